//! JSON-RPC error objects and WebSocket close codes of PROTOCOL.md §2.
//!
//! Every failure that crosses the wire is one of these: handlers return an
//! [`RpcError`] built from an [`ErrorCode`], never a bare string, so a peer can
//! always branch on the code and on `data.reason`.

use serde::{Deserialize, Serialize};

/// The error codes of PROTOCOL.md §2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ErrorCode {
    ParseError = -32700,
    InvalidRequest = -32600,
    MethodNotFound = -32601,
    InvalidParams = -32602,
    InternalError = -32603,
    Unauthorized = -32001,
    Forbidden = -32003,
    NotFound = -32004,
    Timeout = -32008,
    Conflict = -32009,
    LeaseExpired = -32010,
    SessionNotActive = -32011,
    CapabilityUnavailable = -32012,
    PayloadTooLarge = -32013,
    McpUnavailable = -32014,
    ResourceUnavailable = -32015,
    UnsupportedProtocol = -32016,
    Canceled = -32020,
    ExecutorBusy = -32029,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 19] = [
        Self::ParseError,
        Self::InvalidRequest,
        Self::MethodNotFound,
        Self::InvalidParams,
        Self::InternalError,
        Self::Unauthorized,
        Self::Forbidden,
        Self::NotFound,
        Self::Timeout,
        Self::Conflict,
        Self::LeaseExpired,
        Self::SessionNotActive,
        Self::CapabilityUnavailable,
        Self::PayloadTooLarge,
        Self::McpUnavailable,
        Self::ResourceUnavailable,
        Self::UnsupportedProtocol,
        Self::Canceled,
        Self::ExecutorBusy,
    ];

    pub fn code(self) -> i32 {
        self as i32
    }

    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.code() == code)
    }

    /// The snake_case name of PROTOCOL.md §2, used as the default message.
    pub fn name(self) -> &'static str {
        match self {
            Self::ParseError => "parse_error",
            Self::InvalidRequest => "invalid_request",
            Self::MethodNotFound => "method_not_found",
            Self::InvalidParams => "invalid_params",
            Self::InternalError => "internal_error",
            Self::Unauthorized => "unauthorized",
            Self::Forbidden => "forbidden",
            Self::NotFound => "not_found",
            Self::Timeout => "timeout",
            Self::Conflict => "conflict",
            Self::LeaseExpired => "lease_expired",
            Self::SessionNotActive => "session_not_active",
            Self::CapabilityUnavailable => "capability_unavailable",
            Self::PayloadTooLarge => "payload_too_large",
            Self::McpUnavailable => "mcp_unavailable",
            Self::ResourceUnavailable => "resource_unavailable",
            Self::UnsupportedProtocol => "unsupported_protocol",
            Self::Canceled => "canceled",
            Self::ExecutorBusy => "executor_busy",
        }
    }
}

/// `error.data` of a JSON-RPC error: every member optional.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "camelCase")]
pub struct ErrorData {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capability: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_sequence: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminal_code: Option<String>,
}

impl ErrorData {
    pub fn is_empty(&self) -> bool {
        *self == ErrorData::default()
    }
}

/// A JSON-RPC error object, as sent and as received.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[error("{message} (code {code})")]
pub struct RpcError {
    pub code: i32,
    pub message: String,
    /// Boxed: errors travel in `Result`s everywhere, and an unboxed
    /// `ErrorData` would make every `Err` several times larger than `Ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Box<ErrorData>>,
}

impl RpcError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code: code.code(),
            message: message.into(),
            data: None,
        }
    }

    /// The typed code, when it is one of PROTOCOL.md's.
    pub fn kind(&self) -> Option<ErrorCode> {
        ErrorCode::from_code(self.code)
    }

    /// `data.reason`, if any.
    pub fn reason(&self) -> Option<&str> {
        self.data.as_ref().and_then(|d| d.reason.as_deref())
    }

    fn data_mut(&mut self) -> &mut ErrorData {
        self.data.get_or_insert_with(Box::default)
    }

    pub fn with_reason(mut self, reason: impl Into<String>) -> Self {
        self.data_mut().reason = Some(reason.into());
        self
    }

    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.data_mut().detail = Some(detail.into());
        self
    }

    pub fn with_retryable(mut self, retryable: bool) -> Self {
        self.data_mut().retryable = Some(retryable);
        self
    }

    pub fn with_capability(mut self, capability: impl Into<String>) -> Self {
        self.data_mut().capability = Some(capability.into());
        self
    }

    pub fn with_expected_sequence(mut self, seq: u64) -> Self {
        self.data_mut().expected_sequence = Some(seq);
        self
    }

    pub fn with_terminal_code(mut self, code: impl Into<String>) -> Self {
        self.data_mut().terminal_code = Some(code.into());
        self
    }

    pub fn parse_error(detail: impl Into<String>) -> Self {
        Self::new(ErrorCode::ParseError, "parse error").with_detail(detail)
    }

    pub fn invalid_request(reason: &str, message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message).with_reason(reason)
    }

    /// A notification method sent as a request (with an id): refused
    /// -32600 instead of being handled and its responder dropped (-32603).
    pub fn notification_as_request(method: &str) -> Self {
        Self::invalid_request(
            "notification_as_request",
            format!("{method} is a notification: send it without an id"),
        )
    }

    pub fn not_registered() -> Self {
        Self::invalid_request("not_registered", "executor.register must come first")
    }

    pub fn method_not_found(method: &str) -> Self {
        Self::new(
            ErrorCode::MethodNotFound,
            format!("unknown method {method:?}"),
        )
    }

    pub fn invalid_params(detail: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidParams, "invalid params").with_detail(detail)
    }

    pub fn internal(detail: impl Into<String>) -> Self {
        Self::new(ErrorCode::InternalError, "internal error").with_detail(detail)
    }

    pub fn not_found(what: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, what)
    }

    pub fn conflict(reason: &str, message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Conflict, message).with_reason(reason)
    }

    pub fn session_not_active(session_id: &str) -> Self {
        Self::new(
            ErrorCode::SessionNotActive,
            format!("session {session_id:?} is not active"),
        )
    }

    pub fn capability_unavailable(capability: &str) -> Self {
        Self::new(
            ErrorCode::CapabilityUnavailable,
            format!("capability {capability:?} is not offered"),
        )
        .with_capability(capability)
    }

    pub fn payload_too_large(detail: impl Into<String>) -> Self {
        Self::new(ErrorCode::PayloadTooLarge, "payload too large").with_detail(detail)
    }

    pub fn resource_unavailable(detail: impl Into<String>) -> Self {
        Self::new(ErrorCode::ResourceUnavailable, "resource limit reached").with_detail(detail)
    }

    pub fn executor_busy(reason: &str) -> Self {
        Self::new(ErrorCode::ExecutorBusy, "executor busy")
            .with_reason(reason)
            .with_retryable(true)
    }

    pub fn timeout(detail: impl Into<String>) -> Self {
        Self::new(ErrorCode::Timeout, "timeout").with_detail(detail)
    }

    pub fn canceled(detail: impl Into<String>) -> Self {
        Self::new(ErrorCode::Canceled, "canceled").with_detail(detail)
    }
}

/// WebSocket close codes of PROTOCOL.md §2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloseCode {
    Normal,
    GoingAway,
    TooLarge,
    CredentialRejected,
    RegistrationRefused,
    Replaced,
    LeaseExpired,
    ProtocolViolation,
    TokenExpired,
    Other(u16),
}

impl CloseCode {
    pub fn code(self) -> u16 {
        match self {
            Self::Normal => 1000,
            Self::GoingAway => 1001,
            Self::TooLarge => 1009,
            Self::CredentialRejected => 4001,
            Self::RegistrationRefused => 4003,
            Self::Replaced => 4004,
            Self::LeaseExpired => 4008,
            Self::ProtocolViolation => 4009,
            Self::TokenExpired => 4010,
            Self::Other(c) => c,
        }
    }

    pub fn from_code(code: u16) -> Self {
        match code {
            1000 => Self::Normal,
            1001 => Self::GoingAway,
            1009 => Self::TooLarge,
            4001 => Self::CredentialRejected,
            4003 => Self::RegistrationRefused,
            4004 => Self::Replaced,
            4008 => Self::LeaseExpired,
            4009 => Self::ProtocolViolation,
            4010 => Self::TokenExpired,
            c => Self::Other(c),
        }
    }

    /// Whether the executor may reconnect after this close (PROTOCOL.md §3.4).
    pub fn may_reconnect(self) -> bool {
        !matches!(
            self,
            Self::CredentialRejected | Self::RegistrationRefused | Self::Replaced
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for c in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_code(c.code()), Some(c));
        }
        for c in [1000, 1001, 1009, 4001, 4003, 4004, 4008, 4009, 4010, 4999] {
            assert_eq!(CloseCode::from_code(c).code(), c);
        }
    }

    #[test]
    fn final_closes_forbid_reconnect() {
        assert!(!CloseCode::Replaced.may_reconnect());
        assert!(!CloseCode::CredentialRejected.may_reconnect());
        assert!(!CloseCode::RegistrationRefused.may_reconnect());
        assert!(CloseCode::LeaseExpired.may_reconnect());
        assert!(CloseCode::TokenExpired.may_reconnect());
    }

    #[test]
    fn error_serializes_without_empty_data() {
        let e = RpcError::method_not_found("x.y");
        let s = serde_json::to_string(&e).unwrap();
        assert!(!s.contains("data"), "{s}");
        let e = RpcError::executor_busy("draining");
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["data"]["reason"], "draining");
        assert_eq!(v["data"]["retryable"], true);
        assert_eq!(v["code"], -32029);
    }
}

//! API errors: a JSON-RPC error object plus the HTTP status that fits it.
//!
//! The HTTP API answers every failure as `{"error": {code, message, data}}`
//! with the JSON-RPC code of PROTOCOL.md §2 inside; [`status_for`] is the one
//! mapping from code to HTTP status.

use crate::wire::{CallError, ErrorCode, RpcError};
use axum::response::{IntoResponse, Response};
use http::StatusCode;

/// A failed harness operation, for the embedding API and the HTTP API alike.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{error} (HTTP {status})")]
pub struct ApiError {
    /// The HTTP status the API answers with.
    pub status: u16,
    /// The JSON-RPC error object (`code`, `message`, `data`).
    pub error: RpcError,
}

/// The HTTP status for a JSON-RPC error code.
pub fn status_for(code: i32) -> u16 {
    match ErrorCode::from_code(code) {
        Some(ErrorCode::ParseError)
        | Some(ErrorCode::InvalidRequest)
        | Some(ErrorCode::InvalidParams)
        | Some(ErrorCode::MethodNotFound)
        | Some(ErrorCode::UnsupportedProtocol) => 400,
        Some(ErrorCode::Unauthorized) => 401,
        Some(ErrorCode::Forbidden) => 403,
        Some(ErrorCode::NotFound) | Some(ErrorCode::SessionNotActive) => 404,
        Some(ErrorCode::Conflict) | Some(ErrorCode::Canceled) => 409,
        Some(ErrorCode::LeaseExpired) => 410,
        Some(ErrorCode::PayloadTooLarge) => 413,
        Some(ErrorCode::ResourceUnavailable) => 429,
        Some(ErrorCode::CapabilityUnavailable) => 501,
        Some(ErrorCode::McpUnavailable) | Some(ErrorCode::ExecutorBusy) => 503,
        Some(ErrorCode::Timeout) => 504,
        Some(ErrorCode::InternalError) | None => 500,
    }
}

impl ApiError {
    /// An error with the status its code maps to.
    pub fn rpc(error: RpcError) -> Self {
        ApiError {
            status: status_for(error.code),
            error,
        }
    }

    /// An error with an explicit status.
    pub fn with_status(status: u16, error: RpcError) -> Self {
        ApiError { status, error }
    }

    pub fn code(&self) -> i32 {
        self.error.code
    }

    pub fn reason(&self) -> Option<&str> {
        self.error.reason()
    }

    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::rpc(RpcError::invalid_params(detail))
    }

    /// An id that breaks the id rule (docs/protocol.md, "Ids").
    pub fn invalid_id(e: crate::wire::id::IdError) -> Self {
        Self::rpc(RpcError::invalid_params(e.to_string()).with_reason("invalid_id"))
    }

    pub fn unknown_session(session_id: &str) -> Self {
        Self::rpc(RpcError::session_not_active(session_id).with_reason("unknown_session"))
    }

    pub fn session_ended(session_id: &str) -> Self {
        Self::with_status(
            410,
            RpcError::new(
                ErrorCode::SessionNotActive,
                format!("session {session_id:?} has ended"),
            )
            .with_reason("session_ended"),
        )
    }

    /// No executor can take the session (none connected, or all busy).
    pub fn no_executor(detail: impl Into<String>) -> Self {
        Self::with_status(
            503,
            RpcError::new(ErrorCode::ExecutorBusy, "no executor available")
                .with_reason("no_executor")
                .with_retryable(true)
                .with_detail(detail),
        )
    }

    /// The session's executor is disconnected; its lease has not expired
    /// yet, so it may still come back.
    pub fn executor_disconnected(session_id: &str) -> Self {
        Self::with_status(
            503,
            RpcError::new(
                ErrorCode::ExecutorBusy,
                format!("the executor of session {session_id:?} is disconnected"),
            )
            .with_reason("executor_disconnected")
            .with_retryable(true),
        )
    }

    /// The executor holding a tool call was lost and its lease expired: the
    /// call may or may not have run.
    pub fn tool_outcome_unknown(tool_call_id: &str) -> Self {
        Self::with_status(
            502,
            RpcError::new(
                ErrorCode::LeaseExpired,
                format!("the executor was lost while tool call {tool_call_id:?} was in flight"),
            )
            .with_reason("tool_outcome_unknown"),
        )
    }

    pub fn unauthorized() -> Self {
        Self::rpc(RpcError::new(
            ErrorCode::Unauthorized,
            "missing or wrong API token",
        ))
    }

    pub fn not_found(what: impl Into<String>) -> Self {
        Self::rpc(RpcError::not_found(what))
    }

    pub fn internal(detail: impl Into<String>) -> Self {
        Self::rpc(RpcError::internal(detail))
    }

    /// The failure of a request sent to an executor.
    pub fn from_call(e: CallError) -> Self {
        match e {
            CallError::Rpc(e) => Self::rpc(e),
            CallError::Timeout(d) => Self::rpc(RpcError::timeout(format!(
                "the executor did not answer within {d:?}"
            ))),
            CallError::Closed => Self::with_status(
                502,
                RpcError::new(ErrorCode::InternalError, "the executor connection closed")
                    .with_reason("executor_lost")
                    .with_retryable(true),
            ),
            // Refused before sending: the executor never saw it.
            CallError::TooLarge { size, limit } => Self::rpc(
                RpcError::payload_too_large(format!(
                    "the request's frame is {size} bytes; the executor accepts at most {limit}"
                ))
                .with_reason("frame_too_large"),
            ),
            CallError::Decode(d) => Self::with_status(
                502,
                RpcError::internal(format!("undecodable executor answer: {d}"))
                    .with_reason("bad_executor_answer"),
            ),
        }
    }
}

impl From<RpcError> for ApiError {
    fn from(e: RpcError) -> Self {
        ApiError::rpc(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::json!({ "error": self.error });
        (status, axum::Json(body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_issue() {
        assert_eq!(status_for(-32602), 400);
        assert_eq!(status_for(-32004), 404);
        assert_eq!(status_for(-32011), 404);
        assert_eq!(status_for(-32009), 409);
        assert_eq!(status_for(-32010), 410);
        assert_eq!(status_for(-32029), 503);
        assert_eq!(status_for(-32008), 504);
        assert_eq!(ApiError::tool_outcome_unknown("t").status, 502);
        assert_eq!(
            ApiError::tool_outcome_unknown("t").reason(),
            Some("tool_outcome_unknown")
        );
    }
}

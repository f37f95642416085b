//! The JSON-line envelope of every `--json` answer (RUNNER.md §3):
//!
//! ```text
//! {"schema_version":1,"ok":true,"data":{...},"trace":{"request_id":"…","target_id":"…","source":"bmx"}}
//! {"schema_version":1,"ok":false,"error":{"code":"TARGET_NOT_FOUND","message":"…"},"trace":{…}}
//! ```
//!
//! One line per response, so a tool reads it with one `readline` and one
//! parse whatever the command; the same shape for success and failure, so
//! it checks `ok` before anything else. The codes are a closed enum: a
//! caller can switch on them, and a new one is a schema change
//! (`docs/schemas/envelope.json`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Bumped only on an incompatible change of the envelope or of a `data`
/// shape.
pub const SCHEMA_VERSION: u32 = 1;

/// The error codes of the agent protocol, exactly these (RUNNER.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// The request itself is wrong (bad arguments, an API answer that is
    /// not what the protocol says).
    #[serde(rename = "AGENT_PROTOCOL_ERROR")]
    AgentProtocol,
    /// Targets could not be listed (the state root is unreadable).
    TargetDiscoveryFailed,
    /// A target is needed and none was given or none is known.
    TargetMissing,
    /// `--target ID` names no known target.
    TargetNotFound,
    /// A command on a target failed (the harness of `bmx ps` is down).
    TargetExecFailed,
    /// The status of an environment could not be determined (a corrupt or
    /// missing state file).
    #[serde(rename = "ENVIRONMENT_STATUS_FAILED")]
    EnvironmentStatus,
    /// `env start|stop|restart` was attempted and failed.
    #[serde(rename = "ENVIRONMENT_OPERATION_FAILED")]
    EnvironmentOperation,
}

impl ErrorCode {
    /// The wire spelling (`TARGET_NOT_FOUND`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::AgentProtocol => "AGENT_PROTOCOL_ERROR",
            ErrorCode::TargetDiscoveryFailed => "TARGET_DISCOVERY_FAILED",
            ErrorCode::TargetMissing => "TARGET_MISSING",
            ErrorCode::TargetNotFound => "TARGET_NOT_FOUND",
            ErrorCode::TargetExecFailed => "TARGET_EXEC_FAILED",
            ErrorCode::EnvironmentStatus => "ENVIRONMENT_STATUS_FAILED",
            ErrorCode::EnvironmentOperation => "ENVIRONMENT_OPERATION_FAILED",
        }
    }

    /// Every code, for the schema test.
    pub const ALL: [ErrorCode; 7] = [
        ErrorCode::AgentProtocol,
        ErrorCode::TargetDiscoveryFailed,
        ErrorCode::TargetMissing,
        ErrorCode::TargetNotFound,
        ErrorCode::TargetExecFailed,
        ErrorCode::EnvironmentStatus,
        ErrorCode::EnvironmentOperation,
    ];
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failure to report: a code and a message for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ResponseError {
    pub code: ErrorCode,
    pub message: String,
}

impl ResponseError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ResponseError {
        ResponseError {
            code,
            message: message.into(),
        }
    }
}

/// Who answered and about what, for correlating a line with logs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseTrace {
    /// Fresh per response (a UUID).
    pub request_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_id: Option<String>,
    /// Always `bmx`.
    pub source: String,
}

/// One response line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    pub schema_version: u32,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ResponseError>,
    pub trace: ResponseTrace,
}

fn trace(target_id: Option<&str>) -> ResponseTrace {
    ResponseTrace {
        request_id: uuid::Uuid::new_v4().to_string(),
        target_id: target_id.map(str::to_owned),
        source: "bmx".into(),
    }
}

impl Response {
    /// `ok: true` with `data` (serialized here; a value that cannot be
    /// serialized becomes an `AGENT_PROTOCOL_ERROR` failure, not a panic).
    pub fn success(data: &impl Serialize, target_id: Option<&str>) -> Response {
        match serde_json::to_value(data) {
            Ok(data) => Response {
                schema_version: SCHEMA_VERSION,
                ok: true,
                data: Some(data),
                error: None,
                trace: trace(target_id),
            },
            Err(e) => Response::failure(
                ResponseError::new(ErrorCode::AgentProtocol, format!("cannot encode: {e}")),
                target_id,
            ),
        }
    }

    /// `ok: false` with `error`.
    pub fn failure(error: ResponseError, target_id: Option<&str>) -> Response {
        Response {
            schema_version: SCHEMA_VERSION,
            ok: false,
            data: None,
            error: Some(error),
            trace: trace(target_id),
        }
    }

    /// The line, without its newline. Never fails: the fields are plain
    /// data already.
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| {
            format!(
                r#"{{"schema_version":{SCHEMA_VERSION},"ok":false,"error":{{"code":"AGENT_PROTOCOL_ERROR","message":{}}},"trace":{{"request_id":"","source":"bmx"}}}}"#,
                Value::String(e.to_string())
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_spell_as_the_contract_says() {
        let spelled: Vec<String> = ErrorCode::ALL
            .iter()
            .map(|c| {
                serde_json::to_value(c)
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(
            spelled,
            [
                "AGENT_PROTOCOL_ERROR",
                "TARGET_DISCOVERY_FAILED",
                "TARGET_MISSING",
                "TARGET_NOT_FOUND",
                "TARGET_EXEC_FAILED",
                "ENVIRONMENT_STATUS_FAILED",
                "ENVIRONMENT_OPERATION_FAILED"
            ]
        );
        for c in ErrorCode::ALL {
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
    }

    #[test]
    fn lines_are_one_line_with_either_data_or_error() {
        let ok = Response::success(&serde_json::json!({"a": "x\ny"}), Some("local"));
        let line = ok.to_line();
        assert!(!line.contains('\n'));
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["schema_version"], 1);
        assert_eq!(v["ok"], true);
        assert_eq!(v["data"]["a"], "x\ny");
        assert!(v.get("error").is_none());
        assert_eq!(v["trace"]["target_id"], "local");
        assert_eq!(v["trace"]["source"], "bmx");

        let bad = Response::failure(
            ResponseError::new(ErrorCode::TargetNotFound, "no target nope"),
            None,
        );
        let v: Value = serde_json::from_str(&bad.to_line()).unwrap();
        assert_eq!(v["ok"], false);
        assert_eq!(v["error"]["code"], "TARGET_NOT_FOUND");
        assert!(v.get("data").is_none());
        assert!(v["trace"].get("target_id").is_none());
        assert_ne!(
            v["trace"]["request_id"],
            serde_json::from_str::<Value>(&ok.to_line()).unwrap()["trace"]["request_id"]
        );
    }
}

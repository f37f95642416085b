//! One MCP JSON-RPC message as a relay sees it: its kind and id.

use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;

/// JSON-RPC error codes inside MCP payloads.
pub mod code {
    pub const PARSE_ERROR: i64 = -32700;
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INTERNAL_ERROR: i64 = -32603;
    /// The request's deadline passed (the MCP SDKs use -32001 for this).
    pub const TIMEOUT: i64 = -32001;
}

/// What a message is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// Has a `method` and an `id`.
    Request { id: String, method: String },
    /// Has a `method` and no `id`.
    Notification { method: String },
    /// Has an `id` and a `result` or an `error`.
    Response { id: String },
}

/// A message that cannot be relayed, and the error response it gets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct McpError {
    pub code: i64,
    pub message: String,
    /// The id to answer, as JSON text (`null` when it could not be read).
    pub id: String,
    pub reason: &'static str,
}

impl McpError {
    /// The JSON-RPC error response for it.
    pub fn response(&self) -> String {
        error_response(&self.id, self.code, &self.message, self.reason)
    }
}

#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(borrow, default)]
    jsonrpc: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    method: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    result: Option<&'a RawValue>,
    #[serde(borrow, default)]
    error: Option<&'a RawValue>,
}

/// The envelope of one message: enough to route it, nothing more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub kind: Kind,
    pub is_error: bool,
}

/// Read the envelope of `payload` (one JSON-RPC 2.0 message).
pub fn parse(payload: &str) -> Result<Envelope, McpError> {
    let invalid = |id: &str, message: &str| McpError {
        code: code::INVALID_REQUEST,
        message: message.to_owned(),
        id: id.to_owned(),
        reason: "invalid_request",
    };
    let trimmed = payload.trim_start();
    if trimmed.starts_with('[') {
        // Batches left MCP in 2025-06-18.
        return Err(invalid("null", "JSON-RPC batches are not supported"));
    }
    let wire: Wire = serde_json::from_str(payload).map_err(|e| McpError {
        code: code::PARSE_ERROR,
        message: format!("not a JSON-RPC message: {e}"),
        id: "null".into(),
        reason: "parse_error",
    })?;
    let id = match wire.id {
        Some(raw) => {
            let text = raw.get();
            if !(text.starts_with('"')
                || text.starts_with('-')
                || text.as_bytes()[0].is_ascii_digit())
            {
                return Err(invalid("null", "id must be a string or a number"));
            }
            Some(text.to_owned())
        }
        None => None,
    };
    let id_text = id.clone().unwrap_or_else(|| "null".to_owned());
    if wire.jsonrpc.as_deref() != Some("2.0") {
        return Err(invalid(&id_text, "jsonrpc must be \"2.0\""));
    }
    let kind = match (
        wire.method,
        id,
        wire.result.is_some() || wire.error.is_some(),
    ) {
        (Some(method), Some(id), false) => Kind::Request {
            id,
            method: method.into_owned(),
        },
        (Some(method), None, false) => Kind::Notification {
            method: method.into_owned(),
        },
        (None, Some(id), true) => Kind::Response { id },
        _ => return Err(invalid(&id_text, "not a request, notification or response")),
    };
    Ok(Envelope {
        kind,
        is_error: wire.error.is_some(),
    })
}

/// A JSON-RPC error response; `id` is JSON text (`"a"`, `7`, `null`).
pub fn error_response(id: &str, code: i64, message: &str, reason: &str) -> String {
    serde_json::json!({
        "jsonrpc": "2.0",
        "id": serde_json::from_str::<serde_json::Value>(id).unwrap_or(serde_json::Value::Null),
        "error": {"code": code, "message": message, "data": {"reason": reason}},
    })
    .to_string()
}

/// A JSON-RPC result response; `id` and `result` are JSON text.
pub fn result_response(id: &str, result: &str) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{result}}}"#)
}

/// The `id` of a message too large to relay, read without keeping the rest.
pub fn id_of(payload: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct IdOnly<'a> {
        #[serde(borrow, default)]
        id: Option<&'a RawValue>,
    }
    let only: IdOnly = serde_json::from_str(payload).ok()?;
    only.id.map(|r| r.get().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds() {
        let r = parse(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#).unwrap();
        assert_eq!(
            r.kind,
            Kind::Request {
                id: "1".into(),
                method: "tools/list".into()
            }
        );
        let n = parse(r#"{"method":"notifications/initialized","jsonrpc":"2.0"}"#).unwrap();
        assert!(matches!(n.kind, Kind::Notification { .. }));
        let s = parse(r#"{"result":{},"jsonrpc":"2.0","id":"x"}"#).unwrap();
        assert_eq!(s.kind, Kind::Response { id: "\"x\"".into() });
        let e = parse(r#"{"error":{"code":1,"message":"m"},"jsonrpc":"2.0","id":2}"#).unwrap();
        assert!(e.is_error);
    }

    #[test]
    fn bad_messages_get_typed_errors_with_their_id() {
        let e = parse("{nope").unwrap_err();
        assert_eq!((e.code, e.id.as_str()), (code::PARSE_ERROR, "null"));
        let e = parse(r#"{"jsonrpc":"1.0","id":3,"method":"x"}"#).unwrap_err();
        assert_eq!((e.code, e.id.as_str()), (code::INVALID_REQUEST, "3"));
        let e = parse(r#"[{"jsonrpc":"2.0","id":1,"method":"x"}]"#).unwrap_err();
        assert_eq!(e.code, code::INVALID_REQUEST);
        let e = parse(r#"{"jsonrpc":"2.0","id":{"a":1},"method":"x"}"#).unwrap_err();
        assert_eq!(e.code, code::INVALID_REQUEST);
        // `"id": null` reads as no id: a notification.
        let n = parse(r#"{"jsonrpc":"2.0","id":null,"method":"x"}"#).unwrap();
        assert!(matches!(n.kind, Kind::Notification { .. }));
        let e = parse(r#"{"jsonrpc":"2.0"}"#).unwrap_err();
        assert_eq!(e.code, code::INVALID_REQUEST);
        let v: serde_json::Value = serde_json::from_str(&e.response()).unwrap();
        assert_eq!(v["error"]["data"]["reason"], "invalid_request");
    }

    #[test]
    fn id_of_a_large_message() {
        let big = format!(
            r#"{{"result":{{"text":"{}"}},"jsonrpc":"2.0","id":"k"}}"#,
            "x".repeat(10_000)
        );
        assert_eq!(id_of(&big).as_deref(), Some("\"k\""));
    }
}

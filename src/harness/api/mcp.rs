//! MCP servers as the platform sees them: the `mcpServers` of
//! `POST /v1/sessions` (validated and bounded here, before anything is
//! sent), their state from the executor's `session.status`, and the tool
//! list the harness fetched over the channel (`GET /v1/sessions/{id}/mcp`).
//!
//! `secretEnv` values go to the executor in `session.assign` and nowhere
//! else: what the harness keeps and shows is [`redact`]ed (the key names
//! stay, every value is `"<redacted>"`), so no listing, event or log line
//! can carry one.

use crate::harness::error::ApiError;
use crate::harness::runtime::Shared;
use crate::harness::types::SessionState;
use crate::wire::types::{
    ConnectionOrigin, McpRestartBudget, McpServerSpec, McpServerState, McpServerStatus,
    McpTransport, McpTransportType,
};
use crate::wire::RpcError;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};

/// MCP servers one session may have.
pub const MAX_MCP_SERVERS: usize = 32;
/// What a redacted secret value reads as.
pub const REDACTED: &str = "<redacted>";
/// The whole `mcpServers` array, as JSON, at most (it travels in
/// `session.assign`, a control frame).
const MAX_SPECS_BYTES: usize = 256 << 10;
const MAX_PATH_CHARS: usize = 4096;
const MAX_ARGS: usize = 256;
const MAX_ENV: usize = 256;
const MAX_VALUE_BYTES: usize = 32 << 10;

/// One tool of a server, as `tools/list` gave it (bounded: see
/// [`crate::harness::actors::mcp`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct McpToolInfo {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<serde_json::Value>,
}

/// A server's tool list, published by its channel actor.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct McpToolsView {
    pub tools: Vec<McpToolInfo>,
    /// The list was cut at the harness's bounds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// When the list was last fetched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
    /// Why the last `tools/list` failed (the list kept is the one before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One MCP server of a session, in [`SessionInfo`](crate::harness::SessionInfo)
/// and `GET /v1/sessions/{id}/mcp`: its spec (redacted) and its last state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct McpServerInfo {
    pub server_key: String,
    pub connection_origin: ConnectionOrigin,
    /// The transport as given, `secretEnv` values replaced by `"<redacted>"`.
    pub transport: McpTransport,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_budget: Option<McpRestartBudget>,
    /// `starting` until the executor reports otherwise.
    pub state: McpServerState,
    #[serde(default)]
    pub restarts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

impl McpServerInfo {
    /// A server as created: its redacted spec, `starting`.
    pub fn from_spec(spec: &McpServerSpec) -> Self {
        McpServerInfo {
            server_key: spec.server_key.clone(),
            connection_origin: spec.connection_origin,
            transport: redact(&spec.transport),
            restart_budget: spec.restart_budget,
            state: McpServerState::Starting,
            restarts: 0,
            reason: None,
            last_error: None,
        }
    }

    /// Take the executor's report.
    pub fn update(&mut self, s: &McpServerStatus) {
        self.state = s.state;
        self.restarts = s.restarts;
        self.reason = s.reason.clone();
        self.last_error = s.last_error.clone();
    }
}

/// A server with its tools (`GET /v1/sessions/{id}/mcp`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct McpServerView {
    #[serde(flatten)]
    pub server: McpServerInfo,
    pub tools: Vec<McpToolInfo>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tools_truncated: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools_updated_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools_error: Option<String>,
}

/// The transport with every `secretEnv` value replaced.
pub fn redact(t: &McpTransport) -> McpTransport {
    let mut t = t.clone();
    if let Some(secrets) = &mut t.secret_env {
        for v in secrets.values_mut() {
            *v = REDACTED.to_owned();
        }
    }
    t
}

fn bad(detail: impl Into<String>) -> ApiError {
    ApiError::bad_request(detail)
}

/// Whether `key` is a valid `serverKey`: `[A-Za-z0-9_-]{1,64}`.
pub fn valid_server_key(key: &str) -> bool {
    (1..=64).contains(&key.len())
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn check_str(what: &str, s: &str, max: usize) -> Result<(), ApiError> {
    if s.len() > max {
        return Err(bad(format!("{what} is longer than {max} bytes")));
    }
    if s.contains('\0') {
        return Err(bad(format!("{what} contains a NUL byte")));
    }
    Ok(())
}

fn check_env(what: &str, env: &Option<BTreeMap<String, String>>) -> Result<(), ApiError> {
    let Some(env) = env else { return Ok(()) };
    if env.len() > MAX_ENV {
        return Err(bad(format!("{what} has more than {MAX_ENV} entries")));
    }
    for (k, v) in env {
        if k.is_empty() || k.contains('=') {
            return Err(bad(format!("{what} has an invalid name")));
        }
        // The name may be shown; the value is never put in an error.
        check_str(&format!("a name of {what}"), k, 256)?;
        check_str(&format!("{what}.{k}"), v, MAX_VALUE_BYTES)?;
    }
    Ok(())
}

/// `POST /v1/sessions/{id}/mcp-services`: where a `service` server is.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceRegistration {
    pub server_key: String,
    /// The service's Streamable HTTP MCP endpoint (`http://` or `https://`).
    pub url: String,
    /// How long one request may take (1 to 3 600 000; default 60 000).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// Register (or replace) the `service` server `serverKey` of a session.
/// A replaced registration's actor is stopped: its requests in flight are
/// answered with an error and the next `mcp.open` reaches the new URL.
///
/// # Errors
///
/// 404 for an unknown session (-32011) or a key the session has no
/// `service` server for (-32014, `reason: unknown_server`), 410 for an
/// ended session, 400 for a bad url or timeout (checked before the
/// session is looked up; the url is never echoed).
pub fn register_service(
    shared: &Shared,
    session_id: &str,
    reg: ServiceRegistration,
) -> Result<(), ApiError> {
    // The body first: a bad registration is a 400 whatever the session's
    // state, and nothing is looked up for it.
    check_str("url", &reg.url, MAX_PATH_CHARS)?;
    if !(reg.url.starts_with("http://") || reg.url.starts_with("https://")) {
        return Err(bad("url must be an http:// or https:// URL"));
    }
    if reg.timeout_ms.is_some_and(|ms| ms == 0 || ms > 3_600_000) {
        return Err(bad("timeoutMs must be 1 to 3600000"));
    }
    {
        let info = shared
            .sessions
            .get(session_id)
            .ok_or_else(|| ApiError::unknown_session(session_id))?;
        if info.state == SessionState::Ended {
            return Err(ApiError::session_ended(session_id));
        }
        if !info.mcp_servers.iter().any(|s| {
            s.server_key == reg.server_key && s.connection_origin == ConnectionOrigin::Service
        }) {
            return Err(ApiError::with_status(
                404,
                RpcError::new(
                    crate::wire::ErrorCode::McpUnavailable,
                    format!(
                        "session {session_id:?} has no service MCP server {:?}",
                        reg.server_key
                    ),
                )
                .with_reason("unknown_server"),
            ));
        }
    }
    let timeout = reg
        .timeout_ms
        .map(std::time::Duration::from_millis)
        .unwrap_or(crate::harness::actors::mcp_service::DEFAULT_TIMEOUT);
    shared.mcp_services.insert(
        (session_id.to_owned(), reg.server_key.clone()),
        crate::harness::actors::mcp_service::ServiceReg {
            url: reg.url,
            timeout,
        },
    );
    crate::harness::actors::mcp_service::stop(shared, session_id, Some(&reg.server_key));
    tracing::info!(session = %session_id, server = %reg.server_key, "mcp service registered");
    Ok(())
}

/// Check the `mcpServers` of a session before they are sent.
///
/// # Errors
///
/// 400 (-32602) naming the first problem: more than [`MAX_MCP_SERVERS`],
/// a bad or repeated `serverKey`, a `service` origin (not offered by this
/// harness: `reason: unsupported_origin`), a transport missing what its
/// type needs (`command` for stdio, an `http(s)://` `url` for http), a
/// malformed `commandSha256`, or a field past its bound. Error texts name
/// fields, never a value.
pub fn validate_specs(specs: &[McpServerSpec]) -> Result<(), ApiError> {
    if specs.len() > MAX_MCP_SERVERS {
        return Err(bad(format!(
            "at most {MAX_MCP_SERVERS} mcpServers per session"
        )));
    }
    let mut keys = HashSet::new();
    for s in specs {
        if !valid_server_key(&s.server_key) {
            return Err(bad("a serverKey must match [A-Za-z0-9_-]{1,64}"));
        }
        if !keys.insert(s.server_key.as_str()) {
            return Err(bad(format!("serverKey {:?} is repeated", s.server_key)));
        }
        let key = &s.server_key;
        let t = &s.transport;
        if s.connection_origin == ConnectionOrigin::Service {
            // The platform runs it: the executor only needs its key. Where
            // it is comes later (`POST .../mcp-services`) and stays on the
            // harness.
            if t.kind != McpTransportType::Http
                || t.url.is_some()
                || t.command.is_some()
                || t.args.is_some()
                || t.env.is_some()
                || t.secret_env.is_some()
            {
                return Err(ApiError::rpc(
                    RpcError::invalid_params(format!(
                        "mcpServers[{key}]: a service server has transport {{\"type\": \"http\"}} only; register its url with POST /v1/sessions/{{id}}/mcp-services"
                    ))
                    .with_reason("service_spec"),
                ));
            }
            continue;
        }
        match t.kind {
            McpTransportType::Stdio => {
                let Some(command) = t.command.as_deref().filter(|c| !c.is_empty()) else {
                    return Err(bad(format!(
                        "mcpServers[{key}]: a stdio transport needs a command"
                    )));
                };
                check_str(
                    &format!("mcpServers[{key}].command"),
                    command,
                    MAX_PATH_CHARS,
                )?;
            }
            McpTransportType::Http => {
                let Some(url) = t.url.as_deref() else {
                    return Err(bad(format!(
                        "mcpServers[{key}]: an http transport needs a url"
                    )));
                };
                check_str(&format!("mcpServers[{key}].url"), url, MAX_PATH_CHARS)?;
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(bad(format!(
                        "mcpServers[{key}].url must be an http:// or https:// URL"
                    )));
                }
            }
        }
        if let Some(args) = &t.args {
            if args.len() > MAX_ARGS {
                return Err(bad(format!(
                    "mcpServers[{key}].args has more than {MAX_ARGS} entries"
                )));
            }
            for a in args {
                check_str(&format!("mcpServers[{key}].args"), a, MAX_VALUE_BYTES)?;
            }
        }
        if let Some(cwd) = &t.cwd {
            check_str(&format!("mcpServers[{key}].cwd"), cwd, MAX_PATH_CHARS)?;
        }
        check_env(&format!("mcpServers[{key}].env"), &t.env)?;
        check_env(&format!("mcpServers[{key}].secretEnv"), &t.secret_env)?;
        if let Some(sha) = &t.command_sha256 {
            if sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad(format!(
                    "mcpServers[{key}].commandSha256 must be 64 hex digits"
                )));
            }
        }
        if t.timeout_ms.is_some_and(|ms| ms == 0 || ms > 3_600_000) {
            return Err(bad(format!(
                "mcpServers[{key}].timeoutMs must be 1 to 3600000"
            )));
        }
        if let Some(b) = &s.restart_budget {
            if b.max_restarts > 1_000 || b.window_ms == 0 || b.window_ms > 86_400_000 {
                return Err(bad(format!(
                    "mcpServers[{key}].restartBudget: maxRestarts at most 1000, windowMs 1 to 86400000"
                )));
            }
        }
    }
    let size = serde_json::to_vec(specs)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    if size > MAX_SPECS_BYTES {
        return Err(ApiError::rpc(RpcError::payload_too_large(format!(
            "mcpServers is larger than {MAX_SPECS_BYTES} bytes"
        ))));
    }
    Ok(())
}

/// The servers of a session with their tools.
///
/// # Errors
///
/// 404 for an unknown session.
pub fn list(shared: &Shared, session_id: &str) -> Result<Vec<McpServerView>, ApiError> {
    let info = shared
        .sessions
        .get(session_id)
        .map(|s| s.clone())
        .ok_or_else(|| ApiError::unknown_session(session_id))?;
    let live = info.state != SessionState::Ended;
    Ok(info
        .mcp_servers
        .into_iter()
        .map(|server| {
            let tools = live
                .then(|| {
                    shared
                        .mcp_tools
                        .get(&(session_id.to_owned(), server.server_key.clone()))
                        .map(|t| t.clone())
                })
                .flatten()
                .unwrap_or_default();
            McpServerView {
                server,
                tools: tools.tools,
                tools_truncated: tools.truncated,
                tools_updated_at: tools.updated_at,
                tools_error: tools.error,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(key: &str) -> McpServerSpec {
        McpServerSpec {
            server_key: key.into(),
            connection_origin: ConnectionOrigin::Environment,
            transport: McpTransport {
                kind: McpTransportType::Stdio,
                command: Some("npx".into()),
                args: Some(vec!["server".into()]),
                cwd: None,
                env: None,
                secret_env: Some(BTreeMap::from([("API_KEY".into(), "s3cr3t".into())])),
                command_sha256: None,
                url: None,
                timeout_ms: None,
            },
            restart_budget: None,
        }
    }

    #[test]
    fn keys_are_checked_and_unique() {
        assert!(validate_specs(&[spec("fs"), spec("every_thing-2")]).is_ok());
        for bad in ["", "a b", "a/b", "é", &"x".repeat(65)] {
            assert_eq!(
                validate_specs(&[spec(bad)]).unwrap_err().status,
                400,
                "{bad:?}"
            );
        }
        assert_eq!(
            validate_specs(&[spec("a"), spec("a")]).unwrap_err().status,
            400
        );
        let many: Vec<_> = (0..=MAX_MCP_SERVERS)
            .map(|i| spec(&format!("s{i}")))
            .collect();
        assert_eq!(validate_specs(&many).unwrap_err().status, 400);
    }

    #[test]
    fn transports_need_what_their_type_needs() {
        let mut s = spec("a");
        s.transport.command = None;
        assert!(validate_specs(&[s]).is_err());
        let mut s = spec("a");
        s.transport.kind = McpTransportType::Http;
        assert!(validate_specs(std::slice::from_ref(&s)).is_err());
        s.transport.url = Some("ftp://x".into());
        assert!(validate_specs(std::slice::from_ref(&s)).is_err());
        s.transport.url = Some("http://127.0.0.1:1/mcp".into());
        assert!(validate_specs(std::slice::from_ref(&s)).is_ok());
        let mut s = spec("a");
        s.transport.command_sha256 = Some("zz".into());
        assert!(validate_specs(&[s]).is_err());
        let mut s = spec("a");
        s.connection_origin = ConnectionOrigin::Service;
        assert_eq!(
            validate_specs(std::slice::from_ref(&s))
                .unwrap_err()
                .reason(),
            Some("service_spec")
        );
        s.transport = McpTransport {
            kind: McpTransportType::Http,
            ..spec("a").transport
        };
        s.transport.command = None;
        s.transport.args = None;
        s.transport.secret_env = None;
        assert!(validate_specs(std::slice::from_ref(&s)).is_ok());
        s.transport.url = Some("http://127.0.0.1:1/mcp".into());
        assert_eq!(
            validate_specs(&[s]).unwrap_err().reason(),
            Some("service_spec")
        );
    }

    #[test]
    fn secret_values_never_survive_redaction_or_errors() {
        let s = spec("a");
        let info = McpServerInfo::from_spec(&s);
        let text = serde_json::to_string(&info).unwrap();
        assert!(!text.contains("s3cr3t"), "{text}");
        assert!(text.contains("API_KEY") && text.contains(REDACTED));
        let mut s = spec("a");
        s.transport.secret_env = Some(BTreeMap::from([("K".into(), "x\0secret".into())]));
        let e = validate_specs(&[s]).unwrap_err();
        assert!(!e.to_string().contains("secret\""), "{e}");
        assert!(!format!("{:?}", e.error).contains("x\\0secret"));
    }
}

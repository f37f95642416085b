//! A `service`-origin MCP server as the session's processes see it: a
//! Streamable HTTP endpoint on a loopback port, its URL in their
//! environment as `BMX_MCP_<KEY>_URL`, whose messages travel to the harness
//! as `mcp.frame`s (the platform runs the server; the harness reaches it,
//! [`crate::harness::actors::mcp_service`]).
//!
//! The URL carries a random path segment (128 bits): another user of the
//! machine can connect to a loopback port, but only a process that was
//! given the session's environment knows the path.
//!
//! - `POST`: one JSON-RPC message. A request's id is rewritten to one of
//!   the tunnel's own (`"s:<n>"`, unique for the tunnel's life: many
//!   processes may use one endpoint) and put back in the answer, which is
//!   one `application/json` body. Notifications and responses get 202.
//! - `GET` (the server's own stream) and `DELETE`: 405, as the transport
//!   allows; server notifications are not delivered (there is no stream to
//!   carry them), progress neither.
//!
//! Bounds: a body of at most `max` bytes (413 before it is parsed),
//! [`MAX_IN_FLIGHT`] requests at once (429 past it), every request answered
//! within [`REQUEST_TIMEOUT`] (-32001 past it), and a harness that refuses
//! the channel (`mcp.open` -32014: no service registered, or the service is
//! down) or is not connected answers as an MCP error, never a hang.

use crate::executor::Shared;
use crate::mcp::message::{self, code, Kind};
use crate::wire::types::{McpFrameParams, McpOpenParams, McpOpenResult};
use crate::wire::{CallError, Link, Method};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, Semaphore};
use tokio_util::sync::CancellationToken;

/// Requests in flight through one tunnel at once.
pub const MAX_IN_FLIGHT: usize = 64;
/// How long a request may wait for its answer (the service's own
/// `timeoutMs` on the harness is usually shorter and answers first).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// How long `mcp.open` toward the harness may take (it waits for the
/// service's `initialize`).
const OPEN_TIMEOUT: Duration = Duration::from_secs(30);
/// The id prefix of the tunnel's requests.
const ID_PREFIX: &str = "s:";

/// The environment variable that holds the URL of service `key`:
/// `BMX_MCP_<KEY>_URL`, the key upper-cased, anything not alphanumeric as
/// `_`.
pub fn env_name(key: &str) -> String {
    let key: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("BMX_MCP_{key}_URL")
}

pub struct Tunnel {
    shared: Arc<Shared>,
    session_id: String,
    key: String,
    url: String,
    max: usize,
    /// Our id (JSON text) → the request waiting for its answer.
    waiting: Mutex<HashMap<String, oneshot::Sender<String>>>,
    next: AtomicU64,
    /// The link the channel was opened on (a new connection opens again).
    opened_on: tokio::sync::Mutex<Option<Link>>,
    permits: Arc<Semaphore>,
    cancel: CancellationToken,
}

fn rpc_http(status: StatusCode, id: &str, code: i64, text: &str, reason: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        message::error_response(id, code, text, reason),
    )
        .into_response()
}

fn json(body: String) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

impl Tunnel {
    /// Bind the endpoint and serve it until [`Tunnel::stop`].
    pub async fn start(
        shared: Arc<Shared>,
        session_id: &str,
        key: &str,
        max: usize,
    ) -> std::io::Result<Arc<Tunnel>> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let port = listener.local_addr()?.port();
        let secret = format!("{:032x}", rand::random::<u128>());
        let tunnel = Arc::new(Tunnel {
            shared,
            session_id: session_id.to_owned(),
            key: key.to_owned(),
            url: format!("http://127.0.0.1:{port}/{secret}/mcp"),
            max,
            waiting: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            opened_on: tokio::sync::Mutex::new(None),
            permits: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            cancel: CancellationToken::new(),
        });
        let app = axum::Router::new()
            .route(
                &format!("/{secret}/mcp"),
                axum::routing::post(post)
                    .get(not_allowed)
                    .delete(not_allowed),
            )
            // The handler bounds the body itself (413 with a JSON-RPC body).
            .layer(axum::extract::DefaultBodyLimit::disable())
            .with_state(tunnel.clone());
        let cancel = tunnel.cancel.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(cancel.cancelled_owned())
                .await;
        });
        tracing::debug!(session = %session_id, server = %key, port, "mcp service endpoint bound");
        Ok(tunnel)
    }

    /// What the session's processes get as `BMX_MCP_<KEY>_URL`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Stop serving; requests still waiting are answered (their waiters
    /// are dropped).
    pub fn stop(&self) {
        self.cancel.cancel();
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, oneshot::Sender<String>>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An `mcp.frame` from the harness: the answer to one of our requests
    /// (anything else has nowhere to go and is dropped, logged).
    pub fn from_harness(&self, payload: String) {
        match message::parse(&payload).map(|e| e.kind) {
            Ok(Kind::Response { id }) => match self.lock().remove(&id) {
                Some(tx) => {
                    let _ = tx.send(payload);
                }
                None => {
                    tracing::debug!(server = %self.key, "mcp service answer to no request waiting: dropped")
                }
            },
            Ok(_) => {
                tracing::debug!(server = %self.key, "mcp service notification or request: no stream to carry it, dropped")
            }
            Err(_) => {
                tracing::debug!(server = %self.key, "mcp service frame that is not JSON-RPC: dropped")
            }
        }
    }

    /// The link to the harness, with the channel open on it.
    async fn channel(&self) -> Result<Link, (i64, String, &'static str)> {
        let Some(link) = self.shared.link() else {
            return Err((
                code::INTERNAL_ERROR,
                "the executor is not connected to its harness".into(),
                "executor_disconnected",
            ));
        };
        let mut opened = self.opened_on.lock().await;
        if opened
            .as_ref()
            .is_some_and(|l| l.same_as(&link) && !l.is_closed())
        {
            return Ok(link);
        }
        let params = McpOpenParams {
            session_id: self.session_id.clone(),
            server_key: self.key.clone(),
        };
        match link
            .request::<_, McpOpenResult>(Method::McpOpen, &params, OPEN_TIMEOUT)
            .await
        {
            Ok(r) if r.opened => {
                *opened = Some(link.clone());
                Ok(link)
            }
            Ok(_) => Err((
                i64::from(crate::wire::ErrorCode::McpUnavailable.code()),
                "the harness did not open the channel".into(),
                "not_opened",
            )),
            Err(CallError::Rpc(e)) => {
                let reason = match e.reason() {
                    Some("unknown_server") => "unknown_server",
                    Some("service_unavailable") => "service_unavailable",
                    _ => "channel_refused",
                };
                Err((i64::from(e.code), e.message, reason))
            }
            Err(e) => Err((
                code::INTERNAL_ERROR,
                format!("mcp.open: {e}"),
                "executor_disconnected",
            )),
        }
    }

    fn send(&self, link: &Link, payload: String) -> bool {
        link.notify(
            Method::McpFrame,
            &McpFrameParams {
                session_id: self.session_id.clone(),
                server_key: self.key.clone(),
                payload,
            },
        )
        .is_ok()
    }
}

async fn not_allowed() -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        [(header::ALLOW, "POST")],
        "this endpoint offers no server stream and no session end: POST only\n",
    )
        .into_response()
}

async fn post(State(t): State<Arc<Tunnel>>, headers: HeaderMap, body: Body) -> Response {
    let too_large = || {
        rpc_http(
            StatusCode::PAYLOAD_TOO_LARGE,
            "null",
            code::INVALID_REQUEST,
            &format!("an MCP message is at most {} bytes", t.max),
            "payload_too_large",
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > t.max) {
        return too_large();
    }
    let Ok(body) = axum::body::to_bytes(body, t.max).await else {
        return too_large();
    };
    let Ok(text) = std::str::from_utf8(&body) else {
        return rpc_http(
            StatusCode::BAD_REQUEST,
            "null",
            code::PARSE_ERROR,
            "the body is not UTF-8",
            "parse_error",
        );
    };
    let env = match message::parse(text) {
        Ok(env) => env,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                [(header::CONTENT_TYPE, "application/json")],
                e.response(),
            )
                .into_response()
        }
    };
    let original = match env.kind {
        Kind::Request { id, .. } => id,
        Kind::Notification { .. } => {
            return match t.channel().await {
                Ok(link) if t.send(&link, text.to_owned()) => StatusCode::ACCEPTED.into_response(),
                Ok(_) => rpc_http(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "null",
                    code::INTERNAL_ERROR,
                    "the executor is not connected to its harness",
                    "executor_disconnected",
                ),
                Err((c, m, r)) => rpc_http(StatusCode::SERVICE_UNAVAILABLE, "null", c, &m, r),
            };
        }
        // Server → client requests are answered on the harness.
        Kind::Response { .. } => return StatusCode::ACCEPTED.into_response(),
    };
    let Ok(_permit) = t.permits.clone().try_acquire_owned() else {
        return rpc_http(
            StatusCode::TOO_MANY_REQUESTS,
            &original,
            code::INTERNAL_ERROR,
            &format!("at most {MAX_IN_FLIGHT} requests in flight to this service"),
            "busy",
        );
    };
    let link = match t.channel().await {
        Ok(link) => link,
        Err((c, m, r)) => return json(message::error_response(&original, c, &m, r)),
    };
    // Our id in, the client's back out.
    let ours = format!("\"{ID_PREFIX}{}\"", t.next.fetch_add(1, Ordering::Relaxed));
    let Ok(Value::Object(mut msg)) = serde_json::from_str::<Value>(text) else {
        return json(message::error_response(
            &original,
            code::INVALID_REQUEST,
            "not a JSON-RPC object",
            "invalid_request",
        ));
    };
    msg.insert(
        "id".into(),
        Value::String(ours[1..ours.len() - 1].to_owned()),
    );
    let (tx, rx) = oneshot::channel();
    t.lock().insert(ours.clone(), tx);
    if !t.send(&link, Value::Object(msg).to_string()) {
        t.lock().remove(&ours);
        return json(message::error_response(
            &original,
            code::INTERNAL_ERROR,
            "the executor is not connected to its harness",
            "executor_disconnected",
        ));
    }
    let answer = match tokio::time::timeout(REQUEST_TIMEOUT, rx).await {
        Ok(Ok(a)) => a,
        Ok(Err(_)) => {
            return json(message::error_response(
                &original,
                code::INTERNAL_ERROR,
                "the session's MCP service endpoint stopped",
                "session_ended",
            ))
        }
        Err(_) => {
            t.lock().remove(&ours);
            return json(message::error_response(
                &original,
                code::TIMEOUT,
                &format!("no answer within {} s", REQUEST_TIMEOUT.as_secs()),
                "timeout",
            ));
        }
    };
    match serde_json::from_str::<Value>(&answer) {
        Ok(Value::Object(mut m)) => {
            let id: Value = serde_json::from_str(&original).unwrap_or(Value::Null);
            m.insert("id".into(), id);
            json(Value::Object(m).to_string())
        }
        _ => json(message::error_response(
            &original,
            code::INTERNAL_ERROR,
            "the service answered something that is not JSON-RPC",
            "bad_answer",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names() {
        assert_eq!(env_name("svc"), "BMX_MCP_SVC_URL");
        assert_eq!(env_name("my-tools_2"), "BMX_MCP_MY_TOOLS_2_URL");
    }
}

//! `GET /v1/sessions/{id}/mcp` (the servers, their state and tools) and
//! `/v1/sessions/{id}/mcp/{serverKey}`: a Streamable HTTP MCP endpoint
//! (MCP transport revisions 2025-03-26 and 2025-06-18) proxied over the
//! session's `mcp.frame` channel to the executor's server.
//!
//! - `POST`: one JSON-RPC message (batches are refused). A request is
//!   answered with `application/json` when the client accepts it and the
//!   request carries no `progressToken`; else (progress asked for, or only
//!   SSE accepted) with `text/event-stream` (its progress notifications,
//!   then its response, then the end). `initialize` is answered with JSON
//!   when the client accepts JSON, so that the `Mcp-Session-Id` it mints
//!   comes with a known outcome. Notifications and responses get 202.
//! - `GET`: the client session's notification stream (server
//!   notifications: `tools/list_changed`, log messages, resource updates).
//! - `DELETE`: end the client session.
//!
//! Errors of the transport itself (bad headers, sizes, unknown client
//! session) are HTTP statuses with a JSON-RPC error body, as MCP clients
//! expect; the MCP server's own errors are JSON-RPC responses (200). The
//! API token guards these routes like every other (401).

use super::App;
use crate::harness::actors::mcp::{ensure_channel, EndpointError, McpMsg, Port, PROGRESS_QUEUE};
use crate::harness::api::mcp::list as list_servers;
use crate::harness::error::ApiError;
use crate::harness::mcp_proxy::{
    error_response, parse_client, progress_token, timeout_error, ClientMessage,
};
use crate::wire::{ErrorCode, RpcError};
use axum::extract::{Path, Request, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use serde_json::Value;
use std::convert::Infallible;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// The client session header of the Streamable HTTP transport.
pub const SESSION_HEADER: &str = "mcp-session-id";
/// How long a handler waits for the channel actor to take a message.
const ACCEPT_WAIT: Duration = Duration::from_secs(10);
/// Past the request deadline the actor answers with a timeout; this is
/// the handler's own margin should the actor be gone.
const ANSWER_GRACE: Duration = Duration::from_secs(5);
/// Keep-alive comments on notification streams (so a gone client is seen).
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// `GET /v1/sessions/{id}/mcp`.
pub(crate) async fn list(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let servers = list_servers(&app.shared, &id)?;
    Ok(Json(serde_json::json!({ "servers": servers })).into_response())
}

/// `POST /v1/sessions/{id}/mcp-services`: register a `service` server's
/// URL (201; the url is never echoed).
pub(crate) async fn register_service(
    State(app): State<App>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    if body.len() > 64 << 10 {
        return Err(ApiError::rpc(RpcError::payload_too_large(
            "a service registration is at most 64 KiB",
        )));
    }
    let reg: crate::harness::api::mcp::ServiceRegistration = serde_json::from_slice(&body)
        .map_err(|e| {
            // serde's text may quote a value (the url): only the position.
            ApiError::rpc(RpcError::invalid_params(format!(
                "bad registration (line {}, column {}): expected {{serverKey, url, timeoutMs?}}",
                e.line(),
                e.column()
            )))
        })?;
    // Parsed above without echoing the url; parsed again (it is at most
    // 64 KiB) only to refuse `null` members as every other body does.
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) {
        super::refuse_null_members(&v)?;
    }
    let key = reg.server_key.clone();
    crate::harness::api::mcp::register_service(&app.shared, &id, reg)?;
    Ok((
        StatusCode::CREATED,
        Json(serde_json::json!({ "serverKey": key, "registered": true })),
    )
        .into_response())
}

/// A transport error: the HTTP status with a JSON-RPC error body.
fn rpc_http(status: u16, id: &Value, error: &RpcError) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        error_response(id, error),
    )
        .into_response()
}

fn from_api(e: ApiError, id: &Value) -> Response {
    rpc_http(e.status, id, &e.error)
}

fn endpoint_error(e: EndpointError, id: &Value) -> Response {
    match e {
        EndpointError::UnknownClient => rpc_http(
            404,
            id,
            &RpcError::new(ErrorCode::NotFound, e.to_string()).with_reason("unknown_mcp_session"),
        ),
        EndpointError::TooManyClients(_) => rpc_http(
            429,
            id,
            &RpcError::resource_unavailable(e.to_string())
                .with_reason("too_many_mcp_sessions")
                .with_retryable(true),
        ),
        EndpointError::AlreadyStreaming => {
            rpc_http(409, id, &RpcError::conflict("stream_open", e.to_string()))
        }
    }
}

fn unavailable(id: &Value) -> Response {
    rpc_http(
        503,
        id,
        &RpcError::internal("the MCP channel is not answering")
            .with_reason("channel_unavailable")
            .with_retryable(true),
    )
}

/// What the `Accept` header allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Accepts {
    json: bool,
    sse: bool,
}

fn accepts(headers: &HeaderMap) -> Accepts {
    let values: Vec<&str> = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    if values.is_empty() {
        // No Accept at all: answer JSON (curl and friends).
        return Accepts {
            json: true,
            sse: false,
        };
    }
    let mut a = Accepts {
        json: false,
        sse: false,
    };
    for item in values.iter().flat_map(|v| v.split(',')) {
        let mut parts = item.split(';');
        let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        let refused = parts.any(|p| {
            let p = p.trim().replace(' ', "");
            p == "q=0" || p == "q=0.0" || p == "q=0.00" || p == "q=0.000"
        });
        if refused {
            continue;
        }
        match media.as_str() {
            "*/*" => {
                a.json = true;
                a.sse = true;
            }
            "application/json" | "application/*" => a.json = true,
            "text/event-stream" | "text/*" => a.sse = true,
            _ => {}
        }
    }
    a
}

fn is_json_body(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

/// The `Mcp-Session-Id` of the request: `Ok(None)` when absent,
/// `Err(())` when it cannot be one of ours (then it is unknown: 404).
fn client_session(headers: &HeaderMap) -> Result<Option<String>, ()> {
    let Some(v) = headers.get(SESSION_HEADER) else {
        return Ok(None);
    };
    let s = v.to_str().map_err(|_| ())?;
    if s.is_empty() || s.len() > 128 || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(());
    }
    Ok(Some(s.to_owned()))
}

/// The length of `s` as a JSON string literal (the payload travels as one
/// in `mcp.frame`).
fn escaped_len(s: &str) -> usize {
    2 + s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum::<usize>()
}

/// Whether the message, rewritten and carried in an `mcp.frame`, stays
/// within `max` bytes: a frame above the executor's limit would close the
/// whole connection (1009), so it must never be sent.
fn frame_fits(raw: &[u8], message: &ClientMessage, max: usize, overhead: usize) -> bool {
    // Rewriting can grow a message (a longer id; params that carry a
    // progress token are printed again, and 1E9 becomes 1000000000.0
    // there) and escaping it can double it; small messages cannot get near
    // the limit.
    if raw.len().saturating_mul(8).saturating_add(overhead) <= max {
        return true;
    }
    let text = match message {
        ClientMessage::Request { body, .. } | ClientMessage::Notification { body, .. } => {
            body.to_json()
        }
        ClientMessage::Response { .. } => return true,
    };
    escaped_len(&text).saturating_add(overhead) <= max
}

/// A JSON-RPC answer (or error) to a request, as the 200 JSON response
/// it is carried in.
fn json_answer(answer: String) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        answer,
    )
        .into_response()
}

fn message_id(message: &ClientMessage) -> Value {
    match message {
        ClientMessage::Request { id, .. } | ClientMessage::Response { id } => id.clone(),
        ClientMessage::Notification { .. } => Value::Null,
    }
}

fn too_large(id: &Value, max: usize) -> Response {
    rpc_http(
        413,
        id,
        &RpcError::payload_too_large(format!(
            "an MCP message is at most {max} bytes as carried in mcp.frame (maxMcpFrameBytes)"
        ))
        .with_reason("mcp_frame_too_large"),
    )
}

/// `POST /v1/sessions/{id}/mcp/{serverKey}`.
pub(crate) async fn post(
    State(app): State<App>,
    Path((session_id, server_key)): Path<(String, String)>,
    req: Request,
) -> Response {
    let shared = app.shared.clone();
    let max = shared.config.max_mcp_frame_bytes;
    let (parts, body) = req.into_parts();
    let headers = parts.headers;
    if !is_json_body(&headers) {
        return rpc_http(
            415,
            &Value::Null,
            &RpcError::invalid_request(
                "unsupported_media_type",
                "Content-Type must be application/json",
            ),
        );
    }
    let accept = accepts(&headers);
    if !accept.json && !accept.sse {
        return rpc_http(
            406,
            &Value::Null,
            &RpcError::invalid_request(
                "not_acceptable",
                "Accept must allow application/json or text/event-stream",
            ),
        );
    }
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return too_large(&Value::Null, max);
    }
    let Ok(bytes) = axum::body::to_bytes(body, max).await else {
        return too_large(&Value::Null, max);
    };
    let message = match parse_client(&bytes) {
        Ok(m) => m,
        Err(e) => return rpc_http(400, &e.id(), &e.rpc()),
    };
    let id = message_id(&message);
    let overhead = 512 + session_id.len() + server_key.len();
    if !frame_fits(&bytes, &message, max, overhead) {
        return too_large(&id, max);
    }
    drop(bytes);
    let is_init =
        matches!(&message, ClientMessage::Request { method, .. } if method == "initialize");
    let actor = match ensure_channel(&shared, &session_id, &server_key).await {
        Ok(a) => a,
        Err(e) => return from_api(e, &id),
    };
    let client = match client_session(&headers) {
        Ok(c) => c,
        Err(()) => return endpoint_error(EndpointError::UnknownClient, &id),
    };
    if client.is_none() && !is_init {
        return rpc_http(
            400,
            &id,
            &RpcError::invalid_request(
                "missing_session_id",
                "Mcp-Session-Id is required after initialize",
            ),
        );
    }
    match message {
        ClientMessage::Request {
            id, method, body, ..
        } => {
            let wants_progress = progress_token(&body).is_some();
            // SSE only when the client cannot take JSON, or when the
            // request asked for progress (the one thing a JSON answer
            // cannot carry): a JSON answer is one write of the whole
            // response, where SSE costs the head, the event and the last
            // chunk as separate writes and reads.
            let use_sse = accept.sse && (!accept.json || (wants_progress && !is_init));
            // A progress queue only for an SSE answer: a JSON answer has
            // nowhere to put progress, and making the queue (its shared
            // state and a first block of 32 slots) was two allocations,
            // about 1 KiB together, per call.
            let (ptx, prx) = use_sse.then(|| mpsc::channel(PROGRESS_QUEUE)).unzip();
            let (dtx, drx) = oneshot::channel();
            let (atx, arx) = oneshot::channel();
            let msg = McpMsg::Request {
                // `initialize` always starts a new client session.
                client: if is_init { None } else { client },
                id: id.clone(),
                method,
                body,
                port: Port {
                    progress: ptx,
                    done: dtx,
                },
                accepted: atx,
            };
            if actor.send_message(msg).is_err() {
                return unavailable(&id);
            }
            let deadline =
                tokio::time::Instant::now() + shared.config.mcp_request_timeout + ANSWER_GRACE;
            let timeout_ms = shared.config.mcp_request_timeout.as_millis() as u64;
            if !is_init && !use_sse {
                // The common call: a request of a known client session
                // answered with JSON. It waits for the answer alone; the
                // actor refuses one (unknown client) by dropping its port,
                // with the reason left in `accepted`. Awaiting `accepted`
                // first cost a task wake-up per call, often of another
                // thread. A channel actor too busy to take the request is
                // then a timeout of the request instead of a 503 after
                // ACCEPT_WAIT.
                let d = tokio::time::timeout_at(deadline, drx).await;
                if matches!(d, Ok(Err(_))) {
                    let mut arx = arx;
                    if let Ok(Err(e)) = arx.try_recv() {
                        return endpoint_error(e, &id);
                    }
                }
                return json_answer(resolve(d, &id, timeout_ms));
            }
            let minted = match tokio::time::timeout(ACCEPT_WAIT, arx).await {
                Ok(Ok(Ok(m))) => m,
                Ok(Ok(Err(e))) => return endpoint_error(e, &id),
                _ => return unavailable(&id),
            };
            // The queue is there exactly when the answer is SSE.
            let Some(prx) = prx else {
                let answer = wait_answer(drx, deadline, &id, timeout_ms).await;
                let failed = minted.is_some()
                    && serde_json::from_str::<Value>(&answer)
                        .map(|v| v.get("error").is_some())
                        .unwrap_or(true);
                let mut resp = json_answer(answer);
                if let Some(client) = minted {
                    if failed {
                        // No session for a failed initialize.
                        let (tx, _rx) = oneshot::channel();
                        let _ = actor.send_message(McpMsg::EndClient { client, reply: tx });
                    } else if let Ok(v) = HeaderValue::from_str(&client) {
                        resp.headers_mut().insert(SESSION_HEADER, v);
                    }
                }
                return resp;
            };
            let stream = futures_util::stream::unfold(Some((prx, drx)), move |st| {
                let id = id.clone();
                async move {
                    let (mut prx, mut drx) = st?;
                    let last = tokio::select! {
                        biased;
                        Some(p) = prx.recv() => {
                            return Some((Ok::<_, Infallible>(event(p)), Some((prx, drx))));
                        }
                        d = tokio::time::timeout_at(deadline, &mut drx) => resolve(d, &id, timeout_ms),
                    };
                    Some((Ok(event(last)), None))
                }
            });
            let mut resp = Sse::new(stream).into_response();
            if let Some(v) = minted.and_then(|c| HeaderValue::from_str(&c).ok()) {
                resp.headers_mut().insert(SESSION_HEADER, v);
            }
            resp
        }
        ClientMessage::Notification { method, body } => {
            let Some(client) = client else {
                return unavailable(&id);
            };
            let (atx, arx) = oneshot::channel();
            let msg = McpMsg::Notify {
                client,
                method,
                body,
                accepted: atx,
            };
            if actor.send_message(msg).is_err() {
                return unavailable(&id);
            }
            accepted_or(arx, &id).await
        }
        ClientMessage::Response { .. } => {
            let Some(client) = client else {
                return unavailable(&id);
            };
            let (atx, arx) = oneshot::channel();
            if actor
                .send_message(McpMsg::ClientResponse {
                    client,
                    accepted: atx,
                })
                .is_err()
            {
                return unavailable(&id);
            }
            accepted_or(arx, &id).await
        }
    }
}

async fn accepted_or(arx: oneshot::Receiver<Result<(), EndpointError>>, id: &Value) -> Response {
    match tokio::time::timeout(ACCEPT_WAIT, arx).await {
        Ok(Ok(Ok(()))) => StatusCode::ACCEPTED.into_response(),
        Ok(Ok(Err(e))) => endpoint_error(e, id),
        _ => unavailable(id),
    }
}

fn event(message: String) -> Event {
    Event::default().event("message").data(message)
}

fn resolve(
    d: Result<Result<String, oneshot::error::RecvError>, tokio::time::error::Elapsed>,
    id: &Value,
    timeout_ms: u64,
) -> String {
    match d {
        Ok(Ok(m)) => m,
        // The channel actor is gone without answering (it failed).
        Ok(Err(_)) => error_response(
            id,
            &RpcError::internal("the MCP channel stopped").with_reason("channel_stopped"),
        ),
        Err(_) => error_response(id, &timeout_error(timeout_ms)),
    }
}

async fn wait_answer(
    drx: oneshot::Receiver<String>,
    deadline: tokio::time::Instant,
    id: &Value,
    timeout_ms: u64,
) -> String {
    resolve(tokio::time::timeout_at(deadline, drx).await, id, timeout_ms)
}

fn required_session(headers: &HeaderMap) -> Result<String, Response> {
    match client_session(headers) {
        Ok(Some(c)) => Ok(c),
        Ok(None) => Err(rpc_http(
            400,
            &Value::Null,
            &RpcError::invalid_request("missing_session_id", "Mcp-Session-Id is required"),
        )),
        Err(()) => Err(endpoint_error(EndpointError::UnknownClient, &Value::Null)),
    }
}

/// `GET /v1/sessions/{id}/mcp/{serverKey}`: the notification stream.
pub(crate) async fn get(
    State(app): State<App>,
    Path((session_id, server_key)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    if !accepts(&headers).sse || headers.get(header::ACCEPT).is_none() {
        return rpc_http(
            406,
            &Value::Null,
            &RpcError::invalid_request("not_acceptable", "Accept must allow text/event-stream"),
        );
    }
    let client = match required_session(&headers) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let actor = match ensure_channel(&app.shared, &session_id, &server_key).await {
        Ok(a) => a,
        Err(e) => return from_api(e, &Value::Null),
    };
    let (tx, rx) = oneshot::channel();
    if actor
        .send_message(McpMsg::Attach { client, reply: tx })
        .is_err()
    {
        return unavailable(&Value::Null);
    }
    let notes = match tokio::time::timeout(ACCEPT_WAIT, rx).await {
        Ok(Ok(Ok(rx))) => rx,
        Ok(Ok(Err(e))) => return endpoint_error(e, &Value::Null),
        _ => return unavailable(&Value::Null),
    };
    let stream = futures_util::stream::unfold(notes, |mut rx| async move {
        rx.recv().await.map(|m| (Ok::<_, Infallible>(event(m)), rx))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response()
}

/// `DELETE /v1/sessions/{id}/mcp/{serverKey}`: end the client session.
pub(crate) async fn delete(
    State(app): State<App>,
    Path((session_id, server_key)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let client = match required_session(&headers) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let actor = match ensure_channel(&app.shared, &session_id, &server_key).await {
        Ok(a) => a,
        Err(e) => return from_api(e, &Value::Null),
    };
    let (tx, rx) = oneshot::channel();
    if actor
        .send_message(McpMsg::EndClient { client, reply: tx })
        .is_err()
    {
        return unavailable(&Value::Null);
    }
    match tokio::time::timeout(ACCEPT_WAIT, rx).await {
        Ok(Ok(true)) => StatusCode::NO_CONTENT.into_response(),
        Ok(Ok(false)) => endpoint_error(EndpointError::UnknownClient, &Value::Null),
        _ => unavailable(&Value::Null),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        m
    }

    #[test]
    fn accept_header() {
        let a = accepts(&h(&[("accept", "application/json, text/event-stream")]));
        assert_eq!(
            a,
            Accepts {
                json: true,
                sse: true
            }
        );
        let a = accepts(&h(&[("accept", "text/event-stream")]));
        assert_eq!(
            a,
            Accepts {
                json: false,
                sse: true
            }
        );
        let a = accepts(&h(&[("accept", "*/*")]));
        assert_eq!(
            a,
            Accepts {
                json: true,
                sse: true
            }
        );
        let a = accepts(&h(&[("accept", "text/html")]));
        assert_eq!(
            a,
            Accepts {
                json: false,
                sse: false
            }
        );
        let a = accepts(&h(&[("accept", "application/json;q=0, text/event-stream")]));
        assert_eq!(
            a,
            Accepts {
                json: false,
                sse: true
            }
        );
        assert_eq!(
            accepts(&HeaderMap::new()),
            Accepts {
                json: true,
                sse: false
            }
        );
    }

    #[test]
    fn session_header_and_content_type() {
        assert_eq!(client_session(&HeaderMap::new()), Ok(None));
        assert_eq!(
            client_session(&h(&[("mcp-session-id", "abc")])),
            Ok(Some("abc".into()))
        );
        assert!(client_session(&h(&[("mcp-session-id", &"x".repeat(129))])).is_err());
        assert!(is_json_body(&h(&[(
            "content-type",
            "application/json; charset=utf-8"
        )])));
        assert!(!is_json_body(&h(&[("content-type", "text/plain")])));
        assert!(!is_json_body(&HeaderMap::new()));
    }

    #[test]
    fn escaping_is_counted_like_serde_json() {
        for s in ["plain", "q\"uote\\", "nl\n\t\r", "\u{1}\u{1f}", "é✓"] {
            assert_eq!(
                escaped_len(s),
                serde_json::to_string(s).unwrap().len(),
                "{s:?}"
            );
        }
        let big = format!(
            "{{\"jsonrpc\":\"2.0\",\"method\":\"m\",\"params\":{{\"x\":\"{}\"}}}}",
            "\\\"".repeat(10)
        );
        let msg = parse_client(big.as_bytes()).unwrap();
        assert!(frame_fits(big.as_bytes(), &msg, 1 << 20, 512));
        assert!(!frame_fits(big.as_bytes(), &msg, 60, 0));
    }
}

//! API calls on any replica (docs/store.md, "Several replicas"): a call
//! about a session this replica does not know, or creating a session on an
//! executor connected elsewhere, is forwarded over HTTP to the replica
//! that holds it, rather than redirected: a platform then needs one URL
//! and no redirect handling for POSTs with bodies.
//!
//! The owner comes from the database (`sessions.replica` for
//! `/v1/sessions/{id}/…`, `connections.replica` for a create naming an
//! executor and for `/v1/executors/{id}/…` of an executor not connected
//! here), joined with `replicas`: a replica not seen for a lease TTL is
//! dead and is not forwarded to (the call is then answered here, as
//! without replicas). The forwarded call carries this harness's API token
//! (replicas of one platform share it) and a marker header, so it is
//! never forwarded twice. WebSocket upgrades on those paths (the event
//! stream, a terminal attach) are forwarded too, frame by frame
//! ([`super::forward_ws`]). The relay routes (`/v1/relay/…`) are not:
//! their one-time tickets live in the replica that minted them, whose
//! URL the ticket's holder was given.
//!
//! `GET /v1/sessions/{id}` of a session neither this replica nor any live
//! one holds is answered from the database's row (a dead replica's
//! session, or one the sweep ended: `lease_expired`), so its outcome can
//! be read on any replica. A forwarded call never reads the database
//! this way: it asks what the replica itself holds.

use super::App;
use crate::harness::error::ApiError;
use axum::body::Body;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{header, Method};
use std::time::Duration;
use tracing::Instrument;

/// Marks a forwarded call; a replica never forwards such a call again.
pub const FORWARDED: &str = "x-bmx-forwarded-by";

/// The largest `POST /v1/sessions` body read to find its `executorId`:
/// the route's own limit (axum's default), so a body it would take is
/// never refused here.
const CREATE_BODY_MAX: usize = 2 << 20;

/// The request headers a forwarded call carries on (what the routes it
/// may reach read): an SSE resume point (`Last-Event-ID`) and an MCP
/// session among them. Not `Authorization` (the forward carries this
/// harness's own token), nor hop-by-hop ones.
const REQUEST_HEADERS: [&str; 6] = [
    "content-type",
    "accept",
    "if-match",
    "if-none-match",
    "last-event-id",
    crate::harness::http::mcp::SESSION_HEADER,
];

/// The answer headers handed back; `x-accel-buffering: no` keeps a proxy
/// in front of this replica from buffering a forwarded event stream.
const ANSWER_HEADERS: [&str; 5] = [
    "content-type",
    "cache-control",
    "etag",
    "x-accel-buffering",
    crate::harness::http::mcp::SESSION_HEADER,
];

/// Who to ask for the owner of a call.
enum Owner {
    /// A session, and the fencing token a newer grant must exceed.
    Session(String, u64),
    Executor(String),
}

/// Forward when another live replica holds the call's session or
/// executor; else serve it here (`next`). Run by the router's stage for
/// matched routes, after the path ids are checked.
pub(crate) async fn forward(app: &App, req: Request, next: Next) -> Response {
    let shared = &app.shared;
    let Some(replica) = shared.replica.get() else {
        return next.run(req).await;
    };
    if req.headers().contains_key(FORWARDED) {
        return next.run(req).await;
    }
    // A WebSocket upgrade is forwarded as a WebSocket; any other upgrade
    // is answered here.
    let ws = super::relay::ws_accept(req.headers()).is_some();
    if req.headers().contains_key(header::UPGRADE) && !ws {
        return next.run(req).await;
    }
    let path = req.uri().path().to_owned();
    let (req, owner) = if let Some(rest) = path.strip_prefix("/v1/sessions/") {
        let id = rest.split('/').next().unwrap_or_default().to_owned();
        if id.is_empty() {
            return next.run(req).await;
        }
        // A replica never answers for a session while another live
        // replica's row holds a newer grant of it (issue 54): whatever
        // this replica's copy says (`active` over a frozen connection
        // included), the database is asked for a newer grant first, and
        // the call is forwarded there if there is one.
        let above = shared.sessions.get(&id).map_or(0, |r| r.fencing_token);
        (req, Owner::Session(id, above))
    } else if let Some(rest) = path.strip_prefix("/v1/executors/") {
        // Terminals, drains: the replica the executor is connected to.
        let id = rest.split('/').next().unwrap_or_default();
        if id.is_empty() || shared.executors.contains_key(id) {
            return next.run(req).await;
        }
        let id = id.to_owned();
        (req, Owner::Executor(id))
    } else if path == "/v1/sessions" && req.method() == Method::POST && !ws {
        let (parts, body) = req.into_parts();
        let bytes = match axum::body::to_bytes(body, CREATE_BODY_MAX).await {
            Ok(b) => b,
            Err(_) => {
                return ApiError::with_status(
                    413,
                    crate::wire::RpcError::invalid_request(
                        "payload_too_large",
                        "request body too large",
                    ),
                )
                .into_response()
            }
        };
        let executor = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|v| v["executorId"].as_str().map(str::to_owned));
        let req = Request::from_parts(parts, Body::from(bytes));
        match executor {
            Some(e) if !shared.executors.contains_key(&e) => (req, Owner::Executor(e)),
            _ => return next.run(req).await,
        }
    } else {
        return next.run(req).await;
    };
    // Read from the database when no live replica holds it: a plain
    // `GET /v1/sessions/{id}` of a session unknown here.
    let from_db = match &owner {
        Owner::Session(id, 0)
            if req.method() == Method::GET
                && path.len() == "/v1/sessions/".len() + id.len()
                && !shared.sessions.contains_key(id) =>
        {
            Some(id.clone())
        }
        _ => None,
    };
    let db = replica.db.clone();
    let alive = shared.config.lease_ttl_ms;
    let found = tokio::task::spawn_blocking(move || match owner {
        Owner::Session(id, above) => db.session_owner(&id, alive, above),
        Owner::Executor(id) => db.executor_owner(&id, alive),
    })
    .await;
    let (to, url) = match found {
        Ok(Ok(Some(o))) => o,
        Ok(Ok(None)) => match from_db {
            Some(id) => return stored_session(app, req, next, id).await,
            None => return next.run(req).await,
        },
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot look up the owning replica; answering here");
            return next.run(req).await;
        }
        Err(e) => return ApiError::internal(e.to_string()).into_response(),
    };
    let span = tracing::debug_span!("forward", to = %to, %path);
    if ws {
        return super::forward_ws::forward(app, req, &to, &url)
            .instrument(span)
            .await;
    }
    match send(app, req, &url).instrument(span).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "forwarding to the owning replica failed");
            unreachable(&to).into_response()
        }
    }
}

/// 502 `replica_unreachable`: the replica holding the call did not answer.
pub(crate) fn unreachable(to: &str) -> ApiError {
    ApiError::with_status(
        502,
        crate::wire::RpcError::internal(format!("replica {to} did not answer"))
            .with_reason("replica_unreachable"),
    )
}

/// Answer `GET /v1/sessions/{id}` with the database's row of `id`, or as
/// without replicas (404) when there is none or the database fails.
async fn stored_session(app: &App, req: Request, next: Next, id: String) -> Response {
    let Some(replica) = app.shared.replica.get() else {
        return next.run(req).await;
    };
    let db = replica.db.clone();
    match tokio::task::spawn_blocking(move || db.session_info(&id)).await {
        Ok(Ok(Some(info))) => axum::Json(info).into_response(),
        Ok(Ok(None)) => next.run(req).await,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot read the session from the store; answering here");
            next.run(req).await
        }
        Err(e) => ApiError::internal(e.to_string()).into_response(),
    }
}

/// Send `req` to the replica at `base` and hand its answer back, bodies
/// streamed both ways.
async fn send(app: &App, req: Request, base: &str) -> Result<Response, reqwest::Error> {
    let shared = &app.shared;
    let client = shared
        .replica
        .get()
        .map(|r| r.http.clone())
        .unwrap_or_default();
    let (parts, body) = req.into_parts();
    let target = format!(
        "{}{}",
        base.trim_end_matches('/'),
        parts.uri.path_and_query().map_or("/", |p| p.as_str())
    );
    let me = shared.replica.get().map_or("", |r| r.db.id()).to_owned();
    let mut out = client
        .request(parts.method.clone(), target)
        .header(FORWARDED, me)
        .body(reqwest::Body::wrap_stream(body.into_data_stream()));
    for name in REQUEST_HEADERS {
        if let Some(v) = parts.headers.get(name) {
            out = out.header(name, v.clone());
        }
    }
    if let Some(t) = &shared.config.api_token {
        out = out.bearer_auth(t.expose());
    }
    let resp = out.send().await?;
    let mut answer = Response::builder().status(resp.status().as_u16());
    for name in ANSWER_HEADERS {
        if let Some(v) = resp.headers().get(name) {
            answer = answer.header(name, v.clone());
        }
    }
    Ok(answer
        .body(Body::from_stream(resp.bytes_stream()))
        .unwrap_or_else(|_| ApiError::internal("bad forwarded answer").into_response()))
}

/// The client forwarded calls go out on (connect deadline; no overall one:
/// a tool call may wait as long as the tool runs, and the caller's own
/// deadline still applies).
pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .build()
        .unwrap_or_default()
}

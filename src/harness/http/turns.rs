//! Agent turns over HTTP (docs/api.md "Agent turns", docs/agents.md):
//!
//! - `POST /v1/sessions/{id}/turns`, `…/turns/{turnId}/input`,
//!   `…/turns/{turnId}/cancel`: `turn.start`, `turn.input`, `turn.cancel`.
//! - `GET /v1/sessions/{id}/events`: the session's agent stream as
//!   Server-Sent Events. Final events carry `id: <sequence>` (and the
//!   default event type); deltas (`event: delta`) and interaction notices
//!   (`event: interaction`) carry no id; `event: gap` says events were
//!   dropped by retention, `event: end` that the session ended, `event:
//!   error` that the stream was cut (`slow_subscriber`). `Last-Event-ID`
//!   (or `?after=SEQ`) resumes after that sequence: nothing missed, nothing
//!   twice.
//! - `GET /v1/sessions/{id}/events/ws`: the same items as WebSocket text
//!   frames (one JSON object each, `kind` tells which).
//! - `GET /v1/sessions/{id}/interactions[/{interactionId}]`, `POST
//!   …/interactions/{interactionId}`: pending permission questions and
//!   their answers.
//!
//! Bodies are bounded before they are parsed (413, -32013): a turn's input
//! by the control frame size, an answer by 128 KiB.

use super::relay::{server_ws, switching, ws_accept};
use super::App;
use crate::harness::api::turns::{
    CancelTurn, EventStream, InteractionAnswer, MoreInput, StartTurn, StreamItem,
};
use crate::harness::error::ApiError;
use crate::wire::transport::WsStream;
use crate::wire::RpcError;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{SinkExt, StreamExt};
use http::{header, HeaderMap, StatusCode};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::convert::Infallible;
use std::time::Duration;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;

/// Keep-alive comments (SSE) and pings (WebSocket), so idle proxies keep
/// the stream and a gone client is noticed.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// A WebSocket client that takes no frame for this long is let go.
const SEND_WAIT: Duration = Duration::from_secs(30);
/// Largest frame accepted from a WebSocket client (it has nothing to say).
const MAX_CLIENT_FRAME: usize = 64 << 10;
/// Largest interaction answer or cancel body.
const MAX_SMALL_BODY: usize = 128 << 10;

/// Read a JSON body of at most `limit` bytes (413 past it; empty is `{}`).
async fn read_json<T: DeserializeOwned>(req: Request, limit: usize) -> Result<T, ApiError> {
    let too_large = || {
        ApiError::rpc(RpcError::payload_too_large(format!(
            "the body must be at most {limit} bytes"
        )))
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let bytes = axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|_| too_large())?;
    super::body(&bytes)
}

fn turn_limit(app: &App) -> usize {
    app.shared.config.max_control_frame_bytes
}

/// `POST /v1/sessions/{id}/turns` → 201 `{turnId, inputId, accepted,
/// effective, executorSessionRef, resumed}`.
pub(crate) async fn start(
    State(app): State<App>,
    Path(id): Path<String>,
    req: Request,
) -> Result<Response, ApiError> {
    let body: StartTurn = read_json(req, turn_limit(&app)).await?;
    let r = app.sessions().session(&id).start_turn(body).await?;
    Ok((StatusCode::CREATED, Json(r)).into_response())
}

/// `POST /v1/sessions/{id}/turns/{turnId}/input` → `{accepted, inputId}`.
pub(crate) async fn input(
    State(app): State<App>,
    Path((id, turn_id)): Path<(String, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    let body: MoreInput = read_json(req, turn_limit(&app)).await?;
    let r = app
        .sessions()
        .session(&id)
        .turn_input(&turn_id, body)
        .await?;
    Ok(Json(r).into_response())
}

/// `POST /v1/sessions/{id}/turns/{turnId}/cancel` → `{canceled}`.
pub(crate) async fn cancel(
    State(app): State<App>,
    Path((id, turn_id)): Path<(String, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    let body: CancelTurn = read_json(req, MAX_SMALL_BODY).await?;
    let r = app
        .sessions()
        .session(&id)
        .cancel_turn(&turn_id, body.reason)
        .await?;
    Ok(Json(r).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EventsQuery {
    after: Option<u64>,
}

/// Where a client resumes: `Last-Event-ID` (what an EventSource sends when
/// it reconnects) wins over `?after=`; neither means from the oldest kept.
fn cursor(
    query: Result<Query<EventsQuery>, QueryRejection>,
    headers: &HeaderMap,
) -> Result<u64, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::bad_request(format!("query: {e}")))?;
    if let Some(v) = headers.get("last-event-id") {
        let text = v
            .to_str()
            .map_err(|_| ApiError::bad_request("Last-Event-ID must be a sequence number"))?
            .trim();
        if !text.is_empty() {
            return text
                .parse::<u64>()
                .map_err(|_| ApiError::bad_request("Last-Event-ID must be a sequence number"));
        }
    }
    Ok(q.after.unwrap_or(0))
}

fn sse_event(item: &StreamItem) -> Event {
    let mut e = Event::default().data(&*item.json());
    if let StreamItem::Event { sequence, .. } = item {
        e = e.id(sequence.to_string());
    }
    if let Some(name) = item.sse_name() {
        e = e.event(name);
    }
    e
}

/// `GET /v1/sessions/{id}/events[?after=SEQ]`: Server-Sent Events.
pub(crate) async fn events(
    State(app): State<App>,
    Path(id): Path<String>,
    query: Result<Query<EventsQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let after = cursor(query, &headers)?;
    let stream = app.sessions().session(&id).events(after).await?;
    let sse = stream.map(|item| Ok::<_, Infallible>(sse_event(&item)));
    let mut resp = Sse::new(sse)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response();
    // Proxies must pass every event on at once.
    resp.headers_mut().insert(
        header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-cache"),
    );
    resp.headers_mut()
        .insert("x-accel-buffering", http::HeaderValue::from_static("no"));
    Ok(resp)
}

/// `GET /v1/sessions/{id}/events/ws[?after=SEQ]`: the same stream over a
/// WebSocket. Errors before the upgrade are HTTP statuses, like the SSE
/// route's.
pub(crate) async fn events_ws(
    State(app): State<App>,
    Path(id): Path<String>,
    query: Result<Query<EventsQuery>, QueryRejection>,
    req: Request,
) -> Result<Response, ApiError> {
    let accept = ws_accept(req.headers())
        .ok_or_else(|| ApiError::bad_request("expected a WebSocket upgrade"))?;
    let after = cursor(query, req.headers())?;
    let stream = app.sessions().session(&id).events(after).await?;
    let on_upgrade = hyper::upgrade::on(req);
    let span = tracing::info_span!("events_ws", session = %id);
    tokio::spawn(tracing::Instrument::instrument(
        async move {
            match on_upgrade.await {
                Ok(up) => pump_ws(server_ws(up, MAX_CLIENT_FRAME).await, stream).await,
                Err(e) => tracing::info!(error = %e, "events upgrade failed"),
            }
        },
        span,
    ));
    Ok(switching(accept, None))
}

async fn pump_ws(mut ws: WsStream, mut stream: EventStream) {
    let mut ping = tokio::time::interval(KEEP_ALIVE);
    ping.tick().await;
    let close = |code: WsCode, reason: &'static str| {
        Message::Close(Some(CloseFrame {
            code,
            reason: reason.into(),
        }))
    };
    loop {
        tokio::select! {
            item = stream.next() => {
                let Some(item) = item else {
                    let _ = ws.send(close(WsCode::Normal, "end")).await;
                    return;
                };
                let last = matches!(item, StreamItem::End { .. } | StreamItem::Error { .. });
                let frame = Message::text(item.json().to_string());
                match tokio::time::timeout(SEND_WAIT, ws.send(frame)).await {
                    Ok(Ok(())) => {}
                    _ => return,
                }
                if last {
                    let code = if matches!(item, StreamItem::End { .. }) {
                        WsCode::Normal
                    } else {
                        WsCode::Again
                    };
                    let _ = tokio::time::timeout(SEND_WAIT, ws.send(close(code, "stream ended"))).await;
                    return;
                }
            }
            msg = ws.next() => match msg {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return,
                // The client has nothing to say; pings are answered by the socket.
                Some(Ok(_)) => {}
            },
            _ = ping.tick() => {
                match tokio::time::timeout(SEND_WAIT, ws.send(Message::Ping(Default::default()))).await {
                    Ok(Ok(())) => {}
                    _ => return,
                }
            }
        }
    }
}

/// `GET /v1/sessions/{id}/interactions` → `{interactions: [...]}` (pending).
pub(crate) async fn list_interactions(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let v = app.sessions().session(&id).interactions().await?;
    Ok(Json(serde_json::json!({ "interactions": v })).into_response())
}

/// `GET /v1/sessions/{id}/interactions/{interactionId}` (pending or recently
/// resolved).
pub(crate) async fn get_interaction(
    State(app): State<App>,
    Path((id, iid)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let v = app.sessions().session(&id).interaction(&iid).await?;
    Ok(Json(v).into_response())
}

/// `POST /v1/sessions/{id}/interactions/{interactionId}` `{outcome, scope?,
/// answers?, denyMessage?}` → the interaction, resolved.
pub(crate) async fn answer_interaction(
    State(app): State<App>,
    Path((id, iid)): Path<(String, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    let body: InteractionAnswer = read_json(req, MAX_SMALL_BODY).await?;
    let v = app
        .sessions()
        .session(&id)
        .answer_interaction(&iid, body)
        .await?;
    Ok(Json(v).into_response())
}

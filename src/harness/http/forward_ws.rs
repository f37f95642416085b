//! WebSocket calls on any replica (docs/store.md, "Several replicas"): an
//! upgrade about a session or an executor another live replica holds
//! (`GET /v1/sessions/{id}/events/ws`, `GET /v1/executors/{id}/terminals/
//! {tid}/attach`; who holds it is [`super::forward`]'s rule) is passed on
//! frame by frame, so a platform needs one URL for streams too.
//!
//! ```text
//! client ──ws──▶ this replica ──ws (API token, x-bmx-forwarded-by)──▶ owner
//!        ◀══ text, binary, ping, pong, close (code, reason) ══▶
//! ```
//!
//! * **The owner first.** The owner is dialled (same path and query, this
//!   harness's API token, the forwarded marker, the client's subprotocol
//!   offer and resume point) before the client's upgrade is answered: an
//!   owner that does not answer within [`CONNECT_WAIT`] is 502
//!   `replica_unreachable`, and an owner that refuses the upgrade (404
//!   unknown session, 429, 503 …) has its HTTP answer handed back as it
//!   is, exactly as a client would have had it from the owner itself. An
//!   owner that upgrades with none of the subprotocols the client offered
//!   (a connection the client would fail itself) is 400
//!   `no_common_subprotocol`.
//! * **Backpressure.** Each direction reads one frame and sends it on
//!   before it reads the next: no queue between the two sockets, so a
//!   slow reader slows its writer down through TCP. A frame the receiver
//!   does not take within [`SEND_WAIT`] ends both sockets.
//! * **Closing.** A close frame is passed on with its code and reason;
//!   the other side then gets [`CLOSE_WAIT`] to answer it. A side lost
//!   without a close frame closes the other: the client with 1011 (its
//!   owner was lost), the owner with 1001 (the client went away).
//! * **Pings.** Passed on like any frame. Each socket also answers pings
//!   itself (tungstenite does), so a sender may get two pongs: the one of
//!   this replica and the one passed back (RFC 6455 allows unsolicited
//!   pongs).
//!
//! A forwarded socket takes one of this replica's `max_relays` places
//! ([`Slot`]): it holds two sockets and a task here.

use super::relay::{server_ws, ws_accept, Slot, MAX_EXECUTOR_FRAME};
use super::{forward, App};
use crate::harness::error::ApiError;
use crate::wire::transport::{self, BoxIo, WsStream};
use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use http::{header, HeaderMap, HeaderValue, StatusCode};
use std::time::Duration;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::error::ProtocolError;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tracing::Instrument;

/// Dialling the owner and its handshake, at most (the plain forward's
/// connect deadline).
pub const CONNECT_WAIT: Duration = Duration::from_secs(5);
/// One frame passed on, at most: a side that takes none for this long is
/// stuck, and both sockets end (the routes' own send deadline).
const SEND_WAIT: Duration = Duration::from_secs(30);
/// After one side closed, how long the other may take to finish.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// The request headers of the client's upgrade passed on to the owner:
/// the subprotocol offer (a terminal viewer's `bmx.terminal.v1`), the
/// event stream's resume point, the request id (one trace).
const UPGRADE_HEADERS: [header::HeaderName; 3] = [
    header::SEC_WEBSOCKET_PROTOCOL,
    header::HeaderName::from_static("last-event-id"),
    header::HeaderName::from_static("x-request-id"),
];

/// Why dialling the owner failed.
#[derive(Debug, thiserror::Error)]
enum DialError {
    #[error("the replica's URL {0:?} is not http://host:port")]
    Url(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("cannot connect: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad upgrade request: {0}")]
    Request(String),
    /// The owner answered the upgrade with an HTTP status instead.
    #[error("the upgrade was answered with {}", .0.status())]
    Refused(Box<http::Response<Option<Vec<u8>>>>),
    /// The owner upgraded without any subprotocol the client offered
    /// (the route speaks none of them): a client would fail that
    /// connection itself.
    #[error("no common subprotocol: {0}")]
    Subprotocol(String),
    #[error("handshake: {0}")]
    Handshake(WsError),
}

/// Forward the WebSocket upgrade `req` to replica `to` at `base` (its
/// `http://` URL): 101 with the owner's subprotocol once the owner took
/// it, then both sockets pumped by a task.
pub(crate) async fn forward(app: &App, req: Request, to: &str, base: &str) -> Response {
    let shared = &app.shared;
    let Some(accept) = ws_accept(req.headers()) else {
        return ApiError::bad_request("expected a WebSocket upgrade").into_response();
    };
    let slot = match Slot::take(shared) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let max = frame_max(shared.config.max_control_frame_bytes);
    let me = shared.replica.get().map_or("", |r| r.db.id());
    let token = shared.config.api_token.as_ref().map(|t| t.expose());
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let dialled = tokio::time::timeout(
        CONNECT_WAIT,
        dial(base, path, req.headers(), token, me, max),
    )
    .await
    .unwrap_or(Err(DialError::Timeout(CONNECT_WAIT)));
    let (owner, subprotocol) = match dialled {
        Ok(o) => o,
        Err(DialError::Refused(answer)) => return refused(*answer),
        Err(DialError::Subprotocol(detail)) => {
            return ApiError::rpc(
                crate::wire::RpcError::new(crate::wire::ErrorCode::UnsupportedProtocol, detail)
                    .with_reason("no_common_subprotocol"),
            )
            .into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "forwarding a WebSocket to the owning replica failed");
            return forward::unreachable(to).into_response();
        }
    };
    let on_upgrade = hyper::upgrade::on(req);
    tokio::spawn(
        async move {
            let _slot = slot;
            match on_upgrade.await {
                Ok(up) => pump(server_ws(up, max).await, owner).await,
                Err(e) => {
                    tracing::info!(error = %e, "client upgrade failed; closing the owner's socket");
                    let mut owner = owner;
                    let bye = close_frame(WsCode::Away, "the client went away");
                    let _ = tokio::time::timeout(CLOSE_WAIT, owner.close(Some(bye))).await;
                }
            }
        }
        .in_current_span(),
    );
    let mut answer = Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, "websocket")
        .header(header::SEC_WEBSOCKET_ACCEPT, accept);
    if let Some(p) = subprotocol {
        answer = answer.header(header::SEC_WEBSOCKET_PROTOCOL, p);
    }
    answer
        .body(Body::empty())
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The largest frame passed on either way: above every forwarded route's
/// own limit (a terminal's output frame, an event of a control frame's
/// size with its envelope), which the owner enforces; bounds what one
/// direction holds at a time.
fn frame_max(max_control_frame_bytes: usize) -> usize {
    MAX_EXECUTOR_FRAME
        .max(max_control_frame_bytes)
        .saturating_add(64 << 10)
}

/// `ws://host:port` + `path` of the replica at `base` (`http://host:port`,
/// as replicas record it), and the `host:port` to connect to.
fn target(base: &str, path: &str) -> Result<(String, String), DialError> {
    let hostport = base
        .trim_end_matches('/')
        .strip_prefix("http://")
        .filter(|h| !h.is_empty() && !h.contains('/'))
        .ok_or_else(|| DialError::Url(base.to_owned()))?;
    Ok((format!("ws://{hostport}{path}"), hostport.to_owned()))
}

/// Dial the owner's WebSocket of `path`: the client's subprotocol offer
/// and resume point, this harness's API token and the forwarded marker.
/// Returns the socket and the subprotocol the owner chose.
async fn dial(
    base: &str,
    path: &str,
    client: &HeaderMap,
    token: Option<&str>,
    me: &str,
    max: usize,
) -> Result<(WsStream, Option<HeaderValue>), DialError> {
    let (url, hostport) = target(base, path)?;
    let mut request = url
        .into_client_request()
        .map_err(|e| DialError::Request(e.to_string()))?;
    let headers = request.headers_mut();
    for name in UPGRADE_HEADERS {
        for v in client.get_all(&name) {
            headers.append(name.clone(), v.clone());
        }
    }
    let marker = HeaderValue::from_str(me).map_err(|e| DialError::Request(e.to_string()))?;
    headers.insert(forward::FORWARDED, marker);
    if let Some(t) = token {
        let bearer = HeaderValue::from_str(&format!("Bearer {t}"))
            .map_err(|_| DialError::Request("the API token is not a header value".into()))?;
        headers.insert(header::AUTHORIZATION, bearer);
    }
    let tcp = tokio::net::TcpStream::connect(hostport.as_str()).await?;
    tcp.set_nodelay(true)?;
    let io: BoxIo = Box::new(tcp);
    let config = transport::ws_config(max);
    match tokio_tungstenite::client_async_with_config(request, io, Some(config)).await {
        Ok((ws, resp)) => {
            let chosen = resp.headers().get(header::SEC_WEBSOCKET_PROTOCOL).cloned();
            Ok((ws, chosen))
        }
        Err(WsError::Http(answer)) => Err(DialError::Refused(answer)),
        Err(WsError::Protocol(ProtocolError::SecWebSocketSubProtocolError(e))) => {
            Err(DialError::Subprotocol(e.to_string()))
        }
        Err(WsError::Io(e)) => Err(DialError::Io(e)),
        Err(e) => Err(DialError::Handshake(e)),
    }
}

/// The owner's refusal of the upgrade, handed to the client as it came
/// (its status, JSON error body and content type).
fn refused(answer: http::Response<Option<Vec<u8>>>) -> Response {
    let (parts, body) = answer.into_parts();
    let mut out = Response::builder().status(parts.status);
    if let Some(v) = parts.headers.get(header::CONTENT_TYPE) {
        out = out.header(header::CONTENT_TYPE, v.clone());
    }
    out.body(Body::from(body.unwrap_or_default()))
        .unwrap_or_else(|_| ApiError::internal("bad forwarded answer").into_response())
}

fn close_frame(code: WsCode, reason: &'static str) -> CloseFrame {
    CloseFrame {
        code,
        reason: reason.into(),
    }
}

/// Which socket a direction reads.
#[derive(Debug, Clone, Copy)]
enum Side {
    Client,
    Owner,
}

impl Side {
    /// What the other side is told when this one is lost without a close.
    fn lost(self) -> CloseFrame {
        match self {
            Side::Client => close_frame(WsCode::Away, "the client went away"),
            Side::Owner => close_frame(WsCode::Error, "the replica holding it was lost"),
        }
    }
}

/// How a direction ended.
#[derive(Debug)]
enum End {
    /// A close frame came and was passed on (or the other side was gone).
    Closed,
    /// The socket read was lost without a close; the other side was told.
    Lost,
    /// The other side took no frame within [`SEND_WAIT`], or failed.
    Stuck,
}

/// Pass frames both ways until either side closes or is lost; then give
/// the other [`CLOSE_WAIT`] to finish and flush both.
async fn pump(client: WsStream, owner: WsStream) {
    let (mut client_tx, mut client_rx) = client.split();
    let (mut owner_tx, mut owner_rx) = owner.split();
    {
        let up = one_way(&mut client_rx, &mut owner_tx, Side::Client);
        let down = one_way(&mut owner_rx, &mut client_tx, Side::Owner);
        tokio::pin!(up, down);
        tokio::select! {
            end = &mut up => {
                tracing::debug!(?end, "client side ended");
                let _ = tokio::time::timeout(CLOSE_WAIT, down).await;
            }
            end = &mut down => {
                tracing::debug!(?end, "owner side ended");
                let _ = tokio::time::timeout(CLOSE_WAIT, up).await;
            }
        }
    }
    // Close replies still queued go out; a side not closed yet is.
    let _ = tokio::time::timeout(CLOSE_WAIT, client_tx.close()).await;
    let _ = tokio::time::timeout(CLOSE_WAIT, owner_tx.close()).await;
}

/// One direction: read a frame of `from` (the `side` socket), send it on,
/// read the next.
async fn one_way(
    from: &mut SplitStream<WsStream>,
    to: &mut SplitSink<WsStream, Message>,
    side: Side,
) -> End {
    loop {
        let msg = match from.next().await {
            // Raw frames are only ever written, never read.
            Some(Ok(Message::Frame(_))) => continue,
            Some(Ok(m)) => m,
            Some(Err(_)) | None => {
                let bye = Message::Close(Some(side.lost()));
                let _ = tokio::time::timeout(SEND_WAIT, to.send(bye)).await;
                return End::Lost;
            }
        };
        let close = matches!(msg, Message::Close(_));
        let sent = matches!(
            tokio::time::timeout(SEND_WAIT, to.send(msg)).await,
            Ok(Ok(()))
        );
        match (close, sent) {
            (true, _) => return End::Closed,
            (false, true) => {}
            (false, false) => return End::Stuck,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_the_replicas_http_url_as_ws() {
        let (url, hp) = target("http://127.0.0.1:8080", "/v1/sessions/s/events/ws?after=3")
            .ok()
            .unwrap();
        assert_eq!(url, "ws://127.0.0.1:8080/v1/sessions/s/events/ws?after=3");
        assert_eq!(hp, "127.0.0.1:8080");
        assert!(target("http://h:1/", "/x").is_ok());
        for bad in ["https://h:1", "h:1", "http://", "http://h:1/base"] {
            assert!(target(bad, "/x").is_err(), "{bad}");
        }
    }

    #[test]
    fn frames_are_bounded_above_every_routes_limit() {
        assert!(frame_max(0) > MAX_EXECUTOR_FRAME);
        assert!(frame_max(8 << 20) > 8 << 20);
        assert_eq!(frame_max(usize::MAX), usize::MAX);
    }
}

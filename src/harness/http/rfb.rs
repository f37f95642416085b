//! The display relay (`display.rfb`, issue 20): a session's virtual display
//! as VNC (RFB) bytes in binary WebSocket frames, the way noVNC and
//! websockify speak it, relayed like the terminals (docs/terminals.md,
//! "Relay design"): the executor dials out, so nothing listens on its
//! machine.
//!
//! ```text
//! client ──POST /v1/sessions/{id}/display/rfb (API token)──▶ harness: {url}   (viewer ticket)
//! viewer ──ws /v1/relay/rfb/{id.secret}──▶ harness ──display.rfb {host: {url, ticket}}──▶ executor
//!                harness: /v1/relay/display/{ticketId} ◀──ws (bearer = ticket)── executor ◀─unix─▶ x11vnc
//! viewer ◀══ RFB bytes ══▶ relay task ◀══ RFB bytes ══▶ executor
//! ```
//!
//! Two one-time tickets, both `<16 hex id>.<64 hex secret>`, compared in
//! constant time, removed when presented, expiring after
//! `relay_ticket_ttl`:
//!
//! * the **viewer ticket**, minted by the `POST` (which takes the API
//!   token or the console's cookie). It is in the viewer URL's path
//!   because a browser cannot put a header on a WebSocket (noVNC gets a
//!   URL); request logs print `/v1/relay/rfb/***`. It names one session.
//! * the **executor ticket**, minted when the viewer arrives, exactly the
//!   terminal relay's ([`super::relay::Relays`]): its secret travels only
//!   in the executor's `Authorization` header.
//!
//! Bounds: the viewer tickets share `max_pending_tickets`; a relay takes
//! one of `max_relays` places; a viewer's frame is at most 64 KiB, the
//! executor's 1 MiB; each direction is passed on one frame at a time, so
//! the sockets' own flow control paces both ends.

use super::relay::{self, server_ws, switching, ws_accept, Slot};
use super::same_secret;
use crate::harness::api::sessions::Session;
use crate::harness::error::ApiError;
use crate::harness::runtime::Shared;
use crate::wire::transport::WsStream;
use crate::wire::types::{AttachHost, DisplayRfbParams, DisplayRfbResult};
use crate::wire::{ErrorCode, Method, RpcError, Version};
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use futures_util::{SinkExt, StreamExt};
use http::header;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tracing::Instrument;

/// Where viewers connect; the whole viewer ticket follows.
pub const VIEWER_PATH: &str = "/v1/relay/rfb";
/// Where executors dial; the executor ticket's id follows.
pub const EXECUTOR_PATH: &str = "/v1/relay/display";
/// The subprotocol websockify answers and older noVNC offers; echoed when
/// offered (browsers fail the socket when an offered one is not answered).
pub const SUBPROTOCOL: &str = "binary";
/// Largest frame from a viewer: RFB client messages are small (a key, a
/// pointer event, a cut text the server truncates anyway).
pub const MAX_VIEWER_FRAME: usize = 64 << 10;
/// Time the executor has to answer `display.rfb`: start Xvfb (10 s) and
/// x11vnc (10 s) if they are not running, then dial (10 s).
const EXECUTOR_ANSWER: Duration = Duration::from_secs(30);
/// Time between the executor's answer and its socket arriving here.
const DIALED: Duration = Duration::from_secs(5);

struct ViewerTicket {
    secret: String,
    session_id: String,
    expires: Instant,
}

/// Outstanding viewer tickets, in [`Shared`].
#[derive(Default)]
pub struct RfbTickets {
    pending: Mutex<HashMap<String, ViewerTicket>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl RfbTickets {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, ViewerTicket>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new one-time viewer ticket for `session_id`: `id.secret`.
    fn mint(&self, session_id: &str, max: usize, ttl: Duration) -> Result<String, ApiError> {
        let now = Instant::now();
        let mut pending = self.lock();
        pending.retain(|_, t| t.expires > now);
        if pending.len() >= max {
            return Err(ApiError::rpc(
                RpcError::resource_unavailable(format!("{max} RFB tickets are outstanding"))
                    .with_reason("relay_tickets_full"),
            ));
        }
        let id = hex(&rand::random::<[u8; 8]>());
        let secret = hex(&rand::random::<[u8; 32]>());
        pending.insert(
            id.clone(),
            ViewerTicket {
                secret: secret.clone(),
                session_id: session_id.to_owned(),
                expires: now + ttl,
            },
        );
        Ok(format!("{id}.{secret}"))
    }

    /// The session of `ticket` if it is whole and unexpired; it is used up.
    /// A wrong secret leaves the ticket in place (a guess cannot burn it).
    fn redeem(&self, ticket: &str) -> Option<String> {
        let (id, secret) = ticket.split_once('.')?;
        let mut pending = self.lock();
        if !same_secret(&pending.get(id)?.secret, secret) {
            return None;
        }
        let t = pending.remove(id)?;
        (t.expires > Instant::now()).then_some(t.session_id)
    }

    /// Outstanding viewer tickets (for tests and metrics).
    pub fn pending(&self) -> usize {
        self.lock().len()
    }
}

/// The answer of `POST /v1/sessions/{id}/display/rfb`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RfbOffer {
    /// The one-time WebSocket URL of the viewer (give it to noVNC).
    pub url: String,
    /// How long the URL can be opened (once).
    pub expires_in_ms: u64,
}

/// The session's route, if its executor offers `display.rfb`.
async fn rfb_session(shared: &Arc<Shared>, session_id: &str) -> Result<Session, ApiError> {
    let session = Session {
        shared: shared.clone(),
        id: session_id.to_owned(),
    };
    let route = session.route().await?;
    let entry = shared.conns.get(&route.conn).map(|e| e.clone());
    let Some(entry) = entry else {
        return Err(ApiError::rpc(RpcError::capability_unavailable("display")));
    };
    if entry.link.version() < Version::V1_1 {
        return Err(ApiError::rpc(
            RpcError::new(
                ErrorCode::UnsupportedProtocol,
                "display.rfb needs protocol 1.1; this executor negotiated 1",
            )
            .with_reason("unsupported_protocol"),
        ));
    }
    if !entry.capabilities.display.as_ref().is_some_and(|d| d.rfb) {
        return Err(ApiError::rpc(RpcError::capability_unavailable("display")));
    }
    Ok(session)
}

/// `POST /v1/sessions/{id}/display/rfb`: check the session and its
/// executor's `display.rfb` capability, mint a viewer ticket.
///
/// # Errors
/// 404/410/503 for the session as every session route; 501 when its
/// executor does not advertise `display {rfb: true}`; 429 when
/// `max_pending_tickets` viewer tickets are outstanding.
pub(crate) async fn offer(shared: Arc<Shared>, session_id: String) -> Result<RfbOffer, ApiError> {
    rfb_session(&shared, &session_id).await?;
    let ttl = shared.config.relay_ticket_ttl;
    let ticket = shared
        .rfb
        .mint(&session_id, shared.config.max_pending_tickets, ttl)?;
    let base = relay_base(&shared)?;
    Ok(RfbOffer {
        url: format!("{base}{VIEWER_PATH}/{ticket}"),
        expires_in_ms: ttl.as_millis() as u64,
    })
}

fn relay_base(shared: &Shared) -> Result<String, ApiError> {
    shared
        .relay_base
        .get()
        .cloned()
        .ok_or_else(|| ApiError::internal("the relay URL is not set"))
}

/// `GET /v1/relay/rfb/{ticket}`: the viewer's WebSocket. Every refusal is
/// an HTTP error before the upgrade: 401 for a bad, used or expired
/// ticket, then the session's errors, then the executor's.
pub(crate) async fn viewer(shared: Arc<Shared>, ticket: String, req: Request) -> Response {
    match connect(shared, ticket, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn connect(shared: Arc<Shared>, ticket: String, req: Request) -> Result<Response, ApiError> {
    let accept = ws_accept(req.headers())
        .ok_or_else(|| ApiError::bad_request("expected a WebSocket upgrade"))?;
    let Some(session_id) = shared.rfb.redeem(&ticket) else {
        tracing::info!("RFB viewer refused: unknown, used, expired or wrong ticket");
        return Err(ApiError::rpc(
            RpcError::new(ErrorCode::Unauthorized, "invalid RFB ticket").with_reason("bad_ticket"),
        ));
    };
    let span = tracing::info_span!("rfb_relay", session = %session_id);
    async move {
        let subprotocol = req
            .headers()
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|p| p.trim() == SUBPROTOCOL)
            .then_some(SUBPROTOCOL);
        let slot = Slot::take(&shared)?;
        let session = rfb_session(&shared, &session_id).await?;
        let (exec_ticket, dialed) = shared.relays.mint(
            shared.config.max_pending_tickets,
            shared.config.relay_ticket_ttl,
        )?;
        let params = DisplayRfbParams {
            session_id: session_id.clone(),
            host: AttachHost {
                url: format!("{}{EXECUTOR_PATH}/{}", relay_base(&shared)?, exec_ticket.id),
                ticket: exec_ticket.bearer,
            },
        };
        let timeout = shared.config.request_timeout + EXECUTOR_ANSWER;
        let answer: Result<DisplayRfbResult, ApiError> =
            session.request(Method::DisplayRfb, &params, timeout).await;
        let result = match answer {
            Ok(r) => r,
            Err(mut e) => {
                shared.relays.forget(&exec_ticket.id);
                // The executor could not serve the display (as opposed to
                // a full limit, which stays 429): a bad gateway.
                if matches!(e.reason(), Some("display_error" | "relay_unreachable")) {
                    e.status = 502;
                }
                return Err(e);
            }
        };
        let exec = match tokio::time::timeout(DIALED, dialed).await {
            Ok(Ok(ws)) => ws,
            _ => {
                shared.relays.forget(&exec_ticket.id);
                return Err(ApiError::with_status(
                    502,
                    RpcError::internal(
                        "the executor accepted display.rfb but did not dial the relay",
                    )
                    .with_reason("relay_not_dialed"),
                ));
            }
        };
        tracing::info!(display = %result.display, "RFB viewer attached");
        let on_upgrade = hyper::upgrade::on(req);
        let shutdown = shared.shutdown.clone();
        tokio::spawn(
            async move {
                let _slot = slot;
                let mut exec = exec;
                match on_upgrade.await {
                    Ok(up) => {
                        let viewer = server_ws(up, MAX_VIEWER_FRAME).await;
                        let end = pipe(viewer, exec, shutdown).await;
                        tracing::info!(?end, "RFB viewer detached");
                    }
                    Err(e) => {
                        tracing::info!(error = %e, "RFB viewer upgrade failed");
                        let _ = exec.close(None).await;
                    }
                }
            }
            .in_current_span(),
        );
        Ok(switching(accept, subprotocol))
    }
    .instrument(span)
    .await
}

/// Why a relay ended.
#[derive(Debug)]
enum End {
    ViewerGone,
    ViewerTooLarge,
    ExecutorGone,
    Shutdown,
}

/// Pass binary frames both ways until one side ends, then close the
/// other: a viewer that sent too much gets 1009, a harness shutdown 1001,
/// the executor's end (the session or its display ended) 1000.
async fn pipe(
    viewer: WsStream,
    exec: WsStream,
    shutdown: tokio_util::sync::CancellationToken,
) -> End {
    let (mut v_tx, mut v_rx) = viewer.split();
    let (mut e_tx, mut e_rx) = exec.split();
    let up = async {
        loop {
            match v_rx.next().await {
                Some(Ok(Message::Binary(b))) => {
                    if e_tx.send(Message::Binary(b)).await.is_err() {
                        return End::ExecutorGone;
                    }
                }
                Some(Ok(Message::Close(_))) | None => return End::ViewerGone,
                Some(Err(WsError::Capacity(_))) => return End::ViewerTooLarge,
                Some(Err(_)) => return End::ViewerGone,
                // RFB has no text; pings are answered by tungstenite.
                Some(Ok(_)) => {}
            }
        }
    };
    let down = async {
        loop {
            match e_rx.next().await {
                Some(Ok(Message::Binary(b))) => {
                    if v_tx.send(Message::Binary(b)).await.is_err() {
                        return End::ViewerGone;
                    }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return End::ExecutorGone,
                Some(Ok(_)) => {}
            }
        }
    };
    let end = tokio::select! {
        e = up => e,
        e = down => e,
        _ = shutdown.cancelled() => End::Shutdown,
    };
    let (code, reason) = match end {
        End::ViewerGone => (None, ""),
        End::ViewerTooLarge => (Some(relay::close::TOO_LARGE), "frame too large"),
        End::ExecutorGone => (Some(1000), "display stream ended"),
        End::Shutdown => (Some(relay::close::GOING_AWAY), "harness shutting down"),
    };
    let (mut viewer, mut exec) = match (v_tx.reunite(v_rx), e_tx.reunite(e_rx)) {
        (Ok(v), Ok(e)) => (v, e),
        _ => return end,
    };
    let grace = Duration::from_secs(2);
    if let Some(code) = code {
        let frame = CloseFrame {
            code: WsCode::from(code),
            reason: reason.into(),
        };
        let _ = tokio::time::timeout(grace, viewer.close(Some(frame))).await;
    }
    let frame = CloseFrame {
        code: WsCode::Normal,
        reason: "viewer detached".into(),
    };
    let _ = tokio::time::timeout(grace, exec.close(Some(frame))).await;
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn viewer_tickets_are_single_use_bounded_and_expire() {
        let t = RfbTickets::default();
        let ticket = t.mint("s1", 2, Duration::from_secs(10)).unwrap();
        let (id, secret) = ticket.split_once('.').unwrap();
        assert_eq!((id.len(), secret.len()), (16, 64));
        // A wrong secret does not burn it.
        assert_eq!(t.redeem(&format!("{id}.{}", "0".repeat(64))), None);
        assert_eq!(t.redeem(id), None);
        assert_eq!(t.redeem(&ticket).as_deref(), Some("s1"));
        assert_eq!(t.redeem(&ticket), None, "single use");
        let expired = t.mint("s1", 2, Duration::ZERO).unwrap();
        assert_eq!(t.redeem(&expired), None, "expired");
        let _a = t.mint("s1", 2, Duration::from_secs(10)).unwrap();
        let _b = t.mint("s2", 2, Duration::from_secs(10)).unwrap();
        assert_eq!(
            t.mint("s3", 2, Duration::from_secs(10))
                .err()
                .unwrap()
                .status,
            429
        );
    }
}

//! The terminal relay: a viewer's WebSocket
//! (`GET /v1/executors/{id}/terminals/{tid}/attach`) piped to the
//! executor's `host` stream (PROTOCOL.md §8), so terminal bytes never ride
//! the control connection.
//!
//! ```text
//! viewer ──ws──▶ harness: attach ──terminal.attach {host: {url, ticket}}──▶ executor
//!                harness: /v1/relay/terminals/{ticketId} ◀──ws (bearer = ticket)── executor
//! viewer ◀══ binary frames ══▶ relay task ◀══ binary frames ══▶ executor
//! ```
//!
//! * **Tickets** are one-time: `<id>.<secret>` (64 + 256 random bits). The
//!   id is in the relay URL (so logs can name it), the whole ticket is the
//!   bearer token (so the secret never appears in a path). A ticket is
//!   removed when it is presented with the right secret, when it expires
//!   (`relay_ticket_ttl`, 15 s) or when its attach fails. At most
//!   `max_pending_tickets` are outstanding.
//! * **Frames** are passed on as they are, after a check: from the
//!   executor only ops 1 and 3, from the viewer only op 2, and only while
//!   this relay holds the writer epoch (otherwise the viewer gets a
//!   `not_writer` notice and the bytes are dropped).
//! * **Control messages** are text frames: the viewer may send
//!   `{"type":"resize","cols":C,"rows":R}` (turned into `terminal.resize`
//!   with this relay's stream and epoch). The relay sends `attached`,
//!   `error`, `resized` and `exited` notices.
//! * **Close codes** to the viewer: see [`close`].

use super::same_secret;
use crate::harness::api::terminals::{unknown_terminal, TerminalEnd, Terminals};
use crate::harness::error::ApiError;
use crate::harness::runtime::Shared;
use crate::terminal::frame::{self, OP_INPUT, OP_OUTPUT, OP_SNAPSHOT};
use crate::wire::transport::{self, BoxIo, WsStream};
use crate::wire::types::{AttachHost, TerminalAttachParams, TerminalAttachResult};
use crate::wire::{CallError, ErrorCode, Method, RpcError};
use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{header, StatusCode};
use serde::Deserialize;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;
use tracing::Instrument;

/// Path prefix the executor dials; the ticket id follows.
pub const RELAY_PATH: &str = "/v1/relay/terminals";
/// Subprotocol a viewer may offer; the relay echoes it (browsers require
/// an answer when they offer one).
pub const SUBPROTOCOL: &str = "bmx.terminal.v1";

/// Largest frame from a viewer: 64 KiB of input plus the header.
pub const MAX_VIEWER_FRAME: usize = (64 << 10) + frame::HEADER_LEN;
/// Largest frame from the executor (the executor reads its PTY 64 KiB at
/// a time; 1 MiB leaves room).
pub const MAX_EXECUTOR_FRAME: usize = (1 << 20) + frame::HEADER_LEN;
/// Largest text (control) message from a viewer.
const MAX_CONTROL: usize = 4096;
/// How long the relay waits, after `terminal.exited`, for the output the
/// executor had not streamed yet.
const EXIT_DRAIN: Duration = Duration::from_secs(3);
/// How long the relay waits, after the executor's stream ended, for the
/// reason (`terminal.exited` or a close) to arrive on the control link.
const END_GRACE: Duration = Duration::from_secs(2);

/// Close codes the relay sends the viewer.
pub mod close {
    /// The program ended; the reason is `exited <code>`.
    pub const EXITED: u16 = 1000;
    /// The harness is shutting down.
    pub const GOING_AWAY: u16 = 1001;
    /// The viewer sent a frame above [`MAX_VIEWER_FRAME`](super::MAX_VIEWER_FRAME).
    pub const TOO_LARGE: u16 = 1009;
    /// The terminal was closed (`DELETE`, or the executor forgot it).
    pub const TERMINAL_CLOSED: u16 = 4100;
    /// The executor's stream ended for another reason (executor lost or
    /// restarted, stream evicted): re-attach to continue.
    pub const STREAM_ENDED: u16 = 4102;
}

/// A minted ticket.
pub struct Ticket {
    /// Public part, in the relay URL.
    pub id: String,
    /// `id.secret`: the bearer token the executor presents.
    pub bearer: String,
}

struct Pending {
    secret: String,
    expires: Instant,
    tx: oneshot::Sender<WsStream>,
}

/// The relay's state in [`Shared`]: outstanding tickets and the count of
/// live relays.
#[derive(Default)]
pub struct Relays {
    pending: Mutex<HashMap<String, Pending>>,
    live: AtomicUsize,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn busy(detail: impl Into<String>, reason: &str) -> ApiError {
    ApiError::rpc(RpcError::resource_unavailable(detail).with_reason(reason))
}

impl Relays {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pending>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new one-time ticket; the executor's socket arrives on the receiver.
    pub fn mint(
        &self,
        max: usize,
        ttl: Duration,
    ) -> Result<(Ticket, oneshot::Receiver<WsStream>), ApiError> {
        let now = Instant::now();
        let mut pending = self.lock();
        pending.retain(|_, p| p.expires > now && !p.tx.is_closed());
        if pending.len() >= max {
            return Err(busy(
                format!("{max} relay tickets are outstanding"),
                "relay_tickets_full",
            ));
        }
        let id = hex(&rand::random::<[u8; 8]>());
        let secret = hex(&rand::random::<[u8; 32]>());
        let (tx, rx) = oneshot::channel();
        pending.insert(
            id.clone(),
            Pending {
                secret: secret.clone(),
                expires: now + ttl,
                tx,
            },
        );
        Ok((
            Ticket {
                bearer: format!("{id}.{secret}"),
                id,
            },
            rx,
        ))
    }

    /// Take the ticket `id` if `bearer` is its whole, unexpired ticket.
    /// A wrong secret leaves the ticket in place (a guess cannot burn it).
    fn redeem(&self, id: &str, bearer: Option<&str>) -> Option<oneshot::Sender<WsStream>> {
        let (bid, secret) = bearer?.split_once('.')?;
        if !same_secret(bid, id) {
            return None;
        }
        let mut pending = self.lock();
        let p = pending.get(id)?;
        if !same_secret(&p.secret, secret) {
            return None;
        }
        let p = pending.remove(id)?;
        (p.expires > Instant::now()).then_some(p.tx)
    }

    /// Drop ticket `id` (its attach gave up).
    pub(crate) fn forget(&self, id: &str) {
        self.lock().remove(id);
    }

    /// Outstanding tickets (for tests and metrics).
    pub fn pending(&self) -> usize {
        self.lock().len()
    }

    /// Relays running now.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }
}

/// One place among `max_relays` (terminal and display relays alike);
/// given back on drop.
pub(crate) struct Slot(Arc<Shared>);

impl Slot {
    pub(crate) fn take(shared: &Arc<Shared>) -> Result<Slot, ApiError> {
        let max = shared.config.max_relays;
        let r = &shared.relays;
        let mut n = r.live.load(Ordering::Relaxed);
        loop {
            if n >= max {
                return Err(busy(
                    format!("{max} relay viewers are attached"),
                    "relays_full",
                ));
            }
            match r
                .live
                .compare_exchange(n, n + 1, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Ok(Slot(shared.clone())),
                Err(now) => n = now,
            }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.relays.live.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The base URL executors dial for relays: `public_url` with an http(s)
/// scheme turned into ws(s), else `ws://` + the bound address.
pub fn relay_base(public_url: Option<&str>, bound: SocketAddr) -> Result<String, String> {
    match public_url {
        Some(u) => {
            let u = u.trim().trim_end_matches('/');
            let converted = if let Some(rest) = u.strip_prefix("http://") {
                format!("ws://{rest}")
            } else if let Some(rest) = u.strip_prefix("https://") {
                format!("wss://{rest}")
            } else if u.starts_with("ws://") || u.starts_with("wss://") {
                u.to_owned()
            } else {
                return Err(format!(
                    "public URL {u:?} must start with http://, https://, ws:// or wss://"
                ));
            };
            let host = converted.split("://").nth(1).unwrap_or_default();
            if host.is_empty() || host.starts_with('/') {
                return Err(format!("public URL {u:?} has no host"));
            }
            Ok(converted)
        }
        None => {
            let ip = match bound.ip() {
                IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
                ip => ip,
            };
            Ok(format!("ws://{}", SocketAddr::new(ip, bound.port())))
        }
    }
}

pub(crate) use crate::wire::transport::ws_accept;

pub(crate) fn switching(accept: String, subprotocol: Option<&'static str>) -> Response {
    let mut b = Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, "websocket")
        .header(header::SEC_WEBSOCKET_ACCEPT, accept);
    if let Some(p) = subprotocol {
        b = b.header(header::SEC_WEBSOCKET_PROTOCOL, p);
    }
    b.body(Body::empty())
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

pub(crate) async fn server_ws(upgraded: hyper::upgrade::Upgraded, max: usize) -> WsStream {
    let io: BoxIo = Box::new(hyper_util::rt::TokioIo::new(upgraded));
    WebSocketStream::from_raw_socket(io, Role::Server, Some(transport::ws_config(max))).await
}

/// `GET /v1/relay/terminals/{ticketId}`: the executor's side. Only a valid
/// ticket is upgraded; anything else is 401 (or 400 for a non-upgrade).
pub(crate) async fn executor_dial(
    shared: Arc<Shared>,
    ticket_id: String,
    req: Request,
) -> Response {
    let Some(accept) = ws_accept(req.headers()) else {
        return ApiError::bad_request("expected a WebSocket upgrade").into_response();
    };
    let Some(tx) = shared
        .relays
        .redeem(&ticket_id, transport::bearer(req.headers()))
    else {
        tracing::info!(ticket = %ticket_id, "relay dial refused: unknown, used, expired or wrong ticket");
        return ApiError::rpc(
            RpcError::new(ErrorCode::Unauthorized, "invalid relay ticket")
                .with_reason("bad_ticket"),
        )
        .into_response();
    };
    let on_upgrade = hyper::upgrade::on(req);
    tokio::spawn(
        async move {
            match on_upgrade.await {
                Ok(up) => {
                    let ws = server_ws(up, MAX_EXECUTOR_FRAME).await;
                    // The attach gave up meanwhile: the socket just closes.
                    let _ = tx.send(ws);
                }
                Err(e) => tracing::info!(error = %e, "relay upgrade failed"),
            }
        }
        .in_current_span(),
    );
    switching(accept, None)
}

/// The attach query.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AttachQuery {
    /// Replay from this seq (default: the oldest retained chunk).
    pub from_seq: Option<u64>,
    /// `1`/`true`: take the writer role.
    pub write: Option<String>,
    /// Name of the stream (default: a fresh `v-<uuid>`).
    pub stream_id: Option<String>,
}

fn flag(v: Option<&str>) -> Result<bool, ApiError> {
    match v.map(str::trim) {
        None | Some("") | Some("0") | Some("false") => Ok(false),
        Some("1") | Some("true") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!(
            "write must be 1, 0, true or false, not {other:?}"
        ))),
    }
}

/// `GET /v1/executors/{id}/terminals/{tid}/attach`: the viewer's side.
/// Every refusal (unknown terminal, executor down, limits) is an HTTP error
/// before the upgrade.
pub(crate) async fn viewer_attach(
    shared: Arc<Shared>,
    executor_id: String,
    terminal_id: String,
    query: AttachQuery,
    req: Request,
) -> Response {
    let span =
        tracing::info_span!("terminal_relay", executor = %executor_id, terminal = %terminal_id);
    match attach(shared, executor_id, terminal_id, query, req)
        .instrument(span)
        .await
    {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn attach(
    shared: Arc<Shared>,
    executor_id: String,
    terminal_id: String,
    q: AttachQuery,
    req: Request,
) -> Result<Response, ApiError> {
    let accept = ws_accept(req.headers())
        .ok_or_else(|| ApiError::bad_request("expected a WebSocket upgrade"))?;
    let subprotocol = req
        .headers()
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == SUBPROTOCOL)
        .then_some(SUBPROTOCOL);
    let write = flag(q.write.as_deref())?;
    let stream_id = q
        .stream_id
        .unwrap_or_else(|| format!("v-{}", uuid::Uuid::new_v4().simple()));
    if stream_id.is_empty() || stream_id.len() > 128 {
        return Err(ApiError::bad_request(
            "streamId must be 1 to 128 characters",
        ));
    }
    let slot = Slot::take(&shared)?;
    let terminals = Terminals {
        shared: shared.clone(),
    };
    let registry = &shared.terminals;
    // Where the scrollback starts and which epoch writes now.
    let snap = terminals.snapshot(&executor_id, &terminal_id).await?;
    let from_seq = q.from_seq.unwrap_or(snap.earliest_seq);
    let epoch = if write {
        registry
            .next_epoch(&executor_id, &terminal_id, snap.epoch)
            .ok_or_else(|| unknown_terminal(&executor_id, &terminal_id))?
    } else {
        0
    };
    let end = registry
        .watch(&executor_id, &terminal_id)
        .ok_or_else(|| unknown_terminal(&executor_id, &terminal_id))?;
    let (ticket, dialed) = shared.relays.mint(
        shared.config.max_pending_tickets,
        shared.config.relay_ticket_ttl,
    )?;
    let base = shared
        .relay_base
        .get()
        .cloned()
        .ok_or_else(|| ApiError::internal("the relay URL is not set"))?;
    let params = TerminalAttachParams {
        terminal_id: terminal_id.clone(),
        stream_id: stream_id.clone(),
        from_seq,
        ack_seq: None,
        can_write: write,
        epoch,
        host: Some(AttachHost {
            url: format!("{base}{RELAY_PATH}/{}", ticket.id),
            ticket: ticket.bearer,
        }),
    };
    let link = terminals.link(&executor_id)?;
    // The executor answers after dialing the relay (up to 10 s).
    let timeout = shared.config.request_timeout + Duration::from_secs(10);
    let answer = link
        .request::<_, TerminalAttachResult>(Method::TerminalAttach, &params, timeout)
        .await;
    let result = match answer {
        Ok(r) => r,
        Err(e) => {
            shared.relays.forget(&ticket.id);
            if let CallError::Rpc(r) = &e {
                if r.kind() == Some(ErrorCode::NotFound) {
                    registry.remove(&executor_id, &terminal_id);
                    return Err(unknown_terminal(&executor_id, &terminal_id));
                }
            }
            return Err(ApiError::from_call(e));
        }
    };
    registry.observe_epoch(&executor_id, &terminal_id, result.writer_epoch);
    let writer = write && result.writer_epoch == epoch;
    let exec = match tokio::time::timeout(Duration::from_secs(5), dialed).await {
        Ok(Ok(ws)) => ws,
        _ => {
            shared.relays.forget(&ticket.id);
            return Err(ApiError::with_status(
                502,
                RpcError::internal("the executor accepted the attach but did not dial the relay")
                    .with_reason("relay_not_dialed"),
            ));
        }
    };
    tracing::info!(stream = %stream_id, writer, epoch, from_seq, "viewer attached");
    let on_upgrade = hyper::upgrade::on(req);
    let pipe_span = tracing::Span::current();
    tokio::spawn(
        async move {
            let mut exec = exec;
            match on_upgrade.await {
                Ok(up) => {
                    let viewer = server_ws(up, MAX_VIEWER_FRAME).await;
                    Pipe {
                        terminals,
                        executor_id,
                        terminal_id,
                        stream_id,
                        epoch,
                        writer,
                        from_seq,
                        viewer,
                        exec,
                        end,
                        last_seq: 0,
                        refused: false,
                        _slot: slot,
                    }
                    .run()
                    .await
                }
                Err(e) => {
                    tracing::info!(error = %e, "viewer upgrade failed");
                    let _ = exec.close(None).await;
                }
            }
        }
        .instrument(pipe_span),
    );
    Ok(switching(accept, subprotocol))
}

/// A text message from the viewer.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ViewerControl {
    Resize { cols: u16, rows: u16 },
}

/// Why a relay ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    Exited(i32),
    Closed,
    StreamEnded,
    ViewerGone,
    ViewerTooLarge,
    Shutdown,
}

struct Pipe {
    terminals: Terminals,
    executor_id: String,
    terminal_id: String,
    stream_id: String,
    epoch: u64,
    writer: bool,
    from_seq: u64,
    viewer: WsStream,
    exec: WsStream,
    end: watch::Receiver<TerminalEnd>,
    /// Highest seq passed to the viewer.
    last_seq: u64,
    /// A `not_writer` notice was sent since the last accepted input.
    refused: bool,
    _slot: Slot,
}

fn notice(v: serde_json::Value) -> Message {
    Message::text(v.to_string())
}

impl Pipe {
    fn shared(&self) -> &Shared {
        &self.terminals.shared
    }

    /// Still the writer: asked for it, got it, and no later `write=1`
    /// attach through this harness took a higher epoch.
    fn is_writer(&self) -> bool {
        self.writer
            && self
                .shared()
                .terminals
                .epoch(&self.executor_id, &self.terminal_id)
                == Some(self.epoch)
    }

    async fn run(mut self) {
        let (eid, tid) = (self.executor_id.clone(), self.terminal_id.clone());
        self.shared().terminals.viewers(&eid, &tid, 1);
        let hello = notice(serde_json::json!({
            "type": "attached", "executorId": eid, "terminalId": tid,
            "streamId": self.stream_id, "writer": self.writer, "epoch": self.epoch,
            "fromSeq": self.from_seq,
        }));
        let outcome = if self.viewer.send(hello).await.is_err() {
            Outcome::ViewerGone
        } else {
            self.pump().await
        };
        tracing::info!(stream = %self.stream_id, ?outcome, "viewer detached");
        self.finish(outcome).await;
        self.shared().terminals.viewers(&eid, &tid, -1);
    }

    async fn pump(&mut self) -> Outcome {
        let (notices_tx, mut notices) = mpsc::channel::<Message>(16);
        let shutdown = self.shared().shutdown.clone();
        // (drain until this seq, deadline, exit code) after terminal.exited.
        let mut drain: Option<(u64, tokio::time::Instant, i32)> = None;
        let initial = *self.end.borrow_and_update();
        match initial {
            TerminalEnd::Exited(code) => drain = Some(self.drain_target(code).await),
            TerminalEnd::Closed => return Outcome::Closed,
            TerminalEnd::Running => {}
        }
        loop {
            if let Some((until, _, code)) = drain {
                if self.last_seq >= until {
                    return Outcome::Exited(code);
                }
            }
            let deadline = drain.map(|d| d.1);
            tokio::select! {
                m = self.exec.next() => match m {
                    Some(Ok(Message::Binary(b))) => {
                        match frame::parse(&b) {
                            Some((OP_OUTPUT | OP_SNAPSHOT, seq, _)) => {
                                self.last_seq = self.last_seq.max(seq);
                                if self.viewer.send(Message::Binary(b)).await.is_err() {
                                    return Outcome::ViewerGone;
                                }
                            }
                            _ => tracing::debug!("dropped a malformed frame from the executor"),
                        }
                    }
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return self.exec_ended().await,
                    Some(Ok(_)) => {}
                },
                m = self.viewer.next() => match m {
                    Some(Ok(Message::Binary(b))) => {
                        if !self.input(b).await {
                            return self.exec_ended().await;
                        }
                    }
                    Some(Ok(Message::Text(t))) => self.control(t.as_str(), &notices_tx),
                    Some(Ok(Message::Close(_))) | None => return Outcome::ViewerGone,
                    Some(Err(WsError::Capacity(_))) => return Outcome::ViewerTooLarge,
                    Some(Err(_)) => return Outcome::ViewerGone,
                    Some(Ok(_)) => {}
                },
                Some(n) = notices.recv() => {
                    if self.viewer.send(n).await.is_err() {
                        return Outcome::ViewerGone;
                    }
                }
                changed = self.end.changed() => {
                    let now = if changed.is_err() { TerminalEnd::Closed } else { *self.end.borrow_and_update() };
                    match now {
                        TerminalEnd::Exited(code) if drain.is_none() => drain = Some(self.drain_target(code).await),
                        TerminalEnd::Closed => return Outcome::Closed,
                        _ => {}
                    }
                }
                _ = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)), if deadline.is_some() => {
                    if let Some((_, _, code)) = drain {
                        return Outcome::Exited(code);
                    }
                }
                _ = shutdown.cancelled() => return Outcome::Shutdown,
            }
        }
    }

    /// After `terminal.exited`: the executor has read the PTY dry, so its
    /// `latestSeq` is the last chunk; wait (bounded) until it passed.
    async fn drain_target(&mut self, code: i32) -> (u64, tokio::time::Instant, i32) {
        let deadline = tokio::time::Instant::now() + EXIT_DRAIN;
        match self
            .terminals
            .snapshot(&self.executor_id, &self.terminal_id)
            .await
        {
            Ok(s) => (s.latest_seq, deadline, code),
            // Unknown: give in-flight frames a moment.
            Err(_) => (
                u64::MAX,
                tokio::time::Instant::now() + Duration::from_millis(500),
                code,
            ),
        }
    }

    /// The executor's socket ended: learn why from the control link
    /// (bounded), the exit or close usually arrives there around the same time.
    async fn exec_ended(&mut self) -> Outcome {
        let wait = async {
            loop {
                match *self.end.borrow_and_update() {
                    TerminalEnd::Exited(code) => return Outcome::Exited(code),
                    TerminalEnd::Closed => return Outcome::Closed,
                    TerminalEnd::Running => {}
                }
                if self.end.changed().await.is_err() {
                    return Outcome::Closed;
                }
            }
        };
        tokio::time::timeout(END_GRACE, wait)
            .await
            .unwrap_or(Outcome::StreamEnded)
    }

    /// Input from the viewer; `false` when the executor's socket failed.
    async fn input(&mut self, b: Bytes) -> bool {
        match frame::parse(&b) {
            Some((OP_INPUT, _, data)) if !data.is_empty() => {}
            _ => {
                tracing::debug!("ignored a viewer frame that is not op 2 input");
                return true;
            }
        }
        if !self.is_writer() {
            if !self.refused {
                self.refused = true;
                let n = notice(serde_json::json!({
                    "type": "error", "reason": "not_writer",
                    "message": "this viewer does not hold the writer role; its input is dropped",
                }));
                let _ = self.viewer.send(n).await;
            }
            return true;
        }
        self.refused = false;
        self.exec.send(Message::Binary(b)).await.is_ok()
    }

    /// A text message from the viewer: a resize, sent as `terminal.resize`
    /// in a task (the output keeps flowing meanwhile); its outcome comes
    /// back as a notice.
    fn control(&mut self, text: &str, notices: &mpsc::Sender<Message>) {
        let parsed = if text.len() > MAX_CONTROL {
            Err(format!(
                "control messages are limited to {MAX_CONTROL} bytes"
            ))
        } else {
            serde_json::from_str::<ViewerControl>(text).map_err(|e| e.to_string())
        };
        let ViewerControl::Resize { cols, rows } = match parsed {
            Ok(c) => c,
            Err(e) => {
                let _ = notices.try_send(notice(serde_json::json!({
                    "type": "error", "reason": "bad_control", "message": e,
                })));
                return;
            }
        };
        let terminals = self.terminals.clone();
        let (eid, tid) = (self.executor_id.clone(), self.terminal_id.clone());
        let stream = (self.stream_id.clone(), self.epoch);
        let notices = notices.clone();
        tokio::spawn(
            async move {
                let n = match terminals.resize(&eid, &tid, cols, rows, Some(stream)).await {
                    Ok(()) => serde_json::json!({"type": "resized", "cols": cols, "rows": rows}),
                    Err(e) => serde_json::json!({
                        "type": "error", "reason": e.reason().unwrap_or("resize_failed"),
                        "code": e.code(), "message": e.error.message,
                    }),
                };
                let _ = notices.try_send(notice(n));
            }
            .in_current_span(),
        );
    }

    async fn finish(&mut self, outcome: Outcome) {
        let (code, reason) = match &outcome {
            Outcome::Exited(c) => {
                let n = notice(serde_json::json!({"type": "exited", "exitCode": c}));
                let _ = tokio::time::timeout(Duration::from_secs(2), self.viewer.send(n)).await;
                (close::EXITED, format!("exited {c}"))
            }
            Outcome::Closed => (close::TERMINAL_CLOSED, "terminal closed".to_owned()),
            Outcome::StreamEnded => (close::STREAM_ENDED, "executor stream ended".to_owned()),
            Outcome::Shutdown => (close::GOING_AWAY, "harness shutting down".to_owned()),
            Outcome::ViewerTooLarge => (close::TOO_LARGE, "frame too large".to_owned()),
            Outcome::ViewerGone => (close::EXITED, String::new()),
        };
        if outcome != Outcome::ViewerGone {
            let frame = CloseFrame {
                code: WsCode::from(code),
                reason: reason.into(),
            };
            let _ =
                tokio::time::timeout(Duration::from_secs(2), self.viewer.close(Some(frame))).await;
        }
        let frame = CloseFrame {
            code: WsCode::Normal,
            reason: "viewer detached".into(),
        };
        let _ = tokio::time::timeout(Duration::from_secs(2), self.exec.close(Some(frame))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_are_single_use_and_need_the_secret() {
        let r = Relays::default();
        let (t, _rx) = r.mint(4, Duration::from_secs(10)).unwrap();
        let (id, secret) = t.bearer.split_once('.').unwrap();
        assert_eq!(id, t.id);
        assert_eq!(secret.len(), 64);
        // A wrong secret does not burn the ticket.
        assert!(r
            .redeem(&t.id, Some(&format!("{id}.{}", "0".repeat(64))))
            .is_none());
        assert!(r.redeem(&t.id, None).is_none());
        assert!(r.redeem("other", Some(&t.bearer)).is_none());
        assert!(r.redeem(&t.id, Some(&t.bearer)).is_some());
        assert!(r.redeem(&t.id, Some(&t.bearer)).is_none(), "single use");
    }

    #[test]
    fn tickets_expire_and_are_bounded() {
        let r = Relays::default();
        let (t, _rx) = r.mint(2, Duration::ZERO).unwrap();
        assert!(r.redeem(&t.id, Some(&t.bearer)).is_none(), "expired");
        let (_a, _ra) = r.mint(2, Duration::from_secs(10)).unwrap();
        let (_b, _rb) = r.mint(2, Duration::from_secs(10)).unwrap();
        let e = r.mint(2, Duration::from_secs(10)).err().unwrap();
        assert_eq!(e.status, 429);
        // A ticket whose attach gave up (receiver dropped) frees its place.
        drop(_rb);
        assert!(r.mint(2, Duration::from_secs(10)).is_ok());
    }

    #[test]
    fn relay_urls() {
        let a: SocketAddr = "0.0.0.0:7070".parse().unwrap();
        assert_eq!(relay_base(None, a).unwrap(), "ws://127.0.0.1:7070");
        let a: SocketAddr = "[::]:7".parse().unwrap();
        assert_eq!(relay_base(None, a).unwrap(), "ws://[::1]:7");
        assert_eq!(
            relay_base(Some("https://h.example/bmx/"), a).unwrap(),
            "wss://h.example/bmx"
        );
        assert_eq!(
            relay_base(Some("http://10.0.0.1:7070"), a).unwrap(),
            "ws://10.0.0.1:7070"
        );
        assert!(relay_base(Some("ftp://x"), a).is_err());
        assert!(relay_base(Some("http://"), a).is_err());
    }

    #[test]
    fn control_messages_parse_strictly() {
        assert_eq!(
            serde_json::from_str::<ViewerControl>(r#"{"type":"resize","cols":100,"rows":30}"#)
                .unwrap(),
            ViewerControl::Resize {
                cols: 100,
                rows: 30
            }
        );
        assert!(
            serde_json::from_str::<ViewerControl>(r#"{"type":"resize","cols":-1,"rows":3}"#)
                .is_err()
        );
        assert!(serde_json::from_str::<ViewerControl>(r#"{"type":"nope"}"#).is_err());
        assert!(flag(Some("1")).unwrap());
        assert!(!flag(None).unwrap());
        assert!(flag(Some("yes")).is_err());
    }
}

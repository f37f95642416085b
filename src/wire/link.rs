//! One live connection's I/O: the sending half ([`Writer`]: frames written
//! by their sender, a task for what the transport cannot take at once), a
//! reader loop that routes frames, and the correlator for requests this
//! side sends.
//!
//! A [`Link`] is a cheap, cloneable handle actors keep to send frames. The
//! reader hands each request or notification to a [`Dispatch`] (the router)
//! together with a [`Responder`]: the owning actor answers through the
//! responder whenever it is done, so no frame path ever waits on an actor
//! round trip (`call!`), and a responder dropped without an answer still
//! answers -32603, so no request is silently lost.

use super::codec::{Codec, CodecError};
use super::error::{CloseCode, RpcError};
use super::frame::{
    FrameKind, Id, Inbound, OutError, OutNotification, OutRequest, OutResult, JSONRPC,
};
use super::method::{Method, Version};
use super::pending::Pending;
use super::transport::{Transport, WsStream};
use super::writer::{frame_len, Writer};
use bytes::Bytes;
use futures_util::stream::SplitStream;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_util::sync::CancellationToken;

/// Routes inbound requests and notifications to their owners. Implementations
/// must not block: look the owner up, cast, return.
pub trait Dispatch: Send + Sync + 'static {
    fn dispatch(&self, frame: Inbound, reply: Option<Responder>);
}

/// Why an outgoing request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CallError {
    #[error("peer answered with an error: {0}")]
    Rpc(RpcError),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("connection closed")]
    Closed,
    #[error("undecodable answer: {0}")]
    Decode(String),
    /// Refused before sending: the frame would pass the limit the peer
    /// announced, and the peer would close the whole connection (1009).
    #[error("a {size}-byte frame exceeds the peer's {limit}-byte limit")]
    TooLarge { size: usize, limit: usize },
}

/// Per-connection limits the reader enforces.
#[derive(Debug, Clone, Copy)]
pub struct LinkLimits {
    /// Frames above this size are refused with close 1009, except `mcp.frame`.
    pub max_control_frame_bytes: usize,
    /// The cap for `mcp.frame` (and the transport's hard cap).
    pub max_mcp_frame_bytes: usize,
    /// Requests from the peer being handled at once; the reader stops reading
    /// (TCP back-pressure) while all are taken.
    pub max_in_flight: usize,
}

impl Default for LinkLimits {
    fn default() -> Self {
        LinkLimits {
            max_control_frame_bytes: 1 << 20,
            max_mcp_frame_bytes: 4 << 20,
            max_in_flight: 1024,
        }
    }
}

type Waiter = oneshot::Sender<Result<Inbound, RpcError>>;

/// The frame limit assumed for a peer that announces none: PROTOCOL.md's
/// default `maxControlFrameBytes`.
pub const DEFAULT_PEER_FRAME_BYTES: usize = 1 << 20;

struct Inner {
    codec: Codec,
    version: Version,
    id_prefix: &'static str,
    out: Arc<Writer>,
    /// Requests in flight and "closed", under one lock (see [`Pending`]).
    pending: Mutex<Pending<String, Waiter>>,
    /// The largest frame the peer accepts; requests above it are refused
    /// here, never sent.
    peer_max_frame: AtomicUsize,
    next_id: AtomicU64,
    closed: CancellationToken,
    started: Instant,
    last_inbound_ms: AtomicU64,
    in_flight: Arc<Semaphore>,
}

/// A handle to one live connection.
#[derive(Clone)]
pub struct Link {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("codec", &self.inner.codec)
            .field("closed", &self.inner.closed.is_cancelled())
            .finish()
    }
}

/// How a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    /// The close code, if a close frame was seen (either direction).
    pub code: Option<CloseCode>,
    pub reason: String,
    /// Whether the peer sent the close (false: we closed or the socket broke).
    pub by_peer: bool,
}

impl Link {
    /// Start a connection's I/O: spawns the writer task and returns the link
    /// and the reader, which the owner runs with [`Reader::run`].
    pub fn start(
        transport: Transport,
        id_prefix: &'static str,
        limits: LinkLimits,
    ) -> (Link, Reader) {
        let (sink, stream) = transport.ws.split();
        let closed = CancellationToken::new();
        let (out, write_task) = Writer::start(sink, closed.clone());
        let inner = Arc::new(Inner {
            codec: transport.subprotocol.codec,
            version: transport.subprotocol.version,
            id_prefix,
            out,
            pending: Mutex::new(Pending::new()),
            peer_max_frame: AtomicUsize::new(DEFAULT_PEER_FRAME_BYTES),
            next_id: AtomicU64::new(1),
            closed: closed.clone(),
            started: Instant::now(),
            last_inbound_ms: AtomicU64::new(0),
            in_flight: Arc::new(Semaphore::new(limits.max_in_flight)),
        });
        tokio::spawn(write_task);
        let link = Link { inner };
        let reader = Reader {
            stream,
            link: link.clone(),
            limits,
        };
        (link, reader)
    }

    pub fn codec(&self) -> Codec {
        self.inner.codec
    }

    /// Whether both handles are of the same connection.
    pub fn same_as(&self, other: &Link) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    pub fn version(&self) -> Version {
        self.inner.version
    }

    pub fn is_closed(&self) -> bool {
        self.inner.closed.is_cancelled()
    }

    /// Resolves when the connection is gone.
    pub async fn closed(&self) {
        self.inner.closed.cancelled().await
    }

    /// Set the largest frame the peer accepts (from its register
    /// advertisement). Requests whose frame is larger fail with
    /// [`CallError::TooLarge`] without being sent.
    pub fn set_peer_max_frame_bytes(&self, bytes: usize) {
        self.inner.peer_max_frame.store(bytes, Ordering::Relaxed);
    }

    pub fn peer_max_frame_bytes(&self) -> usize {
        self.inner.peer_max_frame.load(Ordering::Relaxed)
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Pending<String, Waiter>> {
        // A panic while holding this lock cannot leave the map half
        // updated (every operation is one map call): keep going.
        self.inner.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fail every request waiting for an answer and refuse new ones.
    fn fail_pending(&self) {
        let waiters = self.pending().close();
        // Dropped outside the lock: each drop wakes a waiter with Closed.
        drop(waiters);
    }

    /// Time since the last inbound frame of any kind.
    pub fn idle_for(&self) -> Duration {
        let now = self.inner.started.elapsed().as_millis() as u64;
        Duration::from_millis(
            now.saturating_sub(self.inner.last_inbound_ms.load(Ordering::Relaxed)),
        )
    }

    fn touch(&self) {
        let now = self.inner.started.elapsed().as_millis() as u64;
        self.inner.last_inbound_ms.store(now, Ordering::Relaxed);
    }

    fn send_message(&self, msg: Message) -> Result<(), CallError> {
        self.inner.out.send(msg).map_err(|_| CallError::Closed)
    }

    fn encode<T: Serialize>(&self, value: &T) -> Result<Message, CallError> {
        self.inner
            .codec
            .encode(value)
            .map_err(|e: CodecError| CallError::Decode(e.to_string()))
    }

    /// Send a notification.
    pub fn notify<P: Serialize>(&self, method: Method, params: &P) -> Result<(), CallError> {
        let msg = self.encode(&OutNotification {
            jsonrpc: JSONRPC,
            method: method.as_str(),
            params,
        })?;
        self.send_message(msg)
    }

    /// Send a request and wait for its answer, at most `timeout`.
    ///
    /// # Errors
    ///
    /// [`CallError::Closed`] when the connection is closed before the
    /// answer (also when it was already closed: the request is never left
    /// waiting), [`CallError::TooLarge`] when the frame would pass the
    /// peer's limit (nothing is sent), [`CallError::Timeout`],
    /// [`CallError::Rpc`] for an error answer.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the request sent; its waiter stays
    /// registered until the answer arrives (and finds nobody) or the
    /// connection closes.
    pub async fn request<P: Serialize, R: DeserializeOwned>(
        &self,
        method: Method,
        params: &P,
        timeout: Duration,
    ) -> Result<R, CallError> {
        let n = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}{n}", self.inner.id_prefix);
        let msg = self.encode(&OutRequest {
            jsonrpc: JSONRPC,
            id: &id,
            method: method.as_str(),
            params,
        })?;
        let size = frame_len(&msg);
        let limit = self.peer_max_frame_bytes();
        if size > limit {
            return Err(CallError::TooLarge { size, limit });
        }
        let (tx, rx) = oneshot::channel();
        if self.pending().insert(id.clone(), tx).is_err() {
            return Err(CallError::Closed);
        }
        if let Err(e) = self.send_message(msg) {
            self.pending().take(&id);
            return Err(e);
        }
        let answer = match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => return Err(CallError::Closed),
            Err(_) => {
                self.pending().take(&id);
                return Err(CallError::Timeout(timeout));
            }
        };
        match answer {
            Ok(frame) => frame.result().map_err(|e| CallError::Decode(e.to_string())),
            Err(e) => Err(CallError::Rpc(e)),
        }
    }

    fn respond_ok<R: Serialize>(&self, id: &Id, result: &R, payload: usize) {
        let out = OutResult {
            jsonrpc: JSONRPC,
            id,
            result,
        };
        let msg = self
            .inner
            .codec
            .encode_sized(&out, payload)
            .map_err(|e| CallError::Decode(e.to_string()));
        match msg {
            Ok(msg) => {
                let _ = self.send_message(msg);
            }
            Err(e) => self.respond_err(Some(id), &RpcError::internal(e.to_string())),
        }
    }

    fn respond_err(&self, id: Option<&Id>, error: &RpcError) {
        if let Ok(msg) = self.encode(&OutError {
            jsonrpc: JSONRPC,
            id,
            error,
        }) {
            let _ = self.send_message(msg);
        }
    }

    /// Close the connection with a code; the writer sends the close frame and
    /// stops.
    pub fn close(&self, code: CloseCode, reason: &str) {
        let frame = CloseFrame {
            code: WsCloseCode::from(code.code()),
            reason: reason.to_owned().into(),
        };
        let _ = self.inner.out.send(Message::Close(Some(frame)));
    }

    /// A raw message (benchmarks, tests of malformed input).
    pub fn send_raw(&self, msg: Message) -> Result<(), CallError> {
        self.send_message(msg)
    }
}

/// The answer port of one inbound request. Exactly one answer goes out:
/// [`Responder::ok`], [`Responder::err`], or -32603 when dropped unanswered.
pub struct Responder {
    link: Link,
    id: Id,
    method: Method,
    answered: bool,
    _permit: Option<OwnedSemaphorePermit>,
}

impl std::fmt::Debug for Responder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Responder({} {})", self.method, self.id)
    }
}

impl Responder {
    pub fn id(&self) -> &Id {
        &self.id
    }

    pub fn method(&self) -> Method {
        self.method
    }

    pub fn link(&self) -> &Link {
        &self.link
    }

    pub fn ok<R: Serialize>(mut self, result: &R) {
        self.answered = true;
        self.link.respond_ok(&self.id, result, 0);
    }

    /// [`ok`](Self::ok) for an answer carrying about `payload` bytes of
    /// data (a `process.read`): the frame buffer is sized once.
    pub fn ok_sized<R: Serialize>(mut self, result: &R, payload: usize) {
        self.answered = true;
        self.link.respond_ok(&self.id, result, payload);
    }

    pub fn err(mut self, error: RpcError) {
        self.answered = true;
        self.link.respond_err(Some(&self.id), &error);
    }

    /// Answer with a handler's result.
    pub fn send<R: Serialize>(self, result: Result<R, RpcError>) {
        match result {
            Ok(r) => self.ok(&r),
            Err(e) => self.err(e),
        }
    }
}

/// Decode a frame's params for a handler. Bad params answer a request with
/// -32602 (taking its responder); on a notification, where nobody can be
/// answered, they are logged and the frame is dropped.
pub fn decode_params<P: DeserializeOwned>(
    frame: &Inbound,
    reply: &mut Option<Responder>,
) -> Option<P> {
    match frame.params::<P>() {
        Ok(p) => Some(p),
        Err(e) => {
            match reply.take() {
                Some(r) => r.err(e),
                None => tracing::warn!(error = %e, "notification with bad params ignored"),
            }
            None
        }
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        if !self.answered {
            tracing::warn!(method = %self.method, id = %self.id, "request dropped unanswered");
            self.link.respond_err(
                Some(&self.id),
                &RpcError::internal("the handler stopped before answering"),
            );
        }
    }
}

/// The reading half of a connection.
pub struct Reader {
    stream: SplitStream<WsStream>,
    link: Link,
    limits: LinkLimits,
}

impl Reader {
    /// Read frames until the connection ends, routing requests and
    /// notifications to `dispatch` and answers to waiting requests.
    pub async fn run(mut self, dispatch: Arc<dyn Dispatch>) -> Closed {
        let link = self.link.clone();
        let closed = self.read_loop(&*dispatch).await;
        link.inner.closed.cancel();
        // Fail every request still waiting for an answer; later ones are
        // refused by the same state, so none is left waiting.
        link.fail_pending();
        closed
    }

    async fn read_loop(&mut self, dispatch: &dyn Dispatch) -> Closed {
        let codec = self.link.codec();
        loop {
            let next = tokio::select! {
                n = self.stream.next() => n,
                _ = self.link.closed() => {
                    return Closed { code: None, reason: "closed locally".into(), by_peer: false };
                }
            };
            let msg = match next {
                None => {
                    return Closed {
                        code: None,
                        reason: "connection lost".into(),
                        by_peer: false,
                    }
                }
                Some(Err(WsError::Capacity(e))) => {
                    tracing::warn!(error = %e, "frame too large");
                    self.link.close(CloseCode::TooLarge, "frame too large");
                    return Closed {
                        code: Some(CloseCode::TooLarge),
                        reason: e.to_string(),
                        by_peer: false,
                    };
                }
                Some(Err(e)) => {
                    return Closed {
                        code: None,
                        reason: e.to_string(),
                        by_peer: false,
                    }
                }
                Some(Ok(m)) => m,
            };
            self.link.touch();
            let bytes: Bytes = match (msg, codec) {
                (Message::Text(t), Codec::Json) => Bytes::from(t),
                (Message::Binary(b), Codec::MsgPack) => b,
                (Message::Close(frame), _) => {
                    let (code, reason) = match frame {
                        Some(f) => (
                            Some(CloseCode::from_code(u16::from(f.code))),
                            f.reason.to_string(),
                        ),
                        None => (None, String::new()),
                    };
                    return Closed {
                        code,
                        reason,
                        by_peer: true,
                    };
                }
                (Message::Ping(_) | Message::Pong(_) | Message::Frame(_), _) => continue,
                (Message::Text(_), Codec::MsgPack) | (Message::Binary(_), Codec::Json) => {
                    self.link.respond_err(
                        None,
                        &RpcError::parse_error("frame type does not match the negotiated codec"),
                    );
                    continue;
                }
            };
            if let Some(closed) = self.handle_frame(bytes, dispatch).await {
                return closed;
            }
        }
    }

    async fn handle_frame(&mut self, bytes: Bytes, dispatch: &dyn Dispatch) -> Option<Closed> {
        let size = bytes.len();
        let frame = match Inbound::parse(self.link.codec(), bytes) {
            Ok(f) => f,
            Err(e) => {
                if size > self.limits.max_control_frame_bytes {
                    return Some(self.too_large(size));
                }
                let (id, err) = e.to_rpc();
                self.link.respond_err(id.as_ref(), &err);
                return None;
            }
        };
        // Only mcp.frame may use the larger MCP limit.
        if size > self.limits.max_control_frame_bytes
            && frame.method() != Some(Method::McpFrame.as_str())
        {
            return Some(self.too_large(size));
        }
        match frame.kind.clone() {
            FrameKind::Response { id } => self.resolve(&id, Ok(frame)),
            FrameKind::Error {
                id: Some(id),
                error,
            } => self.resolve(&id, Err(error)),
            FrameKind::Error { id: None, error } => {
                // An answer to a frame the peer could not parse: nothing to
                // resolve, but the owner may want to see it.
                tracing::warn!(code = error.code, message = %error.message, "peer reported an error without id");
                dispatch.dispatch(frame, None);
            }
            FrameKind::Request { id, method } => {
                let Some(m) = Method::from_name(&method) else {
                    self.link
                        .respond_err(Some(&id), &RpcError::method_not_found(&method));
                    return None;
                };
                let permit = tokio::select! {
                    p = self.link.inner.in_flight.clone().acquire_owned() => p.ok(),
                    _ = self.link.closed() => None,
                };
                let responder = Responder {
                    link: self.link.clone(),
                    id,
                    method: m,
                    answered: false,
                    _permit: permit,
                };
                dispatch.dispatch(frame, Some(responder));
            }
            FrameKind::Notification { method } => {
                if Method::from_name(&method).is_none() {
                    tracing::warn!(%method, "unknown notification ignored");
                    return None;
                }
                dispatch.dispatch(frame, None);
            }
        }
        None
    }

    fn too_large(&self, size: usize) -> Closed {
        self.link.close(CloseCode::TooLarge, "frame too large");
        Closed {
            code: Some(CloseCode::TooLarge),
            reason: format!("{size} bytes"),
            by_peer: false,
        }
    }

    fn resolve(&self, id: &Id, answer: Result<Inbound, RpcError>) {
        let key = id.to_string();
        let waiter = self.link.pending().take(&key);
        match waiter {
            Some(tx) => {
                let _ = tx.send(answer);
            }
            None => tracing::debug!(%id, "answer to an unknown or timed-out request"),
        }
    }
}

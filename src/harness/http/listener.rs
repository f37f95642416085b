//! The listeners: the TCP one serves the HTTP router (the API and the
//! executors' upgrade route `GET /v1/executor/connect`) one hyper
//! connection per socket, under [`ConnectionLimits`]; the optional API
//! Unix socket serves the same router the same way (a co-located
//! platform's way in, guarded by the socket file's mode as well as the
//! token); the optional executors' Unix socket takes executors with the
//! same handshake. All end in [`connection::start`](super::connection::start).
//!
//! Why not `axum::serve`: it sets no timer, so hyper's header-read timeout
//! never runs, and it has no idle timeout or connection cap: a peer could
//! hold any number of idle or half-sent-header sockets forever (issue 18,
//! finding 4).

use super::body_deadline::{Deadline, TimedBody};
use super::self_wake::RepollSelfWake;
use super::throttle::Source;
use crate::harness::config::ConnectionLimits;
use crate::harness::{actors::connection, runtime::Shared};
use crate::wire::transport;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Connections not yet authenticated, oldest first, each with the token
/// that closes it. Bounded by `max_unauthenticated`: admitting one more
/// evicts the oldest, so a flood of idle sockets costs the flooder its own
/// sockets, not a newcomer its turn.
#[derive(Debug)]
pub(crate) struct Gate {
    max: usize,
    next: AtomicU64,
    pending: Mutex<BTreeMap<u64, CancellationToken>>,
}

impl Gate {
    pub(crate) fn new(max: usize) -> Arc<Gate> {
        Arc::new(Gate {
            max: max.max(1),
            next: AtomicU64::new(0),
            pending: Mutex::new(BTreeMap::new()),
        })
    }

    /// Admit a new connection: returns its pass and the token that is
    /// cancelled if it is evicted before it authenticates.
    pub(crate) fn admit(self: &Arc<Gate>) -> (ConnPass, CancellationToken) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let evict = CancellationToken::new();
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        while pending.len() >= self.max {
            match pending.pop_first() {
                Some((_, oldest)) => oldest.cancel(),
                None => break,
            }
        }
        pending.insert(id, evict.clone());
        drop(pending);
        (
            ConnPass {
                id,
                gate: self.clone(),
            },
            evict,
        )
    }

    fn leave(&self, id: u64) {
        if let Ok(mut p) = self.pending.lock() {
            p.remove(&id);
        }
    }
}

/// A connection's place at the [`Gate`], carried in every request's
/// extensions so the authentication middleware can take it off the
/// unauthenticated list.
#[derive(Debug, Clone)]
pub(crate) struct ConnPass {
    id: u64,
    gate: Arc<Gate>,
}

impl ConnPass {
    /// A request on this connection showed a valid credential: it can no
    /// longer be evicted (the idle and header timeouts still apply).
    pub(crate) fn authenticated(&self) {
        self.gate.leave(self.id);
    }
}

/// Requests in flight on one connection and when the last one ended, for
/// the keep-alive idle timeout.
struct Activity {
    born: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds since `born` at the last response; `u64::MAX` before
    /// the first (the header-read timeout covers that wait).
    last_done_ms: AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            born: Instant::now(),
            in_flight: AtomicUsize::new(0),
            last_done_ms: AtomicU64::new(u64::MAX),
        }
    }

    fn begin(&self) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
    }

    fn end(&self) {
        let ms = self.born.elapsed().as_millis() as u64;
        self.last_done_ms.store(ms, Ordering::SeqCst);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    /// When the idle timeout falls, if it runs now.
    fn idle_deadline(&self, idle: Duration) -> Option<Instant> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        match self.last_done_ms.load(Ordering::SeqCst) {
            u64::MAX => None,
            ms => Some(self.born + Duration::from_millis(ms) + idle),
        }
    }
}

/// The keep-alive idle timer of one connection, armed from its
/// [`Activity`] each time it is polled: the connection's task polls it
/// right after the connection itself, so a request that just ended arms it
/// in the same poll.
///
/// Why not a `Notify` from [`Activity::end`]: that runs inside this task's
/// poll of the connection, so it woke the task during its own poll, and
/// tokio requeues such a task as a yield and wakes an idle worker for it:
/// one needless thread wake-up per request (docs/benchmarks.md, "MCP").
struct IdleClock<'a> {
    activity: &'a Activity,
    idle: Duration,
    armed: Option<Instant>,
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl<'a> IdleClock<'a> {
    fn new(activity: &'a Activity, idle: Duration) -> Self {
        IdleClock {
            activity,
            idle,
            armed: None,
            sleep: Box::pin(tokio::time::sleep(idle)),
        }
    }
}

impl std::future::Future for IdleClock<'_> {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        let at = self.activity.idle_deadline(self.idle);
        if at != self.armed {
            self.armed = at;
            if let Some(at) = at {
                self.sleep.as_mut().reset(at);
            }
        }
        match self.armed {
            Some(_) => self.sleep.as_mut().poll(cx),
            // A request in flight (or none yet): the clock does not run.
            None => std::task::Poll::Pending,
        }
    }
}

/// A listening socket the router is served on.
pub(crate) trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The next connection and where it comes from (the per-source
    /// limits count by it: [`Source`]).
    fn accept(
        &self,
    ) -> impl std::future::Future<Output = std::io::Result<(Self::Io, Source)>> + Send;
}

impl Accept for TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<(Self::Io, Source)> {
        let (tcp, peer) = TcpListener::accept(self).await?;
        // No Nagle: small frames to executors (a tool call, an MCP
        // message) would otherwise wait for the peer's delayed ACK (40 ms
        // on Linux) whenever an earlier one is unacknowledged.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
        Ok((tcp, Source::of(peer.ip())))
    }
}

/// A Unix socket this harness bound, and its file: the file is removed
/// when the listener is dropped, so it goes with the listener however that
/// ends (the harness stops, the build fails after the bind, the task is
/// aborted) and never outlives it to be mistaken for a live server.
pub(crate) struct UnixSocket {
    listener: UnixListener,
    path: PathBuf,
}

impl UnixSocket {
    /// The socket file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Bind `path`; a stale socket file of an earlier run is replaced
    /// ([`remove_stale_socket`]).
    pub(crate) fn bind(path: &Path) -> std::io::Result<UnixSocket> {
        remove_stale_socket(path)?;
        Ok(UnixSocket {
            listener: UnixListener::bind(path)?,
            path: path.to_owned(),
        })
    }
}

impl Drop for UnixSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Accept for UnixSocket {
    type Io = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<(Self::Io, Source)> {
        self.listener
            .accept()
            .await
            .map(|(s, _)| (s, Source::Local))
    }
}

/// Serve `router` on `listener` until `stop`, then let the open
/// connections finish (graceful: no new request on them). The listener is
/// closed before that drain: a client arriving meanwhile is refused at
/// once rather than left in the backlog, and a Unix socket's file is gone.
pub(crate) async fn serve<L: Accept>(
    listener: L,
    router: Router,
    gate: Arc<Gate>,
    limits: ConnectionLimits,
    stop: CancellationToken,
) {
    let tasks = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.cancelled() => break,
        };
        let (io, source) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning; the
                // evictions and timeouts free descriptors meanwhile.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (pass, evicted) = gate.admit();
        // hyper wakes its connection task during its own poll on most
        // requests: polled again at once, not requeued (`self_wake`).
        tasks.spawn(RepollSelfWake::new(Box::pin(serve_connection(
            io,
            source,
            router.clone(),
            pass,
            evicted,
            limits,
            stop.clone(),
        ))));
    }
    drop(listener);
    tasks.close();
    tasks.wait().await;
}

/// Bind the API's Unix socket: a stale socket file of an earlier run is
/// replaced, and the new one is made `0600` (owner only) right after the
/// bind. Connecting needs write permission on the file, so under the
/// usual umask (022) nobody else could connect in between either; the
/// API token is required over it all the same.
pub(crate) fn bind_api_unix(path: &Path) -> std::io::Result<UnixSocket> {
    use std::os::unix::fs::PermissionsExt;
    let socket = UnixSocket::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(socket)
}

/// Remove a socket file left by an earlier run. A socket someone still
/// listens on is not taken over (`AddrInUse`: a second harness must not
/// steal the first one's clients), and anything else at `path` is kept
/// (bind then fails with `AddrInUse`).
fn remove_stale_socket(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    "a server is listening on this socket",
                ));
            }
            std::fs::remove_file(path)
        }
        _ => Ok(()),
    }
}

/// One HTTP/1.1 connection (upgrades included) under the limits. Every
/// request carries the connection's [`ConnPass`] and [`Source`] in its
/// extensions, and its body is a [`TimedBody`]: a body that misses its
/// deadline gets 408 and the connection is closed.
async fn serve_connection<I: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: I,
    source: Source,
    router: Router,
    pass: ConnPass,
    evicted: CancellationToken,
    limits: ConnectionLimits,
    stop: CancellationToken,
) {
    let activity = Arc::new(Activity::new());
    // One request at a time on an HTTP/1.1 connection: one flag for all.
    let timed_out = Arc::new(AtomicBool::new(false));
    let deadline = Deadline::new(&limits);
    let inner = TowerToHyperService::new(router);
    let service = {
        let activity = activity.clone();
        let pass = pass.clone();
        hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let mut req =
                req.map(|b| TimedBody::new(b, deadline, Instant::now(), timed_out.clone()));
            req.extensions_mut().insert(pass.clone());
            req.extensions_mut().insert(source);
            activity.begin();
            let fut = hyper::service::Service::call(&inner, req);
            let activity = activity.clone();
            let timed_out = timed_out.clone();
            async move {
                let r = fut.await;
                activity.end();
                if timed_out.swap(false, Ordering::AcqRel) {
                    tracing::debug!(%source, "a request body missed its deadline: 408, closing");
                    return Ok(body_timed_out());
                }
                r
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    let conn = builder
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    tokio::pin!(conn);
    let mut closing = false;
    let mut idle = IdleClock::new(&activity, limits.idle_timeout);
    loop {
        tokio::select! {
            // The connection first, the idle clock last: see `IdleClock`.
            biased;
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "HTTP connection ended");
                }
                break;
            }
            _ = evicted.cancelled() => {
                tracing::debug!("closing the oldest unauthenticated connection: at the cap");
                break;
            }
            _ = stop.cancelled(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = &mut idle, if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
    // Served, upgraded (authenticated by then), evicted or timed out:
    // off the list either way.
    pass.gate.leave(pass.id);
}

/// The answer to a request whose body missed its deadline: 408, and the
/// connection closes (the rest of the body is never read).
fn body_timed_out() -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut r = crate::harness::error::ApiError::with_status(
        408,
        crate::wire::RpcError::new(
            crate::wire::ErrorCode::Timeout,
            "the request body did not arrive in time",
        )
        .with_reason("body_timeout"),
    )
    .into_response();
    r.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    super::security_headers::apply(r.headers_mut());
    r
}

/// Bind `path` and accept executors on it until the harness shuts down.
pub fn serve_unix(shared: Arc<Shared>, path: &Path) -> std::io::Result<JoinHandle<()>> {
    let listener = UnixSocket::bind(path)?;
    Ok(tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = shared.shutdown.cancelled() => break,
            };
            let stream = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "unix accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            tokio::spawn(serve_stream(shared.clone(), Box::new(stream), "unix"));
        }
    }))
}

/// Accept executors dialing [`transport::InProcess`] until the harness
/// shuts down: each pipe goes through the handshake a socket gets.
pub fn serve_in_process(
    shared: Arc<Shared>,
    mut accept: tokio::sync::mpsc::Receiver<transport::BoxIo>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let io = tokio::select! {
                io = accept.recv() => match io {
                    Some(io) => io,
                    None => break,
                },
                _ = shared.shutdown.cancelled() => break,
            };
            tokio::spawn(serve_stream(shared.clone(), io, "in-process"));
        }
    })
}

/// One executor connection on a stream that is not TCP (no HTTP API
/// there): the upgrade handshake under the handshake deadline, then its
/// connection actor.
async fn serve_stream(shared: Arc<Shared>, io: transport::BoxIo, kind: &'static str) {
    let auth = shared.clone();
    let handshake = transport::accept(
        io,
        &shared.config.subprotocols,
        shared.config.max_mcp_frame_bytes,
        move |token| auth.authenticate(token),
    );
    let within = shared.config.connections.handshake_timeout;
    match tokio::time::timeout(within, handshake).await {
        Ok(Ok((transport, executor_id))) => connection::start(shared, transport, executor_id).await,
        Ok(Err(e)) => tracing::info!(error = %e, transport = kind, "upgrade refused"),
        Err(_) => tracing::info!(transport = kind, "upgrade timed out"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admitting_past_the_cap_evicts_the_oldest_unauthenticated() {
        let gate = Gate::new(2);
        let (a, evict_a) = gate.admit();
        let (_b, evict_b) = gate.admit();
        a.authenticated();
        let (_c, evict_c) = gate.admit();
        // `a` left the list: two pending, nobody evicted yet.
        assert!(!evict_a.is_cancelled() && !evict_b.is_cancelled());
        let (_d, evict_d) = gate.admit();
        assert!(evict_b.is_cancelled(), "the oldest pending goes first");
        assert!(
            !evict_a.is_cancelled(),
            "an authenticated one is never evicted"
        );
        assert!(!evict_c.is_cancelled() && !evict_d.is_cancelled());
    }
}

//! The confirmation actor: drives the [`Book`] of `executor::confirm` and
//! serves the local socket `bmx confirm` talks to.
//!
//! A child of the executor's root supervisor (permanent). Tool-call actors
//! that must ask send [`ConfirmMsg::Ask`] with a oneshot and wait on it (with
//! a deadline of their own); a person's answer, the expiry timer and a
//! withdrawal each resolve the entry once. If this actor dies, the
//! oneshots of its waiters close and those calls end with
//! `local_confirmation_unavailable`: nothing waits forever, nothing runs
//! unconfirmed.

use crate::executor::confirm::{
    socket_path, AnswerError, Book, Decision, Key, LocalDecision, LocalRequest, LocalResponse,
    PendingView, Request, MAX_LINE, MAX_WATCHERS,
};
use crate::executor::Shared;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{oneshot, watch};

/// Local connections served at once; more wait in the accept queue.
const MAX_CONNECTIONS: usize = 16;
/// Requests one local connection may make.
const MAX_REQUESTS_PER_CONNECTION: usize = 64;
/// A local connection that sends nothing for this long is closed.
const IDLE: Duration = Duration::from_secs(30);
/// How long a local request waits for the actor.
const ACTOR_ANSWER: Duration = Duration::from_secs(5);
/// How long a watcher may take to read one list before it is dropped: a
/// stuck reader must not keep a watch slot forever.
const WATCH_WRITE: Duration = Duration::from_secs(5);

/// The pending list as watchers see it: replaced whenever the set of
/// pending ids changes.
type Feed = watch::Sender<Arc<Vec<PendingView>>>;

pub enum ConfirmMsg {
    /// A tool call asks; `reply` gets the decision exactly once.
    Ask {
        request: Request,
        wait: Duration,
        reply: oneshot::Sender<Decision>,
    },
    /// The call was canceled or its session stopped.
    Withdraw(Key),
    /// A request from the local socket.
    Local {
        request: LocalRequest,
        reply: oneshot::Sender<LocalResponse>,
    },
    /// The earliest deadline may have passed.
    Tick,
}

#[derive(Clone)]
pub struct Confirm;

pub struct ConfirmState {
    shared: Arc<Shared>,
    book: Book,
    /// Waiting calls by confirmation id (one per id: a repeated
    /// `tool.call` never starts a second call actor).
    waiters: HashMap<String, Vec<oneshot::Sender<Decision>>>,
    /// The deadline the one armed timer is for.
    armed: Option<Instant>,
    listener: Option<tokio::task::JoinHandle<()>>,
    path: Option<PathBuf>,
    /// What watchers are sent.
    feed: Feed,
}

/// Bind `path` for the executor's user only: the directory 0700 (made so
/// when it is new; an existing one must be this user's and writable by
/// nobody else, and is never `chmod`ed: issue 56), the socket 0600. A
/// socket file another live executor answers on is not taken over; a
/// stale one (nobody listening) is replaced; anything else at the path
/// (a link, a file) is refused.
fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        crate::executor::workroot::ensure_private(dir).map_err(std::io::Error::other)?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another executor answers on this socket",
            ));
        }
        std::fs::remove_file(path)?;
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

impl ConfirmState {
    fn resolve(&mut self, id: &str, decision: Decision) {
        for w in self.waiters.remove(id).unwrap_or_default() {
            let _ = w.send(decision);
        }
    }

    fn expire(&mut self, now: Instant) {
        for (id, key) in self.book.expire(now) {
            tracing::info!(confirmation = %id, session = %key.session_id, tool_call = %key.tool_call_id, "local confirmation expired");
            self.resolve(&id, Decision::Expired);
        }
    }

    /// Tell watchers when a confirmation was added or resolved (not when
    /// only the time left changed: that would be a line per message).
    fn publish(&self, now: Instant) {
        let list = self.book.list(now);
        self.feed.send_if_modified(|cur| {
            let same = cur.len() == list.len() && cur.iter().zip(&list).all(|(a, b)| a.id == b.id);
            if !same {
                *cur = Arc::new(list);
            }
            !same
        });
    }

    /// One timer, for the earliest deadline.
    fn arm(&mut self, myself: &ActorRef<ConfirmMsg>, now: Instant) {
        let Some(next) = self.book.next_deadline() else {
            self.armed = None;
            return;
        };
        if self.armed.is_some_and(|a| a <= next && a > now) {
            return;
        }
        self.armed = Some(next);
        myself.send_after(next.saturating_duration_since(now), || ConfirmMsg::Tick);
    }

    fn local(&mut self, now: Instant, request: LocalRequest) -> LocalResponse {
        match request {
            LocalRequest::List => LocalResponse::list(self.book.list(now)),
            // Served by the connection itself from the feed (never here).
            LocalRequest::Watch => LocalResponse::error("bad_request", "watch is not a request"),
            LocalRequest::Answer { id, decision } => match self.book.answer(now, &id) {
                Ok(key) => {
                    let d = match decision {
                        LocalDecision::Allow => Decision::Allowed,
                        LocalDecision::Deny => Decision::Denied,
                    };
                    tracing::info!(confirmation = %id, session = %key.session_id, tool_call = %key.tool_call_id, decision = ?d, "local confirmation answered");
                    self.resolve(&id, d);
                    LocalResponse::answered(id)
                }
                Err(e @ AnswerError::Unknown(_)) => {
                    LocalResponse::error("unknown_id", e.to_string())
                }
                Err(e @ AnswerError::Expired(_)) => LocalResponse::error("expired", e.to_string()),
            },
        }
    }
}

/// Serve the local socket: peer uid checked, lines bounded, requests
/// forwarded to the actor.
async fn serve(
    listener: tokio::net::UnixListener,
    actor: ActorRef<ConfirmMsg>,
    feed: watch::Receiver<Arc<Vec<PendingView>>>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let watchers = Arc::new(tokio::sync::Semaphore::new(MAX_WATCHERS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "confirm socket: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let actor = actor.clone();
        let (feed, watchers) = (feed.clone(), watchers.clone());
        tokio::spawn(async move {
            connection(stream, actor, permit, feed, watchers).await;
        });
    }
}

async fn connection(
    stream: tokio::net::UnixStream,
    actor: ActorRef<ConfirmMsg>,
    permit: tokio::sync::OwnedSemaphorePermit,
    feed: watch::Receiver<Arc<Vec<PendingView>>>,
    watchers: Arc<tokio::sync::Semaphore>,
) {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let cred = stream.peer_cred();
    let peer = cred.as_ref().map(|c| c.uid());
    let (read, mut write) = stream.into_split();
    // Session code of the same user must not answer its own calls (issue
    // 48): a peer inside one of this executor's session cgroups is
    // refused, whatever its uid. The kernel keeps that membership; the
    // session cannot leave its cgroup.
    let in_session = cred
        .as_ref()
        .ok()
        .and_then(|c| c.pid())
        .is_some_and(crate::sandbox::cgroup::in_sessions);
    if in_session {
        tracing::warn!("confirm socket: a process of a session was refused");
        let _ = write
            .write_all(
                LocalResponse::error("forbidden", "session code may not answer")
                    .line()
                    .as_bytes(),
            )
            .await;
        return;
    }
    if peer.as_ref().ok() != Some(&me) {
        tracing::warn!(?peer, "confirm socket: a peer of another user was refused");
        let _ = write
            .write_all(
                LocalResponse::error("forbidden", "only the executor's user may answer")
                    .line()
                    .as_bytes(),
            )
            .await;
        return;
    }
    let mut read = BufReader::new(read);
    let mut buf = Vec::new();
    for _ in 0..MAX_REQUESTS_PER_CONNECTION {
        buf.clear();
        let got = tokio::time::timeout(
            IDLE,
            (&mut read)
                .take(MAX_LINE as u64 + 1)
                .read_until(b'\n', &mut buf),
        )
        .await;
        match got {
            Ok(Ok(0)) | Err(_) | Ok(Err(_)) => return,
            Ok(Ok(_)) => {}
        }
        if buf.len() > MAX_LINE {
            let line =
                LocalResponse::error("too_large", format!("a line is at most {MAX_LINE} bytes"));
            let _ = write.write_all(line.line().as_bytes()).await;
            return;
        }
        let answer = match serde_json::from_slice::<LocalRequest>(&buf) {
            Err(e) => LocalResponse::error("bad_request", e.to_string()),
            Ok(LocalRequest::Watch) => match watchers.clone().try_acquire_owned() {
                Ok(slot) => {
                    // A watcher holds a watch slot, not a request slot.
                    drop(permit);
                    watch_feed(read, write, feed).await;
                    drop(slot);
                    return;
                }
                Err(_) => LocalResponse::error(
                    "busy",
                    format!("at most {MAX_WATCHERS} connections watch at once"),
                ),
            },
            Ok(request) => {
                let (tx, rx) = oneshot::channel();
                if actor
                    .send_message(ConfirmMsg::Local { request, reply: tx })
                    .is_err()
                {
                    LocalResponse::error("unavailable", "the executor is stopping")
                } else {
                    match tokio::time::timeout(ACTOR_ANSWER, rx).await {
                        Ok(Ok(a)) => a,
                        _ => LocalResponse::error("unavailable", "the executor did not answer"),
                    }
                }
            }
        };
        if write.write_all(answer.line().as_bytes()).await.is_err() {
            return;
        }
    }
}

/// A watching connection: the list now and after every change, until the
/// client closes or sends anything (a watch connection takes no requests),
/// the executor stops, or a list is not read within [`WATCH_WRITE`].
async fn watch_feed(
    mut read: BufReader<tokio::net::unix::OwnedReadHalf>,
    mut write: tokio::net::unix::OwnedWriteHalf,
    mut feed: watch::Receiver<Arc<Vec<PendingView>>>,
) {
    let mut byte = [0u8; 1];
    loop {
        let list = feed.borrow_and_update().clone();
        let line = LocalResponse::list(list.as_ref().clone()).line();
        match tokio::time::timeout(WATCH_WRITE, write.write_all(line.as_bytes())).await {
            Ok(Ok(())) => {}
            _ => return,
        }
        tokio::select! {
            changed = feed.changed() => if changed.is_err() { return },
            _ = read.read(&mut byte) => return,
        }
    }
}

impl Actor for Confirm {
    type Msg = ConfirmMsg;
    type State = ConfirmState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        myself: ActorRef<ConfirmMsg>,
        shared: Arc<Shared>,
    ) -> Result<ConfirmState, ActorProcessingErr> {
        let path = shared
            .config
            .confirm_socket
            .clone()
            .unwrap_or_else(|| socket_path(&shared.config.work_root));
        // No socket: nobody could ever answer, so the actor is not
        // published and `always_ask` calls fail at once (and the mode is
        // not advertised).
        let feed = watch::channel(Arc::new(Vec::new())).0;
        let (listener, path) = match bind(&path) {
            Ok(l) => {
                let task = tokio::spawn(serve(l, myself.clone(), feed.subscribe()));
                shared.set_confirm_actor(Some(myself.clone()));
                tracing::info!(socket = %path.display(), "local confirmation socket ready");
                (Some(task), Some(path))
            }
            Err(e) => {
                tracing::error!(socket = %path.display(), error = %e, "no local confirmation socket: always_ask calls will fail");
                (None, None)
            }
        };
        Ok(ConfirmState {
            shared,
            book: Book::default(),
            waiters: HashMap::new(),
            armed: None,
            listener,
            path,
            feed,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ConfirmMsg>,
        state: &mut ConfirmState,
    ) -> Result<(), ActorProcessingErr> {
        state.shared.set_confirm_actor(None);
        if let Some(t) = state.listener.take() {
            t.abort();
        }
        if let Some(p) = state.path.take() {
            let _ = std::fs::remove_file(p);
        }
        // Dropping the waiters closes their oneshots: those calls end as
        // `local_confirmation_unavailable`.
        state.waiters.clear();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<ConfirmMsg>,
        msg: ConfirmMsg,
        state: &mut ConfirmState,
    ) -> Result<(), ActorProcessingErr> {
        let now = Instant::now();
        state.expire(now);
        match msg {
            ConfirmMsg::Ask {
                request,
                wait,
                reply,
            } => {
                let key = request.key.clone();
                match state.book.ask(now, request, wait) {
                    Ok(asked) => {
                        if asked.fresh {
                            tracing::info!(confirmation = %asked.id, session = %key.session_id, tool_call = %key.tool_call_id, "waiting for local confirmation");
                        }
                        state.waiters.entry(asked.id).or_default().push(reply);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "local confirmation refused");
                        let _ = reply.send(Decision::Unavailable);
                    }
                }
            }
            ConfirmMsg::Withdraw(key) => {
                if let Some(id) = state.book.withdraw(&key) {
                    state.resolve(&id, Decision::Withdrawn);
                }
            }
            ConfirmMsg::Local { request, reply } => {
                let _ = reply.send(state.local(now, request));
            }
            ConfirmMsg::Tick => state.armed = None,
        }
        state.publish(now);
        state.arm(&myself, now);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::bind;
    use std::os::unix::fs::PermissionsExt;

    #[tokio::test]
    async fn a_shared_parent_is_refused_and_never_chmodded() {
        let t = tempfile::tempdir().unwrap();
        let shared = t.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(bind(&shared.join("c.sock")).is_err());
        let mode = std::fs::metadata(&shared).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o1777, "the operator's directory is left as it was");
        // A file (or a link) where the socket goes is not removed.
        let own = t.path().join("own");
        let sock = own.join("c.sock");
        std::fs::create_dir(&own).unwrap();
        std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::write(&sock, "precious").unwrap();
        assert!(bind(&sock).is_err());
        assert_eq!(std::fs::read_to_string(&sock).unwrap(), "precious");
        std::fs::remove_file(&sock).unwrap();
        // A new directory is made 0700 and the socket 0600.
        let fresh = t.path().join("fresh/c.sock");
        let _l = bind(&fresh).unwrap();
        let dir_mode = std::fs::metadata(fresh.parent().unwrap())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(dir_mode & 0o777, 0o700);
        assert_eq!(
            std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
}

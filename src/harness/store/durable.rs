//! Durable harness state over a [`DurableBackend`] (docs/store.md): the
//! fencing high-water mark, the platform's sessions, the tool results
//! acknowledged to executors and the sessions' agent event streams.
//!
//! Database calls block, and the leases actor that decides leases runs on the
//! async threads, so nothing here writes on the caller's thread. Writes are
//! queued and a dedicated writer thread commits them in batches, one
//! transaction each; a caller that must not go on before its write is
//! durable gets a *ticket* and waits for it ([`DurableState::wait_durable`])
//! or hands over a closure run after the commit ([`DurableState::put_result`]).
//!
//! The ordering rules that make a SIGKILL safe:
//!
//! * **Fencing tokens** come from blocks reserved in the database *before*
//!   any token of the block is issued (`UPDATE fencing SET reserved =
//!   reserved + N RETURNING reserved`, one transaction). A restarted
//!   harness starts from a fresh block above everything reserved, so a
//!   token handed out before a crash is never handed out again, whether or
//!   not the session that got it was written. The next block is reserved
//!   in the background when half the current one is used; if it runs out
//!   first, a grant is refused (retryable) instead of blocking on the disk.
//! * **Sessions** are written through on every change of state, holder or
//!   grant (the newest snapshot of a session wins, so a queue of writes is
//!   bounded by the number of sessions). `session.assign` goes out only
//!   after the session's row is durable.
//! * **Tool results** are acknowledged to the executor (which resends until
//!   acknowledged) and handed to the platform only after they are durable:
//!   a crash before the commit means the executor sends the result again.
//! * **Session events** (`session.event`) follow the same rule: acknowledged
//!   and shown to stream clients only once durable. The store keeps what
//!   the session's in-memory log keeps (its retention limits): the
//!   session's stream actor trims the stored events to its log's oldest
//!   ([`DurableState::trim_events`]) and, when the id is granted anew,
//!   clears them ([`DurableState::clear_events`]).

use super::StoreError;
use crate::harness::types::{SessionInfo, SessionState};
use crate::lease::LeaseStore;
use crate::wire::types::ToolResultParams;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::watch;

/// Fencing tokens reserved per database write. At most this many token
/// values are skipped per restart; `u64` makes that free.
pub const FENCING_BLOCK: u64 = 4096;

/// Writes (tool results and acknowledgements waiting for a commit) queued
/// at most; past it a `tool.result` is refused as retryable, never dropped.
pub const MAX_QUEUED: usize = 4096;

/// Tool results kept per session (the leases actor keeps as many).
pub const RESULTS_KEPT_PER_SESSION: usize = 256;

/// The writer thread wakes at least this often (to notice an abandoned
/// store when no one called [`DurableState::shutdown`]).
const IDLE_WAKE: Duration = Duration::from_secs(1);

/// Longest pause between retries of a failed write.
const RETRY_MAX: Duration = Duration::from_secs(5);

/// A failed write is retried this many times once shutdown began, then
/// given up (its acknowledgements are never sent: the executor resends).
const RETRIES_AT_SHUTDOWN: u32 = 3;

/// A session as kept: the platform's record and, while its holder is lost,
/// when its orphaned lease runs out (unix ms; the harness's own clock is
/// monotonic and means nothing to the next process).
#[derive(Debug, Clone, PartialEq)]
pub struct StoredSession {
    pub info: SessionInfo,
    pub lease_expires_at_ms: Option<u64>,
}

/// A `tool.result` that was acknowledged to its executor.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResult {
    pub session_id: String,
    /// The grant the result came under; results of an older grant of a
    /// reused session id are not loaded.
    pub fencing_token: u64,
    pub tool_call_id: String,
    pub result: ToolResultParams,
}

/// A final event of a session's agent stream that was accepted, as kept:
/// its sequence and the JSON record stream clients receive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEvent {
    pub session_id: String,
    /// The grant it came under (for the record; a session taken over by
    /// another replica keeps its stream across grants).
    pub fencing_token: u64,
    pub sequence: u64,
    pub json: Arc<str>,
}

/// Run once the write it was queued with is durable.
pub type AfterCommit = Box<dyn FnOnce() + Send>;

/// One batch the writer thread commits: all of it in one transaction, or
/// none of it.
#[derive(Debug)]
pub struct Commit<'a> {
    /// The newest snapshot per session id; `None` deletes the session and
    /// its results.
    pub sessions: &'a HashMap<String, Option<StoredSession>>,
    /// Tool results to insert (replacing one of the same session and
    /// tool call id), oldest first; each session keeps the newest
    /// [`RESULTS_KEPT_PER_SESSION`].
    pub results: &'a [StoredResult],
    /// The fencing token of the grant a deleted session (`None` above)
    /// had, when known: a store shared by replicas deletes only that
    /// grant's row, never a newer one another replica made.
    pub deleted_tokens: &'a HashMap<String, u64>,
    /// Sessions whose stored events all go, before `events` are written
    /// (the id was granted anew: its stream starts over).
    pub cleared_events: &'a HashSet<String>,
    /// Session events to insert (replacing one of the same session and
    /// sequence).
    pub events: &'a [StoredEvent],
    /// Per session, the oldest sequence to keep: events below it go, after
    /// `events` are written.
    pub event_floors: &'a HashMap<String, u64>,
    /// Reserve a block of this many fencing tokens in the same transaction.
    pub reserve: Option<u64>,
}

/// What [`DurableState`] needs from a database: the seam between the
/// ordering rules (here) and an engine (SQLite in [`super::sqlite`],
/// PostgreSQL in `super::postgres`). Every call blocks; only the writer
/// thread and startup call them.
pub trait DurableBackend: Send + Sync {
    /// Reserve the next `n` fencing tokens in a transaction of its own,
    /// committed before this returns: `(first, last)`, strictly above every
    /// block this database handed out before, to any process.
    ///
    /// # Errors
    ///
    /// The database fails; nothing was reserved.
    fn reserve_block(&self, n: u64) -> Result<(u64, u64), StoreError>;

    /// Commit `c` in one transaction; the block reserved, if asked.
    ///
    /// # Errors
    ///
    /// The database fails; nothing of the batch is written.
    fn commit(&self, c: &Commit<'_>) -> Result<Option<(u64, u64)>, StoreError>;

    /// The fencing token of every stored session.
    ///
    /// # Errors
    ///
    /// The database fails.
    fn session_tokens(&self) -> Result<Vec<(String, u64)>, StoreError>;

    /// Every stored session (any order) and the tool results of each
    /// session's current grant (oldest first).
    ///
    /// # Errors
    ///
    /// The database fails or a row does not decode.
    fn load(&self) -> Result<(Vec<StoredSession>, Vec<StoredResult>), StoreError>;

    /// The stored events of one session, by sequence (oldest first).
    ///
    /// # Errors
    ///
    /// The database fails.
    fn events(&self, session_id: &str) -> Result<Vec<StoredEvent>, StoreError>;
}

#[derive(Default)]
struct Batch {
    /// `None`: delete the session (and its results).
    sessions: HashMap<String, Option<StoredSession>>,
    deleted_tokens: HashMap<String, u64>,
    results: Vec<StoredResult>,
    cleared_events: HashSet<String>,
    events: Vec<StoredEvent>,
    event_floors: HashMap<String, u64>,
    reserve: bool,
    after: Vec<AfterCommit>,
}

impl Batch {
    /// Drop the session's event writes queued so far: a clear or a delete
    /// queued after them supersedes them. (A commit applies deletes and
    /// clears before inserts and floors, so without this an event queued
    /// before a delete would outlive it, and a floor of the old stream
    /// would cut into the new one.)
    fn forget_events(&mut self, session_id: &str) {
        self.events.retain(|e| e.session_id != session_id);
        self.event_floors.remove(session_id);
    }

    fn is_empty(&self) -> bool {
        self.sessions.is_empty()
            && self.results.is_empty()
            && self.cleared_events.is_empty()
            && self.events.is_empty()
            && self.event_floors.is_empty()
            && !self.reserve
            && self.after.is_empty()
    }
}

#[derive(Default)]
struct Queue {
    /// The last ticket handed out.
    seq: u64,
    pending: Batch,
    stop: bool,
}

struct Fence {
    /// The next token of the current block, and its last.
    next: u64,
    end: u64,
    /// The block reserved after the current one, if any.
    spare: Option<(u64, u64)>,
    refilling: bool,
    /// The last token issued per session id by this process, or loaded.
    current: HashMap<String, u64>,
}

struct Inner {
    db: Arc<dyn DurableBackend>,
    queue: Mutex<Queue>,
    wake: Condvar,
    fence: Mutex<Fence>,
    /// The highest ticket whose write is committed.
    durable: watch::Sender<u64>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section below leaves the data consistent between
    // statements; a panic elsewhere must not stop the store.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The durable harness state: a [`LeaseStore`] whose tokens survive
/// restarts, plus the write-through of sessions and tool results.
///
/// Cheap to clone; [`shutdown`](Self::shutdown) flushes and stops the
/// writer thread (also stopped, after a flush, once every clone is gone).
#[derive(Clone)]
pub struct DurableState {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for DurableState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DurableState")
    }
}

impl DurableState {
    /// Open over `db` (migrated): reserve a first block of fencing tokens
    /// above everything reserved before, and start the writer thread.
    ///
    /// Blocks on one write: call it at startup, or on the blocking pool.
    ///
    /// # Errors
    ///
    /// The reservation cannot be written, or the thread cannot start.
    pub fn open(db: Arc<dyn DurableBackend>) -> Result<DurableState, StoreError> {
        let (start, end) = db.reserve_block(FENCING_BLOCK)?;
        let current: HashMap<String, u64> = db.session_tokens()?.into_iter().collect();
        tracing::info!(first = start, "fencing tokens reserved");
        let inner = Arc::new(Inner {
            db,
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            fence: Mutex::new(Fence {
                next: start,
                end,
                spare: None,
                refilling: false,
                current,
            }),
            durable: watch::channel(0).0,
            writer: Mutex::new(None),
        });
        let for_thread = inner.clone();
        let handle = std::thread::Builder::new()
            .name("bmx-store-writer".into())
            .spawn(move || run_writer(for_thread))?;
        *lock(&inner.writer) = Some(handle);
        Ok(DurableState { inner })
    }

    /// Everything kept: sessions (any order) and tool results (oldest
    /// first, only those of each session's current grant). Blocking.
    ///
    /// # Errors
    ///
    /// SQLite fails or a row does not decode.
    pub fn load(&self) -> Result<(Vec<StoredSession>, Vec<StoredResult>), StoreError> {
        self.inner.db.load()
    }

    /// Queue the newest snapshot of a session; returns its ticket.
    pub fn put_session(&self, session: StoredSession) -> u64 {
        self.enqueue(|b| {
            b.deleted_tokens.remove(&session.info.session_id);
            b.sessions
                .insert(session.info.session_id.clone(), Some(session));
        })
    }

    /// Queue the removal of a session whose grant had `fencing_token`
    /// (retention forgot it): over a store shared by replicas, only that
    /// grant's row goes (see [`Commit::deleted_tokens`]).
    pub fn delete_grant(&self, session_id: &str, fencing_token: u64) -> u64 {
        self.enqueue(|b| {
            b.forget_events(session_id);
            b.sessions.insert(session_id.to_owned(), None);
            b.deleted_tokens
                .insert(session_id.to_owned(), fencing_token);
        })
    }

    /// Queue the removal of a session and its results (retention forgot it).
    pub fn delete_session(&self, session_id: &str) -> u64 {
        self.enqueue(|b| {
            b.forget_events(session_id);
            b.sessions.insert(session_id.to_owned(), None);
            b.deleted_tokens.remove(session_id);
        })
    }

    /// Whether `n` more results, events or acknowledgements fit in the queue.
    pub fn has_room(&self, n: usize) -> bool {
        let q = lock(&self.inner.queue);
        q.pending.results.len() + q.pending.events.len() + q.pending.after.len() + n <= MAX_QUEUED
    }

    /// Queue a tool result; `then` runs on the writer thread once it is
    /// committed (acknowledge the executor, hand it to waiters there).
    /// Check [`has_room`](Self::has_room) first: past [`MAX_QUEUED`] the
    /// write is still queued (never dropped), only the bound is exceeded.
    pub fn put_result(&self, result: StoredResult, then: AfterCommit) -> u64 {
        self.enqueue(|b| {
            b.results.push(result);
            b.after.push(then);
        })
    }

    /// Queue an accepted session event; `then` runs on the writer thread
    /// once it is committed (acknowledge the executor, show it to stream
    /// clients). Check [`has_room`](Self::has_room) first, as for results.
    pub fn put_event(&self, event: StoredEvent, then: AfterCommit) -> u64 {
        self.enqueue(|b| {
            b.events.push(event);
            b.after.push(then);
        })
    }

    /// Queue the removal of a session's events below `floor` (its log's
    /// retention dropped them).
    pub fn trim_events(&self, session_id: &str, floor: u64) -> u64 {
        self.enqueue(|b| {
            let f = b.event_floors.entry(session_id.to_owned()).or_default();
            *f = (*f).max(floor);
        })
    }

    /// Queue the removal of all of a session's events (its id was granted
    /// anew). Events of it queued before and not yet being written are
    /// dropped from the queue: the clear comes first in a commit.
    pub fn clear_events(&self, session_id: &str) -> u64 {
        self.enqueue(|b| {
            b.forget_events(session_id);
            b.cleared_events.insert(session_id.to_owned());
        })
    }

    /// The stored events of one session (oldest first). Blocking.
    ///
    /// # Errors
    ///
    /// The database fails or a row does not decode.
    pub fn events(&self, session_id: &str) -> Result<Vec<StoredEvent>, StoreError> {
        self.inner.db.events(session_id)
    }

    /// The ticket of the newest write queued so far: once it is durable,
    /// everything queued before this call is.
    pub fn last_ticket(&self) -> u64 {
        lock(&self.inner.queue).seq
    }

    /// Run `then` once everything queued so far is committed.
    pub fn after_commit(&self, then: AfterCommit) -> u64 {
        self.enqueue(|b| b.after.push(then))
    }

    /// Wait until the write of `ticket` is committed, at most `limit`.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the commit did not come in time
    /// (the disk fails, or is too slow) or the writer stopped.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the write stays queued either way.
    pub async fn wait_durable(&self, ticket: u64, limit: Duration) -> Result<(), StoreError> {
        let mut rx = self.inner.durable.subscribe();
        let waited = tokio::time::timeout(limit, rx.wait_for(|d| *d >= ticket))
            .await
            .map(|r| r.map(|_| ()));
        match waited {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(StoreError::Unavailable("the store writer stopped".into())),
            Err(_) => Err(StoreError::Unavailable(format!(
                "the write was not durable within {limit:?}"
            ))),
        }
    }

    /// Flush what is queued and stop the writer thread. Blocking (run it
    /// on the blocking pool from async code); idempotent.
    pub fn shutdown(&self) {
        lock(&self.inner.queue).stop = true;
        self.inner.wake.notify_all();
        let handle = lock(&self.inner.writer).take();
        if let Some(h) = handle {
            if h.join().is_err() {
                tracing::error!("the store writer thread panicked");
            }
        }
    }

    /// A fencing token for `session_id` strictly above `floor` (a token
    /// another harness over the same database issued, from a block of its
    /// own: a takeover's new grant must be above it). From the current
    /// block when that is already above `floor`; else from a fresh block
    /// reserved now, which lies above every block ever reserved (so above
    /// `floor`). The older blocks left over are dropped, so tokens stay
    /// increasing across all sessions. Blocking (one write when a block
    /// is reserved): call it on the blocking pool.
    ///
    /// # Errors
    ///
    /// The reservation cannot be written.
    pub fn token_above(&self, session_id: &str, floor: u64) -> Result<u64, StoreError> {
        {
            let mut f = lock(&self.inner.fence);
            if f.next > floor && f.next <= f.end {
                let token = f.next;
                f.next += 1;
                f.current.insert(session_id.to_owned(), token);
                return Ok(token);
            }
        }
        let (start, end) = self.inner.db.reserve_block(FENCING_BLOCK)?;
        let mut f = lock(&self.inner.fence);
        if start > f.next {
            // Whatever is left of the current and the spare block is
            // below the new one: skipped, never issued after it.
            (f.next, f.end, f.spare) = (start, end, None);
        }
        if f.next <= floor || f.next > f.end {
            return Err(StoreError::Corrupt(format!(
                "a fresh fencing block ({start}..={end}) is not above token {floor}"
            )));
        }
        let token = f.next;
        f.next += 1;
        f.current.insert(session_id.to_owned(), token);
        Ok(token)
    }

    fn enqueue(&self, f: impl FnOnce(&mut Batch)) -> u64 {
        let mut q = lock(&self.inner.queue);
        f(&mut q.pending);
        q.seq += 1;
        let seq = q.seq;
        drop(q);
        self.inner.wake.notify_one();
        seq
    }

    fn request_reserve(&self) {
        self.enqueue(|b| b.reserve = true);
    }
}

impl LeaseStore for DurableState {
    fn next_fencing_token(&self, session_id: &str) -> Option<u64> {
        let mut f = lock(&self.inner.fence);
        if f.next > f.end {
            match f.spare.take() {
                Some((start, end)) => (f.next, f.end) = (start, end),
                None => {
                    let ask = !f.refilling;
                    f.refilling = true;
                    drop(f);
                    // Once per refill, not per refused grant: a burst of
                    // grants must not become a burst of log lines.
                    if ask {
                        self.request_reserve();
                        tracing::warn!("fencing block used up before the next was reserved");
                    } else {
                        tracing::trace!("fencing block used up; a reservation is in flight");
                    }
                    return None;
                }
            }
        }
        let token = f.next;
        f.next += 1;
        f.current.insert(session_id.to_owned(), token);
        let ask = f.spare.is_none() && !f.refilling && f.end - token < FENCING_BLOCK / 2;
        if ask {
            f.refilling = true;
        }
        drop(f);
        if ask {
            self.request_reserve();
        }
        Some(token)
    }

    fn current(&self, session_id: &str) -> Option<u64> {
        lock(&self.inner.fence).current.get(session_id).copied()
    }
}

/// The `state` column's value (searchable copy of `info.state`).
pub fn state_name(s: SessionState) -> &'static str {
    match s {
        SessionState::Assigning => "assigning",
        SessionState::Active => "active",
        SessionState::Disconnected => "disconnected",
        SessionState::Stopping => "stopping",
        SessionState::Ended => "ended",
    }
}

fn run_writer(inner: Arc<Inner>) {
    loop {
        let (batch, seq) = {
            let mut q = lock(&inner.queue);
            loop {
                if !q.pending.is_empty() {
                    break;
                }
                // Nothing to write: stop when asked, or when every handle
                // is gone (only this thread's is left).
                if q.stop || Arc::strong_count(&inner) == 1 {
                    return;
                }
                q = inner
                    .wake
                    .wait_timeout(q, IDLE_WAKE)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            (std::mem::take(&mut q.pending), q.seq)
        };
        let mut pause = Duration::from_millis(50);
        let mut attempts = 0u32;
        let written = loop {
            let commit = Commit {
                sessions: &batch.sessions,
                deleted_tokens: &batch.deleted_tokens,
                results: &batch.results,
                cleared_events: &batch.cleared_events,
                events: &batch.events,
                event_floors: &batch.event_floors,
                reserve: batch.reserve.then_some(FENCING_BLOCK),
            };
            match inner.db.commit(&commit) {
                Ok(block) => break Some(block),
                Err(e) => {
                    attempts += 1;
                    tracing::error!(error = %e, attempts, "store write failed; retrying");
                    if lock(&inner.queue).stop && attempts >= RETRIES_AT_SHUTDOWN {
                        break None;
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(RETRY_MAX);
                }
            }
        };
        let Some(block) = written else {
            tracing::error!("store writes given up at shutdown; executors will resend");
            return;
        };
        if let Some(block) = block {
            let mut f = lock(&inner.fence);
            f.spare = Some(block);
            f.refilling = false;
        }
        inner.durable.send_replace(seq);
        for then in batch.after {
            then();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: &str, token: u64, state: SessionState) -> SessionInfo {
        SessionInfo {
            connection_id: Some("c-1".into()),
            ready: true,
            ..SessionInfo::new(
                id.into(),
                "e1".into(),
                token,
                format!("lease-{id}-{token}"),
                state,
                "2026-01-01T00:00:00Z".into(),
            )
        }
    }

    fn open(dir: &std::path::Path) -> DurableState {
        DurableState::open(Arc::new(super::super::SqliteStore::open_dir(dir).unwrap())).unwrap()
    }

    #[test]
    fn a_token_above_another_stores_block() {
        let dir = tempfile::tempdir().unwrap();
        // Two harnesses over one database: the second's block is above
        // the first's.
        let first = open(dir.path());
        let second = open(dir.path());
        let theirs = second.next_fencing_token("s").unwrap();
        let mine = first.next_fencing_token("t").unwrap();
        assert!(mine < theirs);
        // Above a token of the other block: from a fresh block.
        let above = first.token_above("s", theirs).unwrap();
        assert!(above > theirs, "{above} after {theirs}");
        assert_eq!(first.current("s"), Some(above));
        // Tokens keep increasing after it, for every session.
        let next = first.next_fencing_token("u").unwrap();
        assert!(next > above);
        // Below the current block: from it, no reservation.
        assert_eq!(first.token_above("v", 1).unwrap(), next + 1);
        first.shutdown();
        second.shutdown();
    }

    #[tokio::test]
    async fn tokens_never_go_back_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let d = open(dir.path());
        let a = d.next_fencing_token("s").unwrap();
        let b = d.next_fencing_token("s").unwrap();
        assert!(b > a);
        d.shutdown();
        drop(d);
        let d = open(dir.path());
        let c = d.next_fencing_token("s").unwrap();
        assert!(c > b, "{c} after a reopen must exceed {b}");
        d.shutdown();
    }

    #[tokio::test]
    async fn a_used_up_block_is_refilled_in_the_background() {
        let dir = tempfile::tempdir().unwrap();
        let d = open(dir.path());
        let mut last = 0;
        let mut refused = 0;
        for _ in 0..(3 * FENCING_BLOCK) {
            match d.next_fencing_token("s") {
                Some(t) => {
                    assert!(t > last);
                    last = t;
                }
                None => {
                    refused += 1;
                    // Let the writer commit the reservation it was asked for.
                    let seq = lock(&d.inner.queue).seq;
                    d.wait_durable(seq, Duration::from_secs(10)).await.unwrap();
                }
            }
        }
        assert!(last >= 2 * FENCING_BLOCK, "last {last}, refused {refused}");
        d.shutdown();
    }

    #[tokio::test]
    async fn sessions_and_results_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let d = open(dir.path());
        d.put_session(StoredSession {
            info: info("s1", 3, SessionState::Active),
            lease_expires_at_ms: None,
        });
        d.put_session(StoredSession {
            info: info("s2", 4, SessionState::Disconnected),
            lease_expires_at_ms: Some(12_345),
        });
        let result: ToolResultParams = serde_json::from_value(serde_json::json!({
            "sessionId": "s1", "toolCallId": "t1", "outcome": "succeeded",
            "isError": false, "durationMs": 5
        }))
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = d.put_result(
            StoredResult {
                session_id: "s1".into(),
                fencing_token: 3,
                tool_call_id: "t1".into(),
                result: result.clone(),
            },
            Box::new(move || tx.send(()).unwrap()),
        );
        // A result of an older grant is not loaded.
        d.put_result(
            StoredResult {
                session_id: "s1".into(),
                fencing_token: 2,
                tool_call_id: "t0".into(),
                result: result.clone(),
            },
            Box::new(|| {}),
        );
        let gone = d.delete_session("s3");
        d.wait_durable(t.max(gone), Duration::from_secs(10))
            .await
            .unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        d.shutdown();
        drop(d);
        let d = open(dir.path());
        let (mut sessions, results) = d.load().unwrap();
        sessions.sort_by(|a, b| a.info.session_id.cmp(&b.info.session_id));
        assert_eq!(sessions.len(), 2);
        assert_eq!(sessions[0].info, info("s1", 3, SessionState::Active));
        assert_eq!(sessions[1].lease_expires_at_ms, Some(12_345));
        assert_eq!(results.len(), 1);
        assert_eq!(results[0].tool_call_id, "t1");
        assert_eq!(results[0].result, result);
        assert_eq!(d.current("s2"), Some(4));
        d.delete_session("s1");
        d.shutdown();
        let (sessions, results) = d.load().unwrap();
        assert_eq!(sessions.len(), 1);
        assert!(results.is_empty());
    }

    #[tokio::test]
    async fn events_round_trip_trim_clear_and_go_with_their_session() {
        let dir = tempfile::tempdir().unwrap();
        let d = open(dir.path());
        let ev = |sid: &str, n: u64| StoredEvent {
            session_id: sid.into(),
            fencing_token: 7,
            sequence: n,
            json: Arc::from(format!("{{\"sequence\":{n}}}")),
        };
        let (tx, rx) = std::sync::mpsc::channel();
        for n in 1..=5 {
            let tx = tx.clone();
            d.put_event(ev("s1", n), Box::new(move || tx.send(n).unwrap()));
        }
        d.put_event(ev("s2", 1), Box::new(|| {}));
        // Floors apply after the batch's inserts: 1 and 2 go.
        let t = d.trim_events("s1", 3);
        d.wait_durable(t, Duration::from_secs(10)).await.unwrap();
        let acked: Vec<u64> = (0..5)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(acked, vec![1, 2, 3, 4, 5], "after-commit runs in order");
        let seqs = |d: &DurableState, sid: &str| -> Vec<u64> {
            d.events(sid).unwrap().iter().map(|e| e.sequence).collect()
        };
        assert_eq!(seqs(&d, "s1"), vec![3, 4, 5]);
        assert_eq!(d.events("s1").unwrap()[0], ev("s1", 3));
        // A clear drops what is queued for the session before it, and what
        // is stored; what is queued after it is kept.
        d.put_event(ev("s2", 2), Box::new(|| {}));
        d.clear_events("s2");
        let t = d.put_event(ev("s2", 1), Box::new(|| {}));
        d.wait_durable(t, Duration::from_secs(10)).await.unwrap();
        assert_eq!(seqs(&d, "s2"), vec![1]);
        // They survive a reopen, and go with their session.
        d.shutdown();
        drop(d);
        let d = open(dir.path());
        assert_eq!(seqs(&d, "s1"), vec![3, 4, 5]);
        let t = d.delete_session("s1");
        d.wait_durable(t, Duration::from_secs(10)).await.unwrap();
        assert!(seqs(&d, "s1").is_empty());
        assert_eq!(seqs(&d, "s2"), vec![1]);
        d.shutdown();
    }
}

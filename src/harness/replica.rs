//! This harness as one of several live replicas over one PostgreSQL
//! database (docs/store.md, "Several replicas"). Only a harness over the
//! PostgreSQL store has one; with SQLite or in memory nothing here runs
//! and the 4004 rule is the leases actor's alone.
//!
//! **The 4004 rule across replicas.** The database numbers the
//! connections of each executor id ([`PgReplicas::claim_connection`]);
//! the highest generation is the one that may live. This module keeps,
//! per executor id, the highest generation seen (from this replica's own
//! claims, every replica's notifications and the poll) and this replica's
//! connections with theirs, under one lock per executor id
//! ([`Replica::admit`], [`Replica::observed`]). Whichever of "a newer
//! generation is seen" and "an older connection is admitted" comes
//! second under that lock sees the other, so no older connection
//! survives a newer one it has heard of; a lost notification is covered
//! by the next poll (one heartbeat interval). A connection admitted on
//! this replica is handed to the leases actor *under* the lock, so two
//! connections of one executor on this replica reach it in generation
//! order, and its own local 4004 replacement agrees with the database.
//!
//! Memory: one entry per executor id ever connected to this replica (a
//! generation and this replica's live connections of it).

use crate::harness::actors::leases::Adopted;
use crate::harness::runtime::Shared;
use crate::harness::store::durable::StoredSession;
use crate::harness::store::pg_replicas::Generation;
use crate::harness::store::PgReplicas;
use crate::harness::types::{SessionInfo, SessionState};
use crate::lease::ConnId;
use crate::wire::types::{AssignParams, AssignResult, LeaseGrant};
use crate::wire::{CloseCode, Link, Method};
use dashmap::DashMap;
use std::sync::{Arc, Weak};

/// What this replica knows of one executor id.
#[derive(Default)]
struct ExecGens {
    /// The highest generation seen from any replica.
    latest: i64,
    /// This replica's connections of the executor, with their generation.
    local: Vec<(ConnId, i64)>,
}

/// The generation rule, without I/O: per executor id the highest
/// generation seen and this replica's connections with theirs, one lock
/// per executor id.
#[derive(Default)]
pub struct Generations {
    gens: DashMap<String, ExecGens>,
}

impl Generations {
    /// Connection `conn` of `executor_id` was numbered `generation`: if no
    /// newer one is known, record it and run `register` (hand it to the
    /// leases actor) while still holding the executor's lock, and return
    /// what `register` returned. `false` without running it: a newer
    /// connection exists; this one must close with 4004.
    pub fn admit(
        &self,
        executor_id: &str,
        conn: ConnId,
        generation: i64,
        register: impl FnOnce() -> bool,
    ) -> bool {
        let mut e = self.gens.entry(executor_id.to_owned()).or_default();
        if generation < e.latest {
            return false;
        }
        e.latest = generation;
        e.local.push((conn, generation));
        register()
    }

    /// `generation` of `executor_id` was announced (or polled): `close`
    /// each of this replica's connections of it that is older (under the
    /// lock), and forget them.
    pub fn observed(&self, executor_id: &str, generation: i64, mut close: impl FnMut(ConnId, i64)) {
        let mut e = self.gens.entry(executor_id.to_owned()).or_default();
        e.latest = e.latest.max(generation);
        let latest = e.latest;
        e.local.retain(|&(conn, g)| {
            if g >= latest {
                return true;
            }
            close(conn, g);
            false
        });
    }

    /// The highest generation of `executor_id` seen (0: none).
    pub fn latest(&self, executor_id: &str) -> i64 {
        self.gens.get(executor_id).map_or(0, |e| e.latest)
    }

    /// `conn` is gone.
    pub fn forget(&self, executor_id: &str, conn: ConnId) {
        if let Some(mut e) = self.gens.get_mut(executor_id) {
            e.local.retain(|&(c, _)| c != conn);
        }
    }

    /// The executor ids with a connection on this replica (what the poll
    /// reads).
    pub fn local_executors(&self) -> Vec<String> {
        self.gens
            .iter()
            .filter(|e| !e.local.is_empty())
            .map(|e| e.key().clone())
            .collect()
    }
}

/// A session row of the database, as another replica left it, for
/// [`judge_takeover`]. Times are unix ms on the database's clock,
/// `lease_expires_at_ms` included: the writing harness's deadline is moved
/// onto that clock as it is written (docs/store.md, "Takeover").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakeoverRow {
    pub executor_id: String,
    pub ended: bool,
    /// Set by the replica that held the grant once its holder connection
    /// was lost: the orphaned lease runs out then.
    pub lease_expires_at_ms: Option<u64>,
    /// When the replica that made the grant was last seen alive (its row
    /// of `replicas`), or when the row was written if that replica has no
    /// row.
    pub owner_seen_ms: u64,
}

/// What a replica does with a resumed session it does not hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takeover {
    /// The lease is still current: take the grant over (a new fencing
    /// token, claimed conditionally on the row's) and keep the session.
    Take,
    /// The lease ran out: end the row (`lease_expired`) and tell the
    /// executor to stop the session.
    Expired,
    /// Not this executor's, or already over: the executor stops it; the
    /// row is left alone.
    NotYours,
}

/// The takeover rule, without I/O: may `executor_id`, resuming `row`'s
/// session at `now_ms` (the database's clock), keep it?
///
/// A lease is current while its holder connection lives, and for
/// `ttl_ms` after the holder's last frame once it is lost. The replica
/// that held it records that deadline when it sees the loss
/// (`lease_expires_at_ms`). A replica that died recorded nothing: the
/// last frame it can have acknowledged came at most one poll interval
/// (`poll_ms`, how often a live replica refreshes its row) after it was
/// last seen, so its leases ran out by `owner_seen_ms + poll_ms + ttl_ms`
/// at the latest. A row whose holder is still live on a replica that is
/// alive is current too: the executor's newest connection is the
/// resuming one (the database numbered it), so the older holder is being
/// closed with 4004, and the new grant's higher fencing token fences it.
pub fn judge_takeover(
    row: &TakeoverRow,
    executor_id: &str,
    now_ms: u64,
    ttl_ms: u64,
    poll_ms: u64,
) -> Takeover {
    if row.ended || row.executor_id != executor_id {
        return Takeover::NotYours;
    }
    if now_ms < lease_deadline(row, ttl_ms, poll_ms) {
        Takeover::Take
    } else {
        Takeover::Expired
    }
}

/// When `row`'s lease runs out at the latest (unix ms): the deadline its
/// holding replica recorded, else one poll interval and one TTL after
/// that replica was last seen (see [`judge_takeover`]).
pub fn lease_deadline(row: &TakeoverRow, ttl_ms: u64, poll_ms: u64) -> u64 {
    row.lease_expires_at_ms.unwrap_or_else(|| {
        row.owner_seen_ms
            .saturating_add(poll_ms)
            .saturating_add(ttl_ms)
    })
}

/// The sweep rule, without I/O: may a live replica end `row` (a session
/// another replica granted) at `now_ms` (the database's clock), although
/// no executor resumed it?
///
/// Only when its replica is dead (not seen for `ttl_ms`: a live one runs
/// and ends its own sessions by its own lease table) and the lease ran
/// out by the same deadline as [`judge_takeover`]'s. So the sweep never
/// ends a session its executor could still resume and keep: whenever this
/// says yes, a takeover at the same `now_ms` would say
/// [`Takeover::Expired`] (or [`Takeover::NotYours`]).
pub fn orphan_expired(row: &TakeoverRow, now_ms: u64, ttl_ms: u64, poll_ms: u64) -> bool {
    let owner_dead = now_ms >= row.owner_seen_ms.saturating_add(ttl_ms);
    !row.ended && owner_dead && now_ms >= lease_deadline(row, ttl_ms, poll_ms)
}

/// `stored` ended because its lease ran out while no replica held it
/// (`lease_expired`, now), as a takeover or the sweep writes it.
pub(crate) fn ended_expired(stored: StoredSession) -> StoredSession {
    let mut info = stored.info;
    info.state = SessionState::Ended;
    info.ended_reason = Some(crate::wire::types::EndReason::LEASE_EXPIRED.into());
    info.ended_at = Some(crate::wire::types::now_rfc3339());
    StoredSession {
        info,
        lease_expires_at_ms: None,
    }
}

/// Ended connections blanked in the database at once at most
/// ([`Replica::connection_ended`]): the store has one connection, so more
/// would only hold blocking threads waiting for it (a replica stopping
/// with 10 000 executors ends them all at once).
const ENDING_AT_ONCE: usize = 4;

/// The replica state of one harness.
pub struct Replica {
    pub db: Arc<PgReplicas>,
    pub gens: Generations,
    /// Forwarded API calls go out on it (`crate::harness::http::forward`).
    pub http: reqwest::Client,
    /// Places for [`Replica::connection_ended`]'s writes.
    ending: Arc<tokio::sync::Semaphore>,
}

impl Replica {
    pub fn new(db: Arc<PgReplicas>) -> Replica {
        Replica {
            db,
            gens: Generations::default(),
            http: crate::harness::http::forward::client(),
            ending: Arc::new(tokio::sync::Semaphore::new(ENDING_AT_ONCE)),
        }
    }

    /// See [`Generations::admit`].
    pub fn admit(
        &self,
        executor_id: &str,
        conn: ConnId,
        generation: i64,
        register: impl FnOnce() -> bool,
    ) -> bool {
        self.gens.admit(executor_id, conn, generation, register)
    }

    /// A generation was announced (or polled): close every connection of
    /// this replica of that executor that is older, with 4004.
    pub fn observed(&self, shared: &Shared, g: &Generation) {
        self.gens
            .observed(&g.executor_id, g.generation, |conn, generation| {
                if let Some(link) = shared.link_of(conn) {
                    link.close(CloseCode::Replaced, "replaced");
                    // At once, not when the close handshake ends (a frozen
                    // socket never finishes it): the connection holds
                    // nothing from now on, and its sessions' leases are
                    // orphaned here (the newer connection's replica takes
                    // them over in the database).
                    if let Some(l) = shared.leases() {
                        let _ = l.send_message(
                            crate::harness::actors::leases::LeasesMsg::Disconnected(conn),
                        );
                    }
                    shared.metrics.replacements.inc();
                    tracing::info!(executor_id = %g.executor_id, replaced = %conn, generation,
                        by = g.generation,
                        "connection replaced by a newer one on another replica (4004)");
                }
            });
    }

    /// See [`Generations::latest`].
    pub fn latest(&self, executor_id: &str) -> i64 {
        self.gens.latest(executor_id)
    }

    /// See [`Generations::forget`].
    pub fn forget(&self, executor_id: &str, conn: ConnId) {
        self.gens.forget(executor_id, conn);
    }

    /// This replica's connection `connection_id` of `executor_id` ended:
    /// blank it in the database ([`PgReplicas::connection_ended`]), so no
    /// other replica lists the executor as connected here or forwards to
    /// it. In the background, [`ENDING_AT_ONCE`] at a time (the waiting
    /// ones are at most one per connection that ended): the socket is gone
    /// either way, and a write that fails (logged) leaves the row listed
    /// until the executor connects again or this replica is dead (a lease
    /// TTL unseen).
    pub fn connection_ended(&self, executor_id: &str, connection_id: &str) {
        let (db, ending) = (self.db.clone(), self.ending.clone());
        let (exec, conn) = (executor_id.to_owned(), connection_id.to_owned());
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            let Ok(_place) = ending.acquire_owned().await else {
                return;
            };
            let (e, c) = (exec.clone(), conn.clone());
            let done = tokio::task::spawn_blocking(move || db.connection_ended(&e, &c)).await;
            match done {
                Ok(Ok(true)) => tracing::debug!(executor_id = %exec, connection_id = %conn,
                    "connection marked ended in the store"),
                Ok(Ok(false)) => {}
                Ok(Err(e)) => tracing::warn!(executor_id = %exec, connection_id = %conn,
                    error = %e, "cannot mark the connection ended in the store; other \
                    replicas list it until it reconnects or this replica is unseen for a \
                    lease TTL"),
                Err(e) => tracing::warn!(error = %e, "marking a connection ended failed"),
            }
        });
    }

    /// See [`Generations::local_executors`].
    pub fn local_executors(&self) -> Vec<String> {
        self.gens.local_executors()
    }
}

/// Start listening for other replicas' registrations: notifications go
/// through a channel to a task of the harness's runtime, which applies
/// them ([`Replica::observed`]). Both end when the listener stops.
///
/// # Errors
///
/// The listener thread cannot be started.
pub(crate) fn watch(shared: &Arc<Shared>, url: String) -> Result<(), std::io::Error> {
    let Some(replica) = shared.replica.get() else {
        return Ok(());
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Generation>();
    let weak: Weak<Shared> = Arc::downgrade(shared);
    let local = {
        let weak = weak.clone();
        move || {
            weak.upgrade()
                .and_then(|s| s.replica.get().map(|r| r.local_executors()))
                .unwrap_or_default()
        }
    };
    let poll = std::time::Duration::from_millis(shared.config.heartbeat_interval_ms.max(50));
    let ttl = std::time::Duration::from_millis(shared.config.lease_ttl_ms);
    replica
        .db
        .watch(poll, ttl, url, local, move |g| {
            let _ = tx.send(g);
        })
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    tokio::spawn(async move {
        while let Some(g) = rx.recv().await {
            let Some(shared) = weak.upgrade() else { return };
            if let Some(r) = shared.replica.get() {
                r.observed(&shared, &g);
            }
        }
    });
    Ok(())
}

/// What the database decided for the sessions of a resumed register
/// ([`take_over`]): the leases actor drops `drop` (stale copies: another
/// grant is the row's) without stopping anything, adopts `adopt`, keeps
/// `kept` (re-adopting its own grant if its table let it run out
/// meanwhile), and never stops `leave` (another replica's statement won).
/// `stop_tokens`: the row's fencing token of each session the executor is
/// told to stop, sent as `fencingToken` with the stop.
#[derive(Default)]
pub struct ResumeSettlement {
    pub adopt: Vec<Adopted>,
    pub drop: Vec<(String, u64)>,
    pub kept: Vec<(String, u64)>,
    pub leave: Vec<String>,
    pub stop_tokens: std::collections::BTreeMap<String, u64>,
}

/// Settle, for a resumed register of `executor_id` on this replica's
/// connection `connection_id`, **every** session of `resume` by the
/// database ([`crate::harness::rows::settle_resume`]; issue 54): this
/// replica's copy is kept only while the row names this replica and the
/// copy's token (one conditional `UPDATE`); a copy of another grant is
/// dropped without stopping anything; a current lease of another grant is
/// taken over with a new token (one conditional `UPDATE`); a lease that
/// ran out by the database's clock is ended (one conditional `UPDATE`) and
/// stopped. A failing database decides nothing: the executor is told to
/// stop only the sessions the leases actor knows nothing of, as before
/// (logged).
pub(crate) async fn take_over(
    shared: &Shared,
    executor_id: &str,
    connection_id: &str,
    resume: &[String],
) -> ResumeSettlement {
    let (Some(replica), Some(durable)) = (shared.replica.get(), shared.durable.get()) else {
        return ResumeSettlement::default();
    };
    if resume.is_empty() {
        return ResumeSettlement::default();
    }
    let listed: Vec<(String, Option<crate::harness::rows::Local>)> = resume
        .iter()
        .map(|s| {
            let local = shared.sessions.get(s).map(|r| crate::harness::rows::Local {
                fencing_token: r.fencing_token,
                ended: r.state == SessionState::Ended,
            });
            (s.clone(), local)
        })
        .collect();
    let (db, durable) = (replica.db.clone(), durable.clone());
    let (exec, conn) = (executor_id.to_owned(), connection_id.to_owned());
    let ttl = shared.config.lease_ttl_ms;
    let poll = shared.config.heartbeat_interval_ms.max(50);
    let done = tokio::task::spawn_blocking(move || {
        let me = db.id().to_owned();
        crate::harness::rows::settle_resume(
            &*db,
            &me,
            &exec,
            &conn,
            &listed,
            |id, above| match durable.token_above(id, above) {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::warn!(session = %id, error = %e, "no fencing token for a takeover");
                    None
                }
            },
            ttl,
            poll,
            None,
        )
    })
    .await;
    let settled = match done {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot read resumed sessions from the store; none settled by it");
            return ResumeSettlement::default();
        }
        Err(e) => {
            tracing::warn!(error = %e, "takeover task failed");
            return ResumeSettlement::default();
        }
    };
    let mut out = ResumeSettlement::default();
    for s in settled {
        let id = s.session_id;
        if s.drop_local {
            let stale = shared.sessions.get(&id).map_or(0, |r| r.fencing_token);
            tracing::info!(session = %id, fencing_token = stale,
                "this replica's copy of a resumed session is superseded in the store: dropped, nothing stopped");
            out.drop.push((id.clone(), stale));
        }
        match s.outcome {
            crate::harness::rows::Settled::Kept { token } => out.kept.push((id, token)),
            crate::harness::rows::Settled::Taken {
                token,
                taken: (info, results),
            } => {
                tracing::info!(session = %id, fencing_token = token,
                    "taking over a session granted by another grant");
                let _ = token;
                out.adopt.push(Adopted { info, results });
            }
            crate::harness::rows::Settled::Stop { token } => {
                if let Some(t) = token {
                    out.stop_tokens.insert(id, t);
                }
            }
            crate::harness::rows::Settled::Lost => {
                tracing::info!(session = %id, "the session's row changed meanwhile: left alone");
                out.leave.push(id);
            }
        }
    }
    out
}

/// Tell the executor the new grant of a session taken over (its fencing
/// token is higher: PROTOCOL.md §5, "the lease is renewed in place"; the
/// session and its processes go on).
pub(crate) async fn renew(link: &Link, info: &SessionInfo, timeout: std::time::Duration) {
    let params = AssignParams {
        session_id: info.session_id.clone(),
        work_id: info.session_id.clone(),
        agent_id: None,
        environment_id: None,
        lease: LeaseGrant {
            token: info.lease_token.clone(),
            fencing_token: info.fencing_token,
        },
        deadline_ms: None,
        mcp_servers: Vec::new(),
        metadata: info.metadata.clone(),
        resources: Vec::new(),
        restore: None,
    };
    match link
        .request::<_, AssignResult>(Method::SessionAssign, &params, timeout)
        .await
    {
        Ok(_) => {
            tracing::debug!(session = %info.session_id, "taken-over grant renewed on the executor")
        }
        Err(e) => {
            tracing::warn!(session = %info.session_id, error = %e, "renewing a taken-over grant failed")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_connection_never_outlives_a_newer_one_it_heard_of() {
        let g = Generations::default();
        // Admitted, then a newer generation from another replica: closed.
        assert!(g.admit("e", ConnId(1), 1, || true));
        let mut closed = Vec::new();
        g.observed("e", 2, |c, gen| closed.push((c, gen)));
        assert_eq!(closed, vec![(ConnId(1), 1)]);
        assert!(g.local_executors().is_empty());
        // Heard of first, admitted after: refused, `register` never runs.
        assert!(!g.admit("e", ConnId(2), 1, || panic!(
            "registered an older connection"
        )));
        // Its own generation, or an older announcement: kept.
        assert!(g.admit("e", ConnId(3), 3, || true));
        g.observed("e", 3, |c, _| panic!("closed {c}"));
        g.observed("e", 2, |c, _| panic!("closed {c}"));
        assert_eq!(g.latest("e"), 3);
        assert_eq!(g.local_executors(), vec!["e".to_owned()]);
        // Another executor id is another lock and another count.
        assert!(g.admit("f", ConnId(4), 1, || true));
        g.forget("e", ConnId(3));
        assert_eq!(g.local_executors(), vec!["f".to_owned()]);
    }

    fn row(expires: Option<u64>, seen: u64) -> TakeoverRow {
        TakeoverRow {
            executor_id: "e".into(),
            ended: false,
            lease_expires_at_ms: expires,
            owner_seen_ms: seen,
        }
    }

    #[test]
    fn a_dead_replicas_lease_runs_out_one_poll_and_one_ttl_after_it_was_seen() {
        let r = row(None, 1_000);
        assert_eq!(judge_takeover(&r, "e", 1_000, 500, 100), Takeover::Take);
        assert_eq!(judge_takeover(&r, "e", 1_599, 500, 100), Takeover::Take);
        assert_eq!(judge_takeover(&r, "e", 1_600, 500, 100), Takeover::Expired);
        // A recorded deadline is the lease's, whatever the owner's liveness.
        let r = row(Some(1_200), 5_000);
        assert_eq!(judge_takeover(&r, "e", 1_199, 500, 100), Takeover::Take);
        assert_eq!(judge_takeover(&r, "e", 1_200, 500, 100), Takeover::Expired);
        // Another executor's session, or one over, is never taken.
        assert_eq!(judge_takeover(&r, "f", 0, 500, 100), Takeover::NotYours);
        let ended = TakeoverRow {
            ended: true,
            ..row(None, 1_000)
        };
        assert_eq!(judge_takeover(&ended, "e", 0, 500, 100), Takeover::NotYours);
    }

    #[test]
    fn the_sweep_ends_only_a_dead_replicas_run_out_lease() {
        // Owner last seen at 1000, ttl 500, poll 100: dead from 1500,
        // lease out from 1600.
        let r = row(None, 1_000);
        assert!(!orphan_expired(&r, 1_499, 500, 100));
        assert!(!orphan_expired(&r, 1_599, 500, 100));
        assert!(orphan_expired(&r, 1_600, 500, 100));
        // A recorded deadline long past, but the owner still alive: it
        // is the owner's to end, not the sweep's.
        let r = row(Some(1_200), 5_000);
        assert!(!orphan_expired(&r, 5_499, 500, 100));
        assert!(orphan_expired(&r, 5_500, 500, 100));
        // A recorded deadline later than the owner's death counts.
        let r = row(Some(9_000), 1_000);
        assert!(!orphan_expired(&r, 8_999, 500, 100));
        assert!(orphan_expired(&r, 9_000, 500, 100));
        // An ended row is never ended again.
        let ended = TakeoverRow {
            ended: true,
            ..row(None, 1_000)
        };
        assert!(!orphan_expired(&ended, 100_000, 500, 100));
    }

    proptest::proptest! {
        /// The sweep never ends a session its executor could still
        /// resume and keep, and once it would end one it would at every
        /// later `now`.
        #[test]
        fn the_sweep_agrees_with_the_takeover(
            expires in proptest::option::of(0u64..10_000),
            seen in 0u64..10_000,
            ended: bool,
            now in 0u64..20_000,
            later in 0u64..20_000,
            ttl in 0u64..5_000,
            poll in 0u64..1_000,
        ) {
            let r = TakeoverRow {
                executor_id: "e".into(),
                ended,
                lease_expires_at_ms: expires,
                owner_seen_ms: seen,
            };
            if orphan_expired(&r, now, ttl, poll) {
                proptest::prop_assert_eq!(judge_takeover(&r, "e", now, ttl, poll), Takeover::Expired);
                proptest::prop_assert!(now >= seen + ttl);
                proptest::prop_assert!(orphan_expired(&r, now + later, ttl, poll));
            } else if !ended && now >= seen + ttl {
                proptest::prop_assert_eq!(judge_takeover(&r, "e", now, ttl, poll), Takeover::Take);
            }
        }

        /// Once a lease counts as run out it stays so at every later
        /// `now`; only its own executor ever takes it; an ended row never.
        #[test]
        fn takeover_is_monotonic_in_time(
            expires in proptest::option::of(0u64..10_000),
            seen in 0u64..10_000,
            ended: bool,
            mine: bool,
            now in 0u64..20_000,
            later in 0u64..20_000,
            ttl in 0u64..5_000,
            poll in 0u64..1_000,
        ) {
            let r = TakeoverRow {
                executor_id: if mine { "e".into() } else { "f".into() },
                ended,
                lease_expires_at_ms: expires,
                owner_seen_ms: seen,
            };
            let first = judge_takeover(&r, "e", now, ttl, poll);
            if !mine || ended {
                proptest::prop_assert_eq!(first, Takeover::NotYours);
            }
            if first == Takeover::Expired {
                proptest::prop_assert_eq!(
                    judge_takeover(&r, "e", now + later, ttl, poll),
                    Takeover::Expired
                );
            }
            if first == Takeover::Take {
                let deadline = expires.unwrap_or(seen + poll + ttl);
                proptest::prop_assert!(now < deadline);
            }
        }
    }
}

//! Who holds a session, as the database decides it (docs/store.md,
//! "Holding a session over several replicas"; issue 54).
//!
//! Over several replicas a replica's own copy of a session (its leases
//! actor's table and published map) is only a cache. The session's row
//! says which replica holds which grant (`replica`, `fencing_token`), and
//! a replica serves a session (keeps it on a resume, takes it over,
//! expires it, stops it) only while the row names it and its token. Each
//! such change of hands is **one conditional statement** on the row,
//! ordered by the row lock, and time in it is the **store's clock**
//! (PostgreSQL's `now()`), never a replica's.
//!
//! This module holds the rules without I/O ([`plan_resume`],
//! [`judge_takeover`]) and the statements they need as a trait,
//! [`SessionRows`], with two stores: [`MemoryRows`] (one process; the
//! property model's reference) and `PgReplicas` (the real one). The
//! drivers [`settle_resume`] and [`expire`] run the rules over any store,
//! so the model in `tests/misc/lease_model_replicas.rs` exercises the code
//! the harness runs, over both stores.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// One session's row, as a replica reads it. Times are unix ms on the
/// store's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub executor_id: String,
    pub fencing_token: u64,
    /// The replica that made the current grant (`None`: a harness without
    /// replicas wrote it).
    pub replica: Option<String>,
    pub ended: bool,
    /// The holder connection the row names (`None`: none recorded).
    pub connection_id: Option<String>,
    /// Set by the holding replica once its holder connection was lost: the
    /// orphaned lease runs out then.
    pub lease_expires_at_ms: Option<u64>,
    /// When the granting replica was last seen alive.
    pub owner_seen_ms: u64,
}

/// What [`SessionRows::expire`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// The row was this replica's grant, its lease ran out by the store's
    /// clock: it is ended now (`lease_expired`).
    Ended,
    /// The row is still this replica's grant, but its lease has not run out
    /// by the store's clock (or names a newer holder connection): look
    /// again in `remaining_ms`.
    NotYet { remaining_ms: u64 },
    /// The row names another grant (a newer token, another replica) or is
    /// over: this replica's copy is stale. Drop it, stop nothing.
    Superseded,
}

/// The conditional statements on session rows. `now`: `None` is the
/// store's own clock (PostgreSQL's `now()`; production), `Some` an
/// explicit one (the model). Every method that changes a row changes it
/// only if the row is still what the caller believes (the same token,
/// replica and, for an expiry, holder), in one statement.
pub trait SessionRows {
    type Error: std::fmt::Display;
    /// What a won takeover hands back (the results moved to the new grant).
    type Taken;

    /// The store's clock, unix ms.
    fn clock(&self, now: Option<u64>) -> Result<u64, Self::Error>;

    /// The rows of `ids` that exist.
    fn rows(&self, ids: &[String]) -> Result<BTreeMap<String, Row>, Self::Error>;

    /// A fresh grant by `replica` (`previous`: the token it knew, `None`:
    /// none). `false`: another grant won.
    #[allow(clippy::too_many_arguments)]
    fn grant(
        &self,
        session_id: &str,
        executor_id: &str,
        token: u64,
        replica: &str,
        connection_id: &str,
        previous: Option<u64>,
    ) -> Result<bool, Self::Error>;

    /// Take grant `previous` over as `token` (larger) for `replica`, held
    /// by `connection_id`, if the row is still `previous` and not ended.
    fn take_over(
        &self,
        session_id: &str,
        previous: u64,
        token: u64,
        replica: &str,
        connection_id: &str,
    ) -> Result<Option<Self::Taken>, Self::Error>;

    /// The executor resumed grant `token` of `replica` on `connection_id`:
    /// keep it, if the row is still that grant, not ended, and its lease
    /// not run out by the store's clock.
    fn keep(
        &self,
        session_id: &str,
        token: u64,
        replica: &str,
        connection_id: &str,
        now: Option<u64>,
    ) -> Result<bool, Self::Error>;

    /// `replica` lost the holder of grant `token`: record the lease's
    /// deadline (`deadline_ms` on the replica's clock, read at
    /// `local_now_ms`; stored on the store's clock) if the row is still
    /// that grant.
    fn lost(
        &self,
        session_id: &str,
        token: u64,
        replica: &str,
        deadline_ms: u64,
        local_now_ms: u64,
        now: Option<u64>,
    ) -> Result<bool, Self::Error>;

    /// End grant `token` of `replica` for `lease_expired`, if the row is
    /// still that grant, held (last) by `holder`, and its lease ran out by
    /// the store's clock: the recorded deadline, else `deadline_ms` (the
    /// replica's own, read at `local_now_ms`) moved onto that clock.
    #[allow(clippy::too_many_arguments)]
    fn expire(
        &self,
        session_id: &str,
        token: u64,
        replica: &str,
        holder: Option<&str>,
        deadline_ms: u64,
        local_now_ms: u64,
        now: Option<u64>,
    ) -> Result<Expiry, Self::Error>;

    /// End grant `previous` (a lease that ran out while no replica held
    /// it), if the row is still that grant and not ended.
    fn end_expired(&self, session_id: &str, previous: u64) -> Result<bool, Self::Error>;

    /// Whether the row is grant `token` of `replica`, not ended: asked
    /// before a replica stops a session.
    fn holds(&self, session_id: &str, token: u64, replica: &str) -> Result<bool, Self::Error>;
}

/// What a replica does with a resumed session.
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
/// session at `now_ms` (the store's clock), keep it under a new grant?
/// See `crate::harness::replica::judge_takeover` for the rationale.
pub fn judge_takeover(
    row: &Row,
    executor_id: &str,
    now_ms: u64,
    ttl_ms: u64,
    poll_ms: u64,
) -> Takeover {
    if row.ended || row.executor_id != executor_id {
        return Takeover::NotYours;
    }
    let deadline = row.lease_expires_at_ms.unwrap_or_else(|| {
        row.owner_seen_ms
            .saturating_add(poll_ms)
            .saturating_add(ttl_ms)
    });
    if now_ms < deadline {
        Takeover::Take
    } else {
        Takeover::Expired
    }
}

/// This replica's copy of a session, as its leases actor holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Local {
    pub fencing_token: u64,
    /// Ended here (its view says `ended`).
    pub ended: bool,
}

/// The plan for one session of a resumed register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// The row is this replica's grant and its copy is that grant: keep it
    /// (with [`SessionRows::keep`]).
    Keep,
    /// Another grant (another replica's, or an older copy of its own): take
    /// it over from `previous`.
    TakeOver { previous: u64 },
    /// The lease ran out while no replica held it: end row `previous`, the
    /// executor stops the session.
    EndExpired { previous: u64 },
    /// Not this executor's, over, or unknown: the executor stops it (under
    /// the row's token when there is a row).
    Stop { token: Option<u64> },
}

/// The resume rule, without I/O: what replica `me` does with a session
/// `executor_id` lists in its resume, given its own copy and the row
/// (read at `now_ms`, the store's clock). The row decides: the local copy
/// is kept only when the row names `me` and the copy's token.
pub fn plan_resume(
    me: &str,
    executor_id: &str,
    local: Option<Local>,
    row: Option<&Row>,
    now_ms: u64,
    ttl_ms: u64,
    poll_ms: u64,
) -> Plan {
    let Some(row) = row else {
        return Plan::Stop { token: None };
    };
    let mine = row.replica.as_deref() == Some(me)
        && local.is_some_and(|l| !l.ended && l.fencing_token == row.fencing_token);
    if mine && !row.ended && row.executor_id == executor_id {
        return Plan::Keep;
    }
    match judge_takeover(row, executor_id, now_ms, ttl_ms, poll_ms) {
        Takeover::Take => Plan::TakeOver {
            previous: row.fencing_token,
        },
        Takeover::Expired => Plan::EndExpired {
            previous: row.fencing_token,
        },
        Takeover::NotYours => Plan::Stop {
            token: Some(row.fencing_token),
        },
    }
}

/// What became of one session of a resumed register ([`settle_resume`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Settled<T> {
    /// Kept under this replica's grant `token` (the row said so and the
    /// keep statement won).
    Kept { token: u64 },
    /// Taken over: the new grant `token` is the row now.
    Taken { token: u64, taken: T },
    /// The executor is told to stop it (`session.stop lease_expired`),
    /// under `token` when the row has one: the row is over, or not this
    /// executor's, or its lease ran out (ended here by a conditional
    /// statement).
    Stop { token: Option<u64> },
    /// Another replica's statement won a race for the row: left alone,
    /// nothing is stopped.
    Lost,
}

/// One session of a resumed register, settled.
#[derive(Debug, Clone, PartialEq)]
pub struct SettledSession<T> {
    pub session_id: String,
    pub outcome: Settled<T>,
    /// This replica's copy is stale (another grant is the row's): drop it
    /// without stopping anything.
    pub drop_local: bool,
}

/// Settle every session `executor_id` resumes on replica `me`'s
/// connection `connection_id`: read the rows once, plan each
/// ([`plan_resume`]), then carry out each plan with one conditional
/// statement. `next_token(session, above)` draws a fencing token above
/// `above` for a takeover.
///
/// # Errors
///
/// The store fails while reading the rows (a failure of one session's
/// statement only loses that session: it is left alone).
#[allow(clippy::too_many_arguments)]
pub fn settle_resume<S: SessionRows + ?Sized>(
    rows: &S,
    me: &str,
    executor_id: &str,
    connection_id: &str,
    listed: &[(String, Option<Local>)],
    mut next_token: impl FnMut(&str, u64) -> Option<u64>,
    ttl_ms: u64,
    poll_ms: u64,
    now: Option<u64>,
) -> Result<Vec<SettledSession<S::Taken>>, S::Error> {
    let ids: Vec<String> = listed.iter().map(|(s, _)| s.clone()).collect();
    let now_ms = rows.clock(now)?;
    let found = rows.rows(&ids)?;
    let mut out = Vec::with_capacity(listed.len());
    for (id, local) in listed {
        let row = found.get(id);
        let plan = plan_resume(me, executor_id, *local, row, now_ms, ttl_ms, poll_ms);
        // A copy of another grant than the row's is stale, whatever
        // happens next.
        let stale = local.is_some_and(|l| {
            !l.ended
                && row.is_some_and(|r| {
                    r.fencing_token != l.fencing_token || r.replica.as_deref() != Some(me)
                })
        });
        let outcome = match plan {
            Plan::Keep => {
                let token = local.map_or(0, |l| l.fencing_token);
                match rows.keep(id, token, me, connection_id, now) {
                    Ok(true) => Settled::Kept { token },
                    // Ran out by the store's clock, or changed meanwhile:
                    // nothing is kept, nothing stopped; the executor's
                    // next register settles it again.
                    Ok(false) => Settled::Lost,
                    Err(e) => {
                        tracing::warn!(session = %id, error = %e, "keeping a resumed session failed");
                        Settled::Lost
                    }
                }
            }
            Plan::TakeOver { previous } => match next_token(id, previous) {
                None => Settled::Lost,
                Some(token) => match rows.take_over(id, previous, token, me, connection_id) {
                    Ok(Some(taken)) => Settled::Taken { token, taken },
                    Ok(None) => Settled::Lost,
                    Err(e) => {
                        tracing::warn!(session = %id, error = %e, "takeover claim failed");
                        Settled::Lost
                    }
                },
            },
            Plan::EndExpired { previous } => match rows.end_expired(id, previous) {
                Ok(true) => Settled::Stop {
                    token: Some(previous),
                },
                Ok(false) => Settled::Lost,
                Err(e) => {
                    tracing::warn!(session = %id, error = %e, "cannot end an expired session");
                    Settled::Lost
                }
            },
            Plan::Stop { token } => Settled::Stop { token },
        };
        // A copy that is not kept is dropped too when it is ours but the
        // row moved on (a lost keep).
        let drop_local = stale
            || (matches!(outcome, Settled::Lost | Settled::Taken { .. })
                && local.is_some_and(|l| !l.ended));
        out.push(SettledSession {
            session_id: id.clone(),
            outcome,
            drop_local,
        });
    }
    Ok(out)
}

/// The rows of one process: the statements of [`SessionRows`] over a map
/// under a lock (what a row lock gives PostgreSQL). The reference store
/// of the property model; a harness without replicas needs none.
#[derive(Debug, Default)]
pub struct MemoryRows {
    rows: Mutex<BTreeMap<String, Row>>,
    /// Replica id → when it was last seen (the model's liveness).
    seen: Mutex<BTreeMap<String, u64>>,
}

impl MemoryRows {
    pub fn new() -> MemoryRows {
        MemoryRows::default()
    }

    /// `replica` is alive at `now` (what its poll writes).
    pub fn seen(&self, replica: &str, now: u64) {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(replica.to_owned(), now);
    }

    fn with<T>(&self, f: impl FnOnce(&mut BTreeMap<String, Row>) -> T) -> T {
        f(&mut self
            .rows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

/// The memory store needs an explicit clock.
#[derive(Debug, thiserror::Error)]
#[error("the memory row store has no clock of its own: pass `now`")]
pub struct NoClock;

impl SessionRows for MemoryRows {
    type Error = NoClock;
    type Taken = ();

    fn clock(&self, now: Option<u64>) -> Result<u64, NoClock> {
        now.ok_or(NoClock)
    }

    fn rows(&self, ids: &[String]) -> Result<BTreeMap<String, Row>, NoClock> {
        let seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        Ok(self.with(|m| {
            ids.iter()
                .filter_map(|id| {
                    m.get(id).map(|r| {
                        let mut r = r.clone();
                        if let Some(at) = r.replica.as_ref().and_then(|x| seen.get(x)) {
                            r.owner_seen_ms = *at;
                        }
                        (id.clone(), r)
                    })
                })
                .collect()
        }))
    }

    fn grant(
        &self,
        session_id: &str,
        executor_id: &str,
        token: u64,
        replica: &str,
        connection_id: &str,
        previous: Option<u64>,
    ) -> Result<bool, NoClock> {
        Ok(self.with(|m| {
            let ok = match m.get(session_id) {
                None => true,
                Some(r) => {
                    (Some(r.fencing_token) == previous && r.fencing_token < token)
                        || (r.fencing_token == token && r.replica.as_deref() == Some(replica))
                }
            };
            if ok {
                m.insert(
                    session_id.to_owned(),
                    Row {
                        executor_id: executor_id.to_owned(),
                        fencing_token: token,
                        replica: Some(replica.to_owned()),
                        ended: false,
                        connection_id: Some(connection_id.to_owned()),
                        lease_expires_at_ms: None,
                        owner_seen_ms: 0,
                    },
                );
            }
            ok
        }))
    }

    fn take_over(
        &self,
        session_id: &str,
        previous: u64,
        token: u64,
        replica: &str,
        connection_id: &str,
    ) -> Result<Option<()>, NoClock> {
        Ok(self.with(|m| match m.get_mut(session_id) {
            Some(r) if r.fencing_token == previous && token > previous && !r.ended => {
                r.fencing_token = token;
                r.replica = Some(replica.to_owned());
                r.connection_id = Some(connection_id.to_owned());
                r.lease_expires_at_ms = None;
                Some(())
            }
            _ => None,
        }))
    }

    fn keep(
        &self,
        session_id: &str,
        token: u64,
        replica: &str,
        connection_id: &str,
        now: Option<u64>,
    ) -> Result<bool, NoClock> {
        let now = now.ok_or(NoClock)?;
        Ok(self.with(|m| match m.get_mut(session_id) {
            Some(r)
                if r.fencing_token == token
                    && r.replica.as_deref() == Some(replica)
                    && !r.ended
                    && r.lease_expires_at_ms.is_none_or(|d| d > now) =>
            {
                r.connection_id = Some(connection_id.to_owned());
                r.lease_expires_at_ms = None;
                true
            }
            _ => false,
        }))
    }

    fn lost(
        &self,
        session_id: &str,
        token: u64,
        replica: &str,
        deadline_ms: u64,
        local_now_ms: u64,
        now: Option<u64>,
    ) -> Result<bool, NoClock> {
        let now = now.ok_or(NoClock)?;
        Ok(self.with(|m| match m.get_mut(session_id) {
            Some(r)
                if r.fencing_token == token
                    && r.replica.as_deref() == Some(replica)
                    && !r.ended =>
            {
                r.lease_expires_at_ms = Some(on_store_clock(deadline_ms, local_now_ms, now));
                true
            }
            _ => false,
        }))
    }

    fn expire(
        &self,
        session_id: &str,
        token: u64,
        replica: &str,
        holder: Option<&str>,
        deadline_ms: u64,
        local_now_ms: u64,
        now: Option<u64>,
    ) -> Result<Expiry, NoClock> {
        let now = now.ok_or(NoClock)?;
        Ok(self.with(|m| {
            let Some(r) = m.get_mut(session_id) else {
                return Expiry::Superseded;
            };
            if r.fencing_token != token || r.replica.as_deref() != Some(replica) || r.ended {
                return Expiry::Superseded;
            }
            let due = r
                .lease_expires_at_ms
                .unwrap_or_else(|| on_store_clock(deadline_ms, local_now_ms, now));
            if r.connection_id.as_deref() == holder && due <= now {
                r.ended = true;
                r.lease_expires_at_ms = None;
                Expiry::Ended
            } else {
                Expiry::NotYet {
                    remaining_ms: due.saturating_sub(now),
                }
            }
        }))
    }

    fn end_expired(&self, session_id: &str, previous: u64) -> Result<bool, NoClock> {
        Ok(self.with(|m| match m.get_mut(session_id) {
            Some(r) if r.fencing_token == previous && !r.ended => {
                r.ended = true;
                r.lease_expires_at_ms = None;
                true
            }
            _ => false,
        }))
    }

    fn holds(&self, session_id: &str, token: u64, replica: &str) -> Result<bool, NoClock> {
        Ok(self.with(|m| {
            m.get(session_id).is_some_and(|r| {
                r.fencing_token == token && r.replica.as_deref() == Some(replica) && !r.ended
            })
        }))
    }
}

/// A deadline on a replica's clock (`deadline_ms`, read at
/// `local_now_ms`) moved onto the store's (`store_now_ms`): what the
/// PostgreSQL statements compute as `$deadline - $local_now + now()`.
pub fn on_store_clock(deadline_ms: u64, local_now_ms: u64, store_now_ms: u64) -> u64 {
    if deadline_ms >= local_now_ms {
        store_now_ms.saturating_add(deadline_ms - local_now_ms)
    } else {
        store_now_ms.saturating_sub(local_now_ms - deadline_ms)
    }
}

/// Expire grant `token` of replica `me` ([`SessionRows::expire`]), or
/// say what to do instead.
///
/// # Errors
///
/// The store fails: the caller looks again later (nothing is ended and
/// nothing stopped on a failure).
#[allow(clippy::too_many_arguments)]
pub fn expire<S: SessionRows + ?Sized>(
    rows: &S,
    session_id: &str,
    token: u64,
    me: &str,
    holder: Option<&str>,
    deadline_ms: u64,
    local_now_ms: u64,
    now: Option<u64>,
) -> Result<Expiry, S::Error> {
    rows.expire(
        session_id,
        token,
        me,
        holder,
        deadline_ms,
        local_now_ms,
        now,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(replica: &str, token: u64) -> Row {
        Row {
            executor_id: "e".into(),
            fencing_token: token,
            replica: Some(replica.into()),
            ended: false,
            connection_id: Some("c".into()),
            lease_expires_at_ms: None,
            owner_seen_ms: 1_000,
        }
    }

    #[test]
    fn a_superseded_copy_is_never_kept() {
        let local = Some(Local {
            fencing_token: 4098,
            ended: false,
        });
        // The row says A took it over at 8194: B does not keep its 4098.
        let r = row("A", 8194);
        assert_eq!(
            plan_resume("B", "e", local, Some(&r), 1_100, 500, 100),
            Plan::TakeOver { previous: 8194 }
        );
        // Its own grant: kept.
        let r = row("B", 4098);
        assert_eq!(
            plan_resume("B", "e", local, Some(&r), 1_100, 500, 100),
            Plan::Keep
        );
        // A copy ended here while the row is alive elsewhere: taken over,
        // never stopped.
        let ended = Some(Local {
            fencing_token: 4098,
            ended: true,
        });
        let r = row("A", 8194);
        assert_eq!(
            plan_resume("B", "e", ended, Some(&r), 1_100, 500, 100),
            Plan::TakeOver { previous: 8194 }
        );
        // No row at all: stopped (nobody granted it).
        assert_eq!(
            plan_resume("B", "e", local, None, 0, 500, 100),
            Plan::Stop { token: None }
        );
    }

    #[test]
    fn a_stale_copy_expires_as_superseded() {
        let m = MemoryRows::new();
        assert!(m.grant("s", "e", 4098, "B", "c1", None).unwrap());
        assert!(m.take_over("s", 4098, 8194, "A", "c2").unwrap().is_some());
        // B's copy runs out on B's clock: the row is A's.
        assert_eq!(
            m.expire("s", 4098, "B", Some("c1"), 10, 10, Some(10))
                .unwrap(),
            Expiry::Superseded
        );
        assert!(!m.holds("s", 4098, "B").unwrap());
        assert!(m.holds("s", 8194, "A").unwrap());
        // A's own expiry waits for the store's clock.
        assert!(m.lost("s", 8194, "A", 500, 100, Some(1_000)).unwrap());
        assert_eq!(
            m.expire("s", 8194, "A", Some("c2"), 500, 100, Some(1_200))
                .unwrap(),
            Expiry::NotYet { remaining_ms: 200 }
        );
        assert_eq!(
            m.expire("s", 8194, "A", Some("c2"), 500, 100, Some(1_400))
                .unwrap(),
            Expiry::Ended
        );
    }
}

//! The harness side: connections, session leases and their clocks.
//!
//! # Model
//!
//! A *connection* is live from `register` until it is disconnected,
//! reported silent by `tick` (close 4008), or replaced by a newer
//! registration of the same executor (close 4004). Closed connections are
//! forgotten: frames from them are ignored and they never hold a lease
//! again.
//!
//! A *lease* ties a session to the connection holding it. While that
//! connection is live the lease is simply held, with no expiry. When it is
//! lost (disconnect or silence) the lease is *orphaned*: it expires at the
//! connection's `last_seen + lease_ttl_ms`, unless the executor registers
//! again before that and lists the session in `resume`, which moves the
//! same grant (same lease token, same fencing token) to the new
//! connection. A fencing token is only ever issued by `assign`, from the
//! [`LeaseStore`], so it changes exactly when a session is granted anew.
//!
//! All outputs that are lists are sorted, so that the harness behaves the
//! same for the same inputs and tests can compare results directly.

use super::{ConnId, LeaseError, LeaseStore};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

/// Outcome of [`LeaseTable::register`], telling the harness which frames to
/// send and which sessions to finish.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Registered {
    /// The executor's previous live connection, now closed: send close 4004
    /// `replaced` on it.
    pub replaced: Option<ConnId>,
    /// Sessions listed in `resume` whose lease moved to the new connection,
    /// with their fencing token unchanged.
    pub kept: Vec<String>,
    /// Sessions listed in `resume` that the executor must not run (not
    /// leased to it, leased elsewhere since, or expired): send
    /// `session.stop {reason: "lease_expired"}` for each.
    pub to_stop: Vec<String>,
    /// Sessions that were leased to this executor and whose lease ended
    /// during this registration, because `resume` did not list them or
    /// their lease had already expired. The harness ends these sessions; they
    /// are not reported again by `tick`.
    pub ended: Vec<String>,
}

/// A fresh grant from [`LeaseTable::assign`], to be sent in `session.assign`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// The session granted.
    pub session_id: String,
    /// The connection the session is leased to.
    pub holder: ConnId,
    /// Opaque lease token, unique per grant.
    pub lease_token: String,
    /// Fencing token of this grant; higher than any earlier grant's for
    /// this session id.
    pub fencing_token: u64,
}

/// What [`LeaseTable::tick`] found due.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Tick {
    /// Connections silent for `lease_ttl_ms`: close them with 4008. The
    /// table already treats them as disconnected.
    pub silent: Vec<ConnId>,
    /// Sessions whose orphaned lease ran out: the harness ends them. Their
    /// leases are gone from the table.
    pub expired: Vec<String>,
}

/// Read-only view of one session's lease, from [`LeaseTable::holder`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseView {
    /// The connection that holds (or, if `expires_at` is set, last held)
    /// the lease.
    pub conn: ConnId,
    /// The executor the session is leased to.
    pub executor_id: String,
    /// The grant's lease token.
    pub lease_token: String,
    /// The grant's fencing token.
    pub fencing_token: u64,
    /// `None` while the holder connection is live. Once the holder is lost,
    /// the time from which the lease counts as expired; the view can show a
    /// past time until `tick` (or a registration of the same executor)
    /// removes the lease, and `check_frame` already refuses it then.
    pub expires_at: Option<u64>,
}

/// A lease to put back with [`LeaseTable::restore`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoredLease {
    pub session_id: String,
    pub executor_id: String,
    /// The holder connection; if it is not among the restored live
    /// connections of `executor_id`, the lease is orphaned.
    pub holder: ConnId,
    pub lease_token: String,
    pub fencing_token: u64,
    /// For an orphaned lease, when it runs out, if known.
    pub expires_at: Option<u64>,
}

#[derive(Debug, Clone)]
struct Conn {
    executor_id: String,
    last_seen: u64,
}

#[derive(Debug, Clone)]
struct Lease {
    executor_id: String,
    holder: ConnId,
    lease_token: String,
    fencing_token: u64,
    /// `None` while `holder` is live; set once when the holder is lost.
    expires_at: Option<u64>,
}

impl Lease {
    /// A lease still counts as held if its holder is live or its clock has
    /// not run out; `now == expires_at` is already too late, matching the
    /// protocol's "register *before* `last_seen + lease_ttl_ms`".
    fn is_current(&self, now: u64) -> bool {
        self.expires_at.is_none_or(|t| now < t)
    }
}

/// The harness's lease bookkeeping, driven by connection events and time.
///
/// Invariants kept by every method (and checked by the model-based tests):
/// at most one live connection per executor; at most one lease per session;
/// a lease whose `expires_at` is `None` is held by a live connection of the
/// lease's executor; fencing tokens come only from the store, so they only
/// grow.
pub struct LeaseTable {
    ttl: u64,
    store: Arc<dyn LeaseStore>,
    /// Live connections only; closed ones are dropped at once so that a
    /// frame from them is indistinguishable from one from an unknown id.
    conns: BTreeMap<ConnId, Conn>,
    /// Executor id → its one live connection; mirrors `conns`.
    live: BTreeMap<String, ConnId>,
    /// Session id → its current lease.
    leases: BTreeMap<String, Lease>,
}

impl fmt::Debug for LeaseTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseTable")
            .field("ttl", &self.ttl)
            .field("conns", &self.conns)
            .field("leases", &self.leases)
            .finish_non_exhaustive()
    }
}

impl LeaseTable {
    /// An empty table. `lease_ttl_ms` is both how long a connection may stay
    /// silent and how long an orphaned lease waits for its executor to come
    /// back; the store issues fencing tokens and may be shared with an
    /// earlier table so tokens keep increasing across harness restarts.
    pub fn new(lease_ttl_ms: u64, store: Arc<dyn LeaseStore>) -> Self {
        Self {
            ttl: lease_ttl_ms,
            store,
            conns: BTreeMap::new(),
            live: BTreeMap::new(),
            leases: BTreeMap::new(),
        }
    }

    /// A table rebuilt from what the harness published, after the actor
    /// that owned the previous one crashed.
    ///
    /// `live` are the registered connections, one per executor (a later
    /// duplicate is ignored); their silence clock restarts at `now`, which
    /// can only delay a 4008 by one TTL, never close a connection early.
    /// Each lease keeps its grant (lease and fencing tokens, which came
    /// from `store` and so stay below anything it issues next). A lease
    /// whose holder is not live is orphaned and runs out at its
    /// `expires_at`, or one TTL from `now` if that was not known. A second
    /// lease for one session is ignored.
    pub fn restore(
        lease_ttl_ms: u64,
        store: Arc<dyn LeaseStore>,
        live: &[(String, ConnId)],
        leases: Vec<RestoredLease>,
        now: u64,
    ) -> Self {
        let mut t = Self::new(lease_ttl_ms, store);
        for (executor_id, conn) in live {
            if t.live.contains_key(executor_id) || t.conns.contains_key(conn) {
                continue;
            }
            t.conns.insert(
                *conn,
                Conn {
                    executor_id: executor_id.clone(),
                    last_seen: now,
                },
            );
            t.live.insert(executor_id.clone(), *conn);
        }
        for l in leases {
            if t.leases.contains_key(&l.session_id) {
                continue;
            }
            let held_live = t.live.get(&l.executor_id) == Some(&l.holder);
            let expires_at = if held_live {
                None
            } else {
                Some(l.expires_at.unwrap_or(now.saturating_add(lease_ttl_ms)))
            };
            t.leases.insert(
                l.session_id,
                Lease {
                    executor_id: l.executor_id,
                    holder: l.holder,
                    lease_token: l.lease_token,
                    fencing_token: l.fencing_token,
                    expires_at,
                },
            );
        }
        t
    }

    /// The TTL this table enforces, to advertise to executors.
    pub fn lease_ttl_ms(&self) -> u64 {
        self.ttl
    }

    /// Binds `conn` to `executor_id` as its one live connection.
    ///
    /// Any older live connection of the executor is closed (`replaced`).
    /// Then every lease of the executor is settled against `resume`: a
    /// listed session whose lease is still current (held by the replaced
    /// connection, or orphaned with time left) moves to `conn` with the same
    /// grant (`kept`); every other lease of the executor ends (`ended`),
    /// because the executor says it no longer runs that session or its lease
    /// ran out. Listed sessions not kept are reported in `to_stop` so the
    /// executor stops them. Leases of other executors are untouched.
    ///
    /// Registering a `conn` that is live for another executor first treats
    /// it as lost for that executor (its leases are orphaned); registering
    /// it again for the same executor re-settles that executor's leases.
    pub fn register(
        &mut self,
        executor_id: &str,
        conn: ConnId,
        resume: &[String],
        now: u64,
    ) -> Registered {
        if self
            .conns
            .get(&conn)
            .is_some_and(|c| c.executor_id != executor_id)
        {
            self.detach(conn);
        }
        // The replaced connection is dropped without orphaning its leases:
        // it was live up to this instant, so its leases are all current and
        // are settled right below.
        let replaced = match self.live.get(executor_id) {
            Some(&old) if old != conn => {
                self.conns.remove(&old);
                Some(old)
            }
            _ => None,
        };

        let listed: BTreeSet<&str> = resume.iter().map(String::as_str).collect();
        let mut kept = Vec::new();
        let mut ended = Vec::new();
        self.leases.retain(|session, lease| {
            if lease.executor_id != executor_id {
                return true;
            }
            if listed.contains(session.as_str()) && lease.is_current(now) {
                lease.holder = conn;
                lease.expires_at = None;
                kept.push(session.clone());
                true
            } else {
                ended.push(session.clone());
                false
            }
        });
        let to_stop = listed
            .into_iter()
            .filter(|s| kept.binary_search_by(|k| k.as_str().cmp(s)).is_err())
            .map(str::to_owned)
            .collect();

        self.conns.insert(
            conn,
            Conn {
                executor_id: executor_id.to_owned(),
                last_seen: now,
            },
        );
        self.live.insert(executor_id.to_owned(), conn);
        Registered {
            replaced,
            kept,
            to_stop,
            ended,
        }
    }

    /// Records that a frame (any frame, heartbeats included) arrived on
    /// `conn`, which keeps the connection and so its leases alive. Frames on
    /// unknown or closed connections are ignored. `last_seen` never moves
    /// backwards, so a caller passing an out-of-order `now` cannot shorten a
    /// deadline already promised.
    pub fn frame(&mut self, conn: ConnId, now: u64) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.last_seen = c.last_seen.max(now);
        }
    }

    /// The socket of `conn` was lost. Its leases become orphaned and expire
    /// at the connection's `last_seen + lease_ttl_ms` (not `now + ttl`: the
    /// executor's own clock counts from its last acknowledged frame, so the
    /// two sides agree). Unknown or closed connections are ignored.
    pub fn disconnect(&mut self, conn: ConnId, now: u64) {
        // The deadline depends on last_seen only; `now` is taken for the
        // uniform call shape of the event methods.
        let _ = now;
        self.detach(conn);
    }

    /// Grants `session_id` to the live connection of `executor_id`, with a
    /// new fencing token from the store.
    ///
    /// Refused with [`LeaseError::NoLiveConnection`] if the executor has no
    /// live connection, and with [`LeaseError::AlreadyLeased`] while another
    /// executor holds the session over a live connection. A lease orphaned
    /// by another executor may be taken over (failover is the harness's
    /// call); the higher fencing token is what fences the old holder out.
    /// Re-assigning to the same executor issues a new grant.
    pub fn assign(
        &mut self,
        session_id: &str,
        executor_id: &str,
        now: u64,
    ) -> Result<Grant, LeaseError> {
        // A grant does not depend on time: the holder is live, so the lease
        // has no expiry until the holder is lost.
        let _ = now;
        let holder = *self
            .live
            .get(executor_id)
            .ok_or(LeaseError::NoLiveConnection)?;
        let held_live_elsewhere = self
            .leases
            .get(session_id)
            .filter(|l| l.expires_at.is_none() && l.executor_id != executor_id);
        if let Some(lease) = held_live_elsewhere {
            return Err(LeaseError::AlreadyLeased {
                holder: lease.executor_id.clone(),
            });
        }
        let fencing_token = self
            .store
            .next_fencing_token(session_id)
            .ok_or(LeaseError::StoreUnavailable)?;
        let lease_token = lease_token_of(session_id, fencing_token);
        self.leases.insert(
            session_id.to_owned(),
            Lease {
                executor_id: executor_id.to_owned(),
                holder,
                lease_token: lease_token.clone(),
                fencing_token,
                expires_at: None,
            },
        );
        Ok(Grant {
            session_id: session_id.to_owned(),
            holder,
            lease_token,
            fencing_token,
        })
    }

    /// Takes over a grant another harness made (over a database shared by
    /// several replicas; docs/store.md, "Takeover"): the session gets a
    /// lease for `executor_id` under `fencing_token` (issued by the caller
    /// from the store, above the old grant's), orphaned until the
    /// executor's resumed [`register`](Self::register), which keeps it
    /// because `resume` lists it. It runs out one TTL from `now` like any
    /// orphaned lease, should that register not come.
    ///
    /// Refused with [`LeaseError::AlreadyLeased`] when this table already
    /// holds a lease of the session at or above `fencing_token` (its own
    /// grant is newer, or the same), so a token never goes backwards.
    pub fn adopt(
        &mut self,
        session_id: &str,
        executor_id: &str,
        fencing_token: u64,
        now: u64,
    ) -> Result<Grant, LeaseError> {
        self.adopt_until(
            session_id,
            executor_id,
            fencing_token,
            now.saturating_add(self.ttl),
        )
    }

    /// [`adopt`](Self::adopt), running out at `expires_at` instead of one
    /// TTL from now: a lease this table reported expired but the store says
    /// has time left by its clock (docs/store.md, "Expiry by the
    /// database's clock") is put back until then.
    pub fn adopt_until(
        &mut self,
        session_id: &str,
        executor_id: &str,
        fencing_token: u64,
        expires_at: u64,
    ) -> Result<Grant, LeaseError> {
        if let Some(l) = self.leases.get(session_id) {
            if l.fencing_token >= fencing_token {
                return Err(LeaseError::AlreadyLeased {
                    holder: l.executor_id.clone(),
                });
            }
        }
        let lease_token = lease_token_of(session_id, fencing_token);
        // ConnId(0) is never minted: the holder is not connected yet.
        let holder = ConnId(0);
        self.leases.insert(
            session_id.to_owned(),
            Lease {
                executor_id: executor_id.to_owned(),
                holder,
                lease_token: lease_token.clone(),
                fencing_token,
                expires_at: Some(expires_at),
            },
        );
        Ok(Grant {
            session_id: session_id.to_owned(),
            holder,
            lease_token,
            fencing_token,
        })
    }

    /// This table's lease of `session_id` is stale (the store names a newer
    /// grant): removed if its grant is `fencing_token` or older, without
    /// ending anything. Returns whether it was.
    pub fn supersede(&mut self, session_id: &str, fencing_token: u64) -> bool {
        if self
            .leases
            .get(session_id)
            .is_some_and(|l| l.fencing_token <= fencing_token)
        {
            self.leases.remove(session_id);
            return true;
        }
        false
    }

    /// The session ended or was stopped: its lease is removed. The fencing
    /// counter stays in the store, so a later session with the same id gets
    /// a higher token.
    pub fn end(&mut self, session_id: &str) {
        self.leases.remove(session_id);
    }

    /// Whether a session-scoped frame for `session_id` arriving on `conn`
    /// may be accepted: only from the live connection holding the session's
    /// lease.
    ///
    /// Errors, in order of precedence: [`LeaseError::UnknownSession`] (no
    /// lease), [`LeaseError::Expired`] (orphaned and out of time, for any
    /// connection), [`LeaseError::NotHolder`] (another connection, or the
    /// lost holder of an orphaned lease: until the executor resumes, nobody
    /// may speak for the session).
    pub fn check_frame(&self, conn: ConnId, session_id: &str, now: u64) -> Result<(), LeaseError> {
        let lease = self
            .leases
            .get(session_id)
            .ok_or(LeaseError::UnknownSession)?;
        if !lease.is_current(now) {
            return Err(LeaseError::Expired);
        }
        if lease.holder != conn || lease.expires_at.is_some() {
            return Err(LeaseError::NotHolder);
        }
        Ok(())
    }

    /// Reaps what is due at `now`: live connections silent for
    /// `lease_ttl_ms` (reported so the harness closes them with 4008) and
    /// orphaned leases whose clock ran out (removed and reported). A silent
    /// connection's leases expire in the same tick, since their clock counts
    /// from the same `last_seen`.
    pub fn tick(&mut self, now: u64) -> Tick {
        let silent: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| now >= c.last_seen.saturating_add(self.ttl))
            .map(|(&id, _)| id)
            .collect();
        for &conn in &silent {
            self.detach(conn);
        }
        let mut expired = Vec::new();
        self.leases.retain(|session, lease| {
            if lease.is_current(now) {
                true
            } else {
                expired.push(session.clone());
                false
            }
        });
        Tick { silent, expired }
    }

    /// The earliest `now` at which [`tick`](Self::tick) would report
    /// something, for the actor's timer; `None` when nothing is pending.
    ///
    /// Once it is `Some(d)`, no event makes it earlier than `d`: a frame
    /// moves a connection's `last_seen` later; a new connection's deadline
    /// is `now + ttl`, no earlier than any existing one (every `last_seen`
    /// is at most `now`); a lost connection's leases run out at its own
    /// silence deadline; a resume or a tick only removes deadlines. So an
    /// actor that armed its timer at this value need not recompute it (a
    /// walk over every connection and lease) until the timer fires or
    /// nothing is armed (`tests/misc/lease_model.rs` checks the rule).
    pub fn next_deadline(&self) -> Option<u64> {
        let silence = self
            .conns
            .values()
            .map(|c| c.last_seen.saturating_add(self.ttl));
        let orphans = self.leases.values().filter_map(|l| l.expires_at);
        silence.chain(orphans).min()
    }

    /// The session's lease, if one exists (see [`LeaseView::expires_at`]).
    pub fn holder(&self, session_id: &str) -> Option<LeaseView> {
        self.leases.get(session_id).map(|l| LeaseView {
            conn: l.holder,
            executor_id: l.executor_id.clone(),
            lease_token: l.lease_token.clone(),
            fencing_token: l.fencing_token,
            expires_at: l.expires_at,
        })
    }

    /// The executor's live connection, if it has one.
    pub fn live_connection(&self, executor_id: &str) -> Option<ConnId> {
        self.live.get(executor_id).copied()
    }

    /// The executor a live connection belongs to; `None` for unknown or
    /// closed connections. Lets the harness map a socket to its principal.
    pub fn executor_of(&self, conn: ConnId) -> Option<&str> {
        self.conns.get(&conn).map(|c| c.executor_id.as_str())
    }

    /// Sessions whose lease names `conn` as holder, sorted. For a lost
    /// connection these are its orphaned leases, still waiting for a resume.
    pub fn sessions_of(&self, conn: ConnId) -> Vec<String> {
        self.leases
            .iter()
            .filter(|(_, l)| l.holder == conn)
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// Closes a live connection and starts the clock of its leases; returns
    /// whether it was live.
    fn detach(&mut self, conn: ConnId) -> bool {
        let Some(c) = self.conns.remove(&conn) else {
            return false;
        };
        if self.live.get(&c.executor_id) == Some(&conn) {
            self.live.remove(&c.executor_id);
        }
        let expires_at = c.last_seen.saturating_add(self.ttl);
        for lease in self.leases.values_mut() {
            if lease.holder == conn && lease.expires_at.is_none() {
                lease.expires_at = Some(expires_at);
            }
        }
        true
    }
}

/// The lease token of a grant: named after the session and its fencing
/// token, so a grant and a takeover mint it the same way.
fn lease_token_of(session_id: &str, fencing_token: u64) -> String {
    format!("lease-{session_id}-{fencing_token}")
}

#[cfg(test)]
mod tests {
    use super::super::MemoryLeaseStore;
    use super::*;

    const TTL: u64 = 1_000;

    fn table() -> LeaseTable {
        LeaseTable::new(TTL, Arc::new(MemoryLeaseStore::new()))
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn an_adopted_grant_is_kept_by_the_resume_that_lists_it() {
        let mut t = table();
        let g = t.adopt("s", "e", 40, 0).unwrap();
        assert_eq!(g.fencing_token, 40);
        // Orphaned until the executor registers, like any lost holder.
        assert_eq!(t.holder("s").unwrap().expires_at, Some(TTL));
        assert_eq!(t.check_frame(ConnId(1), "s", 0), Err(LeaseError::NotHolder));
        let r = t.register("e", ConnId(1), &names(&["s"]), 10);
        assert_eq!(r.kept, names(&["s"]));
        assert!(r.to_stop.is_empty() && r.ended.is_empty());
        let h = t.holder("s").unwrap();
        assert_eq!(
            (h.conn, h.fencing_token, h.expires_at),
            (ConnId(1), 40, None)
        );
        assert_eq!(t.check_frame(ConnId(1), "s", 10), Ok(()));
        // Never back to an older or the same grant.
        assert!(t.adopt("s", "e", 40, 10).is_err());
        assert!(t.adopt("s", "e", 39, 10).is_err());
        // Not resumed in time: it runs out like any orphaned lease.
        let mut t = table();
        t.adopt("s", "e", 7, 0).unwrap();
        assert_eq!(t.tick(TTL).expired, names(&["s"]));
    }

    #[test]
    fn assign_grants_to_the_live_connection() {
        let mut t = table();
        let r = t.register("e", ConnId(1), &[], 0);
        assert_eq!(r, Registered::default());
        let g = t.assign("s", "e", 5);
        assert_eq!(
            g,
            Ok(Grant {
                session_id: "s".into(),
                holder: ConnId(1),
                lease_token: "lease-s-1".into(),
                fencing_token: 1,
            })
        );
        assert_eq!(t.check_frame(ConnId(1), "s", 5), Ok(()));
        assert_eq!(t.check_frame(ConnId(2), "s", 5), Err(LeaseError::NotHolder));
        assert_eq!(
            t.check_frame(ConnId(1), "x", 5),
            Err(LeaseError::UnknownSession)
        );
        assert_eq!(t.sessions_of(ConnId(1)), names(&["s"]));
        assert_eq!(t.executor_of(ConnId(1)), Some("e"));
    }

    #[test]
    fn assign_needs_a_live_connection_and_respects_live_holders() {
        let mut t = table();
        assert_eq!(t.assign("s", "e", 0), Err(LeaseError::NoLiveConnection));
        t.register("a", ConnId(1), &[], 0);
        t.register("b", ConnId(2), &[], 0);
        let first = t.assign("s", "a", 0).map(|g| g.fencing_token);
        assert_eq!(first, Ok(1));
        assert_eq!(
            t.assign("s", "b", 0),
            Err(LeaseError::AlreadyLeased { holder: "a".into() })
        );
        // Re-assigning to the same executor is a new grant.
        let again = t.assign("s", "a", 1).map(|g| g.fencing_token);
        assert_eq!(again, Ok(2));
    }

    #[test]
    fn orphaned_lease_can_fail_over_with_a_higher_token() {
        let mut t = table();
        t.register("a", ConnId(1), &[], 0);
        t.register("b", ConnId(2), &[], 0);
        let _ = t.assign("s", "a", 0);
        t.disconnect(ConnId(1), 10);
        let g = t.assign("s", "b", 20).map(|g| (g.holder, g.fencing_token));
        assert_eq!(g, Ok((ConnId(2), 2)));
        // The old executor coming back may not keep it.
        let r = t.register("a", ConnId(3), &names(&["s"]), 30);
        assert_eq!(r.kept, Vec::<String>::new());
        assert_eq!(r.to_stop, names(&["s"]));
        assert_eq!(r.ended, Vec::<String>::new());
        assert_eq!(t.check_frame(ConnId(2), "s", 30), Ok(()));
    }

    #[test]
    fn resume_before_expiry_keeps_the_same_grant() {
        let mut t = table();
        t.register("e", ConnId(1), &[], 0);
        let _ = t.assign("s", "e", 0);
        let _ = t.assign("t", "e", 0);
        t.frame(ConnId(1), 100);
        t.disconnect(ConnId(1), 400);
        let view = t.holder("s");
        assert_eq!(view.as_ref().and_then(|v| v.expires_at), Some(100 + TTL));
        assert_eq!(
            t.check_frame(ConnId(1), "s", 400),
            Err(LeaseError::NotHolder)
        );
        assert_eq!(t.next_deadline(), Some(100 + TTL));
        // Resume at the last moment: listed "s" kept, unlisted "t" ended,
        // unknown "u" stopped.
        let r = t.register("e", ConnId(2), &names(&["u", "s", "s"]), 100 + TTL - 1);
        assert_eq!(
            r,
            Registered {
                replaced: None,
                kept: names(&["s"]),
                to_stop: names(&["u"]),
                ended: names(&["t"]),
            }
        );
        let view = t.holder("s");
        assert_eq!(
            view,
            Some(LeaseView {
                conn: ConnId(2),
                executor_id: "e".into(),
                lease_token: "lease-s-1".into(),
                fencing_token: 1,
                expires_at: None,
            })
        );
        assert_eq!(t.check_frame(ConnId(2), "s", 5_000), Ok(()));
    }

    #[test]
    fn resume_at_expiry_is_too_late() {
        let mut t = table();
        t.register("e", ConnId(1), &[], 0);
        let _ = t.assign("s", "e", 0);
        t.disconnect(ConnId(1), 0);
        assert_eq!(t.check_frame(ConnId(1), "s", TTL), Err(LeaseError::Expired));
        let r = t.register("e", ConnId(2), &names(&["s"]), TTL);
        assert_eq!(r.kept, Vec::<String>::new());
        assert_eq!(r.to_stop, names(&["s"]));
        assert_eq!(r.ended, names(&["s"]));
        assert_eq!(t.holder("s"), None);
        // Already settled by the registration, so tick does not repeat it.
        assert_eq!(t.tick(TTL).expired, Vec::<String>::new());
    }

    #[test]
    fn replacement_closes_the_old_connection_and_moves_listed_leases() {
        let mut t = table();
        t.register("e", ConnId(1), &[], 0);
        let _ = t.assign("s", "e", 0);
        let _ = t.assign("t", "e", 0);
        // Even a connection overdue for 4008 is live until tick says so.
        let r = t.register("e", ConnId(2), &names(&["s"]), 5 * TTL);
        assert_eq!(r.replaced, Some(ConnId(1)));
        assert_eq!(r.kept, names(&["s"]));
        assert_eq!(r.ended, names(&["t"]));
        assert_eq!(t.live_connection("e"), Some(ConnId(2)));
        assert_eq!(t.executor_of(ConnId(1)), None);
        assert_eq!(
            t.check_frame(ConnId(1), "s", 5 * TTL),
            Err(LeaseError::NotHolder)
        );
        assert_eq!(t.check_frame(ConnId(2), "s", 5 * TTL), Ok(()));
        // Frames from the replaced socket no longer count.
        t.frame(ConnId(1), 6 * TTL);
        assert_eq!(t.next_deadline(), Some(6 * TTL));
    }

    #[test]
    fn silence_closes_the_connection_and_expires_its_leases_together() {
        let mut t = table();
        t.register("e", ConnId(1), &[], 0);
        let _ = t.assign("s", "e", 0);
        t.frame(ConnId(1), 300);
        assert_eq!(t.next_deadline(), Some(300 + TTL));
        assert_eq!(t.tick(300 + TTL - 1), Tick::default());
        assert_eq!(
            t.tick(300 + TTL),
            Tick {
                silent: vec![ConnId(1)],
                expired: names(&["s"]),
            }
        );
        assert_eq!(t.live_connection("e"), None);
        assert_eq!(t.next_deadline(), None);
        assert_eq!(
            t.check_frame(ConnId(1), "s", 300 + TTL),
            Err(LeaseError::UnknownSession)
        );
    }

    #[test]
    fn orphaned_lease_expires_at_tick() {
        let mut t = table();
        t.register("e", ConnId(1), &[], 0);
        let _ = t.assign("s", "e", 0);
        t.disconnect(ConnId(1), 200);
        assert_eq!(t.tick(TTL - 1), Tick::default());
        assert_eq!(t.tick(TTL).expired, names(&["s"]));
        assert_eq!(t.holder("s"), None);
    }

    #[test]
    fn fencing_tokens_survive_end_and_table_rebuild() {
        let store: Arc<dyn LeaseStore> = Arc::new(MemoryLeaseStore::new());
        let mut t = LeaseTable::new(TTL, Arc::clone(&store));
        t.register("e", ConnId(1), &[], 0);
        let first = t.assign("s", "e", 0).map(|g| g.fencing_token);
        t.end("s");
        assert_eq!(t.holder("s"), None);
        let second = t.assign("s", "e", 0).map(|g| g.fencing_token);
        assert_eq!((first, second), (Ok(1), Ok(2)));

        let mut rebuilt = LeaseTable::new(TTL, Arc::clone(&store));
        rebuilt.register("e", ConnId(7), &[], 0);
        let third = rebuilt.assign("s", "e", 0);
        assert_eq!(third.as_ref().map(|g| g.fencing_token), Ok(3));
        assert_eq!(third.map(|g| g.lease_token), Ok("lease-s-3".to_owned()));
        assert_eq!(store.current("s"), Some(3));
    }

    #[test]
    fn restore_keeps_grants_and_orphans_leases_of_lost_holders() {
        let store: Arc<dyn LeaseStore> = Arc::new(MemoryLeaseStore::new());
        let mut t = LeaseTable::new(TTL, Arc::clone(&store));
        t.register("e", ConnId(1), &[], 0);
        let held = t.assign("held", "e", 0).unwrap();
        let lease = |s: &str, holder: u64, token: u64, at: Option<u64>| RestoredLease {
            session_id: s.into(),
            executor_id: "e".into(),
            holder: ConnId(holder),
            lease_token: format!("lease-{s}-{token}"),
            fencing_token: token,
            expires_at: at,
        };
        let live = vec![("e".to_owned(), ConnId(1)), ("e".to_owned(), ConnId(2))];
        let leases = vec![
            lease("held", 1, held.fencing_token, None),
            lease("held", 9, 99, None),
            lease("away", 0, 4, Some(700)),
            lease("lost", 0, 5, None),
        ];
        let mut r = LeaseTable::restore(TTL, Arc::clone(&store), &live, leases, 500);
        // One live connection per executor: the later duplicate is ignored,
        // and the silence clock restarts at `now`.
        assert_eq!(r.live_connection("e"), Some(ConnId(1)));
        assert_eq!(r.executor_of(ConnId(2)), None);
        assert_eq!(r.check_frame(ConnId(1), "held", 600), Ok(()));
        assert_eq!(r.holder("held").map(|v| v.fencing_token), Some(1));
        assert_eq!(r.holder("away").and_then(|v| v.expires_at), Some(700));
        assert_eq!(r.holder("lost").and_then(|v| v.expires_at), Some(500 + TTL));
        assert_eq!(r.next_deadline(), Some(700));
        // The executor resumes one; the other runs out.
        let reg = r.register("e", ConnId(3), &names(&["away"]), 650);
        assert_eq!(reg.kept, names(&["away"]));
        assert_eq!(reg.ended, names(&["held", "lost"]));
        // Tokens continue from the store.
        assert_eq!(r.assign("held", "e", 700).map(|g| g.fencing_token), Ok(2));
    }

    #[test]
    fn reusing_a_connection_id_for_another_executor_orphans_the_first() {
        let mut t = table();
        t.register("a", ConnId(1), &[], 0);
        let _ = t.assign("s", "a", 0);
        let r = t.register("b", ConnId(1), &names(&["s"]), 10);
        assert_eq!(r.to_stop, names(&["s"]));
        assert_eq!(t.live_connection("a"), None);
        assert_eq!(t.live_connection("b"), Some(ConnId(1)));
        // The orphaned lease still names conn 1, but conn 1 now speaks for b.
        assert_eq!(
            t.check_frame(ConnId(1), "s", 10),
            Err(LeaseError::NotHolder)
        );
        assert_eq!(t.holder("s").and_then(|v| v.expires_at), Some(TTL));
    }

    #[test]
    fn registering_the_same_connection_again_resettles_leases() {
        let mut t = table();
        t.register("e", ConnId(1), &[], 0);
        let _ = t.assign("s", "e", 0);
        let _ = t.assign("t", "e", 0);
        let r = t.register("e", ConnId(1), &names(&["t"]), 10);
        assert_eq!(
            r,
            Registered {
                replaced: None,
                kept: names(&["t"]),
                to_stop: vec![],
                ended: names(&["s"]),
            }
        );
    }

    #[test]
    fn frames_never_move_last_seen_backwards() {
        let mut t = table();
        t.register("e", ConnId(1), &[], 500);
        t.frame(ConnId(1), 100);
        assert_eq!(t.next_deadline(), Some(500 + TTL));
        t.frame(ConnId(9), 10_000);
        assert_eq!(t.next_deadline(), Some(500 + TTL));
    }

    #[test]
    fn extreme_times_saturate_instead_of_overflowing() {
        let mut t = LeaseTable::new(u64::MAX, Arc::new(MemoryLeaseStore::new()));
        t.register("e", ConnId(1), &[], u64::MAX - 1);
        let _ = t.assign("s", "e", u64::MAX - 1);
        assert_eq!(t.next_deadline(), Some(u64::MAX));
        t.disconnect(ConnId(1), u64::MAX - 1);
        assert_eq!(
            t.check_frame(ConnId(1), "s", u64::MAX - 1),
            Err(LeaseError::NotHolder)
        );
        assert_eq!(t.tick(u64::MAX).expired, names(&["s"]));
    }

    #[test]
    fn zero_ttl_reaps_at_once() {
        let mut t = LeaseTable::new(0, Arc::new(MemoryLeaseStore::new()));
        t.register("e", ConnId(1), &[], 5);
        let _ = t.assign("s", "e", 5);
        assert_eq!(t.next_deadline(), Some(5));
        let tick = t.tick(5);
        assert_eq!(tick.silent, vec![ConnId(1)]);
        assert_eq!(tick.expired, names(&["s"]));
    }
}

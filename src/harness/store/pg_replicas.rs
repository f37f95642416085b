//! Several live harness replicas over one PostgreSQL database
//! (docs/store.md, "Several replicas"): the database calls of the
//! cross-replica rules. What to do with their answers (close a connection
//! with 4004, refuse a grant with 409) is the harness's
//! ([`crate::harness::replica`]); nothing here knows about sockets.
//!
//! * **The 4004 rule.** Registering an executor's connection bumps that
//!   executor's row of `connections` and notifies every replica
//!   (`pg_notify('bmx_connections', '<generation> <executor id>')`) in the
//!   same transaction, so the notification goes out exactly when the new
//!   generation is visible. Each replica `LISTEN`s on a connection of its
//!   own ([`PgReplicas::watch`]) and, because a notification can be lost
//!   (the listening connection breaks and is reopened), also reads the
//!   generations of its own executors every poll interval: a superseded
//!   connection is seen at the latest one poll interval (plus a query)
//!   after the newer one registered.
//! * **Session grants.** A grant becomes a session's row only through
//!   [`PgReplicas::claim_session`], a single conditional statement: the
//!   database, not any replica's memory, decides which of two racing
//!   grants of one session wins, and a grant's fencing token only ever
//!   grows per session.
//! * **Liveness.** Each replica upserts its row of `replicas` (`seen_at =
//!   now()`, the database clock) every poll interval.
//! * **Ended connections.** A connection of this replica that ends
//!   blanks its `connection_id` in its row of `connections`
//!   ([`PgReplicas::connection_ended`]), if the row is still that
//!   connection's; the generation stays, so the 4004 numbering goes on.
//!   A row with a blank connection is no executor's live connection: not
//!   listed ([`PgReplicas::executors_elsewhere`]) and not forwarded to.
//! * **The sweep.** On the same poll, each replica ends the sessions of
//!   dead replicas whose lease ran out by the database's clock and whose
//!   executor never resumed them anywhere ([`sweep_orphans`]), a bounded
//!   number per poll, each with one conditional `UPDATE` (the database
//!   decides a race with a takeover or another replica's sweep).

use super::durable::{state_name, StoredResult, StoredSession};
use super::postgres::PgStore;
use super::{big, StoreError};
use crate::harness::replica::TakeoverRow;
use postgres::fallible_iterator::FallibleIterator;
use postgres::types::Type;
use postgres::{Client, GenericClient, Row};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The channel every replica listens on.
const CHANNEL: &str = "bmx_connections";

/// How long the listener blocks at most before looking at its stop flag.
const STOP_CHECK: Duration = Duration::from_millis(200);

/// Pause before reopening a broken listening connection.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// Sessions the sweep ends per poll at most: a dead replica's many
/// sessions end over several polls, each poll one short query and at
/// most this many one-row updates.
const SWEEP_LIMIT: i64 = 64;

/// `connections.connection_id` of an executor whose newest connection
/// ended: the column is `NOT NULL` (migration 3), and the row must stay
/// for its generation.
const ENDED: &str = "";

/// Executors listed from other replicas at most (`GET /v1/executors`):
/// bounded like every read, far above any fleet one database serves.
pub const EXECUTORS_MAX: usize = 100_000;

/// An executor connected to another live replica, as the database knows
/// it (`GET /v1/executors`): which connection, where, since when, and the
/// sessions its current grants name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutorRow {
    pub executor_id: String,
    pub connection_id: String,
    pub replica: String,
    /// When the connection registered (unix ms, the database's clock).
    pub connected_at_ms: u64,
    /// Not-ended sessions granted on this connection, by id.
    pub active_sessions: Vec<String>,
}

/// An executor's connection generation, as the database numbered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    pub executor_id: String,
    pub generation: i64,
}

/// The replica side of a PostgreSQL store. Calls block: async callers use
/// `spawn_blocking`.
pub struct PgReplicas {
    store: Arc<PgStore>,
    id: String,
    stop: Arc<AtomicBool>,
    listener: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for PgReplicas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgReplicas").field("id", &self.id).finish()
    }
}

/// A random replica id (12 hex digits), for a process not given one.
pub fn random_replica_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

impl PgReplicas {
    /// Make `store` the store of replica `id`: from now on its writer only
    /// updates session rows of grants this replica claimed.
    pub fn new(store: Arc<PgStore>, id: impl Into<String>) -> PgReplicas {
        let id = id.into();
        store.set_replica(&id);
        PgReplicas {
            store,
            id,
            stop: Arc::new(AtomicBool::new(false)),
            listener: Mutex::new(None),
        }
    }

    /// This replica's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Record `connection_id` (on this replica) as the newest connection
    /// of `executor_id` and tell every replica; returns its generation,
    /// larger than that of every earlier connection of the executor on
    /// any replica.
    ///
    /// # Errors
    ///
    /// The database fails.
    pub fn claim_connection(
        &self,
        executor_id: &str,
        connection_id: &str,
    ) -> Result<i64, StoreError> {
        self.store.with(|c| {
            let mut tx = c.transaction()?;
            let generation: i64 = tx
                .query_one(
                    "INSERT INTO connections (executor_id, replica, connection_id, generation) \
                     VALUES ($1, $2, $3, 1) \
                     ON CONFLICT (executor_id) DO UPDATE SET \
                     generation = connections.generation + 1, replica = excluded.replica, \
                     connection_id = excluded.connection_id, written_at = now() \
                     RETURNING generation",
                    &[&executor_id, &self.id, &connection_id],
                )?
                .get(0);
            // Delivered at commit, when the generation is visible.
            tx.execute(
                "SELECT pg_notify($1, $2)",
                &[&CHANNEL, &format!("{generation} {executor_id}")],
            )?;
            tx.commit()?;
            Ok(generation)
        })
    }

    /// Make `session` (a fresh grant of this replica) the session's row,
    /// if the row is still the grant this replica knew (`previous`: its
    /// fencing token, `None` when it knew no row) and the new token is
    /// larger. `Ok(false)`: another replica's grant won; this one must not
    /// reach an executor.
    ///
    /// # Errors
    ///
    /// The database fails.
    pub fn claim_session(
        &self,
        session: &StoredSession,
        previous: Option<u64>,
    ) -> Result<bool, StoreError> {
        let i = &session.info;
        let token = big(i.fencing_token)?;
        let previous = previous.map(big).transpose()?;
        let info = serde_json::to_string(i)?;
        let expires = session.lease_expires_at_ms.map(big).transpose()?;
        // The row keeps the deadline on the database's clock
        // (`super::postgres`).
        let local_now = big(crate::harness::runtime::unix_ms())?;
        let state = state_name(i.state);
        let won = self.store.with(|c| {
            // One statement: a row lock orders racing claims, and each
            // sees the row the one before left. The same grant claimed
            // again (a retry) is a success too.
            let row = c.query_opt(
                "INSERT INTO sessions (session_id, executor_id, fencing_token, state, \
                 connection_id, lease_expires_at_ms, ended_reason, info, replica) \
                 VALUES ($1, $2, $3, $4, $5, \
                 $6::BIGINT - $11::BIGINT + (extract(epoch FROM now()) * 1000)::BIGINT, \
                 $7, $8, $9) \
                 ON CONFLICT (session_id) DO UPDATE SET executor_id = excluded.executor_id, \
                 fencing_token = excluded.fencing_token, state = excluded.state, \
                 connection_id = excluded.connection_id, \
                 lease_expires_at_ms = excluded.lease_expires_at_ms, \
                 ended_reason = excluded.ended_reason, info = excluded.info, \
                 replica = excluded.replica, written_at = now() \
                 WHERE (sessions.fencing_token = $10 \
                        AND sessions.fencing_token < excluded.fencing_token) \
                    OR (sessions.fencing_token = excluded.fencing_token \
                        AND sessions.replica = excluded.replica) \
                 RETURNING fencing_token",
                &[
                    &i.session_id,
                    &i.executor_id,
                    &token,
                    &state,
                    &i.connection_id,
                    &expires,
                    &i.ended_reason,
                    &info,
                    &self.id,
                    &previous,
                    &local_now,
                ],
            )?;
            Ok(row.is_some())
        })?;
        Ok(won)
    }

    /// The rows of `session_ids` (sessions an executor resumes that this
    /// replica does not hold), with what [`crate::harness::replica::
    /// judge_takeover`] needs, and the database's `now()` in unix ms: the
    /// one clock the takeover rule reads.
    ///
    /// # Errors
    ///
    /// The database fails or a row does not decode.
    pub fn takeover_rows(
        &self,
        session_ids: &[String],
    ) -> Result<(u64, Vec<(StoredSession, TakeoverRow)>), StoreError> {
        let (now, rows) = self.store.with(|c| {
            let now: i64 = c
                .query_one("SELECT (extract(epoch FROM now()) * 1000)::BIGINT", &[])?
                .get(0);
            let rows = c.query(
                "SELECT s.info, s.lease_expires_at_ms, s.executor_id, s.state, \
                 (extract(epoch FROM COALESCE(r.seen_at, s.written_at)) * 1000)::BIGINT \
                 FROM sessions s LEFT JOIN replicas r ON r.id = s.replica \
                 WHERE s.session_id = ANY($1)",
                &[&session_ids],
            )?;
            Ok((now, rows))
        })?;
        let out = rows
            .iter()
            .map(takeover_row)
            .collect::<Result<Vec<_>, _>>()?;
        Ok((super::postgres::ms(now)?, out))
    }

    /// Take over the grant `previous` of a session another replica made:
    /// `session` (a new grant of this replica, with a larger fencing
    /// token) becomes the row if the row is still that grant and not
    /// over; the tool results delivered under the old grant move to the
    /// new one (they stay duplicates for the exactly-once rule) and are
    /// returned, oldest first. `None`: the row changed meanwhile (another
    /// replica took it, or it ended); nothing was written.
    ///
    /// # Errors
    ///
    /// The database fails.
    pub fn take_over(
        &self,
        session: &StoredSession,
        previous: u64,
    ) -> Result<Option<Vec<StoredResult>>, StoreError> {
        let i = &session.info;
        let token = big(i.fencing_token)?;
        let previous = big(previous)?;
        let info = serde_json::to_string(i)?;
        let state = state_name(i.state);
        let rows = self.store.with(|c| {
            let mut tx = c.transaction()?;
            // One conditional statement decides: the row lock orders two
            // replicas taking the same grant over, and the second finds
            // the token changed.
            let won = tx.query_opt(
                "UPDATE sessions SET fencing_token = $3, state = $4, connection_id = $5, \
                 lease_expires_at_ms = NULL, ended_reason = NULL, info = $6, replica = $7, \
                 written_at = now() \
                 WHERE session_id = $1 AND fencing_token = $2 AND $3 > $2 AND state <> 'ended' \
                 RETURNING fencing_token",
                &[
                    &i.session_id,
                    &previous,
                    &token,
                    &state,
                    &i.connection_id,
                    &info,
                    &self.id,
                ],
            )?;
            if won.is_none() {
                return Ok(None);
            }
            tx.execute(
                "UPDATE tool_results SET fencing_token = $3 \
                 WHERE session_id = $1 AND fencing_token = $2",
                &[&i.session_id, &previous, &token],
            )?;
            let rows = tx.query(
                "SELECT tool_call_id, result FROM tool_results \
                 WHERE session_id = $1 AND fencing_token = $2 ORDER BY seq",
                &[&i.session_id, &token],
            )?;
            tx.commit()?;
            Ok(Some(rows))
        })?;
        let Some(rows) = rows else {
            return Ok(None);
        };
        rows.iter()
            .map(|r| {
                Ok(StoredResult {
                    session_id: i.session_id.clone(),
                    fencing_token: i.fencing_token,
                    tool_call_id: r.try_get(0)?,
                    result: serde_json::from_str(r.try_get::<_, &str>(1)?)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()
            .map(Some)
    }

    /// End the grant `previous` of a session whose lease ran out while no
    /// replica held it (`session`: its record, ended), if the row is still
    /// that grant. `false`: it changed meanwhile; nothing was written.
    ///
    /// # Errors
    ///
    /// The database fails.
    pub fn end_expired(&self, session: &StoredSession, previous: u64) -> Result<bool, StoreError> {
        self.store
            .with(|c| Ok(end_expired_on(c, session, previous)))?
    }

    /// The replica other than this one that made the current grant of
    /// `session_id`, with its URL, if it was seen within `alive_ms` (by
    /// the database's clock) and the grant's fencing token is above
    /// `above` (0: any). `None`: this replica's, unknown, or dead.
    ///
    /// # Errors
    ///
    /// The database fails.
    pub fn session_owner(
        &self,
        session_id: &str,
        alive_ms: u64,
        above: u64,
    ) -> Result<Option<(String, String)>, StoreError> {
        let alive = big(alive_ms)?;
        let above = big(above)?;
        // Typed: one round trip, not a prepare and an execute (this runs
        // for every API call about a session this replica does not hold).
        let row = self.store.with(|c| {
            c.query_typed_opt(
                "SELECT r.id, r.url FROM sessions s JOIN replicas r ON r.id = s.replica \
                 WHERE s.session_id = $1 AND r.id <> $2 \
                 AND r.seen_at > now() - $3::BIGINT * interval '1 millisecond' \
                 AND s.fencing_token > $4",
                &[
                    (&session_id, Type::TEXT),
                    (&self.id, Type::TEXT),
                    (&alive, Type::INT8),
                    (&above, Type::INT8),
                ],
            )
        })?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    /// The record of `session_id` as the database holds it (whoever
    /// granted it), for a replica asked about a session no live replica
    /// holds: a dead replica's, or one the sweep ended.
    ///
    /// # Errors
    ///
    /// The database fails or the row does not decode.
    pub fn session_info(
        &self,
        session_id: &str,
    ) -> Result<Option<crate::harness::types::SessionInfo>, StoreError> {
        let row = self.store.with(|c| {
            c.query_typed_opt(
                "SELECT info FROM sessions WHERE session_id = $1",
                &[(&session_id, Type::TEXT)],
            )
        })?;
        row.map(|r| Ok(serde_json::from_str(r.try_get::<_, &str>(0)?)?))
            .transpose()
    }

    /// The first `limit` session records with ids above `after` (all when
    /// `None`), in byte order of the id (`COLLATE "C"`, the order Rust
    /// compares strings in, whatever the database's collation), whoever
    /// granted them: a listing over every replica
    /// ([`crate::harness::api::listing::merge_page`]).
    ///
    /// # Errors
    ///
    /// The database fails or a row does not decode.
    pub fn sessions_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<crate::harness::types::SessionInfo>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.store.with(|c| {
            c.query(
                "SELECT info FROM sessions \
                 WHERE $1::TEXT IS NULL OR session_id COLLATE \"C\" > $1 \
                 ORDER BY session_id COLLATE \"C\" LIMIT $2",
                &[&after, &limit],
            )
        })?;
        rows.iter()
            .map(|r| Ok(serde_json::from_str(r.try_get::<_, &str>(0)?)?))
            .collect()
    }

    /// The sessions whose current grant another replica made that was
    /// seen within `alive_ms`: a replica starting up does not load them
    /// (they are that replica's to run, end and forget; calls about them
    /// are forwarded there).
    ///
    /// # Errors
    ///
    /// The database fails.
    pub fn held_elsewhere(&self, alive_ms: u64) -> Result<Vec<String>, StoreError> {
        let alive = big(alive_ms)?;
        let rows = self.store.with(|c| {
            c.query(
                "SELECT s.session_id FROM sessions s JOIN replicas r ON r.id = s.replica \
                 WHERE r.id <> $1 AND r.seen_at > now() - $2::BIGINT * interval '1 millisecond'",
                &[&self.id, &alive],
            )
        })?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// The replica other than this one holding the newest connection of
    /// `executor_id`, with its URL, if it was seen within `alive_ms` and
    /// the connection did not end.
    ///
    /// # Errors
    ///
    /// The database fails.
    pub fn executor_owner(
        &self,
        executor_id: &str,
        alive_ms: u64,
    ) -> Result<Option<(String, String)>, StoreError> {
        self.owner(
            "SELECT r.id, r.url FROM connections c JOIN replicas r ON r.id = c.replica \
             WHERE c.executor_id = $1 AND r.id <> $2 AND c.connection_id <> '' \
             AND r.seen_at > now() - $3::BIGINT * interval '1 millisecond'",
            executor_id,
            alive_ms,
        )
    }

    /// Connection `connection_id` of `executor_id` on this replica ended:
    /// blank it in the executor's row, if the row is still that
    /// connection's (a newer one, here or on another replica, is left
    /// alone). `false`: it was not. The generation stays: the next
    /// connection of the executor is numbered above it.
    ///
    /// # Errors
    ///
    /// The database fails.
    pub fn connection_ended(
        &self,
        executor_id: &str,
        connection_id: &str,
    ) -> Result<bool, StoreError> {
        let n = self.store.with(|c| {
            c.execute(
                "UPDATE connections SET connection_id = $4, written_at = now() \
                 WHERE executor_id = $1 AND replica = $2 AND connection_id = $3",
                &[&executor_id, &self.id, &connection_id, &ENDED],
            )
        })?;
        Ok(n > 0)
    }

    /// The executors whose newest connection is on another replica seen
    /// within `alive_ms` (by the database's clock) and did not end, by id
    /// in byte order, at most `limit`; each with the not-ended sessions
    /// whose current grant names that connection.
    ///
    /// # Errors
    ///
    /// The database fails or a row does not decode.
    pub fn executors_elsewhere(
        &self,
        alive_ms: u64,
        limit: usize,
    ) -> Result<Vec<ExecutorRow>, StoreError> {
        let alive = big(alive_ms)?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.store.with(|c| {
            c.query(
                "SELECT c.executor_id, c.connection_id, c.replica, \
                 (extract(epoch FROM c.written_at) * 1000)::BIGINT, \
                 COALESCE(array_agg(s.session_id ORDER BY s.session_id COLLATE \"C\") \
                          FILTER (WHERE s.session_id IS NOT NULL), '{}') \
                 FROM connections c JOIN replicas r ON r.id = c.replica \
                 LEFT JOIN sessions s ON s.connection_id = c.connection_id \
                      AND s.replica = c.replica AND s.state <> 'ended' \
                 WHERE c.replica <> $1 AND c.connection_id <> '' \
                 AND r.seen_at > now() - $2::BIGINT * interval '1 millisecond' \
                 GROUP BY c.executor_id, c.connection_id, c.replica, c.written_at \
                 ORDER BY c.executor_id COLLATE \"C\" LIMIT $3",
                &[&self.id, &alive, &limit],
            )
        })?;
        rows.iter()
            .map(|r| {
                Ok(ExecutorRow {
                    executor_id: r.try_get(0)?,
                    connection_id: r.try_get(1)?,
                    replica: r.try_get(2)?,
                    connected_at_ms: super::postgres::ms(r.try_get(3)?)?,
                    active_sessions: r.try_get(4)?,
                })
            })
            .collect()
    }

    fn owner(
        &self,
        sql: &str,
        key: &str,
        alive_ms: u64,
    ) -> Result<Option<(String, String)>, StoreError> {
        let alive = big(alive_ms)?;
        let row = self.store.with(|c| {
            c.query_typed_opt(
                sql,
                &[
                    (&key, Type::TEXT),
                    (&self.id, Type::TEXT),
                    (&alive, Type::INT8),
                ],
            )
        })?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    /// Start the listener thread: `on` gets every generation another
    /// connection registration announces, and, every `poll`, the current
    /// generation of each executor `local()` names (what covers a lost
    /// notification). Each `poll` the replica's row of `replicas` is
    /// refreshed with `url`, and the sessions of replicas dead for `ttl`
    /// whose leases ran out are ended ([`sweep_orphans`]). Runs until
    /// [`PgReplicas::stop`].
    ///
    /// # Errors
    ///
    /// The thread cannot be started.
    pub fn watch(
        &self,
        poll: Duration,
        ttl: Duration,
        url: String,
        local: impl Fn() -> Vec<String> + Send + 'static,
        on: impl Fn(Generation) + Send + 'static,
    ) -> Result<(), StoreError> {
        let store = self.store.clone();
        let stop = self.stop.clone();
        let id = self.id.clone();
        let handle = std::thread::Builder::new()
            .name("bmx-replicas".into())
            .spawn(move || {
                let span = tracing::info_span!("replicas", replica = %id);
                let _g = span.enter();
                let every = Every { poll, ttl };
                listen(&store, &stop, &id, &url, every, &local, &on);
            })?;
        *self.listener.lock().unwrap_or_else(PoisonError::into_inner) = Some(handle);
        Ok(())
    }

    /// Tell the listener thread to stop, without waiting for it.
    pub fn signal_stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Stop the listener thread and wait for it (at most one
    /// [`STOP_CHECK`] plus a query in flight).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let handle = self
            .listener
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

/// `sql` with every `$n` replaced by "now" in unix ms: the database's
/// clock, or the explicit `now` of a caller that brings its own (the
/// property model), passed as parameter `$i` (`NULL`: the database's).
fn with_now(sql: &str, i: usize) -> String {
    sql.replace(
        "$n",
        &format!("COALESCE(${i}::BIGINT, (extract(epoch FROM now()) * 1000)::BIGINT)"),
    )
}

fn opt_big(v: Option<u64>) -> Result<Option<i64>, StoreError> {
    v.map(big).transpose()
}

/// The rows of the sessions, decided by the database (issue 54): every
/// statement is conditional on the row being what the replica believes,
/// and time is the database's `now()` unless the caller passes its own.
impl crate::harness::rows::SessionRows for PgReplicas {
    type Error = StoreError;
    /// The new grant's record and the tool results moved to it.
    type Taken = (crate::harness::types::SessionInfo, Vec<StoredResult>);

    fn clock(&self, now: Option<u64>) -> Result<u64, StoreError> {
        let now = opt_big(now)?;
        let v: i64 = self
            .store
            .with(|c| Ok(c.query_one(&with_now("SELECT $n", 1), &[&now])?.get(0)))?;
        super::postgres::ms(v)
    }

    fn rows(
        &self,
        ids: &[String],
    ) -> Result<std::collections::BTreeMap<String, crate::harness::rows::Row>, StoreError> {
        let rows = self.store.with(|c| {
            c.query(
                "SELECT s.session_id, s.executor_id, s.fencing_token, s.replica, s.state, \
                 s.connection_id, s.lease_expires_at_ms, \
                 (extract(epoch FROM COALESCE(r.seen_at, s.written_at)) * 1000)::BIGINT \
                 FROM sessions s LEFT JOIN replicas r ON r.id = s.replica \
                 WHERE s.session_id = ANY($1)",
                &[&ids],
            )
        })?;
        rows.iter()
            .map(|r| {
                let id: String = r.try_get(0)?;
                let row = crate::harness::rows::Row {
                    executor_id: r.try_get(1)?,
                    fencing_token: super::postgres::ms(r.try_get(2)?)?,
                    replica: r.try_get(3)?,
                    ended: r.try_get::<_, &str>(4)? == "ended",
                    connection_id: r.try_get(5)?,
                    lease_expires_at_ms: r
                        .try_get::<_, Option<i64>>(6)?
                        .map(super::postgres::ms)
                        .transpose()?,
                    owner_seen_ms: super::postgres::ms(r.try_get(7)?)?,
                };
                Ok((id, row))
            })
            .collect()
    }

    fn grant(
        &self,
        session_id: &str,
        executor_id: &str,
        token: u64,
        replica: &str,
        connection_id: &str,
        previous: Option<u64>,
    ) -> Result<bool, StoreError> {
        if replica != self.id {
            return Err(StoreError::Unavailable(format!(
                "replica {replica} grants through {}'s store",
                self.id
            )));
        }
        let mut info = crate::harness::types::SessionInfo::new(
            session_id.to_owned(),
            executor_id.to_owned(),
            token,
            format!("lease-{session_id}-{token}"),
            crate::harness::types::SessionState::Active,
            crate::wire::types::now_rfc3339(),
        );
        info.connection_id = Some(connection_id.to_owned());
        self.claim_session(
            &StoredSession {
                info,
                lease_expires_at_ms: None,
            },
            previous,
        )
    }

    fn take_over(
        &self,
        session_id: &str,
        previous: u64,
        token: u64,
        replica: &str,
        connection_id: &str,
    ) -> Result<Option<Self::Taken>, StoreError> {
        let (prev, tok) = (big(previous)?, big(token)?);
        let lease_token = format!("lease-{session_id}-{token}");
        let rows = self.store.with(|c| {
            let mut tx = c.transaction()?;
            // One conditional statement decides: the row lock orders two
            // replicas taking the same grant over, and the second finds
            // the token changed. The record (`info`) follows the columns.
            let won = tx.query_opt(
                "UPDATE sessions SET fencing_token = $3, state = 'active', connection_id = $5, \
                 lease_expires_at_ms = NULL, ended_reason = NULL, replica = $4, \
                 info = ((info::jsonb - 'endedAt' - 'endedReason') || jsonb_build_object(\
                   'fencingToken', $3::BIGINT, 'leaseToken', $6::TEXT, \
                   'connectionId', $5::TEXT, 'state', 'active'))::TEXT, \
                 written_at = now() \
                 WHERE session_id = $1 AND fencing_token = $2 AND $3 > $2 AND state <> 'ended' \
                 RETURNING info",
                &[
                    &session_id,
                    &prev,
                    &tok,
                    &replica,
                    &connection_id,
                    &lease_token,
                ],
            )?;
            let Some(won) = won else {
                return Ok(None);
            };
            let info: String = won.try_get(0)?;
            tx.execute(
                "UPDATE tool_results SET fencing_token = $3 \
                 WHERE session_id = $1 AND fencing_token = $2",
                &[&session_id, &prev, &tok],
            )?;
            let results = tx.query(
                "SELECT tool_call_id, result FROM tool_results \
                 WHERE session_id = $1 AND fencing_token = $2 ORDER BY seq",
                &[&session_id, &tok],
            )?;
            tx.commit()?;
            Ok(Some((info, results)))
        })?;
        let Some((info, results)) = rows else {
            return Ok(None);
        };
        let info: crate::harness::types::SessionInfo = serde_json::from_str(&info)?;
        let results = results
            .iter()
            .map(|r| {
                Ok(StoredResult {
                    session_id: session_id.to_owned(),
                    fencing_token: token,
                    tool_call_id: r.try_get(0)?,
                    result: serde_json::from_str(r.try_get::<_, &str>(1)?)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(Some((info, results)))
    }

    fn keep(
        &self,
        session_id: &str,
        token: u64,
        replica: &str,
        connection_id: &str,
        now: Option<u64>,
    ) -> Result<bool, StoreError> {
        let (tok, now) = (big(token)?, opt_big(now)?);
        let n = self.store.with(|c| {
            c.execute(
                &with_now(
                    "UPDATE sessions SET connection_id = $4, lease_expires_at_ms = NULL, \
                     written_at = now() \
                     WHERE session_id = $1 AND fencing_token = $2 AND replica = $3 \
                     AND state <> 'ended' \
                     AND (lease_expires_at_ms IS NULL OR lease_expires_at_ms > $n)",
                    5,
                ),
                &[&session_id, &tok, &replica, &connection_id, &now],
            )
        })?;
        Ok(n > 0)
    }

    fn lost(
        &self,
        session_id: &str,
        token: u64,
        replica: &str,
        deadline_ms: u64,
        local_now_ms: u64,
        now: Option<u64>,
    ) -> Result<bool, StoreError> {
        let (tok, d, l, now) = (
            big(token)?,
            big(deadline_ms)?,
            big(local_now_ms)?,
            opt_big(now)?,
        );
        let n = self.store.with(|c| {
            c.execute(
                &with_now(
                    "UPDATE sessions SET lease_expires_at_ms = $4::BIGINT - $5::BIGINT + $n, \
                     written_at = now() \
                     WHERE session_id = $1 AND fencing_token = $2 AND replica = $3 \
                     AND state <> 'ended'",
                    6,
                ),
                &[&session_id, &tok, &replica, &d, &l, &now],
            )
        })?;
        Ok(n > 0)
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
    ) -> Result<crate::harness::rows::Expiry, StoreError> {
        use crate::harness::rows::Expiry;
        let (tok, d, l, now) = (
            big(token)?,
            big(deadline_ms)?,
            big(local_now_ms)?,
            opt_big(now)?,
        );
        let ended_at = crate::wire::types::now_rfc3339();
        let reason = crate::wire::types::EndReason::LEASE_EXPIRED;
        let outcome = self.store.with(|c| {
            // One conditional statement: this replica's grant, last held
            // by `holder` (a keep on another connection moved it), whose
            // lease ran out by the database's clock.
            let n = c.execute(
                &with_now(
                    "UPDATE sessions SET state = 'ended', ended_reason = $8, \
                     lease_expires_at_ms = NULL, written_at = now(), \
                     info = (info::jsonb || jsonb_build_object('state', 'ended', \
                       'endedReason', $8::TEXT, 'endedAt', $9::TEXT))::TEXT \
                     WHERE session_id = $1 AND fencing_token = $2 AND replica = $3 \
                     AND state <> 'ended' AND connection_id IS NOT DISTINCT FROM $4 \
                     AND COALESCE(lease_expires_at_ms, $5::BIGINT - $6::BIGINT + $n) <= $n",
                    7,
                ),
                &[
                    &session_id,
                    &tok,
                    &replica,
                    &holder,
                    &d,
                    &l,
                    &now,
                    &reason,
                    &ended_at,
                ],
            )?;
            if n > 0 {
                return Ok(Expiry::Ended);
            }
            let row = c.query_opt(
                &with_now(
                    "SELECT fencing_token = $2 AND replica = $3 AND state <> 'ended', \
                     COALESCE(lease_expires_at_ms, $4::BIGINT - $5::BIGINT + $n) - $n \
                     FROM sessions WHERE session_id = $1",
                    6,
                ),
                &[&session_id, &tok, &replica, &d, &l, &now],
            )?;
            Ok(match row {
                Some(r) if r.try_get::<_, bool>(0)? => Expiry::NotYet {
                    remaining_ms: u64::try_from(r.try_get::<_, i64>(1)?).unwrap_or(0),
                },
                _ => Expiry::Superseded,
            })
        })?;
        Ok(outcome)
    }

    fn end_expired(&self, session_id: &str, previous: u64) -> Result<bool, StoreError> {
        let prev = big(previous)?;
        let ended_at = crate::wire::types::now_rfc3339();
        let reason = crate::wire::types::EndReason::LEASE_EXPIRED;
        let n = self.store.with(|c| {
            c.execute(
                "UPDATE sessions SET state = 'ended', ended_reason = $3, \
                 lease_expires_at_ms = NULL, written_at = now(), \
                 info = (info::jsonb || jsonb_build_object('state', 'ended', \
                   'endedReason', $3::TEXT, 'endedAt', $4::TEXT))::TEXT \
                 WHERE session_id = $1 AND fencing_token = $2 AND state <> 'ended'",
                &[&session_id, &prev, &reason, &ended_at],
            )
        })?;
        Ok(n > 0)
    }

    fn holds(&self, session_id: &str, token: u64, replica: &str) -> Result<bool, StoreError> {
        let tok = big(token)?;
        let row = self.store.with(|c| {
            c.query_typed_opt(
                "SELECT 1 FROM sessions WHERE session_id = $1 AND fencing_token = $2 \
                 AND replica = $3 AND state <> 'ended'",
                &[
                    (&session_id, Type::TEXT),
                    (&tok, Type::INT8),
                    (&replica, Type::TEXT),
                ],
            )
        })?;
        Ok(row.is_some())
    }
}

impl Drop for PgReplicas {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A row of `info, lease_expires_at_ms, executor_id, state, owner seen
/// (unix ms)`, as the takeover and the sweep read it.
fn takeover_row(r: &Row) -> Result<(StoredSession, TakeoverRow), StoreError> {
    let info: crate::harness::types::SessionInfo = serde_json::from_str(r.try_get::<_, &str>(0)?)?;
    let expires = r
        .try_get::<_, Option<i64>>(1)?
        .map(super::postgres::ms)
        .transpose()?;
    let row = TakeoverRow {
        executor_id: r.try_get(2)?,
        ended: r.try_get::<_, &str>(3)? == "ended",
        lease_expires_at_ms: expires,
        owner_seen_ms: super::postgres::ms(r.try_get(4)?)?,
    };
    Ok((
        StoredSession {
            info,
            lease_expires_at_ms: expires,
        },
        row,
    ))
}

/// End the grant `previous` of `session` (its record, ended), if the row
/// is still that grant and not ended: one conditional statement, so of a
/// takeover, a sweep and another replica's sweep racing for the row,
/// the row lock lets exactly one change it.
fn end_expired_on(
    c: &mut impl GenericClient,
    session: &StoredSession,
    previous: u64,
) -> Result<bool, StoreError> {
    let i = &session.info;
    let previous = big(previous)?;
    let info = serde_json::to_string(i)?;
    let n = c.execute(
        "UPDATE sessions SET state = 'ended', ended_reason = $3, \
         lease_expires_at_ms = NULL, info = $4, written_at = now() \
         WHERE session_id = $1 AND fencing_token = $2 AND state <> 'ended'",
        &[&i.session_id, &previous, &i.ended_reason, &info],
    )?;
    Ok(n > 0)
}

/// End, as replica `me`, the sessions another replica granted that no
/// executor will keep any more: that replica is dead and the lease ran
/// out, both by the database's `now()` ([`replica::orphan_expired`]).
/// Without this such a session stays as the dead replica left it (not
/// ended) until some replica starts up and loads it. The query picks at
/// most [`SWEEP_LIMIT`] candidates with the same rule (so rows not yet
/// due never crowd out rows that are); the rule then decides each, and
/// the conditional update decides a race. Returns how many were ended.
///
/// [`replica::orphan_expired`]: crate::harness::replica::orphan_expired
fn sweep_orphans(c: &mut Client, me: &str, every: Every) -> Result<usize, StoreError> {
    let ttl_ms = u64::try_from(every.ttl.as_millis()).unwrap_or(u64::MAX);
    let poll_ms = u64::try_from(every.poll.as_millis()).unwrap_or(u64::MAX);
    let rows = c.query(
        "WITH n AS (SELECT (extract(epoch FROM now()) * 1000)::BIGINT AS now_ms), \
         s AS (SELECT s.*, (extract(epoch FROM COALESCE(r.seen_at, s.written_at)) * 1000)::BIGINT \
               AS seen_ms FROM sessions s LEFT JOIN replicas r ON r.id = s.replica \
               WHERE s.state <> 'ended' AND s.replica IS NOT NULL AND s.replica <> $1) \
         SELECT s.info, s.lease_expires_at_ms, s.executor_id, s.state, s.seen_ms, n.now_ms \
         FROM s CROSS JOIN n \
         WHERE s.seen_ms + $2 <= n.now_ms \
           AND COALESCE(s.lease_expires_at_ms, s.seen_ms + $3 + $2) <= n.now_ms \
         ORDER BY s.written_at LIMIT $4",
        &[&me, &big(ttl_ms)?, &big(poll_ms)?, &SWEEP_LIMIT],
    )?;
    let mut ended = 0;
    for r in &rows {
        let now = super::postgres::ms(r.try_get(5)?)?;
        let (stored, row) = takeover_row(r)?;
        if !crate::harness::replica::orphan_expired(&row, now, ttl_ms, poll_ms) {
            continue;
        }
        let previous = stored.info.fencing_token;
        let session = crate::harness::replica::ended_expired(stored);
        if end_expired_on(c, &session, previous)? {
            ended += 1;
            tracing::info!(session = %session.info.session_id,
                executor_id = %session.info.executor_id, fencing_token = previous,
                "ended a dead replica's session whose lease ran out (lease_expired)");
        }
    }
    Ok(ended)
}

/// The listener's intervals: the poll, and how long a replica unseen is
/// dead (the lease TTL).
#[derive(Debug, Clone, Copy)]
struct Every {
    poll: Duration,
    ttl: Duration,
}

/// `"<generation> <executor id>"` (the id may hold spaces: it is the rest).
fn parse(payload: &str) -> Option<Generation> {
    let (g, id) = payload.split_once(' ')?;
    Some(Generation {
        executor_id: id.to_owned(),
        generation: g.parse().ok()?,
    })
}

/// The listener loop: (re)connect and `LISTEN`, hand over notifications,
/// poll the table and heartbeat the replica's row every `poll`.
fn listen(
    store: &PgStore,
    stop: &AtomicBool,
    id: &str,
    url: &str,
    every: Every,
    local: &dyn Fn() -> Vec<String>,
    on: &dyn Fn(Generation),
) {
    let poll = every.poll;
    let mut client: Option<Client> = None;
    let mut next_poll = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let Some(c) = client.as_mut() else {
            match store.connect_new().and_then(|mut c| {
                c.batch_execute(&format!("LISTEN {CHANNEL}"))?;
                Ok(c)
            }) {
                Ok(c) => {
                    client = Some(c);
                    // Whatever was announced while not listening.
                    next_poll = Instant::now();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for connection generations; retrying");
                    sleep_unless(stop, RECONNECT_PAUSE);
                }
            }
            continue;
        };
        let wait = next_poll
            .saturating_duration_since(Instant::now())
            .min(STOP_CHECK);
        let mut broken = false;
        {
            let mut notes = c.notifications();
            let mut it = notes.timeout_iter(wait);
            loop {
                match it.next() {
                    Ok(Some(n)) => match parse(n.payload()) {
                        Some(g) => on(g),
                        None => tracing::warn!(payload = n.payload(), "bad notification"),
                    },
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "listening connection lost");
                        broken = true;
                        break;
                    }
                }
            }
        }
        if !broken && Instant::now() >= next_poll {
            next_poll = Instant::now() + poll;
            if let Err(e) = poll_once(c, id, url, &local(), on) {
                tracing::warn!(error = %e, "polling connection generations failed");
                broken = c.is_closed();
            } else if let Err(e) = sweep_orphans(c, id, every) {
                tracing::warn!(error = %e, "sweeping dead replicas' expired sessions failed");
                broken = c.is_closed();
            }
        }
        if broken {
            client = None;
        }
    }
}

/// Heartbeat this replica's row, then hand over the current generation of
/// each of `executors`.
fn poll_once(
    c: &mut Client,
    id: &str,
    url: &str,
    executors: &[String],
    on: &dyn Fn(Generation),
) -> Result<(), postgres::Error> {
    c.execute(
        "INSERT INTO replicas (id, url) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET url = excluded.url, seen_at = now()",
        &[&id, &url],
    )?;
    if executors.is_empty() {
        return Ok(());
    }
    for row in c.query(
        "SELECT executor_id, generation FROM connections WHERE executor_id = ANY($1)",
        &[&executors],
    )? {
        on(Generation {
            executor_id: row.try_get(0)?,
            generation: row.try_get(1)?,
        });
    }
    Ok(())
}

fn sleep_unless(stop: &AtomicBool, total: Duration) {
    let end = Instant::now() + total;
    while !stop.load(Ordering::Relaxed) && Instant::now() < end {
        std::thread::sleep(STOP_CHECK.min(end.saturating_duration_since(Instant::now())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_parse() {
        assert_eq!(
            parse("7 exec a"),
            Some(Generation {
                executor_id: "exec a".into(),
                generation: 7
            })
        );
        assert_eq!(parse("x exec"), None);
        assert_eq!(parse("7"), None);
    }
}

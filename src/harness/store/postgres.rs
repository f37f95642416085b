//! The shared store: PostgreSQL (`bmx harness --store postgres://…`),
//! for harnesses that keep their state in an existing database
//! (docs/store.md, "PostgreSQL").
//!
//! Client: the blocking `postgres` crate (tokio-postgres underneath, on a
//! runtime of its own per connection). Every caller here is already a
//! blocking one: the `bmx-store-writer` thread of [`DurableState`], startup,
//! enrollment calls, which the SQLite store made blocking anyway, and the
//! replicas' claims and look-ups. They share a pool (r2d2, at most
//! `--store-connections`, default [`DEFAULT_CONNECTIONS`]): with one
//! connection a grant's claim or a forwarding look-up queued behind the
//! writer's batch commit, an fsync each. Called from a thread that drives
//! async tasks, the call moves to a scoped thread, since the crate refuses
//! to block such a thread. TLS: [`super::pg_tls`].
//!
//! The database decides every race between harnesses sharing it:
//!
//! * migrations run in one transaction under `pg_advisory_xact_lock`, so
//!   two replicas starting together apply each migration once;
//! * fencing blocks come from `UPDATE fencing SET reserved = reserved + $1
//!   RETURNING reserved` (the row lock orders concurrent reservations: two
//!   harnesses never get overlapping blocks);
//! * a session row is overwritten only by a snapshot of the same or a newer
//!   grant (`ON CONFLICT … WHERE sessions.fencing_token <=
//!   excluded.fencing_token`), so a stale replica cannot roll a session back;
//! * rows record when they were written with the database's `now()`, the
//!   one clock all replicas share, and an orphaned lease's deadline
//!   (`lease_expires_at_ms`) is kept on that clock too: written as this
//!   harness's deadline moved by the difference of the two clocks at the
//!   write, read back the other way, so no harness clock's offset reaches
//!   another harness's decision.
//!
//! The URL may carry a password: it is never logged nor put in an error;
//! [`redact`] is what anyone prints.
//!
//! [`DurableState`]: super::DurableState

use super::durable::{
    state_name, Commit, DurableBackend, StoredEvent, StoredResult, StoredSession,
    RESULTS_KEPT_PER_SESSION,
};
use super::pg_tls::{self, Tls};
use super::{big, Credential, Store, StoreError};
use crate::harness::enroll::{Enrollment, Status};
use crate::harness::runtime::unix_ms;
use crate::harness::types::SessionInfo;
use postgres::{Client, GenericClient, Row};
use r2d2_postgres::PostgresConnectionManager;
use std::sync::Arc;
use std::time::Duration;

type Pool = r2d2::Pool<PostgresConnectionManager<Tls>>;

/// The most connections one store opens, unless told otherwise: the
/// writer, a few grants or look-ups at once, and enrollment calls. The
/// replicas' listener has one more of its own.
pub const DEFAULT_CONNECTIONS: u32 = 8;

/// Migration N is `MIGRATIONS[N-1]`. Append only; never edit one that
/// shipped. The same tables as the SQLite store (`sqlite.rs`), in
/// PostgreSQL's types, plus `written_at` stamped by the database.
const MIGRATIONS: &[&str] = &[
    // 1: enrollments and credentials.
    "CREATE TABLE enrollments (
        id TEXT PRIMARY KEY,
        device_code_hash BYTEA NOT NULL UNIQUE,
        user_code TEXT NOT NULL UNIQUE,
        workspace TEXT NOT NULL,
        display_name TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        created_at_ms BIGINT NOT NULL,
        expires_at_ms BIGINT NOT NULL,
        interval_ms BIGINT NOT NULL,
        last_poll_ms BIGINT,
        status TEXT NOT NULL,
        credential_id TEXT,
        executor_id TEXT,
        written_at TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    CREATE TABLE credentials (
        id TEXT PRIMARY KEY,
        executor_id TEXT NOT NULL UNIQUE,
        token_hash BYTEA NOT NULL UNIQUE,
        enrollment_id TEXT NOT NULL,
        workspace TEXT NOT NULL,
        display_name TEXT NOT NULL,
        created_at_ms BIGINT NOT NULL,
        revoked_at_ms BIGINT,
        written_at TIMESTAMPTZ NOT NULL DEFAULT now()
    );",
    // 2: durable harness state: the fencing high-water mark, the
    // platform's sessions, tool results not to lose.
    "CREATE TABLE fencing (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        reserved BIGINT NOT NULL CHECK (reserved >= 0),
        written_at TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    INSERT INTO fencing (id, reserved) VALUES (1, 0);
    CREATE TABLE sessions (
        session_id TEXT PRIMARY KEY,
        executor_id TEXT NOT NULL,
        fencing_token BIGINT NOT NULL,
        state TEXT NOT NULL,
        connection_id TEXT,
        lease_expires_at_ms BIGINT,
        ended_reason TEXT,
        info TEXT NOT NULL,
        written_at TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    CREATE TABLE tool_results (
        seq BIGSERIAL PRIMARY KEY,
        session_id TEXT NOT NULL,
        fencing_token BIGINT NOT NULL,
        tool_call_id TEXT NOT NULL,
        result TEXT NOT NULL,
        written_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        UNIQUE (session_id, tool_call_id)
    );",
    // 3: several live replicas (docs/store.md, "Several replicas"): which
    // replica holds each executor's newest connection (the 4004 rule), who
    // made a session's current grant, and the replicas alive.
    "CREATE TABLE connections (
        executor_id TEXT PRIMARY KEY,
        replica TEXT NOT NULL,
        connection_id TEXT NOT NULL,
        generation BIGINT NOT NULL,
        written_at TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    ALTER TABLE sessions ADD COLUMN replica TEXT;
    CREATE TABLE replicas (
        id TEXT PRIMARY KEY,
        url TEXT NOT NULL,
        seen_at TIMESTAMPTZ NOT NULL DEFAULT now()
    );",
    // 4: the sessions' agent event streams (accepted `session.event`s,
    // trimmed to the in-memory log's retention).
    "CREATE TABLE session_events (
        session_id TEXT NOT NULL,
        sequence BIGINT NOT NULL,
        fencing_token BIGINT NOT NULL,
        json TEXT NOT NULL,
        written_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        PRIMARY KEY (session_id, sequence)
    );",
];

/// The advisory lock migrations run under (any fixed key: "bmx_migr").
const MIGRATION_LOCK: i64 = 0x626d_785f_6d69_6772;

/// Deadlines: connecting, and any one statement (a lock wait included).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const STATEMENT_TIMEOUT_MS: u64 = 30_000;

/// `url` with any password replaced by `***`, for logs and errors. Both
/// forms libpq accepts are handled: `postgres://user:pw@host/db` and
/// `host=… password=pw`, plus `password=` in a URL's query.
pub fn redact(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = out.find("://") {
        let rest = scheme_end + 3;
        let authority_end = out[rest..]
            .find(['/', '?', '#'])
            .map_or(out.len(), |i| rest + i);
        if let Some(at) = out[rest..authority_end].rfind('@') {
            let userinfo = &out[rest..rest + at];
            if let Some(colon) = userinfo.find(':') {
                out.replace_range(rest + colon + 1..rest + at, "***");
            }
        }
    }
    // `password=…` as a key of a query or of a key/value string.
    let lower = out.to_ascii_lowercase();
    let mut redacted = String::with_capacity(out.len());
    let mut i = 0;
    while let Some(off) = lower[i..].find("password=") {
        let start = i + off + "password=".len();
        redacted.push_str(&out[i..start]);
        redacted.push_str("***");
        let end = if out[start..].starts_with('\'') {
            // A quoted key/value password runs to the closing quote.
            out[start + 1..]
                .find('\'')
                .map_or(out.len(), |e| start + e + 2)
        } else {
            out[start..]
                .find(['&', ' ', '#'])
                .map_or(out.len(), |e| start + e)
        };
        i = end;
    }
    redacted.push_str(&out[i..]);
    redacted
}

/// Whether `s` names a PostgreSQL store (`postgres://` or `postgresql://`).
pub fn is_postgres_url(s: &str) -> bool {
    s.starts_with("postgres://") || s.starts_with("postgresql://")
}

/// Run `f` where the blocking client may block. The client runs a
/// runtime of its own, which tokio refuses to start on a thread that
/// drives async tasks. So:
///
/// * no runtime here (the writer thread, a plain thread): on this thread;
/// * a multi-thread runtime: through `block_in_place`, which on a worker
///   hands the worker's tasks to another thread first, and on a
///   `spawn_blocking` thread (where the API's look-ups and claims run) is
///   simply the call: no thread is started per statement;
/// * a current-thread runtime (`#[tokio::test]`, embedders): on a scoped
///   thread of its own, the one way to block there.
fn off_runtime<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    match tokio::runtime::Handle::try_current() {
        Err(_) => f(),
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        Ok(_) => std::thread::scope(|s| match s.spawn(f).join() {
            Ok(v) => v,
            Err(panic) => std::panic::resume_unwind(panic),
        }),
    }
}

/// The PostgreSQL store: a pool of connections; a broken one is dropped
/// when it is handed back, and the next call opens a new one.
pub struct PgStore {
    config: postgres::Config,
    tls: Tls,
    /// What the URL's `sslmode` asked for, for the log line.
    mode: pg_tls::Mode,
    /// What logs say instead of the URL.
    redacted: String,
    /// `None` only while dropping.
    pool: Option<Pool>,
    /// Set when this harness is one of several live replicas
    /// ([`super::pg_replicas::PgReplicas`]): session rows are then created
    /// only by a claim, and the writer updates a row only while it holds
    /// that row's grant.
    replica: std::sync::OnceLock<String>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("url", &self.redacted)
            .finish()
    }
}

impl Drop for PgStore {
    /// A client closes its connection and its own runtime when dropped,
    /// which must not happen on a thread that drives async tasks: the last
    /// handle may well go there (a harness shutting down).
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            off_runtime(move || drop(pool));
        }
    }
}

/// Every pooled connection gets the statement deadlines on first use.
#[derive(Debug)]
struct Deadlines;

impl r2d2::CustomizeConnection<Client, postgres::Error> for Deadlines {
    fn on_acquire(&self, c: &mut Client) -> Result<(), postgres::Error> {
        set_deadlines(c)
    }
}

fn set_deadlines(c: &mut Client) -> Result<(), postgres::Error> {
    c.batch_execute(&format!(
        "SET statement_timeout = {STATEMENT_TIMEOUT_MS}; \
         SET lock_timeout = {STATEMENT_TIMEOUT_MS}"
    ))
}

/// The pool's own connection attempts (it opens them in the background)
/// go to the log, not to `log`'s default handler.
#[derive(Debug)]
struct LogErrors;

impl r2d2::HandleError<postgres::Error> for LogErrors {
    fn handle_error(&self, error: postgres::Error) {
        tracing::warn!(error = %error, "postgres store: opening a pooled connection failed");
    }
}

fn bad_url(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("bad URL: {e}"))
}

impl PgStore {
    /// Connect to `url` and migrate the database, with at most
    /// [`DEFAULT_CONNECTIONS`] connections.
    ///
    /// # Errors
    ///
    /// See [`PgStore::connect_with`].
    pub fn connect(url: &str) -> Result<PgStore, StoreError> {
        PgStore::connect_with(url, DEFAULT_CONNECTIONS)
    }

    /// Connect to `url` (TLS as its `sslmode`/`sslrootcert` say:
    /// [`super::pg_tls`]) and migrate the database; later calls share at
    /// most `connections` connections (at least 1).
    ///
    /// # Errors
    ///
    /// The URL does not parse, its TLS settings cannot be used, the server
    /// cannot be reached in time (or its certificate is refused), or the
    /// schema is newer than this bmx. The error never holds the URL.
    pub fn connect_with(url: &str, connections: u32) -> Result<PgStore, StoreError> {
        let split = pg_tls::split(url).map_err(bad_url)?;
        let mut config: postgres::Config = split
            .rest
            .parse()
            .map_err(|e: postgres::Error| bad_url(e))?;
        config.ssl_mode(split.mode.client_mode());
        config.connect_timeout(CONNECT_TIMEOUT);
        if config.get_application_name().is_none() {
            config.application_name("bmx-harness");
        }
        let tls = pg_tls::connector(split.mode, split.root_cert.as_deref())
            .map_err(|e| StoreError::Unavailable(format!("TLS: {e}")))?;
        let mut store = PgStore {
            config,
            tls,
            mode: split.mode,
            redacted: redact(url),
            pool: None,
            replica: std::sync::OnceLock::new(),
        };
        // The first connection is opened here, not by the pool, so a
        // server that refuses it fails the start at once with its own
        // error rather than after the pool's wait. It migrates, then goes.
        let encrypted = off_runtime(|| -> Result<bool, StoreError> {
            let mut c = store.connect_new()?;
            migrate(&mut c)??;
            Ok(encrypted(&mut c)?)
        })?;
        let manager = PostgresConnectionManager::new(store.config.clone(), store.tls.clone());
        store.pool = Some(off_runtime(|| {
            r2d2::Pool::builder()
                .max_size(connections.max(1))
                .min_idle(Some(1))
                .connection_timeout(CONNECT_TIMEOUT)
                // Checked when handed back (`is_closed`), not with a
                // round trip on every hand-out.
                .test_on_check_out(false)
                .connection_customizer(Box::new(Deadlines))
                .error_handler(Box::new(LogErrors))
                .build_unchecked(manager)
        }));
        tracing::info!(
            url = %store.redacted,
            sslmode = store.mode.name(),
            tls = encrypted,
            connections = connections.max(1),
            "postgres store ready"
        );
        Ok(store)
    }

    /// The URL with its password hidden.
    pub fn redacted_url(&self) -> &str {
        &self.redacted
    }

    /// Whether a connection of this store is encrypted (TLS), as the
    /// server sees it (`pg_stat_ssl`).
    ///
    /// # Errors
    ///
    /// The database fails.
    pub fn encrypted(&self) -> Result<bool, StoreError> {
        self.with(encrypted)
    }

    /// The schema version (the highest migration applied).
    ///
    /// # Errors
    ///
    /// The database fails.
    pub fn schema_version(&self) -> Result<i64, StoreError> {
        self.with(|c| {
            let row = c.query_one(
                "SELECT COALESCE(MAX(version), 0)::BIGINT FROM schema_migrations",
                &[],
            )?;
            Ok(row.get::<_, i64>(0))
        })
    }

    /// Become replica `id`: see the field `replica`. Once only.
    pub(super) fn set_replica(&self, id: &str) {
        let _ = self.replica.set(id.to_owned());
    }

    /// A new connection of its own, outside the pool (the replicas'
    /// `LISTEN`), with the same TLS and deadlines as the pooled ones.
    /// Blocks: call it off any runtime.
    pub(super) fn connect_new(&self) -> Result<Client, postgres::Error> {
        let mut client = self.config.connect(self.tls.clone())?;
        set_deadlines(&mut client)?;
        Ok(client)
    }

    /// Run `f` on a pooled connection, off any async thread. A connection
    /// found broken when handed back is dropped, so the next call (the
    /// writer retries) opens a new one.
    pub(super) fn with<T: Send>(
        &self,
        f: impl FnOnce(&mut Client) -> Result<T, postgres::Error> + Send,
    ) -> Result<T, StoreError> {
        off_runtime(|| {
            let Some(pool) = self.pool.as_ref() else {
                return Err(StoreError::Unavailable("the store is closed".into()));
            };
            let mut conn = pool
                .get()
                .map_err(|e| StoreError::Unavailable(format!("no connection: {e}")))?;
            Ok(f(&mut conn)?)
        })
    }
}

fn encrypted(c: &mut Client) -> Result<bool, postgres::Error> {
    let row = c.query_opt(
        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        &[],
    )?;
    Ok(row.is_some_and(|r| r.get::<_, bool>(0)))
}

/// Apply every migration past the highest recorded, all in one
/// transaction under an advisory lock: a second harness starting at the
/// same time waits, then finds them applied.
fn migrate(c: &mut Client) -> Result<Result<(), StoreError>, postgres::Error> {
    let known = MIGRATIONS.len() as i64;
    let mut tx = c.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (
            version BIGINT PRIMARY KEY,
            applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
        )",
    )?;
    let found: i64 = tx
        .query_one(
            "SELECT COALESCE(MAX(version), 0)::BIGINT FROM schema_migrations",
            &[],
        )?
        .get(0);
    if found > known {
        return Ok(Err(StoreError::TooNew { found, known }));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        let version = (i + 1) as i64;
        tx.batch_execute(sql)?;
        tx.execute(
            "INSERT INTO schema_migrations (version) VALUES ($1)",
            &[&version],
        )?;
        tracing::info!(version, "postgres store migrated");
    }
    tx.commit()?;
    Ok(Ok(()))
}

const ENROLLMENT_COLUMNS: &str = "id, device_code_hash, user_code, workspace, display_name, \
    fingerprint, created_at_ms, expires_at_ms, interval_ms, last_poll_ms, status, \
    credential_id, executor_id";

const CREDENTIAL_COLUMNS: &str = "id, executor_id, token_hash, enrollment_id, workspace, \
    display_name, created_at_ms, revoked_at_ms";

fn hash_of(v: Vec<u8>) -> Result<[u8; 32], StoreError> {
    v.try_into()
        .map_err(|_| StoreError::Corrupt("hash is not 32 bytes".into()))
}

pub(super) fn ms(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| StoreError::Corrupt(format!("negative time {v}")))
}

fn enrollment_row(r: &Row) -> Result<Enrollment, StoreError> {
    let status: String = r.try_get(10)?;
    let status = Status::parse(&status)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown status {status:?}")))?;
    Ok(Enrollment {
        id: r.try_get(0)?,
        device_code_hash: hash_of(r.try_get(1)?)?,
        user_code: r.try_get(2)?,
        workspace: r.try_get(3)?,
        display_name: r.try_get(4)?,
        fingerprint: r.try_get(5)?,
        created_at_ms: ms(r.try_get(6)?)?,
        expires_at_ms: ms(r.try_get(7)?)?,
        interval_ms: ms(r.try_get(8)?)?,
        last_poll_ms: r.try_get::<_, Option<i64>>(9)?.map(ms).transpose()?,
        status,
        credential_id: r.try_get(11)?,
        executor_id: r.try_get(12)?,
    })
}

fn credential_row(r: &Row) -> Result<Credential, StoreError> {
    Ok(Credential {
        credential_id: r.try_get(0)?,
        executor_id: r.try_get(1)?,
        token_hash: hash_of(r.try_get(2)?)?,
        enrollment_id: r.try_get(3)?,
        workspace: r.try_get(4)?,
        display_name: r.try_get(5)?,
        created_at_ms: ms(r.try_get(6)?)?,
        revoked_at_ms: r.try_get::<_, Option<i64>>(7)?.map(ms).transpose()?,
    })
}

fn put(c: &mut impl GenericClient, e: &Enrollment) -> Result<(), StoreError> {
    c.execute(
        &format!(
            "INSERT INTO enrollments ({ENROLLMENT_COLUMNS}) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) \
             ON CONFLICT (id) DO UPDATE SET device_code_hash = excluded.device_code_hash, \
             user_code = excluded.user_code, workspace = excluded.workspace, \
             display_name = excluded.display_name, fingerprint = excluded.fingerprint, \
             created_at_ms = excluded.created_at_ms, expires_at_ms = excluded.expires_at_ms, \
             interval_ms = excluded.interval_ms, last_poll_ms = excluded.last_poll_ms, \
             status = excluded.status, credential_id = excluded.credential_id, \
             executor_id = excluded.executor_id, written_at = now()"
        ),
        &[
            &e.id,
            &&e.device_code_hash[..],
            &e.user_code,
            &e.workspace,
            &e.display_name,
            &e.fingerprint,
            &big(e.created_at_ms)?,
            &big(e.expires_at_ms)?,
            &big(e.interval_ms)?,
            &e.last_poll_ms.map(big).transpose()?,
            &e.status.as_str(),
            &e.credential_id,
            &e.executor_id,
        ],
    )?;
    Ok(())
}

impl Store for PgStore {
    fn put_enrollment(&self, e: &Enrollment) -> Result<(), StoreError> {
        self.with(|c| Ok(put(c, e)))?
    }

    fn enrollment_by_device_hash(&self, hash: &[u8; 32]) -> Result<Option<Enrollment>, StoreError> {
        let row = self.with(|c| {
            c.query_opt(
                &format!(
                    "SELECT {ENROLLMENT_COLUMNS} FROM enrollments WHERE device_code_hash = $1"
                ),
                &[&&hash[..]],
            )
        })?;
        row.as_ref().map(enrollment_row).transpose()
    }

    fn enrollment_by_user_code(&self, code: &str) -> Result<Option<Enrollment>, StoreError> {
        let row = self.with(|c| {
            c.query_opt(
                &format!("SELECT {ENROLLMENT_COLUMNS} FROM enrollments WHERE user_code = $1"),
                &[&code],
            )
        })?;
        row.as_ref().map(enrollment_row).transpose()
    }

    fn enrollments(&self, limit: usize) -> Result<Vec<Enrollment>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.with(|c| {
            c.query(
                &format!(
                    "SELECT {ENROLLMENT_COLUMNS} FROM enrollments \
                     ORDER BY created_at_ms DESC, id LIMIT $1"
                ),
                &[&limit],
            )
        })?;
        rows.iter().map(enrollment_row).collect()
    }

    fn issue(&self, e: &Enrollment, cred: &Credential) -> Result<(), StoreError> {
        self.with(|c| Ok(issue(c, e, cred)))?
    }

    fn credentials(&self) -> Result<Vec<Credential>, StoreError> {
        let rows = self.with(|c| {
            c.query(
                &format!("SELECT {CREDENTIAL_COLUMNS} FROM credentials ORDER BY created_at_ms, id"),
                &[],
            )
        })?;
        rows.iter().map(credential_row).collect()
    }

    fn revoke(&self, credential_id: &str, now_ms: u64) -> Result<Option<Credential>, StoreError> {
        let now = big(now_ms)?;
        let row = self.with(|c| {
            // One statement decides: the first revocation's time stays.
            c.execute(
                "UPDATE credentials SET revoked_at_ms = $2, written_at = now() \
                 WHERE id = $1 AND revoked_at_ms IS NULL",
                &[&credential_id, &now],
            )?;
            c.query_opt(
                &format!("SELECT {CREDENTIAL_COLUMNS} FROM credentials WHERE id = $1"),
                &[&credential_id],
            )
        })?;
        row.as_ref().map(credential_row).transpose()
    }

    fn count_pending(&self, now_ms: u64) -> Result<usize, StoreError> {
        let now = big(now_ms)?;
        let n: i64 = self.with(|c| {
            Ok(c.query_one(
                "SELECT COUNT(*) FROM enrollments WHERE status = 'pending' AND expires_at_ms > $1",
                &[&now],
            )?
            .get(0))
        })?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    fn prune_enrollments(&self, before_ms: u64) -> Result<usize, StoreError> {
        let before = big(before_ms)?;
        let n = self.with(|c| {
            c.execute(
                "DELETE FROM enrollments \
                 WHERE status IN ('pending', 'expired', 'denied') AND expires_at_ms < $1",
                &[&before],
            )
        })?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }
}

fn issue(c: &mut Client, e: &Enrollment, cred: &Credential) -> Result<(), StoreError> {
    let mut tx = c.transaction()?;
    put(&mut tx, e)?;
    tx.execute(
        &format!(
            "INSERT INTO credentials ({CREDENTIAL_COLUMNS}) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
        ),
        &[
            &cred.credential_id,
            &cred.executor_id,
            &&cred.token_hash[..],
            &cred.enrollment_id,
            &cred.workspace,
            &cred.display_name,
            &big(cred.created_at_ms)?,
            &cred.revoked_at_ms.map(big).transpose()?,
        ],
    )?;
    tx.commit()?;
    Ok(())
}

/// Reserve the next block of `n` in `tx`: the row lock on `fencing`
/// orders concurrent reservations, each sees the other's committed mark.
fn reserve(c: &mut impl GenericClient, n: u64) -> Result<(u64, u64), StoreError> {
    let last: i64 = c
        .query_one(
            "UPDATE fencing SET reserved = reserved + $1, written_at = now() \
             WHERE id = 1 RETURNING reserved",
            &[&big(n)?],
        )?
        .get(0);
    let last = ms(last)?;
    Ok((last - n + 1, last))
}

impl DurableBackend for PgStore {
    fn reserve_block(&self, n: u64) -> Result<(u64, u64), StoreError> {
        self.with(|c| {
            let mut tx = c.transaction()?;
            let block = reserve(&mut tx, n);
            if block.is_ok() {
                tx.commit()?;
            }
            Ok(block)
        })?
    }

    fn session_tokens(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let rows = self.with(|c| c.query("SELECT session_id, fencing_token FROM sessions", &[]))?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, ms(r.try_get(1)?)?)))
            .collect()
    }

    fn load(&self) -> Result<(Vec<StoredSession>, Vec<StoredResult>), StoreError> {
        let local_now = big(unix_ms())?;
        let (sessions, results) = self.with(|c| {
            // One snapshot for both reads: results match their sessions.
            let mut tx = c
                .build_transaction()
                .isolation_level(postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()?;
            // Deadlines are kept on the database's clock: back onto this
            // harness's (what is left of each, from now).
            let sessions = tx.query(
                "SELECT info, lease_expires_at_ms \
                 - (extract(epoch FROM now()) * 1000)::BIGINT + $1::BIGINT FROM sessions",
                &[&local_now],
            )?;
            let results = tx.query(
                "SELECT r.session_id, r.fencing_token, r.tool_call_id, r.result \
                 FROM tool_results r JOIN sessions s \
                   ON s.session_id = r.session_id AND s.fencing_token = r.fencing_token \
                 ORDER BY r.seq",
                &[],
            )?;
            tx.commit()?;
            Ok((sessions, results))
        })?;
        let sessions = sessions
            .iter()
            .map(|r| {
                let info: SessionInfo = serde_json::from_str(r.try_get::<_, &str>(0)?)?;
                Ok(StoredSession {
                    info,
                    lease_expires_at_ms: r.try_get::<_, Option<i64>>(1)?.map(ms).transpose()?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        let results = results
            .iter()
            .map(|r| {
                Ok(StoredResult {
                    session_id: r.try_get(0)?,
                    fencing_token: ms(r.try_get(1)?)?,
                    tool_call_id: r.try_get(2)?,
                    result: serde_json::from_str(r.try_get::<_, &str>(3)?)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok((sessions, results))
    }

    fn commit(&self, batch: &Commit<'_>) -> Result<Option<(u64, u64)>, StoreError> {
        let replica = self.replica.get().map(String::as_str);
        self.with(|c| Ok(commit(c, batch, replica)))?
    }

    fn events(&self, session_id: &str) -> Result<Vec<StoredEvent>, StoreError> {
        let rows = self.with(|c| {
            c.query(
                "SELECT sequence, fencing_token, json FROM session_events \
                 WHERE session_id = $1 ORDER BY sequence",
                &[&session_id],
            )
        })?;
        rows.iter()
            .map(|r| {
                Ok(StoredEvent {
                    session_id: session_id.to_owned(),
                    sequence: ms(r.try_get(0)?)?,
                    fencing_token: ms(r.try_get(1)?)?,
                    json: Arc::from(r.try_get::<_, &str>(2)?),
                })
            })
            .collect()
    }
}

/// Write a session's snapshot as replica `me`: only over the row of the
/// same grant (its fencing token), which only this replica's claim
/// created ([`super::pg_replicas::PgReplicas::claim_session`]). A replica
/// that lost the claim, or whose grant was taken over, writes nothing.
fn update_own(
    tx: &mut postgres::Transaction<'_>,
    id: &str,
    s: &super::durable::StoredSession,
    me: &str,
) -> Result<(), StoreError> {
    let i = &s.info;
    tx.execute(
        "UPDATE sessions SET executor_id = $2, state = $4, connection_id = $5, \
         lease_expires_at_ms = $6::BIGINT - $10::BIGINT + (extract(epoch FROM now()) * 1000)::BIGINT, \
         ended_reason = $7, info = $8, replica = $9, \
         written_at = now() WHERE session_id = $1 AND fencing_token = $3",
        &[
            &id,
            &i.executor_id,
            &big(i.fencing_token)?,
            &state_name(i.state),
            &i.connection_id,
            &s.lease_expires_at_ms.map(big).transpose()?,
            &i.ended_reason,
            &serde_json::to_string(i)?,
            &me,
            &big(unix_ms())?,
        ],
    )?;
    Ok(())
}

fn commit(
    c: &mut Client,
    b: &Commit<'_>,
    replica: Option<&str>,
) -> Result<Option<(u64, u64)>, StoreError> {
    let mut tx = c.transaction()?;
    for (id, row) in b.sessions {
        match (row, replica) {
            (Some(s), Some(me)) => update_own(&mut tx, id, s, me)?,
            (None, Some(me)) => {
                // Only the grant this replica forgets, never another's.
                let gone = match b.deleted_tokens.get(id) {
                    Some(t) => tx.execute(
                        "DELETE FROM sessions WHERE session_id = $1 AND fencing_token = $2",
                        &[id, &big(*t)?],
                    )?,
                    None => tx.execute(
                        "DELETE FROM sessions WHERE session_id = $1 AND replica = $2",
                        &[id, &me],
                    )?,
                };
                if gone > 0 {
                    tx.execute("DELETE FROM tool_results WHERE session_id = $1", &[id])?;
                    tx.execute("DELETE FROM session_events WHERE session_id = $1", &[id])?;
                }
            }
            (Some(s), None) => {
                let i = &s.info;
                // A snapshot of an older grant never overwrites a newer
                // one (another replica's): the database decides.
                tx.execute(
                    "INSERT INTO sessions (session_id, executor_id, fencing_token, state, \
                     connection_id, lease_expires_at_ms, ended_reason, info) \
                     VALUES ($1, $2, $3, $4, $5, \
                     $6::BIGINT - $9::BIGINT + (extract(epoch FROM now()) * 1000)::BIGINT, $7, $8) \
                     ON CONFLICT (session_id) DO UPDATE SET executor_id = excluded.executor_id, \
                     fencing_token = excluded.fencing_token, state = excluded.state, \
                     connection_id = excluded.connection_id, \
                     lease_expires_at_ms = excluded.lease_expires_at_ms, \
                     ended_reason = excluded.ended_reason, info = excluded.info, \
                     written_at = now() \
                     WHERE sessions.fencing_token <= excluded.fencing_token",
                    &[
                        id,
                        &i.executor_id,
                        &big(i.fencing_token)?,
                        &state_name(i.state),
                        &i.connection_id,
                        &s.lease_expires_at_ms.map(big).transpose()?,
                        &i.ended_reason,
                        &serde_json::to_string(i)?,
                        &big(unix_ms())?,
                    ],
                )?;
            }
            (None, None) => {
                tx.execute("DELETE FROM sessions WHERE session_id = $1", &[id])?;
                tx.execute("DELETE FROM tool_results WHERE session_id = $1", &[id])?;
                tx.execute("DELETE FROM session_events WHERE session_id = $1", &[id])?;
            }
        }
    }
    let kept = RESULTS_KEPT_PER_SESSION as i64;
    for r in b.results {
        // A result sent again replaces the stored one and becomes the
        // newest (as SQLite's INSERT OR REPLACE does).
        tx.execute(
            "INSERT INTO tool_results (session_id, fencing_token, tool_call_id, result) \
             VALUES ($1, $2, $3, $4) \
             ON CONFLICT (session_id, tool_call_id) DO UPDATE SET \
             fencing_token = excluded.fencing_token, result = excluded.result, \
             seq = nextval(pg_get_serial_sequence('tool_results', 'seq')), written_at = now()",
            &[
                &r.session_id,
                &big(r.fencing_token)?,
                &r.tool_call_id,
                &serde_json::to_string(&r.result)?,
            ],
        )?;
        tx.execute(
            "DELETE FROM tool_results WHERE session_id = $1 AND seq NOT IN \
             (SELECT seq FROM tool_results WHERE session_id = $1 ORDER BY seq DESC LIMIT $2)",
            &[&r.session_id, &kept],
        )?;
    }
    write_events(&mut tx, b)?;
    let block = match b.reserve {
        Some(n) => Some(reserve(&mut tx, n)?),
        None => None,
    };
    tx.commit()?;
    Ok(block)
}

/// A batch's session events: clears, then inserts, then floors (the order
/// [`Commit`] documents).
fn write_events(tx: &mut postgres::Transaction<'_>, b: &Commit<'_>) -> Result<(), StoreError> {
    for id in b.cleared_events {
        tx.execute("DELETE FROM session_events WHERE session_id = $1", &[id])?;
    }
    if !b.events.is_empty() {
        let insert = tx.prepare(
            "INSERT INTO session_events (session_id, sequence, fencing_token, json) \
             VALUES ($1, $2, $3, $4) \
             ON CONFLICT (session_id, sequence) DO UPDATE SET \
             fencing_token = excluded.fencing_token, json = excluded.json, written_at = now()",
        )?;
        for e in b.events {
            tx.execute(
                &insert,
                &[
                    &e.session_id,
                    &big(e.sequence)?,
                    &big(e.fencing_token)?,
                    &&*e.json,
                ],
            )?;
        }
    }
    for (id, floor) in b.event_floors {
        tx.execute(
            "DELETE FROM session_events WHERE session_id = $1 AND sequence < $2",
            &[id, &big(*floor)?],
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_survive_redaction() {
        for (url, want) in [
            (
                "postgres://bmx:s3cret@db:5432/bmx",
                "postgres://bmx:***@db:5432/bmx",
            ),
            (
                "postgresql://u:p%40ss@h/db?sslmode=disable",
                "postgresql://u:***@h/db?sslmode=disable",
            ),
            ("postgres://u@h/db", "postgres://u@h/db"),
            (
                "postgres://h/db?user=u&password=hunter2&x=1",
                "postgres://h/db?user=u&password=***&x=1",
            ),
            (
                "host=h user=u PASSWORD=hunter2 dbname=d",
                "host=h user=u PASSWORD=*** dbname=d",
            ),
            // An '@' in the password itself.
            ("postgres://u:a@b@h/db", "postgres://u:***@h/db"),
            ("host=h password='a b' user=u", "host=h password=*** user=u"),
        ] {
            let got = redact(url);
            assert_eq!(got, want);
            assert!(!got.contains("s3cret") && !got.contains("hunter2"));
        }
    }

    #[test]
    fn a_bad_url_is_refused_without_echoing_it() {
        let err = PgStore::connect("postgres://u:topsecret@h:notaport/db")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("topsecret"), "{err}");
    }
}

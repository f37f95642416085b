//! The embedded store: SQLite (bundled) in `<data-dir>/harness.db`.
//!
//! Schema changes are numbered migrations applied in order inside one
//! transaction each, from the very first table on; `PRAGMA user_version`
//! records the last one applied, and a database from a newer bmx is
//! refused rather than misread.

use super::durable::{
    state_name, Commit, DurableBackend, StoredEvent, StoredResult, StoredSession,
    RESULTS_KEPT_PER_SESSION,
};
use super::{big, Credential, Store, StoreError};
use crate::harness::enroll::{Enrollment, Status};
use crate::harness::types::SessionInfo;
use rusqlite::{params, Connection, OptionalExtension, Row};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Migration N is `MIGRATIONS[N-1]`. Append only; never edit one that shipped.
const MIGRATIONS: &[&str] = &[
    // 1: enrollments and credentials.
    "CREATE TABLE enrollments (
        id TEXT PRIMARY KEY,
        device_code_hash BLOB NOT NULL UNIQUE,
        user_code TEXT NOT NULL UNIQUE,
        workspace TEXT NOT NULL,
        display_name TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL,
        expires_at_ms INTEGER NOT NULL,
        interval_ms INTEGER NOT NULL,
        last_poll_ms INTEGER,
        status TEXT NOT NULL,
        credential_id TEXT,
        executor_id TEXT
    );
    CREATE TABLE credentials (
        id TEXT PRIMARY KEY,
        executor_id TEXT NOT NULL UNIQUE,
        token_hash BLOB NOT NULL UNIQUE,
        enrollment_id TEXT NOT NULL,
        workspace TEXT NOT NULL,
        display_name TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL,
        revoked_at_ms INTEGER
    );",
    // 2: durable harness state (docs/store.md): the fencing high-water
    // mark, the platform's sessions, tool results not to lose.
    "CREATE TABLE fencing (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        reserved INTEGER NOT NULL
    );
    INSERT INTO fencing (id, reserved) VALUES (1, 0);
    CREATE TABLE sessions (
        session_id TEXT PRIMARY KEY,
        executor_id TEXT NOT NULL,
        fencing_token INTEGER NOT NULL,
        state TEXT NOT NULL,
        connection_id TEXT,
        lease_expires_at_ms INTEGER,
        ended_reason TEXT,
        info TEXT NOT NULL
    );
    CREATE TABLE tool_results (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id TEXT NOT NULL,
        fencing_token INTEGER NOT NULL,
        tool_call_id TEXT NOT NULL,
        result TEXT NOT NULL,
        UNIQUE (session_id, tool_call_id)
    );",
    // 3: the sessions' agent event streams (accepted `session.event`s,
    // trimmed to the in-memory log's retention).
    "CREATE TABLE session_events (
        session_id TEXT NOT NULL,
        sequence INTEGER NOT NULL,
        fencing_token INTEGER NOT NULL,
        json TEXT NOT NULL,
        PRIMARY KEY (session_id, sequence)
    ) WITHOUT ROWID;",
];

/// The SQLite store. One connection behind a mutex: the harness's write
/// rate (enrollments, revocations) is tiny.
pub struct SqliteStore {
    conn: Mutex<Connection>,
}

impl SqliteStore {
    /// Open (creating) `<dir>/harness.db`. The directory is made or
    /// checked by [`data_dir::prepare`](crate::harness::data_dir::prepare)
    /// (0700 when created; refused when another user's or writable by
    /// others); the database is created 0600 before SQLite opens it, and
    /// SQLite gives its `-wal` and `-shm` files the database's mode. Files
    /// of an earlier run that are more open are made 0600.
    ///
    /// # Errors
    ///
    /// The directory is refused or cannot be created, the database cannot
    /// be created, or its schema is newer.
    pub fn open_dir(dir: &Path) -> Result<SqliteStore, StoreError> {
        use crate::harness::data_dir;
        data_dir::prepare(dir).map_err(std::io::Error::from)?;
        let db = dir.join("harness.db");
        data_dir::private_file()
            .write(true)
            .create(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&db)?;
        for name in ["harness.db", "harness.db-wal", "harness.db-shm"] {
            data_dir::tighten(&dir.join(name), 0o600)?;
        }
        Self::open(&db)
    }

    /// Open (creating) the database file at `path` and migrate it.
    ///
    /// # Errors
    ///
    /// As [`open_dir`](Self::open_dir).
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        let conn = Connection::open(path)?;
        Self::init(conn)
    }

    /// An in-memory store (tests, embedders that keep nothing).
    ///
    /// # Errors
    ///
    /// SQLite cannot start.
    pub fn in_memory() -> Result<SqliteStore, StoreError> {
        Self::init(Connection::open_in_memory()?)
    }

    fn init(mut conn: Connection) -> Result<SqliteStore, StoreError> {
        conn.busy_timeout(Duration::from_secs(5))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        migrate(&mut conn)?;
        Ok(SqliteStore {
            conn: Mutex::new(conn),
        })
    }

    /// The schema version (the number of migrations applied).
    ///
    /// # Errors
    ///
    /// SQLite fails.
    pub fn schema_version(&self) -> Result<i64, StoreError> {
        Ok(self
            .lock()
            .query_row("PRAGMA user_version", [], |r| r.get(0))?)
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Apply every migration past the recorded version, each in its own
/// transaction together with its version bump.
fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let known = MIGRATIONS.len() as i64;
    // Two harnesses may open one data dir at once: the version is read
    // and bumped inside one write transaction (BEGIN IMMEDIATE), so only
    // one of them applies each migration.
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let found: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if found > known {
        return Err(StoreError::TooNew { found, known });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", (i + 1) as i64)?;
        tracing::info!(version = i + 1, "store migrated");
    }
    tx.commit()?;
    Ok(())
}

const ENROLLMENT_COLUMNS: &str = "id, device_code_hash, user_code, workspace, display_name, \
    fingerprint, created_at_ms, expires_at_ms, interval_ms, last_poll_ms, status, \
    credential_id, executor_id";

fn hash_of(v: Vec<u8>) -> Result<[u8; 32], rusqlite::Error> {
    v.try_into().map_err(|_| {
        rusqlite::Error::FromSqlConversionFailure(
            0,
            rusqlite::types::Type::Blob,
            "hash is not 32 bytes".into(),
        )
    })
}

fn enrollment_row(r: &Row<'_>) -> Result<Enrollment, rusqlite::Error> {
    let status: String = r.get(10)?;
    let status = Status::parse(&status).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            10,
            rusqlite::types::Type::Text,
            format!("unknown status {status:?}").into(),
        )
    })?;
    Ok(Enrollment {
        id: r.get(0)?,
        device_code_hash: hash_of(r.get(1)?)?,
        user_code: r.get(2)?,
        workspace: r.get(3)?,
        display_name: r.get(4)?,
        fingerprint: r.get(5)?,
        created_at_ms: r.get::<_, i64>(6)? as u64,
        expires_at_ms: r.get::<_, i64>(7)? as u64,
        interval_ms: r.get::<_, i64>(8)? as u64,
        last_poll_ms: r.get::<_, Option<i64>>(9)?.map(|v| v as u64),
        status,
        credential_id: r.get(11)?,
        executor_id: r.get(12)?,
    })
}

fn credential_row(r: &Row<'_>) -> Result<Credential, rusqlite::Error> {
    Ok(Credential {
        credential_id: r.get(0)?,
        executor_id: r.get(1)?,
        token_hash: hash_of(r.get(2)?)?,
        enrollment_id: r.get(3)?,
        workspace: r.get(4)?,
        display_name: r.get(5)?,
        created_at_ms: r.get::<_, i64>(6)? as u64,
        revoked_at_ms: r.get::<_, Option<i64>>(7)?.map(|v| v as u64),
    })
}

const CREDENTIAL_COLUMNS: &str = "id, executor_id, token_hash, enrollment_id, workspace, \
    display_name, created_at_ms, revoked_at_ms";

fn put(conn: &Connection, e: &Enrollment) -> Result<(), rusqlite::Error> {
    conn.execute(
        &format!(
            "INSERT OR REPLACE INTO enrollments ({ENROLLMENT_COLUMNS}) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"
        ),
        params![
            e.id,
            &e.device_code_hash[..],
            e.user_code,
            e.workspace,
            e.display_name,
            e.fingerprint,
            e.created_at_ms as i64,
            e.expires_at_ms as i64,
            e.interval_ms as i64,
            e.last_poll_ms.map(|v| v as i64),
            e.status.as_str(),
            e.credential_id,
            e.executor_id,
        ],
    )?;
    Ok(())
}

impl Store for SqliteStore {
    fn put_enrollment(&self, e: &Enrollment) -> Result<(), StoreError> {
        Ok(put(&self.lock(), e)?)
    }

    fn count_pending(&self, now_ms: u64) -> Result<usize, StoreError> {
        let n: i64 = self.lock().query_row(
            "SELECT COUNT(*) FROM enrollments WHERE status = 'pending' AND expires_at_ms > ?1",
            params![now_ms as i64],
            |r| r.get(0),
        )?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    fn prune_enrollments(&self, before_ms: u64) -> Result<usize, StoreError> {
        Ok(self.lock().execute(
            "DELETE FROM enrollments \
             WHERE status IN ('pending', 'expired', 'denied') AND expires_at_ms < ?1",
            params![before_ms as i64],
        )?)
    }

    fn enrollment_by_device_hash(&self, hash: &[u8; 32]) -> Result<Option<Enrollment>, StoreError> {
        Ok(self
            .lock()
            .query_row(
                &format!(
                    "SELECT {ENROLLMENT_COLUMNS} FROM enrollments WHERE device_code_hash = ?1"
                ),
                params![&hash[..]],
                enrollment_row,
            )
            .optional()?)
    }

    fn enrollment_by_user_code(&self, code: &str) -> Result<Option<Enrollment>, StoreError> {
        Ok(self
            .lock()
            .query_row(
                &format!("SELECT {ENROLLMENT_COLUMNS} FROM enrollments WHERE user_code = ?1"),
                params![code],
                enrollment_row,
            )
            .optional()?)
    }

    fn enrollments(&self, limit: usize) -> Result<Vec<Enrollment>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(&format!(
            "SELECT {ENROLLMENT_COLUMNS} FROM enrollments ORDER BY created_at_ms DESC, id LIMIT ?1"
        ))?;
        let rows = stmt.query_map(params![limit as i64], enrollment_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn issue(&self, e: &Enrollment, c: &Credential) -> Result<(), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        put(&tx, e)?;
        tx.execute(
            &format!(
                "INSERT INTO credentials ({CREDENTIAL_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
            ),
            params![
                c.credential_id,
                c.executor_id,
                &c.token_hash[..],
                c.enrollment_id,
                c.workspace,
                c.display_name,
                c.created_at_ms as i64,
                c.revoked_at_ms.map(|v| v as i64),
            ],
        )?;
        tx.commit()?;
        Ok(())
    }

    fn credentials(&self) -> Result<Vec<Credential>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(&format!(
            "SELECT {CREDENTIAL_COLUMNS} FROM credentials ORDER BY created_at_ms, id"
        ))?;
        let rows = stmt.query_map([], credential_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn revoke(&self, credential_id: &str, now_ms: u64) -> Result<Option<Credential>, StoreError> {
        let conn = self.lock();
        conn.execute(
            "UPDATE credentials SET revoked_at_ms = ?2 WHERE id = ?1 AND revoked_at_ms IS NULL",
            params![credential_id, now_ms as i64],
        )?;
        Ok(conn
            .query_row(
                &format!("SELECT {CREDENTIAL_COLUMNS} FROM credentials WHERE id = ?1"),
                params![credential_id],
                credential_row,
            )
            .optional()?)
    }
}

/// Reserve the next block of `n`: `(first, last)` token, strictly above
/// every block reserved before in this database (by any process).
fn reserve(tx: &rusqlite::Transaction<'_>, n: u64) -> Result<(u64, u64), StoreError> {
    let last: i64 = tx.query_row(
        "UPDATE fencing SET reserved = reserved + ?1 WHERE id = 1 RETURNING reserved",
        params![n as i64],
        |r| r.get(0),
    )?;
    let last =
        u64::try_from(last).map_err(|_| StoreError::Corrupt("negative fencing mark".into()))?;
    Ok((last - n + 1, last))
}

impl DurableBackend for SqliteStore {
    fn reserve_block(&self, n: u64) -> Result<(u64, u64), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let block = reserve(&tx, n)?;
        tx.commit()?;
        Ok(block)
    }

    fn session_tokens(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare("SELECT session_id, fencing_token FROM sessions")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
        let mut out = Vec::new();
        for row in rows {
            let (id, t) = row?;
            out.push((id, t as u64));
        }
        Ok(out)
    }

    fn load(&self) -> Result<(Vec<StoredSession>, Vec<StoredResult>), StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare("SELECT info, lease_expires_at_ms FROM sessions")?;
        let rows = stmt.query_map([], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, Option<i64>>(1)?))
        })?;
        let mut sessions = Vec::new();
        for row in rows {
            let (info, expires) = row?;
            let info: SessionInfo = serde_json::from_str(&info)?;
            sessions.push(StoredSession {
                info,
                lease_expires_at_ms: expires.map(|v| v as u64),
            });
        }
        let mut stmt = conn.prepare(
            "SELECT r.session_id, r.fencing_token, r.tool_call_id, r.result \
             FROM tool_results r JOIN sessions s \
               ON s.session_id = r.session_id AND s.fencing_token = r.fencing_token \
             ORDER BY r.seq",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
            ))
        })?;
        let mut results = Vec::new();
        for row in rows {
            let (session_id, token, tool_call_id, result) = row?;
            results.push(StoredResult {
                session_id,
                fencing_token: token as u64,
                tool_call_id,
                result: serde_json::from_str(&result)?,
            });
        }
        Ok((sessions, results))
    }

    fn commit(&self, c: &Commit<'_>) -> Result<Option<(u64, u64)>, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        for (id, row) in c.sessions {
            match row {
                Some(s) => {
                    let i = &s.info;
                    tx.execute(
                        "INSERT INTO sessions (session_id, executor_id, fencing_token, state, \
                         connection_id, lease_expires_at_ms, ended_reason, info) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
                         ON CONFLICT(session_id) DO UPDATE SET executor_id = excluded.executor_id, \
                         fencing_token = excluded.fencing_token, state = excluded.state, \
                         connection_id = excluded.connection_id, \
                         lease_expires_at_ms = excluded.lease_expires_at_ms, \
                         ended_reason = excluded.ended_reason, info = excluded.info",
                        params![
                            id,
                            i.executor_id,
                            i.fencing_token as i64,
                            state_name(i.state),
                            i.connection_id,
                            s.lease_expires_at_ms.map(|v| v as i64),
                            i.ended_reason,
                            serde_json::to_string(i)?,
                        ],
                    )?;
                }
                None => {
                    tx.execute("DELETE FROM sessions WHERE session_id = ?1", params![id])?;
                    tx.execute(
                        "DELETE FROM tool_results WHERE session_id = ?1",
                        params![id],
                    )?;
                    tx.execute(
                        "DELETE FROM session_events WHERE session_id = ?1",
                        params![id],
                    )?;
                }
            }
        }
        for r in c.results {
            tx.execute(
                "INSERT OR REPLACE INTO tool_results (session_id, fencing_token, tool_call_id, result) \
                 VALUES (?1, ?2, ?3, ?4)",
                params![
                    r.session_id,
                    r.fencing_token as i64,
                    r.tool_call_id,
                    serde_json::to_string(&r.result)?,
                ],
            )?;
            tx.execute(
                "DELETE FROM tool_results WHERE session_id = ?1 AND seq NOT IN \
                 (SELECT seq FROM tool_results WHERE session_id = ?1 ORDER BY seq DESC LIMIT ?2)",
                params![r.session_id, RESULTS_KEPT_PER_SESSION as i64],
            )?;
        }
        write_events(&tx, c)?;
        let block = match c.reserve {
            Some(n) => Some(reserve(&tx, n)?),
            None => None,
        };
        tx.commit()?;
        Ok(block)
    }

    fn events(&self, session_id: &str) -> Result<Vec<StoredEvent>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT sequence, fencing_token, json FROM session_events \
             WHERE session_id = ?1 ORDER BY sequence",
        )?;
        let rows = stmt.query_map(params![session_id], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, String>(2)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (sequence, token, json) = row?;
            out.push(StoredEvent {
                session_id: session_id.to_owned(),
                fencing_token: token as u64,
                sequence: sequence as u64,
                json: Arc::from(json),
            });
        }
        Ok(out)
    }
}

/// A batch's session events: clears, then inserts, then floors (the order
/// [`Commit`] documents).
fn write_events(tx: &rusqlite::Transaction<'_>, c: &Commit<'_>) -> Result<(), StoreError> {
    for id in c.cleared_events {
        tx.execute(
            "DELETE FROM session_events WHERE session_id = ?1",
            params![id],
        )?;
    }
    let mut insert = tx.prepare_cached(
        "INSERT OR REPLACE INTO session_events (session_id, sequence, fencing_token, json) \
         VALUES (?1, ?2, ?3, ?4)",
    )?;
    for e in c.events {
        insert.execute(params![
            e.session_id,
            big(e.sequence)?,
            big(e.fencing_token)?,
            &*e.json
        ])?;
    }
    for (id, floor) in c.event_floors {
        tx.execute(
            "DELETE FROM session_events WHERE session_id = ?1 AND sequence < ?2",
            params![id, big(*floor)?],
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enrollment(id: &str, code: &str, byte: u8) -> Enrollment {
        Enrollment::new(
            id.into(),
            [byte; 32],
            code.into(),
            "/ws".into(),
            "laptop".into(),
            "fp".into(),
            1_000,
            60_000,
            500,
        )
    }

    #[test]
    fn migrations_are_versioned_and_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let s = SqliteStore::open_dir(dir.path()).unwrap();
        assert_eq!(s.schema_version().unwrap(), MIGRATIONS.len() as i64);
        s.put_enrollment(&enrollment("e1", "AAAA-BBBB", 1)).unwrap();
        drop(s);
        // Reopening applies nothing twice and keeps the rows.
        let s = SqliteStore::open_dir(dir.path()).unwrap();
        assert_eq!(s.schema_version().unwrap(), MIGRATIONS.len() as i64);
        assert_eq!(s.enrollments(10).unwrap().len(), 1);
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("harness.db");
        let conn = Connection::open(&path).unwrap();
        conn.pragma_update(None, "user_version", 99).unwrap();
        drop(conn);
        assert!(matches!(
            SqliteStore::open(&path),
            Err(StoreError::TooNew { found: 99, .. })
        ));
    }

    #[test]
    fn enrollments_and_credentials_round_trip() {
        let s = SqliteStore::in_memory().unwrap();
        let mut e = enrollment("e1", "AAAA-BBBB", 7);
        s.put_enrollment(&e).unwrap();
        assert_eq!(
            s.enrollment_by_device_hash(&[7; 32]).unwrap(),
            Some(e.clone())
        );
        assert_eq!(
            s.enrollment_by_user_code("AAAA-BBBB").unwrap(),
            Some(e.clone())
        );
        assert_eq!(s.enrollment_by_user_code("ZZZZ-ZZZZ").unwrap(), None);
        e.approve(2_000, "cred-1".into(), "r-1".into()).unwrap();
        s.put_enrollment(&e).unwrap();
        let c = Credential {
            credential_id: "cred-1".into(),
            executor_id: "r-1".into(),
            token_hash: [9; 32],
            enrollment_id: "e1".into(),
            workspace: "/ws".into(),
            display_name: "laptop".into(),
            created_at_ms: 3_000,
            revoked_at_ms: None,
        };
        s.issue(&e, &c).unwrap();
        assert_eq!(s.credentials().unwrap(), vec![c.clone()]);
        // The same token hash twice is refused (and nothing half-written).
        let dup = Credential {
            credential_id: "cred-2".into(),
            executor_id: "r-2".into(),
            ..c.clone()
        };
        assert!(s.issue(&e, &dup).is_err());
        assert_eq!(s.credentials().unwrap().len(), 1);
        let revoked = s.revoke("cred-1", 4_000).unwrap().unwrap();
        assert_eq!(revoked.revoked_at_ms, Some(4_000));
        // Revoking again keeps the first time.
        assert_eq!(
            s.revoke("cred-1", 5_000).unwrap().unwrap().revoked_at_ms,
            Some(4_000)
        );
        assert_eq!(s.revoke("nope", 5_000).unwrap(), None);
    }
}

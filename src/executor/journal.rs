//! The executor's journal: what it owes the harness, on disk.
//!
//! A `tool.result` is the only copy of a call's outcome (the call runs at
//! most once), and `session.ended` / `session.event` are the harness's
//! only way to learn how a session went. The in-memory outboxes
//! ([`crate::executor::outbox`]) keep them across dropped connections; the
//! journal keeps them across the death of the executor process itself
//! (`kill -9`, OOM, a power cut): each is written here, and fsynced,
//! before it is first sent, and removed once the harness acknowledges it.
//! After a restart with the same work root the executor reads what is left,
//! resumes the sessions those entries belong to in its first register, and
//! delivers each entry again; the harness dedupes (`toolCallId`, sequence),
//! so the caller sees it exactly once.
//!
//! **Store.** SQLite (bundled, through `rusqlite`), chosen over `redb`
//! because the harness already links it (no new crate, one storage engine
//! to know), and because `synchronous=FULL` in WAL mode is a documented
//! fsync on every commit. One connection behind a mutex: writes are one
//! small row each and come from a handful of actors.
//!
//! **Bounds.** At most [`MAX_ENTRIES`] entries and [`MAX_BYTES`] of bodies.
//! Past either, a new entry is not journaled: it is still kept in memory
//! and delivered as before, but would not survive a crash. That is logged
//! (error) and counted (`bmx_executor_journal_overflows_total`).
//!
//! **Removal is not fsynced**: a removal lost in a crash only makes the
//! entry be delivered once more, which the harness acknowledges without
//! delivering twice.

use crate::wire::Method;
use rusqlite::{params, Connection, OptionalExtension};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Mutex;

/// The journal's file name under the work root.
pub const FILE: &str = "journal.db";
/// Entries kept at most (past it: memory only, logged).
pub const MAX_ENTRIES: u64 = 65_536;
/// Body bytes kept at most (past it: memory only, logged).
pub const MAX_BYTES: u64 = 256 << 20;
/// `session.ended` reason of a session the executor lost by dying: it
/// came back from its journal to deliver what it owed, and ends it.
pub const EXECUTOR_RESTARTED: &str = "executor_restarted";

/// The methods whose requests are journaled.
pub const JOURNALED: [Method; 3] = [
    Method::ToolResult,
    Method::SessionEnded,
    Method::SessionEvent,
];

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("journal: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("journal: cannot encode the entry: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("journal full: {entries} entries, {bytes} bytes (caps {MAX_ENTRIES}, {MAX_BYTES})")]
    Full { entries: u64, bytes: u64 },
    #[error("journal: the lock is poisoned")]
    Poisoned,
    /// Another live executor holds this journal (two daemons on one work
    /// root): this one runs without.
    #[error("journal {0}: held by another executor")]
    Held(std::path::PathBuf),
    #[error("journal: {0}")]
    Io(#[from] std::io::Error),
}

/// One journaled request, as read back at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub method: Method,
    pub session_id: String,
    /// The `toolCallId`, the event's sequence (20 digits), or empty.
    pub key: String,
    /// The request's params, JSON.
    pub body: Vec<u8>,
}

/// What a previous run of this work root left.
#[derive(Debug, Clone, Default)]
pub struct Previous {
    /// The executor id and connection id of its last register: the first
    /// register of this run resumes from them.
    pub executor_id: Option<String>,
    pub connection_id: Option<String>,
    /// Its process tag prefix (`Shared::instance`) and pid: what it left
    /// running can be found and killed.
    pub instance: Option<String>,
    pub pid: Option<i32>,
}

struct Inner {
    conn: Connection,
    entries: u64,
    bytes: u64,
}

pub struct Journal {
    inner: Mutex<Inner>,
    max_entries: u64,
    max_bytes: u64,
    recovered: Mutex<Vec<Entry>>,
    /// Sessions of a previous run still being delivered: listed in
    /// `resume.activeSessions` until their `session.ended` is acknowledged.
    recovering: Mutex<BTreeSet<String>>,
    previous: Previous,
    /// `<journal>.lock`, `flock`ed for as long as this journal is open.
    _lock: nix::fcntl::Flock<std::fs::File>,
    /// Entries that could not be journaled (caps, disk errors), for
    /// `bmx_executor_journal_overflows_total`.
    pub overflows: prometheus_client::metrics::counter::Counter,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Journal")
    }
}

/// Mode 0600.
fn private(path: &std::ffi::OsStr) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

impl Journal {
    /// Open (creating) the journal at `path`, read what a previous run
    /// left, and record this run's `instance` and pid.
    pub fn open(path: &Path, instance: &str) -> Result<Journal, JournalError> {
        Self::open_with(path, instance, MAX_ENTRIES, MAX_BYTES)
    }

    pub fn open_with(
        path: &Path,
        instance: &str,
        max_entries: u64,
        max_bytes: u64,
    ) -> Result<Journal, JournalError> {
        let mut lock_path = path.as_os_str().to_owned();
        lock_path.push(".lock");
        let lock_file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)?;
        let lock = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|_| JournalError::Held(path.to_owned()))?;
        {
            use std::os::unix::fs::OpenOptionsExt;
            // Made here, 0600, so SQLite never creates it with the umask's.
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(path)?;
        }
        let conn = Connection::open(path)?;
        // The executor's alone (tool results of every session): 0600, set
        // before the WAL exists, which SQLite then creates with the same
        // mode. Under `--run-as` the work root is traversable by the
        // session user, so this is what keeps it out.
        private(&lock_path)?;
        private(path.as_os_str())?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        for suffix in ["-wal", "-shm"] {
            let mut p = path.as_os_str().to_owned();
            p.push(suffix);
            if std::path::Path::new(&p).exists() {
                private(&p)?;
            }
        }
        // FULL: every commit is fsynced before it returns.
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS entries (
                method TEXT NOT NULL,
                session_id TEXT NOT NULL,
                key TEXT NOT NULL,
                body BLOB NOT NULL,
                PRIMARY KEY (method, session_id, key)
            ) WITHOUT ROWID;
            CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);",
        )?;
        let mut recovered = Vec::new();
        {
            let mut st = conn.prepare(
                "SELECT method, session_id, key, body FROM entries \
                 ORDER BY session_id, method, key",
            )?;
            let rows = st.query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, Vec<u8>>(3)?,
                ))
            })?;
            for row in rows {
                let (method, session_id, key, body) = row?;
                match Method::from_name(&method).filter(|m| JOURNALED.contains(m)) {
                    Some(method) => recovered.push(Entry {
                        method,
                        session_id,
                        key,
                        body,
                    }),
                    None => {
                        tracing::warn!(%method, "journal: an entry of an unknown method; ignored")
                    }
                }
            }
        }
        let meta = |k: &str| -> Result<Option<String>, rusqlite::Error> {
            conn.query_row("SELECT v FROM meta WHERE k = ?1", [k], |r| r.get(0))
                .optional()
        };
        let previous = Previous {
            executor_id: meta("executor_id")?,
            connection_id: meta("connection_id")?,
            instance: meta("instance")?,
            pid: meta("pid")?.and_then(|p| p.parse().ok()),
        };
        let entries = recovered.len() as u64;
        let bytes = recovered.iter().map(|e| e.body.len() as u64).sum();
        let journal = Journal {
            inner: Mutex::new(Inner {
                conn,
                entries,
                bytes,
            }),
            max_entries,
            max_bytes,
            recovered: Mutex::new(recovered),
            recovering: Mutex::new(BTreeSet::new()),
            previous,
            _lock: lock,
            overflows: Default::default(),
        };
        journal.set_meta(&[
            ("instance", instance),
            ("pid", &std::process::id().to_string()),
        ])?;
        Ok(journal)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>, JournalError> {
        self.inner.lock().map_err(|_| JournalError::Poisoned)
    }

    /// Write `params` under (`method`, `session_id`, `key`), replacing an
    /// entry with that key, and fsync. Past the caps: [`JournalError::Full`].
    pub fn put<V: serde::Serialize>(
        &self,
        method: Method,
        session_id: &str,
        key: &str,
        params: &V,
    ) -> Result<(), JournalError> {
        let body = serde_json::to_vec(params)?;
        let mut g = self.lock()?;
        let old: Option<i64> = g
            .conn
            .query_row(
                "SELECT length(body) FROM entries WHERE method = ?1 AND session_id = ?2 AND key = ?3",
                params![method.as_str(), session_id, key],
                |r| r.get(0),
            )
            .optional()?;
        let (entries, bytes) = match old {
            Some(n) => (g.entries, g.bytes - (n as u64).min(g.bytes)),
            None => (g.entries + 1, g.bytes),
        };
        let bytes = bytes + body.len() as u64;
        if entries > self.max_entries || bytes > self.max_bytes {
            return Err(JournalError::Full {
                entries: g.entries,
                bytes: g.bytes,
            });
        }
        g.conn.execute(
            "INSERT OR REPLACE INTO entries (method, session_id, key, body) VALUES (?1, ?2, ?3, ?4)",
            params![method.as_str(), session_id, key, body],
        )?;
        g.entries = entries;
        g.bytes = bytes;
        Ok(())
    }

    /// Forget an entry (the harness acknowledged it). Not fsynced.
    pub fn remove(&self, method: Method, session_id: &str, key: &str) -> Result<(), JournalError> {
        self.remove_where(
            "DELETE FROM entries WHERE method = ?1 AND session_id = ?2 AND key = ?3 \
             RETURNING length(body)",
            params![method.as_str(), session_id, key],
        )
    }

    /// Forget every entry of `method` for `session_id` (the session gave
    /// up on them as it ended).
    pub fn remove_session(&self, method: Method, session_id: &str) -> Result<(), JournalError> {
        self.remove_where(
            "DELETE FROM entries WHERE method = ?1 AND session_id = ?2 RETURNING length(body)",
            params![method.as_str(), session_id],
        )
    }

    fn remove_where(&self, sql: &str, p: &[&dyn rusqlite::ToSql]) -> Result<(), JournalError> {
        let mut g = self.lock()?;
        // A lost removal costs one more delivery, which the harness
        // dedupes: no fsync for it.
        g.conn.pragma_update(None, "synchronous", "NORMAL")?;
        let removed = delete_returning(&g.conn, sql, p);
        g.conn.pragma_update(None, "synchronous", "FULL")?;
        let removed = removed?;
        g.entries = g.entries.saturating_sub(removed.len() as u64);
        g.bytes = g
            .bytes
            .saturating_sub(removed.iter().map(|n| *n as u64).sum());
        Ok(())
    }

    /// Entries and body bytes kept now.
    pub fn usage(&self) -> (u64, u64) {
        self.lock().map(|g| (g.entries, g.bytes)).unwrap_or((0, 0))
    }

    /// What the previous run of this work root left (entries aside).
    pub fn previous(&self) -> &Previous {
        &self.previous
    }

    /// The entries found at open, once (the next call gets none).
    pub fn take_recovered(&self) -> Vec<Entry> {
        self.recovered
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default()
    }

    pub fn set_recovering(&self, sessions: BTreeSet<String>) {
        if let Ok(mut r) = self.recovering.lock() {
            *r = sessions;
        }
    }

    /// A recovered session is done (its `session.ended` was acknowledged).
    pub fn recovered_session_done(&self, session_id: &str) {
        if let Ok(mut r) = self.recovering.lock() {
            r.remove(session_id);
        }
    }

    /// Sessions of a previous run still being delivered.
    pub fn recovering(&self) -> Vec<String> {
        self.recovering
            .lock()
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Record `pairs` in the meta table (one fsynced transaction).
    pub fn set_meta(&self, pairs: &[(&str, &str)]) -> Result<(), JournalError> {
        let mut g = self.lock()?;
        let tx = g.conn.transaction()?;
        for (k, v) in pairs {
            tx.execute(
                "INSERT OR REPLACE INTO meta (k, v) VALUES (?1, ?2)",
                params![k, v],
            )?;
        }
        tx.commit()?;
        Ok(())
    }
}

/// Run a `DELETE … RETURNING length(body)`: the removed bodies' sizes.
fn delete_returning(
    conn: &Connection,
    sql: &str,
    p: &[&dyn rusqlite::ToSql],
) -> Result<Vec<i64>, rusqlite::Error> {
    let mut st = conn.prepare_cached(sql)?;
    let rows = st.query_map(p, |r| r.get::<_, i64>(0))?;
    rows.collect()
}

/// The key of a `session.event` entry: its sequence, zero-padded so the
/// keys sort as the numbers do.
pub fn sequence_key(sequence: u64) -> String {
    format!("{sequence:020}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn entries_survive_a_reopen_and_removals_stick() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        {
            let j = Journal::open(&path, "inst-a").unwrap();
            assert!(j.take_recovered().is_empty());
            j.put(Method::ToolResult, "s1", "t1", &json!({"a": 1}))
                .unwrap();
            j.put(Method::ToolResult, "s1", "t2", &json!({"a": 2}))
                .unwrap();
            j.put(Method::SessionEnded, "s1", "", &json!({"r": "x"}))
                .unwrap();
            j.remove(Method::ToolResult, "s1", "t1").unwrap();
            j.set_meta(&[("executor_id", "e1"), ("connection_id", "c1")])
                .unwrap();
            assert_eq!(j.usage().0, 2);
        }
        let j = Journal::open(&path, "inst-b").unwrap();
        let got = j.take_recovered();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got
            .iter()
            .any(|e| e.method == Method::ToolResult && e.key == "t2" && e.body == br#"{"a":2}"#));
        assert!(got.iter().any(|e| e.method == Method::SessionEnded));
        assert!(j.take_recovered().is_empty(), "taken once");
        assert_eq!(j.previous().executor_id.as_deref(), Some("e1"));
        assert_eq!(j.previous().instance.as_deref(), Some("inst-a"));
        assert_eq!(j.previous().pid, Some(std::process::id() as i32));
        j.remove_session(Method::ToolResult, "s1").unwrap();
        assert_eq!(j.usage().0, 1);
    }

    #[test]
    fn one_executor_per_journal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        let first = Journal::open(&path, "a").unwrap();
        assert!(matches!(
            Journal::open(&path, "b"),
            Err(JournalError::Held(_))
        ));
        drop(first);
        Journal::open(&path, "c").unwrap();
    }

    #[test]
    fn the_caps_hold_and_a_replacement_fits() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open_with(&dir.path().join(FILE), "i", 2, 1000).unwrap();
        j.put(Method::ToolResult, "s", "a", &"x").unwrap();
        j.put(Method::ToolResult, "s", "b", &"x").unwrap();
        j.put(Method::ToolResult, "s", "b", &"y").unwrap();
        assert!(matches!(
            j.put(Method::ToolResult, "s", "c", &"x"),
            Err(JournalError::Full { entries: 2, .. })
        ));
        j.remove(Method::ToolResult, "s", "a").unwrap();
        j.put(Method::ToolResult, "s", "c", &"x").unwrap();
        let big = "z".repeat(2000);
        assert!(matches!(
            j.put(Method::ToolResult, "s", "d", &big),
            Err(JournalError::Full { .. })
        ));
        assert_eq!(j.usage(), (2, 6));
    }
}

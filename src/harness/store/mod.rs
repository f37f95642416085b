//! What the harness keeps across restarts: device enrollments and the
//! executor credentials they issued (docs/runner.md), and, through
//! [`DurableState`], fencing counters, sessions and acknowledged tool
//! results (docs/store.md).
//!
//! Behind a trait so a harness over a shared database puts PostgreSQL
//! ([`postgres::PgStore`]) behind the same calls; the default is embedded SQLite ([`sqlite::SqliteStore`]):
//! no server to run, one file in the data directory, and bundled so every
//! machine gets the same engine. Secrets are never stored: device codes
//! and tokens are kept as SHA-256 hashes, and the token itself only exists
//! in the one poll answer that hands it out.
//!
//! Calls block (a disk write); async callers run them on the blocking
//! pool (`tokio::task::spawn_blocking`).

pub mod durable;
pub mod pg_replicas;
pub mod pg_tls;
pub mod postgres;
pub mod sqlite;

use crate::harness::enroll::Enrollment;
use serde::Serialize;

pub use self::pg_replicas::PgReplicas;
pub use self::postgres::PgStore;
pub use durable::{Commit, DurableBackend, DurableState, StoredEvent};
pub use sqlite::SqliteStore;

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// PostgreSQL's errors never hold the connection URL. Shown with
    /// their causes: the client's own message is often only "error
    /// performing TLS handshake", the cause says which certificate check
    /// failed.
    #[error("store: {}", with_causes(.0))]
    Postgres(#[from] ::postgres::Error),
    #[error("store: {0}")]
    Io(#[from] std::io::Error),
    #[error("store: the database is at schema version {found}, newer than this bmx ({known})")]
    TooNew { found: i64, known: i64 },
    #[error("store: corrupt row: {0}")]
    Corrupt(String),
    #[error("store: {0}")]
    Json(#[from] serde_json::Error),
    /// A write did not become durable in time, or the writer stopped.
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// A `u64` as the databases' signed 64-bit integer (SQLite's `INTEGER`,
/// PostgreSQL's `BIGINT`): past `i64::MAX` is refused, never wrapped.
pub(crate) fn big(v: u64) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| StoreError::Corrupt(format!("{v} does not fit a BIGINT")))
}

/// `e: cause: cause…`, each cause once (a client error often repeats its
/// source's text).
fn with_causes(e: &::postgres::Error) -> String {
    let mut out = e.to_string();
    let mut next = std::error::Error::source(e);
    // A bound on a chain a library builds: a cycle must not hang a log.
    for _ in 0..8 {
        let Some(cause) = next else { break };
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = cause.source();
    }
    out
}

/// An issued executor credential (never the token, only its hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Credential {
    pub credential_id: String,
    pub executor_id: String,
    #[serde(skip)]
    pub token_hash: [u8; 32],
    pub enrollment_id: String,
    pub workspace: String,
    pub display_name: String,
    pub created_at_ms: u64,
    pub revoked_at_ms: Option<u64>,
}

/// Enrollments and credentials.
pub trait Store: Send + Sync {
    /// Insert or replace an enrollment (by id).
    fn put_enrollment(&self, e: &Enrollment) -> Result<(), StoreError>;
    fn enrollment_by_device_hash(&self, hash: &[u8; 32]) -> Result<Option<Enrollment>, StoreError>;
    fn enrollment_by_user_code(&self, code: &str) -> Result<Option<Enrollment>, StoreError>;
    /// All enrollments, newest first, at most `limit`.
    fn enrollments(&self, limit: usize) -> Result<Vec<Enrollment>, StoreError>;
    /// Save the enrollment and insert the credential in one transaction:
    /// the token is handed out only if both are durable.
    fn issue(&self, e: &Enrollment, c: &Credential) -> Result<(), StoreError>;
    fn credentials(&self) -> Result<Vec<Credential>, StoreError>;
    /// Mark revoked; `None` if there is no such credential.
    fn revoke(&self, credential_id: &str, now_ms: u64) -> Result<Option<Credential>, StoreError>;
    /// Enrollments still waiting for an operator at `now_ms` (pending and
    /// unexpired): what the cap on pending enrollments counts.
    fn count_pending(&self, now_ms: u64) -> Result<usize, StoreError>;
    /// Delete enrollments that ended without a credential (pending past
    /// expiry, expired, denied) and expired before `before_ms`; returns how
    /// many. Approved and consumed ones stay: credentials name them.
    fn prune_enrollments(&self, before_ms: u64) -> Result<usize, StoreError>;
}

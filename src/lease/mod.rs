//! Session leases and fencing for the executor protocol, as sans-IO state
//! machines.
//!
//! Nothing in here performs I/O, reads a clock or draws randomness: every
//! method that depends on time takes `now` (milliseconds on a monotonic
//! clock) from the caller. That keeps the protocol rules testable by
//! replaying exact sequences of events (see `tests/misc/lease_model.rs`), and lets
//! the harness actor own the sockets and the timer.
//!
//! * [`LeaseTable`] is the harness side: which connection is live for which
//!   executor, which connection holds which session's lease, and when
//!   silent connections and orphaned leases must be reaped.
//! * [`SessionFence`] and [`LeaseClock`] are the executor side: refusing
//!   stale assignments by fencing token, and knowing how long local sessions
//!   may keep running while the connection to the harness is down.
//! * [`SessionViews`], [`ToolResults`] and [`EventSequencer`] are the rest
//!   of the harness's session rules: the lifecycle the platform sees,
//!   exactly-once `tool.result` delivery, and `session.event` sequencing.
//! * [`LeaseStore`] holds the per-session fencing counter, behind a trait so
//!   a platform can persist it across harness restarts.
//!
//! `docs/leases.md` describes the state machines and their invariants.

pub mod events;
mod fence;
pub mod session_view;
mod store;
mod table;
pub mod tool_results;

pub use self::events::{EventDecision, EventSequencer};
pub use self::fence::{AssignDecision, LeaseClock, SessionFence};
pub use self::session_view::{SessionState, SessionViews, StopStart, ViewEffect};
pub use self::store::{LeaseStore, MemoryLeaseStore};
pub use self::table::{Grant, LeaseTable, LeaseView, Registered, RestoredLease, Tick};
pub use self::tool_results::{Delivery, Lookup, ToolResults};

use serde::{Deserialize, Serialize};
use std::fmt;

/// Identifies one WebSocket connection as minted by the harness.
///
/// A connection is distinct from the executor principal (`executor_id`):
/// one executor may come back over many connections over time, and leases
/// are held by a connection so that frames arriving on a replaced or lost
/// socket can be refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ConnId(pub u64);

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "conn-{}", self.0)
    }
}

/// Why a lease operation was refused.
///
/// The variants carry only what the caller does not already know (the
/// caller passed the session and connection), so they stay cheap to compare
/// in tests and to map onto protocol error codes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LeaseError {
    /// No lease exists for the session: it was never assigned, or it ended.
    #[error("no lease exists for this session")]
    UnknownSession,
    /// The session is leased, but not to this connection (or its holder
    /// connection is gone and the lease is waiting to be resumed).
    #[error("this connection does not hold the session's current lease")]
    NotHolder,
    /// The lease's clock ran out; `tick` will report it as expired.
    #[error("the session's lease has expired")]
    Expired,
    /// The executor has no live connection to lease the session to.
    #[error("the executor has no live connection")]
    NoLiveConnection,
    /// Another executor holds the session over a live connection.
    #[error("the session is leased to executor {holder} over a live connection")]
    AlreadyLeased {
        /// The executor currently holding the lease.
        holder: String,
    },
    /// The [`LeaseStore`] could not issue a fencing token without risking
    /// reuse (its durable reservation is being extended); retry.
    #[error("no fencing token can be issued right now; retry")]
    StoreUnavailable,
}

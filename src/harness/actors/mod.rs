//! The harness's actors (docs/architecture.md: "harness root").
//!
//! ```text
//! harness root (supervisor)
//! ├── leases           the lease table, the executors registry (4004 rule),
//! │                    the platform's view of sessions, tool-call waiters,
//! │                    the 4008 / lease-expiry timer
//! ├── mcp              dynamic supervisor
//! │   └── <session>/<serverKey>  temporary, one per MCP channel: client
//! │                    sessions, id map, progress routing, tool list
//! ├── turns            dynamic supervisor
//! │   └── <session>    temporary, one per session's agent stream: the
//! │                    event log and its subscribers, interactions
//! └── connections      dynamic supervisor
//!     └── connection <n>  temporary, one per executor connection: register,
//!                      heartbeat, token refresh; forwards session frames
//! ```
//!
//! `leases` is permanent and rebuilds its state on restart (see
//! [`root`]); a failed connection is not restarted, its socket is closed
//! so the executor reconnects.

pub mod connection;
pub mod leases;
pub mod mcp;
pub mod mcp_service;
pub mod root;
pub mod turns;

use crate::harness::error::ApiError;
use crate::supervisor::{start_actor, ChildSpec, DynamicMsg, StartChildError};
use crate::wire::RpcError;
use ractor::{ActorRef, ActorStatus};
use std::time::Duration;

/// Whether an actor still takes messages.
pub(crate) fn alive<M: ractor::Message>(a: &ActorRef<M>) -> bool {
    !matches!(a.get_status(), ActorStatus::Stopping | ActorStatus::Stopped)
}

/// The live actor `live` finds (one per key of a registry in `Shared`,
/// which each actor fills in itself), or one started now under `sup` from
/// `spec`. Callers racing to start the same key: the losers wait for the
/// winner's entry (at most 200 tries, 5 ms apart). `what` and `reason`
/// name the limit in the 429 a full supervisor gets.
pub(crate) async fn get_or_start<M: ractor::Message>(
    live: impl Fn() -> Option<ActorRef<M>>,
    sup: impl Fn() -> Option<ActorRef<DynamicMsg>>,
    spec: impl Fn() -> ChildSpec,
    what: &str,
    reason: &str,
) -> Result<ActorRef<M>, ApiError> {
    for _ in 0..200 {
        if let Some(a) = live() {
            return Ok(a);
        }
        let Some(sup) = sup() else {
            return Err(ApiError::with_status(
                503,
                RpcError::internal("the harness is shutting down").with_reason("shutting_down"),
            ));
        };
        match start_actor::<M>(&sup, spec().shutdown_timeout(Duration::from_secs(2))).await {
            Ok(a) => return Ok(a),
            // Another caller is starting it (or its predecessor is still
            // stopping): its entry appears shortly.
            Err(StartChildError::AlreadyStarted(_)) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(StartChildError::MaxChildren(n)) => {
                return Err(ApiError::rpc(
                    RpcError::resource_unavailable(format!(
                        "the harness serves at most {n} {what}"
                    ))
                    .with_reason(reason),
                ))
            }
            Err(e) => return Err(ApiError::internal(e.to_string())),
        }
    }
    Err(ApiError::internal(format!(
        "the {what} actor did not start"
    )))
}

/// One timer for the next deadline of an actor's sans-IO core (times in ms
/// on the core's clock): armed for the earliest deadline, never twice, and
/// moved earlier when a sooner one comes. A tick that finds nothing due
/// just re-arms.
pub(crate) struct DeadlineTimer<M: ractor::Message> {
    /// The deadline armed for and the timer task that sends the tick.
    armed: Option<(u64, TimerTask<M>)>,
}

type TimerTask<M> = tokio::task::JoinHandle<Result<(), ractor::MessagingErr<M>>>;

impl<M: ractor::Message> Default for DeadlineTimer<M> {
    fn default() -> Self {
        DeadlineTimer { armed: None }
    }
}

impl<M: ractor::Message> DeadlineTimer<M> {
    /// Disarm (the actor stops).
    pub(crate) fn cancel(&mut self) {
        if let Some((_, handle)) = self.armed.take() {
            handle.abort();
        }
    }

    /// The tick arrived: the timer is spent, whether or not its task has
    /// been seen to finish yet (it sends the tick, then ends), so the next
    /// [`arm`](Self::arm) arms afresh.
    pub(crate) fn fired(&mut self) {
        self.armed = None;
    }

    /// Whether a tick is still to come.
    pub(crate) fn is_armed(&self) -> bool {
        self.armed.as_ref().is_some_and(|(_, h)| !h.is_finished())
    }

    pub(crate) fn arm(
        &mut self,
        myself: &ActorRef<M>,
        deadline: Option<u64>,
        now: u64,
        tick: fn() -> M,
    ) {
        let Some(deadline) = deadline else { return };
        if let Some((armed, handle)) = &self.armed {
            if *armed <= deadline && !handle.is_finished() {
                return;
            }
        }
        if let Some((_, handle)) = self.armed.take() {
            handle.abort();
        }
        let wait = deadline.saturating_sub(now);
        let handle = myself.send_after(Duration::from_millis(wait + 1), tick);
        self.armed = Some((deadline, handle));
    }
}

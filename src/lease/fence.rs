//! The executor side: fencing stale assignments, and knowing how long local
//! sessions may outlive a lost connection.
//!
//! The harness is the authority on leases, but an executor cut off from it
//! must still decide on its own when to stop running a session (the harness
//! will have given it away), and must ignore an assignment that arrives late
//! after a newer one. Both decisions are made here, without I/O.

use serde::{Deserialize, Serialize};

/// What the executor should do with a `session.assign` for a session it
/// already knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum AssignDecision {
    /// Same fencing token as the current grant: a duplicate or a resumed
    /// lease. Nothing changes.
    Idempotent,
    /// A newer grant: adopt it, replacing the one with token `previous`.
    Renewed {
        /// The fencing token that was current before.
        previous: u64,
    },
    /// An older grant arriving late: refuse it, the current one stands.
    Stale {
        /// The current (highest) fencing token.
        highest: u64,
    },
}

/// Per-session fence on the executor: remembers the highest fencing token
/// seen, so that only newer grants are adopted.
///
/// The fence never goes backwards; that is the whole point: once an executor
/// has seen token `n`, a message carrying a token below `n` comes from a
/// grant the harness has already superseded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionFence {
    highest: u64,
    lease_token: String,
}

impl SessionFence {
    /// A fence for a session first assigned with these tokens.
    pub fn new(fencing_token: u64, lease_token: String) -> Self {
        Self {
            highest: fencing_token,
            lease_token,
        }
    }

    /// Decides on a later assignment of the same session.
    ///
    /// Equal tokens are [`AssignDecision::Idempotent`] and keep the stored
    /// lease token: the harness issues exactly one lease token per fencing
    /// token, so a different one with an equal fencing token cannot be a
    /// newer grant and must not displace the known one.
    pub fn on_assign(&mut self, fencing_token: u64, lease_token: &str) -> AssignDecision {
        use std::cmp::Ordering;
        match fencing_token.cmp(&self.highest) {
            Ordering::Greater => {
                let previous = self.highest;
                self.highest = fencing_token;
                lease_token.clone_into(&mut self.lease_token);
                AssignDecision::Renewed { previous }
            }
            Ordering::Equal => AssignDecision::Idempotent,
            Ordering::Less => AssignDecision::Stale {
                highest: self.highest,
            },
        }
    }

    /// The highest fencing token seen: the current grant's.
    pub fn highest(&self) -> u64 {
        self.highest
    }

    /// The current grant's lease token, to echo in session-scoped frames.
    pub fn lease_token(&self) -> &str {
        &self.lease_token
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum ClockState {
    /// Never registered: no lease can be held yet.
    Unregistered,
    /// Registered over a live connection; `last_ack` is the latest time the
    /// harness is known to have heard from us.
    Connected { last_ack: u64 },
    /// Connection lost; sessions may keep running until `expires_at`.
    Disconnected { expires_at: u64 },
}

/// The executor's view of its connection for lease purposes.
///
/// While disconnected, the executor keeps its sessions for `lease_ttl_ms`
/// since the last *acknowledged* heartbeat: an acknowledgement proves the
/// harness saw a frame, and the harness runs the same TTL from the last
/// frame it saw. A heartbeat that was sent but never acknowledged may have
/// been lost, so it does not extend anything.
///
/// `on_heartbeat_ack(now)` with the arrival time of the ack can run up to
/// one round trip longer than the harness; callers who want the executor to
/// stop strictly first may pass the time the acknowledged heartbeat was
/// sent instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseClock {
    ttl: u64,
    state: ClockState,
}

impl LeaseClock {
    /// A clock that has not registered yet; `lease_ttl_ms` is used until a
    /// registration tells the harness's own value.
    pub fn new(lease_ttl_ms: u64) -> Self {
        Self {
            ttl: lease_ttl_ms,
            state: ClockState::Unregistered,
        }
    }

    /// The harness acknowledged a heartbeat. Ignored while not connected (a
    /// late ack must not extend a clock that is already running), and never
    /// moves the last acknowledgement backwards.
    pub fn on_heartbeat_ack(&mut self, now: u64) {
        if let ClockState::Connected { last_ack } = &mut self.state {
            *last_ack = (*last_ack).max(now);
        }
    }

    /// The harness accepted our registration (which counts as an
    /// acknowledged frame) and told us its `lease_ttl_ms`, which from now on
    /// is the one that matters.
    pub fn on_registered(&mut self, now: u64, lease_ttl_ms: u64) {
        self.ttl = lease_ttl_ms;
        self.state = ClockState::Connected { last_ack: now };
    }

    /// The connection was lost: the clock runs from the last acknowledgement,
    /// not from `now`, since that is when the harness last heard from us.
    /// A second disconnect does not restart the clock.
    pub fn on_disconnect(&mut self, now: u64) {
        let _ = now;
        if let ClockState::Connected { last_ack } = self.state {
            self.state = ClockState::Disconnected {
                expires_at: last_ack.saturating_add(self.ttl),
            };
        }
    }

    /// Whether we are registered over a live connection.
    pub fn is_connected(&self) -> bool {
        matches!(self.state, ClockState::Connected { .. })
    }

    /// When local sessions must be stopped; `Some` only while disconnected.
    pub fn expires_at(&self) -> Option<u64> {
        match self.state {
            ClockState::Disconnected { expires_at } => Some(expires_at),
            _ => None,
        }
    }

    /// Whether local sessions must be stopped at `now`. Always true before the
    /// first registration (no lease can be held), never while connected (the
    /// harness enforces silence on its side and the socket will close).
    pub fn expired(&self, now: u64) -> bool {
        match self.state {
            ClockState::Unregistered => true,
            ClockState::Connected { .. } => false,
            ClockState::Disconnected { expires_at } => now >= expires_at,
        }
    }

    /// The TTL in force: the harness's once registered.
    pub fn lease_ttl_ms(&self) -> u64 {
        self.ttl
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_adopts_higher_ignores_equal_refuses_lower() {
        let mut f = SessionFence::new(3, "lease-s-3".into());
        assert_eq!(f.on_assign(3, "lease-s-3"), AssignDecision::Idempotent);
        assert_eq!(
            f.on_assign(5, "lease-s-5"),
            AssignDecision::Renewed { previous: 3 }
        );
        assert_eq!(
            f.on_assign(4, "lease-s-4"),
            AssignDecision::Stale { highest: 5 }
        );
        assert_eq!(f.on_assign(5, "other"), AssignDecision::Idempotent);
        assert_eq!(f.highest(), 5);
        assert_eq!(f.lease_token(), "lease-s-5");
    }

    #[test]
    fn clock_runs_from_last_ack_while_disconnected() {
        let mut c = LeaseClock::new(10);
        assert!(c.expired(0));
        assert!(!c.is_connected());
        c.on_registered(100, 1_000);
        assert!(c.is_connected());
        assert_eq!(c.expires_at(), None);
        assert!(!c.expired(1_000_000));
        c.on_heartbeat_ack(400);
        c.on_heartbeat_ack(300);
        c.on_disconnect(900);
        assert_eq!(c.expires_at(), Some(1_400));
        // Neither a late ack nor a second disconnect moves the deadline.
        c.on_heartbeat_ack(1_000);
        c.on_disconnect(1_100);
        assert_eq!(c.expires_at(), Some(1_400));
        assert!(!c.expired(1_399));
        assert!(c.expired(1_400));
        c.on_registered(2_000, 50);
        assert_eq!(c.lease_ttl_ms(), 50);
        c.on_disconnect(2_010);
        assert_eq!(c.expires_at(), Some(2_050));
    }

    #[test]
    fn disconnect_before_registering_changes_nothing() {
        let mut c = LeaseClock::new(10);
        c.on_heartbeat_ack(5);
        c.on_disconnect(5);
        assert_eq!(c.expires_at(), None);
        assert!(c.expired(0));
    }

    #[test]
    fn clock_saturates() {
        let mut c = LeaseClock::new(0);
        c.on_registered(u64::MAX - 1, u64::MAX);
        c.on_disconnect(u64::MAX);
        assert_eq!(c.expires_at(), Some(u64::MAX));
        assert!(!c.expired(u64::MAX - 1));
    }
}

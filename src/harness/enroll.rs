//! Device enrollment (RFC 8628 style), as a sans-IO state machine with an
//! explicit `now` (Unix milliseconds: enrollments outlive a harness
//! restart, so a monotonic clock would not do).
//!
//! ```text
//!            approve              poll (once)
//! pending ───────────▶ approved ─────────────▶ consumed
//!    │ deny                         (the poll that moves it is the only
//!    ├──────▶ denied                 one that carries a credential)
//!    │ now ≥ expires_at
//!    └──────▶ expired
//! ```
//!
//! A poll sooner than `interval_ms` after the previous accepted poll is
//! answered `slow_down` and changes nothing. Approving or denying anything
//! but a live pending enrollment is refused (a replayed approval cannot
//! issue a second credential). The HTTP layer (`http::enrollments`) only
//! loads, applies and saves.

use serde::Serialize;

/// Where an enrollment is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pending,
    Approved,
    Denied,
    Expired,
    Consumed,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Approved => "approved",
            Status::Denied => "denied",
            Status::Expired => "expired",
            Status::Consumed => "consumed",
        }
    }

    pub fn parse(s: &str) -> Option<Status> {
        Some(match s {
            "pending" => Status::Pending,
            "approved" => Status::Approved,
            "denied" => Status::Denied,
            "expired" => Status::Expired,
            "consumed" => Status::Consumed,
            _ => return None,
        })
    }
}

/// One enrollment, as stored (secrets only as hashes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrollment {
    pub id: String,
    pub device_code_hash: [u8; 32],
    pub user_code: String,
    pub workspace: String,
    pub display_name: String,
    pub fingerprint: String,
    pub created_at_ms: u64,
    pub expires_at_ms: u64,
    pub interval_ms: u64,
    /// Last poll that was not `slow_down`.
    pub last_poll_ms: Option<u64>,
    pub status: Status,
    /// Set at approval.
    pub credential_id: Option<String>,
    pub executor_id: Option<String>,
}

/// What a poll answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Poll {
    /// Too soon after the last poll: 429 `slow_down`; nothing changed.
    SlowDown,
    Pending,
    /// Approved, and this is the one poll that hands out the credential:
    /// the caller mints the token, stores its hash, and answers it.
    Issue {
        credential_id: String,
        executor_id: String,
    },
    Consumed,
    Denied,
    Expired,
}

/// Why an operator decision was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecisionError {
    #[error("the enrollment is {}, not pending", .0.as_str())]
    NotPending(Status),
}

impl Enrollment {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: String,
        device_code_hash: [u8; 32],
        user_code: String,
        workspace: String,
        display_name: String,
        fingerprint: String,
        now_ms: u64,
        ttl_ms: u64,
        interval_ms: u64,
    ) -> Enrollment {
        Enrollment {
            id,
            device_code_hash,
            user_code,
            workspace,
            display_name,
            fingerprint,
            created_at_ms: now_ms,
            expires_at_ms: now_ms.saturating_add(ttl_ms),
            interval_ms,
            last_poll_ms: None,
            status: Status::Pending,
            credential_id: None,
            executor_id: None,
        }
    }

    /// Move a pending enrollment past its deadline to `expired`.
    pub fn tick(&mut self, now_ms: u64) {
        if self.status == Status::Pending && now_ms >= self.expires_at_ms {
            self.status = Status::Expired;
        }
    }

    /// The status as of `now` (expiry applied).
    pub fn status_at(&self, now_ms: u64) -> Status {
        let mut e = self.clone();
        e.tick(now_ms);
        e.status
    }

    /// The device polls.
    pub fn poll(&mut self, now_ms: u64) -> Poll {
        self.tick(now_ms);
        if let Some(last) = self.last_poll_ms {
            if now_ms < last.saturating_add(self.interval_ms) && self.status == Status::Pending {
                return Poll::SlowDown;
            }
        }
        self.last_poll_ms = Some(now_ms);
        match self.status {
            Status::Pending => Poll::Pending,
            Status::Approved => match (&self.credential_id, &self.executor_id) {
                (Some(c), Some(x)) => {
                    let out = Poll::Issue {
                        credential_id: c.clone(),
                        executor_id: x.clone(),
                    };
                    self.status = Status::Consumed;
                    out
                }
                // Approved rows always carry both ids; a row without them
                // cannot issue anything.
                _ => Poll::Consumed,
            },
            Status::Consumed => Poll::Consumed,
            Status::Denied => Poll::Denied,
            Status::Expired => Poll::Expired,
        }
    }

    /// An operator approves; the ids are those the credential will have.
    ///
    /// # Errors
    ///
    /// [`DecisionError::NotPending`] unless pending and unexpired.
    pub fn approve(
        &mut self,
        now_ms: u64,
        credential_id: String,
        executor_id: String,
    ) -> Result<(), DecisionError> {
        self.tick(now_ms);
        if self.status != Status::Pending {
            return Err(DecisionError::NotPending(self.status));
        }
        self.status = Status::Approved;
        self.credential_id = Some(credential_id);
        self.executor_id = Some(executor_id);
        Ok(())
    }

    /// An operator denies.
    ///
    /// # Errors
    ///
    /// [`DecisionError::NotPending`] unless pending and unexpired.
    pub fn deny(&mut self, now_ms: u64) -> Result<(), DecisionError> {
        self.tick(now_ms);
        if self.status != Status::Pending {
            return Err(DecisionError::NotPending(self.status));
        }
        self.status = Status::Denied;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TTL: u64 = 10_000;
    const INTERVAL: u64 = 500;

    fn fresh() -> Enrollment {
        Enrollment::new(
            "e".into(),
            [0; 32],
            "AAAA-BBBB".into(),
            "/w".into(),
            "n".into(),
            "f".into(),
            0,
            TTL,
            INTERVAL,
        )
    }

    #[derive(Debug, Clone)]
    enum Op {
        Poll(u64),
        Approve(u64),
        Deny(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..2_000).prop_map(Op::Poll),
            1 => (0u64..2_000).prop_map(Op::Approve),
            1 => (0u64..2_000).prop_map(Op::Deny),
        ]
    }

    proptest! {
        /// Whatever the history: at most one poll carries a credential,
        /// exactly one if an approval was accepted and a later poll was
        /// let through; polls faster than the interval change nothing;
        /// nothing happens after expiry but `expired`; decisions only
        /// succeed on a live pending enrollment.
        #[test]
        fn one_credential_per_approval(ops in proptest::collection::vec(op(), 0..60)) {
            let mut e = fresh();
            let mut now = 0u64;
            let mut issued = 0;
            let mut approved = false;
            let mut accepted_poll_after_approval = false;
            for op in ops {
                let before = e.clone();
                match op {
                    Op::Poll(dt) => {
                        now += dt;
                        let r = e.poll(now);
                        match &r {
                            Poll::SlowDown => {
                                prop_assert_eq!(before.status_at(now), Status::Pending);
                                prop_assert!(now < before.last_poll_ms.unwrap() + INTERVAL);
                                let mut b = before.clone();
                                b.tick(now);
                                prop_assert_eq!(&e, &b);
                            }
                            Poll::Issue { credential_id, executor_id } => {
                                issued += 1;
                                prop_assert!(approved);
                                prop_assert_eq!(credential_id, "c");
                                prop_assert_eq!(executor_id, "x");
                                prop_assert_eq!(e.status, Status::Consumed);
                                accepted_poll_after_approval = true;
                            }
                            Poll::Consumed => prop_assert!(issued == 1),
                            Poll::Expired => prop_assert!(now >= TTL && !approved),
                            Poll::Denied => prop_assert!(!approved),
                            Poll::Pending => prop_assert!(now < TTL && !approved),
                        }
                    }
                    Op::Approve(dt) => {
                        now += dt;
                        let live = before.status_at(now) == Status::Pending;
                        let r = e.approve(now, "c".into(), "x".into());
                        prop_assert_eq!(r.is_ok(), live);
                        if r.is_ok() { approved = true; }
                    }
                    Op::Deny(dt) => {
                        now += dt;
                        let live = before.status_at(now) == Status::Pending;
                        prop_assert_eq!(e.deny(now).is_ok(), live);
                    }
                }
                prop_assert!(issued <= 1);
            }
            prop_assert_eq!(issued == 1, approved && accepted_poll_after_approval);
        }
    }

    #[test]
    fn the_happy_path_and_its_replays() {
        let mut e = fresh();
        assert_eq!(e.poll(0), Poll::Pending);
        assert_eq!(e.poll(100), Poll::SlowDown);
        assert_eq!(e.poll(INTERVAL), Poll::Pending);
        e.approve(600, "c".into(), "x".into()).unwrap();
        assert_eq!(
            e.approve(601, "c2".into(), "x2".into()),
            Err(DecisionError::NotPending(Status::Approved))
        );
        assert!(e.deny(602).is_err());
        // The issuing poll is let through even inside the interval.
        assert!(matches!(e.poll(700), Poll::Issue { .. }));
        assert_eq!(e.poll(701), Poll::Consumed);
    }

    #[test]
    fn expiry_and_denial_are_final() {
        let mut e = fresh();
        assert_eq!(e.poll(TTL), Poll::Expired);
        assert!(e.approve(TTL, "c".into(), "x".into()).is_err());
        let mut d = fresh();
        d.deny(1).unwrap();
        assert_eq!(d.poll(2), Poll::Denied);
        assert_eq!(d.poll(TTL + 1), Poll::Denied);
    }
}

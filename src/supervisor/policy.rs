//! Restart policy as plain state machines: which exits restart a child, the
//! restart-intensity window and the backoff delay. No clocks or I/O here:
//! callers pass `now` and a random number, so property tests can drive them.

use std::collections::VecDeque;
use std::time::Duration;

/// OTP restart types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    /// Always restarted (except after a final `shutdown` exit).
    Permanent,
    /// Restarted only after an abnormal exit.
    Transient,
    /// Never restarted.
    Temporary,
}

/// OTP restart strategies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// Only the exited child is restarted.
    #[default]
    OneForOne,
    /// All children are stopped and restarted.
    OneForAll,
    /// The exited child and every child started after it are restarted.
    RestForOne,
}

/// How a child ended, classified from ractor's supervision event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// Stopped with no reason or `"normal"`.
    Normal,
    /// Stopped with `"shutdown"` or `"shutdown:<why>"`: final, never
    /// restarted. Used for 4004, 4001 and 4003.
    Shutdown(String),
    /// Anything else: a panic, a handler error, a lost socket.
    Abnormal(String),
}

/// Prefix of a stop reason that makes an exit final.
pub const SHUTDOWN: &str = "shutdown";

impl Exit {
    /// Classify a ractor stop reason.
    pub fn from_reason(reason: Option<&str>) -> Exit {
        match reason {
            None | Some("normal") | Some("") => Exit::Normal,
            Some(r) if r == SHUTDOWN => Exit::Shutdown(String::new()),
            Some(r) => match r.strip_prefix("shutdown:") {
                Some(why) => Exit::Shutdown(why.to_owned()),
                None => Exit::Abnormal(r.to_owned()),
            },
        }
    }

    /// The stop reason that reproduces this exit one level up.
    pub fn to_reason(&self) -> Option<String> {
        match self {
            Exit::Normal => None,
            Exit::Shutdown(w) if w.is_empty() => Some(SHUTDOWN.to_owned()),
            Exit::Shutdown(w) => Some(format!("shutdown:{w}")),
            Exit::Abnormal(w) => Some(w.clone()),
        }
    }
}

impl Restart {
    /// Whether a child of this type is restarted after `exit`.
    pub fn restarts_after(self, exit: &Exit) -> bool {
        match (self, exit) {
            (_, Exit::Shutdown(_)) => false,
            (Restart::Permanent, _) => true,
            (Restart::Transient, Exit::Abnormal(_)) => true,
            (Restart::Transient, _) => false,
            (Restart::Temporary, _) => false,
        }
    }
}

/// Which children (by start order) a restart of child `idx` touches.
pub fn affected(strategy: Strategy, idx: usize, len: usize) -> std::ops::Range<usize> {
    match strategy {
        Strategy::OneForOne => idx..idx + 1,
        Strategy::OneForAll => 0..len,
        Strategy::RestForOne => idx..len,
    }
}

/// Restart intensity: at most `max_restarts` within `period`. OTP's default
/// is 1 restart in 5 s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Intensity {
    pub max_restarts: u32,
    pub period: Duration,
}

impl Default for Intensity {
    fn default() -> Self {
        Intensity {
            max_restarts: 1,
            period: Duration::from_secs(5),
        }
    }
}

/// The sliding window of recent restarts.
#[derive(Debug, Clone)]
pub struct RestartWindow {
    intensity: Intensity,
    restarts: VecDeque<Duration>,
}

impl RestartWindow {
    pub fn new(intensity: Intensity) -> Self {
        RestartWindow {
            intensity,
            restarts: VecDeque::new(),
        }
    }

    /// Record a restart at `now` (time since any fixed origin). Returns
    /// false when this restart would exceed the intensity: the supervisor
    /// must give up instead of restarting.
    pub fn allow(&mut self, now: Duration) -> bool {
        while let Some(&t) = self.restarts.front() {
            if now.saturating_sub(t) >= self.intensity.period {
                self.restarts.pop_front();
            } else {
                break;
            }
        }
        if self.restarts.len() as u32 >= self.intensity.max_restarts {
            return false;
        }
        self.restarts.push_back(now);
        true
    }

    /// Restarts counted in the current window.
    pub fn len(&self) -> usize {
        self.restarts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.restarts.is_empty()
    }
}

/// Exponential backoff with jitter (PROTOCOL.md §3.4):
/// `delay = min(max, min_delay × 2^attempt) × (0.5 + 0.5 × random)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub min: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            min: Duration::from_millis(250),
            max: Duration::from_secs(30),
        }
    }
}

impl Backoff {
    /// No delay at all (restart at once).
    pub const NONE: Backoff = Backoff {
        min: Duration::ZERO,
        max: Duration::ZERO,
    };

    /// The delay before restart number `attempt` (0-based); `random` is
    /// uniform in [0, 1]. The result lies in `[min/2, max]` and never
    /// exceeds `max`.
    pub fn delay(&self, attempt: u32, random: f64) -> Duration {
        let random = if random.is_finite() {
            random.clamp(0.0, 1.0)
        } else {
            1.0
        };
        let exp = 2u32.saturating_pow(attempt.min(32));
        let base = self.min.saturating_mul(exp).min(self.max);
        base.mul_f64(0.5 + 0.5 * random).min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert, prop_assert_eq, proptest, ProptestConfig};

    #[test]
    fn exit_reasons_classify() {
        assert_eq!(Exit::from_reason(None), Exit::Normal);
        assert_eq!(Exit::from_reason(Some("normal")), Exit::Normal);
        assert_eq!(
            Exit::from_reason(Some("shutdown")),
            Exit::Shutdown(String::new())
        );
        assert_eq!(
            Exit::from_reason(Some("shutdown:replaced")),
            Exit::Shutdown("replaced".into())
        );
        assert_eq!(
            Exit::from_reason(Some("lost")),
            Exit::Abnormal("lost".into())
        );
        for e in [
            Exit::Normal,
            Exit::Shutdown("x".into()),
            Exit::Abnormal("y".into()),
        ] {
            assert_eq!(Exit::from_reason(e.to_reason().as_deref()), e);
        }
    }

    #[test]
    fn restart_types_follow_otp() {
        let n = Exit::Normal;
        let a = Exit::Abnormal("boom".into());
        let s = Exit::Shutdown("replaced".into());
        assert!(Restart::Permanent.restarts_after(&n));
        assert!(Restart::Permanent.restarts_after(&a));
        assert!(!Restart::Permanent.restarts_after(&s));
        assert!(!Restart::Transient.restarts_after(&n));
        assert!(Restart::Transient.restarts_after(&a));
        assert!(!Restart::Transient.restarts_after(&s));
        assert!(!Restart::Temporary.restarts_after(&n));
        assert!(!Restart::Temporary.restarts_after(&a));
    }

    #[test]
    fn strategies_pick_children() {
        assert_eq!(affected(Strategy::OneForOne, 1, 4), 1..2);
        assert_eq!(affected(Strategy::OneForAll, 1, 4), 0..4);
        assert_eq!(affected(Strategy::RestForOne, 1, 4), 1..4);
    }

    #[test]
    fn otp_default_intensity_allows_one_in_five_seconds() {
        let mut w = RestartWindow::new(Intensity::default());
        assert!(w.allow(Duration::from_secs(0)));
        assert!(!w.allow(Duration::from_secs(1)));
        assert!(w.allow(Duration::from_secs(6)));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Never more than N restarts allowed inside any window of `period`.
        #[test]
        fn intensity_window_never_exceeded(
            max in 1u32..6,
            period_ms in 1u64..5_000,
            steps in proptest::collection::vec(0u64..3_000, 1..200),
        ) {
            let intensity = Intensity { max_restarts: max, period: Duration::from_millis(period_ms) };
            let mut w = RestartWindow::new(intensity);
            let mut now = 0u64;
            let mut allowed: Vec<u64> = Vec::new();
            for step in steps {
                now += step;
                let expected = allowed.iter().filter(|&&t| now - t < period_ms).count() < max as usize;
                let got = w.allow(Duration::from_millis(now));
                prop_assert_eq!(got, expected);
                if got { allowed.push(now); }
                let in_window = allowed.iter().filter(|&&t| now - t < period_ms).count();
                prop_assert!(in_window <= max as usize);
            }
        }

        /// The delay is always within [min/2, max] and never above max.
        #[test]
        fn backoff_within_bounds(
            min_ms in 0u64..10_000,
            extra_ms in 0u64..100_000,
            attempt in 0u32..200,
            random in proptest::num::f64::ANY,
        ) {
            let b = Backoff { min: Duration::from_millis(min_ms), max: Duration::from_millis(min_ms + extra_ms) };
            let d = b.delay(attempt, random);
            prop_assert!(d <= b.max);
            prop_assert!(d >= (b.min / 2).min(b.max / 2));
        }

        /// Without jitter (random = 1) the delay doubles until it reaches max.
        #[test]
        fn backoff_grows_monotonically(min_ms in 1u64..1_000, attempts in 1u32..40) {
            let b = Backoff { min: Duration::from_millis(min_ms), max: Duration::from_secs(30) };
            let mut last = Duration::ZERO;
            for a in 0..attempts {
                let d = b.delay(a, 1.0);
                prop_assert!(d >= last);
                last = d;
            }
        }
    }
}

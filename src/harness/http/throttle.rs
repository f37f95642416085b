//! Per-source limits on what an unauthenticated peer may do (issue 56,
//! item 4): how often one source may create or poll enrollments, and how
//! many failed credentials (API token, console login, executor token,
//! upload and download tickets) it may show before it must wait.
//!
//! The rules are a sans-IO core: [`Buckets`] (one token bucket per
//! [`Source`], bounded in the number of sources it remembers) and
//! [`Tally`] (what happened since the last summary, for one aggregate log
//! line instead of one line per failure). Both take an explicit `now`.
//! [`Throttles`] is the harness's set of them behind mutexes, reading the
//! clock.
//!
//! **A source** is the TCP peer's address, an IPv6 address by its /64 (one
//! host usually holds a whole /64, so per-address limits would not bind),
//! or [`Source::Local`] for the API's Unix socket. Behind a reverse proxy
//! every client is the proxy's address: the harness trusts no
//! `X-Forwarded-For`, so such clients share one budget.
//!
//! **Why refusing a blocked source outright.** While a source is out of
//! failure budget, every request of it that shows a credential is answered
//! 429 *without checking the credential*: checking it and letting a right
//! one through would tell the guesser which guess was right, at full
//! speed. The price: a client sharing an address with a guesser waits too.

pub use crate::harness::config::{Rate, SourceLimits};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Where a request came from, as the limits count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// An IPv4 address, or an IPv6 address with its last 64 bits cleared.
    Ip(IpAddr),
    /// The API's Unix socket (mode 0600: the harness's own user).
    Local,
}

impl Source {
    /// The source of a TCP peer at `ip`: IPv4 (also when mapped into
    /// IPv6) as it is, IPv6 by its /64.
    pub fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(_) => Source::Ip(ip),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source::Ip(IpAddr::V4(v4)),
                None => {
                    let bits = u128::from(v6) & !((1u128 << 64) - 1);
                    Source::Ip(IpAddr::V6(bits.into()))
                }
            },
        }
    }

    /// The key the enrollment book keeps pending enrollments under.
    pub fn key(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Ip(IpAddr::V6(a)) => write!(f, "{a}/64"),
            Source::Ip(a) => write!(f, "{a}"),
            Source::Local => f.write_str("local"),
        }
    }
}

impl Rate {
    /// How far ahead of `now` a bucket's theoretical arrival time may be
    /// while it still has a token: the burst, less the one being taken.
    fn tolerance(&self) -> Duration {
        self.every
            .saturating_mul(self.burst.max(1))
            .saturating_sub(self.every)
    }
}

/// One token bucket per source, as GCRA: per source, only the
/// theoretical arrival time (`tat`) of its next token. A source whose
/// `tat` is not after `now` has a full bucket, the same as a source never
/// seen, so it can be forgotten; that is how [`Buckets`] stays bounded.
#[derive(Debug, Clone)]
pub struct Buckets {
    rate: Rate,
    max_sources: usize,
    tat: HashMap<Source, Instant>,
}

impl Buckets {
    pub fn new(rate: Rate, max_sources: usize) -> Buckets {
        Buckets {
            rate,
            max_sources: max_sources.max(1),
            tat: HashMap::new(),
        }
    }

    /// Take one token for `source`: `Ok` if it had one, else how long
    /// until it has one again (nothing changes then).
    pub fn take(&mut self, source: Source, now: Instant) -> Result<(), Duration> {
        let tat = self.tat.get(&source).copied().unwrap_or(now).max(now);
        let allowed_at = tat
            .checked_sub(self.rate.tolerance())
            .unwrap_or(now)
            .max(now);
        if allowed_at > now {
            return Err(allowed_at - now);
        }
        if !self.tat.contains_key(&source) {
            self.make_room(now);
        }
        self.tat.insert(source, tat + self.rate.every);
        Ok(())
    }

    /// How long until `source` has a token, if it has none now.
    pub fn empty_for(&self, source: Source, now: Instant) -> Option<Duration> {
        let tat = *self.tat.get(&source)?;
        let allowed_at = tat.checked_sub(self.rate.tolerance())?;
        (allowed_at > now).then(|| allowed_at - now)
    }

    /// Sources remembered (those whose bucket is not full, at most
    /// `max_sources`).
    pub fn len(&self) -> usize {
        self.tat.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tat.is_empty()
    }

    /// Forget full buckets; at the bound, also the source closest to a
    /// full bucket (the least limited), so the most limited ones stay.
    fn make_room(&mut self, now: Instant) {
        if self.tat.len() < self.max_sources {
            return;
        }
        self.tat.retain(|_, tat| *tat > now);
        while self.tat.len() >= self.max_sources {
            let Some(least) = self.tat.iter().min_by_key(|(_, t)| **t).map(|(s, _)| *s) else {
                break;
            };
            self.tat.remove(&least);
        }
    }
}

/// What happened since the last summary, for one aggregate log line.
#[derive(Debug, Default)]
pub struct Tally {
    failed: u64,
    refused: u64,
    throttled: u64,
    sources: HashSet<Source>,
    /// The source with the most events, and its count.
    by_source: HashMap<Source, u64>,
}

/// Sources a [`Tally`] names at most per summary (the counts stay exact).
const TALLY_SOURCES: usize = 1024;

/// What a [`Tally`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A credential was shown and was wrong (401).
    Failed,
    /// A browser-page rule refused the request (403: cross origin, not a
    /// loopback host name).
    Refused,
    /// Answered 429 by a per-source limit.
    Throttled,
}

/// One summary: the counts since the previous one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub failed: u64,
    pub refused: u64,
    pub throttled: u64,
    pub sources: usize,
    /// The source with the most events.
    pub top: Option<(Source, u64)>,
}

impl Tally {
    /// Count one event of `source`; `true` when it is the first since the
    /// last summary (the caller logs that one at once, so a single typo
    /// is visible without waiting for the summary).
    pub fn record(&mut self, event: Event, source: Source) -> bool {
        let first = self.failed + self.refused + self.throttled == 0;
        match event {
            Event::Failed => self.failed += 1,
            Event::Refused => self.refused += 1,
            Event::Throttled => self.throttled += 1,
        }
        if self.sources.len() < TALLY_SOURCES || self.sources.contains(&source) {
            self.sources.insert(source);
            *self.by_source.entry(source).or_default() += 1;
        }
        first
    }

    /// The summary of what was counted, if anything, and a fresh start.
    pub fn take(&mut self) -> Option<Summary> {
        if self.failed + self.refused + self.throttled == 0 {
            return None;
        }
        let t = std::mem::take(self);
        Some(Summary {
            failed: t.failed,
            refused: t.refused,
            throttled: t.throttled,
            sources: t.sources.len(),
            top: t.by_source.into_iter().max_by_key(|(_, n)| *n),
        })
    }
}

/// The limits of one harness, shared by its requests.
pub(crate) struct Throttles {
    auth: Mutex<Buckets>,
    /// Sources remembered by `auth`: requests skip its lock while none is.
    auth_sources: AtomicUsize,
    create: Mutex<Buckets>,
    poll: Mutex<Buckets>,
    tally: Mutex<Tally>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Which per-source enrollment limit a request meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EnrollRoute {
    Create,
    Poll,
}

impl Throttles {
    pub(crate) fn new(limits: &SourceLimits) -> Throttles {
        Throttles {
            auth: Mutex::new(Buckets::new(limits.auth_failures, limits.max_sources)),
            auth_sources: AtomicUsize::new(0),
            create: Mutex::new(Buckets::new(limits.enroll_create, limits.max_sources)),
            poll: Mutex::new(Buckets::new(limits.enroll_poll, limits.max_sources)),
            tally: Mutex::new(Tally::default()),
        }
    }

    /// `Some(retry after)` while `source` has shown too many wrong
    /// credentials. Lock-free while no source has any failure on record.
    pub(crate) fn blocked(&self, source: Source) -> Option<Duration> {
        if self.auth_sources.load(Ordering::Relaxed) == 0 {
            return None;
        }
        lock(&self.auth).empty_for(source, Instant::now())
    }

    /// `source` showed a wrong credential.
    pub(crate) fn failed(&self, source: Source) {
        let mut b = lock(&self.auth);
        let _ = b.take(source, Instant::now());
        self.auth_sources.store(b.len(), Ordering::Relaxed);
        drop(b);
        self.count(Event::Failed, source);
    }

    /// One enrollment request of `source`: `Err(retry after)` past its rate.
    pub(crate) fn enroll(&self, route: EnrollRoute, source: Source) -> Result<(), Duration> {
        let buckets = match route {
            EnrollRoute::Create => &self.create,
            EnrollRoute::Poll => &self.poll,
        };
        lock(buckets).take(source, Instant::now())
    }

    /// Count `event` for the aggregate line; the first since the last
    /// summary is logged at once.
    pub(crate) fn count(&self, event: Event, source: Source) {
        if lock(&self.tally).record(event, source) {
            tracing::info!(
                ?event,
                %source,
                "refused a request; more are counted and logged together"
            );
        }
    }

    /// Log what was counted since the last call (one line), if anything.
    pub(crate) fn log_summary(&self) {
        let Some(s) = lock(&self.tally).take() else {
            return;
        };
        let top = s
            .top
            .map(|(src, n)| format!("{src} ({n})"))
            .unwrap_or_default();
        tracing::warn!(
            failed_credentials = s.failed,
            refused_browser_requests = s.refused,
            throttled = s.throttled,
            sources = s.sources,
            top_source = %top,
            "refused requests since the last summary"
        );
    }
}

/// What is left is logged when the harness stops (its router goes).
impl Drop for Throttles {
    fn drop(&mut self) {
        self.log_summary();
    }
}

/// Log the summary every `every` while `throttles` is in use (the task
/// ends when the router holding it is dropped).
pub(crate) fn log_periodically(throttles: &std::sync::Arc<Throttles>, every: Duration) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let weak = std::sync::Arc::downgrade(throttles);
    rt.spawn(async move {
        let mut tick = tokio::time::interval(every.max(Duration::from_secs(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            match weak.upgrade() {
                Some(t) => t.log_summary(),
                None => return,
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: Source = Source::Ip(IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 1)));
    const B: Source = Source::Ip(IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 2)));

    fn rate(burst: u32, every_ms: u64) -> Rate {
        Rate {
            burst,
            every: Duration::from_millis(every_ms),
        }
    }

    #[test]
    fn a_burst_then_one_per_period_and_sources_are_apart() {
        let now = Instant::now();
        let mut b = Buckets::new(rate(3, 1000), 16);
        for _ in 0..3 {
            assert_eq!(b.take(A, now), Ok(()));
        }
        let wait = b.take(A, now).unwrap_err();
        assert_eq!(wait, Duration::from_secs(1));
        assert_eq!(b.empty_for(A, now), Some(Duration::from_secs(1)));
        // Another source is not held up by A.
        assert_eq!(b.take(B, now), Ok(()));
        assert_eq!(b.empty_for(B, now), None);
        let later = now + Duration::from_secs(1);
        assert_eq!(b.empty_for(A, later), None);
        assert_eq!(b.take(A, later), Ok(()));
        assert!(b.take(A, later).is_err());
    }

    #[test]
    fn ipv6_counts_by_its_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Source::of(a), Source::of(b));
        assert_ne!(Source::of(a), Source::of(c));
        assert_eq!(Source::of(a).to_string(), "2001:db8:1:2::/64");
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert_eq!(Source::of(mapped), A);
        assert_eq!(Source::Local.to_string(), "local");
    }

    #[test]
    fn the_most_limited_sources_are_kept_at_the_bound() {
        let now = Instant::now();
        let mut b = Buckets::new(rate(2, 1000), 2);
        b.take(A, now).unwrap();
        b.take(A, now).unwrap();
        b.take(B, now).unwrap();
        let c = Source::Ip("192.0.2.3".parse().unwrap());
        b.take(c, now).unwrap();
        assert_eq!(b.len(), 2);
        assert!(b.empty_for(A, now).is_some(), "A, out of tokens, is kept");
    }

    #[test]
    fn the_tally_logs_the_first_and_sums_the_rest() {
        let mut t = Tally::default();
        assert!(t.take().is_none());
        assert!(t.record(Event::Failed, A));
        assert!(!t.record(Event::Failed, A));
        assert!(!t.record(Event::Throttled, B));
        let s = t.take().unwrap();
        assert_eq!((s.failed, s.throttled, s.refused, s.sources), (2, 1, 0, 2));
        assert_eq!(s.top, Some((A, 2)));
        assert!(t.take().is_none());
        assert!(t.record(Event::Refused, B), "first again after a summary");
    }

    proptest! {
        /// A refusal's wait is exactly when the next token comes: a
        /// moment earlier is still refused, then it is granted; and the
        /// sources remembered never exceed the bound.
        #[test]
        fn the_wait_is_exact_and_memory_bounded(
            burst in 1u32..8,
            every_ms in 1u64..500,
            steps in proptest::collection::vec((0u8..6, 0u64..400), 1..200),
        ) {
            let mut b = Buckets::new(rate(burst, every_ms), 3);
            let mut now = Instant::now();
            for (who, dt) in steps {
                now += Duration::from_millis(dt);
                let src = Source::Ip(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, who)));
                if let Err(wait) = b.take(src, now) {
                    prop_assert!(wait > Duration::ZERO);
                    prop_assert!(wait <= Duration::from_millis(every_ms));
                    prop_assert_eq!(b.empty_for(src, now), Some(wait));
                    let mut c = b.clone();
                    prop_assert!(c.take(src, now + wait - Duration::from_nanos(1)).is_err());
                    prop_assert!(c.take(src, now + wait).is_ok());
                }
                prop_assert!(b.len() <= 3);
            }
        }

        /// With room for every source, the exact bound holds: at most
        /// burst + elapsed/every tokens from a source's first request.
        #[test]
        fn the_exact_bound_with_room(
            burst in 1u32..8,
            every_ms in 1u64..500,
            steps in proptest::collection::vec(0u64..400, 1..200),
        ) {
            let start = Instant::now();
            let mut b = Buckets::new(rate(burst, every_ms), 8);
            let mut now = start;
            let mut granted = 0u64;
            for dt in steps {
                now += Duration::from_millis(dt);
                if b.take(A, now).is_ok() {
                    granted += 1;
                }
                let span = now.duration_since(start).as_millis() as u64;
                prop_assert!(granted <= u64::from(burst) + span / every_ms);
            }
        }
    }
}

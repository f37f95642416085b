//! "Deliver until acknowledged" as a sans-IO state machine.
//!
//! Some executor → harness requests must reach the harness whatever happens
//! to the connection: `tool.result` (at-most-once execution means the
//! result is the only copy), `session.ended` and `session.ready`. Each is
//! kept here from the moment it exists until the harness answers it; a
//! failed attempt is retried after [`Backoff`], a lost connection parks
//! everything until the next register, which makes everything due at once.
//!
//! The outbox does no I/O and reads no clock: callers pass `now` (time
//! since any fixed origin) and a random number for the jitter, take what is
//! due with [`Outbox::poll_send`], report each attempt's end with
//! [`Outbox::acked`] or [`Outbox::failed`], and arm one timer at
//! [`Outbox::next_due`]. `crate::executor::outbox` is the actor-side driver.

use crate::supervisor::Backoff;
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Send at or after this time (if connected).
    Due(Duration),
    /// An attempt is under way: wait for its end.
    InFlight,
}

#[derive(Debug, Clone)]
struct Item<V> {
    value: V,
    slot: Slot,
    /// Failed attempts since the last success of the link (for backoff).
    failures: u32,
}

/// Items waiting for an acknowledgement, by key (a tool call id, a session
/// id). A key is delivered at most once at a time and kept until acked.
#[derive(Debug, Clone)]
pub struct Outbox<K: Ord, V> {
    items: BTreeMap<K, Item<V>>,
    backoff: Backoff,
    connected: bool,
    max_items: usize,
}

/// Why [`Outbox::push`] refused an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the outbox holds its maximum of {0} items")]
pub struct Full(pub usize);

impl<K: Ord + Clone, V: Clone> Outbox<K, V> {
    /// An empty outbox, disconnected, holding at most `max_items`.
    pub fn new(backoff: Backoff, max_items: usize) -> Self {
        Outbox {
            items: BTreeMap::new(),
            backoff,
            connected: false,
            max_items,
        }
    }

    /// Keep `value` under `key` until acknowledged; due at once. Pushing a
    /// key that is already kept replaces its value and makes it due again
    /// (unless an attempt is in flight: that attempt's end decides).
    pub fn push(&mut self, key: K, value: V, now: Duration) -> Result<(), Full> {
        if let Some(item) = self.items.get_mut(&key) {
            item.value = value;
            if item.slot != Slot::InFlight {
                item.slot = Slot::Due(now);
            }
            return Ok(());
        }
        if self.items.len() >= self.max_items {
            return Err(Full(self.max_items));
        }
        self.items.insert(
            key,
            Item {
                value,
                slot: Slot::Due(now),
                failures: 0,
            },
        );
        Ok(())
    }

    /// Make a kept item due now (a repeated request asks for it again).
    /// `false` when the key is not kept.
    pub fn resend(&mut self, key: &K, now: Duration) -> bool {
        match self.items.get_mut(key) {
            Some(item) => {
                if item.slot != Slot::InFlight {
                    item.slot = Slot::Due(now);
                }
                true
            }
            None => false,
        }
    }

    /// The items to send now, marked in flight. Nothing while disconnected.
    pub fn poll_send(&mut self, now: Duration) -> Vec<(K, V)> {
        if !self.connected {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (k, item) in self.items.iter_mut() {
            if matches!(item.slot, Slot::Due(at) if at <= now) {
                item.slot = Slot::InFlight;
                out.push((k.clone(), item.value.clone()));
            }
        }
        out
    }

    /// The harness acknowledged `key`: forget it. Returns its value.
    pub fn acked(&mut self, key: &K) -> Option<V> {
        self.items.remove(key).map(|i| i.value)
    }

    /// An attempt failed (no answer, an error answer, a closed link):
    /// retry after the backoff; `random` in [0, 1] is the jitter.
    pub fn failed(&mut self, key: &K, now: Duration, random: f64) {
        let backoff = self.backoff;
        if let Some(item) = self.items.get_mut(key) {
            let delay = backoff.delay(item.failures, random);
            item.failures = item.failures.saturating_add(1);
            item.slot = Slot::Due(now + delay);
        }
    }

    /// A (re)register succeeded: everything not in flight is due now and
    /// the backoff starts over.
    pub fn connected(&mut self, now: Duration) {
        self.connected = true;
        for item in self.items.values_mut() {
            item.failures = 0;
            if item.slot != Slot::InFlight {
                item.slot = Slot::Due(now);
            }
        }
    }

    /// The connection is gone: nothing is sent until [`Outbox::connected`].
    /// Attempts in flight still end (they fail) through [`Outbox::failed`].
    pub fn disconnected(&mut self) {
        self.connected = false;
    }

    /// When the next item falls due (`None`: nothing to wait for).
    pub fn next_due(&self) -> Option<Duration> {
        if !self.connected {
            return None;
        }
        self.items
            .values()
            .filter_map(|i| match i.slot {
                Slot::Due(at) => Some(at),
                Slot::InFlight => None,
            })
            .min()
    }

    pub fn contains(&self, key: &K) -> bool {
        self.items.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// The most items kept at once.
    pub fn max_items(&self) -> usize {
        self.max_items
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The kept keys (for logs when an owner ends with items undelivered).
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.items.keys()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn outbox() -> Outbox<u8, u32> {
        Outbox::new(
            Backoff {
                min: ms(100),
                max: ms(10_000),
            },
            64,
        )
    }

    #[test]
    fn nothing_is_sent_until_connected_then_everything_at_once() {
        let mut o = outbox();
        o.push(1, 10, ms(0)).unwrap();
        o.push(2, 20, ms(0)).unwrap();
        assert!(o.poll_send(ms(5)).is_empty());
        assert_eq!(o.next_due(), None);
        o.connected(ms(7));
        assert_eq!(o.poll_send(ms(7)), vec![(1, 10), (2, 20)]);
        assert!(o.poll_send(ms(8)).is_empty(), "in flight: not sent twice");
        assert_eq!(o.acked(&1), Some(10));
        o.failed(&2, ms(9), 1.0);
        assert_eq!(o.next_due(), Some(ms(109)));
        assert!(o.poll_send(ms(100)).is_empty());
        assert_eq!(o.poll_send(ms(109)), vec![(2, 20)]);
    }

    #[test]
    fn a_resend_of_an_in_flight_item_waits_for_the_attempt() {
        let mut o = outbox();
        o.connected(ms(0));
        o.push(1, 10, ms(0)).unwrap();
        assert_eq!(o.poll_send(ms(0)).len(), 1);
        assert!(o.resend(&1, ms(1)));
        assert!(o.poll_send(ms(1)).is_empty());
        o.failed(&1, ms(2), 0.0);
        assert!(o.resend(&1, ms(3)));
        assert_eq!(o.poll_send(ms(3)), vec![(1, 10)]);
        assert!(!o.resend(&9, ms(3)));
    }

    #[test]
    fn the_bound_holds() {
        let mut o: Outbox<u32, ()> = Outbox::new(Backoff::default(), 2);
        o.push(1, (), ms(0)).unwrap();
        o.push(2, (), ms(0)).unwrap();
        o.push(2, (), ms(0)).unwrap();
        assert_eq!(o.push(3, (), ms(0)), Err(Full(2)));
    }

    #[derive(Debug, Clone)]
    enum Step {
        Push(u8),
        Resend(u8),
        Poll,
        Ack(u8),
        Fail(u8, f64),
        Connect,
        Disconnect,
        Advance(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u8..6).prop_map(Step::Push),
            (0u8..6).prop_map(Step::Resend),
            Just(Step::Poll),
            (0u8..6).prop_map(Step::Ack),
            ((0u8..6), 0.0f64..=1.0).prop_map(|(k, r)| Step::Fail(k, r)),
            Just(Step::Connect),
            Just(Step::Disconnect),
            (0u64..20_000).prop_map(Step::Advance),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Against a model: an item is never in flight twice at once, never
        /// sent while disconnected, never lost before its ack, never sent
        /// after it; and a connected outbox with nothing in flight always
        /// has a next due time when it holds anything (no item is stranded).
        #[test]
        fn delivered_until_acked_never_twice_at_once(steps in proptest::collection::vec(step(), 1..300)) {
            let mut o = outbox();
            let mut now = ms(0);
            let mut kept: BTreeSet<u8> = BTreeSet::new();
            let mut in_flight: BTreeSet<u8> = BTreeSet::new();
            let mut connected = false;
            let mut sends: BTreeMap<u8, u32> = BTreeMap::new();
            for s in steps {
                match s {
                    Step::Push(k) => {
                        o.push(k, k as u32, now).unwrap();
                        kept.insert(k);
                    }
                    Step::Resend(k) => prop_assert_eq!(o.resend(&k, now), kept.contains(&k)),
                    Step::Poll => {
                        let sent = o.poll_send(now);
                        if !connected { prop_assert!(sent.is_empty()); }
                        for (k, v) in sent {
                            prop_assert_eq!(v, k as u32);
                            prop_assert!(kept.contains(&k), "only kept items are sent");
                            prop_assert!(in_flight.insert(k), "never in flight twice");
                            *sends.entry(k).or_default() += 1;
                        }
                    }
                    Step::Ack(k) => {
                        if in_flight.remove(&k) {
                            prop_assert_eq!(o.acked(&k), Some(k as u32));
                            kept.remove(&k);
                        }
                    }
                    Step::Fail(k, r) => {
                        if in_flight.remove(&k) {
                            o.failed(&k, now, r);
                        }
                    }
                    Step::Connect => { connected = true; o.connected(now); }
                    Step::Disconnect => { connected = false; o.disconnected(); }
                    Step::Advance(d) => now += ms(d),
                }
                prop_assert_eq!(o.len(), kept.len(), "nothing lost, nothing extra");
                for k in &kept { prop_assert!(o.contains(k)); }
                let waiting = kept.len() > in_flight.len();
                if connected && waiting {
                    let due = o.next_due();
                    prop_assert!(due.is_some(), "a kept item is never stranded");
                    prop_assert!(due.unwrap() <= now + ms(10_000), "due within the backoff cap");
                }
                if !connected { prop_assert_eq!(o.next_due(), None); }
            }
        }
    }
}

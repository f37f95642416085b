//! One session's agent event stream, as a sans-IO state machine: the
//! `session.event` sequence rules, the retained log, and the cursors of the
//! platform's subscribers (SSE and WebSocket clients of
//! `GET /v1/sessions/{id}/events`).
//!
//! **Sequence.** `sequence` starts at 1 per session and rises by one with no
//! hole (PROTOCOL.md §10). The next expected sequence is the last accepted
//! plus one: that event is accepted (kept, offered to every subscriber); a
//! sequence at or below the last accepted is a resend whose acknowledgement
//! was lost, acknowledged again with the last accepted sequence and not
//! delivered twice; a higher one is a hole, refused with
//! `expectedSequence` so the executor resends from there. A log that does
//! not know where the session is (its actor was restarted after a crash,
//! see `actors::turns`) takes the first sequence it sees as the start.
//!
//! **Retention.** The newest [`LogLimits::max_events`] events and at most
//! [`LogLimits::max_bytes`] of their JSON are kept; older ones are dropped.
//! A client that asks for events older than the oldest kept gets a gap
//! marker naming the dropped range first, then everything kept.
//!
//! **Subscribers.** Each has a cursor: the last sequence handed to it. A
//! subscription replays what is kept after the client's cursor, then
//! receives live items (final events, deltas, interaction notices) through
//! a bounded [`Sink`] in the order the executor sent them. A sink that is
//! full is *kicked*: it gets a final error and is forgotten, so a slow
//! client never holds up the executor's acknowledgements (it reconnects
//! with its last event id and misses nothing). Every sequence reaches each
//! subscriber exactly once and in order (property-tested below).
//!
//! Nothing here reads a clock or does I/O: the actor serializes the JSON,
//! feeds frames in, and its sinks are channels.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// How much of a session's stream is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogLimits {
    /// Final events kept while the session lives.
    pub max_events: usize,
    /// Bytes of their JSON kept while the session lives.
    pub max_bytes: usize,
    /// Final events kept once the session has ended (until it is forgotten).
    pub ended_max_events: usize,
    /// Bytes kept once the session has ended.
    pub ended_max_bytes: usize,
    /// Subscribers at once.
    pub max_subscribers: usize,
}

impl Default for LogLimits {
    fn default() -> Self {
        LogLimits {
            max_events: 10_000,
            max_bytes: 16 << 20,
            ended_max_events: 1_000,
            ended_max_bytes: 1 << 20,
            max_subscribers: 64,
        }
    }
}

/// A final event as kept: its sequence and its JSON record (what SSE and
/// WebSocket clients receive, serialized once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub sequence: u64,
    pub json: Arc<str>,
}

impl Stored {
    /// Bytes counted against [`LogLimits::max_bytes`]: the JSON plus a
    /// fixed overhead, so a flood of tiny events is bounded too.
    fn cost(&self) -> usize {
        self.json.len() + 64
    }
}

/// What a subscriber receives, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// A final event (has a sequence; replayable).
    Event(Arc<Stored>),
    /// Live only: a delta or an interaction notice (its kind and JSON record).
    Live(&'static str, Arc<str>),
    /// Events `from..=to` were dropped before this subscriber could get them.
    Gap { from: u64, to: u64 },
    /// The session ended: nothing follows.
    End { reason: String },
}

/// Why a sink could not take an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    Taken,
    /// Full: the subscriber is too slow and is kicked.
    Full,
    /// The client is gone: forget it.
    Gone,
}

/// Where a subscriber's live items go (a bounded channel in the actor, a
/// plain queue in tests).
pub trait Sink {
    fn offer(&mut self, item: Item) -> Offer;
    /// Tell the subscriber it was dropped for being slow (its last item).
    fn kick(self);
}

/// What [`EventLog::accept`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Kept and offered to subscribers; acknowledge `acked` (its sequence).
    Accept { acked: u64 },
    /// A resend of an event already kept: acknowledge `acked` (the last
    /// accepted) again, deliver nothing.
    Repeat { acked: u64 },
    /// A hole: refuse; the executor resends from `expected`.
    Hole { expected: u64 },
    /// The session has ended: nothing more is accepted.
    Ended,
}

/// The sequence rule alone: what to do with event `sequence` when `last`
/// is the last accepted (`None`: unknown, the event sets the start). The
/// session actor also applies it to events accepted but not yet durable.
pub fn decide_after(last: Option<u64>, sequence: u64) -> Decision {
    match last {
        None => Decision::Accept { acked: sequence },
        Some(last) if sequence <= last => Decision::Repeat { acked: last },
        // `last < sequence`, so `last + 1` cannot overflow.
        Some(last) if sequence == last + 1 => Decision::Accept { acked: sequence },
        Some(last) => Decision::Hole { expected: last + 1 },
    }
}

/// Why a subscription was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SubscribeError {
    #[error("at most {0} subscribers per session")]
    TooMany(usize),
    #[error("after {after} is beyond the last event ({last})")]
    Beyond { after: u64, last: u64 },
}

/// What a new subscriber is handed at once: then its live items follow
/// through its sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// Events after the cursor that were dropped (`from..=to`), if any.
    pub gap: Option<(u64, u64)>,
    pub events: Vec<Arc<Stored>>,
    /// Set when the session has ended: after the replay, the stream ends.
    pub ended: Option<String>,
}

struct Sub<S> {
    sink: S,
    /// Last sequence handed to this subscriber (replayed or live).
    cursor: u64,
}

/// One session's event stream.
pub struct EventLog<S> {
    limits: LogLimits,
    /// Last accepted sequence; `None` when unknown (the first event sets it).
    last: Option<u64>,
    events: VecDeque<Arc<Stored>>,
    bytes: usize,
    subs: BTreeMap<u64, Sub<S>>,
    next_sub: u64,
    ended: Option<String>,
    /// Events dropped by retention, for the logs.
    dropped: u64,
}

impl<S: Sink> EventLog<S> {
    /// The stream of a new session: the first event must be sequence 1.
    pub fn new(limits: LogLimits) -> Self {
        Self::with_last(limits, Some(0))
    }

    /// A stream that does not know where the session is (rebuilt after a
    /// crash): the first event it sees sets the start.
    pub fn unknown(limits: LogLimits) -> Self {
        Self::with_last(limits, None)
    }

    /// A stream rebuilt from what a store kept (oldest first): it goes on
    /// after the newest. Sequences must be consecutive; if they are not
    /// (a store that lost rows), only the newest consecutive run is kept,
    /// so a subscriber is never handed a hole as if it were the stream.
    /// Nothing kept: the first event the executor sends sets the start.
    pub fn restore(limits: LogLimits, kept: impl IntoIterator<Item = Stored>) -> Self {
        let mut log = Self::with_last(limits, None);
        for stored in kept {
            if log
                .last
                .is_some_and(|last| last.checked_add(1) != Some(stored.sequence))
            {
                log.dropped += log.events.len() as u64;
                log.events.clear();
                log.bytes = 0;
            }
            log.keep(Arc::new(stored));
        }
        log
    }

    /// Keep `stored` as the newest event (it is the last accepted) and
    /// apply the live retention limits.
    fn keep(&mut self, stored: Arc<Stored>) {
        self.last = Some(stored.sequence);
        self.bytes += stored.cost();
        self.events.push_back(stored);
        self.trim(self.limits.max_events, self.limits.max_bytes);
    }

    fn with_last(limits: LogLimits, last: Option<u64>) -> Self {
        EventLog {
            limits,
            last,
            events: VecDeque::new(),
            bytes: 0,
            subs: BTreeMap::new(),
            next_sub: 1,
            ended: None,
            dropped: 0,
        }
    }

    /// The last accepted sequence (0 before the first).
    pub fn last(&self) -> u64 {
        self.last.unwrap_or(0)
    }

    /// The oldest sequence kept, if any.
    pub fn earliest(&self) -> Option<u64> {
        self.events.front().map(|e| e.sequence)
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn subscribers(&self) -> usize {
        self.subs.len()
    }

    pub fn ended(&self) -> Option<&str> {
        self.ended.as_deref()
    }

    /// Decide on event `sequence` (without its JSON: a refusal costs no
    /// serialization). Call [`accept`](Self::accept) for an `Accept`.
    pub fn decide(&self, sequence: u64) -> Decision {
        if self.ended.is_some() {
            return Decision::Ended;
        }
        decide_after(self.last, sequence)
    }

    /// Decide on event `sequence` and, if accepted, keep `json` and offer
    /// it to every subscriber that is caught up.
    pub fn accept(&mut self, sequence: u64, json: impl FnOnce() -> Arc<str>) -> Decision {
        let d = self.decide(sequence);
        if let Decision::Accept { .. } = d {
            let stored = Arc::new(Stored {
                sequence,
                json: json(),
            });
            self.keep(stored.clone());
            self.fan_out(|cursor| {
                // A subscriber whose cursor is not just before this event
                // already has it (it was replayed) or is behind a gap that
                // only a reconnect can fill; neither gets it twice.
                (cursor < sequence).then(|| Item::Event(stored.clone()))
            });
        }
        d
    }

    /// Offer a live-only item (a delta, an interaction notice) to every
    /// subscriber. Nothing is kept.
    pub fn live(&mut self, kind: &'static str, json: Arc<str>) {
        if self.ended.is_some() {
            return;
        }
        self.fan_out(|_| Some(Item::Live(kind, json.clone())));
    }

    /// Subscribe with cursor `after` (the last sequence the client has; 0
    /// for everything kept). The replay comes back; live items go to `sink`.
    pub fn subscribe(&mut self, after: u64, sink: S) -> Result<(u64, Replay), SubscribeError> {
        if let Some(last) = self.last {
            if after > last {
                return Err(SubscribeError::Beyond { after, last });
            }
        }
        if self.ended.is_none() && self.subs.len() >= self.limits.max_subscribers {
            return Err(SubscribeError::TooMany(self.limits.max_subscribers));
        }
        let earliest = self.earliest().unwrap_or(self.last() + 1);
        let gap = (after + 1 < earliest).then(|| (after + 1, earliest - 1));
        // Sequences are consecutive in the log: skip to the first after `after`.
        let skip = match self.events.front() {
            Some(front) if after >= front.sequence => (after - front.sequence + 1) as usize,
            _ => 0,
        };
        let events: Vec<Arc<Stored>> = self.events.iter().skip(skip).cloned().collect();
        let cursor = events.last().map_or(after, |e| e.sequence).max(after);
        let replay = Replay {
            gap,
            events,
            ended: self.ended.clone(),
        };
        let id = self.next_sub;
        self.next_sub += 1;
        if self.ended.is_none() {
            self.subs.insert(id, Sub { sink, cursor });
        }
        Ok((id, replay))
    }

    /// A client went away.
    pub fn unsubscribe(&mut self, id: u64) {
        self.subs.remove(&id);
    }

    /// The session ended: every subscriber gets `End` and is let go; the
    /// log shrinks to the ended limits and accepts nothing more.
    pub fn end(&mut self, reason: &str) {
        if self.ended.is_some() {
            return;
        }
        self.ended = Some(reason.to_owned());
        for (_, sub) in std::mem::take(&mut self.subs) {
            let mut sink = sub.sink;
            if sink.offer(Item::End {
                reason: reason.to_owned(),
            }) == Offer::Full
            {
                sink.kick();
            }
        }
        self.trim(self.limits.ended_max_events, self.limits.ended_max_bytes);
    }

    fn trim(&mut self, max_events: usize, max_bytes: usize) {
        while self.events.len() > max_events || (self.bytes > max_bytes && self.events.len() > 1) {
            match self.events.pop_front() {
                Some(e) => {
                    self.bytes -= e.cost();
                    self.dropped += 1;
                }
                None => break,
            }
        }
    }

    /// Events dropped by retention so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    fn fan_out(&mut self, mut item_for: impl FnMut(u64) -> Option<Item>) {
        let mut gone = Vec::new();
        for (id, sub) in self.subs.iter_mut() {
            let Some(item) = item_for(sub.cursor) else {
                continue;
            };
            let seq = match &item {
                Item::Event(e) => Some(e.sequence),
                _ => None,
            };
            match sub.sink.offer(item) {
                Offer::Taken => {
                    if let Some(s) = seq {
                        sub.cursor = s;
                    }
                }
                Offer::Full => gone.push((*id, true)),
                Offer::Gone => gone.push((*id, false)),
            }
        }
        for (id, slow) in gone {
            if let Some(sub) = self.subs.remove(&id) {
                if slow {
                    sub.sink.kick();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// A bounded queue shared with the test, and whether it was kicked.
    #[derive(Clone, Default)]
    struct Q {
        inner: Rc<RefCell<QInner>>,
    }

    #[derive(Default)]
    struct QInner {
        items: VecDeque<Item>,
        cap: usize,
        kicked: bool,
        gone: bool,
    }

    impl Q {
        fn new(cap: usize) -> Q {
            let q = Q::default();
            q.inner.borrow_mut().cap = cap;
            q
        }
        fn drain(&self) -> Vec<Item> {
            self.inner.borrow_mut().items.drain(..).collect()
        }
        fn kicked(&self) -> bool {
            self.inner.borrow().kicked
        }
    }

    impl Sink for Q {
        fn offer(&mut self, item: Item) -> Offer {
            let mut q = self.inner.borrow_mut();
            if q.gone {
                return Offer::Gone;
            }
            if q.items.len() >= q.cap {
                return Offer::Full;
            }
            q.items.push_back(item);
            Offer::Taken
        }
        fn kick(self) {
            self.inner.borrow_mut().kicked = true;
        }
    }

    fn js(n: u64) -> impl FnOnce() -> Arc<str> {
        move || Arc::from(format!("{{\"sequence\":{n}}}"))
    }

    fn seqs(items: &[Item]) -> Vec<u64> {
        items
            .iter()
            .filter_map(|i| match i {
                Item::Event(e) => Some(e.sequence),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn starts_at_one_rejects_holes_reacks_duplicates() {
        let mut log: EventLog<Q> = EventLog::new(LogLimits::default());
        assert_eq!(log.accept(2, js(2)), Decision::Hole { expected: 1 });
        assert_eq!(log.accept(1, js(1)), Decision::Accept { acked: 1 });
        assert_eq!(log.accept(2, js(2)), Decision::Accept { acked: 2 });
        assert_eq!(log.accept(1, js(1)), Decision::Repeat { acked: 2 });
        assert_eq!(log.accept(5, js(5)), Decision::Hole { expected: 3 });
        assert_eq!(log.len(), 2);
        let mut unknown: EventLog<Q> = EventLog::unknown(LogLimits::default());
        assert_eq!(unknown.accept(40, js(40)), Decision::Accept { acked: 40 });
        assert_eq!(unknown.accept(42, js(42)), Decision::Hole { expected: 41 });
        unknown.end("stopped");
        assert_eq!(unknown.accept(41, js(41)), Decision::Ended);
    }

    #[test]
    fn replay_then_live_without_gap_or_duplicate() {
        let mut log = EventLog::new(LogLimits::default());
        for n in 1..=3 {
            log.accept(n, js(n));
        }
        let q = Q::new(16);
        let (_, replay) = log.subscribe(1, q.clone()).unwrap();
        assert_eq!(replay.gap, None);
        assert_eq!(
            replay.events.iter().map(|e| e.sequence).collect::<Vec<_>>(),
            vec![2, 3]
        );
        log.live("delta", Arc::from("delta"));
        log.accept(4, js(4));
        let items = q.drain();
        assert_eq!(items[0], Item::Live("delta", Arc::from("delta")));
        assert_eq!(seqs(&items), vec![4]);
        assert_eq!(
            log.subscribe(9, Q::new(1)).unwrap_err(),
            SubscribeError::Beyond { after: 9, last: 4 }
        );
    }

    #[test]
    fn retention_reports_a_gap_and_a_slow_subscriber_is_kicked() {
        let limits = LogLimits {
            max_events: 3,
            max_subscribers: 2,
            ..LogLimits::default()
        };
        let mut log = EventLog::new(limits);
        let slow = Q::new(1);
        log.subscribe(0, slow.clone()).unwrap();
        for n in 1..=5 {
            log.accept(n, js(n));
        }
        assert!(slow.kicked());
        assert_eq!(log.subscribers(), 0);
        assert_eq!(log.earliest(), Some(3));
        let (_, replay) = log.subscribe(0, Q::new(8)).unwrap();
        assert_eq!(replay.gap, Some((1, 2)));
        assert_eq!(replay.events.len(), 3);
        log.subscribe(0, Q::new(8)).unwrap();
        assert_eq!(
            log.subscribe(0, Q::new(8)).unwrap_err(),
            SubscribeError::TooMany(2)
        );
    }

    #[test]
    fn the_end_reaches_subscribers_and_later_ones_replay() {
        let mut log = EventLog::new(LogLimits {
            ended_max_events: 2,
            ..LogLimits::default()
        });
        let q = Q::new(8);
        log.subscribe(0, q.clone()).unwrap();
        for n in 1..=4 {
            log.accept(n, js(n));
        }
        log.end("stopped");
        let items = q.drain();
        assert_eq!(
            items.last(),
            Some(&Item::End {
                reason: "stopped".into()
            })
        );
        let (_, replay) = log.subscribe(0, Q::new(8)).unwrap();
        assert_eq!(replay.gap, Some((1, 2)));
        assert_eq!(replay.ended.as_deref(), Some("stopped"));
        assert_eq!(log.subscribers(), 0);
    }

    #[test]
    fn bytes_are_bounded() {
        let mut log: EventLog<Q> = EventLog::new(LogLimits {
            max_bytes: 1_000,
            ..LogLimits::default()
        });
        for n in 1..=100 {
            log.accept(n, move || Arc::from("x".repeat(200)));
        }
        assert!(log.bytes() <= 1_000, "{}", log.bytes());
        assert_eq!(log.last(), 100);
        assert_eq!(log.dropped() as usize + log.len(), 100);
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// The executor sends its next frame: a resend of an already sent
        /// sequence (`back` below the next), or one ahead (a hole).
        Send {
            back: u8,
            ahead: bool,
        },
        Delta,
        /// A client (re)connects with its own cursor.
        Connect {
            client: usize,
        },
        /// A client reads what is queued (or not: it stays slow).
        Read {
            client: usize,
        },
        Disconnect {
            client: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u8..4, prop::bool::weighted(0.1)).prop_map(|(back, ahead)| Op::Send { back, ahead }),
            1 => Just(Op::Delta),
            1 => (0usize..3).prop_map(|client| Op::Connect { client }),
            3 => (0usize..3).prop_map(|client| Op::Read { client }),
            1 => (0usize..3).prop_map(|client| Op::Disconnect { client }),
        ]
    }

    /// A platform client: what it has seen (through replays and live
    /// items, across reconnects) and its live connection.
    #[derive(Default)]
    struct Client {
        seen: Vec<u64>,
        conn: Option<(u64, Q)>,
    }

    impl Client {
        fn cursor(&self) -> u64 {
            self.seen.last().copied().unwrap_or(0)
        }
        fn take(&mut self, items: Vec<Item>) {
            for i in items {
                match i {
                    Item::Event(e) => self.seen.push(e.sequence),
                    Item::Gap { .. } => panic!("no retention gap in this model"),
                    _ => {}
                }
            }
        }
    }

    proptest! {
        /// Whatever order and duplication the executor sends, the accepted
        /// sequences are 1, 2, 3… and every client that reconnects with its
        /// last seen sequence sees each sequence exactly once, in order,
        /// with no hole — through replays, live delivery, kicks for being
        /// slow and disconnects.
        #[test]
        fn each_sequence_once_in_order(ops in proptest::collection::vec(op(), 1..300)) {
            let mut log = EventLog::new(LogLimits { max_subscribers: 8, ..LogLimits::default() });
            let mut next_new = 1u64; // the executor's next fresh sequence
            let mut accepted = Vec::new();
            let mut clients: Vec<Client> = (0..3).map(|_| Client::default()).collect();
            for op in ops {
                match op {
                    Op::Send { back, ahead } => {
                        let seq = if ahead { next_new + 1 } else { next_new.saturating_sub(u64::from(back)).max(1) };
                        match log.accept(seq, js(seq)) {
                            Decision::Accept { acked } => {
                                prop_assert_eq!(acked, seq);
                                prop_assert_eq!(seq, next_new);
                                accepted.push(seq);
                                next_new += 1;
                            }
                            Decision::Repeat { acked } => {
                                prop_assert!(seq < next_new);
                                prop_assert_eq!(acked, next_new - 1);
                            }
                            Decision::Hole { expected } => prop_assert_eq!(expected, next_new),
                            Decision::Ended => prop_assert!(false),
                        }
                    }
                    Op::Delta => log.live("delta", Arc::from("d")),
                    Op::Connect { client } => {
                        let c = &mut clients[client];
                        if let Some((id, _)) = c.conn.take() {
                            log.unsubscribe(id);
                        }
                        let q = Q::new(4);
                        let (id, replay) = log.subscribe(c.cursor(), q.clone()).unwrap();
                        prop_assert_eq!(replay.gap, None);
                        c.take(replay.events.into_iter().map(Item::Event).collect());
                        c.conn = Some((id, q));
                    }
                    Op::Read { client } => {
                        let c = &mut clients[client];
                        if let Some((_, q)) = c.conn.clone() {
                            let items = q.drain();
                            c.take(items);
                            if q.kicked() {
                                c.conn = None;
                            }
                        }
                    }
                    Op::Disconnect { client } => {
                        if let Some((id, _)) = clients[client].conn.take() {
                            log.unsubscribe(id);
                        }
                    }
                }
                prop_assert!(log.subscribers() <= 3);
            }
            let expected: Vec<u64> = (1..next_new).collect();
            prop_assert_eq!(&accepted, &expected);
            for c in &mut clients {
                // Finish: drain what is queued, then reconnect once more.
                if let Some((_, q)) = c.conn.take() {
                    c.take(q.drain());
                }
                let (_, replay) = log.subscribe(c.cursor(), Q::new(1)).unwrap();
                c.take(replay.events.into_iter().map(Item::Event).collect());
                prop_assert_eq!(&c.seen, &expected);
            }
        }
    }

    proptest! {
        /// A log rebuilt from the events another log kept (what the store
        /// holds, docs/store.md) goes on exactly where that one was: the
        /// same last and oldest sequence, the same replay, the same
        /// decision for whatever comes next.
        #[test]
        fn a_restored_log_goes_on_where_the_kept_one_was(
            n in 0u64..60,
            max_events in 1usize..20,
            max_bytes in 64usize..2_000,
            probe in 1u64..70,
        ) {
            let limits = LogLimits { max_events, max_bytes, ..LogLimits::default() };
            let mut log: EventLog<Q> = EventLog::new(limits);
            for s in 1..=n {
                log.accept(s, js(s));
            }
            let kept: Vec<Stored> = log.events.iter().map(|e| (**e).clone()).collect();
            let mut restored: EventLog<Q> = EventLog::restore(limits, kept);
            if n == 0 {
                // Nothing kept: the next event sets the start.
                prop_assert_eq!(restored.decide(probe), Decision::Accept { acked: probe });
            } else {
                prop_assert_eq!(restored.last(), log.last());
                prop_assert_eq!(restored.earliest(), log.earliest());
                prop_assert_eq!(restored.decide(probe), log.decide(probe));
                let a = log.subscribe(0, Q::new(1)).unwrap().1;
                let b = restored.subscribe(0, Q::new(1)).unwrap().1;
                prop_assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn a_restore_with_a_hole_keeps_only_the_newest_run() {
        let stored = |n: u64| Stored {
            sequence: n,
            json: js(n)(),
        };
        let mut log: EventLog<Q> =
            EventLog::restore(LogLimits::default(), [1, 2, 5, 6, 7].map(stored));
        assert_eq!(log.last(), 7);
        assert_eq!(log.earliest(), Some(5));
        assert_eq!(log.dropped(), 2);
        assert_eq!(log.decide(8), Decision::Accept { acked: 8 });
        let (_, replay) = log.subscribe(0, Q::new(1)).unwrap();
        assert_eq!(replay.gap, Some((1, 4)));
        assert_eq!(
            replay.events.iter().map(|e| e.sequence).collect::<Vec<_>>(),
            vec![5, 6, 7]
        );
    }
}

//! The visor's event stream (VISOR.md §3): one global `seq` across all
//! sessions, a bounded retention log, filters, and replay joined to the live
//! stream.
//!
//! [`EventLog`] is the sans-IO part (numbering, retention, replay, gap
//! accounting). [`Hub`] wraps it with a lock and a `broadcast` ring: an
//! event is numbered, retained and broadcast under one lock, and a
//! subscriber takes its replay and its live receiver under the same lock,
//! so the two join with no duplicate and no hole. The ring never blocks a
//! publisher: a subscriber that falls behind it is told `Lagged` and
//! resumes from the retained log (a `gap` frame first if even that lost
//! events it had not seen).

use serde_json::{Map, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast;

/// Events retained for replay (the contract asks for at least 10,000).
pub const RETAIN: usize = 16_384;
/// The live ring shared by all subscribers; a subscriber further behind
/// than this replays from the log instead.
pub const RING: usize = 4096;

/// What filters look at, beside the event itself: the session's attributes
/// when the event was emitted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Meta {
    pub kind: String,
    pub agent: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub state: String,
}

/// One numbered event, serialized once.
#[derive(Debug)]
pub struct Event {
    pub seq: u64,
    pub session: String,
    pub kind: String,
    pub meta: Meta,
    /// The JSON text sent to clients.
    pub json: String,
}

/// A subscription's filter (VISOR.md §3); empty fields match everything,
/// set fields AND together, lists are ORs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    pub sessions: Vec<String>,
    pub kinds: Vec<String>,
    pub states: Vec<String>,
    pub agents: Vec<String>,
    pub labels: Vec<(String, String)>,
    pub types: Vec<String>,
}

impl Filter {
    pub fn matches(&self, e: &Event) -> bool {
        let any = |list: &[String], v: &str| list.is_empty() || list.iter().any(|x| x == v);
        any(&self.sessions, &e.session)
            && any(&self.kinds, &e.meta.kind)
            && any(&self.states, &e.meta.state)
            && (self.agents.is_empty()
                || e.meta
                    .agent
                    .as_deref()
                    .is_some_and(|a| any(&self.agents, a)))
            && self
                .labels
                .iter()
                .all(|(k, v)| e.meta.labels.get(k) == Some(v))
            && any(&self.types, &e.kind)
    }
}

/// Replay of the retained log.
#[derive(Debug, Default)]
pub struct Replay {
    /// `Some((from, to))`: events `from..=to` are no longer retained.
    pub gap: Option<(u64, u64)>,
    pub events: Vec<Arc<Event>>,
}

/// Numbering and retention, no I/O.
#[derive(Debug)]
pub struct EventLog {
    retained: VecDeque<Arc<Event>>,
    cap: usize,
    latest: u64,
    /// The highest seq dropped by retention (0: none). Purged events are
    /// removed on purpose and are not a gap.
    dropped_through: u64,
}

impl EventLog {
    pub fn new(cap: usize) -> EventLog {
        EventLog {
            retained: VecDeque::new(),
            cap: cap.max(1),
            latest: 0,
            dropped_through: 0,
        }
    }

    pub fn latest(&self) -> u64 {
        self.latest
    }

    pub fn len(&self) -> usize {
        self.retained.len()
    }

    pub fn is_empty(&self) -> bool {
        self.retained.is_empty()
    }

    /// Number and retain an event: `{seq, at, session, type, ..fields}`.
    pub fn push(
        &mut self,
        at: String,
        session: &str,
        kind: &str,
        fields: Map<String, Value>,
        meta: Meta,
    ) -> Arc<Event> {
        self.latest += 1;
        let mut obj = Map::new();
        obj.insert("seq".into(), self.latest.into());
        obj.insert("at".into(), at.into());
        obj.insert("session".into(), session.into());
        obj.insert("type".into(), kind.into());
        for (k, v) in fields {
            obj.entry(k).or_insert(v);
        }
        let event = Arc::new(Event {
            seq: self.latest,
            session: session.to_owned(),
            kind: kind.to_owned(),
            meta,
            json: Value::Object(obj).to_string(),
        });
        self.retained.push_back(event.clone());
        while self.retained.len() > self.cap {
            if let Some(old) = self.retained.pop_front() {
                self.dropped_through = self.dropped_through.max(old.seq);
            }
        }
        event
    }

    /// Retained events with `seq > after` (all, unfiltered), and the gap
    /// if retention dropped some of them.
    pub fn replay(&self, after: u64) -> Replay {
        let gap = (after < self.dropped_through).then_some((after + 1, self.dropped_through));
        let start = self.retained.partition_point(|e| e.seq <= after);
        Replay {
            gap,
            events: self.retained.iter().skip(start).cloned().collect(),
        }
    }

    /// Forget a session's events (purge).
    pub fn purge(&mut self, session: &str) {
        self.retained.retain(|e| e.session != session);
    }
}

/// The shared event hub.
pub struct Hub {
    log: Mutex<EventLog>,
    live: broadcast::Sender<Arc<Event>>,
}

impl Hub {
    pub fn new(retain: usize, ring: usize) -> Arc<Hub> {
        Arc::new(Hub {
            log: Mutex::new(EventLog::new(retain)),
            live: broadcast::channel(ring.max(1)).0,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, EventLog> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn latest(&self) -> u64 {
        self.lock().latest()
    }

    /// Number, retain and broadcast an event; returns its seq.
    pub fn publish(
        &self,
        session: &str,
        kind: &str,
        fields: Map<String, Value>,
        meta: Meta,
    ) -> u64 {
        let mut log = self.lock();
        let e = log.push(
            crate::wire::types::now_rfc3339(),
            session,
            kind,
            fields,
            meta,
        );
        let seq = e.seq;
        // No receivers is fine: the log keeps it.
        let _ = self.live.send(e);
        seq
    }

    /// Replay from `after` and a live receiver that starts right after it.
    pub fn subscribe(&self, after: u64) -> (Replay, broadcast::Receiver<Arc<Event>>) {
        let log = self.lock();
        let replay = log.replay(after);
        (replay, self.live.subscribe())
    }

    pub fn purge(&self, session: &str) {
        self.lock().purge(session);
    }
}

/// A `gap` frame.
pub fn gap_frame(from: u64, to: u64) -> String {
    serde_json::json!({"type": "gap", "from": from, "to": to}).to_string()
}

/// One subscriber's cursor over the hub: yields the frames to send, in
/// order, with no duplicate; recovers from lag through the log.
pub struct Cursor {
    hub: Arc<Hub>,
    filter: Filter,
    /// The highest seq examined (sent or filtered out).
    last: u64,
    rx: broadcast::Receiver<Arc<Event>>,
    pending: VecDeque<String>,
}

impl Cursor {
    pub fn new(hub: Arc<Hub>, filter: Filter, after: u64) -> Cursor {
        let (replay, rx) = hub.subscribe(after);
        let mut c = Cursor {
            hub,
            filter,
            last: after,
            rx,
            pending: VecDeque::new(),
        };
        c.take(replay);
        c
    }

    fn take(&mut self, replay: Replay) {
        if let Some((from, to)) = replay.gap {
            self.pending.push_back(gap_frame(from, to));
            self.last = self.last.max(to);
        }
        for e in replay.events {
            self.consider(&e);
        }
    }

    fn consider(&mut self, e: &Event) {
        if e.seq <= self.last {
            return;
        }
        self.last = e.seq;
        if self.filter.matches(e) {
            self.pending.push_back(e.json.clone());
        }
    }

    /// The next frame to send; `None` when the hub is gone.
    ///
    /// # Cancel safety
    /// Cancel safe: a frame is only removed from the queue when returned.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(f) = self.pending.pop_front() {
                return Some(f);
            }
            match self.rx.recv().await {
                Ok(e) => self.consider(&e),
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let (replay, rx) = self.hub.subscribe(self.last);
                    self.rx = rx;
                    self.take(replay);
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;
    use proptest::prelude::*;

    fn meta(kind: &str) -> Meta {
        Meta {
            kind: kind.into(),
            ..Default::default()
        }
    }

    fn seq_of(frame: &str) -> Option<u64> {
        serde_json::from_str::<Value>(frame)
            .ok()?
            .get("seq")?
            .as_u64()
    }

    #[test]
    fn replay_reports_what_retention_dropped() {
        let mut log = EventLog::new(3);
        for _ in 0..5 {
            log.push("t".into(), "s", "init", Map::new(), meta("pty"));
        }
        let r = log.replay(0);
        assert_eq!(r.gap, Some((1, 2)));
        assert_eq!(
            r.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        assert_eq!(log.replay(2).gap, None);
        log.purge("s");
        assert!(log.replay(2).events.is_empty());
    }

    #[tokio::test]
    async fn a_lagging_cursor_resumes_without_duplicates() {
        let hub = Hub::new(1000, 4);
        let mut c = Cursor::new(hub.clone(), Filter::default(), 0);
        for _ in 0..50 {
            hub.publish("s", "init", Map::new(), meta("pty"));
        }
        let mut seen = Vec::new();
        while seen.len() < 50 {
            let f = c.next().await.unwrap();
            seen.push(seq_of(&f).unwrap());
        }
        assert_eq!(seen, (1..=50).collect::<Vec<_>>());
    }

    proptest! {
        /// Replay from any point then live: every matching seq once, in
        /// order, and a gap frame exactly when retention dropped some.
        #[test]
        fn replay_then_live_has_no_hole_or_duplicate(
            before in 0usize..60, after_pick in 0u64..70, live in 0usize..60,
            cap in 1usize..40, ring in 1usize..8, odd_only in any::<bool>(),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let hub = Hub::new(cap, ring);
                for i in 0..before {
                    hub.publish(if i % 2 == 1 { "odd" } else { "even" }, "init", Map::new(), meta("pty"));
                }
                let after = after_pick.min(before as u64);
                let filter = Filter { sessions: if odd_only { vec!["odd".into()] } else { vec![] }, ..Default::default() };
                let mut c = Cursor::new(hub.clone(), filter, after);
                for i in before..before + live {
                    hub.publish(if i % 2 == 1 { "odd" } else { "even" }, "init", Map::new(), meta("pty"));
                }
                let total = (before + live) as u64;
                let mut got = Vec::new();
                let mut gaps = Vec::new();
                // Everything is published: the cursor is ready until empty.
                while let Some(Some(f)) = c.next().now_or_never() {
                    match seq_of(&f) {
                        Some(s) => got.push(s),
                        None => {
                            let g: Value = serde_json::from_str(&f).unwrap();
                            gaps.push((g["from"].as_u64().unwrap(), g["to"].as_u64().unwrap()));
                        }
                    }
                }
                let want: Vec<u64> = (after + 1..=total)
                    .filter(|s| !gaps.iter().any(|(a, b)| a <= s && s <= b))
                    .filter(|s| !odd_only || s % 2 == 0)
                    .collect();
                assert_eq!(got, want, "gaps {:?}", gaps);
                // A gap is only reported for what retention really dropped.
                for (_, to) in &gaps {
                    assert!(*to + cap as u64 <= total);
                }
            });
        }
    }
}

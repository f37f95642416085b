//! The actor-side driver of [`crate::wire::outbox::Outbox`]: sends what is
//! due over the current link, turns each answer into a message to the
//! owning actor, and keeps one timer armed for the next retry. Used by the
//! session (tool results, `session.ready`) and the sessions actor
//! (`session.ended`): one "deliver until acknowledged", not three.
//!
//! A delivery can be *journaled* ([`Delivery::journaled`]): each item is
//! then also written to the executor's journal ([`super::journal`]) when
//! it is pushed and removed from it when acknowledged, so it outlives the
//! executor process.

use super::journal::Journal;
use super::Shared;
use crate::wire::outbox::{Full, Outbox};
use crate::wire::{CallError, Method};
use ractor::{ActorRef, Message};
use serde::Serialize;
use std::fmt::Debug;
use std::time::{Duration, Instant};

/// What the owner feeds back into [`Delivery::on_event`].
#[derive(Debug)]
pub enum OutboxEvent<K> {
    Acked(K),
    Failed(K),
    /// The harness refused the item and asked for another sequence first
    /// (`session.event`: -32009 with `expectedSequence`).
    Expected(K, u64),
    /// The retry timer fired.
    Tick,
}

/// Names an item's journal entry: (session id, entry key).
type EntryKey<K> = Box<dyn Fn(&K) -> (String, String) + Send + Sync>;

/// Where a journaled delivery keeps its items: the journal and each key's
/// entry there.
struct Journaled<K> {
    journal: std::sync::Arc<Journal>,
    key: EntryKey<K>,
}

/// An outbox of requests of one method, and its timer.
pub struct Delivery<K: Ord, V> {
    outbox: Outbox<K, V>,
    method: Method,
    origin: Instant,
    timer_at: Option<Duration>,
    /// Whether an error answer counts as delivered: for `session.ended` the
    /// harness answered, so it knows; a `tool.result` refused with an
    /// internal error is tried again.
    error_is_answer: bool,
    journal: Option<Journaled<K>>,
}

impl<K, V> Delivery<K, V>
where
    K: Ord + Clone + Debug + Send + 'static,
    V: Serialize + Clone + Send + Sync + 'static,
{
    pub fn new(method: Method, error_is_answer: bool, max_items: usize, connected: bool) -> Self {
        let mut outbox = Outbox::new(crate::supervisor::Backoff::default(), max_items);
        let origin = Instant::now();
        if connected {
            outbox.connected(Duration::ZERO);
        }
        Delivery {
            outbox,
            method,
            origin,
            timer_at: None,
            error_is_answer,
            journal: None,
        }
    }

    /// Keep every item in `journal` too (nothing when `None`); `key` names
    /// an item's journal entry: (session id, key).
    pub fn journaled(
        mut self,
        journal: Option<std::sync::Arc<Journal>>,
        key: impl Fn(&K) -> (String, String) + Send + Sync + 'static,
    ) -> Self {
        self.journal = journal.map(|journal| Journaled {
            journal,
            key: Box::new(key),
        });
        self
    }

    /// Write an item to the journal. Past the journal's caps (or on a disk
    /// error) the item stays in memory only: delivered as usual, but lost
    /// if the executor dies first. Logged and counted.
    fn journal_put(&self, key: &K, value: &V) {
        let Some(j) = &self.journal else { return };
        let (session, k) = (j.key)(key);
        if let Err(e) = j.journal.put(self.method, &session, &k, value) {
            tracing::error!(method = self.method.as_str(), session = %session, key = %k, error = %e,
                "not journaled: kept in memory only");
            j.journal.overflows.inc();
        }
    }

    fn journal_remove(&self, key: &K) {
        let Some(j) = &self.journal else { return };
        let (session, k) = (j.key)(key);
        if let Err(e) = j.journal.remove(self.method, &session, &k) {
            tracing::warn!(method = self.method.as_str(), session = %session, key = %k, error = %e,
                "journal: cannot remove an acknowledged entry (it will be delivered again after a restart)");
        }
    }

    /// Forget every journaled item of `session` (its owner gives up on
    /// them: the session is over).
    pub fn journal_forget_session(&self, session: &str) {
        if let Some(j) = &self.journal {
            if let Err(e) = j.journal.remove_session(self.method, session) {
                tracing::warn!(error = %e, "journal: cannot forget a session's entries");
            }
        }
    }

    /// Keep an item read back from the journal (already there: not
    /// written again).
    pub fn restore(&mut self, key: K, value: V) -> Result<(), Full> {
        let now = self.now();
        self.outbox.push(key, value, now)
    }

    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    pub fn outbox(&self) -> &Outbox<K, V> {
        &self.outbox
    }

    /// Keep `value` until the harness acknowledges it (sent at the next
    /// [`Delivery::pump`]); journaled first when the delivery is.
    pub fn push(&mut self, key: K, value: V) -> Result<(), Full> {
        let now = self.now();
        if self.journal.is_some() {
            if self.outbox.len() >= self.outbox.max_items() && !self.outbox.contains(&key) {
                return Err(Full(self.outbox.max_items()));
            }
            self.journal_put(&key, &value);
        }
        self.outbox.push(key, value, now)
    }

    /// Make every kept item `pred` selects due now (the harness asked to
    /// resume from one of them).
    pub fn resend_where(&mut self, pred: impl Fn(&K) -> bool) {
        let now = self.now();
        let keys: Vec<K> = self.outbox.keys().filter(|k| pred(k)).cloned().collect();
        for k in keys {
            self.outbox.resend(&k, now);
        }
    }

    /// Forget every kept item `pred` selects: the harness has them (it asked
    /// for a later one).
    pub fn ack_where(&mut self, pred: impl Fn(&K) -> bool) {
        let keys: Vec<K> = self.outbox.keys().filter(|k| pred(k)).cloned().collect();
        for k in keys {
            if self.outbox.acked(&k).is_some() {
                self.journal_remove(&k);
            }
        }
    }

    /// Send a kept item again now (the harness asked for it again).
    pub fn resend(&mut self, key: &K) -> bool {
        let now = self.now();
        self.outbox.resend(key, now)
    }

    pub fn connected(&mut self) {
        let now = self.now();
        self.outbox.connected(now);
    }

    pub fn disconnected(&mut self) {
        self.outbox.disconnected();
    }

    /// Apply an answer or a timer tick, then send what is due.
    pub fn on_event<M: Message>(
        &mut self,
        event: OutboxEvent<K>,
        shared: &Shared,
        myself: &ActorRef<M>,
        wrap: fn(OutboxEvent<K>) -> M,
    ) {
        match event {
            OutboxEvent::Acked(k) => {
                if self.outbox.acked(&k).is_some() {
                    self.journal_remove(&k);
                }
            }
            OutboxEvent::Failed(k) | OutboxEvent::Expected(k, _) => {
                let now = self.now();
                self.outbox.failed(&k, now, rand::random::<f64>());
            }
            OutboxEvent::Tick => self.timer_at = None,
        }
        self.pump(shared, myself, wrap);
    }

    /// Send every due item over the current link (each attempt's end comes
    /// back as an [`OutboxEvent`]) and arm the timer for the next one.
    pub fn pump<M: Message>(
        &mut self,
        shared: &Shared,
        myself: &ActorRef<M>,
        wrap: fn(OutboxEvent<K>) -> M,
    ) {
        let now = self.now();
        let due = self.outbox.poll_send(now);
        if !due.is_empty() {
            let link = shared.link();
            let timeout = shared.config.request_timeout;
            let mut sends = Vec::with_capacity(due.len());
            for (key, value) in due {
                let (me, link, method) = (myself.clone(), link.clone(), self.method);
                let error_is_answer = self.error_is_answer;
                sends.push(async move {
                    let result = match link {
                        Some(link) => {
                            link.request::<_, serde_json::Value>(method, &value, timeout)
                                .await
                        }
                        None => Err(CallError::Closed),
                    };
                    let event = match result {
                        Ok(_) => OutboxEvent::Acked(key),
                        Err(CallError::Rpc(e)) if e.data.as_ref().is_some_and(|d| d.expected_sequence.is_some()) => {
                            let expected = e.data.as_ref().and_then(|d| d.expected_sequence).unwrap_or(0);
                            OutboxEvent::Expected(key, expected)
                        }
                        Err(CallError::Rpc(e)) if error_is_answer => {
                            tracing::warn!(method = method.as_str(), ?key, error = %e, "refused; the harness knows");
                            OutboxEvent::Acked(key)
                        }
                        Err(e) => {
                            tracing::debug!(method = method.as_str(), ?key, error = %e, "not acknowledged; will retry");
                            OutboxEvent::Failed(key)
                        }
                    };
                    let _ = me.send_message(wrap(event));
                });
            }
            // One task, the requests first polled in key order: they leave
            // in that order (the harness takes `session.event`s in sequence).
            tokio::spawn(futures_util::future::join_all(sends));
        }
        if let Some(at) = self.outbox.next_due() {
            if self.timer_at.is_none_or(|t| at < t) {
                self.timer_at = Some(at);
                let wait = at.saturating_sub(now) + Duration::from_millis(1);
                myself.send_after(wait, move || wrap(OutboxEvent::Tick));
            }
        }
    }
}

//! One actor per session's agent stream (harness side): its event log and
//! subscribers ([`EventLog`]) and its pending interactions
//! ([`Interactions`]), driven with the harness clock.
//!
//! Frames reach it after the leases actor fenced them (a frame on a
//! connection that does not hold the session's lease never gets here:
//! -32010): `session.event` (sequenced, acknowledged), `session.event_delta`
//! (fanned out live), `interaction.request` / `interaction.cancel`. The HTTP
//! API subscribes clients, lists interactions and marks answers on their
//! way (the API sends `interaction.response` itself, over the session's
//! route, and reports back).
//!
//! Started under the harness's `turns` dynamic supervisor when the session
//! is created ([`session_created`]); it outlives the session's end to serve
//! the tail of the stream (trimmed to the ended limits) and stops when the
//! platform's view forgets the session ([`forget`]). It is `temporary`:
//! one that fails loses its pending interactions (its subscribers' streams
//! end with `stream_closed`); the next use starts a fresh actor.
//!
//! **Durable events.** With a store ([`DurableState`]), an accepted event
//! is *staged*: written to the store, and only once that write is
//! committed acknowledged to the executor, offered to stream clients and
//! the platform's callback (`Committed`). A harness killed before the
//! commit never acknowledged the event, so the executor sends it again.
//! Deltas and interaction notices that arrive behind a staged event wait
//! behind it, so clients still see everything in the order the executor
//! sent it.
//! The store keeps what the log keeps (the actor trims it to the log's
//! oldest sequence), so an actor started for a session that already had
//! one (after a harness restart, a crash of the actor, or a takeover by
//! this replica) rebuilds its log from the store and goes on at the next
//! sequence: clients resume with their `Last-Event-ID` across a restart.
//! Without a store (or with nothing stored), the log takes the next
//! sequence the executor sends as its start.

use super::{alive, get_or_start};
use crate::harness::error::ApiError;
use crate::harness::events::{EventLog, Item, Offer, Replay, Sink, SubscribeError};
use crate::harness::interactions::{
    AnswerError, InteractionState, InteractionView, Interactions, RequestDecision,
};
use crate::harness::runtime::Shared;
use crate::harness::store::{DurableState, StoredEvent};
use crate::harness::types::{HarnessEvent, SessionState};
use crate::supervisor::ChildSpec;
use crate::wire::types::{
    now_rfc3339, Accepted, EventDeltaParams, InteractionCancelParams, InteractionOutcome,
    InteractionRequestParams, InteractionRequestResult, SessionEventParams, SessionEventResult,
};
use crate::wire::{ErrorCode, Responder, RpcError};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::json;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Ids from the executor longer than this are refused (-32602).
const MAX_ID_LEN: usize = 256;
/// An event `type` longer than this is refused.
const MAX_TYPE_LEN: usize = 128;
/// How long a starting actor waits for writes queued before it (by the
/// actor it replaces) to be durable, and for its events to load.
const RESTORE_DEADLINE: Duration = Duration::from_secs(10);
/// Live items held behind staged events at most (a store that stops
/// committing must not grow the queue without end). Past it a live item
/// is not shown: live items are never replayed anyway, and a client
/// that reconnects reads the final events and interactions as kept.
const MAX_HELD_LIVE: usize = 4096;

pub enum TurnsMsg {
    /// `session.event`, fenced.
    Event {
        params: SessionEventParams,
        reply: Option<Responder>,
    },
    /// `session.event_delta`, fenced.
    Delta(EventDeltaParams),
    InteractionRequest {
        params: InteractionRequestParams,
        reply: Option<Responder>,
    },
    InteractionCancel {
        params: InteractionCancelParams,
        reply: Option<Responder>,
    },
    /// A platform client wants the stream after `after`.
    Subscribe {
        after: u64,
        reply: oneshot::Sender<Result<Subscription, ApiError>>,
    },
    Unsubscribe(u64),
    /// Pending interactions, or one (live or remembered) by id.
    Interactions {
        id: Option<String>,
        reply: oneshot::Sender<Vec<InteractionView>>,
    },
    /// An answer is about to be sent: mark it `responding`.
    BeginAnswer {
        id: String,
        reply: oneshot::Sender<Result<InteractionView, AnswerError>>,
    },
    /// How sending the answer went: `Ok` taken by the executor, `Err(true)`
    /// the executor does not know it (gone there), `Err(false)` not
    /// delivered (pending again).
    AnswerDone {
        id: String,
        result: Result<InteractionOutcome, bool>,
        reply: oneshot::Sender<Option<InteractionView>>,
    },
    /// The session ended: pending interactions go away, subscribers get
    /// the end, the log shrinks.
    SessionEnded {
        reason: String,
    },
    /// The session id was granted anew: start over.
    Reset,
    /// Interaction deadlines.
    Tick,
    /// The store committed the staged events up to `sequence` of grant
    /// `generation` (from the store's writer thread).
    Committed {
        generation: u64,
        sequence: u64,
    },
}

/// What waits for a staged event's write to the store, in arrival order.
enum Held {
    /// An accepted event.
    Event {
        sequence: u64,
        json: Arc<str>,
        params: SessionEventParams,
    },
    /// A live item (delta, interaction notice) that came after one: shown
    /// after it.
    Live {
        kind: &'static str,
        json: Arc<str>,
        event: HarnessEvent,
    },
}

/// A subscriber's side: the replay, then its live items.
pub struct Subscription {
    pub id: u64,
    pub replay: Replay,
    pub rx: mpsc::Receiver<Item>,
    /// Fires when the subscriber was dropped for being slow.
    pub kicked: oneshot::Receiver<()>,
    pub actor: ActorRef<TurnsMsg>,
}

/// A subscriber's bounded queue.
pub struct ChannelSink {
    tx: mpsc::Sender<Item>,
    kick: Option<oneshot::Sender<()>>,
}

impl Sink for ChannelSink {
    fn offer(&mut self, item: Item) -> Offer {
        match self.tx.try_send(item) {
            Ok(()) => Offer::Taken,
            Err(mpsc::error::TrySendError::Full(_)) => Offer::Full,
            Err(mpsc::error::TrySendError::Closed(_)) => Offer::Gone,
        }
    }

    fn kick(mut self) {
        if let Some(k) = self.kick.take() {
            let _ = k.send(());
        }
    }
}

pub struct SessionTurns;

pub struct TurnsArgs {
    pub shared: Arc<Shared>,
    pub session_id: String,
    /// A new session (the first event is sequence 1), or one whose stream
    /// was lost (the first event sets the start).
    pub fresh: bool,
}

pub struct TurnsState {
    shared: Arc<Shared>,
    session_id: String,
    span: tracing::Span,
    log: EventLog<ChannelSink>,
    interactions: Interactions,
    timer: super::DeadlineTimer<TurnsMsg>,
    durable: Option<DurableState>,
    /// Accepted events not yet durable and the live items behind them,
    /// oldest first; it starts with an event whenever it is not empty
    /// (always empty without a store). Its events are bounded by the
    /// store's queue ([`DurableState::has_room`]), its live items by
    /// [`MAX_HELD_LIVE`] (`held_live` counts them).
    held: VecDeque<Held>,
    held_live: usize,
    /// Bumped when the session id is granted anew: commits of the older
    /// grant's events are then ignored.
    generation: u64,
    /// The session ended while events were staged: the stream ends once
    /// they are shown.
    pending_end: Option<String>,
    /// The oldest sequence the store was last asked to keep.
    floor: u64,
}

impl Actor for SessionTurns {
    type Msg = TurnsMsg;
    type State = TurnsState;
    type Arguments = TurnsArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<TurnsMsg>,
        a: TurnsArgs,
    ) -> Result<TurnsState, ActorProcessingErr> {
        let span = tracing::info_span!("session_turns", session = %a.session_id);
        let config = &a.shared.config;
        let durable = a.shared.durable.get().cloned();
        let mut log = match (&durable, a.fresh) {
            (Some(d), true) => {
                // A reused id: an older grant's events are not this one's.
                d.clear_events(&a.session_id);
                EventLog::new(config.event_log)
            }
            (None, true) => EventLog::new(config.event_log),
            (Some(d), false) => {
                let log = restore(d, &a.session_id, config.event_log).await;
                span.in_scope(|| match log.earliest() {
                    Some(first) => tracing::info!(
                        first,
                        last = log.last(),
                        "event stream restored from the store"
                    ),
                    None => tracing::info!(
                        "event stream rebuilt with nothing stored: the next event sets the start"
                    ),
                });
                log
            }
            (None, false) => {
                span.in_scope(|| {
                    tracing::info!("event stream rebuilt: the next event sets the start")
                });
                EventLog::unknown(config.event_log)
            }
        };
        // Started for a session already over (its first actor failed):
        // clients get what little there is and the end, never a stream
        // that waits forever.
        let ended = a
            .shared
            .sessions
            .get(&a.session_id)
            .filter(|s| s.state == SessionState::Ended)
            .map(|s| s.ended_reason.clone().unwrap_or_else(|| "ended".into()));
        if let Some(reason) = ended {
            log.end(&reason);
        }
        a.shared.turns.insert(a.session_id.clone(), myself);
        let mut state = TurnsState {
            interactions: Interactions::new(config.interactions),
            shared: a.shared,
            session_id: a.session_id,
            span,
            log,
            timer: Default::default(),
            durable,
            held: VecDeque::new(),
            held_live: 0,
            generation: 0,
            pending_end: None,
            floor: 0,
        };
        state.trim_store();
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<TurnsMsg>,
        msg: TurnsMsg,
        state: &mut TurnsState,
    ) -> Result<(), ActorProcessingErr> {
        let span = state.span.clone();
        let _g = span.enter();
        state.handle(&myself, msg);
        state.rearm(&myself);
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<TurnsMsg>,
        state: &mut TurnsState,
    ) -> Result<(), ActorProcessingErr> {
        state.timer.cancel();
        let id = myself.get_id();
        state
            .shared
            .turns
            .remove_if(&state.session_id, |_, a| a.get_id() == id);
        Ok(())
    }
}

/// A log rebuilt from the store: first every write queued before (the
/// events of an actor this one replaces), then the session's events. A
/// store that fails, or is too slow, gives a log that does not know where
/// the session is (as without a store): the executor's next event sets
/// the start.
async fn restore(
    d: &DurableState,
    session_id: &str,
    limits: crate::harness::events::LogLimits,
) -> EventLog<ChannelSink> {
    let loaded = async {
        d.wait_durable(d.last_ticket(), RESTORE_DEADLINE).await?;
        let (d, id) = (d.clone(), session_id.to_owned());
        let load = tokio::task::spawn_blocking(move || d.events(&id));
        match tokio::time::timeout(RESTORE_DEADLINE, load).await {
            Ok(Ok(events)) => events,
            Ok(Err(e)) => Err(crate::harness::store::StoreError::Unavailable(
                e.to_string(),
            )),
            Err(_) => Err(crate::harness::store::StoreError::Unavailable(format!(
                "the events did not load within {RESTORE_DEADLINE:?}"
            ))),
        }
    };
    match loaded.await {
        Ok(events) => EventLog::restore(
            limits,
            events.into_iter().map(|e| crate::harness::events::Stored {
                sequence: e.sequence,
                json: e.json,
            }),
        ),
        Err(e) => {
            tracing::warn!(session = %session_id, error = %e, "stored events not loaded; the stream restarts at the next event");
            EventLog::unknown(limits)
        }
    }
}

fn answer<R: serde::Serialize>(reply: Option<Responder>, result: Result<R, RpcError>) {
    match (reply, result) {
        (Some(r), result) => r.send(result),
        (None, Err(e)) => tracing::debug!(error = %e, "notification refused"),
        (None, Ok(_)) => {}
    }
}

fn bad_id(what: &str, id: &str) -> Option<RpcError> {
    (id.is_empty() || id.len() > MAX_ID_LEN)
        .then(|| RpcError::invalid_params(format!("{what} must be 1 to {MAX_ID_LEN} characters")))
}

/// Milliseconds from now until an RFC 3339 time stamp (0 if past).
fn ms_until(stamp: &str) -> Option<u64> {
    let at =
        time::OffsetDateTime::parse(stamp, &time::format_description::well_known::Rfc3339).ok()?;
    let left = at - time::OffsetDateTime::now_utc();
    Some(left.whole_milliseconds().clamp(0, i128::from(u64::MAX)) as u64)
}

/// The JSON record of a final event on the stream (serialized once: kept,
/// stored and sent to every client as it is).
fn record(p: &SessionEventParams) -> Arc<str> {
    Arc::from(
        json!({
            "kind": "event",
            "sessionId": p.session_id,
            "turnId": p.turn_id,
            "eventId": p.event_id,
            "sequence": p.sequence,
            "event": p.event,
            "receivedAt": now_rfc3339(),
        })
        .to_string(),
    )
}

/// The JSON record of an interaction notice on the event stream: the
/// interaction nested (its own `kind` is `permission` or `question`), with
/// the session and turn beside `kind` like every other record.
fn interaction_json(view: &InteractionView) -> Arc<str> {
    Arc::from(
        json!({
            "kind": "interaction",
            "sessionId": view.request.session_id,
            "turnId": view.request.turn_id,
            "interaction": view,
        })
        .to_string(),
    )
}

impl TurnsState {
    fn now(&self) -> u64 {
        self.shared.now_ms()
    }

    fn handle(&mut self, myself: &ActorRef<TurnsMsg>, msg: TurnsMsg) {
        match msg {
            TurnsMsg::Event { params, reply } => self.event(myself, params, reply),
            TurnsMsg::Committed {
                generation,
                sequence,
            } => self.committed(generation, sequence),
            TurnsMsg::Delta(p) => self.delta(p),
            TurnsMsg::InteractionRequest { params, reply } => self.interaction(params, reply),
            TurnsMsg::InteractionCancel { params, reply } => {
                if let Some(e) = bad_id("interactionId", &params.interaction_id) {
                    return answer::<Accepted>(reply, Err(e));
                }
                let reason = serde_json::to_value(params.reason)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_else(|| "canceled".into());
                if let Some(v) = self.interactions.cancel(&params.interaction_id, &reason) {
                    tracing::info!(interaction = %params.interaction_id, %reason, "interaction canceled by the executor");
                    self.notice(&v);
                }
                answer(reply, Ok(Accepted::YES));
            }
            TurnsMsg::Subscribe { after, reply } => {
                let _ = reply.send(self.subscribe(myself, after));
            }
            TurnsMsg::Unsubscribe(id) => self.log.unsubscribe(id),
            TurnsMsg::Interactions { id, reply } => {
                let v = match id {
                    Some(id) => self.interactions.get(&id).into_iter().collect(),
                    None => self.interactions.pending(),
                };
                let _ = reply.send(v);
            }
            TurnsMsg::BeginAnswer { id, reply } => {
                let r = self.interactions.begin_answer(&id);
                if let Ok(v) = &r {
                    self.notice(&InteractionView {
                        state: InteractionState::Responding,
                        ..v.clone()
                    });
                }
                let _ = reply.send(r);
            }
            TurnsMsg::AnswerDone { id, result, reply } => {
                let view = match result {
                    Ok(outcome) => self.interactions.answered(&id, outcome),
                    Err(true) => self.interactions.cancel(&id, "unknown_to_executor"),
                    Err(false) => {
                        self.interactions.answer_failed(&id);
                        self.interactions.get(&id)
                    }
                };
                if let Some(v) = &view {
                    self.notice(v);
                }
                let _ = reply.send(view);
            }
            TurnsMsg::SessionEnded { reason } => {
                for v in self.interactions.cancel_all("session_ended") {
                    self.notice(&v);
                }
                if self.held.is_empty() {
                    self.end(&reason);
                } else if self.pending_end.is_none() {
                    // Events acknowledged before the end are shown first.
                    self.pending_end = Some(reason);
                }
            }
            TurnsMsg::Reset => {
                self.log.end("session_restarted");
                self.log = EventLog::new(self.shared.config.event_log);
                self.interactions = Interactions::new(self.shared.config.interactions);
                self.generation += 1;
                self.held.clear();
                self.held_live = 0;
                self.pending_end = None;
                self.floor = 0;
                if let Some(d) = &self.durable {
                    d.clear_events(&self.session_id);
                }
            }
            TurnsMsg::Tick => {
                let now = self.now();
                for v in self.interactions.tick(now) {
                    tracing::info!(interaction = %v.request.interaction_id, "interaction expired");
                    self.notice(&v);
                }
            }
        }
    }

    /// Tell stream clients and the platform's callback about an interaction.
    fn notice(&mut self, v: &InteractionView) {
        self.live(
            "interaction",
            interaction_json(v),
            HarnessEvent::Interaction(Box::new(v.clone())),
        );
    }

    /// Show a live item now, or behind the staged events that came before it.
    fn live(&mut self, kind: &'static str, json: Arc<str>, event: HarnessEvent) {
        if self.held.is_empty() {
            self.log.live(kind, json);
            self.shared.emit(event);
        } else if self.held_live < MAX_HELD_LIVE {
            self.held_live += 1;
            self.held.push_back(Held::Live { kind, json, event });
        } else {
            tracing::debug!(
                kind,
                "live item not shown: the store has not committed the events before it"
            );
        }
    }

    /// The stream ends: no more events are accepted, the log shrinks to
    /// the ended limits (and the store with it).
    fn end(&mut self, reason: &str) {
        self.log.end(reason);
        self.trim_store();
        tracing::debug!(%reason, kept = self.log.len(), "session ended: event stream closed");
    }

    /// Ask the store to drop what the log dropped. The newest event always
    /// stays (it tells a restored log where the session is), even when
    /// the log keeps none.
    fn trim_store(&mut self) {
        let Some(d) = &self.durable else { return };
        let floor = self.log.earliest().unwrap_or(self.log.last());
        if floor > self.floor {
            self.floor = floor;
            d.trim_events(&self.session_id, floor);
        }
    }

    /// Staged events up to `sequence` are durable: show them, in order.
    fn committed(&mut self, generation: u64, sequence: u64) {
        if generation != self.generation {
            return;
        }
        loop {
            match self.held.pop_front() {
                Some(Held::Event {
                    sequence: s,
                    json,
                    params,
                }) if s <= sequence => match self.log.accept(s, || json) {
                    crate::harness::events::Decision::Accept { .. } => {
                        self.shared.emit(HarnessEvent::SessionEvent(params));
                    }
                    other => {
                        tracing::warn!(sequence = s, decision = ?other, "a staged event was not taken by the log")
                    }
                },
                Some(Held::Live { kind, json, event }) => {
                    self.held_live -= 1;
                    self.log.live(kind, json);
                    self.shared.emit(event);
                }
                Some(later) => {
                    self.held.push_front(later);
                    break;
                }
                None => break,
            }
        }
        if self.held.is_empty() {
            if let Some(reason) = self.pending_end.take() {
                self.end(&reason);
            }
        }
        self.trim_store();
    }

    fn event(
        &mut self,
        myself: &ActorRef<TurnsMsg>,
        p: SessionEventParams,
        reply: Option<Responder>,
    ) {
        if let Some(e) = bad_id("turnId", &p.turn_id).or_else(|| bad_id("eventId", &p.event_id)) {
            return answer::<Accepted>(reply, Err(e));
        }
        let kind_ok = p
            .event
            .get("type")
            .and_then(|t| t.as_str())
            .is_some_and(|t| !t.is_empty() && t.len() <= MAX_TYPE_LEN);
        if !kind_ok || p.sequence == 0 {
            return answer::<Accepted>(
                reply,
                Err(RpcError::invalid_params(
                    "an event needs sequence >= 1 and event.type (a string of 1 to 128 characters)",
                )),
            );
        }
        use crate::harness::events::{decide_after, Decision};
        let staged_last = self.held.iter().rev().find_map(|h| match h {
            Held::Event { sequence, .. } => Some(*sequence),
            Held::Live { .. } => None,
        });
        let decision = match staged_last {
            _ if self.pending_end.is_some() => Decision::Ended,
            Some(last) if self.log.ended().is_none() => decide_after(Some(last), p.sequence),
            _ => self.log.decide(p.sequence),
        };
        let ack = |acked: u64, event_id: String| SessionEventResult {
            accepted: true,
            acked_sequence: acked,
            event_id,
        };
        let result = match (decision, self.durable.clone()) {
            (Decision::Accept { acked }, None) => {
                self.log.accept(p.sequence, || record(&p));
                let result = ack(acked, p.event_id.clone());
                self.shared.emit(HarnessEvent::SessionEvent(p));
                Ok(result)
            }
            (Decision::Accept { acked }, Some(d)) => {
                if !d.has_room(1) {
                    return answer::<Accepted>(reply, Err(super::leases::store_busy()));
                }
                let json = record(&p);
                let fencing_token = self
                    .shared
                    .sessions
                    .get(&self.session_id)
                    .map_or(0, |s| s.fencing_token);
                let result = ack(acked, p.event_id.clone());
                let (me, generation) = (myself.clone(), self.generation);
                d.put_event(
                    StoredEvent {
                        session_id: self.session_id.clone(),
                        fencing_token,
                        sequence: acked,
                        json: json.clone(),
                    },
                    // The actor hears first, so a client that subscribes
                    // after the executor's acknowledgement finds the event.
                    Box::new(move || {
                        let _ = me.send_message(TurnsMsg::Committed {
                            generation,
                            sequence: acked,
                        });
                        answer(reply, Ok(result));
                    }),
                );
                self.held.push_back(Held::Event {
                    sequence: acked,
                    json,
                    params: p,
                });
                return;
            }
            (Decision::Repeat { acked }, Some(d)) if staged_last.is_some() => {
                // Acknowledged once what it repeats is durable.
                let result = ack(acked, p.event_id);
                d.after_commit(Box::new(move || answer(reply, Ok(result))));
                return;
            }
            (Decision::Repeat { acked }, _) => Ok(ack(acked, p.event_id)),
            (Decision::Hole { expected }, _) => {
                tracing::debug!(sequence = p.sequence, expected, "event sequence hole");
                Err(RpcError::conflict(
                    "unexpected_sequence",
                    format!(
                        "event sequence {} is not the next one ({expected})",
                        p.sequence
                    ),
                )
                .with_expected_sequence(expected))
            }
            (Decision::Ended, _) => {
                Err(RpcError::session_not_active(&self.session_id).with_reason("session_ended"))
            }
        };
        answer(reply, result);
    }

    fn delta(&mut self, p: EventDeltaParams) {
        if bad_id("eventId", &p.event_id).is_some() || p.event_type.len() > MAX_TYPE_LEN {
            return;
        }
        let json = json!({
            "kind": "delta",
            "sessionId": p.session_id,
            "turnId": p.turn_id,
            "eventId": p.event_id,
            "eventType": p.event_type,
            "index": p.index,
            "text": p.text,
        });
        self.live(
            "delta",
            Arc::from(json.to_string()),
            HarnessEvent::SessionEventDelta(p),
        );
    }

    fn interaction(&mut self, p: InteractionRequestParams, reply: Option<Responder>) {
        if let Some(e) =
            bad_id("interactionId", &p.interaction_id).or_else(|| bad_id("turnId", &p.turn_id))
        {
            return answer::<Accepted>(reply, Err(e));
        }
        let Some(ttl) = ms_until(&p.expires_at) else {
            return answer::<Accepted>(
                reply,
                Err(RpcError::invalid_params(
                    "expiresAt must be an RFC 3339 time stamp",
                )),
            );
        };
        if self.log.ended().is_some() {
            return answer::<Accepted>(
                reply,
                Err(RpcError::session_not_active(&self.session_id).with_reason("session_ended")),
            );
        }
        let id = p.interaction_id.clone();
        let platform_id = format!("pi-{}", uuid::Uuid::new_v4().simple());
        let now = self.now();
        match self
            .interactions
            .request(p, platform_id, now_rfc3339(), now, ttl)
        {
            RequestDecision::New(view) => {
                tracing::info!(interaction = %id, "interaction pending");
                let platform_interaction_id = view.platform_interaction_id.clone();
                self.notice(&view);
                answer(
                    reply,
                    Ok(InteractionRequestResult {
                        accepted: true,
                        platform_interaction_id: Some(platform_interaction_id),
                    }),
                );
            }
            RequestDecision::Known {
                platform_interaction_id,
            } => answer(
                reply,
                Ok(InteractionRequestResult {
                    accepted: true,
                    platform_interaction_id: Some(platform_interaction_id),
                }),
            ),
            RequestDecision::Full(n) => answer::<Accepted>(
                reply,
                Err(RpcError::resource_unavailable(format!(
                    "at most {n} pending interactions per session"
                ))
                .with_reason("too_many_interactions")),
            ),
        }
    }

    fn subscribe(
        &mut self,
        myself: &ActorRef<TurnsMsg>,
        after: u64,
    ) -> Result<Subscription, ApiError> {
        let (tx, rx) = mpsc::channel(self.shared.config.event_subscriber_queue.max(1));
        let (ktx, krx) = oneshot::channel();
        let sink = ChannelSink {
            tx,
            kick: Some(ktx),
        };
        match self.log.subscribe(after, sink) {
            Ok((id, replay)) => Ok(Subscription {
                id,
                replay,
                rx,
                kicked: krx,
                actor: myself.clone(),
            }),
            Err(e @ SubscribeError::TooMany(_)) => Err(ApiError::rpc(
                RpcError::resource_unavailable(e.to_string())
                    .with_reason("too_many_subscribers")
                    .with_retryable(true),
            )),
            Err(e @ SubscribeError::Beyond { .. }) => Err(ApiError::rpc(
                RpcError::invalid_params(e.to_string()).with_reason("after_beyond_last"),
            )),
        }
    }

    fn rearm(&mut self, myself: &ActorRef<TurnsMsg>) {
        let now = self.now();
        self.timer
            .arm(myself, self.interactions.next_deadline(), now, || {
                TurnsMsg::Tick
            });
    }
}

fn live_actor(shared: &Shared, session_id: &str) -> Option<ActorRef<TurnsMsg>> {
    shared
        .turns
        .get(session_id)
        .map(|a| a.clone())
        .filter(alive)
}

async fn start(
    shared: &Arc<Shared>,
    session_id: &str,
    fresh: bool,
) -> Result<ActorRef<TurnsMsg>, ApiError> {
    let spec = || {
        let args = TurnsArgs {
            shared: shared.clone(),
            session_id: session_id.to_owned(),
            fresh,
        };
        ChildSpec::temporary(session_id.to_owned(), SessionTurns, args)
    };
    get_or_start(
        || live_actor(shared, session_id),
        || shared.turns_sup(),
        spec,
        "session agent streams",
        "too_many_streams",
    )
    .await
}

/// The stream actor of a session the platform knows, started if needed.
///
/// # Errors
///
/// 404 for an unknown session, 429 when the harness serves its maximum of
/// streams, 503 while it shuts down.
pub async fn ensure(
    shared: &Arc<Shared>,
    session_id: &str,
) -> Result<ActorRef<TurnsMsg>, ApiError> {
    if !shared.sessions.contains_key(session_id) {
        return Err(ApiError::unknown_session(session_id));
    }
    if let Some(a) = live_actor(shared, session_id) {
        return Ok(a);
    }
    start(shared, session_id, false).await
}

/// A session was created (granted): its stream starts at sequence 1.
pub async fn session_created(shared: &Arc<Shared>, session_id: &str) {
    if let Some(a) = live_actor(shared, session_id) {
        let _ = a.send_message(TurnsMsg::Reset);
        return;
    }
    if let Err(e) = start(shared, session_id, true).await {
        tracing::warn!(session = %session_id, error = %e, "no event stream for the session yet");
    }
}

/// Hand an executor frame (already fenced) to the session's stream actor.
/// Without one (it failed, or could not be started), requests are refused
/// with a retryable -32603 and an actor is started, so the executor's
/// retry finds it; the sequence rules then ask for what is missing.
pub fn from_executor(shared: &Arc<Shared>, session_id: &str, msg: TurnsMsg) {
    if let Some(a) = live_actor(shared, session_id) {
        match a.send_message(msg) {
            Ok(()) => return,
            Err(ractor::MessagingErr::SendErr(m)) => return refuse(shared, session_id, m),
            Err(_) => return,
        }
    }
    refuse(shared, session_id, msg);
}

fn refuse(shared: &Arc<Shared>, session_id: &str, msg: TurnsMsg) {
    let reply = match msg {
        TurnsMsg::Event { reply, .. }
        | TurnsMsg::InteractionRequest { reply, .. }
        | TurnsMsg::InteractionCancel { reply, .. } => reply,
        _ => None,
    };
    if let Some(r) = reply {
        r.err(
            RpcError::new(
                ErrorCode::InternalError,
                "the session's event stream is restarting",
            )
            .with_reason("stream_restarting")
            .with_retryable(true),
        );
    }
    let ended = shared
        .sessions
        .get(session_id)
        .is_none_or(|s| s.state == SessionState::Ended);
    if ended {
        return;
    }
    let shared = shared.clone();
    let session_id = session_id.to_owned();
    tokio::spawn(async move {
        if let Err(e) = start(&shared, &session_id, false).await {
            tracing::warn!(session = %session_id, error = %e, "event stream not started");
        }
    });
}

/// The session ended.
pub fn session_ended(shared: &Shared, session_id: &str, reason: &str) {
    if let Some(a) = live_actor(shared, session_id) {
        let _ = a.send_message(TurnsMsg::SessionEnded {
            reason: reason.to_owned(),
        });
    }
}

/// The platform's view forgot the session: its stream goes too.
pub fn forget(shared: &Shared, session_id: &str) {
    if let Some((_, a)) = shared.turns.remove(session_id) {
        a.stop(Some("session forgotten".into()));
    }
}

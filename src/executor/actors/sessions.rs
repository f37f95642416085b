//! The sessions supervisor: creates a session actor per `session.assign`,
//! keeps each session's fence (highest fencing token), runs the lease clock
//! while the connection is down, and delivers `session.ended` until the
//! harness acknowledges it.
//!
//! Session actors are `temporary` children: a crashed session is ended,
//! its processes killed, and reported with reason `internal_error`; it is
//! never silently recreated.

use super::connection::ConnMsg;
use super::session::{Session, SessionArgs, SessionMsg};
use crate::executor::Shared;
use crate::lease::{AssignDecision, LeaseClock, SessionFence};
use crate::supervisor::Exit;
use crate::wire::types::{AssignParams, AssignResult, EndedParams};
use crate::wire::{Method, Responder, RpcError};
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

pub enum SessionsMsg {
    Assign(Box<AssignParams>, Responder),
    /// A register succeeded (first or resumed).
    Registered {
        lease_ttl_ms: u64,
    },
    HeartbeatAck {
        lease_ttl_ms: u64,
    },
    /// The connection actor stopped.
    Disconnected,
    /// Time to see whether the lease clock ran out.
    LeaseCheck,
    Drain {
        deadline: Duration,
        done: ActorRef<ConnMsg>,
    },
    DrainDeadline,
    /// Retry undelivered `session.ended`.
    FlushEnded,
    EndedAcked(String),
    EndedFailed(String),
}

struct Entry {
    actor: ActorRef<SessionMsg>,
    fence: SessionFence,
}

pub struct Sessions;

pub struct SessionsState {
    shared: Arc<Shared>,
    sessions: HashMap<String, Entry>,
    by_actor: HashMap<ActorId, String>,
    /// Highest fencing token of sessions that ended, so a stale re-assign
    /// of an ended session is still refused.
    retired: HashMap<String, u64>,
    clock: LeaseClock,
    origin: Instant,
    connected: bool,
    /// session.ended not yet acknowledged: session id → reason.
    ended: BTreeMap<String, String>,
    ended_in_flight: HashSet<String>,
    drain: Option<ActorRef<ConnMsg>>,
}

const RETIRED_MAX: usize = 65_536;

impl SessionsState {
    fn now(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    fn flush_ended(&mut self, myself: &ActorRef<SessionsMsg>) {
        let Some(link) = self.shared.link() else {
            return;
        };
        let timeout = self.shared.config.request_timeout;
        for (id, reason) in &self.ended {
            if !self.ended_in_flight.insert(id.clone()) {
                continue;
            }
            let (link, me) = (link.clone(), myself.clone());
            let params = EndedParams {
                session_id: id.clone(),
                reason: reason.clone(),
            };
            tokio::spawn(async move {
                let r = link
                    .request::<_, serde_json::Value>(Method::SessionEnded, &params, timeout)
                    .await;
                let _ = me.send_message(match r {
                    Ok(_) => SessionsMsg::EndedAcked(params.session_id),
                    // The harness answered, even with an error: it knows.
                    Err(crate::wire::CallError::Rpc(e)) => {
                        tracing::warn!(session = %params.session_id, error = %e, "session.ended refused");
                        SessionsMsg::EndedAcked(params.session_id)
                    }
                    Err(_) => SessionsMsg::EndedFailed(params.session_id),
                });
            });
        }
    }

    fn check_drained(&self) {
        if let Some(done) = &self.drain {
            if self.sessions.is_empty() && self.ended.is_empty() {
                let _ = done.send_message(ConnMsg::Drained);
            }
        }
    }

    fn stop_all(&self, reason: &str) {
        for e in self.sessions.values() {
            let _ = e.actor.send_message(SessionMsg::Stop {
                reason: reason.to_owned(),
                deadline: Duration::from_millis(5_000),
                keep_workspace: false,
                reply: None,
            });
        }
    }
}

impl Sessions {
    async fn assign(
        &self,
        myself: &ActorRef<SessionsMsg>,
        state: &mut SessionsState,
        p: AssignParams,
        reply: Responder,
    ) {
        let accepted = AssignResult {
            accepted: true,
            session_id: p.session_id.clone(),
        };
        if let Some(entry) = state.sessions.get_mut(&p.session_id) {
            return match entry.fence.on_assign(p.lease.fencing_token, &p.lease.token) {
                AssignDecision::Idempotent => reply.ok(&accepted),
                AssignDecision::Renewed { previous } => {
                    tracing::info!(previous, now = p.lease.fencing_token, "lease renewed");
                    let _ = entry.actor.send_message(SessionMsg::Renewed {
                        lease_token: p.lease.token.clone(),
                    });
                    reply.ok(&accepted)
                }
                AssignDecision::Stale { highest } => reply.err(RpcError::conflict(
                    "stale_fencing_token",
                    format!("fencing token {} is below {highest}", p.lease.fencing_token),
                )),
            };
        }
        if let Some(&highest) = state.retired.get(&p.session_id) {
            if p.lease.fencing_token <= highest {
                return reply.err(RpcError::conflict(
                    "stale_fencing_token",
                    format!("session ended under fencing token {highest}"),
                ));
            }
        }
        if state.shared.is_draining() {
            return reply.err(RpcError::executor_busy("draining"));
        }
        if state.sessions.len() >= state.shared.config.max_sessions as usize {
            return reply.err(RpcError::executor_busy("max_sessions"));
        }
        let args = SessionArgs {
            shared: state.shared.clone(),
            params: p.clone(),
        };
        match Actor::spawn_linked(None, Session, args, myself.get_cell()).await {
            Ok((actor, _)) => {
                state.by_actor.insert(actor.get_id(), p.session_id.clone());
                state
                    .shared
                    .sessions
                    .insert(p.session_id.clone(), actor.clone());
                state.sessions.insert(
                    p.session_id.clone(),
                    Entry {
                        actor,
                        fence: SessionFence::new(p.lease.fencing_token, p.lease.token.clone()),
                    },
                );
                state.ended.remove(&p.session_id);
                reply.ok(&accepted);
            }
            Err(e) => {
                tracing::error!(error = %e, "session failed to start");
                reply.err(RpcError::internal(format!("session failed to start: {e}")));
            }
        }
    }

    fn session_exited(
        &self,
        myself: &ActorRef<SessionsMsg>,
        state: &mut SessionsState,
        id: ActorId,
        exit: Exit,
    ) {
        let Some(session_id) = state.by_actor.remove(&id) else {
            return;
        };
        state.shared.sessions.remove(&session_id);
        if let Some(entry) = state.sessions.remove(&session_id) {
            if state.retired.len() >= RETIRED_MAX {
                state.retired.clear();
            }
            state
                .retired
                .insert(session_id.clone(), entry.fence.highest());
        }
        let reason = match &exit {
            Exit::Abnormal(why) => match why.strip_prefix("ended:") {
                Some(r) => r.to_owned(),
                None => {
                    tracing::error!(session = %session_id, error = %why, "session crashed; ending it");
                    // Its process actors may be gone with it: kill by tag.
                    crate::process::sys::kill_scope(
                        None,
                        &super::session::session_scope(&state.shared.instance, &session_id),
                    );
                    let _ = std::fs::remove_dir_all(super::session::workspace_dir(
                        &state.shared.config.work_root,
                        &session_id,
                    ));
                    "internal_error".to_owned()
                }
            },
            Exit::Shutdown(_) | Exit::Normal => "shutdown".to_owned(),
        };
        state.ended.insert(session_id, reason);
        state.flush_ended(myself);
        state.check_drained();
    }
}

impl Actor for Sessions {
    type Msg = SessionsMsg;
    type State = SessionsState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        myself: ActorRef<SessionsMsg>,
        shared: Arc<Shared>,
    ) -> Result<SessionsState, ActorProcessingErr> {
        shared.set_sessions_actor(Some(myself.clone()));
        Ok(SessionsState {
            shared,
            sessions: HashMap::new(),
            by_actor: HashMap::new(),
            retired: HashMap::new(),
            clock: LeaseClock::new(crate::wire::types::RegisterResult::DEFAULT_LEASE_TTL_MS),
            origin: Instant::now(),
            connected: false,
            ended: BTreeMap::new(),
            ended_in_flight: HashSet::new(),
            drain: None,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SessionsMsg>,
        state: &mut SessionsState,
    ) -> Result<(), ActorProcessingErr> {
        state.shared.set_sessions_actor(None);
        // End every session in parallel; each kills its process tree.
        state.stop_all("shutdown");
        for e in state.sessions.values() {
            let _ = e
                .actor
                .get_cell()
                .stop_and_wait(None, Some(Duration::from_secs(12)))
                .await;
        }
        state.shared.sessions.clear();
        crate::process::sys::kill_scope(None, &format!("{}/", state.shared.instance));
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<SessionsMsg>,
        msg: SessionsMsg,
        state: &mut SessionsState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SessionsMsg::Assign(p, reply) => {
                let span = tracing::info_span!("session", session = %p.session_id);
                self.assign(&myself, state, *p, reply)
                    .instrument(span)
                    .await
            }
            SessionsMsg::Registered { lease_ttl_ms } => {
                let now = state.now();
                state.clock.on_registered(now, lease_ttl_ms);
                state.connected = true;
                state.ended_in_flight.clear();
                state.flush_ended(&myself);
                if let Some(t) = state.shared.terminals_actor() {
                    let _ = t.send_message(
                        crate::executor::actors::terminals::TerminalsMsg::Reconnected,
                    );
                }
                // Sessions re-send what the harness has not acknowledged.
                for e in state.sessions.values() {
                    let _ = e.actor.send_message(SessionMsg::Reconnected);
                }
            }
            SessionsMsg::HeartbeatAck { lease_ttl_ms } => {
                let now = state.now();
                state.clock.on_registered(now, lease_ttl_ms);
                state.clock.on_heartbeat_ack(now);
            }
            SessionsMsg::Disconnected => {
                let now = state.now();
                state.connected = false;
                state.clock.on_disconnect(now);
                if let Some(at) = state.clock.expires_at() {
                    let wait = Duration::from_millis(at.saturating_sub(now));
                    tracing::info!(
                        ?wait,
                        sessions = state.sessions.len(),
                        "disconnected: lease clock running"
                    );
                    myself.send_after(wait + Duration::from_millis(1), || SessionsMsg::LeaseCheck);
                }
            }
            SessionsMsg::LeaseCheck => {
                let now = state.now();
                if !state.connected && state.clock.expired(now) && !state.sessions.is_empty() {
                    tracing::warn!(
                        sessions = state.sessions.len(),
                        "lease expired while disconnected: ending sessions"
                    );
                    state.stop_all("lease_expired");
                }
            }
            SessionsMsg::Drain { deadline, done } => {
                state.drain = Some(done);
                myself.send_after(deadline, || SessionsMsg::DrainDeadline);
                state.check_drained();
            }
            SessionsMsg::DrainDeadline => {
                state.stop_all("drain_deadline");
            }
            SessionsMsg::FlushEnded => state.flush_ended(&myself),
            SessionsMsg::EndedAcked(id) => {
                state.ended_in_flight.remove(&id);
                state.ended.remove(&id);
                state.check_drained();
            }
            SessionsMsg::EndedFailed(id) => {
                state.ended_in_flight.remove(&id);
                if state.connected {
                    myself.send_after(Duration::from_millis(500), || SessionsMsg::FlushEnded);
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SessionsMsg>,
        event: SupervisionEvent,
        state: &mut SessionsState,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            SupervisionEvent::ActorTerminated(cell, _, reason) => self.session_exited(
                &myself,
                state,
                cell.get_id(),
                Exit::from_reason(reason.as_deref()),
            ),
            SupervisionEvent::ActorFailed(cell, err) => self.session_exited(
                &myself,
                state,
                cell.get_id(),
                Exit::Abnormal(err.to_string()),
            ),
            _ => {}
        }
        Ok(())
    }
}

//! The sessions supervisor: creates a session actor per `session.assign`,
//! keeps each session's fence (highest fencing token), runs the lease clock
//! while the connection is down, and delivers `session.ended` until the
//! harness acknowledges it.
//!
//! After a restart it also delivers what the previous run's journal kept
//! ([`crate::executor::journal`]): the tool results and session events
//! first, then each of those sessions' `session.ended` (the journaled one,
//! or `executor_restarted`), so the harness gets the results before the
//! session ends.
//!
//! Session actors are `temporary` children: a crashed session is ended,
//! its processes killed, and reported with reason `internal_error`; it is
//! never silently recreated.

use super::connection::ConnMsg;
use super::session::{Session, SessionArgs, SessionMsg};
use crate::executor::outbox::{Delivery, OutboxEvent};
use crate::executor::Shared;
use crate::lease::{AssignDecision, LeaseClock, SessionFence};
use crate::supervisor::dynamic::{self, ChildExit, DynamicMsg, DynamicSpec, DynamicSupervisor};
use crate::supervisor::{ChildSpec, Exit};
use crate::wire::types::{
    AssignParams, AssignResult, EndReason, EndedParams, SessionEventParams, ToolResultParams,
};
use crate::wire::{Method, Responder, RpcError};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::HashMap;
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
    /// A session is about to stop for this reason (sent by the session
    /// itself, before its exit reaches us through the supervisor).
    Ending {
        session_id: String,
        reason: String,
    },
    /// A session actor ended (from the sessions' dynamic supervisor).
    Exited(ChildExit),
    /// `session.ended` delivery.
    Ended(OutboxEvent<String>),
    /// Delivery of a previous run's journaled tool results.
    RecoveredResults(OutboxEvent<(String, String)>),
    /// Delivery of a previous run's journaled session events.
    RecoveredEvents(OutboxEvent<(String, u64)>),
    /// Test hook: panic in the handler (a crash the tests inject).
    #[doc(hidden)]
    Panic,
}

struct Entry {
    actor: ActorRef<SessionMsg>,
    fence: SessionFence,
}

#[derive(Clone)]
pub struct Sessions;

pub struct SessionsState {
    shared: Arc<Shared>,
    /// The dynamic supervisor the session actors are `temporary` children of.
    sup: ActorRef<DynamicMsg>,
    sessions: HashMap<String, Entry>,
    /// Why each stopping session stops (from [`SessionsMsg::Ending`]).
    ending: HashMap<String, String>,
    /// Highest fencing token of sessions that ended, so a stale re-assign
    /// of an ended session is still refused.
    retired: HashMap<String, u64>,
    clock: LeaseClock,
    origin: Instant,
    connected: bool,
    /// `session.ended` kept until the harness acknowledges it.
    ended: Delivery<String, EndedParams>,
    drain: Option<ActorRef<ConnMsg>>,
    recovered: Recovered,
}

/// What a previous run of this work root left in the journal, being
/// delivered. An RPC error answer counts as delivered (the harness has
/// ended the session, or has the item): logged, then forgotten.
struct Recovered {
    results: Delivery<(String, String), ToolResultParams>,
    events: Delivery<(String, u64), SessionEventParams>,
    /// Each recovered session's `session.ended`, held until its results
    /// and events are acknowledged.
    held: HashMap<String, EndedParams>,
}

impl Recovered {
    fn new(shared: &Shared, connected: bool) -> Recovered {
        let j = shared.journal.clone();
        Recovered {
            results: Delivery::new(Method::ToolResult, true, ENDED_MAX, connected)
                .journaled(j.clone(), |k: &(String, String)| k.clone()),
            events: Delivery::new(Method::SessionEvent, true, ENDED_MAX, connected)
                .journaled(j, |k: &(String, u64)| {
                    (k.0.clone(), crate::executor::journal::sequence_key(k.1))
                }),
            held: HashMap::new(),
        }
    }

    /// Sessions whose results and events are all delivered: their
    /// `session.ended` may go now.
    fn release(&mut self) -> Vec<EndedParams> {
        let busy: std::collections::HashSet<&String> = self
            .results
            .outbox()
            .keys()
            .map(|k| &k.0)
            .chain(self.events.outbox().keys().map(|k| &k.0))
            .collect();
        let done: Vec<String> = self
            .held
            .keys()
            .filter(|s| !busy.contains(s))
            .cloned()
            .collect();
        done.into_iter()
            .filter_map(|s| self.held.remove(&s))
            .collect()
    }
}

const RETIRED_MAX: usize = 65_536;
/// `session.ended` reports kept while the harness is away.
const ENDED_MAX: usize = 65_536;

impl SessionsState {
    fn now(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    fn check_drained(&self) {
        if let Some(done) = &self.drain {
            if self.sessions.is_empty() && self.ended.outbox().is_empty() {
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
    async fn assign(&self, state: &mut SessionsState, p: AssignParams, reply: Responder) {
        let accepted = AssignResult {
            accepted: true,
            session_id: p.session_id.clone(),
        };
        if let Some(entry) = state.sessions.get_mut(&p.session_id) {
            return match entry.fence.on_assign(p.lease.fencing_token, &p.lease.token) {
                AssignDecision::Idempotent => reply.ok(&accepted),
                AssignDecision::Renewed { previous } => {
                    tracing::info!(previous, now = p.lease.fencing_token, "lease renewed");
                    state
                        .shared
                        .fences
                        .insert(p.session_id.clone(), entry.fence.highest());
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
        let bounds = match state.shared.sandboxes.bounds_for(&p.metadata) {
            Ok(b) => b,
            Err(refusal) => {
                return reply.err(
                    RpcError::invalid_params(refusal.to_string())
                        .with_reason("invalid_sandbox_bounds"),
                )
            }
        };
        let args = SessionArgs {
            shared: state.shared.clone(),
            params: p.clone(),
            bounds,
        };
        let spec = ChildSpec::temporary(p.session_id.clone(), Session, args)
            // Ending a session kills its processes: allow for the deadline.
            .shutdown_timeout(Duration::from_secs(12));
        match dynamic::start_actor::<SessionMsg>(&state.sup, spec).await {
            Ok(actor) => {
                state
                    .shared
                    .fences
                    .insert(p.session_id.clone(), p.lease.fencing_token);
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
        exit: ChildExit,
    ) {
        let session_id = exit.id;
        state.shared.sessions.remove(&session_id);
        state.shared.fences.remove(&session_id);
        if let Some(entry) = state.sessions.remove(&session_id) {
            if state.retired.len() >= RETIRED_MAX {
                state.retired.clear();
            }
            state
                .retired
                .insert(session_id.clone(), entry.fence.highest());
        }
        let told = state.ending.remove(&session_id);
        let reason = match (&exit.exit, told) {
            (Exit::Abnormal(why), _) => {
                tracing::error!(session = %session_id, error = %why, "session crashed; ending it");
                // Its process actors may be gone with it: kill its cgroup,
                // and by tag.
                state
                    .shared
                    .sandboxes
                    .kill_named(&crate::sandbox::session_name(&session_id));
                crate::process::sys::kill_scope(
                    None,
                    &super::session::session_scope(&state.shared.instance, &session_id),
                );
                let _ = crate::executor::workroot::remove_session_dir(
                    &state.shared.config.work_root,
                    "private",
                    &crate::sandbox::session_name(&session_id),
                );
                if state.shared.config.workspace.is_none() {
                    let _ = std::fs::remove_dir_all(super::session::workspace_dir(
                        &state.shared.config.work_root,
                        &session_id,
                    ));
                }
                EndReason::INTERNAL_ERROR.to_owned()
            }
            (_, Some(reason)) => reason,
            (Exit::Normal | Exit::Shutdown(_), None) => EndReason::SHUTDOWN.to_owned(),
        };
        let params = EndedParams {
            session_id: session_id.clone(),
            reason,
        };
        if let Err(e) = state.ended.push(session_id.clone(), params) {
            tracing::error!(session = %session_id, error = %e, "session.ended cannot be kept");
        }
        state.ended.pump(&state.shared, myself, SessionsMsg::Ended);
        state.check_drained();
    }
}

impl Sessions {
    /// Send the `session.ended` of every recovered session that has
    /// nothing left to deliver.
    fn release_recovered(&self, myself: &ActorRef<SessionsMsg>, state: &mut SessionsState) {
        let released = state.recovered.release();
        if released.is_empty() {
            return;
        }
        for params in released {
            let session_id = params.session_id.clone();
            if let Err(e) = state.ended.push(session_id.clone(), params) {
                tracing::error!(session = %session_id, error = %e, "session.ended cannot be kept");
            }
        }
        state.ended.pump(&state.shared, myself, SessionsMsg::Ended);
    }
}

/// Read back what a previous run of this work root left in the journal
/// (once per process: a restart of this actor finds nothing), and kill
/// what that run left running if it is dead.
async fn recover(shared: &Arc<Shared>, into: &mut Recovered) {
    let Some(journal) = shared.journal.clone() else {
        return;
    };
    let entries = journal.take_recovered();
    let previous = journal.previous().clone();
    // The previous run's processes (sessions, terminals) outlived it only
    // if it died without its shutdown sweep (SIGKILL): they carry its tag.
    if let (Some(instance), Some(pid)) = (previous.instance, previous.pid) {
        let gone = pid as u32 == std::process::id()
            || !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| !c.windows(3).any(|w| w == b"bmx"))
                .unwrap_or(true);
        if gone && instance != shared.instance {
            let scope = format!("{instance}/");
            let _ = tokio::task::spawn_blocking(move || {
                crate::process::sys::kill_scope(None, &scope);
            })
            .await;
        }
    }
    if entries.is_empty() {
        return;
    }
    let mut sessions = std::collections::BTreeSet::new();
    for e in entries {
        sessions.insert(e.session_id.clone());
        let restored = match e.method {
            Method::ToolResult => serde_json::from_slice::<ToolResultParams>(&e.body)
                .map_err(|x| x.to_string())
                .and_then(|v| {
                    into.results
                        .restore((e.session_id.clone(), e.key.clone()), v)
                        .map_err(|x| x.to_string())
                }),
            Method::SessionEvent => serde_json::from_slice::<SessionEventParams>(&e.body)
                .map_err(|x| x.to_string())
                .and_then(|v| {
                    into.events
                        .restore((e.session_id.clone(), v.sequence), v)
                        .map_err(|x| x.to_string())
                }),
            Method::SessionEnded => serde_json::from_slice::<EndedParams>(&e.body)
                .map(|v| {
                    into.held.insert(e.session_id.clone(), v);
                })
                .map_err(|x| x.to_string()),
            _ => Ok(()),
        };
        if let Err(why) = restored {
            tracing::error!(method = e.method.as_str(), session = %e.session_id, key = %e.key, error = %why,
                "journal: an entry cannot be read back; dropped");
            if let Err(x) = journal.remove(e.method, &e.session_id, &e.key) {
                tracing::warn!(error = %x, "journal: cannot drop the entry");
            }
        }
    }
    // Those sessions died with the previous run: each ends once its
    // results are delivered (its workspace goes with it).
    for s in &sessions {
        into.held.entry(s.clone()).or_insert_with(|| EndedParams {
            session_id: s.clone(),
            reason: crate::executor::journal::EXECUTOR_RESTARTED.to_owned(),
        });
        if shared.config.workspace.is_none() {
            let _ =
                std::fs::remove_dir_all(super::session::workspace_dir(&shared.config.work_root, s));
        }
    }
    tracing::info!(
        sessions = sessions.len(),
        results = into.results.outbox().len(),
        events = into.events.outbox().len(),
        "journal: delivering what the previous run owed"
    );
    journal.set_recovering(sessions);
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
        let me = myself.clone();
        let spec = DynamicSpec::new("sessions").on_exit(move |exit| {
            let _ = me.send_message(SessionsMsg::Exited(exit));
        });
        let sup = DynamicSupervisor::start_linked(spec, myself.get_cell()).await?;
        // A restart after a crash: the sessions of the crashed incarnation
        // died with it (their actors were killed, their cleanup did not
        // run). End each of them as a crashed session: kill what carries its
        // tag, remove its workspace, report `internal_error`.
        let orphaned: Vec<String> = shared.sessions.iter().map(|e| e.key().clone()).collect();
        let connected = shared.link().is_some();
        let mut ended = Delivery::new(Method::SessionEnded, true, ENDED_MAX, connected)
            .journaled(shared.journal.clone(), |s: &String| {
                (s.clone(), String::new())
            });
        let mut recovered = Recovered::new(&shared, connected);
        recover(&shared, &mut recovered).await;
        for session_id in orphaned {
            shared.sessions.remove(&session_id);
            let prefix = crate::executor::runtime::process_key(&session_id, "");
            shared.processes.retain(|k, _| !k.starts_with(&prefix));
            tracing::error!(session = %session_id, "session lost with a crashed sessions actor; ending it");
            let scope = super::session::session_scope(&shared.instance, &session_id);
            let workspace = super::session::workspace_dir(&shared.config.work_root, &session_id);
            let bound = shared.config.workspace.is_some();
            let (sandboxes, sid, root) = (
                shared.sandboxes.clone(),
                session_id.clone(),
                shared.config.work_root.clone(),
            );
            let _ = tokio::task::spawn_blocking(move || {
                sandboxes.kill_named(&crate::sandbox::session_name(&sid));
                let _ = crate::executor::workroot::remove_session_dir(
                    &root,
                    "private",
                    &crate::sandbox::session_name(&sid),
                );
                crate::process::sys::kill_scope(None, &scope);
                if !bound {
                    let _ = std::fs::remove_dir_all(workspace);
                }
            })
            .await;
            let params = EndedParams {
                session_id: session_id.clone(),
                reason: EndReason::INTERNAL_ERROR.to_owned(),
            };
            let _ = ended.push(session_id, params);
        }
        for params in recovered.release() {
            let _ = ended.push(params.session_id.clone(), params);
        }
        ended.pump(&shared, &myself, SessionsMsg::Ended);
        recovered
            .results
            .pump(&shared, &myself, SessionsMsg::RecoveredResults);
        recovered
            .events
            .pump(&shared, &myself, SessionsMsg::RecoveredEvents);
        Ok(SessionsState {
            shared,
            sup,
            sessions: HashMap::new(),
            ending: HashMap::new(),
            retired: HashMap::new(),
            clock: LeaseClock::new(crate::wire::types::RegisterResult::DEFAULT_LEASE_TTL_MS),
            origin: Instant::now(),
            connected,
            ended,
            drain: None,
            recovered,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SessionsMsg>,
        state: &mut SessionsState,
    ) -> Result<(), ActorProcessingErr> {
        state.shared.set_sessions_actor(None);
        // End every session in parallel; each kills its process tree.
        state.stop_all(EndReason::SHUTDOWN);
        dynamic::shutdown(&state.sup, Duration::from_secs(15)).await;
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
                self.assign(state, *p, reply).instrument(span).await
            }
            SessionsMsg::Registered { lease_ttl_ms } => {
                let now = state.now();
                state.clock.on_registered(now, lease_ttl_ms);
                state.connected = true;
                state.ended.connected();
                state.ended.pump(&state.shared, &myself, SessionsMsg::Ended);
                let r = &mut state.recovered;
                r.results.connected();
                r.results
                    .pump(&state.shared, &myself, SessionsMsg::RecoveredResults);
                r.events.connected();
                r.events
                    .pump(&state.shared, &myself, SessionsMsg::RecoveredEvents);
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
                state.ended.disconnected();
                state.recovered.results.disconnected();
                state.recovered.events.disconnected();
                for e in state.sessions.values() {
                    let _ = e.actor.send_message(SessionMsg::Disconnected);
                }
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
                    state.stop_all(EndReason::LEASE_EXPIRED);
                }
            }
            SessionsMsg::Drain { deadline, done } => {
                state.drain = Some(done);
                myself.send_after(deadline, || SessionsMsg::DrainDeadline);
                state.check_drained();
            }
            SessionsMsg::DrainDeadline => {
                state.stop_all(EndReason::DRAIN_DEADLINE);
            }
            SessionsMsg::Ending { session_id, reason } => {
                state.ending.insert(session_id, reason);
            }
            SessionsMsg::Exited(exit) => self.session_exited(&myself, state, exit),
            SessionsMsg::Panic => panic!("injected panic (test hook)"),
            SessionsMsg::Ended(event) => {
                if let (OutboxEvent::Acked(s), Some(j)) = (&event, &state.shared.journal) {
                    j.recovered_session_done(s);
                }
                state
                    .ended
                    .on_event(event, &state.shared, &myself, SessionsMsg::Ended);
                state.check_drained();
            }
            SessionsMsg::RecoveredResults(event) => {
                state.recovered.results.on_event(
                    event,
                    &state.shared,
                    &myself,
                    SessionsMsg::RecoveredResults,
                );
                self.release_recovered(&myself, state);
            }
            SessionsMsg::RecoveredEvents(event) => {
                // The harness wants another sequence first: it has this
                // one, or it lost earlier ones this journal no longer
                // holds. Either way this entry is done.
                let event = match event {
                    OutboxEvent::Expected(k, expected) => {
                        tracing::warn!(session = %k.0, sequence = k.1, expected, "recovered session.event refused; dropped");
                        OutboxEvent::Acked(k)
                    }
                    other => other,
                };
                state.recovered.events.on_event(
                    event,
                    &state.shared,
                    &myself,
                    SessionsMsg::RecoveredEvents,
                );
                self.release_recovered(&myself, state);
            }
        }
        Ok(())
    }
}

//! The leases actor: the harness's single source of truth for who holds
//! what.
//!
//! It wraps the sans-IO [`LeaseTable`] and drives it with the harness clock:
//! registrations (the 4004 rule: the table names the replaced connection and
//! this actor closes it *before* the newer register is answered; because the
//! actor handles one message at a time, two racing registers for one id
//! always end with exactly one survivor), frames seen, disconnects, grants,
//! and a timer armed at [`LeaseTable::next_deadline`] that closes silent
//! connections with 4008 and ends sessions whose orphaned lease ran out.
//!
//! It also owns the platform's view of sessions ([`Shared::sessions`]), the
//! waiters of tool calls and stops, and the exactly-once delivery of
//! `tool.result`: a `toolCallId` is delivered (waiter + event) once,
//! duplicates are acknowledged and dropped.

#![allow(clippy::result_large_err)]

use crate::harness::error::ApiError;
use crate::harness::runtime::Shared;
use crate::harness::types::{HarnessEvent, SessionInfo, SessionState};
use crate::lease::{ConnId, Grant, LeaseError, LeaseTable, Registered};
use crate::wire::types::{
    now_rfc3339, Accepted, EndedParams, EventDeltaParams, JsonMap, ProcessStatusParams,
    ReadyParams, SessionEventParams, SessionEventResult, SessionRefParams, StatusParams,
    ToolProgressParams, ToolResultParams,
};
use crate::wire::{
    decode_params, CloseCode, ErrorCode, Inbound, Link, Method, Responder, RpcError,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Tool results kept per session to answer a repeated call with the same id.
const RESULTS_KEPT: usize = 256;

type Timer = JoinHandle<Result<(), ractor::MessagingErr<LeasesMsg>>>;

pub type ToolWaiter = oneshot::Sender<Result<ToolResultParams, ApiError>>;

/// Where to send a session's requests: its holder's live link.
#[derive(Clone)]
pub struct Route {
    pub link: Link,
    pub executor_id: String,
    pub fencing_token: u64,
}

/// A fresh grant, to be sent as `session.assign`.
pub struct Assignment {
    pub grant: Grant,
    pub executor_id: String,
    pub link: Link,
}

pub enum LeasesMsg {
    /// `executor.register` on `conn`; answered once the registry and the
    /// leases are settled (and a replaced connection was closed with 4004).
    Register {
        conn: ConnId,
        executor_id: String,
        resume: Vec<String>,
        reply: oneshot::Sender<Registered>,
    },
    /// A frame arrived on `conn` (keeps it and its leases alive).
    Seen(ConnId),
    /// The socket of `conn` is gone.
    Disconnected(ConnId),
    /// Grant a session (the API's create).
    Assign {
        session_id: Option<String>,
        executor_id: Option<String>,
        metadata: JsonMap,
        reply: oneshot::Sender<Result<Assignment, ApiError>>,
    },
    /// The executor answered (or failed to answer) `session.assign`.
    AssignAnswered {
        session_id: String,
        fencing_token: u64,
        result: Result<(), ApiError>,
    },
    /// The live link of a session's holder.
    Route {
        session_id: String,
        reply: oneshot::Sender<Result<Route, ApiError>>,
    },
    /// Register a waiter for a tool call's result. The reply is `Ok(None)`
    /// when the result was already delivered (the waiter has it), or the
    /// route to send `tool.call` on.
    ToolWait {
        session_id: String,
        tool_call_id: String,
        waiter: ToolWaiter,
        reply: oneshot::Sender<Result<Option<Route>, ApiError>>,
    },
    /// Drop waiters that gave up.
    ToolForget {
        session_id: String,
        tool_call_id: String,
    },
    /// Begin stopping a session: `waiter` gets the session once it ended.
    /// The reply is the route to send `session.stop` on, or `None` when
    /// the session is already over (or ended at once, its holder being lost).
    Stop {
        session_id: String,
        waiter: oneshot::Sender<SessionInfo>,
        reply: oneshot::Sender<Result<Option<Route>, ApiError>>,
    },
    /// End a session now (the stop deadline passed).
    ForceEnd { session_id: String, reason: String },
    /// A session-scoped frame from an executor.
    Frame {
        conn: ConnId,
        method: Method,
        frame: Inbound,
        reply: Option<Responder>,
    },
    /// The timer: reap silent connections and expired leases.
    Tick,
}

#[derive(Default)]
struct SessionTools {
    waiters: HashMap<String, Vec<ToolWaiter>>,
    /// Every delivered id; the result itself only for the newest few.
    delivered: HashMap<String, Option<ToolResultParams>>,
    order: VecDeque<String>,
}

pub struct LeasesState {
    shared: Arc<Shared>,
    table: LeaseTable,
    timer: Option<(u64, Timer)>,
    tools: HashMap<String, SessionTools>,
    stop_waiters: HashMap<String, Vec<oneshot::Sender<SessionInfo>>>,
    /// Next expected `session.event` sequence per session.
    event_seq: HashMap<String, u64>,
    ended_order: VecDeque<String>,
}

pub struct Leases;

pub struct LeasesArgs {
    pub shared: Arc<Shared>,
    pub table: LeaseTable,
}

impl Actor for Leases {
    type Msg = LeasesMsg;
    type State = LeasesState;
    type Arguments = LeasesArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<LeasesMsg>,
        args: LeasesArgs,
    ) -> Result<LeasesState, ActorProcessingErr> {
        Ok(LeasesState {
            shared: args.shared,
            table: args.table,
            timer: None,
            tools: HashMap::new(),
            stop_waiters: HashMap::new(),
            event_seq: HashMap::new(),
            ended_order: VecDeque::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<LeasesMsg>,
        msg: LeasesMsg,
        state: &mut LeasesState,
    ) -> Result<(), ActorProcessingErr> {
        state.handle(msg);
        state.rearm(&myself);
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<LeasesMsg>,
        state: &mut LeasesState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some((_, t)) = state.timer.take() {
            t.abort();
        }
        Ok(())
    }
}

fn answer<R: serde::Serialize>(reply: Option<Responder>, result: Result<R, RpcError>) {
    match (reply, result) {
        (Some(r), result) => r.send(result),
        (None, Err(e)) => tracing::warn!(error = %e, "session frame refused"),
        (None, Ok(_)) => {}
    }
}

impl LeasesState {
    fn now(&self) -> u64 {
        self.shared.now_ms()
    }

    /// Arm the timer for the table's next deadline, unless an earlier one is
    /// already armed (a tick that finds nothing due just re-arms).
    fn rearm(&mut self, myself: &ActorRef<LeasesMsg>) {
        let Some(deadline) = self.table.next_deadline() else {
            return;
        };
        if let Some((armed, handle)) = &self.timer {
            if *armed <= deadline && !handle.is_finished() {
                return;
            }
        }
        if let Some((_, handle)) = self.timer.take() {
            handle.abort();
        }
        let wait = deadline.saturating_sub(self.now());
        let handle = myself.send_after(Duration::from_millis(wait + 1), || LeasesMsg::Tick);
        self.timer = Some((deadline, handle));
    }

    fn handle(&mut self, msg: LeasesMsg) {
        match msg {
            LeasesMsg::Register {
                conn,
                executor_id,
                resume,
                reply,
            } => {
                let r = self.register(conn, &executor_id, &resume);
                let _ = reply.send(r);
            }
            LeasesMsg::Seen(conn) => {
                let now = self.now();
                self.table.frame(conn, now);
            }
            LeasesMsg::Disconnected(conn) => self.disconnected(conn),
            LeasesMsg::Assign {
                session_id,
                executor_id,
                metadata,
                reply,
            } => {
                let _ = reply.send(self.assign(session_id, executor_id, metadata));
            }
            LeasesMsg::AssignAnswered {
                session_id,
                fencing_token,
                result,
            } => self.assign_answered(&session_id, fencing_token, result),
            LeasesMsg::Route { session_id, reply } => {
                let _ = reply.send(self.route(&session_id));
            }
            LeasesMsg::ToolWait {
                session_id,
                tool_call_id,
                waiter,
                reply,
            } => {
                let r = self.tool_wait(&session_id, tool_call_id, waiter);
                let _ = reply.send(r);
            }
            LeasesMsg::ToolForget {
                session_id,
                tool_call_id,
            } => {
                if let Some(t) = self.tools.get_mut(&session_id) {
                    if let Some(ws) = t.waiters.get_mut(&tool_call_id) {
                        ws.retain(|w| !w.is_closed());
                        if ws.is_empty() {
                            t.waiters.remove(&tool_call_id);
                        }
                    }
                }
            }
            LeasesMsg::Stop {
                session_id,
                waiter,
                reply,
            } => {
                let r = self.stop(&session_id, waiter);
                let _ = reply.send(r);
            }
            LeasesMsg::ForceEnd { session_id, reason } => self.end_session(&session_id, &reason),
            LeasesMsg::Frame {
                conn,
                method,
                frame,
                reply,
            } => self.frame(conn, method, frame, reply),
            LeasesMsg::Tick => self.tick(),
        }
    }

    fn register(&mut self, conn: ConnId, executor_id: &str, resume: &[String]) -> Registered {
        let now = self.now();
        let r = self.table.register(executor_id, conn, resume, now);
        if let Some(old) = r.replaced {
            // The older connection is closed first; only then is the newer
            // register answered (by the caller, after this reply).
            if let Some(link) = self.shared.link_of(old) {
                link.close(CloseCode::Replaced, "replaced");
            }
            tracing::info!(%executor_id, replaced = %old, by = %conn, "connection replaced (4004)");
        }
        self.shared.executors.insert(executor_id.to_owned(), conn);
        let conn_str = self
            .shared
            .conns
            .get(&conn)
            .map(|e| e.connection_id.clone());
        for s in &r.kept {
            if let Some(mut rec) = self.shared.sessions.get_mut(s) {
                rec.connection_id = conn_str.clone();
                if rec.state == SessionState::Disconnected {
                    rec.state = SessionState::Active;
                }
            }
        }
        for s in &r.ended {
            self.end_session(s, "lease_lost");
        }
        r
    }

    fn disconnected(&mut self, conn: ConnId) {
        let now = self.now();
        let executor = self.table.executor_of(conn).map(str::to_owned);
        let held = self.table.sessions_of(conn);
        self.table.disconnect(conn, now);
        if let Some(exec) = executor {
            self.shared.executors.remove_if(&exec, |_, c| *c == conn);
        }
        for s in held {
            if let Some(mut rec) = self.shared.sessions.get_mut(&s) {
                if matches!(
                    rec.state,
                    SessionState::Active | SessionState::Assigning | SessionState::Stopping
                ) {
                    rec.state = SessionState::Disconnected;
                }
            }
        }
    }

    fn assign(
        &mut self,
        session_id: Option<String>,
        executor_id: Option<String>,
        metadata: JsonMap,
    ) -> Result<Assignment, ApiError> {
        let session_id = match session_id {
            Some(s) if s.is_empty() || s.len() > 256 => {
                return Err(ApiError::bad_request(
                    "sessionId must be 1 to 256 characters",
                ))
            }
            Some(s) => s,
            None => format!("s-{}", uuid::Uuid::new_v4().simple()),
        };
        if let Some(rec) = self.shared.sessions.get(&session_id) {
            if rec.state != SessionState::Ended {
                return Err(ApiError::rpc(RpcError::conflict(
                    "session_exists",
                    format!("session {session_id:?} exists"),
                )));
            }
        }
        let executor_id = match executor_id {
            Some(e) => {
                if !self.shared.executors.contains_key(&e) {
                    return Err(ApiError::no_executor(format!(
                        "executor {e:?} is not connected"
                    )));
                }
                e
            }
            None => self
                .least_loaded()
                .ok_or_else(|| ApiError::no_executor("no executor is connected"))?,
        };
        let now = self.now();
        let grant = match self.table.assign(&session_id, &executor_id, now) {
            Ok(g) => g,
            Err(LeaseError::NoLiveConnection) => {
                return Err(ApiError::no_executor(format!(
                    "executor {executor_id:?} is not connected"
                )))
            }
            Err(e) => {
                return Err(ApiError::rpc(RpcError::conflict(
                    "already_leased",
                    e.to_string(),
                )))
            }
        };
        let Some(entry) = self.shared.conns.get(&grant.holder).map(|e| e.clone()) else {
            self.table.end(&session_id);
            return Err(ApiError::no_executor("the executor connection just closed"));
        };
        self.tools.remove(&session_id);
        self.event_seq.remove(&session_id);
        self.shared.sessions.insert(
            session_id.clone(),
            SessionInfo {
                session_id: session_id.clone(),
                executor_id: executor_id.clone(),
                connection_id: Some(entry.connection_id.clone()),
                fencing_token: grant.fencing_token,
                lease_token: grant.lease_token.clone(),
                state: SessionState::Assigning,
                ready: false,
                status: None,
                created_at: now_rfc3339(),
                ended_at: None,
                ended_reason: None,
                metadata,
                processes: Vec::new(),
            },
        );
        Ok(Assignment {
            grant,
            executor_id,
            link: entry.link,
        })
    }

    /// The registered executor with the fewest live sessions (ties: by id).
    fn least_loaded(&self) -> Option<String> {
        let mut load: HashMap<String, usize> = self
            .shared
            .executors
            .iter()
            .map(|e| (e.key().clone(), 0))
            .collect();
        for s in self.shared.sessions.iter() {
            if s.state != SessionState::Ended {
                if let Some(n) = load.get_mut(&s.executor_id) {
                    *n += 1;
                }
            }
        }
        load.into_iter()
            .min_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)))
            .map(|(e, _)| e)
    }

    fn assign_answered(&mut self, session_id: &str, token: u64, result: Result<(), ApiError>) {
        let current = self
            .shared
            .sessions
            .get(session_id)
            .map(|r| (r.fencing_token, r.state, r.executor_id.clone()));
        let Some((fencing, st, executor_id)) = current else {
            return;
        };
        if fencing != token {
            return;
        }
        match result {
            Ok(()) => {
                if st == SessionState::Assigning {
                    if let Some(mut rec) = self.shared.sessions.get_mut(session_id) {
                        rec.state = SessionState::Active;
                    }
                }
                self.shared.emit(HarnessEvent::SessionAssigned {
                    session_id: session_id.to_owned(),
                    executor_id,
                    fencing_token: token,
                });
            }
            Err(e) => {
                tracing::info!(session = %session_id, error = %e, "assignment failed");
                if self
                    .table
                    .holder(session_id)
                    .is_some_and(|h| h.fencing_token == token)
                {
                    self.table.end(session_id);
                }
                // The session never began for the platform.
                self.shared.sessions.remove(session_id);
                self.tools.remove(session_id);
            }
        }
    }

    fn route(&self, session_id: &str) -> Result<Route, ApiError> {
        let Some(rec) = self.shared.sessions.get(session_id).map(|r| r.clone()) else {
            return Err(ApiError::unknown_session(session_id));
        };
        if rec.state == SessionState::Ended {
            return Err(ApiError::session_ended(session_id));
        }
        let Some(view) = self.table.holder(session_id) else {
            return Err(ApiError::session_ended(session_id));
        };
        if view.expires_at.is_some() {
            return Err(ApiError::executor_disconnected(session_id));
        }
        let link = self
            .shared
            .link_of(view.conn)
            .filter(|l| !l.is_closed())
            .ok_or_else(|| ApiError::executor_disconnected(session_id))?;
        Ok(Route {
            link,
            executor_id: view.executor_id,
            fencing_token: view.fencing_token,
        })
    }

    fn tool_wait(
        &mut self,
        session_id: &str,
        tool_call_id: String,
        waiter: ToolWaiter,
    ) -> Result<Option<Route>, ApiError> {
        if let Some(t) = self.tools.get(session_id) {
            match t.delivered.get(&tool_call_id) {
                Some(Some(result)) => {
                    let _ = waiter.send(Ok(result.clone()));
                    return Ok(None);
                }
                Some(None) => {
                    return Err(ApiError::rpc(RpcError::conflict(
                        "tool_result_forgotten",
                        format!("tool call {tool_call_id:?} was delivered long ago"),
                    )))
                }
                None => {}
            }
        }
        let route = self.route(session_id)?;
        self.tools
            .entry(session_id.to_owned())
            .or_default()
            .waiters
            .entry(tool_call_id)
            .or_default()
            .push(waiter);
        Ok(Some(route))
    }

    fn stop(
        &mut self,
        session_id: &str,
        waiter: oneshot::Sender<SessionInfo>,
    ) -> Result<Option<Route>, ApiError> {
        let Some(rec) = self.shared.sessions.get(session_id).map(|r| r.clone()) else {
            return Err(ApiError::unknown_session(session_id));
        };
        if rec.state == SessionState::Ended {
            let _ = waiter.send(rec);
            return Ok(None);
        }
        self.stop_waiters
            .entry(session_id.to_owned())
            .or_default()
            .push(waiter);
        match self.route(session_id) {
            Ok(route) => {
                if let Some(mut r) = self.shared.sessions.get_mut(session_id) {
                    r.state = SessionState::Stopping;
                }
                Ok(Some(route))
            }
            Err(_) => {
                // No live holder: nobody to ask, the session ends here (an
                // executor that resumes it later is told to stop).
                self.end_session(session_id, "stopped");
                Ok(None)
            }
        }
    }

    /// The platform's view of a session ends: its lease is dropped, waiting
    /// tool calls fail with `tool_outcome_unknown`, stop waiters are answered.
    fn end_session(&mut self, session_id: &str, reason: &str) {
        self.table.end(session_id);
        let info = {
            let Some(mut rec) = self.shared.sessions.get_mut(session_id) else {
                return;
            };
            if rec.state == SessionState::Ended {
                return;
            }
            rec.state = SessionState::Ended;
            rec.ended_at = Some(now_rfc3339());
            rec.ended_reason = Some(reason.to_owned());
            rec.clone()
        };
        tracing::info!(session = %session_id, %reason, "session ended");
        if let Some(t) = self.tools.remove(session_id) {
            for (id, ws) in t.waiters {
                for w in ws {
                    let _ = w.send(Err(ApiError::tool_outcome_unknown(&id)));
                }
            }
        }
        for w in self.stop_waiters.remove(session_id).unwrap_or_default() {
            let _ = w.send(info.clone());
        }
        self.event_seq.remove(session_id);
        self.shared.emit(HarnessEvent::SessionEnded {
            session_id: session_id.to_owned(),
            reason: reason.to_owned(),
        });
        self.ended_order.push_back(session_id.to_owned());
        while self.ended_order.len() > self.shared.config.ended_sessions_kept.max(1) {
            if let Some(old) = self.ended_order.pop_front() {
                self.shared
                    .sessions
                    .remove_if(&old, |_, r| r.state == SessionState::Ended);
            }
        }
    }

    fn tick(&mut self) {
        let now = self.now();
        let tick = self.table.tick(now);
        for conn in tick.silent {
            if let Some(entry) = self.shared.conns.get(&conn) {
                tracing::info!(executor_id = %entry.executor_id, connection_id = %entry.connection_id, "no frame within the lease TTL: closing with 4008");
                entry.link.close(CloseCode::LeaseExpired, "lease expired");
                self.shared
                    .executors
                    .remove_if(&entry.executor_id, |_, c| *c == conn);
            }
        }
        for s in tick.expired {
            self.end_session(&s, "lease_expired");
        }
    }

    fn lease_error(&self, session_id: &str, e: LeaseError) -> RpcError {
        let (reason, msg) = match e {
            LeaseError::NotHolder => (
                "not_holder",
                "this connection does not hold the session's lease",
            ),
            LeaseError::Expired => ("lease_expired", "the session's lease has expired"),
            LeaseError::UnknownSession => {
                if !self.shared.sessions.contains_key(session_id) {
                    return RpcError::session_not_active(session_id).with_reason("unknown_session");
                }
                ("lease_ended", "the session's lease has ended")
            }
            _ => (
                "not_holder",
                "this connection does not hold the session's lease",
            ),
        };
        RpcError::new(ErrorCode::LeaseExpired, msg).with_reason(reason)
    }

    fn frame(
        &mut self,
        conn: ConnId,
        method: Method,
        frame: Inbound,
        mut reply: Option<Responder>,
    ) {
        let Some(SessionRefParams { session_id }) = decode_params(&frame, &mut reply) else {
            return;
        };
        let now = self.now();
        if let Err(e) = self.table.check_frame(conn, &session_id, now) {
            // A repeated session.ended for a session already over is
            // acknowledged again (the executor retries until it is).
            if method == Method::SessionEnded {
                let ended_here = self.shared.sessions.get(&session_id).is_some_and(|r| {
                    r.state == SessionState::Ended
                        && self.table.executor_of(conn) == Some(r.executor_id.as_str())
                });
                if ended_here {
                    return answer(reply, Ok(Accepted::YES));
                }
            }
            tracing::debug!(session = %session_id, %method, error = %e, "session frame fenced");
            let err = self.lease_error(&session_id, e);
            return answer::<Accepted>(reply, Err(err));
        }
        match method {
            Method::SessionReady => {
                let Some(_p) = decode_params::<ReadyParams>(&frame, &mut reply) else {
                    return;
                };
                if let Some(mut rec) = self.shared.sessions.get_mut(&session_id) {
                    rec.ready = true;
                }
                self.shared.emit(HarnessEvent::SessionReady {
                    session_id: session_id.clone(),
                });
                answer(reply, Ok(Accepted::YES));
            }
            Method::SessionEnded => {
                let Some(p) = decode_params::<EndedParams>(&frame, &mut reply) else {
                    return;
                };
                self.end_session(&session_id, &p.reason);
                answer(reply, Ok(Accepted::YES));
            }
            Method::SessionStatus => {
                let Some(p) = decode_params::<StatusParams>(&frame, &mut reply) else {
                    return;
                };
                if let Some(mut rec) = self.shared.sessions.get_mut(&session_id) {
                    rec.status = Some(p.status);
                }
                self.shared.emit(HarnessEvent::SessionStatus {
                    session_id,
                    status: p.status,
                    detail: p.detail,
                });
            }
            Method::ToolResult => {
                let Some(p) = decode_params::<ToolResultParams>(&frame, &mut reply) else {
                    return;
                };
                self.tool_result(p);
                answer(reply, Ok(Accepted::YES));
            }
            Method::ToolProgress => {
                if let Some(p) = decode_params::<ToolProgressParams>(&frame, &mut reply) {
                    self.shared.emit(HarnessEvent::ToolProgress(p));
                }
            }
            Method::ProcessStatus => {
                let Some(p) = decode_params::<ProcessStatusParams>(&frame, &mut reply) else {
                    return;
                };
                if let Some(mut rec) = self.shared.sessions.get_mut(&session_id) {
                    let pos = rec
                        .processes
                        .iter()
                        .position(|x| x.process_id == p.process_id);
                    match pos {
                        Some(i) => rec.processes[i] = p.clone(),
                        None if rec.processes.len() < 4096 => {
                            rec.processes.push(p.clone());
                            rec.processes
                                .sort_by(|a, b| a.process_id.cmp(&b.process_id));
                        }
                        None => {}
                    }
                }
                self.shared.emit(HarnessEvent::ProcessStatus(p));
            }
            Method::SessionEvent => {
                let Some(p) = decode_params::<SessionEventParams>(&frame, &mut reply) else {
                    return;
                };
                let expected = self.event_seq.get(&session_id).copied();
                let ok = match expected {
                    None => true,
                    Some(n) => p.sequence == n,
                };
                if !ok {
                    let n = expected.unwrap_or(0);
                    // A resent event already acknowledged: acknowledge again.
                    if p.sequence < n {
                        return answer(
                            reply,
                            Ok(SessionEventResult {
                                accepted: true,
                                acked_sequence: n - 1,
                                event_id: p.event_id,
                            }),
                        );
                    }
                    return answer::<Accepted>(
                        reply,
                        Err(
                            RpcError::conflict("unexpected_sequence", "event sequence has a hole")
                                .with_expected_sequence(n),
                        ),
                    );
                }
                self.event_seq.insert(session_id, p.sequence + 1);
                let result = SessionEventResult {
                    accepted: true,
                    acked_sequence: p.sequence,
                    event_id: p.event_id.clone(),
                };
                self.shared.emit(HarnessEvent::SessionEvent(p));
                answer(reply, Ok(result));
            }
            Method::SessionEventDelta => {
                if let Some(p) = decode_params::<EventDeltaParams>(&frame, &mut reply) {
                    self.shared.emit(HarnessEvent::SessionEventDelta(p));
                }
            }
            Method::InteractionRequest | Method::InteractionCancel => {
                let Some(params) = decode_params::<serde_json::Value>(&frame, &mut reply) else {
                    return;
                };
                let id = params
                    .get("interactionId")
                    .and_then(|v| v.as_str())
                    .unwrap_or_default()
                    .to_owned();
                self.shared.emit(HarnessEvent::Other {
                    method: method.as_str().to_owned(),
                    params,
                });
                if method == Method::InteractionRequest {
                    answer(
                        reply,
                        Ok(serde_json::json!({"accepted": true, "platformInteractionId": id})),
                    );
                } else {
                    answer(reply, Ok(Accepted::YES));
                }
            }
            other => answer::<Accepted>(reply, Err(RpcError::method_not_found(other.as_str()))),
        }
    }

    /// Exactly once: the first result for a `toolCallId` goes to its
    /// waiters and the event stream; repeats are only acknowledged.
    fn tool_result(&mut self, p: ToolResultParams) {
        let t = self.tools.entry(p.session_id.clone()).or_default();
        if t.delivered.contains_key(&p.tool_call_id) {
            tracing::debug!(tool_call = %p.tool_call_id, "duplicate tool.result acknowledged");
            return;
        }
        t.delivered.insert(p.tool_call_id.clone(), Some(p.clone()));
        t.order.push_back(p.tool_call_id.clone());
        if t.order.len() > RESULTS_KEPT {
            if let Some(old) = t.order.pop_front() {
                t.delivered.insert(old, None);
            }
        }
        for w in t.waiters.remove(&p.tool_call_id).unwrap_or_default() {
            let _ = w.send(Ok(p.clone()));
        }
        self.shared.emit(HarnessEvent::ToolResult(p));
    }
}

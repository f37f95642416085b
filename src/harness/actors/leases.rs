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
//! It also publishes the platform's view of sessions ([`Shared::sessions`]),
//! holds the waiters of tool calls and stops, and delivers `tool.result`
//! exactly once. The rules of all three are sans-IO cores in
//! [`crate::lease`] ([`LeaseTable`], [`SessionViews`], [`ToolResults`]);
//! this actor feeds them the harness clock and frames, and carries out what
//! they return. The agent stream's frames (`session.event`, deltas,
//! interactions) are fenced here like every session-scoped frame, then
//! handed to the session's stream actor ([`super::turns`]).
//!
//! The actor is `permanent` under the harness root supervisor. Everything
//! it must not lose is outside it: fencing counters in the [`LeaseStore`],
//! sessions, connections and orphaned-lease deadlines in [`Shared`]. So
//! `pre_start` rebuilds its state from those (the first start finds them
//! empty), and a crash loses no lease and never lowers a fencing token. What
//! a crash does lose: the waiters of calls in flight (their callers get an
//! error, see `api::sessions`), the memory of results already delivered
//! (a duplicate `tool.result` arriving after a crash is published again).

#![allow(clippy::result_large_err)]

use super::mcp::{self, McpMsg};
use super::turns::{self, TurnsMsg};
use crate::harness::api::mcp::McpServerInfo;
use crate::harness::error::ApiError;
use crate::harness::runtime::Shared;
use crate::harness::store::durable::StoredResult;
use crate::harness::types::{HarnessEvent, SessionInfo, SessionState};
use crate::lease::session_view::{Restored, ViewEntry};
use crate::lease::{
    ConnId, Delivery, Grant, LeaseError, LeaseStore, LeaseTable, Lookup, Registered, RestoredLease,
    SessionViews, StopStart, ToolResults, ViewEffect,
};
use crate::wire::types::{
    now_rfc3339, Accepted, ConnectionOrigin, EndedParams, EventDeltaParams,
    InteractionCancelParams, InteractionRequestParams, JsonMap, McpServerState,
    ProcessStatusParams, ReadyParams, SessionEventParams, SessionRefParams, StatusParams,
    ToolProgressParams, ToolResultParams,
};
use crate::wire::{
    decode_params, CloseCode, ErrorCode, Inbound, Link, Method, Responder, RpcError,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;
use tokio::sync::oneshot;

/// Tool results kept per session to answer a repeated call with the same id.
const RESULTS_KEPT: usize = 256;

pub type ToolWaiter = oneshot::Sender<Result<ToolResultParams, ApiError>>;
type StopWaiter = oneshot::Sender<SessionInfo>;

/// Where to send a session's requests: its holder's live link.
#[derive(Clone)]
pub struct Route {
    pub link: Link,
    /// The holder connection (MCP channels check their frames come on it).
    pub conn: ConnId,
    pub executor_id: String,
    pub fencing_token: u64,
}

impl Route {
    /// Send a session-scoped request to the holder under this route's
    /// grant: `params` go with the bmx extension `fencingToken` (the
    /// executor refuses a grant older than the newest it saw with -32009
    /// `stale_fencing_token`; docs/protocol.md).
    ///
    /// # Errors
    ///
    /// As [`Link::request`].
    pub async fn request<P: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        params: &P,
        timeout: std::time::Duration,
    ) -> Result<R, crate::wire::CallError> {
        let fenced = crate::wire::request::Fenced {
            params,
            fencing_token: self.fencing_token,
        };
        self.link.request(method, &fenced, timeout).await
    }
}

/// A fresh grant, to be sent as `session.assign`.
pub struct Assignment {
    pub grant: Grant,
    pub executor_id: String,
    pub link: Link,
    /// The store ticket of the session's record: `session.assign` goes out
    /// only once it is durable (docs/store.md). `None`: no durable store.
    pub durable: Option<u64>,
    /// The fencing token of the session's grant this harness knew before
    /// this one (a reused id), for the replicas' claim in the database.
    pub previous: Option<u64>,
}

/// A session another replica granted, taken over by this one for a
/// resumed register (docs/store.md, "Takeover"): its record under the new
/// grant (already claimed in the database) and the tool results delivered
/// under the old one.
pub struct Adopted {
    pub info: SessionInfo,
    pub results: Vec<StoredResult>,
}

pub enum LeasesMsg {
    /// `executor.register` on `conn`; answered once the registry and the
    /// leases are settled (and a replaced connection was closed with 4004).
    /// `settled`: over several replicas, what the database decided for
    /// the sessions of `resume` (stale copies dropped first, sessions taken
    /// over adopted, and kept if `resume` lists them).
    Register {
        conn: ConnId,
        executor_id: String,
        resume: Vec<String>,
        settled: crate::harness::replica::ResumeSettlement,
        reply: oneshot::Sender<Registered>,
    },
    /// Over several replicas: the database's answer to an expiry this
    /// actor's clock found due ([`crate::harness::rows::expire`]).
    Expiry {
        session_id: String,
        fencing_token: u64,
        outcome: Result<crate::harness::rows::Expiry, String>,
    },
    /// Over several replicas: this replica's copy of grant `fencing_token`
    /// is stale (the row names another grant): drop it, stop nothing.
    Superseded {
        session_id: String,
        fencing_token: u64,
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
        /// The session's MCP servers, redacted (what the platform sees).
        mcp_servers: Vec<McpServerInfo>,
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
    /// Fail on purpose, so tests can check the supervision. Not reachable
    /// from the wire or the HTTP API.
    #[doc(hidden)]
    InjectPanic,
}

pub struct LeasesState {
    shared: Arc<Shared>,
    table: LeaseTable,
    timer: super::DeadlineTimer<LeasesMsg>,
    views: SessionViews<StopWaiter>,
    tools: ToolResults<ToolWaiter, ToolResultParams>,
}

#[derive(Clone)]
pub struct Leases;

#[derive(Clone)]
pub struct LeasesArgs {
    pub shared: Arc<Shared>,
    /// Where fencing counters live; shared by every incarnation of the actor.
    pub store: Arc<dyn LeaseStore>,
}

impl Actor for Leases {
    type Msg = LeasesMsg;
    type State = LeasesState;
    type Arguments = LeasesArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<LeasesMsg>,
        args: LeasesArgs,
    ) -> Result<LeasesState, ActorProcessingErr> {
        let mut state = LeasesState::rebuild(args.shared, args.store);
        // Delivered results come back from the store, so a resent
        // `tool.result` stays a duplicate across a crash or a restart.
        if let Some(d) = state.shared.durable.get().cloned() {
            match tokio::task::spawn_blocking(move || d.load()).await {
                Ok(Ok((_, results))) => state.seed_results(results),
                Ok(Err(e)) => return Err(Box::new(e)),
                Err(e) => return Err(Box::new(e)),
            }
        }
        // Reap whatever ran out while no actor was watching, and arm the timer.
        myself.send_message(LeasesMsg::Tick)?;
        state.shared.set_leases(myself);
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<LeasesMsg>,
        msg: LeasesMsg,
        state: &mut LeasesState,
    ) -> Result<(), ActorProcessingErr> {
        if matches!(msg, LeasesMsg::Tick) {
            state.timer.fired();
        }
        state.handle(msg);
        // `LeaseTable::next_deadline` never moves earlier while it has a
        // value (see its doc), so a timer armed at it stays right until it
        // fires. Computing it walks every connection and lease: doing that
        // after every frame made each heartbeat cost O(executors), and
        // 10 000 executors at 1 Hz one full core (docs/benchmarks.md).
        if !state.timer.is_armed() {
            state.rearm(&myself);
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<LeasesMsg>,
        state: &mut LeasesState,
    ) -> Result<(), ActorProcessingErr> {
        state.timer.cancel();
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
    /// The state of a new incarnation, from what outlives the actor: the
    /// fencing counters in `store`, the registered connections, and the
    /// published sessions with their orphaned-lease deadlines.
    fn rebuild(shared: Arc<Shared>, store: Arc<dyn LeaseStore>) -> LeasesState {
        let now = shared.now_ms();
        // The registry names one live connection per executor; trust it
        // only for connections still present and registered.
        let mut live: Vec<(String, ConnId)> = shared
            .executors
            .iter()
            .filter(|e| {
                shared
                    .conns
                    .get(e.value())
                    .is_some_and(|c| c.registered && &c.executor_id == e.key())
            })
            .map(|e| (e.key().clone(), *e.value()))
            .collect();
        live.sort();
        let conn_of = |connection_id: &Option<String>| {
            connection_id.as_ref().and_then(|id| {
                shared
                    .conns
                    .iter()
                    .find(|c| &c.connection_id == id)
                    .map(|c| c.conn)
            })
        };
        let mut records: Vec<SessionInfo> = shared.sessions.iter().map(|r| r.clone()).collect();
        // Ended sessions oldest first, so retention forgets in the same order.
        records.sort_by(|a, b| {
            a.ended_at
                .cmp(&b.ended_at)
                .then_with(|| a.session_id.cmp(&b.session_id))
        });
        let mut leases = Vec::new();
        let mut restored = Vec::new();
        for r in &records {
            if r.state != SessionState::Ended {
                leases.push(RestoredLease {
                    session_id: r.session_id.clone(),
                    executor_id: r.executor_id.clone(),
                    // ConnId(0) is never minted: "the holder is gone".
                    holder: conn_of(&r.connection_id).unwrap_or(ConnId(0)),
                    lease_token: r.lease_token.clone(),
                    fencing_token: r.fencing_token,
                    expires_at: shared.lease_deadlines.get(&r.session_id).map(|d| *d),
                });
            }
            restored.push(Restored {
                session_id: r.session_id.clone(),
                entry: ViewEntry {
                    executor_id: r.executor_id.clone(),
                    fencing_token: r.fencing_token,
                    state: r.state,
                    ended_reason: r.ended_reason.clone(),
                },
            });
        }
        let table = LeaseTable::restore(shared.config.lease_ttl_ms, store, &live, leases, now);
        let (views, effects) = SessionViews::restore(shared.config.ended_sessions_kept, restored);
        if !records.is_empty() {
            tracing::info!(
                sessions = records.len(),
                executors = live.len(),
                "leases rebuilt from the store and the published sessions"
            );
        }
        let mut state = LeasesState {
            shared,
            table,
            timer: Default::default(),
            views,
            tools: ToolResults::new(RESULTS_KEPT),
        };
        state.apply(effects);
        // Sessions whose holder is gone but that were still published as
        // held become `disconnected`, as the table now sees them.
        let orphaned: Vec<String> = state
            .views
            .iter()
            .filter(|(s, _)| {
                state
                    .table
                    .holder(s)
                    .is_some_and(|h| h.expires_at.is_some())
            })
            .map(|(s, _)| s.clone())
            .collect();
        let effects = state.views.disconnected(&orphaned);
        state.record_deadlines(&orphaned);
        state.apply(effects);
        state
    }

    fn now(&self) -> u64 {
        self.shared.now_ms()
    }

    /// Results of the sessions' current grants, oldest first, as delivered
    /// (no waiter can exist yet).
    fn seed_results(&mut self, results: Vec<StoredResult>) {
        let mut n = 0usize;
        for r in results {
            let current = self.views.get(&r.session_id).is_some_and(|v| {
                v.fencing_token == r.fencing_token && v.state != SessionState::Ended
            });
            if current {
                let _ = self.tools.result(&r.session_id, &r.tool_call_id, r.result);
                n += 1;
            }
        }
        if n > 0 {
            tracing::info!(
                results = n,
                "delivered tool results restored from the store"
            );
        }
    }

    /// Write a session's record through to the durable store (if any);
    /// the ticket says when it is durable.
    fn persist(&self, session_id: &str) -> Option<u64> {
        let d = self.shared.durable.get()?;
        match self.shared.stored_session(session_id) {
            Some(s) => Some(d.put_session(s)),
            None => Some(d.delete_session(session_id)),
        }
    }

    /// Publish what the session-view core decided.
    fn apply(&mut self, effects: Vec<ViewEffect<StopWaiter>>) {
        for effect in effects {
            match effect {
                ViewEffect::State { session_id, state } => {
                    if let Some(mut rec) = self.shared.sessions.get_mut(&session_id) {
                        rec.state = state;
                    }
                    self.persist(&session_id);
                }
                ViewEffect::Assigned {
                    session_id,
                    executor_id,
                    fencing_token,
                } => self.shared.emit(HarnessEvent::SessionAssigned {
                    session_id,
                    executor_id,
                    fencing_token,
                }),
                ViewEffect::Ended {
                    session_id,
                    reason,
                    waiters,
                } => self.ended(&session_id, &reason, waiters),
                ViewEffect::Forget { session_id } => {
                    turns::forget(&self.shared, &session_id);
                    let gone = self.shared.sessions.remove(&session_id);
                    self.shared.lease_deadlines.remove(&session_id);
                    match (gone, self.shared.durable.get()) {
                        // Only this grant's row: over a store shared by
                        // replicas a newer grant may be another's.
                        (Some((_, rec)), Some(d)) => {
                            d.delete_grant(&session_id, rec.fencing_token);
                        }
                        _ => {
                            self.persist(&session_id);
                        }
                    }
                }
            }
        }
    }

    /// Keep the deadline of each orphaned lease where a rebuilt actor finds it.
    fn record_deadlines(&self, sessions: &[String]) {
        for s in sessions {
            if let Some(at) = self.table.holder(s).and_then(|h| h.expires_at) {
                self.shared.lease_deadlines.insert(s.clone(), at);
                self.persist(s);
            }
        }
    }

    /// Arm the timer for the table's next deadline, unless an earlier one is
    /// already armed (a tick that finds nothing due just re-arms).
    fn rearm(&mut self, myself: &ActorRef<LeasesMsg>) {
        let now = self.now();
        self.timer
            .arm(myself, self.table.next_deadline(), now, || LeasesMsg::Tick);
    }

    fn handle(&mut self, msg: LeasesMsg) {
        match msg {
            LeasesMsg::Register {
                conn,
                executor_id,
                resume,
                settled,
                reply,
            } => {
                for (session_id, token) in &settled.drop {
                    self.supersede(session_id, *token);
                }
                for a in settled.adopt {
                    self.adopt(&executor_id, a);
                }
                // Kept by the database: if this table let the lease run out
                // meanwhile (its expiry waits for the database's answer),
                // the same grant is put back, so the register keeps it.
                let now = self.now();
                for (session_id, token) in &settled.kept {
                    if self.table.holder(session_id).is_none()
                        && self.views.get(session_id).is_some_and(|v| {
                            v.fencing_token == *token && v.state != SessionState::Ended
                        })
                    {
                        let _ = self.table.adopt_until(
                            session_id,
                            &executor_id,
                            *token,
                            now.saturating_add(self.table.lease_ttl_ms()),
                        );
                    }
                }
                let mut r = self.register(conn, &executor_id, &resume);
                // Another replica's statement won the row: not ours to stop.
                r.to_stop.retain(|s| !settled.leave.contains(s));
                let _ = reply.send(r);
            }
            LeasesMsg::Expiry {
                session_id,
                fencing_token,
                outcome,
            } => self.expiry_decided(&session_id, fencing_token, outcome),
            LeasesMsg::Superseded {
                session_id,
                fencing_token,
            } => self.supersede(&session_id, fencing_token),
            LeasesMsg::Seen(conn) => {
                let now = self.now();
                self.table.frame(conn, now);
            }
            LeasesMsg::Disconnected(conn) => self.disconnected(conn),
            LeasesMsg::Assign {
                session_id,
                executor_id,
                metadata,
                mcp_servers,
                reply,
            } => {
                let _ = reply.send(self.assign(session_id, executor_id, metadata, mcp_servers));
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
                self.tools
                    .retain_waiters(&session_id, &tool_call_id, |w| !w.is_closed());
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
            LeasesMsg::InjectPanic => panic!("panic injected into the leases actor"),
        }
    }

    /// Put a session taken over from another replica into the table (an
    /// orphaned lease under the new grant, kept by the register that
    /// follows), the published map and the views (`active`), with the
    /// results delivered under the old grant as delivered. A session this
    /// replica already holds under a newer grant is left alone.
    fn adopt(&mut self, executor_id: &str, a: Adopted) {
        let session_id = a.info.session_id.clone();
        let token = a.info.fencing_token;
        let now = self.now();
        if let Err(e) = self.table.adopt(&session_id, executor_id, token, now) {
            tracing::warn!(session = %session_id, error = %e, "takeover refused by the lease table");
            return;
        }
        if self.views.create(&session_id, executor_id, token).is_err() {
            tracing::warn!(session = %session_id, "takeover of a session still running here");
            return;
        }
        for (id, w) in self.tools.end(&session_id) {
            let _ = w.send(Err(ApiError::tool_outcome_unknown(&id)));
        }
        let mut info = a.info;
        info.state = SessionState::Assigning;
        self.shared.sessions.insert(session_id.clone(), info);
        let effects = self.views.assign_answered(&session_id, token, true);
        self.apply(effects);
        for r in a.results {
            let _ = self.tools.result(&r.session_id, &r.tool_call_id, r.result);
        }
        tracing::info!(session = %session_id, fencing_token = token, "session taken over from another replica");
    }

    /// This replica's copy of grant `token` of `session_id` is stale: the
    /// database's row names another grant (issue 54). Forget it without
    /// ending it: nothing is written (the row is not ours), nothing is
    /// stopped on the executor, no `session_ended` is published; waiters of
    /// calls in flight learn their outcome is unknown here. Calls about the
    /// session are forwarded to the row's replica from now on.
    fn supersede(&mut self, session_id: &str, token: u64) {
        let current = self.views.get(session_id).map(|v| v.fencing_token);
        if current.is_some_and(|t| t > token) {
            return;
        }
        self.table.supersede(session_id, token);
        let waiters = self.views.supersede(session_id, token).unwrap_or_default();
        for (id, w) in self.tools.end(session_id) {
            let _ = w.send(Err(ApiError::tool_outcome_unknown(&id)));
        }
        let info = self.shared.sessions.remove(session_id).map(|(_, i)| i);
        self.shared.lease_deadlines.remove(session_id);
        if let Some(d) = self.shared.durable.get() {
            // Writes of this copy still queued lose to the row anyway
            // (they are conditional on its token); none is added.
            let _ = d;
        }
        if let Some(mut info) = info {
            info.state = SessionState::Ended;
            info.ended_reason = Some("superseded".into());
            for w in waiters {
                let _ = w.send(info.clone());
            }
        }
        mcp::session_ended(&self.shared, session_id, "superseded");
        turns::forget(&self.shared, session_id);
        self.shared.metrics.superseded.inc();
        self.shared.routes_changed();
        tracing::info!(session = %session_id, fencing_token = token,
            "superseded by another grant in the store: this replica's copy dropped, nothing stopped");
    }

    /// Over several replicas, a lease this actor's clock found run out is
    /// ended only if the database agrees, by its own clock, that it is
    /// this replica's grant and ran out (one conditional `UPDATE`,
    /// [`crate::harness::rows::expire`]). Until the answer the session is
    /// `disconnected` with no lease here.
    fn expire_by_store(&mut self, session_id: &str) {
        let Some(replica) = self.shared.replica.get() else {
            return self.end_session(session_id, "lease_expired");
        };
        let Some(view) = self.views.get(session_id).cloned() else {
            return;
        };
        if view.state == SessionState::Ended {
            return;
        }
        let now = self.now();
        let deadline = self
            .shared
            .lease_deadlines
            .get(session_id)
            .map_or(now, |d| *d);
        let holder = self
            .shared
            .sessions
            .get(session_id)
            .and_then(|r| r.connection_id.clone());
        let db = replica.db.clone();
        let leases = self.shared.leases();
        let (sid, token) = (session_id.to_owned(), view.fencing_token);
        let local_now = self.now();
        tokio::spawn(async move {
            let sid2 = sid.clone();
            let outcome = tokio::task::spawn_blocking(move || {
                let me = db.id().to_owned();
                crate::harness::rows::expire(
                    &*db,
                    &sid2,
                    token,
                    &me,
                    holder.as_deref(),
                    deadline,
                    local_now,
                    None,
                )
                .map_err(|e| e.to_string())
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
            if let Some(l) = leases {
                let _ = l.send_message(LeasesMsg::Expiry {
                    session_id: sid,
                    fencing_token: token,
                    outcome,
                });
            }
        });
    }

    fn expiry_decided(
        &mut self,
        session_id: &str,
        token: u64,
        outcome: Result<crate::harness::rows::Expiry, String>,
    ) {
        use crate::harness::rows::Expiry;
        let Some(view) = self.views.get(session_id).cloned() else {
            return;
        };
        if view.fencing_token != token || view.state == SessionState::Ended {
            return;
        }
        match outcome {
            Ok(Expiry::Ended) => {
                if self
                    .table
                    .holder(session_id)
                    .is_some_and(|h| h.expires_at.is_none())
                {
                    // Resumed here meanwhile: the keep came after.
                    return;
                }
                self.table.end(session_id);
                self.shared.metrics.lease_expiries.inc();
                self.end_session(session_id, "lease_expired");
            }
            Ok(Expiry::Superseded) => self.supersede(session_id, token),
            Ok(Expiry::NotYet { remaining_ms }) => {
                self.expiry_later(session_id, &view, remaining_ms)
            }
            Err(e) => {
                tracing::warn!(session = %session_id, error = %e,
                    "cannot ask the store whether a lease ran out; asking again");
                self.expiry_later(session_id, &view, 1_000);
            }
        }
    }

    /// Put the lease back until `remaining_ms` from now (at least 100 ms),
    /// when this actor's timer asks the database again.
    fn expiry_later(&mut self, session_id: &str, view: &ViewEntry, remaining_ms: u64) {
        if self.table.holder(session_id).is_some() {
            return;
        }
        let at = self.now().saturating_add(remaining_ms.max(100));
        if self
            .table
            .adopt_until(session_id, &view.executor_id, view.fencing_token, at)
            .is_ok()
        {
            // An earlier deadline than the armed one: arm again.
            self.timer.cancel();
            tracing::debug!(session = %session_id, remaining_ms, "lease not run out by the store's clock yet");
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
            self.shared.metrics.replacements.inc();
            tracing::info!(%executor_id, replaced = %old, by = %conn, "connection replaced (4004)");
        }
        self.shared.executors.insert(executor_id.to_owned(), conn);
        let conn_str = self
            .shared
            .conns
            .get(&conn)
            .map(|e| e.connection_id.clone());
        for s in &r.kept {
            self.shared.lease_deadlines.remove(s);
            if let Some(mut rec) = self.shared.sessions.get_mut(s) {
                rec.connection_id = conn_str.clone();
            }
            self.persist(s);
        }
        let effects = self.views.resumed(&r.kept);
        self.apply(effects);
        for s in &r.ended {
            self.end_session(s, "lease_lost");
        }
        // Requests lost with the old connection are sent again now.
        self.shared.routes_changed();
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
        self.record_deadlines(&held);
        let effects = self.views.disconnected(&held);
        self.apply(effects);
    }

    fn assign(
        &mut self,
        session_id: Option<String>,
        executor_id: Option<String>,
        metadata: JsonMap,
        mcp_servers: Vec<McpServerInfo>,
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
        let exists = || {
            ApiError::rpc(RpcError::conflict(
                "session_exists",
                format!("session {session_id:?} exists"),
            ))
        };
        if !self.views.can_create(&session_id) {
            return Err(exists());
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
            None => {
                // A draining executor refuses assigns: never place there.
                let registered: Vec<String> = self
                    .shared
                    .executors
                    .iter()
                    .filter(|e| !self.shared.conns.get(e.value()).is_some_and(|c| c.draining))
                    .map(|e| e.key().clone())
                    .collect();
                self.views
                    .least_loaded(registered.iter().map(String::as_str))
                    .ok_or_else(|| ApiError::no_executor("no executor is connected"))?
            }
        };
        let now = self.now();
        let grant = match self.table.assign(&session_id, &executor_id, now) {
            Ok(g) => g,
            Err(LeaseError::NoLiveConnection) => {
                return Err(ApiError::no_executor(format!(
                    "executor {executor_id:?} is not connected"
                )))
            }
            Err(LeaseError::StoreUnavailable) => {
                return Err(store_unavailable("no fencing token could be reserved yet"))
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
        if self
            .views
            .create(&session_id, &executor_id, grant.fencing_token)
            .is_err()
        {
            return Err(exists());
        }
        // A new grant starts its tool and event bookkeeping over.
        for (id, w) in self.tools.end(&session_id) {
            let _ = w.send(Err(ApiError::tool_outcome_unknown(&id)));
        }
        self.shared.lease_deadlines.remove(&session_id);
        let previous = self
            .shared
            .sessions
            .get(&session_id)
            .map(|r| r.fencing_token);
        self.shared.sessions.insert(
            session_id.clone(),
            SessionInfo {
                connection_id: Some(entry.connection_id.clone()),
                metadata,
                mcp_servers,
                ..SessionInfo::new(
                    session_id.clone(),
                    executor_id.clone(),
                    grant.fencing_token,
                    grant.lease_token.clone(),
                    SessionState::Assigning,
                    now_rfc3339(),
                )
            },
        );
        let durable = self.persist(&session_id);
        Ok(Assignment {
            grant,
            executor_id,
            link: entry.link,
            durable,
            previous,
        })
    }

    fn assign_answered(&mut self, session_id: &str, token: u64, result: Result<(), ApiError>) {
        if let Err(e) = &result {
            tracing::info!(session = %session_id, error = %e, "assignment failed");
            if self
                .table
                .holder(session_id)
                .is_some_and(|h| h.fencing_token == token)
            {
                self.table.end(session_id);
            }
        }
        let effects = self
            .views
            .assign_answered(session_id, token, result.is_ok());
        if result.is_err() && !effects.is_empty() {
            // The session never began for the platform.
            for (id, w) in self.tools.end(session_id) {
                let _ = w.send(Err(ApiError::tool_outcome_unknown(&id)));
            }
        }
        self.apply(effects);
    }

    fn route(&self, session_id: &str) -> Result<Route, ApiError> {
        match self.views.state(session_id) {
            None => return Err(ApiError::unknown_session(session_id)),
            Some(SessionState::Ended) => return Err(ApiError::session_ended(session_id)),
            Some(_) => {}
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
            conn: view.conn,
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
        let forgotten = || {
            ApiError::rpc(RpcError::conflict(
                "tool_result_forgotten",
                format!("tool call {tool_call_id:?} was delivered long ago"),
            ))
        };
        match self.tools.lookup(session_id, &tool_call_id) {
            Lookup::Delivered(result) => {
                let _ = waiter.send(Ok(result.clone()));
                return Ok(None);
            }
            Lookup::Forgotten => return Err(forgotten()),
            Lookup::Pending => {}
        }
        let route = self.route(session_id)?;
        match self.tools.wait(session_id, &tool_call_id, waiter) {
            Ok(()) => Ok(Some(route)),
            // Checked just above; kept total rather than unwrapped.
            Err((w, Some(result))) => {
                let _ = w.send(Ok(result));
                Ok(None)
            }
            Err((_, None)) => Err(forgotten()),
        }
    }

    fn stop(&mut self, session_id: &str, waiter: StopWaiter) -> Result<Option<Route>, ApiError> {
        match self.views.stop_requested(session_id, waiter) {
            StopStart::Unknown(_) => Err(ApiError::unknown_session(session_id)),
            StopStart::AlreadyEnded(w) => {
                if let Some(rec) = self.shared.sessions.get(session_id).map(|r| r.clone()) {
                    let _ = w.send(rec);
                }
                Ok(None)
            }
            StopStart::Pending => match self.route(session_id) {
                Ok(route) => {
                    let effects = self.views.stopping(session_id);
                    self.apply(effects);
                    Ok(Some(route))
                }
                Err(_) => {
                    // No live holder: nobody to ask, the session ends here (an
                    // executor that resumes it later is told to stop).
                    self.end_session(session_id, "stopped");
                    Ok(None)
                }
            },
        }
    }

    fn end_session(&mut self, session_id: &str, reason: &str) {
        self.table.end(session_id);
        let now = self.now();
        let effects = self.views.end(session_id, reason, now);
        self.apply(effects);
    }

    /// The platform's view of a session ended: its lease is dropped, waiting
    /// tool calls fail with `tool_outcome_unknown`, stop waiters are answered.
    fn ended(&mut self, session_id: &str, reason: &str, waiters: Vec<StopWaiter>) {
        self.table.end(session_id);
        self.shared.lease_deadlines.remove(session_id);
        let info = self.shared.sessions.get_mut(session_id).map(|mut rec| {
            rec.state = SessionState::Ended;
            rec.ended_at = Some(now_rfc3339());
            rec.ended_reason = Some(reason.to_owned());
            rec.clone()
        });
        self.persist(session_id);
        tracing::info!(session = %session_id, %reason, "session ended");
        for (id, w) in self.tools.end(session_id) {
            let _ = w.send(Err(ApiError::tool_outcome_unknown(&id)));
        }
        if let Some(info) = info {
            for w in waiters {
                let _ = w.send(info.clone());
            }
        }
        mcp::session_ended(&self.shared, session_id, reason);
        turns::session_ended(&self.shared, session_id, reason);
        // Re-senders waiting for this session's route give up.
        self.shared.routes_changed();
        self.shared.emit(HarnessEvent::SessionEnded {
            session_id: session_id.to_owned(),
            reason: reason.to_owned(),
        });
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
            if self.shared.replica.get().is_some() {
                self.expire_by_store(&s);
            } else {
                self.shared.metrics.lease_expiries.inc();
                self.end_session(&s, "lease_expired");
            }
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
                if self.views.get(session_id).is_none() {
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
                let ended_here = self.views.get(&session_id).is_some_and(|r| {
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
                let mcp_keys: Vec<String> = match self.shared.sessions.get_mut(&session_id) {
                    Some(mut rec) => {
                        rec.ready = true;
                        rec.mcp_servers
                            .iter()
                            .filter(|s| s.connection_origin == ConnectionOrigin::Environment)
                            .map(|s| s.server_key.clone())
                            .collect()
                    }
                    None => Vec::new(),
                };
                self.persist(&session_id);
                // Every server has answered `initialize` (or failed): list
                // the tools of each over its channel.
                for key in mcp_keys {
                    mcp::wake(&self.shared, &session_id, &key, McpMsg::Wake);
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
                let mut changed = Vec::new();
                if let Some(mut rec) = self.shared.sessions.get_mut(&session_id) {
                    rec.status = Some(p.status);
                    rec.status_detail = p.detail.clone();
                    // Only servers the session was created with; the
                    // executor's list is bounded by them.
                    for s in &p.mcp_servers {
                        if let Some(info) = rec
                            .mcp_servers
                            .iter_mut()
                            .find(|i| i.server_key == s.server_key)
                        {
                            if info.state != s.state || info.restarts != s.restarts {
                                changed.push(s.clone());
                            }
                            info.update(s);
                        }
                    }
                }
                for s in changed {
                    let key = s.server_key.clone();
                    if s.state == McpServerState::Ready {
                        mcp::wake(&self.shared, &session_id, &key, McpMsg::Status(s));
                    } else if let Some(a) = self
                        .shared
                        .mcp_channels
                        .get(&(session_id.clone(), key))
                        .map(|a| a.clone())
                    {
                        let _ = a.send_message(McpMsg::Status(s));
                    }
                }
                let mut mcp_servers = p.mcp_servers;
                mcp_servers.truncate(super::super::api::mcp::MAX_MCP_SERVERS);
                self.shared.emit(HarnessEvent::SessionStatus {
                    session_id,
                    status: p.status,
                    detail: p.detail,
                    mcp_servers,
                });
            }
            Method::ToolResult => {
                let Some(p) = decode_params::<ToolResultParams>(&frame, &mut reply) else {
                    return;
                };
                self.tool_result(p, reply);
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
            // The agent stream's frames go to the session's stream actor
            // (actors::turns), which sequences, keeps and fans them out.
            Method::SessionEvent => {
                if let Some(params) = decode_params::<SessionEventParams>(&frame, &mut reply) {
                    turns::from_executor(
                        &self.shared,
                        &session_id,
                        TurnsMsg::Event { params, reply },
                    );
                }
            }
            Method::SessionEventDelta => {
                if let Some(p) = decode_params::<EventDeltaParams>(&frame, &mut reply) {
                    turns::from_executor(&self.shared, &session_id, TurnsMsg::Delta(p));
                }
            }
            Method::InteractionRequest => {
                if let Some(params) = decode_params::<InteractionRequestParams>(&frame, &mut reply)
                {
                    turns::from_executor(
                        &self.shared,
                        &session_id,
                        TurnsMsg::InteractionRequest { params, reply },
                    );
                }
            }
            Method::InteractionCancel => {
                if let Some(params) = decode_params::<InteractionCancelParams>(&frame, &mut reply) {
                    turns::from_executor(
                        &self.shared,
                        &session_id,
                        TurnsMsg::InteractionCancel { params, reply },
                    );
                }
            }
            other => answer::<Accepted>(reply, Err(RpcError::method_not_found(other.as_str()))),
        }
    }

    /// Exactly once: the first result for a `toolCallId` goes to its
    /// waiters and the event stream; repeats are only acknowledged.
    ///
    /// With a durable store, the acknowledgement and the delivery wait for
    /// the result's commit (run by the store's writer): a harness killed
    /// before it never acknowledged, so the executor sends it again; one
    /// killed after it finds the result in the store. A duplicate is
    /// acknowledged only once the first copy is durable, for the same
    /// reason. A full write queue refuses the frame as retryable.
    fn tool_result(&mut self, p: ToolResultParams, reply: Option<Responder>) {
        let durable = self.shared.durable.get().cloned();
        if durable.as_ref().is_some_and(|d| !d.has_room(1)) {
            return answer::<Accepted>(reply, Err(store_busy()));
        }
        let (session_id, call_id) = (p.session_id.clone(), p.tool_call_id.clone());
        let fencing_token = self.views.get(&session_id).map_or(0, |v| v.fencing_token);
        match (self.tools.result(&session_id, &call_id, p), durable) {
            (Delivery::Duplicate, None) => {
                tracing::debug!(tool_call = %call_id, "duplicate tool.result acknowledged");
                answer(reply, Ok(Accepted::YES));
            }
            (Delivery::Duplicate, Some(d)) => {
                tracing::debug!(tool_call = %call_id, "duplicate tool.result acknowledged once durable");
                d.after_commit(Box::new(move || answer(reply, Ok(Accepted::YES))));
            }
            (Delivery::Deliver { waiters, result }, None) => {
                for w in waiters {
                    let _ = w.send(Ok(result.clone()));
                }
                self.shared.emit(HarnessEvent::ToolResult(result));
                answer(reply, Ok(Accepted::YES));
            }
            (Delivery::Deliver { waiters, result }, Some(d)) => {
                let shared = self.shared.clone();
                let stored = StoredResult {
                    session_id,
                    fencing_token,
                    tool_call_id: call_id,
                    result: result.clone(),
                };
                d.put_result(
                    stored,
                    Box::new(move || {
                        for w in waiters {
                            let _ = w.send(Ok(result.clone()));
                        }
                        shared.emit(HarnessEvent::ToolResult(result));
                        answer(reply, Ok(Accepted::YES));
                    }),
                );
            }
        }
    }
}

/// The store's write queue is full: an executor's frame (a result, an
/// event) is refused as retryable, never dropped; the executor sends it
/// again.
pub(crate) fn store_busy() -> RpcError {
    RpcError::internal("the harness store is busy; send it again")
        .with_reason("store_busy")
        .with_retryable(true)
}

/// The durable store could not take a write in time: retryable.
pub(crate) fn store_unavailable(detail: impl Into<String>) -> ApiError {
    ApiError::with_status(
        503,
        RpcError::internal("the harness store is unavailable")
            .with_reason("store_unavailable")
            .with_retryable(true)
            .with_detail(detail),
    )
}

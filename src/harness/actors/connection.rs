//! One actor per executor connection (harness side).
//!
//! The reader of the connection's [`Link`] hands every request and
//! notification to [`ConnRouter`], which casts it here. Before
//! `executor.register` every request is refused with -32600
//! (`not_registered`); `executor.register` goes through the leases actor
//! (the 4004 rule) and is answered with the configured heartbeat and TTL;
//! session-scoped frames are forwarded to the leases actor, which fences
//! them. A connection that never registers is closed with 4008 after the
//! handshake timeout (or the lease TTL, if shorter); a registered one is watched by the leases actor's timer.

use super::leases::LeasesMsg;
use super::mcp;
use super::mcp_service;
use crate::harness::runtime::{ConnEntry, Shared};
use crate::harness::types::HarnessEvent;
use crate::lease::ConnId;
use crate::wire::types::{
    now_rfc3339, CapabilitiesUpdateParams, CloseParams, HeartbeatParams, HeartbeatResult, Limits,
    McpCloseParams, McpCloseResult, McpFrameParams, McpOpenParams, McpOpenResult, RegisterParams,
    RegisterResult, StopParams, TerminalExitedParams, TokenRefreshParams, TokenRefreshResult,
};
use crate::wire::{
    decode_params, CloseCode, Closed, Dispatch, Inbound, Link, LinkLimits, Method, Owner,
    Responder, RpcError, Transport,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tracing::Instrument;

// A frame is moved into the mailbox once; boxing it would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum ConnMsg {
    Frame(Inbound, Option<Responder>),
    Lost(Closed),
    RegisterTimeout,
    /// Fail on purpose, so tests can check the supervision. Not reachable
    /// from the wire or the HTTP API.
    #[doc(hidden)]
    InjectPanic,
}

/// Casts every frame of one connection to its actor; holds no state.
/// `mcp.frame` notifications skip the connection actor and go straight to
/// their channel actor (one mailbox hop, not two: the MCP latency path).
/// That is safe before `executor.register` too: a channel only takes
/// frames from the connection it was opened on, which is a leased one.
pub struct ConnRouter {
    actor: ActorRef<ConnMsg>,
    link: Link,
    shared: Arc<Shared>,
    conn: ConnId,
}

impl Dispatch for ConnRouter {
    fn dispatch(&self, frame: Inbound, mut reply: Option<Responder>) {
        if reply.is_none()
            && frame.method() == Some(Method::McpFrame.as_str())
            && Method::McpFrame.since() <= self.link.version()
        {
            if let Some(p) = decode_params::<McpFrameParams>(&frame, &mut reply) {
                mcp::from_executor(&self.shared, &self.link, self.conn, p);
            }
            return;
        }
        if let Err(ractor::MessagingErr::SendErr(msg)) =
            self.actor.send_message(ConnMsg::Frame(frame, reply))
        {
            if let ConnMsg::Frame(_, Some(r)) = msg {
                r.err(RpcError::internal("the connection is closing"));
            }
            // The actor is gone (it failed, or stopped): a socket nobody
            // serves must close, so that the executor reconnects.
            close_orphaned(&self.link);
        }
    }
}

/// Close a connection whose actor is gone with 1011, so the executor
/// reconnects and resumes its sessions on a fresh connection.
pub fn close_orphaned(link: &Link) {
    if !link.is_closed() {
        tracing::warn!("connection actor gone: closing its socket with 1011");
        link.close(CloseCode::Other(1011), "internal error");
    }
}

/// The socket of `conn` is gone: tell the leases actor, drop the entry,
/// tell the platform. Run by the connection actor, or by the reader task
/// when the actor died first.
async fn lost(shared: &Shared, conn: ConnId, closed: Closed) {
    let _ = shared.send_leases(LeasesMsg::Disconnected(conn)).await;
    let Some((_, entry)) = shared.conns.remove(&conn) else {
        return;
    };
    if let Some(r) = shared.replica.get() {
        r.forget(&entry.executor_id, conn);
        // Registered or not: the row may name it from before the
        // register settled (it is numbered first).
        r.connection_ended(&entry.executor_id, &entry.connection_id);
    }
    if entry.registered {
        shared
            .metrics
            .connection_closed(closed.code.map(|c| c.code()));
        shared.emit(HarnessEvent::ExecutorDisconnected {
            executor_id: entry.executor_id,
            connection_id: entry.connection_id,
            code: closed.code.map(|c| c.code()),
            reason: closed.reason,
        });
    }
}

/// Whether `generation` is still the newest known of `executor_id`.
fn replica_is_newest(
    replica: &crate::harness::replica::Replica,
    executor_id: &str,
    generation: i64,
) -> bool {
    replica.latest(executor_id) <= generation
}

/// The largest frame the executor reads: its `maxFrameBytes`
/// advertisement, else PROTOCOL.md's default 1 MiB. Below 4 KiB it is
/// not believed (no useful request fits) and the default applies.
fn peer_frame_limit(caps: &crate::wire::types::Capabilities) -> usize {
    caps.max_frame_bytes
        .filter(|&b| b >= 4096)
        .map(|b| usize::try_from(b).unwrap_or(usize::MAX))
        .unwrap_or(crate::wire::DEFAULT_PEER_FRAME_BYTES)
}

pub struct Connection;

/// What a resumed register learnt from the database (over replicas): the
/// sessions taken over (their new grant goes to the executor) and the
/// row's token of each session it is told to stop.
#[derive(Default)]
struct Resumed {
    adopted: Vec<crate::harness::types::SessionInfo>,
    stop_tokens: std::collections::BTreeMap<String, u64>,
}

pub struct ConnArgs {
    pub shared: Arc<Shared>,
    pub link: Link,
    pub conn: ConnId,
    pub connection_id: String,
    pub executor_id: String,
}

pub struct ConnState {
    shared: Arc<Shared>,
    link: Link,
    conn: ConnId,
    connection_id: String,
    executor_id: String,
    registered: bool,
    span: tracing::Span,
}

/// Start the actor and the reader of an accepted, authenticated transport.
pub async fn start(shared: Arc<Shared>, transport: Transport, executor_id: String) {
    let limits = LinkLimits {
        max_control_frame_bytes: shared.config.max_control_frame_bytes,
        max_mcp_frame_bytes: shared.config.max_mcp_frame_bytes,
        max_in_flight: shared.config.max_in_flight,
    };
    let (link, reader) = Link::start(transport, "h", limits);
    let (conn, connection_id) = shared.next_conn();
    shared.conns.insert(
        conn,
        ConnEntry {
            conn,
            connection_id: connection_id.clone(),
            executor_id: executor_id.clone(),
            link: link.clone(),
            registered: false,
            info: None,
            capabilities: Default::default(),
            connected_at: now_rfc3339(),
            last_heartbeat_at: None,
            draining: false,
            actor: None,
        },
    );
    let args = ConnArgs {
        shared: shared.clone(),
        link: link.clone(),
        conn,
        connection_id,
        executor_id,
    };
    let actor = match super::root::start_connection(&shared, args).await {
        Ok(actor) => actor,
        Err(e) => {
            tracing::error!(error = %e, "cannot start a connection actor");
            shared.conns.remove(&conn);
            link.close(CloseCode::Other(1011), "internal error");
            return;
        }
    };
    if let Some(mut e) = shared.conns.get_mut(&conn) {
        e.actor = Some(actor.clone());
    }
    let router = Arc::new(ConnRouter {
        actor: actor.clone(),
        link,
        shared: shared.clone(),
        conn,
    });
    tokio::spawn(async move {
        let closed = reader.run(router).await;
        if let Err(ractor::MessagingErr::SendErr(ConnMsg::Lost(closed))) =
            actor.send_message(ConnMsg::Lost(closed))
        {
            lost(&shared, conn, closed).await;
        }
    });
}

impl Actor for Connection {
    type Msg = ConnMsg;
    type State = ConnState;
    type Arguments = ConnArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ConnMsg>,
        a: ConnArgs,
    ) -> Result<ConnState, ActorProcessingErr> {
        let span = tracing::info_span!("executor_conn", executor_id = %a.executor_id, connection_id = %a.connection_id);
        span.in_scope(|| tracing::info!("executor connected"));
        // An upgraded socket that never registers holds a slot and an
        // actor: bounded by the handshake timeout (issue 18, finding 4).
        let config = &a.shared.config;
        let register_within =
            Duration::from_millis(config.lease_ttl_ms).min(config.connections.handshake_timeout);
        myself.send_after(register_within, || ConnMsg::RegisterTimeout);
        Ok(ConnState {
            shared: a.shared,
            link: a.link,
            conn: a.conn,
            connection_id: a.connection_id,
            executor_id: a.executor_id,
            registered: false,
            span,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<ConnMsg>,
        msg: ConnMsg,
        state: &mut ConnState,
    ) -> Result<(), ActorProcessingErr> {
        // Spans are attached with `instrument`, never held across an await.
        let span = state.span.clone();
        let _g = span.enter();
        match msg {
            ConnMsg::Frame(frame, reply) => {
                let fspan = tracing::debug_span!(
                    "frame",
                    method = frame.method().unwrap_or("?"),
                    id = ?frame.id()
                );
                drop(_g);
                state
                    .frame(frame, reply)
                    .instrument(fspan)
                    .instrument(span.clone())
                    .await
            }
            ConnMsg::RegisterTimeout => {
                if !state.registered {
                    tracing::info!(
                        "no executor.register within the handshake timeout: closing with 4008"
                    );
                    state.link.close(CloseCode::LeaseExpired, "not registered");
                }
            }
            ConnMsg::Lost(closed) => {
                tracing::info!(code = ?closed.code.map(|c| c.code()), reason = %closed.reason, by_peer = closed.by_peer, "executor connection closed");
                drop(_g);
                lost(&state.shared, state.conn, closed)
                    .instrument(span.clone())
                    .await;
                myself.stop(None);
            }
            ConnMsg::InjectPanic => panic!("panic injected into a connection actor"),
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ConnMsg>,
        state: &mut ConnState,
    ) -> Result<(), ActorProcessingErr> {
        // Stopped from outside (harness shutdown): close the socket.
        if !state.link.is_closed() {
            state
                .link
                .close(CloseCode::GoingAway, "harness shutting down");
        }
        Ok(())
    }
}

impl ConnState {
    async fn frame(&mut self, frame: Inbound, mut reply: Option<Responder>) {
        let Some(method) = frame.method().and_then(Method::from_name) else {
            return;
        };
        if !method.harness_receives() || method.since() > self.link.version() {
            if let Some(r) = reply {
                r.err(RpcError::method_not_found(method.as_str()));
            }
            return;
        }
        if method.is_notification() {
            if let Some(r) = reply.take() {
                return r.err(RpcError::notification_as_request(method.as_str()));
            }
        }
        if !self.registered {
            if method != Method::ExecutorRegister {
                match reply {
                    Some(r) => r.err(RpcError::not_registered()),
                    None => {
                        tracing::warn!(%method, "notification before executor.register ignored")
                    }
                }
                return;
            }
        } else if let Some(leases) = self.shared.leases() {
            // Best effort: a frame lost while the leases actor restarts
            // only means the next one counts.
            let _ = leases.send_message(LeasesMsg::Seen(self.conn));
        }
        match method {
            Method::ExecutorRegister => {
                let Some(r) = reply.take() else { return };
                self.register(&frame, r).await;
            }
            Method::ExecutorHeartbeat => {
                let Some(p) = decode_params::<HeartbeatParams>(&frame, &mut reply) else {
                    return;
                };
                let _ = p;
                if let Some(mut e) = self.shared.conns.get_mut(&self.conn) {
                    e.last_heartbeat_at = Some(now_rfc3339());
                }
                if let Some(r) = reply {
                    r.ok(&HeartbeatResult {
                        lease_ttl_ms: self.shared.config.lease_ttl_ms,
                        server_time: now_rfc3339(),
                        drain: false,
                    });
                }
            }
            Method::ExecutorTokenRefresh => {
                let Some(p) = decode_params::<TokenRefreshParams>(&frame, &mut reply) else {
                    return;
                };
                let ok = self.shared.authenticate(Some(p.token.expose())).as_deref()
                    == Some(self.executor_id.as_str());
                if let Some(r) = reply {
                    if ok {
                        r.ok(&TokenRefreshResult { expires_at: None });
                    } else {
                        r.err(RpcError::new(
                            crate::wire::ErrorCode::Unauthorized,
                            "the token does not map to this executor",
                        ));
                    }
                }
            }
            Method::ExecutorCapabilitiesUpdate => {
                if let Some(p) = decode_params::<CapabilitiesUpdateParams>(&frame, &mut reply) {
                    self.link
                        .set_peer_max_frame_bytes(peer_frame_limit(&p.capabilities));
                    if let Some(mut e) = self.shared.conns.get_mut(&self.conn) {
                        e.capabilities = p.capabilities;
                    }
                }
            }
            Method::ExecutorClose => {
                if let Some(p) = decode_params::<CloseParams>(&frame, &mut reply) {
                    tracing::info!(reason = %p.reason, "the executor said it closes (executor.close)");
                }
            }
            Method::TerminalExited => {
                if let Some(params) = decode_params::<serde_json::Value>(&frame, &mut reply) {
                    if let Ok(p) = serde_json::from_value::<TerminalExitedParams>(params.clone()) {
                        self.shared.terminals.exited(
                            &self.executor_id,
                            &p.terminal_id,
                            p.exit_code,
                        );
                    }
                    self.shared.emit(HarnessEvent::Other {
                        method: method.as_str().to_owned(),
                        params,
                    });
                }
            }
            Method::TerminalOutput => {
                // Executor-scoped v1.1 traffic the harness does not act on.
                if let Some(params) = decode_params::<serde_json::Value>(&frame, &mut reply) {
                    self.shared.emit(HarnessEvent::Other {
                        method: method.as_str().to_owned(),
                        params,
                    });
                }
            }
            // MCP frames go to their channel actor, never to the event
            // stream (payloads may carry secrets). The channel checks that
            // the frame came on the connection it was opened on.
            Method::McpFrame => {
                if let Some(p) = decode_params::<McpFrameParams>(&frame, &mut reply) {
                    mcp::from_executor(&self.shared, &self.link, self.conn, p);
                }
            }
            Method::McpClose => {
                if let Some(p) = decode_params::<McpCloseParams>(&frame, &mut reply) {
                    mcp::executor_closed(&self.shared, self.conn, p);
                    if let Some(r) = reply {
                        r.ok(&McpCloseResult { closed: true });
                    }
                }
            }
            Method::McpOpen => {
                // A channel toward the harness: a `service` server the
                // platform registered (docs/mcp.md). The connection must
                // hold the session's lease; the open waits for the
                // service's `initialize`, so it is answered from a task.
                let Some(p) = decode_params::<McpOpenParams>(&frame, &mut reply) else {
                    return;
                };
                let Some(r) = reply else { return };
                let (shared, link, conn) = (self.shared.clone(), self.link.clone(), self.conn);
                tokio::spawn(async move {
                    let holds = matches!(
                        crate::harness::api::sessions::ask(&shared, |reply| LeasesMsg::Route {
                            session_id: p.session_id.clone(),
                            reply,
                        })
                        .await,
                        Ok(Ok(route)) if route.conn == conn
                    );
                    if !holds {
                        return r.err(RpcError::session_not_active(&p.session_id));
                    }
                    match mcp_service::open(&shared, link, conn, &p.session_id, &p.server_key).await
                    {
                        Ok(()) => r.ok(&McpOpenResult { opened: true }),
                        Err(e) => r.err(e),
                    }
                });
            }
            m if m.owner() == Owner::HarnessSession => {
                let sent = self
                    .shared
                    .send_leases(LeasesMsg::Frame {
                        conn: self.conn,
                        method: m,
                        frame,
                        reply,
                    })
                    .await;
                if let Err(Some(LeasesMsg::Frame { reply: Some(r), .. })) = sent {
                    r.err(RpcError::internal("the harness is shutting down"));
                }
            }
            other => {
                if let Some(r) = reply {
                    r.err(RpcError::method_not_found(other.as_str()));
                }
            }
        }
    }

    /// Over several replicas: number this connection in the database,
    /// then hand the register to the leases actor unless a newer
    /// connection of the executor is already known (on any replica); then
    /// this one is the older and closes with 4004 (`crate::harness::replica`).
    ///
    /// # Errors
    ///
    /// `None`: replaced, the connection was closed with 4004; else the
    /// error to answer the register with.
    async fn register_replicated(&self, mut msg: LeasesMsg) -> Result<Resumed, Option<RpcError>> {
        let Some(replica) = self.shared.replica.get() else {
            return Err(Some(RpcError::internal("not a replica")));
        };
        let db = replica.db.clone();
        let (exec, cid) = (self.executor_id.clone(), self.connection_id.clone());
        let generation = tokio::task::spawn_blocking(move || db.claim_connection(&exec, &cid))
            .await
            .map_err(|e| Some(RpcError::internal(e.to_string())))?
            .map_err(|e| {
                tracing::warn!(error = %e, "cannot record the connection in the store");
                Some(RpcError::internal("store unavailable"))
            })?;
        tracing::debug!(generation, "connection numbered");
        // Sessions it resumes that another replica granted (it died, or
        // the executor left it): taken over from the database before the
        // register settles the resume (docs/store.md, "Takeover").
        let mut adopted_infos = Resumed::default();
        if let LeasesMsg::Register {
            resume, settled, ..
        } = &mut msg
        {
            *settled = crate::harness::replica::take_over(
                &self.shared,
                &self.executor_id,
                &self.connection_id,
                resume,
            )
            .await;
            adopted_infos = Resumed {
                adopted: settled.adopt.iter().map(|a| a.info.clone()).collect(),
                stop_tokens: settled.stop_tokens.clone(),
            };
        }
        let leases = self.shared.leases();
        let mut msg = Some(msg);
        // Sent under the executor's lock: this replica's registers of one
        // executor reach the leases actor in generation order.
        let admitted = replica.admit(&self.executor_id, self.conn, generation, || {
            let Some(l) = leases.as_ref() else {
                return false;
            };
            let Some(m) = msg.take() else {
                return false;
            };
            match l.send_message(m) {
                Ok(()) => true,
                Err(ractor::MessagingErr::SendErr(m)) => {
                    msg = Some(m);
                    false
                }
                Err(_) => false,
            }
        });
        if admitted {
            return Ok(adopted_infos);
        }
        if let Some(m) = msg {
            // The leases actor is restarting: wait for the next one (no
            // order with a concurrent register; the poll settles it).
            let shutting_down = || Some(RpcError::internal("the harness is shutting down"));
            if self.shared.leases().is_none() || leases.is_none() {
                return Err(shutting_down());
            }
            if replica_is_newest(replica, &self.executor_id, generation) {
                return self
                    .shared
                    .send_leases(m)
                    .await
                    .map(|()| adopted_infos)
                    .map_err(|_| shutting_down());
            }
        }
        tracing::info!(
            generation,
            "a newer connection of this executor registered meanwhile: closing with 4004"
        );
        self.shared.metrics.replacements.inc();
        self.link.close(CloseCode::Replaced, "replaced");
        Err(None)
    }

    async fn register(&mut self, frame: &Inbound, reply: Responder) {
        let params: RegisterParams = match frame.params() {
            Ok(p) => p,
            Err(e) => return reply.err(e),
        };
        if self.registered {
            return reply.err(RpcError::invalid_request(
                "already_registered",
                "this connection is registered",
            ));
        }
        // A resume for another executor id is not this principal's to claim.
        let resume = match params.resume {
            Some(r) if r.executor_id == self.executor_id => {
                let mut s = r.active_sessions;
                s.truncate(100_000);
                s
            }
            Some(r) => {
                tracing::warn!(claimed = %r.executor_id, "resume for another executor id ignored");
                Vec::new()
            }
            None => Vec::new(),
        };
        let (tx, rx) = oneshot::channel();
        let msg = LeasesMsg::Register {
            conn: self.conn,
            executor_id: self.executor_id.clone(),
            resume,
            settled: Default::default(),
            reply: tx,
        };
        let mut resumed = Resumed::default();
        if self.shared.replica.get().is_some() {
            match self.register_replicated(msg).await {
                Ok(a) => resumed = a,
                // Replaced: closed with 4004, which is the whole answer
                // (nothing goes out after a close frame).
                Err(None) => {
                    drop(reply);
                    return;
                }
                Err(Some(e)) => return reply.err(e),
            }
        } else if self.shared.send_leases(msg).await.is_err() {
            return reply.err(RpcError::internal("the harness is shutting down"));
        }
        let Ok(registered) = rx.await else {
            return reply.err(RpcError::internal("the harness is shutting down"));
        };
        self.registered = true;
        self.link
            .set_peer_max_frame_bytes(peer_frame_limit(&params.capabilities));
        if let Some(mut e) = self.shared.conns.get_mut(&self.conn) {
            e.registered = true;
            e.info = Some(params.executor.clone());
            e.capabilities = params.capabilities.clone();
        }
        // Requests waiting for this executor (terminals) can go now.
        self.shared.routes_changed();
        let config = &self.shared.config;
        reply.ok(&RegisterResult {
            executor_id: self.executor_id.clone(),
            connection_id: self.connection_id.clone(),
            protocol: self.link.version().as_str().to_owned(),
            heartbeat_interval_ms: config.heartbeat_interval_ms,
            lease_ttl_ms: config.lease_ttl_ms,
            limits: Limits::default(),
            max_control_frame_bytes: config.max_control_frame_bytes as u64,
            max_mcp_frame_bytes: config.max_mcp_frame_bytes as u64,
            server_time: now_rfc3339(),
            drain: false,
        });
        tracing::info!(
            name = %params.executor.name,
            kept = registered.kept.len(),
            to_stop = registered.to_stop.len(),
            ended = registered.ended.len(),
            "executor registered"
        );
        self.shared.emit(HarnessEvent::ExecutorConnected {
            executor_id: self.executor_id.clone(),
            connection_id: self.connection_id.clone(),
        });
        // Sessions taken over from another replica and kept: the executor
        // learns their new grant (a higher fencing token renews in place).
        for info in resumed.adopted {
            if registered.kept.contains(&info.session_id) {
                let link = self.link.clone();
                let timeout = config.request_timeout;
                tokio::spawn(async move {
                    crate::harness::replica::renew(&link, &info, timeout).await;
                });
            }
        }
        // Sessions the executor still runs but may not keep (§3.5).
        // Over several replicas each of them was decided by the database
        // (the row is over, not this executor's, or ran out and was ended
        // here), and the stop carries the row's fencing token: an executor
        // that holds a newer grant refuses it (stale_fencing_token).
        for session_id in registered.to_stop {
            let link = self.link.clone();
            let timeout = config.request_timeout;
            let token = resumed.stop_tokens.get(&session_id).copied();
            tokio::spawn(async move {
                let params = StopParams {
                    session_id,
                    reason: "lease_expired".into(),
                    deadline_ms: None,
                    keep_workspace: false,
                };
                let sent = match token {
                    Some(fencing_token) => {
                        link.request::<_, serde_json::Value>(
                            Method::SessionStop,
                            &crate::wire::request::Fenced {
                                params: &params,
                                fencing_token,
                            },
                            timeout,
                        )
                        .await
                    }
                    None => {
                        link.request::<_, serde_json::Value>(Method::SessionStop, &params, timeout)
                            .await
                    }
                };
                if let Err(e) = sent {
                    tracing::debug!(session = %params.session_id, error = %e, "session.stop after resume failed");
                }
            });
        }
    }
}

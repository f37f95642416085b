//! The executor's connection actor: one live WebSocket.
//!
//! `pre_start` dials, authenticates, negotiates and registers (with `resume`
//! after the first connection); a failure there is a failed start that the
//! root supervisor retries with backoff, or, for a refused credential, a
//! final `shutdown:` exit. Once registered it heartbeats at the interval the
//! harness named and routes every inbound frame through the
//! [`ExecutorRouter`](super::router::ExecutorRouter). When the socket is
//! lost the actor stops; the supervisor's restart is the reconnect.

use super::router::ExecutorRouter;
use super::sessions::SessionsMsg;
use crate::executor::runtime::Registration;
use crate::executor::stop::{self, FinalStop};
use crate::executor::Shared;
use crate::wire::link::Reader;
use crate::wire::transport::{self, DialError};
use crate::wire::types::{
    CloseParams, DrainParams, DrainResult, ExecutorInfo, HeartbeatParams, HeartbeatResult,
    RegisterParams, RegisterResult, Resume,
};
use crate::wire::{CallError, CloseCode, Closed, ErrorCode, Link, LinkLimits, Method, Responder};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::Instrument;

pub enum ConnMsg {
    /// Time to send a heartbeat.
    Heartbeat,
    HeartbeatAck(HeartbeatResult),
    /// A heartbeat went unanswered: the connection counts as lost.
    HeartbeatFailed(String),
    /// The socket ended.
    Lost(Closed),
    /// `executor.drain` from the harness.
    Drain(DrainParams, Responder),
    /// The drain finished (all sessions ended or the deadline passed).
    Drained,
}

#[derive(Clone)]
pub struct Connection;

pub struct ConnState {
    shared: Arc<Shared>,
    link: Link,
    registration: Registration,
    heartbeat: Option<JoinHandle<()>>,
    closed_rx: Option<oneshot::Receiver<Closed>>,
    heartbeat_in_flight: bool,
    draining: bool,
}

impl Connection {
    async fn connect(
        myself: &ActorRef<ConnMsg>,
        shared: &Arc<Shared>,
    ) -> Result<(Link, oneshot::Receiver<Closed>, Registration), String> {
        let config = &shared.config;
        let token = config
            .token
            .read()
            .map_err(|e| format!("cannot read the token: {e}"))?;
        let limits = LinkLimits::default();
        let dial = transport::dial(
            &config.endpoint,
            &token,
            &config.subprotocols,
            limits.max_mcp_frame_bytes,
            config.connect_timeout,
        );
        let dialled = tokio::select! {
            d = dial => d,
            () = shared.stopping.cancelled() => return Err(FinalStop::Requested.reason()),
        };
        let transport = dialled.map_err(|e| match e {
            DialError::Unauthorized => FinalStop::Unauthorized.reason(),
            DialError::BadUrl(u) => {
                tracing::error!(url = %u, "the harness URL cannot be dialled");
                FinalStop::BadUrl.reason()
            }
            other => other.to_string(),
        })?;
        let subprotocol = transport.subprotocol;
        let (link, reader): (Link, Reader) = Link::start(transport, "e", limits);
        let router = Arc::new(ExecutorRouter::new(
            shared.clone(),
            myself.clone(),
            subprotocol.version,
        ));
        let (closed_tx, mut closed_rx) = oneshot::channel();
        tokio::spawn(async move {
            let closed = reader.run(router).await;
            let _ = closed_tx.send(closed);
        });
        let previous = shared.registration();
        let params = RegisterParams {
            protocol: subprotocol.protocol_version().to_owned(),
            executor: ExecutorInfo {
                name: config.name.clone(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
                os: std::env::consts::OS.to_owned(),
                arch: std::env::consts::ARCH.to_owned(),
            },
            environment_id: config.environment_id.clone(),
            capabilities: shared.capabilities(),
            resume: previous
                .map(|p| (p.executor_id, p.connection_id))
                .or_else(|| shared.journal_resume())
                .map(|(executor_id, last_connection_id)| Resume {
                    executor_id,
                    last_connection_id,
                    active_sessions: shared.active_sessions(),
                    fencing_tokens: shared.fencing_tokens(),
                }),
        };
        let register = link.request::<_, RegisterResult>(
            Method::ExecutorRegister,
            &params,
            config.request_timeout,
        );
        let result = tokio::select! {
            r = register => r,
            () = shared.stopping.cancelled() => {
                // Asked to stop before the harness answered: say so and
                // close 1000, as a registered connection's stop does.
                let _ = link.notify(
                    Method::ExecutorClose,
                    &CloseParams { reason: "shutdown".into() },
                );
                link.close(CloseCode::Normal, "shutdown");
                let _ = tokio::time::timeout(Duration::from_secs(3), &mut closed_rx).await;
                return Err(FinalStop::Requested.reason());
            }
            closed = &mut closed_rx => {
                let closed = closed.unwrap_or(Closed { code: None, reason: "reader ended".into(), by_peer: false });
                if let Some(f) = FinalStop::from_close(closed.code) {
                    return Err(f.reason());
                }
                return Err(format!("closed during register: {:?} {}", closed.code, closed.reason));
            }
        };
        let result = match result {
            Ok(r) => r,
            Err(CallError::Rpc(e)) if e.kind() == Some(ErrorCode::Unauthorized) => {
                return Err(FinalStop::Unauthorized.reason())
            }
            Err(e) => {
                link.close(CloseCode::ProtocolViolation, "register failed");
                // A close that arrived with the failure decides finality.
                if let Ok(closed) = closed_rx.try_recv() {
                    if let Some(f) = FinalStop::from_close(closed.code) {
                        return Err(f.reason());
                    }
                }
                return Err(format!("register failed: {e}"));
            }
        };
        // The harness's own limit: a request of ours above it fails here
        // instead of costing the connection (0: not said, keep the default).
        if let Ok(max) = usize::try_from(result.max_control_frame_bytes) {
            if max >= 4096 {
                link.set_peer_max_frame_bytes(max);
            }
        }
        let registration = Registration {
            executor_id: result.executor_id,
            connection_id: result.connection_id,
            heartbeat_interval_ms: result.heartbeat_interval_ms.max(50),
            lease_ttl_ms: result.lease_ttl_ms,
            limits: result.limits,
            max_control_frame_bytes: result.max_control_frame_bytes,
            max_mcp_frame_bytes: result.max_mcp_frame_bytes,
        };
        Ok((link, closed_rx, registration))
    }
}

impl Actor for Connection {
    type Msg = ConnMsg;
    type State = ConnState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        myself: ActorRef<ConnMsg>,
        shared: Arc<Shared>,
    ) -> Result<ConnState, ActorProcessingErr> {
        // `instrument`, not `enter`: a span entered across an await leaks
        // into whatever else runs on this thread meanwhile.
        let span = tracing::info_span!("connection", url = ?shared.config.endpoint);
        let (link, closed_rx, registration) = Self::connect(&myself, &shared)
            .instrument(span)
            .await
            .map_err(|e| {
                if e == FinalStop::Requested.reason() {
                    tracing::info!("stopped while connecting");
                } else {
                    tracing::warn!(error = %e, "connect failed");
                }
                ActorProcessingErr::from(e)
            })?;
        tracing::info!(
            executor_id = %registration.executor_id,
            connection_id = %registration.connection_id,
            protocol = ?link.version(),
            codec = ?link.codec(),
            "registered"
        );
        shared.set_registration(registration.clone());
        shared.metrics.registrations.inc();
        shared.set_link(Some(link.clone()));
        if let Some(sessions) = shared.sessions_actor() {
            let _ = sessions.send_message(SessionsMsg::Registered {
                lease_ttl_ms: registration.lease_ttl_ms,
            });
        }
        Ok(ConnState {
            shared,
            link,
            registration,
            heartbeat: None,
            closed_rx: Some(closed_rx),
            heartbeat_in_flight: false,
            draining: false,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<ConnMsg>,
        state: &mut ConnState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(rx) = state.closed_rx.take() {
            let me = myself.clone();
            tokio::spawn(async move {
                let closed = rx.await.unwrap_or(Closed {
                    code: None,
                    reason: "reader ended".into(),
                    by_peer: false,
                });
                let _ = me.send_message(ConnMsg::Lost(closed));
            });
        }
        let period = Duration::from_millis(state.registration.heartbeat_interval_ms);
        state.heartbeat = Some(myself.send_interval(period, || ConnMsg::Heartbeat));
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ConnMsg>,
        state: &mut ConnState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(h) = state.heartbeat.take() {
            h.abort();
        }
        state.shared.set_link(None);
        if let Some(sessions) = state.shared.sessions_actor() {
            let _ = sessions.send_message(SessionsMsg::Disconnected);
        }
        if !state.link.is_closed() {
            // An orderly stop (shutdown or drain): say so, then close 1000/1001.
            let reason = if state.draining {
                "drained"
            } else {
                "shutdown"
            };
            let _ = state.link.notify(
                Method::ExecutorClose,
                &CloseParams {
                    reason: reason.into(),
                },
            );
            let code = if state.draining {
                CloseCode::GoingAway
            } else {
                CloseCode::Normal
            };
            state.link.close(code, reason);
            let _ = tokio::time::timeout(Duration::from_secs(3), state.link.closed()).await;
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<ConnMsg>,
        msg: ConnMsg,
        state: &mut ConnState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ConnMsg::Heartbeat => {
                if state.heartbeat_in_flight {
                    return Ok(());
                }
                state.heartbeat_in_flight = true;
                let link = state.link.clone();
                let params = HeartbeatParams {
                    connection_id: state.registration.connection_id.clone(),
                    active_sessions: state.shared.active_sessions(),
                    load: None,
                };
                let timeout = state.shared.config.request_timeout;
                let me = myself.clone();
                tokio::spawn(async move {
                    let r = link
                        .request::<_, HeartbeatResult>(Method::ExecutorHeartbeat, &params, timeout)
                        .await;
                    let _ = me.send_message(match r {
                        Ok(result) => ConnMsg::HeartbeatAck(result),
                        Err(CallError::Closed) => return,
                        Err(e) => ConnMsg::HeartbeatFailed(e.to_string()),
                    });
                });
            }
            ConnMsg::HeartbeatAck(result) => {
                state.heartbeat_in_flight = false;
                if let Some(sessions) = state.shared.sessions_actor() {
                    let _ = sessions.send_message(SessionsMsg::HeartbeatAck {
                        lease_ttl_ms: result.lease_ttl_ms,
                    });
                }
                if result.drain && !state.draining {
                    self.start_drain(&myself, state, "harness asked to drain".into(), None);
                }
            }
            ConnMsg::HeartbeatFailed(e) => {
                tracing::warn!(error = %e, "heartbeat unanswered: connection lost");
                state
                    .shared
                    .metrics
                    .connection_lost("heartbeat_timeout".to_owned());
                state.link.close(CloseCode::GoingAway, "heartbeat timeout");
                myself.stop(Some(stop::lost("heartbeat timeout")));
            }
            ConnMsg::Lost(closed) => {
                tracing::warn!(code = ?closed.code, reason = %closed.reason, "connection lost");
                state.shared.metrics.connection_lost(
                    closed
                        .code
                        .map_or_else(|| "none".to_owned(), |c| c.code().to_string()),
                );
                let reason = match FinalStop::from_close(closed.code) {
                    Some(f) => f.reason(),
                    None => stop::lost(format_args!("{:?} {}", closed.code, closed.reason)),
                };
                myself.stop(Some(reason));
            }
            ConnMsg::Drain(params, reply) => {
                reply.ok(&DrainResult {
                    accepted: true,
                    active_sessions: state.shared.active_sessions(),
                });
                if !state.draining {
                    self.start_drain(&myself, state, params.reason, params.deadline_ms);
                }
            }
            ConnMsg::Drained => {
                tracing::info!("drain complete");
                myself.stop(Some(FinalStop::Drained.reason()));
            }
        }
        Ok(())
    }
}

impl Connection {
    fn start_drain(
        &self,
        myself: &ActorRef<ConnMsg>,
        state: &mut ConnState,
        reason: String,
        deadline_ms: Option<u64>,
    ) {
        tracing::info!(%reason, ?deadline_ms, "draining");
        state.draining = true;
        state.shared.set_draining();
        match state.shared.sessions_actor() {
            Some(sessions) => {
                let _ = sessions.send_message(SessionsMsg::Drain {
                    deadline: Duration::from_millis(deadline_ms.unwrap_or(30_000)),
                    done: myself.clone(),
                });
            }
            None => {
                let _ = myself.send_message(ConnMsg::Drained);
            }
        }
    }
}

//! One actor per `service`-origin MCP server (session × serverKey),
//! harness side: the platform's server, reached by the session's processes
//! through the executor.
//!
//! The platform registers the server's Streamable HTTP URL
//! (`POST /v1/sessions/{id}/mcp-services`). The executor exposes the server
//! to the session's processes on a loopback endpoint and, on first use,
//! opens the channel toward the harness (`mcp.open`, executor → harness);
//! its `mcp.frame`s come here. This actor is the service's one MCP client,
//! like the executor's actor of an `environment` server: it sends
//! `initialize` itself ([`Relay`]), answers the clients' `initialize` from
//! the cached result, POSTs every other message to the URL
//! ([`crate::mcp::http::Http`], the same Streamable HTTP client
//! the executor uses for `transport: http`), and sends what the service
//! answers back as `mcp.frame`s on the link the frames came on.
//!
//! A service that is down never leaves a client hanging: the transport
//! answers a request it cannot deliver with an MCP error (unreachable,
//! HTTP error, `timeoutMs`), and a service that failed its `initialize`
//! (or ended its MCP session) answers every request with -32603 until the
//! next `mcp.open`, which tries `initialize` again.
//!
//! A `temporary` child of the harness's `mcp` dynamic supervisor, started
//! by the first `mcp.open` and stopped when the session ends or the
//! service is registered again. Payloads are never logged.

use super::get_or_start;
use crate::harness::error::ApiError;
use crate::harness::runtime::Shared;
use crate::lease::ConnId;
use crate::mcp::http::Http;
use crate::mcp::peer::PeerEvent;
use crate::mcp::relay::INIT_ID;
use crate::mcp::{Out, Relay, RelayConfig};
use crate::supervisor::ChildSpec;
use crate::wire::types::McpFrameParams;
use crate::wire::{ErrorCode, Link, Method, RpcError};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

/// `mcp.open`s waiting for the service's `initialize`.
const MAX_WAITING_OPENS: usize = 64;
/// Requests in flight to one service at once (the relay refuses more).
pub const MAX_IN_FLIGHT: usize = 256;
/// How long the service may take to answer one request (the default of
/// `timeoutMs`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// What the platform registered: where the service is.
#[derive(Clone)]
pub struct ServiceReg {
    /// A Streamable HTTP MCP endpoint. It may carry a credential (in its
    /// query): it is never logged, listed or put in an error.
    pub url: String,
    pub timeout: Duration,
}

pub enum ServiceMsg {
    /// `mcp.open` from the executor on `conn`.
    Open {
        link: Link,
        conn: ConnId,
        reply: oneshot::Sender<Result<(), RpcError>>,
    },
    /// An `mcp.frame` from the executor.
    Frame {
        link: Link,
        conn: ConnId,
        payload: String,
    },
    /// What the service's transport reports.
    Server(PeerEvent),
}

pub struct McpService;

pub struct ServiceArgs {
    pub shared: Arc<Shared>,
    pub session_id: String,
    pub server_key: String,
    pub reg: ServiceReg,
}

pub struct ServiceState {
    shared: Arc<Shared>,
    key: (String, String),
    reg: ServiceReg,
    relay: Relay,
    http: Http,
    /// The link answers go to (the one the last `mcp.open` came on).
    link: Option<(Link, ConnId)>,
    opens: Vec<oneshot::Sender<Result<(), RpcError>>>,
    /// The service failed `initialize` or ended its session: the next
    /// `mcp.open` starts over.
    failed: Option<String>,
}

fn unavailable(message: &str) -> RpcError {
    RpcError::new(ErrorCode::McpUnavailable, message.to_owned()).with_reason("service_unavailable")
}

fn transport(myself: &ActorRef<ServiceMsg>, reg: &ServiceReg, max: usize) -> Result<Http, String> {
    let me = myself.clone();
    let sink: crate::mcp::peer::Sink = Arc::new(move |ev| {
        let _ = me.send_message(ServiceMsg::Server(ev));
    });
    Http::new(reg.url.clone(), reg.timeout, max, sink)
}

impl Actor for McpService {
    type Msg = ServiceMsg;
    type State = ServiceState;
    type Arguments = ServiceArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ServiceMsg>,
        a: ServiceArgs,
    ) -> Result<ServiceState, ActorProcessingErr> {
        let max = a.shared.config.max_mcp_frame_bytes / 2;
        let http = transport(&myself, &a.reg, max)?;
        let relay = Relay::new(RelayConfig {
            max_in_flight: MAX_IN_FLIGHT,
        });
        http.send(relay.initialize(), Some(INIT_ID.into()));
        let key = (a.session_id, a.server_key);
        a.shared.mcp_service_actors.insert(key.clone(), myself);
        tracing::debug!(session = %key.0, server = %key.1, "mcp service actor started");
        Ok(ServiceState {
            shared: a.shared,
            key,
            reg: a.reg,
            relay,
            http,
            link: None,
            opens: Vec::new(),
            failed: None,
        })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<ServiceMsg>,
        state: &mut ServiceState,
    ) -> Result<(), ActorProcessingErr> {
        let outs = state
            .relay
            .crashed("the service was stopped", "session_ended");
        state.apply(outs);
        for open in state.opens.drain(..) {
            let _ = open.send(Err(unavailable("the service was stopped")));
        }
        state.http.shutdown().await;
        let id = myself.get_id();
        state
            .shared
            .mcp_service_actors
            .remove_if(&state.key, |_, a| a.get_id() == id);
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<ServiceMsg>,
        msg: ServiceMsg,
        state: &mut ServiceState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ServiceMsg::Open { link, conn, reply } => {
                state.link = Some((link, conn));
                if state.failed.is_some() {
                    state.restart(&myself)?;
                }
                if state.relay.is_ready() {
                    let _ = reply.send(Ok(()));
                } else if state.opens.len() >= MAX_WAITING_OPENS {
                    let _ = reply.send(Err(unavailable("too many opens waiting")));
                } else {
                    state.opens.push(reply);
                }
            }
            ServiceMsg::Frame {
                link,
                conn,
                payload,
            } => {
                if state.link.as_ref().map(|(_, c)| *c) != Some(conn) {
                    state.link = Some((link, conn));
                }
                let outs = state.relay.from_client(&payload);
                state.apply(outs);
            }
            ServiceMsg::Server(PeerEvent::Message(m)) => {
                let outs = state.relay.from_server(&m);
                state.apply(outs);
            }
            ServiceMsg::Server(PeerEvent::Messages(ms)) => {
                for m in ms {
                    let outs = state.relay.from_server(&m);
                    state.apply(outs);
                }
            }
            ServiceMsg::Server(PeerEvent::Oversized(id)) => {
                let outs = state.relay.oversized(id.as_deref(), state.max());
                state.apply(outs);
            }
            ServiceMsg::Server(PeerEvent::Closed(why)) => {
                tracing::info!(session = %state.key.0, server = %state.key.1, %why, "mcp service ended its session");
                state.fail(&why);
            }
        }
        Ok(())
    }
}

impl ServiceState {
    fn max(&self) -> usize {
        self.shared.config.max_mcp_frame_bytes / 2
    }

    /// A fresh client of the service (after a failed `initialize`).
    fn restart(&mut self, myself: &ActorRef<ServiceMsg>) -> Result<(), String> {
        self.http = transport(myself, &self.reg, self.max())?;
        self.relay = Relay::new(RelayConfig {
            max_in_flight: MAX_IN_FLIGHT,
        });
        self.failed = None;
        self.http
            .send(self.relay.initialize(), Some(INIT_ID.into()));
        Ok(())
    }

    fn fail(&mut self, why: &str) {
        let outs = self
            .relay
            .crashed("the service is unavailable", "service_unavailable");
        self.apply(outs);
        self.failed = Some(why.to_owned());
        for open in self.opens.drain(..) {
            let _ = open.send(Err(unavailable("the service did not answer initialize")));
        }
    }

    fn to_executor(&self, payload: String) {
        let Some((link, _)) = &self.link else {
            tracing::debug!("mcp service answer with no executor link: dropped");
            return;
        };
        let _ = link.notify(
            Method::McpFrame,
            &McpFrameParams {
                session_id: self.key.0.clone(),
                server_key: self.key.1.clone(),
                payload,
            },
        );
    }

    fn apply(&mut self, outs: Vec<Out>) {
        for out in outs {
            match out {
                Out::ToServer(m) => self.http.send(m, None),
                Out::Request { id, message } => self.http.send(message, Some(id)),
                Out::ToClient(m) | Out::Notify(m) => self.to_executor(m),
                Out::Initialized => {
                    let version = self
                        .relay
                        .init_result()
                        .and_then(|r| serde_json::from_str::<serde_json::Value>(r).ok())
                        .and_then(|v| v["protocolVersion"].as_str().map(str::to_owned));
                    self.http.initialized(version);
                    tracing::info!(session = %self.key.0, server = %self.key.1, "mcp service ready");
                    for open in self.opens.drain(..) {
                        let _ = open.send(Ok(()));
                    }
                }
                Out::InitFailed(why) => self.fail(&why),
                Out::Dropped(why) => tracing::trace!(why, "mcp service message not relayed"),
            }
        }
    }
}

/// The service actor of (session, key), started if the service is
/// registered; `Ok(None)` if it is not.
pub async fn ensure(
    shared: &Arc<Shared>,
    session_id: &str,
    server_key: &str,
) -> Result<Option<ActorRef<ServiceMsg>>, ApiError> {
    let key = (session_id.to_owned(), server_key.to_owned());
    let Some(reg) = shared.mcp_services.get(&key).map(|r| r.clone()) else {
        return Ok(None);
    };
    let live = || {
        let a = shared.mcp_service_actors.get(&key).map(|a| a.clone())?;
        super::alive(&a).then_some(a)
    };
    let spec = || {
        ChildSpec::temporary(
            format!("service:{session_id}/{server_key}"),
            McpService,
            ServiceArgs {
                shared: shared.clone(),
                session_id: key.0.clone(),
                server_key: key.1.clone(),
                reg: reg.clone(),
            },
        )
    };
    get_or_start(
        live,
        || shared.mcp(),
        spec,
        "MCP channels",
        "too_many_mcp_channels",
    )
    .await
    .map(Some)
}

/// `mcp.open` from the executor for a `service` server: `Ok` once the
/// service answered `initialize`; -32014 for a key the session has no
/// registered service for, or a service that is down.
pub async fn open(
    shared: &Arc<Shared>,
    link: Link,
    conn: ConnId,
    session_id: &str,
    server_key: &str,
) -> Result<(), RpcError> {
    let actor = match ensure(shared, session_id, server_key).await {
        Ok(Some(a)) => a,
        Ok(None) => {
            return Err(RpcError::new(
                ErrorCode::McpUnavailable,
                format!("no service registered as {server_key:?} for this session"),
            )
            .with_reason("unknown_server"))
        }
        Err(e) => return Err(e.error),
    };
    let (tx, rx) = oneshot::channel();
    if actor
        .send_message(ServiceMsg::Open {
            link,
            conn,
            reply: tx,
        })
        .is_err()
    {
        return Err(unavailable("the service actor stopped"));
    }
    match tokio::time::timeout(shared.config.mcp_open_timeout, rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(unavailable("the service actor stopped")),
        Err(_) => Err(unavailable("the service did not answer initialize in time")),
    }
}

/// An `mcp.frame` from the executor for a `service` server; handed back
/// when no service actor is there (the caller tries the `environment`
/// channels).
pub fn frame(
    shared: &Shared,
    link: &Link,
    conn: ConnId,
    p: McpFrameParams,
) -> Result<(), McpFrameParams> {
    let key = (p.session_id, p.server_key);
    match shared.mcp_service_actors.get(&key).map(|a| a.clone()) {
        Some(a) => {
            let _ = a.send_message(ServiceMsg::Frame {
                link: link.clone(),
                conn,
                payload: p.payload,
            });
            Ok(())
        }
        None => Err(McpFrameParams {
            session_id: key.0,
            server_key: key.1,
            payload: p.payload,
        }),
    }
}

/// The session ended (or the service is registered again): stop its
/// service actors.
pub fn stop(shared: &Shared, session_id: &str, server_key: Option<&str>) {
    let actors: Vec<ActorRef<ServiceMsg>> = shared
        .mcp_service_actors
        .iter()
        .filter(|e| e.key().0 == session_id && server_key.is_none_or(|k| e.key().1 == k))
        .map(|e| e.value().clone())
        .collect();
    for a in actors {
        a.stop(Some("session ended".into()));
    }
    if server_key.is_none() {
        shared.mcp_services.retain(|k, _| k.0 != session_id);
    }
}

//! One MCP server of a session: its transport (a stdio child or an HTTP
//! peer) and the sans-IO [`Relay`] that keeps every request it carries
//! answered.
//!
//! The actor is a `transient` child of its session with a restart budget:
//! a server that dies after it was ready makes the actor fail, and the
//! session's supervisor rules restart it (with backoff) until the budget is
//! spent; then the server is `unavailable`. A server that never gets
//! through its first `initialize` ends the actor normally: restarting a
//! server that cannot start helps nobody, and a failed server must never
//! hold up `session.ready`. Whatever was in flight when the server went is
//! answered with an MCP error (-32603), never silence.
//!
//! MCP payloads are never logged (they may carry secrets): only methods,
//! sizes and reasons.

use super::session::SessionMsg;
use crate::executor::mcp::launch::Launch;
use crate::executor::mcp::{http::Http, Transport};
use crate::executor::stdio_peer::{PeerEvent, Sink, StdioPeer, StdioSpec};
use crate::executor::Shared;
use crate::mcp::{Out, Relay, RelayConfig};
use crate::wire::request::McpRequest;
use crate::wire::types::{Accepted, McpCloseResult, McpFrameParams, McpOpenResult, McpServerState};
use crate::wire::{ErrorCode, Method, Responder, RpcError};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// `mcp.open`s waiting for a starting server.
const MAX_WAITING_OPENS: usize = 64;

pub enum McpMsg {
    Request(McpRequest, Option<Responder>),
    Server(PeerEvent),
    InitTimeout,
    /// The connection is gone: the harness opens the channel again.
    Disconnected,
}

/// A change the session reports in `session.status`.
#[derive(Debug, Clone)]
pub struct McpChange {
    pub key: String,
    pub state: McpServerState,
    pub reason: Option<String>,
    pub last_error: Option<String>,
}

/// What survives a restart is in `Arc`s: the spec, the start count, and
/// whether the harness holds the channel open.
#[derive(Clone)]
pub struct McpArgs {
    pub shared: Arc<Shared>,
    pub session: ActorRef<SessionMsg>,
    pub session_id: String,
    pub key: String,
    pub launch: Arc<Launch>,
    pub scope: String,
    pub secrets: Arc<Vec<String>>,
    pub starts: Arc<AtomicU32>,
    pub open: Arc<AtomicBool>,
    pub init_timeout: Duration,
    pub max_message: usize,
}

#[derive(Clone)]
pub struct McpServer;

pub struct McpState {
    args: McpArgs,
    relay: Relay,
    transport: Transport,
    opens: Vec<Responder>,
    /// Set once the actor is on its way out (reported, in-flight answered).
    ended: bool,
}

impl McpState {
    fn report(&self, state: McpServerState, reason: Option<&str>, error: Option<String>) {
        let _ = self
            .args
            .session
            .send_message(SessionMsg::McpChanged(McpChange {
                key: self.args.key.clone(),
                state,
                reason: reason.map(str::to_owned),
                last_error: error,
            }));
    }

    fn to_client(&self, payload: String) {
        let Some(link) = self.args.shared.link() else {
            tracing::debug!(server = %self.args.key, "mcp answer with no connection: the harness answers its clients itself");
            return;
        };
        let _ = link.notify(
            Method::McpFrame,
            &McpFrameParams {
                session_id: self.args.session_id.clone(),
                server_key: self.args.key.clone(),
                payload,
            },
        );
    }

    /// Carry out what the relay decided. `Err`: the server failed its
    /// `initialize` (the caller ends the actor).
    fn apply(&mut self, outs: Vec<Out>) -> Result<(), String> {
        for out in outs {
            match out {
                Out::ToServer(msg) => {
                    if let Err(why) = self.transport.send(msg, None) {
                        tracing::debug!(server = %self.args.key, error = %why, "mcp message to the server dropped");
                    }
                }
                Out::Request { id, message } => {
                    if let Err(why) = self.transport.send(message, Some(id.clone())) {
                        let more = self.relay.undeliverable(&id, &why);
                        self.apply(more)?;
                    }
                }
                Out::ToClient(msg) => self.to_client(msg),
                Out::Notify(msg) => {
                    if self.args.open.load(Ordering::Relaxed) {
                        self.to_client(msg);
                    }
                }
                Out::Initialized => self.initialized(),
                Out::InitFailed(why) => return Err(why),
                Out::Dropped(why) => {
                    tracing::trace!(server = %self.args.key, why, "mcp message not relayed")
                }
            }
        }
        Ok(())
    }

    fn initialized(&mut self) {
        let version = self
            .relay
            .init_result()
            .and_then(|r| serde_json::from_str::<serde_json::Value>(r).ok())
            .and_then(|v| v["protocolVersion"].as_str().map(str::to_owned));
        self.transport.initialized(version);
        tracing::info!(session = %self.args.session_id, server = %self.args.key, "mcp server ready");
        self.report(McpServerState::Ready, None, None);
        for open in self.opens.drain(..) {
            self.args.open.store(true, Ordering::Relaxed);
            open.ok(&McpOpenResult { opened: true });
        }
        if self.args.starts.load(Ordering::Relaxed) > 1 && self.args.open.load(Ordering::Relaxed) {
            // A restarted server may list other tools: clients re-list.
            self.to_client(
                r#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#.to_owned(),
            );
        }
    }

    /// The server is gone: answer everything in flight, refuse waiting
    /// opens.
    fn gone(&mut self, message: &str, reason: &str) {
        self.ended = true;
        let outs = self.relay.crashed(message, reason);
        let _ = self.apply(outs);
        for open in self.opens.drain(..) {
            open.err(unavailable(reason, message));
        }
    }

    /// The first start failed (or the server cannot run): unavailable, no
    /// restart.
    fn give_up(&mut self, myself: &ActorRef<McpMsg>, why: String) {
        let why = crate::executor::stdio_peer::redact(&why, &self.args.secrets);
        tracing::warn!(session = %self.args.session_id, server = %self.args.key, error = %why, "mcp server failed to start");
        self.gone("server unavailable", "unavailable");
        self.report(
            McpServerState::Unavailable,
            Some("initialize_failed"),
            Some(why),
        );
        myself.stop(Some("normal".into()));
    }

    /// Whether this is the server's first life.
    fn first(&self) -> bool {
        self.args.starts.load(Ordering::Relaxed) <= 1
    }
}

pub fn unavailable(reason: &str, message: &str) -> RpcError {
    RpcError::new(ErrorCode::McpUnavailable, message.to_owned()).with_reason(reason.to_owned())
}

impl Actor for McpServer {
    type Msg = McpMsg;
    type State = McpState;
    type Arguments = McpArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<McpMsg>,
        args: McpArgs,
    ) -> Result<McpState, ActorProcessingErr> {
        args.starts.fetch_add(1, Ordering::Relaxed);
        let me = myself.clone();
        let sink: Sink = Arc::new(move |ev| {
            let _ = me.send_message(McpMsg::Server(ev));
        });
        let label = format!("{}/{}", args.session_id, args.key);
        let transport = match &*args.launch {
            Launch::Stdio {
                program,
                arg0,
                args: argv,
                cwd,
                env,
            } => {
                let stdio = StdioPeer::start(
                    StdioSpec {
                        program: program.clone(),
                        arg0: arg0.clone(),
                        args: argv.clone(),
                        cwd: cwd.clone(),
                        env: env.clone(),
                        scope: args.scope.clone(),
                        max_message: args.max_message,
                        secrets: args.secrets.clone(),
                        label,
                    },
                    sink,
                )
                .map_err(|e| format!("spawn_failed: {}: {e}", program.display()))?;
                Transport::Stdio(stdio)
            }
            // The transport answers a request past `timeoutMs` itself.
            Launch::Http { url, timeout } => {
                Transport::Http(Http::new(url.clone(), *timeout, args.max_message, sink)?)
            }
        };
        Ok(McpState {
            relay: Relay::new(RelayConfig::default()),
            transport,
            opens: Vec::new(),
            ended: false,
            args,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<McpMsg>,
        state: &mut McpState,
    ) -> Result<(), ActorProcessingErr> {
        let a = &state.args;
        a.shared.mcp.insert(
            crate::executor::runtime::process_key(&a.session_id, &a.key),
            myself.clone(),
        );
        tracing::debug!(session = %a.session_id, server = %a.key, pid = ?state.transport.pid(), "mcp server started");
        state.report(McpServerState::Starting, None, None);
        let init = state.relay.initialize();
        if let Err(why) = state
            .transport
            .send(init, Some(crate::mcp::relay::INIT_ID.into()))
        {
            return Err(why.into());
        }
        myself.send_after(state.args.init_timeout, || McpMsg::InitTimeout);
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<McpMsg>,
        state: &mut McpState,
    ) -> Result<(), ActorProcessingErr> {
        let a = &state.args;
        let key = crate::executor::runtime::process_key(&a.session_id, &a.key);
        a.shared
            .mcp
            .remove_if(&key, |_, v| v.get_id() == myself.get_id());
        if !state.ended {
            // Stopped by the session (it ends): nothing in flight is lost.
            state.gone("session ended", "session_ended");
        }
        state.transport.shutdown().await;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<McpMsg>,
        msg: McpMsg,
        state: &mut McpState,
    ) -> Result<(), ActorProcessingErr> {
        if state.ended {
            if let McpMsg::Request(r, Some(reply)) = msg {
                let _ = r;
                reply.err(unavailable("server_crashed", "server restarted"));
            }
            return Ok(());
        }
        let result = match msg {
            McpMsg::Request(McpRequest::McpOpen(_), reply) => {
                let Some(reply) = reply else { return Ok(()) };
                if state.relay.is_ready() {
                    state.args.open.store(true, Ordering::Relaxed);
                    reply.ok(&McpOpenResult { opened: true });
                } else if state.opens.len() >= MAX_WAITING_OPENS {
                    reply.err(unavailable("busy", "too many opens waiting for the server"));
                } else {
                    state.opens.push(reply);
                }
                Ok(())
            }
            McpMsg::Request(McpRequest::McpClose(_), reply) => {
                state.args.open.store(false, Ordering::Relaxed);
                if let Some(r) = reply {
                    r.ok(&McpCloseResult { closed: true });
                }
                Ok(())
            }
            McpMsg::Request(McpRequest::McpFrame(p), reply) => {
                let outs = state.relay.from_client(&p.payload);
                if let Some(r) = reply {
                    r.ok(&Accepted::YES);
                }
                state.apply(outs)
            }
            McpMsg::Server(PeerEvent::Message(m)) => {
                let outs = state.relay.from_server(&m);
                state.apply(outs)
            }
            McpMsg::Server(PeerEvent::Messages(ms)) => {
                for m in ms {
                    let outs = state.relay.from_server(&m);
                    state.apply(outs)?;
                }
                Ok(())
            }
            McpMsg::Server(PeerEvent::Oversized(id)) => {
                tracing::warn!(server = %state.args.key, "mcp server sent a message over the frame limit");
                let outs = state.relay.oversized(id.as_deref(), state.args.max_message);
                state.apply(outs)
            }
            McpMsg::Server(PeerEvent::Closed(why)) => {
                if state.first() && !state.relay.is_ready() {
                    Err(why)
                } else {
                    let why = crate::executor::stdio_peer::redact(&why, &state.args.secrets);
                    tracing::warn!(session = %state.args.session_id, server = %state.args.key, error = %why, "mcp server crashed");
                    state.gone("server restarted", "server_crashed");
                    // Abnormal: the session's supervisor rules restart it.
                    return Err(format!("mcp server crashed: {why}").into());
                }
            }
            McpMsg::InitTimeout => {
                if state.relay.is_ready() {
                    Ok(())
                } else {
                    Err(format!(
                        "no answer to initialize within {} ms",
                        state.args.init_timeout.as_millis()
                    ))
                }
            }
            McpMsg::Disconnected => {
                state.args.open.store(false, Ordering::Relaxed);
                Ok(())
            }
        };
        if let Err(why) = result {
            let tail = state.transport.stderr_tail();
            let why = match tail.lines().rev().find(|l| !l.trim().is_empty()) {
                Some(line) if !why.contains(line.trim()) => format!("{why}: {}", line.trim()),
                _ => why,
            };
            if state.first() {
                state.give_up(&myself, why);
            } else {
                // A restarted server that cannot initialize again: a crash,
                // which spends the budget.
                state.gone("server restarted", "server_crashed");
                return Err(why.into());
            }
        }
        Ok(())
    }
}

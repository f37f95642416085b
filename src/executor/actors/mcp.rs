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
//! A server's answers do not wait for the actor: the transport's reader
//! feeds them to the relay itself ([`Fast`]) and sends the `mcp.frame`, so
//! an answer costs no mailbox hop. On a multi-threaded runtime each hop is
//! a task wake-up, and past three in a row tokio wakes an idle worker too
//! (docs/benchmarks.md, "MCP"). Whatever the relay answers with more than
//! frames to the harness (an `initialize` answer, a server's own request),
//! and every event behind one of those, goes through the mailbox in order.
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
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// `mcp.open`s waiting for a starting server.
const MAX_WAITING_OPENS: usize = 64;

pub enum McpMsg {
    Request(McpRequest, Option<Responder>),
    Server(PeerEvent),
    /// What the relay decided for a server message the reader could not
    /// carry out itself (see [`Fast`]).
    Apply(Vec<Out>),
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
    /// The session's sandbox: a stdio server runs in it.
    pub sandbox: Arc<crate::sandbox::Sandbox>,
    pub secrets: Arc<Vec<String>>,
    pub starts: Arc<AtomicU32>,
    pub open: Arc<AtomicBool>,
    pub init_timeout: Duration,
    pub max_message: usize,
}

#[derive(Clone)]
pub struct McpServer;

/// The relay and what the transport's reader needs to answer the harness
/// without the actor.
pub struct Fast {
    relay: Mutex<Relay>,
    /// Server events handed to the mailbox and not yet carried out: while
    /// any is, the reader hands the next ones over too, so they keep their
    /// order.
    behind: AtomicUsize,
    args: McpArgs,
}

impl Fast {
    fn relay(&self) -> MutexGuard<'_, Relay> {
        // Every relay call leaves it whole; a panic elsewhere cannot tear it.
        self.relay.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The transport's sink: answers go to the harness from here.
    fn sink(self: &Arc<Fast>, actor: ActorRef<McpMsg>) -> Sink {
        let fast = self.clone();
        Arc::new(move |ev| match ev {
            PeerEvent::Message(m) => {
                if let Some(m) = fast.relay_now(m, &actor) {
                    fast.hand_over(&actor, McpMsg::Server(PeerEvent::Message(m)));
                }
            }
            PeerEvent::Messages(ms) => {
                let mut rest = ms.into_iter();
                while let Some(m) = rest.next() {
                    if let Some(m) = fast.relay_now(m, &actor) {
                        let left = std::iter::once(m).chain(rest).collect();
                        fast.hand_over(&actor, McpMsg::Server(PeerEvent::Messages(left)));
                        break;
                    }
                }
            }
            other => fast.hand_over(&actor, McpMsg::Server(other)),
        })
    }

    /// Relay one server message here when nothing is waiting in the mailbox
    /// and the server is ready; `Some(message)` when the actor must.
    fn relay_now(&self, m: String, actor: &ActorRef<McpMsg>) -> Option<String> {
        if self.behind.load(Ordering::Acquire) != 0 {
            return Some(m);
        }
        let outs = {
            let mut relay = self.relay();
            if !relay.is_ready() {
                return Some(m);
            }
            relay.from_server(&m)
        };
        if !outs.iter().all(is_frame) {
            // A ping to answer: the actor owns the writes to the server.
            self.hand_over(actor, McpMsg::Apply(outs));
            return None;
        }
        for out in outs {
            frame_out(&self.args, out);
        }
        None
    }

    fn hand_over(&self, actor: &ActorRef<McpMsg>, msg: McpMsg) {
        self.behind.fetch_add(1, Ordering::AcqRel);
        if actor.send_message(msg).is_err() {
            self.behind.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Whether the relay's outcome only concerns the harness (a frame, or
/// nothing at all): what the transport's reader may carry out itself.
fn is_frame(out: &Out) -> bool {
    matches!(out, Out::ToClient(_) | Out::Notify(_) | Out::Dropped(_))
}

/// Carry out an outcome that [`is_frame`]; any other is handed back.
fn frame_out(args: &McpArgs, out: Out) -> Option<Out> {
    match out {
        Out::ToClient(msg) => to_client(args, msg),
        Out::Notify(msg) => {
            if args.open.load(Ordering::Relaxed) {
                to_client(args, msg)
            }
        }
        Out::Dropped(why) => {
            tracing::trace!(server = %args.key, why, "mcp message not relayed")
        }
        other => return Some(other),
    }
    None
}

/// Send one MCP message to the harness (`mcp.frame`).
fn to_client(args: &McpArgs, payload: String) {
    let Some(link) = args.shared.link() else {
        tracing::debug!(server = %args.key, "mcp answer with no connection: the harness answers its clients itself");
        return;
    };
    let _ = link.notify(
        Method::McpFrame,
        &McpFrameParams {
            session_id: args.session_id.clone(),
            server_key: args.key.clone(),
            payload,
        },
    );
}

pub struct McpState {
    /// The relay, and the arguments (`fast.args`).
    fast: Arc<Fast>,
    transport: Transport,
    opens: Vec<Responder>,
    /// Set once the actor is on its way out (reported, in-flight answered).
    ended: bool,
}

impl McpState {
    fn report(&self, state: McpServerState, reason: Option<&str>, error: Option<String>) {
        let _ = self
            .fast
            .args
            .session
            .send_message(SessionMsg::McpChanged(McpChange {
                key: self.fast.args.key.clone(),
                state,
                reason: reason.map(str::to_owned),
                last_error: error,
            }));
    }

    fn to_client(&self, payload: String) {
        to_client(&self.fast.args, payload)
    }

    fn relay(&self) -> MutexGuard<'_, Relay> {
        self.fast.relay()
    }

    /// Carry out what the relay decided. `Err`: the server failed its
    /// `initialize` (the caller ends the actor).
    fn apply(&mut self, outs: Vec<Out>) -> Result<(), String> {
        for out in outs {
            let Some(out) = frame_out(&self.fast.args, out) else {
                continue;
            };
            match out {
                Out::ToServer(msg) => {
                    if let Err(why) = self.transport.send(msg, None) {
                        tracing::debug!(server = %self.fast.args.key, error = %why, "mcp message to the server dropped");
                    }
                }
                Out::Request { id, message } => {
                    if let Err(why) = self.transport.send(message, Some(id.clone())) {
                        let more = self.relay().undeliverable(&id, &why);
                        self.apply(more)?;
                    }
                }
                Out::Initialized => self.initialized(),
                Out::InitFailed(why) => return Err(why),
                // Carried out by `frame_out` above.
                Out::ToClient(_) | Out::Notify(_) | Out::Dropped(_) => {}
            }
        }
        Ok(())
    }

    fn initialized(&mut self) {
        let version = self
            .relay()
            .init_result()
            .and_then(|r| serde_json::from_str::<serde_json::Value>(r).ok())
            .and_then(|v| v["protocolVersion"].as_str().map(str::to_owned));
        self.transport.initialized(version);
        tracing::info!(session = %self.fast.args.session_id, server = %self.fast.args.key, "mcp server ready");
        self.report(McpServerState::Ready, None, None);
        for open in self.opens.drain(..) {
            self.fast.args.open.store(true, Ordering::Relaxed);
            open.ok(&McpOpenResult { opened: true });
        }
        if self.fast.args.starts.load(Ordering::Relaxed) > 1
            && self.fast.args.open.load(Ordering::Relaxed)
        {
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
        let outs = self.relay().crashed(message, reason);
        let _ = self.apply(outs);
        for open in self.opens.drain(..) {
            open.err(unavailable(reason, message));
        }
    }

    /// The first start failed (or the server cannot run): unavailable, no
    /// restart.
    fn give_up(&mut self, myself: &ActorRef<McpMsg>, why: String) {
        let why = crate::executor::stdio_peer::redact(&why, &self.fast.args.secrets);
        tracing::warn!(session = %self.fast.args.session_id, server = %self.fast.args.key, error = %why, "mcp server failed to start");
        self.gone("server unavailable", "unavailable");
        self.report(
            McpServerState::Unavailable,
            Some("initialize_failed"),
            Some(why),
        );
        myself.stop(Some("normal".into()));
    }

    /// A server event the reader handed over. `Err`: the server crashed
    /// (the actor fails); `Ok(Err(why))`: it failed its start.
    fn server(&mut self, ev: PeerEvent) -> Result<Result<(), String>, ActorProcessingErr> {
        Ok(match ev {
            PeerEvent::Message(m) => {
                let outs = self.relay().from_server(&m);
                self.apply(outs)
            }
            PeerEvent::Messages(ms) => {
                for m in ms {
                    let outs = self.relay().from_server(&m);
                    if let Err(why) = self.apply(outs) {
                        return Ok(Err(why));
                    }
                }
                Ok(())
            }
            PeerEvent::Oversized(id) => {
                tracing::warn!(server = %self.fast.args.key, "mcp server sent a message over the frame limit");
                let outs = self
                    .relay()
                    .oversized(id.as_deref(), self.fast.args.max_message);
                self.apply(outs)
            }
            PeerEvent::Closed(why) => {
                if self.first() && !self.relay().is_ready() {
                    Err(why)
                } else {
                    let why = crate::executor::stdio_peer::redact(&why, &self.fast.args.secrets);
                    tracing::warn!(session = %self.fast.args.session_id, server = %self.fast.args.key, error = %why, "mcp server crashed");
                    self.gone("server restarted", "server_crashed");
                    // Abnormal: the session's supervisor rules restart it.
                    return Err(format!("mcp server crashed: {why}").into());
                }
            }
        })
    }

    /// Whether this is the server's first life.
    fn first(&self) -> bool {
        self.fast.args.starts.load(Ordering::Relaxed) <= 1
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
        let fast = Arc::new(Fast {
            relay: Mutex::new(Relay::new(RelayConfig::default())),
            behind: AtomicUsize::new(0),
            args: args.clone(),
        });
        let sink = fast.sink(myself.clone());
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
                        unit: Some(
                            args.sandbox
                                .unit()
                                .map_err(|e| format!("spawn_failed: {e}"))?,
                        ),
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
            fast,
            transport,
            opens: Vec::new(),
            ended: false,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<McpMsg>,
        state: &mut McpState,
    ) -> Result<(), ActorProcessingErr> {
        let a = &state.fast.args;
        a.shared.mcp.insert(
            crate::executor::runtime::process_key(&a.session_id, &a.key),
            myself.clone(),
        );
        tracing::debug!(session = %a.session_id, server = %a.key, pid = ?state.transport.pid(), "mcp server started");
        state.report(McpServerState::Starting, None, None);
        let init = state.relay().initialize();
        if let Err(why) = state
            .transport
            .send(init, Some(crate::mcp::relay::INIT_ID.into()))
        {
            return Err(why.into());
        }
        myself.send_after(state.fast.args.init_timeout, || McpMsg::InitTimeout);
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<McpMsg>,
        state: &mut McpState,
    ) -> Result<(), ActorProcessingErr> {
        let a = &state.fast.args;
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
            match msg {
                McpMsg::Request(_, Some(reply)) => {
                    reply.err(unavailable("server_crashed", "server restarted"))
                }
                McpMsg::Server(_) | McpMsg::Apply(_) => {
                    state.fast.behind.fetch_sub(1, Ordering::AcqRel);
                }
                _ => {}
            }
            return Ok(());
        }
        let result = match msg {
            McpMsg::Request(McpRequest::McpOpen(_), reply) => {
                let Some(reply) = reply else { return Ok(()) };
                if state.relay().is_ready() {
                    state.fast.args.open.store(true, Ordering::Relaxed);
                    reply.ok(&McpOpenResult { opened: true });
                } else if state.opens.len() >= MAX_WAITING_OPENS {
                    reply.err(unavailable("busy", "too many opens waiting for the server"));
                } else {
                    state.opens.push(reply);
                }
                Ok(())
            }
            McpMsg::Request(McpRequest::McpClose(_), reply) => {
                state.fast.args.open.store(false, Ordering::Relaxed);
                if let Some(r) = reply {
                    r.ok(&McpCloseResult { closed: true });
                }
                Ok(())
            }
            McpMsg::Request(McpRequest::McpFrame(p), reply) => {
                let outs = state.relay().from_client(&p.payload);
                if let Some(r) = reply {
                    r.ok(&Accepted::YES);
                }
                state.apply(outs)
            }
            McpMsg::Apply(outs) => {
                state.fast.behind.fetch_sub(1, Ordering::AcqRel);
                state.apply(outs)
            }
            McpMsg::Server(ev) => {
                let r = state.server(ev);
                state.fast.behind.fetch_sub(1, Ordering::AcqRel);
                r?
            }
            McpMsg::InitTimeout => {
                if state.relay().is_ready() {
                    Ok(())
                } else {
                    Err(format!(
                        "no answer to initialize within {} ms",
                        state.fast.args.init_timeout.as_millis()
                    ))
                }
            }
            McpMsg::Disconnected => {
                state.fast.args.open.store(false, Ordering::Relaxed);
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

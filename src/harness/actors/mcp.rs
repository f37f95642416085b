//! One actor per MCP channel (session × serverKey), harness side.
//!
//! The actor drives a [`McpProxy`] (the id map, progress routing and client
//! sessions, sans-IO) with the harness clock and does its I/O: it opens the
//! channel (`mcp.open` on the link of the session's holder), sends the
//! proxy's payloads as `mcp.frame` notifications, hands the server's
//! messages to the HTTP handlers waiting for them (a [`Port`] per request,
//! a bounded queue per client notification stream) and keeps the server's
//! tool list ([`McpToolsView`] in [`Shared::mcp_tools`]).
//!
//! Started under the harness's `mcp` dynamic supervisor ([`ensure_channel`])
//! on first use: an HTTP client, `session.ready`, or the server reported
//! `ready` in `session.status`. It lives as long as its session.
//!
//! What a lost channel means to clients: the executor buffers no MCP frames
//! across connections, so when the link that carried the channel closes,
//! every request in flight is answered here with `-32603`
//! (`data.reason: executor_disconnected`) and the actor re-opens the channel
//! (with backoff) once the session's executor is back. Every request also
//! has a deadline ([`HarnessConfig::mcp_request_timeout`](crate::harness::HarnessConfig)):
//! past it the client gets `-32001` and the server `notifications/cancelled`.
//!
//! Logs carry methods, ids, sizes and reasons, never a payload: MCP
//! messages may hold secrets.

use super::leases::{LeasesMsg, Route};
use super::{alive, get_or_start};
use crate::harness::api::mcp::{McpToolInfo, McpToolsView};
use crate::harness::api::sessions::ask;
use crate::harness::error::ApiError;
use crate::harness::mcp_proxy::{
    error_response, failure, McpProxy, Out, ProxyLimits, TooManyClients,
};
use crate::harness::runtime::Shared;
use crate::harness::types::SessionState;
use crate::lease::ConnId;
use crate::mcp::raw::RawObject;
use crate::supervisor::ChildSpec;
use crate::wire::types::{
    now_rfc3339, McpCloseParams, McpFrameParams, McpOpenParams, McpOpenResult, McpServerState,
    McpServerStatus,
};
use crate::wire::{CallError, ErrorCode, Link, Method, RpcError};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// (session id, serverKey).
pub type ChannelKey = (String, String);

/// Progress notifications queued for one request's SSE answer; more are
/// dropped (the answer itself never is: it has its own slot).
pub const PROGRESS_QUEUE: usize = 64;
/// Client notifications queued while the channel opens.
const PENDING_NOTES: usize = 64;
/// `tools/list` pages followed at most.
const MAX_TOOL_PAGES: u32 = 16;
/// Tools kept per server at most.
const MAX_TOOLS: usize = 1024;
/// Bytes of tool names, descriptions and schemas kept per server at most.
const MAX_TOOLS_BYTES: usize = 1 << 20;
const MAX_DESCRIPTION_BYTES: usize = 8 << 10;
const MAX_SCHEMA_BYTES: usize = 64 << 10;
/// How often live notification streams are checked for a gone client.
const STREAM_SWEEP_MS: u64 = 30_000;
/// Backoff of re-opening a channel after its executor connection was lost.
const RETRY_BASE_MS: u64 = 250;
const RETRY_MAX_MS: u64 = 5_000;

/// Where an HTTP handler waits for one request's answer: progress
/// notifications (bounded), then exactly one response.
#[derive(Debug)]
pub struct Port {
    /// `None` when the answer is JSON, which cannot carry progress: the
    /// server's progress for that request is dropped (logged at debug).
    pub progress: Option<mpsc::Sender<String>>,
    pub done: oneshot::Sender<String>,
}

/// A client message the HTTP layer must refuse with an HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("unknown or ended MCP client session")]
    UnknownClient,
    #[error("too many MCP client sessions on this server (at most {0})")]
    TooManyClients(usize),
    #[error("this MCP client session already has a notification stream open")]
    AlreadyStreaming,
}

/// Why a channel could not be opened.
#[derive(Debug)]
enum OpenError {
    /// The session is unknown or over: the actor ends.
    SessionGone,
    /// The session's executor is disconnected (or the link closed while
    /// opening): try again later.
    Disconnected,
    /// The executor refused (`-32014` and its `data.reason`, `-32011`) or
    /// did not answer in time.
    Refused(RpcError),
}

pub enum McpMsg {
    /// A client request (HTTP POST). `client: None` is an `initialize`: a
    /// client session is minted and its id comes back in `accepted`.
    Request {
        client: Option<String>,
        id: Value,
        method: String,
        body: RawObject,
        port: Port,
        accepted: oneshot::Sender<Result<Option<String>, EndpointError>>,
    },
    /// A client notification (HTTP POST, answered 202).
    Notify {
        client: String,
        method: String,
        body: RawObject,
        accepted: oneshot::Sender<Result<(), EndpointError>>,
    },
    /// A client response (the executor answers server requests itself, so
    /// it is only checked and dropped).
    ClientResponse {
        client: String,
        accepted: oneshot::Sender<Result<(), EndpointError>>,
    },
    /// Open a client's notification stream (HTTP GET).
    Attach {
        client: String,
        reply: oneshot::Sender<Result<mpsc::Receiver<String>, EndpointError>>,
    },
    /// End a client session (HTTP DELETE); `false` if unknown.
    EndClient {
        client: String,
        reply: oneshot::Sender<bool>,
    },
    /// An `mcp.frame` from the executor, on connection `conn`.
    FromExecutor { conn: ConnId, payload: String },
    /// `mcp.close` from the executor.
    ExecutorClosed { conn: ConnId, reason: String },
    /// The server's state changed (`session.status`).
    Status(McpServerStatus),
    /// `session.ready`: open the channel and list the tools.
    Wake,
    /// The session ended: answer everything, stop.
    SessionEnded { reason: String },
    /// An `mcp.open` attempt finished.
    Opened {
        epoch: u64,
        result: Result<(Link, ConnId), OpenErrorMsg>,
    },
    /// The link the channel was opened on closed.
    LinkClosed { epoch: u64 },
    /// Deadlines (timeouts, idle clients, stream sweep).
    Tick,
    /// Try to open again after a lost connection.
    Retry,
}

/// [`OpenError`] as carried in a message (opaque outside this module).
#[derive(Debug)]
pub struct OpenErrorMsg(OpenError);

pub struct McpChannel;

pub struct McpArgs {
    pub shared: Arc<Shared>,
    pub session_id: String,
    pub server_key: String,
}

enum Channel {
    Closed,
    Opening,
    Open {
        link: Link,
        conn: ConnId,
        /// Ends the watcher of `link` when the channel is left.
        watch: CancellationToken,
    },
}

#[derive(Default)]
struct ToolsFetch {
    /// A listing should run once the channel is open.
    dirty: bool,
    running: bool,
    /// Another listing was asked for while one ran.
    again: bool,
    pages: u32,
    acc: Vec<McpToolInfo>,
    bytes: usize,
    truncated: bool,
}

pub struct McpState {
    shared: Arc<Shared>,
    key: ChannelKey,
    span: tracing::Span,
    proxy: McpProxy<Port>,
    channel: Channel,
    /// Bumped at each open attempt; stale answers and watchers are ignored.
    epoch: u64,
    /// Payloads waiting for the channel to open.
    outbox: Vec<String>,
    /// Client session → its notification stream (GET).
    streams: HashMap<String, mpsc::Sender<String>>,
    tools: ToolsFetch,
    timer: super::DeadlineTimer<McpMsg>,
    retry_attempt: u32,
    retry_armed: bool,
}

/// The first characters of a client session id, for logs (the whole id is
/// a credential of that client session).
fn short(client: &str) -> &str {
    client.get(..8).unwrap_or(client)
}

/// A fresh client session id: 128 random bits, hex.
fn mint_client_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl Actor for McpChannel {
    type Msg = McpMsg;
    type State = McpState;
    type Arguments = McpArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<McpMsg>,
        a: McpArgs,
    ) -> Result<McpState, ActorProcessingErr> {
        let span =
            tracing::info_span!("mcp_channel", session = %a.session_id, server = %a.server_key);
        let config = &a.shared.config;
        let limits = ProxyLimits {
            max_clients: config.mcp_max_clients,
            max_in_flight: config.mcp_max_in_flight,
            client_idle_ms: config.mcp_client_idle.as_millis() as u64,
            request_timeout_ms: config.mcp_request_timeout.as_millis() as u64,
        };
        let key = (a.session_id, a.server_key);
        a.shared.mcp_channels.insert(key.clone(), myself);
        span.in_scope(|| tracing::debug!("mcp channel actor started"));
        Ok(McpState {
            shared: a.shared,
            key,
            span,
            proxy: McpProxy::new(limits),
            channel: Channel::Closed,
            epoch: 0,
            outbox: Vec::new(),
            streams: HashMap::new(),
            tools: ToolsFetch {
                dirty: true,
                ..Default::default()
            },
            timer: Default::default(),
            retry_attempt: 0,
            retry_armed: false,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<McpMsg>,
        msg: McpMsg,
        state: &mut McpState,
    ) -> Result<(), ActorProcessingErr> {
        let span = state.span.clone();
        let _g = span.enter();
        state.handle(&myself, msg);
        state.rearm(&myself);
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<McpMsg>,
        state: &mut McpState,
    ) -> Result<(), ActorProcessingErr> {
        // Stopped from outside (harness shutdown) with requests in flight:
        // they are answered, never left hanging.
        let outs = state.proxy.fail_all(&failure(
            "channel_stopped",
            "the harness stopped serving this MCP server",
        ));
        state.execute(&myself, outs);
        state.leave_channel();
        state.timer.cancel();
        state.streams.clear();
        let id = myself.get_id();
        state
            .shared
            .mcp_channels
            .remove_if(&state.key, |_, a| a.get_id() == id);
        state.shared.mcp_tools.remove(&state.key);
        Ok(())
    }
}

impl McpState {
    fn now(&self) -> u64 {
        self.shared.now_ms()
    }

    fn handle(&mut self, myself: &ActorRef<McpMsg>, msg: McpMsg) {
        match msg {
            McpMsg::Request {
                client,
                id,
                method,
                body,
                port,
                accepted,
            } => self.request(myself, client, id, method, body, port, accepted),
            McpMsg::Notify {
                client,
                method,
                body,
                accepted,
            } => {
                let now = self.now();
                if !self.proxy.touch(&client, now) {
                    let _ = accepted.send(Err(EndpointError::UnknownClient));
                    return;
                }
                let _ = accepted.send(Ok(()));
                match self.proxy.notification(&client, &method, body, now) {
                    Some(payload) => {
                        tracing::debug!(%method, client = short(&client), bytes = payload.len(), "client notification");
                        if !matches!(self.channel, Channel::Open { .. })
                            && self.outbox.len()
                                >= self.proxy.limits().max_in_flight + PENDING_NOTES
                        {
                            tracing::info!(%method, "client notification dropped: the channel is not open and the queue is full");
                            return;
                        }
                        self.send(myself, payload);
                    }
                    None => tracing::debug!(%method, "client notification not for the server"),
                }
            }
            McpMsg::ClientResponse { client, accepted } => {
                let now = self.now();
                let known = self.proxy.touch(&client, now);
                let _ = accepted.send(if known {
                    Ok(())
                } else {
                    Err(EndpointError::UnknownClient)
                });
                tracing::debug!(
                    client = short(&client),
                    "client response dropped (the executor answers server requests)"
                );
            }
            McpMsg::Attach { client, reply } => {
                let now = self.now();
                if !self.proxy.has_client(&client) {
                    let _ = reply.send(Err(EndpointError::UnknownClient));
                    return;
                }
                if self.streams.get(&client).is_some_and(|tx| !tx.is_closed()) {
                    let _ = reply.send(Err(EndpointError::AlreadyStreaming));
                    return;
                }
                let (tx, rx) = mpsc::channel(self.shared.config.mcp_stream_queue.max(1));
                self.streams.insert(client.clone(), tx);
                self.proxy.set_streaming(&client, true, now);
                tracing::debug!(client = short(&client), "notification stream opened");
                let _ = reply.send(Ok(rx));
                self.ensure_open(myself);
            }
            McpMsg::EndClient { client, reply } => {
                let outs = self.proxy.remove_client(&client);
                self.streams.remove(&client);
                let known = outs.is_some();
                if let Some(outs) = outs {
                    tracing::debug!(client = short(&client), "client session ended");
                    self.execute(myself, outs);
                }
                let _ = reply.send(known);
            }
            McpMsg::FromExecutor { conn, payload } => {
                let current = matches!(&self.channel, Channel::Open { conn: c, .. } if *c == conn);
                if !current {
                    tracing::debug!(
                        bytes = payload.len(),
                        "mcp.frame for a channel not open on this connection: dropped"
                    );
                    return;
                }
                let now = self.now();
                let outs = self.proxy.from_server(&payload, now);
                self.execute(myself, outs);
            }
            McpMsg::ExecutorClosed { conn, reason } => {
                let current = matches!(&self.channel, Channel::Open { conn: c, .. } if *c == conn);
                if !current {
                    return;
                }
                tracing::info!(%reason, "the executor closed the mcp channel");
                self.leave_channel();
                let error = failure("channel_closed", "the executor closed the MCP channel")
                    .with_detail(truncate(&reason, 256));
                let outs = self.proxy.fail_all(&error);
                self.execute(myself, outs);
                self.outbox.clear();
            }
            McpMsg::Status(s) => {
                tracing::debug!(state = ?s.state, restarts = s.restarts, "mcp server status");
                if s.state == McpServerState::Ready {
                    self.refresh_tools(myself);
                    self.ensure_open(myself);
                }
            }
            McpMsg::Wake => {
                self.refresh_tools(myself);
                self.ensure_open(myself);
            }
            McpMsg::SessionEnded { reason } => {
                tracing::debug!(%reason, "session ended: mcp channel stops");
                let outs = self
                    .proxy
                    .fail_all(&failure("session_ended", "the session ended").with_detail(reason));
                self.execute(myself, outs);
                self.streams.clear();
                myself.stop(None);
            }
            McpMsg::Opened { epoch, result } => self.opened(myself, epoch, result),
            McpMsg::LinkClosed { epoch } => {
                if epoch != self.epoch || !matches!(self.channel, Channel::Open { .. }) {
                    return;
                }
                tracing::info!("the executor connection of this mcp channel closed");
                self.leave_channel();
                let outs = self.proxy.fail_all(&disconnected());
                self.execute(myself, outs);
                self.outbox.clear();
                self.schedule_retry(myself);
            }
            McpMsg::Tick => {
                let now = self.now();
                let expired = self.proxy.expire(now);
                for c in &expired.clients {
                    tracing::debug!(client = short(c), "idle client session forgotten");
                    self.streams.remove(c);
                }
                self.execute(myself, expired.outs);
                let gone: Vec<String> = self
                    .streams
                    .iter()
                    .filter(|(_, tx)| tx.is_closed())
                    .map(|(c, _)| c.clone())
                    .collect();
                for c in gone {
                    self.streams.remove(&c);
                    self.proxy.set_streaming(&c, false, now);
                }
            }
            McpMsg::Retry => {
                self.retry_armed = false;
                self.ensure_open(myself);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn request(
        &mut self,
        myself: &ActorRef<McpMsg>,
        client: Option<String>,
        id: Value,
        method: String,
        body: RawObject,
        port: Port,
        accepted: oneshot::Sender<Result<Option<String>, EndpointError>>,
    ) {
        let now = self.now();
        let (client, minted) = match client {
            Some(c) => {
                if !self.proxy.touch(&c, now) {
                    let _ = accepted.send(Err(EndpointError::UnknownClient));
                    return;
                }
                (c, None)
            }
            None => {
                let c = mint_client_id();
                if let Err(TooManyClients(n)) = self.proxy.add_client(&c, now) {
                    let _ = accepted.send(Err(EndpointError::TooManyClients(n)));
                    return;
                }
                tracing::debug!(client = short(&c), "client session minted");
                (c.clone(), Some(c))
            }
        };
        match self.proxy.request(&client, id.clone(), body, port, now) {
            Ok(payload) => {
                let _ = accepted.send(Ok(minted));
                tracing::debug!(%method, client = short(&client), bytes = payload.len(), "client request");
                self.send(myself, payload);
            }
            Err((port, why)) => {
                tracing::debug!(%method, error = %why, "client request refused");
                let _ = port.done.send(error_response(&id, &why.rpc()));
                let _ = accepted.send(Ok(minted));
            }
        }
    }

    /// Send a payload now, or queue it and open the channel.
    fn send(&mut self, myself: &ActorRef<McpMsg>, payload: String) {
        if let Channel::Open { link, .. } = &self.channel {
            let params = McpFrameParams {
                session_id: self.key.0.clone(),
                server_key: self.key.1.clone(),
                payload,
            };
            if link.notify(Method::McpFrame, &params).is_err() {
                // The writer is gone: the watcher reports the close; the
                // requests in flight are answered then.
                tracing::debug!("mcp.frame not sent: the link is closing");
            }
            return;
        }
        self.outbox.push(payload);
        self.ensure_open(myself);
    }

    /// Send a payload only if the channel is open (cancellations).
    fn send_if_open(&mut self, payload: String) {
        if let Channel::Open { link, .. } = &self.channel {
            let params = McpFrameParams {
                session_id: self.key.0.clone(),
                server_key: self.key.1.clone(),
                payload,
            };
            let _ = link.notify(Method::McpFrame, &params);
        }
    }

    /// Carry out what the proxy decided.
    fn execute(&mut self, myself: &ActorRef<McpMsg>, outs: Vec<Out<Port>>) {
        for out in outs {
            match out {
                Out::Answer { port, message } => {
                    let _ = port.done.send(message);
                }
                Out::Progress { request, message } => {
                    if let Some(port) = self.proxy.port(&request) {
                        let queued = port.progress.as_ref().map(|q| q.try_send(message));
                        if !matches!(queued, Some(Ok(()))) {
                            tracing::debug!(%request, "progress notification dropped (a JSON answer, or a slow or gone reader)");
                        }
                    }
                }
                Out::Broadcast { message } => self.broadcast(message),
                Out::ToolsChanged => {
                    tracing::debug!("tools/list_changed: listing again");
                    self.refresh_tools(myself);
                }
                Out::Internal { method, result } => self.internal_answer(myself, &method, result),
                Out::Send { payload } => self.send_if_open(payload),
                Out::Ignored { why } => tracing::debug!(why, "mcp message ignored"),
            }
        }
    }

    /// A server notification to every client's stream; a stream that is
    /// full is dropped (its client reconnects), never waited for.
    fn broadcast(&mut self, message: String) {
        let now = self.now();
        let mut dropped = Vec::new();
        for (client, tx) in &self.streams {
            match tx.try_send(message.clone()) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => {
                    tracing::warn!(
                        client = short(client),
                        "notification stream too slow: dropped"
                    );
                    dropped.push(client.clone());
                }
                Err(mpsc::error::TrySendError::Closed(_)) => dropped.push(client.clone()),
            }
        }
        for c in dropped {
            self.streams.remove(&c);
            self.proxy.set_streaming(&c, false, now);
        }
    }

    fn ensure_open(&mut self, myself: &ActorRef<McpMsg>) {
        if !matches!(self.channel, Channel::Closed) {
            return;
        }
        self.epoch += 1;
        let epoch = self.epoch;
        self.channel = Channel::Opening;
        let shared = self.shared.clone();
        let (session_id, server_key) = self.key.clone();
        let me = myself.clone();
        tracing::debug!(epoch, "opening the mcp channel");
        tokio::spawn(
            async move {
                let result = open(&shared, &session_id, &server_key).await;
                let _ = me.send_message(McpMsg::Opened {
                    epoch,
                    result: result.map_err(OpenErrorMsg),
                });
            }
            .instrument(self.span.clone()),
        );
    }

    fn opened(
        &mut self,
        myself: &ActorRef<McpMsg>,
        epoch: u64,
        result: Result<(Link, ConnId), OpenErrorMsg>,
    ) {
        if epoch != self.epoch || !matches!(self.channel, Channel::Opening) {
            return;
        }
        match result {
            Ok((link, conn)) => {
                tracing::info!(epoch, "mcp channel open");
                let watch = CancellationToken::new();
                let (w, l, me) = (watch.clone(), link.clone(), myself.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        _ = l.closed() => { let _ = me.send_message(McpMsg::LinkClosed { epoch }); }
                        _ = w.cancelled() => {}
                    }
                });
                self.channel = Channel::Open { link, conn, watch };
                self.retry_attempt = 0;
                for payload in std::mem::take(&mut self.outbox) {
                    self.send(myself, payload);
                }
                if self.tools.dirty {
                    self.refresh_tools(myself);
                }
            }
            Err(OpenErrorMsg(e)) => {
                self.channel = Channel::Closed;
                self.outbox.clear();
                match e {
                    OpenError::SessionGone => {
                        tracing::debug!("session gone: mcp channel stops");
                        let outs = self
                            .proxy
                            .fail_all(&failure("session_ended", "the session ended"));
                        self.execute(myself, outs);
                        self.streams.clear();
                        myself.stop(None);
                    }
                    OpenError::Disconnected => {
                        tracing::debug!("mcp.open: the executor is disconnected");
                        let outs = self.proxy.fail_all(&disconnected());
                        self.execute(myself, outs);
                        self.schedule_retry(myself);
                    }
                    OpenError::Refused(error) => {
                        tracing::info!(code = error.code, reason = ?error.reason(), "mcp.open refused");
                        let outs = self.proxy.fail_all(&error);
                        self.execute(myself, outs);
                        self.tools_failed(&error.message);
                    }
                }
            }
        }
    }

    /// Leave an open channel (its watcher ends).
    fn leave_channel(&mut self) {
        if let Channel::Open { watch, .. } = &self.channel {
            watch.cancel();
        }
        self.channel = Channel::Closed;
        if self.tools.running {
            self.tools.running = false;
        }
        self.tools.dirty = true;
    }

    fn schedule_retry(&mut self, myself: &ActorRef<McpMsg>) {
        if self.retry_armed {
            return;
        }
        let delay = (RETRY_BASE_MS << self.retry_attempt.min(8)).min(RETRY_MAX_MS);
        self.retry_attempt = self.retry_attempt.saturating_add(1);
        self.retry_armed = true;
        myself.send_after(Duration::from_millis(delay), || McpMsg::Retry);
    }

    /// Arm the timer for the proxy's next deadline (and the stream sweep).
    fn rearm(&mut self, myself: &ActorRef<McpMsg>) {
        let now = self.now();
        let mut next = self.proxy.next_deadline();
        if !self.streams.is_empty() {
            let sweep = now + STREAM_SWEEP_MS;
            next = Some(next.map_or(sweep, |n| n.min(sweep)));
        }
        self.timer.arm(myself, next, now, || McpMsg::Tick);
    }

    fn refresh_tools(&mut self, myself: &ActorRef<McpMsg>) {
        if !matches!(self.channel, Channel::Open { .. }) {
            self.tools.dirty = true;
            return;
        }
        if self.tools.running {
            self.tools.again = true;
            return;
        }
        self.tools = ToolsFetch {
            running: true,
            ..Default::default()
        };
        self.tools_page(myself, None);
    }

    fn tools_page(&mut self, myself: &ActorRef<McpMsg>, cursor: Option<String>) {
        let params = match cursor {
            Some(c) => serde_json::json!({ "cursor": c }),
            None => serde_json::json!({}),
        };
        let now = self.now();
        match self.proxy.internal("tools/list", params, now) {
            Ok(payload) => {
                self.tools.pages += 1;
                self.send(myself, payload);
            }
            Err(e) => {
                tracing::debug!(error = %e, "tools/list not sent");
                self.tools.running = false;
                self.tools.dirty = true;
            }
        }
    }

    fn internal_answer(
        &mut self,
        myself: &ActorRef<McpMsg>,
        method: &str,
        result: Result<Value, Value>,
    ) {
        if method != "tools/list" {
            return;
        }
        match result {
            Ok(v) => {
                let next = self.take_tools(&v);
                if let Some(cursor) = next {
                    if self.tools.pages < MAX_TOOL_PAGES && !self.tools.truncated {
                        return self.tools_page(myself, Some(cursor));
                    }
                    self.tools.truncated = true;
                }
                let view = McpToolsView {
                    tools: std::mem::take(&mut self.tools.acc),
                    truncated: self.tools.truncated,
                    updated_at: Some(now_rfc3339()),
                    error: None,
                };
                tracing::debug!(
                    tools = view.tools.len(),
                    truncated = view.truncated,
                    "tool list fetched"
                );
                self.shared.mcp_tools.insert(self.key.clone(), view);
                self.tools.dirty = false;
            }
            Err(e) => {
                let message = e
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("tools/list failed")
                    .to_owned();
                tracing::debug!(code = ?e.get("code"), "tools/list failed");
                self.tools_failed(&message);
                if !matches!(self.channel, Channel::Open { .. }) {
                    self.tools.dirty = true;
                }
            }
        }
        self.tools.running = false;
        if std::mem::take(&mut self.tools.again) {
            self.refresh_tools(myself);
        }
    }

    /// Keep the previous list, with why the last listing failed.
    fn tools_failed(&mut self, message: &str) {
        let mut view = self
            .shared
            .mcp_tools
            .get(&self.key)
            .map(|v| v.clone())
            .unwrap_or_default();
        view.error = Some(truncate(message, 512));
        self.shared.mcp_tools.insert(self.key.clone(), view);
    }

    /// Add one page of `tools/list` within the bounds; the next cursor.
    fn take_tools(&mut self, result: &Value) -> Option<String> {
        let tools = result.get("tools").and_then(Value::as_array);
        for t in tools.into_iter().flatten() {
            if self.tools.acc.len() >= MAX_TOOLS {
                self.tools.truncated = true;
                break;
            }
            let Some(name) = t
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty() && n.len() <= 256)
            else {
                continue;
            };
            let title = t
                .get("title")
                .and_then(Value::as_str)
                .map(|s| truncate(s, 256));
            let description = t
                .get("description")
                .and_then(Value::as_str)
                .map(|s| truncate(s, MAX_DESCRIPTION_BYTES));
            let input_schema = t
                .get("inputSchema")
                .filter(|s| s.to_string().len() <= MAX_SCHEMA_BYTES)
                .cloned();
            let bytes = name.len()
                + title.as_ref().map_or(0, String::len)
                + description.as_ref().map_or(0, String::len)
                + input_schema.as_ref().map_or(0, |s| s.to_string().len());
            if self.tools.bytes + bytes > MAX_TOOLS_BYTES {
                self.tools.truncated = true;
                break;
            }
            self.tools.bytes += bytes;
            self.tools.acc.push(McpToolInfo {
                name: name.to_owned(),
                title,
                description,
                input_schema,
            });
        }
        result
            .get("nextCursor")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty() && c.len() <= 1024)
            .map(str::to_owned)
    }
}

/// At most `max` bytes of `s`, cut at a character boundary.
fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn disconnected() -> RpcError {
    failure(
        "executor_disconnected",
        "the executor of this session disconnected",
    )
}

/// `mcp.open` on the link of the session's holder.
async fn open(
    shared: &Shared,
    session_id: &str,
    server_key: &str,
) -> Result<(Link, ConnId), OpenError> {
    let sid = session_id.to_owned();
    let route: Result<Route, ApiError> = ask(shared, |reply| LeasesMsg::Route {
        session_id: sid,
        reply,
    })
    .await
    .and_then(|r| r);
    let route = match route {
        Ok(r) => r,
        Err(e) if e.status == 404 || e.status == 410 => return Err(OpenError::SessionGone),
        Err(e) if e.reason() == Some("shutting_down") => return Err(OpenError::SessionGone),
        Err(_) => return Err(OpenError::Disconnected),
    };
    let params = McpOpenParams {
        session_id: session_id.to_owned(),
        server_key: server_key.to_owned(),
    };
    let timeout = shared.config.mcp_open_timeout;
    match route
        .request::<_, McpOpenResult>(Method::McpOpen, &params, timeout)
        .await
    {
        Ok(r) if r.opened => Ok((route.link, route.conn)),
        Ok(_) => Err(OpenError::Refused(
            RpcError::new(
                ErrorCode::McpUnavailable,
                "the executor did not open the channel",
            )
            .with_reason("not_opened"),
        )),
        Err(CallError::Rpc(e)) => Err(OpenError::Refused(e)),
        Err(CallError::Closed) => Err(OpenError::Disconnected),
        Err(CallError::Timeout(d)) => Err(OpenError::Refused(
            RpcError::new(
                ErrorCode::McpUnavailable,
                "the MCP server did not open in time",
            )
            .with_reason("open_timeout")
            .with_detail(format!("mcp.open unanswered within {d:?}")),
        )),
        Err(e @ CallError::TooLarge { .. }) => Err(OpenError::Refused(
            RpcError::payload_too_large(e.to_string()).with_reason("frame_too_large"),
        )),
        Err(CallError::Decode(d)) => Err(OpenError::Refused(
            RpcError::internal(format!("undecodable mcp.open answer: {d}"))
                .with_reason("bad_executor_answer"),
        )),
    }
}

/// The channel actor of (session, serverKey), started if needed.
///
/// # Errors
///
/// 404 for an unknown session (-32011) or a serverKey the session does not
/// have (-32014, `reason: unknown_server`), 410 for an ended session, 429
/// when the harness serves `mcp_max_channels` channels, 503 while it shuts
/// down.
pub async fn ensure_channel(
    shared: &Arc<Shared>,
    session_id: &str,
    server_key: &str,
) -> Result<ActorRef<McpMsg>, ApiError> {
    {
        let info = shared
            .sessions
            .get(session_id)
            .ok_or_else(|| ApiError::unknown_session(session_id))?;
        if info.state == SessionState::Ended {
            return Err(ApiError::session_ended(session_id));
        }
        // `service` servers are the platform's: no channel toward the
        // executor (their frames go the other way, `mcp_service`).
        if !info.mcp_servers.iter().any(|s| {
            s.server_key == server_key
                && s.connection_origin == crate::wire::types::ConnectionOrigin::Environment
        }) {
            return Err(ApiError::with_status(
                404,
                RpcError::new(
                    ErrorCode::McpUnavailable,
                    format!("session {session_id:?} has no MCP server {server_key:?}"),
                )
                .with_reason("unknown_server"),
            ));
        }
    }
    let key = (session_id.to_owned(), server_key.to_owned());
    let live = || {
        let a = shared.mcp_channels.get(&key).map(|a| a.clone())?;
        if alive(&a) {
            return Some(a);
        }
        let id = a.get_id();
        shared.mcp_channels.remove_if(&key, |_, x| x.get_id() == id);
        None
    };
    let spec = || {
        let args = McpArgs {
            shared: shared.clone(),
            session_id: key.0.clone(),
            server_key: key.1.clone(),
        };
        // `/` never occurs in a serverKey, so the id is unambiguous.
        ChildSpec::temporary(format!("{session_id}/{server_key}"), McpChannel, args)
    };
    get_or_start(
        live,
        || shared.mcp(),
        spec,
        "MCP channels",
        "too_many_mcp_channels",
    )
    .await
}

/// Route an `mcp.frame` from the executor to its channel, or to its
/// service actor for a `service` server (a notification: with neither it
/// is dropped, with a debug line).
pub fn from_executor(shared: &Shared, link: &Link, conn: ConnId, p: McpFrameParams) {
    let Err(p) = super::mcp_service::frame(shared, link, conn, p) else {
        return;
    };
    let key = (p.session_id, p.server_key);
    match shared.mcp_channels.get(&key).map(|a| a.clone()) {
        Some(a) => {
            let _ = a.send_message(McpMsg::FromExecutor {
                conn,
                payload: p.payload,
            });
        }
        None => {
            tracing::debug!(session = %key.0, server = %key.1, bytes = p.payload.len(), "mcp.frame for no open channel: dropped")
        }
    }
}

/// `mcp.close` from the executor.
pub fn executor_closed(shared: &Shared, conn: ConnId, p: McpCloseParams) {
    let key = (p.session_id, p.server_key);
    if let Some(a) = shared.mcp_channels.get(&key).map(|a| a.clone()) {
        let _ = a.send_message(McpMsg::ExecutorClosed {
            conn,
            reason: p.reason,
        });
    }
}

/// A session ended: its channels answer what they hold and stop.
pub fn session_ended(shared: &Shared, session_id: &str, reason: &str) {
    super::mcp_service::stop(shared, session_id, None);
    let actors: Vec<ActorRef<McpMsg>> = shared
        .mcp_channels
        .iter()
        .filter(|e| e.key().0 == session_id)
        .map(|e| e.value().clone())
        .collect();
    for a in actors {
        let _ = a.send_message(McpMsg::SessionEnded {
            reason: reason.to_owned(),
        });
    }
}

/// Hand `msg` to the channel of (session, key), starting it if needed (in
/// a task: the caller is an actor that must not wait).
pub fn wake(shared: &Arc<Shared>, session_id: &str, server_key: &str, msg: McpMsg) {
    let key = (session_id.to_owned(), server_key.to_owned());
    if let Some(a) = shared.mcp_channels.get(&key).map(|a| a.clone()) {
        if alive(&a) && a.send_message(msg).is_ok() {
            return;
        }
        // A dead entry: start a fresh actor (with a fresh message).
        return wake_new(shared, key, McpMsg::Wake);
    }
    wake_new(shared, key, msg);
}

fn wake_new(shared: &Arc<Shared>, key: ChannelKey, msg: McpMsg) {
    let shared = shared.clone();
    tokio::spawn(async move {
        match ensure_channel(&shared, &key.0, &key.1).await {
            Ok(a) => {
                let _ = a.send_message(msg);
            }
            Err(e) => {
                tracing::debug!(session = %key.0, server = %key.1, error = %e, "mcp channel not started")
            }
        }
    });
}

//! One session: its workspace, lease token, processes and tool calls.
//!
//! The session actor routes process and tool requests to its children and
//! owns their specs (for idempotent starts). It is also their supervisor:
//! its process and tool actors are `temporary` children linked under it
//! and kept in an embedded [`Children`] (the dynamic supervisor's rules
//! without an actor of their own: about 10 KiB less per session). A child
//! that crashes ends alone; its exit reaches the session as a supervision
//! event (a crashed process is killed by its tag and reported `failed`; a
//! crashed tool call gets an error `tool.result`).
//!
//! Tool results and `session.ready` are kept in outboxes until the harness
//! acknowledges them. `session.stop` terminates every process group
//! (SIGTERM, SIGKILL at the deadline, then every process still carrying the
//! session's tag), removes the workspace, answers, tells the sessions actor
//! why it ends, and stops.

use super::agent::{Agent, AgentArgs, AgentMsg};
use super::display::{Display, DisplayArgs, DisplayHandle};
use super::mcp::{McpArgs, McpChange, McpServer};
use super::process::{ProcessActor, ProcessArgs, ProcessMsg};
use super::sessions::SessionsMsg;
use super::tool::{ToolActor, ToolArgs, ToolMsg};
use super::turn::{Turn, TurnArgs, TurnMsg};
use crate::acp::updates::Emit;
use crate::executor::mcp::launch;
use crate::executor::outbox::{Delivery, OutboxEvent};
use crate::executor::Shared;
use crate::supervisor::children::{Children, Decision};
use crate::supervisor::Restart;
use crate::supervisor::{ChildExit, ChildSpec, Exit};
use crate::wire::request::McpRequest;
use crate::wire::request::ProcessRequest;
use crate::wire::request::TurnRequest;
use crate::wire::types::Accepted;
use crate::wire::types::{
    AssignParams, ProcState, ProcessListResult, ProcessStartParams, ProcessState,
    ProcessStatusParams, ReadyParams, SessionStatus, StatusParams, StopResult, ToolCallParams,
    ToolCancelResult, ToolResultParams,
};
use crate::wire::types::{ConnectionOrigin, McpServerSpec, McpServerState, McpServerStatus};
use crate::wire::types::{EventDeltaParams, SessionEventParams, TurnCancelResult, TurnStartResult};
use crate::wire::{Method, Responder, RpcError};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// Requests the router hands a session: generated from the method table
/// (the rows it owns, plus process requests the router could not deliver
/// straight to their process).
pub use crate::wire::request::SessionRequest;

pub enum SessionMsg {
    Request(SessionRequest, Responder),
    /// A higher fencing token renewed the lease in place.
    Renewed {
        lease_token: String,
    },
    /// End the session.
    Stop {
        reason: String,
        deadline: Duration,
        keep_workspace: bool,
        reply: Option<Responder>,
    },
    /// A process changed state (from its actor).
    ProcessChanged(ProcessState),
    /// A resumed register succeeded: re-send what is unacknowledged.
    Reconnected,
    /// The connection is gone: hold deliveries until it is back.
    Disconnected,
    /// A tool call finished (from its actor, which then ends).
    ToolDone(Box<ToolResultParams>),
    /// `tool.result` delivery.
    ToolResults(OutboxEvent<String>),
    /// `session.ready` delivery.
    Ready(OutboxEvent<()>),
    /// An MCP server changed state (from its actor).
    McpChanged(McpChange),
    /// `mcp.*` for a server the router's map does not hold: unknown,
    /// unavailable, or between two lives.
    Mcp(McpRequest, Option<Responder>),
    /// A restart of a supervised child is due (after its backoff).
    RestartChild {
        id: String,
        generation: u64,
    },
    /// `turn.*` and `interaction.response`.
    Turn(TurnRequest, Responder),
    /// Events of the running turn, to number and deliver (from its actor).
    Emit {
        turn_id: String,
        emits: Vec<Emit>,
    },
    /// The agent's session id (`executorSessionRef`), from the turn.
    AcpSession(String),
    /// The restore of `session.assign.restore` ended (from its task).
    Restored(Result<usize, crate::executor::restore::RestoreError>),
    /// `session.event` delivery.
    Events(OutboxEvent<u64>),
    /// Test hook: panic in the handler (`None`), or make one child panic.
    #[doc(hidden)]
    Panic(Option<SessionChild>),
}

/// A child of the session's supervisor, by id. The one place a child id is
/// made and read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionChild {
    Process(String),
    Tool(String),
    Mcp(String),
    Agent,
    Turn(String),
}

impl SessionChild {
    pub fn id(&self) -> String {
        match self {
            SessionChild::Process(p) => format!("process/{p}"),
            SessionChild::Tool(t) => format!("tool/{t}"),
            SessionChild::Mcp(k) => format!("mcp/{k}"),
            SessionChild::Agent => "agent".to_owned(),
            SessionChild::Turn(t) => format!("turn/{t}"),
        }
    }

    pub fn parse(id: &str) -> Option<SessionChild> {
        if let Some(p) = id.strip_prefix("process/") {
            return Some(SessionChild::Process(p.to_owned()));
        }
        if let Some(k) = id.strip_prefix("mcp/") {
            return Some(SessionChild::Mcp(k.to_owned()));
        }
        if id == "agent" {
            return Some(SessionChild::Agent);
        }
        if let Some(t) = id.strip_prefix("turn/") {
            return Some(SessionChild::Turn(t.to_owned()));
        }
        id.strip_prefix("tool/")
            .map(|t| SessionChild::Tool(t.to_owned()))
    }
}

/// A tool call as the session knows it.
enum ToolCall {
    Running(ActorRef<ToolMsg>),
    /// Finished: the result is kept so a repeated `tool.call` of the same
    /// id re-sends it instead of running the tool again (at most once).
    Done(Box<ToolResultParams>),
}

/// Tool results kept while the harness is away, per session.
const TOOL_RESULTS_MAX: usize = 65_536;

pub struct SessionArgs {
    pub shared: Arc<Shared>,
    pub params: AssignParams,
    /// The session's bounds (the executor's, lowered by
    /// `metadata.sandbox`), checked at assign.
    pub bounds: crate::sandbox::Bounds,
}

struct ProcEntry {
    actor: ActorRef<ProcessMsg>,
    spec: ProcessStartParams,
    state: ProcState,
    /// The child's pid once it started: a crashed actor's tree is found
    /// from it (the scope tag is only set where no cgroup exists).
    pid: Option<u32>,
}

pub struct Session;

pub struct SessionState {
    shared: Arc<Shared>,
    id: String,
    work_id: String,
    lease_token: String,
    workspace: PathBuf,
    scope: String,
    /// What confines the session's code (issue 48), shared with every
    /// child actor that starts a process.
    sandbox: Arc<crate::sandbox::Sandbox>,
    /// `<work_root>/private/<id>`: the sandbox's temp and home.
    private: PathBuf,
    processes: HashMap<String, ProcEntry>,
    tools: HashMap<String, ToolCall>,
    /// This session's process and tool actors (it is their supervisor).
    children: Children,
    results: Delivery<String, ToolResultParams>,
    ready: Delivery<(), ReadyParams>,
    read_slots: Arc<Semaphore>,
    stopping: bool,
    /// The session's MCP servers by key, as `session.status` reports them.
    mcp: BTreeMap<String, McpEntry>,
    /// What `session.status` last said (sent again with every MCP change).
    phase: SessionStatus,
    /// `session.ready` waits for every MCP server to be ready or failed.
    ready_due: bool,
    /// `session.assign.mcpServers`, until they are started.
    specs: Vec<McpServerSpec>,
    /// The loopback endpoints of the `service` servers, by key (their
    /// URLs go into every process's environment).
    services: BTreeMap<String, Arc<crate::executor::mcp::service::Tunnel>>,
    /// The agent process's name, while one runs (child `agent`).
    agent: Option<String>,
    /// The running turn.
    turn: Option<(String, ActorRef<TurnMsg>)>,
    /// Turns by id, for idempotent `turn.start` (bounded, oldest first out).
    turns: HashMap<String, bool>,
    turn_order: std::collections::VecDeque<String>,
    /// The agent's ACP session (`executorSessionRef`).
    acp_session: Option<String>,
    /// Tools allowed for the whole session.
    always: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    /// `session.event`s until acknowledged, by sequence.
    events: Delivery<u64, SessionEventParams>,
    next_sequence: u64,
    /// The session's virtual display, from its first `computer_*` call.
    display: Option<DisplayHandle>,
    /// `session.assign.restore`: until it is done, the session is not
    /// ready (and never, when it failed).
    restore: Restore,
}

/// Where the restore of a backup into the workspace stands.
enum Restore {
    /// Nothing to restore, or restored.
    Done,
    /// To start in `post_start`.
    Due(crate::wire::types::RestoreSource),
    /// Running: the task, aborted if the session stops first.
    Running(tokio::task::AbortHandle),
    /// Failed: the session never becomes ready.
    Failed,
}

/// Turns remembered for idempotent starts.
const TURNS_KEPT: usize = 256;
/// Events kept while the harness is away, per session.
const EVENTS_MAX: usize = 65_536;

struct McpEntry {
    status: McpServerStatus,
    /// Whether the harness holds the channel open (survives restarts).
    open: Arc<std::sync::atomic::AtomicBool>,
}

/// The `BMX_SCOPE` of one MCP server of a session (`:` is not in any
/// process id's scope, so no process can share it).
pub fn mcp_scope(session_scope: &str, key: &str) -> String {
    format!("{session_scope}mcp:{}/", safe_name(key))
}

/// A directory name for a session id from the wire: the id itself when it
/// is short and plain, otherwise a hash (never `..`, `/` or a huge name).
pub fn safe_name(id: &str) -> String {
    let plain = !id.is_empty()
        && id.len() <= 64
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if plain {
        id.to_owned()
    } else {
        let digest = Sha256::digest(id.as_bytes());
        let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
        format!("h-{hex}")
    }
}

pub fn workspace_dir(work_root: &Path, session_id: &str) -> PathBuf {
    work_root.join("sessions").join(safe_name(session_id))
}

/// The `BMX_SCOPE` prefix of every process of a session.
pub fn session_scope(instance: &str, session_id: &str) -> String {
    format!("{instance}/{}/", safe_name(session_id))
}

/// The `BMX_SCOPE` of one process of a session. Scopes are matched by
/// prefix: the trailing `/` keeps process `p` from matching `p2`.
pub fn process_scope(session_scope: &str, process_id: &str) -> String {
    format!("{session_scope}{}/", safe_name(process_id))
}

/// Spec equality for idempotent starts: everything but `waitMs` (which is
/// about the call, not the process).
fn same_spec(a: &ProcessStartParams, b: &ProcessStartParams) -> bool {
    let mut a = a.clone();
    a.wait_ms = b.wait_ms;
    // A file transfer's one-time data path (token, ticket) is minted anew
    // by every request of the harness: the transfer is the rest.
    let strip = |p: &mut ProcessStartParams| {
        p.file_transfer = p
            .file_transfer
            .as_ref()
            .map(|f| Box::new(f.without_credentials()));
    };
    let mut b = b.clone();
    strip(&mut a);
    strip(&mut b);
    a == b
}

impl SessionState {
    fn status(&mut self, status: SessionStatus, detail: Option<String>) {
        self.phase = status;
        if let Some(link) = self.shared.link() {
            let _ = link.notify(
                Method::SessionStatus,
                &StatusParams {
                    session_id: self.id.clone(),
                    status,
                    detail,
                    mcp_servers: self.mcp.values().map(|e| e.status.clone()).collect(),
                },
            );
        }
    }

    /// Keep `session.ready` (for the current lease token) until
    /// acknowledged; once every MCP server is ready or has failed.
    fn send_ready(&mut self, myself: &ActorRef<SessionMsg>) {
        match self.restore {
            Restore::Done => {}
            Restore::Due(_) | Restore::Running(_) => {
                self.ready_due = true;
                return;
            }
            Restore::Failed => return,
        }
        let settled = self.mcp.values().all(|e| {
            matches!(
                e.status.state,
                McpServerState::Ready | McpServerState::Unavailable
            )
        });
        if !settled {
            self.ready_due = true;
            return;
        }
        self.ready_due = false;
        let params = ReadyParams {
            session_id: self.id.clone(),
            work_id: self.work_id.clone(),
            lease_token: self.lease_token.clone(),
        };
        let _ = self.ready.push((), params);
        self.ready.pump(&self.shared, myself, SessionMsg::Ready);
    }

    fn deliver_result(&mut self, myself: &ActorRef<SessionMsg>, result: ToolResultParams) {
        let id = result.tool_call_id.clone();
        self.shared.metrics.tool_result(&result);
        if let Err(e) = self.results.push(id.clone(), result.clone()) {
            tracing::error!(tool_call = %id, error = %e, "tool.result cannot be kept");
        }
        self.tools.insert(id, ToolCall::Done(Box::new(result)));
        self.results
            .pump(&self.shared, myself, SessionMsg::ToolResults);
    }

    /// A process or tool actor ended. A crash is never silent: the process
    /// is killed by its tag and reported `failed`; the tool call gets an
    /// error result.
    fn child_exited(&mut self, myself: &ActorRef<SessionMsg>, exit: ChildExit) {
        if let (Some(SessionChild::Turn(tid)), Exit::Normal | Exit::Shutdown(_)) =
            (SessionChild::parse(&exit.id), &exit.exit)
        {
            self.turn_ended(&tid);
        }
        let Exit::Abnormal(why) = exit.exit else {
            return;
        };
        match SessionChild::parse(&exit.id) {
            Some(SessionChild::Process(pid)) => {
                tracing::error!(session = %self.id, process = %pid, error = %why, "process actor crashed");
                self.shared
                    .processes
                    .remove(&crate::executor::runtime::process_key(&self.id, &pid));
                let scope = process_scope(&self.scope, &pid);
                let root = self
                    .processes
                    .get(&pid)
                    .and_then(|e| e.pid)
                    .and_then(|p| i32::try_from(p).ok());
                tokio::task::spawn_blocking(move || {
                    crate::process::sys::kill_tree(root, root, &scope)
                });
                let Some(entry) = self.processes.get_mut(&pid) else {
                    return;
                };
                if entry.state.is_final() {
                    return;
                }
                entry.state = ProcState::Failed;
                if let Some(link) = self.shared.link() {
                    let _ = link.notify(
                        Method::ProcessStatus,
                        &ProcessStatusParams {
                            session_id: self.id.clone(),
                            process_id: pid,
                            state: ProcState::Failed,
                            exit_code: None,
                            exit_signal: None,
                            ended_at: Some(crate::wire::types::now_rfc3339()),
                            reason: Some("internal_error".into()),
                            observed_at: crate::wire::types::now_rfc3339(),
                        },
                    );
                }
            }
            Some(SessionChild::Tool(tid)) => {
                if !matches!(self.tools.get(&tid), Some(ToolCall::Running(_))) {
                    return;
                }
                tracing::error!(session = %self.id, tool_call = %tid, error = %why, "tool actor crashed");
                let result = ToolResultParams {
                    session_id: self.id.clone(),
                    tool_call_id: tid,
                    outcome: crate::wire::types::Outcome::Failed,
                    is_error: true,
                    content: vec![crate::wire::types::ContentBlock::text(
                        "the tool call failed inside the executor".to_owned(),
                    )],
                    artifacts: Vec::new(),
                    duration_ms: 0,
                    reason: Some("internal_error".into()),
                };
                self.deliver_result(myself, result);
            }
            Some(SessionChild::Agent) => {
                tracing::error!(session = %self.id, error = %why, "agent past its restart budget");
                self.agent = None;
            }
            Some(SessionChild::Turn(tid)) => {
                tracing::error!(session = %self.id, turn = %tid, error = %why, "turn actor crashed");
                let mut events = crate::acp::updates::TurnEvents::new(&format!("{tid}.crash"));
                let mut emits =
                    events.error("internal_error", "the turn failed inside the executor");
                emits.extend(events.idle("end_turn", "failed"));
                self.emit(myself, &tid, emits);
                self.turn_ended(&tid);
            }
            Some(SessionChild::Mcp(key)) => {
                // Gone for good after an abnormal exit: the budget is spent
                // (a normal exit reported its own reason first).
                tracing::error!(session = %self.id, server = %key, error = %why, "mcp server past its restart budget");
                self.mcp_changed(
                    myself,
                    McpChange {
                        key,
                        state: McpServerState::Unavailable,
                        reason: Some("restart_budget_exhausted".into()),
                        last_error: Some(why),
                    },
                );
            }
            None => {}
        }
    }

    fn turn_ended(&mut self, turn_id: &str) {
        if self.turn.as_ref().is_some_and(|(t, _)| t == turn_id) {
            self.turn = None;
        }
        if let Some(done) = self.turns.get_mut(turn_id) {
            *done = true;
        }
    }

    /// Number the turn's final events and keep them until acknowledged;
    /// send the deltas as they come (best effort).
    fn emit(&mut self, myself: &ActorRef<SessionMsg>, turn_id: &str, emits: Vec<Emit>) {
        for e in emits {
            match e {
                Emit::Event { event_id, event } => {
                    let sequence = self.next_sequence;
                    self.next_sequence += 1;
                    let params = SessionEventParams {
                        session_id: self.id.clone(),
                        turn_id: turn_id.to_owned(),
                        event_id,
                        sequence,
                        event,
                    };
                    if let Err(e) = self.events.push(sequence, params) {
                        tracing::error!(session = %self.id, sequence, error = %e, "session.event cannot be kept");
                    }
                }
                Emit::Delta {
                    event_id,
                    event_type,
                    index,
                    text,
                } => {
                    if let Some(link) = self.shared.link() {
                        let _ = link.notify(
                            Method::SessionEventDelta,
                            &EventDeltaParams {
                                session_id: self.id.clone(),
                                turn_id: turn_id.to_owned(),
                                event_id,
                                event_type: event_type.to_owned(),
                                index,
                                text,
                            },
                        );
                    }
                }
            }
        }
        self.events.pump(&self.shared, myself, SessionMsg::Events);
    }

    fn mcp_changed(&mut self, myself: &ActorRef<SessionMsg>, change: McpChange) {
        let Some(entry) = self.mcp.get_mut(&change.key) else {
            return;
        };
        let s = &mut entry.status;
        if s.state == McpServerState::Unavailable {
            // Final: a late report of a life that ended cannot revive it.
            return;
        }
        if change.state == McpServerState::Restarting {
            s.restarts += 1;
        }
        s.state = change.state;
        if change.reason.is_some() {
            s.reason = change.reason;
        }
        if change.last_error.is_some() {
            s.last_error = change.last_error;
        }
        let phase = self.phase;
        if !self.stopping {
            self.status(phase, None);
        }
        if self.ready_due {
            self.send_ready(myself);
        }
    }

    /// `mcp.*` the router could not hand to a live server actor.
    fn mcp_refused(&self, request: McpRequest, reply: Option<Responder>) {
        let key = request.server_key().to_owned();
        // The reason of an unavailable server is why it is unavailable.
        let (reason, message, retryable) = match self.mcp.get(&key).map(|e| &e.status) {
            None => (
                "unknown_server".to_owned(),
                format!("no MCP server {key:?} in this session"),
                false,
            ),
            Some(s) if s.state == McpServerState::Unavailable => {
                let why = s.reason.as_deref().unwrap_or("unavailable");
                (
                    why.to_owned(),
                    format!("MCP server {key:?} is unavailable ({why})"),
                    false,
                )
            }
            Some(_) => (
                "restarting".to_owned(),
                format!("MCP server {key:?} is restarting"),
                true,
            ),
        };
        match (request, reply) {
            (McpRequest::McpClose(_), Some(r)) if self.mcp.contains_key(&key) => {
                if let Some(e) = self.mcp.get(&key) {
                    e.open.store(false, std::sync::atomic::Ordering::Relaxed);
                }
                r.ok(&crate::wire::types::McpCloseResult { closed: true });
            }
            (McpRequest::McpFrame(p), reply) => {
                if let Some(r) = reply {
                    r.ok(&Accepted::YES);
                }
                // A request gets its MCP error back over the channel.
                if let Ok(crate::mcp::Kind::Request { id, .. }) =
                    crate::mcp::message::parse(&p.payload).map(|e| e.kind)
                {
                    if let Some(link) = self.shared.link() {
                        let _ = link.notify(
                            Method::McpFrame,
                            &crate::wire::types::McpFrameParams {
                                session_id: self.id.clone(),
                                server_key: key,
                                payload: crate::mcp::message::error_response(
                                    &id,
                                    crate::mcp::message::code::INTERNAL_ERROR,
                                    &message,
                                    &reason,
                                ),
                            },
                        );
                    }
                }
            }
            (_, Some(r)) => {
                r.err(super::mcp::unavailable(&reason, &message).with_retryable(retryable))
            }
            (_, None) => {}
        }
    }

    /// Drop this session's processes from the router's direct map.
    fn forget_processes(&self) {
        for id in self.processes.keys() {
            self.shared
                .processes
                .remove(&crate::executor::runtime::process_key(&self.id, id));
        }
    }

    fn live_processes(&self) -> usize {
        self.processes
            .values()
            .filter(|p| p.state == ProcState::Running)
            .count()
    }

    fn process(&self, id: &str) -> Result<&ActorRef<ProcessMsg>, RpcError> {
        self.processes
            .get(id)
            .map(|p| &p.actor)
            .ok_or_else(|| RpcError::not_found(format!("no process {id:?}")))
    }
}

impl Session {
    /// What the supervisor rules decided about a child's exit.
    fn decided(&self, myself: &ActorRef<SessionMsg>, state: &mut SessionState, decision: Decision) {
        match decision {
            Decision::Restart {
                exit,
                delay,
                generation,
            } if !state.stopping => {
                if let Some(SessionChild::Mcp(key)) = SessionChild::parse(&exit.id) {
                    let why = match &exit.exit {
                        Exit::Abnormal(w) => Some(w.clone()),
                        _ => None,
                    };
                    state.mcp_changed(
                        myself,
                        McpChange {
                            key,
                            state: McpServerState::Restarting,
                            reason: None,
                            last_error: why,
                        },
                    );
                }
                let id = exit.id;
                myself.send_after(delay, move || SessionMsg::RestartChild { id, generation });
            }
            Decision::Restart { exit, .. } | Decision::Gone(exit) | Decision::Meltdown(exit) => {
                if !state.stopping {
                    state.child_exited(myself, exit)
                }
            }
        }
    }

    /// The agent actor to run a turn on, started (or replaced) as needed.
    async fn agent_for(
        &self,
        myself: &ActorRef<SessionMsg>,
        state: &mut SessionState,
        name: &str,
    ) -> Result<ActorRef<AgentMsg>, RpcError> {
        let id = SessionChild::Agent.id();
        let live = state
            .children
            .which()
            .into_iter()
            .find(|(c, _)| *c == id)
            .map(|(_, cell)| cell);
        match live {
            Some(Some(cell)) if state.agent.as_deref() == Some(name) => return Ok(cell.into()),
            // Another agent, or one between two lives: a fresh one.
            Some(_) => {
                state.children.terminate(&id).await;
            }
            None => {}
        }
        let Some((_, argv)) = state.shared.config.agents.iter().find(|(n, _)| n == name) else {
            return Err(RpcError::invalid_params(format!("no agent {name:?}")));
        };
        let args = AgentArgs {
            shared: state.shared.clone(),
            session_id: state.id.clone(),
            name: name.to_owned(),
            argv: argv.clone(),
            workspace: state.workspace.clone(),
            scope: format!("{}agent:/", state.scope),
            sandbox: state.sandbox.clone(),
        };
        let spec = ChildSpec::restartable(id, Restart::Transient, Agent, args)
            .budget(state.shared.config.agent_restart_budget);
        match state.children.start(spec, myself.get_cell()).await {
            Ok(cell) => {
                // A new process resumes the old ACP session by id
                // (`session/load`) if the agent can: see the turn's `resume`.
                state.agent = Some(name.to_owned());
                Ok(cell.into())
            }
            Err(e) => Err(RpcError::internal(format!("agent {name:?}: {e}"))),
        }
    }

    async fn turn_request(
        &self,
        myself: &ActorRef<SessionMsg>,
        state: &mut SessionState,
        request: TurnRequest,
        reply: Responder,
    ) {
        match request {
            TurnRequest::TurnStart(p) => {
                if state.turns.contains_key(&p.turn_id) {
                    // Idempotent by turnId.
                    return reply.ok(&TurnStartResult {
                        accepted: true,
                        turn_id: p.turn_id,
                        effective: serde_json::json!({"agent": state.agent}),
                        executor_session_ref: state.acp_session.clone(),
                        resumed: false,
                    });
                }
                if let Some((running, _)) = &state.turn {
                    return reply.err(RpcError::conflict(
                        "turn_running",
                        format!("turn {running:?} is running"),
                    ));
                }
                let prompt = match super::turn::input_text(&p.input) {
                    Ok(t) => t,
                    Err(e) => return reply.err(e),
                };
                let config = p.config.clone().unwrap_or_default();
                let name = match config.agent.clone() {
                    Some(n) => n,
                    None => match state.shared.config.agents.first() {
                        Some((n, _)) => n.clone(),
                        None => return reply.err(RpcError::capability_unavailable("agent")),
                    },
                };
                let agent = match self.agent_for(myself, state, &name).await {
                    Ok(a) => a,
                    Err(e) => return reply.err(e),
                };
                let resume = p.executor_session_ref.clone().or(state.acp_session.clone());
                let args = TurnArgs {
                    shared: state.shared.clone(),
                    session: myself.clone(),
                    session_id: state.id.clone(),
                    turn_id: p.turn_id.clone(),
                    agent,
                    agent_name: name,
                    prompt,
                    resume,
                    reply: Some(reply),
                    always: state.always.clone(),
                };
                let child =
                    ChildSpec::temporary(SessionChild::Turn(p.turn_id.clone()).id(), Turn, args);
                match state.children.start(child, myself.get_cell()).await {
                    Ok(cell) => {
                        state.turn = Some((p.turn_id.clone(), cell.into()));
                        state.turns.insert(p.turn_id.clone(), false);
                        state.turn_order.push_back(p.turn_id);
                        while state.turn_order.len() > TURNS_KEPT {
                            if let Some(old) = state.turn_order.pop_front() {
                                state.turns.remove(&old);
                            }
                        }
                    }
                    Err(e) => {
                        tracing::error!(session = %state.id, error = %e, "turn actor did not start")
                    }
                }
            }
            TurnRequest::TurnInput(p) => match (&state.turn, state.turns.get(&p.turn_id)) {
                (Some((t, actor)), _) if *t == p.turn_id => {
                    match super::turn::input_text(&p.input) {
                        Ok(text) => {
                            let _ = actor.send_message(TurnMsg::Input(text, reply));
                        }
                        Err(e) => reply.err(e),
                    }
                }
                (_, Some(_)) => reply.err(RpcError::conflict("turn_finished", "the turn is over")),
                _ => reply.err(RpcError::not_found(format!("no turn {:?}", p.turn_id))),
            },
            TurnRequest::TurnCancel(p) => match (&state.turn, state.turns.get(&p.turn_id)) {
                (Some((t, actor)), _) if *t == p.turn_id => {
                    let _ = actor.send_message(TurnMsg::Cancel(reply));
                }
                (_, Some(_)) => reply.ok(&TurnCancelResult { canceled: false }),
                _ => reply.err(RpcError::not_found(format!("no turn {:?}", p.turn_id))),
            },
            TurnRequest::InteractionResponse(p) => match &state.turn {
                Some((_, actor)) => {
                    let _ = actor.send_message(TurnMsg::Response(p, reply));
                }
                None => reply.err(RpcError::not_found(format!(
                    "no open interaction {:?}",
                    p.interaction_id
                ))),
            },
        }
    }

    /// Bind the loopback endpoint of a `service` server: `ready` once bound
    /// (the service itself is the platform's; the harness answers for it).
    async fn start_service(
        &self,
        myself: &ActorRef<SessionMsg>,
        state: &mut SessionState,
        key: String,
    ) {
        let max = state.shared.max_mcp_message();
        let change = match crate::executor::mcp::service::Tunnel::start(
            state.shared.clone(),
            &state.id,
            &key,
            max,
        )
        .await
        {
            Ok(t) => {
                state.shared.mcp_tunnels.insert(
                    crate::executor::runtime::process_key(&state.id, &key),
                    t.clone(),
                );
                state.services.insert(key.clone(), t);
                McpChange {
                    key,
                    state: McpServerState::Ready,
                    reason: None,
                    last_error: None,
                }
            }
            Err(e) => McpChange {
                key,
                state: McpServerState::Unavailable,
                reason: Some("bind_failed".into()),
                last_error: Some(e.to_string()),
            },
        };
        state.mcp_changed(myself, change);
    }

    /// Start each `environment` server as a `transient` child with its
    /// restart budget. A spec that cannot run is `unavailable` at once.
    async fn start_mcp_servers(&self, myself: &ActorRef<SessionMsg>, state: &mut SessionState) {
        let specs = std::mem::take(&mut state.specs);
        for spec in specs {
            let key = spec.server_key.clone();
            if !matches!(state.mcp.get(&key), Some(e) if e.status.state == McpServerState::Starting)
            {
                continue;
            }
            if spec.connection_origin == ConnectionOrigin::Service {
                self.start_service(myself, state, key).await;
                continue;
            }
            let scope = mcp_scope(&state.scope, &key);
            let (shared, workspace, scope2, spec2, sandbox) = (
                state.shared.clone(),
                state.workspace.clone(),
                scope.clone(),
                spec.clone(),
                state.sandbox.clone(),
            );
            let prepared = tokio::task::spawn_blocking(move || {
                launch::prepare(&shared, &workspace, &scope2, &spec2, &sandbox)
            })
            .await
            .unwrap_or_else(|e| {
                Err(launch::Refused {
                    reason: "spawn_failed",
                    message: e.to_string(),
                })
            });
            let launch = match prepared {
                Ok(l) => l,
                Err(refused) => {
                    tracing::warn!(session = %state.id, server = %key, reason = refused.reason, error = %refused.message, "mcp server not started");
                    state.mcp_changed(
                        myself,
                        McpChange {
                            key,
                            state: McpServerState::Unavailable,
                            reason: Some(refused.reason.into()),
                            last_error: Some(refused.message),
                        },
                    );
                    continue;
                }
            };
            let secrets: Vec<String> = spec
                .transport
                .secret_env
                .as_ref()
                .map(|m| m.values().cloned().collect())
                .unwrap_or_default();
            let open = match state.mcp.get(&key) {
                Some(e) => e.open.clone(),
                None => continue,
            };
            let budget = spec
                .restart_budget
                .map(|b| crate::supervisor::Intensity {
                    max_restarts: b.max_restarts.min(100),
                    period: Duration::from_millis(b.window_ms.clamp(1, 86_400_000)),
                })
                .unwrap_or(state.shared.config.mcp_restart_budget);
            let args = McpArgs {
                shared: state.shared.clone(),
                session: myself.clone(),
                session_id: state.id.clone(),
                key: key.clone(),
                launch: Arc::new(launch),
                scope,
                sandbox: state.sandbox.clone(),
                secrets: Arc::new(secrets),
                starts: Arc::new(std::sync::atomic::AtomicU32::new(0)),
                open,
                init_timeout: state.shared.config.init_timeout,
                max_message: state.shared.max_mcp_message(),
            };
            let child = ChildSpec::restartable(
                SessionChild::Mcp(key.clone()).id(),
                Restart::Transient,
                McpServer,
                args,
            )
            .budget(budget);
            if let Err(e) = state.children.start(child, myself.get_cell()).await {
                let e = e.to_string();
                tracing::warn!(session = %state.id, server = %key, error = %e, "mcp server not started");
                state.mcp_changed(
                    myself,
                    McpChange {
                        key,
                        state: McpServerState::Unavailable,
                        reason: Some("spawn_failed".into()),
                        last_error: Some(e),
                    },
                );
            }
        }
    }

    async fn start_process(
        &self,
        myself: &ActorRef<SessionMsg>,
        state: &mut SessionState,
        spec: ProcessStartParams,
        reply: Responder,
    ) {
        let wait_ms = spec.wait_ms;
        if let Some(existing) = state.processes.get(&spec.process_id) {
            if same_spec(&existing.spec, &spec) {
                let _ = existing
                    .actor
                    .send_message(ProcessMsg::Started { reply, wait_ms });
            } else {
                reply.err(RpcError::conflict(
                    "process_id_spec_mismatch",
                    format!("process {:?} exists with another spec", spec.process_id),
                ));
            }
            return;
        }
        let max = state
            .shared
            .limits()
            .max_processes_per_session
            .unwrap_or(state.shared.config.max_processes_per_session)
            .min(state.shared.config.max_processes_per_session) as usize;
        if state.live_processes() >= max {
            return reply.err(RpcError::resource_unavailable(format!(
                "maxProcesses ({max}) live processes in this session"
            )));
        }
        // `packageInstall`: the executor's argv (`executor::packages`), in
        // what runs; the spec kept for idempotent retries stays as sent.
        let mut run = spec.clone();
        if let Some(install) = &spec.package_install {
            match crate::executor::packages::prepare(&state.workspace, &spec, install) {
                Ok(r) => run = r,
                Err(e) => return reply.err(e),
            }
        }
        // `fileTransfer`: the executor runs the transfer itself
        // (`executor::file_transfer`), so there is no argv.
        if let Some(ft) = &spec.file_transfer {
            if !crate::executor::file_transfer::ENABLED {
                return reply.err(RpcError::capability_unavailable("process.fileTransfer"));
            }
            if let Err(e) = crate::executor::file_transfer::check(&spec, ft) {
                return reply.err(e);
            }
        } else if run.argv.is_empty() {
            return reply.err(RpcError::invalid_params("argv must not be empty"));
        }
        if spec.git_credentials && state.shared.config.git_credentials.is_none() {
            return reply.err(RpcError::capability_unavailable("process.gitCredentials"));
        }
        // Refuse what may never run before anything starts: a cwd outside
        // the workspace, a denied environment variable.
        if let Err(e) = super::process::check_spec(&state.shared, &state.workspace, &run) {
            return reply.err(e);
        }
        // The `service` servers' endpoints, unless the spec sets them (in
        // what runs, not in the spec kept for idempotent retries).
        if !state.services.is_empty() {
            let env = run.env.get_or_insert_with(Default::default);
            for (key, t) in &state.services {
                env.entry(crate::executor::mcp::service::env_name(key))
                    .or_insert_with(|| t.url().to_owned());
            }
        }
        let args = ProcessArgs {
            shared: state.shared.clone(),
            session: myself.clone(),
            session_id: state.id.clone(),
            workspace: state.workspace.clone(),
            scope: process_scope(&state.scope, &spec.process_id),
            sandbox: state.sandbox.clone(),
            spec: run,
            read_slots: state.read_slots.clone(),
        };
        let child = SessionChild::Process(spec.process_id.clone()).id();
        match state
            .children
            .start(
                ChildSpec::temporary(child, ProcessActor, args),
                myself.get_cell(),
            )
            .await
        {
            Ok(cell) => {
                let actor: ActorRef<ProcessMsg> = cell.into();
                let _ = actor.send_message(ProcessMsg::Started { reply, wait_ms });
                state.shared.processes.insert(
                    crate::executor::runtime::process_key(&state.id, &spec.process_id),
                    actor.clone(),
                );
                state.processes.insert(
                    spec.process_id.clone(),
                    ProcEntry {
                        actor,
                        spec,
                        state: ProcState::Running,
                        pid: None,
                    },
                );
            }
            Err(e) => reply.err(RpcError::internal(format!("process actor: {e}"))),
        }
    }

    async fn tool_call(
        &self,
        myself: &ActorRef<SessionMsg>,
        state: &mut SessionState,
        p: ToolCallParams,
        reply: Responder,
    ) {
        if let Some(existing) = state.tools.get(&p.tool_call_id) {
            // At most once: answer, and re-send the result if there is one.
            if let ToolCall::Done(result) = existing {
                let result = (**result).clone();
                state.deliver_result(myself, result);
            }
            return reply.ok(&Accepted::YES);
        }
        if let Err(e) = crate::executor::confirm::effective_mode(
            p.permission.as_ref(),
            state.shared.config.confirm_always,
        ) {
            return reply.err(RpcError::invalid_params(e.to_string()));
        }
        let computer = matches!(p.tool.as_str(), "computer_observe" | "computer_action");
        if p.tool.starts_with("computer_") && (!computer || !super::display::xvfb_available()) {
            return reply.err(RpcError::capability_unavailable("computer"));
        }
        if !computer && state.shared.tools.get(&p.tool).is_none() {
            return reply.err(RpcError::invalid_params(format!(
                "unknown tool {:?}",
                p.tool
            )));
        }
        let id = p.tool_call_id.clone();
        let display = if computer {
            self.ensure_display(myself, state).await
        } else {
            state.display.clone()
        };
        let args = ToolArgs {
            shared: state.shared.clone(),
            session: myself.clone(),
            workspace: state.workspace.clone(),
            sandbox: state.sandbox.clone(),
            params: p,
            display,
        };
        let child = SessionChild::Tool(id.clone()).id();
        match state
            .children
            .start(
                ChildSpec::temporary(child, ToolActor, args),
                myself.get_cell(),
            )
            .await
        {
            Ok(cell) => {
                state.tools.insert(id, ToolCall::Running(cell.into()));
                reply.ok(&Accepted::YES);
            }
            Err(e) => reply.err(RpcError::internal(format!("tool actor: {e}"))),
        }
    }

    /// The session's display, started on first use (`None`: it cannot
    /// start; the call then fails with `display_error`).
    async fn ensure_display(
        &self,
        myself: &ActorRef<SessionMsg>,
        state: &mut SessionState,
    ) -> Option<DisplayHandle> {
        if let Some(h) = &state.display {
            if h.actor.get_status() == ractor::ActorStatus::Running {
                return Some(h.clone());
            }
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let args = DisplayArgs {
            scope: format!("{}display:/", state.scope),
            // Xvfb and x11vnc are the executor's, not the session's code:
            // outside its sandbox, tagged so that the session's sweeps
            // find them.
            env: state.shared.config.child_env(),
        };
        let started = state
            .children
            .start(
                ChildSpec::temporary("display".to_owned(), Display, (args, tx)),
                myself.get_cell(),
            )
            .await;
        match started {
            Ok(cell) => {
                let name = rx.await.ok()?;
                let h = DisplayHandle {
                    actor: cell.into(),
                    name,
                };
                state.display = Some(h.clone());
                Some(h)
            }
            Err(e) => {
                tracing::error!(session = %state.id, error = %e, "cannot start the display");
                None
            }
        }
    }

    async fn stop(
        &self,
        myself: &ActorRef<SessionMsg>,
        state: &mut SessionState,
        reason: String,
        deadline: Duration,
        keep_workspace: bool,
        reply: Option<Responder>,
    ) {
        if state.stopping {
            if let Some(r) = reply {
                r.ok(&StopResult { stopped: true });
            }
            return;
        }
        state.stopping = true;
        tracing::info!(session = %state.id, %reason, "stopping session");
        state.status(SessionStatus::Stopping, Some(reason.clone()));
        for t in state.tools.values() {
            if let ToolCall::Running(t) = t {
                let _ = t.send_message(ToolMsg::Cancel("session_stopped".into()));
            }
        }
        // MCP servers first, in their own orderly way (their in-flight
        // requests are answered), before the session's scope is killed.
        let keys: Vec<String> = state.mcp.keys().cloned().collect();
        let stops = keys.iter().map(|k| SessionChild::Mcp(k.clone()).id());
        for id in stops {
            state.children.terminate(&id).await;
        }
        // SIGTERM every live group, give them until the deadline.
        let mut waits = Vec::new();
        for p in state.processes.values() {
            if p.state == ProcState::Running {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let _ = p.actor.send_message(ProcessMsg::Terminate {
                    grace: deadline,
                    reason: reason.clone(),
                    reply: None,
                    done: Some(tx),
                });
                waits.push(rx);
            }
        }
        let until = Instant::now() + deadline + Duration::from_millis(500);
        for w in waits {
            let _ = tokio::time::timeout_at(until.into(), w).await;
        }
        // Whatever escaped its group dies now: everything in the session's
        // cgroup (or, without one, everything carrying its tag).
        let (scope, sandbox) = (state.scope.clone(), state.sandbox.clone());
        let _ = tokio::task::spawn_blocking(move || kill_session(&sandbox, &scope)).await;
        state.forget_processes();
        state.children.stop_all().await;
        let (sandbox, private) = (state.sandbox.clone(), state.private.clone());
        let _ = tokio::task::spawn_blocking(move || sandbox.end(&private)).await;
        if !keep_workspace && state.shared.config.workspace.is_none() {
            if let Err(e) = remove_workspace(&state.shared.config.work_root, &state.id).await {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(error = %e, "cannot remove the workspace");
                }
            }
        }
        state.status(SessionStatus::Stopped, Some(reason.clone()));
        if let Some(r) = reply {
            r.ok(&StopResult { stopped: true });
        }
        if !state.results.outbox().is_empty() {
            let undelivered: Vec<&String> = state.results.outbox().keys().collect();
            tracing::error!(session = %state.id, ?undelivered, "tool.result never acknowledged; giving up as the session ends");
        }
        // The session is over: the harness takes none of its frames now.
        state.results.journal_forget_session(&state.id);
        state.events.journal_forget_session(&state.id);
        // The sessions actor learns why before it sees the exit.
        if let Some(sessions) = state.shared.sessions_actor() {
            let _ = sessions.send_message(SessionsMsg::Ending {
                session_id: state.id.clone(),
                reason,
            });
        }
        myself.stop(None);
    }
}

impl Actor for Session {
    type Msg = SessionMsg;
    type State = SessionState;
    type Arguments = SessionArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<SessionMsg>,
        args: SessionArgs,
    ) -> Result<SessionState, ActorProcessingErr> {
        let p = args.params;
        let workspace = match &args.shared.config.workspace {
            // Bound: the one workspace, shared by every session, never removed.
            Some(ws) => ws.clone(),
            None => {
                let root = args.shared.config.work_root.clone();
                let id = p.session_id.clone();
                tokio::task::spawn_blocking(move || {
                    crate::executor::workroot::make_session_dir(&root, "sessions", &id)
                })
                .await??
            }
        };
        let workspace = tokio::fs::canonicalize(&workspace).await?;
        let private = {
            let root = args.shared.config.work_root.clone();
            let id = p.session_id.clone();
            tokio::task::spawn_blocking(move || {
                crate::executor::workroot::make_session_dir(
                    &root,
                    "private",
                    &crate::sandbox::session_name(&id),
                )
            })
            .await??
        };
        let sandbox = {
            let (shared, id, ws, private, bounds) = (
                args.shared.clone(),
                p.session_id.clone(),
                workspace.clone(),
                private.clone(),
                args.bounds,
            );
            tokio::task::spawn_blocking(move || {
                shared
                    .sandboxes
                    .make(&crate::sandbox::session_name(&id), &ws, &private, &bounds)
            })
            .await?
        };
        let sandbox = match sandbox {
            Ok(s) => Arc::new(s),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&private);
                return Err(e.into());
            }
        };
        let reads = args.shared.limits().concurrent_process_reads() as usize;
        let children = Children::new("session", None, None);
        let connected = args.shared.link().is_some();
        let mut mcp = BTreeMap::new();
        for spec in &p.mcp_servers {
            let (state, reason) = if mcp.contains_key(&spec.server_key) {
                continue;
            } else if !launch::valid_key(&spec.server_key) {
                (McpServerState::Unavailable, Some("invalid_spec"))
            } else if mcp.len() >= args.shared.config.mcp_max_servers as usize {
                (McpServerState::Unavailable, Some("max_servers"))
            } else {
                (McpServerState::Starting, None)
            };
            mcp.insert(
                spec.server_key.clone(),
                McpEntry {
                    status: McpServerStatus {
                        server_key: spec.server_key.clone(),
                        state,
                        restarts: 0,
                        reason: reason.map(str::to_owned),
                        last_error: None,
                    },
                    open: Arc::new(std::sync::atomic::AtomicBool::new(false)),
                },
            );
        }
        let journal = args.shared.journal.clone();
        let (sid_r, sid_e) = (p.session_id.clone(), p.session_id.clone());
        let mut state = SessionState {
            scope: session_scope(&args.shared.instance, &p.session_id),
            sandbox,
            private,
            shared: args.shared,
            id: p.session_id,
            work_id: p.work_id,
            lease_token: p.lease.token,
            workspace,
            processes: HashMap::new(),
            tools: HashMap::new(),
            children,
            results: Delivery::new(Method::ToolResult, false, TOOL_RESULTS_MAX, connected)
                .journaled(journal.clone(), move |k: &String| {
                    (sid_r.clone(), k.clone())
                }),
            ready: Delivery::new(Method::SessionReady, false, 1, connected),
            read_slots: Arc::new(Semaphore::new(reads)),
            stopping: false,
            mcp,
            phase: SessionStatus::Starting,
            ready_due: false,
            specs: p.mcp_servers,
            services: BTreeMap::new(),
            agent: None,
            turn: None,
            turns: HashMap::new(),
            turn_order: std::collections::VecDeque::new(),
            acp_session: None,
            always: Default::default(),
            events: Delivery::new(Method::SessionEvent, false, EVENTS_MAX, connected)
                .journaled(journal, move |s: &u64| {
                    (sid_e.clone(), crate::executor::journal::sequence_key(*s))
                }),
            next_sequence: 1,
            display: None,
            restore: match p.restore {
                Some(src) => Restore::Due(src),
                None => Restore::Done,
            },
        };
        state.status(SessionStatus::Starting, None);
        Ok(state)
    }

    async fn post_start(
        &self,
        myself: ActorRef<SessionMsg>,
        state: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        if let Restore::Due(src) = std::mem::replace(&mut state.restore, Restore::Done) {
            // The backup goes into the workspace first: the MCP servers
            // and `session.ready` wait for it (docs/protocol.md, "Restore").
            let (me, ws) = (myself.clone(), state.workspace.clone());
            let task = tokio::spawn(async move {
                let r = crate::executor::restore::run(&ws, &src).await;
                let _ = me.send_message(SessionMsg::Restored(r));
            });
            state.restore = Restore::Running(task.abort_handle());
            return Ok(());
        }
        self.start_mcp_servers(&myself, state).await;
        // Ready now, or once every MCP server is ready or failed.
        state.send_ready(&myself);
        state.status(SessionStatus::Running, None);
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SessionMsg>,
        state: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        state.forget_processes();
        if let Restore::Running(task) = &state.restore {
            task.abort();
        }
        for (key, t) in std::mem::take(&mut state.services) {
            t.stop();
            state
                .shared
                .mcp_tunnels
                .remove(&crate::executor::runtime::process_key(&state.id, &key));
        }
        if !state.stopping {
            // Stopped from outside (executor shutdown): no orphans, no leftovers.
            for p in state.processes.values() {
                let _ = p.actor.send_message(ProcessMsg::Kill("shutdown".into()));
            }
            // MCP servers and the agent go their orderly way first (their
            // in-flight requests answered), then whatever is left dies.
            state.children.stop_all().await;
            let (scope, sandbox, private) = (
                state.scope.clone(),
                state.sandbox.clone(),
                state.private.clone(),
            );
            let _ = tokio::task::spawn_blocking(move || {
                kill_session(&sandbox, &scope);
                sandbox.end(&private);
            })
            .await;
            if state.shared.config.workspace.is_none() {
                let _ = remove_workspace(&state.shared.config.work_root, &state.id).await;
            }
        }
        state.children.stop_all().await;
        Ok(())
    }

    /// A process or tool actor ended. Its own supervisor's rules decide
    /// (all temporary: reported, never restarted); ractor's default would
    /// stop the whole session instead.
    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SessionMsg>,
        event: ractor::SupervisionEvent,
        state: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(decision) = state.children.on_event(&event) {
            self.decided(&myself, state, decision);
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<SessionMsg>,
        msg: SessionMsg,
        state: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SessionMsg::Request(req, reply) => {
                if state.stopping {
                    {
                        reply.err(RpcError::session_not_active(&state.id));
                        return Ok(());
                    }
                }
                self.request(&myself, state, req, reply).await;
            }
            SessionMsg::Renewed { lease_token } => {
                state.lease_token = lease_token;
                state.send_ready(&myself);
            }
            SessionMsg::Stop {
                reason,
                deadline,
                keep_workspace,
                reply,
            } => {
                self.stop(&myself, state, reason, deadline, keep_workspace, reply)
                    .await
            }
            SessionMsg::ProcessChanged(ps) => {
                if let Some(p) = state.processes.get_mut(&ps.process_id) {
                    p.state = ps.state;
                    p.pid = p.pid.or(ps.pid);
                }
            }
            SessionMsg::Reconnected => {
                state.ready.connected();
                state.ready.pump(&state.shared, &myself, SessionMsg::Ready);
                state.results.connected();
                state
                    .results
                    .pump(&state.shared, &myself, SessionMsg::ToolResults);
                state.events.connected();
                state
                    .events
                    .pump(&state.shared, &myself, SessionMsg::Events);
            }
            SessionMsg::Disconnected => {
                state.ready.disconnected();
                state.results.disconnected();
                state.events.disconnected();
                if let Some((_, t)) = &state.turn {
                    let _ = t.send_message(TurnMsg::Connected(false));
                }
                for e in state.mcp.values() {
                    e.open.store(false, std::sync::atomic::Ordering::Relaxed);
                }
            }
            SessionMsg::McpChanged(change) => state.mcp_changed(&myself, change),
            SessionMsg::Turn(request, reply) => {
                if state.stopping {
                    reply.err(RpcError::session_not_active(&state.id));
                } else {
                    self.turn_request(&myself, state, request, reply).await;
                }
            }
            SessionMsg::Emit { turn_id, emits } => state.emit(&myself, &turn_id, emits),
            SessionMsg::AcpSession(id) => state.acp_session = Some(id),
            SessionMsg::Restored(r) => {
                if !matches!(state.restore, Restore::Running(_)) || state.stopping {
                    return Ok(());
                }
                match r {
                    Ok(entries) => {
                        tracing::info!(session = %state.id, entries, "workspace restored");
                        state.restore = Restore::Done;
                        self.start_mcp_servers(&myself, state).await;
                        state.send_ready(&myself);
                        state.status(SessionStatus::Running, None);
                    }
                    Err(e) => {
                        tracing::warn!(session = %state.id, code = e.code, error = %e.message, "restore failed");
                        state.restore = Restore::Failed;
                        state.status(
                            SessionStatus::Error,
                            Some(format!("restore_failed: {}: {}", e.code, e.message)),
                        );
                    }
                }
            }
            SessionMsg::Events(event) => {
                let expected = match &event {
                    OutboxEvent::Expected(_, e) => Some(e.to_owned()),
                    _ => None,
                };
                state
                    .events
                    .on_event(event, &state.shared, &myself, SessionMsg::Events);
                if let Some(e) = expected {
                    // The harness has everything below `e`: resend from it.
                    state.events.ack_where(|s| *s < e);
                    state.events.resend_where(|s| *s >= e);
                    state
                        .events
                        .pump(&state.shared, &myself, SessionMsg::Events);
                }
            }
            SessionMsg::Mcp(request, reply) => state.mcp_refused(request, reply),
            SessionMsg::RestartChild { id, generation } => {
                if state.stopping {
                    return Ok(());
                }
                let Some(start) = state.children.restart_fn(&id, generation) else {
                    return Ok(());
                };
                match start(myself.get_cell()).await {
                    Ok(cell) => {
                        if !state.children.restarted(&id, generation, &cell) {
                            cell.stop(Some(crate::supervisor::SHUTDOWN.into()));
                        }
                    }
                    Err(e) => {
                        let decision = state.children.exited(id, Exit::Abnormal(e));
                        self.decided(&myself, state, decision);
                    }
                }
            }
            SessionMsg::ToolDone(result) => state.deliver_result(&myself, *result),
            SessionMsg::ToolResults(event) => {
                state
                    .results
                    .on_event(event, &state.shared, &myself, SessionMsg::ToolResults)
            }
            SessionMsg::Ready(event) => {
                state
                    .ready
                    .on_event(event, &state.shared, &myself, SessionMsg::Ready)
            }
            SessionMsg::Panic(None) => panic!("injected panic (test hook)"),
            SessionMsg::Panic(Some(SessionChild::Process(id))) => {
                if let Some(p) = state.processes.get(&id) {
                    let _ = p.actor.send_message(ProcessMsg::Panic);
                }
            }
            SessionMsg::Panic(Some(SessionChild::Agent | SessionChild::Turn(_))) => {}
            SessionMsg::Panic(Some(SessionChild::Mcp(_))) => {
                // An MCP server is crashed from outside (kill -9) in tests.
            }
            SessionMsg::Panic(Some(SessionChild::Tool(id))) => {
                if let Some(ToolCall::Running(t)) = state.tools.get(&id) {
                    let _ = t.send_message(ToolMsg::Panic);
                }
            }
        }
        Ok(())
    }
}

impl Session {
    async fn request(
        &self,
        myself: &ActorRef<SessionMsg>,
        state: &mut SessionState,
        req: SessionRequest,
        reply: Responder,
    ) {
        let forward = |r: Result<&ActorRef<ProcessMsg>, RpcError>, msg: ProcessMsg| match r {
            Ok(actor) => {
                if let Err(ractor::MessagingErr::SendErr(m)) = actor.send_message(msg) {
                    m.fail(RpcError::internal("process actor stopped"));
                }
            }
            Err(e) => msg.fail(e),
        };
        match req {
            SessionRequest::SessionStop(p) => {
                let deadline = Duration::from_millis(p.deadline_ms.unwrap_or(5_000).min(600_000));
                self.stop(
                    myself,
                    state,
                    p.reason,
                    deadline,
                    p.keep_workspace,
                    Some(reply),
                )
                .await
            }
            SessionRequest::ProcessStart(p) => self.start_process(myself, state, p, reply).await,
            SessionRequest::Process(ProcessRequest::ProcessRead(p)) => {
                forward(state.process(&p.process_id), ProcessMsg::Read(p, reply))
            }
            SessionRequest::Process(ProcessRequest::ProcessWrite(p)) => {
                forward(state.process(&p.process_id), ProcessMsg::Write(p, reply))
            }
            SessionRequest::ProcessInterrupt(p) => {
                forward(state.process(&p.process_id), ProcessMsg::Interrupt(reply))
            }
            SessionRequest::ProcessTerminate(p) => forward(
                state.process(&p.process_id),
                ProcessMsg::Terminate {
                    grace: Duration::from_millis(p.grace_ms.unwrap_or(5_000).min(600_000)),
                    reason: "terminated".into(),
                    reply: Some(reply),
                    done: None,
                },
            ),
            SessionRequest::ProcessList(_) => {
                let actors: Vec<ActorRef<ProcessMsg>> =
                    state.processes.values().map(|p| p.actor.clone()).collect();
                tokio::spawn(async move {
                    let mut processes = Vec::with_capacity(actors.len());
                    for a in actors {
                        if let Ok(s) = ractor::call!(a, ProcessMsg::GetState) {
                            processes.push(s);
                        }
                    }
                    processes.sort_by(|a, b| a.process_id.cmp(&b.process_id));
                    reply.ok(&ProcessListResult { processes });
                });
            }
            SessionRequest::ToolCall(p) => self.tool_call(myself, state, p, reply).await,
            SessionRequest::SessionClose(_) => {
                // The agent session ends; the executor session stays.
                state.children.terminate(&SessionChild::Agent.id()).await;
                state.agent = None;
                state.acp_session = None;
                reply.ok(&crate::wire::types::SessionCloseResult { closed: true });
            }
            SessionRequest::SkillInstall(p) => {
                let workspace = state.workspace.clone();
                tokio::spawn(async move {
                    reply.ok(&crate::executor::skills::run(&workspace, p).await);
                });
            }
            SessionRequest::WorkspaceBackup(p) => {
                // Off the mailbox, like an upload (bounded by its deadline).
                let (workspace, id) = (state.workspace.clone(), state.id.clone());
                tokio::spawn(async move {
                    match crate::executor::backup::run(&workspace, &id, p).await {
                        Ok(r) => reply.ok(&r),
                        Err(e) => reply.err(e),
                    }
                });
            }
            SessionRequest::ArtifactUpload(p) => {
                // Off the session's mailbox: an upload takes as long as the
                // file does (bounded by its own deadline).
                let workspace = state.workspace.clone();
                tokio::spawn(async move {
                    match crate::executor::artifacts::upload(&workspace, p).await {
                        Ok(r) => reply.ok(&r),
                        Err(e) => reply.err(e),
                    }
                });
            }
            SessionRequest::DisplayRfb(p) => {
                // The display starts here if no computer call started it:
                // a person may want to watch before the agent acts.
                let Some(display) = self.ensure_display(myself, state).await else {
                    return reply.err(
                        RpcError::resource_unavailable("the session's display could not start")
                            .with_reason("display_error"),
                    );
                };
                let msg = super::display::DisplayMsg::Rfb {
                    host: p.host,
                    reply,
                };
                if let Err(ractor::MessagingErr::SendErr(super::display::DisplayMsg::Rfb {
                    reply,
                    ..
                })) = display.actor.send_message(msg)
                {
                    reply.err(
                        RpcError::resource_unavailable("the session's display is gone")
                            .with_reason("display_error"),
                    );
                }
            }
            SessionRequest::ToolCancel(p) => match state.tools.get(&p.tool_call_id) {
                Some(t) => {
                    if let ToolCall::Running(t) = t {
                        let _ = t.send_message(ToolMsg::Cancel(p.reason));
                    }
                    reply.ok(&ToolCancelResult { canceled: true });
                }
                None => reply.err(RpcError::not_found(format!(
                    "no tool call {:?}",
                    p.tool_call_id
                ))),
            },
        }
    }
}

/// Kill everything the session runs: its cgroup, or (no cgroup on this
/// host) every process carrying its tag. Blocking.
fn kill_session(sandbox: &crate::sandbox::Sandbox, scope: &str) {
    if sandbox.contained() {
        sandbox.kill();
    } else {
        crate::process::sys::kill_tree(None, None, scope);
    }
}

/// Remove a session's workspace beneath the work root (never through a
/// link planted in place of it: `executor::workroot`).
async fn remove_workspace(work_root: &std::path::Path, id: &str) -> std::io::Result<()> {
    let (root, id) = (work_root.to_path_buf(), id.to_owned());
    tokio::task::spawn_blocking(move || {
        crate::executor::workroot::remove_session_dir(&root, "sessions", &id)
    })
    .await
    .map_err(std::io::Error::other)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_names_never_escape() {
        assert_eq!(safe_name("abc-1_2.x"), "abc-1_2.x");
        for bad in ["..", ".", "", "a/b", "../../etc", &"x".repeat(65), "naïve"] {
            let n = safe_name(bad);
            assert!(n.starts_with("h-") && n.len() == 34, "{bad:?} -> {n}");
        }
        assert_ne!(safe_name("a/b"), safe_name("a/c"));
    }
}

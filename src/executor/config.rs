//! Executor configuration: what `bmx executor` parses and what an embedding
//! platform fills in.

use crate::process::env::{ChildEnv, EnvError};
use crate::supervisor::Backoff;
use crate::wire::{Endpoint, ErrorCode, RpcError, Subprotocol};
use std::path::PathBuf;
use std::time::Duration;

/// Where the executor's bearer token comes from.
#[derive(Clone)]
pub enum TokenSource {
    /// A fixed token (`--token`, `BMX_TOKEN`).
    Static(String),
    /// A file re-read on every (re)connect and after close 4010 (`--token-file`).
    File(PathBuf),
}

/// The token never prints (issue 18, finding 7): `Static(***)`.
impl std::fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSource::Static(_) => f.write_str("Static(***)"),
            TokenSource::File(p) => f.debug_tuple("File").field(p).finish(),
        }
    }
}

impl TokenSource {
    /// The current token.
    pub fn read(&self) -> std::io::Result<String> {
        match self {
            TokenSource::Static(t) => Ok(t.clone()),
            TokenSource::File(p) => Ok(std::fs::read_to_string(p)?.trim().to_owned()),
        }
    }
}

/// Everything the executor daemon needs.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    pub endpoint: Endpoint,
    pub token: TokenSource,
    /// `executor.name` in the register params.
    pub name: String,
    pub environment_id: Option<String>,
    /// Session workspaces live under `<work_root>/sessions/`.
    pub work_root: PathBuf,
    /// A bound executor (`--workspace DIR`, docs/runner.md): every session
    /// works in this one directory (canonical; never removed), and every
    /// working directory must resolve inside it. The caller holds the
    /// directory's lock (`runner::lock`) for as long as the executor runs.
    pub workspace: Option<PathBuf>,
    pub max_sessions: u32,
    /// `None`: reconnect forever.
    pub reconnect_max_attempts: Option<u32>,
    pub reconnect_backoff: Backoff,
    pub max_processes_per_session: u32,
    pub process_buffer_bytes: usize,
    /// Subprotocols offered, best first.
    pub subprotocols: Vec<Subprotocol>,
    /// Timeout of this side's requests (register, heartbeat, results).
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    /// Environment variable names no tool, process or terminal ever sees
    /// nor may set: `NAME`, or `PREFIX*` for every name that starts so.
    /// Every `BMX_*` variable of the executor's own environment is kept
    /// from children whatever this says (see `process::env`); the secrets
    /// listed by default are also refused when a caller tries to set them.
    pub deny_env: Vec<String>,
    /// The environment children start from; `None`: the executor's own,
    /// read at each start.
    pub base_env: Option<Vec<(String, String)>>,
    /// Inline limit of tool output.
    pub tool_inline_limit: usize,
    /// Disk bounds of every tool call (`--tool-max-file-size`,
    /// `--disk-reserve`; see `tools::disk`).
    pub tool_disk: crate::tools::disk::DiskLimits,
    /// Become the child subreaper and reap orphans (see
    /// `process::sys::become_subreaper`). The daemon turns this on; a host
    /// program that spawns children of its own must leave it off.
    pub subreaper: bool,
    /// Terminals open at once (`terminal.maxSessions`; -32015 past it).
    pub terminal_max_sessions: u32,
    /// Scrollback each terminal keeps for replay.
    pub terminal_scrollback_bytes: usize,
    /// Bytes a `terminal.output` stream may have sent and not had
    /// acknowledged (`ackSeq`) before it stops sending: a viewer that does
    /// not keep up falls behind into a gap instead of growing memory.
    pub terminal_window_bytes: usize,
    /// Between the SIGHUP of `terminal.close` and the SIGKILL of the tree.
    pub terminal_close_grace: Duration,
    /// MCP servers one session may run (`mcp.maxServers`).
    pub mcp_max_servers: u32,
    /// Time an MCP server or an ACP agent has to answer `initialize`, and
    /// a turn to get its agent session.
    pub init_timeout: Duration,
    /// Restart budget of an MCP server when `session.assign` names none.
    pub mcp_restart_budget: crate::supervisor::Intensity,
    /// Named ACP agents, `(name, argv)`; the first is the default. Empty:
    /// no agent turns (the capability is not advertised).
    pub agents: Vec<(String, Vec<String>)>,
    /// How long a permission question waits for a person before the agent
    /// is told no (`interaction.cancel {reason: expired}`).
    pub interaction_timeout: Duration,
    /// Restart budget of a session's agent process.
    pub agent_restart_budget: crate::supervisor::Intensity,
    /// The journal file (`executor::journal`): tool results, `session.ended`
    /// and session events not yet acknowledged survive the executor's death
    /// there. `None`: kept in memory only. The daemon uses
    /// `<work_root>/journal.db`; one executor per file.
    pub journal: Option<PathBuf>,
    /// `--confirm always`: every tool call waits for a person at this
    /// machine (`always_ask`), whatever its `permission` says.
    pub confirm_always: bool,
    /// How long an `always_ask` call waits for a person (never past the
    /// call's `deadlineMs`).
    pub confirm_timeout: Duration,
    /// The local confirmation socket; `None`:
    /// `<work_root>/confirm/confirm.sock` (`executor::confirm::socket_path`).
    pub confirm_socket: Option<PathBuf>,
    /// The git credentials the platform grants (`--git-credentials`, a
    /// 0600 JSON file read at every grant; `executor::git_credentials`).
    /// `None`: `process.gitCredentials` is not offered.
    pub git_credentials: Option<PathBuf>,
    /// The session sandbox (issue 48; `crate::sandbox`): on by default.
    pub sandbox: crate::sandbox::SandboxConfig,
}

impl ExecutorConfig {
    pub fn new(endpoint: Endpoint, token: TokenSource) -> Self {
        ExecutorConfig {
            endpoint,
            token,
            name: hostname(),
            environment_id: None,
            work_root: crate::executor::workroot::default_work_root(),
            workspace: None,
            max_sessions: 1024,
            reconnect_max_attempts: None,
            reconnect_backoff: Backoff::default(),
            max_processes_per_session: 64,
            process_buffer_bytes: 1 << 20,
            subprotocols: Subprotocol::ALL.to_vec(),
            request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            deny_env: DEFAULT_DENY_ENV.iter().map(|s| s.to_string()).collect(),
            base_env: None,
            tool_inline_limit: 64 * 1024,
            tool_disk: crate::tools::disk::DiskLimits::default(),
            subreaper: false,
            terminal_max_sessions: 32,
            terminal_scrollback_bytes: 1 << 20,
            terminal_window_bytes: 256 << 10,
            terminal_close_grace: Duration::from_secs(2),
            mcp_max_servers: 16,
            init_timeout: Duration::from_secs(30),
            mcp_restart_budget: crate::supervisor::Intensity {
                max_restarts: 3,
                period: Duration::from_secs(60),
            },
            agents: Vec::new(),
            interaction_timeout: Duration::from_secs(300),
            agent_restart_budget: crate::supervisor::Intensity {
                max_restarts: 3,
                period: Duration::from_secs(60),
            },
            journal: None,
            confirm_always: false,
            confirm_timeout: crate::executor::confirm::DEFAULT_TIMEOUT,
            confirm_socket: None,
            git_credentials: None,
            sandbox: crate::sandbox::SandboxConfig::default(),
        }
    }
}

/// Denied by default: the executor's and the harness's credentials.
pub const DEFAULT_DENY_ENV: &[&str] = &["BMX_TOKEN", "BMX_TOKEN_FILE", "BMX_API_TOKEN"];

impl ExecutorConfig {
    /// The environment policy of every child (processes, terminals, tools).
    pub fn child_env(&self) -> ChildEnv {
        match &self.base_env {
            Some(base) => ChildEnv::new(base.iter().cloned(), &self.deny_env),
            None => ChildEnv::from_process(&self.deny_env),
        }
    }
}

/// How the executor answers a request whose variables the policy refused:
/// -32003 `denied_env` for a name that is not the caller's to set, -32602
/// (`invalid_env`) for malformed or oversized variables.
pub fn env_refusal(e: &EnvError) -> RpcError {
    if e.is_denied() {
        RpcError::new(ErrorCode::Forbidden, e.to_string()).with_reason(e.reason())
    } else {
        RpcError::new(ErrorCode::InvalidParams, e.to_string()).with_reason(e.reason())
    }
}

/// This machine's host name, for `executor.name`.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "bmx-executor".into())
}

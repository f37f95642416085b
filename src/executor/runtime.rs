//! State one executor instance shares between its actors: the current
//! connection, the routing maps and the registration. It holds addresses and
//! facts, not business state: each actor owns its own.

use super::ExecutorConfig;
use crate::executor::actors::mcp::McpMsg;
use crate::executor::actors::process::ProcessMsg;
use crate::executor::actors::session::SessionMsg;
use crate::executor::actors::sessions::SessionsMsg;
use crate::executor::actors::terminals::TerminalsMsg;
use crate::wire::types::{
    AgentCapability, AgentInfo, Capabilities, FilesCapability, Limits, McpCapability,
    ProcessCapability, ShellCapability,
};
use crate::wire::Link;
use dashmap::DashMap;
use ractor::ActorRef;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tokio::sync::watch;

/// The key of a process in [`Shared::processes`].
pub fn process_key(session_id: &str, process_id: &str) -> String {
    format!("{session_id}\u{0}{process_id}")
}

/// What the last successful register established.
#[derive(Debug, Clone)]
pub struct Registration {
    pub executor_id: String,
    pub connection_id: String,
    pub heartbeat_interval_ms: u64,
    pub lease_ttl_ms: u64,
    pub limits: Limits,
    pub max_control_frame_bytes: u64,
    pub max_mcp_frame_bytes: u64,
}

pub struct Shared {
    pub config: ExecutorConfig,
    /// The tools `tool.call` can run: the built-ins plus any a platform registered.
    pub tools: Arc<crate::tools::ToolRegistry>,
    /// Tags this executor's processes (see `process::sys`), so a session's
    /// whole process tree can be found even after it left its group.
    pub instance: String,
    link: watch::Sender<Option<Link>>,
    registration: Mutex<Option<Registration>>,
    /// sessionId → session actor, for the router.
    pub sessions: DashMap<String, ActorRef<SessionMsg>>,
    /// `process_key(session, process)` → process actor: the hot requests
    /// (`process.read`, `process.write`) go straight to the process.
    pub processes: DashMap<String, ActorRef<ProcessMsg>>,
    /// sessionId → the highest fencing token of its grant. Written by the
    /// sessions supervisor only (the fence's owner: on assign, renewal and
    /// the session's end); read by the router, which refuses a
    /// session-scoped request carrying a lower `fencingToken` (-32009
    /// `stale_fencing_token`), and by the register's `resume`.
    pub fences: DashMap<String, u64>,
    /// `process_key(session, serverKey)` → MCP actor: `mcp.frame` goes
    /// straight to its server. Each actor puts itself in and takes itself
    /// out (a restart replaces the entry).
    pub mcp: DashMap<String, ActorRef<McpMsg>>,
    /// `process_key(session, serverKey)` → the loopback endpoint of a
    /// `service` server; its answers (`mcp.frame` from the harness) go
    /// straight to it. Written by the session (bound at its start, removed
    /// at its end).
    pub mcp_tunnels: DashMap<String, Arc<crate::executor::mcp::service::Tunnel>>,
    sessions_actor: RwLock<Option<ActorRef<SessionsMsg>>>,
    terminals_actor: RwLock<Option<ActorRef<TerminalsMsg>>>,
    /// The confirmation actor, while its socket is up (`None`: nobody can
    /// answer, `always_ask` calls fail at once).
    confirm_actor: RwLock<Option<ActorRef<crate::executor::actors::confirm::ConfirmMsg>>>,
    draining: AtomicBool,
    /// Counters of this executor (`--metrics-listen`).
    pub metrics: super::metrics::Metrics,
    /// What the executor owes the harness, on disk (`None`: memory only).
    pub journal: Option<Arc<super::journal::Journal>>,
    /// Cancelled when the executor is asked to stop: a connection still
    /// dialling or registering (an actor's `pre_start`, which a stop
    /// signal cannot interrupt) gives up at once instead of waiting out
    /// its request timeout.
    pub stopping: tokio_util::sync::CancellationToken,
    /// What confines each session (issue 48).
    pub sandboxes: Arc<crate::sandbox::Sandboxes>,
}

impl Shared {
    /// As [`Shared::new`], with the process tag prefix `instance` and a
    /// journal opened under it.
    pub fn with_journal(
        config: ExecutorConfig,
        tools: crate::tools::ToolRegistry,
        instance: String,
        journal: Option<Arc<super::journal::Journal>>,
        sandboxes: Arc<crate::sandbox::Sandboxes>,
    ) -> Arc<Self> {
        Arc::new(Shared {
            config,
            tools: Arc::new(tools),
            instance,
            link: watch::channel(None).0,
            registration: Mutex::new(None),
            sessions: DashMap::new(),
            fences: DashMap::new(),
            processes: DashMap::new(),
            mcp: DashMap::new(),
            mcp_tunnels: DashMap::new(),
            sessions_actor: RwLock::new(None),
            terminals_actor: RwLock::new(None),
            confirm_actor: RwLock::new(None),
            draining: AtomicBool::new(false),
            metrics: super::metrics::Metrics::new().with_journal(journal.as_deref()),
            journal,
            stopping: tokio_util::sync::CancellationToken::new(),
            sandboxes,
        })
    }

    /// What this executor advertises: only what it runs.
    pub fn capabilities(&self) -> Capabilities {
        Capabilities {
            process: Some(ProcessCapability {
                enabled: true,
                max_processes: Some(self.config.max_processes_per_session),
                buffer_bytes: Some(self.config.process_buffer_bytes as u64),
                pty: true,
                // Issue 15: built and tested (tests/executor/packages.rs,
                // tests/executor/git.rs).
                package_install: true,
                git_credentials: self.config.git_credentials.is_some(),
                // Issue 15: tests/harness/file_transfer.rs.
                file_transfer: crate::executor::file_transfer::ENABLED,
            }),
            files: Some(FilesCapability {
                enabled: true,
                ..Default::default()
            }),
            shell: Some(ShellCapability { enabled: true }),
            // Issue 20: computer use on an Xvfb display; RFB (`display.rfb`)
            // when x11vnc is there too.
            display: crate::executor::actors::display::xvfb_available().then(|| {
                crate::wire::types::DisplayCapability {
                    desktop: true,
                    rfb: crate::executor::actors::display::rfb_available(),
                }
            }),
            artifacts: crate::executor::artifacts::ENABLED.then_some(
                crate::wire::types::ArtifactsCapability {
                    upload: true,
                    max_bytes: Some(crate::executor::artifacts::MAX_BYTES),
                },
            ),
            workspace: crate::executor::artifacts::ENABLED.then_some(
                crate::wire::types::WorkspaceCapability {
                    backup: true,
                    // Issue 15: tests/harness/restore.rs.
                    restore: true,
                },
            ),
            skills: crate::executor::artifacts::ENABLED
                .then_some(crate::wire::types::SkillsCapability { install: true }),
            // What the executor's reader accepts (`LinkLimits::default`).
            sandbox: self.sandboxes.is_on().then(|| self.sandboxes.capability()),
            max_frame_bytes: Some(
                crate::wire::LinkLimits::default().max_control_frame_bytes as u64,
            ),
            terminal: crate::executor::actors::terminals::capability(self),
            tools: Some(self.tools_capability()),
            mcp: (self.config.mcp_max_servers > 0).then_some(McpCapability {
                stdio: true,
                http: true,
                max_servers: Some(self.config.mcp_max_servers),
                secret_env: true,
            }),
            agent: (!self.config.agents.is_empty()).then(|| AgentCapability {
                enabled: true,
                interaction_kinds: vec!["permission".into()],
                turn_resume: true,
                agents: self
                    .config
                    .agents
                    .iter()
                    .map(|(name, _)| AgentInfo { name: name.clone() })
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The live connection, if any.
    pub fn link(&self) -> Option<Link> {
        self.link.borrow().clone().filter(|l| !l.is_closed())
    }

    /// Watch the connection come and go (for senders that retry across
    /// reconnects).
    pub fn watch_link(&self) -> watch::Receiver<Option<Link>> {
        self.link.subscribe()
    }

    pub fn set_link(&self, link: Option<Link>) {
        self.link.send_replace(link);
    }

    pub fn registration(&self) -> Option<Registration> {
        self.registration.lock().ok()?.clone()
    }

    pub fn set_registration(&self, r: Registration) {
        // A restarted executor resumes from the last register it made.
        if let Some(j) = &self.journal {
            if let Err(e) = j.set_meta(&[
                ("executor_id", r.executor_id.as_str()),
                ("connection_id", r.connection_id.as_str()),
            ]) {
                tracing::warn!(error = %e, "journal: cannot record the registration");
            }
        }
        if let Ok(mut g) = self.registration.lock() {
            *g = Some(r);
        }
    }

    /// What the first register of this process resumes from: the
    /// previous run's registration, when its journal left sessions to
    /// deliver for.
    pub fn journal_resume(&self) -> Option<(String, String)> {
        let j = self.journal.as_ref()?;
        if j.recovering().is_empty() {
            return None;
        }
        let p = j.previous();
        Some((p.executor_id.clone()?, p.connection_id.clone()?))
    }

    /// The largest MCP message relayed in one `mcp.frame`: half the frame
    /// limit, because JSON escaping can double a payload (every `"` of the
    /// message becomes `\"` in the frame), less room for the envelope.
    pub fn max_mcp_message(&self) -> usize {
        let frame = self
            .registration()
            .map(|r| r.max_mcp_frame_bytes)
            .unwrap_or(crate::wire::types::RegisterResult::DEFAULT_MCP_FRAME_BYTES);
        ((frame / 2) as usize).saturating_sub(4096).max(4096)
    }

    pub fn limits(&self) -> Limits {
        self.registration().map(|r| r.limits).unwrap_or_default()
    }

    pub fn sessions_actor(&self) -> Option<ActorRef<SessionsMsg>> {
        self.sessions_actor.read().ok()?.clone()
    }

    pub fn set_sessions_actor(&self, a: Option<ActorRef<SessionsMsg>>) {
        if let Ok(mut g) = self.sessions_actor.write() {
            *g = a;
        }
    }

    pub fn terminals_actor(&self) -> Option<ActorRef<TerminalsMsg>> {
        self.terminals_actor.read().ok()?.clone()
    }

    pub fn set_terminals_actor(&self, a: Option<ActorRef<TerminalsMsg>>) {
        if let Ok(mut g) = self.terminals_actor.write() {
            *g = a;
        }
    }

    pub fn confirm_actor(&self) -> Option<ActorRef<crate::executor::actors::confirm::ConfirmMsg>> {
        self.confirm_actor.read().ok()?.clone()
    }

    pub fn set_confirm_actor(
        &self,
        a: Option<ActorRef<crate::executor::actors::confirm::ConfirmMsg>>,
    ) {
        if let Ok(mut g) = self.confirm_actor.write() {
            *g = a;
        }
    }

    /// `capabilities.tools` (a bmx extension): the permission modes a
    /// `tool.call` may name and this executor honors. `always_ask` only
    /// while the confirmation socket is up; under `--confirm always` only
    /// `always_ask` (an `always_allow` call is asked anyway).
    pub fn tools_capability(&self) -> crate::wire::types::ToolsCapability {
        let ask = self.confirm_actor().is_some();
        let mut modes = Vec::new();
        if !self.config.confirm_always {
            modes.push("always_allow".to_owned());
        }
        if ask {
            modes.push("always_ask".to_owned());
        }
        crate::wire::types::ToolsCapability {
            permission_modes: modes,
            local_confirmation: ask,
        }
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// The highest fencing token of each session this executor runs, for
    /// `resume.fencingTokens` (bmx extension).
    pub fn fencing_tokens(&self) -> std::collections::BTreeMap<String, u64> {
        self.fences
            .iter()
            .map(|e| (e.key().clone(), *e.value()))
            .collect()
    }

    pub fn active_sessions(&self) -> Vec<String> {
        let mut v: Vec<String> = self.sessions.iter().map(|e| e.key().clone()).collect();
        // Sessions of a previous run whose journal is being delivered: the
        // harness must keep their leases with this connection until then.
        if let Some(j) = &self.journal {
            v.extend(j.recovering());
        }
        v.sort();
        v.dedup();
        v
    }
}

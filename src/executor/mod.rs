//! The executor daemon as a library: start it, wait for it, stop it.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use bmx::executor::{Executor, ExecutorConfig, TokenSource};
//! use bmx::wire::Endpoint;
//! let endpoint = Endpoint::parse("ws://127.0.0.1:7070/v1/executor/connect")?;
//! let config = ExecutorConfig::new(endpoint, TokenSource::Static("secret".into()));
//! let executor = Executor::start(config).await?;
//! let exit = executor.run_until_signal().await;
//! std::process::exit(exit.exit_code().into());
//! # }
//! ```

pub mod actors;
pub mod artifacts;
pub mod backup;
pub mod config;
pub mod confirm;
pub mod file_transfer;
pub mod journal;
pub mod mcp;
pub mod metrics;
pub mod outbox;
pub mod runtime;
pub mod skills;
pub mod stdio_peer;
pub mod stop;
pub mod workroot;
// Issue 15 (part A): package install, git credentials.
pub mod git_credentials;
pub mod packages;
pub mod restore;

pub use config::{ExecutorConfig, TokenSource};
pub use runtime::Shared;

use crate::supervisor::{Exit, SupervisorExit, SupervisorMsg};
use actors::root;
use ractor::ActorRef;
use std::sync::Arc;
use tokio::sync::oneshot;

/// How an executor run ended; [`ExecutorExit::exit_code`] is the daemon's
/// exit status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecutorExit {
    /// Stopped on request (signal, `shutdown`, or a completed drain): 0.
    Stopped,
    /// Closed with 4004 by a newer connection of the same executor id: 3.
    Replaced,
    /// Credential or registration refused (HTTP 401, close 4001 or 4003): 4.
    Refused(String),
    /// The configured reconnect attempts ran out: 5.
    ReconnectExhausted,
    /// Anything else (an internal failure): 1.
    Failed(String),
}

impl ExecutorExit {
    pub fn exit_code(&self) -> u8 {
        match self {
            ExecutorExit::Stopped => 0,
            ExecutorExit::Failed(_) => 1,
            ExecutorExit::Replaced => 3,
            ExecutorExit::Refused(_) => 4,
            ExecutorExit::ReconnectExhausted => 5,
        }
    }

    fn from_supervisor(exit: SupervisorExit) -> Self {
        match exit {
            SupervisorExit::Stopped => ExecutorExit::Stopped,
            SupervisorExit::ChildExited {
                exit: Exit::Shutdown(why),
                ..
            } => match stop::FinalStop::parse(&why) {
                Some(stop::FinalStop::Replaced) => ExecutorExit::Replaced,
                Some(
                    f @ (stop::FinalStop::Unauthorized
                    | stop::FinalStop::CredentialRejected
                    | stop::FinalStop::RegistrationRefused),
                ) => ExecutorExit::Refused(f.as_str().to_owned()),
                Some(stop::FinalStop::Drained | stop::FinalStop::Requested) => {
                    ExecutorExit::Stopped
                }
                Some(f @ stop::FinalStop::BadUrl) => ExecutorExit::Failed(f.as_str().to_owned()),
                None => ExecutorExit::Failed(why),
            },
            SupervisorExit::ChildExited { child, exit } => {
                ExecutorExit::Failed(format!("{child}: {exit:?}"))
            }
            SupervisorExit::Exhausted { .. } => ExecutorExit::ReconnectExhausted,
            SupervisorExit::Meltdown => ExecutorExit::Failed("restart intensity exceeded".into()),
        }
    }
}

/// Why the executor could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("work root: {0}")]
    WorkRoot(#[from] workroot::WorkRootError),
    #[error("{0}")]
    Sandbox(#[from] crate::sandbox::SandboxError),
    #[error("cannot spawn the actor tree: {0}")]
    Spawn(String),
    #[error("cannot open the journal {path}: {source}")]
    Journal {
        path: std::path::PathBuf,
        source: journal::JournalError,
    },
}

/// A running executor.
pub struct ExecutorHandle {
    root: ActorRef<SupervisorMsg>,
    exit: oneshot::Receiver<SupervisorExit>,
    shared: Arc<Shared>,
}

/// Entry point of the executor runtime.
pub struct Executor;

impl Executor {
    /// Start the actor tree: sessions, terminals, then the connection (which
    /// dials, registers and keeps reconnecting).
    pub async fn start(config: ExecutorConfig) -> Result<ExecutorHandle, StartError> {
        Self::start_with_tools(config, crate::tools::ToolRegistry::builtin()).await
    }

    /// Start with a tool registry of the platform's own (see
    /// [`crate::tools::Tool`]).
    pub async fn start_with_tools(
        config: ExecutorConfig,
        tools: crate::tools::ToolRegistry,
    ) -> Result<ExecutorHandle, StartError> {
        workroot::prepare(&config.work_root)?;
        // Every process holds one to three descriptors (its pipes).
        crate::process::sys::raise_nofile_limit();
        crate::process::sys::reserve_spare_fd();
        if config.subreaper {
            crate::process::sys::become_subreaper();
        }
        let instance = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let journal = match &config.journal {
            Some(path) => match journal::Journal::open(path, &instance) {
                Ok(j) => Some(Arc::new(j)),
                Err(e @ journal::JournalError::Held(_)) => {
                    tracing::warn!(error = %e, "running without a journal: results are kept in memory only");
                    None
                }
                Err(source) => {
                    return Err(StartError::Journal {
                        path: path.clone(),
                        source,
                    })
                }
            },
            None => None,
        };
        // Before any session: children start from reserved low descriptor
        // slots (`process::spawn`), and the sandbox decides what it can
        // enforce here.
        let _ = crate::process::spawn::reserve();
        let sandboxes = Arc::new(crate::sandbox::Sandboxes::start(config.sandbox.clone())?);
        let shared = Shared::with_journal(config, tools, instance, journal, sandboxes);
        let (root, exit) = root::start(shared.clone())
            .await
            .map_err(|e| StartError::Spawn(e.to_string()))?;
        Ok(ExecutorHandle { root, exit, shared })
    }
}

/// An actor a test makes panic (see [`ExecutorHandle::inject_panic`]).
#[doc(hidden)]
#[derive(Debug, Clone)]
pub enum PanicTarget {
    /// The sessions actor itself (every session dies with it).
    Sessions,
    Session(String),
    Process {
        session: String,
        process: String,
    },
    Tool {
        session: String,
        tool_call: String,
    },
    Terminal(String),
}

impl ExecutorHandle {
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Fault injection for tests: make one actor panic in its handler, as
    /// a bug would. Not reachable from the wire. `false` when the target
    /// is not running.
    #[doc(hidden)]
    pub fn inject_panic(&self, target: PanicTarget) -> bool {
        use actors::session::{SessionChild, SessionMsg};
        let to_session = |session: &str, child: Option<SessionChild>| {
            self.shared
                .sessions
                .get(session)
                .is_some_and(|s| s.send_message(SessionMsg::Panic(child)).is_ok())
        };
        match target {
            PanicTarget::Sessions => self
                .shared
                .sessions_actor()
                .is_some_and(|s| s.send_message(actors::sessions::SessionsMsg::Panic).is_ok()),
            PanicTarget::Session(s) => to_session(&s, None),
            PanicTarget::Process { session, process } => {
                to_session(&session, Some(SessionChild::Process(process)))
            }
            PanicTarget::Tool { session, tool_call } => {
                to_session(&session, Some(SessionChild::Tool(tool_call)))
            }
            PanicTarget::Terminal(id) => self.shared.terminals_actor().is_some_and(|t| {
                t.send_message(actors::terminals::TerminalsMsg::PanicTerminal(id))
                    .is_ok()
            }),
        }
    }

    /// Wait until the executor ends by itself.
    pub async fn wait(self) -> ExecutorExit {
        let exit = match self.exit.await {
            Ok(exit) => ExecutorExit::from_supervisor(exit),
            Err(_) => ExecutorExit::Failed("the root supervisor vanished".into()),
        };
        remove_sandboxes(&self.shared).await;
        exit
    }

    /// Stop in order: close the connection (executor.close, then 1000), end
    /// every session (no orphans), then return.
    pub async fn shutdown(self) -> ExecutorExit {
        self.shared.stopping.cancel();
        self.root.stop(None);
        self.wait().await
    }

    /// Run until SIGINT or SIGTERM (then shut down) or until the executor
    /// ends by itself. The handlers are installed here; a daemon should
    /// install them before [`Executor::start`] with [`ShutdownSignals`] and
    /// call [`ExecutorHandle::run_until`], or a signal that arrives while
    /// the executor starts kills it without a clean close.
    pub async fn run_until_signal(self) -> ExecutorExit {
        match ShutdownSignals::install() {
            Ok(signals) => self.run_until(signals).await,
            Err(_) => self.wait().await,
        }
    }

    /// Run until one of `signals` arrives (then shut down) or until the
    /// executor ends by itself.
    pub async fn run_until(mut self, mut signals: ShutdownSignals) -> ExecutorExit {
        tokio::select! {
            exit = &mut self.exit => {
                remove_sandboxes(&self.shared).await;
                return match exit {
                    Ok(exit) => ExecutorExit::from_supervisor(exit),
                    Err(_) => ExecutorExit::Failed("the root supervisor vanished".into()),
                };
            }
            _ = signals.term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = signals.int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        self.shutdown().await
    }
}

/// The executor's last act: whatever is still in a session cgroup dies,
/// and its cgroup tree goes.
async fn remove_sandboxes(shared: &Arc<Shared>) {
    let sandboxes = shared.sandboxes.clone();
    let _ = tokio::task::spawn_blocking(move || sandboxes.remove_all()).await;
}

/// SIGTERM and SIGINT listeners. Installing them replaces the default
/// action (die at once), so a daemon installs them first thing: a signal
/// that arrives from then on is kept until [`ExecutorHandle::run_until`]
/// sees it, and ends in a clean shutdown (executor.close, 1000, every
/// session ended) even while the executor is still starting.
pub struct ShutdownSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    /// Install both listeners (inside a tokio runtime).
    pub fn install() -> std::io::Result<ShutdownSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(ShutdownSignals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }
}

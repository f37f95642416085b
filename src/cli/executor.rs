//! `bmx executor`: the daemon.

use bmx::executor::{Executor, ExecutorConfig, TokenSource};
use bmx::runner::{LockError, LockHolder, WorkspaceLock};
use bmx::wire::Endpoint;
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Connect to a harness and run its sessions. Exit status: 0 after
/// SIGINT/SIGTERM, 3 when replaced by a newer connection (close 4004), 4 when
/// the credential or registration is refused (HTTP 401, close 4001 or 4003),
/// 5 when `--reconnect-max-attempts` ran out, 6 when `--workspace` is
/// locked by another live executor, 2 on bad arguments, 1 on other errors.
#[derive(Debug, Args)]
pub struct ExecutorArgs {
    /// The harness: ws://HOST:PORT/v1/executor/connect or unix:/PATH.
    #[arg(long, env = "BMX_URL", required_unless_present = "harness")]
    pub url: Option<String>,
    /// The harness API (http://HOST:PORT): connect to its executor
    /// endpoint with the credential `bmx enroll` saved for it (and for
    /// `--workspace`, if given).
    #[arg(long, conflicts_with_all = ["url", "token", "token_file"])]
    pub harness: Option<String>,
    /// Bearer token.
    #[arg(
        long,
        env = "BMX_TOKEN",
        conflicts_with = "token_file",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// File holding the token; re-read on every (re)connect.
    #[arg(long, env = "BMX_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Root of session workspaces.
    #[arg(long)]
    pub work_root: Option<PathBuf>,
    /// Bind this executor to one directory: take `DIR/.bmx/lock` before
    /// registering (exit 6 if a live executor holds it), run every session
    /// in DIR and refuse working directories outside it.
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// `executor.name` (default: the host name).
    #[arg(long)]
    pub name: Option<String>,
    #[arg(long, default_value_t = 1024)]
    pub max_sessions: u32,
    /// Give up after this many failed reconnects in a row (default: never).
    #[arg(long)]
    pub reconnect_max_attempts: Option<u32>,
    #[arg(long, default_value_t = 64)]
    pub max_processes_per_session: u32,
    /// Bytes kept per process output stream.
    #[arg(long, default_value_t = 1 << 20)]
    pub process_buffer_bytes: usize,
    /// Environment variable names that never reach a tool or process
    /// (repeatable; the token variables are always denied).
    #[arg(long)]
    pub deny_env: Vec<String>,
    /// An ACP agent turns may run: `NAME=COMMAND [ARGS...]` (split on
    /// whitespace; repeatable; the first is the default).
    #[arg(long = "agent", value_name = "NAME=COMMAND")]
    pub agents: Vec<String>,
    /// Serve `GET /metrics` (Prometheus text) on this address, e.g.
    /// 127.0.0.1:9464. Unauthenticated: keep it on loopback or a private
    /// network.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// `always`: every tool call waits for a person at this machine to
    /// allow it (`bmx confirm`), whatever its permission mode says; `ask`
    /// (default): only calls whose `permission.mode` is `always_ask` wait.
    #[arg(long, value_enum, default_value_t = ConfirmPolicy::Ask)]
    pub confirm: ConfirmPolicy,
    /// Seconds an `always_ask` call waits for a person (never past the
    /// call's own deadline).
    #[arg(long, default_value_t = 60, value_name = "SECONDS")]
    pub confirm_timeout: u64,
    /// The local confirmation socket (default `<work root>/confirm/confirm.sock`).
    #[arg(long, value_name = "PATH")]
    pub confirm_socket: Option<PathBuf>,
    /// Git credentials granted to processes started with
    /// `gitCredentials: true`: a JSON file of mode 0600,
    /// `{"credentials": [{"host", "username", "password", "expiresAt"?}]}`,
    /// read again at every grant (docs/security.md).
    #[arg(long, value_name = "FILE")]
    pub git_credentials: Option<PathBuf>,
    /// Run every session's processes, terminals, tools and MCP servers as
    /// this unprivileged user (a name or a uid); the executor itself must
    /// run as root and stays the only holder of its token
    /// (docs/security.md).
    #[arg(long, env = "BMX_RUN_AS", value_name = "USER")]
    pub run_as: Option<String>,
    /// Largest file a tool call's processes may write, in bytes
    /// (`RLIMIT_FSIZE`; 0: no limit). Default 4 GiB.
    #[arg(long, value_name = "BYTES", default_value_t = bmx::tools::disk::DEFAULT_MAX_FILE_BYTES)]
    pub tool_max_file_size: u64,
    /// Free bytes tool calls never take from the workspace's file system:
    /// a call does not start, and a running `bash` call is killed, below
    /// it (0: off). Default 512 MiB.
    #[arg(long, value_name = "BYTES", default_value_t = bmx::tools::disk::DEFAULT_RESERVE_BYTES)]
    pub disk_reserve: u64,
    #[command(flatten)]
    pub sandbox: super::sandbox::SandboxArgs,
}

/// `--confirm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ConfirmPolicy {
    /// Ask only for calls that say `always_ask`.
    Ask,
    /// Ask for every call.
    Always,
}

impl ExecutorArgs {
    pub fn into_config(self) -> Result<ExecutorConfig, String> {
        let (endpoint, token) = match &self.harness {
            Some(h) => enrolled(h, self.workspace.as_deref())?,
            None => {
                let url = self
                    .url
                    .as_deref()
                    .ok_or("--url or --harness is required")?;
                let endpoint = Endpoint::parse(url).map_err(|e| e.to_string())?;
                let token = match (self.token, self.token_file) {
                    (Some(t), _) => TokenSource::Static(t),
                    (None, Some(f)) => TokenSource::File(f),
                    (None, None) => {
                        return Err("one of --token, --token-file or --harness is required".into())
                    }
                };
                (endpoint, token)
            }
        };
        let mut config = ExecutorConfig::new(endpoint, token);
        for spec in &self.agents {
            let Some((name, command)) = spec.split_once('=') else {
                return Err(format!("--agent {spec:?}: expected NAME=COMMAND"));
            };
            let argv: Vec<String> = command.split_whitespace().map(str::to_owned).collect();
            if name.is_empty() || argv.is_empty() {
                return Err(format!("--agent {spec:?}: expected NAME=COMMAND"));
            }
            config.agents.push((name.to_owned(), argv));
        }
        if let Some(root) = self.work_root {
            config.work_root = root;
        }
        if let Some(name) = self.name {
            config.name = name;
        }
        config.max_sessions = self.max_sessions;
        config.reconnect_max_attempts = self.reconnect_max_attempts;
        config.max_processes_per_session = self.max_processes_per_session;
        config.process_buffer_bytes = self.process_buffer_bytes.max(1);
        config.deny_env.extend(self.deny_env);
        config.confirm_always = self.confirm == ConfirmPolicy::Always;
        config.confirm_timeout = std::time::Duration::from_secs(self.confirm_timeout.max(1));
        config.confirm_socket = self.confirm_socket;
        config.git_credentials = self.git_credentials;
        config.tool_disk = bmx::tools::disk::DiskLimits {
            max_file_bytes: (self.tool_max_file_size > 0).then_some(self.tool_max_file_size),
            reserve_bytes: self.disk_reserve,
        };
        config.sandbox = self.sandbox.into_config()?;
        // The daemon owns all its children: orphans come back to it.
        config.subreaper = true;
        config.journal = Some(config.work_root.join(bmx::executor::journal::FILE));
        Ok(config)
    }
}

/// Exit status of an executor whose workspace is locked by another.
pub const EXIT_WORKSPACE_LOCKED: u8 = 6;

pub async fn run(args: ExecutorArgs) -> ExitCode {
    let workspace = args.workspace.clone();
    let harness = args
        .harness
        .clone()
        .or(args.url.clone())
        .unwrap_or_default();
    let metrics_listen = args.metrics_listen;
    let run_as = args.run_as.clone();
    let mut config = match args.into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("bmx executor: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(name) = run_as {
        if let Err(e) = run_as_user(&name, &config.work_root) {
            eprintln!("bmx executor: {e}");
            return ExitCode::from(2);
        }
    }
    // The lock comes before anything else, registering included; it is
    // held (`_lock` lives) until the executor has stopped.
    let _lock = match workspace {
        Some(dir) => match bind_workspace(&dir) {
            Ok((canonical, lock)) => {
                config.workspace = Some(canonical);
                Some(lock)
            }
            Err(code) => return ExitCode::from(code),
        },
        None => None,
    };
    // A bound executor's state dir (bmx targets, bmx env), held as long as
    // the workspace lock.
    let mut state = config
        .workspace
        .as_deref()
        .and_then(|w| bmx::runner::claims::claim_workspace(w, &harness));
    // Before the executor starts: a SIGTERM from now on is a clean
    // shutdown, not the default death (which would skip executor.close
    // and the end of every session).
    let signals = match bmx::executor::ShutdownSignals::install() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bmx executor: cannot install signal handlers: {e}");
            return ExitCode::from(1);
        }
    };
    let handle = match Executor::start(config).await {
        Ok(h) => h,
        Err(e) => {
            eprintln!("bmx executor: {e}");
            return ExitCode::from(1);
        }
    };
    bmx::runner::claims::ready_without_socket(&mut state);
    let metrics = match metrics_listen {
        Some(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => {
                tracing::info!(addr = %addr, "metrics on /metrics");
                Some(tokio::spawn(bmx::executor::metrics::serve(
                    l,
                    handle.shared().clone(),
                )))
            }
            Err(e) => {
                eprintln!("bmx executor: --metrics-listen {addr}: {e}");
                handle.shutdown().await;
                return ExitCode::from(2);
            }
        },
        None => None,
    };
    let exit = handle.run_until(signals).await;
    if let Some(m) = metrics {
        m.abort();
    }
    // Every session has ended and killed what carries its tag; whatever
    // is still below the daemon (a descendant that dropped its tag) must
    // not outlive it as an orphan of pid 1.
    let killed = tokio::task::spawn_blocking(bmx::process::sys::kill_all_descendants)
        .await
        .unwrap_or(0);
    if killed > 0 {
        tracing::warn!(killed, "killed descendants left after the sessions ended");
    }
    tracing::info!(?exit, "executor stopped");
    drop(state);
    ExitCode::from(exit.exit_code())
}

/// Canonicalize `dir` (a symlinked workspace and its target are one
/// workspace) and take its lock; on failure, the message is printed and
/// the exit status returned.
fn bind_workspace(dir: &Path) -> Result<(PathBuf, WorkspaceLock), u8> {
    let canonical = match std::fs::canonicalize(dir) {
        Ok(c) if c.is_dir() => c,
        Ok(_) => {
            eprintln!(
                "bmx executor: --workspace {}: not a directory",
                dir.display()
            );
            return Err(2);
        }
        Err(e) => {
            eprintln!("bmx executor: --workspace {}: {e}", dir.display());
            return Err(2);
        }
    };
    match WorkspaceLock::acquire(&canonical, LockHolder::this_process("bmx executor")) {
        Ok(lock) => {
            if let Some(old) = lock.took_over() {
                tracing::info!(pid = old.pid, instance = %old.instance_id, "took over the stale lock of a dead executor");
            }
            Ok((canonical, lock))
        }
        Err(e @ LockError::Held { .. }) => {
            eprintln!(
                "bmx executor: workspace {} is in use: {e}",
                canonical.display()
            );
            Err(EXIT_WORKSPACE_LOCKED)
        }
        Err(LockError::Io { path, source }) => {
            let hint = match source.raw_os_error() {
                Some(libc::EROFS) | Some(libc::EACCES) | Some(libc::EPERM) => {
                    " (the workspace must be writable: bmx keeps its lock in DIR/.bmx/)"
                }
                _ => "",
            };
            eprintln!(
                "bmx executor: cannot lock workspace {}: {}: {source}{hint}",
                canonical.display(),
                path.display()
            );
            Err(1)
        }
    }
}

/// The endpoint and stored credential for `--harness URL` (and the
/// workspace, or the only credential kept for that harness).
fn enrolled(harness: &str, workspace: Option<&Path>) -> Result<(Endpoint, TokenSource), String> {
    use bmx::runner::credentials::{bmx_home, CredentialStore};
    let harness = harness.trim_end_matches('/');
    let store = CredentialStore::new(&bmx_home());
    let creds = store.load(harness).map_err(|e| e.to_string())?;
    let cred = match workspace {
        Some(w) => {
            let w = std::fs::canonicalize(w)
                .map_err(|e| format!("--workspace {}: {e}", w.display()))?;
            creds.credentials.get(w.to_string_lossy().as_ref()).cloned()
        }
        None if creds.credentials.len() == 1 => creds.credentials.values().next().cloned(),
        None if creds.credentials.len() > 1 => {
            return Err(format!(
                "several credentials are stored for {harness}: give --workspace"
            ))
        }
        None => None,
    }
    .ok_or_else(|| format!("no stored credential for {harness}: run bmx enroll first"))?;
    let ws = if let Some(rest) = harness.strip_prefix("https://") {
        format!("wss://{rest}")
    } else if let Some(rest) = harness.strip_prefix("http://") {
        format!("ws://{rest}")
    } else {
        return Err(format!("--harness {harness:?}: expected http://HOST:PORT"));
    };
    let endpoint =
        Endpoint::parse(&format!("{ws}/v1/executor/connect")).map_err(|e| e.to_string())?;
    Ok((endpoint, TokenSource::Static(cred.token)))
}

/// `--run-as`: resolve the user, make the work root and its `sessions/`
/// reachable by it (`o+x`: it can enter its own workspace by path, but list
/// nothing), then make it the identity of every session child.
fn run_as_user(name: &str, work_root: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let user = bmx::process::run_as::resolve(name).map_err(|e| e.to_string())?;
    for dir in [work_root.to_owned(), work_root.join("sessions")] {
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mode = std::fs::metadata(&dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .permissions()
            .mode();
        if mode & 0o001 == 0 {
            std::fs::set_permissions(
                &dir,
                std::fs::Permissions::from_mode((mode & 0o7777) | 0o011),
            )
            .map_err(|e| format!("{}: {e}", dir.display()))?;
            tracing::info!(dir = %dir.display(), "made traversable for the --run-as user");
        }
    }
    tracing::info!(user = %user.name, uid = user.uid, "session code runs as this user");
    bmx::process::run_as::set(user).map_err(|e| e.to_string())
}

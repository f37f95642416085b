//! `bmx executor`: the daemon.

use bmx::executor::{Executor, ExecutorConfig, TokenSource};
use bmx::wire::Endpoint;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

/// Connect to a harness and run its sessions. Exit status: 0 after
/// SIGINT/SIGTERM, 3 when replaced by a newer connection (close 4004), 4 when
/// the credential or registration is refused (HTTP 401, close 4001 or 4003),
/// 5 when `--reconnect-max-attempts` ran out, 1 on other errors.
#[derive(Debug, Args)]
pub struct ExecutorArgs {
    /// The harness: ws://HOST:PORT/v1/executor/connect or unix:/PATH.
    #[arg(long, env = "BMX_URL")]
    pub url: String,
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
}

impl ExecutorArgs {
    pub fn into_config(self) -> Result<ExecutorConfig, String> {
        let endpoint = Endpoint::parse(&self.url).map_err(|e| e.to_string())?;
        let token = match (self.token, self.token_file) {
            (Some(t), _) => TokenSource::Static(t),
            (None, Some(f)) => TokenSource::File(f),
            (None, None) => return Err("one of --token or --token-file is required".into()),
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
        // The daemon owns all its children: orphans come back to it.
        config.subreaper = true;
        Ok(config)
    }
}

pub async fn run(args: ExecutorArgs) -> ExitCode {
    let config = match args.into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("bmx executor: {e}");
            return ExitCode::from(2);
        }
    };
    let handle = match Executor::start(config).await {
        Ok(h) => h,
        Err(e) => {
            eprintln!("bmx executor: {e}");
            return ExitCode::from(1);
        }
    };
    let exit = handle.run_until_signal().await;
    tracing::info!(?exit, "executor stopped");
    ExitCode::from(exit.exit_code())
}

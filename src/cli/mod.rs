//! The command line: one module per subcommand.

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use text::warn_line;

pub mod attach;
pub mod bench;
pub mod confirm;
pub mod enroll;
pub mod env;
pub mod executor;
pub mod harness;
pub mod json;
pub mod run;
pub mod sandbox;
pub mod scrub;
pub mod status;
pub mod targets;
pub mod text;
pub mod visor;

/// bmx: an actor-model runtime for the executor protocol.
///
/// `bmx up` runs a harness and one executor on this machine; `bmx executor`
/// runs the daemon against a remote harness; `bmx harness` runs only the
/// control plane.
#[derive(Debug, Parser)]
#[command(name = "bmx", version, about, long_about = None)]
pub struct Cli {
    /// Log line format on stderr: `text` (colours only when stderr is a
    /// terminal) or `json` (one object per line, for log shippers).
    #[arg(long, global = true, env = "BMX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Worker threads of the async runtime (default: one per CPU, or
    /// tokio's `TOKIO_WORKER_THREADS`). Fewer leave more CPU to the
    /// sessions' own processes and cost less per relayed message; more
    /// carry bulk output faster (docs/benchmarks.md, "Runtime size").
    #[arg(long, global = true, env = "BMX_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,
    #[command(subcommand)]
    pub command: Command,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the executor daemon: connect to a harness and do its sessions' work.
    Executor(executor::ExecutorArgs),
    /// Run the harness (control plane): accept executors, serve the HTTP API.
    Harness(harness::HarnessArgs),
    /// Run a local harness and one executor connected to it, until Ctrl-C.
    Up(harness::UpArgs),
    /// Run a command on an executor through the harness API and stream its output.
    Exec(harness::ExecArgs),
    /// Run one agent turn in a session (a new one by default): stream the
    /// agent's text, ask its permission questions here, exit with the
    /// turn's outcome (0 completed, 1 failed, 130 canceled).
    Run(run::RunArgs),
    /// List executors and sessions of a harness.
    Ps(harness::PsArgs),
    /// Attach this terminal to a terminal on an executor (a new one, or
    /// TERMINAL_ID); detach with Ctrl-P Ctrl-Q.
    Attach(attach::AttachArgs),
    /// Enroll this machine's executor for a workspace with a harness
    /// (device code; an operator approves).
    Enroll(enroll::EnrollArgs),
    /// Operator: list, approve or deny enrollments.
    #[command(subcommand)]
    Enrollments(enroll::EnrollmentsCommand),
    /// Operator: list or revoke enrollment-issued credentials.
    #[command(subcommand)]
    Credentials(enroll::CredentialsCommand),
    /// Benchmarks (baseline and bmx measured in one run).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// The local supervisor of agent and shell sessions: serve (no
    /// subcommand), or list, start, drive and stop its sessions.
    Visor(visor::VisorArgs),
    /// List the local runtimes (`bmx up`, visors, bound executors).
    Targets(targets::TargetsArgs),
    /// Status, diagnosis, start and stop of a local runtime.
    #[command(subcommand)]
    Env(env::EnvCommand),
    /// Is the local runtime (`bmx up`) running?
    Status(status::StatusArgs),
    /// List and answer the tool calls the local executor holds for a
    /// person's confirmation (`always_ask`, `--confirm always`).
    Confirm(confirm::ConfirmArgs),
}

/// Log targets of dependencies that print headers or frame payloads at
/// trace level (capped at debug by [`init_tracing`]).
pub const SECRET_PRINTING_TARGETS: [&str; 4] =
    ["tungstenite", "tokio_tungstenite", "reqwest", "hyper_util"];

/// Install the tracing subscriber: stderr, `RUST_LOG`-style filter
/// (default `info`, `warn` for benchmarks). Escape codes only reach a
/// terminal: a file or a pipe gets plain text (or JSON).
pub fn init_tracing(default: &str, format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Dependencies that print credentials at trace: tungstenite logs the
    // raw handshake (`authorization: Bearer …`, relay tickets in the path)
    // and every frame's payload (an `executor.token_refresh` token).
    // Never below debug, whatever RUST_LOG says (secrets never reach a
    // log; tests/security/logs.rs greps a whole run at RUST_LOG=trace).
    // Only when trace is on somewhere: the directives would otherwise turn
    // their debug lines on at the default level.
    let tracing_on = filter
        .max_level_hint()
        .is_none_or(|l| l == tracing_subscriber::filter::LevelFilter::TRACE);
    let mut filter = filter;
    if tracing_on {
        for target in SECRET_PRINTING_TARGETS {
            if let Ok(d) = format!("{target}=debug").parse() {
                filter = filter.add_directive(d);
            }
        }
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(
        match cli.command {
            // Log lines would land in the middle of the remote screen.
            Command::Bench(_) | Command::Attach(_) | Command::Run(_) => "warn",
            Command::Visor(ref v) if v.command.is_some() => "warn",
            // One answer on stdout; logs only when asked (RUST_LOG).
            Command::Targets(_) | Command::Env(_) | Command::Status(_) => "warn",
            Command::Confirm(_) => "warn",
            _ => "info",
        },
        cli.log_format,
    );
    // The daemons hold credentials: out of their own /proc entries before
    // any other thread exists (src/cli/scrub.rs).
    if matches!(
        cli.command,
        Command::Executor(_) | Command::Harness(_) | Command::Up(_)
    ) {
        match scrub::scrub() {
            Ok(done) => {
                for flag in done.flags_on_command_line {
                    tracing::warn!(
                        flag,
                        "a secret given on the command line is visible to every local user until \
                         it is scrubbed; prefer --token-file or the environment"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not scrub secrets from /proc/self"),
        }
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = cli.worker_threads {
        builder.worker_threads(usize::from(n));
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            warn_line!("bmx: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = runtime.block_on(async move {
        match cli.command {
            Command::Executor(args) => executor::run(args).await,
            Command::Harness(args) => harness::run_harness(args).await,
            Command::Up(args) => harness::run_up(args).await,
            Command::Exec(args) => harness::run_exec(args).await,
            Command::Ps(args) => harness::run_ps(args).await,
            Command::Run(args) => run::run(args).await,
            Command::Attach(args) => attach::run(args).await,
            Command::Bench(cmd) => bench::run(cmd).await,
            Command::Visor(args) => visor::run(args).await,
            Command::Enroll(args) => enroll::run_enroll(args).await,
            Command::Enrollments(cmd) => enroll::run_enrollments(cmd).await,
            Command::Credentials(cmd) => enroll::run_credentials(cmd).await,
            Command::Targets(args) => targets::run(args).await,
            Command::Env(cmd) => env::run(cmd).await,
            Command::Status(args) => status::run(args).await,
            Command::Confirm(args) => confirm::run(args).await,
        }
    });
    // Dropping a runtime waits for every blocking task: one tool thread
    // still busy (a cancelled grep between its checks) would hold the
    // exit after SIGTERM (issue 18, finding 5). Everything that matters
    // has been stopped by now; what is left is abandoned.
    runtime.shutdown_timeout(BLOCKING_GRACE);
    code
}

/// How long the exit waits for blocking threads still running.
const BLOCKING_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_threads_is_global_and_bounded() {
        let cli = Cli::try_parse_from(["bmx", "up", "--worker-threads", "1"]).unwrap();
        assert_eq!(cli.worker_threads, Some(1));
        let cli = Cli::try_parse_from(["bmx", "--worker-threads", "3", "bench", "mcp"]).unwrap();
        assert_eq!(cli.worker_threads, Some(3));
        assert!(Cli::try_parse_from(["bmx", "up"])
            .unwrap()
            .worker_threads
            .is_none());
        for bad in ["0", "1025", "-1", "two"] {
            assert!(
                Cli::try_parse_from(["bmx", "up", "--worker-threads", bad]).is_err(),
                "{bad} accepted"
            );
        }
    }
}

//! `bmx confirm ls [--json] | allow ID | deny ID`: the person at the
//! executor's machine answers the tool calls it holds (`always_ask`).
//!
//! Talks to the executor over its local socket (`executor::confirm`),
//! `<work root>/confirm/confirm.sock` unless `--socket` says otherwise.
//! Only the executor's own user gets through (0600 socket, peer uid
//! checked): see docs/security.md.

use bmx::executor::confirm::{
    client, socket_path, LocalDecision, LocalRequest, LocalResponse, PendingView,
};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use super::text::{one_line, say, say_json, warn_line};

/// How long `bmx confirm` waits for the executor.
const TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Args)]
pub struct ConfirmArgs {
    #[command(subcommand)]
    pub command: ConfirmCommand,
    /// The executor's `--work-root` (default: the executor's default,
    /// `~/.bmx/work`).
    #[arg(long, global = true, value_name = "DIR")]
    pub work_root: Option<PathBuf>,
    /// The confirmation socket itself (overrides `--work-root`).
    #[arg(long, global = true, env = "BMX_CONFIRM_SOCKET", value_name = "PATH")]
    pub socket: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum ConfirmCommand {
    /// List the calls waiting for an answer.
    Ls {
        /// One JSON object on stdout: `{"pending": [...]}`.
        #[arg(long)]
        json: bool,
    },
    /// Let the call run.
    Allow { id: String },
    /// Refuse the call (its result: `local_confirmation_denied`).
    Deny { id: String },
}

fn socket(args: &ConfirmArgs) -> PathBuf {
    match (&args.socket, &args.work_root) {
        (Some(s), _) => s.clone(),
        (None, Some(root)) => socket_path(root),
        (None, None) => socket_path(&bmx::executor::workroot::default_work_root()),
    }
}

/// One waiting call, tab-separated. Each field is escaped on its own
/// (the tabs between them are the format's): the tool, its input and the
/// ids came from a session.
fn human(p: &PendingView) {
    say_tabbed(&format!(
        "{}\tsession {}\tcall {}\t{}\texpires in {} s\t{}",
        one_line(&p.id),
        one_line(&p.session_id),
        one_line(&p.tool_call_id),
        one_line(&p.tool),
        p.expires_in_ms.div_ceil(1000),
        one_line(&p.input)
    ));
}

/// A line whose fields are escaped already (a closed stdout is ignored).
fn say_tabbed(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

pub async fn run(args: ConfirmArgs) -> ExitCode {
    let path = socket(&args);
    let (request, json) = match &args.command {
        ConfirmCommand::Ls { json } => (LocalRequest::List, *json),
        ConfirmCommand::Allow { id } => (
            LocalRequest::Answer {
                id: id.clone(),
                decision: LocalDecision::Allow,
            },
            false,
        ),
        ConfirmCommand::Deny { id } => (
            LocalRequest::Answer {
                id: id.clone(),
                decision: LocalDecision::Deny,
            },
            false,
        ),
    };
    let answer: LocalResponse = match client::request(&path, &request, TIMEOUT).await {
        Ok(a) => a,
        Err(e) => {
            warn_line!("bmx confirm: {e}");
            return ExitCode::from(1);
        }
    };
    if let Some(e) = &answer.error {
        warn_line!("bmx confirm: {}: {}", e.code, e.message);
        return ExitCode::from(1);
    }
    match (&args.command, answer) {
        (ConfirmCommand::Ls { .. }, a) => {
            let pending = a.pending.unwrap_or_default();
            if json {
                say_json(&serde_json::json!({ "pending": pending }).to_string());
            } else if pending.is_empty() {
                say!("no tool call is waiting for confirmation");
            } else {
                pending.iter().for_each(human);
            }
        }
        (ConfirmCommand::Allow { id }, _) => say!("allowed {id}"),
        (ConfirmCommand::Deny { id }, _) => say!("denied {id}"),
    }
    ExitCode::SUCCESS
}

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

fn human(p: &PendingView) {
    println!(
        "{}\tsession {}\tcall {}\t{}\texpires in {} s\t{}",
        p.id,
        p.session_id,
        p.tool_call_id,
        p.tool,
        p.expires_in_ms.div_ceil(1000),
        p.input
    );
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
            eprintln!("bmx confirm: {e}");
            return ExitCode::from(1);
        }
    };
    if let Some(e) = &answer.error {
        eprintln!("bmx confirm: {}: {}", e.code, e.message);
        return ExitCode::from(1);
    }
    match (&args.command, answer) {
        (ConfirmCommand::Ls { .. }, a) => {
            let pending = a.pending.unwrap_or_default();
            if json {
                println!("{}", serde_json::json!({ "pending": pending }));
            } else if pending.is_empty() {
                println!("no tool call is waiting for confirmation");
            } else {
                pending.iter().for_each(human);
            }
        }
        (ConfirmCommand::Allow { id }, _) => println!("allowed {id}"),
        (ConfirmCommand::Deny { id }, _) => println!("denied {id}"),
    }
    ExitCode::SUCCESS
}

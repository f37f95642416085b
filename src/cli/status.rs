//! `bmx status [--target ID] [--json]`: is my local bmx running? The
//! summary of `bmx env status` for one target (default `local`, the
//! runtime of `bmx up`): its state, pid and URL. For the executors and
//! sessions of a harness, `bmx ps`.

use super::json::answer;
use super::text::say;
use bmx::runner::environment::{RuntimeSummary, TargetStatus};
use bmx::runner::state::{state_root, LOCAL_TARGET};
use bmx::runner::targets::{environment_status, look};
use clap::Args;
use serde::Serialize;
use std::process::ExitCode;

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The target (see `bmx targets`).
    #[arg(long, default_value = LOCAL_TARGET)]
    pub target: String,
    /// One JSON line in the envelope.
    #[arg(long)]
    pub json: bool,
}

/// `data` of `bmx status --json`.
#[derive(Debug, Serialize)]
pub struct StatusData {
    pub target_id: String,
    pub target_status: TargetStatus,
    pub runtime: RuntimeSummary,
}

pub async fn run(args: StatusArgs) -> ExitCode {
    let id = args.target.clone();
    let result = tokio::task::spawn_blocking(move || {
        look(&state_root(), &id).map(|l| {
            let s = environment_status(&l, false);
            StatusData {
                target_id: s.target.id,
                target_status: s.target.status,
                runtime: s.runtime,
            }
        })
    })
    .await
    .unwrap_or_else(|e| {
        Err(bmx::runner::envelope::ResponseError::new(
            bmx::runner::envelope::ErrorCode::EnvironmentStatus,
            e.to_string(),
        ))
    });
    answer(args.json, "status", Some(&args.target), result, |s| {
        // State files and the runtime's messages: escaped like wire text.
        let state = serde_json::to_value(s.runtime.state).unwrap_or_default();
        let mut line = format!("{}: {}", s.target_id, state.as_str().unwrap_or("-"));
        if let Some(pid) = s.runtime.pid {
            line.push_str(&format!(" (pid {pid})"));
        }
        if let Some(u) = &s.runtime.local_ui_url {
            line.push_str(&format!(" {u}"));
        }
        say!("{line}");
        if let Some(m) = &s.runtime.message {
            say!("  {m}");
        }
    })
}

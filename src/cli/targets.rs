//! `bmx targets [--json]`: the local runtimes bmx knows (docs/runner.md
//! "Targets"): `local` always, then one per state dir.

use super::json::answer;
use super::text::{one_line, say};
use bmx::runner::environment::TargetDescriptor;
use bmx::runner::state::state_root;
use bmx::runner::targets::discover;
use clap::Args;
use serde::Serialize;
use std::process::ExitCode;

#[derive(Debug, Args)]
pub struct TargetsArgs {
    /// One JSON line in the envelope: `data: {targets: [...]}`.
    #[arg(long)]
    pub json: bool,
}

/// `data` of `bmx targets --json` (the seed's `TargetCatalog`).
#[derive(Debug, Serialize)]
pub struct TargetCatalog {
    pub targets: Vec<TargetDescriptor>,
}

pub async fn run(args: TargetsArgs) -> ExitCode {
    let result = tokio::task::spawn_blocking(|| discover(&state_root()))
        .await
        .unwrap_or_else(|e| {
            Err(bmx::runner::envelope::ResponseError::new(
                bmx::runner::envelope::ErrorCode::TargetDiscoveryFailed,
                e.to_string(),
            ))
        })
        .map(|targets| TargetCatalog { targets });
    answer(args.json, "targets", None, result, |c| {
        say!(
            "{:<28} {:<20} {:<15} {:<28} LABEL",
            "ID",
            "KIND",
            "STATUS",
            "CONTROL"
        );
        for t in &c.targets {
            let status = serde_json::to_value(t.status).unwrap_or_default();
            // Read from state dirs: escaped per cell like wire text.
            say!(
                "{:<28} {:<20} {:<15} {:<28} {}",
                one_line(&t.id),
                one_line(&t.kind),
                status.as_str().unwrap_or("-"),
                one_line(t.runtime_control_socket_path.as_deref().unwrap_or("-")),
                one_line(&t.label)
            );
        }
    })
}

//! `bmx harness`, `bmx up`, `bmx exec`, `bmx ps`.

use clap::Args;
use std::process::ExitCode;

#[derive(Debug, Args)]
pub struct HarnessArgs {}

#[derive(Debug, Args)]
pub struct UpArgs {}

#[derive(Debug, Args)]
pub struct ExecArgs {}

#[derive(Debug, Args)]
pub struct PsArgs {}

fn not_built(what: &str) -> ExitCode {
    eprintln!("bmx {what}: not built yet");
    ExitCode::from(2)
}

pub async fn run_harness(_args: HarnessArgs) -> ExitCode {
    not_built("harness")
}

pub async fn run_up(_args: UpArgs) -> ExitCode {
    not_built("up")
}

pub async fn run_exec(_args: ExecArgs) -> ExitCode {
    not_built("exec")
}

pub async fn run_ps(_args: PsArgs) -> ExitCode {
    not_built("ps")
}

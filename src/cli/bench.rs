//! `bmx bench`.

use clap::Subcommand;
use std::process::ExitCode;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Process-output buffering: raw pipe vs ring vs end-to-end.
    Buffering,
}

pub async fn run(_cmd: BenchCommand) -> ExitCode {
    eprintln!("bmx bench: not built yet");
    ExitCode::from(2)
}

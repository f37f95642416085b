//! `bmx env status|diagnose|start|stop|restart [--target ID] [--json]`:
//! the status of a local runtime, and starting or stopping it
//! (docs/runner.md "Environments").
//!
//! An operation that is not possible now (start of a running runtime,
//! stop of a stopped one, start of a target bmx cannot start) is not an
//! error: the answer is `ok: true` with the status and the `operation`
//! plan, `performed: false`, its `availability` and `reason_code` (as the
//! seed's blocked plans). Only an attempt that failed is `ok: false`.

use super::json::answer;
use super::text::say;
use bmx::runner::control::{
    choose_port, current_exe, start_local, stop, START_DEADLINE, STOP_GRACE,
};
use bmx::runner::credentials::bmx_home;
use bmx::runner::envelope::{ErrorCode, ResponseError};
use bmx::runner::environment::{
    plans, Assessment, Availability, EnvironmentStatus, Operation, OperationPlan,
};
use bmx::runner::state::{state_dir, state_root, LOCAL_TARGET};
use bmx::runner::targets::{environment_status, look, startable};
use clap::{Args, Subcommand};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Debug, Subcommand)]
pub enum EnvCommand {
    /// The runtime's state and the operations possible now.
    Status(TargetOpts),
    /// Status plus the raw facts (lock, pid, socket) behind it.
    Diagnose(TargetOpts),
    /// Start the runtime in the background (`local`: `bmx up`); returns
    /// when it is ready.
    Start(StartOpts),
    /// Stop the runtime (SIGTERM, then SIGKILL after --grace-secs);
    /// returns when it and its processes are gone.
    Stop(StopOpts),
    /// Stop (if running), then start.
    Restart(StartOpts),
}

#[derive(Debug, Clone, Args)]
pub struct TargetOpts {
    /// The target (see `bmx targets`).
    #[arg(long, default_value = LOCAL_TARGET)]
    pub target: String,
    /// One JSON line in the envelope (`schema_version`, `ok`, `data`|`error`, `trace`).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct StartOpts {
    #[command(flatten)]
    pub target: TargetOpts,
    /// Port of `bmx up` on 127.0.0.1 (0: any free port). Default: the
    /// port of the last start (the state dir's config.json), else 7070.
    #[arg(long)]
    pub port: Option<u16>,
    /// How long to wait for the runtime to be ready.
    #[arg(long, default_value_t = START_DEADLINE.as_secs())]
    pub timeout_secs: u64,
    /// How long a restart's stop waits after SIGTERM before SIGKILL.
    #[arg(long, default_value_t = STOP_GRACE.as_secs())]
    pub grace_secs: u64,
}

#[derive(Debug, Clone, Args)]
pub struct StopOpts {
    #[command(flatten)]
    pub target: TargetOpts,
    /// How long to wait after SIGTERM before SIGKILL.
    #[arg(long, default_value_t = STOP_GRACE.as_secs())]
    pub grace_secs: u64,
}

impl EnvCommand {
    fn target(&self) -> &TargetOpts {
        match self {
            EnvCommand::Status(t) | EnvCommand::Diagnose(t) => t,
            EnvCommand::Start(s) | EnvCommand::Restart(s) => &s.target,
            EnvCommand::Stop(s) => &s.target,
        }
    }
}

pub async fn run(cmd: EnvCommand) -> ExitCode {
    let opts = cmd.target().clone();
    let verb = match &cmd {
        EnvCommand::Status(_) => Operation::Status,
        EnvCommand::Diagnose(_) => Operation::Diagnose,
        EnvCommand::Start(_) => Operation::Start,
        EnvCommand::Stop(_) => Operation::Stop,
        EnvCommand::Restart(_) => Operation::Restart,
    };
    // Waits and sleeps: off the async workers.
    let result = match tokio::task::spawn_blocking(move || perform(&cmd)).await {
        Ok(r) => r,
        Err(e) => Err(ResponseError::new(
            ErrorCode::EnvironmentOperation,
            format!("internal error: {e}"),
        )),
    };
    answer(
        opts.json,
        &format!("env {}", verb.as_str()),
        Some(&opts.target),
        result,
        print_human,
    )
}

fn perform(cmd: &EnvCommand) -> Result<EnvironmentStatus, ResponseError> {
    let root = state_root();
    let id = cmd.target().target.as_str();
    let looked = match (look(&root, id), cmd) {
        (Ok(l), _) => l,
        // A corrupt or incomplete state dir nobody holds: a new runtime
        // rewrites it, so start (and restart) may go ahead; status and
        // diagnose report the error.
        (Err(e), EnvCommand::Start(s) | EnvCommand::Restart(s))
            if e.code == ErrorCode::EnvironmentStatus && startable(id) && !lock_held(&root, id) =>
        {
            tracing::warn!(error = %e, "starting over an unreadable state dir");
            let pid = do_start(&root, s)?;
            let plan = plans(id, true, &Assessment::default_stopped()).start;
            return done(
                &root,
                id,
                plan,
                format!(
                    "started (pid {pid}) over an unreadable state dir ({})",
                    e.message
                ),
            );
        }
        (Err(e), _) => return Err(e),
    };
    match cmd {
        EnvCommand::Status(_) => Ok(environment_status(&looked, false)),
        EnvCommand::Diagnose(_) => Ok(environment_status(&looked, true)),
        EnvCommand::Start(s) => {
            let status = environment_status(&looked, false);
            let plan = status.operations.get(Operation::Start).clone();
            if plan.availability != Availability::Available {
                return Ok(not_performed(status, plan));
            }
            let pid = do_start(&root, s)?;
            done(&root, id, plan, format!("started (pid {pid})"))
        }
        EnvCommand::Stop(s) => {
            let status = environment_status(&looked, false);
            let plan = status.operations.get(Operation::Stop).clone();
            if plan.availability != Availability::Available {
                return Ok(not_performed(status, plan));
            }
            let msg = do_stop(&state_dir(&root, id), s.grace_secs)?;
            done(&root, id, plan, msg)
        }
        EnvCommand::Restart(s) => {
            let status = environment_status(&looked, false);
            let plan = status.operations.get(Operation::Restart).clone();
            if plan.availability != Availability::Available {
                return Ok(not_performed(status, plan));
            }
            let mut msg = String::new();
            if looked.assessment.running {
                msg = do_stop(&state_dir(&root, id), s.grace_secs)?;
                msg.push_str(", then ");
            }
            let pid = do_start(&root, s)?;
            msg.push_str(&format!("started (pid {pid})"));
            done(&root, id, plan, msg)
        }
    }
}

fn lock_held(root: &Path, id: &str) -> bool {
    bmx::runner::lock::probe(&state_dir(root, id).join(bmx::runner::state::LOCK_FILE))
        .map(|p| p.held)
        .unwrap_or(true)
}

fn do_start(root: &Path, s: &StartOpts) -> Result<u32, ResponseError> {
    start_local(
        &current_exe()?,
        &bmx_home(),
        root,
        choose_port(root, s.port),
        Duration::from_secs(s.timeout_secs.max(1)),
    )
}

fn do_stop(dir: &Path, grace_secs: u64) -> Result<String, ResponseError> {
    let st = stop(dir, Duration::from_secs(grace_secs))?;
    let mut msg = format!("stopped (pid {})", st.pid);
    if st.killed {
        msg.push_str(" with SIGKILL after SIGTERM was not enough");
    }
    if st.leftovers_killed > 0 {
        msg.push_str(&format!(
            "; killed {} leftover process(es) of its session",
            st.leftovers_killed
        ));
    }
    Ok(msg)
}

fn not_performed(mut status: EnvironmentStatus, mut plan: OperationPlan) -> EnvironmentStatus {
    plan.performed = Some(false);
    status.operation = Some(plan);
    status
}

/// The status after an operation, with the plan marked performed.
fn done(
    root: &Path,
    id: &str,
    mut plan: OperationPlan,
    message: String,
) -> Result<EnvironmentStatus, ResponseError> {
    let mut status = environment_status(&look(root, id)?, false);
    plan.performed = Some(true);
    plan.message = Some(message);
    plan.reason_code = None;
    status.operation = Some(plan);
    Ok(status)
}

fn print_human(s: &EnvironmentStatus) {
    if let Some(op) = &s.operation {
        let what = match (op.performed, &op.reason_code) {
            (Some(true), _) => op.message.clone().unwrap_or_default(),
            (_, Some(r)) => format!("not done ({r}): {}", op.message.clone().unwrap_or_default()),
            _ => "not done".into(),
        };
        say!("{} {}: {what}", op.operation, s.target.id);
    }
    let r = &s.runtime;
    let state = serde_json::to_value(r.state).unwrap_or_default();
    let mut line = format!("{}: {}", s.target.id, state.as_str().unwrap_or("-"));
    if let Some(pid) = r.pid {
        line.push_str(&format!(" (pid {pid})"));
    }
    if let Some(u) = &r.local_ui_url {
        line.push_str(&format!(" {u}"));
    }
    say!("{line}");
    if let Some(m) = &r.message {
        say!("  {m}");
    }
    if let Some(c) = r.failure_code {
        say!(
            "  failure: {}",
            serde_json::to_value(c)
                .unwrap_or_default()
                .as_str()
                .unwrap_or("")
        );
    }
    if let Some(d) = &s.diagnostics {
        say!("  lock: {} (held: {})", d.lock_path, d.lock_held);
        if let Some(p) = d.lock_pid {
            say!(
                "  lock pid: {p} (alive: {}), instance {}",
                d.pid_alive,
                d.lock_instance_id.as_deref().unwrap_or("-")
            );
        }
        if let Some(c) = &d.control_socket_path {
            say!("  control socket: {c} (reachable: {})", d.socket_reachable);
        }
    }
}

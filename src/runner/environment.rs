//! What `bmx targets` and `bmx env` answer (RUNNER.md §4), and the rules
//! that turn probe facts into those answers.
//!
//! Sans-IO: [`assess`] takes what was observed (state dir, lock, pid,
//! socket) and returns the runtime's state and failure code; [`plans`]
//! takes a target and that assessment and returns which operations are
//! possible and why not. Nothing here reads a file or a clock, so the
//! table tests below cover every combination; `state` and `control` do
//! the looking and the doing.

use serde::{Deserialize, Serialize};

/// `kind` of a target (the seed's spellings).
pub const KIND_LOCAL_HOST_RUNTIME: &str = "local_host_runtime";
pub const KIND_LOCAL_ENVIRONMENT: &str = "local_environment";

/// `status` of a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetStatus {
    /// Its runtime runs and answers.
    Available,
    /// It has a state dir, but its runtime does not run (or not well).
    Configured,
    /// A known target that has never run here (`local` without a state dir).
    NotConfigured,
    Unsupported,
}

/// One target, as `bmx targets --json` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetDescriptor {
    pub id: String,
    pub kind: String,
    pub label: String,
    pub status: TargetStatus,
    pub state_root: String,
    pub state_dir: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_path: Option<String>,
    /// What the reachability probe connects to: a Unix socket path (the
    /// visor), or `HOST:PORT` of the harness API (`local`; probed with
    /// `GET /v1/health`). Absent for bound executors, which listen on
    /// nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_control_socket_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_ui_url: Option<String>,
    pub capabilities: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable_reason_code: Option<String>,
}

/// The state of a runtime, as `runtime.state` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuntimeState {
    /// Lock held by a live process that answers on its control socket.
    Running,
    /// Lock held, the runtime has not said it is ready yet.
    Starting,
    /// Lock held by a live process whose control socket does not answer.
    Unreachable,
    /// The state dir claims a runtime, but nobody holds the lock (it was
    /// killed, or crashed).
    Stale,
    /// The last runtime exited cleanly.
    Stopped,
    /// No state dir: never started here.
    NotStarted,
}

/// `failure_code` strings (docs/runner.md lists them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureCode {
    /// No state dir.
    RuntimeNotStarted,
    /// Lock held by a live pid, control socket does not answer.
    RuntimeSocketUnreachable,
    /// The flock is free but the state dir still names a running holder.
    RuntimeLockStale,
    /// The flock is held, but the pid written in the lock is dead (the
    /// lock was inherited by some other process).
    RuntimeLockHolderDead,
}

/// What a reachability probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// This runtime has no control socket (a bound executor).
    NotApplicable,
    Reachable,
    Unreachable,
}

/// What the state dir's `runtime.json` says about its last runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordState {
    Starting,
    Running,
    Stopped,
}

/// Everything observed about one target, before any judgement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    pub state_dir_exists: bool,
    /// `runtime.json`: its state and instance id.
    pub record: Option<(RecordState, String)>,
    /// Somebody holds the flock of `lock`.
    pub lock_held: bool,
    /// The lock file names a holder: its pid and instance id.
    pub lock_holder: Option<(u32, String)>,
    /// The named holder's pid is a live (not zombie) process.
    pub pid_alive: bool,
    /// The control socket probe (only done when the lock is held).
    pub probe: Probe,
}

/// The judgement on [`Facts`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assessment {
    pub state: RuntimeState,
    /// A process holds the lock (it may not answer).
    pub running: bool,
    /// It answers: clients can use it.
    pub ready: bool,
    /// The live holder's pid.
    pub pid: Option<u32>,
    pub failure_code: Option<FailureCode>,
}

impl Assessment {
    /// A runtime that exited cleanly (what a state dir nobody holds
    /// amounts to when a start replaces it).
    pub fn default_stopped() -> Assessment {
        Assessment {
            state: RuntimeState::Stopped,
            running: false,
            ready: false,
            pid: None,
            failure_code: None,
        }
    }
}

/// Facts in, state out (see the module doc). The kernel's flock decides
/// whether a runtime exists; the files only name it; the probe decides
/// whether it is usable.
pub fn assess(f: &Facts) -> Assessment {
    let a = |state, running, ready, pid, failure_code| Assessment {
        state,
        running,
        ready,
        pid,
        failure_code,
    };
    if !f.state_dir_exists {
        return a(
            RuntimeState::NotStarted,
            false,
            false,
            None,
            Some(FailureCode::RuntimeNotStarted),
        );
    }
    if f.lock_held {
        let Some((pid, instance)) = &f.lock_holder else {
            // Held, contents not written yet: a runtime is starting.
            return a(RuntimeState::Starting, true, false, None, None);
        };
        if !f.pid_alive {
            return a(
                RuntimeState::Unreachable,
                true,
                false,
                None,
                Some(FailureCode::RuntimeLockHolderDead),
            );
        }
        let record_is_this_holder = matches!(&f.record, Some((_, i)) if i == instance);
        return match (&f.record, record_is_this_holder, f.probe) {
            (Some((RecordState::Running, _)), true, Probe::Reachable | Probe::NotApplicable) => {
                a(RuntimeState::Running, true, true, Some(*pid), None)
            }
            (Some((RecordState::Running, _)), true, Probe::Unreachable) => a(
                RuntimeState::Unreachable,
                true,
                false,
                Some(*pid),
                Some(FailureCode::RuntimeSocketUnreachable),
            ),
            _ => a(RuntimeState::Starting, true, false, Some(*pid), None),
        };
    }
    let claims_running = matches!(
        f.record,
        Some((RecordState::Running | RecordState::Starting, _))
    ) || f.lock_holder.is_some();
    if claims_running {
        a(
            RuntimeState::Stale,
            false,
            false,
            None,
            Some(FailureCode::RuntimeLockStale),
        )
    } else {
        a(RuntimeState::Stopped, false, false, None, None)
    }
}

/// One operation's plan (the seed's `EnvironmentOperationPlan`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationPlan {
    pub operation: String,
    pub availability: Availability,
    pub method: String,
    /// Set on the `operation` of a start/stop/restart answer: whether it
    /// was done (false when blocked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub performed: Option<bool>,
    pub requires_confirmation: bool,
    pub label: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason_code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_actions: Option<Vec<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Availability {
    Available,
    Blocked,
    Unavailable,
    Hidden,
}

/// Reason codes of blocked or unavailable operations.
pub const REASON_ALREADY_RUNNING: &str = "runtime_already_running";
pub const REASON_NOT_STARTED: &str = "runtime_not_started";
pub const REASON_UNSUPPORTED_KIND: &str = "unsupported_target_kind";
pub const REASON_UPDATE_UNSUPPORTED: &str = "update_not_supported";

/// `operations` of an environment status, one plan per operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationPlans {
    pub status: OperationPlan,
    pub diagnose: OperationPlan,
    pub start: OperationPlan,
    pub stop: OperationPlan,
    pub restart: OperationPlan,
    pub update: OperationPlan,
}

/// The operations of env; `as_str` is the CLI verb and the plan's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Status,
    Diagnose,
    Start,
    Stop,
    Restart,
    Update,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Status => "status",
            Operation::Diagnose => "diagnose",
            Operation::Start => "start",
            Operation::Stop => "stop",
            Operation::Restart => "restart",
            Operation::Update => "update",
        }
    }
}

impl OperationPlans {
    pub fn get(&self, op: Operation) -> &OperationPlan {
        match op {
            Operation::Status => &self.status,
            Operation::Diagnose => &self.diagnose,
            Operation::Start => &self.start,
            Operation::Stop => &self.stop,
            Operation::Restart => &self.restart,
            Operation::Update => &self.update,
        }
    }
}

/// Which operations a target allows, given its runtime's assessment.
/// `startable`: bmx knows how to start this target's runtime in the
/// background (only `local`, which is `bmx up`); any running runtime can
/// be stopped (SIGTERM to its lock holder).
pub fn plans(target_id: &str, startable: bool, a: &Assessment) -> OperationPlans {
    let argv = |verb: &str| {
        Some(
            ["bmx", "env", verb, "--target", target_id]
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>(),
        )
    };
    let plan = |op: &str, availability, confirm, label: &str| OperationPlan {
        operation: op.into(),
        availability,
        method: "local_host".into(),
        performed: None,
        requires_confirmation: confirm,
        label: label.into(),
        reason_code: None,
        message: None,
        argv: argv(op),
        next_actions: None,
    };
    let blocked = |mut p: OperationPlan, reason: &str, message: String, next: &[&str]| {
        p.availability = Availability::Blocked;
        p.reason_code = Some(reason.into());
        p.message = Some(message);
        p.next_actions = (!next.is_empty()).then(|| next.iter().map(|s| s.to_string()).collect());
        p
    };
    let unsupported = |mut p: OperationPlan, what: &str| {
        p.availability = Availability::Unavailable;
        p.method = "none".into();
        p.reason_code = Some(REASON_UNSUPPORTED_KIND.into());
        p.message = Some(format!(
            "bmx cannot {what} target {target_id} in the background: run its command yourself"
        ));
        p.argv = None;
        p
    };
    let start = plan("start", Availability::Available, false, "Start the runtime");
    let start = if !startable {
        unsupported(start, "start")
    } else if a.running {
        blocked(
            start,
            REASON_ALREADY_RUNNING,
            format!("target {target_id} is already running"),
            &["status", "restart", "stop"],
        )
    } else {
        start
    };
    let stop = plan("stop", Availability::Available, true, "Stop the runtime");
    let stop = if a.running {
        stop
    } else {
        blocked(
            stop,
            REASON_NOT_STARTED,
            format!("target {target_id} is not running"),
            if startable { &["start"] } else { &[] },
        )
    };
    let restart = plan(
        "restart",
        Availability::Available,
        a.running,
        "Restart the runtime",
    );
    let restart = if startable {
        restart
    } else {
        unsupported(restart, "restart")
    };
    let mut update = plan(
        "update",
        Availability::Unavailable,
        false,
        "Update the runtime",
    );
    update.method = "none".into();
    update.argv = None;
    update.reason_code = Some(REASON_UPDATE_UNSUPPORTED.into());
    update.message = Some("bmx is updated by installing a new binary".into());
    OperationPlans {
        status: plan("status", Availability::Available, false, "Show status"),
        diagnose: plan("diagnose", Availability::Available, false, "Diagnose"),
        start,
        stop,
        restart,
        update,
    }
}

/// `runtime` of an environment status (the seed's `RuntimeStatusSummary`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeSummary {
    pub state: RuntimeState,
    pub ready: bool,
    pub running: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_ui_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_code: Option<FailureCode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// `diagnostics` (only for `env diagnose`): the raw facts behind the state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Diagnostics {
    pub lock_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_socket_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_instance_id: Option<String>,
    /// Whether the lock's flock is held right now.
    pub lock_held: bool,
    pub pid_alive: bool,
    pub socket_reachable: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_code: Option<FailureCode>,
}

/// The answer of `bmx env ... --json` (`data`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvironmentStatus {
    pub target: TargetDescriptor,
    pub supported: bool,
    pub runtime: RuntimeSummary,
    pub operations: OperationPlans,
    /// For `start|stop|restart`: the plan that was acted on, with
    /// `performed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<OperationPlan>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diagnostics: Option<Diagnostics>,
}

/// A human sentence for a state (the `message` of the runtime summary).
pub fn describe(a: &Assessment) -> &'static str {
    match a.state {
        RuntimeState::Running => "running and reachable",
        RuntimeState::Starting => "starting: the lock is held, the runtime is not ready yet",
        RuntimeState::Unreachable => match a.failure_code {
            Some(FailureCode::RuntimeLockHolderDead) => {
                "the lock is held, but the process it names is dead"
            }
            _ => "the lock is held by a live process, but its control socket does not answer",
        },
        RuntimeState::Stale => {
            "stale: the state dir names a runtime, but no process holds its lock (it was killed or crashed)"
        }
        RuntimeState::Stopped => "stopped: the last runtime exited cleanly",
        RuntimeState::NotStarted => "not started: no state dir",
    }
}

/// The target's `status` given its assessment.
pub fn target_status(a: &Assessment) -> TargetStatus {
    match a.state {
        RuntimeState::Running => TargetStatus::Available,
        RuntimeState::NotStarted => TargetStatus::NotConfigured,
        _ => TargetStatus::Configured,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn facts() -> Facts {
        Facts {
            state_dir_exists: true,
            record: Some((RecordState::Running, "i1".into())),
            lock_held: true,
            lock_holder: Some((42, "i1".into())),
            pid_alive: true,
            probe: Probe::Reachable,
        }
    }

    #[test]
    fn table() {
        use FailureCode::*;
        use RuntimeState::*;
        /// Name, facts, expected state, failure code, running, ready.
        type Case = (
            &'static str,
            Facts,
            RuntimeState,
            Option<FailureCode>,
            bool,
            bool,
        );
        let cases: Vec<Case> = vec![
            ("running", facts(), Running, None, true, true),
            (
                "bound executor: no socket",
                Facts {
                    probe: Probe::NotApplicable,
                    ..facts()
                },
                Running,
                None,
                true,
                true,
            ),
            (
                "live holder, socket dead",
                Facts {
                    probe: Probe::Unreachable,
                    ..facts()
                },
                Unreachable,
                Some(RuntimeSocketUnreachable),
                true,
                false,
            ),
            (
                "killed: flock free, record says running",
                Facts {
                    lock_held: false,
                    pid_alive: false,
                    probe: Probe::Unreachable,
                    ..facts()
                },
                Stale,
                Some(RuntimeLockStale),
                false,
                false,
            ),
            (
                "pid reused by another program: the flock decides",
                Facts {
                    lock_held: false,
                    pid_alive: true,
                    ..facts()
                },
                Stale,
                Some(RuntimeLockStale),
                false,
                false,
            ),
            (
                "clean exit",
                Facts {
                    record: Some((RecordState::Stopped, "i1".into())),
                    lock_held: false,
                    lock_holder: None,
                    pid_alive: false,
                    probe: Probe::Unreachable,
                    ..facts()
                },
                Stopped,
                None,
                false,
                false,
            ),
            (
                "no state dir",
                Facts {
                    state_dir_exists: false,
                    record: None,
                    lock_held: false,
                    lock_holder: None,
                    pid_alive: false,
                    probe: Probe::Unreachable,
                },
                NotStarted,
                Some(RuntimeNotStarted),
                false,
                false,
            ),
            (
                "held, record not written yet",
                Facts {
                    record: None,
                    ..facts()
                },
                Starting,
                None,
                true,
                false,
            ),
            (
                "held, record of the previous instance",
                Facts {
                    record: Some((RecordState::Stopped, "i0".into())),
                    ..facts()
                },
                Starting,
                None,
                true,
                false,
            ),
            (
                "held, lock contents not written yet",
                Facts {
                    lock_holder: None,
                    ..facts()
                },
                Starting,
                None,
                true,
                false,
            ),
            (
                "held, named pid dead",
                Facts {
                    pid_alive: false,
                    ..facts()
                },
                Unreachable,
                Some(RuntimeLockHolderDead),
                true,
                false,
            ),
        ];
        for (name, f, state, code, running, ready) in cases {
            let a = assess(&f);
            assert_eq!(a.state, state, "{name}");
            assert_eq!(a.failure_code, code, "{name}");
            assert_eq!((a.running, a.ready), (running, ready), "{name}");
            assert_eq!(
                a.pid.is_some(),
                running && f.lock_holder.is_some() && f.pid_alive,
                "{name}"
            );
        }
    }

    #[test]
    fn start_and_stop_are_blocked_with_the_seed_reasons() {
        let running = assess(&facts());
        let p = plans("local", true, &running);
        assert_eq!(p.start.availability, Availability::Blocked);
        assert_eq!(p.start.reason_code.as_deref(), Some(REASON_ALREADY_RUNNING));
        assert_eq!(p.stop.availability, Availability::Available);
        let stopped = assess(&Facts {
            state_dir_exists: false,
            ..facts()
        });
        let p = plans("local", true, &stopped);
        assert_eq!(p.start.availability, Availability::Available);
        assert_eq!(p.stop.availability, Availability::Blocked);
        assert_eq!(p.stop.reason_code.as_deref(), Some(REASON_NOT_STARTED));
        let p = plans("visor", false, &running);
        assert_eq!(p.start.availability, Availability::Unavailable);
        assert_eq!(p.restart.availability, Availability::Unavailable);
        assert_eq!(p.stop.availability, Availability::Available);
        assert_eq!(p.update.availability, Availability::Unavailable);
    }

    fn any_facts() -> impl Strategy<Value = Facts> {
        (
            any::<bool>(),
            prop::option::of((0..3u8, prop::bool::ANY)),
            any::<bool>(),
            prop::option::of(prop::bool::ANY),
            any::<bool>(),
            0..3u8,
        )
            .prop_map(|(dir, record, held, holder, alive, probe)| Facts {
                state_dir_exists: dir,
                record: record.map(|(s, same)| {
                    (
                        [
                            RecordState::Starting,
                            RecordState::Running,
                            RecordState::Stopped,
                        ][s as usize],
                        if same { "i1".into() } else { "i0".into() },
                    )
                }),
                lock_held: held,
                lock_holder: holder.map(|_| (7, "i1".into())),
                pid_alive: alive,
                probe: [Probe::NotApplicable, Probe::Reachable, Probe::Unreachable][probe as usize],
            })
    }

    proptest! {
        /// The invariants a caller relies on: ready implies running;
        /// running iff the flock is held (with a state dir); a failure
        /// code never comes with ready; start and stop are never both
        /// blocked for a startable target.
        #[test]
        fn invariants(f in any_facts()) {
            let a = assess(&f);
            prop_assert!(!a.ready || a.running);
            prop_assert_eq!(a.running, f.state_dir_exists && f.lock_held);
            prop_assert!(!(a.ready && a.failure_code.is_some()));
            prop_assert_eq!(a.state == RuntimeState::Running, a.ready);
            let p = plans("local", true, &a);
            prop_assert!(p.start.availability == Availability::Available
                || p.stop.availability == Availability::Available);
        }
    }
}

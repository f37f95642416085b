//! The target catalog and environment status: state dirs looked at
//! (`state::observe`), probed (`probe`), judged (`environment::assess`).
//!
//! Targets: `local` (`bmx up`) is always listed, `not_configured` until it
//! first runs; every other target exists by its state dir (`visor`,
//! `visor-<hash>`, `workspace-<hash>`).

use super::envelope::{ErrorCode, ResponseError};
use super::environment::{
    assess, describe, plans, target_status, Assessment, Diagnostics, EnvironmentStatus, Facts,
    Probe, RecordState, RuntimeSummary, TargetDescriptor, TargetStatus, KIND_LOCAL_ENVIRONMENT,
    KIND_LOCAL_HOST_RUNTIME,
};
use super::probe::{http_health, pid_running, unix_connects, PROBE_TIMEOUT};
use super::state::{
    list, observe, state_dir, valid_target_id, ControlProbe, Observation, RuntimeSpec, CONFIG_FILE,
    LOCAL_TARGET,
};
use std::path::Path;

/// Capabilities (the seed's names) of each runtime.
pub const LOCAL_CAPABILITIES: &[&str] =
    &["local_ui", "remote_control", "files", "terminal", "monitor"];
pub const VISOR_CAPABILITIES: &[&str] = &["terminal", "monitor"];
pub const WORKSPACE_CAPABILITIES: &[&str] = &["remote_control", "files", "terminal", "git"];

/// What `bmx up` writes to claim `local`.
pub fn local_spec() -> RuntimeSpec {
    RuntimeSpec {
        target_id: LOCAL_TARGET.into(),
        kind: KIND_LOCAL_HOST_RUNTIME,
        label: "bmx up: local harness and executor".into(),
        program: "bmx up",
        control_probe: ControlProbe::Http,
        capabilities: LOCAL_CAPABILITIES,
        workspace: None,
    }
}

/// What `bmx visor` writes.
pub fn visor_spec(target_id: String, home: &Path) -> RuntimeSpec {
    RuntimeSpec {
        target_id,
        kind: KIND_LOCAL_HOST_RUNTIME,
        label: format!("bmx visor ({})", home.display()),
        program: "bmx visor",
        control_probe: ControlProbe::Unix,
        capabilities: VISOR_CAPABILITIES,
        workspace: None,
    }
}

/// What a bound `bmx executor --workspace DIR` writes.
pub fn workspace_spec(canonical: &Path) -> RuntimeSpec {
    RuntimeSpec {
        target_id: super::state::workspace_target_id(canonical),
        kind: KIND_LOCAL_ENVIRONMENT,
        label: format!("bmx executor --workspace {}", canonical.display()),
        program: "bmx executor",
        control_probe: ControlProbe::None,
        capabilities: WORKSPACE_CAPABILITIES,
        workspace: Some(canonical.display().to_string()),
    }
}

/// Only `local` can be started in the background (it is `bmx up`).
pub fn startable(target_id: &str) -> bool {
    target_id == LOCAL_TARGET
}

/// One target, looked at and judged.
#[derive(Debug, Clone)]
pub struct Looked {
    pub descriptor: TargetDescriptor,
    pub observation: Observation,
    pub facts: Facts,
    pub assessment: Assessment,
}

fn facts_of(o: &Observation) -> Facts {
    let record = o.record.as_ref();
    let claims = record.filter(|r| r.state != RecordState::Stopped);
    let pid = o
        .lock
        .holder
        .as_ref()
        .map(|h| h.pid)
        .or(claims.map(|r| r.pid));
    let probe = match (o.lock.held, record) {
        (true, Some(r)) if r.state == RecordState::Running => {
            match (r.control_probe, r.control_socket_path.as_deref()) {
                (ControlProbe::None, _) => Probe::NotApplicable,
                (_, None) => Probe::Unreachable,
                (ControlProbe::Http, Some(a)) => {
                    if http_health(a, PROBE_TIMEOUT) {
                        Probe::Reachable
                    } else {
                        Probe::Unreachable
                    }
                }
                (ControlProbe::Unix, Some(p)) => {
                    if unix_connects(Path::new(p)) {
                        Probe::Reachable
                    } else {
                        Probe::Unreachable
                    }
                }
            }
        }
        (_, Some(r)) if r.control_probe == ControlProbe::None => Probe::NotApplicable,
        _ => Probe::Unreachable,
    };
    Facts {
        state_dir_exists: o.dir_exists,
        record: record.map(|r| (r.state, r.instance_id.clone())),
        lock_held: o.lock.held,
        lock_holder: o
            .lock
            .holder
            .as_ref()
            .map(|h| (h.pid, h.instance_id.clone())),
        pid_alive: pid.is_some_and(pid_running),
        probe,
    }
}

fn default_descriptor(root: &Path, id: &str) -> TargetDescriptor {
    let spec = if id == LOCAL_TARGET {
        Some(local_spec())
    } else {
        None
    };
    TargetDescriptor {
        id: id.into(),
        kind: spec
            .as_ref()
            .map_or(KIND_LOCAL_HOST_RUNTIME, |s| s.kind)
            .into(),
        label: spec
            .as_ref()
            .map_or_else(|| id.to_owned(), |s| s.label.clone()),
        status: TargetStatus::NotConfigured,
        state_root: root.display().to_string(),
        state_dir: state_dir(root, id).display().to_string(),
        config_path: None,
        runtime_control_socket_path: None,
        local_ui_url: None,
        capabilities: spec
            .map(|s| s.capabilities.iter().map(|c| c.to_string()).collect())
            .unwrap_or_default(),
        unavailable_reason_code: None,
    }
}

/// Look at target `id` under `root`.
///
/// # Errors
///
/// `TARGET_NOT_FOUND` for an id that is neither `local` nor a state dir;
/// `ENVIRONMENT_STATUS_FAILED` for a state dir that cannot be read or is
/// corrupt.
pub fn look(root: &Path, id: &str) -> Result<Looked, ResponseError> {
    let not_found = || {
        ResponseError::new(
            ErrorCode::TargetNotFound,
            format!("no target {id:?} (see bmx targets)"),
        )
    };
    if !valid_target_id(id) {
        return Err(not_found());
    }
    let dir = state_dir(root, id);
    let observation = observe(&dir)
        .map_err(|e| ResponseError::new(ErrorCode::EnvironmentStatus, e.to_string()))?;
    if !observation.dir_exists && id != LOCAL_TARGET {
        return Err(not_found());
    }
    let facts = facts_of(&observation);
    let assessment = assess(&facts);
    let mut descriptor = default_descriptor(root, id);
    if let Some(r) = &observation.record {
        descriptor.kind = r.kind.clone();
        descriptor.label = r.label.clone();
        descriptor.capabilities = r.capabilities.clone();
        descriptor.runtime_control_socket_path = r.control_socket_path.clone();
        descriptor.local_ui_url = r.local_ui_url.clone();
    }
    if observation.config.is_some() {
        descriptor.config_path = Some(dir.join(CONFIG_FILE).display().to_string());
    }
    descriptor.status = target_status(&assessment);
    Ok(Looked {
        descriptor,
        observation,
        facts,
        assessment,
    })
}

/// Every target: `local`, then each state dir, sorted. A state dir that
/// cannot be read is listed `configured` with `unavailable_reason_code:
/// state_unreadable` rather than failing the whole list.
///
/// # Errors
///
/// `TARGET_DISCOVERY_FAILED` when the state root cannot be listed.
pub fn discover(root: &Path) -> Result<Vec<TargetDescriptor>, ResponseError> {
    let mut ids = list(root).map_err(|e| {
        ResponseError::new(
            ErrorCode::TargetDiscoveryFailed,
            format!("{}: {e}", root.display()),
        )
    })?;
    ids.retain(|i| i != LOCAL_TARGET);
    ids.insert(0, LOCAL_TARGET.to_owned());
    Ok(ids
        .iter()
        .map(|id| match look(root, id) {
            Ok(l) => l.descriptor,
            Err(e) => {
                tracing::debug!(target = %id, error = %e, "unreadable state dir");
                let mut d = default_descriptor(root, id);
                d.status = TargetStatus::Configured;
                d.unavailable_reason_code = Some("state_unreadable".into());
                d
            }
        })
        .collect())
}

/// `EnvironmentStatus` of a looked-at target (`diagnose`: with the raw
/// facts).
pub fn environment_status(l: &Looked, diagnose: bool) -> EnvironmentStatus {
    let a = &l.assessment;
    let record = l.observation.record.as_ref();
    let running = a.running;
    let runtime = RuntimeSummary {
        state: a.state,
        ready: a.ready,
        running,
        pid: a.pid,
        runtime_version: record
            .filter(|_| running)
            .map(|r| r.runtime_version.clone()),
        local_ui_url: record
            .filter(|_| a.ready)
            .and_then(|r| r.local_ui_url.clone()),
        failure_code: a.failure_code,
        message: Some(describe(a).to_owned()),
    };
    let diagnostics = diagnose.then(|| Diagnostics {
        lock_path: l.observation.lock_path.display().to_string(),
        control_socket_path: record.and_then(|r| r.control_socket_path.clone()),
        lock_pid: l.observation.lock.holder.as_ref().map(|h| h.pid).or(record
            .filter(|r| r.state != RecordState::Stopped)
            .map(|r| r.pid)),
        lock_instance_id: l
            .observation
            .lock
            .holder
            .as_ref()
            .map(|h| h.instance_id.clone())
            .or(record
                .filter(|r| r.state != RecordState::Stopped)
                .map(|r| r.instance_id.clone())),
        lock_held: l.facts.lock_held,
        pid_alive: l.facts.pid_alive,
        socket_reachable: l.facts.probe == Probe::Reachable,
        failure_code: a.failure_code,
    });
    EnvironmentStatus {
        target: l.descriptor.clone(),
        supported: true,
        runtime,
        operations: plans(&l.descriptor.id, startable(&l.descriptor.id), a),
        operation: None,
        diagnostics,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::environment::RuntimeState;
    use crate::runner::state::RuntimeClaim;
    use serde_json::json;

    #[test]
    fn local_is_listed_before_it_ever_ran_and_others_only_by_state_dir() {
        let root = tempfile::tempdir().unwrap();
        let t = discover(root.path()).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].id, "local");
        assert_eq!(t[0].status, TargetStatus::NotConfigured);
        let l = look(root.path(), "local").unwrap();
        assert_eq!(l.assessment.state, RuntimeState::NotStarted);
        assert_eq!(
            look(root.path(), "visor").unwrap_err().code,
            ErrorCode::TargetNotFound
        );
        assert_eq!(
            look(root.path(), "../etc").unwrap_err().code,
            ErrorCode::TargetNotFound
        );
        let ws = tempfile::tempdir().unwrap();
        let mut c =
            RuntimeClaim::claim(root.path(), workspace_spec(ws.path()), &json!({})).unwrap();
        c.ready(None, None).unwrap();
        let id = c.record().target_id.clone();
        let l = look(root.path(), &id).unwrap();
        assert_eq!(l.assessment.state, RuntimeState::Running);
        assert_eq!(l.descriptor.kind, KIND_LOCAL_ENVIRONMENT);
        assert_eq!(l.descriptor.status, TargetStatus::Available);
        let s = environment_status(&l, true);
        assert_eq!(s.runtime.pid, Some(std::process::id()));
        assert!(s.diagnostics.unwrap().lock_held);
        drop(c);
        let t = discover(root.path()).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[1].status, TargetStatus::Configured);
        std::fs::write(state_dir(root.path(), &id).join("runtime.json"), b"[").unwrap();
        let t = discover(root.path()).unwrap();
        assert_eq!(
            t[1].unavailable_reason_code.as_deref(),
            Some("state_unreadable")
        );
        assert_eq!(
            look(root.path(), &id).unwrap_err().code,
            ErrorCode::EnvironmentStatus
        );
    }
}

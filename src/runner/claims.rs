//! The one or two calls each local runtime makes to appear in
//! `bmx targets`: claim its state dir at start, say when it is ready; the
//! claim's drop marks it stopped. A runtime whose state dir cannot be
//! claimed (another `bmx up` holds `local`) runs on without one, with a
//! warning: the state dir serves discovery and must not stop a runtime
//! that worked before it existed.

use super::probe::unix_connects;
use super::state::{claim_or_warn, state_root, RuntimeClaim, VISOR_TARGET};
use super::targets::{local_spec, visor_spec, workspace_spec};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `bmx up`: claim `local` with its flags as `config.json` (the port as
/// asked: 0 stays 0, so `bmx env restart` picks a free port again).
pub fn claim_local(
    requested_port: u16,
    executor_id: &str,
    work_root: Option<&Path>,
) -> Option<RuntimeClaim> {
    claim_or_warn(
        &state_root(),
        local_spec(),
        &json!({
            "program": "bmx up",
            "port": requested_port,
            "executor_id": executor_id,
            "work_root": work_root.map(|p| p.display().to_string()),
        }),
    )
}

/// `bmx up` listens at `addr` and its executor registered.
pub fn local_ready(claim: &mut Option<RuntimeClaim>, addr: std::net::SocketAddr) {
    if let Some(c) = claim {
        if let Err(e) = c.ready(Some(addr.to_string()), Some(format!("http://{addr}"))) {
            tracing::warn!(error = %e, "cannot mark the state dir running");
        }
    }
}

/// `bmx executor --workspace DIR` (canonical), claimed and marked ready
/// when the executor has started (it listens on nothing: its lock is all
/// there is to probe).
pub fn claim_workspace(canonical: &Path, harness: &str) -> Option<RuntimeClaim> {
    claim_or_warn(
        &state_root(),
        workspace_spec(canonical),
        &json!({
            "program": "bmx executor",
            "workspace": canonical.display().to_string(),
            "harness": harness,
        }),
    )
}

/// Mark a claim ready with no control socket.
pub fn ready_without_socket(claim: &mut Option<RuntimeClaim>) {
    if let Some(c) = claim {
        if let Err(e) = c.ready(None, None) {
            tracing::warn!(error = %e, "cannot mark the state dir running");
        }
    }
}

/// A visor's claim: marked ready by a task as soon as its socket accepts;
/// marked stopped when this is dropped (after `serve` returned).
pub struct VisorClaim {
    claim: Arc<Mutex<Option<RuntimeClaim>>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// `bmx visor` (serve) with this home and socket: target `visor` in
/// `<home>/state/` (the visor's home is the bmx home unless `--home` says
/// otherwise; one visor per home, so one `visor` per state root). Call
/// inside a tokio runtime, before serving.
pub fn claim_visor(home: &Path, socket: &Path) -> VisorClaim {
    let claim = claim_or_warn(
        &home.join("state"),
        visor_spec(VISOR_TARGET.to_owned(), home),
        &json!({
            "program": "bmx visor",
            "home": home.display().to_string(),
            "socket": socket.display().to_string(),
        }),
    );
    let present = claim.is_some();
    let claim = Arc::new(Mutex::new(claim));
    let task = present.then(|| {
        let claim = claim.clone();
        let socket: PathBuf = socket.to_owned();
        tokio::spawn(async move {
            // Up to a minute; a visor that never binds stays `starting`.
            for _ in 0..1200 {
                if unix_connects(&socket) {
                    if let Ok(mut c) = claim.lock() {
                        if let Some(c) = c.as_mut() {
                            if let Err(e) = c.ready(Some(socket.display().to_string()), None) {
                                tracing::warn!(error = %e, "cannot mark the state dir running");
                            }
                        }
                    }
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    });
    VisorClaim { claim, task }
}

impl Drop for VisorClaim {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        if let Ok(mut c) = self.claim.lock() {
            c.take();
        }
    }
}

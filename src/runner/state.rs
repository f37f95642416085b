//! State dirs: `<home>/state/<target-id>/`, one per local runtime bmx
//! starts (`bmx up`, `bmx visor`, `bmx executor --workspace`), so that
//! `bmx targets` and `bmx env` can find them and tell how they are.
//!
//! A state dir (0700) holds:
//!
//! * `lock`: flock held by the runtime for its whole life (the same lock
//!   as the workspace lock, [`super::lock`]); the file names the holder
//!   (pid, instance id, start time) and is emptied on a clean exit.
//! * `config.json`: how the runtime was started (its flags), written
//!   atomically once at start; `bmx env start|restart` reuses it.
//! * `runtime.json`: a [`RuntimeRecord`] (state `starting` → `running` →
//!   `stopped`, pid, instance id, control socket, local UI URL), written
//!   atomically at each change.
//! * `runtime.log`: stdout and stderr of a runtime `bmx env start` started.
//!
//! The kernel's flock says whether a runtime exists; the files say which
//! and where to reach it. A runtime killed with SIGKILL leaves its files
//! claiming `running` with a free flock: a stale lock, which
//! `bmx env diagnose` reports and the next runtime takes over.

use super::credentials::{bmx_home, write_atomic};
use super::environment::RecordState;
use super::lock::{probe, LockError, LockHolder, LockProbe, WorkspaceLock};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

pub const LOCK_FILE: &str = "lock";
pub const RUNTIME_FILE: &str = "runtime.json";
pub const CONFIG_FILE: &str = "config.json";
pub const LOG_FILE: &str = "runtime.log";

/// The target of `bmx up` (and the default of `bmx env`, `bmx status`).
pub const LOCAL_TARGET: &str = "local";
/// The target of `bmx visor`, in the state root of the visor's home
/// (`--home`, else the bmx home): one visor per home.
pub const VISOR_TARGET: &str = "visor";

/// Largest state file read: real ones are < 2 KiB.
const MAX_FILE_BYTES: u64 = 64 * 1024;

/// `<home>/state`, home being `$BMX_HOME`, else `~/.bmx` (the same home as
/// the credential store and the harness's default data dir).
pub fn state_root() -> PathBuf {
    bmx_home().join("state")
}

/// The state dir of `target_id` under `root`.
pub fn state_dir(root: &Path, target_id: &str) -> PathBuf {
    root.join(target_id)
}

fn short_hash(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// `workspace-<16 hex of SHA-256(canonical path)>`: stable for one
/// directory, whatever path or symlink it was named by.
pub fn workspace_target_id(canonical: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    format!("workspace-{}", short_hash(canonical.as_os_str().as_bytes()))
}

/// Target ids are file names: lower-case letters, digits and `-`, 1 to
/// 64 of them. Anything else under the state root is not a target.
pub fn valid_target_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// How a runtime's control socket is probed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlProbe {
    /// `HOST:PORT` of an HTTP API; `GET /v1/health` must answer 200.
    Http,
    /// A Unix socket path; a connect must succeed.
    Unix,
    /// Nothing listens (a bound executor dials out).
    None,
}

/// `runtime.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeRecord {
    pub target_id: String,
    pub kind: String,
    pub label: String,
    /// `bmx up`, `bmx visor`, `bmx executor`.
    pub program: String,
    pub state: RecordState,
    pub pid: u32,
    pub instance_id: String,
    pub started_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_at: Option<String>,
    pub runtime_version: String,
    pub control_probe: ControlProbe,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_socket_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_ui_url: Option<String>,
    pub capabilities: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
}

/// What a runtime says about itself when it claims its state dir.
#[derive(Debug, Clone)]
pub struct RuntimeSpec {
    pub target_id: String,
    pub kind: &'static str,
    pub label: String,
    pub program: &'static str,
    pub control_probe: ControlProbe,
    pub capabilities: &'static [&'static str],
    pub workspace: Option<String>,
}

/// Why a state dir could not be claimed or read.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Another live runtime holds this state dir.
    #[error(transparent)]
    Held(LockError),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: corrupt: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error("{}: missing (the state dir is incomplete; remove it if no runtime uses it)", path.display())]
    Missing { path: PathBuf },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.to_owned(),
        source,
    }
}

fn write_json(path: &Path, v: &impl Serialize) -> Result<(), StateError> {
    let mut text = serde_json::to_vec_pretty(v).map_err(|e| StateError::Corrupt {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    text.push(b'\n');
    write_atomic(path, &text).map_err(io(path))
}

/// A runtime's hold on its state dir: the lock is held while this lives;
/// dropping it marks the record `stopped` and empties the lock file, so a
/// clean exit never reads as a crash.
#[derive(Debug)]
pub struct RuntimeClaim {
    dir: PathBuf,
    lock: WorkspaceLock,
    record: RuntimeRecord,
}

impl RuntimeClaim {
    /// Create `<root>/<target>/` (0700), take its lock, write `config.json`
    /// and a `starting` record.
    ///
    /// # Errors
    ///
    /// [`StateError::Held`] when another live runtime holds it; I/O errors
    /// otherwise. Callers run on without a state dir (and say so): the
    /// state dir is for discovery, not a reason to refuse to run.
    pub fn claim(
        root: &Path,
        spec: RuntimeSpec,
        config: &Value,
    ) -> Result<RuntimeClaim, StateError> {
        let dir = state_dir(root, &spec.target_id);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(io(&dir))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock =
            match WorkspaceLock::acquire_at(&lock_path, LockHolder::this_process(spec.program)) {
                Ok(l) => l,
                Err(e @ LockError::Held { .. }) => return Err(StateError::Held(e)),
                Err(LockError::Io { path, source }) => return Err(StateError::Io { path, source }),
            };
        let holder = lock.holder().clone();
        let record = RuntimeRecord {
            target_id: spec.target_id,
            kind: spec.kind.into(),
            label: spec.label,
            program: spec.program.into(),
            state: RecordState::Starting,
            pid: holder.pid,
            instance_id: holder.instance_id,
            started_at: holder.started_at,
            stopped_at: None,
            runtime_version: env!("CARGO_PKG_VERSION").into(),
            control_probe: spec.control_probe,
            control_socket_path: None,
            local_ui_url: None,
            capabilities: spec.capabilities.iter().map(|s| s.to_string()).collect(),
            workspace: spec.workspace,
        };
        write_json(&dir.join(CONFIG_FILE), config)?;
        write_json(&dir.join(RUNTIME_FILE), &record)?;
        tracing::info!(dir = %dir.display(), target = %record.target_id, "state dir claimed");
        Ok(RuntimeClaim { dir, lock, record })
    }

    /// The runtime listens: record where (`control_socket_path` as its
    /// probe reads it) and its UI URL, state `running`.
    ///
    /// # Errors
    ///
    /// Writing `runtime.json` failed.
    pub fn ready(
        &mut self,
        control_socket_path: Option<String>,
        local_ui_url: Option<String>,
    ) -> Result<(), StateError> {
        self.record.control_socket_path = control_socket_path;
        self.record.local_ui_url = local_ui_url;
        self.record.state = RecordState::Running;
        write_json(&self.dir.join(RUNTIME_FILE), &self.record)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn record(&self) -> &RuntimeRecord {
        &self.record
    }
}

impl Drop for RuntimeClaim {
    fn drop(&mut self) {
        self.record.state = RecordState::Stopped;
        self.record.stopped_at = Some(super::lock::now_rfc3339());
        if let Err(e) = write_json(&self.dir.join(RUNTIME_FILE), &self.record) {
            tracing::warn!(error = %e, "cannot mark the state dir stopped");
        }
        if let Err(e) = self.lock.clear() {
            tracing::warn!(error = %e, "cannot empty the state dir's lock file");
        }
    }
}

/// Claim a state dir under `root`, or log why not and go on without one.
pub fn claim_or_warn(root: &Path, spec: RuntimeSpec, config: &Value) -> Option<RuntimeClaim> {
    let target = spec.target_id.clone();
    match RuntimeClaim::claim(root, spec, config) {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!(target = %target, error = %e, "running without a state dir: bmx targets and bmx env will not see this runtime");
            None
        }
    }
}

/// A state dir as found on disk, not yet judged.
#[derive(Debug, Clone)]
pub struct Observation {
    pub dir: PathBuf,
    pub dir_exists: bool,
    pub lock_path: PathBuf,
    pub lock: LockProbe,
    pub record: Option<RuntimeRecord>,
    pub config: Option<Value>,
}

fn read_small(path: &Path) -> Result<Option<Vec<u8>>, StateError> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(path)(e)),
    };
    let mut buf = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(io(path))?;
    if buf.len() as u64 > MAX_FILE_BYTES {
        return Err(StateError::Corrupt {
            path: path.to_owned(),
            reason: format!("larger than {MAX_FILE_BYTES} bytes"),
        });
    }
    Ok(Some(buf))
}

fn parse<T: serde::de::DeserializeOwned>(path: &Path, bytes: &[u8]) -> Result<T, StateError> {
    serde_json::from_slice(bytes).map_err(|e| StateError::Corrupt {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

/// Read the state dir `dir` without changing it.
///
/// # Errors
///
/// [`StateError::Corrupt`] for a file that does not parse (a lock file
/// with garbage while nobody holds it, a `runtime.json` or `config.json`
/// that is not what bmx writes), [`StateError::Missing`] for a state dir
/// without its `runtime.json` or `config.json` when no runtime holds it
/// (one that holds it may not have written them yet), I/O errors.
pub fn observe(dir: &Path) -> Result<Observation, StateError> {
    let lock_path = dir.join(LOCK_FILE);
    let mut o = Observation {
        dir: dir.to_owned(),
        dir_exists: false,
        lock_path: lock_path.clone(),
        lock: LockProbe {
            exists: false,
            held: false,
            holder: None,
        },
        record: None,
        config: None,
    };
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => o.dir_exists = true,
        Ok(_) => {
            return Err(StateError::Corrupt {
                path: dir.to_owned(),
                reason: "not a directory".into(),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(o),
        Err(e) => return Err(io(dir)(e)),
    }
    o.lock = probe(&lock_path).map_err(io(&lock_path))?;
    if !o.lock.held && o.lock.holder.is_none() {
        // Empty after a clean exit; anything else must parse.
        let len = std::fs::metadata(&lock_path).map(|m| m.len()).unwrap_or(0);
        if len > 0 {
            return Err(StateError::Corrupt {
                path: lock_path,
                reason: "not a lock file bmx wrote".into(),
            });
        }
    }
    let runtime_path = dir.join(RUNTIME_FILE);
    let config_path = dir.join(CONFIG_FILE);
    o.record = match read_small(&runtime_path)? {
        Some(b) => Some(parse(&runtime_path, &b)?),
        None => None,
    };
    o.config = match read_small(&config_path)? {
        Some(b) => Some(parse(&config_path, &b)?),
        None => None,
    };
    if !o.lock.held {
        if !o.lock.exists {
            return Err(StateError::Missing { path: lock_path });
        }
        if o.record.is_none() {
            return Err(StateError::Missing { path: runtime_path });
        }
        if o.config.is_none() {
            return Err(StateError::Missing { path: config_path });
        }
    }
    Ok(o)
}

/// The target ids with a state dir under `root`, sorted.
///
/// # Errors
///
/// The root exists but cannot be listed.
pub fn list(root: &Path) -> std::io::Result<Vec<String>> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut ids = Vec::new();
    for entry in entries {
        let entry = entry?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if valid_target_id(&name) && entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            ids.push(name);
        }
    }
    ids.sort();
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec() -> RuntimeSpec {
        RuntimeSpec {
            target_id: "t-1".into(),
            kind: "local_host_runtime",
            label: "test".into(),
            program: "bmx test",
            control_probe: ControlProbe::None,
            capabilities: &["files"],
            workspace: None,
        }
    }

    #[test]
    fn claim_ready_drop_leaves_a_stopped_dir() {
        let root = tempfile::tempdir().unwrap();
        let dir = state_dir(root.path(), "t-1");
        assert!(!observe(&dir).unwrap().dir_exists);
        let mut c = RuntimeClaim::claim(root.path(), spec(), &json!({"port": 0})).unwrap();
        let o = observe(&dir).unwrap();
        assert!(o.lock.held);
        assert_eq!(o.record.as_ref().unwrap().state, RecordState::Starting);
        c.ready(None, Some("http://x".into())).unwrap();
        let o = observe(&dir).unwrap();
        assert_eq!(o.record.as_ref().unwrap().state, RecordState::Running);
        assert_eq!(
            o.lock.holder.as_ref().unwrap().instance_id,
            c.record().instance_id
        );
        assert!(matches!(
            RuntimeClaim::claim(root.path(), spec(), &json!({})),
            Err(StateError::Held(_))
        ));
        drop(c);
        let o = observe(&dir).unwrap();
        assert!(!o.lock.held && o.lock.holder.is_none());
        assert_eq!(o.record.unwrap().state, RecordState::Stopped);
        assert_eq!(o.config.unwrap()["port"], 0);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }

    #[test]
    fn corrupt_and_missing_files_are_errors_not_panics() {
        let root = tempfile::tempdir().unwrap();
        let dir = state_dir(root.path(), "t-1");
        drop(RuntimeClaim::claim(root.path(), spec(), &json!({})).unwrap());
        std::fs::write(dir.join(RUNTIME_FILE), b"{not json").unwrap();
        assert!(matches!(observe(&dir), Err(StateError::Corrupt { .. })));
        std::fs::remove_file(dir.join(RUNTIME_FILE)).unwrap();
        assert!(matches!(observe(&dir), Err(StateError::Missing { .. })));
        drop(RuntimeClaim::claim(root.path(), spec(), &json!({})).unwrap());
        std::fs::write(dir.join(LOCK_FILE), b"\x00\xff garbage").unwrap();
        assert!(matches!(observe(&dir), Err(StateError::Corrupt { .. })));
        std::fs::write(dir.join(LOCK_FILE), b"").unwrap();
        std::fs::write(dir.join(CONFIG_FILE), vec![b' '; 100_000]).unwrap();
        assert!(matches!(observe(&dir), Err(StateError::Corrupt { .. })));
    }

    #[test]
    fn ids() {
        let a = workspace_target_id(Path::new("/a/b"));
        assert!(valid_target_id(&a) && a.starts_with("workspace-") && a.len() == 26);
        assert_ne!(a, workspace_target_id(Path::new("/a/c")));
        assert!(valid_target_id("local") && valid_target_id("visor"));
        assert!(!valid_target_id("../x") && !valid_target_id("") && !valid_target_id("A"));
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("local")).unwrap();
        std::fs::create_dir(root.path().join("Not.A.Target")).unwrap();
        std::fs::write(root.path().join("file"), b"").unwrap();
        assert_eq!(list(root.path()).unwrap(), vec!["local".to_string()]);
        assert!(list(&root.path().join("absent")).unwrap().is_empty());
    }
}

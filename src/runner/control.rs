//! `bmx env start|stop`: start `bmx up` as a daemon and wait until it is
//! ready; stop a runtime and wait until it and everything it started are
//! gone. Every wait has a deadline.
//!
//! * Start: `bmx up --port P` (P: `--port`, else the `port` of the state
//!   dir's `config.json`, else 7070; 0 picks a free port, which the
//!   runtime writes to `runtime.json`) in a new session (`setsid`), stdin
//!   from /dev/null, stdout and stderr appended to `runtime.log` in the
//!   state dir, with the same `BMX_HOME`. Ready = the state dir names this
//!   child as the lock holder, `running`, and `GET /v1/health` answers.
//! * Stop: SIGTERM to the lock holder; after the grace period SIGKILL to
//!   it and its process group; then every process still in its session
//!   (a daemon is a session leader) is killed; done when the pid is gone
//!   and the flock is free.

use super::envelope::{ErrorCode, ResponseError};
use super::lock::probe as probe_lock;
use super::probe::{pid_running, session_members};
use super::state::{state_dir, CONFIG_FILE, LOCAL_TARGET, LOG_FILE};
use super::targets::look;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `bmx up`'s own default port.
pub const DEFAULT_PORT: u16 = 7070;
/// How long `start` waits for readiness.
pub const START_DEADLINE: Duration = Duration::from_secs(30);
/// How long `stop` waits after SIGTERM before SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(20);
/// How long after SIGKILL before giving up.
const KILL_DEADLINE: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(100);
/// Bytes of `runtime.log` quoted in a failed start's message.
const LOG_TAIL_BYTES: u64 = 2048;

fn op_err(message: impl Into<String>) -> ResponseError {
    ResponseError::new(ErrorCode::EnvironmentOperation, message)
}

/// The port `start` uses: the flag, else the last config's, else 7070.
pub fn choose_port(root: &Path, flag: Option<u16>) -> u16 {
    if let Some(p) = flag {
        return p;
    }
    let path = state_dir(root, LOCAL_TARGET).join(CONFIG_FILE);
    std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["port"].as_u64())
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or(DEFAULT_PORT)
}

/// The last `LOG_TAIL_BYTES` of `runtime.log`, for error messages.
pub fn log_tail(dir: &Path) -> String {
    let path = dir.join(LOG_FILE);
    let Ok(mut f) = std::fs::File::open(&path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut buf = Vec::new();
    let _ = f.take(LOG_TAIL_BYTES).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).trim().to_owned()
}

fn with_tail(msg: String, dir: &Path) -> String {
    let tail = log_tail(dir);
    if tail.is_empty() {
        msg
    } else {
        format!("{msg}; {} ends with:\n{tail}", dir.join(LOG_FILE).display())
    }
}

fn kill(pid: i32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
}

/// Start `local` (`bmx up`) in the background and wait until it is ready.
/// The caller has checked that it is not running. Returns the daemon's pid.
///
/// # Errors
///
/// `ENVIRONMENT_OPERATION_FAILED` (with the log's tail) when it cannot be
/// spawned, exits early, or is not ready within `deadline` (then it is
/// killed, with its session).
#[tracing::instrument(skip_all, fields(port))]
pub fn start_local(
    exe: &Path,
    home: &Path,
    root: &Path,
    port: u16,
    deadline: Duration,
) -> Result<u32, ResponseError> {
    let dir = state_dir(root, LOCAL_TARGET);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| op_err(format!("{}: {e}", dir.display())))?;
    let log_path = dir.join(LOG_FILE);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(&log_path)
        .map_err(|e| op_err(format!("{}: {e}", log_path.display())))?;
    let log2 = log
        .try_clone()
        .map_err(|e| op_err(format!("{}: {e}", log_path.display())))?;
    let mut cmd = Command::new(exe);
    cmd.args(["up", "--port", &port.to_string()])
        .env("BMX_HOME", home)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2));
    // SAFETY: setsid is async-signal-safe; the child is not a group
    // leader right after fork, so it cannot fail with EPERM.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| op_err(format!("cannot run {} up: {e}", exe.display())))?;
    let pid = child.id();
    tracing::info!(pid, port, log = %log_path.display(), "bmx up started in the background");
    let started = Instant::now();
    let give_up = |child: &mut std::process::Child, why: String| {
        if let Ok(p) = i32::try_from(pid) {
            kill(-p, nix::sys::signal::Signal::SIGKILL);
        }
        let _ = child.kill();
        let _ = child.wait();
        Err(op_err(with_tail(why, &dir)))
    };
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return Err(op_err(with_tail(
                    format!("bmx up exited before it was ready ({status})"),
                    &dir,
                )))
            }
            Ok(None) => {}
            Err(e) => return give_up(&mut child, format!("cannot watch bmx up: {e}")),
        }
        if let Ok(l) = look(root, LOCAL_TARGET) {
            let holder = l.observation.lock.holder.as_ref().map(|h| h.pid);
            if l.observation.lock.held && holder.is_some_and(|h| h != pid) {
                return give_up(
                    &mut child,
                    format!(
                        "another runtime (pid {}) holds {}",
                        holder.unwrap_or(0),
                        l.observation.lock_path.display()
                    ),
                );
            }
            if l.assessment.ready && holder == Some(pid) {
                return Ok(pid);
            }
        }
        if started.elapsed() > deadline {
            return give_up(
                &mut child,
                format!(
                    "bmx up (pid {pid}) was not ready within {} s",
                    deadline.as_secs()
                ),
            );
        }
        std::thread::sleep(POLL);
    }
}

/// What `stop` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stopped {
    pub pid: u32,
    /// SIGTERM was not enough.
    pub killed: bool,
    /// Processes of its session that outlived it and were killed.
    pub leftovers_killed: usize,
}

/// Stop the runtime holding the lock of `dir` (the caller has checked it
/// is running): SIGTERM, wait up to `grace`, SIGKILL, then kill what is
/// left of its session; returns when the pid is gone and the lock free.
///
/// # Errors
///
/// `ENVIRONMENT_OPERATION_FAILED` when the lock names no pid, or the
/// runtime (or a process of its session) survives SIGKILL.
#[tracing::instrument(skip_all, fields(dir = %dir.display()))]
pub fn stop(dir: &Path, grace: Duration) -> Result<Stopped, ResponseError> {
    let lock_path = dir.join(super::state::LOCK_FILE);
    let lock =
        probe_lock(&lock_path).map_err(|e| op_err(format!("{}: {e}", lock_path.display())))?;
    let Some(holder) = lock.holder.filter(|_| lock.held) else {
        return Err(op_err(format!(
            "{} is held but names no pid: cannot tell what to stop",
            lock_path.display()
        )));
    };
    let pid = i32::try_from(holder.pid)
        .ok()
        .filter(|p| *p > 1)
        .ok_or_else(|| op_err(format!("the lock names pid {}", holder.pid)))?;
    let gone =
        || !pid_running(holder.pid) && probe_lock(&lock_path).map(|p| !p.held).unwrap_or(false);
    let wait = |limit: Duration| {
        let t = Instant::now();
        while t.elapsed() < limit {
            if gone() {
                return true;
            }
            std::thread::sleep(POLL);
        }
        gone()
    };
    tracing::info!(pid, "SIGTERM");
    kill(pid, nix::sys::signal::Signal::SIGTERM);
    let mut killed = false;
    if !wait(grace) {
        tracing::warn!(pid, "still running after SIGTERM: SIGKILL");
        killed = true;
        kill(pid, nix::sys::signal::Signal::SIGKILL);
        kill(-pid, nix::sys::signal::Signal::SIGKILL);
        if !wait(KILL_DEADLINE) {
            return Err(op_err(format!("pid {pid} survived SIGKILL")));
        }
    }
    let left = session_members(holder.pid);
    for p in &left {
        if let Ok(p) = i32::try_from(*p) {
            kill(p, nix::sys::signal::Signal::SIGKILL);
        }
    }
    let t = Instant::now();
    while !session_members(holder.pid).is_empty() {
        if t.elapsed() > KILL_DEADLINE {
            return Err(op_err(format!(
                "processes of the runtime's session survived: {:?}",
                session_members(holder.pid)
            )));
        }
        std::thread::sleep(POLL);
    }
    Ok(Stopped {
        pid: holder.pid,
        killed,
        leftovers_killed: left.len(),
    })
}

/// The `bmx` binary to start (`bmx env start` starts its own binary).
///
/// # Errors
///
/// The running executable cannot be found.
pub fn current_exe() -> Result<PathBuf, ResponseError> {
    std::env::current_exe().map_err(|e| op_err(format!("cannot find the bmx binary: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_choice_falls_back_in_order() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(choose_port(root.path(), None), DEFAULT_PORT);
        assert_eq!(choose_port(root.path(), Some(0)), 0);
        let dir = state_dir(root.path(), LOCAL_TARGET);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(CONFIG_FILE), br#"{"port": 9123}"#).unwrap();
        assert_eq!(choose_port(root.path(), None), 9123);
        std::fs::write(dir.join(CONFIG_FILE), br#"{"port": 99999}"#).unwrap();
        assert_eq!(choose_port(root.path(), None), DEFAULT_PORT);
        std::fs::write(dir.join(CONFIG_FILE), b"garbage").unwrap();
        assert_eq!(choose_port(root.path(), None), DEFAULT_PORT);
    }

    #[test]
    fn log_tail_is_the_end() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(log_tail(dir.path()), "");
        let mut text = "x".repeat(5000);
        text.push_str("\nthe end\n");
        std::fs::write(dir.path().join(LOG_FILE), text).unwrap();
        let t = log_tail(dir.path());
        assert!(t.ends_with("the end") && t.len() <= LOG_TAIL_BYTES as usize);
    }
}

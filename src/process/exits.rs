//! Exit statuses of the session processes, without a file descriptor per
//! process.
//!
//! Why not `tokio::process::Child::wait`: on Linux tokio watches each child
//! through a pidfd, one more open file per process on top of its output
//! pipe. An executor holding 1 000 sessions × 10 processes then needs 20 000
//! descriptors, and `RLIMIT_NOFILE` is often exactly that (and only root
//! with `CAP_SYS_RESOURCE` may raise the hard limit). Here the pipe is the
//! only descriptor a process costs.
//!
//! How: processes are spawned with `std` (no pidfd) and registered here
//! under the same lock as [`super::sys::spawn_owned`] uses, so the orphan
//! reaper leaves them alone. One thread (not a task: it must outlive any
//! one tokio runtime, and a program may run several) wakes on `SIGCHLD`
//! through a self-pipe written by a signal-safe handler (and every second,
//! as a safety net) and *peeks* at exited children with
//! `waitid(P_ALL, WNOWAIT)`: a registered pid is reaped with `waitpid` and
//! its status sent to its owner; that is O(exited children). A zombie that
//! is not ours (a tool's or a terminal's child, which tokio reaps itself)
//! cannot be stepped over by a peek, so that round falls back to one
//! `waitpid(pid, WNOHANG)` per registered process.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::{Mutex, OnceLock};
use tokio::sync::oneshot;

/// Registered children: pid → where its exit status goes.
static WAITING: Mutex<Option<HashMap<i32, oneshot::Sender<ExitStatus>>>> = Mutex::new(None);

/// The write end of the watcher's self-pipe (raw: the signal handler uses
/// it, and it lives as long as the process).
static WAKE: OnceLock<RawFd> = OnceLock::new();

/// A process's exit, delivered once.
pub type Exit = oneshot::Receiver<ExitStatus>;

/// Spawn `cmd` (its descriptors are set up by the caller) and watch its exit.
pub fn spawn(cmd: &mut std::process::Command) -> std::io::Result<(u32, Exit)> {
    let wake = watcher()?;
    super::sys::inherit_only_stdio(cmd);
    let (tx, rx) = oneshot::channel();
    let pid = super::sys::spawn_owned(|| {
        let child = cmd.spawn()?;
        let pid = child.id();
        // Dropping a std `Child` neither waits for nor kills it.
        Ok((pid, pid))
    })?;
    lock()
        .get_or_insert_with(HashMap::new)
        .insert(pid as i32, tx);
    // The child may already have exited, its SIGCHLD spent on a sweep that
    // did not know it yet: sweep again.
    poke(wake);
    Ok((pid, rx))
}

/// Async-signal-safe: one write(2) to a non-blocking pipe (a full pipe
/// already means "wake up").
fn poke(fd: RawFd) {
    // SAFETY: writing one byte from a static buffer.
    unsafe { libc::write(fd, b"x".as_ptr().cast(), 1) };
}

fn lock() -> std::sync::MutexGuard<'static, Option<HashMap<i32, oneshot::Sender<ExitStatus>>>> {
    WAITING.lock().unwrap_or_else(|p| p.into_inner())
}

/// Start the watcher thread once; its self-pipe's write end.
fn watcher() -> std::io::Result<RawFd> {
    static STARTED: Mutex<()> = Mutex::new(());
    if let Some(&fd) = WAKE.get() {
        return Ok(fd);
    }
    let _once = STARTED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&fd) = WAKE.get() {
        return Ok(fd);
    }
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)?;
    let wfd = w.as_raw_fd();
    // SAFETY: the action only calls write(2), which is async-signal-safe.
    unsafe { signal_hook_registry::register(libc::SIGCHLD, move || poke(wfd)) }
        .map_err(std::io::Error::other)?;
    std::thread::Builder::new()
        .name("bmx-exits".into())
        .spawn(move || watch(r))?;
    // The write end lives as long as the process: the handler may run
    // at any time.
    std::mem::forget(w);
    let _ = WAKE.set(wfd);
    Ok(wfd)
}

/// The watcher thread: sweep, then sleep until a SIGCHLD, a registration
/// or a second has passed.
fn watch(wake: OwnedFd) {
    let mut buf = [0u8; 64];
    loop {
        sweep();
        let mut pfd = [nix::poll::PollFd::new(
            wake.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let _ = nix::poll::poll(&mut pfd, nix::poll::PollTimeout::from(1000u16));
        while matches!(nix::unistd::read(wake.as_fd(), &mut buf), Ok(n) if n > 0) {}
    }
}

/// Reap every registered child that has exited.
fn sweep() {
    let mut guard = lock();
    let Some(waiting) = guard.as_mut().filter(|w| !w.is_empty()) else {
        return;
    };
    let mut foreign = false;
    loop {
        // SAFETY: waitid writes into the zeroed local siginfo only.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let rc = unsafe {
            libc::waitid(
                libc::P_ALL,
                0,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        // SAFETY: si_pid is valid for a WEXITED siginfo (0: none exited).
        let pid = if rc == 0 { unsafe { info.si_pid() } } else { 0 };
        if pid == 0 {
            break;
        }
        if !reap(waiting, pid) {
            foreign = true;
            break;
        }
    }
    if foreign {
        let pids: Vec<i32> = waiting.keys().copied().collect();
        for pid in pids {
            reap(waiting, pid);
        }
    }
}

/// Reap `pid` if it is registered and has exited; false if it is not ours
/// or still running.
fn reap(waiting: &mut HashMap<i32, oneshot::Sender<ExitStatus>>, pid: i32) -> bool {
    if !waiting.contains_key(&pid) {
        return false;
    }
    let mut status = 0;
    // SAFETY: waitpid on one specific child; status is a local.
    let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    if rc != pid {
        return false;
    }
    if let Some(tx) = waiting.remove(&pid) {
        let _ = tx.send(ExitStatus::from_raw(status));
    }
    super::sys::release_owned(pid as u32);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn exit_codes_and_signals_arrive_without_a_pidfd() {
        let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
        let mut exits = Vec::new();
        for code in 0..20 {
            let mut cmd = std::process::Command::new("sh");
            cmd.arg("-c").arg(format!("exit {code}"));
            exits.push((code, spawn(&mut cmd).unwrap().1));
        }
        // A foreign child (tokio's own) exiting in between must not stall
        // the watcher.
        let foreign = tokio::process::Command::new("true").status();
        let mut sleeper = std::process::Command::new("sleep");
        sleeper.arg("300");
        // Other tests in this binary open and close descriptors at the same
        // time: ten processes holding one each would show as +10.
        let before = fds();
        let (pid, killed) = spawn(&mut sleeper).unwrap();
        let more: Vec<(u32, Exit)> = (0..10)
            .map(|_| {
                let mut s = std::process::Command::new("sleep");
                s.arg("300");
                spawn(&mut s).unwrap()
            })
            .collect();
        assert!(fds() < before + 5, "no descriptor held per process");
        for (p, _) in &more {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*p as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        assert!(foreign.await.unwrap().success());
        for (code, exit) in exits {
            let status = tokio::time::timeout(Duration::from_secs(20), exit)
                .await
                .expect("exit delivered")
                .unwrap();
            assert_eq!(status.code(), Some(code));
        }
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let status = tokio::time::timeout(Duration::from_secs(20), killed)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }
}

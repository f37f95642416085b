//! The exit of a child started by [`super::spawn`], watched through its
//! pidfd.
//!
//! Why a pidfd per child (issue 48): the watcher before this one woke on
//! `SIGCHLD` and peeked with `waitid(P_ALL, WNOWAIT)`, which makes the
//! kernel walk every child of the executor for each exit
//! (`wait_consider_task`: a tenth of the CPU while 10 000 processes
//! started). A pidfd becomes readable when its process exits, so tokio's
//! reactor wakes exactly the one waiter, which reaps exactly that child
//! with `waitid(P_PIDFD)`. The price is one descriptor per live process
//! on top of its output pipe; the executor raises `RLIMIT_NOFILE` to the
//! hard limit at start (`sys::raise_nofile_limit`).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

/// A child's exit, to be awaited once. Dropped unawaited, the child is
/// still reaped (by a task, or a thread outside a runtime), never left a
/// zombie.
#[derive(Debug)]
pub struct Exit {
    pid: u32,
    pidfd: Option<OwnedFd>,
}

impl Exit {
    pub(super) fn new(pid: u32, pidfd: OwnedFd) -> Exit {
        Exit {
            pid,
            pidfd: Some(pidfd),
        }
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The child's pidfd, e.g. for `pidfd_send_signal` (no pid reuse
    /// race while the child is unreaped).
    pub fn pidfd(&self) -> Option<&OwnedFd> {
        self.pidfd.as_ref()
    }

    /// Reap the child if it has exited, without waiting.
    ///
    /// # Errors
    /// A `waitid` failure other than "still running".
    pub fn reap_now(&self) -> std::io::Result<Option<ExitStatus>> {
        match &self.pidfd {
            Some(fd) => {
                let status = try_reap(fd)?;
                if status.is_some() {
                    super::sys::release_owned(self.pid);
                }
                Ok(status)
            }
            None => Ok(None),
        }
    }

    /// Wait for the child to exit and reap it.
    ///
    /// # Errors
    /// When the pidfd cannot be watched or `waitid` fails.
    pub async fn wait(mut self) -> std::io::Result<ExitStatus> {
        let fd = self
            .pidfd
            .take()
            .ok_or_else(|| std::io::Error::other("exit already reaped"))?;
        let pid = self.pid;
        let status = wait_fd(fd).await;
        super::sys::release_owned(pid);
        status
    }
}

async fn wait_fd(fd: OwnedFd) -> std::io::Result<ExitStatus> {
    if let Some(status) = try_reap(&fd)? {
        return Ok(status);
    }
    // SAFETY: the OwnedFd is moved into the AsyncFd, which keeps it open
    // (the same pidfd) for as long as it is registered.
    let afd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
    }
    .map_err(|e| e.into_parts().1)?;
    loop {
        let mut ready = afd.readable().await?;
        if let Some(status) = try_reap(afd.get_ref())? {
            return Ok(status);
        }
        ready.clear_ready();
    }
}

impl Drop for Exit {
    fn drop(&mut self) {
        let Some(fd) = self.pidfd.take() else {
            return;
        };
        let pid = self.pid;
        if matches!(try_reap(&fd), Ok(Some(_))) {
            super::sys::release_owned(pid);
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    let _ = wait_fd(fd).await;
                    super::sys::release_owned(pid);
                });
            }
            Err(_) => {
                let _ = std::thread::Builder::new()
                    .name("bmx-reap".into())
                    .spawn(move || {
                        let _ = reap_blocking(&fd);
                        super::sys::release_owned(pid);
                    });
            }
        }
    }
}

/// `waitid(P_PIDFD, WNOHANG)`: the status if the child has exited.
fn try_reap(fd: &OwnedFd) -> std::io::Result<Option<ExitStatus>> {
    waitid(fd, libc::WEXITED | libc::WNOHANG | libc::__WALL)
}

fn reap_blocking(fd: &OwnedFd) -> std::io::Result<Option<ExitStatus>> {
    waitid(fd, libc::WEXITED | libc::__WALL)
}

fn waitid(fd: &OwnedFd, options: libc::c_int) -> std::io::Result<Option<ExitStatus>> {
    loop {
        // SAFETY: waitid writes the zeroed local siginfo only.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let rc = unsafe {
            libc::waitid(
                libc::P_PIDFD,
                fd.as_raw_fd() as libc::id_t,
                &mut info,
                options,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        // SAFETY: si_pid/si_status are valid for a WEXITED siginfo; a pid
        // of 0 means "not exited yet" under WNOHANG.
        let (pid, code, status) = unsafe { (info.si_pid(), info.si_code, info.si_status()) };
        if pid == 0 {
            return Ok(None);
        }
        let raw = match code {
            libc::CLD_EXITED => (status & 0xff) << 8,
            libc::CLD_DUMPED => (status & 0x7f) | 0x80,
            _ => status & 0x7f,
        };
        return Ok(Some(ExitStatus::from_raw(raw)));
    }
}

#[cfg(test)]
mod tests {
    use super::super::spawn::{Command, Stdio};
    use std::path::Path;
    use std::time::Duration;

    fn sh(script: &str) -> Command {
        Command::new(Path::new("/bin/sh"), &["sh", "-c", script]).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_exits_arrive_each_to_its_own_waiter() {
        let mut exits = Vec::new();
        for code in 0..40 {
            let mut cmd = sh(&format!("exit {code}"));
            cmd.stdout(Stdio::Null);
            exits.push((code, cmd.spawn().unwrap().exit));
        }
        // A foreign child (tokio's own) exiting in between is none of
        // their business.
        let foreign = tokio::process::Command::new("true").status();
        assert!(foreign.await.unwrap().success());
        for (code, exit) in exits.into_iter().rev() {
            let status = tokio::time::timeout(Duration::from_secs(20), exit.wait())
                .await
                .expect("exit delivered")
                .unwrap();
            assert_eq!(status.code(), Some(code));
        }
    }

    #[tokio::test]
    async fn a_dropped_exit_still_reaps_its_child() {
        let child = sh("exit 3").spawn().unwrap();
        let pid = child.pid;
        drop(child.exit);
        // Reaped by the background waiter: the pid is gone from /proc
        // (a zombie would still be listed).
        let gone = async {
            while Path::new(&format!("/proc/{pid}")).exists() {
                tokio::task::yield_now().await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), gone)
            .await
            .expect("reaped");
    }
}

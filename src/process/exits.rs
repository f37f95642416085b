//! The exit of a child started by [`super::spawn`]: reaped exactly, never
//! by a `waitid` over every child.
//!
//! Why (issue 48): the watcher before this one woke on `SIGCHLD` and
//! peeked with `waitid(P_ALL, WNOWAIT)`, which makes the kernel walk every
//! child of the executor for each exit (`wait_consider_task`: a tenth of
//! the CPU while 10 000 processes started).
//!
//! How, in the common case: a pidfd per child (`CLONE_PIDFD`). It becomes
//! readable when its process exits, so tokio's reactor wakes exactly the
//! one waiter, which reaps exactly that child with `waitid(P_PIDFD)`.
//!
//! The price is one descriptor per live process on top of its output
//! pipe, and `RLIMIT_NOFILE` may be small with a hard limit not even root
//! may raise (20 000 on the machine these figures come from: 10 000
//! processes would not fit). So a child whose pidfd lands in the last
//! quarter of the descriptor table ([`threshold`]) is *swept*: registered in a set, and a thread woken by
//! `SIGCHLD` checks each swept child with `waitid(P_PID, WNOHANG)`, which
//! costs one system call per swept child per wake-up and nothing per
//! pidfd child. The set is empty unless descriptors run short.
//!
//! (A real-time exit signal, which would carry the pid with no descriptor
//! at all, does not work: `execve` resets a child's exit signal to
//! `SIGCHLD`.)

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::{Mutex, MutexGuard, OnceLock};
use tokio::sync::oneshot;

/// Swept children: pid → where its status goes.
type Swept = HashMap<i32, oneshot::Sender<ExitStatus>>;
static SWEPT: Mutex<Option<Swept>> = Mutex::new(None);

fn swept() -> MutexGuard<'static, Option<Swept>> {
    SWEPT.lock().unwrap_or_else(|p| p.into_inner())
}

/// The lowest pidfd number past which a child is swept instead: three
/// quarters of the descriptor limit (read once; the executor raises the
/// limit at start, before any spawn). The kernel hands out the lowest
/// free number, so a pidfd numbered `n` means at least `n` descriptors
/// are open: the last quarter is left to output pipes, sockets and files,
/// and pidfds come back by themselves as descriptors are freed.
fn threshold() -> i32 {
    static AT: OnceLock<i32> = OnceLock::new();
    *AT.get_or_init(|| {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the local struct only.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
            return 768;
        }
        i32::try_from(lim.rlim_cur / 4 * 3).unwrap_or(i32::MAX)
    })
}

/// The swept set, locked across a start so the sweeper cannot miss the
/// child's exit before it is registered.
pub(super) struct Start {
    guard: MutexGuard<'static, Option<Swept>>,
}

/// Lock the swept set for one start (starting the sweeper first, once).
///
/// # Errors
/// When the sweeper's pipe, handler or thread cannot be made.
pub(super) fn start() -> std::io::Result<Start> {
    sweeper()?;
    Ok(Start { guard: swept() })
}

impl Start {
    /// The exit of child `pid`, started under this lock with `pidfd`:
    /// watched through the pidfd, or swept when descriptors run short.
    pub(super) fn adopt(mut self, pid: u32, pidfd: OwnedFd) -> Exit {
        #[cfg(test)]
        let force = tests::FORCE_SWEPT.load(std::sync::atomic::Ordering::Acquire);
        #[cfg(not(test))]
        let force = false;
        if pidfd.as_raw_fd() < threshold() && !force {
            return Exit {
                pid,
                watch: Watch::Fd(Some(pidfd)),
            };
        }
        drop(pidfd);
        let (tx, rx) = oneshot::channel();
        self.guard
            .get_or_insert_with(HashMap::new)
            .insert(pid as i32, tx);
        Exit {
            pid,
            watch: Watch::Swept(Some(rx)),
        }
    }
}

/// Start the sweeper thread once: `SIGCHLD` writes a byte to a pipe, the
/// thread wakes and checks every swept child (and every second anyway, in
/// case a wake-up was lost to a full pipe).
fn sweeper() -> std::io::Result<()> {
    static STARTED: Mutex<bool> = Mutex::new(false);
    let mut started = STARTED.lock().unwrap_or_else(|p| p.into_inner());
    if *started {
        return Ok(());
    }
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)?;
    let wfd = w.as_raw_fd();
    // The write end lives as long as the process: the handler may run at
    // any time.
    std::mem::forget(w);
    // SAFETY: the action makes one write(2) of a static byte, which is
    // async-signal-safe; a full pipe already holds a wake-up.
    unsafe {
        signal_hook_registry::register_sigaction(libc::SIGCHLD, move |_| {
            libc::write(wfd, b"c".as_ptr().cast(), 1);
        })
    }
    .map_err(std::io::Error::other)?;
    std::thread::Builder::new()
        .name("bmx-exits".into())
        .spawn(move || sweep_forever(r))?;
    *started = true;
    Ok(())
}

fn sweep_forever(pipe: OwnedFd) {
    let mut buf = [0u8; 256];
    loop {
        let mut fds = [libc::pollfd {
            fd: pipe.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: poll on one local pollfd.
        unsafe { libc::poll(fds.as_mut_ptr(), 1, 1000) };
        // Drain every wake-up: one sweep answers them all.
        while matches!(nix::unistd::read(&pipe, &mut buf), Ok(n) if n > 0) {}
        sweep();
    }
}

/// Reap every swept child that has exited; its waiter gets the status.
fn sweep() {
    let mut reaped = Vec::new();
    {
        let mut guard = swept();
        let Some(set) = guard.as_mut() else { return };
        let done: Vec<(i32, Option<ExitStatus>)> = set
            .keys()
            .filter_map(|&pid| match reap_pid(pid) {
                Ok(Some(status)) => Some((pid, Some(status))),
                Ok(None) => None,
                // Not our child any more (cannot happen while it is owned):
                // its waiter learns the watcher has no status for it.
                Err(_) => Some((pid, None)),
            })
            .collect();
        for (pid, status) in done {
            if let (Some(tx), Some(status)) = (set.remove(&pid), status) {
                let _ = tx.send(status);
            }
            reaped.push(pid);
        }
    }
    for pid in reaped {
        super::sys::release_owned(pid as u32);
    }
}

/// A child's exit, to be awaited once. Dropped unawaited, the child is
/// still reaped (by a task, a thread outside a runtime, or the sweeper),
/// never left a zombie.
#[derive(Debug)]
pub struct Exit {
    pid: u32,
    watch: Watch,
}

#[derive(Debug)]
enum Watch {
    /// Watched through its pidfd (`None` once taken).
    Fd(Option<OwnedFd>),
    /// In the swept set; the status comes on this channel.
    Swept(Option<oneshot::Receiver<ExitStatus>>),
}

impl Exit {
    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Reap the child if it has exited, without waiting.
    ///
    /// # Errors
    /// A `waitid` failure other than "still running".
    pub fn reap_now(&mut self) -> std::io::Result<Option<ExitStatus>> {
        match &mut self.watch {
            Watch::Fd(slot @ Some(_)) => {
                let status = slot.as_ref().map_or(Ok(None), try_reap)?;
                if status.is_some() {
                    // Reaped: the pidfd has nothing more to say.
                    drop(slot.take());
                    super::sys::release_owned(self.pid);
                }
                Ok(status)
            }
            Watch::Fd(None) => Ok(None),
            Watch::Swept(rx) => {
                sweep();
                match rx.as_mut().map(|rx| rx.try_recv()) {
                    Some(Ok(status)) => {
                        *rx = None;
                        Ok(Some(status))
                    }
                    _ => Ok(None),
                }
            }
        }
    }

    /// Wait for the child to exit and reap it.
    ///
    /// # Errors
    /// When the pidfd cannot be watched or `waitid` fails.
    pub async fn wait(mut self) -> std::io::Result<ExitStatus> {
        let pid = self.pid;
        match &mut self.watch {
            Watch::Fd(fd) => {
                let fd = fd
                    .take()
                    .ok_or_else(|| std::io::Error::other("exit already reaped"))?;
                let status = wait_fd(fd).await;
                super::sys::release_owned(pid);
                status
            }
            Watch::Swept(rx) => {
                let rx = rx
                    .take()
                    .ok_or_else(|| std::io::Error::other("exit already reaped"))?;
                rx.await
                    .map_err(|_| std::io::Error::other("the exit was not seen"))
            }
        }
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
        // A swept child stays in the set and is reaped by the sweeper.
        let Watch::Fd(fd) = &mut self.watch else {
            return;
        };
        let Some(fd) = fd.take() else {
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

/// `waitid(P_PID, WNOHANG)`: the status if the swept child has exited.
fn reap_pid(pid: i32) -> std::io::Result<Option<ExitStatus>> {
    waitid_raw(
        libc::P_PID,
        pid as libc::id_t,
        libc::WEXITED | libc::WNOHANG | libc::__WALL,
    )
}

/// `waitid(P_PIDFD, WNOHANG)`: the status if the child has exited.
fn try_reap(fd: &OwnedFd) -> std::io::Result<Option<ExitStatus>> {
    waitid(fd, libc::WEXITED | libc::WNOHANG | libc::__WALL)
}

fn reap_blocking(fd: &OwnedFd) -> std::io::Result<Option<ExitStatus>> {
    waitid(fd, libc::WEXITED | libc::__WALL)
}

fn waitid(fd: &OwnedFd, options: libc::c_int) -> std::io::Result<Option<ExitStatus>> {
    waitid_raw(libc::P_PIDFD, fd.as_raw_fd() as libc::id_t, options)
}

fn waitid_raw(
    idtype: libc::idtype_t,
    id: libc::id_t,
    options: libc::c_int,
) -> std::io::Result<Option<ExitStatus>> {
    loop {
        // SAFETY: waitid writes the zeroed local siginfo only.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::waitid(idtype, id, &mut info, options) };
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

    /// Each exit, awaited last first, reports its own code.
    async fn each_exits_with_its_code(exits: Vec<(i32, super::Exit)>) {
        for (code, exit) in exits.into_iter().rev() {
            let status = tokio::time::timeout(Duration::from_secs(20), exit.wait())
                .await
                .expect("exit delivered")
                .unwrap();
            assert_eq!(status.code(), Some(code));
        }
    }

    /// `pid` is reaped: gone from /proc (a zombie would still be listed).
    async fn reaped(pid: u32) {
        let gone = async {
            while Path::new(&format!("/proc/{pid}")).exists() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), gone)
            .await
            .expect("reaped");
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
        each_exits_with_its_code(exits).await;
    }

    /// Set by a test to start every child swept (other tests running
    /// meanwhile take that path too, which is as correct).
    pub(super) static FORCE_SWEPT: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn swept_children_exit_to_their_own_waiters_without_a_pidfd() {
        use std::os::unix::process::ExitStatusExt;
        use std::sync::atomic::Ordering;
        FORCE_SWEPT.store(true, Ordering::Release);
        let mut exits = Vec::new();
        for code in 0..40 {
            let mut cmd = sh(&format!("exit {code}"));
            cmd.stdout(Stdio::Null);
            let child = cmd.spawn().unwrap();
            assert!(matches!(child.exit.watch, super::Watch::Swept(_)));
            exits.push((code, child.exit));
        }
        let sleepers: Vec<_> = (0..20)
            .map(|_| sh("exec sleep 300").spawn().unwrap())
            .collect();
        // A dropped swept exit is reaped all the same.
        let dropped = sh("exit 5").spawn().unwrap();
        let dropped_pid = dropped.pid;
        drop(dropped.exit);
        FORCE_SWEPT.store(false, Ordering::Release);
        let foreign = tokio::process::Command::new("true").status();
        assert!(foreign.await.unwrap().success());
        each_exits_with_its_code(exits).await;
        for s in sleepers {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(s.pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            )
            .unwrap();
            let st = tokio::time::timeout(Duration::from_secs(20), s.exit.wait())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(st.signal(), Some(libc::SIGKILL));
        }
        reaped(dropped_pid).await;
    }

    #[tokio::test]
    async fn a_dropped_exit_still_reaps_its_child() {
        let child = sh("exit 3").spawn().unwrap();
        let pid = child.pid;
        drop(child.exit);
        // Reaped by the background waiter.
        reaped(pid).await;
    }
}

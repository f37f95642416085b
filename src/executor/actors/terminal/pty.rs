//! The PTY side of a terminal: spawning the program on a fresh PTY, the
//! reader that numbers its output into the scrollback, the input writer,
//! and resizing.
//!
//! Why nix `openpty` + `tokio::process` rather than portable-pty (which the
//! issue suggests): the process actor already spawns PTY children this way,
//! so the terminal gets the same async exit status (no thread blocked in
//! `wait`), the same non-blocking master read in the tokio reactor (no
//! blocking reader thread per terminal), and the same `spawn_owned`
//! bookkeeping that keeps the orphan reaper away from our children.

use crate::process::sys;
use crate::terminal::scrollback::Scrollback;
use crate::wire::types::TerminalOpenParams;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch, Notify};

/// How long the PTY reader waits for a paced reader that stopped taking
/// output before it leaves that reader behind (it resynchronises with a
/// snapshot) and reads on.
pub const PACE_WAIT: Duration = Duration::from_millis(250);

/// Bytes one read of the master asks for (and so the largest chunk).
pub const READ_CHUNK: usize = 64 << 10;

/// The terminal's numbered output, shared by the PTY reader (which
/// appends), the terminal actor and host stream tasks (which replay). The
/// lock is held only to push or to clone a few `Bytes` handles.
pub struct Output {
    scrollback: Mutex<Scrollback>,
    /// The latest seq, for tasks that wait for new output.
    latest: watch::Sender<u64>,
    /// Set while a poke to the actor is queued: the reader sends at most one
    /// at a time, so a fast program cannot grow the actor's mailbox.
    poke_queued: AtomicBool,
    /// Paced readers (attached clients that take every byte): id → the
    /// next seq each wants, and whether it was left behind.
    paced: Mutex<BTreeMap<u64, (u64, bool)>>,
    next_paced: AtomicU64,
    /// A paced reader moved or went.
    paced_moved: Notify,
}

/// A paced reader's place in [`Output`]; dropped, it stops pacing.
pub struct Pace {
    output: Arc<Output>,
    id: u64,
}

impl Pace {
    /// The reader took everything before `next`.
    pub fn advance(&self, next: u64) {
        self.output.set_paced(self.id, next, false);
    }

    /// The reader resynchronised (a snapshot) and wants `next` on: paced
    /// again even if it had been left behind.
    pub fn resync(&self, next: u64) {
        self.output.set_paced(self.id, next, true);
    }
}

impl Drop for Pace {
    fn drop(&mut self) {
        self.output
            .paced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
        self.output.paced_moved.notify_waiters();
    }
}

impl Output {
    pub fn new(max_bytes: usize) -> Arc<Self> {
        Arc::new(Output {
            scrollback: Mutex::new(Scrollback::new(max_bytes)),
            latest: watch::channel(0).0,
            poke_queued: AtomicBool::new(false),
            paced: Mutex::new(BTreeMap::new()),
            next_paced: AtomicU64::new(1),
            paced_moved: Notify::new(),
        })
    }

    /// Register a paced reader at `next`: while it keeps taking output the
    /// PTY reader never gets more than half the scrollback ahead of it, so
    /// it never misses a byte (the program waits instead, as it would on
    /// a plain terminal). One that stops taking output for [`PACE_WAIT`]
    /// is left behind until it resynchronises.
    pub fn pace(self: &Arc<Self>, next: u64) -> Pace {
        let id = self.next_paced.fetch_add(1, Ordering::Relaxed);
        self.paced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, (next, false));
        Pace {
            output: self.clone(),
            id,
        }
    }

    fn set_paced(&self, id: u64, next: u64, resync: bool) {
        if let Some(e) = self
            .paced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&id)
        {
            e.0 = next;
            if resync {
                e.1 = false;
            }
        }
        self.paced_moved.notify_waiters();
    }

    /// Whether a reader that wants `next` is more than half the
    /// scrollback behind.
    fn lagging(&self, next: u64) -> bool {
        self.with(|sb| sb.bytes_from(next) > sb.max_bytes() / 2)
    }

    /// Whether a paced reader (not left behind) is lagging.
    fn overrun(&self) -> bool {
        let paced = self.paced.lock().unwrap_or_else(|p| p.into_inner());
        let slowest = paced
            .values()
            .filter(|(_, behind)| !behind)
            .map(|(n, _)| *n)
            .min();
        drop(paced);
        slowest.is_some_and(|n| self.lagging(n))
    }

    /// Mark every paced reader still lagging as left behind.
    fn leave_behind(&self) {
        let mut paced = self.paced.lock().unwrap_or_else(|p| p.into_inner());
        for (next, behind) in paced.values_mut() {
            *behind = *behind || self.lagging(*next);
        }
    }

    /// Wait (at most [`PACE_WAIT`]) until no paced reader is overrun.
    async fn wait_for_paced(&self) {
        let deadline = tokio::time::Instant::now() + PACE_WAIT;
        loop {
            let moved = self.paced_moved.notified();
            if !self.overrun() {
                return;
            }
            if tokio::time::timeout_at(deadline, moved).await.is_err() {
                self.leave_behind();
                return;
            }
        }
    }

    pub fn with<R>(&self, f: impl FnOnce(&Scrollback) -> R) -> R {
        let guard = self.scrollback.lock().unwrap_or_else(|p| p.into_inner());
        f(&guard)
    }

    fn push(&self, data: Bytes) {
        let seq = {
            let mut guard = self.scrollback.lock().unwrap_or_else(|p| p.into_inner());
            guard.push(data)
        };
        self.latest.send_replace(seq);
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.latest.subscribe()
    }

    /// The actor took the poke: the next chunk may send another.
    pub fn poke_taken(&self) {
        self.poke_queued.store(false, Ordering::SeqCst);
    }
}

/// A spawned program on a PTY.
pub struct Spawned {
    pub pid: u32,
    pub exit: crate::process::exits::Exit,
    pub master: OwnedFd,
}

/// What to run: `argv`, else `shell`, else the user's login shell.
pub fn command_line(spec: &TerminalOpenParams) -> Vec<String> {
    match (&spec.argv, &spec.shell) {
        (Some(argv), _) if !argv.is_empty() => argv.clone(),
        (_, Some(shell)) if !shell.is_empty() => vec![shell.clone()],
        _ => vec![login_shell()],
    }
}

/// `$SHELL`, else this user's entry in /etc/passwd, else /bin/sh.
pub fn login_shell() -> String {
    if let Ok(s) = std::env::var("SHELL") {
        if !s.is_empty() {
            return s;
        }
    }
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() }.to_string();
    std::fs::read_to_string("/etc/passwd")
        .ok()
        .and_then(|passwd| {
            passwd.lines().find_map(|line| {
                let f: Vec<&str> = line.split(':').collect();
                (f.len() == 7 && f[2] == uid && !f[6].is_empty()).then(|| f[6].to_owned())
            })
        })
        .unwrap_or_else(|| "/bin/sh".into())
}

/// Start `argv` on a new PTY of `cols`x`rows`, as the leader of a new
/// session whose controlling terminal is the PTY (so job control, SIGWINCH
/// and hangup behave as in a real terminal). The master is non-blocking.
/// `confine`: the sandbox the program starts in (an executor terminal's);
/// `None` for `bmx visor`'s sessions, which are the person's own.
pub fn spawn(
    argv: &[String],
    cwd: &std::path::Path,
    env: Vec<(String, String)>,
    cols: u16,
    rows: u16,
    confine: Option<Arc<crate::process::spawn::Confinement>>,
) -> std::io::Result<Spawned> {
    use crate::process::spawn::{Command, Group, Stdio};
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str());
    let program = match sys::resolve_program(&argv[0], path, cwd) {
        Some(p) => p,
        None if argv[0].contains('/') => cwd.join(&argv[0]),
        None => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "not found in PATH",
            ))
        }
    };
    let (master, slave) = sys::open_pty(cols, rows)?;
    let mut cmd = Command::new(&program, argv)?;
    cmd.cwd(cwd)?
        .env(env)?
        .stdin(Stdio::Fd(slave.try_clone()?))
        .stdout(Stdio::Fd(slave.try_clone()?))
        .stderr(Stdio::Fd(slave))
        .group(Group::Session { tty: true })
        .run_as(confine.is_some())
        .confine(confine);
    // The slave ends go with `cmd`, so the master reads EIO once the
    // program and its children are gone.
    let child = cmd.spawn()?;
    Ok(Spawned {
        pid: child.pid,
        exit: child.exit,
        master,
    })
}

fn winsize(cols: u16, rows: u16) -> nix::pty::Winsize {
    nix::pty::Winsize {
        ws_row: rows.max(1),
        ws_col: cols.max(1),
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// Set the PTY size; the kernel sends SIGWINCH to the foreground group.
pub fn resize(master: &OwnedFd, cols: u16, rows: u16) -> std::io::Result<()> {
    let size = winsize(cols, rows);
    // SAFETY: TIOCSWINSZ reads a `struct winsize` we own, on an fd we own.
    let rc = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &size) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The conventional exit code: the status, or 128 + the signal.
pub fn exit_code(status: std::process::ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(-1)
}

/// Queued input writes to a PTY before the caller says busy.
pub const INPUT_QUEUE: usize = 256;
/// How long the exit report waits for the reader to drain the PTY.
const DRAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Run a spawned program's I/O (its master, child and pid): a [`writer`] fed by the returned sender,
/// a [`reader`] into `output` (poking with `poke`), and a watcher that,
/// when the program exits, kills what it left running in `scope` (no
/// orphans; that also closes the last slave descriptors so the reader
/// ends), lets the reader drain, then reports the exit code with
/// `exited`. One wiring for executor terminals and visor PTY sessions.
pub fn run(
    master: &OwnedFd,
    exit: crate::process::exits::Exit,
    pid: u32,
    output: Arc<Output>,
    scope: String,
    poke: impl Fn() -> bool + Send + 'static,
    exited: impl FnOnce(i32) + Send + 'static,
) -> std::io::Result<mpsc::Sender<Bytes>> {
    let (tx, rx) = mpsc::channel(INPUT_QUEUE);
    tokio::spawn(writer(master.try_clone()?, rx));
    let reader = tokio::spawn(reader(master.try_clone()?, output, poke));
    tokio::spawn(async move {
        let code = exit.wait().await.map(exit_code).unwrap_or(-1);
        let p = pid as i32;
        let _ = tokio::task::spawn_blocking(move || sys::kill_tree(Some(p), Some(p), &scope)).await;
        let _ = tokio::time::timeout(DRAIN_WAIT, reader).await;
        exited(code);
    });
    Ok(tx)
}

/// Read the master until EOF/EIO, numbering each read as one chunk. Never
/// waits on anyone: the scrollback drops its oldest chunks when full, and
/// the actor is poked (at most one poke queued) rather than sent the bytes.
pub async fn reader(master: OwnedFd, output: Arc<Output>, poke: impl Fn() -> bool) {
    let afd = match sys::async_fd(master) {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the PTY");
            return;
        }
    };
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        // Paced readers first: the program waits (its writes block on the
        // full PTY) rather than an attached client missing output.
        output.wait_for_paced().await;
        let Ok(mut guard) = afd.readable().await else {
            break;
        };
        match nix::unistd::read(afd.get_ref().as_fd(), &mut buf) {
            Ok(0) => break,
            Ok(n) => {
                // An exact-size copy: scrollback accounts for lengths, so
                // a small chunk must not pin a 64 KiB allocation.
                output.push(Bytes::copy_from_slice(&buf[..n]));
                if !output.poke_queued.swap(true, Ordering::SeqCst) && !poke() {
                    break;
                }
            }
            Err(nix::errno::Errno::EAGAIN) => guard.clear_ready(),
            Err(nix::errno::Errno::EINTR) => {}
            // EIO: every slave descriptor is closed.
            Err(_) => break,
        }
    }
}

/// Write queued input to the master (non-blocking; waits for room when the
/// program is not reading, without blocking anyone else).
pub async fn writer(master: OwnedFd, mut rx: mpsc::Receiver<Bytes>) {
    let Ok(afd) = sys::async_fd(master) else {
        return;
    };
    while let Some(data) = rx.recv().await {
        if !sys::write_all(&afd, &data).await {
            return;
        }
    }
}

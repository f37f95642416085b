//! Operating-system plumbing for processes: the child subreaper, pipes with
//! a large buffer, process-tree discovery and killing, and reaping orphans.
//!
//! Why a subreaper and a tag: a process group misses descendants that call
//! `setsid` (or that a shell put in their own group), and once their parent
//! exits they are re-parented away from the tree. bmx marks every process it
//! starts with `BMX_SCOPE=<instance>/<session>/<process>` in its
//! environment, which descendants inherit, and becomes the child subreaper,
//! so orphans are re-parented to the executor (which reaps them) instead of
//! init. Killing a scope sends SIGKILL to every process whose environment
//! carries the tag, plus the process group. cgroup v2 would be stronger
//! (a process can clear its environment), but it is not writable on every
//! host (this one mounts cgroup v1); see docs/architecture.md.

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::{getpgid, getpgrp, getpid, Pid};
use std::collections::{BTreeSet, HashSet, VecDeque};
use std::sync::Mutex;

/// Environment variable that tags a process tree with its owner.
pub const SCOPE_ENV: &str = "BMX_SCOPE";

/// Whether this process is the child subreaper (orphans come to us).
static SUBREAPER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn is_subreaper() -> bool {
    SUBREAPER.load(std::sync::atomic::Ordering::SeqCst)
}

/// Make this process the child subreaper (Linux `PR_SET_CHILD_SUBREAPER`)
/// and reap the orphans that come to it.
///
/// Only for a process that owns all of its children (the `bmx` daemon): the
/// reaper reaps any zombie child it did not spawn itself, which in a host
/// program would steal the exit status of the host's own children. Without
/// it, orphans go to init and are found by a full /proc scan instead.
pub fn become_subreaper() {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes an integer argument
    // and touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if rc != 0 {
        tracing::warn!(
            "PR_SET_CHILD_SUBREAPER failed: {}",
            std::io::Error::last_os_error()
        );
    } else {
        SUBREAPER.store(true, std::sync::atomic::Ordering::SeqCst);
        start_orphan_reaper();
    }
}

/// Pids of children this process spawned and waits for itself (tokio or a
/// thread owns their exit status); the orphan reaper leaves them alone.
static OWNED: Mutex<Option<HashSet<i32>>> = Mutex::new(None);

/// Run `spawn` and record the pid it returns as owned, under the same lock
/// the reaper takes, so the reaper never steals its exit status.
pub fn spawn_owned<T>(spawn: impl FnOnce() -> std::io::Result<(T, u32)>) -> std::io::Result<T> {
    let mut guard = OWNED.lock().unwrap_or_else(|p| p.into_inner());
    let (value, pid) = spawn()?;
    guard.get_or_insert_with(HashSet::new).insert(pid as i32);
    Ok(value)
}

/// Forget an owned pid once its owner reaped it.
pub fn release_owned(pid: u32) {
    let mut guard = OWNED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(set) = guard.as_mut() {
        set.remove(&(pid as i32));
    }
}

fn start_orphan_reaper() {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        handle.spawn(async {
            use tokio::signal::unix::{signal, SignalKind};
            let Ok(mut sigchld) = signal(SignalKind::child()) else {
                return;
            };
            loop {
                reap_orphans();
                tokio::select! {
                    _ = sigchld.recv() => {}
                    // SIGCHLD can coalesce; sweep now and then as well.
                    _ = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
                }
            }
        });
    });
}

/// Reap zombie children that nobody owns (re-parented orphans).
pub fn reap_orphans() {
    let me = std::process::id() as i32;
    let guard = OWNED.lock().unwrap_or_else(|p| p.into_inner());
    for pid in zombie_children(me) {
        if guard.as_ref().is_some_and(|s| s.contains(&pid)) {
            continue;
        }
        // SAFETY: waitpid on a specific pid with WNOHANG; status is a local.
        let mut status = 0;
        unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    }
}

/// One descriptor held in reserve, so `/proc` can still be read when the
/// process has run out of them (`EMFILE`): exactly when an executor full of
/// processes must find and kill a tree. Without it, a scan that cannot open
/// `/proc/<pid>/environ` misses tagged processes, and they escape.
static SPARE: Mutex<Option<std::os::fd::OwnedFd>> = Mutex::new(None);

fn open_spare() -> Option<std::os::fd::OwnedFd> {
    std::fs::File::open("/dev/null").ok().map(Into::into)
}

/// Hold the spare descriptor (once, at start, while descriptors are free).
pub fn reserve_spare_fd() {
    let mut spare = SPARE.lock().unwrap_or_else(|p| p.into_inner());
    if spare.is_none() {
        *spare = open_spare();
    }
}

/// Run `f`; if it failed for want of a descriptor, free the spare, run it
/// again, and take the spare back. Best effort: another thread may take the
/// freed slot first, and then the error stands.
fn with_headroom<T>(f: impl Fn() -> std::io::Result<T>) -> std::io::Result<T> {
    match f() {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
            let mut spare = SPARE.lock().unwrap_or_else(|p| p.into_inner());
            if spare.take().is_none() {
                return Err(e);
            }
            let again = f();
            *spare = open_spare();
            again
        }
        other => other,
    }
}

fn proc_read(path: &str) -> std::io::Result<Vec<u8>> {
    with_headroom(|| std::fs::read(path))
}

fn proc_read_string(path: &str) -> std::io::Result<String> {
    with_headroom(|| std::fs::read_to_string(path))
}

/// The names in a `/proc` directory, read in full so that its descriptor
/// is closed before the caller goes on.
fn proc_list(path: &str) -> std::io::Result<Vec<std::ffi::OsString>> {
    with_headroom(|| {
        std::fs::read_dir(path)?
            .map(|e| e.map(|e| e.file_name()))
            .collect()
    })
}

fn proc_pids() -> Vec<i32> {
    proc_list("/proc")
        .unwrap_or_default()
        .iter()
        .filter_map(|n| n.to_str()?.parse::<i32>().ok())
        .collect()
}

/// (ppid, state) from /proc/<pid>/stat.
fn stat(pid: i32) -> Option<(i32, char)> {
    let s = proc_read_string(&format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: split after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let mut it = rest.split(' ');
    let state = it.next()?.chars().next()?;
    let ppid = it.next()?.parse().ok()?;
    Some((ppid, state))
}

/// Zombie children of `parent` that it adopted (its thread-group leader's
/// children list): cheap, unlike a walk of every process on the host.
fn zombie_children(parent: i32) -> Vec<i32> {
    proc_read_string(&format!("/proc/{parent}/task/{parent}/children"))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
                .filter(|&p| matches!(stat(p), Some((pp, 'Z')) if pp == parent))
                .collect()
        })
        .unwrap_or_default()
}

/// Pids whose environment carries `BMX_SCOPE` starting with `prefix`.
pub fn pids_in_scope(prefix: &str) -> Vec<i32> {
    let needle = format!("{SCOPE_ENV}={prefix}");
    let me = std::process::id() as i32;
    proc_pids()
        .into_iter()
        .filter(|&p| p != me)
        .filter(|&p| has_scope(p, needle.as_bytes()))
        .collect()
}

/// Send `signal` to a process group (ignoring a group that is gone).
pub fn signal_group(pgid: i32, signal: nix::sys::signal::Signal) {
    if pgid > 1 {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), signal);
    }
}

/// Kills process `pid`, the process group it leads, and every descendant,
/// including those that left the group (`setsid`, `setpgid`).
///
/// The tree is frozen with SIGSTOP first, then collected by walking
/// `/proc/<pid>/task/*/children` recursively (repeatedly, until no new pid
/// shows up), then killed with SIGKILL. Freezing first means nothing can
/// fork a fresh child between collection and kill, and a stopped process
/// cannot exit, so its pid cannot be recycled before our SIGKILL reaches it.
///
/// Refuses pid 0, 1, our own pid and our own process group, where a signal
/// would hit the executor itself or the whole system.
pub fn kill_process_tree(pid: u32) {
    let Ok(raw) = i32::try_from(pid) else {
        return;
    };
    let me = getpid();
    if raw <= 1 || raw == me.as_raw() {
        return;
    }
    let root = Pid::from_raw(raw);
    let leads_group = getpgid(Some(root)).is_ok_and(|g| g == root) && root != getpgrp();
    if leads_group {
        let _ = killpg(root, Signal::SIGSTOP);
    }
    let _ = kill(root, Signal::SIGSTOP);
    let mut all = BTreeSet::from([raw]);
    for _ in 0..16 {
        let fresh: Vec<i32> = descendants(raw)
            .into_iter()
            .filter(|p| *p > 1 && *p != me.as_raw() && all.insert(*p))
            .collect();
        if fresh.is_empty() {
            break;
        }
        for p in fresh {
            let _ = kill(Pid::from_raw(p), Signal::SIGSTOP);
        }
    }
    if leads_group {
        let _ = killpg(root, Signal::SIGKILL);
    }
    tracing::debug!(pid = raw, processes = all.len(), "killed process tree");
    for p in all {
        let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
    }
}

/// All descendants of `root` currently visible in /proc.
pub fn descendants(root: i32) -> Vec<i32> {
    let mut found = Vec::new();
    let mut seen = BTreeSet::from([root]);
    let mut queue = VecDeque::from([root]);
    while let Some(pid) = queue.pop_front() {
        for child in children_of(pid) {
            if seen.insert(child) {
                found.push(child);
                queue.push_back(child);
            }
        }
    }
    found
}

/// Children of `pid` from `/proc/<pid>/task/*/children`, or, on kernels
/// built without that file, from the parent field of every `/proc/*/stat`.
fn children_of(pid: i32) -> Vec<i32> {
    let Ok(tasks) = proc_list(&format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut children = Vec::new();
    let mut supported = true;
    for task in tasks {
        let path = format!("/proc/{pid}/task/{}/children", task.to_string_lossy());
        match proc_read_string(&path) {
            Ok(list) => children.extend(
                list.split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            ),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => supported = false,
            Err(_) => {}
        }
    }
    if !supported {
        children.extend(scan_children(pid));
    }
    children
}

fn scan_children(parent: i32) -> Vec<i32> {
    proc_pids()
        .into_iter()
        .filter(|pid| parent_of(*pid) == Some(parent))
        .collect()
}

/// The parent pid from `/proc/<pid>/stat` (`pid (comm) state ppid ...`;
/// `comm` may contain spaces and parentheses, so parse after the last `)`).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = proc_read_string(&format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

fn has_scope(pid: i32, needle: &[u8]) -> bool {
    matches!(scope_tag(pid, needle), Tag::Ours)
}

/// What a process's environment says about its scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Ours,
    Other,
    /// Nothing to read: the process is between `execve`'s switch of its
    /// memory and the set-up of the new environment (or is exiting). Read
    /// again shortly.
    Unsettled,
}

fn scope_tag(pid: i32, needle: &[u8]) -> Tag {
    match proc_read(&format!("/proc/{pid}/environ")) {
        Ok(env) if env.is_empty() => Tag::Unsettled,
        Ok(env) if env.split(|&b| b == 0).any(|var| var.starts_with(needle)) => Tag::Ours,
        Ok(_) => Tag::Other,
        Err(_) => Tag::Unsettled,
    }
}

/// Processes of `scope` that left their tree: orphans re-parented to this
/// executor (the subreaper) that carry the tag, and their descendants. Only
/// this process's own children are read, not every process on the host.
pub fn orphans_in_scope(scope: &str) -> Vec<i32> {
    adopted_in_scope(scope).0
}

/// [`orphans_in_scope`], and whether some adopted process could not be
/// told apart yet ([`Tag::Unsettled`]): an escapee caught inside `execve`
/// shows an empty environment for a moment, and a kill that trusted that
/// moment would leave it running.
fn adopted_in_scope(scope: &str) -> (Vec<i32>, bool) {
    let needle = format!("{SCOPE_ENV}={scope}");
    let me = std::process::id() as i32;
    let owned: HashSet<i32> = OWNED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .unwrap_or_default();
    // The kernel re-parents orphans to the subreaper's thread-group leader
    // (while it lives): read only its children list. Children spawned from
    // worker threads are listed under those threads and are ours anyway;
    // reading every thread's list made each kill O(threads + children).
    let adopted = proc_read_string(&format!("/proc/{me}/task/{me}/children"))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
                .collect::<Vec<_>>()
        })
        .unwrap_or_else(|_| children_of(me));
    let mut out = Vec::new();
    let mut unsettled = false;
    for c in adopted {
        if owned.contains(&c) {
            continue;
        }
        match scope_tag(c, needle.as_bytes()) {
            Tag::Ours => {
                out.push(c);
                out.extend(descendants(c));
            }
            Tag::Unsettled if alive(c) => unsettled = true,
            Tag::Unsettled | Tag::Other => {}
        }
    }
    (out, unsettled)
}

fn alive(pid: i32) -> bool {
    !matches!(stat(pid), Some((_, 'Z')) | None)
}

/// Most passes [`kill_tree`] makes (2 ms apart).
const KILL_PASSES: usize = 50;

/// SIGKILL a process tree: the group `pgid`, every descendant of `pid`, and
/// every orphan of `scope`, repeated until nothing is left (a fork racing
/// the kill is caught by the next pass).
pub fn kill_tree(pid: Option<i32>, pgid: Option<i32>, scope: &str) {
    use nix::sys::signal::{kill, Signal};
    if let Some(p) = pid.filter(|&p| alive(p)) {
        kill_process_tree(p as u32);
    }
    // Passes 2 ms apart: enough for a fork racing the kill, and for an
    // escapee caught mid-`execve` to show its tag again; bounded, so a
    // process that never settles cannot hold the kill.
    for _ in 0..KILL_PASSES {
        let mut targets: Vec<i32> = pid.map(descendants).unwrap_or_default();
        let mut unsettled = false;
        if is_subreaper() {
            let (orphans, u) = adopted_in_scope(scope);
            targets.extend(orphans);
            unsettled = u;
        } else {
            targets.extend(pids_in_scope(scope));
        }
        targets.retain(|&p| alive(p));
        if let Some(g) = pgid {
            signal_group(g, Signal::SIGKILL);
        }
        if targets.is_empty() && !unsettled {
            break;
        }
        for p in targets {
            let _ = kill(nix::unistd::Pid::from_raw(p), Signal::SIGKILL);
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    if is_subreaper() {
        reap_orphans();
    }
}

/// Kill every process tagged with `scope` anywhere on the host (a full
/// /proc scan: for tests and last-resort cleanup, not the hot path).
pub fn kill_scope(pgid: Option<i32>, scope: &str) {
    use nix::sys::signal::{kill, Signal};
    kill_tree(None, pgid, scope);
    for _ in 0..5 {
        let alive: Vec<i32> = pids_in_scope(scope)
            .into_iter()
            .filter(|&p| alive(p))
            .collect();
        if alive.is_empty() {
            break;
        }
        for p in alive {
            let _ = kill(nix::unistd::Pid::from_raw(p), Signal::SIGKILL);
        }
    }
    if is_subreaper() {
        reap_orphans();
    }
}

/// The daemon's last act on its way out (`bmx executor` after SIGTERM,
/// SIGINT or any other end, once every session has been stopped): SIGKILL
/// everything still below this process, tagged or not, and reap it.
///
/// Why, on top of the per-session tag sweeps: a descendant that dropped
/// its scope tag (`env -i`, a daemon that scrubs its environment) is
/// invisible to them, and once the daemon exits it is re-parented to pid 1
/// for good. As a subreaper the daemon has adopted every orphan of its
/// trees, so "below this process" is exactly what it started. Only for a
/// process that owns all its children: never call it in an embedding
/// (a platform's own children would die). Returns how many it killed.
pub fn kill_all_descendants() -> usize {
    use nix::sys::signal::{kill, Signal};
    let me = std::process::id() as i32;
    let mut killed = 0;
    for _ in 0..KILL_PASSES {
        let targets: Vec<i32> = descendants(me).into_iter().filter(|&p| alive(p)).collect();
        if targets.is_empty() {
            break;
        }
        for &p in &targets {
            if kill(nix::unistd::Pid::from_raw(p), Signal::SIGKILL).is_ok() {
                killed += 1;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    reap_orphans();
    killed
}

/// A pipe whose read end is non-blocking and whose buffer is `size` bytes
/// (`F_SETPIPE_SZ`): with the default 64 KiB the producer and the reader
/// take turns; 1 MiB lets both run.
pub fn pipe(size: usize) -> std::io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let (r, w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    let _ = fcntl(&r, FcntlArg::F_SETPIPE_SZ(size as i32));
    let flags = OFlag::from_bits_truncate(fcntl(&r, FcntlArg::F_GETFL)?);
    fcntl(&r, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok((r, w))
}

/// Set O_NONBLOCK on a descriptor (the parent's end of stdin, a PTY master).
pub fn set_nonblocking(fd: &impl std::os::fd::AsFd) -> std::io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok(())
}

/// Raise the open-file limit: to the kernel's `nr_open` when this process
/// may raise its hard limit (root), else the soft limit to the hard one.
/// Each pipe-mode process holds one or two descriptors (plus tokio's pidfd).
/// The file `execvp` would run for a bare `program` name, searched in `path`
/// (relative entries, and the empty one, against `cwd`). `None` when the
/// name holds a `/` or nothing matches: the spawn then goes ahead with the
/// name as given and fails or succeeds exactly as it would have.
pub fn resolve_program(
    program: &str,
    path: Option<&str>,
    cwd: &std::path::Path,
) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.is_empty() || program.contains('/') {
        return None;
    }
    path?.split(':').find_map(|dir| {
        let dir = if dir.is_empty() { "." } else { dir };
        let candidate = cwd.join(dir).join(program);
        let meta = std::fs::metadata(&candidate).ok()?;
        (meta.is_file() && meta.permissions().mode() & 0o111 != 0).then_some(candidate)
    })
}

pub fn raise_nofile_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the local struct only.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return;
        }
        let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse::<libc::rlim_t>().ok())
            .unwrap_or(lim.rlim_max);
        let wanted = libc::rlimit {
            rlim_cur: nr_open.max(lim.rlim_max),
            rlim_max: nr_open.max(lim.rlim_max),
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) != 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// A new PTY of `cols`×`rows`: the master (close-on-exec, non-blocking)
/// and the slave (close-on-exec; a child gets it as 0, 1 and 2 and makes
/// it its controlling terminal: `spawn::Group::Session { tty: true }`).
/// Under `--run-as` the slave is the user's, as `login` makes it, so a
/// program that opens its tty by name (`/dev/tty`, `ttyname`) gets in.
pub fn open_pty(
    cols: u16,
    rows: u16,
) -> std::io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    let size = nix::pty::Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = nix::pty::openpty(Some(&size), None)?;
    let (master, slave) = (pty.master, pty.slave);
    if let Some(u) = super::run_as::get() {
        nix::unistd::fchown(&slave, Some(nix::unistd::Uid::from_raw(u.uid)), None)?;
    }
    for fd in [&master, &slave] {
        nix::fcntl::fcntl(
            fd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )?;
    }
    set_nonblocking(&master)?;
    Ok((master, slave))
}

/// Watch an owned descriptor for readiness in the tokio reactor.
pub fn async_fd(
    fd: std::os::fd::OwnedFd,
) -> std::io::Result<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>> {
    // SAFETY: the OwnedFd is moved into the AsyncFd, so the descriptor stays
    // open and refers to the same file description for the AsyncFd's life.
    unsafe { tokio::io::unix::AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}

/// Write all of `data` to a non-blocking descriptor, waiting for room in
/// the reactor (a program that does not read its input blocks nobody).
/// False when the descriptor failed (EPIPE: the reader is gone).
pub async fn write_all(afd: &tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>, data: &[u8]) -> bool {
    let mut off = 0;
    while off < data.len() {
        let Ok(mut guard) = afd.writable().await else {
            return false;
        };
        match nix::unistd::write(afd.get_ref(), &data[off..]) {
            Ok(n) => off += n,
            Err(nix::errno::Errno::EAGAIN) => guard.clear_ready(),
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `SigIgn` mask of a child spawned by this process: by std
    /// (`reset: false`, the control), or by `process::spawn`.
    fn child_ignores(reset: bool) -> u64 {
        let text = if reset {
            use std::io::Read;
            let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
            let mut cmd = super::super::spawn::Command::new(
                std::path::Path::new("/bin/cat"),
                &["cat", "/proc/self/status"],
            )
            .unwrap();
            cmd.stdout(super::super::spawn::Stdio::Fd(w));
            let child = cmd.spawn().unwrap();
            let mut text = String::new();
            std::fs::File::from(r).read_to_string(&mut text).unwrap();
            drop(child);
            text
        } else {
            let out = std::process::Command::new("cat")
                .arg("/proc/self/status")
                .output()
                .unwrap();
            String::from_utf8(out.stdout).unwrap()
        };
        let line = text.lines().find(|l| l.starts_with("SigIgn:")).unwrap();
        u64::from_str_radix(line["SigIgn:".len()..].trim(), 16).unwrap()
    }

    /// For a test that changes something per process: false in the test
    /// process, after running the test `name` again in a child process of
    /// its own (marked by the variable `mark`) and asserting it passed;
    /// true in that child, which then runs the test's body.
    fn in_own_process(name: &str, mark: &str) -> bool {
        if std::env::var_os(mark).is_some() {
            return true;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads=1"])
            .env(mark, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        false
    }

    /// In a process of its own: the other tests must not inherit an
    /// ignored SIGINT.
    #[test]
    fn a_child_does_not_inherit_an_ignored_sigint() {
        const NAME: &str = "process::sys::tests::a_child_does_not_inherit_an_ignored_sigint";
        if !in_own_process(NAME, "BMX_SIGIGN_CHILD") {
            return;
        }
        // SAFETY: SIG_IGN for SIGINT in this throwaway process.
        unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) };
        let bit = 1u64 << (libc::SIGINT - 1);
        assert_ne!(child_ignores(false) & bit, 0, "the control: inherited");
        assert_eq!(child_ignores(true) & bit, 0, "reset for our children");
    }

    /// In a process of its own: the descriptor limit is per process, and
    /// the other tests must not feel it.
    #[test]
    fn proc_reads_survive_descriptor_exhaustion() {
        const NAME: &str = "process::sys::tests::proc_reads_survive_descriptor_exhaustion";
        if !in_own_process(NAME, "BMX_EMFILE_CHILD") {
            return;
        }
        let low = libc::rlimit {
            rlim_cur: 128,
            rlim_max: 128,
        };
        // SAFETY: setrlimit reads the local struct only.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
        reserve_spare_fd();
        let mut held = Vec::new();
        let err = loop {
            match std::fs::File::open("/dev/null") {
                Ok(f) => held.push(f),
                Err(e) => break e,
            }
        };
        assert_eq!(err.raw_os_error(), Some(libc::EMFILE));
        assert!(
            std::fs::read("/proc/self/environ").is_err(),
            "out of descriptors"
        );
        let me = std::process::id() as i32;
        assert!(stat(me).is_some(), "read through the spare");
        assert!(proc_pids().contains(&me));
        assert!(proc_read("/proc/self/environ").is_ok());
        assert!(
            SPARE.lock().unwrap().is_some(),
            "the spare is taken back after each use"
        );
    }

    #[test]
    fn programs_resolve_like_execvp() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let tool = bin.join("tool");
        std::fs::write(&tool, "#!/bin/sh\n").unwrap();
        let plain = bin.join("plain");
        std::fs::write(&plain, "not executable").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        let cwd = dir.path();
        // First match wins; relative entries are against the child's cwd.
        assert_eq!(
            resolve_program("tool", Some("/nowhere:bin"), cwd),
            Some(cwd.join("bin").join("tool"))
        );
        assert_eq!(
            resolve_program("plain", Some("bin"), cwd),
            None,
            "not executable"
        );
        assert_eq!(resolve_program("bin", Some(":"), cwd), None, "a directory");
        assert_eq!(resolve_program("sh", None, cwd), None, "no PATH: as given");
        assert_eq!(
            resolve_program("./tool", Some("bin"), cwd),
            None,
            "a path: as given"
        );
        assert!(resolve_program("sh", Some("/usr/bin:/bin"), cwd).is_some());
    }

    #[test]
    fn stat_parses_names_with_parens() {
        let me = std::process::id() as i32;
        let (ppid, state) = stat(me).unwrap();
        assert!(ppid > 0);
        assert!(state.is_ascii_alphabetic());
    }

    #[test]
    fn parent_of_parses_stat() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert_eq!(parent_of(me), Some(nix::unistd::getppid().as_raw()));
    }

    #[test]
    fn pipe_is_large_and_nonblocking() {
        use nix::fcntl::{fcntl, FcntlArg};
        let (r, _w) = pipe(1 << 20).unwrap();
        let size = fcntl(&r, FcntlArg::F_GETPIPE_SZ).unwrap();
        assert!(size >= 1 << 20, "{size}");
        let mut buf = [0u8; 8];
        let e = nix::unistd::read(&r, &mut buf).unwrap_err();
        assert_eq!(e, nix::errno::Errno::EAGAIN);
    }

    #[test]
    fn scope_kill_finds_a_setsid_descendant() {
        let scope = format!("test-{}/s/p", std::process::id());
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg("setsid sleep 300 & echo $!; wait")
            .env(SCOPE_ENV, &scope)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let orphan: i32 = line.trim().parse().unwrap();
        // `$!` is known before the child has exec'd `setsid`; while an
        // exec is under way its environ cannot be read. Give it time.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !pids_in_scope(&scope).contains(&orphan) {
            assert!(
                std::time::Instant::now() < deadline,
                "{orphan} never in scope"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        kill_scope(None, &scope);
        let _ = child.wait();
        // The orphan is gone (or a zombie about to be reaped by its parent).
        assert!(!matches!(stat(orphan), Some((_, s)) if s != 'Z'));
    }
}

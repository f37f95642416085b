//! Starting a child without copying the executor (issue 48).
//!
//! Why not `std::process::Command`: a child that runs code between fork
//! and exec (closing descriptors, rlimits, `--run-as`, joining a cgroup,
//! Landlock) makes std `fork()` the whole executor. An executor holding
//! thousands of processes then pays, at every start, for copying its page
//! tables (`copy_page_range`), tearing them down again in `execve`
//! (`unmap_page_range`), and copying and then closing its descriptor table
//! (`dup_fd`, `filp_close`): 146 s to start 10 000 processes, against
//! 12.8 s before the per-child code existed (docs/benchmarks.md).
//!
//! How, as Go's `forkExec` and glibc's `posix_spawn` do it: `clone` with
//! `CLONE_VM | CLONE_VFORK`, so the child runs on a small stack of its own
//! in the parent's memory (nothing is copied; the calling thread waits
//! until the child has called `execve` or exited), plus two things they do
//! not do:
//!
//! * `CLONE_FILES`: the child starts on the parent's descriptor table
//!   itself, not a copy of it. The descriptors it is to get as 0, 1 and 2
//!   were put by the parent into three reserved low *slots*; the child's
//!   first act on descriptors is `close_range(past_slots, ~0,
//!   CLOSE_RANGE_UNSHARE)`, which gives it a private table holding only
//!   the descriptors below `past_slots` (the kernel copies just those),
//!   then `dup2`s the slots onto 0, 1, 2 and closes the rest. So a start
//!   costs the same with 20 000 descriptors open as with 20.
//! * `CLONE_PIDFD`: the parent gets a pidfd, and the exit is watched
//!   through it, never by a `waitid` over every child; when descriptors
//!   run short, the child is swept instead ([`super::exits`]).
//!
//! Everything the child does is a raw system call on memory prepared by
//! the parent before the `clone` (no allocation, no lock, no `std`), in an
//! order that matters: signal dispositions back to default, the cgroups
//! joined (before any code of the program runs, so nothing it does can
//! leave them), the process group or session, rlimits, the working
//! directory, the `--run-as` user, `no_new_privs` and Landlock, then the
//! descriptors, the controlling terminal, the signal mask, and `execve`.
//! A failure is written with its stage into memory the parent reads once
//! the child is gone (the memory is shared), and the child exits 127.

use super::exits::Exit;
use std::ffi::{CString, OsStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// What a child gets as one of its standard descriptors.
#[derive(Debug)]
pub enum Stdio {
    /// `/dev/null`, read and write.
    Null,
    /// This descriptor (the parent keeps its own copy until the spawn
    /// returns, then drops it).
    Fd(OwnedFd),
}

/// Where the child stands among process groups and sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// The parent's group (for tests; session code never gets this).
    Inherit,
    /// The leader of a new process group (`setpgid(0, 0)`): a signal to
    /// the group reaches the child and what it starts, not the executor.
    New,
    /// The leader of a new session (`setsid`); with `tty`, its stdin (a
    /// PTY slave) becomes the session's controlling terminal, so job
    /// control, `SIGWINCH` and hangup behave as in a real terminal.
    Session { tty: bool },
}

/// What confines a child, made once per session by `crate::sandbox` and
/// applied by every child the session starts. The descriptors stay open
/// for as long as anyone holds the `Arc`.
#[derive(Debug, Default)]
pub struct Confinement {
    /// `cgroup.procs` files, opened for writing, one per hierarchy the
    /// session has a cgroup in: the child writes `0` (itself) into each.
    pub cgroups: Vec<OwnedFd>,
    /// A Landlock ruleset: the child sets `no_new_privs` and restricts
    /// itself with it.
    pub landlock: Option<OwnedFd>,
    /// A child that is still root when it gets here (a root executor
    /// without `--run-as`) empties its capability bounding set and its
    /// capabilities, so neither it nor anything it execs holds one.
    pub drop_caps: bool,
    /// The highest capability number (`/proc/sys/kernel/cap_last_cap`).
    pub cap_last: u32,
}

/// A child to start: a program, its arguments and environment, what it
/// runs in.
#[derive(Debug)]
pub struct Command {
    program: CString,
    argv: Vec<CString>,
    env: Vec<CString>,
    cwd: Option<CString>,
    stdio: [Stdio; 3],
    group: Group,
    rlimits: Vec<(u32, u64)>,
    confinement: Option<Arc<Confinement>>,
    run_as: bool,
}

/// A started child.
#[derive(Debug)]
pub struct Child {
    pub pid: u32,
    pub exit: Exit,
}

/// Where in the child a start failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Stage {
    None = 0,
    Cgroup,
    Group,
    Rlimit,
    Cwd,
    RunAs,
    Capabilities,
    Landlock,
    Descriptors,
    Tty,
    Exec,
}

impl Stage {
    fn from_raw(raw: u32) -> Stage {
        const ALL: [Stage; 11] = [
            Stage::None,
            Stage::Cgroup,
            Stage::Group,
            Stage::Rlimit,
            Stage::Cwd,
            Stage::RunAs,
            Stage::Capabilities,
            Stage::Landlock,
            Stage::Descriptors,
            Stage::Tty,
            Stage::Exec,
        ];
        ALL.get(raw as usize).copied().unwrap_or(Stage::None)
    }

    fn what(self) -> &'static str {
        match self {
            Stage::None => "start",
            Stage::Cgroup => "joining the session's cgroup",
            Stage::Group => "making a process group",
            Stage::Rlimit => "setting a resource limit",
            Stage::Cwd => "entering the working directory",
            Stage::RunAs => "becoming the --run-as user",
            Stage::Capabilities => "dropping capabilities",
            Stage::Landlock => "applying the Landlock ruleset",
            Stage::Descriptors => "setting up descriptors",
            Stage::Tty => "taking the terminal",
            Stage::Exec => "exec",
        }
    }
}

fn cstring(bytes: &[u8]) -> std::io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a NUL byte in a program, argument, variable or path",
        )
    })
}

impl Command {
    /// Run `program` (a path: resolve a bare name first, see
    /// [`super::sys::resolve_program`]) with `argv` (its first element is
    /// the child's `argv[0]`).
    ///
    /// # Errors
    /// `InvalidInput` for a NUL byte in the program or an argument.
    pub fn new<S: AsRef<OsStr>>(program: &Path, argv: &[S]) -> std::io::Result<Command> {
        Ok(Command {
            program: cstring(program.as_os_str().as_bytes())?,
            argv: argv
                .iter()
                .map(|a| cstring(a.as_ref().as_bytes()))
                .collect::<Result<_, _>>()?,
            env: Vec::new(),
            cwd: None,
            stdio: [Stdio::Null, Stdio::Null, Stdio::Null],
            group: Group::New,
            rlimits: Vec::new(),
            confinement: None,
            run_as: true,
        })
    }

    /// The whole environment (nothing is inherited).
    ///
    /// # Errors
    /// `InvalidInput` for a NUL byte in a name or value.
    pub fn env<K: AsRef<OsStr>, V: AsRef<OsStr>>(
        &mut self,
        vars: impl IntoIterator<Item = (K, V)>,
    ) -> std::io::Result<&mut Self> {
        self.env = vars
            .into_iter()
            .map(|(k, v)| {
                let mut kv = k.as_ref().as_bytes().to_vec();
                kv.push(b'=');
                kv.extend_from_slice(v.as_ref().as_bytes());
                cstring(&kv)
            })
            .collect::<Result<_, _>>()?;
        Ok(self)
    }

    /// The working directory (default: the executor's).
    ///
    /// # Errors
    /// `InvalidInput` for a NUL byte in the path.
    pub fn cwd(&mut self, dir: &Path) -> std::io::Result<&mut Self> {
        self.cwd = Some(cstring(dir.as_os_str().as_bytes())?);
        Ok(self)
    }

    pub fn stdin(&mut self, s: Stdio) -> &mut Self {
        self.stdio[0] = s;
        self
    }

    pub fn stdout(&mut self, s: Stdio) -> &mut Self {
        self.stdio[1] = s;
        self
    }

    pub fn stderr(&mut self, s: Stdio) -> &mut Self {
        self.stdio[2] = s;
        self
    }

    pub fn group(&mut self, g: Group) -> &mut Self {
        self.group = g;
        self
    }

    /// Set resource `resource` (`libc::RLIMIT_*`) to `limit`, soft and hard.
    pub fn rlimit(&mut self, resource: u32, limit: u64) -> &mut Self {
        self.rlimits.push((resource, limit));
        self
    }

    /// Confine the child (a session's cgroups and Landlock ruleset).
    pub fn confine(&mut self, c: Option<Arc<Confinement>>) -> &mut Self {
        self.confinement = c;
        self
    }

    /// Whether the child becomes the `--run-as` user when one is set
    /// (default yes; `bmx visor`'s own sessions are the person's).
    pub fn run_as(&mut self, yes: bool) -> &mut Self {
        self.run_as = yes;
        self
    }

    /// Start the child.
    ///
    /// # Errors
    /// The failing stage and the kernel's error, e.g. `ENOENT` from
    /// `exec`, `EAGAIN` from a cgroup at its `pids.max`.
    pub fn spawn(self) -> std::io::Result<Child> {
        spawn(self)
    }
}

/// The failure the child reports: a stage and an errno.
#[repr(C)]
struct Failure {
    stage: u32,
    errno: i32,
}

/// Everything the child reads, prepared by the parent; raw pointers into
/// memory the parent keeps alive (and does not touch) until `clone`
/// returns.
#[repr(C)]
struct ChildArgs {
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    cwd: *const libc::c_char,
    slots: [libc::c_int; 3],
    past_slots: libc::c_uint,
    group: Group,
    rlimits: *const (u32, u64),
    rlimit_count: usize,
    cgroups: *const libc::c_int,
    cgroup_count: usize,
    landlock: libc::c_int,
    drop_caps: bool,
    cap_last: u32,
    run_as: *const super::run_as::RunAs,
    failure: *mut Failure,
}

/// `rt_sigaction(sig, SIG_DFL)` without libc's checks (x86_64's kernel
/// `struct sigaction`; elsewhere libc's refusal stands).
///
/// # Safety
/// A system call on a local struct.
unsafe fn raw_default(sig: libc::c_int) {
    #[cfg(target_arch = "x86_64")]
    {
        #[repr(C)]
        struct KernelSigaction {
            handler: usize,
            flags: u64,
            restorer: usize,
            mask: u64,
        }
        let ksa = KernelSigaction {
            handler: libc::SIG_DFL,
            flags: 0,
            restorer: 0,
            mask: 0,
        };
        libc::syscall(
            libc::SYS_rt_sigaction,
            sig,
            &ksa as *const KernelSigaction,
            std::ptr::null_mut::<KernelSigaction>(),
            8usize,
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = sig;
}

/// The capabilities a root session keeps: those ordinary programs use on
/// files and ids (Docker's default set without `NET_RAW`, `MKNOD`,
/// `SETFCAP`, `SETPCAP`, `SYS_CHROOT` and `AUDIT_WRITE`). Landlock bounds
/// what they reach (files only beneath the sandbox's paths, signals only
/// inside the session); what they leave out is what reaches past it
/// (modules, mounts, raw I/O, raw sockets, reboot, the network's
/// configuration, BPF, raising rlimits). `xterm`, for one, dies when it
/// cannot `chown` its pty.
const KEPT_CAPS: u64 = (1 << 0) // CHOWN
    | (1 << 1) // DAC_OVERRIDE
    | (1 << 3) // FOWNER
    | (1 << 4) // FSETID
    | (1 << 5) // KILL
    | (1 << 6) // SETGID
    | (1 << 7) // SETUID
    | (1 << 10); // NET_BIND_SERVICE

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct` (two of them in version 3).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// The reserved descriptors and the child's stack. One start at a time
/// holds it: the slots are shared, and a start takes a few hundred
/// microseconds (the calling thread waits for the child's `execve`).
struct Spawner {
    slots: [OwnedFd; 3],
    /// `/dev/null`: what a slot holds between starts (so no pipe end
    /// lingers in one), and what [`Stdio::Null`] is.
    null: OwnedFd,
    stack: Stack,
    past_slots: libc::c_uint,
}

static SPAWNER: Mutex<Option<Spawner>> = Mutex::new(None);

/// Reserve the slots now, while the descriptor table is small: the
/// daemon calls this at start, so every later start copies only a few
/// descriptors. Without it the first start reserves them, wherever the
/// lowest free descriptors are then (still correct, possibly costlier).
///
/// # Errors
/// When `/dev/null` cannot be opened or the stack mapped.
pub fn reserve() -> std::io::Result<()> {
    let mut guard = SPAWNER.lock().unwrap_or_else(|p| p.into_inner());
    if guard.is_none() {
        *guard = Some(Spawner::new()?);
    }
    Ok(())
}

fn open_null() -> std::io::Result<OwnedFd> {
    // SAFETY: a C string literal and flags; the result is checked.
    let fd = unsafe {
        libc::open(
            c"/dev/null".as_ptr(),
            libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOCTTY,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Spawner {
    fn new() -> std::io::Result<Spawner> {
        // Descriptors 0-2 that are closed (a daemon started with them
        // closed) are filled with /dev/null and kept: a slot must never
        // be 0, 1 or 2, since the child `dup2`s the slots onto those.
        let mut fillers = Vec::new();
        let mut slots = Vec::new();
        while slots.len() < 3 {
            let fd = open_null()?;
            if fd.as_raw_fd() < 3 {
                fillers.push(fd);
            } else {
                slots.push(fd);
            }
        }
        for f in fillers {
            // Deliberately never closed (see above).
            std::mem::forget(f);
        }
        let past_slots = slots.iter().map(|s| s.as_raw_fd()).max().unwrap_or(2) as u32 + 1;
        let mut it = slots.into_iter();
        let (Some(a), Some(b), Some(c)) = (it.next(), it.next(), it.next()) else {
            unreachable!("three slots were opened")
        };
        Ok(Spawner {
            slots: [a, b, c],
            null: open_null()?,
            stack: Stack::new()?,
            past_slots,
        })
    }

    /// Put `fd` (or /dev/null) into slot `i`, close-on-exec.
    fn fill(&self, i: usize, fd: RawFd) -> std::io::Result<()> {
        // SAFETY: dup3 onto a descriptor this spawner owns.
        if unsafe { libc::dup3(fd, self.slots[i].as_raw_fd(), libc::O_CLOEXEC) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Back to /dev/null in every slot, so no pipe end outlives its start.
    fn clear(&self) {
        for i in 0..3 {
            let _ = self.fill(i, self.null.as_raw_fd());
        }
    }
}

/// The child's stack: mapped once, reused by every start (one at a time).
struct Stack {
    base: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is only touched by the child of a start, while the
// spawner's lock is held.
unsafe impl Send for Stack {}

impl Stack {
    const LEN: usize = 256 * 1024;

    fn new() -> std::io::Result<Stack> {
        // SAFETY: a fresh anonymous private mapping; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                Self::LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Stack {
            base,
            len: Self::LEN,
        })
    }

    /// The top, 16-byte aligned (stacks grow down on every Linux target
    /// bmx builds for).
    fn top(&self) -> *mut libc::c_void {
        let end = self.base as usize + self.len;
        (end & !15) as *mut libc::c_void
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

fn pointers(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

fn spawn(cmd: Command) -> std::io::Result<Child> {
    if cmd.argv.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "an empty argument list",
        ));
    }
    let argv = pointers(&cmd.argv);
    let envp = pointers(&cmd.env);
    let cgroups: Vec<libc::c_int> = cmd
        .confinement
        .as_ref()
        .map(|c| c.cgroups.iter().map(|f| f.as_raw_fd()).collect())
        .unwrap_or_default();
    let landlock = cmd
        .confinement
        .as_ref()
        .and_then(|c| c.landlock.as_ref())
        .map_or(-1, |f| f.as_raw_fd());
    let run_as = if cmd.run_as {
        super::run_as::get().map_or(std::ptr::null(), |u| u as *const _)
    } else {
        std::ptr::null()
    };
    let mut failure = Failure { stage: 0, errno: 0 };

    let mut guard = SPAWNER.lock().unwrap_or_else(|p| p.into_inner());
    if guard.is_none() {
        *guard = Some(Spawner::new()?);
    }
    let spawner = guard.as_ref().expect("made above");
    for (i, s) in cmd.stdio.iter().enumerate() {
        let fd = match s {
            Stdio::Null => spawner.null.as_raw_fd(),
            Stdio::Fd(f) => f.as_raw_fd(),
        };
        if let Err(e) = spawner.fill(i, fd) {
            spawner.clear();
            return Err(e);
        }
    }
    let args = ChildArgs {
        program: cmd.program.as_ptr(),
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        cwd: cmd.cwd.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
        slots: [
            spawner.slots[0].as_raw_fd(),
            spawner.slots[1].as_raw_fd(),
            spawner.slots[2].as_raw_fd(),
        ],
        past_slots: spawner.past_slots,
        group: cmd.group,
        rlimits: cmd.rlimits.as_ptr(),
        rlimit_count: cmd.rlimits.len(),
        cgroups: cgroups.as_ptr(),
        cgroup_count: cgroups.len(),
        landlock,
        drop_caps: cmd.confinement.as_ref().is_some_and(|c| c.drop_caps),
        cap_last: cmd.confinement.as_ref().map_or(0, |c| c.cap_last),
        run_as,
        failure: &mut failure,
    };
    // The swept set stays locked across the clone, so the sweeper cannot
    // miss an early exit of a child that ends up swept.
    let registry = match super::exits::start() {
        Ok(r) => r,
        Err(e) => {
            spawner.clear();
            return Err(e);
        }
    };
    let mut pidfd: libc::c_int = -1;
    // The orphan reaper must not take this child's exit status: it is
    // registered as owned under the reaper's own lock.
    let started = super::sys::spawn_owned(|| {
        let pid = clone_child(&args, spawner.stack.top(), &mut pidfd)?;
        Ok((pid, pid as u32))
    });
    spawner.clear();
    drop(guard);
    let pid = started? as u32;
    // SAFETY: the kernel wrote a new pidfd for the child (CLONE_PIDFD).
    let mut exit = registry.adopt(pid, unsafe { OwnedFd::from_raw_fd(pidfd) });
    // The child's copies are the caller's to close; ours go now, so a
    // pipe's reader sees EOF when the child (not the executor) closes it.
    drop(cmd.stdio);
    // SAFETY: a volatile read of what the child wrote before it exited
    // (the memory is shared; the compiler knows nothing of the child).
    let failure = unsafe { std::ptr::read_volatile(&failure) };
    if failure.stage != Stage::None as u32 {
        // The child has exited 127; reap it so no zombie is left.
        let _ = exit.reap_now();
        let stage = Stage::from_raw(failure.stage);
        let os = std::io::Error::from_raw_os_error(failure.errno);
        return Err(std::io::Error::new(
            os.kind(),
            format!("{}: {os}", stage.what()),
        ));
    }
    Ok(Child { pid, exit })
}

/// `clone` the child with every signal blocked in this thread (so no
/// handler of the executor runs on the child's stack in shared memory),
/// the old mask back afterwards. Returns the child's pid; by then the
/// child has called `execve` or exited.
fn clone_child(
    args: &ChildArgs,
    stack_top: *mut libc::c_void,
    pidfd: &mut libc::c_int,
) -> std::io::Result<libc::pid_t> {
    // SAFETY: sigset operations on locals; clone with a stack this
    // process mapped and an argument that outlives the call (the calling
    // thread is suspended until the child leaves the shared memory, by
    // CLONE_VFORK).
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let flags = libc::CLONE_VM
            | libc::CLONE_VFORK
            | libc::CLONE_FILES
            | libc::CLONE_PIDFD
            | libc::SIGCHLD;
        let pid = libc::clone(
            child_main,
            stack_top,
            flags,
            args as *const ChildArgs as *mut libc::c_void,
            pidfd as *mut libc::c_int,
        );
        let err = std::io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        if pid < 0 {
            return Err(err);
        }
        Ok(pid)
    }
}

/// The child, between `clone` and `execve`. Async-signal-safe and then
/// some: raw system calls on the parent's prepared memory only.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's `ChildArgs`, alive and untouched until
    // this child execs or exits (CLONE_VFORK).
    let a = unsafe { &*(arg as *const ChildArgs) };
    // SAFETY: see the module's doc: raw system calls on memory prepared by
    // the parent; `fail` writes the shared failure record and `_exit`s.
    unsafe {
        let fail = |stage: Stage| -> ! {
            (*a.failure).stage = stage as u32;
            (*a.failure).errno = *libc::__errno_location();
            libc::_exit(127)
        };
        // Every handler back to default; the mask (all blocked, inherited
        // from the parent's thread) is cleared just before exec.
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        for sig in 1..=64 {
            if sig != libc::SIGKILL
                && sig != libc::SIGSTOP
                && libc::sigaction(sig, &dfl, std::ptr::null_mut()) != 0
            {
                // glibc refuses its own two signals (32, 33); an ignored
                // one would stay ignored across exec. The kernel takes
                // them.
                raw_default(sig);
            }
        }
        for i in 0..a.cgroup_count {
            let fd = *a.cgroups.add(i);
            if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                fail(Stage::Cgroup);
            }
        }
        let grouped = match a.group {
            Group::Inherit => 0,
            Group::New => libc::setpgid(0, 0),
            Group::Session { .. } => libc::setsid(),
        };
        if grouped < 0 {
            fail(Stage::Group);
        }
        for i in 0..a.rlimit_count {
            let (resource, value) = *a.rlimits.add(i);
            let lim = libc::rlimit64 {
                rlim_cur: value,
                rlim_max: value,
            };
            if libc::syscall(
                libc::SYS_prlimit64,
                0,
                resource as libc::c_long,
                &lim as *const libc::rlimit64,
                std::ptr::null_mut::<libc::rlimit64>(),
            ) != 0
            {
                fail(Stage::Rlimit);
            }
        }
        if !a.cwd.is_null() && libc::chdir(a.cwd) != 0 {
            fail(Stage::Cwd);
        }
        if !a.run_as.is_null() && super::run_as::become_user(&*a.run_as).is_err() {
            fail(Stage::RunAs);
        }
        if a.drop_caps && libc::geteuid() == 0 {
            // One `capset`, no bounding-set drops (33 system calls, each a
            // new set of credentials): with `no_new_privs`, set first, no
            // `execve` grants more than the caller's permitted set, not
            // even root's (the kernel intersects the new permitted set
            // with the old one), nor a set-uid program, nor file
            // capabilities. An inheritable set of 0 clears the ambient
            // set with it.
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                fail(Stage::Capabilities);
            }
            let header = CapHeader {
                version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
                pid: 0,
            };
            let kept = CapData {
                effective: KEPT_CAPS as u32,
                permitted: KEPT_CAPS as u32,
                inheritable: 0,
            };
            let data = [kept, CapData::default()];
            if libc::syscall(libc::SYS_capset, &header, data.as_ptr()) != 0 {
                fail(Stage::Capabilities);
            }
        }
        if a.landlock >= 0 {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                fail(Stage::Landlock);
            }
            if libc::syscall(libc::SYS_landlock_restrict_self, a.landlock, 0) != 0 {
                fail(Stage::Landlock);
            }
        }
        // A private descriptor table holding only what is below the
        // slots (the kernel copies just those), then the slots as 0-2.
        if libc::syscall(
            libc::SYS_close_range,
            a.past_slots,
            u32::MAX,
            libc::CLOSE_RANGE_UNSHARE,
        ) != 0
        {
            // Before Linux 5.9: a full private copy, closed below.
            if libc::unshare(libc::CLONE_FILES) != 0 {
                fail(Stage::Descriptors);
            }
        }
        for (i, &slot) in a.slots.iter().enumerate() {
            if libc::dup2(slot, i as libc::c_int) < 0 {
                fail(Stage::Descriptors);
            }
        }
        if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) != 0 {
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            let max = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
                lim.rlim_cur.min(1 << 20) as i32
            } else {
                4096
            };
            for fd in 3..max {
                libc::close(fd);
            }
        }
        if matches!(a.group, Group::Session { tty: true })
            && libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0
        {
            fail(Stage::Tty);
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::execve(a.program, a.argv, a.envp);
        fail(Stage::Exec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn pipe() -> (OwnedFd, OwnedFd) {
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap()
    }

    fn read_all(fd: OwnedFd) -> String {
        let mut s = String::new();
        std::fs::File::from(fd).read_to_string(&mut s).unwrap();
        s
    }

    fn sh(script: &str) -> Command {
        Command::new(Path::new("/bin/sh"), &["sh", "-c", script]).unwrap()
    }

    #[tokio::test]
    async fn output_exit_code_and_environment_arrive() {
        let (r, w) = pipe();
        let mut cmd = sh("echo \"$GREETING\" from $(pwd); exit 7");
        cmd.env([("GREETING", "hello")])
            .unwrap()
            .cwd(Path::new("/usr"))
            .unwrap()
            .stdout(Stdio::Fd(w));
        let child = cmd.spawn().unwrap();
        assert_eq!(read_all(r), "hello from /usr\n");
        let status = child.exit.wait().await.unwrap();
        assert_eq!(status.code(), Some(7));
    }

    #[tokio::test]
    async fn the_child_inherits_only_its_three_descriptors() {
        // A descriptor without close-on-exec, as a careless library makes.
        let leaky = std::fs::File::open("/dev/null").unwrap();
        let raw = leaky.as_raw_fd();
        // SAFETY: clearing FD_CLOEXEC on a descriptor this test owns.
        unsafe { libc::fcntl(raw, libc::F_SETFD, 0) };
        let (r, w) = pipe();
        let mut cmd = sh("ls /proc/self/fd");
        cmd.stdout(Stdio::Fd(w));
        let child = cmd.spawn().unwrap();
        let listed = read_all(r);
        child.exit.wait().await.unwrap();
        // 0, 1, 2 and the one `ls` opens to read the directory.
        let fds: Vec<&str> = listed.split_whitespace().collect();
        assert_eq!(fds.len(), 4, "{listed}");
        assert!(!fds.contains(&raw.to_string().as_str()), "{listed}");
    }

    #[tokio::test]
    async fn a_failed_exec_is_an_error_with_its_stage_and_leaves_no_zombie() {
        let err = Command::new(Path::new("/nonexistent/prog"), &["prog"])
            .unwrap()
            .spawn()
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
        assert!(err.to_string().starts_with("exec:"), "{err}");
        let err = {
            let mut cmd = sh("true");
            cmd.cwd(Path::new("/nonexistent-dir")).unwrap();
            cmd.spawn().unwrap_err()
        };
        assert!(err.to_string().contains("working directory"), "{err}");
    }

    #[tokio::test]
    async fn a_new_group_and_a_new_session() {
        let (r, w) = pipe();
        let mut cmd = sh("ps -o pid=,pgid=,sid= -p $$");
        cmd.stdout(Stdio::Fd(w))
            .group(Group::Session { tty: false });
        let child = cmd.spawn().unwrap();
        let pid = child.pid.to_string();
        let out = read_all(r);
        child.exit.wait().await.unwrap();
        let ids: Vec<&str> = out.split_whitespace().collect();
        assert_eq!(ids, [pid.as_str(); 3], "leader of its group and session");
    }

    #[tokio::test]
    async fn rlimits_are_set_and_signals_start_at_their_defaults() {
        let (r, w) = pipe();
        let mut cmd = sh("ulimit -f; grep -E '^Sig(Ign|Blk)' /proc/self/status");
        cmd.stdout(Stdio::Fd(w))
            .rlimit(libc::RLIMIT_FSIZE, 1024 * 512);
        let child = cmd.spawn().unwrap();
        let out = read_all(r);
        child.exit.wait().await.unwrap();
        let mut lines = out.lines();
        assert_eq!(lines.next(), Some("1024"), "{out}");
        for l in lines {
            assert!(l.ends_with("0000000000000000"), "{out}");
        }
    }

    #[tokio::test]
    async fn a_killed_child_reports_its_signal() {
        let child = sh("sleep 300").spawn().unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        use std::os::unix::process::ExitStatusExt;
        let status = child.exit.wait().await.unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }
}

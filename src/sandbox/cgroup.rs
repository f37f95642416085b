//! One cgroup per session: every process of the session is in it before
//! it runs any code of its own, so stopping the session kills everything
//! it ever started, whatever that did to its environment, process group
//! or parent; and the session's bounds (memory, tasks, CPU) are the
//! kernel's.
//!
//! Three kinds of host, all handled here:
//!
//! * **pure cgroup v2** (`/sys/fs/cgroup` is `cgroup2`): one directory
//!   per session, with the `memory`, `pids` and `cpu` controllers enabled
//!   above it when bounds ask for them; `cgroup.kill` ends it.
//! * **hybrid** (a `cgroup2` tree at `/sys/fs/cgroup/unified` for
//!   membership, usually with no controllers, beside cgroup v1
//!   controllers): the session's directory in the v2 tree (membership and
//!   `cgroup.kill`), plus one in each v1 controller a bound needs (`pids`,
//!   `memory`, `cpu`).
//! * **pure v1**: the session's directory in the `pids` (else `memory`)
//!   hierarchy is its membership; the kill is a loop of SIGKILLs over its
//!   `cgroup.procs` until it is empty.
//!
//! Where: under the executor's own cgroup in each hierarchy (read from
//! `/proc/self/cgroup`), in a directory `bmx-<pid>` of this executor, so
//! a non-root executor works in a subtree delegated to it (systemd's
//! `Delegate=yes`) and two executors on one host never share one. A
//! directory of an executor that died (its pid gone) is killed and
//! removed by the next one that starts beside it.
//!
//! No crate: `cgroups-rs` knows v1 and v2 but not a hybrid host's two
//! trees at once, and bmx needs only `mkdir`, a few writes and `rmdir`;
//! what a child writes to join (`0` into `cgroup.procs`) must be a
//! descriptor opened beforehand anyway (`crate::process::spawn`).

use std::io::Write as _;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A v1 controller bmx uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Controller {
    Pids,
    Memory,
    Cpu,
}

impl Controller {
    fn name(self) -> &'static str {
        match self {
            Controller::Pids => "pids",
            Controller::Memory => "memory",
            Controller::Cpu => "cpu",
        }
    }
}

/// One mounted hierarchy and this process's place in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    /// `None`: the cgroup v2 tree; else the v1 controller it carries.
    pub controller: Option<Controller>,
    /// Where it is mounted.
    pub mount: PathBuf,
    /// This process's cgroup in it (relative to the mount).
    pub own: PathBuf,
}

impl Hierarchy {
    /// This process's cgroup directory.
    pub fn own_dir(&self) -> PathBuf {
        self.mount
            .join(self.own.strip_prefix("/").unwrap_or(&self.own))
    }
}

/// The hierarchies of this host that bmx can use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hierarchies {
    pub v2: Option<Hierarchy>,
    pub v1: Vec<Hierarchy>,
}

/// Parse `/proc/self/mountinfo` and `/proc/self/cgroup` (their texts).
pub fn parse(mountinfo: &str, self_cgroup: &str) -> Hierarchies {
    let mut v2_own = None;
    let mut v1_own: Vec<(String, PathBuf)> = Vec::new();
    for line in self_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrls), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if ctrls.is_empty() {
            v2_own = Some(PathBuf::from(path));
        } else {
            for c in ctrls.split(',') {
                v1_own.push((c.to_owned(), PathBuf::from(path)));
            }
        }
    }
    let mut out = Hierarchies::default();
    for line in mountinfo.lines() {
        // `id parent major:minor root mountpoint options [optional...] -
        // fstype source superoptions`
        let Some((pre, post)) = line.split_once(" - ") else {
            continue;
        };
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        if pre.len() < 5 || post.len() < 3 {
            continue;
        }
        // A bind mount of a subtree (root other than `/`) would put the
        // executor's path elsewhere: skip it.
        if pre[3] != "/" {
            continue;
        }
        let mount = PathBuf::from(unescape(pre[4]));
        match post[0] {
            "cgroup2" if out.v2.is_none() => {
                if let Some(own) = &v2_own {
                    out.v2 = Some(Hierarchy {
                        controller: None,
                        mount,
                        own: own.clone(),
                    });
                }
            }
            "cgroup" => {
                let opts: Vec<&str> = post[2].split(',').collect();
                for c in [Controller::Pids, Controller::Memory, Controller::Cpu] {
                    if !opts.contains(&c.name()) || out.v1.iter().any(|h| h.controller == Some(c)) {
                        continue;
                    }
                    if let Some((_, own)) = v1_own.iter().find(|(n, _)| n == c.name()) {
                        out.v1.push(Hierarchy {
                            controller: Some(c),
                            mount: mount.clone(),
                            own: own.clone(),
                        });
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// This host's hierarchies, read from `/proc/self`.
pub fn detect() -> Hierarchies {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let cg = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    parse(&mi, &cg)
}

/// A session's bounds, in the kernel's units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    pub pids: Option<u64>,
    /// CPU time per 100 ms period, in microseconds (`cpus × 100 000`).
    pub cpu_quota_us: Option<u64>,
}

/// CFS period bmx uses with `cpu_quota_us`.
pub const CPU_PERIOD_US: u64 = 100_000;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no cgroup hierarchy is writable here")]
    None,
    #[error("the {0} controller is not available to this executor")]
    Controller(&'static str),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_owned(),
        source,
    }
}

fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io(path))?;
    f.write_all(value.as_bytes()).map_err(io(path))
}

/// Open `cgroup.procs` of `dir` for the child's join.
fn open_procs(dir: &Path) -> Result<OwnedFd, CgroupError> {
    let path = dir.join("cgroup.procs");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .map_err(io(&path))?;
    Ok(OwnedFd::from(f))
}

/// What an executor's cgroups can do; decided at start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Offer {
    /// Membership and kill: `v2`, `hybrid`, `v1`, or none.
    pub kind: Option<&'static str>,
    pub memory: bool,
    pub pids: bool,
    pub cpu: bool,
}

/// One directory of the executor's tree.
#[derive(Debug, Clone)]
struct Place {
    controller: Option<Controller>,
    dir: PathBuf,
}

/// The executor's own subtree: `bmx-<pid>` in each usable hierarchy.
#[derive(Debug)]
pub struct Tree {
    places: Vec<Place>,
    /// Controllers enabled for sessions in the v2 tree.
    v2_controllers: Vec<&'static str>,
    offer: Offer,
}

impl Tree {
    /// Make this executor's subtree. `move_self`: when the v2 controllers
    /// the bounds need cannot be enabled because this process sits in the
    /// cgroup that would have to enable them, move it into a leaf of its
    /// own first (a daemon under systemd's `Delegate=yes` does this; an
    /// embedding host does not want its process moved).
    ///
    /// # Errors
    /// [`CgroupError::None`] when no hierarchy is writable.
    pub fn create(h: &Hierarchies, want: &Limits, move_self: bool) -> Result<Tree, CgroupError> {
        // One tree per executor, several executors per process (a
        // platform or a test may run more than one).
        static SERIAL: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("bmx-{}-{serial}", std::process::id());
        let mut places = Vec::new();
        let mut v2_controllers = Vec::new();
        if let Some(v2) = &h.v2 {
            let own = v2.own_dir();
            sweep_stale(&own);
            let dir = own.join(&name);
            if make_dir(&dir).is_ok() {
                v2_controllers = enable_v2(&own, &dir, want, move_self);
                places.push(Place {
                    controller: None,
                    dir,
                });
            }
        }
        let v2_has = |c: &str| v2_controllers.contains(&c);
        // v1 controllers: for a bound the v2 tree cannot enforce, and
        // `pids` (else `memory`) for membership when there is no v2 tree.
        for hv1 in &h.v1 {
            let Some(c) = hv1.controller else { continue };
            let needed = match c {
                Controller::Pids => (want.pids.is_some() && !v2_has("pids")) || places.is_empty(),
                Controller::Memory => {
                    (want.memory_bytes.is_some() && !v2_has("memory")) || places.is_empty()
                }
                Controller::Cpu => want.cpu_quota_us.is_some() && !v2_has("cpu"),
            };
            if !needed {
                continue;
            }
            let own = hv1.own_dir();
            sweep_stale(&own);
            let dir = own.join(&name);
            if make_dir(&dir).is_ok() {
                if c == Controller::Memory {
                    // Charges of a v1 memory cgroup stay with it unless it
                    // is hierarchical (the default on every current kernel).
                    let _ = write_file(&dir.join("memory.use_hierarchy"), "1");
                }
                places.push(Place {
                    controller: Some(c),
                    dir,
                });
            }
        }
        if places.is_empty() {
            return Err(CgroupError::None);
        }
        let has_v1 = |c| places.iter().any(|p| p.controller == Some(c));
        let kind = match (
            places.iter().any(|p| p.controller.is_none()),
            places.len() > 1,
        ) {
            (true, false) => "v2",
            (true, true) => "hybrid",
            (false, _) => "v1",
        };
        let offer = Offer {
            kind: Some(kind),
            memory: v2_has("memory") || has_v1(Controller::Memory),
            pids: v2_has("pids") || has_v1(Controller::Pids),
            cpu: v2_has("cpu") || has_v1(Controller::Cpu),
        };
        Ok(Tree {
            places,
            v2_controllers,
            offer,
        })
    }

    pub fn offer(&self) -> &Offer {
        &self.offer
    }

    /// A cgroup for one session (`name`, an id) with `limits`.
    ///
    /// # Errors
    /// When a directory cannot be made or a limit written; what was made
    /// is removed again.
    pub fn group(&self, name: &str, limits: &Limits) -> Result<Group, CgroupError> {
        let mut group = Group {
            dirs: Vec::new(),
            procs: Vec::new(),
        };
        // A directory left by an earlier life of the same name (a session
        // actor that crashed before its cleanup) is emptied and made anew:
        // a cgroup is never shared.
        if self.places.iter().any(|p| p.dir.join(name).exists()) {
            self.kill_group(name);
        }
        for p in &self.places {
            let dir = p.dir.join(name);
            if let Err(source) = std::fs::create_dir(&dir) {
                group.remove();
                return Err(CgroupError::Io { path: dir, source });
            }
            group.dirs.push((p.controller, dir));
        }
        if let Err(e) = self.limit(&group, limits) {
            group.remove();
            return Err(e);
        }
        for (_, dir) in &group.dirs {
            match open_procs(dir) {
                Ok(fd) => group.procs.push(fd),
                Err(e) => {
                    group.remove();
                    return Err(e);
                }
            }
        }
        Ok(group)
    }

    fn limit(&self, group: &Group, l: &Limits) -> Result<(), CgroupError> {
        let v2 = group.dirs.iter().find(|(c, _)| c.is_none()).map(|(_, d)| d);
        let v1 = |c: Controller| {
            group
                .dirs
                .iter()
                .find(|(k, _)| *k == Some(c))
                .map(|(_, d)| d)
        };
        let on_v2 = |c: &str| self.v2_controllers.contains(&c);
        if let Some(bytes) = l.memory_bytes {
            match (v2.filter(|_| on_v2("memory")), v1(Controller::Memory)) {
                (Some(d), _) => {
                    write_file(&d.join("memory.max"), &bytes.to_string())?;
                    // The bound is memory, not memory plus swap.
                    if d.join("memory.swap.max").exists() {
                        write_file(&d.join("memory.swap.max"), "0")?;
                    }
                }
                (None, Some(d)) => {
                    write_file(&d.join("memory.limit_in_bytes"), &bytes.to_string())?;
                    let memsw = d.join("memory.memsw.limit_in_bytes");
                    if memsw.exists() {
                        write_file(&memsw, &bytes.to_string())?;
                    }
                }
                (None, None) => return Err(CgroupError::Controller("memory")),
            }
        }
        if let Some(n) = l.pids {
            match (v2.filter(|_| on_v2("pids")), v1(Controller::Pids)) {
                (Some(d), _) | (None, Some(d)) => write_file(&d.join("pids.max"), &n.to_string())?,
                (None, None) => return Err(CgroupError::Controller("pids")),
            }
        }
        if let Some(q) = l.cpu_quota_us {
            match (v2.filter(|_| on_v2("cpu")), v1(Controller::Cpu)) {
                (Some(d), _) => write_file(&d.join("cpu.max"), &format!("{q} {CPU_PERIOD_US}"))?,
                (None, Some(d)) => {
                    write_file(&d.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                    write_file(&d.join("cpu.cfs_quota_us"), &q.to_string())?;
                }
                (None, None) => return Err(CgroupError::Controller("cpu")),
            }
        }
        Ok(())
    }

    /// Kill what is in the session cgroup `name` and remove it.
    pub fn kill_group(&self, name: &str) {
        let g = Group {
            dirs: self
                .places
                .iter()
                .map(|p| (p.controller, p.dir.join(name)))
                .filter(|(_, d)| d.exists())
                .collect(),
            procs: Vec::new(),
        };
        g.kill();
        g.remove();
    }

    /// Kill whatever is left in the tree and remove it (the executor's
    /// last act).
    pub fn remove(&self) {
        for p in &self.places {
            if let Ok(entries) = std::fs::read_dir(&p.dir) {
                for e in entries.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        let g = Group {
                            dirs: vec![(p.controller, e.path())],
                            procs: Vec::new(),
                        };
                        g.kill();
                        g.remove();
                    }
                }
            }
            let _ = std::fs::remove_dir(&p.dir);
        }
    }
}

/// Enable in the v2 tree the controllers `want` needs, in `own` (the
/// executor's cgroup) and `dir` (its `bmx-<pid>`). Returns those enabled
/// for sessions.
fn enable_v2(own: &Path, dir: &Path, want: &Limits, move_self: bool) -> Vec<&'static str> {
    let wanted: Vec<&'static str> = [
        ("memory", want.memory_bytes.is_some()),
        ("pids", want.pids.is_some()),
        ("cpu", want.cpu_quota_us.is_some()),
    ]
    .into_iter()
    .filter(|(_, w)| *w)
    .map(|(c, _)| c)
    .collect();
    let available = std::fs::read_to_string(own.join("cgroup.controllers")).unwrap_or_default();
    let mut enabled = Vec::new();
    for c in wanted {
        if !available.split_whitespace().any(|a| a == c) {
            continue;
        }
        let mut ok = enable(own, c);
        if !ok && move_self {
            // EBUSY: `own` holds processes (this one). Under a delegated
            // subtree the executor moves itself into a leaf and tries
            // again; it fails again if other processes share `own`.
            let leaf = own.join(format!("bmx-{}-executor", std::process::id()));
            // (Swept as this process's: its name starts `bmx-<pid>-`.)
            if make_dir(&leaf).is_ok() && write_file(&leaf.join("cgroup.procs"), "0").is_ok() {
                ok = enable(own, c);
            }
        }
        if ok && enable(dir, c) {
            enabled.push(c);
        }
    }
    enabled
}

fn enable(dir: &Path, controller: &str) -> bool {
    let current = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
    current.split_whitespace().any(|c| c == controller)
        || write_file(
            &dir.join("cgroup.subtree_control"),
            &format!("+{controller}"),
        )
        .is_ok()
}

/// `mkdir` (0755 is the cgroup file system's own default; the mode is not
/// an access control there).
fn make_dir(dir: &Path) -> Result<(), CgroupError> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(CgroupError::Io {
            path: dir.to_owned(),
            source: e,
        }),
    }
}

/// Kill and remove the `bmx-<pid>` directories under `own` whose executor
/// is gone: what a crashed executor left running dies with the next one's
/// start.
fn sweep_stale(own: &Path) {
    let Ok(entries) = std::fs::read_dir(own) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("bmx-"))
            .and_then(|n| n.split('-').next())
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() as i32 || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let dir = e.path();
        if let Ok(sessions) = std::fs::read_dir(&dir) {
            for s in sessions.flatten() {
                if s.file_type().is_ok_and(|t| t.is_dir()) {
                    let g = Group {
                        dirs: vec![(None, s.path())],
                        procs: Vec::new(),
                    };
                    g.kill();
                    g.remove();
                }
            }
        }
        // A leaf an executor moved itself into is empty once it died.
        let _ = std::fs::remove_dir(&dir);
        tracing::info!(dir = %dir.display(), "removed the cgroup of an executor that is gone");
    }
}

/// One session's cgroup: a directory per hierarchy, and their
/// `cgroup.procs` opened for the children's join.
#[derive(Debug)]
pub struct Group {
    dirs: Vec<(Option<Controller>, PathBuf)>,
    procs: Vec<OwnedFd>,
}

/// How long a kill waits for the cgroup to empty.
const KILL_DEADLINE: Duration = Duration::from_secs(5);

impl Group {
    /// The `cgroup.procs` descriptors a child writes itself into.
    pub fn join_fds(&self) -> Vec<OwnedFd> {
        self.procs
            .iter()
            .filter_map(|f| f.try_clone().ok())
            .collect()
    }

    /// A leaf for one process (or tool call, or server) of the session in
    /// the v2 tree, and the descriptors its child writes itself into: the
    /// leaf's `cgroup.procs`, and the session's in each v1 hierarchy.
    /// `None` for the leaf where the session has no v2 directory (then
    /// the session's own membership is all there is). Killing the leaf
    /// ([`kill_leaf`]) ends everything that process started, whatever it
    /// did to its environment or group; the leaf is inside the session's
    /// cgroup, so the session's bounds and its end cover it.
    ///
    /// # Errors
    /// When the leaf cannot be made or opened.
    ///
    /// `reuse`: a leaf of this session made before and left empty (its
    /// process gone, what it started killed): joined again instead of
    /// making and removing a directory per process.
    pub fn leaf(
        &self,
        name: &str,
        reuse: Option<PathBuf>,
    ) -> Result<(Option<PathBuf>, Vec<OwnedFd>), CgroupError> {
        let mut fds = Vec::new();
        let mut leaf = None;
        for ((c, dir), fd) in self.dirs.iter().zip(&self.procs) {
            if c.is_none() {
                let fresh = reuse.is_none();
                let d = reuse.clone().unwrap_or_else(|| dir.join(name));
                if fresh {
                    std::fs::create_dir(&d).map_err(io(&d))?;
                }
                match open_procs(&d) {
                    Ok(f) => fds.push(f),
                    Err(e) => {
                        let _ = std::fs::remove_dir(&d);
                        return Err(e);
                    }
                }
                leaf = Some(d);
            } else {
                fds.push(fd.try_clone().map_err(io(dir))?);
            }
        }
        Ok((leaf, fds))
    }

    /// The directories (for docs, tests and logs).
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.dirs.iter().map(|(_, d)| d.as_path())
    }

    /// Pids in the session's cgroup (and its leaves) now.
    pub fn pids(&self) -> Vec<i32> {
        match self.dirs.first() {
            Some((_, dir)) => self.pids_in(dir),
            None => Vec::new(),
        }
    }

    /// SIGKILL everything in the session's cgroup, and wait (at most
    /// [`KILL_DEADLINE`]) until it is empty. Blocking.
    pub fn kill(&self) {
        let v2 = self.dirs.iter().find(|(c, _)| c.is_none()).map(|(_, d)| d);
        if let Some(d) = v2 {
            if write_file(&d.join("cgroup.kill"), "1").is_ok() {
                self.wait_empty(d);
                return;
            }
        }
        // No cgroup.kill (v1, or v2 before Linux 5.14): SIGKILL what is
        // listed until nothing is. A process cannot fork once killed, so
        // each pass leaves only what was forked during the last one.
        let Some((_, dir)) = self.dirs.first() else {
            return;
        };
        let end = Instant::now() + KILL_DEADLINE;
        let mut pause = Duration::from_micros(200);
        loop {
            let pids = self.pids_in(dir);
            if pids.is_empty() || Instant::now() >= end {
                return;
            }
            for p in pids {
                // SAFETY: kill(2) with a pid read from the cgroup.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// Pids in `dir` and in its leaves.
    fn pids_in(&self, dir: &Path) -> Vec<i32> {
        let read = |d: &Path| -> Vec<i32> {
            std::fs::read_to_string(d.join("cgroup.procs"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        };
        let mut out = read(dir);
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    out.extend(read(&e.path()));
                }
            }
        }
        out
    }

    fn wait_empty(&self, dir: &Path) {
        let end = Instant::now() + KILL_DEADLINE;
        let mut pause = Duration::from_micros(200);
        while Instant::now() < end {
            let populated = std::fs::read_to_string(dir.join("cgroup.events"))
                .map(|e| e.lines().any(|l| l == "populated 1"))
                .unwrap_or(false);
            if !populated {
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// OOM kills in the session so far (`memory.events` or v1
    /// `memory.oom_control`); 0 when no memory controller is in use.
    pub fn oom_kills(&self) -> u64 {
        for (c, d) in &self.dirs {
            let (file, key) = match c {
                None => ("memory.events", "oom_kill"),
                Some(Controller::Memory) => ("memory.oom_control", "oom_kill"),
                _ => continue,
            };
            let Ok(text) = std::fs::read_to_string(d.join(file)) else {
                continue;
            };
            if let Some(n) = text.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == key).then(|| v.trim().parse::<u64>().ok())?
            }) {
                return n;
            }
        }
        0
    }

    /// Remove the directories (after [`Group::kill`]); a directory still
    /// busy (a zombie not yet reaped) is tried again briefly.
    pub fn remove(&self) {
        for (_, d) in &self.dirs {
            // Leaves first: a cgroup with children cannot be removed.
            if let Ok(entries) = std::fs::read_dir(d) {
                for e in entries.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        remove_dir_retrying(&e.path());
                    }
                }
            }
            remove_dir_retrying(d);
        }
    }
}

/// SIGKILL everything in a leaf (`cgroup.kill`; before Linux 5.14 a loop
/// over its `cgroup.procs`). Does not wait. Blocking (a few writes).
pub fn kill_leaf(leaf: &Path) {
    if write_file(&leaf.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    for _ in 0..64 {
        let pids: Vec<i32> = std::fs::read_to_string(leaf.join("cgroup.procs"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        if pids.is_empty() {
            return;
        }
        for p in pids {
            // SAFETY: kill(2) with a pid read from the cgroup.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
    }
}

/// Remove an empty leaf; `false` while it still holds a process (the
/// session's removal takes it later).
pub fn remove_leaf(leaf: &Path) -> bool {
    matches!(std::fs::remove_dir(leaf), Ok(())) || !leaf.exists()
}

fn remove_dir_retrying(d: &Path) {
    for attempt in 0..50 {
        match std::fs::remove_dir(d) {
            Ok(()) => break,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
            Err(_) if attempt < 49 => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => {
                tracing::warn!(dir = %d.display(), error = %e, "cannot remove a session cgroup");
            }
        }
    }
}

/// The cgroup (v2 path) a process is in, from `/proc/<pid>/cgroup`.
pub fn cgroup_of(pid: i32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_owned))
}

/// Whether `pid` is in a session cgroup of an executor of this process,
/// in any hierarchy (for the confirmation socket's peer check).
pub fn in_sessions(pid: i32) -> bool {
    let me = format!("/bmx-{}-", std::process::id());
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map(|t| {
            t.lines().any(|l| {
                l.splitn(3, ':').nth(2).is_some_and(|path| {
                    path.find(&me).is_some_and(|i| {
                        // `bmx-<pid>-<n>/<session>`, not the executor's own
                        // leaf `bmx-<pid>-executor`.
                        let rest = &path[i + me.len()..];
                        !rest.starts_with("executor") && rest.contains('/')
                    })
                })
            })
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID_MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const HYBRID_SELF: &str = "\
8:pids:/
4:memory:/process_api/ec8b
1:cpu:/
0::/
";

    #[test]
    fn a_hybrid_host_has_both_trees_and_our_place_in_each() {
        let h = parse(HYBRID_MOUNTINFO, HYBRID_SELF);
        let v2 = h.v2.unwrap();
        assert_eq!(v2.mount, Path::new("/sys/fs/cgroup/unified"));
        assert_eq!(v2.own_dir(), Path::new("/sys/fs/cgroup/unified"));
        let mem =
            h.v1.iter()
                .find(|x| x.controller == Some(Controller::Memory))
                .unwrap();
        assert_eq!(
            mem.own_dir(),
            Path::new("/sys/fs/cgroup/memory/process_api/ec8b")
        );
        assert_eq!(h.v1.len(), 3);
    }

    #[test]
    fn a_pure_v2_host_under_systemd() {
        let mi = "25 21 0:22 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        let me = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/bmx.service\n";
        let h = parse(mi, me);
        assert!(h.v1.is_empty());
        assert_eq!(
            h.v2.unwrap().own_dir(),
            Path::new(
                "/sys/fs/cgroup/user.slice/user-1000.slice/user@1000.service/app.slice/bmx.service"
            )
        );
    }

    #[test]
    fn combined_v1_controllers_and_escaped_mount_points() {
        let mi = "40 31 0:40 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n\
                  41 31 0:41 / /mnt/with\\040space rw - cgroup cgroup rw,pids\n\
                  42 31 0:42 /sub /elsewhere rw - cgroup cgroup rw,memory\n";
        let me = "3:cpu,cpuacct:/a\n2:pids:/b\n1:memory:/c\n";
        let h = parse(mi, me);
        assert!(h.v2.is_none());
        let cpu =
            h.v1.iter()
                .find(|x| x.controller == Some(Controller::Cpu))
                .unwrap();
        assert_eq!(cpu.own_dir(), Path::new("/sys/fs/cgroup/cpu,cpuacct/a"));
        let pids =
            h.v1.iter()
                .find(|x| x.controller == Some(Controller::Pids))
                .unwrap();
        assert_eq!(pids.mount, Path::new("/mnt/with space"));
        assert!(
            !h.v1
                .iter()
                .any(|x| x.controller == Some(Controller::Memory)),
            "a bind mount of a subtree is skipped"
        );
    }

    #[test]
    fn nothing_mounted_is_nothing_offered() {
        assert_eq!(parse("", ""), Hierarchies::default());
    }
}

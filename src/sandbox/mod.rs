//! A sandbox per session (issue 48): what a session's code (its
//! processes, terminals, `bash` calls, MCP servers, agents, package
//! installs) can reach, how much of the machine it can take, and that it
//! cannot outlive the session. Enforced by the kernel:
//!
//! * **files, network, signals, abstract sockets**: a Landlock ruleset per
//!   session ([`landlock`]), applied by every child before `exec`;
//! * **containment and bounds**: a cgroup per session ([`cgroup`]), joined
//!   by every child before `exec`, killed when the session ends; its
//!   memory, task and CPU bounds from [`bounds`];
//! * **privilege**: `no_new_privs`, and for a root executor without
//!   `--run-as` an empty capability bounding set, so a root session cannot
//!   load modules, reboot, reconfigure the network or make device nodes.
//!
//! The executor decides at start what this kernel can enforce, says so in
//! the log and in `capabilities.sandbox`, and (with `--sandbox required`)
//! refuses to start when something is missing. Where no cgroup can be
//! made, the environment scope tag of `process::sys` stays as the way to
//! find a session's processes; with a cgroup the tag is not set.
//! docs/security.md has the why of each choice.

pub mod bounds;
pub mod cgroup;
pub mod landlock;

use crate::process::spawn::Confinement;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use bounds::Bounds;

/// `--sandbox`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Everything this kernel offers; a warning names what it lacks.
    #[default]
    Auto,
    /// Refuse to start unless every part is enforced.
    Required,
    /// No sandbox (a trusted local machine): sessions run with the
    /// executor's rights, as before issue 48.
    Off,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "auto" => Ok(Mode::Auto),
            "required" => Ok(Mode::Required),
            "off" => Ok(Mode::Off),
            _ => Err(format!("--sandbox {s:?}: one of auto, required, off")),
        }
    }
}

/// `--session-network`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Network {
    #[default]
    Full,
    /// No TCP `bind` or `connect` (Landlock ABI 4).
    None,
}

impl std::str::FromStr for Network {
    type Err = String;
    fn from_str(s: &str) -> Result<Network, String> {
        match s {
            "full" => Ok(Network::Full),
            "none" => Ok(Network::None),
            _ => Err(format!("--session-network {s:?}: one of full, none")),
        }
    }
}

/// What the operator asked for.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    pub mode: Mode,
    pub network: Network,
    /// Every session's bounds, and the most a session may ask for.
    pub bounds: Bounds,
    /// More read-only paths (`--sandbox-read`), e.g. a toolchain in a home
    /// directory.
    pub read: Vec<PathBuf>,
    /// A daemon may move itself into a leaf cgroup to enable controllers
    /// for its sessions (`cgroup::Tree::create`); an embedding host's
    /// process is left where it is.
    pub move_self: bool,
    /// Mechanisms to act as if this kernel lacked (`landlock`, `cgroup`):
    /// how the tests reach each fallback on a host that has everything
    /// (`--sandbox-without`, hidden).
    pub without: Vec<String>,
}

/// The environment variable with more read-only paths, colon-separated
/// (what `--sandbox-read` also reads).
pub const READ_ENV: &str = "BMX_SANDBOX_READ";

impl Default for SandboxConfig {
    /// `auto`, full network, no bounds, and the read-only paths of
    /// [`READ_ENV`] (absolute ones only).
    fn default() -> SandboxConfig {
        SandboxConfig {
            mode: Mode::Auto,
            network: Network::Full,
            bounds: Bounds::default(),
            read: std::env::var_os(READ_ENV)
                .map(|v| {
                    std::env::split_paths(&v)
                        .filter(|p| p.is_absolute())
                        .collect()
                })
                .unwrap_or_default(),
            move_self: false,
            without: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("--sandbox required, but {0} is not enforced on this host")]
    Required(String),
    #[error("{flag}: {why}")]
    Bound { flag: &'static str, why: String },
    #[error("cannot make the session's sandbox: {0}")]
    Make(String),
}

/// What this executor enforces, decided once at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enforced {
    pub landlock: landlock::Enforced,
    pub cgroup: Option<&'static str>,
    pub can: bounds::Enforceable,
    pub network_none: bool,
    pub drop_caps: bool,
}

/// The executor's sandboxes: the cgroup tree, and how to make one per
/// session.
#[derive(Debug)]
pub struct Sandboxes {
    config: SandboxConfig,
    enforced: Enforced,
    tree: Option<cgroup::Tree>,
    cap_last: u32,
}

impl Sandboxes {
    /// Detect, check against `config`, and make the executor's cgroup
    /// tree. Logs what is enforced and, in `auto` mode, warns about what
    /// is not.
    ///
    /// # Errors
    /// [`SandboxError::Required`] in `required` mode when something is
    /// missing; [`SandboxError::Bound`] for a bound that cannot be
    /// enforced (naming its flag), in every mode but `off`.
    pub fn start(config: SandboxConfig) -> Result<Sandboxes, SandboxError> {
        let cap_last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(40);
        if config.mode == Mode::Off {
            if !config.bounds.is_empty() || config.network == Network::None {
                return Err(SandboxError::Bound {
                    flag: "--sandbox off",
                    why: "session bounds and --session-network none need the sandbox".into(),
                });
            }
            tracing::warn!("--sandbox off: session code runs with the executor's rights and can reach other sessions");
            return Ok(Sandboxes {
                enforced: Enforced {
                    landlock: landlock::Enforced {
                        abi: 0,
                        filesystem: false,
                        network: false,
                        scopes: false,
                    },
                    cgroup: None,
                    can: bounds::Enforceable::default(),
                    network_none: false,
                    drop_caps: false,
                },
                config,
                tree: None,
                cap_last,
            });
        }
        let without = |m: &str| config.without.iter().any(|w| w == m);
        let ll = if without("landlock") {
            landlock::Enforced {
                abi: 0,
                filesystem: false,
                network: false,
                scopes: false,
            }
        } else {
            landlock::enforced()
        };
        let tree = if without("cgroup") {
            None
        } else {
            match cgroup::Tree::create(&cgroup::detect(), &config.bounds.limits(), config.move_self)
            {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::debug!(error = %e, "no cgroup for sessions");
                    None
                }
            }
        };
        let offer = tree.as_ref().map(|t| t.offer().clone()).unwrap_or_default();
        let can = bounds::Enforceable {
            memory: offer.memory,
            pids: offer.pids,
            cpu: offer.cpu,
        };
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let enforced = Enforced {
            landlock: ll,
            cgroup: offer.kind,
            can,
            network_none: config.network == Network::None && ll.network,
            drop_caps: root && crate::process::run_as::get().is_none(),
        };
        let b = &config.bounds;
        for (flag, asked, ok) in [
            ("--session-memory-max", b.memory_bytes.is_some(), can.memory),
            ("--session-pids-max", b.pids.is_some(), can.pids),
            ("--session-cpu-max", b.cpu_milli.is_some(), can.cpu),
        ] {
            if asked && !ok {
                if let Some(t) = &tree {
                    t.remove();
                }
                return Err(SandboxError::Bound {
                    flag,
                    why: "this host gives the executor no cgroup controller for it \
                          (run as root, or under a systemd unit with Delegate=yes)"
                        .into(),
                });
            }
        }
        let mut missing = Vec::new();
        if !ll.filesystem {
            missing.push("the filesystem rules (Landlock)");
        }
        if !ll.scopes {
            missing.push("signal and abstract-socket scoping (Landlock ABI 6)");
        }
        if config.network == Network::None && !ll.network {
            missing.push("--session-network none (Landlock ABI 4)");
        }
        if tree.is_none() {
            missing.push("containment (a cgroup per session)");
        }
        if !missing.is_empty() {
            if config.mode == Mode::Required {
                if let Some(t) = &tree {
                    t.remove();
                }
                return Err(SandboxError::Required(missing.join(", ")));
            }
            tracing::warn!(
                missing = %missing.join(", "),
                "the session sandbox is partial: these are NOT enforced"
            );
        }
        let s = Sandboxes {
            config,
            enforced,
            tree,
            cap_last,
        };
        tracing::info!(
            filesystem = s.filesystem(),
            cgroup = s.enforced.cgroup.unwrap_or("none"),
            landlock_abi = ll.abi,
            network = s.network(),
            limits = ?s.limit_names(),
            "session sandbox"
        );
        Ok(s)
    }

    pub fn enforced(&self) -> &Enforced {
        &self.enforced
    }

    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// Whether sessions are confined at all.
    pub fn is_on(&self) -> bool {
        self.config.mode != Mode::Off
    }

    /// Whether a session's processes are found by its cgroup (else by the
    /// environment tag).
    pub fn contains(&self) -> bool {
        self.tree.is_some()
    }

    fn filesystem(&self) -> &'static str {
        if self.enforced.landlock.filesystem {
            "landlock"
        } else {
            "none"
        }
    }

    fn network(&self) -> &'static str {
        match self.config.network {
            Network::Full => "full",
            Network::None if self.enforced.network_none => "none",
            Network::None => "unenforced",
        }
    }

    fn limit_names(&self) -> Vec<String> {
        let c = self.enforced.can;
        [("memory", c.memory), ("pids", c.pids), ("cpu", c.cpu)]
            .into_iter()
            .filter(|(_, ok)| *ok)
            .map(|(n, _)| n.to_owned())
            .collect()
    }

    /// `capabilities.sandbox` (a bmx extension, docs/protocol.md).
    pub fn capability(&self) -> crate::wire::types::SandboxCapability {
        let b = &self.config.bounds;
        crate::wire::types::SandboxCapability {
            filesystem: self.filesystem().into(),
            cgroup: self.enforced.cgroup.unwrap_or("none").into(),
            network: self.network().into(),
            scoped: self.enforced.landlock.scopes,
            landlock_abi: (self.enforced.landlock.abi > 0)
                .then_some(self.enforced.landlock.abi as u32),
            limits: crate::wire::types::SandboxLimits {
                available: self.limit_names(),
                memory_max: b.memory_bytes,
                pids_max: b.pids,
                cpu_max: b.cpu_milli.map(|m| m as f64 / 1000.0),
            },
        }
    }

    /// A session's bounds: the executor's, lowered by
    /// `metadata.sandbox`.
    ///
    /// # Errors
    /// A [`bounds::Refusal`] naming the field.
    pub fn bounds_for(
        &self,
        metadata: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Bounds, bounds::Refusal> {
        let asked = metadata.get("sandbox");
        if self.config.mode == Mode::Off && asked.is_some() {
            return Err(bounds::Refusal {
                field: "metadata.sandbox".into(),
                message: "this executor runs without a sandbox".into(),
            });
        }
        bounds::for_session(&self.config.bounds, self.enforced.can, asked)
    }

    /// Make the sandbox of one session (or terminal): `name` its
    /// [`session_name`] or [`terminal_name`],
    /// `workspace` and `private` (its temp and home, made here) the only
    /// places it may write.
    ///
    /// # Errors
    /// [`SandboxError::Make`] when the kernel refuses a part of it.
    pub fn make(
        &self,
        name: &str,
        workspace: &Path,
        private: &Path,
        bounds: &Bounds,
    ) -> Result<Sandbox, SandboxError> {
        let tmp = private.join("tmp");
        let home = private.join("home");
        for d in [&tmp, &home] {
            make_private_dir(d).map_err(|e| SandboxError::Make(format!("{}: {e}", d.display())))?;
        }
        let mut sandbox = Sandbox {
            // Off: nothing confines the children, but they are still the
            // executor's session children (`--run-as` applies).
            confinement: Some(Arc::new(Confinement::default())),
            cgroup: None,
            tmp,
            home,
            oom_at_start: 0,
            own_env: self.config.mode != Mode::Off,
            readable: Vec::new(),
            units: std::sync::atomic::AtomicU64::new(0),
            spare: Arc::default(),
        };
        if self.config.mode == Mode::Off {
            return Ok(sandbox);
        }
        let group = match &self.tree {
            Some(t) => Some(
                t.group(name, &bounds.limits())
                    .map_err(|e| SandboxError::Make(e.to_string()))?,
            ),
            None => None,
        };
        let mut read = self.config.read.clone();
        // The executable itself: a session may run `bmx` (as a tool).
        if let Ok(exe) = std::env::current_exe() {
            read.push(exe);
        }
        let rules = landlock::Rules {
            write: vec![
                workspace.to_path_buf(),
                sandbox.tmp.clone(),
                sandbox.home.clone(),
            ],
            read,
            no_network: self.config.network == Network::None,
        };
        let ruleset = if self.enforced.landlock.filesystem {
            match landlock::ruleset(&rules) {
                Ok(r) => r,
                Err(e) => {
                    if let Some(g) = &group {
                        g.remove();
                    }
                    return Err(SandboxError::Make(e.to_string()));
                }
            }
        } else {
            None
        };
        sandbox.readable = landlock::SYSTEM_READ
            .iter()
            .map(PathBuf::from)
            .chain(rules.read.iter().cloned())
            .chain(rules.write.iter().cloned())
            .collect();
        sandbox.oom_at_start = group.as_ref().map_or(0, |g| g.oom_kills());
        sandbox.confinement = Some(Arc::new(Confinement {
            cgroups: group.as_ref().map(|g| g.join_fds()).unwrap_or_default(),
            landlock: ruleset,
            drop_caps: self.enforced.drop_caps,
            cap_last: self.cap_last,
        }));
        sandbox.cgroup = group;
        Ok(sandbox)
    }

    /// Kill and remove every session cgroup left, and the executor's tree
    /// (its last act). Blocking.
    pub fn remove_all(&self) {
        if let Some(t) = &self.tree {
            t.remove();
        }
    }

    /// Kill what sandbox `name` ([`session_name`], [`terminal_name`]) left
    /// in its cgroup and remove it (its actor died without its own
    /// cleanup). Blocking.
    pub fn kill_named(&self, name: &str) {
        if let Some(t) = &self.tree {
            t.kill_group(name);
        }
    }
}

/// The sandbox name of session `id` (its cgroup's directory). Ids are
/// `A-Z a-z 0-9 . _ : -` (`wire::id`), all fine in a cgroup name; the
/// prefix keeps a session from colliding with a terminal of the same id,
/// or with a cgroup control file (`cgroup.procs`).
pub fn session_name(id: &str) -> String {
    format!("s-{id}")
}

/// The sandbox name of terminal `id`.
pub fn terminal_name(id: &str) -> String {
    format!("t-{id}")
}

/// `mkdir` 0700, refusing anything already there (a planted symlink or
/// directory), parents included only when they do not exist.
fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(parent) = dir.parent() {
        if !parent.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)?;
        }
    }
    std::fs::DirBuilder::new().mode(0o700).create(dir)?;
    if let Some(u) = crate::process::run_as::get() {
        nix::unistd::chown(
            dir,
            Some(nix::unistd::Uid::from_raw(u.uid)),
            Some(nix::unistd::Gid::from_raw(u.gid)),
        )?;
    }
    Ok(())
}

/// One session's sandbox. Dropping it does nothing: [`Sandbox::end`]
/// kills and removes (a blocking call, made off the runtime's workers).
#[derive(Debug)]
pub struct Sandbox {
    confinement: Option<Arc<Confinement>>,
    cgroup: Option<cgroup::Group>,
    tmp: PathBuf,
    home: PathBuf,
    oom_at_start: u64,
    /// Whether the children get the sandbox's own `TMPDIR` and `HOME`
    /// (not with `--sandbox off`: as before issue 48).
    own_env: bool,
    /// The roots the session may read (for `PATH`).
    readable: Vec<PathBuf>,
    /// Units made so far (names their leaves).
    units: std::sync::atomic::AtomicU64,
    /// Empty leaves kept for the next units ([`SPARE_LEAVES`]).
    spare: Arc<std::sync::Mutex<Vec<PathBuf>>>,
}

impl Sandbox {
    /// What every child of the session applies before `exec` (empty with
    /// `--sandbox off`).
    pub fn confinement(&self) -> Option<Arc<Confinement>> {
        self.confinement.clone()
    }

    /// Whether the session's processes are found by its cgroup.
    pub fn contained(&self) -> bool {
        self.cgroup.is_some()
    }

    /// `TMPDIR` and `HOME` of the session's children: its own (none with
    /// `--sandbox off`).
    pub fn env(&self) -> Vec<(String, String)> {
        if !self.own_env {
            return Vec::new();
        }
        vec![
            ("TMPDIR".into(), self.tmp.display().to_string()),
            ("HOME".into(), self.home.display().to_string()),
        ]
    }

    pub fn tmp(&self) -> &Path {
        &self.tmp
    }

    /// OOM kills in the session since it started.
    pub fn oom_kills(&self) -> u64 {
        self.cgroup
            .as_ref()
            .map_or(0, |g| g.oom_kills().saturating_sub(self.oom_at_start))
    }

    /// Pids in the session's cgroup.
    pub fn pids(&self) -> Vec<i32> {
        self.cgroup.as_ref().map(|g| g.pids()).unwrap_or_default()
    }

    /// SIGKILL everything the session runs, and wait until it is gone.
    /// Blocking.
    pub fn kill(&self) {
        if let Some(g) = &self.cgroup {
            g.kill();
        }
    }

    /// Kill everything, then remove the cgroup and the private directories
    /// (`private`, their parent, as given to [`Sandboxes::make`]).
    /// Blocking.
    pub fn end(&self, private: &Path) {
        self.kill();
        if let Some(g) = &self.cgroup {
            g.remove();
        }
        if let Err(e) = std::fs::remove_dir_all(private) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(error = %e, "cannot remove the session's private directory");
            }
        }
    }
}

/// One process (or `bash` call, or stdio server) of a sandbox: its leaf
/// cgroup, so that killing it ends everything it started, escapees
/// included, and what its child applies before `exec`. Dropping it kills
/// what is left in the leaf and removes the leaf.
#[derive(Debug)]
pub struct Unit {
    confinement: Option<Arc<Confinement>>,
    leaf: Option<PathBuf>,
    /// Where the leaf goes back when the unit is done (its session's).
    spare: Option<Arc<std::sync::Mutex<Vec<PathBuf>>>>,
}

/// Empty leaves a session keeps for its next processes: a start then
/// joins one instead of a `mkdir` and, at its end, an `rmdir` (about a
/// tenth of a sandboxed start's cost, docs/benchmarks.md).
const SPARE_LEAVES: usize = 4;

impl Unit {
    /// What the unit's child applies before `exec`.
    pub fn confinement(&self) -> Option<Arc<Confinement>> {
        self.confinement.clone()
    }

    /// Whether the unit's processes are found by its cgroup (else by the
    /// environment tag).
    pub fn contained(&self) -> bool {
        self.leaf.is_some()
    }

    /// SIGKILL everything the unit started. Blocking (a write).
    pub fn kill(&self) {
        if let Some(l) = &self.leaf {
            cgroup::kill_leaf(l);
        }
    }

    /// The descriptors are only needed to start the child: let them go
    /// once it runs (an executor with 10 000 processes keeps none).
    pub fn started(&mut self) {
        self.confinement = None;
    }
}

impl Drop for Unit {
    fn drop(&mut self) {
        let Some(l) = self.leaf.take() else {
            return;
        };
        // Whatever the process left dies now (`cgroup.kill` covers a fork
        // racing it); the leaf, empty or emptying, serves the session's
        // next process, or goes. Busy while a killed process is not yet
        // reaped: the session's end removes it then.
        cgroup::kill_leaf(&l);
        if let Some(spare) = &self.spare {
            let mut s = spare.lock().unwrap_or_else(|p| p.into_inner());
            if s.len() < SPARE_LEAVES {
                s.push(l);
                return;
            }
        }
        let _ = cgroup::remove_leaf(&l);
    }
}

impl Sandbox {
    /// A unit for one process of the session: a leaf of its cgroup (where
    /// the session has one in the v2 tree), the Landlock ruleset and the
    /// rest of the confinement. Blocking (a `mkdir` and an `open`).
    ///
    /// # Errors
    /// When the leaf cannot be made.
    pub fn unit(&self) -> Result<Unit, SandboxError> {
        let Some(base) = &self.confinement else {
            return Ok(Unit {
                confinement: None,
                leaf: None,
                spare: None,
            });
        };
        let Some(group) = &self.cgroup else {
            return Ok(Unit {
                confinement: Some(base.clone()),
                leaf: None,
                spare: None,
            });
        };
        let n = self
            .units
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reuse = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let (leaf, cgroups) = group
            .leaf(&format!("u{n}"), reuse)
            .map_err(|e| SandboxError::Make(e.to_string()))?;
        let landlock = match &base.landlock {
            Some(fd) => Some(
                fd.try_clone()
                    .map_err(|e| SandboxError::Make(e.to_string()))?,
            ),
            None => None,
        };
        Ok(Unit {
            confinement: Some(Arc::new(Confinement {
                cgroups,
                landlock,
                drop_caps: base.drop_caps,
                cap_last: base.cap_last,
            })),
            leaf,
            spare: Some(self.spare.clone()),
        })
    }

    /// The environment policy of the session's children: `base` with the
    /// session's own `TMPDIR` and `HOME`, and without the scope tag when
    /// the cgroup finds the session's processes.
    pub fn child_env(&self, base: crate::process::env::ChildEnv) -> crate::process::env::ChildEnv {
        let mut own = self.env();
        // `PATH` without the directories the session cannot read (a
        // toolchain under the executor's home): a shell takes the first
        // match it can `stat`, and Landlock does not hide a file from
        // `stat`, so `python3` would be found in `~/.pyenv/shims`, fail
        // with EACCES, and `/usr/bin/python3` would never be tried.
        if self.own_env {
            if let Some(path) = base.base_var("PATH") {
                let kept: Vec<&str> = path
                    .split(':')
                    .filter(|d| {
                        !d.is_empty() && self.readable.iter().any(|r| Path::new(d).starts_with(r))
                    })
                    .collect();
                own.push(("PATH".into(), kept.join(":")));
            }
        }
        let env = base.with_base_vars(own);
        if self.contained() {
            env.untagged()
        } else {
            env
        }
    }
}

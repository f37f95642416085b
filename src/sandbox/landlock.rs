//! The filesystem, network and IPC rules of a session's code, enforced by
//! Landlock.
//!
//! Why Landlock (and not a mount namespace): it is deny-by-default for
//! every file access, needs no privilege and no user namespace (which
//! some distributions restrict), works the same for a root and a non-root
//! executor, and costs one `landlock_restrict_self` per child with a
//! ruleset built once per session (`process::spawn` applies it between
//! `clone` and `exec`). On top of files it gives, from ABI 4, TCP
//! `bind`/`connect` rules (`--session-network none`) and, from ABI 6,
//! scoping: a sandboxed process can neither signal nor connect to an
//! abstract Unix socket of a process outside its domain (the executor,
//! another session, the host's services). The rights used are those of
//! ABI 7 (what this was tested on); a newer kernel does not change them.
//!
//! What the session's code may do:
//!
//! | where | rights |
//! | --- | --- |
//! | its workspace, its private temp and home | everything but making device nodes |
//! | `/usr /bin /sbin /lib* /etc /opt /proc /sys`, the `--sandbox-read` paths, the target of `/etc/resolv.conf` | read and execute |
//! | `/dev/null /dev/zero /dev/full /dev/random /dev/urandom /dev/tty /dev/ptmx /dev/pts` | read, write, ioctl |
//!
//! Everything else (other sessions' workspaces, the executor's work root,
//! state, journal, sockets' directories, credentials, `/tmp`, `/home`,
//! `/root`, `/var`, `/run`) is refused with `EACCES`.

use landlock::{
    Access, AccessFs, AccessNet, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset,
    RulesetAttr, RulesetCreatedAttr, Scope, ABI,
};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

/// The ABI bmx's rules were written and tested against.
const TESTED: ABI = ABI::V7;

/// The kernel's Landlock ABI version (0: none, or disabled at boot).
pub fn abi() -> i32 {
    // SAFETY: the version query takes no attribute (NULL, 0).
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            1u32, // LANDLOCK_CREATE_RULESET_VERSION
        )
    };
    if v < 0 {
        0
    } else {
        v as i32
    }
}

/// Read-only system paths, present or not on a given host.
pub const SYSTEM_READ: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/proc", "/sys",
];

/// Devices every program may need.
pub const DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/pts",
];

/// What one session may reach.
#[derive(Debug, Clone, Default)]
pub struct Rules {
    /// Read and write (its workspace, private temp and home).
    pub write: Vec<PathBuf>,
    /// Read and execute, on top of [`SYSTEM_READ`].
    pub read: Vec<PathBuf>,
    /// Refuse TCP `bind` and `connect` (`--session-network none`).
    pub no_network: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    #[error("Landlock: {0}")]
    Ruleset(#[from] landlock::RulesetError),
    #[error("Landlock is not available on this kernel")]
    Unsupported,
}

/// Read, write, execute, make and remove: everything but device nodes,
/// which a root session could otherwise make to read raw disks.
fn rw() -> landlock::BitFlags<AccessFs> {
    AccessFs::from_all(TESTED) & !(AccessFs::MakeChar | AccessFs::MakeBlock)
}

fn ro() -> landlock::BitFlags<AccessFs> {
    AccessFs::from_read(TESTED)
}

fn dev() -> landlock::BitFlags<AccessFs> {
    AccessFs::ReadFile
        | AccessFs::WriteFile
        | AccessFs::ReadDir
        | AccessFs::Truncate
        | AccessFs::IoctlDev
}

/// Where `/etc/resolv.conf` points, when it is a link out of `/etc` (a
/// systemd-resolved host keeps it in `/run/systemd/resolve`): name
/// resolution reads it.
fn resolv_conf_dir() -> Option<PathBuf> {
    let target = std::fs::canonicalize("/etc/resolv.conf").ok()?;
    let dir = target.parent()?.to_path_buf();
    (!dir.starts_with("/etc")).then_some(dir)
}

/// Build the ruleset of one session; `None` when the kernel has no
/// Landlock. Paths that do not exist are skipped (a host without
/// `/lib64`).
///
/// # Errors
/// When the kernel refuses the ruleset or a rule.
pub fn ruleset(rules: &Rules) -> Result<Option<OwnedFd>, LandlockError> {
    if abi() < 1 {
        return Ok(None);
    }
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(TESTED))?;
    if rules.no_network {
        ruleset = ruleset.handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)?;
    }
    let ruleset = ruleset.scope(Scope::from_all(TESTED))?;
    let mut beneath: Vec<PathBeneath<PathFd>> = Vec::new();
    let mut allow = |path: &Path, access: landlock::BitFlags<AccessFs>| {
        // Absent on this host (no `/lib64`): nothing to allow.
        if let Ok(fd) = PathFd::new(path) {
            beneath.push(PathBeneath::new(fd, access));
        }
    };
    for p in SYSTEM_READ {
        allow(Path::new(p), ro());
    }
    if let Some(d) = resolv_conf_dir() {
        allow(&d, ro());
    }
    for p in &rules.read {
        allow(p, ro());
    }
    for p in DEVICES {
        allow(Path::new(p), dev());
    }
    for p in &rules.write {
        allow(p, rw());
    }
    let created = ruleset
        .create()?
        .add_rules(beneath.into_iter().map(Ok::<_, landlock::RulesetError>))?;
    Ok(Option::<OwnedFd>::from(created))
}

/// What this kernel enforces of the rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enforced {
    pub abi: i32,
    pub filesystem: bool,
    pub network: bool,
    /// Signals and abstract Unix sockets scoped to the session.
    pub scopes: bool,
}

pub fn enforced() -> Enforced {
    let abi = abi();
    Enforced {
        abi,
        filesystem: abi >= 1,
        network: abi >= 4,
        scopes: abi >= 6,
    }
}

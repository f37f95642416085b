//! `process.start.packageInstall {manager, packages}` (the seed's
//! `ProcessPackageInstall` / `PackageInstaller`): the executor, not the
//! caller, decides what runs.
//!
//! Why an allow-list mapped to argv: a package name travels from the
//! platform (and, behind it, a model) to a program that runs as the
//! executor's user. Only three managers exist here, each with a fixed argv
//! built by this module; the names are checked by a strict per-manager
//! grammar before anything starts, so a name can neither be a shell
//! fragment (there is no shell) nor an option of the manager (no name may
//! begin with `-`, and the argv ends options with `--` where the manager
//! knows it). The install then runs as an ordinary process of the
//! session: its output is streamed to `process.read`, it is killed with
//! the session, `timeoutMs` applies.
//!
//! Where things go (docs/protocol.md, "Files, packages and git
//! credentials"): `pip` installs into `<workspace>/.packages/python`
//! (`--target`, no root, nothing outside the workspace), `npm` into
//! `<workspace>/.packages/node` (`--prefix`), `apt` system-wide (needs an
//! executor running as root; otherwise apt itself fails and the process
//! ends with its exit code).

use crate::wire::types::ProcessPackageInstall;
use crate::wire::RpcError;
use std::collections::BTreeMap;
use std::path::Path;

/// Most packages one install names.
pub const MAX_PACKAGES: usize = 64;
/// Longest package spec (npm's own name limit).
pub const MAX_SPEC_BYTES: usize = 214;

/// Where `pip` installs, relative to the workspace.
pub const PIP_TARGET: &str = ".packages/python";
/// Where `npm` installs, relative to the workspace.
pub const NPM_PREFIX: &str = ".packages/node";

/// The allowed package managers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Manager {
    Apt,
    Pip,
    Npm,
}

impl Manager {
    fn parse(s: &str) -> Option<Manager> {
        match s {
            "apt" => Some(Manager::Apt),
            "pip" => Some(Manager::Pip),
            "npm" => Some(Manager::Npm),
            _ => None,
        }
    }
}

/// Why a `packageInstall` is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PackageError {
    #[error("unknown package manager {0:?}: allowed are apt, pip, npm")]
    UnknownManager(String),
    #[error("packageInstall needs at least one package")]
    NoPackages,
    #[error("packageInstall names {0} packages: at most {MAX_PACKAGES}")]
    TooMany(usize),
    #[error("package {index} is {len} bytes long: at most {MAX_SPEC_BYTES}")]
    TooLong { index: usize, len: usize },
    #[error("package {index} ({spec:?}) is not a valid {manager} package: {why}")]
    Invalid {
        index: usize,
        spec: String,
        manager: &'static str,
        why: &'static str,
    },
    #[error("packageInstall and argv are exclusive: the executor builds the argv")]
    WithArgv,
}

impl From<PackageError> for RpcError {
    fn from(e: PackageError) -> RpcError {
        RpcError::invalid_params(e.to_string()).with_reason("invalid_package_install")
    }
}

/// What to run for an install.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallCommand {
    pub argv: Vec<String>,
    /// Set in the child's environment unless the spec sets them.
    pub env: BTreeMap<String, String>,
}

/// Check an install and build its argv. `workspace` is the session's
/// workspace (absolute).
pub fn command(
    workspace: &Path,
    install: &ProcessPackageInstall,
) -> Result<InstallCommand, PackageError> {
    let manager = Manager::parse(&install.manager)
        .ok_or_else(|| PackageError::UnknownManager(shorten(&install.manager)))?;
    let n = install.packages.len();
    if n == 0 {
        return Err(PackageError::NoPackages);
    }
    if n > MAX_PACKAGES {
        return Err(PackageError::TooMany(n));
    }
    for (index, spec) in install.packages.iter().enumerate() {
        if spec.len() > MAX_SPEC_BYTES {
            return Err(PackageError::TooLong {
                index,
                len: spec.len(),
            });
        }
        let check = match manager {
            Manager::Apt => check_apt(spec),
            Manager::Pip => check_pip(spec),
            Manager::Npm => check_npm(spec),
        };
        if let Err(why) = check {
            return Err(PackageError::Invalid {
                index,
                spec: shorten(spec),
                manager: match manager {
                    Manager::Apt => "apt",
                    Manager::Pip => "pip",
                    Manager::Npm => "npm",
                },
                why,
            });
        }
    }
    let mut env = BTreeMap::new();
    let mut argv: Vec<String> = match manager {
        Manager::Apt => {
            env.insert("DEBIAN_FRONTEND".into(), "noninteractive".into());
            ["apt-get", "install", "-y", "--no-install-recommends", "--"]
                .map(String::from)
                .to_vec()
        }
        Manager::Pip => {
            env.insert("PIP_DISABLE_PIP_VERSION_CHECK".into(), "1".into());
            vec![
                "python3".into(),
                "-m".into(),
                "pip".into(),
                "install".into(),
                "--no-input".into(),
                "--target".into(),
                workspace.join(PIP_TARGET).to_string_lossy().into_owned(),
                "--".into(),
            ]
        }
        Manager::Npm => vec![
            "npm".into(),
            "install".into(),
            "--no-audit".into(),
            "--no-fund".into(),
            "--prefix".into(),
            workspace.join(NPM_PREFIX).to_string_lossy().into_owned(),
            "--".into(),
        ],
    };
    argv.extend(install.packages.iter().cloned());
    Ok(InstallCommand { argv, env })
}

/// The spec that runs for a `packageInstall` start: the executor's argv,
/// its environment defaults under the spec's own. Refused (-32602) with an
/// argv of the caller's, an unknown manager or a bad name.
pub fn prepare(
    workspace: &Path,
    spec: &crate::wire::types::ProcessStartParams,
    install: &ProcessPackageInstall,
) -> Result<crate::wire::types::ProcessStartParams, RpcError> {
    if !spec.argv.is_empty() {
        return Err(PackageError::WithArgv.into());
    }
    // pip's `--target` and npm's `--prefix` are taken relative to the
    // child's cwd, which may be a subdirectory: always absolute.
    let workspace = std::path::absolute(workspace)
        .map_err(|e| RpcError::internal(format!("workspace {}: {e}", workspace.display())))?;
    let cmd = command(&workspace, install)?;
    let mut run = spec.clone();
    run.argv = cmd.argv;
    let env = run.env.get_or_insert_with(Default::default);
    for (k, v) in cmd.env {
        env.entry(k).or_insert(v);
    }
    Ok(run)
}

/// At most 64 characters of untrusted text for an error message.
fn shorten(s: &str) -> String {
    s.chars().take(64).collect()
}

fn alnum(c: char) -> bool {
    c.is_ascii_alphanumeric()
}

/// Debian package name (policy 5.6.1: lowercase letters, digits, `+ - .`,
/// at least two characters, starting alphanumeric), optionally `=version`.
fn check_apt(spec: &str) -> Result<(), &'static str> {
    let (name, version) = match spec.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (spec, None),
    };
    if name.len() < 2 {
        return Err("a name has at least two characters");
    }
    if !name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit()) {
        return Err("a name starts with a lowercase letter or a digit");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "+-.".contains(c))
    {
        return Err("a name has only lowercase letters, digits and + - .");
    }
    if let Some(v) = version {
        if v.is_empty() || !v.starts_with(|c: char| c.is_ascii_digit()) {
            return Err("a version starts with a digit");
        }
        if !v.chars().all(|c| alnum(c) || ".+~:-".contains(c)) {
            return Err("a version has only letters, digits and . + ~ : -");
        }
    }
    Ok(())
}

/// A PEP 508 name (letters, digits, `. _ -`, alphanumeric at both ends)
/// with at most one version clause (`==`, `!=`, `>=`, `<=`, `~=`, `>`,
/// `<` and a version of letters, digits, `. * + !`). No URLs, paths,
/// extras or markers: those are how a spec fetches arbitrary code.
fn check_pip(spec: &str) -> Result<(), &'static str> {
    let cut = spec.find(['=', '!', '<', '>', '~']).unwrap_or(spec.len());
    let (name, clause) = spec.split_at(cut);
    if name.is_empty() || !name.starts_with(alnum) || !name.ends_with(alnum) {
        return Err("a name starts and ends with a letter or a digit");
    }
    if !name.chars().all(|c| alnum(c) || "._-".contains(c)) {
        return Err("a name has only letters, digits and . _ -");
    }
    if clause.is_empty() {
        return Ok(());
    }
    let version = ["==", "!=", ">=", "<=", "~=", ">", "<"]
        .iter()
        .find_map(|op| clause.strip_prefix(op))
        .ok_or("a version clause starts with == != >= <= ~= > or <")?;
    if version.is_empty() || !version.starts_with(alnum) {
        return Err("a version starts with a letter or a digit");
    }
    if !version.chars().all(|c| alnum(c) || ".*+!".contains(c)) {
        return Err("a version has only letters, digits and . * + !");
    }
    Ok(())
}

/// An npm name (`[@scope/]name`, lowercase, digits, `- . _ ~`, not
/// starting with `.` or `_`), optionally `@version` or `@tag` of letters,
/// digits and `. - + ^ ~ * < > =`. No URLs, paths or git specs.
fn check_npm(spec: &str) -> Result<(), &'static str> {
    let (scope, rest) = match spec.strip_prefix('@') {
        Some(r) => {
            let (s, n) = r.split_once('/').ok_or("a scoped name is @scope/name")?;
            (Some(s), n)
        }
        None => (None, spec),
    };
    let (name, version) = match rest.split_once('@') {
        Some((n, v)) => (n, Some(v)),
        None => (rest, None),
    };
    let part = |p: &str| {
        !p.is_empty()
            && p.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && p.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-._~".contains(c))
    };
    if let Some(s) = scope {
        if !part(s) {
            return Err("a scope has only lowercase letters, digits and - . _ ~");
        }
    }
    if !part(name) || name.starts_with('-') && scope.is_none() {
        return Err("a name has only lowercase letters, digits and - . _ ~, not first . or _");
    }
    if let Some(v) = version {
        if v.is_empty() || !v.starts_with(|c: char| alnum(c) || "^~<>=*".contains(c)) {
            return Err("a version or tag starts with a letter, a digit or ^ ~ < > = *");
        }
        if !v.chars().all(|c| alnum(c) || ".-+^~*<>=".contains(c)) {
            return Err("a version or tag has only letters, digits and . - + ^ ~ * < > =");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn install(manager: &str, packages: &[&str]) -> ProcessPackageInstall {
        ProcessPackageInstall {
            manager: manager.into(),
            packages: packages.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn ok(manager: &str, spec: &str) -> bool {
        command(Path::new("/w"), &install(manager, &[spec])).is_ok()
    }

    #[test]
    fn pip_argv_targets_the_workspace() {
        let c = command(Path::new("/w"), &install("pip", &["requests==2.31.0"])).unwrap();
        assert_eq!(
            c.argv,
            [
                "python3",
                "-m",
                "pip",
                "install",
                "--no-input",
                "--target",
                "/w/.packages/python",
                "--",
                "requests==2.31.0"
            ]
        );
    }

    #[test]
    fn npm_and_apt_argv() {
        let c = command(Path::new("/w"), &install("npm", &["@types/node@20"])).unwrap();
        assert_eq!(c.argv[0], "npm");
        assert_eq!(c.argv.last().unwrap(), "@types/node@20");
        assert!(c.argv.contains(&"/w/.packages/node".to_string()));
        let c = command(Path::new("/w"), &install("apt", &["libssl-dev", "g++"])).unwrap();
        assert_eq!(c.argv[..2], ["apt-get", "install"]);
        assert_eq!(c.env["DEBIAN_FRONTEND"], "noninteractive");
    }

    #[test]
    fn good_names() {
        for (m, s) in [
            ("pip", "six"),
            ("pip", "zope.interface>=5"),
            ("pip", "Django~=4.2"),
            ("pip", "a_b-c"),
            ("npm", "left-pad"),
            ("npm", "@scope/pkg@^1.2.3"),
            ("npm", "lodash@latest"),
            ("apt", "git"),
            ("apt", "python3.11=3.11.2-6"),
            ("apt", "libstdc++6"),
        ] {
            assert!(ok(m, s), "{m} {s}");
        }
    }

    #[test]
    fn shell_fragments_options_urls_and_paths_are_refused() {
        for m in ["pip", "npm", "apt"] {
            for s in [
                "; rm -rf /",
                "$(reboot)",
                "`id`",
                "a b",
                "-e",
                "--index-url=http://evil",
                "--target=/etc",
                "../x",
                "/etc/passwd",
                "./pkg",
                "http://evil/x.tar.gz",
                "git+https://evil/x",
                "a\nb",
                "",
                "x|y",
                "x&y",
            ] {
                assert!(!ok(m, s), "{m} {s:?} accepted");
            }
        }
    }

    #[test]
    fn refusal_is_invalid_params_with_a_reason() {
        let e: RpcError = command(Path::new("/w"), &install("pip", &["; rm -rf /"]))
            .unwrap_err()
            .into();
        assert_eq!(e.code, -32602);
        assert_eq!(e.reason(), Some("invalid_package_install"));
        let detail = e.data.as_ref().and_then(|d| d.detail.clone()).unwrap();
        assert!(detail.contains("not a valid pip package"), "{detail}");
    }

    #[test]
    fn bounds() {
        let many: Vec<String> = (0..=MAX_PACKAGES).map(|i| format!("p{i}")).collect();
        let many: Vec<&str> = many.iter().map(|s| s.as_str()).collect();
        assert_eq!(
            command(Path::new("/w"), &install("pip", &many)),
            Err(PackageError::TooMany(MAX_PACKAGES + 1))
        );
        let long = "a".repeat(MAX_SPEC_BYTES + 1);
        assert!(matches!(
            command(Path::new("/w"), &install("pip", &[&long])),
            Err(PackageError::TooLong { .. })
        ));
        assert_eq!(
            command(Path::new("/w"), &install("pip", &[])),
            Err(PackageError::NoPackages)
        );
        assert!(matches!(
            command(Path::new("/w"), &install("brew", &["x"])),
            Err(PackageError::UnknownManager(_))
        ));
    }
}

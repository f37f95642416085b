//! `process.start.gitCredentials: true` (the seed's `GitCredentialGranter`:
//! `Grant(processID, env) -> (env, cleanup)`): the process gets a
//! `GIT_ASKPASS` helper that answers git's prompts with the credential the
//! platform granted this executor, and nothing else gets it.
//!
//! Where the credential comes from: the seed leaves the granting to the
//! executor's side, and `process.start` carries only the flag, so the
//! platform grants through a file the executor is configured with
//! (`--git-credentials FILE`, mode 0600, JSON, see [`CredentialFile`]). It
//! is read again at every grant, so whoever writes it (the platform, a
//! runner) rotates short-lived tokens by rewriting it; an entry past its
//! `expiresAt` is never handed out.
//!
//! How the secret travels, and why: the helper is a `sh` script in a
//! fresh directory made for this one process (mode 0700, created with
//! `mkdir`, so never an existing path or a symlink), beside a 0600 file
//! holding `host TAB username TAB password` lines. The git process's
//! environment holds only the helper's *path* (`GIT_ASKPASS`) and
//! `GIT_TERMINAL_PROMPT=0`; the secret is in no argv (the helper reads the
//! file, it is not given the secret), in no environment (so not in
//! `/proc/PID/environ` of the process or of anything it starts), and in no
//! log line (it is a [`Secret`]). The helper answers only a prompt for the
//! credential's own host (`Username for 'https://HOST': `), so a process
//! cannot make git send it elsewhere. The directory is removed when the
//! process ends ([`Askpass`]'s `Drop`), or when the process actor stops.
//!
//! What this does not protect against: another process of the same Unix
//! user reading the helper's file while the granted process runs (the
//! executor runs every session as one user; docs/security.md).

use crate::wire::Secret;
use serde::Deserialize;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use time::OffsetDateTime;

/// The largest credential file read.
pub const MAX_FILE_BYTES: u64 = 64 * 1024;
/// The most credentials one file holds.
pub const MAX_CREDENTIALS: usize = 64;

/// The file `--git-credentials` names.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CredentialFile {
    pub credentials: Vec<GitCredential>,
}

/// One granted credential. `password` is the token for token-based hosts.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GitCredential {
    /// `host` or `host:port`, as git prints it in its prompt.
    pub host: String,
    pub username: String,
    pub password: Secret,
    /// RFC 3339; absent: until the file changes.
    #[serde(default)]
    pub expires_at: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    #[error("git credential file {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("git credential file {0}: readable by group or others (mode must be 0600)")]
    Mode(PathBuf),
    #[error("git credential file {0}: larger than {MAX_FILE_BYTES} bytes")]
    TooLarge(PathBuf),
    #[error("git credential file {path}: {error}")]
    Parse { path: PathBuf, error: String },
    #[error("git credential {index}: {why}")]
    Invalid { index: usize, why: &'static str },
    #[error("no unexpired git credential is granted")]
    NoneValid,
    #[error("askpass helper: {0}")]
    Helper(std::io::Error),
}

/// Load and check the credential file, keeping the entries valid at `now`.
pub fn load(path: &Path, now: OffsetDateTime) -> Result<Vec<GitCredential>, GrantError> {
    let read = |error| GrantError::Read {
        path: path.to_owned(),
        error,
    };
    let file = std::fs::File::open(path).map_err(read)?;
    let meta = file.metadata().map_err(read)?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(GrantError::Mode(path.to_owned()));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(GrantError::TooLarge(path.to_owned()));
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(file, MAX_FILE_BYTES + 1),
        &mut bytes,
    )
    .map_err(read)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(GrantError::TooLarge(path.to_owned()));
    }
    // serde_json's message names a position, never the value.
    let parsed: CredentialFile = serde_json::from_slice(&bytes).map_err(|e| GrantError::Parse {
        path: path.to_owned(),
        error: e.to_string(),
    })?;
    valid_at(parsed.credentials, now)
}

/// Check every entry; keep those not expired at `now` (sans-IO: the
/// clock is the caller's).
pub fn valid_at(
    credentials: Vec<GitCredential>,
    now: OffsetDateTime,
) -> Result<Vec<GitCredential>, GrantError> {
    if credentials.len() > MAX_CREDENTIALS {
        return Err(GrantError::Invalid {
            index: MAX_CREDENTIALS,
            why: "too many credentials",
        });
    }
    let mut out = Vec::new();
    for (index, c) in credentials.into_iter().enumerate() {
        check(&c).map_err(|why| GrantError::Invalid { index, why })?;
        let live = match &c.expires_at {
            None => true,
            Some(t) => {
                let at = OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
                    .map_err(|_| GrantError::Invalid {
                    index,
                    why: "expiresAt is not RFC 3339",
                })?;
                at > now
            }
        };
        if live {
            out.push(c);
        }
    }
    if out.is_empty() {
        return Err(GrantError::NoneValid);
    }
    Ok(out)
}

/// What may appear in the helper's file and in its `case` patterns: the
/// file is split on TAB and newline, and the host and username are
/// matched literally inside git's quoted prompt.
fn check(c: &GitCredential) -> Result<(), &'static str> {
    let host_ok = |h: &str| {
        !h.is_empty()
            && h.len() <= 253
            && h.chars()
                .all(|ch| ch.is_ascii_alphanumeric() || ".-:[]".contains(ch))
    };
    if !host_ok(&c.host) {
        return Err("host has only letters, digits and . - : [ ]");
    }
    if c.username.is_empty()
        || c.username.len() > 256
        || !c
            .username
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || "._-".contains(ch))
    {
        return Err("username has only letters, digits and . _ -");
    }
    let p = c.password.expose();
    if p.is_empty() || p.len() > 4096 || p.chars().any(|ch| ch.is_control()) {
        return Err("password is 1 to 4096 characters, no control characters");
    }
    Ok(())
}

/// The helper script. `dir` is checked by [`Askpass::create`] to hold no
/// quote; the credentials are read from the file, never embedded.
fn script(dir: &Path) -> String {
    // Exact prompts (git's `"%s for '%s': "`) for http and https: nothing
    // but the scheme varies, so a URL cannot smuggle the host in a path.
    const SCRIPT: &str = r#"#!/bin/sh
# bmx git askpass helper: answers git's prompt for a granted host only.
prompt=$1
while IFS='	' read -r host user pass; do
	case $prompt in
	"Username for 'https://$host': "|"Username for 'http://$host': ")
		printf '%s\n' "$user"; exit 0 ;;
	"Password for 'https://$user@$host': "|"Password for 'http://$user@$host': "|\
	"Password for 'https://$host': "|"Password for 'http://$host': ")
		printf '%s\n' "$pass"; exit 0 ;;
	esac
done < 'DIR/credentials'
exit 1
"#;
    SCRIPT.replace("DIR", &dir.to_string_lossy())
}

/// The seed's `GitCredentialGranter.Grant`: a helper for one process, from
/// the executor's configured file, valid now. `Err` when the executor has
/// none configured (the session refuses that before: -32012).
pub fn grant(config: &crate::executor::ExecutorConfig, root: &Path) -> Result<Askpass, GrantError> {
    let file = config
        .git_credentials
        .as_deref()
        .ok_or(GrantError::NoneValid)?;
    Askpass::grant(file, root, OffsetDateTime::now_utc())
}

/// One process's helper directory; removed on drop.
#[derive(Debug)]
pub struct Askpass {
    dir: PathBuf,
}

impl Askpass {
    /// Grant the credentials of `file` (valid at `now`) to one process:
    /// make its helper under `root` (the system's temp dir by default).
    pub fn grant(file: &Path, root: &Path, now: OffsetDateTime) -> Result<Askpass, GrantError> {
        let credentials = load(file, now)?;
        Askpass::create(root, &credentials).map_err(GrantError::Helper)
    }

    fn create(root: &Path, credentials: &[GitCredential]) -> std::io::Result<Askpass> {
        let root = std::path::absolute(root)?;
        let dir = root.join(format!("bmx-askpass-{}", uuid::Uuid::new_v4().simple()));
        if dir.to_string_lossy().contains(['\'', '\n', '\\']) {
            return Err(std::io::Error::other("helper directory path holds a quote"));
        }
        // `mkdir` with 0700: fails on anything already there (a symlink
        // planted under a guessed name included).
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let askpass = Askpass { dir };
        let mut lines = String::new();
        for c in credentials {
            lines.push_str(&format!(
                "{}\t{}\t{}\n",
                c.host,
                c.username,
                c.password.expose()
            ));
        }
        askpass.write("credentials", 0o600, lines.as_bytes())?;
        askpass.write("askpass", 0o700, script(&askpass.dir).as_bytes())?;
        // Under `--run-as` the process's git runs as that user: the helper
        // is theirs (still 0700, nobody else's).
        crate::process::run_as::chown_tree(&askpass.dir)?;
        Ok(askpass)
    }

    fn write(&self, name: &str, mode: u32, bytes: &[u8]) -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW)
            .open(self.dir.join(name))?;
        f.write_all(bytes)?;
        f.sync_all()
    }

    /// The helper directory (tests, docs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What the granted process's environment gets: paths, never the
    /// secret.
    pub fn env(&self) -> [(String, String); 2] {
        [
            (
                "GIT_ASKPASS".into(),
                self.dir.join("askpass").to_string_lossy().into_owned(),
            ),
            ("GIT_TERMINAL_PROMPT".into(), "0".into()),
        ]
    }
}

impl Drop for Askpass {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove the askpass helper");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn cred(host: &str, user: &str, pass: &str, exp: Option<&str>) -> GitCredential {
        GitCredential {
            host: host.into(),
            username: user.into(),
            password: Secret::new(pass),
            expires_at: exp.map(str::to_owned),
        }
    }

    fn now() -> OffsetDateTime {
        OffsetDateTime::parse(
            "2026-01-01T00:00:00Z",
            &time::format_description::well_known::Rfc3339,
        )
        .unwrap()
    }

    fn ask(a: &Askpass, prompt: &str) -> (bool, String) {
        let out = Command::new(a.dir().join("askpass"))
            .arg(prompt)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    #[test]
    fn expired_entries_are_not_granted() {
        let v = valid_at(
            vec![
                cred("a.example", "u", "old", Some("2025-12-31T23:59:59Z")),
                cred("b.example", "u", "new", Some("2026-01-01T00:00:01Z")),
            ],
            now(),
        )
        .unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].host, "b.example");
        assert!(matches!(
            valid_at(
                vec![cred("a", "u", "p", Some("2025-01-01T00:00:00Z"))],
                now()
            ),
            Err(GrantError::NoneValid)
        ));
    }

    #[test]
    fn bad_fields_are_refused() {
        for c in [
            cred("a b", "u", "p", None),
            cred("h'", "u", "p", None),
            cred("h", "u\tx", "p", None),
            cred("h", "u", "p\nq", None),
            cred("h", "u", "", None),
        ] {
            assert!(matches!(
                valid_at(vec![c], now()),
                Err(GrantError::Invalid { .. })
            ));
        }
    }

    #[test]
    fn helper_answers_its_host_only_and_is_removed_on_drop() {
        let root = tempfile::tempdir().unwrap();
        let a = Askpass::create(
            root.path(),
            &[cred("127.0.0.1:8080", "bob", "s3cr$t 'x'", None)],
        )
        .unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(a.dir()), 0o700);
        assert_eq!(mode(&a.dir().join("askpass")), 0o700);
        assert_eq!(mode(&a.dir().join("credentials")), 0o600);
        assert_eq!(
            ask(&a, "Username for 'http://127.0.0.1:8080': "),
            (true, "bob\n".into())
        );
        assert_eq!(
            ask(&a, "Password for 'http://bob@127.0.0.1:8080': "),
            (true, "s3cr$t 'x'\n".into())
        );
        // Another host, a host with the granted one as a prefix: nothing.
        assert!(!ask(&a, "Password for 'http://bob@evil.example': ").0);
        assert!(!ask(&a, "Username for 'http://127.0.0.1:80801': ").0);
        assert!(!ask(&a, "Username for 'http://127.0.0.1:8080.evil': ").0);
        // Nothing secret in the environment it hands out.
        assert!(a.env().iter().all(|(_, v)| !v.contains("s3cr")));
        let dir = a.dir().to_owned();
        drop(a);
        assert!(!dir.exists());
    }

    #[test]
    fn a_world_readable_file_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("c.json");
        std::fs::write(
            &f,
            r#"{"credentials":[{"host":"h","username":"u","password":"p"}]}"#,
        )
        .unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(load(&f, now()), Err(GrantError::Mode(_))));
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(load(&f, now()).unwrap().len(), 1);
    }
}

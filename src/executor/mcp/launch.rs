//! From an `mcpServers[]` entry to something that can start: checked
//! once, before the first start (a spec that cannot run is reported
//! `unavailable` with its reason and never restarted).

use crate::executor::Shared;
use crate::process::env::Tty;
use crate::process::sys;
use crate::wire::types::{McpServerSpec, McpTransportType};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default `timeoutMs` of an HTTP server's requests.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub enum Launch {
    Stdio {
        program: PathBuf,
        arg0: String,
        args: Vec<String>,
        cwd: PathBuf,
        env: Vec<(String, String)>,
    },
    Http {
        url: String,
        timeout: Duration,
    },
}

/// Why a server is not started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub reason: &'static str,
    pub message: String,
}

fn refused(reason: &'static str, message: impl Into<String>) -> Refused {
    Refused {
        reason,
        message: message.into(),
    }
}

/// A server key as the wire may send it: plain, bounded.
pub fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 64
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Check `spec` and resolve what it starts. Blocking (hashes the
/// executable): call it off the async workers.
pub fn prepare(
    shared: &Shared,
    workspace: &Path,
    scope: &str,
    spec: &McpServerSpec,
    sandbox: &crate::sandbox::Sandbox,
) -> Result<Launch, Refused> {
    let t = &spec.transport;
    match t.kind {
        McpTransportType::Http => {
            let url = t
                .url
                .as_deref()
                .ok_or_else(|| refused("invalid_spec", "an http server needs a url"))?;
            if !url.starts_with("http://") {
                return Err(refused(
                    "unsupported_transport",
                    "only http:// URLs (this build of bmx has no TLS client; put TLS in front of the server)",
                ));
            }
            if url.len() > 4096 {
                return Err(refused("invalid_spec", "url longer than 4096 bytes"));
            }
            let timeout = t
                .timeout_ms
                .map(|ms| Duration::from_millis(ms.clamp(1, 3_600_000)))
                .unwrap_or(HTTP_TIMEOUT);
            Ok(Launch::Http {
                url: url.to_owned(),
                timeout,
            })
        }
        McpTransportType::Stdio => {
            let command = t
                .command
                .as_deref()
                .filter(|c| !c.is_empty())
                .ok_or_else(|| refused("invalid_spec", "a stdio server needs a command"))?;
            let cwd = match t.cwd.as_deref() {
                None => workspace.to_path_buf(),
                Some(c) => crate::tools::boundary::resolve(workspace, c)
                    .map_err(|e| refused("workspace_boundary", format!("cwd: {e}")))?,
            };
            let policy = sandbox.child_env(shared.config.child_env());
            let mut vars = t.env.clone().unwrap_or_default();
            if let Some(secret) = &t.secret_env {
                // Checked by name like any variable; the values never
                // reach a message.
                policy
                    .check(Some(
                        &secret.keys().map(|k| (k.clone(), String::new())).collect(),
                    ))
                    .map_err(|e| refused("denied_env", format!("secretEnv: {e}")))?;
                vars.extend(secret.clone());
            }
            let env = policy
                .build(Some(&vars), Tty::No, scope)
                .map_err(|e| refused("denied_env", e.to_string()))?;
            let path = env
                .iter()
                .find(|(k, _)| k == "PATH")
                .map(|(_, v)| v.as_str());
            let program = match sys::resolve_program(command, path, &cwd) {
                Some(p) => p,
                None if command.contains('/') => cwd.join(command),
                None => {
                    return Err(refused(
                        "spawn_failed",
                        format!("{command:?} not found on the server's PATH"),
                    ))
                }
            };
            if let Some(want) = &t.command_sha256 {
                let got = sha256_file(&program)
                    .map_err(|e| refused("spawn_failed", format!("{}: {e}", program.display())))?;
                if !got.eq_ignore_ascii_case(want.trim()) {
                    return Err(refused(
                        "command_sha256_mismatch",
                        format!(
                            "{} has SHA-256 {got}, not the pinned {}",
                            program.display(),
                            want.trim()
                        ),
                    ));
                }
            }
            Ok(Launch::Stdio {
                program,
                arg0: command.to_owned(),
                args: t.args.clone().unwrap_or_default(),
                cwd,
                env,
            })
        }
    }
}

/// The hex SHA-256 of a file (following symlinks: what `exec` runs).
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert!(valid_key("fs_1-a"));
        for bad in ["", "a/b", "..", "a b", &"k".repeat(65)] {
            assert!(!valid_key(bad), "{bad:?}");
        }
    }

    #[test]
    fn sha256_of_a_file() {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), b"abc").unwrap();
        assert_eq!(
            sha256_file(f.path()).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}

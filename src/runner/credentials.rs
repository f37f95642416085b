//! The local credential store: `<home>/credentials/<harness-host>.json`,
//! mode 0600 in a 0700 folder, replaced atomically (write a temporary file
//! beside it, fsync, rename, fsync the folder), read-modify-written under
//! an `flock` so two `bmx enroll` processes cannot lose each other's
//! update. One file per harness; inside, one credential and at most one
//! pending enrollment per workspace (canonical path).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Largest credential file read.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// `$BMX_HOME`, else `$HOME/.bmx`.
pub fn bmx_home() -> PathBuf {
    match std::env::var_os("BMX_HOME").filter(|v| !v.is_empty()) {
        Some(h) => PathBuf::from(h),
        None => std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/"))
            .join(".bmx"),
    }
}

/// Why the store could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a credential file: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error("not a harness URL: {0:?} (expected http://HOST:PORT or https://HOST:PORT)")]
    BadUrl(String),
}

/// An issued credential, kept for `bmx executor --harness`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LocalCredential {
    pub credential_id: String,
    pub executor_id: String,
    pub token: String,
    pub issued_at: String,
}

/// An enrollment waiting for its operator, kept so it can be resumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingEnrollment {
    pub enrollment_id: String,
    pub device_code: String,
    pub user_code: String,
    pub verification_url: String,
    pub verification_url_complete: String,
    /// Unix milliseconds.
    pub expires_at_ms: u64,
    pub poll_interval_ms: u64,
}

/// One harness's file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HarnessCredentials {
    #[serde(default)]
    pub harness: String,
    #[serde(default)]
    pub credentials: BTreeMap<String, LocalCredential>,
    #[serde(default)]
    pub pending: BTreeMap<String, PendingEnrollment>,
}

/// `http://127.0.0.1:7070/x` → `127.0.0.1_7070` (the file's stem).
///
/// # Errors
///
/// Not an http(s) URL with a host.
pub fn host_key(url: &str) -> Result<String, CredentialError> {
    let bad = || CredentialError::BadUrl(url.to_owned());
    let rest = url
        .strip_prefix("http://")
        .map(|r| (r, 80))
        .or_else(|| url.strip_prefix("https://").map(|r| (r, 443)));
    let (rest, default_port) = rest.ok_or_else(bad)?;
    let authority = rest.split('/').next().unwrap_or("");
    if authority.is_empty() || authority.contains('@') {
        return Err(bad());
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || !p.is_empty() => {
            (h, p.parse::<u16>().map_err(|_| bad())?)
        }
        _ => (authority, default_port),
    };
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if host.is_empty() {
        return Err(bad());
    }
    Ok(format!("{host}_{port}"))
}

/// The store under a bmx home.
#[derive(Debug, Clone)]
pub struct CredentialStore {
    dir: PathBuf,
}

/// Holds the store's flock while a read-modify-write runs.
pub struct StoreGuard {
    // Held, not read: closing it releases the flock.
    _file: File,
}

impl CredentialStore {
    pub fn new(home: &Path) -> CredentialStore {
        CredentialStore {
            dir: home.join("credentials"),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of the harness at `url`.
    ///
    /// # Errors
    ///
    /// A bad URL.
    pub fn path_for(&self, url: &str) -> Result<PathBuf, CredentialError> {
        Ok(self.dir.join(format!("{}.json", host_key(url)?)))
    }

    fn io(&self, path: &Path) -> impl Fn(std::io::Error) -> CredentialError + '_ {
        let path = path.to_owned();
        move |source| CredentialError::Io {
            path: path.clone(),
            source,
        }
    }

    fn ensure_dir(&self) -> Result<(), CredentialError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(self.io(&self.dir))?;
        // An existing folder keeps nobody else out unless it is 0700.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))
            .map_err(self.io(&self.dir))
    }

    /// Take the store's lock (blocking: held only for a read-modify-write).
    ///
    /// # Errors
    ///
    /// The folder or lock file cannot be created.
    pub fn lock(&self) -> Result<StoreGuard, CredentialError> {
        self.ensure_dir()?;
        let path = self.dir.join(".lock");
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&path)
            .map_err(self.io(&path))?;
        // SAFETY: flock on a valid, owned descriptor.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(self.io(&path)(std::io::Error::last_os_error()));
        }
        Ok(StoreGuard { _file: f })
    }

    /// Read the file of `url` (empty if missing).
    ///
    /// # Errors
    ///
    /// Unreadable, too big, or not a credential file.
    pub fn load(&self, url: &str) -> Result<HarnessCredentials, CredentialError> {
        let path = self.path_for(url)?;
        let f = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(HarnessCredentials {
                    harness: url.to_owned(),
                    ..Default::default()
                })
            }
            Err(e) => return Err(self.io(&path)(e)),
        };
        let mut buf = Vec::new();
        f.take(MAX_FILE_BYTES + 1)
            .read_to_end(&mut buf)
            .map_err(self.io(&path))?;
        if buf.len() as u64 > MAX_FILE_BYTES {
            return Err(CredentialError::Corrupt {
                path,
                reason: "larger than 1 MiB".into(),
            });
        }
        serde_json::from_slice(&buf).map_err(|e| CredentialError::Corrupt {
            path,
            reason: e.to_string(),
        })
    }

    /// Replace the file of `url` atomically, 0600. Call under [`lock`](Self::lock).
    ///
    /// # Errors
    ///
    /// The file cannot be written.
    pub fn save(&self, url: &str, creds: &HarnessCredentials) -> Result<(), CredentialError> {
        self.ensure_dir()?;
        let path = self.path_for(url)?;
        let text = serde_json::to_vec_pretty(creds).map_err(|e| CredentialError::Corrupt {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        write_atomic(&path, &text).map_err(self.io(&path))
    }
}

/// Write `bytes` to `path` through a 0600 temporary file and a rename, so
/// a reader sees the old file or the new one, never half of either.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        uuid::Uuid::new_v4().simple()
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn host_keys() {
        assert_eq!(host_key("http://127.0.0.1:7070").unwrap(), "127.0.0.1_7070");
        assert_eq!(host_key("https://h.example/x").unwrap(), "h.example_443");
        assert!(host_key("ftp://x").is_err());
        assert!(host_key("http://").is_err());
        assert!(host_key("http://u@h:1").is_err());
    }

    #[test]
    fn saved_0600_in_0700_and_read_back() {
        let home = tempfile::tempdir().unwrap();
        let s = CredentialStore::new(home.path());
        let url = "http://127.0.0.1:1234";
        let mut c = s.load(url).unwrap();
        assert!(c.credentials.is_empty());
        c.credentials.insert(
            "/w".into(),
            LocalCredential {
                credential_id: "c".into(),
                executor_id: "x".into(),
                token: "t".into(),
                issued_at: "now".into(),
            },
        );
        let _g = s.lock().unwrap();
        s.save(url, &c).unwrap();
        assert_eq!(s.load(url).unwrap(), c);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&s.path_for(url).unwrap()), 0o600);
        assert_eq!(mode(s.dir()), 0o700);
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(s.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
        std::fs::write(s.path_for(url).unwrap(), "{garbage").unwrap();
        assert!(matches!(s.load(url), Err(CredentialError::Corrupt { .. })));
    }
}

//! `skill.install`: fetch a skill archive from the harness with a one-time
//! token, verify its digest **before** looking inside, and unpack it into
//! the session's skills dir, `<workspace>/.skills/<skillId>/`.
//!
//! The archive is untrusted. It is read whole into memory (bounded by
//! [`MAX_ARCHIVE_BYTES`]) and **every entry is checked before anything is
//! written**: a relative path of plain names (no `..`, no absolute path);
//! regular files, directories, and symlinks whose target is relative and
//! has no `..` (so no chain of links can climb out: every link points at
//! or below its own directory); no hard links, devices, FIFOs. One bad
//! entry fails the whole install with an `errorCode`, and nothing is
//! written. A good archive is unpacked into a fresh staging directory
//! beside the workspace and renamed into place, so the skills dir holds
//! the old revision or the new one, never a mix.

use crate::tools::boundary;
use crate::wire::types::{SkillInstallParams, SkillInstallResult};
use sha2::Digest as _;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

/// The largest archive downloaded.
pub const MAX_ARCHIVE_BYTES: u64 = 64 << 20;
/// Entries and unpacked bytes at most.
pub const MAX_ENTRIES: usize = 10_000;
pub const MAX_UNPACKED_BYTES: u64 = 256 << 20;
/// Where skills go, under the workspace.
pub const SKILLS_DIR: &str = ".skills";

/// A failed install: `errorCode` and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct InstallError {
    pub code: &'static str,
    pub message: String,
}

fn fail(code: &'static str, message: impl Into<String>) -> InstallError {
    InstallError {
        code,
        message: message.into(),
    }
}

impl From<InstallError> for SkillInstallResult {
    fn from(e: InstallError) -> Self {
        SkillInstallResult {
            state: "failed".into(),
            error: Some(e.message),
            error_code: Some(e.code.into()),
        }
    }
}

/// One checked entry.
#[derive(Debug)]
enum Item {
    Dir(PathBuf),
    File(PathBuf, Vec<u8>, u32),
    Link(PathBuf, PathBuf),
}

/// A relative path of plain names, or the reason it is not one.
fn plain(p: &Path) -> Result<PathBuf, InstallError> {
    plain_parts(p).map_err(|(code, message)| fail(code, message))
}

/// The archive path rule of skill install and workspace restore: a
/// relative path of plain names (`.` dropped), or the rule it breaks as
/// (error code, message).
pub(crate) fn plain_parts(p: &Path) -> Result<PathBuf, (&'static str, String)> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir => {
                return Err((
                    "path_traversal",
                    format!("entry {p:?} climbs out with `..`"),
                ))
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(("absolute_path", format!("entry {p:?} is absolute")))
            }
        }
    }
    Ok(out)
}

/// Check every entry of `bytes` (tar, or tar compressed with zstd).
fn check(bytes: &[u8]) -> Result<Vec<Item>, InstallError> {
    let zstd_magic = [0x28, 0xb5, 0x2f, 0xfd];
    let reader: Box<dyn Read + '_> = if bytes.starts_with(&zstd_magic) {
        Box::new(
            zstd::Decoder::new(bytes)
                .map_err(|e| fail("bad_archive", e.to_string()))?
                .take(MAX_UNPACKED_BYTES + 1_000_000),
        )
    } else {
        Box::new(bytes)
    };
    let mut archive = tar::Archive::new(reader);
    let bad = |e: std::io::Error| fail("bad_archive", e.to_string());
    let mut items = Vec::new();
    let mut total = 0u64;
    for entry in archive.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        if items.len() >= MAX_ENTRIES {
            return Err(fail(
                "too_large",
                format!("more than {MAX_ENTRIES} entries"),
            ));
        }
        let raw = entry.path().map_err(bad)?.into_owned();
        let path = plain(&raw)?;
        let kind = entry.header().entry_type();
        if path.as_os_str().is_empty() {
            if kind.is_dir() {
                continue;
            }
            return Err(fail("bad_archive", format!("entry {raw:?} has no name")));
        }
        match kind {
            tar::EntryType::Directory => items.push(Item::Dir(path)),
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = entry.header().size().map_err(bad)?;
                total = total.saturating_add(size);
                if total > MAX_UNPACKED_BYTES {
                    return Err(fail(
                        "too_large",
                        format!("more than {MAX_UNPACKED_BYTES} bytes unpacked"),
                    ));
                }
                let mode = entry.header().mode().map_err(bad)? & 0o755;
                let mut data = Vec::with_capacity(size.min(1 << 20) as usize);
                (&mut entry)
                    .take(size)
                    .read_to_end(&mut data)
                    .map_err(bad)?;
                items.push(Item::File(path, data, mode));
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| fail("bad_archive", format!("symlink {raw:?} has no target")))?
                    .into_owned();
                if target.is_absolute()
                    || target
                        .components()
                        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
                {
                    return Err(fail(
                        "symlink_escape",
                        format!("symlink {raw:?} → {target:?} may leave the skill"),
                    ));
                }
                items.push(Item::Link(path, target));
            }
            tar::EntryType::Link => {
                return Err(fail("hard_link", format!("entry {raw:?} is a hard link")))
            }
            tar::EntryType::XGlobalHeader
            | tar::EntryType::XHeader
            | tar::EntryType::GNULongName
            | tar::EntryType::GNULongLink => {}
            other => {
                return Err(fail(
                    "special_file",
                    format!("entry {raw:?} is a {other:?}, not a file, directory or symlink"),
                ))
            }
        }
    }
    Ok(items)
}

/// Write checked `items` under `root` (a fresh, empty directory).
fn write(root: &Path, items: &[Item]) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for item in items {
        match item {
            Item::Dir(p) => std::fs::create_dir_all(root.join(p))?,
            Item::File(p, data, mode) => {
                let dest = root.join(p);
                if let Some(parent) = dest.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&dest)?;
                std::io::Write::write_all(&mut f, data)?;
                f.set_permissions(std::fs::Permissions::from_mode(*mode | 0o600))?;
            }
            Item::Link(p, target) => {
                let dest = root.join(p);
                if let Some(parent) = dest.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::os::unix::fs::symlink(target, &dest)?;
            }
        }
    }
    Ok(())
}

/// Check `bytes` against `digest`, then unpack it as skill `skill_id` in
/// `workspace`. Blocking.
pub fn install_bytes(
    workspace: &Path,
    skill_id: &str,
    digest: &str,
    bytes: &[u8],
) -> Result<(), InstallError> {
    let hex: String = sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if !digest.eq_ignore_ascii_case(&format!("sha256:{hex}")) {
        return Err(fail(
            "digest_mismatch",
            format!("the archive hashes to sha256:{hex}, not {digest}"),
        ));
    }
    let items = check(bytes)?;
    if crate::wire::id::check("skillId", skill_id).is_err() || skill_id.starts_with('.') {
        return Err(fail("invalid_skill_id", "skillId breaks the id rule"));
    }
    let dest = boundary::resolve(workspace, &format!("{SKILLS_DIR}/{skill_id}"))
        .map_err(|e| fail("workspace_boundary", e.to_string()))?;
    let skills = dest.parent().expect("under the skills dir").to_owned();
    let io = |e: std::io::Error| fail("io_error", e.to_string());
    std::fs::create_dir_all(&skills).map_err(io)?;
    let staging = tempfile::Builder::new()
        .prefix(".staging-")
        .tempdir_in(&skills)
        .map_err(io)?;
    write(staging.path(), &items).map_err(io)?;
    // Replace the old revision: move it aside, move the new one in.
    let old = skills.join(format!(".old-{skill_id}-{:016x}", rand::random::<u64>()));
    let had_old = std::fs::rename(&dest, &old).is_ok();
    let staged = staging.keep();
    std::fs::rename(&staged, &dest).map_err(io)?;
    if had_old {
        let _ = std::fs::remove_dir_all(&old);
    }
    Ok(())
}

fn expired(at: &str) -> bool {
    time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339)
        .map(|t| t <= time::OffsetDateTime::now_utc())
        .unwrap_or(true)
}

/// Run `skill.install`: every failure is an answer (`state: failed`).
pub async fn run(workspace: &Path, p: SkillInstallParams) -> SkillInstallResult {
    let r = install_result(workspace, p).await;
    if r.state == "installed" {
        // The unpacked skill is the `--run-as` user's, if one is set.
        let dir = workspace.join(SKILLS_DIR);
        let owned =
            tokio::task::spawn_blocking(move || crate::process::run_as::chown_tree(&dir)).await;
        if let Ok(Err(e)) = owned {
            tracing::warn!(error = %e, "installed skill not handed to the run-as user");
        }
    }
    r
}

async fn install_result(workspace: &Path, p: SkillInstallParams) -> SkillInstallResult {
    match install(workspace, p).await {
        Ok(()) => SkillInstallResult {
            state: "installed".into(),
            error: None,
            error_code: None,
        },
        Err(e) => e.into(),
    }
}

async fn install(workspace: &Path, p: SkillInstallParams) -> Result<(), InstallError> {
    if expired(&p.download_expires_at) {
        return Err(fail("token_expired", "the download token has expired"));
    }
    let Some(url) = p.download_url.clone() else {
        return Err(fail("download_failed", "no downloadUrl"));
    };
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(120))
        .build()
        .map_err(|e| fail("download_failed", e.to_string()))?;
    let mut resp = client
        .get(&url)
        .bearer_auth(&p.download_token)
        .send()
        .await
        .map_err(|e| fail("download_failed", e.to_string()))?;
    match resp.status().as_u16() {
        200 => {}
        401 | 403 | 410 => {
            return Err(fail(
                "token_invalid",
                format!("the harness refused the token (HTTP {})", resp.status()),
            ))
        }
        s => return Err(fail("download_failed", format!("HTTP {s}"))),
    }
    // Bounded as it arrives, whatever Content-Length claims.
    let mut bytes = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| fail("download_failed", e.to_string()))?
    {
        if bytes.len() as u64 + chunk.len() as u64 > MAX_ARCHIVE_BYTES {
            return Err(fail(
                "too_large",
                format!("the archive is over {MAX_ARCHIVE_BYTES} bytes"),
            ));
        }
        bytes.extend_from_slice(&chunk);
    }
    let ws = workspace.to_owned();
    tokio::task::spawn_blocking(move || install_bytes(&ws, &p.skill_id, &p.digest, &bytes))
        .await
        .map_err(|e| fail("io_error", e.to_string()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tar entry written byte by byte, so that names `tar::Builder`
    /// refuses (`..`, absolute) can be crafted.
    fn entry(out: &mut Vec<u8>, name: &str, kind: tar::EntryType, data: &[u8], link: &str) {
        let mut h = tar::Header::new_old();
        {
            let old = h.as_old_mut();
            old.name[..name.len()].copy_from_slice(name.as_bytes());
            old.linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        h.set_entry_type(kind);
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }

    fn finish(mut out: Vec<u8>) -> Vec<u8> {
        out.extend_from_slice(&[0u8; 1024]);
        out
    }

    fn digest(b: &[u8]) -> String {
        let hex: String = sha2::Sha256::digest(b)
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect();
        format!("sha256:{hex}")
    }

    fn good() -> Vec<u8> {
        let mut t = Vec::new();
        entry(&mut t, "docs/", tar::EntryType::Directory, b"", "");
        entry(
            &mut t,
            "docs/SKILL.md",
            tar::EntryType::Regular,
            b"# skill",
            "",
        );
        entry(&mut t, "run.sh", tar::EntryType::Regular, b"echo hi", "");
        entry(
            &mut t,
            "docs/link",
            tar::EntryType::Symlink,
            b"",
            "SKILL.md",
        );
        finish(t)
    }

    #[test]
    fn a_good_archive_is_installed_and_replaced_whole() {
        let d = tempfile::tempdir().unwrap();
        let ws = d.path().join("ws");
        std::fs::create_dir(&ws).unwrap();
        let a = good();
        install_bytes(&ws, "s1", &digest(&a), &a).unwrap();
        let root = ws.join(".skills/s1");
        assert_eq!(
            std::fs::read(root.join("docs/SKILL.md")).unwrap(),
            b"# skill"
        );
        assert_eq!(std::fs::read(root.join("docs/link")).unwrap(), b"# skill");
        // A new revision replaces the old one whole.
        let mut t = Vec::new();
        entry(&mut t, "v2.txt", tar::EntryType::Regular, b"2", "");
        let b = finish(t);
        install_bytes(&ws, "s1", &digest(&b), &b).unwrap();
        assert!(!root.join("run.sh").exists());
        assert_eq!(std::fs::read(root.join("v2.txt")).unwrap(), b"2");
        // And compressed archives are read too.
        let z = zstd::encode_all(&a[..], 3).unwrap();
        install_bytes(&ws, "s2", &digest(&z), &z).unwrap();
        assert!(ws.join(".skills/s2/run.sh").exists());
    }

    #[test]
    fn malicious_archives_fail_and_write_nothing() {
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("path_traversal", {
                let mut t = Vec::new();
                entry(&mut t, "ok.txt", tar::EntryType::Regular, b"fine", "");
                entry(&mut t, "../../evil", tar::EntryType::Regular, b"x", "");
                finish(t)
            }),
            ("absolute_path", {
                let mut t = Vec::new();
                entry(&mut t, "/tmp/evil-abs", tar::EntryType::Regular, b"x", "");
                finish(t)
            }),
            ("symlink_escape", {
                let mut t = Vec::new();
                entry(&mut t, "out", tar::EntryType::Symlink, b"", "/etc");
                entry(&mut t, "out/passwd", tar::EntryType::Regular, b"x", "");
                finish(t)
            }),
            ("symlink_escape", {
                let mut t = Vec::new();
                entry(&mut t, "up", tar::EntryType::Symlink, b"", "../..");
                finish(t)
            }),
            ("hard_link", {
                let mut t = Vec::new();
                entry(&mut t, "h", tar::EntryType::Link, b"", "/etc/passwd");
                finish(t)
            }),
            ("special_file", {
                let mut t = Vec::new();
                entry(&mut t, "dev", tar::EntryType::Char, b"", "");
                finish(t)
            }),
            ("special_file", {
                let mut t = Vec::new();
                entry(&mut t, "fifo", tar::EntryType::Fifo, b"", "");
                finish(t)
            }),
        ];
        for (code, a) in cases {
            let d = tempfile::tempdir().unwrap();
            let ws = d.path().join("ws");
            std::fs::create_dir(&ws).unwrap();
            let e = install_bytes(&ws, "bad", &digest(&a), &a).unwrap_err();
            assert_eq!(e.code, code, "{e}");
            assert!(
                !ws.join(".skills/bad").exists(),
                "{code}: nothing installed"
            );
            assert!(!d.path().join("evil").exists());
            assert!(!Path::new("/tmp/evil-abs").exists());
            // Only the (empty) skills dir may exist: nothing was written.
            let written: Vec<_> = walk(&ws);
            assert!(
                written.iter().all(|p| p.ends_with(".skills")),
                "{code}: {written:?}"
            );
        }
    }

    fn walk(p: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(p).unwrap().flatten() {
            out.push(e.path());
            if e.file_type().unwrap().is_dir() {
                out.extend(walk(&e.path()));
            }
        }
        out
    }

    #[test]
    fn the_digest_is_checked_before_the_archive_is_read() {
        let d = tempfile::tempdir().unwrap();
        let a = good();
        let e = install_bytes(d.path(), "s", &digest(b"other"), &a).unwrap_err();
        assert_eq!(e.code, "digest_mismatch");
        assert!(!d.path().join(".skills").exists());
        let junk = b"not a tar at all, not even close".repeat(20);
        let e = install_bytes(d.path(), "s", &digest(&junk), &junk).unwrap_err();
        assert_eq!(e.code, "bad_archive", "{e}");
        assert!(expired("2000-01-01T00:00:00Z"));
        assert!(expired("garbage"));
        assert!(!expired("2999-01-01T00:00:00Z"));
    }
}

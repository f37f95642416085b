//! Restore a workspace backup into a fresh session (`session.assign.restore`,
//! issue 15): download the archive with the one-time token, verify its
//! digest **before** reading it, check every entry, then unpack it into
//! the workspace, all before `session.ready`.
//!
//! The archive is untrusted, whoever made it. The rules are skill
//! install's ([`super::skills`]), streamed, because a backup may be far
//! larger than a skill:
//! - downloaded into an unnamed temp file outside the workspace, at most
//!   [`MAX_ARCHIVE_BYTES`] counted as it arrives (`too_large`); its
//!   SHA-256 must be `digest` (`digest_mismatch`), or nothing is read;
//! - **pass 1** reads every header and writes nothing: paths of plain
//!   names (`path_traversal` for `..`, `absolute_path`); regular files,
//!   directories and symlinks only (`hard_link`, `special_file`); a
//!   symlink's target relative, made of leading `..` that do not climb
//!   above the workspace and then plain names (`symlink_escape`); no
//!   entry below a symlink of the archive (`symlink_escape`: nothing is
//!   ever written through a link); at most [`MAX_ENTRIES`] entries and
//!   [`MAX_UNPACKED_BYTES`] unpacked (`too_large`); a readable tar
//!   (`bad_archive`);
//! - **pass 2** reads the archive again and writes each entry through the
//!   workspace handle ([`Beneath`]: no symlink is followed on the way,
//!   whatever appears meanwhile); file modes keep the permission bits
//!   without setuid/setgid/sticky, and the recorded mtime.
//!
//! The workspace must be empty (`workspace_not_empty`): a restore gives
//! back the tree as it was, it does not merge. A failure in pass 2
//! (`io_error`, `disk_full`) can leave part of the tree: the session does
//! not become ready then, so nothing runs on it as if it were whole.

use crate::tools::beneath::Beneath;
use crate::wire::types::RestoreSource;
use sha2::Digest as _;
use std::collections::HashSet;
use std::io::{Read, Seek, Write};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

/// The largest archive downloaded (the blob store's default limit).
pub const MAX_ARCHIVE_BYTES: u64 = super::artifacts::MAX_BYTES;
/// Entries at most (the backup's own limit).
pub const MAX_ENTRIES: usize = 1_000_000;
/// Bytes unpacked at most (a zstd bomb stops here).
pub const MAX_UNPACKED_BYTES: u64 = 8 << 30;
/// The whole download's deadline.
const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(600);

/// A failed restore: `code` and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct RestoreError {
    pub code: &'static str,
    pub message: String,
}

fn fail(code: &'static str, message: impl Into<String>) -> RestoreError {
    RestoreError {
        code,
        message: message.into(),
    }
}

fn io(e: std::io::Error) -> RestoreError {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => fail("disk_full", e.to_string()),
        Some(libc::ELOOP) | Some(libc::EXDEV) => fail("symlink_escape", e.to_string()),
        _ => fail("io_error", e.to_string()),
    }
}

fn expired(at: &str) -> bool {
    time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339)
        .map(|t| t <= time::OffsetDateTime::now_utc())
        .unwrap_or(true)
}

/// Download, verify and unpack `src` into `workspace`; the entries
/// written.
///
/// # Errors
///
/// The first rule broken, as a [`RestoreError`] (module docs).
pub async fn run(workspace: &Path, src: &RestoreSource) -> Result<usize, RestoreError> {
    if expired(&src.download_expires_at) {
        return Err(fail("token_expired", "the download token has expired"));
    }
    let file = download(src).await?;
    let ws = workspace.to_owned();
    tokio::task::spawn_blocking(move || {
        let n = unpack_file(&ws, file)?;
        // What the executor unpacked is the `--run-as` user's, if one is set.
        crate::process::run_as::chown_tree(&ws).map_err(io)?;
        Ok(n)
    })
    .await
    .map_err(|e| fail("io_error", e.to_string()))?
}

async fn download(src: &RestoreSource) -> Result<std::fs::File, RestoreError> {
    let dl = |e: reqwest::Error| fail("download_failed", e.to_string());
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .timeout(DOWNLOAD_TIMEOUT)
        .build()
        .map_err(dl)?;
    let mut resp = client
        .get(&src.download_url)
        .bearer_auth(&src.download_token)
        .send()
        .await
        .map_err(dl)?;
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
    let tmp = tokio::task::spawn_blocking(tempfile::tempfile)
        .await
        .map_err(|e| fail("io_error", e.to_string()))?
        .map_err(io)?;
    let mut out = tokio::fs::File::from_std(tmp);
    let mut h = sha2::Sha256::new();
    let mut size = 0u64;
    while let Some(chunk) = resp.chunk().await.map_err(dl)? {
        size += chunk.len() as u64;
        if size > MAX_ARCHIVE_BYTES {
            return Err(fail(
                "too_large",
                format!("the archive is over {MAX_ARCHIVE_BYTES} bytes"),
            ));
        }
        h.update(&chunk);
        tokio::io::AsyncWriteExt::write_all(&mut out, &chunk)
            .await
            .map_err(io)?;
    }
    tokio::io::AsyncWriteExt::flush(&mut out)
        .await
        .map_err(io)?;
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    let got = format!("sha256:{hex}");
    if !got.eq_ignore_ascii_case(&src.digest) {
        return Err(fail(
            "digest_mismatch",
            format!("the archive hashes to {got}, not {}", src.digest),
        ));
    }
    Ok(out.into_std().await)
}

/// The archive in `file` (tar, or tar compressed with zstd), from its
/// start. Blocking.
fn reader(file: &mut std::fs::File) -> Result<Box<dyn Read + '_>, RestoreError> {
    file.rewind().map_err(io)?;
    let mut magic = [0u8; 4];
    let n = file.read(&mut magic).map_err(io)?;
    file.rewind().map_err(io)?;
    if n == 4 && magic == [0x28, 0xb5, 0x2f, 0xfd] {
        let d = zstd::Decoder::new(file).map_err(|e| fail("bad_archive", e.to_string()))?;
        Ok(Box::new(d.take(MAX_UNPACKED_BYTES + (64 << 20))))
    } else {
        Ok(Box::new(file))
    }
}

/// A relative path of plain names (`.` dropped), or the rule it breaks
/// (skill install's rule).
fn plain(p: &Path) -> Result<PathBuf, RestoreError> {
    super::skills::plain_parts(p).map_err(|(code, message)| fail(code, message))
}

/// A symlink at `link` may point at `target`: relative, its leading `..`
/// no more than the link's depth, then plain names only, so it resolves
/// inside the workspace from the link's own (real) directory.
fn link_ok(link: &Path, target: &Path) -> bool {
    let depth = link.components().count().saturating_sub(1);
    let mut ups = 0;
    let mut names = false;
    for c in target.components() {
        match c {
            Component::ParentDir if !names => ups += 1,
            Component::CurDir => {}
            Component::Normal(_) => names = true,
            _ => return false,
        }
    }
    ups <= depth
}

/// What pass 1 found of one entry.
enum Kind {
    Dir,
    File,
    Link,
}

/// Pass 1: every entry checked, nothing written. Blocking.
fn check(file: &mut std::fs::File) -> Result<usize, RestoreError> {
    let bad = |e: std::io::Error| fail("bad_archive", e.to_string());
    let mut archive = tar::Archive::new(reader(file)?);
    let mut links: HashSet<PathBuf> = HashSet::new();
    let (mut count, mut total) = (0usize, 0u64);
    for entry in archive.entries().map_err(bad)? {
        let entry = entry.map_err(bad)?;
        let raw = entry.path().map_err(bad)?.into_owned();
        let path = plain(&raw)?;
        let kind = entry.header().entry_type();
        if path.as_os_str().is_empty() {
            if kind.is_dir() {
                continue;
            }
            return Err(fail("bad_archive", format!("entry {raw:?} has no name")));
        }
        count += 1;
        if count > MAX_ENTRIES {
            return Err(fail(
                "too_large",
                format!("more than {MAX_ENTRIES} entries"),
            ));
        }
        // Nothing below a link of the archive: it would be written
        // through the link.
        if path.ancestors().skip(1).any(|a| links.contains(a)) {
            return Err(fail(
                "symlink_escape",
                format!("entry {raw:?} lies below a symlink of the archive"),
            ));
        }
        match kind {
            tar::EntryType::Directory => {}
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                total = total.saturating_add(entry.header().size().map_err(bad)?);
                if total > MAX_UNPACKED_BYTES {
                    return Err(fail(
                        "too_large",
                        format!("more than {MAX_UNPACKED_BYTES} bytes unpacked"),
                    ));
                }
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| fail("bad_archive", format!("symlink {raw:?} has no target")))?;
                if !link_ok(&path, &target) {
                    return Err(fail(
                        "symlink_escape",
                        format!("symlink {raw:?} → {target:?} leads outside the workspace"),
                    ));
                }
                links.insert(path);
            }
            tar::EntryType::Link => {
                return Err(fail("hard_link", format!("entry {raw:?} is a hard link")))
            }
            tar::EntryType::XGlobalHeader
            | tar::EntryType::XHeader
            | tar::EntryType::GNULongName
            | tar::EntryType::GNULongLink => {
                count -= 1;
            }
            other => {
                return Err(fail(
                    "special_file",
                    format!("entry {raw:?} is a {other:?}, not a file, directory or symlink"),
                ))
            }
        }
    }
    Ok(count)
}

/// Pass 2: write every entry through the workspace handle. Blocking.
fn write(workspace: &Path, file: &mut std::fs::File) -> Result<usize, RestoreError> {
    use std::os::unix::fs::PermissionsExt;
    let bad = |e: std::io::Error| fail("bad_archive", e.to_string());
    let ws = crate::tools::boundary::canonical_workspace(workspace);
    let b = Beneath::new(&ws).map_err(io)?;
    let mut archive = tar::Archive::new(reader(file)?);
    let mut written = 0usize;
    for entry in archive.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        let path = plain(&entry.path().map_err(bad)?)?;
        if path.as_os_str().is_empty() {
            continue;
        }
        let dest = ws.join(&path);
        let kind = match entry.header().entry_type() {
            tar::EntryType::Directory => Kind::Dir,
            tar::EntryType::Regular | tar::EntryType::Continuous => Kind::File,
            tar::EntryType::Symlink => Kind::Link,
            _ => continue,
        };
        match kind {
            Kind::Dir => b.make_dir(&dest).map_err(io)?,
            Kind::File => {
                let mode = entry.header().mode().map_err(bad)? & 0o777;
                let mut f = b.create(&dest).map_err(io)?;
                std::io::copy(&mut entry, &mut f).map_err(io)?;
                f.set_permissions(std::fs::Permissions::from_mode(mode | 0o600))
                    .map_err(io)?;
                if let Ok(secs) = entry.header().mtime() {
                    let at = std::time::UNIX_EPOCH + Duration::from_secs(secs);
                    let _ = f.set_modified(at);
                }
                f.flush().map_err(io)?;
            }
            Kind::Link => {
                let target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| fail("bad_archive", "a symlink without a target"))?
                    .into_owned();
                b.symlink(&target, &dest).map_err(io)?;
            }
        }
        written += 1;
    }
    Ok(written)
}

/// Check, then unpack, the verified archive in `file` into `workspace`
/// (which must be empty). Blocking.
///
/// # Errors
///
/// The first rule broken (module docs).
pub fn unpack_file(workspace: &Path, mut file: std::fs::File) -> Result<usize, RestoreError> {
    let mut dir = std::fs::read_dir(workspace).map_err(io)?;
    if dir.next().is_some() {
        return Err(fail(
            "workspace_not_empty",
            "a restore goes into an empty workspace",
        ));
    }
    check(&mut file)?;
    write(workspace, &mut file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(out: &mut Vec<u8>, name: &str, kind: tar::EntryType, data: &[u8], link: &str) {
        let mut h = tar::Header::new_old();
        {
            let old = h.as_old_mut();
            old.name[..name.len()].copy_from_slice(name.as_bytes());
            old.linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        h.set_entry_type(kind);
        h.set_size(data.len() as u64);
        h.set_mode(0o4755);
        h.set_mtime(1_000_000);
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }

    fn file_of(mut t: Vec<u8>, zstd: bool) -> std::fs::File {
        t.extend_from_slice(&[0u8; 1024]);
        let bytes = if zstd {
            zstd::encode_all(&t[..], 3).unwrap()
        } else {
            t
        };
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&bytes).unwrap();
        f
    }

    #[test]
    fn a_backup_is_restored_with_modes_mtimes_and_links() {
        let d = tempfile::tempdir().unwrap();
        let mut t = Vec::new();
        entry(&mut t, "src/", tar::EntryType::Directory, b"", "");
        entry(
            &mut t,
            "src/main.rs",
            tar::EntryType::Regular,
            b"fn main() {}",
            "",
        );
        entry(&mut t, "src/deep/", tar::EntryType::Directory, b"", "");
        entry(
            &mut t,
            "src/deep/up",
            tar::EntryType::Symlink,
            b"",
            "../main.rs",
        );
        entry(&mut t, "top", tar::EntryType::Symlink, b"", "src/main.rs");
        let n = unpack_file(d.path(), file_of(t, true)).unwrap();
        assert_eq!(n, 5);
        assert_eq!(
            std::fs::read(d.path().join("src/deep/up")).unwrap(),
            b"fn main() {}"
        );
        assert_eq!(
            std::fs::read(d.path().join("top")).unwrap(),
            b"fn main() {}"
        );
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(d.path().join("src/main.rs")).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o755, "no setuid");
        assert_eq!(
            m.modified().unwrap(),
            std::time::UNIX_EPOCH + Duration::from_secs(1_000_000)
        );
        // Not into a workspace that holds something.
        let mut t = Vec::new();
        entry(&mut t, "x", tar::EntryType::Regular, b"x", "");
        let e = unpack_file(d.path(), file_of(t, false)).unwrap_err();
        assert_eq!(e.code, "workspace_not_empty");
    }

    #[test]
    fn malicious_archives_write_nothing() {
        type Entries<'a> = Vec<(&'a str, tar::EntryType, &'a str)>;
        let cases: Vec<(&str, Entries)> = vec![
            (
                "path_traversal",
                vec![
                    ("ok", tar::EntryType::Regular, ""),
                    ("../../evil", tar::EntryType::Regular, ""),
                ],
            ),
            (
                "absolute_path",
                vec![("/tmp/bmx-restore-evil", tar::EntryType::Regular, "")],
            ),
            (
                "symlink_escape",
                vec![("out", tar::EntryType::Symlink, "/etc")],
            ),
            (
                "symlink_escape",
                vec![("a/up", tar::EntryType::Symlink, "../..")],
            ),
            (
                "symlink_escape",
                vec![("a/up", tar::EntryType::Symlink, "../x/../../y")],
            ),
            (
                "symlink_escape",
                vec![
                    ("d", tar::EntryType::Symlink, "sub"),
                    ("d/f", tar::EntryType::Regular, ""),
                ],
            ),
            (
                "hard_link",
                vec![("h", tar::EntryType::Link, "/etc/passwd")],
            ),
            ("special_file", vec![("dev", tar::EntryType::Char, "")]),
            ("special_file", vec![("fifo", tar::EntryType::Fifo, "")]),
        ];
        for (code, entries) in cases {
            let d = tempfile::tempdir().unwrap();
            let ws = d.path().join("ws");
            std::fs::create_dir(&ws).unwrap();
            let mut t = Vec::new();
            for (name, kind, link) in &entries {
                entry(&mut t, name, *kind, b"x", link);
            }
            let e = unpack_file(&ws, file_of(t, false)).unwrap_err();
            assert_eq!(e.code, code, "{entries:?}: {e}");
            assert_eq!(
                std::fs::read_dir(&ws).unwrap().count(),
                0,
                "{code}: nothing written"
            );
            assert!(!d.path().join("evil").exists());
        }
        assert!(!Path::new("/tmp/bmx-restore-evil").exists());
    }

    #[test]
    fn links_may_climb_only_as_deep_as_they_are() {
        assert!(link_ok(Path::new("a/b/l"), Path::new("../../x")));
        assert!(!link_ok(Path::new("a/b/l"), Path::new("../../../x")));
        assert!(!link_ok(Path::new("l"), Path::new("..")));
        assert!(!link_ok(Path::new("a/l"), Path::new("x/../..")));
        assert!(!link_ok(Path::new("a/l"), Path::new("/x")));
        assert!(link_ok(Path::new("l"), Path::new("./x/y")));
    }
}

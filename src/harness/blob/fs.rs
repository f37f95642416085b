//! [`FsBlobStore`]: blobs as files under one directory.
//!
//! Layout: `sha256/<2 hex>/<64 hex>` holds complete, verified blobs;
//! `partial/<64 hex>` an upload in progress; `tmp/` whole-blob writes
//! before their rename. All three are on one file system, so publishing is
//! a `rename(2)`: a reader sees no blob or the whole blob, never a part.
//! Each write is fsynced before it is acknowledged, and the directory after
//! a rename, so an acknowledged byte survives a crash of the harness.
//!
//! Private to the harness's user (issue 56): the root is made or checked
//! by [`data_dir::prepare`], every directory is 0700 and every file 0600
//! whatever the umask; directories of an earlier run are made 0700, which
//! also hides the older files in them.

use super::{BlobError, BlobReader, BlobStore, Digest};
use crate::harness::data_dir;
use async_trait::async_trait;
use dashmap::DashMap;
use sha2::Digest as _;
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

/// Blobs under a directory.
pub struct FsBlobStore {
    root: PathBuf,
    max_bytes: u64,
    /// One lock per digest with an upload in progress: appends and the
    /// commit of one digest never interleave. Entries are removed when the
    /// upload is committed or discarded.
    locks: DashMap<String, Arc<tokio::sync::Mutex<()>>>,
}

/// Whether an I/O error means the disk (or the quota) is full.
fn is_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl FsBlobStore {
    /// Open (creating) a store in `root`, accepting blobs of at most
    /// `max_bytes`. Stale `tmp/` files of an earlier run are removed;
    /// `partial/` files are kept (their uploads may resume).
    ///
    /// # Errors
    ///
    /// `root` is another user's or writable by others
    /// ([`data_dir::prepare`]), or the directories cannot be created.
    pub fn open(root: impl Into<PathBuf>, max_bytes: u64) -> io::Result<FsBlobStore> {
        let root = root.into();
        data_dir::prepare(&root)?;
        data_dir::tighten(&root, 0o700)?;
        for d in ["sha256", "partial", "tmp"] {
            data_dir::private_subdir(&root.join(d))?;
        }
        if let Ok(entries) = std::fs::read_dir(root.join("tmp")) {
            for e in entries.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(FsBlobStore {
            root,
            max_bytes,
            locks: DashMap::new(),
        })
    }

    fn final_path(&self, d: &Digest) -> PathBuf {
        self.root.join("sha256").join(&d.hex()[..2]).join(d.hex())
    }

    fn partial_path(&self, d: &Digest) -> PathBuf {
        self.root.join("partial").join(d.hex())
    }

    fn lock(&self, d: &Digest) -> Arc<tokio::sync::Mutex<()>> {
        self.locks.entry(d.hex().to_owned()).or_default().clone()
    }

    fn unlock(&self, d: &Digest) {
        self.locks
            .remove_if(d.hex(), |_, l| Arc::strong_count(l) <= 2);
    }

    fn check_size(&self, size: u64) -> Result<(), BlobError> {
        if size > self.max_bytes {
            return Err(BlobError::TooLarge {
                size,
                max: self.max_bytes,
            });
        }
        Ok(())
    }
}

/// Run blocking file work off the runtime's worker threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BlobError> + Send + 'static,
) -> Result<T, BlobError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| BlobError::Io(io::Error::other(e.to_string())))?
}

/// Write `data` at the end of `partial` (which must be `offset` long) and
/// fsync it. On a full disk the partial file is removed: a half-written
/// chunk must not be taken for received bytes, and the space is given back.
fn append_file(partial: &Path, size: u64, offset: u64, data: &[u8]) -> Result<u64, BlobError> {
    let end = offset + data.len() as u64;
    if end > size {
        return Err(BlobError::TooLarge {
            size: end,
            max: size,
        });
    }
    let mut f = data_dir::private_file()
        .create(true)
        .append(true)
        .open(partial)?;
    let current = f.metadata()?.len();
    if current != offset {
        return Err(BlobError::OffsetMismatch { offset, current });
    }
    let written = f.write_all(data).and_then(|()| f.sync_data());
    match written {
        Ok(()) => Ok(end),
        Err(e) if is_full(&e) => {
            drop(f);
            let _ = std::fs::remove_file(partial);
            Err(BlobError::DiskFull)
        }
        Err(e) => {
            // Whatever part of the chunk landed is cut off again, so the
            // kept length stays a count of whole acknowledged chunks.
            let _ = f.set_len(offset);
            Err(e.into())
        }
    }
}

/// The SHA-256 of a file, streamed in 256 KiB reads.
fn hash_file(path: &Path) -> io::Result<(Digest, u64)> {
    let mut f = File::open(path)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut n_total = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        n_total += n as u64;
        h.update(&buf[..n]);
    }
    Ok((Digest::from_sha256(&h.finalize()), n_total))
}

/// Rename `from` to `to` (creating `to`'s directory) and fsync the
/// directories involved.
fn publish(from: &Path, to: &Path) -> io::Result<()> {
    let dir = to.parent().expect("blob paths have a parent");
    data_dir::private_subdir(dir)?;
    std::fs::rename(from, to)?;
    fsync_dir(dir)?;
    if let Some(p) = dir.parent() {
        fsync_dir(p)?;
    }
    if let Some(src) = from.parent() {
        fsync_dir(src)?;
    }
    Ok(())
}

#[async_trait]
impl BlobStore for FsBlobStore {
    fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    async fn stat(&self, digest: &Digest) -> Result<Option<u64>, BlobError> {
        match tokio::fs::metadata(self.final_path(digest)).await {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn partial_len(&self, digest: &Digest) -> Result<u64, BlobError> {
        match tokio::fs::metadata(self.partial_path(digest)).await {
            Ok(m) => Ok(m.len()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
            Err(e) => Err(e.into()),
        }
    }

    async fn append(
        &self,
        digest: &Digest,
        size: u64,
        offset: u64,
        data: &[u8],
    ) -> Result<u64, BlobError> {
        self.check_size(size)?;
        let lock = self.lock(digest);
        let _g = lock.lock().await;
        let partial = self.partial_path(digest);
        let data = data.to_vec();
        let r = blocking(move || append_file(&partial, size, offset, &data)).await;
        if matches!(r, Err(BlobError::DiskFull)) {
            tracing::warn!(%digest, "blob store disk full: partial upload removed");
        }
        r
    }

    async fn commit(&self, digest: &Digest, size: u64) -> Result<(), BlobError> {
        self.check_size(size)?;
        let lock = self.lock(digest);
        let r = {
            let _g = lock.lock().await;
            let partial = self.partial_path(digest);
            let target = self.final_path(digest);
            let expected = digest.clone();
            blocking(move || {
                if let Ok(m) = std::fs::metadata(&target) {
                    let _ = std::fs::remove_file(&partial);
                    // Content-addressed: the stored blob is these bytes,
                    // unless the size the caller declared says otherwise.
                    if m.len() != size {
                        return Err(BlobError::Incomplete {
                            have: m.len(),
                            size,
                        });
                    }
                    return Ok(());
                }
                let have = match std::fs::metadata(&partial) {
                    Ok(m) => m.len(),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
                    Err(e) => return Err(e.into()),
                };
                if have != size {
                    return Err(BlobError::Incomplete { have, size });
                }
                let (actual, _) = hash_file(&partial)?;
                if actual != expected {
                    let _ = std::fs::remove_file(&partial);
                    return Err(BlobError::DigestMismatch {
                        expected: expected.to_string(),
                        actual: actual.to_string(),
                    });
                }
                File::open(&partial)?.sync_all()?;
                publish(&partial, &target)?;
                Ok(())
            })
            .await
        };
        drop(lock);
        if !matches!(r, Err(BlobError::Incomplete { .. })) {
            self.unlock(digest);
        }
        r
    }

    async fn put(&self, data: &[u8]) -> Result<Digest, BlobError> {
        self.check_size(data.len() as u64)?;
        let digest = Digest::of(data);
        let target = self.final_path(&digest);
        let tmp =
            self.root
                .join("tmp")
                .join(format!("{}.{:016x}", digest.hex(), rand::random::<u64>()));
        let data = data.to_vec();
        blocking(move || {
            if target.exists() {
                return Ok(());
            }
            let written = (|| {
                let mut f = data_dir::private_file()
                    .write(true)
                    .create_new(true)
                    .open(&tmp)?;
                f.write_all(&data)?;
                f.sync_all()
            })();
            if let Err(e) = written {
                let _ = std::fs::remove_file(&tmp);
                return Err(if is_full(&e) {
                    BlobError::DiskFull
                } else {
                    e.into()
                });
            }
            publish(&tmp, &target).map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                BlobError::from(e)
            })
        })
        .await?;
        Ok(digest)
    }

    async fn read_range(
        &self,
        digest: &Digest,
        start: u64,
        end: u64,
    ) -> Result<BlobReader, BlobError> {
        let mut f = match tokio::fs::File::open(self.final_path(digest)).await {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(BlobError::NotFound(digest.to_string()))
            }
            Err(e) => return Err(e.into()),
        };
        f.seek(io::SeekFrom::Start(start)).await?;
        Ok(Box::pin(f.take(end.saturating_sub(start))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    async fn read_all(s: &FsBlobStore, d: &Digest, a: u64, b: u64) -> Vec<u8> {
        let mut out = Vec::new();
        s.read_range(d, a, b)
            .await
            .unwrap()
            .read_to_end(&mut out)
            .await
            .unwrap();
        out
    }

    #[test]
    fn digests_are_checked() {
        let good = format!("sha256:{}", "A".repeat(64));
        assert_eq!(
            Digest::parse(&good).unwrap().as_str(),
            format!("sha256:{}", "a".repeat(64))
        );
        for bad in [
            "",
            "sha256:",
            "md5:abc",
            &format!("sha256:{}", "a".repeat(63)),
            &format!("sha256:../../{}", "a".repeat(58)),
            &format!("sha256:{}g", "a".repeat(63)),
        ] {
            assert!(Digest::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            Digest::of(b"").as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[tokio::test]
    async fn chunks_resume_and_commit_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let s = FsBlobStore::open(dir.path(), 1 << 20).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let d = Digest::of(&data);
        let size = data.len() as u64;
        assert_eq!(s.partial_len(&d).await.unwrap(), 0);
        assert_eq!(
            s.append(&d, size, 0, &data[..40_000]).await.unwrap(),
            40_000
        );
        // A resend of an acknowledged chunk, or a gap, is refused with
        // where the upload stands.
        match s.append(&d, size, 0, &data[..10]).await {
            Err(BlobError::OffsetMismatch { current, .. }) => assert_eq!(current, 40_000),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            s.append(&d, size, 50_000, &data[50_000..]).await,
            Err(BlobError::OffsetMismatch { .. })
        ));
        // Not visible before the commit, and a commit of a part is refused.
        assert_eq!(s.stat(&d).await.unwrap(), None);
        assert!(matches!(
            s.commit(&d, size).await,
            Err(BlobError::Incomplete { have: 40_000, .. })
        ));
        // Resumed from the kept length (as after a reconnect).
        let at = s.partial_len(&d).await.unwrap();
        assert_eq!(
            s.append(&d, size, at, &data[at as usize..]).await.unwrap(),
            size
        );
        // Past the declared size: refused.
        assert!(matches!(
            s.append(&d, size, size, b"x").await,
            Err(BlobError::TooLarge { .. })
        ));
        s.commit(&d, size).await.unwrap();
        assert_eq!(s.stat(&d).await.unwrap(), Some(size));
        assert_eq!(s.partial_len(&d).await.unwrap(), 0);
        assert_eq!(read_all(&s, &d, 0, size).await, data);
        assert_eq!(read_all(&s, &d, 10, 20).await, &data[10..20]);
        // Committing again is idempotent; so is a put of the same bytes.
        s.commit(&d, size).await.unwrap();
        assert_eq!(s.put(&data).await.unwrap(), d);
    }

    #[tokio::test]
    async fn wrong_bytes_never_become_the_blob() {
        let dir = tempfile::tempdir().unwrap();
        let s = FsBlobStore::open(dir.path(), 1 << 20).unwrap();
        let d = Digest::of(b"hello");
        s.append(&d, 5, 0, b"HELLO").await.unwrap();
        assert!(matches!(
            s.commit(&d, 5).await,
            Err(BlobError::DigestMismatch { .. })
        ));
        assert_eq!(s.stat(&d).await.unwrap(), None);
        assert_eq!(
            s.partial_len(&d).await.unwrap(),
            0,
            "the bad partial is gone"
        );
        s.append(&d, 5, 0, b"hello").await.unwrap();
        s.commit(&d, 5).await.unwrap();
        assert_eq!(read_all(&s, &d, 0, 5).await, b"hello");
    }

    #[tokio::test]
    async fn sizes_are_bounded_before_writing() {
        let dir = tempfile::tempdir().unwrap();
        let s = FsBlobStore::open(dir.path(), 10).unwrap();
        let d = Digest::of(b"x");
        assert!(matches!(
            s.append(&d, 11, 0, b"x").await,
            Err(BlobError::TooLarge { size: 11, max: 10 })
        ));
        assert!(matches!(
            s.put(&[0u8; 11]).await,
            Err(BlobError::TooLarge { .. })
        ));
        assert_eq!(s.partial_len(&d).await.unwrap(), 0);
        assert!(matches!(
            s.read_range(&d, 0, 1).await,
            Err(BlobError::NotFound(_))
        ));
    }

    /// A full disk, for real: the partial file is a link to `/dev/full`,
    /// whose every write fails with `ENOSPC`. The store answers `DiskFull`
    /// and removes the partial.
    #[tokio::test]
    async fn a_full_disk_is_a_clear_error_and_leaves_no_partial() {
        if !Path::new("/dev/full").exists() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let s = FsBlobStore::open(dir.path(), 1 << 20).unwrap();
        let d = Digest::of(b"abc");
        let partial = dir.path().join("partial").join(d.hex());
        std::os::unix::fs::symlink("/dev/full", &partial).unwrap();
        // /dev/full reports length 0, so offset 0 is where it "stands".
        match s.append(&d, 3, 0, b"abc").await {
            Err(e @ BlobError::DiskFull) => assert!(e.to_string().contains("disk is full")),
            other => panic!("{other:?}"),
        }
        assert!(
            partial.symlink_metadata().is_err(),
            "the partial is removed"
        );
        assert_eq!(s.stat(&d).await.unwrap(), None);
    }

    #[tokio::test]
    async fn leftover_temp_files_are_cleaned_and_partials_kept() {
        let dir = tempfile::tempdir().unwrap();
        let s = FsBlobStore::open(dir.path(), 100).unwrap();
        let d = Digest::of(b"abcd");
        s.append(&d, 4, 0, b"ab").await.unwrap();
        std::fs::write(dir.path().join("tmp").join("junk"), b"half").unwrap();
        drop(s);
        let s = FsBlobStore::open(dir.path(), 100).unwrap();
        assert!(std::fs::read_dir(dir.path().join("tmp"))
            .unwrap()
            .next()
            .is_none());
        assert_eq!(s.partial_len(&d).await.unwrap(), 2);
        s.append(&d, 4, 2, b"cd").await.unwrap();
        s.commit(&d, 4).await.unwrap();
    }
}

//! Disk limits of one tool call.
//!
//! A tool call is untrusted code with the workspace's disk at its feet:
//! `yes > f` fills a host in seconds, and a full disk takes the executor's
//! journal, the spill files and every other session down with it. Linux
//! has no per-directory byte quota that works without a prepared file
//! system (XFS project quotas, a loop device per session), so a call gets
//! two bounds that need nothing from the host:
//!
//! * **A size limit per file** (`RLIMIT_FSIZE`) on every process the call
//!   starts: a write past it fails (`SIGXFSZ`, then `EFBIG`), so no single
//!   file the call writes grows past [`DiskLimits::max_file_bytes`].
//! * **A free-space reserve** on the workspace's file system: a call does
//!   not start when less than [`DiskLimits::reserve_bytes`] is free, and a
//!   running `bash` call is killed (with its whole tree) as soon as a check,
//!   every [`CHECK_EVERY`], finds the reserve reached; `write` and `edit`
//!   refuse content that would eat into it. Many files that are each under
//!   the size limit still stop at the reserve.
//!
//! The reserve is shared by everything on that file system: a call is
//! stopped even when another writer used the space. That is the intended
//! trade: the host stays usable, and the result says which rule stopped it.

use std::io;
use std::path::Path;
use std::time::Duration;

use super::{reason, ToolOutput};

/// How often a running `bash` call checks the free space: at 2 GB/s of
/// writes a call overshoots the reserve by at most about 500 MB, which
/// the default reserve absorbs.
pub const CHECK_EVERY: Duration = Duration::from_millis(250);

/// Default [`DiskLimits::max_file_bytes`]: 4 GiB, above what builds and
/// package installs write into one file, far below a disk.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 4 << 30;

/// Default [`DiskLimits::reserve_bytes`]: 512 MiB left free.
pub const DEFAULT_RESERVE_BYTES: u64 = 512 << 20;

/// The disk bounds of a tool call (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskLimits {
    /// Largest file a process of the call may write; `None`: no limit.
    pub max_file_bytes: Option<u64>,
    /// Free bytes the call never takes from the workspace's file system;
    /// 0 turns the reserve off.
    pub reserve_bytes: u64,
}

impl Default for DiskLimits {
    fn default() -> Self {
        Self {
            max_file_bytes: Some(DEFAULT_MAX_FILE_BYTES),
            reserve_bytes: DEFAULT_RESERVE_BYTES,
        }
    }
}

impl DiskLimits {
    /// No limits at all (embedders that bound the disk themselves).
    pub const NONE: Self = Self {
        max_file_bytes: None,
        reserve_bytes: 0,
    };

    /// `Err` with a `disk_full` result when writing `bytes` more under
    /// `path` would leave less than the reserve free. An unreadable file
    /// system (statvfs failing) does not block the call: the write itself
    /// will report the real error.
    pub fn check_room(&self, path: &Path, bytes: u64) -> Result<(), ToolOutput> {
        if self.reserve_bytes == 0 {
            return Ok(());
        }
        match free_bytes(path) {
            Ok(free) if free < self.reserve_bytes.saturating_add(bytes) => Err(self.full(free)),
            _ => Ok(()),
        }
    }

    /// Whether the reserve is reached now (a running call's check).
    pub fn reserve_reached(&self, path: &Path) -> Option<u64> {
        if self.reserve_bytes == 0 {
            return None;
        }
        free_bytes(path)
            .ok()
            .filter(|free| *free < self.reserve_bytes)
    }

    /// The `disk_full` result for `free` bytes left.
    pub fn full(&self, free: u64) -> ToolOutput {
        ToolOutput::failure(reason::DISK_FULL, self.full_text(free))
    }

    /// The text of a `disk_full` result.
    pub fn full_text(&self, free: u64) -> String {
        format!(
            "the workspace's file system has {free} bytes free, under the executor's reserve of {} bytes (--disk-reserve)",
            self.reserve_bytes
        )
    }
}

/// Bytes an unprivileged process may still write on the file system of
/// `path` (`f_bavail`, not `f_bfree`: root's reserved blocks are not ours).
pub fn free_bytes(path: &Path) -> io::Result<u64> {
    let stat = nix::sys::statvfs::statvfs(path).map_err(io::Error::from)?;
    #[allow(clippy::useless_conversion)] // u32 or u64 by target
    let (avail, frsize) = (u64::from(stat.blocks_available()), stat.fragment_size());
    #[allow(clippy::useless_conversion)]
    Ok(avail.saturating_mul(u64::from(frsize)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_bytes_reads_the_file_system() {
        let dir = tempfile::tempdir().unwrap();
        assert!(free_bytes(dir.path()).unwrap() > 0);
        assert!(free_bytes(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn the_reserve_refuses_what_would_eat_into_it() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        let limits = DiskLimits {
            max_file_bytes: None,
            reserve_bytes: free.saturating_add(1 << 30),
        };
        let refused = limits.check_room(dir.path(), 0).unwrap_err();
        assert_eq!(refused.reason.as_deref(), Some(reason::DISK_FULL));
        assert!(limits.reserve_reached(dir.path()).is_some());
        assert!(DiskLimits::NONE.check_room(dir.path(), u64::MAX).is_ok());
        assert!(DiskLimits::NONE.reserve_reached(dir.path()).is_none());
        let roomy = DiskLimits {
            max_file_bytes: None,
            reserve_bytes: 1,
        };
        assert!(roomy.check_room(dir.path(), 0).is_ok());
        assert!(roomy.check_room(dir.path(), u64::MAX).is_err());
    }

    #[test]
    fn a_child_cannot_write_past_the_file_limit() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("big");
        let of = format!("of={}", file.display());
        let mut command = crate::process::spawn::Command::new(
            Path::new("/bin/dd"),
            &["dd", "if=/dev/zero", "bs=4096", "count=64", &of],
        )
        .unwrap();
        command.rlimit(libc::RLIMIT_FSIZE, 16 * 1024);
        let child = command.spawn().unwrap();
        let status = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(child.exit.wait())
            .unwrap();
        assert!(!status.success());
        assert_eq!(std::fs::metadata(&file).unwrap().len(), 16 * 1024);
    }
}

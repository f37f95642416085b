//! Backing memory for large output rings: one anonymous mapping of the
//! ring's full capacity, reserved but not committed.
//!
//! Why not a `Vec` grown by doubling, as small rings use: a ring of many
//! megabytes fills with fresh pages, and first-touching fresh anonymous
//! memory is the single largest cost of ingesting output fast. Measured on
//! the 2-core VM this project is built on (1 GiB, `memset` in 64 KiB
//! steps): 4 KiB pages fault in at 0.4–1.9 GB/s, transparent huge pages at
//! ≈ 8 GB/s, and memory already touched is written at ≈ 25 GB/s. A doubling
//! `Vec` also zero-fills every new half before `read(2)` overwrites it. A
//! mapping with `MAP_NORESERVE` costs nothing until a page is written,
//! never moves (no realloc), is zero-initialised by the kernel (so handing
//! it out as `&mut [u8]` is sound), and `MADV_HUGEPAGE` asks for 2 MiB
//! pages where the kernel allows them (`transparent_hugepage` = `madvise`
//! or `always`). The price: a huge page commits 2 MiB at a time, which is
//! why only rings of at least [`MAPPED_MIN`] bytes use a mapping.
//!
//! # Recycling
//!
//! Even huge pages fault in slowly when the memory is new to the machine:
//! on this VM (which runs DAMON pageout), first touch of memory new to the
//! process ran at ≈ 0.4–0.5 GB/s. So a dropped region is not unmapped at
//! once: it waits, resident, in a small process-wide pool bounded by
//! [`POOL_MAX_BYTES`], [`POOL_MAX_REGIONS`] and [`POOL_IDLE`], and a new
//! ring of the same size takes it back without a fault. (`MADV_FREE` on
//! pooled regions was tried: their pages were gone again by the next run.)
//! Old bytes left in a reused region are never visible: a ring only reads
//! what it wrote.

use std::ptr::NonNull;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Rings at least this large are backed by a [`Region`].
pub const MAPPED_MIN: usize = 4 << 20;

/// At most this many bytes of dropped regions wait for reuse.
pub const POOL_MAX_BYTES: usize = 2 << 30;

/// At most this many dropped regions wait for reuse.
pub const POOL_MAX_REGIONS: usize = 8;

/// A dropped mapping waiting for reuse.
struct Idle {
    addr: usize,
    len: usize,
    since: Instant,
}

/// A pooled region not reused for this long is unmapped at the next drop.
pub const POOL_IDLE: Duration = Duration::from_secs(30);

static POOL: Mutex<Vec<Idle>> = Mutex::new(Vec::new());

/// A fixed-size, lazily committed anonymous mapping, zero-initialised
/// when new (a recycled one holds old bytes: initialised, never exposed by
/// the ring).
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `Region` owns its mapping exclusively, like a `Box<[u8]>`.
unsafe impl Send for Region {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for Region {}

impl Region {
    /// Maps `len` (> 0) bytes; `None` if the kernel refuses (the caller
    /// falls back to the heap).
    pub fn new(len: usize) -> Option<Region> {
        if len == 0 {
            return None;
        }
        if let Some(r) = Self::recycled(len) {
            return Some(r);
        }
        // SAFETY: a fresh private anonymous mapping aliases nothing.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        // A refusal (THP disabled) leaves ordinary pages: ignore it.
        // SAFETY: the range is the mapping just created.
        unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
        Some(Region {
            ptr: NonNull::new(ptr.cast())?,
            len,
        })
    }

    /// A pooled region of exactly `len` bytes, if one waits.
    fn recycled(len: usize) -> Option<Region> {
        let mut pool = POOL.lock().ok()?;
        let i = pool.iter().position(|idle| idle.len == len)?;
        let idle = pool.swap_remove(i);
        Some(Region {
            ptr: NonNull::new(idle.addr as *mut u8)?,
            len: idle.len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable, initialised bytes (zero-
        // filled by the kernel, or old bytes of a recycled mapping), and
        // lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let ptr = self.ptr.as_ptr();
        if let Ok(mut pool) = POOL.lock() {
            let now = Instant::now();
            // Lazy expiry: whatever waited too long is unmapped now.
            pool.retain(|idle| {
                let keep = now.duration_since(idle.since) < POOL_IDLE;
                if !keep {
                    // SAFETY: a pooled mapping is owned by the pool alone.
                    unsafe { libc::munmap(idle.addr as *mut libc::c_void, idle.len) };
                }
                keep
            });
            let held: usize = pool.iter().map(|idle| idle.len).sum();
            if pool.len() < POOL_MAX_REGIONS && held + self.len <= POOL_MAX_BYTES {
                pool.push(Idle {
                    addr: ptr as usize,
                    len: self.len,
                    since: now,
                });
                return;
            }
        }
        // SAFETY: unmapping exactly the mapping this value owns.
        unsafe { libc::munmap(ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_regions_are_zero_filled_and_writable() {
        // A size no other test uses: a recycled region holds old bytes.
        let len = MAPPED_MIN + 4096 * 7;
        let mut r = Region::new(len).expect("mmap");
        assert_eq!(r.len(), len);
        assert!(r.as_slice().iter().all(|&b| b == 0));
        r.as_mut_slice()[len - 1] = 7;
        assert_eq!(r.as_slice()[len - 1], 7);
        assert!(Region::new(0).is_none());
    }

    #[test]
    fn dropped_regions_are_reused_and_the_pool_is_bounded() {
        // A size no other test uses, so parallel tests do not interfere.
        let len = MAPPED_MIN + 4096 * 13;
        let first = Region::new(len).unwrap();
        let addr = first.as_slice().as_ptr();
        drop(first);
        let again = Region::new(len).unwrap();
        assert_eq!(again.as_slice().as_ptr(), addr, "the same mapping back");
        assert_eq!(again.len(), len);
        // More regions than the pool keeps: the extra ones are unmapped.
        let many: Vec<Region> = (0..POOL_MAX_REGIONS + 3)
            .map(|_| Region::new(len).unwrap())
            .collect();
        drop(many);
        drop(again);
        let pool = POOL.lock().unwrap();
        assert!(pool.len() <= POOL_MAX_REGIONS);
        assert!(pool.iter().map(|i| i.len).sum::<usize>() <= POOL_MAX_BYTES);
    }
}

//! The binary's global allocator: mimalloc for small blocks, the system's
//! (glibc) for large ones. The library leaves the choice to whoever embeds
//! it.
//!
//! Why both (docs/benchmarks.md, "The allocator"):
//! - A request through the harness to an executor allocates and frees many
//!   small blocks (headers, JSON values, frames, futures) across two
//!   threads. With glibc alone, its allocator's functions were a sixth of
//!   the runtime workers' CPU in `bmx bench mcp`; with mimalloc for them,
//!   mimalloc's were about a fourteenth.
//! - Output moves in large blocks (a `process.read` of up to 1 MiB, its
//!   frame). With mimalloc for those too, end-to-end output throughput
//!   fell by a third, the kernel zeroing fresh huge pages under pipe reads;
//!   with them on glibc it came back.

use std::alloc::{GlobalAlloc, Layout, System};

/// Blocks of at least this many bytes come from the system allocator.
pub const LARGE: usize = 64 << 10;

/// mimalloc below [`LARGE`], [`System`] from it up. Which allocator owns a
/// block follows from its layout's size alone, which `dealloc` and
/// `realloc` are given, so no block needs a tag.
pub struct Split;

fn is_large(size: usize) -> bool {
    size >= LARGE
}

// SAFETY: every method forwards to the allocator that owns the block by
// its size; a `realloc` that crosses `LARGE` allocates on the other side,
// copies the smaller of the two sizes and frees the old block with the
// layout it was allocated with, as `GlobalAlloc::realloc`'s default does.
unsafe impl GlobalAlloc for Split {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if is_large(layout.size()) {
            unsafe { System.alloc(layout) }
        } else {
            unsafe { mimalloc::MiMalloc.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if is_large(layout.size()) {
            unsafe { System.alloc_zeroed(layout) }
        } else {
            unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if is_large(layout.size()) {
            unsafe { System.dealloc(ptr, layout) }
        } else {
            unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        match (is_large(layout.size()), is_large(new_size)) {
            (true, true) => unsafe { System.realloc(ptr, layout, new_size) },
            (false, false) => unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) },
            _ => {
                // SAFETY: the caller guarantees `new_size`, rounded up to
                // `layout.align()`, does not overflow `isize`.
                let new_layout =
                    unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
                let new = unsafe { self.alloc(new_layout) };
                if !new.is_null() {
                    unsafe {
                        std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                }
                new
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks grown and shrunk across the threshold keep their bytes, and
    /// each is freed by the allocator that made it (a block freed by the
    /// other allocator would most likely crash the test process).
    #[test]
    fn realloc_across_the_threshold_keeps_the_bytes() {
        let mut v: Vec<u8> = (0..=255u8).cycle().take(LARGE - 1).collect();
        v.reserve_exact(LARGE * 3);
        assert!(v.iter().zip((0..=255u8).cycle()).all(|(a, b)| *a == b));
        v.truncate(100);
        v.shrink_to_fit();
        assert!(v.iter().zip((0..=255u8).cycle()).all(|(a, b)| *a == b));
        let big = vec![7u8; LARGE * 2];
        drop(big);
        let zeroed = vec![0u8; LARGE + 1];
        assert!(zeroed.iter().all(|b| *b == 0));
    }
}

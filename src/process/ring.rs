//! Sans-IO byte ring that holds the newest output of one process stream.
//!
//! Protocol rule: each stream (stdout / stderr) keeps its newest `capacity`
//! bytes. Positions are *cursors*: absolute byte offsets since the stream
//! started, so a client can resume where it stopped and learn exactly how
//! much it missed when the writer lapped it. The writer never blocks: when
//! the ring is full the oldest bytes are overwritten and [`OutputRing::earliest`]
//! moves forward.
//!
//! # Memory
//!
//! The buffer is allocated **lazily**: a new ring owns 0 bytes and grows
//! geometrically (doubling, at least [`MIN_GROWTH`] bytes) as data arrives,
//! never beyond `capacity`. Most processes print little, so with thousands of
//! sessions x processes x 2 streams the resident cost tracks what was actually
//! written, not `capacity` x streams. While the buffer is smaller than
//! `capacity` nothing has been dropped yet, so the bytes sit linearly at the
//! front of the buffer and growing is a plain `Vec` resize; wrapping only
//! starts once the buffer has reached `capacity`.
//!
//! Rings of at least [`MAPPED_MIN`] bytes skip the doubling: at their first
//! byte they reserve their whole capacity as one lazily committed mapping
//! (see [`super::region`] for why and the figures).
//!
//! # Panics
//!
//! None of the methods panic on any input; clamps are documented per method.

use super::region::{Region, MAPPED_MIN};
use std::fmt;

/// Default per-stream capacity required by the protocol (1 MiB).
pub const DEFAULT_CAPACITY: usize = 1 << 20;

/// Smallest step by which the lazily allocated buffer grows, so a stream that
/// prints a line at a time does not reallocate on every line.
pub const MIN_GROWTH: usize = 4096;

/// Ring buffer of the newest `capacity` bytes of an output stream, addressed
/// by absolute cursors.
#[derive(Clone)]
pub struct OutputRing {
    /// Physical storage. Its length is the allocated size, which grows lazily
    /// up to `cap`. Invariant: if `buf.len() < cap` then `head == 0` and the
    /// data is `buf[..len]` (nothing was dropped, so nothing wraps).
    buf: Storage,
    /// Logical capacity, >= 1.
    cap: usize,
    /// Physical index of the byte at cursor `earliest()`.
    head: usize,
    /// Bytes held; always `min(end, cap)`.
    len: usize,
    /// Total bytes ever written (the next cursor).
    end: u64,
    /// Length of the slot handed out by the last `write_slot`, 0 if none is
    /// pending. Bounds what `commit` may accept.
    slot_len: usize,
}

/// Outcome of [`OutputRing::read_into`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadSpan {
    /// Cursor of the first byte appended (`earliest()` when `gap`).
    pub from: u64,
    /// Cursor to pass to the next read (`from` + bytes appended).
    pub next: u64,
    /// The requested cursor had already been overwritten; bytes between it
    /// and `from` are lost to this reader.
    pub gap: bool,
    /// More bytes were available after `next` than `max` allowed.
    pub truncated: bool,
}

/// A cursor the ring cannot serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CursorError {
    /// The cursor points past the last byte written; a client can only have
    /// made it up (cursors are handed out by the ring), so it is an error
    /// rather than an empty read.
    BeyondEnd { cursor: u64, end: u64 },
}

impl fmt::Display for CursorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CursorError::BeyondEnd { cursor, end } => {
                write!(f, "cursor {cursor} is beyond the end of the stream ({end})")
            }
        }
    }
}

impl std::error::Error for CursorError {}

/// Where a ring's bytes live: a `Vec` grown by doubling (small rings), or a
/// mapping of the full capacity committed page by page as it is written.
enum Storage {
    Heap(Vec<u8>),
    Mapped(Region),
}

impl Storage {
    /// Nothing yet: even a mapped ring takes its mapping only when its
    /// first byte arrives. A stream that never prints (most stderrs) then
    /// never holds a mapping, and never takes a recycled one from the pool
    /// that a busy stream could have reused warm.
    fn new() -> Storage {
        Storage::Heap(Vec::new())
    }

    fn len(&self) -> usize {
        match self {
            Storage::Heap(v) => v.len(),
            Storage::Mapped(r) => r.len(),
        }
    }

    /// Grows to at least `size` bytes of a ring of capacity `cap`: a heap
    /// buffer to exactly `size`; an empty buffer of a ring of at least
    /// [`MAPPED_MIN`] becomes a mapping of the whole capacity (the heap is
    /// the fallback if the kernel refuses); a mapping already spans it.
    fn grow_to(&mut self, size: usize, cap: usize) {
        if let Storage::Heap(v) = self {
            if v.is_empty() && cap >= MAPPED_MIN {
                if let Some(r) = Region::new(cap) {
                    *self = Storage::Mapped(r);
                    return;
                }
            }
            if size > v.len() {
                // Exact reservation: `Vec`'s own amortized growth could
                // allocate up to twice `capacity`.
                v.reserve_exact(size - v.len());
                v.resize(size, 0);
            }
        }
    }
}

impl std::ops::Deref for Storage {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Storage::Heap(v) => v,
            Storage::Mapped(r) => r.as_slice(),
        }
    }
}

impl std::ops::DerefMut for Storage {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::Heap(v) => v,
            Storage::Mapped(r) => r.as_mut_slice(),
        }
    }
}

impl Clone for Storage {
    fn clone(&self) -> Storage {
        match self {
            Storage::Heap(v) => Storage::Heap(v.clone()),
            Storage::Mapped(r) => match Region::new(r.len()) {
                Some(mut copy) => {
                    copy.as_mut_slice().copy_from_slice(r.as_slice());
                    Storage::Mapped(copy)
                }
                None => Storage::Heap(r.as_slice().to_vec()),
            },
        }
    }
}

impl Default for OutputRing {
    /// A ring of [`DEFAULT_CAPACITY`] bytes.
    fn default() -> Self {
        Self::new(DEFAULT_CAPACITY)
    }
}

impl fmt::Debug for OutputRing {
    // Hand-written so that logging a ring never dumps a megabyte of output.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutputRing")
            .field("capacity", &self.cap)
            .field("allocated", &self.buf.len())
            .field("earliest", &self.earliest())
            .field("end", &self.end)
            .finish()
    }
}

impl OutputRing {
    /// Creates an empty ring keeping the newest `capacity` bytes.
    ///
    /// `capacity` 0 is clamped to 1 (a ring must hold at least one byte for
    /// the cursor arithmetic to mean anything). Nothing is allocated yet.
    pub fn new(capacity: usize) -> Self {
        let cap = capacity.max(1);
        Self {
            buf: Storage::new(),
            cap,
            head: 0,
            len: 0,
            end: 0,
            slot_len: 0,
        }
    }

    /// Maximum number of bytes retained.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Bytes of buffer currently allocated (grows lazily up to `capacity`);
    /// useful for memory accounting. A mapped ring (capacity at least
    /// [`MAPPED_MIN`], once written to) reports its whole reservation: the
    /// kernel commits its pages only as they are written.
    pub fn allocated(&self) -> usize {
        self.buf.len()
    }

    /// Oldest cursor still held.
    pub fn earliest(&self) -> u64 {
        self.end - self.len as u64
    }

    /// Total bytes ever written, i.e. the cursor the next byte will get.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// How many bytes can be written without dropping any byte at or after
    /// cursor `keep`: what a lossless stream (`outputPolicy: "lossless"`)
    /// may take from its pipe while the bytes from `keep` on are unread.
    /// A `keep` at or past the end frees the whole capacity; a `keep`
    /// already dropped (older than `capacity` bytes before the end) frees
    /// nothing.
    pub fn room_keeping(&self, keep: u64) -> usize {
        let unread = self.end.saturating_sub(keep);
        usize::try_from(unread)
            .map(|u| self.cap.saturating_sub(u))
            .unwrap_or(0)
    }

    /// Bytes currently held (`min(end, capacity)`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing has been written yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends a copy of `data`, dropping the oldest bytes if needed.
    ///
    /// If `data` is longer than the capacity only its last `capacity` bytes
    /// are kept, but `end` still advances by `data.len()` so cursors stay
    /// true stream offsets. Cancels a pending `write_slot`.
    pub fn write(&mut self, data: &[u8]) {
        self.slot_len = 0;
        let n = data.len();
        if n == 0 {
            return;
        }
        self.end = self.end.saturating_add(n as u64);
        if n >= self.cap {
            // Everything held so far is overwritten: lay the tail out
            // linearly from index 0.
            self.grow_to(self.cap);
            self.buf.copy_from_slice(&data[n - self.cap..]);
            self.head = 0;
            self.len = self.cap;
            return;
        }
        self.reserve_for(n);
        let phys = self.buf.len();
        let w = (self.head + self.len) % phys;
        let first = n.min(phys - w);
        self.buf[w..w + first].copy_from_slice(&data[..first]);
        self.buf[..n - first].copy_from_slice(&data[first..]);
        self.advance(n);
    }

    /// Zero-copy ingest: returns a contiguous writable slice at the write
    /// position, so a reader can `read(2)` from a pipe straight into the
    /// ring; follow it with [`commit`](Self::commit).
    ///
    /// The slice holds at most `max` bytes and is non-empty unless `max` is
    /// 0. It stops at the physical end of the buffer, so after a wrap it may
    /// be shorter than `max`: the caller loops. The buffer is grown here if it
    /// has not reached `capacity` yet.
    ///
    /// When the ring is full the slice overlaps the oldest bytes, which stay
    /// readable until `commit` drops them. Only the first `n` bytes passed to
    /// `commit` may be written (as `read(2)` does); writing past them would
    /// alter still-retained old output.
    pub fn write_slot(&mut self, max: usize) -> &mut [u8] {
        self.slot_len = 0;
        if max == 0 {
            return &mut [];
        }
        self.reserve_for(max);
        let phys = self.buf.len();
        let w = (self.head + self.len) % phys;
        let n = max.min(phys - w);
        self.slot_len = n;
        &mut self.buf[w..w + n]
    }

    /// Publishes the first `n` bytes of the slot from the last
    /// [`write_slot`](Self::write_slot).
    ///
    /// `n` is clamped to that slot's length; without a pending slot (none
    /// requested, or a `write`/`commit` came in between) this does nothing.
    pub fn commit(&mut self, n: usize) {
        let n = n.min(self.slot_len);
        self.slot_len = 0;
        if n == 0 {
            return;
        }
        self.end = self.end.saturating_add(n as u64);
        self.advance(n);
    }

    /// Reads from absolute `cursor`, at most `max` bytes, appending to `out`.
    ///
    /// A cursor older than [`earliest`](Self::earliest) reads from
    /// `earliest` and reports `gap`. A cursor equal to [`end`](Self::end)
    /// gives an empty span; a cursor past it is
    /// [`CursorError::BeyondEnd`]. `out` is only appended to.
    pub fn read_into(
        &self,
        cursor: u64,
        max: usize,
        out: &mut Vec<u8>,
    ) -> Result<ReadSpan, CursorError> {
        let (span, first, second) = self.slices(cursor, max)?;
        out.reserve(first.len() + second.len());
        out.extend_from_slice(first);
        out.extend_from_slice(second);
        Ok(span)
    }

    /// The bytes [`read_into`](Self::read_into) would append, in place: two
    /// slices because the span may wrap around the physical end (the second
    /// is empty when it does not). Lets a reader encode an answer straight
    /// from the ring without copying the bytes first.
    pub fn slices(&self, cursor: u64, max: usize) -> Result<(ReadSpan, &[u8], &[u8]), CursorError> {
        if cursor > self.end {
            return Err(CursorError::BeyondEnd {
                cursor,
                end: self.end,
            });
        }
        let earliest = self.earliest();
        let gap = cursor < earliest;
        let from = cursor.max(earliest);
        // Both fit in usize: they are bounded by `len`.
        let avail = (self.end - from) as usize;
        let take = avail.min(max);
        let (first, second): (&[u8], &[u8]) = if take > 0 {
            let phys = self.buf.len();
            let p = (self.head + (from - earliest) as usize) % phys;
            let first = take.min(phys - p);
            (&self.buf[p..p + first], &self.buf[..take - first])
        } else {
            (&[], &[])
        };
        let span = ReadSpan {
            from,
            next: from + take as u64,
            gap,
            truncated: avail > take,
        };
        Ok((span, first, second))
    }

    /// Makes sure the next `n` (> 0) bytes have room: while the buffer is
    /// still linear and smaller than capacity, grow it to hold them (or to
    /// capacity, after which the ring wraps and overwrites).
    fn reserve_for(&mut self, n: usize) {
        let phys = self.buf.len();
        if phys < self.cap && self.len + n > phys {
            let needed = (self.len + n).min(self.cap);
            let doubled = phys.saturating_mul(2).max(MIN_GROWTH);
            self.grow_to(needed.max(doubled).min(self.cap));
        }
    }

    /// Grows the buffer to exactly `size` bytes (no-op if already there).
    /// Only called while `head == 0`, so the data stays in place.
    fn grow_to(&mut self, size: usize) {
        self.buf.grow_to(size, self.cap);
    }

    /// Accounts for `n` bytes just stored after the current data, dropping
    /// the oldest ones past capacity.
    fn advance(&mut self, n: usize) {
        self.len += n;
        if self.len > self.cap {
            // Only reachable once the buffer is `cap` long (see reserve_for).
            self.head = (self.head + (self.len - self.cap)) % self.cap;
            self.len = self.cap;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn read_all(r: &OutputRing, cursor: u64) -> (ReadSpan, Vec<u8>) {
        let mut out = Vec::new();
        let span = r.read_into(cursor, usize::MAX, &mut out).unwrap();
        (span, out)
    }

    #[test]
    fn empty_ring() {
        let r = OutputRing::new(8);
        assert!(r.is_empty());
        assert_eq!((r.earliest(), r.end(), r.len()), (0, 0, 0));
        assert_eq!(r.allocated(), 0, "allocation must be lazy");
        let (span, out) = read_all(&r, 0);
        assert_eq!(
            span,
            ReadSpan {
                from: 0,
                next: 0,
                gap: false,
                truncated: false
            }
        );
        assert!(out.is_empty());
    }

    #[test]
    fn zero_capacity_is_clamped() {
        let mut r = OutputRing::new(0);
        assert_eq!(r.capacity(), 1);
        r.write(b"abc");
        assert_eq!(read_all(&r, 0).1, b"c");
        assert_eq!(r.earliest(), 2);
    }

    #[test]
    fn read_at_end_is_empty_not_error() {
        let mut r = OutputRing::new(8);
        r.write(b"hello");
        let (span, out) = read_all(&r, 5);
        assert_eq!(
            (span.from, span.next, span.gap, span.truncated),
            (5, 5, false, false)
        );
        assert!(out.is_empty());
    }

    #[test]
    fn beyond_end_is_error() {
        let mut r = OutputRing::new(8);
        r.write(b"hello");
        let mut out = vec![1];
        let err = r.read_into(6, 10, &mut out).unwrap_err();
        assert_eq!(err, CursorError::BeyondEnd { cursor: 6, end: 5 });
        assert_eq!(out, [1], "out untouched on error");
        assert_eq!(
            err.to_string(),
            "cursor 6 is beyond the end of the stream (5)"
        );
    }

    #[test]
    fn wrap_keeps_newest() {
        let mut r = OutputRing::new(8);
        r.write(b"abcdef");
        r.write(b"ghij");
        assert_eq!((r.earliest(), r.end(), r.len()), (2, 10, 8));
        let (span, out) = read_all(&r, 2);
        assert_eq!(out, b"cdefghij");
        assert_eq!((span.from, span.next, span.gap), (2, 10, false));
        // Read straddling the physical wrap point.
        let mut out = Vec::new();
        let span = r.read_into(5, 4, &mut out).unwrap();
        assert_eq!(out, b"fghi");
        assert_eq!((span.next, span.truncated), (9, true));
    }

    #[test]
    fn oversized_write_keeps_tail_and_advances_end() {
        let mut r = OutputRing::new(4);
        r.write(b"xy");
        r.write(b"0123456789");
        assert_eq!((r.earliest(), r.end(), r.len()), (8, 12, 4));
        assert_eq!(read_all(&r, 8).1, b"6789");
        assert_eq!(r.allocated(), 4);
    }

    #[test]
    fn gap_reads_from_earliest() {
        let mut r = OutputRing::new(4);
        r.write(b"0123456789");
        let (span, out) = read_all(&r, 1);
        assert_eq!(
            span,
            ReadSpan {
                from: 6,
                next: 10,
                gap: true,
                truncated: false
            }
        );
        assert_eq!(out, b"6789");
    }

    #[test]
    fn truncated_when_max_smaller() {
        let mut r = OutputRing::new(16);
        r.write(b"0123456789");
        let mut out = b"pre:".to_vec();
        let span = r.read_into(2, 3, &mut out).unwrap();
        assert_eq!(out, b"pre:234", "appends, does not clear");
        assert_eq!((span.from, span.next, span.truncated), (2, 5, true));
        let span = r.read_into(7, 3, &mut out).unwrap();
        assert_eq!((span.next, span.truncated), (10, false));
        // max == 0 with data pending: empty but truncated.
        let span = r.read_into(0, 0, &mut out).unwrap();
        assert_eq!((span.from, span.next, span.truncated), (0, 0, true));
    }

    #[test]
    fn slot_commit_wraps_in_contiguous_pieces() {
        let mut r = OutputRing::new(8);
        r.write(b"abcdef");
        let s = r.write_slot(5);
        assert_eq!(s.len(), 2, "only up to the physical end");
        s.copy_from_slice(b"gh");
        r.commit(2);
        let s = r.write_slot(5);
        assert_eq!(s.len(), 5);
        s[..3].copy_from_slice(b"ijk");
        r.commit(3);
        assert_eq!((r.earliest(), r.end()), (3, 11));
        assert_eq!(read_all(&r, 0).1, b"defghijk");
    }

    #[test]
    fn commit_is_clamped_and_needs_a_slot() {
        let mut r = OutputRing::new(8);
        r.commit(5);
        assert_eq!(r.end(), 0, "commit without slot is a no-op");
        let s = r.write_slot(3);
        s.copy_from_slice(b"abc");
        r.commit(100);
        assert_eq!(r.end(), 3, "commit clamped to slot length");
        r.commit(1);
        assert_eq!(r.end(), 3, "slot consumed by first commit");
        let _ = r.write_slot(3);
        r.write(b"z");
        r.commit(3);
        assert_eq!(r.end(), 4, "write cancels the pending slot");
        assert!(r.write_slot(0).is_empty());
        r.commit(1);
        assert_eq!(r.end(), 4);
    }

    #[test]
    fn partial_commit_on_full_ring_keeps_old_bytes() {
        let mut r = OutputRing::new(4);
        r.write(b"abcd");
        let s = r.write_slot(4);
        assert_eq!(s.len(), 4);
        s[0] = b'e';
        r.commit(1);
        assert_eq!(read_all(&r, 0).1, b"bcde");
    }

    #[test]
    fn a_mapped_ring_wraps_like_a_heap_ring() {
        let cap = MAPPED_MIN + 3;
        let mut mapped = OutputRing::new(cap);
        assert_eq!(mapped.allocated(), 0, "mapped at the first byte only");
        mapped.write(b"");
        assert_eq!(mapped.allocated(), 0);
        let _ = mapped.write_slot(1);
        assert!(matches!(mapped.buf, Storage::Mapped(_)));
        mapped.commit(0);
        // A non-empty heap buffer stays on the heap whatever the capacity.
        let mut heap = OutputRing {
            buf: Storage::Heap(vec![0]),
            ..OutputRing::new(1)
        };
        heap.cap = cap;
        let mut n = 0u64;
        // Slot-sized ingest across two wraps, with a pattern that shows
        // any misplaced byte.
        while n < 2 * cap as u64 + 12_345 {
            for r in [&mut mapped, &mut heap] {
                let slot = r.write_slot(65_536);
                let len = slot.len().min(40_000);
                for (i, b) in slot[..len].iter_mut().enumerate() {
                    *b = ((n + i as u64) % 251) as u8;
                }
                r.commit(len);
            }
            n = mapped.end();
            assert_eq!(n, heap.end());
        }
        assert_eq!(mapped.earliest(), heap.earliest());
        let (a, b) = (read_all(&mapped, 0), read_all(&heap, 0));
        assert_eq!(a, b);
        assert!(a
            .1
            .iter()
            .enumerate()
            .all(|(i, &b)| { b == ((mapped.earliest() + i as u64) % 251) as u8 }));
        let copy = mapped.clone();
        assert_eq!(read_all(&copy, 0), a);
    }

    #[test]
    fn growth_is_lazy_geometric_and_bounded() {
        let mut r = OutputRing::new(100_000);
        r.write(b"x");
        assert_eq!(r.allocated(), MIN_GROWTH);
        r.write(&[1; MIN_GROWTH]);
        assert_eq!(r.allocated(), 2 * MIN_GROWTH);
        r.write(&[2; 200_000]);
        assert_eq!(r.allocated(), 100_000);
        let Storage::Heap(v) = &r.buf else {
            panic!("a small ring lives on the heap")
        };
        assert!(v.capacity() <= 100_000, "no over-allocation past capacity");
        let s = r.write_slot(1 << 30);
        assert!(s.len() <= 100_000);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Write(Vec<u8>),
        /// Request a slot of `max`, fill the bytes to commit, commit `commit` (may exceed the slot).
        Slot {
            max: usize,
            commit: usize,
        },
        /// Read at `end - back` (saturating at 0), or past `end` when `over`.
        Read {
            back: u64,
            over: bool,
            max: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..40).prop_map(Op::Write),
            (0usize..40, 0usize..45).prop_map(|(max, commit)| Op::Slot { max, commit }),
            (0u64..80, prop::bool::weighted(0.1), 0usize..50)
                .prop_map(|(back, over, max)| Op::Read { back, over, max }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn matches_model(cap in 0usize..33, ops in prop::collection::vec(op(), 0..60)) {
            let mut r = OutputRing::new(cap);
            let cap = cap.max(1);
            let mut model: Vec<u8> = Vec::new();
            let mut counter = 0u8;
            for op in ops {
                match op {
                    Op::Write(d) => {
                        r.write(&d);
                        model.extend_from_slice(&d);
                    }
                    Op::Slot { max, commit } => {
                        let s = r.write_slot(max);
                        prop_assert!(s.len() <= max);
                        prop_assert_eq!(s.is_empty(), max == 0);
                        let n = commit.min(s.len());
                        // Like read(2): write only the bytes that get committed.
                        for b in &mut s[..n] {
                            counter = counter.wrapping_add(1);
                            *b = counter;
                        }
                        let written = s[..n].to_vec();
                        r.commit(commit);
                        model.extend_from_slice(&written);
                    }
                    Op::Read { back, over, max } => {
                        let end = model.len() as u64;
                        let cursor = if over { end + 1 + back } else { end.saturating_sub(back) };
                        let mut out = vec![0xAA];
                        let res = r.read_into(cursor, max, &mut out);
                        if cursor > end {
                            prop_assert_eq!(res, Err(CursorError::BeyondEnd { cursor, end }));
                            prop_assert_eq!(out, vec![0xAA]);
                        } else {
                            let span = res.unwrap();
                            let earliest = end.saturating_sub(cap as u64);
                            prop_assert_eq!(span.gap, cursor < earliest);
                            prop_assert_eq!(span.from, cursor.max(earliest));
                            let want = (end - span.from).min(max as u64);
                            prop_assert_eq!(span.next, span.from + want);
                            prop_assert_eq!(span.truncated, span.next < end);
                            prop_assert_eq!(&out[1..], &model[span.from as usize..span.next as usize]);
                        }
                    }
                }
                let end = model.len() as u64;
                prop_assert_eq!(r.end(), end);
                prop_assert_eq!(r.earliest(), end.saturating_sub(cap as u64));
                prop_assert_eq!(r.len(), model.len().min(cap));
                prop_assert!(r.allocated() <= cap);
                // Full content check after every step.
                let (_, all) = read_all(&r, r.earliest());
                prop_assert_eq!(&all[..], &model[r.earliest() as usize..]);
            }
        }

        /// The lossless discipline: a writer that never takes more than
        /// `room_keeping(read)` and a reader at `read` see every byte, in
        /// order, never a gap, whatever the capacity, chunk sizes and
        /// interleaving.
        #[test]
        fn writing_only_the_room_keeping_the_reader_loses_nothing(
            cap in 1usize..40,
            steps in prop::collection::vec((any::<bool>(), 0usize..50), 0..120),
        ) {
            let mut r = OutputRing::new(cap);
            let (mut written, mut seen) = (Vec::<u8>::new(), Vec::<u8>::new());
            let mut read = 0u64;
            let mut counter = 0u8;
            for (write, n) in steps {
                if write {
                    let room = r.room_keeping(read);
                    prop_assert!(room <= cap);
                    let s = r.write_slot(n.min(room));
                    let k = s.len();
                    for b in s.iter_mut() {
                        counter = counter.wrapping_add(1);
                        *b = counter;
                        written.push(counter);
                    }
                    r.commit(k);
                } else {
                    let span = r.read_into(read, n, &mut seen).unwrap();
                    prop_assert!(!span.gap);
                    read = span.next;
                }
                prop_assert!(r.end() - read <= cap as u64);
            }
            let span = r.read_into(read, usize::MAX, &mut seen).unwrap();
            prop_assert!(!span.gap);
            prop_assert_eq!(seen, written);
        }

        #[test]
        fn room_keeping_is_what_is_left_of_the_capacity(cap in 1usize..40, n in 0usize..100, keep in 0u64..120) {
            let mut r = OutputRing::new(cap);
            r.write(&vec![7; n]);
            let unread = (n as u64).saturating_sub(keep);
            prop_assert_eq!(r.room_keeping(keep) as u64, (cap as u64).saturating_sub(unread));
        }
    }
}

//! Throughput of the output ring's hot paths against a plain memcpy of the
//! same size, so results can be read as a ratio to the machine's copy speed.

use std::hint::black_box;

use bmx::process::ring::OutputRing;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const CHUNK: usize = 64 * 1024;
const RING: usize = 1 << 20;

/// Deterministic non-zero bytes, so nothing can be elided as a memset.
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 31 + 7) as u8).collect()
}

fn bench_ring(c: &mut Criterion) {
    let src = pattern(CHUNK);

    let mut g = c.benchmark_group("ring");
    g.throughput(Throughput::Bytes(CHUNK as u64));

    g.bench_function("write_64k", |b| {
        let mut r = OutputRing::new(RING);
        // Start from a fully grown ring and a position that wraps.
        r.write(&pattern(RING + 12345));
        b.iter(|| r.write(black_box(&src)));
        black_box(r.end());
    });

    g.bench_function("slot_commit_64k", |b| {
        let mut r = OutputRing::new(RING);
        r.write(&pattern(RING + 12345));
        b.iter(|| {
            let src = black_box(&src[..]);
            let mut off = 0;
            while off < src.len() {
                let slot = r.write_slot(src.len() - off);
                let n = slot.len();
                slot.copy_from_slice(&src[off..off + n]);
                r.commit(n);
                off += n;
            }
        });
        black_box(r.end());
    });

    g.throughput(Throughput::Bytes(RING as u64));
    g.bench_function("read_1m_at_cursor", |b| {
        let mut r = OutputRing::new(RING);
        // Full ring whose oldest byte sits mid-buffer: the read wraps.
        r.write(&pattern(RING + RING / 3));
        let cursor = r.earliest();
        let mut out = Vec::with_capacity(RING);
        b.iter(|| {
            out.clear();
            let span = r.read_into(black_box(cursor), RING, &mut out).unwrap();
            black_box((&out, span));
        });
    });
    g.finish();

    let mut g = c.benchmark_group("baseline");
    g.throughput(Throughput::Bytes(CHUNK as u64));
    g.bench_function("memcpy_64k", |b| {
        let mut dst = vec![0u8; CHUNK];
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        });
    });
    g.finish();
}

criterion_group!(benches, bench_ring);
criterion_main!(benches);

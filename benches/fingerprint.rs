//! The cost of deciding that an unchanged workspace need not be backed up:
//! the `lstat` walk plus the fingerprint hash of `workspace.backup`, on a
//! tree of 10 000 small files (set `BMX_BENCH_FILES` for more, e.g. the
//! issue's 100 000, and `BMX_BENCH_FILE_BYTES` for their size: 10 737 makes
//! the 1 GiB). The baseline in the same run is the least any such
//! check must do: a plain recursive `read_dir` + `lstat` of every entry
//! (`baseline_lstat_walk`), with no hashing and no bookkeeping.

use bmx::executor::backup::{fingerprint, walk};
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

fn bench_fingerprint(c: &mut Criterion) {
    let n: usize = std::env::var("BMX_BENCH_FILES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let bytes: usize = std::env::var("BMX_BENCH_FILE_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let content = vec![b'x'; bytes];
    let dir = tempfile::tempdir().unwrap();
    for i in 0..n {
        let sub = dir.path().join(format!("d{:03}", i % 100));
        if i < 100 {
            std::fs::create_dir_all(&sub).unwrap();
        }
        std::fs::write(sub.join(format!("f{i}")), &content).unwrap();
    }
    let mut g = c.benchmark_group("backup");
    g.sample_size(10);
    g.bench_function(format!("unchanged_tree_{n}_files"), |b| {
        b.iter(|| {
            let nodes = walk(dir.path(), &[], &[]).unwrap();
            black_box(fingerprint(&nodes))
        })
    });
    g.bench_function(format!("baseline_lstat_walk_{n}_files"), |b| {
        b.iter(|| black_box(lstat_walk(dir.path())))
    });
    g.finish();
}

/// Entries under `dir`, each `lstat`ed once, recursing into directories.
fn lstat_walk(dir: &std::path::Path) -> u64 {
    let mut count = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            count += m.len() & 1;
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    count
}

criterion_group!(benches, bench_fingerprint);
criterion_main!(benches);

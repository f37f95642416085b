//! The cost of deciding that an unchanged workspace need not be backed up:
//! the `lstat` walk plus the fingerprint hash of `workspace.backup`, on a
//! tree of 10 000 small files (set `BMX_BENCH_FILES` for more, e.g. the
//! issue's 100 000). Figures are not recorded yet: this machine is shared.

use bmx::executor::backup::{fingerprint, walk};
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

fn bench_fingerprint(c: &mut Criterion) {
    let n: usize = std::env::var("BMX_BENCH_FILES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let dir = tempfile::tempdir().unwrap();
    for i in 0..n {
        let sub = dir.path().join(format!("d{:03}", i % 100));
        if i < 100 {
            std::fs::create_dir_all(&sub).unwrap();
        }
        std::fs::write(sub.join(format!("f{i}")), b"x").unwrap();
    }
    let mut g = c.benchmark_group("backup");
    g.sample_size(10);
    g.bench_function(format!("unchanged_tree_{n}_files"), |b| {
        b.iter(|| {
            let nodes = walk(dir.path(), &[], &[]).unwrap();
            black_box(fingerprint(&nodes))
        })
    });
    g.finish();
}

criterion_group!(benches, bench_fingerprint);
criterion_main!(benches);

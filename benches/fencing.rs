//! The cost of a fencing-token bump (issue 17): the durable store
//! (`DurableState` over SQLite, tokens drawn from a block reserved in the
//! database ahead of use) against the in-memory counter, in the same run.
//!
//! `cargo bench --bench fencing`. The database lives in a temporary
//! directory under `$TMPDIR` (or `BMX_BENCH_DIR`). A bump the durable store
//! refuses (its block ran out before the next reservation committed) is
//! retried inside the iteration, so its cost is counted.

use bmx::harness::store::{DurableState, SqliteStore};
use bmx::lease::{LeaseStore, MemoryLeaseStore};
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

fn bench_fencing(c: &mut Criterion) {
    let dir = match std::env::var_os("BMX_BENCH_DIR") {
        Some(d) => tempfile::tempdir_in(d).unwrap(),
        None => tempfile::tempdir().unwrap(),
    };
    let ids: Vec<String> = (0..1000).map(|i| format!("s-{i}")).collect();
    let mut g = c.benchmark_group("fencing_bump");
    g.measurement_time(Duration::from_secs(5));

    let memory = MemoryLeaseStore::new();
    let mut i = 0usize;
    g.bench_function("memory", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            black_box(memory.next_fencing_token(&ids[i % ids.len()]))
        })
    });

    let db = SqliteStore::open_dir(dir.path()).unwrap();
    let durable = DurableState::open(Arc::new(db)).unwrap();
    let mut i = 0usize;
    g.bench_function("durable_sqlite", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            loop {
                if let Some(t) = durable.next_fencing_token(&ids[i % ids.len()]) {
                    break black_box(t);
                }
                std::thread::yield_now();
            }
        })
    });
    g.finish();
    durable.shutdown();
}

criterion_group!(benches, bench_fencing);
criterion_main!(benches);

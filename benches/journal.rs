//! The cost of journaling a tool result (issue 19): what the executor pays
//! per `tool.result` to have it survive `kill -9` (a row written and
//! fsynced, then removed when acknowledged), against the in-memory outbox
//! alone (push, send, acknowledge) in the same run.
//!
//! `cargo bench --bench journal`. The journal file lives in a temporary
//! directory under `$TMPDIR` (or `BMX_BENCH_DIR`): put it on the disk the
//! executor's work root would use, since fsync is the whole cost.

use bmx::executor::journal::Journal;
use bmx::supervisor::Backoff;
use bmx::wire::outbox::Outbox;
use bmx::wire::types::ToolResultParams;
use bmx::wire::Method;
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use std::time::Duration;

fn result(text_bytes: usize) -> ToolResultParams {
    serde_json::from_value(serde_json::json!({
        "sessionId": "s-bench",
        "toolCallId": "call-000000",
        "outcome": "succeeded",
        "isError": false,
        "content": [{"type": "text", "text": "x".repeat(text_bytes)}],
        "artifacts": [],
        "durationMs": 12,
    }))
    .unwrap()
}

fn bench_journal(c: &mut Criterion) {
    let dir = match std::env::var_os("BMX_BENCH_DIR") {
        Some(d) => tempfile::tempdir_in(d).unwrap(),
        None => tempfile::tempdir().unwrap(),
    };
    let journal = Journal::open(&dir.path().join("journal.db"), "bench").unwrap();
    let mut g = c.benchmark_group("journal");
    g.measurement_time(Duration::from_secs(8));
    for (name, size) in [("256B", 256), ("16KiB", 16 << 10)] {
        let r = result(size);
        g.bench_function(format!("outbox_push_ack_{name}"), |b| {
            let mut o: Outbox<String, ToolResultParams> = Outbox::new(Backoff::default(), 1024);
            o.connected(Duration::ZERO);
            let mut n = 0u64;
            b.iter(|| {
                n += 1;
                let key = format!("call-{n}");
                o.push(key.clone(), r.clone(), Duration::ZERO).unwrap();
                black_box(o.poll_send(Duration::ZERO));
                black_box(o.acked(&key));
            });
        });
        g.bench_function(format!("journal_put_fsync_remove_{name}"), |b| {
            let mut n = 0u64;
            b.iter(|| {
                n += 1;
                let key = format!("call-{n}");
                journal
                    .put(Method::ToolResult, "s-bench", &key, black_box(&r))
                    .unwrap();
                journal.remove(Method::ToolResult, "s-bench", &key).unwrap();
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench_journal);
criterion_main!(benches);

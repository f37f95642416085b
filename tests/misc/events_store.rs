//! The stored session events (docs/store.md, "Session events"),
//! property-tested over SQLite and PostgreSQL against a plain map.
//!
//! Random operations in the order a session's stream actor makes them:
//! puts of each session's next sequence, trims below a sequence it has,
//! clears (the id granted anew), deletes (the session forgotten), flushes
//! and restarts (a shutdown and a reopen). Between flushes the writes
//! pile up in one batch, which the writer commits in its own order
//! (deletes and clears, then inserts, then floors): after every flush and
//! every reopen, each session's stored events must be exactly the model's.
//!
//! The PostgreSQL run gets a fresh database (`pg_support::fresh`); without
//! `BMX_TEST_PG` it skips loudly (fails under CI).

use super::pg_support;
use bmx::harness::store::{DurableState, PgStore, SqliteStore, StoredEvent};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::Config;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const SESSIONS: [&str; 3] = ["e0", "e1", "e2"];

#[derive(Debug, Clone)]
enum Op {
    Put { s: usize },
    Trim { s: usize, back: u64 },
    Clear { s: usize },
    Delete { s: usize },
    Flush,
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    let s = 0..SESSIONS.len();
    prop_oneof![
        8 => s.clone().prop_map(|s| Op::Put { s }),
        3 => (s.clone(), 0..6u64).prop_map(|(s, back)| Op::Trim { s, back }),
        1 => s.clone().prop_map(|s| Op::Clear { s }),
        1 => s.prop_map(|s| Op::Delete { s }),
        2 => Just(Op::Flush),
        1 => Just(Op::Restart),
    ]
}

/// Wait until everything queued on `d` is committed.
fn flush(d: &DurableState) {
    let (tx, rx) = std::sync::mpsc::channel();
    d.after_commit(Box::new(move || {
        let _ = tx.send(());
    }));
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the store committed within a minute");
}

fn check(
    d: &DurableState,
    model: &BTreeMap<&str, BTreeMap<u64, String>>,
) -> Result<(), TestCaseError> {
    for sid in SESSIONS {
        let stored: Vec<(u64, String)> = d
            .events(sid)
            .expect("events load")
            .into_iter()
            .map(|e| (e.sequence, e.json.to_string()))
            .collect();
        let want: Vec<(u64, String)> = model
            .get(sid)
            .map(|m| m.iter().map(|(k, v)| (*k, v.clone())).collect())
            .unwrap_or_default();
        prop_assert_eq!(stored, want, "session {}", sid);
    }
    Ok(())
}

fn run(ops: Vec<Op>, open: &dyn Fn() -> DurableState) -> Result<(), TestCaseError> {
    let mut d = open();
    let mut model: BTreeMap<&str, BTreeMap<u64, String>> = BTreeMap::new();
    // Each session's next sequence (1 after a clear or a delete).
    let mut next = [1u64; SESSIONS.len()];
    for (i, op) in ops.into_iter().enumerate() {
        match op {
            Op::Put { s } => {
                let sid = SESSIONS[s];
                let json = format!("{{\"op\":{i}}}");
                model.entry(sid).or_default().insert(next[s], json.clone());
                d.put_event(
                    StoredEvent {
                        session_id: sid.into(),
                        fencing_token: 1,
                        sequence: next[s],
                        json: Arc::from(json),
                    },
                    Box::new(|| {}),
                );
                next[s] += 1;
            }
            Op::Trim { s, back } => {
                // The actor's floor is at most its newest sequence.
                let floor = (next[s] - 1).saturating_sub(back);
                if let Some(m) = model.get_mut(SESSIONS[s]) {
                    m.retain(|k, _| *k >= floor);
                }
                d.trim_events(SESSIONS[s], floor);
            }
            Op::Clear { s } => {
                model.remove(SESSIONS[s]);
                next[s] = 1;
                d.clear_events(SESSIONS[s]);
            }
            Op::Delete { s } => {
                model.remove(SESSIONS[s]);
                next[s] = 1;
                d.delete_session(SESSIONS[s]);
            }
            Op::Flush => {
                flush(&d);
                check(&d, &model)?;
            }
            Op::Restart => {
                d.shutdown();
                d = open();
                check(&d, &model)?;
            }
        }
    }
    flush(&d);
    check(&d, &model)?;
    d.shutdown();
    Ok(())
}

proptest! {
    #![proptest_config(Config { cases: 64, ..Config::default() })]

    #[test]
    fn sqlite_events_match_the_model(ops in vec(op(), 1..60)) {
        let dir = tempfile::tempdir().unwrap();
        run(ops, &|| {
            let db = SqliteStore::open_dir(dir.path()).expect("open the store");
            DurableState::open(Arc::new(db)).expect("open the durable state")
        })?;
    }
}

proptest! {
    #![proptest_config(Config { cases: 16, ..Config::default() })]

    #[test]
    fn pg_events_match_the_model(ops in vec(op(), 1..60)) {
        let Some(db) = pg_support::fresh("events") else { return Ok(()) };
        run(ops, &|| {
            let store = PgStore::connect(&db.url).expect("connect the postgres store");
            DurableState::open(Arc::new(store)).expect("open the durable state")
        })?;
    }
}

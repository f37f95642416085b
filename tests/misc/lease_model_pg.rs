//! The lease model and the token races over the PostgreSQL store
//! (issue 17, docs/store.md "PostgreSQL").
//!
//! * The property model of `lease_model_store` with the PostgreSQL store:
//!   a restart is a shutdown and a reopen (a new connection, migrations
//!   checked again, a new fencing block).
//! * Two replicas: two `DurableState`s over one database, each with its
//!   own connection, many threads issuing tokens on both at once. Every
//!   token is distinct across both, each thread's (so each replica's, whose
//!   issuance is serialised) strictly increasing, and a replica reopened
//!   in the middle never issues a token issued before, by it or the other.
//!
//! Each test gets a fresh database (`pg_support::fresh`); without
//! `BMX_TEST_PG` they skip loudly (fail under CI).

use super::lease_model_store::{next, op, run};
use super::pg_support;
use bmx::harness::store::{DurableState, PgStore};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::Config;
use std::collections::BTreeSet;
use std::sync::Arc;

fn open(url: &str) -> DurableState {
    let db = PgStore::connect(url).expect("connect the postgres store");
    DurableState::open(Arc::new(db)).expect("open the durable state")
}

proptest! {
    #![proptest_config(Config { cases: 24, ..Config::default() })]

    #[test]
    fn pg_table_matches_memory_and_never_reuses_tokens(ops in vec(op(), 1..40)) {
        let Some(db) = pg_support::fresh("model") else { return Ok(()) };
        run(ops, &|| open(&db.url))?;
    }
}

/// Issue `n` tokens from `threads` threads on `store`; each thread checks
/// its own tokens rise. Returns them all.
fn issue(store: &DurableState, tag: &str, threads: usize, n: usize) -> Vec<u64> {
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let store = store.clone();
            let session = format!("{tag}-s{i}");
            std::thread::spawn(move || {
                let mut got = Vec::with_capacity(n);
                let mut last = 0;
                while got.len() < n {
                    let t = next(&store, &session);
                    assert!(t > last, "{session}: {t} after {last}");
                    last = t;
                    got.push(t);
                }
                got
            })
        })
        .collect();
    handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect()
}

#[test]
fn two_replicas_over_one_database_never_share_or_reissue_a_token() {
    let Some(db) = pg_support::fresh("replicas") else {
        return;
    };
    let a = open(&db.url);
    let b = open(&db.url);
    // Both replicas at once, four threads each, enough tokens that each
    // reserves several blocks while the other does too.
    let (from_a, from_b) = std::thread::scope(|s| {
        let ha = s.spawn(|| issue(&a, "a", 4, 3_000));
        let hb = s.spawn(|| issue(&b, "b", 4, 3_000));
        (ha.join().unwrap(), hb.join().unwrap())
    });
    let mut all = BTreeSet::new();
    for t in from_a.iter().chain(&from_b) {
        assert!(all.insert(*t), "token {t} issued twice");
    }
    assert_eq!(all.len(), 24_000);
    // A restarted: everything it issues is new to both and above all it
    // issued before, while B keeps issuing.
    let max_a = *from_a.iter().max().unwrap();
    a.shutdown();
    drop(a);
    let a = open(&db.url);
    let (again_a, more_b) = std::thread::scope(|s| {
        let ha = s.spawn(|| issue(&a, "a2", 4, 1_000));
        let hb = s.spawn(|| issue(&b, "b2", 4, 1_000));
        (ha.join().unwrap(), hb.join().unwrap())
    });
    for t in &again_a {
        assert!(*t > max_a, "reopened replica reissued {t} (had {max_a})");
    }
    for t in again_a.iter().chain(&more_b) {
        assert!(all.insert(*t), "token {t} issued twice");
    }
    a.shutdown();
    b.shutdown();
    // A third replica starts above every token ever issued.
    let c = open(&db.url);
    let t = next(&c, "c");
    assert!(t > *all.iter().next_back().unwrap());
    c.shutdown();
}

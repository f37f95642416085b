//! The lease table over the durable store (docs/store.md), property-tested.
//!
//! `tests/lease_model.rs` checks every rule of [`LeaseTable`] against a
//! reference model over the in-memory counter. Here the same table runs
//! over the SQLite-backed [`DurableState`] next to a twin over
//! [`MemoryLeaseStore`], fed the same random sequence of protocol events
//! plus *restarts*: the durable store is shut down and reopened from its
//! file (what a harness killed and started again sees), and both tables
//! are rebuilt empty. The table must decide the same way over either store
//! (only token values differ: the durable counter is global), and every
//! fencing token the durable store issues must be strictly above every
//! token it issued before, for any session, across every reopen.
//!
//! Two more tests: threads racing for tokens on one store, and two stores
//! (two processes) over one database file, never share a token.
//!
//! `run` and `next` take the store to reopen as a closure: `lease_model_pg`
//! runs the same model over the PostgreSQL store.

use bmx::harness::store::{DurableState, SqliteStore};
use bmx::lease::{ConnId, LeaseError, LeaseStore, LeaseTable, MemoryLeaseStore};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::Config;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

const EXECUTORS: [&str; 3] = ["exec-0", "exec-1", "exec-2"];
const SESSIONS: [&str; 4] = ["s0", "s1", "s2", "s3"];
const TTL: u64 = 1_000;

#[derive(Debug, Clone)]
pub(crate) enum Op {
    Register { exec: usize, resume: Vec<usize> },
    Disconnect { exec: usize },
    Assign { session: usize, exec: usize },
    End { session: usize },
    Advance { ms: u64 },
    Tick,
    Restart,
}

pub(crate) fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..EXECUTORS.len(), vec(0..SESSIONS.len(), 0..3))
            .prop_map(|(exec, resume)| Op::Register { exec, resume }),
        1 => (0..EXECUTORS.len()).prop_map(|exec| Op::Disconnect { exec }),
        4 => (0..SESSIONS.len(), 0..EXECUTORS.len())
            .prop_map(|(session, exec)| Op::Assign { session, exec }),
        1 => (0..SESSIONS.len()).prop_map(|session| Op::End { session }),
        1 => (0..2 * TTL).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Tick),
        1 => Just(Op::Restart),
    ]
}

/// The next token, retrying while the next block is being reserved
/// (bounded: a reservation is one small write).
pub(crate) fn next(store: &DurableState, session: &str) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some(t) = store.next_fencing_token(session) {
            return t;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no block was reserved in time"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn open(dir: &Path) -> DurableState {
    let db = SqliteStore::open_dir(dir).expect("open the store");
    DurableState::open(Arc::new(db)).expect("open the durable state")
}

/// What a table decided, with token values left out (they differ by store).
fn shape<T: std::fmt::Debug>(r: &Result<T, LeaseError>) -> Result<(), LeaseError> {
    r.as_ref().map(|_| ()).map_err(Clone::clone)
}

struct Twin {
    durable: LeaseTable,
    memory: LeaseTable,
}

impl Twin {
    fn new(durable: &DurableState, memory: &Arc<MemoryLeaseStore>) -> Twin {
        Twin {
            durable: LeaseTable::new(TTL, Arc::new(durable.clone())),
            memory: LeaseTable::new(TTL, memory.clone()),
        }
    }
}

/// Run `ops` over the store `open` opens (again at every restart).
pub(crate) fn run(ops: Vec<Op>, open: &dyn Fn() -> DurableState) -> Result<(), TestCaseError> {
    let memory = Arc::new(MemoryLeaseStore::new());
    let mut store = open();
    let mut t = Twin::new(&store, &memory);
    let mut now = 0u64;
    let mut next_conn = 1u64;
    let mut live: BTreeMap<usize, ConnId> = BTreeMap::new();
    // Every token the durable store issued, in order.
    let mut issued: Vec<u64> = Vec::new();
    let mut per_session: BTreeMap<&str, u64> = BTreeMap::new();
    for op in ops {
        match op {
            Op::Register { exec, resume } => {
                let conn = ConnId(next_conn);
                next_conn += 1;
                let resume: Vec<String> = resume.iter().map(|&s| SESSIONS[s].into()).collect();
                let a = t.durable.register(EXECUTORS[exec], conn, &resume, now);
                let b = t.memory.register(EXECUTORS[exec], conn, &resume, now);
                prop_assert_eq!(a, b, "register");
                live.insert(exec, conn);
            }
            Op::Disconnect { exec } => {
                if let Some(conn) = live.remove(&exec) {
                    t.durable.disconnect(conn, now);
                    t.memory.disconnect(conn, now);
                }
            }
            Op::Assign { session, exec } => {
                let name = SESSIONS[session];
                let a = t.durable.assign(name, EXECUTORS[exec], now);
                let b = t.memory.assign(name, EXECUTORS[exec], now);
                prop_assert_eq!(shape(&a), shape(&b), "assign");
                if let Ok(g) = a {
                    if let Some(&last) = issued.last() {
                        prop_assert!(
                            g.fencing_token > last,
                            "token {} not above the last issued {}",
                            g.fencing_token,
                            last
                        );
                    }
                    if let Some(&last) = per_session.get(name) {
                        prop_assert!(g.fencing_token > last);
                    }
                    prop_assert_eq!(store.current(name), Some(g.fencing_token));
                    prop_assert_eq!(
                        t.durable.holder(name).map(|h| h.fencing_token),
                        Some(g.fencing_token)
                    );
                    issued.push(g.fencing_token);
                    per_session.insert(name, g.fencing_token);
                }
            }
            Op::End { session } => {
                t.durable.end(SESSIONS[session]);
                t.memory.end(SESSIONS[session]);
            }
            Op::Advance { ms } => now += ms,
            Op::Tick => {
                let a = t.durable.tick(now);
                let b = t.memory.tick(now);
                prop_assert_eq!(&a.silent, &b.silent, "tick silent");
                prop_assert_eq!(&a.expired, &b.expired, "tick expired");
                for c in &a.silent {
                    live.retain(|_, v| v != c);
                }
            }
            Op::Restart => {
                // What a SIGKILL leaves: the file. Nothing of the table.
                store.shutdown();
                drop(t);
                store = open();
                t = Twin::new(&store, &memory);
                live.clear();
            }
        }
        // Same holders over either store (tokens aside).
        for s in SESSIONS {
            let a = t
                .durable
                .holder(s)
                .map(|h| (h.executor_id, h.conn, h.expires_at));
            let b = t
                .memory
                .holder(s)
                .map(|h| (h.executor_id, h.conn, h.expires_at));
            prop_assert_eq!(a, b, "holder({})", s);
        }
    }
    store.shutdown();
    Ok(())
}

proptest! {
    #![proptest_config(Config { cases: 64, ..Config::default() })]

    #[test]
    fn durable_table_matches_memory_and_never_reuses_tokens(ops in vec(op(), 1..40)) {
        let dir = tempfile::tempdir().unwrap();
        run(ops, &|| open(dir.path()))?;
    }
}

#[test]
fn racing_threads_never_share_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let per_thread = 3_000;
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut got = Vec::new();
                let mut last = 0;
                while got.len() < per_thread {
                    let t = next(&store, &format!("s{i}"));
                    assert!(t > last, "per session, tokens rise");
                    last = t;
                    got.push(t);
                }
                got
            })
        })
        .collect();
    let mut all = BTreeSet::new();
    for h in handles {
        for t in h.join().unwrap() {
            assert!(all.insert(t), "token {t} issued twice");
        }
    }
    store.shutdown();
}

#[test]
fn two_processes_over_one_file_never_share_a_token() {
    let dir = tempfile::tempdir().unwrap();
    // Two harnesses opening one data dir hold separate connections and
    // reserve separate blocks; tokens interleave but never collide.
    let a = open(dir.path());
    let b = open(dir.path());
    let mut all = BTreeSet::new();
    for i in 0..10_000 {
        let s = if i % 2 == 0 { &a } else { &b };
        let t = next(s, "shared");
        assert!(all.insert(t), "token {t} issued twice");
    }
    a.shutdown();
    b.shutdown();
    // And a third opening starts above all of them.
    let c = open(dir.path());
    let t = c.next_fencing_token("shared").unwrap();
    assert!(t > *all.iter().next_back().unwrap());
    c.shutdown();
}

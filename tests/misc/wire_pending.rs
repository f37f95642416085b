//! The link's pending-request state (`bmx::wire::pending::Pending`):
//! every request the link accepted is either answered or failed by the
//! close, never left waiting — whatever the interleaving of requests,
//! answers, timeouts and the close (issue 19, "possible lost answer").
//!
//! Two layers: a proptest of the sans-IO state over random interleavings
//! of the operations the link's tasks perform on it (each operation runs
//! under the one lock, so a history is a sequence of them), and a stress
//! run of the same rule with real threads racing a close.

use bmx::wire::pending::Pending;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Barrier, Mutex};

/// What one of the link's tasks does to the state.
#[derive(Debug, Clone)]
enum Op {
    /// `request()` registers request `n` (then sends it).
    Request(u8),
    /// The reader resolves request `n` with its answer.
    Answer(u8),
    /// `request()` gives up on `n` (timeout, or the send failed).
    GiveUp(u8),
    /// The reader ends: the connection is closed.
    Close,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..16).prop_map(Op::Request),
        3 => (0u8..16).prop_map(Op::Answer),
        1 => (0u8..16).prop_map(Op::GiveUp),
        1 => Just(Op::Close),
    ]
}

/// How a request ended, as its caller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// `insert` refused: the caller fails at once with `Closed`.
    Refused,
    Answered,
    GaveUp,
    /// Handed back by `close`: the caller fails with `Closed`.
    FailedByClose,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn every_request_is_answered_or_failed_by_close(ops in prop::collection::vec(op(), 0..64)) {
        let mut pending: Pending<u32, u32> = Pending::new();
        // Request ids are unique per connection: the n-th request of slot k.
        let mut next_id = 0u32;
        let mut live: BTreeMap<u8, u32> = BTreeMap::new();
        let mut ends: BTreeMap<u32, End> = BTreeMap::new();
        let mut closed = false;
        for op in ops.into_iter().chain(std::iter::once(Op::Close)) {
            match op {
                Op::Request(k) => {
                    if live.contains_key(&k) {
                        continue;
                    }
                    let id = next_id;
                    next_id += 1;
                    match pending.insert(id, id) {
                        Ok(()) => {
                            prop_assert!(!closed, "an insert after close was accepted");
                            live.insert(k, id);
                        }
                        Err(refused) => {
                            prop_assert!(closed, "an insert before close was refused");
                            prop_assert_eq!(refused.0, id);
                            ends.insert(id, End::Refused);
                        }
                    }
                }
                Op::Answer(k) | Op::GiveUp(k) => {
                    let Some(id) = live.remove(&k) else { continue };
                    match pending.take(&id) {
                        Some(w) => {
                            prop_assert_eq!(w, id);
                            let end = if matches!(op, Op::Answer(_)) { End::Answered } else { End::GaveUp };
                            prop_assert!(ends.insert(id, end).is_none(), "request {} ended twice", id);
                        }
                        // Already failed by the close: the answer finds nobody.
                        None => prop_assert!(closed),
                    }
                }
                Op::Close => {
                    let failed = pending.close();
                    for w in failed {
                        prop_assert!(ends.insert(w, End::FailedByClose).is_none(), "request {} ended twice", w);
                        live.retain(|_, id| *id != w);
                    }
                    closed = true;
                    prop_assert!(pending.is_empty());
                    prop_assert!(pending.is_closed());
                }
            }
        }
        // After the final close nothing is waiting, and every request
        // that was ever made has exactly one end.
        prop_assert!(pending.is_empty());
        let made: BTreeSet<u32> = (0..next_id).collect();
        let ended: BTreeSet<u32> = ends.keys().copied().collect();
        prop_assert_eq!(made, ended);
    }
}

/// Real threads: requesters insert while one thread closes. Every
/// accepted insert must come back exactly once, by answer or by close.
#[test]
fn threads_racing_a_close_leave_no_request_waiting() {
    for round in 0..200 {
        let pending: Arc<Mutex<Pending<u64, u64>>> = Arc::new(Mutex::new(Pending::new()));
        let threads = 4;
        let per = 64u64;
        let barrier = Arc::new(Barrier::new(threads + 1));
        let mut handles = Vec::new();
        for t in 0..threads as u64 {
            let (p, b) = (pending.clone(), barrier.clone());
            handles.push(std::thread::spawn(move || {
                b.wait();
                let (mut accepted, mut answered, mut refused) = (Vec::new(), Vec::new(), 0u64);
                for i in 0..per {
                    let id = t * 1_000 + i;
                    if p.lock().unwrap().insert(id, id).is_ok() {
                        accepted.push(id);
                        // Every other request is answered by "the reader".
                        if i % 2 == 0 {
                            if let Some(w) = p.lock().unwrap().take(&id) {
                                answered.push(w);
                            }
                        }
                    } else {
                        refused += 1;
                    }
                }
                (accepted, answered, refused)
            }));
        }
        let closer = {
            let (p, b) = (pending.clone(), barrier.clone());
            std::thread::spawn(move || {
                b.wait();
                if round % 2 == 0 {
                    std::thread::yield_now();
                }
                p.lock().unwrap().close()
            })
        };
        let mut failed: Vec<u64> = closer.join().unwrap();
        let mut accepted = Vec::new();
        let mut answered = Vec::new();
        let mut refused = 0;
        for h in handles {
            let (a, b, r) = h.join().unwrap();
            accepted.extend(a);
            answered.extend(b);
            refused += r;
        }
        // Inserted before the close: answered or drained by it; after it:
        // refused. Nothing can remain in the map.
        assert!(
            pending.lock().unwrap().is_empty(),
            "round {round}: a request left waiting"
        );
        failed.extend(answered.iter().copied());
        failed.sort_unstable();
        let mut expected = accepted.clone();
        expected.sort_unstable();
        assert_eq!(
            failed, expected,
            "round {round}: every accepted request ends exactly once"
        );
        assert_eq!(accepted.len() as u64 + refused, threads as u64 * per);
    }
}

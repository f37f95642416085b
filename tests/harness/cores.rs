//! Property tests for the harness's session cores in `src/lease`:
//! [`SessionViews`] (the lifecycle the platform sees), [`ToolResults`]
//! (exactly-once `tool.result` delivery) and [`EventSequencer`]
//! (`session.event` sequencing).
//!
//! Each is driven with random sequences of inputs. A deliberately plain
//! model works out what every call must return, and the protocol
//! invariants are checked after every step: an ended session never moves
//! back; each stop or tool waiter is handed back exactly once whatever the
//! order of result, wait, duplicate, give-up, reconnect and end; a result
//! is published once; retention never exceeds its bound; accepted event
//! sequences rise by one with no hole.
//!
//! Run: `cargo test --profile tests --test harness cores::`; more cases with
//! `PROPTEST_CASES=100000`.

use bmx::lease::{
    Delivery, EventDecision, EventSequencer, Lookup, SessionState, SessionViews, StopStart,
    ToolResults, ViewEffect,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::Config;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

const SESSIONS: [&str; 4] = ["s0", "s1", "s2", "s3"];
const EXECUTORS: [&str; 2] = ["e0", "e1"];

// ---------------------------------------------------------------------------
// Session views
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum ViewOp {
    Create(usize, usize),
    /// Answer for the current grant (`true`) or a stale one.
    Answered(usize, bool, bool),
    Disconnected(Vec<usize>),
    Resumed(Vec<usize>),
    Stop(usize),
    Stopping(usize),
    End(usize),
}

fn view_op() -> impl Strategy<Value = ViewOp> {
    let s = 0..SESSIONS.len();
    prop_oneof![
        3 => (s.clone(), 0..EXECUTORS.len()).prop_map(|(s, e)| ViewOp::Create(s, e)),
        3 => (s.clone(), any::<bool>(), prop::bool::weighted(0.8))
            .prop_map(|(s, cur, ok)| ViewOp::Answered(s, cur, ok)),
        1 => vec(s.clone(), 0..4).prop_map(ViewOp::Disconnected),
        1 => vec(s.clone(), 0..4).prop_map(ViewOp::Resumed),
        2 => s.clone().prop_map(ViewOp::Stop),
        1 => s.clone().prop_map(ViewOp::Stopping),
        2 => s.prop_map(ViewOp::End),
    ]
}

#[derive(Clone, Debug)]
struct MView {
    exec: usize,
    token: u64,
    state: SessionState,
    waiters: Vec<u32>,
}

fn check_views(kept: usize, ops: Vec<ViewOp>) -> Result<(), TestCaseError> {
    let mut v: SessionViews<u32> = SessionViews::new(kept);
    let mut model: BTreeMap<usize, MView> = BTreeMap::new();
    let mut ended_q: VecDeque<usize> = VecDeque::new();
    let mut next_token = 1u64;
    let mut next_waiter = 0u32;
    // Every waiter handed back so far, and the ones dropped by a failed
    // assignment (handed back by being dropped).
    let mut handed: BTreeSet<u32> = BTreeSet::new();
    for op in ops {
        let before: BTreeMap<usize, SessionState> =
            model.iter().map(|(&s, m)| (s, m.state)).collect();
        let mut effects: Vec<ViewEffect<u32>> = Vec::new();
        let mut created = None;
        match op {
            ViewOp::Create(s, e) => {
                let free = model.get(&s).is_none_or(|m| m.state == SessionState::Ended);
                let token = next_token;
                let r = v.create(SESSIONS[s], EXECUTORS[e], token);
                prop_assert_eq!(r.is_ok(), free);
                if free {
                    created = Some(s);
                    next_token += 1;
                    ended_q.retain(|x| *x != s);
                    model.insert(
                        s,
                        MView {
                            exec: e,
                            token,
                            state: SessionState::Assigning,
                            waiters: Vec::new(),
                        },
                    );
                }
            }
            ViewOp::Answered(s, current, ok) => {
                let token = match (model.get(&s), current) {
                    (Some(m), true) => m.token,
                    (Some(m), false) => m.token.saturating_sub(1),
                    (None, _) => next_token,
                };
                effects = v.assign_answered(SESSIONS[s], token, ok);
                let matches = model.get(&s).is_some_and(|m| m.token == token);
                if !matches {
                    prop_assert!(effects.is_empty());
                } else if ok {
                    let m = model.get_mut(&s).unwrap();
                    let mut want = Vec::new();
                    if m.state == SessionState::Assigning {
                        m.state = SessionState::Active;
                        want.push(ViewEffect::State {
                            session_id: SESSIONS[s].into(),
                            state: SessionState::Active,
                        });
                    }
                    want.push(ViewEffect::Assigned {
                        session_id: SESSIONS[s].into(),
                        executor_id: EXECUTORS[m.exec].into(),
                        fencing_token: token,
                    });
                    prop_assert_eq!(&effects, &want);
                } else {
                    let m = model.remove(&s).unwrap();
                    handed.extend(m.waiters);
                    ended_q.retain(|x| *x != s);
                    prop_assert_eq!(
                        &effects,
                        &vec![ViewEffect::Forget {
                            session_id: SESSIONS[s].into()
                        }]
                    );
                }
            }
            ViewOp::Disconnected(list) => {
                let names: Vec<String> = list.iter().map(|&s| SESSIONS[s].to_owned()).collect();
                effects = v.disconnected(&names);
                for s in list {
                    if let Some(m) = model.get_mut(&s) {
                        if matches!(
                            m.state,
                            SessionState::Active | SessionState::Assigning | SessionState::Stopping
                        ) {
                            m.state = SessionState::Disconnected;
                        }
                    }
                }
            }
            ViewOp::Resumed(list) => {
                let names: Vec<String> = list.iter().map(|&s| SESSIONS[s].to_owned()).collect();
                effects = v.resumed(&names);
                for s in list {
                    if let Some(m) = model.get_mut(&s) {
                        if m.state == SessionState::Disconnected {
                            m.state = SessionState::Active;
                        }
                    }
                }
            }
            ViewOp::Stop(s) => {
                let w = next_waiter;
                next_waiter += 1;
                let r = v.stop_requested(SESSIONS[s], w);
                match model.get_mut(&s) {
                    None => {
                        prop_assert_eq!(r, StopStart::Unknown(w));
                        handed.insert(w);
                    }
                    Some(m) if m.state == SessionState::Ended => {
                        prop_assert_eq!(r, StopStart::AlreadyEnded(w));
                        handed.insert(w);
                    }
                    Some(m) => {
                        prop_assert_eq!(r, StopStart::Pending);
                        m.waiters.push(w);
                    }
                }
            }
            ViewOp::Stopping(s) => {
                effects = v.stopping(SESSIONS[s]);
                if let Some(m) = model.get_mut(&s) {
                    if m.state != SessionState::Ended {
                        m.state = SessionState::Stopping;
                    }
                }
            }
            ViewOp::End(s) => {
                effects = v.end(SESSIONS[s], "done", 0);
                let live = model
                    .get(&s)
                    .is_some_and(|m| m.state != SessionState::Ended);
                if live {
                    let m = model.get_mut(&s).unwrap();
                    m.state = SessionState::Ended;
                    let waiters = std::mem::take(&mut m.waiters);
                    prop_assert_eq!(
                        &effects[0],
                        &ViewEffect::Ended {
                            session_id: SESSIONS[s].into(),
                            reason: "done".into(),
                            waiters: waiters.clone(),
                        }
                    );
                    for w in waiters {
                        prop_assert!(handed.insert(w), "waiter {} handed back twice", w);
                    }
                    ended_q.push_back(s);
                    let mut forgotten = Vec::new();
                    while ended_q.len() > kept.max(1) {
                        let old = ended_q.pop_front().unwrap();
                        model.remove(&old);
                        forgotten.push(ViewEffect::Forget {
                            session_id: SESSIONS[old].into(),
                        });
                    }
                    prop_assert_eq!(&effects[1..], &forgotten[..]);
                } else {
                    prop_assert!(effects.is_empty());
                }
            }
        }

        // The published states are the model's.
        for (i, name) in SESSIONS.iter().enumerate() {
            prop_assert_eq!(v.state(name), model.get(&i).map(|m| m.state), "{}", name);
            prop_assert_eq!(
                v.stop_waiters(name),
                model.get(&i).map_or(0, |m| m.waiters.len())
            );
        }
        // An ended session never moves to another state (only a new grant,
        // or being forgotten, ends that life).
        for (s, st) in &before {
            if *st == SessionState::Ended {
                if let Some(now) = model.get(s) {
                    prop_assert!(
                        now.state == SessionState::Ended || created == Some(*s),
                        "{} left ended for {:?}",
                        SESSIONS[*s],
                        now.state
                    );
                }
            }
        }
        // State effects never announce an end; an end carries the reason.
        for e in &effects {
            if let ViewEffect::State { state, .. } = e {
                prop_assert_ne!(*state, SessionState::Ended);
            }
        }
        // Retention: bounded, and the queue is exactly the ended sessions.
        let ended_now: Vec<String> = v.ended().cloned().collect();
        prop_assert!(ended_now.len() <= kept.max(1));
        let ended_set: BTreeSet<&String> = ended_now.iter().collect();
        prop_assert_eq!(ended_set.len(), ended_now.len(), "duplicates in the queue");
        let really_ended: BTreeSet<String> = v
            .iter()
            .filter(|(_, e)| e.state == SessionState::Ended)
            .map(|(s, _)| s.clone())
            .collect();
        prop_assert_eq!(
            ended_set.into_iter().cloned().collect::<BTreeSet<_>>(),
            really_ended
        );
        // Every ended session has its reason, no other has one.
        for (_, e) in v.iter() {
            prop_assert_eq!(e.ended_reason.is_some(), e.state == SessionState::Ended);
        }
    }
    // Every waiter is handed back, or still held by a session not over.
    let held: usize = model.values().map(|m| m.waiters.len()).sum();
    prop_assert_eq!(handed.len() + held, next_waiter as usize);
    Ok(())
}

// ---------------------------------------------------------------------------
// Tool results
// ---------------------------------------------------------------------------

const CALLS: [&str; 4] = ["c0", "c1", "c2", "c3"];

#[derive(Clone, Debug)]
enum ToolOp {
    Wait(usize, usize),
    Result(usize, usize),
    /// The executor reconnects and resends every result it sent.
    Reconnect,
    GiveUp(usize, usize),
    End(usize),
}

fn tool_op() -> impl Strategy<Value = ToolOp> {
    let s = 0..2usize;
    let c = 0..CALLS.len();
    prop_oneof![
        4 => (s.clone(), c.clone()).prop_map(|(s, c)| ToolOp::Wait(s, c)),
        4 => (s.clone(), c.clone()).prop_map(|(s, c)| ToolOp::Result(s, c)),
        1 => Just(ToolOp::Reconnect),
        1 => (s.clone(), c).prop_map(|(s, c)| ToolOp::GiveUp(s, c)),
        1 => s.prop_map(ToolOp::End),
    ]
}

/// How a waiter was handed back.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Outcome {
    Result(u32),
    Forgotten,
    Ended,
    GaveUp,
}

fn check_tools(kept: usize, ops: Vec<ToolOp>) -> Result<(), TestCaseError> {
    let mut t: ToolResults<u32, u32> = ToolResults::new(kept);
    let mut next_waiter = 0u32;
    let mut next_value = 0u32;
    let mut outcomes: BTreeMap<u32, Outcome> = BTreeMap::new();
    // (session, call) -> the first result delivered in the session's life.
    let mut first: BTreeMap<(usize, usize), u32> = BTreeMap::new();
    // Delivered calls of each session, oldest first (for retention).
    let mut order: BTreeMap<usize, VecDeque<usize>> = BTreeMap::new();
    // Waiters not handed back: waiter -> (session, call).
    let mut waiting: BTreeMap<u32, (usize, usize)> = BTreeMap::new();
    // Results sent by the executor and resent on reconnect.
    let mut sent: Vec<(usize, usize, u32)> = Vec::new();
    let mut published: BTreeMap<(usize, usize), usize> = BTreeMap::new();

    let hand = |outcomes: &mut BTreeMap<u32, Outcome>, w: u32, o: Outcome| {
        let again = outcomes.insert(w, o).is_some();
        prop_assert!(!again, "waiter {} handed back twice", w);
        Ok(())
    };

    for op in ops {
        let mut results: Vec<(usize, usize, u32)> = Vec::new();
        match op {
            ToolOp::Wait(s, c) => {
                let w = next_waiter;
                next_waiter += 1;
                let r = t.wait(SESSIONS[s], CALLS[c], w);
                match first.get(&(s, c)) {
                    None => {
                        prop_assert_eq!(r, Ok(()));
                        waiting.insert(w, (s, c));
                    }
                    Some(&v) => {
                        let still_kept = order[&s].iter().rev().take(kept.max(1)).any(|x| *x == c);
                        if still_kept {
                            prop_assert_eq!(r, Err((w, Some(v))));
                            hand(&mut outcomes, w, Outcome::Result(v))?;
                        } else {
                            prop_assert_eq!(r, Err((w, None)));
                            hand(&mut outcomes, w, Outcome::Forgotten)?;
                        }
                    }
                }
            }
            ToolOp::Result(s, c) => {
                let v = next_value;
                next_value += 1;
                sent.push((s, c, v));
                results.push((s, c, v));
            }
            ToolOp::Reconnect => results.extend(sent.iter().copied()),
            ToolOp::GiveUp(s, c) => {
                // The oldest waiter of the call gives up.
                let quitter = waiting
                    .iter()
                    .find(|(_, sc)| **sc == (s, c))
                    .map(|(w, _)| *w);
                let dropped = t.retain_waiters(SESSIONS[s], CALLS[c], |w| Some(*w) != quitter);
                prop_assert_eq!(dropped, quitter.into_iter().collect::<Vec<_>>());
                if let Some(w) = quitter {
                    waiting.remove(&w);
                    hand(&mut outcomes, w, Outcome::GaveUp)?;
                }
            }
            ToolOp::End(s) => {
                let mut back = t.end(SESSIONS[s]);
                back.sort();
                let mut want: Vec<(String, u32)> = waiting
                    .iter()
                    .filter(|(_, sc)| sc.0 == s)
                    .map(|(w, sc)| (CALLS[sc.1].to_owned(), *w))
                    .collect();
                want.sort();
                prop_assert_eq!(&back, &want);
                for (_, w) in back {
                    waiting.remove(&w);
                    hand(&mut outcomes, w, Outcome::Ended)?;
                }
                first.retain(|sc, _| sc.0 != s);
                order.remove(&s);
                published.retain(|sc, _| sc.0 != s);
                // Results the executor still resends belong to the old life.
                sent.retain(|r| r.0 != s);
            }
        }
        for (s, c, v) in results {
            match t.result(SESSIONS[s], CALLS[c], v) {
                Delivery::Duplicate => {
                    prop_assert!(
                        first.contains_key(&(s, c)),
                        "a first result called duplicate"
                    );
                }
                Delivery::Deliver { waiters, result } => {
                    prop_assert!(!first.contains_key(&(s, c)), "delivered twice");
                    prop_assert_eq!(result, v);
                    first.insert((s, c), v);
                    order.entry(s).or_default().push_back(c);
                    *published.entry((s, c)).or_default() += 1;
                    let mut want: Vec<u32> = waiting
                        .iter()
                        .filter(|(_, sc)| **sc == (s, c))
                        .map(|(w, _)| *w)
                        .collect();
                    let mut got = waiters.clone();
                    got.sort();
                    want.sort();
                    prop_assert_eq!(&got, &want);
                    for w in waiters {
                        waiting.remove(&w);
                        hand(&mut outcomes, w, Outcome::Result(v))?;
                    }
                }
            }
        }
        // Invariants after every step.
        for (s, session) in SESSIONS.iter().enumerate().take(2) {
            prop_assert!(t.results_kept(session) <= kept.max(1));
            for (c, call) in CALLS.iter().enumerate() {
                let n = waiting.values().filter(|sc| **sc == (s, c)).count();
                prop_assert_eq!(t.waiting(session, call), n);
                match first.get(&(s, c)) {
                    Some(v) => {
                        let still_kept = order[&s].iter().rev().take(kept.max(1)).any(|x| *x == c);
                        let want = if still_kept {
                            Lookup::Delivered(v)
                        } else {
                            Lookup::Forgotten
                        };
                        prop_assert_eq!(t.lookup(session, call), want);
                        // Nobody waits for a delivered call.
                        prop_assert_eq!(n, 0);
                    }
                    None => prop_assert_eq!(t.lookup(session, call), Lookup::Pending),
                }
            }
        }
        prop_assert!(published.values().all(|n| *n == 1), "published twice");
    }
    // Every waiter was handed back exactly once, or still waits. (That a
    // waiter handed a result got the first result of its call is checked
    // where it is handed back.)
    prop_assert_eq!(outcomes.len() + waiting.len(), next_waiter as usize);
    Ok(())
}

// ---------------------------------------------------------------------------
// Event sequencing
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum EventOp {
    /// An event `offset` away from the next expected one (negative: a resend).
    Send(usize, i64),
    /// A first event, anywhere (also after `Forget`).
    Big(usize, u64),
    Forget(usize),
}

fn event_op() -> impl Strategy<Value = EventOp> {
    let s = 0..2usize;
    prop_oneof![
        8 => (s.clone(), -3i64..3).prop_map(|(s, o)| EventOp::Send(s, o)),
        1 => (s.clone(), prop_oneof![Just(u64::MAX), Just(u64::MAX - 1), any::<u64>()])
            .prop_map(|(s, n)| EventOp::Big(s, n)),
        1 => s.prop_map(EventOp::Forget),
    ]
}

fn check_events(ops: Vec<EventOp>) -> Result<(), TestCaseError> {
    let mut e = EventSequencer::new();
    let mut last: BTreeMap<usize, u64> = BTreeMap::new();
    // Accepted sequences of the current life of each session.
    let mut accepted: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
    for op in ops {
        let (s, seq) = match op {
            EventOp::Forget(s) => {
                e.forget(SESSIONS[s]);
                last.remove(&s);
                accepted.remove(&s);
                continue;
            }
            EventOp::Big(s, n) => (s, n),
            EventOp::Send(s, off) => {
                let next = last.get(&s).map_or(0, |l| l.saturating_add(1)) as i128;
                (s, (next + off as i128).clamp(0, u64::MAX as i128) as u64)
            }
        };
        let d = e.accept(SESSIONS[s], seq);
        let want = match last.get(&s).copied() {
            None => EventDecision::Accept { acked: seq },
            Some(l) if seq <= l => EventDecision::Repeat { acked: l },
            Some(l) if seq == l + 1 => EventDecision::Accept { acked: seq },
            Some(l) => EventDecision::Hole { expected: l + 1 },
        };
        prop_assert_eq!(d, want);
        if let EventDecision::Accept { acked } = d {
            last.insert(s, acked);
            accepted.entry(s).or_default().push(acked);
        }
        prop_assert_eq!(e.last(SESSIONS[s]), last.get(&s).copied());
        prop_assert_eq!(e.len(), last.len());
        // Within a life, accepted sequences rise by exactly one.
        for seqs in accepted.values() {
            for w in seqs.windows(2) {
                prop_assert_eq!(w[1], w[0] + 1, "hole or repeat in {:?}", seqs);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(Config { cases: 512, ..Config::default() })]

    #[test]
    fn session_views_follow_the_model(kept in 1usize..4, ops in vec(view_op(), 1..80)) {
        check_views(kept, ops)?;
    }

    #[test]
    fn tool_results_reach_each_waiter_exactly_once(
        kept in 1usize..4,
        ops in vec(tool_op(), 1..80),
    ) {
        check_tools(kept, ops)?;
    }

    #[test]
    fn event_sequences_rise_by_one(ops in vec(event_op(), 1..120)) {
        check_events(ops)?;
    }
}

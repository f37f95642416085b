//! Model-based property tests for the lease state machines.
//!
//! `LeaseTable` is driven with `proptest-state-machine`: a deliberately
//! plain reference model (every connection ever opened kept in a map with a
//! `live` flag, expiries recomputed from `last_seen` on demand, fencing as a
//! counter per session) generates random sequences of protocol events, works
//! out what each call must return, and the real table replays the same calls.
//! After every step the whole observable state of the table is compared with
//! the model and the protocol invariants are checked directly.
//!
//! The executor side (`SessionFence`, `LeaseClock`) gets the same treatment
//! with plain proptest over sequences of operations and an inline model.
//!
//! Run: `cargo test --profile tests --test misc lease_model::`; more cases with
//! `PROPTEST_CASES=100000` (proptest applies it over the `cases` below).

use bmx::lease::{
    AssignDecision, ConnId, Grant, LeaseClock, LeaseError, LeaseStore, LeaseTable, LeaseView,
    MemoryLeaseStore, Registered, SessionFence, Tick,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::Config;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

const EXECUTORS: [&str; 3] = ["exec-0", "exec-1", "exec-2"];
/// Single-character suffixes, so index order and string order agree.
const SESSIONS: [&str; 5] = ["s0", "s1", "s2", "s3", "s4"];

fn strings(idx: &[usize]) -> Vec<String> {
    idx.iter().map(|&i| SESSIONS[i].to_owned()).collect()
}

// ---------------------------------------------------------------------------
// Reference model
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct MConn {
    exec: usize,
    last_seen: u64,
    live: bool,
}

#[derive(Clone, Debug)]
struct MLease {
    exec: usize,
    conn: u64,
    fencing: u64,
}

/// The concrete call a transition resolved to, with the model's expected
/// result; the system under test replays exactly this call.
#[derive(Clone, Debug)]
enum Step {
    Nothing,
    Register {
        exec: usize,
        conn: u64,
        resume: Vec<usize>,
        expect: Registered,
    },
    Frame {
        conn: u64,
    },
    Disconnect {
        conn: u64,
    },
    Assign {
        session: usize,
        exec: usize,
        expect: Result<Grant, LeaseError>,
    },
    End {
        session: usize,
    },
    Tick {
        expect: Tick,
    },
    CheckFrame {
        conn: u64,
        session: usize,
        expect: Result<(), LeaseError>,
    },
    Restart,
}

#[derive(Clone, Debug)]
struct Model {
    ttl: u64,
    now: u64,
    /// Next connection id the harness will mint.
    next_conn: u64,
    /// Sockets opened but not registered yet; unknown to the table.
    pending: Vec<u64>,
    /// Every connection ever registered, closed ones included.
    conns: BTreeMap<u64, MConn>,
    leases: BTreeMap<usize, MLease>,
    /// Last fencing token issued per session; survives `End` and `Restart`.
    issued: BTreeMap<usize, u64>,
    step: Step,
}

impl Model {
    fn live_conn(&self, exec: usize) -> Option<u64> {
        self.conns
            .iter()
            .find(|(_, c)| c.live && c.exec == exec)
            .map(|(&id, _)| id)
    }

    /// `None` while the lease's connection is live, else when it runs out.
    fn expiry(&self, lease: &MLease) -> Option<u64> {
        let c = &self.conns[&lease.conn];
        if c.live {
            None
        } else {
            Some(c.last_seen.saturating_add(self.ttl))
        }
    }

    fn current(&self, lease: &MLease) -> bool {
        match self.expiry(lease) {
            None => true,
            Some(t) => self.now < t,
        }
    }

    fn check_frame(&self, conn: u64, session: usize) -> Result<(), LeaseError> {
        let Some(lease) = self.leases.get(&session) else {
            return Err(LeaseError::UnknownSession);
        };
        if !self.current(lease) {
            return Err(LeaseError::Expired);
        }
        if lease.conn == conn && self.conns[&conn].live {
            Ok(())
        } else {
            Err(LeaseError::NotHolder)
        }
    }

    fn holder(&self, session: usize) -> Option<LeaseView> {
        self.leases.get(&session).map(|l| LeaseView {
            conn: ConnId(l.conn),
            executor_id: EXECUTORS[l.exec].to_owned(),
            lease_token: format!("lease-{}-{}", SESSIONS[session], l.fencing),
            fencing_token: l.fencing,
            expires_at: self.expiry(l),
        })
    }

    fn sessions_of(&self, conn: u64) -> Vec<String> {
        self.leases
            .iter()
            .filter(|(_, l)| l.conn == conn)
            .map(|(&s, _)| SESSIONS[s].to_owned())
            .collect()
    }

    fn next_deadline(&self) -> Option<u64> {
        let silence = self
            .conns
            .values()
            .filter(|c| c.live)
            .map(|c| c.last_seen.saturating_add(self.ttl));
        let orphans = self.leases.values().filter_map(|l| self.expiry(l));
        silence.chain(orphans).min()
    }

    fn resume_list(&self, exec: usize, keep_mask: u8, extra: &[usize]) -> Vec<usize> {
        let mut resume: Vec<usize> = self
            .leases
            .iter()
            .filter(|&(&s, l)| l.exec == exec && keep_mask & (1 << s) != 0)
            .map(|(&s, _)| s)
            .collect();
        resume.extend(extra);
        resume
    }

    fn register(&mut self, exec: usize, conn: u64, resume: Vec<usize>) {
        let listed: BTreeSet<usize> = resume.iter().copied().collect();
        let old = self.live_conn(exec);
        let mut expect = Registered {
            replaced: old.map(ConnId),
            ..Registered::default()
        };
        let mut kept = BTreeSet::new();
        // Decide with the old connection still live: it held its leases up
        // to this very registration.
        let mine: Vec<usize> = self
            .leases
            .iter()
            .filter(|(_, l)| l.exec == exec)
            .map(|(&s, _)| s)
            .collect();
        for s in mine {
            if listed.contains(&s) && self.current(&self.leases[&s]) {
                if let Some(l) = self.leases.get_mut(&s) {
                    l.conn = conn;
                }
                kept.insert(s);
            } else {
                self.leases.remove(&s);
                expect.ended.push(SESSIONS[s].to_owned());
            }
        }
        expect.kept = kept.iter().map(|&s| SESSIONS[s].to_owned()).collect();
        expect.to_stop = listed
            .difference(&kept)
            .map(|&s| SESSIONS[s].to_owned())
            .collect();
        if let Some(c) = old.and_then(|old| self.conns.get_mut(&old)) {
            c.live = false;
        }
        self.conns.insert(
            conn,
            MConn {
                exec,
                last_seen: self.now,
                live: true,
            },
        );
        self.step = Step::Register {
            exec,
            conn,
            resume,
            expect,
        };
    }

    fn assign(&mut self, session: usize, exec: usize) -> Result<Grant, LeaseError> {
        let conn = self.live_conn(exec).ok_or(LeaseError::NoLiveConnection)?;
        let live_elsewhere = self
            .leases
            .get(&session)
            .filter(|l| l.exec != exec && self.expiry(l).is_none());
        if let Some(l) = live_elsewhere {
            return Err(LeaseError::AlreadyLeased {
                holder: EXECUTORS[l.exec].to_owned(),
            });
        }
        let fencing = self.issued.get(&session).copied().unwrap_or(0) + 1;
        self.issued.insert(session, fencing);
        self.leases.insert(
            session,
            MLease {
                exec,
                conn,
                fencing,
            },
        );
        Ok(Grant {
            session_id: SESSIONS[session].to_owned(),
            holder: ConnId(conn),
            lease_token: format!("lease-{}-{}", SESSIONS[session], fencing),
            fencing_token: fencing,
        })
    }

    fn tick(&mut self) -> Tick {
        let now = self.now;
        let ttl = self.ttl;
        let mut silent = Vec::new();
        for (&id, c) in self.conns.iter_mut() {
            if c.live && now >= c.last_seen.saturating_add(ttl) {
                c.live = false;
                silent.push(ConnId(id));
            }
        }
        let expired: Vec<usize> = self
            .leases
            .iter()
            .filter(|(_, l)| !self.current(l))
            .map(|(&s, _)| s)
            .collect();
        for s in &expired {
            self.leases.remove(s);
        }
        Tick {
            silent,
            expired: strings(&expired),
        }
    }
}

#[derive(Clone, Debug)]
enum Transition {
    /// A socket opens; it is not known to the table until it registers.
    NewConnection,
    /// Register the oldest pending socket (or a fresh one) for `exec`,
    /// resuming the sessions leased to it selected by `keep_mask` (bit per
    /// session), plus `extra` sessions it may or may not hold.
    Register {
        exec: usize,
        keep_mask: u8,
        extra: Vec<usize>,
    },
    /// Like `Register`, but always over a fresh socket: for an executor
    /// with a live connection this is the 4004 replacement path.
    Replace {
        exec: usize,
        keep_mask: u8,
        extra: Vec<usize>,
    },
    Frame {
        conn: u64,
    },
    Silence {
        ms: u64,
    },
    /// Jump to the model's next deadline (or 1 ms before it): boundaries are
    /// where off-by-one bugs live and random silences rarely hit them.
    AdvanceToDeadline {
        just_before: bool,
    },
    Disconnect {
        conn: u64,
    },
    Assign {
        session: usize,
        exec: usize,
    },
    End {
        session: usize,
    },
    Tick,
    CheckFrame {
        conn: u64,
        session: usize,
    },
    /// The harness restarts: a new table over the same fencing store.
    Restart,
}

struct LeaseModel;

impl ReferenceStateMachine for LeaseModel {
    type State = Model;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Model> {
        (1u64..=2_000, 0u64..1_000_000)
            .prop_map(|(ttl, now)| Model {
                ttl,
                now,
                next_conn: 0,
                pending: Vec::new(),
                conns: BTreeMap::new(),
                leases: BTreeMap::new(),
                issued: BTreeMap::new(),
                step: Step::Nothing,
            })
            .boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Transition> {
        // Choices are biased towards where the interesting behaviour is
        // (live connections, executors with orphaned leases, short
        // silences), while any value stays possible.
        fn biased<T: Clone + std::fmt::Debug + 'static>(
            favoured: Vec<T>,
            any: BoxedStrategy<T>,
        ) -> BoxedStrategy<T> {
            if favoured.is_empty() {
                any
            } else {
                prop_oneof![2 => proptest::sample::select(favoured), 1 => any].boxed()
            }
        }
        let live_conns: Vec<u64> = state
            .conns
            .iter()
            .filter(|(_, c)| c.live)
            .map(|(&id, _)| id)
            .collect();
        let live_execs: Vec<usize> = state
            .conns
            .values()
            .filter(|c| c.live)
            .map(|c| c.exec)
            .collect();
        let orphan_execs: Vec<usize> = state
            .leases
            .values()
            .filter(|l| state.expiry(l).is_some())
            .map(|l| l.exec)
            .collect();
        // Any id ever minted, plus one not minted yet.
        let conn = biased(live_conns, (0..=state.next_conn).boxed());
        let any_exec = (0..EXECUTORS.len()).boxed();
        let assign_exec = biased(live_execs, any_exec.clone());
        let register_exec = biased(orphan_execs, any_exec);
        let session = 0..SESSIONS.len();
        // Resume lists: a subset of what the executor holds, plus noise.
        let resume = (register_exec, any::<u8>(), vec(session.clone(), 0..3));
        let ttl = state.ttl;
        prop_oneof![
            4 => Just(Transition::NewConnection),
            12 => resume.clone().prop_map(|(exec, keep_mask, extra)| {
                Transition::Register { exec, keep_mask, extra }
            }),
            6 => resume.prop_map(|(exec, keep_mask, extra)| {
                Transition::Replace { exec, keep_mask, extra }
            }),
            12 => conn.clone().prop_map(|conn| Transition::Frame { conn }),
            6 => (0..=ttl / 2).prop_map(|ms| Transition::Silence { ms }),
            3 => (0..2 * ttl).prop_map(|ms| Transition::Silence { ms }),
            4 => any::<bool>().prop_map(|just_before| Transition::AdvanceToDeadline { just_before }),
            6 => conn.clone().prop_map(|conn| Transition::Disconnect { conn }),
            16 => (session.clone(), assign_exec).prop_map(|(session, exec)| Transition::Assign { session, exec }),
            4 => session.clone().prop_map(|session| Transition::End { session }),
            8 => Just(Transition::Tick),
            8 => (conn, session).prop_map(|(conn, session)| Transition::CheckFrame { conn, session }),
            1 => Just(Transition::Restart),
        ]
        .boxed()
    }

    fn apply(mut state: Model, transition: &Transition) -> Model {
        state.step = Step::Nothing;
        match transition {
            Transition::NewConnection => {
                state.pending.push(state.next_conn);
                state.next_conn += 1;
            }
            Transition::Register {
                exec,
                keep_mask,
                extra,
            } => {
                let conn = if state.pending.is_empty() {
                    state.next_conn += 1;
                    state.next_conn - 1
                } else {
                    state.pending.remove(0)
                };
                let resume = state.resume_list(*exec, *keep_mask, extra);
                state.register(*exec, conn, resume);
            }
            Transition::Replace {
                exec,
                keep_mask,
                extra,
            } => {
                let conn = state.next_conn;
                state.next_conn += 1;
                let resume = state.resume_list(*exec, *keep_mask, extra);
                state.register(*exec, conn, resume);
            }
            Transition::Frame { conn } => {
                let now = state.now;
                if let Some(c) = state.conns.get_mut(conn).filter(|c| c.live) {
                    c.last_seen = c.last_seen.max(now);
                }
                state.step = Step::Frame { conn: *conn };
            }
            Transition::Silence { ms } => state.now += ms,
            Transition::AdvanceToDeadline { just_before } => {
                if let Some(d) = state.next_deadline() {
                    let target = d.saturating_sub(u64::from(*just_before));
                    state.now = state.now.max(target);
                }
            }
            Transition::Disconnect { conn } => {
                state.pending.retain(|p| p != conn);
                if let Some(c) = state.conns.get_mut(conn) {
                    c.live = false;
                }
                state.step = Step::Disconnect { conn: *conn };
            }
            Transition::Assign { session, exec } => {
                let expect = state.assign(*session, *exec);
                state.step = Step::Assign {
                    session: *session,
                    exec: *exec,
                    expect,
                };
            }
            Transition::End { session } => {
                state.leases.remove(session);
                state.step = Step::End { session: *session };
            }
            Transition::Tick => {
                let expect = state.tick();
                state.step = Step::Tick { expect };
            }
            Transition::CheckFrame { conn, session } => {
                let expect = state.check_frame(*conn, *session);
                state.step = Step::CheckFrame {
                    conn: *conn,
                    session: *session,
                    expect,
                };
            }
            Transition::Restart => {
                state.pending.clear();
                for c in state.conns.values_mut() {
                    c.live = false;
                }
                state.leases.clear();
                state.step = Step::Restart;
            }
        }
        state
    }
}

// ---------------------------------------------------------------------------
// System under test
// ---------------------------------------------------------------------------

struct Sut {
    table: LeaseTable,
    store: Arc<MemoryLeaseStore>,
    /// Every fencing token granted per session, in order.
    grants: BTreeMap<String, Vec<u64>>,
    /// Connections the harness was told are gone (replaced, silent,
    /// disconnected, or lost in a restart). None may ever pass `check_frame`.
    dead: BTreeSet<ConnId>,
    /// `next_deadline` after the last step: once set, it may never move
    /// earlier (the leases actor arms its timer once and relies on it).
    deadline: Option<u64>,
}

struct LeaseTableTest;

impl StateMachineTest for LeaseTableTest {
    type SystemUnderTest = Sut;
    type Reference = LeaseModel;

    fn init_test(ref_state: &Model) -> Sut {
        let store = Arc::new(MemoryLeaseStore::new());
        Sut {
            table: LeaseTable::new(ref_state.ttl, store.clone()),
            store,
            grants: BTreeMap::new(),
            dead: BTreeSet::new(),
            deadline: None,
        }
    }

    fn apply(mut sut: Sut, model: &Model, _transition: Transition) -> Sut {
        let now = model.now;
        match &model.step {
            Step::Nothing => {}
            Step::Register {
                exec,
                conn,
                resume,
                expect,
            } => {
                let got =
                    sut.table
                        .register(EXECUTORS[*exec], ConnId(*conn), &strings(resume), now);
                assert_eq!(&got, expect, "register result");
                sut.dead.extend(got.replaced);
            }
            Step::Frame { conn } => sut.table.frame(ConnId(*conn), now),
            Step::Disconnect { conn } => {
                sut.table.disconnect(ConnId(*conn), now);
                // An id never minted yet may still be minted later.
                if *conn < model.next_conn {
                    sut.dead.insert(ConnId(*conn));
                }
            }
            Step::Assign {
                session,
                exec,
                expect,
            } => {
                let got = sut.table.assign(SESSIONS[*session], EXECUTORS[*exec], now);
                assert_eq!(&got, expect, "assign result");
                if let Ok(grant) = got {
                    let history = sut.grants.entry(grant.session_id).or_default();
                    if let Some(&last) = history.last() {
                        assert!(
                            grant.fencing_token > last,
                            "fencing token {} not above earlier grant {last}",
                            grant.fencing_token
                        );
                    }
                    history.push(grant.fencing_token);
                }
            }
            Step::End { session } => sut.table.end(SESSIONS[*session]),
            Step::Tick { expect } => {
                let got = sut.table.tick(now);
                assert_eq!(&got, expect, "tick result");
                sut.dead.extend(got.silent);
                for s in SESSIONS {
                    if let Some(view) = sut.table.holder(s) {
                        assert!(
                            view.expires_at.is_none_or(|t| t > now),
                            "{s} still reported held after tick past expiry: {view:?}"
                        );
                    }
                }
            }
            Step::CheckFrame {
                conn,
                session,
                expect,
            } => {
                let got = sut
                    .table
                    .check_frame(ConnId(*conn), SESSIONS[*session], now);
                assert_eq!(&got, expect, "check_frame result");
            }
            Step::Restart => {
                sut.table = LeaseTable::new(model.ttl, sut.store.clone());
                sut.dead.extend((0..model.next_conn).map(ConnId));
                // A new table: its actor arms afresh.
                sut.deadline = None;
            }
        }
        let next = sut.table.next_deadline();
        if let (Some(before), Some(after)) = (sut.deadline, next) {
            assert!(
                after >= before,
                "next_deadline moved earlier: {before} -> {after} after {:?}",
                model.step
            );
        }
        sut.deadline = next;
        sut
    }

    fn check_invariants(sut: &Sut, model: &Model) {
        let t = &sut.table;
        let now = model.now;
        let conns: Vec<ConnId> = (0..=model.next_conn).map(ConnId).collect();

        // At most one live connection per executor, and the model's one.
        for (e, name) in EXECUTORS.iter().enumerate() {
            let live: Vec<ConnId> = conns
                .iter()
                .copied()
                .filter(|&c| t.executor_of(c) == Some(*name))
                .collect();
            assert!(live.len() <= 1, "{name} has live connections {live:?}");
            assert_eq!(t.live_connection(name), live.first().copied());
            assert_eq!(t.live_connection(name), model.live_conn(e).map(ConnId));
        }

        // Leases as the model has them; fencing token is the last granted.
        for (s, name) in SESSIONS.iter().enumerate() {
            let view = t.holder(name);
            assert_eq!(view, model.holder(s), "holder({name})");
            if let Some(view) = view {
                let last = sut.grants.get(*name).and_then(|h| h.last());
                assert_eq!(
                    Some(&view.fencing_token),
                    last,
                    "{name} token not its last grant"
                );
                assert_eq!(sut.store.current(name), Some(view.fencing_token));
                if view.expires_at.is_none() {
                    assert_eq!(t.executor_of(view.conn), Some(view.executor_id.as_str()));
                }
            }
        }

        // At most one holder per session across all connections.
        let mut seen = BTreeSet::new();
        for &c in &conns {
            let held = t.sessions_of(c);
            assert_eq!(held, model.sessions_of(c.0), "sessions_of({c})");
            for s in held {
                assert!(seen.insert(s.clone()), "{s} held by two connections");
            }
        }

        assert_eq!(t.next_deadline(), model.next_deadline(), "next_deadline");

        // Frame acceptance everywhere: as the model says, never from a dead
        // connection, and never for a lease past its expiry.
        for &c in &conns {
            for (s, name) in SESSIONS.iter().enumerate() {
                let got = t.check_frame(c, name, now);
                assert_eq!(got, model.check_frame(c.0, s), "check_frame({c}, {name})");
                if sut.dead.contains(&c) {
                    assert!(got.is_err(), "dead {c} accepted for {name}");
                }
                let past_expiry = t
                    .holder(name)
                    .and_then(|v| v.expires_at)
                    .is_some_and(|e| e <= now);
                if past_expiry {
                    assert_eq!(got, Err(LeaseError::Expired), "{name} held past expiry");
                }
            }
        }
    }
}

prop_state_machine! {
    #![proptest_config(Config {
        cases: 1000,
        .. Config::default()
    })]

    #[test]
    fn lease_table_matches_model(sequential 1..=50 => LeaseTableTest);
}

// ---------------------------------------------------------------------------
// Executor side
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum ClockOp {
    Advance(u64),
    Ack,
    Register(u64),
    Disconnect,
}

fn clock_op() -> impl Strategy<Value = ClockOp> {
    prop_oneof![
        3 => (0u64..3_000).prop_map(ClockOp::Advance),
        3 => Just(ClockOp::Ack),
        1 => (0u64..2_000).prop_map(ClockOp::Register),
        2 => Just(ClockOp::Disconnect),
    ]
}

proptest! {
    #![proptest_config(Config {
        cases: 1000,
        .. Config::default()
    })]

    /// Highest fencing token wins; lower is Stale, equal is Idempotent.
    #[test]
    fn session_fence_highest_wins(first in 0u64..20, tokens in vec(0u64..20, 0..50)) {
        let token = |f: u64| format!("lease-s-{f}");
        let mut fence = SessionFence::new(first, token(first));
        let mut highest = first;
        for f in tokens {
            let expect = if f > highest {
                AssignDecision::Renewed { previous: highest }
            } else if f == highest {
                AssignDecision::Idempotent
            } else {
                AssignDecision::Stale { highest }
            };
            prop_assert_eq!(fence.on_assign(f, &token(f)), expect);
            highest = highest.max(f);
            prop_assert_eq!(fence.highest(), highest);
            prop_assert_eq!(fence.lease_token(), token(highest));
        }
    }

    /// `LeaseClock` against a model that keeps flags and recomputes.
    #[test]
    fn lease_clock_matches_model(
        initial_ttl in 0u64..2_000,
        start in 0u64..1_000_000,
        ops in vec(clock_op(), 0..50),
    ) {
        let mut clock = LeaseClock::new(initial_ttl);
        let mut now = start;
        let (mut registered, mut connected, mut last_ack, mut ttl) = (false, false, 0u64, initial_ttl);
        for op in ops {
            match op {
                ClockOp::Advance(ms) => now += ms,
                ClockOp::Ack => {
                    clock.on_heartbeat_ack(now);
                    if connected {
                        last_ack = now;
                    }
                }
                ClockOp::Register(new_ttl) => {
                    clock.on_registered(now, new_ttl);
                    (registered, connected, last_ack, ttl) = (true, true, now, new_ttl);
                }
                ClockOp::Disconnect => {
                    clock.on_disconnect(now);
                    connected = false;
                }
            }
            let expires_at = (registered && !connected).then(|| last_ack + ttl);
            prop_assert_eq!(clock.is_connected(), connected);
            prop_assert_eq!(clock.expires_at(), expires_at);
            prop_assert_eq!(clock.expired(now), !registered || expires_at.is_some_and(|t| now >= t));
            prop_assert_eq!(clock.lease_ttl_ms(), ttl);
        }
    }
}

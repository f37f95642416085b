//! Issue 54: the lease model over several replicas sharing one session
//! row, with the executor's connection flapping between them.
//!
//! Sans-IO, explicit `now`: three replicas with skewed clocks keep their
//! own copy of one session (its grant's token, whether they believe they
//! hold the live connection, their own lease deadline); one executor runs
//! the session with its fence (the highest token it saw). The steps drive
//! the harness's own rules (`bmx::harness::rows`: `settle_resume`,
//! `expire`, and the conditional statements of `SessionRows`) over the
//! row store under test:
//!
//! * `Connect(r)`: the executor registers on replica `r` (resuming the
//!   session if it still runs it); every other replica that still believes
//!   it holds the connection loses it at once (the 4004 rule across
//!   replicas) and records the loss;
//! * `Drop`: the connection drops and its replica notices;
//! * `Freeze`: the connection freezes half-open: its replica notices
//!   nothing until its silence clock runs out;
//! * `Advance(ms)`: time passes (frames on a live connection; a frozen
//!   replica's silence clock, the executor's own lease clock);
//! * `Tick(r)`: replica `r`'s timer: an orphaned copy past its own
//!   deadline asks the store to expire it;
//! * `Stop(r)`, `Request(r)`: the platform stops the session, or sends a
//!   request, through replica `r`.
//!
//! Invariants after every step: **at most one replica acts for the
//! session** (believes it holds the executor's live connection under a
//! grant the executor's fence accepts), and that one is the row's grant;
//! every request the executor accepts comes under the row's grant; **no
//! live session is stopped by a superseded replica** (a stop the executor
//! applies comes from the row's own grant, or the row is over); the row's
//! token never goes down.
//!
//! It runs over the in-memory row store and over PostgreSQL (a fresh
//! database; skipped loudly without `BMX_TEST_PG`, failed under CI).

use super::pg_support;
use bmx::harness::rows::{self, Expiry, Local, MemoryRows, SessionRows, Settled};
use bmx::harness::store::{PgReplicas, PgStore};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::Config;
use std::sync::Arc;

const TTL: u64 = 2_000;
const POLL: u64 = 200;
const REPLICAS: usize = 3;

#[derive(Debug, Clone)]
enum Ev {
    Connect(usize),
    Drop,
    Freeze,
    Advance(u64),
    Tick(usize),
    Stop(usize),
    Request(usize),
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        4 => (0..REPLICAS).prop_map(Ev::Connect),
        2 => Just(Ev::Drop),
        2 => Just(Ev::Freeze),
        4 => prop_oneof![0u64..300, 0u64..(3 * TTL)].prop_map(Ev::Advance),
        3 => (0..REPLICAS).prop_map(Ev::Tick),
        1 => (0..REPLICAS).prop_map(Ev::Stop),
        2 => (0..REPLICAS).prop_map(Ev::Request),
    ]
}

/// A replica's copy of the session.
#[derive(Debug, Clone)]
struct Copy {
    token: u64,
    /// It believes it holds the executor's live connection.
    live: bool,
    /// Its last frame from that connection, on its clock.
    last_seen: u64,
    /// Its orphaned lease's deadline, on its clock.
    deadline: Option<u64>,
    ended: bool,
    /// The holder connection it last had.
    conn: String,
}

struct Model<'a, S: SessionRows + ?Sized> {
    rows: &'a [&'a S],
    names: [String; REPLICAS],
    sid: String,
    /// The store's clock.
    now: u64,
    skew: [i64; REPLICAS],
    copies: [Option<Copy>; REPLICAS],
    /// Where the executor's connection is, and whether it is frozen.
    conn: Option<(usize, bool)>,
    /// The executor runs the session.
    running: bool,
    fence: u64,
    /// The executor's last acknowledged frame (store clock: it only
    /// measures durations).
    last_ack: u64,
    next_token: u64,
    conns: u64,
    row_token: u64,
}

impl<'a, S: SessionRows + ?Sized> Model<'a, S> {
    fn local(&self, r: usize) -> u64 {
        self.now.saturating_add_signed(self.skew[r])
    }

    fn conn_id(&self, r: usize) -> String {
        format!("{}-c{}", self.names[r], self.conns)
    }

    fn row(&self) -> Option<rows::Row> {
        self.rows[0]
            .rows(std::slice::from_ref(&self.sid))
            .unwrap_or_else(|e| panic!("store: {e}"))
            .remove(&self.sid)
    }

    /// Replica `r` lost its connection (noticed now, or by silence).
    fn lose(&mut self, r: usize) {
        let local = self.local(r);
        let Some(c) = self.copies[r].as_mut() else {
            return;
        };
        if !c.live {
            return;
        }
        c.live = false;
        let deadline = c.last_seen + TTL;
        c.deadline = Some(deadline);
        let token = c.token;
        let name = self.names[r].clone();
        self.rows[r]
            .lost(&self.sid, token, &name, deadline, local, Some(self.now))
            .unwrap_or_else(|e| panic!("store: {e}"));
    }

    fn step(&mut self, e: &Ev) -> Result<(), TestCaseError> {
        match *e {
            Ev::Connect(r) => {
                if self.conn.is_some() {
                    return Ok(());
                }
                self.conns += 1;
                // The 4004 rule across replicas: whoever still believes it
                // holds the executor's connection loses it at once.
                for x in 0..REPLICAS {
                    self.lose(x);
                }
                self.conn = Some((r, false));
                self.last_ack = self.now;
                if !self.running {
                    return Ok(());
                }
                let local = self.copies[r].as_ref().map(|c| Local {
                    fencing_token: c.token,
                    ended: c.ended,
                });
                let listed = vec![(self.sid.clone(), local)];
                let name = self.names[r].clone();
                let conn = self.conn_id(r);
                let mut next = self.next_token;
                let settled = rows::settle_resume(
                    self.rows[r],
                    &name,
                    "ex",
                    &conn,
                    &listed,
                    |_, above| {
                        next = next.max(above) + 1;
                        Some(next)
                    },
                    TTL,
                    POLL,
                    Some(self.now),
                )
                .unwrap_or_else(|e| panic!("store: {e}"));
                self.next_token = next;
                let s = &settled[0];
                if s.drop_local {
                    self.copies[r] = None;
                }
                let local_now = self.local(r);
                match &s.outcome {
                    Settled::Kept { token } => {
                        let c = self.copies[r].as_mut().expect("kept a copy it had");
                        prop_assert_eq!(c.token, *token);
                        c.live = true;
                        c.deadline = None;
                        c.last_seen = local_now;
                        c.conn = conn.clone();
                    }
                    Settled::Taken { token, .. } => {
                        self.copies[r] = Some(Copy {
                            token: *token,
                            live: true,
                            last_seen: local_now,
                            deadline: None,
                            ended: false,
                            conn: conn.clone(),
                        });
                        // The renewing assign.
                        self.fence = self.fence.max(*token);
                    }
                    Settled::Stop { token } => {
                        // The stop goes out under the row's token; the
                        // executor applies it unless it knows a newer grant.
                        if token.is_none_or(|t| t >= self.fence) {
                            let row = self.row();
                            prop_assert!(
                                row.as_ref().is_none_or(|w| w.ended),
                                "a resume stopped a live session: {row:?}"
                            );
                            self.running = false;
                        }
                    }
                    Settled::Lost => {}
                }
            }
            Ev::Drop => {
                if let Some((r, frozen)) = self.conn.take() {
                    if !frozen {
                        self.lose(r);
                    }
                }
            }
            Ev::Freeze => {
                if let Some((r, false)) = self.conn {
                    // The executor gives the connection up (its heartbeat
                    // goes unanswered); the replica notices nothing.
                    self.conn = None;
                    let _ = r;
                }
            }
            Ev::Advance(ms) => {
                self.now += ms;
                if let Some((r, false)) = self.conn {
                    let local = self.local(r);
                    if let Some(c) = self.copies[r].as_mut() {
                        if c.live {
                            c.last_seen = local;
                        }
                    }
                    self.last_ack = self.now;
                }
                // Silence: a replica whose connection froze closes it
                // (4008) once its clock passes last frame + TTL.
                for x in 0..REPLICAS {
                    let holds_live = matches!(self.conn, Some((y, false)) if y == x);
                    let local = self.local(x);
                    let silent = self.copies[x]
                        .as_ref()
                        .is_some_and(|c| c.live && local >= c.last_seen + TTL);
                    if silent && !holds_live {
                        self.lose(x);
                    }
                }
                // The executor's own lease clock.
                if self.conn.is_none() && self.now >= self.last_ack + TTL {
                    self.running = false;
                }
            }
            Ev::Tick(r) => {
                let local = self.local(r);
                let Some(c) = self.copies[r].clone() else {
                    return Ok(());
                };
                let Some(deadline) = c.deadline.filter(|d| !c.live && !c.ended && local >= *d)
                else {
                    return Ok(());
                };
                let name = self.names[r].clone();
                // The holder it last had.
                let holder = Some(c.conn.clone());
                let before = self.row();
                let out = rows::expire(
                    self.rows[r],
                    &self.sid,
                    c.token,
                    &name,
                    holder.as_deref(),
                    deadline,
                    local,
                    Some(self.now),
                )
                .unwrap_or_else(|e| panic!("store: {e}"));
                match out {
                    Expiry::Ended => {
                        let b = before.expect("ended a row");
                        prop_assert_eq!(b.fencing_token, c.token);
                        prop_assert_eq!(b.replica.as_deref(), Some(name.as_str()));
                        if let Some(c) = self.copies[r].as_mut() {
                            c.ended = true;
                        }
                    }
                    Expiry::Superseded => self.copies[r] = None,
                    Expiry::NotYet { remaining_ms } => {
                        if let Some(c) = self.copies[r].as_mut() {
                            c.deadline = Some(local + remaining_ms.max(1));
                        }
                    }
                }
            }
            Ev::Stop(r) => {
                let Some(c) = self.copies[r].clone().filter(|c| c.live && !c.ended) else {
                    return Ok(());
                };
                let name = self.names[r].clone();
                // The store decides before every stop.
                if !self.rows[r]
                    .holds(&self.sid, c.token, &name)
                    .unwrap_or_else(|e| panic!("store: {e}"))
                {
                    self.copies[r] = None;
                    return Ok(());
                }
                if matches!(self.conn, Some((y, false)) if y == r)
                    && self.running
                    && c.token >= self.fence
                {
                    self.running = false;
                    self.rows[r]
                        .end_expired(&self.sid, c.token)
                        .unwrap_or_else(|e| panic!("store: {e}"));
                    if let Some(c) = self.copies[r].as_mut() {
                        c.ended = true;
                    }
                }
            }
            Ev::Request(r) => {
                let Some(c) = self.copies[r].clone().filter(|c| c.live && !c.ended) else {
                    return Ok(());
                };
                if matches!(self.conn, Some((y, false)) if y == r)
                    && self.running
                    && c.token >= self.fence
                {
                    // Accepted by the executor: it must be the row's grant.
                    let row = self.row().expect("a row");
                    prop_assert_eq!(row.fencing_token, c.token, "accepted under a stale grant");
                    prop_assert_eq!(row.replica.as_deref(), Some(name_of(&self.names, r)));
                }
            }
        }
        Ok(())
    }

    fn check(&mut self) -> Result<(), TestCaseError> {
        let row = self.row();
        if let Some(w) = &row {
            prop_assert!(
                w.fencing_token >= self.row_token,
                "the row's token went down"
            );
            self.row_token = w.fencing_token;
        }
        // At most one replica acts: believes it holds the live connection,
        // under a grant the executor accepts.
        let acting: Vec<usize> = (0..REPLICAS)
            .filter(|&r| {
                self.copies[r]
                    .as_ref()
                    .is_some_and(|c| c.live && !c.ended && c.token >= self.fence)
                    && matches!(self.conn, Some((y, false)) if y == r)
                    && self.running
            })
            .collect();
        prop_assert!(acting.len() <= 1, "two replicas act: {acting:?}");
        if let (Some(&r), Some(w)) = (acting.first(), &row) {
            let c = self.copies[r].as_ref().expect("acting copy");
            prop_assert_eq!(c.token, w.fencing_token);
            prop_assert_eq!(w.replica.as_deref(), Some(name_of(&self.names, r)));
        }
        Ok(())
    }
}

fn name_of(names: &[String; REPLICAS], r: usize) -> &str {
    &names[r]
}

/// One history over `rows` (one store per replica; all over one set of
/// rows), the session granted on replica 0 first.
fn run<S: SessionRows + ?Sized>(
    rows: &[&S],
    names: [String; REPLICAS],
    sid: &str,
    base: u64,
    skew: [i64; REPLICAS],
    evs: &[Ev],
    seen: &dyn Fn(&str, u64),
) -> Result<(), TestCaseError> {
    let mut m = Model {
        rows,
        names,
        sid: sid.to_owned(),
        now: base,
        skew,
        copies: Default::default(),
        conn: Some((0, false)),
        running: true,
        fence: 0,
        last_ack: base,
        next_token: 100,
        conns: 0,
        row_token: 0,
    };
    let name = m.names[0].clone();
    let conn = m.conn_id(0);
    let granted = rows[0]
        .grant(sid, "ex", 100, &name, &conn, None)
        .unwrap_or_else(|e| panic!("store: {e}"));
    prop_assert!(granted);
    m.fence = 100;
    m.copies[0] = Some(Copy {
        token: 100,
        live: true,
        last_seen: m.local(0),
        deadline: None,
        ended: false,
        conn,
    });
    for e in evs {
        for n in &m.names {
            seen(n, m.now);
        }
        m.step(e)?;
        m.check()?;
    }
    Ok(())
}

fn skews() -> impl Strategy<Value = [i64; REPLICAS]> {
    [-500i64..500, -500i64..500, -500i64..500]
}

proptest! {
    #![proptest_config(Config { cases: 1000, ..Config::default() })]

    #[test]
    fn replicas_over_memory_rows_never_both_act(skew in skews(), evs in vec(ev(), 1..60)) {
        let m = MemoryRows::new();
        let names = ["r0".to_owned(), "r1".to_owned(), "r2".to_owned()];
        run(&[&m, &m, &m], names, "s", 1_000_000, skew, &evs, &|n, t| m.seen(n, t))?;
    }
}

proptest! {
    #![proptest_config(Config { cases: 24, ..Config::default() })]

    #[test]
    fn replicas_over_postgres_never_both_act(skew in skews(), evs in vec(ev(), 1..40)) {
        let Some(db) = pg_support::fresh("model_replicas") else { return Ok(()) };
        let names = ["r0".to_owned(), "r1".to_owned(), "r2".to_owned()];
        let stores: Vec<PgReplicas> = names
            .iter()
            .map(|n| {
                let store = Arc::new(PgStore::connect(&db.url).expect("connect"));
                PgReplicas::new(store, n.clone())
            })
            .collect();
        // The model's clock starts at the database's own (rows it did not
        // write, a replica's liveness, are on that clock).
        let base = stores[0].clock(None).expect("clock");
        let refs: Vec<&PgReplicas> = stores.iter().collect();
        run(&refs, names, "s", base, skew, &evs, &|_, _| {})?;
    }
}

/// The old rule, as a store: a replica's expiry ends the row whatever
/// grant it now holds (the lease judged by the replica's own clock only).
/// The model must catch it: a stale copy expiring on one replica must not
/// end the session another replica holds.
struct ExpiryByLocalClock(MemoryRows);

impl SessionRows for ExpiryByLocalClock {
    type Error = rows::NoClock;
    type Taken = ();
    fn clock(&self, now: Option<u64>) -> Result<u64, Self::Error> {
        self.0.clock(now)
    }
    fn rows(
        &self,
        ids: &[String],
    ) -> Result<std::collections::BTreeMap<String, rows::Row>, Self::Error> {
        self.0.rows(ids)
    }
    fn grant(
        &self,
        s: &str,
        e: &str,
        t: u64,
        r: &str,
        c: &str,
        p: Option<u64>,
    ) -> Result<bool, Self::Error> {
        self.0.grant(s, e, t, r, c, p)
    }
    fn take_over(
        &self,
        s: &str,
        p: u64,
        t: u64,
        r: &str,
        c: &str,
    ) -> Result<Option<()>, Self::Error> {
        self.0.take_over(s, p, t, r, c)
    }
    fn keep(&self, s: &str, t: u64, r: &str, c: &str, n: Option<u64>) -> Result<bool, Self::Error> {
        self.0.keep(s, t, r, c, n)
    }
    fn lost(
        &self,
        s: &str,
        t: u64,
        r: &str,
        d: u64,
        l: u64,
        n: Option<u64>,
    ) -> Result<bool, Self::Error> {
        self.0.lost(s, t, r, d, l, n)
    }
    #[allow(clippy::too_many_arguments)]
    fn expire(
        &self,
        s: &str,
        _t: u64,
        _r: &str,
        _h: Option<&str>,
        _d: u64,
        _l: u64,
        _n: Option<u64>,
    ) -> Result<Expiry, Self::Error> {
        let current = self
            .0
            .rows(&[s.to_owned()])?
            .remove(s)
            .map(|w| w.fencing_token);
        if let Some(t) = current {
            self.0.end_expired(s, t)?;
        }
        Ok(Expiry::Ended)
    }
    fn end_expired(&self, s: &str, p: u64) -> Result<bool, Self::Error> {
        self.0.end_expired(s, p)
    }
    fn holds(&self, s: &str, t: u64, r: &str) -> Result<bool, Self::Error> {
        self.0.holds(s, t, r)
    }
}

#[test]
fn the_model_catches_an_expiry_by_a_replicas_own_clock() {
    // Granted on r0; the connection moves to r1 (which takes over); time
    // passes with the executor on r1; r0's stale copy runs out on r0's
    // clock and its timer fires.
    let evs = [
        Ev::Drop,
        Ev::Connect(1),
        Ev::Advance(TTL / 2),
        Ev::Advance(TTL / 2),
        Ev::Advance(TTL / 2),
        Ev::Tick(0),
    ];
    let names = ["r0".to_owned(), "r1".to_owned(), "r2".to_owned()];
    let good = MemoryRows::new();
    run(
        &[&good, &good, &good],
        names.clone(),
        "s",
        1_000_000,
        [0; 3],
        &evs,
        &|n, t| good.seen(n, t),
    )
    .expect("the harness's rules pass");
    let bad = ExpiryByLocalClock(MemoryRows::new());
    let failed = run(
        &[&bad, &bad, &bad],
        names,
        "s",
        1_000_000,
        [0; 3],
        &evs,
        &|n, t| bad.0.seen(n, t),
    );
    assert!(failed.is_err(), "the model missed a stale expiry");
}

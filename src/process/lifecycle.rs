//! The lifecycle of one process, without I/O: which kill reason wins, who
//! waits for the end, when SIGKILL follows SIGTERM, and whether a
//! `process.read` is answered now or waits.
//!
//! [`Lifecycle`] is driven by the process actor with an explicit `now` (a
//! [`Duration`] since an origin the actor chooses) and answers with
//! [`Effect`]s that the actor executes: signals to the group, SIGKILL to the
//! tree, a timer to arm, the final state to publish, waiters to answer.
//! Timers are only wake-ups: the actor calls [`Lifecycle::tick`] when one
//! fires, and the core decides from `now` and its own deadlines what is due,
//! so a stale or duplicated timer does nothing. Anything already due when an
//! input arrives is done in the same step, which is why every timer the core
//! asks for lies strictly after `now`.
//!
//! [`ReadPoll`] is the long-poll decision of one `process.read`. It is a
//! separate value rather than a table inside [`Lifecycle`] because a read
//! is served by its own task, woken by the output ring's watch, so that
//! the bytes a pump reads never pass through the actor (thousands of
//! processes stream at once in `bmx bench scale`).
//!
//! # Precedence: which cause is reported
//!
//! The final state is decided once, when the exit is observed (or at spawn
//! failure) and never changes afterwards:
//!
//! - Spawn failure: `failed` with reason `spawn_failed`.
//! - Exit observed: `killed` if the child died of a signal or if any kill
//!   was requested before the exit was observed (a terminate, a kill, the
//!   timeout), `exited` otherwise. A child that handles SIGTERM and exits 0
//!   is therefore `killed` with its exit code.
//! - The reason is the **first** requested one: the first
//!   [`Lifecycle::terminate`] (`terminated` from `process.terminate`, the
//!   session's stop reason from `session.stop`) or [`Lifecycle::kill`]
//!   (`shutdown`) sets it and later requests leave it alone, **except** the
//!   timeout: `timeoutMs` passing while the process still runs overrides any
//!   earlier reason with `timeout`, because the timeout is what SIGKILLs the
//!   process there and then, while a terminate may still be inside its
//!   grace period. A child that dies of a signal nobody asked for is
//!   `killed` with no reason.
//! - The timeout counts from the moment the core learns it is due: a tick,
//!   a terminate or a kill at or after the deadline. An exit observed
//!   before that keeps the earlier reason (or none): the process was
//!   already gone when the timeout was handled, as in the mailbox order the
//!   actor always had.
//! - Requests after the exit was observed change nothing.

use nix::sys::signal::Signal;
use std::time::Duration;

/// The longest `waitMs` a `process.read` is held for.
pub const MAX_READ_WAIT: Duration = Duration::from_secs(600);
/// The reason reported when `timeoutMs` passed.
pub const TIMEOUT: &str = "timeout";
/// The reason reported when the child could not be started.
pub const SPAWN_FAILED: &str = "spawn_failed";

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// It exited on its own, nobody asked it to stop.
    Exited,
    /// It died of a signal, or it ended after a kill was requested.
    Killed,
    /// It never started.
    Failed,
}

/// The final state of a process, decided once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub ending: Ending,
    pub exit_code: Option<i32>,
    pub exit_signal: Option<i32>,
    pub reason: Option<String>,
}

/// How the child's wait status read: an exit code or a terminating signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

/// What the actor must do, in order.
#[derive(Debug)]
pub enum Effect<W> {
    /// Send this signal to the process group.
    Signal(Signal),
    /// SIGKILL the group and every process tagged with the scope, because a
    /// kill was asked for: a kill, the timeout, or a grace period that ran
    /// out.
    KillTree,
    /// Call [`Lifecycle::tick`] at (or after) this time.
    ArmTimer(Duration),
    /// The process ended: publish this final state and report it.
    Ended(Outcome),
    /// After the exit: kill what the process left running (no orphans),
    /// which also closes the pipes so readers see EOF.
    ReapLeftovers,
    /// Nothing more goes to the child's stdin.
    CloseStdin,
    /// Answer this waiter with the current state.
    Answer(W),
}

#[derive(Debug, Clone)]
enum Phase {
    Running,
    Ended(Outcome),
}

/// One process's lifecycle. `W` is whatever the actor needs to answer a
/// waiter (a responder, a completion channel); the core only keeps it until
/// the moment it must be answered.
#[derive(Debug)]
pub struct Lifecycle<W> {
    phase: Phase,
    /// The reason of the first kill request (or `timeout`), see the module
    /// doc for precedence.
    reason: Option<String>,
    /// When `timeoutMs` passes, until it has fired.
    timeout_at: Option<Duration>,
    /// The earliest grace deadline of the terminates not yet escalated.
    kill_at: Option<Duration>,
    /// Answered when the process ends, not before.
    terminate_waiters: Vec<W>,
    /// `process.start` with `waitMs`: answered when the process ends or at
    /// the deadline, whichever is first.
    start_waiters: Vec<(Duration, W)>,
}

impl<W> Lifecycle<W> {
    /// A child that was spawned at `now`, killed with reason `timeout` once
    /// `timeout` has passed (if given).
    pub fn started(now: Duration, timeout: Option<Duration>) -> (Self, Vec<Effect<W>>) {
        let mut core = Lifecycle {
            phase: Phase::Running,
            reason: None,
            timeout_at: timeout.map(|t| now.saturating_add(t)),
            kill_at: None,
            terminate_waiters: Vec::new(),
            start_waiters: Vec::new(),
        };
        let mut effects = Vec::new();
        if let Some(at) = core.timeout_at {
            effects.push(Effect::ArmTimer(at));
        }
        core.settle(now, &mut effects);
        (core, effects)
    }

    /// A child that could not be spawned: ended from the start.
    pub fn spawn_failed() -> Self {
        Lifecycle {
            phase: Phase::Ended(Outcome {
                ending: Ending::Failed,
                exit_code: None,
                exit_signal: None,
                reason: Some(SPAWN_FAILED.into()),
            }),
            reason: None,
            timeout_at: None,
            kill_at: None,
            terminate_waiters: Vec::new(),
            start_waiters: Vec::new(),
        }
    }

    /// Still running: no exit observed yet.
    pub fn is_running(&self) -> bool {
        matches!(self.phase, Phase::Running)
    }

    /// The final state, once there is one.
    pub fn outcome(&self) -> Option<&Outcome> {
        match &self.phase {
            Phase::Running => None,
            Phase::Ended(o) => Some(o),
        }
    }

    /// The reason the final state will carry if the process ends now.
    pub fn reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }

    /// `process.start` with `waitMs`: answer `waiter` when the process ends
    /// or `wait` has passed. A zero wait, or an ended process, is answered
    /// at once.
    pub fn await_start(&mut self, now: Duration, wait: Duration, waiter: W) -> Vec<Effect<W>> {
        if !self.is_running() || wait.is_zero() {
            return vec![Effect::Answer(waiter)];
        }
        let at = now.saturating_add(wait);
        self.start_waiters.push((at, waiter));
        vec![Effect::ArmTimer(at)]
    }

    /// SIGINT to the group while it runs.
    pub fn interrupt(&mut self) -> Vec<Effect<W>> {
        if self.is_running() {
            vec![Effect::Signal(Signal::SIGINT)]
        } else {
            Vec::new()
        }
    }

    /// SIGTERM now, SIGKILL to the tree once `grace` has passed; `waiter` is
    /// answered when the process ends (at once if it already has).
    pub fn terminate(
        &mut self,
        now: Duration,
        grace: Duration,
        reason: String,
        waiter: W,
    ) -> Vec<Effect<W>> {
        if !self.is_running() {
            return vec![Effect::Answer(waiter)];
        }
        self.reason.get_or_insert(reason);
        self.terminate_waiters.push(waiter);
        let at = now.saturating_add(grace);
        self.kill_at = Some(self.kill_at.map_or(at, |k| k.min(at)));
        let mut effects = vec![Effect::Signal(Signal::SIGTERM), Effect::ArmTimer(at)];
        self.settle(now, &mut effects);
        effects
    }

    /// SIGKILL the tree now.
    pub fn kill(&mut self, now: Duration, reason: String) -> Vec<Effect<W>> {
        if !self.is_running() {
            return Vec::new();
        }
        self.reason.get_or_insert(reason);
        let mut effects = vec![Effect::KillTree];
        self.settle(now, &mut effects);
        effects
    }

    /// A timer fired: do whatever is due at `now`.
    pub fn tick(&mut self, now: Duration) -> Vec<Effect<W>> {
        let mut effects = Vec::new();
        self.settle(now, &mut effects);
        effects
    }

    /// The child's exit was observed: decide the final state (see the module
    /// doc), reap what it left, answer everyone waiting. A second exit is
    /// ignored.
    /// The kernel's OOM killer ended the process (its session is at its
    /// memory bound): the reason the platform sees, unless one was set
    /// first (a kill it asked for). Call before [`Lifecycle::exited`].
    pub fn oom_killed(&mut self) {
        if self.is_running() && self.reason.is_none() {
            self.reason = Some("oom_killed".into());
        }
    }

    pub fn exited(&mut self, status: ExitStatus) -> Vec<Effect<W>> {
        if !self.is_running() {
            return Vec::new();
        }
        let killed = status.signal.is_some() || self.reason.is_some();
        let outcome = Outcome {
            ending: if killed {
                Ending::Killed
            } else {
                Ending::Exited
            },
            exit_code: status.code,
            exit_signal: status.signal,
            reason: self.reason.clone(),
        };
        self.phase = Phase::Ended(outcome.clone());
        self.timeout_at = None;
        self.kill_at = None;
        let mut effects = vec![
            Effect::Ended(outcome),
            Effect::ReapLeftovers,
            Effect::CloseStdin,
        ];
        effects.extend(self.terminate_waiters.drain(..).map(Effect::Answer));
        effects.extend(self.start_waiters.drain(..).map(|(_, w)| Effect::Answer(w)));
        effects
    }

    /// The actor is stopping: every waiter still parked, so that it can be
    /// answered rather than dropped.
    pub fn abandon(&mut self) -> Vec<W> {
        let mut all: Vec<W> = self.terminate_waiters.drain(..).collect();
        all.extend(self.start_waiters.drain(..).map(|(_, w)| w));
        all
    }

    /// Do everything due at `now`: the timeout, the end of a grace period,
    /// start waiters whose `waitMs` passed.
    fn settle(&mut self, now: Duration, effects: &mut Vec<Effect<W>>) {
        if !self.is_running() {
            return;
        }
        let mut kill = false;
        if self.timeout_at.is_some_and(|t| t <= now) {
            self.timeout_at = None;
            self.reason = Some(TIMEOUT.into());
            kill = true;
        }
        if self.kill_at.is_some_and(|t| t <= now) {
            self.kill_at = None;
            kill = true;
        }
        if kill && !matches!(effects.last(), Some(Effect::KillTree)) {
            effects.push(Effect::KillTree);
        }
        let mut i = 0;
        while i < self.start_waiters.len() {
            if self.start_waiters[i].0 <= now {
                let (_, w) = self.start_waiters.remove(i);
                effects.push(Effect::Answer(w));
            } else {
                i += 1;
            }
        }
        // Every timer asked for lies in the future: what was due is done.
        effects.retain(|e| !matches!(e, Effect::ArmTimer(at) if *at <= now));
    }
}

/// What a read's task sees of its stream when it decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamView {
    /// The span from the read's cursor holds at least one byte.
    pub has_bytes: bool,
    /// The process has ended (any final state).
    pub ended: bool,
    /// The pipe (or PTY) reached EOF: no byte will ever be added.
    pub closed: bool,
    /// The span reaches the end of what the stream holds.
    pub at_end: bool,
}

/// The decision about one `process.read`.
#[derive(Debug)]
pub enum ReadStep {
    /// Answer now, with this `eof`.
    Answer { eof: bool },
    /// Wait for bytes, the end of the process or `until`, then decide again
    /// with the poll handed back. `take_slot`: this is the first wait, which
    /// needs one of the session's waiting-read slots.
    Park {
        poll: ReadPoll,
        until: Duration,
        take_slot: bool,
    },
}

/// The long poll of one `process.read`: answered at once when bytes are
/// there or the stream is over, otherwise held until one of those happens
/// or `waitMs` passes. Deciding consumes the poll and only a park hands it
/// back, so a read cannot be answered twice.
#[derive(Debug)]
pub struct ReadPoll {
    deadline: Duration,
    parked: bool,
}

impl ReadPoll {
    /// A read asked at `now` that may wait `wait_ms` (capped at
    /// [`MAX_READ_WAIT`]; none or zero answers at once).
    pub fn new(now: Duration, wait_ms: Option<u64>) -> Self {
        let wait = Duration::from_millis(wait_ms.unwrap_or(0)).min(MAX_READ_WAIT);
        ReadPoll {
            deadline: now.saturating_add(wait),
            parked: false,
        }
    }

    /// When the read is answered at the latest.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Answer now or wait. `eof` is set once the process has ended, the
    /// stream is closed and the span reaches its end: nothing more will come.
    pub fn decide(self, now: Duration, view: StreamView) -> ReadStep {
        let eof = view.ended && view.closed && view.at_end;
        if view.has_bytes || eof || now >= self.deadline {
            return ReadStep::Answer { eof };
        }
        let take_slot = !self.parked;
        ReadStep::Park {
            until: self.deadline,
            poll: ReadPoll {
                parked: true,
                ..self
            },
            take_slot,
        }
    }
}

#[cfg(test)]
mod tests {
    //! Random input sequences against the invariants in the module doc, with
    //! an inline model of the precedence rule.

    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    const REASONS: [&str; 3] = ["terminated", "done", "shutdown"];

    #[derive(Debug, Clone)]
    enum Input {
        /// Let time pass; `fire` delivers every armed timer now due.
        Advance {
            ms: u64,
            fire: bool,
        },
        /// A stray timer (stale or early) fires now.
        Tick,
        Terminate {
            grace_ms: u64,
            reason: usize,
        },
        Kill {
            reason: usize,
        },
        Interrupt,
        AwaitStart {
            wait_ms: u64,
        },
        Exit {
            code: Option<i32>,
            signal: Option<i32>,
        },
    }

    fn input() -> impl Strategy<Value = Input> {
        prop_oneof![
            4 => (0u64..3_000, any::<bool>()).prop_map(|(ms, fire)| Input::Advance { ms, fire }),
            1 => Just(Input::Tick),
            3 => (prop_oneof![Just(0u64), 0u64..4_000], 0..REASONS.len())
                .prop_map(|(grace_ms, reason)| Input::Terminate { grace_ms, reason }),
            1 => (0..REASONS.len()).prop_map(|reason| Input::Kill { reason }),
            1 => Just(Input::Interrupt),
            2 => prop_oneof![Just(0u64), 0u64..4_000].prop_map(|wait_ms| Input::AwaitStart { wait_ms }),
            1 => (proptest::option::of(0i32..3), proptest::option::of(1i32..16))
                .prop_map(|(code, signal)| Input::Exit { code, signal }),
        ]
    }

    /// The harness around the core: a clock, armed timers, who is waiting.
    struct Driver {
        now: Duration,
        core: Lifecycle<u32>,
        next_waiter: u32,
        /// Waiters handed in and not answered yet: id → (kind, deadline).
        pending: std::collections::BTreeMap<u32, Option<Duration>>,
        answered: BTreeSet<u32>,
        timers: Vec<Duration>,
        /// Earliest grace deadline since the last SIGKILL-worthy request.
        graces: Vec<Duration>,
        kill_asked: bool,
        /// The model: first reason, overridden by the timeout.
        model_reason: Option<String>,
        timeout_at: Option<Duration>,
        ended: Option<Outcome>,
        killed_trees: usize,
    }

    impl Driver {
        fn new(timeout_ms: Option<u64>) -> Self {
            let timeout = timeout_ms.map(Duration::from_millis);
            let (core, effects) = Lifecycle::started(Duration::ZERO, timeout);
            let mut d = Driver {
                now: Duration::ZERO,
                core,
                next_waiter: 0,
                pending: Default::default(),
                answered: BTreeSet::new(),
                timers: Vec::new(),
                graces: Vec::new(),
                kill_asked: false,
                model_reason: None,
                timeout_at: timeout,
                ended: None,
                killed_trees: 0,
            };
            if timeout == Some(Duration::ZERO) {
                d.model_reason = Some(TIMEOUT.into());
                d.kill_asked = true;
                d.timeout_at = None;
            }
            d.apply(effects);
            d
        }

        fn waiter(&mut self, deadline: Option<Duration>) -> u32 {
            self.next_waiter += 1;
            self.pending.insert(self.next_waiter, deadline);
            self.next_waiter
        }

        /// Execute effects, checking each against the invariants.
        fn apply(&mut self, effects: Vec<Effect<u32>>) {
            for e in effects {
                match e {
                    Effect::ArmTimer(at) => {
                        assert!(
                            at > self.now,
                            "timer at {at:?} not after now {:?}",
                            self.now
                        );
                        self.timers.push(at);
                    }
                    Effect::KillTree => {
                        assert!(self.ended.is_none(), "SIGKILL requested after the end");
                        // Never before a grace deadline unless asked (kill or timeout).
                        let grace_due = self.graces.iter().any(|&g| g <= self.now);
                        assert!(
                            self.kill_asked || grace_due,
                            "SIGKILL at {:?} before any grace deadline {:?}",
                            self.now,
                            self.graces
                        );
                        self.killed_trees += 1;
                    }
                    Effect::Signal(_) => assert!(self.ended.is_none()),
                    Effect::Ended(o) => {
                        assert!(self.ended.is_none(), "a second final state: {o:?}");
                        assert_eq!(o.reason, self.model_reason, "the winning reason");
                        self.ended = Some(o);
                    }
                    Effect::ReapLeftovers | Effect::CloseStdin => {
                        assert!(self.ended.is_some())
                    }
                    Effect::Answer(w) => {
                        let deadline = self
                            .pending
                            .remove(&w)
                            .unwrap_or_else(|| panic!("waiter {w} answered twice or unknown"));
                        assert!(self.answered.insert(w));
                        // A start waiter is not answered before its wait is
                        // up, unless the process ended (or had already).
                        if let Some(d) = deadline {
                            assert!(
                                self.ended.is_some() || d <= self.now,
                                "start waiter {w} answered early"
                            );
                        }
                    }
                }
            }
            // After every step: nothing is parked once the process ended,
            // and a parked start waiter always has a timer armed no later
            // than its deadline, so it cannot be answered late.
            for (w, deadline) in &self.pending {
                assert!(
                    self.ended.is_none(),
                    "waiter {w} still parked after the end"
                );
                if let Some(d) = deadline {
                    assert!(
                        self.timers.iter().any(|t| t <= d),
                        "start waiter {w} (deadline {d:?}) has no timer"
                    );
                }
            }
            assert_eq!(self.core.outcome(), self.ended.as_ref());
        }

        fn step(&mut self, input: Input) {
            let running = self.ended.is_none();
            match input {
                Input::Advance { ms, fire } => {
                    let target = self.now + Duration::from_millis(ms);
                    if fire {
                        // Deliver timers in order, each at its own time.
                        loop {
                            self.timers.sort();
                            match self.timers.first().copied() {
                                Some(at) if at <= target => {
                                    self.timers.remove(0);
                                    self.now = self.now.max(at);
                                    self.model_due();
                                    let e = self.core.tick(self.now);
                                    self.apply(e);
                                }
                                _ => break,
                            }
                        }
                    }
                    self.now = target;
                }
                Input::Tick => {
                    self.model_due();
                    let e = self.core.tick(self.now);
                    self.apply(e);
                }
                Input::Terminate { grace_ms, reason } => {
                    let w = self.waiter(None);
                    if running {
                        self.model_due();
                        self.model_reason.get_or_insert(REASONS[reason].into());
                        self.graces.push(self.now + Duration::from_millis(grace_ms));
                    }
                    let e = self.core.terminate(
                        self.now,
                        Duration::from_millis(grace_ms),
                        REASONS[reason].into(),
                        w,
                    );
                    if running {
                        assert!(matches!(e.first(), Some(Effect::Signal(Signal::SIGTERM))));
                    } else {
                        assert!(matches!(e.as_slice(), [Effect::Answer(x)] if *x == w));
                    }
                    self.apply(e);
                }
                Input::Kill { reason } => {
                    if running {
                        self.model_due();
                        self.model_reason.get_or_insert(REASONS[reason].into());
                        self.kill_asked = true;
                    }
                    let e = self.core.kill(self.now, REASONS[reason].into());
                    assert_eq!(running, matches!(e.first(), Some(Effect::KillTree)));
                    self.apply(e);
                }
                Input::Interrupt => {
                    let e = self.core.interrupt();
                    assert_eq!(running, !e.is_empty());
                    self.apply(e);
                }
                Input::AwaitStart { wait_ms } => {
                    let at = self.now + Duration::from_millis(wait_ms);
                    let w = self.waiter(Some(at));
                    let e = self
                        .core
                        .await_start(self.now, Duration::from_millis(wait_ms), w);
                    self.apply(e);
                }
                Input::Exit { code, signal } => {
                    // An exit observed before the timeout's timer was
                    // handled wins over it: no settling here.
                    let before = self.ended.clone();
                    let reason_before = self.model_reason.clone();
                    let killed_before = self.kill_asked || reason_before.is_some();
                    let e = self.core.exited(ExitStatus { code, signal });
                    if before.is_some() {
                        assert!(e.is_empty(), "a second exit changed something");
                    }
                    self.apply(e);
                    if before.is_none() {
                        let o = self.ended.as_ref().expect("exit ends the process");
                        let want = if signal.is_some() || killed_before {
                            Ending::Killed
                        } else {
                            Ending::Exited
                        };
                        assert_eq!(o.ending, want);
                        assert_eq!((o.exit_code, o.exit_signal), (code, signal));
                    }
                }
            }
            if let Some(o) = &self.ended {
                // The final state never changes afterwards.
                assert_eq!(self.core.outcome(), Some(o));
            }
        }

        /// The model's view of the timeout: once due (as of `now`), it
        /// overrides the reason; a tick, a terminate or a kill settles it
        /// first, an exit does not.
        fn model_due(&mut self) {
            if self.ended.is_none() && self.timeout_at.is_some_and(|t| t <= self.now) {
                self.timeout_at = None;
                self.model_reason = Some(TIMEOUT.into());
                self.kill_asked = true;
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

        #[test]
        fn lifecycle_keeps_its_invariants(
            timeout_ms in proptest::option::of(prop_oneof![Just(0u64), 1u64..5_000]),
            inputs in vec(input(), 0..40),
        ) {
            let mut d = Driver::new(timeout_ms);
            for i in inputs {
                d.step(i);
            }
            // The child always exits in the end: every waiter is answered then.
            d.step(Input::Exit { code: Some(0), signal: None });
            prop_assert!(d.pending.is_empty(), "unanswered: {:?}", d.pending);
            prop_assert!(d.ended.is_some());
            prop_assert!(d.core.abandon().is_empty());
        }

        #[test]
        fn a_read_is_answered_by_its_deadline_or_at_eof(
            wait_ms in proptest::option::of(prop_oneof![Just(0u64), 0u64..700_000, Just(u64::MAX)]),
            events in vec((0u64..200_000, any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()), 0..30),
        ) {
            let start = Duration::from_millis(1_000);
            let first = ReadPoll::new(start, wait_ms);
            let deadline = first.deadline();
            let mut poll = Some(first);
            prop_assert!(deadline <= start + MAX_READ_WAIT);
            let mut now = start;
            let mut slots = 0;
            let mut view = StreamView { has_bytes: false, ended: false, closed: false, at_end: true };
            for (ms, bytes, ended, closed, at_end) in events {
                let Some(current) = poll.take() else { break };
                match current.decide(now, view) {
                    ReadStep::Answer { eof } => {
                        prop_assert!(view.has_bytes || eof || now >= deadline);
                        prop_assert_eq!(eof, view.ended && view.closed && view.at_end);
                    }
                    ReadStep::Park { poll: next, until, take_slot } => {
                        prop_assert!(now < deadline, "parked at or past the deadline");
                        prop_assert_eq!(until, deadline);
                        prop_assert!(!view.has_bytes);
                        prop_assert!(!(view.ended && view.closed && view.at_end), "parked at EOF");
                        slots += usize::from(take_slot);
                        poll = Some(next);
                        // Woken by bytes, the end, or the deadline.
                        now = (now + Duration::from_millis(ms)).min(until);
                        view = StreamView {
                            has_bytes: bytes,
                            ended: view.ended || ended,
                            closed: view.closed || closed,
                            at_end,
                        };
                    }
                }
            }
            if let Some(current) = poll {
                // The deadline always answers.
                let late = deadline.max(now);
                let quiet = StreamView { has_bytes: false, ended: false, closed: false, at_end: true };
                let last = matches!(current.decide(late, quiet), ReadStep::Answer { eof: false });
                prop_assert!(last, "not answered at the deadline");
            }
            prop_assert!(slots <= 1, "took {slots} slots");
        }
    }

    #[test]
    fn timeout_overrides_an_earlier_terminate_reason() {
        let ms = Duration::from_millis;
        let (mut core, e) = Lifecycle::<u32>::started(ms(0), Some(ms(100)));
        assert!(matches!(e.as_slice(), [Effect::ArmTimer(t)] if *t == ms(100)));
        core.terminate(ms(10), ms(5_000), "terminated".into(), 1);
        assert_eq!(core.reason(), Some("terminated"));
        assert!(matches!(core.tick(ms(100)).as_slice(), [Effect::KillTree]));
        assert_eq!(core.reason(), Some(TIMEOUT));
        let e = core.exited(ExitStatus {
            code: None,
            signal: Some(9),
        });
        assert!(
            matches!(e.as_slice(), [Effect::Ended(o), Effect::ReapLeftovers, Effect::CloseStdin, Effect::Answer(1)]
            if o.ending == Ending::Killed && o.reason.as_deref() == Some(TIMEOUT))
        );
        // The grace timer firing late does nothing.
        assert!(core.tick(ms(5_010)).is_empty());
    }

    #[test]
    fn first_requested_reason_wins_and_sigterm_handlers_still_count_as_killed() {
        let ms = Duration::from_millis;
        let (mut core, _) = Lifecycle::<u32>::started(ms(0), None);
        let e = core.terminate(ms(0), ms(1_000), "done".into(), 1);
        assert!(
            matches!(e.as_slice(), [Effect::Signal(Signal::SIGTERM), Effect::ArmTimer(t)] if *t == ms(1_000))
        );
        core.kill(ms(5), "shutdown".into());
        assert!(core.tick(ms(999)).is_empty());
        assert!(matches!(
            core.tick(ms(1_000)).as_slice(),
            [Effect::KillTree]
        ));
        core.exited(ExitStatus {
            code: Some(0),
            signal: None,
        });
        let o = core.outcome().unwrap();
        assert_eq!(
            (o.ending, o.reason.as_deref()),
            (Ending::Killed, Some("done"))
        );
    }

    #[test]
    fn spawn_failure_answers_everything_at_once() {
        let mut core = Lifecycle::<u32>::spawn_failed();
        assert!(!core.is_running());
        assert_eq!(
            core.outcome().unwrap().reason.as_deref(),
            Some(SPAWN_FAILED)
        );
        assert!(matches!(
            core.terminate(Duration::ZERO, Duration::ZERO, "x".into(), 7)
                .as_slice(),
            [Effect::Answer(7)]
        ));
        assert!(matches!(
            core.await_start(Duration::ZERO, Duration::from_secs(9), 8)
                .as_slice(),
            [Effect::Answer(8)]
        ));
        assert!(core.kill(Duration::ZERO, "x".into()).is_empty());
        assert!(core
            .exited(ExitStatus {
                code: Some(1),
                signal: None
            })
            .is_empty());
    }
}

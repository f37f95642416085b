//! The session state machine of VISOR.md §2, sans-IO.
//!
//! Every move a session makes goes through [`Machine::apply`]; the moves it
//! returns are checked against [`can_move`], the one table of legal moves.
//! Actors only feed inputs and publish the moves as `session_state` events,
//! so a property test over random input sequences covers every driver.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// A session's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Starting,
    Running,
    Idle,
    Waiting,
    Suspended,
    Exited,
    Lost,
}

impl State {
    pub const ALL: [State; 7] = [
        State::Starting,
        State::Running,
        State::Idle,
        State::Waiting,
        State::Suspended,
        State::Exited,
        State::Lost,
    ];

    /// Busy: the session is doing something (a turn, a start, a question).
    pub fn busy(self) -> bool {
        matches!(self, State::Starting | State::Running | State::Waiting)
    }

    /// Live: every state but `exited` (a `lost` session is about to restart).
    pub fn live(self) -> bool {
        self != State::Exited
    }

    pub fn as_str(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Running => "running",
            State::Idle => "idle",
            State::Waiting => "waiting",
            State::Suspended => "suspended",
            State::Exited => "exited",
            State::Lost => "lost",
        }
    }

    pub fn parse(s: &str) -> Option<State> {
        State::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

/// The legal moves, and nothing else: `starting → running | idle`,
/// `running ⇄ idle`, `running → waiting → running`, any live state →
/// `exited | lost`, `lost → starting`, `idle → suspended → starting`.
pub fn can_move(from: State, to: State) -> bool {
    use State::*;
    if from == to {
        return false;
    }
    match (from, to) {
        (Starting, Running | Idle) => true,
        (Running, Idle) | (Idle, Running) => true,
        (Running, Waiting) | (Waiting, Running) => true,
        (f, Exited | Lost) => f.live(),
        (Lost, Starting) => true,
        (Idle, Suspended) | (Suspended, Starting) => true,
        _ => false,
    }
}

/// What happened to a session, as its driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// The program is up; `idle`: it waits for input (a wire agent after
    /// `session/new`), else it runs (a PTY program).
    Started { idle: bool },
    /// The program produced output (no move: output is not a state).
    Output,
    /// A client sent input (`send`); see [`Delivery`].
    Send { can_steer: bool },
    /// The current turn ended.
    TurnEnded,
    /// The program asked a question / permission.
    Request,
    /// A pending request was answered (or withdrawn).
    Answer,
    /// The program ended on its own. `restart`: the restart policy will
    /// start it again (`lost`), else the session is over (`exited`).
    Exit { restart: bool },
    /// A client asked to stop the session.
    Stop,
    /// The session's actor crashed; like `Exit`.
    Crash { restart: bool },
    /// The restart policy starts the program again.
    Restart,
    /// The program was put to sleep while idle.
    Suspend,
}

/// Where `send` input went (VISOR.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Delivery {
    Prompted,
    Steered,
    Held,
}

/// Why an input was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("the session is {0}")]
    State(&'static str),
    #[error("no request is pending")]
    NoRequest,
}

/// What an accepted input did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Outcome {
    /// The moves made, in order (each one legal by [`can_move`]).
    pub moves: Vec<State>,
    /// For `Send`.
    pub delivery: Option<Delivery>,
}

/// One session's state, its pending request count and when it last moved.
#[derive(Debug, Clone)]
pub struct Machine {
    state: State,
    pending: u32,
    since: Duration,
}

impl Machine {
    /// A new session, `starting` at `now`.
    pub fn new(now: Duration) -> Machine {
        Machine {
            state: State::Starting,
            pending: 0,
            since: now,
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn pending(&self) -> u32 {
        self.pending
    }

    /// When the state last changed.
    pub fn since(&self) -> Duration {
        self.since
    }

    fn go(&mut self, to: State, now: Duration, out: &mut Outcome) {
        debug_assert!(can_move(self.state, to), "{:?} -> {:?}", self.state, to);
        if can_move(self.state, to) {
            self.state = to;
            self.since = now;
            out.moves.push(to);
        }
    }

    fn refuse(&self) -> Refused {
        Refused::State(self.state.as_str())
    }

    /// Apply an input at `now`.
    ///
    /// # Errors
    /// [`Refused`] when the input makes no sense in the current state
    /// (stopping an exited session, answering with nothing pending); the
    /// machine is then unchanged.
    pub fn apply(&mut self, input: Input, now: Duration) -> Result<Outcome, Refused> {
        use State::*;
        let mut out = Outcome::default();
        match (input, self.state) {
            (Input::Started { idle }, Starting) => {
                self.go(if idle { Idle } else { Running }, now, &mut out)
            }
            (Input::Started { .. }, _) => return Err(self.refuse()),
            (Input::Output, s) if s.live() => {}
            (Input::Output, _) => return Err(self.refuse()),
            (Input::Send { .. }, Exited) => return Err(self.refuse()),
            (Input::Send { .. }, Idle) => {
                self.go(Running, now, &mut out);
                out.delivery = Some(Delivery::Prompted);
            }
            (Input::Send { can_steer: true }, Running) => out.delivery = Some(Delivery::Steered),
            (Input::Send { .. }, _) => out.delivery = Some(Delivery::Held),
            (Input::TurnEnded, Running) => self.go(Idle, now, &mut out),
            (Input::TurnEnded, Waiting) => {
                // A cancelled turn withdraws its questions first.
                self.pending = 0;
                self.go(Running, now, &mut out);
                self.go(Idle, now, &mut out);
            }
            (Input::TurnEnded, _) => return Err(self.refuse()),
            (Input::Request, Running) => {
                self.pending = 1;
                self.go(Waiting, now, &mut out);
            }
            (Input::Request, Waiting) => self.pending = self.pending.saturating_add(1),
            (Input::Request, _) => return Err(self.refuse()),
            (Input::Answer, Waiting) if self.pending > 0 => {
                self.pending -= 1;
                if self.pending == 0 {
                    self.go(Running, now, &mut out);
                }
            }
            (Input::Answer, _) => return Err(Refused::NoRequest),
            (Input::Exit { restart } | Input::Crash { restart }, s) if s.live() => {
                self.pending = 0;
                let to = if restart { Lost } else { Exited };
                if s != to {
                    self.go(to, now, &mut out);
                }
            }
            (Input::Exit { .. } | Input::Crash { .. }, _) => return Err(self.refuse()),
            (Input::Stop, s) if s.live() => {
                self.pending = 0;
                self.go(Exited, now, &mut out);
            }
            (Input::Stop, _) => return Err(self.refuse()),
            (Input::Restart, Lost | Suspended) => self.go(Starting, now, &mut out),
            (Input::Restart, _) => return Err(self.refuse()),
            (Input::Suspend, Idle) => self.go(Suspended, now, &mut out),
            (Input::Suspend, _) => return Err(self.refuse()),
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn input() -> impl Strategy<Value = Input> {
        prop_oneof![
            any::<bool>().prop_map(|idle| Input::Started { idle }),
            Just(Input::Output),
            any::<bool>().prop_map(|can_steer| Input::Send { can_steer }),
            Just(Input::TurnEnded),
            Just(Input::Request),
            Just(Input::Answer),
            any::<bool>().prop_map(|restart| Input::Exit { restart }),
            Just(Input::Stop),
            any::<bool>().prop_map(|restart| Input::Crash { restart }),
            Just(Input::Restart),
            Just(Input::Suspend),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// No input sequence makes an illegal move; a refused input changes
        /// nothing; `waiting` exactly when a request is pending; `exited`
        /// is final.
        #[test]
        fn no_sequence_makes_an_illegal_move(inputs in proptest::collection::vec(input(), 0..80)) {
            let mut m = Machine::new(Duration::ZERO);
            for (i, inp) in inputs.into_iter().enumerate() {
                let before = m.clone();
                let now = Duration::from_millis(i as u64);
                match m.apply(inp, now) {
                    Ok(out) => {
                        let mut from = before.state();
                        for to in &out.moves {
                            prop_assert!(can_move(from, *to), "{:?} -> {:?} on {:?}", from, to, inp);
                            from = *to;
                        }
                        prop_assert_eq!(from, m.state());
                        if out.moves.is_empty() {
                            prop_assert_eq!(m.since(), before.since());
                        }
                        prop_assert_eq!(out.delivery.is_some(), matches!(inp, Input::Send { .. }));
                    }
                    Err(_) => {
                        prop_assert_eq!(m.state(), before.state());
                        prop_assert_eq!(m.pending(), before.pending());
                    }
                }
                prop_assert_eq!(m.state() == State::Waiting, m.pending() > 0);
                if before.state() == State::Exited {
                    prop_assert_eq!(m.state(), State::Exited);
                }
            }
        }
    }

    #[test]
    fn the_table() {
        use State::*;
        assert!(can_move(Starting, Running));
        assert!(can_move(Lost, Exited));
        assert!(!can_move(Exited, Starting));
        assert!(!can_move(Running, Starting));
        assert!(!can_move(Idle, Waiting));
        assert!(!can_move(Lost, Lost));
        assert!(Waiting.busy() && !Idle.busy() && Lost.live() && !Exited.live());
    }

    #[test]
    fn send_deliveries() {
        let mut m = Machine::new(Duration::ZERO);
        let held = m
            .apply(Input::Send { can_steer: true }, Duration::ZERO)
            .unwrap();
        assert_eq!(held.delivery, Some(Delivery::Held));
        m.apply(Input::Started { idle: true }, Duration::ZERO)
            .unwrap();
        let p = m
            .apply(Input::Send { can_steer: false }, Duration::ZERO)
            .unwrap();
        assert_eq!(
            (p.delivery, p.moves),
            (Some(Delivery::Prompted), vec![State::Running])
        );
        let s = m
            .apply(Input::Send { can_steer: true }, Duration::ZERO)
            .unwrap();
        assert_eq!(s.delivery, Some(Delivery::Steered));
        m.apply(Input::Stop, Duration::ZERO).unwrap();
        assert_eq!(
            m.apply(Input::Stop, Duration::ZERO),
            Err(Refused::State("exited"))
        );
    }
}

//! `session.event` sequencing, as a sans-IO state machine.
//!
//! PROTOCOL.md: `sequence` rises by one per session with no holes; any
//! other sequence is refused with -32009 and `data.expectedSequence`, and
//! the executor resends from there. A resend of an event already
//! acknowledged (its acknowledgement was lost) is acknowledged again and
//! not published twice. The first event of a session (or the first after
//! the harness forgot the session's sequence) sets where counting starts.
//!
//! Memory is one number per session with events, dropped when the session
//! ends or is granted anew, so it is bounded by the live sessions.

use std::collections::BTreeMap;

/// What to do with an arriving `session.event`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventDecision {
    /// The next event: publish it, acknowledge `acked` (its sequence).
    Accept { acked: u64 },
    /// Already acknowledged: acknowledge again with the last accepted
    /// sequence, publish nothing.
    Repeat { acked: u64 },
    /// A hole: refuse, the executor must resend from `expected`.
    Hole { expected: u64 },
}

/// The last accepted sequence per session.
///
/// Invariants (checked by `tests/harness/cores.rs`): the accepted
/// sequences of a session rise by exactly one with no hole and no repeat;
/// `Repeat` and `Hole` change nothing; no sequence overflows.
#[derive(Debug, Default)]
pub struct EventSequencer {
    last: BTreeMap<String, u64>,
}

impl EventSequencer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Decide on event `sequence` of `session_id`, and record it if accepted.
    pub fn accept(&mut self, session_id: &str, sequence: u64) -> EventDecision {
        match self.last.get(session_id).copied() {
            None => {
                self.last.insert(session_id.to_owned(), sequence);
                EventDecision::Accept { acked: sequence }
            }
            Some(last) if sequence <= last => EventDecision::Repeat { acked: last },
            // `last < sequence`, so `last + 1` cannot overflow.
            Some(last) if sequence == last + 1 => {
                self.last.insert(session_id.to_owned(), sequence);
                EventDecision::Accept { acked: sequence }
            }
            Some(last) => EventDecision::Hole { expected: last + 1 },
        }
    }

    /// The last accepted sequence of the session.
    pub fn last(&self, session_id: &str) -> Option<u64> {
        self.last.get(session_id).copied()
    }

    /// The session ended or was granted anew: counting starts over.
    pub fn forget(&mut self, session_id: &str) {
        self.last.remove(session_id);
    }

    /// Sessions with a sequence.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_rise_by_one_and_resends_are_acknowledged_again() {
        let mut e = EventSequencer::new();
        assert_eq!(e.accept("s", 5), EventDecision::Accept { acked: 5 });
        assert_eq!(e.accept("s", 6), EventDecision::Accept { acked: 6 });
        assert_eq!(e.accept("s", 5), EventDecision::Repeat { acked: 6 });
        assert_eq!(e.accept("s", 8), EventDecision::Hole { expected: 7 });
        assert_eq!(e.accept("s", 7), EventDecision::Accept { acked: 7 });
        e.forget("s");
        assert_eq!(e.accept("s", 0), EventDecision::Accept { acked: 0 });
    }

    #[test]
    fn the_largest_sequence_does_not_overflow() {
        let mut e = EventSequencer::new();
        assert_eq!(
            e.accept("s", u64::MAX),
            EventDecision::Accept { acked: u64::MAX }
        );
        assert_eq!(
            e.accept("s", u64::MAX),
            EventDecision::Repeat { acked: u64::MAX }
        );
        assert_eq!(e.accept("s", 0), EventDecision::Repeat { acked: u64::MAX });
    }
}

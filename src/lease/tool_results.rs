//! Exactly-once delivery of tool results, as a sans-IO state machine.
//!
//! The executor sends `tool.result` until the harness acknowledges it, so
//! the same `toolCallId` can arrive many times (a resend after a reconnect,
//! a retry whose answer was lost). The platform must see it once: the first
//! result goes to every waiter of that call and to the event stream;
//! repeats are acknowledged and dropped. A result may also arrive before
//! anyone waits for it (the call was sent, the API caller asked again with
//! the same id), so delivered results are remembered: the newest `kept` per
//! session in full, older ones by id only (a wait for those is refused
//! rather than run twice).
//!
//! `W` is the waiter (a oneshot sender in the harness, a number in tests),
//! `R` the result. Nothing here does I/O: the caller sends what the calls
//! return.

use std::collections::{BTreeMap, HashMap, VecDeque};

/// What is known of a tool call id in a session.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup<'a, R> {
    /// Not delivered yet: a waiter may wait for it.
    Pending,
    /// Delivered, and the result is still kept.
    Delivered(&'a R),
    /// Delivered long ago; only the id is remembered.
    Forgotten,
}

/// What to do with an arriving result.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery<W, R> {
    /// The first result for this id: send it to each waiter and publish it.
    Deliver { waiters: Vec<W>, result: R },
    /// Already delivered: acknowledge, deliver nothing.
    Duplicate,
}

#[derive(Debug)]
struct SessionTools<W, R> {
    waiters: BTreeMap<String, Vec<W>>,
    /// Every delivered id; the result itself only for the newest `kept`.
    delivered: HashMap<String, Option<R>>,
    /// Delivered ids whose result is still kept, oldest first.
    order: VecDeque<String>,
}

impl<W, R> Default for SessionTools<W, R> {
    fn default() -> Self {
        Self {
            waiters: BTreeMap::new(),
            delivered: HashMap::new(),
            order: VecDeque::new(),
        }
    }
}

/// Tool waiters and delivered results, per session.
///
/// Invariants (checked by `tests/harness/cores.rs`): a result is returned
/// in [`Delivery::Deliver`] at most once per (session, id) for the life of
/// the session's entry; every waiter is handed back exactly once (with the
/// result, by [`end`](Self::end), or by [`retain_waiters`](Self::retain_waiters));
/// at most `kept` results are held per session.
#[derive(Debug)]
pub struct ToolResults<W, R> {
    kept: usize,
    sessions: BTreeMap<String, SessionTools<W, R>>,
}

impl<W, R: Clone> ToolResults<W, R> {
    /// Keep the newest `kept` results per session in full (at least one).
    pub fn new(kept: usize) -> Self {
        Self {
            kept: kept.max(1),
            sessions: BTreeMap::new(),
        }
    }

    pub fn lookup(&self, session_id: &str, call_id: &str) -> Lookup<'_, R> {
        match self
            .sessions
            .get(session_id)
            .and_then(|t| t.delivered.get(call_id))
        {
            None => Lookup::Pending,
            Some(Some(r)) => Lookup::Delivered(r),
            Some(None) => Lookup::Forgotten,
        }
    }

    /// Wait for `call_id`'s result. If it was delivered already the waiter
    /// is handed back with it (`Err`), never queued: a result reaches each
    /// waiter once, whichever came first.
    pub fn wait(
        &mut self,
        session_id: &str,
        call_id: &str,
        waiter: W,
    ) -> Result<(), (W, Option<R>)> {
        match self.lookup(session_id, call_id) {
            Lookup::Delivered(r) => {
                let r = r.clone();
                return Err((waiter, Some(r)));
            }
            Lookup::Forgotten => return Err((waiter, None)),
            Lookup::Pending => {}
        }
        self.sessions
            .entry(session_id.to_owned())
            .or_default()
            .waiters
            .entry(call_id.to_owned())
            .or_default()
            .push(waiter);
        Ok(())
    }

    /// A result arrived: see [`Delivery`].
    pub fn result(&mut self, session_id: &str, call_id: &str, result: R) -> Delivery<W, R> {
        let t = self.sessions.entry(session_id.to_owned()).or_default();
        if t.delivered.contains_key(call_id) {
            return Delivery::Duplicate;
        }
        t.delivered.insert(call_id.to_owned(), Some(result.clone()));
        t.order.push_back(call_id.to_owned());
        while t.order.len() > self.kept {
            if let Some(old) = t.order.pop_front() {
                t.delivered.insert(old, None);
            }
        }
        Delivery::Deliver {
            waiters: t.waiters.remove(call_id).unwrap_or_default(),
            result,
        }
    }

    /// Drop the waiters of `call_id` that `keep` rejects (callers that gave
    /// up); returns them.
    pub fn retain_waiters(
        &mut self,
        session_id: &str,
        call_id: &str,
        keep: impl Fn(&W) -> bool,
    ) -> Vec<W> {
        let Some(t) = self.sessions.get_mut(session_id) else {
            return Vec::new();
        };
        let Some(ws) = t.waiters.remove(call_id) else {
            return Vec::new();
        };
        let (kept, dropped): (Vec<W>, Vec<W>) = ws.into_iter().partition(|w| keep(w));
        if !kept.is_empty() {
            t.waiters.insert(call_id.to_owned(), kept);
        }
        dropped
    }

    /// The session is over (or granted anew): forget it; returns the
    /// waiters still waiting, with their call ids, so the caller fails them
    /// (`tool_outcome_unknown`).
    pub fn end(&mut self, session_id: &str) -> Vec<(String, W)> {
        let Some(t) = self.sessions.remove(session_id) else {
            return Vec::new();
        };
        t.waiters
            .into_iter()
            .flat_map(|(id, ws)| ws.into_iter().map(move |w| (id.clone(), w)))
            .collect()
    }

    /// Waiters of `call_id`.
    pub fn waiting(&self, session_id: &str, call_id: &str) -> usize {
        self.sessions
            .get(session_id)
            .and_then(|t| t.waiters.get(call_id))
            .map_or(0, Vec::len)
    }

    /// Results held in full for the session.
    pub fn results_kept(&self, session_id: &str) -> usize {
        self.sessions
            .get(session_id)
            .map_or(0, |t| t.delivered.values().filter(|r| r.is_some()).count())
    }

    pub fn kept(&self) -> usize {
        self.kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_result_reaches_waiters_once_and_repeats_are_dropped() {
        let mut t: ToolResults<u32, &str> = ToolResults::new(8);
        assert_eq!(t.wait("s", "c", 1), Ok(()));
        assert_eq!(t.wait("s", "c", 2), Ok(()));
        assert_eq!(
            t.result("s", "c", "r"),
            Delivery::Deliver {
                waiters: vec![1, 2],
                result: "r"
            }
        );
        assert_eq!(t.result("s", "c", "r2"), Delivery::Duplicate);
        // A waiter after the fact gets the first result at once.
        assert_eq!(t.wait("s", "c", 3), Err((3, Some("r"))));
    }

    #[test]
    fn old_results_are_remembered_by_id_only() {
        let mut t: ToolResults<u32, u32> = ToolResults::new(2);
        for i in 0..3 {
            let _ = t.result("s", &format!("c{i}"), i);
        }
        assert_eq!(t.results_kept("s"), 2);
        assert_eq!(t.lookup("s", "c0"), Lookup::Forgotten);
        assert_eq!(t.result("s", "c0", 9), Delivery::Duplicate);
        assert_eq!(t.wait("s", "c0", 5), Err((5, None)));
        assert_eq!(t.lookup("s", "c2"), Lookup::Delivered(&2));
    }

    #[test]
    fn end_hands_back_waiters_and_forgets_the_session() {
        let mut t: ToolResults<u32, u32> = ToolResults::new(2);
        t.wait("s", "a", 1).unwrap();
        t.wait("s", "b", 2).unwrap();
        let _ = t.result("s", "z", 0);
        assert_eq!(t.end("s"), vec![("a".into(), 1), ("b".into(), 2)]);
        assert_eq!(t.lookup("s", "z"), Lookup::Pending);
        assert_eq!(t.retain_waiters("s", "a", |_| false), Vec::<u32>::new());
    }

    #[test]
    fn retain_drops_waiters_that_gave_up() {
        let mut t: ToolResults<u32, u32> = ToolResults::new(2);
        t.wait("s", "a", 1).unwrap();
        t.wait("s", "a", 2).unwrap();
        assert_eq!(t.retain_waiters("s", "a", |w| *w == 2), vec![1]);
        assert_eq!(t.waiting("s", "a"), 1);
        assert_eq!(t.retain_waiters("s", "a", |_| false), vec![2]);
        assert_eq!(t.waiting("s", "a"), 0);
    }
}

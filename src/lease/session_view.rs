//! The platform's view of session lifecycles, as a sans-IO state machine.
//!
//! The harness shows a hosting platform one state per session
//! ([`SessionState`]). The rules of how that state moves are protocol rules
//! (an ended session stays ended, an assignment that failed never began, a
//! lost holder makes its sessions `disconnected` until a resume) and live
//! here, apart from the actor that publishes the records, so they can be
//! replayed and property-tested (`tests/harness/cores.rs`).
//!
//! [`SessionViews`] holds only what the rules need (state, executor, fencing
//! token, ended reason) and the waiters of `DELETE /v1/sessions/{id}`
//! (generic `W`, so tests can use plain numbers). Every call returns
//! [`ViewEffect`]s; the caller publishes them (the harness writes its
//! `SessionInfo` records and emits events). Records of ended sessions are
//! kept for the platform to read, up to a bound, oldest forgotten first.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// Where a session is in its life, as the platform sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    /// `session.assign` sent, not answered yet.
    Assigning,
    /// The executor accepted the assignment.
    Active,
    /// The holder connection is lost; the lease waits for a resume.
    Disconnected,
    /// `session.stop` sent, `session.ended` not received yet.
    Stopping,
    /// Over: stopped, ended by the executor, or its lease expired.
    Ended,
}

/// What the rules know of one session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewEntry {
    pub executor_id: String,
    /// The fencing token of the grant the view describes.
    pub fencing_token: u64,
    pub state: SessionState,
    /// Set exactly when `state` is [`SessionState::Ended`].
    pub ended_reason: Option<String>,
}

/// What the caller must publish after a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewEffect<W> {
    /// The session is now in `state` (never [`SessionState::Ended`]: that
    /// is [`ViewEffect::Ended`]).
    State {
        session_id: String,
        state: SessionState,
    },
    /// The executor accepted the grant with this token: tell the platform.
    Assigned {
        session_id: String,
        executor_id: String,
        fencing_token: u64,
    },
    /// The session ended, once: publish it, drop its lease, fail its tool
    /// waiters, and answer these stop waiters with the ended record.
    Ended {
        session_id: String,
        reason: String,
        waiters: Vec<W>,
    },
    /// Forget the record: an ended session past the retention bound, or an
    /// assignment that failed (the session never began for the platform).
    Forget { session_id: String },
}

/// How a stop request starts.
#[derive(Debug, PartialEq, Eq)]
pub enum StopStart<W> {
    /// No such session; the waiter is handed back.
    Unknown(W),
    /// Already over: answer the waiter at once with the ended record.
    AlreadyEnded(W),
    /// The waiter is kept until the session ends; now ask the holder to
    /// stop ([`SessionViews::stopping`]) or, with no live holder, end it.
    Pending,
}

/// Why [`SessionViews::create`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CreateError {
    #[error("the session exists and has not ended")]
    Exists,
}

/// A session to put back when the harness's leases actor is rebuilt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    pub session_id: String,
    pub entry: ViewEntry,
}

/// The lifecycle rules of every session the platform can see.
///
/// Invariants (checked by `tests/harness/cores.rs` after every step):
/// an ended session never moves to another state (only a new `create` of
/// the same id, with a new grant, starts it over); `Ended` is reported once
/// per life; at most `kept` ended sessions are remembered; the retention
/// queue holds exactly the ended sessions; stop waiters exist only for
/// sessions that have not ended, and each is handed back exactly once.
#[derive(Debug)]
pub struct SessionViews<W> {
    kept: usize,
    sessions: BTreeMap<String, ViewEntry>,
    /// Ended sessions, oldest first: the retention queue.
    ended: VecDeque<String>,
    stop_waiters: BTreeMap<String, Vec<W>>,
}

impl<W> SessionViews<W> {
    /// An empty view that remembers at most `ended_kept` ended sessions
    /// (at least one, so a stop can always read what it ended).
    pub fn new(ended_kept: usize) -> Self {
        Self {
            kept: ended_kept.max(1),
            sessions: BTreeMap::new(),
            ended: VecDeque::new(),
            stop_waiters: BTreeMap::new(),
        }
    }

    /// A view rebuilt from published records: ended ones must come oldest
    /// first, so retention keeps forgetting in the same order. Returns the
    /// view and the sessions it forgets at once (beyond the bound).
    pub fn restore(ended_kept: usize, records: Vec<Restored>) -> (Self, Vec<ViewEffect<W>>) {
        let mut v = Self::new(ended_kept);
        for r in records {
            if r.entry.state == SessionState::Ended {
                v.ended.push_back(r.session_id.clone());
            }
            v.sessions.insert(r.session_id, r.entry);
        }
        let mut effects = Vec::new();
        v.evict(&mut effects);
        (v, effects)
    }

    pub fn get(&self, session_id: &str) -> Option<&ViewEntry> {
        self.sessions.get(session_id)
    }

    pub fn state(&self, session_id: &str) -> Option<SessionState> {
        self.sessions.get(session_id).map(|e| e.state)
    }

    /// Every session, by id.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &ViewEntry)> {
        self.sessions.iter()
    }

    /// The ended sessions remembered, oldest first.
    pub fn ended(&self) -> impl Iterator<Item = &String> {
        self.ended.iter()
    }

    pub fn ended_kept(&self) -> usize {
        self.kept
    }

    /// Stop waiters held for `session_id`.
    pub fn stop_waiters(&self, session_id: &str) -> usize {
        self.stop_waiters.get(session_id).map_or(0, Vec::len)
    }

    /// Whether a new session may take this id: unknown, or over.
    pub fn can_create(&self, session_id: &str) -> bool {
        self.state(session_id)
            .is_none_or(|s| s == SessionState::Ended)
    }

    /// A fresh grant: the session is `assigning` under `fencing_token`. An
    /// ended session of the same id starts over (and leaves the retention
    /// queue); a session not over is refused.
    pub fn create(
        &mut self,
        session_id: &str,
        executor_id: &str,
        fencing_token: u64,
    ) -> Result<(), CreateError> {
        if !self.can_create(session_id) {
            return Err(CreateError::Exists);
        }
        self.ended.retain(|s| s != session_id);
        self.sessions.insert(
            session_id.to_owned(),
            ViewEntry {
                executor_id: executor_id.to_owned(),
                fencing_token,
                state: SessionState::Assigning,
                ended_reason: None,
            },
        );
        Ok(())
    }

    /// The executor answered `session.assign` for the grant `fencing_token`.
    /// Answers for an older grant are ignored. Accepted: an `assigning`
    /// session becomes `active` and the platform is told (whatever the
    /// state, as the grant did begin). Refused or unanswered: the session
    /// never began and is forgotten, its stop waiters dropped.
    pub fn assign_answered(
        &mut self,
        session_id: &str,
        fencing_token: u64,
        accepted: bool,
    ) -> Vec<ViewEffect<W>> {
        let Some(e) = self.sessions.get_mut(session_id) else {
            return Vec::new();
        };
        if e.fencing_token != fencing_token {
            return Vec::new();
        }
        let mut effects = Vec::new();
        if accepted {
            if e.state == SessionState::Assigning {
                e.state = SessionState::Active;
                effects.push(ViewEffect::State {
                    session_id: session_id.to_owned(),
                    state: SessionState::Active,
                });
            }
            effects.push(ViewEffect::Assigned {
                session_id: session_id.to_owned(),
                executor_id: e.executor_id.clone(),
                fencing_token,
            });
        } else {
            self.sessions.remove(session_id);
            self.ended.retain(|s| s != session_id);
            self.stop_waiters.remove(session_id);
            effects.push(ViewEffect::Forget {
                session_id: session_id.to_owned(),
            });
        }
        effects
    }

    /// The holder of these sessions was lost: the ones running (or being
    /// assigned or stopped) wait for a resume.
    pub fn disconnected(&mut self, sessions: &[String]) -> Vec<ViewEffect<W>> {
        self.move_all(sessions, SessionState::Disconnected, |s| {
            matches!(
                s,
                SessionState::Active | SessionState::Assigning | SessionState::Stopping
            )
        })
    }

    /// The executor came back and kept these sessions.
    pub fn resumed(&mut self, sessions: &[String]) -> Vec<ViewEffect<W>> {
        self.move_all(sessions, SessionState::Active, |s| {
            s == SessionState::Disconnected
        })
    }

    /// A stop begins: see [`StopStart`].
    pub fn stop_requested(&mut self, session_id: &str, waiter: W) -> StopStart<W> {
        match self.state(session_id) {
            None => StopStart::Unknown(waiter),
            Some(SessionState::Ended) => StopStart::AlreadyEnded(waiter),
            Some(_) => {
                self.stop_waiters
                    .entry(session_id.to_owned())
                    .or_default()
                    .push(waiter);
                StopStart::Pending
            }
        }
    }

    /// `session.stop` is on its way to the live holder.
    pub fn stopping(&mut self, session_id: &str) -> Vec<ViewEffect<W>> {
        self.move_all(&[session_id.to_owned()], SessionState::Stopping, |s| {
            s != SessionState::Ended
        })
    }

    /// The session is over, for `reason`. Only the first end counts; later
    /// ones (a repeated `session.ended`, a late expiry) change nothing.
    /// `now` is when it ended, on the caller's clock (kept for symmetry with
    /// the other cores; retention is by count).
    pub fn end(&mut self, session_id: &str, reason: &str, now: u64) -> Vec<ViewEffect<W>> {
        let _ = now;
        let Some(e) = self.sessions.get_mut(session_id) else {
            return Vec::new();
        };
        if e.state == SessionState::Ended {
            return Vec::new();
        }
        e.state = SessionState::Ended;
        e.ended_reason = Some(reason.to_owned());
        let mut effects = vec![ViewEffect::Ended {
            session_id: session_id.to_owned(),
            reason: reason.to_owned(),
            waiters: self.stop_waiters.remove(session_id).unwrap_or_default(),
        }];
        self.ended.push_back(session_id.to_owned());
        self.evict(&mut effects);
        effects
    }

    /// This harness's copy of a session is stale (over several replicas:
    /// the store's row names a newer grant, `docs/store.md`): forget it at
    /// once, without ending it (nothing is reported, nothing is stopped),
    /// if its grant is `fencing_token` or older. Returns its stop waiters,
    /// or `None` when there was no such copy.
    pub fn supersede(&mut self, session_id: &str, fencing_token: u64) -> Option<Vec<W>> {
        let e = self.sessions.get(session_id)?;
        if e.fencing_token > fencing_token {
            return None;
        }
        self.sessions.remove(session_id);
        self.ended.retain(|s| s != session_id);
        Some(self.stop_waiters.remove(session_id).unwrap_or_default())
    }

    /// The candidate with the fewest sessions not over (ties: by id).
    pub fn least_loaded<'a>(&self, candidates: impl Iterator<Item = &'a str>) -> Option<String> {
        let mut load: BTreeMap<&str, usize> = candidates.map(|c| (c, 0)).collect();
        for e in self.sessions.values() {
            if e.state != SessionState::Ended {
                if let Some(n) = load.get_mut(e.executor_id.as_str()) {
                    *n += 1;
                }
            }
        }
        load.into_iter()
            .min_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(b.0)))
            .map(|(e, _)| e.to_owned())
    }

    fn move_all(
        &mut self,
        sessions: &[String],
        to: SessionState,
        from: impl Fn(SessionState) -> bool,
    ) -> Vec<ViewEffect<W>> {
        let mut effects = Vec::new();
        for s in sessions {
            if let Some(e) = self.sessions.get_mut(s) {
                if e.state != to && from(e.state) {
                    e.state = to;
                    effects.push(ViewEffect::State {
                        session_id: s.clone(),
                        state: to,
                    });
                }
            }
        }
        effects
    }

    fn evict(&mut self, effects: &mut Vec<ViewEffect<W>>) {
        while self.ended.len() > self.kept {
            let Some(old) = self.ended.pop_front() else {
                break;
            };
            if self
                .sessions
                .get(&old)
                .is_some_and(|e| e.state == SessionState::Ended)
            {
                self.sessions.remove(&old);
                effects.push(ViewEffect::Forget { session_id: old });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_session_lives_assigning_active_stopping_ended() {
        let mut v: SessionViews<u32> = SessionViews::new(4);
        assert_eq!(v.create("s", "e", 1), Ok(()));
        assert_eq!(v.create("s", "e", 2), Err(CreateError::Exists));
        assert_eq!(
            v.assign_answered("s", 1, true),
            vec![
                ViewEffect::State {
                    session_id: "s".into(),
                    state: SessionState::Active
                },
                ViewEffect::Assigned {
                    session_id: "s".into(),
                    executor_id: "e".into(),
                    fencing_token: 1
                }
            ]
        );
        assert_eq!(v.stop_requested("s", 7), StopStart::Pending);
        assert_eq!(v.stopping("s").len(), 1);
        assert_eq!(v.state("s"), Some(SessionState::Stopping));
        assert_eq!(
            v.end("s", "stopped", 10),
            vec![ViewEffect::Ended {
                session_id: "s".into(),
                reason: "stopped".into(),
                waiters: vec![7]
            }]
        );
        assert_eq!(v.end("s", "again", 11), vec![]);
        assert_eq!(v.resumed(&ids(&["s"])), vec![]);
        assert_eq!(v.stop_requested("s", 8), StopStart::AlreadyEnded(8));
        assert_eq!(
            v.get("s").and_then(|e| e.ended_reason.clone()),
            Some("stopped".into())
        );
    }

    #[test]
    fn a_failed_assignment_is_forgotten_and_stale_answers_are_ignored() {
        let mut v: SessionViews<u32> = SessionViews::new(4);
        v.create("s", "e", 3).unwrap();
        assert_eq!(v.assign_answered("s", 2, false), vec![]);
        assert_eq!(
            v.assign_answered("s", 3, false),
            vec![ViewEffect::Forget {
                session_id: "s".into()
            }]
        );
        assert_eq!(v.state("s"), None);
    }

    #[test]
    fn retention_forgets_the_oldest_ended_first() {
        let mut v: SessionViews<u32> = SessionViews::new(2);
        for s in ["a", "b", "c"] {
            v.create(s, "e", 1).unwrap();
            v.end(s, "done", 0);
        }
        assert_eq!(v.state("a"), None);
        assert_eq!(v.ended().cloned().collect::<Vec<_>>(), ids(&["b", "c"]));
        // Re-creating an ended id takes it out of the queue.
        v.create("b", "e", 2).unwrap();
        assert_eq!(v.ended().cloned().collect::<Vec<_>>(), ids(&["c"]));
    }

    #[test]
    fn least_loaded_counts_sessions_not_over() {
        let mut v: SessionViews<u32> = SessionViews::new(2);
        v.create("s1", "a", 1).unwrap();
        v.create("s2", "b", 1).unwrap();
        v.end("s2", "done", 0);
        let pick = v.least_loaded(["a", "b"].into_iter());
        assert_eq!(pick.as_deref(), Some("b"));
        assert_eq!(v.least_loaded(std::iter::empty()), None);
    }
}

//! One session's agent interactions (permission questions), as a sans-IO
//! state machine: what is pending for a person to answer, what was
//! resolved and how, and when each pending one expires.
//!
//! An interaction arrives as `interaction.request` from the executor
//! (idempotent by `interactionId`: a resend gets the same answer), is
//! answered by the platform (`POST …/interactions/{id}`, which the harness
//! turns into `interaction.response`), or goes away: the executor cancels
//! it (`interaction.cancel`: the turn was canceled, it expired there), its
//! `expiresAt` passes on the harness's clock, or the session ends. While an
//! answer is on its way to the executor the interaction is `responding`: a
//! second answer is refused, and if the executor cannot be reached it is
//! pending again.
//!
//! Bounded: at most [`InteractionLimits::max_pending`] pending (more are
//! refused, the executor's turn then gets an error it can act on), and the
//! newest [`InteractionLimits::max_resolved`] resolved ones are remembered
//! (for idempotency and to tell "already answered" from "never existed").
//! Times are milliseconds on the caller's monotonic clock.

use crate::wire::types::{InteractionOutcome, InteractionRequestParams};
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};

/// Bounds of one session's interactions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InteractionLimits {
    pub max_pending: usize,
    pub max_resolved: usize,
    /// The longest an interaction may stay pending, whatever its `expiresAt`.
    pub max_ttl_ms: u64,
}

impl Default for InteractionLimits {
    fn default() -> Self {
        InteractionLimits {
            max_pending: 64,
            max_resolved: 256,
            max_ttl_ms: 24 * 3600 * 1000,
        }
    }
}

/// Where an interaction is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InteractionState {
    Pending,
    /// An answer is on its way to the executor.
    Responding,
    Answered,
    Canceled,
    Expired,
}

impl InteractionState {
    pub fn is_resolved(self) -> bool {
        matches!(self, Self::Answered | Self::Canceled | Self::Expired)
    }
}

/// An interaction as the platform sees it (`GET …/interactions`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InteractionView {
    /// The request as the executor sent it (`interactionId`, `turnId`,
    /// `kind`, `toolName`, `toolInput`, `toolUseId`, `scopes`, `expiresAt`…).
    #[serde(flatten)]
    pub request: InteractionRequestParams,
    pub platform_interaction_id: String,
    pub state: InteractionState,
    pub received_at: String,
    /// How it was resolved: the outcome given, or why it went away.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<InteractionOutcome>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

struct Entry {
    view: InteractionView,
    deadline_ms: u64,
}

/// What [`Interactions::request`] decided.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestDecision {
    /// New: pending now (tell subscribers).
    New(Box<InteractionView>),
    /// A resend: the same `platformInteractionId` again, nothing changes.
    Known { platform_interaction_id: String },
    /// Too many pending.
    Full(usize),
}

/// Why an answer cannot be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AnswerError {
    #[error("no such interaction")]
    Unknown,
    #[error("the interaction is already {0:?}")]
    Resolved(InteractionState),
    #[error("an answer to this interaction is already on its way")]
    Busy,
}

/// One session's interactions.
pub struct Interactions {
    limits: InteractionLimits,
    live: BTreeMap<String, Entry>,
    resolved: VecDeque<InteractionView>,
}

impl Interactions {
    pub fn new(limits: InteractionLimits) -> Self {
        Interactions {
            limits,
            live: BTreeMap::new(),
            resolved: VecDeque::new(),
        }
    }

    /// `interaction.request`: `ttl_ms` is what is left until its
    /// `expiresAt` (capped by [`InteractionLimits::max_ttl_ms`]).
    pub fn request(
        &mut self,
        request: InteractionRequestParams,
        platform_interaction_id: String,
        received_at: String,
        now: u64,
        ttl_ms: u64,
    ) -> RequestDecision {
        let id = request.interaction_id.clone();
        if let Some(e) = self.live.get(&id) {
            return RequestDecision::Known {
                platform_interaction_id: e.view.platform_interaction_id.clone(),
            };
        }
        if let Some(v) = self
            .resolved
            .iter()
            .find(|v| v.request.interaction_id == id)
        {
            return RequestDecision::Known {
                platform_interaction_id: v.platform_interaction_id.clone(),
            };
        }
        if self.live.len() >= self.limits.max_pending {
            return RequestDecision::Full(self.limits.max_pending);
        }
        let view = InteractionView {
            request,
            platform_interaction_id,
            state: InteractionState::Pending,
            received_at,
            outcome: None,
            reason: None,
        };
        let deadline_ms = now.saturating_add(ttl_ms.min(self.limits.max_ttl_ms));
        self.live.insert(
            id,
            Entry {
                view: view.clone(),
                deadline_ms,
            },
        );
        RequestDecision::New(Box::new(view))
    }

    /// Begin answering `id`: it is `responding` until
    /// [`answered`](Self::answered) or [`answer_failed`](Self::answer_failed).
    pub fn begin_answer(&mut self, id: &str) -> Result<InteractionView, AnswerError> {
        match self.live.get_mut(id) {
            Some(e) if e.view.state == InteractionState::Responding => Err(AnswerError::Busy),
            Some(e) => {
                e.view.state = InteractionState::Responding;
                Ok(e.view.clone())
            }
            None => match self
                .resolved
                .iter()
                .find(|v| v.request.interaction_id == id)
            {
                Some(v) => Err(AnswerError::Resolved(v.state)),
                None => Err(AnswerError::Unknown),
            },
        }
    }

    /// The executor took the answer: resolved.
    pub fn answered(&mut self, id: &str, outcome: InteractionOutcome) -> Option<InteractionView> {
        self.resolve(id, InteractionState::Answered, Some(outcome), None)
    }

    /// The answer could not be delivered: pending again (unless it was
    /// resolved meanwhile).
    pub fn answer_failed(&mut self, id: &str) {
        if let Some(e) = self.live.get_mut(id) {
            if e.view.state == InteractionState::Responding {
                e.view.state = InteractionState::Pending;
            }
        }
    }

    /// `interaction.cancel` from the executor, the session's end, or an
    /// executor that no longer knows the interaction. `None` when it was
    /// not live (a resend, or unknown).
    pub fn cancel(&mut self, id: &str, reason: &str) -> Option<InteractionView> {
        let state = if reason == "expired" {
            InteractionState::Expired
        } else {
            InteractionState::Canceled
        };
        self.resolve(id, state, None, Some(reason.to_owned()))
    }

    /// Every live interaction goes away with `reason` (the session ended).
    pub fn cancel_all(&mut self, reason: &str) -> Vec<InteractionView> {
        let ids: Vec<String> = self.live.keys().cloned().collect();
        ids.iter()
            .filter_map(|id| self.cancel(id, reason))
            .collect()
    }

    /// Interactions whose deadline passed: expired (an answer on its way
    /// is left to finish: the executor decides).
    pub fn tick(&mut self, now: u64) -> Vec<InteractionView> {
        let due: Vec<String> = self
            .live
            .iter()
            .filter(|(_, e)| e.deadline_ms <= now && e.view.state == InteractionState::Pending)
            .map(|(id, _)| id.clone())
            .collect();
        due.iter()
            .filter_map(|id| {
                self.resolve(
                    id,
                    InteractionState::Expired,
                    None,
                    Some("expired".to_owned()),
                )
            })
            .collect()
    }

    /// When the next pending interaction expires.
    pub fn next_deadline(&self) -> Option<u64> {
        self.live
            .values()
            .filter(|e| e.view.state == InteractionState::Pending)
            .map(|e| e.deadline_ms)
            .min()
    }

    /// Pending (and responding) interactions, oldest deadline first.
    pub fn pending(&self) -> Vec<InteractionView> {
        let mut v: Vec<&Entry> = self.live.values().collect();
        v.sort_by(|a, b| {
            a.deadline_ms.cmp(&b.deadline_ms).then_with(|| {
                a.view
                    .request
                    .interaction_id
                    .cmp(&b.view.request.interaction_id)
            })
        });
        v.into_iter().map(|e| e.view.clone()).collect()
    }

    /// One interaction, live or remembered.
    pub fn get(&self, id: &str) -> Option<InteractionView> {
        self.live.get(id).map(|e| e.view.clone()).or_else(|| {
            self.resolved
                .iter()
                .find(|v| v.request.interaction_id == id)
                .cloned()
        })
    }

    fn resolve(
        &mut self,
        id: &str,
        state: InteractionState,
        outcome: Option<InteractionOutcome>,
        reason: Option<String>,
    ) -> Option<InteractionView> {
        let mut e = self.live.remove(id)?;
        e.view.state = state;
        e.view.outcome = outcome;
        e.view.reason = reason;
        if self.resolved.len() >= self.limits.max_resolved {
            self.resolved.pop_front();
        }
        self.resolved.push_back(e.view.clone());
        Some(e.view)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::types::{InteractionKind, InteractionScope};
    use proptest::prelude::*;

    fn req(id: &str) -> InteractionRequestParams {
        InteractionRequestParams {
            session_id: "s".into(),
            turn_id: "t".into(),
            interaction_id: id.into(),
            kind: InteractionKind::Permission,
            tool_name: Some("write a file".into()),
            tool_input: None,
            tool_use_id: Some("tc".into()),
            question: None,
            scopes: vec![InteractionScope::Once, InteractionScope::Session],
            expires_at: "2030-01-01T00:00:00Z".into(),
        }
    }

    fn add(i: &mut Interactions, id: &str, now: u64, ttl: u64) -> RequestDecision {
        i.request(req(id), format!("p-{id}"), "t0".into(), now, ttl)
    }

    #[test]
    fn lifecycle() {
        let mut i = Interactions::new(InteractionLimits {
            max_pending: 2,
            ..Default::default()
        });
        assert!(matches!(add(&mut i, "a", 0, 100), RequestDecision::New(_)));
        assert_eq!(
            add(&mut i, "a", 5, 100),
            RequestDecision::Known {
                platform_interaction_id: "p-a".into()
            }
        );
        assert!(matches!(add(&mut i, "b", 0, 50), RequestDecision::New(_)));
        assert_eq!(add(&mut i, "c", 0, 50), RequestDecision::Full(2));
        assert_eq!(i.next_deadline(), Some(50));
        assert_eq!(
            i.begin_answer("a").unwrap().state,
            InteractionState::Responding
        );
        assert_eq!(i.begin_answer("a").unwrap_err(), AnswerError::Busy);
        i.answer_failed("a");
        i.begin_answer("a").unwrap();
        let v = i.answered("a", InteractionOutcome::Allow).unwrap();
        assert_eq!(v.state, InteractionState::Answered);
        assert_eq!(
            i.begin_answer("a").unwrap_err(),
            AnswerError::Resolved(InteractionState::Answered)
        );
        assert_eq!(i.begin_answer("zz").unwrap_err(), AnswerError::Unknown);
        assert_eq!(i.tick(49), vec![]);
        let expired = i.tick(50);
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].state, InteractionState::Expired);
        assert_eq!(i.next_deadline(), None);
        assert!(i.cancel("b", "turn_canceled").is_none());
        assert!(matches!(add(&mut i, "d", 0, 10), RequestDecision::New(_)));
        let gone = i.cancel_all("session_ended");
        assert_eq!(gone[0].state, InteractionState::Canceled);
        assert!(i.pending().is_empty());
    }

    proptest! {
        /// Whatever happens, every interaction is resolved at most once,
        /// pending and remembered stay bounded, and a resolved one never
        /// comes back to pending.
        #[test]
        fn resolved_once_and_bounded(ops in proptest::collection::vec((0u8..6, 0usize..6, 0u64..100), 1..200)) {
            let limits = InteractionLimits { max_pending: 3, max_resolved: 4, max_ttl_ms: 1000 };
            let mut i = Interactions::new(limits);
            let mut now = 0;
            let mut resolutions: BTreeMap<String, usize> = BTreeMap::new();
            let mut news: BTreeMap<String, usize> = BTreeMap::new();
            for (kind, id, t) in ops {
                let id = format!("i{id}");
                now += t;
                let resolved: Vec<InteractionView> = match kind {
                    0 => {
                        if let RequestDecision::New(_) = add(&mut i, &id, now, t * 10) {
                            *news.entry(id.clone()).or_default() += 1;
                        }
                        vec![]
                    }
                    1 => { let _ = i.begin_answer(&id); vec![] }
                    2 => i.answered(&id, InteractionOutcome::Deny).into_iter().collect(),
                    3 => { i.answer_failed(&id); vec![] }
                    4 => i.cancel(&id, "turn_canceled").into_iter().collect(),
                    _ => i.tick(now),
                };
                for v in resolved {
                    prop_assert!(v.state.is_resolved());
                    *resolutions.entry(v.request.interaction_id.clone()).or_default() += 1;
                }
                prop_assert!(i.pending().len() <= 3);
                prop_assert!(i.resolved.len() <= 4);
                for v in i.pending() {
                    prop_assert!(!v.state.is_resolved());
                    // Resolved ones still remembered are not live again.
                    prop_assert!(!i.resolved.iter().any(|r| r.request.interaction_id == v.request.interaction_id));
                }
            }
            // Each interaction is resolved at most once (an id comes back
            // as new only once it was forgotten).
            for (id, n) in resolutions {
                prop_assert!(n <= news.get(&id).copied().unwrap_or(0));
            }
        }
    }
}

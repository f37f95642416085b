//! Local confirmation of tool calls (issue 20): `tool.call.permission.mode`
//! `always_ask` holds a call until a person at the executor's machine
//! allows or denies it.
//!
//! The rules live here as a sans-IO [`Book`]: the pending set, one entry per
//! `(sessionId, toolCallId)` so a repeated `tool.call` never asks twice,
//! deadlines against an explicit `now`, answers and expiry. The actor in
//! `actors::confirm` drives it: it feeds asks, answers and ticks in and
//! executes what comes out (a decision sent to the waiting tool call).
//!
//! The person answers over a Unix socket (see [`socket_path`]) that only
//! the executor's own user can reach: the socket lives in a 0700 directory,
//! is itself 0600, and every peer's `SO_PEERCRED` uid must equal the
//! executor's effective uid. The trust boundary is the local account that
//! runs the executor (docs/security.md). The protocol on the socket is
//! line-delimited JSON ([`LocalRequest`] → [`LocalResponse`]), one request
//! per line, each line at most [`MAX_LINE`] bytes. `{"op":"watch"}` turns a
//! connection into a feed of the pending list (at most [`MAX_WATCHERS`]
//! at once): what `bmx visor` follows to ask the person in its own UI.

use crate::wire::types::Permission;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a call waits for a person when the call sets no shorter
/// `deadlineMs`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Calls waiting at once, over all sessions; one more is refused at once
/// (`local_confirmation_unavailable`) instead of growing the set.
pub const MAX_PENDING: usize = 256;
/// The longest line either side of the local socket reads.
pub const MAX_LINE: usize = 16 * 1024;
/// Connections watching the list at once; they do not count against the
/// request connections, so `bmx confirm` always gets through.
pub const MAX_WATCHERS: usize = 4;
/// The longest answer line the client reads (a full list of summaries).
pub const MAX_ANSWER_LINE: usize = 2 << 20;
/// How much of a call's input the person is shown (JSON, cut at a char
/// boundary): enough to judge a command, bounded so the list stays small.
pub const SUMMARY_MAX: usize = 2048;

/// The socket of the executor whose work root is `work_root`:
/// `<work_root>/confirm/confirm.sock`. The directory is created 0700 so
/// nobody else can even reach the socket between its bind and its chmod.
pub fn socket_path(work_root: &Path) -> PathBuf {
    work_root.join("confirm").join("confirm.sock")
}

/// `tool.call.permission.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    AlwaysAllow,
    AlwaysAsk,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::AlwaysAllow => "always_allow",
            Mode::AlwaysAsk => "always_ask",
        }
    }

    /// # Errors
    /// [`UnknownMode`] for anything but the two names.
    pub fn parse(s: &str) -> Result<Mode, UnknownMode> {
        match s {
            "always_allow" => Ok(Mode::AlwaysAllow),
            "always_ask" => Ok(Mode::AlwaysAsk),
            other => Err(UnknownMode(other.chars().take(64).collect())),
        }
    }
}

/// A permission mode this executor does not know (-32602).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown permission mode {0:?}: expected always_allow or always_ask")]
pub struct UnknownMode(pub String);

/// The mode a call runs under: the call's own (`always_allow` when it
/// names none), or `always_ask` whatever it says when the operator started
/// the executor with `--confirm always`. A mode that does not parse is an
/// error even then: a harness bug is reported, not hidden.
///
/// # Errors
/// [`UnknownMode`].
pub fn effective_mode(
    permission: Option<&Permission>,
    confirm_always: bool,
) -> Result<Mode, UnknownMode> {
    let asked = match permission {
        Some(p) => Mode::parse(&p.mode)?,
        None => Mode::AlwaysAllow,
    };
    Ok(if confirm_always {
        Mode::AlwaysAsk
    } else {
        asked
    })
}

/// How long a call may wait: [`DEFAULT_TIMEOUT`] (or the configured one),
/// never past the call's own `deadlineMs`.
pub fn wait_for(configured: Duration, deadline_ms: Option<u64>) -> Duration {
    match deadline_ms {
        Some(ms) => configured.min(Duration::from_millis(ms)),
        None => configured,
    }
}

/// What became of a call that asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Allowed,
    Denied,
    /// Nobody answered before the deadline.
    Expired,
    /// The call was canceled (tool.cancel, session.stop) while waiting.
    Withdrawn,
    /// Nobody can answer: no socket, or the pending set is full.
    Unavailable,
}

impl Decision {
    /// `tool.result.reason` of a call that did not run.
    pub fn reason(self) -> Option<&'static str> {
        match self {
            Decision::Allowed | Decision::Withdrawn => None,
            Decision::Denied => Some("local_confirmation_denied"),
            Decision::Expired => Some("local_confirmation_expired"),
            Decision::Unavailable => Some("local_confirmation_unavailable"),
        }
    }
}

/// One call, as the session knows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub session_id: String,
    pub tool_call_id: String,
}

/// What the person is asked about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub key: Key,
    pub tool: String,
    /// The input, as JSON cut to [`SUMMARY_MAX`] (see [`summarize`]).
    pub summary: String,
}

/// The input as the person sees it.
pub fn summarize(input: &serde_json::Value) -> String {
    let mut s = serde_json::to_string(input).unwrap_or_default();
    if s.len() > SUMMARY_MAX {
        let mut cut = SUMMARY_MAX;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

struct Pending {
    request: Request,
    deadline: Instant,
}

/// The answer to an ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    /// The confirmation's id, what `bmx confirm allow|deny` names.
    pub id: String,
    /// `false`: the call was already pending (a repeated `tool.call`); no
    /// second confirmation was created and the first deadline stands.
    pub fresh: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AskError {
    #[error("{MAX_PENDING} confirmations are already pending")]
    Full,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnswerError {
    #[error("no pending confirmation {0:?}")]
    Unknown(String),
    #[error("confirmation {0:?} expired")]
    Expired(String),
}

/// The pending set. No I/O and no clock: every verb takes `now`.
pub struct Book {
    pending: BTreeMap<String, Pending>,
    by_key: HashMap<Key, String>,
    next: u64,
    max: usize,
}

impl Default for Book {
    fn default() -> Self {
        Self::new(MAX_PENDING)
    }
}

impl Book {
    pub fn new(max: usize) -> Self {
        Book {
            pending: BTreeMap::new(),
            by_key: HashMap::new(),
            next: 1,
            max,
        }
    }

    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Hold `request` until `now + wait`. A key already pending keeps its
    /// one entry and its first deadline.
    ///
    /// # Errors
    /// [`AskError::Full`] past the bound.
    pub fn ask(
        &mut self,
        now: Instant,
        request: Request,
        wait: Duration,
    ) -> Result<Asked, AskError> {
        if let Some(id) = self.by_key.get(&request.key) {
            return Ok(Asked {
                id: id.clone(),
                fresh: false,
            });
        }
        if self.pending.len() >= self.max {
            return Err(AskError::Full);
        }
        let id = format!("c{}", self.next);
        self.next += 1;
        self.by_key.insert(request.key.clone(), id.clone());
        self.pending.insert(
            id.clone(),
            Pending {
                request,
                deadline: now + wait,
            },
        );
        Ok(Asked { id, fresh: true })
    }

    /// A person's answer (allow or deny: the book only needs to know the
    /// entry is resolved; the driver tells the call which). An entry whose deadline has passed cannot be
    /// answered any more (it is left for [`Book::expire`]).
    ///
    /// # Errors
    /// [`AnswerError`] for an unknown or expired id.
    pub fn answer(&mut self, now: Instant, id: &str) -> Result<Key, AnswerError> {
        let Some(p) = self.pending.get(id) else {
            return Err(AnswerError::Unknown(id.chars().take(64).collect()));
        };
        if p.deadline <= now {
            return Err(AnswerError::Expired(id.to_owned()));
        }
        let p = self.pending.remove(id).expect("present");
        self.by_key.remove(&p.request.key);
        Ok(p.request.key)
    }

    /// The call went away (canceled, session stopped): its entry goes.
    pub fn withdraw(&mut self, key: &Key) -> Option<String> {
        let id = self.by_key.remove(key)?;
        self.pending.remove(&id);
        Some(id)
    }

    /// Every entry whose deadline is `now` or earlier, removed.
    pub fn expire(&mut self, now: Instant) -> Vec<(String, Key)> {
        let due: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        due.into_iter()
            .filter_map(|id| {
                let p = self.pending.remove(&id)?;
                self.by_key.remove(&p.request.key);
                Some((id, p.request.key))
            })
            .collect()
    }

    /// When the next entry expires (the one timer the driver arms).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.values().map(|p| p.deadline).min()
    }

    /// What `bmx confirm ls` shows, oldest first.
    pub fn list(&self, now: Instant) -> Vec<PendingView> {
        let mut v: Vec<(u64, PendingView)> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline > now)
            .map(|(id, p)| {
                (
                    id[1..].parse().unwrap_or(u64::MAX),
                    PendingView {
                        id: id.clone(),
                        session_id: p.request.key.session_id.clone(),
                        tool_call_id: p.request.key.tool_call_id.clone(),
                        tool: p.request.tool.clone(),
                        input: p.request.summary.clone(),
                        expires_in_ms: p.deadline.saturating_duration_since(now).as_millis() as u64,
                    },
                )
            })
            .collect();
        v.sort_by_key(|(n, _)| *n);
        v.into_iter().map(|(_, p)| p).collect()
    }
}

/// One request on the local socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum LocalRequest {
    List,
    Answer {
        id: String,
        decision: LocalDecision,
    },
    /// Turn this connection into a feed: the list now, then again each
    /// time a confirmation is added or resolved, until the client closes.
    /// What `bmx visor` watches to show them as `request` events.
    Watch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LocalDecision {
    Allow,
    Deny,
}

/// A pending confirmation as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingView {
    pub id: String,
    pub session_id: String,
    pub tool_call_id: String,
    pub tool: String,
    /// The call's input as JSON, cut to [`SUMMARY_MAX`] bytes.
    pub input: String,
    pub expires_in_ms: u64,
}

/// One answer line on the local socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LocalResponse {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<Vec<PendingView>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<LocalError>,
}

/// Why a local request failed: `bad_request`, `too_large`, `unknown_id`,
/// `expired`, `forbidden`, `unavailable`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalError {
    pub code: String,
    pub message: String,
}

impl LocalResponse {
    pub fn list(pending: Vec<PendingView>) -> Self {
        LocalResponse {
            ok: true,
            pending: Some(pending),
            answered: None,
            error: None,
        }
    }

    pub fn answered(id: String) -> Self {
        LocalResponse {
            ok: true,
            pending: None,
            answered: Some(id),
            error: None,
        }
    }

    pub fn error(code: &str, message: impl Into<String>) -> Self {
        LocalResponse {
            ok: false,
            pending: None,
            answered: None,
            error: Some(LocalError {
                code: code.into(),
                message: message.into(),
            }),
        }
    }

    pub fn line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|_| {
            r#"{"ok":false,"error":{"code":"internal","message":"encode"}}"#.into()
        });
        s.push('\n');
        s
    }
}

/// The client side (`bmx confirm`, tests): one request, one answer, over
/// a fresh connection, within `timeout`.
pub mod client {
    use super::{LocalRequest, LocalResponse, MAX_ANSWER_LINE};
    use std::path::Path;
    use std::time::Duration;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

    #[derive(Debug, thiserror::Error)]
    pub enum ClientError {
        #[error("cannot reach the executor at {path}: {source}")]
        Connect {
            path: String,
            source: std::io::Error,
        },
        #[error("the executor did not answer: {0}")]
        Io(#[from] std::io::Error),
        #[error("the executor did not answer within {0:?}")]
        Timeout(Duration),
        #[error("the executor's answer is not valid: {0}")]
        Invalid(String),
    }

    /// # Errors
    /// [`ClientError`] when the socket cannot be reached or answers badly.
    pub async fn request(
        path: &Path,
        request: &LocalRequest,
        timeout: Duration,
    ) -> Result<LocalResponse, ClientError> {
        let work = async {
            let mut s = tokio::net::UnixStream::connect(path)
                .await
                .map_err(|source| ClientError::Connect {
                    path: path.display().to_string(),
                    source,
                })?;
            let mut line =
                serde_json::to_string(request).map_err(|e| ClientError::Invalid(e.to_string()))?;
            line.push('\n');
            s.write_all(line.as_bytes()).await?;
            let mut r = BufReader::new(s).take(MAX_ANSWER_LINE as u64 + 1);
            let mut buf = Vec::new();
            r.read_until(b'\n', &mut buf).await?;
            if buf.len() > MAX_ANSWER_LINE {
                return Err(ClientError::Invalid("answer too long".into()));
            }
            serde_json::from_slice(&buf).map_err(|e| ClientError::Invalid(e.to_string()))
        };
        tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| ClientError::Timeout(timeout))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(s: &str, c: &str) -> Request {
        Request {
            key: Key {
                session_id: s.into(),
                tool_call_id: c.into(),
            },
            tool: "bash".into(),
            summary: "{}".into(),
        }
    }

    #[test]
    fn modes_parse_and_confirm_always_wins() {
        let p = |m: &str| Permission { mode: m.into() };
        assert_eq!(effective_mode(None, false), Ok(Mode::AlwaysAllow));
        assert_eq!(
            effective_mode(Some(&p("always_ask")), false),
            Ok(Mode::AlwaysAsk)
        );
        assert_eq!(
            effective_mode(Some(&p("always_allow")), true),
            Ok(Mode::AlwaysAsk)
        );
        assert_eq!(effective_mode(None, true), Ok(Mode::AlwaysAsk));
        assert!(effective_mode(Some(&p("sometimes")), true).is_err());
        assert!(effective_mode(Some(&p("")), false).is_err());
    }

    #[test]
    fn the_wait_is_bounded_by_the_call_deadline() {
        assert_eq!(wait_for(DEFAULT_TIMEOUT, None), DEFAULT_TIMEOUT);
        assert_eq!(
            wait_for(DEFAULT_TIMEOUT, Some(300)),
            Duration::from_millis(300)
        );
        assert_eq!(wait_for(DEFAULT_TIMEOUT, Some(600_000)), DEFAULT_TIMEOUT);
    }

    #[test]
    fn a_repeated_ask_keeps_one_entry_and_its_first_deadline() {
        let t0 = Instant::now();
        let mut b = Book::new(4);
        let a = b.ask(t0, req("s", "c"), Duration::from_secs(1)).unwrap();
        assert!(a.fresh);
        let again = b
            .ask(
                t0 + Duration::from_millis(900),
                req("s", "c"),
                Duration::from_secs(1),
            )
            .unwrap();
        assert_eq!(
            again,
            Asked {
                id: a.id.clone(),
                fresh: false
            }
        );
        assert_eq!(b.len(), 1);
        assert_eq!(b.expire(t0 + Duration::from_secs(1)).len(), 1);
    }

    #[test]
    fn an_expired_entry_cannot_be_answered() {
        let t0 = Instant::now();
        let mut b = Book::new(4);
        let a = b.ask(t0, req("s", "c"), Duration::from_secs(1)).unwrap();
        let late = t0 + Duration::from_secs(2);
        assert!(matches!(
            b.answer(late, &a.id),
            Err(AnswerError::Expired(_))
        ));
        assert_eq!(b.list(late), vec![]);
        assert_eq!(b.expire(late).len(), 1);
        assert!(matches!(
            b.answer(late, &a.id),
            Err(AnswerError::Unknown(_))
        ));
    }

    #[test]
    fn the_book_is_bounded() {
        let t0 = Instant::now();
        let mut b = Book::new(2);
        b.ask(t0, req("s", "a"), Duration::from_secs(1)).unwrap();
        b.ask(t0, req("s", "b"), Duration::from_secs(1)).unwrap();
        assert_eq!(
            b.ask(t0, req("s", "c"), Duration::from_secs(1)),
            Err(AskError::Full)
        );
        // A repeat of a pending call is not a new entry, even when full.
        assert!(b.ask(t0, req("s", "a"), Duration::from_secs(1)).is_ok());
    }

    #[test]
    fn summaries_are_bounded_at_a_char_boundary() {
        let long = serde_json::json!({"command": "é".repeat(SUMMARY_MAX)});
        let s = summarize(&long);
        assert!(s.len() <= SUMMARY_MAX + '…'.len_utf8(), "{}", s.len());
        assert!(s.ends_with('…'));
    }

    #[test]
    fn local_requests_round_trip() {
        let r: LocalRequest =
            serde_json::from_str(r#"{"op":"answer","id":"c1","decision":"deny"}"#).unwrap();
        assert_eq!(
            r,
            LocalRequest::Answer {
                id: "c1".into(),
                decision: LocalDecision::Deny
            }
        );
        assert!(serde_json::from_str::<LocalRequest>(r#"{"op":"rm"}"#).is_err());
        assert!(serde_json::from_str::<LocalRequest>(
            r#"{"op":"answer","id":"c1","decision":"maybe"}"#
        )
        .is_err());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Ask(u8, u64),
        Answer(u8),
        Withdraw(u8),
        Advance(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..6, 1u64..2_000).prop_map(|(k, w)| Op::Ask(k, w)),
            (0u8..10).prop_map(Op::Answer),
            (0u8..6).prop_map(Op::Withdraw),
            (0u64..1_500).prop_map(Op::Advance),
        ]
    }

    proptest! {
        /// Against a model: every key resolves at most once (answered,
        /// withdrawn or expired, never two of them), at most one entry per
        /// key, nothing answerable past its deadline, the bound holds and
        /// the timer is the earliest deadline.
        #[test]
        fn the_book_matches_its_model(ops in proptest::collection::vec(op(), 1..80)) {
            let t0 = Instant::now();
            let mut now = t0;
            let mut b = Book::new(4);
            // key -> (id, deadline) of the model
            let mut model: HashMap<u8, (String, Instant)> = HashMap::new();
            let mut resolved: HashMap<String, u32> = HashMap::new();
            for op in ops {
                // The driver expires before every input.
                for (id, _) in b.expire(now) {
                    *resolved.entry(id).or_default() += 1;
                }
                model.retain(|_, (_, d)| *d > now);
                match op {
                    Op::Ask(k, w) => {
                        let r = b.ask(now, req("s", &k.to_string()), Duration::from_millis(w));
                        match model.get(&k) {
                            Some((id, _)) => prop_assert_eq!(r, Ok(Asked { id: id.clone(), fresh: false })),
                            None if model.len() >= 4 => prop_assert_eq!(r, Err(AskError::Full)),
                            None => {
                                let a = r.unwrap();
                                prop_assert!(a.fresh);
                                prop_assert!(!resolved.contains_key(&a.id), "ids are never reused");
                                model.insert(k, (a.id, now + Duration::from_millis(w)));
                            }
                        }
                    }
                    Op::Answer(i) => {
                        let id = format!("c{i}");
                        let owner = model.iter().find(|(_, (mid, _))| *mid == id).map(|(k, _)| *k);
                        match (b.answer(now, &id), owner) {
                            (Ok(key), Some(k)) => {
                                prop_assert_eq!(key.tool_call_id, k.to_string());
                                model.remove(&k);
                                *resolved.entry(id).or_default() += 1;
                            }
                            (Err(AnswerError::Unknown(_)), None) => {}
                            (r, o) => prop_assert!(false, "answer {:?} with model {:?}", r, o),
                        }
                    }
                    Op::Withdraw(k) => {
                        let r = b.withdraw(&req("s", &k.to_string()).key);
                        match model.remove(&k) {
                            Some((id, _)) => {
                                prop_assert_eq!(r, Some(id.clone()));
                                *resolved.entry(id).or_default() += 1;
                            }
                            None => prop_assert_eq!(r, None),
                        }
                    }
                    Op::Advance(ms) => now += Duration::from_millis(ms),
                }
                prop_assert_eq!(b.len(), model.len());
                prop_assert!(b.len() <= 4);
                prop_assert_eq!(b.next_deadline(), model.values().map(|(_, d)| *d).min());
                prop_assert!(b.list(now).iter().all(|p| p.expires_in_ms > 0));
                prop_assert!(resolved.values().all(|n| *n == 1), "{:?}", resolved);
            }
        }
    }
}

//! Agent turns for a platform (docs/agents.md): start a turn, send more
//! input to it, cancel it, follow the session's event stream, and answer
//! the agent's permission questions. The HTTP routes of
//! `/v1/sessions/{id}/turns`, `/events` and `/interactions` are a thin layer
//! over these calls.
//!
//! The executor is the authority on turns (one at a time per session,
//! unknown turn, finished turn): its JSON-RPC errors come back as they are,
//! with the HTTP status of their code. The harness is the authority on the
//! event stream (sequence, retention, subscribers) and on which
//! interactions are still pending.

use super::sessions::Session;
use crate::harness::actors::turns::{ensure, Subscription, TurnsMsg};
use crate::harness::error::ApiError;
use crate::harness::events::Item;
use crate::harness::interactions::{AnswerError, InteractionView};
use crate::wire::types::{
    InteractionKind, InteractionOutcome, InteractionResponseParams, InteractionScope, JsonMap,
    TurnCancelParams, TurnCancelResult, TurnConfig, TurnInputItem, TurnInputParams, TurnInputType,
    TurnStartParams, TurnStartResult,
};
use crate::wire::{ErrorCode, Method, RpcError};
use futures_util::Stream;
use ractor::ActorRef;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Items of one turn input at most.
pub const MAX_INPUT_ITEMS: usize = 64;
/// Ids a client may choose (`turnId`, `inputId`): at most this long.
pub const MAX_CLIENT_ID_LEN: usize = 128;
/// Bytes of a `denyMessage`, and of `answers` as JSON, at most.
pub const MAX_DENY_MESSAGE: usize = 4 << 10;
pub const MAX_ANSWERS_BYTES: usize = 64 << 10;
/// How long a call waits for the session's stream actor.
const ACTOR_WAIT: Duration = Duration::from_secs(10);

/// A turn's input: plain text, or items (PROTOCOL.md §10 `input`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TurnInput {
    Text(String),
    Items(Vec<TurnInputItem>),
}

impl From<&str> for TurnInput {
    fn from(s: &str) -> Self {
        TurnInput::Text(s.to_owned())
    }
}

/// `POST /v1/sessions/{id}/turns`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StartTurn {
    pub input: TurnInput,
    /// `agent` (which of the executor's agents; default its first),
    /// `model`, `cwd`, `permissionMode`, `system`, `thinkingLevel`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<TurnConfig>,
    /// Idempotency key (default: a fresh `turn-<uuid>`): the same id again
    /// gets the executor's same answer, no second turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<String>,
    /// Resume the agent's own session (from an earlier answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_session_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<JsonMap>,
}

impl StartTurn {
    pub fn new(input: impl Into<TurnInput>) -> Self {
        StartTurn {
            input: input.into(),
            config: None,
            turn_id: None,
            executor_session_ref: None,
            deadline_ms: None,
            metadata: None,
        }
    }
}

/// The executor's answer to `turn.start`, with the ids the harness minted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnStarted {
    pub turn_id: String,
    pub input_id: String,
    pub accepted: bool,
    #[serde(default)]
    pub effective: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_session_ref: Option<String>,
    pub resumed: bool,
}

/// `POST /v1/sessions/{id}/turns/{turnId}/input`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MoreInput {
    pub input: TurnInput,
    /// Idempotency key (default: a fresh `in-<uuid>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_id: Option<String>,
}

/// `POST /v1/sessions/{id}/turns/{turnId}/cancel`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CancelTurn {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `POST /v1/sessions/{id}/interactions/{interactionId}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InteractionAnswer {
    /// `allow` or `deny` for a permission; `answered` (with `answers`) or
    /// `deny` for a question.
    pub outcome: InteractionOutcome,
    /// `once` or `session` (one of the request's `scopes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<InteractionScope>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answers: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny_message: Option<String>,
}

fn client_id(what: &str, id: Option<String>, prefix: &str) -> Result<String, ApiError> {
    match id {
        None => Ok(format!("{prefix}-{}", uuid::Uuid::new_v4().simple())),
        Some(id)
            if !id.is_empty()
                && id.len() <= MAX_CLIENT_ID_LEN
                && !id.chars().any(char::is_control) =>
        {
            Ok(id)
        }
        Some(_) => Err(ApiError::bad_request(format!(
            "{what} must be 1 to {MAX_CLIENT_ID_LEN} characters, no control characters"
        ))),
    }
}

/// The input as items, checked: at least one, at most [`MAX_INPUT_ITEMS`],
/// text items with text, file items with a `fileId`.
fn items(input: TurnInput) -> Result<Vec<TurnInputItem>, ApiError> {
    let items = match input {
        TurnInput::Text(text) => vec![TurnInputItem {
            kind: TurnInputType::Text,
            text: Some(text),
            file_id: None,
            name: None,
            mime_type: None,
            size_bytes: None,
        }],
        TurnInput::Items(items) => items,
    };
    if items.is_empty() || items.len() > MAX_INPUT_ITEMS {
        return Err(ApiError::bad_request(format!(
            "input must hold 1 to {MAX_INPUT_ITEMS} items"
        )));
    }
    for (i, item) in items.iter().enumerate() {
        let ok = match item.kind {
            TurnInputType::Text => item.text.as_deref().is_some_and(|t| !t.is_empty()),
            TurnInputType::File => item.file_id.as_deref().is_some_and(|f| !f.is_empty()),
        };
        if !ok {
            return Err(ApiError::bad_request(format!(
                "input[{i}]: a text item needs text, a file item a fileId"
            )));
        }
    }
    Ok(items)
}

fn stream_unavailable() -> ApiError {
    ApiError::with_status(
        503,
        RpcError::internal("the session's event stream is not answering")
            .with_reason("stream_unavailable")
            .with_retryable(true),
    )
}

async fn ask_actor<T>(
    actor: &ActorRef<TurnsMsg>,
    make: impl FnOnce(oneshot::Sender<T>) -> TurnsMsg,
) -> Result<T, ApiError> {
    let (tx, rx) = oneshot::channel();
    actor
        .send_message(make(tx))
        .map_err(|_| stream_unavailable())?;
    match tokio::time::timeout(ACTOR_WAIT, rx).await {
        Ok(Ok(v)) => Ok(v),
        _ => Err(stream_unavailable()),
    }
}

fn unknown_interaction(id: &str) -> ApiError {
    ApiError::rpc(
        RpcError::not_found(format!("no interaction {id:?} in this session"))
            .with_reason("unknown_interaction"),
    )
}

impl Session {
    /// Start an agent turn (`turn.start`): returns once the executor
    /// accepted it; the agent's output then flows on [`events`](Self::events).
    ///
    /// # Errors
    ///
    /// 400 for bad input, 404/410 for an unknown or ended session, 503 while
    /// its executor is away; the executor's refusals as they come: 409
    /// (`turn_running`: a turn is running), 400 (unknown agent), 501 (no
    /// `agent` capability).
    pub async fn start_turn(&self, req: StartTurn) -> Result<TurnStarted, ApiError> {
        let turn_id = client_id("turnId", req.turn_id, "turn")?;
        let input_id = format!("in-{}", uuid::Uuid::new_v4().simple());
        let params = TurnStartParams {
            session_id: self.id.clone(),
            turn_id: turn_id.clone(),
            input_id: input_id.clone(),
            input: items(req.input)?,
            config: req.config,
            deadline_ms: req.deadline_ms,
            executor_session_ref: req.executor_session_ref,
            metadata: req.metadata,
        };
        self.fits(&params)?;
        let r: TurnStartResult = self
            .request(
                Method::TurnStart,
                &params,
                self.shared.config.request_timeout,
            )
            .await?;
        Ok(TurnStarted {
            turn_id: if r.turn_id.is_empty() {
                turn_id
            } else {
                r.turn_id
            },
            input_id,
            accepted: r.accepted,
            effective: r.effective,
            executor_session_ref: r.executor_session_ref,
            resumed: r.resumed,
        })
    }

    /// More input for a running turn (`turn.input`): the agent gets it as
    /// its next prompt in the same turn. Returns `{accepted, inputId}`.
    ///
    /// # Errors
    ///
    /// The executor's: 404 unknown turn, 409 `turn_finished`.
    pub async fn turn_input(&self, turn_id: &str, req: MoreInput) -> Result<Value, ApiError> {
        let input_id = client_id("inputId", req.input_id, "in")?;
        let params = TurnInputParams {
            session_id: self.id.clone(),
            turn_id: turn_id.to_owned(),
            input_id: input_id.clone(),
            input: items(req.input)?,
        };
        self.fits(&params)?;
        let r: Value = self
            .request(
                Method::TurnInput,
                &params,
                self.shared.config.request_timeout,
            )
            .await?;
        Ok(json!({
            "accepted": r.get("accepted").and_then(Value::as_bool).unwrap_or(true),
            "inputId": input_id,
        }))
    }

    /// Cancel a turn (`turn.cancel`): `{canceled: false}` when it had
    /// already finished. The turn ends with `turnOutcome: canceled`.
    pub async fn cancel_turn(
        &self,
        turn_id: &str,
        reason: Option<String>,
    ) -> Result<TurnCancelResult, ApiError> {
        let reason = reason.unwrap_or_else(|| "canceled".into());
        if reason.len() > 256 {
            return Err(ApiError::bad_request("reason must be at most 256 bytes"));
        }
        let params = TurnCancelParams {
            session_id: self.id.clone(),
            turn_id: turn_id.to_owned(),
            reason,
        };
        self.request(
            Method::TurnCancel,
            &params,
            self.shared.config.request_timeout,
        )
        .await
    }

    /// A request must fit in one control frame with room to spare.
    fn fits<P: Serialize>(&self, params: &P) -> Result<(), ApiError> {
        let size = serde_json::to_vec(params).map(|v| v.len()).unwrap_or(0);
        let max = self
            .shared
            .config
            .max_control_frame_bytes
            .saturating_sub(4 << 10);
        if size > max {
            return Err(ApiError::rpc(RpcError::payload_too_large(format!(
                "the turn's input is {size} bytes; at most {max}"
            ))));
        }
        Ok(())
    }

    /// Follow the session's agent stream from after sequence `after` (0:
    /// everything kept): the events kept after it, then live events,
    /// deltas and interaction notices, until the session ends.
    ///
    /// # Errors
    ///
    /// 404 unknown session, 400 `after` beyond the last event, 429 too many
    /// clients on this session.
    pub async fn events(&self, after: u64) -> Result<EventStream, ApiError> {
        let actor = ensure(&self.shared, &self.id).await?;
        let sub = ask_actor(&actor, |reply| TurnsMsg::Subscribe { after, reply }).await??;
        Ok(EventStream::new(sub, after))
    }

    /// Interactions waiting for an answer, oldest deadline first.
    pub async fn interactions(&self) -> Result<Vec<InteractionView>, ApiError> {
        let actor = ensure(&self.shared, &self.id).await?;
        ask_actor(&actor, |reply| TurnsMsg::Interactions { id: None, reply }).await
    }

    /// One interaction, pending or recently resolved.
    pub async fn interaction(&self, interaction_id: &str) -> Result<InteractionView, ApiError> {
        let actor = ensure(&self.shared, &self.id).await?;
        let id = interaction_id.to_owned();
        ask_actor(&actor, |reply| TurnsMsg::Interactions {
            id: Some(id),
            reply,
        })
        .await?
        .pop()
        .ok_or_else(|| unknown_interaction(interaction_id))
    }

    /// Answer an interaction (`interaction.response`); returns it resolved.
    ///
    /// # Errors
    ///
    /// 404 unknown interaction; 409 `interaction_resolved` (answered,
    /// canceled or expired already), `interaction_busy` (an answer is on
    /// its way) or `interaction_gone` (the executor no longer knows it);
    /// 400 a scope the request did not offer, or an outcome that does not
    /// fit its kind; 503 the executor is away (it stays pending).
    pub async fn answer_interaction(
        &self,
        interaction_id: &str,
        answer: InteractionAnswer,
    ) -> Result<InteractionView, ApiError> {
        let view = self.interaction(interaction_id).await?;
        check_answer(&view, &answer)?;
        let actor = ensure(&self.shared, &self.id).await?;
        let id = interaction_id.to_owned();
        ask_actor(&actor, |reply| TurnsMsg::BeginAnswer { id, reply })
            .await?
            .map_err(|e| match e {
                AnswerError::Unknown => unknown_interaction(interaction_id),
                AnswerError::Resolved(state) => ApiError::rpc(
                    RpcError::conflict(
                        "interaction_resolved",
                        format!("interaction {interaction_id:?} is already {state:?}"),
                    )
                    .with_detail(format!("{state:?}").to_lowercase()),
                ),
                AnswerError::Busy => ApiError::rpc(RpcError::conflict(
                    "interaction_busy",
                    "an answer to this interaction is already on its way",
                )),
            })?;
        // Sent from a task: a client that goes away mid-way does not leave
        // the interaction stuck in `responding`.
        let session = self.clone();
        let outcome = answer.outcome;
        let params = InteractionResponseParams {
            session_id: self.id.clone(),
            interaction_id: interaction_id.to_owned(),
            outcome,
            scope: answer.scope,
            answers: answer.answers,
            deny_message: answer.deny_message,
            responder: None,
        };
        let task = tokio::spawn(async move {
            let sent: Result<Value, ApiError> = session
                .request(
                    Method::InteractionResponse,
                    &params,
                    session.shared.config.request_timeout,
                )
                .await;
            let result = match &sent {
                Ok(_) => Ok(outcome),
                Err(e) if e.code() == ErrorCode::NotFound.code() => Err(true),
                Err(_) => Err(false),
            };
            let id = params.interaction_id.clone();
            let view = ask_actor(&actor, |reply| TurnsMsg::AnswerDone { id, result, reply })
                .await
                .ok()
                .flatten();
            (sent, view)
        });
        let (sent, view) = task
            .await
            .map_err(|_| ApiError::internal("the answer's task failed"))?;
        match sent {
            Ok(_) => view.ok_or_else(|| unknown_interaction(interaction_id)),
            Err(e) if e.code() == ErrorCode::NotFound.code() => Err(ApiError::rpc(
                RpcError::conflict(
                    "interaction_gone",
                    format!("the executor no longer waits for interaction {interaction_id:?}"),
                )
                .with_detail(e.error.message),
            )),
            Err(e) => Err(e),
        }
    }
}

fn check_answer(view: &InteractionView, a: &InteractionAnswer) -> Result<(), ApiError> {
    let permission = view.request.kind == InteractionKind::Permission;
    let fits = match a.outcome {
        InteractionOutcome::Allow => permission,
        InteractionOutcome::Answered => !permission,
        InteractionOutcome::Deny => true,
        InteractionOutcome::Canceled | InteractionOutcome::Expired => false,
    };
    if !fits {
        return Err(ApiError::bad_request(format!(
            "outcome {:?} does not fit a {} interaction (permission: allow or deny; question: answered or deny)",
            a.outcome,
            if permission { "permission" } else { "question" },
        )));
    }
    if let Some(scope) = a.scope {
        if !view.request.scopes.contains(&scope) {
            return Err(ApiError::bad_request(format!(
                "scope {scope:?} is not one this interaction offers ({:?})",
                view.request.scopes
            )));
        }
    }
    if a.deny_message
        .as_ref()
        .is_some_and(|m| m.len() > MAX_DENY_MESSAGE)
    {
        return Err(ApiError::bad_request(format!(
            "denyMessage must be at most {MAX_DENY_MESSAGE} bytes"
        )));
    }
    if let Some(answers) = &a.answers {
        if answers.to_string().len() > MAX_ANSWERS_BYTES {
            return Err(ApiError::bad_request(format!(
                "answers must be at most {MAX_ANSWERS_BYTES} bytes of JSON"
            )));
        }
    }
    Ok(())
}

/// One item of a session's event stream, as a client receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamItem {
    /// A final event: its sequence and JSON record (`kind: "event"`,
    /// `sessionId`, `turnId`, `eventId`, `sequence`, `event`, `receivedAt`).
    Event { sequence: u64, json: Arc<str> },
    /// Live only: `kind` is `delta` or `interaction`; the JSON record.
    Live { kind: &'static str, json: Arc<str> },
    /// Events `from..=to` were dropped by retention before this client got
    /// them.
    Gap { from: u64, to: u64 },
    /// The session ended; the stream closes.
    End { reason: String },
    /// The stream was cut: `slow_subscriber` (the client fell behind: it
    /// reconnects with its last sequence) or `stream_closed`.
    Error { reason: &'static str },
}

impl StreamItem {
    /// The JSON text a client receives (an SSE `data:` line, a WebSocket
    /// text frame).
    pub fn json(&self) -> Arc<str> {
        match self {
            StreamItem::Event { json, .. } | StreamItem::Live { json, .. } => json.clone(),
            StreamItem::Gap { from, to } => {
                Arc::from(json!({"kind": "gap", "from": from, "to": to}).to_string())
            }
            StreamItem::End { reason } => {
                Arc::from(json!({"kind": "end", "reason": reason}).to_string())
            }
            StreamItem::Error { reason } => Arc::from(
                json!({"kind": "error", "reason": reason, "message": match *reason {
                    "slow_subscriber" => "this client fell behind the stream; reconnect with the last sequence it has",
                    _ => "the session's event stream closed; reconnect with the last sequence it has",
                }})
                .to_string(),
            ),
        }
    }

    /// The SSE `event:` name (`None`: the default `message`, for final events).
    pub fn sse_name(&self) -> Option<&'static str> {
        match self {
            StreamItem::Event { .. } => None,
            StreamItem::Live { kind, .. } => Some(kind),
            StreamItem::Gap { .. } => Some("gap"),
            StreamItem::End { .. } => Some("end"),
            StreamItem::Error { .. } => Some("error"),
        }
    }
}

/// A client's view of a session's event stream: the replay, then live
/// items; ends after [`StreamItem::End`] or [`StreamItem::Error`].
/// Dropping it unsubscribes.
pub struct EventStream {
    first: VecDeque<StreamItem>,
    rx: mpsc::Receiver<Item>,
    kicked: oneshot::Receiver<()>,
    /// Last sequence handed out (a final event is never handed out twice).
    cursor: u64,
    done: bool,
    id: u64,
    actor: ActorRef<TurnsMsg>,
}

impl EventStream {
    fn new(sub: Subscription, after: u64) -> Self {
        let mut first = VecDeque::new();
        if let Some((from, to)) = sub.replay.gap {
            first.push_back(StreamItem::Gap { from, to });
        }
        let mut cursor = after;
        for e in sub.replay.events {
            cursor = e.sequence;
            first.push_back(StreamItem::Event {
                sequence: e.sequence,
                json: e.json.clone(),
            });
        }
        let done = sub.replay.ended.is_some();
        if let Some(reason) = sub.replay.ended {
            first.push_back(StreamItem::End { reason });
        }
        EventStream {
            first,
            rx: sub.rx,
            kicked: sub.kicked,
            cursor,
            done,
            id: sub.id,
            actor: sub.actor,
        }
    }

    /// The last sequence handed out so far.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }
}

impl Stream for EventStream {
    type Item = StreamItem;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<StreamItem>> {
        let this = &mut *self;
        if let Some(item) = this.first.pop_front() {
            return Poll::Ready(Some(item));
        }
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            match this.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Item::Event(e))) => {
                    if e.sequence <= this.cursor {
                        continue;
                    }
                    this.cursor = e.sequence;
                    return Poll::Ready(Some(StreamItem::Event {
                        sequence: e.sequence,
                        json: e.json.clone(),
                    }));
                }
                Poll::Ready(Some(Item::Live(kind, json))) => {
                    return Poll::Ready(Some(StreamItem::Live { kind, json }))
                }
                Poll::Ready(Some(Item::Gap { from, to })) => {
                    return Poll::Ready(Some(StreamItem::Gap { from, to }))
                }
                Poll::Ready(Some(Item::End { reason })) => {
                    this.done = true;
                    return Poll::Ready(Some(StreamItem::End { reason }));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    let reason = if this.kicked.try_recv().is_ok() {
                        "slow_subscriber"
                    } else {
                        "stream_closed"
                    };
                    return Poll::Ready(Some(StreamItem::Error { reason }));
                }
            }
        }
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        let _ = self.actor.send_message(TurnsMsg::Unsubscribe(self.id));
    }
}

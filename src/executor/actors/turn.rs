//! One agent turn: its prompt(s), the events the agent's updates become,
//! and the permission questions asked on the way.
//!
//! A `temporary` child of its session (one turn at a time). It answers
//! `turn.start` once the agent has an ACP session, maps every update with
//! [`TurnEvents`] and hands the results to the session, which numbers and
//! delivers them; it ends after `session.status_idle`. A permission request
//! becomes `interaction.request` to the harness and waits for
//! `interaction.response` until it expires (then the agent is told no and
//! the harness `interaction.cancel {reason: expired}`). An allow with
//! `scope: session` is remembered by the session: the same tool is not
//! asked about again.

use super::agent::AgentMsg;
use super::session::SessionMsg;
use crate::acp::rpc::Client;
use crate::acp::schema;
use crate::acp::updates::{Emit, TurnEvents};
use crate::executor::outbox::{Delivery, OutboxEvent};
use crate::executor::Shared;
use crate::wire::types::{
    Accepted, InteractionCancelParams, InteractionCancelReason, InteractionKind,
    InteractionOutcome, InteractionRequestParams, InteractionResponseParams, InteractionScope,
    TurnCancelResult, TurnStartResult,
};
use crate::wire::{Method, Responder, RpcError};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Inputs queued for a running turn.
const MAX_QUEUED_INPUTS: usize = 16;
/// Permission questions open at once per turn.
const MAX_INTERACTIONS: usize = 64;
/// How long a canceled turn waits for the agent to stop.
const CANCEL_GRACE: Duration = Duration::from_secs(10);

pub enum TurnMsg {
    /// The agent's ACP session for this turn: `(id, resumed)`.
    Session(Result<(String, bool), String>),
    /// `session/update`s that arrived together (one read of the agent's
    /// pipe): their text goes out as one delta.
    Updates(Vec<Value>),
    Permission {
        id: Value,
        request: Box<schema::RequestPermissionRequest>,
    },
    /// The prompt ended with this stop reason.
    PromptDone(Result<String, String>),
    AgentGone(String),
    Input(String, Responder),
    Cancel(Responder),
    Response(InteractionResponseParams, Responder),
    Expire(String),
    /// The agent did not stop after `session/cancel` in time.
    CancelDeadline,
    /// The agent did not give the turn a session in time.
    SessionDeadline,
    /// `interaction.request` delivery.
    Questions(OutboxEvent<String>),
    /// The connection came back (`true`) or went (`false`).
    Connected(bool),
}

pub struct TurnArgs {
    pub shared: Arc<Shared>,
    pub session: ActorRef<SessionMsg>,
    pub session_id: String,
    pub turn_id: String,
    pub agent: ActorRef<AgentMsg>,
    pub agent_name: String,
    pub prompt: String,
    pub resume: Option<String>,
    /// Answer to `turn.start`, sent once the ACP session exists.
    pub reply: Option<Responder>,
    /// Tools allowed for the whole session (`scope: session`).
    pub always: Arc<Mutex<HashSet<String>>>,
}

pub struct Turn;

struct Question {
    agent_request: Value,
    /// optionId by kind (`allow_once`, `allow_always`, `reject_once`, ...).
    options: HashMap<String, String>,
    tool: String,
}

pub struct TurnState {
    /// `interaction.request`s until the harness answers them (again after
    /// a reconnect): a question is never lost to a cut connection.
    asks: Delivery<String, InteractionRequestParams>,
    args: TurnArgs,
    events: TurnEvents,
    inputs: VecDeque<String>,
    questions: HashMap<String, Question>,
    asked: u64,
    canceled: bool,
    ended: bool,
}

impl TurnState {
    fn emit(&self, emits: Vec<Emit>) {
        if !emits.is_empty() {
            let _ = self.args.session.send_message(SessionMsg::Emit {
                turn_id: self.args.turn_id.clone(),
                emits,
            });
        }
    }

    /// The last event, then the end of the actor.
    fn finish(&mut self, myself: &ActorRef<TurnMsg>, stop: &str, outcome: &str) {
        if self.ended {
            return;
        }
        self.ended = true;
        for (id, q) in self.questions.drain().collect::<Vec<_>>() {
            let _ = self
                .args
                .agent
                .send_message(AgentMsg::Send(Client::permission(&q.agent_request, None)));
            cancel_interaction(&self.args, &id, InteractionCancelReason::TurnCanceled);
        }
        let emits = self.events.idle(stop, outcome);
        self.emit(emits);
        let _ = self.args.agent.send_message(AgentMsg::TurnOver);
        myself.stop(None);
    }

    /// `turn.start` fails: the agent has no session for it.
    fn no_session(&mut self, myself: &ActorRef<TurnMsg>, why: &str) {
        if let Some(r) = self.args.reply.take() {
            r.err(RpcError::internal(format!(
                "the agent has no session: {why}"
            )));
        }
        let emits = self.events.error("agent_error", why);
        self.emit(emits);
        self.finish(myself, "end_turn", "failed");
    }

    fn answer_agent(&self, q: &Question, allow: bool, always: bool) {
        let option = crate::acp::rpc::pick_option(&q.options, allow, always);
        let _ = self
            .args
            .agent
            .send_message(AgentMsg::Send(Client::permission(
                &q.agent_request,
                option.as_deref(),
            )));
    }
}

fn cancel_interaction(args: &TurnArgs, id: &str, reason: InteractionCancelReason) {
    if let Some(link) = args.shared.link() {
        let params = InteractionCancelParams {
            session_id: args.session_id.clone(),
            interaction_id: id.to_owned(),
            reason,
        };
        let timeout = args.shared.config.request_timeout;
        tokio::spawn(async move {
            let _ = link
                .request::<_, Value>(Method::InteractionCancel, &params, timeout)
                .await;
        });
    }
}

impl Actor for Turn {
    type Msg = TurnMsg;
    type State = TurnState;
    type Arguments = TurnArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<TurnMsg>,
        args: TurnArgs,
    ) -> Result<TurnState, ActorProcessingErr> {
        let connected = args.shared.link().is_some();
        Ok(TurnState {
            asks: Delivery::new(
                Method::InteractionRequest,
                true,
                MAX_INTERACTIONS,
                connected,
            ),
            events: TurnEvents::new(&args.turn_id),
            args,
            inputs: VecDeque::new(),
            questions: HashMap::new(),
            asked: 0,
            canceled: false,
            ended: false,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<TurnMsg>,
        state: &mut TurnState,
    ) -> Result<(), ActorProcessingErr> {
        let _ = state.args.agent.send_message(AgentMsg::Begin {
            turn: myself.clone(),
            resume: state.args.resume.clone(),
        });
        myself.send_after(state.args.shared.config.init_timeout, || {
            TurnMsg::SessionDeadline
        });
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<TurnMsg>,
        msg: TurnMsg,
        state: &mut TurnState,
    ) -> Result<(), ActorProcessingErr> {
        if state.ended {
            match msg {
                TurnMsg::Input(_, r) => {
                    r.err(RpcError::conflict("turn_finished", "the turn is over"))
                }
                TurnMsg::Cancel(r) => r.ok(&TurnCancelResult { canceled: false }),
                TurnMsg::Response(_, r) => r.err(RpcError::not_found("the turn is over")),
                _ => {}
            }
            return Ok(());
        }
        match msg {
            TurnMsg::Session(Ok((acp, resumed))) => {
                let _ = state
                    .args
                    .session
                    .send_message(SessionMsg::AcpSession(acp.clone()));
                if let Some(r) = state.args.reply.take() {
                    r.ok(&TurnStartResult {
                        accepted: true,
                        turn_id: state.args.turn_id.clone(),
                        effective: json!({"agent": state.args.agent_name}),
                        executor_session_ref: Some(acp),
                        resumed,
                    });
                }
                let emits = state.events.running();
                state.emit(emits);
                let _ = state
                    .args
                    .agent
                    .send_message(AgentMsg::Prompt(state.args.prompt.clone()));
            }
            TurnMsg::Session(Err(why)) => state.no_session(&myself, &why),
            TurnMsg::SessionDeadline => {
                if state.args.reply.is_some() {
                    state.no_session(&myself, "the agent did not start a session in time");
                }
            }
            TurnMsg::AgentGone(why) => {
                if let Some(r) = state.args.reply.take() {
                    r.err(RpcError::internal(format!("the agent failed: {why}")));
                }
                let emits = state.events.error("agent_crashed", &why);
                state.emit(emits);
                state.finish(&myself, "end_turn", "failed");
            }
            TurnMsg::Updates(updates) => {
                let emits = state.events.updates(&updates);
                state.emit(emits);
            }
            TurnMsg::PromptDone(result) => match result {
                Ok(stop) if !state.canceled && stop != "cancelled" => {
                    if let Some(next) = state.inputs.pop_front() {
                        let _ = state.args.agent.send_message(AgentMsg::Prompt(next));
                    } else {
                        state.finish(&myself, &stop, "completed");
                    }
                }
                Ok(_) => state.finish(&myself, "cancelled", "canceled"),
                Err(e) => {
                    let emits = state.events.error("agent_error", &e);
                    state.emit(emits);
                    state.finish(&myself, "end_turn", "failed");
                }
            },
            TurnMsg::Input(text, reply) => {
                if state.inputs.len() >= MAX_QUEUED_INPUTS {
                    reply.err(RpcError::resource_unavailable("too many inputs queued"));
                } else {
                    state.inputs.push_back(text);
                    reply.ok(&Accepted::YES);
                }
            }
            TurnMsg::Cancel(reply) => {
                state.canceled = true;
                state.inputs.clear();
                let _ = state.args.agent.send_message(AgentMsg::Cancel);
                for (id, q) in state.questions.drain().collect::<Vec<_>>() {
                    state.answer_agent(&q, false, false);
                    cancel_interaction(&state.args, &id, InteractionCancelReason::TurnCanceled);
                }
                myself.send_after(CANCEL_GRACE, || TurnMsg::CancelDeadline);
                reply.ok(&TurnCancelResult { canceled: true });
            }
            TurnMsg::CancelDeadline => state.finish(&myself, "cancelled", "canceled"),
            TurnMsg::Permission { id, request } => {
                let request = serde_json::to_value(&*request).unwrap_or_default();
                let call = &request["toolCall"];
                let tool = call["title"]
                    .as_str()
                    .or_else(|| call["kind"].as_str())
                    .unwrap_or("tool")
                    .to_owned();
                let options = crate::acp::rpc::option_kinds(&request);
                let q = Question {
                    agent_request: id,
                    options,
                    tool: tool.clone(),
                };
                let allowed = state
                    .args
                    .always
                    .lock()
                    .map(|a| a.contains(&tool))
                    .unwrap_or(false);
                if allowed {
                    state.answer_agent(&q, true, true);
                    return Ok(());
                }
                if state.canceled || state.questions.len() >= MAX_INTERACTIONS {
                    state.answer_agent(&q, false, false);
                    return Ok(());
                }
                state.asked += 1;
                let interaction_id = format!("{}-i{}", state.args.turn_id, state.asked);
                let timeout = state.args.shared.config.interaction_timeout;
                let expires = time::OffsetDateTime::now_utc() + timeout;
                let params = InteractionRequestParams {
                    session_id: state.args.session_id.clone(),
                    turn_id: state.args.turn_id.clone(),
                    interaction_id: interaction_id.clone(),
                    kind: InteractionKind::Permission,
                    tool_name: Some(tool),
                    tool_input: call.get("rawInput").cloned(),
                    tool_use_id: call["toolCallId"].as_str().map(str::to_owned),
                    question: None,
                    scopes: vec![InteractionScope::Once, InteractionScope::Session],
                    expires_at: expires
                        .format(&time::format_description::well_known::Rfc3339)
                        .unwrap_or_default(),
                };
                state.questions.insert(interaction_id.clone(), q);
                let id2 = interaction_id.clone();
                myself.send_after(timeout, move || TurnMsg::Expire(id2));
                let _ = state.asks.push(interaction_id, params);
                state
                    .asks
                    .pump(&state.args.shared, &myself, TurnMsg::Questions);
            }
            TurnMsg::Response(p, reply) => {
                let Some(q) = state.questions.remove(&p.interaction_id) else {
                    reply.err(RpcError::not_found(format!(
                        "no open interaction {:?}",
                        p.interaction_id
                    )));
                    return Ok(());
                };
                state.asks.ack_where(|k| *k == p.interaction_id);
                let allow = p.outcome == InteractionOutcome::Allow;
                let always = allow && p.scope == Some(InteractionScope::Session);
                if always {
                    if let Ok(mut a) = state.args.always.lock() {
                        a.insert(q.tool.clone());
                    }
                }
                state.answer_agent(&q, allow, always);
                reply.ok(&Accepted::YES);
            }
            TurnMsg::Questions(event) => {
                state
                    .asks
                    .on_event(event, &state.args.shared, &myself, TurnMsg::Questions);
            }
            TurnMsg::Connected(true) => {
                state.asks.connected();
                state
                    .asks
                    .pump(&state.args.shared, &myself, TurnMsg::Questions);
            }
            TurnMsg::Connected(false) => state.asks.disconnected(),
            TurnMsg::Expire(id) => {
                state.asks.ack_where(|k| *k == id);
                if let Some(q) = state.questions.remove(&id) {
                    state.answer_agent(&q, false, false);
                    cancel_interaction(&state.args, &id, InteractionCancelReason::Expired);
                }
            }
        }
        Ok(())
    }
}

/// The text of a turn's input items (files are not offered: `fileInputs`
/// is false).
pub fn input_text(items: &[crate::wire::types::TurnInputItem]) -> Result<String, RpcError> {
    let mut text = String::new();
    for item in items {
        match (&item.kind, &item.text) {
            (crate::wire::types::TurnInputType::Text, Some(t)) => {
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(t);
            }
            _ => {
                return Err(RpcError::invalid_params(
                    "only text input is offered (fileInputs: false)",
                ))
            }
        }
    }
    if text.is_empty() {
        return Err(RpcError::invalid_params("the input has no text"));
    }
    Ok(text)
}

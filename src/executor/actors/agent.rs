//! A session's agent: one ACP agent process, kept between turns.
//!
//! `transient` under its session with a restart budget: an agent that dies
//! fails the actor (the turn it was running ends `failed`), and the
//! session's supervisor rules start a fresh one for the next turn. The
//! process goes through the executor's process layer (the newline-JSON
//! child of [`crate::executor::stdio_peer`]: own process group, scope tag,
//! bounded lines), so it dies with the session. The protocol bookkeeping
//! is [`crate::acp::rpc::Client`]; the actor routes its updates and
//! permission questions to the session's current turn.

use super::turn::TurnMsg;
use crate::acp::rpc::{Call, Client, Incoming};
use crate::executor::stdio_peer::{PeerEvent, Sink};
use crate::executor::stdio_peer::{StdioPeer, StdioSpec};
use crate::executor::Shared;
use crate::process::env::Tty;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

/// The longest line an agent may write.
const MAX_LINE: usize = 8 << 20;

pub enum AgentMsg {
    /// A turn starts: make sure an ACP session exists (load `resume` if
    /// the agent can), then answer the turn with `TurnMsg::Session`.
    Begin {
        turn: ActorRef<TurnMsg>,
        resume: Option<String>,
    },
    /// Prompt the current ACP session.
    Prompt(String),
    /// `session/cancel` for the current session.
    Cancel,
    /// A line to write (an answer to the agent's permission request).
    Send(String),
    /// The turn is over: stop routing to it.
    TurnOver,
    Agent(PeerEvent),
    InitTimeout,
}

#[derive(Clone)]
pub struct AgentArgs {
    pub shared: Arc<Shared>,
    pub session_id: String,
    pub name: String,
    pub argv: Vec<String>,
    pub workspace: PathBuf,
    pub scope: String,
    /// The session's sandbox: the agent runs in it.
    pub sandbox: Arc<crate::sandbox::Sandbox>,
}

#[derive(Clone)]
pub struct Agent;

pub struct AgentState {
    args: AgentArgs,
    transport: StdioPeer,
    client: Client,
    initialized: bool,
    load_supported: bool,
    /// The ACP session of this process.
    acp_session: Option<String>,
    loading: bool,
    turn: Option<ActorRef<TurnMsg>>,
    pending_begin: Option<Option<String>>,
}

impl AgentState {
    fn send(&self, line: String) -> Result<(), String> {
        self.transport.send(line)
    }

    fn cwd(&self) -> String {
        self.args.workspace.to_string_lossy().into_owned()
    }

    fn tell(&self, msg: TurnMsg) {
        if let Some(t) = &self.turn {
            let _ = t.send_message(msg);
        }
    }

    /// One line from the agent. Session updates of the live turn gather in
    /// `updates`; anything else is handled after them (the turn sees
    /// everything in the order the agent wrote it).
    fn on_line(&mut self, line: &str, updates: &mut Vec<Value>) -> Result<(), String> {
        let incoming = match self.client.on_line(line) {
            Incoming::Update { session_id, update } => {
                if !self.loading && Some(&session_id) == self.acp_session.as_ref() {
                    updates.push(update);
                }
                return Ok(());
            }
            other => other,
        };
        self.flush(updates);
        match incoming {
            Incoming::Answer { call, result } => match (call, result) {
                (Call::Initialize, Ok(r)) => {
                    self.initialized = true;
                    self.load_supported = r["agentCapabilities"]["loadSession"] == true;
                    if let Some(resume) = self.pending_begin.take() {
                        self.session_for(resume)?;
                    }
                }
                (Call::Initialize, Err(e)) => {
                    let why = format!("the agent refused initialize: {e}");
                    self.tell(TurnMsg::AgentGone(why.clone()));
                    return Err(why);
                }
                (Call::NewSession, Ok(r)) => match r["sessionId"].as_str() {
                    Some(id) => {
                        self.acp_session = Some(id.to_owned());
                        self.tell(TurnMsg::Session(Ok((id.to_owned(), false))));
                    }
                    None => self.tell(TurnMsg::Session(Err("no sessionId".into()))),
                },
                (Call::NewSession, Err(e)) => self.tell(TurnMsg::Session(Err(e))),
                (Call::LoadSession, Ok(_)) => {
                    self.loading = false;
                    let id = self.acp_session.clone().unwrap_or_default();
                    self.tell(TurnMsg::Session(Ok((id, true))));
                }
                (Call::LoadSession, Err(_)) => {
                    // Not resumable (unknown to this agent): a new one.
                    self.loading = false;
                    self.acp_session = None;
                    self.session_for(None)?;
                }
                (Call::Prompt, result) => {
                    self.tell(TurnMsg::PromptDone(result.map(|r| {
                        r["stopReason"].as_str().unwrap_or("end_turn").to_owned()
                    })))
                }
            },
            Incoming::Update { .. } => {}
            Incoming::Permission { id, request } => match &self.turn {
                Some(t) => {
                    let _ = t.send_message(TurnMsg::Permission { id, request });
                }
                None => self.send(Client::permission(&id, None))?,
            },
            Incoming::Refused { reply } => self.send(reply)?,
            Incoming::Garbage(why) => {
                tracing::debug!(session = %self.args.session_id, why, "agent line ignored")
            }
        }
        Ok(())
    }

    /// Hand the gathered updates to the turn, as one message.
    fn flush(&self, updates: &mut Vec<Value>) {
        if !updates.is_empty() {
            self.tell(TurnMsg::Updates(std::mem::take(updates)));
        }
    }

    /// The ACP session for a turn: the live one, a loaded one, or new.
    fn session_for(&mut self, resume: Option<String>) -> Result<(), String> {
        match resume {
            Some(r) if Some(&r) == self.acp_session.as_ref() => {
                self.tell(TurnMsg::Session(Ok((r, false))));
                Ok(())
            }
            Some(r) if self.load_supported => {
                self.loading = true;
                let line = self.client.load_session(&r, &self.cwd());
                self.acp_session = Some(r);
                self.send(line)
            }
            _ => {
                let line = self.client.new_session(&self.cwd());
                self.send(line)
            }
        }
    }
}

impl Actor for Agent {
    type Msg = AgentMsg;
    type State = AgentState;
    type Arguments = AgentArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<AgentMsg>,
        args: AgentArgs,
    ) -> Result<AgentState, ActorProcessingErr> {
        let me = myself.clone();
        let sink: Sink = Arc::new(move |ev| {
            let _ = me.send_message(AgentMsg::Agent(ev));
        });
        let env = args
            .sandbox
            .child_env(args.shared.config.child_env())
            .build(None, Tty::No, &args.scope)
            .map_err(|e| e.to_string())?;
        let command = args.argv.first().cloned().unwrap_or_default();
        let path = env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.as_str());
        let program = crate::process::sys::resolve_program(&command, path, &args.workspace)
            .unwrap_or_else(|| PathBuf::from(&command));
        let transport = StdioPeer::start(
            StdioSpec {
                program,
                arg0: command,
                args: args.argv.iter().skip(1).cloned().collect(),
                cwd: args.workspace.clone(),
                env,
                scope: args.scope.clone(),
                max_message: MAX_LINE,
                secrets: Arc::new(Vec::new()),
                label: format!("{}/agent:{}", args.session_id, args.name),
                unit: Some(args.sandbox.unit().map_err(|e| e.to_string())?),
            },
            sink,
        )
        .map_err(|e| format!("agent {:?} cannot start: {e}", args.name))?;
        Ok(AgentState {
            args,
            transport,
            client: Client::new(),
            initialized: false,
            load_supported: false,
            acp_session: None,
            loading: false,
            turn: None,
            pending_begin: None,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<AgentMsg>,
        state: &mut AgentState,
    ) -> Result<(), ActorProcessingErr> {
        let line = state.client.initialize();
        state.send(line)?;
        let wait = state.args.shared.config.init_timeout;
        myself.send_after(wait, || AgentMsg::InitTimeout);
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<AgentMsg>,
        state: &mut AgentState,
    ) -> Result<(), ActorProcessingErr> {
        state.transport.shutdown().await;
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<AgentMsg>,
        msg: AgentMsg,
        state: &mut AgentState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            AgentMsg::Begin { turn, resume } => {
                state.turn = Some(turn);
                if state.initialized {
                    state.session_for(resume)?;
                } else {
                    state.pending_begin = Some(resume);
                }
            }
            AgentMsg::Prompt(text) => match state.acp_session.clone() {
                Some(s) => {
                    let line = state.client.prompt(&s, &text);
                    state.send(line)?;
                }
                None => state.tell(TurnMsg::PromptDone(Err("no agent session".into()))),
            },
            AgentMsg::Cancel => {
                if let Some(s) = &state.acp_session {
                    state.send(Client::cancel(s))?;
                }
            }
            AgentMsg::Send(line) => state.send(line)?,
            AgentMsg::TurnOver => state.turn = None,
            AgentMsg::InitTimeout => {
                if !state.initialized {
                    let why = "the agent did not answer initialize".to_owned();
                    state.tell(TurnMsg::AgentGone(why.clone()));
                    return Err(why.into());
                }
            }
            AgentMsg::Agent(PeerEvent::Closed(why)) => {
                let tail = state.transport.stderr_tail();
                let last = tail
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                let why = format!("the agent exited: {why} {}", last.trim());
                tracing::warn!(session = %state.args.session_id, agent = %state.args.name, error = %why, "agent gone");
                state.tell(TurnMsg::AgentGone(why.clone()));
                return Err(why.into());
            }
            AgentMsg::Agent(PeerEvent::Oversized(_)) => {
                tracing::warn!(session = %state.args.session_id, "agent wrote a line over {MAX_LINE} bytes");
            }
            AgentMsg::Agent(PeerEvent::Message(line)) => {
                let mut updates = Vec::new();
                let r = state.on_line(&line, &mut updates);
                state.flush(&mut updates);
                r?;
            }
            AgentMsg::Agent(PeerEvent::Messages(lines)) => {
                // One read of the pipe: its updates go to the turn as one
                // message (one delta), anything else in order between them.
                let mut updates = Vec::new();
                for line in &lines {
                    if let Err(e) = state.on_line(line, &mut updates) {
                        state.flush(&mut updates);
                        return Err(e.into());
                    }
                }
                state.flush(&mut updates);
            }
        }
        Ok(())
    }
}

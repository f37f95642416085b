//! One run of a `wire` session: an ACP agent on stdio (VISOR.md §2).
//!
//! The agent is a child through the executor's own stdio peer
//! ([`StdioPeer`]: its own process group, tagged with the session's scope,
//! bounded lines, a bounded stderr tail), so `stop` and the end of a run
//! kill it and everything it started, as for PTY sessions. The protocol
//! bookkeeping is [`crate::acp::rpc::Client`] and the mapping of its
//! updates is [`crate::acp::updates::TurnEvents`], both shared with the
//! executor's agent turns; [`super::chat`] turns that mapping into the
//! visor's events and keeps the conversation.
//!
//! The run: `initialize`; `session/load` of the resume id (the spec's
//! `resumeId` on the first run, the previous vendor id on a `resume`
//! restart) when the agent advertises `loadSession`, else `session/new`;
//! the session is then `idle`. A prompt (`send` while idle, the spec's
//! `prompt`, `restart.prompt` after a restart, a held message) is one
//! `session/prompt`: `running` until its answer (`result`), `waiting`
//! while a permission request is open. ACP has no way to add input to a
//! running turn, so `send` while busy is always `held`, and held messages
//! are prompted one per turn, in order, each at the next idle.
//!
//! Like the PTY run, this actor is one run: the agent's unexpected end
//! under `restart: notify|resume` ends it abnormally (`lost: …`) and the
//! session's supervisor starts the next run within its budget.

use super::chat::{events, AnswerError, ChatTurn};
use super::session::{child_env, AnswerSpec, SessionData, SessionMsg, LOST};
use super::state::{Delivery, Input, State};
use super::types::RestartMode;
use super::VisorError;
use crate::acp::rpc::{pick_option, Call, Client, Incoming};
use crate::acp::updates::TurnEvents;
use crate::executor::stdio_peer::{PeerEvent, Sink, StdioPeer, StdioSpec};
use crate::process::env::Tty;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The longest line an agent may write.
pub const MAX_LINE: usize = 8 << 20;
/// From the start of a run to the agent's ACP session (`initialize` and
/// `session/new` or `session/load` answered).
pub const OPEN_DEADLINE: Duration = Duration::from_secs(60);
/// An unanswered permission request is rejected after this.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(30 * 60);

/// One run of a wire session.
#[derive(Clone)]
pub struct WireActor;

pub struct WireRun {
    data: Arc<SessionData>,
    peer: StdioPeer,
    client: Client,
    /// A restart run (sends `restart.prompt` once open).
    restarted: bool,
    load_supported: bool,
    /// The ACP session id to load, if any.
    resume: Option<String>,
    /// The ACP session of this run, once open.
    acp: Option<String>,
    loading: bool,
    /// The turn in flight.
    turn: Option<TurnEvents>,
    /// The last whole assistant message of the turn (its `result` text).
    reply: String,
    /// This run is ending (`stop`, or the agent gone): held messages wait
    /// for the next run, later messages are ignored.
    stopping: bool,
}

/// The exit code in a [`PeerEvent::Closed`] reason (`exited (exit
/// status: N)`, or `128 + N` for `signal: N`).
fn exit_code(why: &str) -> Option<i32> {
    let num = |tag: &str| {
        why.split_once(tag).and_then(|(_, r)| {
            r.trim_start()
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<i32>()
                .ok()
        })
    };
    num("exit status:").or_else(|| num("signal:").map(|s| 128 + s))
}

impl WireRun {
    fn send_line(&self, line: String) -> Result<(), VisorError> {
        self.peer
            .send(line)
            .map_err(|e| VisorError::Busy(format!("the agent: {e}")))
    }

    /// Publish what the mapping made of some updates.
    fn publish(&mut self, emits: Vec<crate::acp::updates::Emit>) {
        for e in &emits {
            if let crate::acp::updates::Emit::Event { event, .. } = e {
                if event["type"] == "agent.message" {
                    // The turn's last whole message is its `result` text.
                    self.reply = event["text"].as_str().unwrap_or("").to_owned();
                }
            }
        }
        for m in events(emits) {
            if let Some((id, status, output)) = m.tool_update {
                let tool = self.data.chat().tool_update(&id, &status, output.as_ref());
                self.data.emit("tool", json!({"tool": tool}));
                continue;
            }
            match m.turn {
                Some(t) => self.data.emit_chat(m.kind, m.fields, t),
                None => {
                    self.data.emit(m.kind, m.fields);
                }
            }
        }
    }

    fn updates(&mut self, updates: &mut Vec<Value>) {
        if updates.is_empty() {
            return;
        }
        let batch = std::mem::take(updates);
        if let Some(t) = self.turn.as_mut() {
            let emits = t.updates(&batch);
            self.publish(emits);
        }
    }

    /// The agent's ACP session is open: `idle`, then the first prompt.
    fn opened(&mut self, id: String) -> Result<(), VisorError> {
        self.acp = Some(id.clone());
        self.data.chat().vendor_id = Some(id);
        let _ = self.data.apply(Input::Started { idle: true });
        let spec = &self.data.checked.spec;
        let first = if self.restarted {
            spec.restart.prompt.clone()
        } else {
            spec.prompt.clone()
        };
        match first {
            Some(p) => self.prompt(p),
            None => self.next_held(),
        }
    }

    /// Prompt the next held message, if any (the session is idle and
    /// this run goes on: a held message is never given to a dying agent).
    fn next_held(&mut self) -> Result<(), VisorError> {
        if self.stopping || self.data.state() != State::Idle {
            return Ok(());
        }
        let held = self.data.chat().next_held();
        match held {
            Some(text) => self.prompt(text),
            None => Ok(()),
        }
    }

    /// A new turn (the session is idle and open).
    fn prompt(&mut self, text: String) -> Result<(), VisorError> {
        let Some(acp) = self.acp.clone() else {
            return Err(VisorError::State("the agent has no session yet".into()));
        };
        let out = self
            .data
            .apply(Input::Send { can_steer: false })
            .map_err(|e| VisorError::State(e.to_string()))?;
        debug_assert_eq!(out.delivery, Some(Delivery::Prompted));
        let n = {
            let mut c = self.data.chat();
            c.prompts += 1;
            c.prompts
        };
        self.data.emit_chat(
            "user",
            json!({"text": text}),
            ChatTurn {
                seq: 0,
                role: "user",
                text: text.clone(),
                tool: None,
            },
        );
        self.turn = Some(TurnEvents::new(&format!("t{n}")));
        self.reply.clear();
        let line = self.client.prompt(&acp, &text);
        self.send_line(line)
    }

    /// `send`.
    fn send(&mut self, text: String) -> Result<Delivery, VisorError> {
        let state = self.data.state();
        if !state.live() {
            return Err(VisorError::State("the session has exited".into()));
        }
        if state == State::Idle && self.turn.is_none() {
            self.prompt(text)?;
            return Ok(Delivery::Prompted);
        }
        if !self.data.chat().hold(text) {
            return Err(VisorError::Busy(format!(
                "{} messages are already held",
                super::chat::MAX_HELD
            )));
        }
        let out = self
            .data
            .apply(Input::Send { can_steer: false })
            .map_err(|e| VisorError::State(e.to_string()))?;
        Ok(out.delivery.unwrap_or(Delivery::Held))
    }

    /// Close every open request: the agent is told `cancelled`.
    fn withdraw(&mut self, reason: &str) {
        let closed = self.data.chat().close_all();
        for p in closed {
            let _ = self.send_line(Client::permission(&p.rpc_id, None));
            self.data.emit(
                "request_closed",
                json!({"requestId": p.id, "reason": reason}),
            );
            let _ = self.data.apply(Input::Answer);
        }
    }

    /// The turn's prompt was answered: `result`, `idle`, the next held.
    fn turn_ended(&mut self, result: Result<String, String>) -> Result<(), VisorError> {
        let Some(mut t) = self.turn.take() else {
            return Ok(());
        };
        self.withdraw("turn_ended");
        let (stop, is_error) = match &result {
            Ok(stop) => (stop.clone(), false),
            Err(_) => ("error".to_owned(), true),
        };
        let emits = match &result {
            Ok(_) => t.idle(&stop, "completed"),
            Err(e) => t.error("agent_error", e),
        };
        self.publish(emits);
        let text = match &result {
            Ok(_) => std::mem::take(&mut self.reply),
            Err(e) => e.clone(),
        };
        self.data.emit_chat(
            "result",
            json!({"result": {"isError": is_error, "text": text, "stopReason": stop}}),
            ChatTurn {
                seq: 0,
                role: "result",
                text,
                tool: None,
            },
        );
        let _ = self.data.apply(Input::TurnEnded);
        self.next_held()
    }

    fn permission(&mut self, myself: &ActorRef<SessionMsg>, id: Value, request: Value) {
        let busy = matches!(self.data.state(), State::Running | State::Waiting);
        let opened = if busy {
            self.data.chat().open(id.clone(), &request)
        } else {
            None
        };
        let Some(p) = opened else {
            // No turn to ask for, or too many open: the agent is told no.
            let _ = self.send_line(Client::permission(&id, None));
            return;
        };
        let _ = self.data.apply(Input::Request);
        self.data.emit("request", json!({"request": p.view}));
        let rid = p.id.clone();
        myself.send_after(REQUEST_DEADLINE, move || SessionMsg::Expire(rid));
    }

    fn answer(&mut self, a: AnswerSpec) -> Result<(), VisorError> {
        let p = self.data.chat().close(&a.request_id).map_err(|e| match e {
            AnswerError::Unknown => {
                VisorError::NotFound(format!("no pending request {:?}", a.request_id))
            }
            AnswerError::Answered => {
                VisorError::State(format!("request {:?} is already answered", a.request_id))
            }
        })?;
        let option = pick_option(&p.options, a.allow, false);
        self.send_line(Client::permission(&p.rpc_id, option.as_deref()))?;
        let mut fields = json!({"requestId": p.id, "allow": a.allow, "optionId": option});
        if let Some(m) = a.message {
            fields["message"] = m.into();
        }
        self.data.emit("request_closed", fields);
        let _ = self.data.apply(Input::Answer);
        Ok(())
    }

    fn expire(&mut self, id: &str) {
        let Ok(p) = self.data.chat().close(id) else {
            return;
        };
        let option = pick_option(&p.options, false, false);
        let _ = self.send_line(Client::permission(&p.rpc_id, option.as_deref()));
        self.data.emit(
            "request_closed",
            json!({"requestId": p.id, "allow": false, "reason": "expired"}),
        );
        let _ = self.data.apply(Input::Answer);
    }

    /// Open the ACP session: load the resume id if the agent can, else new.
    fn open_session(&mut self) -> Result<(), VisorError> {
        let cwd = self.data.checked.cwd.to_string_lossy().into_owned();
        let line = match self.resume.clone() {
            Some(r) if self.load_supported => {
                self.loading = true;
                self.client.load_session(&r, &cwd)
            }
            _ => self.client.new_session(&cwd),
        };
        self.send_line(line)
    }

    /// One line from the agent; updates of this session gather in
    /// `updates` and go out before anything else the agent wrote after them.
    fn on_line(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        line: &str,
        updates: &mut Vec<Value>,
    ) -> Result<(), String> {
        let incoming = match self.client.on_line(line) {
            Incoming::Update { session_id, update } => {
                // Updates while loading replay history the chat already has.
                if !self.loading && Some(&session_id) == self.acp.as_ref() {
                    updates.push(update);
                }
                return Ok(());
            }
            other => other,
        };
        self.updates(updates);
        let vis = |e: VisorError| e.to_string();
        match incoming {
            Incoming::Answer { call, result } => match (call, result) {
                (Call::Initialize, Ok(r)) => {
                    self.load_supported = r["agentCapabilities"]["loadSession"] == true;
                    self.open_session().map_err(vis)?;
                }
                (Call::Initialize, Err(e)) => {
                    return Err(format!("the agent refused initialize: {e}"))
                }
                (Call::NewSession, Ok(r)) => match r["sessionId"].as_str() {
                    Some(id) => self.opened(id.to_owned()).map_err(vis)?,
                    None => return Err("the agent's session/new gave no sessionId".into()),
                },
                (Call::NewSession, Err(e)) => {
                    return Err(format!("the agent refused session/new: {e}"))
                }
                (Call::LoadSession, Ok(_)) => {
                    self.loading = false;
                    let id = self.resume.clone().unwrap_or_default();
                    self.opened(id).map_err(vis)?;
                }
                (Call::LoadSession, Err(e)) => {
                    self.loading = false;
                    self.data.emit(
                        "error",
                        json!({"error": format!("cannot resume agent session {:?}: {e}; a new session is opened", self.resume.clone().unwrap_or_default())}),
                    );
                    self.resume = None;
                    self.open_session().map_err(vis)?;
                }
                (Call::Prompt, result) => {
                    let r =
                        result.map(|r| r["stopReason"].as_str().unwrap_or("end_turn").to_owned());
                    self.turn_ended(r).map_err(vis)?;
                }
            },
            Incoming::Update { .. } => {}
            Incoming::Permission { id, request } => {
                let request = serde_json::to_value(&*request).unwrap_or_default();
                self.permission(myself, id, request);
            }
            Incoming::Refused { reply } => self.send_line(reply).map_err(vis)?,
            Incoming::Garbage(why) => {
                tracing::debug!(session = %self.data.id, why, "agent line ignored")
            }
        }
        Ok(())
    }

    fn on_lines(&mut self, myself: &ActorRef<SessionMsg>, lines: &[String]) -> Result<(), String> {
        let mut updates = Vec::new();
        for line in lines {
            if let Err(e) = self.on_line(myself, line, &mut updates) {
                self.updates(&mut updates);
                return Err(e);
            }
        }
        self.updates(&mut updates);
        Ok(())
    }

    /// The agent is gone (exited, or failed the protocol): the turn ends
    /// with an error, the tree is killed, and the restart policy decides.
    async fn gone(&mut self, myself: &ActorRef<SessionMsg>, code: Option<i32>, why: String) {
        self.stopping = true;
        if self.turn.is_some() {
            let _ = self.turn_ended(Err(why.clone()));
        }
        self.withdraw("exited");
        self.peer.shutdown().await;
        self.data.kill_tree().await;
        self.data.set_exit_code(code);
        tracing::info!(session = %self.data.id, ?code, %why, "visor wire agent ended");
        self.data.emit("exit", json!({"exitCode": code}));
        let restart = self.data.restart_mode() != RestartMode::None;
        if !restart && code != Some(0) {
            self.data.set_error(why.clone());
        }
        let _ = self.data.apply(Input::Exit { restart });
        if restart {
            myself.stop(Some(format!("{LOST}: {why}")));
        } else {
            myself.stop(None);
        }
    }
}

impl Actor for WireActor {
    type Msg = SessionMsg;
    type State = WireRun;
    type Arguments = Arc<SessionData>;

    async fn pre_start(
        &self,
        myself: ActorRef<SessionMsg>,
        data: Arc<SessionData>,
    ) -> Result<WireRun, ActorProcessingErr> {
        let first = data.begin_run().await?;
        let resume = if first {
            data.checked.spec.resume_id.clone()
        } else if data.restart_mode() == RestartMode::Resume {
            data.chat().vendor_id.clone()
        } else {
            None
        };
        let env = child_env(&data, Tty::No)?;
        let mut argv = data.checked.argv.clone();
        if let Some(r) = resume.as_deref().filter(|_| !first) {
            argv.extend(super::agents::resume_args(&data.checked.resume_args, r));
        }
        let command = argv[0].clone();
        let path = env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.as_str());
        let cwd = data.checked.cwd.clone();
        let program = crate::process::sys::resolve_program(&command, path, &cwd)
            .unwrap_or_else(|| PathBuf::from(&command));
        let me = myself.clone();
        let sink: Sink = Arc::new(move |ev| {
            let _ = me.send_message(SessionMsg::Peer(ev));
        });
        let spawned = StdioPeer::start(
            StdioSpec {
                program,
                arg0: command.clone(),
                args: argv[1..].to_vec(),
                cwd,
                env,
                scope: data.scope.clone(),
                max_message: MAX_LINE,
                secrets: Arc::new(Vec::new()),
                label: format!("visor/{}", data.id),
                unit: None,
            },
            sink,
        );
        let peer = match spawned {
            Ok(p) => p,
            Err(e) if first => return Err(format!("shutdown:cannot start {command}: {e}").into()),
            Err(e) => return Err(format!("{LOST}: cannot start {command}: {e}").into()),
        };
        let pid = peer.pid();
        data.set_pid(pid);
        data.set_actor(&myself);
        if first {
            data.emit(
                "init",
                json!({"kind": "wire", "command": argv, "pid": pid, "agent": data.checked.spec.agent}),
            );
        }
        let mut run = WireRun {
            data,
            peer,
            client: Client::new(),
            restarted: !first,
            load_supported: false,
            resume,
            acp: None,
            loading: false,
            turn: None,
            reply: String::new(),
            stopping: false,
        };
        let line = run.client.initialize();
        run.send_line(line).map_err(|e| e.to_string())?;
        myself.send_after(OPEN_DEADLINE, || SessionMsg::InitTimeout);
        tracing::info!(session = %run.data.id, pid, "visor wire session started");
        Ok(run)
    }

    async fn post_stop(
        &self,
        myself: ActorRef<SessionMsg>,
        run: &mut WireRun,
    ) -> Result<(), ActorProcessingErr> {
        run.peer.shutdown().await;
        run.data.end_run(&myself).await;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<SessionMsg>,
        msg: SessionMsg,
        run: &mut WireRun,
    ) -> Result<(), ActorProcessingErr> {
        if run.stopping {
            if let SessionMsg::Stop(reply) = msg {
                let _ = reply.send(Err(VisorError::State("the session has exited".into())));
            }
            return Ok(());
        }
        match msg {
            SessionMsg::Peer(PeerEvent::Message(line)) => {
                if let Err(why) = run.on_lines(&myself, std::slice::from_ref(&line)) {
                    run.gone(&myself, None, why).await;
                }
            }
            SessionMsg::Peer(PeerEvent::Messages(lines)) => {
                if let Err(why) = run.on_lines(&myself, &lines) {
                    run.gone(&myself, None, why).await;
                }
            }
            SessionMsg::Peer(PeerEvent::Oversized(_)) => {
                tracing::warn!(session = %run.data.id, "agent wrote a line over {MAX_LINE} bytes");
                run.data.emit(
                    "error",
                    json!({"error": format!("the agent wrote a line over {MAX_LINE} bytes; dropped")}),
                );
            }
            SessionMsg::Peer(PeerEvent::Closed(why)) => {
                let tail = run.peer.stderr_tail();
                let last = tail.lines().rev().find(|l| !l.trim().is_empty());
                let code = exit_code(&why);
                let why = match last {
                    Some(l) if !why.contains(l.trim()) => {
                        format!("the agent {why}: {}", l.trim())
                    }
                    _ => format!("the agent {why}"),
                };
                run.gone(&myself, code, why).await;
            }
            SessionMsg::InitTimeout => {
                if run.acp.is_none() && run.data.state() == State::Starting {
                    let why = format!(
                        "the agent did not open its ACP session within {} s",
                        OPEN_DEADLINE.as_secs()
                    );
                    run.gone(&myself, None, why).await;
                }
            }
            SessionMsg::Send(text, w, reply) => {
                let r = run.data.may_write(w).and_then(|()| run.send(text));
                let _ = reply.send(r);
            }
            SessionMsg::Answer(a, reply) => {
                let _ = reply.send(run.answer(a));
            }
            SessionMsg::Expire(id) => run.expire(&id),
            SessionMsg::Interrupt(w, reply) => {
                let r = match (run.acp.clone(), run.turn.is_some()) {
                    _ if run.data.may_write(w).is_err() => run.data.may_write(w),
                    (Some(acp), true) => {
                        let line = Client::cancel(&acp);
                        // ACP: the client answers open requests `cancelled`.
                        run.withdraw("cancelled");
                        run.send_line(line)
                    }
                    _ => Err(VisorError::State("no turn is running".into())),
                };
                let _ = reply.send(r);
            }
            SessionMsg::Stop(reply) => {
                tracing::info!(session = %run.data.id, "stopping visor wire session");
                run.stopping = true;
                run.withdraw("stopped");
                // stdin closed, SIGTERM to the group, SIGKILL of the tree.
                run.peer.shutdown().await;
                run.data.kill_tree().await;
                run.data.emit("exit", json!({"exitCode": null}));
                let _ = run.data.apply(Input::Stop);
                let _ = reply.send(Ok(()));
                myself.stop(None);
            }
            SessionMsg::Panic => panic!("injected panic (test hook)"),
            SessionMsg::Write(_, _, reply) => {
                if let Some(r) = reply {
                    let _ = r.send(Err(no_terminal()));
                }
            }
            SessionMsg::Paste(_, _, reply) | SessionMsg::Resize(_, _, _, reply) => {
                let _ = reply.send(Err(no_terminal()));
            }
            SessionMsg::Output | SessionMsg::Exited(_) | SessionMsg::Escalate => {}
        }
        Ok(())
    }
}

fn no_terminal() -> VisorError {
    VisorError::State("a wire session has no terminal; use send".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_from_close_reasons() {
        assert_eq!(exit_code("exited (exit status: 3)"), Some(3));
        assert_eq!(exit_code("exited (signal: 9 (SIGKILL))"), Some(137));
        assert_eq!(exit_code("exited"), None);
    }
}

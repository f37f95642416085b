//! One visor PTY session: the program on a PTY, its numbered output, the
//! screen model, the writer lease and the restart policy.
//!
//! What outlives one run of the program — the state machine record, the
//! output, the screen, the lease, the attach watches — is [`SessionData`],
//! shared by every generation of the session actor. The actor is one run:
//! it spawns the program in `pre_start`, drives the state machine, and ends
//! when the program ends. An unexpected end under `restart: notify` ends
//! the actor *abnormally* (`lost: …`): the sessions' dynamic supervisor
//! restarts it within the session's restart budget (its intensity), and the
//! next generation runs the program again. That is the restart policy; there
//! is no retry loop here. Past the budget the supervisor gives up and the
//! sessions owner ends the session `exited` with an `error`.

use super::chat::Conversation;
use super::events::{Hub, Meta};
use super::lease::Lease;
use super::screen::Screen;
use super::state::{Delivery, Input, Machine, Outcome, Refused, State};
use super::types::{Checked, RestartMode, SessionView};
use super::VisorError;
use crate::executor::actors::terminal::pty;
use crate::process::env::{ChildEnv, Tty};
use crate::process::sys;
use bytes::Bytes;
use nix::sys::signal::Signal;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde_json::{json, Map, Value};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// Output kept per session (numbered chunks).
pub const SCROLLBACK_BYTES: usize = 1 << 20;
/// Between SIGTERM/SIGHUP and SIGKILL on `stop`.
pub const STOP_GRACE: Duration = Duration::from_secs(3);
/// Prefix of the stop reason of a run that ended unexpectedly under a
/// restart policy (an abnormal exit: the supervisor restarts it).
pub const LOST: &str = "lost";

/// What a session's record holds beside its state.
#[derive(Debug)]
pub struct Record {
    pub machine: Machine,
    pub pid: Option<u32>,
    pub exit_code: Option<i32>,
    pub error: Option<String>,
    pub updated_at: String,
    pub seq: u64,
    pub restarts: u32,
    pub cols: u16,
    pub rows: u16,
}

/// Who writes to the PTY.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    /// An HTTP call (`keys`, `paste`, `send`): only while no client holds
    /// the lease.
    Api,
    /// An attached client, by id: only while it holds the lease.
    Client(u64),
}

/// A session across all runs of its program.
pub struct SessionData {
    pub id: String,
    pub checked: Checked,
    pub created_at: String,
    /// The `BMX_SCOPE` tag of every process of this session.
    pub scope: String,
    /// `BMX_VISOR_*` for the program.
    pub visor_env: Vec<(String, String)>,
    pub hub: Arc<Hub>,
    origin: Instant,
    record: Mutex<Record>,
    pub output: Arc<pty::Output>,
    screen: Mutex<Screen>,
    lease: Mutex<Lease>,
    /// Lease changes, for attached clients.
    pub lease_tx: watch::Sender<Lease>,
    /// Terminal size changes.
    pub size_tx: watch::Sender<(u16, u16)>,
    /// `Some(exit code)` once the session is exited.
    pub ended_tx: watch::Sender<Option<Option<i32>>>,
    /// The current run's actor (`None` between runs).
    actor: Mutex<Option<ActorRef<SessionMsg>>>,
    /// A wire session's conversation (empty for PTY sessions).
    chat: Mutex<Conversation>,
    /// The seq of the last chat turn, for attached chat views.
    pub chat_tx: watch::Sender<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SessionData {
    pub fn new(
        id: String,
        checked: Checked,
        scope: String,
        visor_env: Vec<(String, String)>,
        hub: Arc<Hub>,
    ) -> Arc<SessionData> {
        let (cols, rows) = (checked.cols, checked.rows);
        let now = crate::wire::types::now_rfc3339();
        Arc::new(SessionData {
            id,
            checked,
            created_at: now.clone(),
            scope,
            visor_env,
            hub,
            origin: Instant::now(),
            record: Mutex::new(Record {
                machine: Machine::new(Duration::ZERO),
                pid: None,
                exit_code: None,
                error: None,
                updated_at: now,
                seq: 0,
                restarts: 0,
                cols,
                rows,
            }),
            output: pty::Output::new(SCROLLBACK_BYTES),
            screen: Mutex::new(Screen::new(cols, rows)),
            lease: Mutex::new(Lease::default()),
            lease_tx: watch::channel(Lease::default()).0,
            size_tx: watch::channel((cols, rows)).0,
            ended_tx: watch::channel(None).0,
            actor: Mutex::new(None),
            chat: Mutex::new(Conversation::default()),
            chat_tx: watch::channel(0).0,
        })
    }

    pub fn state(&self) -> State {
        lock(&self.record).machine.state()
    }

    pub fn actor(&self) -> Option<ActorRef<SessionMsg>> {
        lock(&self.actor).clone()
    }

    pub fn restart_mode(&self) -> RestartMode {
        self.checked.spec.restart.mode
    }

    pub fn meta(&self) -> Meta {
        Meta {
            kind: self.checked.spec.kind.as_str().into(),
            agent: self.checked.spec.agent.clone(),
            labels: self.checked.spec.labels.clone(),
            state: self.state().as_str().into(),
        }
    }

    pub fn view(&self) -> SessionView {
        let (prompts, pending, vendor_id) = {
            let c = lock(&self.chat);
            (c.prompts, c.pending_views(), c.vendor_id.clone())
        };
        let r = lock(&self.record);
        let spec = &self.checked.spec;
        SessionView {
            id: self.id.clone(),
            kind: spec.kind,
            state: r.machine.state(),
            role: self.checked.role.clone(),
            agent: spec.agent.clone(),
            title: self.checked.title.clone(),
            labels: spec.labels.clone(),
            pid: r.pid,
            workdir: spec.workdir.clone(),
            working_dir: self.checked.cwd.display().to_string(),
            created_at: self.created_at.clone(),
            updated_at: r.updated_at.clone(),
            seq: r.seq,
            turns: prompts,
            pending,
            exit_code: r.exit_code,
            error: r.error.clone(),
            restart: spec.restart.clone(),
            restarts: r.restarts,
            vendor_id,
            cols: r.cols,
            rows: r.rows,
        }
    }

    /// Publish an event of this session; its seq.
    pub fn emit(&self, kind: &str, fields: Value) -> u64 {
        let fields = match fields {
            Value::Object(m) => m,
            _ => Map::new(),
        };
        let seq = self.hub.publish(&self.id, kind, fields, self.meta());
        let mut r = lock(&self.record);
        r.seq = r.seq.max(seq);
        seq
    }

    /// The conversation (wire sessions).
    pub fn chat(&self) -> MutexGuard<'_, Conversation> {
        lock(&self.chat)
    }

    /// Publish an event that is also a chat turn.
    pub fn emit_chat(&self, kind: &str, fields: Value, mut turn: super::chat::ChatTurn) {
        turn.seq = self.emit(kind, fields);
        let seq = turn.seq;
        lock(&self.chat).push(turn);
        self.chat_tx.send_replace(seq);
    }

    pub fn set_pid(&self, pid: u32) {
        lock(&self.record).pid = Some(pid);
    }

    pub fn set_exit_code(&self, code: Option<i32>) {
        lock(&self.record).exit_code = code;
    }

    pub fn set_actor(&self, actor: &ActorRef<SessionMsg>) {
        *lock(&self.actor) = Some(actor.clone());
    }

    /// The run `myself` ends: forget it as the current one.
    pub fn clear_actor(&self, myself: &ActorRef<SessionMsg>) {
        let mut a = lock(&self.actor);
        if a.as_ref().is_some_and(|a| a.get_id() == myself.get_id()) {
            *a = None;
        }
    }

    /// The start of a run of the program, for both kinds of session:
    /// `Ok(true)` for the first run; on a restart run, what the previous
    /// run left is killed, `restarting` is published and the session moves
    /// `lost → starting`.
    ///
    /// # Errors
    /// The session has exited, or the restart is refused (a `shutdown:`
    /// reason: the supervisor does not restart it).
    pub async fn begin_run(&self) -> Result<bool, ActorProcessingErr> {
        let first = lock(&self.record).pid.is_none() && self.state() == State::Starting;
        match self.state() {
            State::Exited => return Err("shutdown:the session has exited".into()),
            State::Starting => {}
            s => {
                if s != State::Lost {
                    // The previous run crashed without reporting its end.
                    let _ = self.apply(Input::Crash { restart: true });
                }
                // Whatever the previous run left behind goes first.
                self.kill_tree().await;
                let restarts = {
                    let mut r = lock(&self.record);
                    r.restarts += 1;
                    r.exit_code = None;
                    r.restarts
                };
                self.emit("restarting", json!({"restarts": restarts}));
                self.apply(Input::Restart)
                    .map_err(|e| format!("shutdown:restart refused: {e}"))?;
            }
        }
        Ok(first)
    }

    /// A run that was stopped from outside (the visor shutting down, the
    /// session terminated while live): the tree goes with it.
    pub async fn end_run(&self, myself: &ActorRef<SessionMsg>) {
        self.clear_actor(myself);
        if matches!(
            self.state(),
            State::Starting | State::Running | State::Idle | State::Waiting | State::Suspended
        ) {
            self.kill_tree().await;
            let _ = self.apply(Input::Stop);
        }
    }

    /// Apply a state machine input; publish its moves.
    pub fn apply(&self, input: Input) -> Result<Outcome, Refused> {
        let now = self.origin.elapsed();
        let out = {
            let mut r = lock(&self.record);
            let out = r.machine.apply(input, now)?;
            if !out.moves.is_empty() {
                r.updated_at = crate::wire::types::now_rfc3339();
            }
            out
        };
        for s in &out.moves {
            self.emit("session_state", json!({"state": s.as_str()}));
            if *s == State::Exited {
                let code = lock(&self.record).exit_code;
                self.ended_tx.send_replace(Some(code));
            }
        }
        Ok(out)
    }

    pub fn set_error(&self, error: String) {
        lock(&self.record).error = Some(error.clone());
        self.emit("error", json!({"error": error}));
    }

    pub fn screen_view(&self) -> super::types::ScreenView {
        lock(&self.screen).view()
    }

    /// A redraw of the screen and the output seq it stands for.
    pub fn snapshot(&self) -> (u64, Vec<u8>) {
        let s = lock(&self.screen);
        (s.fed(), s.redraw())
    }

    pub fn lease(&self) -> Lease {
        *lock(&self.lease)
    }

    /// Change the lease; tell attached clients when it changed.
    pub fn with_lease(&self, f: impl FnOnce(&mut Lease) -> bool) -> bool {
        let mut l = lock(&self.lease);
        let changed = f(&mut l);
        if changed {
            self.lease_tx.send_replace(*l);
        }
        changed
    }

    pub fn may_write(&self, w: Writer) -> Result<(), VisorError> {
        let l = lock(&self.lease);
        match w {
            Writer::Api if l.free() => Ok(()),
            Writer::Api => Err(VisorError::State(
                "an attached client holds the writer lease".into(),
            )),
            Writer::Client(c) if l.may_write(c) => Ok(()),
            Writer::Client(_) => Err(VisorError::State("not_writer".into())),
        }
    }

    /// Kill every process of this session (the last run's tree and any
    /// escapee carrying the scope tag), off the runtime's threads.
    pub async fn kill_tree(&self) {
        let pid = lock(&self.record).pid.map(|p| p as i32);
        let scope = self.scope.clone();
        let _ = tokio::task::spawn_blocking(move || sys::kill_tree(pid, pid, &scope)).await;
    }
}

type Reply = RpcReplyPort<Result<(), VisorError>>;

/// What `answer` says (VISOR.md §2).
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AnswerSpec {
    pub request_id: String,
    pub allow: bool,
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default)]
    pub updated_input: Option<Value>,
}

pub enum SessionMsg {
    /// New output in the scrollback (at most one queued).
    Output,
    /// The program ended (its leftovers killed, the PTY drained).
    Exited(i32),
    Write(Bytes, Writer, Option<Reply>),
    /// Paste text (bracketed when the program asked for it).
    Paste(String, Writer, Reply),
    Resize(u16, u16, Writer, Reply),
    Interrupt(Writer, Reply),
    /// End the session; the reply comes once the tree is gone.
    Stop(Reply),
    /// The stop grace passed.
    Escalate,
    /// Test hook (`BMX_VISOR_TEST_HOOKS=1`): panic in the handler.
    Panic,
    /// `send`: a PTY types it and Enter; a wire agent gets a prompt now
    /// or when it is next idle.
    Send(String, Writer, RpcReplyPort<Result<Delivery, VisorError>>),
    /// `answer` a pending request (wire sessions).
    Answer(AnswerSpec, Reply),
    /// Wire sessions: what the agent's stdio brought.
    Peer(crate::executor::stdio_peer::PeerEvent),
    /// Wire sessions: a request's deadline passed.
    Expire(String),
    /// Wire sessions: the agent's deadline to open its session passed.
    InitTimeout,
}

/// One run of a session's program.
#[derive(Clone)]
pub struct SessionActor;

pub struct Run {
    data: Arc<SessionData>,
    pid: u32,
    master: OwnedFd,
    input: Option<mpsc::Sender<Bytes>>,
    stopping: bool,
    stop_waiters: Vec<Reply>,
}

impl Run {
    fn write(&self, data: Bytes) -> Result<(), VisorError> {
        let Some(tx) = &self.input else {
            return Err(VisorError::State("the session's program has ended".into()));
        };
        if data.is_empty() {
            return Ok(());
        }
        tx.try_send(data)
            .map_err(|_| VisorError::Busy("the session's input queue is full".into()))
    }

    /// Feed new output to the screen; answer the queries in it.
    fn take_output(&mut self) {
        self.data.output.poke_taken();
        let from = lock(&self.data.screen).fed() + 1;
        let replay = self.data.output.with(|sb| sb.replay(from));
        let mut replies = Vec::new();
        {
            let mut screen = lock(&self.data.screen);
            for (seq, chunk) in &replay.chunks {
                replies.extend(screen.feed(*seq, chunk));
            }
        }
        if !replies.is_empty() {
            let _ = self.write(Bytes::from(replies));
        }
    }

    /// SIGHUP and SIGTERM to the program's group and every descendant (an
    /// interactive shell ignores SIGTERM but not SIGHUP).
    fn terminate(&self) {
        let pid = self.pid as i32;
        tokio::task::spawn_blocking(move || {
            for sig in [Signal::SIGHUP, Signal::SIGTERM, Signal::SIGCONT] {
                sys::signal_group(pid, sig);
                for d in sys::descendants(pid) {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(d), sig);
                }
            }
        });
    }
}

/// The program's environment: the visor's (minus `BMX_*`), the spec's
/// `env`, `BMX_SCOPE` and the `BMX_VISOR_*` variables.
pub fn child_env(data: &SessionData, tty: Tty) -> Result<Vec<(String, String)>, String> {
    let mut env = ChildEnv::from_process(&[])
        .build(data.checked.spec.env.as_ref(), tty, &data.scope)
        .map_err(|e| format!("shutdown:{e}"))?;
    env.retain(|(k, _)| !data.visor_env.iter().any(|(v, _)| v == k));
    env.extend(data.visor_env.iter().cloned());
    Ok(env)
}

impl Actor for SessionActor {
    type Msg = SessionMsg;
    type State = Run;
    type Arguments = Arc<SessionData>;

    async fn pre_start(
        &self,
        myself: ActorRef<SessionMsg>,
        data: Arc<SessionData>,
    ) -> Result<Run, ActorProcessingErr> {
        let first = data.begin_run().await?;
        let env = child_env(&data, Tty::Pty)?;
        let (cols, rows) = *data.size_tx.borrow();
        let argv = &data.checked.argv;
        let spawned = match pty::spawn(argv, &data.checked.cwd, env, cols, rows, None) {
            Ok(s) => s,
            // The first run's failure is the caller's (a 400); a restart's
            // counts against the budget.
            Err(e) if first => return Err(format!("shutdown:cannot start {}: {e}", argv[0]).into()),
            Err(e) => return Err(format!("{LOST}: cannot start {}: {e}", argv[0]).into()),
        };
        data.output.poke_taken();
        let (poke, done) = (myself.clone(), myself.clone());
        let tx = pty::run(
            &spawned.master,
            spawned.exit,
            spawned.pid,
            data.output.clone(),
            data.scope.clone(),
            move || poke.send_message(SessionMsg::Output).is_ok(),
            move |code| {
                let _ = done.send_message(SessionMsg::Exited(code));
            },
        )?;
        data.set_pid(spawned.pid);
        data.set_actor(&myself);
        if first {
            data.emit(
                "init",
                json!({"kind": "pty", "command": data.checked.argv, "pid": spawned.pid, "cols": cols, "rows": rows}),
            );
        }
        data.apply(Input::Started { idle: false })
            .map_err(|e| format!("shutdown:{e}"))?;
        tracing::info!(session = %data.id, pid = spawned.pid, "visor session started");
        Ok(Run {
            data,
            pid: spawned.pid,
            master: spawned.master,
            input: Some(tx),
            stopping: false,
            stop_waiters: Vec::new(),
        })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<SessionMsg>,
        run: &mut Run,
    ) -> Result<(), ActorProcessingErr> {
        run.data.end_run(&myself).await;
        for w in run.stop_waiters.drain(..) {
            let _ = w.send(Ok(()));
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<SessionMsg>,
        msg: SessionMsg,
        run: &mut Run,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SessionMsg::Output => run.take_output(),
            SessionMsg::Write(bytes, w, reply) => {
                let r = run.data.may_write(w).and_then(|()| run.write(bytes));
                if let Some(reply) = reply {
                    let _ = reply.send(r);
                }
            }
            SessionMsg::Paste(text, w, reply) => {
                let r = run.data.may_write(w).and_then(|()| {
                    let bracketed = lock(&run.data.screen).bracketed_paste();
                    let mut b = Vec::with_capacity(text.len() + 12);
                    if bracketed {
                        b.extend_from_slice(b"\x1b[200~");
                    }
                    // The end marker inside the text would end the paste early.
                    b.extend_from_slice(text.replace("\x1b[201~", "").as_bytes());
                    if bracketed {
                        b.extend_from_slice(b"\x1b[201~");
                    }
                    run.write(Bytes::from(b))
                });
                let _ = reply.send(r);
            }
            SessionMsg::Resize(cols, rows, w, reply) => {
                let r = run.data.may_write(w).and_then(|()| {
                    pty::resize(&run.master, cols, rows)
                        .map_err(|e| VisorError::State(format!("cannot resize: {e}")))?;
                    lock(&run.data.screen).resize(cols, rows);
                    {
                        let mut rec = lock(&run.data.record);
                        rec.cols = cols;
                        rec.rows = rows;
                    }
                    run.data.size_tx.send_replace((cols, rows));
                    Ok(())
                });
                let _ = reply.send(r);
            }
            SessionMsg::Interrupt(w, reply) => {
                let r = run
                    .data
                    .may_write(w)
                    .and_then(|()| run.write(Bytes::from_static(b"\x03")));
                let _ = reply.send(r);
            }
            SessionMsg::Stop(reply) => {
                if !run.data.state().live() {
                    let _ = reply.send(Err(VisorError::State("the session has exited".into())));
                    return Ok(());
                }
                run.stop_waiters.push(reply);
                if !run.stopping {
                    tracing::info!(session = %run.data.id, "stopping visor session");
                    run.stopping = true;
                    run.input = None;
                    run.terminate();
                    myself.send_after(STOP_GRACE, || SessionMsg::Escalate);
                }
            }
            SessionMsg::Escalate => {
                if run.data.state().live() {
                    let (pid, scope) = (run.pid as i32, run.data.scope.clone());
                    tokio::task::spawn_blocking(move || {
                        sys::kill_tree(Some(pid), Some(pid), &scope)
                    });
                }
            }
            SessionMsg::Panic => panic!("injected panic (test hook)"),
            SessionMsg::Send(text, w, reply) => {
                let mut b = text.into_bytes();
                b.push(b'\r');
                let r = run
                    .data
                    .may_write(w)
                    .and_then(|()| run.write(Bytes::from(b)));
                let _ = reply.send(r.map(|()| Delivery::Prompted));
            }
            SessionMsg::Answer(a, reply) => {
                // PTY sessions never have pending requests.
                let _ = reply.send(Err(VisorError::NotFound(format!(
                    "no pending request {:?}",
                    a.request_id
                ))));
            }
            SessionMsg::Peer(_) | SessionMsg::Expire(_) | SessionMsg::InitTimeout => {}
            SessionMsg::Exited(code) => {
                run.take_output();
                run.input = None;
                lock(&run.data.record).exit_code = Some(code);
                tracing::info!(session = %run.data.id, exit_code = code, "visor session program ended");
                let restart = !run.stopping && run.data.restart_mode() != RestartMode::None;
                run.data.emit("exit", json!({"exitCode": code}));
                if run.stopping {
                    let _ = run.data.apply(Input::Stop);
                } else {
                    let _ = run.data.apply(Input::Exit { restart });
                }
                for w in run.stop_waiters.drain(..) {
                    let _ = w.send(Ok(()));
                }
                if restart {
                    myself.stop(Some(format!("{LOST}: exit code {code}")));
                } else {
                    myself.stop(None);
                }
            }
        }
        Ok(())
    }
}

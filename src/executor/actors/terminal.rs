//! One terminal: a program on a PTY, its numbered scrollback, the streams
//! attached to it, and the single-writer rule (PROTOCOL.md §8).
//!
//! The PTY reader pushes straight into the shared scrollback and pokes this
//! actor (at most one poke queued), so a program is never slowed by bmx and
//! a flood cannot grow the mailbox. The actor owns everything else: the
//! streams' cursors, the writer epoch, the input queue, the lifecycle.
//! Terminals are executor-scoped: a dropped connection pauses delivery, and
//! the next one resumes every stream from its last acknowledged seq.

// `RpcError` is the error type of every handler in bmx; boxing it here alone
// would only make this module differ from its neighbours.
#![allow(clippy::result_large_err)]

pub mod host;
pub mod pty;
pub mod stream;

use super::terminals::TerminalsMsg;
use crate::executor::config::env_refusal;
use crate::executor::Shared;
use crate::process::env::{EnvError, Tty};
use crate::process::sys;
use crate::wire::types::{
    now_rfc3339, Accepted, TerminalAttachParams, TerminalAttachResult, TerminalCloseParams,
    TerminalCloseResult, TerminalExitedParams, TerminalInputParams, TerminalOpenParams,
    TerminalOpenResult, TerminalResizeParams,
};
use crate::wire::{Link, Method, Responder, RpcError};
use bytes::Bytes;
use nix::sys::signal::Signal;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use stream::NotifyStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Streams attached at once; a new one past this evicts the least recently
/// attached or acknowledged (the protocol has no detach, so viewers that
/// went away must not hold slots forever).
pub const MAX_STREAMS: usize = 16;

pub enum TerminalMsg {
    /// `terminal.open` of an existing (or just started) terminal: answer the
    /// current state.
    Open(Responder),
    Attach(TerminalAttachParams, Responder),
    Input(TerminalInputParams, Option<Responder>),
    Resize(TerminalResizeParams, Responder),
    Close(TerminalCloseParams, Responder),
    /// Input frame from a host stream.
    HostInput {
        stream_id: String,
        token: u64,
        data: Bytes,
    },
    /// A host stream's socket closed (or never opened).
    HostGone {
        stream_id: String,
        token: u64,
    },
    /// New output in the scrollback.
    Output,
    /// The program ended; what it left behind is killed and the PTY drained.
    Exited(i32),
    /// The grace period of a close passed.
    Escalate,
    /// The connection came back: streams resume from their acked seq.
    Reconnected,
    /// Test hook: panic in the handler (a crash the tests inject).
    #[doc(hidden)]
    Panic,
}

pub struct TerminalArgs {
    pub shared: Arc<Shared>,
    pub spec: TerminalOpenParams,
    pub terminals: ActorRef<TerminalsMsg>,
    pub scope: String,
}

enum StreamKind {
    Notify(NotifyStream),
    Host {
        token: u64,
        cancel: CancellationToken,
    },
}

struct Attached {
    kind: StreamKind,
    /// Last attach or ack (a logical clock), for eviction.
    touched: u64,
}

impl Drop for Attached {
    fn drop(&mut self) {
        if let StreamKind::Host { cancel, .. } = &self.kind {
            cancel.cancel();
        }
    }
}

pub struct TerminalActor;

pub struct TerminalState {
    shared: Arc<Shared>,
    id: String,
    terminals: ActorRef<TerminalsMsg>,
    scope: String,
    /// The terminal's own sandbox (issue 48): like a session's, with its
    /// own directory as the workspace.
    jail: Jail,
    pid: u32,
    created_at: String,
    cols: u16,
    rows: u16,
    output: Arc<pty::Output>,
    /// For TIOCSWINSZ.
    master: OwnedFd,
    input: Option<mpsc::Sender<Bytes>>,
    streams: HashMap<String, Attached>,
    clock: u64,
    next_token: u64,
    writer: Option<String>,
    writer_epoch: u64,
    exit_code: Option<i32>,
    exit_notified: bool,
    closing: bool,
    close_waiters: Vec<Responder>,
    /// The connection streams last sent on: when it is closed and another
    /// is up, streams resume (even before `Reconnected` arrives).
    link: Option<Link>,
}

fn not_writer() -> RpcError {
    RpcError::conflict("not_writer", "this stream is not the terminal's writer")
        .with_terminal_code("not_writer")
}

/// Checks that need no PTY, done before anything is spawned.
pub fn validate(shared: &Shared, spec: &TerminalOpenParams) -> Result<(), RpcError> {
    if let Some(kind) = spec.kind.as_deref().filter(|k| *k != "pty") {
        return Err(RpcError::invalid_params(format!(
            "terminal kind {kind:?} is not offered (only \"pty\")"
        )));
    }
    if spec
        .argv
        .as_ref()
        .is_some_and(|a| a.iter().any(|s| s.contains('\0')))
    {
        return Err(RpcError::invalid_params("argv contains a NUL byte"));
    }
    shared
        .config
        .child_env()
        .check(spec.env.as_ref())
        .map_err(|e| env_refusal(&e))?;
    if let (Some(ws), Some(c)) = (&shared.config.workspace, &spec.cwd) {
        if let Err(e) = crate::tools::boundary::resolve(ws, c) {
            return Err(
                RpcError::invalid_params(format!("invalid working directory: {e}"))
                    .with_reason("workspace_boundary"),
            );
        }
    }
    // A sandboxed terminal's `cwd` is beneath its own new directory
    // (`cwd`, below); without a sandbox it is a path on the machine.
    if !shared.sandboxes.is_on() && shared.config.workspace.is_none() {
        if let Some(c) = &spec.cwd {
            if !std::path::Path::new(c).is_dir() {
                return Err(RpcError::invalid_params(format!(
                    "cwd {c} is not a directory"
                )));
            }
        }
    }
    if let Some(ws) = &shared.config.workspace {
        let cwd = spec
            .cwd
            .as_deref()
            .map_or(Ok(ws.clone()), |c| crate::tools::boundary::resolve(ws, c));
        if !cwd.is_ok_and(|c| c.is_dir()) {
            return Err(RpcError::invalid_params(
                "cwd is not a directory in the workspace",
            ));
        }
    }
    Ok(())
}

/// `cwd`, else `$HOME`, else the work root (terminals belong to the
/// executor, not to a session workspace).
///
/// A bound executor resolves it inside its workspace (symlinks followed)
/// and defaults to the workspace; `validate` refused anything outside.
/// A terminal's sandbox and the directories it owns.
#[derive(Clone)]
struct Jail {
    sandbox: Arc<crate::sandbox::Sandbox>,
    /// Its workspace (`<work_root>/terminals/<id>`), removed at its end;
    /// `None` for a bound executor's one workspace.
    own: Option<PathBuf>,
    private: PathBuf,
    workspace: PathBuf,
}

impl Jail {
    /// Blocking: directories and a cgroup.
    fn make(shared: &Shared, id: &str) -> Result<Jail, String> {
        use crate::executor::workroot;
        let root = &shared.config.work_root;
        let (workspace, own) = match &shared.config.workspace {
            Some(ws) => (ws.clone(), None),
            None => {
                let d =
                    workroot::make_session_dir(root, "terminals", id).map_err(|e| e.to_string())?;
                (d.clone(), Some(d))
            }
        };
        let private = workroot::make_session_dir(root, "private", &format!("t-{id}"))
            .map_err(|e| e.to_string())?;
        let bounds = shared.config.sandbox.bounds;
        match shared.sandboxes.make(
            &crate::sandbox::terminal_name(id),
            &workspace,
            &private,
            &bounds,
        ) {
            Ok(sandbox) => Ok(Jail {
                sandbox: Arc::new(sandbox),
                own,
                private,
                workspace,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&private);
                Err(e.to_string())
            }
        }
    }

    /// Kill everything the terminal started, remove its cgroup and
    /// directories. Blocking.
    fn end(&self, scope: &str) {
        if self.sandbox.contained() {
            self.sandbox.kill();
        } else {
            sys::kill_scope(None, scope);
        }
        self.sandbox.end(&self.private);
        if let Some(d) = &self.own {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// The working directory: `cwd` beneath the terminal's workspace
/// (relative, or absolute inside it), else the workspace itself. Without
/// a sandbox (`--sandbox off`), as before: `cwd` as given, else `$HOME`.
fn cwd(shared: &Shared, jail: &Jail, spec: &TerminalOpenParams) -> PathBuf {
    if shared.sandboxes.is_on() || shared.config.workspace.is_some() {
        let ws = &jail.workspace;
        return match &spec.cwd {
            Some(c) => crate::tools::boundary::resolve(ws, c).unwrap_or_else(|_| ws.clone()),
            None => ws.clone(),
        };
    }
    match &spec.cwd {
        Some(c) => PathBuf::from(c),
        None => std::env::var_os("HOME")
            .map(PathBuf::from)
            .filter(|h| h.is_dir())
            .unwrap_or_else(|| jail.workspace.clone()),
    }
}

/// The child's environment, by the executor's one policy
/// (`process::env`): the executor's minus `BMX_*` and denied names, the
/// sandbox's own `TMPDIR` and `HOME`, the spec's, `TERM` for the PTY
/// unless set, and (without a cgroup) the scope tag that finds the tree
/// later.
fn env(
    shared: &Shared,
    jail: &Jail,
    spec: &TerminalOpenParams,
    scope: &str,
) -> Result<Vec<(String, String)>, EnvError> {
    jail.sandbox
        .child_env(shared.config.child_env())
        .build(spec.env.as_ref(), Tty::Pty, scope)
}

impl TerminalState {
    fn snapshot(&self) -> TerminalOpenResult {
        let (earliest_seq, latest_seq) =
            self.output.with(|sb| (sb.earliest_seq(), sb.latest_seq()));
        TerminalOpenResult {
            terminal_id: self.id.clone(),
            pid: self.pid,
            cols: self.cols,
            rows: self.rows,
            created_at: self.created_at.clone(),
            epoch: self.writer_epoch,
            earliest_seq,
            latest_seq,
        }
    }

    fn latest(&self) -> u64 {
        self.output.with(|sb| sb.latest_seq())
    }

    fn is_writer(&self, stream_id: &str, epoch: u64) -> bool {
        self.writer.as_deref() == Some(stream_id) && epoch == self.writer_epoch
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Make room for one more stream.
    fn evict(&mut self) {
        while self.streams.len() >= MAX_STREAMS {
            let Some(oldest) = self
                .streams
                .iter()
                .min_by_key(|(_, s)| s.touched)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            tracing::info!(terminal = %self.id, stream = %oldest, "evicting the least recent stream");
            self.streams.remove(&oldest);
        }
    }

    /// Send what every notification stream's window allows; resume them
    /// first if the connection was replaced.
    fn deliver(&mut self) {
        let Some(link) = self.shared.link() else {
            return;
        };
        if self.link.as_ref().is_some_and(|l| l.is_closed()) {
            let latest = self.latest();
            for s in self.streams.values_mut() {
                if let StreamKind::Notify(n) = &mut s.kind {
                    n.resume(latest);
                }
            }
        }
        self.link = Some(link.clone());
        let window = self.shared.config.terminal_window_bytes;
        for (sid, s) in self.streams.iter_mut() {
            if let StreamKind::Notify(n) = &mut s.kind {
                if n.deliver(&link, &self.output, &self.id, sid, window)
                    .is_err()
                {
                    // The connection is going; the next one resumes.
                    return;
                }
            }
        }
        if let (Some(code), false) = (self.exit_code, self.exit_notified) {
            if !self.closing {
                let sent = link.notify(
                    Method::TerminalExited,
                    &TerminalExitedParams {
                        terminal_id: self.id.clone(),
                        exit_code: code,
                    },
                );
                self.exit_notified = sent.is_ok();
            }
        }
    }

    fn attach(
        &mut self,
        myself: &ActorRef<TerminalMsg>,
        p: TerminalAttachParams,
        reply: Responder,
    ) {
        if p.stream_id.is_empty() {
            return reply.err(RpcError::invalid_params("streamId is empty"));
        }
        // The writer rule: a higher epoch takes the role; the writer keeps it
        // by re-attaching with its epoch, and gives it up by re-attaching
        // without canWrite.
        if p.can_write && (p.epoch > self.writer_epoch || self.is_writer(&p.stream_id, p.epoch)) {
            self.writer = Some(p.stream_id.clone());
            self.writer_epoch = p.epoch;
        } else if !p.can_write && self.writer.as_deref() == Some(p.stream_id.as_str()) {
            self.writer = None;
        }
        let answer = TerminalAttachResult {
            accepted: true,
            writer_epoch: self.writer_epoch,
        };
        let latest = self.latest();
        let touched = self.tick();
        match p.host {
            Some(h) => {
                self.streams.remove(&p.stream_id);
                self.evict();
                self.next_token += 1;
                let cancel = CancellationToken::new();
                let task = host::HostStream {
                    url: h.url,
                    ticket: h.ticket,
                    terminal_id: self.id.clone(),
                    stream_id: p.stream_id.clone(),
                    token: self.next_token,
                    from_seq: p.from_seq,
                    live_from: latest + 1,
                    output: self.output.clone(),
                    terminal: myself.clone(),
                    cancel: cancel.clone(),
                };
                self.streams.insert(
                    p.stream_id,
                    Attached {
                        kind: StreamKind::Host {
                            token: self.next_token,
                            cancel,
                        },
                        touched,
                    },
                );
                tokio::spawn(task.run(reply, answer));
            }
            None => {
                match self.streams.get_mut(&p.stream_id) {
                    Some(Attached {
                        kind: StreamKind::Notify(n),
                        touched: t,
                    }) => {
                        n.reattach(p.from_seq, latest);
                        if let Some(a) = p.ack_seq {
                            n.ack(a);
                        }
                        *t = touched;
                    }
                    _ => {
                        self.streams.remove(&p.stream_id);
                        self.evict();
                        let mut n = NotifyStream::new(p.from_seq, latest);
                        if let Some(a) = p.ack_seq {
                            n.ack(a);
                        }
                        self.streams.insert(
                            p.stream_id,
                            Attached {
                                kind: StreamKind::Notify(n),
                                touched,
                            },
                        );
                    }
                }
                // The answer goes out before the replay it starts.
                reply.ok(&answer);
                self.deliver();
            }
        }
    }

    /// Queue input for the PTY if `stream_id`/`epoch` is the writer.
    fn write(&mut self, stream_id: &str, epoch: u64, data: Bytes) -> Result<(), RpcError> {
        if !self.is_writer(stream_id, epoch) {
            return Err(not_writer());
        }
        let Some(tx) = &self.input else {
            return Err(RpcError::conflict(
                "terminal_exited",
                "the terminal's program has ended",
            ));
        };
        let limit = self.shared.limits().process_write_bytes();
        if data.len() as u64 > limit {
            return Err(RpcError::payload_too_large(format!(
                "input is limited to {limit} bytes"
            )));
        }
        if !data.is_empty() && tx.try_send(data).is_err() {
            return Err(RpcError::resource_unavailable(
                "terminal input queue is full",
            ));
        }
        Ok(())
    }

    fn resize(&mut self, p: &TerminalResizeParams) -> Result<(), RpcError> {
        let allowed = match &p.stream_id {
            Some(sid) => self.is_writer(sid, p.epoch.unwrap_or(self.writer_epoch)),
            // Without a stream, only while nobody holds the writer role.
            None => self.writer.is_none(),
        };
        if !allowed {
            return Err(not_writer());
        }
        if p.cols == 0 || p.rows == 0 {
            return Err(RpcError::invalid_params("cols and rows must be positive"));
        }
        pty::resize(&self.master, p.cols, p.rows)
            .map_err(|e| RpcError::internal(format!("TIOCSWINSZ: {e}")))?;
        self.cols = p.cols;
        self.rows = p.rows;
        Ok(())
    }

    /// SIGHUP the program's group and every descendant (a shell puts its
    /// jobs in groups of their own), off the actor's thread.
    fn hang_up(&self) {
        let pid = self.pid as i32;
        tokio::task::spawn_blocking(move || {
            sys::signal_group(pid, Signal::SIGHUP);
            for d in sys::descendants(pid) {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(d), Signal::SIGHUP);
            }
        });
    }

    fn kill_tree(&self) -> tokio::task::JoinHandle<()> {
        let (pid, scope) = (self.pid as i32, self.scope.clone());
        tokio::task::spawn_blocking(move || sys::kill_tree(Some(pid), Some(pid), &scope))
    }

    /// Closed: leave the registry first (so a re-open right after the
    /// answer starts a new terminal), answer, stop.
    fn finish(&mut self, myself: &ActorRef<TerminalMsg>) {
        let _ = self.terminals.send_message(TerminalsMsg::Gone {
            terminal_id: self.id.clone(),
            actor: myself.get_id(),
        });
        let answer = TerminalCloseResult {
            closed: true,
            exit_code: self.exit_code,
        };
        for r in self.close_waiters.drain(..) {
            r.ok(&answer);
        }
        self.streams.clear();
        myself.stop(Some("closed".into()));
    }
}

impl Actor for TerminalActor {
    type Msg = TerminalMsg;
    type State = TerminalState;
    type Arguments = TerminalArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<TerminalMsg>,
        args: TerminalArgs,
    ) -> Result<TerminalState, ActorProcessingErr> {
        let spec = &args.spec;
        let argv = pty::command_line(spec);
        let (cols, rows) = (spec.cols.max(1), spec.rows.max(1));
        let jail = {
            let (shared, id) = (args.shared.clone(), spec.terminal_id.clone());
            tokio::task::spawn_blocking(move || Jail::make(&shared, &id)).await??
        };
        let spawned = match env(&args.shared, &jail, spec, &args.scope)
            .map_err(|e| e.to_string())
            .and_then(|env| {
                pty::spawn(
                    &argv,
                    &cwd(&args.shared, &jail, spec),
                    env,
                    cols,
                    rows,
                    jail.sandbox.confinement(),
                )
                .map_err(|e| format!("{}: {e}", argv[0]))
            }) {
            Ok(s) => s,
            Err(e) => {
                let scope = args.scope.clone();
                let _ = tokio::task::spawn_blocking(move || jail.end(&scope)).await;
                return Err(e.into());
            }
        };
        let output = pty::Output::new(args.shared.config.terminal_scrollback_bytes);
        let (poke, done) = (myself.clone(), myself.clone());
        let tx = pty::run(
            &spawned.master,
            spawned.exit,
            spawned.pid,
            output.clone(),
            args.scope.clone(),
            move || poke.send_message(TerminalMsg::Output).is_ok(),
            move |code| {
                let _ = done.send_message(TerminalMsg::Exited(code));
            },
        )?;
        tracing::info!(terminal = %spec.terminal_id, pid = spawned.pid, argv = ?argv, "terminal opened");
        Ok(TerminalState {
            shared: args.shared,
            id: spec.terminal_id.clone(),
            terminals: args.terminals,
            scope: args.scope,
            jail,
            pid: spawned.pid,
            created_at: now_rfc3339(),
            cols,
            rows,
            output,
            master: spawned.master,
            input: Some(tx),
            streams: HashMap::new(),
            clock: 0,
            next_token: 0,
            writer: None,
            writer_epoch: 0,
            exit_code: None,
            exit_notified: false,
            closing: false,
            close_waiters: Vec::new(),
            link: None,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<TerminalMsg>,
        state: &mut TerminalState,
    ) -> Result<(), ActorProcessingErr> {
        state.streams.clear();
        if state.exit_code.is_none() {
            let _ = state.kill_tree().await;
        }
        // Whatever the program left running dies with its cgroup, and the
        // terminal's directories go.
        let (jail, scope) = (state.jail.clone(), state.scope.clone());
        let _ = tokio::task::spawn_blocking(move || jail.end(&scope)).await;
        for r in state.close_waiters.drain(..) {
            r.ok(&TerminalCloseResult {
                closed: true,
                exit_code: state.exit_code,
            });
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<TerminalMsg>,
        msg: TerminalMsg,
        state: &mut TerminalState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TerminalMsg::Open(reply) => reply.ok(&state.snapshot()),
            TerminalMsg::Attach(p, reply) => state.attach(&myself, p, reply),
            TerminalMsg::Input(p, reply) => {
                let result = state.write(&p.stream_id, p.epoch, p.data.0);
                match reply {
                    Some(r) => r.send(result.map(|()| Accepted::YES)),
                    None => {
                        if let Err(e) = result {
                            tracing::debug!(terminal = %state.id, stream = %p.stream_id, error = %e.message, "input notification refused");
                        }
                    }
                }
            }
            TerminalMsg::HostInput {
                stream_id,
                token,
                data,
            } => {
                let current = matches!(
                    state.streams.get(&stream_id),
                    Some(Attached { kind: StreamKind::Host { token: t, .. }, .. }) if *t == token
                );
                let epoch = state.writer_epoch;
                if !current || state.write(&stream_id, epoch, data).is_err() {
                    tracing::debug!(terminal = %state.id, stream = %stream_id, "host input refused");
                }
            }
            TerminalMsg::HostGone { stream_id, token } => {
                if matches!(
                    state.streams.get(&stream_id),
                    Some(Attached { kind: StreamKind::Host { token: t, .. }, .. }) if *t == token
                ) {
                    state.streams.remove(&stream_id);
                }
            }
            TerminalMsg::Resize(p, reply) => reply.send(state.resize(&p).map(|()| Accepted::YES)),
            TerminalMsg::Close(p, reply) => {
                if state.exit_code.is_some() {
                    state.close_waiters.push(reply);
                    state.closing = true;
                    state.finish(&myself);
                    return Ok(());
                }
                state.close_waiters.push(reply);
                if !state.closing {
                    tracing::info!(terminal = %state.id, reason = %p.reason, "closing terminal");
                    state.closing = true;
                    state.input = None;
                    state.hang_up();
                    let grace = state.shared.config.terminal_close_grace;
                    myself.send_after(grace, || TerminalMsg::Escalate);
                }
            }
            TerminalMsg::Panic => panic!("injected panic (test hook)"),
            TerminalMsg::Escalate => {
                if state.exit_code.is_none() {
                    state.kill_tree();
                }
            }
            TerminalMsg::Output => {
                state.output.poke_taken();
                state.deliver();
            }
            TerminalMsg::Exited(code) => {
                tracing::info!(terminal = %state.id, exit_code = code, "terminal program ended");
                state.exit_code = Some(code);
                state.input = None;
                if state.closing {
                    state.finish(&myself);
                } else {
                    // Flush what the window allows, then report the end.
                    state.deliver();
                }
            }
            TerminalMsg::Reconnected => state.deliver(),
        }
        Ok(())
    }
}

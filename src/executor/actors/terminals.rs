//! The terminals supervisor: executor-scoped PTY terminals by `terminalId`
//! (PROTOCOL.md §8).
//!
//! Holds only the registry (id → terminal actor + the spec it was opened
//! with); each terminal actor owns its PTY, scrollback and streams. A
//! terminal stays registered after its program ends (so viewers can still
//! replay the last output) until `terminal.close`; it counts toward
//! `maxSessions` until then.

use super::session::safe_name;
use super::terminal::{self, TerminalActor, TerminalArgs, TerminalMsg};
use crate::executor::Shared;
use crate::supervisor::dynamic::{self, ChildExit, DynamicMsg, DynamicSpec, DynamicSupervisor};
use crate::supervisor::{ChildSpec, Exit};
use crate::wire::types::{TerminalCapability, TerminalOpenParams};
use crate::wire::{Responder, RpcError};
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Terminal requests the router hands over, generated from the method table
/// (`terminal.input` may be a notification: no responder).
pub use crate::wire::request::TerminalRequest;

pub enum TerminalsMsg {
    Request(TerminalRequest, Option<Responder>),
    /// The connection came back: attached streams resume.
    Reconnected,
    /// A terminal was closed: free its id (sent before the close answer, so
    /// a re-open after the answer finds the id free).
    Gone {
        terminal_id: String,
        actor: ActorId,
    },
    /// A terminal actor ended (from the terminals' dynamic supervisor).
    Exited(ChildExit),
    /// Test hook: crash one terminal's actor.
    #[doc(hidden)]
    PanicTerminal(String),
}

/// What this executor advertises for terminals.
pub fn capability(shared: &Shared) -> Option<TerminalCapability> {
    Some(TerminalCapability {
        enabled: true,
        kinds: vec!["pty".into()],
        max_sessions: Some(shared.config.terminal_max_sessions),
    })
}

/// The `BMX_SCOPE` prefix of every terminal of this executor: apart from
/// the sessions' (`<instance>/`) so ending sessions never touches terminals.
pub fn terminals_scope(instance: &str) -> String {
    format!("{instance}~term/")
}

/// Spec identity for idempotent opens: what runs and where, not the size
/// (a viewer re-opening from a different window is the same terminal).
fn same_spec(a: &TerminalOpenParams, b: &TerminalOpenParams) -> bool {
    a.kind.as_deref().unwrap_or("pty") == b.kind.as_deref().unwrap_or("pty")
        && a.argv == b.argv
        && a.shell == b.shell
        && a.cwd == b.cwd
        && a.env == b.env
}

struct Entry {
    actor: ActorRef<TerminalMsg>,
    /// Its id under the supervisor: the terminal id and a serial, because
    /// a closed id may be opened again before the old actor's exit is seen.
    child: String,
    spec: TerminalOpenParams,
    scope: String,
}

#[derive(Clone)]
pub struct Terminals;

pub struct TerminalsState {
    shared: Arc<Shared>,
    /// The dynamic supervisor the terminal actors are `temporary` children of.
    sup: ActorRef<DynamicMsg>,
    terminals: HashMap<String, Entry>,
    serial: u64,
}

impl TerminalsState {
    async fn open(
        &mut self,
        myself: &ActorRef<TerminalsMsg>,
        p: TerminalOpenParams,
        reply: Responder,
    ) {
        if let Some(e) = self.terminals.get(&p.terminal_id) {
            if !same_spec(&e.spec, &p) {
                return reply.err(RpcError::conflict(
                    "terminal_id_spec_mismatch",
                    format!("terminal {:?} is open with a different spec", p.terminal_id),
                ));
            }
            if let Err(ractor::MessagingErr::SendErr(TerminalMsg::Open(reply))) =
                e.actor.send_message(TerminalMsg::Open(reply))
            {
                reply.err(RpcError::internal("terminal actor stopped"));
            }
            return;
        }
        let max = self.shared.config.terminal_max_sessions;
        if self.terminals.len() >= max as usize {
            return reply.err(RpcError::resource_unavailable(format!(
                "terminal.maxSessions ({max}) terminals are open"
            )));
        }
        if p.terminal_id.is_empty() {
            return reply.err(RpcError::invalid_params("terminalId is empty"));
        }
        if let Err(e) = terminal::validate(&self.shared, &p) {
            return reply.err(e);
        }
        let scope = format!(
            "{}{}",
            terminals_scope(&self.shared.instance),
            safe_name(&p.terminal_id)
        );
        let args = TerminalArgs {
            shared: self.shared.clone(),
            spec: p.clone(),
            terminals: myself.clone(),
            scope: scope.clone(),
        };
        self.serial += 1;
        let child = format!("{}#{}", p.terminal_id, self.serial);
        let spec = ChildSpec::temporary(child.clone(), TerminalActor, args);
        match dynamic::start_actor::<TerminalMsg>(&self.sup, spec).await {
            Ok(actor) => {
                let _ = actor.send_message(TerminalMsg::Open(reply));
                self.terminals.insert(
                    p.terminal_id.clone(),
                    Entry {
                        actor,
                        child,
                        spec: p,
                        scope,
                    },
                );
            }
            Err(e) => {
                let message = match e {
                    dynamic::StartChildError::Failed(inner) => inner,
                    other => other.to_string(),
                };
                tracing::info!(terminal = %p.terminal_id, %message, "terminal spawn failed");
                reply.err(
                    RpcError::invalid_params(format!("cannot start the program: {message}"))
                        .with_reason("spawn_failed"),
                );
            }
        }
    }

    fn forward(&self, request: TerminalRequest, reply: Option<Responder>) {
        let id = request.terminal_id().to_owned();
        let Some(e) = self.terminals.get(&id) else {
            if let Some(r) = reply {
                r.err(RpcError::not_found(format!("terminal {id:?} not found")));
            }
            return;
        };
        let msg = match (request, reply) {
            (TerminalRequest::TerminalAttach(p), Some(r)) => TerminalMsg::Attach(p, r),
            (TerminalRequest::TerminalInput(p), r) => TerminalMsg::Input(p, r),
            (TerminalRequest::TerminalResize(p), Some(r)) => TerminalMsg::Resize(p, r),
            (TerminalRequest::TerminalClose(p), Some(r)) => TerminalMsg::Close(p, r),
            // Requests that arrived as notifications: nobody to answer.
            _ => return,
        };
        // A send error drops the responder, which answers -32603.
        let _ = e.actor.send_message(msg);
    }

    /// A terminal actor ended: forget it; if it crashed, its post_stop may
    /// not have run, so kill its tree here.
    fn exited(&mut self, exit: ChildExit) {
        let key = self
            .terminals
            .iter()
            .find(|(_, e)| e.child == exit.id)
            .map(|(k, _)| k.clone());
        let entry = key
            .clone()
            .and_then(|k| self.terminals.remove(&k).map(|e| (k, e)));
        if let Exit::Abnormal(why) = &exit.exit {
            tracing::warn!(terminal = %exit.id, error = %why, "terminal actor failed");
            if let Some((id, e)) = entry {
                let sandboxes = self.shared.sandboxes.clone();
                tokio::task::spawn_blocking(move || {
                    sandboxes.kill_named(&crate::sandbox::terminal_name(&id));
                    crate::process::sys::kill_scope(None, &e.scope)
                });
            }
        }
    }
}

impl Actor for Terminals {
    type Msg = TerminalsMsg;
    type State = TerminalsState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        myself: ActorRef<TerminalsMsg>,
        shared: Arc<Shared>,
    ) -> Result<TerminalsState, ActorProcessingErr> {
        shared.set_terminals_actor(Some(myself.clone()));
        let me = myself.clone();
        let spec = DynamicSpec::new("terminals").on_exit(move |exit| {
            let _ = me.send_message(TerminalsMsg::Exited(exit));
        });
        let sup = DynamicSupervisor::start_linked(spec, myself.get_cell()).await?;
        // A restart after a crash: the terminals of the crashed incarnation
        // died with it without their cleanup; whatever carries the
        // terminals' tag now belongs to no terminal.
        let scope = terminals_scope(&shared.instance);
        let _ = tokio::task::spawn_blocking(move || crate::process::sys::kill_scope(None, &scope))
            .await;
        Ok(TerminalsState {
            shared,
            sup,
            terminals: HashMap::new(),
            serial: 0,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<TerminalsMsg>,
        state: &mut TerminalsState,
    ) -> Result<(), ActorProcessingErr> {
        state.shared.set_terminals_actor(None);
        // Each terminal kills its tree as it stops; then a sweep of the
        // terminals' scope catches anything that escaped (no orphans).
        state.terminals.clear();
        dynamic::shutdown(&state.sup, Duration::from_secs(10)).await;
        let scope = terminals_scope(&state.shared.instance);
        let _ = tokio::task::spawn_blocking(move || {
            crate::process::sys::kill_scope(None, &scope);
        })
        .await;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<TerminalsMsg>,
        msg: TerminalsMsg,
        state: &mut TerminalsState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TerminalsMsg::Request(TerminalRequest::TerminalOpen(p), Some(reply)) => {
                state.open(&myself, p, reply).await
            }
            TerminalsMsg::Request(TerminalRequest::TerminalOpen(_), None) => {}
            TerminalsMsg::Request(request, reply) => state.forward(request, reply),
            TerminalsMsg::Reconnected => {
                for e in state.terminals.values() {
                    let _ = e.actor.send_message(TerminalMsg::Reconnected);
                }
            }
            TerminalsMsg::Gone { terminal_id, actor } => {
                if state
                    .terminals
                    .get(&terminal_id)
                    .is_some_and(|e| e.actor.get_id() == actor)
                {
                    state.terminals.remove(&terminal_id);
                }
            }
            TerminalsMsg::Exited(exit) => state.exited(exit),
            TerminalsMsg::PanicTerminal(id) => {
                if let Some(e) = state.terminals.get(&id) {
                    let _ = e.actor.send_message(TerminalMsg::Panic);
                }
            }
        }
        Ok(())
    }
}

//! The dynamic supervisor: OTP's `simple_one_for_one`, Elixir's
//! `DynamicSupervisor`. Children are added at runtime (a session per
//! `session.assign`, a process per `process.start`, a connection per
//! accepted socket), each with its own restart type, backoff and restart
//! budget; the supervisor enforces its own restart intensity, tells the
//! owner about every exit through a callback, and stops all children
//! concurrently, each within its shutdown timeout, when it stops.
//!
//! The owner (the actor that decides *what* to start: the sessions actor,
//! a session, the harness) links this supervisor under itself and learns of
//! exits through [`DynamicSpec::on_exit`], a monitor in OTP's terms, not by
//! polling. It never handles its children's supervision events itself.
//!
//! Why a separate actor rather than the owner handling its children's
//! events: the restart rules (which exit restarts, how often, after which
//! delay, what happens past the budget) then live in one place for every
//! kind of child, and a child's crash is a message the owner handles like
//! any other, in its mailbox order.

use super::actor::ChildSpec;
use super::children::{Children, Decision};
use super::policy::{Exit, Intensity};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::sync::Arc;
use std::time::Duration;

/// How a child ended, as the owner learns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildExit {
    /// The child's id (its [`ChildSpec::id`]).
    pub id: String,
    /// How it ended.
    pub exit: Exit,
    /// A restart is scheduled. `false`: the child is gone for good (its
    /// type does not restart after this exit, or its budget ran out).
    pub restarting: bool,
}

/// The owner's exit callback. It runs inside the supervisor's handler: it
/// should only send a message.
pub type OnExit = Arc<dyn Fn(ChildExit) + Send + Sync>;

/// The owner's restart callback: a restarted child has a new address.
pub type OnRestart = Arc<dyn Fn(&str, ActorCell) + Send + Sync>;

/// A dynamic supervisor's configuration.
#[derive(Clone, Default)]
pub struct DynamicSpec {
    /// For logs.
    pub name: String,
    /// Restarts of all children together within a period; past it the
    /// supervisor stops every child and fails (escalates to its owner).
    /// `None`: only each child's own budget counts.
    pub intensity: Option<Intensity>,
    /// At most this many live children; `start_child` past it is refused.
    pub max_children: Option<usize>,
    pub on_exit: Option<OnExit>,
    pub on_restart: Option<OnRestart>,
}

impl DynamicSpec {
    pub fn new(name: impl Into<String>) -> Self {
        DynamicSpec {
            name: name.into(),
            ..Default::default()
        }
    }

    /// Report exits to `f` (typically a `send_message` to the owner).
    pub fn on_exit(mut self, f: impl Fn(ChildExit) + Send + Sync + 'static) -> Self {
        self.on_exit = Some(Arc::new(f));
        self
    }

    /// Tell the owner the new address of a restarted child.
    pub fn on_restart(mut self, f: impl Fn(&str, ActorCell) + Send + Sync + 'static) -> Self {
        self.on_restart = Some(Arc::new(f));
        self
    }

    pub fn intensity(mut self, intensity: Intensity) -> Self {
        self.intensity = Some(intensity);
        self
    }

    pub fn max_children(mut self, n: usize) -> Self {
        self.max_children = Some(n);
        self
    }
}

/// Why `start_child` failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartChildError {
    #[error("a child with id {0:?} is running")]
    AlreadyStarted(String),
    #[error("at most {0} children")]
    MaxChildren(usize),
    #[error("the child failed to start: {0}")]
    Failed(String),
    #[error("the supervisor is gone")]
    SupervisorGone,
}

/// Messages a dynamic supervisor accepts.
pub enum DynamicMsg {
    /// Add and start a child; the reply carries its cell once started.
    StartChild(ChildSpec, RpcReplyPort<Result<ActorCell, StartChildError>>),
    /// Stop a child (orderly, within its shutdown timeout) and forget it;
    /// the owner asked, so no exit is reported.
    TerminateChild(String, RpcReplyPort<bool>),
    /// The children and their cells (`None` while a restart is pending).
    WhichChildren(RpcReplyPort<Vec<(String, Option<ActorCell>)>>),
    /// A restart attempt finished (internal).
    Restarted {
        id: String,
        generation: u64,
        result: Result<ActorCell, String>,
    },
    /// Start this child again now (internal, after its backoff delay).
    Restart { id: String, generation: u64 },
}

pub struct DynamicState {
    children: Children,
    on_exit: Option<OnExit>,
    on_restart: Option<OnRestart>,
}

/// The dynamic supervisor actor.
pub struct DynamicSupervisor;

impl DynamicSupervisor {
    /// Start a dynamic supervisor linked under its owner.
    pub async fn start_linked(
        spec: DynamicSpec,
        owner: ActorCell,
    ) -> Result<ActorRef<DynamicMsg>, ractor::SpawnErr> {
        let (actor, _join) = Actor::spawn_linked(None, DynamicSupervisor, spec, owner).await?;
        Ok(actor)
    }
}

/// Start a child under `sup` and wait until it has started.
pub async fn start_child(
    sup: &ActorRef<DynamicMsg>,
    spec: ChildSpec,
) -> Result<ActorCell, StartChildError> {
    match ractor::call!(sup, DynamicMsg::StartChild, spec) {
        Ok(r) => r,
        Err(_) => Err(StartChildError::SupervisorGone),
    }
}

/// Start a child and type its address.
pub async fn start_actor<M: ractor::Message>(
    sup: &ActorRef<DynamicMsg>,
    spec: ChildSpec,
) -> Result<ActorRef<M>, StartChildError> {
    start_child(sup, spec).await.map(ActorRef::from)
}

/// Stop a child in order and forget it. `false` when no such child.
pub async fn terminate_child(sup: &ActorRef<DynamicMsg>, id: impl Into<String>) -> bool {
    ractor::call!(sup, DynamicMsg::TerminateChild, id.into()).unwrap_or(false)
}

/// Stop the supervisor and with it every child (concurrently, each within
/// its shutdown timeout); returns when they are all gone or `timeout` ran
/// out.
pub async fn shutdown(sup: &ActorRef<DynamicMsg>, timeout: Duration) {
    let _ = sup
        .get_cell()
        .stop_and_wait(Some(super::policy::SHUTDOWN.into()), Some(timeout))
        .await;
}

impl DynamicState {
    fn report(&self, exit: ChildExit) {
        if let Some(f) = &self.on_exit {
            f(exit);
        }
    }

    /// Carry out what [`Children`] decided about an exit.
    async fn decide(
        &mut self,
        myself: &ActorRef<DynamicMsg>,
        decision: Decision,
    ) -> Result<(), ActorProcessingErr> {
        match decision {
            Decision::Gone(exit) => self.report(exit),
            Decision::Restart {
                exit,
                delay,
                generation,
            } => {
                let id = exit.id.clone();
                self.report(exit);
                if delay.is_zero() {
                    self.restart(myself, id, generation);
                } else {
                    myself.send_after(delay, move || DynamicMsg::Restart { id, generation });
                }
            }
            Decision::Meltdown(exit) => {
                self.report(exit);
                self.children.stop_all().await;
                return Err(format!("{}: restart intensity exceeded", self.children.name()).into());
            }
        }
        Ok(())
    }

    /// Run a restart attempt off the mailbox, so a slow start does not hold
    /// up the other children's events.
    fn restart(&self, myself: &ActorRef<DynamicMsg>, id: String, generation: u64) {
        let Some(start) = self.children.restart_fn(&id, generation) else {
            return;
        };
        let (me, cell) = (myself.clone(), myself.get_cell());
        tokio::spawn(async move {
            let result = start(cell).await;
            if let Err(ractor::MessagingErr::SendErr(DynamicMsg::Restarted {
                result: Ok(c), ..
            })) = me.send_message(DynamicMsg::Restarted {
                id,
                generation,
                result,
            }) {
                // The supervisor is gone: do not leave the new child behind.
                c.stop(Some(super::policy::SHUTDOWN.into()));
            }
        });
    }
}

impl Actor for DynamicSupervisor {
    type Msg = DynamicMsg;
    type State = DynamicState;
    type Arguments = DynamicSpec;

    async fn pre_start(
        &self,
        _myself: ActorRef<DynamicMsg>,
        spec: DynamicSpec,
    ) -> Result<DynamicState, ActorProcessingErr> {
        Ok(DynamicState {
            children: Children::new(spec.name, spec.intensity, spec.max_children),
            on_exit: spec.on_exit,
            on_restart: spec.on_restart,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<DynamicMsg>,
        state: &mut DynamicState,
    ) -> Result<(), ActorProcessingErr> {
        state.children.stop_all().await;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<DynamicMsg>,
        msg: DynamicMsg,
        state: &mut DynamicState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DynamicMsg::StartChild(spec, reply) => {
                // Awaited so the caller learns the result.
                let result = state.children.start(spec, myself.get_cell()).await;
                let _ = reply.send(result);
            }
            DynamicMsg::TerminateChild(id, reply) => {
                let found = state.children.terminate(&id).await;
                let _ = reply.send(found);
            }
            DynamicMsg::WhichChildren(reply) => {
                let _ = reply.send(state.children.which());
            }
            DynamicMsg::Restart { id, generation } => state.restart(&myself, id, generation),
            DynamicMsg::Restarted {
                id,
                generation,
                result,
            } => match result {
                Ok(cell) => {
                    if state.children.restarted(&id, generation, &cell) {
                        if let Some(f) = &state.on_restart {
                            f(&id, cell.clone());
                        }
                        // It may have ended before we knew it.
                        if let Some(decision) = state.children.early_exit(&cell) {
                            return state.decide(&myself, decision).await;
                        }
                    } else {
                        let _ = state.children.early_exit(&cell);
                        cell.stop(Some(super::policy::SHUTDOWN.into()));
                    }
                }
                Err(e) => {
                    if !state.children.awaits(&id, generation) {
                        return Ok(());
                    }
                    tracing::warn!(supervisor = %state.children.name(), child = %id, error = %e, "restart failed");
                    let exit = match Exit::from_reason(Some(&e)) {
                        Exit::Shutdown(w) => Exit::Shutdown(w),
                        _ => Exit::Abnormal(e),
                    };
                    let decision = state.children.exited(id, exit);
                    return state.decide(&myself, decision).await;
                }
            },
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<DynamicMsg>,
        event: SupervisionEvent,
        state: &mut DynamicState,
    ) -> Result<(), ActorProcessingErr> {
        match state.children.on_event(&event) {
            Some(decision) => state.decide(&myself, decision).await,
            None => Ok(()),
        }
    }
}

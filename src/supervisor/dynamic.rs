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

use super::actor::{stop_child, ChildSpec};
use super::policy::{Exit, Intensity, RestartWindow};
use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

struct Child {
    spec: ChildSpec,
    cell: Option<ActorCell>,
    /// Consecutive restarts without a successful start (for the backoff).
    attempts: u32,
    budget: Option<RestartWindow>,
    /// Bumped whenever a restart is scheduled, so a stale result is ignored.
    generation: u64,
}

pub struct DynamicState {
    name: String,
    window: Option<RestartWindow>,
    max_children: Option<usize>,
    on_exit: Option<OnExit>,
    on_restart: Option<OnRestart>,
    children: HashMap<String, Child>,
    by_actor: HashMap<ActorId, String>,
    origin: Instant,
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
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn report(&self, exit: ChildExit) {
        if let Some(f) = &self.on_exit {
            f(exit);
        }
    }

    fn live(&self) -> usize {
        self.children.len()
    }

    /// Stop every child concurrently, each within its own timeout.
    async fn stop_all(&mut self) {
        self.by_actor.clear();
        let stops = self.children.drain().filter_map(|(_, c)| {
            let timeout = c.spec.shutdown;
            c.cell
                .map(|cell| async move { stop_child(&cell, timeout).await })
        });
        futures_util::future::join_all(stops).await;
    }
}

impl DynamicSupervisor {
    async fn child_exited(
        &self,
        myself: &ActorRef<DynamicMsg>,
        state: &mut DynamicState,
        id: String,
        exit: Exit,
    ) -> Result<(), ActorProcessingErr> {
        let now = state.now();
        let Some(child) = state.children.get_mut(&id) else {
            return Ok(());
        };
        child.cell = None;
        if !child.spec.restart.restarts_after(&exit) {
            tracing::debug!(supervisor = %state.name, child = %id, ?exit, "child ended");
            state.children.remove(&id);
            state.report(ChildExit {
                id,
                exit,
                restarting: false,
            });
            return Ok(());
        }
        let within_budget = child.budget.as_mut().is_none_or(|b| b.allow(now));
        if !within_budget {
            tracing::warn!(supervisor = %state.name, child = %id, ?exit, "restart budget exhausted; giving up on the child");
            state.children.remove(&id);
            state.report(ChildExit {
                id,
                exit,
                restarting: false,
            });
            return Ok(());
        }
        if let Some(window) = state.window.as_mut() {
            if !window.allow(now) {
                tracing::error!(supervisor = %state.name, child = %id, "restart intensity exceeded; shutting down");
                state.report(ChildExit {
                    id,
                    exit,
                    restarting: false,
                });
                state.stop_all().await;
                return Err(format!("{}: restart intensity exceeded", state.name).into());
            }
        }
        let Some(child) = state.children.get_mut(&id) else {
            return Ok(());
        };
        let delay = child
            .spec
            .backoff
            .delay(child.attempts, rand::random::<f64>());
        child.attempts = child.attempts.saturating_add(1);
        child.generation += 1;
        let generation = child.generation;
        tracing::info!(supervisor = %state.name, child = %id, ?exit, ?delay, "restarting");
        state.report(ChildExit {
            id: id.clone(),
            exit,
            restarting: true,
        });
        if delay.is_zero() {
            restart(myself, state, id, generation);
        } else {
            myself.send_after(delay, move || DynamicMsg::Restart { id, generation });
        }
        Ok(())
    }
}

/// Run a restart attempt off the supervisor's mailbox, so a slow start does
/// not hold up the other children's events.
fn restart(myself: &ActorRef<DynamicMsg>, state: &DynamicState, id: String, generation: u64) {
    let Some(child) = state.children.get(&id) else {
        return;
    };
    if child.generation != generation || child.cell.is_some() {
        return;
    }
    let (me, start, cell) = (myself.clone(), child.spec.start.clone(), myself.get_cell());
    tokio::spawn(async move {
        let result = start(cell).await;
        if let Err(ractor::MessagingErr::SendErr(DynamicMsg::Restarted { result: Ok(c), .. })) = me
            .send_message(DynamicMsg::Restarted {
                id,
                generation,
                result,
            })
        {
            // The supervisor is gone: do not leave the new child behind.
            c.stop(Some(super::policy::SHUTDOWN.into()));
        }
    });
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
            name: spec.name,
            window: spec.intensity.map(RestartWindow::new),
            max_children: spec.max_children,
            on_exit: spec.on_exit,
            on_restart: spec.on_restart,
            children: HashMap::new(),
            by_actor: HashMap::new(),
            origin: Instant::now(),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<DynamicMsg>,
        state: &mut DynamicState,
    ) -> Result<(), ActorProcessingErr> {
        state.stop_all().await;
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
                if state.children.contains_key(&spec.id) {
                    let _ = reply.send(Err(StartChildError::AlreadyStarted(spec.id)));
                    return Ok(());
                }
                if let Some(max) = state.max_children {
                    if state.live() >= max {
                        let _ = reply.send(Err(StartChildError::MaxChildren(max)));
                        return Ok(());
                    }
                }
                // The first start is awaited so the caller learns the
                // result; a child that fails to start is not kept (OTP).
                match (spec.start)(myself.get_cell()).await {
                    Ok(cell) => {
                        state.by_actor.insert(cell.get_id(), spec.id.clone());
                        let budget = spec.budget.map(RestartWindow::new);
                        state.children.insert(
                            spec.id.clone(),
                            Child {
                                spec,
                                cell: Some(cell.clone()),
                                attempts: 0,
                                budget,
                                generation: 0,
                            },
                        );
                        let _ = reply.send(Ok(cell));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(StartChildError::Failed(e)));
                    }
                }
            }
            DynamicMsg::TerminateChild(id, reply) => {
                let found = match state.children.remove(&id) {
                    Some(child) => {
                        if let Some(cell) = child.cell {
                            state.by_actor.remove(&cell.get_id());
                            stop_child(&cell, child.spec.shutdown).await;
                        }
                        true
                    }
                    None => false,
                };
                let _ = reply.send(found);
            }
            DynamicMsg::WhichChildren(reply) => {
                let mut list: Vec<(String, Option<ActorCell>)> = state
                    .children
                    .iter()
                    .map(|(id, c)| (id.clone(), c.cell.clone()))
                    .collect();
                list.sort_by(|a, b| a.0.cmp(&b.0));
                let _ = reply.send(list);
            }
            DynamicMsg::Restart { id, generation } => restart(&myself, state, id, generation),
            DynamicMsg::Restarted {
                id,
                generation,
                result,
            } => {
                let current = state
                    .children
                    .get(&id)
                    .is_some_and(|c| c.generation == generation && c.cell.is_none());
                if !current {
                    if let Ok(cell) = result {
                        cell.stop(Some(super::policy::SHUTDOWN.into()));
                    }
                    return Ok(());
                }
                match result {
                    Ok(cell) => {
                        state.by_actor.insert(cell.get_id(), id.clone());
                        if let Some(f) = &state.on_restart {
                            f(&id, cell.clone());
                        }
                        if let Some(child) = state.children.get_mut(&id) {
                            child.attempts = 0;
                            child.cell = Some(cell);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(supervisor = %state.name, child = %id, error = %e, "restart failed");
                        let exit = match Exit::from_reason(Some(&e)) {
                            Exit::Shutdown(w) => Exit::Shutdown(w),
                            _ => Exit::Abnormal(e),
                        };
                        return self.child_exited(&myself, state, id, exit).await;
                    }
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<DynamicMsg>,
        event: SupervisionEvent,
        state: &mut DynamicState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, exit) = match event {
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, Exit::from_reason(reason.as_deref()))
            }
            SupervisionEvent::ActorFailed(cell, err) => (cell, Exit::Abnormal(err.to_string())),
            _ => return Ok(()),
        };
        let Some(id) = state.by_actor.remove(&cell.get_id()) else {
            return Ok(());
        };
        self.child_exited(&myself, state, id, exit).await
    }
}

//! The generic supervisor actor: starts children from [`ChildSpec`]s,
//! restarts them by type and strategy with backoff, enforces the restart
//! intensity, and shuts children down in reverse start order with a
//! per-child timeout.
//!
//! ractor's default `handle_supervisor_evt` stops the supervisor when any
//! child ends; this actor replaces it with OTP semantics.

use super::policy::{affected, Backoff, Exit, Intensity, Restart, RestartWindow, Strategy};
use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, ActorStatus, RpcReplyPort,
    SupervisionEvent,
};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Starts one child linked to the supervisor cell it is given. An `Err`
/// whose text begins with `shutdown` is final (no retry).
pub type StartFn = Arc<
    dyn Fn(ActorCell) -> Pin<Box<dyn Future<Output = Result<ActorCell, String>> + Send>>
        + Send
        + Sync,
>;

/// How to start and restart one child.
#[derive(Clone)]
pub struct ChildSpec {
    pub id: String,
    pub restart: Restart,
    pub start: StartFn,
    /// Time allowed for an orderly stop before the child is killed.
    pub shutdown: Duration,
    /// Backoff between restarts of this child.
    pub backoff: Backoff,
    /// Consecutive restarts without a successful start before the supervisor
    /// gives up (`None`: unlimited).
    pub max_attempts: Option<u32>,
    /// OTP's `significant`: when this child ends for good, the supervisor
    /// shuts down too and passes the child's exit reason up.
    pub significant: bool,
    /// A restart budget of this child alone (at most N restarts within a
    /// period). Past it a dynamic supervisor gives up on the child and
    /// reports it gone, without failing itself: one MCP server that keeps
    /// crashing must not take its session down.
    pub budget: Option<Intensity>,
}

impl ChildSpec {
    pub fn new<F, Fut>(id: impl Into<String>, restart: Restart, start: F) -> Self
    where
        F: Fn(ActorCell) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<ActorCell, String>> + Send + 'static,
    {
        ChildSpec {
            id: id.into(),
            restart,
            start: Arc::new(move |cell| Box::pin(start(cell))),
            shutdown: Duration::from_secs(5),
            backoff: Backoff::NONE,
            max_attempts: None,
            significant: false,
            budget: None,
        }
    }

    /// A `temporary` child started once from an actor value and its
    /// arguments (never restarted, so the arguments need not be `Clone`).
    pub fn temporary<A>(id: impl Into<String>, actor: A, args: A::Arguments) -> Self
    where
        A: Actor,
    {
        // Boxed, so that once taken the slot a supervisor keeps for the
        // child's lifetime is a pointer, not the size of the arguments.
        let slot = Arc::new(std::sync::Mutex::new(Some(Box::new((actor, args)))));
        ChildSpec::new(id, Restart::Temporary, move |sup: ActorCell| {
            let taken = slot.lock().ok().and_then(|mut g| g.take());
            async move {
                match taken {
                    Some(boxed) => {
                        let (actor, args) = *boxed;
                        spawn_child(actor, args, sup).await
                    }
                    None => Err("shutdown:temporary child started twice".to_owned()),
                }
            }
        })
    }

    /// A child restarted by `restart` from a fresh actor value and a clone of
    /// its arguments each time.
    pub fn restartable<A>(
        id: impl Into<String>,
        restart: Restart,
        actor: A,
        args: A::Arguments,
    ) -> Self
    where
        A: Actor + Clone,
        A::Arguments: Clone + Sync,
    {
        ChildSpec::new(id, restart, move |sup: ActorCell| {
            spawn_child(actor.clone(), args.clone(), sup)
        })
    }

    pub fn budget(mut self, budget: Intensity) -> Self {
        self.budget = Some(budget);
        self
    }

    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    pub fn max_attempts(mut self, n: Option<u32>) -> Self {
        self.max_attempts = n;
        self
    }

    pub fn significant(mut self) -> Self {
        self.significant = true;
        self
    }

    pub fn shutdown_timeout(mut self, d: Duration) -> Self {
        self.shutdown = d;
        self
    }
}

/// A supervisor's configuration.
#[derive(Clone, Default)]
pub struct SupervisorSpec {
    pub strategy: Strategy,
    /// `None`: restarts are never counted (each child still has its own
    /// `max_attempts`).
    pub intensity: Option<Intensity>,
    pub children: Vec<ChildSpec>,
}

/// How a supervisor ended: what its owner (or `main`) sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SupervisorExit {
    /// Stopped from outside.
    Stopped,
    /// A significant child ended for good with this exit.
    ChildExited { child: String, exit: Exit },
    /// More restarts than the intensity allows.
    Meltdown,
    /// A child's `max_attempts` ran out.
    Exhausted { child: String },
}

/// Messages a supervisor accepts.
pub enum SupervisorMsg {
    /// Add and start a child.
    StartChild(ChildSpec, Option<RpcReplyPort<Result<ActorCell, String>>>),
    /// Stop a child (orderly) and forget it.
    TerminateChild(String, Option<RpcReplyPort<bool>>),
    /// The running children, in start order.
    WhichChildren(RpcReplyPort<Vec<(String, Option<ActorCell>)>>),
    /// A child's start attempt finished (internal).
    Started {
        id: String,
        generation: u64,
        result: Result<ActorCell, String>,
    },
    /// Start these children now (internal, after a backoff delay).
    Restart { ids: Vec<String>, generation: u64 },
}

struct Child {
    spec: ChildSpec,
    cell: Option<ActorCell>,
    attempts: u32,
    /// Bumped whenever a start is scheduled, so a stale result is ignored.
    generation: u64,
}

pub struct SupervisorState {
    strategy: Strategy,
    window: Option<RestartWindow>,
    children: Vec<Child>,
    by_actor: HashMap<ActorId, String>,
    origin: Instant,
    exit: SupervisorExit,
    exit_tx: Option<oneshot::Sender<SupervisorExit>>,
}

/// The supervisor actor.
pub struct Supervisor;

/// Arguments: the spec and where to report the final exit.
pub struct SupervisorArgs {
    pub spec: SupervisorSpec,
    pub exit_tx: Option<oneshot::Sender<SupervisorExit>>,
}

impl Supervisor {
    /// Spawn a top-level supervisor. The receiver yields its exit.
    pub async fn start(
        spec: SupervisorSpec,
    ) -> Result<(ActorRef<SupervisorMsg>, oneshot::Receiver<SupervisorExit>), ractor::SpawnErr>
    {
        let (tx, rx) = oneshot::channel();
        let (actor, _join) = Actor::spawn(
            None,
            Supervisor,
            SupervisorArgs {
                spec,
                exit_tx: Some(tx),
            },
        )
        .await?;
        Ok((actor, rx))
    }

    /// Spawn a supervisor linked under another actor.
    pub async fn start_linked(
        spec: SupervisorSpec,
        parent: ActorCell,
    ) -> Result<ActorRef<SupervisorMsg>, ractor::SpawnErr> {
        let (actor, _join) = Actor::spawn_linked(
            None,
            Supervisor,
            SupervisorArgs {
                spec,
                exit_tx: None,
            },
            parent,
        )
        .await?;
        Ok(actor)
    }
}

impl SupervisorState {
    fn index(&self, id: &str) -> Option<usize> {
        self.children.iter().position(|c| c.spec.id == id)
    }

    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    /// Stop the given running children, last started first, each within its
    /// shutdown timeout, and forget their cells (their exits are ours, not
    /// failures to react to).
    async fn stop_children(&mut self, range: std::ops::Range<usize>) {
        for idx in range.rev() {
            let child = &mut self.children[idx];
            if let Some(cell) = child.cell.take() {
                self.by_actor.remove(&cell.get_id());
                stop_child(&cell, child.spec.shutdown).await;
            }
        }
    }
}

/// Start `actor` linked under `supervisor`: the one place runtime actors
/// are spawned (everything else goes through a [`ChildSpec`]).
pub async fn spawn_child<A: Actor>(
    actor: A,
    args: A::Arguments,
    supervisor: ActorCell,
) -> Result<ActorCell, String> {
    Actor::spawn_linked(None, actor, args, supervisor)
        .await
        .map(|(a, _)| a.get_cell())
        .map_err(|e| match e {
            // The actor's own words: a start that ends with `shutdown:…`
            // is final (see `Exit::from_reason`).
            ractor::SpawnErr::StartupFailed(inner) => inner.to_string(),
            other => other.to_string(),
        })
}

/// Orderly stop with a timeout, then kill.
pub async fn stop_child(cell: &ActorCell, timeout: Duration) {
    if cell.get_status() == ActorStatus::Stopped {
        return;
    }
    if cell
        .stop_and_wait(Some(super::policy::SHUTDOWN.into()), Some(timeout))
        .await
        .is_err()
    {
        tracing::warn!(actor = ?cell.get_id(), "child did not stop in time; killing it");
        let _ = cell.kill_and_wait(Some(Duration::from_secs(1))).await;
    }
}

fn schedule_start(myself: &ActorRef<SupervisorMsg>, spec: &ChildSpec, generation: u64) {
    let me = myself.clone();
    let start = spec.start.clone();
    let id = spec.id.clone();
    let cell = myself.get_cell();
    tokio::spawn(async move {
        let result = start(cell).await;
        if let Err(ractor::MessagingErr::SendErr(SupervisorMsg::Started {
            result: Ok(c), ..
        })) = me.send_message(SupervisorMsg::Started {
            id,
            generation,
            result,
        }) {
            // The supervisor is gone: do not leave the new child behind.
            c.stop(Some(super::policy::SHUTDOWN.into()));
        }
    });
}

impl Supervisor {
    /// Give up: stop every child, record why, stop (or fail) ourselves.
    async fn give_up(
        &self,
        myself: &ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
        exit: SupervisorExit,
    ) -> Result<(), ActorProcessingErr> {
        let len = state.children.len();
        state.stop_children(0..len).await;
        state.exit = exit.clone();
        // A failing actor skips post_stop: report the exit here.
        if let Some(tx) = state.exit_tx.take() {
            let _ = tx.send(exit.clone());
        }
        match &exit {
            SupervisorExit::ChildExited { exit, .. } => {
                myself.stop(exit.to_reason());
                Ok(())
            }
            SupervisorExit::Stopped => {
                myself.stop(None);
                Ok(())
            }
            SupervisorExit::Meltdown => Err("restart intensity exceeded".into()),
            SupervisorExit::Exhausted { child } => {
                Err(format!("{child}: restart attempts exhausted").into())
            }
        }
    }

    async fn child_exited(
        &self,
        myself: &ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
        id: String,
        exit: Exit,
    ) -> Result<(), ActorProcessingErr> {
        let Some(idx) = state.index(&id) else {
            return Ok(());
        };
        let child = &mut state.children[idx];
        child.cell = None;
        let restart = child.spec.restart;
        tracing::debug!(child = %id, ?exit, "child exited");
        if !restart.restarts_after(&exit) {
            let significant = child.spec.significant;
            let done = restart == Restart::Temporary
                || matches!(exit, Exit::Normal) && restart == Restart::Transient;
            if done && !significant {
                state.children.remove(idx);
                return Ok(());
            }
            if significant {
                return self
                    .give_up(
                        myself,
                        state,
                        SupervisorExit::ChildExited { child: id, exit },
                    )
                    .await;
            }
            return Ok(());
        }
        let now = state.now();
        if let Some(window) = state.window.as_mut() {
            if !window.allow(now) {
                tracing::error!(child = %id, "restart intensity exceeded; shutting down");
                return self.give_up(myself, state, SupervisorExit::Meltdown).await;
            }
        }
        let range = affected(state.strategy, idx, state.children.len());
        // Siblings the strategy restarts are stopped first (reverse order).
        let (before, after) = (range.start..idx, idx + 1..range.end);
        state.stop_children(after).await;
        state.stop_children(before).await;
        let child = &mut state.children[idx];
        if let Some(max) = child.spec.max_attempts {
            if child.attempts >= max {
                return self
                    .give_up(myself, state, SupervisorExit::Exhausted { child: id })
                    .await;
            }
        }
        let delay = child
            .spec
            .backoff
            .delay(child.attempts, rand::random::<f64>());
        child.attempts = child.attempts.saturating_add(1);
        let ids: Vec<String> = state.children[range]
            .iter()
            .map(|c| c.spec.id.clone())
            .collect();
        let mut generation = 0;
        for c in state
            .children
            .iter_mut()
            .filter(|c| ids.contains(&c.spec.id))
        {
            c.generation += 1;
            generation = generation.max(c.generation);
        }
        tracing::info!(child = %id, ?delay, "restarting");
        if delay.is_zero() {
            self.restart(myself, state, ids);
        } else {
            myself.send_after(delay, move || SupervisorMsg::Restart { ids, generation });
        }
        Ok(())
    }

    fn restart(
        &self,
        myself: &ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
        ids: Vec<String>,
    ) {
        for id in ids {
            if let Some(idx) = state.index(&id) {
                let c = &state.children[idx];
                if c.cell.is_none() {
                    schedule_start(myself, &c.spec, c.generation);
                }
            }
        }
    }
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let state = SupervisorState {
            strategy: args.spec.strategy,
            window: args.spec.intensity.map(RestartWindow::new),
            children: Vec::new(),
            by_actor: HashMap::new(),
            origin: Instant::now(),
            exit: SupervisorExit::Stopped,
            exit_tx: args.exit_tx,
        };
        for spec in args.spec.children {
            myself.send_message(SupervisorMsg::StartChild(spec, None))?;
        }
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let len = state.children.len();
        state.stop_children(0..len).await;
        if let Some(tx) = state.exit_tx.take() {
            let _ = tx.send(state.exit.clone());
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::StartChild(spec, reply) => {
                if state.index(&spec.id).is_some() {
                    if let Some(r) = reply {
                        let _ = r.send(Err(format!("child {:?} exists", spec.id)));
                    }
                    return Ok(());
                }
                // The first start is awaited so the caller learns the result.
                let result = (spec.start)(myself.get_cell()).await;
                let mut child = Child {
                    spec,
                    cell: None,
                    attempts: 0,
                    generation: 0,
                };
                let outcome = match result {
                    Ok(cell) => {
                        state.by_actor.insert(cell.get_id(), child.spec.id.clone());
                        child.cell = Some(cell.clone());
                        state.children.push(child);
                        Ok(cell)
                    }
                    Err(e) => {
                        let id = child.spec.id.clone();
                        state.children.push(child);
                        let exit = start_failure(&e);
                        if let Some(r) = reply {
                            let _ = r.send(Err(e));
                        }
                        return self.child_exited(&myself, state, id, exit).await;
                    }
                };
                if let Some(r) = reply {
                    let _ = r.send(outcome);
                }
            }
            SupervisorMsg::TerminateChild(id, reply) => {
                let found = match state.index(&id) {
                    Some(idx) => {
                        state.stop_children(idx..idx + 1).await;
                        state.children.remove(idx);
                        true
                    }
                    None => false,
                };
                if let Some(r) = reply {
                    let _ = r.send(found);
                }
            }
            SupervisorMsg::WhichChildren(reply) => {
                let list = state
                    .children
                    .iter()
                    .map(|c| (c.spec.id.clone(), c.cell.clone()))
                    .collect();
                let _ = reply.send(list);
            }
            SupervisorMsg::Restart { ids, generation } => {
                let current: Vec<String> = ids
                    .into_iter()
                    .filter(|id| {
                        state
                            .index(id)
                            .is_some_and(|i| state.children[i].generation == generation)
                    })
                    .collect();
                self.restart(&myself, state, current);
            }
            SupervisorMsg::Started {
                id,
                generation,
                result,
            } => {
                let Some(idx) = state.index(&id) else {
                    if let Ok(cell) = result {
                        cell.stop(Some(super::policy::SHUTDOWN.into()));
                    }
                    return Ok(());
                };
                if state.children[idx].generation != generation
                    || state.children[idx].cell.is_some()
                {
                    if let Ok(cell) = result {
                        cell.stop(Some(super::policy::SHUTDOWN.into()));
                    }
                    return Ok(());
                }
                match result {
                    Ok(cell) => {
                        state.by_actor.insert(cell.get_id(), id);
                        let child = &mut state.children[idx];
                        child.attempts = 0;
                        child.cell = Some(cell);
                    }
                    Err(e) => {
                        tracing::warn!(child = %id, error = %e, "start failed");
                        let exit = start_failure(&e);
                        return self.child_exited(&myself, state, id, exit).await;
                    }
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
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

/// A failed start is an abnormal exit, unless its error says `shutdown`.
fn start_failure(error: &str) -> Exit {
    match Exit::from_reason(Some(error)) {
        Exit::Shutdown(w) => Exit::Shutdown(w),
        _ => Exit::Abnormal(error.to_owned()),
    }
}

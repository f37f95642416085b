//! The children of a dynamic supervisor, as a value an actor embeds.
//!
//! [`super::DynamicSupervisor`] is this value inside an actor of its own.
//! An owner that starts many small supervised groups (every session owns
//! its processes and tool calls) embeds it instead: the owner is then the
//! supervisor, its children are linked to it, and each supervision event
//! becomes a [`Decision`] in its own mailbox order. A separate supervisor
//! actor per session cost about 10 KiB per session (`bmx bench scale`),
//! which is why both forms exist; the restart rules are this one code.

use super::actor::{stop_child, ChildSpec, StartFn};
use super::dynamic::{ChildExit, StartChildError};
use super::policy::{Exit, Intensity, RestartWindow};
use ractor::{ActorCell, ActorId, SupervisionEvent};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Most exits of unknown actors remembered (see `Children::early`).
const MAX_EARLY_EXITS: usize = 1024;

struct Child {
    spec: ChildSpec,
    cell: Option<ActorCell>,
    /// Consecutive restarts without a successful start (for the backoff).
    attempts: u32,
    budget: Option<RestartWindow>,
    /// Bumped whenever a restart is scheduled, so a stale result is ignored.
    generation: u64,
}

/// What the owner does about a child's exit.
#[derive(Debug)]
pub enum Decision {
    /// The child is gone for good: report it.
    Gone(ChildExit),
    /// Report the exit, then start the child again after `delay` with
    /// [`Children::restart_fn`] (the generation guards a stale timer).
    Restart {
        exit: ChildExit,
        delay: Duration,
        generation: u64,
    },
    /// More restarts than the supervisor's intensity allows: stop every
    /// child and fail, escalating to the owner's own supervisor.
    Meltdown(ChildExit),
}

/// A dynamic set of supervised children.
pub struct Children {
    name: String,
    window: Option<RestartWindow>,
    max_children: Option<usize>,
    children: HashMap<String, Child>,
    by_actor: HashMap<ActorId, String>,
    /// Exits of actors not (yet) known: a restarted child that ends before
    /// the supervisor has taken in its `Restarted` message (supervision
    /// events overtake ordinary messages in ractor). Kept until the restart
    /// result arrives; bounded by [`MAX_EARLY_EXITS`].
    early: HashMap<ActorId, Exit>,
    origin: Instant,
}

impl Children {
    pub fn new(name: impl Into<String>, intensity: Option<Intensity>, max: Option<usize>) -> Self {
        Children {
            name: name.into(),
            window: intensity.map(RestartWindow::new),
            max_children: max,
            children: HashMap::new(),
            by_actor: HashMap::new(),
            early: HashMap::new(),
            origin: Instant::now(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.children.len()
    }

    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
    }

    /// Start a child linked under `supervisor` and keep it. A child that
    /// fails to start is not kept (OTP).
    pub async fn start(
        &mut self,
        spec: ChildSpec,
        supervisor: ActorCell,
    ) -> Result<ActorCell, StartChildError> {
        if self.children.contains_key(&spec.id) {
            return Err(StartChildError::AlreadyStarted(spec.id));
        }
        if let Some(max) = self.max_children {
            if self.children.len() >= max {
                return Err(StartChildError::MaxChildren(max));
            }
        }
        let cell = (spec.start)(supervisor)
            .await
            .map_err(StartChildError::Failed)?;
        self.by_actor.insert(cell.get_id(), spec.id.clone());
        let budget = spec.budget.map(RestartWindow::new);
        self.children.insert(
            spec.id.clone(),
            Child {
                spec,
                cell: Some(cell.clone()),
                attempts: 0,
                budget,
                generation: 0,
            },
        );
        Ok(cell)
    }

    /// Stop a child in order (within its shutdown timeout) and forget it.
    pub async fn terminate(&mut self, id: &str) -> bool {
        match self.children.remove(id) {
            Some(child) => {
                if let Some(cell) = child.cell {
                    self.by_actor.remove(&cell.get_id());
                    stop_child(&cell, child.spec.shutdown).await;
                }
                true
            }
            None => false,
        }
    }

    /// The children by id, with their cells (`None` while a restart is due).
    pub fn which(&self) -> Vec<(String, Option<ActorCell>)> {
        let mut list: Vec<(String, Option<ActorCell>)> = self
            .children
            .iter()
            .map(|(id, c)| (id.clone(), c.cell.clone()))
            .collect();
        list.sort_by(|a, b| a.0.cmp(&b.0));
        list
    }

    /// A supervision event from a linked actor. `None` when it is not one
    /// of ours (or not an exit).
    pub fn on_event(&mut self, event: &SupervisionEvent) -> Option<Decision> {
        let (cell, exit) = match event {
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, Exit::from_reason(reason.as_deref()))
            }
            SupervisionEvent::ActorFailed(cell, err) => (cell, Exit::Abnormal(err.to_string())),
            _ => return None,
        };
        let Some(id) = self.by_actor.remove(&cell.get_id()) else {
            if self.early.len() >= MAX_EARLY_EXITS {
                self.early.clear();
            }
            self.early.insert(cell.get_id(), exit);
            return None;
        };
        Some(self.exited(id, exit))
    }

    /// A child just registered by [`Children::restarted`] that had already
    /// ended: decide about that exit now. Call after every restart result
    /// (a stale one only forgets the entry).
    pub fn early_exit(&mut self, cell: &ActorCell) -> Option<Decision> {
        let exit = self.early.remove(&cell.get_id())?;
        let id = self.by_actor.remove(&cell.get_id())?;
        Some(self.exited(id, exit))
    }

    /// A child ended (or a restart attempt failed): decide.
    pub fn exited(&mut self, id: String, exit: Exit) -> Decision {
        let now = self.origin.elapsed();
        let gone = |this: &mut Children, id: String, exit: Exit| {
            this.children.remove(&id);
            Decision::Gone(ChildExit {
                id,
                exit,
                restarting: false,
            })
        };
        let Some(child) = self.children.get_mut(&id) else {
            return Decision::Gone(ChildExit {
                id,
                exit,
                restarting: false,
            });
        };
        child.cell = None;
        if !child.spec.restart.restarts_after(&exit) {
            tracing::debug!(supervisor = %self.name, child = %id, ?exit, "child ended");
            return gone(self, id, exit);
        }
        if !child.budget.as_mut().is_none_or(|b| b.allow(now)) {
            tracing::warn!(supervisor = %self.name, child = %id, ?exit, "restart budget exhausted; giving up on the child");
            return gone(self, id, exit);
        }
        if let Some(window) = self.window.as_mut() {
            if !window.allow(now) {
                tracing::error!(supervisor = %self.name, child = %id, "restart intensity exceeded");
                return Decision::Meltdown(ChildExit {
                    id,
                    exit,
                    restarting: false,
                });
            }
        }
        let Some(child) = self.children.get_mut(&id) else {
            return gone(self, id, exit);
        };
        let delay = child
            .spec
            .backoff
            .delay(child.attempts, rand::random::<f64>());
        child.attempts = child.attempts.saturating_add(1);
        child.generation += 1;
        tracing::info!(supervisor = %self.name, child = %id, ?exit, ?delay, "restarting");
        Decision::Restart {
            generation: child.generation,
            exit: ChildExit {
                id,
                exit,
                restarting: true,
            },
            delay,
        }
    }

    /// The start function of a child whose restart (of this generation) is
    /// due; `None` when the child is gone, running, or the timer is stale.
    pub fn restart_fn(&self, id: &str, generation: u64) -> Option<StartFn> {
        let child = self.children.get(id)?;
        (child.generation == generation && child.cell.is_none()).then(|| child.spec.start.clone())
    }

    /// A restart attempt succeeded. `false`: it is stale (stop the cell).
    pub fn restarted(&mut self, id: &str, generation: u64, cell: &ActorCell) -> bool {
        let Some(child) = self.children.get_mut(id) else {
            return false;
        };
        if child.generation != generation || child.cell.is_some() {
            return false;
        }
        child.attempts = 0;
        child.cell = Some(cell.clone());
        self.by_actor.insert(cell.get_id(), id.to_owned());
        true
    }

    /// Whether `(id, generation)` is the restart the child waits for.
    pub fn awaits(&self, id: &str, generation: u64) -> bool {
        self.children
            .get(id)
            .is_some_and(|c| c.generation == generation && c.cell.is_none())
    }

    /// Stop every child concurrently, each within its own timeout, and
    /// forget them (their exits are ours, not failures to react to).
    pub async fn stop_all(&mut self) {
        self.by_actor.clear();
        self.early.clear();
        let stops = self.children.drain().filter_map(|(_, c)| {
            let timeout = c.spec.shutdown;
            c.cell
                .map(|cell| async move { stop_child(&cell, timeout).await })
        });
        futures_util::future::join_all(stops).await;
    }
}

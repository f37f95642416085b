//! The sessions owner: starts sessions under the visor's dynamic
//! supervisor and learns how each run ended (a monitor, not polling).
//!
//! A session's restart type is its restart policy: `none` → `temporary`
//! (a run that ends, or crashes, ends the session), `notify` → `transient`
//! with a restart budget of [`RESTART_INTENSITY`] (an abnormal end — the
//! program's unexpected exit, or the actor's panic — starts a new run).
//! When the supervisor gives up (budget spent, or a temporary session
//! crashed), this owner ends the session `exited` with an `error`, kills
//! what is left of its tree, and the daemon and the other sessions go on.

use super::session::{SessionActor, SessionData, LOST};
use super::state::{Input, State};
use super::types::{Checked, Kind, RestartMode, SessionView};
use super::wire::WireActor;
use super::{Visor, VisorError};
use crate::supervisor::dynamic::{self, ChildExit, DynamicMsg, DynamicSpec, DynamicSupervisor};
use crate::supervisor::{ChildSpec, Exit, Intensity, Restart};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::sync::Arc;
use std::time::Duration;

/// Restarts a session's program may make, and within which period.
pub const RESTART_INTENSITY: Intensity = Intensity {
    max_restarts: 3,
    period: Duration::from_secs(60),
};
/// Sessions alive at once.
pub const MAX_SESSIONS: usize = 256;

pub enum SessionsMsg {
    Start(Box<Checked>, RpcReplyPort<Result<SessionView, VisorError>>),
    /// End a session that has no running actor (between two runs).
    StopIdle(String, RpcReplyPort<Result<(), VisorError>>),
    /// A run ended (from the dynamic supervisor).
    Exited(ChildExit),
}

#[derive(Clone)]
pub struct Sessions;

pub struct SessionsState {
    visor: Arc<Visor>,
    sup: ActorRef<DynamicMsg>,
}

impl Actor for Sessions {
    type Msg = SessionsMsg;
    type State = SessionsState;
    type Arguments = Arc<Visor>;

    async fn pre_start(
        &self,
        myself: ActorRef<SessionsMsg>,
        visor: Arc<Visor>,
    ) -> Result<SessionsState, ActorProcessingErr> {
        let me = myself.clone();
        let spec = DynamicSpec::new("visor sessions")
            .max_children(MAX_SESSIONS)
            .on_exit(move |e| {
                let _ = me.send_message(SessionsMsg::Exited(e));
            });
        let sup = DynamicSupervisor::start_linked(spec, myself.get_cell()).await?;
        *visor.owner.lock().unwrap_or_else(|p| p.into_inner()) = Some(myself.clone());
        Ok(SessionsState { visor, sup })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SessionsMsg>,
        state: &mut SessionsState,
    ) -> Result<(), ActorProcessingErr> {
        dynamic::shutdown(&state.sup, Duration::from_secs(20)).await;
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<SessionsMsg>,
        msg: SessionsMsg,
        state: &mut SessionsState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SessionsMsg::Start(checked, reply) => {
                let _ = reply.send(state.start(*checked).await);
            }
            SessionsMsg::StopIdle(id, reply) => {
                let r = match state.visor.sessions.get(&id).map(|d| d.clone()) {
                    None => Err(VisorError::no_session(&id)),
                    Some(d) if !d.state().live() => {
                        Err(VisorError::State("the session has exited".into()))
                    }
                    Some(d) => {
                        // Cancels a pending restart too.
                        dynamic::terminate_child(&state.sup, id).await;
                        d.kill_tree().await;
                        let _ = d.apply(Input::Stop);
                        Ok(())
                    }
                };
                let _ = reply.send(r);
            }
            SessionsMsg::Exited(exit) => state.exited(exit).await,
        }
        Ok(())
    }
}

impl SessionsState {
    async fn start(&mut self, checked: Checked) -> Result<SessionView, VisorError> {
        if self.visor.is_closing() {
            return Err(VisorError::Closed("the visor is shutting down".into()));
        }
        let id = format!("s-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let scope = format!("{}/{id}/", self.visor.scope_prefix());
        let env = self.visor.session_env(&id, &checked);
        let mode = checked.spec.restart.mode;
        let kind = checked.spec.kind;
        let data = SessionData::new(id.clone(), checked, scope, env, self.visor.hub.clone());
        let restart = match mode {
            RestartMode::None => Restart::Temporary,
            RestartMode::Notify | RestartMode::Resume => Restart::Transient,
        };
        // One actor kind per session kind; the same restart policy.
        let spec = match kind {
            Kind::Wire => ChildSpec::restartable(id.clone(), restart, WireActor, data.clone()),
            _ => ChildSpec::restartable(id.clone(), restart, SessionActor, data.clone()),
        };
        let spec = match restart {
            Restart::Transient => spec.budget(RESTART_INTENSITY),
            _ => spec,
        }
        .shutdown_timeout(Duration::from_secs(10));
        self.visor.sessions.insert(id.clone(), data.clone());
        match dynamic::start_child(&self.sup, spec).await {
            Ok(_) => Ok(data.view()),
            Err(e) => {
                self.visor.sessions.remove(&id);
                self.visor.hub.purge(&id);
                let msg = e.to_string();
                Err(match e {
                    dynamic::StartChildError::MaxChildren(n) => {
                        VisorError::Busy(format!("at most {n} sessions"))
                    }
                    _ => VisorError::Invalid(
                        msg.replace("the child failed to start: ", "")
                            .replace("shutdown:", ""),
                    ),
                })
            }
        }
    }

    async fn exited(&mut self, exit: ChildExit) {
        let Some(data) = self.visor.sessions.get(&exit.id).map(|d| d.clone()) else {
            return;
        };
        if let Exit::Abnormal(reason) = &exit.exit {
            if !reason.starts_with(LOST) {
                tracing::warn!(session = %exit.id, %reason, "visor session actor crashed");
                data.set_error(format!("session actor crashed: {reason}"));
            }
        }
        if exit.restarting || !data.state().live() {
            return;
        }
        // The supervisor is done with this session: end it, with nothing
        // left running.
        data.kill_tree().await;
        match &exit.exit {
            Exit::Abnormal(reason) if reason.starts_with(LOST) => {
                let i = RESTART_INTENSITY;
                data.set_error(format!(
                    "restart intensity reached ({} restarts in {} s); last run: {reason}",
                    i.max_restarts,
                    i.period.as_secs()
                ));
                let _ = data.apply(Input::Exit { restart: false });
            }
            _ => {
                let _ = data.apply(Input::Crash { restart: false });
            }
        }
        debug_assert_eq!(data.state(), State::Exited);
    }
}

//! The harness's root supervisor: the leases actor, then the supervisor of
//! the executor connections.
//!
//! `leases` is `permanent`: if it fails it is started again at once, and
//! its `pre_start` rebuilds the lease table, the session views and the
//! timer from what outlives it (the [`LeaseStore`] and [`Shared`]'s maps),
//! then makes [`Shared::leases`] name it. Callers that found the old actor
//! gone wait for the new one ([`Shared::send_leases`]).
//!
//! `connections` holds one `temporary` child per executor connection: a
//! failed connection actor is not restarted (its socket is closed with
//! 1011 and the executor reconnects and resumes on a new one).

use super::connection::{ConnArgs, ConnMsg, Connection};
use super::leases::{Leases, LeasesArgs};
use crate::harness::runtime::Shared;
use crate::lease::LeaseStore;
use crate::supervisor::{
    ChildSpec, Intensity, Restart, Strategy, Supervisor, SupervisorExit, SupervisorMsg,
    SupervisorSpec,
};
use ractor::{Actor, ActorCell, ActorRef};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

/// Restarts of the root's children tolerated within a period before the
/// harness gives up (a leases actor that fails on every message).
const INTENSITY: Intensity = Intensity {
    max_restarts: 10,
    period: Duration::from_secs(10),
};

pub async fn start(
    shared: Arc<Shared>,
    store: Arc<dyn LeaseStore>,
) -> Result<(ActorRef<SupervisorMsg>, oneshot::Receiver<SupervisorExit>), ractor::SpawnErr> {
    let s = shared.clone();
    let leases = ChildSpec::new("leases", Restart::Permanent, move |sup: ActorCell| {
        let args = LeasesArgs {
            shared: s.clone(),
            store: store.clone(),
        };
        async move {
            Actor::spawn_linked(None, Leases, args, sup)
                .await
                .map(|(a, _)| a.get_cell())
                .map_err(|e| e.to_string())
        }
    })
    .shutdown_timeout(Duration::from_secs(5));
    let s = shared.clone();
    let connections = ChildSpec::new("connections", Restart::Permanent, move |sup: ActorCell| {
        let s = s.clone();
        async move {
            let spec = SupervisorSpec {
                strategy: Strategy::OneForOne,
                // Children are temporary: nothing to count.
                intensity: None,
                children: Vec::new(),
            };
            let conns = Supervisor::start_linked(spec, sup)
                .await
                .map_err(|e| e.to_string())?;
            s.set_connections(conns.clone());
            Ok(conns.get_cell())
        }
    })
    .shutdown_timeout(Duration::from_secs(5));
    let (root, exit) = Supervisor::start(SupervisorSpec {
        strategy: Strategy::OneForOne,
        intensity: Some(INTENSITY),
        children: vec![leases, connections],
    })
    .await?;
    Ok((root, exit))
}

/// Start the actor of one executor connection under `connections`.
pub async fn start_connection(
    shared: &Shared,
    args: ConnArgs,
) -> Result<ActorRef<ConnMsg>, String> {
    let Some(sup) = shared.connections() else {
        return Err("the connections supervisor is not running".into());
    };
    let id = args.connection_id.clone();
    let slot = Arc::new(std::sync::Mutex::new(Some(args)));
    let spec = ChildSpec::new(id, Restart::Temporary, move |sup: ActorCell| {
        let taken = slot.lock().ok().and_then(|mut g| g.take());
        async move {
            let Some(args) = taken else {
                return Err("shutdown: a connection is started once".to_owned());
            };
            Actor::spawn_linked(None, Connection, args, sup)
                .await
                .map(|(a, _)| a.get_cell())
                .map_err(|e| e.to_string())
        }
    })
    .shutdown_timeout(Duration::from_secs(2));
    let cell = ractor::call!(sup, |reply| SupervisorMsg::StartChild(spec, Some(reply)))
        .map_err(|e| e.to_string())??;
    Ok(cell.into())
}

//! The harness's root supervisor: the leases actor, the dynamic supervisors
//! of the MCP channels and of the agent streams, then the one of the executor
//! connections (stopped first, in reverse order).
//!
//! `leases` is `permanent`: if it fails it is started again at once, and
//! its `pre_start` rebuilds the lease table, the session views and the
//! timer from what outlives it (the [`LeaseStore`] and [`Shared`]'s maps),
//! then makes [`Shared::leases`] name it. Callers that found the old actor
//! gone wait for the new one ([`Shared::send_leases`]).
//!
//! `mcp` holds one `temporary` child per MCP channel (session × server),
//! started on first use (an HTTP client, or the server becoming ready) and
//! stopped when its session ends.
//!
//! `turns` holds one `temporary` child per session's agent stream (event
//! log, subscribers, interactions), started when the session is created
//! and stopped when the platform's view forgets it.
//!
//! `connections` holds one `temporary` child per executor connection, with
//! the connection id as child id. A failed connection actor is not
//! restarted: the exit callback closes its socket with 1011, so the
//! executor reconnects and resumes its sessions on a new connection (the
//! reader task then reports the lost socket in the actor's place).

use super::connection::{close_orphaned, ConnArgs, ConnMsg, Connection};
use super::leases::{Leases, LeasesArgs};
use crate::harness::runtime::Shared;
use crate::lease::LeaseStore;
use crate::supervisor::{
    start_actor, ChildExit, ChildSpec, DynamicSpec, DynamicSupervisor, Exit, Intensity, Restart,
    Strategy, Supervisor, SupervisorExit, SupervisorMsg, SupervisorSpec,
};
use ractor::{ActorCell, ActorRef};
use std::sync::{Arc, Weak};
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
    let leases = ChildSpec::restartable(
        "leases",
        Restart::Permanent,
        Leases,
        LeasesArgs {
            shared: shared.clone(),
            store,
        },
    )
    .shutdown_timeout(Duration::from_secs(5));
    // The callback must not keep `Shared` alive on its own.
    let weak = Arc::downgrade(&shared);
    let connections = ChildSpec::new("connections", Restart::Permanent, move |sup: ActorCell| {
        let weak = weak.clone();
        async move {
            let on_exit = weak.clone();
            let spec = DynamicSpec::new("connections")
                .on_exit(move |exit: ChildExit| connection_exited(&on_exit, exit));
            let conns = DynamicSupervisor::start_linked(spec, sup)
                .await
                .map_err(|e| e.to_string())?;
            if let Some(s) = weak.upgrade() {
                s.set_connections(conns.clone());
            }
            Ok(conns.get_cell())
        }
    })
    .shutdown_timeout(Duration::from_secs(5));
    let max_channels = shared.config.mcp_max_channels;
    let weak = Arc::downgrade(&shared);
    let mcp = ChildSpec::new("mcp", Restart::Permanent, move |sup: ActorCell| {
        let weak = weak.clone();
        async move {
            // Channel actors are temporary: one that fails has answered
            // nothing it held (its ports drop, the HTTP side answers them
            // with an error) and the next use starts a fresh one.
            let spec = DynamicSpec::new("mcp").max_children(max_channels);
            let mcp = DynamicSupervisor::start_linked(spec, sup)
                .await
                .map_err(|e| e.to_string())?;
            if let Some(s) = weak.upgrade() {
                s.set_mcp(mcp.clone());
            }
            Ok(mcp.get_cell())
        }
    })
    .shutdown_timeout(Duration::from_secs(5));
    let max_streams = shared.config.turns_max_sessions;
    let weak = Arc::downgrade(&shared);
    let turns = ChildSpec::new("turns", Restart::Permanent, move |sup: ActorCell| {
        let weak = weak.clone();
        async move {
            // Stream actors are temporary: one that fails loses its log
            // (its clients' streams end; see actors::turns) and the next
            // frame or client starts a fresh one.
            let spec = DynamicSpec::new("turns").max_children(max_streams);
            let turns = DynamicSupervisor::start_linked(spec, sup)
                .await
                .map_err(|e| e.to_string())?;
            if let Some(s) = weak.upgrade() {
                s.set_turns_sup(turns.clone());
            }
            Ok(turns.get_cell())
        }
    })
    .shutdown_timeout(Duration::from_secs(5));
    Supervisor::start(SupervisorSpec {
        strategy: Strategy::OneForOne,
        intensity: Some(INTENSITY),
        children: vec![leases, mcp, turns, connections],
    })
    .await
}

/// A connection actor ended. A normal end follows a lost socket; any other
/// leaves a socket nobody serves, which is closed so the executor reconnects.
fn connection_exited(shared: &Weak<Shared>, exit: ChildExit) {
    if matches!(exit.exit, Exit::Normal | Exit::Shutdown(_)) {
        return;
    }
    tracing::warn!(connection_id = %exit.id, exit = ?exit.exit, "connection actor failed");
    let Some(shared) = shared.upgrade() else {
        return;
    };
    let link = shared
        .conns
        .iter()
        .find(|e| e.connection_id == exit.id)
        .map(|e| e.link.clone());
    if let Some(link) = link {
        close_orphaned(&link);
    }
}

/// Start the actor of one executor connection under `connections`.
pub async fn start_connection(
    shared: &Shared,
    args: ConnArgs,
) -> Result<ActorRef<ConnMsg>, String> {
    let Some(sup) = shared.connections() else {
        return Err("the connections supervisor is not running".into());
    };
    let spec = ChildSpec::temporary(args.connection_id.clone(), Connection, args)
        .shutdown_timeout(Duration::from_secs(2));
    start_actor(&sup, spec).await.map_err(|e| e.to_string())
}

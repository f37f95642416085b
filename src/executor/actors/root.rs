//! The executor's root supervisor: sessions first, then the connection.
//!
//! The connection is `permanent` with the reconnect backoff of PROTOCOL.md
//! §3.4: a lost socket is a child exit and the restart is the reconnect. It
//! is `significant`: when it ends for good (4004, 4001, 4003, a completed
//! drain) the root shuts everything down in reverse order and reports why.

use super::{connection::Connection, sessions::Sessions, terminals::Terminals};
use crate::executor::Shared;
use crate::supervisor::{
    ChildSpec, Restart, Supervisor, SupervisorExit, SupervisorMsg, SupervisorSpec,
};
use ractor::ActorRef;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

pub async fn start(
    shared: Arc<Shared>,
) -> Result<(ActorRef<SupervisorMsg>, oneshot::Receiver<SupervisorExit>), ractor::SpawnErr> {
    let sessions = ChildSpec::restartable("sessions", Restart::Permanent, Sessions, shared.clone())
        // Ending every session kills its processes: allow for the stop deadline.
        .shutdown_timeout(Duration::from_secs(15));
    let terminals =
        ChildSpec::restartable("terminals", Restart::Permanent, Terminals, shared.clone())
            .shutdown_timeout(Duration::from_secs(10));
    // Before the connection: the advertised permission modes depend on
    // whether its socket is up.
    let confirm = ChildSpec::restartable(
        "confirm",
        Restart::Permanent,
        super::confirm::Confirm,
        shared.clone(),
    )
    .shutdown_timeout(Duration::from_secs(5));
    let connection =
        ChildSpec::restartable("connection", Restart::Permanent, Connection, shared.clone())
            .backoff(shared.config.reconnect_backoff)
            .max_attempts(shared.config.reconnect_max_attempts)
            .significant()
            .shutdown_timeout(Duration::from_secs(5));
    Supervisor::start(SupervisorSpec {
        strategy: crate::supervisor::Strategy::OneForOne,
        // Reconnects are bounded by the connection's own attempts, not by
        // an intensity window (a flapping network is not a crash loop).
        intensity: None,
        children: vec![sessions, terminals, confirm, connection],
    })
    .await
}

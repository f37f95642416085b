//! The harness runtime: per-instance state its actors and API handlers
//! share (the configuration, the routing maps, the event channel).
//!
//! Shared maps ([`Shared::conns`], [`Shared::executors`], [`Shared::sessions`])
//! are per harness instance (never ractor's global registry) and are only
//! *written* by the actor that owns the entry: a connection actor its own
//! [`ConnEntry`], the leases actor the registry and the sessions. Everyone
//! else reads them for routing and listings.
//!
//! They also outlive the leases actor: when it crashes, its supervisor
//! starts a new one that rebuilds its state from them and the lease store,
//! and [`Shared::leases`] then names the new actor.

use super::actors::connection::ConnMsg;
use super::actors::leases::LeasesMsg;
use super::actors::mcp::McpMsg;
use super::actors::mcp_service::{ServiceMsg, ServiceReg};
use super::actors::turns::TurnsMsg;
use super::api::mcp::McpToolsView;
use crate::harness::api::terminals::TerminalRegistry;
use crate::harness::config::{Authenticator, EventCallback, HarnessConfig};
use crate::harness::http::relay::Relays;
use crate::harness::store::durable::StoredSession;
use crate::harness::store::{DurableState, StoreError};
use crate::harness::types::{HarnessEvent, SessionInfo};
use crate::lease::ConnId;
use crate::supervisor::DynamicMsg;
use crate::wire::types::{Capabilities, ExecutorInfo};
use crate::wire::Link;
use dashmap::DashMap;
use ractor::ActorRef;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

/// How long a caller waits for a crashed leases actor to be replaced
/// before answering "shutting down".
pub const LEASES_RESTART_WAIT: Duration = Duration::from_secs(5);

/// A connection as the registry sees it; written by its connection actor.
#[derive(Clone)]
pub struct ConnEntry {
    pub conn: ConnId,
    pub connection_id: String,
    /// The principal the token mapped to.
    pub executor_id: String,
    pub link: Link,
    pub registered: bool,
    pub info: Option<ExecutorInfo>,
    pub capabilities: Capabilities,
    pub connected_at: String,
    pub last_heartbeat_at: Option<String>,
    /// Told to drain (`api::drain`): no new session is placed here.
    pub draining: bool,
    /// The connection's actor, once started (for supervision tests).
    pub actor: Option<ActorRef<ConnMsg>>,
}

/// Per-instance state shared by the harness's actors and API handlers.
pub struct Shared {
    pub config: HarnessConfig,
    pub authenticate: Authenticator,
    /// Every upgraded connection, registered or not.
    pub conns: DashMap<ConnId, ConnEntry>,
    /// Executor id → its one live registered connection (the 4004 rule);
    /// written only by the leases actor.
    pub executors: DashMap<String, ConnId>,
    /// The platform's view of sessions; written only by the leases actor.
    pub sessions: DashMap<String, SessionInfo>,
    /// Session → when its orphaned lease runs out (harness ms); written
    /// only by the leases actor, so that a restarted one keeps the deadline.
    pub lease_deadlines: DashMap<String, u64>,
    pub events: broadcast::Sender<HarnessEvent>,
    pub on_event: Option<EventCallback>,
    /// Terminals opened through this harness (the protocol has no list).
    pub terminals: TerminalRegistry,
    /// Terminal relays: outstanding tickets, live relays.
    pub relays: Relays,
    /// Display relays: outstanding viewer tickets (`display.rfb`).
    pub rfb: crate::harness::http::rfb::RfbTickets,
    /// Base URL executors dial for relays; set once the listener is bound.
    pub relay_base: OnceLock<String>,
    /// (session, serverKey) → its MCP channel actor; each entry written
    /// only by that actor (inserted when it starts, removed when it stops).
    pub mcp_channels: DashMap<(String, String), ActorRef<McpMsg>>,
    /// (session, serverKey) → the server's tool list; each entry written
    /// only by that server's channel actor.
    pub mcp_tools: DashMap<(String, String), McpToolsView>,
    /// (session, serverKey) → the `service` server the platform registered
    /// (`POST /v1/sessions/{id}/mcp-services`); removed with the session.
    pub mcp_services: DashMap<(String, String), ServiceReg>,
    /// (session, serverKey) → its service actor; each entry written only
    /// by that actor.
    pub mcp_service_actors: DashMap<(String, String), ActorRef<ServiceMsg>>,
    /// The dynamic supervisor of the MCP channel actors.
    mcp: std::sync::RwLock<Option<ActorRef<DynamicMsg>>>,
    /// Session → its agent stream actor (events, subscribers,
    /// interactions); each entry written only by that actor (and removed
    /// by [`crate::harness::actors::turns::forget`]).
    pub turns: DashMap<String, ActorRef<TurnsMsg>>,
    /// The dynamic supervisor of the agent stream actors.
    turns_sup: std::sync::RwLock<Option<ActorRef<DynamicMsg>>>,
    /// The current leases actor; replaced each time it is (re)started.
    leases: watch::Sender<Option<ActorRef<LeasesMsg>>>,
    /// Bumped by the leases actor whenever routes may have changed: an
    /// executor registered (a resume moves sessions to a new connection)
    /// or a session ended. Requests lost with a connection wait on it to
    /// be sent again on the resumed one (`api::resend`), without polling.
    routes: watch::Sender<u64>,
    /// Counters and histograms of this harness (`GET /metrics`).
    pub metrics: super::metrics::Metrics,
    /// The dynamic supervisor of the connection actors.
    connections: std::sync::RwLock<Option<ActorRef<DynamicMsg>>>,
    next_conn: AtomicU64,
    /// Distinguishes connection ids of this harness run from earlier ones.
    instance: String,
    origin: Instant,
    pub shutdown: CancellationToken,
    /// Device enrollment and its credentials (`None`: not enabled, the
    /// routes answer 404).
    pub enrollments: OnceLock<Arc<crate::harness::api::enrollments::Enrollments>>,
    /// Where sessions and tool results are written through (unset: kept
    /// in memory only). Written only by the leases actor.
    pub durable: OnceLock<DurableState>,
    /// Set when this harness is one of several replicas over PostgreSQL
    /// (`crate::harness::replica`).
    pub replica: OnceLock<crate::harness::replica::Replica>,
    /// Where artifacts (and later backups, skills) are kept (`None`: no
    /// data dir, artifact uploads answer 501).
    pub blobs: OnceLock<Arc<dyn crate::harness::blob::BlobStore>>,
    /// Upload tickets and the artifact index.
    pub artifacts: crate::harness::api::artifacts::Artifacts,
}

impl Shared {
    pub fn new(
        config: HarnessConfig,
        authenticate: Authenticator,
        on_event: Option<EventCallback>,
    ) -> Arc<Shared> {
        let (events, _) = broadcast::channel(4096);
        let instance = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
        Arc::new(Shared {
            config,
            authenticate,
            conns: DashMap::new(),
            executors: DashMap::new(),
            sessions: DashMap::new(),
            lease_deadlines: DashMap::new(),
            events,
            on_event,
            terminals: TerminalRegistry::default(),
            relays: Relays::default(),
            rfb: Default::default(),
            relay_base: OnceLock::new(),
            mcp_channels: DashMap::new(),
            mcp_tools: DashMap::new(),
            mcp_services: DashMap::new(),
            mcp_service_actors: DashMap::new(),
            mcp: std::sync::RwLock::new(None),
            turns: DashMap::new(),
            turns_sup: std::sync::RwLock::new(None),
            leases: watch::channel(None).0,
            routes: watch::channel(0).0,
            metrics: super::metrics::Metrics::new(),
            connections: std::sync::RwLock::new(None),
            next_conn: AtomicU64::new(1),
            instance,
            origin: Instant::now(),
            shutdown: CancellationToken::new(),
            enrollments: OnceLock::new(),
            durable: OnceLock::new(),
            replica: OnceLock::new(),
            blobs: OnceLock::new(),
            artifacts: Default::default(),
        })
    }

    /// Milliseconds on the harness's monotonic clock (the `now` of the lease table).
    pub fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// Tell waiting re-senders that routes may have changed.
    pub(crate) fn routes_changed(&self) {
        self.routes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver that wakes on the next [`Shared::routes_changed`].
    pub(crate) fn route_changes(&self) -> watch::Receiver<u64> {
        self.routes.subscribe()
    }

    pub fn next_conn(&self) -> (ConnId, String) {
        let n = self.next_conn.fetch_add(1, Ordering::Relaxed);
        (ConnId(n), format!("c-{}-{n}", self.instance))
    }

    pub(crate) fn set_leases(&self, leases: ActorRef<LeasesMsg>) {
        self.leases.send_replace(Some(leases));
    }

    pub(crate) fn set_connections(&self, sup: ActorRef<DynamicMsg>) {
        *self
            .connections
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(sup);
    }

    /// The supervisor connection actors are started under.
    pub(crate) fn connections(&self) -> Option<ActorRef<DynamicMsg>> {
        self.connections
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn set_mcp(&self, sup: ActorRef<DynamicMsg>) {
        *self
            .mcp
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(sup);
    }

    /// The supervisor MCP channel actors are started under.
    pub(crate) fn mcp(&self) -> Option<ActorRef<DynamicMsg>> {
        self.mcp
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn set_turns_sup(&self, sup: ActorRef<DynamicMsg>) {
        *self
            .turns_sup
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(sup);
    }

    /// The supervisor agent stream actors are started under.
    pub(crate) fn turns_sup(&self) -> Option<ActorRef<DynamicMsg>> {
        self.turns_sup
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The current leases actor (it may have just died: a send can fail).
    pub fn leases(&self) -> Option<ActorRef<LeasesMsg>> {
        self.leases.borrow().clone()
    }

    /// Send to the leases actor; if it just died, wait for the next one
    /// (at most [`LEASES_RESTART_WAIT`]) and send there. The message comes
    /// back when it could not be delivered (the harness is shutting down).
    pub async fn send_leases(&self, msg: LeasesMsg) -> Result<(), Option<LeasesMsg>> {
        let Some(leases) = self.leases() else {
            return Err(Some(msg));
        };
        match leases.send_message(msg) {
            Ok(()) => Ok(()),
            Err(ractor::MessagingErr::SendErr(msg)) => {
                if self.shutdown.is_cancelled() {
                    return Err(Some(msg));
                }
                let Some(next) = self.next_leases(&leases, LEASES_RESTART_WAIT).await else {
                    return Err(Some(msg));
                };
                next.send_message(msg).map_err(|e| match e {
                    ractor::MessagingErr::SendErr(m) => Some(m),
                    _ => None,
                })
            }
            Err(_) => Err(None),
        }
    }

    /// The leases actor after `failed` (one a send just failed on): waits
    /// up to `wait` for its supervisor to start the next one. `None` when
    /// the harness is shutting down or no new actor came.
    pub async fn next_leases(
        &self,
        failed: &ActorRef<LeasesMsg>,
        wait: Duration,
    ) -> Option<ActorRef<LeasesMsg>> {
        let mut rx = self.leases.subscribe();
        let fresh = |r: &Option<ActorRef<LeasesMsg>>| {
            r.as_ref().is_some_and(|a| a.get_id() != failed.get_id())
        };
        let found = tokio::select! {
            r = rx.wait_for(fresh) => r.ok().and_then(|r| r.clone()),
            _ = tokio::time::sleep(wait) => None,
            _ = self.shutdown.cancelled() => None,
        };
        found
    }

    /// Publish an event to subscribers and the callback.
    pub fn emit(&self, event: HarnessEvent) {
        if let Some(cb) = &self.on_event {
            cb(&event);
        }
        let _ = self.events.send(event);
    }

    /// The link of a live connection.
    pub fn link_of(&self, conn: ConnId) -> Option<Link> {
        self.conns.get(&conn).map(|e| e.link.clone())
    }

    pub fn authenticate(&self, token: Option<&str>) -> Option<String> {
        token.and_then(|t| (self.authenticate)(t))
    }

    /// A session's record as the store keeps it: the published record, and
    /// when its orphaned lease runs out as a unix time (this process's
    /// monotonic clock means nothing to the next one).
    pub(crate) fn stored_session(&self, session_id: &str) -> Option<StoredSession> {
        let info = self.sessions.get(session_id)?.clone();
        let lease_expires_at_ms = self.lease_deadlines.get(session_id).map(|d| {
            let left = d.saturating_sub(self.now_ms());
            unix_ms().saturating_add(left)
        });
        Some(StoredSession {
            info,
            lease_expires_at_ms,
        })
    }
}

/// Milliseconds since the unix epoch (0 if the clock is before it).
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Load the sessions of an earlier run into `shared`, for the leases actor
/// to rebuild from (as after its own crash): their holders are gone, so
/// each live one is orphaned and waits for its executor's resume. An
/// orphaned lease keeps what was left of its deadline, at most one TTL.
///
/// `skip`: sessions another live replica holds (over PostgreSQL), left to
/// it.
pub(crate) async fn restore_sessions(
    shared: &Shared,
    durable: &DurableState,
    skip: &std::collections::HashSet<String>,
) -> Result<usize, StoreError> {
    let d = durable.clone();
    let (sessions, _) = tokio::task::spawn_blocking(move || d.load())
        .await
        .map_err(|e| StoreError::Unavailable(e.to_string()))??;
    let now = shared.now_ms();
    let wall = unix_ms();
    let ttl = shared.config.lease_ttl_ms;
    let n = sessions.len();
    for s in sessions {
        let id = s.info.session_id.clone();
        if skip.contains(&id) {
            continue;
        }
        if s.info.state != crate::harness::types::SessionState::Ended {
            if let Some(at) = s.lease_expires_at_ms {
                let left = at.saturating_sub(wall).min(ttl);
                shared.lease_deadlines.insert(id.clone(), now + left);
            }
        }
        shared.sessions.insert(id, s.info);
    }
    if n > 0 {
        tracing::info!(sessions = n, "sessions restored from the store");
    }
    Ok(n)
}

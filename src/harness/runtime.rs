//! The harness runtime: per-instance state its actors and API handlers
//! share (the configuration, the routing maps, the event channel).
//!
//! Shared maps ([`Shared::conns`], [`Shared::executors`], [`Shared::sessions`])
//! are per harness instance (never ractor's global registry) and are only
//! *written* by the actor that owns the entry: a connection actor its own
//! [`ConnEntry`], the leases actor the registry and the sessions. Everyone
//! else reads them for routing and listings.

use super::actors::leases::LeasesMsg;
use crate::harness::api::terminals::TerminalRegistry;
use crate::harness::config::{Authenticator, EventCallback, HarnessConfig};
use crate::harness::http::relay::Relays;
use crate::harness::types::{HarnessEvent, SessionInfo};
use crate::lease::ConnId;
use crate::wire::types::{Capabilities, ExecutorInfo};
use crate::wire::Link;
use dashmap::DashMap;
use ractor::ActorRef;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

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
    pub events: broadcast::Sender<HarnessEvent>,
    pub on_event: Option<EventCallback>,
    /// Terminals opened through this harness (the protocol has no list).
    pub terminals: TerminalRegistry,
    /// Terminal relays: outstanding tickets, live relays.
    pub relays: Relays,
    /// Base URL executors dial for relays; set once the listener is bound.
    pub relay_base: OnceLock<String>,
    leases: OnceLock<ActorRef<LeasesMsg>>,
    next_conn: AtomicU64,
    /// Distinguishes connection ids of this harness run from earlier ones.
    instance: String,
    origin: Instant,
    pub shutdown: CancellationToken,
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
            events,
            on_event,
            terminals: TerminalRegistry::default(),
            relays: Relays::default(),
            relay_base: OnceLock::new(),
            leases: OnceLock::new(),
            next_conn: AtomicU64::new(1),
            instance,
            origin: Instant::now(),
            shutdown: CancellationToken::new(),
        })
    }

    /// Milliseconds on the harness's monotonic clock (the `now` of the lease table).
    pub fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    pub fn next_conn(&self) -> (ConnId, String) {
        let n = self.next_conn.fetch_add(1, Ordering::Relaxed);
        (ConnId(n), format!("c-{}-{n}", self.instance))
    }

    pub(crate) fn set_leases(&self, leases: ActorRef<LeasesMsg>) {
        let _ = self.leases.set(leases);
    }

    pub fn leases(&self) -> Option<&ActorRef<LeasesMsg>> {
        self.leases.get()
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
}

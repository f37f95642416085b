//! The harness as a library: the control plane a hosting platform embeds
//! (or `bmx harness` runs). It accepts executors on
//! `GET /v1/executor/connect`, keeps at most one live connection per
//! executor id (4004), watches heartbeats (4008), grants session leases
//! with fencing tokens, and serves the HTTP API of `docs/api.md` on the same
//! listener.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use bmx::harness::{CreateSession, Harness, HarnessEvent};
//!
//! let harness = Harness::builder()
//!     .listen("127.0.0.1:0".parse()?)
//!     .token("exec-1", "secret-1")
//!     // Or map tokens to executor ids with a callback of your own:
//!     .authenticate(|token| (token == "other").then(|| "exec-2".to_string()))
//!     .on_event(|e: &HarnessEvent| println!("event: {e:?}"))
//!     .build()
//!     .await?;
//! println!("executors connect to {}", harness.executor_url());
//!
//! // No executor is connected yet: creating a session is refused with 503.
//! let err = harness.sessions().create(CreateSession::default()).await.unwrap_err();
//! assert_eq!(err.status, 503);
//!
//! // With an executor connected:
//! //   let s = harness.sessions().create(CreateSession::default()).await?;
//! //   s.start_process(process_params("p1", vec!["echo".into(), "hi".into()])).await?;
//! //   s.call_tool(ToolCall::new("bash", json!({"command": "echo hi"}))).await?;
//! //   s.stop().await?;
//! harness.shutdown().await;
//! # Ok(())
//! # }
//! ```

// `ApiError` carries a full JSON-RPC error object by value on purpose: it is
// built once per failed request and handed straight to the caller.
#![allow(clippy::result_large_err)]

pub mod actors;
pub mod api;
pub mod blob;
pub mod config;
pub mod data_dir;
pub mod enroll;
pub mod error;
pub mod events;
pub mod http;
pub mod interactions;
pub mod mcp_proxy;
pub mod metrics;
pub mod replica;
pub mod rows;
pub mod runtime;
pub mod store;
pub mod types;

pub use api::mcp::{McpServerInfo, McpServerView, McpToolInfo, McpToolsView};
pub use api::sessions::{process_params, CreateSession, ReadRequest, Session, Sessions, ToolCall};
pub use api::terminals::{OpenTerminal, TerminalState, TerminalView, Terminals};
pub use api::turns::{
    CancelTurn, EventStream, InteractionAnswer, MoreInput, StartTurn, StreamItem, TurnInput,
    TurnStarted,
};
pub use config::{Authenticator, ConnectionLimits, EventCallback, HarnessConfig};
pub use error::ApiError;
pub use interactions::{InteractionState, InteractionView};
pub use types::{ExecutorView, HarnessEvent, SessionInfo, SessionState};

use crate::lease::{LeaseStore, MemoryLeaseStore};
use crate::supervisor::SupervisorMsg;
use crate::wire::transport::CONNECT_PATH;
use crate::wire::CloseCode;
use actors::connection::ConnMsg;
use actors::leases::LeasesMsg;
use http::listener;
use ractor::ActorRef;
use runtime::Shared;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

/// Entry point of the embedded harness.
pub struct Harness;

impl Harness {
    pub fn builder() -> HarnessBuilder {
        HarnessBuilder::default()
    }
}

/// Why the harness could not start.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error("refusing an unauthenticated API on the non-loopback address {0}: set an API token (--api-token) or allow it explicitly")]
    OpenApi(SocketAddr),
    #[error("no executor credential: add a token or an authenticate callback")]
    NoCredentials,
    #[error("cannot start the actors: {0}")]
    Spawn(String),
    #[error("{0}")]
    PublicUrl(String),
    /// An API token anyone could guess (issue 56).
    #[error("the API token (--api-token) is {0} bytes: it must have at least {min} (e.g. `openssl rand -hex 32`)", min = config::MIN_API_TOKEN_BYTES)]
    ShortApiToken(usize),
}

/// Configures a harness; [`build`](HarnessBuilder::build) starts it.
#[derive(Default)]
pub struct HarnessBuilder {
    config: HarnessConfig,
    tokens: HashMap<String, String>,
    authenticate: Option<Authenticator>,
    on_event: Option<EventCallback>,
    store: Option<Arc<dyn LeaseStore>>,
    enrollment_store: Option<Arc<dyn store::Store>>,
    durable: Option<store::DurableState>,
    blob_store: Option<Arc<dyn blob::BlobStore>>,
    replicas: Option<Arc<store::PgReplicas>>,
}

impl HarnessBuilder {
    /// Replace the whole configuration (tokens and callbacks stay).
    pub fn config(mut self, config: HarnessConfig) -> Self {
        self.config = config;
        self
    }

    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.config.listen = addr;
        self
    }

    /// Serve the HTTP API on this Unix socket too ([`HarnessConfig::api_unix`]).
    pub fn api_unix(mut self, path: impl Into<PathBuf>) -> Self {
        self.config.api_unix = Some(path.into());
        self
    }

    /// Also accept executors on a Unix socket.
    pub fn listen_unix(mut self, path: impl Into<PathBuf>) -> Self {
        self.config.listen_unix = Some(path.into());
        self
    }

    /// Accept bearer token `secret` as executor `executor_id`.
    pub fn token(mut self, executor_id: impl Into<String>, secret: impl Into<String>) -> Self {
        self.tokens.insert(secret.into(), executor_id.into());
        self
    }

    /// Map bearer tokens to executor ids with a callback (asked first; the
    /// static tokens are the fallback). Must not block.
    pub fn authenticate<F>(mut self, f: F) -> Self
    where
        F: Fn(&str) -> Option<String> + Send + Sync + 'static,
    {
        self.authenticate = Some(Arc::new(f));
        self
    }

    pub fn heartbeat_ms(mut self, ms: u64) -> Self {
        self.config.heartbeat_interval_ms = ms.max(1);
        self
    }

    pub fn lease_ttl_ms(mut self, ms: u64) -> Self {
        self.config.lease_ttl_ms = ms.max(1);
        self
    }

    pub fn api_token(mut self, token: Option<String>) -> Self {
        self.config.api_token = token.filter(|t| !t.is_empty()).map(Into::into);
        self
    }

    /// Base URL executors dial for terminal relays (default: `ws://` + the
    /// bound address). Needed behind a proxy, or when binding 0.0.0.0 for
    /// remote executors.
    pub fn public_url(mut self, url: Option<String>) -> Self {
        self.config.public_url = url.filter(|u| !u.trim().is_empty());
        self
    }

    /// Serve the API without a token on a non-loopback address.
    pub fn allow_open_api(mut self, allow: bool) -> Self {
        self.config.allow_open_api = allow;
        self
    }

    /// A callback for every [`HarnessEvent`]; it runs on the harness's
    /// actors, so it must return quickly.
    pub fn on_event<F>(mut self, f: F) -> Self
    where
        F: Fn(&HarnessEvent) + Send + Sync + 'static,
    {
        self.on_event = Some(Arc::new(f));
        self
    }

    /// Where fencing counters live (default: in memory). Share a durable
    /// store so tokens keep increasing across harness restarts.
    pub fn lease_store(mut self, store: Arc<dyn LeaseStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Keep the harness's state in `state` (docs/store.md): fencing tokens
    /// come from it (replacing [`lease_store`](Self::lease_store)),
    /// sessions and acknowledged tool results are written through, and a
    /// harness started over the same store knows every session again.
    pub fn durable_state(mut self, state: store::DurableState) -> Self {
        self.durable = Some(state);
        self
    }

    /// Run as one of several live replicas over the PostgreSQL database of
    /// `replicas` (docs/store.md, "Several replicas"): the 4004 rule holds
    /// across replicas and session grants are claimed in the database.
    /// Use with a [`durable_state`](Self::durable_state) over the same
    /// [`store::PgStore`].
    pub fn replicas(mut self, replicas: Arc<store::PgReplicas>) -> Self {
        self.replicas = Some(replicas);
        self
    }

    /// Enable device enrollment (docs/runner.md) with enrollments and
    /// issued credentials kept in `store`; its credentials are accepted
    /// at the executors' upgrade beside the static tokens.
    pub fn enrollment_store(mut self, store: Arc<dyn store::Store>) -> Self {
        self.enrollment_store = Some(store);
        self
    }

    /// Keep artifacts in `store` (e.g. [`blob::FsBlobStore`] under the
    /// data dir). Without one, artifact uploads answer 501.
    pub fn blob_store(mut self, store: Arc<dyn blob::BlobStore>) -> Self {
        self.blob_store = Some(store);
        self
    }

    /// `ttl` of new enrollments and their poll interval.
    pub fn enrollment_timing(mut self, ttl: Duration, poll_interval: Duration) -> Self {
        self.config.enrollment_ttl = ttl;
        self.config.enrollment_poll_interval = poll_interval;
        self
    }

    /// Bind, start the actors and serve.
    pub async fn build(self) -> Result<HarnessHandle, HarnessError> {
        let config = self.config;
        if config.api_token.is_none() && !config.allow_open_api && !config.listen.ip().is_loopback()
        {
            return Err(HarnessError::OpenApi(config.listen));
        }
        if let Some(t) = &config.api_token {
            if t.expose().len() < config::MIN_API_TOKEN_BYTES {
                return Err(HarnessError::ShortApiToken(t.expose().len()));
            }
        }
        if self.tokens.is_empty() && self.authenticate.is_none() && self.enrollment_store.is_none()
        {
            return Err(HarnessError::NoCredentials);
        }
        let enrollments = match self.enrollment_store {
            Some(s) => Some(Arc::new(
                api::enrollments::Enrollments::new(
                    s,
                    config.enrollment_ttl,
                    config.enrollment_poll_interval,
                )
                .map_err(|e| HarnessError::Spawn(e.to_string()))?,
            )),
            None => None,
        };
        let tokens = self.tokens;
        let callback = self.authenticate;
        let enrolled = enrollments.clone();
        let authenticate: Authenticator = Arc::new(move |token: &str| {
            if let Some(cb) = &callback {
                if let Some(id) = cb(token) {
                    return Some(id);
                }
            }
            if let Some(id) = enrolled.as_ref().and_then(|e| e.authenticate(token)) {
                return Some(id);
            }
            tokens.get(token).cloned()
        });
        let tcp = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| HarnessError::Listen {
                addr: config.listen.to_string(),
                source,
            })?;
        let addr = tcp.local_addr().map_err(|source| HarnessError::Listen {
            addr: config.listen.to_string(),
            source,
        })?;
        // Bound before anything starts, so a bad path fails the build
        // with nothing to stop.
        // Its file goes with the listener if the build fails below.
        let api_unix = match &config.api_unix {
            Some(p) => Some(
                listener::bind_api_unix(p).map_err(|source| HarnessError::Listen {
                    addr: p.display().to_string(),
                    source,
                })?,
            ),
            None => None,
        };
        let relay_base = http::relay::relay_base(config.public_url.as_deref(), addr)
            .map_err(HarnessError::PublicUrl)?;
        let store: Arc<dyn LeaseStore> = match (&self.durable, self.store) {
            (Some(d), _) => Arc::new(d.clone()),
            (None, Some(s)) => s,
            (None, None) => Arc::new(MemoryLeaseStore::new()),
        };
        let unix_path = config.listen_unix.clone();
        let shared = Shared::new(config, authenticate, self.on_event);
        if let Some(e) = enrollments {
            let _ = shared.enrollments.set(e);
        }
        if let Some(d) = self.durable {
            // Over several replicas, the sessions another live replica
            // holds are its own: not loaded here (docs/store.md,
            // "Takeover").
            let skip = match &self.replicas {
                Some(r) => {
                    let (r, alive) = (r.clone(), shared.config.lease_ttl_ms);
                    tokio::task::spawn_blocking(move || r.held_elsewhere(alive))
                        .await
                        .map_err(|e| HarnessError::Spawn(e.to_string()))?
                        .map_err(|e| HarnessError::Spawn(e.to_string()))?
                        .into_iter()
                        .collect()
                }
                None => std::collections::HashSet::new(),
            };
            // Before the leases actor starts: it rebuilds from these.
            runtime::restore_sessions(&shared, &d, &skip)
                .await
                .map_err(|e| HarnessError::Spawn(e.to_string()))?;
            let _ = shared.durable.set(d);
        }
        let _ = shared.relay_base.set(relay_base);
        if let Some(r) = self.replicas {
            let _ = shared.replica.set(replica::Replica::new(r));
            replica::watch(&shared, format!("http://{addr}"))
                .map_err(|e| HarnessError::Spawn(format!("replica listener: {e}")))?;
        }
        if let Some(b) = self.blob_store {
            let _ = shared.blobs.set(b);
        }
        // The root starts `leases` then `connections`; the API and the
        // listeners need both, so wait until they are up.
        let (root, _exit) = actors::root::start(shared.clone(), store)
            .await
            .map_err(|e| HarnessError::Spawn(e.to_string()))?;
        let ready = async {
            while shared.leases().is_none()
                || shared.connections().is_none()
                || shared.mcp().is_none()
                || shared.turns_sup().is_none()
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(10), ready)
            .await
            .is_err()
        {
            root.stop(None);
            return Err(HarnessError::Spawn(
                "the harness actors did not start".into(),
            ));
        }
        let unix = match &unix_path {
            Some(p) => Some(listener::serve_unix(shared.clone(), p).map_err(|source| {
                root.stop(None);
                HarnessError::Listen {
                    addr: p.display().to_string(),
                    source,
                }
            })?),
            None => None,
        };
        let (in_process, accept) = crate::wire::transport::InProcess::channel(IN_PROCESS_BACKLOG);
        let in_process_task = listener::serve_in_process(shared.clone(), accept);
        let router = http::router(shared.clone());
        let stop = shared.shutdown.clone();
        let gate = listener::Gate::new(shared.config.connections.max_unauthenticated);
        let api_unix = api_unix.map(|l| {
            tracing::info!(path = %l.path().display(), "harness API on a Unix socket");
            let limits = shared.config.connections;
            tokio::spawn(listener::serve(
                l,
                router.clone(),
                gate.clone(),
                limits,
                stop.clone(),
            ))
        });
        let server = tokio::spawn(listener::serve(
            tcp,
            router,
            gate,
            shared.config.connections,
            stop,
        ));
        tracing::info!(%addr, "harness listening");
        Ok(HarnessHandle {
            shared,
            addr,
            root,
            server: Some(server),
            api_unix,
            unix,
            in_process,
            in_process_task: Some(in_process_task),
        })
    }
}

/// Dials of the in-process endpoint waiting for their handshake to start.
const IN_PROCESS_BACKLOG: usize = 16;

/// A running harness. Dropping it stops accepting; call
/// [`shutdown`](HarnessHandle::shutdown) for an orderly stop.
pub struct HarnessHandle {
    shared: Arc<Shared>,
    addr: SocketAddr,
    /// The root supervisor: `leases`, then `connections`.
    root: ActorRef<SupervisorMsg>,
    server: Option<JoinHandle<()>>,
    /// The API's Unix socket ([`HarnessConfig::api_unix`]).
    api_unix: Option<JoinHandle<()>>,
    unix: Option<JoinHandle<()>>,
    in_process: crate::wire::transport::InProcess,
    in_process_task: Option<JoinHandle<()>>,
}

impl HarnessHandle {
    /// The bound TCP address (API and executors).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`: prefix of the API (`/v1/...`).
    pub fn api_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `ws://ADDR/v1/executor/connect`: where executors dial.
    pub fn executor_url(&self) -> String {
        format!("ws://{}{CONNECT_PATH}", self.addr)
    }

    /// Where an executor in this process dials: an in-process pipe per
    /// connection (PROTOCOL.md §1, "local transport"), with the same
    /// handshake, token check and frames as the socket at
    /// [`executor_url`](Self::executor_url). `bmx up` connects its
    /// executor this way: no kernel socket between two ends that share a
    /// process, and no port another local user could reach.
    pub fn in_process_endpoint(&self) -> crate::wire::Endpoint {
        crate::wire::Endpoint::InProcess(self.in_process.clone())
    }

    pub fn config(&self) -> &HarnessConfig {
        &self.shared.config
    }

    pub fn sessions(&self) -> Sessions {
        Sessions {
            shared: self.shared.clone(),
        }
    }

    /// Executor-scoped terminals opened through this harness.
    pub fn terminals(&self) -> Terminals {
        Terminals {
            shared: self.shared.clone(),
        }
    }

    /// Base URL executors dial for terminal relays.
    pub fn relay_url(&self) -> String {
        self.shared.relay_base.get().cloned().unwrap_or_default()
    }

    /// Live registered executors.
    pub fn executors(&self) -> Vec<ExecutorView> {
        http::executor_views(&self.shared)
    }

    /// A stream of every [`HarnessEvent`] from now on (a slow receiver
    /// loses the oldest events and is told so by `RecvError::Lagged`).
    pub fn events(&self) -> broadcast::Receiver<HarnessEvent> {
        self.shared.events.subscribe()
    }

    /// Wait until `executor_id` (or any executor, for `None`) is registered.
    pub async fn wait_for_executor(&self, executor_id: Option<&str>, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let found = match executor_id {
                Some(id) => self.shared.executors.contains_key(id),
                None => !self.shared.executors.is_empty(),
            };
            if found {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stop: close every executor connection with 1001, stop the actors and
    /// the listeners.
    pub async fn shutdown(mut self) {
        self.stop_now();
        for server in [self.server.take(), self.api_unix.take()]
            .into_iter()
            .flatten()
        {
            if tokio::time::timeout(Duration::from_secs(2), server)
                .await
                .is_err()
            {
                tracing::debug!("HTTP server still draining; detached");
            }
        }
        if let Some(unix) = self.unix.take() {
            let _ = unix.await;
        }
        if let Some(t) = self.in_process_task.take() {
            let _ = t.await;
        }
        // The listener thread of a replica ends within its stop check.
        if let Some(r) = self.shared.replica.get() {
            let db = r.db.clone();
            let _ = tokio::task::spawn_blocking(move || db.stop()).await;
        }
        // Flush what the actors queued before they stopped.
        if let Some(d) = self.shared.durable.get().cloned() {
            let _ = tokio::task::spawn_blocking(move || d.shutdown()).await;
        }
    }

    fn stop_now(&self) {
        self.shared.shutdown.cancel();
        if let Some(r) = self.shared.replica.get() {
            r.db.signal_stop();
        }
        for e in self.shared.conns.iter() {
            e.link.close(CloseCode::GoingAway, "harness shutting down");
        }
        self.root.stop(None);
    }

    /// Test hook: make the leases actor fail, and wait until its supervisor
    /// started the next one (`false` if none came). Not part of the API.
    #[doc(hidden)]
    pub async fn inject_leases_panic(&self) -> bool {
        let Some(old) = self.shared.leases() else {
            return false;
        };
        if old.send_message(LeasesMsg::InjectPanic).is_err() {
            return false;
        }
        self.shared
            .next_leases(&old, Duration::from_secs(10))
            .await
            .is_some()
    }

    /// Test hook: make the actor of `executor_id`'s registered connection
    /// fail. Not part of the API.
    #[doc(hidden)]
    pub fn inject_connection_panic(&self, executor_id: &str) -> bool {
        let Some(conn) = self.shared.executors.get(executor_id).map(|c| *c) else {
            return false;
        };
        let actor: Option<ActorRef<ConnMsg>> =
            self.shared.conns.get(&conn).and_then(|e| e.actor.clone());
        actor.is_some_and(|a| a.send_message(ConnMsg::InjectPanic).is_ok())
    }
}

impl Drop for HarnessHandle {
    fn drop(&mut self) {
        if !self.shared.shutdown.is_cancelled() {
            self.stop_now();
        }
    }
}

//! Harness configuration: what `bmx harness` parses and what an embedding
//! platform fills in through [`HarnessBuilder`](super::HarnessBuilder).

use crate::harness::events::LogLimits;
use crate::harness::interactions::InteractionLimits;
use crate::wire::types::RegisterResult;
use crate::wire::Subprotocol;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Maps a bearer token to an executor id (the principal); `None` refuses it
/// (HTTP 401 before the upgrade).
pub type Authenticator = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// Called with every [`HarnessEvent`](super::HarnessEvent); must return quickly.
pub type EventCallback = Arc<dyn Fn(&super::HarnessEvent) + Send + Sync>;

/// Everything the harness needs.
#[derive(Debug, Clone)]
pub struct HarnessConfig {
    /// HTTP API and `GET /v1/executor/connect` (one listener). Port 0 picks
    /// a free port; [`HarnessHandle::local_addr`](super::HarnessHandle::local_addr)
    /// tells which.
    pub listen: SocketAddr,
    /// Also accept executors on this Unix socket (same handshake).
    pub listen_unix: Option<PathBuf>,
    /// Also serve the whole HTTP API (every route `listen` serves,
    /// executors' upgrades included) on this Unix socket, mode `0600`:
    /// for a platform on the same host. The API token applies as on TCP.
    pub api_unix: Option<PathBuf>,
    /// `heartbeatIntervalMs` announced at register.
    pub heartbeat_interval_ms: u64,
    /// `leaseTtlMs`: silence after which a connection is closed with 4008,
    /// and how long an orphaned lease waits for its executor.
    pub lease_ttl_ms: u64,
    /// Bearer token the HTTP API requires (`None`: no API auth).
    pub api_token: Option<crate::wire::Secret>,
    /// Allow an unauthenticated API on a non-loopback address.
    pub allow_open_api: bool,
    pub max_control_frame_bytes: usize,
    pub max_mcp_frame_bytes: usize,
    /// Requests from one executor handled at once.
    pub max_in_flight: usize,
    /// Subprotocols accepted, in no particular order (the executor's order wins).
    pub subprotocols: Vec<Subprotocol>,
    /// Timeout of harness → executor requests (assign, stop, process.*).
    pub request_timeout: Duration,
    /// `deadlineMs` of `session.stop` sent for `DELETE /v1/sessions/{id}`.
    pub stop_deadline_ms: u64,
    /// How long `POST /v1/sessions/{id}/tools` waits for a result when the
    /// call names no `deadlineMs`.
    pub tool_timeout: Duration,
    /// Longest `waitMs` a process read may ask for.
    pub max_read_wait_ms: u64,
    /// Ended sessions remembered for `GET /v1/sessions/{id}`.
    pub ended_sessions_kept: usize,
    /// Where executors reach this harness for terminal relays
    /// (`http://`, `https://`, `ws://` or `wss://` base URL, path prefix
    /// allowed). Default: `ws://` + the bound address (an unspecified IP
    /// becomes 127.0.0.1). Set it when the harness is behind a proxy or
    /// listens on 0.0.0.0 for remote executors.
    pub public_url: Option<String>,
    /// Terminals the registry tracks at most (-32015 / 429 past it).
    pub max_terminals: usize,
    /// Terminal relays (attached viewers) at once (429 past it).
    pub max_relays: usize,
    /// Relay tickets minted and not yet used, at most.
    pub max_pending_tickets: usize,
    /// How long a relay ticket stays valid (the executor dials within 10 s).
    pub relay_ticket_ttl: Duration,
    /// MCP (docs/mcp.md): how long a client request through
    /// `/v1/sessions/{id}/mcp/{serverKey}` waits for the server's answer
    /// before it is answered with a timeout error (-32001).
    pub mcp_request_timeout: Duration,
    /// How long `mcp.open` may take (the executor waits for the server's
    /// `initialize` before it answers).
    pub mcp_open_timeout: Duration,
    /// MCP client sessions (`Mcp-Session-Id`) per server at once (429 past it).
    pub mcp_max_clients: usize,
    /// An MCP client session with nothing in flight and no open stream is
    /// forgotten after this much silence (its id then gets 404).
    pub mcp_client_idle: Duration,
    /// Requests in flight per (session, server) at once.
    pub mcp_max_in_flight: usize,
    /// MCP channels (session × server) the harness serves at once.
    pub mcp_max_channels: usize,
    /// Messages queued for one client's notification stream (GET); a
    /// client that falls this far behind loses its stream.
    pub mcp_stream_queue: usize,
    /// Agent turns (docs/agents.md): what each session's event stream
    /// keeps (newest 10 000 events / 16 MiB while it lives, 1 000 / 1 MiB
    /// once it ended) and how many clients may follow it at once (64).
    pub event_log: LogLimits,
    /// Live items (events, deltas, interaction notices) queued for one
    /// event-stream client; a client this far behind is dropped with an
    /// `error` item (`slow_subscriber`) and reconnects with its last id.
    pub event_subscriber_queue: usize,
    /// Pending interactions per session (64), resolved ones remembered (256).
    pub interactions: InteractionLimits,
    /// Sessions whose agent stream the harness serves at once.
    pub turns_max_sessions: usize,
    /// How long a device enrollment waits for an operator (docs/runner.md).
    pub enrollment_ttl: Duration,
    /// `pollIntervalMs` of an enrollment; faster polls get `slow_down`.
    pub enrollment_poll_interval: Duration,
    /// Connection limits of the TCP listener (docs/security.md, issue 18
    /// finding 4): what an unauthenticated peer can hold.
    pub connections: ConnectionLimits,
    /// Per-source limits on enrollments and failed credentials
    /// (docs/security.md, "The web surface").
    pub sources: SourceLimits,
}

/// The shortest API token accepted (bytes): a token anyone can guess
/// in a day of tries is no token. `openssl rand -hex 32` makes a good one.
pub const MIN_API_TOKEN_BYTES: usize = 16;

/// What a peer may hold on the harness's TCP listener before it has shown
/// a credential: without these, idle and half-sent-header sockets were
/// kept forever and a few hundred of them starved `/v1/health`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// A request head must be complete within this of the connection being
    /// ready for one: from accept, and from the end of the previous
    /// response on a keep-alive connection (hyper's clock). Bounds slow
    /// and half-sent headers; 431 is not sent, the socket is closed.
    pub header_read_timeout: Duration,
    /// A keep-alive connection with no request in flight is closed after
    /// this much quiet following its last response. Effective only when
    /// shorter than `header_read_timeout`, whose clock also runs then.
    pub idle_timeout: Duration,
    /// Connections that have not yet authenticated (no request with a valid
    /// API token or executor credential; with no `--api-token`, no
    /// complete request), at most. Accepting one more closes the oldest of
    /// them at once, so idle sockets cannot keep a new client out.
    pub max_unauthenticated: usize,
    /// An executor's WebSocket handshake (the raw upgrade on the Unix
    /// socket) must complete within this, and its `executor.register`
    /// must arrive within this of the upgrade (or the lease TTL, if
    /// shorter): else 4008.
    pub handshake_timeout: Duration,
    /// A request body must have arrived whole within this of its head...
    pub body_timeout: Duration,
    /// ...or, for a body longer than `body_timeout` × this many bytes a
    /// second, within its length divided by this rate. Past the deadline
    /// the request is answered 408 and its connection closed, and what it
    /// sent is freed: a peer cannot hold memory by sending most of a body
    /// and stalling (issue 56).
    pub min_body_rate: u64,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(5),
            max_unauthenticated: 512,
            handshake_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            // 64 MiB (the largest body: a skill or a session file) in
            // 256 s; a 2 MiB body in the 30 s.
            min_body_rate: 256 * 1024,
        }
    }
}

impl Default for HarnessConfig {
    fn default() -> Self {
        HarnessConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            listen_unix: None,
            api_unix: None,
            heartbeat_interval_ms: RegisterResult::DEFAULT_HEARTBEAT_MS,
            lease_ttl_ms: RegisterResult::DEFAULT_LEASE_TTL_MS,
            api_token: None,
            allow_open_api: false,
            max_control_frame_bytes: RegisterResult::DEFAULT_CONTROL_FRAME_BYTES as usize,
            max_mcp_frame_bytes: RegisterResult::DEFAULT_MCP_FRAME_BYTES as usize,
            max_in_flight: 1024,
            subprotocols: Subprotocol::ALL.to_vec(),
            request_timeout: Duration::from_secs(30),
            stop_deadline_ms: 5_000,
            tool_timeout: Duration::from_secs(600),
            max_read_wait_ms: 60_000,
            ended_sessions_kept: 1024,
            public_url: None,
            max_terminals: 4096,
            max_relays: 256,
            max_pending_tickets: 256,
            relay_ticket_ttl: Duration::from_secs(15),
            mcp_request_timeout: Duration::from_secs(60),
            mcp_open_timeout: Duration::from_secs(60),
            mcp_max_clients: 64,
            mcp_client_idle: Duration::from_secs(600),
            mcp_max_in_flight: 256,
            mcp_max_channels: 4096,
            mcp_stream_queue: 256,
            event_log: LogLimits::default(),
            event_subscriber_queue: 4096,
            interactions: InteractionLimits::default(),
            turns_max_sessions: 8192,
            enrollment_ttl: Duration::from_secs(900),
            enrollment_poll_interval: Duration::from_secs(5),
            connections: ConnectionLimits::default(),
            sources: SourceLimits::default(),
        }
    }
}

/// A token bucket's shape: `burst` at once, then one more per `every`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub burst: u32,
    pub every: Duration,
}

/// The harness's per-source limits (`HarnessConfig::sources`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceLimits {
    /// Failed credentials a source may show (API token, console login,
    /// executor token, tickets): then one more per `every`; past it, 429.
    pub auth_failures: Rate,
    /// `POST /v1/enrollments` per source.
    pub enroll_create: Rate,
    /// `POST /v1/enrollments/poll` per source.
    pub enroll_poll: Rate,
    /// Pending enrollments one source may have at once.
    pub pending_enrollments: usize,
    /// Sources each limit remembers at most.
    pub max_sources: usize,
    /// How often the aggregate line about failures is logged.
    pub log_every: Duration,
}

impl Default for SourceLimits {
    fn default() -> Self {
        SourceLimits {
            // ~1 guess a second once the burst is spent; a client that
            // mistypes a few times is never held up.
            auth_failures: Rate {
                burst: 30,
                every: Duration::from_secs(1),
            },
            enroll_create: Rate {
                burst: 10,
                every: Duration::from_secs(6),
            },
            // A device polls every 5 s (pollIntervalMs): 4 a second is
            // twenty devices behind one address.
            enroll_poll: Rate {
                burst: 30,
                every: Duration::from_millis(250),
            },
            pending_enrollments: 16,
            max_sources: 4096,
            log_every: Duration::from_secs(60),
        }
    }
}

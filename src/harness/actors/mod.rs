//! The harness's actors (docs/architecture.md: "harness root").
//!
//! ```text
//! harness root (supervisor)
//! ├── leases           the lease table, the executors registry (4004 rule),
//! │                    the platform's view of sessions, tool-call waiters,
//! │                    the 4008 / lease-expiry timer
//! ├── mcp              dynamic supervisor
//! │   └── <session>/<serverKey>  temporary, one per MCP channel: client
//! │                    sessions, id map, progress routing, tool list
//! ├── turns            dynamic supervisor
//! │   └── <session>    temporary, one per session's agent stream: the
//! │                    event log and its subscribers, interactions
//! └── connections      dynamic supervisor
//!     └── connection <n>  temporary, one per executor connection: register,
//!                      heartbeat, token refresh; forwards session frames
//! ```
//!
//! `leases` is permanent and rebuilds its state on restart (see
//! [`root`]); a failed connection is not restarted, its socket is closed
//! so the executor reconnects.

pub mod connection;
pub mod leases;
pub mod mcp;
pub mod root;
pub mod turns;

//! MCP relaying, sans IO (PROTOCOL.md §9).
//!
//! The executor runs a session's MCP servers and carries their JSON-RPC
//! messages to and from the harness (`mcp.frame`). What a relay must get
//! right lives here, with no sockets, pipes or clocks of its own: which
//! message is which ([`message`]), and the bookkeeping of one server
//! connection ([`relay`]): the `initialize` handshake the executor does
//! itself, the requests in flight (so a crash answers each of them, never
//! silence), the ids the executor keeps for itself, and the server→client
//! requests it answers on the client's behalf. The harness's side of the
//! channel uses [`raw`]: a message split at its top level only, so that
//! it replaces an id and copies the rest.
//!
//! Messages stay strings end to end: a proxy must forward what it cannot
//! type (custom methods, fields of a newer revision) byte for byte, so only
//! the envelope (`jsonrpc`, `id`, `method`, whether `result`/`error` is
//! there) is read. rmcp's model types are used where bmx speaks MCP itself:
//! the `initialize` it sends and the result it checks.

pub mod http;
pub mod message;
pub mod peer;
pub mod raw;
pub mod relay;
pub mod sse;

pub use message::{Envelope, Kind, McpError};
pub use relay::{Out, Relay, RelayConfig};

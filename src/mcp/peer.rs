//! What a JSON-RPC peer's transport (an MCP server's stdio or Streamable
//! HTTP, an ACP agent's stdio) reports to the actor that drives it. In the
//! core so both sides can drive a transport: the executor its servers and
//! agents, the harness the platform's `service` servers.

use std::sync::Arc;

/// What a peer's transport reports.
#[derive(Debug)]
pub enum PeerEvent {
    /// One JSON-RPC message from the peer.
    Message(String),
    /// Several, in order, from one read of the peer's pipe: one mailbox
    /// message for what arrived together, so a fast peer costs an actor
    /// hop per read, not per line.
    Messages(Vec<String>),
    /// A message over the size limit; its id when it could be read.
    Oversized(Option<String>),
    /// The peer is gone (exited, or its HTTP session ended): why.
    Closed(String),
}

/// Where a transport sends its events (its actor's mailbox).
pub type Sink = Arc<dyn Fn(PeerEvent) + Send + Sync>;

//! The transports of the executor's MCP servers: a child on stdio
//! ([`crate::executor::stdio_peer`], shared with the ACP agents), or a
//! Streamable HTTP peer. Each turns the server's output into
//! [`stdio_peer::PeerEvent`]s for its MCP actor ([`crate::executor::actors::mcp`]),
//! which feeds them to the sans-IO [`crate::mcp::Relay`].

pub use crate::mcp::http;
pub mod launch;
pub mod service;
pub use crate::mcp::sse;

use crate::executor::stdio_peer::StdioPeer;

/// One running transport.
pub enum Transport {
    Stdio(StdioPeer),
    Http(http::Http),
}

impl Transport {
    /// Send one message; `request` is its id when it is a request (a
    /// transport that cannot deliver it answers it with an error event).
    pub fn send(&self, message: String, request: Option<String>) -> Result<(), String> {
        match self {
            Transport::Stdio(s) => s.send(message),
            Transport::Http(h) => {
                h.send(message, request);
                Ok(())
            }
        }
    }

    /// The server answered `initialize` with this protocol version.
    pub fn initialized(&self, protocol_version: Option<String>) {
        if let Transport::Http(h) = self {
            h.initialized(protocol_version);
        }
    }

    pub fn pid(&self) -> Option<u32> {
        match self {
            Transport::Stdio(s) => Some(s.pid()),
            Transport::Http(_) => None,
        }
    }

    /// The newest stderr of a stdio server (redacted), for error reports.
    pub fn stderr_tail(&self) -> String {
        match self {
            Transport::Stdio(s) => s.stderr_tail(),
            Transport::Http(_) => String::new(),
        }
    }

    /// End it: a stdio child is asked to go (stdin closed, SIGTERM), then
    /// killed with everything it started; an HTTP session is deleted.
    pub async fn shutdown(&mut self) {
        match self {
            Transport::Stdio(s) => s.shutdown().await,
            Transport::Http(h) => h.shutdown().await,
        }
    }
}

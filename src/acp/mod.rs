//! The Agent Client Protocol, client side (issue 12): bmx drives agents
//! (Claude Code's and Codex's ACP adapters, Gemini CLI, any ACP agent) over
//! JSON-RPC on their stdio.
//!
//! What the executor's turns need from ACP lives here without IO:
//! [`updates`] turns the agent's `session/update` stream into bmx's
//! session events (final events plus streamed deltas), [`rpc`] is the
//! client's bookkeeping of one connection (ids, answers, the agent's own
//! requests). Message types come from the official SDK crate
//! (`agent-client-protocol`'s `schema`); the bytes travel over the
//! executor's own process layer (a tagged child, bounded line reads), not
//! the SDK's transport, so the agent is killed with its session and a
//! runaway line cannot grow memory. The visor's wire sessions use the same
//! module.

pub mod rpc;
pub mod updates;

pub use agent_client_protocol::v1::schema;

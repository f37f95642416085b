//! Executor-side actors.
//!
//! ```text
//! executor root (supervisor, one_for_one)
//! ├── sessions            session actors + lease clock (permanent)
//! │   └── session <id>    workspace, fence, processes, tools (temporary)
//! │       ├── process <id>
//! │       └── tool <id>
//! ├── terminals           terminal actors by terminalId (permanent)
//! │   └── terminal <id>   PTY, scrollback, streams, writer epoch (temporary)
//! ├── confirm             local confirmation of tool calls + its socket (permanent)
//! └── connection          dial, register, heartbeat, route (permanent,
//!                         significant, reconnect backoff)
//! ```

pub mod agent;
pub mod confirm;
pub mod connection;
pub mod display;
pub mod mcp;
pub mod process;
pub mod root;
pub mod router;
pub mod session;
pub mod sessions;
pub mod terminal;
pub mod terminals;
pub mod tool;
pub mod turn;

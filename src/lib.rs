//! bmx: an actor-model runtime for the executor protocol.
//!
//! Sans-IO cores and libraries that import no side:
//! * [`wire`]: frames, codecs, the method table, transports.
//! * [`supervisor`]: OTP-style supervision over ractor.
//! * [`lease`]: the lease and fencing state machines.
//! * [`process`]: the output ring, exit watching, process-tree plumbing.
//! * [`terminal`]: the numbered scrollback and the terminal frames.
//! * [`tools`]: the built-in tools and the workspace boundary.
//!
//! The two sides, each with its runtime, its actors and its API:
//! * [`executor`]: the daemon.
//! * [`harness`]: the control plane a platform embeds.
//! * [`runner`]: the workspace lock (and, as it grows, enrollment and
//!   local state) of a workspace-bound executor.
//! * [`client`]: a client of the harness's HTTP API (the CLI's, and a
//!   platform's Rust code may use it).
//! * [`fuzz`]: the fuzz entry points over every untrusted-input decoder
//!   (cargo-fuzz targets in `fuzz/`, bounded runs in the tests).
//!
//! See docs/architecture.md for the code map and the import rules.

pub mod acp;
pub mod client;
pub mod executor;
pub mod fuzz;
pub mod harness;
pub mod lease;
pub mod mcp;
pub mod process;
pub mod runner;
pub mod sandbox;
pub mod supervisor;
pub mod terminal;
pub mod tools;
pub mod visor;
pub mod wire;

//! bmx: an actor-model runtime for the executor protocol.
//!
//! * [`wire`]: frames, codecs, the method table, transports.
//! * [`supervisor`]: OTP-style supervision over ractor.

pub mod actors;
pub mod bench;
pub mod cli;
pub mod executor;
pub mod harness;
pub mod lease;
pub mod process;
pub mod supervisor;
pub mod terminal;
pub mod tools;
pub mod wire;

//! The actors: one module per actor kind, executor side and harness side.

pub mod executor;
pub mod harness;

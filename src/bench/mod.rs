//! Benchmarks run by `bmx bench`: each measures the raw baseline in the
//! same run and reports the ratio.

pub mod buffering;
pub mod local;
pub mod mcp;
pub mod peer;
pub mod scale;
pub mod turns;
pub mod visor;

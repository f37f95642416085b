//! The `executor` black-box tests, one binary: each module was its own
//! test target once; one binary links once instead of once per file
//! (CI time, docs/testing.md).

#[path = "../support/mod.rs"]
mod support;
#[path = "../visor_support/mod.rs"]
mod visor_support;

mod computer;
mod confirm;
mod connection;
mod crash;
mod env;
mod fence;
mod git;
mod mcp;
mod packages;
mod process;
mod shutdown;
mod terminal;
mod tools;
mod turns;

//! The `visor` black-box tests, one binary: each module was its own
//! test target once; one binary links once instead of once per file
//! (CI time, docs/testing.md).

#[path = "../visor_support/mod.rs"]
mod visor_support;

mod agents;
mod attach;
mod daemon;
mod events;
mod hooks;
mod pty;
mod wire;
mod workdirs;

//! The `runner` black-box tests, one binary: each module was its own
//! test target once; one binary links once instead of once per file
//! (CI time, docs/testing.md).

#[path = "../runner_common/mod.rs"]
mod runner_common;

mod enroll;
mod env;
mod lock;

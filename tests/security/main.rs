//! The `security` black-box tests, one binary: each module was its own
//! test target once; one binary links once instead of once per file
//! (CI time, docs/testing.md).

#[path = "../harness_common/mod.rs"]
mod harness_common;
#[path = "../security_common/mod.rs"]
mod security_common;
#[path = "../support/mod.rs"]
mod support;
#[path = "../visor_support/mod.rs"]
mod visor_support;

mod connections;
mod ids;
mod logs;
mod run_as;
mod sandbox;
mod schemathesis;
mod small;
mod token;
mod tools;
mod web_data_dir;
mod web_limits;
mod web_rebinding;
mod web_terminal;
mod web_visor_peer;

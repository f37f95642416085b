//! The `misc` black-box tests, one binary: each module was its own
//! test target once; one binary links once instead of once per file
//! (CI time, docs/testing.md).

mod cli_logs;
mod events_store;
mod fuzz;
mod lease_model;
mod lease_model_pg;
mod lease_model_replicas;
mod lease_model_store;
#[path = "../pg_support/mod.rs"]
mod pg_support;
mod store_pg;
mod tools_race;
mod wire_pending;

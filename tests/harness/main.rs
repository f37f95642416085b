//! The `harness` black-box tests, one binary: each module was its own
//! test target once; one binary links once instead of once per file
//! (CI time, docs/testing.md).

#[path = "../harness_common/mod.rs"]
mod harness_common;
#[path = "../pg_support/mod.rs"]
mod pg_support;
#[path = "../support/mod.rs"]
mod support;

mod artifacts;
mod backups;
mod cli;
mod console;
mod console_content;
mod console_display;
mod cores;
mod disk_full;
mod drain;
mod e2e;
mod fake;
mod file_transfer;
mod in_process;
mod mcp;
mod mcp_service;
mod method_owners;
mod replicas;
mod replicas_flaps;
mod restart;
mod restore;
mod rfb;
mod session_files;
mod skills;
mod supervision;
mod terminal;
mod turns;

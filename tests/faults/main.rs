//! The `faults` black-box tests, one binary: each module was its own
//! test target once; one binary links once instead of once per file
//! (CI time, docs/testing.md).

#[path = "../faults_common/mod.rs"]
mod faults_common;

mod frame_limit;
mod journal;
mod metrics;
mod resend;
mod soak;

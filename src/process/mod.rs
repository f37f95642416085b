//! Processes: the output ring (sans-IO) and the OS plumbing the executor's
//! process actor uses.

pub mod env;
pub mod exits;
pub mod lifecycle;
pub mod region;
pub mod ring;
pub mod run_as;
pub mod spawn;
pub mod sys;

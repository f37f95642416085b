//! Processes: the output ring (sans-IO) and, in the executor, the process actor.

pub mod ring;

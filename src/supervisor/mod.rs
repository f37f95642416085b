//! OTP-style supervision over ractor.
//!
//! ractor reports child exits but restarts nothing; this module supplies the
//! policy: restart types, strategies, restart intensity, backoff with
//! jitter, final (`shutdown`) exits, significant children and orderly
//! shutdown. [`policy`] is sans-IO and property-tested; [`actor`] applies
//! it. See docs/architecture.md for why bmx does not use ractor-supervisor.

pub mod actor;
pub mod children;
pub mod dynamic;
pub mod policy;

pub use actor::{
    spawn_child, stop_child, ChildSpec, Supervisor, SupervisorExit, SupervisorMsg, SupervisorSpec,
};
pub use dynamic::{
    start_actor, start_child, terminate_child, ChildExit, DynamicMsg, DynamicSpec,
    DynamicSupervisor, StartChildError,
};
pub use policy::{Backoff, Exit, Intensity, Restart, RestartWindow, Strategy, SHUTDOWN};

#[cfg(test)]
mod dynamic_tests;
#[cfg(test)]
mod tests;

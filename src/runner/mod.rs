//! The workspace-bound side of bmx (docs/runner.md): an executor bound to
//! one directory takes that directory's lock before it registers, so two
//! executors never work in the same tree.
//!
//! * [`credentials`]: the local credential store (0600 files in a 0700
//!   folder, replaced atomically) that `bmx enroll` fills and
//!   `bmx executor --harness` reads.
//! * [`lock`]: the workspace lock `DIR/.bmx/lock` (advisory `flock`, plus
//!   the holder's pid, instance id and start time for people and tools).

pub mod credentials;
pub mod lock;

pub use lock::{LockError, LockHolder, WorkspaceLock};

//! The workspace-bound side of bmx and the local runtimes' state
//! (docs/runner.md): an executor bound to one directory takes that
//! directory's lock before it registers, so two executors never work in
//! the same tree; every local runtime keeps a state dir that
//! `bmx targets` and `bmx env` read.
//!
//! * [`credentials`]: the local credential store (0600 files in a 0700
//!   folder, replaced atomically) that `bmx enroll` fills and
//!   `bmx executor --harness` reads.
//! * [`lock`]: the workspace lock `DIR/.bmx/lock` (advisory `flock`, plus
//!   the holder's pid, instance id and start time for people and tools);
//!   state dirs use the same lock.
//! * [`envelope`]: the `--json` line (`schema_version`, `ok`, `data` or
//!   `error`, `trace`) and its error codes.
//! * [`state`]: state dirs `<home>/state/<target-id>/` (lock, config,
//!   runtime record), claimed by runtimes and read by `bmx env`.
//! * [`claims`]: the calls `bmx up`, `bmx visor` and a bound executor make.
//! * [`environment`]: sans-IO: probe facts → runtime state, failure code,
//!   operation plans; the `bmx targets` / `bmx env` data types.
//! * [`probe`]: pids, sessions and control sockets, looked at.
//! * [`targets`]: the catalog and environment status (glue of the above).
//! * [`control`]: `env start` (daemonize `bmx up`) and `env stop`.

pub mod claims;
pub mod control;
pub mod credentials;
pub mod envelope;
pub mod environment;
pub mod lock;
pub mod probe;
pub mod state;
pub mod targets;

pub use lock::{LockError, LockHolder, WorkspaceLock};

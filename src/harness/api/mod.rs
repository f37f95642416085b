//! What a platform calls: sessions (processes, tools) and terminals. The
//! HTTP routes in [`super::http`] are a thin layer over these.

pub mod artifacts;
pub mod backups;
pub mod drain;
pub mod enrollments;
pub mod executors;
pub mod files;
pub mod listing;
pub mod mcp;
pub mod sessions;
pub mod skills;
pub mod terminals;
pub mod turns;

//! Benchmarks run by `bmx bench`: each measures the raw baseline in the
//! same run and reports the ratio.

pub mod affinity;
pub mod buffering;
pub mod computer;
pub mod events;
pub mod harness;
pub mod local;
pub mod mcp;
pub mod peer;
pub mod rfb;
pub mod scale;
pub mod turns;
pub mod visor;

/// `VmRSS` of `/proc/<pid>` (`"self"` for this process), in KiB.
pub fn rss_kib(pid: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

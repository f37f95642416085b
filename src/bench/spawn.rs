//! `bmx bench spawn`: what a process start costs, and what the session
//! sandbox adds to it (issue 48's figure: at most 1.5× a start without
//! it).
//!
//! Three rows, each `/bin/true` started and waited for, `starts` times,
//! interleaved in ten rounds so that a drift of the machine touches every
//! row alike:
//!
//! * `raw`: `std::process::Command` (glibc's `posix_spawn`, a vfork), the
//!   baseline;
//! * `bare`: bmx's spawner (`process::spawn`) with nothing to apply;
//! * `sandboxed`: bmx's spawner in a session's sandbox as the executor
//!   starts a process: a unit of the sandbox made (its leaf cgroup), the
//!   cgroups joined, Landlock applied, capabilities dropped (as root),
//!   `no_new_privs`, and the leaf removed after the exit.

use bmx::process::spawn::{Command, Confinement, Group, Stdio};
use bmx::sandbox::{Bounds, SandboxConfig, Sandboxes};
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

#[derive(Debug, Serialize)]
pub struct SpawnReport {
    pub starts: usize,
    /// Mean µs per start and wait.
    pub raw_us: f64,
    pub bare_us: f64,
    pub sandboxed_us: f64,
    /// `sandboxed_us / bare_us`: what the sandbox costs.
    pub sandbox_ratio: f64,
    /// `sandboxed_us / raw_us`.
    pub vs_raw: f64,
    /// What the sandboxed row applied (`capabilities.sandbox`).
    pub sandbox: String,
    /// Where the sandbox's cost goes: one part applied alone, µs per
    /// start (the leaf made and removed, and joined; Landlock alone; the
    /// capability set alone).
    pub cgroup_only_us: f64,
    pub landlock_only_us: f64,
    pub caps_only_us: f64,
}

impl SpawnReport {
    pub fn table(&self) -> String {
        format!(
            "starts per row: {}\n\
             raw (std posix_spawn)   {:>8.1} µs\n\
             bmx spawn, bare         {:>8.1} µs\n\
             bmx spawn, sandboxed    {:>8.1} µs   ({})\n\
             sandboxed / bare        {:>8.2}\n\
             sandboxed / raw         {:>8.2}\n\
             parts alone: cgroup leaf {:.1} µs, Landlock {:.1} µs, capabilities {:.1} µs\n",
            self.starts,
            self.raw_us,
            self.bare_us,
            self.sandboxed_us,
            self.sandbox,
            self.sandbox_ratio,
            self.vs_raw,
            self.cgroup_only_us,
            self.landlock_only_us,
            self.caps_only_us,
        )
    }
}

const ROUNDS: usize = 10;

pub async fn run(starts: usize) -> Result<SpawnReport, String> {
    let work = tempfile::tempdir().map_err(|e| e.to_string())?;
    let ws = work.path().join("ws");
    let private = work.path().join("private");
    std::fs::create_dir(&ws).map_err(|e| e.to_string())?;
    let sandboxes = Sandboxes::start(SandboxConfig::default()).map_err(|e| e.to_string())?;
    let sandbox = sandboxes
        .make(
            &bmx::sandbox::session_name("bench-spawn"),
            &ws,
            &private,
            &Bounds::default(),
        )
        .map_err(|e| e.to_string())?;
    let cap = sandboxes.capability();
    let per_round = (starts / ROUNDS).max(1);
    let (mut raw, mut bare, mut boxed) = (0.0, 0.0, 0.0);
    let (mut cg, mut ll, mut caps) = (0.0, 0.0, 0.0);
    let result: Result<(), String> = async {
        for _ in 0..ROUNDS {
            raw += time(per_round, || async {
                let st = std::process::Command::new("/bin/true")
                    .stdin(std::process::Stdio::null())
                    .status()
                    .map_err(|e| e.to_string())?;
                st.success().then_some(()).ok_or("true failed".to_owned())
            })
            .await?;
            bare += time(per_round, || start(None)).await?;
            // As the executor starts a process: a unit (a leaf cgroup,
            // made and removed per start) of the session's sandbox.
            boxed += time(per_round, || async {
                let unit = sandbox.unit().map_err(|e| e.to_string())?;
                start(unit.confinement()).await
            })
            .await?;
            for (part, total) in [(0, &mut cg), (1, &mut ll), (2, &mut caps)] {
                *total += time(per_round, || async {
                    let unit = sandbox.unit().map_err(|e| e.to_string())?;
                    let whole = unit.confinement().ok_or("no confinement")?;
                    let only = Confinement {
                        cgroups: if part == 0 {
                            whole
                                .cgroups
                                .iter()
                                .filter_map(|f| f.try_clone().ok())
                                .collect()
                        } else {
                            Vec::new()
                        },
                        landlock: whole
                            .landlock
                            .as_ref()
                            .filter(|_| part == 1)
                            .and_then(|f| f.try_clone().ok()),
                        drop_caps: part == 2 && whole.drop_caps,
                        cap_last: whole.cap_last,
                    };
                    start(Some(std::sync::Arc::new(only))).await
                })
                .await?;
            }
        }
        Ok(())
    }
    .await;
    let _ = tokio::task::spawn_blocking(move || {
        sandbox.end(&private);
        sandboxes.remove_all();
    })
    .await;
    result?;
    let n = (per_round * ROUNDS) as f64;
    let (raw_us, bare_us, sandboxed_us) = (raw / n, bare / n, boxed / n);
    Ok(SpawnReport {
        starts: per_round * ROUNDS,
        raw_us,
        bare_us,
        sandboxed_us,
        sandbox_ratio: sandboxed_us / bare_us,
        vs_raw: sandboxed_us / raw_us,
        sandbox: format!(
            "filesystem={} cgroup={} scoped={}",
            cap.filesystem, cap.cgroup, cap.scoped
        ),
        cgroup_only_us: cg / n,
        landlock_only_us: ll / n,
        caps_only_us: caps / n,
    })
}

async fn start(
    confine: Option<std::sync::Arc<bmx::process::spawn::Confinement>>,
) -> Result<(), String> {
    let mut cmd = Command::new(Path::new("/bin/true"), &["true"]).map_err(|e| e.to_string())?;
    cmd.stdin(Stdio::Null)
        .group(Group::New)
        .run_as(false)
        .confine(confine);
    let child = cmd.spawn().map_err(|e| e.to_string())?;
    let st = child.exit.wait().await.map_err(|e| e.to_string())?;
    st.success().then_some(()).ok_or("true failed".to_owned())
}

/// Total µs of `n` sequential runs of `f`.
async fn time<F, Fut>(n: usize, f: F) -> Result<f64, String>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let t = Instant::now();
    for _ in 0..n {
        f().await?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6)
}

//! The session sandbox's flags (issue 48), shared by `bmx executor` and
//! `bmx up`.

use bmx::sandbox::{bounds, Bounds, Mode, Network, SandboxConfig};
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct SandboxArgs {
    /// How each session is confined (docs/security.md): `auto` enforces
    /// what this kernel offers and warns about the rest; `required`
    /// refuses to start unless Landlock, signal scoping and a cgroup per
    /// session are all enforced; `off` runs sessions with the executor's
    /// rights.
    #[arg(long, value_name = "auto|required|off", default_value = "auto")]
    pub sandbox: Mode,
    /// `none`: sessions may neither connect nor listen on TCP (Landlock
    /// ABI 4).
    #[arg(long, value_name = "full|none", default_value = "full")]
    pub session_network: Network,
    /// Memory of each session, e.g. 512M or 2G (K, M, G, T: 1024-based);
    /// past it the kernel's OOM killer ends a process (`oom_killed`).
    #[arg(long, value_name = "SIZE")]
    pub session_memory_max: Option<String>,
    /// Tasks (processes and threads) of each session; past it `fork`
    /// fails with EAGAIN.
    #[arg(long, value_name = "N")]
    pub session_pids_max: Option<String>,
    /// CPU time of each session, in CPUs (e.g. 0.5, 2).
    #[arg(long, value_name = "CPUS")]
    pub session_cpu_max: Option<String>,
    /// One more directory sessions may read and execute from (repeatable,
    /// or colon-separated in the environment), e.g. a toolchain under a
    /// home directory.
    #[arg(
        long = "sandbox-read",
        value_name = "DIR",
        env = "BMX_SANDBOX_READ",
        value_delimiter = ':'
    )]
    pub sandbox_read: Vec<PathBuf>,
    /// Act as if the kernel lacked these mechanisms (`landlock`,
    /// `cgroup`; comma-separated): for testing the fallbacks.
    #[arg(long, hide = true, value_delimiter = ',')]
    pub sandbox_without: Vec<String>,
}

impl SandboxArgs {
    /// The sandbox's config; an error names the flag it is about.
    pub fn into_config(self) -> Result<SandboxConfig, String> {
        let named = |flag: &str, e: bounds::ParseError| format!("{flag}: {e}");
        let b = Bounds {
            memory_bytes: self
                .session_memory_max
                .as_deref()
                .map(bounds::parse_size)
                .transpose()
                .map_err(|e| named("--session-memory-max", e))?,
            pids: self
                .session_pids_max
                .as_deref()
                .map(bounds::parse_pids)
                .transpose()
                .map_err(|e| named("--session-pids-max", e))?,
            cpu_milli: self
                .session_cpu_max
                .as_deref()
                .map(bounds::parse_cpus)
                .transpose()
                .map_err(|e| named("--session-cpu-max", e))?,
        };
        for p in &self.sandbox_read {
            if !p.is_absolute() {
                return Err(format!(
                    "--sandbox-read {}: must be an absolute path",
                    p.display()
                ));
            }
        }
        Ok(SandboxConfig {
            mode: self.sandbox,
            network: self.session_network,
            bounds: b,
            read: self.sandbox_read,
            move_self: true,
            without: self.sandbox_without,
        })
    }
}

//! `bmx bench harness`: how many executors one harness holds on one core.
//!
//! Three processes, so that nothing measured shares a core with the load:
//!
//! * the **server**, pinned to CPU 0: the real `bmx harness` (the daemon as
//!   users run it, embedded SQLite store, plus any `--harness-arg`), or the
//!   **baseline**, a bare peer (`bmx bench harness-peer`) that accepts the
//!   same WebSockets with the same codec and link and answers register and
//!   heartbeat with constants: socket + codec + router, no actors, no
//!   leases, no store;
//! * the **load**, pinned to CPU 1 (`bmx bench harness-load`): N simulated
//!   executors, each a real WebSocket that registers with its own token and
//!   then sends `executor.heartbeat` every second, the N phases spread over
//!   the second;
//! * this process, which starts both, reads the server's CPU time from
//!   `/proc/<pid>/stat` at the start and end of the measured window, and
//!   prints the rows.
//!
//! The server's share of one core over the window, against the baseline's
//! at the same N, is the figure; heartbeat round trips (p50/p99/max) and
//! heartbeats that failed or came late say whether it kept up. After the
//! heartbeat window the load (harness only) runs session assign/stop pairs
//! through the HTTP API, each answered by a simulated executor, against a
//! plain API round trip (`GET` of an unknown session) in the same run.
//!
//! The cost of a durable fencing-token bump (`DurableState`, SQLite) is
//! measured in this process against the in-memory counter.

use super::peer::Answer;
use bmx::client::ApiClient;
use bmx::harness::store::{DurableBackend, DurableState, PgStore, SqliteStore};
use bmx::lease::{LeaseStore, MemoryLeaseStore};
use bmx::wire::types::{
    AssignParams, AssignResult, EndedParams, ExecutorInfo, HeartbeatParams, HeartbeatResult,
    ReadyParams, RegisterParams, RegisterResult, StopParams, StopResult,
};
use bmx::wire::{
    transport, Dispatch, Endpoint, Inbound, Link, LinkLimits, Method, Responder, Subprotocol,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A heartbeat answered later than this counts as late (the protocol's
/// executors treat an unanswered heartbeat as a dead connection at their
/// request timeout; one interval is the stricter bound).
const LATE: Duration = Duration::from_secs(1);

/// The share of one core under which a row counts as held: at 0.97 the
/// first runs still answered every heartbeat, but 100 times slower.
const HELD_CPU: f64 = 0.9;

/// How long the load waits for any one answer before counting a failure.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Dials in flight at once while the load connects.
const DIAL_CONCURRENCY: usize = 128;

#[derive(Debug, Clone)]
pub struct HarnessOptions {
    /// Simulated executor counts, one row (per server) each.
    pub executors: Vec<usize>,
    pub warmup_secs: u64,
    pub window_secs: u64,
    /// Seconds of session assign/stop pairs (0: none).
    pub assign_secs: u64,
    /// API callers in flight during the assign phase.
    pub assign_concurrency: usize,
    /// Extra arguments of `bmx harness` (e.g. `--store URL`).
    pub harness_args: Vec<String>,
    /// Token bumps per fencing row.
    pub fencing_ops: usize,
    /// Also run the baseline peer at every N.
    pub baseline: bool,
    /// Harness replicas over one PostgreSQL database (1: one harness), all
    /// pinned to the server's core; executor i connects to replica i mod
    /// `replicas`. Their CPU and memory are summed.
    pub replicas: usize,
}

/// One server at one N.
#[derive(Debug, Clone, Serialize)]
pub struct LoadRow {
    pub server: String,
    pub executors: usize,
    /// Registered at the start of the window.
    pub connected: usize,
    pub window_secs: f64,
    pub heartbeats_per_sec: f64,
    /// The server's CPU time over the window / the window (1.0 = one core).
    pub server_cpu: f64,
    /// Server CPU per heartbeat, in microseconds.
    pub cpu_us_per_heartbeat: f64,
    pub server_rss_bytes: u64,
    pub rtt_p50_us: u64,
    pub rtt_p99_us: u64,
    pub rtt_max_us: u64,
    /// Heartbeats answered with an error or not at all (within 10 s).
    pub failed: u64,
    /// Heartbeats answered later than 1 s.
    pub late: u64,
    /// Connections that closed during the window.
    pub dropped: usize,
    /// `server_cpu` over the baseline's at the same N.
    pub cpu_ratio: Option<f64>,
}

/// Session assign/stop through the API.
#[derive(Debug, Clone, Serialize)]
pub struct AssignRow {
    pub executors: usize,
    pub concurrency: usize,
    /// Assign + stop pairs completed per second.
    pub pairs_per_sec: f64,
    pub pair_p50_us: u64,
    pub pair_p99_us: u64,
    pub failed: u64,
    /// Baseline: `GET /v1/sessions/<unknown>` round trips per second, same
    /// callers, same harness.
    pub api_roundtrips_per_sec: f64,
    /// The harness's CPU over the assign phase (1.0 = one core).
    pub server_cpu: f64,
}

/// Fencing-token bumps.
#[derive(Debug, Clone, Serialize)]
pub struct FencingRow {
    pub ops: usize,
    pub memory_ns: f64,
    pub durable_ns: f64,
    pub ratio: f64,
    /// Bumps the durable store refused (block ran out before the next
    /// reservation committed); each was retried.
    pub durable_refused: u64,
    /// The same over PostgreSQL, when the harness runs with `--store
    /// postgres://…`.
    pub postgres_ns: Option<f64>,
    pub postgres_refused: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct HarnessReport {
    pub rows: Vec<LoadRow>,
    pub assign: Vec<AssignRow>,
    pub fencing: FencingRow,
    /// The largest N at which the harness stayed under 0.9 of one core
    /// (a saturated core answers late before it fails) with no failed,
    /// late or dropped heartbeat.
    pub held: usize,
}

impl HarnessReport {
    pub fn table(&self) -> String {
        let mut s = String::new();
        s.push_str(&format!(
            "{:<9} {:>6} {:>6} {:>8} {:>7} {:>8} {:>9} {:>8} {:>8} {:>8} {:>5} {:>5} {:>5} {:>6}\n",
            "server",
            "N",
            "conn",
            "hb/s",
            "cpu",
            "us/hb",
            "rss MB",
            "p50 us",
            "p99 us",
            "max us",
            "fail",
            "late",
            "drop",
            "ratio"
        ));
        for r in &self.rows {
            s.push_str(&format!(
                "{:<9} {:>6} {:>6} {:>8.0} {:>7.3} {:>8.1} {:>9.1} {:>8} {:>8} {:>8} {:>5} {:>5} {:>5} {:>6}\n",
                r.server,
                r.executors,
                r.connected,
                r.heartbeats_per_sec,
                r.server_cpu,
                r.cpu_us_per_heartbeat,
                r.server_rss_bytes as f64 / 1e6,
                r.rtt_p50_us,
                r.rtt_p99_us,
                r.rtt_max_us,
                r.failed,
                r.late,
                r.dropped,
                r.cpu_ratio.map_or("-".into(), |x| format!("{x:.2}")),
            ));
        }
        for a in &self.assign {
            s.push_str(&format!(
                "assign/stop at N={} ({} callers): {:.0} pairs/s (p50 {} us, p99 {} us, {} failed, harness cpu {:.2}); baseline API round trip {:.0}/s\n",
                a.executors,
                a.concurrency,
                a.pairs_per_sec,
                a.pair_p50_us,
                a.pair_p99_us,
                a.failed,
                a.server_cpu,
                a.api_roundtrips_per_sec,
            ));
        }
        let f = &self.fencing;
        s.push_str(&format!(
            "fencing bump: in-memory {:.0} ns, durable (SQLite) {:.0} ns, ratio {:.2} ({} refused and retried, {} ops)\n",
            f.memory_ns, f.durable_ns, f.ratio, f.durable_refused, f.ops
        ));
        if let (Some(ns), Some(refused)) = (f.postgres_ns, f.postgres_refused) {
            s.push_str(&format!(
                "fencing bump: durable (PostgreSQL) {:.0} ns, ratio {:.2} ({} refused and retried)\n",
                ns,
                ns / f.memory_ns.max(f64::MIN_POSITIVE),
                refused
            ));
        }
        s.push_str(&format!(
            "held under 0.9 of one core: {} executors at 1 Hz\n",
            self.held
        ));
        s
    }
}

/// What the load prints, one JSON object per line.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum LoadEvent {
    Connected { connected: usize, failed: usize },
    WindowStart,
    WindowEnd(HeartbeatStats),
    AssignStart,
    AssignEnd(AssignStats),
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HeartbeatStats {
    pub secs: f64,
    pub ok: u64,
    pub failed: u64,
    pub late: u64,
    pub dropped: usize,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AssignStats {
    pub secs: f64,
    pub pairs: u64,
    pub failed: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub baseline_secs: f64,
    pub baseline_calls: u64,
}

pub async fn run(opts: &HarnessOptions) -> Result<HarnessReport, String> {
    if opts.executors.is_empty() {
        return Err("--executors is empty".into());
    }
    let pg_store = opts
        .harness_args
        .iter()
        .any(|a| bmx::harness::store::postgres::is_postgres_url(a));
    if opts.replicas > 1 && !pg_store {
        return Err("--replicas needs a PostgreSQL store (--harness-arg=--store --harness-arg=postgres://...)".into());
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        return Err("needs two CPUs: the server on one, the load on the other".into());
    }
    bmx::process::sys::raise_nofile_limit();
    let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    let dir = tempfile::tempdir().map_err(|e| format!("tempdir: {e}"))?;
    let mut rows = Vec::new();
    let mut assign = Vec::new();
    for &n in &opts.executors {
        let tokens = dir.path().join(format!("tokens-{n}"));
        write_tokens(&tokens, n).map_err(|e| format!("tokens file: {e}"))?;
        let base = if opts.baseline {
            let (row, _) = one(&exe, dir.path(), Server::Peer, n, &tokens, opts).await?;
            Some(row)
        } else {
            None
        };
        let (mut row, a) = one(&exe, dir.path(), Server::Harness, n, &tokens, opts).await?;
        row.cpu_ratio = base
            .as_ref()
            .filter(|b| b.server_cpu > 0.0)
            .map(|b| row.server_cpu / b.server_cpu);
        rows.extend(base);
        rows.push(row);
        assign.extend(a);
    }
    let held = rows
        .iter()
        .filter(|r| r.server != "baseline")
        .filter(|r| {
            r.server_cpu < HELD_CPU
                && r.failed == 0
                && r.late == 0
                && r.dropped == 0
                && r.connected == r.executors
        })
        .map(|r| r.executors)
        .max()
        .unwrap_or(0);
    let pg = opts
        .harness_args
        .iter()
        .find(|a| bmx::harness::store::postgres::is_postgres_url(a));
    let fencing = fencing(dir.path(), pg.map(String::as_str), opts.fencing_ops.max(1))?;
    Ok(HarnessReport {
        rows,
        assign,
        fencing,
        held,
    })
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Server {
    Harness,
    Peer,
}

/// Kills the child when dropped (an early `?` must not leave a server or a
/// load running).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

/// Run `cmd` pinned to `cpu`.
fn pinned(cmd: &mut Command, cpu: usize) {
    // SAFETY: sched_setaffinity is a plain syscall on a stack value,
    // async-signal-safe, run in the child between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("local addr: {e}"))
}

fn write_tokens(path: &Path, n: usize) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for i in 0..n {
        writeln!(f, "{}={}", sim_id(i), sim_secret(i))?;
    }
    f.flush()
}

fn sim_id(i: usize) -> String {
    format!("sim-{i}")
}

fn sim_secret(i: usize) -> String {
    format!("bench-secret-{i}")
}

/// Utime + stime of `pid`, in seconds.
fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: fields count from after its ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((utime + stime) / hz.max(1.0))
}

async fn one(
    exe: &Path,
    dir: &Path,
    server: Server,
    n: usize,
    tokens: &Path,
    opts: &HarnessOptions,
) -> Result<(LoadRow, Option<AssignRow>), String> {
    let count = match server {
        Server::Harness => opts.replicas.max(1),
        Server::Peer => 1,
    };
    let mut servers = Vec::with_capacity(count);
    let mut pids = Vec::with_capacity(count);
    let mut listens = Vec::with_capacity(count);
    for k in 0..count {
        let (srv, pid, listen) = start_server(exe, dir, server, n, k, count, tokens, opts).await?;
        servers.push(srv);
        pids.push(pid);
        listens.push(listen);
    }
    let listen = listens[0].clone();
    let urls: Vec<String> = listens
        .iter()
        .map(|l| format!("ws://{l}{}", transport::CONNECT_PATH))
        .collect();

    let assign_secs = if server == Server::Harness {
        opts.assign_secs
    } else {
        0
    };
    let mut cmd = Command::new(exe);
    cmd.args(["bench", "harness-load", "--url"])
        .arg(urls.join(","))
        .arg("--api")
        .arg(format!("http://{listen}"))
        .arg("--executors")
        .arg(n.to_string())
        .arg("--warmup-secs")
        .arg(opts.warmup_secs.to_string())
        .arg("--window-secs")
        .arg(opts.window_secs.to_string())
        .arg("--assign-secs")
        .arg(assign_secs.to_string())
        .arg("--assign-concurrency")
        .arg(opts.assign_concurrency.to_string())
        .env("RUST_LOG", "error")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true);
    pinned(&mut cmd, 1);
    let mut load = Reaped(cmd.spawn().map_err(|e| format!("start load: {e}"))?);
    let mut events = BufReader::new(load.0.stdout.take().ok_or("load stdout")?).lines();
    // Connecting 10 000 executors takes a while; everything else is bounded
    // by the phases' own lengths.
    let budget = Duration::from_secs(
        120 + opts.warmup_secs + opts.window_secs + 2 * assign_secs + n as u64 / 100,
    );
    let deadline = tokio::time::Instant::now() + budget;
    let mut connected = 0;
    let mut window: Option<(f64, Instant)> = None;
    let mut assign_start: Option<(f64, Instant)> = None;
    let mut row: Option<LoadRow> = None;
    let mut assign = None;
    loop {
        let line = match tokio::time::timeout_at(deadline, events.next_line()).await {
            Err(_) => return Err(format!("{server:?} N={n}: the load took over {budget:?}")),
            Ok(Err(e)) => return Err(format!("load output: {e}")),
            Ok(Ok(None)) => break,
            Ok(Ok(Some(l))) => l,
        };
        let event: LoadEvent =
            serde_json::from_str(&line).map_err(|e| format!("load said {line:?}: {e}"))?;
        let cpu_now = || {
            pids.iter()
                .map(|&p| cpu_secs(p).ok_or_else(|| format!("{server:?} exited")))
                .sum::<Result<f64, String>>()
        };
        match event {
            LoadEvent::Connected { connected: c, .. } => connected = c,
            LoadEvent::WindowStart => window = Some((cpu_now()?, Instant::now())),
            LoadEvent::WindowEnd(st) => {
                let (c0, t0) = window.ok_or("window end before start")?;
                let (cpu, wall) = (cpu_now()? - c0, t0.elapsed().as_secs_f64());
                let server_cpu = cpu / wall;
                row = Some(LoadRow {
                    server: match server {
                        Server::Harness if count > 1 => format!("{count}-replica"),
                        Server::Harness => "harness".into(),
                        Server::Peer => "baseline".into(),
                    },
                    executors: n,
                    connected,
                    window_secs: st.secs,
                    heartbeats_per_sec: st.ok as f64 / st.secs,
                    server_cpu,
                    cpu_us_per_heartbeat: cpu * 1e6 / (st.ok.max(1) as f64),
                    server_rss_bytes: pids
                        .iter()
                        .map(|p| super::rss_kib(&p.to_string()).map_or(0, |k| k * 1024))
                        .sum(),
                    rtt_p50_us: st.p50_us,
                    rtt_p99_us: st.p99_us,
                    rtt_max_us: st.max_us,
                    failed: st.failed,
                    late: st.late,
                    dropped: st.dropped,
                    cpu_ratio: None,
                });
            }
            LoadEvent::AssignStart => assign_start = Some((cpu_now()?, Instant::now())),
            LoadEvent::AssignEnd(st) => {
                let (c0, t0) = assign_start.ok_or("assign end before start")?;
                let server_cpu = (cpu_now()? - c0) / t0.elapsed().as_secs_f64();
                assign = Some(AssignRow {
                    executors: n,
                    concurrency: opts.assign_concurrency,
                    pairs_per_sec: st.pairs as f64 / st.secs,
                    pair_p50_us: st.p50_us,
                    pair_p99_us: st.p99_us,
                    failed: st.failed,
                    api_roundtrips_per_sec: st.baseline_calls as f64 / st.baseline_secs,
                    server_cpu,
                });
            }
        }
    }
    let status = load.0.wait().await.map_err(|e| format!("load: {e}"))?;
    if !status.success() {
        return Err(format!("{server:?} N={n}: the load failed ({status})"));
    }
    let row = row.ok_or_else(|| format!("{server:?} N={n}: no measured window"))?;
    drop(servers);
    Ok((row, assign))
}

/// Start server `k` of `count` (a replica id each when `count > 1`),
/// pinned to CPU 0; returns it once it listens, with its pid and address.
#[allow(clippy::too_many_arguments)]
async fn start_server(
    exe: &Path,
    dir: &Path,
    server: Server,
    n: usize,
    k: usize,
    count: usize,
    tokens: &Path,
    opts: &HarnessOptions,
) -> Result<(Reaped, u32, String), String> {
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let mut cmd = Command::new(exe);
    match server {
        Server::Harness => {
            let data = dir.join(format!("data-{n}-{port}"));
            cmd.arg("harness")
                .args(["--listen", &listen, "--heartbeat-ms", "1000"])
                .args(["--lease-ttl-ms", "30000", "--tokens-file"])
                .arg(tokens)
                .arg("--data-dir")
                .arg(&data)
                .args(&opts.harness_args);
            if count > 1 {
                cmd.args(["--replica-id", &format!("bench-{k}")]);
            }
        }
        Server::Peer => {
            cmd.args([
                "bench",
                "harness-peer",
                "--listen",
                &listen,
                "--tokens-file",
            ])
            .arg(tokens);
        }
    }
    cmd.env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true);
    pinned(&mut cmd, 0);
    let mut srv = Reaped(cmd.spawn().map_err(|e| format!("start server: {e}"))?);
    let pid = srv.0.id().ok_or("server exited at once")?;
    // Ready when it prints its first line (both print after listening).
    let mut out = BufReader::new(srv.0.stdout.take().ok_or("server stdout")?).lines();
    match tokio::time::timeout(Duration::from_secs(30), out.next_line()).await {
        Ok(Ok(Some(_))) => {}
        _ => return Err(format!("{server:?} did not start on {listen}")),
    }
    tokio::spawn(async move { while let Ok(Some(_)) = out.next_line().await {} });
    Ok((srv, pid, listen))
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn fencing(dir: &Path, pg: Option<&str>, ops: usize) -> Result<FencingRow, String> {
    let ids: Vec<String> = (0..1000).map(|i| format!("s-{i}")).collect();
    let memory = MemoryLeaseStore::new();
    let t = Instant::now();
    for i in 0..ops {
        std::hint::black_box(memory.next_fencing_token(&ids[i % ids.len()]));
    }
    let memory_ns = t.elapsed().as_nanos() as f64 / ops as f64;

    let db = SqliteStore::open_dir(&dir.join("fencing")).map_err(|e| e.to_string())?;
    let (durable_ns, durable_refused) = bumps(Arc::new(db), &ids, ops)?;
    let (postgres_ns, postgres_refused) = match pg {
        Some(url) => {
            let db = PgStore::connect(url).map_err(|e| e.to_string())?;
            let (ns, refused) = bumps(Arc::new(db), &ids, ops)?;
            (Some(ns), Some(refused))
        }
        None => (None, None),
    };
    Ok(FencingRow {
        ops,
        memory_ns,
        durable_ns,
        ratio: durable_ns / memory_ns.max(f64::MIN_POSITIVE),
        durable_refused,
        postgres_ns,
        postgres_refused,
    })
}

/// ns per token bump of a [`DurableState`] over `db`, and how many bumps
/// were refused (and retried).
fn bumps(db: Arc<dyn DurableBackend>, ids: &[String], ops: usize) -> Result<(f64, u64), String> {
    let durable = DurableState::open(db).map_err(|e| e.to_string())?;
    let mut refused = 0u64;
    let t = Instant::now();
    for i in 0..ops {
        // A refused bump is what the leases actor answers as retryable;
        // here the caller retries until the next block is reserved.
        let deadline = Instant::now() + Duration::from_secs(10);
        while durable.next_fencing_token(&ids[i % ids.len()]).is_none() {
            refused += 1;
            if Instant::now() > deadline {
                return Err("durable fencing: no block reserved within 10 s".into());
            }
            std::thread::yield_now();
        }
    }
    let ns = t.elapsed().as_nanos() as f64 / ops as f64;
    durable.shutdown();
    Ok((ns, refused))
}

// ---------------------------------------------------------------- peer

/// `bmx bench harness-peer`: the baseline server. Accepts executors
/// authenticated by the tokens file and answers with constants.
pub async fn peer_main(listen: &str, tokens_file: &Path) -> Result<(), String> {
    bmx::process::sys::raise_nofile_limit();
    let text = std::fs::read_to_string(tokens_file).map_err(|e| e.to_string())?;
    let tokens: Arc<HashMap<String, String>> = Arc::new(
        text.lines()
            .filter_map(|l| l.split_once('='))
            .map(|(id, secret)| (secret.to_owned(), id.to_owned()))
            .collect(),
    );
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("bind {listen}: {e}"))?;
    println!("bmx bench harness-peer: listening on {listen}");
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // Out of descriptors: wait for one to be freed, never spin.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let tokens = tokens.clone();
        tokio::spawn(async move {
            let auth = |t: Option<&str>| t.and_then(|t| tokens.get(t).cloned());
            let Ok((t, _)) =
                transport::accept(Box::new(stream), &Subprotocol::ALL, 1 << 20, auth).await
            else {
                return;
            };
            let (_link, reader) = Link::start(t, "h", LinkLimits::default());
            reader.run(Arc::new(Answer)).await;
        });
    }
}

// ---------------------------------------------------------------- load

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub url: String,
    pub api: String,
    pub executors: usize,
    pub warmup_secs: u64,
    pub window_secs: u64,
    pub assign_secs: u64,
    pub assign_concurrency: usize,
}

fn emit(e: &LoadEvent) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", serde_json::to_string(e).unwrap_or_default());
    let _ = out.flush();
}

/// A simulated executor's answers to the harness: accept an assign and
/// say ready, stop and say ended, like an executor with nothing to run.
struct Sim {
    link: Arc<Mutex<Option<Link>>>,
}

impl Dispatch for Sim {
    fn dispatch(&self, frame: Inbound, reply: Option<Responder>) {
        let Some(reply) = reply else { return };
        let link = self.link.lock().ok().and_then(|l| l.clone());
        match frame.method().and_then(Method::from_name) {
            Some(Method::SessionAssign) => {
                let Ok(p) = frame.params::<AssignParams>() else {
                    return reply.ok(&AssignResult {
                        accepted: false,
                        session_id: String::new(),
                    });
                };
                reply.ok(&AssignResult {
                    accepted: true,
                    session_id: p.session_id.clone(),
                });
                if let Some(link) = link {
                    tokio::spawn(async move {
                        let ready = ReadyParams {
                            session_id: p.session_id,
                            work_id: p.work_id,
                            lease_token: p.lease.token,
                        };
                        let _ = link
                            .request::<_, serde_json::Value>(
                                Method::SessionReady,
                                &ready,
                                CALL_TIMEOUT,
                            )
                            .await;
                    });
                }
            }
            Some(Method::SessionStop) => {
                let Ok(p) = frame.params::<StopParams>() else {
                    return reply.ok(&StopResult { stopped: false });
                };
                reply.ok(&StopResult { stopped: true });
                if let Some(link) = link {
                    tokio::spawn(async move {
                        let ended = EndedParams {
                            session_id: p.session_id,
                            reason: "stopped".into(),
                        };
                        let _ = link
                            .request::<_, serde_json::Value>(
                                Method::SessionEnded,
                                &ended,
                                CALL_TIMEOUT,
                            )
                            .await;
                    });
                }
            }
            _ => reply.ok(&bmx::wire::types::Accepted::YES),
        }
    }
}

pub(super) struct Connected {
    pub(super) link: Link,
    connection_id: String,
}

async fn connect(endpoint: &Endpoint, i: usize) -> Result<Connected, String> {
    connect_with(endpoint, &sim_secret(i)).await
}

/// A simulated executor (answers as [`Sim`]) registered at `endpoint`
/// with `secret`.
pub(super) async fn connect_with(endpoint: &Endpoint, secret: &str) -> Result<Connected, String> {
    let t = transport::dial(endpoint, secret, &Subprotocol::ALL, 1 << 20, CALL_TIMEOUT)
        .await
        .map_err(|e| format!("dial: {e}"))?;
    let (link, reader) = Link::start(t, "e", LinkLimits::default());
    let slot = Arc::new(Mutex::new(Some(link.clone())));
    tokio::spawn(async move {
        reader.run(Arc::new(Sim { link: slot })).await;
    });
    let params = RegisterParams {
        protocol: "1.1".into(),
        executor: ExecutorInfo {
            name: "bench-sim".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            os: std::env::consts::OS.into(),
            arch: std::env::consts::ARCH.into(),
        },
        environment_id: None,
        capabilities: Default::default(),
        resume: None,
    };
    let r: RegisterResult = link
        .request(Method::ExecutorRegister, &params, CALL_TIMEOUT)
        .await
        .map_err(|e| format!("register: {e}"))?;
    Ok(Connected {
        link,
        connection_id: r.connection_id,
    })
}

#[derive(Default)]
struct Window {
    on: AtomicBool,
    rtts: Mutex<Vec<u64>>,
    failed: AtomicU64,
    late: AtomicU64,
}

/// `bmx bench harness-load`: the simulated executors.
pub async fn load_main(opts: &LoadOptions) -> Result<(), String> {
    bmx::process::sys::raise_nofile_limit();
    let endpoints = opts
        .url
        .split(',')
        .map(|u| Endpoint::parse(u).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, String>>()?;
    let n = opts.executors;
    // Connect in bounded batches: a burst of 10 000 handshakes would only
    // measure the accept queue.
    let mut sims: Vec<Option<Connected>> = Vec::with_capacity(n);
    let mut failed = 0;
    let mut i = 0;
    while i < n {
        let end = (i + DIAL_CONCURRENCY).min(n);
        let batch = futures_util::future::join_all(
            (i..end).map(|k| connect(&endpoints[k % endpoints.len()], k)),
        )
        .await;
        for r in batch {
            match r {
                Ok(c) => sims.push(Some(c)),
                Err(e) => {
                    if failed == 0 {
                        eprintln!("bench harness-load: executor {}: {e}", sims.len());
                    }
                    failed += 1;
                    sims.push(None);
                }
            }
        }
        i = end;
    }
    let connected = sims.iter().flatten().count();
    emit(&LoadEvent::Connected { connected, failed });

    let window = Arc::new(Window::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let links: Vec<Link> = sims.iter().flatten().map(|c| c.link.clone()).collect();
    let mut tasks = Vec::with_capacity(connected);
    for (k, c) in sims.into_iter().flatten().enumerate() {
        let (window, stop) = (window.clone(), stop.clone());
        // Phases spread evenly over the second.
        let phase = Duration::from_micros((k as u64 * 1_000_000) / connected.max(1) as u64);
        tasks.push(tokio::spawn(async move {
            let start = tokio::time::Instant::now() + phase;
            let mut tick = tokio::time::interval_at(start, Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let params = HeartbeatParams {
                connection_id: c.connection_id,
                active_sessions: vec![],
                load: None,
            };
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let t = Instant::now();
                let r: Result<HeartbeatResult, _> = c
                    .link
                    .request(Method::ExecutorHeartbeat, &params, CALL_TIMEOUT)
                    .await;
                let rtt = t.elapsed();
                if !window.on.load(Ordering::Relaxed) {
                    continue;
                }
                match r {
                    Ok(_) => {
                        if rtt > LATE {
                            window.late.fetch_add(1, Ordering::Relaxed);
                        }
                        if let Ok(mut v) = window.rtts.lock() {
                            v.push(rtt.as_micros() as u64);
                        }
                    }
                    Err(_) => {
                        window.failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(opts.warmup_secs)).await;
    let open_before = links.iter().filter(|l| !l.is_closed()).count();
    window.on.store(true, Ordering::Relaxed);
    emit(&LoadEvent::WindowStart);
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(opts.window_secs.max(1))).await;
    window.on.store(false, Ordering::Relaxed);
    let secs = t.elapsed().as_secs_f64();
    let open_after = links.iter().filter(|l| !l.is_closed()).count();
    let mut rtts = std::mem::take(&mut *window.rtts.lock().map_err(|_| "poisoned")?);
    rtts.sort_unstable();
    emit(&LoadEvent::WindowEnd(HeartbeatStats {
        secs,
        ok: rtts.len() as u64,
        failed: window.failed.load(Ordering::Relaxed),
        late: window.late.load(Ordering::Relaxed),
        dropped: open_before.saturating_sub(open_after),
        p50_us: percentile(&rtts, 0.50),
        p99_us: percentile(&rtts, 0.99),
        max_us: rtts.last().copied().unwrap_or(0),
    }));

    if opts.assign_secs > 0 && connected > 0 {
        emit(&LoadEvent::AssignStart);
        let st = assign_phase(opts, connected).await?;
        emit(&LoadEvent::AssignEnd(st));
    }
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}

async fn assign_phase(opts: &LoadOptions, connected: usize) -> Result<AssignStats, String> {
    let api = ApiClient::new(&opts.api)
        .map_err(|e| e.to_string())?
        .timeout(CALL_TIMEOUT);
    let k = opts.assign_concurrency.max(1);
    let secs = Duration::from_secs(opts.assign_secs);

    // Baseline first: a plain API round trip, same callers.
    let t = Instant::now();
    let end = tokio::time::Instant::now() + secs;
    let calls = futures_util::future::join_all((0..k).map(|_| {
        let api = api.clone();
        async move {
            let mut n = 0u64;
            while tokio::time::Instant::now() < end {
                if api.get("/v1/sessions/bench-none").await.is_ok() {
                    n += 1;
                }
            }
            n
        }
    }))
    .await;
    let baseline_secs = t.elapsed().as_secs_f64();
    let baseline_calls = calls.iter().sum();

    let t = Instant::now();
    let end = tokio::time::Instant::now() + secs;
    let per = futures_util::future::join_all((0..k).map(|w| {
        let api = api.clone();
        async move {
            let (mut lat, mut failed) = (Vec::new(), 0u64);
            let mut j = w;
            while tokio::time::Instant::now() < end {
                let executor = sim_id(j % connected);
                j += k;
                let t = Instant::now();
                let created = api
                    .post(
                        "/v1/sessions",
                        &serde_json::json!({ "executorId": executor }),
                    )
                    .await;
                let id = match created {
                    Ok((201, v)) => v["sessionId"].as_str().unwrap_or_default().to_owned(),
                    _ => {
                        failed += 1;
                        continue;
                    }
                };
                match api
                    .delete(&format!(
                        "/v1/sessions/{}",
                        bmx::client::encode_component(&id)
                    ))
                    .await
                {
                    Ok((200, _)) => lat.push(t.elapsed().as_micros() as u64),
                    _ => failed += 1,
                }
            }
            (lat, failed)
        }
    }))
    .await;
    let secs_done = t.elapsed().as_secs_f64();
    let mut lat: Vec<u64> = per.iter().flat_map(|(l, _)| l.iter().copied()).collect();
    lat.sort_unstable();
    Ok(AssignStats {
        secs: secs_done,
        pairs: lat.len() as u64,
        failed: per.iter().map(|(_, f)| f).sum(),
        p50_us: percentile(&lat, 0.50),
        p99_us: percentile(&lat, 0.99),
        baseline_secs,
        baseline_calls,
    })
}

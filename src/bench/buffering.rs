//! `bmx bench buffering`: how fast process output flows, against the raw
//! baseline measured in the same run.
//!
//! Every row uses the same producer (`bmx bench produce`, 1 MiB writes of a
//! fixed pattern to stdout) and counts bytes to the end:
//! * `raw_pipe`: a plain pipe (1 MiB, `F_SETPIPE_SZ`) read into a discard
//!   buffer: the baseline;
//! * `ring_ingest`: through the process actor into its ring, nobody reading;
//!   run alternately with `raw_pipe`, its ratio the median of the pairs'.
//!   Its target ratio comes from pairs run with the whole process (the
//!   reader's threads, the producer) pinned to one CPU ([`super::affinity`]):
//!   unpinned, where the scheduler puts producer and reader decides more
//!   than the ring does (both kinds are reported);
//! * `e2e_<codec>`: read over a loopback WebSocket with `process.read`
//!   long-polls of 1 MiB through the real executor, the process started
//!   with `outputPolicy: "lossless"` and an 8 MiB ring (`--window`): the
//!   producer is held back by the reader, as a pipe would hold it back,
//!   and any lost byte would show as a gap (which fails the run). Run
//!   alternately with `raw_pipe` (unpinned, the same producer: the path
//!   needs both cores), its ratio the median of the pairs': a baseline
//!   measured minutes apart swung the ratio with whatever else the
//!   machine did meanwhile;
//! * `e2e_<codec>_big_ring`: the same reads of a process with the default
//!   policy (`ring`) and a ring as large as the whole output, so the reader
//!   never falls a ring behind: what a client without `lossless` must do to
//!   see every byte. Every byte lands in fresh memory the kernel zeroes
//!   first, which is most of the difference to `e2e_<codec>`. Paired with
//!   `raw_pipe` like `e2e_<codec>`;
//! * `pty`: through `ioMode: "pty"` into the ring, against the same producer
//!   under `script -qc` read from a pipe (`pty_script`), alternately, its
//!   ratio the median of the pairs' (`runs` pairs, at least
//!   [`PTY_PAIRS`]).

use super::peer::BenchPeer;
use bmx::executor::{Executor, ExecutorConfig, ExecutorHandle, TokenSource};
use bmx::process::sys;
use bmx::wire::types::*;
use bmx::wire::{Codec, Endpoint, Link, Method, Subprotocol, Version};
use serde::Serialize;
use std::process::Stdio;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct BufferingOptions {
    pub bytes: u64,
    /// `maxBytes` of each `process.read` (1 MiB).
    pub read_bytes: u64,
    /// Runs per row; the median is reported.
    pub runs: usize,
    pub pty_bytes: u64,
    pub codecs: Vec<Codec>,
    /// Ring bytes of the lossless e2e rows (8 MiB).
    pub window: usize,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Ratios {
    /// Of the pinned pairs: the target's measure.
    pub ring_ingest: f64,
    /// Of the pairs where the scheduler placed the threads.
    pub ring_ingest_unpinned: f64,
    /// Each e2e ratio: the median of its pairs' ratios to `raw_pipe`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_json: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_msgpack: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_json_big_ring: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_msgpack_big_ring: Option<f64>,
    pub pty: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct BufferingReport {
    pub bytes: u64,
    pub runs: usize,
    pub pty_bytes: u64,
    /// `pty`/`pty_script` pairs (`runs`, at least [`PTY_PAIRS`]).
    pub pty_pairs: usize,
    /// Unpinned, of the ring's pairs (each e2e row has pairs of its own).
    pub raw_pipe_mbps: f64,
    pub ring_ingest_mbps: f64,
    /// Both rows with the process pinned to one CPU.
    pub pinned_raw_pipe_mbps: f64,
    pub pinned_ring_ingest_mbps: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_json_mbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_msgpack_mbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_json_big_ring_mbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_msgpack_big_ring_mbps: Option<f64>,
    /// The median `raw_pipe` of each e2e row's own pairs: the baseline its
    /// ratio is taken against.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_json_raw_pipe_mbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_msgpack_raw_pipe_mbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_json_big_ring_raw_pipe_mbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_msgpack_big_ring_raw_pipe_mbps: Option<f64>,
    pub pty_mbps: f64,
    pub pty_script_mbps: f64,
    pub ratios: Ratios,
}

fn mbps(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64().max(1e-9) / 1e6
}

pub(super) fn producer(bytes: u64) -> Result<Vec<String>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    Ok(vec![
        exe.to_string_lossy().into_owned(),
        "bench".into(),
        "produce".into(),
        "--bytes".into(),
        bytes.to_string(),
    ])
}

/// Read a child's stdout through a plain pipe to the end; bytes counted.
pub(super) async fn drain_pipe(argv: &[String]) -> Result<(u64, Duration), String> {
    let (r, w) = sys::pipe(1 << 20).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut child = tokio::process::Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::from(w))
        .spawn()
        .map_err(|e| format!("{}: {e}", argv[0]))?;
    let afd = sys::async_fd(r).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let mut guard = afd.readable().await.map_err(|e| e.to_string())?;
        match nix::unistd::read(afd.get_ref(), &mut buf) {
            Ok(0) => break,
            Ok(n) => total += n as u64,
            Err(nix::errno::Errno::EAGAIN) => guard.clear_ready(),
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    let _ = child.wait().await;
    Ok((total, started.elapsed()))
}

struct Rig {
    executor: ExecutorHandle,
    link: Link,
    _work: tempfile::TempDir,
}

async fn rig(protocol: Subprotocol, ring_bytes: usize) -> Result<Rig, String> {
    let mut peer = BenchPeer::start(protocol)
        .await
        .map_err(|e| e.to_string())?;
    let work = tempfile::tempdir().map_err(|e| e.to_string())?;
    let endpoint = Endpoint::parse(&peer.url).map_err(|e| e.to_string())?;
    let mut config = ExecutorConfig::new(endpoint, TokenSource::Static(peer.token.clone()));
    config.work_root = work.path().to_path_buf();
    config.process_buffer_bytes = ring_bytes;
    // `bmx bench` owns every child it starts, like the daemon: be their
    // subreaper, so killing a tree reads only this process's own children.
    config.subreaper = true;
    config.request_timeout = Duration::from_secs(60);
    let executor = Executor::start(config).await.map_err(|e| e.to_string())?;
    let link = tokio::time::timeout(Duration::from_secs(10), peer.link())
        .await
        .map_err(|_| "the executor did not connect".to_owned())?
        .ok_or("peer stopped")?;
    let assign = AssignParams {
        session_id: "bench".into(),
        work_id: "bench".into(),
        agent_id: None,
        environment_id: None,
        lease: LeaseGrant {
            token: "bench".into(),
            fencing_token: 1,
        },
        deadline_ms: None,
        mcp_servers: vec![],
        metadata: Default::default(),
        resources: vec![],
        restore: None,
    };
    // The register answer may still be in flight: retry the assign briefly.
    for _ in 0..50 {
        match link
            .request::<_, AssignResult>(Method::SessionAssign, &assign, Duration::from_secs(10))
            .await
        {
            Ok(_) => {
                return Ok(Rig {
                    executor,
                    link,
                    _work: work,
                })
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    Err("session.assign failed".into())
}

fn start(argv: Vec<String>, io_mode: IoMode, wait_ms: Option<u64>) -> ProcessStartParams {
    ProcessStartParams {
        session_id: "bench".into(),
        process_id: uuid::Uuid::new_v4().to_string(),
        argv,
        cwd: None,
        env: None,
        stdin: StdinMode::Closed,
        stderr: StderrMode::Separate,
        io_mode,
        timeout_ms: None,
        wait_ms,
        metadata: None,
        cols: None,
        rows: None,
        output_policy: Default::default(),
        package_install: None,
        git_credentials: false,
        file_transfer: None,
    }
}

/// At least this many `pty`/`pty_script` pairs. A PTY moves at most a
/// line-discipline buffer (4 KiB) per wake-up of its reader, so one run's
/// rate is one scheduler's luck: with three 16 MiB pairs the median ratio
/// fell to 0.92 once in twelve invocations while the row medians stood at
/// 99 against 93 MB/s (docs/benchmarks.md). A pair costs well under a
/// second.
const PTY_PAIRS: usize = 5;

const LONG: Duration = Duration::from_secs(600);

/// Into the ring, nobody reading: until the process ended and the ring saw
/// every byte.
async fn ingest(bytes: u64, io_mode: IoMode) -> Result<(u64, Duration), String> {
    let rig = rig(Subprotocol::ALL[0], 1 << 20).await?;
    let p = start(producer(bytes)?, io_mode, Some(600_000));
    let started = Instant::now();
    let mut st: ProcessState = rig
        .link
        .request(Method::ProcessStart, &p, LONG)
        .await
        .map_err(|e| e.to_string())?;
    while st.cursors.stdout < bytes && st.state == ProcState::Running {
        st = rig
            .link
            .request(Method::ProcessStart, &p, LONG)
            .await
            .map_err(|e| e.to_string())?;
    }
    // The pump may still be moving the last pipe buffer into the ring.
    let deadline = Instant::now() + Duration::from_secs(10);
    while st.cursors.stdout < bytes && Instant::now() < deadline {
        tokio::task::yield_now().await;
        st = rig
            .link
            .request(Method::ProcessStart, &p, LONG)
            .await
            .map_err(|e| e.to_string())?;
    }
    let took = started.elapsed();
    rig.executor.shutdown().await;
    if st.exit_code != Some(0) {
        return Err(format!("producer ended with {st:?}"));
    }
    Ok((st.cursors.stdout, took))
}

/// How an e2e row keeps every byte.
#[derive(Debug, Clone, Copy)]
enum Keep {
    /// `outputPolicy: "lossless"` with a ring of this many bytes.
    Lossless(usize),
    /// The default policy, with a ring as large as the output.
    BigRing,
}

/// Over the wire with long-poll reads of `read_bytes`.
async fn e2e(
    bytes: u64,
    codec: Codec,
    read_bytes: u64,
    keep: Keep,
) -> Result<(u64, Duration), String> {
    let protocol = Subprotocol {
        version: Version::V1_1,
        codec,
    };
    let (ring, policy) = match keep {
        Keep::Lossless(window) => (window.max(1 << 20), OutputPolicy::Lossless),
        Keep::BigRing => (
            usize::try_from(bytes).unwrap_or(usize::MAX).max(1 << 20),
            OutputPolicy::Ring,
        ),
    };
    let rig = rig(protocol, ring).await?;
    let p = ProcessStartParams {
        output_policy: policy,
        package_install: None,
        git_credentials: false,
        file_transfer: None,
        ..start(producer(bytes)?, IoMode::Pipe, None)
    };
    let started = Instant::now();
    let _: ProcessState = rig
        .link
        .request(Method::ProcessStart, &p, LONG)
        .await
        .map_err(|e| e.to_string())?;
    let (mut cursor, mut total) = (0u64, 0u64);
    loop {
        let r: ProcessReadResult = rig
            .link
            .request(
                Method::ProcessRead,
                &ProcessReadParams {
                    session_id: "bench".into(),
                    process_id: p.process_id.clone(),
                    stream: Stream::Stdout,
                    cursor,
                    max_bytes: Some(read_bytes),
                    wait_ms: Some(1_000),
                },
                LONG,
            )
            .await
            .map_err(|e| e.to_string())?;
        if r.gap {
            return Err(format!("gap at cursor {cursor}: the reader fell behind"));
        }
        total += r.data.len() as u64;
        cursor = r.next_cursor;
        if r.eof {
            break;
        }
    }
    let took = started.elapsed();
    rig.executor.shutdown().await;
    Ok((total, took))
}

/// MB/s of one run, which must have seen every byte.
fn checked(expected: u64, what: &str, (n, took): (u64, Duration)) -> Result<f64, String> {
    if n != expected {
        return Err(format!("{what} saw {n} of {expected} bytes"));
    }
    Ok(mbps(n, took))
}

/// The median of non-empty measurements.
fn middle(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The medians of `runs` alternating pairs: of the baseline (MB/s), of
/// the row (MB/s) and of the pairs' ratios.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Paired {
    base: f64,
    row: f64,
    ratio: f64,
}

impl Paired {
    /// Summarise `(baseline, row)` MB/s pairs; `None` when there are none.
    fn of(runs: &[(f64, f64)]) -> Option<Paired> {
        if runs.is_empty() {
            return None;
        }
        let pick = |f: fn(&(f64, f64)) -> f64| middle(runs.iter().map(f).collect());
        Some(Paired {
            base: pick(|p| p.0),
            row: pick(|p| p.1),
            ratio: pick(|p| p.1 / p.0.max(1e-9)),
        })
    }
}

/// `runs` alternating pairs: a `raw_pipe` run of `argv` (the baseline),
/// then a run of the row, each checked to have seen all `bytes`.
///
/// Why pairs: the machine's other work comes in bursts of seconds to
/// minutes; a burst then lands on both halves of a pair instead of on one
/// row, and the median of the pairs' ratios drops the pair it spoiled.
async fn pairs<F, Fut>(
    runs: usize,
    bytes: u64,
    argv: &[String],
    what: &str,
    row: F,
) -> Result<Paired, String>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(u64, Duration), String>>,
{
    let mut v = Vec::with_capacity(runs.max(1));
    for _ in 0..runs.max(1) {
        let base = checked(bytes, "raw pipe", drain_pipe(argv).await?)?;
        let r = checked(bytes, what, row().await?)?;
        tracing::debug!(what, raw_pipe = base, mbps = r, "one pair");
        v.push((base, r));
    }
    Paired::of(&v).ok_or_else(|| format!("{what}: no runs"))
}

pub async fn run(opts: &BufferingOptions) -> Result<BufferingReport, String> {
    let runs = opts.runs;
    let argv = producer(opts.bytes)?;
    // Every row alternates with its baseline, run by run, and its ratio is
    // the median of each pair's ratio ([`pairs`]). The ring: first with
    // everything on one CPU (the target's pairs), then where the scheduler
    // puts it. The e2e rows need both cores: their pairs are unpinned.
    let ring = || ingest(opts.bytes, IoMode::Pipe);
    let cpu = super::affinity::first_cpu().map_err(|e| format!("CPU mask: {e}"))?;
    let pinned = {
        let _pin =
            super::affinity::pin_process(cpu).map_err(|e| format!("pin to CPU {cpu}: {e}"))?;
        pairs(runs, opts.bytes, &argv, "ring ingest", ring).await?
    };
    let free = pairs(runs, opts.bytes, &argv, "ring ingest", ring).await?;
    let mut report = BufferingReport {
        bytes: opts.bytes,
        runs,
        pty_bytes: opts.pty_bytes,
        raw_pipe_mbps: free.base,
        ring_ingest_mbps: free.row,
        pinned_raw_pipe_mbps: pinned.base,
        pinned_ring_ingest_mbps: pinned.row,
        ..Default::default()
    };
    let mut e2e_ratios = Ratios::default();
    for &codec in &opts.codecs {
        for keep in [Keep::Lossless(opts.window), Keep::BigRing] {
            let what = format!("e2e {codec:?} {keep:?}");
            let p = pairs(runs, opts.bytes, &argv, &what, || {
                e2e(opts.bytes, codec, opts.read_bytes, keep)
            })
            .await?;
            let (mbps, base, ratio) = match (codec, keep) {
                (Codec::Json, Keep::Lossless(_)) => (
                    &mut report.e2e_json_mbps,
                    &mut report.e2e_json_raw_pipe_mbps,
                    &mut e2e_ratios.e2e_json,
                ),
                (Codec::MsgPack, Keep::Lossless(_)) => (
                    &mut report.e2e_msgpack_mbps,
                    &mut report.e2e_msgpack_raw_pipe_mbps,
                    &mut e2e_ratios.e2e_msgpack,
                ),
                (Codec::Json, Keep::BigRing) => (
                    &mut report.e2e_json_big_ring_mbps,
                    &mut report.e2e_json_big_ring_raw_pipe_mbps,
                    &mut e2e_ratios.e2e_json_big_ring,
                ),
                (Codec::MsgPack, Keep::BigRing) => (
                    &mut report.e2e_msgpack_big_ring_mbps,
                    &mut report.e2e_msgpack_big_ring_raw_pipe_mbps,
                    &mut e2e_ratios.e2e_msgpack_big_ring,
                ),
            };
            (*mbps, *base, *ratio) = (Some(p.row), Some(p.base), Some(p.ratio));
        }
    }
    let command = producer(opts.pty_bytes)?.join(" ");
    let script = vec![
        "script".to_owned(),
        "-qc".into(),
        command,
        "/dev/null".into(),
    ];
    let (mut pty, mut baseline, mut pty_ratio) = (Vec::new(), Vec::new(), Vec::new());
    report.pty_pairs = runs.max(PTY_PAIRS);
    for _ in 0..report.pty_pairs {
        let s = checked(opts.pty_bytes, "pty script", drain_pipe(&script).await?)?;
        // Not checked against the count: a PTY may translate bytes.
        let (n, took) = ingest(opts.pty_bytes, IoMode::Pty).await?;
        let p = mbps(n, took);
        baseline.push(s);
        pty.push(p);
        pty_ratio.push(p / s.max(1e-9));
    }
    report.pty_mbps = middle(pty);
    report.pty_script_mbps = middle(baseline);
    report.ratios = Ratios {
        ring_ingest: pinned.ratio,
        ring_ingest_unpinned: free.ratio,
        pty: middle(pty_ratio),
        ..e2e_ratios
    };
    Ok(report)
}

impl BufferingReport {
    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut out = format!(
            "bmx bench buffering: {} bytes ({} through the PTY), median of {} runs\n{:<20} {:>12} {:>10}\n",
            self.bytes, self.pty_bytes, self.runs, "path", "MB/s", "ratio"
        );
        let mut row = |name: &str, v: f64, ratio: Option<f64>, against: &str| {
            let r = ratio
                .map(|r| format!("{r:.2}"))
                .unwrap_or_else(|| "1.00".into());
            out.push_str(&format!("{name:<20} {v:>12.1} {r:>10}  {against}\n"));
        };
        row(
            "raw_pipe",
            self.raw_pipe_mbps,
            None,
            "baseline (of the ring's pairs)",
        );
        row(
            "ring_ingest",
            self.ring_ingest_mbps,
            Some(self.ratios.ring_ingest_unpinned),
            "of raw_pipe (pairs, unpinned)",
        );
        row(
            "raw_pipe_1cpu",
            self.pinned_raw_pipe_mbps,
            None,
            "baseline, process on one CPU",
        );
        row(
            "ring_ingest_1cpu",
            self.pinned_ring_ingest_mbps,
            Some(self.ratios.ring_ingest),
            "of raw_pipe_1cpu (pairs; the target)",
        );
        let e2e = [
            (
                "e2e_json",
                self.e2e_json_mbps,
                self.ratios.e2e_json,
                self.e2e_json_raw_pipe_mbps,
            ),
            (
                "e2e_msgpack",
                self.e2e_msgpack_mbps,
                self.ratios.e2e_msgpack,
                self.e2e_msgpack_raw_pipe_mbps,
            ),
            (
                "e2e_json_big_ring",
                self.e2e_json_big_ring_mbps,
                self.ratios.e2e_json_big_ring,
                self.e2e_json_big_ring_raw_pipe_mbps,
            ),
            (
                "e2e_msgpack_big_ring",
                self.e2e_msgpack_big_ring_mbps,
                self.ratios.e2e_msgpack_big_ring,
                self.e2e_msgpack_big_ring_raw_pipe_mbps,
            ),
        ];
        for (name, v, ratio, base) in e2e {
            if let Some(v) = v {
                let against = format!(
                    "of raw_pipe (pairs; their raw_pipe {:.1})",
                    base.unwrap_or_default()
                );
                row(name, v, ratio, &against);
            }
        }
        row("pty_script", self.pty_script_mbps, None, "PTY baseline");
        let pairs = format!("of pty_script ({} pairs)", self.pty_pairs);
        row("pty", self.pty_mbps, Some(self.ratios.pty), &pairs);
        out
    }
}

/// `bmx bench produce`: write `bytes` bytes of a fixed pattern to stdout in
/// 1 MiB writes.
pub fn produce(bytes: u64) -> std::io::Result<()> {
    // Straight write(2) on fd 1: std's stdout is line-buffered and would
    // scan every block for a newline.
    let block: Vec<u8> = (0..1 << 20).map(|i| b'a' + (i % 26) as u8).collect();
    let out = std::io::stdout();
    let fd = std::os::fd::AsFd::as_fd(&out);
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len() as u64) as usize;
        let mut off = 0;
        while off < n {
            match nix::unistd::write(fd, &block[off..n]) {
                Ok(w) => off += w,
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        left -= n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_ratio_is_the_median_of_the_pairs_not_of_the_medians() {
        // A burst on the second pair slows both halves: its ratio stays.
        let p = Paired::of(&[(2000.0, 600.0), (1000.0, 300.0), (3000.0, 750.0)]).unwrap();
        assert_eq!(p.base, 2000.0);
        assert_eq!(p.row, 600.0);
        assert_eq!(p.ratio, 0.3);
        assert_eq!(Paired::of(&[]), None);
    }

    #[test]
    fn the_table_names_each_e2e_rows_own_baseline() {
        let r = BufferingReport {
            raw_pipe_mbps: 2500.0,
            e2e_json_mbps: Some(700.0),
            e2e_json_raw_pipe_mbps: Some(2800.0),
            ratios: Ratios {
                e2e_json: Some(0.25),
                ..Default::default()
            },
            ..Default::default()
        };
        let t = r.table();
        let line = t.lines().find(|l| l.starts_with("e2e_json ")).unwrap();
        assert!(line.contains("0.25"), "{line}");
        assert!(line.contains("raw_pipe 2800.0"), "{line}");
        assert!(!t.contains("e2e_msgpack"));
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["e2e_json_raw_pipe_mbps"], 2800.0);
        assert_eq!(json["ratios"]["e2e_json"], 0.25);
        assert!(json.get("e2e_msgpack_raw_pipe_mbps").is_none());
    }
}

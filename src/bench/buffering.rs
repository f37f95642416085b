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
//!   and any lost byte would show as a gap (which fails the run);
//! * `e2e_<codec>_big_ring`: the same reads of a process with the default
//!   policy (`ring`) and a ring as large as the whole output, so the reader
//!   never falls a ring behind: what a client without `lossless` must do to
//!   see every byte. Every byte lands in fresh memory the kernel zeroes
//!   first, which is most of the difference to `e2e_<codec>`;
//! * `pty`: through `ioMode: "pty"` into the ring, against the same producer
//!   under `script -qc` read from a pipe (`pty_script`), alternately, its
//!   ratio the median of the pairs'.

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
    /// Unpinned: the baseline of the e2e rows, which need both cores.
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

/// The median of `runs` measurements (in MB/s) of one row.
async fn median<F, Fut>(runs: usize, expected: u64, what: &str, f: F) -> Result<f64, String>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(u64, Duration), String>>,
{
    let mut v = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        let (n, took) = f().await?;
        if n != expected {
            return Err(format!("{what} saw {n} of {expected} bytes"));
        }
        v.push(mbps(n, took));
        tracing::debug!(what, mbps = mbps(n, took), "one run");
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[v.len() / 2])
}

/// `runs` alternating pairs of the raw pipe and the ring: the medians of
/// each row (MB/s) and of the pairs' ratios.
async fn pairs(runs: usize, bytes: u64, argv: &[String]) -> Result<(f64, f64, f64), String> {
    let mut raw = Vec::with_capacity(runs.max(1));
    let mut ring = Vec::with_capacity(runs.max(1));
    let mut paired = Vec::with_capacity(runs.max(1));
    for _ in 0..runs.max(1) {
        let r = checked(bytes, "raw pipe", drain_pipe(argv).await?)?;
        let i = checked(bytes, "ring ingest", ingest(bytes, IoMode::Pipe).await?)?;
        raw.push(r);
        ring.push(i);
        paired.push(i / r);
    }
    Ok((middle(raw), middle(ring), middle(paired)))
}

pub async fn run(opts: &BufferingOptions) -> Result<BufferingReport, String> {
    let runs = opts.runs;
    let argv = producer(opts.bytes)?;
    // The baseline and the ring row alternate, run by run, and the ratio
    // is the median of each pair's ratio: a burst of other work on the
    // machine then lands on both halves of a pair instead of on one row.
    // First with everything on one CPU (the target's pairs), then where
    // the scheduler puts it (the e2e rows' baseline: they need both).
    let cpu = super::affinity::first_cpu().map_err(|e| format!("CPU mask: {e}"))?;
    let pinned = {
        let _pin =
            super::affinity::pin_process(cpu).map_err(|e| format!("pin to CPU {cpu}: {e}"))?;
        pairs(runs, opts.bytes, &argv).await?
    };
    let free = pairs(runs, opts.bytes, &argv).await?;
    let raw_pipe_mbps = free.0;
    let ring_ingest_mbps = free.1;
    let mut report = BufferingReport {
        bytes: opts.bytes,
        runs,
        pty_bytes: opts.pty_bytes,
        raw_pipe_mbps,
        ring_ingest_mbps,
        pinned_raw_pipe_mbps: pinned.0,
        pinned_ring_ingest_mbps: pinned.1,
        ..Default::default()
    };
    for &codec in &opts.codecs {
        for keep in [Keep::Lossless(opts.window), Keep::BigRing] {
            let what = format!("e2e {codec:?} {keep:?}");
            let v = median(runs, opts.bytes, &what, || {
                e2e(opts.bytes, codec, opts.read_bytes, keep)
            })
            .await?;
            let slot = match (codec, keep) {
                (Codec::Json, Keep::Lossless(_)) => &mut report.e2e_json_mbps,
                (Codec::MsgPack, Keep::Lossless(_)) => &mut report.e2e_msgpack_mbps,
                (Codec::Json, Keep::BigRing) => &mut report.e2e_json_big_ring_mbps,
                (Codec::MsgPack, Keep::BigRing) => &mut report.e2e_msgpack_big_ring_mbps,
            };
            *slot = Some(v);
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
    for _ in 0..runs.max(1) {
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
        ring_ingest: pinned.2,
        ring_ingest_unpinned: free.2,
        e2e_json: report.e2e_json_mbps.map(|v| v / raw_pipe_mbps),
        e2e_msgpack: report.e2e_msgpack_mbps.map(|v| v / raw_pipe_mbps),
        e2e_json_big_ring: report.e2e_json_big_ring_mbps.map(|v| v / raw_pipe_mbps),
        e2e_msgpack_big_ring: report.e2e_msgpack_big_ring_mbps.map(|v| v / raw_pipe_mbps),
        pty: middle(pty_ratio),
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
        row("raw_pipe", self.raw_pipe_mbps, None, "baseline");
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
        if let Some(v) = self.e2e_json_mbps {
            row("e2e_json", v, self.ratios.e2e_json, "of raw_pipe");
        }
        if let Some(v) = self.e2e_msgpack_mbps {
            row("e2e_msgpack", v, self.ratios.e2e_msgpack, "of raw_pipe");
        }
        if let Some(v) = self.e2e_json_big_ring_mbps {
            row(
                "e2e_json_big_ring",
                v,
                self.ratios.e2e_json_big_ring,
                "of raw_pipe",
            );
        }
        if let Some(v) = self.e2e_msgpack_big_ring_mbps {
            row(
                "e2e_msgpack_big_ring",
                v,
                self.ratios.e2e_msgpack_big_ring,
                "of raw_pipe",
            );
        }
        row("pty_script", self.pty_script_mbps, None, "PTY baseline");
        row(
            "pty",
            self.pty_mbps,
            Some(self.ratios.pty),
            "of pty_script (pairs)",
        );
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

//! `bmx bench scale`: many sessions with live processes on one executor:
//! the executor's memory per session and per process, and the time to
//! assign, start and stop them all.
//!
//! Each process is `sleep` with stderr merged into stdout, so it costs the
//! executor one pipe descriptor (two with separate stderr): 10 000
//! processes need `ulimit -n` above 10 000 (the executor raises its soft
//! limit to the hard one at start).

use super::peer::BenchPeer;
use bmx::executor::{Executor, ExecutorConfig, TokenSource};
use bmx::wire::types::*;
use bmx::wire::{Endpoint, Link, Method, Subprotocol};
use serde::Serialize;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    pub sessions: usize,
    pub processes_per_session: usize,
    pub baseline_rss_bytes: u64,
    pub after_sessions_rss_bytes: u64,
    pub after_processes_rss_bytes: u64,
    pub rss_per_session_bytes: f64,
    pub rss_per_process_bytes: f64,
    pub assign_secs: f64,
    pub start_processes_secs: f64,
    /// Mean time per start (µs) over the starts made while about 100
    /// processes were live (those from the 64th to the 192nd).
    pub start_us_at_100: f64,
    /// Mean time per start (µs) over the last 128 starts (all but 128 of
    /// the processes live).
    pub start_us_at_full: f64,
    /// `start_us_at_full / start_us_at_100` (the goal: at most 1.5).
    pub start_growth: f64,
    /// Whether the sessions were sandboxed (`--sandbox`), and how.
    pub sandbox: String,
    pub stop_secs: f64,
    /// Processes of the bench's sessions still alive after every session
    /// was stopped: those in a session cgroup of this executor, or
    /// carrying its scope tag.
    pub leftover_processes: usize,
}

/// Resident set size of this process.
pub fn rss_bytes() -> u64 {
    super::rss_kib("self").map_or(0, |kib| kib * 1024)
}

async fn in_batches<F, Fut>(count: usize, batch: usize, f: F) -> Result<(), String>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let mut i = 0;
    while i < count {
        let end = (i + batch).min(count);
        let results = futures_util::future::join_all((i..end).map(&f)).await;
        results.into_iter().collect::<Result<Vec<()>, String>>()?;
        i = end;
    }
    Ok(())
}

async fn req<P: Serialize, R: serde::de::DeserializeOwned>(
    link: &Link,
    m: Method,
    p: &P,
) -> Result<R, String> {
    link.request(m, p, Duration::from_secs(120))
        .await
        .map_err(|e| format!("{m}: {e}"))
}

pub async fn run(
    sessions: usize,
    per_session: usize,
    sandbox: bmx::sandbox::Mode,
) -> Result<ScaleReport, String> {
    bmx::process::sys::raise_nofile_limit();
    let mut peer = BenchPeer::start(Subprotocol::ALL[0])
        .await
        .map_err(|e| e.to_string())?;
    let work = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut config = ExecutorConfig::new(
        Endpoint::parse(&peer.url).map_err(|e| e.to_string())?,
        TokenSource::Static(peer.token.clone()),
    );
    config.work_root = work.path().to_path_buf();
    config.max_sessions = sessions as u32 + 1;
    config.max_processes_per_session = per_session.max(1) as u32;
    // `bmx bench` owns every child it starts, like the daemon: be their
    // subreaper, so killing a tree reads only this process's own children.
    config.subreaper = true;
    config.request_timeout = Duration::from_secs(120);
    config.sandbox.mode = sandbox;
    let executor = Executor::start(config).await.map_err(|e| e.to_string())?;
    let result = measure(&mut peer, &executor, sessions, per_session).await;
    // Whatever happened, end every session: no sleep outlives the bench.
    executor.shutdown().await;
    result
}

async fn measure(
    peer: &mut BenchPeer,
    executor: &bmx::executor::ExecutorHandle,
    sessions: usize,
    per_session: usize,
) -> Result<ScaleReport, String> {
    let link = peer.link().await.ok_or("no connection")?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let baseline = rss_bytes();
    let started = Instant::now();
    in_batches(sessions, 64, |i| {
        let link = link.clone();
        async move {
            let p = AssignParams {
                session_id: format!("s{i}"),
                work_id: format!("w{i}"),
                agent_id: None,
                environment_id: None,
                lease: LeaseGrant {
                    token: "t".into(),
                    fencing_token: 1,
                },
                deadline_ms: None,
                mcp_servers: vec![],
                metadata: Default::default(),
                resources: vec![],
                restore: None,
            };
            req::<_, AssignResult>(&link, Method::SessionAssign, &p)
                .await
                .map(|_| ())
        }
    })
    .await?;
    let assign_secs = started.elapsed().as_secs_f64();
    let after_sessions = rss_bytes();
    let started = Instant::now();
    let total = sessions * per_session;
    let batch_done = std::sync::Mutex::new(Vec::<(usize, Instant)>::new());
    in_batches(total, 32, |n| {
        let batch_done = &batch_done;
        let link = link.clone();
        async move {
            let p = ProcessStartParams {
                session_id: format!("s{}", n / per_session),
                process_id: format!("p{}", n % per_session),
                argv: vec!["sleep".into(), "3600".into()],
                cwd: None,
                env: None,
                stdin: StdinMode::Closed,
                stderr: StderrMode::Merge,
                io_mode: IoMode::Pipe,
                timeout_ms: None,
                wait_ms: None,
                metadata: None,
                cols: None,
                rows: None,
                output_policy: Default::default(),
                package_install: None,
                git_credentials: false,
                file_transfer: None,
            };
            let st: ProcessState = req(&link, Method::ProcessStart, &p).await?;
            if let Ok(mut d) = batch_done.lock() {
                d.push((n, Instant::now()));
            }
            match st.state {
                ProcState::Running => Ok(()),
                other => Err(format!("process {n}: {other:?} {:?}", st.message)),
            }
        }
    })
    .await?;
    let start_processes_secs = started.elapsed().as_secs_f64();
    // When the k-th start (in completion order) finished: the time per
    // start over a window is its span over its length.
    let mut done: Vec<Instant> = batch_done
        .into_inner()
        .unwrap_or_default()
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    done.sort();
    let per_start = |from: usize, to: usize| -> f64 {
        if to <= from || to > done.len() || from == 0 {
            return f64::NAN;
        }
        (done[to - 1] - done[from - 1]).as_secs_f64() * 1e6 / (to - from) as f64
    };
    let start_us_at_100 = per_start(64, 192.min(total));
    let start_us_at_full = per_start(total.saturating_sub(128).max(1), total);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after_processes = rss_bytes();
    let started = Instant::now();
    in_batches(sessions, 64, |i| {
        let link = link.clone();
        async move {
            let p = StopParams {
                session_id: format!("s{i}"),
                reason: "bench".into(),
                deadline_ms: Some(5_000),
                keep_workspace: false,
            };
            req::<_, StopResult>(&link, Method::SessionStop, &p)
                .await
                .map(|_| ())
        }
    })
    .await?;
    let stop_secs = started.elapsed().as_secs_f64();
    let scope = format!("{}/", executor.shared().instance);
    let mut leftover = bmx::process::sys::pids_in_scope(&scope);
    leftover.extend(in_session_cgroups());
    leftover.sort_unstable();
    leftover.dedup();
    let leftover = leftover.len();
    let procs = (sessions * per_session).max(1) as f64;
    Ok(ScaleReport {
        sessions,
        processes_per_session: per_session,
        baseline_rss_bytes: baseline,
        after_sessions_rss_bytes: after_sessions,
        after_processes_rss_bytes: after_processes,
        rss_per_session_bytes: after_sessions.saturating_sub(baseline) as f64
            / sessions.max(1) as f64,
        rss_per_process_bytes: after_processes.saturating_sub(after_sessions) as f64 / procs,
        assign_secs,
        start_processes_secs,
        start_us_at_100,
        start_us_at_full,
        start_growth: start_us_at_full / start_us_at_100,
        sandbox: match executor.shared().capabilities().sandbox {
            Some(s) => format!("filesystem={} cgroup={}", s.filesystem, s.cgroup),
            None => "off".into(),
        },
        stop_secs,
        leftover_processes: leftover,
    })
}

/// Pids in one of this process's session cgroups (any hierarchy).
fn in_session_cgroups() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&p| bmx::sandbox::cgroup::in_sessions(p))
        .collect()
}

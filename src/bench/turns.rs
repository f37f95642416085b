//! `bmx bench turns`: agent events per second from the agent to an SSE
//! client through executor and harness, against the same agent's ACP
//! stream read directly, in the same run.
//!
//! * `direct`: the bench spawns the offline test agent (tests/peers) and
//!   speaks ACP on its pipes: `initialize`, `session/new`, then `session/
//!   prompt "many N"`; it counts the N `agent_message_chunk` updates;
//! * `through`: an in-process harness and executor on loopback with the
//!   same agent; the bench reads `GET /v1/sessions/{id}/events` (SSE) and
//!   counts the N chunks in the deltas (`session.event_delta`: chunks that
//!   reach the executor in one read of the agent's pipe travel as one
//!   delta; each chunk's index is checked, in order, once) until the
//!   turn's `session.status_idle`.
//!
//! The figure is chunks per second end to end; the ratio is through/direct.
//!
//! Latency: the agent's `paced N MS` turn writes chunks "at T" far apart,
//! T its CLOCK_MONOTONIC at the write; each reader (the direct one on the
//! pipe, the SSE client through executor and harness) subtracts T from
//! its own CLOCK_MONOTONIC when the chunk arrives. The added latency is
//! through − direct at p50 and p99 over every chunk of every run.

use super::local::Local;
use bmx::executor::mcp::sse::SseReader;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

#[derive(Debug, Clone)]
pub struct TurnsOptions {
    /// The agent script (default: tests/peers' test agent, run with node).
    pub agent: PathBuf,
    pub chunks: u64,
    pub runs: usize,
    /// Chunks per latency turn (`paced N MS`).
    pub paced: u64,
    /// Milliseconds between paced chunks: far apart, so a chunk's latency
    /// is its own, not the queue of the ones before it.
    pub gap_ms: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct TurnsReport {
    pub chunks: u64,
    pub runs: usize,
    pub direct_chunks_per_s: f64,
    pub through_chunks_per_s: f64,
    /// Deltas the SSE client read for the `chunks` (median run): chunks
    /// that reach the executor together travel as one delta.
    pub through_deltas: u64,
    /// through / direct (the target: at least 0.5).
    pub ratio: f64,
    pub paced: u64,
    pub gap_ms: u64,
    /// A paced chunk's age when read (agent write → reader), in µs, over
    /// every run's chunks: on the agent's pipe...
    pub direct_p50_us: f64,
    pub direct_p99_us: f64,
    /// ...and at the SSE client, through executor and harness.
    pub through_p50_us: f64,
    pub through_p99_us: f64,
    /// What executor and harness add (through − direct).
    pub added_p50_us: f64,
    pub added_p99_us: f64,
}

impl TurnsReport {
    pub fn table(&self) -> String {
        format!(
            "agent chunks, {} per turn, median of {} runs\n{:>16} {:>16} {:>8} {:>10}\n{:>16.0} {:>16.0} {:>8.2} {:>10}\n",
            self.chunks,
            self.runs,
            "direct/s",
            "through/s",
            "ratio",
            "deltas",
            self.direct_chunks_per_s,
            self.through_chunks_per_s,
            self.ratio,
            self.through_deltas
        ) + &format!(
            "delta latency, agent write -> reader, {} chunks {} ms apart x {} runs (us)\n{:>10} {:>10} {:>10}\n{:>10} {:>10.0} {:>10.0}\n{:>10} {:>10.0} {:>10.0}\n{:>10} {:>10.0} {:>10.0}\n",
            self.paced,
            self.gap_ms,
            self.runs,
            "",
            "p50",
            "p99",
            "direct",
            self.direct_p50_us,
            self.direct_p99_us,
            "through",
            self.through_p50_us,
            self.through_p99_us,
            "added",
            self.added_p50_us,
            self.added_p99_us
        )
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The test agent on its own pipes, spoken to directly (the baseline).
struct DirectAgent {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    session: Value,
    next_id: u64,
    _cwd: tempfile::TempDir,
}

impl DirectAgent {
    /// Spawn the agent, `initialize`, `session/new`.
    async fn start(agent: &Path) -> Result<DirectAgent, String> {
        let cwd = tempfile::tempdir().map_err(|e| e.to_string())?;
        let mut child = tokio::process::Command::new("node")
            .arg(agent)
            .current_dir(cwd.path())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("node {}: {e}", agent.display()))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
        let mut me = DirectAgent {
            child,
            stdin,
            lines,
            session: Value::Null,
            next_id: 1,
            _cwd: cwd,
        };
        me.call(
            "initialize",
            json!({"protocolVersion": 1, "clientCapabilities": {}}),
            |_| {},
        )
        .await?;
        let cwd = me._cwd.path().to_owned();
        let s = me
            .call("session/new", json!({"cwd": cwd, "mcpServers": []}), |_| {})
            .await?;
        me.session = s["result"]["sessionId"].clone();
        Ok(me)
    }

    /// One request; `each` sees every line until its answer.
    async fn call(
        &mut self,
        method: &str,
        params: Value,
        mut each: impl FnMut(&str),
    ) -> Result<Value, String> {
        let id = self.next_id;
        self.next_id += 1;
        let mut s =
            json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string();
        s.push('\n');
        self.stdin
            .write_all(s.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        loop {
            let line = tokio::time::timeout(Duration::from_secs(120), self.lines.next_line())
                .await
                .map_err(|_| "the agent went quiet".to_owned())?
                .map_err(|e| e.to_string())?
                .ok_or("the agent closed stdout")?;
            each(&line);
            if line.contains("\"id\"") && !line.contains("\"method\"") {
                let v: Value = serde_json::from_str(&line).map_err(|e| e.to_string())?;
                if v["id"] == id {
                    return Ok(v);
                }
            }
        }
    }

    /// Prompt; `each` sees every line of the turn.
    async fn prompt(&mut self, text: &str, each: impl FnMut(&str)) -> Result<(), String> {
        let params = json!({"sessionId": self.session, "prompt": [{"type": "text", "text": text}]});
        self.call("session/prompt", params, each).await.map(|_| ())
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

async fn direct(agent: &Path, chunks: u64) -> Result<f64, String> {
    let mut a = DirectAgent::start(agent).await?;
    let t = Instant::now();
    let mut seen = 0u64;
    a.prompt(&format!("many {chunks}"), |l| {
        if l.contains("agent_message_chunk") {
            seen += 1;
        }
    })
    .await?;
    let elapsed = t.elapsed();
    a.stop().await;
    if seen != chunks {
        return Err(format!("direct: {seen} chunks of {chunks}"));
    }
    Ok(chunks as f64 / elapsed.as_secs_f64())
}

/// The monotonic clock in ns: the clock the test agent stamps its
/// `paced` chunks with (node's `process.hrtime` is CLOCK_MONOTONIC).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the local timespec only.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The numbers after each `marker` in `text`, in order (`"at T"` stamps,
/// `"chunk N"` indexes): a delta may carry several chunks.
fn numbers_after<'a>(text: &'a str, marker: &'a str) -> impl Iterator<Item = u64> + 'a {
    text.split(marker).skip(1).filter_map(|rest| {
        let end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        rest[..end].parse().ok()
    })
}

/// The age in µs of every chunk "at T" found in `text` (a line or a delta).
fn ages_us(text: &str, now: u64) -> impl Iterator<Item = f64> + '_ {
    numbers_after(text, "at ").map(move |stamp| now.saturating_sub(stamp) as f64 / 1_000.0)
}

/// Latency of each `paced` chunk, agent write → this reader, read directly.
async fn direct_latency(agent: &Path, chunks: u64, gap_ms: u64) -> Result<Vec<f64>, String> {
    let mut a = DirectAgent::start(agent).await?;
    let mut ages = Vec::new();
    a.prompt(&format!("paced {chunks} {gap_ms}"), |l| {
        let now = monotonic_ns();
        if l.contains("agent_message_chunk") {
            ages.extend(ages_us(l, now));
        }
    })
    .await?;
    a.stop().await;
    if ages.len() as u64 != chunks {
        return Err(format!("direct: {} paced chunks of {chunks}", ages.len()));
    }
    Ok(ages)
}

/// Read one turn's SSE stream until `session.status_idle`; `each` sees
/// every event's data, with the time it was read.
async fn read_turn(
    events: reqwest::Response,
    mut each: impl FnMut(&str, u64),
) -> Result<(), String> {
    let mut reader = SseReader::new(16 << 20);
    let mut stream = events.bytes_stream();
    let deadline = Instant::now() + Duration::from_secs(300);
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(60), stream.next())
        .await
        .map_err(|_| "the event stream went quiet".to_owned())?
    {
        let chunk = chunk.map_err(|e| e.to_string())?;
        let now = monotonic_ns();
        for data in reader.feed(&chunk).map_err(|_| "event too large")? {
            if data.contains("session.status_idle") {
                return Ok(());
            }
            each(&data, now);
        }
        if Instant::now() > deadline {
            return Err("the turn did not end in 300 s".into());
        }
    }
    Err("the event stream ended before the turn".into())
}

/// An in-process harness and executor with the test agent, and a session's
/// SSE stream open from its start.
async fn through_session(agent: &Path) -> Result<(Local, String, reqwest::Response), String> {
    let local = Local::start(|config| {
        config.agents = vec![(
            "test".into(),
            vec!["node".into(), agent.to_string_lossy().into_owned()],
        )];
    })
    .await?;
    let session = local.session(&json!({})).await?;
    let events = local
        .http
        .get(local.url(&format!("/v1/sessions/{session}/events?after=0")))
        .header("authorization", local.auth())
        .header("accept", "text/event-stream")
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !events.status().is_success() {
        return Err(format!("events: HTTP {}", events.status()));
    }
    Ok((local, session, events))
}

/// A delta: `session.event_delta` relayed as SSE (it has an `index`).
fn is_delta(data: &str) -> bool {
    data.contains("\"eventType\"") && data.contains("\"index\"")
}

async fn through(agent: &Path, chunks: u64) -> Result<(f64, u64), String> {
    let (local, session, events) = through_session(agent).await?;
    let t = Instant::now();
    local
        .post(
            &format!("/v1/sessions/{session}/turns"),
            &json!({"input": format!("many {chunks}")}),
        )
        .await?;
    // Chunks that reach the executor together travel as one delta: count
    // the chunks in the deltas' text, and check they came in order, each
    // once ("chunk N" is the agent's index).
    let (mut next, mut disorder, mut deltas) = (0u64, None, 0u64);
    read_turn(events, |data, _| {
        if is_delta(data) {
            deltas += 1;
            for n in numbers_after(data, "chunk ") {
                if n != next && disorder.is_none() {
                    disorder = Some((next, n));
                }
                next = n + 1;
            }
        }
    })
    .await?;
    let elapsed = t.elapsed();
    local.shutdown().await;
    if let Some((want, got)) = disorder {
        return Err(format!("through: chunk {got} where {want} was due"));
    }
    if next != chunks {
        return Err(format!("through: {next} chunks of {chunks}"));
    }
    Ok((chunks as f64 / elapsed.as_secs_f64(), deltas))
}

/// Latency of each `paced` chunk, agent write → SSE client.
async fn through_latency(agent: &Path, chunks: u64, gap_ms: u64) -> Result<Vec<f64>, String> {
    let (local, session, events) = through_session(agent).await?;
    local
        .post(
            &format!("/v1/sessions/{session}/turns"),
            &json!({"input": format!("paced {chunks} {gap_ms}")}),
        )
        .await?;
    let mut ages = Vec::new();
    read_turn(events, |data, now| {
        if is_delta(data) {
            ages.extend(ages_us(data, now));
        }
    })
    .await?;
    local.shutdown().await;
    if ages.len() as u64 != chunks {
        return Err(format!("through: {} paced chunks of {chunks}", ages.len()));
    }
    Ok(ages)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub async fn run(opts: &TurnsOptions) -> Result<TurnsReport, String> {
    let agent = std::fs::canonicalize(&opts.agent).map_err(|e| {
        format!(
            "{}: {e} (install the test peers: scripts/test.sh, or npm ci in tests/peers)",
            opts.agent.display()
        )
    })?;
    let (mut d, mut t) = (Vec::new(), Vec::new());
    let (mut dl, mut tl) = (Vec::new(), Vec::new());
    for _ in 0..opts.runs.max(1) {
        d.push(direct(&agent, opts.chunks).await?);
        t.push(through(&agent, opts.chunks).await?);
        dl.extend(direct_latency(&agent, opts.paced, opts.gap_ms).await?);
        tl.extend(through_latency(&agent, opts.paced, opts.gap_ms).await?);
    }
    dl.sort_by(|a, b| a.total_cmp(b));
    tl.sort_by(|a, b| a.total_cmp(b));
    let direct = median(d);
    t.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (through, through_deltas) = t[t.len() / 2];
    Ok(TurnsReport {
        chunks: opts.chunks,
        runs: opts.runs.max(1),
        direct_chunks_per_s: direct,
        through_chunks_per_s: through,
        through_deltas,
        ratio: through / direct,
        paced: opts.paced,
        gap_ms: opts.gap_ms,
        direct_p50_us: percentile(&dl, 0.50),
        direct_p99_us: percentile(&dl, 0.99),
        through_p50_us: percentile(&tl, 0.50),
        through_p99_us: percentile(&tl, 0.99),
        added_p50_us: percentile(&tl, 0.50) - percentile(&dl, 0.50),
        added_p99_us: percentile(&tl, 0.99) - percentile(&dl, 0.99),
    })
}

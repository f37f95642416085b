//! `bmx bench turns`: agent events per second from the agent to an SSE
//! client through executor and harness, against the same agent's ACP
//! stream read directly, in the same run.
//!
//! * `direct`: the bench spawns the offline test agent (tests/peers) and
//!   speaks ACP on its pipes: `initialize`, `session/new`, then `session/
//!   prompt "many N"`; it counts the N `agent_message_chunk` updates;
//! * `through`: an in-process harness and executor on loopback with the
//!   same agent; the bench reads `GET /v1/sessions/{id}/events` (SSE) and
//!   counts the N deltas (`session.event_delta`, one per chunk) until the
//!   turn's `session.status_idle`.
//!
//! The figure is chunks per second end to end; the ratio is through/direct.

use super::local::Local;
use bmx::executor::mcp::sse::SseReader;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

#[derive(Debug, Clone)]
pub struct TurnsOptions {
    /// The agent script (default: tests/peers' test agent, run with node).
    pub agent: PathBuf,
    pub chunks: u64,
    pub runs: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct TurnsReport {
    pub chunks: u64,
    pub runs: usize,
    pub direct_chunks_per_s: f64,
    pub through_chunks_per_s: f64,
    /// through / direct (the target: at least 0.5).
    pub ratio: f64,
}

impl TurnsReport {
    pub fn table(&self) -> String {
        format!(
            "agent chunks, {} per turn, median of {} runs\n{:>16} {:>16} {:>8}\n{:>16.0} {:>16.0} {:>8.2}\n",
            self.chunks,
            self.runs,
            "direct/s",
            "through/s",
            "ratio",
            self.direct_chunks_per_s,
            self.through_chunks_per_s,
            self.ratio
        )
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

async fn direct(agent: &std::path::Path, chunks: u64) -> Result<f64, String> {
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
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    let mut send = async |v: Value| -> Result<(), String> {
        let mut s = v.to_string();
        s.push('\n');
        stdin
            .write_all(s.as_bytes())
            .await
            .map_err(|e| e.to_string())
    };
    async fn answer(
        lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
        id: u64,
        mut each: impl FnMut(&str),
    ) -> Result<Value, String> {
        loop {
            let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
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
    send(json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": 1, "clientCapabilities": {}}}))
    .await?;
    answer(&mut lines, 1, |_| {}).await?;
    send(json!({"jsonrpc": "2.0", "id": 2, "method": "session/new",
        "params": {"cwd": cwd.path(), "mcpServers": []}}))
    .await?;
    let s = answer(&mut lines, 2, |_| {}).await?;
    let session = s["result"]["sessionId"].clone();
    let t = Instant::now();
    send(json!({"jsonrpc": "2.0", "id": 3, "method": "session/prompt",
        "params": {"sessionId": session, "prompt": [{"type": "text", "text": format!("many {chunks}")}]}}))
    .await?;
    let mut seen = 0u64;
    answer(&mut lines, 3, |l| {
        if l.contains("agent_message_chunk") {
            seen += 1;
        }
    })
    .await?;
    let elapsed = t.elapsed();
    if seen != chunks {
        return Err(format!("direct: {seen} chunks of {chunks}"));
    }
    let _ = child.kill().await;
    Ok(chunks as f64 / elapsed.as_secs_f64())
}

async fn through(agent: &std::path::Path, chunks: u64) -> Result<f64, String> {
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
    let t = Instant::now();
    local
        .post(
            &format!("/v1/sessions/{session}/turns"),
            &json!({"input": format!("many {chunks}")}),
        )
        .await?;
    let mut reader = SseReader::new(16 << 20);
    let mut stream = events.bytes_stream();
    let mut deltas = 0u64;
    let deadline = Instant::now() + Duration::from_secs(300);
    'read: while let Some(chunk) = tokio::time::timeout(Duration::from_secs(60), stream.next())
        .await
        .map_err(|_| "the event stream went quiet".to_owned())?
    {
        let chunk = chunk.map_err(|e| e.to_string())?;
        for data in reader.feed(&chunk).map_err(|_| "event too large")? {
            if data.contains("\"eventType\"") && data.contains("\"index\"") {
                deltas += 1;
            } else if data.contains("session.status_idle") {
                break 'read;
            }
        }
        if Instant::now() > deadline {
            return Err("the turn did not end in 300 s".into());
        }
    }
    let elapsed = t.elapsed();
    local.shutdown().await;
    if deltas != chunks {
        return Err(format!("through: {deltas} deltas of {chunks} chunks"));
    }
    Ok(chunks as f64 / elapsed.as_secs_f64())
}

pub async fn run(opts: &TurnsOptions) -> Result<TurnsReport, String> {
    let agent = std::fs::canonicalize(&opts.agent).map_err(|e| {
        format!(
            "{}: {e} (install the test peers: scripts/test.sh, or npm ci in tests/peers)",
            opts.agent.display()
        )
    })?;
    let (mut d, mut t) = (Vec::new(), Vec::new());
    for _ in 0..opts.runs.max(1) {
        d.push(direct(&agent, opts.chunks).await?);
        t.push(through(&agent, opts.chunks).await?);
    }
    let (direct, through) = (median(d), median(t));
    Ok(TurnsReport {
        chunks: opts.chunks,
        runs: opts.runs.max(1),
        direct_chunks_per_s: direct,
        through_chunks_per_s: through,
        ratio: through / direct,
    })
}

//! `bmx bench visor`: a real `bmx visor` (this binary, on a temporary
//! home) against the plain tools a person would otherwise use, in one run.
//!
//! * **Output**: a PTY session runs the benchmarks' producer (N bytes of
//!   letters: no newline, so the PTY passes them through as they are);
//!   1 and then 10 clients attached over the socket count the output
//!   frames' bytes until the `ended` frame. Baseline: the same producer
//!   under `script -qc`, read from a pipe to its end. The figure is MB/s
//!   for the slowest client; the ratio is against `script`. The PTY never
//!   waits for a client: one more than the 1 MiB scrollback behind gets a
//!   snapshot instead of the bytes it missed, so the share of bytes
//!   delivered and the resyncs are reported beside the rate.
//! * **Event fan-out**: the retained events (from the sessions this bench
//!   started) replayed to 1 client, then to 100 clients at once, each read
//!   to the last `seq`: events/s delivered in total.
//! * **Memory**: the visor's RSS before and after 50 idle PTY sessions
//!   (`cat` waiting on its terminal, each with its screen model and
//!   scrollback), per session; beside it the RSS of one `script -qc cat`,
//!   the process a plain terminal session would keep instead.

use super::buffering::{drain_pipe, producer};
use bmx::terminal::frame::{OP_OUTPUT, OP_SNAPSHOT};
use bmx::visor::client::{self, Ws};
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;

/// Every wait of this bench.
const WAIT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone)]
pub struct VisorOptions {
    pub bytes: u64,
    pub runs: usize,
    pub idle_sessions: usize,
    pub subscribers: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct VisorReport {
    pub bytes: u64,
    pub runs: usize,
    pub script_mbps: f64,
    pub one_client_mbps: f64,
    pub ten_clients_mbps: f64,
    /// one client / script (the target: at least 0.9).
    pub one_client_ratio: f64,
    pub ten_clients_ratio: f64,
    /// Share of the output bytes that reached the clients (median run;
    /// below 1.0 a client fell more than the 1 MiB scrollback behind and
    /// was resynchronised with a snapshot), and the resyncs of that run.
    pub one_client_delivered: f64,
    pub one_client_resyncs: u64,
    pub ten_clients_delivered: f64,
    pub ten_clients_resyncs: u64,
    pub events: u64,
    pub one_subscriber_events_per_s: f64,
    pub subscribers: usize,
    /// Deliveries per second, all subscribers together.
    pub fan_out_events_per_s: f64,
    pub idle_sessions: usize,
    pub rss_per_idle_session_kib: f64,
    pub script_rss_kib: f64,
}

impl VisorReport {
    pub fn table(&self) -> String {
        format!(
            "PTY output, {} MiB, median of {} runs\n{:>14} {:>10} {:>10} {:>10} {:>8}\n{:>14} {:>10.0} {:>10} {:>10} {:>8}\n{:>14} {:>10.0} {:>10.2} {:>10.3} {:>8}\n{:>14} {:>10.0} {:>10.2} {:>10.3} {:>8}\n\
             event fan-out, {} events replayed\n{:>14} {:>14.0} events/s\n{:>14} {:>14.0} deliveries/s\n\
             memory\n{:>14} {:>10.0} KiB per idle PTY session ({} sessions)\n{:>14} {:>10.0} KiB (one `script -qc cat`)\n",
            self.bytes >> 20,
            self.runs,
            "",
            "MB/s",
            "ratio",
            "delivered",
            "resyncs",
            "script",
            self.script_mbps,
            "",
            "",
            "",
            "1 client",
            self.one_client_mbps,
            self.one_client_ratio,
            self.one_client_delivered,
            self.one_client_resyncs,
            "10 clients",
            self.ten_clients_mbps,
            self.ten_clients_ratio,
            self.ten_clients_delivered,
            self.ten_clients_resyncs,
            self.events,
            "1 client",
            self.one_subscriber_events_per_s,
            format!("{} clients", self.subscribers),
            self.fan_out_events_per_s,
            "visor",
            self.rss_per_idle_session_kib,
            self.idle_sessions,
            "baseline",
            self.script_rss_kib,
        )
    }
}

/// The visor under test: a child process on a temporary home, SIGTERMed
/// (then killed) on drop.
struct Daemon {
    child: std::process::Child,
    socket: PathBuf,
    _home: tempfile::TempDir,
}

impl Daemon {
    async fn start() -> Result<Daemon, String> {
        let home = tempfile::tempdir().map_err(|e| e.to_string())?;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let child = std::process::Command::new(exe)
            .args(["visor", "--home"])
            .arg(home.path())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("bmx visor: {e}"))?;
        let d = Daemon {
            child,
            socket: home.path().join("visor.sock"),
            _home: home,
        };
        let deadline = Instant::now() + WAIT;
        while client::request(&d.socket, "GET", "/v1/info", None)
            .await
            .is_err()
        {
            if Instant::now() > deadline {
                return Err("the visor did not come up".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(d)
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        client::request(&self.socket, method, path, body.as_ref())
            .await
            .map_err(|e| format!("{method} {path}: {e}"))
    }

    async fn start_pty(&self, command: &[String]) -> Result<String, String> {
        let v = self
            .call(
                "POST",
                "/v1/sessions",
                Some(
                    json!({"kind": "pty", "command": command, "workingDir": std::env::temp_dir()}),
                ),
            )
            .await?;
        v["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("no session id in {v}"))
    }

    async fn attach(&self, id: &str) -> Result<Ws, String> {
        client::websocket(&self.socket, &format!("/v1/sessions/{id}/attach"))
            .await
            .map_err(|e| e.to_string())
    }

    fn rss_kib(&self) -> Result<f64, String> {
        rss_kib(self.child.id())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// VmRSS of `pid`, in KiB.
fn rss_kib(pid: u32) -> Result<f64, String> {
    super::rss_kib(&pid.to_string())
        .map(|kib| kib as f64)
        .ok_or_else(|| format!("no VmRSS for pid {pid}"))
}

/// Read an attach stream until `ended`: output bytes (op 1 frames) and
/// snapshots after the first (a client more than the scrollback behind is
/// resynchronised with a snapshot: the PTY never waits for a client).
async fn drain_attach(mut ws: Ws) -> Result<(u64, u64), String> {
    let (mut bytes, mut snapshots) = (0u64, 0u64);
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, ws.next()).await {
            Err(_) => return Err("the attach stream went quiet".into()),
            Ok(Some(Ok(Message::Binary(b)))) if b.len() >= 9 && b[0] == OP_OUTPUT => {
                bytes += (b.len() - 9) as u64
            }
            Ok(Some(Ok(Message::Binary(b)))) if b.first() == Some(&OP_SNAPSHOT) => snapshots += 1,
            Ok(Some(Ok(Message::Text(t)))) => {
                let v: Value = serde_json::from_str(&t).unwrap_or(Value::Null);
                if v["type"] == "ended" {
                    // The attach's own first snapshot is not a resync.
                    return Ok((bytes, snapshots.saturating_sub(1)));
                }
            }
            Ok(Some(Ok(_))) => {}
            Ok(None) | Ok(Some(Err(_))) => return Err("the attach stream closed".into()),
        }
    }
}

/// One run's figures for `clients` attached clients.
#[derive(Debug, Clone, Copy)]
struct Through {
    /// Bytes produced / time until the slowest client saw the end.
    mbps: f64,
    /// Output bytes the clients got, over what they would have with no
    /// resync (1.0: every byte reached every client).
    delivered: f64,
    resyncs: u64,
}

/// One run: the producer on a PTY session, `clients` attached, from the
/// moment the producer is let go until every client saw the end.
async fn through_visor(d: &Daemon, bytes: u64, clients: usize) -> Result<Through, String> {
    let mut command = vec!["sh".to_owned(), "-c".into()];
    // Held until the clients are attached: nothing is produced unseen.
    command.push(format!("read go; exec {}", producer(bytes)?.join(" ")));
    let id = d.start_pty(&command).await?;
    let mut streams = Vec::with_capacity(clients);
    for _ in 0..clients {
        streams.push(d.attach(&id).await?);
    }
    let started = Instant::now();
    let readers: Vec<_> = streams
        .into_iter()
        .map(|ws| tokio::spawn(drain_attach(ws)))
        .collect();
    d.call(
        "POST",
        &format!("/v1/sessions/{id}/keys"),
        Some(json!({"data": "Cg=="})),
    )
    .await?;
    let (mut got, mut resyncs) = (0u64, 0u64);
    for r in readers {
        let (b, s) = r.await.map_err(|e| e.to_string())??;
        got += b.min(bytes);
        resyncs += s;
    }
    let took = started.elapsed();
    let _ = d
        .call("POST", "/v1/purge", Some(json!({"session": id})))
        .await;
    Ok(Through {
        mbps: bytes as f64 / took.as_secs_f64() / 1e6,
        delivered: got as f64 / (bytes as f64 * clients as f64),
        resyncs,
    })
}

/// Subscribe `n` clients from `after=0` at once; events/s delivered until
/// each has seen `last`.
async fn fan_out(d: &Daemon, n: usize, last: u64) -> Result<f64, String> {
    let mut streams = Vec::with_capacity(n);
    for _ in 0..n {
        streams.push(
            client::websocket(&d.socket, "/v1/events?after=0")
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    let started = Instant::now();
    let readers: Vec<_> = streams
        .into_iter()
        .map(|mut ws| {
            tokio::spawn(async move {
                let deadline = Instant::now() + WAIT;
                let mut seen = 0u64;
                loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match tokio::time::timeout(left, ws.next()).await {
                        Ok(Some(Ok(Message::Text(t)))) => {
                            let v: Value = serde_json::from_str(&t).unwrap_or(Value::Null);
                            if let Some(seq) = v["seq"].as_u64() {
                                seen += 1;
                                if seq >= last {
                                    let _ = ws.close(None).await;
                                    return Ok(seen);
                                }
                            }
                        }
                        Ok(Some(Ok(_))) => {}
                        _ => return Err(format!("a subscriber stopped at {seen} events")),
                    }
                }
            })
        })
        .collect();
    let mut delivered = 0u64;
    for r in readers {
        delivered += r.await.map_err(|e| e.to_string())??;
    }
    Ok(delivered as f64 / started.elapsed().as_secs_f64())
}

/// The highest `seq` so far: a subscriber from 0 that reads until quiet.
async fn last_seq(d: &Daemon) -> Result<u64, String> {
    let mut ws = client::websocket(&d.socket, "/v1/events?after=0")
        .await
        .map_err(|e| e.to_string())?;
    let mut last = 0;
    while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_millis(500), ws.next()).await {
        if let Message::Text(t) = m {
            let v: Value = serde_json::from_str(&t).unwrap_or(Value::Null);
            last = v["seq"].as_u64().unwrap_or(last).max(last);
        }
    }
    Ok(last)
}

async fn wait_running(d: &Daemon, id: &str) -> Result<(), String> {
    let deadline = Instant::now() + WAIT;
    loop {
        let v = d.call("GET", &format!("/v1/sessions/{id}"), None).await?;
        if v["state"] == "running" {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("session {id} is {}", v["state"]));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// RSS of a plain `script -qc cat` held open: what a person's own
/// terminal session would keep instead of a visor session.
async fn script_rss() -> Result<f64, String> {
    let mut child = tokio::process::Command::new("script")
        .args(["-qc", "cat", "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("script: {e}"))?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = child.id().ok_or("script exited")?;
    let rss = rss_kib(pid);
    let _ = child.kill().await;
    rss
}

/// The run with the median rate.
fn median_run(mut v: Vec<Through>) -> Through {
    v.sort_by(|a, b| a.mbps.total_cmp(&b.mbps));
    v[v.len() / 2]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub async fn run(opts: &VisorOptions) -> Result<VisorReport, String> {
    let d = Daemon::start().await?;
    let runs = opts.runs.max(1);
    let script = vec![
        "script".to_owned(),
        "-qc".into(),
        producer(opts.bytes)?.join(" "),
        "/dev/null".into(),
    ];
    let (mut base, mut one, mut ten) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        let (n, took) = drain_pipe(&script).await?;
        if n < opts.bytes {
            return Err(format!("script: {n} of {} bytes", opts.bytes));
        }
        base.push(n as f64 / took.as_secs_f64() / 1e6);
        one.push(through_visor(&d, opts.bytes, 1).await?);
        ten.push(through_visor(&d, opts.bytes, 10).await?);
    }
    // Memory: idle sessions, with their screen model and scrollback.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = d.rss_kib()?;
    let mut idle = Vec::new();
    for _ in 0..opts.idle_sessions {
        let id = d.start_pty(&["cat".to_owned()]).await?;
        wait_running(&d, &id).await?;
        idle.push(id);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = d.rss_kib()?;
    let script_rss_kib = script_rss().await?;
    for id in &idle {
        let _ = d
            .call("POST", &format!("/v1/sessions/{id}/stop"), None)
            .await;
    }
    // Fan-out: replay everything retained so far.
    let last = last_seq(&d).await?;
    let one_sub = fan_out(&d, 1, last).await?;
    let many = fan_out(&d, opts.subscribers.max(1), last).await?;
    let base = median(base);
    let (one, ten) = (median_run(one), median_run(ten));
    Ok(VisorReport {
        bytes: opts.bytes,
        runs,
        script_mbps: base,
        one_client_mbps: one.mbps,
        ten_clients_mbps: ten.mbps,
        one_client_ratio: one.mbps / base,
        ten_clients_ratio: ten.mbps / base,
        one_client_delivered: one.delivered,
        one_client_resyncs: one.resyncs,
        ten_clients_delivered: ten.delivered,
        ten_clients_resyncs: ten.resyncs,
        events: last,
        one_subscriber_events_per_s: one_sub,
        subscribers: opts.subscribers.max(1),
        fan_out_events_per_s: many,
        idle_sessions: opts.idle_sessions,
        rss_per_idle_session_kib: (after - before) / opts.idle_sessions.max(1) as f64,
        script_rss_kib,
    })
}

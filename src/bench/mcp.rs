//! `bmx bench mcp`: `tools/call` of `echo` through harness → executor →
//! stdio server, against the same call made directly to the same server
//! over its stdio in the same run.
//!
//! * `direct`: the bench spawns the server and speaks newline-delimited
//!   JSON-RPC on its pipes (the baseline: nothing between client and server);
//! * `proxied`: an in-process harness and executor on loopback; the bench
//!   is an HTTP client of the harness's Streamable HTTP endpoint
//!   (`/v1/sessions/{id}/mcp/{key}`), which carries each call over the
//!   executor's WebSocket (`mcp.frame`) to the server's stdio and back;
//! * `unix`: the same, with the client on the harness's API Unix socket
//!   (`--api-unix`) instead of loopback TCP;
//! * `http`: a bare HTTP server answering the echo itself, the floor of
//!   the one hop the proxied path has and the direct path has not.
//!
//! Each row runs `calls` calls with 1 and with 32 in flight and reports
//! latency p50/p99 and calls per second; the ratios are proxied/direct.
//! Both clients run on a thread and runtime of their own, off the
//! harness's workers; beside the latencies, each row reports the CPU and
//! the context switches per call that explain them.

use super::http1;
use super::local::Local;
use bmx::executor::mcp::sse::SseReader;
use bytes::Bytes;
use http::header::HeaderValue;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;

#[derive(Debug, Clone)]
pub struct McpOptions {
    /// The stdio MCP server (default: tests/peers' server-everything).
    pub command: PathBuf,
    pub calls: usize,
    pub concurrency: Vec<usize>,
    /// Calls on each path before the rows, [`WARMUP_IN_FLIGHT`] at a time.
    pub warmup: usize,
}

/// Requests in flight during the warm-up.
const WARMUP_IN_FLIGHT: usize = 32;

/// Below this many sleeps of the direct server per call at one in flight,
/// most calls found the server awake and the baseline's p50 is most
/// likely its fast mode's: the table says so. Measured on the first VM: a direct p50 of
/// 49-54 us with 0.00-0.36 sleeps a call, 96-100 us with 0.69-0.91; on a
/// second, 56-71 us under it in 14 runs of 15 (docs/benchmarks.md).
const FAST_BASELINE_SLEEPS: f64 = 0.5;

#[derive(Debug, Clone, Default, Serialize)]
pub struct Row {
    pub in_flight: usize,
    pub direct_p50_us: f64,
    pub direct_p99_us: f64,
    pub direct_calls_per_s: f64,
    pub proxied_p50_us: f64,
    pub proxied_p99_us: f64,
    pub proxied_calls_per_s: f64,
    /// The harness's share alone: p50 of a client notification POSTed to
    /// the same endpoint and answered 202 by the channel actor without
    /// reaching the executor (HTTP round trip + one actor hop).
    pub harness_only_p50_us: f64,
    /// The loopback HTTP hop alone: p50 and calls/s of the same POST to a
    /// bare hyper server on the harness's runtime that answers the echo
    /// itself (no routing, no auth, no actor, no executor, no server).
    /// The direct path has no such hop; the proxied one cannot avoid it.
    pub http_floor_p50_us: f64,
    pub http_floor_calls_per_s: f64,
    /// The proxied path with the client on the harness's API Unix socket
    /// (`--api-unix`) instead of loopback TCP: p50, calls/s, and p50 over
    /// the direct p50.
    pub unix_p50_us: f64,
    pub unix_calls_per_s: f64,
    pub unix_p50_ratio: f64,
    /// CPU of this process (the client thread; and, proxied, the harness
    /// and the executor) per call, in µs.
    pub direct_bmx_cpu_us: f64,
    pub proxied_bmx_cpu_us: f64,
    /// The client thread's share of the above: what a separate client
    /// process would spend, not bmx's cost.
    pub direct_client_cpu_us: f64,
    pub proxied_client_cpu_us: f64,
    /// CPU of the row's server (node) per call, in µs: the bench's own
    /// child (direct) and the executor's (proxied).
    pub direct_server_cpu_us: f64,
    pub proxied_server_cpu_us: f64,
    /// Context switches of this process's threads per call: how often a
    /// thread slept and was woken. At one in flight each is a wake-up of
    /// an idle thread, which on a VM costs tens of µs of latency and CPU
    /// (docs/benchmarks.md).
    pub direct_switches: f64,
    pub proxied_switches: f64,
    /// Times per call the server's main thread went to sleep (node's
    /// voluntary context switches): about 1 when each request found it
    /// asleep, about 0 when the request was already there as it finished
    /// the last reply. The direct baseline is in its fast mode when the
    /// server hardly sleeps (docs/benchmarks.md, "Where one call's time
    /// goes at one in flight"); which CPUs client and server ran on did
    /// not tell the modes apart ("HTTP/2 tried, and everything on one CPU").
    pub direct_server_sleeps: f64,
    pub proxied_server_sleeps: f64,
    /// proxied p50 / direct p50 (the issue's target: at most 3, "adds at
    /// most 2× the direct latency").
    pub p50_ratio: f64,
    /// direct calls/s / proxied calls/s.
    pub throughput_ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct McpReport {
    pub calls: usize,
    pub warmup: usize,
    /// Worker threads of the runtime the harness and executor ran on
    /// (`--worker-threads`; by default one per CPU).
    pub workers: usize,
    /// The CPU idle driver (and the KVM guest's halt-polling window): on a
    /// VM it decides what a wake-up costs (docs/benchmarks.md).
    pub cpuidle: Option<String>,
    pub rows: Vec<Row>,
}

impl McpReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "tools/call echo, {} calls per row after {} on each path; harness and executor on {} worker thread(s); cpuidle: {}\n{:>9} {:>12} {:>12} {:>10} {:>12} {:>12} {:>10} {:>9} {:>9} {:>12} {:>10} {:>9} {:>10} {:>9} {:>7}\n",
            self.calls, self.warmup, self.workers, self.cpuidle.as_deref().unwrap_or("unknown"), "in_flight", "direct_p50", "direct_p99", "direct/s", "proxy_p50", "proxy_p99",
            "proxy/s", "p50_x", "tput_x", "harness_p50", "http_p50", "http/s", "unix_p50", "unix/s", "unix_x"
        );
        for r in &self.rows {
            s.push_str(&format!(
                "{:>9} {:>10.0}us {:>10.0}us {:>10.0} {:>10.0}us {:>10.0}us {:>10.0} {:>9.2} {:>9.2} {:>10.0}us {:>8.0}us {:>9.0} {:>8.0}us {:>9.0} {:>7.2}\n",
                r.in_flight,
                r.direct_p50_us,
                r.direct_p99_us,
                r.direct_calls_per_s,
                r.proxied_p50_us,
                r.proxied_p99_us,
                r.proxied_calls_per_s,
                r.p50_ratio,
                r.throughput_ratio,
                r.harness_only_p50_us,
                r.http_floor_p50_us,
                r.http_floor_calls_per_s,
                r.unix_p50_us,
                r.unix_calls_per_s,
                r.unix_p50_ratio
            ));
        }
        s.push_str("CPU per call: client thread + harness and executor + node\n");
        for r in &self.rows {
            s.push_str(&format!(
                "{:>9} direct {:.0}us + {:.0}us + {:.0}us, proxied {:.0}us + {:.0}us + {:.0}us; context switches of bmx per call: direct {:.2}, proxied {:.2}; node slept per call: direct {:.2}, proxied {:.2}\n",
                r.in_flight,
                r.direct_client_cpu_us,
                // Both in clock ticks: the difference can round below 0.
                (r.direct_bmx_cpu_us - r.direct_client_cpu_us).max(0.0),
                r.direct_server_cpu_us,
                r.proxied_client_cpu_us,
                (r.proxied_bmx_cpu_us - r.proxied_client_cpu_us).max(0.0),
                r.proxied_server_cpu_us,
                r.direct_switches,
                r.proxied_switches,
                r.direct_server_sleeps,
                r.proxied_server_sleeps
            ));
        }
        if self
            .rows
            .iter()
            .any(|r| r.in_flight == 1 && r.direct_server_sleeps < FAST_BASELINE_SLEEPS)
        {
            s.push_str(&format!(
                "note: at one in flight most direct calls found the server awake (under {FAST_BASELINE_SLEEPS} sleeps a call): \
                 the direct p50 is most likely the baseline's fast mode, in which calls hardly wake an idle CPU \
                 (docs/benchmarks.md, \"Where one call's time goes at one in flight\")\n"
            ));
        }
        if self
            .cpuidle
            .as_deref()
            .is_some_and(|c| c.ends_with("guest_halt_poll_ns=0"))
        {
            s.push_str(
                "note: this VM halts an idle CPU at once (guest_halt_poll_ns=0): each wake-up of one \
                 costs tens of us, and the proxied path has twice the direct path's \
                 (docs/benchmarks.md, \"Guest halt polling\")\n",
            );
        }
        s
    }
}

/// The call of the proxied clients. Written out rather than built as a
/// `serde_json::Value`: the client shares the two CPUs with what it
/// measures, and a `Value` is a map allocation per object.
fn echo(id: u64) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"echo","arguments":{{"message":"bench"}}}}}}"#
    )
}

/// The same request as [`echo`], built as the direct client has built it
/// in every measurement so far. The direct client is left as it was on
/// purpose: a cheaper one (this builder, and [`Answer`] for its reads)
/// fed node in smaller batches, and node got slower per call: in twelve
/// pairs its direct p50 at 32 in flight rose from 541 to 584 µs (median),
/// which would flatter the ratio (docs/benchmarks.md, "A cheaper client
/// for the proxied path").
fn echo_direct(id: u64) -> String {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": "echo", "arguments": {"message": "bench"}}})
    .to_string()
}

/// What the proxied clients read of an answer: its id and whether it has a
/// result. Typed, so that the rest of the message is skipped rather than
/// built into a `Value` (maps, strings) and dropped.
#[derive(serde::Deserialize)]
struct Answer<'a> {
    id: Option<u64>,
    #[serde(borrow)]
    result: Option<&'a serde_json::value::RawValue>,
}

impl Answer<'_> {
    /// The successful answer to `id`: a `result` that is an object.
    fn answers(&self, id: u64) -> bool {
        self.id == Some(id) && self.result.is_some_and(|r| r.get().starts_with('{'))
    }
}

struct Stats {
    p50: Duration,
    p99: Duration,
    per_s: f64,
}

fn stats(mut lat: Vec<Duration>, wall: Duration) -> Stats {
    lat.sort();
    let at = |q: f64| lat[((lat.len() as f64 - 1.0) * q).round() as usize];
    Stats {
        p50: at(0.50),
        p99: at(0.99),
        per_s: lat.len() as f64 / wall.as_secs_f64(),
    }
}

/// A client of one stdio server: a writer and a reader task that routes
/// answers by id.
struct Direct {
    child: tokio::process::Child,
    stdin: tokio::sync::Mutex<tokio::process::ChildStdin>,
    waiting: Arc<Mutex<HashMap<u64, oneshot::Sender<()>>>>,
}

impl Direct {
    async fn start(command: &std::path::Path) -> Result<Direct, String> {
        let mut child = tokio::process::Command::new(command)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("{}: {e}", command.display()))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let waiting: Arc<Mutex<HashMap<u64, oneshot::Sender<()>>>> = Default::default();
        let w = waiting.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                // A `Value`, as ever (see [`echo_direct`]).
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                if let Some(id) = v["id"].as_u64() {
                    if let Some(tx) = w.lock().ok().and_then(|mut m| m.remove(&id)) {
                        let _ = tx.send(());
                    }
                }
            }
        });
        let d = Direct {
            child,
            stdin: tokio::sync::Mutex::new(stdin),
            waiting,
        };
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "bmx-bench", "version": "1"}}})
        .to_string();
        d.call(0, init).await?;
        d.write(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#.into())
            .await?;
        Ok(d)
    }

    async fn write(&self, mut line: String) -> Result<(), String> {
        line.push('\n');
        self.stdin
            .lock()
            .await
            .write_all(line.as_bytes())
            .await
            .map_err(|e| e.to_string())
    }

    async fn call(&self, id: u64, msg: String) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        self.waiting
            .lock()
            .map_err(|e| e.to_string())?
            .insert(id, tx);
        self.write(msg).await?;
        tokio::time::timeout(Duration::from_secs(30), rx)
            .await
            .map_err(|_| format!("call {id}: no answer in 30 s"))?
            .map_err(|_| "server gone".to_owned())
    }
}

/// A client of the harness's MCP endpoint: HTTP/1.1 connections of the
/// bench's own ([`http1`]), one per call in flight, kept open.
///
/// Why neither `reqwest` nor hyper's client: the client shares the machine
/// (2 cores here) with the harness, the executor and two servers, and
/// what it spends per call is taken from the path it measures. With
/// `reqwest` (URL parsing, a pool, redirect and header handling, per
/// request) it was a fifth of all samples at 32 in flight; with hyper's
/// client connection (a task per connection, a channel to it and back)
/// 12 µs a call, three times the direct client's. This one parses the
/// URL once, writes the same request head each time, and reads the answer
/// in the calling task (docs/benchmarks.md, "A minimal HTTP client for the
/// bench").
struct Proxied {
    dial: Dial,
    path: String,
    /// `Bearer <api token>`.
    auth: String,
    session: String,
    /// Every header of a POST but its length, made once.
    head: String,
    idle: Mutex<Vec<http1::Conn>>,
}

/// Where the client connects.
#[derive(Debug, Clone, PartialEq)]
enum Dial {
    Tcp(std::net::SocketAddr),
    /// The harness's API Unix socket.
    Unix(PathBuf),
}

impl Dial {
    fn host(&self) -> String {
        match self {
            Dial::Tcp(a) => a.to_string(),
            Dial::Unix(_) => "localhost".into(),
        }
    }
}

impl Proxied {
    fn build(dial: Dial, path: String, auth: String, session: String) -> Proxied {
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nhost: {}\r\nauthorization: {auth}\r\n\
             content-type: application/json\r\naccept: application/json, text/event-stream\r\n",
            dial.host()
        );
        if !session.is_empty() {
            head.push_str(&format!(
                "mcp-session-id: {session}\r\nmcp-protocol-version: 2025-06-18\r\n"
            ));
        }
        Proxied {
            dial,
            path,
            auth,
            session,
            head,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// The same client (path, credential, client session) over `dial`.
    fn over(&self, dial: Dial) -> Proxied {
        Proxied::build(
            dial,
            self.path.clone(),
            self.auth.clone(),
            self.session.clone(),
        )
    }

    /// The same client in the client session `session`.
    fn in_session(&self, session: String) -> Proxied {
        Proxied::build(
            self.dial.clone(),
            self.path.clone(),
            self.auth.clone(),
            session,
        )
    }

    /// `call` of one shared client, as [`measure`] takes it.
    fn echo(
        self: &Arc<Self>,
    ) -> impl Fn(
        u64,
    )
        -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>
           + Clone
           + Send
           + 'static {
        let p = self.clone();
        move |id| {
            let p = p.clone();
            Box::pin(async move { p.call(id).await })
        }
    }

    fn new(url: &str, auth: &str) -> Result<Proxied, String> {
        let rest = url.strip_prefix("http://").ok_or("not an http:// url")?;
        let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let dial = Dial::Tcp(host.parse().map_err(|e| format!("{host}: {e}"))?);
        if auth.bytes().any(|b| b.is_ascii_control()) {
            return Err("a credential with a control character".into());
        }
        Ok(Proxied::build(
            dial,
            path.to_owned(),
            auth.to_owned(),
            String::new(),
        ))
    }

    /// An idle connection (`true`), or a new one.
    async fn connection(&self) -> Result<(http1::Conn, bool), String> {
        let idle = self.idle.lock().map_err(|e| e.to_string())?.pop();
        match idle {
            Some(c) => Ok((c, true)),
            None => Ok((self.connect().await?, false)),
        }
    }

    async fn connect(&self) -> Result<http1::Conn, String> {
        Ok(match &self.dial {
            Dial::Tcp(addr) => {
                let tcp = tokio::net::TcpStream::connect(addr)
                    .await
                    .map_err(|e| e.to_string())?;
                tcp.set_nodelay(true).map_err(|e| e.to_string())?;
                http1::Conn::new(tcp)
            }
            Dial::Unix(path) => {
                let unix = tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                http1::Conn::new(unix)
            }
        })
    }

    /// One POST of `body`, and its answer. The connection goes back to
    /// the idle ones when it can carry another. An idle connection the
    /// harness closed meanwhile (its keep-alive timeout) fails before any
    /// answer; then the request goes once more, on a new connection.
    async fn exchange(&self, body: &str) -> Result<http1::Reply, String> {
        let mut request = String::with_capacity(self.head.len() + 24 + body.len());
        request.push_str(&self.head);
        // Writing to a `String` cannot fail.
        let _ = write!(request, "content-length: {}\r\n\r\n{body}", body.len());
        let (mut conn, reused) = self.connection().await?;
        let reply = match conn.exchange(request.as_bytes()).await {
            Err(_) if reused && conn.unanswered() => {
                let mut fresh = self.connect().await?;
                let reply = fresh.exchange(request.as_bytes()).await;
                conn = fresh;
                reply?
            }
            other => other?,
        };
        if conn.reusable() {
            self.idle.lock().map_err(|e| e.to_string())?.push(conn);
        }
        Ok(reply)
    }

    async fn post(&self, body: String) -> Result<(http1::Reply, Vec<Value>), String> {
        let reply = self.exchange(&body).await?;
        if !(200..300).contains(&reply.status) {
            return Err(format!(
                "HTTP {}: {}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            ));
        }
        let messages = if reply.is_sse() {
            SseReader::new(16 << 20)
                .feed(&reply.body)
                .map_err(|_| "event too large".to_owned())?
                .iter()
                .filter_map(|e| serde_json::from_str(e).ok())
                .collect()
        } else if reply.body.is_empty() {
            Vec::new()
        } else {
            vec![serde_json::from_slice(&reply.body).map_err(|e| e.to_string())?]
        };
        Ok((reply, messages))
    }

    /// A notification the harness answers 202 itself: the cancellation
    /// of a request that is not in flight (nothing goes to the executor).
    async fn harness_only(&self, id: u64) -> Result<(), String> {
        let body = json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": id, "reason": "bench"}})
        .to_string();
        let (_, messages) = self.post(body).await?;
        if messages.is_empty() {
            Ok(())
        } else {
            Err(format!("cancel {id}: {messages:?}"))
        }
    }

    /// One `echo` call. It must be answered with JSON, as the harness
    /// does when the client accepts JSON and asks for no progress: any
    /// other answer (an SSE stream, an HTTP error, another id, a JSON-RPC
    /// error) fails the call.
    async fn call(&self, id: u64) -> Result<(), String> {
        let reply = self.exchange(&echo(id)).await?;
        if reply.status == 200 && reply.is_json() {
            if let Ok(answer) = serde_json::from_slice::<Answer>(&reply.body) {
                if answer.answers(id) {
                    return Ok(());
                }
            }
        }
        Err(format!(
            "call {id}: HTTP {}: {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        ))
    }
}

async fn measure<F, Fut>(calls: usize, in_flight: usize, call: F) -> Result<Stats, String>
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), String>> + Send,
{
    let next = Arc::new(std::sync::atomic::AtomicU64::new(1_000));
    let wall = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let per = calls.div_ceil(in_flight);
    for _ in 0..in_flight {
        let (call, next) = (call.clone(), next.clone());
        tasks.spawn(async move {
            let mut lat = Vec::with_capacity(per);
            for _ in 0..per {
                let id = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let t = Instant::now();
                call(id).await?;
                lat.push(t.elapsed());
            }
            Ok::<_, String>(lat)
        });
    }
    let mut all = Vec::with_capacity(calls);
    while let Some(r) = tasks.join_next().await {
        all.extend(r.map_err(|e| e.to_string())??);
    }
    Ok(stats(all, wall.elapsed()))
}

/// A bare HTTP/1.1 server on loopback that answers every POST with the
/// `echo` tool's result for the request's id: the floor of any HTTP hop
/// on this machine, measured by the same client as the proxied path.
/// It runs on this runtime, as the harness does.
async fn http_floor() -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>), String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let task = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = tcp.set_nodelay(true);
            conns.spawn(async move {
                let service = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let body = req.into_body().collect().await?.to_bytes();
                        let id = serde_json::from_slice::<Value>(&body)
                            .map(|v| v["id"].clone())
                            .unwrap_or(Value::Null);
                        let answer = json!({"jsonrpc": "2.0", "id": id, "result": {
                            "content": [{"type": "text", "text": "Echo: bench"}]}})
                        .to_string();
                        let mut resp = http::Response::new(Full::new(Bytes::from(answer)));
                        resp.headers_mut().insert(
                            http::header::CONTENT_TYPE,
                            HeaderValue::from_static("application/json"),
                        );
                        Ok::<_, hyper::Error>(resp)
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    Ok((addr, task))
}

pub async fn run(opts: &McpOptions) -> Result<McpReport, String> {
    let command = std::fs::canonicalize(&opts.command).map_err(|e| {
        format!(
            "{}: {e} (install the test peers: scripts/test.sh, or npm ci in tests/peers)",
            opts.command.display()
        )
    })?;
    // The proxied path: harness + executor in this process's runtime, on
    // loopback, as `bmx up` runs them.
    let local = Local::start(|_| {}).await?;
    let session = local
        .session(
            &json!({"mcpServers": [{"serverKey": "ev", "connectionOrigin": "environment",
            "transport": {"type": "stdio", "command": command}}]}),
        )
        .await?;
    let (floor_addr, floor) = http_floor().await?;
    let target = Target {
        command,
        floor_url: format!("http://{floor_addr}/mcp"),
        api_unix: local.api_unix.clone(),
        url: local.url(&format!("/v1/sessions/{session}/mcp/ev")),
        auth: local.auth(),
        calls: opts.calls,
        concurrency: opts.concurrency.clone(),
        warmup: opts.warmup,
    };
    let rows = on_client_thread(move || clients(target)).await;
    // Its connections are in its JoinSet: dropped (aborted) with it.
    floor.abort();
    local.shutdown().await;
    Ok(McpReport {
        calls: opts.calls,
        warmup: opts.warmup,
        workers: tokio::runtime::Handle::current().metrics().num_workers(),
        cpuidle: super::cpuidle(),
        rows: rows?,
    })
}

/// What the client side needs to know of the server side.
struct Target {
    command: PathBuf,
    url: String,
    /// The bare HTTP server's endpoint ([`http_floor`]).
    floor_url: String,
    /// The harness's API Unix socket: the proxied path without TCP.
    api_unix: PathBuf,
    auth: String,
    calls: usize,
    concurrency: Vec<usize>,
    warmup: usize,
}

/// Runs the clients on a thread and runtime of their own, as a separate
/// client process would: sharing the harness's runtime, the bench's
/// client tasks took the harness's worker threads and were woken across
/// them, which measured tokio's scheduling of the bench rather than the
/// path (docs/benchmarks.md, issue 11). Both clients run there, so the
/// baseline is measured the same way.
async fn on_client_thread<F, Fut, T>(make: F) -> Result<T, String>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, String>>,
    T: Send + 'static,
{
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("bench-client".into())
        .spawn(move || {
            let r = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(make()),
                Err(e) => Err(e.to_string()),
            };
            let _ = tx.send(r);
        })
        .map_err(|e| e.to_string())?;
    rx.await
        .map_err(|_| "the client thread failed".to_owned())?
}

/// Both clients, row by row.
async fn clients(target: Target) -> Result<Vec<Row>, String> {
    // The baseline.
    let direct = Arc::new(Direct::start(&target.command).await?);
    let proxied = Proxied::new(&target.url, &target.auth)?;
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "bmx-bench", "version": "1"}}})
    .to_string();
    // The server starts with the session: retry initialize until it is up.
    let deadline = Instant::now() + Duration::from_secs(30);
    let session = loop {
        match proxied.post(init.clone()).await {
            Ok((r, m)) if m.iter().any(|m| m["result"].is_object()) => break r.session,
            other if Instant::now() > deadline => {
                return Err(format!("initialize through the harness: {other:?}"))
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let proxied = proxied.in_session(session.unwrap_or_default());
    proxied
        .post(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#.into())
        .await?;
    // The same client session over the harness's Unix socket.
    let unix = Arc::new(proxied.over(Dial::Unix(target.api_unix.clone())));
    let proxied = Arc::new(proxied);
    // The bare server gets a credential of the same length, not the
    // harness's: the request is the same size, the token stays put.
    let stand_in = format!("Bearer {}", "x".repeat(target.auth.len().saturating_sub(7)));
    let floor = Arc::new(Proxied::new(&target.floor_url, &stand_in)?);

    // Warm both paths: a few calls one at a time, then `warmup` calls
    // each. Node compiles its hot code only after thousands of calls; a
    // cold server makes the direct baseline slow and so flatters the
    // ratio (2 000-call rows with 50 calls of warm-up gave a direct p50 of
    // 124-145 us at one in flight against 84-90 us after 20 000;
    // docs/benchmarks.md).
    for id in 1..=50 {
        direct.call(id, echo_direct(id)).await?;
        proxied.call(id).await?;
    }
    let direct_echo = {
        let d = direct.clone();
        move |id| {
            let d = d.clone();
            async move { d.call(id, echo_direct(id)).await }
        }
    };
    let proxied_echo = proxied.echo();
    let floor_echo = floor.echo();
    let unix_echo = unix.echo();
    if target.warmup > 0 {
        measure(target.warmup, WARMUP_IN_FLIGHT, direct_echo.clone()).await?;
        measure(target.warmup, WARMUP_IN_FLIGHT, proxied_echo.clone()).await?;
        measure(target.warmup, WARMUP_IN_FLIGHT, floor_echo.clone()).await?;
        measure(target.warmup, WARMUP_IN_FLIGHT, unix_echo.clone()).await?;
    }
    let mut rows = Vec::new();
    for &k in &target.concurrency {
        let cpu = || super::cpu_ms("self").unwrap_or(0.0);
        // The measuring runs on this thread (a current-thread runtime).
        let client_cpu = || super::cpu_ms("thread-self").unwrap_or(0.0);
        let server_pid = direct.child.id().unwrap_or(0);
        let server = server_pid.to_string();
        let server_cpu = || super::cpu_ms(&server).unwrap_or(0.0);
        // The executor's servers: this process's other children.
        let proxied_servers = || {
            super::children_of_self()
                .into_iter()
                .filter(|&p| p != server_pid)
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
        };
        let proxied_server_cpu = || {
            let pids = proxied_servers();
            pids.iter().filter_map(|p| super::cpu_ms(p)).sum::<f64>()
        };
        let server_sleeps = || super::sleeps(&server).unwrap_or(0);
        let proxied_server_sleeps = || {
            let pids = proxied_servers();
            pids.iter().filter_map(|p| super::sleeps(p)).sum::<u64>()
        };
        let csw = || super::context_switches().unwrap_or(0);
        let w0 = csw();
        let z0 = server_sleeps();
        let (c0, s0, t0) = (cpu(), server_cpu(), client_cpu());
        let ds = measure(target.calls, k, direct_echo.clone()).await?;
        let (c1, s1, t1, e1) = (cpu(), server_cpu(), client_cpu(), proxied_server_cpu());
        let w1 = csw();
        let (z1, y1) = (server_sleeps(), proxied_server_sleeps());
        let ps = measure(target.calls, k, proxied_echo.clone()).await?;
        let (c2, t2, e2) = (cpu(), client_cpu(), proxied_server_cpu());
        let w2 = csw();
        let y2 = proxied_server_sleeps();
        let p = proxied.clone();
        let hs = measure(target.calls, k, move |id| {
            let p = p.clone();
            async move { p.harness_only(id).await }
        })
        .await?;
        let fs = measure(target.calls, k, floor_echo.clone()).await?;
        let us_ = measure(target.calls, k, unix_echo.clone()).await?;
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        // `measure` runs whole rounds of `k`.
        let calls = (target.calls.div_ceil(k) * k) as f64;
        let per_call = |ms: f64| ms * 1000.0 / calls;
        rows.push(Row {
            direct_bmx_cpu_us: per_call(c1 - c0),
            proxied_bmx_cpu_us: per_call(c2 - c1),
            direct_server_cpu_us: per_call(s1 - s0),
            direct_client_cpu_us: per_call(t1 - t0),
            proxied_client_cpu_us: per_call(t2 - t1),
            proxied_server_cpu_us: per_call(e2 - e1),
            direct_switches: w1.saturating_sub(w0) as f64 / calls,
            proxied_switches: w2.saturating_sub(w1) as f64 / calls,
            direct_server_sleeps: z1.saturating_sub(z0) as f64 / calls,
            proxied_server_sleeps: y2.saturating_sub(y1) as f64 / calls,
            in_flight: k,
            direct_p50_us: us(ds.p50),
            direct_p99_us: us(ds.p99),
            direct_calls_per_s: ds.per_s,
            proxied_p50_us: us(ps.p50),
            proxied_p99_us: us(ps.p99),
            proxied_calls_per_s: ps.per_s,
            harness_only_p50_us: us(hs.p50),
            http_floor_p50_us: us(fs.p50),
            http_floor_calls_per_s: fs.per_s,
            unix_p50_us: us(us_.p50),
            unix_calls_per_s: us_.per_s,
            unix_p50_ratio: us(us_.p50) / us(ds.p50),
            p50_ratio: us(ps.p50) / us(ds.p50),
            throughput_ratio: ds.per_s / ps.per_s,
        });
    }
    // The closures hold the last other reference to `direct`.
    drop((direct_echo, proxied_echo));
    if let Ok(d) = Arc::try_unwrap(direct) {
        let mut child = d.child;
        let _ = child.kill().await;
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn the_table_says_when_the_vm_halts_idle_cpus_at_once() {
        let report = |cpuidle: Option<&str>| McpReport {
            calls: 1,
            warmup: 0,
            workers: 2,
            cpuidle: cpuidle.map(str::to_owned),
            rows: Vec::new(),
        };
        let off = report(Some("haltpoll, guest_halt_poll_ns=0")).table();
        assert!(off.contains("cpuidle: haltpoll, guest_halt_poll_ns=0"));
        assert!(off.contains("halts an idle CPU at once"));
        for other in [
            Some("haltpoll, guest_halt_poll_ns=200000"),
            Some("intel_idle"),
            None,
        ] {
            assert!(!report(other).table().contains("halts an idle CPU"));
        }
    }

    #[test]
    fn the_table_says_when_the_baseline_ran_in_its_fast_mode() {
        let report = |in_flight, direct_server_sleeps| McpReport {
            calls: 1,
            warmup: 0,
            workers: 2,
            cpuidle: None,
            rows: vec![Row {
                in_flight,
                direct_server_sleeps,
                proxied_server_sleeps: 0.97,
                ..Row::default()
            }],
        };
        let fast = report(1, 0.36).table();
        assert!(fast.contains("node slept per call: direct 0.36, proxied 0.97"));
        assert!(fast.contains("the baseline's fast mode"));
        assert!(!report(1, 0.69).table().contains("fast mode"));
        assert!(!report(32, 0.0).table().contains("fast mode"));
    }

    #[test]
    fn the_call_is_the_echo_request_and_only_its_result_answers_it() {
        assert_eq!(
            serde_json::from_str::<Value>(&echo(42)).unwrap(),
            serde_json::from_str::<Value>(&echo_direct(42)).unwrap(),
        );
        let read = |s: &str| serde_json::from_str::<Answer>(s).map(|a| a.answers(7));
        let ok = r#"{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"Echo: bench"}]}}"#;
        assert!(read(ok).unwrap());
        assert!(!read(&ok.replace("\"id\":7", "\"id\":8")).unwrap());
        assert!(
            !read(r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32603,"message":"x"}}"#).unwrap()
        );
        assert!(!read(r#"{"jsonrpc":"2.0","id":7,"result":"text"}"#).unwrap());
        assert!(!read(r#"{"jsonrpc":"2.0","method":"notifications/message"}"#).unwrap());
    }

    #[test]
    fn the_client_parses_the_endpoint_once() {
        let p = Proxied::new("http://127.0.0.1:7070/v1/sessions/s-1/mcp/ev", "Bearer t").unwrap();
        assert_eq!(p.dial, Dial::Tcp("127.0.0.1:7070".parse().unwrap()));
        assert_eq!(p.path, "/v1/sessions/s-1/mcp/ev");
        assert!(Proxied::new("https://127.0.0.1:7070/x", "Bearer t").is_err());
        assert!(Proxied::new("http://localhost:7070/x", "Bearer t").is_err());
    }

    /// A server that answers one request per connection, then closes it
    /// without saying so, as the harness's keep-alive timeout does to an
    /// idle one.
    async fn one_answer_per_connection() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let mut seen = Vec::new();
                let body = loop {
                    let mut b = [0u8; 4096];
                    let n = tcp.read(&mut b).await.unwrap();
                    assert!(n > 0);
                    seen.extend_from_slice(&b[..n]);
                    let text = String::from_utf8_lossy(&seen).into_owned();
                    if let Some((head, body)) = text.split_once("\r\n\r\n") {
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length: "))
                            .unwrap()
                            .parse()
                            .unwrap();
                        if body.len() == len {
                            break body.to_owned();
                        }
                    }
                };
                let id = serde_json::from_str::<Value>(&body).unwrap()["id"].clone();
                let answer =
                    json!({"jsonrpc": "2.0", "id": id, "result": {"content": []}}).to_string();
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                    answer.len()
                );
                tcp.write_all(reply.as_bytes()).await.unwrap();
            }
        });
        (addr, accepted)
    }

    #[tokio::test]
    async fn a_kept_connection_the_server_closed_is_replaced_not_a_failed_call() {
        let (addr, accepted) = one_answer_per_connection().await;
        let client = Proxied::new(&format!("http://{addr}/mcp"), "Bearer t").unwrap();
        for id in [1, 2, 3] {
            client.call(id).await.unwrap();
            // Let the server's close arrive before the connection is used again.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            3,
            "a new connection each time"
        );
    }

    #[tokio::test]
    async fn the_bare_http_server_answers_each_call_with_its_own_id() {
        let (addr, task) = http_floor().await.unwrap();
        let client = Proxied::new(&format!("http://{addr}/mcp"), "Bearer t").unwrap();
        for id in [7, 8, 9] {
            client.call(id).await.unwrap();
        }
        // A call whose answer carried another id would fail.
        let (_, messages) = client.post(echo(41)).await.unwrap();
        assert_eq!(messages.len(), 1);
        assert_eq!(messages[0]["id"], 41);
        assert_eq!(
            client.idle.lock().unwrap().len(),
            1,
            "one kept-alive connection"
        );
        task.abort();
    }
}

//! A harness stand-in for black-box executor tests: a real WebSocket server
//! on 127.0.0.1 (or a Unix socket) speaking the wire protocol through
//! `bmx::wire`, scripted by each test.
#![allow(dead_code)]

use bmx::executor::{Executor, ExecutorConfig, ExecutorHandle, TokenSource};
use bmx::supervisor::Backoff;
use bmx::wire::types::*;
use bmx::wire::{
    transport, Closed, Dispatch, Endpoint, Inbound, Link, LinkLimits, Method, Responder, RpcError,
    Subprotocol,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

pub const TOKEN: &str = "test-token";

/// `bmx executor` (the real binary) for the stand-in at `url`, with its
/// token, working in `work`, logging at warn, killed on drop: add to it,
/// then `spawn`.
pub fn executor_command(url: &str, work: &std::path::Path) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_bmx"));
    c.args(["executor", "--url", url, "--token", TOKEN, "--work-root"])
        .arg(work)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true);
    c
}
pub const WAIT: Duration = Duration::from_secs(10);

/// One frame the stand-in received.
pub struct Got {
    pub frame: Inbound,
    pub reply: Option<Responder>,
}

impl Got {
    pub fn method(&self) -> &str {
        self.frame.method().unwrap_or("")
    }
    pub fn params<T: DeserializeOwned>(&self) -> T {
        self.frame.params().expect("params decode")
    }
    pub fn ok<R: Serialize>(self, r: &R) {
        self.reply.expect("a request").ok(r)
    }
    pub fn err(self, e: RpcError) {
        self.reply.expect("a request").err(e)
    }
}

struct Forward(mpsc::UnboundedSender<Got>);

impl Dispatch for Forward {
    fn dispatch(&self, frame: Inbound, reply: Option<Responder>) {
        let _ = self.0.send(Got { frame, reply });
    }
}

/// One accepted executor connection.
pub struct Conn {
    pub link: Link,
    pub rx: mpsc::UnboundedReceiver<Got>,
    pub closed: oneshot::Receiver<Closed>,
    pub subprotocol: Subprotocol,
}

impl Conn {
    /// The next frame (any kind), within WAIT.
    pub async fn next(&mut self) -> Got {
        tokio::time::timeout(WAIT, self.rx.recv())
            .await
            .expect("a frame within 10 s")
            .expect("connection open")
    }

    /// The next frame of `method`, answering heartbeats on the way.
    pub async fn expect(&mut self, method: Method) -> Got {
        loop {
            let g = self.next().await;
            if g.method() == method.as_str() {
                return g;
            }
            if g.method() == Method::ExecutorHeartbeat.as_str() {
                g.ok(&HeartbeatResult {
                    lease_ttl_ms: 30_000,
                    server_time: now_rfc3339(),
                    drain: false,
                });
                continue;
            }
            if let Some(r) = g.reply {
                // Acknowledge anything else the executor asks (ready, status...).
                r.ok(&Accepted::YES);
            }
        }
    }

    /// Answer the register with the given timings.
    pub async fn register(&mut self, heartbeat_ms: u64, lease_ttl_ms: u64) -> RegisterParams {
        self.register_as("exec-1", "conn-1", heartbeat_ms, lease_ttl_ms)
            .await
    }

    pub async fn register_as(
        &mut self,
        executor_id: &str,
        connection_id: &str,
        heartbeat_ms: u64,
        lease_ttl_ms: u64,
    ) -> RegisterParams {
        let g = self.next().await;
        assert_eq!(
            g.method(),
            "executor.register",
            "the first frame is executor.register"
        );
        let p: RegisterParams = g.params();
        g.ok(&RegisterResult {
            executor_id: executor_id.into(),
            connection_id: connection_id.into(),
            protocol: p.protocol.clone(),
            heartbeat_interval_ms: heartbeat_ms,
            lease_ttl_ms,
            limits: Limits::default(),
            max_control_frame_bytes: 1 << 20,
            max_mcp_frame_bytes: 4 << 20,
            server_time: now_rfc3339(),
            drain: false,
        });
        p
    }

    /// Send a request to the executor and decode the result.
    pub async fn call<P: Serialize, R: DeserializeOwned>(
        &self,
        method: Method,
        params: &P,
    ) -> Result<R, RpcError> {
        match self
            .link
            .request(method, params, Duration::from_secs(30))
            .await
        {
            Ok(r) => Ok(r),
            Err(bmx::wire::CallError::Rpc(e)) => Err(e),
            Err(e) => panic!("{method}: {e}"),
        }
    }

    /// A background task that answers everything the executor sends
    /// (heartbeats, ready, results, ended) and forwards notifications and
    /// requests to the returned channel.
    pub fn serve(mut self) -> (Served, mpsc::UnboundedReceiver<(String, serde_json::Value)>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let link = self.link.clone();
        let subprotocol = self.subprotocol;
        let task = tokio::spawn(async move {
            while let Some(g) = self.rx.recv().await {
                let method = g.method().to_owned();
                let value: serde_json::Value = g.frame.params().unwrap_or(serde_json::Value::Null);
                if let Some(r) = g.reply {
                    if method == "executor.heartbeat" {
                        r.ok(&HeartbeatResult {
                            lease_ttl_ms: 30_000,
                            server_time: now_rfc3339(),
                            drain: false,
                        });
                    } else {
                        r.ok(&Accepted::YES);
                    }
                }
                let _ = tx.send((method, value));
            }
            self.closed.await.ok()
        });
        (
            Served {
                link,
                task,
                subprotocol,
            },
            rx,
        )
    }
}

/// A connection served in the background.
pub struct Served {
    pub link: Link,
    pub task: tokio::task::JoinHandle<Option<Closed>>,
    pub subprotocol: Subprotocol,
}

impl Served {
    pub async fn call<P: Serialize, R: DeserializeOwned>(
        &self,
        method: Method,
        params: &P,
    ) -> Result<R, RpcError> {
        match self
            .link
            .request(method, params, Duration::from_secs(30))
            .await
        {
            Ok(r) => Ok(r),
            Err(bmx::wire::CallError::Rpc(e)) => Err(e),
            Err(e) => panic!("{method}: {e}"),
        }
    }
}

/// The stand-in server.
pub struct StandIn {
    pub url: String,
    pub conns: mpsc::UnboundedReceiver<Conn>,
    /// Count of TCP connections accepted (including failed handshakes).
    pub attempts: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
    pub unix_path: Option<std::path::PathBuf>,
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
pub struct Options {
    pub supported: Vec<Subprotocol>,
    /// Drop the TCP connection before the handshake (a retryable failure).
    pub refuse_handshake: bool,
    pub unix: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            supported: Subprotocol::ALL.to_vec(),
            refuse_handshake: false,
            unix: false,
        }
    }
}

pub async fn stand_in(opts: Options) -> StandIn {
    let (tx, rx) = mpsc::unbounded_channel();
    let attempts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let a = attempts.clone();
    if opts.unix {
        let dir = tempfile::tempdir().unwrap().keep();
        let path = dir.join("harness.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let o = opts.clone();
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                a.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                spawn_conn(Box::new(s), o.clone(), tx.clone());
            }
        });
        return StandIn {
            url: format!("unix:{}", path.display()),
            conns: rx,
            attempts,
            task,
            unix_path: Some(path),
        };
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let o = opts.clone();
    let task = tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            a.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if o.refuse_handshake {
                drop(s);
                continue;
            }
            spawn_conn(Box::new(s), o.clone(), tx.clone());
        }
    });
    StandIn {
        url: format!("ws://{addr}/v1/executor/connect"),
        conns: rx,
        attempts,
        task,
        unix_path: None,
    }
}

fn spawn_conn(io: transport::BoxIo, opts: Options, tx: mpsc::UnboundedSender<Conn>) {
    tokio::spawn(async move {
        let auth = |t: Option<&str>| (t == Some(TOKEN)).then(|| "exec-1".to_owned());
        let Ok((t, _)) = transport::accept(io, &opts.supported, 4 << 20, auth).await else {
            return;
        };
        let subprotocol = t.subprotocol;
        let (link, reader) = Link::start(t, "h", LinkLimits::default());
        let (ftx, frx) = mpsc::unbounded_channel();
        let (ctx, crx) = oneshot::channel();
        tokio::spawn(async move {
            let closed = reader.run(Arc::new(Forward(ftx))).await;
            let _ = ctx.send(closed);
        });
        let _ = tx.send(Conn {
            link,
            rx: frx,
            closed: crx,
            subprotocol,
        });
    });
}

impl StandIn {
    pub async fn next_conn(&mut self) -> Conn {
        tokio::time::timeout(WAIT, self.conns.recv())
            .await
            .expect("a connection within 10 s")
            .expect("listener alive")
    }

    pub fn config(&self, work_root: &std::path::Path) -> ExecutorConfig {
        let mut c = ExecutorConfig::new(
            Endpoint::parse(&self.url).unwrap(),
            TokenSource::Static(TOKEN.into()),
        );
        c.work_root = work_root.to_path_buf();
        c.name = "test-executor".into();
        c.reconnect_backoff = Backoff {
            min: Duration::from_millis(50),
            max: Duration::from_millis(500),
        };
        c.request_timeout = Duration::from_secs(5);
        c
    }
}

/// An in-process executor plus its stand-in, registered and served.
pub struct Rig {
    pub stand_in: StandIn,
    pub executor: Option<ExecutorHandle>,
    pub conn: Served,
    pub events: mpsc::UnboundedReceiver<(String, serde_json::Value)>,
    pub work: tempfile::TempDir,
    /// What the executor said in `executor.register`.
    pub registered: RegisterParams,
}

impl Rig {
    pub async fn start(opts: Options) -> Rig {
        Self::start_with(opts, |_| {}).await
    }

    pub async fn start_with(opts: Options, tweak: impl FnOnce(&mut ExecutorConfig)) -> Rig {
        let mut stand_in = stand_in(opts).await;
        let work = tempfile::tempdir().unwrap();
        let mut config = stand_in.config(work.path());
        tweak(&mut config);
        let executor = Executor::start(config).await.unwrap();
        let mut conn = stand_in.next_conn().await;
        let registered = conn.register(10_000, 30_000).await;
        let (conn, events) = conn.serve();
        Rig {
            stand_in,
            executor: Some(executor),
            conn,
            events,
            work,
            registered,
        }
    }

    /// Assign a session with fencing token 1.
    pub async fn assign(&self, session_id: &str) -> AssignResult {
        self.conn
            .call(Method::SessionAssign, &assign_params(session_id, 1))
            .await
            .expect("assign")
    }

    /// Wait for an event of `method` matching `pred`.
    pub async fn event(
        &mut self,
        method: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let (m, v) = tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .unwrap_or_else(|_| panic!("no {method} event within 10 s"))
                .expect("events open");
            if m == method && pred(&v) {
                return v;
            }
        }
    }

    pub async fn shutdown(mut self) {
        if let Some(e) = self.executor.take() {
            e.shutdown().await;
        }
    }
}

pub fn assign_params(session_id: &str, fencing: u64) -> AssignParams {
    AssignParams {
        session_id: session_id.into(),
        work_id: format!("work-{session_id}"),
        agent_id: None,
        environment_id: None,
        lease: LeaseGrant {
            token: format!("lease-{fencing}"),
            fencing_token: fencing,
        },
        deadline_ms: None,
        mcp_servers: vec![],
        metadata: Default::default(),
        resources: vec![],
        restore: None,
    }
}

pub fn start_params(session_id: &str, process_id: &str, argv: &[&str]) -> ProcessStartParams {
    ProcessStartParams {
        session_id: session_id.into(),
        process_id: process_id.into(),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        cwd: None,
        env: None,
        stdin: StdinMode::Closed,
        stderr: StderrMode::Separate,
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
    }
}

pub fn read_params(
    session_id: &str,
    process_id: &str,
    stream: Stream,
    cursor: u64,
    wait_ms: u64,
) -> ProcessReadParams {
    ProcessReadParams {
        session_id: session_id.into(),
        process_id: process_id.into(),
        stream,
        cursor,
        max_bytes: None,
        wait_ms: Some(wait_ms),
    }
}

/// Whether a pid is alive (not gone, not a zombie).
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => {
            let state = s.rfind(')').and_then(|i| s[i + 2..].chars().next());
            state != Some('Z')
        }
        Err(_) => false,
    }
}

/// Pids whose command line starts with `needle` (unique args mark test
/// processes; a shell whose script mentions them does not count).
pub fn pids_with_arg(needle: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.starts_with(needle) && alive(pid) {
                out.push(pid);
            }
        }
    }
    out
}

/// Poll `cond` until it holds (bounded).
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + WAIT;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not reached in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A library harness with a filesystem blob store (blobs of at most
/// `max_blob` bytes) on `listen`, uploads addressed to `public_url` when
/// given, and the real `bmx executor` binary registered as `executor_id`:
/// the world of the artifact, backup and skill tests.
pub struct BlobWorld {
    pub h: bmx::harness::HarnessHandle,
    pub api: bmx::client::ApiClient,
    /// The executor child and the two directories; dropped with the world.
    pub guard: (tokio::process::Child, tempfile::TempDir, tempfile::TempDir),
}

pub async fn blob_world(
    executor_id: &str,
    listen: std::net::SocketAddr,
    max_blob: u64,
    public_url: Option<String>,
) -> BlobWorld {
    let blobs = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let (h, api, executor) = blob_world_in(
        executor_id,
        listen,
        blobs.path(),
        max_blob,
        public_url,
        work.path(),
        &[],
    )
    .await;
    BlobWorld {
        h,
        api,
        guard: (executor, work, blobs),
    }
}

/// The parts of a [`BlobWorld`] over directories the caller owns (say, a
/// small tmpfs): the harness with its blob store at `blobs`, an API client,
/// and the executor (work root `work`, `extra` arguments) once registered.
pub async fn blob_world_in(
    executor_id: &str,
    listen: std::net::SocketAddr,
    blobs: &std::path::Path,
    max_blob: u64,
    public_url: Option<String>,
    work: &std::path::Path,
    extra: &[&str],
) -> (
    bmx::harness::HarnessHandle,
    bmx::client::ApiClient,
    tokio::process::Child,
) {
    let store = bmx::harness::blob::FsBlobStore::open(blobs, max_blob).unwrap();
    let h = bmx::harness::Harness::builder()
        .listen(listen)
        .token(executor_id, TOKEN)
        .blob_store(Arc::new(store))
        .heartbeat_ms(500)
        .lease_ttl_ms(10_000)
        .public_url(public_url)
        .build()
        .await
        .expect("harness");
    let executor = executor_command(&h.executor_url(), work)
        .args(extra)
        .spawn()
        .expect("bmx executor");
    assert!(
        h.wait_for_executor(Some(executor_id), Duration::from_secs(20))
            .await,
        "the executor registers"
    );
    let api = bmx::client::ApiClient::new(&h.api_url())
        .unwrap()
        .timeout(Duration::from_secs(60));
    (h, api, executor)
}

/// Run `command` with the `bash` tool through the harness API; it must
/// succeed. Returns its text.
pub async fn bash_ok(api: &bmx::client::ApiClient, sid: &str, command: &str) -> String {
    let (s, v) = api
        .post(
            &format!("/v1/sessions/{sid}/tools"),
            &serde_json::json!({"tool": "bash", "input": {"command": command}}),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["isError"], false, "{command}: {v}");
    v["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// The stdout of `command` run with the `bash` tool through the harness
/// API (it must succeed): the tool's text without its `stdout:` header and
/// `exit code:` trailer.
pub async fn bash_stdout(api: &bmx::client::ApiClient, sid: &str, command: &str) -> String {
    let t = bash_ok(api, sid, command).await;
    let t = t.strip_prefix("stdout:\n").unwrap_or(&t);
    t.rsplit_once("\nexit code:")
        .map(|(a, _)| a)
        .unwrap_or(t)
        .to_owned()
}

/// `sha256:<hex>` of `bytes`, the digest form of artifacts and blobs.
pub fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    let hex: String = sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

//! `bmx harness`, `bmx up`, `bmx exec`, `bmx ps`.

use bmx::client::ApiClient;
use bmx::executor::{Executor, ExecutorConfig, TokenSource};
use bmx::harness::{Harness, HarnessBuilder, HarnessHandle};
use clap::Args;
use serde_json::{json, Value};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use super::text::{cell, say, warn_line};

/// Run the harness: accept executors on `GET /v1/executor/connect` and serve
/// the HTTP API (docs/api.md) on the same address.
#[derive(Debug, Args)]
pub struct HarnessArgs {
    /// Address of the API and of the executors' WebSocket endpoint.
    #[arg(long, env = "BMX_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Also accept executors on this Unix socket.
    #[arg(long)]
    pub listen_unix: Option<PathBuf>,
    /// Also serve the whole HTTP API on this Unix socket (mode 0600; the
    /// API token applies as on TCP): for a platform on the same host.
    #[arg(long, env = "BMX_API_UNIX")]
    pub api_unix: Option<PathBuf>,
    /// An executor credential, `EXECUTOR_ID=SECRET` (repeatable).
    #[arg(long = "token", value_name = "ID=SECRET")]
    pub tokens: Vec<String>,
    /// A file of `EXECUTOR_ID=SECRET` lines (`#` starts a comment).
    #[arg(long)]
    pub tokens_file: Option<PathBuf>,
    /// `heartbeatIntervalMs` announced to executors.
    #[arg(long, default_value_t = 10_000)]
    pub heartbeat_ms: u64,
    /// `leaseTtlMs`: silence before close 4008, and how long a lost
    /// executor's leases wait for it.
    #[arg(long, default_value_t = 30_000)]
    pub lease_ttl_ms: u64,
    /// Bearer token the HTTP API requires.
    #[arg(long, env = "BMX_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// Serve the API without a token on a non-loopback address.
    #[arg(long)]
    pub allow_open_api: bool,
    /// Base URL executors dial for terminal relays (default: ws:// + the
    /// listen address, 0.0.0.0 read as 127.0.0.1). Set it behind a proxy
    /// or when executors are remote.
    #[arg(long, env = "BMX_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// Where enrollments, issued credentials, sessions, fencing counters
    /// and acknowledged tool results are kept (SQLite, docs/store.md).
    /// Default: `$BMX_HOME/harness`, else `~/.bmx/harness`.
    #[arg(long, env = "BMX_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Where the state above is kept instead: `sqlite` (the default, in
    /// `--data-dir`) or a `postgres://user:pw@host:port/db` URL shared by
    /// harnesses (docs/store.md). Blobs stay in `--data-dir`. A password in
    /// the URL is never printed.
    #[arg(long, env = "BMX_STORE", hide_env_values = true)]
    pub store: Option<String>,
    /// The most connections a PostgreSQL `--store` opens (the replicas'
    /// listener has one more). Ignored with SQLite.
    #[arg(long, env = "BMX_STORE_CONNECTIONS", default_value_t = bmx::harness::store::postgres::DEFAULT_CONNECTIONS,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub store_connections: u32,
    /// This harness's id among the replicas over one PostgreSQL `--store`
    /// (docs/store.md, "Several replicas"; default: random per process).
    /// Ignored with SQLite.
    #[arg(long, env = "BMX_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// How long a device enrollment waits for approval, in seconds.
    #[arg(long, default_value_t = 900)]
    pub enrollment_ttl_secs: u64,
    /// `pollIntervalMs` of enrollments (faster polls get `slow_down`).
    #[arg(long, default_value_t = 5000)]
    pub enrollment_poll_ms: u64,
    /// A request body must arrive within this many seconds of its head
    /// (longer bodies: at 256 KiB/s at least), else 408 and the
    /// connection is closed.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub body_timeout_secs: u64,
}

/// Run a harness on 127.0.0.1 and one executor connected to it, until
/// Ctrl-C (or SIGTERM).
#[derive(Debug, Args)]
pub struct UpArgs {
    /// Port of the API on 127.0.0.1.
    #[arg(long, default_value_t = 7070)]
    pub port: u16,
    /// Root of session workspaces (default: a fresh directory under the
    /// system's temp dir, removed at exit).
    #[arg(long)]
    pub work_root: Option<PathBuf>,
    /// Id of the local executor.
    #[arg(long, default_value = "local")]
    pub executor_id: String,
    /// An ACP agent the local executor runs turns with: `NAME=COMMAND
    /// [ARGS...]` (split on whitespace; repeatable; the first is the
    /// default). Then `bmx run "prompt"` talks to it.
    #[arg(long = "agent", value_name = "NAME=COMMAND")]
    pub agents: Vec<String>,
    /// Also serve the API on this Unix socket (mode 0600).
    #[arg(long, env = "BMX_API_UNIX")]
    pub api_unix: Option<PathBuf>,
    #[command(flatten)]
    pub sandbox: super::sandbox::SandboxArgs,
}

/// `NAME=COMMAND [ARGS...]` → (name, argv), as `bmx executor --agent` reads it.
pub fn parse_agent(spec: &str) -> Result<(String, Vec<String>), String> {
    let bad = || format!("--agent {spec:?}: expected NAME=COMMAND");
    let (name, command) = spec.split_once('=').ok_or_else(bad)?;
    let argv: Vec<String> = command.split_whitespace().map(str::to_owned).collect();
    if name.is_empty() || argv.is_empty() {
        return Err(bad());
    }
    Ok((name.to_owned(), argv))
}

/// Run a command on an executor through the harness API, stream its stdout
/// and stderr, and exit with its exit code (128+N for signal N).
#[derive(Debug, Args)]
pub struct ExecArgs {
    /// The harness API.
    #[arg(long, env = "BMX_HARNESS", default_value = "http://127.0.0.1:7070")]
    pub harness: String,
    #[arg(long, env = "BMX_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// Run in this session (default: a new one, stopped at the end).
    #[arg(long)]
    pub session: Option<String>,
    /// Run on this executor (new sessions only).
    #[arg(long)]
    pub executor: Option<String>,
    /// Working directory inside the session workspace.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Kill the command after this many milliseconds.
    #[arg(long)]
    pub timeout_ms: Option<u64>,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// List the executors and sessions of a harness.
#[derive(Debug, Args)]
pub struct PsArgs {
    #[arg(long, env = "BMX_HARNESS", default_value = "http://127.0.0.1:7070")]
    pub harness: String,
    #[arg(long, env = "BMX_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// One JSON line in the envelope: `data: {harness, executors,
    /// sessions}` (the API's objects as they are).
    #[arg(long)]
    pub json: bool,
}

fn parse_token(line: &str) -> Result<(String, String), String> {
    let (id, secret) = line
        .split_once('=')
        .ok_or_else(|| format!("{line:?}: expected EXECUTOR_ID=SECRET"))?;
    let (id, secret) = (id.trim(), secret.trim());
    if id.is_empty() || secret.is_empty() {
        return Err(format!("{line:?}: empty executor id or secret"));
    }
    Ok((id.to_owned(), secret.to_owned()))
}

/// The enrollment store and the durable state over the store `--store`
/// names: SQLite in `data_dir` by default, or PostgreSQL. Errors name a
/// PostgreSQL URL only with its password redacted.
/// With PostgreSQL the harness is also one of several replicas over the
/// database (`PgReplicas`, id `replica_id` or a random one).
type Opened = (
    std::sync::Arc<dyn bmx::harness::store::Store>,
    bmx::harness::store::DurableState,
    Option<std::sync::Arc<bmx::harness::store::PgReplicas>>,
);

fn open_store(
    store: Option<&str>,
    connections: u32,
    data_dir: &std::path::Path,
    replica_id: Option<&str>,
) -> Result<Opened, String> {
    use bmx::harness::store::{
        pg_replicas, postgres, DurableState, PgReplicas, PgStore, SqliteStore,
    };
    match store {
        None | Some("sqlite") => {
            let db = std::sync::Arc::new(
                SqliteStore::open_dir(data_dir)
                    .map_err(|e| format!("--data-dir {}: {e}", data_dir.display()))?,
            );
            let durable = DurableState::open(db.clone())
                .map_err(|e| format!("--data-dir {}: {e}", data_dir.display()))?;
            Ok((db, durable, None))
        }
        Some(url) if postgres::is_postgres_url(url) => {
            let shown = postgres::redact(url);
            let db = std::sync::Arc::new(
                PgStore::connect_with(url, connections)
                    .map_err(|e| format!("--store {shown}: {e}"))?,
            );
            let id = replica_id.map_or_else(pg_replicas::random_replica_id, str::to_owned);
            // Before the writer can write: session rows are then created
            // only by a replica's claim.
            let replicas = std::sync::Arc::new(PgReplicas::new(db.clone(), id.clone()));
            let durable =
                DurableState::open(db.clone()).map_err(|e| format!("--store {shown}: {e}"))?;
            tracing::info!(replica = %id, "one of the replicas over the postgres store");
            Ok((db, durable, Some(replicas)))
        }
        Some(other) => Err(format!(
            "--store {}: expected `sqlite` or a postgres:// URL",
            postgres::redact(other)
        )),
    }
}

/// `--api-token` (or `BMX_API_TOKEN`) must be long enough not to be
/// guessed; empty means none (the loopback-only API).
fn check_api_token(token: Option<&str>) -> Result<(), String> {
    use bmx::harness::config::MIN_API_TOKEN_BYTES;
    match token {
        Some(t) if !t.is_empty() && t.len() < MIN_API_TOKEN_BYTES => Err(format!(
            "--api-token (or BMX_API_TOKEN) is {} bytes: it must have at least \
             {MIN_API_TOKEN_BYTES}; make one with `openssl rand -hex 32`",
            t.len()
        )),
        _ => Ok(()),
    }
}

impl HarnessArgs {
    pub fn into_builder(self) -> Result<HarnessBuilder, String> {
        check_api_token(self.api_token.as_deref())?;
        let mut tokens = Vec::new();
        for t in &self.tokens {
            tokens.push(parse_token(t)?);
        }
        if let Some(f) = &self.tokens_file {
            let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            for line in text.lines() {
                let line = line.split('#').next().unwrap_or("").trim();
                if !line.is_empty() {
                    tokens.push(parse_token(line)?);
                }
            }
        }
        let data_dir = self
            .data_dir
            .clone()
            .unwrap_or_else(|| bmx::runner::credentials::bmx_home().join("harness"));
        // Ours alone, before anything is written there (issue 56).
        bmx::harness::data_dir::prepare(&data_dir).map_err(|e| format!("--data-dir: {e}"))?;
        let (store, durable, replicas) = open_store(
            self.store.as_deref(),
            self.store_connections,
            &data_dir,
            self.replica_id.as_deref(),
        )?;
        // Artifacts (issue 15): content-addressed files under the data dir.
        let blobs = bmx::harness::blob::FsBlobStore::open(data_dir.join("blobs"), 1 << 30)
            .map_err(|e| format!("--data-dir {}: blobs: {e}", data_dir.display()))?;
        let mut config = bmx::harness::HarnessConfig::default();
        config.connections.body_timeout = Duration::from_secs(self.body_timeout_secs);
        let mut b = Harness::builder()
            .config(config)
            .durable_state(durable)
            .blob_store(std::sync::Arc::new(blobs))
            .enrollment_store(store)
            .enrollment_timing(
                Duration::from_secs(self.enrollment_ttl_secs.max(1)),
                Duration::from_millis(self.enrollment_poll_ms),
            )
            .listen(self.listen)
            .heartbeat_ms(self.heartbeat_ms)
            .lease_ttl_ms(self.lease_ttl_ms)
            .api_token(self.api_token)
            .allow_open_api(self.allow_open_api)
            .public_url(self.public_url);
        if let Some(p) = self.listen_unix {
            b = b.listen_unix(p);
        }
        if let Some(p) = self.api_unix {
            b = b.api_unix(p);
        }
        if let Some(r) = replicas {
            b = b.replicas(r);
        }
        for (id, secret) in tokens {
            b = b.token(id, secret);
        }
        Ok(b)
    }
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is
/// called, not when it is first polled: call it before saying "ready", so
/// a signal sent right after is never met by the default action.
fn signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let handlers = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    );
    async move {
        match handlers {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => std::future::pending().await,
        }
    }
}

pub async fn run_harness(args: HarnessArgs) -> ExitCode {
    // One descriptor per executor connection: a harness holding thousands
    // of executors needs more than the usual soft limit of 1024.
    bmx::process::sys::raise_nofile_limit();
    let builder = match args.into_builder() {
        Ok(b) => b,
        Err(e) => {
            warn_line!("bmx harness: {e}");
            return ExitCode::from(2);
        }
    };
    let h = match builder.build().await {
        Ok(h) => h,
        Err(e) => {
            warn_line!("bmx harness: {e}");
            return ExitCode::from(1);
        }
    };
    let stop = signal();
    println!(
        "bmx harness: API {}/v1, executors connect to {}",
        h.api_url(),
        h.executor_url()
    );
    // The web console (issue 16, docs/console.md). A line of its own,
    // after the one scripts parse; a reader that stopped reading must
    // not make it panic (EPIPE), hence no `println!`.
    let console = if h.config().api_token.is_some() {
        Some("log in with the API token")
    } else if h.local_addr().ip().is_loopback() {
        Some("no API token: loopback only")
    } else {
        None
    };
    if let Some(how) = console {
        let _ = writeln!(
            std::io::stdout(),
            "bmx harness: console at {}/ ({how})",
            h.api_url()
        );
    }
    stop.await;
    tracing::info!("shutting down");
    h.shutdown().await;
    ExitCode::SUCCESS
}

pub async fn run_up(args: UpArgs) -> ExitCode {
    let mut agents = Vec::new();
    for spec in &args.agents {
        match parse_agent(spec) {
            Ok(a) => agents.push(a),
            Err(e) => {
                warn_line!("bmx up: {e}");
                return ExitCode::from(2);
            }
        }
    }
    // The state dir `local` (bmx targets, bmx env): claimed first, held
    // until the end of this function, marked stopped when dropped.
    let mut state =
        bmx::runner::claims::claim_local(args.port, &args.executor_id, args.work_root.as_deref());
    let token = uuid::Uuid::new_v4().simple().to_string();
    // Sessions and fencing counters survive a restart of `bmx up` too, in
    // a data dir of its own per port (the port is claimed above, so one
    // process per dir).
    let data_dir = bmx::runner::credentials::bmx_home()
        .join("up")
        .join(args.port.to_string());
    let durable = match bmx::harness::store::SqliteStore::open_dir(&data_dir)
        .and_then(|s| bmx::harness::store::DurableState::open(std::sync::Arc::new(s)))
    {
        Ok(d) => d,
        Err(e) => {
            warn_line!("bmx up: {}: {e}", data_dir.display());
            return ExitCode::from(1);
        }
    };
    let mut builder = Harness::builder()
        .durable_state(durable)
        .listen(SocketAddr::from(([127, 0, 0, 1], args.port)))
        .token(args.executor_id.clone(), token.clone());
    if let Some(p) = &args.api_unix {
        builder = builder.api_unix(p);
    }
    let h: HarnessHandle = match builder.build().await {
        Ok(h) => h,
        Err(e) => {
            warn_line!("bmx up: {e}");
            return ExitCode::from(1);
        }
    };
    let sandbox = match args.sandbox.into_config() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bmx up: {e}");
            h.shutdown().await;
            return ExitCode::from(2);
        }
    };
    // A fresh directory with a random name (mkdtemp, 0700), never one
    // another user could have made first (issue 56); under
    // $XDG_RUNTIME_DIR when there is one.
    let (work_root, remove_work_root) = match args.work_root {
        Some(p) => (p, false),
        None => {
            let base = std::env::var_os("XDG_RUNTIME_DIR")
                .map(PathBuf::from)
                .filter(|d| d.is_dir())
                .unwrap_or_else(std::env::temp_dir);
            match tempfile::Builder::new().prefix("bmx-up-").tempdir_in(&base) {
                Ok(d) => (d.keep(), true),
                Err(e) => {
                    eprintln!("bmx up: cannot make a work root in {}: {e}", base.display());
                    h.shutdown().await;
                    return ExitCode::from(1);
                }
            }
        }
    };
    // Its own executor dials the in-process endpoint: the same handshake
    // and frames as a socket, without one (PROTOCOL.md §1, local
    // transport). Other executors still connect at `h.executor_url()`.
    let endpoint = h.in_process_endpoint();
    let mut config = ExecutorConfig::new(endpoint, TokenSource::Static(token));
    config.work_root = work_root.clone();
    config.agents = agents;
    config.sandbox = sandbox;
    // Installed before the executor starts, like `bmx executor`'s: a signal
    // from now on is a clean shutdown, never the default death.
    let signals = match bmx::executor::ShutdownSignals::install() {
        Ok(s) => s,
        Err(e) => {
            warn_line!("bmx up: cannot install signal handlers: {e}");
            return ExitCode::from(1);
        }
    };
    let executor = match Executor::start(config).await {
        Ok(e) => e,
        Err(e) => {
            warn_line!("bmx up: {e}");
            h.shutdown().await;
            return ExitCode::from(1);
        }
    };
    if !h
        .wait_for_executor(Some(&args.executor_id), Duration::from_secs(10))
        .await
    {
        warn_line!("bmx up: the local executor did not register within 10 s");
    }
    println!(
        "bmx up: API at {}/v1 (executor {:?} connected; Ctrl-C to stop)",
        h.api_url(),
        args.executor_id
    );
    let _ = writeln!(
        std::io::stdout(),
        "bmx up: console at {}/ (no API token: loopback only)",
        h.api_url()
    );
    let _ = std::io::stdout().flush();
    // Run until a signal, or until the executor ends by itself.
    let exit = {
        let wait = executor.run_until(signals);
        tokio::pin!(wait);
        // Poll it once (an executor that already ended answers at once)
        // before the state dir says `running`.
        let early = tokio::select! {
            biased;
            e = &mut wait => Some(e),
            _ = std::future::ready(()) => None,
        };
        bmx::runner::claims::local_ready(&mut state, h.local_addr());
        match early {
            Some(e) => e,
            None => wait.await,
        }
    };
    tracing::info!(?exit, "executor stopped");
    h.shutdown().await;
    if remove_work_root {
        let _ = std::fs::remove_dir_all(&work_root);
    }
    drop(state);
    ExitCode::SUCCESS
}

fn api_error(v: &Value) -> String {
    match v.get("error") {
        Some(e) => {
            let mut s = format!(
                "{} (code {})",
                e["message"].as_str().unwrap_or("error"),
                e["code"]
            );
            if let Some(r) = e["data"]["reason"].as_str() {
                s.push_str(&format!(", reason {r}"));
            }
            if let Some(d) = e["data"]["detail"].as_str() {
                s.push_str(&format!(": {d}"));
            }
            s
        }
        None => v.to_string(),
    }
}

/// Stream one output stream of a process until EOF; returns the last read.
async fn pump(client: ApiClient, base: String, stream: &'static str) -> Result<Value, String> {
    let mut cursor = 0u64;
    loop {
        let path = format!("{base}/output?stream={stream}&cursor={cursor}&waitMs=10000");
        let (status, r) = client.get(&path).await.map_err(|e| e.to_string())?;
        if status != 200 {
            return Err(api_error(&r));
        }
        let data = r["data"].as_str().unwrap_or_default();
        let bytes = bmx::wire::blob::base64_decode(data).map_err(|e| e.to_string())?;
        if r["gap"] == true {
            warn_line!("bmx exec: [{stream}: some output was dropped]");
        }
        if !bytes.is_empty() {
            let res = if stream == "stdout" {
                let mut out = std::io::stdout().lock();
                out.write_all(&bytes).and_then(|_| out.flush())
            } else {
                let mut err = std::io::stderr().lock();
                err.write_all(&bytes).and_then(|_| err.flush())
            };
            if res.is_err() {
                return Err(format!("cannot write {stream}"));
            }
        }
        cursor = r["nextCursor"].as_u64().unwrap_or(cursor);
        if r["eof"] == true {
            return Ok(r);
        }
    }
}

fn exit_status(state: &Value) -> u8 {
    if let Some(c) = state["exitCode"].as_i64() {
        return (c & 0xff) as u8;
    }
    if let Some(s) = state["exitSignal"].as_i64() {
        return (128 + s).clamp(0, 255) as u8;
    }
    match state["state"].as_str() {
        Some("failed") => 127,
        Some("killed") => 137,
        _ => 1,
    }
}

pub async fn run_exec(args: ExecArgs) -> ExitCode {
    let client = match ApiClient::new(&args.harness) {
        Ok(c) => c.token(args.api_token.clone()),
        Err(e) => {
            warn_line!("bmx exec: {e}");
            return ExitCode::from(2);
        }
    };
    let (session, created) = match &args.session {
        Some(s) => (s.clone(), false),
        None => {
            let mut body = json!({});
            if let Some(e) = &args.executor {
                body["executorId"] = json!(e);
            }
            match client.post("/v1/sessions", &body).await {
                Ok((201, v)) => (v["sessionId"].as_str().unwrap_or_default().to_owned(), true),
                Ok((_, v)) => {
                    warn_line!("bmx exec: cannot create a session: {}", api_error(&v));
                    return ExitCode::from(1);
                }
                Err(e) => {
                    warn_line!("bmx exec: {}: {e}", args.harness);
                    return ExitCode::from(1);
                }
            }
        }
    };
    let code = exec_in(&client, &session, &args).await;
    if created {
        if let Err(e) = client.delete(&format!("/v1/sessions/{session}")).await {
            warn_line!("bmx exec: stopping session {session}: {e}");
        }
    }
    ExitCode::from(code)
}

async fn exec_in(client: &ApiClient, session: &str, args: &ExecArgs) -> u8 {
    let process_id = format!("exec-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut spec = json!({"processId": process_id, "argv": args.command});
    if let Some(c) = &args.cwd {
        spec["cwd"] = json!(c);
    }
    if let Some(t) = args.timeout_ms {
        spec["timeoutMs"] = json!(t);
    }
    let base = format!("/v1/sessions/{session}/processes/{process_id}");
    let state = match client
        .post(&format!("/v1/sessions/{session}/processes"), &spec)
        .await
    {
        Ok((200, v)) => v,
        Ok((_, v)) => {
            warn_line!("bmx exec: cannot start the command: {}", api_error(&v));
            return 1;
        }
        Err(e) => {
            warn_line!("bmx exec: {e}");
            return 1;
        }
    };
    if state["state"] == "failed" {
        let msg = state["message"].as_str().unwrap_or("cannot start");
        warn_line!("bmx exec: {msg}");
        return 127;
    }
    let out = tokio::spawn(pump(client.clone(), base.clone(), "stdout"));
    let err = tokio::spawn(pump(client.clone(), base.clone(), "stderr"));
    let both = async { (out.await, err.await) };
    tokio::pin!(both);
    // One listener while the command runs: a Ctrl-C landing during the
    // interrupt request is kept for the next pass, not lost.
    let mut interrupts =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok();
    let (out, err) = loop {
        tokio::select! {
            r = &mut both => break r,
            Some(()) = async { match interrupts.as_mut() { Some(s) => s.recv().await, None => std::future::pending().await } } => {
                // Pass Ctrl-C on to the command; keep streaming until it ends.
                let _ = client.post(&format!("{base}/interrupt"), &json!({})).await;
            }
        }
    };
    let last = match (out, err) {
        (Ok(Ok(o)), Ok(Ok(_))) => o,
        (Ok(Err(e)), _) | (_, Ok(Err(e))) => {
            warn_line!("bmx exec: {e}");
            return 1;
        }
        _ => return 1,
    };
    exit_status(&last)
}

pub async fn run_ps(args: PsArgs) -> ExitCode {
    if args.json {
        return run_ps_json(args).await;
    }
    let client = match ApiClient::new(&args.harness) {
        Ok(c) => c.token(args.api_token),
        Err(e) => {
            warn_line!("bmx ps: {e}");
            return ExitCode::from(2);
        }
    };
    let answers = (
        client.get("/v1/executors").await,
        all_sessions(&client).await,
    );
    let (execs, sessions) = match answers {
        (Err(e), _) | (_, Err(e)) => {
            warn_line!("bmx ps: {}: {e}", args.harness);
            return ExitCode::from(1);
        }
        (Ok((200, e)), Ok((200, s))) => (e, s),
        (Ok((_, v)), Ok((200, _))) | (Ok(_), Ok((_, v))) => {
            warn_line!("bmx ps: {}", api_error(&v));
            return ExitCode::from(1);
        }
    };
    // Escaped per cell (names and ids came from executors and clients).
    let s = |v: &Value| cell(v, "-").into_owned();
    say!(
        "{:<20} {:<24} {:<16} {:>8}  LAST HEARTBEAT",
        "EXECUTOR",
        "CONNECTION",
        "NAME",
        "SESSIONS"
    );
    for e in execs["executors"].as_array().into_iter().flatten() {
        say!(
            "{:<20} {:<24} {:<16} {:>8}  {}",
            s(&e["executorId"]),
            s(&e["connectionId"]),
            s(&e["name"]),
            e["activeSessions"].as_array().map_or(0, Vec::len),
            s(&e["lastHeartbeatAt"]),
        );
    }
    say!("");
    say!(
        "{:<38} {:<20} {:<13} {:>6} {:>6}  CREATED",
        "SESSION",
        "EXECUTOR",
        "STATE",
        "READY",
        "FENCE"
    );
    for x in sessions["sessions"].as_array().into_iter().flatten() {
        say!(
            "{:<38} {:<20} {:<13} {:>6} {:>6}  {}",
            s(&x["sessionId"]),
            s(&x["executorId"]),
            s(&x["state"]),
            x["ready"].as_bool().unwrap_or(false),
            x["fencingToken"],
            s(&x["createdAt"]),
        );
    }
    ExitCode::SUCCESS
}

/// Most pages `bmx ps` follows: 1 000 pages of 1 000 sessions.
const PS_MAX_PAGES: usize = 1000;

/// `GET /v1/sessions` page by page (`next`), as one answer: the status of
/// the first page that is not 200, else 200 with every session. The
/// listing is paged (1 000 per page) so one call never carries an
/// unbounded list; `bmx ps` still shows them all.
async fn all_sessions(client: &ApiClient) -> Result<(u16, Value), bmx::client::ClientError> {
    let mut sessions = Vec::new();
    let mut path = "/v1/sessions".to_owned();
    for _ in 0..PS_MAX_PAGES {
        let (status, page) = client.get(&path).await?;
        if status != 200 {
            return Ok((status, page));
        }
        sessions.extend(page["sessions"].as_array().cloned().unwrap_or_default());
        match page["next"].as_str() {
            // A session id passes the id rule (wire::id): nothing in it
            // needs escaping in a query; anything else is refused.
            Some(next) if bmx::wire::id::check("next", next).is_ok() => {
                path = format!("/v1/sessions?after={next}")
            }
            Some(_) => return Ok((502, json!({"error": {"message": "bad next page id"}}))),
            None => break,
        }
    }
    Ok((200, json!({ "sessions": sessions })))
}

/// `bmx ps --json`: one envelope line; a harness that cannot be reached
/// or answers an error is `TARGET_EXEC_FAILED`, a bad URL
/// `AGENT_PROTOCOL_ERROR`.
async fn run_ps_json(args: PsArgs) -> ExitCode {
    use bmx::runner::envelope::{ErrorCode, ResponseError};
    let result = async {
        let client = ApiClient::new(&args.harness)
            .map_err(|e| ResponseError::new(ErrorCode::AgentProtocol, e.to_string()))?
            .token(args.api_token.clone());
        let failed = |m: String| ResponseError::new(ErrorCode::TargetExecFailed, m);
        let execs = client
            .get("/v1/executors")
            .await
            .map_err(|e| failed(format!("{}: {e}", args.harness)))?;
        let sessions = all_sessions(&client)
            .await
            .map_err(|e| failed(format!("{}: {e}", args.harness)))?;
        match (execs, sessions) {
            ((200, e), (200, s)) => Ok(json!({
                "harness": args.harness,
                "executors": e["executors"].as_array().cloned().unwrap_or_default(),
                "sessions": s["sessions"].as_array().cloned().unwrap_or_default(),
            })),
            ((200, _), (_, v)) | ((_, v), _) => Err(failed(api_error(&v))),
        }
    }
    .await;
    super::json::answer(true, "ps", None, result, |_| {})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_parse() {
        assert_eq!(
            parse_token("exec-1=s3cret").unwrap(),
            ("exec-1".to_string(), "s3cret".to_string())
        );
        assert!(parse_token("nope").is_err());
        assert!(parse_token("=x").is_err());
        assert_eq!(exit_status(&json!({"exitCode": 3})), 3);
        assert_eq!(exit_status(&json!({"exitSignal": 9})), 137);
        assert_eq!(
            parse_agent("test=node agent.mjs --x").unwrap(),
            (
                "test".to_string(),
                vec!["node".into(), "agent.mjs".into(), "--x".into()]
            )
        );
        assert!(parse_agent("test=").is_err());
        assert!(parse_agent("=node").is_err());
    }

    #[test]
    fn short_api_tokens_are_refused_naming_the_flag() {
        let e = check_api_token(Some("apikey")).unwrap_err();
        assert!(
            e.contains("--api-token") && e.contains("openssl rand -hex 32"),
            "{e}"
        );
        assert!(check_api_token(Some(&"x".repeat(16))).is_ok());
        assert!(check_api_token(Some("")).is_ok(), "empty: no token");
        assert!(check_api_token(None).is_ok());
    }
}

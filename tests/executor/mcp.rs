//! Issue 11, executor side: real MCP servers (`@modelcontextprotocol/
//! server-everything` and `server-filesystem`, installed by
//! scripts/test.sh from tests/peers) run by the real executor, driven over
//! a real WebSocket with `mcp.open` / `mcp.frame`.

use crate::support;
use bmx::wire::types::*;
use bmx::wire::{Method, RpcError};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;
use support::*;

fn peer(bin: &str) -> String {
    format!(
        "{}/tests/peers/node_modules/.bin/{bin}",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn stdio(key: &str, bin: &str, args: &[&str], env: &[(&str, &str)]) -> McpServerSpec {
    McpServerSpec {
        server_key: key.into(),
        connection_origin: ConnectionOrigin::Environment,
        transport: McpTransport {
            kind: McpTransportType::Stdio,
            command: Some(peer(bin)),
            args: Some(args.iter().map(|s| s.to_string()).collect()),
            cwd: None,
            env: Some(
                env.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            secret_env: None,
            command_sha256: None,
            url: None,
            timeout_ms: None,
        },
        restart_budget: None,
    }
}

/// Processes whose environment holds `marker` (a unique value per test).
fn pids_with_env(marker: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) {
            if String::from_utf8_lossy(&env).contains(marker) && alive(pid) {
                out.push(pid);
            }
        }
    }
    out
}

fn marker() -> String {
    format!("m{}", uuid::Uuid::new_v4().simple())
}

async fn assign(rig: &Rig, session: &str, servers: Vec<McpServerSpec>) {
    let mut p = assign_params(session, 1);
    p.mcp_servers = servers;
    let r: AssignResult = rig.conn.call(Method::SessionAssign, &p).await.unwrap();
    assert!(r.accepted);
}

/// `session.ready`, and the last `session.status` seen before it.
async fn ready(rig: &mut Rig, session: &str) -> Vec<McpServerStatus> {
    let mut last = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (m, v) = tokio::time::timeout_at(deadline, rig.events.recv())
            .await
            .expect("session.ready within 30 s")
            .unwrap();
        if v["sessionId"] != session {
            continue;
        }
        if m == "session.status" {
            last = serde_json::from_value(v["mcpServers"].clone()).unwrap_or_default();
        }
        if m == "session.ready" {
            return last;
        }
    }
}

/// The next `session.status` whose server `key` satisfies `pred`.
async fn status_until(
    rig: &mut Rig,
    key: &str,
    pred: impl Fn(&McpServerStatus) -> bool,
) -> McpServerStatus {
    let v = next_event(rig, 60, |m, v| {
        m == "session.status"
            && statuses(v)
                .into_iter()
                .any(|s| s.server_key == key && pred(&s))
    })
    .await;
    statuses(&v)
        .into_iter()
        .find(|s| s.server_key == key)
        .unwrap()
}

fn statuses(v: &Value) -> Vec<McpServerStatus> {
    serde_json::from_value(v["mcpServers"].clone()).unwrap_or_default()
}

/// The params of the next event that satisfies `pred`, within `secs`.
async fn next_event(rig: &mut Rig, secs: u64, pred: impl Fn(&str, &Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let (m, v) = tokio::time::timeout_at(deadline, rig.events.recv())
            .await
            .unwrap_or_else(|_| panic!("no matching event within {secs} s"))
            .unwrap();
        if pred(&m, &v) {
            return v;
        }
    }
}

async fn open(rig: &Rig, session: &str, key: &str) -> Result<McpOpenResult, RpcError> {
    rig.conn
        .call(
            Method::McpOpen,
            &McpOpenParams {
                session_id: session.into(),
                server_key: key.into(),
            },
        )
        .await
}

fn send(rig: &Rig, session: &str, key: &str, payload: Value) {
    send_raw(rig, session, key, payload.to_string());
}

fn send_raw(rig: &Rig, session: &str, key: &str, payload: String) {
    rig.conn
        .link
        .notify(
            Method::McpFrame,
            &McpFrameParams {
                session_id: session.into(),
                server_key: key.into(),
                payload,
            },
        )
        .unwrap();
}

/// The next `mcp.frame` payload from `key` matching `pred`.
async fn frame(rig: &mut Rig, key: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let payload =
        |v: &Value| -> Value { serde_json::from_str(v["payload"].as_str().unwrap()).unwrap() };
    let v = next_event(rig, 30, |m, v| {
        m == "mcp.frame" && v["serverKey"] == key && pred(&payload(v))
    })
    .await;
    payload(&v)
}

async fn request(
    rig: &mut Rig,
    session: &str,
    key: &str,
    id: Value,
    method: &str,
    params: Value,
) -> Value {
    send(
        rig,
        session,
        key,
        json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}),
    );
    let want = id.clone();
    frame(rig, key, move |p| p["id"] == want).await
}

fn echo(id: i64, text: &str) -> (Value, &'static str, Value) {
    (
        json!(id),
        "tools/call",
        json!({"name": "echo", "arguments": {"message": text}}),
    )
}

#[tokio::test]
async fn a_stdio_server_initializes_lists_and_calls_echo() {
    let mut rig = Rig::start(Options::default()).await;
    let mark = marker();
    assign(
        &rig,
        "s",
        vec![stdio(
            "ev",
            "mcp-server-everything",
            &[],
            &[("MCP_MARK", &mark)],
        )],
    )
    .await;
    let servers = ready(&mut rig, "s").await;
    assert_eq!(servers.len(), 1);
    assert_eq!(servers[0].state, McpServerState::Ready, "{servers:?}");
    assert_eq!(pids_with_env(&mark).len(), 1, "one server process");
    assert!(open(&rig, "s", "ev").await.unwrap().opened);

    // A client's initialize is answered from the server's own result.
    let init = request(
        &mut rig,
        "s",
        "ev",
        json!(1),
        "initialize",
        json!({
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}),
    )
    .await;
    assert!(init["result"]["serverInfo"]["name"].is_string(), "{init}");
    send(
        &rig,
        "s",
        "ev",
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    );

    let list = request(&mut rig, "s", "ev", json!("two"), "tools/list", json!({})).await;
    let tools: Vec<&str> = list["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(tools.contains(&"echo"), "{tools:?}");

    let (id, m, p) = echo(3, "hello over bmx");
    let r = request(&mut rig, "s", "ev", id, m, p).await;
    assert_eq!(r["result"]["content"][0]["text"], "Echo: hello over bmx");

    // Not JSON-RPC: an MCP error back, never silence.
    send_raw(&rig, "s", "ev", "{not json".into());
    let e = frame(&mut rig, "ev", |p| p["error"]["code"] == -32700).await;
    assert_eq!(e["id"], Value::Null);
    // The executor's own ids are reserved.
    let e = request(
        &mut rig,
        "s",
        "ev",
        json!("bmx:mine"),
        "tools/list",
        json!({}),
    )
    .await;
    assert_eq!(e["error"]["data"]["reason"], "reserved_id");

    // Unknown server: -32014.
    let e = open(&rig, "s", "nope").await.unwrap_err();
    assert_eq!(e.code, -32014);
    assert_eq!(e.reason(), Some("unknown_server"));

    // Session stop: the server is gone, no orphan.
    let _: StopResult = rig
        .conn
        .call(
            Method::SessionStop,
            &StopParams {
                session_id: "s".into(),
                reason: "done".into(),
                deadline_ms: Some(2_000),
                keep_workspace: false,
            },
        )
        .await
        .unwrap();
    eventually("server gone", || pids_with_env(&mark).is_empty()).await;
    rig.shutdown().await;
}

#[tokio::test]
async fn progress_notifications_and_a_filesystem_server_in_the_workspace() {
    let mut rig = Rig::start(Options::default()).await;
    let ws = bmx::executor::actors::session::workspace_dir(rig.work.path(), "f");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("note.txt"), "inside the workspace\n").unwrap();
    let ws = ws.canonicalize().unwrap();
    assign(
        &rig,
        "f",
        vec![
            stdio("ev", "mcp-server-everything", &[], &[]),
            stdio("fs", "mcp-server-filesystem", &[ws.to_str().unwrap()], &[]),
        ],
    )
    .await;
    let servers = ready(&mut rig, "f").await;
    assert!(
        servers.iter().all(|s| s.state == McpServerState::Ready),
        "{servers:?}"
    );
    open(&rig, "f", "ev").await.unwrap();
    open(&rig, "f", "fs").await.unwrap();

    let path = ws.join("note.txt");
    let r = request(
        &mut rig,
        "f",
        "fs",
        json!(1),
        "tools/call",
        json!({"name": "read_text_file", "arguments": {"path": path}}),
    )
    .await;
    assert!(
        r["result"]["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("inside the workspace"),
        "{r}"
    );
    let r = request(
        &mut rig,
        "f",
        "fs",
        json!(2),
        "tools/call",
        json!({"name": "read_text_file", "arguments": {"path": "/etc/hostname"}}),
    )
    .await;
    assert!(
        r["result"]["isError"] == true || r["error"].is_object(),
        "outside the root: {r}"
    );

    send(
        &rig,
        "f",
        "ev",
        json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {
        "name": "trigger-long-running-operation", "arguments": {"duration": 1, "steps": 3},
        "_meta": {"progressToken": "tok-9"}}}),
    );
    let p = frame(&mut rig, "ev", |p| p["method"] == "notifications/progress").await;
    assert_eq!(p["params"]["progressToken"], "tok-9");
    let done = frame(&mut rig, "ev", |p| p["id"] == 9).await;
    assert!(done["result"].is_object(), "{done}");
    rig.shutdown().await;
}

#[tokio::test]
async fn a_killed_server_answers_in_flight_restarts_then_runs_out_of_budget() {
    let mut rig = Rig::start(Options::default()).await;
    let mark = marker();
    let mut spec = stdio("ev", "mcp-server-everything", &[], &[("MCP_MARK", &mark)]);
    spec.restart_budget = Some(McpRestartBudget {
        max_restarts: 1,
        window_ms: 60_000,
    });
    assign(&rig, "k", vec![spec]).await;
    ready(&mut rig, "k").await;
    open(&rig, "k", "ev").await.unwrap();

    // A request in flight when the server dies gets an error.
    send(
        &rig,
        "k",
        "ev",
        json!({"jsonrpc": "2.0", "id": "slow", "method": "tools/call", "params": {
        "name": "trigger-long-running-operation", "arguments": {"duration": 20, "steps": 2}}}),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pids = pids_with_env(&mark);
    assert_eq!(pids.len(), 1);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let e = frame(&mut rig, "ev", |p| p["id"] == "slow").await;
    assert_eq!(e["error"]["code"], -32603, "{e}");
    assert_eq!(e["error"]["message"], "server restarted");

    // Restarted: ready again, a new process, answers as before.
    let s = status_until(&mut rig, "ev", |s| {
        s.state == McpServerState::Ready && s.restarts == 1
    })
    .await;
    assert!(s.last_error.is_some());
    let again = pids_with_env(&mark);
    assert_eq!(again.len(), 1);
    assert_ne!(again, pids);
    let (id, m, p) = echo(2, "back");
    let r = request(&mut rig, "k", "ev", id, m, p).await;
    assert_eq!(r["result"]["content"][0]["text"], "Echo: back");

    // Past the budget: unavailable, and every request gets an MCP error.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(again[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let s = status_until(&mut rig, "ev", |s| s.state == McpServerState::Unavailable).await;
    assert_eq!(s.reason.as_deref(), Some("restart_budget_exhausted"));
    let (id, m, p) = echo(3, "gone");
    let r = request(&mut rig, "k", "ev", id, m, p).await;
    assert_eq!(r["error"]["code"], -32603, "{r}");
    let e = open(&rig, "k", "ev").await.unwrap_err();
    assert_eq!(e.code, -32014);
    assert_eq!(e.reason(), Some("restart_budget_exhausted"));
    eventually("no server left", || pids_with_env(&mark).is_empty()).await;
    rig.shutdown().await;
}

#[tokio::test]
async fn a_sha256_pin_is_checked_and_a_failed_server_never_blocks_ready() {
    let mut rig = Rig::start(Options::default()).await;
    let real = std::fs::canonicalize(peer("mcp-server-everything")).unwrap();
    let digest = bmx::executor::mcp::launch::sha256_file(&real).unwrap();
    let mut good = stdio("good", "mcp-server-everything", &[], &[]);
    good.transport.command_sha256 = Some(digest.to_uppercase());
    let mut bad = stdio("bad", "mcp-server-everything", &[], &[]);
    bad.transport.command_sha256 = Some("00".repeat(32));
    let mut missing = stdio("missing", "mcp-server-everything", &[], &[]);
    missing.transport.command = Some("/nonexistent/mcp-server".into());
    let mut exits = stdio(
        "exits",
        "mcp-server-everything",
        &["no-such-transport"],
        &[],
    );
    exits.transport.command = Some(peer("mcp-server-everything"));
    assign(&rig, "p", vec![good, bad, missing, exits]).await;
    let servers: BTreeMap<String, McpServerStatus> = ready(&mut rig, "p")
        .await
        .into_iter()
        .map(|s| (s.server_key.clone(), s))
        .collect();
    assert_eq!(servers["good"].state, McpServerState::Ready, "{servers:?}");
    assert_eq!(servers["bad"].state, McpServerState::Unavailable);
    assert_eq!(
        servers["bad"].reason.as_deref(),
        Some("command_sha256_mismatch")
    );
    assert_eq!(servers["missing"].state, McpServerState::Unavailable);
    assert_eq!(servers["exits"].state, McpServerState::Unavailable);
    assert_eq!(
        servers["exits"].reason.as_deref(),
        Some("initialize_failed")
    );
    assert_eq!(servers["exits"].restarts, 0);
    let e = open(&rig, "p", "bad").await.unwrap_err();
    assert_eq!(e.reason(), Some("command_sha256_mismatch"));
    rig.shutdown().await;
}

#[tokio::test]
async fn a_streamable_http_server() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut server = tokio::process::Command::new(peer("mcp-server-everything"))
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Up when it accepts.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "http server did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut rig = Rig::start(Options::default()).await;
    let spec = McpServerSpec {
        server_key: "web".into(),
        connection_origin: ConnectionOrigin::Environment,
        transport: McpTransport {
            kind: McpTransportType::Http,
            command: None,
            args: None,
            cwd: None,
            env: None,
            secret_env: None,
            command_sha256: None,
            url: Some(format!("http://127.0.0.1:{port}/mcp")),
            timeout_ms: Some(20_000),
        },
        restart_budget: None,
    };
    assign(&rig, "h", vec![spec]).await;
    let servers = ready(&mut rig, "h").await;
    assert_eq!(servers[0].state, McpServerState::Ready, "{servers:?}");
    open(&rig, "h", "web").await.unwrap();
    let (id, m, p) = echo(1, "over http");
    let r = request(&mut rig, "h", "web", id, m, p).await;
    assert_eq!(r["result"]["content"][0]["text"], "Echo: over http");
    send(
        &rig,
        "h",
        "web",
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "trigger-long-running-operation", "arguments": {"duration": 1, "steps": 2},
        "_meta": {"progressToken": 77}}}),
    );
    let p = frame(&mut rig, "web", |p| p["method"] == "notifications/progress").await;
    assert_eq!(p["params"]["progressToken"], 77);
    let done = frame(&mut rig, "web", |p| p["id"] == 2).await;
    assert!(done["result"].is_object(), "{done}");
    rig.shutdown().await;
    let _ = server.kill().await;
}

/// `secretEnv` reaches the server and nothing else: not bmx's logs at
/// trace level (the server prints it to stderr, which bmx logs at debug),
/// not a frame the harness gets (statuses, errors), not bmx's command line.
#[tokio::test]
async fn secret_env_reaches_the_server_and_never_bmx_output() {
    const SECRET: &str = "s3cret-VALUE-never-logged-8421";
    let mut stand_in = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let log_path = work.path().join("bmx.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args(["executor", "--url", &stand_in.url, "--token", TOKEN])
        .arg("--work-root")
        .arg(work.path())
        .env("RUST_LOG", "trace")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut conn = stand_in.next_conn().await;
    conn.register(10_000, 30_000).await;
    let (conn, mut events) = conn.serve();
    let mut spec = stdio("sec", "mcp-server-everything", &[], &[]);
    spec.transport.command = Some("sh".into());
    spec.transport.args = Some(vec![
        "-c".into(),
        format!(
            "echo \"the secret is $MCP_SECRET\" >&2; exec {}",
            peer("mcp-server-everything")
        ),
    ]);
    spec.transport.secret_env = Some(BTreeMap::from([(
        "MCP_SECRET".to_owned(),
        SECRET.to_owned(),
    )]));
    let mut p = assign_params("z", 1);
    p.mcp_servers = vec![spec];
    let _: AssignResult = conn.call(Method::SessionAssign, &p).await.unwrap();
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !seen
        .iter()
        .any(|(m, _): &(String, Value)| m == "session.ready")
    {
        let e = tokio::time::timeout_at(deadline, events.recv())
            .await
            .unwrap()
            .unwrap();
        seen.push(e);
    }
    let servers = pids_with_env(SECRET);
    assert_eq!(servers.len(), 1, "the server (and only it) has the secret");
    assert_ne!(servers[0] as u32, child.id().unwrap());
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", child.id().unwrap())).unwrap();
    assert!(!String::from_utf8_lossy(&cmdline).contains(SECRET));
    let _: McpOpenResult = conn
        .call(
            Method::McpOpen,
            &McpOpenParams {
                session_id: "z".into(),
                server_key: "sec".into(),
            },
        )
        .await
        .unwrap();
    // A crash: the stderr tail goes into lastError and the log.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(servers[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let e = tokio::time::timeout_at(deadline, events.recv())
            .await
            .unwrap()
            .unwrap();
        let restarted = e.0 == "session.status"
            && e.1["mcpServers"][0]["restarts"] == 1
            && e.1["mcpServers"][0]["state"] == "ready";
        seen.push(e);
        if restarted {
            break;
        }
    }
    let _: StopResult = conn
        .call(
            Method::SessionStop,
            &StopParams {
                session_id: "z".into(),
                reason: "done".into(),
                deadline_ms: Some(2_000),
                keep_workspace: false,
            },
        )
        .await
        .unwrap();
    eventually("server gone", || pids_with_env(SECRET).is_empty()).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    let logged = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        logged.contains("mcp server stderr"),
        "the server's stderr is logged at debug"
    );
    assert!(
        logged.contains("<redacted>"),
        "and the secret in it is redacted"
    );
    assert!(!logged.contains(SECRET), "the secret is in bmx's log");
    for (m, v) in &seen {
        assert!(!v.to_string().contains(SECRET), "{m} carries the secret");
    }
}

//! Issue 11, the `service` origin: an MCP server the platform runs,
//! registered on the harness (`POST /v1/sessions/{id}/mcp-services`),
//! reached by the session's processes at `$BMX_MCP_<KEY>_URL` (a loopback
//! endpoint of the executor), over `mcp.frame` executor → harness → the
//! service.
//!
//! Everything real: the harness and the executor (in process, on
//! loopback), `@modelcontextprotocol/server-everything` in its Streamable
//! HTTP mode as the platform's service (tests/peers), and `curl` run by a
//! session process as the MCP client.

use crate::harness_common;
use harness_common::*;
use serde_json::{json, Value};
use std::time::Duration;

const API_TOKEN: &str = "mcp-service-api-token";

fn peer(bin: &str) -> String {
    format!(
        "{}/tests/peers/node_modules/.bin/{bin}",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// server-everything over Streamable HTTP on `port`, once it accepts.
async fn everything_http(port: u16) -> tokio::process::Child {
    let server = tokio::process::Command::new(peer("mcp-server-everything"))
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the http server did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server
}

/// Run `script` with `sh -c` as a process of the session; its stdout.
async fn run(client: &bmx::client::ApiClient, sid: &str, pid: &str, script: &str) -> String {
    let (status, p) = client
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            &json!({"processId": pid, "argv": ["sh", "-c", script]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{p}");
    let mut out = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (status, r) = client
            .get(&format!(
                "/v1/sessions/{sid}/processes/{pid}/output?stream=stdout&cursor={cursor}&waitMs=2000"
            ))
            .await
            .unwrap();
        assert_eq!(status, 200, "{r}");
        out.extend(bmx::wire::blob::base64_decode(r["data"].as_str().unwrap()).unwrap());
        cursor = r["nextCursor"].as_u64().unwrap();
        if r["eof"] == true {
            return String::from_utf8_lossy(&out).into_owned();
        }
    }
}

/// One JSON answer per line of `out`.
fn answers(out: &str) -> Vec<Value> {
    out.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// POST one MCP message to `$VAR` with curl, the answer on its own line.
fn curl(var: &str, msg: &Value) -> String {
    format!(
        "curl -sS -m 60 -X POST -H 'content-type: application/json' \
         -H 'accept: application/json, text/event-stream' --data '{msg}' \"${var}\"; echo\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_process_reaches_the_platforms_service_through_executor_and_harness() {
    let port = free_port();
    let mut service = everything_http(port).await;
    let (h, executor, _work) = harness_with_executor_tweaked(
        "exec-svc",
        |b| {
            b.heartbeat_ms(200)
                .lease_ttl_ms(10_000)
                .api_token(Some(API_TOKEN.into()))
        },
        |_| {},
    )
    .await;
    let client = api(&h)
        .token(Some(API_TOKEN.into()))
        .timeout(Duration::from_secs(90));
    let sid = "svc";
    let (status, v) = client
        .post(
            "/v1/sessions",
            &json!({"sessionId": sid, "mcpServers": [
                {"serverKey": "tools-1", "connectionOrigin": "service",
                 "transport": {"type": "http"}},
                {"serverKey": "down", "connectionOrigin": "service",
                 "transport": {"type": "http"}},
                {"serverKey": "later", "connectionOrigin": "service",
                 "transport": {"type": "http"}}]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{v}");

    // A service's url stays on the harness: never in session.assign.
    let (status, v) = client
        .post(
            "/v1/sessions",
            &json!({"mcpServers": [{"serverKey": "x", "connectionOrigin": "service",
                 "transport": {"type": "http", "url": "http://127.0.0.1:1/mcp"}}]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 400, "{v}");

    // Registration: unknown session 404, a key that is no service 404,
    // a bad url 400; the real ones 201.
    let register = |sid: &str, key: &str, url: String| {
        let client = &client;
        let path = format!("/v1/sessions/{sid}/mcp-services");
        let body = json!({"serverKey": key, "url": url, "timeoutMs": 20_000});
        async move { client.post(&path, &body).await.unwrap() }
    };
    let (status, _) = register("nope", "tools-1", format!("http://127.0.0.1:{port}/mcp")).await;
    assert_eq!(status, 404);
    let (status, v) = register(sid, "nope", format!("http://127.0.0.1:{port}/mcp")).await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["code"], -32014, "{v}");
    let (status, _) = register(sid, "tools-1", "ftp://x".into()).await;
    assert_eq!(status, 400);
    let (status, v) = register(sid, "tools-1", format!("http://127.0.0.1:{port}/mcp")).await;
    assert_eq!(status, 201, "{v}");
    assert!(!v.to_string().contains(&port.to_string()), "{v}");
    let dead = free_port();
    let (status, _) = register(sid, "down", format!("http://127.0.0.1:{dead}/mcp")).await;
    assert_eq!(status, 201);

    // The endpoint is in the environment, on loopback.
    let out = run(&client, sid, "env", "echo \"$BMX_MCP_TOOLS_1_URL\"").await;
    assert!(out.starts_with("http://127.0.0.1:"), "{out}");
    assert!(out.trim_end().ends_with("/mcp"), "{out}");

    // initialize, tools/list and tools/call through the tunnel.
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "curl", "version": "1"}}});
    let list = json!({"jsonrpc": "2.0", "id": "two", "method": "tools/list", "params": {}});
    let call = json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
        "params": {"name": "echo", "arguments": {"message": "from a session process"}}});
    let script = [
        curl("BMX_MCP_TOOLS_1_URL", &init),
        curl("BMX_MCP_TOOLS_1_URL", &list),
        curl("BMX_MCP_TOOLS_1_URL", &call),
    ]
    .concat();
    let out = run(&client, sid, "calls", &script).await;
    let a = answers(&out);
    assert_eq!(a.len(), 3, "{out}");
    assert_eq!(a[0]["id"], 1, "{out}");
    assert!(a[0]["result"]["capabilities"]["tools"].is_object(), "{out}");
    assert_eq!(a[1]["id"], "two", "the client's own id back: {out}");
    let tools: Vec<&str> = a[1]["result"]["tools"]
        .as_array()
        .unwrap_or_else(|| panic!("{out}"))
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(tools.contains(&"echo"), "{tools:?}");
    assert_eq!(a[2]["id"], 3);
    assert_eq!(
        a[2]["result"]["content"][0]["text"], "Echo: from a session process",
        "{out}"
    );

    // A key with no registered service: -32014, as an MCP error.
    let out = run(&client, sid, "unknown", &curl("BMX_MCP_LATER_URL", &call)).await;
    let a = answers(&out);
    assert_eq!(a.len(), 1, "{out}");
    assert_eq!(a[0]["id"], 3, "{out}");
    assert_eq!(a[0]["error"]["code"], -32014, "{out}");

    // A service that is down: an MCP error, never a hang.
    let out = run(&client, sid, "down", &curl("BMX_MCP_DOWN_URL", &call)).await;
    let a = answers(&out);
    assert_eq!(a.len(), 1, "{out}");
    assert_eq!(a[0]["id"], 3, "{out}");
    assert!(a[0]["error"]["code"].is_i64(), "{out}");

    // Registered later: the next use reaches it.
    let (status, _) = register(sid, "later", format!("http://127.0.0.1:{port}/mcp")).await;
    assert_eq!(status, 201);
    let out = run(&client, sid, "later", &curl("BMX_MCP_LATER_URL", &call)).await;
    let a = answers(&out);
    assert_eq!(
        a[0]["result"]["content"][0]["text"], "Echo: from a session process",
        "{out}"
    );

    // Bounds of the local endpoint: not a JSON-RPC message, too large,
    // GET (no server stream).
    let script = "curl -sS -o /dev/null -w '%{http_code}\\n' -X POST -H 'content-type: application/json' --data 'nonsense' \"$BMX_MCP_TOOLS_1_URL\"\n\
         head -c 3000000 /dev/zero | tr '\\0' 'x' > big.txt\n\
         curl -sS -o /dev/null -w '%{http_code}\\n' -X POST -H 'content-type: application/json' --data-binary @big.txt \"$BMX_MCP_TOOLS_1_URL\"\n\
         curl -sS -o /dev/null -w '%{http_code}\\n' \"$BMX_MCP_TOOLS_1_URL\"\n\
         curl -sS -o /dev/null -w '%{http_code}\\n' \"${BMX_MCP_TOOLS_1_URL%/*/mcp}/guess/mcp\"\n";
    let out = run(&client, sid, "bounds", script).await;
    let codes: Vec<&str> = out.lines().collect();
    assert_eq!(codes, ["400", "413", "405", "404"], "{out}");

    // The session ends: the endpoint goes with it.
    let (status, v) = client.delete(&format!("/v1/sessions/{sid}")).await.unwrap();
    assert_eq!(status, 200, "{v}");
    executor.shutdown().await;
    h.shutdown().await;
    let _ = service.kill().await;
}

//! Issue 16: the web console served by the harness. Over real sockets:
//! what `/` and the assets are served with (types, caching, CSP, gzip) and
//! the browser login's rules (cookie, CSRF, Origin on WebSockets); then the
//! whole console in a real browser: `tests/peers/console.mjs` drives
//! Debian's chromium (headless) through playwright-core against a real
//! harness and executor. Screenshots land in `target/console-shots/`.

use crate::harness_common;
use bmx::executor::ExecutorHandle;
use bmx::harness::HarnessHandle;
use futures_util::StreamExt;
use harness_common::harness_with_executor_tweaked;
use serde_json::{json, Value};
use std::time::Duration;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

const TOKEN: &str = "console-test-api-token";
const EXECUTOR: &str = "console-e";
/// Generous: the machine may be busy building.
const DEADLINE: Duration = Duration::from_secs(60);

struct Rig {
    h: HarnessHandle,
    executor: ExecutorHandle,
    _work: tempfile::TempDir,
}

async fn rig() -> Rig {
    let (h, executor, work) = harness_with_executor_tweaked(
        EXECUTOR,
        |b| b.api_token(Some(TOKEN.to_owned())),
        |c| {
            // The offline ACP test agent, for the agent-turn page.
            c.agents = vec![(
                "test".into(),
                vec![
                    "node".into(),
                    format!(
                        "{}/tests/peers/agent/test-agent.mjs",
                        env!("CARGO_MANIFEST_DIR")
                    ),
                ],
            )];
            c.interaction_timeout = Duration::from_secs(120);
        },
    )
    .await;
    Rig {
        h,
        executor,
        _work: work,
    }
}

impl Rig {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.h.api_url())
    }

    async fn stop(self) {
        self.executor.shutdown().await;
        self.h.shutdown().await;
    }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(DEADLINE)
        .build()
        .unwrap()
}

fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

async fn json_of(r: reqwest::Response) -> Value {
    let b = r.bytes().await.unwrap();
    serde_json::from_slice(&b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&b)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_and_its_assets_are_served_with_their_headers() {
    let rig = rig().await;
    let c = http();
    let r = c
        .get(rig.url("/"))
        .header("accept-encoding", "identity")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "content-type"), "text/html; charset=utf-8");
    assert_eq!(header(&r, "cache-control"), "no-cache");
    let csp = header(&r, "content-security-policy");
    assert!(
        csp.contains("script-src 'self'") && csp.contains("style-src 'self'"),
        "{csp}"
    );
    assert!(
        !csp.contains("unsafe-inline") && !csp.contains("unsafe-eval"),
        "{csp}"
    );
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert_eq!(header(&r, "x-content-type-options"), "nosniff");
    let html = r.text().await.unwrap();
    let start = html
        .find("/console/assets/")
        .expect("the page names its assets");
    let base = &html[start..start + "/console/assets/".len() + 16];
    assert!(html.contains(&format!("{base}/app.js")), "{html}");

    // A hashed asset: cached for good, gzip when accepted.
    let js = format!("{base}/vendor/xterm.mjs");
    let r = c
        .get(rig.url(&js))
        .header("accept-encoding", "gzip, br")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "content-type"), "text/javascript; charset=utf-8");
    assert_eq!(
        header(&r, "cache-control"),
        "public, max-age=31536000, immutable"
    );
    assert_eq!(header(&r, "content-encoding"), "gzip");
    assert_eq!(header(&r, "vary"), "accept-encoding");
    let gz = r.bytes().await.unwrap();
    let mut plain = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut plain).unwrap();
    let r = c.get(rig.url(&js)).send().await.unwrap();
    assert_eq!(header(&r, "content-encoding"), "");
    let raw = r.bytes().await.unwrap();
    assert_eq!(plain, raw, "the gzip form is the same file");
    assert!(gz.len() < raw.len() / 2);
    assert!(String::from_utf8_lossy(&raw).contains("Terminal"));

    let css = c
        .get(rig.url(&format!("{base}/app.css")))
        .send()
        .await
        .unwrap();
    assert_eq!(header(&css, "content-type"), "text/css; charset=utf-8");
    // Another hash, or a path outside the set: 404.
    for bad in [
        "/console/assets/0000000000000000/app.js".to_owned(),
        format!("{base}/..%2F..%2FCargo.toml"),
        format!("{base}/nope.js"),
    ] {
        let r = c.get(rig.url(&bad)).send().await.unwrap();
        assert_eq!(r.status(), 404, "{bad}");
    }
    // The page is public; the API still is not.
    let r = c.get(rig.url("/v1/executors")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    rig.stop().await;
}

/// Log in; (cookie header value, CSRF token).
async fn login(c: &reqwest::Client, rig: &Rig) -> (String, String) {
    let r = c
        .post(rig.url("/console/login"))
        .body(json!({"token": TOKEN}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let set = header(&r, "set-cookie");
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age="] {
        assert!(set.contains(attr), "{set}");
    }
    let cookie = set.split(';').next().unwrap().to_owned();
    let v = json_of(r).await;
    (cookie, v["csrf"].as_str().unwrap().to_owned())
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Attach to a terminal's relay as a browser would: cookie and `Origin`
/// as given; the HTTP status when the upgrade is refused.
async fn ws_attach(
    rig: &Rig,
    tid: &str,
    cookie: Option<&str>,
    origin: Option<&str>,
) -> Result<Ws, u16> {
    let url = format!(
        "ws://{}/v1/executors/{EXECUTOR}/terminals/{tid}/attach",
        rig.h.local_addr()
    );
    let mut req = url.into_client_request().unwrap();
    if let Some(c) = cookie {
        req.headers_mut().insert("cookie", c.parse().unwrap());
    }
    if let Some(o) = origin {
        req.headers_mut().insert("origin", o.parse().unwrap());
    }
    match tokio::time::timeout(DEADLINE, tokio_tungstenite::connect_async(req))
        .await
        .expect("the upgrade answers")
    {
        Ok((ws, _)) => Ok(ws),
        Err(WsError::Http(resp)) => Err(resp.status().as_u16()),
        Err(e) => panic!("attach: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cookies_need_csrf_to_write_and_the_own_origin_to_upgrade() {
    let rig = rig().await;
    let c = http();
    let own = rig.h.api_url();

    // Login: a wrong token, a foreign page, a body too large.
    let r = c
        .post(rig.url("/console/login"))
        .body(json!({"token": "wrong"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert!(header(&r, "set-cookie").is_empty());
    let r = c
        .post(rig.url("/console/login"))
        .header("origin", "http://evil.example")
        .body(json!({"token": TOKEN}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "login from a foreign page");
    let r = c
        .post(rig.url("/console/login"))
        .body(format!(r#"{{"token": "{}"}}"#, "x".repeat(8192)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);

    let (cookie, csrf) = login(&c, &rig).await;
    let r = c
        .get(rig.url("/console/session"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    let v = json_of(r).await;
    assert_eq!(v["authenticated"], true, "{v}");
    assert_eq!(v["csrf"], csrf.as_str());
    assert_eq!(v["loopbackOnly"], false);

    // Reads pass with the cookie; writes need the CSRF token.
    let r = c
        .get(rig.url("/v1/executors"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .post(rig.url("/v1/sessions"))
        .header("cookie", &cookie)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(json_of(r).await["error"]["data"]["reason"], "csrf");
    let r = c
        .post(rig.url("/v1/sessions"))
        .header("cookie", &cookie)
        .header("x-csrf-token", "0".repeat(64))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "a wrong CSRF token");
    let r = c
        .post(rig.url("/v1/sessions"))
        .header("cookie", &cookie)
        .header("origin", "http://evil.example")
        .header("x-csrf-token", &csrf)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "a foreign page, even with the token");
    assert_eq!(json_of(r).await["error"]["data"]["reason"], "cross_origin");
    let r = c
        .post(rig.url("/v1/sessions"))
        .header("cookie", &cookie)
        .header("origin", &own)
        .header("x-csrf-token", &csrf)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    // Bearer needs neither.
    let r = c
        .post(rig.url(&format!("/v1/executors/{EXECUTOR}/terminals")))
        .bearer_auth(TOKEN)
        .header("origin", "http://evil.example")
        .body(json!({"argv": ["sh"], "cols": 80, "rows": 24}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let tid = json_of(r).await["terminalId"].as_str().unwrap().to_owned();

    // The relay WebSocket with the cookie: only from the harness's origin.
    assert_eq!(
        ws_attach(&rig, &tid, Some(&cookie), Some("http://evil.example"))
            .await
            .err(),
        Some(403),
        "a foreign Origin"
    );
    assert_eq!(
        ws_attach(&rig, &tid, Some(&cookie), None).await.err(),
        Some(403),
        "no Origin"
    );
    assert_eq!(
        ws_attach(&rig, &tid, None, Some(&own)).await.err(),
        Some(401),
        "no cookie"
    );
    let mut ws = ws_attach(&rig, &tid, Some(&cookie), Some(&own))
        .await
        .expect("the harness's own origin upgrades");
    let first = tokio::time::timeout(DEADLINE, ws.next())
        .await
        .expect("a notice")
        .expect("open")
        .unwrap();
    let Message::Text(t) = first else {
        panic!("expected the attached notice, got {first:?}")
    };
    let v: Value = serde_json::from_str(t.as_str()).unwrap();
    assert_eq!(v["type"], "attached", "{v}");
    drop(ws);

    // Logged out: the cookie is dead.
    let r = c
        .post(rig.url("/console/logout"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert!(header(&r, "set-cookie").contains("Max-Age=0"));
    let r = c
        .get(rig.url("/v1/executors"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_only_pages_of_the_loopback_harness_pass() {
    let h = harness_common::harness().await;
    let c = http();
    let url = |p: &str| format!("{}{p}", h.api_url());
    let v = json_of(c.get(url("/console/session")).send().await.unwrap()).await;
    assert_eq!(v["loopbackOnly"], true, "{v}");
    assert_eq!(v["authenticated"], true, "{v}");
    // No login to do.
    let r = c
        .post(url("/console/login"))
        .body(json!({"token": "x"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // Tools (no Origin) and the page itself pass; other pages do not.
    assert_eq!(
        c.get(url("/v1/executors")).send().await.unwrap().status(),
        200
    );
    let own = h.api_url();
    let r = c
        .get(url("/v1/executors"))
        .header("origin", &own)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .post(url("/v1/sessions"))
        .header("origin", "http://evil.example")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "a cross-site POST to an open harness");
    // DNS rebinding: the name agrees with the Host, but is not loopback.
    let port = h.local_addr().port();
    let r = c
        .get(url("/v1/executors"))
        .header("host", format!("rebind.example:{port}"))
        .header("origin", format!("http://rebind.example:{port}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(json_of(r).await["error"]["data"]["reason"], "not_loopback");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_a_real_browser() {
    let chromium = std::path::Path::new("/usr/bin/chromium");
    assert!(
        chromium.exists(),
        "Debian's chromium is needed (scripts/test.sh installs it)"
    );
    let rig = rig().await;
    let open = harness_common::harness().await;
    let root = env!("CARGO_MANIFEST_DIR");
    let shots = format!("{root}/target/console-shots");
    run_browser_script(
        "console.mjs",
        &[
            ("BMX_CONSOLE_URL", rig.h.api_url()),
            ("BMX_API_TOKEN", TOKEN.to_owned()),
            ("BMX_EXECUTOR_ID", EXECUTOR.to_owned()),
            ("BMX_OPEN_URL", open.api_url()),
            ("BMX_SHOTS", shots.clone()),
        ],
        Duration::from_secs(600),
    )
    .await;
    for shot in [
        "login",
        "executors",
        "sessions",
        "session",
        "process",
        "terminal",
        "terminal-read-only",
        "turn",
    ] {
        let p = format!("{shots}/{shot}.png");
        let len = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
        assert!(len > 1000, "screenshot {p}");
    }
    open.shutdown().await;
    rig.stop().await;
}

/// Run a playwright script of tests/peers with node (chromium behind it),
/// with `envs`, within `within`; it must exit 0 and print `step: done`.
pub(crate) async fn run_browser_script(script: &str, envs: &[(&str, String)], within: Duration) {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg(format!("{root}/tests/peers/{script}"))
        .current_dir(format!("{root}/tests/peers"))
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .kill_on_drop(true);
    let out = tokio::time::timeout(within, cmd.output())
        .await
        .expect("the browser run ends")
        .expect("node runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains("step: done"), "{stdout}");
}

//! Issue 56, item 1: content a session chose never runs on the harness's
//! origin. The review's attack: an agent wrote `report.html`; an operator
//! logged in to the console opened it (`GET /v1/artifacts/{id}` served it
//! inline as `text/html`), and its script read the CSRF token, created a
//! session and ran `id` on an executor through the bash tool.
//!
//! A real harness (API token, blob store) and a real executor: the
//! payload is put in a session's workspace and published as an artifact;
//! both it and the session-file route answer as sandboxed downloads
//! (checked here on the headers), and `tests/peers/web-content.mjs` drives
//! Debian's chromium through the attack (see there), then a DNS-rebinding
//! page against a harness without a token. Afterwards the harness holds
//! exactly the one session the *control* (the payload served as HTML on
//! the harness's origin by the browser test itself) created, whose `id`
//! ran: the payload works, and nothing the harness served ran it.

use crate::harness_common::{self, harness_with_executor_tweaked};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

const TOKEN: &str = "console-content-api-token";
const EXECUTOR: &str = "content-e";
const DEADLINE: Duration = Duration::from_secs(60);

/// The agent's report: it sets its title at once (so a test can see that
/// a script ran at all), then attacks with the operator's cookie.
const REPORT: &str = r#"<!doctype html>
<html><head><title>report</title></head><body><p>Quarterly report</p>
<script>
document.title = 'RAN';
(async () => {
  const s = await (await fetch('/console/session')).json();
  const h = {'content-type': 'application/json', 'x-csrf-token': s.csrf};
  const r = await fetch('/v1/sessions', {method: 'POST', headers: h,
    body: JSON.stringify({metadata: {pwned: location.pathname}})});
  const sess = await r.json();
  await fetch('/v1/sessions/' + sess.sessionId + '/tools', {method: 'POST', headers: h,
    body: JSON.stringify({tool: 'bash', input: {command: 'id > pwned.txt'}})});
  document.title = 'PWNED';
})();
</script></body></html>
"#;

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(DEADLINE)
        .build()
        .unwrap()
}

async fn call(
    c: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    body: Option<Vec<u8>>,
) -> (u16, Value) {
    let mut r = c.request(method, url).bearer_auth(TOKEN);
    if let Some(b) = body {
        r = r.body(b);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    let b = r.bytes().await.unwrap();
    (status, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

/// A `bash` tool call in session `sid`: its answer.
async fn bash(c: &reqwest::Client, api: &str, sid: &str, command: &str) -> (u16, Value) {
    let body = json!({"tool": "bash", "input": {"command": command}});
    call(
        c,
        reqwest::Method::POST,
        format!("{api}/v1/sessions/{sid}/tools"),
        Some(body.to_string().into_bytes()),
    )
    .await
}

async fn get(c: &reqwest::Client, url: &str) -> reqwest::Response {
    c.get(url).bearer_auth(TOKEN).send().await.unwrap()
}

fn header<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_s_html_runs_nothing_in_a_real_browser() {
    let chromium = std::path::Path::new("/usr/bin/chromium");
    assert!(
        chromium.exists(),
        "Debian's chromium is needed (scripts/test.sh installs it)"
    );
    let blobs = tempfile::tempdir().unwrap();
    let store = bmx::harness::blob::FsBlobStore::open(blobs.path().join("blobs"), 1 << 30).unwrap();
    let (h, executor, _work) = harness_with_executor_tweaked(
        EXECUTOR,
        |b| b.api_token(Some(TOKEN.into())).blob_store(Arc::new(store)),
        |_| {},
    )
    .await;
    let open = harness_common::harness().await;
    let c = http();
    let api = h.api_url();

    // The agent's session writes report.html; the platform publishes it.
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        format!("{api}/v1/sessions"),
        Some(b"{}".to_vec()),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let sid = v["sessionId"].as_str().unwrap().to_owned();
    let (s, v) = call(
        &c,
        reqwest::Method::PUT,
        format!("{api}/v1/sessions/{sid}/files/uploads/report.html"),
        Some(REPORT.as_bytes().to_vec()),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    // The agent also leaves it among the session's output files.
    let (s, v) = bash(
        &c,
        &api,
        &sid,
        "mkdir -p outputs && cp uploads/report.html outputs/",
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = call(
        &c,
        reqwest::Method::POST,
        format!("{api}/v1/sessions/{sid}/artifacts"),
        Some(
            json!({"path": "uploads/report.html"})
                .to_string()
                .into_bytes(),
        ),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        v["artifact"]["mimeType"], "text/html",
        "the executor's guess: {v}"
    );
    let artifact = format!(
        "/v1/artifacts/{}",
        v["artifact"]["artifactId"].as_str().unwrap()
    );
    let output = format!("/v1/sessions/{sid}/files/outputs/report.html");

    // What the harness answers: a sandboxed download, never HTML.
    for path in [&artifact, &output] {
        let r = get(&c, &format!("{api}{path}")).await;
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(
            header(&r, "content-type"),
            "application/octet-stream",
            "{path}"
        );
        assert_eq!(
            header(&r, "content-disposition"),
            "attachment; filename=\"report.html\"; filename*=UTF-8''report.html",
            "{path}"
        );
        assert_eq!(header(&r, "x-content-type-options"), "nosniff");
        assert!(
            header(&r, "content-security-policy").starts_with("sandbox;"),
            "{path}: {}",
            header(&r, "content-security-policy")
        );
        assert_eq!(header(&r, "x-frame-options"), "DENY");
        assert_eq!(header(&r, "referrer-policy"), "no-referrer");
        assert_eq!(r.bytes().await.unwrap().as_ref(), REPORT.as_bytes());
    }
    // Every API answer carries the headers too (JSON, errors included).
    for (path, status) in [("/v1/executors", 200), ("/v1/sessions/nope", 404)] {
        let r = get(&c, &format!("{api}{path}")).await;
        assert_eq!(r.status(), status);
        assert_eq!(
            header(&r, "content-security-policy"),
            "default-src 'none'; frame-ancestors 'none'",
            "{path}"
        );
        assert_eq!(header(&r, "x-content-type-options"), "nosniff");
        assert_eq!(header(&r, "x-frame-options"), "DENY");
    }

    crate::console::run_browser_script(
        "web-content.mjs",
        &[
            ("BMX_CONSOLE_URL", api.clone()),
            ("BMX_API_TOKEN", TOKEN.to_owned()),
            ("BMX_CONTENT_PATHS", format!("{artifact},{output}")),
            ("BMX_REPORT_HTML", REPORT.to_owned()),
            ("BMX_OPEN_PORT", open.local_addr().port().to_string()),
        ],
        Duration::from_secs(600),
    )
    .await;

    // The harness's view: only the control's session exists, and its
    // `id` ran; the paths the harness served created nothing.
    let (s, v) = call(&c, reqwest::Method::GET, format!("{api}/v1/sessions"), None).await;
    assert_eq!(s, 200);
    let pwned: Vec<&Value> = v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["metadata"]["pwned"].is_string())
        .collect();
    assert_eq!(pwned.len(), 1, "{pwned:?}");
    assert_eq!(pwned[0]["metadata"]["pwned"], "/control/report.html");
    let control = pwned[0]["sessionId"].as_str().unwrap();
    let (s, r) = bash(&c, &api, control, "cat pwned.txt").await;
    assert_eq!(s, 200, "{r}");
    assert!(r.to_string().contains("uid="), "the control's id ran: {r}");

    open.shutdown().await;
    executor.shutdown().await;
    h.shutdown().await;
}

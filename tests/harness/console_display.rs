//! Issue 20, RFB in the web console: a session's virtual display shown by
//! noVNC in a real browser, and a person taking over. A real harness (with
//! an API token), a real executor, a real Xvfb, x11vnc and xterm, and
//! Debian's chromium driven by `tests/peers/console-display.mjs`
//! (playwright-core).
//!
//! Here: the session, its display (started by a `computer_observe` call,
//! which names it), an xterm on it running bash in the workspace, and the
//! pointer put inside the xterm (a `computer_action` click: focus follows
//! the pointer, so keys the page sends in view-only mode *would* reach the
//! shell if they were sent). The script then opens the display page,
//! checks noVNC connected at the display's geometry, types a command in
//! view-only mode, takes over and types `echo $((6*7)) > out.txt`, and
//! reads the workspace through the API (`out.txt` holds 42; the view-only
//! command left no file); reconnects (a new one-time ticket); ends the
//! session and sees the page say so, and refuse to reconnect with the
//! harness's error.
//!
//! Needs `Xvfb`, `x11vnc` and `xterm` (scripts/test.sh installs them);
//! without them the test says so loudly and passes, except under CI.

use crate::harness_common;
use harness_common::harness_with_executor_tweaked;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const TOKEN: &str = "console-display-api-token";
const EXECUTOR: &str = "console-display-e";
/// Generous: the machine may be busy building.
const DEADLINE: Duration = Duration::from_secs(60);

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

fn tools_present() -> bool {
    let ok = on_path("Xvfb") && on_path("x11vnc") && on_path("xterm");
    if !ok {
        let msg = "Xvfb, x11vnc or xterm is not installed (scripts/test.sh installs them)";
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("SKIPPED: {msg}");
    }
    ok
}

/// The API with the bearer token.
struct Api {
    base: String,
    c: reqwest::Client,
}

impl Api {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .c
            .post(format!("{}{path}", self.base))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let b = r.bytes().await.unwrap();
        let v = serde_json::from_slice(&b)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&b)));
        (status, v)
    }

    /// A tool call; its text blocks and the data of its image block.
    async fn tool(&self, sid: &str, tool: &str, input: Value) -> (String, Option<String>) {
        let (status, r) = self
            .post(
                &format!("/v1/sessions/{sid}/tools"),
                json!({"tool": tool, "input": input}),
            )
            .await;
        assert_eq!(status, 200, "{tool}: {r}");
        assert_eq!(r["isError"], false, "{tool}: {r}");
        let blocks = r["content"].as_array().cloned().unwrap_or_default();
        let text = blocks
            .iter()
            .filter_map(|b| b["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n");
        let image = blocks
            .iter()
            .find(|b| b["type"] == "image")
            .and_then(|b| b["data"].as_str())
            .map(str::to_owned);
        (text, image)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_display_in_the_console_view_only_then_taken_over() {
    if !tools_present() {
        return;
    }
    assert!(
        std::path::Path::new("/usr/bin/chromium").exists(),
        "Debian's chromium is needed (scripts/test.sh installs it)"
    );
    let (h, executor, _work) =
        harness_with_executor_tweaked(EXECUTOR, |b| b.api_token(Some(TOKEN.to_owned())), |_| {})
            .await;
    let api = Api {
        base: h.api_url(),
        c: reqwest::Client::builder()
            .timeout(DEADLINE)
            .build()
            .unwrap(),
    };
    let (status, s) = api.post("/v1/sessions", json!({})).await;
    assert_eq!(status, 201, "{s}");
    let sid = s["sessionId"].as_str().unwrap().to_owned();

    // The display, and its name: "display :N, screen 1280x800 …".
    let (text, blank) = api.tool(&sid, "computer_observe", json!({})).await;
    let display = text
        .split_whitespace()
        .find(|w| w.starts_with(':'))
        .map(|w| w.trim_end_matches(',').to_owned())
        .unwrap_or_else(|| panic!("no display named in {text:?}"));
    assert!(text.contains("1280x800"), "{text}");
    let blank = blank.expect("a screenshot");

    // An xterm on it: bash in the workspace (the process's cwd).
    let (status, p) = api
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            json!({
                "processId": "xterm",
                "argv": ["xterm", "-geometry", "80x24+0+0", "-e", "bash", "--norc", "--noprofile"],
                "env": {"DISPLAY": display},
            }),
        )
        .await;
    assert_eq!(status, 200, "{p}");
    assert_eq!(p["state"], "running", "{p}");
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (_, now) = api.tool(&sid, "computer_observe", json!({})).await;
        if now.as_deref() != Some(blank.as_str()) {
            break;
        }
        assert!(Instant::now() < deadline, "the xterm never showed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The pointer inside the xterm (80x24 at the top left): keys sent to
    // the display now reach its shell.
    api.tool(
        &sid,
        "computer_action",
        json!({"action": "click", "x": 100, "y": 100}),
    )
    .await;

    let root = env!("CARGO_MANIFEST_DIR");
    let shots = format!("{root}/target/console-shots");
    crate::console::run_browser_script(
        "console-display.mjs",
        &[
            ("BMX_CONSOLE_URL", h.api_url()),
            ("BMX_API_TOKEN", TOKEN.to_owned()),
            ("BMX_SESSION_ID", sid.clone()),
            ("BMX_SHOTS", shots.clone()),
        ],
        Duration::from_secs(300),
    )
    .await;

    for shot in ["display-view-only", "display-taken-over"] {
        let p = format!("{shots}/{shot}.png");
        let len = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
        assert!(len > 1000, "screenshot {p}");
    }
    executor.shutdown().await;
    h.shutdown().await;
}

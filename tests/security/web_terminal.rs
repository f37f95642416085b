//! Issue 56, item 5: no control bytes from the wire reach a terminal. An
//! unauthenticated `displayName` holding OSC/CSI sequences and a carriage
//! return was printed raw by `bmx enrollments ls`: it set the window
//! title, cleared the screen and overwrote the line. The real CLI against
//! a real harness and a real visor: tables and lines show such text
//! escaped (`\x1b`, `\r`, `\n`), `--json` stays JSON that decodes to the
//! same strings, and neither holds a byte a terminal acts on.

use crate::security_common::Bmx;
use crate::visor_support;
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::time::Duration;

const TOKEN: &str = "terminal-test-api-token-4b";
/// A window title (OSC 0), a screen clear, a carriage return that would
/// overwrite the line, a newline that would forge a row, an 8-bit CSI
/// (U+009B), DEL and a right-to-left override.
const EVIL: &str =
    "\u{1b}]0;pwned\u{7}\u{1b}[2J\rlaptop\nFORGED ROW \u{9b}31m\u{7f}\u{202e}gpj.exe";

/// Bytes a terminal acts on, besides the line feeds ending lines.
fn terminal_controls(out: &str) -> Vec<char> {
    out.chars()
        .filter(|c| (c.is_control() && *c != '\n') || ('\u{202a}'..='\u{202e}').contains(c))
        .collect()
}

fn bmx(args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args(args)
        .env("RUST_LOG", "error")
        .env_remove("BMX_API_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "bmx {args:?}: {out:?}");
    (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enrollment_s_display_name_is_shown_escaped() {
    let (harness, api) = Bmx::harness(
        &["--token", "exec-1=terminal-exec-secret"],
        &[("BMX_API_TOKEN", TOKEN)],
        "warn",
    );
    // Anyone may create an enrollment: no token.
    let r = reqwest::Client::new()
        .post(format!("{api}/v1/enrollments"))
        .header("content-type", "application/json")
        .body(json!({"workspace": "/w", "displayName": EVIL, "fingerprint": EVIL}).to_string())
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let code = serde_json::from_slice::<Value>(&r.bytes().await.unwrap()).unwrap()["userCode"]
        .as_str()
        .unwrap()
        .to_owned();

    let (out, _) = bmx(&["enrollments", "ls", "--harness", &api, "--api-token", TOKEN]);
    assert_eq!(terminal_controls(&out), Vec::<char>::new(), "{out:?}");
    assert!(
        out.contains("\\x1b]0;pwned\\x07\\x1b[2J\\rlaptop\\nFORGED ROW"),
        "{out}"
    );
    assert!(out.contains("\\u{9b}31m\\x7f\\u{202e}gpj.exe"), "{out}");
    assert_eq!(out.lines().count(), 2, "the header and one row: {out}");

    let (out, _) = bmx(&[
        "enrollments",
        "ls",
        "--json",
        "--harness",
        &api,
        "--api-token",
        TOKEN,
    ]);
    assert_eq!(terminal_controls(&out), Vec::<char>::new(), "{out:?}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["data"]["enrollments"][0]["displayName"], EVIL, "{v}");

    let (out, _) = bmx(&[
        "enrollments",
        "approve",
        &code,
        "--harness",
        &api,
        "--api-token",
        TOKEN,
    ]);
    assert_eq!(terminal_controls(&out), Vec::<char>::new(), "{out:?}");
    assert!(out.starts_with("approved "), "{out}");
    assert_eq!(out.lines().count(), 1, "{out}");
    drop(harness);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_visor_session_s_title_is_shown_escaped() {
    let v = visor_support::Visor::start();
    let id = v.start_pty(&["sleep", "60"], json!({"title": EVIL})).await;
    let home = v.home.path().to_str().unwrap().to_owned();
    let (out, _) = bmx(&["visor", "--no-executor-confirm", "--home", &home, "ls"]);
    assert_eq!(terminal_controls(&out), Vec::<char>::new(), "{out:?}");
    assert!(out.contains(&id), "{out}");
    assert!(out.contains("\\x1b]0;pwned\\x07"), "{out}");
    assert_eq!(out.lines().count(), 2, "{out}");
    let (out, _) = bmx(&[
        "visor",
        "--no-executor-confirm",
        "--home",
        &home,
        "--json",
        "ls",
    ]);
    assert_eq!(terminal_controls(&out), Vec::<char>::new(), "{out:?}");
    let j: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(j["data"]["sessions"][0]["title"], EVIL, "{j}");
}

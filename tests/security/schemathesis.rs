//! Issue 18, "keep it closed": schemathesis against the OpenAPI document
//! the harness serves, with every check on, bounded in examples and time.
//!
//! A real `bmx harness` (with an API token) and a real `bmx executor`
//! connected to it, so sessions, processes and tool calls really run. The
//! gate: every response check (ST1xx): no server error, no undocumented
//! status, content type or header, no body its schema rejects; and no
//! request the document calls invalid accepted (ST201).
//! 501 (capability not offered, -32012) and 503 (no executor or executor
//! busy, -32029) are deliberate, documented answers and are expected; any
//! other 5xx fails. The other stateful and negative findings (ST202,
//! ST3xx: a schema-valid id of a session that does not exist is "rejected"
//! with 404) are printed, not gated.
//!
//! WebSocket-only routes are left out: schemathesis speaks plain HTTP. So
//! is `POST /v1/executors/{id}/drain`: a successful call would end the one
//! executor the rest of the run needs (tests/harness/drain.rs covers it).
//! schemathesis comes from `scripts/test.sh` (a pinned venv under
//! `target/py`); without it the test says so loudly and passes, except
//! under CI (`CI` set), where it fails.

use crate::security_common;
use std::path::PathBuf;
use std::process::Command;

const API_SECRET: &str = "st-api-secret-0f3a";
const EXEC_SECRET: &str = "st-exec-secret-9b2c";

fn schemathesis() -> Option<PathBuf> {
    let st = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/py/bin/st");
    st.exists().then_some(st)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_response_checks_pass() {
    let Some(st) = schemathesis() else {
        let msg = "schemathesis is not installed (scripts/test.sh installs it into target/py)";
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("SKIPPED: {msg}");
        return;
    };
    let security_common::Pair {
        harness,
        executor,
        api,
        work: _work,
        ..
    } = security_common::pair(API_SECRET, EXEC_SECRET, "warn").await;

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("schemathesis.toml");
    std::fs::write(
        &config,
        "[checks.not_a_server_error]\nexpected-statuses = [\"1XX\", \"2XX\", \"3XX\", \"4XX\", \"501\", \"503\"]\n",
    )
    .unwrap();
    let examples = std::env::var("BMX_ST_EXAMPLES").unwrap_or_else(|_| "15".into());
    let max_time = std::env::var("BMX_ST_SECONDS").unwrap_or_else(|_| "90".into());
    let out = tokio::task::spawn_blocking({
        let api = api.clone();
        let st = st.clone();
        let report = dir.path().to_owned();
        move || {
            Command::new(st)
                .current_dir(&report)
                .arg("--no-color")
                .arg("--config-file")
                .arg(&config)
                .args(["run", &format!("{api}/v1/openapi.json")])
                .args(["--checks", "all", "--workers", "1"])
                .args(["--max-examples", &examples, "--max-time", &max_time])
                .args(["--seed", "1"])
                .args(["-H", &format!("Authorization: Bearer {API_SECRET}")])
                .args([
                    "--exclude-path-regex",
                    "(/ws$|/attach$|^/v1/relay/|^/v1/executor/connect$|/drain$)",
                ])
                .output()
                .expect("run schemathesis")
        }
    })
    .await
    .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let _ = executor.stop();
    let _ = harness.stop();

    // The summary lists each failure kind once: "❌ ST101 Server error: 4".
    let summary = text.rsplit_once("\nFailures:").map_or("", |(_, s)| s);
    let mut gated = Vec::new();
    for line in summary.lines() {
        let is_code = |w: &&str| {
            w.len() == 5 && w.starts_with("ST") && w[2..].bytes().all(|b| b.is_ascii_digit())
        };
        let Some(code) = line.split_whitespace().find(is_code) else {
            continue;
        };
        eprintln!("schemathesis: {}", line.trim());
        // The gate: every response check (ST1xx: server errors, status
        // codes, content types, headers, schemas) and ST201 (a request the
        // document calls invalid was accepted). ST202 (a schema-valid
        // request refused: mostly 404/410 for sessions that do not exist or
        // ended, the world rather than the document) and ST3xx are printed
        // (docs/security.md).
        if code.starts_with("ST1") || code == "ST201" {
            gated.push(line.trim().to_owned());
        }
    }
    let generated = text
        .lines()
        .find(|l| l.contains("generated"))
        .unwrap_or("")
        .trim()
        .to_owned();
    eprintln!("schemathesis: {generated}");
    assert!(
        text.contains("generated"),
        "schemathesis did not run:\n{text}"
    );
    assert!(
        gated.is_empty(),
        "responses that break the document: {gated:?}\n{text}"
    );
}

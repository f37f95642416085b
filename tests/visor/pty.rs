//! PTY sessions of a real `bmx visor`: bash on a real PTY driven through
//! the socket, the screen model, resize, terminal queries, stop of the whole
//! tree, and the restart policy.

use crate::visor_support;
use serde_json::{json, Value};
use visor_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bash_computes_on_the_screen_and_in_the_output() {
    let v = Visor::start();
    let id = v
        .start_pty(
            &["bash", "--norc", "--noprofile", "-i"],
            json!({"cols": 80, "rows": 24}),
        )
        .await;
    let s = v.session(&id).await;
    assert_eq!(s["kind"], "pty");
    assert!(s["pid"].as_u64().is_some());
    v.keys(&id, "echo $((6*7))\r").await;
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let screen = v.screen_text(&id).await;
        if screen.lines().any(|l| l.trim() == "42") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "42 not on the screen:\n{screen}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let out = v.output(&id).await;
    assert!(out.lines().any(|l| l.trim() == "42"), "output: {out:?}");
    let screen = v
        .ok("GET", &format!("/v1/sessions/{id}/screen"), None)
        .await;
    assert_eq!(
        (screen["cols"].as_u64(), screen["rows"].as_u64()),
        (Some(80), Some(24))
    );

    // The size follows a resize (the program sees it through the kernel).
    v.ok(
        "POST",
        &format!("/v1/sessions/{id}/resize"),
        Some(json!({"cols": 100, "rows": 30})),
    )
    .await;
    v.keys(&id, "stty size\r").await;
    v.until(&format!("/v1/sessions/{id}/output"), "stty size", |o| {
        o["text"]
            .as_str()
            .unwrap_or("")
            .lines()
            .any(|l| l.trim() == "30 100")
    })
    .await;
    let s = v.session(&id).await;
    assert_eq!(
        (s["cols"].as_u64(), s["rows"].as_u64()),
        (Some(100), Some(30))
    );

    // The session's environment names the visor.
    v.keys(&id, "echo \"[$BMX_VISOR_SESSION]\"\r").await;
    let want = format!("[{id}]");
    v.until(
        &format!("/v1/sessions/{id}/output"),
        "BMX_VISOR_SESSION",
        |o| {
            o["text"]
                .as_str()
                .unwrap_or("")
                .lines()
                .any(|l| l.trim() == want)
        },
    )
    .await;

    // Bad input: typed errors.
    let (st, e) = v
        .req(
            "POST",
            &format!("/v1/sessions/{id}/keys"),
            Some(json!({"data": "%%%"})),
        )
        .await;
    assert_eq!((st, e["error"]["code"].as_str()), (400, Some("invalid")));
    let big = base64_simd::STANDARD.encode_to_string(vec![b'a'; 200 << 10]);
    let (st, _) = v
        .req(
            "POST",
            &format!("/v1/sessions/{id}/keys"),
            Some(json!({"data": big})),
        )
        .await;
    assert_eq!(st, 400);
    let (st, e) = v
        .req("POST", "/v1/sessions/nope/keys", Some(json!({"data": ""})))
        .await;
    assert_eq!((st, e["error"]["code"].as_str()), (404, Some("not_found")));
    let (st, _) = v
        .req(
            "POST",
            &format!("/v1/sessions/{id}/resize"),
            Some(json!({"cols": 0, "rows": 3})),
        )
        .await;
    assert_eq!(st, 400);

    let s = v.ok("POST", &format!("/v1/sessions/{id}/stop"), None).await;
    assert_eq!(s["state"], "exited");
    let (st, e) = v
        .req("POST", &format!("/v1/sessions/{id}/stop"), None)
        .await;
    assert_eq!((st, e["error"]["code"].as_str()), (409, Some("state")));
    let (st, _) = v
        .req(
            "POST",
            &format!("/v1/sessions/{id}/keys"),
            Some(json!({"data": ""})),
        )
        .await;
    assert_eq!(st, 409);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_position_query_is_answered() {
    let v = Visor::start();
    let script = r#"printf 'ab\033[6n'; IFS= read -rs -d R pos; echo; echo "pos=${pos#*[}""#;
    let id = v
        .start_pty(&["bash", "--norc", "--noprofile", "-c", script], json!({}))
        .await;
    v.until(&format!("/v1/sessions/{id}"), "exited", |s| {
        s["state"] == "exited"
    })
    .await;
    let out = v.output(&id).await;
    assert!(out.contains("pos=1;3"), "output: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_leaves_no_process_not_even_a_setsid_escapee() {
    let v = Visor::start();
    let id = v
        .start_pty(
            &[
                "bash",
                "--norc",
                "--noprofile",
                "-c",
                "setsid sleep 1000 & sleep 1000 & wait",
            ],
            json!({}),
        )
        .await;
    eventually("three processes of the session", || {
        session_pids(&id).len() >= 3
    })
    .await;
    let s = v.ok("POST", &format!("/v1/sessions/{id}/stop"), None).await;
    assert_eq!(s["state"], "exited");
    eventually("no process of the session", || session_pids(&id).is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_visor_going_down_takes_its_sessions_with_it() {
    let mut v = Visor::start();
    let id = v
        .start_pty(
            &[
                "bash",
                "--norc",
                "--noprofile",
                "-c",
                "setsid sleep 1000 & sleep 1000",
            ],
            json!({}),
        )
        .await;
    eventually("the session's processes", || session_pids(&id).len() >= 2).await;
    let status = v.stop();
    assert!(status.success(), "{status:?}");
    eventually("no process of the session", || session_pids(&id).is_empty()).await;
    assert!(!v.socket().exists(), "the socket is removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashing_command_restarts_up_to_the_intensity_then_exits_with_an_error() {
    let v = Visor::start();
    let id = v
        .start_pty(
            &["sh", "-c", "echo run; exit 3"],
            json!({"restart": {"mode": "notify"}}),
        )
        .await;
    let s = v
        .until(&format!("/v1/sessions/{id}"), "exited", |s| {
            s["state"] == "exited"
        })
        .await;
    assert_eq!(s["restarts"], 3, "{s}");
    assert!(
        s["error"]
            .as_str()
            .unwrap_or("")
            .contains("restart intensity"),
        "{s}"
    );
    assert_eq!(s["exitCode"], 3);
    // The events tell the same story: 4 runs, 3 restarts, then the error.
    let mut ws = v.ws(&format!("/v1/events?session={id}")).await;
    let mut types = Vec::new();
    loop {
        let e = next_json(&mut ws).await;
        let t = e["type"].as_str().unwrap().to_owned();
        let state = e["state"].as_str().map(str::to_owned);
        types.push(t.clone());
        if state.as_deref() == Some("exited") {
            break;
        }
    }
    let count = |t: &str| types.iter().filter(|x| *x == t).count();
    assert_eq!(count("restarting"), 3, "{types:?}");
    assert_eq!(count("exit"), 4, "{types:?}");
    assert_eq!(count("error"), 1, "{types:?}");
    assert_eq!(types.first().map(String::as_str), Some("init"));
    // Purge removes it and its events.
    let p = v
        .ok("POST", "/v1/purge", Some(json!({"session": id})))
        .await;
    assert_eq!(p["purged"], json!([id]));
    let (st, _) = v.req("GET", &format!("/v1/sessions/{id}"), None).await;
    assert_eq!(st, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_refuses_a_live_session_and_lists_filter() {
    let v = Visor::start();
    let a = v
        .start_pty(&["sleep", "1000"], json!({"labels": {"team": "a"}}))
        .await;
    let b = v
        .start_pty(&["true"], json!({"labels": {"team": "b"}}))
        .await;
    v.until(&format!("/v1/sessions/{b}"), "exited", |s| {
        s["state"] == "exited"
    })
    .await;
    let (st, e) = v
        .req("POST", "/v1/purge", Some(json!({"session": a})))
        .await;
    assert_eq!((st, e["error"]["code"].as_str()), (409, Some("state")));
    let ids = |l: &Value| -> Vec<String> {
        l["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let running = v.ok("GET", "/v1/sessions?state=running,idle", None).await;
    assert_eq!(ids(&running), vec![a.clone()]);
    let team_b = v.ok("GET", "/v1/sessions?label=team%3Db", None).await;
    assert_eq!(ids(&team_b), vec![b.clone()]);
    let (st, _) = v.req("GET", "/v1/sessions?state=bogus", None).await;
    assert_eq!(st, 400);
    v.ok("POST", &format!("/v1/sessions/{a}/stop"), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_session_actor_is_reported_and_the_rest_lives_on() {
    // The daemon with its test hooks on.
    let home = tempfile::tempdir().unwrap();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args(["visor", "--home"])
        .arg(home.path())
        .env("BMX_VISOR_TEST_HOOKS", "1")
        .env("RUST_LOG", "error")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let v = Visor {
        home,
        child: Some(child),
    };
    eventually("socket", || {
        std::os::unix::net::UnixStream::connect(v.socket()).is_ok()
    })
    .await;
    let doomed = v
        .start_pty(
            &[
                "bash",
                "--norc",
                "--noprofile",
                "-c",
                "setsid sleep 1000 & sleep 1000",
            ],
            json!({}),
        )
        .await;
    let other = v
        .start_pty(&["bash", "--norc", "--noprofile", "-i"], json!({}))
        .await;
    eventually("doomed's processes", || session_pids(&doomed).len() >= 2).await;
    let mut ws = v
        .ws(&format!("/v1/events?session={doomed}&types=error"))
        .await;
    v.ok("POST", &format!("/v1/sessions/{doomed}/debug/panic"), None)
        .await;
    let e = next_json(&mut ws).await;
    assert!(e["error"].as_str().unwrap_or("").contains("crashed"), "{e}");
    let s = v
        .until(&format!("/v1/sessions/{doomed}"), "exited", |s| {
            s["state"] == "exited"
        })
        .await;
    assert!(s["error"].as_str().is_some(), "{s}");
    eventually("no process of the crashed session", || {
        session_pids(&doomed).is_empty()
    })
    .await;
    // The daemon and the other session are fine.
    v.keys(&other, "echo still$((1+1))\r").await;
    v.until(
        &format!("/v1/sessions/{other}/output"),
        "other session works",
        |o| o["text"].as_str().unwrap_or("").contains("still2"),
    )
    .await;
    assert_eq!(v.session(&other).await["state"], "running");
}

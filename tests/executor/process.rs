//! Issue 4: sessions and processes through the real executor, driven over
//! a real WebSocket by the harness stand-in; real child processes and PTYs.

use crate::support;
use bmx::wire::types::*;
use bmx::wire::{Method, Subprotocol};
use std::time::Duration;
use support::*;

fn json_only() -> Options {
    Options {
        supported: vec![Subprotocol::ALL[1]],
        ..Default::default()
    }
}

async fn start(rig: &Rig, p: ProcessStartParams) -> ProcessState {
    rig.conn
        .call(Method::ProcessStart, &p)
        .await
        .expect("process.start")
}

async fn read(
    rig: &Rig,
    s: &str,
    p: &str,
    stream: Stream,
    cursor: u64,
    wait_ms: u64,
) -> ProcessReadResult {
    rig.conn
        .call(
            Method::ProcessRead,
            &read_params(s, p, stream, cursor, wait_ms),
        )
        .await
        .expect("process.read")
}

/// Read a stream to EOF from `cursor`, returning the bytes.
async fn read_all(rig: &Rig, s: &str, p: &str, stream: Stream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut cursor = 0;
    loop {
        let r = read(rig, s, p, stream, cursor, 5_000).await;
        assert!(!r.gap, "no gap expected");
        out.extend_from_slice(r.data.as_slice());
        cursor = r.next_cursor;
        if r.eof {
            return out;
        }
    }
}

async fn exit_codes_and_both_streams(opts: Options) {
    let rig = Rig::start(opts).await;
    rig.assign("s").await;
    let st = start(
        &rig,
        ProcessStartParams {
            wait_ms: Some(10_000),
            ..start_params("s", "p", &["sh", "-c", "echo out; echo err >&2; exit 7"])
        },
    )
    .await;
    assert_eq!(st.state, ProcState::Exited);
    assert_eq!(st.exit_code, Some(7));
    assert!(st.pid.is_some() && st.ended_at.is_some());
    assert_eq!(read_all(&rig, "s", "p", Stream::Stdout).await, b"out\n");
    assert_eq!(read_all(&rig, "s", "p", Stream::Stderr).await, b"err\n");
    rig.shutdown().await;
}

#[tokio::test]
async fn exit_codes_and_both_streams_msgpack() {
    exit_codes_and_both_streams(Options::default()).await;
}

#[tokio::test]
async fn exit_codes_and_both_streams_json() {
    exit_codes_and_both_streams(json_only()).await;
}

#[tokio::test]
async fn merged_stderr_goes_to_stdout() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let p = ProcessStartParams {
        stderr: StderrMode::Merge,
        wait_ms: Some(10_000),
        ..start_params("s", "m", &["sh", "-c", "echo a; echo b >&2; echo c"])
    };
    start(&rig, p).await;
    assert_eq!(read_all(&rig, "s", "m", Stream::Stdout).await, b"a\nb\nc\n");
    let e = read(&rig, "s", "m", Stream::Stderr, 0, 0).await;
    assert!(e.data.is_empty() && e.eof);
    rig.shutdown().await;
}

#[tokio::test]
async fn idempotent_start_and_spec_mismatch() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    // In the session's workspace: its sandbox writes nowhere else.
    let marker = rig.work.path().join("sessions/s/count");
    let cmd = format!("echo x >> {}; sleep 0.2", marker.display());
    let p = start_params("s", "once", &["sh", "-c", &cmd]);
    let a = start(&rig, p.clone()).await;
    let b = start(
        &rig,
        ProcessStartParams {
            wait_ms: Some(5_000),
            ..p.clone()
        },
    )
    .await;
    assert_eq!(a.pid, b.pid, "the same process");
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap(),
        "x\n",
        "started once"
    );
    let e = rig
        .conn
        .call::<_, ProcessState>(Method::ProcessStart, &start_params("s", "once", &["true"]))
        .await
        .unwrap_err();
    assert_eq!(e.code, -32009);
    assert_eq!(e.reason(), Some("process_id_spec_mismatch"));
    rig.shutdown().await;
}

#[tokio::test]
async fn spawn_failure_is_a_state_not_an_error() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let st = start(
        &rig,
        start_params("s", "nope", &["/definitely/not/a/program"]),
    )
    .await;
    assert_eq!(st.state, ProcState::Failed);
    assert_eq!(st.reason.as_deref(), Some("spawn_failed"));
    assert!(st.message.unwrap().contains("/definitely/not/a/program"));
    let r = read(&rig, "s", "nope", Stream::Stdout, 0, 1_000).await;
    assert!(r.eof && r.data.is_empty());
    rig.shutdown().await;
}

#[tokio::test]
async fn big_output_shows_a_gap_and_the_exact_tail() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    // 5 MB of numbered lines: the 1 MiB ring keeps the last 1 MiB.
    let script = "i=0; while [ $i -lt 500000 ]; do printf '%09d\\n' $i; i=$((i+1)); done";
    let p = ProcessStartParams {
        wait_ms: Some(60_000),
        ..start_params("s", "big", &["bash", "-c", script])
    };
    let st = start(&rig, p).await;
    assert_eq!(st.exit_code, Some(0));
    assert_eq!(st.cursors.stdout, 5_000_000);
    let r = read(&rig, "s", "big", Stream::Stdout, 0, 0).await;
    assert!(r.gap);
    assert_eq!(r.earliest_cursor, 5_000_000 - (1 << 20));
    assert_eq!(r.from_cursor, r.earliest_cursor);
    let mut tail = r.data.as_slice().to_vec();
    let mut cursor = r.next_cursor;
    while cursor < 5_000_000 {
        let r = read(&rig, "s", "big", Stream::Stdout, cursor, 0).await;
        assert!(!r.gap);
        tail.extend_from_slice(r.data.as_slice());
        cursor = r.next_cursor;
    }
    let expected: Vec<u8> = (0..500_000)
        .flat_map(|i| format!("{i:09}\n").into_bytes())
        .collect();
    assert_eq!(tail.len(), 1 << 20);
    assert_eq!(&tail[..], &expected[expected.len() - (1 << 20)..]);
    // A cursor beyond the end is invalid params.
    let e = rig
        .conn
        .call::<_, ProcessReadResult>(
            Method::ProcessRead,
            &read_params("s", "big", Stream::Stdout, 5_000_001, 0),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32602);
    rig.shutdown().await;
}

#[tokio::test]
async fn long_poll_returns_when_bytes_arrive() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    start(
        &rig,
        ProcessStartParams {
            stdin: StdinMode::Open,
            ..start_params("s", "cat", &["cat"])
        },
    )
    .await;
    let conn = rig.conn.link.clone();
    let waiting = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let r: ProcessReadResult = conn
            .request(
                Method::ProcessRead,
                &read_params("s", "cat", Stream::Stdout, 0, 30_000),
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        (r, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _: Accepted = rig
        .conn
        .call(
            Method::ProcessWrite,
            &ProcessWriteParams {
                session_id: "s".into(),
                process_id: "cat".into(),
                data: b"ping\n".to_vec().into(),
                close_stdin: false,
            },
        )
        .await
        .unwrap();
    let (r, took) = waiting.await.unwrap();
    assert_eq!(r.data.as_slice(), b"ping\n");
    assert!(
        took < Duration::from_secs(20),
        "woken by the bytes, not the 30 s timeout: {took:?}"
    );
    assert!(!r.eof);
    // stdin round trip, then close it: cat exits, EOF.
    let _: Accepted = rig
        .conn
        .call(
            Method::ProcessWrite,
            &ProcessWriteParams {
                session_id: "s".into(),
                process_id: "cat".into(),
                data: b"pong\n".to_vec().into(),
                close_stdin: true,
            },
        )
        .await
        .unwrap();
    assert_eq!(
        read_all(&rig, "s", "cat", Stream::Stdout).await,
        b"ping\npong\n"
    );
    let e = rig
        .conn
        .call::<_, Accepted>(
            Method::ProcessWrite,
            &ProcessWriteParams {
                session_id: "s".into(),
                process_id: "cat".into(),
                data: b"x".to_vec().into(),
                close_stdin: false,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32009);
    assert_eq!(e.reason(), Some("stdin_closed"));
    rig.shutdown().await;
}

#[tokio::test]
async fn terminate_kills_the_whole_group_and_setsid_escapees() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let tag = format!("30{}", std::process::id() % 10_000);
    let script = format!("sleep {tag}.1 & setsid sleep {tag}.2 & sleep {tag}.3");
    start(&rig, start_params("s", "tree", &["sh", "-c", &script])).await;
    eventually("three sleeps running", || {
        pids_with_arg(&format!("sleep {tag}.")).len() == 3
    })
    .await;
    let st: ProcessState = rig
        .conn
        .call(
            Method::ProcessTerminate,
            &ProcessTerminateParams {
                session_id: "s".into(),
                process_id: "tree".into(),
                grace_ms: Some(500),
            },
        )
        .await
        .unwrap();
    assert_eq!(st.state, ProcState::Killed);
    assert_eq!(st.reason.as_deref(), Some("terminated"));
    eventually("nothing left behind", || {
        pids_with_arg(&format!("sleep {tag}.")).is_empty()
    })
    .await;
    rig.shutdown().await;
}

#[tokio::test]
async fn interrupt_sends_sigint_to_the_group() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let tag = format!("31{}", std::process::id() % 10_000);
    let script = format!("sleep {tag}.1 & sleep {tag}.2");
    start(&rig, start_params("s", "int", &["sh", "-c", &script])).await;
    eventually("two sleeps", || {
        pids_with_arg(&format!("sleep {tag}.")).len() == 2
    })
    .await;
    let _: ProcessState = rig
        .conn
        .call(
            Method::ProcessInterrupt,
            &ProcessRefParams {
                session_id: "s".into(),
                process_id: "int".into(),
            },
        )
        .await
        .unwrap();
    eventually("SIGINT reached the group", || {
        pids_with_arg(&format!("sleep {tag}.")).is_empty()
    })
    .await;
    rig.shutdown().await;
}

#[tokio::test]
async fn timeout_kills_the_group() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let p = ProcessStartParams {
        timeout_ms: Some(300),
        wait_ms: Some(20_000),
        ..start_params("s", "slow", &["sleep", "30"])
    };
    let st = start(&rig, p).await;
    assert_eq!(st.state, ProcState::Killed);
    assert_eq!(st.reason.as_deref(), Some("timeout"));
    assert_eq!(st.exit_signal, Some(9));
    rig.shutdown().await;
}

#[tokio::test]
async fn pty_mode_sees_a_terminal_of_the_given_size() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let p = ProcessStartParams {
        io_mode: IoMode::Pty,
        cols: Some(100),
        rows: Some(30),
        wait_ms: Some(10_000),
        ..start_params("s", "tty", &["sh", "-c", "tty && stty size"])
    };
    let st = start(&rig, p).await;
    assert_eq!(st.exit_code, Some(0), "tty succeeds");
    let out = String::from_utf8(read_all(&rig, "s", "tty", Stream::Stdout).await).unwrap();
    assert!(out.contains("/dev/pts/"), "{out:?}");
    assert!(out.contains("30 100"), "{out:?}");
    rig.shutdown().await;
}

#[tokio::test]
async fn session_stop_kills_everything_and_forgets_the_session() {
    let mut rig = Rig::start(Options::default()).await;
    rig.assign("gone").await;
    let tag = format!("32{}", std::process::id() % 10_000);
    for i in 0..3 {
        let script = format!("sleep {tag}.{i} & setsid sleep {tag}.9{i} & wait");
        start(
            &rig,
            start_params("gone", &format!("p{i}"), &["sh", "-c", &script]),
        )
        .await;
    }
    eventually("six sleeps", || {
        pids_with_arg(&format!("sleep {tag}.")).len() == 6
    })
    .await;
    let workspace = rig.work.path().join("sessions").join("gone");
    assert!(workspace.is_dir());
    let r: StopResult = rig
        .conn
        .call(
            Method::SessionStop,
            &StopParams {
                session_id: "gone".into(),
                reason: "done".into(),
                deadline_ms: Some(1_000),
                keep_workspace: false,
            },
        )
        .await
        .unwrap();
    assert!(r.stopped);
    assert!(
        pids_with_arg(&format!("sleep {tag}.")).is_empty(),
        "no orphans"
    );
    assert!(!workspace.exists(), "workspace removed");
    let ended = rig
        .event("session.ended", |v| v["sessionId"] == "gone")
        .await;
    assert_eq!(ended["reason"], "done");
    let e = rig
        .conn
        .call::<_, ProcessListResult>(
            Method::ProcessList,
            &SessionRefParams {
                session_id: "gone".into(),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32011);
    rig.shutdown().await;
}

#[tokio::test]
async fn fencing_tokens_are_idempotent_renewed_or_stale() {
    let rig = Rig::start(Options::default()).await;
    let a: AssignResult = rig
        .conn
        .call(Method::SessionAssign, &assign_params("f", 5))
        .await
        .unwrap();
    let b: AssignResult = rig
        .conn
        .call(Method::SessionAssign, &assign_params("f", 5))
        .await
        .unwrap();
    assert_eq!(a, b);
    let _: AssignResult = rig
        .conn
        .call(Method::SessionAssign, &assign_params("f", 6))
        .await
        .unwrap();
    let e = rig
        .conn
        .call::<_, AssignResult>(Method::SessionAssign, &assign_params("f", 5))
        .await
        .unwrap_err();
    assert_eq!(e.code, -32009);
    assert_eq!(e.reason(), Some("stale_fencing_token"));
    rig.shutdown().await;
}

#[tokio::test]
async fn max_sessions_and_max_processes() {
    let rig = Rig::start_with(Options::default(), |c| {
        c.max_sessions = 1;
        c.max_processes_per_session = 2;
    })
    .await;
    rig.assign("one").await;
    let e = rig
        .conn
        .call::<_, AssignResult>(Method::SessionAssign, &assign_params("two", 1))
        .await
        .unwrap_err();
    assert_eq!(e.code, -32029);
    for i in 0..2 {
        start(
            &rig,
            start_params("one", &format!("p{i}"), &["sleep", "30"]),
        )
        .await;
    }
    let e = rig
        .conn
        .call::<_, ProcessState>(
            Method::ProcessStart,
            &start_params("one", "p3", &["sleep", "30"]),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, -32015);
    rig.shutdown().await;
}

#[tokio::test]
async fn lease_expiry_while_disconnected_kills_and_reports_after_reconnect() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let mut config = s.config(work.path());
    // Reconnect only after the lease ran out.
    config.reconnect_backoff = bmx::supervisor::Backoff {
        min: Duration::from_millis(1_600),
        max: Duration::from_millis(1_600),
    };
    let exec = bmx::executor::Executor::start(config).await.unwrap();
    let mut conn = s.next_conn().await;
    conn.register(10_000, 500).await;
    let (served, _e) = conn.serve();
    let _: AssignResult = served
        .call(Method::SessionAssign, &assign_params("l", 1))
        .await
        .unwrap();
    let tag = format!("33{}", std::process::id() % 10_000);
    let script = format!("setsid sleep {tag}.1 & sleep {tag}.2");
    let _: ProcessState = served
        .call(
            Method::ProcessStart,
            &start_params("l", "p", &["sh", "-c", &script]),
        )
        .await
        .unwrap();
    eventually("sleeps", || {
        pids_with_arg(&format!("sleep {tag}.")).len() == 2
    })
    .await;
    served
        .link
        .close(bmx::wire::CloseCode::GoingAway, "network gone");
    eventually("lease expiry killed the processes", || {
        pids_with_arg(&format!("sleep {tag}.")).is_empty()
    })
    .await;
    let mut conn = s.next_conn().await;
    conn.register(10_000, 500).await;
    let ended = conn.expect(Method::SessionEnded).await;
    let p: EndedParams = ended.params();
    assert_eq!(p.session_id, "l");
    assert_eq!(p.reason, "lease_expired");
    ended.ok(&Accepted::YES);
    exec.shutdown().await;
}

#[tokio::test]
async fn reconnect_within_the_ttl_loses_no_output() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let exec = bmx::executor::Executor::start(s.config(work.path()))
        .await
        .unwrap();
    let mut conn = s.next_conn().await;
    conn.register(10_000, 30_000).await;
    let (served, _e) = conn.serve();
    let _: AssignResult = served
        .call(Method::SessionAssign, &assign_params("r", 1))
        .await
        .unwrap();
    let script = "for i in $(seq 1 40); do echo line$i; sleep 0.02; done";
    let _: ProcessState = served
        .call(
            Method::ProcessStart,
            &start_params("r", "p", &["bash", "-c", script]),
        )
        .await
        .unwrap();
    let first: ProcessReadResult = served
        .call(
            Method::ProcessRead,
            &read_params("r", "p", Stream::Stdout, 0, 2_000),
        )
        .await
        .unwrap();
    served.link.close(bmx::wire::CloseCode::GoingAway, "blip");
    let mut conn = s.next_conn().await;
    let p = conn.register(10_000, 30_000).await;
    assert_eq!(p.resume.unwrap().active_sessions, vec!["r".to_owned()]);
    let (served, _e) = conn.serve();
    let mut out = first.data.as_slice().to_vec();
    let mut cursor = first.next_cursor;
    loop {
        let r: ProcessReadResult = served
            .call(
                Method::ProcessRead,
                &read_params("r", "p", Stream::Stdout, cursor, 5_000),
            )
            .await
            .unwrap();
        assert!(!r.gap);
        assert_eq!(r.from_cursor, cursor, "cursors continue");
        out.extend_from_slice(r.data.as_slice());
        cursor = r.next_cursor;
        if r.eof {
            break;
        }
    }
    let expected: String = (1..=40).map(|i| format!("line{i}\n")).collect();
    assert_eq!(String::from_utf8(out).unwrap(), expected);
    exec.shutdown().await;
}

#[tokio::test]
async fn process_list_and_status_notifications() {
    let mut rig = Rig::start(json_only()).await;
    rig.assign("s").await;
    start(
        &rig,
        ProcessStartParams {
            wait_ms: Some(5_000),
            ..start_params("s", "a", &["true"])
        },
    )
    .await;
    start(&rig, start_params("s", "b", &["sleep", "30"])).await;
    let list: ProcessListResult = rig
        .conn
        .call(
            Method::ProcessList,
            &SessionRefParams {
                session_id: "s".into(),
            },
        )
        .await
        .unwrap();
    let states: Vec<(String, ProcState)> = list
        .processes
        .iter()
        .map(|p| (p.process_id.clone(), p.state))
        .collect();
    assert_eq!(
        states,
        vec![
            ("a".into(), ProcState::Exited),
            ("b".into(), ProcState::Running)
        ]
    );
    let exited = rig
        .event("process.status", |v| {
            v["processId"] == "a" && v["state"] == "exited"
        })
        .await;
    assert_eq!(exited["exitCode"], 0);
    assert!(exited["observedAt"].is_string());
    rig.shutdown().await;
}

#[tokio::test]
async fn cwd_outside_the_workspace_and_denied_env_are_forbidden() {
    let rig = Rig::start_with(Options::default(), |c| {
        c.deny_env.push("BMX_DENIED_FOR_TEST".into())
    })
    .await;
    rig.assign("s").await;
    let p = ProcessStartParams {
        cwd: Some("../..".into()),
        ..start_params("s", "cwd", &["pwd"])
    };
    let e = rig
        .conn
        .call::<_, ProcessState>(Method::ProcessStart, &p)
        .await
        .unwrap_err();
    assert_eq!(e.code, -32003);
    assert_eq!(e.reason(), Some("workspace_boundary"));
    let mut env = std::collections::BTreeMap::new();
    env.insert("BMX_DENIED_FOR_TEST".to_owned(), "x".to_owned());
    let p = ProcessStartParams {
        env: Some(env),
        ..start_params("s", "env", &["true"])
    };
    let e = rig
        .conn
        .call::<_, ProcessState>(Method::ProcessStart, &p)
        .await
        .unwrap_err();
    assert_eq!(e.code, -32003);
    assert_eq!(e.reason(), Some("denied_env"));
    // Inside the workspace is fine.
    std::fs::create_dir_all(rig.work.path().join("sessions/s/sub")).unwrap();
    let p = ProcessStartParams {
        cwd: Some("sub".into()),
        wait_ms: Some(5_000),
        ..start_params("s", "ok", &["pwd"])
    };
    let st = start(&rig, p).await;
    assert_eq!(st.exit_code, Some(0));
    let out = read(&rig, "s", "ok", Stream::Stdout, 0, 1_000).await;
    assert!(String::from_utf8_lossy(out.data.as_slice())
        .trim_end()
        .ends_with("/sessions/s/sub"));
    rig.shutdown().await;
}

/// The daemon path: `bmx executor` is the child subreaper, so a `setsid`
/// escapee comes back to it and is killed and reaped when the session ends.
#[tokio::test]
async fn the_daemon_kills_setsid_escapees_on_session_stop() {
    let mut s = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let mut child = executor_command(&s.url, work.path()).spawn().unwrap();
    let mut conn = s.next_conn().await;
    conn.register(10_000, 30_000).await;
    let (served, _e) = conn.serve();
    let _: AssignResult = served
        .call(Method::SessionAssign, &assign_params("d", 1))
        .await
        .unwrap();
    let tag = format!("34{}", std::process::id() % 10_000);
    // The shell exits at once: the setsid sleep is orphaned to the daemon.
    let script = format!("setsid sleep {tag}.1 & exit 0");
    let _: ProcessState = served
        .call(
            Method::ProcessStart,
            &ProcessStartParams {
                wait_ms: Some(5_000),
                ..start_params("d", "p", &["sh", "-c", &script])
            },
        )
        .await
        .unwrap();
    eventually("escapee gone with its process", || {
        pids_with_arg(&format!("sleep {tag}.")).is_empty()
    })
    .await;
    let script = format!("setsid sleep {tag}.2 & sleep {tag}.3");
    let _: ProcessState = served
        .call(
            Method::ProcessStart,
            &start_params("d", "q", &["sh", "-c", &script]),
        )
        .await
        .unwrap();
    eventually("two sleeps", || {
        pids_with_arg(&format!("sleep {tag}.")).len() == 2
    })
    .await;
    let _: StopResult = served
        .call(
            Method::SessionStop,
            &StopParams {
                session_id: "d".into(),
                reason: "done".into(),
                deadline_ms: Some(1_000),
                keep_workspace: false,
            },
        )
        .await
        .unwrap();
    assert!(
        pids_with_arg(&format!("sleep {tag}.")).is_empty(),
        "no orphans"
    );
    let pid = child.id().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

/// `maxBytes: 0` reads no byte (issue 18, finding 9: it used to return
/// one) and does not wait: it reports the cursors, whether bytes were
/// ready (`truncated`) and the state; the next read still gets every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_byte_read_takes_nothing_and_does_not_wait() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    start(
        &rig,
        start_params("s", "p", &["sh", "-c", "printf hello; sleep 30"]),
    )
    .await;
    // Wait until the bytes are there, without taking them.
    let mut probe;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        probe = rig
            .conn
            .call::<_, ProcessReadResult>(
                Method::ProcessRead,
                &ProcessReadParams {
                    max_bytes: Some(0),
                    ..read_params("s", "p", Stream::Stdout, 0, 60_000)
                },
            )
            .await
            .expect("process.read maxBytes 0");
        assert!(probe.data.as_slice().is_empty(), "no data: {probe:?}");
        assert_eq!((probe.from_cursor, probe.next_cursor), (0, 0));
        if probe.truncated {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "bytes never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!probe.eof);
    let r = read(&rig, "s", "p", Stream::Stdout, 0, 0).await;
    assert_eq!(r.data.as_slice(), b"hello");
}

/// 5 MB of numbered lines, the reader asleep while they are written: with
/// `outputPolicy: "lossless"` the 1 MiB ring holds the producer back
/// instead of dropping, so every byte arrives, in order, with no gap. The
/// same run with the default policy is the control: it loses the head.
#[tokio::test]
async fn lossless_output_holds_the_producer_back_and_loses_no_byte() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let argv = ["seq", "-f", "%09g", "0", "499999"];
    let expected: Vec<u8> = (0..500_000)
        .flat_map(|i| format!("{i:09}\n").into_bytes())
        .collect();
    for policy in [OutputPolicy::Lossless, OutputPolicy::Ring] {
        let id = format!("{policy:?}");
        let p = ProcessStartParams {
            output_policy: policy,
            package_install: None,
            git_credentials: false,
            file_transfer: None,
            // The control waits for the end: by then its ring has lapped.
            wait_ms: (policy == OutputPolicy::Ring).then_some(60_000),
            ..start_params("s", &id, &argv)
        };
        start(&rig, p.clone()).await;
        // Let the producer run into the full ring before anyone reads.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        // Starting it again answers its current state.
        let st = start(&rig, p).await;
        match policy {
            OutputPolicy::Lossless => {
                // Held back: the ring (1 MiB) is all it could write.
                assert!(st.cursors.stdout <= 1 << 20, "{st:?}");
                assert_eq!(st.state, ProcState::Running, "blocked, not ended");
                let all = read_all(&rig, "s", &id, Stream::Stdout).await;
                assert_eq!(all.len(), expected.len());
                assert!(all == expected, "every byte, in order");
            }
            OutputPolicy::Ring => {
                let r = read(&rig, "s", &id, Stream::Stdout, 0, 60_000).await;
                assert!(r.gap, "the control run drops its head");
            }
        }
    }
    rig.shutdown().await;
}

/// A lossless process nobody reads is blocked on its pipe, and its pump on
/// the reader: stopping the session must still end both, leaving nothing.
#[tokio::test]
async fn a_blocked_lossless_process_ends_with_its_session() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let tag = format!("lossless-{}", std::process::id());
    let p = ProcessStartParams {
        output_policy: OutputPolicy::Lossless,
        package_install: None,
        git_credentials: false,
        file_transfer: None,
        ..start_params(
            "s",
            "yes",
            &["bash", "-c", &format!("exec -a {tag} yes {tag}")],
        )
    };
    start(&rig, p).await;
    eventually("the producer runs", || !pids_with_arg(&tag).is_empty()).await;
    let r: StopResult = rig
        .conn
        .call(
            Method::SessionStop,
            &StopParams {
                session_id: "s".into(),
                reason: "done".into(),
                deadline_ms: Some(1_000),
                keep_workspace: false,
            },
        )
        .await
        .unwrap();
    assert!(r.stopped);
    assert!(pids_with_arg(&tag).is_empty(), "no process left");
    rig.shutdown().await;
}

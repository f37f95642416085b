//! Issue 20, part 2: computer use on a virtual display. A real `Xvfb`
//! started by the session's first `computer_*` call, a real `xterm` on it
//! (started as a process of the session), keys typed into it through
//! XTEST by `computer_action`, the screen read back as PNG by
//! `computer_observe`.
//!
//! Needs `Xvfb` and `xterm` (scripts/test.sh installs them); without them
//! the test says so loudly and passes, except under CI, where it fails.

use crate::support;
use bmx::wire::types::*;
use bmx::wire::Method;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};
use support::*;

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

fn tools_present() -> bool {
    let ok = on_path("Xvfb") && on_path("xterm");
    if !ok {
        let msg = "Xvfb or xterm is not installed (scripts/test.sh installs them)";
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("SKIPPED: {msg}");
    }
    ok
}

async fn tool(rig: &mut Rig, id: &str, name: &str, input: Value) -> ToolResultParams {
    let p = ToolCallParams {
        session_id: "s".into(),
        tool_call_id: id.into(),
        tool: name.into(),
        input,
        deadline_ms: Some(60_000),
        permission: None,
    };
    let a: Accepted = rig.conn.call(Method::ToolCall, &p).await.unwrap();
    assert!(a.accepted);
    let v = rig.event("tool.result", |v| v["toolCallId"] == id).await;
    serde_json::from_value(v).unwrap()
}

/// The observe result: its text, and the PNG decoded (width, height, RGB).
fn screen(r: &ToolResultParams) -> (String, u32, u32, Vec<u8>) {
    assert!(!r.is_error, "{r:?}");
    let text = r.content[0].text.clone().unwrap();
    let image = &r.content[1];
    assert_eq!(image.kind, ContentType::Image);
    assert_eq!(image.mime_type.as_deref(), Some("image/png"));
    let png = base64_simd::STANDARD
        .decode_to_vec(image.data.as_deref().unwrap())
        .unwrap();
    let mut reader = png::Decoder::new(std::io::Cursor::new(png))
        .read_info()
        .unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    (text, info.width, info.height, buf)
}

fn read(ws: &Path, name: &str) -> String {
    std::fs::read_to_string(ws.join(name)).unwrap_or_default()
}

#[tokio::test]
async fn typed_into_an_xterm_and_seen_on_the_screen() {
    if !tools_present() {
        return;
    }
    let mut rig = Rig::start(Options::default()).await;
    assert_eq!(
        rig.registered.capabilities.display,
        Some(DisplayCapability {
            desktop: true,
            // RFB (tests/harness/rfb.rs) when the VNC server is there too.
            rfb: on_path("x11vnc")
        })
    );
    rig.assign("s").await;
    let ws = rig.work.path().join("sessions").join("s");

    // The first call starts the display; its text names it.
    let r = tool(&mut rig, "o1", "computer_observe", json!({})).await;
    let (text, w, h, blank) = screen(&r);
    assert_eq!((w, h), (1280, 800), "{text}");
    assert!(text.contains("screen 1280x800"), "{text}");
    let display = text
        .split_whitespace()
        .nth(1)
        .unwrap()
        .trim_end_matches(',')
        .to_owned();
    assert!(display.starts_with(':'), "{text}");

    // An xterm on it, as a process of the session (bash in the workspace).
    let mut p = start_params(
        "s",
        "xterm",
        &[
            "xterm",
            "-geometry",
            "80x24+0+0",
            "-e",
            "bash",
            "--norc",
            "--noprofile",
        ],
    );
    p.env = Some(
        [("DISPLAY".to_owned(), display.clone())]
            .into_iter()
            .collect(),
    );
    let started: ProcessState = rig.conn.call(Method::ProcessStart, &p).await.unwrap();
    let xterm_pid = started.pid.unwrap() as i32;

    // Wait until the window shows (the screen changes).
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut n = 0;
    loop {
        n += 1;
        let r = tool(&mut rig, &format!("w{n}"), "computer_observe", json!({})).await;
        if screen(&r).3 != blank {
            break;
        }
        assert!(Instant::now() < deadline, "the xterm never showed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let r = tool(
        &mut rig,
        "o2",
        "computer_observe",
        json!({"display": display}),
    )
    .await;
    let before = screen(&r).3;

    // Keys typed while the pointer is off the window (Xvfb starts it at
    // the screen's centre, outside the 80x24 xterm) reach nobody: focus
    // follows the pointer (no window manager).
    let r = tool(
        &mut rig,
        "t0",
        "computer_action",
        json!({"action": "type", "text": "echo no > no.txt\n"}),
    )
    .await;
    assert!(!r.is_error, "{r:?}");
    // A click into the window gives it the keyboard; type.
    let r = tool(
        &mut rig,
        "c",
        "computer_action",
        json!({"action": "click", "x": 100, "y": 100}),
    )
    .await;
    assert!(!r.is_error, "{r:?}");
    let r = tool(
        &mut rig,
        "t",
        "computer_action",
        json!({"action": "type", "text": "echo $((6*7)) > out.txt"}),
    )
    .await;
    assert!(!r.is_error, "{r:?}");
    let r = tool(
        &mut rig,
        "k",
        "computer_action",
        json!({"action": "key", "keys": "Return"}),
    )
    .await;
    assert!(!r.is_error, "{r:?}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while read(&ws, "out.txt").trim() != "42" {
        assert!(
            Instant::now() < deadline,
            "out.txt: {:?}",
            read(&ws, "out.txt")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        !ws.join("no.txt").exists(),
        "keys reached the xterm before the click"
    );
    let r = tool(&mut rig, "o3", "computer_observe", json!({})).await;
    assert_ne!(screen(&r).3, before, "typing changed nothing on the screen");

    // Bad input: isError, nothing done.
    for (id, input) in [
        ("b1", json!({"action": "click", "x": 5000, "y": 10})),
        ("b2", json!({"action": "key", "keys": "NoSuchKey"})),
        ("b3", json!({"action": "explode"})),
        (
            "b4",
            json!({"action": "click", "x": 1, "y": 1, "display": ":999"}),
        ),
    ] {
        let r = tool(&mut rig, id, "computer_action", input.clone()).await;
        assert!(r.is_error, "{input}: {r:?}");
        assert_eq!(r.reason.as_deref(), Some("invalid_input"), "{input}: {r:?}");
    }

    // The session's end takes the display and its clients with it.
    let _: StopResult = rig
        .conn
        .call(
            Method::SessionStop,
            &StopParams {
                session_id: "s".into(),
                reason: "test".into(),
                deadline_ms: Some(5_000),
                keep_workspace: false,
            },
        )
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while alive(xterm_pid) {
        assert!(Instant::now() < deadline, "the xterm outlived its session");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let n: u32 = display[1..].parse().unwrap();
    let socket = format!("/tmp/.X11-unix/X{n}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(&socket).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the display outlived its session"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rig.shutdown().await;
}

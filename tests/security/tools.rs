//! Issue 18, finding 5: a giant one-line file costs the file tools a
//! bounded amount of memory, and the daemon exits on SIGTERM while a tool
//! is busy on it. The real executor binary behind an in-process stand-in
//! harness; its peak resident memory (`VmHWM`) is read from `/proc`.
//!
//! On the code before the fix `grep` read the whole line into memory
//! (`read_until`): the executor's peak grew past the file's 512 MiB and
//! `grep_a_giant_line_costs_a_bounded_amount_of_memory` failed.

use crate::security_common;
use crate::support;
use bmx::wire::types::Accepted;
use bmx::wire::Method;
use security_common::{executor_behind_stand_in, result_text, tool, Bmx};
use serde_json::json;
use std::io::Write;

const GIANT: usize = 512 << 20;

/// A workspace file of `GIANT` bytes of `a` and no newline.
fn giant_file(dir: &std::path::Path) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(dir.join("giant.txt")).unwrap());
    let chunk = vec![b'a'; 1 << 20];
    for _ in 0..(GIANT >> 20) {
        f.write_all(&chunk).unwrap();
    }
    f.flush().unwrap();
}

fn peak_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

/// An executor with session `s1` whose workspace holds the giant file.
async fn executor_with_giant_file() -> (
    Bmx,
    support::StandIn,
    support::Served,
    tokio::sync::mpsc::UnboundedReceiver<(String, serde_json::Value)>,
    tempfile::TempDir,
) {
    let (executor, harness, conn, work) =
        executor_behind_stand_in(&[], &[("BMX_TOKEN", support::TOKEN)], "warn").await;
    let (served, events) = conn.serve();
    let _: serde_json::Value = served
        .call(Method::SessionAssign, &support::assign_params("s1", 1))
        .await
        .unwrap();
    // The session's workspace (src/executor/actors/session.rs).
    let ws = work.path().join("sessions").join("s1");
    support::eventually("the workspace exists", || ws.is_dir()).await;
    giant_file(&ws);
    (executor, harness, served, events, work)
}

#[tokio::test]
async fn grep_a_giant_line_costs_a_bounded_amount_of_memory() {
    let (executor, _harness, served, mut events, _work) = executor_with_giant_file().await;
    let r = tool(
        &served,
        &mut events,
        "g1",
        "grep",
        json!({"pattern": "zzz"}),
    )
    .await;
    assert_eq!(r["outcome"], "succeeded", "{r}");
    assert!(result_text(&r).contains("No matches"), "{r}");
    let r = tool(&served, &mut events, "g2", "grep", json!({"pattern": "^a"})).await;
    assert!(result_text(&r).contains("giant.txt:1:"), "{r}");
    let r = tool(
        &served,
        &mut events,
        "r1",
        "read",
        json!({"path": "giant.txt", "limit": 1}),
    )
    .await;
    assert_eq!(r["outcome"], "succeeded", "{r}");
    let peak = peak_kib(executor.pid());
    assert!(
        peak < (GIANT as u64 >> 10) / 4,
        "peak {peak} KiB for a {} MiB line",
        GIANT >> 20
    );
    executor.stop();
}

#[tokio::test]
async fn sigterm_ends_the_executor_while_a_tool_is_busy() {
    let (executor, _harness, served, _events, _work) = executor_with_giant_file().await;
    // A pattern that must scan every byte, again and again.
    for i in 0..4 {
        let a: Accepted = served
            .call(
                Method::ToolCall,
                &json!({"sessionId": "s1", "toolCallId": format!("busy-{i}"), "tool": "grep",
                        "input": {"pattern": "a*b"}}),
            )
            .await
            .unwrap();
        assert!(a.accepted);
    }
    // `stop` sends SIGTERM and panics if the executor is not gone in 20 s.
    executor.stop();
}

/// Issue 18, finding 6 (the disk half): `--tool-max-file-size` and
/// `--disk-reserve` reach the daemon's tool calls.
#[tokio::test]
async fn the_daemon_bounds_a_tool_calls_disk() {
    let work = tempfile::tempdir().unwrap();
    let free = bmx::tools::disk::free_bytes(work.path()).unwrap();
    // A file limit of 1 MiB, and a reserve of all but 64 MiB of the disk.
    let reserve = free.saturating_sub(64 << 20).to_string();
    let (executor, _harness, conn, work) = executor_behind_stand_in(
        &[
            "--tool-max-file-size",
            "1048576",
            "--disk-reserve",
            &reserve,
        ],
        &[("BMX_TOKEN", support::TOKEN)],
        "warn",
    )
    .await;
    let (served, mut events) = conn.serve();
    let _: serde_json::Value = served
        .call(Method::SessionAssign, &support::assign_params("s1", 1))
        .await
        .unwrap();
    let ws = work.path().join("sessions").join("s1");
    support::eventually("the workspace exists", || ws.is_dir()).await;

    let r = tool(
        &served,
        &mut events,
        "big",
        "bash",
        json!({"command": "head -c 8388608 /dev/zero > big"}),
    )
    .await;
    assert_eq!(r["isError"], true, "{r}");
    assert_eq!(std::fs::metadata(ws.join("big")).unwrap().len(), 1 << 20);

    // Many files, each under the limit, stop at the reserve.
    let r = tool(
        &served,
        &mut events,
        "many",
        "bash",
        json!({"command": "i=0; while [ $i -lt 4096 ]; do head -c 1048576 /dev/zero > f$i; i=$((i+1)); done; touch finished",
               "timeoutMs": 120000}),
    )
    .await;
    assert_eq!(r["reason"], "disk_full", "{r}");
    assert!(!ws.join("finished").exists());
    executor.stop();
}

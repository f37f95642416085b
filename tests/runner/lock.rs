//! The workspace lock and working-directory confinement of a bound
//! executor (docs/runner.md §2), through the real binaries.

use crate::runner_common;
use runner_common::*;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

fn lock_file(ws: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(ws.join(".bmx/lock")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn a_second_executor_on_one_workspace_exits_6_naming_the_holder() {
    let h = harness(&[]);
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    let ws_s = ws.to_str().unwrap();
    let mut first = executor(&h, &["--workspace", ws_s], None);
    h.wait_registered("exec-1");
    let holder = lock_file(&ws);
    assert_eq!(holder["pid"], first.pid());
    let instance = holder["instance_id"].as_str().unwrap().to_owned();

    // Through a symlink to the same directory: the same workspace.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&ws, &link).unwrap();
    for path in [ws_s, link.to_str().unwrap()] {
        let err = dir.path().join("second.err");
        let mut second = executor(&h, &["--workspace", path], Some(&err));
        assert_eq!(second.wait_exit(), Some(6));
        let msg = std::fs::read_to_string(&err).unwrap();
        assert!(msg.contains(&format!("pid {}", first.pid())), "{msg}");
        assert!(msg.contains(&instance), "{msg}");
    }
    assert!(first.running(), "the holder is untouched");
    assert_eq!(lock_file(&ws)["instance_id"], instance.as_str());
}

#[test]
fn a_dead_holders_lock_is_taken_over() {
    let h = harness(&[]);
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().to_str().unwrap();
    let mut first = executor(&h, &["--workspace", ws], None);
    h.wait_registered("exec-1");
    let old = lock_file(dir.path());
    first.kill9();
    let mut second = executor(&h, &["--workspace", ws], None);
    eventually("the new executor holds the lock", || {
        lock_file(dir.path())["pid"] == second.pid()
    });
    h.wait_registered("exec-1");
    assert!(second.running());
    assert_ne!(lock_file(dir.path())["instance_id"], old["instance_id"]);
    assert_eq!(second.term(), Some(0));
}

#[test]
fn garbage_and_a_reused_pid_do_not_hold_the_lock() {
    let h = harness(&[]);
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().to_str().unwrap();
    std::fs::create_dir_all(dir.path().join(".bmx")).unwrap();
    // Garbage.
    std::fs::write(dir.path().join(".bmx/lock"), b"\xff\xfe garbage {").unwrap();
    let mut e = executor(&h, &["--workspace", ws], None);
    eventually("took over the garbage lock", || {
        std::fs::read_to_string(dir.path().join(".bmx/lock"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|v| v["pid"] == e.pid())
    });
    assert!(e.running());
    assert_eq!(e.term(), Some(0));
    // A pid that is alive but belongs to another program (this test), with
    // another instance id, and nobody holding the flock: taken over.
    let fake = serde_json::json!({
        "pid": std::process::id(),
        "instance_id": "not-a-live-executor",
        "started_at": "2020-01-01T00:00:00Z",
        "program": "bmx executor",
    });
    std::fs::write(dir.path().join(".bmx/lock"), fake.to_string()).unwrap();
    let mut e = executor(&h, &["--workspace", ws], None);
    eventually("took over the reused pid's lock", || {
        lock_file(dir.path())["pid"] == e.pid()
    });
    h.wait_registered("exec-1");
    assert!(e.running());
}

#[test]
fn a_read_only_workspace_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let ws = dir.path().join("ro");
    std::fs::create_dir(&ws).unwrap();
    std::fs::set_permissions(&ws, std::fs::Permissions::from_mode(0o555)).unwrap();
    let mut cmd = Command::new(BMX);
    cmd.args([
        "executor",
        "--url",
        "ws://127.0.0.1:9/v1/executor/connect",
        "--token",
        "x",
        "--workspace",
    ])
    .arg(&ws)
    .env("RUST_LOG", "warn");
    // Root ignores permission bits: run as nobody then.
    if unsafe { libc::geteuid() } == 0 {
        use std::os::unix::process::CommandExt;
        cmd.uid(65534).gid(65534);
    }
    let out = run(&mut cmd);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot lock workspace"), "{err}");
    assert!(err.contains("must be writable"), "{err}");
    assert!(!ws.join(".bmx").exists());
}

#[test]
fn a_missing_workspace_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(Command::new(BMX).args([
        "executor",
        "--url",
        "ws://127.0.0.1:9/v1/executor/connect",
        "--token",
        "x",
        "--workspace",
        dir.path().join("nope").to_str().unwrap(),
    ]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

#[test]
fn working_directories_stay_inside_the_workspace() {
    let h = harness(&[]);
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(ws.join("sub")).unwrap();
    std::fs::write(ws.join("keep.txt"), "mine").unwrap();
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, ws.join("escape")).unwrap();
    let mut e = executor(&h, &["--workspace", ws.to_str().unwrap()], None);
    h.wait_registered("exec-1");
    let canonical = std::fs::canonicalize(&ws).unwrap();
    let exec = |cwd: Option<&str>| {
        let mut c = Command::new(BMX);
        c.args(["exec", "--harness", &h.api]);
        if let Some(cwd) = cwd {
            c.args(["--cwd", cwd]);
        }
        run(c.args(["--", "pwd"]))
    };
    // Default: the workspace itself.
    let out = exec(None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), canonical.to_str().unwrap());
    let out = exec(Some("sub"));
    assert_eq!(
        text(&out.stdout).trim(),
        canonical.join("sub").to_str().unwrap()
    );
    // Absolute inside is fine too.
    let out = exec(Some(canonical.join("sub").to_str().unwrap()));
    assert!(out.status.success(), "{}", text(&out.stderr));
    for bad in [
        "..",
        "/",
        "escape",
        outside.to_str().unwrap(),
        "keep.txt",
        "missing",
    ] {
        let out = exec(Some(bad));
        assert!(!out.status.success(), "{bad}: {}", text(&out.stdout));
        let err = text(&out.stderr);
        assert!(err.contains("invalid working directory"), "{bad}: {err}");
    }
    // Sessions ended (bmx exec stops its own): the workspace is still there.
    assert_eq!(
        std::fs::read_to_string(ws.join("keep.txt")).unwrap(),
        "mine"
    );
    assert!(e.running());
    assert_eq!(e.term(), Some(0));
    assert!(ws.join("keep.txt").exists());
}

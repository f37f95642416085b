//! Issue 56, item 2 (the harness's part): the data dir is private.
//! `harness.db` and the blobs were created 0644, safe only while bmx made
//! the directory itself with 0700: an operator-made 0755 `/var/lib/bmx`
//! exposed every workspace backup. The real `bmx harness`, started under
//! umask 0 in a 0755 parent: its data dir is 0700, the database, its WAL
//! and shared-memory files and a stored blob are 0600, the blob
//! directories 0700. A data dir other users can write to, or another
//! user's, is refused at start (exit 2, the flag named); files of an
//! earlier run that were more open are made private.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const TOKEN: &str = "data-dir-test-api-token-77";

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .mode()
        & 0o7777
}

fn command(data: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_bmx"));
    c.args([
        "harness",
        "--listen",
        "127.0.0.1:0",
        "--token",
        "e=data-dir-exec-secret",
    ])
    .arg("--data-dir")
    .arg(data)
    .env("BMX_API_TOKEN", TOKEN)
    .env("RUST_LOG", "warn")
    .env_remove("BMX_LOG_FORMAT")
    .stdin(Stdio::null());
    c
}

/// Start the harness under umask 0; its API URL.
fn start(data: &Path) -> (Child, String) {
    let mut c = command(data);
    // SAFETY: umask is async-signal-safe and touches only the child.
    unsafe {
        c.pre_exec(|| {
            libc::umask(0);
            Ok(())
        });
    }
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let api = crate::security_common::api_url(&mut child);
    (child, api)
}

/// Run the harness to its exit; (status, stderr).
fn refused(data: &Path) -> (i32, String) {
    let out = command(data)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn stop(mut child: Child) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_dir_is_private_whatever_the_umask_and_parent() {
    let t = tempfile::tempdir().unwrap();
    let parent = t.path().join("var-lib");
    std::fs::create_dir(&parent).unwrap();
    std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let data = parent.join("bmx/harness");
    let (child, api) = start(&data);
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    // A blob (a skill archive is stored as given) and a database write.
    let r = c
        .post(format!("{api}/v1/skills?skillId=s1&revisionId=r1"))
        .bearer_auth(TOKEN)
        .body(b"not really a tar, stored as given".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let r = c
        .post(format!("{api}/v1/enrollments"))
        .header("content-type", "application/json")
        .body(r#"{"workspace": "/w", "displayName": "d"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);

    assert_eq!(mode(&parent), 0o755, "the operator's parent is left alone");
    assert_eq!(mode(&parent.join("bmx")), 0o700);
    assert_eq!(mode(&data), 0o700);
    for f in ["harness.db", "harness.db-wal", "harness.db-shm"] {
        assert_eq!(mode(&data.join(f)), 0o600, "{f}");
    }
    let blobs = data.join("blobs");
    for d in ["", "sha256", "partial", "tmp"] {
        assert_eq!(mode(&blobs.join(d)), 0o700, "blobs/{d}");
    }
    let mut files = 0;
    for sub in std::fs::read_dir(blobs.join("sha256")).unwrap() {
        let sub = sub.unwrap().path();
        assert_eq!(mode(&sub), 0o700, "{}", sub.display());
        for f in std::fs::read_dir(&sub).unwrap() {
            assert_eq!(mode(&f.unwrap().path()), 0o600);
            files += 1;
        }
    }
    assert_eq!(files, 1, "the skill's blob");
    stop(child);
}

#[test]
fn an_open_or_foreign_data_dir_is_refused_and_old_files_are_tightened() {
    let t = tempfile::tempdir().unwrap();
    let open = t.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (code, err) = refused(&open);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--data-dir") && err.contains("writable by group or others"),
        "{err}"
    );
    assert!(
        !open.join("harness.db").exists(),
        "nothing was written there"
    );

    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let nobody = bmx::process::run_as::resolve("nobody").expect("a user nobody");
        let theirs = t.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(nobody.uid), Some(nobody.gid)).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
        let (code, err) = refused(&theirs);
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains("--data-dir") && err.contains("not by this user"),
            "{err}"
        );
    } else {
        let msg = "another user's data dir needs root to make; not checked";
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("SKIPPED in part: {msg}");
    }

    // An earlier run's files, 0644 in a 0755 dir of ours: accepted, and
    // made private.
    let old = t.path().join("old");
    std::fs::create_dir(&old).unwrap();
    std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
    drop(bmx::harness::store::SqliteStore::open(&old.join("harness.db")).unwrap());
    std::fs::set_permissions(
        old.join("harness.db"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    std::fs::create_dir_all(old.join("blobs/sha256")).unwrap();
    std::fs::set_permissions(old.join("blobs"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (child, _api) = start(&old);
    assert_eq!(mode(&old.join("harness.db")), 0o600);
    assert_eq!(mode(&old.join("blobs")), 0o700);
    assert_eq!(mode(&old), 0o755, "the data dir itself is not changed");
    stop(child);
}

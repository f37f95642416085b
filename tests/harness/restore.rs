//! Restore from a backup (`POST /v1/sessions {restoreFrom}` →
//! `session.assign.restore`) through the real harness and the real
//! `bmx executor`: a backup of one session becomes the workspace of a new
//! one before it is ready (files, modes, symlinks); a malicious archive
//! (traversal, a symlink out, a hard link) fails the restore: the session
//! never becomes ready, says why, and nothing is written.

use crate::support;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

type World = support::BlobWorld;

async fn world() -> World {
    let listen = "127.0.0.1:0".parse().unwrap();
    support::blob_world("exec-rs", listen, 64 << 20, None).await
}

async fn until<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn session(w: &World, sid: &str) -> Value {
    let (s, v) = w.api.get(&format!("/v1/sessions/{sid}")).await.unwrap();
    assert_eq!(s, 200, "{v}");
    v
}

/// A tar entry written byte by byte (names `tar::Builder` refuses).
fn entry(out: &mut Vec<u8>, name: &str, kind: tar::EntryType, data: &[u8], link: &str) {
    let mut h = tar::Header::new_old();
    {
        let old = h.as_old_mut();
        old.name[..name.len()].copy_from_slice(name.as_bytes());
        old.linkname[..link.len()].copy_from_slice(link.as_bytes());
    }
    h.set_entry_type(kind);
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_becomes_the_workspace_of_a_new_session() {
    let w = world().await;
    let (s, v) = w.api.get("/v1/executors").await.unwrap();
    assert_eq!(s, 200);
    assert_eq!(
        v["executors"][0]["capabilities"]["workspace"]["restore"], true,
        "{v}"
    );
    let (s, v) = w.api.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(s, 201, "{v}");
    let s1 = v["sessionId"].as_str().unwrap().to_owned();
    support::bash_ok(
        &w.api,
        &s1,
        "mkdir -p src/deep && printf 'fn main() {}' > src/main.rs && chmod 750 src/main.rs && \
         ln -s ../main.rs src/deep/up && touch -d @1000000 src/main.rs",
    )
    .await;
    let (s, b) = w
        .api
        .post(
            &format!("/v1/sessions/{s1}/backups"),
            &json!({"backupId": "rb1"}),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["backup"]["state"], "completed", "{b}");

    let (s, v) = w
        .api
        .post(
            "/v1/sessions",
            &json!({"restoreFrom": {"backupId": "rb1", "sessionId": s1}}),
        )
        .await
        .unwrap();
    assert_eq!(s, 201, "{v}");
    let s2 = v["sessionId"].as_str().unwrap().to_owned();
    until("the restored session to be ready", || async {
        let v = session(&w, &s2).await;
        assert_ne!(v["status"], "error", "{v}");
        (v["ready"] == true).then_some(())
    })
    .await;
    let out = support::bash_stdout(
        &w.api,
        &s2,
        "cat src/main.rs; echo; readlink src/deep/up; cat src/deep/up; echo; stat -c '%a %Y' src/main.rs",
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "fn main() {}", "{out}");
    assert_eq!(lines[1], "../main.rs", "{out}");
    assert_eq!(lines[2], "fn main() {}", "{out}");
    assert_eq!(lines[3], "750 1000000", "{out}");

    // The same by the archive's artifact id.
    let art = b["backup"]["artifactId"].as_str().unwrap();
    let (s, v) = w
        .api
        .post("/v1/sessions", &json!({"restoreFrom": {"artifactId": art}}))
        .await
        .unwrap();
    assert_eq!(s, 201, "{v}");
    let s3 = v["sessionId"].as_str().unwrap().to_owned();
    until("the second restore", || async {
        (session(&w, &s3).await["ready"] == true).then_some(())
    })
    .await;
    assert_eq!(
        support::bash_stdout(&w.api, &s3, "cat src/main.rs").await,
        "fn main() {}"
    );

    // Unknown backups and bad requests: no session made.
    let (s, v) = w
        .api
        .post(
            "/v1/sessions",
            &json!({"restoreFrom": {"backupId": "nope"}}),
        )
        .await
        .unwrap();
    assert_eq!(s, 404, "{v}");
    let (s, v) = w
        .api
        .post(
            "/v1/sessions",
            &json!({"restoreFrom": {"backupId": "rb1", "artifactId": art}}),
        )
        .await
        .unwrap();
    assert_eq!(s, 400, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malicious_archive_fails_the_restore_and_writes_nothing() {
    let w = world().await;
    let (s, v) = w.api.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(s, 201, "{v}");
    let staging = v["sessionId"].as_str().unwrap().to_owned();
    let work = w.guard.1.path().to_owned();
    let marker = format!("bmx-evil-{}", std::process::id());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("path_traversal", {
            let mut t = Vec::new();
            entry(&mut t, "ok.txt", tar::EntryType::Regular, b"fine", "");
            entry(
                &mut t,
                &format!("../../{marker}"),
                tar::EntryType::Regular,
                b"x",
                "",
            );
            t
        }),
        ("symlink_escape", {
            let mut t = Vec::new();
            entry(
                &mut t,
                "out",
                tar::EntryType::Symlink,
                b"",
                work.to_str().unwrap(),
            );
            entry(
                &mut t,
                &format!("out/{marker}"),
                tar::EntryType::Regular,
                b"x",
                "",
            );
            t
        }),
        ("hard_link", {
            let mut t = Vec::new();
            entry(&mut t, "h", tar::EntryType::Link, b"", "/etc/passwd");
            t
        }),
    ];
    for (i, (code, mut tar)) in cases.into_iter().enumerate() {
        tar.extend_from_slice(&[0u8; 1024]);
        // Into the blob store as an artifact of another session: a
        // session file, then published.
        let name = format!("evil{i}.tar");
        let resp = reqwest::Client::new()
            .put(format!(
                "{}/v1/sessions/{staging}/files/uploads/{name}",
                w.h.api_url()
            ))
            .body(tar)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let (s, a) = w
            .api
            .post(
                &format!("/v1/sessions/{staging}/artifacts"),
                &json!({"path": format!("uploads/{name}")}),
            )
            .await
            .unwrap();
        assert_eq!(s, 201, "{a}");
        let art = a["artifact"]["artifactId"].as_str().unwrap();

        let (s, v) = w
            .api
            .post("/v1/sessions", &json!({"restoreFrom": {"artifactId": art}}))
            .await
            .unwrap();
        assert_eq!(s, 201, "{v}");
        let sid = v["sessionId"].as_str().unwrap().to_owned();
        let v = until("the restore to fail", || async {
            let v = session(&w, &sid).await;
            (v["status"] == "error").then_some(v)
        })
        .await;
        assert_eq!(v["ready"], false, "{v}");
        let detail = v["statusDetail"].as_str().unwrap_or_default();
        assert!(
            detail.starts_with(&format!("restore_failed: {code}:")),
            "{code}: {v}"
        );
        // Nothing written: not outside, not in the workspace.
        assert!(!work.join(&marker).exists(), "{code}");
        let ws = work.join("sessions").join(&sid);
        let left: Vec<_> = std::fs::read_dir(&ws)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{code}: {left:?}");
    }
    assert!(!std::path::Path::new("/etc").join(&marker).exists());
}

//! Workspace backups through the real harness (library, filesystem blob
//! store) and the real `bmx executor` binary: a deterministic archive of
//! the workspace in the blob store, skipped when the fingerprint has not
//! changed, idempotent by `backupId`, paths kept inside the workspace.

use crate::support;
use serde_json::{json, Value};
use std::io::Read;

type World = support::BlobWorld;

async fn world() -> World {
    let listen = "127.0.0.1:0".parse().unwrap();
    support::blob_world("exec-bk", listen, 64 << 20, None).await
}

async fn backup(w: &World, sid: &str, body: Value) -> (u16, Value) {
    w.api
        .post(&format!("/v1/sessions/{sid}/backups"), &body)
        .await
        .unwrap()
}

/// The archive's entries as (path, content or link target).
async fn entries(w: &World, artifact_id: &str) -> Vec<(String, String)> {
    let bytes = reqwest::get(format!("{}/v1/artifacts/{artifact_id}", w.h.api_url()))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let mut t = tar::Archive::new(zstd::Decoder::new(&bytes[..]).unwrap());
    let mut out = Vec::new();
    for e in t.entries().unwrap() {
        let mut e = e.unwrap();
        let path = e
            .path()
            .unwrap()
            .to_string_lossy()
            .trim_end_matches('/')
            .to_owned();
        let mut body = String::new();
        if e.header().entry_type().is_file() {
            e.read_to_string(&mut body).unwrap();
        } else if e.header().entry_type().is_symlink() {
            body = e
                .link_name()
                .unwrap()
                .unwrap()
                .to_string_lossy()
                .into_owned();
        }
        out.push((path, body));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backups_are_deterministic_skipped_when_unchanged_and_idempotent() {
    let w = world().await;
    let (s, v) = w.api.get("/v1/executors").await.unwrap();
    assert_eq!(s, 200);
    assert_eq!(
        v["executors"][0]["capabilities"]["workspace"]["backup"], true,
        "{v}"
    );
    let (s, v) = w.api.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(s, 201, "{v}");
    let sid = v["sessionId"].as_str().unwrap().to_owned();
    support::bash_ok(
        &w.api,
        &sid,
        "mkdir -p src/deep target && printf 'fn main() {}' > src/main.rs && \
         printf 'x' > src/deep/z && printf 'junk' > target/out && ln -s main.rs src/link",
    )
    .await;

    let (s, b1) = backup(&w, &sid, json!({"backupId": "b1", "exclude": ["target"]})).await;
    assert_eq!(s, 200, "{b1}");
    let b1 = &b1["backup"];
    assert_eq!(b1["state"], "completed", "{b1}");
    assert_eq!(b1["skipped"], false);
    assert_eq!(b1["entries"], 5, "{b1}");
    let fp = b1["fingerprint"].as_str().unwrap().to_owned();
    let digest = b1["digest"].as_str().unwrap().to_owned();
    assert!(digest.starts_with("sha256:"));
    let art = b1["artifactId"].as_str().unwrap().to_owned();
    assert_eq!(
        entries(&w, &art).await,
        [
            ("src".to_owned(), String::new()),
            ("src/deep".to_owned(), String::new()),
            ("src/deep/z".to_owned(), "x".to_owned()),
            ("src/link".to_owned(), "main.rs".to_owned()),
            ("src/main.rs".to_owned(), "fn main() {}".to_owned()),
        ]
    );

    // Same backupId: the same answer, not a new backup.
    let (s, again) = backup(&w, &sid, json!({"backupId": "b1"})).await;
    assert_eq!(s, 200);
    assert_eq!(&again["backup"], b1);

    // Unchanged tree: skipped on the fingerprint, nothing archived.
    let (s, b2) = backup(
        &w,
        &sid,
        json!({"backupId": "b2", "exclude": ["target"], "skipIfFingerprint": fp}),
    )
    .await;
    assert_eq!(s, 200, "{b2}");
    assert_eq!(b2["backup"]["skipped"], true, "{b2}");
    assert_eq!(b2["backup"]["state"], "skipped");
    assert_eq!(b2["backup"]["fingerprint"], fp.as_str());

    // Unchanged tree, no skip asked: the same bytes (deterministic).
    let (_, b3) = backup(&w, &sid, json!({"backupId": "b3", "exclude": ["target"]})).await;
    assert_eq!(b3["backup"]["digest"], digest.as_str(), "{b3}");

    // A changed file: a new fingerprint, not skipped.
    support::bash_ok(&w.api, &sid, "printf 'y' > src/deep/z2").await;
    let (_, b4) = backup(
        &w,
        &sid,
        json!({"backupId": "b4", "exclude": ["target"], "skipIfFingerprint": fp}),
    )
    .await;
    assert_eq!(b4["backup"]["skipped"], false, "{b4}");
    assert_ne!(b4["backup"]["fingerprint"], fp.as_str());
    assert_eq!(b4["backup"]["entries"], 6);

    // Only some paths.
    let (_, b5) = backup(&w, &sid, json!({"backupId": "b5", "paths": ["src/deep"]})).await;
    let art5 = b5["backup"]["artifactId"].as_str().unwrap().to_owned();
    assert_eq!(
        entries(&w, &art5).await,
        [
            ("src/deep".to_owned(), String::new()),
            ("src/deep/z".to_owned(), "x".to_owned()),
            ("src/deep/z2".to_owned(), "y".to_owned()),
        ]
    );

    let (s, l) = w
        .api
        .get(&format!("/v1/sessions/{sid}/backups"))
        .await
        .unwrap();
    assert_eq!(s, 200);
    let ids: Vec<&str> = l["backups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["backupId"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["b1", "b3", "b4", "b5"], "{l}");

    // Outside the workspace: refused, nothing archived.
    for p in ["..", "/etc", "../../"] {
        let (s, v) = backup(&w, &sid, json!({"paths": [p]})).await;
        assert_eq!(s, 400, "{p}: {v}");
        assert_eq!(
            v["error"]["data"]["reason"], "workspace_boundary",
            "{p}: {v}"
        );
    }
    let (s, v) = backup(&w, &sid, json!({"exclude": ["["]})).await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = backup(&w, &sid, json!({"backupId": "bad id!"})).await;
    assert_eq!(s, 400, "{v}");
    let (s, _) = w.api.get("/v1/sessions/nobody/backups").await.unwrap();
    assert_eq!(s, 404);
}

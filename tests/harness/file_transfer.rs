//! File-transfer processes (`process.start.fileTransfer`) through the real
//! harness (library, filesystem blob store) and the real `bmx executor`
//! binary: an upload to the blob store and a download into the workspace,
//! both listed as processes of the session with their result in
//! `process.read.fileTransfer`; the conflict check (`expectedDigest`,
//! `currentDigest`); paths that escape (`..`, a symlink out); the size
//! cap hit in the middle of a download, which leaves no partial file.

use crate::support;
use serde_json::{json, Value};

type World = support::BlobWorld;

async fn world() -> World {
    let listen = "127.0.0.1:0".parse().unwrap();
    support::blob_world("exec-ft", listen, 16 << 20, None).await
}

/// Start a transfer process and wait for its end; `(status, state)`.
async fn start(w: &World, sid: &str, process_id: &str, ft: Value) -> (u16, Value) {
    w.api
        .post(
            &format!("/v1/sessions/{sid}/processes"),
            &json!({"processId": process_id, "fileTransfer": ft, "waitMs": 20_000}),
        )
        .await
        .unwrap()
}

/// The process's `process.read` once it has ended.
async fn result(w: &World, sid: &str, process_id: &str) -> Value {
    let (s, v) = w
        .api
        .get(&format!(
            "/v1/sessions/{sid}/processes/{process_id}/output?waitMs=10000"
        ))
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["eof"], true, "{v}");
    v
}

async fn transfer(w: &World, sid: &str, process_id: &str, ft: Value) -> Value {
    let (s, st) = start(w, sid, process_id, ft).await;
    assert_eq!(s, 200, "{st}");
    assert_eq!(st["state"], "exited", "{st}");
    let r = result(w, sid, process_id).await;
    assert_eq!(r["exitCode"], st["exitCode"], "{r}");
    r["fileTransfer"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_and_downloads_run_as_processes_with_a_conflict_check() {
    let w = world().await;
    let (s, v) = w.api.get("/v1/executors").await.unwrap();
    assert_eq!(s, 200);
    assert_eq!(
        v["executors"][0]["capabilities"]["process"]["fileTransfer"], true,
        "{v}"
    );
    let (s, v) = w.api.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(s, 201, "{v}");
    let sid = v["sessionId"].as_str().unwrap().to_owned();
    support::bash_ok(&w.api, &sid, "mkdir -p out && printf hello > out/a.txt").await;

    // Upload: the file becomes an artifact (a blob of the store).
    let up = transfer(
        &w,
        &sid,
        "up1",
        json!({"direction": "upload", "localPath": "out/a.txt"}),
    )
    .await;
    assert!(up.get("error").is_none(), "{up}");
    assert_eq!(up["path"], "out/a.txt");
    assert_eq!(up["digest"], support::sha256(b"hello").as_str());
    assert_eq!(up["sizeBytes"], 5);
    let art = up["artifactId"].as_str().unwrap().to_owned();
    let bytes = reqwest::get(format!("{}/v1/artifacts/{art}", w.h.api_url()))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(&bytes[..], b"hello");

    // Download it elsewhere in the workspace (parents made).
    let down = transfer(
        &w,
        &sid,
        "dl1",
        json!({"direction": "download", "localPath": "in/deep/b.txt", "artifactId": art}),
    )
    .await;
    assert!(down.get("error").is_none(), "{down}");
    assert_eq!(down["digest"], support::sha256(b"hello").as_str());
    assert_eq!(
        support::bash_stdout(&w.api, &sid, "cat in/deep/b.txt")
            .await
            .trim(),
        "hello"
    );

    // Both are processes of the session, ended with a state.
    let (s, list) = w
        .api
        .get(&format!("/v1/sessions/{sid}/processes"))
        .await
        .unwrap();
    assert_eq!(s, 200);
    for id in ["up1", "dl1"] {
        let p = list["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["processId"] == id)
            .unwrap_or_else(|| panic!("{id} in {list}"));
        assert_eq!(p["state"], "exited", "{p}");
        assert_eq!(p["exitCode"], 0, "{p}");
    }
    // The same start again is the same process (no new transfer), even
    // though the harness mints a new token for it.
    let (s, again) = start(
        &w,
        &sid,
        "dl1",
        json!({"direction": "download", "localPath": "in/deep/b.txt", "artifactId": art}),
    )
    .await;
    assert_eq!(s, 200, "{again}");
    assert_eq!(again["state"], "exited");

    // Conflict: the caller expects the file it last saw; it changed.
    support::bash_ok(&w.api, &sid, "printf changed > in/deep/b.txt").await;
    let c = transfer(
        &w,
        &sid,
        "dl2",
        json!({"direction": "download", "localPath": "in/deep/b.txt", "artifactId": art,
               "expectedDigest": support::sha256(b"hello")}),
    )
    .await;
    assert_eq!(c["error"]["code"], "conflict", "{c}");
    assert_eq!(
        c["error"]["currentDigest"],
        support::sha256(b"changed").as_str(),
        "{c}"
    );
    assert_eq!(
        support::bash_stdout(&w.api, &sid, "cat in/deep/b.txt")
            .await
            .trim(),
        "changed",
        "a conflict writes nothing"
    );
    // `""`: the file must not exist.
    let c = transfer(
        &w,
        &sid,
        "dl3",
        json!({"direction": "download", "localPath": "in/deep/b.txt", "artifactId": art,
               "expectedDigest": ""}),
    )
    .await;
    assert_eq!(c["error"]["code"], "conflict", "{c}");
    // The right expectation: replaced.
    let ok = transfer(
        &w,
        &sid,
        "dl4",
        json!({"direction": "download", "localPath": "in/deep/b.txt", "artifactId": art,
               "expectedDigest": support::sha256(b"changed")}),
    )
    .await;
    assert!(ok.get("error").is_none(), "{ok}");
    assert_eq!(
        support::bash_stdout(&w.api, &sid, "cat in/deep/b.txt")
            .await
            .trim(),
        "hello"
    );
    // An upload checks too.
    let c = transfer(
        &w,
        &sid,
        "up2",
        json!({"direction": "upload", "localPath": "out/a.txt", "expectedDigest": support::sha256(b"other")}),
    )
    .await;
    assert_eq!(c["error"]["code"], "conflict", "{c}");
    assert_eq!(
        c["error"]["currentDigest"],
        support::sha256(b"hello").as_str()
    );
    let st = result(&w, &sid, "up2").await;
    assert_eq!(st["exitCode"], 1, "a failed transfer exits 1: {st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escapes_and_oversize_transfers_leave_nothing_behind() {
    let w = world().await;
    let (s, v) = w.api.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(s, 201, "{v}");
    let sid = v["sessionId"].as_str().unwrap().to_owned();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), "outside").unwrap();
    let out = outside.path().display().to_string();
    support::bash_ok(
        &w.api,
        &sid,
        &format!(
            "ln -s {out} esc && ln -s {out}/secret leak && head -c 3000000 /dev/urandom > big.bin && printf small > small.txt"
        ),
    )
    .await;
    let big = transfer(
        &w,
        &sid,
        "big",
        json!({"direction": "upload", "localPath": "big.bin"}),
    )
    .await;
    assert!(big.get("error").is_none(), "{big}");
    let big_art = big["artifactId"].as_str().unwrap().to_owned();

    // `..` and absolute paths: refused at start, no process made.
    for (i, p) in ["../x", "a/../../x", "/etc/passwd"].iter().enumerate() {
        let (s, v) = start(
            &w,
            &sid,
            &format!("bad{i}"),
            json!({"direction": "download", "localPath": p, "artifactId": big_art}),
        )
        .await;
        assert_eq!(s, 400, "{p}: {v}");
        assert_eq!(v["error"]["data"]["reason"], "workspace_boundary", "{v}");
    }
    // A symlink out: found when the transfer runs; nothing written there,
    // nothing read from there.
    let r = transfer(
        &w,
        &sid,
        "esc1",
        json!({"direction": "download", "localPath": "esc/planted", "artifactId": big_art}),
    )
    .await;
    assert_eq!(r["error"]["code"], "workspace_boundary", "{r}");
    assert!(!outside.path().join("planted").exists());
    let r = transfer(
        &w,
        &sid,
        "esc2",
        json!({"direction": "upload", "localPath": "leak"}),
    )
    .await;
    assert_eq!(r["error"]["code"], "workspace_boundary", "{r}");
    assert!(r.get("artifactId").is_none());

    // The size cap hit in the middle of a download: no file, no partial
    // file beside it.
    let r = transfer(
        &w,
        &sid,
        "cap1",
        json!({"direction": "download", "localPath": "cap/big.bin", "artifactId": big_art,
               "maxBytes": 1_000_000}),
    )
    .await;
    assert_eq!(r["error"]["code"], "too_large", "{r}");
    assert_eq!(
        support::bash_stdout(&w.api, &sid, "ls -A cap | wc -l")
            .await
            .trim(),
        "0",
        "the partial file is gone"
    );
    // An upload over its cap sends nothing.
    let r = transfer(
        &w,
        &sid,
        "cap2",
        json!({"direction": "upload", "localPath": "big.bin", "maxBytes": 1000}),
    )
    .await;
    assert_eq!(r["error"]["code"], "too_large", "{r}");
    // Not a file; missing.
    let r = transfer(
        &w,
        &sid,
        "nf1",
        json!({"direction": "upload", "localPath": "cap"}),
    )
    .await;
    assert_eq!(r["error"]["code"], "not_a_file", "{r}");
    let r = transfer(
        &w,
        &sid,
        "nf2",
        json!({"direction": "upload", "localPath": "nope"}),
    )
    .await;
    assert_eq!(r["error"]["code"], "not_found", "{r}");
    // A bad shape is refused before anything runs.
    let (s, v) = start(
        &w,
        &sid,
        "shape",
        json!({"direction": "sideways", "localPath": "small.txt"}),
    )
    .await;
    assert_eq!(s, 400, "{v}");
}

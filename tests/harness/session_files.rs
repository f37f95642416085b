//! Session files through the real harness and the real `bmx executor`:
//! `PUT …/files/uploads/{path}` lands in the workspace's `uploads/`,
//! `GET …/files/outputs/{path}` fetches from `outputs/`; preconditions
//! (`If-Match`, `If-None-Match: *`); bad paths (`..`, a symlink out) are
//! 400 `invalid_path`; a missing file 404; a body over the limit 413.

use crate::support;
use serde_json::{json, Value};

type World = support::BlobWorld;

async fn world() -> World {
    let listen = "127.0.0.1:0".parse().unwrap();
    support::blob_world("exec-sf", listen, 128 << 20, None).await
}

async fn put(
    w: &World,
    sid: &str,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .put(format!(
            "{}/v1/sessions/{sid}/files/uploads/{path}",
            w.h.api_url()
        ))
        .body(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let v = resp.json::<Value>().await.unwrap_or(Value::Null);
    (status, v)
}

/// Send only the head of a `PUT` declaring `length` bytes; the status
/// line of the answer.
async fn declare_only(w: &World, path: &str, length: u64) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = w.h.api_url().trim_start_matches("http://").to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s.write_all(
        format!("PUT {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {length}\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(20), s.read(&mut buf))
        .await
        .expect("an answer without the body")
        .unwrap();
    String::from_utf8_lossy(&buf[..n])
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned()
}

async fn get(w: &World, sid: &str, path: &str) -> reqwest::Response {
    reqwest::get(format!(
        "{}/v1/sessions/{sid}/files/outputs/{path}",
        w.h.api_url()
    ))
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_land_in_the_workspace_and_outputs_come_back() {
    let w = world().await;
    let (s, v) = w.api.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(s, 201, "{v}");
    let sid = v["sessionId"].as_str().unwrap().to_owned();

    let (s, v) = put(&w, &sid, "docs/a.txt", b"hello".to_vec(), &[]).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["path"], "uploads/docs/a.txt");
    assert_eq!(v["digest"], support::sha256(b"hello").as_str());
    assert_eq!(v["sizeBytes"], 5);
    assert_eq!(
        support::bash_stdout(&w.api, &sid, "cat uploads/docs/a.txt")
            .await
            .trim(),
        "hello"
    );

    // Preconditions: the conflict check of the transfer underneath.
    let (s, v) = put(
        &w,
        &sid,
        "docs/a.txt",
        b"second".to_vec(),
        &[("if-match", &format!("\"{}\"", support::sha256(b"other")))],
    )
    .await;
    assert_eq!(s, 409, "{v}");
    let (s, v) = put(
        &w,
        &sid,
        "docs/a.txt",
        b"second".to_vec(),
        &[("if-none-match", "*")],
    )
    .await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(
        support::bash_stdout(&w.api, &sid, "cat uploads/docs/a.txt")
            .await
            .trim(),
        "hello",
        "refused writes change nothing"
    );
    let (s, v) = put(
        &w,
        &sid,
        "docs/a.txt",
        b"second".to_vec(),
        &[("if-match", &format!("\"{}\"", support::sha256(b"hello")))],
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        support::bash_stdout(&w.api, &sid, "cat uploads/docs/a.txt")
            .await
            .trim(),
        "second"
    );

    // Outputs.
    support::bash_ok(
        &w.api,
        &sid,
        "mkdir -p outputs/r && printf result > outputs/r/x.txt",
    )
    .await;
    let resp = get(&w, &sid, "r/x.txt").await;
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(
        resp.headers()["etag"].to_str().unwrap(),
        format!("\"{}\"", support::sha256(b"result"))
    );
    assert_eq!(&resp.bytes().await.unwrap()[..], b"result");
    let resp = get(&w, &sid, "r/missing.txt").await;
    assert_eq!(resp.status().as_u16(), 404);

    // The transfers were processes of the session.
    let (_, list) = w
        .api
        .get(&format!("/v1/sessions/{sid}/processes"))
        .await
        .unwrap();
    let files = list["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["processId"].as_str().unwrap().starts_with("file-"))
        .count();
    assert!(files >= 5, "{list}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_paths_and_oversize_bodies_are_refused() {
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
        &format!("mkdir -p uploads outputs && ln -s {out} uploads/esc && ln -s {out}/secret outputs/leak"),
    )
    .await;

    // `..` (percent-encoded so no client folds it away), empty segments.
    for p in ["..%2Fx", "a%2F..%2F..%2Fx", "a%2F%2Fb", "%2Fetc%2Fpasswd"] {
        let (s, v) = put(&w, &sid, p, b"x".to_vec(), &[]).await;
        assert_eq!(s, 400, "{p}: {v}");
        assert_eq!(v["error"]["data"]["reason"], "invalid_path", "{p}: {v}");
        let resp = get(&w, &sid, p).await;
        assert_eq!(resp.status().as_u16(), 400, "{p}");
    }
    // A symlink out, found by the executor.
    let (s, v) = put(&w, &sid, "esc/planted", b"x".to_vec(), &[]).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["data"]["reason"], "invalid_path", "{v}");
    assert!(!outside.path().join("planted").exists());
    let resp = get(&w, &sid, "leak").await;
    assert_eq!(resp.status().as_u16(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["data"]["reason"], "invalid_path", "{v}");

    // Over the limit: refused on the declared length, before a byte of
    // the body is read (none is sent here: the answer comes anyway).
    let status = declare_only(
        &w,
        &format!("/v1/sessions/{sid}/files/uploads/big.bin"),
        bmx::harness::api::files::MAX_UPLOAD_BYTES as u64 + 1,
    )
    .await;
    assert!(status.starts_with("HTTP/1.1 413"), "{status}");
    // A body without a declared length is read to the limit only.
    let stream =
        futures_util::stream::iter((0..65).map(|_| Ok::<_, std::io::Error>(vec![b'x'; 1 << 20])));
    let resp = reqwest::Client::new()
        .put(format!(
            "{}/v1/sessions/{sid}/files/uploads/big.bin",
            w.h.api_url()
        ))
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await;
    if let Ok(resp) = resp {
        assert_eq!(resp.status().as_u16(), 413);
    }
    assert_eq!(
        support::bash_stdout(&w.api, &sid, "ls -A uploads")
            .await
            .trim(),
        "esc",
        "nothing written"
    );
    // Unknown session.
    let (s, _) = put(&w, "no-such-session", "a.txt", b"x".to_vec(), &[]).await;
    assert_eq!(s, 404);
}

//! Artifacts through the real harness (its library, with the filesystem
//! blob store) and the real `bmx executor` binary: upload, a TCP cut in
//! the middle of the upload (resumed from the harness's offset, the blob
//! never corrupt), idempotency by digest, download with `ETag` and
//! `Range`, and the bad inputs (paths outside the workspace, too large,
//! forged tickets). Plus `fs.mount` / `fs.unmount`: still -32012.

use crate::support;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP proxy in front of the harness's public URL (where executors send
/// uploads). Once armed, the first connection whose executor → harness
/// bytes pass `cut_after` is closed right there, both ways; later
/// connections pass. Counts the bytes it forwarded upstream.
struct Proxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    armed: Arc<AtomicBool>,
    upstream_bytes: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn proxy(target: SocketAddr, cut_after: u64) -> Proxy {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let cut = Arc::new(AtomicBool::new(false));
    let armed = Arc::new(AtomicBool::new(false));
    let upstream_bytes = Arc::new(AtomicU64::new(0));
    let (c, a, u) = (cut.clone(), armed.clone(), upstream_bytes.clone());
    let task = tokio::spawn(async move {
        while let Ok((client, _)) = l.accept().await {
            let (c, a, u) = (c.clone(), a.clone(), u.clone());
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(target).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let down = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                    cw
                });
                let mut buf = vec![0u8; 16 * 1024];
                let mut seen = 0u64;
                loop {
                    let n = match cr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if a.load(Ordering::SeqCst)
                        && seen + n as u64 > cut_after
                        && !c.swap(true, Ordering::SeqCst)
                    {
                        // Close both sides: the upload dies mid-chunk.
                        down.abort();
                        drop(sw);
                        return;
                    }
                    seen += n as u64;
                    u.fetch_add(n as u64, Ordering::SeqCst);
                    if sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = sw.shutdown().await;
                let _ = down.await;
            });
        }
    });
    Proxy {
        addr,
        cut,
        armed,
        upstream_bytes,
        task,
    }
}

struct World {
    base: support::BlobWorld,
    proxy: Proxy,
}

/// The harness (blobs of at most `max_blob` bytes, uploads through a
/// proxy that cuts once at `cut_after` when armed) and the executor binary.
/// Build the world in the right order: proxy (pointing at a fixed harness
/// port), then the harness with the proxy as its public URL.
async fn world_at(max_blob: u64, cut_after: u64) -> World {
    let port_probe = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let harness_addr = port_probe.local_addr().unwrap();
    drop(port_probe);
    let proxy = proxy(harness_addr, cut_after).await;
    let public = Some(format!("http://{}", proxy.addr));
    let rest = support::blob_world("exec-art", harness_addr, max_blob, public).await;
    World { base: rest, proxy }
}

async fn session(w: &World) -> String {
    let (s, v) = w.base.api.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(s, 201, "{v}");
    v["sessionId"].as_str().unwrap().to_owned()
}

async fn publish(w: &World, sid: &str, body: Value) -> (u16, Value) {
    w.base
        .api
        .post(&format!("/v1/sessions/{sid}/artifacts"), &body)
        .await
        .unwrap()
}

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_cut_mid_way_resumes_and_the_blob_is_whole() {
    let w = world_at(8 * MIB, MIB + MIB / 2).await;
    let (s, v) = w.base.api.get("/v1/executors").await.unwrap();
    assert_eq!(s, 200);
    let caps = &v["executors"][0]["capabilities"]["artifacts"];
    assert_eq!(caps["upload"], true, "{v}");
    assert!(caps["maxBytes"].as_u64().unwrap() >= 8 * MIB);

    let sid = session(&w).await;
    // 3 MiB of random bytes: three chunks.
    support::bash_ok(&w.base.api, &sid, "head -c 3145728 /dev/urandom > out.bin").await;

    w.proxy.armed.store(true, Ordering::SeqCst);
    let (s, a) = publish(&w, &sid, json!({"path": "out.bin"})).await;
    assert_eq!(s, 201, "{a}");
    assert!(
        w.proxy.cut.load(Ordering::SeqCst),
        "the proxy cut the upload"
    );
    // Resumed from the harness's offset, not from zero: less than the
    // whole file went upstream twice.
    let upstream = w.proxy.upstream_bytes.load(Ordering::SeqCst);
    assert!(
        upstream < 3 * MIB + 2 * MIB,
        "{upstream} bytes went upstream for a 3 MiB file"
    );
    let art = &a["artifact"];
    assert_eq!(art["name"], "out.bin");
    assert_eq!(art["sizeBytes"], 3 * MIB);
    assert_eq!(art["mimeType"], "application/octet-stream");
    let id = art["artifactId"].as_str().unwrap().to_owned();
    let digest = art["digest"].as_str().unwrap().to_owned();

    // The download is the file, byte for byte: its digest is the one
    // `sha256sum` computes in the workspace.
    let http = reqwest::Client::new();
    let url = format!("{}/v1/artifacts/{id}", w.base.h.api_url());
    let r = http.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["etag"].to_str().unwrap(),
        format!("\"{digest}\"")
    );
    assert_eq!(r.headers()["accept-ranges"], "bytes");
    let body = r.bytes().await.unwrap();
    assert_eq!(body.len() as u64, 3 * MIB);
    assert_eq!(support::sha256(&body), digest);
    let out = support::bash_ok(&w.base.api, &sid, "sha256sum out.bin").await;
    assert!(out.contains(&digest["sha256:".len()..]), "{out}");

    // Ranges.
    let r = http
        .get(&url)
        .header("range", "bytes=10-19")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(
        r.headers()["content-range"],
        format!("bytes 10-19/{}", 3 * MIB).as_str()
    );
    assert_eq!(r.bytes().await.unwrap(), body.slice(10..20));
    let r = http
        .get(&url)
        .header("range", "bytes=-5")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(r.bytes().await.unwrap(), body.slice(body.len() - 5..));
    for bad in [
        format!("bytes={}-", 3 * MIB),
        "bytes=5-1".into(),
        "bytes=0-1,4-5".into(),
    ] {
        let r = http.get(&url).header("range", &bad).send().await.unwrap();
        assert_eq!(r.status(), 416, "{bad}");
        assert_eq!(
            r.headers()["content-range"],
            format!("bytes */{}", 3 * MIB).as_str()
        );
    }
    let r = http
        .get(&url)
        .header("if-none-match", format!("\"{digest}\""))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 304);

    // Idempotent by digest: the same bytes again (even under another
    // path) are the same artifact, and no chunk travels again.
    let before = w.proxy.upstream_bytes.load(Ordering::SeqCst);
    support::bash_ok(&w.base.api, &sid, "cp out.bin again.bin").await;
    let (s, b) = publish(&w, &sid, json!({"path": "again.bin"})).await;
    assert_eq!(s, 201, "{b}");
    assert_eq!(b["artifact"]["artifactId"], id.as_str());
    let sent = w.proxy.upstream_bytes.load(Ordering::SeqCst) - before;
    assert!(sent < 64 * 1024, "{sent} bytes sent for a stored blob");

    // A name and a type of the platform's choosing.
    support::bash_ok(&w.base.api, &sid, "printf 'hello' > note").await;
    let (s, n) = publish(
        &w,
        &sid,
        json!({"path": "note", "name": "greeting.txt", "mimeType": "text/plain"}),
    )
    .await;
    assert_eq!(s, 201, "{n}");
    assert_eq!(n["artifact"]["name"], "greeting.txt");
    assert_eq!(n["artifact"]["mimeType"], "text/plain");
    assert_eq!(n["artifact"]["digest"], support::sha256(b"hello"));
    let r = http
        .get(format!(
            "{}/v1/artifacts/{}",
            w.base.h.api_url(),
            n["artifact"]["artifactId"].as_str().unwrap()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["content-type"], "text/plain");
    assert_eq!(r.bytes().await.unwrap().as_ref(), b"hello");

    let (s, l) = w
        .base
        .api
        .get(&format!("/v1/sessions/{sid}/artifacts"))
        .await
        .unwrap();
    assert_eq!(s, 200);
    let list = l["artifacts"].as_array().unwrap();
    assert_eq!(list.len(), 2, "{l}");
    assert_eq!(list[0]["artifactId"], id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_paths_sizes_and_tickets_are_refused() {
    let w = world_at(MIB, u64::MAX).await;
    let sid = session(&w).await;
    support::bash_ok(
        &w.base.api,
        &sid,
        "mkdir d && ln -s /etc/passwd link && head -c 1048577 /dev/zero > big",
    )
    .await;
    for path in ["../outside", "/etc/passwd", "link", "d/../../x"] {
        let (s, v) = publish(&w, &sid, json!({ "path": path })).await;
        assert_eq!(s, 400, "{path}: {v}");
        assert_eq!(
            v["error"]["data"]["reason"], "workspace_boundary",
            "{path}: {v}"
        );
    }
    let (s, v) = publish(&w, &sid, json!({"path": "d"})).await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = publish(&w, &sid, json!({"path": "missing"})).await;
    assert_eq!(s, 404, "{v}");
    // One byte over the harness's limit: refused before it is read.
    let (s, v) = publish(&w, &sid, json!({"path": "big"})).await;
    assert_eq!(s, 413, "{v}");
    assert_eq!(v["error"]["code"], -32013);
    let (s, v) = publish(&w, &sid, json!({"path": "x", "bogus": 1})).await;
    assert_eq!(s, 400, "{v}");
    let (s, _) = publish(&w, "nobody", json!({"path": "x"})).await;
    assert_eq!(s, 404);
    let (s, _) = w
        .base
        .api
        .get("/v1/sessions/nobody/artifacts")
        .await
        .unwrap();
    assert_eq!(s, 404);
    let (s, _) = w.base.api.get("/v1/artifacts/art-000").await.unwrap();
    assert_eq!(s, 404);

    // The upload route takes a ticket, nothing else.
    let http = reqwest::Client::new();
    let url = format!(
        "{}/v1/artifact-uploads/0123456789abcdef",
        w.base.h.api_url()
    );
    let begin = json!({"digest": support::sha256(b"x"), "sizeBytes": 1}).to_string();
    for auth in [None, Some("0123456789abcdef.00"), Some("nope")] {
        let mut r = http.post(&url).body(begin.clone());
        if let Some(a) = auth {
            r = r.bearer_auth(a);
        }
        assert_eq!(r.send().await.unwrap().status(), 401, "{auth:?}");
        let mut r = http.patch(&url).header("upload-offset", "0").body("x");
        if let Some(a) = auth {
            r = r.bearer_auth(a);
        }
        assert_eq!(r.send().await.unwrap().status(), 401, "{auth:?}");
    }
}

/// `fs` is not offered (no FUSE here): `fs.mount` and `fs.unmount` are
/// refused with -32012, and the capability is not advertised.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fs_mount_and_unmount_stay_unavailable() {
    use bmx::wire::Method;
    let rig = support::Rig::start(support::Options::default()).await;
    rig.assign("s-fs").await;
    for m in [Method::FsMount, Method::FsUnmount] {
        let e = rig
            .conn
            .call::<_, Value>(m, &json!({"sessionId": "s-fs", "path": "/mnt"}))
            .await
            .unwrap_err();
        assert_eq!(e.code, -32012, "{m}: {e:?}");
    }
    rig.shutdown().await;
}

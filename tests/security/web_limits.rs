//! Issue 56, item 4: what an unauthenticated peer can do is bounded.
//!
//! * Enrollment: 999 unauthenticated creates in 0.8 s filled the table
//!   for everyone (429 `too_many_pending` for the TTL). Now each source
//!   has a create rate, a poll rate and a cap of pending enrollments of its
//!   own; another source still gets through.
//! * Failed credentials: about 4 600 guesses a second on one connection.
//!   Now a source that showed too many wrong credentials gets 429 (with
//!   `Retry-After`) for every credential it shows, right or wrong, while
//!   other sources are served; the failures are logged in aggregate.
//! * No body is read before its route's credential is checked, and the
//!   unauthenticated routes refuse a body larger than they take by its
//!   declared length, before a byte of it arrives.
//! * A body must arrive in time: 150 connections that each send 1.9 MB of
//!   a declared 2 MB body and stall are answered 408 and closed, and the
//!   harness gives the memory back (its RSS, read from `/proc`).
//!
//! Different sources are different loopback addresses (127.0.0.2,
//! 127.0.0.3, …): the client binds one before it connects.

use crate::security_common::Bmx;
use bmx::harness::config::{Rate, SourceLimits};
use bmx::harness::{Harness, HarnessConfig, HarnessHandle};
use serde_json::{json, Value};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const TOKEN: &str = "limits-test-api-token-5f1e";
const PATIENCE: Duration = Duration::from_secs(60);

fn source(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

/// A client whose connections come from `127.0.0.LAST`.
fn client_from(last: u8) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(source(last))
        .timeout(PATIENCE)
        .build()
        .unwrap()
}

async fn connect_from(last: u8, to: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(source(last), 0)).unwrap();
    s.connect(to).await.unwrap()
}

async fn harness_with(sources: SourceLimits) -> HarnessHandle {
    let config = HarnessConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        sources,
        ..HarnessConfig::default()
    };
    Harness::builder()
        .config(config)
        .token("exec-a", "secret-a")
        .api_token(Some(TOKEN.into()))
        .enrollment_store(std::sync::Arc::new(
            bmx::harness::store::SqliteStore::in_memory().unwrap(),
        ))
        .build()
        .await
        .unwrap()
}

async fn answer(r: reqwest::Response) -> (u16, Option<String>, Value) {
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let v = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap_or(Value::Null);
    (status, retry, v)
}

async fn create(c: &reqwest::Client, h: &HarnessHandle, n: usize) -> (u16, Option<String>, Value) {
    answer(
        c.post(format!("{}/v1/enrollments", h.api_url()))
            .header("content-type", "application/json")
            .body(json!({"workspace": format!("/w/{n}"), "displayName": "flood"}).to_string())
            .send()
            .await
            .unwrap(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enrollment_flood_from_one_source_leaves_the_others_room() {
    let h = harness_with(SourceLimits::default()).await;
    let flood = client_from(2);
    // The review's flood: 999 creates, as fast as they go.
    let mut created = 0;
    let mut limited = 0;
    for n in 0..999 {
        let (status, retry, v) = create(&flood, &h, n).await;
        match status {
            201 => created += 1,
            429 => {
                limited += 1;
                assert_eq!(v["error"], "rate_limited", "{v}");
                let secs: u64 = retry.expect("Retry-After").parse().unwrap();
                assert!(secs >= 1);
            }
            s => panic!("create {n}: {s} {v}"),
        }
    }
    let burst = SourceLimits::default().enroll_create.burst as usize;
    assert!(created <= burst + 1, "{created} created in the flood");
    assert_eq!(created + limited, 999);
    // Another source is not locked out.
    let (status, _, v) = create(&client_from(3), &h, 0).await;
    assert_eq!(status, 201, "{v}");

    // Polls: a rate per source too (a wrong device code is 404 until then).
    let mut polled = 0;
    loop {
        let (status, _, v) = answer(
            flood
                .post(format!("{}/v1/enrollments/poll", h.api_url()))
                .header("content-type", "application/json")
                .body(json!({"deviceCode": "bmxd_guess"}).to_string())
                .send()
                .await
                .unwrap(),
        )
        .await;
        if status == 429 {
            assert_eq!(v["error"], "rate_limited", "{v}");
            break;
        }
        assert_eq!(status, 404, "{v}");
        polled += 1;
        assert!(polled <= 1000, "polls are never limited");
    }
    let r = client_from(3)
        .post(format!("{}/v1/enrollments/poll", h.api_url()))
        .header("content-type", "application/json")
        .body(json!({"deviceCode": "bmxd_guess"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404, "another source polls on");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_enrollments_are_capped_per_source() {
    let h = harness_with(SourceLimits {
        enroll_create: Rate {
            burst: 1000,
            every: Duration::from_millis(1),
        },
        pending_enrollments: 5,
        ..SourceLimits::default()
    })
    .await;
    let a = client_from(4);
    let mut codes = Vec::new();
    for n in 0..5 {
        let (status, _, v) = create(&a, &h, n).await;
        assert_eq!(status, 201, "{v}");
        codes.push(v["userCode"].as_str().unwrap().to_owned());
    }
    let (status, _, v) = create(&a, &h, 5).await;
    assert_eq!(status, 429, "{v}");
    assert_eq!(v["error"], "too_many_pending", "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("from this address"),
        "{v}"
    );
    let (status, _, v) = create(&client_from(5), &h, 0).await;
    assert_eq!(status, 201, "another source: {v}");
    // An operator's decision frees the source's slot.
    let op = client_from(6);
    let r = op
        .post(format!("{}/v1/enrollments/deny", h.api_url()))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(json!({"userCode": codes[0]}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (status, _, v) = create(&a, &h, 6).await;
    assert_eq!(status, 201, "{v}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_throttled_per_source_and_logged_in_aggregate() {
    let (harness, api) = Bmx::harness(
        &["--token", "exec-1=limits-exec-secret"],
        &[("BMX_API_TOKEN", TOKEN)],
        "info",
    );
    let guesser = client_from(7);
    let url = format!("{api}/v1/executors");
    let mut unauthorized = 0;
    let mut throttled = None;
    for n in 0..200 {
        let (status, retry, v) = answer(
            guesser
                .get(&url)
                .bearer_auth(format!("guess-{n:012}"))
                .send()
                .await
                .unwrap(),
        )
        .await;
        match status {
            401 => unauthorized += 1,
            429 => {
                assert_eq!(v["error"]["data"]["reason"], "too_many_failures", "{v}");
                assert!(retry.is_some(), "Retry-After");
                throttled = Some(n);
            }
            s => panic!("guess {n}: {s} {v}"),
        }
    }
    let burst = SourceLimits::default().auth_failures.burst as usize;
    assert!(
        (burst..=burst + 2).contains(&unauthorized),
        "{unauthorized} guesses were checked"
    );
    assert_eq!(throttled, Some(199), "the last guesses were throttled");
    // The right token from the throttled source is not even checked...
    let r = guesser.get(&url).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), 429);
    // ...while another source is served.
    let r = client_from(8)
        .get(&url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Console logins and executor tokens count the same way.
    let login = client_from(9);
    let mut last = 0;
    for n in 0..60 {
        let r = login
            .post(format!("{api}/console/login"))
            .header("content-type", "application/json")
            .body(json!({"token": format!("wrong-{n}")}).to_string())
            .send()
            .await
            .unwrap();
        last = r.status().as_u16();
        assert!(last == 401 || last == 429, "{last}");
    }
    assert_eq!(last, 429, "logins are throttled");
    let connect = format!("{}/v1/executor/connect", api);
    let exec = client_from(10);
    for _ in 0..60 {
        let r = exec
            .get(&connect)
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap();
        last = r.status().as_u16();
    }
    assert_eq!(last, 429, "executor tokens are throttled");

    let log = harness.stop();
    let first = log.matches("more are counted and logged together").count();
    let summaries: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("refused requests since the last summary"))
        .collect();
    assert_eq!(first, 1, "one line for the first refusal:\n{log}");
    assert!(!summaries.is_empty(), "a summary line:\n{log}");
    let failed: u64 = summaries
        .iter()
        .filter_map(|l| {
            let at = l.find("failed_credentials=")? + "failed_credentials=".len();
            l[at..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    assert!(
        failed >= 3 * burst as u64,
        "{failed} failures summed:\n{log}"
    );
    // Nothing per failure at the default level: the whole log is short.
    assert!(
        log.lines().count() < 40,
        "{} lines:\n{log}",
        log.lines().count()
    );
    assert!(!log.contains(TOKEN) && !log.contains("guess-"), "{log}");
}

/// Send a request head declaring a `length`-byte body, then nothing; the
/// answer that comes back without the body.
async fn head_only(
    to: SocketAddr,
    method: &str,
    path: &str,
    auth: Option<&str>,
    length: u64,
) -> String {
    let mut s = connect_from(11, to).await;
    let auth = auth
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {to}\r\n{auth}Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(PATIENCE, s.read(&mut buf))
        .await
        .expect("answered without the body")
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_body_is_read_before_its_credential_is_checked() {
    let h = harness_with(SourceLimits::default()).await;
    let to = h.local_addr();
    const MB2: u64 = 2_000_000;
    for (method, path) in [
        ("POST", "/v1/artifact-uploads/0123456789abcdef"),
        ("PATCH", "/v1/artifact-uploads/0123456789abcdef"),
        ("POST", "/v1/sessions"),
        ("PUT", "/v1/sessions/s1/files/uploads/a.bin"),
        ("POST", "/v1/skills?skillId=s&revisionId=r"),
    ] {
        let a = head_only(to, method, path, None, MB2).await;
        assert!(a.starts_with("HTTP/1.1 401"), "{method} {path}: {a}");
    }
    // The unauthenticated routes take small bodies: refused by length.
    for path in ["/v1/enrollments", "/v1/enrollments/poll", "/console/login"] {
        let a = head_only(to, "POST", path, None, MB2).await;
        assert!(a.starts_with("HTTP/1.1 413"), "{path}: {a}");
    }
    h.shutdown().await;
}

/// The harness's resident memory, kB.
fn rss_kb(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_are_cut_and_their_memory_returned() {
    const CONNECTIONS: usize = 150;
    const DECLARED: usize = 2_000_000;
    const SENT: usize = 1_900_000;
    // No API token: on loopback every route reads its body, the worst case.
    let (harness, api) = Bmx::harness(
        &[
            "--token",
            "exec-1=limits-exec-secret",
            "--body-timeout-secs",
            "15",
        ],
        &[],
        "warn",
    );
    let pid = harness.pid();
    let to: SocketAddr = api.trim_start_matches("http://").parse().unwrap();
    let before = rss_kb(pid);
    let chunk = vec![b' '; SENT];
    let mut socks = Vec::new();
    for _ in 0..CONNECTIONS {
        let mut s = TcpStream::connect(to).await.unwrap();
        let head = format!(
            "POST /v1/sessions HTTP/1.1\r\nHost: {to}\r\nContent-Type: application/json\r\nContent-Length: {DECLARED}\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&chunk).await.unwrap();
        socks.push(s);
    }
    // Every byte sent is in the harness by now or on its way; wait until
    // it holds most of them (it reads them into the requests' buffers).
    let held_kb = (CONNECTIONS * SENT / 1024) as u64;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut peak = rss_kb(pid);
    while peak < before + held_kb / 2 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        peak = peak.max(rss_kb(pid));
    }
    // Each stalled request is answered 408 and its connection closed.
    for (i, s) in socks.iter_mut().enumerate() {
        let mut answer = Vec::new();
        tokio::time::timeout(PATIENCE, s.read_to_end(&mut answer))
            .await
            .unwrap_or_else(|_| panic!("connection {i} was not cut"))
            .ok();
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.starts_with("HTTP/1.1 408"),
            "connection {i}: {answer:.200}"
        );
        assert!(answer.contains("body_timeout"), "{answer:.300}");
    }
    drop(socks);
    // The memory comes back (the allocator may keep a little).
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut after = rss_kb(pid);
    while after > before + held_kb / 4 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = rss_kb(pid);
    }
    eprintln!("harness RSS: {before} kB before, {peak} kB while held, {after} kB after the cut");
    assert!(
        peak >= before + held_kb / 2,
        "the bodies were never held: {peak} kB"
    );
    assert!(
        after <= before + held_kb / 4,
        "{after} kB after the cut (before {before} kB, peak {peak} kB)"
    );
    // Still serving.
    let r = reqwest::get(format!("{api}/v1/health")).await.unwrap();
    assert_eq!(r.status(), 200);
    drop(harness);
}

#[test]
fn a_short_api_token_is_refused_at_start() {
    let data = tempfile::tempdir().unwrap();
    for (how, args, env) in [
        ("flag", vec!["--api-token", "apikey"], None),
        ("env", vec![], Some("0123456789abcde")),
    ] {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_bmx"));
        c.args([
            "harness",
            "--listen",
            "127.0.0.1:0",
            "--token",
            "e=short-token-exec-secret",
        ])
        .arg("--data-dir")
        .arg(data.path())
        .args(&args)
        .env_remove("BMX_API_TOKEN")
        .env("RUST_LOG", "error");
        if let Some(t) = env {
            c.env("BMX_API_TOKEN", t);
        }
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{how}: {err}");
        assert!(
            err.contains("--api-token")
                && err.contains("at least 16")
                && err.contains("openssl rand -hex 32"),
            "{how}: {err}"
        );
    }
}

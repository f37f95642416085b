//! Issue 56, item 3: loopback means loopback. A harness without an API
//! token is protected only by listening on loopback; a DNS-rebinding page
//! (its name resolved to 127.0.0.1) reached it all the same: a GET with
//! `Host: evil.example` answered 200 with data, a POST without `Origin`
//! 201. Over real sockets against a real harness: every method, the
//! console's routes and the WebSocket upgrades refuse a `Host` that is not
//! a loopback name (403 `not_loopback`, the API's error shape) and a
//! foreign `Origin` (403 `cross_origin`); loopback names with any port
//! pass; the executors' connect route, which checks its own token, does
//! not look at the `Host` but still refuses a foreign `Origin`; with an
//! API token the `Host` does not matter (platforms behind proxies).

use crate::harness_common;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

const PATIENCE: Duration = Duration::from_secs(30);

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(PATIENCE)
        .build()
        .unwrap()
}

async fn refusal(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let body: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap_or(Value::Null);
    (status, body)
}

/// The status of a GET of `url` with these headers.
async fn get_status(c: &reqwest::Client, url: &str, headers: &[(&str, &str)]) -> u16 {
    let mut r = c.get(url);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    r.send().await.unwrap().status().as_u16()
}

/// The status of a WebSocket upgrade to `path` with these headers (101
/// when it upgraded).
async fn upgrade(addr: std::net::SocketAddr, path: &str, headers: &[(&str, String)]) -> u16 {
    let mut req = format!("ws://{addr}{path}").into_client_request().unwrap();
    for (k, v) in headers {
        let name = http::HeaderName::from_bytes(k.as_bytes()).unwrap();
        req.headers_mut()
            .insert(name, http::HeaderValue::from_str(v).unwrap());
    }
    match tokio::time::timeout(PATIENCE, tokio_tungstenite::connect_async(req))
        .await
        .expect("the upgrade answers")
    {
        Ok(_) => 101,
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => r.status().as_u16(),
        Err(e) => panic!("upgrade {path}: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebound_host_is_refused_on_every_method_and_route() {
    let h = harness_common::harness().await;
    let addr = h.local_addr();
    let port = addr.port();
    let c = http();
    let url = |p: &str| format!("http://{addr}{p}");
    // A session to read, so that a 200 would leak something real.
    let (_fake, sid) = harness_common::fake_with_session(&h).await;

    let evil = format!("evil.example:{port}");
    let requests: Vec<(reqwest::Method, String, Option<Value>)> = vec![
        (reqwest::Method::GET, "/v1/executors".into(), None),
        (reqwest::Method::GET, format!("/v1/sessions/{sid}"), None),
        (reqwest::Method::GET, "/v1/health".into(), None),
        (reqwest::Method::GET, "/metrics".into(), None),
        (
            reqwest::Method::POST,
            "/v1/sessions".into(),
            Some(json!({})),
        ),
        (
            reqwest::Method::POST,
            format!("/v1/sessions/{sid}/tools"),
            Some(json!({"tool": "bash", "input": {"command": "id"}})),
        ),
        (reqwest::Method::DELETE, format!("/v1/sessions/{sid}"), None),
        (
            reqwest::Method::POST,
            "/v1/enrollments".into(),
            Some(json!({"workspace": "/w"})),
        ),
        (reqwest::Method::GET, "/".into(), None),
        (reqwest::Method::GET, "/console/session".into(), None),
    ];
    for (method, path, body) in &requests {
        let mut r = c.request(method.clone(), url(path)).header("host", &evil);
        if let Some(b) = body {
            r = r.body(b.to_string());
        }
        let (status, v) = refusal(r.send().await.unwrap()).await;
        assert_eq!(status, 403, "{method} {path} with Host {evil}: {v}");
        assert_eq!(v["error"]["data"]["reason"], "not_loopback", "{v}");
        assert_eq!(v["error"]["code"], -32003, "{v}");
    }
    // The session is still there: neither the DELETE nor the tool call ran.
    assert_eq!(
        get_status(&c, &url(&format!("/v1/sessions/{sid}")), &[]).await,
        200
    );

    // Loopback names, with or without a port, and the bound address pass.
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        "localhost".to_owned(),
        format!("[::1]:{port}"),
        format!("127.8.9.10:{port}"),
    ] {
        let status = get_status(&c, &url("/v1/executors"), &[("host", &host)]).await;
        assert_eq!(status, 200, "Host {host}");
    }

    // A foreign Origin, even with a loopback Host: refused on a POST and
    // on a GET; the harness's own origin passes.
    let own = format!("http://127.0.0.1:{port}");
    for (method, path) in [
        (reqwest::Method::POST, "/v1/sessions"),
        (reqwest::Method::GET, "/v1/executors"),
    ] {
        let (status, v) = refusal(
            c.request(method.clone(), url(path))
                .header("origin", "http://evil.example")
                .body("{}")
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(status, 403, "{method} {path}: {v}");
        assert_eq!(v["error"]["data"]["reason"], "cross_origin");
    }
    let status = get_status(&c, &url("/v1/executors"), &[("origin", &own)]).await;
    assert_eq!(status, 200);

    // HTTP/1.0 without a Host: not known to be for a loopback name.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /v1/executors HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut answer))
        .await
        .expect("an answer")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.0 403"), "{answer}");
    assert!(answer.contains("not_loopback"), "{answer}");

    // WebSockets: the session's event stream.
    let events = format!("/v1/sessions/{sid}/events/ws");
    assert_eq!(upgrade(addr, &events, &[("host", evil.clone())]).await, 403);
    assert_eq!(
        upgrade(addr, &events, &[("origin", "http://evil.example".into())]).await,
        403
    );
    assert_eq!(
        upgrade(addr, &events, &[("origin", own.clone())]).await,
        101
    );

    // The executors' connect route checks the executor's token, not where
    // it was dialed: a name that is not loopback (a tunnel) still
    // connects with a good token, and gets 401 without one. A page of
    // another origin is refused all the same.
    let auth = ("authorization", "Bearer secret-a".to_owned());
    let proto = ("sec-websocket-protocol", "bmaexecutor.v1.1".to_owned());
    let connect = bmx::wire::transport::CONNECT_PATH;
    assert_eq!(
        upgrade(
            addr,
            connect,
            &[("host", evil.clone()), auth.clone(), proto.clone()]
        )
        .await,
        101
    );
    assert_eq!(
        upgrade(addr, connect, &[("host", evil.clone()), proto.clone()]).await,
        401
    );
    assert_eq!(
        upgrade(
            addr,
            connect,
            &[("origin", "http://evil.example".into()), auth, proto]
        )
        .await,
        403
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_api_token_the_host_does_not_matter() {
    let token = "rebinding-test-api-token-0123";
    let h = bmx::harness::Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .token("exec-a", "secret-a")
        .api_token(Some(token.into()))
        .build()
        .await
        .unwrap();
    let c = http();
    let url = format!("http://{}/v1/executors", h.local_addr());
    let r = c
        .get(&url)
        .header("host", "harness.internal.example")
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "a proxy's Host with the token");
    let r = c
        .get(&url)
        .header("host", "harness.internal.example")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "no token");
    h.shutdown().await;
}

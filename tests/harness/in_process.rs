//! The in-process transport (PROTOCOL.md §1, local transport): an executor
//! in the harness's process dials `HarnessHandle::in_process_endpoint`, as
//! `bmx up`'s does, through the same handshake and frames as a socket.

use bmx::client::ApiClient;
use bmx::executor::{Executor, ExecutorConfig, TokenSource};
use bmx::harness::Harness;
use bmx::wire::transport::{dial, DialError};
use bmx::wire::Subprotocol;
use serde_json::json;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);

async fn harness() -> bmx::harness::HarnessHandle {
    Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .token("exec-local", "tok-local")
        .heartbeat_ms(200)
        .build()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_on_the_in_process_endpoint_serves_sessions() {
    let h = harness().await;
    let work = tempfile::tempdir().unwrap();
    let mut config = ExecutorConfig::new(
        h.in_process_endpoint(),
        TokenSource::Static("tok-local".into()),
    );
    config.work_root = work.path().to_owned();
    let executor = Executor::start(config).await.unwrap();
    assert!(h.wait_for_executor(Some("exec-local"), WAIT).await);
    let client = ApiClient::new(&h.api_url()).unwrap().timeout(WAIT);
    let (status, s) = client.post("/v1/sessions", &json!({})).await.unwrap();
    assert_eq!(status, 201, "{s}");
    let sid = s["sessionId"].as_str().unwrap().to_owned();
    let (status, t) = client
        .post(
            &format!("/v1/sessions/{sid}/tools"),
            &json!({"tool": "bash", "input": {"command": "echo in-process"}, "toolCallId": "t1"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["outcome"], "succeeded", "{t}");
    let text = t["content"][0]["text"].as_str().unwrap();
    assert!(text.contains("in-process"), "{text}");
    executor.shutdown().await;
    h.shutdown().await;
}

#[tokio::test]
async fn a_bad_token_on_the_in_process_endpoint_is_refused_before_the_upgrade() {
    let h = harness().await;
    let r = dial(
        &h.in_process_endpoint(),
        "not-the-token",
        &Subprotocol::ALL,
        1 << 20,
        WAIT,
    )
    .await;
    assert!(matches!(r, Err(DialError::Unauthorized)), "{:?}", r.err());
    // Every dial is a connection of its own: the right token still gets in.
    let ok = dial(
        &h.in_process_endpoint(),
        "tok-local",
        &Subprotocol::ALL,
        1 << 20,
        WAIT,
    )
    .await;
    assert!(ok.is_ok(), "{:?}", ok.err());
    h.shutdown().await;
}

#[tokio::test]
async fn after_shutdown_the_in_process_endpoint_refuses_and_is_not_final() {
    let h = harness().await;
    let endpoint = h.in_process_endpoint();
    h.shutdown().await;
    let r = dial(&endpoint, "tok-local", &Subprotocol::ALL, 1 << 20, WAIT).await;
    match r {
        Err(e @ DialError::Io(_)) => {
            assert!(!e.is_final(), "a harness coming back is worth a retry")
        }
        other => panic!("expected a refused dial, got {:?}", other.err()),
    }
}

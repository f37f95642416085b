//! Embedding the harness in a platform: start it, connect an executor (here
//! one in the same process), create a session, run a process, call a tool,
//! watch events, stop.
//!
//! ```sh
//! cargo run --release --example embed_harness
//! ```

use bmx::executor::{Executor, ExecutorConfig, TokenSource};
use bmx::harness::{process_params, CreateSession, Harness, HarnessEvent, ReadRequest, ToolCall};
use bmx::wire::types::Stream;
use bmx::wire::Endpoint;
use serde_json::json;
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 1. The harness: executors authenticate with a bearer token that the
    //    platform maps to an executor id.
    let harness = Harness::builder()
        .listen("127.0.0.1:0".parse()?)
        .authenticate(|token| (token == "platform-issued-token").then(|| "worker-1".to_string()))
        .heartbeat_ms(1_000)
        .lease_ttl_ms(5_000)
        .build()
        .await?;
    println!("API: {}/v1", harness.api_url());

    // 2. Events: session lifecycle, process status, tool progress and results.
    let mut events = harness.events();
    tokio::spawn(async move {
        while let Ok(e) = events.recv().await {
            match e {
                HarnessEvent::ProcessStatus(p) => {
                    println!("event: process {} is {:?}", p.process_id, p.state)
                }
                HarnessEvent::ToolResult(r) => {
                    println!("event: tool {} {:?}", r.tool_call_id, r.outcome)
                }
                other => println!("event: {other:?}"),
            }
        }
    });

    // 3. An executor (normally on another machine: `bmx executor --url ... --token ...`).
    let work = std::env::temp_dir().join(format!("bmx-embed-{}", std::process::id()));
    let mut config = ExecutorConfig::new(
        Endpoint::parse(&harness.executor_url())?,
        TokenSource::Static("platform-issued-token".into()),
    );
    config.work_root = work.clone();
    let executor = Executor::start(config).await?;
    if !harness
        .wait_for_executor(Some("worker-1"), Duration::from_secs(10))
        .await
    {
        return Err("the executor did not connect".into());
    }

    // 4. A session, a process and its output.
    let session = harness.sessions().create(CreateSession::default()).await?;
    println!(
        "session {} on {:?}",
        session.id(),
        session.info().map(|i| i.executor_id)
    );
    session
        .start_process(process_params(
            "hello",
            vec!["echo".into(), "hello from the executor".into()],
        ))
        .await?;
    let mut cursor = 0;
    loop {
        let r = session
            .read(ReadRequest {
                process_id: "hello".into(),
                stream: Stream::Stdout,
                cursor,
                max_bytes: None,
                wait_ms: Some(5_000),
            })
            .await?;
        print!("{}", String::from_utf8_lossy(r.data.as_slice()));
        cursor = r.next_cursor;
        if r.eof {
            println!("exit code {:?}", r.exit_code);
            break;
        }
    }

    // 5. A tool call: answered with its result, once.
    let result = session
        .call_tool(ToolCall::new("bash", json!({"command": "uname -s"})))
        .await?;
    println!(
        "bash tool said: {:?}",
        result.content.first().and_then(|c| c.text.clone())
    );

    // 6. Stop the session, then everything.
    let ended = session.stop().await?;
    println!("session ended: {:?}", ended.ended_reason);
    executor.shutdown().await;
    harness.shutdown().await;
    let _ = std::fs::remove_dir_all(work);
    Ok(())
}

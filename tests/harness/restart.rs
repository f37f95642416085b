//! Restart without loss (issue 17, docs/store.md): the real `bmx harness`
//! with a temporary data dir and a real `bmx executor`, the harness killed
//! with SIGKILL while a tool call is running and started again on the same
//! port and data dir. The session is known again with its fencing token,
//! the executor resumes it, the result of the call in flight is delivered
//! once, a fresh assign gets a larger fencing token, and nothing is left
//! running. Twice: with the embedded store, and with `--store
//! postgres://…` on a fresh database of the test server (`BMX_TEST_PG`;
//! skipped loudly without it, failed under CI).

use bmx::client::ApiClient;
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BMX: &str = env!("CARGO_BIN_EXE_bmx");
const TOKEN: &str = "restart-secret";
const EXEC: &str = "exec-restart";
/// Every wait has this deadline.
const WAIT: Duration = Duration::from_secs(60);

/// Kills the child if the test fails before it is stopped.
struct Guard(Option<Child>);

impl Guard {
    fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.0.as_ref().unwrap().id() as i32)
    }

    fn signal(&mut self, sig: nix::sys::signal::Signal) -> std::process::ExitStatus {
        nix::sys::signal::kill(self.pid(), sig).unwrap();
        let mut child = self.0.take().unwrap();
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "child did not exit after {sig:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn harness(port: u16, data: &Path, store: Option<&str>) -> Guard {
    let child = Command::new(BMX)
        .args(["harness", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--token", &format!("{EXEC}={TOKEN}")])
        .args(["--heartbeat-ms", "500", "--lease-ttl-ms", "20000"])
        .arg("--data-dir")
        .arg(data)
        .args(store.map(|url| ["--store", url]).into_iter().flatten())
        // A replica restarted keeps its id: it loads its own sessions (a
        // new id would leave them to the takeover, docs/store.md).
        .args(
            store
                .map(|_| ["--replica-id", "restarted"])
                .into_iter()
                .flatten(),
        )
        .env("RUST_LOG", "warn")
        .env_remove("BMX_API_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    Guard(Some(child))
}

fn executor(port: u16, work: &Path) -> Guard {
    let child = Command::new(BMX)
        .args(["executor", "--url"])
        .arg(format!("ws://127.0.0.1:{port}/v1/executor/connect"))
        .args(["--token", TOKEN, "--work-root"])
        .arg(work)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    Guard(Some(child))
}

/// Poll `f` until it returns `Some`, at most [`WAIT`].
async fn until<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn session(client: &ApiClient, id: &str) -> Option<Value> {
    match client.get(&format!("/v1/sessions/{id}")).await {
        Ok((200, v)) => Some(v),
        _ => None,
    }
}

async fn executor_registered(client: &ApiClient) -> Option<()> {
    let (status, v) = client.get("/v1/executors").await.ok()?;
    let found = status == 200
        && v["executors"]
            .as_array()
            .is_some_and(|a| a.iter().any(|e| e["executorId"] == EXEC));
    found.then_some(())
}

/// Processes whose command line contains `needle`.
fn processes_with(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(needle) && !cmd.contains("harness_restart") {
                found.push(cmd);
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_restart_keeps_sessions_results_and_fencing() {
    scenario(None, "2.1717").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_restart_over_postgres_keeps_sessions_results_and_fencing() {
    let Some(db) = super::pg_support::fresh("restart") else {
        return;
    };
    scenario(Some(&db.url), "2.1719").await;
}

/// The whole scenario over `store` (`None`: SQLite in the data dir); the
/// tool call sleeps `sleep` seconds, unique per test so its process is
/// found among those of tests running beside it.
async fn scenario(store: Option<&str>, sleep: &str) {
    let data = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let port = free_port();
    let client = ApiClient::new(&format!("http://127.0.0.1:{port}"))
        .unwrap()
        .timeout(Duration::from_secs(30));

    let mut h = harness(port, data.path(), store);
    until("the harness", || async {
        client.get("/v1/health").await.ok().filter(|r| r.0 == 200)
    })
    .await;
    let mut exec = executor(port, work.path());
    until("the executor", || executor_registered(&client)).await;

    let (status, s1) = client
        .post(
            "/v1/sessions",
            &json!({"sessionId": "s1", "executorId": EXEC}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{s1}");
    let token1 = s1["fencingToken"].as_u64().unwrap();

    // A tool call that appends a line when it starts, then sleeps ~2 s.
    // The unique sleep length finds its process later.
    // In the session's workspace: its sandbox writes nowhere else.
    let runs = work.path().join("sessions/s1/runs");
    let command = format!(
        "echo run >> {}; sleep {sleep}; echo done-sleeping",
        runs.display()
    );
    let call = json!({"tool": "bash", "input": {"command": command}, "toolCallId": "slow-1"});
    let first = {
        let client = ApiClient::new(&format!("http://127.0.0.1:{port}"))
            .unwrap()
            .timeout(Duration::from_secs(30));
        let call = call.clone();
        tokio::spawn(async move { client.post("/v1/sessions/s1/tools", &call).await })
    };
    until("the tool call to start", || async {
        std::fs::read_to_string(&runs)
            .ok()
            .filter(|s| !s.is_empty())
    })
    .await;

    // SIGKILL while the call is in flight.
    let status = h.signal(nix::sys::signal::Signal::SIGKILL);
    assert!(!status.success());
    // Its HTTP caller lost the answer (the connection died with it).
    let lost = first.await.unwrap();
    assert!(
        !matches!(lost, Ok((200, _))),
        "the first call cannot have been answered: {lost:?}"
    );

    // Same port, same data dir.
    let mut h = harness(port, data.path(), store);
    let restored = until("the restarted harness to list s1", || {
        session(&client, "s1")
    })
    .await;
    assert_eq!(
        restored["fencingToken"].as_u64(),
        Some(token1),
        "{restored}"
    );
    assert_eq!(restored["executorId"], EXEC);
    assert_ne!(restored["state"], "ended", "{restored}");
    let (status, list) = client.get("/v1/sessions").await.unwrap();
    assert_eq!(status, 200);
    assert!(
        list["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["sessionId"] == "s1" && s["fencingToken"].as_u64() == Some(token1)),
        "{list}"
    );

    // The executor comes back by itself and resumes s1.
    until("the executor to reconnect", || executor_registered(&client)).await;
    until("s1 to be active again", || async {
        session(&client, "s1")
            .await
            .filter(|s| s["state"] == "active")
    })
    .await;

    // The platform asks again with the same id and gets the one result.
    let (status, r) = client.post("/v1/sessions/s1/tools", &call).await.unwrap();
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["toolCallId"], "slow-1");
    assert_eq!(r["outcome"], "succeeded", "{r}");
    let text = r["content"][0]["text"].as_str().unwrap_or_default();
    assert!(text.contains("done-sleeping"), "{r}");
    // The command ran once, not once per harness.
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "run\n");

    // A fresh assign gets a strictly larger fencing token.
    let (status, s2) = client
        .post(
            "/v1/sessions",
            &json!({"sessionId": "s2", "executorId": EXEC}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{s2}");
    let token2 = s2["fencingToken"].as_u64().unwrap();
    assert!(token2 > token1, "{token2} must exceed {token1}");

    // Killed again once the result was acknowledged: the executor will
    // not send it again, so only the store can answer.
    let status = h.signal(nix::sys::signal::Signal::SIGKILL);
    assert!(!status.success());
    let mut h = harness(port, data.path(), store);
    until("the second restart", || session(&client, "s2")).await;
    let (status, again) = client.post("/v1/sessions/s1/tools", &call).await.unwrap();
    assert_eq!(status, 200, "{again}");
    assert_eq!(again, r, "the stored result is the delivered one");
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "run\n");

    // Nothing orphaned: both sessions resume and stop cleanly, and the
    // tool's process is gone.
    until("the executor to reconnect again", || {
        executor_registered(&client)
    })
    .await;
    for id in ["s1", "s2"] {
        until("the session to be active", || async {
            session(&client, id)
                .await
                .filter(|s| s["state"] == "active")
        })
        .await;
        let (status, ended) = client.delete(&format!("/v1/sessions/{id}")).await.unwrap();
        assert_eq!(status, 200, "{ended}");
        assert_eq!(ended["state"], "ended", "{ended}");
    }
    assert!(processes_with(&format!("sleep {sleep}")).is_empty());
    let (_, list) = client.get("/v1/sessions").await.unwrap();
    for s in list["sessions"].as_array().unwrap() {
        assert_eq!(s["state"], "ended", "{s}");
    }
    let status = exec.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(status.code(), Some(0));
    let status = h.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_restart_keeps_the_event_stream() {
    events_scenario(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_restart_over_postgres_keeps_the_event_stream() {
    let Some(db) = super::pg_support::fresh("restart_events") else {
        return;
    };
    events_scenario(Some(&db.url)).await;
}

/// A scripted executor (a real WebSocket client speaking the protocol)
/// registered with the harness on `port`, resuming `resume` if given.
async fn fake_on(port: u16, resume: Option<(&str, &str)>) -> super::harness_common::Fake {
    use bmx::wire::types::Resume;
    let url =
        bmx::wire::Endpoint::parse(&format!("ws://127.0.0.1:{port}/v1/executor/connect")).unwrap();
    let mut fake = super::harness_common::dial_endpoint(&url, TOKEN)
        .await
        .unwrap();
    fake.register(resume.map(|(last, session)| Resume {
        executor_id: EXEC.into(),
        last_connection_id: last.into(),
        active_sessions: vec![session.into()],
        fencing_tokens: Default::default(),
    }))
    .await
    .unwrap();
    fake.keep_alive();
    fake
}

/// The `state` column of a stored session, read from the store itself.
fn stored_state(data: &Path, store: Option<&str>, session: &str) -> Option<String> {
    const Q: &str = "SELECT state FROM sessions WHERE session_id = ";
    let session = session.to_owned();
    match store {
        None => {
            let c = rusqlite::Connection::open_with_flags(
                data.join("harness.db"),
                rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
            )
            .ok()?;
            c.query_row(&format!("{Q}?1"), [session], |r| r.get(0)).ok()
        }
        Some(url) => {
            let url = url.to_owned();
            // The blocking client refuses a tokio thread: a thread of its own.
            std::thread::spawn(move || {
                let mut c = postgres::Client::connect(&url, postgres::NoTls).ok()?;
                c.query_opt(&format!("{Q}$1"), &[&session])
                    .ok()?
                    .map(|r| r.get(0))
            })
            .join()
            .ok()?
        }
    }
}

fn said(n: u64) -> Value {
    json!({"type": "agent.message", "text": format!("m{n}")})
}

fn acked(r: &Value) -> u64 {
    assert_eq!(r["accepted"], true, "{r}");
    r["ackedSequence"].as_u64().unwrap()
}

/// Session events survive SIGKILL (issue 17): what was acknowledged to the
/// executor is replayed after a restart exactly as before, a client
/// resuming with `Last-Event-ID` gets only what follows, the executor's
/// resend of an acknowledged event is not delivered twice, the sequence
/// goes on, and an ended stream is still served (with its end) after
/// another restart.
async fn events_scenario(store: Option<&str>) {
    use super::harness_common::{send_event, sse_at};
    use bmx::wire::types::{AssignParams, AssignResult};
    use bmx::wire::{Method, Responder};
    let data = tempfile::tempdir().unwrap();
    let port = free_port();
    let api = format!("http://127.0.0.1:{port}");
    let client = ApiClient::new(&api)
        .unwrap()
        .timeout(Duration::from_secs(30));
    let path = "/v1/sessions/ev-1/events";

    let mut h = harness(port, data.path(), store);
    until("the harness", || async {
        client.get("/v1/health").await.ok().filter(|r| r.0 == 200)
    })
    .await;
    let mut fake = fake_on(port, None).await;
    let create = {
        let client = ApiClient::new(&api).unwrap();
        tokio::spawn(async move {
            client
                .post(
                    "/v1/sessions",
                    &json!({"sessionId": "ev-1", "executorId": EXEC}),
                )
                .await
                .unwrap()
        })
    };
    let (p, r): (AssignParams, Responder) = fake.expect(Method::SessionAssign).await;
    r.ok(&AssignResult {
        accepted: true,
        session_id: p.session_id.clone(),
    });
    assert_eq!(create.await.unwrap().0, 201);
    for n in 1..=3 {
        let r = send_event(&fake, "ev-1", "t1", n, said(n)).await.unwrap();
        assert_eq!(acked(&r), n);
    }
    let mut s = sse_at(&api, path, None, None).await;
    let before: Vec<Value> = [s.next().await, s.next().await, s.next().await]
        .into_iter()
        .map(|m| m.data)
        .collect();
    drop(s);

    // SIGKILL, then the same port and data dir; the executor resumes.
    assert!(!h.signal(nix::sys::signal::Signal::SIGKILL).success());
    let last = fake.connection_id.clone();
    drop(fake);
    h = harness(port, data.path(), store);
    until("the restarted harness to list ev-1", || {
        session(&client, "ev-1")
    })
    .await;
    let fake = fake_on(port, Some((&last, "ev-1"))).await;
    until("ev-1 to be active again", || async {
        session(&client, "ev-1")
            .await
            .filter(|s| s["state"] == "active")
    })
    .await;

    // A client that had 1 gets 2 and 3, byte for byte what it would have
    // got before the crash, and nothing more.
    let mut s = sse_at(&api, path, Some(1), None).await;
    assert_eq!(s.status, 200, "{:?}", s.body);
    assert_eq!(s.next().await.data, before[1]);
    assert_eq!(s.next().await.data, before[2]);
    assert!(s.next_within(Duration::from_millis(300)).await.is_none());
    // The executor's resend of 3 is acknowledged, not shown again; a hole
    // is refused with the next sequence; 4 goes on.
    let r = send_event(&fake, "ev-1", "t1", 3, said(3)).await.unwrap();
    assert_eq!(acked(&r), 3);
    let e = send_event(&fake, "ev-1", "t1", 5, said(5))
        .await
        .unwrap_err();
    assert_eq!(
        super::harness_common::rpc_code(&e),
        Some(-32009),
        "a hole: {e}"
    );
    let r = send_event(&fake, "ev-1", "t1", 4, said(4)).await.unwrap();
    assert_eq!(acked(&r), 4);
    let four = s.next().await;
    assert_eq!(four.data["sequence"], 4, "{:?}", four.data);
    assert_eq!(four.data["event"], said(4));
    assert!(s.next_within(Duration::from_millis(300)).await.is_none());
    drop(s);

    // The session ends; after another SIGKILL its stream is still served,
    // all of it, and ends.
    let stop = {
        let client = ApiClient::new(&api).unwrap();
        tokio::spawn(async move { client.delete("/v1/sessions/ev-1").await.unwrap() })
    };
    let mut fake = fake;
    fake.end_as_stopped("ev-1").await;
    assert_eq!(stop.await.unwrap().0, 200);
    // The API answers before the state is written (only a grant waits
    // for the store): wait for the row, so the kill below finds it ended.
    until("ev-1 to be stored as ended", || {
        let ended = stored_state(data.path(), store, "ev-1").as_deref() == Some("ended");
        async move { ended.then_some(()) }
    })
    .await;
    assert!(!h.signal(nix::sys::signal::Signal::SIGKILL).success());
    drop(fake);
    let mut h = harness(port, data.path(), store);
    until("the second restart", || session(&client, "ev-1")).await;
    let mut s = sse_at(&api, path, None, None).await;
    assert_eq!(s.status, 200, "{:?}", s.body);
    for (i, want) in before.iter().enumerate() {
        assert_eq!(&s.next().await.data, want, "event {}", i + 1);
    }
    assert_eq!(s.next().await.data["sequence"], 4);
    let end = s.next().await;
    assert_eq!(end.event.as_deref(), Some("end"), "{:?}", end.data);
    assert!(h.signal(nix::sys::signal::Signal::SIGTERM).success());
}

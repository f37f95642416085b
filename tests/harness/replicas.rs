//! Several live replicas over one PostgreSQL database (issue 17,
//! docs/store.md, "Several replicas"): two real `bmx harness` processes
//! over one fresh database of the test server (`BMX_TEST_PG`; skipped
//! loudly without it, failed under CI), with real `bmx executor`s.
//!
//! * The 4004 rule across replicas: two executors of one id connecting at
//!   once, one to each replica: exactly one survives, the other is closed
//!   with 4004 and exits with the `replaced` status (3); then a newer
//!   connection on the other replica replaces the survivor.
//! * Two replicas granting one session at once: exactly one grant wins
//!   (201), the other answers 409 and its executor never hears of it; the
//!   database row holds the winner's token, and each new grant of the same
//!   session has a strictly larger token.
//! * API calls on any replica: a session created and used through the
//!   replica that does not hold its executor's connection (the calls are
//!   forwarded to the one that does).

use bmx::client::ApiClient;
use serde_json::json;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BMX: &str = env!("CARGO_BIN_EXE_bmx");
/// Every wait has this deadline.
const WAIT: Duration = Duration::from_secs(60);
/// The `bmx executor` exit status after close 4004.
const EXIT_REPLACED: i32 = 3;

/// Kills the child when dropped (a failing test leaves nothing behind).
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// Exit status if it exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.0.try_wait().unwrap()
    }

    fn term(mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(s) = self.exited() {
                return s;
            }
            assert!(Instant::now() < deadline, "no exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
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

fn harness(port: u16, data: &Path, store: &str, id: &str) -> Proc {
    let child = Command::new(BMX)
        .args(["harness", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--token", "ex-a=tok-a", "--token", "ex-b=tok-b"])
        .args(["--token", "ex-same=tok-same"])
        .args(["--heartbeat-ms", "500", "--lease-ttl-ms", "20000"])
        .args(["--replica-id", id])
        .arg("--data-dir")
        .arg(data)
        .env("BMX_STORE", store)
        .env("RUST_LOG", "warn")
        .env_remove("BMX_API_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    Proc(child)
}

fn executor(port: u16, token: &str, work: &Path) -> Proc {
    let child = Command::new(BMX)
        .args(["executor", "--url"])
        .arg(format!("ws://127.0.0.1:{port}/v1/executor/connect"))
        .args(["--token", token, "--work-root"])
        .arg(work)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Proc(child)
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

/// Whether `client`'s harness lists executor `id` as connected.
async fn lists(client: &ApiClient, id: &str) -> bool {
    let Ok((200, v)) = client.get("/v1/executors").await else {
        return false;
    };
    v["executors"]
        .as_array()
        .is_some_and(|a| a.iter().any(|e| e["executorId"] == id))
}

fn client(port: u16) -> ApiClient {
    ApiClient::new(&format!("http://127.0.0.1:{port}"))
        .unwrap()
        .timeout(Duration::from_secs(30))
}

/// Two replicas over `db`, healthy.
async fn two_replicas(db: &str, data: &Path) -> ([Proc; 2], [ApiClient; 2], [u16; 2]) {
    let ports = [free_port(), free_port()];
    let procs = [
        harness(ports[0], &data.join("a"), db, "replica-a"),
        harness(ports[1], &data.join("b"), db, "replica-b"),
    ];
    let clients = [client(ports[0]), client(ports[1])];
    for c in &clients {
        until("a replica to answer", || async {
            c.get("/v1/health").await.ok().filter(|r| r.0 == 200)
        })
        .await;
    }
    (procs, clients, ports)
}

/// `GET /v1/sessions/{id}` answered by the replica on `port` itself: the
/// forwarded marker keeps it from forwarding the call.
async fn local_status(port: u16, session: &str) -> u16 {
    reqwest::Client::new()
        .get(format!("http://127.0.0.1:{port}/v1/sessions/{session}"))
        .header("x-bmx-forwarded-by", "test")
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// The database row of a session: (fencing token, replica).
fn row(db: &str, session: &str) -> Option<(i64, String)> {
    let (db, session) = (db.to_owned(), session.to_owned());
    // The blocking client refuses a tokio thread: a thread of its own.
    std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&db, postgres::NoTls).unwrap();
        c.query_opt(
            "SELECT fencing_token, replica FROM sessions WHERE session_id = $1",
            &[&session],
        )
        .unwrap()
        .map(|r| (r.get(0), r.get(1)))
    })
    .join()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_per_executor_id_across_replicas() {
    let Some(db) = super::pg_support::fresh("replicas_4004") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let (procs, clients, ports) = two_replicas(&db.url, data.path()).await;

    for round in 0..3 {
        let work = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
        // Both at once, one to each replica.
        let mut execs = [
            executor(ports[0], "tok-same", work[0].path()),
            executor(ports[1], "tok-same", work[1].path()),
        ];
        // Exactly one is replaced: it exits with the `replaced` status.
        let loser = until("one executor to be replaced", || {
            let found = execs
                .iter_mut()
                .position(|e| e.exited().is_some())
                .inspect(|&i| {
                    let status = execs[i].exited().unwrap();
                    assert_eq!(
                        status.code(),
                        Some(EXIT_REPLACED),
                        "round {round}: executor {i} exited with {status:?}"
                    );
                });
            async move { found }
        })
        .await;
        let winner = 1 - loser;
        // The winner's replica lists it; the loser's replica no longer does.
        until("the winner listed by its replica", || async {
            lists(&clients[winner], "ex-same").await.then_some(())
        })
        .await;
        until("the loser's replica to forget it", || async {
            (!lists(&clients[loser], "ex-same").await).then_some(())
        })
        .await;
        assert!(
            execs[winner].exited().is_none(),
            "round {round}: both executors were closed"
        );
        // A newer connection on the loser's replica replaces the winner.
        let work2 = tempfile::tempdir().unwrap();
        let newer = executor(ports[loser], "tok-same", work2.path());
        until("the older connection to be replaced", || {
            let s = execs[winner].exited();
            async move { s }
        })
        .await;
        assert_eq!(
            execs[winner].exited().unwrap().code(),
            Some(EXIT_REPLACED),
            "round {round}: the older connection was not closed with 4004"
        );
        until("the newer connection listed", || async {
            lists(&clients[loser], "ex-same").await.then_some(())
        })
        .await;
        until("the winner's replica to forget it", || async {
            (!lists(&clients[winner], "ex-same").await).then_some(())
        })
        .await;
        assert_eq!(newer.term().code(), Some(0));
        until("the executor gone", || async {
            (!lists(&clients[loser], "ex-same").await).then_some(())
        })
        .await;
    }
    for p in procs {
        assert!(p.term().success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_grant_per_session_across_replicas() {
    let Some(db) = super::pg_support::fresh("replicas_grant") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let (procs, clients, ports) = two_replicas(&db.url, data.path()).await;
    let work = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let execs = [
        executor(ports[0], "tok-a", work[0].path()),
        executor(ports[1], "tok-b", work[1].path()),
    ];
    let exec_ids = ["ex-a", "ex-b"];
    for (c, id) in clients.iter().zip(exec_ids) {
        until("the executor to register", || async {
            lists(c, id).await.then_some(())
        })
        .await;
    }

    for n in 0..5 {
        let session = format!("race-{n}");
        let mut last_token: Option<i64> = None;
        for round in 0..3 {
            // Both replicas grant the same session at once.
            let body = |i: usize| json!({"sessionId": session, "executorId": exec_ids[i]});
            let (b0, b1) = (body(0), body(1));
            let (ra, rb) = tokio::join!(
                clients[0].post("/v1/sessions", &b0),
                clients[1].post("/v1/sessions", &b1),
            );
            let answers = [ra.unwrap(), rb.unwrap()];
            let won: Vec<usize> = (0..2).filter(|&i| answers[i].0 == 201).collect();
            assert_eq!(
                won.len(),
                1,
                "{session} round {round}: exactly one grant wins: {answers:?}"
            );
            let (w, l) = (won[0], 1 - won[0]);
            assert_eq!(answers[l].0, 409, "{session}: {answers:?}");
            let token = answers[w].1["fencingToken"].as_i64().unwrap();
            // The database holds the winner's grant, nobody else's.
            let (row_token, replica) = row(&db.url, &session).expect("the session's row");
            assert_eq!(row_token, token, "{session} round {round}");
            assert_eq!(replica, ["replica-a", "replica-b"][w]);
            if let Some(t) = last_token {
                assert!(token > t, "{session}: token {token} after {t}");
            }
            last_token = Some(token);
            // The loser published nothing: its executor never heard
            // (asked as a forwarded call, so the loser answers itself).
            assert_eq!(
                local_status(ports[l], &session).await,
                404,
                "{session}: the loser kept a session"
            );
            let (status, v) = clients[w]
                .get(&format!("/v1/sessions/{session}"))
                .await
                .unwrap();
            assert_eq!(status, 200);
            assert_eq!(v["state"], "active", "{v}");
            // Ended, so the next round grants it anew.
            let (status, ended) = clients[w]
                .delete(&format!("/v1/sessions/{session}"))
                .await
                .unwrap();
            assert_eq!(status, 200, "{ended}");
            assert_eq!(ended["state"], "ended");
        }
    }
    for e in execs {
        assert_eq!(e.term().code(), Some(0));
    }
    for p in procs {
        assert!(p.term().success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_on_any_replica_reach_the_sessions_executor() {
    let Some(db) = super::pg_support::fresh("replicas_forward") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let (procs, clients, ports) = two_replicas(&db.url, data.path()).await;
    let work = tempfile::tempdir().unwrap();
    // The executor is connected to replica B only.
    let exec = executor(ports[1], "tok-b", work.path());
    until("the executor on B", || async {
        lists(&clients[1], "ex-b").await.then_some(())
    })
    .await;
    assert!(!lists(&clients[0], "ex-b").await);

    // Everything through replica A.
    let a = &clients[0];
    let (status, s) = a
        .post(
            "/v1/sessions",
            &json!({"sessionId": "fwd-1", "executorId": "ex-b"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{s}");
    assert_eq!(s["executorId"], "ex-b");
    let (status, r) = a
        .post(
            "/v1/sessions/fwd-1/tools",
            &json!({"tool": "bash", "input": {"command": "echo ran-on-$((40+2))"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["outcome"], "succeeded", "{r}");
    let text = r["content"][0]["text"].as_str().unwrap_or_default();
    assert!(text.contains("ran-on-42"), "{r}");
    let (status, v) = a.get("/v1/sessions/fwd-1").await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "active", "{v}");
    // A holds nothing of it itself; B does.
    assert_eq!(local_status(ports[0], "fwd-1").await, 404);
    assert_eq!(local_status(ports[1], "fwd-1").await, 200);
    let (status, ended) = a.delete("/v1/sessions/fwd-1").await.unwrap();
    assert_eq!(status, 200, "{ended}");
    assert_eq!(ended["state"], "ended", "{ended}");
    // A session nobody holds is still A's own 404.
    let (status, _) = a.get("/v1/sessions/nobody").await.unwrap();
    assert_eq!(status, 404);

    assert_eq!(exec.term().code(), Some(0));
    for p in procs {
        assert!(p.term().success());
    }
}

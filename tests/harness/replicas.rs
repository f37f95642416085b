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
//! * Takeover: a replica killed with SIGKILL; its executor reconnects to
//!   the other (through a TCP forwarder: `bmx executor` dials one URL),
//!   which takes its session over with a larger fencing token: the
//!   session's process runs on with no byte of its output lost, a tool
//!   call in flight at the kill is answered once, and calls work there.
//!   A session whose lease ran out (by the database's clock) before its
//!   executor came back is not taken over: the executor is told to stop it.
//! * Listings: each replica lists every replica's sessions (from the
//!   database), one page at a time by id.
//! * Executor listings: each replica lists every live replica's executors
//!   with the replica holding each (the others' from the database), and
//!   stops listing one whose connection ended.
//! * Streams on any replica: a terminal of B's executor opened and
//!   attached through A (typed into, read, closed with the program's exit
//!   code); A's session's event stream through B, as a WebSocket and as
//!   Server-Sent Events, live; an offer of a subprotocol the route does
//!   not speak refused (400); then A unreachable: 502 before an upgrade.
//! * The sweep: a dead replica's session whose executor never comes back
//!   is ended by a live replica (`lease_expired`, the same grant), not
//!   before its lease ran out by the database's clock, and reads so on
//!   the live replica.

use bmx::client::ApiClient;
use serde_json::json;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BMX: &str = env!("CARGO_BIN_EXE_bmx");
/// Every wait has this deadline.
pub(super) const WAIT: Duration = Duration::from_secs(60);
/// The `bmx executor` exit status after close 4004.
const EXIT_REPLACED: i32 = 3;

/// Kills the child when dropped (a failing test leaves nothing behind).
pub(super) struct Proc(pub(super) Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// Exit status if it exited.
    pub(super) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.0.try_wait().unwrap()
    }

    pub(super) fn term(mut self) -> std::process::ExitStatus {
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

pub(super) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn harness(port: u16, data: &Path, store: &str, id: &str) -> Proc {
    harness_ttl(port, data, store, id, 20_000)
}

pub(super) fn harness_ttl(port: u16, data: &Path, store: &str, id: &str, ttl_ms: u64) -> Proc {
    let child = Command::new(BMX)
        .args(["harness", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--token", "ex-a=tok-a", "--token", "ex-b=tok-b"])
        .args(["--token", "ex-same=tok-same"])
        .args([
            "--heartbeat-ms",
            "500",
            "--lease-ttl-ms",
            &ttl_ms.to_string(),
        ])
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

pub(super) fn executor(port: u16, token: &str, work: &Path) -> Proc {
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
pub(super) async fn until<T, F, Fut>(what: &str, mut f: F) -> T
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

/// Whether the replica on `port` holds executor `id`'s connection
/// itself: asked with the forwarded marker, a replica lists only its own
/// (without it, every live replica's).
pub(super) async fn holds(port: u16, id: &str) -> bool {
    let Ok(r) = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{port}/v1/executors"))
        .header("x-bmx-forwarded-by", "test")
        .timeout(Duration::from_secs(30))
        .send()
        .await
    else {
        return false;
    };
    let Ok(body) = r.bytes().await else {
        return false;
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return false;
    };
    v["executors"]
        .as_array()
        .is_some_and(|a| a.iter().any(|e| e["executorId"] == id))
}

pub(super) fn client(port: u16) -> ApiClient {
    ApiClient::new(&format!("http://127.0.0.1:{port}"))
        .unwrap()
        .timeout(Duration::from_secs(30))
}

/// Two replicas over `db`, healthy.
/// One executor on each replica (`ex-a` on the first, `ex-b` on the
/// second), registered: their workspaces (kept while the test runs), the
/// processes and the ids.
async fn one_executor_each(
    ports: [u16; 2],
) -> ([tempfile::TempDir; 2], [Proc; 2], [&'static str; 2]) {
    let work = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let execs = [
        executor(ports[0], "tok-a", work[0].path()),
        executor(ports[1], "tok-b", work[1].path()),
    ];
    let exec_ids = ["ex-a", "ex-b"];
    for (&port, id) in ports.iter().zip(exec_ids) {
        until("the executor to register", || async {
            holds(port, id).await.then_some(())
        })
        .await;
    }
    (work, execs, exec_ids)
}

/// One real executor (`ex-b`) connected to replica B only, once B holds
/// it; its workspace lives as long as the returned dir.
async fn executor_on_b(ports: [u16; 2]) -> (tempfile::TempDir, Proc) {
    let work = tempfile::tempdir().unwrap();
    let exec = executor(ports[1], "tok-b", work.path());
    until("the executor on B", || async {
        holds(ports[1], "ex-b").await.then_some(())
    })
    .await;
    (work, exec)
}

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
pub(super) fn row(db: &str, session: &str) -> Option<(i64, String)> {
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
            holds(ports[winner], "ex-same").await.then_some(())
        })
        .await;
        until("the loser's replica to forget it", || async {
            (!holds(ports[loser], "ex-same").await).then_some(())
        })
        .await;
        // Both list it once, as the winner's.
        let want = pairs(&[("ex-same", ["replica-a", "replica-b"][winner])]);
        for c in &clients {
            until("the executor listed as the winner's", || async {
                let (_, v) = c.get("/v1/executors").await.ok()?;
                (held_by(&v) == want).then_some(())
            })
            .await;
        }
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
            holds(ports[loser], "ex-same").await.then_some(())
        })
        .await;
        until("the winner's replica to forget it", || async {
            (!holds(ports[winner], "ex-same").await).then_some(())
        })
        .await;
        assert_eq!(newer.term().code(), Some(0));
        until("the executor gone", || async {
            (!holds(ports[loser], "ex-same").await).then_some(())
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
    let (_work, execs, exec_ids) = one_executor_each(ports).await;

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
    // The executor is connected to replica B only.
    let (_work, exec) = executor_on_b(ports).await;
    assert!(!holds(ports[0], "ex-b").await);

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

/// A TCP forwarder on 127.0.0.1: every connection it accepts goes to the
/// port `target` names at that moment (the executor dials one URL; the
/// test moves it from one replica to the other).
struct Forwarder {
    port: u16,
    target: std::sync::Arc<std::sync::atomic::AtomicU16>,
    task: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    async fn start(to: u16) -> Forwarder {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = std::sync::Arc::new(std::sync::atomic::AtomicU16::new(to));
        let t = target.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                let to = t.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    if let Ok(mut up) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
            }
        });
        Forwarder { port, target, task }
    }

    fn point_to(&self, port: u16) {
        self.target.store(port, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A session's row: (fencing token, replica, state, ended reason).
pub(super) fn full_row(db: &str, session: &str) -> Option<(i64, String, String, Option<String>)> {
    let (db, session) = (db.to_owned(), session.to_owned());
    std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&db, postgres::NoTls).unwrap();
        c.query_opt(
            "SELECT fencing_token, replica, state, ended_reason FROM sessions WHERE session_id = $1",
            &[&session],
        )
        .unwrap()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    })
    .join()
    .unwrap()
}

/// Whether, by the database's clock, `ms` have passed since `replica`
/// was last seen.
fn unseen_for(db: &str, replica: &str, ms: i64) -> bool {
    let (db, replica) = (db.to_owned(), replica.to_owned());
    std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&db, postgres::NoTls).unwrap();
        c.query_one(
            "SELECT now() >= seen_at + $2::BIGINT * interval '1 millisecond' \
             FROM replicas WHERE id = $1",
            &[&replica, &ms],
        )
        .unwrap()
        .get(0)
    })
    .join()
    .unwrap()
}

/// Whether `replica` has its liveness row (its listener polled once).
fn seen(db: &str, replica: &str) -> bool {
    let (db, replica) = (db.to_owned(), replica.to_owned());
    std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&db, postgres::NoTls).unwrap();
        c.query_opt("SELECT 1 FROM replicas WHERE id = $1", &[&replica])
            .unwrap()
            .is_some()
    })
    .join()
    .unwrap()
}

/// Stdout of process `pid` of `session` from byte 0, through `client`:
/// (bytes, gap seen, state).
pub(super) async fn output(
    client: &ApiClient,
    session: &str,
    pid: &str,
) -> (Vec<u8>, bool, String) {
    let (status, r) = client
        .get(&format!(
            "/v1/sessions/{session}/processes/{pid}/output?cursor=0&maxBytes=1048576"
        ))
        .await
        .unwrap();
    assert_eq!(status, 200, "{r}");
    let data = bmx::wire::blob::base64_decode(r["data"].as_str().unwrap()).unwrap();
    let gap = r["gap"].as_bool().unwrap_or(true) || r["fromCursor"] != 0;
    (
        data,
        gap,
        r["state"].as_str().unwrap_or_default().to_owned(),
    )
}

/// The numbers a counting process printed, checked to be 1, 2, 3, ...
/// with none missing (a last line cut short is left out).
pub(super) fn counted(data: &[u8]) -> u64 {
    let text = String::from_utf8_lossy(data);
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    let mut n = 0u64;
    for line in complete.lines() {
        let v: u64 = line.parse().unwrap_or_else(|_| panic!("bad line {line:?}"));
        assert_eq!(v, n + 1, "line {v} after {n}: bytes were lost");
        n = v;
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replicas_sessions_are_taken_over() {
    let Some(db) = super::pg_support::fresh("replicas_takeover") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let (procs, clients, ports) = two_replicas(&db.url, data.path()).await;
    let [mut a_proc, b_proc] = procs;
    let [a, b] = clients;
    let fwd = Forwarder::start(ports[0]).await;
    let work = tempfile::tempdir().unwrap();
    let mut exec = executor(fwd.port, "tok-a", work.path());
    until("the executor on A", || async {
        holds(ports[0], "ex-a").await.then_some(())
    })
    .await;

    let (status, s) = a
        .post(
            "/v1/sessions",
            &json!({"sessionId": "take-1", "executorId": "ex-a"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{s}");
    let token1 = s["fencingToken"].as_i64().unwrap();
    assert_eq!(row(&db.url, "take-1"), Some((token1, "replica-a".into())));
    // A process counting, one line every 20 ms, for as long as it lives.
    let (status, p) = a
        .post(
            "/v1/sessions/take-1/processes",
            &json!({"processId": "count", "argv": ["sh", "-c",
                "i=0; while :; do i=$((i+1)); echo $i; sleep 0.02; done"]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{p}");
    assert_eq!(p["state"], "running", "{p}");
    // A tool call finished before the kill, and one in flight at it.
    // In the session's workspace: its sandbox writes nowhere else.
    let runs = work.path().join("sessions/take-1/runs");
    let done_call = json!({"tool": "bash", "toolCallId": "t-done",
        "input": {"command": "echo done-before-$((40+2))"}});
    let (status, done_before) = a
        .post("/v1/sessions/take-1/tools", &done_call)
        .await
        .unwrap();
    assert_eq!(status, 200, "{done_before}");
    let flight = json!({"tool": "bash", "toolCallId": "t-flight", "input": {"command":
        format!("echo run >> {}; sleep 2; echo in-flight-done", runs.display())}});
    let lost = {
        let (a2, flight) = (client(ports[0]), flight.clone());
        tokio::spawn(async move { a2.post("/v1/sessions/take-1/tools", &flight).await })
    };
    until("the tool call to start", || async {
        std::fs::read_to_string(&runs)
            .ok()
            .filter(|s| !s.is_empty())
    })
    .await;
    let (before, gap, _) = output(&a, "take-1", "count").await;
    assert!(!gap);
    let counted_before = counted(&before);
    assert!(counted_before > 0);

    // SIGKILL A; the executor's next dial reaches B.
    a_proc.0.kill().unwrap();
    a_proc.0.wait().unwrap();
    fwd.point_to(ports[1]);
    let lost = lost.await.unwrap();
    assert!(
        !matches!(lost, Ok((200, _))),
        "answered by a dead replica: {lost:?}"
    );

    until("the executor on B", || async {
        holds(ports[1], "ex-a").await.then_some(())
    })
    .await;
    let taken = until("B to hold the session", || async {
        let (status, v) = b.get("/v1/sessions/take-1").await.ok()?;
        (status == 200 && v["state"] == "active").then_some(v)
    })
    .await;
    let token2 = taken["fencingToken"].as_i64().unwrap();
    assert!(token2 > token1, "token {token2} after {token1}");
    assert_eq!(taken["executorId"], "ex-a");
    // The database decided: the row is B's grant.
    assert_eq!(row(&db.url, "take-1"), Some((token2, "replica-b".into())));
    assert!(exec.exited().is_none(), "the executor stopped");

    // The process ran on: its output through B from byte 0 is the output
    // A showed, continued, with no number missing; and it still grows.
    let (after, gap, state) = output(&b, "take-1", "count").await;
    assert!(!gap, "bytes were dropped");
    assert_eq!(state, "running");
    assert_eq!(&after[..before.len()], &before[..], "the output changed");
    let counted_after = counted(&after);
    until("the process to go on counting", || async {
        let (more, _, _) = output(&b, "take-1", "count").await;
        (counted(&more) > counted_after).then_some(())
    })
    .await;

    // The call in flight at the kill: asked again on B, answered with the
    // one result; its command ran once.
    let (status, r) = b.post("/v1/sessions/take-1/tools", &flight).await.unwrap();
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["toolCallId"], "t-flight");
    assert_eq!(r["outcome"], "succeeded", "{r}");
    let text = r["content"][0]["text"].as_str().unwrap_or_default();
    assert!(text.contains("in-flight-done"), "{r}");
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "run\n");
    // The call finished before the kill: the same result.
    let (status, again) = b
        .post("/v1/sessions/take-1/tools", &done_call)
        .await
        .unwrap();
    assert_eq!(status, 200, "{again}");
    assert_eq!(again, done_before);
    // A new call on B.
    let (status, r) = b
        .post(
            "/v1/sessions/take-1/tools",
            &json!({"tool": "bash", "input": {"command": "echo on-b-$((6*7))"}}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{r}");
    assert!(
        r["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .contains("on-b-42"),
        "{r}"
    );

    // A comes back (same id, as a restarted replica does): the session is
    // B's now, so A does not load it, and calls about it on A reach B.
    let a_again = harness(ports[0], &data.path().join("a"), &db.url, "replica-a");
    until("A to answer again", || async {
        a.get("/v1/health").await.ok().filter(|r| r.0 == 200)
    })
    .await;
    assert_eq!(local_status(ports[0], "take-1").await, 404);
    let (status, v) = a.get("/v1/sessions/take-1").await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["fencingToken"].as_i64(), Some(token2), "{v}");
    let (status, ended) = a.delete("/v1/sessions/take-1").await.unwrap();
    assert_eq!(status, 200, "{ended}");
    assert_eq!(ended["state"], "ended", "{ended}");
    assert_eq!(
        full_row(&db.url, "take-1").map(|r| (r.1, r.2)),
        Some(("replica-b".into(), "ended".into()))
    );
    // The process ended with the session (no orphan).
    let pid = p["pid"].as_u64().unwrap();
    until("the process to be gone", || async {
        (!Path::new(&format!("/proc/{pid}")).exists()).then_some(())
    })
    .await;
    assert_eq!(exec.term().code(), Some(0));
    assert!(b_proc.term().success());
    assert!(a_again.term().success());
}

/// Replicas A and B with lease TTL `ttl_ms` over `db`, and a scripted
/// executor (a real WebSocket client, `ex-b`) on A that accepted session
/// `session`: the executor, its connection id and the session as created.
struct OnA {
    a: Proc,
    b: Proc,
    ports: [u16; 2],
    fake: super::harness_common::Fake,
    connection: String,
    session: serde_json::Value,
}

fn ws_url(port: u16) -> bmx::wire::Endpoint {
    bmx::wire::Endpoint::parse(&format!("ws://127.0.0.1:{port}/v1/executor/connect")).unwrap()
}

async fn a_session_on_a(db: &str, data: &Path, session: &str, ttl_ms: u64) -> OnA {
    use super::harness_common::dial_endpoint;
    use bmx::wire::types::{AssignParams, AssignResult};
    use bmx::wire::{Method, Responder};
    let ports = [free_port(), free_port()];
    let a = harness_ttl(ports[0], &data.join("a"), db, "replica-a", ttl_ms);
    let b = harness_ttl(ports[1], &data.join("b"), db, "replica-b", ttl_ms);
    for p in ports {
        let c = client(p);
        until("a replica to answer", || async {
            c.get("/v1/health").await.ok().filter(|r| r.0 == 200)
        })
        .await;
    }
    // Both live by the database (their listeners polled once, which a
    // busy machine may delay past the first API calls): a replica that
    // dies below was seen alive first.
    for id in ["replica-a", "replica-b"] {
        until("the replica's liveness row", || {
            let live = seen(db, id);
            async move { live.then_some(()) }
        })
        .await;
    }
    let mut fake = dial_endpoint(&ws_url(ports[0]), "tok-b").await.unwrap();
    fake.register(None).await.unwrap();
    fake.keep_alive();
    let create = {
        let (a, body) = (
            client(ports[0]),
            json!({"sessionId": session, "executorId": "ex-b"}),
        );
        tokio::spawn(async move { a.post("/v1/sessions", &body).await.unwrap() })
    };
    let (p, r): (AssignParams, Responder) = fake.expect(Method::SessionAssign).await;
    r.ok(&AssignResult {
        accepted: true,
        session_id: p.session_id.clone(),
    });
    let (status, s) = create.await.unwrap();
    assert_eq!(status, 201, "{s}");
    let connection = fake.connection_id.clone();
    OnA {
        a,
        b,
        ports,
        fake,
        connection,
        session: s,
    }
}

/// A scripted executor `ex-b` registering on `port` with `resume` listing
/// `session`: it must be told `session.stop {reason: "lease_expired"}`.
async fn resume_is_stopped(port: u16, last_connection: String, session: &str) {
    use super::harness_common::dial_endpoint;
    use bmx::wire::types::{Resume, StopParams, StopResult};
    use bmx::wire::{Method, Responder};
    let mut fake = dial_endpoint(&ws_url(port), "tok-b").await.unwrap();
    fake.register(Some(Resume {
        executor_id: "ex-b".into(),
        last_connection_id: last_connection,
        active_sessions: vec![session.into()],
        fencing_tokens: Default::default(),
    }))
    .await
    .unwrap();
    let (stop, r): (StopParams, Responder) = fake.expect(Method::SessionStop).await;
    assert_eq!(stop.session_id, session);
    assert_eq!(stop.reason, "lease_expired");
    r.ok(&StopResult { stopped: true });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_lease_ran_out_is_not_taken_over() {
    const TTL_MS: u64 = 2_000;
    let Some(db) = super::pg_support::fresh("replicas_expired") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let OnA {
        mut a,
        b,
        ports,
        fake,
        connection,
        session: s,
    } = a_session_on_a(&db.url, data.path(), "exp-1", TTL_MS).await;

    // A dies; the executor stays away until, by the database's clock, the
    // lease cannot be current any more (A last seen + poll + TTL).
    a.0.kill().unwrap();
    a.0.wait().unwrap();
    drop(fake);
    until("the lease to run out by the database's clock", || async {
        unseen_for(&db.url, "replica-a", (TTL_MS + 500) as i64).then_some(())
    })
    .await;

    // It resumes on B: told to stop the session, which B does not take
    // (whether B's sweep ended it first or the takeover rule does now).
    resume_is_stopped(ports[1], connection, "exp-1").await;
    let (token, replica, state, reason) = full_row(&db.url, "exp-1").unwrap();
    assert_eq!(
        token,
        s["fencingToken"].as_i64().unwrap(),
        "a new grant was made"
    );
    assert_eq!(replica, "replica-a");
    assert_eq!(state, "ended");
    assert_eq!(reason.as_deref(), Some("lease_expired"));
    assert_eq!(local_status(ports[1], "exp-1").await, 404);
    assert!(b.term().success());
}

/// The database's verdict on an ended row of `session` granted by
/// `replica`: whether it was ended no earlier than `ms` after that
/// replica was last seen, both by the database's clock.
fn ended_after_unseen_for(db: &str, session: &str, replica: &str, ms: i64) -> bool {
    let (db, session, replica) = (db.to_owned(), session.to_owned(), replica.to_owned());
    std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&db, postgres::NoTls).unwrap();
        c.query_one(
            "SELECT s.written_at >= r.seen_at + $3::BIGINT * interval '1 millisecond' \
             FROM sessions s JOIN replicas r ON r.id = $2 WHERE s.session_id = $1",
            &[&session, &replica, &ms],
        )
        .unwrap()
        .get(0)
    })
    .join()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replicas_session_whose_executor_never_returns_is_ended() {
    const TTL_MS: u64 = 2_000;
    let Some(db) = super::pg_support::fresh("replicas_sweep") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let OnA {
        mut a,
        b: b_proc,
        ports,
        fake,
        connection,
        session: s,
    } = a_session_on_a(&db.url, data.path(), "orphan-1", TTL_MS).await;
    let token = s["fencingToken"].as_i64().unwrap();
    let b = client(ports[1]);
    // While A lives, B answers with A's session, not ended (forwarded to
    // A, or, if A's liveness row lags under load, its row: `assigning`
    // until A's writer stored the acceptance).
    let (status, v) = b.get("/v1/sessions/orphan-1").await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert!(
        ["active", "assigning"].contains(&v["state"].as_str().unwrap_or_default()),
        "{v}"
    );

    // SIGKILL A; the executor never comes back (until the very end).
    a.0.kill().unwrap();
    a.0.wait().unwrap();
    drop(fake);
    let ended = until("B to end the dead replica's session", || async {
        let (status, v) = b.get("/v1/sessions/orphan-1").await.ok()?;
        (status == 200 && v["state"] == "ended").then_some(v)
    })
    .await;
    assert_eq!(ended["endedReason"], "lease_expired", "{ended}");
    assert_eq!(ended["fencingToken"].as_i64(), Some(token), "{ended}");
    // The database's row: the same grant (no new one), ended, and not
    // before A's lease could have run out by the database's clock (A last
    // seen + one poll + the TTL; the harness polls every 500 ms).
    let (row_token, replica, state, reason) = full_row(&db.url, "orphan-1").unwrap();
    assert_eq!(row_token, token);
    assert_eq!(replica, "replica-a");
    assert_eq!(state, "ended");
    assert_eq!(reason.as_deref(), Some("lease_expired"));
    assert!(
        ended_after_unseen_for(&db.url, "orphan-1", "replica-a", (TTL_MS + 500) as i64),
        "ended before the lease ran out"
    );

    // The executor comes back after all, to B, resuming the session: it
    // is told to stop it.
    resume_is_stopped(ports[1], connection, "orphan-1").await;
    assert_eq!(
        full_row(&db.url, "orphan-1").map(|r| (r.0, r.2)),
        Some((token, "ended".into()))
    );
    assert!(b_proc.term().success());
}

/// The session ids of a `GET /v1/sessions` answer, in order.
fn listed(v: &serde_json::Value) -> Vec<String> {
    v["sessions"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s["sessionId"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_lists_every_replicas_sessions() {
    let Some(db) = super::pg_support::fresh("replicas_list") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let (procs, clients, ports) = two_replicas(&db.url, data.path()).await;
    let (_work, execs, exec_ids) = one_executor_each(ports).await;
    // Two sessions through A (on its executor), one through B.
    for (i, session) in [(0, "list-a-1"), (0, "list-a-2"), (1, "list-b-1")] {
        let (status, s) = clients[i]
            .post(
                "/v1/sessions",
                &json!({"sessionId": session, "executorId": exec_ids[i]}),
            )
            .await
            .unwrap();
        assert_eq!(status, 201, "{s}");
    }
    let want = ["list-a-1", "list-a-2", "list-b-1"];
    // Each replica lists all three at once (a grant is its row before
    // the 201); the other replica's show `active` once that replica's
    // writer stored the executor's acceptance (the row lags it).
    for c in &clients {
        let (status, v) = c.get("/v1/sessions").await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(listed(&v), want, "{v}");
        assert!(v.get("next").is_none(), "{v}");
        until("every session listed active", || async {
            let (_, v) = c.get("/v1/sessions").await.ok()?;
            let all = v["sessions"].as_array()?;
            (all.len() == 3 && all.iter().all(|s| s["state"] == "active")).then_some(())
        })
        .await;
    }
    // One page at a time through B: each session once, in order.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..10 {
        let path = match &after {
            None => "/v1/sessions?limit=1".to_owned(),
            Some(a) => format!("/v1/sessions?limit=1&after={a}"),
        };
        let (status, v) = clients[1].get(&path).await.unwrap();
        assert_eq!(status, 200, "{v}");
        let page = listed(&v);
        assert!(page.len() <= 1, "{v}");
        seen.extend(page);
        match v["next"].as_str() {
            Some(n) => after = Some(n.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, want);
    for bad in ["0", "1001", "x"] {
        let (status, v) = clients[1]
            .get(&format!("/v1/sessions?limit={bad}"))
            .await
            .unwrap();
        assert_eq!(status, 400, "limit={bad}: {v}");
    }
    // Ended on A (asked through B, forwarded): B lists it ended.
    let (status, ended) = clients[1].delete("/v1/sessions/list-a-1").await.unwrap();
    assert_eq!(status, 200, "{ended}");
    until("B to list the session ended", || async {
        let (_, v) = clients[1].get("/v1/sessions").await.ok()?;
        v["sessions"]
            .as_array()?
            .iter()
            .any(|s| s["sessionId"] == "list-a-1" && s["state"] == "ended")
            .then_some(())
    })
    .await;
    for e in execs {
        assert_eq!(e.term().code(), Some(0));
    }
    for p in procs {
        assert!(p.term().success());
    }
}

/// `(executorId, replica)` of each entry of a `GET /v1/executors` answer.
fn held_by(v: &serde_json::Value) -> Vec<(String, String)> {
    v["executors"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    let s = |k: &str| e[k].as_str().unwrap_or_default().to_owned();
                    (s("executorId"), s("replica"))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn pairs(want: &[(&str, &str)]) -> Vec<(String, String)> {
    want.iter()
        .map(|(e, r)| ((*e).to_owned(), (*r).to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_lists_every_replicas_executors() {
    let Some(db) = super::pg_support::fresh("replicas_executors") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let (procs, clients, ports) = two_replicas(&db.url, data.path()).await;
    let (_work, [exec_a, exec_b], _) = one_executor_each(ports).await;
    let both = pairs(&[("ex-a", "replica-a"), ("ex-b", "replica-b")]);
    for c in &clients {
        let v = until("both executors listed with their replicas", || async {
            let (status, v) = c.get("/v1/executors").await.ok()?;
            (status == 200 && held_by(&v) == both).then_some(v)
        })
        .await;
        for e in v["executors"].as_array().unwrap() {
            assert!(
                e["connectionId"].as_str().is_some_and(|c| !c.is_empty()),
                "{e}"
            );
            assert!(
                e["connectedAt"].as_str().is_some_and(|t| t.ends_with('Z')),
                "{e}"
            );
            assert_eq!(e["state"], "ready", "{e}");
        }
    }
    // A session on ex-b, created through B: A lists it among ex-b's
    // sessions (the database's rows), B as it holds it.
    let (status, s) = clients[1]
        .post(
            "/v1/sessions",
            &json!({"sessionId": "exs-1", "executorId": "ex-b"}),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{s}");
    for c in &clients {
        until("ex-b listed with its session", || async {
            let (_, v) = c.get("/v1/executors").await.ok()?;
            v["executors"]
                .as_array()?
                .iter()
                .any(|e| e["executorId"] == "ex-b" && e["activeSessions"] == json!(["exs-1"]))
                .then_some(())
        })
        .await;
    }
    let (status, ended) = clients[0].delete("/v1/sessions/exs-1").await.unwrap();
    assert_eq!(status, 200, "{ended}");
    // ex-b's executor leaves B: neither replica lists it any more.
    assert_eq!(exec_b.term().code(), Some(0));
    let only_a = pairs(&[("ex-a", "replica-a")]);
    for c in &clients {
        until("ex-b no longer listed", || async {
            let (status, v) = c.get("/v1/executors").await.ok()?;
            (status == 200 && held_by(&v) == only_a).then_some(())
        })
        .await;
    }
    assert_eq!(exec_a.term().code(), Some(0));
    for p in procs {
        assert!(p.term().success());
    }
}

/// What a terminal viewer received so far.
#[derive(Default)]
struct Seen {
    out: Vec<u8>,
    notices: Vec<serde_json::Value>,
    close: Option<(u16, String)>,
}

/// Read the viewer's socket into `seen` until `done` holds, at most [`WAIT`].
async fn read_until(
    ws: &mut bmx::client::TerminalSocket,
    seen: &mut Seen,
    what: &str,
    done: impl Fn(&Seen) -> bool,
) {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    let deadline = Instant::now() + WAIT;
    while !done(seen) {
        let out = String::from_utf8_lossy(&seen.out).into_owned();
        assert!(
            seen.close.is_none(),
            "{what}: closed {:?}; output {out:?}",
            seen.close
        );
        let left = deadline.saturating_duration_since(Instant::now());
        let m = tokio::time::timeout(left, ws.next())
            .await
            .unwrap_or_else(|_| panic!("no {what} within {WAIT:?}; output {out:?}"));
        match m {
            Some(Ok(Message::Binary(b))) => {
                if let Some((_, _, d)) = bmx::terminal::frame::parse(&b) {
                    seen.out.extend_from_slice(&d);
                }
            }
            Some(Ok(Message::Text(t))) => seen.notices.push(serde_json::from_str(&t).unwrap()),
            Some(Ok(Message::Close(f))) => {
                seen.close = Some(
                    f.map(|f| (u16::from(f.code), f.reason.to_string()))
                        .unwrap_or((1005, String::new())),
                );
            }
            None | Some(Err(_)) => seen.close = Some((1006, "gone".into())),
            Some(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_attached_through_any_replica_reaches_its_executor() {
    use bmx::terminal::frame::{self, OP_INPUT};
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::Message;
    let Some(db) = super::pg_support::fresh("replicas_terminal") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let (procs, clients, ports) = two_replicas(&db.url, data.path()).await;
    // The executor is connected to replica B only; everything goes
    // through A.
    let (_work, exec) = executor_on_b(ports).await;
    let a = &clients[0];
    let (status, t) = a
        .open_terminal("ex-b", &json!({"terminalId": "t1", "argv": ["/bin/sh"]}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{t}");
    let opts = bmx::client::AttachOptions {
        write: true,
        ..Default::default()
    };
    let mut ws = a.attach_terminal("ex-b", "t1", &opts).await.unwrap();
    let mut seen = Seen::default();
    read_until(&mut ws, &mut seen, "the attached notice", |s| {
        s.notices.iter().any(|n| n["type"] == "attached")
    })
    .await;
    let typed = |s: &str| Message::Binary(frame::frame(OP_INPUT, 0, s.as_bytes()));
    ws.send(typed("echo hi-$((6*7))\n")).await.unwrap();
    read_until(&mut ws, &mut seen, "the echo's output", |s| {
        String::from_utf8_lossy(&s.out).contains("hi-42")
    })
    .await;
    // The program ends: B's close (code and reason) passes through A.
    ws.send(typed("exit 3\n")).await.unwrap();
    read_until(&mut ws, &mut seen, "the close", |s| s.close.is_some()).await;
    assert_eq!(seen.close, Some((1000, "exited 3".into())));
    assert_eq!(exec.term().code(), Some(0));
    for p in procs {
        assert!(p.term().success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_streams_through_any_replica_and_an_unreachable_owner() {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;
    let Some(db) = super::pg_support::fresh("replicas_events") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let OnA {
        mut a,
        b,
        ports,
        mut fake,
        ..
    } = a_session_on_a(&db.url, data.path(), "ev-1", 20_000).await;
    let events = format!("127.0.0.1:{}/v1/sessions/ev-1/events", ports[1]);
    // Through B: the WebSocket and the Server-Sent Events of A's session.
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{events}/ws"))
        .await
        .unwrap();
    let sse = reqwest::Client::new()
        .get(format!("http://{events}"))
        .send()
        .await
        .unwrap();
    assert_eq!(sse.status(), 200);
    let mut sse = Box::pin(sse.bytes_stream());
    super::harness_common::send_event(
        &fake,
        "ev-1",
        "t1",
        1,
        json!({"type": "agent.message", "text": "said-on-a"}),
    )
    .await
    .unwrap();
    let first = text_frame(&mut ws).await;
    assert_eq!(first["kind"], "event", "{first}");
    assert_eq!(first["sequence"], 1, "{first}");
    assert!(first.to_string().contains("said-on-a"), "{first}");
    // The SSE stream carries it while it is still open: streamed through
    // B, not buffered until its end.
    let mut got = Vec::new();
    let deadline = Instant::now() + WAIT;
    while !String::from_utf8_lossy(&got).contains("said-on-a") {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, sse.next()).await {
            Ok(Some(Ok(c))) => got.extend_from_slice(&c),
            other => panic!(
                "no event on the SSE stream ({other:?}): {:?}",
                String::from_utf8_lossy(&got)
            ),
        }
    }
    // The session ends (stopped through B, on A): the stream's end and
    // A's close frame pass through B.
    let stop = {
        let b = client(ports[1]);
        tokio::spawn(async move { b.delete("/v1/sessions/ev-1").await.unwrap() })
    };
    fake.end_as_stopped("ev-1").await;
    let (status, ended) = stop.await.unwrap();
    assert_eq!(status, 200, "{ended}");
    let end = text_frame(&mut ws).await;
    assert_eq!(end["kind"], "end", "{end}");
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, ws.next()).await {
            Ok(Some(Ok(Message::Close(Some(f))))) => {
                assert_eq!(u16::from(f.code), 1000, "{f:?}");
                break;
            }
            Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => {}
            other => panic!("no close frame: {other:?}"),
        }
    }

    // A subprotocol the route does not speak: A upgrades without one,
    // which the client would fail; B answers 400 before an upgrade.
    let mut offer = format!("ws://{events}/ws").into_client_request().unwrap();
    offer.headers_mut().insert(
        "sec-websocket-protocol",
        http::HeaderValue::from_static("bmx.nothing"),
    );
    match tokio_tungstenite::connect_async(offer).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status(), 400);
            let body: serde_json::Value =
                serde_json::from_slice(resp.body().as_deref().unwrap_or_default()).unwrap();
            assert_eq!(
                body["error"]["data"]["reason"], "no_common_subprotocol",
                "{body}"
            );
        }
        other => panic!("not refused with 400: {other:?}"),
    }

    // A is gone but not yet dead by the database (seen within the TTL):
    // an upgrade through B is refused with 502, before any upgrade.
    a.0.kill().unwrap();
    a.0.wait().unwrap();
    match tokio_tungstenite::connect_async(format!("ws://{events}/ws")).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status(), 502);
            let body: serde_json::Value =
                serde_json::from_slice(resp.body().as_deref().unwrap_or_default()).unwrap();
            assert_eq!(
                body["error"]["data"]["reason"], "replica_unreachable",
                "{body}"
            );
        }
        other => panic!("not refused with 502: {other:?}"),
    }
    assert!(b.term().success());
}

/// The next text frame of an event WebSocket, as JSON (pings skipped),
/// at most [`WAIT`].
async fn text_frame<S>(ws: &mut tokio_tungstenite::WebSocketStream<S>) -> serde_json::Value
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => return serde_json::from_str(&t).unwrap(),
            Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => {}
            other => panic!("no text frame: {other:?}"),
        }
    }
}

/// The event stream of a dead replica's session goes on at the replica
/// that takes it over (issue 17, docs/store.md "Session events"): the
/// events A acknowledged are replayed by B as A showed them, a client
/// resuming with its `Last-Event-ID` gets only what follows, and the
/// executor's next sequence is the next one, under B's new grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replicas_event_stream_goes_on_where_it_is_taken_over() {
    use super::harness_common::{dial_endpoint, send_event, sse_at};
    use bmx::wire::types::Resume;
    let Some(db) = super::pg_support::fresh("replicas_events") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let OnA {
        mut a,
        b,
        ports,
        fake,
        connection,
        session: s,
    } = a_session_on_a(&db.url, data.path(), "ev-take", 20_000).await;
    let said = |n: u64| json!({"type": "agent.message", "text": format!("m{n}")});
    for n in 1..=3 {
        let r = send_event(&fake, "ev-take", "t1", n, said(n))
            .await
            .unwrap();
        assert_eq!(r["ackedSequence"], n, "{r}");
    }
    let urls = ports.map(|p| format!("http://127.0.0.1:{p}"));
    let path = "/v1/sessions/ev-take/events";
    // Through B, forwarded to A.
    let mut stream = sse_at(&urls[1], path, None, None).await;
    assert_eq!(stream.status, 200, "{:?}", stream.body);
    let before: Vec<serde_json::Value> = [
        stream.next().await,
        stream.next().await,
        stream.next().await,
    ]
    .into_iter()
    .map(|m| m.data)
    .collect();
    drop(stream);

    // A dies; the executor resumes on B, which takes the session over.
    a.0.kill().unwrap();
    a.0.wait().unwrap();
    drop(fake);
    let mut fake = dial_endpoint(&ws_url(ports[1]), "tok-b").await.unwrap();
    fake.register(Some(Resume {
        executor_id: "ex-b".into(),
        last_connection_id: connection,
        active_sessions: vec!["ev-take".into()],
        fencing_tokens: Default::default(),
    }))
    .await
    .unwrap();
    fake.keep_alive();
    let taken = until("B to hold the session", || async {
        let (status, v) = client(ports[1]).get("/v1/sessions/ev-take").await.ok()?;
        (status == 200 && v["state"] == "active").then_some(v)
    })
    .await;
    assert!(
        taken["fencingToken"].as_i64() > s["fencingToken"].as_i64(),
        "{taken} after {s}"
    );
    assert_eq!(local_status(ports[1], "ev-take").await, 200);

    let mut stream = sse_at(&urls[1], path, Some(1), None).await;
    assert_eq!(stream.status, 200, "{:?}", stream.body);
    assert_eq!(stream.next().await.data, before[1]);
    assert_eq!(stream.next().await.data, before[2]);
    let r = send_event(&fake, "ev-take", "t1", 3, said(3))
        .await
        .unwrap();
    assert_eq!(r["ackedSequence"], 3, "a resend: {r}");
    let r = send_event(&fake, "ev-take", "t1", 4, said(4))
        .await
        .unwrap();
    assert_eq!(r["ackedSequence"], 4, "{r}");
    let four = stream.next().await;
    assert_eq!(four.data["sequence"], 4, "{:?}", four.data);
    assert!(stream
        .next_within(Duration::from_millis(300))
        .await
        .is_none());
    assert!(b.term().success());
}

/// A database outage (issue 17): the calls that need the database answer
/// 503 `store_unavailable` in bounded time instead of a partial page or
/// a hang, and both replicas serve them again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_gives_503_and_the_replicas_recover() {
    let Some(db) = super::pg_support::fresh("replicas_outage") else {
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let ([a, b], clients, _) = two_replicas(&db.url, data.path()).await;
    for c in &clients {
        assert_eq!(c.get("/v1/executors").await.unwrap().0, 200);
        assert_eq!(c.get("/v1/sessions").await.unwrap().0, 200);
    }
    db.set_reachable(false);
    for c in &clients {
        for path in ["/v1/executors", "/v1/sessions"] {
            let v = until("a 503 during the outage", || async {
                let (status, v) = c.get(path).await.ok()?;
                (status == 503).then_some(v)
            })
            .await;
            assert_eq!(
                v["error"]["data"]["reason"], "store_unavailable",
                "{path}: {v}"
            );
        }
        // The process itself is up.
        assert_eq!(c.get("/v1/health").await.unwrap().0, 200);
    }
    db.set_reachable(true);
    for c in &clients {
        for path in ["/v1/executors", "/v1/sessions"] {
            until("the replica to serve again", || async {
                let (status, _) = c.get(path).await.ok()?;
                (status == 200).then_some(())
            })
            .await;
        }
    }
    assert!(a.term().success());
    assert!(b.term().success());
}

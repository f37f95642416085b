//! Issue 48: every session a sandbox. The real `bmx executor` binary
//! behind a library harness, driven through the harness's HTTP API as a
//! platform would: two sessions that cannot reach each other or the
//! executor by any path (bash, processes, terminals, MCP servers),
//! ordinary work that still works, escapees that die with their session,
//! bounds that hold one session without starving the others, and each
//! mechanism's fallback.

use crate::support::{self, executor_command, TOKEN};
use bmx::client::ApiClient;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A harness and one real executor (`extra` arguments), its work root,
/// and an API client.
struct World {
    _h: bmx::harness::HarnessHandle,
    api: ApiClient,
    executor: tokio::process::Child,
    work: tempfile::TempDir,
}

async fn world(extra: &[&str]) -> World {
    let work = tempfile::tempdir().unwrap();
    let h = bmx::harness::Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .token("ex", TOKEN)
        .heartbeat_ms(500)
        .lease_ttl_ms(10_000)
        .build()
        .await
        .expect("harness");
    let executor = executor_command(&h.executor_url(), work.path())
        .args(extra)
        .spawn()
        .expect("bmx executor");
    assert!(
        h.wait_for_executor(Some("ex"), Duration::from_secs(20))
            .await,
        "the executor registers"
    );
    let api = ApiClient::new(&h.api_url())
        .unwrap()
        .timeout(Duration::from_secs(60));
    World {
        _h: h,
        api,
        executor,
        work,
    }
}

/// The executor ends the orderly way (SIGTERM), so it kills and removes
/// its sessions' cgroups; a SIGKILL would leave them to the next
/// executor's start.
impl Drop for World {
    fn drop(&mut self) {
        if let Some(pid) = self.executor.id() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let end = std::time::Instant::now() + Duration::from_secs(20);
            while std::time::Instant::now() < end
                && self.executor.try_wait().ok().flatten().is_none()
            {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

impl World {
    async fn session(&self, body: Value) -> String {
        let (s, v) = self.api.post("/v1/sessions", &body).await.unwrap();
        assert_eq!(s, 201, "{v}");
        v["sessionId"].as_str().unwrap().to_owned()
    }

    /// A `bash` call: (succeeded, its text).
    async fn bash(&self, sid: &str, command: &str) -> (bool, String) {
        let (s, v) = self
            .api
            .post(
                &format!("/v1/sessions/{sid}/tools"),
                &json!({"tool": "bash", "input": {"command": command, "timeoutMs": 60_000}}),
            )
            .await
            .unwrap();
        assert_eq!(s, 200, "{v}");
        let text = v["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        (v["isError"] == false, text)
    }

    /// A process run to its end: (its final state, its output with
    /// stderr merged).
    async fn process(&self, sid: &str, pid: &str, argv: &[&str]) -> (Value, String) {
        let (s, v) = self
            .api
            .post(
                &format!("/v1/sessions/{sid}/processes"),
                &json!({"processId": pid, "argv": argv, "stderr": "merge"}),
            )
            .await
            .unwrap();
        assert!(s == 200 || s == 201, "{v}");
        let mut text = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (_, out) = self
                .api
                .get(&format!(
                    "/v1/sessions/{sid}/processes/{pid}/output?stream=stdout&cursor={cursor}&waitMs=10000"
                ))
                .await
                .unwrap();
            let data = out["data"].as_str().unwrap_or_default();
            text.extend(base64_simd::STANDARD.decode_to_vec(data).unwrap());
            cursor = out["nextCursor"].as_u64().unwrap_or(cursor);
            if out["eof"] == true {
                break;
            }
        }
        let (_, list) = self
            .api
            .get(&format!("/v1/sessions/{sid}/processes"))
            .await
            .unwrap();
        let state = list["processes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["processId"] == pid)
            .cloned()
            .unwrap_or(Value::Null);
        (state, String::from_utf8_lossy(&text).into_owned())
    }

    /// This executor's entry in `GET /v1/executors`.
    async fn executor(&self) -> Value {
        let (_, v) = self.api.get("/v1/executors").await.unwrap();
        v["executors"][0].clone()
    }

    fn workspace(&self, sid: &str) -> PathBuf {
        self.work.path().join("sessions").join(sid)
    }

    fn executor_pid(&self) -> u32 {
        self.executor.id().unwrap()
    }

    async fn end(&self, sid: &str) {
        let (s, v) = self
            .api
            .delete(&format!("/v1/sessions/{sid}"))
            .await
            .unwrap();
        assert_eq!(s, 200, "{v}");
    }
}

/// What session code tries against `victim`'s workspace and the
/// executor, as one shell script that prints what got through.
fn attack(victim: &Path, work_root: &Path, executor: u32) -> String {
    let v = victim.display();
    let w = work_root.display();
    format!(
        "cat {v}/mine.txt && echo READ-OTHER; \
         echo evil > {v}/planted && echo WROTE-OTHER; \
         echo evil >> {v}/mine.txt && echo CHANGED-OTHER; \
         ls {w}/sessions/ && echo LISTED-SESSIONS; \
         cat {w}/planted-secret && echo READ-WORK-ROOT; \
         cat {w}/journal.db > /dev/null && echo READ-JOURNAL; \
         kill -0 {executor} && echo SIGNALLED-EXECUTOR; \
         cat /proc/{executor}/environ > /dev/null && echo READ-ENVIRON; \
         echo attack-done"
    )
}

const GOT_THROUGH: &[&str] = &[
    "READ-OTHER",
    "WROTE-OTHER",
    "CHANGED-OTHER",
    "LISTED-SESSIONS",
    "READ-WORK-ROOT",
    "READ-JOURNAL",
    "SIGNALLED-EXECUTOR",
    "READ-ENVIRON",
];

fn assert_nothing_got_through(path: &str, text: &str) {
    assert!(
        text.contains("attack-done"),
        "{path}: the attack ran: {text}"
    );
    for marker in GOT_THROUGH {
        assert!(!text.contains(marker), "{path}: {marker}: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_reach_neither_each_other_nor_the_executor_by_any_path() {
    let w = world(&[]).await;
    let a = w.session(json!({})).await;
    let b = w
        .session(json!({"mcpServers": [{
        "serverKey": "probe", "connectionOrigin": "environment",
        "transport": {"type": "stdio", "command": "sh", "args": ["-c", "placeholder"]}}]}))
        .await;
    let (ok, text) = w.bash(&a, "echo secret-of-a > mine.txt").await;
    assert!(ok, "{text}");
    std::fs::write(w.work.path().join("planted-secret"), "executor's").unwrap();
    let script = attack(&w.workspace(&a), w.work.path(), w.executor_pid());

    // 1. The bash tool.
    let (_, text) = w.bash(&b, &script).await;
    assert_nothing_got_through("bash", &text);

    // 2. A process.
    let (state, out) = w.process(&b, "p1", &["sh", "-c", &script]).await;
    assert_nothing_got_through("process", &out);
    assert_eq!(state["state"], "exited", "{state}");

    // 3. An MCP server: a stdio "server" that runs the attack and leaves
    // its findings in its own workspace.
    let c = w
        .session(json!({"mcpServers": [{
            "serverKey": "probe", "connectionOrigin": "environment",
            "transport": {"type": "stdio", "command": "sh",
                          "args": ["-c", format!("({script}) > found.txt 2>&1; sleep 60")]}}]}))
        .await;
    let found = w.workspace(&c).join("found.txt");
    support::eventually("the MCP server ran", || {
        std::fs::read_to_string(&found).is_ok_and(|t| t.contains("attack-done"))
    })
    .await;
    assert_nothing_got_through("mcp", &std::fs::read_to_string(&found).unwrap());

    // 4. A terminal (executor-scoped, a sandbox of its own).
    let (s, v) = w
        .api
        .post(
            "/v1/executors/ex/terminals",
            &json!({"terminalId": "t1", "argv": ["sh", "-c", format!("({script}) > found.txt 2>&1; sleep 60")],
                    "cols": 80, "rows": 24}),
        )
        .await
        .unwrap();
    assert!(s == 200 || s == 201, "{v}");
    let found = w.work.path().join("terminals/t1/found.txt");
    support::eventually("the terminal ran", || {
        std::fs::read_to_string(&found).is_ok_and(|t| t.contains("attack-done"))
    })
    .await;
    assert_nothing_got_through("terminal", &std::fs::read_to_string(&found).unwrap());

    // Nothing of the victim changed, nothing was planted.
    assert_eq!(
        std::fs::read_to_string(w.workspace(&a).join("mine.txt")).unwrap(),
        "secret-of-a\n"
    );
    assert!(!w.workspace(&a).join("planted").exists());
    // A session reads its own file, and the executor advertised what it
    // enforces.
    let (ok, text) = w.bash(&a, "cat mine.txt").await;
    assert!(ok && text.contains("secret-of-a"), "{text}");
    let ex = w.executor().await;
    let sb = &ex["capabilities"]["sandbox"];
    assert_eq!(sb["filesystem"], "landlock", "{ex}");
    assert_ne!(sb["cgroup"], "none", "{ex}");
    assert_eq!(sb["scoped"], true, "{ex}");
    let _ = b;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordinary_work_still_works_in_the_sandbox() {
    let w = world(&[]).await;
    let s = w.session(json!({})).await;
    let script = r#"set -e
        python3 -c 'import sys, tempfile; f = tempfile.NamedTemporaryFile(); print("py", sys.version_info[0], f.name.startswith(__import__("os").environ["TMPDIR"]))'
        printf 'int main(){return 0;}' > t.c && cc -o t t.c && ./t && echo cc-ok
        git init -q repo && cd repo && git config user.email a@b && git config user.name n
        echo x > f && git add f && git commit -qm one && git log --oneline | wc -l && cd ..
        t=$(mktemp) && echo hi > "$t" && cat "$t"
        echo home > "$HOME/h" && cat "$HOME/h"
        ls /usr/bin/env > /dev/null && echo usr-ok
        node -e 'console.log("node", 1 + 1)'
        echo done"#;
    let (ok, text) = w.bash(&s, script).await;
    assert!(ok, "{text}");
    for want in [
        "py 3 True",
        "cc-ok",
        "\n1\n",
        "hi",
        "home",
        "usr-ok",
        "node 2",
        "done",
    ] {
        assert!(text.contains(want), "want {want:?}: {text}");
    }
}

/// Whether a live (not zombie) process has `marker` in its command line.
fn live_with(marker: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
        })
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    let rest = &s[s.rfind(')')? + 2..];
                    rest.chars().next()
                })
                .is_some_and(|state| state != 'Z')
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escapees_of_every_kind_die_when_the_session_ends() {
    let w = world(&[]).await;
    let tag = format!("{}", std::process::id());
    // Its own stdio on /dev/null: an escapee holding the process's output
    // pipe would keep that output from ending, which is not under test.
    let escape = |n: u32| {
        format!("setsid env -i sh -c '(exec sleep 7{tag}{n} &)' </dev/null >/dev/null 2>&1")
    };
    let s = w
        .session(json!({"mcpServers": [{
            "serverKey": "esc", "connectionOrigin": "environment",
            "transport": {"type": "stdio", "command": "sh",
                          "args": ["-c", format!("{}; sleep 600", escape(1))]}}]}))
        .await;
    let (ok, text) = w.bash(&s, &format!("{}; echo ok", escape(2))).await;
    assert!(ok, "{text}");
    let (st, _v) = w
        .api
        .post(
            &format!("/v1/sessions/{s}/processes"),
            &json!({"processId": "p1", "argv": ["sh", "-c", format!("{}; sleep 600", escape(3))]}),
        )
        .await
        .unwrap();
    assert!(st == 200 || st == 201, "{_v}");
    let (s2, v) = w
        .api
        .post(
            &format!("/v1/sessions/{s}/processes"),
            &json!({"processId": "p2", "argv": ["sh", "-c", format!("{}; sleep 600", escape(4))], "ioMode": "pty"}),
        )
        .await
        .unwrap();
    assert!(s2 == 200 || s2 == 201, "{v}");
    for n in 1..=4 {
        let marker = format!("7{tag}{n}");
        support::eventually(&format!("escapee {n} runs"), || {
            !live_with(&marker).is_empty()
        })
        .await;
    }
    w.end(&s).await;
    // The session's end waits for its cgroup to be empty: by the time
    // DELETE answers, nothing it started is alive.
    for n in 1..=4 {
        let marker = format!("7{tag}{n}");
        assert!(
            live_with(&marker).is_empty(),
            "escapee {n} survived its session"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_and_a_memory_hog_leave_the_executor_and_others_serving() {
    let w = world(&["--session-pids-max", "64", "--session-memory-max", "96M"]).await;
    let bomb = w.session(json!({})).await;
    let other = w.session(json!({})).await;

    // At its bound a session's fork fails with EAGAIN.
    let (_, text) = w
        .bash(
            &bomb,
            "for i in $(seq 200); do sleep 30 & done 2>&1 | head -3; echo after",
        )
        .await;
    assert!(
        text.contains("Resource temporarily unavailable") || text.contains("retry"),
        "no EAGAIN at the bound: {text}"
    );
    // A fork bomb, bounded by the call's timeout, while the other session
    // keeps serving.
    let api = w.api.clone();
    let b2 = bomb.clone();
    let bombing = tokio::spawn(async move {
        api.post(
            &format!("/v1/sessions/{b2}/tools"),
            &json!({"tool": "bash", "input": {"command": "f(){ f | f & }; f; sleep 5", "timeoutMs": 8000}}),
        )
        .await
    });
    for i in 0..5 {
        let (ok, text) = w.bash(&other, &format!("echo alive-{i}")).await;
        assert!(ok && text.contains(&format!("alive-{i}")), "{text}");
    }
    let _ = bombing.await;

    // A memory hog is ended by the kernel's OOM killer, and says so.
    let (st, _) = w
        .process(
            &bomb,
            "hog",
            &["python3", "-c", "x = bytearray(512 << 20); print(len(x))"],
        )
        .await;
    assert_eq!(st["state"], "killed", "{st}");
    assert_eq!(st["reason"], "oom_killed", "{st}");
    let (ok, text) = w.bash(&other, "echo still-serving").await;
    assert!(ok && text.contains("still-serving"), "{text}");
    // The executor itself is fine.
    let ex = w.executor().await;
    assert_eq!(
        ex["capabilities"]["sandbox"]["limits"]["pidsMax"], 64,
        "{ex}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_may_lower_its_bounds_but_never_raise_them() {
    let w = world(&["--session-pids-max", "64"]).await;
    let (s, v) = w
        .api
        .post(
            "/v1/sessions",
            &json!({"metadata": {"sandbox": {"pidsMax": 65}}}),
        )
        .await
        .unwrap();
    assert_eq!(s, 400, "{v}");
    assert!(v.to_string().contains("metadata.sandbox.pidsMax"), "{v}");
    let sid = w
        .session(json!({"metadata": {"sandbox": {"pidsMax": 8}}}))
        .await;
    let (_, text) = w
        .bash(
            &sid,
            "for i in $(seq 20); do sleep 30 & done 2>&1 | head -2; echo after",
        )
        .await;
    assert!(
        text.contains("Resource temporarily unavailable") || text.contains("retry"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_session_holds_no_capability_and_cannot_answer_confirmations() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        panic!("this test needs root (CI runs as root): it checks what a root executor drops");
    }
    let w = world(&["--confirm", "always"]).await;
    let s = w.session(json!({})).await;
    let sock = w.work.path().join("confirm/confirm.sock");
    // The call itself waits for a person: answer it from the test (as the
    // executor's user, outside any session) after reading what the
    // session's code got from the socket.
    let api = w.api.clone();
    let sid = s.clone();
    let script = format!(
        "grep -E '^(Cap(Eff|Prm|Amb)|NoNewPrivs)' /proc/self/status; \
         mknod dev c 1 3 && echo MADE-DEVICE; \
         python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); s.connect(\"{}\"); s.sendall(b\"{{\\\"op\\\":\\\"list\\\"}}\\n\"); print(s.recv(4096).decode())'; echo end",
        sock.display()
    );
    let call = tokio::spawn(async move {
        api.post(
            &format!("/v1/sessions/{sid}/tools"),
            &json!({"tool": "bash", "input": {"command": script}}),
        )
        .await
    });
    let pending = loop {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
            .args(["confirm", "ls", "--json", "--socket"])
            .arg(&sock)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if let Some(id) = text
            .split('"')
            .skip_while(|t| *t != "id")
            .nth(2)
            .map(str::to_owned)
        {
            break id;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let ok = std::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args(["confirm", "allow", &pending, "--socket"])
        .arg(&sock)
        .status()
        .unwrap();
    assert!(ok.success());
    let (_, v) = call.await.unwrap().unwrap();
    let text = v["content"][0]["text"].as_str().unwrap_or_default();
    // CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID NET_BIND_SERVICE:
    // nothing that reaches past Landlock (no SYS_ADMIN, SYS_MODULE,
    // NET_ADMIN, NET_RAW, MKNOD, SYS_RAWIO...).
    assert!(text.contains("CapEff:\t00000000000004fb"), "{text}");
    assert!(text.contains("CapPrm:\t00000000000004fb"), "{text}");
    assert!(text.contains("CapAmb:\t0000000000000000"), "{text}");
    assert!(text.contains("NoNewPrivs:\t1"), "{text}");
    assert!(!text.contains("MADE-DEVICE"), "{text}");
    assert!(text.contains("session code may not answer"), "{text}");
    assert!(text.contains("end"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_cgroup_the_tag_still_ends_what_keeps_its_environment() {
    let w = world(&["--sandbox-without", "cgroup"]).await;
    let ex = w.executor().await;
    assert_eq!(ex["capabilities"]["sandbox"]["cgroup"], "none", "{ex}");
    assert_eq!(
        ex["capabilities"]["sandbox"]["filesystem"], "landlock",
        "{ex}"
    );
    let s = w.session(json!({})).await;
    let tag = format!("8{}", std::process::id());
    let (ok, text) = w
        .bash(&s, &format!("setsid sh -c '(exec sleep {tag} &)'; echo ok"))
        .await;
    assert!(ok, "{text}");
    support::eventually("the escapee runs", || !live_with(&tag).is_empty()).await;
    w.end(&s).await;
    support::eventually("the tagged escapee dies", || live_with(&tag).is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_landlock_the_executor_warns_or_with_required_refuses() {
    // `auto`: it starts, and says what is not enforced.
    let w = world(&["--sandbox-without", "landlock"]).await;
    let ex = w.executor().await;
    assert_eq!(ex["capabilities"]["sandbox"]["filesystem"], "none", "{ex}");
    assert_eq!(ex["capabilities"]["sandbox"]["scoped"], false, "{ex}");
    drop(w);
    // `required`: it refuses to start, naming what is missing.
    let work = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
        .args(["executor", "--url", "ws://127.0.0.1:9/", "--token", TOKEN])
        .args(["--sandbox", "required", "--sandbox-without", "landlock"])
        .arg("--work-root")
        .arg(work.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--sandbox required") && err.contains("Landlock"),
        "{err}"
    );
}

#[test]
fn a_bound_that_cannot_be_parsed_is_refused_at_start_naming_its_flag() {
    for (flag, value) in [
        ("--session-memory-max", "12X"),
        ("--session-pids-max", "0"),
        ("--session-cpu-max", "-1"),
        ("--session-network", "some"),
        ("--sandbox", "maybe"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
            .args(["executor", "--url", "ws://127.0.0.1:9/", "--token", TOKEN])
            .arg(format!("{flag}={value}"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{flag}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_none_refuses_tcp() {
    let w = world(&["--session-network", "none"]).await;
    let s = w.session(json!({})).await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (_, text) = w
        .bash(
            &s,
            &format!(
                "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 2)' && echo CONNECTED; \
                 python3 -c 'import socket; socket.socket().bind((\"127.0.0.1\", 0))' && echo BOUND; echo end"
            ),
        )
        .await;
    assert!(text.contains("end"), "{text}");
    assert!(
        !text.contains("CONNECTED") && !text.contains("BOUND"),
        "{text}"
    );
    assert!(text.contains("Permission denied"), "{text}");
}

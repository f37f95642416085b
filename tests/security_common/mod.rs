//! The real binaries for the security tests: a `bmx harness` or `bmx
//! executor` child whose stderr (the log) is kept in a file, stopped with
//! SIGTERM, and its log read back whole.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `bmx` child process and the file its stderr goes to.
pub struct Bmx {
    pub child: Child,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
    /// A harness's `--data-dir`, removed on drop.
    _data: Option<tempfile::TempDir>,
}

impl Bmx {
    /// Start `bmx ARGS` with `envs` and `RUST_LOG=rust_log`, logs to a file.
    pub fn spawn(args: &[&str], envs: &[(&str, &str)], rust_log: &str) -> Bmx {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("stderr.log");
        let mut c = Command::new(env!("CARGO_BIN_EXE_bmx"));
        c.args(args)
            .env("RUST_LOG", rust_log)
            .env_remove("BMX_LOG_FORMAT")
            .env_remove("BMX_TOKEN")
            .env_remove("BMX_API_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in envs {
            c.env(k, v);
        }
        Bmx {
            child: c.spawn().unwrap(),
            log,
            _dir: dir,
            _data: None,
        }
    }

    /// `bmx harness` on 127.0.0.1:0; returns it and its API base URL
    /// (`http://ADDR`), read from the line it prints once it listens.
    pub fn harness(extra: &[&str], envs: &[(&str, &str)], rust_log: &str) -> (Bmx, String) {
        // A data dir of its own (kept with the log's), never `~/.bmx`.
        let data = tempfile::tempdir().unwrap();
        let dir = data.path().to_str().unwrap().to_owned();
        let mut args = vec!["harness", "--listen", "127.0.0.1:0", "--data-dir", &dir];
        args.extend_from_slice(extra);
        let mut h = Bmx::spawn(&args, envs, rust_log);
        h._data = Some(data);
        let api = api_url(&mut h.child);
        (h, api)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGTERM, wait (20 s, then SIGKILL and panic), return the whole log.
    pub fn stop(mut self) -> String {
        let pid = nix::unistd::Pid::from_raw(self.pid());
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("bmx did not exit after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::read_to_string(&self.log).unwrap()
    }
}

impl Drop for Bmx {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The API base URL (`http://ADDR`) of a `bmx harness` child, read from
/// the first line it prints on its piped stdout once it listens.
pub fn api_url(child: &mut Child) -> String {
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    // "bmx harness: API http://ADDR/v1, executors connect to ws://..."
    line.split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no API URL in {line:?}"))
        .trim_end_matches(',')
        .trim_end_matches("/v1")
        .to_owned()
}

/// One tool call in session `s1` on the stand-in's connection; its
/// `tool.result`.
pub async fn tool(
    served: &crate::support::Served,
    events: &mut tokio::sync::mpsc::UnboundedReceiver<(String, serde_json::Value)>,
    id: &str,
    tool: &str,
    input: serde_json::Value,
) -> serde_json::Value {
    let a: bmx::wire::types::Accepted = served
        .call(
            bmx::wire::Method::ToolCall,
            &serde_json::json!({"sessionId": "s1", "toolCallId": id, "tool": tool, "input": input}),
        )
        .await
        .unwrap();
    assert!(a.accepted);
    event(events, "tool.result", |v| v["toolCallId"] == id).await
}

/// Lines of `log` that begin with `marker` (a forged line would).
pub fn forged_lines<'a>(log: &'a str, marker: &str) -> Vec<&'a str> {
    log.lines().filter(|l| l.starts_with(marker)).collect()
}

/// Wait for the first event `method` whose params satisfy `pick`.
pub async fn event(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<(String, serde_json::Value)>,
    method: &str,
    pick: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let wait = async {
        while let Some((m, v)) = rx.recv().await {
            if m == method && pick(&v) {
                return v;
            }
        }
        panic!("the connection closed before {method}");
    };
    tokio::time::timeout(Duration::from_secs(60), wait)
        .await
        .unwrap_or_else(|_| panic!("no {method} within 60 s"))
}

/// Text of a `tool.result` event.
pub fn result_text(v: &serde_json::Value) -> String {
    v["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["text"].as_str())
        .collect()
}

/// The real executor binary (`bmx executor --url … --work-root … EXTRA`)
/// behind an in-process stand-in harness, registered. The stand-in must
/// outlive the test's use of the connection.
pub async fn executor_behind_stand_in(
    extra: &[&str],
    envs: &[(&str, &str)],
    rust_log: &str,
) -> (
    Bmx,
    crate::support::StandIn,
    crate::support::Conn,
    tempfile::TempDir,
) {
    let mut harness = crate::support::stand_in(crate::support::Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let work_root = work.path().to_str().unwrap().to_owned();
    let mut args = vec!["executor", "--url", &harness.url, "--work-root", &work_root];
    args.extend_from_slice(extra);
    let executor = Bmx::spawn(&args, envs, rust_log);
    let mut conn = harness.next_conn().await;
    conn.register(10_000, 30_000).await;
    (executor, harness, conn, work)
}

/// A real `bmx harness` (API token `api_secret`, one executor `exec-1`
/// with token `exec_secret`) and a real `bmx executor` connected to it,
/// both logging at `rust_log`.
pub struct Pair {
    pub harness: Bmx,
    pub executor: Bmx,
    /// The API base URL (`http://ADDR`).
    pub api: String,
    /// A client carrying the API token.
    pub client: bmx::client::ApiClient,
    pub work: tempfile::TempDir,
}

/// Start a [`Pair`]; returns once the executor is registered (30 s).
pub async fn pair(api_secret: &str, exec_secret: &str, rust_log: &str) -> Pair {
    let token_arg = format!("exec-1={exec_secret}");
    let (harness, api) = Bmx::harness(
        &["--token", &token_arg],
        &[("BMX_API_TOKEN", api_secret)],
        rust_log,
    );
    let url = format!(
        "ws://{}/v1/executor/connect",
        api.trim_start_matches("http://")
    );
    let work = tempfile::tempdir().unwrap();
    let work_root = work.path().to_str().unwrap().to_owned();
    let executor = Bmx::spawn(
        &["executor", "--url", &url, "--work-root", &work_root],
        &[("BMX_TOKEN", exec_secret)],
        rust_log,
    );
    let client = bmx::client::ApiClient::new(&api)
        .unwrap()
        .token(Some(api_secret.into()))
        .timeout(Duration::from_secs(30));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, v) = client.executors().await.unwrap();
        assert_eq!(status, 200, "{v}");
        if v["executors"].as_array().is_some_and(|e| !e.is_empty()) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no executor: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Pair {
        harness,
        executor,
        api,
        client,
        work,
    }
}

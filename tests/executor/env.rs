//! The child environment policy, black-box through the `bmx executor`
//! daemon: every process, bash tool call and terminal carries its scope tag
//! (`BMX_SCOPE`), so what leaves its group with `setsid` still dies with its
//! session or terminal; and no `BMX_*` secret of the executor's own
//! environment reaches any of them.

use crate::support;
use bmx::wire::types::*;
use bmx::wire::Method;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use support::*;
use tokio::sync::mpsc;

/// A secret the executor holds in its environment, never a child's.
const API_SECRET: &str = "api-secret-3c1f9e77";
const OTHER_SECRET: &str = "other-secret-8d20b4aa";

/// `bmx executor` as a child, registered with a stand-in and served.
struct Daemon {
    child: tokio::process::Child,
    conn: Served,
    events: mpsc::UnboundedReceiver<(String, Value)>,
    work: tempfile::TempDir,
    _stand_in: StandIn,
}

impl Daemon {
    async fn start() -> Daemon {
        let mut stand_in = stand_in(Options::default()).await;
        let work = tempfile::tempdir().unwrap();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_bmx"))
            .args(["executor", "--url", &stand_in.url, "--token", TOKEN])
            .arg("--work-root")
            .arg(work.path())
            .env("RUST_LOG", "warn")
            .env("BMX_API_TOKEN", API_SECRET)
            .env("BMX_SOMETHING_ELSE", OTHER_SECRET)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut conn = stand_in.next_conn().await;
        conn.register(10_000, 30_000).await;
        let (conn, events) = conn.serve();
        Daemon {
            child,
            conn,
            events,
            work,
            _stand_in: stand_in,
        }
    }

    async fn assign(&self, session: &str) {
        let _: AssignResult = self
            .conn
            .call(Method::SessionAssign, &assign_params(session, 1))
            .await
            .expect("assign");
    }

    async fn stop_session(&self, session: &str) {
        let r: StopResult = self
            .conn
            .call(
                Method::SessionStop,
                &StopParams {
                    session_id: session.into(),
                    reason: "done".into(),
                    deadline_ms: Some(1_000),
                    keep_workspace: false,
                },
            )
            .await
            .expect("session.stop");
        assert!(r.stopped);
    }

    /// Run a bash tool call to its result.
    async fn bash(&mut self, session: &str, id: &str, command: &str) -> ToolResultParams {
        let a: Accepted = self
            .conn
            .call(
                Method::ToolCall,
                &ToolCallParams {
                    session_id: session.into(),
                    tool_call_id: id.into(),
                    tool: "bash".into(),
                    input: json!({ "command": command }),
                    deadline_ms: None,
                    permission: None,
                },
            )
            .await
            .expect("tool.call");
        assert!(a.accepted);
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let (m, v) = tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .expect("tool.result within 10 s")
                .expect("events open");
            if m == "tool.result" && v["toolCallId"] == id {
                return serde_json::from_value(v).unwrap();
            }
        }
    }

    async fn open_terminal(&self, id: &str, script: &str) -> TerminalOpenResult {
        self.conn
            .call(
                Method::TerminalOpen,
                &TerminalOpenParams {
                    terminal_id: id.into(),
                    kind: None,
                    argv: Some(vec!["sh".into(), "-c".into(), script.into()]),
                    shell: None,
                    cwd: Some(self.work.path().display().to_string()),
                    env: None,
                    cols: 80,
                    rows: 24,
                },
            )
            .await
            .expect("terminal.open")
    }

    async fn close_terminal(&self, id: &str) {
        let r: TerminalCloseResult = self
            .conn
            .call(
                Method::TerminalClose,
                &TerminalCloseParams {
                    terminal_id: id.into(),
                    reason: "test".into(),
                },
            )
            .await
            .expect("terminal.close");
        assert!(r.closed);
    }

    /// SIGTERM: the daemon exits 0.
    async fn stop(mut self) {
        let pid = self.child.id().unwrap() as i32;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = tokio::time::timeout(WAIT, self.child.wait())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(status.code(), Some(0));
    }
}

/// A number no other process on the host has as its argument.
fn unique(kind: u32) -> String {
    format!("4{kind}{:07}", std::process::id())
}

/// Live processes whose command line is exactly `sleep <arg>`.
fn sleeps(arg: &str) -> Vec<i32> {
    let wanted = format!("sleep\0{arg}\0");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == wanted.as_bytes())
        })
        .filter(|pid| alive(*pid))
        .collect()
}

/// Kill what a failed assertion left behind, so a red test leaks nothing.
struct Reap(String);

impl Drop for Reap {
    fn drop(&mut self) {
        for pid in sleeps(&self.0) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Shell code that starts `sleep <arg>` in a session of its own (out of
/// the caller's process group, orphaned at once) and returns only once it
/// left the group: a group kill racing the `setsid` call would otherwise
/// decide the test.
fn detached(arg: &str) -> String {
    let ready = format!("ready-{arg}");
    format!(
        "(setsid sh -c 'touch {ready}; exec sleep {arg}' >/dev/null 2>&1 </dev/null &); \
         until [ -e {ready} ]; do sleep 0.01; done"
    )
}

#[tokio::test]
async fn a_setsid_escapee_of_a_bash_tool_call_dies_with_its_session() {
    let arg = unique(1);
    let _reap = Reap(arg.clone());
    let mut d = Daemon::start().await;
    d.assign("s").await;
    let r = d.bash("s", "escape", &detached(&arg)).await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{:?}", r.content);
    eventually("the escapee runs", || sleeps(&arg).len() == 1).await;
    d.stop_session("s").await;
    eventually("the escapee is gone", || sleeps(&arg).is_empty()).await;
    d.stop().await;
}

#[tokio::test]
async fn a_setsid_escapee_of_a_process_dies_with_its_session() {
    let arg = unique(2);
    let _reap = Reap(arg.clone());
    let d = Daemon::start().await;
    d.assign("s").await;
    // The process itself keeps running: only the session's end kills it.
    let script = format!("{}; exec sleep 600", detached(&arg));
    let st: ProcessState = d
        .conn
        .call(
            Method::ProcessStart,
            &start_params("s", "p", &["sh", "-c", &script]),
        )
        .await
        .expect("process.start");
    assert_eq!(st.state, ProcState::Running);
    eventually("the escapee runs", || sleeps(&arg).len() == 1).await;
    d.stop_session("s").await;
    eventually("the escapee is gone", || sleeps(&arg).is_empty()).await;
    d.stop().await;
}

#[tokio::test]
async fn a_setsid_escapee_of_a_terminal_dies_when_it_closes() {
    let arg = unique(3);
    let _reap = Reap(arg.clone());
    let d = Daemon::start().await;
    let script = format!("{}; exec sleep 600", detached(&arg));
    let t = d.open_terminal("t", &script).await;
    eventually("the escapee runs", || sleeps(&arg).len() == 1).await;
    d.close_terminal("t").await;
    eventually("the terminal and the escapee are gone", || {
        !alive(t.pid as i32) && sleeps(&arg).is_empty()
    })
    .await;
    d.stop().await;
}

/// SIGTERM to the daemon ends every session and terminal it holds, and
/// with them whatever left its group: nothing is re-parented to pid 1.
#[tokio::test]
async fn setsid_escapees_die_when_the_daemon_exits_on_sigterm() {
    let (tool, process, terminal) = (unique(5), unique(6), unique(7));
    let _reap = [
        Reap(tool.clone()),
        Reap(process.clone()),
        Reap(terminal.clone()),
    ];
    let mut d = Daemon::start().await;
    d.assign("s").await;
    let r = d.bash("s", "escape", &detached(&tool)).await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{:?}", r.content);
    let script = format!("{}; exec sleep 600", detached(&process));
    let _: ProcessState = d
        .conn
        .call(
            Method::ProcessStart,
            &start_params("s", "p", &["sh", "-c", &script]),
        )
        .await
        .expect("process.start");
    let script = format!("{}; exec sleep 600", detached(&terminal));
    d.open_terminal("t", &script).await;
    eventually("the three escapees run", || {
        sleeps(&tool).len() == 1 && sleeps(&process).len() == 1 && sleeps(&terminal).len() == 1
    })
    .await;
    d.stop().await;
    eventually("every escapee died with the daemon", || {
        sleeps(&tool).is_empty() && sleeps(&process).is_empty() && sleeps(&terminal).is_empty()
    })
    .await;
}

/// The environment a child printed with `env`, as name → value.
fn parse_env(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim_end_matches('\r').to_owned()))
        .collect()
}

/// No executor secret, by name or by value. The scope tag is the
/// fallback where no cgroup holds the session (issue 48): present then,
/// absent with one; never anything else of `BMX_*`.
fn assert_clean(what: &str, text: &str) {
    assert!(
        !text.contains(API_SECRET) && !text.contains(OTHER_SECRET),
        "{what} sees an executor secret:\n{text}"
    );
    let env = parse_env(text);
    let leaked: Vec<&String> = env
        .keys()
        .filter(|k| k.starts_with("BMX_") && *k != "BMX_SCOPE")
        .collect();
    assert!(leaked.is_empty(), "{what} sees {leaked:?}");
    assert!(
        env.get("BMX_SCOPE").is_none_or(|s| !s.is_empty()),
        "{what} has an empty scope tag:\n{text}"
    );
}

#[tokio::test]
async fn no_bmx_secret_reaches_a_process_a_tool_or_a_terminal() {
    let mut d = Daemon::start().await;
    d.assign("s").await;

    let r = d.bash("s", "env", "env").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{:?}", r.content);
    assert_clean("a bash tool call", r.content[0].text.as_deref().unwrap());

    let st: ProcessState = d
        .conn
        .call(
            Method::ProcessStart,
            &ProcessStartParams {
                wait_ms: Some(5_000),
                ..start_params("s", "env", &["env"])
            },
        )
        .await
        .expect("process.start");
    assert_eq!(st.exit_code, Some(0));
    let out: ProcessReadResult = d
        .conn
        .call(
            Method::ProcessRead,
            &read_params("s", "env", Stream::Stdout, 0, 1_000),
        )
        .await
        .expect("process.read");
    assert_clean("a process", &String::from_utf8_lossy(out.data.as_slice()));

    // A terminal writes only in its own directory (issue 48).
    let file = d.work.path().join("terminals/t/terminal.env");
    let script = "env > terminal.env.tmp && mv terminal.env.tmp terminal.env".to_owned();
    d.open_terminal("t", &script).await;
    eventually("the terminal wrote its environment", || file.exists()).await;
    assert_clean("a terminal", &std::fs::read_to_string(&file).unwrap());

    d.stop_session("s").await;
    d.stop().await;
}

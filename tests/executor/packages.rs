//! Issue 15: `process.start.packageInstall` through the real executor over
//! a real WebSocket: a real `pip install --target` into the workspace, its
//! output streamed through `process.read`, the package importable after;
//! and the names and shapes that are refused before anything runs.
//!
//! The wheel is built by the test (a zip, written by Python's `zipfile`) and
//! found by pip through `PIP_NO_INDEX`/`PIP_FIND_LINKS` in the process's
//! `env`: a real install that needs no network.

use crate::support;
use bmx::wire::types::*;
use bmx::wire::Method;
use support::*;

/// A minimal pure-Python wheel `bmxtiny-1.0` in `dir`.
fn build_wheel(dir: &std::path::Path) {
    let script = r#"
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1] + '/bmxtiny-1.0-py3-none-any.whl', 'w')
z.writestr('bmxtiny/__init__.py', 'X = 42\n')
z.writestr('bmxtiny-1.0.dist-info/METADATA', 'Metadata-Version: 2.1\nName: bmxtiny\nVersion: 1.0\n')
z.writestr('bmxtiny-1.0.dist-info/WHEEL', 'Wheel-Version: 1.0\nGenerator: bmx-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n')
z.writestr('bmxtiny-1.0.dist-info/RECORD', 'bmxtiny/__init__.py,,\nbmxtiny-1.0.dist-info/METADATA,,\nbmxtiny-1.0.dist-info/WHEEL,,\nbmxtiny-1.0.dist-info/RECORD,,\n')
z.close()
"#;
    let st = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(dir)
        .status()
        .expect("python3 runs");
    assert!(st.success(), "wheel built");
}

fn install(session: &str, process: &str, manager: &str, packages: &[&str]) -> ProcessStartParams {
    ProcessStartParams {
        package_install: Some(ProcessPackageInstall {
            manager: manager.into(),
            packages: packages.iter().map(|s| s.to_string()).collect(),
        }),
        ..start_params(session, process, &[])
    }
}

/// Read a stream to EOF.
async fn read_all(rig: &Rig, s: &str, p: &str, stream: Stream) -> (Vec<u8>, ProcessReadResult) {
    let mut out = Vec::new();
    let mut cursor = 0;
    loop {
        let r: ProcessReadResult = rig
            .conn
            .call(
                Method::ProcessRead,
                &read_params(s, p, stream, cursor, 10_000),
            )
            .await
            .expect("process.read");
        out.extend_from_slice(r.data.as_slice());
        cursor = r.next_cursor;
        if r.eof {
            return (out, r);
        }
    }
}

#[tokio::test]
async fn pip_installs_into_the_workspace_and_streams_its_output() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    // The local index is in the session's workspace: its sandbox reads
    // nothing of the host's temp dir (issue 48).
    let links = rig.work.path().join("sessions/s/wheels");
    std::fs::create_dir(&links).unwrap();
    build_wheel(&links);
    let mut p = install("s", "pip", "pip", &["bmxtiny==1.0"]);
    p.env = Some(
        [
            ("PIP_NO_INDEX".to_string(), "1".to_string()),
            (
                "PIP_FIND_LINKS".to_string(),
                links.to_string_lossy().into_owned(),
            ),
        ]
        .into(),
    );
    let st: ProcessState = rig
        .conn
        .call(Method::ProcessStart, &p)
        .await
        .expect("process.start");
    assert!(st.accepted && st.pid.is_some(), "{st:?}");
    let first_pid = st.pid;
    let (out, end) = read_all(&rig, "s", "pip", Stream::Stdout).await;
    let out = String::from_utf8_lossy(&out);
    let (err, _) = read_all(&rig, "s", "pip", Stream::Stderr).await;
    assert_eq!(
        (end.state, end.exit_code),
        (ProcState::Exited, Some(0)),
        "stdout {out}\nstderr {}",
        String::from_utf8_lossy(&err)
    );
    assert!(out.contains("Successfully installed bmxtiny-1.0"), "{out}");

    // Importable by a later process of the session, from the documented
    // place in the workspace.
    let check = ProcessStartParams {
        env: Some([("PYTHONPATH".to_string(), ".packages/python".to_string())].into()),
        wait_ms: Some(20_000),
        ..start_params(
            "s",
            "check",
            &["python3", "-c", "import bmxtiny; print(bmxtiny.X)"],
        )
    };
    let st: ProcessState = rig.conn.call(Method::ProcessStart, &check).await.unwrap();
    let (out, _) = read_all(&rig, "s", "check", Stream::Stdout).await;
    assert_eq!((st.exit_code, &out[..]), (Some(0), &b"42\n"[..]));

    // Idempotent by processId: the same install again is the same process.
    let again: ProcessState = rig.conn.call(Method::ProcessStart, &p).await.unwrap();
    assert_eq!(again.pid, first_pid);
    assert_eq!(end_pid(&rig, "s", "pip").await, first_pid);
    rig.shutdown().await;
}

async fn end_pid(rig: &Rig, s: &str, p: &str) -> Option<u32> {
    let list: ProcessListResult = rig
        .conn
        .call(
            Method::ProcessList,
            &SessionRefParams {
                session_id: s.into(),
            },
        )
        .await
        .unwrap();
    list.processes
        .into_iter()
        .find(|x| x.process_id == p)
        .and_then(|x| x.pid)
}

#[tokio::test]
async fn bad_installs_are_refused_before_anything_runs() {
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let cases = [
        install("s", "a", "pip", &["; rm -rf /"]),
        install("s", "b", "npm", &["; rm -rf /"]),
        install("s", "c", "apt", &["; rm -rf /"]),
        install("s", "d", "pip", &["--index-url=http://evil.invalid/"]),
        install("s", "e", "pip", &["six", "$(id)"]),
        install("s", "f", "brew", &["six"]),
        install("s", "g", "pip", &[]),
        // The caller's argv with an install: the executor builds the argv.
        ProcessStartParams {
            argv: vec!["sh".into(), "-c".into(), "echo hi".into()],
            ..install("s", "h", "pip", &["six"])
        },
    ];
    for p in cases {
        let e = rig
            .conn
            .call::<_, ProcessState>(Method::ProcessStart, &p)
            .await
            .expect_err("refused");
        assert_eq!(e.code, -32602, "{} {e:?}", p.process_id);
        assert_eq!(e.reason(), Some("invalid_package_install"), "{e:?}");
    }
    let detail = rig
        .conn
        .call::<_, ProcessState>(
            Method::ProcessStart,
            &install("s", "a", "pip", &["; rm -rf /"]),
        )
        .await
        .unwrap_err()
        .data
        .and_then(|d| d.detail)
        .unwrap_or_default();
    assert!(detail.contains("not a valid pip package"), "{detail}");
    // Nothing was started.
    let list: ProcessListResult = rig
        .conn
        .call(
            Method::ProcessList,
            &SessionRefParams {
                session_id: "s".into(),
            },
        )
        .await
        .unwrap();
    assert!(list.processes.is_empty(), "{:?}", list.processes);
    rig.shutdown().await;
}

#[tokio::test]
async fn package_install_is_advertised() {
    let mut stand_in = stand_in(Options::default()).await;
    let work = tempfile::tempdir().unwrap();
    let executor = bmx::executor::Executor::start(stand_in.config(work.path()))
        .await
        .unwrap();
    let mut conn = stand_in.next_conn().await;
    let reg = conn.register(10_000, 30_000).await;
    let process = reg.capabilities.process.expect("process capability");
    assert!(process.package_install);
    // Not configured with a credential file: not offered.
    assert!(!process.git_credentials);
    executor.shutdown().await;
}

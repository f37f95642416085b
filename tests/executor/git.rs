//! Issue 15: `process.start.gitCredentials` through the real executor: a
//! real `git clone` over HTTP from a server in this test that runs the real
//! `git http-backend` as CGI behind Basic auth. With the credential the
//! clone works; without it, it fails; the `GIT_ASKPASS` helper is gone when
//! the process has ended; the token is in no process environment and in
//! none of the executor's log lines at trace level.

use crate::support;
use bmx::wire::types::*;
use bmx::wire::Method;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use support::*;

const USER: &str = "bob";
/// Unique enough to be searched for in logs and environments.
const TOKEN: &str = "tok-5e3c1a9f0b7d4e2a8c6f";

/// Every log line of the executor (in this process), at trace level.
fn log() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .init();
        buf
    })
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn git(dir: &Path, args: &[&str]) {
    let st = std::process::Command::new("git")
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .status()
        .expect("git runs");
    assert!(st.success(), "git {args:?}");
}

/// A bare repository `repo.git` under `root` with one commit.
fn make_repo(root: &Path) {
    let src = root.join("src");
    std::fs::create_dir(&src).unwrap();
    git(&src, &["init", "-q", "-b", "main"]);
    std::fs::write(src.join("hello.txt"), "hello from the remote\n").unwrap();
    git(&src, &["add", "hello.txt"]);
    git(&src, &["commit", "-q", "-m", "first"]);
    git(root, &["clone", "-q", "--bare", "src", "srv/repo.git"]);
}

/// An HTTP/1.1 server running `git http-backend` for every request with
/// the right Basic credential, 401 for every other. Counts both.
struct GitServer {
    port: u16,
    authorized: Arc<AtomicUsize>,
    refused: Arc<AtomicUsize>,
}

fn serve(project_root: PathBuf) -> GitServer {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let authorized = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let expected = format!(
        "Basic {}",
        base64_simd::STANDARD.encode_to_string(format!("{USER}:{TOKEN}"))
    );
    let (a, r) = (authorized.clone(), refused.clone());
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let (root, expected, a, r) =
                (project_root.clone(), expected.clone(), a.clone(), r.clone());
            std::thread::spawn(move || {
                let _ = handle(conn, &root, &expected, &a, &r);
            });
        }
    });
    GitServer {
        port,
        authorized,
        refused,
    }
}

fn handle(
    conn: TcpStream,
    root: &Path,
    expected: &str,
    authorized: &AtomicUsize,
    refused: &AtomicUsize,
) -> std::io::Result<()> {
    conn.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut out = conn;
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or("").to_owned(),
        parts.next().unwrap_or("").to_owned(),
    );
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.trim_end().split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let body = if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let mut body = Vec::new();
        loop {
            let mut size = String::new();
            reader.read_line(&mut size)?;
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16)
                .unwrap_or(0);
            let mut chunk = vec![0; n + 2];
            reader.read_exact(&mut chunk)?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
        body
    } else {
        let n: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0; n];
        reader.read_exact(&mut body)?;
        body
    };
    if header("authorization").as_deref() != Some(expected) {
        refused.fetch_add(1, Ordering::SeqCst);
        out.write_all(
            b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"git\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )?;
        return Ok(());
    }
    authorized.fetch_add(1, Ordering::SeqCst);
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let mut cmd = std::process::Command::new("git");
    cmd.arg("http-backend")
        .env("GIT_PROJECT_ROOT", root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("REQUEST_METHOD", &method)
        .env("PATH_INFO", path)
        .env("QUERY_STRING", query)
        .env("CONTENT_LENGTH", body.len().to_string())
        .env("REMOTE_USER", USER)
        .env("REMOTE_ADDR", "127.0.0.1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    if let Some(t) = header("content-type") {
        cmd.env("CONTENT_TYPE", t);
    }
    if let Some(e) = header("content-encoding") {
        cmd.env("HTTP_CONTENT_ENCODING", e);
    }
    if let Some(p) = header("git-protocol") {
        cmd.env("GIT_PROTOCOL", p);
    }
    let mut child = cmd.spawn()?;
    let mut stdin = child.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(&body);
    });
    let output = child.wait_with_output()?;
    let _ = feeder.join();
    let cgi = output.stdout;
    let split = cgi
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4))
        .or_else(|| cgi.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2)));
    let Some((at, sep)) = split else {
        out.write_all(b"HTTP/1.1 500 Bad CGI\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
        return Ok(());
    };
    let head = String::from_utf8_lossy(&cgi[..at]).into_owned();
    let mut status = "200 OK".to_owned();
    let mut response = Vec::new();
    let mut lines = Vec::new();
    for l in head.lines() {
        match l.split_once(':') {
            Some((k, v)) if k.eq_ignore_ascii_case("status") => status = v.trim().to_owned(),
            _ => lines.push(l.to_owned()),
        }
    }
    let payload = &cgi[at + sep..];
    response.extend_from_slice(format!("HTTP/1.1 {status}\r\n").as_bytes());
    for l in lines {
        response.extend_from_slice(format!("{l}\r\n").as_bytes());
    }
    response.extend_from_slice(
        format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            payload.len()
        )
        .as_bytes(),
    );
    response.extend_from_slice(payload);
    out.write_all(&response)
}

fn credential_file(dir: &Path, host: &str, expires_at: &str) -> PathBuf {
    let f = dir.join(format!("creds-{}.json", host.replace(':', "_")));
    std::fs::write(
        &f,
        format!(
            r#"{{"credentials":[{{"host":"{host}","username":"{USER}","password":"{TOKEN}","expiresAt":"{expires_at}"}}]}}"#
        ),
    )
    .unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
    f
}

/// A clone of the test's remote into `dest` that prints its environment
/// first; no system or global git config, no terminal prompt.
fn clone_params(process_id: &str, port: u16, dest: &str, credentials: bool) -> ProcessStartParams {
    let script = format!(
        "env; echo ---; git clone -q http://127.0.0.1:{port}/repo.git {dest} && cat {dest}/hello.txt"
    );
    ProcessStartParams {
        git_credentials: credentials,
        wait_ms: Some(25_000),
        env: Some(
            [
                ("GIT_CONFIG_NOSYSTEM", "1"),
                ("GIT_CONFIG_GLOBAL", "/dev/null"),
                ("GIT_TERMINAL_PROMPT", "0"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into(),
        ),
        ..start_params("s", process_id, &["sh", "-c", &script])
    }
}

async fn run(rig: &Rig, p: &ProcessStartParams) -> (ProcessState, String, String) {
    let st: ProcessState = rig
        .conn
        .call(Method::ProcessStart, p)
        .await
        .expect("process.start");
    let mut texts = Vec::new();
    for stream in [Stream::Stdout, Stream::Stderr] {
        let mut out = Vec::new();
        let mut cursor = 0;
        loop {
            let r: ProcessReadResult = rig
                .conn
                .call(
                    Method::ProcessRead,
                    &read_params("s", &p.process_id, stream, cursor, 10_000),
                )
                .await
                .expect("process.read");
            out.extend_from_slice(r.data.as_slice());
            cursor = r.next_cursor;
            if r.eof {
                break;
            }
        }
        texts.push(String::from_utf8_lossy(&out).into_owned());
    }
    let err = texts.pop().unwrap();
    (st, texts.pop().unwrap(), err)
}

#[tokio::test]
async fn clone_with_the_granted_credential_and_not_without() {
    let log = log();
    let root = tempfile::tempdir().unwrap();
    make_repo(root.path());
    let server = serve(root.path().join("srv"));
    let host = format!("127.0.0.1:{}", server.port);
    let creds = credential_file(root.path(), &host, "2999-01-01T00:00:00Z");
    let rig = Rig::start_with(Options::default(), |c| c.git_credentials = Some(creds)).await;
    rig.assign("s").await;

    // With the credential: the clone works.
    let (st, out, err) = run(&rig, &clone_params("with", server.port, "a", true)).await;
    assert_eq!(
        (st.state, st.exit_code),
        (ProcState::Exited, Some(0)),
        "stdout {out}\nstderr {err}"
    );
    assert!(out.ends_with("hello from the remote\n"), "{out}");
    assert!(server.authorized.load(Ordering::SeqCst) > 0);
    // The helper was this process's, by path only; gone now it has ended.
    let helper = out
        .lines()
        .find_map(|l| l.strip_prefix("GIT_ASKPASS="))
        .expect("GIT_ASKPASS in the process's environment");
    let helper_dir = Path::new(helper).parent().unwrap().to_owned();
    assert!(
        helper_dir.starts_with(std::env::temp_dir()),
        "{}",
        helper_dir.display()
    );
    assert!(
        !helper_dir.exists(),
        "helper left behind: {}",
        helper_dir.display()
    );
    assert!(!out.contains(TOKEN), "the token is in the environment");

    // Without it: refused by the server, the clone fails, and a process
    // without the flag has no helper.
    let refused_before = server.refused.load(Ordering::SeqCst);
    let (st, out, err) = run(&rig, &clone_params("without", server.port, "b", false)).await;
    assert_eq!(st.state, ProcState::Exited);
    assert_ne!(st.exit_code, Some(0), "cloned without a credential: {out}");
    assert!(!out.contains("GIT_ASKPASS="), "{out}");
    assert!(
        server.refused.load(Ordering::SeqCst) > refused_before,
        "the server never saw the attempt: {err}"
    );
    assert!(!rig.work.path().join("sessions/s/b/hello.txt").exists());

    rig.shutdown().await;
    let logged = String::from_utf8_lossy(&log.lock().unwrap()).into_owned();
    // The log is real (the executor did log at trace level) and clean.
    assert!(!logged.is_empty(), "no log lines captured");
    assert!(
        !logged.contains(TOKEN),
        "the token is in the executor's log"
    );
}

#[tokio::test]
async fn a_credential_for_another_host_or_expired_is_not_given() {
    let _ = log();
    let root = tempfile::tempdir().unwrap();
    make_repo(root.path());
    let server = serve(root.path().join("srv"));

    // For another host: the helper answers nothing, the clone fails.
    let other = credential_file(root.path(), "127.0.0.1:1", "2999-01-01T00:00:00Z");
    let rig = Rig::start_with(Options::default(), |c| c.git_credentials = Some(other)).await;
    rig.assign("s").await;
    let (st, out, _) = run(&rig, &clone_params("other", server.port, "a", true)).await;
    assert_eq!(st.state, ProcState::Exited);
    assert_ne!(st.exit_code, Some(0), "{out}");
    assert_eq!(server.authorized.load(Ordering::SeqCst), 0);
    rig.shutdown().await;

    // Expired: not granted; the spawn fails with the reason.
    let host = format!("127.0.0.1:{}", server.port);
    let expired = credential_file(root.path(), &host, "2000-01-01T00:00:00Z");
    let rig = Rig::start_with(Options::default(), |c| c.git_credentials = Some(expired)).await;
    rig.assign("s").await;
    let st: ProcessState = rig
        .conn
        .call(
            Method::ProcessStart,
            &clone_params("expired", server.port, "b", true),
        )
        .await
        .unwrap();
    assert_eq!(st.state, ProcState::Failed);
    assert_eq!(st.reason.as_deref(), Some("spawn_failed"));
    assert!(
        st.message
            .as_deref()
            .unwrap_or("")
            .contains("no unexpired git credential"),
        "{st:?}"
    );
    assert!(!format!("{st:?}").contains(TOKEN));
    rig.shutdown().await;
}

#[tokio::test]
async fn not_configured_is_not_offered() {
    let _ = log();
    let rig = Rig::start(Options::default()).await;
    rig.assign("s").await;
    let e = rig
        .conn
        .call::<_, ProcessState>(Method::ProcessStart, &clone_params("x", 1, "a", true))
        .await
        .expect_err("refused");
    assert_eq!(e.code, -32012, "{e:?}");
    rig.shutdown().await;
}

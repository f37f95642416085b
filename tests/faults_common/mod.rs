//! Shared by the fault tests: a TCP proxy between the executor and the
//! harness that the test can cut (RST) or turn into a black hole, and the
//! real `bmx executor` binary as a child killed on drop.
#![allow(dead_code)]

pub mod chaos;

use bmx::harness::{Harness, HarnessHandle};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub const BMX: &str = env!("CARGO_BIN_EXE_bmx");

/// A harness on 127.0.0.1:0 with one executor token.
pub async fn harness(executor_id: &str, token: &str, lease_ttl_ms: u64) -> HarnessHandle {
    Harness::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .token(executor_id, token)
        .heartbeat_ms(500)
        .lease_ttl_ms(lease_ttl_ms)
        .build()
        .await
        .expect("harness starts")
}

/// The `host:port` of a `ws://host:port/...` URL.
pub fn ws_addr(url: &str) -> SocketAddr {
    let rest = url.strip_prefix("ws://").expect("a ws:// url");
    rest.split('/').next().unwrap().parse().unwrap()
}

#[derive(Default)]
struct ProxyState {
    /// The tasks piping the live connections; aborting them drops the
    /// sockets (with SO_LINGER 0: an RST on both sides).
    pipes: Mutex<Vec<JoinHandle<()>>>,
    /// While set, bytes from the harness to the executor are read and
    /// dropped (kept in `swallowed`), as a network that loses them would.
    black_hole: AtomicBool,
    swallowed: Mutex<Vec<u8>>,
    /// The same, from the executor to the harness.
    black_hole_up: AtomicBool,
    swallowed_up: Mutex<Vec<u8>>,
}

/// A TCP proxy: executors dial [`Proxy::url`], it dials the harness.
pub struct Proxy {
    pub addr: SocketAddr,
    state: Arc<ProxyState>,
    accept: JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.sever();
    }
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(ProxyState::default());
        let st = state.clone();
        let accept = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let Ok(up) = TcpStream::connect(upstream).await else {
                    continue;
                };
                // Linger 0: dropping the socket sends an RST (and never
                // blocks, the deprecation's concern).
                #[allow(deprecated)]
                let _ = down.set_linger(Some(Duration::ZERO));
                #[allow(deprecated)]
                let _ = up.set_linger(Some(Duration::ZERO));
                let _ = down.set_nodelay(true);
                let _ = up.set_nodelay(true);
                let s = st.clone();
                let pipe = tokio::spawn(async move {
                    let (mut down_r, mut down_w) = down.into_split();
                    let (mut up_r, mut up_w) = up.into_split();
                    let to_harness = async {
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            let n = match down_r.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if s.black_hole_up.load(Ordering::SeqCst) {
                                s.swallowed_up.lock().unwrap().extend_from_slice(&buf[..n]);
                                continue;
                            }
                            if up_w.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    };
                    let to_executor = async {
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            let n = match up_r.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if s.black_hole.load(Ordering::SeqCst) {
                                s.swallowed.lock().unwrap().extend_from_slice(&buf[..n]);
                                continue;
                            }
                            if down_w.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    };
                    // Either direction ending ends the connection.
                    tokio::select! {
                        _ = to_harness => {}
                        _ = to_executor => {}
                    }
                });
                st.pipes.lock().unwrap().push(pipe);
            }
        });
        Proxy {
            addr,
            state,
            accept,
        }
    }

    pub fn url(&self) -> String {
        format!("ws://{}/v1/executor/connect", self.addr)
    }

    /// Cut every live connection (RST both ways); new ones go through.
    pub fn sever(&self) {
        for p in self.state.pipes.lock().unwrap().drain(..) {
            p.abort();
        }
    }

    pub fn black_hole(&self, on: bool) {
        self.state.black_hole.store(on, Ordering::SeqCst);
    }

    /// Swallow what the executor sends (see [`Proxy::black_hole`]).
    pub fn black_hole_up(&self, on: bool) {
        self.state.black_hole_up.store(on, Ordering::SeqCst);
    }

    /// Whether the bytes swallowed on their way up contain `needle`.
    pub fn swallowed_up_contains(&self, needle: &str) -> bool {
        let s = self.state.swallowed_up.lock().unwrap();
        s.windows(needle.len()).any(|w| w == needle.as_bytes())
    }

    /// Whether the bytes swallowed so far contain `needle`.
    pub fn swallowed_contains(&self, needle: &str) -> bool {
        let s = self.state.swallowed.lock().unwrap();
        s.windows(needle.len()).any(|w| w == needle.as_bytes())
    }
}

/// The real `bmx executor`, killed (and reaped) on drop.
pub struct ExecutorProc {
    pub child: Option<std::process::Child>,
}

impl ExecutorProc {
    pub fn spawn(url: &str, token: &str, work_root: &std::path::Path) -> ExecutorProc {
        Self::spawn_with(url, token, work_root, &[])
    }

    pub fn spawn_with(
        url: &str,
        token: &str,
        work_root: &std::path::Path,
        extra: &[&str],
    ) -> ExecutorProc {
        let child = std::process::Command::new(BMX)
            .args(["executor", "--url", url, "--token", token, "--work-root"])
            .arg(work_root)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .spawn()
            .expect("bmx executor starts");
        ExecutorProc { child: Some(child) }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }
}

impl Drop for ExecutorProc {
    /// SIGTERM (the daemon ends its sessions and their processes), then
    /// SIGKILL if it is still there after 10 s.
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(c.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One scrape of a `/metrics` endpoint: `name{labels}` → value.
pub async fn scrape(url: &str) -> std::collections::HashMap<String, f64> {
    let resp = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("metrics answer");
    assert_eq!(resp.status(), 200);
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");
    let text = resp.text().await.unwrap();
    assert!(
        text.trim_end().ends_with("# EOF"),
        "OpenMetrics ends with # EOF"
    );
    let mut out = std::collections::HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (name, value) = line.rsplit_once(' ').expect("name value");
        out.insert(name.to_owned(), value.parse::<f64>().expect("a number"));
    }
    out
}

/// A loopback port free a moment ago (for `--metrics-listen`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether a pid is alive (not gone, not a zombie).
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rfind(')').and_then(|i| s[i + 2..].chars().next()) != Some('Z'))
        .unwrap_or(false)
}

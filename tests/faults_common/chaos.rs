//! A TCP proxy that breaks the connection between the executor and the
//! harness at random, from a seed: RST, FIN, half-close, stalls and
//! delays. Used by the soak (`tests/faults/soak.rs`).
//!
//! Each proxied connection is one task that owns both sockets, so a fault
//! is applied whole: an RST really is an RST (the halves are reunited and
//! dropped with `SO_LINGER 0`, no FIN first), a FIN is a graceful
//! shutdown of both directions, a half-close shuts one direction only and
//! keeps piping the other until its peer gives up.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// One fault, applied to the newest live connection.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    Rst,
    Fin,
    /// FIN in one direction only (`true`: towards the executor).
    HalfClose(bool),
    /// Nothing forwarded either way for this long.
    Stall(Duration),
    /// Every chunk waits this long, for the second duration.
    Delay(Duration, Duration),
}

/// What the chaos did, for the soak's report.
#[derive(Debug, Default)]
pub struct Counts {
    pub connections: AtomicU64,
    pub rst: AtomicU64,
    pub fin: AtomicU64,
    pub half_close: AtomicU64,
    pub stall: AtomicU64,
    pub delay: AtomicU64,
    /// Faults drawn while no connection was up (nothing to break).
    pub idle: AtomicU64,
}

impl Counts {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    /// Connections broken (RST, FIN, half-close).
    pub fn cuts(&self) -> u64 {
        Self::get(&self.rst) + Self::get(&self.fin) + Self::get(&self.half_close)
    }
}

struct Live {
    faults: mpsc::UnboundedSender<Fault>,
    task: JoinHandle<()>,
}

/// The proxy: executors dial [`ChaosProxy::url`], it dials `upstream`.
pub struct ChaosProxy {
    pub addr: SocketAddr,
    pub counts: Arc<Counts>,
    live: Arc<Mutex<Vec<Live>>>,
    accept: JoinHandle<()>,
    chaos: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for ChaosProxy {
    fn drop(&mut self) {
        self.accept.abort();
        if let Some(c) = self.chaos.lock().unwrap().take() {
            c.abort();
        }
        for l in self.live.lock().unwrap().drain(..) {
            l.task.abort();
        }
    }
}

impl ChaosProxy {
    pub async fn start(upstream: SocketAddr) -> ChaosProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let live: Arc<Mutex<Vec<Live>>> = Arc::default();
        let counts: Arc<Counts> = Arc::default();
        let (l, c) = (live.clone(), counts.clone());
        let accept = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let Ok(up) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let _ = down.set_nodelay(true);
                let _ = up.set_nodelay(true);
                c.connections.fetch_add(1, Ordering::Relaxed);
                let (tx, rx) = mpsc::unbounded_channel();
                let task = tokio::spawn(pipe(down, up, rx));
                let mut l = l.lock().unwrap();
                l.retain(|x| !x.task.is_finished());
                l.push(Live { faults: tx, task });
            }
        });
        ChaosProxy {
            addr,
            counts,
            live,
            accept,
            chaos: Mutex::new(None),
        }
    }

    pub fn url(&self) -> String {
        format!("ws://{}/v1/executor/connect", self.addr)
    }

    /// Apply `fault` to the newest live connection; `false` when none is.
    pub fn inject(&self, fault: Fault) -> bool {
        let l = self.live.lock().unwrap();
        match l.iter().rev().find(|x| !x.task.is_finished()) {
            Some(x) => x.faults.send(fault).is_ok(),
            None => false,
        }
    }

    /// Break things at random every 0.2–2 s, drawn from `seed`.
    pub fn run_chaos(self: &Arc<Self>, seed: u64) {
        let me = Arc::downgrade(self);
        let task = tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed);
            loop {
                let wait = Duration::from_millis(rng.random_range(200..2000));
                tokio::time::sleep(wait).await;
                let fault = match rng.random_range(0..100) {
                    0..30 => Fault::Rst,
                    30..50 => Fault::Fin,
                    50..62 => Fault::HalfClose(rng.random_bool(0.5)),
                    62..82 => Fault::Stall(Duration::from_millis(rng.random_range(300..4000))),
                    _ => Fault::Delay(
                        Duration::from_millis(rng.random_range(5..250)),
                        Duration::from_millis(rng.random_range(500..5000)),
                    ),
                };
                let Some(me) = me.upgrade() else { return };
                let counter = match fault {
                    Fault::Rst => &me.counts.rst,
                    Fault::Fin => &me.counts.fin,
                    Fault::HalfClose(_) => &me.counts.half_close,
                    Fault::Stall(_) => &me.counts.stall,
                    Fault::Delay(..) => &me.counts.delay,
                };
                if me.inject(fault) {
                    counter.fetch_add(1, Ordering::Relaxed);
                } else {
                    me.counts.idle.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        *self.chaos.lock().unwrap() = Some(task);
    }

    /// Stop breaking things (live connections stay as they are).
    pub fn stop_chaos(&self) {
        if let Some(c) = self.chaos.lock().unwrap().take() {
            c.abort();
        }
    }
}

/// Drop both sockets with `SO_LINGER 0`: an RST, no FIN before it.
fn reset(dr: OwnedReadHalf, dw: OwnedWriteHalf, ur: OwnedReadHalf, uw: OwnedWriteHalf) {
    for s in [dr.reunite(dw), ur.reunite(uw)].into_iter().flatten() {
        #[allow(deprecated)]
        let _ = s.set_linger(Some(Duration::ZERO));
    }
}

async fn pipe(down: TcpStream, up: TcpStream, mut faults: mpsc::UnboundedReceiver<Fault>) {
    let (mut dr, mut dw) = down.into_split();
    let (mut ur, mut uw) = up.into_split();
    let mut b1 = vec![0u8; 64 << 10];
    let mut b2 = vec![0u8; 64 << 10];
    let mut delay: Option<(Duration, Instant)> = None;
    // Set by a half-close or a FIN: the connection ends by this time at
    // the latest (then with an RST), whatever the peers do.
    let mut doom: Option<Instant> = None;
    let (mut down_open, mut up_open) = (true, true);
    loop {
        let doomed = async {
            match doom {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        // From the executor, to the harness; and back.
        let (from_exec, n) = tokio::select! {
            f = faults.recv() => {
                match f {
                    None | Some(Fault::Rst) => return reset(dr, dw, ur, uw),
                    Some(Fault::Fin) => {
                        let _ = dw.shutdown().await;
                        let _ = uw.shutdown().await;
                        doom.get_or_insert(Instant::now() + Duration::from_secs(3));
                    }
                    Some(Fault::HalfClose(to_executor)) => {
                        if to_executor {
                            let _ = dw.shutdown().await;
                        } else {
                            let _ = uw.shutdown().await;
                        }
                        doom.get_or_insert(Instant::now() + Duration::from_secs(5));
                    }
                    Some(Fault::Stall(d)) => tokio::time::sleep(d).await,
                    Some(Fault::Delay(d, span)) => delay = Some((d, Instant::now() + span)),
                }
                continue;
            }
            _ = doomed => return reset(dr, dw, ur, uw),
            r = dr.read(&mut b1), if down_open => (true, r),
            r = ur.read(&mut b2), if up_open => (false, r),
        };
        let n = match n {
            Ok(0) | Err(_) => {
                // One side is done: pass its FIN on, and end when both are.
                if from_exec {
                    down_open = false;
                    let _ = uw.shutdown().await;
                } else {
                    up_open = false;
                    let _ = dw.shutdown().await;
                }
                if !down_open && !up_open {
                    return;
                }
                doom.get_or_insert(Instant::now() + Duration::from_secs(5));
                continue;
            }
            Ok(n) => n,
        };
        if let Some((d, until)) = delay {
            if Instant::now() < until {
                tokio::time::sleep(d).await;
            } else {
                delay = None;
            }
        }
        let ok = if from_exec {
            uw.write_all(&b1[..n]).await.is_ok()
        } else {
            dw.write_all(&b2[..n]).await.is_ok()
        };
        if !ok {
            return reset(dr, dw, ur, uw);
        }
    }
}

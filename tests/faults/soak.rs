//! Issue 19, "must build": the fault-injection soak.
//!
//! The real `bmx executor` binary dials the in-process harness through a
//! proxy ([`faults_common::chaos`]) that, from a seed it prints, cuts the
//! connection (RST, FIN), half-closes it, stalls it and delays it at
//! random every 0.2–2 s. Meanwhile, through the harness's HTTP API:
//!
//! - a process prints a known pattern (line `i` is `i` in 15 digits and a
//!   newline) and a reader checks every byte it gets against it; a `gap`
//!   the executor reports is counted, a byte out of place fails the test;
//! - workers post bash tool calls, each appending its own id to a file;
//!   every call must be answered before a client deadline far above the
//!   lease TTL (a call past it is a hang, and fails the test), and at the
//!   end every id must be in the file exactly once (no duplicate, no loss);
//! - a terminal (`cat`) is attached again and again and must echo;
//! - at the end nothing of the session is left: no process below the
//!   executor, none carrying the session's scope tag, none after the
//!   executor's exit.
//!
//! `BMX_SOAK_SEED` replays a run, `BMX_SOAK_SECS` sets its length (default
//! 60 s: the CI form). The figures are printed as one `soak:` line.

use crate::faults_common;
use bmx::client::{ApiClient, AttachOptions, ClientError};
use bmx::terminal::frame::{self, OP_INPUT, OP_OUTPUT, OP_SNAPSHOT};
use faults_common::chaos::{ChaosProxy, Counts};
use faults_common::{alive, harness, scrape, ws_addr, ExecutorProc};
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;

/// Far above the lease TTL: an answer can always come before it.
const LEASE_TTL_MS: u64 = 20_000;
const CALL_DEADLINE: Duration = Duration::from_secs(90);
const WORKERS: usize = 12;
const LINE: u64 = 16;
/// The pattern's byte at stream offset `at`.
fn expected(at: u64) -> u8 {
    let line = at / LINE;
    let col = (at % LINE) as usize;
    if col == 15 {
        b'\n'
    } else {
        format!("{line:015}").as_bytes()[col]
    }
}

#[derive(Default)]
struct Figures {
    calls: AtomicU64,
    /// Error answers that were posted again with the same id.
    call_retries: AtomicU64,
    hangs: AtomicU64,
    bytes: AtomicU64,
    gaps: AtomicU64,
    gap_bytes: AtomicU64,
    read_errors: AtomicU64,
    term_echoes: AtomicU64,
    term_retries: AtomicU64,
    /// The refusals that were posted again, by status and reason.
    refusals: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_under_random_cuts_stalls_and_delays() {
    let seed = env_u64("BMX_SOAK_SEED").unwrap_or_else(rand::random);
    let secs = env_u64("BMX_SOAK_SECS").unwrap_or(60);
    println!("soak: seed {seed} ({secs} s); replay with BMX_SOAK_SEED={seed}");
    eprintln!("soak: seed {seed} ({secs} s); replay with BMX_SOAK_SEED={seed}");

    let h = harness("exec-soak", "tok-soak", LEASE_TTL_MS).await;
    let proxy = Arc::new(ChaosProxy::start(ws_addr(&h.executor_url())).await);
    let work = tempfile::tempdir().unwrap();
    // The ledger is in the session's workspace: its sandbox writes
    // nowhere else (issue 48).
    let ledger = work
        .path()
        .join("sessions")
        .join(format!("soak-{}", std::process::id()))
        .join("calls.txt");
    let mut executor = ExecutorProc::spawn_with(
        &proxy.url(),
        "tok-soak",
        work.path(),
        &["--process-buffer-bytes", "16777216"],
    );
    let exec_pid = executor.pid();
    assert!(
        h.wait_for_executor(Some("exec-soak"), Duration::from_secs(20))
            .await,
        "the executor registers through the proxy"
    );
    let client = ApiClient::new(&h.api_url()).unwrap().timeout(CALL_DEADLINE);
    let sid = format!("soak-{}", std::process::id());
    let (status, s) = client
        .post("/v1/sessions", &json!({"sessionId": sid}))
        .await
        .unwrap();
    assert_eq!(status, 201, "{s}");
    let sessions = format!("/v1/sessions/{sid}");

    // The stream: ~1 MB/s, paced so a 16 MiB ring covers any outage.
    let gen = "BEGIN{for(i=0;;i++){printf \"%015d\\n\", i; \
               if(i%16384==16383){fflush(); system(\"sleep 0.25\")}}}";
    let (status, p) = client
        .post(
            &format!("{sessions}/processes"),
            &json!({"processId": "stream", "argv": ["awk", gen]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{p}");
    let term_id = format!("soak-term-{}", std::process::id());
    let (status, t) = client
        .open_terminal(
            "exec-soak",
            &json!({"terminalId": term_id, "argv": ["cat"]}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{t}");

    let figures = Arc::new(Figures::default());
    let stop = Arc::new(AtomicBool::new(false));
    proxy.run_chaos(seed);
    let started = Instant::now();
    let until = started + Duration::from_secs(secs);

    // Tool-call workers.
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let (client, figures, ledger) = (client.clone(), figures.clone(), ledger.clone());
        let path = format!("{sessions}/tools");
        workers.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut n = 0u64;
            while Instant::now() < until {
                let id = format!("c{w:02}-{n:06}");
                n += 1;
                let body = json!({"tool": "bash", "toolCallId": id,
                    "input": {"command": format!("echo {id} >> {}", ledger.display())}});
                let begun = Instant::now();
                loop {
                    match client.post(&path, &body).await {
                        Ok((200, v)) => {
                            assert_eq!(v["outcome"], "succeeded", "{id}: {v}");
                            break;
                        }
                        Ok((status, v)) => {
                            // An honest refusal while the executor is away:
                            // the platform posts the same id again.
                            assert!(
                                begun.elapsed() < CALL_DEADLINE,
                                "{id}: still refused after {CALL_DEADLINE:?}: {status} {v}"
                            );
                            figures.call_retries.fetch_add(1, Ordering::Relaxed);
                            let why = format!(
                                "{status} {}",
                                v["error"]["data"]["reason"].as_str().unwrap_or("-")
                            );
                            *figures.refusals.lock().unwrap().entry(why).or_default() += 1;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        Err(ClientError::Timeout(_)) => {
                            figures.hangs.fetch_add(1, Ordering::Relaxed);
                            eprintln!("soak: {id} hung past {CALL_DEADLINE:?}");
                            break;
                        }
                        Err(e) => panic!("{id}: {e}"),
                    }
                }
                figures.calls.fetch_add(1, Ordering::Relaxed);
                ids.push(id);
            }
            ids
        }));
    }

    // The stream reader: every byte checked against the pattern.
    let reader = {
        let (client, figures) = (client.clone(), figures.clone());
        let path = format!("{sessions}/processes/stream/output");
        tokio::spawn(async move {
            let mut cursor = 0u64;
            loop {
                let q =
                    format!("{path}?stream=stdout&cursor={cursor}&maxBytes=1048576&waitMs=2000");
                let v = match client.get(&q).await {
                    Ok((200, v)) => v,
                    Ok(_) => {
                        figures.read_errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    Err(ClientError::Timeout(_)) => {
                        figures.hangs.fetch_add(1, Ordering::Relaxed);
                        eprintln!("soak: a read at {cursor} hung past {CALL_DEADLINE:?}");
                        continue;
                    }
                    Err(e) => panic!("read at {cursor}: {e}"),
                };
                let from = v["fromCursor"].as_u64().unwrap();
                if v["gap"] == true {
                    assert!(from > cursor, "a gap moves forward: {v}");
                    figures.gaps.fetch_add(1, Ordering::Relaxed);
                    figures
                        .gap_bytes
                        .fetch_add(from - cursor, Ordering::Relaxed);
                } else {
                    assert_eq!(from, cursor, "no silent jump: {v}");
                }
                let data = base64_simd::STANDARD
                    .decode_to_vec(v["data"].as_str().unwrap_or_default())
                    .unwrap();
                for (i, b) in data.iter().enumerate() {
                    let at = from + i as u64;
                    assert_eq!(*b, expected(at), "byte {at} of the stream is wrong");
                }
                figures
                    .bytes
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                cursor = v["nextCursor"].as_u64().unwrap();
                assert_eq!(cursor, from + data.len() as u64, "{v}");
                if v["eof"] == true {
                    return cursor;
                }
            }
        })
    };

    // The terminal: attached again and again, it must echo each time.
    let terminal = {
        let (client, figures, stop) = (client.clone(), figures.clone(), stop.clone());
        let term_id = term_id.clone();
        tokio::spawn(async move {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let mark = format!("mark-{round}");
                let deadline = Instant::now() + CALL_DEADLINE;
                while !echoes(&client, &term_id, &mark).await {
                    assert!(
                        Instant::now() < deadline,
                        "the terminal did not echo {mark} within {CALL_DEADLINE:?}"
                    );
                    figures.term_retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                figures.term_echoes.fetch_add(1, Ordering::Relaxed);
                round += 1;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        })
    };

    let mut all_ids = Vec::new();
    for w in workers {
        all_ids.extend(w.await.unwrap());
    }
    proxy.stop_chaos();
    stop.store(true, Ordering::Relaxed);
    terminal.await.unwrap();
    let chaos_secs = started.elapsed().as_secs_f64();

    // End the stream and read it to its end.
    let (status, v) = client
        .post(
            &format!("{sessions}/processes/stream/terminate"),
            &json!({}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    let stream_end = tokio::time::timeout(CALL_DEADLINE, reader)
        .await
        .expect("the reader reaches eof")
        .unwrap();

    // Exactly once: every id in the ledger once, nothing else.
    let text = std::fs::read_to_string(&ledger).unwrap_or_default();
    let mut seen: HashMap<&str, u64> = HashMap::new();
    for l in text.lines() {
        *seen.entry(l.trim()).or_default() += 1;
    }
    let duplicates: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    let lost: Vec<_> = all_ids
        .iter()
        .filter(|id| !seen.contains_key(id.as_str()))
        .collect();
    let unknown = seen.len() + lost.len() - all_ids.len();

    let metrics = scrape(&format!("{}/metrics", h.api_url())).await;
    let reconnects: f64 = metrics
        .iter()
        .filter(|(k, _)| k.starts_with("bmx_harness_executor_connection_closes_total"))
        .map(|(_, v)| v)
        .sum();
    let resent: f64 = metrics
        .iter()
        .filter(|(k, _)| k.starts_with("bmx_harness_resent_requests_total"))
        .map(|(_, v)| v)
        .sum();

    // No orphans: the terminal and the session end, nothing stays.
    let (status, v) = client
        .delete(&format!("/v1/executors/exec-soak/terminals/{term_id}"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{v}");
    let (status, v) = client.delete(&sessions).await.unwrap();
    assert_eq!(status, 200, "{v}");
    let below = wait_empty(|| descendants(exec_pid)).await;
    let tagged = wait_empty(|| pids_tagged(&sid)).await;
    drop(executor.child.take().map(|mut c| {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        c.wait()
    }));
    let after_exit = wait_empty(|| pids_tagged(&sid)).await;

    let c = &proxy.counts;
    let f = &figures;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let report = format!(
        "soak: seed {seed}, {chaos_secs:.0} s: calls {}, hangs {}, duplicates {}, lost {}, \
         unknown {unknown}, refused-then-reposted {} {:?}; cuts {} (rst {}, fin {}, half-close {}), \
         stalls {}, delays {}, connections {}, reconnects {reconnects}, re-sent requests {resent}; \
         bytes verified {} of {stream_end}, gaps {} ({} bytes), read errors {}; \
         terminal echoes {} (retries {}); orphans: below {}, tagged {}, after exit {}",
        g(&f.calls),
        g(&f.hangs),
        duplicates.len(),
        lost.len(),
        g(&f.call_retries),
        f.refusals.lock().unwrap(),
        c.cuts(),
        Counts::get(&c.rst),
        Counts::get(&c.fin),
        Counts::get(&c.half_close),
        Counts::get(&c.stall),
        Counts::get(&c.delay),
        Counts::get(&c.connections),
        g(&f.bytes),
        g(&f.gaps),
        g(&f.gap_bytes),
        g(&f.read_errors),
        g(&f.term_echoes),
        g(&f.term_retries),
        below.len(),
        tagged.len(),
        after_exit.len(),
    );
    println!("{report}");
    eprintln!("{report}");

    assert_eq!(g(&f.hangs), 0, "no hung call: {report}");
    assert!(duplicates.is_empty(), "duplicates {duplicates:?}: {report}");
    assert!(lost.is_empty(), "lost {lost:?}: {report}");
    assert_eq!(unknown, 0, "lines no call wrote: {report}");
    assert!(g(&f.calls) >= 100, "the calls ran: {report}");
    assert!(c.cuts() > 0 && reconnects > 0.0, "the chaos cut: {report}");
    assert_eq!(
        g(&f.bytes) + g(&f.gap_bytes),
        stream_end,
        "every byte verified or reported lost: {report}"
    );
    assert!(g(&f.term_echoes) > 0, "the terminal echoed: {report}");
    assert!(below.is_empty(), "processes below the executor: {below:?}");
    assert!(tagged.is_empty(), "tagged processes left: {tagged:?}");
    assert!(after_exit.is_empty(), "left after exit: {after_exit:?}");
    drop(proxy);
    h.shutdown().await;
}

/// Attach as the writer, type `mark`, and wait for its echo (false when
/// the attach or the echo fails: the caller tries again).
async fn echoes(client: &ApiClient, term_id: &str, mark: &str) -> bool {
    let opts = AttachOptions {
        write: true,
        ..Default::default()
    };
    let attach = tokio::time::timeout(
        Duration::from_secs(15),
        client.attach_terminal("exec-soak", term_id, &opts),
    );
    let Ok(Ok(mut ws)) = attach.await else {
        return false;
    };
    let input = frame::frame(OP_INPUT, 0, format!("{mark}\n").as_bytes());
    if ws.send(Message::Binary(input)).await.is_err() {
        return false;
    }
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    let needle = format!("{mark}\r\n{mark}");
    loop {
        let m = match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(m))) => m,
            _ => return false,
        };
        if let Message::Binary(b) = m {
            if let Some((OP_OUTPUT | OP_SNAPSHOT, _, d)) = frame::parse(&b) {
                out.extend_from_slice(&d);
                // The PTY echoes the line, then `cat` prints it.
                if String::from_utf8_lossy(&out).contains(&needle) {
                    let _ = ws.close(None).await;
                    return true;
                }
            }
        } else if let Message::Close(_) = m {
            return false;
        }
    }
}

/// Every process below `root` (children of children ...).
fn descendants(root: i32) -> Vec<i32> {
    let mut parent: HashMap<i32, i32> = HashMap::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            let rest = &s[s.rfind(')').unwrap_or(0) + 2..];
            let mut f = rest.split(' ');
            let state = f.next().unwrap_or("");
            let ppid: i32 = f.next().and_then(|p| p.parse().ok()).unwrap_or(0);
            if state != "Z" {
                parent.insert(pid, ppid);
            }
        }
    }
    parent
        .keys()
        .copied()
        .filter(|&p| {
            let mut cur = p;
            for _ in 0..64 {
                match parent.get(&cur) {
                    Some(&pp) if pp == root => return true,
                    Some(&pp) if pp > 1 => cur = pp,
                    _ => return false,
                }
            }
            false
        })
        .collect()
}

/// Processes whose `BMX_SCOPE` names the session (or the soak's terminal).
fn pids_tagged(sid: &str) -> Vec<i32> {
    let needle = format!("/{sid}/");
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let hit = env.split(|b| *b == 0).any(|kv| {
            kv.starts_with(b"BMX_SCOPE=") && String::from_utf8_lossy(kv).contains(&needle)
        });
        if hit && alive(pid) {
            out.push(pid);
        }
    }
    out
}

/// Poll `list` for up to 15 s until it is empty; what is left then.
async fn wait_empty(list: impl Fn() -> Vec<i32>) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let l = list();
        if l.is_empty() || Instant::now() >= deadline {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

//! `bmx bench events`: what a durable store costs the agent event stream
//! (issue 17, docs/store.md "Session events").
//!
//! A simulated executor (a real WebSocket client on the project's `Link`,
//! answering as `bench harness`'s simulator does) sends `session.event`s
//! of one session to an in-process harness and checks every
//! acknowledgement (`accepted`, the sequence it sent). Measured per store:
//!
//! * **latency**: `--latency-events` events one at a time, each the time
//!   from the send to its acknowledgement;
//! * **rate**: `--events` events with `--in-flight` outstanding at once.
//!
//! The baseline in the same run is the same harness with no store (the
//! log in memory, acknowledged at once); the durable rows are the
//! embedded SQLite store in a temporary directory (what `bmx up` and
//! `bmx harness` run) and, with `--store postgres://…`, PostgreSQL. Each
//! row is the median of `--runs` runs, each on a fresh harness.

use super::harness::connect_with;
use bmx::harness::api::sessions::CreateSession;
use bmx::harness::store::{DurableState, PgStore, SqliteStore};
use bmx::harness::Harness;
use bmx::wire::types::SessionEventResult;
use bmx::wire::{Endpoint, Link, Method};
use futures_util::StreamExt;
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

const EXECUTOR: &str = "bench-events";
const SECRET: &str = "bench-events-secret";
/// Every call's deadline.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct EventsOptions {
    pub events: u64,
    pub latency_events: u64,
    pub in_flight: usize,
    pub runs: usize,
    /// A PostgreSQL URL for a third row.
    pub store: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct EventsRow {
    /// `memory` (the baseline), `sqlite` or `postgres`.
    pub store: &'static str,
    pub events_per_sec: f64,
    pub ack_p50_us: f64,
    pub ack_p99_us: f64,
    /// Rate over the baseline's (1.0 for the baseline).
    pub rate_ratio: f64,
    /// p50 latency over the baseline's.
    pub p50_ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct EventsReport {
    pub events: u64,
    pub latency_events: u64,
    pub in_flight: usize,
    pub runs: usize,
    pub rows: Vec<EventsRow>,
}

impl EventsReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "session.event acknowledgements: {} events with {} in flight; latency of {} one at a time; median of {} runs\n",
            self.events, self.in_flight, self.latency_events, self.runs
        );
        s.push_str("store      events/s   ratio   ack p50 µs  p99 µs  p50 ratio\n");
        for r in &self.rows {
            s.push_str(&format!(
                "{:<9} {:>9.0}  {:>6.2}  {:>10.0} {:>7.0}  {:>9.2}\n",
                r.store, r.events_per_sec, r.rate_ratio, r.ack_p50_us, r.ack_p99_us, r.p50_ratio
            ));
        }
        s
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Memory,
    Sqlite,
    Postgres,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Memory => "memory",
            Kind::Sqlite => "sqlite",
            Kind::Postgres => "postgres",
        }
    }
}

/// One run's figures: events/s, then the sorted latencies (µs).
struct Run {
    rate: f64,
    latencies: Vec<f64>,
}

pub async fn run(opts: &EventsOptions) -> Result<EventsReport, String> {
    let mut kinds = vec![Kind::Memory, Kind::Sqlite];
    if opts.store.is_some() {
        kinds.push(Kind::Postgres);
    }
    let mut rows: Vec<EventsRow> = Vec::new();
    for kind in kinds {
        let mut runs = Vec::new();
        for _ in 0..opts.runs.max(1) {
            runs.push(one(kind, opts).await?);
        }
        runs.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        let rate = runs[runs.len() / 2].rate;
        let mut p50s: Vec<f64> = runs.iter().map(|r| percentile(&r.latencies, 0.5)).collect();
        let mut p99s: Vec<f64> = runs
            .iter()
            .map(|r| percentile(&r.latencies, 0.99))
            .collect();
        p50s.sort_by(|a, b| a.total_cmp(b));
        p99s.sort_by(|a, b| a.total_cmp(b));
        let (p50, p99) = (p50s[p50s.len() / 2], p99s[p99s.len() / 2]);
        let (base_rate, base_p50) = rows
            .first()
            .map_or((rate, p50), |b| (b.events_per_sec, b.ack_p50_us));
        rows.push(EventsRow {
            store: kind.name(),
            events_per_sec: rate,
            ack_p50_us: p50,
            ack_p99_us: p99,
            rate_ratio: rate / base_rate.max(f64::MIN_POSITIVE),
            p50_ratio: p50 / base_p50.max(f64::MIN_POSITIVE),
        });
    }
    Ok(EventsReport {
        events: opts.events,
        latency_events: opts.latency_events,
        in_flight: opts.in_flight.max(1),
        runs: opts.runs.max(1),
        rows,
    })
}

/// One run on a fresh harness over `kind`.
async fn one(kind: Kind, opts: &EventsOptions) -> Result<Run, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut builder = Harness::builder()
        .listen("127.0.0.1:0".parse().map_err(|e| format!("{e}"))?)
        .token(EXECUTOR, SECRET)
        // No heartbeat is due while the bench runs.
        .heartbeat_ms(60_000)
        .lease_ttl_ms(600_000);
    let durable = match kind {
        Kind::Memory => None,
        Kind::Sqlite => Some(SqliteStore::open_dir(dir.path()).map(|s| Arc::new(s) as _)),
        Kind::Postgres => {
            let url = opts.store.clone().unwrap_or_default();
            Some(
                tokio::task::spawn_blocking(move || PgStore::connect(&url))
                    .await
                    .map_err(|e| e.to_string())?
                    .map(|s| Arc::new(s) as _),
            )
        }
    };
    if let Some(db) = durable {
        let db = db.map_err(|e| format!("{}: {e}", kind.name()))?;
        let state = tokio::task::spawn_blocking(move || DurableState::open(db))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("{}: {e}", kind.name()))?;
        builder = builder.durable_state(state);
    }
    let h = builder.build().await.map_err(|e| format!("harness: {e}"))?;
    let endpoint = Endpoint::parse(&h.executor_url()).map_err(|e| e.to_string())?;
    let sim = connect_with(&endpoint, SECRET).await?;
    let session = h
        .sessions()
        .create(CreateSession {
            executor_id: Some(EXECUTOR.into()),
            ..CreateSession::default()
        })
        .await
        .map_err(|e| format!("create a session: {e}"))?;
    let sid = session.id().to_owned();
    let link = sim.link;

    let mut latencies = Vec::with_capacity(opts.latency_events as usize);
    for seq in 1..=opts.latency_events {
        let t = Instant::now();
        send(&link, &sid, seq).await?;
        latencies.push(t.elapsed().as_secs_f64() * 1e6);
    }
    latencies.sort_by(|a, b| a.total_cmp(b));

    let first = opts.latency_events + 1;
    let last = opts.latency_events + opts.events;
    let t = Instant::now();
    // `buffered` starts the sends in order and keeps `in_flight` of them
    // outstanding: the frames go out in sequence order (a hole would be
    // refused, and fail the run).
    let mut acks = futures_util::stream::iter(first..=last)
        .map(|seq| send(&link, &sid, seq))
        .buffered(opts.in_flight.max(1));
    while let Some(r) = acks.next().await {
        r?;
    }
    let rate = opts.events as f64 / t.elapsed().as_secs_f64();
    drop(acks);
    drop(link);
    h.shutdown().await;
    Ok(Run { rate, latencies })
}

/// Send event `seq` and check its acknowledgement.
async fn send(link: &Link, sid: &str, seq: u64) -> Result<(), String> {
    let params = serde_json::json!({
        "sessionId": sid,
        "turnId": "bench-turn",
        "eventId": format!("ev-{seq}"),
        "sequence": seq,
        "event": {"type": "agent.message", "text": "a final agent message of about the size of a short answer, ................................................................................................................................"},
    });
    let r: SessionEventResult = link
        .request(Method::SessionEvent, &params, CALL_TIMEOUT)
        .await
        .map_err(|e| format!("event {seq}: {e}"))?;
    if !r.accepted || r.acked_sequence != seq {
        return Err(format!(
            "event {seq}: acknowledged as {} (accepted {})",
            r.acked_sequence, r.accepted
        ));
    }
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_sorted_values() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 51.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_small_run_checks_every_acknowledgement() {
        let r = run(&EventsOptions {
            events: 200,
            latency_events: 20,
            in_flight: 8,
            runs: 1,
            store: None,
        })
        .await
        .unwrap();
        assert_eq!(r.rows.len(), 2);
        assert_eq!(r.rows[0].store, "memory");
        assert_eq!(r.rows[1].store, "sqlite");
        assert!(r.rows.iter().all(|row| row.events_per_sec > 0.0));
        assert!((r.rows[0].rate_ratio - 1.0).abs() < 1e-9);
    }
}

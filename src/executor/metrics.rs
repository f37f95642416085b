//! The executor's metrics, for `bmx executor --metrics-listen ADDR`
//! (`GET /metrics`, Prometheus / OpenMetrics text, `prometheus-client`).
//!
//! Counters are bumped where the thing happens (connection losses by
//! close code, registrations, tool results by outcome and their run time,
//! output bytes answered and gaps, journal overflows); gauges are read
//! from the runtime's routing maps and the journal at scrape time
//! (connected, sessions, processes, journal entries and bytes), so they
//! cannot drift. One [`Metrics`] per executor instance, no global registry.

use super::runtime::Shared;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The content type of [`Metrics::render`] (the same as the harness's).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// The close code, `none` (the socket broke) or `heartbeat_timeout`.
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `succeeded`, `failed` or `canceled`.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamLabel {
    /// `stdout` or `stderr`.
    pub stream: String,
}

/// Every metric of one executor.
pub struct Metrics {
    registry: Registry,
    connected: Gauge,
    sessions: Gauge,
    processes: Gauge,
    /// Successful registers: the first, then one per reconnect.
    pub registrations: Counter,
    /// Connections lost, by close code: each is followed by a reconnect
    /// unless the code is final (4001, 4003, 4004).
    pub connection_losses: Family<CodeLabel, Counter>,
    /// Tool calls that produced a result, by outcome.
    pub tool_calls: Family<OutcomeLabel, Counter>,
    /// How long each tool ran (the result's `durationMs`).
    pub tool_call_seconds: Histogram,
    /// Process output bytes sent in `process.read` answers, by stream.
    pub output_bytes: Family<StreamLabel, Counter>,
    /// `process.read` answers with `gap: true` (the reader had fallen
    /// behind the ring).
    pub ring_gaps: Counter,
    journal_entries: Gauge,
    journal_bytes: Gauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("bmx_executor");
        let m = Metrics {
            registry: Registry::default(),
            connected: Gauge::default(),
            sessions: Gauge::default(),
            processes: Gauge::default(),
            registrations: Counter::default(),
            connection_losses: Family::default(),
            tool_calls: Family::default(),
            // 1 ms .. ~33 s.
            tool_call_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            output_bytes: Family::default(),
            ring_gaps: Counter::default(),
            journal_entries: Gauge::default(),
            journal_bytes: Gauge::default(),
        };
        registry.register(
            "connected",
            "1 while registered with the harness",
            m.connected.clone(),
        );
        registry.register("sessions", "Sessions running now", m.sessions.clone());
        registry.register("processes", "Process actors alive now", m.processes.clone());
        registry.register(
            "registrations",
            "Successful executor.register (the first and every reconnect)",
            m.registrations.clone(),
        );
        registry.register(
            "connection_losses",
            "Connections lost, by close code",
            m.connection_losses.clone(),
        );
        registry.register(
            "tool_calls",
            "Tool calls that produced a result, by outcome",
            m.tool_calls.clone(),
        );
        registry.register(
            "tool_call_duration_seconds",
            "How long each tool call ran",
            m.tool_call_seconds.clone(),
        );
        registry.register(
            "process_output_bytes",
            "Process output bytes sent in process.read answers, by stream",
            m.output_bytes.clone(),
        );
        registry.register(
            "ring_gaps",
            "process.read answers that skipped output already dropped from the ring",
            m.ring_gaps.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Add the journal's metrics (entries and bytes kept, overflows).
    pub fn with_journal(mut self, journal: Option<&super::journal::Journal>) -> Metrics {
        if let Some(j) = journal {
            self.registry.register(
                "journal_entries",
                "Requests kept in the journal until acknowledged",
                self.journal_entries.clone(),
            );
            self.registry.register(
                "journal_bytes",
                "Bytes of the requests kept in the journal",
                self.journal_bytes.clone(),
            );
            self.registry.register(
                "journal_overflows",
                "Requests not journaled (caps or disk errors): kept in memory only",
                j.overflows.clone(),
            );
        }
        self
    }

    /// A tool call produced its result.
    pub fn tool_result(&self, r: &crate::wire::types::ToolResultParams) {
        let outcome = match serde_json::to_value(r.outcome) {
            Ok(serde_json::Value::String(s)) => s,
            _ => "unknown".to_owned(),
        };
        self.tool_calls
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
        self.tool_call_seconds
            .observe(r.duration_ms as f64 / 1000.0);
    }

    /// A `process.read` answer left with `bytes` of `stream`.
    pub fn read_answered(&self, stream: &str, bytes: usize, gap: bool) {
        self.output_bytes
            .get_or_create(&StreamLabel {
                stream: stream.to_owned(),
            })
            .inc_by(bytes as u64);
        if gap {
            self.ring_gaps.inc();
        }
    }

    pub fn connection_lost(&self, code: String) {
        self.connection_losses
            .get_or_create(&CodeLabel { code })
            .inc();
    }

    /// The text exposition, gauges refreshed from `shared`.
    pub fn render(&self, shared: &Shared) -> String {
        let connected = shared.link().is_some_and(|l| !l.is_closed());
        self.connected.set(i64::from(connected));
        self.sessions.set(shared.sessions.len() as i64);
        self.processes.set(shared.processes.len() as i64);
        if let Some(j) = &shared.journal {
            let (entries, bytes) = j.usage();
            self.journal_entries.set(entries as i64);
            self.journal_bytes.set(bytes as i64);
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Serve `GET /metrics` on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, shared: std::sync::Arc<Shared>) {
    use axum::response::IntoResponse;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let shared = shared.clone();
            async move {
                let body = shared.metrics.render(&shared);
                ([(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response()
            }
        }),
    );
    if let Err(e) = axum::serve(listener, app).await {
        tracing::warn!(error = %e, "the metrics listener stopped");
    }
}

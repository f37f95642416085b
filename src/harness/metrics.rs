//! The harness's metrics, served as `GET /metrics` in the Prometheus /
//! OpenMetrics text format (`prometheus-client`).
//!
//! Two kinds: **counters** the code bumps where the thing happens
//! (connection closes by code, tool calls by outcome and their latency,
//! output bytes, lease expiries, 4004 replacements, frame errors, re-sent
//! requests), and **gauges** read from the runtime's published state at
//! scrape time (live connections, sessions by state, running processes),
//! so a gauge can never drift from what `GET /v1/sessions` shows. One
//! [`Metrics`] per harness instance (no global registry: two harnesses
//! embedded in one process keep their own numbers).

use super::runtime::Shared;
use super::types::SessionState;
use crate::wire::types::ProcState;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The content type of [`Metrics::render`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// A WebSocket close code (`1000`, `4004`, ...) or `none` (the socket
    /// broke without a close frame).
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `succeeded`, `failed`, `canceled` (the executor's result), or why
    /// the API call ended without one: `tool_outcome_unknown`, `timeout`,
    /// `refused`, `frame_too_large`, `error`.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamLabel {
    pub stream: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabel {
    pub method: String,
}

/// Every metric of one harness.
pub struct Metrics {
    registry: Registry,
    connections: Gauge,
    sessions: Family<StateLabel, Gauge>,
    processes: Gauge,
    /// Registered executor connections that ended, by close code: each is
    /// a reconnect to come unless the code is final (4001, 4003, 4004).
    pub connection_closes: Family<CodeLabel, Counter>,
    pub tool_calls: Family<OutcomeLabel, Counter>,
    pub tool_call_seconds: Histogram,
    /// Process output bytes handed to API readers, by stream.
    pub output_bytes: Family<StreamLabel, Counter>,
    pub lease_expiries: Counter,
    /// Over several replicas: copies of sessions dropped because the
    /// store's row names another grant (nothing was stopped).
    pub superseded: Counter,
    pub replacements: Counter,
    /// Frame-level failures by close code: 1009 (a frame too large),
    /// 4009 (protocol violation), 1007/1002 (undecodable).
    pub frame_errors: Family<CodeLabel, Counter>,
    /// Requests the harness refused to send because their frame would pass
    /// the executor's `maxFrameBytes` (answered 413).
    pub frames_refused: Counter,
    /// Requests sent again on a resumed connection, by method.
    pub resends: Family<MethodLabel, Counter>,
    /// Reads answered with `gap: true`: output the executor's ring had
    /// already dropped (a reader too slow for the process).
    pub ring_gaps: Counter,
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
        let mut registry = Registry::with_prefix("bmx_harness");
        let m = Metrics {
            connections: Gauge::default(),
            sessions: Family::default(),
            processes: Gauge::default(),
            connection_closes: Family::default(),
            tool_calls: Family::default(),
            // 5 ms .. ~160 s.
            tool_call_seconds: Histogram::new(exponential_buckets(0.005, 2.0, 16)),
            output_bytes: Family::default(),
            lease_expiries: Counter::default(),
            superseded: Counter::default(),
            replacements: Counter::default(),
            frame_errors: Family::default(),
            frames_refused: Counter::default(),
            resends: Family::default(),
            ring_gaps: Counter::default(),
            registry: Registry::default(),
        };
        registry.register(
            "executor_connections",
            "Registered executor connections now",
            m.connections.clone(),
        );
        registry.register(
            "executor_connection_closes",
            "Registered executor connections that ended, by close code",
            m.connection_closes.clone(),
        );
        registry.register("sessions", "Sessions by state now", m.sessions.clone());
        registry.register(
            "processes",
            "Processes running in live sessions now (last process.status)",
            m.processes.clone(),
        );
        registry.register(
            "tool_calls",
            "Tool calls answered by the API, by outcome",
            m.tool_calls.clone(),
        );
        registry.register(
            "tool_call_duration_seconds",
            "Tool call latency as the API caller sees it",
            m.tool_call_seconds.clone(),
        );
        registry.register(
            "process_output_bytes",
            "Process output bytes read through the API, by stream",
            m.output_bytes.clone(),
        );
        registry.register(
            "lease_expiries",
            "Sessions ended because their lease ran out",
            m.lease_expiries.clone(),
        );
        registry.register(
            "sessions_superseded",
            "Copies of sessions dropped because another replica's grant holds them (nothing stopped)",
            m.superseded.clone(),
        );
        registry.register(
            "replacements",
            "Executor connections replaced by a newer one (close 4004)",
            m.replacements.clone(),
        );
        registry.register(
            "frame_errors",
            "Connections closed for a frame error, by close code",
            m.frame_errors.clone(),
        );
        registry.register(
            "frames_refused",
            "Requests not sent because their frame exceeds the executor's maxFrameBytes",
            m.frames_refused.clone(),
        );
        registry.register(
            "resent_requests",
            "Requests sent again on a resumed connection, by method",
            m.resends.clone(),
        );
        registry.register(
            "ring_gaps",
            "Process reads that found output already dropped from the ring",
            m.ring_gaps.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Count a tool call's end and its latency.
    pub fn tool_call(&self, outcome: &str, seconds: f64) {
        self.tool_calls
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .inc();
        self.tool_call_seconds.observe(seconds);
    }

    /// A registered connection ended with `code`.
    pub fn connection_closed(&self, code: Option<u16>) {
        let label = CodeLabel {
            code: code.map_or_else(|| "none".to_owned(), |c| c.to_string()),
        };
        if matches!(code, Some(1002 | 1007 | 1009 | 4009)) {
            self.frame_errors.get_or_create(&label).inc();
        }
        self.connection_closes.get_or_create(&label).inc();
    }

    /// The text exposition: gauges refreshed from `shared`, then every
    /// metric.
    pub fn render(&self, shared: &Shared) -> String {
        self.connections
            .set(shared.conns.iter().filter(|c| c.registered).count() as i64);
        let mut by_state: std::collections::BTreeMap<&'static str, i64> =
            ["assigning", "active", "disconnected", "stopping", "ended"]
                .into_iter()
                .map(|s| (s, 0))
                .collect();
        let mut running = 0i64;
        for s in shared.sessions.iter() {
            *by_state.entry(state_name(s.state)).or_default() += 1;
            if s.state != SessionState::Ended {
                running += s
                    .processes
                    .iter()
                    .filter(|p| p.state == ProcState::Running)
                    .count() as i64;
            }
        }
        for (state, n) in by_state {
            self.sessions
                .get_or_create(&StateLabel {
                    state: state.to_owned(),
                })
                .set(n);
        }
        self.processes.set(running);
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

fn state_name(s: SessionState) -> &'static str {
    match s {
        SessionState::Assigning => "assigning",
        SessionState::Active => "active",
        SessionState::Disconnected => "disconnected",
        SessionState::Stopping => "stopping",
        SessionState::Ended => "ended",
    }
}

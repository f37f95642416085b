//! The executor's metrics, for `bmx executor --metrics-listen ADDR`
//! (`GET /metrics`, Prometheus / OpenMetrics text, `prometheus-client`).
//!
//! Counters are bumped where the thing happens (connection losses by
//! close code, registrations); gauges are read from the runtime's routing
//! maps at scrape time (connected, sessions, processes), so they cannot
//! drift. One [`Metrics`] per executor instance, no global registry.

use super::runtime::Shared;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The content type of [`Metrics::render`] (the same as the harness's).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// The close code, `none` (the socket broke) or `heartbeat_timeout`.
    pub code: String,
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
        Metrics { registry, ..m }
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

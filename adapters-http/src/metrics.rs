//! HTTP metrics: requests by route and status, latency by route, idempotency outcomes.

use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::exemplar::HistogramWithExemplars;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
/// Labels of `idem_http_requests`.
pub struct RequestLabels {
    /// HTTP method.
    pub method: String,
    /// Route template (`/payments/{id}`).
    pub route: String,
    /// Status code.
    pub status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
/// Labels of the latency histogram.
pub struct RouteLabels {
    /// HTTP method.
    pub method: String,
    /// Route template.
    pub route: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
/// Labels of `idem_http_idempotency_outcomes`.
pub struct OutcomeLabels {
    /// executed, replayed, conflict, in_flight, unavailable, rejected_input, failed
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
/// The exemplar of a latency observation: the trace it belongs to (when tracing is on and it was sampled).
pub struct TraceLabel {
    /// 32 hexadecimal digits.
    pub trace_id: String,
}

type Histograms = Family<RouteLabels, HistogramWithExemplars<TraceLabel>, fn() -> HistogramWithExemplars<TraceLabel>>;

fn latency_histogram() -> HistogramWithExemplars<TraceLabel> {
    HistogramWithExemplars::new(exponential_buckets(0.0005, 2.0, 14))
}

/// The HTTP adapter's metrics; cheap to clone (shared counters).
#[derive(Debug, Clone)]
pub struct HttpMetrics {
    /// Requests by method, route and status.
    pub requests: Family<RequestLabels, Counter>,
    /// Latency by route, each bucket's exemplar the trace of its last sampled request.
    pub duration: Histograms,
    /// What the idempotency layer did.
    pub idempotency: Family<OutcomeLabels, Counter>,
}

impl Default for HttpMetrics {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            duration: Family::new_with_constructor(latency_histogram),
            idempotency: Family::default(),
        }
    }
}

impl HttpMetrics {
    /// Registers the metrics under `idem_http_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("idem_http");
        r.register("requests", "HTTP requests by method, route and status", self.requests.clone());
        r.register("request_duration_seconds", "HTTP request latency by route", self.duration.clone());
        r.register(
            "idempotency_outcomes",
            "What the idempotency layer did: executed, replayed, conflict, in_flight, unavailable, rejected_input, failed",
            self.idempotency.clone(),
        );
    }

    /// Counts one idempotency outcome.
    pub fn outcome(&self, outcome: &'static str) {
        self.idempotency.get_or_create(&OutcomeLabels { outcome }).inc();
    }
}

/// Middleware: counts and times every request by its route template (never the raw path, so ids do not
/// explode the label space).
pub async fn track(State(metrics): State<HttpMetrics>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = req.method().as_str().to_owned();
    let start = Instant::now();
    let span = tracing::Span::current();
    span.record("http.route", route.as_str());
    let response = next.run(req).await;
    let status = response.status().as_u16();
    let exemplar = idem_ports::trace::trace_id_of(&span).map(|trace_id| TraceLabel { trace_id });
    metrics
        .duration
        .get_or_create(&RouteLabels { method: method.clone(), route: route.clone() })
        .observe(start.elapsed().as_secs_f64(), exemplar);
    metrics.requests.get_or_create(&RequestLabels { method, route, status }).inc();
    response
}

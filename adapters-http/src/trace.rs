//! The HTTP server span of a request (OpenTelemetry's HTTP semantic conventions): a child of the client's
//! `traceparent`/`tracestate` when it sent them; the idempotency layer records what it did on it
//! (`idempotency.outcome`), the metrics middleware its route, and [`record_response`] its status. Its
//! `trace_id` and `span_id` fields put the trace on every log line of a sampled request.

use axum::http::Request;

/// The span of one request.
pub fn server_span<B>(req: &Request<B>) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        otel.name = %req.method(),
        otel.kind = "server",
        http.request.method = %req.method(),
        url.path = %req.uri().path(),
        http.route = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        idempotency.outcome = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
    );
    if !span.is_disabled() {
        let headers: Vec<(&str, &[u8])> = [idem_ports::trace::TRACEPARENT, idem_ports::trace::TRACESTATE]
            .into_iter()
            .filter_map(|name| req.headers().get(name).map(|v| (name, v.as_bytes())))
            .collect();
        idem_ports::trace::continue_from(&span, headers.into_iter());
    }
    if let Some((trace_id, span_id)) = idem_ports::trace::ids_of(&span) {
        span.record("trace_id", trace_id);
        span.record("span_id", span_id);
    }
    span
}

/// Records the answer's status on the request's span.
pub fn record_response(status: axum::http::StatusCode, span: &tracing::Span) {
    span.record("http.response.status_code", status.as_u16());
}

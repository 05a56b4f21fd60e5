//! W3C trace context across the hops a message takes: an HTTP request's, stored with an outbox row, sent
//! in a Kafka message's headers, continued by the consumer that applies it.
//!
//! Everything goes through OpenTelemetry's global propagator, which the service sets when it exports
//! traces (`traceparent`/`tracestate`, the W3C Trace Context propagator). Until then the global propagator
//! is OpenTelemetry's no-op: nothing is injected or extracted, and these functions cost next to nothing.

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The header carrying the W3C trace parent.
pub const TRACEPARENT: &str = "traceparent";
/// The header carrying vendor trace state.
pub const TRACESTATE: &str = "tracestate";

struct Pairs<'a>(&'a mut Vec<(String, String)>);

impl Injector for Pairs<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_owned(), value));
    }
}

struct Found<'a, I: Clone + Iterator<Item = (&'a str, &'a [u8])>>(I);

impl<'a, I: Clone + Iterator<Item = (&'a str, &'a [u8])>> Extractor for Found<'a, I> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.clone().find(|(k, _)| k.eq_ignore_ascii_case(key)).and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.clone().map(|(k, _)| k).collect()
    }
}

/// The context headers (`traceparent`, `tracestate`) of `span`: empty when tracing is off or the span has
/// no context.
pub fn headers_of(span: &tracing::Span) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    if span.is_disabled() {
        return pairs;
    }
    opentelemetry::global::get_text_map_propagator(|p| {
        let cx = span.context();
        if cx.span().span_context().is_valid() {
            p.inject_context(&cx, &mut Pairs(&mut pairs));
        }
    });
    pairs
}

/// The context headers of the current span (see [`headers_of`]).
pub fn current_headers() -> Vec<(String, String)> {
    headers_of(&tracing::Span::current())
}

/// The `traceparent` of the current span, if tracing is on.
pub fn current_traceparent() -> Option<String> {
    current_headers().into_iter().find(|(k, _)| k == TRACEPARENT).map(|(_, v)| v)
}

/// The remote context `headers` carry (`None`: none, or tracing is off).
pub fn remote_context<'a>(
    headers: impl Clone + Iterator<Item = (&'a str, &'a [u8])>,
) -> Option<opentelemetry::Context> {
    let found = Found(headers);
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&found));
    cx.span().span_context().is_valid().then_some(cx)
}

/// Makes `span` continue the context `headers` carry (a child of the remote span); nothing when they carry
/// none. Returns whether they did.
pub fn continue_from<'a>(span: &tracing::Span, headers: impl Clone + Iterator<Item = (&'a str, &'a [u8])>) -> bool {
    match remote_context(headers) {
        Some(cx) => span.set_parent(cx).is_ok(),
        None => false,
    }
}

/// Links `span` to the context `headers` carry (a batch holding messages of several traces).
pub fn link_from<'a>(span: &tracing::Span, headers: impl Clone + Iterator<Item = (&'a str, &'a [u8])>) {
    if let Some(cx) = remote_context(headers) {
        span.add_link(cx.span().span_context().clone());
    }
}

/// Whether the current span belongs to a sampled trace: idem's own child spans (units of work, foreign
/// calls) are created only then, so an unsampled request, or background work outside any request, costs
/// no span of theirs.
pub fn current_sampled() -> bool {
    let span = tracing::Span::current();
    !span.is_disabled() && span.context().span().span_context().is_sampled()
}

/// Whether `headers` carry a W3C `traceparent` whose trace was not sampled: a child of it would not be
/// either (the parent-based sampler), so its span need not be made.
pub fn unsampled_parent<'a>(mut headers: impl Iterator<Item = (&'a str, &'a [u8])>) -> bool {
    headers.any(|(k, v)| k.eq_ignore_ascii_case(TRACEPARENT) && v.len() == 55 && v.ends_with(b"-00"))
}

/// The trace id of `span` (32 hexadecimal digits) when it is sampled: for log lines and exemplars.
pub fn trace_id_of(span: &tracing::Span) -> Option<String> {
    ids_of(span).map(|(trace, _)| trace)
}

/// The trace and span ids of `span` when it is sampled.
pub fn ids_of(span: &tracing::Span) -> Option<(String, String)> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    (sc.is_valid() && sc.is_sampled()).then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
}

//! An OTLP/HTTP trace receiver for tests: `POST /v1/traces` with protobuf bodies, decoded with the
//! protocol's own generated types (`opentelemetry-proto`), kept in memory; it can be told to answer `503`
//! or to answer late (a collector that is down or slow).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;

/// A received span, flattened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedSpan {
    /// 32 hexadecimal digits.
    pub trace_id: String,
    /// 16 hexadecimal digits.
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    /// The span's name.
    pub name: String,
    /// `SPAN_KIND_SERVER` and so on, as the protocol names them.
    pub kind: String,
    /// Attributes, values as text.
    pub attributes: Vec<(String, String)>,
    /// Trace ids of the spans it links to.
    pub links: Vec<String>,
    /// `service.name` of its resource.
    pub service: String,
}

impl ReceivedSpan {
    /// An attribute's value as text.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// The receiver's state, shared with the test.
#[derive(Debug, Default)]
pub struct Receiver {
    spans: std::sync::Mutex<Vec<ReceivedSpan>>,
    /// Answer `503` to every export.
    pub down: AtomicBool,
    /// Answer this many milliseconds late.
    pub delay_ms: AtomicU64,
    /// Export requests received.
    pub requests: AtomicU64,
}

impl Receiver {
    /// The spans received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// The spans of `trace_id`.
    pub fn trace(&self, trace_id: &str) -> Vec<ReceivedSpan> {
        self.spans().into_iter().filter(|s| s.trace_id == trace_id).collect()
    }
}

/// Serves a receiver; returns it and its base URL (for `OTEL_EXPORTER_OTLP_ENDPOINT`).
pub async fn start() -> anyhow::Result<(Arc<Receiver>, String)> {
    let state = Arc::new(Receiver::default());
    let router = axum::Router::new().route("/v1/traces", axum::routing::post(export)).with_state(state.clone());
    Ok((state, crate::serve(router).await?))
}

fn text(value: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    match value.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

async fn export(State(r): State<Arc<Receiver>>, body: Bytes) -> StatusCode {
    r.requests.fetch_add(1, SeqCst);
    tokio::time::sleep(Duration::from_millis(r.delay_ms.load(SeqCst))).await;
    if r.down.load(SeqCst) {
        return StatusCode::SERVICE_UNAVAILABLE;
    }
    let Ok(request) = ExportTraceServiceRequest::decode(body.as_ref()) else {
        return StatusCode::BAD_REQUEST;
    };
    let mut received = Vec::new();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .as_ref()
            .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
            .map(|a| text(a.value.as_ref()))
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                let kind = opentelemetry_proto::tonic::trace::v1::span::SpanKind::try_from(span.kind)
                    .map(|k| k.as_str_name().to_owned())
                    .unwrap_or_default();
                received.push(ReceivedSpan {
                    trace_id: hex::encode(&span.trace_id),
                    span_id: hex::encode(&span.span_id),
                    parent_span_id: hex::encode(&span.parent_span_id),
                    name: span.name,
                    kind,
                    attributes: span.attributes.iter().map(|a| (a.key.clone(), text(a.value.as_ref()))).collect(),
                    links: span.links.iter().map(|l| hex::encode(&l.trace_id)).collect(),
                    service: service.clone(),
                });
            }
        }
    }
    if let Ok(mut spans) = r.spans.lock() {
        spans.extend(received);
    }
    StatusCode::OK
}

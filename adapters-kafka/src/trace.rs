//! Kafka's side of the trace context (`idem_ports::trace`): the relay's publish is a `PRODUCER` span
//! continuing the context stored with the outbox row, and the message carries that span's `traceparent`;
//! a consumer's processing is a `CONSUMER` span continuing the message's context (linked to each when a
//! batch holds several traces). Attributes follow OpenTelemetry's messaging conventions. The spans are
//! debug spans: exported when tracing is on, free when it is off.

use idem_ports::trace::{self, TRACEPARENT, TRACESTATE};
use idem_ports::{InboundEvent, OutboxRecord};
use rdkafka::message::{Header, OwnedHeaders};

/// The `PRODUCER` span of publishing `row`, a child of the context stored with it.
pub fn producer_span(row: &OutboxRecord) -> tracing::Span {
    // an unsampled stored context makes no span: the stored context goes out as it is
    continuing(row.headers.iter().map(|(k, v)| (k.as_str(), v.as_bytes())), || {
        tracing::debug_span!(
            "publish",
            otel.name = %format_args!("{} publish", row.topic),
            otel.kind = "producer",
            messaging.system = "kafka",
            messaging.operation.type = "send",
            messaging.destination.name = %row.topic,
            messaging.kafka.message.key = %row.aggregate_id,
            messaging.message.id = %row.id,
        )
    })
}

/// The span `make` makes, a child of the context `headers` carry; none when that context was not sampled
/// (a child of it would not be either).
fn continuing<'a>(
    headers: impl Clone + Iterator<Item = (&'a str, &'a [u8])>,
    make: impl FnOnce() -> tracing::Span,
) -> tracing::Span {
    if trace::unsampled_parent(headers.clone()) {
        return tracing::Span::none();
    }
    let span = make();
    if !span.is_disabled() {
        trace::continue_from(&span, headers);
    }
    span
}

/// The headers of `row`'s message: idem's (`event_id`, `event_type`, …), then the row's own, with the trace
/// context of `span` (the publish) in place of the stored one when tracing is on.
pub fn message_headers(mut headers: OwnedHeaders, row: &OutboxRecord, span: &tracing::Span) -> OwnedHeaders {
    let context = trace::headers_of(span);
    let replaced = |k: &str| !context.is_empty() && (k == TRACEPARENT || k == TRACESTATE);
    for (k, v) in row.headers.iter().filter(|(k, _)| !replaced(k)) {
        headers = headers.insert(Header { key: k, value: Some(v.as_bytes()) });
    }
    for (k, v) in &context {
        headers = headers.insert(Header { key: k, value: Some(v.as_bytes()) });
    }
    headers
}

/// The `CONSUMER` span of processing `events` (one transaction) of `group`: a child of the event's context
/// when there is one event, linked to each event's context when a batch holds several.
pub fn consumer_span(group: &str, topic: &str, events: &[&InboundEvent]) -> tracing::Span {
    if !events.is_empty() && events.iter().all(|e| trace::unsampled_parent(headers(e))) {
        return tracing::Span::none();
    }
    let first = events.first();
    let span = tracing::debug_span!(
        "process",
        otel.name = %format_args!("{topic} process"),
        otel.kind = "consumer",
        messaging.system = "kafka",
        messaging.operation.type = "process",
        messaging.destination.name = %topic,
        messaging.consumer.group.name = %group,
        messaging.batch.message_count = events.len(),
        messaging.destination.partition.id = first.map_or(-1, |e| e.partition),
        messaging.kafka.offset = first.map_or(-1, |e| e.offset),
        messaging.message.id = tracing::field::Empty,
    );
    if span.is_disabled() {
        return span;
    }
    match events {
        [one] => {
            span.record("messaging.message.id", tracing::field::display(one.event_id));
            trace::continue_from(&span, headers(one));
        }
        many => {
            for e in many {
                trace::link_from(&span, headers(e));
            }
        }
    }
    span
}

/// The `PRODUCER` span of dead-lettering a message of `topic` to `dlq_topic` for `reason`, a child of the
/// message's context.
pub fn dead_letter_span<'a>(
    topic: &str,
    dlq_topic: &str,
    reason: &str,
    headers: impl Clone + Iterator<Item = (&'a str, &'a [u8])>,
) -> tracing::Span {
    continuing(headers, || {
        tracing::debug_span!(
            "dead-letter",
            otel.name = %format_args!("{dlq_topic} publish"),
            otel.kind = "producer",
            messaging.system = "kafka",
            messaging.operation.type = "send",
            messaging.destination.name = %dlq_topic,
            dlq.original.topic = %topic,
            dlq.reason = %reason,
        )
    })
}

/// The `PRODUCER` span of re-driving a dead letter of `dlq_topic` to `to`, continuing the original
/// message's context.
pub fn redrive_span<'a>(
    dlq_topic: &str,
    to: &str,
    headers: impl Clone + Iterator<Item = (&'a str, &'a [u8])>,
) -> tracing::Span {
    continuing(headers, || {
        tracing::debug_span!(
            "redrive",
            otel.name = %format_args!("{to} publish"),
            otel.kind = "producer",
            messaging.system = "kafka",
            messaging.operation.type = "send",
            messaging.destination.name = %to,
            dlq.topic = %dlq_topic,
        )
    })
}

fn headers(event: &InboundEvent) -> impl Clone + Iterator<Item = (&str, &[u8])> {
    event.headers.iter().map(|(k, v)| (k.as_str(), v.as_slice()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TracerProvider as _;
    use rdkafka::message::Headers;
    use tracing_subscriber::layer::SubscriberExt;

    fn row(headers: Vec<(String, String)>) -> OutboxRecord {
        OutboxRecord {
            id: uuid::Uuid::from_u128(1),
            topic: "payments".into(),
            aggregate_type: "payment".into(),
            aggregate_id: "order-1".into(),
            event_type: "PaymentCaptured".into(),
            payload: "{}".into(),
            headers,
            saga_id: None,
            created_at: chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default(),
            attempts: 0,
        }
    }

    fn sent(headers: &OwnedHeaders) -> Vec<(String, String)> {
        headers
            .iter()
            .map(|h| (h.key.to_owned(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned()))
            .collect()
    }

    const STORED: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    /// With tracing off the stored context goes out as it was stored; with it on, the message carries the
    /// publish span's context — same trace, a new span id — and the consumer's span continues it.
    #[test]
    fn the_context_goes_from_the_row_through_the_message_to_the_consumer() {
        let stored = vec![(TRACEPARENT.to_owned(), STORED.to_owned())];
        let off = message_headers(OwnedHeaders::new(), &row(stored.clone()), &producer_span(&row(stored.clone())));
        assert_eq!(sent(&off), stored, "tracing off: the stored context, untouched");

        opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber =
            tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let span = producer_span(&row(stored.clone()));
            let on = sent(&message_headers(OwnedHeaders::new(), &row(stored.clone()), &span));
            let parent = on.iter().find(|(k, _)| k == TRACEPARENT).map(|(_, v)| v.clone()).unwrap_or_default();
            assert_eq!(on.iter().filter(|(k, _)| k == TRACEPARENT).count(), 1, "{on:?}");
            assert_eq!(&parent[3..35], &STORED[3..35], "the same trace");
            assert_ne!(&parent[36..52], &STORED[36..52], "the publish span's own id");

            let event = InboundEvent {
                event_id: uuid::Uuid::from_u128(2),
                saga_id: None,
                topic: "payments".into(),
                partition: 0,
                offset: 7,
                key: None,
                payload: Vec::new(),
                headers: vec![(TRACEPARENT.to_owned(), parent.clone().into_bytes())],
            };
            let consumer = consumer_span("g", "payments", &[&event]);
            let continued = trace::headers_of(&consumer);
            let tp = continued.iter().find(|(k, _)| k == TRACEPARENT).map(|(_, v)| v.clone()).unwrap_or_default();
            assert_eq!(&tp[3..35], &STORED[3..35], "the consumer continues the trace");
        });
    }
}

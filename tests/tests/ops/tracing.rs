//! Issue 35: one trace from the HTTP request through the outbox and Kafka to the consumer, exported over
//! OTLP by the real binary to an in-process receiver that decodes the protocol's protobuf.

use std::time::Duration;

use idem_tests::TestDb;
use idem_tests::kafka::{eventually, produce, producer, read_topic};
use idem_tests::otlp::{ReceivedSpan, Receiver};
use serde_json::json;
use uuid::Uuid;

use crate::harness::{API_KEY, Service};

fn traced(service: Service, endpoint: &str) -> Service {
    service
        .with_env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .with_env("OTEL_SERVICE_NAME", "idem-under-test")
        .with_env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .with_env("OTEL_EXPORTER_OTLP_TIMEOUT", "1000")
}

async fn spans_where(receiver: &Receiver, want: impl Fn(&[ReceivedSpan]) -> bool) -> anyhow::Result<Vec<ReceivedSpan>> {
    let found = eventually(Duration::from_secs(20), || async { Ok(want(&receiver.spans())) }).await?;
    anyhow::ensure!(found, "spans never arrived; received: {:#?}", receiver.spans());
    Ok(receiver.spans())
}

fn of_kind<'a>(spans: &'a [ReceivedSpan], trace: &str, kind: &str) -> Vec<&'a ReceivedSpan> {
    spans.iter().filter(|s| s.trace_id == trace && s.kind == kind).collect()
}

/// The spans of one trace as an indented tree (README, "Observability").
fn render(spans: &[ReceivedSpan]) -> String {
    fn walk(spans: &[ReceivedSpan], parent: &str, depth: usize, out: &mut String) {
        for s in spans.iter().filter(|s| s.parent_span_id == parent) {
            let attrs: Vec<String> = s
                .attributes
                .iter()
                .filter(|(k, _)| !k.starts_with("otel.") && k != "trace_id")
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            out.push_str(&format!(
                "{}{} [{}] {}\n",
                "  ".repeat(depth),
                s.name,
                s.kind.trim_start_matches("SPAN_KIND_").to_lowercase(),
                attrs.join(" ")
            ));
            walk(spans, &s.span_id, depth + 1, out);
        }
    }
    let ids: std::collections::BTreeSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    let mut out = String::new();
    let roots: std::collections::BTreeSet<&str> =
        spans.iter().filter(|s| !ids.contains(s.parent_span_id.as_str())).map(|s| s.parent_span_id.as_str()).collect();
    for root in roots {
        out.push_str(&format!("(remote parent {root})\n"));
        walk(spans, root, 1, &mut out);
    }
    out
}

async fn charge(service: &Service, key: &str, traceparent: &str) -> anyhow::Result<u16> {
    let body = json!({"order_id": Uuid::now_v7(), "customer_id": Uuid::now_v7(), "provider": "otel",
                      "external_payment_id": format!("pi_{}", Uuid::now_v7().simple()), "amount": "10.00",
                      "currency": "EUR"});
    let resp = reqwest::Client::new()
        .post(format!("{}/payments", service.base))
        .bearer_auth(API_KEY)
        .header("idempotency-key", key)
        .header("traceparent", traceparent)
        .json(&body)
        .send()
        .await?;
    Ok(resp.status().as_u16())
}

/// A charge with a client `traceparent` yields, in that trace, the server span (its parent the client's
/// span, the idempotency outcome on it), the unit of work, and the relay's `PRODUCER` span; the published
/// message carries a `traceparent` of the trace. An order event produced with a `traceparent` yields the
/// consumer's span in its trace, and the payment it announces is published in the same trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_crosses_http_the_outbox_kafka_and_the_consumer() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let (receiver, endpoint) = idem_tests::otlp::start().await?;
    let mut service = traced(Service::new(&db.url, &brokers), &endpoint);
    service.start().await?;

    let (trace, client_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let status = charge(&service, "traced-charge-1", &format!("00-{trace}-{client_span}-01")).await?;
    assert_eq!(status, 201);
    let spans = spans_where(&receiver, |s| {
        !of_kind(s, trace, "SPAN_KIND_SERVER").is_empty() && !of_kind(s, trace, "SPAN_KIND_PRODUCER").is_empty()
    })
    .await?;
    let server = of_kind(&spans, trace, "SPAN_KIND_SERVER")[0];
    assert_eq!(server.parent_span_id, client_span, "the server span continues the client's");
    assert_eq!(server.service, "idem-under-test");
    assert_eq!(server.attribute("http.request.method"), Some("POST"));
    assert_eq!(server.attribute("http.route"), Some("/payments"));
    assert_eq!(server.attribute("http.response.status_code"), Some("201"));
    assert_eq!(server.attribute("idempotency.outcome"), Some("executed"));
    let units: Vec<_> = spans.iter().filter(|s| s.trace_id == trace && s.name == "unit of work").collect();
    assert!(units.iter().any(|u| u.attribute("outcome") == Some("committed")), "{units:#?}");
    let publish = of_kind(&spans, trace, "SPAN_KIND_PRODUCER")[0];
    assert_eq!(publish.attribute("messaging.system"), Some("kafka"));
    assert_eq!(publish.attribute("messaging.destination.name"), Some(service.payments_topic.as_str()));
    println!("{}", render(&receiver.trace(trace)));
    let messages = read_topic(&brokers, &service.payments_topic, 1, Duration::from_secs(20)).await?;
    let sent = messages[0].header("traceparent").unwrap_or_default();
    assert_eq!(&sent[3..35], trace, "the message carries the trace: {sent}");
    assert_eq!(&sent[36..52], publish.span_id, "as the publish span's child");

    // an order event with a traceparent: the consumer continues it, and its announcement too
    let (order_trace, producer_span) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let order = Uuid::now_v7();
    let body = json!({"type": "OrderPlaced", "order_id": order, "customer_id": Uuid::now_v7(), "amount": "5.00",
                      "currency": "EUR", "provider": "otel", "external_payment_id": format!("pi_{order}"),
                      "version": 1});
    let event_id = Uuid::now_v7().to_string();
    let traceparent = format!("00-{order_trace}-{producer_span}-01");
    let p = producer(&brokers)?;
    produce(
        &p,
        &service.orders_topic,
        Some(&order.to_string()),
        body.to_string().as_bytes(),
        &[("event_id", event_id.as_bytes()), ("traceparent", traceparent.as_bytes())],
    )
    .await?;
    let spans = spans_where(&receiver, |s| {
        !of_kind(s, order_trace, "SPAN_KIND_CONSUMER").is_empty()
            && !of_kind(s, order_trace, "SPAN_KIND_PRODUCER").is_empty()
    })
    .await?;
    let consumer = of_kind(&spans, order_trace, "SPAN_KIND_CONSUMER")[0];
    assert_eq!(consumer.parent_span_id, producer_span, "the consumer continues the producer's span");
    assert_eq!(consumer.attribute("messaging.consumer.group.name"), Some(service.group.as_str()));
    assert_eq!(consumer.attribute("messaging.message.id"), Some(event_id.as_str()));
    assert!(!spans.iter().any(|s| s.name == "batch"), "the runner's batch span is not exported (a trace per batch)");
    let announced = of_kind(&spans, order_trace, "SPAN_KIND_PRODUCER")[0];
    assert_eq!(announced.attribute("messaging.destination.name"), Some(service.payments_topic.as_str()));

    // a malformed event with a traceparent: its dead-lettering is a span of its trace
    let (bad_trace, bad_span) = ("5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8");
    let traceparent = format!("00-{bad_trace}-{bad_span}-01");
    let bad_id = Uuid::now_v7().to_string();
    produce(
        &p,
        &service.orders_topic,
        Some("not-an-order"),
        b"{\"type\": \"Nonsense\"}",
        &[("event_id", bad_id.as_bytes()), ("traceparent", traceparent.as_bytes())],
    )
    .await?;
    let dead_letter = |x: &ReceivedSpan| x.trace_id == bad_trace && x.attribute("dlq.reason").is_some();
    let spans = spans_where(&receiver, |s| s.iter().any(dead_letter)).await?;
    let dead = spans.iter().find(|x| dead_letter(x)).expect("found");
    assert_eq!(dead.kind, "SPAN_KIND_PRODUCER");
    assert_eq!(dead.parent_span_id, bad_span);
    assert_eq!(dead.attribute("dlq.reason"), Some("malformed"));
    assert_eq!(dead.attribute("messaging.destination.name"), Some(format!("{}.dlq", service.orders_topic).as_str()));

    // its re-drive (`idem dlq redrive`, a process of its own exporting to the same receiver) is a span of it too
    // (the receiver runs on this test's runtime: the blocking wait for the command must not stop it)
    let out = tokio::task::block_in_place(|| {
        service.idem(&["dlq", "redrive", "--all-matching", "--reason", "malformed", "--json"])
    })?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let redrive = |x: &ReceivedSpan| x.trace_id == bad_trace && x.attribute("dlq.topic").is_some();
    let spans = spans_where(&receiver, |s| s.iter().any(redrive)).await?;
    let redriven = spans.iter().find(|x| redrive(x)).expect("found");
    assert_eq!(redriven.kind, "SPAN_KIND_PRODUCER");
    assert_eq!(redriven.parent_span_id, bad_span, "the re-drive continues the original message's span");
    assert_eq!(redriven.attribute("messaging.destination.name"), Some(service.orders_topic.as_str()));
    Ok(())
}

/// A collector that is down, then one that answers 5 s late: every charge is answered as before and none
/// waits for the export; the spans it could not take are counted.
#[tokio::test]
async fn a_collector_down_or_slow_changes_no_answer() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let (receiver, endpoint) = idem_tests::otlp::start().await?;
    receiver.down.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut service = traced(Service::new(&db.url, &brokers), &endpoint);
    service.start().await?;
    for i in 0..10 {
        let status =
            charge(&service, &format!("down-{i}"), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").await?;
        assert_eq!(status, 201);
    }
    let failed = eventually(Duration::from_secs(20), || async {
        let text = reqwest::get(format!("{}/metrics", service.admin)).await?.text().await?;
        let value = text
            .lines()
            .find(|l| l.starts_with("idem_trace_spans_failed_total"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        Ok(value > 0.0)
    })
    .await?;
    assert!(failed, "the spans the collector refused are counted");

    receiver.down.store(false, std::sync::atomic::Ordering::SeqCst);
    receiver.delay_ms.store(5_000, std::sync::atomic::Ordering::SeqCst);
    for i in 0..10 {
        let started = std::time::Instant::now();
        let status =
            charge(&service, &format!("slow-{i}"), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").await?;
        assert_eq!(status, 201);
        // a charge that waited for the export would take the collector's 5 s
        assert!(started.elapsed() < Duration::from_secs(3), "charge {i} waited {:?}", started.elapsed());
    }
    Ok(())
}

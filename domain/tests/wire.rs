//! Golden tests of the wire formats (`idem_domain::wire`): the exact bytes other services read. A failure
//! here is a contract change: make it deliberately (`UPDATE_GOLDEN=1 cargo test -p idem-domain --test wire`
//! rewrites the files) and tell the consumers.

use std::path::PathBuf;

use chrono::{TimeZone, Utc};
use idem_domain::wire::{self, OrderEvent, headers};
use idem_ports::{PaymentRecord, PaymentStatus, RefundRecord};
use rust_decimal::Decimal;
use uuid::Uuid;

fn golden(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).expect("write golden file");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(actual, expected, "{name} changed: this is a wire-format change");
}

fn payment() -> PaymentRecord {
    PaymentRecord {
        id: Uuid::from_u128(0x0193_a000_0000_7000_8000_0000_0000_0001),
        merchant_id: "m1".into(),
        order_id: Uuid::from_u128(0x0193_a000_0000_7000_8000_0000_0000_0002),
        customer_id: Uuid::from_u128(0x0193_a000_0000_7000_8000_0000_0000_0003),
        provider: "stripe".into(),
        external_payment_id: Some("pi_123".into()),
        amount: Decimal::new(123_400, 4),
        currency: "EUR".into(),
        status: PaymentStatus::Captured,
        refunded_amount: Decimal::ZERO,
        created_at: Utc.with_ymd_and_hms(2026, 12, 3, 10, 0, 0).single().expect("time"),
        through_provider: false,
    }
}

#[test]
fn payment_captured_payload() {
    let text = serde_json::to_string_pretty(&wire::payment_captured(&payment())).expect("json");
    golden("payment_captured.json", &text);
}

#[test]
fn payment_refunded_payload() {
    let refund = RefundRecord {
        id: Uuid::from_u128(0x0193_a000_0000_7000_8000_0000_0000_0004),
        payment_id: payment().id,
        amount: Decimal::new(20_000, 4),
        reason: Some("damaged".into()),
        created_at: payment().created_at,
    };
    let value = wire::payment_refunded(&payment(), &refund, Decimal::new(20_000, 4), PaymentStatus::PartiallyRefunded);
    golden("payment_refunded.json", &serde_json::to_string_pretty(&value).expect("json"));
}

#[test]
fn order_events_are_read_as_documented() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let placed: OrderEvent =
        serde_json::from_str(&std::fs::read_to_string(dir.join("order_placed.json")).expect("file")).expect("parse");
    assert_eq!(
        placed,
        OrderEvent::OrderPlaced {
            order_id: Uuid::from_u128(0x0193_a000_0000_7000_8000_0000_0000_0002),
            customer_id: Uuid::from_u128(0x0193_a000_0000_7000_8000_0000_0000_0003),
            amount: "12.34".into(),
            currency: "EUR".into(),
            provider: Some("stripe".into()),
            external_payment_id: Some("pi_123".into()),
            payment_method: None,
            version: 1,
        }
    );
    let cancelled: OrderEvent =
        serde_json::from_str(&std::fs::read_to_string(dir.join("order_cancelled.json")).expect("file")).expect("parse");
    assert_eq!(
        cancelled,
        OrderEvent::OrderCancelled { order_id: Uuid::from_u128(0x0193_a000_0000_7000_8000_0000_0000_0002), version: 2 }
    );
}

#[test]
fn header_names() {
    let names = [
        headers::EVENT_ID,
        headers::SAGA_ID,
        headers::EVENT_TYPE,
        headers::AGGREGATE_TYPE,
        headers::CONTENT_TYPE,
        headers::TRACEPARENT,
        headers::REDRIVEN_FROM,
        headers::dlq::REASON,
        headers::dlq::ERROR,
        headers::dlq::ORIGINAL_TOPIC,
        headers::dlq::ORIGINAL_PARTITION,
        headers::dlq::ORIGINAL_OFFSET,
        headers::dlq::CONSUMER_GROUP,
        headers::dlq::FAILED_AT,
        headers::dlq::ORIGINAL_SIZE,
    ];
    golden("headers.txt", &(names.join("\n") + "\n"));
    assert!(names.iter().filter(|n| n.starts_with(headers::dlq::PREFIX)).count() == 8);
}

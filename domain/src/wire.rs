//! Wire formats: every message header name and event payload the payment service sends or reads, in one
//! place. Other services depend on these bytes; `domain/tests/wire.rs` pins them with golden files, so a
//! change here is a deliberate, visible contract change.

use idem_ports::{PaymentRecord, PaymentStatus, RefundRecord};
use rust_decimal::Decimal;
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::money::format_amount;

/// Kafka header names.
pub mod headers {
    /// The message's id (UUID v7 for idem's own messages): the key every receiver dedups by.
    pub const EVENT_ID: &str = "event_id";
    /// The saga a message belongs to (compensations are claimed per `saga_id` and step).
    pub const SAGA_ID: &str = "saga_id";
    /// The event type (`PaymentCaptured`, …).
    pub const EVENT_TYPE: &str = "event_type";
    /// The aggregate type (`payment`).
    pub const AGGREGATE_TYPE: &str = "aggregate_type";
    /// Always `application/json`.
    pub const CONTENT_TYPE: &str = "content-type";
    /// W3C trace context of the request that wrote the message.
    pub const TRACEPARENT: &str = "traceparent";
    /// Set on a message re-driven from the dead-letter topic: `<dlq topic>/<partition>/<offset>`.
    pub const REDRIVEN_FROM: &str = "idem.redriven-from";

    /// Provenance headers the consumer adds to a dead letter (the original headers are kept too).
    pub mod dlq {
        /// Prefix of every provenance header.
        pub const PREFIX: &str = "dlq.";
        /// Why it was dead-lettered (`malformed`, `rejected`, `older-than-dedup-window`, …).
        pub const REASON: &str = "dlq.reason";
        /// What failed (field and position, never payload values).
        pub const ERROR: &str = "dlq.error";
        /// The topic it was read from.
        pub const ORIGINAL_TOPIC: &str = "dlq.original.topic";
        /// The partition it was read from.
        pub const ORIGINAL_PARTITION: &str = "dlq.original.partition";
        /// Its offset there.
        pub const ORIGINAL_OFFSET: &str = "dlq.original.offset";
        /// The consumer group that refused it.
        pub const CONSUMER_GROUP: &str = "dlq.consumer.group";
        /// When (RFC 3339).
        pub const FAILED_AT: &str = "dlq.failed.at";
        /// On a dead letter cut to fit (its payload and headers shortened): the original payload's size in
        /// bytes. The whole message is at its original position.
        pub const ORIGINAL_SIZE: &str = "dlq.original.size";
    }
}

/// Value of the `content-type` header of every message idem publishes.
pub const JSON: &str = "application/json";

/// Version of the payment events' body: 1 (no `schema_version` field) had no merchant; 2 adds
/// `merchant_id`, so receivers can scope a payment to its merchant. Fields are only ever added.
pub const PAYMENT_EVENT_SCHEMA: u32 = 2;

/// `PaymentCaptured`, announced (keyed by the order id) when a payment is created.
pub fn payment_captured(payment: &PaymentRecord) -> Value {
    json!({
        "type": "PaymentCaptured",
        "schema_version": PAYMENT_EVENT_SCHEMA,
        "merchant_id": payment.merchant_id,
        "payment_id": payment.id,
        "order_id": payment.order_id,
        "customer_id": payment.customer_id,
        "provider": payment.provider,
        "external_payment_id": payment.external_payment_id,
        "amount": format_amount(payment.amount, &payment.currency),
        "currency": payment.currency,
    })
}

/// `PaymentRefunded`, announced (keyed by the order id) for every refund.
pub fn payment_refunded(
    payment: &PaymentRecord,
    refund: &RefundRecord,
    refunded_total: Decimal,
    status: PaymentStatus,
) -> Value {
    json!({
        "type": "PaymentRefunded",
        "schema_version": PAYMENT_EVENT_SCHEMA,
        "merchant_id": payment.merchant_id,
        "payment_id": payment.id,
        "refund_id": refund.id,
        "order_id": payment.order_id,
        "amount": format_amount(refund.amount, &payment.currency),
        "currency": payment.currency,
        "refunded_total": format_amount(refunded_total, &payment.currency),
        "status": status,
    })
}

/// The order events the payment service consumes (tag `type`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "type")]
pub enum OrderEvent {
    /// An order was placed: charge it.
    OrderPlaced {
        /// The order.
        order_id: Uuid,
        /// Who pays.
        customer_id: Uuid,
        /// Decimal string.
        amount: String,
        /// ISO 4217 code.
        currency: String,
        /// Payment provider (the recording flow: the producer charged already).
        #[serde(default)]
        provider: Option<String>,
        /// The provider's payment id (with `provider`).
        #[serde(default)]
        external_payment_id: Option<String>,
        /// The provider's token of the card (instead of `provider` and `external_payment_id`): idem charges
        /// it through the payment provider, in phases keyed by the event.
        #[serde(default)]
        payment_method: Option<String>,
        /// The order's version; older or repeated versions change nothing.
        version: i64,
    },
    /// An order was cancelled: refund what is left (a saga step, with the `saga_id` header).
    OrderCancelled {
        /// The order.
        order_id: Uuid,
        /// The order's version.
        version: i64,
    },
}

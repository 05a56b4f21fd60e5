//! Plain data crossing the ports. Values here were validated by the domain before they were built; the
//! adapters store and load them as they are.

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Life cycle of a payment as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PaymentStatus {
    Pending,
    Captured,
    PartiallyRefunded,
    Refunded,
}

impl PaymentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Captured => "captured",
            Self::PartiallyRefunded => "partially_refunded",
            Self::Refunded => "refunded",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => Self::Pending,
            "captured" => Self::Captured,
            "partially_refunded" => Self::PartiallyRefunded,
            "refunded" => Self::Refunded,
            _ => return None,
        })
    }
}

/// A payment to insert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPayment {
    pub id: Uuid,
    pub merchant_id: String,
    pub order_id: Uuid,
    pub customer_id: Uuid,
    pub provider: String,
    pub external_payment_id: String,
    pub amount: Decimal,
    pub currency: String,
    pub status: PaymentStatus,
    pub created_at: DateTime<Utc>,
}

/// A stored payment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaymentRecord {
    pub id: Uuid,
    pub merchant_id: String,
    pub order_id: Uuid,
    pub customer_id: Uuid,
    pub provider: String,
    pub external_payment_id: String,
    pub amount: Decimal,
    pub currency: String,
    pub status: PaymentStatus,
    /// Sum of all refunds so far; never above `amount`.
    pub refunded_amount: Decimal,
    pub created_at: DateTime<Utc>,
}

/// Result of inserting a payment that may already exist under the same (provider, external_payment_id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PaymentInsert {
    /// The row was new and is now part of the transaction.
    Inserted(PaymentRecord),
    /// A committed payment with the same (provider, external_payment_id) exists; it is returned as stored.
    Existing(PaymentRecord),
}

/// A refund to insert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRefund {
    pub id: Uuid,
    pub payment_id: Uuid,
    pub amount: Decimal,
    pub reason: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// A stored refund.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundRecord {
    pub id: Uuid,
    pub payment_id: Uuid,
    pub amount: Decimal,
    pub reason: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// Whether an idempotency record describes a request that is still executing or one whose response is
/// stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdempotencyState {
    InFlight,
    Completed,
}

/// The response stored for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status_code: u16,
    /// Headers to replay, already filtered through the replay allow-list, in order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// A stored idempotency record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyRecord {
    pub scope: String,
    pub key: String,
    /// SHA-256 of the request (method, route, canonical body).
    pub command_hash: [u8; 32],
    pub state: IdempotencyState,
    /// Present when `state` is `Completed`.
    pub response: Option<StoredResponse>,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

/// A claim on an idempotency key: the row written, in flight, inside the caller's transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyClaim {
    pub scope: String,
    pub key: String,
    pub command_hash: [u8; 32],
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

/// Outcome of [`crate::IdempotencyRepository::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The key was free (or its record had expired): the claim row now belongs to this transaction, and
    /// concurrent claims of the same key wait for it to commit or roll back.
    Claimed,
    /// A live record exists for the key; the caller decides (replay, conflict, in flight).
    Existing(IdempotencyRecord),
}

/// A message to publish through the transactional outbox.
#[derive(Debug, Clone, PartialEq)]
pub struct NewOutboxMessage {
    /// UUID v7, generated once when the row is written; sent as the `event_id` header on every publish.
    pub id: Uuid,
    pub topic: String,
    /// Aggregate type, for example `payment` (Debezium's `aggregatetype`).
    pub aggregate_type: String,
    /// Aggregate id; also the message key (the order id), so one order's messages share a partition.
    pub aggregate_id: String,
    /// Event type, for example `PaymentCaptured`.
    pub event_type: String,
    pub payload: serde_json::Value,
    pub saga_id: Option<Uuid>,
    /// W3C `traceparent` of the request that wrote the row, when it had one.
    pub traceparent: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// An event to mark as processed by one consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessedEvent {
    pub event_id: Uuid,
    pub topic: String,
}

/// Outcome of claiming a saga step.
#[derive(Debug, Clone, PartialEq)]
pub enum SagaStepClaim {
    /// The step had not run for this saga: it is now claimed in the caller's transaction.
    Claimed,
    /// The step already ran; its recorded outcome is returned.
    Done(serde_json::Value),
}

/// The projection of an order kept by the event handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderVersion {
    pub order_id: Uuid,
    pub version: i64,
    pub status: String,
}

/// A message received from a topic, with its identifying headers already validated by the runner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundEvent {
    /// The `event_id` header: the dedup key.
    pub event_id: Uuid,
    /// The `saga_id` header, when present.
    pub saga_id: Option<Uuid>,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
}

/// An unpublished outbox row claimed by a relay.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRecord {
    pub id: Uuid,
    pub topic: String,
    pub aggregate_type: String,
    /// The message key.
    pub aggregate_id: String,
    pub event_type: String,
    /// The payload as JSON text, exactly as stored (published without re-serializing).
    pub payload: String,
    /// Extra headers stored with the row (for example `traceparent`).
    pub headers: Vec<(String, String)>,
    pub saga_id: Option<Uuid>,
    pub created_at: DateTime<Utc>,
    pub attempts: i32,
}

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
    /// Written before the payment provider is called; not yet charged (no provider charge id yet).
    Pending,
    /// Captured in full; refundable.
    Captured,
    /// Part of the captured amount was refunded.
    PartiallyRefunded,
    /// Refunded in full; nothing left to refund.
    Refunded,
    /// The payment provider declined the charge (a final answer): nothing was charged.
    Declined,
}

impl PaymentStatus {
    /// The stored text (`pending`, `captured`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Captured => "captured",
            Self::PartiallyRefunded => "partially_refunded",
            Self::Refunded => "refunded",
            Self::Declined => "declined",
        }
    }

    /// Reads the stored text; `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => Self::Pending,
            "captured" => Self::Captured,
            "partially_refunded" => Self::PartiallyRefunded,
            "refunded" => Self::Refunded,
            "declined" => Self::Declined,
            _ => return None,
        })
    }
}

/// A payment to insert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPayment {
    /// UUID v7 chosen by the caller (the payment id clients see).
    pub id: Uuid,
    /// The merchant that owns the payment (the authenticated merchant, or the order stream's).
    pub merchant_id: String,
    /// The order the payment belongs to; also the outbox key of its announcements.
    pub order_id: Uuid,
    /// The paying customer.
    pub customer_id: Uuid,
    /// Payment provider, 1–64 printable ASCII characters.
    pub provider: String,
    /// The provider's payment id; `(provider, external_payment_id)` is unique across merchants.
    pub external_payment_id: String,
    /// Positive, at most 4 decimals and no finer than the currency's minor unit.
    pub amount: Decimal,
    /// ISO 4217 code.
    pub currency: String,
    /// Initial status (`Captured` for charges).
    pub status: PaymentStatus,
    /// When the use case created it (from the `Clock`).
    pub created_at: DateTime<Utc>,
}

/// A stored payment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaymentRecord {
    /// The payment id.
    pub id: Uuid,
    /// The owning merchant.
    pub merchant_id: String,
    /// The order the payment belongs to.
    pub order_id: Uuid,
    /// The paying customer.
    pub customer_id: Uuid,
    /// Payment provider.
    pub provider: String,
    /// The provider's payment id (`None` while a charge through the provider is pending or was declined).
    pub external_payment_id: Option<String>,
    /// The captured amount (scale 4 as stored).
    pub amount: Decimal,
    /// ISO 4217 code.
    pub currency: String,
    /// Current status.
    pub status: PaymentStatus,
    /// Sum of all refunds so far; never above `amount`.
    pub refunded_amount: Decimal,
    /// When the payment was created.
    pub created_at: DateTime<Utc>,
    /// Charged by idem itself through the configured payment provider (a `payment_method`): its refunds go
    /// to the provider. A payment recorded with a provider's name names a charge made elsewhere, and its
    /// refunds are recorded in idem only.
    pub through_provider: bool,
}

/// Result of inserting a payment that may already exist under the same (provider, external_payment_id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PaymentInsert {
    /// The row was new and is now part of the transaction.
    Inserted(PaymentRecord),
    /// A committed payment with the same (provider, external_payment_id) exists; it is returned as stored.
    Existing(PaymentRecord),
}

/// A payment written `pending` before its charge at the payment provider (the intent of the first phase):
/// it has no provider charge id until it is captured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPendingPayment {
    /// The payment id (derived from the request's key, so every attempt names the same payment).
    pub id: Uuid,
    /// The merchant that owns the payment.
    pub merchant_id: String,
    /// The order the payment belongs to.
    pub order_id: Uuid,
    /// The paying customer.
    pub customer_id: Uuid,
    /// The provider charged (its configured name).
    pub provider: String,
    /// Positive, no finer than the currency's minor unit.
    pub amount: Decimal,
    /// ISO 4217 code.
    pub currency: String,
    /// When the use case created it.
    pub created_at: DateTime<Utc>,
}

/// A refund to insert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRefund {
    /// UUID v7 chosen by the caller.
    pub id: Uuid,
    /// The refunded payment.
    pub payment_id: Uuid,
    /// Positive, no more than what is left to refund.
    pub amount: Decimal,
    /// Free text (at most 500 characters, no control characters), if given.
    pub reason: Option<String>,
    /// When the use case created it.
    pub created_at: DateTime<Utc>,
}

/// A stored refund.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundRecord {
    /// The refund id.
    pub id: Uuid,
    /// The refunded payment.
    pub payment_id: Uuid,
    /// The refunded amount.
    pub amount: Decimal,
    /// The reason given, if any.
    pub reason: Option<String>,
    /// When the refund was created.
    pub created_at: DateTime<Utc>,
}

/// Whether an idempotency record describes a request that is still executing or one whose response is
/// stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdempotencyState {
    /// The first request with the key is executing (its transaction holds the claim).
    InFlight,
    /// The response is stored and is replayed to later requests with the key.
    Completed,
}

/// The response stored for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status of the first execution.
    pub status_code: u16,
    /// Headers to replay, already filtered through the replay allow-list, in order.
    pub headers: Vec<(String, String)>,
    /// Body bytes, replayed byte for byte.
    pub body: Vec<u8>,
}

/// A stored idempotency record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyRecord {
    /// Whose key it is (the merchant, for the payments API).
    pub scope: String,
    /// The `Idempotency-Key` as the client sent it (bare form).
    pub key: String,
    /// SHA-256 of the request (method, route, canonical body).
    pub command_hash: [u8; 32],
    /// Executing or completed.
    pub state: IdempotencyState,
    /// Present when `state` is `Completed`.
    pub response: Option<StoredResponse>,
    /// When the key was claimed.
    pub created_at: DateTime<Utc>,
    /// After this the record counts as absent and the cleaner deletes it (not while it is held between
    /// the phases of a foreign call: its retention counts from completion).
    pub expires_at: DateTime<Utc>,
    /// Between the phases of a foreign call: the attempt holding it, until when, and where a resumed attempt
    /// starts (`None` for a record claimed in one transaction).
    pub phase: Option<PhaseHold>,
}

/// A record committed between the phases of a foreign call (see `idem_domain::phases`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhaseHold {
    /// The attempt holding it (1 for the first, one more per takeover): the fencing token.
    pub attempt: u32,
    /// When its lease lapses unless renewed, on the database's clock (as read; a write's own estimate).
    pub lease_until: DateTime<Utc>,
    /// The lease a write holds: from the database's clock at the write, never a host's (a host whose clock
    /// is ahead would otherwise take over a live lease, or write one that is already lapsed).
    pub lease: std::time::Duration,
    /// After an unknown outcome: the earliest next call (the other side's `Retry-After`, else a backoff), on
    /// the database's clock; no attempt takes the record over before it (as read; writes leave it).
    pub not_before: Option<DateTime<Utc>>,
    /// Which claim of the key this is (its time in microseconds; `None` before it was recorded): intent ids
    /// and downstream keys derive from it (`idem_domain::phases::generational_key`). As read.
    pub generation: Option<i64>,
    /// The last recovery point reached.
    pub recovery_point: String,
    /// The request that started it, kept with the first hold so the completer can drive it to completion
    /// (`None`: keep what is stored — a renewal, a later recovery point).
    pub request: Option<StoredRequest>,
}

/// A request as the completer re-sends it: what its idempotency fingerprint was computed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRequest {
    /// `POST`, …
    pub method: String,
    /// Path and query.
    pub uri: String,
    /// Its `Content-Type`, if any.
    pub content_type: Option<String>,
    /// Its body, byte for byte.
    pub body: Vec<u8>,
}

/// A request held for the completer from the start (a consumer's event that charges through a provider):
/// the completer sends it at its next round, and the phases run as for any HTTP request with its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldRequest {
    /// Whose key (the principal the completer sends it as).
    pub scope: String,
    /// The key (`event:<event_id>`).
    pub key: String,
    /// The request's fingerprint, as the idempotency layer computes it.
    pub command_hash: [u8; 32],
    /// The request.
    pub request: StoredRequest,
    /// When it was held.
    pub created_at: DateTime<Utc>,
    /// Its retention (counted from completion once completed).
    pub expires_at: DateTime<Utc>,
}

/// A record held between phases whose lease lapsed long enough ago that its client is taken to have gone
/// away: the completer's to finish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LapsedRecord {
    /// Whose key.
    pub scope: String,
    /// The key.
    pub key: String,
    /// The request to re-send (`None`: none was kept; the record can only be parked).
    pub request: Option<StoredRequest>,
    /// When the key was claimed (the other side's idempotency window counts from about then).
    pub created_at: DateTime<Utc>,
    /// How often the completer ran it already.
    pub completer_runs: u32,
}

/// A claim on an idempotency key: the row written, in flight, inside the caller's transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyClaim {
    /// Whose key it is.
    pub scope: String,
    /// The `Idempotency-Key`.
    pub key: String,
    /// SHA-256 of the request (method, route, canonical body).
    pub command_hash: [u8; 32],
    /// When the claim is made.
    pub created_at: DateTime<Utc>,
    /// `created_at` plus the idempotency TTL.
    pub expires_at: DateTime<Utc>,
}

/// Outcome of [`crate::IdempotencyRepository::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)] // one per claim, moved once: not worth an allocation per replay
pub enum ClaimOutcome {
    /// The key was free (or its record had expired): the claim row now belongs to this transaction, and
    /// concurrent claims of the same key wait for it to commit or roll back.
    Claimed,
    /// A live record exists for the key; the caller decides (replay, conflict, in flight).
    Existing(IdempotencyRecord),
}

/// A held request [`crate::IdempotencyRepository::cancel_unstarted`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldCall {
    /// Its call never started: cancelled, completed with the given answer.
    Cancelled,
    /// An attempt took it: its call may be in process; it ends on its own (wait for it).
    InProgress,
}

/// Outcome of [`crate::IdempotencyRepository::take_over`], decided on the database's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeOver {
    /// The next attempt holds the record now; `past_window`: its first claim is older than the other
    /// side's idempotency window, so its call must not be sent again under its key (look the outcome up).
    Taken {
        /// Older than the window given to `take_over`.
        past_window: bool,
    },
    /// Parked for an operator: nobody takes it over until `idem keys resume` or `abandon`.
    Parked,
    /// Its lease is live (or it was renewed, completed or taken over meanwhile): in flight.
    Held,
    /// Its last call's outcome is unknown and the other side asked to wait (or a backoff runs): no call
    /// before this much longer.
    NotBefore(std::time::Duration),
}

/// A message to publish through the transactional outbox.
#[derive(Debug, Clone, PartialEq)]
pub struct NewOutboxMessage {
    /// UUID v7, generated once when the row is written; sent as the `event_id` header on every publish.
    pub id: Uuid,
    /// Topic to publish to.
    pub topic: String,
    /// Aggregate type, for example `payment` (Debezium's `aggregatetype`).
    pub aggregate_type: String,
    /// Aggregate id; also the message key (the order id), so one order's messages share a partition.
    pub aggregate_id: String,
    /// Event type, for example `PaymentCaptured`.
    pub event_type: String,
    /// The message body (JSON).
    pub payload: serde_json::Value,
    /// The saga this message belongs to, sent as the `saga_id` header.
    pub saga_id: Option<Uuid>,
    /// W3C `traceparent` of the request that wrote the row, when it had one.
    pub traceparent: Option<String>,
    /// When the business transaction wrote it (commit-to-publish latency is measured from here).
    pub created_at: DateTime<Utc>,
}

impl NewOutboxMessage {
    /// A message for `topic` keyed by `key` (its partition, and the order of the key's messages), of
    /// `event_type` with `payload`. Its id is a new UUID v7 from `ids` — the `event_id` header receivers
    /// deduplicate by, whose time bounds their dedup window — and `created_at` is `clock`'s now. The
    /// aggregate type defaults to the topic; no saga, no trace context (see the setters).
    pub fn new(
        ids: &dyn crate::IdGenerator,
        clock: &dyn crate::Clock,
        topic: impl Into<String>,
        key: impl Into<String>,
        event_type: impl Into<String>,
        payload: serde_json::Value,
    ) -> Self {
        let topic = topic.into();
        Self {
            id: ids.new_id(),
            aggregate_type: topic.clone(),
            topic,
            aggregate_id: key.into(),
            event_type: event_type.into(),
            payload,
            saga_id: None,
            traceparent: None,
            created_at: clock.now(),
        }
    }

    /// Sets the aggregate type (Debezium's `aggregatetype`, for example `payment`).
    pub fn aggregate_type(mut self, aggregate_type: impl Into<String>) -> Self {
        self.aggregate_type = aggregate_type.into();
        self
    }

    /// Sets the saga the message belongs to (sent as the `saga_id` header).
    pub fn saga(mut self, saga_id: Uuid) -> Self {
        self.saga_id = Some(saga_id);
        self
    }

    /// Sets the W3C `traceparent` of the request that wrote the row.
    pub fn traceparent(mut self, traceparent: Option<String>) -> Self {
        self.traceparent = traceparent;
        self
    }
}

/// An event to mark as processed by one consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessedEvent {
    /// The event's `event_id` header.
    pub event_id: Uuid,
    /// The topic it came from (kept for diagnostics).
    pub topic: String,
    /// When the row may be deleted (`TtlPolicy::retain_until`: a retention after the later of processing
    /// time and the time the id carries).
    pub expires_at: DateTime<Utc>,
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
    /// The order.
    pub order_id: Uuid,
    /// The highest version applied; older or equal versions change nothing.
    pub version: i64,
    /// The order's status at that version.
    pub status: String,
}

/// A message received from a topic, with its identifying headers already validated by the runner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundEvent {
    /// The `event_id` header: the dedup key.
    pub event_id: Uuid,
    /// The `saga_id` header, when present.
    pub saga_id: Option<Uuid>,
    /// Topic it was read from.
    pub topic: String,
    /// Partition it was read from.
    pub partition: i32,
    /// Its offset in that partition.
    pub offset: i64,
    /// The message key, if any.
    pub key: Option<Vec<u8>>,
    /// The raw message body.
    pub payload: Vec<u8>,
    /// Every header of the message, in order (`event_id`, `event_type`, `traceparent`, …).
    pub headers: Vec<(String, Vec<u8>)>,
}

impl InboundEvent {
    /// The value of the header `name` (the first, when repeated; names compared ignoring case).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
    }

    /// The `event_type` header idem's relay sends (the outbox row's type), for handlers that take several
    /// kinds of event: dispatch on it instead of parsing every payload first.
    pub fn event_type(&self) -> Option<&str> {
        self.header("event_type").and_then(|v| std::str::from_utf8(v).ok())
    }
}

/// An unpublished outbox row claimed by a relay.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRecord {
    /// The row id: the `event_id` of every publish of this row.
    pub id: Uuid,
    /// Topic to publish to.
    pub topic: String,
    /// Aggregate type (`aggregatetype`).
    pub aggregate_type: String,
    /// The message key.
    pub aggregate_id: String,
    /// Event type, sent as the `event_type` header.
    pub event_type: String,
    /// The payload as JSON text, exactly as stored (published without re-serializing).
    pub payload: String,
    /// Extra headers stored with the row (for example `traceparent`).
    pub headers: Vec<(String, String)>,
    /// The saga id, sent as the `saga_id` header.
    pub saga_id: Option<Uuid>,
    /// When the business transaction wrote it.
    pub created_at: DateTime<Utc>,
    /// Failed publish attempts so far (quarantined after a bound).
    pub attempts: i32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_reads_its_headers_and_type() {
        let event = InboundEvent {
            event_id: Uuid::from_u128(1),
            saga_id: None,
            topic: "t".into(),
            partition: 0,
            offset: 0,
            key: None,
            payload: Vec::new(),
            headers: vec![("Event_Type".into(), b"PaymentCaptured".to_vec()), ("x".into(), vec![0xff])],
        };
        assert_eq!(event.event_type(), Some("PaymentCaptured"));
        assert_eq!(event.header("x"), Some(&[0xff][..]));
        assert_eq!(event.header("missing"), None);
    }
}

//! The reference service's order-event handler: `OrderPlaced` charges, `OrderCancelled` refunds as a
//! compensation step, and an order projection only moves forward by version.

use std::sync::Arc;

use async_trait::async_trait;
use idem_ports::{
    BatchError, Clock, EventHandler, HandlerError, HeldCall, HeldRequest, IdGenerator, InboundEvent, PaymentStatus,
    PaymentUnitOfWork, PaymentsOf, StoredRequest, StoredResponse, UnitOfWork,
};
use serde_json::json;
use uuid::Uuid;

use super::{
    ChargeCommand, ChargeError, Env, RefundCommand, RefundError, charge_payment, charge_payments, refund_payment,
};
use crate::events::SagaStep;
use crate::money::{Amount, Currency, Money, format_amount};
use crate::payment::refundable;
use crate::saga::{StepStart, begin_step, finish_step};

/// How long the answer of a charge through the provider that an event started is kept after it completed
/// (the held request's retention, as an HTTP request's under the default `IDEMPOTENCY_TTL`).
pub const EVENT_CHARGE_RETENTION_HOURS: i64 = 48;

/// Name of the compensation step run for a cancelled order.
pub const REFUND_STEP: &str = "refund-payment";

/// The key of the request `POST /payments` an `OrderPlaced` with a `payment_method` holds for the
/// completer: one per order, so a cancellation finds it (and a second `OrderPlaced` of the order charges
/// nothing more).
pub fn order_charge_key(order_id: Uuid) -> String {
    format!("order:{order_id}")
}

/// The key of the refund request a cancellation holds for the completer: its saga's step.
pub fn compensation_refund_key(saga_id: Uuid) -> String {
    format!("saga:{saga_id}:{REFUND_STEP}")
}

use crate::wire::OrderEvent;

/// Handles `OrderPlaced` / `OrderCancelled` events.
#[derive(Clone)]
pub struct OrderEventHandler {
    /// The source of time.
    pub clock: Arc<dyn Clock>,
    /// The source of ids.
    pub ids: Arc<dyn IdGenerator>,
    /// Topic payment events are announced on.
    pub payments_topic: String,
    /// The merchant that payments created from order events belong to.
    pub merchant_id: String,
    /// The payment repositories in the unit of work the consumer runner hands the handler.
    pub payments_of: PaymentsOf,
    /// The service charges through a payment provider: an `OrderPlaced` with a `payment_method` becomes
    /// a held request the completer drives (without one, such events are rejected).
    pub charges_through_provider: bool,
}

impl std::fmt::Debug for OrderEventHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrderEventHandler").field("merchant_id", &self.merchant_id).finish_non_exhaustive()
    }
}

fn malformed(e: impl std::fmt::Display) -> HandlerError {
    HandlerError::Malformed(e.to_string())
}

impl OrderEventHandler {
    fn env(&self) -> Env<'_> {
        Env { clock: &*self.clock, ids: &*self.ids, payments_topic: &self.payments_topic }
    }
}

/// A validated order event.
struct Parsed {
    order_id: Uuid,
    version: i64,
    action: Action,
}

enum Action {
    Charge(ChargeCommand),
    /// A charge through the provider: the `POST /payments` request the completer sends for the event.
    ChargeThroughProvider(Vec<u8>),
    Compensate(SagaStep),
}

impl Parsed {
    fn status(&self) -> &'static str {
        match self.action {
            Action::Charge(_) | Action::ChargeThroughProvider(_) => "placed",
            Action::Compensate(_) => "cancelled",
        }
    }
}

/// The largest order `version` an event may carry: an order's history never reaches a million changes, and
/// a producer that sent `i64::MAX` froze the order's projection for good (every real later version is
/// "older"). Beyond it the event is malformed (dead-lettered).
pub const MAX_ORDER_VERSION: i64 = 1_000_000;

impl OrderEventHandler {
    /// Validates an event completely before anything is written.
    fn parse(&self, event: &InboundEvent) -> Result<Parsed, HandlerError> {
        let body: OrderEvent = crate::json::read(&event.payload).map_err(HandlerError::Malformed)?;
        let (order_id, version) = match &body {
            OrderEvent::OrderPlaced { order_id, version, .. } | OrderEvent::OrderCancelled { order_id, version } => {
                (*order_id, *version)
            }
        };
        if let Some(key) = &event.key
            && key.as_slice() != order_id.to_string().as_bytes()
        {
            return Err(malformed("message key must be the order id"));
        }
        if !(0..=MAX_ORDER_VERSION).contains(&version) {
            return Err(malformed("version must be between 0 and 1000000"));
        }
        let action = match body {
            OrderEvent::OrderPlaced {
                customer_id,
                amount,
                currency,
                provider,
                external_payment_id,
                payment_method,
                ..
            } => {
                let money = Money::new(
                    Amount::parse(&amount).map_err(malformed)?,
                    Currency::parse(&currency).map_err(malformed)?,
                )
                .map_err(malformed)?;
                match (provider, external_payment_id, payment_method) {
                    (Some(provider), Some(external_payment_id), None) => {
                        let mut cmd = ChargeCommand::new(
                            &self.merchant_id,
                            order_id,
                            customer_id,
                            &provider,
                            &external_payment_id,
                            money,
                        )
                        .map_err(malformed)?;
                        if let Some(id) = event.saga_id {
                            cmd = cmd.with_saga(id);
                        }
                        Action::Charge(cmd)
                    }
                    (None, None, Some(payment_method)) => {
                        if !self.charges_through_provider {
                            return Err(HandlerError::Rejected(
                                "a payment_method needs a payment provider, and none is configured".into(),
                            ));
                        }
                        // validated as the API validates it; the completer sends exactly this request
                        super::ProviderChargeCommand::new(
                            &self.merchant_id,
                            order_id,
                            customer_id,
                            money,
                            &payment_method,
                        )
                        .map_err(malformed)?;
                        let body = json!({
                            "order_id": order_id, "customer_id": customer_id, "amount": amount,
                            "currency": currency, "payment_method": payment_method,
                        });
                        Action::ChargeThroughProvider(body.to_string().into_bytes())
                    }
                    _ => {
                        return Err(malformed(
                            "an OrderPlaced names either provider and external_payment_id, or payment_method",
                        ));
                    }
                }
            }
            OrderEvent::OrderCancelled { .. } => {
                let saga_id = event.saga_id.ok_or_else(|| malformed("OrderCancelled needs a saga_id header"))?;
                Action::Compensate(SagaStep::new(saga_id, REFUND_STEP).map_err(malformed)?)
            }
        };
        Ok(Parsed { order_id, version, action })
    }

    async fn apply(&self, uow: &mut dyn PaymentUnitOfWork, event: Parsed) -> Result<(), HandlerError> {
        // Older or repeated versions are skipped: the projection never moves backwards or twice.
        let now = self.clock.now();
        if !uow.projections().apply_order_version(event.order_id, event.version, event.status(), now).await? {
            return Ok(());
        }
        match event.action {
            Action::Charge(cmd) => match charge_payment(uow, self.env(), &cmd).await {
                Ok(_) => Ok(()),
                Err(e) => Err(charge_failure(e)),
            },
            Action::ChargeThroughProvider(body) => {
                // the charge's phases run as the request `POST /payments` under the key `order:<order_id>`:
                // held here, in the event's transaction, for the completer to send (at its next round)
                let request = StoredRequest {
                    method: "POST".into(),
                    uri: "/payments".into(),
                    content_type: Some("application/json".into()),
                    body,
                };
                let held = HeldRequest {
                    scope: self.merchant_id.clone(),
                    key: order_charge_key(event.order_id),
                    command_hash: *crate::idempotency::Fingerprint::of_request("POST", "/payments", &request.body)
                        .as_bytes(),
                    request,
                    created_at: now,
                    expires_at: now + chrono::Duration::hours(EVENT_CHARGE_RETENTION_HOURS),
                };
                uow.idempotency().enqueue_held(&held).await?;
                Ok(())
            }
            Action::Compensate(step) => {
                if let StepStart::Done(_) = begin_step(uow, &step, now).await? {
                    return Ok(());
                }
                let outcome = self.compensate(uow, event.order_id, step.saga_id(), now).await?;
                finish_step(uow, &step, &outcome).await?;
                Ok(())
            }
        }
    }
}

fn charge_failure(e: ChargeError) -> HandlerError {
    match e {
        ChargeError::DetailsDiffer { existing } => HandlerError::Rejected(format!(
            "payment {existing} already uses this provider and external payment id with other details"
        )),
        ChargeError::TakenByAnotherMerchant { .. } => {
            HandlerError::Rejected("the provider and external payment id are taken by another merchant".into())
        }
        ChargeError::Store(e) => e.into(),
    }
}

#[async_trait]
impl EventHandler for OrderEventHandler {
    async fn handle(&self, uow: &mut dyn UnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
        let parsed = self.parse(event)?;
        self.apply((self.payments_of)(uow)?, parsed).await
    }

    /// Set-based when every event is an `OrderPlaced` of a distinct order (the common case): one statement
    /// for the projection, one for the payments, one for the announcements. Anything else (an order twice
    /// in the batch, a cancellation) runs event by event.
    async fn handle_batch(&self, uow: &mut dyn UnitOfWork, events: &[&InboundEvent]) -> Result<(), BatchError> {
        let uow = (self.payments_of)(uow).map_err(|e| BatchError { index: 0, error: e.into() })?;
        let mut parsed = Vec::with_capacity(events.len());
        for (index, event) in events.iter().enumerate() {
            parsed.push(self.parse(event).map_err(|error| BatchError { index, error })?);
        }
        let orders: std::collections::HashSet<Uuid> = parsed.iter().map(|p| p.order_id).collect();
        let all_charges = parsed.iter().all(|p| matches!(p.action, Action::Charge(_)));
        if events.len() == 1 || orders.len() != parsed.len() || !all_charges {
            for (index, p) in parsed.into_iter().enumerate() {
                self.apply(uow, p).await.map_err(|error| BatchError { index, error })?;
            }
            return Ok(());
        }
        let store = |error: idem_ports::StoreError| BatchError { index: 0, error: error.into() };
        let now = self.clock.now();
        let versions: Vec<(Uuid, i64, String)> =
            parsed.iter().map(|p| (p.order_id, p.version, p.status().to_owned())).collect();
        let applied: std::collections::HashSet<Uuid> =
            uow.projections().apply_order_versions(&versions, now).await.map_err(store)?.into_iter().collect();
        let charges: Vec<(usize, &ChargeCommand)> = parsed
            .iter()
            .enumerate()
            .filter(|(_, p)| applied.contains(&p.order_id))
            .filter_map(|(i, p)| match &p.action {
                Action::Charge(cmd) => Some((i, cmd)),
                Action::ChargeThroughProvider(_) | Action::Compensate(_) => None,
            })
            .collect();
        let cmds: Vec<&ChargeCommand> = charges.iter().map(|(_, c)| *c).collect();
        let outcomes = charge_payments(uow, self.env(), &cmds).await.map_err(store)?;
        for ((index, _), outcome) in charges.iter().zip(outcomes) {
            if let Err(e) = outcome {
                return Err(BatchError { index: *index, error: charge_failure(e) });
            }
        }
        Ok(())
    }
}

impl OrderEventHandler {
    /// Refunds what is left of the order's payment — only a payment of the order stream's own merchant:
    /// HTTP merchants choose order ids freely, so an order id alone must never reach their payments.
    ///
    /// A charge through the provider is never left to happen after its order was cancelled, and its money
    /// is returned by the provider, not in idem only: a held charge whose call never started is cancelled
    /// under its record's lock; one whose call may be out (or whose payment is still `pending`) makes the
    /// event wait (a transient failure: retried until the charge is final); a captured one is refunded
    /// through the provider, in phases under the saga step's key, by the completer — `PaymentRefunded` is
    /// announced once the provider confirmed.
    async fn compensate(
        &self,
        uow: &mut dyn PaymentUnitOfWork,
        order_id: Uuid,
        saga_id: Uuid,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<serde_json::Value, HandlerError> {
        let waits = |why: &str| {
            HandlerError::Store(idem_ports::StoreError::Unavailable(format!(
                "order {order_id}: {why}; the cancellation waits until the charge is final"
            )))
        };
        if self.charges_through_provider {
            // the record first, then the payment: the order the completer's attempt takes them in; a charge
            // held under the earlier key scheme (`event:<event_id>`, before a rolling deploy finished) too
            let mut keys = vec![order_charge_key(order_id)];
            keys.extend(
                uow.idempotency()
                    .held_with_field(&self.merchant_id, "event:", "/payments", "order_id", &order_id.to_string())
                    .await?,
            );
            let mut cancelled = Vec::new();
            for key in keys {
                match uow.idempotency().cancel_unstarted(&self.merchant_id, &key, &cancelled_charge()).await? {
                    Some(HeldCall::Cancelled) => cancelled.push(key),
                    Some(HeldCall::InProgress) => return Err(waits("its charge is in progress at the provider")),
                    None => {}
                }
            }
            if !cancelled.is_empty() {
                return Ok(json!({ "cancelled": "the order's charge was never sent", "keys": cancelled }));
            }
        }
        let Some(payment) = uow.payments().find_by_order_for_update(&self.merchant_id, order_id).await? else {
            return Ok(json!({ "skipped": "no payment for the order" }));
        };
        if payment.status == PaymentStatus::Pending {
            return Err(waits("its payment is pending at the provider"));
        }
        let Ok(amount) = Amount::try_from(refundable(&payment)) else {
            return Ok(json!({ "skipped": "nothing left to refund", "payment_id": payment.id }));
        };
        if crate::payment::charged_through_provider(&payment) {
            let key = compensation_refund_key(saga_id);
            let uri = format!("/payments/{}/refund", payment.id);
            // no amount: what is left when the refund runs (a merchant's refund may land first)
            let body = serde_json::to_vec(&json!({ "reason": "order cancelled" }))
                .map_err(|e| HandlerError::Rejected(e.to_string()))?;
            let held = HeldRequest {
                scope: self.merchant_id.clone(),
                key: key.clone(),
                command_hash: *crate::idempotency::Fingerprint::of_request("POST", &uri, &body).as_bytes(),
                request: StoredRequest {
                    method: "POST".into(),
                    uri,
                    content_type: Some("application/json".into()),
                    body,
                },
                created_at: now,
                expires_at: now + chrono::Duration::hours(EVENT_CHARGE_RETENTION_HOURS),
            };
            uow.idempotency().enqueue_held(&held).await?;
            return Ok(json!({ "refund_requested": key, "payment_id": payment.id }));
        }
        let cmd = RefundCommand {
            id: None,
            merchant_id: Some(self.merchant_id.clone()),
            payment_id: payment.id,
            amount,
            reason: Some("order cancelled".into()),
            saga_id: Some(saga_id),
            traceparent: None,
        };
        match refund_payment(uow, self.env(), &cmd).await {
            Ok((refund, _)) => Ok(
                json!({ "refund_id": refund.id, "payment_id": payment.id, "amount": format_amount(refund.amount, &payment.currency) }),
            ),
            Err(RefundError::Store(e)) => Err(e.into()),
            Err(e) => Err(HandlerError::Rejected(e.to_string())),
        }
    }
}

/// The answer a charge cancelled before it was sent keeps (`409 request-abandoned`, as an operator's
/// `idem keys abandon`): the completer never sends it, and a retry of its key replays this.
fn cancelled_charge() -> StoredResponse {
    let body = json!({
        "type": "urn:idem:problem:request-abandoned", "title": "The request was abandoned", "status": 409,
        "detail": "the order was cancelled before its charge was sent: nothing was charged",
    });
    StoredResponse {
        status_code: 409,
        headers: vec![("content-type".into(), "application/problem+json".into())],
        body: body.to_string().into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use idem_ports::{InboundEvent, MockUnitOfWork, SystemClock, UuidV7Generator};

    use super::*;

    fn handler() -> OrderEventHandler {
        OrderEventHandler {
            charges_through_provider: false,
            clock: Arc::new(SystemClock),
            ids: Arc::new(UuidV7Generator),
            payments_topic: "payments".into(),
            merchant_id: "orders".into(),
            payments_of: idem_ports::mock_payments_of,
        }
    }

    fn event(payload: &str) -> InboundEvent {
        InboundEvent {
            event_id: Uuid::from_u128(1),
            saga_id: None,
            topic: "orders".into(),
            partition: 0,
            offset: 0,
            key: None,
            payload: payload.as_bytes().to_vec(),
            headers: Vec::new(),
        }
    }

    /// Issue 11.8: the reason of a malformed event reaches logs and the dead-letter header; it names the
    /// field and the position, never a payload value.
    #[test]
    fn malformed_reasons_never_echo_payload_values() {
        let order = "01930000-0000-7000-8000-000000000001";
        for (payload, secret, expected) in [
            (
                format!(r#"{{"type":"OrderPlaced","order_id":"{order}","amount":98765.43,"version":1}}"#),
                "98765.43",
                "wrong type",
            ),
            (
                format!(r#"{{"type":"OrderRefunded","order_id":"{order}","note":"SECRET-NAME"}}"#),
                "OrderRefunded",
                "unknown type or variant",
            ),
            (format!(r#"{{"type":"OrderCancelled","order_id":"{order}"}}"#), order, "missing field version"),
            // issue 38.5: a version no order history reaches would freeze the projection; nothing is written
            (
                format!(r#"{{"type":"OrderCancelled","order_id":"{order}","version":9223372036854775807}}"#),
                "9223372036854775807",
                "version must be between 0 and 1000000",
            ),
            (r#"{"type":"OrderPlaced", "amount": "SECRET-12"#.to_owned(), "SECRET-12", "ends early"),
        ] {
            let mut uow = MockUnitOfWork::default();
            let err = futures::executor::block_on(handler().handle(&mut uow, &event(&payload))).expect_err("malformed");
            let text = err.to_string();
            assert!(matches!(err, HandlerError::Malformed(_)), "{text}");
            assert!(!text.contains(secret), "{text} echoes {secret}");
            assert!(text.contains(expected), "{text}: expected {expected:?}");
        }
    }
}

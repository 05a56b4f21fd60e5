use idem_ports::{NewOutboxMessage, NewRefund, PaymentRecord, PaymentUnitOfWork, RefundRecord, StoreError};
use thiserror::Error;
use uuid::Uuid;

use super::Env;

/// Longest refund reason, in characters.
pub const REFUND_REASON_MAX_CHARS: usize = 500;

/// A refund reason as stored: at most [`REFUND_REASON_MAX_CHARS`] characters, no control characters.
pub fn refund_reason(text: &str) -> Result<String, &'static str> {
    if text.chars().count() > REFUND_REASON_MAX_CHARS || text.chars().any(char::is_control) {
        return Err("must be a string of at most 500 characters without control characters");
    }
    Ok(text.to_owned())
}
use crate::money::Amount;
use crate::payment::{RefundRuleError, plan_refund};

/// A request to refund part or all of a payment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundCommand {
    /// The refund's id when the caller fixes it (a refund through the provider: derived from the request's
    /// key, and echoed by the provider's webhook); a refund with this id that exists already is returned
    /// as it is, never applied twice. `None`: a new id.
    pub id: Option<Uuid>,
    /// The merchant asking; `None` for internal callers such as a saga compensation.
    pub merchant_id: Option<String>,
    /// The payment to refund.
    pub payment_id: Uuid,
    /// How much.
    pub amount: Amount,
    /// Free text, validated by `refund_reason`.
    pub reason: Option<String>,
    /// The saga the refund is a step of (compensations).
    pub saga_id: Option<Uuid>,
    /// W3C `traceparent` of the request.
    pub traceparent: Option<String>,
}

/// Why a refund failed.
#[derive(Debug, Error)]
pub enum RefundError {
    /// No such payment, or it belongs to another merchant (the two are indistinguishable on purpose).
    #[error("payment not found")]
    NotFound,
    /// The amount is finer than the payment's currency allows; nothing was changed.
    #[error(transparent)]
    Amount(crate::money::MoneyError),
    #[error(transparent)]
    /// A refund rule refused it.
    Rule(#[from] RefundRuleError),
    #[error(transparent)]
    /// The store failed.
    Store(#[from] StoreError),
}

/// Refunds `cmd.amount` of a payment inside `uow`. The payment row is locked for the rest of the unit, so
/// concurrent refunds of one payment are serialized and their sum can never exceed the captured amount.
pub async fn refund_payment(
    uow: &mut dyn PaymentUnitOfWork,
    env: Env<'_>,
    cmd: &RefundCommand,
) -> Result<(RefundRecord, PaymentRecord), RefundError> {
    let payment = uow
        .payments()
        .get_for_update(cmd.payment_id, cmd.merchant_id.clone())
        .await?
        .filter(|p| cmd.merchant_id.as_ref().is_none_or(|m| *m == p.merchant_id))
        .ok_or(RefundError::NotFound)?;
    let currency = crate::money::Currency::parse(&payment.currency).map_err(RefundError::Amount)?;
    crate::money::check_minor_units(cmd.amount, currency).map_err(RefundError::Amount)?;
    if let Some(existing) = match cmd.id {
        Some(id) => uow.payments().get_refund(id).await?,
        None => None,
    } {
        if existing.payment_id != payment.id {
            return Err(RefundError::NotFound);
        }
        return Ok((existing, payment));
    }
    let plan = plan_refund(&payment, cmd.amount)?;
    let now = env.clock.now();
    let refund = NewRefund {
        id: cmd.id.unwrap_or_else(|| env.ids.new_id()),
        payment_id: payment.id,
        amount: cmd.amount.value(),
        reason: cmd.reason.clone(),
        created_at: now,
    };
    let record = uow.payments().apply_refund(&refund, plan.refunded_amount, plan.status).await?;
    let message = NewOutboxMessage {
        id: env.ids.new_id(),
        topic: env.payments_topic.to_owned(),
        aggregate_type: "payment".into(),
        aggregate_id: payment.order_id.to_string(),
        event_type: "PaymentRefunded".into(),
        payload: crate::wire::payment_refunded(&payment, &record, plan.refunded_amount, plan.status),
        saga_id: cmd.saga_id,
        traceparent: cmd.traceparent.clone(),
        created_at: now,
    };
    uow.outbox().enqueue(&message).await?;
    let updated = PaymentRecord { refunded_amount: plan.refunded_amount, status: plan.status, ..payment };
    Ok((record, updated))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::DateTime;
    use idem_ports::{MockClock, MockIdGenerator, MockUnitOfWork, PaymentStatus};
    use rust_decimal::Decimal;

    const PAYMENT: Uuid = Uuid::from_u128(0x0193_0000_0000_7000_8000_0000_0000_0003);

    fn payment(merchant: &str) -> PaymentRecord {
        PaymentRecord {
            id: PAYMENT,
            merchant_id: merchant.into(),
            order_id: Uuid::from_u128(1),
            customer_id: Uuid::from_u128(2),
            provider: "p".into(),
            external_payment_id: Some("e".into()),
            amount: Decimal::new(100_0000, 4),
            currency: "EUR".into(),
            status: PaymentStatus::Captured,
            refunded_amount: Decimal::ZERO,
            created_at: DateTime::from_timestamp(0, 0).expect("valid"),
            through_provider: false,
        }
    }

    fn run(
        uow: &mut MockUnitOfWork,
        merchant: &str,
        amount: &str,
    ) -> Result<(RefundRecord, PaymentRecord), RefundError> {
        let mut clock = MockClock::new();
        clock.expect_now().return_const(DateTime::from_timestamp(10, 0).expect("valid"));
        let mut ids = MockIdGenerator::new();
        ids.expect_new_id().returning(|| Uuid::from_u128(0x0193_0000_0000_7000_8000_0000_0000_1111));
        let cmd = RefundCommand {
            id: None,
            merchant_id: Some(merchant.into()),
            payment_id: PAYMENT,
            amount: Amount::parse(amount).expect("valid"),
            reason: None,
            saga_id: None,
            traceparent: None,
        };
        let env = Env { clock: &clock, ids: &ids, payments_topic: "payments" };
        futures::executor::block_on(refund_payment(uow, env, &cmd))
    }

    #[test]
    fn refund_updates_payment_and_announces() {
        let mut uow = MockUnitOfWork::default();
        uow.payments.expect_get_for_update().returning(|_, _| Ok(Some(payment("a"))));
        uow.payments
            .expect_apply_refund()
            .withf(|r, total, status| {
                r.amount == Decimal::new(40, 0)
                    && *total == Decimal::new(40, 0)
                    && *status == PaymentStatus::PartiallyRefunded
            })
            .times(1)
            .returning(|r, _, _| {
                Ok(RefundRecord {
                    id: r.id,
                    payment_id: r.payment_id,
                    amount: r.amount,
                    reason: None,
                    created_at: r.created_at,
                })
            });
        uow.outbox.expect_enqueue().withf(|m| m.event_type == "PaymentRefunded").times(1).returning(|_| Ok(()));
        let (_, updated) = run(&mut uow, "a", "40").expect("refunded");
        assert_eq!(updated.status, PaymentStatus::PartiallyRefunded);
    }

    #[test]
    fn another_merchants_payment_is_not_found() {
        let mut uow = MockUnitOfWork::default();
        uow.payments.expect_get_for_update().returning(|_, _| Ok(Some(payment("a"))));
        uow.payments.expect_apply_refund().never();
        assert!(matches!(run(&mut uow, "b", "1"), Err(RefundError::NotFound)));
    }

    #[test]
    fn a_refund_finer_than_the_currency_is_refused_before_writing() {
        let mut uow = MockUnitOfWork::default();
        uow.payments.expect_get_for_update().returning(|_, _| Ok(Some(payment("a"))));
        uow.payments.expect_apply_refund().never();
        uow.outbox.expect_enqueue().never();
        assert!(matches!(run(&mut uow, "a", "0.001"), Err(RefundError::Amount(_))));
    }

    #[test]
    fn over_refund_is_refused_before_writing() {
        let mut uow = MockUnitOfWork::default();
        uow.payments.expect_get_for_update().returning(|_, _| Ok(Some(payment("a"))));
        uow.payments.expect_apply_refund().never();
        uow.outbox.expect_enqueue().never();
        assert!(matches!(
            run(&mut uow, "a", "100.01"),
            Err(RefundError::Rule(RefundRuleError::ExceedsCaptured { .. }))
        ));
    }
}

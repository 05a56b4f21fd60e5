use idem_ports::{
    NewOutboxMessage, NewPayment, PaymentInsert, PaymentRecord, PaymentStatus, PaymentUnitOfWork, StoreError,
};
use thiserror::Error;
use uuid::Uuid;

use super::Env;
use crate::money::Money;

/// A field that failed validation, named as the API names it.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{field}: {reason}")]
pub struct InvalidField {
    /// The request field at fault.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

/// A validated request to charge a payment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeCommand {
    merchant_id: String,
    order_id: Uuid,
    customer_id: Uuid,
    provider: String,
    external_payment_id: String,
    money: Money,
    saga_id: Option<Uuid>,
    traceparent: Option<String>,
}

/// Longest provider name (printable ASCII, no spaces).
pub const PROVIDER_MAX_LEN: usize = 64;
/// Longest provider payment id (printable ASCII, no spaces).
pub const EXTERNAL_PAYMENT_ID_MAX_LEN: usize = 255;

fn reference(field: &'static str, value: &str, max: usize) -> Result<String, InvalidField> {
    if value.is_empty() || value.len() > max {
        return Err(InvalidField { field, reason: format!("must be 1 to {max} characters") });
    }
    if !value.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(InvalidField {
            field,
            reason: "must contain only printable ASCII characters without spaces".into(),
        });
    }
    Ok(value.to_owned())
}

impl ChargeCommand {
    /// Validates a charge. `provider` is 1–64 printable ASCII characters, `external_payment_id` 1–255.
    pub fn new(
        merchant_id: &str,
        order_id: Uuid,
        customer_id: Uuid,
        provider: &str,
        external_payment_id: &str,
        money: Money,
    ) -> Result<Self, InvalidField> {
        let non_nil = |field, id: Uuid| {
            if id.is_nil() { Err(InvalidField { field, reason: "must not be the nil UUID".into() }) } else { Ok(id) }
        };
        Ok(Self {
            merchant_id: reference("merchant_id", merchant_id, 64)?,
            order_id: non_nil("order_id", order_id)?,
            customer_id: non_nil("customer_id", customer_id)?,
            provider: reference("provider", provider, PROVIDER_MAX_LEN)?,
            external_payment_id: reference("external_payment_id", external_payment_id, EXTERNAL_PAYMENT_ID_MAX_LEN)?,
            money,
            saga_id: None,
            traceparent: None,
        })
    }

    /// Marks the charge as a step of a saga; the saga id travels on the announced event.
    pub fn with_saga(mut self, saga_id: Uuid) -> Self {
        self.saga_id = Some(saga_id);
        self
    }

    /// The W3C traceparent of the request, carried to the announced event.
    /// The payment provider named by the request.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Records the W3C `traceparent` of the request, carried by the announcement.
    pub fn with_traceparent(mut self, traceparent: Option<String>) -> Self {
        self.traceparent = traceparent;
        self
    }

    /// The order charged.
    pub fn order_id(&self) -> Uuid {
        self.order_id
    }

    /// Whether an existing payment is this same charge (same merchant, order, customer and money).
    fn matches(&self, p: &PaymentRecord) -> bool {
        p.merchant_id == self.merchant_id
            && p.order_id == self.order_id
            && p.customer_id == self.customer_id
            && p.amount == self.money.amount.value()
            && p.currency == self.money.currency.as_str()
    }
}

/// How a charge ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeOutcome {
    /// A new payment was created in this unit of work (and its event enqueued in the outbox).
    Created(PaymentRecord),
    /// The same charge was already recorded (same provider and external payment id, same details).
    AlreadyCharged(PaymentRecord),
}

impl ChargeOutcome {
    /// The payment, new or existing.
    pub fn payment(&self) -> &PaymentRecord {
        match self {
            Self::Created(p) | Self::AlreadyCharged(p) => p,
        }
    }
}

/// Why a charge failed.
#[derive(Debug, Error)]
pub enum ChargeError {
    /// A payment with the same (provider, external_payment_id) exists with other details.
    #[error("a different payment {existing} already uses this provider and external payment id")]
    DetailsDiffer {
        /// The existing payment.
        existing: Uuid,
    },
    /// Another merchant's payment already uses this (provider, external_payment_id). Uniqueness is global
    /// (the second protection of money), but nothing about the other payment may reach this merchant: the
    /// caller answers a generic conflict and records a security event.
    #[error("the provider and external payment id are taken by another merchant")]
    TakenByAnotherMerchant {
        /// The merchant it belongs to (for the security log, never for the client).
        other_merchant: String,
    },
    #[error(transparent)]
    /// The store failed.
    Store(#[from] StoreError),
}

/// Charges a payment inside `uow`: inserts it, or finds the existing payment with the same (provider,
/// external_payment_id). An existing payment with the same details is returned as
/// [`ChargeOutcome::AlreadyCharged`]; one with different details is [`ChargeError::DetailsDiffer`]. The
/// duplicate check never raises a unique violation, so the surrounding transaction stays usable.
pub async fn charge_payment(
    uow: &mut dyn PaymentUnitOfWork,
    env: Env<'_>,
    cmd: &ChargeCommand,
) -> Result<ChargeOutcome, ChargeError> {
    let now = env.clock.now();
    let payment = new_payment(env, cmd, now);
    // the announcement of the payment as it will be stored, enqueued only if it is new (one statement)
    let announcement = captured_message(env, cmd, &as_stored(&payment), now);
    let insert = uow.insert_announced(&payment, &announcement).await?;
    classify(cmd, insert)
}

/// The record of a new payment as the store returns it once inserted.
fn as_stored(p: &NewPayment) -> PaymentRecord {
    PaymentRecord {
        id: p.id,
        merchant_id: p.merchant_id.clone(),
        order_id: p.order_id,
        customer_id: p.customer_id,
        provider: p.provider.clone(),
        external_payment_id: Some(p.external_payment_id.clone()),
        amount: p.amount,
        currency: p.currency.clone(),
        status: p.status,
        refunded_amount: rust_decimal::Decimal::ZERO,
        created_at: p.created_at,
        through_provider: false,
    }
}

/// [`charge_payment`] for many commands with set-based statements: one insert for the payments, one
/// lookup for the duplicates, one insert for the announcements. Returns one outcome per command, in
/// order; the effects equal charging them one after the other.
pub async fn charge_payments(
    uow: &mut dyn PaymentUnitOfWork,
    env: Env<'_>,
    cmds: &[&ChargeCommand],
) -> Result<Vec<Result<ChargeOutcome, ChargeError>>, StoreError> {
    let now = env.clock.now();
    let new: Vec<NewPayment> = cmds.iter().map(|c| new_payment(env, c, now)).collect();
    let inserts = uow.payments().insert_many_or_get(&new).await?;
    let outcomes: Vec<_> = cmds.iter().zip(inserts).map(|(cmd, insert)| classify(cmd, insert)).collect();
    let messages: Vec<NewOutboxMessage> = cmds
        .iter()
        .zip(&outcomes)
        .filter_map(|(cmd, o)| match o {
            Ok(ChargeOutcome::Created(p)) => Some(captured_message(env, cmd, p, now)),
            _ => None,
        })
        .collect();
    uow.outbox().enqueue_many(&messages).await?;
    Ok(outcomes)
}

fn new_payment(env: Env<'_>, cmd: &ChargeCommand, now: chrono::DateTime<chrono::Utc>) -> NewPayment {
    NewPayment {
        id: env.ids.new_id(),
        merchant_id: cmd.merchant_id.clone(),
        order_id: cmd.order_id,
        customer_id: cmd.customer_id,
        provider: cmd.provider.clone(),
        external_payment_id: cmd.external_payment_id.clone(),
        amount: cmd.money.amount.value(),
        currency: cmd.money.currency.as_str().to_owned(),
        status: PaymentStatus::Captured,
        created_at: now,
    }
}

fn classify(cmd: &ChargeCommand, insert: PaymentInsert) -> Result<ChargeOutcome, ChargeError> {
    match insert {
        PaymentInsert::Existing(existing) if cmd.matches(&existing) => Ok(ChargeOutcome::AlreadyCharged(existing)),
        PaymentInsert::Existing(existing) if existing.merchant_id != cmd.merchant_id => {
            Err(ChargeError::TakenByAnotherMerchant { other_merchant: existing.merchant_id })
        }
        PaymentInsert::Existing(existing) => Err(ChargeError::DetailsDiffer { existing: existing.id }),
        PaymentInsert::Inserted(payment) => Ok(ChargeOutcome::Created(payment)),
    }
}

/// The `PaymentCaptured` announcement of a new payment, keyed by its order.
fn captured_message(
    env: Env<'_>,
    cmd: &ChargeCommand,
    payment: &PaymentRecord,
    now: chrono::DateTime<chrono::Utc>,
) -> NewOutboxMessage {
    announce_capture(env, payment, cmd.saga_id, cmd.traceparent.clone(), now)
}

/// The `PaymentCaptured` announcement of `payment`, keyed by its order (recorded, or captured through the
/// provider).
pub(super) fn announce_capture(
    env: Env<'_>,
    payment: &PaymentRecord,
    saga_id: Option<Uuid>,
    traceparent: Option<String>,
    now: chrono::DateTime<chrono::Utc>,
) -> NewOutboxMessage {
    NewOutboxMessage {
        id: env.ids.new_id(),
        topic: env.payments_topic.to_owned(),
        aggregate_type: "payment".into(),
        aggregate_id: payment.order_id.to_string(),
        event_type: "PaymentCaptured".into(),
        payload: crate::wire::payment_captured(payment),
        saga_id,
        traceparent,
        created_at: now,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::money::{Amount, Currency};
    use chrono::{DateTime, Utc};
    use idem_ports::{MockClock, MockIdGenerator, MockUnitOfWork};
    use mockall::predicate::always;
    use rust_decimal::Decimal;

    const ORDER: Uuid = Uuid::from_u128(0x0193_0000_0000_7000_8000_0000_0000_0001);
    const CUSTOMER: Uuid = Uuid::from_u128(0x0193_0000_0000_7000_8000_0000_0000_0002);

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).expect("valid")
    }

    fn cmd(amount: &str) -> ChargeCommand {
        let money =
            Money { amount: Amount::parse(amount).expect("valid"), currency: Currency::parse("EUR").expect("valid") };
        ChargeCommand::new("merchant_a", ORDER, CUSTOMER, "stripe", "pi_1", money).expect("valid")
    }

    fn runtime() -> (MockClock, MockIdGenerator) {
        let mut clock = MockClock::new();
        clock.expect_now().return_const(now());
        let mut ids = MockIdGenerator::new();
        let mut n = 0u128;
        ids.expect_new_id().returning(move || {
            n += 1;
            Uuid::from_u128(0x0193_0000_0000_7000_8000_0000_0000_1000 + n)
        });
        (clock, ids)
    }

    #[test]
    fn new_payment_is_inserted_and_announced_in_the_same_unit() {
        let (clock, ids) = runtime();
        let mut uow = MockUnitOfWork::default();
        uow.payments
            .expect_insert_or_get()
            .withf(|p| p.provider == "stripe" && p.amount == Decimal::new(10_5000, 4) && p.created_at == now())
            .times(1)
            .returning(|p| Ok(PaymentInsert::Inserted(super::as_stored(p))));
        uow.outbox
            .expect_enqueue()
            .withf(|m| {
                m.event_type == "PaymentCaptured"
                    && m.aggregate_id == ORDER.to_string()
                    && m.topic == "payments"
                    && m.payload["amount"] == "10.50"
            })
            .times(1)
            .returning(|_| Ok(()));
        let env = Env { clock: &clock, ids: &ids, payments_topic: "payments" };
        let out = futures::executor::block_on(charge_payment(&mut uow, env, &cmd("10.5"))).expect("charged");
        assert!(matches!(out, ChargeOutcome::Created(p) if p.order_id == ORDER));
    }

    #[test]
    fn same_details_return_the_existing_payment_without_a_second_event() {
        let (clock, ids) = runtime();
        let mut uow = MockUnitOfWork::default();
        let existing_id = Uuid::from_u128(0x0193_0000_0000_7000_8000_0000_0000_0099);
        uow.payments.expect_insert_or_get().returning(move |p| {
            let mut rec = super::as_stored(p);
            rec.id = existing_id;
            Ok(PaymentInsert::Existing(rec))
        });
        uow.outbox.expect_enqueue().never();
        let env = Env { clock: &clock, ids: &ids, payments_topic: "payments" };
        let out = futures::executor::block_on(charge_payment(&mut uow, env, &cmd("10.5"))).expect("charged");
        assert_eq!(out, ChargeOutcome::AlreadyCharged(out.payment().clone()));
        assert_eq!(out.payment().id, existing_id);
    }

    #[test]
    fn different_details_are_a_conflict() {
        let (clock, ids) = runtime();
        let mut uow = MockUnitOfWork::default();
        uow.payments.expect_insert_or_get().returning(|p| {
            let mut rec = super::as_stored(p);
            rec.amount = Decimal::new(99, 0);
            Ok(PaymentInsert::Existing(rec))
        });
        uow.outbox.expect_enqueue().never();
        let env = Env { clock: &clock, ids: &ids, payments_topic: "payments" };
        let err = futures::executor::block_on(charge_payment(&mut uow, env, &cmd("10.5"))).expect_err("conflict");
        assert!(matches!(err, ChargeError::DetailsDiffer { .. }));
    }

    #[test]
    fn store_errors_propagate() {
        let (clock, ids) = runtime();
        let mut uow = MockUnitOfWork::default();
        uow.payments.expect_insert_or_get().with(always()).returning(|_| Err(StoreError::Unavailable("down".into())));
        let env = Env { clock: &clock, ids: &ids, payments_topic: "payments" };
        let err = futures::executor::block_on(charge_payment(&mut uow, env, &cmd("1"))).expect_err("store down");
        assert!(matches!(err, ChargeError::Store(StoreError::Unavailable(_))));
    }

    #[test]
    fn command_validation_names_the_field() {
        let money = cmd("1").money;
        let bad = ChargeCommand::new("m", ORDER, CUSTOMER, "", "x", money).expect_err("empty provider");
        assert_eq!(bad.field, "provider");
        let bad = ChargeCommand::new("m", Uuid::nil(), CUSTOMER, "p", "x", money).expect_err("nil order");
        assert_eq!(bad.field, "order_id");
        let bad = ChargeCommand::new("m", ORDER, CUSTOMER, "p", "a b", money).expect_err("space");
        assert_eq!(bad.field, "external_payment_id");
    }
}

//! Charging through a payment provider, in phases around the call (`crate::phases`): the first phase
//! writes the payment `pending` ([`pending_payment`]); the call runs with no transaction open; the second
//! phase captures it with the provider's charge id ([`capture_charge`], which the provider's
//! `charge.succeeded` webhook uses too) or records the decline ([`decline_charge`]). Both paths land on
//! one payment: the provider echoes idem's payment id as the charge's `reference`, and
//! `UNIQUE (provider, external_payment_id)` refuses a second payment with the same charge.

use idem_ports::{ChargeRequest, NewPendingPayment, PaymentRecord, PaymentStatus, PaymentUnitOfWork, StoreError};
use rust_decimal::Decimal;
use thiserror::Error;
use uuid::Uuid;

use super::Env;
use super::charge::InvalidField;
use crate::money::{Currency, Money};

/// Longest provider token of a card or account (`pm_…`).
pub const PAYMENT_METHOD_MAX_LEN: usize = 255;

/// A validated request to charge through the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderChargeCommand {
    merchant_id: String,
    order_id: Uuid,
    customer_id: Uuid,
    money: Money,
    payment_method: String,
    traceparent: Option<String>,
}

impl ProviderChargeCommand {
    /// Validates a charge through the provider; `payment_method` is 1–255 printable ASCII characters.
    pub fn new(
        merchant_id: &str,
        order_id: Uuid,
        customer_id: Uuid,
        money: Money,
        payment_method: &str,
    ) -> Result<Self, InvalidField> {
        if payment_method.is_empty()
            || payment_method.len() > PAYMENT_METHOD_MAX_LEN
            || !payment_method.bytes().all(|b| (0x21..=0x7e).contains(&b))
        {
            return Err(InvalidField {
                field: "payment_method",
                reason: format!("must be 1 to {PAYMENT_METHOD_MAX_LEN} printable ASCII characters without spaces"),
            });
        }
        for (field, id) in [("order_id", order_id), ("customer_id", customer_id)] {
            if id.is_nil() {
                return Err(InvalidField { field, reason: "must not be the nil UUID".into() });
            }
        }
        Ok(Self {
            merchant_id: merchant_id.to_owned(),
            order_id,
            customer_id,
            money,
            payment_method: payment_method.to_owned(),
            traceparent: None,
        })
    }

    /// Records the W3C `traceparent` of the request, carried by the announcement.
    pub fn with_traceparent(mut self, traceparent: Option<String>) -> Self {
        self.traceparent = traceparent;
        self
    }

    /// What to ask the provider for the payment `payment_id`.
    pub fn charge_request(&self, payment_id: Uuid) -> ChargeRequest {
        ChargeRequest {
            amount_minor: minor_units(&self.money),
            currency: self.money.currency.as_str().to_owned(),
            payment_method: self.payment_method.clone(),
            reference: payment_id.to_string(),
        }
    }

    /// Whether `p` is this charge (a resumed attempt finds its own pending payment).
    fn matches(&self, p: &PaymentRecord) -> bool {
        p.merchant_id == self.merchant_id
            && p.order_id == self.order_id
            && p.customer_id == self.customer_id
            && p.amount == self.money.amount.value()
            && p.currency == self.money.currency.as_str()
    }
}

/// An amount in the currency's minor unit (cents), as providers take it. Amounts never have more decimals
/// than the minor unit ([`Money::new`]), so this is exact; one beyond `i64` saturates (and is refused by any
/// provider).
pub fn minor_units(money: &Money) -> i64 {
    in_minor_units(money.amount.value(), money.currency)
}

/// `minor` units of `currency` as an amount (`1234` EUR is `12.34`); refused when not positive or too large.
pub fn from_minor_units(minor: i64, currency: Currency) -> Result<crate::money::Amount, crate::money::MoneyError> {
    let mut value = Decimal::from(minor);
    value.set_scale(currency.minor_units()).map_err(|_| crate::money::MoneyError::TooLarge)?;
    crate::money::Amount::try_from(value)
}

/// A stored amount (`12.3400` EUR) in minor units of its `currency` code (`1234`); `None` for an unknown code.
pub fn minor_units_of(value: Decimal, currency: &str) -> Option<i64> {
    Currency::parse(currency).ok().map(|c| in_minor_units(value, c))
}

fn in_minor_units(value: Decimal, currency: Currency) -> i64 {
    let scaled = value * Decimal::from(10i64.pow(currency.minor_units()));
    i64::try_from(scaled.trunc()).unwrap_or(i64::MAX)
}

/// Why a step of a charge through the provider failed.
#[derive(Debug, Error)]
pub enum ProviderChargeError {
    /// The payment this request names exists with other details (cannot happen for one request: its id is
    /// derived from the request's key, whose request hash is checked first).
    #[error("payment {0} exists with other details")]
    Mismatch(Uuid),
    /// The provider's charge does not agree with the payment (another amount, another charge id for a
    /// captured payment, a capture of a declined payment): an operator's case, never silently applied.
    #[error("the provider's charge disagrees with payment {payment}: {why}")]
    Disagrees {
        /// The payment.
        payment: Uuid,
        /// What disagrees.
        why: String,
    },
    /// No payment with this id.
    #[error("no payment {0}")]
    NotFound(Uuid),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The first phase's intent: the payment `id`, written `pending` unless a resumed attempt wrote it already;
/// returned as stored (a resumed attempt may find it captured by the provider's webhook meanwhile).
pub async fn pending_payment(
    uow: &mut dyn PaymentUnitOfWork,
    env: Env<'_>,
    cmd: &ProviderChargeCommand,
    id: Uuid,
    provider: &str,
) -> Result<PaymentRecord, ProviderChargeError> {
    let pending = NewPendingPayment {
        id,
        merchant_id: cmd.merchant_id.clone(),
        order_id: cmd.order_id,
        customer_id: cmd.customer_id,
        provider: provider.to_owned(),
        amount: cmd.money.amount.value(),
        currency: cmd.money.currency.as_str().to_owned(),
        created_at: env.clock.now(),
    };
    let payment = uow.payments().insert_pending(&pending).await?;
    if !cmd.matches(&payment) {
        return Err(ProviderChargeError::Mismatch(id));
    }
    Ok(payment)
}

/// How a capture ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Capture {
    /// Captured in this unit of work, its `PaymentCaptured` announcement in the outbox.
    Now(PaymentRecord),
    /// It was captured with this charge before (the other path — API answer or webhook — came first).
    Already(PaymentRecord),
}

impl Capture {
    /// The payment.
    pub fn payment(&self) -> &PaymentRecord {
        match self {
            Self::Now(p) | Self::Already(p) => p,
        }
    }
}

/// Captures the pending payment `id` with the provider's charge (`charge_id`, for `amount_minor` in
/// `currency`), announcing it once — whichever path comes first, the API's second phase or the provider's
/// `charge.succeeded` webhook; the second finds it captured and changes nothing.
pub async fn capture_charge(
    uow: &mut dyn PaymentUnitOfWork,
    env: Env<'_>,
    id: Uuid,
    charge_id: &str,
    charged: (i64, &str),
    traceparent: Option<String>,
) -> Result<Capture, ProviderChargeError> {
    let disagrees = |why: String| ProviderChargeError::Disagrees { payment: id, why };
    let Some(current) = uow.payments().get_for_update(id, None).await? else {
        return Err(ProviderChargeError::NotFound(id));
    };
    let currency = Currency::parse(&current.currency).map_err(|e| disagrees(e.to_string()))?;
    let expected = in_minor_units(current.amount, currency);
    if (expected, current.currency.as_str()) != charged {
        return Err(disagrees(format!("charged {} {} for {expected} {}", charged.0, charged.1, current.currency)));
    }
    match current.status {
        PaymentStatus::Pending => {}
        PaymentStatus::Declined => return Err(disagrees("a charge for a declined payment".into())),
        _ if current.external_payment_id.as_deref() == Some(charge_id) => return Ok(Capture::Already(current)),
        _ => return Err(disagrees("another charge id than the captured one".into())),
    }
    let now = env.clock.now();
    let Some(payment) = uow.payments().capture(id, charge_id, now).await? else {
        return Err(ProviderChargeError::NotFound(id)); // locked above: cannot happen
    };
    uow.outbox().enqueue(&super::charge::announce_capture(env, &payment, None, traceparent, now)).await?;
    Ok(Capture::Now(payment))
}

/// Records the provider's decline of the pending payment `id` (a final answer); returns it as stored.
pub async fn decline_charge(
    uow: &mut dyn PaymentUnitOfWork,
    env: Env<'_>,
    id: Uuid,
) -> Result<PaymentRecord, ProviderChargeError> {
    if let Some(p) = uow.payments().decline(id, env.clock.now()).await? {
        return Ok(p);
    }
    uow.payments().get_for_update(id, None).await?.ok_or(ProviderChargeError::NotFound(id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::money::Amount;

    fn money(amount: &str, currency: &str) -> Money {
        Money::new(Amount::parse(amount).expect("amount"), Currency::parse(currency).expect("currency")).expect("money")
    }

    #[test]
    fn amounts_go_to_the_provider_in_minor_units() {
        assert_eq!(minor_units(&money("12.34", "EUR")), 1234);
        assert_eq!(minor_units(&money("12.3", "EUR")), 1230);
        assert_eq!(minor_units(&money("1500", "JPY")), 1500);
        assert_eq!(minor_units(&money("1.234", "BHD")), 1234);
        for (amount, currency) in [("12.34", "EUR"), ("1500", "JPY"), ("1.234", "BHD"), ("0.01", "EUR")] {
            let m = money(amount, currency);
            assert_eq!(from_minor_units(minor_units(&m), m.currency), Ok(m.amount), "{amount} {currency}");
        }
        assert!(from_minor_units(0, Currency::parse("EUR").expect("EUR")).is_err());
        assert!(from_minor_units(-5, Currency::parse("EUR").expect("EUR")).is_err());
    }

    #[test]
    fn a_payment_method_must_be_a_printable_token() {
        let (o, c) = (Uuid::from_u128(1), Uuid::from_u128(2));
        for bad in ["", "pm card", "pm_\u{1b}[31m", &"x".repeat(256)] {
            let err = ProviderChargeCommand::new("m", o, c, money("1", "EUR"), bad).expect_err(bad);
            assert_eq!(err.field, "payment_method");
        }
        let cmd = ProviderChargeCommand::new("m", o, c, money("1.5", "EUR"), "pm_card_visa").expect("valid");
        let id = Uuid::from_u128(9);
        assert_eq!(
            cmd.charge_request(id),
            ChargeRequest {
                amount_minor: 150,
                currency: "EUR".into(),
                payment_method: "pm_card_visa".into(),
                reference: id.to_string(),
            }
        );
    }
}

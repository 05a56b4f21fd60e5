//! Payment rules: status transitions and refunds that can never exceed what was captured.

use idem_ports::{PaymentRecord, PaymentStatus};
use rust_decimal::Decimal;
use thiserror::Error;

use crate::money::Amount;

/// Why a refund is not allowed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RefundRuleError {
    #[error("payment is {} and cannot be refunded", .0.as_str())]
    /// The payment is not captured (or already fully refunded).
    NotRefundable(PaymentStatus),
    #[error("refund of {requested} exceeds the {remaining} left to refund")]
    /// The amount is more than what is left to refund.
    ExceedsCaptured {
        /// The amount asked.
        requested: Decimal,
        /// What is left to refund.
        remaining: Decimal,
    },
}

/// The payment's state after a refund.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefundPlan {
    /// What will have been refunded after this refund.
    pub refunded_amount: Decimal,
    /// The payment's status after this refund.
    pub status: PaymentStatus,
}

/// Whether a payment may move from `from` to `to`.
pub fn can_transition(from: PaymentStatus, to: PaymentStatus) -> bool {
    use PaymentStatus::*;
    matches!(
        (from, to),
        (Pending, Captured)
            | (Pending, Declined)
            | (Captured, PartiallyRefunded)
            | (Captured, Refunded)
            | (PartiallyRefunded, PartiallyRefunded)
            | (PartiallyRefunded, Refunded)
    )
}

/// Whether idem charged `payment` itself through its provider, so its refunds go to the provider:
/// `through_provider`, or an id of the provider flow (a UUID v8 intent id — an instance of the previous
/// version, during a rolling deploy, writes such payments without the column).
pub fn charged_through_provider(payment: &PaymentRecord) -> bool {
    payment.through_provider || payment.id.get_version_num() == 8
}

/// What is left to refund.
pub fn refundable(payment: &PaymentRecord) -> Decimal {
    match payment.status {
        PaymentStatus::Captured | PaymentStatus::PartiallyRefunded => {
            (payment.amount - payment.refunded_amount).max(Decimal::ZERO)
        }
        PaymentStatus::Pending | PaymentStatus::Refunded | PaymentStatus::Declined => Decimal::ZERO,
    }
}

/// Plans refunding `amount` of `payment`: the new refunded total and status, or why it is refused.
pub fn plan_refund(payment: &PaymentRecord, amount: Amount) -> Result<RefundPlan, RefundRuleError> {
    if !matches!(payment.status, PaymentStatus::Captured | PaymentStatus::PartiallyRefunded) {
        return Err(RefundRuleError::NotRefundable(payment.status));
    }
    let remaining = refundable(payment);
    let requested = amount.value();
    if requested > remaining {
        return Err(RefundRuleError::ExceedsCaptured { requested, remaining });
    }
    let refunded_amount = payment.refunded_amount + requested;
    let status =
        if refunded_amount == payment.amount { PaymentStatus::Refunded } else { PaymentStatus::PartiallyRefunded };
    debug_assert!(can_transition(payment.status, status));
    Ok(RefundPlan { refunded_amount, status })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::DateTime;
    use proptest::prelude::*;
    use uuid::Uuid;

    fn captured(amount: &str) -> PaymentRecord {
        PaymentRecord {
            id: Uuid::nil(),
            merchant_id: "m".into(),
            order_id: Uuid::nil(),
            customer_id: Uuid::nil(),
            provider: "p".into(),
            external_payment_id: Some("e".into()),
            amount: Amount::parse(amount).expect("valid").value(),
            currency: "EUR".into(),
            status: PaymentStatus::Captured,
            refunded_amount: Decimal::ZERO,
            created_at: DateTime::from_timestamp(0, 0).expect("valid"),
            through_provider: false,
        }
    }

    fn amt(s: &str) -> Amount {
        Amount::parse(s).expect("valid")
    }

    #[test]
    fn partial_then_full_refund() {
        let mut p = captured("10.00");
        let plan = plan_refund(&p, amt("4")).expect("allowed");
        assert_eq!(plan.status, PaymentStatus::PartiallyRefunded);
        p.refunded_amount = plan.refunded_amount;
        p.status = plan.status;
        let plan = plan_refund(&p, amt("6")).expect("allowed");
        assert_eq!(plan.status, PaymentStatus::Refunded);
        assert_eq!(plan.refunded_amount, p.amount);
        p.status = plan.status;
        p.refunded_amount = plan.refunded_amount;
        assert_eq!(plan_refund(&p, amt("0.0001")), Err(RefundRuleError::NotRefundable(PaymentStatus::Refunded)));
    }

    #[test]
    fn refund_above_remaining_is_refused() {
        let mut p = captured("10");
        p.refunded_amount = Decimal::new(7, 0);
        p.status = PaymentStatus::PartiallyRefunded;
        assert!(matches!(
            plan_refund(&p, amt("3.0001")),
            Err(RefundRuleError::ExceedsCaptured { remaining, .. }) if remaining == Decimal::new(3, 0)
        ));
    }

    #[test]
    fn pending_cannot_be_refunded_and_transitions_are_one_way() {
        let mut p = captured("1");
        p.status = PaymentStatus::Pending;
        assert_eq!(plan_refund(&p, amt("1")), Err(RefundRuleError::NotRefundable(PaymentStatus::Pending)));
        assert!(!can_transition(PaymentStatus::Refunded, PaymentStatus::Captured));
        assert!(!can_transition(PaymentStatus::Captured, PaymentStatus::Pending));
    }

    proptest! {
        #[test]
        fn refunds_never_exceed_the_capture(total in 1u64..1_000_000, parts in proptest::collection::vec(1u64..500_000, 1..20)) {
            let mut p = captured(&format!("{}.{:04}", total / 10_000, total % 10_000));
            for part in parts {
                let a = amt(&format!("{}.{:04}", part / 10_000, part % 10_000));
                if let Ok(plan) = plan_refund(&p, a) {
                    p.refunded_amount = plan.refunded_amount;
                    p.status = plan.status;
                }
                prop_assert!(p.refunded_amount <= p.amount);
            }
        }
    }
}

//! Use cases: each runs inside a unit of work the caller began and will commit, so the caller can add
//! its own writes (an idempotency record, a processed-event row) to the same transaction.

mod charge;
mod claim_key;
mod order_events;
mod provider_charge;
mod refund;

pub use charge::{
    ChargeCommand, ChargeError, ChargeOutcome, EXTERNAL_PAYMENT_ID_MAX_LEN, InvalidField, PROVIDER_MAX_LEN,
    charge_payment, charge_payments,
};
pub use claim_key::{KeyClaim, claim_for, claim_key};
pub use order_events::{OrderEventHandler, REFUND_STEP};
pub use provider_charge::{
    Capture, PAYMENT_METHOD_MAX_LEN, ProviderChargeCommand, ProviderChargeError, capture_charge, decline_charge,
    from_minor_units, minor_units, minor_units_of, pending_payment,
};
pub use refund::{REFUND_REASON_MAX_CHARS, RefundCommand, RefundError, refund_payment, refund_reason};

use idem_ports::{Clock, IdGenerator};

/// What use cases need besides the unit of work.
#[derive(Clone, Copy)]
pub struct Env<'a> {
    /// The source of time.
    pub clock: &'a dyn Clock,
    /// The source of ids.
    pub ids: &'a dyn IdGenerator,
    /// Topic that payment events are announced on (through the outbox).
    pub payments_topic: &'a str,
}

impl std::fmt::Debug for Env<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Env").field("payments_topic", &self.payments_topic).finish_non_exhaustive()
    }
}

//! A payment provider (a card network, Stripe, Adyen): the other system a charge's real effect lives in.
//! Calls carry the downstream idempotency key of their step (`idem_domain::phases::downstream_key`), so
//! the provider deduplicates a repeated call; they run between the phases of a request, with no
//! transaction open.

use async_trait::async_trait;

/// A charge to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeRequest {
    /// Amount in the currency's minor unit (cents).
    pub amount_minor: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// The provider's token of the card or account (`pm_…`); never logged.
    pub payment_method: String,
    /// idem's own id of the payment, echoed by the provider (and by its webhooks).
    pub reference: String,
}

/// A charge the provider made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    /// The provider's id of the charge (`ch_…`): the payment's `external_payment_id`.
    pub id: String,
    /// What it charged, in minor units.
    pub amount_minor: i64,
    /// Its currency.
    pub currency: String,
}

/// A refund to make of a charge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundRequest {
    /// The provider's id of the charge (`ch_…`).
    pub charge: String,
    /// Amount in the currency's minor unit.
    pub amount_minor: i64,
    /// idem's own id of the refund, echoed by the provider (and by its webhooks).
    pub reference: String,
}

/// A refund the provider made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderRefund {
    /// The provider's id of the refund (`re_…`).
    pub id: String,
    /// What it refunded, in minor units.
    pub amount_minor: i64,
}

/// A charge or refund as the provider lists it (`GET /v1/charges`, `GET /v1/refunds`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The provider's id (`ch_…`, `re_…`).
    pub id: String,
    /// For a refund, the charge it refunds.
    pub charge: Option<String>,
    /// Its amount in minor units.
    pub amount_minor: i64,
    /// Its currency (charges).
    pub currency: Option<String>,
    /// idem's id it echoes (`None`: made elsewhere, its dashboard).
    pub reference: Option<String>,
    /// When it was made (unix seconds).
    pub created: i64,
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Page {
    /// The items, oldest first.
    pub data: Vec<Listed>,
    /// Whether more follow (ask again `starting_after` the last one).
    pub has_more: bool,
    /// The id of the page's last item as the provider listed it (items idem does not keep, a failed
    /// charge, included): where the next page starts.
    pub last_id: Option<String>,
}

/// What to list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listing {
    /// Succeeded charges.
    Charges,
    /// Succeeded refunds.
    Refunds,
}

/// Why a call did not produce a charge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// The provider refused for good (a declined card, a key reused with other parameters): a final
    /// answer, stored and replayed, never attempted again.
    #[error("refused by the provider: {code}")]
    Refused {
        /// The provider's code (`card_declined`, `key_reused`, …).
        code: String,
    },
    /// The provider answered without saying whether it happened (its own `5xx`, `429` or "in progress"),
    /// or the call never reached it (a refused connection): nothing of this call is still in process
    /// there; call again with the same key, not before `retry_after` (the provider's `Retry-After`).
    #[error("outcome unknown: {why}")]
    Unknown {
        /// What was seen (a status, an error kind; never a secret or the request).
        why: String,
        /// The provider's `Retry-After`, when it sent one.
        retry_after: Option<std::time::Duration>,
    },
    /// No answer (a timeout, a reset after sending, a redirect, a gateway's `502`/`504`, an answer that is
    /// not the provider's): the call may still be in process at the provider. Call again with the same key
    /// once the attempt's lease lapsed, which outlives any call.
    #[error("no answer: {0}")]
    NoAnswer(String),
}

/// A payment provider.
#[async_trait]
pub trait PaymentProvider: Send + Sync {
    /// The name stored as the payments' `provider`.
    fn name(&self) -> &str;

    /// Charges once per `idempotency_key`: a repeated key with the same request gets the first answer.
    async fn charge(&self, idempotency_key: &str, request: &ChargeRequest) -> Result<Charge, ProviderError>;

    /// Refunds once per `idempotency_key`, like [`PaymentProvider::charge`].
    async fn refund(&self, idempotency_key: &str, request: &RefundRequest) -> Result<ProviderRefund, ProviderError>;

    /// The charge made with `reference` (idem's payment id), if any: how the outcome of a call is known once
    /// the provider's idempotency window passed (sending it again could charge twice). The default knows
    /// nothing (an unknown outcome: the request stays held).
    async fn find_charge(&self, reference: &str) -> Result<Option<Charge>, ProviderError> {
        let _ = reference;
        Err(ProviderError::Unknown { why: "this provider cannot look charges up".into(), retry_after: None })
    }

    /// One page of `what` made since `created_gte` (unix seconds), after `starting_after` (an id of the
    /// previous page): what the reconciler compares with idem's payments. The default lists nothing.
    async fn list(&self, what: Listing, created_gte: i64, starting_after: Option<&str>) -> Result<Page, ProviderError> {
        let _ = (what, created_gte, starting_after);
        Err(ProviderError::Unknown { why: "this provider cannot list".into(), retry_after: None })
    }

    /// The refund made with `reference` (idem's refund id), if any, like [`PaymentProvider::find_charge`].
    async fn find_refund(&self, reference: &str) -> Result<Option<ProviderRefund>, ProviderError> {
        let _ = reference;
        Err(ProviderError::Unknown { why: "this provider cannot look refunds up".into(), retry_after: None })
    }
}

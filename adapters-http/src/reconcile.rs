//! The reconciler: the provider's charges and refunds compared with idem's payments, because something always
//! slips (a webhook never delivered, a dashboard refund, a charge made elsewhere with idem's reference, a bug).
//! It lists what the provider made since a time (`PaymentProvider::list`, paged) and what idem captured through
//! it (`charged_through_provider_since`), then:
//!
//! - **repairs what is safe, the way a webhook would** (through the webhook's own path, recorded once per
//!   provider object as `reconcile:<id>`): a `pending` payment whose charge exists is captured; a refund made
//!   at the provider (its dashboard) is recorded;
//! - **reports the rest** for an operator: a provider charge with no payment (or a second charge for one), a
//!   captured payment without its provider charge, amounts that differ, refunds of charges idem does not know.
//!
//! `idem reconcile --since 24h` prints the report; `idem serve` runs it every `RECONCILE_INTERVAL` with
//! gauges (`idem_reconcile_findings{kind}`) and an alert. None of the libraries idem is compared with does this.

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use idem_ports::{Listed, Listing, PaymentProvider, PaymentStatus, ProviderError, StoreError};
use uuid::Uuid;

use crate::ApiState;

/// What a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FindingKind {
    /// A charge at the provider that no payment of idem's is captured as (made elsewhere with idem's
    /// reference, a second charge for one payment, a charge for a payment idem declined).
    ChargeWithoutPayment,
    /// A payment idem captured through the provider whose charge the provider does not list.
    PaymentWithoutCharge,
    /// The provider charged another amount (or currency) than idem captured.
    AmountDiffers,
    /// A refund at the provider of a charge idem does not know.
    UnknownRefund,
    /// Repaired: a `pending` payment whose charge exists, captured.
    CapturedPending,
    /// Repaired: a refund made at the provider, recorded.
    RecordedRefund,
}

impl FindingKind {
    /// Its name in reports and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ChargeWithoutPayment => "charge_without_payment",
            Self::PaymentWithoutCharge => "payment_without_charge",
            Self::AmountDiffers => "amount_differs",
            Self::UnknownRefund => "unknown_refund",
            Self::CapturedPending => "captured_pending",
            Self::RecordedRefund => "recorded_refund",
        }
    }

    /// Whether the reconciler repaired it (else an operator's case).
    pub fn repaired(self) -> bool {
        matches!(self, Self::CapturedPending | Self::RecordedRefund)
    }

    /// Every kind, in report order.
    pub const ALL: [FindingKind; 6] = [
        Self::ChargeWithoutPayment,
        Self::PaymentWithoutCharge,
        Self::AmountDiffers,
        Self::UnknownRefund,
        Self::CapturedPending,
        Self::RecordedRefund,
    ];
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// What it is.
    pub kind: FindingKind,
    /// idem's payment, when one is concerned.
    pub payment: Option<Uuid>,
    /// The provider's object (`ch_…`, `re_…`), when one is concerned.
    pub provider_id: Option<String>,
    /// What was compared (amounts in minor units; never a card token).
    pub detail: String,
}

/// A reconciliation's result.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Provider charges listed.
    pub charges: usize,
    /// Provider refunds listed.
    pub refunds: usize,
    /// idem's payments captured through the provider in the period.
    pub payments: usize,
    /// What was found (repaired ones included, marked by their kind).
    pub findings: Vec<Finding>,
}

impl Report {
    /// Findings of `kind`.
    pub fn count(&self, kind: FindingKind) -> usize {
        self.findings.iter().filter(|f| f.kind == kind).count()
    }
}

/// Why a reconciliation did not finish.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The provider's listing failed.
    #[error("listing at the provider: {0}")]
    Provider(#[from] ProviderError),
    /// The store failed.
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// The reconciler of one provider.
#[derive(Clone)]
pub struct Reconciler {
    api: ApiState,
    provider: Arc<dyn PaymentProvider>,
}

impl std::fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciler").field("provider", &self.provider.name()).finish_non_exhaustive()
    }
}

/// Most pages read of one listing in a run (100 items each).
const MAX_PAGES: usize = 1_000;

impl Reconciler {
    /// Reconciles `provider` with the payments of `api`.
    pub fn new(api: ApiState, provider: Arc<dyn PaymentProvider>) -> Self {
        Self { api, provider }
    }

    async fn list_all(&self, what: Listing, since: DateTime<Utc>) -> Result<Vec<Listed>, ReconcileError> {
        let mut all = Vec::new();
        let mut after: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let page = self.provider.list(what, since.timestamp(), after.as_deref()).await?;
            // the cursor is the page's last item as listed, kept or not (a page of failed charges only)
            after = page.last_id.clone().or_else(|| page.data.last().map(|l| l.id.clone()));
            all.extend(page.data);
            if !page.has_more || after.is_none() {
                break;
            }
        }
        Ok(all)
    }

    /// One run over what was made since `since`: repairs what is safe, reports the rest.
    pub async fn run(&self, since: DateTime<Utc>) -> Result<Report, ReconcileError> {
        let name = self.provider.name().to_owned();
        let started = self.api.clock.now();
        let charges = self.list_all(Listing::Charges, since).await?;
        let refunds = self.list_all(Listing::Refunds, since).await?;
        let mut report = Report { charges: charges.len(), refunds: refunds.len(), ..Report::default() };
        let finding = |kind, payment, provider_id: Option<&str>, detail: String| Finding {
            kind,
            payment,
            provider_id: provider_id.map(str::to_owned),
            detail,
        };
        let by_id: HashMap<&str, &Listed> = charges.iter().map(|c| (c.id.as_str(), c)).collect();

        for charge in &charges {
            let reference = charge.reference.as_deref().and_then(|r| Uuid::try_parse(r).ok());
            let payment = match reference {
                Some(id) => {
                    let mut uow = self.api.tm.begin().await?;
                    let found = (self.api.payments_of)(uow.as_mut())?.payments().get(id).await?;
                    drop(uow);
                    found
                }
                None => None,
            };
            let Some(payment) = payment else {
                report.findings.push(finding(
                    FindingKind::ChargeWithoutPayment,
                    reference,
                    Some(&charge.id),
                    format!("{} minor units; no payment of idem's has this reference", charge.amount_minor),
                ));
                continue;
            };
            match payment.status {
                PaymentStatus::Pending if charge.currency.is_none() => report.findings.push(finding(
                    FindingKind::AmountDiffers,
                    Some(payment.id),
                    Some(&charge.id),
                    "the provider lists this charge without a currency: not captured".into(),
                )),
                PaymentStatus::Pending => {
                    // as the provider's `charge.succeeded` webhook would: captured with this charge
                    let object = serde_json::json!({
                        "id": charge.id, "amount_minor": charge.amount_minor,
                        "currency": charge.currency,
                        "reference": payment.id.to_string(),
                    });
                    let outcome = crate::webhooks::apply_as_event(
                        &self.api,
                        &name,
                        format!("reconcile:{}", charge.id),
                        "charge.succeeded",
                        object,
                    )
                    .await;
                    let repaired = match outcome {
                        Ok("captured") => Some((FindingKind::CapturedPending, "captured with the provider's charge")),
                        // captured meanwhile by the API or the webhook: nothing to repair
                        Ok("already_captured") => None,
                        // refused before ("disagrees", recorded once) or failed: still pending, still a finding
                        Ok(_) => Some((
                            FindingKind::AmountDiffers,
                            "still pending: the provider's charge disagrees with the payment",
                        )),
                        Err(_) => Some((FindingKind::ChargeWithoutPayment, "the repair failed; retried next run")),
                    };
                    if let Some((kind, detail)) = repaired {
                        report.findings.push(finding(kind, Some(payment.id), Some(&charge.id), detail.to_owned()));
                    }
                }
                PaymentStatus::Declined => report.findings.push(finding(
                    FindingKind::ChargeWithoutPayment,
                    Some(payment.id),
                    Some(&charge.id),
                    format!("{} minor units charged for a payment idem declined", charge.amount_minor),
                )),
                _ if payment.external_payment_id.as_deref() != Some(charge.id.as_str()) => {
                    report.findings.push(finding(
                        FindingKind::ChargeWithoutPayment,
                        Some(payment.id),
                        Some(&charge.id),
                        format!(
                            "a second charge for one payment (captured as {})",
                            payment.external_payment_id.as_deref().unwrap_or("-")
                        ),
                    ));
                }
                _ => {
                    let captured = idem_domain::usecases::minor_units_of(payment.amount, &payment.currency);
                    let currency_differs = charge.currency.as_deref() != Some(payment.currency.as_str());
                    if captured != Some(charge.amount_minor) || currency_differs {
                        report.findings.push(finding(
                            FindingKind::AmountDiffers,
                            Some(payment.id),
                            Some(&charge.id),
                            format!(
                                "idem captured {} {}, the provider charged {} {}",
                                captured.map_or("?".to_owned(), |c| c.to_string()),
                                payment.currency,
                                charge.amount_minor,
                                charge.currency.as_deref().unwrap_or("?")
                            ),
                        ));
                    }
                }
            }
        }

        // captured here, not charged there
        let mut after = None;
        for _ in 0..MAX_PAGES {
            let mut uow = self.api.tm.begin().await?;
            let page = (self.api.payments_of)(uow.as_mut())?
                .payments()
                .charged_through_provider_since(&name, since, after, 500)
                .await?;
            drop(uow);
            report.payments += page.len();
            for p in &page {
                let listed = p.external_payment_id.as_deref().is_some_and(|id| by_id.contains_key(id));
                // a charge made before `since` is not listed, nor one made after the listing began: only
                // payments made well inside the listed period count
                let inside = p.created_at > since + chrono::Duration::minutes(5)
                    && p.created_at < started - chrono::Duration::minutes(1);
                if !listed && inside {
                    report.findings.push(finding(
                        FindingKind::PaymentWithoutCharge,
                        Some(p.id),
                        p.external_payment_id.as_deref(),
                        "captured in idem, not listed by the provider".into(),
                    ));
                }
            }
            after = page.last().map(|p| p.id);
            if page.len() < 500 {
                break;
            }
        }

        for refund in &refunds {
            let Some(charge) = refund.charge.as_deref() else { continue };
            let known = match refund.reference.as_deref().and_then(|r| Uuid::try_parse(r).ok()) {
                Some(id) => {
                    let mut uow = self.api.tm.begin().await?;
                    let found = (self.api.payments_of)(uow.as_mut())?.payments().get_refund(id).await?;
                    found.is_some()
                }
                None => false,
            };
            if known {
                continue;
            }
            let object = serde_json::json!({
                "id": refund.id, "charge": charge, "amount_minor": refund.amount_minor,
                "reference": refund.reference,
            });
            // as the provider's `charge.refunded` webhook would: recorded once, by its derived id
            let outcome = crate::webhooks::apply_as_event(
                &self.api,
                &name,
                format!("reconcile:{}", refund.id),
                "charge.refunded",
                object,
            )
            .await;
            // recorded under the id the webhook path derives (its reference is not one of idem's refunds)
            let derived = idem_domain::phases::intent_id(&name, &refund.id, "refund");
            let recorded = async {
                let mut uow = self.api.tm.begin().await?;
                let found = (self.api.payments_of)(uow.as_mut())?.payments().get_refund(derived).await?;
                Ok::<_, StoreError>(found.is_some())
            };
            match outcome {
                Ok("refunded") => report.findings.push(finding(
                    FindingKind::RecordedRefund,
                    None,
                    Some(&refund.id),
                    format!("{} minor units refunded at the provider, recorded", refund.amount_minor),
                )),
                Ok("already_refunded") => {}
                // applied before: recorded then, or refused then (and still an operator's case)
                Ok("duplicate") if recorded.await? => {}
                Ok(other) => report.findings.push(finding(
                    FindingKind::UnknownRefund,
                    None,
                    Some(&refund.id),
                    format!("not recorded: {other}"),
                )),
                Err(_) => report.findings.push(finding(
                    FindingKind::UnknownRefund,
                    None,
                    Some(&refund.id),
                    format!("a refund of {charge}, a charge idem does not know"),
                )),
            }
        }
        Ok(report)
    }
}

/// What the reconciler found in its last run, for `/metrics` (`idem_reconcile_findings{kind}`) and its
/// alert, and how its runs went.
#[derive(Debug, Default)]
pub struct ReconcileMetrics {
    findings:
        prometheus_client::metrics::family::Family<Vec<(String, String)>, prometheus_client::metrics::gauge::Gauge>,
    runs: prometheus_client::metrics::counter::Counter,
    failed: prometheus_client::metrics::counter::Counter,
}

impl ReconcileMetrics {
    /// Registers the gauges and counters.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "idem_reconcile_findings",
            "Findings of the last reconciliation with the payment provider, by kind (repaired ones included)",
            self.findings.clone(),
        );
        registry.register("idem_reconcile_runs", "Reconciliations run", self.runs.clone());
        registry.register("idem_reconcile_failed_runs", "Reconciliations that did not finish", self.failed.clone());
        self.show(&Report::default());
    }

    fn show(&self, report: &Report) {
        for kind in FindingKind::ALL {
            let count = i64::try_from(report.count(kind)).unwrap_or(i64::MAX);
            self.findings.get_or_create(&vec![("kind".to_owned(), kind.as_str().to_owned())]).set(count);
        }
    }
}

impl Reconciler {
    /// Runs every `interval` over the last `lookback` until `shutdown`, its findings in `metrics` and the
    /// log (an operator's finding at error, a repair at warn).
    pub async fn run_every(
        self,
        interval: std::time::Duration,
        lookback: chrono::Duration,
        metrics: Arc<ReconcileMetrics>,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        let mut first = true;
        loop {
            // at once at start (an instance restarted more often than the interval still reconciles), then
            // every interval
            let wait = if first { std::time::Duration::from_secs(30) } else { interval };
            first = false;
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            let since = self.api.clock.now() - lookback;
            match self.run(since).await {
                Ok(report) => {
                    metrics.runs.inc();
                    metrics.show(&report);
                    for f in &report.findings {
                        let (payment, id) = (
                            f.payment.map(|p| p.to_string()).unwrap_or_default(),
                            f.provider_id.as_deref().unwrap_or(""),
                        );
                        let (id, detail) = (id.escape_debug(), f.detail.escape_debug());
                        if f.kind.repaired() {
                            tracing::warn!(kind = f.kind.as_str(), %payment, provider_id = %id, %detail, "reconciliation repaired");
                        } else {
                            tracing::error!(kind = f.kind.as_str(), %payment, provider_id = %id, %detail, "reconciliation finding: an operator's case");
                        }
                    }
                }
                Err(e) => {
                    metrics.failed.inc();
                    tracing::warn!(error = %e, "reconciliation did not finish; next run in an interval");
                }
            }
        }
    }
}

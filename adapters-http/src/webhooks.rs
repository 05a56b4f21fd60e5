//! `POST /webhooks/payment-provider`: the payment provider's events (README, "Calling other systems").
//!
//! The signature (`Provider-Signature: t=…,v1=…`, HMAC-SHA256 of `t.body`, 5 minutes' tolerance) is
//! checked before anything is read: a missing or malformed one (more than a few `v1`s included) is `400`,
//! a wrong or stale one `401`, and neither changes anything. A body over [`MAX_BODY`] is `413` before any
//! MAC work, and one request costs one MAC whatever its header holds. Each provider event id is applied once, in the transaction of its effect
//! (`provider_event`). The effects converge with the API's own path on one payment and one refund:
//!
//! - `charge.succeeded` captures the pending payment its `reference` names (idem's payment id) — before
//!   the API's second phase, after it, twice, or after a crash lost the API's answer; the second path finds
//!   it captured and changes nothing, and `UNIQUE (provider, external_payment_id)` refuses a second payment
//!   for one charge;
//! - `charge.refunded` records the refund its `reference` names (the id the API's refund uses), or one
//!   derived from the provider's refund id for a refund made elsewhere (its dashboard). A refund whose
//!   charge idem has not captured yet (events out of order) is answered `503` without being recorded: the
//!   provider delivers it again later, when the charge is there.
//!
//! Events idem has no use for are recorded and acknowledged. An event that disagrees with the payment
//! (another amount, another charge) is logged as an error for an operator and acknowledged.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_domain::usecases::{Capture, ProviderChargeError, RefundCommand, RefundError, capture_charge, refund_payment};
use idem_domain::webhook::{MIN_SECRET_LEN, WebhookError, verify};
use idem_ports::StoreError;
use serde::Deserialize;
use uuid::Uuid;

use crate::ApiState;
use crate::problem::{Problem, ProblemKind};

/// The header carrying the signature.
pub const SIGNATURE_HEADER: &str = "provider-signature";

/// The largest webhook body read (`413` beyond, before any MAC work): a provider's event is a few KiB.
pub const MAX_BODY: usize = 256 * 1024;

/// What the webhook endpoint needs: the API's state and the secret the provider signs with.
#[derive(Clone)]
pub struct WebhookState {
    /// The payments' repositories, clock, ids and topic.
    pub api: ApiState,
    /// The provider's name (its payments' `provider`).
    pub provider: Arc<str>,
    /// `PAYMENT_PROVIDER_WEBHOOK_SECRET`: at least [`MIN_SECRET_LEN`] bytes.
    secret: Arc<[u8]>,
}

/// A webhook secret too short to authenticate anything (empty, or under [`MIN_SECRET_LEN`] bytes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the webhook secret must have at least {MIN_SECRET_LEN} characters")]
pub struct WeakWebhookSecret;

impl WebhookState {
    /// The endpoint's state: `secret` must have at least [`MIN_SECRET_LEN`] bytes (an empty or short one
    /// would let anyone sign a capture).
    pub fn new(api: ApiState, provider: Arc<str>, secret: &[u8]) -> Result<Self, WeakWebhookSecret> {
        if secret.len() < MIN_SECRET_LEN {
            return Err(WeakWebhookSecret);
        }
        Ok(Self { api, provider, secret: secret.into() })
    }
}

impl std::fmt::Debug for WebhookState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookState").field("provider", &self.provider).finish_non_exhaustive()
    }
}

/// The route, outside the API's authentication and idempotency layer (its own dedup is the event id), with
/// its own body limit ([`MAX_BODY`]).
pub fn router(state: WebhookState) -> axum::Router {
    axum::Router::new()
        .route(
            "/webhooks/payment-provider",
            axum::routing::post(payment_provider).layer(axum::extract::DefaultBodyLimit::max(MAX_BODY)),
        )
        .with_state(state)
}

#[derive(Deserialize)]
struct Event {
    id: String,
    #[serde(rename = "type")]
    kind: String,
    data: EventData,
}

#[derive(Deserialize)]
struct EventData {
    object: serde_json::Value,
}

#[derive(Deserialize)]
struct ChargeObject {
    id: String,
    amount_minor: i64,
    currency: String,
    reference: Option<String>,
}

#[derive(Deserialize)]
struct RefundObject {
    id: String,
    charge: String,
    amount_minor: i64,
    reference: Option<String>,
}

fn refused(status: StatusCode, detail: &str) -> Response {
    Problem::new(ProblemKind::WebhookSignatureInvalid, status).detail(detail).into_response()
}

fn malformed(detail: String) -> Response {
    Problem::new(ProblemKind::MalformedJson, StatusCode::BAD_REQUEST).detail(detail).into_response()
}

fn acknowledged(outcome: &'static str) -> Response {
    (StatusCode::OK, [(axum::http::header::CONTENT_TYPE, "application/json")], format!("{{\"outcome\":\"{outcome}\"}}"))
        .into_response()
}

fn unavailable(e: &StoreError) -> Response {
    tracing::warn!(error = %e, "webhook not applied: the store failed; the provider delivers it again");
    Problem::new(ProblemKind::StoreUnavailable, StatusCode::SERVICE_UNAVAILABLE).retry_after(5).into_response()
}

/// `POST /webhooks/payment-provider`.
pub async fn payment_provider(State(state): State<WebhookState>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(signature) = headers.get(SIGNATURE_HEADER).and_then(|v| v.to_str().ok()) else {
        return refused(StatusCode::BAD_REQUEST, "send the Provider-Signature header");
    };
    match verify(&state.secret, signature, &body, state.api.clock.now()) {
        Ok(()) => {}
        Err(WebhookError::Malformed) => return refused(StatusCode::BAD_REQUEST, "malformed Provider-Signature"),
        Err(e @ (WebhookError::Stale | WebhookError::Mismatch)) => {
            tracing::warn!(why = %e, "webhook refused");
            return refused(StatusCode::UNAUTHORIZED, "the signature does not match, or is too old");
        }
    }
    let event: Event = match serde_json::from_slice(&body) {
        Ok(e) => e,
        Err(e) => return malformed(e.to_string()),
    };
    if event.id.is_empty() || event.id.len() > 255 {
        return malformed("the event id must be 1 to 255 characters".into());
    }
    match apply(&state.api, &state.provider, &event).await {
        Ok(outcome) => acknowledged(outcome),
        Err(response) => response,
    }
}

/// Applies what the provider's event `kind` (`charge.succeeded`, `charge.refunded`) with `object` says,
/// once per `id`, as its webhook would (the reconciler repairs through it): the outcome, or the answer a
/// webhook would get.
pub(crate) async fn apply_as_event(
    api: &ApiState,
    provider: &str,
    id: String,
    kind: &str,
    object: serde_json::Value,
) -> Result<&'static str, Response> {
    let event = Event { id, kind: kind.to_owned(), data: EventData { object } };
    apply(api, provider, &event).await
}

/// Applies `event` once: its id recorded in the transaction of its effect.
async fn apply(api: &ApiState, provider: &str, event: &Event) -> Result<&'static str, Response> {
    let mut uow = api.tm.begin().await.map_err(|e| unavailable(&e))?;
    let payments = (api.payments_of)(uow.as_mut()).map_err(|e| unavailable(&e))?;
    let now = api.clock.now();
    if !payments
        .payments()
        .record_provider_event(provider, &event.id, &event.kind, now)
        .await
        .map_err(|e| unavailable(&e))?
    {
        // acknowledged from a row this unit did not write: as for a replay, only once the synchronous
        // standby has it (a cancelled commit wait leaves it visible on the primary alone, and the next
        // failover would take it back while the provider stops delivering)
        drop(uow);
        api.tm.confirm_replicated().await.map_err(|e| unavailable(&e))?;
        return Ok("duplicate");
    }
    let env = idem_domain::usecases::Env { clock: &*api.clock, ids: &*api.ids, payments_topic: &api.payments_topic };
    let outcome = match event.kind.as_str() {
        "charge.succeeded" => {
            let charge: ChargeObject =
                serde_json::from_value(event.data.object.clone()).map_err(|e| malformed(e.to_string()))?;
            let Some(payment) = charge.reference.as_deref().and_then(|r| Uuid::try_parse(r).ok()) else {
                tracing::warn!(event = %event.id.escape_debug(), "a charge without idem's reference: not idem's; acknowledged");
                return commit(uow, "ignored").await;
            };
            match capture_charge(payments, env, payment, &charge.id, (charge.amount_minor, &charge.currency), None)
                .await
            {
                Ok(Capture::Now(_)) => "captured",
                Ok(Capture::Already(_)) => "already_captured",
                Err(ProviderChargeError::Store(e)) => return Err(unavailable(&e)),
                Err(ProviderChargeError::NotFound(_)) => {
                    tracing::warn!(event = %event.id.escape_debug(), %payment, "a charge for no payment of idem's; acknowledged");
                    "ignored"
                }
                Err(e) => {
                    tracing::error!(event = %event.id.escape_debug(), error = %e, "a provider charge disagrees with idem's payment: an operator's case");
                    "disagrees"
                }
            }
        }
        "charge.refunded" => {
            let refund: RefundObject =
                serde_json::from_value(event.data.object.clone()).map_err(|e| malformed(e.to_string()))?;
            let Some(payment) = payments
                .payments()
                .get_by_external_for_update(provider, &refund.charge)
                .await
                .map_err(|e| unavailable(&e))?
            else {
                // out of order: the charge is not captured here yet; not recorded, so delivered again
                tracing::info!(event = %event.id.escape_debug(), "a refund before its charge: asked to deliver it again later");
                return Err(Problem::new(ProblemKind::StoreUnavailable, StatusCode::SERVICE_UNAVAILABLE)
                    .detail("the refunded charge is not known yet; deliver the event again later")
                    .retry_after(30)
                    .into_response());
            };
            let id = refund
                .reference
                .as_deref()
                .and_then(|r| Uuid::try_parse(r).ok())
                .unwrap_or_else(|| idem_domain::phases::intent_id(provider, &refund.id, "refund"));
            let currency = idem_domain::Currency::parse(&payment.currency).map_err(|e| malformed(e.to_string()))?;
            let amount = idem_domain::usecases::from_minor_units(refund.amount_minor, currency)
                .map_err(|e| malformed(format!("amount_minor: {e}")))?;
            let cmd = RefundCommand {
                id: Some(id),
                merchant_id: None,
                payment_id: payment.id,
                amount,
                reason: Some("refunded at the payment provider".into()),
                saga_id: None,
                traceparent: None,
            };
            if payments.payments().get_refund(id).await.map_err(|e| unavailable(&e))?.is_some() {
                return commit(uow, "already_refunded").await; // the API's refund recorded it
            }
            match refund_payment(payments, env, &cmd).await {
                Ok(_) => "refunded",
                Err(RefundError::Store(e)) => return Err(unavailable(&e)),
                Err(e) => {
                    tracing::error!(event = %event.id.escape_debug(), error = %e, "a provider refund disagrees with idem's payment: an operator's case");
                    "disagrees"
                }
            }
        }
        _ => "ignored",
    };
    commit(uow, outcome).await
}

async fn commit(uow: Box<dyn idem_ports::UnitOfWork>, outcome: &'static str) -> Result<&'static str, Response> {
    uow.commit().await.map_err(|e| unavailable(&e))?;
    Ok(outcome)
}

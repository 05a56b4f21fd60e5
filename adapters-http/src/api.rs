//! The payments API: `POST /payments`, `POST /payments/{id}/refund`, `GET /payments/{id}`.
//!
//! Request and response DTOs stay private to this module and convert explicitly into domain commands.

use std::sync::Arc;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SecondsFormat, Utc};
use idem_domain::usecases::{
    ChargeCommand, ChargeError, ChargeOutcome, Env, ProviderChargeCommand, ProviderChargeError, RefundCommand,
    RefundError, capture_charge, charge_payment, decline_charge, pending_payment, refund_payment, refund_reason,
};
use idem_domain::{Amount, Currency, Money, MoneyError, RefundRuleError, format_amount};
use idem_ports::{
    Clock, IdGenerator, PaymentProvider, PaymentRecord, PaymentStatus, PaymentsOf, ProviderError, RefundRecord,
    StoreError, TransactionManager,
};
use serde::Serialize;
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::auth::Merchant;
use crate::idempotency::Tx;
use crate::problem::{Problem, ProblemKind};

/// What the handlers share.
#[derive(Clone)]
pub struct ApiState {
    /// Begins units of work (reads; the commands get theirs from the idempotency layer).
    pub tm: Arc<dyn TransactionManager>,
    /// The payment repositories in the unit of work the idempotency layer hands the handlers.
    pub payments_of: PaymentsOf,
    /// The source of time.
    pub clock: Arc<dyn Clock>,
    /// The source of ids.
    pub ids: Arc<dyn IdGenerator>,
    /// Topic payment events are announced on.
    pub payments_topic: Arc<str>,
    /// The payment provider charges with a `payment_method` go through (`None`: such charges are refused).
    pub provider: Option<Arc<dyn PaymentProvider>>,
}

impl std::fmt::Debug for ApiState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiState").field("payments_topic", &self.payments_topic).finish_non_exhaustive()
    }
}

impl ApiState {
    fn env(&self) -> Env<'_> {
        Env { clock: &*self.clock, ids: &*self.ids, payments_topic: &self.payments_topic }
    }
}

/// Errors of the API handlers; internal details are logged, never sent.
#[derive(Debug)]
pub enum ApiError {
    /// A problem to answer as it is.
    Problem(Problem),
    /// A store failure: 503 when transient, 500 otherwise.
    Store(StoreError),
}

impl From<Problem> for ApiError {
    fn from(p: Problem) -> Self {
        Self::Problem(p)
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            Self::Problem(p) => p.into_response(),
            Self::Store(e) if e.is_transient() => {
                tracing::warn!(error = %e, "store unavailable");
                Problem::new(ProblemKind::StoreUnavailable, StatusCode::SERVICE_UNAVAILABLE)
                    .retry_after(1)
                    .into_response()
            }
            Self::Store(e) => {
                tracing::error!(error = %e, "store failed");
                Problem::new(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR).into_response()
            }
        }
    }
}

fn invalid(field: impl Into<String>, detail: impl Into<String>) -> ApiError {
    Problem::new(ProblemKind::InvalidField, StatusCode::UNPROCESSABLE_ENTITY).field(field).detail(detail).into()
}

fn not_found() -> ApiError {
    // Like every refusal, rolled back: the Idempotency-Key stays free for the corrected request.
    Problem::new(ProblemKind::NotFound, StatusCode::NOT_FOUND).detail("no such payment").into()
}

/// Parses a JSON object body, checking the media type; names unknown fields.
fn json_object(headers: &HeaderMap, body: &[u8], allowed: &[&str]) -> Result<Map<String, Value>, ApiError> {
    let media_ok = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|m| m.trim().eq_ignore_ascii_case("application/json"))
        .unwrap_or(false);
    if !media_ok {
        return Err(Problem::new(ProblemKind::UnsupportedMediaType, StatusCode::UNSUPPORTED_MEDIA_TYPE)
            .detail("send Content-Type: application/json")
            .into());
    }
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::from(Problem::new(ProblemKind::MalformedJson, StatusCode::BAD_REQUEST).detail(e.to_string()))
    })?;
    let Value::Object(map) = value else {
        return Err(Problem::new(ProblemKind::MalformedJson, StatusCode::BAD_REQUEST)
            .detail("the body must be a JSON object")
            .into());
    };
    if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        let shown: String = unknown.chars().take(64).collect();
        return Err(invalid(shown, "unknown field"));
    }
    Ok(map)
}

fn string_field<'a>(map: &'a Map<String, Value>, field: &'static str) -> Result<&'a str, ApiError> {
    match map.get(field) {
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(invalid(field, "must be a string")),
        None => Err(invalid(field, "is required")),
    }
}

fn uuid_field(map: &Map<String, Value>, field: &'static str) -> Result<Uuid, ApiError> {
    Uuid::try_parse(string_field(map, field)?).map_err(|_| invalid(field, "must be a UUID"))
}

fn amount_field(map: &Map<String, Value>) -> Result<Amount, ApiError> {
    match map.get("amount") {
        Some(Value::String(s)) => Amount::parse(s).map_err(|e| invalid("amount", e.to_string())),
        Some(Value::Number(_)) => Err(invalid("amount", "must be a decimal string like \"12.34\", not a JSON number")),
        Some(_) => Err(invalid("amount", "must be a decimal string like \"12.34\"")),
        None => Err(invalid("amount", "is required")),
    }
}

fn traceparent(headers: &HeaderMap) -> Option<String> {
    let v = headers.get("traceparent")?.to_str().ok()?;
    // version-traceid-parentid-flags, 55 characters in version 00
    let valid = v.len() == 55 && v.split('-').count() == 4 && v.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-');
    valid.then(|| v.to_owned())
}

fn timestamp(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

#[derive(Serialize)]
struct PaymentBody<'a> {
    id: Uuid,
    order_id: Uuid,
    customer_id: Uuid,
    provider: &'a str,
    external_payment_id: Option<&'a str>,
    amount: String,
    currency: &'a str,
    status: idem_ports::PaymentStatus,
    refunded_amount: String,
    created_at: String,
}

impl<'a> From<&'a PaymentRecord> for PaymentBody<'a> {
    fn from(p: &'a PaymentRecord) -> Self {
        Self {
            id: p.id,
            order_id: p.order_id,
            customer_id: p.customer_id,
            provider: &p.provider,
            external_payment_id: p.external_payment_id.as_deref(),
            amount: format_amount(p.amount, &p.currency),
            currency: &p.currency,
            status: p.status,
            refunded_amount: format_amount(p.refunded_amount, &p.currency),
            created_at: timestamp(p.created_at),
        }
    }
}

fn json_response(status: StatusCode, body: &impl Serialize, location: Option<String>) -> Response {
    let bytes = match serde_json::to_vec(body) {
        Ok(b) => b,
        Err(_) => {
            return Problem::new(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR).into_response();
        }
    };
    let mut response = (status, bytes).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(loc) = location.and_then(|l| HeaderValue::try_from(l).ok()) {
        headers.insert(header::LOCATION, loc);
    }
    response
}

const CHARGE_FIELDS: &[&str] =
    &["order_id", "customer_id", "provider", "external_payment_id", "amount", "currency", "payment_method"];

/// Why a request past the provider's window is parked: its call was looked up and not found.
const PARKED_NOT_FOUND: &str = "past the provider's idempotency window and not found there by its reference: sending it again could act twice; check the provider, then resume (looked up again) or abandon";

/// A lookup that failed says nothing of the call it looks for: never a refusal to store (a `404` for an
/// unknown reference parameter would decline a charge that may exist), always an unknown outcome.
fn lookup_failed(e: ProviderError) -> ProviderError {
    match e {
        ProviderError::Refused { code } => {
            ProviderError::Unknown { why: format!("the lookup was refused ({code})"), retry_after: None }
        }
        other => other,
    }
}

/// The recovery point (and downstream key step) of a charge through the provider.
pub const CHARGE_STEP: &str = "charge";

/// `POST /payments`
pub async fn charge(
    State(state): State<ApiState>,
    Extension(merchant): Extension<Merchant>,
    headers: HeaderMap,
    mut tx: Tx,
    body: Bytes,
) -> Result<Response, ApiError> {
    let map = json_object(&headers, &body, CHARGE_FIELDS)?;
    if map.contains_key("payment_method") {
        return charge_through_provider(&state, &merchant, &headers, tx, &map).await;
    }
    let order_id = uuid_field(&map, "order_id")?;
    let customer_id = uuid_field(&map, "customer_id")?;
    let provider = string_field(&map, "provider")?;
    if state.provider.as_ref().is_some_and(|configured| configured.name() == provider) {
        // recorded under the configured provider's name, a charge made elsewhere would be refunded through
        // the provider with the platform's key: only idem's own charges (with a payment_method) carry it
        return Err(invalid(
            "provider",
            "this is the payment provider idem charges through: charge with a payment_method instead of recording a charge made elsewhere",
        ));
    }
    let external_payment_id = string_field(&map, "external_payment_id")?;
    let amount = amount_field(&map)?;
    let currency =
        Currency::parse(string_field(&map, "currency")?).map_err(|e: MoneyError| invalid("currency", e.to_string()))?;
    let cmd = ChargeCommand::new(
        &merchant.0,
        order_id,
        customer_id,
        provider,
        external_payment_id,
        Money::new(amount, currency).map_err(|e| invalid("amount", e.to_string()))?,
    )
    .map_err(|e| invalid(e.field, e.reason))?
    .with_traceparent(traceparent(&headers));
    match charge_payment((state.payments_of)(tx.uow())?, state.env(), &cmd).await {
        Ok(ChargeOutcome::Created(p)) => {
            Ok(json_response(StatusCode::CREATED, &PaymentBody::from(&p), Some(format!("/payments/{}", p.id))))
        }
        Ok(ChargeOutcome::AlreadyCharged(p)) => {
            Ok(json_response(StatusCode::OK, &PaymentBody::from(&p), Some(format!("/payments/{}", p.id))))
        }
        // The one refusal stored on purpose: the key was used for a charge that collides with a payment
        // that exists for good, so every retry with the key gets this answer (the seed's rule)
        Err(ChargeError::DetailsDiffer { .. }) => Err(Problem::new(ProblemKind::PaymentConflict, StatusCode::CONFLICT)
            .detail("a payment with this provider and external_payment_id exists with different details")
            .commit()
            .into()),
        Err(ChargeError::TakenByAnotherMerchant { other_merchant }) => {
            // Policy: (provider, external_payment_id) is unique across merchants (the second protection of
            // money), so a collision is refused; the answer is the same generic conflict whatever the other
            // payment holds, and the event is logged for security review without keys or amounts.
            tracing::warn!(
                security_event = "provider_payment_id_collision",
                merchant = %merchant.0,
                other_merchant = %other_merchant,
                provider = %cmd.provider(),
                "a merchant used a provider payment id that belongs to another merchant"
            );
            Err(Problem::new(ProblemKind::PaymentConflict, StatusCode::CONFLICT)
                .detail("this provider and external_payment_id cannot be used for a new payment")
                .commit()
                .into())
        }
        Err(ChargeError::Store(e)) => Err(e.into()),
    }
}

fn payment_created(p: &PaymentRecord) -> Response {
    json_response(StatusCode::CREATED, &PaymentBody::from(p), Some(format!("/payments/{}", p.id)))
}

/// The answer to a charge the provider declined: stored and replayed (the payment ends `declined`).
fn card_declined(p: &PaymentRecord) -> ApiError {
    Problem::new(ProblemKind::CardDeclined, StatusCode::PAYMENT_REQUIRED)
        .detail(format!("the payment provider declined the charge; payment {} is declined", p.id))
        .commit()
        .into()
}

fn provider_charge_problem(e: ProviderChargeError) -> ApiError {
    match e {
        ProviderChargeError::Store(e) => e.into(),
        other => {
            // an operator's case: logged with the payment id, never a charge applied twice or silently
            tracing::error!(error = %other, "charge through the provider disagrees with the payment");
            Problem::new(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR).into()
        }
    }
}

/// `POST /payments` with a `payment_method`: charged through the payment provider in phases (README,
/// "Calling other systems"). First phase: the payment `pending`, its id derived from the request's key;
/// then the provider's charge under the downstream key of the step, with no transaction open; second
/// phase: `captured` with the provider's charge id and its announcement (or `declined`). A retry or a
/// takeover resumes at the recovery point with the same downstream key, so the provider charges once.
async fn charge_through_provider(
    state: &ApiState,
    merchant: &Merchant,
    headers: &HeaderMap,
    mut tx: Tx,
    map: &Map<String, Value>,
) -> Result<Response, ApiError> {
    for recorded in ["provider", "external_payment_id"] {
        if map.contains_key(recorded) {
            return Err(invalid(
                recorded,
                "a charge through the provider (with payment_method) names no provider payment: leave it out",
            ));
        }
    }
    let Some(provider) = state.provider.clone() else {
        return Err(invalid("payment_method", "this service has no payment provider configured"));
    };
    let amount = amount_field(map)?;
    let currency =
        Currency::parse(string_field(map, "currency")?).map_err(|e: MoneyError| invalid("currency", e.to_string()))?;
    let cmd = ProviderChargeCommand::new(
        &merchant.0,
        uuid_field(map, "order_id")?,
        uuid_field(map, "customer_id")?,
        Money::new(amount, currency).map_err(|e| invalid("amount", e.to_string()))?,
        string_field(map, "payment_method")?,
    )
    .map_err(|e| invalid(e.field, e.reason))?
    .with_traceparent(traceparent(headers));
    let Some(payment_id) = tx.intent_id("payment") else {
        return Err(Problem::new(ProblemKind::IdempotencyKeyMissing, StatusCode::BAD_REQUEST)
            .detail("a charge through the payment provider needs an Idempotency-Key")
            .into());
    };
    let pending = pending_payment((state.payments_of)(tx.uow())?, state.env(), &cmd, payment_id, provider.name())
        .await
        .map_err(provider_charge_problem)?;
    match pending.status {
        PaymentStatus::Pending => {}
        // resumed after the provider's webhook captured it, or after a stored decline was lost
        PaymentStatus::Declined => return Err(card_declined(&pending)),
        _ => return Ok(payment_created(&pending)),
    }
    let call = tx.foreign_call(CHARGE_STEP).await?;
    let charged = if call.past_window() {
        // the provider may have forgotten the key: a repeat could charge twice; look it up instead
        match provider.find_charge(&payment_id.to_string()).await {
            Ok(Some(found)) => Ok(found),
            Ok(None) => return Err(tx.park(call, PARKED_NOT_FOUND).await.into()),
            Err(e) => Err(lookup_failed(e)),
        }
    } else {
        provider.charge(call.key(), &cmd.charge_request(payment_id)).await
    };
    match charged {
        Ok(charge) => {
            tx.resume(call).await?;
            let captured = capture_charge(
                (state.payments_of)(tx.uow())?,
                state.env(),
                payment_id,
                &charge.id,
                (charge.amount_minor, &charge.currency),
                traceparent(headers),
            )
            .await
            .map_err(provider_charge_problem)?;
            Ok(payment_created(captured.payment()))
        }
        Err(ProviderError::Refused { code }) => {
            tracing::info!(payment = %payment_id, code = %code.escape_debug(), "the provider refused the charge");
            tx.resume(call).await?;
            let declined = decline_charge((state.payments_of)(tx.uow())?, state.env(), payment_id)
                .await
                .map_err(provider_charge_problem)?;
            match declined.status {
                PaymentStatus::Declined => Err(card_declined(&declined)),
                // the webhook captured it meanwhile: the provider charged after all
                _ => Ok(payment_created(&declined)),
            }
        }
        Err(ProviderError::Unknown { why, retry_after }) => {
            tracing::warn!(payment = %payment_id, why = %why, "the provider's answer is unknown; the retry asks again under the same key");
            Err(tx.outcome_unknown_after(call, retry_after).await.into())
        }
        Err(ProviderError::NoAnswer(why)) => {
            tracing::warn!(payment = %payment_id, why = %why, "no answer from the provider; the retry asks again under the same key once the lease lapsed");
            Err(tx.unanswered(call).into())
        }
    }
}

#[derive(Serialize)]
struct RefundBody<'a> {
    id: Uuid,
    payment_id: Uuid,
    amount: String,
    reason: Option<&'a str>,
    created_at: String,
    payment_status: idem_ports::PaymentStatus,
    refunded_amount: String,
}

fn refund_body<'a>(r: &'a RefundRecord, p: &PaymentRecord) -> RefundBody<'a> {
    RefundBody {
        id: r.id,
        payment_id: r.payment_id,
        amount: format_amount(r.amount, &p.currency),
        reason: r.reason.as_deref(),
        created_at: timestamp(r.created_at),
        payment_status: p.status,
        refunded_amount: format_amount(p.refunded_amount, &p.currency),
    }
}

/// `POST /payments/{id}/refund`
pub async fn refund(
    State(state): State<ApiState>,
    Extension(merchant): Extension<Merchant>,
    Path(id): Path<String>,
    headers: HeaderMap,
    mut tx: Tx,
    body: Bytes,
) -> Result<Response, ApiError> {
    let payment_id = Uuid::try_parse(&id).map_err(|_| not_found())?;
    let map = json_object(&headers, &body, &["amount", "reason"])?;
    let given = if map.contains_key("amount") { Some(amount_field(&map)?) } else { None };
    let reason = match map.get("reason") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(refund_reason(s).map_err(|e| invalid("reason", e))?),
        Some(_) => return Err(invalid("reason", "must be a string or null")),
    };
    let payment =
        (state.payments_of)(tx.uow())?.payments().get_for_update(payment_id, Some(merchant.0.to_string())).await?;
    // no amount: what is left to refund when the refund runs (a cancellation's compensation), under the
    // payment's lock — never a figure taken earlier that a refund meanwhile made too large
    // a retry of a refund without an amount that was made (recorded by its webhook or the reconciler meanwhile)
    // is answered with it, not with what is left now
    if given.is_none()
        && let (Some(p), Some(refund_id)) = (&payment, tx.intent_id("refund"))
        && let Some(done) = (state.payments_of)(tx.uow())?.payments().get_refund(refund_id).await?
        && done.payment_id == p.id
    {
        return refund_answer(Ok((done, p.clone())));
    }
    let amount = match (given, &payment) {
        (Some(amount), _) => amount,
        (None, Some(p)) => Amount::try_from(idem_domain::payment::refundable(p)).map_err(|_| {
            ApiError::from(
                Problem::new(ProblemKind::RefundExceedsCaptured, StatusCode::CONFLICT)
                    .detail("nothing is left to refund of this payment"),
            )
        })?,
        (None, None) => return Err(not_found()),
    };
    let cmd = RefundCommand {
        id: None,
        merchant_id: Some(merchant.0.to_string()),
        payment_id,
        amount,
        reason,
        saga_id: None,
        traceparent: traceparent(&headers),
    };
    // only a charge idem made itself is refunded at the provider
    if let Some(p) = payment.filter(idem_domain::payment::charged_through_provider) {
        return match state.provider.clone().filter(|provider| p.provider == provider.name()) {
            Some(provider) => refund_through_provider(&state, provider, tx, cmd, p).await,
            // never refunded in idem only: the money is at the provider (an instance configured without it)
            None => Err(Problem::new(ProblemKind::StoreUnavailable, StatusCode::SERVICE_UNAVAILABLE)
                .detail("this payment is refunded through its payment provider, which this instance is not configured for; nothing was done")
                .retry_after(30)
                .into()),
        };
    }
    refund_answer(refund_payment((state.payments_of)(tx.uow())?, state.env(), &cmd).await)
}

/// The answer to a refund (recorded, or through the provider).
fn refund_answer(result: Result<(RefundRecord, PaymentRecord), RefundError>) -> Result<Response, ApiError> {
    match result {
        Ok((refund, payment)) => Ok(json_response(
            StatusCode::CREATED,
            &refund_body(&refund, &payment),
            Some(format!("/payments/{}", payment.id)),
        )),
        Err(RefundError::NotFound) => Err(not_found()),
        // Refusals that depend on the payment (its currency, what is left to refund, its status) conflict
        // with the state of the resource: 409, not 422 (the request itself is well-formed).
        // Refusals roll back and store nothing: the key stays free for the corrected amount, or for a retry
        // once the payment's state allows it.
        Err(RefundError::Amount(e)) => Err(Problem::new(ProblemKind::AmountFinerThanCurrency, StatusCode::CONFLICT)
            .field("amount")
            .detail(e.to_string())
            .into()),
        Err(RefundError::Rule(e @ RefundRuleError::ExceedsCaptured { .. })) => {
            Err(Problem::new(ProblemKind::RefundExceedsCaptured, StatusCode::CONFLICT)
                .field("amount")
                .detail(e.to_string())
                .into())
        }
        Err(RefundError::Rule(e)) => {
            Err(Problem::new(ProblemKind::RefundNotAllowed, StatusCode::CONFLICT).detail(e.to_string()).into())
        }
        Err(RefundError::Store(e)) => Err(e.into()),
    }
}

/// The recovery point (and downstream key step) of a refund through the provider.
pub const REFUND_STEP: &str = "refund";

/// `POST /payments/{id}/refund` of a payment charged through the provider: the refund is checked against
/// the payment (first phase: nothing written but the held record), made at the provider under the step's
/// downstream key with no transaction open, then recorded (second phase, the payment locked and checked
/// again) with the id the provider echoes as `reference` — the id its `charge.refunded` webhook records
/// too, so the two paths make one refund.
async fn refund_through_provider(
    state: &ApiState,
    provider: Arc<dyn PaymentProvider>,
    mut tx: Tx,
    mut cmd: RefundCommand,
    payment: PaymentRecord,
) -> Result<Response, ApiError> {
    let Some(refund_id) = tx.intent_id("refund") else {
        return Err(Problem::new(ProblemKind::IdempotencyKeyMissing, StatusCode::BAD_REQUEST).into());
    };
    cmd.id = Some(refund_id);
    let Some(charge) = payment.external_payment_id.clone() else {
        return refund_answer(Err(RefundError::Rule(RefundRuleError::NotRefundable(payment.status))));
    };
    if let Some(done) = (state.payments_of)(tx.uow())?.payments().get_refund(refund_id).await? {
        if done.payment_id != payment.id {
            // a stored refund answers only for its own payment
            tracing::error!(refund = %refund_id, payment = %payment.id, "a refund id names another payment's refund");
            return Err(Problem::new(ProblemKind::PaymentConflict, StatusCode::CONFLICT)
                .detail("this Idempotency-Key names a refund of another payment: use a new key")
                .into());
        }
        // resumed after the provider's webhook recorded it
        return refund_answer(Ok((done, payment)));
    }
    let currency = Currency::parse(&payment.currency).map_err(|e| invalid("amount", e.to_string()))?;
    let money = match Money::new(cmd.amount, currency) {
        Ok(money) => money,
        Err(e) => return refund_answer(Err(RefundError::Amount(e))),
    };
    if let Err(e) = idem_domain::plan_refund(&payment, cmd.amount) {
        return refund_answer(Err(RefundError::Rule(e)));
    }
    let request = idem_ports::RefundRequest {
        charge,
        amount_minor: idem_domain::usecases::minor_units(&money),
        reference: refund_id.to_string(),
    };
    let call = tx.foreign_call(REFUND_STEP).await?;
    let refunded = if call.past_window() {
        // the provider may have forgotten the key: a repeat could refund twice; look it up instead
        match provider.find_refund(&request.reference).await {
            Ok(Some(found)) => Ok(found),
            Ok(None) => return Err(tx.park(call, PARKED_NOT_FOUND).await.into()),
            Err(e) => Err(lookup_failed(e)),
        }
    } else {
        provider.refund(call.key(), &request).await
    };
    match refunded {
        Ok(_) => {
            tx.resume(call).await?;
            refund_answer(refund_payment((state.payments_of)(tx.uow())?, state.env(), &cmd).await)
        }
        Err(ProviderError::Refused { code }) => {
            tracing::info!(payment = %payment.id, code = %code.escape_debug(), "the provider refused the refund");
            tx.resume(call).await?;
            Err(Problem::new(ProblemKind::RefundNotAllowed, StatusCode::CONFLICT)
                .detail("the payment provider refused the refund")
                .commit()
                .into())
        }
        Err(ProviderError::Unknown { why, retry_after }) => {
            tracing::warn!(payment = %payment.id, why = %why, "the provider's answer to a refund is unknown; the retry asks again under the same key");
            Err(tx.outcome_unknown_after(call, retry_after).await.into())
        }
        Err(ProviderError::NoAnswer(why)) => {
            tracing::warn!(payment = %payment.id, why = %why, "no answer from the provider to a refund; the retry asks again once the lease lapsed");
            Err(tx.unanswered(call).into())
        }
    }
}

/// `GET /payments/{id}`
pub async fn get_payment(
    State(state): State<ApiState>,
    Extension(merchant): Extension<Merchant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = Uuid::try_parse(&id).map_err(|_| not_found())?;
    let mut uow = state.tm.begin().await?;
    let payments = (state.payments_of)(uow.as_mut())?.payments();
    let payment = payments.get(id).await?.filter(|p| *p.merchant_id == *merchant.0).ok_or_else(not_found)?;
    drop(uow);
    Ok(json_response(StatusCode::OK, &PaymentBody::from(&payment), None))
}

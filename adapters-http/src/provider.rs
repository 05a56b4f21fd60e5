//! A payment provider spoken over HTTP (the contract a real provider's adapter maps onto; README, "Calling
//! other systems"): `POST {base}/v1/charges` with `Authorization: Bearer <api key>` and the call's
//! `Idempotency-Key`. What an answer means is the domain's rule (`idem_domain::phases::http_outcome`):
//! `2xx` charged, `409`/`429`/`5xx`/no answer unknown, any other `4xx` refused.

use std::time::Duration;

use async_trait::async_trait;
use idem_domain::phases::{CallOutcome, http_outcome};
use idem_ports::{Charge, ChargeRequest, PaymentProvider, ProviderError, ProviderRefund, RefundRequest};
use serde::Deserialize;

/// The provider at `base`, each call bounded by a timeout. `Debug` never shows the API key.
#[derive(Clone)]
pub struct HttpPaymentProvider {
    name: String,
    base: String,
    api_key: String,
    http: reqwest::Client,
}

impl std::fmt::Debug for HttpPaymentProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpPaymentProvider")
            .field("name", &self.name)
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct ChargeBody {
    id: String,
    amount_minor: i64,
    currency: String,
}

#[derive(Deserialize)]
struct RefundBody {
    id: String,
    amount_minor: i64,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Deserialize)]
struct ErrorDetail {
    code: String,
}

impl HttpPaymentProvider {
    /// The provider `name` (stored as the payments' `provider`) at `base` (`https://…`, no trailing
    /// slash), authenticated with `api_key`; each call gives up after `timeout` (its outcome is then
    /// unknown).
    pub fn new(name: &str, base: &str, api_key: &str, timeout: Duration) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder().timeout(timeout).connect_timeout(timeout).build()?;
        Ok(Self {
            name: name.to_owned(),
            base: base.trim_end_matches('/').to_owned(),
            api_key: api_key.to_owned(),
            http,
        })
    }
}

#[async_trait]
impl PaymentProvider for HttpPaymentProvider {
    fn name(&self) -> &str {
        &self.name
    }

    async fn charge(&self, idempotency_key: &str, request: &ChargeRequest) -> Result<Charge, ProviderError> {
        let body = serde_json::json!({
            "amount_minor": request.amount_minor,
            "currency": request.currency,
            "payment_method": request.payment_method,
            "reference": request.reference,
        });
        let (status, text) = self.post("/v1/charges", idempotency_key, &body).await?;
        let charge: ChargeBody = serde_json::from_slice(&text)
            .map_err(|e| ProviderError::Unknown(format!("unreadable charge (status {status}): {e}")))?;
        Ok(Charge { id: charge.id, amount_minor: charge.amount_minor, currency: charge.currency })
    }

    async fn refund(&self, idempotency_key: &str, request: &RefundRequest) -> Result<ProviderRefund, ProviderError> {
        let body = serde_json::json!({
            "charge": request.charge,
            "amount_minor": request.amount_minor,
            "reference": request.reference,
        });
        let (status, text) = self.post("/v1/refunds", idempotency_key, &body).await?;
        let refund: RefundBody = serde_json::from_slice(&text)
            .map_err(|e| ProviderError::Unknown(format!("unreadable refund (status {status}): {e}")))?;
        Ok(ProviderRefund { id: refund.id, amount_minor: refund.amount_minor })
    }
}

impl HttpPaymentProvider {
    /// Posts `body` to `path` under `idempotency_key`: the body of a `2xx`, or what the answer means.
    async fn post(
        &self,
        path: &str,
        idempotency_key: &str,
        body: &serde_json::Value,
    ) -> Result<(u16, bytes::Bytes), ProviderError> {
        let reply = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.api_key)
            .header("idempotency-key", idempotency_key)
            .json(body)
            .send()
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            // no answer: a timeout, a reset, a refused connection (reqwest's text names the URL, no secret)
            // refused before anything was sent: nothing is in process at the provider
            Err(e) if e.is_connect() => return Err(ProviderError::Unknown(e.without_url().to_string())),
            Err(e) => return Err(ProviderError::NoAnswer(e.without_url().to_string())),
        };
        let status = reply.status().as_u16();
        let text = reply.bytes().await.map_err(|e| ProviderError::NoAnswer(e.without_url().to_string()))?;
        match http_outcome(Some(status)) {
            CallOutcome::Succeeded => Ok((status, text)),
            CallOutcome::Refused => {
                let code = serde_json::from_slice::<ErrorBody>(&text).map(|b| b.error.code).unwrap_or_default();
                Err(ProviderError::Refused { code: if code.is_empty() { format!("http_{status}") } else { code } })
            }
            CallOutcome::Unknown => Err(ProviderError::Unknown(format!("status {status}"))),
        }
    }
}

//! A payment provider spoken over HTTP (the contract a real provider's adapter maps onto; README, "Calling
//! other systems"): `POST {base}/v1/charges` with `Authorization: Bearer <api key>` and the call's
//! `Idempotency-Key`. What an answer means is the domain's rule (`idem_domain::phases::http_outcome`, one
//! table): a refusal only with the provider's error body, a gateway's `502`/`504` or a redirect (never
//! followed) is no answer, and an answer that is not the provider's is never stored. Answers are read up
//! to [`MAX_ANSWER`] bytes within the call's timeout.

#![warn(missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_domain::phases::{CallOutcome, http_outcome};
use idem_ports::{Charge, ChargeRequest, Listing, Page, PaymentProvider, ProviderError, ProviderRefund, RefundRequest};
use serde::Deserialize;

/// The provider at `base`, each call bounded by a timeout. `Debug` never shows the API key.
#[derive(Clone)]
pub struct HttpPaymentProvider {
    name: String,
    base: String,
    api_key: String,
    http: reqwest::Client,
    unrecognised: Arc<prometheus_client::metrics::counter::Counter>,
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
struct Listed<T> {
    data: Vec<T>,
    #[serde(default)]
    has_more: bool,
}

#[derive(Deserialize)]
struct ListedItem {
    id: String,
    charge: Option<String>,
    amount_minor: i64,
    currency: Option<String>,
    reference: Option<String>,
    status: Option<String>,
    #[serde(default)]
    created: i64,
}

#[derive(Deserialize)]
struct ListedCharge {
    id: String,
    amount_minor: i64,
    currency: String,
    reference: Option<String>,
    status: Option<String>,
}

#[derive(Deserialize)]
struct ListedRefund {
    id: String,
    amount_minor: i64,
    reference: Option<String>,
    status: Option<String>,
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
    /// The provider `name` (stored as the payments' `provider`) at `base` (`https://…`, `http://` only to a
    /// loopback host, no credentials: [`check_base_url`]), authenticated with `api_key`; each call gives up
    /// after `timeout` (its outcome is then unknown). Redirects are never followed.
    pub fn new(name: &str, base: &str, api_key: &str, timeout: Duration) -> Result<Self, ProviderSetupError> {
        check_base_url(base).map_err(ProviderSetupError::Url)?;
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            // a redirect would re-send the charge (card token included) to another host and take its answer
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Self {
            name: name.to_owned(),
            base: base.trim_end_matches('/').to_owned(),
            api_key: api_key.to_owned(),
            http,
            unrecognised: Arc::default(),
        })
    }

    /// Registers `idem_provider_unrecognised_answers_total`: answers that were not the provider's (an
    /// ingress's 404, a 401 for a wrong key, a 2xx that is no charge); an alert fires while they come.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "idem_provider_unrecognised_answers",
            "Answers to provider calls that were not the provider's (held, never stored as a refusal)",
            (*self.unrecognised).clone(),
        );
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
        let charge: ChargeBody = self.post("/v1/charges", idempotency_key, &body).await?;
        Ok(Charge { id: charge.id, amount_minor: charge.amount_minor, currency: charge.currency })
    }

    async fn refund(&self, idempotency_key: &str, request: &RefundRequest) -> Result<ProviderRefund, ProviderError> {
        let body = serde_json::json!({
            "charge": request.charge,
            "amount_minor": request.amount_minor,
            "reference": request.reference,
        });
        let refund: RefundBody = self.post("/v1/refunds", idempotency_key, &body).await?;
        Ok(ProviderRefund { id: refund.id, amount_minor: refund.amount_minor })
    }

    async fn find_charge(&self, reference: &str) -> Result<Option<Charge>, ProviderError> {
        let found: Listed<ListedCharge> = self.get("/v1/charges", reference).await?;
        // only what the provider says is this reference's, succeeded, and one: a provider that ignored the
        // filter (or lists failed attempts) must not hand another payment's charge to this one
        let has_more = found.has_more;
        let mine: Vec<ListedCharge> = found
            .data
            .into_iter()
            .filter(|c| {
                c.reference.as_deref() == Some(reference) && c.status.as_deref().is_none_or(|s| s == "succeeded")
            })
            .collect();
        match mine.as_slice() {
            [] if !has_more => Ok(None),
            [c] if !has_more => {
                Ok(Some(Charge { id: c.id.clone(), amount_minor: c.amount_minor, currency: c.currency.clone() }))
            }
            _ => Err(ProviderError::Unknown {
                why: "the lookup found more than one charge, or more pages: an operator's case".into(),
                retry_after: None,
            }),
        }
    }

    async fn list(&self, what: Listing, created_gte: i64, starting_after: Option<&str>) -> Result<Page, ProviderError> {
        let path = match what {
            Listing::Charges => "/v1/charges",
            Listing::Refunds => "/v1/refunds",
        };
        let mut query = vec![("created_gte", created_gte.to_string()), ("limit", "100".to_owned())];
        if let Some(after) = starting_after {
            query.push(("starting_after", after.to_owned()));
        }
        let request = self.http.get(format!("{}{path}", self.base)).bearer_auth(&self.api_key).query(&query);
        let page: Listed<ListedItem> = self.answer(request).await?;
        Ok(Page {
            has_more: page.has_more,
            last_id: page.data.last().map(|i| i.id.clone()),
            data: page
                .data
                .into_iter()
                .filter(|i| i.status.as_deref().is_none_or(|s| s == "succeeded"))
                .map(|i| idem_ports::Listed {
                    id: i.id,
                    charge: i.charge,
                    amount_minor: i.amount_minor,
                    currency: i.currency,
                    reference: i.reference,
                    created: i.created,
                })
                .collect(),
        })
    }

    async fn find_refund(&self, reference: &str) -> Result<Option<ProviderRefund>, ProviderError> {
        let found: Listed<ListedRefund> = self.get("/v1/refunds", reference).await?;
        let has_more = found.has_more;
        let mine: Vec<ListedRefund> = found
            .data
            .into_iter()
            .filter(|r| {
                r.reference.as_deref() == Some(reference) && r.status.as_deref().is_none_or(|s| s == "succeeded")
            })
            .collect();
        match mine.as_slice() {
            [] if !has_more => Ok(None),
            [r] if !has_more => Ok(Some(ProviderRefund { id: r.id.clone(), amount_minor: r.amount_minor })),
            _ => Err(ProviderError::Unknown {
                why: "the lookup found more than one refund, or more pages: an operator's case".into(),
                retry_after: None,
            }),
        }
    }
}

impl HttpPaymentProvider {
    /// Posts `body` to `path` under `idempotency_key`: the provider's `T` for a `2xx`, or what the answer
    /// means (`idem_domain::phases::http_outcome`).
    async fn post<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        idempotency_key: &str,
        body: &serde_json::Value,
    ) -> Result<T, ProviderError> {
        let request = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.api_key)
            .header("idempotency-key", idempotency_key)
            .json(body);
        self.answer(request).await
    }

    /// Lists what `path` holds with `reference` (`GET {path}?reference=…` → `{"data": […], "has_more":
    /// false}`), read like any answer.
    async fn get<T: serde::de::DeserializeOwned>(&self, path: &str, reference: &str) -> Result<T, ProviderError> {
        let request =
            self.http.get(format!("{}{path}", self.base)).bearer_auth(&self.api_key).query(&[("reference", reference)]);
        self.answer(request).await
    }

    /// Sends `request`: the provider's `T` for a `2xx`, or what the answer means.
    async fn answer<T: serde::de::DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<T, ProviderError> {
        let reply = request.send().await;
        let mut reply = match reply {
            Ok(reply) => reply,
            // refused before anything was sent: nothing is in process at the provider (reqwest's text
            // without the URL)
            Err(e) if e.is_connect() => {
                return Err(ProviderError::Unknown { why: e.without_url().to_string(), retry_after: None });
            }
            // a timeout, a reset: the call may still be in process
            Err(e) => return Err(ProviderError::NoAnswer(e.without_url().to_string())),
        };
        let status = reply.status().as_u16();
        let retry_after = reply
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|s| Duration::from_secs(s.min(3600)));
        let mut text = Vec::new();
        loop {
            match reply.chunk().await {
                Ok(Some(chunk)) if text.len() + chunk.len() <= MAX_ANSWER => text.extend_from_slice(&chunk),
                Ok(Some(_)) => return Err(self.unrecognised(status, "an answer longer than MAX_ANSWER")),
                Ok(None) => break,
                Err(e) => return Err(ProviderError::NoAnswer(e.without_url().to_string())),
            }
        }
        let success = if (200..300).contains(&status) { serde_json::from_slice::<T>(&text).ok() } else { None };
        let error_code = serde_json::from_slice::<ErrorBody>(&text).ok().map(|b| b.error.code);
        match http_outcome(Some(status), success.is_some() || error_code.is_some()) {
            CallOutcome::Succeeded => success.ok_or_else(|| self.unrecognised(status, "unreadable")),
            CallOutcome::Refused => Err(ProviderError::Refused {
                code: error_code.filter(|c| !c.is_empty()).unwrap_or_else(|| format!("http_{status}")),
            }),
            CallOutcome::Unknown => Err(ProviderError::Unknown { why: format!("status {status}"), retry_after }),
            CallOutcome::NoAnswer => Err(ProviderError::NoAnswer(format!("status {status}"))),
            CallOutcome::Unrecognised => Err(self.unrecognised(status, "not the provider's answer")),
        }
    }

    /// An answer that is not the provider's: held like no answer (never a refusal stored for a payment),
    /// logged and counted for the alert.
    fn unrecognised(&self, status: u16, what: &str) -> ProviderError {
        self.unrecognised.inc();
        tracing::error!(status, what, provider = %self.name, "an answer to a provider call that is not the provider's (an ingress, a wrong URL or key?): the request stays held and is asked again");
        ProviderError::NoAnswer(format!("status {status}: {what}"))
    }
}

/// The largest answer read from the provider: a charge or a refund is a few hundred bytes; anything longer
/// is not the provider's answer.
pub const MAX_ANSWER: usize = 64 * 1024;

/// Why `PAYMENT_PROVIDER_URL` cannot be used: it must be `https://` (`http://` only to a loopback host) and
/// carry no credentials (the key goes in `Authorization`, never in a URL that is logged and printed).
pub fn check_base_url(base: &str) -> Result<(), String> {
    let url = reqwest::Url::parse(base).map_err(|e| format!("is not a URL ({e})"))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must carry no credentials: give the provider's key as PAYMENT_PROVIDER_API_KEY".into());
    }
    let Some(host) = url.host_str() else { return Err("names no host".into()) };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback =
        host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    match url.scheme() {
        "https" => Ok(()),
        "http" if loopback => Ok(()),
        "http" => Err("must be https:// (http:// only to a loopback host)".into()),
        _ => Err("must be an https:// URL".into()),
    }
}

/// Why the provider's client was not built.
#[derive(Debug, thiserror::Error)]
pub enum ProviderSetupError {
    /// The base URL is unusable ([`check_base_url`]).
    #[error("the payment provider's URL {0}")]
    Url(String),
    /// The HTTP client could not be built (TLS).
    #[error("the payment provider's HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

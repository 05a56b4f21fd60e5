//! A small client for services that call idem: one `Idempotency-Key` per business operation, generated
//! once and reused on every retry (exponential backoff with full jitter, honouring `Retry-After` on 409
//! in-flight and 503), never a new key per attempt.

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

/// Retry policy.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Sends per operation, the first included.
    pub max_attempts: u32,
    /// First retry delay.
    pub base_delay: Duration,
    /// Longest retry delay.
    pub max_delay: Duration,
    /// Per-attempt timeout.
    pub timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 8,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(10),
            timeout: Duration::from_secs(10),
        }
    }
}

/// A charge request.
#[derive(Debug, Clone, Serialize)]
pub struct ChargeRequest {
    /// The order.
    pub order_id: Uuid,
    /// The paying customer.
    pub customer_id: Uuid,
    /// Payment provider.
    pub provider: String,
    /// The provider's payment id.
    pub external_payment_id: String,
    /// Decimal string, for example "12.34".
    pub amount: String,
    /// ISO 4217 code.
    pub currency: String,
}

/// What the service finally answered.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// HTTP status of the final answer.
    pub status: u16,
    /// Its JSON body.
    pub body: Value,
    /// Whether the answer was a replay of a stored response.
    pub replayed: bool,
    /// Attempts made (1 = no retry).
    pub attempts: u32,
    /// The key used on every attempt.
    pub idempotency_key: String,
}

/// Why the client gave up.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Every attempt failed or answered a retryable status.
    #[error("gave up after {attempts} attempts with key {key}: {last}")]
    Exhausted {
        /// Sends made.
        attempts: u32,
        /// The key they used.
        key: String,
        /// The last answer or error.
        last: String,
    },
    #[error("invalid request: {0}")]
    /// The base URL or the API key is unusable.
    Invalid(String),
}

/// The client. Its `Debug` output never shows the API key.
#[derive(Clone)]
pub struct IdemClient {
    http: reqwest::Client,
    base: String,
    api_key: String,
    policy: RetryPolicy,
}

impl std::fmt::Debug for IdemClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdemClient").field("base", &self.base).field("policy", &self.policy).finish_non_exhaustive()
    }
}

impl IdemClient {
    /// A client of the service at `base`, authenticated with `api_key`.
    pub fn new(base: &str, api_key: &str, policy: RetryPolicy) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder()
            .timeout(policy.timeout)
            .build()
            .map_err(|e| ClientError::Invalid(e.to_string()))?;
        Ok(Self { http, base: base.trim_end_matches('/').to_owned(), api_key: api_key.to_owned(), policy })
    }

    /// A new key for a new business operation.
    #[allow(clippy::disallowed_methods)] // client side: the caller's own id, not the service's
    pub fn new_key() -> String {
        Uuid::now_v7().to_string()
    }

    /// Charges; `key` identifies the operation (reuse it if the caller itself retries later).
    pub async fn charge(&self, key: &str, request: &ChargeRequest) -> Result<Reply, ClientError> {
        let body = serde_json::to_vec(request).map_err(|e| ClientError::Invalid(e.to_string()))?;
        self.post("/payments", key, body).await
    }

    /// Refunds part of a payment.
    pub async fn refund(&self, key: &str, payment_id: Uuid, amount: &str) -> Result<Reply, ClientError> {
        let body = serde_json::to_vec(&serde_json::json!({ "amount": amount }))
            .map_err(|e| ClientError::Invalid(e.to_string()))?;
        self.post(&format!("/payments/{payment_id}/refund"), key, body).await
    }

    /// POSTs `body` with `key`, retrying what is safe to retry with the same key.
    pub async fn post(&self, path: &str, key: &str, body: Vec<u8>) -> Result<Reply, ClientError> {
        let url = format!("{}{path}", self.base);
        let mut last = String::new();
        for attempt in 1..=self.policy.max_attempts {
            let sent = self
                .http
                .post(&url)
                .bearer_auth(&self.api_key)
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await;
            let wait = match sent {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let retry_after = resp
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .map(Duration::from_secs);
                    let replayed = resp.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
                    let text = resp.bytes().await.unwrap_or_default();
                    let body: Value = serde_json::from_slice(&text).unwrap_or(Value::Null);
                    let in_flight = status == 409 && body["type"] == "urn:idem:problem:request-in-flight";
                    if !(in_flight || status == 503 || status == 502 || status == 504 || status == 429) {
                        return Ok(Reply {
                            status,
                            body,
                            replayed,
                            attempts: attempt,
                            idempotency_key: key.to_owned(),
                        });
                    }
                    last = format!("status {status}");
                    retry_after.unwrap_or_else(|| self.backoff(attempt)).max(self.backoff(attempt) / 2)
                }
                Err(e) => {
                    // The request may or may not have executed: the same key makes the retry safe.
                    last = e.to_string();
                    self.backoff(attempt)
                }
            };
            if attempt < self.policy.max_attempts {
                tokio::time::sleep(wait).await;
            }
        }
        Err(ClientError::Exhausted { attempts: self.policy.max_attempts, key: key.to_owned(), last })
    }

    /// Exponential backoff with jitter (`idem_ports::Backoff`, the service's own schedule).
    fn backoff(&self, attempt: u32) -> Duration {
        idem_ports::Backoff::new(self.policy.base_delay, self.policy.max_delay).nth(attempt)
    }
}

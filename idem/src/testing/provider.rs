//! A stand-in payment provider speaking idem's provider contract (README, "Calling other systems"), for
//! tests: `POST /v1/charges` with a Bearer key and an `Idempotency-Key`; a repeated key with the same
//! parameters gets the first answer (as Stripe does), with other parameters `422 key_reused`;
//! `payment_method = "pm_card_declined"` is `402 card_declined`. It counts its charges per key, so tests
//! count effects at the provider, and it can answer late or fail the next calls before charging.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

/// The provider's state, shared with the test.
#[derive(Debug, Default)]
pub struct StandIn {
    /// The API key it accepts.
    pub api_key: String,
    /// Answers by idempotency key: the request's parameters and the answer.
    answers: Mutex<HashMap<String, (Value, Value)>>,
    /// Charges made.
    pub charges: AtomicUsize,
    /// Calls received.
    pub calls: AtomicUsize,
    /// Each answer is sent this many milliseconds late (after charging).
    pub delay_ms: AtomicU64,
    /// The next calls fail with this status before charging (0: none), counted down by `failures`.
    pub fail_status: AtomicU16,
    /// How many next calls fail.
    pub failures: AtomicUsize,
    /// The failed calls' `Retry-After` in seconds (0: none).
    pub fail_retry_after: AtomicU64,
    /// Refunds by idempotency key: the request's parameters and the answer.
    refunds: Mutex<HashMap<String, (Value, Value)>>,
    /// Refunds made.
    pub refunds_made: AtomicUsize,
    /// Lookups received (`GET /v1/charges`, `GET /v1/refunds`).
    pub lookups: AtomicUsize,
}

impl StandIn {
    /// Charges made for `key`: 0 or 1.
    pub fn charges_for(&self, key: &str) -> usize {
        self.answers.lock().map(|a| usize::from(a.contains_key(key))).unwrap_or_default()
    }

    /// Minor units refunded of the charge `charge`.
    pub fn refunded_of(&self, charge: &str) -> i64 {
        let Ok(refunds) = self.refunds.lock() else { return 0 };
        refunds
            .values()
            .filter(|(_, a)| a["charge"] == charge)
            .map(|(_, a)| a["amount_minor"].as_i64().unwrap_or_default())
            .sum()
    }

    /// A refund made at the provider itself (its dashboard), not through its API: its id.
    pub fn refund_from_dashboard(&self, charge: &str, amount_minor: i64) -> String {
        let n = self.refunds_made.fetch_add(1, SeqCst) + 1;
        let id = format!("re_{n}");
        let answer = json!({"id": id, "status": "succeeded", "charge": charge, "amount_minor": amount_minor,
                            "created": chrono::Utc::now().timestamp()});
        if let Ok(mut refunds) = self.refunds.lock() {
            refunds.insert(format!("dashboard-{n}"), (Value::Null, answer));
        }
        id
    }

    /// A charge made at the provider by other means (its dashboard, another integration) with `reference`:
    /// its id. The reconciler finds it.
    pub fn charge_elsewhere(&self, reference: &str, amount_minor: i64) -> String {
        let n = self.charges.fetch_add(1, SeqCst) + 1;
        let id = format!("ch_{n}");
        let answer = json!({"id": id, "status": "succeeded", "amount_minor": amount_minor, "currency": "EUR",
                            "reference": reference, "created": chrono::Utc::now().timestamp()});
        if let Ok(mut answers) = self.answers.lock() {
            answers.insert(format!("elsewhere-{n}"), (Value::Null, answer));
        }
        id
    }

    /// Every charge made: its id, amount in minor units and reference (idem's payment id), in no order.
    pub fn charges_made(&self) -> Vec<(String, i64, String)> {
        let Ok(answers) = self.answers.lock() else { return Vec::new() };
        answers
            .values()
            .filter(|(_, a)| a["status"] == "succeeded")
            .map(|(_, a)| {
                let text = |f: &str| a[f].as_str().unwrap_or_default().to_owned();
                (text("id"), a["amount_minor"].as_i64().unwrap_or_default(), text("reference"))
            })
            .collect()
    }
}

/// A status, its headers (a `Retry-After`) and a JSON body.
type Answer = (StatusCode, HeaderMap, Json<Value>);

fn error(status: StatusCode, kind: &str, code: &str) -> Answer {
    (status, HeaderMap::new(), Json(json!({"error": {"type": kind, "code": code}})))
}

impl StandIn {
    /// Sends `answer` (a success or a refusal) after the configured delay.
    async fn answer(&self, answer: Result<Value, Answer>) -> Answer {
        tokio::time::sleep(Duration::from_millis(self.delay_ms.load(SeqCst))).await;
        match answer {
            Ok(answer) => (StatusCode::OK, HeaderMap::new(), Json(answer)),
            Err(refusal) => refusal,
        }
    }

    /// The Bearer key, checked.
    #[allow(clippy::result_large_err)] // one per call of a test double
    fn authenticated(&self, headers: &HeaderMap) -> Result<(), Answer> {
        let bearer = headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if bearer != Some(self.api_key.as_str()) {
            return Err(error(StatusCode::UNAUTHORIZED, "authentication_error", "invalid_api_key"));
        }
        Ok(())
    }

    /// Forgets every idempotency key, as a provider does once its window (24 h at Stripe) passed: a repeated
    /// key then makes a new charge. The charges stay (and are found by reference).
    pub fn forget_keys(&self) {
        if let Ok(mut answers) = self.answers.lock() {
            let kept: Vec<(Value, Value)> = answers.drain().map(|(_, v)| v).collect();
            for (n, v) in kept.into_iter().enumerate() {
                answers.insert(format!("forgotten-{n}"), v);
            }
        }
    }

    /// What every call goes through first: counted, authenticated, keyed, and failed when told to.
    #[allow(clippy::result_large_err)] // one per call of a test double
    fn admit(&self, headers: &HeaderMap) -> Result<String, Answer> {
        self.calls.fetch_add(1, SeqCst);
        let bearer = headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if bearer != Some(self.api_key.as_str()) {
            return Err(error(StatusCode::UNAUTHORIZED, "authentication_error", "invalid_api_key"));
        }
        let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned) else {
            return Err(error(StatusCode::BAD_REQUEST, "invalid_request_error", "idempotency_key_missing"));
        };
        if self.failures.load(SeqCst) > 0 {
            self.failures.fetch_sub(1, SeqCst);
            let status =
                StatusCode::from_u16(self.fail_status.load(SeqCst)).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut failed = error(status, "api_error", "injected");
            let wait = self.fail_retry_after.load(SeqCst);
            if wait > 0 {
                failed.1.insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from(wait));
            }
            return Err(failed);
        }
        Ok(key)
    }
}

/// Serves a stand-in provider accepting `api_key`; returns its state and base URL.
pub async fn start(api_key: &str) -> anyhow::Result<(Arc<StandIn>, String)> {
    let state = Arc::new(StandIn { api_key: api_key.to_owned(), ..StandIn::default() });
    let router = axum::Router::new()
        .route("/v1/charges", axum::routing::post(charge).get(list_charges))
        .route("/v1/refunds", axum::routing::post(refund).get(list_refunds))
        .with_state(state.clone());
    Ok((state, super::serve(router).await?))
}

async fn charge(State(p): State<Arc<StandIn>>, headers: HeaderMap, Json(params): Json<Value>) -> Answer {
    let key = match p.admit(&headers) {
        Ok(key) => key,
        Err(refusal) => return refusal,
    };
    let answer = {
        let Ok(mut answers) = p.answers.lock() else {
            return error(StatusCode::INTERNAL_SERVER_ERROR, "api_error", "poisoned");
        };
        match answers.get(&key) {
            Some((first, answer)) if *first == params => Ok(answer.clone()),
            Some(_) => Err(error(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_error", "key_reused")),
            None if params["payment_method"] == "pm_card_declined" => {
                Err(error(StatusCode::PAYMENT_REQUIRED, "card_error", "card_declined"))
            }
            None => {
                let n = p.charges.fetch_add(1, SeqCst) + 1;
                let answer = json!({
                    "id": format!("ch_{n}"), "status": "succeeded", "amount_minor": params["amount_minor"],
                    "currency": params["currency"], "reference": params["reference"],
                    "created": chrono::Utc::now().timestamp(),
                });
                answers.insert(key, (params.clone(), answer.clone()));
                Ok(answer)
            }
        }
    };
    p.answer(answer).await
}

/// `GET /v1/charges?reference=…`: the charges made with that reference (`{"data": […], "has_more":
/// false}`), as a provider's lookup answers once its idempotency window forgot the key; without a
/// reference, a listing page ([`listed`]).
async fn list_charges(
    State(p): State<Arc<StandIn>>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, String>>,
) -> Answer {
    let items = p.answers.lock().map(|a| a.values().map(|(_, c)| c.clone()).collect()).unwrap_or_default();
    p.look_up(&headers, items, &q)
}

/// `GET /v1/refunds?reference=…`, like [`list_charges`].
async fn list_refunds(
    State(p): State<Arc<StandIn>>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, String>>,
) -> Answer {
    let items = p.refunds.lock().map(|r| r.values().map(|(_, a)| a.clone()).collect()).unwrap_or_default();
    p.look_up(&headers, items, &q)
}

impl StandIn {
    /// A lookup (`reference`: its succeeded items) or a listing page of `items`, counted and authenticated.
    fn look_up(&self, headers: &HeaderMap, items: Vec<Value>, q: &HashMap<String, String>) -> Answer {
        self.lookups.fetch_add(1, SeqCst);
        if let Err(refusal) = self.authenticated(headers) {
            return refusal;
        }
        let Some(reference) = q.get("reference") else { return listed(items, q) };
        let found: Vec<Value> =
            items.into_iter().filter(|v| v["reference"] == reference.as_str() && v["status"] == "succeeded").collect();
        (StatusCode::OK, HeaderMap::new(), Json(json!({"data": found, "has_more": false})))
    }
}

/// A listing page: `created_gte`, `starting_after` (an id), `limit` (at most 100), ordered by id number.
fn listed(mut items: Vec<Value>, q: &HashMap<String, String>) -> Answer {
    let number = |v: &Value| {
        v["id"].as_str().and_then(|id| id.split('_').nth(1)).and_then(|n| n.parse::<u64>().ok()).unwrap_or_default()
    };
    let since = q.get("created_gte").and_then(|v| v.parse::<i64>().ok()).unwrap_or(0);
    items.retain(|v| v["status"] == "succeeded" && v["created"].as_i64().unwrap_or(0) >= since);
    items.sort_by_key(number);
    if let Some(after) = q.get("starting_after") {
        let after = number(&json!({"id": after}));
        items.retain(|v| number(v) > after);
    }
    let limit = q.get("limit").and_then(|v| v.parse::<usize>().ok()).unwrap_or(100).clamp(1, 100);
    let has_more = items.len() > limit;
    items.truncate(limit);
    (StatusCode::OK, HeaderMap::new(), Json(json!({"data": items, "has_more": has_more})))
}

/// `POST /v1/refunds`: a refund of a charge made here, at most what is left of it; a repeated key with the
/// same parameters gets the first answer.
async fn refund(State(p): State<Arc<StandIn>>, headers: HeaderMap, Json(params): Json<Value>) -> Answer {
    let key = match p.admit(&headers) {
        Ok(key) => key,
        Err(refusal) => return refusal,
    };
    let charge = params["charge"].as_str().unwrap_or_default().to_owned();
    let charged = p
        .answers
        .lock()
        .ok()
        .and_then(|a| a.values().find(|(_, c)| c["id"] == charge.as_str()).map(|(_, c)| c["amount_minor"].as_i64()))
        .flatten();
    let already = p.refunded_of(&charge);
    let answer = {
        let Ok(mut refunds) = p.refunds.lock() else {
            return error(StatusCode::INTERNAL_SERVER_ERROR, "api_error", "poisoned");
        };
        match (refunds.get(&key), charged) {
            (Some((first, answer)), _) if *first == params => Ok(answer.clone()),
            (Some(_), _) => Err(error(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_error", "key_reused")),
            (None, None) => Err(error(StatusCode::NOT_FOUND, "invalid_request_error", "no_such_charge")),
            (None, Some(charged)) if already + params["amount_minor"].as_i64().unwrap_or(i64::MAX) > charged => {
                Err(error(StatusCode::BAD_REQUEST, "invalid_request_error", "amount_too_large"))
            }
            (None, Some(_)) => {
                let n = p.refunds_made.fetch_add(1, SeqCst) + 1;
                let answer = json!({
                    "id": format!("re_{n}"), "status": "succeeded", "charge": charge,
                    "amount_minor": params["amount_minor"], "reference": params["reference"],
                    "created": chrono::Utc::now().timestamp(),
                });
                refunds.insert(key, (params.clone(), answer.clone()));
                Ok(answer)
            }
        }
    };
    p.answer(answer).await
}

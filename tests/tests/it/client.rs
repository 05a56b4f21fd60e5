//! The retrying client: one key per operation, reused on every retry; Retry-After honoured.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use idem_http::client::{ChargeRequest, IdemClient, RetryPolicy};
use uuid::Uuid;

fn request() -> ChargeRequest {
    ChargeRequest {
        order_id: Uuid::now_v7(),
        customer_id: Uuid::now_v7(),
        provider: "stripe".into(),
        external_payment_id: format!("pi_{}", Uuid::now_v7()),
        amount: "9.99".into(),
        currency: "EUR".into(),
    }
}

#[tokio::test]
async fn retries_reuse_the_key_and_honour_retry_after() -> anyhow::Result<()> {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    let handler = move |headers: HeaderMap| {
        let log = log.clone();
        async move {
            let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            let n = {
                let mut seen = log.lock().expect("lock");
                seen.push(key);
                seen.len()
            };
            let problem = |status: StatusCode, kind: &str| {
                let body = format!("{{\"type\":\"urn:idem:problem:{kind}\",\"status\":{}}}", status.as_u16());
                (status, [("retry-after", "1"), ("content-type", "application/problem+json")], body).into_response()
            };
            match n {
                1 => problem(StatusCode::SERVICE_UNAVAILABLE, "service-unavailable"),
                2 => problem(StatusCode::CONFLICT, "request-in-flight"),
                _ => (StatusCode::CREATED, [("content-type", "application/json")], "{\"id\":\"p1\"}").into_response(),
            }
        }
    };
    let base = idem_tests::serve(axum::Router::new().route("/payments", axum::routing::post(handler))).await?;
    let policy = RetryPolicy { base_delay: Duration::from_millis(10), ..RetryPolicy::default() };
    let client = IdemClient::new(&base, "key_0123456789", policy)?;
    let key = IdemClient::new_key();
    let start = Instant::now();
    let reply = client.charge(&key, &request()).await?;
    let elapsed = start.elapsed();
    assert_eq!(reply.status, 201);
    assert_eq!(reply.attempts, 3);
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen, vec![key.clone(), key.clone(), key], "the same key on every attempt");
    assert!(elapsed >= Duration::from_secs(2), "two Retry-After: 1 answers were honoured ({elapsed:?})");
    Ok(())
}

#[tokio::test]
async fn a_conflict_is_not_retried() -> anyhow::Result<()> {
    let calls = Arc::new(Mutex::new(0));
    let counter = calls.clone();
    let handler = move || {
        let counter = counter.clone();
        async move {
            *counter.lock().expect("lock") += 1;
            (StatusCode::CONFLICT, "{\"type\":\"urn:idem:problem:idempotency-key-reused\"}").into_response()
        }
    };
    let base = idem_tests::serve(axum::Router::new().route("/payments", axum::routing::post(handler))).await?;
    let client = IdemClient::new(&base, "key_0123456789", RetryPolicy::default())?;
    let reply = client.charge(&IdemClient::new_key(), &request()).await?;
    assert_eq!((reply.status, reply.attempts), (409, 1));
    assert_eq!(*calls.lock().expect("lock"), 1);
    Ok(())
}

//! The payments API and its idempotency layer, through real HTTP against real PostgreSQL.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use idem_domain::TtlPolicy;
use idem_domain::usecases::{ChargeCommand, Env, charge_payment};
use idem_domain::{Amount, Currency, Money};
use idem_http::{ApiKeys, ApiState, IdempotencyConfig, IdempotencyLayer, Tx};
use idem_ports::{Clock, SystemClock, TransactionManager, UuidV7Generator};
use idem_postgres::PgStore;
use idem_tests::TestDb;
use reqwest::header::HeaderMap;
use serde_json::{Value, json};
use uuid::Uuid;

const KEY_A: &str = "key_a_0123456789";
const KEY_B: &str = "key_b_0123456789";

struct Api {
    db: TestDb,
    base: String,
    http: reqwest::Client,
}

/// `router` with every request authenticated as `merchant_a` (routes built without the API's key layer).
fn as_merchant_a(router: axum::Router) -> axum::Router {
    router.layer(axum::middleware::from_fn(
        |mut req: axum::extract::Request, next: axum::middleware::Next| async move {
            req.extensions_mut().insert(idem_http::Merchant("merchant_a".into()));
            next.run(req).await
        },
    ))
}

fn layer_config(conflict: StatusCode) -> IdempotencyConfig {
    let ttl = TtlPolicy::new(Duration::from_secs(48 * 3600)).expect("valid ttl");
    let mut config = IdempotencyConfig::new(ttl, idem_http::merchant_scope());
    config.conflict_status = conflict;
    config.wait = Duration::from_secs(5);
    config
}

fn api_state(store: &PgStore) -> ApiState {
    ApiState {
        payments_of: idem_postgres::payments_of,
        tm: Arc::new(store.clone()),
        clock: Arc::new(SystemClock),
        ids: Arc::new(UuidV7Generator),
        payments_topic: "payments".into(),
        provider: None,
    }
}

fn keys() -> Arc<ApiKeys> {
    Arc::new(ApiKeys::parse(&format!("merchant_a:{KEY_A},merchant_b:{KEY_B}")).expect("valid keys"))
}

async fn spawn_with(db: TestDb, conflict: StatusCode) -> anyhow::Result<Api> {
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), layer_config(conflict));
    let router = idem_http::router(api_state(&db.store), keys(), layer);
    let base = idem_tests::serve(router).await?;
    Ok(Api { db, base, http: reqwest::Client::new() })
}

async fn spawn() -> anyhow::Result<Api> {
    spawn_with(TestDb::new().await?, StatusCode::CONFLICT).await
}

struct Reply {
    status: u16,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    fn problem_type(&self) -> String {
        assert_eq!(self.header("content-type"), Some("application/problem+json"), "status {}", self.status);
        self.json()["type"].as_str().unwrap_or_default().to_owned()
    }
}

impl Api {
    async fn send(&self, req: reqwest::RequestBuilder) -> anyhow::Result<Reply> {
        let resp = req.send().await?;
        Ok(Reply {
            status: resp.status().as_u16(),
            headers: resp.headers().clone(),
            body: resp.bytes().await?.to_vec(),
        })
    }

    async fn post(&self, path: &str, api_key: &str, idem_key: Option<&str>, body: &str) -> anyhow::Result<Reply> {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(api_key)
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(k) = idem_key {
            req = req.header("idempotency-key", k);
        }
        self.send(req).await
    }

    async fn charge(&self, api_key: &str, idem_key: &str, body: &Value) -> anyhow::Result<Reply> {
        self.post("/payments", api_key, Some(idem_key), &body.to_string()).await
    }

    async fn get(&self, path: &str, api_key: &str) -> anyhow::Result<Reply> {
        self.send(self.http.get(format!("{}{path}", self.base)).bearer_auth(api_key)).await
    }
}

fn charge_body(external: &str, amount: &str) -> Value {
    json!({
        "order_id": Uuid::now_v7(),
        "customer_id": Uuid::now_v7(),
        "provider": "stripe",
        "external_payment_id": external,
        "amount": amount,
        "currency": "EUR",
    })
}

#[tokio::test]
async fn replay_is_byte_for_byte() -> anyhow::Result<()> {
    let api = spawn().await?;
    let body = charge_body("pi_replay", "12.34");
    let first = api.charge(KEY_A, "key-replay", &body).await?;
    assert_eq!(first.status, 201);
    assert_eq!(first.json()["amount"], "12.34");
    assert_eq!(first.json()["status"], "captured");
    assert!(first.header("idempotent-replayed").is_none());
    let second = api.charge(KEY_A, "key-replay", &body).await?;
    assert_eq!(second.status, 201);
    assert_eq!(second.body, first.body, "replayed body differs");
    assert_eq!(second.header("idempotent-replayed"), Some("true"));
    assert_eq!(second.header("location"), first.header("location"));
    assert_eq!(second.header("content-type"), Some("application/json"));
    assert_eq!(api.db.count("payment").await?, 1);
    assert_eq!(api.db.count("outbox_message").await?, 1);
    // the structured-field form names the same key
    let third = api.charge(KEY_A, "\"key-replay\"", &body).await?;
    assert_eq!((third.status, third.body.clone()), (201, first.body.clone()));
    Ok(())
}

#[tokio::test]
async fn changed_body_is_a_conflict_and_reformatted_json_is_not() -> anyhow::Result<()> {
    let api = spawn().await?;
    let body = charge_body("pi_conflict", "10.00");
    let first = api.charge(KEY_A, "key-c", &body).await?;
    assert_eq!(first.status, 201);

    let mut changed = body.clone();
    changed["amount"] = json!("10.01");
    let conflict = api.charge(KEY_A, "key-c", &changed).await?;
    assert_eq!(conflict.status, 409);
    assert_eq!(conflict.problem_type(), "urn:idem:problem:idempotency-key-reused");
    assert_eq!(conflict.header("cache-control"), Some("no-store"));

    // same JSON, other key order and whitespace
    let obj = body.as_object().expect("object");
    let mut fields: Vec<String> = obj.iter().map(|(k, v)| format!("\n  \"{k}\" :  {v}")).collect();
    fields.reverse();
    let reformatted = format!("{{{}\n}}", fields.join(" ,"));
    let replay = api.post("/payments", KEY_A, Some("key-c"), &reformatted).await?;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(api.db.count("payment").await?, 1);
    Ok(())
}

#[tokio::test]
async fn conflict_status_can_follow_the_ietf_draft() -> anyhow::Result<()> {
    let api = spawn_with(TestDb::new().await?, StatusCode::UNPROCESSABLE_ENTITY).await?;
    let body = charge_body("pi_422", "1.00");
    assert_eq!(api.charge(KEY_A, "k422", &body).await?.status, 201);
    let reuse = api.charge(KEY_A, "k422", &charge_body("pi_422_other", "1.00")).await?;
    assert_eq!(reuse.status, 422);
    assert_eq!(reuse.problem_type(), "urn:idem:problem:idempotency-key-reused");
    Ok(())
}

#[tokio::test]
async fn fifty_concurrent_identical_requests_create_one_payment() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    idem_tests::effects::log_payment_attempts(&db).await?;
    let api = Arc::new(spawn_with(db, StatusCode::CONFLICT).await?);
    let body = charge_body("pi_storm", "50.00");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let (api, body) = (api.clone(), body.clone());
        tasks.push(tokio::spawn(async move { api.charge(KEY_A, "storm-key", &body).await }));
    }
    let mut bodies = std::collections::BTreeSet::new();
    let (mut ok, mut in_flight) = (0, 0);
    for t in tasks {
        let r = t.await??;
        match r.status {
            201 => {
                ok += 1;
                bodies.insert(r.body.clone());
            }
            409 => {
                assert_eq!(r.problem_type(), "urn:idem:problem:request-in-flight");
                assert!(r.header("retry-after").is_some());
                in_flight += 1;
            }
            other => panic!("unexpected status {other}: {}", String::from_utf8_lossy(&r.body)),
        }
    }
    assert_eq!(ok + in_flight, 50);
    assert!(ok >= 1);
    assert_eq!(bodies.len(), 1, "every success is the same payment");
    assert_eq!(api.db.count("payment").await?, 1);
    // executions, not surviving rows: the unique provider id alone would also leave one payment
    assert_eq!(api.db.count("test_payment_attempt").await?, 1, "the charge was executed more than once");
    assert_eq!(api.db.count("idempotency_record").await?, 1);
    Ok(())
}

#[tokio::test]
async fn keys_are_scoped_by_merchant() -> anyhow::Result<()> {
    let api = spawn().await?;
    let a = api.charge(KEY_A, "shared-key", &charge_body("pi_iso_a", "5.00")).await?;
    assert_eq!(a.status, 201);
    let b = api.charge(KEY_B, "shared-key", &charge_body("pi_iso_b", "7.00")).await?;
    assert_eq!(b.status, 201, "merchant B executes its own request");
    assert!(b.header("idempotent-replayed").is_none());
    assert_ne!(a.json()["id"], b.json()["id"]);
    assert_eq!(b.json()["amount"], "7.00");
    // B sending A's exact request under A's key still never sees A's response
    let b2 = api.charge(KEY_B, "shared-key-2", &charge_body("pi_iso_a", "5.00")).await?;
    assert_eq!(b2.status, 409);
    assert_eq!(b2.problem_type(), "urn:idem:problem:payment-conflict");
    assert!(!String::from_utf8_lossy(&b2.body).contains(a.json()["id"].as_str().unwrap_or("-")));
    // and A's payment is invisible to B
    let path = format!("/payments/{}", a.json()["id"].as_str().unwrap_or_default());
    assert_eq!(api.get(&path, KEY_B).await?.status, 404);
    assert_eq!(api.get(&path, KEY_A).await?.status, 200);
    Ok(())
}

#[tokio::test]
async fn unique_provider_payment_across_keys() -> anyhow::Result<()> {
    let api = spawn().await?;
    let body = charge_body("pi_double", "20.00");
    let first = api.charge(KEY_A, "dp-1", &body).await?;
    assert_eq!(first.status, 201);
    let second = api.charge(KEY_A, "dp-2", &body).await?;
    assert_eq!(second.status, 200, "same payment under another key");
    assert_eq!(second.json()["id"], first.json()["id"]);
    let mut other = body.clone();
    other["amount"] = json!("21.00");
    let third = api.charge(KEY_A, "dp-3", &other).await?;
    assert_eq!(third.status, 409);
    assert_eq!(third.problem_type(), "urn:idem:problem:payment-conflict");
    assert_eq!(api.db.count("payment").await?, 1);
    // the 4xx answer is stored and replayed too
    let again = api.charge(KEY_A, "dp-3", &other).await?;
    assert_eq!((again.status, again.header("idempotent-replayed")), (409, Some("true")));
    Ok(())
}

#[tokio::test]
async fn refunds_and_reads() -> anyhow::Result<()> {
    let api = spawn().await?;
    let paid = api.charge(KEY_A, "rf-charge", &charge_body("pi_refund", "10.00")).await?;
    let id = paid.json()["id"].as_str().unwrap_or_default().to_owned();
    let path = format!("/payments/{id}/refund");
    let r1 = api.post(&path, KEY_A, Some("rf-1"), r#"{"amount":"4.00","reason":"damaged"}"#).await?;
    assert_eq!(r1.status, 201, "{}", String::from_utf8_lossy(&r1.body));
    assert_eq!(r1.json()["payment_status"], "partially_refunded");
    let replay = api.post(&path, KEY_A, Some("rf-1"), r#"{"amount":"4.00","reason":"damaged"}"#).await?;
    assert_eq!(replay.body, r1.body);
    // issue 24.8: a refund finer than the currency is refused without burning its key
    let finer = api.post(&path, KEY_A, Some("rf-finer"), r#"{"amount":"0.001"}"#).await?;
    assert_eq!(finer.problem_type(), "urn:idem:problem:amount-finer-than-currency");
    let corrected = api.post(&path, KEY_A, Some("rf-finer"), r#"{"amount":"0.01"}"#).await?;
    assert_eq!(corrected.status, 201, "the key was burnt: {}", String::from_utf8_lossy(&corrected.body));
    let too_much = api.post(&path, KEY_A, Some("rf-2"), r#"{"amount":"6.00"}"#).await?;
    assert_eq!(too_much.status, 409, "more than is left to refund conflicts with the payment's state");
    assert_eq!(too_much.problem_type(), "urn:idem:problem:refund-exceeds-captured");
    let rest = api.post(&path, KEY_A, Some("rf-3"), r#"{"amount":"5.99"}"#).await?;
    assert_eq!(rest.json()["payment_status"], "refunded");
    let unknown =
        api.post(&format!("/payments/{}/refund", Uuid::now_v7()), KEY_A, Some("rf-4"), r#"{"amount":"1"}"#).await?;
    assert_eq!(unknown.status, 404);
    let other_merchant = api.post(&path, KEY_B, Some("rf-5"), r#"{"amount":"1"}"#).await?;
    assert_eq!(other_merchant.status, 404);
    let got = api.get(&format!("/payments/{id}"), KEY_A).await?;
    assert_eq!((got.status, got.json()["refunded_amount"].clone()), (200, json!("10.00")));
    assert_eq!(api.db.count("refund").await?, 3);
    Ok(())
}

#[tokio::test]
async fn handler_failure_after_insert_stores_nothing_and_retry_succeeds() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let fail_once = Arc::new(AtomicBool::new(true));
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), layer_config(StatusCode::CONFLICT));
    let flag = fail_once.clone();
    let handler = move |mut tx: Tx| {
        let flag = flag.clone();
        async move {
            let money = Money {
                amount: Amount::parse("3.00").expect("valid"),
                currency: Currency::parse("EUR").expect("valid"),
            };
            let cmd =
                ChargeCommand::new("merchant_a", Uuid::from_u128(1), Uuid::from_u128(2), "stripe", "pi_fail", money)
                    .expect("valid");
            let (clock, ids) = (SystemClock, UuidV7Generator);
            let env = Env { clock: &clock as &dyn Clock, ids: &ids, payments_topic: "payments" };
            let out = charge_payment(idem_postgres::payments_of(tx.uow()).expect("postgres"), env, &cmd).await;
            assert!(out.is_ok(), "insert worked inside the transaction");
            if flag.swap(false, Ordering::SeqCst) {
                return (StatusCode::INTERNAL_SERVER_ERROR, "provider exploded").into_response();
            }
            (StatusCode::CREATED, "charged").into_response()
        }
    };
    let router = as_merchant_a(axum::Router::new().route("/charge", axum::routing::post(handler)).route_layer(layer));
    let base = idem_tests::serve(router).await?;
    let http = reqwest::Client::new();
    let send = || http.post(format!("{base}/charge")).header("idempotency-key", "fail-key").body("{}").send();
    let first = send().await?;
    assert_eq!(first.status().as_u16(), 500);
    assert_eq!(db.count("payment").await?, 0, "the payment was rolled back");
    assert_eq!(db.count("idempotency_record").await?, 0, "no record for a 5xx");
    assert_eq!(db.count("outbox_message").await?, 0);
    let retry = send().await?;
    assert_eq!(retry.status().as_u16(), 201);
    assert_eq!(retry.text().await?, "charged");
    assert_eq!(db.count("payment").await?, 1);
    assert_eq!(db.count("idempotency_record").await?, 1);
    let replay = send().await?;
    assert_eq!(replay.headers().get("idempotent-replayed").and_then(|v| v.to_str().ok()), Some("true"));
    assert_eq!(db.count("payment").await?, 1);
    Ok(())
}

#[tokio::test]
async fn unreachable_store_answers_503_and_executes_nothing() -> anyhow::Result<()> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy("postgres://postgres@127.0.0.1:1/none")?;
    let store = PgStore::from_pool(pool, 4);
    let tm: Arc<dyn TransactionManager> = Arc::new(store.clone());
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), layer_config(StatusCode::CONFLICT));
    let router = idem_http::router(api_state(&store), keys(), layer);
    let base = idem_tests::serve(router).await?;
    let resp = reqwest::Client::new()
        .post(format!("{base}/payments"))
        .bearer_auth(KEY_A)
        .header("idempotency-key", "down-1")
        .header("content-type", "application/json")
        .body(charge_body("pi_down", "1.00").to_string())
        .send()
        .await?;
    assert_eq!(resp.status().as_u16(), 503);
    assert!(resp.headers().get("retry-after").is_some());
    assert_eq!(resp.headers().get("cache-control").and_then(|v| v.to_str().ok()), Some("no-store"));
    assert_eq!(resp.headers().get("content-type").and_then(|v| v.to_str().ok()), Some("application/problem+json"));
    Ok(())
}

#[tokio::test]
async fn bad_input_gets_precise_problems_and_is_never_stored() -> anyhow::Result<()> {
    let api = spawn().await?;
    let good = charge_body("pi_bad", "1.00").to_string();
    let with = |field: &str, value: Value| {
        let mut b = charge_body("pi_bad", "1.00");
        b[field] = value;
        b.to_string()
    };
    let without = |field: &str| {
        let mut b = charge_body("pi_bad", "1.00");
        b.as_object_mut().map(|o| o.remove(field));
        b.to_string()
    };
    struct Case {
        name: &'static str,
        status: u16,
        problem: &'static str,
        field: Option<&'static str>,
    }
    let cases: Vec<(Case, Reply)> = vec![
        (
            Case { name: "missing key", status: 400, problem: "idempotency-key-missing", field: None },
            api.post("/payments", KEY_A, None, &good).await?,
        ),
        (
            Case { name: "key with space", status: 400, problem: "idempotency-key-invalid", field: None },
            api.post("/payments", KEY_A, Some("a b"), &good).await?,
        ),
        (
            Case { name: "key too long", status: 400, problem: "idempotency-key-invalid", field: None },
            api.post("/payments", KEY_A, Some(&"k".repeat(256)), &good).await?,
        ),
        (
            Case { name: "huge key", status: 400, problem: "idempotency-key-invalid", field: None },
            api.post("/payments", KEY_A, Some(&"k".repeat(8000)), &good).await?,
        ),
        (
            Case { name: "control character in key", status: 400, problem: "idempotency-key-invalid", field: None },
            api.post("/payments", KEY_A, Some("a\tb"), &good).await?,
        ),
        (
            Case { name: "non-ASCII key", status: 400, problem: "idempotency-key-invalid", field: None },
            api.send(
                api.http
                    .post(format!("{}/payments", api.base))
                    .bearer_auth(KEY_A)
                    .header("content-type", "application/json")
                    .header("idempotency-key", reqwest::header::HeaderValue::from_bytes(b"cl\xc3\xa9")?)
                    .body(good.clone()),
            )
            .await?,
        ),
        (
            Case { name: "another merchant's key is not a key", status: 401, problem: "unauthorized", field: None },
            api.post("/payments", "merchant_a:key_a_0123456789", Some("x0"), &good).await?,
        ),
        (
            Case { name: "array body", status: 400, problem: "malformed-json", field: None },
            api.post("/payments", KEY_A, Some("x15"), "[1,2,3]").await?,
        ),
        (
            Case { name: "unknown field", status: 422, problem: "invalid-field", field: Some("ammount") },
            api.post("/payments", KEY_A, Some("x16"), &with("ammount", json!("1.00"))).await?,
        ),
        (
            Case { name: "script in currency", status: 422, problem: "invalid-field", field: Some("currency") },
            api.post("/payments", KEY_A, Some("x17"), &with("currency", json!("<script>"))).await?,
        ),
        (
            Case { name: "no auth", status: 401, problem: "unauthorized", field: None },
            api.send(
                api.http.post(format!("{}/payments", api.base)).header("idempotency-key", "x1").body(good.clone()),
            )
            .await?,
        ),
        (
            Case { name: "wrong api key", status: 401, problem: "unauthorized", field: None },
            api.post("/payments", "not_a_key_123", Some("x2"), &good).await?,
        ),
        (
            Case { name: "oversize", status: 413, problem: "payload-too-large", field: None },
            api.post("/payments", KEY_A, Some("x3"), &format!("{{\"pad\":\"{}\"}}", "x".repeat(70 * 1024))).await?,
        ),
        (
            Case { name: "wrong content type", status: 415, problem: "unsupported-media-type", field: None },
            api.send(
                api.http
                    .post(format!("{}/payments", api.base))
                    .bearer_auth(KEY_A)
                    .header("idempotency-key", "x4")
                    .header("content-type", "text/plain")
                    .body(good.clone()),
            )
            .await?,
        ),
        (
            Case { name: "malformed json", status: 400, problem: "malformed-json", field: None },
            api.post("/payments", KEY_A, Some("x5"), "{\"order_id\":").await?,
        ),
        (
            Case { name: "invalid utf-8", status: 400, problem: "malformed-json", field: None },
            api.send(
                api.http
                    .post(format!("{}/payments", api.base))
                    .bearer_auth(KEY_A)
                    .header("idempotency-key", "x6")
                    .header("content-type", "application/json")
                    .body(vec![b'{', b'"', 0xff, 0xfe, b'"', b'}']),
            )
            .await?,
        ),
        (
            Case { name: "missing amount", status: 422, problem: "invalid-field", field: Some("amount") },
            api.post("/payments", KEY_A, Some("x7"), &without("amount")).await?,
        ),
        (
            Case { name: "negative amount", status: 422, problem: "invalid-field", field: Some("amount") },
            api.post("/payments", KEY_A, Some("x8"), &with("amount", json!("-1.00"))).await?,
        ),
        (
            Case { name: "zero amount", status: 422, problem: "invalid-field", field: Some("amount") },
            api.post("/payments", KEY_A, Some("x9"), &with("amount", json!("0"))).await?,
        ),
        (
            Case { name: "over-precise amount", status: 422, problem: "invalid-field", field: Some("amount") },
            api.post("/payments", KEY_A, Some("x10"), &with("amount", json!("1.00001"))).await?,
        ),
        (
            Case { name: "numeric amount", status: 422, problem: "invalid-field", field: Some("amount") },
            api.post("/payments", KEY_A, Some("x11"), &with("amount", json!(1.5))).await?,
        ),
        (
            Case { name: "unknown currency", status: 422, problem: "invalid-field", field: Some("currency") },
            api.post("/payments", KEY_A, Some("x12"), &with("currency", json!("ABC"))).await?,
        ),
        (
            Case { name: "bad uuid", status: 422, problem: "invalid-field", field: Some("order_id") },
            api.post("/payments", KEY_A, Some("x13"), &with("order_id", json!("1; DROP TABLE payment"))).await?,
        ),
        (
            Case { name: "injection-shaped provider", status: 422, problem: "invalid-field", field: Some("provider") },
            api.post("/payments", KEY_A, Some("x14"), &with("provider", json!("x' OR '1'='1"))).await?,
        ),
        (
            Case { name: "unknown route", status: 404, problem: "not-found", field: None },
            api.get("/nowhere", KEY_A).await?,
        ),
    ];
    for (case, reply) in &cases {
        assert_eq!(reply.status, case.status, "{}: {}", case.name, String::from_utf8_lossy(&reply.body));
        assert_eq!(reply.problem_type(), format!("urn:idem:problem:{}", case.problem), "{}", case.name);
        if let Some(field) = case.field {
            assert_eq!(reply.json()["field"], field, "{}", case.name);
        }
        assert!(!String::from_utf8_lossy(&reply.body).contains(KEY_A), "{} leaks the API key", case.name);
    }
    // two Idempotency-Key header lines
    let dup = api
        .send(
            api.http
                .post(format!("{}/payments", api.base))
                .bearer_auth(KEY_A)
                .header("content-type", "application/json")
                .header("idempotency-key", "one")
                .header("idempotency-key", "two")
                .body(good.clone()),
        )
        .await?;
    assert_eq!(dup.status, 400);
    assert_eq!(dup.problem_type(), "urn:idem:problem:idempotency-key-invalid");
    assert_eq!(api.db.count("payment").await?, 0, "no bad request created a payment");
    // input rejected before execution is never stored: the client may fix it and reuse the key
    assert_eq!(api.db.count("idempotency_record").await?, 0);
    let fixed = api.post("/payments", KEY_A, Some("x8"), &good).await?;
    assert_eq!(fixed.status, 201, "a corrected request may reuse the key of a rejected one");
    Ok(())
}

#[tokio::test]
async fn idempotency_metrics_move_when_things_happen() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let metrics = idem_http::HttpMetrics::default();
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), layer_config(StatusCode::CONFLICT));
    let router = idem_http::router_with_metrics(api_state(&db.store), keys(), layer, metrics.clone());
    let api = Api { db, base: idem_tests::serve(router).await?, http: reqwest::Client::new() };
    let outcome = |o: &'static str| {
        metrics.idempotency.get(&idem_http::metrics::OutcomeLabels { outcome: o }).map(|c| c.get()).unwrap_or(0)
    };
    let body = charge_body("pi_metrics", "3.00");
    api.charge(KEY_A, "m-1", &body).await?;
    assert_eq!(outcome("executed"), 1);
    api.charge(KEY_A, "m-1", &body).await?;
    assert_eq!(outcome("replayed"), 1);
    api.charge(KEY_A, "m-1", &charge_body("pi_metrics_2", "3.00")).await?;
    assert_eq!(outcome("conflict"), 1);
    api.post("/payments", KEY_A, None, "{}").await?;
    assert_eq!(outcome("rejected_input"), 1);
    let created = metrics
        .requests
        .get(&idem_http::metrics::RequestLabels { method: "POST".into(), route: "/payments".into(), status: 201 })
        .map(|c| c.get());
    assert_eq!(created, Some(2), "the first execution and its replay");
    Ok(())
}

#[tokio::test]
async fn every_documented_api_operation_is_routed() -> anyhow::Result<()> {
    let api = spawn().await?;
    let doc: Value = idem_http::openapi::document();
    let paths = doc["paths"].as_object().expect("paths");
    let mut checked = 0;
    for (path, ops) in paths {
        if matches!(path.as_str(), "/healthz" | "/readyz" | "/metrics") {
            continue; // served by the binary's operational router, checked by the fault suite
        }
        for method in ops.as_object().expect("operations").keys() {
            let url = format!("{}{}", api.base, path.replace("{id}", &Uuid::now_v7().to_string()));
            let req = match method.as_str() {
                "get" => api.http.get(url),
                "post" => api.http.post(url).header("content-type", "application/json").body("{}"),
                other => panic!("undocumented method kind {other}"),
            };
            let reply = api.send(req.bearer_auth(KEY_A)).await?;
            let is_fallback = reply.status == 405 || (reply.status == 404 && reply.json().get("detail").is_none());
            assert!(!is_fallback, "{method} {path} is documented but not routed ({})", reply.status);
            checked += 1;
        }
    }
    assert_eq!(checked, 4, "POST /payments, GET /payments/{{id}}, POST /payments/{{id}}/refund, GET /openapi.json");
    // and an undocumented route is the fallback
    let reply = api.get("/payments", KEY_A).await?;
    assert_eq!(reply.status, 405);
    Ok(())
}

/// A transaction manager whose commits take `delay` more (a slow disk: the connection is held that long)
/// and, with `lose_outcome`, commit for real and then report a lost connection: what a client sees when the
/// connection drops during COMMIT after the server applied it.
/// Units of work whose commit takes `delay` more and, with `lose_outcome`, reports a lost connection
/// after the commit succeeded.
fn faulty_commit(store: &PgStore, delay: Duration, lose_outcome: bool) -> Arc<dyn TransactionManager> {
    Arc::new(idem_tests::faulty::FaultyCommits::new(Arc::new(store.clone()), move || {
        Box::new(move |uow| {
            Box::pin(async move {
                tokio::time::sleep(delay).await;
                uow.commit().await?;
                if lose_outcome {
                    return Err(idem_ports::StoreError::Unavailable("connection reset during COMMIT".into()));
                }
                Ok(())
            })
        })
    }))
}

/// Issue 11.5: a commit whose outcome is unknown must not be reported as "not executed": 503 saying the
/// outcome is unknown; the retry with the same key then replays what was committed.
#[tokio::test]
async fn a_commit_with_an_unknown_outcome_says_so_and_the_retry_replays() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let tm: Arc<dyn TransactionManager> = faulty_commit(&db.store, Duration::ZERO, true);
    let layer = IdempotencyLayer::new(tm.clone(), Arc::new(SystemClock), layer_config(StatusCode::CONFLICT));
    let state = ApiState { tm, ..api_state(&db.store) };
    let lossy = idem_tests::serve(idem_http::router(state, keys(), layer)).await?;
    let api = spawn_with(db, StatusCode::CONFLICT).await?;
    let body = charge_body("pi_unknown", "10.00").to_string();
    let first = api
        .send(
            api.http
                .post(format!("{lossy}/payments"))
                .bearer_auth(KEY_A)
                .header("idempotency-key", "unknown-1")
                .header("content-type", "application/json")
                .body(body.clone()),
        )
        .await?;
    assert_eq!(first.status, 503);
    assert_eq!(first.problem_type(), "urn:idem:problem:outcome-unknown");
    let detail = first.json()["detail"].as_str().unwrap_or_default().to_owned();
    assert!(!detail.contains("not executed"), "{detail}");
    assert!(detail.contains("same Idempotency-Key"), "{detail}");
    assert!(first.header("retry-after").is_some());
    // The commit did happen: the retry replays it, and there is one payment.
    let retry = api.post("/payments", KEY_A, Some("unknown-1"), &body).await?;
    assert_eq!(retry.status, 201, "{}", String::from_utf8_lossy(&retry.body));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(api.db.count("payment").await?, 1);
    Ok(())
}

/// Issue 11.4: a request refused before the handler changed anything (here a path parameter that is not a
/// payment id) never burns its key: the corrected request with the same key executes.
#[tokio::test]
async fn a_refusal_before_execution_leaves_the_key_free() -> anyhow::Result<()> {
    let api = spawn().await?;
    let paid = api.charge(KEY_A, "burn-charge", &charge_body("pi_burn", "10.00")).await?;
    let id = paid.json()["id"].as_str().unwrap_or_default().to_owned();
    let bad = api.post("/payments/not-a-uuid/refund", KEY_A, Some("burn-1"), r#"{"amount":"1.00"}"#).await?;
    assert!(matches!(bad.status, 400 | 404 | 422), "{}", bad.status);
    let good = api.post(&format!("/payments/{id}/refund"), KEY_A, Some("burn-1"), r#"{"amount":"1.00"}"#).await?;
    assert_eq!(good.status, 201, "the key was burnt: {}", String::from_utf8_lossy(&good.body));
    let missing = api
        .post(&format!("/payments/{}/refund", Uuid::now_v7()), KEY_A, Some("burn-2"), r#"{"amount":"1.00"}"#)
        .await?;
    assert_eq!(missing.status, 404);
    let corrected = api.post(&format!("/payments/{id}/refund"), KEY_A, Some("burn-2"), r#"{"amount":"2.00"}"#).await?;
    assert_eq!(corrected.status, 201, "a 404 for an unknown payment burnt the key");
    Ok(())
}

/// Issue 11.3: an amount finer than its currency's minor unit is refused (422 naming the field), for
/// charges and refunds; amounts are answered at the currency's scale.
#[tokio::test]
async fn amounts_respect_their_currency_minor_units() -> anyhow::Result<()> {
    let api = spawn().await?;
    let with = |currency: &str, amount: &str, ext: &str| {
        let mut b = charge_body(ext, amount);
        b["currency"] = json!(currency);
        b
    };
    for (i, (currency, amount)) in
        [("JPY", "10.5"), ("EUR", "12.345"), ("BHD", "1.2345"), ("USD", "0.001")].into_iter().enumerate()
    {
        let r = api.charge(KEY_A, &format!("minor-{i}"), &with(currency, amount, &format!("pi_minor_{i}"))).await?;
        assert_eq!(r.status, 422, "{amount} {currency}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.problem_type(), "urn:idem:problem:invalid-field");
        assert_eq!(r.json()["field"], "amount", "{amount} {currency}");
    }
    let jpy = api.charge(KEY_A, "minor-ok-jpy", &with("JPY", "1000", "pi_jpy")).await?;
    assert_eq!(jpy.status, 201, "{}", String::from_utf8_lossy(&jpy.body));
    assert_eq!(jpy.json()["amount"], "1000");
    let bhd = api.charge(KEY_A, "minor-ok-bhd", &with("BHD", "1.234", "pi_bhd")).await?;
    assert_eq!(bhd.status, 201);
    assert_eq!(bhd.json()["amount"], "1.234");
    let eur = api.charge(KEY_A, "minor-ok-eur", &with("EUR", "12.3", "pi_eur")).await?;
    assert_eq!(eur.json()["amount"], "12.30");
    let id = eur.json()["id"].as_str().unwrap_or_default().to_owned();
    let refund = api.post(&format!("/payments/{id}/refund"), KEY_A, Some("minor-r"), r#"{"amount":"0.001"}"#).await?;
    // finer than this payment's currency: the refund conflicts with the payment, the request is well-formed
    assert_eq!(refund.status, 409);
    assert_eq!(refund.problem_type(), "urn:idem:problem:amount-finer-than-currency");
    assert_eq!(refund.json()["field"], "amount");
    Ok(())
}

/// Issue 11.2: (provider, external_payment_id) stays unique across merchants, but merchant B learns nothing
/// about merchant A's payment: the same generic conflict whether B's details match A's or not, nothing that
/// says a payment exists, no id, no amount; A's payment is untouched.
#[tokio::test]
async fn another_merchants_provider_payment_id_gets_a_generic_conflict() -> anyhow::Result<()> {
    let api = spawn().await?;
    let body = charge_body("pi_secret", "20.00");
    let a = api.charge(KEY_A, "x-a", &body).await?;
    assert_eq!(a.status, 201);
    let same = api.charge(KEY_B, "x-b1", &body).await?;
    let mut other = body.clone();
    other["amount"] = json!("99.00");
    let differ = api.charge(KEY_B, "x-b2", &other).await?;
    for r in [&same, &differ] {
        assert_eq!(r.status, 409);
        assert_eq!(r.problem_type(), "urn:idem:problem:payment-conflict");
        let text = String::from_utf8_lossy(&r.body).to_lowercase();
        let id = a.json()["id"].as_str().unwrap_or_default().to_owned();
        for leak in ["exist", "details", "20.00", id.as_str()] {
            assert!(!text.contains(leak), "the answer to merchant B reveals {leak:?}: {text}");
        }
    }
    assert_eq!(same.json()["detail"], differ.json()["detail"], "B can tell whether its details match A's");
    assert_eq!(api.db.count("payment").await?, 1);
    Ok(())
}

/// Issue 11.7: a UUID v7 key tells when it was created; one older than IDEMPOTENCY_TTL is refused (its
/// record may be gone, so executing could charge twice) and nothing runs. Younger v7 keys and keys without
/// a time behave as always.
#[tokio::test]
async fn a_v7_key_older_than_the_retention_is_refused() -> anyhow::Result<()> {
    let api = spawn().await?;
    let v7_ago = |hours: i64| idem_tests::v7_at(chrono::Utc::now() - chrono::Duration::hours(hours)).to_string();
    let old = api.charge(KEY_A, &v7_ago(49), &charge_body("pi_old_key", "5.00")).await?;
    assert_eq!(old.status, 422, "{}", String::from_utf8_lossy(&old.body));
    assert_eq!(old.problem_type(), "urn:idem:problem:idempotency-key-expired");
    assert_eq!(api.db.count("payment").await?, 0);
    let young = api.charge(KEY_A, &v7_ago(46), &charge_body("pi_young_key", "5.00")).await?;
    assert_eq!(young.status, 201);
    let plain = api.charge(KEY_A, "order-1234-attempt", &charge_body("pi_plain_key", "5.00")).await?;
    assert_eq!(plain.status, 201);
    Ok(())
}

/// Issue 11.6: one merchant's storm cannot starve another. Merchant A sends 200 concurrent duplicates of
/// one charge and 50 concurrent refunds of one payment while commits are slow (100 ms, a commit-bound
/// disk) and the pool is small; merchant B charges steadily meanwhile. B sees no 503 and its p99 stays
/// under a second; everything A sent has at most one effect per key.
#[tokio::test]
async fn one_merchant_cannot_starve_another() -> anyhow::Result<()> {
    let settings = idem_postgres::PoolSettings {
        max_connections: 10,
        acquire_timeout: Duration::from_secs(3),
        ..idem_postgres::PoolSettings::default()
    };
    let db = TestDb::with_pool(settings).await?;
    let tm: Arc<dyn TransactionManager> = faulty_commit(&db.store, Duration::from_millis(100), false);
    let layer = IdempotencyLayer::new(tm.clone(), Arc::new(SystemClock), layer_config(StatusCode::CONFLICT));
    let limited = Arc::new(
        ApiKeys::parse(&format!("merchant_a:{KEY_A},merchant_b:{KEY_B}"))
            .expect("valid keys")
            .with_concurrency_limit(4),
    );
    let state = ApiState { tm, ..api_state(&db.store) };
    let base = idem_tests::serve(idem_http::router(state, limited, layer)).await?;
    let api = Api { db, base, http: reqwest::Client::new() };
    let target = api.charge(KEY_A, "storm-target", &charge_body("pi_storm_target", "100.00")).await?;
    let target = target.json()["id"].as_str().unwrap_or_default().to_owned();
    let api = Arc::new(api);

    // B: four workers charging one after the other for the whole storm.
    let stop = Arc::new(AtomicBool::new(false));
    let mut b_workers = Vec::new();
    for w in 0..4 {
        let (api, stop) = (api.clone(), stop.clone());
        b_workers.push(tokio::spawn(async move {
            let (mut latencies, mut statuses) = (Vec::new(), Vec::new());
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let started = std::time::Instant::now();
                let r =
                    api.charge(KEY_B, &format!("b-{w}-{i}"), &charge_body(&format!("pi_b_{w}_{i}"), "1.00")).await?;
                latencies.push(started.elapsed());
                statuses.push(r.status);
                i += 1;
            }
            anyhow::Ok((latencies, statuses))
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A's storm, all at once.
    let storm_body = charge_body("pi_storm", "5.00");
    let mut storm = Vec::new();
    for _ in 0..200 {
        let (api, body) = (api.clone(), storm_body.clone());
        storm.push(tokio::spawn(async move { api.charge(KEY_A, "storm-key", &body).await }));
    }
    for i in 0..50 {
        let (api, path) = (api.clone(), format!("/payments/{target}/refund"));
        storm.push(tokio::spawn(async move {
            api.post(&path, KEY_A, Some(&format!("storm-refund-{i}")), r#"{"amount":"1.00"}"#).await
        }));
    }
    let mut a_replies = Vec::new();
    for t in storm {
        a_replies.push(t.await??);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let (mut latencies, mut statuses) = (Vec::new(), Vec::new());
    for w in b_workers {
        let (l, s) = w.await??;
        latencies.extend(l);
        statuses.extend(s);
    }
    latencies.sort();
    let p99 = latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)];
    assert!(latencies.len() >= 10, "B completed only {} charges", latencies.len());
    assert!(
        statuses.iter().all(|s| *s == 201),
        "B got {:?}",
        statuses.iter().filter(|s| **s != 201).collect::<Vec<_>>()
    );
    assert!(p99 < Duration::from_secs(1), "B's p99 was {p99:?}");

    // A: one payment for the storm key, every success the same payment; refunds equal their 201s.
    let storm_ids: std::collections::BTreeSet<String> = a_replies[..200]
        .iter()
        .filter(|r| matches!(r.status, 200 | 201))
        .map(|r| r.json()["id"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert!(storm_ids.len() <= 1, "the storm key answered with {} payments", storm_ids.len());
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM payment WHERE external_payment_id = 'pi_storm'")
        .fetch_one(api.db.pool())
        .await?;
    assert!(stored <= 1);
    for r in &a_replies {
        assert!(matches!(r.status, 200 | 201 | 409 | 429), "A got {}", r.status);
        if r.status == 429 {
            assert!(r.header("retry-after").is_some());
            assert_eq!(r.problem_type(), "urn:idem:problem:too-many-requests");
        }
    }
    let refunded = a_replies[200..].iter().filter(|r| r.status == 201).count() as i64;
    assert_eq!(api.db.count("refund").await?, refunded, "a refund key had more or fewer effects than answers");
    Ok(())
}

/// Issue 11.6: a duplicate waiting for an in-flight key of this process holds no database connection:
/// 100 duplicates wait on one request slower than the pool's acquire timeout, with a pool of 4, and all end
/// with the same payment (before, 96 of them waited for a connection and got 503).
#[tokio::test]
async fn waiting_duplicates_hold_no_connection() -> anyhow::Result<()> {
    let settings = idem_postgres::PoolSettings {
        max_connections: 4,
        acquire_timeout: Duration::from_secs(2),
        ..idem_postgres::PoolSettings::default()
    };
    let db = TestDb::with_pool(settings).await?;
    let tm: Arc<dyn TransactionManager> = faulty_commit(&db.store, Duration::from_millis(2500), false);
    let layer = IdempotencyLayer::new(tm.clone(), Arc::new(SystemClock), layer_config(StatusCode::CONFLICT));
    let state = ApiState { tm, ..api_state(&db.store) };
    let base = idem_tests::serve(idem_http::router(state, keys(), layer)).await?;
    let api = Arc::new(Api { db, base, http: reqwest::Client::new() });
    let body = charge_body("pi_single_flight", "3.00");
    let mut tasks = Vec::new();
    for _ in 0..100 {
        let (api, body) = (api.clone(), body.clone());
        tasks.push(tokio::spawn(async move { api.charge(KEY_A, "single-flight", &body).await }));
    }
    let mut ids = std::collections::BTreeSet::new();
    for t in tasks {
        let r = t.await??;
        assert!(matches!(r.status, 200 | 201), "{} {}", r.status, String::from_utf8_lossy(&r.body));
        ids.insert(r.json()["id"].as_str().unwrap_or_default().to_owned());
    }
    assert_eq!(ids.len(), 1);
    assert_eq!(api.db.count("payment").await?, 1);
    Ok(())
}

/// Issue 24.6: the v7 key-age rule. A key minted hours ahead is refused (it would stay acceptable after its
/// record expired); one a little ahead keeps its record until its own time + TTL; and an old key whose
/// record is still alive (its first send came late) replays instead of being refused.
#[tokio::test]
async fn the_key_age_rule_looks_the_record_up_and_refuses_keys_from_the_future() -> anyhow::Result<()> {
    use idem_tests::effects::ShiftedClock;
    let db = TestDb::new().await?;
    let clock = Arc::new(ShiftedClock::new());
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let layer = IdempotencyLayer::new(tm, clock.clone(), layer_config(StatusCode::CONFLICT));
    let router = idem_http::router(api_state(&db.store), keys(), layer);
    let api = Api { db: db.clone(), base: idem_tests::serve(router).await?, http: reqwest::Client::new() };
    let now = chrono::Utc::now();

    let ahead = idem_tests::v7_at(now + chrono::Duration::hours(2)).to_string();
    let refused = api.charge(KEY_A, &ahead, &charge_body("pi_ahead", "1.00")).await?;
    assert_eq!(refused.status, 422);
    assert_eq!(refused.problem_type(), "urn:idem:problem:idempotency-key-future-dated");
    assert_eq!(db.count("idempotency_record").await?, 0, "a refused key stored a record");

    let near = idem_tests::v7_at(now + chrono::Duration::minutes(30));
    let ok = api.charge(KEY_A, &near.to_string(), &charge_body("pi_near", "1.00")).await?;
    assert_eq!(ok.status, 201);
    let expires: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT expires_at FROM idempotency_record WHERE key = $1")
            .bind(near.to_string())
            .fetch_one(db.pool())
            .await?;
    let key_time = idem_domain::uuid_v7_time(near).expect("v7");
    assert!(
        expires >= key_time + chrono::Duration::hours(48),
        "the record expires before the key stops being accepted"
    );

    // first sent 46 h after it was minted (inside the hour's margin for clocks), retried 2 h later: the
    // record is alive, so the retry replays
    let late = idem_tests::v7_at(now - chrono::Duration::hours(46)).to_string();
    let body = charge_body("pi_late", "1.00");
    let first = api.charge(KEY_A, &late, &body).await?;
    assert_eq!(first.status, 201);
    clock.advance(chrono::Duration::hours(2));
    let retry = api.charge(KEY_A, &late, &body).await?;
    assert_eq!(retry.status, 201, "a live record was refused as expired: {}", String::from_utf8_lossy(&retry.body));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    // an old key without a record is still refused
    let gone = idem_tests::v7_at(now - chrono::Duration::hours(60)).to_string();
    let refused = api.charge(KEY_A, &gone, &charge_body("pi_gone", "1.00")).await?;
    assert_eq!(refused.problem_type(), "urn:idem:problem:idempotency-key-expired");
    Ok(())
}

/// Issue 26.1: an application's handler writes, then refuses with a plain 409 ("insufficient stock"). The
/// refusal rolls back its write and stores nothing, so the retry after a restock executes (before: the 409
/// committed the write and was replayed for ever). A refusal the handler commits on purpose
/// (`CommitRefusal`) is stored and replayed; a second `Tx` in one handler is a clear 500, not a hang; JSON
/// rejections are problem+json with their own statuses and burn no key.
#[tokio::test]
async fn refusals_roll_back_unless_committed_on_purpose() -> anyhow::Result<()> {
    use axum::response::IntoResponse;
    use idem_http::{CommitRefusal, Problem, ProblemJson};
    let db = TestDb::new().await?;
    sqlx::raw_sql(
        "CREATE TABLE stock (item text PRIMARY KEY, left_ int NOT NULL); INSERT INTO stock VALUES ('a', 0);
                   CREATE TABLE attempt (n serial PRIMARY KEY, item text)",
    )
    .execute(db.pool())
    .await?;
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), layer_config(StatusCode::CONFLICT));
    #[derive(serde::Deserialize)]
    struct Reserve {
        item: String,
        commit_refusal: bool,
    }
    let reserve = |mut tx: idem::PgTx, ProblemJson(body): ProblemJson<Reserve>| async move {
        let conn = tx.connection();
        // a write before the refusal: it must not survive a rolled-back refusal
        sqlx::query("INSERT INTO attempt (item) VALUES ($1)")
            .bind(&body.item)
            .execute(&mut *conn)
            .await
            .expect("insert");
        let left: i32 = sqlx::query_scalar("SELECT left_ FROM stock WHERE item = $1")
            .bind(&body.item)
            .fetch_one(&mut *conn)
            .await
            .expect("stock");
        if left == 0 {
            let problem =
                Problem::custom("https://example.com/problems/out-of-stock", "Out of stock", StatusCode::CONFLICT)
                    .detail(format!("{} left", left));
            return if body.commit_refusal {
                (CommitRefusal, problem).into_response()
            } else {
                problem.into_response()
            };
        }
        sqlx::query("UPDATE stock SET left_ = left_ - 1 WHERE item = $1")
            .bind(&body.item)
            .execute(&mut *conn)
            .await
            .expect("update");
        (StatusCode::CREATED, "reserved").into_response()
    };
    let twice = |_first: Tx, _second: Tx| async move { StatusCode::OK };
    let router = as_merchant_a(
        axum::Router::new()
            .route("/reserve", axum::routing::post(reserve))
            .route("/twice", axum::routing::post(twice))
            .route_layer(layer),
    );
    let base = idem_tests::serve(router).await?;
    let http = reqwest::Client::new();
    let send = |key: &'static str, body: &'static str| {
        http.post(format!("{base}/reserve"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let plain = r#"{"item":"a","commit_refusal":false}"#;
    let refused = send("k-plain", plain).await?;
    assert_eq!(refused.status().as_u16(), 409);
    assert_eq!(refused.headers().get("content-type").and_then(|v| v.to_str().ok()), Some("application/problem+json"));
    assert_eq!(refused.json::<serde_json::Value>().await?["type"], "https://example.com/problems/out-of-stock");
    assert_eq!(db.count("attempt").await?, 0, "the refusal committed the write made before it");
    assert_eq!(db.count("idempotency_record").await?, 0, "the refusal burnt the key");
    sqlx::query("UPDATE stock SET left_ = 1").execute(db.pool()).await?;
    let after_restock = send("k-plain", plain).await?;
    assert_eq!(after_restock.status().as_u16(), 201, "the retry after the restock did not execute");

    // committed on purpose: stored and replayed, its write kept
    sqlx::query("UPDATE stock SET left_ = 0").execute(db.pool()).await?;
    let committed = r#"{"item":"a","commit_refusal":true}"#;
    assert_eq!(send("k-commit", committed).await?.status().as_u16(), 409);
    assert_eq!(db.count("attempt").await?, 2);
    sqlx::query("UPDATE stock SET left_ = 5").execute(db.pool()).await?;
    let replayed = send("k-commit", committed).await?;
    assert_eq!(replayed.status().as_u16(), 409);
    assert_eq!(replayed.headers().get("idempotent-replayed").and_then(|v| v.to_str().ok()), Some("true"));

    // JSON rejections: problem+json, their statuses, no key burnt
    let wrong_shape = send("k-json", r#"{"item":"a"}"#).await?;
    assert_eq!(wrong_shape.status().as_u16(), 422);
    assert_eq!(wrong_shape.json::<serde_json::Value>().await?["type"], "urn:idem:problem:invalid-field");
    let not_json = send("k-json", "{").await?;
    assert_eq!(not_json.status().as_u16(), 400);
    let media = http.post(format!("{base}/reserve")).header("idempotency-key", "k-json").body(plain).send().await?;
    assert_eq!(media.status().as_u16(), 415);
    assert_eq!(send("k-json", plain).await?.status().as_u16(), 201, "a JSON rejection burnt the key");

    // Tx twice: answered, not hung
    let twice = tokio::time::timeout(
        Duration::from_secs(5),
        http.post(format!("{base}/twice")).header("idempotency-key", "k-twice").body("{}").send(),
    )
    .await
    .map_err(|_| anyhow::anyhow!("extracting Tx twice hung the request"))??;
    assert_eq!(twice.status().as_u16(), 500);
    Ok(())
}

/// Issue 27.2: a retry whose record is completed and matches is answered from one read — one round trip to
/// PostgreSQL, no claim transaction (before: BEGIN, the claim, the read and ROLLBACK) — while a different
/// request with the key still goes the full way and conflicts.
#[tokio::test]
async fn a_replay_of_a_completed_key_costs_one_round_trip() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (proxy, proxied) = db.proxied().await?;
    let settings = idem_postgres::PoolSettings { max_connections: 1, ..Default::default() };
    let store = PgStore::connect(&proxied, &settings).await?;
    let tm: Arc<dyn TransactionManager> = Arc::new(store);
    let mut config = layer_config(StatusCode::CONFLICT);
    config.replay_fast_path = idem_http::FastPath::Always;
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), config);
    let router = as_merchant_a(
        axum::Router::new()
            .route("/op", axum::routing::post(|_tx: Tx| async { (StatusCode::CREATED, "done") }))
            .route_layer(layer),
    );
    let base = idem_tests::serve(router).await?;
    let http = reqwest::Client::new();
    let send =
        |body: &'static str| http.post(format!("{base}/op")).header("idempotency-key", "fast-1").body(body).send();
    assert_eq!(send("{}").await?.status().as_u16(), 201);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = proxy.flights();
    let replayed = send("{}").await?;
    assert_eq!(replayed.headers().get("idempotent-replayed").and_then(|v| v.to_str().ok()), Some("true"));
    assert_eq!(replayed.text().await?, "done");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(proxy.flights() - before, 1, "a replay of a completed key took more than one round trip");
    let other = send(r#"{"other":1}"#).await?;
    assert_eq!(other.status().as_u16(), 409, "a different request with the key must still conflict");
    Ok(())
}

/// Issue 38.3: one merchant resending under new keys stored every answer for the retention (4,838 records
/// in 5 s in the review, no payment). With a bound on new keys per scope, the keys beyond the burst are
/// refused `429` with `Retry-After` before anything runs or is stored, while retries of a known key are
/// still answered from its record, and another scope is not affected.
#[tokio::test]
async fn new_keys_beyond_the_merchants_quota_are_refused_and_store_nothing() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let mut config = layer_config(StatusCode::CONFLICT);
    let one = std::num::NonZeroU32::MIN;
    config.new_keys = Some(Arc::new(idem_http::quota::NewKeyQuota::new(one, one.saturating_add(2))));
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), config);
    let router = axum::Router::new()
        .route("/op", axum::routing::post(|_tx: Tx| async { (StatusCode::CREATED, "done") }))
        .route_layer(layer);
    let scoped = axum::Router::new().merge(router).layer(axum::middleware::from_fn(
        |mut req: axum::extract::Request, next: axum::middleware::Next| async move {
            let merchant = req.headers().get("x-merchant").and_then(|v| v.to_str().ok()).unwrap_or("a").to_owned();
            req.extensions_mut().insert(idem_http::Merchant(merchant.into()));
            next.run(req).await
        },
    ));
    let base = idem_tests::serve(scoped).await?;
    let http = reqwest::Client::new();
    let send = |key: String, merchant: &'static str| {
        http.post(format!("{base}/op")).header("idempotency-key", key).header("x-merchant", merchant).body("{}").send()
    };
    let mut statuses = Vec::new();
    for i in 0..5 {
        let reply = send(format!("flood-{i}"), "a").await?;
        let status = reply.status().as_u16();
        if status == 429 {
            assert!(reply.headers().contains_key("retry-after"), "429 without Retry-After");
            let body: serde_json::Value = reply.json().await?;
            assert_eq!(body["type"], "urn:idem:problem:too-many-requests", "{body}");
        }
        statuses.push(status);
    }
    assert_eq!(statuses, [201, 201, 201, 429, 429]);
    let records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_record WHERE scope = 'a'").fetch_one(db.pool()).await?;
    assert_eq!(records, 3, "only the burst's keys are stored");
    let replay = send("flood-0".into(), "a").await?;
    assert_eq!(replay.status(), 201, "a retry of a known key takes no token");
    assert_eq!(replay.headers().get("idempotent-replayed").and_then(|v| v.to_str().ok()), Some("true"));
    assert_eq!(send("other-0".into(), "b").await?.status(), 201, "another merchant has its own bucket");
    Ok(())
}

/// Issue 38.5: an unauthenticated connection could make the server buffer ~400 KB of an unfinished head
/// (hyper's default) for the whole header timeout. The head is now bounded: a 100 KB header or 100 header
/// fields are refused `431` at once, while an ordinary request with a long key and a traceparent is served.
#[tokio::test]
async fn request_heads_are_bounded_to_what_a_legitimate_request_needs() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = axum::Router::new().route("/x", axum::routing::get(|| async { "ok" }));
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(idem_http::server::serve(listener, router, Default::default(), stop.clone()));
    let status_of = |head: String| async move {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(head.as_bytes()).await?;
        let mut buf = vec![0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await??;
        anyhow::Ok(String::from_utf8_lossy(&buf[..n]).chars().skip(9).take(3).collect::<String>())
    };
    let ordinary = format!(
        "GET /x HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {}\r\nIdempotency-Key: {}\r\ntraceparent: 00-{}-{}-01\r\n\r\n",
        "k".repeat(64),
        "i".repeat(255),
        "a".repeat(32),
        "b".repeat(16)
    );
    assert_eq!(status_of(ordinary).await?, "200");
    let huge = format!("GET /x HTTP/1.1\r\nHost: idem\r\nX-Pad: {}\r\n\r\n", "p".repeat(100_000));
    assert_eq!(status_of(huge).await?, "431", "a 100 KB head was read");
    let many: String = (0..100).map(|i| format!("X-H{i}: v\r\n")).collect();
    assert_eq!(status_of(format!("GET /x HTTP/1.1\r\nHost: idem\r\n{many}\r\n")).await?, "431", "100 header fields");
    stop.cancel();
    Ok(())
}

/// Issue 38.5: a refund locked the payment's row before checking whose it was, so merchant B, guessing A's
/// payment id, waited on (and held) A's row lock. Now the merchant is in the locking statement: while A's
/// payment is locked, B's refund of it answers 404 at once, and A's refund is not delayed by B.
#[tokio::test]
async fn a_refund_never_locks_another_merchants_payment() -> anyhow::Result<()> {
    let api = spawn().await?;
    let paid = api.charge(KEY_A, "lock-charge", &charge_body("pi_lock", "10.00")).await?;
    let id = paid.json()["id"].as_str().unwrap_or_default().to_owned();
    let mut holder = api.db.pool().begin().await?;
    sqlx::query("SELECT 1 FROM payment WHERE id = $1::uuid FOR UPDATE").bind(&id).execute(&mut *holder).await?;
    let started = std::time::Instant::now();
    let theirs = api.post(&format!("/payments/{id}/refund"), KEY_B, Some("lock-b"), r#"{"amount":"1.00"}"#).await?;
    let waited = started.elapsed();
    holder.rollback().await?;
    assert_eq!(theirs.status, 404, "{}", String::from_utf8_lossy(&theirs.body));
    assert!(waited < Duration::from_secs(1), "merchant B waited {waited:?} on merchant A's row lock");
    Ok(())
}

/// Issue 32.5: a body that does not arrive within the body-read timeout was answered `413
/// payload-too-large`; it is `408 request-timeout` (nothing ran), and a body over the limit is still `413`.
#[tokio::test]
async fn a_body_that_does_not_arrive_in_time_is_408_not_413() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let db = TestDb::new().await?;
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), layer_config(StatusCode::CONFLICT));
    let router = as_merchant_a(
        axum::Router::new()
            .route("/op", axum::routing::post(|_tx: Tx| async { (StatusCode::CREATED, "done") }))
            .route_layer(layer),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let limits =
        idem_http::server::ServerLimits { body_read_timeout: Duration::from_millis(500), ..Default::default() };
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(idem_http::server::serve(listener, router, limits, stop.clone()));
    let answer = |head: String, body: Vec<u8>| async move {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(head.as_bytes()).await?;
        s.write_all(&body).await?;
        let mut buf = vec![0u8; 2048];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await??;
        anyhow::Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    };
    let slow = answer(
        "POST /op HTTP/1.1\r\nHost: idem\r\nIdempotency-Key: slow-1\r\nContent-Length: 100\r\n\r\n".into(),
        b"{\"partial\":".to_vec(),
    )
    .await?;
    assert!(slow.starts_with("HTTP/1.1 408"), "{slow}");
    assert!(slow.contains("urn:idem:problem:request-timeout"), "{slow}");
    let large = answer(
        format!("POST /op HTTP/1.1\r\nHost: idem\r\nIdempotency-Key: large-1\r\nContent-Length: {}\r\n\r\n", 70_000),
        vec![b' '; 70_000],
    )
    .await?;
    assert!(large.starts_with("HTTP/1.1 413"), "{large}");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_record").fetch_one(db.pool()).await?;
    assert_eq!(stored, 0, "nothing is stored for a body that was not read");
    stop.cancel();
    Ok(())
}

/// A writer shared with a tracing subscriber, for reading what was logged.
#[derive(Clone, Default)]
struct Logged(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().map_err(|_| std::io::Error::other("poisoned"))?.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Issue 32.7: a handler that answers without taking its unit of work (writing through the pool instead) is
/// not atomic with its record. It is logged at debug with its route; a handler that takes it is not.
#[tokio::test]
async fn a_handler_that_never_takes_its_unit_of_work_is_logged_with_its_route() -> anyhow::Result<()> {
    let logged = Logged::default();
    let writer = logged.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    let db = TestDb::new().await?;
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), layer_config(StatusCode::CONFLICT));
    let router = as_merchant_a(
        axum::Router::new()
            .route("/without/{id}", axum::routing::post(|| async { (StatusCode::CREATED, "done") }))
            .route("/with", axum::routing::post(|_tx: Tx| async { (StatusCode::CREATED, "done") }))
            .route_layer(layer),
    );
    let base = idem_tests::serve(router).await?;
    let http = reqwest::Client::new();
    for path in ["/with", "/without/7"] {
        let reply = http.post(format!("{base}{path}")).header("idempotency-key", path).body("{}").send().await?;
        assert_eq!(reply.status(), 201);
    }
    let text = String::from_utf8(logged.0.lock().map(|l| l.clone()).unwrap_or_default())?;
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("without taking its unit of work")).collect();
    assert_eq!(lines.len(), 1, "{text}");
    assert!(lines[0].contains("/without/{id}"), "the route is named: {}", lines[0]);
    Ok(())
}

/// Issue 38.5: sockets that open and send nothing held a connection slot for the whole header timeout
/// (legitimate requests waited up to 6.9 s with 1,030 held and reopened). A new connection now gets a
/// shorter wait for its first byte; one that sends in time is served as before.
#[tokio::test]
async fn a_silent_connection_is_closed_after_the_first_byte_bound() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = axum::Router::new().route("/x", axum::routing::get(|| async { "ok" }));
    let limits = idem_http::server::ServerLimits {
        first_byte_timeout: Duration::from_millis(300),
        header_read_timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(idem_http::server::serve(listener, router, limits, stop.clone()));
    let mut silent = tokio::net::TcpStream::connect(addr).await?;
    let started = std::time::Instant::now();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf)).await??;
    assert_eq!(n, 0, "closed without an answer");
    assert!(started.elapsed() < Duration::from_secs(2), "held {:?}", started.elapsed());
    let mut talking = tokio::net::TcpStream::connect(addr).await?;
    talking.write_all(b"GET /x HTTP/1.1\r\nHost: idem\r\n\r\n").await?;
    let n = tokio::time::timeout(Duration::from_secs(5), talking.read(&mut buf)).await??;
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    stop.cancel();
    Ok(())
}

/// A stand-in payment provider: `POST /v1/charges` answers a repeated `Idempotency-Key` with its first
/// answer (as Stripe does), after `delay`; it counts its charges (new keys) and every call.
#[derive(Default)]
struct StandInProvider {
    charges: std::sync::atomic::AtomicUsize,
    calls: std::sync::atomic::AtomicUsize,
    answers: std::sync::Mutex<std::collections::HashMap<String, String>>,
    delay_ms: std::sync::atomic::AtomicU64,
}

async fn stand_in_provider(provider: Arc<StandInProvider>) -> anyhow::Result<String> {
    use std::sync::atomic::Ordering::SeqCst;
    let charge = |axum::extract::State(p): axum::extract::State<Arc<StandInProvider>>,
                  headers: axum::http::HeaderMap| async move {
        p.calls.fetch_add(1, SeqCst);
        tokio::time::sleep(Duration::from_millis(p.delay_ms.load(SeqCst))).await;
        let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
        let mut answers = p.answers.lock().map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        let n = answers.len();
        let id = answers.entry(key).or_insert_with(|| {
            p.charges.fetch_add(1, SeqCst);
            format!("ch_{}", n + 1)
        });
        Ok::<_, StatusCode>(id.clone())
    };
    let router = axum::Router::new().route("/v1/charges", axum::routing::post(charge)).with_state(provider);
    idem_tests::serve(router).await
}

/// The handler of a charge through the provider, in phases: the intent (first phase), the call with the
/// downstream key and no transaction open, the result (second phase). `lose` makes the next execution lose
/// the provider's answer after it charged (a crash or a timeout between the call and the second phase).
use idem_http::{Problem, ProblemKind};

async fn charge_in_phases(
    axum::extract::State((provider, lose)): axum::extract::State<(String, Arc<std::sync::atomic::AtomicBool>)>,
    mut tx: Tx,
) -> Result<(StatusCode, String), Problem> {
    let store = |e: sqlx::Error| {
        Problem::new(ProblemKind::StoreUnavailable, StatusCode::SERVICE_UNAVAILABLE).detail(e.to_string())
    };
    if tx.recovery_point().is_none() {
        let pg = idem_postgres::PgUnitOfWork::of(tx.uow()).map_err(|e| {
            Problem::new(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR).detail(e.to_string())
        })?;
        sqlx::query("INSERT INTO test_intent DEFAULT VALUES").execute(pg.connection()).await.map_err(store)?;
    }
    let call = tx.foreign_call("charge").await?;
    let answer = reqwest::Client::new()
        .post(format!("{provider}/v1/charges"))
        .header("idempotency-key", call.key())
        .send()
        .await
        .and_then(reqwest::Response::error_for_status);
    let charge = match answer {
        Ok(reply) => reply.text().await.unwrap_or_default(),
        Err(_) => return Err(Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)),
    };
    if lose.swap(false, std::sync::atomic::Ordering::SeqCst) {
        return Err(Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE));
    }
    tx.resume(call).await?;
    let pg = idem_postgres::PgUnitOfWork::of(tx.uow())
        .map_err(|e| Problem::new(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR).detail(e.to_string()))?;
    sqlx::query("INSERT INTO test_charge (charge) VALUES ($1)")
        .bind(&charge)
        .execute(pg.connection())
        .await
        .map_err(store)?;
    Ok((StatusCode::CREATED, charge))
}

/// Issue 33 (toolkit): a charge through a provider in phases. The provider charged but the answer was lost
/// before the second phase; a retry while the lease holds is told the request is in flight; after the lease
/// lapsed the retry takes the record over, resumes at the call (the intent is not written again) with the
/// same downstream key, and the provider answers its first charge: one charge at the provider, one intent,
/// one result, and replays equal the answer. With one pooled connection and a provider answering in 500 ms,
/// eight charges run their calls side by side: no connection is held across a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_in_phases_survives_a_lost_answer_with_one_provider_charge() -> anyhow::Result<()> {
    use std::sync::atomic::Ordering::SeqCst;
    let db = TestDb::new().await?;
    sqlx::raw_sql(
        "CREATE TABLE test_intent (n bigint GENERATED ALWAYS AS IDENTITY); \
         CREATE TABLE test_charge (charge text NOT NULL)",
    )
    .execute(db.pool())
    .await?;
    let provider = Arc::new(StandInProvider::default());
    let provider_url = stand_in_provider(provider.clone()).await?;
    let settings = idem_postgres::PoolSettings { max_connections: 1, ..Default::default() };
    let tm: Arc<dyn TransactionManager> = Arc::new(PgStore::connect(&db.url, &settings).await?);
    let mut config = layer_config(StatusCode::CONFLICT);
    config.lease = Duration::from_millis(1000);
    let lose = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let router = as_merchant_a(
        axum::Router::new()
            .route("/pay", axum::routing::post(charge_in_phases))
            .route_layer(IdempotencyLayer::new(tm, Arc::new(SystemClock), config))
            .with_state((provider_url, lose.clone())),
    );
    let base = idem_tests::serve(router).await?;
    let http = reqwest::Client::new();
    let pay = |key: String| http.post(format!("{base}/pay")).header("idempotency-key", key).body("{}").send();

    let lost = pay("phased-1".into()).await?;
    assert_eq!(lost.status(), 503, "the lost answer is an unknown outcome");
    assert_eq!(provider.charges.load(SeqCst), 1, "the provider charged");
    let early = pay("phased-1".into()).await?;
    assert_eq!(early.status(), 409, "a retry while the lease holds is in flight");
    assert_eq!(db.store.health().await?.held_records, 1, "the gauge shows the held request");
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(db.store.health().await?.lapsed_records, 1, "its lease lapsed");
    let resumed = pay("phased-1".into()).await?;
    assert_eq!(resumed.status(), 201);
    let charge = resumed.text().await?;
    assert_eq!(charge, "ch_1", "the takeover got the provider's first answer");
    let replay = pay("phased-1".into()).await?;
    assert_eq!(replay.headers().get("idempotent-replayed").and_then(|v| v.to_str().ok()), Some("true"));
    assert_eq!(replay.text().await?, charge);
    assert_eq!((provider.charges.load(SeqCst), provider.calls.load(SeqCst)), (1, 2), "(charges, calls)");
    assert_eq!(db.count("test_intent").await?, 1, "the intent was written once");
    assert_eq!(db.count("test_charge").await?, 1, "the result was recorded once");
    assert_eq!(db.store.health().await?.held_records, 0, "completed: no longer held");

    // no connection across the call: 8 charges, one pooled connection, 500 ms a call
    provider.delay_ms.store(500, SeqCst);
    lose.store(false, SeqCst);
    let started = std::time::Instant::now();
    let replies = futures::future::join_all((0..8).map(|i| pay(format!("parallel-{i}")))).await;
    let took = started.elapsed();
    for reply in replies {
        assert_eq!(reply?.status(), 201);
    }
    assert!(took < Duration::from_millis(2500), "8 calls of 500 ms took {took:?}: a connection was held across them");
    assert_eq!(provider.charges.load(SeqCst), 9);
    Ok(())
}

/// A claim of key `key` in scope `m` at `now`, kept 48 h.
fn claim_at(key: &str, now: chrono::DateTime<chrono::Utc>) -> idem_ports::IdempotencyClaim {
    idem_ports::IdempotencyClaim {
        scope: "m".into(),
        key: key.into(),
        command_hash: [7; 32],
        created_at: now,
        expires_at: now + chrono::Duration::hours(48),
    }
}

/// Attempt `attempt`'s hold at the recovery point `charge`, its lease until about `lease_until` (the
/// database's clock counts the lease: one in the past is lapsed at once).
fn hold(attempt: u32, lease_until: chrono::DateTime<chrono::Utc>) -> idem_ports::PhaseHold {
    let lease = (lease_until - chrono::Utc::now()).to_std().unwrap_or_default();
    idem_ports::PhaseHold {
        attempt,
        lease_until,
        lease,
        not_before: None,
        generation: None,
        recovery_point: "charge".into(),
        request: None,
    }
}

/// Issue 33 (toolkit): the store's fencing. A record held by attempt 1 whose lease lapsed is taken over by
/// attempt 2; attempt 1 can then neither renew nor enter its second phase, attempt 2 can.
#[tokio::test]
async fn a_late_original_is_fenced_out_after_a_takeover() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let now = chrono::Utc::now();
    let claim = claim_at("fenced", now);
    let mut uow = db.store.begin().await?;
    assert_eq!(uow.idempotency().claim(&claim, now, Duration::from_secs(1)).await?, idem_ports::ClaimOutcome::Claimed);
    assert!(uow.idempotency().hold("m", "fenced", &hold(1, now - chrono::Duration::seconds(1))).await?);
    uow.commit().await?;
    let mut uow = db.store.begin().await?;
    assert_eq!(
        uow.idempotency().take_over("m", "fenced", 1, Duration::from_secs(30), None).await?,
        idem_ports::TakeOver::Taken { past_window: false }
    );
    assert_eq!(
        uow.idempotency().take_over("m", "fenced", 1, Duration::from_secs(30), None).await?,
        idem_ports::TakeOver::Held,
        "twice"
    );
    uow.commit().await?;
    let mut uow = db.store.begin().await?;
    assert!(!uow.idempotency().owns("m", "fenced", 1).await?, "the late original entered its second phase");
    assert!(!uow.idempotency().hold("m", "fenced", &hold(1, now + chrono::Duration::seconds(30))).await?);
    assert!(uow.idempotency().owns("m", "fenced", 2).await?);
    let record = uow.idempotency().get("m", "fenced").await?.expect("the record");
    assert_eq!(record.phase.map(|p| p.attempt), Some(2));
    Ok(())
}

/// A key reused after its record expired (before the cleaner removed it) is claimed again over the old row.
/// The claim kept the old request's phase columns: after a takeover (attempt 2), the new request's first
/// hold as attempt 1 was refused ("taken over", 503) on every send until the cleaner ran. A claim over an
/// expired record now leaves the row as a fresh claim inserts it (as after the cleaner): attempt 0, no
/// lease, no recovery point, no stored request.
#[tokio::test]
async fn a_key_reused_after_its_record_expired_holds_a_lease_again() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let now = chrono::Utc::now();
    let claim = claim_at("reused", now);
    let request = idem_ports::StoredRequest {
        method: "POST".into(),
        uri: "/op".into(),
        content_type: None,
        body: b"{}".to_vec(),
    };
    let hold =
        |attempt, lease_until| idem_ports::PhaseHold { request: Some(request.clone()), ..hold(attempt, lease_until) };
    let response = idem_ports::StoredResponse { status_code: 201, headers: Vec::new(), body: b"first".to_vec() };
    // the first request: held by attempt 1, taken over by attempt 2, completed
    let mut uow = db.store.begin().await?;
    assert_eq!(uow.idempotency().claim(&claim, now, Duration::from_secs(1)).await?, idem_ports::ClaimOutcome::Claimed);
    assert!(uow.idempotency().hold("m", "reused", &hold(1, now - chrono::Duration::seconds(1))).await?);
    uow.commit().await?;
    let mut uow = db.store.begin().await?;
    assert_eq!(
        uow.idempotency().take_over("m", "reused", 1, Duration::from_secs(30), None).await?,
        idem_ports::TakeOver::Taken { past_window: false }
    );
    uow.idempotency().complete("m", "reused", &response).await?;
    uow.commit().await?;
    // its retention ends; the cleaner has not come yet
    sqlx::query("UPDATE idempotency_record SET expires_at = now() - interval '1 minute' WHERE key = 'reused'")
        .execute(db.pool())
        .await?;
    // the key sent again: claimed over the expired row, and its foreign call holds the record as attempt 1
    let later = chrono::Utc::now();
    let again = claim_at("reused", later);
    let mut uow = db.store.begin().await?;
    assert_eq!(
        uow.idempotency().claim(&again, later, Duration::from_secs(1)).await?,
        idem_ports::ClaimOutcome::Claimed
    );
    let claimed_row: (i32, Option<chrono::DateTime<chrono::Utc>>, Option<Vec<u8>>) =
        sqlx::query_as("SELECT attempt, lease_until, request_body FROM idempotency_record WHERE key = 'reused'")
            .fetch_one(idem_postgres::PgUnitOfWork::of(uow.as_mut())?.connection())
            .await?;
    assert!(
        uow.idempotency().hold("m", "reused", &hold(1, later + chrono::Duration::seconds(30))).await?,
        "the new request's first hold was refused as if another attempt had taken it over"
    );
    assert!(uow.idempotency().owns("m", "reused", 1).await?);
    assert_eq!(claimed_row, (0, None, None), "the claimed row is a fresh claim's (attempt, lease, stored request)");
    Ok(())
}
/// Issue 37: a keyed charge claimed its key (an in-flight row), wrote the payment and its outbox row, then
/// completed the record (a second, non-HOT write of the row: `state` is in the held-records index's
/// predicate): six round trips. Recorded at commit, the record is written once, completed, and the payment
/// and its announcement go in one statement: BEGIN, payment + announcement, record, COMMIT. On main before
/// this change the same count was 6 and the record's tuple was the second one written.
#[tokio::test]
async fn a_new_charge_writes_its_record_once_in_four_round_trips() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (proxy, proxied) = db.proxied().await?;
    let settings = idem_postgres::PoolSettings { max_connections: 1, ..Default::default() };
    let store = PgStore::connect(&proxied, &settings).await?;
    let tm: Arc<dyn TransactionManager> = Arc::new(store.clone());
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), layer_config(StatusCode::CONFLICT));
    let base = idem_tests::serve(idem_http::router(api_state(&store), keys(), layer)).await?;
    let api = Api { db, base, http: reqwest::Client::new() };
    // the first charge prepares the statements on the connection
    assert_eq!(api.charge(KEY_A, "once-0", &charge_body("ext-once-0", "10.00")).await?.status, 201);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = proxy.flights();
    let body = charge_body("ext-once-1", "10.00");
    let charged = api.charge(KEY_A, "once-1", &body).await?;
    assert_eq!(charged.status, 201, "{:?}", charged.json());
    tokio::time::sleep(Duration::from_millis(300)).await;
    // the unit of work: BEGIN, payment + announcement, record, COMMIT (4; before: 6). The rest is the
    // cross-instance wake-up of relays, one per charge this far apart (`wakeup.rs`, debounced to 40 a
    // second under load): sqlx's pool pings on acquire and release around BEGIN, pg_notify, COMMIT (5).
    assert_eq!(proxy.flights() - before, 4 + 5, "BEGIN, payment + announcement, record, COMMIT, then the NOTIFY");
    let pool = api.db.pool();
    let (state, first_tuple): (String, bool) =
        sqlx::query_as("SELECT state, ctid = '(0,2)'::tid FROM idempotency_record WHERE key = 'once-1'")
            .fetch_one(pool)
            .await?;
    assert_eq!(state, "completed");
    assert!(first_tuple, "the record of the second charge is the table's second tuple: written once, never updated");
    let announced: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_message WHERE payload->>'external_payment_id' = 'ext-once-1'")
            .fetch_one(pool)
            .await?;
    assert_eq!(announced, 1, "the new payment is announced once");
    // a charge that finds its payment (same provider id, new key) is answered 200 and announces nothing
    let again = api.charge(KEY_A, "once-2", &body).await?;
    assert_eq!(again.status, 200, "{:?}", again.json());
    let announced: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_message WHERE payload->>'external_payment_id' = 'ext-once-1'")
            .fetch_one(pool)
            .await?;
    assert_eq!(announced, 1, "an existing payment is not announced again");
    Ok(())
}

/// Issue 37: recorded at commit, a duplicate on another instance runs its handler before any record
/// exists. Two instances (two layers, two pools, one database) each get concurrent duplicates of one key
/// whose handler is not idempotent on its own (it inserts a row without any key, then waits 200 ms in the
/// transaction so the duplicates overlap). Effects are counted, not survivors: more than one execution
/// runs, exactly one row commits, and every answer is that execution's (201 executed or replayed).
#[tokio::test]
async fn duplicates_on_two_instances_recorded_at_commit_commit_one_effect() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    sqlx::query("CREATE TABLE effect (id bigserial PRIMARY KEY, note text NOT NULL)").execute(db.pool()).await?;
    let executions = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let instance = |n: usize| {
        let (executions, url) = (executions.clone(), db.url.clone());
        async move {
            let store = PgStore::connect(&url, &idem_postgres::PoolSettings::default()).await?;
            let tm: Arc<dyn TransactionManager> = Arc::new(store);
            let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), layer_config(StatusCode::CONFLICT));
            let handler = move |mut tx: Tx| {
                let executions = executions.clone();
                async move {
                    let run = executions.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let conn =
                        idem_postgres::PgUnitOfWork::of(tx.uow()).map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                    sqlx::query("INSERT INTO effect (note) VALUES ($1)")
                        .bind(format!("instance {n} run {run}"))
                        .execute(conn.connection())
                        .await
                        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Ok::<_, StatusCode>((StatusCode::CREATED, format!("run {run}")))
                }
            };
            let router =
                as_merchant_a(axum::Router::new().route("/op", axum::routing::post(handler)).route_layer(layer));
            idem_tests::serve(router).await
        }
    };
    let bases = [instance(1).await?, instance(2).await?];
    let http = reqwest::Client::new();
    let replies = futures::future::join_all((0..8).map(|i| {
        let req = http.post(format!("{}/op", bases[i % 2])).header("idempotency-key", "dup-1").body("{}");
        async move {
            let r = req.send().await?;
            anyhow::Ok((r.status().as_u16(), r.text().await?))
        }
    }))
    .await
    .into_iter()
    .collect::<anyhow::Result<Vec<_>>>()?;
    let effects: Vec<String> = sqlx::query_scalar("SELECT note FROM effect").fetch_all(db.pool()).await?;
    assert_eq!(effects.len(), 1, "one effect commits: {effects:?}");
    assert!(
        executions.load(std::sync::atomic::Ordering::SeqCst) >= 2,
        "both instances ran the handler (the duplicate recorded at commit ran before the record existed)"
    );
    let first = effects[0].rsplit(' ').next().unwrap_or_default().to_owned();
    for (status, body) in &replies {
        assert_eq!(*status, 201, "{replies:?}");
        assert_eq!(body, &format!("run {first}"), "every answer is the committed execution's: {replies:?}");
    }
    Ok(())
}

/// Issue 45.8: on the record-at-commit path a retry of a known key took a new-key token before it knew
/// the key (it runs the handler first) and kept it, so at a quota of 1/s a client's retries refused its
/// next new key `429` — while the README says retries are free. The token now goes back.
#[tokio::test]
async fn retries_of_a_known_key_recorded_at_commit_take_no_new_key_token() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let mut config = layer_config(StatusCode::CONFLICT);
    assert!(config.record_at_commit, "the default path");
    let one = std::num::NonZeroU32::MIN;
    config.new_keys = Some(Arc::new(idem_http::quota::NewKeyQuota::new(one, one)));
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), config);
    let router = as_merchant_a(
        axum::Router::new()
            .route("/op", axum::routing::post(|_tx: Tx| async { (StatusCode::CREATED, "done") }))
            .route_layer(layer),
    );
    let base = idem_tests::serve(router).await?;
    let http = reqwest::Client::new();
    let send = |key: &str| http.post(format!("{base}/op")).header("idempotency-key", key).body("{}").send();
    assert_eq!(send("known-1").await?.status(), 201);
    // the bucket refills (1/s); a retry of the known key must leave that token for the next new key
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let retry = send("known-1").await?;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers().get("idempotent-replayed").and_then(|v| v.to_str().ok()), Some("true"));
    let next = send("new-2").await?;
    assert_eq!(next.status(), 201, "the retry of a known key spent the new key's token");
    assert_eq!(send("new-3").await?.status(), 429, "and the quota still holds");
    Ok(())
}

/// Issue 45.8: the record-at-commit path took the handler's rows first and the key last, the claim-first
/// path the key first: a request recorded at commit on one instance and a claim-first duplicate on
/// another (here: an instance configured to claim first) deadlocked until PostgreSQL broke it a second
/// later, answering one of them `500`/`503`. The record-at-commit insert now waits on the key only briefly,
/// rolls back and is decided again claim first: both answered with the one execution, no deadlock.
#[tokio::test]
async fn the_two_claim_paths_wait_for_locks_in_one_order() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    sqlx::query("CREATE TABLE effect (note text PRIMARY KEY, instance int NOT NULL)").execute(db.pool()).await?;
    let instance = |n: i32, record_at_commit: bool, hold: Duration| {
        let url = db.url.clone();
        async move {
            let store = PgStore::connect(&url, &idem_postgres::PoolSettings::default()).await?;
            let tm: Arc<dyn TransactionManager> = Arc::new(store);
            let mut config = layer_config(StatusCode::CONFLICT);
            config.record_at_commit = record_at_commit;
            let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), config);
            let handler = move |mut tx: Tx| async move {
                let conn = idem_postgres::PgUnitOfWork::of(tx.uow()).map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                // the business row both executions write (a payment's unique reference, say)
                sqlx::query("INSERT INTO effect (note, instance) VALUES ('the-row', $1)")
                    .bind(n)
                    .execute(conn.connection())
                    .await
                    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                tokio::time::sleep(hold).await;
                Ok::<_, StatusCode>((StatusCode::CREATED, format!("instance {n}")))
            };
            let router =
                as_merchant_a(axum::Router::new().route("/op", axum::routing::post(handler)).route_layer(layer));
            idem_tests::serve(router).await
        }
    };
    let at_commit = instance(1, true, Duration::from_millis(400)).await?;
    let claim_first = instance(2, false, Duration::ZERO).await?;
    let deadlocks = || async {
        sqlx::query_scalar::<_, i64>("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            .fetch_one(db.pool())
            .await
    };
    let before = deadlocks().await?;
    let http = reqwest::Client::new();
    let send = |base: &str| {
        let req = http.post(format!("{base}/op")).header("idempotency-key", "one-order").body("{}");
        async move {
            let r = req.send().await?;
            anyhow::Ok((r.status().as_u16(), r.text().await?))
        }
    };
    let first = send(&at_commit);
    let second = async {
        // the record-at-commit request holds the row; the claim-first one takes the key, then waits for it
        tokio::time::sleep(Duration::from_millis(150)).await;
        send(&claim_first).await
    };
    let (first, second) = tokio::join!(first, second);
    let (first, second) = (first?, second?);
    assert_eq!((first.0, second.0), (201, 201), "both answered with the one execution: {first:?} {second:?}");
    assert_eq!(first.1, second.1, "one execution answers both");
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effect").fetch_one(db.pool()).await?;
    assert_eq!(effects, 1);
    // the statistics are flushed at the end of a transaction; give the collector a moment
    tokio::time::sleep(Duration::from_millis(600)).await;
    sqlx::query("SELECT pg_stat_clear_snapshot()").execute(db.pool()).await?;
    assert_eq!(deadlocks().await?, before, "no deadlock was broken by PostgreSQL");
    Ok(())
}

//! Issue 33 (reference service): `POST /payments` with a `payment_method` charges through the payment
//! provider in phases. Each case counts the effects at the stand-in provider (charges per key), in the
//! database (payments, their announcements) and what the client sees on a retry.

use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use idem_domain::TtlPolicy;
use idem_http::{ApiKeys, ApiState, IdempotencyConfig, IdempotencyLayer};
use idem_ports::{PaymentProvider, SystemClock, TransactionManager, UuidV7Generator};
use idem_postgres::PgStore;
use idem_provider::HttpPaymentProvider;
use idem_tests::TestDb;
use idem_tests::provider::StandIn;
use serde_json::{Value, json};

const API_KEY: &str = "key_a_0123456789";
const PROVIDER_KEY: &str = "sk_test_standin_0123";
const WEBHOOK_SECRET: &str = "whsec_test_0123456789";

/// One instance of the service on `store`, charging through the provider at `provider_base`.
async fn instance(
    store: &PgStore,
    provider_base: &str,
    call_timeout: Duration,
    lease: Duration,
) -> anyhow::Result<String> {
    idem_tests::serve(reference_router(store, provider_base, call_timeout, lease)?).await
}

/// The payments API on `store` with the provider at `provider_base`.
fn reference_router(
    store: &PgStore,
    provider_base: &str,
    call_timeout: Duration,
    lease: Duration,
) -> anyhow::Result<axum::Router> {
    reference_router_on(store, provider_base, call_timeout, lease, Arc::new(SystemClock), None)
}

/// The payments API's state on `store`, on a host whose clock is `clock`, charging through `provider`.
fn api_state(
    store: &PgStore,
    clock: Arc<dyn idem_ports::Clock>,
    provider: Option<Arc<dyn PaymentProvider>>,
) -> ApiState {
    ApiState {
        tm: Arc::new(store.clone()),
        payments_of: idem_postgres::payments_of,
        clock,
        ids: Arc::new(UuidV7Generator),
        payments_topic: "payments".into(),
        provider,
    }
}

/// [`reference_router`] on a host whose clock is `clock`.
fn reference_router_on(
    store: &PgStore,
    provider_base: &str,
    call_timeout: Duration,
    lease: Duration,
    clock: Arc<dyn idem_ports::Clock>,
    window: Option<Duration>,
) -> anyhow::Result<axum::Router> {
    let provider: Arc<dyn PaymentProvider> =
        Arc::new(HttpPaymentProvider::new("standin", provider_base, PROVIDER_KEY, call_timeout)?);
    let tm: Arc<dyn TransactionManager> = Arc::new(store.clone());
    let state = api_state(store, clock.clone(), Some(provider));
    let mut config =
        IdempotencyConfig::new(TtlPolicy::new(Duration::from_secs(48 * 3600))?, idem_http::merchant_scope());
    config.lease = lease;
    config.window = window;
    let layer = IdempotencyLayer::new(tm, clock, config);
    let keys = Arc::new(ApiKeys::parse(&format!("merchant_a:{API_KEY}")).map_err(anyhow::Error::msg)?);
    let webhooks = idem_http::webhooks::WebhookState::new(state.clone(), "standin".into(), WEBHOOK_SECRET.as_bytes())?;
    Ok(idem_http::router(state, keys, layer).merge(idem_http::webhooks::router(webhooks)))
}

struct Reply {
    status: u16,
    replayed: bool,
    retry_after: Option<u64>,
    body: Value,
    raw: Vec<u8>,
}

async fn charge(base: &str, key: &str, body: &Value) -> anyhow::Result<Reply> {
    let resp = reqwest::Client::new()
        .post(format!("{base}/payments"))
        .bearer_auth(API_KEY)
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await?;
    let status = resp.status().as_u16();
    let replayed = resp.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    let retry_after =
        resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let raw = resp.bytes().await?.to_vec();
    Ok(Reply { status, replayed, retry_after, body: serde_json::from_slice(&raw).unwrap_or(Value::Null), raw })
}

fn card(payment_method: &str, amount: &str) -> Value {
    json!({
        "order_id": uuid::Uuid::now_v7(), "customer_id": uuid::Uuid::now_v7(),
        "amount": amount, "currency": "EUR", "payment_method": payment_method,
    })
}

/// The effects in the database: (payments by status, `PaymentCaptured` announcements).
async fn effects(db: &TestDb) -> anyhow::Result<(Vec<(String, i64)>, i64)> {
    let statuses: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM payment GROUP BY status ORDER BY status")
            .fetch_all(db.pool())
            .await?;
    let announced: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_message WHERE type = 'PaymentCaptured'")
        .fetch_one(db.pool())
        .await?;
    Ok((statuses, announced))
}

/// Money conserved: what the provider charged equals what idem captured, payment by payment (the charge's
/// reference is idem's payment id, its id the payment's external_payment_id).
async fn assert_money_conserved(db: &TestDb, standin: &StandIn) -> anyhow::Result<()> {
    let mut at_provider: Vec<(String, i64, String)> = standin.charges_made();
    at_provider.sort();
    let mut in_idem: Vec<(String, i64, String)> = sqlx::query_as(
        "SELECT external_payment_id, (amount * 100)::bigint, id::text FROM payment
         WHERE status IN ('captured', 'partially_refunded', 'refunded')",
    )
    .fetch_all(db.pool())
    .await?;
    in_idem.sort();
    assert_eq!(at_provider, in_idem, "charges at the provider vs captured payments");
    let refunded: Vec<(String, i64)> = sqlx::query_as(
        "SELECT external_payment_id, (refunded_amount * 100)::bigint FROM payment WHERE external_payment_id IS NOT NULL",
    )
    .fetch_all(db.pool())
    .await?;
    for (charge, in_idem) in refunded {
        assert_eq!(standin.refunded_of(&charge), in_idem, "refunded of {charge}: at the provider vs in idem");
    }
    Ok(())
}

/// A charge, its replay, a decline and its replay, the refusal of a charge that also names a provider
/// payment: one provider charge, one announcement, identical replays.
#[tokio::test]
async fn a_charge_and_a_decline_through_the_provider_happen_once_and_replay() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let base = instance(&db.store, &provider, Duration::from_secs(5), Duration::from_secs(30)).await?;

    let body = card("pm_card_visa", "12.34");
    let first = charge(&base, "provider-charge-1", &body).await?;
    assert_eq!(first.status, 201, "{}", first.body);
    assert_eq!(first.body["status"], "captured");
    assert_eq!(first.body["provider"], "standin");
    assert_eq!(first.body["external_payment_id"], "ch_1");
    let again = charge(&base, "provider-charge-1", &body).await?;
    assert!(again.replayed);
    assert_eq!((again.status, &again.raw), (201, &first.raw), "the replay is the first answer");

    let declined = charge(&base, "provider-decline-1", &card("pm_card_declined", "5.00")).await?;
    assert_eq!(declined.status, 402, "{}", declined.body);
    assert_eq!(declined.body["type"], "urn:idem:problem:card-declined");
    let replayed = charge(&base, "provider-decline-1", &card("pm_card_declined", "5.00")).await?;
    // the body differs (new order ids): a conflict, not a second call; the same body replays the decline
    assert_eq!(replayed.status, 409, "another request under the key");
    assert_eq!(standin.calls.load(SeqCst), 2, "one call per key: the decline was not asked again");

    let both = json!({"order_id": uuid::Uuid::now_v7(), "customer_id": uuid::Uuid::now_v7(), "amount": "1.00",
                      "currency": "EUR", "payment_method": "pm_card_visa", "provider": "x", "external_payment_id": "y"});
    let refused = charge(&base, "provider-both-1", &both).await?;
    assert_eq!((refused.status, refused.body["field"].as_str()), (422, Some("provider")));

    assert_eq!(standin.charges.load(SeqCst), 1);
    let (statuses, announced) = effects(&db).await?;
    assert_eq!(statuses, vec![("captured".to_owned(), 1), ("declined".to_owned(), 1)]);
    assert_eq!(announced, 1);
    assert_money_conserved(&db, &standin).await
}

/// A decline replays byte for byte under the same request.
#[tokio::test]
async fn a_decline_is_stored_and_replayed_never_asked_again() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let base = instance(&db.store, &provider, Duration::from_secs(5), Duration::from_secs(30)).await?;
    let body = card("pm_card_declined", "5.00");
    let first = charge(&base, "provider-decline-2", &body).await?;
    let second = charge(&base, "provider-decline-2", &body).await?;
    assert_eq!((first.status, second.status, second.replayed), (402, 402, true));
    assert_eq!(first.raw, second.raw);
    assert_eq!((standin.calls.load(SeqCst), standin.charges.load(SeqCst)), (1, 0));
    Ok(())
}

/// Every answer whose outcome is unknown — a `500` before charging, the provider's own `409` in progress, a
/// `429`, an answer later than the call's bound (after charging) — is `503 outcome-unknown` and leaves the
/// payment pending; the client's retry resumes under the same downstream key (at once after an answer,
/// once the lease lapsed after none): one charge at the provider per client key, one payment, one
/// announcement.
#[tokio::test]
async fn unknown_outcomes_are_resumed_by_the_retry_with_one_charge() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let base = instance(&db.store, &provider, Duration::from_millis(400), Duration::from_secs(1)).await?;
    let cases: [(&str, u16, u64); 4] = [("500", 500, 0), ("409", 409, 0), ("429", 429, 0), ("slow", 0, 800)];
    for (i, (name, fail, delay)) in cases.into_iter().enumerate() {
        let key = format!("provider-unknown-{name}");
        let body = card("pm_card_visa", "7.00");
        if fail > 0 {
            standin.fail_status.store(fail, SeqCst);
            standin.failures.store(1, SeqCst);
        }
        standin.delay_ms.store(delay, SeqCst);
        let unknown = charge(&base, &key, &body).await?;
        assert_eq!(unknown.status, 503, "{name}: {}", unknown.body);
        assert_eq!(unknown.body["type"], "urn:idem:problem:outcome-unknown", "{name}");
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM payment WHERE status = 'pending'").fetch_one(db.pool()).await?;
        assert_eq!(pending, 1, "{name}: the payment waits, pending");
        standin.delay_ms.store(0, SeqCst);
        let mut retried = charge(&base, &key, &body).await?;
        if fail > 0 {
            // answered, nothing in process: no call again before the backoff (issue 44), and nothing sent
            let calls = standin.calls.load(SeqCst);
            assert_eq!((retried.status, retried.retry_after), (503, Some(1)), "{name}: {}", retried.body);
            assert_eq!(standin.calls.load(SeqCst), calls, "{name}: a retry within the wait called the provider");
            tokio::time::sleep(Duration::from_millis(1100)).await;
            retried = charge(&base, &key, &body).await?;
        }
        if delay > 0 {
            // no answer: the call may still be in process at the provider, so the lease is kept
            assert_eq!(retried.status, 409, "{name}: a retry before the lease lapsed: {}", retried.body);
            while retried.status == 409 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                retried = charge(&base, &key, &body).await?;
            }
        }
        assert_eq!(retried.status, 201, "{name}: {}", retried.body);
        assert_eq!(retried.body["status"], "captured");
        let replay = charge(&base, &key, &body).await?;
        assert_eq!((replay.replayed, &replay.raw), (true, &retried.raw), "{name}");
        assert_eq!(standin.charges.load(SeqCst), i + 1, "{name}: one charge per client key");
    }
    let (statuses, announced) = effects(&db).await?;
    assert_eq!(statuses, vec![("captured".to_owned(), 4)]);
    assert_eq!(announced, 4);
    assert_money_conserved(&db, &standin).await
}

/// The provider unreachable (connection refused) on one instance, then reachable from another instance on
/// the same database: the retry there resumes the pending payment and charges once; two instances racing on
/// one key make one call (the other is told the request is in flight).
#[tokio::test]
async fn a_refused_connection_then_another_instance_and_a_race_charge_once() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        format!("http://{}", listener.local_addr()?)
    }; // dropped: nothing listens there
    let down = instance(&db.store, &closed, Duration::from_millis(500), Duration::from_secs(30)).await?;
    let up = instance(&db.store, &provider, Duration::from_secs(5), Duration::from_secs(30)).await?;
    let body = card("pm_card_visa", "3.50");
    let refused = charge(&down, "provider-refused-1", &body).await?;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(standin.calls.load(SeqCst), 0);
    tokio::time::sleep(Duration::from_secs(refused.retry_after.unwrap_or(1)) + Duration::from_millis(100)).await;
    let resumed = charge(&up, "provider-refused-1", &body).await?;
    assert_eq!(resumed.status, 201, "{}", resumed.body);

    standin.delay_ms.store(600, SeqCst);
    let race = card("pm_card_visa", "9.99");
    let up_too = instance(&db.store, &provider, Duration::from_secs(5), Duration::from_secs(30)).await?;
    let (a, b) = tokio::join!(charge(&up, "provider-race-1", &race), charge(&up_too, "provider-race-1", &race));
    let mut statuses = [a?.status, b?.status];
    statuses.sort_unstable();
    assert_eq!(statuses, [201, 409], "one executes, the other is in flight");
    standin.delay_ms.store(0, SeqCst);
    let after = charge(&down, "provider-race-1", &race).await?;
    assert_eq!((after.status, after.replayed), (201, true));
    assert_eq!(standin.charges.load(SeqCst), 2, "one charge per client key");
    assert_money_conserved(&db, &standin).await
}

/// The completer and the operator's commands on requests whose client went away after an unknown outcome:
/// the completer finishes one (one charge, the client's retry replays it); one past the provider's
/// idempotency window is parked (gauge, listed, a retry cannot take it over), then handed back with
/// `resume` and finished; one the provider never charged is parked and `abandon`ed (409 replayed to
/// every retry, nothing charged). Only parked requests can be abandoned.
#[tokio::test]
async fn the_completer_finishes_parks_and_the_operator_resumes_or_abandons() -> anyhow::Result<()> {
    use idem_http::completer::{Completer, CompleterSettings, Round};
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let router = reference_router(&db.store, &provider, Duration::from_secs(2), Duration::from_secs(30))?;
    let base = idem_tests::serve(router.clone()).await?;
    let completer = |window: Duration| {
        let settings = CompleterSettings { grace: Duration::ZERO, window, ..CompleterSettings::default() };
        Completer::new(
            Arc::new(db.store.clone()),
            Arc::new(SystemClock),
            router.clone(),
            idem_http::merchant_principal(),
            settings,
        )
    };
    let unknown = |key: &'static str, body: Value| {
        let (standin, base) = (standin.clone(), base.clone());
        async move {
            standin.fail_status.store(500, SeqCst);
            standin.failures.store(1, SeqCst);
            let reply = charge(&base, key, &body).await?;
            anyhow::ensure!(reply.status == 503, "{}", reply.body);
            // nothing is re-sent before the wait after an unknown outcome (issue 44)
            tokio::time::sleep(Duration::from_millis(1100)).await;
            Ok::<_, anyhow::Error>(body)
        }
    };

    let finished = unknown("completer-1", card("pm_card_visa", "20.00")).await?;
    let round = completer(Duration::from_secs(3600)).round().await?;
    assert_eq!(round, Round { completed: 1, unknown: 0, parked: 0 });
    let replay = charge(&base, "completer-1", &finished).await?;
    assert_eq!((replay.status, replay.replayed, replay.body["status"].as_str()), (201, true, Some("captured")));
    assert_eq!(standin.charges.load(SeqCst), 1);

    let late = unknown("completer-late-1", card("pm_card_visa", "30.00")).await?;
    let round = completer(Duration::ZERO).round().await?;
    assert_eq!(round, Round { completed: 0, unknown: 0, parked: 1 }, "past the window: parked, not re-sent");
    assert_eq!(db.store.health().await?.parked_records, 1);
    let listed = db.store.held_records(true, 10).await?;
    assert_eq!(listed.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(), ["completer-late-1"]);
    let retry = charge(&base, "completer-late-1", &late).await?;
    assert_eq!(retry.status, 503, "a parked request is not taken over by a retry: {}", retry.body);
    assert!(retry.body["detail"].as_str().unwrap_or_default().contains("parked"), "{}", retry.body);
    assert_eq!(standin.charges.load(SeqCst), 1, "nothing re-sent while parked");
    assert!(db.store.resume_held("merchant_a", "completer-late-1").await?);
    let round = completer(Duration::from_secs(3600)).round().await?;
    assert_eq!(round.completed, 1);
    assert_eq!(charge(&base, "completer-late-1", &late).await?.status, 201);

    let never = unknown("completer-abandon-1", card("pm_card_visa", "40.00")).await?;
    assert!(!db.store.abandon_parked("merchant_a", "completer-abandon-1", 409, b"{}").await?, "held, not parked");
    assert_eq!(completer(Duration::ZERO).round().await?.parked, 1);
    let body = br#"{"type":"urn:idem:problem:request-abandoned","status":409}"#;
    assert!(db.store.abandon_parked("merchant_a", "completer-abandon-1", 409, body).await?);
    for _ in 0..2 {
        let answer = charge(&base, "completer-abandon-1", &never).await?;
        assert_eq!((answer.status, answer.body["type"].as_str()), (409, Some("urn:idem:problem:request-abandoned")));
    }
    assert_eq!(db.store.health().await?.parked_records, 0);
    assert_eq!(completer(Duration::from_secs(3600)).round().await?, Round::default(), "nothing left to do");
    assert_eq!(standin.charges.load(SeqCst), 2, "the abandoned request was never charged");
    assert_money_conserved(&db, &standin).await
}

/// Posts a provider event, signed at `signed_at` with `secret`; returns the status and the outcome.
async fn webhook(
    base: &str,
    secret: &str,
    signed_at: chrono::DateTime<chrono::Utc>,
    event: &Value,
) -> anyhow::Result<(u16, String)> {
    let body = serde_json::to_vec(event)?;
    let resp = reqwest::Client::new()
        .post(format!("{base}/webhooks/payment-provider"))
        .header("provider-signature", idem_domain::webhook::sign(secret.as_bytes(), &body, signed_at))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    Ok((status, body["outcome"].as_str().unwrap_or_default().to_owned()))
}

fn charge_event(event_id: &str, charge: &str, minor: i64, reference: uuid::Uuid) -> Value {
    json!({"id": event_id, "type": "charge.succeeded", "created": 0, "data": {"object": {
        "id": charge, "status": "succeeded", "amount_minor": minor, "currency": "EUR", "reference": reference.to_string()}}})
}

fn refund_event(event_id: &str, refund: &str, charge: &str, minor: i64, reference: Option<uuid::Uuid>) -> Value {
    json!({"id": event_id, "type": "charge.refunded", "created": 0, "data": {"object": {
        "id": refund, "status": "succeeded", "charge": charge, "amount_minor": minor,
        "reference": reference.map(|r| r.to_string())}}})
}

/// Webhooks badly signed (missing, wrong secret, stale), early (the charge captured by its webhook while
/// the API's call is still out, then the API's second phase finds it captured), duplicated, late (after
/// the API captured), and a refund before its charge (503, not recorded, applied when delivered again);
/// a refund through the API and its webhook make one refund. Effects: one payment per charge, one
/// announcement per capture, refunds at the provider = refunds in idem.
#[tokio::test]
async fn webhooks_converge_with_the_api_whatever_their_order() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let base = instance(&db.store, &provider, Duration::from_secs(5), Duration::from_secs(30)).await?;
    let now = chrono::Utc::now();
    let events = || async { count_rows(&db, "SELECT count(*) FROM provider_event").await };

    // badly signed: nothing recorded, nothing changed
    let unknown_ref = uuid::Uuid::now_v7();
    let badly = charge_event("evt_1", "ch_1", 2500, unknown_ref);
    assert_eq!(webhook(&base, "whsec_wrong_0123456789", now, &badly).await?.0, 401);
    assert_eq!(webhook(&base, WEBHOOK_SECRET, now - chrono::Duration::minutes(6), &badly).await?.0, 401, "stale");
    let unsigned = reqwest::Client::new().post(format!("{base}/webhooks/payment-provider")).json(&badly).send().await?;
    assert_eq!(unsigned.status().as_u16(), 400);
    assert_eq!(events().await?, 0);

    // early: the webhook captures while the API's call is out (the provider answers late)
    standin.delay_ms.store(700, SeqCst);
    let body = card("pm_card_visa", "25.00");
    let api = {
        let (base, body) = (base.clone(), body.clone());
        tokio::spawn(async move { charge(&base, "webhook-early-1", &body).await })
    };
    while standin.charges.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // the provider echoes idem's payment id (the pending payment's) as the charge's reference
    let reference: uuid::Uuid =
        sqlx::query_scalar("SELECT id FROM payment WHERE status = 'pending'").fetch_one(db.pool()).await?;
    assert_eq!(reference.get_version_num(), 8, "an intent id");
    let early = charge_event("evt_1", "ch_1", 2500, reference);
    assert_eq!(webhook(&base, WEBHOOK_SECRET, now, &early).await?, (200, "captured".into()));
    let answered = api.await??;
    assert_eq!(
        (answered.status, answered.body["external_payment_id"].as_str()),
        (201, Some("ch_1")),
        "{}",
        answered.body
    );
    assert_eq!(webhook(&base, WEBHOOK_SECRET, now, &early).await?, (200, "duplicate".into()));
    standin.delay_ms.store(0, SeqCst);

    // late: the API captured first
    let late_body = card("pm_card_visa", "10.00");
    let late = charge(&base, "webhook-late-1", &late_body).await?;
    assert_eq!(late.status, 201);
    let late_ref: uuid::Uuid = late.body["id"].as_str().unwrap_or_default().parse()?;
    assert_eq!(late_ref.get_version_num(), 8, "the payment id is the derived intent id");
    assert_eq!(
        webhook(&base, WEBHOOK_SECRET, now, &charge_event("evt_2", "ch_2", 1000, late_ref)).await?,
        (200, "already_captured".into())
    );

    // a refund made at the provider's dashboard, delivered before its charge is captured here: 503, again later
    standin.delay_ms.store(700, SeqCst);
    let third_body = card("pm_card_visa", "8.00");
    let third = {
        let (base, body) = (base.clone(), third_body.clone());
        tokio::spawn(async move { charge(&base, "webhook-third-1", &body).await })
    };
    while standin.charges.load(SeqCst) < 3 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let made = standin.refund_from_dashboard("ch_3", 300);
    let early_refund = refund_event("evt_3", &made, "ch_3", 300, None);
    assert_eq!(webhook(&base, WEBHOOK_SECRET, now, &early_refund).await?.0, 503, "its charge is not captured yet");
    assert_eq!(third.await??.status, 201);
    standin.delay_ms.store(0, SeqCst);
    assert_eq!(webhook(&base, WEBHOOK_SECRET, now, &early_refund).await?, (200, "refunded".into()));
    assert_eq!(webhook(&base, WEBHOOK_SECRET, now, &early_refund).await?, (200, "duplicate".into()));

    // a refund through the API, then its webhook: one refund
    let payment = answered.body["id"].as_str().unwrap_or_default().to_owned();
    let refund = reqwest::Client::new()
        .post(format!("{base}/payments/{payment}/refund"))
        .bearer_auth(API_KEY)
        .header("idempotency-key", "webhook-refund-1")
        .json(&json!({"amount": "5.00"}))
        .send()
        .await?;
    assert_eq!(refund.status().as_u16(), 201);
    let refund: Value = refund.json().await?;
    let refund_id = uuid::Uuid::try_parse(refund["id"].as_str().unwrap_or_default())?;
    assert_eq!(standin.refunded_of("ch_1"), 500, "refunded at the provider");
    let echoed = refund_event("evt_4", "re_2", "ch_1", 500, Some(refund_id));
    assert_eq!(webhook(&base, WEBHOOK_SECRET, now, &echoed).await?, (200, "already_refunded".into()));

    assert_eq!(standin.charges.load(SeqCst), 3);
    assert_eq!(count_rows(&db, "SELECT count(*) FROM payment").await?, 3);
    assert_eq!(count_rows(&db, "SELECT count(*) FROM outbox_message WHERE type = 'PaymentCaptured'").await?, 3);
    assert_eq!(count_rows(&db, "SELECT count(*) FROM refund").await?, 2);
    let refunded: Vec<(String, i64)> = sqlx::query_as(
        "SELECT external_payment_id, (refunded_amount * 100)::bigint FROM payment WHERE refunded_amount > 0 ORDER BY 1",
    )
    .fetch_all(db.pool())
    .await?;
    assert_eq!(refunded, vec![("ch_1".to_owned(), 500), ("ch_3".to_owned(), 300)]);
    assert_money_conserved(&db, &standin).await
}

/// A refund through the provider whose answer was lost (the provider refunded, answered too late) is
/// retried under the same key: one refund at the provider, one in idem; a refund the provider refuses
/// (more than is left there) is stored and replayed.
#[tokio::test]
async fn a_refund_through_the_provider_is_retried_once_and_a_refusal_replayed() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let base = instance(&db.store, &provider, Duration::from_millis(400), Duration::from_secs(1)).await?;
    let paid = charge(&base, "refund-base-1", &card("pm_card_visa", "20.00")).await?;
    assert_eq!(paid.status, 201);
    let payment = paid.body["id"].as_str().unwrap_or_default().to_owned();
    let refund = |key: &'static str, amount: &'static str| {
        let (base, payment) = (base.clone(), payment.clone());
        async move {
            let resp = reqwest::Client::new()
                .post(format!("{base}/payments/{payment}/refund"))
                .bearer_auth(API_KEY)
                .header("idempotency-key", key)
                .json(&json!({"amount": amount}))
                .send()
                .await?;
            let status = resp.status().as_u16();
            Ok::<_, anyhow::Error>((status, resp.json::<Value>().await.unwrap_or(Value::Null)))
        }
    };
    standin.delay_ms.store(800, SeqCst);
    let lost = refund("refund-lost-1", "7.00").await?;
    assert_eq!(lost.0, 503, "{}", lost.1);
    assert_eq!(standin.refunded_of("ch_1"), 700, "the provider refunded");
    assert_eq!(count_rows(&db, "SELECT count(*) FROM refund").await?, 0);
    standin.delay_ms.store(0, SeqCst);
    let mut retried = refund("refund-lost-1", "7.00").await?;
    while retried.0 == 409 {
        // in flight until the unanswered attempt's lease lapsed
        tokio::time::sleep(Duration::from_millis(200)).await;
        retried = refund("refund-lost-1", "7.00").await?;
    }
    assert_eq!((retried.0, retried.1["refunded_amount"].as_str()), (201, Some("7.00")), "{}", retried.1);
    assert_eq!(standin.refunds_made.load(SeqCst), 1, "one refund at the provider");
    assert_eq!(count_rows(&db, "SELECT count(*) FROM refund").await?, 1);
    let again = refund("refund-lost-1", "7.00").await?;
    assert_eq!(again, retried, "replayed");

    // the rest refunded at the provider's dashboard (its webhook not here yet): the provider refuses more
    standin.refund_from_dashboard("ch_1", 1300);
    let calls = standin.calls.load(SeqCst);
    let refused = refund("refund-refused-1", "5.00").await?;
    assert_eq!(
        (refused.0, refused.1["type"].as_str()),
        (409, Some("urn:idem:problem:refund-not-allowed")),
        "{}",
        refused.1
    );
    assert_eq!(refund("refund-refused-1", "5.00").await?, refused, "the refusal is stored and replayed");
    assert_eq!(standin.calls.load(SeqCst), calls + 1, "asked once");
    assert_eq!(count_rows(&db, "SELECT count(*) FROM refund").await?, 1);
    Ok(())
}

async fn count_rows(db: &TestDb, sql: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sql).fetch_one(db.pool()).await?)
}

/// An `OrderPlaced` with a `payment_method`, delivered twice (a redelivery that reached the handler): the
/// event's transaction holds the request `POST /payments` under the key `order:<order_id>` for the
/// completer, which charges through the provider in phases keyed by the order — one charge, one captured
/// payment of the orders merchant; a service without a provider rejects such an event (dead letter).
#[tokio::test]
async fn an_order_with_a_payment_method_is_charged_once_through_the_completer() -> anyhow::Result<()> {
    use idem_domain::usecases::OrderEventHandler;
    use idem_http::completer::{Completer, CompleterSettings};
    use idem_ports::{EventHandler, HandlerError, InboundEvent};
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let router = reference_router(&db.store, &provider, Duration::from_secs(2), Duration::from_secs(30))?;
    let handler = |through_provider| OrderEventHandler {
        charges_through_provider: through_provider,
        clock: Arc::new(SystemClock),
        ids: Arc::new(UuidV7Generator),
        payments_topic: "payments".into(),
        merchant_id: "orders".into(),
        payments_of: idem_postgres::payments_of,
    };
    let order = uuid::Uuid::now_v7();
    let event = InboundEvent {
        event_id: uuid::Uuid::now_v7(),
        saga_id: None,
        topic: "orders".into(),
        partition: 0,
        offset: 0,
        key: Some(order.to_string().into_bytes()),
        headers: Vec::new(),
        payload:
            json!({"type": "OrderPlaced", "order_id": order, "customer_id": uuid::Uuid::now_v7(), "amount": "55.10",
                        "currency": "EUR", "payment_method": "pm_card_visa", "version": 1})
            .to_string()
            .into_bytes(),
    };
    let mut uow = db.store.begin().await?;
    let refused = handler(false).handle(uow.as_mut(), &event).await;
    assert!(matches!(refused, Err(HandlerError::Rejected(_))), "{refused:?}");
    drop(uow);
    for _ in 0..2 {
        let mut uow = db.store.begin().await?;
        handler(true).handle(uow.as_mut(), &event).await?;
        uow.commit().await?;
    }
    assert_eq!(db.store.held_records(false, 10).await?.len(), 1, "held once, for the completer");
    let settings = CompleterSettings { grace: Duration::ZERO, ..CompleterSettings::default() };
    let completer = Completer::new(
        Arc::new(db.store.clone()),
        Arc::new(SystemClock),
        router,
        idem_http::merchant_principal(),
        settings,
    );
    assert_eq!(completer.round().await?.completed, 1);
    assert_eq!(completer.round().await?.completed, 0, "nothing left");
    assert_eq!(standin.charges.load(SeqCst), 1);
    let generation: Option<i64> = sqlx::query_scalar("SELECT generation FROM idempotency_record WHERE key = $1")
        .bind(format!("order:{order}"))
        .fetch_one(db.pool())
        .await?;
    assert!(generation.is_some(), "the held charge records its generation");
    let named = idem_domain::phases::generational_key(&format!("order:{order}"), generation).into_owned();
    let key = idem_domain::phases::downstream_key("orders", &named, "charge");
    assert_eq!(standin.charges_for(&key), 1, "the provider saw the downstream key of the event's charge step");
    let (merchant, status): (String, String) =
        sqlx::query_as("SELECT merchant_id, status FROM payment").fetch_one(db.pool()).await?;
    assert_eq!((merchant.as_str(), status.as_str()), ("orders", "captured"));
    assert_money_conserved(&db, &standin).await
}

/// Issue 44: an unauthenticated webhook cost seconds of CPU on the async workers (thousands of `v1`
/// entries, each a MAC over a 2 MB body), stalling every route. The route reads at most 256 KiB (`413`
/// beyond, before any MAC), takes at most four `v1`s, and computes one MAC: three worst-case requests at once
/// leave `/healthz` answering promptly.
#[tokio::test]
async fn hostile_webhooks_cost_one_mac_and_leave_the_service_answering() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (_standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let router = reference_router(&db.store, &provider, Duration::from_secs(2), Duration::from_secs(30))?
        .route("/healthz", axum::routing::get(|| async { "ok" }));
    let base = idem_tests::serve(router).await?;
    let now = chrono::Utc::now().timestamp();
    let junk = move |n: usize| {
        let mut h = format!("t={now}");
        for _ in 0..n {
            h.push_str(&format!(",v1={}", "ab".repeat(32)));
        }
        h
    };
    let target = base.clone();
    let post = move |body: Vec<u8>, header: String| {
        let base = target.clone();
        async move {
            let resp = reqwest::Client::new()
                .post(format!("{base}/webhooks/payment-provider"))
                .header("provider-signature", header)
                .body(body)
                .send()
                .await?;
            Ok::<_, anyhow::Error>(resp.status().as_u16())
        }
    };
    // the review's request: 2 MB and as many entries as a 16 KiB head holds
    assert_eq!(post(vec![b' '; 2 << 20], junk(200)).await?, 413, "a body over the webhook's own limit");
    assert_eq!(post(vec![b' '; 1024], junk(5)).await?, 400, "more than four signatures");
    let worst = move || post.clone()(vec![b' '; idem_http::webhooks::MAX_BODY], junk(4));
    let started = std::time::Instant::now();
    let hostile = tokio::spawn(async move {
        let (a, b, c) = tokio::join!(worst(), worst(), worst());
        Ok::<_, anyhow::Error>([a?, b?, c?])
    });
    let mut slowest = Duration::ZERO;
    while !hostile.is_finished() {
        let asked = std::time::Instant::now();
        let ok = reqwest::get(format!("{base}/healthz")).await?.status().as_u16();
        assert_eq!(ok, 200);
        slowest = slowest.max(asked.elapsed());
    }
    assert_eq!(hostile.await??, [401, 401, 401], "well formed, wrong signatures");
    // before: ~8.5 s per /healthz beside three such requests; a MAC over 256 KiB takes about a millisecond
    assert!(slowest < Duration::from_secs(1), "/healthz took {slowest:?} beside hostile webhooks");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    Ok(())
}

/// Issue 44: a merchant recorded, with the platform's key, a charge made outside idem under the configured
/// provider's name and refunded it: the provider received the refund. The recording flow now refuses the
/// provider's name, and a payment idem did not charge itself (a row from before, an order event) is
/// refunded in idem only — the provider receives nothing.
#[tokio::test]
async fn a_charge_idem_did_not_make_is_never_refunded_at_the_provider() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let base = instance(&db.store, &provider, Duration::from_secs(2), Duration::from_secs(30)).await?;
    let foreign = json!({
        "order_id": uuid::Uuid::now_v7(), "customer_id": uuid::Uuid::now_v7(), "provider": "standin",
        "external_payment_id": "ch_made_elsewhere", "amount": "500.00", "currency": "EUR",
    });
    let recorded = charge(&base, "foreign-1", &foreign).await?;
    assert_eq!(recorded.status, 422, "{}", recorded.body);
    assert!(recorded.raw.windows(8).any(|w| w == b"provider"), "names the field: {}", recorded.body);
    // a payment under the provider's name that idem did not charge (recorded before this rule)
    let id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO payment (id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                              currency, status, created_at, updated_at)
         VALUES ($1, 'merchant_a', $2, $3, 'standin', 'ch_made_elsewhere', 500, 'EUR', 'captured', now(), now())",
    )
    .bind(id)
    .bind(uuid::Uuid::now_v7())
    .bind(uuid::Uuid::now_v7())
    .execute(db.pool())
    .await?;
    let refund = reqwest::Client::new()
        .post(format!("{base}/payments/{id}/refund"))
        .bearer_auth(API_KEY)
        .header("idempotency-key", "foreign-refund-1")
        .json(&json!({"amount": "500.00"}))
        .send()
        .await?;
    assert_eq!(refund.status().as_u16(), 201);
    assert_eq!(standin.calls.load(SeqCst), 0, "the provider was asked to refund a charge idem did not make");
    // a charge idem made is still refunded at the provider
    let charged = charge(&base, "own-1", &card("pm_card_visa", "10.00")).await?;
    assert_eq!(charged.status, 201, "{}", charged.body);
    let own = charged.body["id"].as_str().unwrap_or_default().to_owned();
    let refund = reqwest::Client::new()
        .post(format!("{base}/payments/{own}/refund"))
        .bearer_auth(API_KEY)
        .header("idempotency-key", "own-refund-1")
        .json(&json!({"amount": "10.00"}))
        .send()
        .await?;
    assert_eq!(refund.status().as_u16(), 201);
    assert_eq!(standin.refunds_made.load(SeqCst), 1);
    // an instance on the same database without the provider configured never refunds it in idem only
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let bare = api_state(&db.store, Arc::new(SystemClock), None);
    let config = IdempotencyConfig::new(TtlPolicy::new(Duration::from_secs(48 * 3600))?, idem_http::merchant_scope());
    let keys = Arc::new(ApiKeys::parse(&format!("merchant_a:{API_KEY}")).map_err(anyhow::Error::msg)?);
    let without =
        idem_tests::serve(idem_http::router(bare, keys, IdempotencyLayer::new(tm, Arc::new(SystemClock), config)))
            .await?;
    let charged_again = charge(&base, "own-2", &card("pm_card_visa", "3.00")).await?;
    let second = charged_again.body["id"].as_str().unwrap_or_default().to_owned();
    let refused = reqwest::Client::new()
        .post(format!("{without}/payments/{second}/refund"))
        .bearer_auth(API_KEY)
        .header("idempotency-key", "own-refund-2")
        .json(&json!({}))
        .send()
        .await?;
    assert_eq!(refused.status().as_u16(), 503, "refunded in idem only by an instance without the provider");
    let refunded: i64 = sqlx::query_scalar("SELECT count(*) FROM refund WHERE payment_id = $1")
        .bind(uuid::Uuid::parse_str(&second)?)
        .fetch_one(db.pool())
        .await?;
    assert_eq!(refunded, 0);
    let own_charge = charged.body["external_payment_id"].as_str().unwrap_or_default().to_owned();
    assert_eq!(standin.refunded_of(&own_charge), 1000, "{}", charged.body);
    Ok(())
}

/// Issue 44: 50 retries of one key produced 50 provider calls in 2.4 s, each answered `Retry-After: 1`
/// whatever the provider asked. The record keeps the provider's `Retry-After` on the database's clock: a
/// retry before it is `503` with the time left and sends nothing.
#[tokio::test]
async fn retries_of_one_key_wait_for_the_providers_retry_after() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let base = instance(&db.store, &provider, Duration::from_secs(2), Duration::from_secs(30)).await?;
    standin.fail_status.store(503, SeqCst);
    standin.fail_retry_after.store(5, SeqCst);
    standin.failures.store(1000, SeqCst);
    let body = card("pm_card_visa", "12.00");
    let mut waits = Vec::new();
    for _ in 0..50 {
        let reply = charge(&base, "storm-1", &body).await?;
        assert_eq!(reply.status, 503, "{}", reply.body);
        waits.push(reply.retry_after.unwrap_or_default());
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert!(standin.calls.load(SeqCst) <= 2, "{} provider calls for one key", standin.calls.load(SeqCst));
    assert_eq!(waits[0], 5, "the provider's Retry-After, not 1");
    assert!(waits.iter().all(|w| (1..=5).contains(w)), "{waits:?}");
    // held records store the request without its padding
    let padded = format!("{}{}", " ".repeat(60_000), serde_json::to_string(&card("pm_card_visa", "1.00"))?);
    let sent = reqwest::Client::new()
        .post(format!("{base}/payments"))
        .bearer_auth(API_KEY)
        .header("idempotency-key", "padded-1")
        .header("content-type", "application/json")
        .body(padded)
        .send()
        .await?;
    assert_eq!(sent.status().as_u16(), 503);
    let stored: i32 = sqlx::query_scalar("SELECT length(request_body) FROM idempotency_record WHERE key = 'padded-1'")
        .fetch_one(db.pool())
        .await?;
    assert!(stored < 1_000, "stored {stored} bytes of a padded body");
    Ok(())
}

/// Issue 45: a host whose clock is 40 s ahead took over a live lease with default settings (the lease was
/// compared with the host's clock) and called the provider while the first call still ran. Leases are
/// written and compared on the database's clock: the skewed instance is told the request is in flight,
/// and the provider sees one call.
#[tokio::test]
async fn a_host_whose_clock_is_ahead_never_takes_over_a_live_lease() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let lease = Duration::from_secs(30);
    let base = instance(&db.store, &provider, Duration::from_secs(5), lease).await?;
    let ahead = Arc::new(idem_tests::effects::ShiftedClock::new());
    ahead.advance(chrono::Duration::seconds(40));
    let skewed =
        idem_tests::serve(reference_router_on(&db.store, &provider, Duration::from_secs(5), lease, ahead, None)?)
            .await?;
    standin.delay_ms.store(1_500, SeqCst);
    let body = card("pm_card_visa", "40.00");
    let first = tokio::spawn({
        let (base, body) = (base.clone(), body.clone());
        async move { charge(&base, "skew-1", &body).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await; // the first call is out
    let second = charge(&skewed, "skew-1", &body).await?;
    assert_eq!(second.status, 409, "the skewed host: {}", second.body);
    let first = first.await??;
    assert_eq!(first.status, 201, "{}", first.body);
    assert_eq!(standin.calls.load(SeqCst), 1, "calls at the provider for one key");
    assert_money_conserved(&db, &standin).await
}

/// Issue 45: after the provider charged, a failure of the second phase was answered `503
/// service-unavailable` ("nothing was executed"). Once a call may have been sent, every failure is `503
/// outcome-unknown`; the retry records the provider's first charge: one charge.
#[tokio::test]
async fn a_second_phase_that_fails_after_the_charge_answers_outcome_unknown() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let base = instance(&db.store, &provider, Duration::from_secs(1), Duration::from_secs(3)).await?;
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_capture() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN IF NEW.status = 'captured' AND NEW.amount = 66.66 THEN RAISE EXCEPTION 'injected'; END IF;
         RETURN NEW; END $$;
         CREATE TRIGGER refuse_capture BEFORE UPDATE ON payment FOR EACH ROW EXECUTE FUNCTION refuse_capture();",
    )
    .execute(db.pool())
    .await?;
    let body = card("pm_card_visa", "66.66");
    let failed = charge(&base, "second-phase-1", &body).await?;
    assert_eq!(failed.status, 503, "{}", failed.body);
    assert_eq!(failed.body["type"], "urn:idem:problem:outcome-unknown", "{}", failed.body);
    assert_eq!(standin.charges.load(SeqCst), 1, "the provider charged");
    sqlx::raw_sql("DROP TRIGGER refuse_capture ON payment").execute(db.pool()).await?;
    // the lease (3 s) lapses, then the retry resumes with the same downstream key
    let mut retried = charge(&base, "second-phase-1", &body).await?;
    for _ in 0..40 {
        if retried.status != 409 && retried.status != 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        retried = charge(&base, "second-phase-1", &body).await?;
    }
    assert_eq!(retried.status, 201, "{}", retried.body);
    assert_eq!(standin.charges.load(SeqCst), 1, "one charge for one key");
    assert_money_conserved(&db, &standin).await
}

/// Review of issue 44's change: a retry while the live attempt's second phase holds the record's row lock
/// waited for the claim's bounded lock wait and was answered `503 service-unavailable` ("not executed")
/// while the charge was being recorded. It is in flight: `409`.
#[tokio::test]
async fn a_retry_behind_a_locked_second_phase_is_in_flight() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let base = instance(&db.store, &provider, Duration::from_secs(2), Duration::from_secs(30)).await?;
    standin.delay_ms.store(1_000, SeqCst);
    let body = card("pm_card_visa", "5.00");
    let first = tokio::spawn({
        let (base, body) = (base.clone(), body.clone());
        async move { charge(&base, "locked-1", &body).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // the record's row locked as a second phase locks it, longer than the claim's wait (2 s)
    let mut locker = db.pool().begin().await?;
    sqlx::query("SELECT 1 FROM idempotency_record WHERE key = 'locked-1' FOR UPDATE").execute(&mut *locker).await?;
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        locker.rollback().await
    });
    let retry = charge(&base, "locked-1", &body).await?;
    assert_eq!(retry.status, 409, "{}", retry.body);
    release.await??;
    assert_eq!(first.await??.status, 201);
    assert_eq!(standin.charges.load(SeqCst), 1);
    Ok(())
}

/// Issue 45.1: a call starts only while its attempt holds at least the call's bound of its lease, on the
/// database's clock, confirmed after the first phase committed. With a lease shorter than the bound (a
/// commit that waited about a lease looks the same), the attempt answers without sending anything.
#[tokio::test]
async fn a_call_starts_only_with_its_bound_left_of_the_lease() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let router = |call_bound: Duration| -> anyhow::Result<axum::Router> {
        let provider: Arc<dyn PaymentProvider> =
            Arc::new(HttpPaymentProvider::new("standin", &provider, PROVIDER_KEY, Duration::from_secs(1))?);
        let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
        let state = api_state(&db.store, Arc::new(SystemClock), Some(provider));
        let mut config =
            IdempotencyConfig::new(TtlPolicy::new(Duration::from_secs(48 * 3600))?, idem_http::merchant_scope());
        config.lease = Duration::from_secs(2);
        config.call_bound = call_bound;
        let keys = Arc::new(ApiKeys::parse(&format!("merchant_a:{API_KEY}")).map_err(anyhow::Error::msg)?);
        Ok(idem_http::router(state, keys, IdempotencyLayer::new(tm, Arc::new(SystemClock), config)))
    };
    let short = idem_tests::serve(router(Duration::from_secs(5))?).await?;
    let body = card("pm_card_visa", "8.00");
    let refused = charge(&short, "bound-1", &body).await?;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.body["type"], "urn:idem:problem:outcome-unknown");
    assert_eq!(standin.calls.load(SeqCst), 0, "a call sent without its bound left of the lease");
    // with the bound inside the lease, the retry calls once
    let fits = idem_tests::serve(router(Duration::from_millis(1500))?).await?;
    let charged = charge(&fits, "bound-1", &body).await?;
    assert_eq!(charged.status, 201, "{}", charged.body);
    assert_eq!(standin.calls.load(SeqCst), 1);
    Ok(())
}

/// An order event for `order` of the orders stream (`saga`: its `saga_id` header).
fn order_event(order: uuid::Uuid, saga: Option<uuid::Uuid>, payload: Value) -> idem_ports::InboundEvent {
    idem_ports::InboundEvent {
        event_id: uuid::Uuid::now_v7(),
        saga_id: saga,
        topic: "orders".into(),
        partition: 0,
        offset: 0,
        key: Some(order.to_string().into_bytes()),
        headers: Vec::new(),
        payload: payload.to_string().into_bytes(),
    }
}

/// Issue 45.4: compensating a cancelled order whose payment was charged through the provider recorded a
/// refund in idem only (the provider never asked: money kept), and an `OrderCancelled` that arrived before
/// the completer charged finished "skipped" — then the completer charged the card. Now, counted at the
/// provider: cancelled **before** the call, nothing is ever charged; **between** the phases, the
/// cancellation waits (retried) until the charge is final, then the provider refunds it; **after**, the
/// provider refunds it. `PaymentRefunded` only once the provider confirmed.
#[tokio::test]
async fn a_cancelled_order_is_never_charged_after_and_its_charge_is_refunded_at_the_provider() -> anyhow::Result<()> {
    use idem_domain::usecases::OrderEventHandler;
    use idem_http::completer::{Completer, CompleterSettings};
    use idem_ports::{EventHandler, HandlerError};
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let router = reference_router(&db.store, &provider, Duration::from_secs(5), Duration::from_secs(30))?;
    let handler = OrderEventHandler {
        charges_through_provider: true,
        clock: Arc::new(SystemClock),
        ids: Arc::new(UuidV7Generator),
        payments_topic: "payments".into(),
        merchant_id: "orders".into(),
        payments_of: idem_postgres::payments_of,
    };
    let completer = Completer::new(
        Arc::new(db.store.clone()),
        Arc::new(SystemClock),
        router,
        idem_http::merchant_principal(),
        CompleterSettings { grace: Duration::ZERO, ..CompleterSettings::default() },
    );
    let apply = |event: idem_ports::InboundEvent| {
        let (store, handler) = (db.store.clone(), handler.clone());
        async move {
            let mut uow = store.begin().await?;
            let applied = handler.handle(uow.as_mut(), &event).await;
            if applied.is_ok() {
                uow.commit().await?;
            }
            Ok::<_, anyhow::Error>(applied)
        }
    };
    let placed = |order, amount: &str| {
        order_event(
            order,
            None,
            json!({"type": "OrderPlaced", "order_id": order, "customer_id": uuid::Uuid::now_v7(),
            "amount": amount, "currency": "EUR", "payment_method": "pm_card_visa", "version": 1}),
        )
    };
    let cancelled = |order| {
        order_event(
            order,
            Some(uuid::Uuid::now_v7()),
            json!({"type": "OrderCancelled", "order_id": order, "version": 2}),
        )
    };

    // before: the held charge is cancelled under its record's lock; the completer never sends it
    let before = uuid::Uuid::now_v7();
    apply(placed(before, "10.00")).await??;
    apply(cancelled(before)).await??;
    assert_eq!(completer.round().await?.completed, 0);
    assert_eq!(standin.calls.load(SeqCst), 0, "a cancelled order was charged");

    // between: the charge is out; the cancellation waits until it is final, then the provider refunds it
    let between = uuid::Uuid::now_v7();
    apply(placed(between, "20.00")).await??;
    standin.delay_ms.store(1_500, SeqCst);
    let round = tokio::spawn({
        let completer = completer.clone();
        async move { completer.round().await }
    });
    while standin.calls.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cancel = cancelled(between);
    let waited = apply(cancel.clone()).await?;
    assert!(matches!(waited, Err(HandlerError::Store(_))), "a transient wait, retried: {waited:?}");
    assert_eq!(round.await??.completed, 1, "the charge completed");
    standin.delay_ms.store(0, SeqCst);
    apply(cancel).await??;
    assert_eq!(standin.refunds_made.load(SeqCst), 0, "nothing refunded before the completer sends the refund");
    let outbox = |kind: &'static str| {
        let pool = db.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox_message WHERE type = $1")
                .bind(kind)
                .fetch_one(&pool)
                .await
        }
    };
    assert_eq!(outbox("PaymentRefunded").await?, 0, "announced before the provider confirmed");
    assert_eq!(completer.round().await?.completed, 1, "the refund, through the provider");
    assert_eq!(standin.refunds_made.load(SeqCst), 1);

    // after: charged, then cancelled: refunded at the provider
    let after = uuid::Uuid::now_v7();
    apply(placed(after, "30.00")).await??;
    assert_eq!(completer.round().await?.completed, 1);
    apply(cancelled(after)).await??;
    assert_eq!(completer.round().await?.completed, 1);
    assert_eq!(standin.refunds_made.load(SeqCst), 2);
    assert_eq!(standin.charges.load(SeqCst), 2, "the orders charged: between and after");
    let refunded: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, (refunded_amount * 100)::bigint FROM payment ORDER BY amount")
            .fetch_all(db.pool())
            .await?;
    assert_eq!(refunded, vec![("refunded".to_owned(), 2000), ("refunded".to_owned(), 3000)]);
    for (charge, _, _) in standin.charges_made() {
        let minor: i64 =
            sqlx::query_scalar("SELECT (amount * 100)::bigint FROM payment WHERE external_payment_id = $1")
                .bind(&charge)
                .fetch_one(db.pool())
                .await?;
        assert_eq!(standin.refunded_of(&charge), minor, "refunded at the provider: {charge}");
    }
    assert_eq!(outbox("PaymentRefunded").await?, 2);
    Ok(())
}

/// Issue 45.3: `COMPLETER_WINDOW` was checked only by the completer. A client retrying through a provider
/// outage longer than the provider's key window took the record over on every retry, and the first retry
/// after the window was charged again under a key the provider had forgotten (two charges). The window is
/// the layer's: past it a call is never sent again under the old key — its outcome is looked up by
/// reference: found, the second phase records that charge; not found, the request is parked.
#[tokio::test]
async fn past_the_providers_window_a_retry_looks_the_charge_up_and_never_sends_it_again() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let window = Some(Duration::from_secs(2));
    let router = reference_router_on(
        &db.store,
        &provider,
        Duration::from_millis(500),
        Duration::from_secs(2),
        Arc::new(SystemClock),
        window,
    )?;
    let base = idem_tests::serve(router).await?;
    let retry_until = |key: &'static str, body: Value, until: std::time::Instant| {
        let base = base.clone();
        async move {
            let mut last = charge(&base, key, &body).await?;
            while std::time::Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(300)).await;
                last = charge(&base, key, &body).await?;
            }
            Ok::<_, anyhow::Error>(last)
        }
    };

    // 1. charged, its answer lost (later than the call's bound); the provider forgets the key after its
    //    window; the retry past the window finds the charge instead of making a second one
    standin.delay_ms.store(800, SeqCst);
    let lost = card("pm_card_visa", "70.00");
    let first = charge(&base, "window-lost-1", &lost).await?;
    assert_eq!(first.status, 503, "{}", first.body);
    standin.delay_ms.store(0, SeqCst);
    tokio::time::sleep(Duration::from_millis(2_600)).await; // the lease and the window passed
    standin.forget_keys();
    let found = retry_until("window-lost-1", lost.clone(), std::time::Instant::now()).await?;
    assert_eq!(found.status, 201, "{}", found.body);
    assert_eq!(standin.charges.load(SeqCst), 1, "charged again under a forgotten key");
    assert!(standin.lookups.load(SeqCst) >= 1, "looked up");

    // 2. an outage longer than the window, the client retrying every 300 ms: never charged past the window;
    //    not found there, the request is parked (and stays so for further retries)
    standin.fail_status.store(503, SeqCst);
    standin.fail_retry_after.store(1, SeqCst);
    standin.failures.store(1_000, SeqCst);
    let outage = card("pm_card_visa", "80.00");
    let during =
        retry_until("window-outage-1", outage.clone(), std::time::Instant::now() + Duration::from_secs(3)).await?;
    assert_eq!(during.status, 503, "{}", during.body);
    standin.failures.store(0, SeqCst);
    standin.forget_keys();
    let calls = standin.calls.load(SeqCst);
    let after = retry_until("window-outage-1", outage, std::time::Instant::now() + Duration::from_secs(1)).await?;
    assert_eq!(after.status, 503, "{}", after.body);
    assert!(after.body["detail"].as_str().unwrap_or_default().contains("parked"), "{}", after.body);
    assert_eq!(standin.calls.load(SeqCst), calls, "a call sent past the window");
    assert_eq!(standin.charges.load(SeqCst), 1);
    assert_eq!(db.store.health().await?.parked_records, 1);
    assert_money_conserved(&db, &standin).await
}

/// Issue 45.6: a key reused after its record expired named the earlier request's rows — a charge answered
/// `201` with the earlier payment and charged nothing; a refund answered `201` with the earlier refund of
/// another payment and refunded nothing. Names derive from the claim's generation: a reused key makes a
/// new payment (a new charge at the provider under a new downstream key) and a new refund.
#[tokio::test]
async fn a_key_reused_after_its_record_expired_names_new_rows() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let base = instance(&db.store, &provider, Duration::from_secs(2), Duration::from_secs(30)).await?;
    let expire = |key: &'static str| {
        let pool = db.pool().clone();
        async move {
            sqlx::query("UPDATE idempotency_record SET expires_at = now() - interval '1 minute' WHERE key = $1")
                .bind(key)
                .execute(&pool)
                .await
        }
    };
    let refund = |payment: String, amount: &'static str| {
        let base = base.clone();
        async move {
            let resp = reqwest::Client::new()
                .post(format!("{base}/payments/{payment}/refund"))
                .bearer_auth(API_KEY)
                .header("idempotency-key", "reused-refund-1")
                .json(&json!({"amount": amount}))
                .send()
                .await?;
            let status = resp.status().as_u16();
            Ok::<_, anyhow::Error>((status, resp.json::<Value>().await.unwrap_or(Value::Null)))
        }
    };
    let body = card("pm_card_visa", "12.00");
    let first = charge(&base, "reused-charge-1", &body).await?;
    assert_eq!(first.status, 201, "{}", first.body);
    expire("reused-charge-1").await?;
    let second = charge(&base, "reused-charge-1", &body).await?;
    assert_eq!(second.status, 201, "{}", second.body);
    assert_ne!(second.body["id"], first.body["id"], "the earlier payment answered for a new charge");
    assert_eq!(standin.charges.load(SeqCst), 2, "the reused key's charge made no charge");

    let p1 = first.body["id"].as_str().unwrap_or_default().to_owned();
    let p2 = second.body["id"].as_str().unwrap_or_default().to_owned();
    let (status, r1) = refund(p1.clone(), "5.00").await?;
    assert_eq!(status, 201, "{r1}");
    expire("reused-refund-1").await?;
    let (status, r2) = refund(p2.clone(), "7.00").await?;
    assert_eq!(status, 201, "{r2}");
    assert_eq!(r2["payment_id"], p2.as_str(), "the earlier refund of another payment answered: {r2}");
    assert_ne!(r2["id"], r1["id"]);
    assert_eq!(standin.refunds_made.load(SeqCst), 2, "the reused key's refund refunded nothing");
    assert_money_conserved(&db, &standin).await
}

/// Review of issue 45.4: a charge held under the earlier key scheme (`event:<event_id>`, written by an
/// instance of the previous version during a rolling deploy) was not found by a cancellation, which
/// finished "skipped", and the completer then charged the cancelled order. It is found by its order id and
/// cancelled too.
#[tokio::test]
async fn a_charge_held_under_the_earlier_key_is_cancelled_too() -> anyhow::Result<()> {
    use idem_domain::usecases::OrderEventHandler;
    use idem_http::completer::{Completer, CompleterSettings};
    use idem_ports::EventHandler;
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let router = reference_router(&db.store, &provider, Duration::from_secs(5), Duration::from_secs(30))?;
    let order = uuid::Uuid::now_v7();
    let body = json!({"order_id": order, "customer_id": uuid::Uuid::now_v7(), "amount": "9.00", "currency": "EUR",
                      "payment_method": "pm_card_visa"})
    .to_string()
    .into_bytes();
    let now = chrono::Utc::now();
    let mut uow = db.store.begin().await?;
    let held = idem_ports::HeldRequest {
        scope: "orders".into(),
        key: format!("event:{}", uuid::Uuid::now_v7()),
        command_hash: *idem_domain::Fingerprint::of_request("POST", "/payments", &body).as_bytes(),
        request: idem_ports::StoredRequest {
            method: "POST".into(),
            uri: "/payments".into(),
            content_type: Some("application/json".into()),
            body,
        },
        created_at: now,
        expires_at: now + chrono::Duration::hours(48),
    };
    assert!(uow.idempotency().enqueue_held(&held).await?);
    uow.commit().await?;
    let handler = OrderEventHandler {
        charges_through_provider: true,
        clock: Arc::new(SystemClock),
        ids: Arc::new(UuidV7Generator),
        payments_topic: "payments".into(),
        merchant_id: "orders".into(),
        payments_of: idem_postgres::payments_of,
    };
    let cancel = order_event(
        order,
        Some(uuid::Uuid::now_v7()),
        json!({"type": "OrderCancelled", "order_id": order, "version": 2}),
    );
    let mut uow = db.store.begin().await?;
    handler.handle(uow.as_mut(), &cancel).await?;
    uow.commit().await?;
    let completer = Completer::new(
        Arc::new(db.store.clone()),
        Arc::new(SystemClock),
        router,
        idem_http::merchant_principal(),
        CompleterSettings { grace: Duration::ZERO, ..CompleterSettings::default() },
    );
    completer.round().await?;
    assert_eq!(standin.calls.load(SeqCst), 0, "the cancelled order was charged");
    Ok(())
}

/// Issue 45.9: the completer took the oldest held records first, so one merchant's backlog delayed every
/// other merchant's held request by as many rounds as the backlog had batches. Rounds are round-robin over
/// merchants: another merchant's one held request is finished in the first round beside 40 of one merchant.
#[tokio::test]
async fn the_completer_is_fair_between_merchants() -> anyhow::Result<()> {
    use idem_http::completer::{Completer, CompleterSettings};
    let db = TestDb::new().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let router = reference_router(&db.store, &provider, Duration::from_secs(5), Duration::from_secs(30))?;
    let hold = |scope: &'static str, key: String| {
        let store = db.store.clone();
        async move {
            let body = serde_json::to_vec(&card("pm_card_visa", "1.00"))?;
            let now = chrono::Utc::now();
            let mut uow = store.begin().await?;
            let held = idem_ports::HeldRequest {
                scope: scope.into(),
                key,
                command_hash: *idem_domain::Fingerprint::of_request("POST", "/payments", &body).as_bytes(),
                request: idem_ports::StoredRequest {
                    method: "POST".into(),
                    uri: "/payments".into(),
                    content_type: Some("application/json".into()),
                    body,
                },
                created_at: now,
                expires_at: now + chrono::Duration::hours(48),
            };
            anyhow::ensure!(uow.idempotency().enqueue_held(&held).await?);
            uow.commit().await?;
            Ok::<_, anyhow::Error>(())
        }
    };
    for n in 0..40 {
        hold("merchant_a", format!("backlog-{n}")).await?;
    }
    hold("merchant_b", "the-other-1".into()).await?; // the newest of all
    let completer = Completer::new(
        Arc::new(db.store.clone()),
        Arc::new(SystemClock),
        router,
        idem_http::merchant_principal(),
        CompleterSettings { grace: Duration::ZERO, ..CompleterSettings::default() },
    );
    let round = completer.round().await?;
    assert_eq!(round.completed, 16, "{round:?}");
    let done: String = sqlx::query_scalar("SELECT state FROM idempotency_record WHERE key = 'the-other-1'")
        .fetch_one(db.pool())
        .await?;
    assert_eq!(done, "completed", "merchant_b waited behind merchant_a's backlog");
    assert_eq!(standin.charges.load(SeqCst), 16);
    Ok(())
}

/// Issue 45.10: a reconciler. Against the stand-in: a charge made elsewhere with a reference idem does not
/// have, a refund made at the provider's dashboard, a payment whose charge differs in amount, a pending
/// payment whose charge exists (its answer was lost), and a payment captured in idem that the provider does
/// not list. The safe ones are repaired as a webhook would (once: a second run repairs nothing again), the
/// rest reported.
#[tokio::test]
async fn the_reconciler_repairs_what_is_safe_and_reports_the_rest() -> anyhow::Result<()> {
    use idem_http::reconcile::{FindingKind, Reconciler};
    let db = TestDb::new().await?;
    let (standin, provider_base) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let base = instance(&db.store, &provider_base, Duration::from_millis(500), Duration::from_secs(30)).await?;
    let provider: Arc<dyn PaymentProvider> =
        Arc::new(HttpPaymentProvider::new("standin", &provider_base, PROVIDER_KEY, Duration::from_secs(2))?);
    let api = api_state(&db.store, Arc::new(SystemClock), Some(provider.clone()));
    let reconciler = Reconciler::new(api, provider);
    let since = chrono::Utc::now() - chrono::Duration::hours(24);

    let ok = charge(&base, "rec-ok-1", &card("pm_card_visa", "10.00")).await?;
    assert_eq!(ok.status, 201, "{}", ok.body);
    let orphan = standin.charge_elsewhere(&uuid::Uuid::now_v7().to_string(), 500);
    let ok_charge = ok.body["external_payment_id"].as_str().unwrap_or_default().to_owned();
    let dashboard = standin.refund_from_dashboard(&ok_charge, 300);
    // a payment captured through the provider whose charge is for another amount
    let differs = uuid::Uuid::now_v7();
    let differs_charge = standin.charge_elsewhere(&differs.to_string(), 999);
    // a pending payment whose charge at the provider is for another amount: never captured with it
    let pending_differs = uuid::Uuid::now_v7();
    let pending_differs_charge = standin.charge_elsewhere(&pending_differs.to_string(), 999);
    sqlx::query(
        "INSERT INTO payment (id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                              currency, status, created_at, updated_at, through_provider)
         VALUES ($1, 'merchant_a', $2, $3, 'standin', NULL, 10, 'EUR', 'pending', now() - interval '1 hour',
                 now(), true)",
    )
    .bind(pending_differs)
    .bind(uuid::Uuid::now_v7())
    .bind(uuid::Uuid::now_v7())
    .execute(db.pool())
    .await?;
    let missing = uuid::Uuid::now_v7();
    for (id, external) in [(differs, differs_charge.clone()), (missing, "ch_never_made".to_owned())] {
        sqlx::query(
            "INSERT INTO payment (id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                                  currency, status, created_at, updated_at, through_provider)
             VALUES ($1, 'merchant_a', $2, $3, 'standin', $4, 10, 'EUR', 'captured', now() - interval '1 hour',
                     now(), true)",
        )
        .bind(id)
        .bind(uuid::Uuid::now_v7())
        .bind(uuid::Uuid::now_v7())
        .bind(external)
        .execute(db.pool())
        .await?;
    }
    // a charge whose answer was lost: the payment stays pending, the provider charged
    standin.delay_ms.store(900, SeqCst);
    let lost = charge(&base, "rec-lost-1", &card("pm_card_visa", "7.00")).await?;
    assert_eq!(lost.status, 503, "{}", lost.body);
    standin.delay_ms.store(0, SeqCst);
    tokio::time::sleep(Duration::from_millis(600)).await;

    let report = reconciler.run(since).await?;
    let of = |kind: FindingKind| {
        report
            .findings
            .iter()
            .filter(|f| f.kind == kind)
            .map(|f| f.provider_id.clone().unwrap_or_default())
            .collect::<Vec<_>>()
    };
    assert_eq!(of(FindingKind::ChargeWithoutPayment), vec![orphan], "{report:#?}");
    assert_eq!(of(FindingKind::RecordedRefund), vec![dashboard], "{report:#?}");
    let mut differing = of(FindingKind::AmountDiffers);
    differing.sort();
    let mut expected = vec![differs_charge.clone(), pending_differs_charge.clone()];
    expected.sort();
    assert_eq!(differing, expected, "{report:#?}");
    assert_eq!(of(FindingKind::PaymentWithoutCharge), vec!["ch_never_made".to_owned()], "{report:#?}");
    assert_eq!(report.count(FindingKind::CapturedPending), 1, "{report:#?}");
    let statuses: Vec<(String, i64)> = sqlx::query_as(
        "SELECT status, (refunded_amount * 100)::bigint FROM payment
         WHERE through_provider AND id <> $1 ORDER BY amount, status",
    )
    .bind(pending_differs)
    .fetch_all(db.pool())
    .await?;
    assert!(!statuses.iter().any(|(s, _)| s == "pending"), "the pending payment was captured: {statuses:?}");
    assert!(statuses.contains(&("partially_refunded".to_owned(), 300)), "the dashboard refund: {statuses:?}");
    // repairs happen once
    let again = reconciler.run(since).await?;
    assert_eq!(again.count(FindingKind::CapturedPending) + again.count(FindingKind::RecordedRefund), 0, "{again:#?}");
    assert_eq!(again.count(FindingKind::ChargeWithoutPayment), 1);
    // review: a refused repair is reported again, never counted as repaired on the next run
    let mut still: Vec<String> = again
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::AmountDiffers)
        .map(|f| f.provider_id.clone().unwrap_or_default())
        .collect();
    still.sort();
    assert_eq!(still, expected, "{again:#?}");
    let pending: String = sqlx::query_scalar("SELECT status FROM payment WHERE id = $1")
        .bind(pending_differs)
        .fetch_one(db.pool())
        .await?;
    assert_eq!(pending, "pending", "captured with a charge of another amount");
    Ok(())
}

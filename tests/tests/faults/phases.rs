//! Issue 33: `kill -9` of idem between the phases of a charge through the payment provider — the
//! provider charged, idem never recorded it. With no client retry the completer of the restarted service
//! finishes the request; with a client retry the retry does (after the dead attempt's lease lapsed). Either
//! way: one charge at the provider per client key, one captured payment, one announcement, and the
//! client's answer is the payment. A refund killed the same way and retried is one refund there and here.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use idem_tests::TestDb;
use serde_json::{Value, json};

use crate::harness::{API_KEY, Service};

const PROVIDER_KEY: &str = "sk_test_faults_0123";

async fn charge(base: &str, key: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
    let resp = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?
        .post(format!("{base}/payments"))
        .bearer_auth(API_KEY)
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await?;
    let status = resp.status().as_u16();
    Ok((status, resp.json().await.unwrap_or(Value::Null)))
}

async fn count(db: &TestDb, sql: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sql).fetch_one(db.pool()).await?)
}

/// Sends a charge, waits until the provider received its call (the first phase is committed), then
/// `kill -9`s the service while the provider's answer is on its way.
async fn kill_between_the_phases(
    service: &mut Service,
    standin: &idem_tests::provider::StandIn,
    key: &str,
    body: &Value,
) -> anyhow::Result<()> {
    let calls = standin.calls.load(SeqCst);
    let (base, key_owned, body_owned) = (service.base.clone(), key.to_owned(), body.clone());
    let request = tokio::spawn(async move { charge(&base, &key_owned, &body_owned).await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while standin.calls.load(SeqCst) == calls {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "the provider was never called");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    service.kill9();
    let lost = request.await?;
    anyhow::ensure!(lost.is_err(), "the client got an answer from a killed service: {lost:?}");
    Ok(())
}

#[tokio::test]
async fn s13_kill9_between_the_phases_completer_or_retry_finishes_with_one_charge() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    standin.delay_ms.store(1_500, SeqCst); // charged at once, answered late: the kill lands in between
    let mut service = Service::new(&db.url, &brokers)
        .with_env("PAYMENT_PROVIDER_URL", &provider)
        .with_env("PAYMENT_PROVIDER_NAME", "standin")
        .with_env("PAYMENT_PROVIDER_API_KEY", PROVIDER_KEY)
        .with_env("IDEMPOTENCY_LEASE", "4s")
        .with_env("PAYMENT_PROVIDER_TIMEOUT", "2s") // the lease holds a call and a second's margin
        .with_env("COMPLETER_INTERVAL", "300ms");
    service.start().await?;
    let order = |amount: &str| {
        json!({"order_id": uuid::Uuid::now_v7(), "customer_id": uuid::Uuid::now_v7(), "amount": amount,
               "currency": "EUR", "payment_method": "pm_card_visa"})
    };

    // 1. no client retry: the completer of the restarted service finishes it
    let alone = order("42.00");
    kill_between_the_phases(&mut service, &standin, "kill-no-retry-1", &alone).await?;
    assert_eq!(standin.charges.load(SeqCst), 1, "the provider charged before the kill");
    assert_eq!(count(&db, "SELECT count(*) FROM payment WHERE status = 'pending'").await?, 1);
    standin.delay_ms.store(0, SeqCst);
    service.start().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while count(&db, "SELECT count(*) FROM idempotency_record WHERE key = 'kill-no-retry-1' AND state = 'completed'")
        .await?
        == 0
    {
        assert!(tokio::time::Instant::now() < deadline, "the completer did not finish the request within 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, payment) = charge(&service.base, "kill-no-retry-1", &alone).await?;
    assert_eq!((status, payment["status"].as_str()), (201, Some("captured")), "{payment}");
    assert_eq!(payment["external_payment_id"], "ch_1", "the provider's first charge, not a second one");

    // 2. the client retries: the retry takes over once the dead attempt's lease lapsed
    standin.delay_ms.store(1_500, SeqCst);
    let retried = order("17.50");
    kill_between_the_phases(&mut service, &standin, "kill-retry-1", &retried).await?;
    standin.delay_ms.store(0, SeqCst);
    service = service.with_env("COMPLETER_INTERVAL", "1h"); // the client's retry, not the completer
    service.start().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let answer = loop {
        let (status, body) = charge(&service.base, "kill-retry-1", &retried).await?;
        if status != 409 {
            break (status, body);
        }
        assert!(tokio::time::Instant::now() < deadline, "still in flight after 30 s");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!((answer.0, answer.1["status"].as_str()), (201, Some("captured")), "{}", answer.1);

    // 3. a refund killed between its phases (the provider refunded), retried after the restart
    let payment = answer.1["id"].as_str().unwrap_or_default().to_owned();
    let refund = |base: String| {
        let payment = payment.clone();
        async move {
            let resp = reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?
                .post(format!("{base}/payments/{payment}/refund"))
                .bearer_auth(API_KEY)
                .header("idempotency-key", "kill-refund-1")
                .json(&json!({"amount": "5.00"}))
                .send()
                .await?;
            let status = resp.status().as_u16();
            Ok::<_, anyhow::Error>((status, resp.json::<Value>().await.unwrap_or(Value::Null)))
        }
    };
    standin.delay_ms.store(1_500, SeqCst);
    let calls = standin.calls.load(SeqCst);
    let lost = tokio::spawn(refund(service.base.clone()));
    while standin.calls.load(SeqCst) == calls {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    service.kill9();
    assert!(lost.await?.is_err(), "the refund's client got no answer");
    assert_eq!(standin.refunds_made.load(SeqCst), 1, "the provider refunded before the kill");
    standin.delay_ms.store(0, SeqCst);
    service.start().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let refunded = loop {
        let (status, body) = refund(service.base.clone()).await?;
        if status != 409 {
            break (status, body);
        }
        assert!(tokio::time::Instant::now() < deadline, "the refund stayed in flight");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!((refunded.0, refunded.1["refunded_amount"].as_str()), (201, Some("5.00")), "{}", refunded.1);
    assert_eq!(standin.refunds_made.load(SeqCst), 1, "one refund at the provider");
    assert_eq!(count(&db, "SELECT count(*) FROM refund").await?, 1, "one refund in idem");

    assert_eq!(standin.charges.load(SeqCst), 2, "one charge at the provider per client key");
    assert_eq!(count(&db, "SELECT count(*) FROM payment WHERE status IN ('captured', 'partially_refunded')").await?, 2);
    assert_eq!(
        count(&db, "SELECT count(*) FROM payment WHERE status NOT IN ('captured', 'partially_refunded')").await?,
        0
    );
    let captured: Vec<(String, i64)> =
        sqlx::query_as("SELECT external_payment_id, (amount * 100)::bigint FROM payment ORDER BY 1")
            .fetch_all(db.pool())
            .await?;
    let mut charged: Vec<(String, i64)> =
        standin.charges_made().into_iter().map(|(id, minor, _)| (id, minor)).collect();
    charged.sort();
    assert_eq!(captured, charged, "money conserved: captured in idem = charged at the provider");
    let announced =
        idem_tests::kafka::read_topic(&brokers, &service.payments_topic, 2, Duration::from_secs(20)).await?;
    // the relay publishes at least once: count distinct events (their event_id), one per payment
    let events: std::collections::BTreeSet<String> = announced.iter().filter_map(|r| r.header("event_id")).collect();
    assert_eq!(events.len(), 2, "one PaymentCaptured per payment");
    Ok(())
}

/// Issue 45.1, black-box: an instance whose host clock is 40 s ahead (`faketime`), with the default lease
/// (30 s) and provider timeout (10 s), retries a charge whose call is out on another instance. Leases were
/// compared with the host's clock: the retry took the live lease over and called again (two calls in
/// process with one key). On the database's clock it is in flight: one call, one charge, one payment.
#[tokio::test]
async fn s14_a_host_40s_ahead_never_takes_over_a_live_lease() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    let service = |brokers: &str| {
        Service::new(&db.url, brokers)
            .with_env("PAYMENT_PROVIDER_URL", &provider)
            .with_env("PAYMENT_PROVIDER_NAME", "standin")
            .with_env("PAYMENT_PROVIDER_API_KEY", PROVIDER_KEY)
            .with_env("COMPLETER_INTERVAL", "1h")
    };
    let mut on_time = service(&brokers);
    let mut ahead = service(&brokers).with_clock_shift("+40s");
    on_time.start().await?;
    ahead.start().await?;
    // the shift took: hyper's `Date` header is the process's wall clock
    let date = reqwest::get(format!("{}/readyz", ahead.admin)).await?.headers()["date"].to_str()?.to_owned();
    let skew = chrono::DateTime::parse_from_rfc2822(&date)?.timestamp() - chrono::Utc::now().timestamp();
    assert!((35..=45).contains(&skew), "the host is {skew} s ahead, not 40 ({date})");
    standin.delay_ms.store(3_000, SeqCst);
    let body = json!({"order_id": uuid::Uuid::now_v7(), "customer_id": uuid::Uuid::now_v7(), "amount": "40.00",
                      "currency": "EUR", "payment_method": "pm_card_visa"});
    let first = tokio::spawn({
        let (base, body) = (on_time.base.clone(), body.clone());
        async move { charge(&base, "skew-faketime-1", &body).await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while standin.calls.load(SeqCst) == 0 {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "the provider was never called");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, answer) = charge(&ahead.base, "skew-faketime-1", &body).await?;
    assert_eq!(status, 409, "the host 40 s ahead took over a live lease: {answer}");
    let (status, payment) = first.await??;
    assert_eq!((status, payment["status"].as_str()), (201, Some("captured")), "{payment}");
    let (status, replayed) = charge(&ahead.base, "skew-faketime-1", &body).await?;
    assert_eq!((status, &replayed["id"]), (201, &payment["id"]), "the skewed host replays the one payment");
    assert_eq!(standin.calls.load(SeqCst), 1, "calls at the provider for one key");
    assert_eq!(standin.charges.load(SeqCst), 1, "charges at the provider");
    assert_eq!(count(&db, "SELECT count(*) FROM payment").await?, 1);
    Ok(())
}

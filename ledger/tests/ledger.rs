//! The ledger, a service built only on idem's public API, against the real PostgreSQL and broker: its own
//! rows commit with idem's idempotency record, processed-event row and outbox row, or not at all.

#![allow(clippy::disallowed_methods)] // tests make their own ids and read the clock
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use idem::http::ApiKeys;
use idem::testing::faults::{FaultyCommits, dies_before_commit};
use idem::testing::{TestDb, TestProducer, create_topic, eventually, kafka_brokers, unique_topic};
use idem::{SystemClock, TransactionManager, TtlPolicy};
use serde_json::{Value, json};
use uuid::Uuid;

const KEYS: &str = "alpha:alpha_key_0123456789,beta:beta_key_0123456789";

async fn ledger_db() -> anyhow::Result<TestDb> {
    // idem's tables and the ledger's, in one migration table
    let db = TestDb::with_migrations(&idem_ledger::MIGRATOR).await?;
    db.store.migrate().await?; // and idem alone still migrates a database holding the ledger's entries
    Ok(db)
}

/// Serves the ledger on a free port; returns its base URL.
async fn serve(tm: Arc<dyn TransactionManager>) -> anyhow::Result<String> {
    let keys = Arc::new(ApiKeys::parse(KEYS).map_err(anyhow::Error::msg)?);
    let app = idem_ledger::router(tm, keys, TtlPolicy::new(Duration::from_secs(48 * 3600))?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(base)
}

async fn credit(base: &str, key: &str, api_key: &str, amount: &str) -> anyhow::Result<(u16, Value, bool)> {
    let reply = reqwest::Client::new()
        .post(format!("{base}/accounts/cash/credits"))
        .bearer_auth(api_key)
        .header("Idempotency-Key", key)
        .json(&json!({ "amount": amount, "source": "test" }))
        .send()
        .await?;
    let status = reply.status().as_u16();
    let replayed = reply.headers().contains_key("idempotent-replayed");
    let body = reply.json().await.unwrap_or(Value::Null);
    Ok((status, body, replayed))
}

async fn count(db: &TestDb, sql: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sql).fetch_one(db.pool()).await?)
}

#[tokio::test]
async fn a_credit_replays_conflicts_and_is_scoped_by_merchant() -> anyhow::Result<()> {
    let db = ledger_db().await?;
    let base = serve(Arc::new(db.store.clone())).await?;
    let (status, first, _) = credit(&base, "k-1", "alpha_key_0123456789", "10.50").await?;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["balance"], "10.5");
    let (status, again, replayed) = credit(&base, "k-1", "alpha_key_0123456789", "10.50").await?;
    assert_eq!((status, replayed), (201, true));
    assert_eq!(again, first, "the replay is the stored answer");
    let (status, conflict, _) = credit(&base, "k-1", "alpha_key_0123456789", "99").await?;
    assert_eq!(status, 409, "{conflict}");
    assert_eq!(conflict["type"], "urn:idem:problem:idempotency-key-reused");
    // the same key for another merchant is another operation
    let (status, other, replayed) = credit(&base, "k-1", "beta_key_0123456789", "10.50").await?;
    assert_eq!((status, replayed), (201, false));
    assert_ne!(other["entry_id"], first["entry_id"]);
    // a refused request leaves the key free
    let (status, _, _) = credit(&base, "k-2", "alpha_key_0123456789", "-1").await?;
    assert_eq!(status, 422);
    let (status, _, _) = credit(&base, "k-2", "alpha_key_0123456789", "1").await?;
    assert_eq!(status, 201);

    // own rows and idem's bookkeeping: one of each per executed credit
    assert_eq!(count(&db, "SELECT count(*) FROM ledger_entry").await?, 3);
    assert_eq!(count(&db, "SELECT count(*) FROM idempotency_record WHERE state = 'completed'").await?, 3);
    assert_eq!(count(&db, "SELECT count(*) FROM outbox_message WHERE type = 'LedgerCredited'").await?, 3);
    let alpha: rust_decimal::Decimal =
        sqlx::query_scalar("SELECT balance FROM ledger_balance WHERE merchant = 'alpha' AND account = 'cash'")
            .fetch_one(db.pool())
            .await?;
    assert_eq!(alpha.normalize().to_string(), "11.5");
    Ok(())
}

#[tokio::test]
async fn concurrent_duplicates_make_one_credit() -> anyhow::Result<()> {
    let db = ledger_db().await?;
    let base = serve(Arc::new(db.store.clone())).await?;
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let base = base.clone();
            tokio::spawn(async move { credit(&base, "same", "alpha_key_0123456789", "5").await })
        })
        .collect();
    let mut bodies = Vec::new();
    for t in tasks {
        let (status, body, _) = t.await??;
        assert!(matches!(status, 201 | 409), "{status} {body}");
        if status == 201 {
            bodies.push(body);
        } else {
            assert_eq!(body["type"], "urn:idem:problem:request-in-flight", "{body}");
        }
    }
    assert!(!bodies.is_empty());
    assert!(bodies.iter().all(|b| *b == bodies[0]), "every success is the same credit");
    assert_eq!(count(&db, "SELECT count(*) FROM ledger_entry").await?, 1);
    assert_eq!(count(&db, "SELECT count(*) FROM outbox_message").await?, 1);
    Ok(())
}

#[tokio::test]
async fn a_crash_before_commit_leaves_nothing_and_the_retry_executes_once() -> anyhow::Result<()> {
    let db = ledger_db().await?;
    let base = serve(Arc::new(FaultyCommits::first(1, Arc::new(db.store.clone()), dies_before_commit))).await?;
    let (status, body, _) = credit(&base, "k-crash", "alpha_key_0123456789", "7").await?;
    assert_eq!(status, 503, "{body}");
    for table in ["ledger_entry", "ledger_balance", "idempotency_record", "outbox_message"] {
        assert_eq!(db.count(table).await?, 0, "{table} kept a row of an uncommitted credit");
    }
    let (status, body, replayed) = credit(&base, "k-crash", "alpha_key_0123456789", "7").await?;
    assert_eq!((status, replayed), (201, false), "{body}");
    assert_eq!(db.count("ledger_entry").await?, 1);
    assert_eq!(db.count("outbox_message").await?, 1);
    assert_eq!(db.count("idempotency_record").await?, 1);
    Ok(())
}

/// The revenue handler under idem's consumer runner: duplicates (same event_id) credit once, commits that
/// die are retried, and each applied event leaves exactly one ledger entry, one processed-event row and one
/// announcement.
#[tokio::test]
async fn revenue_events_are_credited_once_with_their_processed_row() -> anyhow::Result<()> {
    let db = ledger_db().await?;
    let brokers = kafka_brokers().await?;
    let topic = unique_topic("ledger-payments");
    create_topic(&brokers, &topic, 2).await?;
    let producer = TestProducer::new(&brokers)?;
    let distinct = 40;
    for i in 0..distinct {
        let body =
            json!({ "type": "PaymentCaptured", "payment_id": Uuid::now_v7(), "amount": "2.50", "currency": "EUR" });
        let (key, payload) = (format!("o-{i}"), body.to_string());
        let id = producer.event(&topic, &key, payload.as_bytes()).await?;
        if i % 3 == 0 {
            producer.event_with_id(id, &topic, &key, payload.as_bytes()).await?; // delivered again
        }
    }
    // other events are ignored, yet recorded as processed
    producer.event(&topic, "x", br#"{"type":"OrderPlaced"}"#).await?;

    let tm = Arc::new(FaultyCommits::first(3, Arc::new(db.store.clone()), dies_before_commit));
    let mut settings = idem::kafka::consumer::RunnerSettings::new(
        &brokers,
        &unique_topic("ledger-group"),
        &topic,
        TtlPolicy::new(Duration::from_secs(72 * 3600))?,
    );
    settings.batch_size = 7;
    let handler = Arc::new(idem_ledger::RevenueHandler { merchant: "alpha".into() });
    let runner = idem::kafka::consumer::Runner::new(settings, tm, Arc::new(SystemClock), handler);
    let token = idem::CancellationToken::new();
    let task = tokio::spawn(runner.run(token.clone()));
    let done = eventually(Duration::from_secs(60), || async {
        Ok(count(&db, "SELECT count(*) FROM processed_event").await? == distinct + 1)
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    token.cancel();
    task.await??;
    assert!(done, "processed {} of {}", count(&db, "SELECT count(*) FROM processed_event").await?, distinct + 1);
    assert_eq!(count(&db, "SELECT count(*) FROM ledger_entry").await?, distinct);
    assert_eq!(count(&db, "SELECT count(*) FROM outbox_message WHERE type = 'LedgerCredited'").await?, distinct);
    let balance: rust_decimal::Decimal =
        sqlx::query_scalar("SELECT balance FROM ledger_balance WHERE merchant = 'alpha' AND account = 'revenue:EUR'")
            .fetch_one(db.pool())
            .await?;
    assert_eq!(balance, rust_decimal::Decimal::new(250, 2) * rust_decimal::Decimal::from(distinct));
    Ok(())
}

//! The service's guarantees, tested with idem's kit: a refusal leaves the key free, a commit that dies
//! leaves nothing and the retry executes once, a redelivered event is applied once.

use std::{sync::Arc, time::Duration};

use idem::testing::faults::{FaultyCommits, dies_before_commit};
use idem::testing::{TestDb, TestProducer, create_topic, eventually, kafka_brokers, serve, unique_topic};
use idem::{SystemClock, TransactionManager, TtlPolicy};

fn ttl() -> TtlPolicy {
    TtlPolicy::new(Duration::from_secs(48 * 3600)).expect("a TTL in range")
}

/// A database with idem's tables and the service's, holding `on_hand` of "sku-1".
async fn stocked(on_hand: i32) -> anyhow::Result<TestDb> {
    let db = TestDb::with_migrations(&inventory::MIGRATOR).await?;
    sqlx::query("INSERT INTO stock (sku, on_hand) VALUES ('sku-1', $1)").bind(on_hand).execute(db.pool()).await?;
    Ok(db)
}

async fn reserve(base: &str, key: &str) -> anyhow::Result<u16> {
    let url = format!("{base}/stock/sku-1/reservations");
    Ok(reqwest::Client::new().post(url).header("Idempotency-Key", key).send().await?.status().as_u16())
}

async fn reserved(db: &TestDb) -> anyhow::Result<i32> {
    Ok(sqlx::query_scalar("SELECT reserved FROM stock WHERE sku = 'sku-1'").fetch_one(db.pool()).await?)
}

#[tokio::test]
async fn a_refusal_leaves_the_key_free_for_the_retry_after_a_restock() -> anyhow::Result<()> {
    let db = stocked(0).await?;
    let base = serve(inventory::api(Arc::new(db.store.clone()), Arc::new(SystemClock), ttl())).await?;
    assert_eq!(reserve(&base, "k-1").await?, 409, "out of stock");
    assert_eq!(db.count("idempotency_record").await?, 0, "a refusal stores nothing");
    sqlx::query("UPDATE stock SET on_hand = 1").execute(db.pool()).await?;
    assert_eq!(reserve(&base, "k-1").await?, 201);
    assert_eq!(reserve(&base, "k-1").await?, 201, "the replay");
    assert_eq!((reserved(&db).await?, db.count("outbox_message").await?), (1, 1));
    Ok(())
}

#[tokio::test]
async fn a_crash_before_commit_leaves_nothing_and_the_retry_reserves_once() -> anyhow::Result<()> {
    let db = stocked(5).await?;
    let tm: Arc<dyn TransactionManager> =
        Arc::new(FaultyCommits::first(1, Arc::new(db.store.clone()), dies_before_commit));
    let base = serve(inventory::api(tm, Arc::new(SystemClock), ttl())).await?;
    assert_eq!(reserve(&base, "k-1").await?, 503, "the commit died");
    assert_eq!((reserved(&db).await?, db.count("outbox_message").await?), (0, 0));
    assert_eq!(reserve(&base, "k-1").await?, 201);
    assert_eq!(reserve(&base, "k-1").await?, 201);
    assert_eq!((reserved(&db).await?, db.count("outbox_message").await?), (1, 1), "one reservation, one event");
    Ok(())
}

#[tokio::test]
async fn a_redelivered_restock_is_applied_once() -> anyhow::Result<()> {
    let db = stocked(0).await?;
    let (brokers, topic) = (kafka_brokers().await?, unique_topic("restocks"));
    create_topic(&brokers, &topic, 1).await?;
    let producer = TestProducer::new(&brokers)?;
    let id = producer.event(&topic, "sku-1", b"sku-1").await?;
    producer.event_with_id(id, &topic, "sku-1", b"sku-1").await?; // the same event again
    producer.event(&topic, "sku-1", b"sku-1").await?; // another restock

    let settings = idem::kafka::consumer::RunnerSettings::new(&brokers, &unique_topic("inventory"), &topic, ttl());
    let runner = idem::pg_runner(settings, db.store.clone(), Arc::new(SystemClock), inventory::Restocked);
    let token = idem::CancellationToken::new();
    let task = tokio::spawn(runner.run(token.clone()));
    let done = eventually(Duration::from_secs(30), || async { Ok(db.count("processed_event").await? == 2) }).await?;
    tokio::time::sleep(Duration::from_millis(500)).await; // time for a third application, if there were one
    token.cancel();
    task.await??;
    assert!(done, "two distinct events were never both processed");
    let on_hand: i32 = sqlx::query_scalar("SELECT on_hand FROM stock").fetch_one(db.pool()).await?;
    assert_eq!(on_hand, 2, "three deliveries of two events: two restocks");
    Ok(())
}

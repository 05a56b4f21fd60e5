//! Relay benchmark: relay throughput (messages/s, acks=all) and commit-to-publish latency p50/p99 at a
//! steady offered load, beside two ceilings: the broker's raw produce rate with the same producer settings,
//! and PostgreSQL's rate for the relay's claim-and-delete transactions alone on as many rows.
//!
//! Run with `scripts/bench.sh relay`. Settings: BENCH_ROWS (100000), BENCH_RATE (1000 messages/s offered
//! for the latency phase), BENCH_SECONDS (10), BENCH_RELAY_BATCH (2000), BENCH_CLAIM_INTERVAL_US (the relay's
//! default, 25000), BENCH_LINGER_US (the producer's `linger.ms`, default 1000), DATABASE_URL, KAFKA_BROKERS.

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::disallowed_methods)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{env_or, fresh_store};
use idem_kafka::ProducerSettings;
use idem_kafka::relay::{Relay, RelaySettings};
use idem_ports::{SystemClock, TransactionManager};
use idem_postgres::{PgOutboxWakeup, PgStore};
use idem_tests::kafka::{create_topic, unique_topic};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use tokio_util::sync::CancellationToken;

/// ~200-byte payloads, as the ceiling quoted in the issue.
const PAYLOAD: &str = r#"{"type":"PaymentCaptured","payment_id":"01936f8e-7b2a-7c3d-8e4f-5a6b7c8d9e0f","order_id":"01936f8e-7b2a-7c3d-8e4f-5a6b7c8d9e10","amount":"12.3400","currency":"EUR","provider":"stripe","x":"pad"}"#;

/// Inserts `rows` unpublished outbox rows over 1,000 keys in one statement.
async fn fill(store: &PgStore, topic: &str, rows: i64) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, created_at)
         SELECT gen_random_uuid(), $1, 'payment', 'order-' || (g % 1000), 'PaymentCaptured', $2::jsonb, now()
         FROM generate_series(1, $3) AS g",
    )
    .bind(topic)
    .bind(PAYLOAD)
    .bind(rows)
    .execute(store.pool())
    .await?;
    Ok(())
}

async fn unpublished(store: &PgStore) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM outbox_message").fetch_one(store.pool()).await?)
}

/// Ceiling 1: the broker's raw produce rate with the relay's producer settings.
async fn broker_ceiling(brokers: &str, topic: &str, messages: usize) -> anyhow::Result<f64> {
    let producer: FutureProducer = ProducerSettings::new(brokers).client_config().create()?;
    let start = Instant::now();
    let mut pending = Vec::with_capacity(messages);
    for i in 0..messages {
        let key = format!("order-{}", i % 1000);
        loop {
            match producer.send_result(FutureRecord::to(topic).key(&key).payload(PAYLOAD)) {
                Ok(d) => {
                    pending.push(d);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        }
    }
    for d in pending {
        d.await?.map_err(|(e, _)| e)?;
    }
    producer.flush(Duration::from_secs(10))?;
    Ok(messages as f64 / start.elapsed().as_secs_f64())
}

/// Ceiling 2: claim-and-delete transactions alone (no publishing) on as many rows.
async fn claim_mark_ceiling(store: &PgStore, topic: &str, rows: i64, batch: i64) -> anyhow::Result<f64> {
    sqlx::query("DELETE FROM outbox_message").execute(store.pool()).await?;
    fill(store, topic, rows).await?;
    sqlx::query("VACUUM ANALYZE outbox_message").execute(store.pool()).await?;
    let total = unpublished(store).await?;
    let start = Instant::now();
    loop {
        let mut uow = store.begin().await?;
        let rows = uow.outbox().claim_unpublished(batch).await?;
        if rows.is_empty() {
            break;
        }
        let ids: Vec<_> = rows.iter().map(|r| r.id).collect();
        uow.outbox().delete_published(&ids).await?;
        uow.commit().await?;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

fn start_relay(
    store: &PgStore,
    brokers: &str,
    batch: i64,
    wakeup: PgOutboxWakeup,
) -> (CancellationToken, tokio::task::JoinHandle<()>, Arc<idem_kafka::relay::RelayStats>) {
    let mut settings = RelaySettings::new(brokers);
    settings.batch_size = batch;
    settings.poll_interval = Duration::from_millis(env_or("BENCH_POLL_MS", 1000));
    settings.concurrency = env_or("BENCH_RELAY_WORKERS", settings.concurrency);
    settings.min_claim_interval =
        Duration::from_micros(env_or("BENCH_CLAIM_INTERVAL_US", settings.min_claim_interval.as_micros() as u64));
    settings.producer.linger =
        Duration::from_micros(env_or("BENCH_LINGER_US", settings.producer.linger.as_micros() as u64));
    let relay = Relay::new(settings, Arc::new(store.clone()), Arc::new(SystemClock));
    let stats = relay.stats();
    let stop = CancellationToken::new();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        relay.run(Box::new(wakeup), token).await.unwrap();
    });
    (stop, task, stats)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Some((admin, brokers)) = common::bench_env() else { return Ok(()) };
    let rows: i64 = env_or("BENCH_ROWS", 100_000);
    let rate: u64 = env_or("BENCH_RATE", 1_000);
    let seconds: u64 = env_or("BENCH_SECONDS", 10);
    let batch: i64 = env_or("BENCH_RELAY_BATCH", 2000);
    let store = fresh_store(&admin, "idem_bench_relay").await?;
    let topic = unique_topic("bench-payments");
    create_topic(&brokers, &topic, 6).await?;
    println!("idem relay benchmark: {rows} rows of ~{} bytes, 1,000 keys, 6 partitions, batch {batch}", PAYLOAD.len());

    // Throughput: a backlog drained by one relay.
    fill(&store, &topic, rows).await?;
    // as the claim-and-delete ceiling does, so both start from the same table (hint bits set, statistics)
    sqlx::query("VACUUM ANALYZE outbox_message").execute(store.pool()).await?;
    let (stop, task, stats) = start_relay(&store, &brokers, batch, PgOutboxWakeup::connect(&store).await?);
    let start = Instant::now();
    // Done when the relay counted every row published: polling `count(*)` every 20 ms (as before) scanned
    // the whole backlog each time, on the cores the relay was measured on.
    let mut first = None;
    while stats.published.get() < rows as u64 {
        if first.is_none() && stats.published.get() > 0 {
            first = Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if std::env::var_os("BENCH_DEBUG").is_some() {
        println!("first round published after {first:?}, all after {:?}", start.elapsed());
    }
    let relayed = rows as f64 / start.elapsed().as_secs_f64();
    anyhow::ensure!(unpublished(&store).await? == 0, "every row deleted once published");
    stop.cancel();
    task.await?;
    anyhow::ensure!(stats.published.get() == rows as u64, "every row published once");

    // Latency: a steady offered load, one row per transaction, relay idle between rows.
    sqlx::query("DELETE FROM outbox_message").execute(store.pool()).await?;
    let (stop, task, _) = start_relay(&store, &brokers, batch, PgOutboxWakeup::connect(&store).await?);
    // warm-up: the new producer's first publish (connection, producer id, topic metadata) takes ~1 s
    fill(&store, &topic, 10).await?;
    while unpublished(&store).await? > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sqlx::query("DELETE FROM outbox_message").execute(store.pool()).await?;
    // The relay deletes a row in the round that saw the broker's ack: note when (bench-only trigger).
    sqlx::raw_sql(
        "CREATE TABLE bench_published (id uuid PRIMARY KEY, at timestamptz NOT NULL);
         CREATE FUNCTION bench_published() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO bench_published VALUES (OLD.id, clock_timestamp()); RETURN NULL; END $$;
         CREATE TRIGGER bench_published AFTER DELETE ON outbox_message FOR EACH ROW EXECUTE FUNCTION bench_published();",
    )
    .execute(store.pool())
    .await?;
    // 4 writers, each committing one row per transaction at rate/4
    let writers = 4u64;
    let interval = Duration::from_micros(1_000_000 * writers / rate.max(1));
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (store, topic) = (store.clone(), topic.clone());
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut committed_at = Vec::new();
            let mut n = 0u64;
            while Instant::now() < end {
                tick.tick().await;
                let mut uow = store.begin().await?;
                let id = uuid::Uuid::now_v7();
                uow.outbox()
                    .enqueue(&idem_ports::NewOutboxMessage {
                        id,
                        topic: topic.clone(),
                        aggregate_type: "payment".into(),
                        aggregate_id: format!("order-{}", (n * writers + w) % 1000),
                        event_type: "PaymentCaptured".into(),
                        payload: serde_json::from_str(PAYLOAD)?,
                        saga_id: None,
                        traceparent: None,
                        created_at: chrono::Utc::now(),
                    })
                    .await?;
                uow.commit().await?;
                committed_at.push((id, chrono::Utc::now()));
                n += 1;
            }
            anyhow::Ok(committed_at)
        }));
    }
    let mut committed_at = Vec::new();
    for t in tasks {
        committed_at.extend(t.await??);
    }
    let written = committed_at.len();
    while unpublished(&store).await? > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    task.await?;
    // commit-to-publish: from the writer's commit acknowledgement to the relay's delete (after the broker
    // acknowledged the message)
    let published: std::collections::HashMap<uuid::Uuid, chrono::DateTime<chrono::Utc>> =
        sqlx::query_as::<_, (uuid::Uuid, chrono::DateTime<chrono::Utc>)>("SELECT id, at FROM bench_published")
            .fetch_all(store.pool())
            .await?
            .into_iter()
            .collect();
    sqlx::raw_sql("DROP TRIGGER bench_published ON outbox_message").execute(store.pool()).await?;
    let slow: Vec<(usize, u128)> = committed_at
        .iter()
        .enumerate()
        .filter_map(|(i, (id, at))| published.get(id).map(|p| (i, (*p - *at).num_milliseconds() as u128)))
        .filter(|(_, ms)| *ms > 200)
        .collect();
    if std::env::var_os("BENCH_DEBUG").is_some() {
        println!("slow rows (index, ms): {slow:?}");
    }
    let latencies: Vec<Duration> = committed_at
        .iter()
        .filter_map(|(id, at)| published.get(id).map(|p| (*p - *at).to_std().unwrap_or(Duration::ZERO)))
        .collect();
    let summary = common::Summary::from_latencies("latency", latencies, 0, Duration::from_secs(seconds));
    let (p50, p99) = (summary.p50.as_secs_f64() * 1e3, summary.p99.as_secs_f64() * 1e3);
    let broker = broker_ceiling(&brokers, &topic, rows as usize).await?;
    let claim_mark = claim_mark_ceiling(&store, &topic, rows, batch).await?;
    // The relay both claims/deletes and produces on the same cores: its ceiling is the two ceilings combined.
    let lower = 1.0 / (1.0 / broker + 1.0 / claim_mark);
    println!("{:<62} {:>12}", "measure", "value");
    println!("{:<62} {:>12.0}", "relay throughput, backlog drained (messages/s)", relayed);
    println!("{:<62} {:>12.0}", "ceiling: broker raw produce, same producer settings (msg/s)", broker);
    println!("{:<62} {:>12.0}", "ceiling: claim-and-delete transactions alone (rows/s)", claim_mark);
    println!("{:<62} {:>12.1}", &format!("commit-to-publish p50 at {rate} msg/s offered ({written} rows), ms"), p50);
    println!("{:<62} {:>12.1}", "commit-to-publish p99, ms", p99);
    println!();
    println!("relay / combined ceiling 1/(1/claim_mark + 1/broker_raw) = {:.2}  (target >= 0.70)", relayed / lower);
    println!("relay throughput      = {relayed:.0}/s  (target >= 15,000/s)");
    println!("p99 commit-to-publish = {p99:.1} ms  (target < 100 ms)");
    Ok(())
}

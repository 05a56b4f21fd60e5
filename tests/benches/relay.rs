//! Relay benchmark: relay throughput (messages/s, acks=all) and commit-to-publish latency p50/p99 at a
//! steady offered load, beside two ceilings: the broker's raw produce rate with the same producer settings,
//! and PostgreSQL's rate for the relay's claim-and-delete transactions alone on as many rows.
//!
//! Run with `scripts/bench.sh relay`. Settings: BENCH_ROWS (100000), BENCH_RATE (1000 messages/s offered
//! for the latency phase), BENCH_SECONDS (10), BENCH_RELAY_BATCH (2000), BENCH_CLAIM_INTERVAL_US (the relay's
//! default, 25000), BENCH_LINGER_US (the producer's `linger.ms`, default 1000), DATABASE_URL, KAFKA_BROKERS.

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::disallowed_methods)]

mod common;

use std::time::{Duration, Instant};

use common::relay::{PAYLOAD, fill, latency, start_relay, unpublished};
use common::{env_or, fresh_store};
use idem_kafka::ProducerSettings;
use idem_ports::TransactionManager;
use idem_postgres::{PgOutboxWakeup, PgStore};
use idem_tests::kafka::{create_topic, unique_topic};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

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
    let (summary, written) = latency(&store, &brokers, &topic, rate, seconds, batch).await?;
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

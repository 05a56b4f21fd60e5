//! The relay benchmark's pieces shared with the peers benchmark: a backlog of outbox rows, a relay task,
//! and commit-to-publish latency at a steady offered load.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_kafka::relay::{Relay, RelaySettings};
use idem_ports::{SystemClock, TransactionManager};
use idem_postgres::{PgOutboxWakeup, PgStore};
use tokio_util::sync::CancellationToken;

use super::env_or;

/// ~200-byte payloads, as the ceiling quoted in the issue.
pub const PAYLOAD: &str = r#"{"type":"PaymentCaptured","payment_id":"01936f8e-7b2a-7c3d-8e4f-5a6b7c8d9e0f","order_id":"01936f8e-7b2a-7c3d-8e4f-5a6b7c8d9e10","amount":"12.3400","currency":"EUR","provider":"stripe","x":"pad"}"#;

/// Inserts `rows` unpublished outbox rows over 1,000 keys in one statement.
pub async fn fill(store: &PgStore, topic: &str, rows: i64) -> anyhow::Result<()> {
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

pub async fn unpublished(store: &PgStore) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM outbox_message").fetch_one(store.pool()).await?)
}

pub fn start_relay(
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

/// Commit-to-publish latency at `rate` rows/s offered for `seconds` by 4 writers, one row per transaction,
/// against an empty outbox: from each writer's commit acknowledgement to the relay's delete of the row (in
/// the round that saw the broker's ack). Returns the latencies and the rows written.
pub async fn latency(
    store: &PgStore,
    brokers: &str,
    topic: &str,
    rate: u64,
    seconds: u64,
    batch: i64,
) -> anyhow::Result<(super::Summary, usize)> {
    let (stop, task, _) = start_relay(store, brokers, batch, PgOutboxWakeup::connect(store).await?);
    // warm-up: the new producer's first publish (connection, producer id, topic metadata) takes ~1 s
    fill(store, topic, 10).await?;
    while unpublished(store).await? > 0 {
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
        let (store, topic) = (store.clone(), topic.to_owned());
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
    while unpublished(store).await? > 0 {
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
    let summary = super::Summary::from_latencies("latency", latencies, 0, Duration::from_secs(seconds));
    Ok((summary, written))
}

//! Cleanup benchmark: 1,000,000 expired processed-event rows removed while charges run at a steady rate.
//! Prints rows/s removed and the charges' p99 latency before, during and after the cleanup, for batched
//! deletes (`processed_event`) and for partition drop (`processed_event_partitioned`), in one run.
//!
//! Run with `scripts/bench.sh cleanup`. Settings: BENCH_ROWS (1000000), BENCH_RATE (200 charges/s),
//! BENCH_WINDOW (8 s before and after), DATABASE_URL, IDEM_BIN.

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::disallowed_methods)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use common::{API_KEY, Summary, env_or, fresh_database, start_service};
use idem_postgres::cleanup::{Cleaner, CleanupSettings, partitions};
use idem_postgres::{DedupStorage, PgStore, PoolSettings};
use serde_json::json;
use tokio::sync::Mutex;
use uuid::Uuid;

/// Steady charges: `rate` per second from 8 paced workers; records (start instant, latency).
fn steady_load(
    base: String,
    rate: u64,
    stop: tokio_util::sync::CancellationToken,
) -> Arc<Mutex<Vec<(Instant, Duration)>>> {
    let samples = Arc::new(Mutex::new(Vec::new()));
    let workers = 8u64;
    for _ in 0..workers {
        let (base, stop, samples) = (base.clone(), stop.clone(), samples.clone());
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 * workers / rate.max(1)));
            while !stop.is_cancelled() {
                tick.tick().await;
                let body = json!({
                    "order_id": Uuid::now_v7(), "customer_id": Uuid::now_v7(), "provider": "bench",
                    "external_payment_id": Uuid::now_v7().to_string(), "amount": "1.00", "currency": "EUR",
                });
                let start = Instant::now();
                let ok = http
                    .post(format!("{base}/payments"))
                    .bearer_auth(API_KEY)
                    .header("idempotency-key", Uuid::now_v7().to_string())
                    .json(&body)
                    .send()
                    .await
                    .is_ok_and(|r| r.status().as_u16() == 201);
                if ok {
                    samples.lock().await.push((start, start.elapsed()));
                }
            }
        });
    }
    samples
}

async fn p99(samples: &Mutex<Vec<(Instant, Duration)>>, from: Instant, to: Instant) -> (usize, f64) {
    let lat: Vec<Duration> =
        samples.lock().await.iter().filter(|(t, _)| *t >= from && *t < to).map(|(_, l)| *l).collect();
    let n = lat.len();
    let s = Summary::from_latencies("", lat, 0, to - from);
    (n, s.p99.as_secs_f64() * 1e3)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Some((admin, _)) = common::bench_env() else { return Ok(()) };
    let bin = std::env::var("IDEM_BIN")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/idem").into());
    let rows: i64 = env_or("BENCH_ROWS", 1_000_000);
    let rate: u64 = env_or("BENCH_RATE", 200);
    let window = Duration::from_secs(env_or("BENCH_WINDOW", 8));
    let db = fresh_database(&admin, "idem_bench_cleanup").await?;
    let svc = start_service(&bin, &db, 18082, "on").await?;
    let store = PgStore::connect(&db, &PoolSettings::default()).await?;
    println!("idem cleanup benchmark: {rows} expired rows, charges at {rate}/s, {}s windows", window.as_secs());
    println!(
        "{:<34} {:>12} {:>10} {:>14} {:>14} {:>14}",
        "method", "rows/s", "seconds", "p99 before ms", "p99 during ms", "p99 after ms"
    );

    // batched delete on processed_event
    let expired = Utc::now() - chrono::Duration::hours(1);
    let mut fill = untimed(&store).await?;
    sqlx::query(
        "INSERT INTO processed_event (consumer_name, event_id, topic, created_at, expires_at)
         SELECT 'bench', gen_random_uuid(), 'orders', $1, $1 FROM generate_series(1, $2)",
    )
    .bind(expired)
    .bind(rows)
    .execute(&mut *fill)
    .await?;
    fill.commit().await?;
    sqlx::query("VACUUM ANALYZE processed_event").execute(store.pool()).await?;
    let stop = tokio_util::sync::CancellationToken::new();
    let samples = steady_load(svc.base.clone(), rate, stop.clone());
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let t1 = Instant::now();
    let cleaner = Cleaner::new(store.clone(), CleanupSettings { max_batches: 1_000_000, ..CleanupSettings::default() });
    let report = cleaner.run_once(Utc::now()).await?.expect("lock free");
    let t2 = Instant::now();
    tokio::time::sleep(window).await;
    let t3 = Instant::now();
    let deleted = report.deleted.iter().map(|(_, n)| *n).sum::<u64>();
    anyhow::ensure!(deleted >= rows as u64, "deleted {deleted} of {rows}");
    let (b, d, a) = (p99(&samples, t0, t1).await, p99(&samples, t1, t2).await, p99(&samples, t2, t3).await);
    let secs = (t2 - t1).as_secs_f64();
    println!(
        "{:<34} {:>12.0} {:>10.1} {:>14.1} {:>14.1} {:>14.1}",
        "batched DELETE (5,000 per batch)",
        deleted as f64 / secs,
        secs,
        b.1,
        d.1,
        a.1
    );
    let batched_ratio = d.1 / b.1;

    // partition drop on processed_event_partitioned
    let partitioned = store.clone().with_dedup_storage(DedupStorage::Partitioned);
    let old_day = (Utc::now() - chrono::Duration::days(10)).date_naive();
    partitions::ensure(&partitioned, old_day, 0, 0).await?;
    let old_ms = old_day.and_hms_opt(12, 0, 0).unwrap().and_utc().timestamp_millis();
    // v7 ids of that day: 48-bit ms timestamp, version 7, random rest
    let mut fill = untimed(&store).await?;
    sqlx::query(
        "INSERT INTO processed_event_partitioned (consumer_name, event_id, event_time, topic, created_at, expires_at)
         SELECT 'bench', id, uuid_v7_time(id), 'orders', now(), now() - interval '1 hour'
         FROM (SELECT (lpad(to_hex($1::bigint + g), 12, '0') || '7' || substr(md5(g::text), 1, 3) || '8'
                       || substr(md5(g::text), 4, 15))::uuid AS id
               FROM generate_series(1, $2) g) s",
    )
    .bind(old_ms)
    .bind(rows)
    .execute(&mut *fill)
    .await?;
    fill.commit().await?;
    let t4 = Instant::now();
    tokio::time::sleep(window).await;
    let t5 = Instant::now();
    let dropped = partitions::drop_expired(&partitioned, Utc::now(), Duration::from_secs(72 * 3600)).await?;
    let t6 = Instant::now();
    // the "during" window of an instant drop: the drop and the second after it
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t6b = Instant::now();
    tokio::time::sleep(window).await;
    let t7 = Instant::now();
    stop.cancel();
    anyhow::ensure!(!dropped.is_empty(), "nothing dropped");
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM processed_event_partitioned").fetch_one(store.pool()).await?;
    anyhow::ensure!(left == 0, "{left} rows left");
    let (b2, d2, a2) = (p99(&samples, t4, t5).await, p99(&samples, t5, t6b).await, p99(&samples, t6b, t7).await);
    let secs = (t6 - t5).as_secs_f64();
    println!(
        "{:<34} {:>12.0} {:>10.3} {:>14.1} {:>14.1} {:>14.1}",
        "partition DETACH + DROP",
        rows as f64 / secs,
        secs,
        b2.1,
        d2.1,
        a2.1
    );
    println!();
    println!("p99 during / before: batched {batched_ratio:.2}, partition drop {:.2}  (target <= 2.0)", d2.1 / b2.1);
    println!("charges measured: {} / {} / {} and {} / {} / {}", b.0, d.0, a.0, b2.0, d2.0, a2.0);
    drop(svc);
    Ok(())
}

/// A transaction without the pool's statement timeout (30 s): filling a million rows took longer than that
/// on a slow afternoon of this VM.
async fn untimed(store: &PgStore) -> anyhow::Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let mut tx = store.pool().begin().await?;
    sqlx::query("SET LOCAL statement_timeout = 0").execute(&mut *tx).await?;
    Ok(tx)
}

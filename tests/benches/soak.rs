//! Soak: one `idem serve` under a steady offered load for BENCH_SOAK_MINUTES (30), its resident memory
//! sampled every BENCH_SOAK_SAMPLE_SECONDS (60). Every request carries a fresh random key and one in ten
//! replays a key sent before, so the in-process state that could grow (merchant limiter entries, metric
//! series, connection state, the relay's and the cleaner's buffers) is exercised the whole time.
//!
//! Run with `scripts/bench.sh soak`. Settings: BENCH_SOAK_RATE (300 requests/s), IDEM_BIN, DATABASE_URL.
//! Prints one row per sample (RSS, requests answered, failures, p99 of the interval) and the growth of RSS
//! from the end of the first sample to the end of the run.

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::disallowed_methods)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{API_KEY, charge_body, env_or, fresh_store, start_service_with};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Some((admin, _)) = common::bench_env() else { return Ok(()) };
    let minutes: u64 = env_or("BENCH_SOAK_MINUTES", 30);
    let sample = Duration::from_secs(env_or("BENCH_SOAK_SAMPLE_SECONDS", 60));
    let rate: u64 = env_or("BENCH_SOAK_RATE", 300);
    let bin = std::env::var("IDEM_BIN")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/idem").into());
    let store = fresh_store(&admin, "idem_bench_soak").await?;
    let db = idem_tests::with_database(&admin, "idem_bench_soak");
    store.close().await;
    let svc = start_service_with(&bin, &db, 18110, "on", &[("CLEANUP_INTERVAL", "60s")]).await?;
    println!("idem soak: {rate} requests/s offered for {minutes} min (1 in 10 a replay), RSS every {sample:?}");
    println!("{:>8} {:>10} {:>12} {:>10} {:>10}", "minute", "RSS MB", "answered", "failed", "p99 ms");
    let client = reqwest::Client::new();
    let url = format!("{}/payments", svc.base);
    let (answered, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    // failures by status or transport error
    let failures = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::<String, usize>::new()));
    let latencies = Arc::new(std::sync::Mutex::new(Vec::<Duration>::new()));
    let sent = Arc::new(std::sync::Mutex::new(Vec::<(String, String)>::new()));
    let inflight = Arc::new(tokio::sync::Semaphore::new(256));
    let end = Instant::now() + Duration::from_secs(minutes * 60);
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next_sample = Instant::now() + sample;
    let (started, mut samples, mut n) = (Instant::now(), Vec::new(), 0u64);
    while Instant::now() < end {
        tick.tick().await;
        n += 1;
        let (key, body) = {
            let sent = sent.lock().unwrap();
            if n % 10 == 0 && !sent.is_empty() {
                sent[(n as usize * 7919) % sent.len()].clone()
            } else {
                (uuid::Uuid::new_v4().to_string(), charge_body())
            }
        };
        let Ok(permit) = inflight.clone().try_acquire_owned() else {
            failed.fetch_add(1, Ordering::Relaxed); // more than 256 in flight: counted as a failure
            continue;
        };
        let (client, url, ok_count, fail_count, lat, keys, kinds) = (
            client.clone(),
            url.clone(),
            answered.clone(),
            failed.clone(),
            latencies.clone(),
            sent.clone(),
            failures.clone(),
        );
        tokio::spawn(async move {
            let t = Instant::now();
            let outcome = match idem_tests::charge_request(&client, &url, API_KEY, &key, &body).send().await {
                Ok(r) => r.status().as_u16().to_string(),
                Err(e) if e.is_connect() => "connect error".to_owned(),
                Err(_) => "transport error (connection closed or reset)".to_owned(),
            };
            if outcome == "201" {
                ok_count.fetch_add(1, Ordering::Relaxed);
                lat.lock().unwrap().push(t.elapsed());
                let mut keys = keys.lock().unwrap();
                if keys.len() < 100_000 {
                    keys.push((key, body));
                }
            } else {
                fail_count.fetch_add(1, Ordering::Relaxed);
                *kinds.lock().unwrap().entry(outcome).or_insert(0usize) += 1;
            }
            drop(permit);
        });
        if Instant::now() >= next_sample {
            next_sample += sample;
            let rss = svc.rss_bytes().unwrap_or(0) as f64 / 1e6;
            let mut l = std::mem::take(&mut *latencies.lock().unwrap());
            l.sort_unstable();
            let p99 = l.get(((l.len() as f64 - 1.0) * 0.99).max(0.0) as usize).copied().unwrap_or_default();
            let minute = started.elapsed().as_secs_f64() / 60.0;
            println!(
                "{:>8.1} {:>10.1} {:>12} {:>10} {:>10.2}",
                minute,
                rss,
                answered.load(Ordering::Relaxed),
                failed.load(Ordering::Relaxed),
                p99.as_secs_f64() * 1e3
            );
            samples.push(rss);
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (first, last) = (samples.first().copied().unwrap_or(0.0), samples.last().copied().unwrap_or(0.0));
    let peak = samples.iter().copied().fold(0.0, f64::max);
    println!(
        "RSS after the first sample {first:.1} MB, at the end {last:.1} MB (x{:.2}), peak {peak:.1} MB; {} answered, \
         {} failed",
        last / first.max(1e-9),
        answered.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
    println!("failures: {:?}", failures.lock().unwrap());
    Ok(())
}

//! HTTP benchmark: drives a running `idem serve` over loopback and prints, in one run, requests/s and
//! p50/p99 latency for charges with the idempotency layer, the same charges with the layer off, replays
//! of stored keys, the same charges while the relay does not publish (a diagnostic of what publishing costs
//! on shared cores), and the ceiling — the same SQL transaction one charge executes, run by pgbench at the
//! same concurrency.
//!
//! Run with `scripts/bench.sh http` (builds the release binary and starts the services). Settings:
//! BENCH_CONCURRENCY (8), BENCH_SECONDS (10), BENCH_PHASES (on,replay,off,idle), IDEM_BIN (target/release/idem),
//! DATABASE_URL.

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::disallowed_methods)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{API_KEY, Summary, env_or, fresh_database, pgbench, print_table, start_service};
use serde_json::json;
use uuid::Uuid;

fn charge_body() -> String {
    json!({
        "order_id": Uuid::now_v7(),
        "customer_id": Uuid::now_v7(),
        "provider": "bench",
        "external_payment_id": Uuid::now_v7().to_string(),
        "amount": "12.34",
        "currency": "EUR",
    })
    .to_string()
}

/// Counters read around a phase: relay claims, relay rounds, committed + rolled-back transactions of the
/// benchmark database, then CPU milliseconds of the service, the broker (tansu), PostgreSQL (all
/// processes) and this load generator (`None` where a binary does not expose a counter).
async fn work(svc: &common::Service, db: &str) -> anyhow::Result<[Option<f64>; 7]> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(db).await?;
    // statistics of other backends reach the shared counters within a second
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let xacts: i64 = sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&mut conn)
    .await?;
    conn.close().await?;
    let ms = |s: f64| Some(s * 1000.0);
    Ok([
        svc.metric("idem_outbox_claims_total").await.ok(),
        svc.metric("idem_outbox_rounds_total").await.ok(),
        Some(xacts as f64),
        svc.cpu_seconds().map(|s| s * 1000.0),
        ms(common::cpu_seconds_of("tansu")),
        ms(common::cpu_seconds_of("postgres")),
        common::process_cpu_seconds(std::process::id()).map(|s| s * 1000.0),
    ])
}

/// Two seconds of charges before a measured phase.
async fn warm_up(svc: &common::Service, concurrency: usize) {
    let _ = phase("warm-up", &svc.base, concurrency, Duration::from_secs(2), |_, _| {
        (Uuid::now_v7().to_string(), charge_body())
    })
    .await;
}

/// A warmed-up phase of new charges named `name`, printing what each charge cost: relay claims and rounds,
/// database transactions, and CPU of the service, the broker, PostgreSQL and this load generator.
async fn costed_charges(
    svc: &common::Service,
    db: &str,
    name: &str,
    concurrency: usize,
    duration: Duration,
) -> anyhow::Result<(Summary, Vec<(String, String)>)> {
    warm_up(svc, concurrency).await;
    let before = work(svc, db).await?;
    let (summary, sent) =
        phase(name, &svc.base, concurrency, duration, |_, _| (Uuid::now_v7().to_string(), charge_body())).await;
    let after = work(svc, db).await?;
    let per = |i: usize| match (before[i], after[i]) {
        (Some(b), Some(a)) => format!("{:.3}", (a - b) / summary.ops as f64),
        _ => "n/a".into(),
    };
    println!("per charge ({name}): {} relay claims, {} relay rounds, {} database transactions", per(0), per(1), per(2));
    println!(
        "CPU ms per charge ({name}): service {}, broker {}, PostgreSQL {}, load generator {}",
        per(3),
        per(4),
        per(5),
        per(6)
    );
    Ok((summary, sent))
}

/// One phase: `concurrency` workers sending `make()` requests until `duration` elapses.
///
/// Each worker owns one keep-alive HTTP/1.1 connection (hyper's connection API, driven in the worker's own
/// task: no pool, no connection task) and the whole generator runs on one thread. The generator shares the
/// two cores with what it measures, so every microsecond it spends is taken from the service; it prints
/// its own CPU per charge.
async fn phase<F>(
    name: &str,
    base: &str,
    concurrency: usize,
    duration: Duration,
    make: F,
) -> (Summary, Vec<(String, String)>)
where
    F: Fn(usize, usize) -> (String, String) + 'static,
{
    let make = std::rc::Rc::new(make);
    let start = Instant::now();
    let deadline = start + duration;
    let addr = base.trim_start_matches("http://").to_owned();
    let local = tokio::task::LocalSet::new();
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let (make, addr) = (make.clone(), addr.clone());
        tasks.push(local.spawn_local(async move { worker(&addr, w, deadline, &*make).await }));
    }
    let (mut all, mut errors, mut sent) = (Vec::new(), 0, Vec::new());
    local
        .run_until(async {
            for t in tasks {
                let (l, e, s) = t.await.unwrap();
                all.extend(l);
                errors += e;
                sent.extend(s);
            }
        })
        .await;
    (Summary::from_latencies(name, all, errors, start.elapsed()), sent)
}

/// One client of [`phase`]: latencies of successful charges, failures, and up to 2,000 requests it sent.
async fn worker(
    addr: &str,
    w: usize,
    deadline: Instant,
    make: &dyn Fn(usize, usize) -> (String, String),
) -> (Vec<Duration>, usize, Vec<(String, String)>) {
    use http_body_util::{BodyExt, Full};
    let (mut lat, mut errors, mut sent) = (Vec::new(), 0usize, Vec::new());
    let stream = tokio::net::TcpStream::connect(addr).await.expect("the service listens");
    stream.set_nodelay(true).unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake::<_, Full<bytes::Bytes>>(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("HTTP/1.1 handshake");
    let requests = async {
        let auth = format!("Bearer {API_KEY}");
        let mut i = 0;
        while Instant::now() < deadline {
            let (key, body) = make(w, i);
            i += 1;
            let t = Instant::now();
            let req = http::Request::post("/payments")
                .header(http::header::HOST, addr)
                .header(http::header::AUTHORIZATION, &auth)
                .header("idempotency-key", &key)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(bytes::Bytes::from(body.clone())))
                .unwrap();
            let ok = match sender.send_request(req).await {
                Ok(r) => r.status().as_u16() == 201 && r.into_body().collect().await.is_ok(),
                Err(_) => false,
            };
            if ok {
                lat.push(t.elapsed());
                if sent.len() < 2000 {
                    sent.push((key, body));
                }
            } else {
                errors += 1;
                if sender.ready().await.is_err() {
                    break; // the connection is gone; the rest of the phase counts as nothing sent
                }
            }
        }
        drop(sender);
    };
    let _ = tokio::join!(conn, requests);
    (lat, errors, sent)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let Some((admin, _)) = common::bench_env() else { return Ok(()) };
    let concurrency: usize = env_or("BENCH_CONCURRENCY", 8);
    let seconds: u64 = env_or("BENCH_SECONDS", 10);
    let duration = Duration::from_secs(seconds);
    let bin = std::env::var("IDEM_BIN")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/idem").into());
    let db = fresh_database(&admin, "idem_bench_http").await?;
    println!("idem HTTP benchmark: {concurrency} concurrent clients, {seconds} s per phase, binary {bin}");

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/sql/charge.sql");
    // The ceiling is measured first (fresh tables) and last (after the service's phases wrote theirs):
    // the machine's disk and autovacuum drift between the two, so the ratio uses their mean.
    {
        let store = idem_postgres::PgStore::connect(&db, &idem_postgres::PoolSettings::default()).await?;
        store.migrate().await?;
    }
    let (pg, children) = (common::cpu_seconds_of("postgres"), common::children_cpu_seconds());
    let tps_first = pgbench(&db, script, concurrency, seconds)?;
    let per_tx = |now: f64, then: f64| (now - then) * 1000.0 / (tps_first * seconds as f64);
    println!(
        "CPU ms per transaction (ceiling, first run): PostgreSQL {:.3}, pgbench {:.3}",
        per_tx(common::cpu_seconds_of("postgres"), pg),
        per_tx(common::children_cpu_seconds(), children)
    );
    {
        // its outbox rows are not the service's to publish
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&db).await?;
        sqlx::query("DELETE FROM outbox_message").execute(&mut conn).await?;
        sqlx::query("VACUUM ANALYZE outbox_message").execute(&mut conn).await?;
    }
    // BENCH_PHASES (on,replay,off,idle): the phases to run, for quick comparisons of one setting.
    let phases = std::env::var("BENCH_PHASES").unwrap_or_else(|_| "on,replay,off,idle".into());
    let wanted = |p: &str| phases.split(',').any(|x| x.trim() == p);
    let mut rows = Vec::new();
    let (mut on, mut off, mut replays, mut quiet) = (None, None, None, None);
    if wanted("on") {
        let svc = start_service(&bin, &db, 18080, "on").await?;
        let (charges, sent) = costed_charges(&svc, &db, "charge, idempotency layer on", concurrency, duration).await?;
        if wanted("replay") {
            let pick = Arc::new(sent);
            let (replay, _) = phase("replay of a stored key", &svc.base, concurrency, duration, move |w, i| {
                pick[(w * 7919 + i) % pick.len()].clone()
            })
            .await;
            replays = Some(replay);
        }
        on = Some(charges);
    }
    if wanted("off") {
        let svc = start_service(&bin, &db, 18081, "off").await?;
        warm_up(&svc, concurrency).await;
        let charges = phase("charge, idempotency layer off", &svc.base, concurrency, duration, |_, _| {
            (Uuid::now_v7().to_string(), charge_body())
        })
        .await
        .0;
        off = Some(charges);
    }
    // Diagnostic: the same charges while the relay does not publish (its claims are held off for the
    // phase), to show what publishing every charge costs on cores shared with PostgreSQL and the broker.
    if wanted("idle") {
        let idle = [("OUTBOX_MIN_CLAIM_INTERVAL", "1h"), ("OUTBOX_POLL_INTERVAL", "1h")];
        let svc = common::start_service_with(&bin, &db, 18082, "on", &idle).await?;
        quiet = Some(costed_charges(&svc, &db, "charge, layer on, relay idle", concurrency, duration).await?.0);
    }
    let tps_last = pgbench(&db, script, concurrency, seconds)?;
    let tps = (tps_first + tps_last) / 2.0;
    rows.extend([&on, &off, &replays, &quiet].into_iter().flatten().cloned());
    print_table(&rows);
    println!(
        "{:<44} {:>10} {:>8} {:>12.0}  (first {tps_first:.0}, last {tps_last:.0})",
        "ceiling: same SQL transaction via pgbench", "-", "-", tps
    );
    println!();
    if let (Some(on), Some(off)) = (&on, &off) {
        println!(
            "layer on / layer off          = {:.2}  (layer costs {:.0}% of throughput; target <= 20%)",
            on.rate() / off.rate(),
            (1.0 - on.rate() / off.rate()) * 100.0
        );
    }
    if let Some(on) = &on {
        println!("layer on / pgbench ceiling    = {:.2}  (target >= 0.80)", on.rate() / tps);
    }
    if let Some(quiet) = &quiet {
        println!("relay idle / pgbench ceiling  = {:.2}  (diagnostic: the same, not publishing)", quiet.rate() / tps);
    }
    if let (Some(on), Some(replays)) = (&on, &replays) {
        println!(
            "replay speed-up (p50, rate)   = {:.1}x, {:.1}x  (target >= 2x)",
            on.p50.as_secs_f64() / replays.p50.as_secs_f64().max(1e-9),
            replays.rate() / on.rate()
        );
    }
    Ok(())
}

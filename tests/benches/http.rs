//! HTTP benchmark: drives a running `idem serve` over loopback and prints, in one run, requests/s and
//! p50/p99 latency for charges with the idempotency layer, the same charges with the layer off, replays
//! of stored keys, the same charges while the relay does not publish (a diagnostic of what publishing costs
//! on shared cores), and the ceiling — the same SQL transaction one charge executes, run by pgbench at the
//! same concurrency.
//!
//! The VM's speed drifts by tens of percent within minutes, so the phases compared with the ceiling
//! (layer on, relay idle) are not run once each: they run in BENCH_ROUNDS slices interleaved with slices of
//! the ceiling (ceiling, on, idle, ceiling, on, idle, …, ceiling), each against its own database, and each
//! ratio divides the sums over all slices. Every slice's rate is printed.
//!
//! Run with `scripts/bench.sh http` (builds the release binary and starts the services). Settings:
//! BENCH_CONCURRENCY (8), BENCH_SECONDS (5, per slice), BENCH_ROUNDS (6), BENCH_PHASES (on,replay,off,idle;
//! also pgbouncer, nofast, cleanup, otel: traces exported with every trace sampled and one in a hundred), IDEM_BIN (target/release/idem), DATABASE_URL. At size (`scripts/bench.sh scale`):
//! BENCH_PREFILL_ROWS (0) completed idempotency records written into the service's and the ceiling's tables
//! first, spread over the 48 h retention, and BENCH_KEYS (v7, or v4: random keys as most clients send);
//! with `cleanup` in BENCH_PHASES, BENCH_CLEANUP_PACES ("5000:5ms": rows per DELETE and pause, one cleanup
//! round per pace).

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::disallowed_methods)]

mod common;

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::load::{Slice, phase};
use common::{Summary, charge_body, env_or, fresh_database, pgbench, print_table, start_service};
use uuid::Uuid;

/// Counters read around a phase: relay claims, relay rounds, committed + rolled-back transactions of the
/// benchmark database, then CPU milliseconds of the service, the broker (tansu), PostgreSQL (all
/// processes) and this load generator (`None` where a binary does not expose a counter).
async fn work(svc: &common::Service, db: &str) -> anyhow::Result<[Option<f64>; 11]> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(db).await?;
    // statistics of other backends reach the shared counters within a second
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let xacts: i64 = sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&mut conn)
    .await?;
    let [read, hit, wal, written] = io(&mut conn).await?;
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
        Some(read),
        Some(hit),
        Some(wal),
        Some(written),
    ])
}

/// PostgreSQL's I/O counters: blocks of this database read from outside shared buffers and found in them,
/// and, cluster-wide, WAL bytes written and buffers written out (checkpointer, background writer and
/// backends).
async fn io(conn: &mut sqlx::PgConnection) -> anyhow::Result<[f64; 4]> {
    let (read, hit): (i64, i64) =
        sqlx::query_as("SELECT blks_read, blks_hit FROM pg_stat_database WHERE datname = current_database()")
            .fetch_one(&mut *conn)
            .await?;
    let wal: f64 = sqlx::query_scalar("SELECT wal_bytes::float8 FROM pg_stat_wal").fetch_one(&mut *conn).await?;
    let written: i64 =
        sqlx::query_scalar("SELECT buffers_checkpoint + buffers_clean + buffers_backend FROM pg_stat_bgwriter")
            .fetch_one(&mut *conn)
            .await?;
    Ok([read as f64, hit as f64, wal, written as f64])
}

/// Two seconds of charges before a measured slice.
async fn warm_up(svc: &common::Service, concurrency: usize) {
    let _ = phase(&svc.base, concurrency, Duration::from_secs(2), |_, _| (new_key(), charge_body())).await;
}

/// A client's key: UUID v7 (time-ordered), or v4 (random: every insert lands anywhere in the key index)
/// with BENCH_KEYS=v4.
fn new_key() -> String {
    if std::env::var("BENCH_KEYS").is_ok_and(|k| k == "v4") { Uuid::new_v4() } else { Uuid::now_v7() }.to_string()
}

/// Writes `rows` completed idempotency records of `scope` into `db`, spread over the 48 h retention (keys
/// like BENCH_KEYS), vacuums and analyzes; returns the table's and its indexes' sizes in bytes.
async fn prefill(db: &str, scope: &str, rows: u64) -> anyhow::Result<(i64, i64)> {
    prefill_aged(db, scope, rows, 0, (0, 47)).await
}

/// [`prefill`] with the rows numbered from `first + 1` and created between `hours.0` and `hours.1` hours
/// ago (each expires 48 h after its creation: created more than 48 h ago, it has expired).
async fn prefill_aged(db: &str, scope: &str, rows: u64, first: u64, hours: (u32, u32)) -> anyhow::Result<(i64, i64)> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(db).await?;
    let v4 = std::env::var("BENCH_KEYS").is_ok_and(|k| k == "v4");
    let key = if v4 {
        "gen_random_uuid()::text"
    } else {
        // time-ordered like a v7 key: the creation time leads
        "lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') || '-7000-8000-' || lpad(to_hex(i), 12, '0')"
    };
    let batch = 1_000_000u64;
    let mut done = 0;
    while done < rows {
        let n = batch.min(rows - done);
        let sql = format!(
            "INSERT INTO idempotency_record (scope, key, command_hash, state, status_code, response_headers,
                                             response_body, created_at, expires_at)
             SELECT '{scope}', {key}, sha256(i::text::bytea), 'completed', 201,
                    '[[\"content-type\",\"application/json\"]]', convert_to(repeat('x', 80), 'UTF8'), t,
                    t + interval '48 hours'
             FROM (SELECT i, now() - interval '{min} hours' - random() * interval '{span} hours' AS t
                   FROM generate_series({from}::bigint, {to}::bigint) i) s",
            from = first + done + 1,
            to = first + done + n,
            min = hours.0,
            span = hours.1 - hours.0,
        );
        sqlx::raw_sql(&sql).execute(&mut conn).await?;
        done += n;
        println!("prefilled {done} of {rows} rows in {scope}'s table");
    }
    sqlx::raw_sql("VACUUM ANALYZE idempotency_record").execute(&mut conn).await?;
    let sizes: (i64, i64) =
        sqlx::query_as("SELECT pg_table_size('idempotency_record'), pg_indexes_size('idempotency_record')")
            .fetch_one(&mut conn)
            .await?;
    conn.close().await?;
    Ok(sizes)
}

/// What slices of one phase measured, summed: latencies of successful requests, failures, time, the
/// requests sent (for replays), each slice's rate, and the counters of [`work`] (deltas, summed; `None`
/// once a slice could not read one).
struct Measured {
    latencies: Vec<Duration>,
    errors: usize,
    elapsed: Duration,
    sent: Vec<(String, String)>,
    rates: Vec<f64>,
    work: [Option<f64>; 11],
}

impl Default for Measured {
    fn default() -> Self {
        Self {
            latencies: Vec::new(),
            errors: 0,
            elapsed: Duration::ZERO,
            sent: Vec::new(),
            rates: Vec::new(),
            work: [Some(0.0); 11],
        }
    }
}

impl Measured {
    fn add(&mut self, slice: Slice) {
        self.rates.push(slice.latencies.len() as f64 / slice.elapsed.as_secs_f64().max(1e-9));
        self.latencies.extend(slice.latencies);
        self.errors += slice.errors;
        self.elapsed += slice.elapsed;
        self.sent.extend(slice.sent);
    }

    fn add_work(&mut self, before: [Option<f64>; 11], after: [Option<f64>; 11]) {
        for (i, sum) in self.work.iter_mut().enumerate() {
            *sum = match (*sum, before[i], after[i]) {
                (Some(s), Some(b), Some(a)) => Some(s + a - b),
                _ => None,
            };
        }
    }

    fn summary(&self, name: &str) -> Summary {
        Summary::from_latencies(name, self.latencies.clone(), self.errors, self.elapsed)
    }

    /// Prints what each charge cost: relay claims and rounds, database transactions, and CPU of the
    /// service, the broker, PostgreSQL and this load generator.
    fn print_costs(&self, name: &str) {
        let ops = self.latencies.len().max(1) as f64;
        let per = |i: usize| self.work[i].map_or_else(|| "n/a".into(), |v| format!("{:.3}", v / ops));
        println!(
            "per charge ({name}): {} relay claims, {} relay rounds, {} database transactions",
            per(0),
            per(1),
            per(2)
        );
        println!(
            "CPU ms per charge ({name}): service {}, broker {}, PostgreSQL {}, load generator {}",
            per(3),
            per(4),
            per(5),
            per(6)
        );
        println!(
            "I/O per charge ({name}): blocks read {}, blocks hit {}, WAL bytes {}, buffers written {}",
            per(7),
            per(8),
            per(9),
            per(10)
        );
    }
}

/// One warmed-up slice of new charges, added to `into` with its counters.
async fn charges_slice(svc: &common::Service, db: &str, concurrency: usize, duration: Duration, into: &mut Measured) {
    warm_up(svc, concurrency).await;
    let before = work(svc, db).await.unwrap_or([None; 11]);
    let slice = phase(&svc.base, concurrency, duration, |_, _| (new_key(), charge_body())).await;
    let after = work(svc, db).await.unwrap_or([None; 11]);
    into.add(slice);
    into.add_work(before, after);
}

/// The ceiling's slices: pgbench's transactions per second, and the CPU PostgreSQL and pgbench spent.
#[derive(Default)]
struct Ceiling {
    transactions: f64,
    seconds: f64,
    rates: Vec<f64>,
    postgres_ms: f64,
    pgbench_ms: f64,
    /// Deltas of [`io`] summed over the slices.
    io: [f64; 4],
}

impl Ceiling {
    /// One slice of pgbench on `db`; its outbox rows are then removed (the service's relay keeps its own
    /// outbox small), outside the measured time.
    async fn slice(&mut self, db: &str, script: &str, concurrency: usize, seconds: u64) -> anyhow::Result<()> {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(db).await?;
        let before = io(&mut conn).await?;
        let (pg, children) = (common::cpu_seconds_of("postgres"), common::children_cpu_seconds());
        let tps = pgbench(db, script, concurrency, seconds)?;
        self.postgres_ms += (common::cpu_seconds_of("postgres") - pg) * 1000.0;
        self.pgbench_ms += (common::children_cpu_seconds() - children) * 1000.0;
        self.transactions += tps * seconds as f64;
        self.seconds += seconds as f64;
        self.rates.push(tps);
        // statistics of other backends reach the shared counters within a second
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let after = io(&mut conn).await?;
        for (sum, (b, a)) in self.io.iter_mut().zip(before.iter().zip(after)) {
            *sum += a - b;
        }
        sqlx::query("TRUNCATE outbox_message").execute(&mut conn).await?;
        conn.close().await?;
        Ok(())
    }

    fn rate(&self) -> f64 {
        self.transactions / self.seconds.max(1e-9)
    }
}

fn rates(r: &[f64]) -> String {
    r.iter().map(|v| format!("{v:.0}")).collect::<Vec<_>>().join(" / ")
}

/// Adds `rows / 2` expired records to `db`, measures two slices of charges, then slices while
/// `idem cleanup --once` runs until it exits. Returns the charges without and with cleanup, the rows it
/// deleted and how long it took.
async fn cleanup_during_traffic(
    svc: &common::Service,
    db: &str,
    bin: &str,
    concurrency: usize,
    duration: Duration,
    rows: u64,
    (batch, pause): (&str, &str),
) -> anyhow::Result<(Summary, Summary, u64, Duration)> {
    let expired = rows / 2;
    prefill_aged(db, "bench", expired, rows, (49, 72)).await?;
    let (mut without, mut with) = (Measured::default(), Measured::default());
    for _ in 0..2 {
        charges_slice(svc, db, concurrency, duration, &mut without).await;
    }
    let started = Instant::now();
    let mut child = std::process::Command::new(bin)
        .args(["cleanup", "--once", "--database-url", db, "--cleanup-batch-size", batch, "--cleanup-pause", pause])
        .env("RUST_LOG", "warn")
        .spawn()?;
    // its end is noted as it happens, not when the slice running then ends
    let waiter = std::thread::spawn(move || (child.wait().is_ok_and(|s| s.success()), started.elapsed()));
    while !waiter.is_finished() {
        charges_slice(svc, db, concurrency, duration, &mut with).await;
    }
    let (ok, took) = waiter.join().map_err(|_| anyhow::anyhow!("the cleanup waiter panicked"))?;
    anyhow::ensure!(ok, "idem cleanup --once failed");
    Ok((without.summary("charge, no cleanup running"), with.summary("charge while cleanup deletes"), expired, took))
}

/// An OTLP receiver (`idem_tests::otlp`) served by a runtime on a thread of its own, so decoding spans
/// takes nothing from the load generator's thread.
fn otlp_receiver() -> anyhow::Result<(std::sync::Arc<idem_tests::otlp::Receiver>, String)> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        runtime.block_on(async move {
            let started = idem_tests::otlp::start().await;
            let _ = tx.send(started.map_err(|e| e.to_string()));
            std::future::pending::<()>().await;
        });
    });
    rx.recv()?.map_err(anyhow::Error::msg)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let Some((admin, _)) = common::bench_env() else { return Ok(()) };
    let concurrency: usize = env_or("BENCH_CONCURRENCY", 8);
    let seconds: u64 = env_or("BENCH_SECONDS", 5);
    let rounds: usize = env_or("BENCH_ROUNDS", 6usize).max(1);
    let duration = Duration::from_secs(seconds);
    let bin = std::env::var("IDEM_BIN")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/idem").into());
    println!(
        "idem HTTP benchmark: {concurrency} concurrent clients, {rounds} rounds of {seconds} s slices, binary {bin}"
    );
    // One database per service and one for the ceiling: no relay publishes another phase's rows, and the
    // service can stay up (idle) while pgbench runs.
    let mut dbs = Vec::new();
    for name in [
        "idem_bench_http",
        "idem_bench_http_idle",
        "idem_bench_http_ceiling",
        "idem_bench_http_pgbouncer",
        "idem_bench_http_nofast",
        "idem_bench_http_traced",
        "idem_bench_http_sampled",
    ] {
        let db = fresh_database(&admin, name).await?;
        let store = idem_postgres::PgStore::connect(&db, &idem_postgres::PoolSettings::default()).await?;
        store.migrate_schema_first(&idem_tests::REFERENCE_MIGRATOR).await?;
        store.close().await;
        dbs.push(db);
    }
    let (db, idle_db, ceiling_db, pooled_db, nofast_db) = (&dbs[0], &dbs[1], &dbs[2], &dbs[3], &dbs[4]);
    let (traced_db, sampled_db) = (&dbs[5], &dbs[6]);
    let prefill_rows: u64 = env_or("BENCH_PREFILL_ROWS", 0);
    if prefill_rows > 0 {
        let started = Instant::now();
        let (table, indexes) = prefill(db, "bench", prefill_rows).await?;
        prefill(ceiling_db, "pgbench", prefill_rows).await?;
        let per_million = |bytes: i64| bytes as f64 / 1e6 / (prefill_rows as f64 / 1e6);
        println!(
            "idempotency_record at {prefill_rows} rows: table {:.0} MB, indexes {:.0} MB ({:.0} and {:.0} MB per \
             million rows); prefilled both in {:?}",
            table as f64 / 1e6,
            indexes as f64 / 1e6,
            per_million(table),
            per_million(indexes),
            started.elapsed()
        );
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/sql/charge.sql");

    // BENCH_PHASES (on,replay,off,idle): the phases to run, for quick comparisons of one setting.
    let phases = std::env::var("BENCH_PHASES").unwrap_or_else(|_| "on,replay,off,idle".into());
    let wanted = |p: &str| phases.split(',').any(|x| x.trim() == p);
    let on_svc = if wanted("on") { Some(start_service(&bin, db, 18080, "on").await?) } else { None };
    // Diagnostic: the same charges while the relay does not publish (its claims are held off), to show what
    // publishing every charge costs on cores shared with PostgreSQL and the broker.
    let idle_svc = if wanted("idle") {
        let idle = [("OUTBOX_MIN_CLAIM_INTERVAL", "1h"), ("OUTBOX_POLL_INTERVAL", "1h")];
        Some(common::start_service_with(&bin, idle_db, 18082, "on", &idle).await?)
    } else {
        None
    };
    // Not in the default phases: the same charges through PgBouncer (transaction pooling, as many server
    // connections as the service's pool), with DATABASE_POOLER=transaction, interleaved with the direct ones.
    let bouncer = if wanted("pgbouncer") {
        let port = sqlx::postgres::PgConnectOptions::from_str(pooled_db)?.get_port();
        Some(idem_tests::infra::PgBouncer::start(port, 32).await?)
    } else {
        None
    };
    let pooled_svc = match &bouncer {
        Some(b) => {
            let env = [("DATABASE_POOLER", "transaction"), ("DATABASE_DIRECT_URL", pooled_db.as_str())];
            Some(common::start_service_with(&bin, &b.url_for(pooled_db)?, 18083, "on", &env).await?)
        }
        None => None,
    };
    // Not in the default phases: the same charges with the replay fast path off (its read before every
    // claim is what first executions pay for it), interleaved with the others.
    let nofast_svc = if wanted("nofast") {
        let env = [("IDEMPOTENCY_REPLAY_FAST_PATH", "never")];
        Some(common::start_service_with(&bin, nofast_db, 18084, "on", &env).await?)
    } else {
        None
    };
    // Not in the default phases (`otel`): the same charges with traces exported over OTLP to a receiver on a
    // thread of its own, every trace sampled, and one in a hundred; the `on` service is tracing off.
    let receiver = if wanted("otel") { Some(otlp_receiver()?) } else { None };
    let traced_svcs = match &receiver {
        Some((_, endpoint)) => {
            let env = |sampler: &'static str, arg: &'static str| {
                [
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
                    ("OTEL_TRACES_SAMPLER", sampler),
                    ("OTEL_TRACES_SAMPLER_ARG", arg),
                ]
            };
            let all = common::start_service_with(&bin, traced_db, 18085, "on", &env("always_on", "1")).await?;
            let some = common::start_service_with(&bin, sampled_db, 18086, "on", &env("traceidratio", "0.01")).await?;
            Some((all, some))
        }
        None => None,
    };
    let (mut traced, mut sampled) = (Measured::default(), Measured::default());
    let (mut ceiling, mut on, mut quiet) = (Ceiling::default(), Measured::default(), Measured::default());
    let (mut pooled, mut nofast) = (Measured::default(), Measured::default());
    for _ in 0..rounds {
        ceiling.slice(ceiling_db, script, concurrency, seconds).await?;
        if let Some(svc) = &on_svc {
            charges_slice(svc, db, concurrency, duration, &mut on).await;
        }
        if let Some(svc) = &idle_svc {
            charges_slice(svc, idle_db, concurrency, duration, &mut quiet).await;
        }
        if let Some(svc) = &pooled_svc {
            charges_slice(svc, pooled_db, concurrency, duration, &mut pooled).await;
        }
        if let Some(svc) = &nofast_svc {
            charges_slice(svc, nofast_db, concurrency, duration, &mut nofast).await;
        }
        if let Some((all, some)) = &traced_svcs {
            charges_slice(all, traced_db, concurrency, duration, &mut traced).await;
            charges_slice(some, sampled_db, concurrency, duration, &mut sampled).await;
        }
    }
    drop(traced_svcs);
    if let Some((spans, _)) = &receiver {
        println!("the OTLP receiver took {} spans", spans.spans().len());
    }
    drop(pooled_svc);
    drop(bouncer);
    ceiling.slice(ceiling_db, script, concurrency, seconds).await?;
    drop(idle_svc);

    let on_summary = on_svc.is_some().then(|| on.summary("charge, idempotency layer on"));
    let replays = match &on_svc {
        Some(svc) if wanted("replay") => {
            let pick = Arc::new(std::mem::take(&mut on.sent));
            let replay = phase(&svc.base, concurrency, duration, move |w, i| pick[(w * 7919 + i) % pick.len()].clone());
            Some(replay.await.summary("replay of a stored key"))
        }
        _ => None,
    };
    // At size (BENCH_PHASES with `cleanup`): a day's worth of expired records (half the prefill, created
    // 48.5–72 h ago) is added, then charges run in slices before and while `idem cleanup --once` deletes
    // them in its batches, once per pace of BENCH_CLEANUP_PACES (`rows:pause` each, "5000:5ms" = the default).
    let mut cleanup = Vec::new();
    if let Some(svc) = on_svc.as_ref().filter(|_| wanted("cleanup") && prefill_rows > 0) {
        for pace in std::env::var("BENCH_CLEANUP_PACES").unwrap_or_else(|_| "5000:5ms".into()).split_whitespace() {
            let (batch, pause) = pace.split_once(':').ok_or_else(|| anyhow::anyhow!("a pace is rows:pause"))?;
            let measured =
                cleanup_during_traffic(svc, db, &bin, concurrency, duration, prefill_rows, (batch, pause)).await?;
            cleanup.push((pace.to_owned(), measured));
        }
    }
    drop(on_svc);
    let nofast_replays = match &nofast_svc {
        Some(svc) => {
            let pick = Arc::new(std::mem::take(&mut nofast.sent));
            let replay = phase(&svc.base, concurrency, duration, move |w, i| pick[(w * 7919 + i) % pick.len()].clone());
            Some(replay.await.summary("replay, fast path off"))
        }
        None => None,
    };
    drop(nofast_svc);
    let off = if wanted("off") {
        let svc = start_service(&bin, db, 18081, "off").await?;
        warm_up(&svc, concurrency).await;
        let off = phase(&svc.base, concurrency, duration, |_, _| (new_key(), charge_body())).await;
        Some(off.summary("charge, idempotency layer off"))
    } else {
        None
    };
    let quiet_summary = wanted("idle").then(|| quiet.summary("charge, layer on, relay idle"));
    let pooled_summary = wanted("pgbouncer").then(|| pooled.summary("charge through PgBouncer (transaction)"));
    let nofast_summary = wanted("nofast").then(|| nofast.summary("charge, replay fast path off"));
    let traced_summary = wanted("otel").then(|| traced.summary("charge, traces exported, all sampled"));
    let sampled_summary = wanted("otel").then(|| sampled.summary("charge, traces exported, 1 % sampled"));
    let rows: Vec<Summary> = [
        &on_summary,
        &replays,
        &off,
        &quiet_summary,
        &pooled_summary,
        &nofast_summary,
        &nofast_replays,
        &traced_summary,
        &sampled_summary,
    ]
    .into_iter()
    .flatten()
    .cloned()
    .collect();
    print_table(&rows);
    let tps = ceiling.rate();
    println!("{:<44} {:>10} {:>8} {:>12.0}", "ceiling: same SQL transaction via pgbench", "-", "-", tps);
    println!();
    println!("slices (charges/s): ceiling {}", rates(&ceiling.rates));
    if on_summary.is_some() {
        println!("slices (charges/s): layer on {}", rates(&on.rates));
    }
    if quiet_summary.is_some() {
        println!("slices (charges/s): relay idle {}", rates(&quiet.rates));
    }
    if pooled_summary.is_some() {
        println!("slices (charges/s): through PgBouncer {}", rates(&pooled.rates));
    }
    if traced_summary.is_some() {
        println!("slices (charges/s): traced, all sampled {}", rates(&traced.rates));
        println!("slices (charges/s): traced, 1 % sampled {}", rates(&sampled.rates));
        let sum = |m: &Measured| m.rates.iter().sum::<f64>();
        println!("traced all sampled / tracing off = {:.3}", sum(&traced) / sum(&on).max(1e-9));
        println!("traced 1 % sampled / tracing off = {:.3}  (target >= 0.97)", sum(&sampled) / sum(&on).max(1e-9));
    }
    let per_tx = |ms: f64| ms / ceiling.transactions.max(1.0);
    println!(
        "CPU ms per transaction (ceiling): PostgreSQL {:.3}, pgbench {:.3}",
        per_tx(ceiling.postgres_ms),
        per_tx(ceiling.pgbench_ms)
    );
    println!(
        "I/O per transaction (ceiling): blocks read {:.3}, blocks hit {:.3}, WAL bytes {:.3}, buffers written {:.3}",
        per_tx(ceiling.io[0]),
        per_tx(ceiling.io[1]),
        per_tx(ceiling.io[2]),
        per_tx(ceiling.io[3])
    );
    if on_summary.is_some() {
        on.print_costs("layer on");
    }
    if quiet_summary.is_some() {
        quiet.print_costs("relay idle");
    }
    if pooled_summary.is_some() {
        pooled.print_costs("through PgBouncer");
    }
    println!();
    if let (Some(on), Some(off)) = (&on_summary, &off) {
        println!(
            "layer on / layer off          = {:.2}  (layer costs {:.0}% of throughput; target <= 20%)",
            on.rate() / off.rate(),
            (1.0 - on.rate() / off.rate()) * 100.0
        );
    }
    if let Some(on) = &on_summary {
        println!("layer on / pgbench ceiling    = {:.2}  (target >= 0.80)", on.rate() / tps);
    }
    if let Some(quiet) = &quiet_summary {
        println!("relay idle / pgbench ceiling  = {:.2}  (diagnostic: the same, not publishing)", quiet.rate() / tps);
    }
    if let (Some(on), Some(nofast_rate)) = (&on_summary, &nofast_summary) {
        println!("slices (charges/s): fast path off {}", rates(&nofast.rates));
        println!(
            "first executions: fast path on / off = {:.2}  (same run, interleaved slices: what its read costs)",
            on.rate() / nofast_rate.rate()
        );
    }
    if let (Some(replays), Some(nofast_replays)) = (&replays, &nofast_replays) {
        println!("replays: fast path on / off      = {:.2}", replays.rate() / nofast_replays.rate());
    }
    for (pace, (without, with, deleted, took)) in &cleanup {
        print_table(&[without.clone(), with.clone()]);
        println!(
            "cleanup during traffic at {pace} (rows per DELETE:pause): {deleted} expired rows deleted in {took:.1?} \
             ({:.0} rows/s); charges/s {:.2} and p99 {:.2}x of the slices without it (target p99 <= 2x)",
            *deleted as f64 / took.as_secs_f64().max(1e-9),
            with.rate() / without.rate().max(1e-9),
            with.p99.as_secs_f64() / without.p99.as_secs_f64().max(1e-9)
        );
    }
    if let (Some(on), Some(pooled)) = (&on_summary, &pooled_summary) {
        println!("through PgBouncer / direct    = {:.2}  (same run, interleaved slices)", pooled.rate() / on.rate());
    }
    if let (Some(on), Some(replays)) = (&on_summary, &replays) {
        println!(
            "replay speed-up (p50, rate)   = {:.1}x, {:.1}x  (target >= 2x)",
            on.p50.as_secs_f64() / replays.p50.as_secs_f64().max(1e-9),
            replays.rate() / on.rate()
        );
    }
    Ok(())
}

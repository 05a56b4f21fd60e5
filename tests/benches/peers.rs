//! idem side by side with the libraries a user would pick instead, in one run on the same PostgreSQL and
//! broker, each with a fresh database (`scripts/bench.sh peers` builds and installs the peers into .local/):
//!
//! - **HTTP**: idem's `POST /payments` against an axum service using the crates.io crate `axum-idempotent`
//!   (peers/axum-idempotent: the same business write, payment row with its UNIQUE constraint + outbox row in
//!   one transaction). Fresh keys, then replays of stored keys, at each of BENCH_PEER_CLIENTS (8 64) clients,
//!   in BENCH_ROUNDS (4) interleaved slices of BENCH_SECONDS (5); charges/s, p50/p99 and CPU per charge of the
//!   service and of PostgreSQL. Then the guarantees, demonstrated against both: the same key with another
//!   body, concurrent duplicates, and a SIGKILL between effect and record followed by retries.
//! - **Outbox**: idem's relay against `pg-transactional-outbox` (npm; polling listener, kafkajs producer),
//!   see [`outbox`].
//! - **Inbox**: idem's consumer (processed_event in the business transaction) against the same library's
//!   inbox (kafkajs consumer storing into its inbox table, polling listener applying), see [`inbox`].
//!
//! - **Profile** (BENCH_PEER_PARTS=profile, not by default): where PostgreSQL's work per charge goes, see
//!   [`profile`].
//!
//! Settings: PEER_AXUM_BIN (.local/peers/target/release/peer-axum-idempotent), PEER_OUTBOX_DIR
//! (.local/peers/outbox), IDEM_BIN, DATABASE_URL, KAFKA_BROKERS, BENCH_PEER_PARTS
//! (http,guarantees,outbox,inbox), BENCH_PEER_LAYOUTS (shared,per-client), BENCH_PEER_RELAY (idle; `on`
//! runs idem's relay during the HTTP part), BENCH_IDEM_BEFORE (an older `idem` binary measured alongside).

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::disallowed_methods)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::load::{Target, phase_on};
use common::{Service, Summary, charge_body, env_or, fresh_database, start_process, start_service_with};
use uuid::Uuid;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// The two services under test, started on fresh databases.
struct Pair {
    idem: Service,
    peer: Service,
    idem_db: String,
    peer_db: String,
    peer_target: Target,
}

async fn migrated(admin: &str, name: &str) -> anyhow::Result<String> {
    let db = fresh_database(admin, name).await?;
    let store = idem_postgres::PgStore::connect(&db, &idem_postgres::PoolSettings::default()).await?;
    store.migrate_schema_first(&idem_tests::REFERENCE_MIGRATOR).await?;
    store.close().await;
    Ok(db)
}

/// Opens `n` sessions on the peer and returns their cookies (`session=…`).
async fn sessions(base: &str, n: usize) -> anyhow::Result<Vec<String>> {
    let client = reqwest::Client::new();
    let mut cookies = Vec::new();
    for _ in 0..n {
        let r = client.post(format!("{base}/session")).send().await?;
        let cookie = r
            .headers()
            .get(reqwest::header::SET_COOKIE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .ok_or_else(|| anyhow::anyhow!("the peer set no session cookie"))?;
        cookies.push(cookie.to_owned());
    }
    Ok(cookies)
}

/// idem's service `bin` on `db` and `port`, its merchant limit at `clients` (one merchant drives every
/// client: its limit must not be what is measured). Its relay idles unless BENCH_PEER_RELAY=on: the peer
/// publishes nothing, so like for like both write the payment and its outbox row and neither publishes.
async fn start_idem_bin(bin: &str, db: &str, port: u16, clients: usize) -> anyhow::Result<Service> {
    let limit = clients.max(16).to_string();
    let mut env = vec![("MERCHANT_CONCURRENCY", limit.as_str())];
    if std::env::var("BENCH_PEER_RELAY").as_deref() != Ok("on") {
        env.extend([("OUTBOX_MIN_CLAIM_INTERVAL", "1h"), ("OUTBOX_POLL_INTERVAL", "1h")]);
    }
    start_service_with(bin, db, port, "on", &env).await
}

/// idem's service (IDEM_BIN) on `db`: see [`start_idem_bin`].
async fn start_idem(db: &str, clients: usize) -> anyhow::Result<Service> {
    let bin = std::env::var("IDEM_BIN").unwrap_or_else(|_| format!("{ROOT}/target/release/idem"));
    start_idem_bin(&bin, db, 18100, clients).await
}

/// The axum-idempotent peer on `db`.
async fn start_peer(db: &str) -> anyhow::Result<Service> {
    let bin = std::env::var("PEER_AXUM_BIN")
        .unwrap_or_else(|_| format!("{ROOT}/.local/peers/target/release/peer-axum-idempotent"));
    start_process(&bin, 18102, &[("DATABASE_URL", db), ("PORT", "18102")]).await
}

async fn start_pair(admin: &str, tag: &str, clients: usize) -> anyhow::Result<Pair> {
    let idem_db = migrated(admin, &format!("idem_bench_peers_idem_{tag}")).await?;
    let peer_db = migrated(admin, &format!("idem_bench_peers_axum_{tag}")).await?;
    let idem = start_idem(&idem_db, clients).await?;
    let peer = start_peer(&peer_db).await?;
    let peer_target = Target { addr: "127.0.0.1:18102".into(), bearer: None, cookies: sessions(&peer.base, 1).await? };
    Ok(Pair { idem, peer, idem_db, peer_db, peer_target })
}

/// Slices of one side summed: latencies, time, per-slice rates, CPU of the service and PostgreSQL.
#[derive(Default)]
struct Side {
    latencies: Vec<Duration>,
    errors: usize,
    elapsed: Duration,
    rates: Vec<f64>,
    service_ms: f64,
    postgres_ms: f64,
    sent: Vec<(String, String)>,
}

impl Side {
    fn summary(&self, name: &str) -> Summary {
        Summary::from_latencies(name, self.latencies.clone(), self.errors, self.elapsed)
    }

    fn per_op(&self, ms: f64) -> f64 {
        ms / self.latencies.len().max(1) as f64
    }

    /// One line of the HTTP tables: operations, errors, rate, latencies, CPU per operation.
    fn print_row(&self, name: &str) {
        let s = self.summary(name);
        println!(
            "{:<40} {:>10} {:>8} {:>10.0} {:>9.2} {:>9.2} {:>14.3} {:>14.3}",
            name,
            s.ops,
            s.errors,
            s.rate(),
            s.p50.as_secs_f64() * 1e3,
            s.p99.as_secs_f64() * 1e3,
            self.per_op(self.service_ms),
            self.per_op(self.postgres_ms)
        );
    }
}

/// One measured slice of `make` against `target`, served by `svc`, added to `side`.
async fn slice<F>(svc: &Service, target: &Target, clients: usize, seconds: u64, side: &mut Side, make: F)
where
    F: Fn(usize, usize) -> (String, String) + 'static,
{
    let (svc0, pg0) = (svc.cpu_seconds().unwrap_or(0.0), common::cpu_seconds_of("postgres"));
    let s = phase_on(target, clients, Duration::from_secs(seconds), make).await;
    side.service_ms += (svc.cpu_seconds().unwrap_or(0.0) - svc0) * 1000.0;
    side.postgres_ms += (common::cpu_seconds_of("postgres") - pg0) * 1000.0;
    side.rates.push(s.latencies.len() as f64 / s.elapsed.as_secs_f64().max(1e-9));
    side.latencies.extend(s.latencies);
    side.errors += s.errors;
    side.elapsed += s.elapsed;
    side.sent.extend(s.sent);
}

fn rates(r: &[f64]) -> String {
    r.iter().map(|v| format!("{v:.0}")).collect::<Vec<_>>().join(" / ")
}

/// How the peer's clients hold its sessions (axum-idempotent caches a response only within a session, and a
/// key is scoped by it). Both are realistic: one service calling another keeps one session (a shared API
/// client: every worker may retry any key), while browsers and per-connection API clients open a session
/// each (a client retries only its own keys). idem's keys are scoped by the API key either way.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Layout {
    SharedSession,
    SessionPerClient,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::SharedSession => "one shared session",
            Layout::SessionPerClient => "a session per client",
        }
    }
}

/// A random (v4) key whose first byte names client `w`: in the session-per-client layout a client replays
/// only keys it sent itself (another session would not find them).
fn key_of(w: usize) -> String {
    let mut bytes = *Uuid::new_v4().as_bytes();
    bytes[0] = (w % 256) as u8;
    uuid::Builder::from_random_bytes(bytes).into_uuid().to_string()
}

/// Fresh charges and replays, idem and the peer in interleaved slices, at `clients` clients, the peer in
/// each session layout (BENCH_PEER_LAYOUTS: `shared`, `per-client`; both by default).
async fn http(admin: &str, clients: usize) -> anyhow::Result<()> {
    let layouts = std::env::var("BENCH_PEER_LAYOUTS").unwrap_or_else(|_| "shared,per-client".into());
    for layout in [Layout::SharedSession, Layout::SessionPerClient] {
        let tag = if layout == Layout::SharedSession { "shared" } else { "per-client" };
        if layouts.split(',').any(|l| l.trim() == tag) {
            http_layout(admin, clients, layout).await?;
        }
    }
    Ok(())
}

async fn http_layout(admin: &str, clients: usize, layout: Layout) -> anyhow::Result<()> {
    let seconds: u64 = env_or("BENCH_SECONDS", 5);
    let rounds: usize = env_or("BENCH_ROUNDS", 4usize).max(1);
    let tag = format!("{clients}_{}", if layout == Layout::SharedSession { "s" } else { "c" });
    let mut pair = start_pair(admin, &tag, clients).await?;
    if layout == Layout::SessionPerClient {
        pair.peer_target.cookies = sessions(&pair.peer.base, clients).await?;
    }
    let idem_target = Target::idem(&pair.idem.base);
    let fresh = |w: usize, _: usize| (key_of(w), charge_body());
    // warm-up of both (connections, caches)
    let _ = phase_on(&idem_target, clients, Duration::from_secs(2), fresh).await;
    let _ = phase_on(&pair.peer_target, clients, Duration::from_secs(2), fresh).await;
    let (mut idem_first, mut peer_first) = (Side::default(), Side::default());
    for _ in 0..rounds {
        slice(&pair.idem, &idem_target, clients, seconds, &mut idem_first, fresh).await;
        slice(&pair.peer, &pair.peer_target, clients, seconds, &mut peer_first, fresh).await;
    }
    // Replays of stored keys: with one shared session any client may replay any key (as every client of
    // idem shares one API key); with a session per client, each replays the keys it sent itself.
    let replays_of = |side: &Side| {
        let mut by_client: Vec<Vec<(String, String)>> = vec![Vec::new(); clients];
        for (key, body) in &side.sent {
            let w = usize::from(Uuid::parse_str(key).map(|u| u.as_bytes()[0]).unwrap_or(0)) % clients;
            let owner = if layout == Layout::SharedSession { by_client.len() - 1 } else { w };
            by_client[owner].push((key.clone(), body.clone()));
        }
        if layout == Layout::SharedSession {
            let all = by_client.pop().unwrap_or_default();
            by_client = vec![all; clients];
        }
        Arc::new(by_client)
    };
    let (idem_sent, peer_sent) = (replays_of(&idem_first), replays_of(&peer_first));
    let (mut idem_replay, mut peer_replay) = (Side::default(), Side::default());
    for _ in 0..rounds {
        let pick = idem_sent.clone();
        slice(&pair.idem, &idem_target, clients, seconds, &mut idem_replay, move |w, i| {
            let own = &pick[w];
            own[(w * 7919 + i) % own.len().max(1)].clone()
        })
        .await;
        let pick = peer_sent.clone();
        slice(&pair.peer, &pair.peer_target, clients, seconds, &mut peer_replay, move |w, i| {
            let own = &pick[w];
            own[(w * 7919 + i) % own.len().max(1)].clone()
        })
        .await;
    }
    println!();
    println!(
        "HTTP, {clients} clients, the peer with {}, {rounds} interleaved slices of {seconds} s per phase:",
        layout.name()
    );
    println!(
        "{:<40} {:>10} {:>8} {:>10} {:>9} {:>9} {:>14} {:>14}",
        "phase", "ops", "errors", "ops/s", "p50 ms", "p99 ms", "service CPU ms", "PostgreSQL ms"
    );
    for (name, side) in [
        ("idem: new charges", &idem_first),
        ("axum-idempotent: new charges", &peer_first),
        ("idem: replays", &idem_replay),
        ("axum-idempotent: replays", &peer_replay),
    ] {
        side.print_row(name);
    }
    println!("slices (ops/s): idem new {} | peer new {}", rates(&idem_first.rates), rates(&peer_first.rates));
    println!("slices (ops/s): idem replay {} | peer replay {}", rates(&idem_replay.rates), rates(&peer_replay.rates));
    let ratio = |a: &Side, b: &Side| a.summary("").rate() / b.summary("").rate().max(1e-9);
    let cpu = |a: &Side| a.per_op(a.service_ms + a.postgres_ms);
    println!(
        "idem / axum-idempotent at {clients} clients, {}: new charges {:.2}x, replays {:.2}x; PostgreSQL CPU per \
         new charge {:.3} vs {:.3} ms; CPU (service + PostgreSQL) per new charge {:.3} vs {:.3} ms, per replay \
         {:.3} vs {:.3} ms",
        layout.name(),
        ratio(&idem_first, &peer_first),
        ratio(&idem_replay, &peer_replay),
        idem_first.per_op(idem_first.postgres_ms),
        peer_first.per_op(peer_first.postgres_ms),
        cpu(&idem_first),
        cpu(&peer_first),
        cpu(&idem_replay),
        cpu(&peer_replay)
    );
    if layout == Layout::SharedSession
        && let Ok(bin) = std::env::var("BENCH_IDEM_BEFORE")
        && !bin.is_empty()
    {
        // the peer stopped first: three services' pools would exceed the server's max_connections
        let Pair { idem, peer, .. } = pair;
        drop(peer);
        before_after(admin, &bin, &tag, clients, &idem, &idem_target).await?;
    }
    if std::env::var("BENCH_PEER_RELAY").as_deref() == Ok("on") {
        println!("(idem publishes every charge through its relay to the broker meanwhile; the peer publishes nothing)");
    } else {
        println!(
            "(both write the payment and its outbox row; neither publishes: idem's relay idles, BENCH_PEER_RELAY=on runs it)"
        );
    }
    Ok(())
}

/// New charges on idem against BENCH_IDEM_BEFORE (an older `idem` binary, its relay set the same way), in
/// interleaved slices: the cuts before and after in one run.
async fn before_after(
    admin: &str,
    bin: &str,
    tag: &str,
    clients: usize,
    idem: &Service,
    idem_target: &Target,
) -> anyhow::Result<()> {
    let seconds: u64 = env_or("BENCH_SECONDS", 5);
    let rounds: usize = env_or("BENCH_ROUNDS", 4usize).max(1);
    let db = migrated(admin, &format!("idem_bench_peers_before_{tag}")).await?;
    let before = start_idem_bin(bin, &db, 18104, clients).await?;
    let before_target = Target::idem(&before.base);
    let fresh = |w: usize, _: usize| (key_of(w), charge_body());
    let _ = phase_on(&before_target, clients, Duration::from_secs(2), fresh).await;
    let (mut now, mut then) = (Side::default(), Side::default());
    for _ in 0..rounds {
        slice(idem, idem_target, clients, seconds, &mut now, fresh).await;
        slice(&before, &before_target, clients, seconds, &mut then, fresh).await;
    }
    println!("new charges, idem now against BENCH_IDEM_BEFORE, {clients} clients, {rounds} interleaved slices:");
    for (name, side) in [("idem now", &now), ("idem before", &then)] {
        side.print_row(name);
    }
    println!(
        "idem now / before at {clients} clients: new charges {:.2}x; PostgreSQL CPU per new charge {:.3} vs {:.3} ms; \
         slices now {} | before {}",
        now.summary("").rate() / then.summary("").rate().max(1e-9),
        now.per_op(now.postgres_ms),
        then.per_op(then.postgres_ms),
        rates(&now.rates),
        rates(&then.rates)
    );
    Ok(())
}

/// One request's answer: status and body.
async fn send(client: &reqwest::Client, base: &str, target: &Target, key: &str, body: &str) -> (u16, String) {
    let mut req = client
        .post(format!("{base}/payments"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(b) = &target.bearer {
        req = req.bearer_auth(b);
    }
    if let Some(c) = target.cookies.first() {
        req = req.header("cookie", c);
    }
    match req.send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            (status, r.text().await.unwrap_or_default())
        }
        Err(e) => (0, e.to_string()),
    }
}

/// How an answer reads to the client.
fn class(status: u16, body: &str) -> &'static str {
    match status {
        _ if body.contains("idempotency-key-reused") => "refused: key reused with another request",
        201 => "201 charged",
        409 if body.contains("request-in-flight") => "409 in flight, retry later",
        409 if body.contains("payment-conflict") || body.contains("payment exists") => {
            "409 ran again, stopped by UNIQUE"
        }
        0 => "no answer",
        _ => "other",
    }
}

async fn payments_with(db: &str, external_ids: &[String]) -> anyhow::Result<HashMap<String, i64>> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(db).await?;
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT external_payment_id, count(*) FROM payment WHERE external_payment_id = ANY($1) GROUP BY 1",
    )
    .bind(external_ids)
    .fetch_all(&mut conn)
    .await?;
    conn.close().await?;
    Ok(rows.into_iter().collect())
}

fn external_id(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["external_payment_id"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn tally(answers: &[(u16, String)]) -> String {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for (s, b) in answers {
        let c = class(*s, b);
        match counts.iter_mut().find(|(k, _)| *k == c) {
            Some((_, n)) => *n += 1,
            None => counts.push((c, 1)),
        }
    }
    counts.iter().map(|(k, n)| format!("{n} × {k}")).collect::<Vec<_>>().join(", ")
}

/// The guarantees, shown by what each service does (effects counted in its database).
async fn guarantees(admin: &str) -> anyhow::Result<()> {
    let mut pair = start_pair(admin, "guarantees", 16).await?;
    let client = reqwest::Client::new();
    let idem_target = Target::idem(&pair.idem.base);
    println!();
    println!("Guarantees (each shown against both services; payments counted in their databases):");

    // 1. The same key with another request.
    for (name, base, target, db) in [
        ("idem", pair.idem.base.clone(), idem_target.clone(), pair.idem_db.clone()),
        ("axum-idempotent", pair.peer.base.clone(), pair.peer_target.clone(), pair.peer_db.clone()),
    ] {
        let key = Uuid::new_v4().to_string();
        let (a, b) = (charge_body(), charge_body());
        let first = send(&client, &base, &target, &key, &a).await;
        let second = send(&client, &base, &target, &key, &b).await;
        let made = payments_with(&db, &[external_id(&b)]).await?;
        let replayed_first = second.0 == 201 && second.1 == first.1;
        println!(
            "  same key, another body [{name}]: second answered {} ({}); its payment made: {}; client told it \
             was charged with the first request's payment: {}",
            second.0,
            class(second.0, &second.1),
            made.values().sum::<i64>(),
            if replayed_first { "YES (silently wrong)" } else { "no" }
        );
    }

    // 2. Concurrent duplicates: the same request sent by 8 connections at once, for 20 keys.
    for (name, base, target, db) in [
        ("idem", pair.idem.base.clone(), idem_target.clone(), pair.idem_db.clone()),
        ("axum-idempotent", pair.peer.base.clone(), pair.peer_target.clone(), pair.peer_db.clone()),
    ] {
        let mut answers = Vec::new();
        let mut ids = Vec::new();
        for _ in 0..20 {
            let (key, body) = (Uuid::new_v4().to_string(), charge_body());
            ids.push(external_id(&body));
            let sends = (0..8).map(|_| {
                let (c, base, target, key, body) =
                    (reqwest::Client::new(), base.clone(), target.clone(), key.clone(), body.clone());
                async move { send(&c, &base, &target, &key, &body).await }
            });
            answers.extend(futures::future::join_all(sends).await);
        }
        let made = payments_with(&db, &ids).await?;
        println!(
            "  8 concurrent duplicates × 20 keys [{name}]: payments {} (max per key {}); answers: {}",
            made.values().sum::<i64>(),
            made.values().max().copied().unwrap_or(0),
            tally(&answers)
        );
    }

    // 3. A crash between effect and record: 16 clients charge, the process is SIGKILLed after 1.5 s,
    // restarted, and every request sent is retried once with its key.
    for which in ["idem", "axum-idempotent"] {
        let (svc, target, db) = match which {
            "idem" => (&mut pair.idem, idem_target.clone(), pair.idem_db.clone()),
            _ => (&mut pair.peer, pair.peer_target.clone(), pair.peer_db.clone()),
        };
        let base = svc.base.clone();
        let sent = Arc::new(std::sync::Mutex::new(Vec::<(String, String)>::new()));
        let stop = Instant::now() + Duration::from_secs(30);
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let (base, target, sent) = (base.clone(), target.clone(), sent.clone());
            tasks.push(tokio::spawn(async move {
                let c = reqwest::Client::new();
                while Instant::now() < stop {
                    let (key, body) = (Uuid::new_v4().to_string(), charge_body());
                    sent.lock().unwrap().push((key.clone(), body.clone()));
                    if send(&c, &base, &target, &key, &body).await.0 == 0 {
                        break;
                    }
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        svc.crash();
        for t in tasks {
            let _ = t.await;
        }
        let restarted = match which {
            "idem" => start_idem(&db, 16).await?,
            _ => start_peer(&db).await?,
        };
        *svc = restarted;
        let sent = sent.lock().unwrap().clone();
        let mut answers = Vec::new();
        for (key, body) in &sent {
            answers.push(send(&client, &base, &target, key, body).await);
        }
        let ids: Vec<String> = sent.iter().map(|(_, b)| external_id(b)).collect();
        let made = payments_with(&db, &ids).await?;
        println!(
            "  SIGKILL under load, then every request retried [{which}]: {} requests, payments {} (max per key {}); \
             retries answered: {}",
            sent.len(),
            made.values().sum::<i64>(),
            made.values().max().copied().unwrap_or(0),
            tally(&answers)
        );
    }
    Ok(())
}

/// Where `scripts/bench.sh peers` installed pg-transactional-outbox and its driver script.
fn peer_outbox_dir() -> String {
    std::env::var("PEER_OUTBOX_DIR").unwrap_or_else(|_| format!("{ROOT}/.local/peers/outbox"))
}

/// Runs the outbox peer's script (peers/pg-transactional-outbox/bench.cjs); returns its JSON answer and
/// the CPU seconds its process used.
fn node(dir: &str, env: &[(&str, &str)], args: &[&str]) -> anyhow::Result<(serde_json::Value, f64)> {
    let before = common::children_cpu_seconds();
    let out = std::process::Command::new("node")
        .arg(format!("{dir}/bench.cjs"))
        .args(args)
        .current_dir(dir)
        .envs(env.iter().copied())
        .output()?;
    let cpu = common::children_cpu_seconds() - before;
    anyhow::ensure!(out.status.success(), "peer {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_owned();
    Ok((serde_json::from_str(&line)?, cpu))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let Some((admin, brokers)) = common::bench_env() else { return Ok(()) };
    let parts = std::env::var("BENCH_PEER_PARTS").unwrap_or_else(|_| "http,guarantees,outbox,inbox".into());
    let wanted = |p: &str| parts.split(',').any(|x| x.trim() == p);
    println!("idem side by side with its peers (one run, same PostgreSQL and broker, fresh databases)");
    if wanted("http") {
        for clients in std::env::var("BENCH_PEER_CLIENTS").unwrap_or_else(|_| "8 64".into()).split_whitespace() {
            http(&admin, clients.parse()?).await?;
        }
    }
    if wanted("profile") {
        profile::run().await?;
    }
    if wanted("guarantees") {
        guarantees(&admin).await?;
    }
    if wanted("outbox") {
        outbox::run(&admin, &brokers).await?;
    }
    if wanted("inbox") {
        inbox::run(&admin, &brokers).await?;
    }
    Ok(())
}

/// Outbox relays side by side: idem's relay (in this process) and pg-transactional-outbox's listener
/// publishing through kafkajs (a Node.js child), each from its own fresh database to its own topic on the same
/// broker. Throughput: BENCH_OUTBOX_ROWS (10000) stored messages over 1,000 keys drained; CPU of the relay's
/// process and of PostgreSQL per message. Latency: BENCH_RATE (500) messages/s offered for BENCH_SECONDS (5)
/// by 4 writers, one business transaction each; commit-to-publish p50/p99. First on the shared PostgreSQL
/// with the peer's polling listener; then, unless BENCH_LOGICAL=0, both again on a private cluster with
/// `wal_level = logical` (started here with initdb), where the peer follows its table by logical replication.
mod outbox {
    use std::time::Instant;

    use idem_postgres::PgOutboxWakeup;
    use idem_tests::infra::PrivatePostgres;
    use idem_tests::kafka::{create_topic, unique_topic};

    use super::common::relay::{fill, latency, start_relay, unpublished};
    use super::common::{self, env_or, fresh_database, fresh_store};
    use super::node;

    /// What one side measured.
    struct Relayed {
        name: String,
        rate: f64,
        cpu_ms: f64,
        pg_ms: f64,
        p50_ms: f64,
        p99_ms: f64,
    }

    struct Load {
        rows: i64,
        rate: u64,
        seconds: u64,
    }

    const BATCH: i64 = 2000;

    fn per(cpu: f64, rows: i64) -> f64 {
        cpu * 1000.0 / rows as f64
    }

    /// idem: a backlog drained by its relay, then the latency at the offered rate.
    async fn idem(admin: &str, brokers: &str, load: &Load, name: &str) -> anyhow::Result<Relayed> {
        let store = fresh_store(admin, "idem_bench_peers_relay").await?;
        let topic = unique_topic("peers-idem");
        create_topic(brokers, &topic, 6).await?;
        fill(&store, &topic, load.rows).await?;
        sqlx::query("VACUUM ANALYZE outbox_message").execute(store.pool()).await?;
        let (me, pg) =
            (common::process_cpu_seconds(std::process::id()).unwrap_or(0.0), common::cpu_seconds_of("postgres"));
        let (stop, task, stats) = start_relay(&store, brokers, BATCH, PgOutboxWakeup::connect(&store).await?);
        let start = Instant::now();
        while stats.published.get() < load.rows as u64 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let secs = start.elapsed().as_secs_f64();
        let cpu = common::process_cpu_seconds(std::process::id()).unwrap_or(0.0) - me;
        let pg = common::cpu_seconds_of("postgres") - pg;
        stop.cancel();
        task.await?;
        anyhow::ensure!(unpublished(&store).await? == 0, "idem's relay left rows");
        let (lat, _) = latency(&store, brokers, &topic, load.rate, load.seconds, BATCH).await?;
        store.close().await;
        Ok(Relayed {
            name: name.into(),
            rate: load.rows as f64 / secs,
            cpu_ms: per(cpu, load.rows),
            pg_ms: per(pg, load.rows),
            p50_ms: lat.p50.as_secs_f64() * 1e3,
            p99_ms: lat.p99.as_secs_f64() * 1e3,
        })
    }

    /// The peer with `listener` (polling or replication): the same backlog in its table, drained, then the
    /// latency at the offered rate. Also returns the drain's report (published, abandoned, failures).
    async fn peer(
        admin: &str,
        brokers: &str,
        load: &Load,
        listener: &str,
    ) -> anyhow::Result<(Relayed, serde_json::Value, serde_json::Value)> {
        let db = fresh_database(admin, "idem_bench_peers_outbox").await?;
        let topic = unique_topic("peers-pgto");
        create_topic(brokers, &topic, 6).await?;
        let env = [
            ("DATABASE_URL", db.as_str()),
            ("KAFKA_BROKERS", brokers),
            ("TOPIC", topic.as_str()),
            ("LISTENER", listener),
        ];
        let dir = super::peer_outbox_dir();
        node(&dir, &env, &["setup"])?;
        {
            use sqlx::Connection;
            let mut conn = sqlx::PgConnection::connect(&db).await?;
            sqlx::query(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, message_type, segment, payload, created_at)
                 SELECT gen_random_uuid(), 'payment', 'order-' || (g % 1000), 'PaymentCaptured',
                        'order-' || (g % 1000), $1::jsonb, clock_timestamp()
                 FROM generate_series(1, $2) AS g",
            )
            .bind(super::common::relay::PAYLOAD)
            .bind(load.rows)
            .execute(&mut conn)
            .await?;
            sqlx::query("VACUUM ANALYZE outbox").execute(&mut conn).await?;
            conn.close().await?;
        }
        let pg = common::cpu_seconds_of("postgres");
        let (drained, cpu) = node(&dir, &env, &["drain", &load.rows.to_string()])?;
        let pg = common::cpu_seconds_of("postgres") - pg;
        let secs = drained["seconds"].as_f64().unwrap_or(f64::NAN);
        let (lat, _) = node(&dir, &env, &["latency", &load.rate.to_string(), &load.seconds.to_string()])?;
        let measured = Relayed {
            name: format!("pg-transactional-outbox ({listener})"),
            rate: load.rows as f64 / secs,
            cpu_ms: per(cpu, load.rows),
            pg_ms: per(pg, load.rows),
            p50_ms: lat["p50_ms"].as_f64().unwrap_or(f64::NAN),
            p99_ms: lat["p99_ms"].as_f64().unwrap_or(f64::NAN),
        };
        Ok((measured, drained, lat))
    }

    fn print(
        cluster: &str,
        load: &Load,
        idem: &Relayed,
        peer: &Relayed,
        drained: &serde_json::Value,
        lat: &serde_json::Value,
    ) {
        println!();
        println!(
            "Outbox relay on {cluster}, {} stored messages over 1,000 keys, 6 partitions, acks=all (idem: idempotent producer; peer: see peers/pg-transactional-outbox/bench.cjs):",
            load.rows
        );
        println!(
            "{:<42} {:>10} {:>16} {:>16} {:>10} {:>10}",
            "relay", "msg/s", "relay CPU ms/msg", "PostgreSQL ms/msg", "p50 ms", "p99 ms"
        );
        for r in [idem, peer] {
            println!(
                "{:<42} {:>10.0} {:>16.3} {:>16.3} {:>10.1} {:>10.1}",
                r.name, r.rate, r.cpu_ms, r.pg_ms, r.p50_ms, r.p99_ms
            );
        }
        println!(
            "latency at {} msg/s offered for {} s: peer {} written / {} published",
            load.rate, load.seconds, lat["written"], lat["published"]
        );
        println!(
            "peer backlog: {} published, {} abandoned by the library after 5 failed attempts (never published); \
             failed attempts: {}; idem: 0 abandoned (a row stays until the broker acknowledges it)",
            drained["published"], drained["abandoned"], drained["failures"]
        );
        println!(
            "idem / {}: throughput {:.2}x, CPU (relay + PostgreSQL) per message {:.3} vs {:.3} ms",
            peer.name,
            idem.rate / peer.rate,
            idem.cpu_ms + idem.pg_ms,
            peer.cpu_ms + peer.pg_ms
        );
    }

    pub async fn run(admin: &str, brokers: &str) -> anyhow::Result<()> {
        let load = Load {
            rows: env_or("BENCH_OUTBOX_ROWS", 10_000),
            rate: env_or("BENCH_RATE", 500),
            seconds: env_or("BENCH_SECONDS", 5),
        };
        let mine = idem(admin, brokers, &load, "idem relay").await?;
        let (theirs, drained, lat) = peer(admin, brokers, &load, "polling").await?;
        print("the shared PostgreSQL", &load, &mine, &theirs, &drained, &lat);
        if env_or("BENCH_LOGICAL", 1) == 1 {
            let cluster = PrivatePostgres::start(
                "wal_level = logical\nmax_wal_senders = 4\nmax_replication_slots = 4\nmax_connections = 100\n\
                 shared_buffers = 256MB\n",
            )
            .await?;
            let admin = cluster.url("postgres");
            let mine = idem(&admin, brokers, &load, "idem relay").await?;
            let (theirs, drained, lat) = peer(&admin, brokers, &load, "replication").await?;
            print("a private cluster with wal_level=logical", &load, &mine, &theirs, &drained, &lat);
        }
        Ok(())
    }
}

/// Inbox dedup side by side: one topic of BENCH_INBOX_EVENTS (10000) order events over 1,000 keys, 6
/// partitions, each with an `event_id` header, plus BENCH_INBOX_DUPLICATES (1000) redeliveries of events
/// already sent (same id, key and body), read by each side in its own consumer group into its own fresh
/// database. Both apply an event by inserting one row with no key, so an event applied twice is two rows:
/// the effects are counted, not the survivors. idem: the consumer runner, processed_event recorded in the
/// business transaction, batches of 100. The peer: kafkajs stores each message in the library's inbox table
/// (ON CONFLICT DO NOTHING on the id), and its polling listener applies it in the transaction that marks the
/// row processed. msg/s from the first message received to the last event applied; CPU per message of the
/// consumer's process and of PostgreSQL.
mod inbox {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use idem_domain::TtlPolicy;
    use idem_kafka::consumer::{Runner, RunnerSettings};
    use idem_ports::{SystemClock, TransactionManager};
    use idem_tests::effects::CountingHandler;
    use idem_tests::kafka::{create_topic, produce, unique_topic};
    use tokio_util::sync::CancellationToken;
    use uuid::Uuid;

    use super::common::{self, env_or, fresh_database, fresh_store};
    use super::node;

    /// `events` distinct events, then `duplicates` of them sent again, spread through the topic.
    async fn fill(brokers: &str, topic: &str, events: usize, duplicates: usize) -> anyhow::Result<()> {
        // uncompressed: kafkajs reads no LZ4 without a codec plugin, and both sides read the same bytes
        let p: rdkafka::producer::FutureProducer =
            idem_kafka::ProducerSettings::new(brokers).client_config().set("compression.type", "none").create()?;
        let sent: Vec<(Uuid, String, String)> = (0..events)
            .map(|i| {
                let order = format!("order-{}", i % 1000);
                let body = serde_json::json!({ "type": "OrderPlaced", "order": order, "n": i }).to_string();
                (Uuid::now_v7(), order, body)
            })
            .collect();
        let every = events / duplicates.max(1);
        let mut order: Vec<&(Uuid, String, String)> = Vec::with_capacity(events + duplicates);
        for (i, event) in sent.iter().enumerate() {
            order.push(event);
            if every > 0 && i % every == every - 1 && order.len() < events + duplicates {
                order.push(&sent[i / 2]); // an earlier event redelivered
            }
        }
        for chunk in order.chunks(1000) {
            let sends = chunk.iter().map(|(id, key, body)| {
                let id = id.to_string();
                let p = p.clone();
                async move { produce(&p, topic, Some(key), body.as_bytes(), &[("event_id", id.as_bytes())]).await }
            });
            for sent in futures::future::join_all(sends).await {
                sent?;
            }
        }
        anyhow::ensure!(order.len() == events + duplicates, "{} messages, not {}", order.len(), events + duplicates);
        Ok(())
    }

    pub async fn run(admin: &str, brokers: &str) -> anyhow::Result<()> {
        let events: usize = env_or("BENCH_INBOX_EVENTS", 10_000);
        let duplicates: usize = env_or("BENCH_INBOX_DUPLICATES", 1_000);
        let total = events + duplicates;
        let topic = unique_topic("peers-inbox");
        create_topic(brokers, &topic, 6).await?;
        create_topic(brokers, &format!("{topic}.dlq"), 1).await?;
        fill(brokers, &topic, events, duplicates).await?;

        // idem: the consumer runner with a handler that writes one row per application
        let store = fresh_store(admin, "idem_bench_peers_inbox").await?;
        sqlx::raw_sql(
            "CREATE TABLE test_application (n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                 event_id uuid, order_id uuid, version bigint, topic text, at timestamptz NOT NULL DEFAULT clock_timestamp())",
        )
        .execute(store.pool())
        .await?;
        let mut settings =
            RunnerSettings::new(brokers, "idem-inbox", &topic, TtlPolicy::new(Duration::from_secs(72 * 3600))?);
        settings.consumer.session_timeout = Duration::from_millis(6000);
        let tm: Arc<dyn TransactionManager> = Arc::new(store.clone());
        let runner = Runner::new(settings, tm, Arc::new(SystemClock), Arc::new(CountingHandler));
        let stats = runner.stats();
        let stop = CancellationToken::new();
        let task = tokio::spawn(runner.run(stop.clone()));
        while stats.received.get() == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let (me, pg) =
            (common::process_cpu_seconds(std::process::id()).unwrap_or(0.0), common::cpu_seconds_of("postgres"));
        let start = Instant::now();
        let deadline = start + Duration::from_secs(600);
        while stats.processed.get() + stats.duplicates.get() < total as u64 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let idem_secs = start.elapsed().as_secs_f64();
        let idem_cpu = common::process_cpu_seconds(std::process::id()).unwrap_or(0.0) - me;
        let idem_pg = common::cpu_seconds_of("postgres") - pg;
        stop.cancel();
        let _ = task.await;
        let (idem_applied, idem_distinct): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM test_application")
                .fetch_one(store.pool())
                .await?;

        // the peer: its inbox, fed by kafkajs, applied by its polling listener
        let db = fresh_database(admin, "idem_bench_peers_inbox_peer").await?;
        let env = [
            ("DATABASE_URL", db.as_str()),
            ("KAFKA_BROKERS", brokers),
            ("TOPIC", topic.as_str()),
            ("GROUP", "peer-inbox"),
        ];
        let pg = common::cpu_seconds_of("postgres");
        let (peer, peer_cpu) =
            node(&super::peer_outbox_dir(), &env, &["inbox", &events.to_string(), &total.to_string()])?;
        let peer_pg = common::cpu_seconds_of("postgres") - pg;
        let peer_secs = peer["seconds"].as_f64().unwrap_or(f64::NAN);

        let per = |cpu: f64| cpu * 1000.0 / total as f64;
        println!();
        println!(
            "Inbox dedup, {events} events + {duplicates} redeliveries over 1,000 keys, 6 partitions; each application inserts one row with no key:"
        );
        println!(
            "{:<34} {:>10} {:>18} {:>17} {:>9} {:>9}",
            "consumer", "msg/s", "consumer CPU ms/msg", "PostgreSQL ms/msg", "applied", "distinct"
        );
        println!(
            "{:<34} {:>10.0} {:>18.3} {:>17.3} {:>9} {:>9}",
            "idem runner (batch 100)",
            total as f64 / idem_secs,
            per(idem_cpu),
            per(idem_pg),
            idem_applied,
            idem_distinct
        );
        println!(
            "{:<34} {:>10.0} {:>18.3} {:>17.3} {:>9} {:>9}",
            "pg-transactional-outbox inbox",
            total as f64 / peer_secs,
            per(peer_cpu),
            per(peer_pg),
            peer["applied"].as_i64().unwrap_or(-1),
            peer["distinct"].as_i64().unwrap_or(-1)
        );
        println!(
            "idem / pg-transactional-outbox: throughput {:.2}x, CPU (consumer + PostgreSQL) per message {:.3} vs {:.3} ms; \
             peer received {} of {total}, failed attempts: {}",
            peer_secs / idem_secs,
            per(idem_cpu + idem_pg),
            per(peer_cpu + peer_pg),
            peer["received"],
            peer["failures"]
        );
        anyhow::ensure!(
            idem_applied == events as i64 && idem_distinct == events as i64,
            "idem applied {idem_applied} rows for {events} events"
        );
        Ok(())
    }
}

/// Where PostgreSQL's work per charge goes, idem against the peer (BENCH_PEER_PARTS=profile): both
/// services on a private cluster started here with `pg_stat_statements` loaded (the shared server does not
/// load it), the peer with a session per client, BENCH_PEER_CLIENTS[0] (8) clients, one BENCH_SECONDS (5)
/// slice of new charges each after a warm-up. Per charge: WAL bytes (`pg_current_wal_lsn`), commits,
/// tuples written, buffers, PostgreSQL CPU, and each statement's calls, execution time and WAL. With
/// BENCH_PERF=1 each slice also runs `perf record` on every CPU and prints the hottest symbols of the
/// PostgreSQL backends and of the service.
mod profile {
    use std::time::Duration;

    use idem_tests::infra::PrivatePostgres;
    use sqlx::{Connection, Row};

    use super::common::load::{Target, phase_on};
    use super::common::{self, Service, charge_body, env_or};
    use super::{key_of, migrated, sessions, start_idem, start_peer};

    /// Counters of one database, read before and after a slice.
    #[derive(Default, Clone, Copy)]
    struct Counters {
        wal: f64,
        commits: f64,
        inserted: f64,
        updated: f64,
        deleted: f64,
        hit: f64,
        read: f64,
        cpu_ms: f64,
    }

    async fn counters(admin: &mut sqlx::PgConnection, db: &str) -> anyhow::Result<Counters> {
        let row = sqlx::query(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8, d.xact_commit::float8,
                    d.tup_inserted::float8, d.tup_updated::float8, d.tup_deleted::float8,
                    d.blks_hit::float8, d.blks_read::float8
             FROM pg_stat_database d WHERE d.datname = $1",
        )
        .bind(db)
        .fetch_one(&mut *admin)
        .await?;
        Ok(Counters {
            wal: row.get(0),
            commits: row.get(1),
            inserted: row.get(2),
            updated: row.get(3),
            deleted: row.get(4),
            hit: row.get(5),
            read: row.get(6),
            cpu_ms: common::cpu_seconds_of("postgres") * 1000.0,
        })
    }

    /// One statement's share of a slice.
    struct Statement {
        query: String,
        calls: f64,
        exec_ms: f64,
        wal_bytes: f64,
        dirtied: f64,
    }

    async fn statements(conn: &mut sqlx::PgConnection, db: &str) -> anyhow::Result<Vec<Statement>> {
        let rows = sqlx::query(
            "SELECT regexp_replace(s.query, '\\s+', ' ', 'g'), s.calls::float8, s.total_exec_time,
                    s.wal_bytes::float8, s.shared_blks_dirtied::float8
             FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
             WHERE d.datname = $1 ORDER BY s.total_exec_time DESC LIMIT 14",
        )
        .bind(db)
        .fetch_all(&mut *conn)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| Statement {
                query: r.get(0),
                calls: r.get(1),
                exec_ms: r.get(2),
                wal_bytes: r.get(3),
                dirtied: r.get(4),
            })
            .collect())
    }

    /// `perf record` on every CPU until stopped; then the report of the `postgres` command's symbols.
    struct Perf(Option<(std::process::Child, tempfile::NamedTempFile)>);

    impl Perf {
        fn start() -> Self {
            if env_or("BENCH_PERF", 0) != 1 {
                return Self(None);
            }
            let Ok(file) = tempfile::NamedTempFile::new() else { return Self(None) };
            let child = std::process::Command::new("perf")
                .args(["record", "-a", "-g", "-F", "499", "-q", "-o"])
                .arg(file.path())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn();
            Self(child.ok().map(|c| (c, file)))
        }

        /// The hottest symbols of the `postgres` processes, then of the service's process `service`.
        fn report(self, service: u32) -> (String, String) {
            let Some((child, file)) = self.0 else { return (String::new(), String::new()) };
            let _ = std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status();
            let _ = child.wait_with_output();
            let hottest = |filter: &[&str]| {
                let out = std::process::Command::new("perf")
                    .args(["report", "--no-children"])
                    .args(filter)
                    .args(["--sort", "symbol", "--stdio", "-g", "none", "-i"])
                    .arg(file.path())
                    .output();
                let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
                text.lines()
                    .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
                    .take(18)
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            (hottest(&["--comm", "postgres"]), hottest(&["--pid", &service.to_string()]))
        }
    }

    async fn side(
        name: &str,
        cluster: &PrivatePostgres,
        db_name: &str,
        svc: &Service,
        target: &Target,
        clients: usize,
    ) -> anyhow::Result<()> {
        let seconds: u64 = env_or("BENCH_SECONDS", 5);
        let fresh = |w: usize, _: usize| (key_of(w), charge_body());
        let _ = phase_on(target, clients, Duration::from_secs(2), fresh).await;
        let mut admin = sqlx::PgConnection::connect(&cluster.url("postgres")).await?;
        sqlx::query("SELECT pg_stat_statements_reset()").execute(&mut admin).await?;
        sqlx::query("SELECT pg_stat_reset()")
            .execute(&mut sqlx::PgConnection::connect(&cluster.url(db_name)).await?)
            .await?;
        // a backend flushes its statistics at most once a second, and an idle one after 10 s
        tokio::time::sleep(Duration::from_secs(11)).await;
        let hot_of = |db: String| async move {
            let mut c = sqlx::PgConnection::connect(&db).await?;
            let v: f64 = sqlx::query_scalar("SELECT coalesce(sum(n_tup_hot_upd), 0)::float8 FROM pg_stat_user_tables")
                .fetch_one(&mut c)
                .await?;
            anyhow::Ok(v)
        };
        let before = counters(&mut admin, db_name).await?;
        let hot0 = hot_of(cluster.url(db_name)).await?;
        let svc0 = svc.cpu_seconds().unwrap_or(0.0);
        let perf = Perf::start();
        let s = phase_on(target, clients, Duration::from_secs(seconds), fresh).await;
        let (hottest, service_hottest) = perf.report(svc.pid());
        tokio::time::sleep(Duration::from_secs(11)).await; // the relay's deletes, the idle backends' flush
        let svc_ms = (svc.cpu_seconds().unwrap_or(0.0) - svc0) * 1000.0;
        let after = counters(&mut admin, db_name).await?;
        let hot = hot_of(cluster.url(db_name)).await? - hot0;
        let n = s.latencies.len().max(1) as f64;
        let per = |a: f64, b: f64| (a - b) / n;
        println!();
        println!(
            "{name}: {} charges in {:.1} s ({:.0}/s), {} errors, {clients} clients",
            s.latencies.len(),
            s.elapsed.as_secs_f64(),
            n / s.elapsed.as_secs_f64().max(1e-9),
            s.errors
        );
        println!(
            "  per charge: PostgreSQL CPU {:.3} ms, service CPU {:.3} ms, WAL {:.0} bytes, commits {:.2}, tuples \
             inserted {:.2} / updated {:.2} (HOT {:.2}) / deleted {:.2}, buffers hit {:.1} / read {:.2}",
            per(after.cpu_ms, before.cpu_ms),
            svc_ms / n,
            per(after.wal, before.wal),
            per(after.commits, before.commits),
            per(after.inserted, before.inserted),
            per(after.updated, before.updated),
            hot / n,
            per(after.deleted, before.deleted),
            per(after.hit, before.hit),
            per(after.read, before.read),
        );
        println!("  {:>8} {:>10} {:>10} {:>9}  statement", "calls", "exec µs", "WAL bytes", "dirtied");
        for st in statements(&mut admin, db_name).await? {
            let q: String = st.query.chars().take(110).collect();
            println!(
                "  {:>8.2} {:>10.1} {:>10.0} {:>9.3}  {q}",
                st.calls / n,
                st.exec_ms * 1000.0 / n,
                st.wal_bytes / n,
                st.dirtied / n
            );
        }
        if !hottest.is_empty() {
            println!("  perf, the postgres processes' hottest symbols (self time):\n{hottest}");
        }
        if !service_hottest.is_empty() {
            println!("  perf, the service's hottest symbols (self time):\n{service_hottest}");
        }
        Ok(())
    }

    pub async fn run() -> anyhow::Result<()> {
        let clients: usize = std::env::var("BENCH_PEER_CLIENTS")
            .ok()
            .and_then(|c| c.split_whitespace().next().and_then(|c| c.parse().ok()))
            .unwrap_or(8);
        let cluster = PrivatePostgres::start(
            "shared_preload_libraries = 'pg_stat_statements'\npg_stat_statements.track = 'all'\n\
             max_connections = 200\n",
        )
        .await?;
        let admin = cluster.url("postgres");
        let idem_db = migrated(&admin, "idem_profile_idem").await?;
        let peer_db = migrated(&admin, "idem_profile_axum").await?;
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&mut sqlx::PgConnection::connect(&admin).await?)
            .await?;
        let idem = start_idem(&idem_db, clients).await?;
        let peer = start_peer(&peer_db).await?;
        let peer_target =
            Target { addr: "127.0.0.1:18102".into(), bearer: None, cookies: sessions(&peer.base, clients).await? };
        println!();
        println!(
            "Profile of new charges on a private cluster with pg_stat_statements (the peer: a session per client):"
        );
        if let Ok(bin) = std::env::var("BENCH_IDEM_BEFORE")
            && !bin.is_empty()
        {
            let db = migrated(&admin, "idem_profile_before").await?;
            let before = super::start_idem_bin(&bin, &db, 18104, clients).await?;
            side(
                "idem before (BENCH_IDEM_BEFORE)",
                &cluster,
                "idem_profile_before",
                &before,
                &Target::idem(&before.base),
                clients,
            )
            .await?;
        }
        side("idem", &cluster, "idem_profile_idem", &idem, &Target::idem(&idem.base), clients).await?;
        side("axum-idempotent", &cluster, "idem_profile_axum", &peer, &peer_target, clients).await?;
        Ok(())
    }
}

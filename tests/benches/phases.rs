//! A call to another system (a payment provider answering in BENCH_PROVIDER_MS, 200 ms) from a handler under
//! the idempotency layer, with BENCH_CONCURRENCY (64) clients and a pool of BENCH_POOL (4) connections:
//!
//! - **in phases** (`Tx::foreign_call` … `Tx::resume`): no connection is held during the call, so the pool
//!   is never the limit and the rate approaches clients / call time;
//! - **inside the transaction** (the naive shape): the connection and the key's row are held for the call,
//!   so the rate is at most pool / call time.
//!
//! - **the reference service** (`POST /payments` with a `payment_method`, the whole API: authentication,
//!   the pending payment, the provider adapter speaking the JSON contract, the capture and its outbox row)
//!   against the test library's stand-in provider answering after the same delay.
//!
//! All in one run against the same PostgreSQL, BENCH_SECONDS (5) each. Prints each rate, its ratio to
//! clients / call time, and the ratio of the first two. Run with `scripts/bench.sh phases`.

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::disallowed_methods)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use common::{env_or, fresh_store};
use idem_http::{IdempotencyConfig, IdempotencyLayer, Problem, ProblemKind, Tx};
use idem_ports::{SystemClock, TransactionManager};

/// The stand-in provider: the first answer per key, after the delay.
async fn provider(delay: Duration) -> anyhow::Result<String> {
    let answers = Arc::new(std::sync::Mutex::new(std::collections::HashMap::<String, String>::new()));
    let charge = move |headers: axum::http::HeaderMap| {
        let answers = answers.clone();
        async move {
            tokio::time::sleep(delay).await;
            let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
            let mut answers = answers.lock().map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
            let n = answers.len();
            Ok::<_, StatusCode>(answers.entry(key).or_insert_with(|| format!("ch_{n}")).clone())
        }
    };
    idem_tests::serve(axum::Router::new().route("/v1/charges", axum::routing::post(charge))).await
}

#[derive(Clone)]
struct Provider {
    url: String,
    http: reqwest::Client,
}

impl Provider {
    async fn charge(&self, key: &str) -> Result<String, Problem> {
        let unknown = |_| Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE);
        let reply = self.http.post(format!("{}/v1/charges", self.url)).header("idempotency-key", key).send().await;
        reply.map_err(unknown)?.text().await.map_err(unknown)
    }
}

async fn in_phases(State(p): State<Provider>, mut tx: Tx) -> Result<(StatusCode, String), Problem> {
    let call = tx.foreign_call("charge").await?;
    let charge = p.charge(call.key()).await?;
    tx.resume(call).await?;
    Ok((StatusCode::CREATED, charge))
}

async fn inside_the_transaction(State(p): State<Provider>, tx: Tx) -> Result<(StatusCode, String), Problem> {
    let key = format!("{:p}", &tx); // a key of its own: the naive handler has no stable one
    let charge = p.charge(&key).await?;
    drop(tx);
    Ok((StatusCode::CREATED, charge))
}

async fn serve(store: &idem_postgres::PgStore, provider: Provider, phased: bool) -> anyhow::Result<String> {
    let tm: Arc<dyn TransactionManager> = Arc::new(store.clone());
    let ttl = idem_domain::TtlPolicy::new(Duration::from_secs(48 * 3600))?;
    let config = IdempotencyConfig::new(ttl, idem_http::merchant_scope());
    let route = if phased { axum::routing::post(in_phases) } else { axum::routing::post(inside_the_transaction) };
    let router = axum::Router::new()
        .route("/payments", route)
        .route_layer(IdempotencyLayer::new(tm, Arc::new(SystemClock), config))
        .with_state(provider)
        .layer(axum::middleware::from_fn(|mut req: axum::extract::Request, next: axum::middleware::Next| async move {
            req.extensions_mut().insert(idem_http::Merchant("bench".into()));
            next.run(req).await
        }));
    idem_tests::serve(router).await
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let Some((admin, _)) = common::bench_env() else { return Ok(()) };
    let (clients, pool, call_ms, seconds) = (
        env_or("BENCH_CONCURRENCY", 64usize),
        env_or("BENCH_POOL", 4u32),
        env_or("BENCH_PROVIDER_MS", 200u64),
        env_or("BENCH_SECONDS", 5u64),
    );
    let migrated = fresh_store(&admin, "idem_bench_phases").await?;
    migrated.close().await;
    let url = idem_tests::with_database(&admin, "idem_bench_phases");
    let settings = idem_postgres::PoolSettings { max_connections: pool, ..Default::default() };
    let store = idem_postgres::PgStore::connect(&url, &settings).await?;
    let provider = Provider { url: provider(Duration::from_millis(call_ms)).await?, http: reqwest::Client::new() };
    let ceiling = clients as f64 / (call_ms as f64 / 1000.0);
    println!(
        "a {call_ms} ms provider call per charge, {clients} clients, a pool of {pool}: clients / call time = {ceiling:.0}/s"
    );
    let mut rates = Vec::new();
    for (name, phased) in [("in phases", true), ("inside the transaction", false)] {
        let base = serve(&store, provider.clone(), phased).await?;
        // one request first: a misconfigured bench fails here, loudly, instead of counting failures
        let first = reqwest::Client::new()
            .post(format!("{base}/payments"))
            .header("idempotency-key", format!("warm-{phased}"))
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await?;
        let status = first.status();
        anyhow::ensure!(status == 201, "{name}: {status} {}", first.text().await?);
        let slice = common::load::phase(&base, clients, Duration::from_secs(seconds), move |w, i| {
            (format!("{phased}-{w}-{i}-{}", uuid::Uuid::new_v4().simple()), "{}".to_owned())
        })
        .await;
        let summary = slice.summary(name);
        println!(
            "{name:<24} {:>8.0} charges/s ({:.2} of clients / call time), p50 {:.0} ms, p99 {:.0} ms, {} failed",
            summary.rate(),
            summary.rate() / ceiling,
            summary.p50.as_secs_f64() * 1000.0,
            summary.p99.as_secs_f64() * 1000.0,
            summary.errors
        );
        rates.push(summary.rate());
    }
    println!("in phases / inside the transaction: {:.1}x", rates[0] / rates[1].max(1e-9));

    // the reference service's own charges through its provider adapter
    let (standin, standin_url) = idem_tests::provider::start("sk_bench_provider").await?;
    standin.delay_ms.store(call_ms, std::sync::atomic::Ordering::SeqCst);
    let api = reference_service(&store, &standin_url).await?;
    let name = "the reference service";
    let slice = common::load::phase(&api, clients, Duration::from_secs(seconds), move |w, i| {
        let body = serde_json::json!({
            "order_id": uuid::Uuid::now_v7(), "customer_id": uuid::Uuid::now_v7(), "amount": "12.34",
            "currency": "EUR", "payment_method": "pm_card_visa",
        });
        (format!("ref-{w}-{i}-{}", uuid::Uuid::new_v4().simple()), body.to_string())
    })
    .await;
    let summary = slice.summary(name);
    println!(
        "{name:<24} {:>8.0} charges/s ({:.2} of clients / call time), p50 {:.0} ms, p99 {:.0} ms, {} failed; {} charges at the provider",
        summary.rate(),
        summary.rate() / ceiling,
        summary.p50.as_secs_f64() * 1000.0,
        summary.p99.as_secs_f64() * 1000.0,
        summary.errors,
        standin.charges.load(std::sync::atomic::Ordering::SeqCst),
    );
    Ok(())
}

/// The payments API with the stand-in provider at `provider`, as `idem serve` wires it.
async fn reference_service(store: &idem_postgres::PgStore, provider: &str) -> anyhow::Result<String> {
    let tm: Arc<dyn TransactionManager> = Arc::new(store.clone());
    let provider =
        idem_provider::HttpPaymentProvider::new("standin", provider, "sk_bench_provider", Duration::from_secs(5))?;
    let state = idem_http::ApiState {
        tm: tm.clone(),
        payments_of: idem_postgres::payments_of,
        clock: Arc::new(SystemClock),
        ids: Arc::new(idem_ports::UuidV7Generator),
        payments_topic: "payments".into(),
        provider: Some(Arc::new(provider)),
    };
    let ttl = idem_domain::TtlPolicy::new(Duration::from_secs(48 * 3600))?;
    let config = IdempotencyConfig::new(ttl, idem_http::merchant_scope());
    let keys = idem_http::ApiKeys::parse(&format!("bench:{}", common::API_KEY)).map_err(anyhow::Error::msg)?;
    let layer = IdempotencyLayer::new(tm, Arc::new(SystemClock), config);
    idem_tests::serve(idem_http::router(state, Arc::new(keys), layer)).await
}

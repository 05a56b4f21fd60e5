//! `idem pay` and `idem demo`: try the running service from a terminal.
//!
//! These act as a client of the service, so they make their own ids.
#![allow(clippy::disallowed_methods)]

use idem_domain::wire::headers::{EVENT_ID, SAGA_ID};
use std::time::Duration;

use anyhow::Context;
use idem_http::client::{ChargeRequest, IdemClient, RetryPolicy};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;
use uuid::Uuid;

/// `idem pay` settings.
#[derive(Debug, clap::Args)]
pub struct PayArgs {
    /// Base URL of the service.
    #[arg(long, env = "IDEM_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// API key (Bearer).
    #[arg(long, env = "IDEM_API_KEY", hide_env_values = true, value_parser = |s: &str| Ok::<_, String>(crate::config::Secret(s.to_owned())))]
    pub api_key: crate::config::Secret,
    #[arg(long)]
    pub amount: String,
    #[arg(long, default_value = "EUR")]
    pub currency: String,
    #[arg(long, default_value = "demo-provider")]
    pub provider: String,
    /// The provider's payment id (default: a new one).
    #[arg(long)]
    pub external_payment_id: Option<String>,
    #[arg(long)]
    pub order_id: Option<Uuid>,
    #[arg(long)]
    pub customer_id: Option<Uuid>,
    /// Reuse a key to retry an earlier operation (default: a new key).
    #[arg(long)]
    pub idempotency_key: Option<String>,
}

pub async fn pay(args: PayArgs) -> anyhow::Result<()> {
    let client = IdemClient::new(&args.url, &args.api_key.0, RetryPolicy::default())?;
    let key = args.idempotency_key.unwrap_or_else(IdemClient::new_key);
    let request = ChargeRequest {
        order_id: args.order_id.unwrap_or_else(Uuid::now_v7),
        customer_id: args.customer_id.unwrap_or_else(Uuid::now_v7),
        provider: args.provider,
        external_payment_id: args.external_payment_id.unwrap_or_else(|| format!("pi_{}", Uuid::now_v7().simple())),
        amount: args.amount,
        currency: args.currency,
    };
    let reply = client.charge(&key, &request).await?;
    let out = json!({
        "status": reply.status,
        "idempotency_key": reply.idempotency_key,
        "replayed": reply.replayed,
        "attempts": reply.attempts,
        "body": reply.body,
    });
    #[allow(clippy::print_stdout)]
    {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}

/// `idem demo` settings.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    #[arg(long, env = "IDEM_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    #[arg(long, env = "IDEM_API_KEY", hide_env_values = true, value_parser = |s: &str| Ok::<_, String>(crate::config::Secret(s.to_owned())))]
    pub api_key: crate::config::Secret,
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_parser = |s: &str| Ok::<_, String>(crate::config::DatabaseUrl(s.to_owned())))]
    pub database_url: crate::config::DatabaseUrl,
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub kafka_brokers: String,
    #[arg(long, env = "KAFKA_ORDERS_TOPIC", default_value = "orders")]
    pub orders_topic: String,
}

struct Row {
    scenario: &'static str,
    expected: String,
    observed: String,
}

async fn count(pool: &sqlx::PgPool, sql: &str, id: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sql).bind(id).fetch_one(pool).await?)
}

async fn wait_for(pool: &sqlx::PgPool, sql: &str, id: &str, want: i64) -> anyhow::Result<i64> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let n = count(pool, sql, id).await?;
        if n >= want || tokio::time::Instant::now() > deadline {
            // settle: a duplicate would show up shortly after
            tokio::time::sleep(Duration::from_millis(500)).await;
            return count(pool, sql, id).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn send(
    p: &FutureProducer,
    topic: &str,
    key: &str,
    payload: &str,
    headers: &[(&str, &str)],
) -> anyhow::Result<()> {
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header { key: k, value: Some(v.as_bytes()) });
    }
    p.send(FutureRecord::to(topic).key(key).payload(payload).headers(h), Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)?;
    Ok(())
}

pub async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let client = IdemClient::new(&args.url, &args.api_key.0, RetryPolicy::default())?;
    let pool = sqlx::PgPool::connect(&args.database_url.0).await.context("connecting to the database")?;
    let producer: FutureProducer = idem_kafka::ProducerSettings::new(&args.kafka_brokers).client_config().create()?;
    let mut rows = Vec::new();
    let charge = |external: &str, amount: &str| ChargeRequest {
        order_id: Uuid::now_v7(),
        customer_id: Uuid::now_v7(),
        provider: "demo".into(),
        external_payment_id: external.into(),
        amount: amount.into(),
        currency: "EUR".into(),
    };
    let payments = "SELECT count(*) FROM payment WHERE external_payment_id = $1";

    // 1. a charge retried with the same key
    let ext = format!("pi_demo_{}", Uuid::now_v7().simple());
    let req = charge(&ext, "10.00");
    let key = IdemClient::new_key();
    let first = client.charge(&key, &req).await?;
    let again = client.charge(&key, &req).await?;
    rows.push(Row {
        scenario: "charge retried with the same key",
        expected: "1 payment, 2nd replayed".into(),
        observed: format!(
            "{} payment(s), {} then {} (replayed: {})",
            count(&pool, payments, &ext).await?,
            first.status,
            again.status,
            again.replayed
        ),
    });

    // 2. the key reused with another body
    let other = client.charge(&key, &charge(&ext, "11.00")).await?;
    rows.push(Row {
        scenario: "key reused with another body",
        expected: "409".into(),
        observed: format!("{} {}", other.status, other.body["type"].as_str().unwrap_or("")),
    });

    // 3. the same provider payment under two keys
    let ext3 = format!("pi_demo_{}", Uuid::now_v7().simple());
    let req3 = charge(&ext3, "5.00");
    let a = client.charge(&IdemClient::new_key(), &req3).await?;
    let b = client.charge(&IdemClient::new_key(), &req3).await?;
    rows.push(Row {
        scenario: "same external payment under two keys",
        expected: "1 payment (201, then 200)".into(),
        observed: format!("{} payment(s) ({}, then {})", count(&pool, payments, &ext3).await?, a.status, b.status),
    });

    // 4. a Kafka event delivered three times
    let order = Uuid::now_v7();
    let ext4 = format!("pi_demo_{}", Uuid::now_v7().simple());
    let placed = json!({
        "type": "OrderPlaced", "order_id": order, "customer_id": Uuid::now_v7(), "amount": "7.50", "currency": "EUR",
        "provider": "demo", "external_payment_id": ext4, "version": 1,
    })
    .to_string();
    let event_id = Uuid::now_v7().to_string();
    for _ in 0..3 {
        send(&producer, &args.orders_topic, &order.to_string(), &placed, &[(EVENT_ID, &event_id)]).await?;
    }
    rows.push(Row {
        scenario: "Kafka event delivered 3 times (same event_id)",
        expected: "1 payment".into(),
        observed: format!("{} payment(s)", wait_for(&pool, payments, &ext4, 1).await?),
    });

    // 5. a cancelled order, the compensation delivered twice
    let saga = Uuid::now_v7().to_string();
    let cancelled = json!({ "type": "OrderCancelled", "order_id": order, "version": 2 }).to_string();
    for _ in 0..2 {
        let id = Uuid::now_v7().to_string();
        send(&producer, &args.orders_topic, &order.to_string(), &cancelled, &[(EVENT_ID, &id), (SAGA_ID, &saga)])
            .await?;
    }
    let refunds =
        "SELECT count(*) FROM refund r JOIN payment p ON p.id = r.payment_id WHERE p.external_payment_id = $1";
    rows.push(Row {
        scenario: "cancelled order, compensation sent twice",
        expected: "1 refund".into(),
        observed: format!("{} refund(s)", wait_for(&pool, refunds, &ext4, 1).await?),
    });

    #[allow(clippy::print_stdout)]
    {
        println!("{:<48} {:<28} observed", "scenario", "expected");
        for r in &rows {
            println!("{:<48} {:<28} {}", r.scenario, r.expected, r.observed);
        }
    }
    Ok(())
}

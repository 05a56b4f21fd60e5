//! Consumer benchmark: messages/s end to end (pre-produced topic → committed business effects) for
//! (a) the dedup consumer at batch size 1, (b) at the default batch size, (c) a baseline doing the same
//! business write with no dedup at the default batch size, and (d) the seed's shape: a separate EXISTS
//! query, then the business write and an INSERT, one transaction per message.
//!
//! Run with `scripts/bench.sh consumer`. Settings: BENCH_MESSAGES (20000, for b and c),
//! BENCH_MESSAGES_SINGLE (3000, for a and d), BENCH_BATCH (100), DATABASE_URL, KAFKA_BROKERS.

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::disallowed_methods)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::{env_or, fresh_store};
use idem_domain::TtlPolicy;
use idem_domain::usecases::OrderEventHandler;
use idem_kafka::consumer::{Runner, RunnerSettings};
use idem_ports::{
    EventHandler, HandlerError, IdempotencyRepository, InboundEvent, OutboxRepository, ProcessedEvent,
    ProcessedEventRepository, SagaStepRepository, StoreError, SystemClock, TransactionManager, UnitOfWork,
    UuidV7Generator,
};
use idem_tests::kafka::{create_topic, produce, producer, unique_topic};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const GROUP: &str = "bench";

fn order_handler() -> OrderEventHandler {
    OrderEventHandler {
        charges_through_provider: false,
        clock: Arc::new(SystemClock),
        ids: Arc::new(UuidV7Generator),
        payments_topic: "payments".into(),
        merchant_id: "bench".into(),
        payments_of: idem_postgres::payments_of,
    }
}

/// The seed's shape: `SELECT EXISTS` first, then the business write, then the processed_event insert.
struct SeedShape(OrderEventHandler);

#[async_trait]
impl EventHandler for SeedShape {
    async fn handle(&self, uow: &mut dyn UnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
        if uow.processed_events().is_processed(GROUP, event.event_id).await? {
            return Ok(());
        }
        self.0.handle(uow, event).await?;
        let now = chrono::Utc::now();
        let expires_at = now + chrono::Duration::hours(72);
        let row = ProcessedEvent { event_id: event.event_id, topic: event.topic.clone(), expires_at };
        uow.processed_events().record_new(GROUP, &[row], now).await?;
        Ok(())
    }
}

async fn fill_topic(brokers: &str, messages: usize) -> anyhow::Result<String> {
    let topic = unique_topic("bench-orders");
    create_topic(brokers, &topic, 6).await?;
    create_topic(brokers, &format!("{topic}.dlq"), 1).await?;
    let p = producer(brokers)?;
    let mut pending = Vec::new();
    for i in 0..messages {
        let order = Uuid::now_v7();
        let payload = json!({
            "type": "OrderPlaced", "order_id": order, "customer_id": Uuid::now_v7(), "amount": "19.99",
            "currency": "EUR", "provider": "bench", "external_payment_id": format!("pi_{}", Uuid::now_v7()),
            "version": 1,
        })
        .to_string();
        let (p, topic) = (p.clone(), topic.clone());
        pending.push(tokio::spawn(async move {
            let id = Uuid::now_v7().to_string();
            produce(&p, &topic, Some(&order.to_string()), payload.as_bytes(), &[("event_id", id.as_bytes())]).await
        }));
        if pending.len() >= 1000 || i + 1 == messages {
            for t in pending.drain(..) {
                t.await??;
            }
        }
    }
    Ok(topic)
}

/// Baseline (c): the same units of work with the processed-event bookkeeping taken out (every event is
/// "new", nothing is written). It lives here, in the benchmark: the consumer runner itself has no switch
/// to turn dedup off.
struct NoDedup(idem_postgres::PgStore);

struct NoDedupUow(Box<dyn UnitOfWork>, NothingRecorded);

struct NothingRecorded;

#[async_trait]
impl TransactionManager for NoDedup {
    async fn begin(&self) -> Result<Box<dyn UnitOfWork>, StoreError> {
        Ok(Box::new(NoDedupUow(self.0.begin().await?, NothingRecorded)))
    }
}

#[async_trait]
impl ProcessedEventRepository for NothingRecorded {
    async fn record_new(
        &mut self,
        _consumer: &str,
        events: &[ProcessedEvent],
        _created_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<Vec<Uuid>, StoreError> {
        let mut ids: Vec<Uuid> = events.iter().map(|e| e.event_id).collect();
        ids.dedup();
        Ok(ids)
    }
    async fn is_processed(&mut self, _consumer: &str, _event_id: Uuid) -> Result<bool, StoreError> {
        Ok(false)
    }
    async fn late_admitted(&mut self, _consumer: &str, _ids: &[Uuid]) -> Result<Vec<Uuid>, StoreError> {
        Ok(Vec::new())
    }
    async fn apply_late_admission(
        &mut self,
        _consumer: &str,
        _event_id: Uuid,
        _now: chrono::DateTime<chrono::Utc>,
    ) -> Result<bool, StoreError> {
        Ok(false)
    }
}

#[async_trait]
impl UnitOfWork for NoDedupUow {
    fn idempotency(&mut self) -> &mut dyn IdempotencyRepository {
        self.0.idempotency()
    }
    fn processed_events(&mut self) -> &mut dyn ProcessedEventRepository {
        &mut self.1
    }
    fn outbox(&mut self) -> &mut dyn OutboxRepository {
        self.0.outbox()
    }
    fn saga_steps(&mut self) -> &mut dyn SagaStepRepository {
        self.0.saga_steps()
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self.0.as_any_mut()
    }
    async fn commit(self: Box<Self>) -> Result<(), StoreError> {
        self.0.commit().await
    }
    async fn rollback(self: Box<Self>) -> Result<(), StoreError> {
        self.0.rollback().await
    }
}

async fn measure(
    name: &str,
    admin: &str,
    brokers: &str,
    messages: usize,
    batch: usize,
    dedup: bool,
    handler: Arc<dyn EventHandler>,
) -> anyhow::Result<f64> {
    let store = fresh_store(admin, "idem_bench_consumer").await?;
    let topic = fill_topic(brokers, messages).await?;
    let mut settings = RunnerSettings::new(brokers, GROUP, &topic, TtlPolicy::new(Duration::from_secs(72 * 3600))?);
    settings.consumer.session_timeout = Duration::from_millis(6000);
    settings.batch_size = batch;
    let tm: Arc<dyn TransactionManager> =
        if dedup { Arc::new(store.clone()) } else { Arc::new(NoDedup(store.clone())) };
    let runner = Runner::new(settings, tm, Arc::new(SystemClock), handler);
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone()));
    // the clock starts at the first message (group join time excluded)
    while stats.received.get() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let start = Instant::now();
    while (stats.processed.get() + stats.duplicates.get()) < messages as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed();
    stop.cancel();
    let _ = task.await;
    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM payment").fetch_one(store.pool()).await?;
    anyhow::ensure!(payments == messages as i64, "{name}: {payments} payments for {messages} messages");
    let rate = messages as f64 / elapsed.as_secs_f64();
    println!("{name:<58} {messages:>8} {:>10.2} {rate:>12.0}", elapsed.as_secs_f64());
    Ok(rate)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Some((admin, brokers)) = common::bench_env() else { return Ok(()) };
    let many: usize = env_or("BENCH_MESSAGES", 20_000);
    let single: usize = env_or("BENCH_MESSAGES_SINGLE", 3_000);
    let batch: usize = env_or("BENCH_BATCH", 100);
    println!("idem consumer benchmark: OrderPlaced events (charge = payment + outbox row + projection), 6 partitions");
    println!("{:<58} {:>8} {:>10} {:>12}", "mode", "messages", "seconds", "messages/s");
    let plain: Arc<dyn EventHandler> = Arc::new(order_handler());
    let a = measure("(a) dedup consumer, batch size 1", &admin, &brokers, single, 1, true, plain.clone()).await?;
    let b =
        measure(&format!("(b) dedup consumer, batch size {batch}"), &admin, &brokers, many, batch, true, plain.clone())
            .await?;
    let c = measure(
        &format!("(c) baseline without dedup, batch size {batch}"),
        &admin,
        &brokers,
        many,
        batch,
        false,
        plain,
    )
    .await?;
    let d = measure(
        "(d) seed shape: EXISTS then INSERT, 1 tx/message",
        &admin,
        &brokers,
        single,
        1,
        false,
        Arc::new(SeedShape(order_handler())),
    )
    .await?;
    println!();
    println!("(b) / (d) = {:.1}x   (target >= 10x)", b / d);
    println!("(b) / (c) = {:.2}    (target >= 0.85)", b / c);
    println!("(b) / (a) = {:.1}x   (what batching buys)", b / a);
    Ok(())
}

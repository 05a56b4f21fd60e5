//! The deduplicating consumer against the tansu broker and real PostgreSQL.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use idem_domain::TtlPolicy;
use idem_domain::usecases::OrderEventHandler;
use idem_kafka::consumer::{ConsumerStats, Runner, RunnerSettings};
use idem_ports::{SystemClock, TransactionManager, UuidV7Generator};
use idem_postgres::PgStore;
use idem_tests::TestDb;
use idem_tests::kafka::{create_topic, eventually, produce, producer, read_topic, unique_topic};
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

struct Running {
    stop: CancellationToken,
    task: JoinHandle<()>,
    stats: Arc<ConsumerStats>,
}

impl Running {
    async fn stop(self) {
        self.stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(20), self.task).await;
    }
}

fn handler() -> Arc<OrderEventHandler> {
    Arc::new(OrderEventHandler {
        charges_through_provider: false,
        clock: Arc::new(SystemClock),
        ids: Arc::new(UuidV7Generator),
        payments_topic: "payments".into(),
        merchant_id: "orders".into(),
        payments_of: idem_postgres::payments_of,
    })
}

fn settings(brokers: &str, group: &str, topic: &str, batch: usize) -> RunnerSettings {
    let mut s =
        RunnerSettings::new(brokers, group, topic, TtlPolicy::new(Duration::from_secs(72 * 3600)).expect("ttl"));
    s.consumer.session_timeout = Duration::from_millis(6000);
    s.batch_size = batch;
    s.max_rejections = 2;
    s
}

fn start(tm: Arc<dyn TransactionManager>, settings: RunnerSettings) -> Running {
    let runner = Runner::new(settings, tm, Arc::new(SystemClock), handler());
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        if let Err(e) = runner.run(token).await {
            panic!("consumer failed: {e}");
        }
    });
    Running { stop, task, stats }
}

fn placed(order: Uuid, external: &str, version: i64) -> Vec<u8> {
    json!({
        "type": "OrderPlaced", "order_id": order, "customer_id": Uuid::from_u128(7), "amount": "10.00",
        "currency": "EUR", "provider": "stripe", "external_payment_id": external, "version": version,
    })
    .to_string()
    .into_bytes()
}

fn cancelled(order: Uuid, version: i64) -> Vec<u8> {
    json!({ "type": "OrderCancelled", "order_id": order, "version": version }).to_string().into_bytes()
}

async fn setup(partitions: i32) -> anyhow::Result<(TestDb, String, String)> {
    let db = TestDb::new().await?;
    // every application of an order event is counted (the order handler is idempotent on its own)
    idem_tests::effects::log_order_applications(&db).await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("orders");
    create_topic(&brokers, &topic, partitions).await?;
    create_topic(&brokers, &format!("{topic}.dlq"), 1).await?;
    Ok((db, brokers, topic))
}

/// Each order event was applied exactly once: `n` applications in all, no (order, version) twice.
async fn applied_once_each(db: &TestDb, n: i64) -> anyhow::Result<()> {
    let twice = idem_tests::effects::orders_applied_twice(db).await?;
    anyhow::ensure!(twice.is_empty(), "events applied more than once: {twice:?}");
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM test_application").fetch_one(db.pool()).await?;
    anyhow::ensure!(all == n, "{all} applications, {n} expected");
    Ok(())
}

/// Whether the database holds at least `n` payments within `timeout`.
async fn payments_reach(db: &TestDb, n: i64, timeout: Duration) -> anyhow::Result<bool> {
    eventually(timeout, || async {
        Ok(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payment").fetch_one(db.store.pool()).await? >= n)
    })
    .await
}

async fn send(
    p: &rdkafka::producer::FutureProducer,
    topic: &str,
    order: Uuid,
    event: Uuid,
    payload: &[u8],
) -> anyhow::Result<()> {
    let id = event.to_string();
    produce(p, topic, Some(&order.to_string()), payload, &[("event_id", id.as_bytes())]).await?;
    Ok(())
}

#[tokio::test]
async fn a_thousand_events_with_three_hundred_resent_have_seven_hundred_effects() -> anyhow::Result<()> {
    let (db, brokers, topic) = setup(3).await?;
    let p = producer(&brokers)?;
    let events: Vec<(Uuid, Uuid)> = (0..700).map(|_| (Uuid::now_v7(), Uuid::now_v7())).collect();
    let mut sends = Vec::new();
    for (i, (order, event)) in events.iter().enumerate() {
        sends.push((*order, *event, i));
        if i % 7 < 3 {
            sends.push((*order, *event, i)); // 300 re-sends with the same event_id
        }
    }
    assert_eq!(sends.len(), 1000);
    for (order, event, i) in &sends {
        send(&p, &topic, *order, *event, &placed(*order, &format!("pi_{i}"), 1)).await?;
    }
    let running = start(Arc::new(db.store.clone()), settings(&brokers, &unique_topic("g"), &topic, 100));
    let stats = running.stats.clone();
    assert!(eventually(Duration::from_secs(60), || async { Ok(stats.received.get() >= 1000) }).await?);
    running.stop().await;
    assert_eq!(db.count("payment").await?, 700);
    applied_once_each(&db, 700).await?;
    assert_eq!(db.count("processed_event").await?, 700);
    assert_eq!(stats.duplicates.get(), 300);
    assert_eq!(stats.dead_lettered.get(), 0);
    Ok(())
}

#[tokio::test]
async fn new_event_ids_for_the_same_provider_payment_make_one_payment() -> anyhow::Result<()> {
    let (db, brokers, topic) = setup(1).await?;
    let p = producer(&brokers)?;
    let order = Uuid::now_v7();
    for version in 1..=5 {
        send(&p, &topic, order, Uuid::now_v7(), &placed(order, "pi_same", version)).await?;
    }
    let running = start(Arc::new(db.store.clone()), settings(&brokers, &unique_topic("g"), &topic, 1));
    let stats = running.stats.clone();
    assert!(eventually(Duration::from_secs(60), || async { Ok(stats.received.get() >= 5) }).await?);
    running.stop().await;
    assert_eq!(db.count("payment").await?, 1);
    assert_eq!(db.count("processed_event").await?, 5, "five distinct events, each processed once");
    Ok(())
}

#[tokio::test]
async fn out_of_order_versions_end_at_the_highest_and_compensation_runs_once() -> anyhow::Result<()> {
    let (db, brokers, topic) = setup(1).await?;
    let p = producer(&brokers)?;
    let order = Uuid::now_v7();
    for version in [2, 3, 1] {
        send(&p, &topic, order, Uuid::now_v7(), &placed(order, "pi_versions", version)).await?;
    }
    let saga = Uuid::now_v7().to_string();
    for _ in 0..2 {
        // the compensation sent twice with distinct event ids: the saga step makes it one refund
        let id = Uuid::now_v7().to_string();
        produce(
            &p,
            &topic,
            Some(&order.to_string()),
            &cancelled(order, 4),
            &[("event_id", id.as_bytes()), ("saga_id", saga.as_bytes())],
        )
        .await?;
    }
    let running = start(Arc::new(db.store.clone()), settings(&brokers, &unique_topic("g"), &topic, 10));
    let stats = running.stats.clone();
    assert!(eventually(Duration::from_secs(60), || async { Ok(stats.received.get() >= 5) }).await?);
    running.stop().await;
    let (version, status): (i64, String) =
        sqlx::query_as("SELECT version, status FROM order_projection WHERE order_id = $1")
            .bind(order)
            .fetch_one(db.pool())
            .await?;
    assert_eq!((version, status.as_str()), (4, "cancelled"));
    assert_eq!(db.count("payment").await?, 1);
    assert_eq!(db.count("refund").await?, 1, "one compensation");
    let refunded: String = sqlx::query_scalar("SELECT status FROM payment").fetch_one(db.pool()).await?;
    assert_eq!(refunded, "refunded");
    Ok(())
}

#[tokio::test]
async fn bad_messages_are_dead_lettered_and_the_consumer_keeps_going() -> anyhow::Result<()> {
    let (db, brokers, topic) = setup(1).await?;
    let p = producer(&brokers)?;
    let order = Uuid::now_v7();
    let key = order.to_string();
    produce(&p, &topic, Some(&key), &placed(order, "pi_dlq_1", 1), &[]).await?; // no event_id
    produce(&p, &topic, Some(&key), &placed(order, "pi_dlq_2", 1), &[("event_id", b"not-a-uuid")]).await?;
    let id = Uuid::now_v7().to_string();
    produce(&p, &topic, Some(&key), b"{\"type\":\"OrderPlaced\",", &[("event_id", id.as_bytes())]).await?;
    // rejected by a business rule every time: another order reusing pi_dlq_ok
    let good = Uuid::now_v7();
    send(&p, &topic, good, Uuid::now_v7(), &placed(good, "pi_dlq_ok", 1)).await?;
    let thief = Uuid::now_v7();
    send(&p, &topic, thief, Uuid::now_v7(), &placed(thief, "pi_dlq_ok", 1)).await?;
    let last = Uuid::now_v7();
    send(&p, &topic, last, Uuid::now_v7(), &placed(last, "pi_dlq_last", 1)).await?;

    let running = start(Arc::new(db.store.clone()), settings(&brokers, &unique_topic("g"), &topic, 10));
    let stats = running.stats.clone();
    assert!(eventually(Duration::from_secs(60), || async { Ok(stats.dead_lettered.get() >= 4) }).await?);
    running.stop().await;
    assert_eq!(db.count("payment").await?, 2, "the good order and the one after the poison messages");
    let dlq = read_topic(&brokers, &format!("{topic}.dlq"), 4, Duration::from_secs(30)).await?;
    let mut reasons: Vec<(String, String)> = dlq
        .iter()
        .map(|m| (m.header("dlq.reason").unwrap_or_default(), m.header("dlq.error").unwrap_or_default()))
        .collect();
    reasons.sort();
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    assert!(reasons.iter().any(|(r, e)| r == "invalid-headers" && e.contains("missing event_id")), "{reasons:?}");
    assert!(reasons.iter().any(|(r, e)| r == "invalid-headers" && e.contains("invalid event_id")), "{reasons:?}");
    assert!(reasons.iter().any(|(r, _)| r == "malformed"), "{reasons:?}");
    assert!(reasons.iter().any(|(r, e)| r == "rejected" && e.contains("other details")), "{reasons:?}");
    for m in &dlq {
        assert_eq!(m.header("dlq.original.topic").as_deref(), Some(topic.as_str()));
        assert!(m.header("dlq.original.offset").is_some());
    }
    Ok(())
}

/// Units of work whose commit succeeds and then never returns once `commits_before_hang` units began:
/// the process "dies" between the database commit and the offset commit. Every commit takes `delay` more
/// (a slow database).
fn hang_after_commit(store: &PgStore, commits_before_hang: usize, delay: Duration) -> Arc<dyn TransactionManager> {
    let left = std::sync::atomic::AtomicUsize::new(commits_before_hang);
    Arc::new(idem_tests::faulty::FaultyCommits::new(Arc::new(store.clone()), move || {
        let hang = left.fetch_sub(1, Ordering::SeqCst) <= 1;
        Box::new(move |uow| {
            Box::pin(async move {
                uow.commit().await?;
                tokio::time::sleep(delay).await;
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok(())
            })
        })
    }))
}

#[tokio::test]
async fn killed_after_db_commit_before_offset_commit_has_no_second_effect() -> anyhow::Result<()> {
    let (db, brokers, topic) = setup(1).await?;
    let p = producer(&brokers)?;
    for i in 0..20 {
        let order = Uuid::now_v7();
        send(&p, &topic, order, Uuid::now_v7(), &placed(order, &format!("pi_kill_{i}"), 1)).await?;
    }
    let group = unique_topic("g");
    // first consumer: the second batch commits in the database and the process dies before the offsets
    let hang = hang_after_commit(&db.store, 2, Duration::ZERO);
    let first = start(hang, settings(&brokers, &group, &topic, 5));
    assert!(payments_reach(&db, 10, Duration::from_secs(60)).await?);
    tokio::time::sleep(Duration::from_millis(500)).await;
    first.task.abort(); // the crash: no shutdown, no final offset commit
    let _ = first.task.await;
    let before = db.count("payment").await?;
    assert_eq!(before, 10, "two batches of five committed in the database");

    let second = start(Arc::new(db.store.clone()), settings(&brokers, &group, &topic, 5));
    let stats = second.stats.clone();
    assert!(
        eventually(Duration::from_secs(60), || async { Ok(stats.processed.get() + stats.duplicates.get() >= 15) })
            .await?
    );
    second.stop().await;
    assert_eq!(db.count("payment").await?, 20, "every order charged exactly once");
    applied_once_each(&db, 20).await?;
    assert!(stats.duplicates.get() >= 5, "the redelivered batch was recognised");
    Ok(())
}

#[tokio::test]
async fn rebalance_under_load_keeps_effects_equal_to_distinct_events() -> anyhow::Result<()> {
    let (db, brokers, topic) = setup(4).await?;
    let group = unique_topic("g");
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let a = start(tm.clone(), settings(&brokers, &group, &topic, 20));
    let p = producer(&brokers)?;
    let mut distinct = 0;
    let mut b = None;
    let mut b_stats = None;
    for i in 0..1500 {
        let order = Uuid::now_v7();
        let event = Uuid::now_v7();
        send(&p, &topic, order, event, &placed(order, &format!("pi_rb_{i}"), 1)).await?;
        distinct += 1;
        if i % 5 == 0 {
            send(&p, &topic, order, event, &placed(order, &format!("pi_rb_{i}"), 1)).await?;
        }
        if i == 300 {
            b = Some(start(tm.clone(), settings(&brokers, &group, &topic, 20)));
        }
        if i == 1000
            && let Some(b) = b.take()
        {
            // The rebalance must have happened under load before the second member leaves: wait for it to
            // process (the producer's pace alone does not guarantee that).
            let stats = b.stats.clone();
            anyhow::ensure!(
                eventually(Duration::from_secs(60), || async { Ok(stats.processed.get() > 0) }).await?,
                "the second member never got partitions"
            );
            b_stats = Some(b.stats.clone());
            b.stop().await; // leaves the group: its partitions go back to the first consumer
        }
    }
    let done = payments_reach(&db, distinct, Duration::from_secs(90)).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let a_stats = a.stats.clone();
    a.stop().await;
    assert!(done, "all events processed");
    let b_processed = b_stats.map_or(0, |s| s.processed.get());
    assert!(b_processed > 0, "the second member took partitions and processed events");
    assert!(a_stats.processed.get() > 0);
    assert_eq!(db.count("payment").await?, distinct);
    applied_once_each(&db, distinct).await?;
    assert_eq!(db.count("processed_event").await?, distinct);
    Ok(())
}

#[tokio::test]
async fn consumer_lag_is_reported() -> anyhow::Result<()> {
    let (db, brokers, topic) = setup(1).await?;
    let p = producer(&brokers)?;
    for i in 0..40 {
        let order = Uuid::now_v7();
        send(&p, &topic, order, Uuid::now_v7(), &placed(order, &format!("pi_lag_{i}"), 1)).await?;
    }
    // a slow database: each batch of 5 takes 2 s to commit, so most of the 40 messages wait
    let hang = hang_after_commit(&db.store, usize::MAX, Duration::from_secs(2));
    let stuck = start(hang, settings(&brokers, &unique_topic("g"), &topic, 5));
    let stats = stuck.stats.clone();
    let reported = eventually(Duration::from_secs(30), || async { Ok(stats.lag.get() >= 15) }).await?;
    stuck.task.abort();
    assert!(reported, "lag gauge reached {} (want >= 15)", stats.lag.get());
    Ok(())
}

/// Issue 11.1: HTTP merchants choose order ids freely; an `OrderCancelled` on the orders topic must only
/// ever compensate the order stream's own payment of that order, never another merchant's.
#[tokio::test]
async fn an_order_cancellation_never_refunds_another_merchants_payment() -> anyhow::Result<()> {
    use idem_domain::usecases::{ChargeCommand, Env, charge_payment};
    use idem_domain::{Amount, Currency, Money};
    use idem_ports::{Clock, EventHandler, InboundEvent};
    let db = TestDb::new().await?;
    let order = Uuid::now_v7();
    let (clock, ids) = (SystemClock, UuidV7Generator);
    let env = Env { clock: &clock as &dyn Clock, ids: &ids, payments_topic: "payments" };
    let money = Money::new(Amount::parse("10.00").expect("amount"), Currency::parse("EUR").expect("currency"))?;
    let cmd = ChargeCommand::new("merchant_a", order, Uuid::now_v7(), "stripe", "pi_http_a", money)
        .map_err(|e| anyhow::anyhow!("{}: {}", e.field, e.reason))?;
    let mut uow = db.store.begin().await?;
    charge_payment(idem_postgres::payments_of(uow.as_mut())?, env, &cmd).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    uow.commit().await?;

    let cancel = |version: i64| InboundEvent {
        event_id: Uuid::now_v7(),
        saga_id: Some(Uuid::now_v7()),
        topic: "orders".into(),
        partition: 0,
        offset: version,
        key: Some(order.to_string().into_bytes()),
        payload: cancelled(order, version),
        headers: Vec::new(),
    };
    let mut uow = db.store.begin().await?;
    handler().handle(uow.as_mut(), &cancel(2)).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    uow.commit().await?;
    assert_eq!(db.count("refund").await?, 0, "the order stream refunded merchant_a's payment");
    let status: String = sqlx::query_scalar("SELECT status::text FROM payment WHERE merchant_id = 'merchant_a'")
        .fetch_one(db.pool())
        .await?;
    assert_eq!(status, "captured");
    Ok(())
}

/// Reads the group's committed offsets every 100 ms until `stop`; returns every backwards move seen.
fn sample_committed(
    brokers: String,
    group: String,
    topic: String,
    partitions: i32,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<anyhow::Result<(usize, Vec<String>)>> {
    tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let c: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()?;
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
        let mut high: std::collections::HashMap<i32, i64> = std::collections::HashMap::new();
        let (mut samples, mut backwards) = (0, Vec::new());
        while !stop.load(Ordering::SeqCst) {
            if let Ok(committed) = c.committed_offsets(tpl.clone(), Duration::from_secs(2)) {
                samples += 1;
                for e in committed.elements() {
                    if let rdkafka::Offset::Offset(o) = e.offset() {
                        let h = high.entry(e.partition()).or_insert(o);
                        if o < *h {
                            backwards.push(format!("partition {} went back from {} to {o}", e.partition(), *h));
                        }
                        *h = (*h).max(o);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok((samples, backwards))
    })
}

/// Issue 10.4: a member must never commit positions of partitions it no longer owns. Two members under
/// load, a member joining and leaving: the group's committed offsets, sampled all along, never go back.
#[tokio::test]
async fn committed_offsets_never_move_backwards_across_rebalances() -> anyhow::Result<()> {
    let (db, brokers, topic) = setup(4).await?;
    let group = unique_topic("g");
    let n = 1500usize;
    let load = {
        let (brokers, topic) = (brokers.clone(), topic.clone());
        tokio::spawn(async move {
            let p = producer(&brokers)?;
            for i in 0..n {
                let order = Uuid::now_v7();
                send(&p, &topic, order, Uuid::now_v7(), &placed(order, &format!("pi_rb_{i}"), 1)).await?;
                if i % 25 == 0 {
                    tokio::time::sleep(Duration::from_millis(60)).await;
                }
            }
            anyhow::Ok(())
        })
    };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = sample_committed(brokers.clone(), group.clone(), topic.clone(), 4, stop.clone());
    let a = start(Arc::new(db.store.clone()), settings(&brokers, &group, &topic, 20));
    tokio::time::sleep(Duration::from_secs(6)).await;
    let b = start(Arc::new(db.store.clone()), settings(&brokers, &group, &topic, 20));
    tokio::time::sleep(Duration::from_secs(12)).await;
    b.stop().await;
    load.await??;
    let done = eventually(Duration::from_secs(90), || async { Ok(db.count("payment").await? >= n as i64) }).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    a.stop().await;
    stop.store(true, Ordering::SeqCst);
    let (samples, backwards) = sampler.await??;
    assert!(done, "only {} of {n} payments", db.count("payment").await?);
    assert!(samples > 50, "only {samples} samples of the committed offsets");
    assert!(
        backwards.is_empty(),
        "committed offsets moved backwards {} times: {:?}",
        backwards.len(),
        &backwards[..backwards.len().min(6)]
    );
    assert_eq!(db.count("payment").await?, n as i64);
    applied_once_each(&db, n as i64).await?;
    Ok(())
}

/// Issue 10.5: a consumer days behind must not apply an event whose dedup row may already be gone. An
/// event whose v7 id is older than the dedup window (less the margin) is dead-lettered as
/// `older-than-dedup-window`; younger events and ids without a time (v4) are applied.
#[tokio::test]
async fn events_older_than_the_dedup_window_are_dead_lettered_not_applied() -> anyhow::Result<()> {
    let (db, brokers, topic) = setup(1).await?;
    let p = producer(&brokers)?;
    let (old, recent, untimed) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    send(
        &p,
        &topic,
        old,
        idem_tests::v7_at(chrono::Utc::now() - chrono::Duration::hours(73)),
        &placed(old, "pi_old", 1),
    )
    .await?;
    send(
        &p,
        &topic,
        recent,
        idem_tests::v7_at(chrono::Utc::now() - chrono::Duration::hours(1)),
        &placed(recent, "pi_recent", 1),
    )
    .await?;
    send(&p, &topic, untimed, Uuid::new_v4(), &placed(untimed, "pi_v4", 1)).await?;
    // a producer clock days ahead: its id would fall outside the dedup partitions created ahead
    let future = Uuid::now_v7();
    let future_id = idem_tests::v7_at(chrono::Utc::now() + chrono::Duration::days(10));
    send(&p, &topic, future, future_id, &placed(future, "pi_future", 1)).await?;
    let running = start(Arc::new(db.store.clone()), settings(&brokers, &unique_topic("g"), &topic, 10));
    let stats = running.stats.clone();
    assert!(
        eventually(Duration::from_secs(60), || async {
            Ok(stats.dead_lettered.get() >= 2 && stats.processed.get() >= 2)
        })
        .await?
    );
    running.stop().await;
    let externals: Vec<String> =
        sqlx::query_scalar("SELECT external_payment_id FROM payment ORDER BY 1").fetch_all(db.pool()).await?;
    assert_eq!(externals, ["pi_recent", "pi_v4"], "the event older than the dedup window was applied");
    applied_once_each(&db, 2).await?;
    let dlq = read_topic(&brokers, &format!("{topic}.dlq"), 2, Duration::from_secs(30)).await?;
    assert_eq!(dlq.len(), 2);
    assert_eq!(dlq[0].header("dlq.reason").as_deref(), Some("older-than-dedup-window"));
    assert!(dlq[0].header("dlq.error").is_some_and(|e| e.contains("admission floor")));
    assert_eq!(dlq[1].header("dlq.reason").as_deref(), Some("future-dated-event-id"));
    Ok(())
}

/// A broker cut the way the issue saw it: every connection is closed at once, then new ones are refused.
/// librdkafka reports the refused connects ("Connect to … failed", "all brokers down") through `recv()`.
/// The runner must count them and keep waiting: a Kafka outage never ends the consumer (nor, with it, the
/// process).
#[tokio::test]
async fn a_broker_cut_never_ends_the_runner() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let port = idem_tests::port_for_child();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let accepted = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = accepted.clone();
    // Accepts and drops three connections, then stops listening: later connects are refused.
    let broker = tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            drop(conn);
            if counter.fetch_add(1, Ordering::SeqCst) + 1 >= 3 {
                break;
            }
        }
    });
    let runner = Runner::new(
        settings(&format!("127.0.0.1:{port}"), &unique_topic("g"), "orders-unreachable", 10),
        Arc::new(db.store.clone()),
        Arc::new(SystemClock),
        handler(),
    );
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone()));
    let errors_seen =
        eventually(Duration::from_secs(30), || async { Ok(stats.kafka_errors.get() >= 1 || task.is_finished()) })
            .await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!task.is_finished(), "the runner ended on a broker outage: {:?}", task.await);
    assert!(errors_seen, "no client error came through recv() ({} connections)", accepted.load(Ordering::SeqCst));
    assert!(broker.is_finished(), "the cut broker dropped its three connections");
    stop.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(20), task).await?;
    assert!(matches!(ended, Ok(Ok(()))), "shutdown during an outage is clean: {ended:?}");
    Ok(())
}

/// A member that leaves while the group is still rebalancing to take it in (a pod killed during a rolling
/// deploy) must not stall the members that stay: they get every partition back and consume the rest.
#[tokio::test]
async fn a_member_leaving_during_a_rebalance_does_not_stall_the_group() -> anyhow::Result<()> {
    let (db, brokers, topic) = setup(4).await?;
    let group = unique_topic("g");
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let a = start(tm.clone(), settings(&brokers, &group, &topic, 20));
    let p = producer(&brokers)?;
    let mut sent = 0i64;
    let mut batch = |n: usize| {
        let start = sent;
        sent += n as i64;
        (start..start + n as i64).map(|i| (Uuid::now_v7(), Uuid::now_v7(), i)).collect::<Vec<_>>()
    };
    for (order, event, i) in batch(100) {
        send(&p, &topic, order, event, &placed(order, &format!("pi_mid_{i}"), 1)).await?;
    }
    let stats = a.stats.clone();
    anyhow::ensure!(eventually(Duration::from_secs(60), || async { Ok(stats.processed.get() >= 100) }).await?);
    for pause_ms in [100u64, 700, 3000] {
        let b = start(tm.clone(), settings(&brokers, &group, &topic, 20));
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        b.stop().await;
        for (order, event, i) in batch(100) {
            send(&p, &topic, order, event, &placed(order, &format!("pi_mid_{i}"), 1)).await?;
        }
    }
    let done = payments_reach(&db, sent, Duration::from_secs(60)).await?;
    a.stop().await;
    assert!(done, "the member that stayed consumed everything: {} of {sent}", db.count("payment").await?);
    assert_eq!(db.count("payment").await?, sent);
    Ok(())
}

mod effects {
    //! Issue 24: dedup holes, counted through a handler that is not idempotent on its own (one row per
    //! application), with the runner's clock moved instead of waiting a day.

    use super::*;
    use idem_postgres::DedupStorage;
    use idem_tests::effects::{CountingHandler, ShiftedClock, applications_of_event, create_application_log};

    const DAY: u64 = 24 * 3600;

    fn counting(store: PgStore, settings: RunnerSettings, clock: Arc<ShiftedClock>) -> Running {
        let runner = Runner::new(settings, Arc::new(store), clock, Arc::new(CountingHandler));
        let stats = runner.stats();
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            if let Err(e) = runner.run(token).await {
                panic!("consumer failed: {e}");
            }
        });
        Running { stop, task, stats }
    }

    fn day_settings(brokers: &str, group: &str, topic: &str) -> RunnerSettings {
        let mut s = settings(brokers, group, topic, 10);
        s.dedup_ttl = TtlPolicy::new(Duration::from_secs(DAY)).expect("ttl");
        s
    }

    /// Sends a marker dated at the runner's clock and waits until it was applied: everything sent before it
    /// on the partition was handled.
    async fn drain(
        db: &TestDb,
        p: &rdkafka::producer::FutureProducer,
        topic: &str,
        clock: &ShiftedClock,
    ) -> anyhow::Result<()> {
        use idem_ports::Clock;
        let marker = idem_tests::v7_at(clock.now());
        send(p, topic, Uuid::from_u128(1), marker, b"{}").await?;
        let seen =
            eventually(Duration::from_secs(60), || async { Ok(applications_of_event(db, marker).await? == 1) }).await?;
        anyhow::ensure!(seen, "the marker {marker} was never applied");
        Ok(())
    }

    /// Issue 26: events from `EventProducer` (outside the outbox) carry a UUID v7 `event_id` each and are
    /// applied once; a retry of a send with the same id is dropped by the consumer, counted through a
    /// handler that is not idempotent on its own.
    #[tokio::test]
    async fn events_from_the_event_producer_are_applied_once_and_its_retries_dropped() -> anyhow::Result<()> {
        let (db, brokers, topic) = setup(1).await?;
        create_application_log(&db).await?;
        let clock = Arc::new(ShiftedClock::new());
        let running = counting(db.store.clone(), day_settings(&brokers, &unique_topic("g"), &topic), clock.clone());
        let events = idem_kafka::EventProducer::new(
            &idem_kafka::ProducerSettings::new(&brokers),
            Arc::new(idem_ports::UuidV7Generator),
        )?;
        let mut sent = Vec::new();
        for i in 0..3 {
            sent.push(events.send(&topic, &format!("k{i}"), b"{}", Duration::from_secs(10)).await?);
        }
        // a send whose outcome the caller did not learn, retried with its id
        let retried = events.send_with_id(sent[0].event_id, &topic, "k0", b"{}", Duration::from_secs(10)).await?;
        assert_eq!(retried.event_id, sent[0].event_id);
        let p = producer(&brokers)?;
        drain(&db, &p, &topic, &clock).await?;
        running.stop().await;
        for s in &sent {
            assert_eq!(s.event_id.get_version_num(), 7, "the event id is not a UUID v7");
            assert_eq!(applications_of_event(&db, s.event_id).await?, 1, "{} applied other than once", s.event_id);
        }
        Ok(())
    }

    /// Issue 26: a `PgEventHandler` run by `idem::pg_runner` gets its unit of work typed (its SQL on
    /// `tx.connection()`, no conversion that could fail) and each event applied once, duplicates dropped.
    #[tokio::test]
    async fn a_typed_postgres_handler_applies_each_event_once() -> anyhow::Result<()> {
        struct Log;
        #[idem::async_trait]
        impl idem::PgEventHandler for Log {
            async fn handle(
                &self,
                tx: &mut idem_postgres::PgUnitOfWork,
                event: &idem_ports::InboundEvent,
            ) -> Result<(), idem_ports::HandlerError> {
                sqlx::query("INSERT INTO test_application (event_id, topic) VALUES ($1, $2)")
                    .bind(event.event_id)
                    .bind(&event.topic)
                    .execute(tx.connection())
                    .await
                    .map_err(idem_postgres::map_sqlx_error)?;
                Ok(())
            }
        }
        let (db, brokers, topic) = setup(1).await?;
        create_application_log(&db).await?;
        let clock = Arc::new(ShiftedClock::new());
        let runner =
            idem::pg_runner(day_settings(&brokers, &unique_topic("g"), &topic), db.store.clone(), clock.clone(), Log);
        let stop = CancellationToken::new();
        let task = tokio::spawn(runner.run(stop.clone()));
        let p = producer(&brokers)?;
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        for id in [a, b, a] {
            send(&p, &topic, Uuid::from_u128(9), id, b"{}").await?;
        }
        drain(&db, &p, &topic, &clock).await?;
        stop.cancel();
        task.await??;
        assert_eq!((applications_of_event(&db, a).await?, applications_of_event(&db, b).await?), (1, 1));
        Ok(())
    }

    /// 24.1: an event applied inside the window, refused 60 s later as `older-than-dedup-window` and
    /// re-driven with `--admit-late` (its `late_admission` row), is not applied again while its
    /// processed-event row still exists — in both dedup storages.
    #[tokio::test]
    async fn a_late_redrive_of_an_event_still_recorded_is_not_applied_again() -> anyhow::Result<()> {
        for storage in [DedupStorage::Table, DedupStorage::Partitioned] {
            let (db, brokers, topic) = setup(1).await?;
            create_application_log(&db).await?;
            let store = db.store.clone().with_dedup_storage(storage);
            let clock = Arc::new(ShiftedClock::new());
            let group = unique_topic("g");
            let running = counting(store, day_settings(&brokers, &group, &topic), clock.clone());
            let p = producer(&brokers)?;
            // 22 h 59 m 30 s old: 30 s inside the admission floor of a 24 h window
            let e = idem_tests::v7_at(chrono::Utc::now() - chrono::Duration::seconds(23 * 3600 - 30));
            send(&p, &topic, Uuid::from_u128(2), e, b"{}").await?;
            drain(&db, &p, &topic, &clock).await?;
            assert_eq!(applications_of_event(&db, e).await?, 1, "{storage:?}: the first delivery");
            clock.advance(chrono::Duration::seconds(60));
            send(&p, &topic, Uuid::from_u128(2), e, b"{}").await?;
            drain(&db, &p, &topic, &clock).await?;
            // the dead letter goes out after its batch commits, so after the marker's application
            let stats = running.stats.clone();
            let refused = eventually(Duration::from_secs(20), || async { Ok(stats.dead_lettered.get() == 1) }).await?;
            assert!(refused, "{storage:?}: the second delivery is past the floor and dead-lettered");
            // what `idem dlq redrive --admit-late` does: admit it, then produce it again
            sqlx::query("INSERT INTO late_admission (consumer, event_id, admitted_by, admitted_at) VALUES ($1, $2, 'test', now())")
                .bind(&group)
                .bind(e)
                .execute(db.pool())
                .await?;
            send(&p, &topic, Uuid::from_u128(2), e, b"{}").await?;
            drain(&db, &p, &topic, &clock).await?;
            running.stop().await;
            assert_eq!(
                applications_of_event(&db, e).await?,
                1,
                "{storage:?}: a late admission applied an event whose processed-event row still exists"
            );
        }
        Ok(())
    }

    /// 24.2: an id dated 10 h ahead is applied; 25 h later (after a cleanup) the same event arrives again.
    /// It is still inside the admission window (its own time + TTL − 1 h), so its dedup row must still be
    /// there: the row's expiry counts from the later of processing time and event time.
    #[tokio::test]
    async fn an_event_dated_ahead_keeps_its_dedup_row_as_long_as_it_is_admitted() -> anyhow::Result<()> {
        let (db, brokers, topic) = setup(1).await?;
        create_application_log(&db).await?;
        let clock = Arc::new(ShiftedClock::new());
        let running = counting(db.store.clone(), day_settings(&brokers, &unique_topic("g"), &topic), clock.clone());
        let p = producer(&brokers)?;
        let e = idem_tests::v7_at(chrono::Utc::now() + chrono::Duration::hours(10));
        send(&p, &topic, Uuid::from_u128(3), e, b"{}").await?;
        drain(&db, &p, &topic, &clock).await?;
        assert_eq!(applications_of_event(&db, e).await?, 1);
        clock.advance(chrono::Duration::hours(25));
        {
            // what a cleanup round 25 h from now deletes (the cleaner itself decides by the database's
            // clock, which a test cannot move)
            use idem_ports::Clock;
            sqlx::query("DELETE FROM processed_event WHERE expires_at <= $1")
                .bind(clock.now())
                .execute(db.pool())
                .await?;
        }
        send(&p, &topic, Uuid::from_u128(3), e, b"{}").await?;
        drain(&db, &p, &topic, &clock).await?;
        running.stop().await;
        assert_eq!(
            applications_of_event(&db, e).await?,
            1,
            "a future-dated event was applied again after its dedup row expired inside its admission window"
        );
        Ok(())
    }
}

/// Issue 24.8: the per-event rejection counts only grew (an event refused once and applied on its retry
/// kept its entry for the life of the process). They are dropped once the event is applied.
#[tokio::test]
async fn rejection_counts_are_forgotten_once_the_event_is_applied() -> anyhow::Result<()> {
    use idem_ports::{EventHandler, HandlerError, InboundEvent, UnitOfWork};
    use std::sync::Mutex;

    /// Refuses each event's first attempt, applies the second.
    #[derive(Default)]
    struct RefusesOnce(Mutex<std::collections::HashSet<Uuid>>);
    #[async_trait::async_trait]
    impl EventHandler for RefusesOnce {
        async fn handle(&self, _uow: &mut dyn UnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
            if self.0.lock().unwrap_or_else(|p| p.into_inner()).insert(event.event_id) {
                return Err(HandlerError::Rejected("not yet".into()));
            }
            Ok(())
        }
    }
    let (db, brokers, topic) = setup(1).await?;
    let p = producer(&brokers)?;
    for _ in 0..5 {
        send(&p, &topic, Uuid::now_v7(), Uuid::now_v7(), b"{}").await?;
    }
    let mut s = settings(&brokers, &unique_topic("g"), &topic, 1);
    s.max_rejections = 3;
    let runner = Runner::new(s, Arc::new(db.store.clone()), Arc::new(SystemClock), Arc::new(RefusesOnce::default()));
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone()));
    let done = eventually(Duration::from_secs(60), || async { Ok(stats.processed.get() >= 5) }).await?;
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(20), task).await;
    assert!(done, "the events were not applied on their retry");
    assert_eq!(stats.dead_lettered.get(), 0);
    assert_eq!(stats.retrying.get(), 0, "rejection counts of applied events were kept");
    Ok(())
}

/// Issue 24.8: `idem dlq redrive` read the whole dead-letter topic into memory. The reader it streams
/// through hands out bounded batches up to the end the topic had when opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_reader_streams_bounded_batches() -> anyhow::Result<()> {
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("dlq-stream");
    create_topic(&brokers, &topic, 2).await?;
    let p = producer(&brokers)?;
    for i in 0..1200 {
        let key = format!("k{i}");
        produce(&p, &topic, Some(&key), b"{}", &[]).await?;
    }
    let sizes = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<usize>> {
        let mut reader = idem_kafka::dlq::Reader::open(&(&brokers).into(), &topic, Duration::from_secs(30))?;
        let mut sizes = Vec::new();
        loop {
            let batch = reader.next_batch(500)?;
            if batch.is_empty() {
                return Ok(sizes);
            }
            sizes.push(batch.len());
        }
    })
    .await??;
    assert!(sizes.iter().all(|n| *n <= 500), "{sizes:?}");
    assert_eq!(sizes.iter().sum::<usize>(), 1200, "{sizes:?}");
    Ok(())
}

/// Issue 38.1: a payload near the producer's limit is accepted by the broker, but its dead-letter copy (with
/// the provenance headers) exceeded the dead-letter producer's `message.max.bytes`: the runner retried it
/// for ever, never committed, never polled again, and orders produced after it were never applied. Now the
/// dead-letter producer takes what the consumer can fetch plus room for the provenance, and a message
/// larger still (1.5 MB from a producer allowed 2 MB) is dead-lettered cut, its original size and
/// position recorded. The orders after both are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_near_limit_message_is_dead_lettered_and_later_orders_are_applied() -> anyhow::Result<()> {
    let (db, brokers, topic) = setup(1).await?;
    let p = producer(&brokers)?;
    let large: rdkafka::producer::FutureProducer =
        idem_kafka::ProducerSettings::new(&brokers).client_config().set("message.max.bytes", "2000000").create()?;
    let order = Uuid::now_v7();
    let (near_id, huge_id) = (Uuid::now_v7().to_string(), Uuid::now_v7().to_string());
    let near = vec![b'x'; 999_850];
    let huge = vec![b'y'; 1_500_000];
    produce(&p, &topic, Some(&order.to_string()), &near, &[("event_id", near_id.as_bytes())]).await?;
    produce(&large, &topic, Some(&order.to_string()), &huge, &[("event_id", huge_id.as_bytes())]).await?;
    let running = start(Arc::new(db.store.clone()), settings(&brokers, &unique_topic("g"), &topic, 1));
    let stats = running.stats.clone();
    // valid orders in later batches, produced after the runner is already on the large ones
    tokio::time::sleep(Duration::from_secs(2)).await;
    for n in 0..3 {
        let o = Uuid::now_v7();
        send(&p, &topic, o, Uuid::now_v7(), &placed(o, &format!("pi_after_large_{n}"), 1)).await?;
    }
    let applied = payments_reach(&db, 3, Duration::from_secs(60)).await?;
    let dead = stats.dead_lettered.get();
    running.stop().await;
    assert!(applied, "the orders after the large messages were not applied ({dead} dead-lettered)");
    applied_once_each(&db, 3).await?;
    assert_eq!(dead, 2);
    let dlq = read_topic(&brokers, &format!("{topic}.dlq"), 2, Duration::from_secs(30)).await?;
    assert_eq!(dlq.len(), 2);
    let (whole, cut) = (&dlq[0], &dlq[1]);
    assert_eq!(whole.header("event_id").as_deref(), Some(near_id.as_str()));
    assert_eq!((whole.payload.len(), whole.header("dlq.original.size")), (near.len(), None), "sent whole");
    assert_eq!(cut.header("event_id").as_deref(), Some(huge_id.as_str()));
    assert_eq!(cut.header("dlq.reason").as_deref(), Some("malformed"));
    assert_eq!(cut.header("dlq.original.size").as_deref(), Some("1500000"));
    assert_eq!(cut.header("dlq.original.offset").as_deref(), Some("1"));
    assert!(cut.payload.len() < 100_000 && huge.starts_with(&cut.payload), "cut, not altered: {}", cut.payload.len());
    Ok(())
}

/// Issue 32.1: a service on the toolkit (no `idem serve`) renames its consumer group for a "v2" deploy.
/// Before: the new group started from the earliest offset with no processed rows, and every event was
/// applied a second time (3,000 credits for 1,500 event ids in the review). Now every runner checks its
/// group, topic and dedup storage against what earlier starts recorded, refuses the rename with the
/// binary's text, and applies nothing; accepting the change explicitly lets it run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_toolkit_runner_refuses_a_renamed_group_instead_of_applying_everything_again() -> anyhow::Result<()> {
    use idem_tests::effects::{CountingHandler, create_application_log};
    let (db, brokers, topic) = setup(1).await?;
    create_application_log(&db).await?;
    let p = producer(&brokers)?;
    let n = 60;
    for _ in 0..n {
        let id = Uuid::now_v7();
        send(&p, &topic, id, id, b"bonus").await?;
    }
    let applications = || async {
        anyhow::Ok(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM test_application").fetch_one(db.pool()).await?)
    };
    let run = |group: &str, accept: &[&str]| {
        let mut s = settings(&brokers, group, &topic, 20);
        s.accept_setting_changes = accept.iter().map(|a| (*a).to_owned()).collect();
        let runner = Runner::new(s, Arc::new(db.store.clone()), Arc::new(SystemClock), Arc::new(CountingHandler));
        let stop = CancellationToken::new();
        (stop.clone(), tokio::spawn(runner.run(stop)))
    };
    let (stop, v1) = run("wallet", &[]);
    assert!(eventually(Duration::from_secs(60), || async { Ok(applications().await? >= n) }).await?);
    stop.cancel();
    v1.await??;

    let (stop, v2) = run("wallet-v2", &[]);
    let refused = tokio::time::timeout(Duration::from_secs(20), v2).await;
    stop.cancel();
    let applied = applications().await?;
    let error = match refused {
        Ok(Ok(Err(e))) => e.to_string(),
        other => panic!("the renamed group ran ({applied} applications of {n} events): {other:?}"),
    };
    assert!(error.contains("KAFKA_GROUP_ID changed from wallet to wallet-v2"), "{error}");
    assert!(error.contains("consumer-group"), "{error}");
    assert_eq!(applied, n, "events applied again under the new group");

    // accepted deliberately (after copying the old group's rows, as the refusal says): it runs
    sqlx::query(
        "INSERT INTO processed_event SELECT 'wallet-v2', event_id, topic, created_at, expires_at
         FROM processed_event WHERE consumer_name = 'wallet'",
    )
    .execute(db.pool())
    .await?;
    let (stop, v2) = run("wallet-v2", &["consumer-group"]);
    let last = Uuid::now_v7();
    send(&p, &topic, last, last, b"bonus").await?;
    assert!(eventually(Duration::from_secs(60), || async { Ok(applications().await? > n) }).await?);
    stop.cancel();
    v2.await??;
    assert_eq!(applications().await?, n + 1, "only the new event was applied");
    Ok(())
}

/// A handler that swallows the error of a failed statement for events whose payload is `swallow`, and
/// logs every other event as one application.
struct SwallowingHandler;

#[async_trait::async_trait]
impl idem_ports::EventHandler for SwallowingHandler {
    async fn handle(
        &self,
        uow: &mut dyn idem_ports::UnitOfWork,
        event: &idem_ports::InboundEvent,
    ) -> Result<(), idem_ports::HandlerError> {
        let pg = idem_postgres::PgUnitOfWork::of(uow)?;
        if event.payload == b"swallow" {
            let _ = sqlx::query("SELECT 1 / 0").execute(pg.connection()).await; // the error is dropped
            return Ok(());
        }
        sqlx::query("INSERT INTO test_application (event_id, topic) VALUES ($1, $2)")
            .bind(event.event_id)
            .bind(&event.topic)
            .execute(pg.connection())
            .await
            .map_err(|e| idem_ports::HandlerError::Store(idem_postgres::map_sqlx_error(e)))?;
        Ok(())
    }
}

/// Issue 32.6: a handler swallows a failed statement. The commit is refused (nothing half-applied), but the
/// batch was classed transient and retried for ever with backoff: the events after it were never applied.
/// Now the refused commit is the handler's failure: the event is isolated, retried `max_rejections` times,
/// then dead-lettered with the SQLSTATE, and its neighbours are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_swallows_a_failed_statement_does_not_stall_its_partition() -> anyhow::Result<()> {
    use idem_tests::effects::create_application_log;
    let (db, brokers, topic) = setup(1).await?;
    create_application_log(&db).await?;
    let p = producer(&brokers)?;
    for payload in [&b"ok"[..], b"swallow", b"ok", b"ok"] {
        let id = Uuid::now_v7();
        send(&p, &topic, id, id, payload).await?;
    }
    let runner = Runner::new(
        settings(&brokers, &unique_topic("g"), &topic, 10),
        Arc::new(db.store.clone()),
        Arc::new(SystemClock),
        Arc::new(SwallowingHandler),
    );
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone()));
    let applications = || async {
        anyhow::Ok(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM test_application").fetch_one(db.pool()).await?)
    };
    let done = eventually(Duration::from_secs(60), || async {
        Ok(applications().await? == 3 && stats.dead_lettered.get() == 1)
    })
    .await?;
    let (applied, dead) = (applications().await?, stats.dead_lettered.get());
    stop.cancel();
    task.await??;
    assert!(done, "{applied} of 3 events applied, {dead} dead-lettered");
    let dlq = read_topic(&brokers, &format!("{topic}.dlq"), 1, Duration::from_secs(30)).await?;
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].payload, b"swallow");
    let error = dlq[0].header("dlq.error").unwrap_or_default();
    assert!(error.contains("25P02"), "the dead letter names the SQLSTATE: {error}");
    Ok(())
}

/// Issue 32.7: twenty dead letters written as one produce batch were read as one by `dlq::Reader` on tansu
/// (a plain consumer read all twenty): the reader stopped at a high watermark the broker reported wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_reader_reads_a_batch_written_at_once() -> anyhow::Result<()> {
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("dlq-batch");
    create_topic(&brokers, &topic, 1).await?;
    let p: rdkafka::producer::FutureProducer =
        idem_kafka::ProducerSettings::new(&brokers).client_config().set("linger.ms", "200").create()?;
    let sends = (0..20).map(|i| {
        let (key, p, topic) = (format!("k{i}"), p.clone(), topic.clone());
        async move {
            let record = rdkafka::producer::FutureRecord::to(&topic).key(&key).payload("{}");
            p.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e)
        }
    });
    let delivered = futures::future::join_all(sends).await;
    assert!(delivered.iter().all(Result::is_ok), "{delivered:?}");
    let topic_read = topic.clone();
    let read = tokio::task::spawn_blocking(move || {
        idem_kafka::dlq::read_all(&(&brokers).into(), &topic_read, Duration::from_secs(30), |_| {})
    })
    .await??;
    assert_eq!(read.len(), 20, "read {} of 20 dead letters written as one batch", read.len());
    Ok(())
}

/// Issue 36: a retry policy chooses per error. With the default (`max_rejections = 2`) a rejection that
/// clears on its sixth attempt would be dead-lettered at its third, and one that will never clear would be
/// retried three times. The policy here dead-letters "never" at its first failure and retries "flaky"
/// until it is applied: each handler call is counted.
#[tokio::test]
async fn a_retry_policy_dead_letters_one_error_at_once_and_retries_another_until_it_clears() -> anyhow::Result<()> {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use idem_kafka::consumer::{RetryPolicy, Verdict};
    use idem_ports::{EventHandler, HandlerError, InboundEvent, UnitOfWork};

    #[derive(Default)]
    struct Flaky {
        calls: Mutex<HashMap<String, u32>>,
    }

    #[async_trait::async_trait]
    impl EventHandler for Flaky {
        async fn handle(&self, _: &mut dyn UnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
            let body = String::from_utf8_lossy(&event.payload).into_owned();
            let n = {
                let mut calls = self.calls.lock().expect("calls");
                let n = calls.entry(body.clone()).or_insert(0);
                *n += 1;
                *n
            };
            match body.as_str() {
                "never" => Err(HandlerError::Rejected("never: the account is closed".into())),
                "flaky" if n < 6 => Err(HandlerError::Rejected("flaky: the limit is not raised yet".into())),
                _ => Ok(()),
            }
        }
    }

    let (db, brokers, topic) = setup(1).await?;
    let p = producer(&brokers)?;
    let (never, flaky) = (Uuid::now_v7(), Uuid::now_v7());
    send(&p, &topic, Uuid::from_u128(1), never, b"never").await?;
    send(&p, &topic, Uuid::from_u128(1), flaky, b"flaky").await?;
    let mut s = settings(&brokers, &unique_topic("g"), &topic, 1);
    s.retry = Some(RetryPolicy::new(|f| match f.error {
        HandlerError::Rejected(why) if why.starts_with("never") => Verdict::DeadLetter,
        _ if f.attempts <= 10 => Verdict::RetryAfter(Duration::from_millis(20)),
        _ => Verdict::DeadLetter,
    }));
    let handler = Arc::new(Flaky::default());
    let runner = Runner::new(s, Arc::new(db.store.clone()), Arc::new(SystemClock), handler.clone());
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone()));
    let applied = eventually(Duration::from_secs(30), || async {
        Ok(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM processed_event WHERE event_id = $1")
            .bind(flaky)
            .fetch_one(db.pool())
            .await?
            == 1)
    })
    .await?;
    stop.cancel();
    task.await??;
    let dlq = read_topic(&brokers, &format!("{topic}.dlq"), 1, Duration::from_secs(30)).await?;
    let calls = handler.calls.lock().expect("calls").clone();
    assert!(applied, "the flaky event was never applied: {calls:?}");
    assert_eq!((calls.get("never"), calls.get("flaky")), (Some(&1), Some(&6)), "handler calls");
    assert_eq!(dlq.len(), 1, "{dlq:?}");
    assert_eq!(dlq[0].header("event_id"), Some(never.to_string()));
    assert_eq!(dlq[0].header("dlq.reason").as_deref(), Some("rejected"));
    Ok(())
}

/// Issue 36: one consumer, several kinds of event. `Dispatch` routes by the relay's `event_type` header
/// (or a JSON `type` field), reads payloads into the handler's type, and dead-letters an unknown type and a
/// payload that does not read; a redelivered event is applied once. Effects are counted in the table.
#[tokio::test]
async fn a_dispatch_routes_by_event_type_and_dead_letters_what_it_cannot_read() -> anyhow::Result<()> {
    use idem::postgres::PgUnitOfWork;
    use idem::testing::TestProducer;
    use idem::{Dispatch, HandlerError, InboundEvent, TypedEventHandler};

    #[derive(serde::Deserialize)]
    struct Credited {
        amount: i32,
    }
    struct Credit;
    #[async_trait::async_trait]
    impl TypedEventHandler for Credit {
        type Event = Credited;
        async fn handle(&self, tx: &mut PgUnitOfWork, e: Credited, m: &InboundEvent) -> Result<(), HandlerError> {
            sqlx::query("INSERT INTO test_credit (event_id, amount) VALUES ($1, $2)")
                .bind(m.event_id)
                .bind(e.amount)
                .execute(tx.connection())
                .await
                .map_err(idem_postgres::map_sqlx_error)?;
            Ok(())
        }
    }

    let (db, brokers, topic) = setup(1).await?;
    sqlx::raw_sql("CREATE TABLE test_credit (event_id uuid NOT NULL, amount int NOT NULL)").execute(db.pool()).await?;
    let p = TestProducer::new(&brokers)?;
    let send = |body: &'static str, kind: Option<&'static str>| {
        let p = p.clone();
        let topic = topic.clone();
        async move {
            let id = Uuid::now_v7();
            let id_text = id.to_string();
            let mut headers: Vec<(&str, &[u8])> = vec![("event_id", id_text.as_bytes())];
            if let Some(kind) = kind {
                headers.push(("event_type", kind.as_bytes()));
            }
            p.raw(&topic, Some("k"), body.as_bytes(), &headers).await?;
            anyhow::Ok(id)
        }
    };
    let first = send(r#"{"amount": 5}"#, Some("Credited")).await?;
    p.raw(
        &topic,
        Some("k"),
        br#"{"amount": 5}"#,
        &[("event_id", first.to_string().as_bytes()), ("event_type", b"Credited")],
    )
    .await?; // delivered again
    send(r#"{"type": "Credited", "amount": 7}"#, None).await?; // the type in the body
    // issue 46.5: a header naming a type with no handler falls back to the body's type (it was skipped)
    send(r#"{"type": "Credited", "amount": 11}"#, Some("Envelope")).await?;
    let unknown = send(r#"{"amount": 100}"#, Some("Debited")).await?;
    let unreadable = send(r#"{"amount": "lots"}"#, Some("Credited")).await?;

    // issue 46.5: the default dead-letters an unknown type (it skipped it: recorded processed, never seen)
    let handler = Dispatch::new().on_typed("Credited", Credit);
    let runner = idem::pg_runner(
        settings(&brokers, &unique_topic("g"), &topic, 10),
        db.store.clone(),
        Arc::new(SystemClock),
        handler,
    );
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone()));
    let dlq = read_topic(&brokers, &format!("{topic}.dlq"), 2, Duration::from_secs(30)).await?;
    let credited = eventually(Duration::from_secs(10), || async { Ok(db.count("test_credit").await? == 3) }).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    task.await??;
    assert!(credited, "{} credits", db.count("test_credit").await?);
    let total: i64 = sqlx::query_scalar("SELECT sum(amount) FROM test_credit").fetch_one(db.pool()).await?;
    assert_eq!((db.count("test_credit").await?, total), (3, 23), "5 once, though delivered twice, 7 and 11");
    let mut dead: Vec<(Option<String>, Option<String>)> =
        dlq.iter().map(|m| (m.header("event_id"), m.header("dlq.reason"))).collect();
    dead.sort();
    let mut expected = vec![
        (Some(unknown.to_string()), Some("malformed".into())),
        (Some(unreadable.to_string()), Some("malformed".into())),
    ];
    expected.sort();
    assert_eq!(dead, expected);
    Ok(())
}

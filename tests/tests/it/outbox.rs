//! The outbox relay against the tansu broker and real PostgreSQL.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use idem_domain::saga::{StepStart, begin_step, finish_step};
use idem_domain::usecases::OrderEventHandler;
use idem_domain::{SagaStep, TtlPolicy};
use idem_kafka::consumer::{Runner, RunnerSettings};
use idem_kafka::partitioner::partition_for_key;
use idem_kafka::relay::{Relay, RelaySettings, RelayStats};
use idem_ports::{NewOutboxMessage, SystemClock, TransactionManager, UuidV7Generator};
use idem_postgres::{PgOutboxWakeup, PgStore};
use idem_tests::TestDb;
use idem_tests::kafka::{ProxiedBroker, create_topic, eventually, read_topic, unique_topic};
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

struct RunningRelay {
    stop: CancellationToken,
    task: JoinHandle<()>,
    stats: Arc<RelayStats>,
}

impl RunningRelay {
    async fn stop(self) {
        self.stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(20), self.task).await;
    }
}

async fn start_relay(
    tm: Arc<dyn TransactionManager>,
    store: &PgStore,
    brokers: &str,
    batch: i64,
) -> anyhow::Result<RunningRelay> {
    let mut settings = RelaySettings::new(brokers);
    settings.batch_size = batch;
    settings.poll_interval = Duration::from_millis(200);
    settings.producer.delivery_timeout = Duration::from_secs(5);
    start_relay_with(settings, tm, store).await
}

/// [`start_relay`] with the test's own settings.
async fn start_relay_with(
    settings: RelaySettings,
    tm: Arc<dyn TransactionManager>,
    store: &PgStore,
) -> anyhow::Result<RunningRelay> {
    let relay = Relay::new(settings, tm, Arc::new(SystemClock));
    let stats = relay.stats();
    let wakeup = PgOutboxWakeup::connect(store).await?;
    let stop = CancellationToken::new();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        if let Err(e) = relay.run(Box::new(wakeup), token).await {
            panic!("relay failed: {e}");
        }
    });
    Ok(RunningRelay { stop, task, stats })
}

fn message(topic: &str, key: &str, payload: serde_json::Value) -> NewOutboxMessage {
    NewOutboxMessage {
        id: Uuid::now_v7(),
        topic: topic.to_owned(),
        aggregate_type: "order".into(),
        aggregate_id: key.to_owned(),
        event_type: payload["type"].as_str().unwrap_or("Test").to_owned(),
        payload,
        saga_id: None,
        traceparent: None,
        created_at: Utc::now(),
    }
}

/// Writes each message in its own committed transaction, in order; returns their ids.
async fn write(db: &TestDb, messages: Vec<NewOutboxMessage>) -> anyhow::Result<Vec<Uuid>> {
    let mut ids = Vec::new();
    for m in messages {
        let mut uow = db.store.begin().await?;
        uow.outbox().enqueue(&m).await?;
        uow.commit().await?;
        ids.push(m.id);
    }
    Ok(ids)
}

fn event_ids(read: &[idem_tests::kafka::Read]) -> Vec<String> {
    read.iter().filter_map(|m| m.header("event_id")).collect()
}

#[tokio::test]
async fn committed_rows_arrive_with_event_ids_and_rolled_back_rows_never() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("payments");
    create_topic(&brokers, &topic, 3).await?;
    let saga = Uuid::now_v7();
    let mut msgs: Vec<_> =
        (0..50).map(|i| message(&topic, &format!("order-{i}"), json!({"type": "PaymentCaptured", "n": i}))).collect();
    msgs[0].saga_id = Some(saga);
    msgs[0].traceparent = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
    let ids = write(&db, msgs).await?;
    let mut uow = db.store.begin().await?;
    uow.outbox().enqueue(&message(&topic, "ghost", json!({"type": "Ghost"}))).await?;
    uow.rollback().await?;

    let relay = start_relay(Arc::new(db.store.clone()), &db.store, &brokers, 20).await?;
    let read = read_topic(&brokers, &topic, 51, Duration::from_secs(15)).await?;
    relay.stop().await;
    assert_eq!(read.len(), 50, "exactly the committed rows");
    let got: BTreeSet<String> = event_ids(&read).into_iter().collect();
    let want: BTreeSet<String> = ids.iter().map(Uuid::to_string).collect();
    assert_eq!(got, want);
    let first = read.iter().find(|m| m.header("event_id") == Some(ids[0].to_string())).expect("first message");
    assert_eq!(first.header("saga_id"), Some(saga.to_string()));
    assert_eq!(first.header("event_type").as_deref(), Some("PaymentCaptured"));
    assert_eq!(first.header("content-type").as_deref(), Some("application/json"));
    assert_eq!(first.header("traceparent").as_deref(), Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"));
    let unpublished = db.unpublished().await?;
    assert_eq!(unpublished, 0);
    Ok(())
}

#[tokio::test]
async fn two_relays_publish_every_row_once() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("payments");
    create_topic(&brokers, &topic, 4).await?;
    // rows written while both relays run
    let a = start_relay(Arc::new(db.store.clone()), &db.store, &brokers, 50).await?;
    let b = start_relay(Arc::new(db.store.clone()), &db.store, &brokers, 50).await?;
    let mut all = Vec::new();
    for chunk in 0..10 {
        let mut uow = db.store.begin().await?;
        for i in 0..100 {
            let m = message(
                &topic,
                &format!("order-{}", (chunk * 100 + i) % 37),
                json!({"type": "T", "n": chunk * 100 + i}),
            );
            all.push(m.id.to_string());
            uow.outbox().enqueue(&m).await?;
        }
        uow.commit().await?;
    }
    let read = read_topic(&brokers, &topic, 1000, Duration::from_secs(30)).await?;
    // anything published twice would show up as more than 1000 messages
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (a_stats, b_stats) = (a.stats.clone(), b.stats.clone());
    a.stop().await;
    b.stop().await;
    let ids = event_ids(&read);
    let distinct: BTreeSet<_> = ids.iter().cloned().collect();
    assert_eq!(ids.len(), 1000);
    assert_eq!(distinct.len(), 1000, "no row published twice");
    assert_eq!(distinct, all.into_iter().collect::<BTreeSet<_>>());
    assert_eq!(a_stats.published.get() + b_stats.published.get(), 1000);
    Ok(())
}

#[tokio::test]
async fn one_key_arrives_in_commit_order_on_its_murmur2_partition() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("payments");
    let partitions = 6;
    create_topic(&brokers, &topic, partitions).await?;
    let keys = ["order-a", "order-b", "order-c"];
    let mut msgs = Vec::new();
    for n in 0..60 {
        msgs.push(message(&topic, keys[n % 3], json!({"type": "T", "n": n})));
    }
    write(&db, msgs).await?; // one transaction each: commit order = n
    let relay = start_relay(Arc::new(db.store.clone()), &db.store, &brokers, 7).await?;
    let read = read_topic(&brokers, &topic, 60, Duration::from_secs(20)).await?;
    relay.stop().await;
    assert_eq!(read.len(), 60);
    let mut by_key: BTreeMap<String, Vec<(i32, i64, u64)>> = BTreeMap::new();
    for m in &read {
        let key = String::from_utf8(m.key.clone().unwrap_or_default())?;
        let n = serde_json::from_slice::<serde_json::Value>(&m.payload)?["n"].as_u64().unwrap_or(u64::MAX);
        by_key.entry(key).or_default().push((m.partition, m.offset, n));
    }
    for key in keys {
        let mut seen = by_key.remove(key).unwrap_or_default();
        assert_eq!(seen.len(), 20);
        let partition = partition_for_key(key.as_bytes(), partitions);
        assert!(
            seen.iter().all(|(p, _, _)| *p == partition),
            "{key} must land on murmur2 partition {partition}: {seen:?}"
        );
        seen.sort_by_key(|(_, offset, _)| *offset);
        let order: Vec<u64> = seen.iter().map(|(_, _, n)| *n).collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(order, sorted, "{key} in commit order");
    }
    Ok(())
}

/// Units whose commit never happens: the relay "dies" after publishing and before marking.
fn die_before_commit(store: &PgStore) -> Arc<dyn TransactionManager> {
    // the transaction stays open (its rows claimed) until the task is aborted, as in a hung process
    let never: fn() -> idem_tests::faulty::Commit = || {
        Box::new(|uow| {
            Box::pin(async move {
                let _open = uow;
                std::future::pending().await
            })
        })
    };
    Arc::new(idem_tests::faulty::FaultyCommits::new(Arc::new(store.clone()), never))
}

#[tokio::test]
async fn relay_killed_after_publish_republishes_the_same_event_ids_and_consumers_dedup() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("orders");
    create_topic(&brokers, &topic, 2).await?;
    create_topic(&brokers, &format!("{topic}.dlq"), 1).await?;
    let mut msgs = Vec::new();
    for i in 0..30 {
        let order = Uuid::now_v7();
        msgs.push(message(
            &topic,
            &order.to_string(),
            json!({
                "type": "OrderPlaced", "order_id": order, "customer_id": Uuid::now_v7(), "amount": "5.00",
                "currency": "EUR", "provider": "stripe", "external_payment_id": format!("pi_relay_{i}"), "version": 1,
            }),
        ));
    }
    let ids = write(&db, msgs).await?;

    let dying = start_relay(die_before_commit(&db.store), &db.store, &brokers, 100).await?;
    let first = read_topic(&brokers, &topic, 30, Duration::from_secs(15)).await?;
    assert_eq!(first.len(), 30, "published before the crash");
    dying.task.abort(); // the crash: its claim transaction rolls back, rows stay unpublished
    let _ = dying.task.await;
    let unpublished = db.unpublished().await?;
    assert_eq!(unpublished, 30);

    let relay = start_relay(Arc::new(db.store.clone()), &db.store, &brokers, 100).await?;
    let both = read_topic(&brokers, &topic, 60, Duration::from_secs(15)).await?;
    relay.stop().await;
    assert_eq!(both.len(), 60, "every row published twice");
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for id in event_ids(&both) {
        *counts.entry(id).or_default() += 1;
    }
    assert_eq!(counts.len(), 30);
    assert!(counts.values().all(|c| *c == 2), "the re-publish carries the same event_id");
    assert_eq!(counts.keys().cloned().collect::<BTreeSet<_>>(), ids.iter().map(Uuid::to_string).collect());

    // the consumer dedups the re-published events: one payment per order
    let mut settings =
        RunnerSettings::new(&brokers, &unique_topic("g"), &topic, TtlPolicy::new(Duration::from_secs(72 * 3600))?);
    settings.consumer.session_timeout = Duration::from_millis(6000);
    let handler = Arc::new(OrderEventHandler {
        charges_through_provider: false,
        clock: Arc::new(SystemClock),
        ids: Arc::new(UuidV7Generator),
        payments_topic: "payments".into(),
        merchant_id: "orders".into(),
        payments_of: idem_postgres::payments_of,
    });
    let runner = Runner::new(settings, Arc::new(db.store.clone()), Arc::new(SystemClock), handler);
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone()));
    assert!(eventually(Duration::from_secs(60), || async { Ok(stats.received.get() >= 60) }).await?);
    stop.cancel();
    let _ = task.await;
    assert_eq!(db.count("payment").await?, 30, "zero duplicate effects end to end");
    assert_eq!(stats.duplicates.get(), 30);
    Ok(())
}

#[tokio::test]
async fn broker_outage_loses_nothing() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let broker = ProxiedBroker::start().await?;
    let topic = unique_topic("payments");
    create_topic(&broker.bootstrap, &topic, 2).await?;
    let relay = start_relay(Arc::new(db.store.clone()), &db.store, &broker.bootstrap, 20).await?;
    let before =
        write(&db, (0..10).map(|i| message(&topic, &format!("k{i}"), json!({"type": "T", "n": i}))).collect()).await?;
    let stats = relay.stats.clone();
    assert!(eventually(Duration::from_secs(20), || async { Ok(stats.published.get() >= 10) }).await?);

    broker.proxy.cut();
    let during =
        write(&db, (10..40).map(|i| message(&topic, &format!("k{i}"), json!({"type": "T", "n": i}))).collect()).await?;
    tokio::time::sleep(Duration::from_secs(7)).await; // longer than the delivery timeout: publishes fail
    let unpublished = db.unpublished().await?;
    assert_eq!(unpublished, 30, "rows written during the outage stay unpublished");
    broker.proxy.restore();

    assert!(db.all_published_within(Duration::from_secs(60)).await?, "every row published after the broker came back");
    relay.stop().await;
    let read = read_topic(&broker.bootstrap, &topic, 1000, Duration::from_secs(10)).await?;
    let got: BTreeSet<String> = event_ids(&read).into_iter().collect();
    let want: BTreeSet<String> = before.iter().chain(during.iter()).map(Uuid::to_string).collect();
    assert_eq!(got, want, "every row arrived");
    Ok(())
}

#[tokio::test]
async fn a_saga_step_run_twice_has_one_effect() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let step = SagaStep::new(Uuid::now_v7(), "reserve-stock")?;
    let mut runs = 0;
    for attempt in 0..2 {
        let mut uow = db.store.begin().await?;
        match begin_step(uow.as_mut(), &step, Utc::now()).await? {
            StepStart::Run => {
                runs += 1;
                uow.outbox().enqueue(&message("stock", "order-1", json!({"type": "StockReserved"}))).await?;
                finish_step(uow.as_mut(), &step, &json!({"attempt": attempt})).await?;
            }
            StepStart::Done(outcome) => {
                assert_eq!(outcome, json!({"attempt": 0}), "the recorded outcome")
            }
        }
        uow.commit().await?;
    }
    assert_eq!(runs, 1);
    assert_eq!(db.count("outbox_message").await?, 1);
    Ok(())
}

/// Issue 12: a business transaction that writes an outbox row must not execute NOTIFY (it serializes every
/// commit of the database behind one lock). The relay is still woken: in process after the commit, and
/// other instances by one debounced NOTIFY sent outside the business transaction, carrying the sender's
/// instance id.
#[tokio::test]
async fn business_commits_do_not_notify_and_relays_are_still_woken() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    // Another instance's relay, listening.
    let mut listener = sqlx::postgres::PgListener::connect_with(db.pool()).await?;
    listener.listen(idem_postgres::OUTBOX_CHANNEL).await?;

    // What a business transaction runs, on its own connection: the NOTIFY can only come from inside it.
    let mut tx = db.pool().begin().await?;
    sqlx::query(
        "INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, headers, created_at)
         VALUES ($1, 't', 'order', 'k', 'Test', '{}', '{}', now())",
    )
    .bind(Uuid::now_v7())
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    let inside = tokio::time::timeout(Duration::from_millis(500), listener.recv()).await;
    assert!(inside.is_err(), "a business transaction executed NOTIFY: {inside:?}");

    // Through the unit of work: the commit wakes a relay of this process at once ...
    let mut wakeup = PgOutboxWakeup::connect(&db.store).await?;
    let waiting = tokio::spawn(async move {
        let started = std::time::Instant::now();
        idem_ports::OutboxWakeup::wait(&mut wakeup, Duration::from_secs(10)).await;
        started.elapsed()
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut uow = db.store.begin().await?;
    uow.outbox().enqueue(&message("t", "k", json!({"type": "Test"}))).await?;
    uow.commit().await?;
    let waited = waiting.await?;
    assert!(waited < Duration::from_secs(5), "the in-process relay was not woken: {waited:?}");
    // ... and other instances get one notification, sent after the commit by the store's notifier.
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await??;
    assert!(!n.payload().is_empty(), "notification without the sender's instance id");
    Ok(())
}

/// Writes `n` unpublished rows over `n` distinct keys in one statement (a backlog after a broker outage).
async fn backlog(db: &TestDb, topic: &str, n: i64) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, headers, created_at)
         SELECT gen_random_uuid(), $1, 'order', 'key-' || i, 'Test', jsonb_build_object('n', i), '{}', now()
         FROM generate_series(1, $2) AS i",
    )
    .bind(topic)
    .bind(n)
    .execute(db.pool())
    .await?;
    Ok(())
}

/// Issue 12 (found by the relay bench): a relay that starts over a backlog (a restart after an outage, a
/// deploy) claims at once. It waited for its first wake-up, and rows committed before it listened wake
/// nobody: the first round came a whole poll interval later (1 s by default; 1.08 s of a 2.4 s drain).
#[tokio::test]
async fn a_relay_started_over_a_backlog_claims_at_once() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("relay-start");
    create_topic(&brokers, &topic, 3).await?;
    backlog(&db, &topic, 100).await?;
    let mut settings = RelaySettings::new(&brokers);
    settings.poll_interval = Duration::from_secs(60); // no poll within the test: only the start can claim
    let relay = start_relay_with(settings, Arc::new(db.store.clone()), &db.store).await?;
    let published = eventually(Duration::from_secs(15), || async { Ok(relay.stats.published.get() >= 100) }).await?;
    let count = relay.stats.published.get();
    relay.stop().await;
    assert!(published, "{count} of 100 rows published within 15 s of the relay's start");
    Ok(())
}

/// Issue 10.3: the locks a claim takes are bounded by design, whatever plan the planner picks. Right after
/// a burst (no statistics) or with index scans off, a claim used to evaluate its per-key advisory lock on
/// every unpublished row and exhaust the lock table (`out of shared memory`).
#[tokio::test]
async fn a_claim_takes_a_bounded_number_of_locks_whatever_the_plan() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    backlog(&db, "t", 50_000).await?;
    for forced in ["SET LOCAL enable_indexscan = off", "SET LOCAL enable_indexscan = on"] {
        let mut uow = db.store.begin_pg().await?;
        sqlx::query(forced).execute(uow.connection()).await?;
        let rows = idem_ports::OutboxRepository::claim_unpublished(&mut uow, 2000).await?;
        assert!(!rows.is_empty() && rows.len() <= 2000, "{forced}: {} rows", rows.len());
        let locks: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()")
                .fetch_one(uow.connection())
                .await?;
        // a claim over a backlog leaves three quarters of the shards to the other workers' rounds
        assert!(locks <= idem_postgres::SHARDS_PER_CLAIM, "{forced}: a backlog claim holds {locks} advisory locks");
    }
    Ok(())
}

/// Issue 10.3 at full size: a 50,000-row backlog over distinct keys drained by concurrent relay rounds
/// with the planner forced off index scans: every row published once, no lock error.
#[tokio::test]
async fn a_large_backlog_drains_with_index_scans_off() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("payments");
    create_topic(&brokers, &topic, 3).await?;
    let name: String = sqlx::query_scalar("SELECT current_database()").fetch_one(db.pool()).await?;
    sqlx::query(&format!("ALTER DATABASE {name} SET enable_indexscan = off")).execute(db.pool()).await?;
    let store = PgStore::connect(&db.url, &idem_postgres::PoolSettings::default()).await?;
    let n = 50_000;
    backlog(&db, &topic, n).await?;
    let relay = start_relay(Arc::new(store.clone()), &store, &brokers, 2000).await?;
    let drained = db.all_published_within(Duration::from_secs(240)).await?;
    let stats = relay.stats.clone();
    relay.stop().await;
    assert!(drained, "{} rows still unpublished", db.unpublished().await?);
    assert_eq!(stats.published.get(), n as u64, "every row published exactly once");
    assert_eq!(stats.failed.get(), 0);
    Ok(())
}

/// Issue 10.7: a row the broker can never accept (here 2 MiB, above `message.max.bytes`) is quarantined
/// after a bounded number of attempts, later rows of its key wait behind it, and every other key flows.
#[tokio::test]
async fn a_poison_row_is_quarantined_and_only_its_key_waits() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("payments");
    create_topic(&brokers, &topic, 3).await?;
    let mut msgs = vec![message(&topic, "poison-key", json!({"type": "Big", "blob": "x".repeat(2 << 20)}))];
    msgs.push(message(&topic, "poison-key", json!({"type": "After"})));
    msgs.extend((0..200).map(|i| message(&topic, &format!("k-{i}"), json!({"type": "Normal", "n": i}))));
    let ids = write(&db, msgs).await?;
    let (poison, after) = (ids[0], ids[1]);
    let relay = start_relay(Arc::new(db.store.clone()), &db.store, &brokers, 50).await?;
    let others_done = eventually(Duration::from_secs(15), || async {
        Ok(db.unpublished().await? == 2) // only the poison row and the row behind it
    })
    .await?;
    let quarantined = eventually(Duration::from_secs(30), || async {
        let q: Option<chrono::DateTime<Utc>> =
            sqlx::query_scalar("SELECT quarantined_at FROM outbox_message WHERE id = $1")
                .bind(poison)
                .fetch_one(db.pool())
                .await?;
        Ok(q.is_some())
    })
    .await?;
    let stats = relay.stats.clone();
    tokio::time::sleep(Duration::from_secs(2)).await;
    relay.stop().await;
    assert!(others_done, "{} rows still unpublished: the poison row slowed other keys", db.unpublished().await?);
    assert!(quarantined, "the poison row was never quarantined");
    let (attempts, error): (i32, Option<String>) =
        sqlx::query_as("SELECT attempts, last_error FROM outbox_message WHERE id = $1")
            .bind(poison)
            .fetch_one(db.pool())
            .await?;
    assert!((1..=5).contains(&attempts), "{attempts} attempts");
    assert!(error.is_some_and(|e| !e.is_empty()));
    let after_waits: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox_message WHERE id = $1)")
        .bind(after)
        .fetch_one(db.pool())
        .await?;
    assert!(after_waits, "a later row of the poison key overtook it");
    assert_eq!(stats.quarantined.get(), 1);
    Ok(())
}

/// Issue 12: under a steady stream of commits each relay claim must serve many commits. Every commit wakes
/// the relay, and every wake-up used to wake every worker, each running a claim (BEGIN, claim, ROLLBACK
/// when empty): before the claim throttle, 3 of 5 runs made 247–466 claims for these 800 rows (the
/// others 10–25, depending on how long rounds took).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_commits_is_claimed_in_few_rounds() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("relay-claims");
    create_topic(&brokers, &topic, 3).await?;
    let store: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let mut settings = RelaySettings::new(&brokers);
    settings.poll_interval = Duration::from_secs(5); // polling plays no part: every claim is a wake-up's
    let relay = Relay::new(settings, store, Arc::new(SystemClock));
    let stats = relay.stats();
    let wakeup = PgOutboxWakeup::connect(&db.store).await?;
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(Box::new(wakeup), stop).await }
    });

    // 8 writers, each committing one row at a time, about 1,000 commits/s together (8 HTTP clients charging)
    let (writers, per_writer) = (8, 100);
    let started = std::time::Instant::now();
    let mut handles = Vec::new();
    for w in 0..writers {
        let db_store = db.store.clone();
        let topic = topic.clone();
        handles.push(tokio::spawn(async move {
            for i in 0..per_writer {
                let mut uow = db_store.begin().await?;
                uow.outbox().enqueue(&message(&topic, &format!("k{w}-{i}"), json!({"type": "Test"}))).await?;
                uow.commit().await?;
                tokio::time::sleep(Duration::from_millis(7)).await;
            }
            anyhow::Ok(())
        }));
    }
    for h in handles {
        h.await??;
    }
    let written = started.elapsed();
    let rows = (writers * per_writer) as u64;
    let all = eventually(Duration::from_secs(20), || async { Ok(stats.published.get() >= rows) }).await?;
    assert!(all, "{} of {rows} rows published", stats.published.get());
    let claims = stats.claims.get();
    stop.cancel();
    task.await??;
    assert!(claims * 4 <= rows, "{claims} claims for {rows} rows committed in {written:?}: at most one per 4 commits");
    Ok(())
}

/// Issue 12: publishing must cost the database as little per row as possible, since on a shared machine
/// every row the relay publishes competes with the charges. Marking a row published (`UPDATE ... SET
/// published_at`) wrote a new version of every row — a heap tuple, new entries in two indexes, later a
/// cleanup DELETE and VACUUM of both versions: in the HTTP benchmark the mark cost 110 buffers and 3.2 WAL
/// records per 11 rows' claim, and the relay took PostgreSQL from 0.89 to 1.36 ms of CPU per charge. A round
/// now deletes the rows it saw acknowledged: one WAL record per row, no new version, nothing left to clean.
#[tokio::test]
async fn a_published_row_is_deleted_by_its_round_without_a_new_row_version() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let topic = unique_topic("relay-cost");
    create_topic(&brokers, &topic, 3).await?;
    let rows = 200;
    write(&db, (0..rows).map(|i| message(&topic, &format!("k-{i}"), json!({"type": "Test", "n": i}))).collect())
        .await?;
    let relay = start_relay(Arc::new(db.store.clone()), &db.store, &brokers, 50).await?;
    let published = eventually(Duration::from_secs(20), || async { Ok(relay.stats.published.get() >= rows) }).await?;
    relay.stop().await;
    assert!(published, "{} of {rows} rows still unpublished", db.unpublished().await?);
    // the database's own counters for this test's database (flushed by each backend within about a second)
    let counted = eventually(Duration::from_secs(10), || async {
        let (upd, del): (i64, i64) =
            sqlx::query_as("SELECT n_tup_upd, n_tup_del FROM pg_stat_user_tables WHERE relname = 'outbox_message'")
                .fetch_one(db.pool())
                .await?;
        Ok(upd + del >= rows as i64)
    })
    .await?;
    let (updated, deleted, left): (i64, i64, i64) = sqlx::query_as(
        "SELECT n_tup_upd, n_tup_del, (SELECT count(*) FROM outbox_message)
         FROM pg_stat_user_tables WHERE relname = 'outbox_message'",
    )
    .fetch_one(db.pool())
    .await?;
    assert!(counted, "the statistics never showed {rows} updated or deleted rows ({updated}, {deleted})");
    assert_eq!(updated, 0, "publishing wrote a new version of {updated} rows");
    assert_eq!(deleted, rows as i64, "each published row is deleted once");
    assert_eq!(left, 0, "published rows left in the table for cleanup");
    Ok(())
}

/// Issue 12: one claim must take every row waiting in steady state, so rounds can be fewer and larger. A
/// claim locked at most 16 of the 64 key shards whatever it found, so when the rows waiting since the last
/// claim spread over more than 16 shards (about 20 rows of distinct keys), the rest waited for a follow-up
/// claim one interval later: longer claim intervals pushed p99 commit-to-publish over 100 ms (BENCHMARKS.md).
/// Only a claim that finds a backlog (a full batch) leaves shards to the other workers.
#[tokio::test]
async fn one_claim_takes_every_waiting_row_when_there_is_no_backlog() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    backlog(&db, "t", 60).await?; // 60 distinct keys: about 39 of the 64 shards
    let shards: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT key_shard) FROM outbox_message").fetch_one(db.pool()).await?;
    assert!(shards > 16, "the rows must span more shards than a backlog claim takes ({shards})");
    let mut uow = db.store.begin_pg().await?;
    let rows = idem_ports::OutboxRepository::claim_unpublished(&mut uow, 2000).await?;
    assert_eq!(rows.len(), 60, "one claim took {} of 60 waiting rows over {shards} shards", rows.len());
    Ok(())
}

/// Issue 12: a claim over a backlog takes a quarter of the shards; it must take the shard of the oldest
/// row, or that row can wait behind younger ones round after round. The shards were picked in hash order
/// (`DISTINCT`), not by age.
#[tokio::test]
async fn a_backlog_claim_always_takes_the_oldest_row() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    for first in 0..8 {
        sqlx::query("DELETE FROM outbox_message").execute(db.pool()).await?;
        let oldest = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, headers, created_at)
             VALUES ($1, 't', 'order', $2, 'Test', '{}', '{}', now())",
        )
        .bind(oldest)
        .bind(format!("oldest-{first}"))
        .execute(db.pool())
        .await?;
        backlog(&db, "t", 3000).await?;
        let mut uow = db.store.begin_pg().await?;
        let rows = idem_ports::OutboxRepository::claim_unpublished(&mut uow, 2000).await?;
        assert!(
            rows.iter().any(|r| r.id == oldest),
            "run {first}: the claim of {} rows left the oldest row",
            rows.len()
        );
        assert!(rows.len() >= 500, "run {first}: a backlog claim took only {} rows", rows.len());
        idem_ports::UnitOfWork::rollback(Box::new(uow)).await?;
    }
    Ok(())
}

/// Per-key order around a quarantine: a claim whose statement began before another round quarantined the
/// first row of a key, and took that key's shard lock right after the round committed, read the key's later
/// row as claimable (its snapshot predates the quarantine) while `FOR UPDATE` dropped the changed first
/// row: the later row was published ahead of the quarantined one. Found when claims took every waiting
/// shard (`a_poison_row_is_quarantined_and_only_its_key_waits` then failed every run). A claim now reads
/// its rows in a statement that starts after it holds the shard locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_racing_a_quarantine_never_takes_the_rows_behind_it() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let mut ids = Vec::new();
    for kind in ["Poison", "After"] {
        let id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, headers, created_at)
             VALUES ($1, 't', 'order', 'poison-key', $2, '{}', '{}', now())",
        )
        .bind(id)
        .bind(kind)
        .execute(db.pool())
        .await?;
        ids.push(id);
    }
    backlog(&db, "t", 300_000).await?; // a slow claim statement: the window the quarantine commits in
    sqlx::query("ANALYZE outbox_message").execute(db.pool()).await?;
    let (poison, after) = (ids[0], ids[1]);
    // the round that quarantines the poison row holds its key's shard
    let mut round = db.pool().begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(7368, key_shard) FROM outbox_message WHERE id = $1")
        .bind(poison)
        .execute(&mut *round)
        .await?;
    sqlx::query("UPDATE outbox_message SET quarantined_at = now(), attempts = 3 WHERE id = $1")
        .bind(poison)
        .execute(&mut *round)
        .await?;
    let store = db.store.clone();
    let claim = tokio::spawn(async move {
        let mut uow = store.begin_pg().await?;
        sqlx::query("SET LOCAL enable_indexscan = off").execute(uow.connection()).await?;
        sqlx::query("SET LOCAL enable_bitmapscan = off").execute(uow.connection()).await?;
        let started = std::time::Instant::now();
        let rows = idem_ports::OutboxRepository::claim_unpublished(&mut uow, 2000).await?;
        anyhow::Ok((rows, started.elapsed()))
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    round.commit().await?;
    let (rows, took) = claim.await??;
    assert!(took > Duration::from_millis(60), "the claim took {took:?}: too fast to race the quarantine");
    let claimed: BTreeSet<Uuid> = rows.iter().map(|r| r.id).collect();
    assert!(!claimed.contains(&poison), "a quarantined row was claimed");
    assert!(!claimed.contains(&after), "the row behind a quarantined row of its key was claimed");
    Ok(())
}

/// Issue 12: the relay deletes every row it publishes, and new rows go to the right end of the `seq` index,
/// so the entries of deleted rows stay on the index's left pages until VACUUM, and every claim scans them
/// from the left. Autovacuum visits a database at most once a minute: after 60,000 published rows a claim
/// of 10 rows read 377 index pages (without the vacuum below). The service vacuums the outbox table every `OUTBOX_VACUUM_INTERVAL`.
#[tokio::test]
async fn a_claim_after_a_stream_of_published_rows_reads_few_index_pages() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    backlog(&db, "t", 60_000).await?;
    loop {
        let mut uow = db.store.begin().await?;
        let rows = uow.outbox().claim_unpublished(2000).await?;
        if rows.is_empty() {
            break;
        }
        uow.outbox().delete_published(&rows.iter().map(|r| r.id).collect::<Vec<_>>()).await?;
        uow.commit().await?;
    }
    // what the service's outbox vacuum task does every few seconds; it skips a table another vacuum holds
    // (autovacuum, which after 60,000 deletes may be at it now and may bypass the index cleanup): wait for
    // that one to end first, as the service's next round would
    for _ in 0..100 {
        let busy: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_progress_vacuum WHERE relid = 'outbox_message'::regclass")
                .fetch_one(db.pool())
                .await?;
        if busy == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    db.store.vacuum_outbox().await?;
    backlog(&db, "t", 10).await?;
    // a fresh backend: the block counters below are the backend's pending ones, not per transaction
    let fresh = PgStore::connect(&db.url, &idem_postgres::PoolSettings::default()).await?;
    let mut uow = fresh.begin_pg().await?;
    let rows = idem_ports::OutboxRepository::claim_unpublished(&mut uow, 2000).await?;
    let pages: i64 = sqlx::query_scalar(
        "SELECT sum(pg_stat_get_xact_blocks_fetched(indexrelid))::bigint FROM pg_index
         WHERE indrelid = 'outbox_message'::regclass",
    )
    .fetch_one(uow.connection())
    .await?;
    assert_eq!(rows.len(), 10);
    assert!(pages <= 30, "one claim of 10 rows read {pages} index pages");
    Ok(())
}

/// Issue 24.5: the broker refuses a whole produce request (a batch-level refusal: here librdkafka's mock
/// cluster answers the first Produce request with MSG_SIZE_TOO_LARGE). It holds rows of two keys, none of
/// them too large: no row may be charged a refusal (quarantined after one here) for its neighbours; each
/// is tried on its own first, and all are published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_by_the_broker_is_attributed_per_row_before_any_quarantine() -> anyhow::Result<()> {
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

    let db = TestDb::new().await?;
    let mock = MockCluster::new(1)?;
    let topic = "mock-payments";
    mock.create_topic(topic, 1, 1)?;
    for (key, n) in [("k", 1), ("k", 2), ("j", 1)] {
        let mut uow = db.store.begin().await?;
        uow.outbox().enqueue(&message(topic, key, json!({ "type": "Test", "n": n }))).await?;
        uow.commit().await?;
    }
    mock.request_errors(RDKafkaApiKey::Produce, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE]);
    let mut settings = RelaySettings::new(mock.bootstrap_servers());
    settings.quarantine_after = 1;
    let producer: rdkafka::producer::FutureProducer = settings.producer.client_config().create()?;
    let relay = Relay::new(settings, Arc::new(db.store.clone()), Arc::new(SystemClock));
    let mut published = 0;
    for _ in 0..3 {
        relay.round(&producer).await?;
        published = relay.stats().published.get();
        if published == 3 {
            break;
        }
    }
    let quarantined: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_message WHERE quarantined_at IS NOT NULL")
        .fetch_one(db.pool())
        .await?;
    assert_eq!(quarantined, 0, "rows were quarantined for a refusal of the whole request");
    assert_eq!(published, 3);
    // and on the wire, the key's rows are in commit order (the refused request wrote none of them)
    let read = idem_tests::kafka::read_topic(&mock.bootstrap_servers(), topic, 3, Duration::from_secs(20)).await?;
    let of_k: Vec<i64> = read
        .iter()
        .filter(|m| m.key.as_deref() == Some(b"k".as_slice()))
        .filter_map(|m| serde_json::from_slice::<serde_json::Value>(&m.payload).ok()?["n"].as_i64())
        .collect();
    assert_eq!(of_k, [1, 2], "key k out of order on the wire");
    Ok(())
}

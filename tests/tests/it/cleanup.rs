//! The TTL cleaner against real PostgreSQL.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idem_postgres::cleanup::{Cleaner, CleanupSettings, ExpiringTable, TableLabels};
use idem_tests::TestDb;
use tokio_util::sync::CancellationToken;

/// Inserts `n` rows into each expiring table, expiring at `expires_at`.
async fn seed(db: &TestDb, n: i64, expires_at: DateTime<Utc>, tag: &str) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO idempotency_record (scope, key, command_hash, state, status_code, response_body, created_at, expires_at)
         SELECT 'm', $3 || g, sha256(g::text::bytea), 'completed', 201, '\\x7b7d', now(), $1 FROM generate_series(1, $2) g",
    )
    .bind(expires_at)
    .bind(n)
    .bind(tag)
    .execute(db.pool())
    .await?;
    sqlx::query(
        "INSERT INTO processed_event (consumer_name, event_id, topic, created_at, expires_at)
         SELECT 'g', gen_random_uuid(), 'orders', now(), $1 FROM generate_series(1, $2)",
    )
    .bind(expires_at)
    .bind(n)
    .execute(db.pool())
    .await?;
    Ok(())
}

#[tokio::test]
async fn expired_rows_go_live_rows_stay_in_bounded_batches() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let now = Utc::now();
    seed(&db, 250, now - chrono::Duration::hours(1), "old").await?;
    seed(&db, 40, now + chrono::Duration::hours(1), "live").await?;
    // the outbox holds only rows still to publish: the cleaner never touches it
    sqlx::query("INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, created_at) VALUES (gen_random_uuid(), 'p', 'payment', 'k', 'T', '{}', now())")
        .execute(db.pool())
        .await?;

    let settings =
        CleanupSettings { batch_size: 100, max_batches: 2, pause: Duration::ZERO, ..CleanupSettings::default() };
    let cleaner = Cleaner::new(db.store.clone(), settings);
    let first = cleaner.run_once(now).await?.expect("lock free");
    for (table, n) in &first.deleted {
        assert_eq!(*n, 200, "{}: at most max_batches × batch_size per round", table.name());
    }
    let second = cleaner.run_once(now).await?.expect("lock free");
    assert!(second.deleted.iter().all(|(_, n)| *n == 50), "{second:?}");
    assert_eq!(db.count("idempotency_record").await?, 40);
    assert_eq!(db.count("processed_event").await?, 40);
    assert_eq!(db.count("outbox_message").await?, 1);
    let deleted =
        cleaner.stats().deleted.get_or_create(&TableLabels { table: ExpiringTable::ProcessedEvent.name() }).get();
    assert_eq!(deleted, 250, "the metric counts what was removed");
    Ok(())
}

#[tokio::test]
async fn only_one_instance_cleans_at_a_time() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    seed(&db, 10, Utc::now() - chrono::Duration::hours(1), "x").await?;
    let mut holder = db.pool().acquire().await?;
    sqlx::query("SELECT pg_advisory_lock(7594306392147387758)").execute(&mut *holder).await?;
    let cleaner = Cleaner::new(db.store.clone(), CleanupSettings::default());
    assert!(cleaner.run_once(Utc::now()).await?.is_none(), "the other instance holds the lock");
    assert_eq!(db.count("processed_event").await?, 10);
    sqlx::query("SELECT pg_advisory_unlock(7594306392147387758)").execute(&mut *holder).await?;
    assert!(cleaner.run_once(Utc::now()).await?.is_some());
    assert_eq!(db.count("processed_event").await?, 0);
    Ok(())
}

#[tokio::test]
async fn a_failed_round_does_not_stop_the_next() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    seed(&db, 10, Utc::now() - chrono::Duration::hours(1), "x").await?;
    sqlx::query("ALTER TABLE processed_event RENAME TO processed_event_away").execute(db.pool()).await?;
    let cleaner = std::sync::Arc::new(Cleaner::new(db.store.clone(), CleanupSettings::default()));
    let stop = CancellationToken::new();
    let task = {
        let (cleaner, stop) = (cleaner.clone(), stop.clone());
        tokio::spawn(async move { cleaner.run(&idem_ports::SystemClock, Duration::from_millis(100), stop).await })
    };
    let stats = cleaner.stats();
    let failed =
        idem_tests::kafka::eventually(Duration::from_secs(10), || async { Ok(stats.failed_rounds.get() >= 1) }).await?;
    assert!(failed, "the round fails while the table is away");
    sqlx::query("ALTER TABLE processed_event_away RENAME TO processed_event").execute(db.pool()).await?;
    let store = db.store.clone();
    let recovered = idem_tests::kafka::eventually(Duration::from_secs(10), || {
        let store = store.clone();
        async move {
            Ok(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM processed_event").fetch_one(store.pool()).await? == 0)
        }
    })
    .await?;
    stop.cancel();
    task.await?;
    assert!(recovered, "a later round cleaned up");
    assert!(stats.rounds.get() >= 1);
    Ok(())
}

#[tokio::test]
async fn partition_drop_removes_only_expired_ranges() -> anyhow::Result<()> {
    use idem_ports::{ProcessedEvent, TransactionManager};
    use idem_postgres::DedupStorage;
    use idem_postgres::cleanup::{PartitionPolicy, partitions};

    let db = TestDb::new().await?;
    let store = db.store.clone().with_dedup_storage(DedupStorage::Partitioned);
    let now = Utc::now();
    let ttl = Duration::from_secs(72 * 3600);
    partitions::ensure(&store, now.date_naive(), 6, 2).await?;
    let days = [6i64, 5, 4, 3, 1, 0];
    let mut ids = Vec::new();
    for d in days {
        let id = idem_tests::v7_at(now - chrono::Duration::days(d));
        ids.push((d, id));
        let mut uow = store.begin().await?;
        let fresh = uow
            .processed_events()
            .record_new(
                "g",
                &[ProcessedEvent {
                    event_id: id,
                    topic: "orders".into(),
                    expires_at: now + chrono::Duration::hours(72),
                }],
                now,
            )
            .await?;
        assert_eq!(fresh, vec![id]);
        uow.commit().await?;
    }
    // a redelivery of an event lands in the same partition and still conflicts
    let mut uow = store.begin().await?;
    let again = uow
        .processed_events()
        .record_new(
            "g",
            &[ProcessedEvent {
                event_id: ids[4].1,
                topic: "orders".into(),
                expires_at: now + chrono::Duration::hours(72),
            }],
            now,
        )
        .await?;
    assert!(again.is_empty(), "duplicate detected in the partitioned table");
    drop(uow);

    let settings =
        CleanupSettings { partitions: Some(PartitionPolicy { ttl, days_ahead: 2 }), ..CleanupSettings::default() };
    let report = Cleaner::new(store.clone(), settings).run_once(now).await?.expect("lock free");
    // expired: whole day ended more than 72 h ago → days 6, 5, 4 (day 3 ends 2 days + ... ago: within ttl)
    assert_eq!(report.partitions_dropped.len(), 3, "{:?}", report.partitions_dropped);
    let left: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT event_id FROM processed_event_partitioned ORDER BY event_id")
            .fetch_all(db.pool())
            .await?;
    let want: Vec<uuid::Uuid> = ids.iter().filter(|(d, _)| *d <= 3).map(|(_, id)| *id).collect();
    assert_eq!(left, want, "only expired ranges were dropped");
    let remaining = partitions::list(&store).await?;
    assert!(remaining.iter().all(|(_, day)| *day >= (now - chrono::Duration::days(3)).date_naive()), "{remaining:?}");
    Ok(())
}

/// Issue 10.5: partition maintenance is stable: a second round creates nothing and drops nothing (it used
/// to create the oldest day and drop it again every round), and leaves no session setting behind.
#[tokio::test]
async fn partition_maintenance_does_not_churn() -> anyhow::Result<()> {
    use idem_postgres::DedupStorage;
    use idem_postgres::cleanup::{PartitionPolicy, partitions};

    // Three connections: the cleaner's lock, its deletes, and partition DDL; all are checked below.
    let settings = idem_postgres::PoolSettings { max_connections: 3, ..idem_postgres::PoolSettings::default() };
    let db = TestDb::with_pool(settings).await?;
    let store = db.store.clone().with_dedup_storage(DedupStorage::Partitioned);
    let now = Utc::now();
    let policy = PartitionPolicy { ttl: Duration::from_secs(72 * 3600), days_ahead: 3 };
    let cleaner =
        Cleaner::new(store.clone(), CleanupSettings { partitions: Some(policy), ..CleanupSettings::default() });
    cleaner.run_once(now).await?.expect("lock free");
    let first = partitions::list(&store).await?;
    let report = cleaner.run_once(now).await?.expect("lock free");
    assert!(report.partitions_dropped.is_empty(), "the second round dropped {:?}", report.partitions_dropped);
    assert_eq!(partitions::list(&store).await?, first, "the second round changed the partitions");
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(store.pool().acquire().await?);
    }
    for conn in &mut conns {
        let lock_timeout: String = sqlx::query_scalar("SHOW lock_timeout").fetch_one(&mut **conn).await?;
        assert_eq!(lock_timeout, "0", "a session setting was left on a pooled connection");
        let idle: String =
            sqlx::query_scalar("SHOW idle_in_transaction_session_timeout").fetch_one(&mut **conn).await?;
        assert_eq!(idle, "1min", "the cleaner's exemption outlived its transaction");
        let advisory: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
            .fetch_one(&mut **conn)
            .await?;
        assert_eq!(advisory, 0, "an advisory lock outlived the round");
    }
    Ok(())
}

/// Issue 24.6: cleanup decides by the database's clock. A round started on a host whose clock is two days
/// ahead is refused, naming the skew, and every live row stays (it used to delete every record expiring
/// within the two days).
#[tokio::test]
async fn a_host_clock_far_ahead_cannot_clean_up_live_rows() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let now = Utc::now();
    for (i, hours) in [1i64, 30].into_iter().enumerate() {
        sqlx::query(
            "INSERT INTO idempotency_record (scope, key, command_hash, state, status_code, response_body, created_at, expires_at)
             VALUES ('m', $1, $4, 'completed', 201, '', $2, $3)",
        )
        .bind(format!("live-{i}"))
        .bind(now)
        .bind(now + chrono::Duration::hours(hours))
        .bind(vec![0u8; 32])
        .execute(db.pool())
        .await?;
    }
    let cleaner = Cleaner::new(db.store.clone(), CleanupSettings::default());
    let refused = cleaner.run_once(now + chrono::Duration::days(2)).await;
    let error = refused.expect_err("a round from a clock two days ahead ran");
    assert!(error.to_string().contains("differs from the database's"), "{error}");
    assert_eq!(db.count("idempotency_record").await?, 2, "live records were deleted");
    // a host within the margin cleans by the database's clock: nothing here has expired yet
    let report = cleaner.run_once(now + chrono::Duration::minutes(30)).await?.expect("lock free");
    assert!(report.deleted.iter().all(|(_, n)| *n == 0), "{:?}", report.deleted);
    assert_eq!(db.count("idempotency_record").await?, 2);
    Ok(())
}

/// Issue 26: the outbox's dead tuples reach `idem_cleanup_dead_tuples` (the gauge was never set for it: the
/// refresh only knew the two expiring tables).
#[tokio::test]
async fn the_outbox_dead_tuple_gauge_is_set() -> anyhow::Result<()> {
    use sqlx::Connection;
    let db = TestDb::new().await?;
    let mut conn = sqlx::PgConnection::connect(&db.url).await?;
    sqlx::raw_sql("ALTER TABLE outbox_message SET (autovacuum_enabled = false)").execute(&mut conn).await?;
    sqlx::raw_sql(
        "INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, created_at)
         SELECT gen_random_uuid(), 't', 'a', i::text, 'E', '{}'::jsonb, now() FROM generate_series(1, 50) i;
         DELETE FROM outbox_message;",
    )
    .execute(&mut conn)
    .await?;
    sqlx::raw_sql("SELECT pg_stat_force_next_flush()").execute(&mut conn).await?;
    sqlx::raw_sql("SELECT 1").execute(&mut conn).await?;
    let stats = idem_postgres::cleanup::CleanupStats::default();
    let outbox = TableLabels { table: "outbox_message" };
    let mut dead = 0;
    for _ in 0..50 {
        idem_postgres::cleanup::refresh_dead_tuples(&db.store, &stats).await?;
        dead = stats.dead_tuples.get_or_create(&outbox).get();
        if dead >= 50 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(dead >= 50, "the outbox's dead tuples were not exported: {dead}");
    Ok(())
}

/// Issue 32.5: a cleaner round ignored shutdown: a large round (here 100 batches with a 100 ms pause) kept
/// the service's drain waiting until its end. It stops between two batches once shutdown is asked.
#[tokio::test]
async fn a_cleanup_round_stops_between_batches_on_shutdown() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let now = Utc::now();
    seed(&db, 5_000, now - chrono::Duration::hours(1), "old").await?;
    let settings = CleanupSettings { batch_size: 50, pause: Duration::from_millis(100), ..CleanupSettings::default() };
    let cleaner = Cleaner::new(db.store.clone(), settings);
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let round =
        tokio::spawn(async move { cleaner.run(&idem_ports::SystemClock, Duration::from_secs(3600), token).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(2), round).await??;
    let left = db.count("idempotency_record").await?;
    assert!(left > 0 && left < 5_000, "{left} rows left: the round neither ran nor stopped");
    Ok(())
}

/// Issue 33: a record held between the phases of a foreign call is never cleaned up, however old: its
/// retention counts from completion (deleting it would free the key while the provider may have charged).
/// Completed and unheld expired records around it go as before.
#[tokio::test]
async fn records_held_between_phases_are_never_cleaned_up() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let now = Utc::now();
    seed(&db, 30, now - chrono::Duration::hours(1), "old").await?;
    sqlx::query(
        "INSERT INTO idempotency_record (scope, key, command_hash, state, created_at, expires_at, attempt, lease_until, recovery_point)
         VALUES ('m', 'held', sha256('held'), 'in_flight', $1, $2, 3, $2, 'charge')",
    )
    .bind(now - chrono::Duration::hours(80))
    .bind(now - chrono::Duration::hours(30))
    .execute(db.pool())
    .await?;
    let cleaner = Cleaner::new(db.store.clone(), CleanupSettings::default());
    cleaner.run_once(now).await?.expect("lock free");
    let left: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_record").fetch_all(db.pool()).await?;
    assert_eq!(left, ["held"], "only the held record stays");
    Ok(())
}

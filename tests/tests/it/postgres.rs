//! The PostgreSQL adapter against a real database.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use idem_domain::usecases::{ChargeCommand, ChargeOutcome, Env, charge_payment};
use idem_domain::{Amount, Currency, Money};
use idem_ports::{
    ClaimOutcome, Clock, IdGenerator, IdempotencyClaim, IdempotencyState, NewPayment, PaymentStatus, ProcessedEvent,
    StoreError, StoredResponse, SystemClock, TransactionManager, UuidV7Generator,
};
use idem_tests::TestDb;
use rust_decimal::Decimal;
use uuid::Uuid;

fn new_payment(provider: &str, external: &str) -> NewPayment {
    NewPayment {
        id: Uuid::now_v7(),
        merchant_id: "merchant_a".into(),
        order_id: Uuid::now_v7(),
        customer_id: Uuid::now_v7(),
        provider: provider.into(),
        external_payment_id: external.into(),
        amount: Decimal::new(12_3400, 4),
        currency: "EUR".into(),
        status: PaymentStatus::Captured,
        created_at: Utc::now(),
    }
}

#[tokio::test]
async fn failure_after_business_insert_leaves_nothing_behind() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    {
        let mut uow = db.store.begin().await?;
        idem_postgres::payments_of(uow.as_mut())?.payments().insert(&new_payment("stripe", "pi_rollback")).await?;
        let claim = IdempotencyClaim {
            scope: "merchant_a".into(),
            key: "k1".into(),
            command_hash: [7; 32],
            created_at: Utc::now(),
            expires_at: Utc::now() + chrono::Duration::hours(48),
        };
        uow.idempotency().claim(&claim, Utc::now(), Duration::from_secs(1)).await?;
        // the handler fails here: the unit is dropped without commit
    }
    assert_eq!(db.count("payment").await?, 0);
    assert_eq!(db.count("idempotency_record").await?, 0);

    // and an explicit rollback does the same
    let mut uow = db.store.begin().await?;
    idem_postgres::payments_of(uow.as_mut())?.payments().insert(&new_payment("stripe", "pi_rollback")).await?;
    uow.rollback().await?;
    assert_eq!(db.count("payment").await?, 0);
    Ok(())
}

#[tokio::test]
async fn unique_violation_maps_to_the_port_error() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let mut uow = db.store.begin().await?;
    idem_postgres::payments_of(uow.as_mut())?.payments().insert(&new_payment("stripe", "pi_dup")).await?;
    uow.commit().await?;

    let mut uow = db.store.begin().await?;
    let err = idem_postgres::payments_of(uow.as_mut())?
        .payments()
        .insert(&new_payment("stripe", "pi_dup"))
        .await
        .expect_err("duplicate");
    match err {
        StoreError::UniqueViolation { constraint } => {
            assert_eq!(constraint, "payment_provider_external_id_key")
        }
        other => panic!("expected UniqueViolation, got {other:?}"),
    }
    drop(uow);
    // another provider with the same external id is a different payment
    let mut uow = db.store.begin().await?;
    idem_postgres::payments_of(uow.as_mut())?.payments().insert(&new_payment("adyen", "pi_dup")).await?;
    uow.commit().await?;
    assert_eq!(db.count("payment").await?, 2);
    Ok(())
}

#[tokio::test]
async fn twenty_concurrent_charges_create_one_payment() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let order = Uuid::now_v7();
    let customer = Uuid::now_v7();
    let money = Money { amount: Amount::parse("99.99")?, currency: Currency::parse("EUR")? };
    let cmd = Arc::new(ChargeCommand::new("merchant_a", order, customer, "stripe", "pi_race", money)?);
    let barrier = Arc::new(tokio::sync::Barrier::new(20));
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (store, cmd, barrier) = (db.store.clone(), cmd.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let (clock, ids) = (SystemClock, UuidV7Generator);
            let env = Env { clock: &clock as &dyn Clock, ids: &ids as &dyn IdGenerator, payments_topic: "payments" };
            let mut uow = store.begin().await?;
            barrier.wait().await;
            let out = charge_payment(idem_postgres::payments_of(uow.as_mut())?, env, &cmd).await?;
            uow.commit().await?;
            anyhow::Ok(out)
        }));
    }
    let mut created = 0;
    let mut ids = std::collections::BTreeSet::new();
    for t in tasks {
        let out = t.await??;
        if matches!(out, ChargeOutcome::Created(_)) {
            created += 1;
        }
        ids.insert(out.payment().id);
    }
    assert_eq!(created, 1, "exactly one caller creates the payment");
    assert_eq!(ids.len(), 1, "all 20 callers get the same payment");
    assert_eq!(db.count("payment").await?, 1);
    assert_eq!(db.count("outbox_message").await?, 1, "one announcement, not twenty");
    Ok(())
}

#[tokio::test]
async fn idempotency_claim_waits_for_the_holder_then_sees_its_record() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let now = Utc::now();
    let claim = IdempotencyClaim {
        scope: "merchant_a".into(),
        key: "key-1".into(),
        command_hash: [1; 32],
        created_at: now,
        expires_at: now + chrono::Duration::hours(48),
    };
    let mut first = db.store.begin().await?;
    assert_eq!(first.idempotency().claim(&claim, now, Duration::from_secs(1)).await?, ClaimOutcome::Claimed);

    // a second claim while the first is uncommitted times out after the bounded wait
    let mut second = db.store.begin().await?;
    let err = second.idempotency().claim(&claim, now, Duration::from_millis(200)).await.expect_err("held");
    assert!(matches!(err, StoreError::LockTimeout), "got {err:?}");
    drop(second);

    // a third waits, the first completes and commits, the third sees the stored response
    let store = db.store.clone();
    let claim2 = claim.clone();
    let waiter = tokio::spawn(async move {
        let mut third = store.begin().await?;
        let out = third.idempotency().claim(&claim2, now, Duration::from_secs(5)).await?;
        anyhow::Ok(out)
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let response = StoredResponse {
        status_code: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: b"{\"ok\":true}".to_vec(),
    };
    first.idempotency().complete("merchant_a", "key-1", &response).await?;
    first.commit().await?;
    match waiter.await?? {
        ClaimOutcome::Existing(rec) => {
            assert_eq!(rec.state, IdempotencyState::Completed);
            assert_eq!(rec.response, Some(response));
        }
        other => panic!("expected the stored record, got {other:?}"),
    }

    // another scope with the same key is independent
    let mut other = db.store.begin().await?;
    let claim_b = IdempotencyClaim { scope: "merchant_b".into(), ..claim.clone() };
    assert_eq!(other.idempotency().claim(&claim_b, now, Duration::from_secs(1)).await?, ClaimOutcome::Claimed);
    drop(other);

    // once expired, the key can be claimed again
    let later = now + chrono::Duration::hours(49);
    let mut again = db.store.begin().await?;
    let renewed = IdempotencyClaim { created_at: later, expires_at: later + chrono::Duration::hours(48), ..claim };
    assert_eq!(again.idempotency().claim(&renewed, later, Duration::from_secs(1)).await?, ClaimOutcome::Claimed);
    Ok(())
}

#[tokio::test]
async fn processed_events_dedup_a_batch_in_one_statement() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let now = Utc::now();
    let exp = now + chrono::Duration::hours(72);
    let a = Uuid::now_v7();
    let b = Uuid::now_v7();
    let ev = |id| ProcessedEvent { event_id: id, topic: "orders".into(), expires_at: exp };
    let mut uow = db.store.begin().await?;
    let mut fresh = uow.processed_events().record_new("payment-service", &[ev(a), ev(b), ev(a)], now).await?;
    fresh.sort();
    let mut want = vec![a, b];
    want.sort();
    assert_eq!(fresh, want);
    uow.commit().await?;

    let mut uow = db.store.begin().await?;
    let c = Uuid::now_v7();
    assert_eq!(uow.processed_events().record_new("payment-service", &[ev(a), ev(c)], now).await?, vec![c]);
    // another consumer group never dedups against this one
    assert_eq!(uow.processed_events().record_new("analytics", &[ev(a)], now).await?, vec![a]);
    uow.commit().await?;
    assert_eq!(db.count("processed_event").await?, 4);
    Ok(())
}

#[tokio::test]
async fn saga_steps_and_projection_versions() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let saga = Uuid::now_v7();
    let now = Utc::now();
    let mut uow = db.store.begin().await?;
    assert_eq!(uow.saga_steps().claim(saga, "refund", now).await?, idem_ports::SagaStepClaim::Claimed);
    uow.saga_steps().complete(saga, "refund", &serde_json::json!({"refund_id": "r1"})).await?;
    uow.commit().await?;
    let mut uow = db.store.begin().await?;
    assert_eq!(
        uow.saga_steps().claim(saga, "refund", now).await?,
        idem_ports::SagaStepClaim::Done(serde_json::json!({"refund_id": "r1"}))
    );

    let order = Uuid::now_v7();
    assert!(
        idem_postgres::payments_of(uow.as_mut())?.projections().apply_order_version(order, 2, "placed", now).await?
    );
    assert!(
        !idem_postgres::payments_of(uow.as_mut())?.projections().apply_order_version(order, 1, "older", now).await?
    );
    assert!(
        !idem_postgres::payments_of(uow.as_mut())?.projections().apply_order_version(order, 2, "repeat", now).await?
    );
    assert!(
        idem_postgres::payments_of(uow.as_mut())?.projections().apply_order_version(order, 3, "cancelled", now).await?
    );
    uow.commit().await?;
    let (version, status): (i64, String) =
        sqlx::query_as("SELECT version, status FROM order_projection WHERE order_id = $1")
            .bind(order)
            .fetch_one(db.pool())
            .await?;
    assert_eq!((version, status.as_str()), (3, "cancelled"));
    Ok(())
}

/// Issue 10.6: a statement timeout says nothing about the event or request being processed: it maps to a
/// transient store error (retried with backoff), never to a rejection that would dead-letter a valid event.
#[tokio::test]
async fn a_statement_timeout_is_a_transient_store_error() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let mut uow = db.store.begin_pg().await?;
    sqlx::query("SET LOCAL statement_timeout = '10ms'").execute(uow.connection()).await?;
    let err = sqlx::query("SELECT pg_sleep(1)").execute(uow.connection()).await.expect_err("must time out");
    let mapped = idem_postgres::map_sqlx_error(err);
    assert!(mapped.is_transient(), "statement timeout classed as {mapped:?}");
    Ok(())
}

/// Issue 12: sqlx's pool pings a connection when it is acquired and again when it goes back, so a
/// transaction cost two round trips more than its statements: a charge sent 8 requests to PostgreSQL
/// where pgbench sends 6 for the same transaction (on the old pool this test counted 25 flights for the
/// five units of work). Units of work now cost exactly BEGIN, their statements and COMMIT; a connection
/// idle for longer than `ping_after_idle` is pinged first; one dropped mid-transaction is rolled back
/// before anyone can take it again.
#[tokio::test]
async fn a_unit_of_work_costs_its_statements_and_nothing_more() -> anyhow::Result<()> {
    use idem_ports::UnitOfWork;
    let db = TestDb::new().await?;
    let (proxy, proxied) = db.proxied().await?;
    let settings = idem_postgres::PoolSettings { max_connections: 1, ..Default::default() };
    let store = idem_postgres::PgStore::connect(&proxied, &settings).await?;
    let unit = |store: idem_postgres::PgStore| async move {
        let mut uow = store.begin_pg().await?;
        uow.processed_events().is_processed("g", Uuid::nil()).await?;
        Box::new(uow).commit().await?;
        anyhow::Ok(())
    };
    // the application's own SQL: the commit checks the transaction is alive first (issue 24.7)
    let own_sql = |store: idem_postgres::PgStore| async move {
        let mut uow = store.begin_pg().await?;
        sqlx::query("SELECT 1").execute(uow.connection()).await?;
        Box::new(uow).commit().await?;
        anyhow::Ok(())
    };
    unit(store.clone()).await?; // opens the connection
    tokio::time::sleep(Duration::from_millis(100)).await;

    let before = proxy.flights();
    for _ in 0..5 {
        unit(store.clone()).await?;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(proxy.flights() - before, 15, "five units of work of one statement: BEGIN, SELECT, COMMIT each");
    own_sql(store.clone()).await?; // prepares its statement on the connection
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = proxy.flights();
    own_sql(store.clone()).await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(proxy.flights() - before, 4, "the application's SQL: BEGIN, SELECT, the check, COMMIT");

    tokio::time::sleep(settings.ping_after_idle + Duration::from_millis(200)).await;
    let before = proxy.flights();
    unit(store.clone()).await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(proxy.flights() - before, 4, "a connection idle for longer than ping_after_idle is pinged first");

    // dropped mid-transaction holding a row lock: the next unit (same single connection) must not see it
    let claim = IdempotencyClaim {
        scope: "merchant_a".into(),
        key: "dropped".into(),
        command_hash: [1; 32],
        created_at: Utc::now(),
        expires_at: Utc::now() + chrono::Duration::hours(24),
    };
    let wait = Duration::from_secs(1);
    let mut uow = store.begin_pg().await?;
    uow.idempotency().claim(&claim, Utc::now(), wait).await?;
    drop(uow);
    let mut next = store.begin_pg().await?;
    let outcome = next.idempotency().claim(&claim, Utc::now(), wait).await?;
    assert!(matches!(outcome, ClaimOutcome::Claimed), "the dropped transaction was not rolled back: {outcome:?}");
    Box::new(next).rollback().await?;
    Ok(())
}

/// The units of work's pool recycles connections like sqlx's did (`max_lifetime`): reused while young, a
/// new server process once older.
#[tokio::test]
async fn unit_of_work_connections_are_reused_until_their_lifetime_ends() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let settings = idem_postgres::PoolSettings {
        max_connections: 1,
        max_lifetime: Duration::from_millis(800),
        ..Default::default()
    };
    let store = idem_postgres::PgStore::connect(&db.url, &settings).await?;
    let backend = |store: idem_postgres::PgStore| async move {
        let mut uow = store.begin_pg().await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(uow.connection()).await?;
        idem_ports::UnitOfWork::commit(Box::new(uow)).await?;
        anyhow::Ok(pid)
    };
    let first = backend(store.clone()).await?;
    assert_eq!(backend(store.clone()).await?, first, "a young connection is reused");
    tokio::time::sleep(settings.max_lifetime + Duration::from_millis(200)).await;
    assert_ne!(backend(store.clone()).await?, first, "a connection past max_lifetime is replaced");
    Ok(())
}

/// Issue 24.7: PostgreSQL answers `COMMIT` of an aborted transaction with the tag `ROLLBACK` and no error.
/// A handler that swallows a failed statement (its own SQL, or one of idem's repositories) and carries on
/// must not have its unit reported as committed: the commit fails and nothing is written.
#[tokio::test]
async fn a_commit_after_a_swallowed_error_fails_instead_of_reporting_success() -> anyhow::Result<()> {
    use idem_ports::NewOutboxMessage;
    use idem_postgres::PgUnitOfWork;

    let db = TestDb::new().await?;
    sqlx::raw_sql("CREATE TABLE app_effect (n int)").execute(db.pool()).await?;
    let message = |id: Uuid| NewOutboxMessage {
        id,
        topic: "t".into(),
        aggregate_type: "a".into(),
        aggregate_id: "k".into(),
        event_type: "E".into(),
        payload: serde_json::json!({}),
        saga_id: None,
        traceparent: None,
        created_at: Utc::now(),
    };
    let taken = Uuid::now_v7();
    let mut uow = db.store.begin().await?;
    uow.outbox().enqueue(&message(taken)).await?;
    uow.commit().await?;

    // the application's own SQL fails, the error is dropped, the handler writes on and commits
    let mut uow = db.store.begin().await?;
    let pg = PgUnitOfWork::of(uow.as_mut())?;
    sqlx::query("INSERT INTO app_effect VALUES (1)").execute(pg.connection()).await?;
    let swallowed = sqlx::query("SELECT 1 / 0").execute(pg.connection()).await;
    assert!(swallowed.is_err());
    let _ = sqlx::query("INSERT INTO app_effect VALUES (2)").execute(pg.connection()).await;
    let committed = uow.commit().await;
    assert!(committed.is_err(), "a COMMIT answered ROLLBACK was reported as success");
    assert_eq!(db.count("app_effect").await?, 0);

    // one of idem's repositories fails (a duplicate outbox id), the handler ignores it and commits
    let mut uow = db.store.begin().await?;
    let fresh = Uuid::now_v7();
    let _ = uow.outbox().enqueue(&message(taken)).await;
    let _ = uow.outbox().enqueue(&message(fresh)).await;
    assert!(uow.commit().await.is_err(), "a COMMIT answered ROLLBACK was reported as success");
    assert_eq!(db.unpublished().await?, 1, "only the first committed row exists");

    // a healthy unit that used the connection still commits
    let mut uow = db.store.begin().await?;
    let pg = PgUnitOfWork::of(uow.as_mut())?;
    sqlx::query("INSERT INTO app_effect VALUES (3)").execute(pg.connection()).await?;
    uow.commit().await?;
    assert_eq!(db.count("app_effect").await?, 1);
    Ok(())
}

/// Issue 24.8: the claim bounds its own lock wait (down to 100 ms), and that bound must not stay on the
/// handler's statements in the same transaction: ordinary row contention there is waited out, not a 503.
#[tokio::test]
async fn the_claims_lock_timeout_does_not_bound_the_handlers_statements() -> anyhow::Result<()> {
    use idem_ports::IdempotencyClaim;
    use idem_postgres::PgUnitOfWork;

    let db = TestDb::new().await?;
    sqlx::raw_sql("CREATE TABLE stock (sku text PRIMARY KEY, n int); INSERT INTO stock VALUES ('a', 10)")
        .execute(db.pool())
        .await?;
    // another transaction holds the row for 400 ms
    let mut holder = db.pool().begin().await?;
    sqlx::query("UPDATE stock SET n = n - 1 WHERE sku = 'a'").execute(&mut *holder).await?;
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(400)).await;
        holder.commit().await
    });
    let now = Utc::now();
    let claim = IdempotencyClaim {
        scope: "m".into(),
        key: "k".into(),
        command_hash: [7; 32],
        created_at: now,
        expires_at: now + chrono::Duration::hours(24),
    };
    let mut uow = db.store.begin().await?;
    uow.idempotency().claim(&claim, now, Duration::from_millis(100)).await?;
    let pg = PgUnitOfWork::of(uow.as_mut())?;
    let waited = sqlx::query("UPDATE stock SET n = n - 1 WHERE sku = 'a'").execute(pg.connection()).await;
    assert!(waited.is_ok(), "the handler's row wait was cut by the claim's lock_timeout: {waited:?}");
    uow.commit().await?;
    release.await??;
    let n: i32 = sqlx::query_scalar("SELECT n FROM stock").fetch_one(db.pool()).await?;
    assert_eq!(n, 8);
    Ok(())
}

/// Issue 24.8: `is_processed` read `processed_event` even in partitioned mode, so it never saw an event.
#[tokio::test]
async fn is_processed_reads_the_storage_in_use() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let store = db.store.clone().with_dedup_storage(idem_postgres::DedupStorage::Partitioned);
    let (id, now) = (Uuid::now_v7(), Utc::now());
    let row = ProcessedEvent { event_id: id, topic: "orders".into(), expires_at: now + chrono::Duration::hours(72) };
    let mut uow = store.begin().await?;
    assert_eq!(uow.processed_events().record_new("g", &[row], now).await?, vec![id]);
    uow.commit().await?;
    let mut uow = store.begin().await?;
    assert!(uow.processed_events().is_processed("g", id).await?, "a recorded event was reported unprocessed");
    assert!(!uow.processed_events().is_processed("other", id).await?);
    Ok(())
}

/// Issue 26: the SQL `uuid_v7_time` (partition routing of `processed_event_partitioned`) and the domain's
/// `uuid_v7_time` (admission, retention) read the same instant from every UUID v7 up to the year 2200 — the
/// epoch's edges and 2,000 random times — and agree that a non-v7 id has none (SQL: the epoch). (Beyond
/// 2^53 µs, about the year 2255, PostgreSQL's `to_timestamp(float8)` drifts by microseconds; this test
/// found it at the 48-bit field's maximum, year 10889. No v7 id minted by a working clock gets there.)
#[tokio::test]
async fn rust_and_sql_read_the_same_time_from_a_uuid_v7() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let max = 7_258_118_400_000; // 2200-01-01
    let mut millis = vec![0, 1, 999, 1000, 1_700_000_000_123, 4_102_444_800_000, max];
    millis.extend((0..2000).map(|_| Uuid::new_v4().as_u128() as u64 % max));
    let ids: Vec<Uuid> = millis
        .iter()
        .map(|ms| {
            uuid::Builder::from_unix_timestamp_millis(
                *ms,
                &Uuid::new_v4().into_bytes()[..10].try_into().expect("10 bytes"),
            )
            .into_uuid()
        })
        .collect();
    let sql: Vec<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT uuid_v7_time(id) FROM unnest($1::uuid[]) WITH ORDINALITY AS t(id, n) ORDER BY n")
            .bind(&ids)
            .fetch_all(db.pool())
            .await?;
    for ((id, ms), from_sql) in ids.iter().zip(&millis).zip(&sql) {
        let from_rust = idem_domain::uuid_v7_time(*id).expect("a v7 id has a time");
        assert_eq!(from_rust.timestamp_millis() as u64, *ms, "{id}: Rust");
        assert_eq!(from_sql, &from_rust, "{id}: SQL and Rust disagree");
    }
    let v4 = Uuid::new_v4();
    let epoch: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT uuid_v7_time($1)").bind(v4).fetch_one(db.pool()).await?;
    assert_eq!((idem_domain::uuid_v7_time(v4), epoch.timestamp()), (None, 0));
    Ok(())
}

/// Issue 26: a toolkit user's database (`PgStore::migrate`) gets idem's tables and none of the reference
/// payment service's (`payment`, `refund`, `order_projection`: before, `migrate` installed them in every
/// database); and every idem table, index, default and storage setting has the same shape there as in a
/// database that grew through the reference service's history.
#[tokio::test]
async fn a_toolkit_database_holds_idems_tables_only_and_in_the_reference_shape() -> anyhow::Result<()> {
    let reference = TestDb::new().await?;
    let toolkit = TestDb::unmigrated(idem_postgres::PoolSettings::default()).await?;
    toolkit.store.migrate().await?;
    let tables = |db: &TestDb| {
        let pool = db.pool().clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT relname::text FROM pg_class WHERE relnamespace = 'public'::regnamespace
                 AND relkind IN ('r', 'p') AND relname <> '_sqlx_migrations' ORDER BY 1",
            )
            .fetch_all(&pool)
            .await
        }
    };
    let toolkit_tables = tables(&toolkit).await?;
    for reference_only in ["payment", "refund", "order_projection"] {
        assert!(!toolkit_tables.iter().any(|t| t == reference_only), "{reference_only} in a toolkit database");
    }
    let shape = "SELECT string_agg(line, E'\\n' ORDER BY line) FROM (
          SELECT format('%s.%s %s %s %s %s', c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
                        a.attnotnull, a.attidentity::text || a.attgenerated::text, pg_get_expr(d.adbin, d.adrelid)) AS line
            FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
            LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
           WHERE c.relname = ANY($1)
          UNION ALL
          SELECT format('%s index %s', tablename, regexp_replace(indexdef, '^.* USING ', '')) FROM pg_indexes
           WHERE tablename = ANY($1)
          UNION ALL
          SELECT format('%s options %s', relname, reloptions) FROM pg_class WHERE relname = ANY($1)
          UNION ALL
          SELECT format('%s check %s', conrelid::regclass, pg_get_constraintdef(oid)) FROM pg_constraint
           WHERE conrelid::regclass::text = ANY($1)
          UNION ALL
          SELECT format('function %s', pg_get_functiondef('uuid_v7_time'::regproc))
        ) lines";
    let describe = |db: &TestDb| {
        let (pool, names) = (db.pool().clone(), toolkit_tables.clone());
        async move { sqlx::query_scalar::<_, String>(shape).bind(names).fetch_one(&pool).await }
    };
    let (from_history, from_toolkit) = (describe(&reference).await?, describe(&toolkit).await?);
    assert!(from_toolkit.lines().count() > 50, "{from_toolkit}");
    assert_eq!(from_toolkit, from_history, "idem's tables differ between the two migration paths");
    // the reference database took idem's migration too (no-ops there), so both record it
    let recorded = |db: &TestDb| {
        let pool = db.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM _sqlx_migrations WHERE version = 20261205000001 AND success",
            )
            .fetch_one(&pool)
            .await
        }
    };
    assert_eq!((recorded(&reference).await?, recorded(&toolkit).await?), (1, 1));
    Ok(())
}

/// Issue 32.5: behind a transaction pooler without a direct URL, the start checks that every migration was
/// applied — by version only, so an applied migration edited since passed. Now its checksum is compared,
/// as sqlx's migrator does on a direct connection.
#[tokio::test]
async fn behind_a_pooler_an_edited_applied_migration_is_refused() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let settings = idem_postgres::PoolSettings { pooler: idem_postgres::Pooler::Transaction, ..Default::default() };
    let pooled = idem_postgres::PgStore::connect(&db.url, &settings).await?;
    pooled.migrate_schema_first(&idem_tests::REFERENCE_MIGRATOR).await?;
    sqlx::query(
        "UPDATE _sqlx_migrations SET checksum = '\\x00' WHERE version = (SELECT min(version) FROM _sqlx_migrations)",
    )
    .execute(db.pool())
    .await?;
    let err =
        pooled.migrate_schema_first(&idem_tests::REFERENCE_MIGRATOR).await.expect_err("an edited migration is refused");
    assert!(err.to_string().contains("checksum"), "{err}");
    Ok(())
}

//! Issue 36: an operation run once per key outside HTTP (`idem::Idempotent`), and a fingerprint that
//! leaves out what a client may change between retries. Effects are counted in a table of their own.

use std::sync::Arc;
use std::time::Duration;

use idem::domain::Fingerprint;
use idem::testing::{ShiftedClock, TestDb};
use idem::{Claimed, Idempotent, OnceError, TransactionManager, TtlPolicy};
use idem_postgres::PgUnitOfWork;

/// Runs the "fee" operation for `key` with `amount`: one row in `test_fee` per execution.
async fn charge_fee(db: &TestDb, once: &Idempotent, key: &str, amount: i64) -> Result<(i64, bool), OnceError> {
    let fingerprint = Fingerprint::of_call("fee", &serde_json::json!({ "amount": amount }))?;
    let mut uow = db.store.begin().await?;
    match once.claim::<i64>(uow.as_mut(), "job:fees", key, fingerprint).await? {
        Claimed::Replay(fee) => Ok((fee, true)),
        Claimed::Run(pending) => {
            let pg = PgUnitOfWork::of(uow.as_mut())?;
            sqlx::query("INSERT INTO test_fee (key, amount) VALUES ($1, $2)")
                .bind(key)
                .bind(amount)
                .execute(pg.connection())
                .await
                .map_err(idem_postgres::map_sqlx_error)?;
            once.complete(uow.as_mut(), pending, &amount).await?;
            uow.commit().await?;
            Ok((amount, false))
        }
    }
}

async fn fees(db: &TestDb) -> anyhow::Result<i64> {
    db.count("test_fee").await
}

#[tokio::test]
async fn an_operation_runs_once_per_key_replays_conflicts_and_frees_a_key_rolled_back() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    sqlx::raw_sql("CREATE TABLE test_fee (key text NOT NULL, amount bigint NOT NULL)").execute(db.pool()).await?;
    let clock = Arc::new(ShiftedClock::new());
    let once = Idempotent::new(TtlPolicy::new(Duration::from_secs(24 * 3600))?, clock.clone())
        .wait(Duration::from_millis(200));

    assert_eq!(charge_fee(&db, &once, "m-7/2026-11", 1200).await?, (1200, false));
    assert_eq!(charge_fee(&db, &once, "m-7/2026-11", 1200).await?, (1200, true), "the retry replays");
    assert!(matches!(charge_fee(&db, &once, "m-7/2026-11", 999).await, Err(OnceError::Conflict)));
    assert!(matches!(charge_fee(&db, &once, "bad key", 1).await, Err(OnceError::InvalidKey(_))));
    assert_eq!(fees(&db).await?, 1, "one execution");

    // claimed and rolled back (the operation failed): the key is free again
    let fingerprint = Fingerprint::of_call("fee", &serde_json::json!({ "amount": 5 }))?;
    let mut uow = db.store.begin().await?;
    assert!(matches!(once.claim::<i64>(uow.as_mut(), "job:fees", "k-2", fingerprint).await?, Claimed::Run(_)));
    // meanwhile another unit finds it in flight
    assert!(matches!(charge_fee(&db, &once, "k-2", 5).await, Err(OnceError::InFlight)));
    drop(uow);
    assert_eq!(charge_fee(&db, &once, "k-2", 5).await?, (5, false));

    // the same key in another scope is another operation
    let mut uow = db.store.begin().await?;
    let fingerprint = Fingerprint::of_call("fee", &serde_json::json!({ "amount": 1200 }))?;
    assert!(matches!(once.claim::<i64>(uow.as_mut(), "job:other", "m-7/2026-11", fingerprint).await?, Claimed::Run(_)));
    drop(uow);

    // past the retention the record counts as gone: the key runs again (the cleaner deletes such records)
    clock.advance(chrono::Duration::hours(25));
    assert_eq!(charge_fee(&db, &once, "m-7/2026-11", 1200).await?, (1200, false));
    assert_eq!(fees(&db).await?, 3, "m-7 twice (once per retention), k-2 once");
    Ok(())
}

/// The HTTP layer with a field left out of the fingerprint: a retry that changed only it replays, and a
/// retry that changed anything else is still a conflict. One execution is counted.
#[tokio::test]
async fn a_field_left_out_of_the_fingerprint_may_change_between_retries() -> anyhow::Result<()> {
    use axum::routing::post;
    use idem::http::{IdempotencyConfig, IdempotencyLayer, Tx};

    let db = TestDb::new().await?;
    sqlx::raw_sql("CREATE TABLE test_fee (key text NOT NULL, amount bigint NOT NULL)").execute(db.pool()).await?;
    async fn handler(mut tx: Tx, body: axum::body::Bytes) -> Result<&'static str, axum::http::StatusCode> {
        let pg = PgUnitOfWork::of(tx.uow()).map_err(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR)?;
        sqlx::query("INSERT INTO test_fee (key, amount) VALUES ('http', length($1))")
            .bind(String::from_utf8_lossy(&body).into_owned())
            .execute(pg.connection())
            .await
            .map_err(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR)?;
        Ok("charged")
    }
    let ttl = TtlPolicy::new(Duration::from_secs(24 * 3600))?;
    let scope = Arc::new(|_: &axum::http::request::Parts| Some("s".to_owned()));
    let config = IdempotencyConfig::new(ttl, scope).ignoring_fields(&["sent_at"]);
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let layer = IdempotencyLayer::new(tm, Arc::new(idem::SystemClock), config);
    let base = idem::testing::serve(axum::Router::new().route("/fees", post(handler)).route_layer(layer)).await?;
    let send = |body: &'static str| {
        let url = format!("{base}/fees");
        async move {
            let reply = reqwest::Client::new()
                .post(url)
                .header("idempotency-key", "k-1")
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await?;
            anyhow::Ok((reply.status().as_u16(), reply.headers().contains_key("idempotent-replayed")))
        }
    };
    assert_eq!(send(r#"{"amount": 10, "sent_at": "10:00:00"}"#).await?, (200, false));
    assert_eq!(send(r#"{"amount": 10, "sent_at": "10:00:05"}"#).await?, (200, true), "only sent_at changed");
    assert_eq!(send(r#"{"amount": 11, "sent_at": "10:00:05"}"#).await?.0, 409, "the amount changed");
    assert_eq!(fees(&db).await?, 1);
    Ok(())
}

/// Issue 36: a toolkit service whose scope function finds no principal was told "Missing or invalid API
/// key" though it has no API keys. The 401 now says what is missing, and nothing runs.
#[tokio::test]
async fn a_request_without_a_principal_is_told_so_and_runs_nothing() -> anyhow::Result<()> {
    use axum::routing::post;
    use idem::http::{IdempotencyConfig, IdempotencyLayer};

    let db = TestDb::new().await?;
    let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = ran.clone();
    let handler = move || {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            "ran"
        }
    };
    let ttl = TtlPolicy::new(Duration::from_secs(24 * 3600))?;
    let scope = Arc::new(|_: &axum::http::request::Parts| None);
    let tm: Arc<dyn TransactionManager> = Arc::new(db.store.clone());
    let layer = IdempotencyLayer::new(tm, Arc::new(idem::SystemClock), IdempotencyConfig::new(ttl, scope));
    let base = idem::testing::serve(axum::Router::new().route("/jobs", post(handler)).route_layer(layer)).await?;
    let reply = reqwest::Client::new().post(format!("{base}/jobs")).header("idempotency-key", "k-1").send().await?;
    assert_eq!(reply.status().as_u16(), 401);
    let body: serde_json::Value = reply.json().await?;
    assert_eq!(body["title"], "The request is not authenticated", "{body}");
    assert!(body["detail"].as_str().unwrap_or_default().contains("no principal"), "{body}");
    assert!(!body.to_string().contains("API key"), "{body}");
    assert_eq!((ran.load(std::sync::atomic::Ordering::SeqCst), db.count("idempotency_record").await?), (0, 0));
    Ok(())
}

//! A test kit for services built on idem (feature `testing`, for your dev-dependencies): what idem's own
//! suite uses to count effects, not survivors.
//!
//! - [`TestDb`]: a database of its own per test, migrated with idem's tables and yours, on the server of
//!   `DATABASE_URL` or, without it, in a PostgreSQL container ([`containers`]).
//! - [`kafka_brokers`], [`create_topic`], [`unique_topic`] and [`TestProducer`]: a broker (`KAFKA_BROKERS`
//!   or a container), topics of the test's own, and messages with an `event_id`, with the same one again
//!   (a redelivery) or raw (none, or any headers).
//! - [`faults`]: units of work whose commit dies before `COMMIT` or whose outcome is lost after it.
//! - [`effects`]: a log of applications written in the handler's transaction (a rolled-back application
//!   leaves no row), [`effects::Counted`] around your handler and [`effects::CountingHandler`].
//! - [`ShiftedClock`], for the age and retention rules; [`eventually`]; [`serve`] for a router.
//! - [`provider`]: a stand-in payment provider speaking the provider contract of README's "Calling other
//!   systems", counting its charges per key.
//!
//! A test that a redelivered event is applied once, with one announcement:
//!
//! ```no_run
//! # use std::{sync::Arc, time::Duration};
//! # use idem::{HandlerError, InboundEvent, PgEventHandler, SystemClock, TtlPolicy};
//! # use idem::postgres::PgUnitOfWork;
//! use idem::testing::{TestDb, TestProducer, effects, eventually, kafka_brokers, unique_topic, create_topic};
//! # struct MyHandler;
//! # #[idem::async_trait]
//! # impl PgEventHandler for MyHandler {
//! #     async fn handle(&self, _: &mut PgUnitOfWork, _: &InboundEvent) -> Result<(), HandlerError> { Ok(()) }
//! # }
//! # async fn example() -> anyhow::Result<()> {
//! let db = TestDb::new().await?; // with_migrations(&sqlx::migrate!()) for your tables too
//! effects::create_application_log(&db).await?;
//! let brokers = kafka_brokers().await?;
//! let topic = unique_topic("orders");
//! create_topic(&brokers, &topic, 1).await?;
//! let producer = TestProducer::new(&brokers)?;
//! let id = producer.event(&topic, "order-1", b"{}").await?;
//! producer.event_with_id(id, &topic, "order-1", b"{}").await?; // the same event, delivered again
//!
//! let ttl = TtlPolicy::new(Duration::from_secs(48 * 3600))?;
//! let settings = idem::kafka::consumer::RunnerSettings::new(&brokers, &unique_topic("group"), &topic, ttl);
//! let runner = idem::pg_runner(settings, db.store.clone(), Arc::new(SystemClock), effects::Counted(MyHandler));
//! let token = idem::CancellationToken::new();
//! let task = tokio::spawn(runner.run(token.clone()));
//! assert!(eventually(Duration::from_secs(30), || async { Ok(db.count("processed_event").await? == 1) }).await?);
//! token.cancel();
//! task.await??;
//! assert_eq!(effects::applications_of_event(&db, id).await?, 1, "applied once, though delivered twice");
//! # Ok(()) }
//! ```

#![allow(clippy::disallowed_methods)] // a test kit makes its own ids and reads the clock

mod broker;
mod clock;
pub mod containers;
mod db;
pub mod effects;
pub mod faults;
pub mod provider;

use std::time::Duration;

pub use broker::{TestProducer, create_topic, kafka_brokers, unique_topic};
pub use clock::ShiftedClock;
pub use db::{TestDb, with_database};

/// Polls `check` every 100 ms until it returns true or `timeout` passes; returns the last answer.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> anyhow::Result<bool>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await? {
            return Ok(true);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Serves `router` on a random loopback port until the test process ends; returns its base URL.
pub async fn serve(router: axum::Router) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(format!("http://{addr}"))
}

/// A UUID v7 whose embedded time is `at`: ids from the past or the future, for the age rules.
pub fn v7_at(at: chrono::DateTime<chrono::Utc>) -> uuid::Uuid {
    let ts = uuid::Timestamp::from_unix(uuid::NoContext, at.timestamp() as u64, at.timestamp_subsec_nanos());
    uuid::Uuid::new_v7(ts)
}

/// Waits until something listens on the loopback `port` (about 30 s at most); `what` names it in the error.
pub async fn wait_for_port(port: u16, what: &str) -> anyhow::Result<()> {
    for _ in 0..600 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("{what} did not listen on {port}")
}

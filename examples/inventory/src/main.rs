//! The README's "Use idem in your own service" example: the wiring (the parts are in `lib.rs`).

use std::{sync::Arc, time::Duration};

use idem::kafka::consumer::RunnerSettings;
use idem::kafka::relay::{Relay, RelaySettings};
use idem::postgres::cleanup::{Cleaner, CleanupSettings};
use idem::postgres::{PgStore, PoolSettings};
use idem::{Background, SystemClock, TtlPolicy, pg_runner};
use inventory::{MIGRATOR, Restocked, api};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (kafka, clock) = ("127.0.0.1:9092", Arc::new(SystemClock));
    let store = PgStore::connect("postgres://postgres@127.0.0.1/app", &PoolSettings::default()).await?;
    // idem's tables beside yours: both migration sets in the same _sqlx_migrations table
    store.migrate_with(Some(&MIGRATOR)).await?;
    let ttl = TtlPolicy::new(Duration::from_secs(48 * 3600))?;
    let app = api(Arc::new(store.clone()), clock.clone(), ttl);

    // relay (with its wake-ups and the outbox vacuum), cleaner, topics and consumers: one call, one token
    let restocks = RunnerSettings::new(kafka, "inventory", "restocks", ttl);
    let consumer = pg_runner(restocks, store.clone(), clock.clone(), Restocked);
    let mut tasks = Background::new(store.clone(), kafka)
        .relay(Relay::new(RelaySettings::new(kafka), Arc::new(store.clone()), clock))
        .cleaner(Cleaner::new(store.clone(), CleanupSettings::default()), Duration::from_secs(6 * 3600))
        .topics(&["restocks", "restocks.dlq", "stock"], 6, idem::kafka::admin::Replication::Auto)
        .consumer(consumer)
        .start()
        .await?;
    tasks.stop_on_signal(); // SIGINT/SIGTERM: every task drains (requests finish, consumers leave their groups)
    let (listener, token) = (tokio::net::TcpListener::bind("127.0.0.1:8081").await?, tasks.token());
    tasks.spawn("http", async move {
        Ok(idem::http::server::serve(listener, app, Default::default(), token).await?)
    });
    tasks.wait(Duration::from_secs(20)).await?;
    Ok(())
}

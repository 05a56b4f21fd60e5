//! Test harness: real PostgreSQL and a real Kafka-protocol broker.
//!
//! Uses `DATABASE_URL` / `KAFKA_BROKERS` when they are set (the no-Docker machines, CI) and falls back to
//! testcontainers when not. Every test gets its own database, so tests run in parallel.

#![allow(clippy::disallowed_methods)] // the test harness makes its own ids and reads the clock

use std::sync::OnceLock;

use idem_postgres::PoolSettings;

pub use idem::testing::{containers, kafka_brokers, serve, v7_at, with_database};

static TRACING: OnceLock<()> = OnceLock::new();

/// The reference payment service's schema history (`migrations/` at the repository's root), applied before
/// idem's own (`PgStore::migrate_schema_first`), as `idem serve` does.
pub static REFERENCE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Installs a test tracing subscriber when `TEST_LOG` is set; silent otherwise.
pub fn init_tracing() {
    TRACING.get_or_init(|| {
        if std::env::var_os("TEST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_test_writer()
                .try_init();
        }
    });
}

/// A fresh database for one test with the reference service's tables and idem's: the kit's
/// [`idem::testing::TestDb`] (its fields and methods through `Deref`), plus what only idem's suite needs.
#[derive(Debug, Clone)]
pub struct TestDb(pub idem::testing::TestDb);

impl std::ops::Deref for TestDb {
    type Target = idem::testing::TestDb;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl TestDb {
    pub async fn new() -> anyhow::Result<Self> {
        Self::with_pool(PoolSettings::default()).await
    }

    pub async fn with_pool(settings: PoolSettings) -> anyhow::Result<Self> {
        let db = Self::unmigrated(settings).await?;
        db.store.migrate_schema_first(&REFERENCE_MIGRATOR).await?;
        Ok(db)
    }

    /// A fresh database with nothing in it (the caller migrates what it needs).
    pub async fn unmigrated(settings: PoolSettings) -> anyhow::Result<Self> {
        init_tracing();
        Ok(Self(idem::testing::TestDb::unmigrated(settings).await?))
    }

    /// A [`kafka::TcpProxy`] in front of this database's server (it counts the round trips a client makes)
    /// and this database's URL through it.
    pub async fn proxied(&self) -> anyhow::Result<(kafka::TcpProxy, String)> {
        let options: sqlx::postgres::PgConnectOptions = self.url.parse()?;
        let upstream = format!("{}:{}", options.get_host(), options.get_port());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address =
            tokio::net::lookup_host(&upstream).await?.next().ok_or_else(|| anyhow::anyhow!("no {upstream}"))?;
        let proxy = kafka::TcpProxy::start(listener, address)?;
        let proxied = self.url.replacen(&upstream, &proxy.addr.to_string(), 1);
        anyhow::ensure!(proxied != self.url, "cannot route {} through the proxy", self.url);
        Ok((proxy, proxied))
    }

    /// Keeps the id of every committed outbox row in `test_outbox_log` (a trigger in the writing
    /// transaction, so rolled-back rows are never logged): the relay deletes the rows it publishes, and the
    /// fault suite checks every committed one arrived.
    pub async fn log_outbox_rows(&self) -> anyhow::Result<()> {
        sqlx::raw_sql(
            "CREATE TABLE test_outbox_log (id uuid PRIMARY KEY);
             CREATE FUNCTION test_outbox_log() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN INSERT INTO test_outbox_log VALUES (NEW.id) ON CONFLICT DO NOTHING; RETURN NULL; END $$;
             CREATE TRIGGER test_outbox_log AFTER INSERT ON outbox_message
                 FOR EACH ROW EXECUTE FUNCTION test_outbox_log();",
        )
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Ids of every committed outbox row since [`TestDb::log_outbox_rows`].
    pub async fn logged_outbox_rows(&self) -> anyhow::Result<std::collections::BTreeSet<String>> {
        Ok(sqlx::query_scalar("SELECT id::text FROM test_outbox_log")
            .fetch_all(self.pool())
            .await?
            .into_iter()
            .collect())
    }
}

/// `POST url` as a client sends a charge: bearer `api_key`, `Idempotency-Key: key`, a JSON `body`.
pub fn charge_request(
    http: &reqwest::Client,
    url: &str,
    api_key: &str,
    key: &str,
    body: &str,
) -> reqwest::RequestBuilder {
    http.post(url)
        .bearer_auth(api_key)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
}

/// A loopback port for a child process to listen on. It lies below the kernel's ephemeral range: a port
/// from `bind(0)` goes back to that range when the probe closes, the next outgoing connection of any
/// process may take it, and the child's bind then fails. Ports here are only taken by listeners, and the
/// probe checks that none holds it.
pub fn port_for_child() -> u16 {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let low = ephemeral_low.saturating_sub(12_000).max(1024);
    let span = u128::from(ephemeral_low - low);
    loop {
        let port = low + (uuid::Uuid::new_v4().as_u128() % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

pub mod effects;
pub mod history;
pub use idem::testing::faults as faulty;
pub mod infra;
pub mod kafka;
pub mod otlp;
pub use idem::testing::provider;

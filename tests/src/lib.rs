//! Test harness: real PostgreSQL and a real Kafka-protocol broker.
//!
//! Uses `DATABASE_URL` / `KAFKA_BROKERS` when they are set (the no-Docker machines, CI) and falls back to
//! testcontainers when not. Every test gets its own database, so tests run in parallel.

#![allow(clippy::disallowed_methods)] // the test harness makes its own ids and reads the clock

use std::sync::OnceLock;

use anyhow::Context;
use idem_postgres::{PgStore, PoolSettings};
use sqlx::Connection;
use tokio::sync::OnceCell;

/// Prefix of per-test databases.
const DB_PREFIX: &str = "idem_test_";

static PG_ADMIN_URL: OnceCell<String> = OnceCell::const_new();
static KAFKA: OnceCell<String> = OnceCell::const_new();
static TRACING: OnceLock<()> = OnceLock::new();

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

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// URL of a server where the harness may create databases.
async fn admin_url() -> anyhow::Result<String> {
    PG_ADMIN_URL
        .get_or_try_init(|| async {
            let url = match std::env::var("DATABASE_URL") {
                Ok(url) => url,
                Err(_) => containers::postgres().await?,
            };
            drop_stale_databases(&url).await?;
            Ok(url)
        })
        .await
        .cloned()
}

/// Drops per-test databases created more than 30 minutes ago (no test runs that long: nextest ends a test
/// after 6 minutes). Hundreds of leftover databases keep autovacuum busy and skew the benchmarks.
async fn drop_stale_databases(admin: &str) -> anyhow::Result<()> {
    let mut conn = sqlx::PgConnection::connect(admin).await.context("connecting to PostgreSQL")?;
    let names: Vec<String> = sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'idem\\_test\\_%'")
        .fetch_all(&mut conn)
        .await?;
    let cutoff = unix_now().saturating_sub(30 * 60);
    for name in names {
        let created = name
            .strip_prefix(DB_PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|secs| secs.parse::<u64>().ok());
        if created.is_some_and(|c| c < cutoff) {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&mut conn).await;
        }
    }
    Ok(())
}

/// A fresh, migrated database for one test.
#[derive(Debug, Clone)]
pub struct TestDb {
    pub store: PgStore,
    pub url: String,
    pub name: String,
}

impl TestDb {
    pub async fn new() -> anyhow::Result<Self> {
        Self::with_pool(PoolSettings::default()).await
    }

    pub async fn with_pool(settings: PoolSettings) -> anyhow::Result<Self> {
        let db = Self::unmigrated(settings).await?;
        db.store.migrate_reference().await?;
        Ok(db)
    }

    /// A fresh database with nothing in it (the caller migrates what it needs).
    pub async fn unmigrated(settings: PoolSettings) -> anyhow::Result<Self> {
        init_tracing();
        let admin = admin_url().await?;
        let name = format!("{DB_PREFIX}{}_{}", unix_now(), uuid::Uuid::new_v4().simple());
        let mut conn = sqlx::PgConnection::connect(&admin).await?;
        sqlx::query(&format!("CREATE DATABASE \"{name}\"")).execute(&mut conn).await?;
        conn.close().await?;
        let url = with_database(&admin, &name);
        let store = PgStore::connect(&url, &settings).await?;
        Ok(Self { store, url, name })
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

    pub fn pool(&self) -> &sqlx::PgPool {
        self.store.pool()
    }

    /// Outbox rows not yet published (quarantined ones included): the relay deletes what it published.
    pub async fn unpublished(&self) -> anyhow::Result<i64> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM outbox_message").fetch_one(self.pool()).await?)
    }

    /// Waits until every outbox row is published; false when `timeout` passed first.
    pub async fn all_published_within(&self, timeout: std::time::Duration) -> anyhow::Result<bool> {
        kafka::eventually(timeout, || async { Ok(self.unpublished().await? == 0) }).await
    }

    /// Number of rows of a table (test-only, table names are literals of the tests).
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

    pub async fn count(&self, table: &str) -> anyhow::Result<i64> {
        Ok(sqlx::query_scalar(&format!("SELECT count(*) FROM {table}")).fetch_one(self.pool()).await?)
    }
}

/// A UUID v7 whose embedded time is `at` (ids from the past or the future, for the age rules).
pub fn v7_at(at: chrono::DateTime<chrono::Utc>) -> uuid::Uuid {
    let ts = uuid::Timestamp::from_unix(uuid::NoContext, at.timestamp() as u64, at.timestamp_subsec_nanos());
    uuid::Uuid::new_v7(ts)
}

/// Replaces the database name in a PostgreSQL URL.
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

pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let base = match base[scheme_end..].find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    match query {
        Some(q) => format!("{base}/{db}?{q}"),
        None => format!("{base}/{db}"),
    }
}

/// Bootstrap servers of the test broker.
pub async fn kafka_brokers() -> anyhow::Result<String> {
    KAFKA
        .get_or_try_init(|| async {
            match std::env::var("KAFKA_BROKERS") {
                Ok(b) => Ok(b),
                Err(_) => containers::kafka().await,
            }
        })
        .await
        .cloned()
}

/// The path for machines with Docker (no `DATABASE_URL`/`KAFKA_BROKERS`): PostgreSQL and a Kafka-protocol
/// broker in containers, started through testcontainers.
///
/// Images: `IDEM_TEST_POSTGRES_IMAGE` (default `idem-postgres:15`) and `IDEM_TEST_KAFKA_IMAGE` (default
/// `idem-tansu:local`), the local images `scripts/docker.sh` builds from Debian's packages where no registry
/// can be reached. They run on the host's network (the engine has no bridge) on fixed ports derived from the
/// image name, and are **reused**: the first test process starts them, every later one (nextest runs each
/// test in a process of its own) and every later run finds them running. Any other image (`postgres:15`,
/// `apache/kafka:3.8.0` where a registry is reachable) runs on the default bridge with a mapped port, one
/// container per test process.
pub mod containers {
    use testcontainers::core::{IntoContainerPort, WaitFor};
    use testcontainers::runners::AsyncRunner;
    use testcontainers::{GenericImage, ImageExt, ReuseDirective};
    use tokio::sync::OnceCell;

    /// A started container, kept for the process's life (shared ones are not removed when dropped).
    type Held = Box<dyn std::any::Any + Send + Sync>;

    static PG: OnceCell<(Held, u16)> = OnceCell::const_new();
    static KAFKA: OnceCell<(Held, u16)> = OnceCell::const_new();

    /// `IDEM_TEST_POSTGRES_IMAGE`, or the local one.
    pub fn postgres_image() -> String {
        std::env::var("IDEM_TEST_POSTGRES_IMAGE").unwrap_or_else(|_| "idem-postgres:15".into())
    }

    /// `IDEM_TEST_KAFKA_IMAGE`, or the local one.
    pub fn kafka_image() -> String {
        std::env::var("IDEM_TEST_KAFKA_IMAGE").unwrap_or_else(|_| "idem-tansu:local".into())
    }

    fn split(image: &str) -> (String, String) {
        match image.rsplit_once(':') {
            Some((name, tag)) if !tag.contains('/') => (name.to_owned(), tag.to_owned()),
            _ => (image.to_owned(), "latest".to_owned()),
        }
    }

    fn is_local(image: &str) -> bool {
        image.starts_with("idem-")
    }

    /// A port for a shared container on the host network: fixed per image (every test process must find
    /// the same one), in 20000–29999, away from the kernel's ephemeral range.
    fn shared_port(image: &str, base: u16) -> u16 {
        let h = image.bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
        base + (h % 1000) as u16
    }

    /// Starts `request` as a container shared by every test process: reused when running; a concurrent
    /// start by another process (the name is taken) is answered by reusing it.
    async fn start_shared(
        request: impl Fn() -> testcontainers::core::ContainerRequest<GenericImage>,
        name: &str,
    ) -> anyhow::Result<testcontainers::ContainerAsync<GenericImage>> {
        let mut last = None;
        for _ in 0..5 {
            let shared = request()
                .with_network("host")
                .with_container_name(name)
                .with_label("idem.test", "shared")
                .with_reuse(ReuseDirective::Always)
                .with_startup_timeout(std::time::Duration::from_secs(60));
            match shared.start().await {
                Ok(c) => return Ok(c),
                Err(e) => {
                    last = Some(e);
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                }
            }
        }
        Err(anyhow::anyhow!("starting {name}: {last:?} (scripts/docker.sh builds the local images)"))
    }

    pub async fn postgres() -> anyhow::Result<String> {
        let image = postgres_image();
        let (name, tag) = split(&image);
        let (_, port) = PG
            .get_or_try_init(|| async {
                if is_local(&image) {
                    let port = shared_port(&image, 25000);
                    let request = || {
                        GenericImage::new(name.clone(), tag.clone())
                            .with_wait_for(WaitFor::message_on_stderr("database system is ready to accept connections"))
                            .with_env_var("PGPORT", port.to_string())
                    };
                    let c = start_shared(request, &format!("idem-test-postgres-{port}")).await?;
                    crate::infra::wait_for_port(port, &image).await?;
                    anyhow::Ok((Box::new(c) as Held, port))
                } else {
                    let c = GenericImage::new(name, tag)
                        .with_exposed_port(5432.tcp())
                        .with_wait_for(WaitFor::message_on_stderr("database system is ready to accept connections"))
                        .with_env_var("POSTGRES_PASSWORD", "postgres")
                        .start()
                        .await?;
                    let port = c.get_host_port_ipv4(5432).await?;
                    anyhow::Ok((Box::new(c) as Held, port))
                }
            })
            .await?;
        let url = if is_local(&image) {
            format!("postgres://postgres@127.0.0.1:{port}/postgres")
        } else {
            format!("postgres://postgres:postgres@127.0.0.1:{port}/postgres")
        };
        accepting_sessions(&url).await?;
        Ok(url)
    }

    /// Waits until the server answers a query. A listening port and the "ready" log line are not enough:
    /// a reused container found by a second test process, or one whose entrypoint's temporary server has
    /// just stopped, still answers `57P03 the database system is starting up` for a moment.
    async fn accepting_sessions(url: &str) -> anyhow::Result<()> {
        use sqlx::Connection;
        let mut last = None;
        for _ in 0..300 {
            match sqlx::PgConnection::connect(url).await {
                Ok(mut conn) => match sqlx::query("SELECT 1").execute(&mut conn).await {
                    Ok(_) => return Ok(conn.close().await?),
                    Err(e) => last = Some(e),
                },
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        Err(anyhow::anyhow!("the PostgreSQL container never accepted a session: {last:?}"))
    }

    pub async fn kafka() -> anyhow::Result<String> {
        let image = kafka_image();
        let (name, tag) = split(&image);
        let (_, port) = KAFKA
            .get_or_try_init(|| async {
                if is_local(&image) {
                    let port = shared_port(&image, 26000);
                    let url = format!("tcp://127.0.0.1:{port}");
                    let request = || {
                        GenericImage::new(name.clone(), tag.clone()).with_cmd([
                            "broker",
                            "--listener-url",
                            &url,
                            "--advertised-listener-url",
                            &url,
                            "--storage-engine",
                            "memory://tansu/",
                        ])
                    };
                    let c = start_shared(request, &format!("idem-test-tansu-{port}")).await?;
                    crate::infra::wait_for_port(port, &image).await?;
                    anyhow::Ok((Box::new(c) as Held, port))
                } else {
                    // Apache Kafka's image through testcontainers-modules' settings for one KRaft node
                    let c = testcontainers_modules::kafka::apache::Kafka::default()
                        .with_name(name)
                        .with_tag(tag)
                        .start()
                        .await?;
                    let port = c.get_host_port_ipv4(testcontainers_modules::kafka::apache::KAFKA_PORT).await?;
                    anyhow::Ok((Box::new(c) as Held, port))
                }
            })
            .await?;
        Ok(format!("127.0.0.1:{port}"))
    }
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

/// Serves `router` on a random loopback port until the test process ends; returns its base URL.
pub async fn serve(router: axum::Router) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(format!("http://{addr}"))
}

pub mod effects;
pub mod faulty;
pub mod infra;
pub mod kafka;
pub mod otlp;
pub mod provider;

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn replaces_database_name() {
        assert_eq!(with_database("postgres://u@h:5432/postgres", "x"), "postgres://u@h:5432/x");
        assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
        assert_eq!(with_database("postgres://u@h/db?sslmode=disable", "x"), "postgres://u@h/x?sslmode=disable");
    }
}

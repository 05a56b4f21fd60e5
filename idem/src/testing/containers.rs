//! The path for machines with Docker (no `DATABASE_URL`/`KAFKA_BROKERS`): PostgreSQL and a Kafka-protocol
//! broker in containers, started through testcontainers.
//!
//! Images: `IDEM_TEST_POSTGRES_IMAGE` (default `idem-postgres:15`) and `IDEM_TEST_KAFKA_IMAGE` (default
//! `idem-tansu:local`), the local images `scripts/docker.sh` builds from Debian's packages where no registry
//! can be reached. They run on the host's network (the engine has no bridge) on fixed ports derived from the
//! image name, and are **reused**: the first test process starts them, every later one (nextest runs each
//! test in a process of its own) and every later run finds them running. Any other image (`postgres:15`,
//! `apache/kafka:3.8.0` where a registry is reachable) runs on the default bridge with a mapped port, one
//! container per test process.
//!
//! In a service's own repository set both variables to public images (`postgres:15`,
//! `apache/kafka:3.8.0`), or set `DATABASE_URL` and `KAFKA_BROKERS` and no container starts.

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

/// The URL of a server in a PostgreSQL container (its `postgres` database), started once per process.
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
                super::wait_for_port(port, &image).await?;
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

/// Bootstrap servers of a broker in a container, started once per process.
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
                super::wait_for_port(port, &image).await?;
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

//! idem's own image (issue 25): the root `Dockerfile`'s `local` stage with the binary cargo built, started
//! with testcontainers on the PostgreSQL and broker containers the suite uses (`idem_tests::containers`).
//! Needs a Docker engine and the local base image (`scripts/docker.sh`, which `scripts/test.sh` runs).

#![allow(clippy::disallowed_methods)] // tests make their own ids and read the clock
#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::time::Duration;

use idem_http::client::{ChargeRequest, IdemClient, RetryPolicy};
use testcontainers::core::{ExecCommand, WaitFor};
use testcontainers::runners::AsyncRunner;
use testcontainers::{GenericImage, ImageExt};
use uuid::Uuid;

const API_KEY: &str = "image_key_0123456789";

/// Builds `idem:test` from the root Dockerfile's `local` stage with the binary of this build (`IDEM_BIN`,
/// else `target/debug/idem`, else `target/release/idem`); returns its size in bytes. (testcontainers 0.27
/// starts images, it does not build them: the build is the one `docker` command here.)
fn build_image() -> anyhow::Result<u64> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let binary = match std::env::var("IDEM_BIN") {
        Ok(b) => std::path::PathBuf::from(b),
        Err(_) => ["target/debug/idem", "target/release/idem"]
            .iter()
            .map(|p| root.join(p))
            .find(|p| p.exists())
            .ok_or_else(|| anyhow::anyhow!("no idem binary: cargo build -p idem-app"))?,
    };
    let binary = binary.canonicalize()?;
    let relative = binary.strip_prefix(root.canonicalize()?)?;
    let out = std::process::Command::new("docker")
        .args(["build", "--target", "local", "--network", "host", "-t", "idem:test", "--build-arg"])
        .arg(format!("IDEM_BINARY={}", relative.display()))
        .arg(&root)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "docker build failed (scripts/docker.sh builds the base image): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let size =
        std::process::Command::new("docker").args(["image", "inspect", "-f", "{{.Size}}", "idem:test"]).output()?;
    Ok(String::from_utf8_lossy(&size.stdout).trim().parse()?)
}

/// The image runs as a non-root user, becomes healthy by its own `HEALTHCHECK`, takes a charge, replays
/// it, publishes its event through the broker container, and drains on SIGTERM (exit code 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_charges_replays_publishes_and_drains_on_sigterm() -> anyhow::Result<()> {
    let size = build_image()?;
    let admin = idem_tests::containers::postgres().await?;
    let brokers = idem_tests::containers::kafka().await?;
    let name = format!("idem_image_{}", Uuid::now_v7().simple());
    {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&admin).await?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await?;
        conn.close().await?;
    }
    let db_url = idem_tests::with_database(&admin, &name);
    let (port, admin_port) = (idem_tests::port_for_child(), idem_tests::port_for_child());
    let payments = format!("image-payments-{}", Uuid::now_v7().simple());
    let suffix = Uuid::now_v7().simple().to_string();
    let container = GenericImage::new("idem", "test")
        .with_wait_for(WaitFor::healthcheck())
        .with_network("host")
        .with_env_var("DATABASE_URL", &db_url)
        .with_env_var("KAFKA_BROKERS", &brokers)
        .with_env_var("HTTP_ADDR", format!("127.0.0.1:{port}"))
        .with_env_var("ADMIN_ADDR", format!("127.0.0.1:{admin_port}"))
        .with_env_var("IDEM_API_KEYS", format!("image:{API_KEY}"))
        .with_env_var("KAFKA_PAYMENTS_TOPIC", &payments)
        .with_env_var("KAFKA_ORDERS_TOPIC", format!("image-orders-{suffix}"))
        .with_env_var("KAFKA_GROUP_ID", format!("image-group-{suffix}"))
        .with_env_var("KAFKA_TOPIC_PARTITIONS", "1")
        .with_env_var("RUST_LOG", "info")
        .with_startup_timeout(Duration::from_secs(90))
        .start()
        .await?;
    let mut uid = container.exec(ExecCommand::new(["id", "-u"])).await?;
    let uid = String::from_utf8(uid.stdout_to_vec().await?)?;
    assert_eq!(uid.trim(), "10001", "the image runs as root");

    let client = IdemClient::new(&format!("http://127.0.0.1:{port}"), API_KEY, RetryPolicy::default())?;
    let request = ChargeRequest {
        order_id: Uuid::now_v7(),
        customer_id: Uuid::now_v7(),
        provider: "image".into(),
        external_payment_id: format!("image-{suffix}"),
        amount: "12.34".into(),
        currency: "EUR".into(),
    };
    let key = IdemClient::new_key();
    let first = client.charge(&key, &request).await?;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let again = client.charge(&key, &request).await?;
    assert!(again.replayed && again.body == first.body, "{again:?}");
    let published = idem_tests::kafka::read_topic(&brokers, &payments, 1, Duration::from_secs(60)).await?;
    assert_eq!(published.len(), 1, "the charge's event was not published");
    assert!(published[0].header("event_id").is_some(), "the event has no event_id header");

    container.stop().await?;
    assert_eq!(container.exit_code().await?, Some(0), "idem did not drain and exit cleanly on SIGTERM");
    let log = String::from_utf8_lossy(&container.stderr_to_vec().await?).into_owned();
    assert!(log.contains("SIGTERM received") && log.contains("stopped"), "{log}");
    println!("idem:test image size: {:.1} MB", size as f64 / 1e6);
    Ok(())
}

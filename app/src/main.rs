//! `idem`: the reference payment service. `main` only bootstraps: configuration, tracing, adapters,
//! tasks.

mod config;

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::sync::Arc;

use axum::http::StatusCode;
use config::{ConflictStatus, DbArgs, LayerSwitch, ServeArgs};
use idem_http::{ApiState, IdempotencyConfig, IdempotencyLayer};
use idem_ports::{Clock, SystemClock, TransactionManager, UuidV7Generator};
use idem_postgres::{PgStore, PoolSettings};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    name = "idem",
    version,
    about = "Idempotent payment service: HTTP idempotency, deduplicating Kafka consumer, transactional outbox"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the service: applies pending migrations, then serves until SIGINT/SIGTERM.
    Serve(Box<ServeArgs>),
    /// Apply pending database migrations and exit.
    Migrate(DbArgs),
}

fn init_tracing(json: bool) {
    use tracing_subscriber::{EnvFilter, fmt};
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

async fn connect(db: &DbArgs) -> anyhow::Result<PgStore> {
    let settings = PoolSettings {
        max_connections: db.database_max_connections,
        ..PoolSettings::default()
    };
    PgStore::connect(&db.database_url.0, &settings)
        .await
        .with_context(|| format!("connecting to {:?}", db.database_url))
}

/// Cancels `token` on SIGINT or SIGTERM.
fn cancel_on_signal(token: CancellationToken) {
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let term = std::future::pending::<()>();
        tokio::select! {
            _ = ctrl_c => tracing::info!("SIGINT received, shutting down"),
            _ = term => tracing::info!("SIGTERM received, shutting down"),
        }
        token.cancel();
    });
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    init_tracing(args.log_json);
    tracing::info!(config = ?args, "starting idem");
    if args.api_keys.is_empty() {
        anyhow::bail!("IDEM_API_KEYS is empty: configure at least one merchant:key pair");
    }
    let store = connect(&args.db).await?;
    store.migrate().await.context("applying migrations")?;
    tracing::info!("migrations applied");

    let tm: Arc<dyn TransactionManager> = Arc::new(store.clone());
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let state = ApiState {
        tm: tm.clone(),
        clock: clock.clone(),
        ids: Arc::new(UuidV7Generator),
        payments_topic: args.payments_topic.as_str().into(),
    };
    let mut idem_config = IdempotencyConfig::new(args.idempotency_ttl, idem_http::merchant_scope());
    idem_config.wait = args.idempotency_wait;
    idem_config.conflict_status = match args.conflict_status {
        ConflictStatus::Conflict => StatusCode::CONFLICT,
        ConflictStatus::Unprocessable => StatusCode::UNPROCESSABLE_ENTITY,
    };
    let layer = match args.idempotency_layer {
        LayerSwitch::On => IdempotencyLayer::new(tm.clone(), clock.clone(), idem_config),
        LayerSwitch::Off => {
            tracing::warn!(
                "idempotency layer is OFF: requests are not deduplicated (benchmark mode)"
            );
            IdempotencyLayer::transaction_only(tm.clone(), clock.clone(), idem_config)
        }
    };
    let app = idem_http::router(state, Arc::new(args.api_keys.clone()), layer);

    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .with_context(|| format!("binding {}", args.http_addr))?;
    tracing::info!(addr = %listener.local_addr()?, "HTTP API listening");
    let http_shutdown = shutdown.clone();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { http_shutdown.cancelled().await })
        .await
        .context("HTTP server failed")?;
    store.pool().close().await;
    tracing::info!("stopped");
    Ok(())
}

async fn migrate(db: DbArgs) -> anyhow::Result<()> {
    init_tracing(false);
    let store = connect(&db).await?;
    store.migrate().await.context("applying migrations")?;
    tracing::info!("migrations applied");
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve(*args).await,
        Command::Migrate(db) => migrate(db).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = format!("{err:#}"), "idem failed");
            eprintln!("idem: {err:#}");
            ExitCode::FAILURE
        }
    }
}

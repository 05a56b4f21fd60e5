//! `idem`: the reference payment service. `main` only bootstraps: configuration, tracing, adapters,
//! tasks.

mod config;
mod demo;
mod operate;
mod ops;
mod serve;
mod telemetry;

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use config::{DbArgs, RelayOnlyArgs, ServeArgs};
use idem_ports::{Clock, SystemClock};
use idem_postgres::cleanup::Cleaner;
use idem_postgres::{PgStore, PoolSettings, Pooler};
use tokio_util::sync::CancellationToken;

/// The reference payment service's schema history (`migrations/` at the repository's root): its `payment`,
/// `refund` and `order_projection` tables, and idem's tables as they were created along the way. Applied
/// before idem's own (`PgStore::migrate_schema_first`).
pub(crate) static REFERENCE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

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
    /// Run only the outbox relay (several may run at once, on several machines).
    Relay(Box<RelayOnlyArgs>),
    /// Delete expired idempotency records, processed events and published outbox rows.
    Cleanup(CleanupArgs),
    /// Charge a payment through the running service (one key per operation, retried safely).
    Pay(Box<demo::PayArgs>),
    /// Run a scripted scenario against the running service and print what happened.
    Demo(Box<demo::DemoArgs>),
    /// Dead letters of the order consumer: list, show, re-drive.
    #[command(subcommand)]
    Dlq(Box<operate::DlqCommand>),
    /// Outbox rows that do not get published: list quarantined or stuck rows, retry them.
    #[command(subcommand)]
    Outbox(operate::OutboxCommand),
    /// Idempotency keys: what was stored for a key.
    #[command(subcommand)]
    Keys(operate::KeysCommand),
    /// Compare the payment provider's charges and refunds with idem's payments: repair what is safe (as a
    /// webhook would), report the rest (exit status 3 when something is left for an operator).
    Reconcile(Box<ReconcileArgs>),
}

#[derive(Debug, clap::Args)]
struct ReconcileArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    provider: config::ProviderArgs,
    /// How far back to look (what the provider made since then).
    #[arg(long, default_value = "24h", value_parser = config::parse_duration)]
    since: std::time::Duration,
}

#[derive(Debug, clap::Args)]
struct CleanupArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Run one round and exit (the only mode; `idem serve` runs the periodic cleaner).
    #[arg(long)]
    once: bool,
    #[command(flatten)]
    pace: config::CleanupPace,
}

fn init_tracing(json: bool) -> telemetry::Telemetry {
    telemetry::init(json)
}

async fn connect(db: &DbArgs) -> anyhow::Result<PgStore> {
    let settings = PoolSettings {
        max_connections: db.database_max_connections,
        step_timeout: db.database_step_timeout,
        pooler: match db.database_pooler {
            config::PoolerArg::None => Pooler::None,
            config::PoolerArg::Transaction => Pooler::Transaction,
        },
        ..PoolSettings::default()
    };
    let store = PgStore::connect(&db.database_url.0, &settings)
        .await
        .with_context(|| format!("connecting to {:?}", db.database_url))?;
    match &db.database_direct_url {
        Some(direct) => {
            Ok(store.with_direct_url(&direct.0).with_context(|| format!("DATABASE_DIRECT_URL {direct:?}"))?)
        }
        None => Ok(store),
    }
}

/// `idem reconcile`: one run, its report printed; `false` when findings are left for an operator.
async fn reconcile(args: ReconcileArgs) -> anyhow::Result<bool> {
    use idem_ports::Clock as _;
    let store = connect(&args.db).await?;
    let mut registry = prometheus_client::registry::Registry::default();
    let Some(provider) = serve::payment_provider(&args.provider, &mut registry)? else {
        anyhow::bail!("idem reconcile needs PAYMENT_PROVIDER_URL and PAYMENT_PROVIDER_API_KEY");
    };
    let tm: std::sync::Arc<dyn idem_ports::TransactionManager> = std::sync::Arc::new(store.clone());
    let api = idem_http::ApiState {
        tm,
        payments_of: idem_postgres::payments_of,
        clock: std::sync::Arc::new(idem_ports::SystemClock),
        ids: std::sync::Arc::new(idem_ports::UuidV7Generator),
        payments_topic: String::new().into(),
        provider: Some(provider.clone()),
    };
    let since = idem_ports::SystemClock.now() - chrono::Duration::from_std(args.since)?;
    // the provider's (or a proxy's) text in an error never drives the operator's terminal
    let report = idem_http::reconcile::Reconciler::new(api, provider)
        .run(since)
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.to_string().escape_debug()))?;
    store.close().await;
    Ok(operate::print_reconciliation(since, &report))
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

async fn cleanup_once(args: CleanupArgs) -> anyhow::Result<()> {
    init_tracing(false);
    anyhow::ensure!(args.once, "idem cleanup needs --once (idem serve runs the periodic cleaner)");
    let store = connect(&args.db).await?;
    store.migrate_schema_first(&REFERENCE_MIGRATOR).await.context("applying migrations")?;
    let settings = args.pace.settings();
    let now = SystemClock.now();
    let expired = store.expired_rows(now).await?;
    let cleaner = Cleaner::new(store.clone(), settings);
    let stats = cleaner.stats();
    let deleted = move || -> u64 {
        use idem_postgres::cleanup::{ExpiringTable, TableLabels};
        ExpiringTable::ALL.iter().map(|t| stats.deleted.get_or_create(&TableLabels { table: t.name() }).get()).sum()
    };
    let mut progress = operate::Progress::new("deleting expired rows", Some(expired.max(0) as u64), 50_000);
    let round = cleaner.run_once(now);
    tokio::pin!(round);
    let outcome = loop {
        tokio::select! {
            outcome = &mut round => break outcome?,
            _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => progress.set(deleted()),
        }
    };
    progress.set(deleted());
    progress.finish();
    match outcome {
        Some(report) => {
            for (table, n) in &report.deleted {
                tracing::info!(table = table.name(), deleted = n, "expired rows deleted");
            }
            tracing::info!(total = report.total(), "cleanup done");
        }
        None => tracing::warn!("another instance holds the cleaner lock; nothing done"),
    }
    store.close().await;
    Ok(())
}

async fn migrate(db: DbArgs) -> anyhow::Result<()> {
    init_tracing(false);
    let store = connect(&db).await?;
    store.migrate_schema_first(&REFERENCE_MIGRATOR).await.context("applying migrations")?;
    tracing::info!("migrations applied");
    Ok(())
}

/// The command line, with `<VARIABLE>_FILE` secrets applied ([`config::with_secret_files`]).
fn parse_cli() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let cmd = match config::with_secret_files(Cli::command(), &|name| std::env::var(name).ok()) {
        Ok(cmd) => cmd,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let matches = cmd.get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = parse_cli();
    let result = match cli.command {
        Command::Serve(args) => serve::serve(*args).await,
        Command::Migrate(db) => migrate(db).await,
        Command::Relay(args) => serve::relay_only(*args).await,
        Command::Cleanup(args) => cleanup_once(args).await,
        Command::Pay(args) => demo::pay(*args).await,
        Command::Demo(args) => demo::demo(*args).await,
        Command::Dlq(command) => {
            let telemetry = telemetry::init_traces_only();
            let done = operate::dlq(*command).await;
            telemetry.shutdown();
            done
        }
        Command::Outbox(command) => operate::outbox(command).await,
        Command::Keys(command) => operate::keys(command).await,
        Command::Reconcile(args) => match reconcile(*args).await {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::from(3),
            Err(e) => Err(e),
        },
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use config::ConflictStatus;
    use idem_http::IdempotencyConfig;
    use idem_kafka::consumer::RunnerSettings;
    use idem_kafka::relay::RelaySettings;
    use idem_postgres::PoolSettings;
    use idem_postgres::cleanup::CleanupSettings;

    const BASE: &[&str] = &["idem", "serve", "--database-url", "postgres://u:pw_not_shown_42@h/db"];

    fn serve_with(extra: &[&str]) -> Result<ServeArgs, String> {
        let keys: &[&str] = if extra.contains(&"--api-keys") { &[] } else { &["--api-keys", "m:key_0123456789ab"] };
        let args: Vec<&str> = BASE.iter().chain(keys).chain(extra).copied().collect();
        match Cli::try_parse_from(args) {
            Ok(Cli { command: Command::Serve(args) }) => args.validate().map(|()| *args),
            Ok(other) => Err(format!("unexpected command {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    fn refused(extra: &[&str], message: &str) {
        let err = serve_with(extra).expect_err("must be refused");
        assert!(err.contains(message), "{extra:?}: expected {message:?} in {err}");
    }

    /// Issue 23.6: no secret reaches an error, a log line or `Debug` output: a parse error of the API keys
    /// (clap echoed the whole value), a password in the URL's query or with an `@` in it, the API key and
    /// URL of `idem pay`/`idem demo`.
    #[test]
    fn secrets_never_reach_errors_or_debug_output() {
        let err = serve_with(&["--api-keys", "a:alpha_key_12345678,b:short"]).expect_err("a short key is refused");
        assert!(!err.contains("alpha_key_12345678"), "{err}");
        assert!(err.contains("IDEM_API_KEYS"), "{err}");
        for (url, secret) in [
            ("postgres://u:s3cret@h/db", "s3cret"),
            ("postgres://u:p@ss@h/db", "p@ss"),
            ("postgres://u@h/db?password=s3cret&sslmode=require", "s3cret"),
            ("postgres://h/db?user=u&password=s3cret", "s3cret"),
        ] {
            let shown = config::redact_url(url);
            assert!(!shown.contains(secret), "{url} shown as {shown}");
        }
        let serve = Cli::try_parse_from([
            "idem",
            "serve",
            "--database-url",
            "postgres://u@h/db?password=s3cret",
            "--api-keys",
            "m:key_0123456789ab",
        ])
        .expect("parses");
        assert!(!format!("{serve:?}").contains("s3cret"), "{serve:?}");
        assert!(!format!("{serve:?}").contains("key_0123456789"), "{serve:?}");
        let pay =
            Cli::try_parse_from(["idem", "pay", "--api-key", "pay_key_0123456789", "--amount", "1"]).expect("parses");
        assert!(!format!("{pay:?}").contains("pay_key_0123456789"), "{pay:?}");
        let demo = Cli::try_parse_from([
            "idem",
            "demo",
            "--api-key",
            "demo_key_0123456789",
            "--database-url",
            "postgres://u:s3cret@h/db",
        ])
        .expect("parses");
        assert!(!format!("{demo:?}").contains("demo_key_0123456789"), "{demo:?}");
        assert!(!format!("{demo:?}").contains("s3cret"), "{demo:?}");
        let client = idem_http::client::IdemClient::new("http://h", "client_key_0123456789", Default::default())
            .expect("client");
        assert!(!format!("{client:?}").contains("client_key_0123456789"), "{client:?}");
    }

    /// Issue 23.6: every secret setting also comes from a `*_FILE` (a mounted secret), the command line still
    /// wins, and an unreadable file is named without any content.
    /// The command without its environment fallbacks for the secret settings (the test run's own
    /// `DATABASE_URL` would otherwise win, as it should in production).
    fn without_secret_env(cmd: clap::Command) -> clap::Command {
        let mut cmd = cmd;
        for (_, id) in config::FILE_SECRETS {
            if cmd.get_arguments().any(|a| a.get_id() == id) {
                cmd = cmd.mut_arg(id, |a| a.env(None::<&str>));
            }
        }
        let names: Vec<String> = cmd.get_subcommands().map(|s| s.get_name().to_owned()).collect();
        for name in names {
            cmd = cmd.mut_subcommand(name, without_secret_env);
        }
        cmd
    }

    #[test]
    fn secrets_come_from_files() {
        use clap::{CommandFactory, FromArgMatches};
        let dir = std::env::temp_dir().join(format!("idem-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (url, keys) = (dir.join("url"), dir.join("keys"));
        std::fs::write(&url, "postgres://u:from_file@h/db\n").expect("write");
        std::fs::write(&keys, "m:file_key_0123456789\n").expect("write");
        let env = |name: &str| match name {
            "DATABASE_URL_FILE" => Some(url.display().to_string()),
            "IDEM_API_KEYS_FILE" => Some(keys.display().to_string()),
            _ => None,
        };
        let cmd = config::with_secret_files(without_secret_env(Cli::command()), &env).expect("files read");
        let matches = cmd.try_get_matches_from(["idem", "serve"]).expect("parses without flags");
        let Cli { command: Command::Serve(args) } = Cli::from_arg_matches(&matches).expect("cli") else {
            panic!("serve")
        };
        assert_eq!(args.db.database_url.0, "postgres://u:from_file@h/db");
        assert_eq!(args.api_keys.merchant("file_key_0123456789").map(|m| m.0.to_string()), Some("m".into()));
        let cmd = config::with_secret_files(Cli::command(), &env).expect("files read");
        let matches =
            cmd.try_get_matches_from(["idem", "migrate", "--database-url", "postgres://flag@h/db"]).expect("parses");
        let Cli { command: Command::Migrate(db) } = Cli::from_arg_matches(&matches).expect("cli") else {
            panic!("migrate")
        };
        assert_eq!(db.database_url.0, "postgres://flag@h/db", "the flag wins over the file");
        // --help never shows a secret read from a file
        let mut cmd = config::with_secret_files(Cli::command(), &env).expect("files read");
        let help = cmd.find_subcommand_mut("serve").expect("serve").render_long_help().to_string();
        assert!(!help.contains("from_file") && !help.contains("file_key_0123456789"), "{help}");
        let missing = |name: &str| (name == "DATABASE_URL_FILE").then(|| "/nonexistent/secret".to_owned());
        let err = config::with_secret_files(Cli::command(), &missing).expect_err("unreadable file");
        assert!(err.contains("DATABASE_URL_FILE") && err.contains("/nonexistent/secret"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 24.8: the merchant of order-event payments may not be an API merchant.
    #[test]
    fn the_orders_merchant_cannot_be_an_api_merchant() {
        refused(&["--api-keys", "orders:key_0123456789ab"], "ORDERS_MERCHANT_ID 'orders' is also an API merchant");
        refused(&["--orders-merchant-id", "m"], "is also an API merchant");
        assert!(serve_with(&["--orders-merchant-id", "shop-orders"]).is_ok());
    }

    /// Each default has one source: the library's settings. The CLI's defaults (shown by `--help`) must be
    /// the same values, or one of them drifted.
    #[test]
    fn cli_defaults_are_the_libraries_defaults() {
        let args = serve_with(&[]).expect("defaults parse");
        let runner = RunnerSettings::new("b", "g", "t", args.dedup_ttl);
        assert_eq!(args.orders.group_id, "payment-service");
        assert_eq!(args.batch_size as usize, runner.batch_size);
        assert_eq!(args.batch_timeout, runner.batch_timeout);
        assert_eq!(args.max_rejections, runner.max_rejections);
        let relay = RelaySettings::new("b");
        assert_eq!(args.relay.outbox_batch_size, relay.batch_size);
        assert_eq!(args.relay.outbox_poll_interval, relay.poll_interval);
        assert_eq!(args.relay.outbox_min_claim_interval, relay.min_claim_interval);
        assert_eq!(args.relay.outbox_linger, relay.producer.linger);
        assert_eq!(args.relay.outbox_concurrency as usize, relay.concurrency);
        let layer = IdempotencyConfig::new(args.idempotency_ttl, idem_http::merchant_scope());
        assert_eq!(args.idempotency_wait, layer.wait);
        assert_eq!(
            matches!(args.conflict_status, ConflictStatus::Conflict),
            layer.conflict_status == StatusCode::CONFLICT
        );
        assert_eq!(args.db.database_max_connections, PoolSettings::default().max_connections);
        let ttl = |p: idem_domain::TtlPolicy| p.ttl();
        assert!((idem_domain::ttl::MIN_TTL..=idem_domain::ttl::MAX_TTL).contains(&ttl(args.idempotency_ttl)));
        assert!((idem_domain::ttl::MIN_TTL..=idem_domain::ttl::MAX_TTL).contains(&ttl(args.dedup_ttl)));
        let cleanup = Cli::try_parse_from(["idem", "cleanup", "--once", "--database-url", "postgres://h/db"]);
        let Ok(Cli { command: Command::Cleanup(cleanup) }) = cleanup else { panic!("cleanup parses") };
        assert_eq!(cleanup.pace.batch_size, CleanupSettings::default().batch_size);
        assert_eq!(cleanup.pace.pause, CleanupSettings::default().pause);
        assert_eq!(args.cleanup.batch_size, CleanupSettings::default().batch_size);
        assert_eq!(args.cleanup.pause, CleanupSettings::default().pause);
    }

    #[test]
    fn defaults_are_valid_and_secrets_are_not_printed() {
        let args = serve_with(&[]).expect("defaults valid");
        assert_eq!(args.http_addr.to_string(), "127.0.0.1:8080");
        assert_eq!(args.idempotency_ttl.ttl(), std::time::Duration::from_secs(48 * 3600));
        assert_eq!(args.dedup_ttl.ttl(), std::time::Duration::from_secs(72 * 3600));
        assert_eq!(args.orders.dlq_topic(), "orders.dlq");
        let shown = format!("{args:?}");
        assert!(!shown.contains("pw_not_shown_42") && !shown.contains("key_0123456789"), "{shown}");
        let with_provider = serve_with(&[
            "--payment-provider-url",
            "https://provider.example",
            "--payment-provider-api-key",
            "sk_live_not_shown_1",
            "--payment-provider-webhook-secret",
            "whsec_not_shown_2",
        ])
        .expect("valid");
        let shown = format!("{with_provider:?}");
        assert!(!shown.contains("not_shown"), "{shown}");
    }

    #[test]
    fn provider_settings_are_checked() {
        refused(&["--payment-provider-url", "https://p.example"], "needs PAYMENT_PROVIDER_API_KEY");
        refused(&["--payment-provider-url", "ftp://p.example", "--payment-provider-api-key", "k"], "https:// URL");
        // issue 44: https:// except to a loopback host, and no credentials in the URL (never echoed)
        refused(&["--payment-provider-url", "http://p.example", "--payment-provider-api-key", "k"], "https://");
        assert!(
            serve_with(&["--payment-provider-url", "http://127.0.0.1:9", "--payment-provider-api-key", "k"]).is_ok()
        );
        let url = "https://acct:pw_not_shown_3@p.example";
        let err = serve_with(&["--payment-provider-url", url, "--payment-provider-api-key", "k"]).expect_err("creds");
        assert!(err.contains("PAYMENT_PROVIDER_API_KEY") && !err.contains("pw_not_shown"), "{err}");
        // issue 44: an empty or short webhook secret let anyone sign a capture
        for weak in ["", "short_secret_15"] {
            let args = ["--payment-provider-url", "https://p", "--payment-provider-api-key", "k"];
            let err = serve_with(&[&args[..], &["--payment-provider-webhook-secret", weak]].concat())
                .expect_err("a weak webhook secret");
            assert!(err.contains("PAYMENT_PROVIDER_WEBHOOK_SECRET") && err.contains("at least 16"), "{err}");
            assert!(weak.is_empty() || !err.contains(weak), "{err}");
        }
        refused(
            &[
                "--payment-provider-url",
                "https://p",
                "--payment-provider-api-key",
                "k",
                "--payment-provider-timeout",
                "30s",
            ],
            "below HTTP_REQUEST_TIMEOUT",
        );
        refused(&["--payment-provider-webhook-secret", "s"], "needs PAYMENT_PROVIDER_URL");
        // issue 45: a lease the call cannot fit in would let a takeover call while the call still runs
        refused(
            &["--payment-provider-url", "https://p", "--payment-provider-api-key", "k", "--idempotency-lease", "11s"],
            "IDEMPOTENCY_LEASE must be longer than PAYMENT_PROVIDER_TIMEOUT",
        );
        refused(&["--completer-window", "30s"], "COMPLETER_WINDOW");
        // without a provider its timeout is not checked against a short request timeout
        assert!(serve_with(&["--http-request-timeout", "3s"]).is_ok());
    }

    #[test]
    fn each_invalid_setting_is_refused_with_its_rule() {
        refused(&["--idempotency-ttl", "12h"], "between 24h and 72h");
        refused(&["--idempotency-ttl", "73h"], "between 24h and 72h");
        refused(&["--dedup-ttl", "1h"], "between 24h and 72h");
        refused(&["--dedup-ttl", "soon"], "write durations like 48h");
        refused(&["--idempotency-lease", "500ms"], "IDEMPOTENCY_LEASE must be between 1s and 1h");
        refused(&["--cleanup-pause", "5s"], "CLEANUP_PAUSE must be at most 1s");
        refused(&["--api-keys", ""], "IDEM_API_KEYS is empty");
        refused(&["--api-keys", "nocolon"], "merchant:key");
        refused(&["--api-keys", "m:short"], "16 to 256 printable");
        refused(&["--http-addr", "localhost"], "invalid socket address");
        refused(&["--idempotency-wait", "0s"], "IDEMPOTENCY_WAIT");
        refused(&["--idempotency-wait", "1m"], "IDEMPOTENCY_WAIT");
        refused(&["--cleanup-interval", "0s"], "CLEANUP_INTERVAL");
        refused(&["--batch-size", "0"], "batch-size");
        refused(&["--conflict-status", "418"], "conflict-status");
        refused(&["--orders-topic", "bad topic"], "topic names");
        refused(&["--orders-topic", "payments"], "must differ");
        refused(&["--database-max-connections", "0"], "database-max-connections");
        refused(&["--max-poll-interval", "5s"], "KAFKA_MAX_POLL_INTERVAL");
    }
}

//! `idem serve` and `idem relay`: wiring the adapters into the running service (HTTP first, then the
//! Kafka side in the background), its background tasks, and the graceful drain.

use crate::config::{
    ConflictStatus, DbArgs, DedupStorageArg, FastPathArg, LayerSwitch, RelayArgs, RelayOnlyArgs, ServeArgs,
};
use anyhow::Context;
use axum::http::StatusCode;
use idem::Background;
use idem_domain::usecases::OrderEventHandler;
use idem_http::HttpMetrics;
use idem_http::{ApiState, IdempotencyConfig, IdempotencyLayer};
use idem_kafka::KafkaConnection;
use idem_kafka::consumer::{Runner, RunnerSettings};
use idem_kafka::probe::BrokerProbe;
use idem_kafka::relay::{Relay, RelaySettings};
use idem_ports::{Clock, IdGenerator, SystemClock, TransactionManager, UuidV7Generator};
use idem_postgres::DedupStorage;
use idem_postgres::PgStore;
use idem_postgres::cleanup::{Cleaner, CleanupSettings, PartitionPolicy};
use prometheus_client::registry::Registry;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tower_http::trace::TraceLayer;

use crate::{cancel_on_signal, connect, init_tracing, ops};

fn relay_settings(cluster: &KafkaConnection, relay: &RelayArgs) -> RelaySettings {
    let mut settings = RelaySettings::new(cluster);
    settings.batch_size = relay.outbox_batch_size;
    settings.poll_interval = relay.outbox_poll_interval;
    settings.min_claim_interval = relay.outbox_min_claim_interval;
    settings.producer.linger = relay.outbox_linger;
    settings.concurrency = relay.outbox_concurrency as usize;
    settings
}

/// The relay with its statistics registered.
fn relay(store: &PgStore, cluster: &KafkaConnection, relay_args: &RelayArgs, registry: &mut Registry) -> Relay {
    let relay = Relay::new(relay_settings(cluster, relay_args), Arc::new(store.clone()), Arc::new(SystemClock));
    relay.stats().register(registry);
    relay
}

fn http_limits(args: &ServeArgs) -> idem_http::server::ServerLimits {
    idem_http::server::ServerLimits {
        header_read_timeout: args.http_header_read_timeout,
        first_byte_timeout: args.http_first_byte_timeout,
        body_read_timeout: args.http_body_read_timeout,
        max_connections: args.http_max_connections as usize,
        request_timeout: args.http_request_timeout,
    }
}

/// `idem serve`, step by step: open and migrate the database, check the settings dedup depends on, bind
/// both listeners (a taken port fails the start before a single message is touched), build the API, the
/// order consumer and the cleaner, start the background work, then serve until the shutdown signal.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let telemetry = init_tracing(args.log_json);
    args.validate().map_err(anyhow::Error::msg)?;
    let cluster = args.kafka.connection()?;
    tracing::info!(config = ?args, "starting idem");
    let stores = Stores::open(&args).await?;
    let checked = check_settings(&stores.api, &args).await?;
    let listeners = Listeners::bind(&args).await?;
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    let mut registry = Registry::default();
    telemetry.stats.register(&mut registry);
    if telemetry.exporting() {
        tracing::info!("exporting traces over OTLP");
    }

    let (api, reconciler) = api(&args, &stores.api, &checked, &mut registry)?;
    let completer = completer(&args, &stores.api, &api, &mut registry);
    let runner = order_consumer(&args, &cluster, &stores.background, &checked, &mut registry);
    let cleaner = cleaner(&args, &stores.background, &mut registry);
    let cleanup_stats = cleaner.stats();
    // Background work: relay (wake-ups, outbox vacuum), cleaner, topics, then the order consumer. Kafka may be
    // down at start: the API serves at once (payments wait in the outbox) and the rest waits for the broker.
    let dlq_topic = args.orders.dlq_topic();
    let topics = [args.orders.orders_topic.as_str(), dlq_topic.as_str(), args.kafka.payments_topic.as_str()];
    let relay = relay(&stores.background, &cluster, &args.relay, &mut registry);
    let mut group = Background::new(stores.background.clone(), &cluster)
        .shutdown_token(shutdown.clone())
        .relay(relay)
        .outbox_vacuum_every(args.relay.outbox_vacuum_interval)
        .cleaner(cleaner, args.cleanup_interval)
        .topics(&topics, args.kafka.topic_partitions, args.kafka.replication_factor)
        .consumer(runner)
        .start()
        .await
        .context("LISTEN for outbox notifications")?;

    let token = shutdown.clone();
    group.spawn("completer", async move {
        completer.run_until(token).await;
        Ok(())
    });
    if let Some(reconciler) = reconciler {
        let metrics = Arc::new(idem_http::reconcile::ReconcileMetrics::default());
        metrics.register(&mut registry);
        let (token, interval) = (shutdown.clone(), args.provider.reconcile_interval);
        group.spawn("reconciler", async move {
            reconciler.run_every(interval, chrono::Duration::hours(24), metrics, token).await;
            Ok(())
        });
    }
    let ops = operations(&stores.background, &cluster, registry, cleanup_stats)?;
    listeners.serve(&mut group, &args, api, ops, &shutdown)?;
    let result = group.wait(args.shutdown_timeout).await;
    stores.close().await;
    tracing::info!("stopped");
    telemetry.shutdown();
    result
}

/// The two pools: the API's units of work, and a second one for background work (consumer, relay, cleaner,
/// readiness) so that neither side can take the other's connections. They share the outbox signal, so HTTP
/// commits wake the relay at once.
struct Stores {
    api: PgStore,
    background: PgStore,
}

impl Stores {
    /// Connects, applies the migrations and says whether acknowledged commits survive a failover.
    async fn open(args: &ServeArgs) -> anyhow::Result<Self> {
        let storage = match args.dedup_storage {
            DedupStorageArg::Table => DedupStorage::Table,
            DedupStorageArg::Partitioned => DedupStorage::Partitioned,
        };
        let api = connect(&args.db).await?.with_dedup_storage(storage);
        api.migrate_schema_first(&crate::REFERENCE_MIGRATOR).await.context("applying migrations")?;
        tracing::info!("migrations applied");
        warn_without_synchronous_standby(&api).await;
        let background = DbArgs { database_max_connections: args.background_connections, ..args.db.clone() };
        let background = connect(&background).await?.with_dedup_storage(storage).sharing_outbox_signal(&api);
        Ok(Self { api, background })
    }

    async fn close(self) {
        self.api.close().await;
        self.background.close().await;
    }
}

/// Asynchronous replication can lose commits idem already acted on (RELIABILITY.md): said at every start.
async fn warn_without_synchronous_standby(store: &PgStore) {
    match store.durability().await {
        Ok(durability) => match durability.risk() {
            Some(risk) => tracing::warn!(%risk, "acknowledged commits are not protected against a failover"),
            None => tracing::info!(?durability, "commits are confirmed by a synchronous standby"),
        },
        Err(e) => tracing::warn!(error = %e, "cannot read the replication settings"),
    }
}

/// The retentions a start runs with, each with its raise while it matters.
#[derive(Debug, Clone, Copy)]
struct Checked {
    dedup_ttl: idem_domain::TtlPolicy,
    idempotency_ttl: idem_domain::TtlPolicy,
}

/// The settings dedup depends on, checked by the toolkit's guard (`idem_postgres::guard`) against the ones
/// recorded at earlier starts — the check every consumer runner makes before it consumes, made here once
/// more before anything listens, so a refused change stops the start.
async fn check_settings(store: &PgStore, args: &ServeArgs) -> anyhow::Result<Checked> {
    let now = SystemClock.now();
    let consumer = idem_ports::ConsumerIdentity {
        group: args.orders.group_id.clone(),
        topic: args.orders.orders_topic.clone(),
        dedup_ttl: args.dedup_ttl.ttl(),
        accept: args.accept_setting_change.clone(),
        now,
    };
    let raised = |ttl: idem_domain::TtlPolicy, raise: Option<idem_ports::RetentionRaise>| match raise {
        Some(r) => ttl.raised_from(r.from, r.since),
        None => ttl,
    };
    let dedup = store.check_consumer_settings(&consumer).await.map_err(|e| anyhow::anyhow!(e))?;
    let keys = store.check_idempotency_ttl(args.idempotency_ttl.ttl(), now).await?;
    Ok(Checked { dedup_ttl: raised(args.dedup_ttl, dedup), idempotency_ttl: raised(args.idempotency_ttl, keys) })
}

/// The payment API behind the idempotency layer, its metrics registered.
fn api(
    args: &ServeArgs,
    store: &PgStore,
    checked: &Checked,
    registry: &mut Registry,
) -> anyhow::Result<(axum::Router, Option<idem_http::reconcile::Reconciler>)> {
    let http_metrics = HttpMetrics::default();
    http_metrics.register(registry);
    let tm: Arc<dyn TransactionManager> = Arc::new(store.clone());
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let state = ApiState {
        tm: tm.clone(),
        payments_of: idem_postgres::payments_of,
        clock: clock.clone(),
        ids: Arc::new(UuidV7Generator),
        payments_topic: args.kafka.payments_topic.as_str().into(),
        provider: payment_provider(&args.provider, registry)?,
    };
    let mut config = IdempotencyConfig::new(checked.idempotency_ttl, idem_http::merchant_scope());
    config.wait = args.idempotency_wait;
    config.lease = args.idempotency_lease;
    if args.provider.payment_provider_url.is_some() {
        config.call_bound = args.provider.call_bound();
        // the provider's window on every path: a retry, the completer and a resumed record past it look
        // the outcome up instead of sending again
        config.window = Some(args.provider.completer_window);
    }
    config.new_keys = std::num::NonZeroU32::new(args.merchant_new_keys_per_second).map(|rate| {
        let burst = std::num::NonZeroU32::new(args.merchant_new_keys_burst).unwrap_or(rate);
        Arc::new(idem_http::quota::NewKeyQuota::new(rate, burst))
    });
    config.replay_fast_path = match args.idempotency_replay_fast_path {
        FastPathArg::Adaptive => idem_http::FastPath::Adaptive,
        FastPathArg::Always => idem_http::FastPath::Always,
        FastPathArg::Never => idem_http::FastPath::Never,
    };
    config.conflict_status = match args.conflict_status {
        ConflictStatus::Conflict => StatusCode::CONFLICT,
        ConflictStatus::Unprocessable => StatusCode::UNPROCESSABLE_ENTITY,
    };
    let layer = match args.idempotency_layer {
        LayerSwitch::On => IdempotencyLayer::new(tm, clock, config),
        LayerSwitch::Off => {
            tracing::warn!("idempotency layer is OFF: requests are not deduplicated (benchmark mode)");
            IdempotencyLayer::transaction_only(tm, clock, config)
        }
    };
    let api_keys = args.api_keys.clone().with_concurrency_limit(args.merchant_concurrency as usize);
    api_keys.register(registry);
    let webhooks = match (&args.provider.payment_provider_webhook_secret, &state.provider) {
        (Some(secret), Some(provider)) => Some(
            idem_http::webhooks::WebhookState::new(state.clone(), provider.name().into(), secret.0.as_bytes())
                .map_err(|e| anyhow::anyhow!("PAYMENT_PROVIDER_WEBHOOK_SECRET: {e}"))?,
        ),
        (Some(_), None) => anyhow::bail!("PAYMENT_PROVIDER_WEBHOOK_SECRET needs PAYMENT_PROVIDER_URL"),
        _ => None,
    };
    let reconciler = state
        .provider
        .clone()
        .filter(|_| !args.provider.reconcile_interval.is_zero())
        .map(|provider| idem_http::reconcile::Reconciler::new(state.clone(), provider));
    let api = idem_http::router_with_metrics(state, Arc::new(api_keys), layer, http_metrics);
    let api = match webhooks {
        Some(webhooks) => api.merge(idem_http::webhooks::router(webhooks)),
        None => api,
    };
    Ok((api, reconciler))
}

/// The completer of held requests, re-sending through the API's own router (its idempotency layer and
/// handlers), on the API's pool: what it does is what a client's retry would do.
fn completer(
    args: &ServeArgs,
    store: &PgStore,
    api: &axum::Router,
    registry: &mut Registry,
) -> idem_http::completer::Completer {
    let settings = idem_http::completer::CompleterSettings {
        interval: args.provider.completer_interval,
        // a client has one lease to come back before the completer takes its request over
        grace: args.idempotency_lease,
        // the layer applies the window (it looks a request past it up, then parks it if not found): the
        // completer re-sends through it instead of parking unseen, so a resumed record is looked up
        window: std::time::Duration::from_secs(3650 * 24 * 3600),
        request_timeout: args.http_request_timeout,
        ..Default::default()
    };
    let completer = idem_http::completer::Completer::new(
        Arc::new(store.clone()),
        Arc::new(SystemClock),
        api.clone(),
        idem_http::merchant_principal(),
        settings,
    );
    completer.stats().register(registry);
    completer
}

/// The payment provider of `PAYMENT_PROVIDER_URL`, if one is configured.
pub(crate) fn payment_provider(
    args: &crate::config::ProviderArgs,
    registry: &mut Registry,
) -> anyhow::Result<Option<Arc<dyn idem_ports::PaymentProvider>>> {
    let (Some(url), Some(key)) = (&args.payment_provider_url, &args.payment_provider_api_key) else {
        return Ok(None);
    };
    let provider = idem_provider::HttpPaymentProvider::new(
        &args.payment_provider_name,
        url,
        &key.0,
        args.payment_provider_timeout,
    )
    .context("building the payment provider's HTTP client")?;
    provider.register(registry);
    tracing::info!(name = %args.payment_provider_name, "charges with a payment_method go through the payment provider");
    Ok(Some(Arc::new(provider)))
}

/// The order-event consumer on the background pool, its statistics registered.
fn order_consumer(
    args: &ServeArgs,
    cluster: &KafkaConnection,
    store: &PgStore,
    checked: &Checked,
    registry: &mut Registry,
) -> Runner {
    let mut settings =
        RunnerSettings::new(cluster, &args.orders.group_id, &args.orders.orders_topic, checked.dedup_ttl);
    settings.dlq_topic = args.orders.dlq_topic();
    settings.batch_size = args.batch_size as usize;
    settings.batch_timeout = args.batch_timeout;
    settings.max_rejections = args.max_rejections;
    settings.consumer.session_timeout = args.session_timeout;
    settings.consumer.max_poll_interval = args.max_poll_interval;
    settings.accept_setting_changes = args.accept_setting_change.clone();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let ids: Arc<dyn IdGenerator> = Arc::new(UuidV7Generator);
    let handler = Arc::new(OrderEventHandler {
        charges_through_provider: args.provider.payment_provider_url.is_some(),
        clock: clock.clone(),
        ids,
        payments_topic: args.kafka.payments_topic.clone(),
        merchant_id: args.orders_merchant_id.clone(),
        payments_of: idem_postgres::payments_of,
    });
    let tm: Arc<dyn TransactionManager> = Arc::new(store.clone());
    let runner = Runner::new(settings, tm, clock, handler);
    runner.stats().register(registry);
    runner
}

/// The TTL cleaner (and, with partitioned dedup storage, the partition keeper), its statistics registered.
fn cleaner(args: &ServeArgs, store: &PgStore, registry: &mut Registry) -> Cleaner {
    let partitions = (args.dedup_storage == DedupStorageArg::Partitioned)
        .then(|| PartitionPolicy { ttl: args.dedup_ttl.ttl(), days_ahead: 3 });
    let cleaner = Cleaner::new(store.clone(), CleanupSettings { partitions, ..args.cleanup.settings() });
    cleaner.stats().register(registry);
    cleaner
}

/// Readiness, metrics and the database gauges behind them.
fn operations(
    store: &PgStore,
    cluster: &KafkaConnection,
    mut registry: Registry,
    cleanup: Arc<idem_postgres::cleanup::CleanupStats>,
) -> anyhow::Result<ops::Ops> {
    let gauges = ops::Gauges::default();
    gauges.register(&mut registry);
    Ok(ops::Ops {
        store: store.clone(),
        broker: BrokerProbe::new(cluster)?,
        registry: Arc::new(registry),
        gauges,
        cleanup,
        readiness: Arc::default(),
    })
}

/// The public listener (the API and a liveness probe) and the admin listener (readiness and metrics, loopback
/// by default), bound before anything else starts.
struct Listeners {
    public: tokio::net::TcpListener,
    admin: tokio::net::TcpListener,
}

impl Listeners {
    async fn bind(args: &ServeArgs) -> anyhow::Result<Self> {
        let public = tokio::net::TcpListener::bind(args.http_addr)
            .await
            .with_context(|| format!("binding {}", args.http_addr))?;
        let admin = tokio::net::TcpListener::bind(args.admin_addr)
            .await
            .with_context(|| format!("binding the admin listener {}", args.admin_addr))?;
        Ok(Self { public, admin })
    }

    /// Serves both listeners in `group`, and refreshes the database gauges in the background (never by a
    /// scrape). No unauthenticated public request causes database work: readiness lives on the admin side.
    fn serve(
        self,
        group: &mut idem::TaskGroup,
        args: &ServeArgs,
        api: axum::Router,
        ops: ops::Ops,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let (gauges, token) = (ops.clone(), shutdown.clone());
        group.spawn("gauges", async move {
            gauges.refresh_until(token, std::time::Duration::from_secs(10)).await;
            Ok(())
        });
        let (probe, token) = (ops.clone(), shutdown.clone());
        group.spawn("readiness", async move {
            probe.probe_readiness_until(token, ops::READINESS_EVERY).await;
            Ok(())
        });
        let app = api.merge(ops::public_router()).layer(
            TraceLayer::new_for_http()
                .make_span_with(|req: &axum::http::Request<axum::body::Body>| idem_http::trace::server_span(req))
                .on_response(
                    |response: &axum::http::Response<axum::body::Body>,
                     _latency: std::time::Duration,
                     span: &tracing::Span| {
                        idem_http::trace::record_response(response.status(), span)
                    },
                ),
        );
        tracing::info!(addr = %self.admin.local_addr()?, "admin listener (readyz, metrics)");
        let (token, admin, listener) = (shutdown.clone(), ops::router(ops), self.admin);
        let limits = http_limits(args);
        group.spawn("admin http", async move {
            idem_http::server::serve(listener, admin, limits, token).await?;
            Ok(())
        });
        tracing::info!(addr = %self.public.local_addr()?, "HTTP API listening");
        let (token, limits, listener) = (shutdown.clone(), http_limits(args), self.public);
        group.spawn("http", async move {
            idem_http::server::serve(listener, app, limits, token).await?;
            Ok(())
        });
        Ok(())
    }
}

pub async fn relay_only(args: RelayOnlyArgs) -> anyhow::Result<()> {
    let telemetry = init_tracing(args.log_json);
    let cluster = args.kafka.connection()?;
    let store = connect(&args.db).await?;
    store.migrate_schema_first(&crate::REFERENCE_MIGRATOR).await.context("applying migrations")?;
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    let group = Background::new(store.clone(), &cluster)
        .shutdown_token(shutdown)
        .relay(relay(&store, &cluster, &args.relay, &mut Registry::default()))
        .outbox_vacuum_every(args.relay.outbox_vacuum_interval)
        .start()
        .await
        .context("LISTEN for outbox notifications")?;
    let result = group.wait(std::time::Duration::from_secs(20)).await;
    store.close().await;
    telemetry.shutdown();
    result
}

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
        body_read_timeout: args.http_body_read_timeout,
        max_connections: args.http_max_connections as usize,
        request_timeout: args.http_request_timeout,
    }
}

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    init_tracing(args.log_json);
    args.validate().map_err(anyhow::Error::msg)?;
    let cluster = args.kafka.connection()?;
    tracing::info!(config = ?args, "starting idem");
    let store = connect(&args.db).await?.with_dedup_storage(match args.dedup_storage {
        DedupStorageArg::Table => DedupStorage::Table,
        DedupStorageArg::Partitioned => DedupStorage::Partitioned,
    });
    store.migrate_reference().await.context("applying migrations")?;
    tracing::info!("migrations applied");
    match store.durability().await {
        Ok(durability) => match durability.risk() {
            Some(risk) => tracing::warn!(%risk, "acknowledged commits are not protected against a failover"),
            None => tracing::info!(?durability, "commits are confirmed by a synchronous standby"),
        },
        Err(e) => tracing::warn!(error = %e, "cannot read the replication settings"),
    }
    let wanted = crate::guard::Wanted {
        group: &args.orders.group_id,
        topic: &args.orders.orders_topic,
        dedup_storage: match args.dedup_storage {
            DedupStorageArg::Table => "table",
            DedupStorageArg::Partitioned => "partitioned",
        },
        dedup_ttl: args.dedup_ttl,
        idempotency_ttl: args.idempotency_ttl,
        accept: &args.accept_setting_change,
    };
    let checked = crate::guard::check(&store, &wanted, SystemClock.now()).await?;
    // A second pool for background work (consumer, relay, cleaner, readiness): neither side can take the
    // other's connections. It shares the outbox signal, so HTTP commits wake the relay at once.
    let background = DbArgs { database_max_connections: args.background_connections, ..args.db.clone() };
    let bg_store = connect(&background).await?.with_dedup_storage(store.dedup_storage()).sharing_outbox_signal(&store);
    // Bind before anything consumes: a taken port fails the start before a single message is touched.
    let listener =
        tokio::net::TcpListener::bind(args.http_addr).await.with_context(|| format!("binding {}", args.http_addr))?;
    let admin_listener = tokio::net::TcpListener::bind(args.admin_addr)
        .await
        .with_context(|| format!("binding the admin listener {}", args.admin_addr))?;
    let dlq_topic = args.orders.dlq_topic();

    let tm: Arc<dyn TransactionManager> = Arc::new(store.clone());
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let ids: Arc<dyn IdGenerator> = Arc::new(UuidV7Generator);
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    let mut registry = Registry::default();
    let http_metrics = HttpMetrics::default();
    http_metrics.register(&mut registry);

    // HTTP API
    let state = ApiState {
        tm: tm.clone(),
        payments_of: idem_postgres::payments_of,
        clock: clock.clone(),
        ids: ids.clone(),
        payments_topic: args.kafka.payments_topic.as_str().into(),
    };
    let mut idem_config = IdempotencyConfig::new(checked.idempotency_ttl, idem_http::merchant_scope());
    idem_config.wait = args.idempotency_wait;
    idem_config.replay_fast_path = match args.idempotency_replay_fast_path {
        FastPathArg::Adaptive => idem_http::FastPath::Adaptive,
        FastPathArg::Always => idem_http::FastPath::Always,
        FastPathArg::Never => idem_http::FastPath::Never,
    };
    idem_config.conflict_status = match args.conflict_status {
        ConflictStatus::Conflict => StatusCode::CONFLICT,
        ConflictStatus::Unprocessable => StatusCode::UNPROCESSABLE_ENTITY,
    };
    let layer = match args.idempotency_layer {
        LayerSwitch::On => IdempotencyLayer::new(tm.clone(), clock.clone(), idem_config),
        LayerSwitch::Off => {
            tracing::warn!("idempotency layer is OFF: requests are not deduplicated (benchmark mode)");
            IdempotencyLayer::transaction_only(tm.clone(), clock.clone(), idem_config)
        }
    };
    let api_keys = args.api_keys.clone().with_concurrency_limit(args.merchant_concurrency as usize);
    let api = idem_http::router_with_metrics(state, Arc::new(api_keys), layer, http_metrics);
    // Order-event consumer
    let mut settings =
        RunnerSettings::new(&cluster, &args.orders.group_id, &args.orders.orders_topic, checked.dedup_ttl);
    settings.dlq_topic = dlq_topic.clone();
    settings.batch_size = args.batch_size as usize;
    settings.batch_timeout = args.batch_timeout;
    settings.max_rejections = args.max_rejections;
    settings.consumer.session_timeout = args.session_timeout;
    settings.consumer.max_poll_interval = args.max_poll_interval;
    let handler = Arc::new(OrderEventHandler {
        clock: clock.clone(),
        ids: ids.clone(),
        payments_topic: args.kafka.payments_topic.clone(),
        merchant_id: args.orders_merchant_id.clone(),
        payments_of: idem_postgres::payments_of,
    });
    let bg_tm: Arc<dyn TransactionManager> = Arc::new(bg_store.clone());
    let runner = Runner::new(settings, bg_tm, clock.clone(), handler);
    runner.stats().register(&mut registry);
    // TTL cleanup
    let partitions = (args.dedup_storage == DedupStorageArg::Partitioned)
        .then(|| PartitionPolicy { ttl: args.dedup_ttl.ttl(), days_ahead: 3 });
    let cleaner = Cleaner::new(
        bg_store.clone(),
        CleanupSettings { partitions, max_clock_skew: idem_domain::ADMISSION_MARGIN, ..CleanupSettings::default() },
    );
    let cleanup_stats = cleaner.stats();
    cleanup_stats.register(&mut registry);

    // Background work: relay (wake-ups, outbox vacuum), cleaner, topics, then the order consumer. Kafka may be
    // down at start: the API serves at once (payments wait in the outbox) and the rest waits for the broker.
    let topics = [args.orders.orders_topic.as_str(), dlq_topic.as_str(), args.kafka.payments_topic.as_str()];
    let mut group = Background::new(bg_store.clone(), &cluster)
        .shutdown_token(shutdown.clone())
        .relay(relay(&bg_store, &cluster, &args.relay, &mut registry))
        .outbox_vacuum_every(args.relay.outbox_vacuum_interval)
        .cleaner(cleaner, args.cleanup_interval)
        .topics(&topics, args.kafka.topic_partitions, args.kafka.replication_factor)
        .consumer(runner)
        .start()
        .await
        .context("LISTEN for outbox notifications")?;

    // Operational endpoints, then serve everything
    let gauges = ops::Gauges::default();
    gauges.register(&mut registry);
    let ops = ops::Ops {
        store: bg_store.clone(),
        broker: BrokerProbe::new(&cluster)?,
        registry: Arc::new(registry),
        gauges,
        cleanup: cleanup_stats,
    };
    // Gauges that need the database are refreshed in the background, never by a scrape.
    let (gauges, token) = (ops.clone(), shutdown.clone());
    group.spawn("gauges", async move {
        gauges.refresh_until(token, std::time::Duration::from_secs(10)).await;
        Ok(())
    });
    // The public listener serves the API and a liveness probe; readiness and metrics live on the admin
    // listener only (loopback by default), so no unauthenticated public request causes database work.
    let app = api.merge(ops::public_router()).layer(
        TraceLayer::new_for_http().make_span_with(|req: &axum::http::Request<axum::body::Body>| {
            tracing::info_span!("request", method = %req.method(), path = %req.uri().path())
        }),
    );
    {
        tracing::info!(addr = %admin_listener.local_addr()?, "admin listener (readyz, metrics)");
        let (token, admin) = (shutdown.clone(), ops::router(ops));
        let limits = http_limits(&args);
        group.spawn("admin http", async move {
            idem_http::server::serve(admin_listener, admin, limits, token).await?;
            Ok(())
        });
    }

    {
        tracing::info!(addr = %listener.local_addr()?, "HTTP API listening");
        let (token, limits) = (shutdown.clone(), http_limits(&args));
        group.spawn("http", async move {
            idem_http::server::serve(listener, app, limits, token).await?;
            Ok(())
        });
    }

    let result = group.wait(args.shutdown_timeout).await;
    store.close().await;
    bg_store.close().await;
    tracing::info!("stopped");
    result
}

pub async fn relay_only(args: RelayOnlyArgs) -> anyhow::Result<()> {
    init_tracing(args.log_json);
    let cluster = args.kafka.connection()?;
    let store = connect(&args.db).await?;
    store.migrate_reference().await.context("applying migrations")?;
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
    result
}

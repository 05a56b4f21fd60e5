//! The one typed configuration of `idem`: every setting is a flag with an environment fallback.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, ValueEnum};
use idem_domain::TtlPolicy;
use idem_http::ApiKeys;

/// A database URL whose password is redacted when printed.
#[derive(Clone)]
pub struct DatabaseUrl(pub String);

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(&self.0))
    }
}

/// Replaces the passwords of a URL by `***`: the user-info's (`scheme://user:password@host`, the password
/// running to the last `@`, so one containing `@` is hidden whole) and libpq's query parameters
/// (`?password=…`, `sslpassword=…`).
pub fn redact_url(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let base = match base.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((userinfo, host)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                None => base.to_owned(),
            },
            None => base.to_owned(),
        },
        None => base.to_owned(),
    };
    let Some(query) = query else { return base };
    let params: Vec<String> = query
        .split('&')
        .map(|p| match p.split_once('=') {
            Some((k, _)) if matches!(k.to_ascii_lowercase().as_str(), "password" | "sslpassword" | "passwd") => {
                format!("{k}=***")
            }
            _ => p.to_owned(),
        })
        .collect();
    format!("{base}?{}", params.join("&"))
}

/// The secret settings that may also come from a file named by `<VARIABLE>_FILE` (the container and
/// orchestrator convention: a mounted secret instead of a value in the environment).
pub const FILE_SECRETS: [(&str, &str); 7] = [
    ("DATABASE_URL", "database_url"),
    ("DATABASE_DIRECT_URL", "database_direct_url"),
    ("IDEM_API_KEYS", "api_keys"),
    ("IDEM_API_KEY", "api_key"),
    ("KAFKA_SASL_PASSWORD", "kafka_sasl_password"),
    ("PAYMENT_PROVIDER_API_KEY", "payment_provider_api_key"),
    ("PAYMENT_PROVIDER_WEBHOOK_SECRET", "payment_provider_webhook_secret"),
];

/// The payment provider charges with a `payment_method` go through (README, "Calling other systems").
#[derive(Debug, Clone, clap::Args)]
pub struct ProviderArgs {
    /// Base URL of the payment provider's API (`https://…`; `http://` only to a loopback host; no
    /// credentials: the key is PAYMENT_PROVIDER_API_KEY); unset: charges name their provider payment
    /// themselves (the recording flow) and a `payment_method` is refused.
    #[arg(long, env = "PAYMENT_PROVIDER_URL", hide_env_values = true)]
    pub payment_provider_url: Option<String>,
    /// The provider's name, stored as the payments' `provider`.
    #[arg(long, env = "PAYMENT_PROVIDER_NAME", default_value = "provider")]
    pub payment_provider_name: String,
    /// API key sent as `Authorization: Bearer`; also read from `PAYMENT_PROVIDER_API_KEY_FILE`.
    #[arg(long, env = "PAYMENT_PROVIDER_API_KEY", hide_env_values = true, value_parser = |s: &str| Ok::<_, String>(Secret(s.to_owned())))]
    pub payment_provider_api_key: Option<Secret>,
    /// Secret the provider signs its webhooks with; also read from `PAYMENT_PROVIDER_WEBHOOK_SECRET_FILE`.
    /// Unset: `POST /webhooks/payment-provider` answers 404.
    #[arg(long, env = "PAYMENT_PROVIDER_WEBHOOK_SECRET", hide_env_values = true, value_parser = |s: &str| Ok::<_, String>(Secret(s.to_owned())))]
    pub payment_provider_webhook_secret: Option<Secret>,
    /// Longest wait for one provider call; past it the outcome is unknown (503, the retry asks again under
    /// the same key). Below HTTP_REQUEST_TIMEOUT, so the handler answers before the request is dropped.
    #[arg(long, env = "PAYMENT_PROVIDER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub payment_provider_timeout: Duration,
    /// How often the completer looks for requests whose attempt died between the phases and whose client
    /// did not come back, and drives them to completion.
    #[arg(long, env = "COMPLETER_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub completer_interval: Duration,
    /// How long after its claim a held request may still be re-sent to the other side: its idempotency
    /// window (24 h at Stripe) less a margin. Past it the completer parks the request for an operator.
    #[arg(long, env = "COMPLETER_WINDOW", default_value = "23h", value_parser = parse_duration)]
    pub completer_window: Duration,
    /// How often the provider's charges and refunds of the last day are reconciled with idem's payments
    /// (`0s`: never); what is safe is repaired as a webhook would, the rest reported (`idem reconcile`).
    #[arg(long, env = "RECONCILE_INTERVAL", default_value = "1h", value_parser = parse_duration)]
    pub reconcile_interval: Duration,
}

impl ProviderArgs {
    /// The longest a provider call takes, with a second's margin: what an attempt must hold of its lease
    /// before it calls (`IdempotencyConfig::call_bound`).
    pub fn call_bound(&self) -> Duration {
        self.payment_provider_timeout + Duration::from_secs(1)
    }

    fn validate(&self, request_timeout: Duration) -> Result<(), String> {
        if self.payment_provider_webhook_secret.is_some() && self.payment_provider_url.is_none() {
            return Err("PAYMENT_PROVIDER_WEBHOOK_SECRET needs PAYMENT_PROVIDER_URL".into());
        }
        if let Some(secret) = &self.payment_provider_webhook_secret
            && secret.0.chars().count() < idem_domain::webhook::MIN_SECRET_LEN
        {
            return Err(format!(
                "PAYMENT_PROVIDER_WEBHOOK_SECRET must have at least {} characters (empty or short, anyone could sign a capture)",
                idem_domain::webhook::MIN_SECRET_LEN
            ));
        }
        if let Some(url) = &self.payment_provider_url {
            idem_provider::check_base_url(url).map_err(|why| format!("PAYMENT_PROVIDER_URL {why}"))?;
            if self.payment_provider_api_key.is_none() {
                return Err("PAYMENT_PROVIDER_URL needs PAYMENT_PROVIDER_API_KEY (or _FILE)".into());
            }
        }
        if self.payment_provider_url.is_some()
            && (self.payment_provider_timeout.is_zero() || self.payment_provider_timeout >= request_timeout)
        {
            return Err("PAYMENT_PROVIDER_TIMEOUT must be positive and below HTTP_REQUEST_TIMEOUT".into());
        }
        if idem_domain::usecases::PROVIDER_MAX_LEN < self.payment_provider_name.len()
            || self.payment_provider_name.is_empty()
            || !self.payment_provider_name.bytes().all(|b| (0x21..=0x7e).contains(&b))
        {
            return Err("PAYMENT_PROVIDER_NAME must be 1 to 64 printable ASCII characters".into());
        }
        if self.completer_interval < Duration::from_millis(100) {
            return Err("COMPLETER_INTERVAL must be at least 100ms".into());
        }
        if !(Duration::from_secs(60)..=Duration::from_secs(7 * 24 * 3600)).contains(&self.completer_window) {
            return Err("COMPLETER_WINDOW must be between 1m and 7d (the other side's idempotency window)".into());
        }
        Ok(())
    }
}

/// Applies `<VARIABLE>_FILE` to `cmd` and every subcommand that has the setting: when the variable itself is
/// not set and the file variable is, the file's content (one trailing newline dropped) becomes the
/// setting's default. A flag on the command line still wins. `env` looks a variable up; a file that
/// cannot be read is an error naming the variable and the path, never the content.
pub fn with_secret_files(
    mut cmd: clap::Command,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<clap::Command, String> {
    for (variable, id) in FILE_SECRETS {
        if env(variable).is_some() {
            continue;
        }
        let Some(path) = env(&format!("{variable}_FILE")) else { continue };
        let content =
            std::fs::read_to_string(&path).map_err(|e| format!("{variable}_FILE: cannot read {path}: {}", e.kind()))?;
        let value =
            content.strip_suffix('\n').map(|v| v.strip_suffix('\r').unwrap_or(v)).unwrap_or(&content).to_owned();
        cmd = set_default(cmd, id, &value);
    }
    Ok(cmd)
}

fn set_default(cmd: clap::Command, id: &str, value: &str) -> clap::Command {
    let has = cmd.get_arguments().any(|a| a.get_id() == id);
    let mut cmd = if has {
        let value = value.to_owned();
        cmd.mut_arg(id, move |a| a.default_value(value).hide_default_value(true).required(false))
    } else {
        cmd
    };
    let names: Vec<String> = cmd.get_subcommands().map(|s| s.get_name().to_owned()).collect();
    for name in names {
        cmd = cmd.mut_subcommand(name, |sub| set_default(sub, id, value));
    }
    cmd
}

/// A secret setting (an API key): kept as given, shown as `***` by `Debug`.
#[derive(Clone)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// Parses `IDEM_API_KEYS` without echoing it: clap's own errors quote the value given, which is every key.
#[derive(Clone, Copy, Debug)]
pub struct ApiKeysParser;

impl clap::builder::TypedValueParser for ApiKeysParser {
    type Value = ApiKeys;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<ApiKeys, clap::Error> {
        let refuse = |why: String| {
            let mut cmd = cmd.clone();
            cmd.error(clap::error::ErrorKind::ValueValidation, format!("invalid --api-keys / IDEM_API_KEYS: {why}"))
        };
        let text = value.to_str().ok_or_else(|| refuse("not UTF-8".into()))?;
        ApiKeys::parse(text).map_err(refuse)
    }
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (write durations like 48h, 30m, 500ms)"))
}

fn parse_cleanup_pause(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d > Duration::from_secs(1) {
        return Err("CLEANUP_PAUSE must be at most 1s (a round pauses after each of up to 10,000 batches)".into());
    }
    Ok(d)
}

fn parse_vacuum_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(100) {
        return Err("the outbox vacuum interval must be at least 100ms".into());
    }
    Ok(d)
}

pub(crate) fn parse_ttl(s: &str) -> Result<TtlPolicy, String> {
    TtlPolicy::new(parse_duration(s)?).map_err(|e| e.to_string())
}

/// Status of a reused key with another request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConflictStatus {
    /// 409 Conflict, as the seed's rule specifies.
    #[value(name = "409")]
    Conflict,
    /// 422 Unprocessable Content, as the IETF draft specifies.
    #[value(name = "422")]
    Unprocessable,
}

/// Processed-event storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DedupStorageArg {
    Table,
    Partitioned,
}

/// `IDEMPOTENCY_REPLAY_FAST_PATH`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FastPathArg {
    /// While replays are over a tenth of recent requests.
    Adaptive,
    /// Before every claim.
    Always,
    /// Never.
    Never,
}

/// On or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LayerSwitch {
    On,
    Off,
}

/// Settings shared by commands that use the database.
#[derive(Debug, Clone, Args)]
pub struct DbArgs {
    /// PostgreSQL connection URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_parser = |s: &str| Ok::<_, String>(DatabaseUrl(s.to_owned())))]
    pub database_url: DatabaseUrl,
    /// How DATABASE_URL reaches the server: `none` (directly, or a session pooler) or `transaction` (a
    /// transaction pooler such as PgBouncer with `pool_mode = transaction`: every statement in an explicit
    /// transaction, no named prepared statements kept, timeouts set per transaction).
    #[arg(long, env = "DATABASE_POOLER", default_value = "none")]
    pub database_pooler: PoolerArg,
    /// A direct connection to the same database (not through the pooler), for migrations and the relays'
    /// LISTEN behind a transaction pooler; also `DATABASE_DIRECT_URL_FILE`.
    #[arg(long, env = "DATABASE_DIRECT_URL", hide_env_values = true, value_parser = |s: &str| Ok::<_, String>(DatabaseUrl(s.to_owned())))]
    pub database_direct_url: Option<DatabaseUrl>,
    /// Longest ping, BEGIN or rollback of an abandoned transaction on one connection: a connection that
    /// does not answer within it (a failover that black-holes connections) is closed and replaced.
    #[arg(long, env = "DATABASE_STEP_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    pub database_step_timeout: Duration,
    /// Largest number of pooled database connections.
    #[arg(long, env = "DATABASE_MAX_CONNECTIONS", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub database_max_connections: u32,
}

/// How the database is reached (`DATABASE_POOLER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PoolerArg {
    /// Directly, or through a session pooler.
    None,
    /// Through a transaction pooler (PgBouncer `pool_mode = transaction`).
    Transaction,
}

/// Kafka settings shared by the consumer and the relay.
#[derive(Debug, Clone, Args)]
pub struct KafkaArgs {
    /// Kafka bootstrap servers (host:port,…).
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub kafka_brokers: String,
    /// Topic payment events are published to (through the outbox).
    #[arg(long, env = "KAFKA_PAYMENTS_TOPIC", default_value = "payments")]
    pub payments_topic: String,
    /// Partitions of the topics idem creates when they are missing.
    #[arg(long, env = "KAFKA_TOPIC_PARTITIONS", default_value_t = 6, value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub topic_partitions: i32,
    /// Replication factor of the topics idem creates: `auto` (3 where the cluster has 3 brokers or more,
    /// else one per broker) or a number.
    #[arg(long, env = "KAFKA_REPLICATION_FACTOR", default_value = "auto")]
    pub replication_factor: idem_kafka::admin::Replication,
    /// A librdkafka properties file (`key=value` lines, as Kafka's and librdkafka's tools read):
    /// `security.protocol`, `ssl.ca.location`, `sasl.mechanism`, `sasl.username`, … applied to every Kafka
    /// client idem creates. Properties idem's guarantees rest on (`acks`, `enable.idempotence`,
    /// `isolation.level`, `enable.auto.commit`, `group.id`, …) are refused at start.
    #[arg(long, env = "KAFKA_CONFIG_FILE")]
    pub kafka_config_file: Option<std::path::PathBuf>,
    /// SASL password (`sasl.password`), for a properties file that is not itself a secret; also read from
    /// the file named by `KAFKA_SASL_PASSWORD_FILE`.
    #[arg(long, env = "KAFKA_SASL_PASSWORD", hide_env_values = true, value_parser = |s: &str| Ok::<_, String>(Secret(s.to_owned())))]
    pub kafka_sasl_password: Option<Secret>,
}

impl KafkaArgs {
    /// The cluster with the deployment's properties: the properties file, then the SASL password. An
    /// unreadable file or a refused property is an error that names the file or the property, never a value.
    pub fn connection(&self) -> anyhow::Result<idem_kafka::KafkaConnection> {
        let mut connection = idem_kafka::KafkaConnection::new(&self.kafka_brokers);
        if let Some(path) = &self.kafka_config_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("KAFKA_CONFIG_FILE: cannot read {}: {}", path.display(), e.kind()))?;
            connection = connection
                .with_properties(&text)
                .map_err(|e| anyhow::anyhow!("KAFKA_CONFIG_FILE {}: {e}", path.display()))?;
        }
        if let Some(password) = &self.kafka_sasl_password {
            connection = connection.with_property("sasl.password", &password.0)?;
        }
        Ok(connection)
    }
}

/// The order-event stream: its topic, dead-letter topic and consumer group (`idem serve`, `idem dlq`).
#[derive(Debug, Clone, Args)]
pub struct OrdersArgs {
    /// Topic of incoming order events.
    #[arg(long, env = "KAFKA_ORDERS_TOPIC", default_value = "orders")]
    pub orders_topic: String,
    /// Dead-letter topic of the order consumer (default: `<orders topic>.dlq`).
    #[arg(long, env = "KAFKA_DLQ_TOPIC")]
    pub dlq_topic: Option<String>,
    /// Consumer group of the order-event consumer.
    #[arg(long, env = "KAFKA_GROUP_ID", default_value = "payment-service")]
    pub group_id: String,
}

impl OrdersArgs {
    pub fn dlq_topic(&self) -> String {
        self.dlq_topic.clone().unwrap_or_else(|| format!("{}.dlq", self.orders_topic))
    }
}

/// Outbox relay settings.
#[derive(Debug, Clone, Args)]
pub struct RelayArgs {
    /// Most outbox rows claimed and published per round.
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 2000, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub outbox_batch_size: i64,
    /// Polling fallback of the relay when no NOTIFY arrives.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub outbox_poll_interval: Duration,
    /// Shortest time between two relay claims started by commits: one claim serves every commit in between.
    #[arg(long, env = "OUTBOX_MIN_CLAIM_INTERVAL", default_value = "50ms", value_parser = parse_duration)]
    pub outbox_min_claim_interval: Duration,
    /// How long the relay's producer waits to fill a batch (`linger.ms`).
    #[arg(long, env = "OUTBOX_LINGER", default_value = "1ms", value_parser = parse_duration)]
    pub outbox_linger: Duration,
    /// How often the outbox table is vacuumed: the relay deletes what it publishes, and the claims scan
    /// the dead index entries until VACUUM removes them (autovacuum comes at most once a minute).
    #[arg(long, env = "OUTBOX_VACUUM_INTERVAL", default_value = "5s", value_parser = parse_vacuum_interval)]
    pub outbox_vacuum_interval: Duration,
    /// Outbox rounds in flight at once (each claims distinct keys, so per-key order holds).
    #[arg(long, env = "OUTBOX_CONCURRENCY", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub outbox_concurrency: u32,
}

/// `idem relay` settings: the outbox relay alone.
#[derive(Debug, Clone, Args)]
pub struct RelayOnlyArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub kafka: KafkaArgs,
    #[command(flatten)]
    pub relay: RelayArgs,
    /// Log as JSON lines instead of text.
    #[arg(long, env = "LOG_JSON", default_value_t = false)]
    pub log_json: bool,
}

/// How fast a cleanup round deletes: rows per statement and the pause between statements that leaves room
/// to the traffic (`idem serve`'s cleaner and `idem cleanup --once`). Smaller batches and longer pauses
/// lower the charges' p99 during a large round and make it take longer (BENCHMARKS.md, "At size").
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct CleanupPace {
    /// Rows per DELETE statement.
    #[arg(id = "cleanup_batch_size", long = "cleanup-batch-size", env = "CLEANUP_BATCH_SIZE", default_value_t = 5000, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub batch_size: i64,
    /// Pause between two DELETE statements of a round (at most 1s: a round of 10,000 batches must still end).
    #[arg(id = "cleanup_pause", long = "cleanup-pause", env = "CLEANUP_PAUSE", default_value = "5ms", value_parser = parse_cleanup_pause)]
    pub pause: Duration,
}

impl CleanupPace {
    /// The cleaner's settings at this pace.
    pub fn settings(&self) -> idem_postgres::cleanup::CleanupSettings {
        idem_postgres::cleanup::CleanupSettings {
            batch_size: self.batch_size,
            pause: self.pause,
            max_clock_skew: idem_domain::ADMISSION_MARGIN,
            ..idem_postgres::cleanup::CleanupSettings::default()
        }
    }
}

/// `idem serve` settings.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub kafka: KafkaArgs,
    #[command(flatten)]
    pub relay: RelayArgs,
    #[command(flatten)]
    pub provider: ProviderArgs,
    /// Address the HTTP API listens on.
    #[arg(long, env = "HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http_addr: SocketAddr,
    /// Address of the admin listener: `/readyz`, `/metrics` and `/healthz`. Keep it off the public network.
    #[arg(long, env = "ADMIN_ADDR", default_value = "127.0.0.1:9090")]
    pub admin_addr: SocketAddr,
    /// API keys: `merchant_a:key_a,merchant_b:key_b`.
    #[arg(long, env = "IDEM_API_KEYS", default_value = "", value_parser = ApiKeysParser, hide_default_value = true, hide_env_values = true)]
    pub api_keys: ApiKeys,
    #[command(flatten)]
    pub orders: OrdersArgs,
    /// Most messages per consumer transaction (1 = one transaction per message).
    #[arg(long, env = "KAFKA_BATCH_SIZE", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub batch_size: u32,
    /// Longest wait to fill a consumer batch.
    #[arg(long, env = "KAFKA_BATCH_TIMEOUT", default_value = "20ms", value_parser = parse_duration)]
    pub batch_timeout: Duration,
    /// Attempts of an event refused by a business rule before it is dead-lettered.
    #[arg(long, env = "KAFKA_MAX_REJECTIONS", default_value_t = 3)]
    pub max_rejections: u32,
    /// Consumer group session timeout.
    #[arg(long, env = "KAFKA_SESSION_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub session_timeout: Duration,
    /// Longest time between two polls before the consumer leaves its group (it rejoins by itself).
    #[arg(long, env = "KAFKA_MAX_POLL_INTERVAL", default_value = "300s", value_parser = parse_duration)]
    pub max_poll_interval: Duration,
    /// Merchant that payments created from order events belong to.
    #[arg(long, env = "ORDERS_MERCHANT_ID", default_value = "orders")]
    pub orders_merchant_id: String,
    /// How long idempotency records are kept (24h to 72h).
    #[arg(long, env = "IDEMPOTENCY_TTL", default_value = "48h", value_parser = parse_ttl)]
    pub idempotency_ttl: TtlPolicy,
    /// How long processed-event rows are kept (24h to 72h).
    #[arg(long, env = "DEDUP_TTL", default_value = "72h", value_parser = parse_ttl)]
    pub dedup_ttl: TtlPolicy,
    /// Where processed events live: `table` (batched deletes) or `partitioned` (daily partitions on the
    /// event id's UUID v7 time, dropped whole when expired; needs v7 event ids).
    #[arg(long, env = "DEDUP_STORAGE", value_enum, default_value = "table")]
    pub dedup_storage: DedupStorageArg,
    /// Setting changes accepted deliberately although they re-open processed events (`dedup-storage`,
    /// `consumer-group`; comma-separated). Without it `serve` refuses them (README, "Changing settings").
    #[arg(long, env = "IDEM_ACCEPT_SETTING_CHANGE", value_delimiter = ',')]
    pub accept_setting_change: Vec<String>,
    /// How often expired rows are deleted.
    #[arg(long, env = "CLEANUP_INTERVAL", default_value = "6h", value_parser = parse_duration)]
    pub cleanup_interval: Duration,
    #[command(flatten)]
    pub cleanup: CleanupPace,
    /// How long a duplicate request waits for the first one with its key to finish.
    #[arg(long, env = "IDEMPOTENCY_WAIT", default_value = "2s", value_parser = parse_duration)]
    pub idempotency_wait: Duration,
    /// How long an attempt holds a request between the phases of a call to another system without renewing
    /// its lease (renewed every third of it while the call runs); after it lapses a retry takes over.
    #[arg(long, env = "IDEMPOTENCY_LEASE", default_value = "30s", value_parser = parse_duration)]
    pub idempotency_lease: Duration,
    /// Status answered when a key is reused with a different request.
    #[arg(long, env = "IDEMPOTENCY_CONFLICT_STATUS", value_enum, default_value = "409")]
    pub conflict_status: ConflictStatus,
    /// `off` runs the POST routes in a plain transaction without idempotency keys: only for measuring
    /// what the layer costs. Never run a real service with it.
    #[arg(long, env = "IDEMPOTENCY_LAYER", value_enum, default_value = "on")]
    pub idempotency_layer: LayerSwitch,
    /// Longest time a client may take to send a request head; also how long an idle keep-alive connection
    /// is kept (slow or half-sent requests are disconnected).
    #[arg(long, env = "HTTP_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub http_header_read_timeout: Duration,
    /// Longest wait for the first byte of a new connection (capped by HTTP_HEADER_READ_TIMEOUT): sockets
    /// that open and send nothing hold a connection slot only this long.
    #[arg(long, env = "HTTP_FIRST_BYTE_TIMEOUT", default_value = "3s", value_parser = parse_duration)]
    pub http_first_byte_timeout: Duration,
    /// Longest time a client may take to send a request body (nothing runs before it is complete).
    #[arg(long, env = "HTTP_BODY_READ_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub http_body_read_timeout: Duration,
    /// When a retry of a completed key is answered from one read before claiming: `adaptive` (while
    /// replays are over a tenth of recent requests: a retry storm), `always`, or `never`.
    #[arg(long, env = "IDEMPOTENCY_REPLAY_FAST_PATH", default_value = "adaptive")]
    pub idempotency_replay_fast_path: FastPathArg,
    /// Longest time from a complete request head to its response: a request not answered by then gets 503
    /// and is dropped (its transaction rolls back unless the commit was under way: retry with the same key).
    #[arg(long, env = "HTTP_REQUEST_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub http_request_timeout: Duration,
    /// Most HTTP connections open at once on each listener; further clients wait in the listen backlog.
    #[arg(long, env = "HTTP_MAX_CONNECTIONS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub http_max_connections: u32,
    /// Longest graceful drain after SIGINT/SIGTERM before the process exits anyway.
    #[arg(long, env = "SHUTDOWN_TIMEOUT", default_value = "20s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
    /// Log as JSON lines instead of text.
    #[arg(long, env = "LOG_JSON", default_value_t = false)]
    pub log_json: bool,
    /// Most requests of one merchant in progress at once; beyond it, 429 with Retry-After.
    #[arg(long, env = "MERCHANT_CONCURRENCY", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub merchant_concurrency: u32,
    /// New Idempotency-Keys one merchant may store per second (a token bucket; 0: no bound). Every
    /// executed request's answer is kept for IDEMPOTENCY_TTL, so without a bound one merchant resending
    /// under new keys can grow the table without limit; beyond it, 429 with Retry-After (nothing stored).
    /// Retries of known keys take no token.
    #[arg(long, env = "MERCHANT_NEW_KEYS_PER_SECOND", default_value_t = 100, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub merchant_new_keys_per_second: u32,
    /// Most new keys one merchant may store at once above that rate.
    #[arg(long, env = "MERCHANT_NEW_KEYS_BURST", default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub merchant_new_keys_burst: u32,
    /// Connections of a second pool reserved for the consumer, the relay, the cleaner and readiness, so
    /// HTTP load can never starve them (nor they HTTP, which keeps DATABASE_MAX_CONNECTIONS).
    #[arg(long, env = "DATABASE_BACKGROUND_CONNECTIONS", default_value_t = 8, value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub background_connections: u32,
}

impl ServeArgs {
    /// Checks what the parsers alone cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_poll_interval < self.session_timeout {
            return Err("KAFKA_MAX_POLL_INTERVAL must be at least KAFKA_SESSION_TIMEOUT".into());
        }
        if self.api_keys.is_empty() {
            return Err("IDEM_API_KEYS is empty: configure at least one merchant:key pair".into());
        }
        if self.idempotency_wait > Duration::from_secs(30) || self.idempotency_wait.is_zero() {
            return Err("IDEMPOTENCY_WAIT must be between 1ms and 30s".into());
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&self.idempotency_lease) {
            return Err("IDEMPOTENCY_LEASE must be between 1s and 1h (longer than any foreign call's bound)".into());
        }
        if self.http_header_read_timeout.is_zero()
            || self.http_body_read_timeout.is_zero()
            || self.http_request_timeout.is_zero()
        {
            return Err(
                "HTTP_HEADER_READ_TIMEOUT, HTTP_BODY_READ_TIMEOUT and HTTP_REQUEST_TIMEOUT must be positive".into()
            );
        }
        self.provider.validate(self.http_request_timeout)?;
        if self.provider.payment_provider_url.is_some() && self.idempotency_lease <= self.provider.call_bound() {
            return Err(
                "IDEMPOTENCY_LEASE must be longer than PAYMENT_PROVIDER_TIMEOUT plus one second: a call starts only while its attempt holds that much of its lease"
                    .into(),
            );
        }
        if self.cleanup_interval < Duration::from_secs(1) {
            return Err("CLEANUP_INTERVAL must be at least 1s".into());
        }
        if self.batch_timeout > Duration::from_secs(10) {
            return Err("KAFKA_BATCH_TIMEOUT must be at most 10s".into());
        }
        let topics = [&self.orders.orders_topic, &self.kafka.payments_topic];
        if topics.iter().any(|t| {
            t.is_empty()
                || t.len() > 249
                || !t.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        }) {
            return Err("topic names must be 1-249 characters of a-z, A-Z, 0-9, '.', '_' or '-'".into());
        }
        if self.api_keys.has_merchant(&self.orders_merchant_id) {
            // Payments from order events and an API merchant's would share one key scope and one set of
            // provider payment ids, and order cancellations would refund that merchant's payments.
            return Err(format!(
                "ORDERS_MERCHANT_ID '{}' is also an API merchant in IDEM_API_KEYS: payments created from order \
                 events must belong to a merchant of their own",
                self.orders_merchant_id
            ));
        }
        if self.orders.orders_topic == self.kafka.payments_topic {
            return Err("KAFKA_ORDERS_TOPIC and KAFKA_PAYMENTS_TOPIC must differ".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted() {
        assert_eq!(redact_url("postgres://u:secret@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
    }

    #[test]
    fn ttl_outside_range_is_refused_with_the_rule() {
        let err = parse_ttl("12h").expect_err("too short");
        assert!(err.contains("between 24h and 72h"), "{err}");
        assert!(parse_ttl("73h").is_err());
        assert!(parse_ttl("48h").is_ok());
        assert!(parse_ttl("forever").is_err());
    }
}

//! PostgreSQL adapter (sqlx): implements the unit of work and every repository port.
//!
//! API boundary: [`PgStore`] (a [`TransactionManager`]) and [`PgUnitOfWork`]. sqlx types stay inside; its
//! errors are mapped to [`StoreError`] here, constraint violations by SQLSTATE and constraint name.
//! Queries are compile-time checked (`query!`), with the offline data in `.sqlx/` so building needs no
//! database.
//!
//! # What it stores where
//!
//! [`PgStore::migrate`] installs these tables in the application's schema (`adapters-postgres/migrations/`,
//! recorded in `_sqlx_migrations`). Every row is written in the unit of work of the effect it records.
//!
//! | table | one row per | columns | kept |
//! | --- | --- | --- | --- |
//! | `idempotency_record` | (scope, key) of an HTTP request or an `idem::Idempotent` call | `scope`, `key`, `command_hash` (the fingerprint), `state` (`in_flight`, `completed`), `status_code`, `response_headers`, `response_body`, `created_at`, `expires_at`; between the phases of a foreign call `attempt`, `lease_until`, `recovery_point`, the request (`request_method`, `request_uri`, `request_content_type`, `request_body`), `completer_runs`, `parked_at`, `parked_reason` | the TTL (24–72 h) from completion; the cleaner deletes expired rows; parked rows stay until an operator acts |
//! | `processed_event` | (consumer group, `event_id`) applied | `consumer_name`, `event_id`, `topic`, `created_at`, `expires_at` | the dedup TTL from the event's time (`TtlPolicy::retain_until`); the cleaner |
//! | `processed_event_partitioned` | the same, when the dedup storage is partitioned | as above plus `event_time`, ranged by it | whole partitions dropped once expired |
//! | `outbox_message` | message to publish | `id` (the `event_id`), `seq`, `topic`, `aggregatetype`, `aggregateid` (the Kafka key; `NewOutboxMessage::aggregate_type`/`aggregate_id`), `type` (the `event_type` header), `payload`, `headers`, `saga_id`, `created_at`, `attempts`, `last_error`, `key_shard`, `quarantined_at` | until published (the relay deletes it), or quarantined for an operator |
//! | `saga_step` | (`saga_id`, step) run | `saga_id`, `step`, `outcome`, `created_at` | not cleaned up |
//! | `dlq_redrive` | dead letter re-driven by an operator | `dlq_topic`, `dlq_partition`, `dlq_offset`, `event_id`, `source_topic`, `reason`, `redriven_by`, `redriven_at`, `admitted_late` | not cleaned up (an audit) |
//! | `late_admission` | event admitted past the dedup window | `consumer`, `event_id`, `admitted_by`, `admitted_at`, `applied_at` | not cleaned up |
//! | `idem_setting` | setting a consumer or cleaner checked at start | `name`, `value`, `previous`, `changed_at` | current values |

#![warn(missing_docs)]

pub mod cleanup;
mod error;
pub mod guard;
pub mod operations;
mod replication;
mod repos;
mod servers;
mod txpool;
mod wakeup;

use std::time::Duration;

use async_trait::async_trait;
use idem_ports::{
    IdempotencyRecord, IdempotencyRepository, OutboxRepository, PaymentRepository, PaymentUnitOfWork,
    ProcessedEventRepository, ProjectionRepository, SagaStepRepository, StoreError, TransactionManager, UnitOfWork,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};

pub use error::{is_transient_sqlstate, map_sqlx_error};
pub use repos::outbox::{OUTBOX_KEY_SHARDS, SHARDS_PER_CLAIM};
pub use wakeup::{NOTIFY_DEBOUNCE, OUTBOX_CHANNEL, OutboxSignal, PgOutboxWakeup};

/// idem's own tables (`adapters-postgres/migrations/`): idempotency records, processed events, the outbox,
/// saga steps, operators' records, settings. What [`PgStore::migrate`] installs for a toolkit user.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Pool settings.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// Most connections for units of work (size it for concurrent committers: group commit needs them).
    /// Other queries (health checks, cleanup batches, notifications) use a second pool of 2 to 4.
    pub max_connections: u32,
    /// How long a caller waits for a free connection before getting [`StoreError::Unavailable`].
    pub acquire_timeout: Duration,
    /// `statement_timeout` of every session: no statement holds a pooled connection longer.
    pub statement_timeout: Duration,
    /// `idle_in_transaction_session_timeout`: a transaction left open and idle (a stuck caller) is ended
    /// by the server and its connection freed. Longer than the relay's wait for delivery reports.
    pub idle_in_transaction_timeout: Duration,
    /// A connection handed out after resting in the pool longer than this is pinged first (one round
    /// trip), so one that died while idle (server restart, a proxy's idle timeout) is replaced before use.
    /// One back sooner is handed out as is: under load every transaction would otherwise pay a round trip
    /// (sqlx's `test_before_acquire` pings on every acquire; a charge is six round trips without it).
    pub ping_after_idle: Duration,
    /// Connections of units of work older than this are closed and replaced when next taken (long-lived
    /// server processes accumulate caches).
    pub max_lifetime: Duration,
    /// Longest time one step of taking, beginning or returning a connection may take: the ping of a rested
    /// connection, `BEGIN`, the rollback of an abandoned transaction, the check on release. A connection
    /// that does not answer within it (a failover that black-holes connections: no RST, no FIN) is closed,
    /// and a reused one replaced by a new connection, so requests fail over within seconds and no pool
    /// slot waits for the kernel to give up (~15 min). sqlx 0.8 sets no TCP keepalive or user timeout on
    /// its sockets, so these bounds are the client's only ones.
    pub step_timeout: Duration,
    /// How the database is reached: directly, or through a transaction pooler.
    pub pooler: Pooler,
}

/// How the database is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooler {
    /// Directly, or through a session pooler: sessions keep their prepared statements and settings.
    #[default]
    None,
    /// Through a transaction pooler (PgBouncer `pool_mode = transaction`): a server connection belongs to
    /// the client only for one transaction. So every statement runs in an explicit transaction (sqlx's
    /// extended protocol spans two round trips, which the pooler may otherwise serve from two servers),
    /// which begins by removing the statements named like sqlx's that another client left on the server
    /// connection (they would collide with this one's; other statements are left alone) and sets what idem
    /// depends on with `SET LOCAL` — timeouts, `search_path`, `lock_timeout`, `synchronous_commit`,
    /// isolation — whatever another client's session set (no `options` startup parameter, no session
    /// state). No statement cache: each statement is prepared again in each transaction.
    Transaction,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            max_connections: 32,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(30),
            idle_in_transaction_timeout: Duration::from_secs(60),
            ping_after_idle: Duration::from_secs(1),
            max_lifetime: Duration::from_secs(30 * 60),
            step_timeout: Duration::from_secs(2),
            pooler: Pooler::None,
        }
    }
}

/// Where processed events are recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DedupStorage {
    /// `processed_event`, cleaned by batched deletes on `expires_at`.
    #[default]
    Table,
    /// `processed_event_partitioned`, daily partitions on the event id's v7 time, cleaned by dropping
    /// whole expired partitions.
    Partitioned,
}

/// A handle on the database: cheap to clone, shared by value.
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    /// Units of work take their connections here (see `txpool.rs`: no round trip on return).
    transactions: txpool::TxPool,
    dedup: DedupStorage,
    outbox_signal: OutboxSignal,
    /// Behind a transaction pooler: the statement every transaction begins with (see [`Pooler`]).
    begin_sql: Option<std::sync::Arc<str>>,
    /// A direct connection (not through the pooler) for migrations and LISTEN.
    direct: Option<DirectOptions>,
    /// The servers of the URL: the one every new connection goes to (see `servers.rs`).
    servers: servers::Servers,
    /// Whether replays must wait for a synchronous standby (see `replication.rs`).
    replication: replication::Memo,
}

/// Connect options of a direct connection; `Debug` never shows them (they hold the password).
#[derive(Clone)]
struct DirectOptions(servers::Servers);

impl std::fmt::Debug for DirectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DirectOptions")
    }
}

/// `BEGIN` with what a transaction pooler needs (see [`Pooler::Transaction`]): the transaction's own
/// settings, whatever another client of the server connection left in its session, and no statement
/// named like sqlx's left by another client (sqlx prepares named statements even with its cache off and
/// never closes them; removing only those leaves the statements other clients — or PgBouncer's own
/// `max_prepared_statements` — rely on).
fn pooled_begin(settings: &PoolSettings) -> String {
    format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE; \
         DO $idem$ DECLARE s record; BEGIN \
           FOR s IN SELECT name FROM pg_prepared_statements WHERE name LIKE 'sqlx\\_s\\_%' LOOP \
             EXECUTE format('DEALLOCATE %I', s.name); \
           END LOOP; \
         END $idem$; \
         SET LOCAL statement_timeout = '{}ms'; \
         SET LOCAL idle_in_transaction_session_timeout = '{}ms'; \
         SET LOCAL search_path TO DEFAULT; SET LOCAL lock_timeout TO DEFAULT; \
         SET LOCAL synchronous_commit TO DEFAULT",
        settings.statement_timeout.as_millis(),
        settings.idle_in_transaction_timeout.as_millis()
    )
}

/// The URL parameters sqlx reads; it logs any other with its value ("ignoring unrecognized connect
/// parameter … value=…"), which printed an `sslpassword` in clear.
const SQLX_PARAMETERS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// `url` without the parameters sqlx does not read, each named (never its value) in a warning; an
/// `sslpassword` (the passphrase of an encrypted client key, which rustls cannot use) is refused.
fn supported_parameters(url: &str) -> Result<std::borrow::Cow<'_, str>, StoreError> {
    let Some((base, query)) = url.split_once('?') else { return Ok(url.into()) };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let key = pair.split_once('=').map_or(pair, |(k, _)| k);
        if SQLX_PARAMETERS.contains(&key) {
            kept.push(pair);
        } else if key.eq_ignore_ascii_case("sslpassword") {
            return Err(StoreError::Other(
                "invalid database url: `sslpassword` is not supported (an encrypted client key); give `sslkey` an \
                 unencrypted key readable only by the service"
                    .into(),
            ));
        } else {
            tracing::warn!(parameter = %key, "database url parameter not supported: ignored");
        }
    }
    Ok(if kept.is_empty() { base.to_owned().into() } else { format!("{base}?{}", kept.join("&")).into() })
}

/// `options` with the session settings of `settings`: behind a transaction pooler no statement cache (the
/// timeouts travel with every BEGIN instead: it refuses or drops the `options` startup parameter); else
/// the session timeouts and TCP keepalives as startup options.
fn with_session_settings(options: PgConnectOptions, settings: &PoolSettings) -> PgConnectOptions {
    match settings.pooler {
        Pooler::Transaction => options.statement_cache_capacity(0),
        Pooler::None => options.options([
            ("statement_timeout", format!("{}ms", settings.statement_timeout.as_millis())),
            ("idle_in_transaction_session_timeout", format!("{}ms", settings.idle_in_transaction_timeout.as_millis())),
            // the server's side of a black-holed connection: its backend is freed within a minute
            ("tcp_keepalives_idle", "30".to_owned()),
            ("tcp_keepalives_interval", "10".to_owned()),
            ("tcp_keepalives_count", "3".to_owned()),
            ("tcp_user_timeout", "30000".to_owned()),
        ]),
    }
}

/// A transaction pooler (PgBouncer) refuses the `options` startup parameter idem sends with its session
/// timeouts; its error (`08P01: unsupported startup parameter: options`) does not say what to do.
fn pooler_hint(e: StoreError) -> StoreError {
    let text = e.to_string();
    if text.contains("unsupported startup parameter") {
        StoreError::Other(format!(
            "{text}: the server is a connection pooler (PgBouncer) — set DATABASE_POOLER=transaction (and \
             DATABASE_DIRECT_URL to a direct connection for migrations and LISTEN)"
        ))
    } else {
        e
    }
}

fn parse_url(url: &str) -> Result<PgConnectOptions, StoreError> {
    supported_parameters(url)?.parse().map_err(|e: sqlx::Error| StoreError::Other(format!("invalid database url: {e}")))
}

impl PgStore {
    /// Connects lazily-validated: fails fast if the URL is malformed or the server unreachable.
    ///
    /// Every connection honours libpq's URL parameters `sslmode` (`disable` … `verify-full`),
    /// `sslrootcert`, `sslcert` and `sslkey` (TLS through rustls; with `verify-ca`/`verify-full` and no
    /// `sslrootcert`, the system's trust store).
    ///
    /// A URL may name several servers, as libpq's do (`postgres://u@h1:5432,h2:5432/db?target_session_attrs=
    /// read-write&connect_timeout=3`): every new connection goes to the first that answers and matches
    /// `target_session_attrs` (`any`, `read-write`, `read-only`, `primary`, `standby`, `prefer-standby`),
    /// trying the one found last first; after a failover, connections to the old server are closed instead
    /// of reused.
    pub async fn connect(url: &str, settings: &PoolSettings) -> Result<Self, StoreError> {
        let servers = servers::Servers::parse(url, parse_url)?.map(|options| with_session_settings(options, settings));
        // the server to start on: the first that answers and matches (several hosts, or a session requirement)
        servers.resolve().await;
        let options = servers.current();
        let (ping_after_idle, step) = (settings.ping_after_idle, settings.step_timeout);
        // units of work have their own pool (`txpool.rs`); this one serves health checks, cleanup batches,
        // notifications and operators' queries: a few connections at most
        let pool = PgPoolOptions::new()
            .max_connections(settings.max_connections.clamp(2, 4))
            .acquire_timeout(settings.acquire_timeout)
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > ping_after_idle {
                        // a connection that does not answer is replaced (sqlx closes it)
                        return Ok(matches!(tokio::time::timeout(step, conn.ping()).await, Ok(Ok(()))));
                    }
                    Ok(true)
                })
            })
            // sqlx pings every connection it takes back, without a bound: checked here first, within the
            // step bound, so a frozen connection is closed instead of holding its slot for ever
            .after_release(move |conn, _| {
                Box::pin(async move { Ok(matches!(tokio::time::timeout(step, conn.ping()).await, Ok(Ok(())))) })
            })
            .connect_with(options)
            .await
            .map_err(|e| pooler_hint(map_sqlx_error(e)))?;
        servers.follow(&pool);
        Ok(Self::with_settings(pool, servers, settings))
    }

    /// A store on an existing pool (tests), for the queries that are not units of work; units of work get
    /// a pool of their own with the same connection options, of at most `transactions` connections. The
    /// store can so hold `pool`'s connections plus `transactions`: size both (it used to take the pool's
    /// size again, silently doubling it).
    pub fn from_pool(pool: PgPool, transactions: u32) -> Self {
        let settings = PoolSettings {
            max_connections: transactions,
            acquire_timeout: pool.options().get_acquire_timeout(),
            ..PoolSettings::default()
        };
        let servers = servers::Servers::single((*pool.connect_options()).clone());
        Self::with_settings(pool, servers, &settings)
    }

    fn with_settings(pool: PgPool, servers: servers::Servers, settings: &PoolSettings) -> Self {
        let begin_sql: Option<std::sync::Arc<str>> =
            (settings.pooler == Pooler::Transaction).then(|| pooled_begin(settings).into());
        let transactions = txpool::TxPool::new(
            servers.clone(),
            txpool::Bounds {
                max_connections: settings.max_connections,
                acquire_timeout: settings.acquire_timeout,
                ping_after_idle: settings.ping_after_idle,
                max_lifetime: settings.max_lifetime,
                step_timeout: settings.step_timeout,
            },
            begin_sql.clone(),
        );
        Self {
            outbox_signal: OutboxSignal::new(pool.clone(), begin_sql.clone()),
            pool,
            transactions,
            dedup: DedupStorage::Table,
            begin_sql,
            direct: None,
            servers,
            replication: replication::Memo::default(),
        }
    }

    /// A direct connection to the same database for migrations and the relays' `LISTEN`, which a
    /// transaction pooler cannot carry (session advisory lock, session settings, notifications).
    pub fn with_direct_url(mut self, url: &str) -> Result<Self, StoreError> {
        self.direct = Some(DirectOptions(servers::Servers::parse(url, parse_url)?));
        Ok(self)
    }

    /// The servers LISTEN connects to: the direct URL's, or the store's own (none behind a transaction
    /// pooler without a direct URL).
    pub(crate) fn listen_servers(&self) -> Option<servers::Servers> {
        match (&self.direct, &self.begin_sql) {
            (Some(direct), _) => Some(direct.0.clone()),
            (None, None) => Some(self.servers.clone()),
            (None, Some(_)) => None,
        }
    }

    /// A transaction on the small pool, for statements that are not a unit of work: behind a transaction
    /// pooler it begins as every transaction there must ([`Pooler::Transaction`]).
    pub(crate) async fn small_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
        match &self.begin_sql {
            Some(sql) => self.pool.begin_with(sql.to_string()).await,
            None => self.pool.begin().await,
        }
    }

    /// Raised after every commit that wrote outbox rows (see [`PgOutboxWakeup`]).
    pub fn outbox_signal(&self) -> &OutboxSignal {
        &self.outbox_signal
    }

    /// Records processed events in `storage`.
    pub fn with_dedup_storage(mut self, storage: DedupStorage) -> Self {
        self.dedup = storage;
        self
    }

    /// Where processed events are recorded.
    pub fn dedup_storage(&self) -> DedupStorage {
        self.dedup
    }

    /// The pool (for adapters' own queries and tests).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies idem's pending migrations ([`MIGRATOR`]: idem's tables only), on a connection of their own
    /// without the sessions' statement timeout (an index build may take longer); the connection is closed
    /// afterwards. Migrations an application recorded in the same `_sqlx_migrations` table are left alone.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        self.migrate_sets(&[&MIGRATOR]).await
    }

    /// Applies idem's migrations and then the application's (`sqlx::migrate!("./migrations")`), both
    /// recorded in the database's `_sqlx_migrations` table: idem's tables install beside the
    /// application's own. Application versions must not reuse idem's (dated `2026120…`); each migrator
    /// ignores the other's entries.
    ///
    /// Behind a transaction pooler ([`Pooler::Transaction`]) migrations need a session of their own (sqlx's
    /// session advisory lock, `SET statement_timeout`): they run on the direct connection
    /// ([`Self::with_direct_url`]); without one, pending migrations are an error that says so, and
    /// nothing is run through the pooler.
    pub async fn migrate_with(&self, application: Option<&sqlx::migrate::Migrator>) -> Result<(), StoreError> {
        match application {
            Some(application) => self.migrate_sets(&[&MIGRATOR, application]).await,
            None => self.migrate().await,
        }
    }

    /// The application's schema history first and then idem's ([`MIGRATOR`], whose statements find its
    /// tables in place): for an application whose own history created idem's tables along the way, as the
    /// reference payment service's (`migrations/` at the repository's root) did.
    pub async fn migrate_schema_first(&self, schema: &sqlx::migrate::Migrator) -> Result<(), StoreError> {
        self.migrate_sets(&[schema, &MIGRATOR]).await
    }

    async fn migrate_sets(&self, sets: &[&sqlx::migrate::Migrator]) -> Result<(), StoreError> {
        let servers = match (&self.direct, &self.begin_sql) {
            (Some(direct), _) => &direct.0,
            (None, None) => &self.servers,
            (None, Some(_)) => return self.check_migrated(sets).await,
        };
        let (mut conn, _) = servers.connect().await.map_err(map_sqlx_error)?;
        sqlx::raw_sql("SET statement_timeout = 0").execute(&mut conn).await.map_err(map_sqlx_error)?;
        let mut result = Ok(());
        for set in sets {
            // each migrator ignores the other's entries in the shared _sqlx_migrations table
            let migrator = sqlx::migrate::Migrator {
                migrations: std::borrow::Cow::Owned(set.migrations.to_vec()),
                ignore_missing: true,
                locking: true,
                no_tx: false,
            };
            result = migrator.run(&mut conn).await.map_err(|e| StoreError::Other(format!("migration failed: {e}")));
            if result.is_err() {
                break;
            }
        }
        let _ = conn.close().await;
        result
    }

    /// Behind a transaction pooler without a direct URL: fails when a migration is pending.
    async fn check_migrated(&self, sets: &[&sqlx::migrate::Migrator]) -> Result<(), StoreError> {
        let mut tx = self.small_tx().await.map_err(map_sqlx_error)?;
        let applied: Vec<(i64, Vec<u8>)> =
            sqlx::query_as("SELECT version, checksum FROM _sqlx_migrations WHERE success")
                .fetch_all(&mut *tx)
                .await
                .unwrap_or_default();
        let _ = tx.commit().await;
        let migrations =
            || sets.iter().flat_map(|m| m.migrations.iter()).filter(|m| m.migration_type.is_up_migration());
        let pending = migrations().filter(|m| !applied.iter().any(|(v, _)| *v == m.version)).count();
        if pending > 0 {
            return Err(StoreError::Other(format!(
                "{pending} migration(s) pending and the database is reached through a transaction pooler: set \
                 DATABASE_DIRECT_URL to a direct connection (migrations need a session of their own)"
            )));
        }
        // as sqlx's migrator does: an applied migration whose text changed since is refused
        if let Some(m) = migrations().find(|m| applied.iter().any(|(v, sum)| *v == m.version && **sum != *m.checksum)) {
            return Err(StoreError::Other(format!(
                "migration {} was applied with a different text (checksum mismatch): never edit an applied \
                 migration",
                m.version
            )));
        }
        Ok(())
    }

    /// Shares `other`'s outbox signal: commits through this store wake relays subscribed to `other` (a
    /// second pool for the same database, for example one reserved for background work).
    pub fn sharing_outbox_signal(mut self, other: &PgStore) -> Self {
        self.outbox_signal = other.outbox_signal.clone();
        self
    }

    /// Closes both pools: new units of work and queries are refused, idle connections closed.
    pub async fn close(&self) {
        self.transactions.close().await;
        self.pool.close().await;
    }

    /// Vacuums the outbox table, unless another session is vacuuming it (`SKIP_LOCKED`).
    ///
    /// The relay deletes every row it publishes, and new rows go to the right end of the `seq` index, so
    /// the entries of deleted rows stay on the index's left pages until VACUUM: each claim scans from the
    /// left and reads every such page. Autovacuum visits a database at most once a minute
    /// (`autovacuum_naptime`), by which time 1,000 charges/s have left ~60,000 dead entries, and the claims
    /// read hundreds of pages each (377 after 60,000 rows): most of a claim's cost (issue 12,
    /// BENCHMARKS.md). Vacuuming a table that holds only the rows in flight every few seconds costs a few
    /// milliseconds. `INDEX_CLEANUP ON`: the
    /// dead index entries are the point (VACUUM may otherwise skip the indexes when few heap pages have
    /// dead rows); the table never truncates (a migration sets `vacuum_truncate = false`: truncation takes
    /// an ACCESS EXCLUSIVE lock that would block the charges' inserts).
    pub async fn vacuum_outbox(&self) -> Result<(), StoreError> {
        // The table's schema-qualified name, read in a transaction that sets `search_path` (behind a
        // transaction pooler another client's session may have changed it): VACUUM runs outside any
        // transaction, on a server connection whose session settings are not idem's.
        let mut tx = self.small_tx().await.map_err(map_sqlx_error)?;
        let table: Option<String> = sqlx::query_scalar(
            "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass('outbox_message')",
        )
        .persistent(false)
        .fetch_optional(&mut *tx)
        .await
        .map_err(map_sqlx_error)?;
        tx.commit().await.map_err(map_sqlx_error)?;
        let table = table.ok_or_else(|| StoreError::Other("outbox_message does not exist: migrate first".into()))?;
        // simple protocol, no transaction (VACUUM cannot run in one): one round trip, fine through a pooler
        let vacuum = format!("VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON) {table}");
        sqlx::raw_sql(&vacuum).execute(&self.pool).await.map(|_| ()).map_err(map_sqlx_error)
    }

    /// Whether the database answers.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let pinged = sqlx::raw_sql("SELECT 1").execute(&self.pool).await.map(|_| ()).map_err(map_sqlx_error);
        if pinged.is_err() {
            // with several servers, the one in use may be gone: find the one to use now
            self.servers.resolve().await;
        }
        pinged
    }

    /// Begins a transaction, typed (for adapters' own use and tests).
    pub async fn begin_pg(&self) -> Result<PgUnitOfWork, StoreError> {
        // under a sampled span only: background work (relay claims, cleanup, readiness) makes no traces
        let span = if idem_ports::trace::current_sampled() {
            tracing::debug_span!(
                "unit of work",
                otel.kind = "internal",
                db.system.name = "postgresql",
                outcome = tracing::field::Empty
            )
        } else {
            tracing::Span::none()
        };
        let tx = self.transactions.begin().await.map_err(map_sqlx_error)?;
        Ok(PgUnitOfWork {
            span,
            tx,
            dedup: self.dedup,
            outbox_signal: self.outbox_signal.clone(),
            wrote_outbox: false,
            aborted: false,
            unchecked: false,
            replication: self.replication.clone(),
        })
    }
}

#[cfg(test)]
mod url_tests {
    /// Issue 38.5: sqlx logged an unsupported parameter with its value; `sslpassword=` was printed in clear.
    #[test]
    fn unsupported_parameters_never_reach_sqlx_and_an_sslpassword_is_refused() {
        let err = super::supported_parameters("postgres://u@h/db?sslmode=verify-full&sslpassword=s3cret_pw")
            .expect_err("refused");
        assert!(err.to_string().contains("sslpassword") && !err.to_string().contains("s3cret_pw"), "{err}");
        let kept = super::supported_parameters("postgres://u:pw@h/db?connect_timeout=5&sslmode=require&keepalives=1")
            .expect("kept");
        assert_eq!(kept, "postgres://u:pw@h/db?sslmode=require");
        assert_eq!(super::supported_parameters("postgres://h/db?x=1").expect("kept"), "postgres://h/db");
        assert_eq!(super::supported_parameters("postgres://h/db").expect("kept"), "postgres://h/db");
    }
}

#[async_trait]
impl TransactionManager for PgStore {
    async fn begin(&self) -> Result<Box<dyn UnitOfWork>, StoreError> {
        Ok(Box::new(self.begin_pg().await?))
    }

    /// Checked against `idem_setting` ([`guard`]).
    async fn check_consumer(
        &self,
        consumer: &idem_ports::ConsumerIdentity,
    ) -> Result<Option<idem_ports::RetentionRaise>, idem_ports::SettingsCheckError> {
        self.check_consumer_settings(consumer).await
    }

    /// One read on a pooled connection, no transaction. Behind a transaction pooler `None` (the full path):
    /// a statement outside a transaction may be served by two server connections there.
    async fn completed_record(&self, scope: &str, key: &str) -> Result<Option<IdempotencyRecord>, StoreError> {
        if self.begin_sql.is_some() {
            return Ok(None);
        }
        let mut conn = self.transactions.plain().await.map_err(map_sqlx_error)?;
        // bounded like every step on a connection: a black-holed one costs this, not the request's timeout
        let read = repos::idempotency::read_with_standby(conn.connection(), scope, key);
        let row = match tokio::time::timeout(self.transactions.step_timeout(), read).await {
            Ok(row) => row.map_err(map_sqlx_error)?,
            Err(_) => {
                self.transactions.discard_idle(); // and this one is dropped unreleased: closed
                return Err(map_sqlx_error(sqlx::Error::PoolTimedOut));
            }
        };
        conn.release();
        let Some((row, standby)) = row else { return Ok(None) };
        self.replication.found(standby); // what `confirm_replicated` then needs to know
        match row.into_record()? {
            record if record.state == idem_ports::IdempotencyState::Completed => Ok(Some(record)),
            _ => Ok(None),
        }
    }

    /// An autocommit statement whose commit waits for the synchronous standby (`replication.rs`), bounded
    /// by the step timeout: a standby that does not confirm is an unavailable store, never a silent pass.
    async fn confirm_replicated(&self) -> Result<(), StoreError> {
        if self.replication.no_standby() {
            return Ok(());
        }
        if self.begin_sql.is_some() {
            // behind a transaction pooler a statement outside a transaction meets whatever settings the
            // server connection's last client left (`search_path`): in a unit of work, which resets them
            let step = self.transactions.step_timeout();
            let barrier = async {
                let mut uow = self.begin_pg().await?;
                uow.confirm_replication().await?;
                Box::new(uow).commit().await
            };
            return tokio::time::timeout(step * 2, barrier).await.map_err(|_| unconfirmed(step * 2))?;
        }
        let mut conn = self.transactions.plain().await.map_err(map_sqlx_error)?;
        // `fetch_all` reads up to ReadyForQuery, which PostgreSQL sends after the commit's wait
        let barrier = sqlx::query_scalar::<_, bool>(replication::BARRIER)
            .bind(self.replication.slot())
            .fetch_all(conn.connection());
        let standby = match tokio::time::timeout(self.transactions.step_timeout(), barrier).await {
            Ok(rows) => !rows.map_err(map_sqlx_error)?.is_empty(),
            // the connection is dropped unreleased (closed); its backend goes on waiting, holding nothing
            Err(_) => return Err(unconfirmed(self.transactions.step_timeout())),
        };
        conn.release();
        self.replication.found(standby);
        Ok(())
    }
}

fn unconfirmed(bound: Duration) -> StoreError {
    StoreError::Unavailable(format!(
        "the synchronous standby did not confirm the stored answer within {} ms: it is not given until a standby \
         has it",
        bound.as_millis()
    ))
}

/// One PostgreSQL transaction. Dropping it uncommitted rolls back (before its connection can be reused).
#[derive(Debug)]
pub struct PgUnitOfWork {
    tx: txpool::TxConnection,
    dedup: DedupStorage,
    outbox_signal: OutboxSignal,
    /// Set by the outbox writes: the commit then wakes the relays (after the commit, never inside it).
    pub(crate) wrote_outbox: bool,
    /// A statement of idem's repositories failed in the database: the transaction is aborted.
    aborted: bool,
    /// The application had the connection ([`PgUnitOfWork::connection`]): its statements' errors are not
    /// seen here, so the commit checks the transaction first.
    unchecked: bool,
    /// The unit's span, from `BEGIN` to its end (`outcome`: committed, rolled back, refused; none when dropped:
    /// rolled back). A debug span: exported when tracing is on, free otherwise.
    span: tracing::Span,
    replication: replication::Memo,
}

impl PgUnitOfWork {
    /// The open transaction's connection: run the application's own sqlx queries (`query!`, `query_as!`,
    /// …) on it. They commit or roll back together with idem's bookkeeping in this unit (idempotency
    /// record, processed-event row, outbox rows).
    ///
    /// A statement that fails aborts the whole transaction in PostgreSQL, and a `COMMIT` after that is
    /// answered as a rollback without an error. So once the application had the connection, the commit
    /// first checks that the transaction is still alive (one `SELECT 1`) and fails if it is not: an
    /// application that swallowed an error of its own SQL never has its unit reported as committed.
    pub fn connection(&mut self) -> &mut sqlx::PgConnection {
        self.unchecked = true;
        self.tx.connection()
    }

    /// The connection for idem's own repositories, which report every error they meet ([`Self::failed`]).
    pub(crate) fn db(&mut self) -> &mut sqlx::PgConnection {
        self.tx.connection()
    }

    /// Maps a repository's error and remembers that the transaction may be aborted: a caller that swallows
    /// the error and commits is told the commit failed.
    pub(crate) fn failed(&mut self, e: sqlx::Error) -> StoreError {
        if matches!(e, sqlx::Error::Database(_)) {
            self.aborted = true;
        }
        map_sqlx_error(e)
    }

    /// The PostgreSQL unit of work behind `uow` — the one idem's idempotency layer (`Tx::uow`) or consumer
    /// runner (`EventHandler::handle`) hands the application. Fails only when `uow` comes from another
    /// store.
    pub fn of(uow: &mut dyn UnitOfWork) -> Result<&mut PgUnitOfWork, StoreError> {
        uow.as_any_mut()
            .downcast_mut::<PgUnitOfWork>()
            .ok_or_else(|| StoreError::Other("the unit of work is not a PostgreSQL one".into()))
    }
}

#[async_trait::async_trait]
impl PaymentUnitOfWork for PgUnitOfWork {
    fn payments(&mut self) -> &mut dyn PaymentRepository {
        self
    }
    fn projections(&mut self) -> &mut dyn ProjectionRepository {
        self
    }
    async fn insert_announced(
        &mut self,
        payment: &idem_ports::NewPayment,
        announcement: &idem_ports::NewOutboxMessage,
    ) -> Result<idem_ports::PaymentInsert, StoreError> {
        self.insert_announced_pg(payment, announcement).await
    }
}

/// The payment service's repositories in the PostgreSQL unit of work idem's layer or runner began
/// ([`idem_ports::PaymentsOf`]).
pub fn payments_of(uow: &mut dyn UnitOfWork) -> Result<&mut dyn PaymentUnitOfWork, StoreError> {
    Ok(PgUnitOfWork::of(uow)?)
}

#[async_trait]
impl UnitOfWork for PgUnitOfWork {
    fn idempotency(&mut self) -> &mut dyn IdempotencyRepository {
        self
    }
    fn processed_events(&mut self) -> &mut dyn ProcessedEventRepository {
        self
    }
    fn outbox(&mut self) -> &mut dyn OutboxRepository {
        self
    }
    fn saga_steps(&mut self) -> &mut dyn SagaStepRepository {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    async fn commit(self: Box<Self>) -> Result<(), StoreError> {
        let Self { mut tx, outbox_signal, wrote_outbox, aborted, unchecked, span, .. } = *self;
        // PostgreSQL answers COMMIT of an aborted transaction with the tag ROLLBACK and no error, and sqlx
        // does not read the tag: a unit whose error was swallowed would be reported as committed.
        let alive = !aborted && (!unchecked || sqlx::query("SELECT 1").execute(tx.connection()).await.is_ok());
        if !alive {
            let _ = tx.rollback().await;
            span.record("outcome", "refused");
            return Err(StoreError::Other(
                "SQLSTATE 25P02 (in_failed_sql_transaction): the transaction was aborted by an earlier failed \
                 statement whose error was not returned: rolled back, nothing committed"
                    .into(),
            ));
        }
        let committed = tx.commit().await;
        span.record("outcome", if committed.is_ok() { "committed" } else { "commit failed" });
        committed.map_err(map_sqlx_error)?;
        if wrote_outbox {
            outbox_signal.committed();
        }
        Ok(())
    }
    async fn rollback(self: Box<Self>) -> Result<(), StoreError> {
        self.span.record("outcome", "rolled back");
        self.tx.rollback().await.map_err(map_sqlx_error)
    }

    /// One statement in this transaction: with a synchronous standby configured it writes a barrier row,
    /// so the commit writes WAL after everything this unit read and waits for the standby
    /// (`replication.rs`). The commit is then bounded like any: a caller that gives up never answers.
    async fn confirm_replication(&mut self) -> Result<(), StoreError> {
        if self.replication.no_standby() {
            return Ok(());
        }
        let slot = self.replication.slot();
        let rows = sqlx::query_scalar::<_, bool>(replication::BARRIER).bind(slot).fetch_all(self.db()).await;
        let standby = !rows.map_err(|e| self.failed(e))?.is_empty();
        self.replication.found(standby);
        Ok(())
    }
}

//! Deletes expired rows: idempotency records and processed events (the relay deletes published outbox rows
//! itself, in the round that published them).
//!
//! Each round takes a transaction-scoped advisory lock, held by a transaction of its own for the round, so
//! only one instance cleans at a time and nothing outlives the round on a pooled connection (a crash frees
//! it with the connection). Then it deletes per table in
//! bounded batches (`DELETE … WHERE key IN (SELECT … WHERE expires_at <= now ORDER BY expires_at LIMIT n
//! FOR UPDATE SKIP LOCKED)`): every batch is its own short transaction found through the `expires_at`
//! index, so no statement holds locks or produces WAL for long, and rows in use are skipped.
//!
//! # Retention and cleanup
//!
//! Every expiring row carries `expires_at`, indexed: idempotency records (the layer's TTL, 24–72 h),
//! processed events (the runner's `dedup_ttl`, 24–72 h); published outbox rows are deleted by the relay. `TtlPolicy` refuses
//! anything outside 24–72 h at start-up. The cleaner (`Cleaner`, run by the facade's `Background::cleaner`
//! on an interval; `idem serve` every `CLEANUP_INTERVAL`) takes a transaction-scoped advisory lock in a
//! transaction of its own that lives for the round (one cleaner at a time across instances; nothing survives the
//! round on a pooled connection), then per table deletes in batches of 5,000 found through the `expires_at` index
//! (`DELETE … WHERE key IN (SELECT … ORDER BY expires_at LIMIT n FOR UPDATE SKIP LOCKED)`): each batch is its
//! own short transaction, so no statement holds locks or builds WAL for long, and rows in use are skipped. A
//! failed round is logged and counted; the next one runs on schedule. The high-churn tables get per-table
//! autovacuum settings (scale factor 0.02) and `n_dead_tup` is exported as `idem_cleanup_dead_tuples`.
//!
//! ## Scale-out: partitioned dedup table (`DEDUP_STORAGE=partitioned`)
//!
//! `processed_event_partitioned` is range-partitioned by day on `event_time = uuid_v7_time(event_id)`, the
//! millisecond timestamp inside the UUID v7 event id. The partition column must be part of the primary key
//! (`(consumer_name, event_id, event_time)`); because it is a pure function of the event id, a redelivered
//! event always computes the same `event_time`, lands in the same partition, and still conflicts — the key is
//! as unique as `(consumer_name, event_id)`. The cleaner creates partitions ahead (3 days) and behind (the TTL
//! window, never a day it would drop), and detaches and drops every partition whose whole day ended more than
//! the TTL ago — a catalog operation instead of millions of row deletes. Partition DDL runs in a transaction under
//! `SET LOCAL lock_timeout = '2s'`. Event ids more than 24 h ahead are dead-lettered (`future-dated-event-id`),
//! so no far-future row blocks creating its day's partition later. Non-v7 ids (v4 is accepted) map to the epoch and land in the
//! default partition, which is cleaned row by row; so do events whose day has no partition. The partitioned
//! variant counts retention from the event's creation time rather than from its processing time; pick the TTL
//! with that in mind. `DETACH` takes a brief exclusive lock on the parent; it runs with `lock_timeout = 2s` so
//! it never queues behind long transactions (it retries next round).
//!
//! When to choose which, for a table receiving **10,000 events/s**:
//!
//! - rows: 10,000 × 86,400 = **864 million rows a day**, ~2.6 billion live with a 72 h TTL;
//! - size: ~100 B of heap per row (24 B tuple header, 16 B uuid, ~15 B consumer name, ~10 B topic, 2 × 8 B
//!   timestamps, item pointer) plus ~45 B primary-key entry plus ~30 B `expires_at` entry ≈ **175 B/row ≈
//!   150 GB a day**, ~450 GB at steady state;
//! - batched deletes must remove 10,000 rows/s forever just to keep up, each row a WAL record and a dead tuple
//!   that VACUUM must then visit in the heap and in both indexes (another pass over ~150 GB a day). At the
//!   rate measured here (BENCHMARKS.md: 58,000 rows/s on 2 cores while serving 200 charges/s) that is about
//!   4 hours of deleting per day, before vacuum — it does not fit comfortably;
//! - dropping one daily partition removes 864 million rows in milliseconds with no WAL for the rows, no dead
//!   tuples and no index bloat.
//!
//! Rule of thumb: the plain table with batched deletes up to roughly 1,000 events/s (86 million rows a day,
//! minutes of deleting per day); partitions beyond that, or whenever VACUUM of the dedup table cannot keep up.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idem_ports::StoreError;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sqlx::PgConnection;

use crate::PgStore;
use crate::error::map_sqlx_error;

/// Advisory lock key of the cleaner ("idemclen").
const CLEANER_LOCK: i64 = 0x6964_656d_636c_656e;

/// The tables with an `expires_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpiringTable {
    /// `idempotency_record`.
    IdempotencyRecord,
    /// `processed_event`.
    ProcessedEvent,
}

impl ExpiringTable {
    /// Every table the cleaner deletes from.
    pub const ALL: [Self; 2] = [Self::IdempotencyRecord, Self::ProcessedEvent];

    /// The table's name (a metric label).
    pub fn name(self) -> &'static str {
        match self {
            Self::IdempotencyRecord => "idempotency_record",
            Self::ProcessedEvent => "processed_event",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
/// Metric labels: the table.
pub struct TableLabels {
    /// The table's name.
    pub table: &'static str,
}

/// Partition policy of the partitioned dedup table.
#[derive(Debug, Clone, Copy)]
pub struct PartitionPolicy {
    /// Retention of processed events, counted from the event's own (UUID v7) time.
    pub ttl: Duration,
    /// Daily partitions created ahead of today.
    pub days_ahead: u64,
}

/// Cleaner settings.
#[derive(Debug, Clone)]
pub struct CleanupSettings {
    /// Set when processed events live in the partitioned table.
    pub partitions: Option<PartitionPolicy>,
    /// Rows per DELETE statement.
    pub batch_size: i64,
    /// Upper bound of batches per table and round (a backlog larger than that waits for the next round).
    pub max_batches: u32,
    /// Pause between batches, leaving room to the traffic.
    pub pause: Duration,
    /// Largest difference between this host's clock and the database's at which a round still runs (the
    /// domain's `ADMISSION_MARGIN`, 1 h: the skew every age rule already tolerates).
    pub max_clock_skew: Duration,
}

impl Default for CleanupSettings {
    fn default() -> Self {
        Self {
            partitions: None,
            batch_size: 5_000,
            max_batches: 10_000,
            pause: Duration::from_millis(5),
            max_clock_skew: Duration::from_secs(3600),
        }
    }
}

/// Cleaner metrics.
#[derive(Debug, Default)]
pub struct CleanupStats {
    /// Rows deleted, by table.
    pub deleted: Family<TableLabels, Counter>,
    /// Rounds completed.
    pub rounds: Counter,
    /// Rounds that failed.
    pub failed_rounds: Counter,
    /// Rounds skipped (another instance held the lock).
    pub skipped_rounds: Counter,
    /// Dedup partitions dropped.
    pub partitions_dropped: Counter,
    /// `n_dead_tup` by table.
    pub dead_tuples: Family<TableLabels, Gauge>,
}

impl CleanupStats {
    /// Registers the metrics under `idem_cleanup_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("idem_cleanup");
        r.register("deleted_rows", "Expired rows deleted, by table", self.deleted.clone());
        r.register("rounds", "Cleanup rounds completed", self.rounds.clone());
        r.register(
            "failed_rounds",
            "Cleanup rounds that failed (the next one runs anyway)",
            self.failed_rounds.clone(),
        );
        r.register(
            "skipped_rounds",
            "Rounds skipped because another instance held the cleaner lock",
            self.skipped_rounds.clone(),
        );
        r.register(
            "partitions_dropped",
            "Expired dedup partitions detached and dropped",
            self.partitions_dropped.clone(),
        );
        r.register("dead_tuples", "pg_stat_user_tables.n_dead_tup of the high-churn tables", self.dead_tuples.clone());
    }
}

/// Rows deleted by one round.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleanupReport {
    /// Rows deleted per table.
    pub deleted: Vec<(ExpiringTable, u64)>,
    /// Partitions of the partitioned dedup table dropped whole.
    pub partitions_dropped: Vec<String>,
}

impl CleanupReport {
    /// Rows deleted in all.
    pub fn total(&self) -> u64 {
        self.deleted.iter().map(|(_, n)| n).sum()
    }
}

/// The cleaner.
#[derive(Debug)]
pub struct Cleaner {
    store: PgStore,
    settings: CleanupSettings,
    stats: std::sync::Arc<CleanupStats>,
}

async fn delete_batch(
    conn: &mut PgConnection,
    table: ExpiringTable,
    now: DateTime<Utc>,
    limit: i64,
) -> Result<u64, StoreError> {
    let done = match table {
        ExpiringTable::IdempotencyRecord => {
            sqlx::query!(
                "DELETE FROM idempotency_record WHERE (scope, key) IN (
                 SELECT scope, key FROM idempotency_record
                 WHERE expires_at <= $1 AND (state = 'completed' OR lease_until IS NULL)
                 ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
                now,
                limit,
            )
            .execute(&mut *conn)
            .await
        }
        ExpiringTable::ProcessedEvent => {
            sqlx::query!(
                "DELETE FROM processed_event WHERE (consumer_name, event_id) IN (
                 SELECT consumer_name, event_id FROM processed_event WHERE expires_at <= $1
                 ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
                now,
                limit,
            )
            .execute(&mut *conn)
            .await
        }
    };
    done.map(|r| r.rows_affected()).map_err(map_sqlx_error)
}

impl Cleaner {
    /// A cleaner of `store`'s expired rows.
    pub fn new(store: PgStore, settings: CleanupSettings) -> Self {
        Self { store, settings, stats: std::sync::Arc::new(CleanupStats::default()) }
    }

    /// Its metrics.
    pub fn stats(&self) -> std::sync::Arc<CleanupStats> {
        self.stats.clone()
    }

    /// One round. `Ok(None)` when another instance holds the cleaner lock.
    ///
    /// Deleting by expiry is irreversible, so the round decides by the **database's** clock, never this
    /// host's: every instance's rows are judged by one clock. `local_now` is this host's clock; when it
    /// differs from the database's by more than `max_clock_skew` the round is refused
    /// ([`StoreError::Other`] naming the skew): a host whose clock is wrong is also minting wrong expiries,
    /// and its operator must know. (A host two days ahead used to empty `idempotency_record` and drop live
    /// dedup partitions.)
    pub async fn run_once(&self, local_now: DateTime<Utc>) -> Result<Option<CleanupReport>, StoreError> {
        self.run_once_until(local_now, &tokio_util::sync::CancellationToken::new()).await
    }

    /// [`Cleaner::run_once`], stopping between two batches once `shutdown` is cancelled (what it deleted
    /// so far stays deleted; the next round goes on from there).
    pub async fn run_once_until(
        &self,
        local_now: DateTime<Utc>,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> Result<Option<CleanupReport>, StoreError> {
        // The lock's transaction stays open (idle) for the round: exempt it, in this transaction only, from
        // the sessions' idle-in-transaction timeout.
        let mut lock = self.store.small_tx().await.map_err(map_sqlx_error)?;
        sqlx::query("SET LOCAL idle_in_transaction_session_timeout = 0")
            .execute(&mut *lock)
            .await
            .map_err(map_sqlx_error)?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
            .bind(CLEANER_LOCK)
            .fetch_one(&mut *lock)
            .await
            .map_err(map_sqlx_error)?;
        if !locked {
            self.stats.skipped_rounds.inc();
            return Ok(None);
        }
        let now: DateTime<Utc> =
            sqlx::query_scalar("SELECT statement_timestamp()").fetch_one(&mut *lock).await.map_err(map_sqlx_error)?;
        let skew = (local_now - now).abs();
        let margin = chrono::Duration::from_std(self.settings.max_clock_skew).unwrap_or(chrono::Duration::hours(1));
        if skew > margin {
            return Err(StoreError::Other(format!(
                "refusing to clean up: this host's clock ({}) differs from the database's ({}) by {} s, more than \
                 the {} s margin; fix the host's time (NTP) first",
                local_now.to_rfc3339(),
                now.to_rfc3339(),
                skew.num_seconds(),
                margin.num_seconds()
            )));
        }
        let result = self.delete_all(now, shutdown).await;
        // Ending the transaction releases the lock; if that fails the connection is closed, which does too.
        let _ = lock.rollback().await;
        let report = result?;
        self.stats.rounds.inc();
        Ok(Some(report))
    }

    async fn delete_all(
        &self,
        now: DateTime<Utc>,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> Result<CleanupReport, StoreError> {
        let mut report = CleanupReport::default();
        for table in ExpiringTable::ALL {
            let mut total = 0u64;
            for _ in 0..self.settings.max_batches {
                if shutdown.is_cancelled() {
                    report.deleted.push((table, total));
                    tracing::info!(table = table.name(), deleted = total, "cleanup round stopped by shutdown");
                    return Ok(report);
                }
                // each batch its own short transaction (also what a transaction pooler needs)
                let mut tx = self.store.small_tx().await.map_err(map_sqlx_error)?;
                let n = delete_batch(&mut tx, table, now, self.settings.batch_size).await?;
                tx.commit().await.map_err(map_sqlx_error)?;
                total += n;
                self.stats.deleted.get_or_create(&TableLabels { table: table.name() }).inc_by(n);
                if n < self.settings.batch_size as u64 {
                    break;
                }
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(self.settings.pause) => {}
                }
            }
            report.deleted.push((table, total));
        }
        if let Some(policy) = self.settings.partitions {
            let today = now.date_naive();
            // The oldest day not yet expired: `ensure` must never create a day `drop_expired` drops at once.
            let ttl = chrono::Duration::from_std(policy.ttl).map_err(|e| StoreError::Other(e.to_string()))?;
            let first_live = (now - ttl).date_naive();
            let behind = u64::try_from((today - first_live).num_days()).unwrap_or(0);
            let created = partitions::ensure(&self.store, today, behind, policy.days_ahead).await?;
            let dropped = partitions::drop_expired(&self.store, now, policy.ttl).await?;
            let default_rows = partitions::clean_default(&self.store, now, self.settings.batch_size).await?;
            self.stats.partitions_dropped.inc_by(dropped.len() as u64);
            tracing::info!(created = created.len(), dropped = ?dropped, default_rows, "partition maintenance done");
            report.partitions_dropped = dropped;
        }
        Ok(report)
    }

    /// Runs a round now and then every `interval` until `shutdown`. A failed round is logged and counted;
    /// the next one runs on schedule.
    pub async fn run(
        &self,
        clock: &dyn idem_ports::Clock,
        interval: Duration,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        loop {
            match self.run_once_until(clock.now(), &shutdown).await {
                Ok(Some(report)) => {
                    let deleted: Vec<String> =
                        report.deleted.iter().map(|(t, n)| format!("{}={n}", t.name())).collect();
                    tracing::info!(total = report.total(), deleted = %deleted.join(" "), "cleanup round done");
                }
                Ok(None) => {
                    tracing::info!("cleanup skipped: another instance holds the cleaner lock")
                }
                Err(e) => {
                    self.stats.failed_rounds.inc();
                    tracing::warn!(error = %e, "cleanup round failed; the next one runs on schedule");
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }

    /// Refreshes the dead-tuple gauges from `pg_stat_user_tables`.
    pub async fn refresh_dead_tuples(&self) -> Result<(), StoreError> {
        refresh_dead_tuples(&self.store, &self.stats).await
    }
}

/// The high-churn tables whose dead tuples are exported.
pub const DEAD_TUPLE_TABLES: [&str; 3] = ["idempotency_record", "processed_event", "outbox_message"];

/// Reads `n_dead_tup` of the high-churn tables ([`DEAD_TUPLE_TABLES`]) into `stats`.
pub async fn refresh_dead_tuples(store: &PgStore, stats: &CleanupStats) -> Result<(), StoreError> {
    let rows = sqlx::query!(
        r#"SELECT relname AS "relname!", n_dead_tup AS "dead!" FROM pg_stat_user_tables
           WHERE relname IN ('idempotency_record', 'processed_event', 'outbox_message')"#
    )
    .fetch_all(&mut *store.small_tx().await.map_err(map_sqlx_error)?)
    .await
    .map_err(map_sqlx_error)?;
    for row in rows {
        // the two expiring tables and the outbox (deleted by the relay, vacuumed by the service)
        if let Some(table) = DEAD_TUPLE_TABLES.into_iter().find(|t| *t == row.relname) {
            stats.dead_tuples.get_or_create(&TableLabels { table }).set(row.dead);
        }
    }
    Ok(())
}

/// Partition maintenance of `processed_event_partitioned` (DEDUP_STORAGE=partitioned).
pub mod partitions {
    use chrono::{DateTime, Days, NaiveDate, Utc};
    use idem_ports::StoreError;

    use crate::PgStore;
    use crate::error::map_sqlx_error;

    const PARENT: &str = "processed_event_partitioned";

    fn name(day: NaiveDate) -> String {
        format!("{PARENT}_p{}", day.format("%Y%m%d"))
    }

    /// The day of a partition, from its name.
    fn day_of(name: &str) -> Option<NaiveDate> {
        let digits = name.strip_prefix(PARENT)?.strip_prefix("_p")?;
        NaiveDate::parse_from_str(digits, "%Y%m%d").ok()
    }

    /// Existing daily partitions, oldest first.
    pub async fn list(store: &PgStore) -> Result<Vec<(String, NaiveDate)>, StoreError> {
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_inherits i
             JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
             WHERE p.relname = $1",
        )
        .bind(PARENT)
        .fetch_all(&mut *store.small_tx().await.map_err(map_sqlx_error)?)
        .await
        .map_err(map_sqlx_error)?;
        let mut days: Vec<(String, NaiveDate)> = names.into_iter().filter_map(|n| day_of(&n).map(|d| (n, d))).collect();
        days.sort_by_key(|(_, d)| *d);
        Ok(days)
    }

    /// Creates the daily partitions from `behind` days before `today` to `ahead` days after it. A day
    /// whose rows already sit in the default partition cannot get its partition (PostgreSQL refuses); it
    /// is skipped and logged, its rows are cleaned row by row.
    pub async fn ensure(store: &PgStore, today: NaiveDate, behind: u64, ahead: u64) -> Result<Vec<String>, StoreError> {
        let existing: Vec<NaiveDate> = list(store).await?.into_iter().map(|(_, d)| d).collect();
        let mut created = Vec::new();
        let first = today.checked_sub_days(Days::new(behind)).unwrap_or(today);
        for offset in 0..=(behind + ahead) {
            let Some(day) = first.checked_add_days(Days::new(offset)) else { continue };
            if existing.contains(&day) {
                continue;
            }
            let Some(next) = day.checked_add_days(Days::new(1)) else { continue };
            // names and bounds are built from dates only: nothing user-supplied reaches the DDL
            let ddl = format!(
                "CREATE TABLE IF NOT EXISTS {} PARTITION OF {PARENT} FOR VALUES FROM ('{day}') TO ('{next}')",
                name(day)
            );
            match bounded_ddl(store, &[&ddl]).await {
                Ok(_) => created.push(name(day)),
                Err(e) => {
                    tracing::warn!(partition = %name(day), error = %e, "cannot create partition; its rows stay in the default partition")
                }
            }
        }
        Ok(created)
    }

    /// Detaches and drops every daily partition whose whole range expired: `day + 1 + ttl <= now`.
    pub async fn drop_expired(
        store: &PgStore,
        now: DateTime<Utc>,
        ttl: std::time::Duration,
    ) -> Result<Vec<String>, StoreError> {
        let ttl = chrono::Duration::from_std(ttl).map_err(|e| StoreError::Other(e.to_string()))?;
        let mut dropped = Vec::new();
        for (name, day) in list(store).await? {
            let Some(end) = day.checked_add_days(Days::new(1)).and_then(|d| d.and_hms_opt(0, 0, 0)) else { continue };
            if end.and_utc() + ttl > now {
                continue;
            }
            let detach = format!("ALTER TABLE {PARENT} DETACH PARTITION {name}");
            let drop = format!("DROP TABLE {name}");
            bounded_ddl(store, &[&detach, &drop]).await.map_err(map_sqlx_error)?;
            dropped.push(name);
        }
        Ok(dropped)
    }

    /// Runs DDL statements in one transaction under `SET LOCAL lock_timeout = '2s'`: never queued behind
    /// long transactions (it gives up and the next round retries), and no setting outlives the transaction
    /// on the pooled connection.
    async fn bounded_ddl(store: &PgStore, statements: &[&str]) -> Result<(), sqlx::Error> {
        let mut tx = store.small_tx().await?;
        sqlx::query("SET LOCAL lock_timeout = '2s'").execute(&mut *tx).await?;
        for statement in statements {
            sqlx::query(statement).execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    /// Deletes expired rows of the default partition in bounded batches; returns the count.
    pub async fn clean_default(store: &PgStore, now: DateTime<Utc>, batch: i64) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let mut tx = store.small_tx().await.map_err(map_sqlx_error)?;
            let n = sqlx::query(
                "DELETE FROM processed_event_partitioned_default WHERE (consumer_name, event_id) IN (
                     SELECT consumer_name, event_id FROM processed_event_partitioned_default
                     WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED)",
            )
            .bind(now)
            .bind(batch)
            .execute(&mut *tx)
            .await
            .map_err(map_sqlx_error)?
            .rows_affected();
            tx.commit().await.map_err(map_sqlx_error)?;
            total += n;
            if n < batch as u64 {
                return Ok(total);
            }
        }
    }
}

//! Deletes expired rows: idempotency records, processed events, published outbox rows.
//!
//! Each round takes a session advisory lock so only one instance cleans at a time, then deletes per table in
//! bounded batches (`DELETE … WHERE key IN (SELECT … WHERE expires_at <= now ORDER BY expires_at LIMIT n
//! FOR UPDATE SKIP LOCKED)`): every batch is its own short transaction found through the `expires_at`
//! index, so no statement holds locks or produces WAL for long, and rows in use are skipped.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idem_ports::StoreError;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sqlx::{Connection, PgConnection};

use crate::PgStore;
use crate::error::map_sqlx_error;

/// Advisory lock key of the cleaner ("idemclen").
const CLEANER_LOCK: i64 = 0x6964_656d_636c_656e;

/// The tables with an `expires_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpiringTable {
    IdempotencyRecord,
    ProcessedEvent,
    OutboxMessage,
}

impl ExpiringTable {
    pub const ALL: [Self; 3] = [Self::IdempotencyRecord, Self::ProcessedEvent, Self::OutboxMessage];

    pub fn name(self) -> &'static str {
        match self {
            Self::IdempotencyRecord => "idempotency_record",
            Self::ProcessedEvent => "processed_event",
            Self::OutboxMessage => "outbox_message",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TableLabels {
    pub table: &'static str,
}

/// Cleaner settings.
#[derive(Debug, Clone)]
pub struct CleanupSettings {
    /// Rows per DELETE statement.
    pub batch_size: i64,
    /// Upper bound of batches per table and round (a backlog larger than that waits for the next round).
    pub max_batches: u32,
    /// Pause between batches, leaving room to the traffic.
    pub pause: Duration,
}

impl Default for CleanupSettings {
    fn default() -> Self {
        Self { batch_size: 5_000, max_batches: 10_000, pause: Duration::from_millis(5) }
    }
}

/// Cleaner metrics.
#[derive(Debug, Default)]
pub struct CleanupStats {
    pub deleted: Family<TableLabels, Counter>,
    pub rounds: Counter,
    pub failed_rounds: Counter,
    pub skipped_rounds: Counter,
    pub dead_tuples: Family<TableLabels, Gauge>,
}

impl CleanupStats {
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
        r.register("dead_tuples", "pg_stat_user_tables.n_dead_tup of the high-churn tables", self.dead_tuples.clone());
    }
}

/// Rows deleted by one round.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleanupReport {
    pub deleted: Vec<(ExpiringTable, u64)>,
}

impl CleanupReport {
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
                 SELECT scope, key FROM idempotency_record WHERE expires_at <= $1
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
        ExpiringTable::OutboxMessage => {
            sqlx::query!(
                "DELETE FROM outbox_message WHERE id IN (
                 SELECT id FROM outbox_message WHERE expires_at <= $1 AND published_at IS NOT NULL
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
    pub fn new(store: PgStore, settings: CleanupSettings) -> Self {
        Self { store, settings, stats: std::sync::Arc::new(CleanupStats::default()) }
    }

    pub fn stats(&self) -> std::sync::Arc<CleanupStats> {
        self.stats.clone()
    }

    /// One round at time `now`. `Ok(None)` when another instance holds the cleaner lock.
    pub async fn run_once(&self, now: DateTime<Utc>) -> Result<Option<CleanupReport>, StoreError> {
        let mut conn = self.store.pool().acquire().await.map_err(map_sqlx_error)?;
        let locked: bool = sqlx::query_scalar!(r#"SELECT pg_try_advisory_lock($1) AS "locked!""#, CLEANER_LOCK)
            .fetch_one(&mut *conn)
            .await
            .map_err(map_sqlx_error)?;
        if !locked {
            self.stats.skipped_rounds.inc();
            return Ok(None);
        }
        let result = self.delete_all(&mut conn, now).await;
        let unlocked = sqlx::query_scalar!(r#"SELECT pg_advisory_unlock($1) AS "unlocked!""#, CLEANER_LOCK)
            .fetch_one(&mut *conn)
            .await;
        if !matches!(unlocked, Ok(true)) {
            // Never hand a connection that may still hold the lock back to the pool.
            let _ = conn.detach().close().await;
        }
        let report = result?;
        self.stats.rounds.inc();
        Ok(Some(report))
    }

    async fn delete_all(&self, conn: &mut PgConnection, now: DateTime<Utc>) -> Result<CleanupReport, StoreError> {
        let mut report = CleanupReport::default();
        for table in ExpiringTable::ALL {
            let mut total = 0u64;
            for _ in 0..self.settings.max_batches {
                let n = delete_batch(conn, table, now, self.settings.batch_size).await?;
                total += n;
                self.stats.deleted.get_or_create(&TableLabels { table: table.name() }).inc_by(n);
                if n < self.settings.batch_size as u64 {
                    break;
                }
                tokio::time::sleep(self.settings.pause).await;
            }
            report.deleted.push((table, total));
        }
        Ok(report)
    }

    /// Runs a round now and then every `interval` until `shutdown`. A failed round is logged and counted;
    /// the next one runs on schedule.
    pub async fn run(&self, interval: Duration, shutdown: tokio_util::sync::CancellationToken) {
        loop {
            match self.run_once(Utc::now()).await {
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

/// Reads `n_dead_tup` of the high-churn tables into `stats`.
pub async fn refresh_dead_tuples(store: &PgStore, stats: &CleanupStats) -> Result<(), StoreError> {
    let rows = sqlx::query!(
        r#"SELECT relname AS "relname!", n_dead_tup AS "dead!" FROM pg_stat_user_tables
           WHERE relname IN ('idempotency_record', 'processed_event', 'outbox_message')"#
    )
    .fetch_all(store.pool())
    .await
    .map_err(map_sqlx_error)?;
    for row in rows {
        if let Some(table) = ExpiringTable::ALL.into_iter().find(|t| t.name() == row.relname) {
            stats.dead_tuples.get_or_create(&TableLabels { table: table.name() }).set(row.dead);
        }
    }
    Ok(())
}

//! The transactional-outbox relay.
//!
//! Each round, in one unit of work: claim up to `batch_size` unpublished rows (oldest first, whole key
//! shards at a time), hand every message to the idempotent producer in that order, wait for the delivery
//! report of every one, then delete the delivered rows (failures stay and are counted) and commit. A crash between
//! publishing and the commit re-publishes the same rows with the same `event_id`; receivers dedup them.
//!
//! Claims lock key shards, not keys (see `claim_unpublished` in the PostgreSQL adapter): a claim over a
//! backlog holds at most 16 advisory locks, any claim at most 64, and so do all relays together, whatever the
//! query plan.
//!
//! An idle relay is woken without anything in the business transaction: in process right after a commit
//! that wrote outbox rows, across instances by one debounced NOTIFY sent outside business transactions,
//! and by polling as the fallback (`idem_postgres::PgOutboxWakeup` explains why: a NOTIFY inside the
//! transaction serializes every commit of the database behind one lock and defeats group commit).
//!
//! # In detail
//!
//! Business transactions write `outbox_message` rows (id = UUID v7 = the `event_id` of every publish). The
//! relay, in each round and one unit of work: claims up to `OUTBOX_BATCH_SIZE` unpublished rows oldest first,
//! hands them to the producer in that order, waits for every delivery report, deletes the delivered rows and
//! counts failures on the others, then commits. There is
//! no "last published id" cursor: sequence values are assigned at insert, not commit, so such a cursor skips
//! rows. A crash between publish and commit re-publishes the same rows with the same `event_id`; receivers
//! dedup them.
//!
//! **Claims lock key shards.** Each row has `key_shard` = hash(key) mod 64 (a stored generated column). A
//! claim reads the shards of the oldest unpublished rows (no locks), takes `pg_try_advisory_xact_lock` on
//! them in the order of their oldest row over a materialized list — all it found, or at most 16 when it
//! finds a full batch (a backlog, shared by the other workers) — then, in a second statement whose snapshot
//! follows the locks, reads the oldest rows of the shards it holds. One claim thus takes every row waiting
//! since the last one, and the oldest row always goes first. The lock function runs only over ≤ 64 distinct
//! shards, whatever plan the planner picks (a per-row lock in the WHERE clause ran on every row under a
//! bitmap plan and exhausted the lock table: `out of shared memory`).
//!
//! **Waking the relay without serializing commits.** A NOTIFY inside a transaction takes a database-wide lock
//! from pre-commit until the commit record is flushed, so on a commit-bound disk every business transaction
//! committed alone. Nothing notifies inside business transactions: the unit of work that wrote outbox rows
//! wakes an in-process relay after its commit, and asks a background task to send one debounced
//! `NOTIFY outbox_message` (at most every 25 ms, payload = instance id) for relays of other instances; relays
//! also poll (`adapters-postgres/src/wakeup.rs`). A wake-up starts one claim by one idle worker, at most one
//! per `OUTBOX_MIN_CLAIM_INTERVAL` (50 ms): under a stream of commits one claim serves many of them, and the
//! relay stays a small share of the database's and the broker's work (see [`Relay::run`]). Each round costs
//! its claim, its delete and one produce request whatever its size; at 50 ms instead of 25 the HTTP
//! benchmark's whole machine spent ~4 % less CPU per charge and p99 commit-to-publish at 1,000 msg/s was
//! 58 ms (target < 100; BENCHMARKS.md).
//!
//! **Poison rows.** A row the broker refuses for good (too large, not authorized, invalid) is quarantined after
//! 3 refusals (`quarantined_at`, `last_error`, `attempts` kept; `idem_outbox_quarantined`); later rows of its
//! key wait behind it and other keys flow without backoff. An unknown topic is retried (topics may be created
//! after the broker returns).
//!
//! **Published rows are deleted, not marked.** A round deletes the rows whose delivery the broker
//! acknowledged, in the transaction that claimed them. Marking them (`UPDATE … SET published_at`) and cleaning
//! them up a day later wrote every message three times (a new row version with two index entries, then a
//! delete) and left two dead versions for VACUUM; in the HTTP benchmark that was most of what publishing cost
//! PostgreSQL (BENCHMARKS.md, issue 12). Nothing needs a published row: receivers dedup by `event_id`, and
//! the broker is the record of what was published. So the table holds only what is still to publish (or
//! quarantined), and a claim's index scan meets few dead entries.
//!
//! **Per-key order, precisely.** One key is in at most one in-flight round (its shard lock), the next round
//! for that key starts after the previous one was acknowledged and committed, and within a round rows go out
//! in `seq` order through one idempotent producer; a row that fails holds back the later rows of its key. So
//! rows of one key are published in `seq` order among the rows committed when the claim runs. `seq` is taken
//! at insert, not at commit: rows written by transactions that serialize on a common lock (one payment's
//! capture and refunds lock the payment row) publish in commit order (test
//! `one_key_arrives_in_commit_order_on_its_murmur2_partition`), but two concurrent transactions writing the same
//! key without a shared lock — two payments of one order, since the key is the order id — may commit out of
//! `seq` order, and the later `seq` can be published first. Receivers order by the payload's own version (the
//! order projection does), never by arrival.
//!
//! **Producer settings** (`client.rs`): `enable.idempotence=true` (the broker drops retried duplicates within
//! one producer session and keeps per-partition order), `acks=all`, `max.in.flight.requests.per.connection=5`
//! (the bound idempotence requires), unbounded `retries` within `delivery.timeout.ms=30000`, `linger.ms=1`,
//! `partitioner=murmur2_random` (the Java client's hashing: a key lands on the same partition from Java, Go
//! with a murmur2 balancer, or idem; verified against Kafka's reference vectors). The idempotent producer only
//! dedups within one session: a send that timed out may still have been written, and its retry can duplicate
//! it — which is why every message carries `event_id` and every receiver dedups. If the broker rejects the
//! session (tansu fences the producer after delivery timeouts), the relay starts a new producer.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use idem_domain::wire::headers as wire;
use idem_ports::{Clock, OutboxRecord, OutboxWakeup, StoreError, TransactionManager};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use tokio::sync::{Notify, RwLock};
use tokio_util::sync::CancellationToken;

use crate::client::{KafkaConnection, ProducerSettings, breaks_session};

/// Relay settings.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// The producer.
    pub producer: ProducerSettings,
    /// Most rows per claim.
    pub batch_size: i64,
    /// Polling fallback when no notification arrives.
    pub poll_interval: Duration,
    /// Shortest time between two claims started by wake-ups: commits arriving meanwhile are served by
    /// one claim. A full claim is followed at once, whatever this says.
    pub min_claim_interval: Duration,
    /// Rounds in flight at once (each claims distinct keys).
    pub concurrency: usize,
    /// After how many refusals for good (too large, not authorized, invalid) a row is quarantined.
    pub quarantine_after: i32,
    /// Longest time one round may take, from its claim to its COMMIT (it waits for delivery reports, so
    /// longer than the producer's delivery timeout). A round that takes longer (its connection black-holed
    /// by a failover) is abandoned: its rows stay claimed by nobody and are published again later; the
    /// receivers deduplicate by event_id.
    pub round_timeout: Duration,
}

impl RelaySettings {
    /// Defaults: rounds of 2,000 rows, 4 in flight, at most one wake-up claim per 50 ms, poll every second,
    /// quarantine after 3 refusals.
    pub fn new(cluster: impl Into<KafkaConnection>) -> Self {
        Self {
            producer: ProducerSettings::new(cluster),
            batch_size: 2000,
            poll_interval: Duration::from_secs(1),
            min_claim_interval: Duration::from_millis(50),
            concurrency: 4,
            quarantine_after: 3,
            round_timeout: Duration::from_secs(60),
        }
    }
}

/// Metrics of a running relay (register them with [`RelayStats::register`]).
#[derive(Debug)]
pub struct RelayStats {
    /// Messages published: acknowledged by the broker and deleted from the outbox.
    pub published: Counter,
    /// Deliveries that failed.
    pub failed: Counter,
    /// Rounds committed.
    pub rounds: Counter,
    /// Claims run, including those that found nothing to publish.
    pub claims: Counter,
    /// Rows quarantined because the broker refuses them for good.
    pub quarantined: Counter,
    /// Seconds from a row's creation (its transaction) to its delete after the broker's ack.
    pub publish_latency: Histogram,
}

impl Default for RelayStats {
    fn default() -> Self {
        Self {
            published: Counter::default(),
            failed: Counter::default(),
            rounds: Counter::default(),
            claims: Counter::default(),
            quarantined: Counter::default(),
            publish_latency: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
        }
    }
}

impl RelayStats {
    /// Registers the metrics under `idem_outbox_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("idem_outbox");
        r.register(
            "published",
            "Outbox messages published (acknowledged and deleted from the outbox)",
            self.published.clone(),
        );
        r.register("publish_failures", "Outbox messages whose delivery failed (left unpublished)", self.failed.clone());
        r.register("rounds", "Claim-publish-delete rounds committed", self.rounds.clone());
        r.register("claims", "Claims of unpublished rows, including those that found none", self.claims.clone());
        r.register(
            "quarantined",
            "Outbox rows quarantined because the broker refuses them for good",
            self.quarantined.clone(),
        );
        r.register(
            "publish_latency_seconds",
            "From outbox row creation to publish acknowledged",
            self.publish_latency.clone(),
        );
    }
}

/// Why the relay stopped: only a producer configuration the Kafka client refuses, which no retry heals.
/// Broker outages never stop the relay: rows stay unpublished and rounds back off.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("invalid Kafka producer configuration (fix the settings and restart): {0}")]
    /// librdkafka refused the producer configuration.
    Config(#[from] KafkaError),
}

/// The relay.
pub struct Relay {
    settings: RelaySettings,
    tm: Arc<dyn TransactionManager>,
    clock: Arc<dyn Clock>,
    stats: Arc<RelayStats>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").field("settings", &self.settings).finish_non_exhaustive()
    }
}

/// The publish span of `row` and its message's headers: idem's, then the row's own with the publish span's
/// trace context ([`crate::trace::message_headers`]).
fn record_headers(row: &OutboxRecord) -> (tracing::Span, OwnedHeaders) {
    let span = crate::trace::producer_span(row);
    let headers = crate::trace::message_headers(idem_headers(row), row, &span);
    (span, headers)
}

fn idem_headers(row: &OutboxRecord) -> OwnedHeaders {
    let id = row.id.to_string();
    let saga = row.saga_id.map(|s| s.to_string());
    let mut headers = OwnedHeaders::new()
        .insert(Header { key: wire::EVENT_ID, value: Some(id.as_bytes()) })
        .insert(Header { key: wire::EVENT_TYPE, value: Some(row.event_type.as_bytes()) })
        .insert(Header { key: wire::AGGREGATE_TYPE, value: Some(row.aggregate_type.as_bytes()) })
        .insert(Header { key: wire::CONTENT_TYPE, value: Some(idem_domain::wire::JSON.as_bytes()) });
    if let Some(saga) = &saga {
        headers = headers.insert(Header { key: wire::SAGA_ID, value: Some(saga.as_bytes()) });
    }
    headers
}

/// How long a round in flight may go on after shutdown was asked before it is abandoned (its rows stay in
/// the outbox): enough for a healthy broker's acknowledgements, far below the drain bound.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

impl Relay {
    /// A relay publishing `tm`'s outbox rows.
    pub fn new(settings: RelaySettings, tm: Arc<dyn TransactionManager>, clock: Arc<dyn Clock>) -> Self {
        Self { settings, tm, clock, stats: Arc::new(RelayStats::default()) }
    }

    /// Its metrics.
    pub fn stats(&self) -> Arc<RelayStats> {
        self.stats.clone()
    }

    /// Relays until `shutdown`; finishes the rounds in hand first.
    ///
    /// `concurrency` workers claim and publish at once. They never share a key (a claim locks the key
    /// shards it takes), so a key's next round starts only after its previous round was acknowledged and
    /// committed: per-key order holds while rounds overlap their broker round trips.
    ///
    /// **Who claims when.** A wake-up (a commit, a notification, the poll) starts one claim, by one idle
    /// worker, at most once per `min_claim_interval`: every commit in between is served by that claim.
    /// A full claim means more are waiting: its worker claims again at once and wakes another worker, so
    /// a backlog drains with every worker. A partial claim asks for one follow-up claim (through the same
    /// throttle): rows it skipped because another round held their shard are claimed after that round
    /// committed, and that round, not being empty, asks for its own follow-up. An empty claim asks for
    /// nothing. (Before, every wake-up woke every worker and each claimed: under a stream of commits most
    /// claims found nothing or one row, and the relay cost the database more statements than the charges.)
    pub async fn run(self, mut wakeup: Box<dyn OutboxWakeup>, shutdown: CancellationToken) -> Result<(), RelayError> {
        let producer = RwLock::new(self.settings.producer.client_config().create::<FutureProducer>()?);
        let claim = Notify::new();
        let follow_up = Notify::new();
        tracing::info!(batch = self.settings.batch_size, workers = self.settings.concurrency, "outbox relay started");
        let listen = async {
            // The first claim is at once: rows committed before this relay listened (a restart after an
            // outage, a deploy) wake nobody, and waited a whole poll interval.
            claim.notify_one();
            let mut last_claim = Some(tokio::time::Instant::now());
            while !shutdown.is_cancelled() {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = wakeup.wait(self.settings.poll_interval) => {}
                    _ = follow_up.notified() => {}
                }
                if let Some(next) = last_claim.map(|at| at + self.settings.min_claim_interval) {
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep_until(next) => {}
                    }
                }
                last_claim = Some(tokio::time::Instant::now());
                claim.notify_one();
            }
        };
        let workers =
            (0..self.settings.concurrency.max(1)).map(|_| self.worker(&producer, &claim, &follow_up, &shutdown));
        let (_, results) = tokio::join!(listen, futures::future::join_all(workers));
        let producer = producer.into_inner();
        // what is still queued belongs to abandoned rounds (their rows stay in the outbox): purged, not
        // waited for — a flush blocks the thread until the delivery timeout while the broker is away
        producer.purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
        let _ = tokio::task::spawn_blocking(move || producer.flush(Duration::from_millis(500))).await;
        tracing::info!("outbox relay stopped");
        results.into_iter().collect()
    }

    async fn worker(
        &self,
        producer: &RwLock<FutureProducer>,
        claim: &Notify,
        follow_up: &Notify,
        shutdown: &CancellationToken,
    ) -> Result<(), RelayError> {
        // 100 ms doubling to 5 s between failed rounds
        let mut backoff = idem_ports::Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut wanted = false;
        while !shutdown.is_cancelled() {
            if !wanted {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = claim.notified() => {}
                }
            }
            wanted = false;
            let current = producer.read().await.clone();
            let bounded = tokio::time::timeout(self.settings.round_timeout, self.round(&current));
            let abandon = async {
                shutdown.cancelled().await;
                tokio::time::sleep(SHUTDOWN_GRACE).await;
            };
            let round = tokio::select! {
                bounded = bounded => bounded.unwrap_or_else(|_| {
                    Err(StoreError::Unavailable(format!(
                        "the round did not end within {} s: abandoned (rolled back unless its commit was under way)",
                        self.settings.round_timeout.as_secs()
                    )))
                }),
                () = abandon => {
                    // the broker did not acknowledge in time: the round's rows stay in the outbox (the next
                    // start publishes them; one that was written meanwhile is a duplicate receivers drop by
                    // its event_id), and the shutdown does not wait for the delivery timeout
                    tracing::warn!(grace = ?SHUTDOWN_GRACE, "shutdown: the round in flight is abandoned; its rows stay in the outbox");
                    break;
                }
            };
            let pause = match round {
                Ok(round) if round.failed == 0 => {
                    backoff.reset();
                    if round.claimed as i64 >= self.settings.batch_size {
                        // more are waiting: claim again, and let another worker join
                        claim.notify_one();
                        wanted = true;
                    } else if round.claimed > 0 {
                        follow_up.notify_one();
                    }
                    continue;
                }
                Ok(round) => {
                    tracing::warn!(
                        failed = round.failed,
                        claimed = round.claimed,
                        "outbox round had undelivered messages; they stay unpublished"
                    );
                    // A producer session the broker rejected (fenced after timeouts) or a fatal producer
                    // error poisons the client for good: start a new producer session.
                    let fatal = current.client().fatal_error();
                    if round.session_broken || fatal.is_some() {
                        let mut guard = producer.write().await;
                        if guard.client().native_ptr() == current.client().native_ptr() {
                            tracing::warn!(?fatal, "producer session unusable; creating a new producer");
                            match self.settings.producer.client_config().create() {
                                Ok(p) => *guard = p,
                                Err(e) => tracing::error!(error = %e, "cannot create a new producer; retrying"),
                            }
                        }
                    }
                    backoff.next_delay()
                }
                Err(e) => {
                    tracing::warn!(error = %e, "outbox round failed; rows stay unpublished");
                    backoff.next_delay()
                }
            };
            // the rows stay unpublished: this worker retries them after the pause
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(pause) => {}
            }
            wanted = true;
        }
        Ok(())
    }

    /// One claim-publish-delete round, in four steps: claim rows; publish them in claim order (per key:
    /// commit order); send each row of a refused request alone; record the outcome (delete what was
    /// delivered, charge what failed) and commit.
    pub async fn round(&self, producer: &FutureProducer) -> Result<Round, StoreError> {
        let mut uow = self.tm.begin().await?;
        let rows = uow.outbox().claim_unpublished(self.settings.batch_size).await?;
        self.stats.claims.inc();
        if rows.is_empty() {
            return Ok(Round { claimed: 0, failed: 0, session_broken: false });
        }
        let mut published = publish(producer, &rows).await;
        if !published.failures.rejected.is_empty() {
            resend_refused(producer, &rows, &mut published).await;
        }
        let Published { delivered, failures, session_broken } = published;
        let failed = failures.failed.len();
        self.record(uow, &delivered, failures).await?;
        Ok(Round { claimed: rows.len(), failed, session_broken })
    }

    /// Deletes the delivered rows, charges the failed and refused ones, commits, and counts.
    async fn record(
        &self,
        mut uow: Box<dyn idem_ports::UnitOfWork>,
        delivered: &[&OutboxRecord],
        failures: Failures,
    ) -> Result<(), StoreError> {
        let now = self.clock.now();
        let ids: Vec<_> = delivered.iter().map(|r| r.id).collect();
        if !ids.is_empty() {
            uow.outbox().delete_published(&ids).await?;
        }
        let Failures { failed, rejected, last_error, last_rejection } = failures;
        if !failed.is_empty() {
            uow.outbox().record_failure(&failed, &last_error).await?;
        }
        let mut quarantined = 0;
        if !rejected.is_empty() {
            quarantined =
                uow.outbox().record_rejection(&rejected, &last_rejection, self.settings.quarantine_after).await?;
        }
        uow.commit().await?;
        self.stats.rounds.inc_by(1);
        self.stats.published.inc_by(ids.len() as u64);
        self.stats.failed.inc_by((failed.len() + rejected.len()) as u64);
        self.stats.quarantined.inc_by(quarantined);
        if quarantined > 0 {
            tracing::error!(rows = quarantined, error = %last_rejection, "outbox rows quarantined: the broker refuses them for good; see `idem outbox`");
        }
        for r in delivered {
            let secs = (now - r.created_at).num_microseconds().unwrap_or(0).max(0) as f64 / 1e6;
            self.stats.publish_latency.observe(secs);
        }
        Ok(())
    }
}

/// What a round's publishing did: the rows delivered (to delete), the failures (to charge), and whether
/// the producer session is broken.
struct Published<'r> {
    delivered: Vec<&'r OutboxRecord>,
    failures: Failures,
    session_broken: bool,
}

/// Enqueues `rows` in claim order (per key: commit order), then collects every delivery report. Once a row
/// of a key failed, the later rows of that key are not sent (or, if already sent, not deleted): they wait
/// behind it, so a key never publishes out of order.
async fn publish<'r>(producer: &FutureProducer, rows: &'r [OutboxRecord]) -> Published<'r> {
    let mut blocked: HashSet<&str> = HashSet::new();
    let mut pending = Vec::with_capacity(rows.len());
    for row in rows {
        if blocked.contains(row.aggregate_id.as_str()) {
            pending.push(None);
            continue;
        }
        let payload = row.payload.as_str();
        let (_span, headers) = record_headers(row);
        let delivery = loop {
            let record = FutureRecord::to(&row.topic).key(&row.aggregate_id).payload(payload).headers(headers.clone());
            match producer.send_result(record) {
                Ok(d) => break Ok(d),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err((e, _)) => break Err(e),
            }
        };
        if delivery.is_err() {
            blocked.insert(&row.aggregate_id);
        }
        pending.push(Some(delivery));
    }
    let mut published =
        Published { delivered: Vec::with_capacity(rows.len()), failures: Failures::default(), session_broken: false };
    let mut failed_keys: HashSet<&str> = HashSet::new();
    for (row, delivery) in rows.iter().zip(pending) {
        let outcome = match delivery {
            None => continue, // behind a failed row of its key: left unpublished, not an attempt
            Some(Ok(future)) => match future.await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err((e, _))) => {
                    published.session_broken |= breaks_session(&e);
                    Err(e)
                }
                Err(_) => Err(KafkaError::Canceled),
            },
            Some(Err(e)) => Err(e),
        };
        match outcome {
            Ok(()) if !failed_keys.contains(row.aggregate_id.as_str()) => published.delivered.push(row),
            Ok(()) => {} // sent, but behind a failed row of its key: re-sent later, receivers dedup
            Err(e) => {
                failed_keys.insert(&row.aggregate_id);
                tracing::warn!(event_id = %row.id, topic = %row.topic, attempts = row.attempts + 1, error = %e, "outbox publish failed");
                published.failures.add(row.id, &e);
            }
        }
    }
    published
}

/// The broker refuses whole produce requests (a batch of several keys and partitions): a refusal says only
/// that some row of the request was refused. Each refused row is sent alone, in claim order, before it is
/// charged; a key whose row is refused alone (or fails) sends nothing more.
async fn resend_refused<'r>(producer: &FutureProducer, rows: &'r [OutboxRecord], published: &mut Published<'r>) {
    let refused: HashSet<uuid::Uuid> = published.failures.rejected.drain(..).collect();
    let mut stopped = keys_that_failed(rows, &published.failures.failed);
    for row in rows.iter().filter(|r| refused.contains(&r.id)) {
        if stopped.contains(row.aggregate_id.as_str()) {
            continue; // behind a row of its key refused alone: waits, not an attempt
        }
        match send_alone(producer, row).await {
            Ok(()) => published.delivered.push(row),
            Err(e) => {
                stopped.insert(&row.aggregate_id);
                published.session_broken |= breaks_session(&e);
                published.failures.add(row.id, &e);
            }
        }
    }
}

/// The keys of the rows that failed for now in this round: a refused row of such a key is not sent alone,
/// since it would be published (and deleted) before the row of its key that failed, out of order; it waits
/// for the next round, uncharged. (Issue 32.5: the keys used to start unstopped.)
fn keys_that_failed<'r>(rows: &'r [OutboxRecord], failed: &[uuid::Uuid]) -> HashSet<&'r str> {
    rows.iter().filter(|r| failed.contains(&r.id)).map(|r| r.aggregate_id.as_str()).collect()
}

/// The rows of a round that failed: refused for good (charged towards quarantine) or for now.
#[derive(Default)]
struct Failures {
    failed: Vec<uuid::Uuid>,
    rejected: Vec<uuid::Uuid>,
    last_error: String,
    last_rejection: String,
}

impl Failures {
    fn add(&mut self, id: uuid::Uuid, e: &KafkaError) {
        if is_permanent(e) {
            self.last_rejection = e.to_string();
            self.rejected.push(id);
        } else {
            self.last_error = e.to_string();
            self.failed.push(id);
        }
    }
}

/// Sends one row and waits for its delivery report.
async fn send_alone(producer: &FutureProducer, row: &OutboxRecord) -> Result<(), KafkaError> {
    let (_span, headers) = record_headers(row);
    let record = FutureRecord::to(&row.topic).key(&row.aggregate_id).payload(row.payload.as_str()).headers(headers);
    producer.send(record, Duration::from_secs(30)).await.map(|_| ()).map_err(|(e, _)| e)
}

/// Errors after which the broker will refuse the same message again, whatever the retries: the row is a
/// poison row. An unknown topic is not among them (topics may be created at start, after the broker
/// returns); it is retried with backoff.
fn is_permanent(e: &KafkaError) -> bool {
    use RDKafkaErrorCode::*;
    matches!(
        e.rdkafka_error_code(),
        Some(
            MessageSizeTooLarge
                | InvalidMessageSize
                | InvalidMessage
                | InvalidRecord
                | MessageBatchTooLarge
                | TopicAuthorizationFailed
                | InvalidTopic
        )
    )
}

/// What one round did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Round {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows whose delivery failed.
    pub failed: usize,
    /// A delivery failed with an error that ends the idempotent producer's session.
    pub session_broken: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: u128, key: &str) -> OutboxRecord {
        OutboxRecord {
            id: uuid::Uuid::from_u128(n),
            topic: "payments".into(),
            aggregate_type: "payment".into(),
            aggregate_id: key.into(),
            event_type: "PaymentCaptured".into(),
            payload: "{}".into(),
            headers: Vec::new(),
            saga_id: None,
            created_at: chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default(),
            attempts: 0,
        }
    }

    /// Issue 32.5: key A's first row failed for now and its second was refused; re-sending the refused row
    /// alone would publish (and delete) it before its predecessor. Its key is stopped from the start.
    #[test]
    fn a_refused_row_waits_behind_a_row_of_its_key_that_failed_for_now() {
        let rows = [row(1, "a"), row(2, "b"), row(3, "a"), row(4, "c")];
        let stopped = keys_that_failed(&rows, &[rows[0].id]);
        assert!(stopped.contains("a"), "the refused row 3 of key a must not be sent alone");
        assert!(!stopped.contains("b") && !stopped.contains("c"), "{stopped:?}");
        assert!(keys_that_failed(&rows, &[]).is_empty());
    }
}

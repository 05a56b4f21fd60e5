//! The deduplicating consumer runner.
//!
//! Per batch (up to `batch_size` messages or `batch_timeout`, whichever comes first):
//! 1. messages without a valid `event_id` header are set aside for the dead-letter topic;
//! 2. one unit of work: `record_new` inserts every event id of the batch into `processed_event` in one
//!    statement (`ON CONFLICT DO NOTHING`), the handler runs only for the ids that were new, in partition
//!    order, then commit. A concurrent duplicate waits on that insert and sees the conflict;
//! 3. dead letters are published (and acknowledged) before anything else moves on;
//! 4. only then are the offsets committed.
//!
//! Failures: a transient store error rolls back and retries the same batch with backoff (never
//! dead-lettered, offsets untouched). A malformed event is dead-lettered at once; an event rejected by a
//! business rule is retried and dead-lettered after `max_rejections` attempts. Either way the batch is
//! re-applied without it, so one poison message never stalls its partition.
//!
//! # In detail
//!
//! `consumer::Runner` subscribes with `enable.auto.commit=false` and `enable.auto.offset.store=false`, and per
//! batch (up to `KAFKA_BATCH_SIZE` messages or `KAFKA_BATCH_TIMEOUT`):
//!
//! 1. validates `event_id` (UUID v4/v7, non-nil) and `saga_id` headers; invalid → dead-letter list;
//! 2. one unit of work: `INSERT INTO processed_event … SELECT FROM UNNEST … ORDER BY event_id ON CONFLICT DO
//!    NOTHING RETURNING event_id` (one statement per batch; a fixed lock order so concurrent batches cannot
//!    deadlock), then `EventHandler::handle_batch` for the first occurrence of each new id, in partition
//!    order, then commit. A concurrent duplicate (a rebalance overlap) waits on the insert and sees the conflict;
//! 3. dead letters go to `<topic>.dlq` with `dlq.reason`, `dlq.error`, `dlq.original.{topic,partition,offset}`,
//!    `dlq.consumer.group`, `dlq.failed.at` and the original headers, key and payload, and are acknowledged;
//! 4. only then the offsets (per partition, last + 1) are committed — only for partitions this member owns
//!    now. On revocation the runner commits the revoked partitions' positions and forgets them; a batch that
//!    straddled a revocation never commits the revoked partition (its new owner re-reads and dedups). Kafka's
//!    classic group protocol accepts an offset commit from any current member for any partition, so committing
//!    a stale map would move the owner's committed offset backwards (`consumer.rs`, `Offsets`; test
//!    `committed_offsets_never_move_backwards_across_rebalances`).
//!
//! Malformed events (unparsable body, missing field, key ≠ order id) are dead-lettered at once; events a
//! business rule refuses are retried `KAFKA_MAX_REJECTIONS` times, then dead-lettered; transient store errors
//! roll back and retry the same batch with backoff and are never dead-lettered. Transient means connection
//! loss, lock and statement timeouts, serialization failures, resource (53xxx), I/O (58xxx) and internal
//! (XX000) errors (`adapters-postgres/src/error.rs`, `is_transient_sqlstate`). When a set-based statement of
//! the whole batch fails, the batch is retried one event per transaction so a rejection lands on the event
//! that caused it, never on a neighbour.
//!
//! **Admission floor.** An event whose UUID v7 id carries a time older than `DEDUP_TTL − 1 h`
//! (`TtlPolicy::admission_floor`) is never applied: its dedup row may already be gone, so it goes to the
//! dead-letter topic with reason `older-than-dedup-window`. Every admitted event's row outlives any later
//! duplicate of it, so dropping dedup partitions by event time is safe; ids without a time (v4) are kept by
//! processing time. The one exception is deliberate: an operator's `idem dlq redrive --admit-late` writes a
//! `late_admission` row, and the consumer applies such an event in a transaction that marks the admission
//! applied (`apply_late_admission`), so it is applied once and later copies count as duplicates.
//!
//! **Kafka outages.** Client errors from `recv()` (transport, all brokers down, timeouts, coordinator,
//! rebalance) are logged, counted (`idem_consumer_kafka_errors`) and waited out with backoff; a consumer the
//! client declares fatally broken is replaced. Only a configuration the client refuses at creation stops the
//! runner. `idem serve` binds HTTP first, then creates topics and starts the consumer in the background,
//! retrying, so payments are accepted (into the outbox) while Kafka is down, including after a restart. The batch is re-applied
//! without the dead event, so a poison message never stalls its partition. Shutdown stops fetching, finishes or
//! rolls back the batch in hand, commits the last offsets synchronously and leaves the group.
//!
//! The order handler keeps `order_projection`: an event applies only if its `version` is greater than the
//! stored one (an upsert with `WHERE o.version < EXCLUDED.version`), so an older or repeated version changes
//! nothing. `OrderPlaced` charges through the same `charge_payment` use case as HTTP; `OrderCancelled` runs
//! the compensation as saga step `(saga_id, "refund-payment")` (`domain::saga`): claimed in the same unit, a
//! repeat returns the recorded outcome.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use idem_domain::wire::headers as wire;
use idem_domain::{Admission, EventId, TtlPolicy};
use idem_ports::{
    BatchError, Clock, EventHandler, HandlerError, InboundEvent, ProcessedEvent, StoreError, TransactionManager,
};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::client::{ConsumerSettings, KafkaConnection, ProducerSettings, breaks_session};

mod errors;
mod offsets;
mod stats;

pub use errors::{ClientErrorAction, RunnerError, classify_consumer_error};
use offsets::{Offsets, RunnerContext};
pub use stats::ConsumerStats;

/// Header carrying the event id.
pub const EVENT_ID_HEADER: &str = wire::EVENT_ID;
/// Dead-letter reason of an event older than the dedup window (see `TtlPolicy::admission_floor`).
pub const OLDER_THAN_DEDUP_WINDOW: &str = "older-than-dedup-window";

/// Dead-letter reason of an event whose id carries a time too far in the future.
pub const FUTURE_DATED: &str = "future-dated-event-id";

/// What records an event as applied, in the transaction that applies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dedup {
    /// `record_new` in the processed-event table (every event inside the dedup window).
    Window,
    /// The operator's admission of an event older than the window: the admission is marked applied and
    /// the processed row recorded, and the event applied only when both were new.
    LateAdmission,
}

/// Header carrying the saga id.
pub const SAGA_ID_HEADER: &str = wire::SAGA_ID;

/// Settings of one consumer.
#[derive(Debug, Clone)]
pub struct RunnerSettings {
    /// The consumer client.
    pub consumer: ConsumerSettings,
    /// The producer of dead letters.
    pub producer: ProducerSettings,
    /// The input topic.
    pub topic: String,
    /// Dead-letter topic (default `<topic>.dlq`).
    pub dlq_topic: String,
    /// Most messages per transaction (1 = one transaction per message).
    pub batch_size: usize,
    /// Longest wait to fill a batch once its first message arrived.
    pub batch_timeout: Duration,
    /// How many times an event rejected by a business rule is retried before it is dead-lettered.
    pub max_rejections: u32,
    /// Retention of processed-event rows.
    pub dedup_ttl: TtlPolicy,
    /// Longest time one batch's transaction may take, from BEGIN to COMMIT. One that takes longer (its
    /// connection black-holed by a failover, with no RST to end the wait) is abandoned: rolled back unless
    /// its commit was under way, and retried; the processed-event rows make the retry safe either way.
    pub transaction_timeout: Duration,
}

impl RunnerSettings {
    /// Defaults: batches of 100 or 20 ms, 3 rejections before dead-lettering, `<topic>.dlq`.
    pub fn new(cluster: impl Into<KafkaConnection>, group_id: &str, topic: &str, dedup_ttl: TtlPolicy) -> Self {
        let cluster = cluster.into();
        Self {
            consumer: ConsumerSettings::new(&cluster, group_id),
            producer: ProducerSettings::new(cluster),
            topic: topic.to_owned(),
            dlq_topic: format!("{topic}.dlq"),
            batch_size: 100,
            batch_timeout: Duration::from_millis(20),
            max_rejections: 3,
            dedup_ttl,
            transaction_timeout: Duration::from_secs(60),
        }
    }
}

/// A received message, detached from the consumer.
#[derive(Debug, Clone)]
struct Received {
    topic: String,
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    headers: Vec<(String, Vec<u8>)>,
    timestamp: Option<i64>,
}

impl Received {
    fn from_message(m: &BorrowedMessage<'_>) -> Self {
        let headers = m
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec())).collect())
            .unwrap_or_default();
        Self {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().unwrap_or_default().to_vec(),
            headers,
            timestamp: m.timestamp().to_millis(),
        }
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_slice())
    }

    /// Validates the identifying headers.
    fn to_event(&self) -> Result<InboundEvent, String> {
        let event_id = match self.header(EVENT_ID_HEADER) {
            None => return Err("missing event_id header".into()),
            Some(raw) => EventId::parse_bytes(raw).map_err(|e| format!("invalid event_id header: {e}"))?,
        };
        let saga_id = match self.header(SAGA_ID_HEADER) {
            None => None,
            Some(raw) => Some(
                std::str::from_utf8(raw)
                    .ok()
                    .and_then(|s| Uuid::try_parse(s.trim()).ok())
                    .filter(|u| !u.is_nil())
                    .ok_or_else(|| "invalid saga_id header: must be a non-nil UUID".to_owned())?,
            ),
        };
        Ok(InboundEvent {
            event_id: event_id.as_uuid(),
            saga_id,
            topic: self.topic.clone(),
            partition: self.partition,
            offset: self.offset,
            key: self.key.clone(),
            payload: self.payload.clone(),
        })
    }
}

struct DeadLetter {
    message: Received,
    reason: &'static str,
    error: String,
}

/// The consumer runner.
pub struct Runner {
    settings: RunnerSettings,
    tm: Arc<dyn TransactionManager>,
    clock: Arc<dyn Clock>,
    handler: Arc<dyn EventHandler>,
    stats: Arc<ConsumerStats>,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner").field("settings", &self.settings).finish_non_exhaustive()
    }
}

/// How one consumer instance's loop ended.
enum Consumed {
    /// Shutdown was asked.
    Stopped,
    /// The client reported a fatal error: the instance must be replaced.
    Broken(rdkafka::error::KafkaError),
}

async fn sleep_until_opt(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

enum BatchOutcome {
    Committed,
    /// An event failed for good or for now; `index` into the batch.
    EventFailed {
        index: usize,
        error: HandlerError,
    },
    Transient(StoreError),
}

impl Runner {
    /// A runner applying `handler` to `settings.topic` in units of work from `tm`.
    pub fn new(
        settings: RunnerSettings,
        tm: Arc<dyn TransactionManager>,
        clock: Arc<dyn Clock>,
        handler: Arc<dyn EventHandler>,
    ) -> Self {
        Self { settings, tm, clock, handler, stats: Arc::new(ConsumerStats::default()) }
    }

    /// Its metrics.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        self.stats.clone()
    }

    /// Consumes until `shutdown` is cancelled: stops fetching, finishes (or rolls back) the batch in
    /// hand, commits what committed, leaves the group.
    ///
    /// Broker outages, timeouts and rebalances never end it: they are logged, counted
    /// (`idem_consumer_kafka_errors`) and waited out with backoff; a consumer instance the client declares
    /// fatally broken is replaced by a new one. Only a configuration the client refuses at creation
    /// returns an error.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), RunnerError> {
        let producer: FutureProducer = self.settings.producer.client_config().create().map_err(RunnerError::Config)?;
        let mut rejections: HashMap<(i32, i64), u32> = HashMap::new();
        let mut backoff = Backoff::new();
        while !shutdown.is_cancelled() {
            let consumer: StreamConsumer<RunnerContext> = self
                .settings
                .consumer
                .client_config()
                .set("statistics.interval.ms", "5000")
                .create_with_context(RunnerContext { lag: self.stats.lag.clone(), offsets: Offsets::default() })
                .map_err(RunnerError::Config)?;
            consumer.subscribe(&[&self.settings.topic]).map_err(RunnerError::Config)?;
            tracing::info!(topic = %self.settings.topic, group = %self.settings.consumer.group_id, "consumer started");
            let outcome = self.consume(&consumer, &producer, &mut rejections, &shutdown).await;
            consumer.unsubscribe();
            match outcome {
                Consumed::Stopped => break,
                Consumed::Broken(e) => {
                    tracing::error!(error = %e, "Kafka consumer unusable; creating a new one");
                    if !backoff.wait(&shutdown).await {
                        break;
                    }
                }
            }
        }
        tracing::info!(topic = %self.settings.topic, "consumer stopped");
        Ok(())
    }

    async fn consume(
        &self,
        consumer: &StreamConsumer<RunnerContext>,
        producer: &FutureProducer,
        rejections: &mut HashMap<(i32, i64), u32>,
        shutdown: &CancellationToken,
    ) -> Consumed {
        let done = &consumer.context().offsets;
        let outcome = loop {
            let batch = match self.next_batch(consumer, shutdown).await {
                Ok(Some(batch)) => batch,
                Ok(None) => break Consumed::Stopped,
                Err(e) => break Consumed::Broken(e),
            };
            self.stats.received.inc_by(batch.len() as u64);
            let span = tracing::info_span!("batch", size = batch.len(), first_offset = batch[0].offset);
            let committed = self.process(producer, &batch, rejections, shutdown).instrument(span).await;
            if !committed {
                break Consumed::Stopped; // shutdown while the store was down: nothing committed or acknowledged
            }
            done.advance(&batch);
            // Async: a lost commit only means a redelivery, which the processed_event rows dedup.
            done.commit(consumer, CommitMode::Async);
            self.stats.batches.inc_by(1);
        };
        // Make the last positions durable before leaving the group (or replacing the consumer).
        done.commit(consumer, CommitMode::Sync);
        outcome
    }

    /// Receives one message. Client errors are waited out here (logged, counted, backoff) until a message
    /// arrives; `Ok(None)` on shutdown; `Err` only when the consumer instance must be replaced.
    async fn recv<'c>(
        &self,
        consumer: &'c StreamConsumer<RunnerContext>,
        shutdown: &CancellationToken,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Option<BorrowedMessage<'c>>, rdkafka::error::KafkaError> {
        let mut backoff = Backoff::new();
        loop {
            let received = tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                _ = sleep_until_opt(deadline) => return Ok(None),
                m = consumer.recv() => m,
            };
            match received {
                Ok(m) => return Ok(Some(m)),
                Err(e) => match classify_consumer_error(&e) {
                    ClientErrorAction::Ignore => {}
                    ClientErrorAction::Recreate => {
                        self.stats.kafka_errors.inc_by(1);
                        return Err(e);
                    }
                    ClientErrorAction::Retry => {
                        self.stats.kafka_errors.inc_by(1);
                        tracing::warn!(error = %e, "Kafka client error; retrying");
                        if !backoff.wait(shutdown).await {
                            return Ok(None);
                        }
                    }
                },
            }
        }
    }

    /// Waits for the first message (or shutdown), then fills the batch up to its size or timeout.
    async fn next_batch(
        &self,
        consumer: &StreamConsumer<RunnerContext>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Vec<Received>>, rdkafka::error::KafkaError> {
        let Some(first) = self.recv(consumer, shutdown, None).await? else { return Ok(None) };
        let mut batch = vec![Received::from_message(&first)];
        drop(first);
        let deadline = tokio::time::Instant::now() + self.settings.batch_timeout;
        while batch.len() < self.settings.batch_size {
            match self.recv(consumer, shutdown, Some(deadline)).await? {
                Some(next) => batch.push(Received::from_message(&next)),
                None => break,
            }
        }
        Ok(Some(batch))
    }

    /// Applies a batch until it commits (returns true) or shutdown interrupts a transient outage (false).
    async fn process(
        &self,
        producer: &FutureProducer,
        batch: &[Received],
        rejections: &mut HashMap<(i32, i64), u32>,
        shutdown: &CancellationToken,
    ) -> bool {
        let mut dead = Vec::new();
        let mut events = Vec::with_capacity(batch.len());
        let mut too_old = Vec::new();
        let now = self.clock.now();
        let ttl = self.settings.dedup_ttl;
        let floor = ttl.admission_floor(now);
        for m in batch {
            match m.to_event() {
                // Ids without a time (v4) have no age to check: they are retained by processing time.
                Ok(e) => match idem_domain::uuid_v7_time(e.event_id).map(|t| (t, ttl.admission(now, Some(t)))) {
                    None | Some((_, Admission::Admitted)) => events.push((m, e)),
                    // Its dedup row may already be gone: applying it could apply it twice.
                    Some((t, Admission::TooOld)) => too_old.push((m, e, t)),
                    Some((t, Admission::FutureDated)) => dead.push(DeadLetter {
                        message: m.clone(),
                        reason: FUTURE_DATED,
                        error: format!(
                            "event time {} is more than {} s ahead of this consumer's clock: the producer's clock is wrong",
                            t.to_rfc3339(),
                            idem_domain::MAX_FUTURE_SKEW.as_secs()
                        ),
                    }),
                },
                Err(error) => dead.push(DeadLetter { message: m.clone(), reason: "invalid-headers", error }),
            }
        }
        // Older than the dedup window: applied only if an operator admitted it (once), else dead-lettered.
        let Some(admitted) = self.late_admitted(&too_old, shutdown).await else {
            return false;
        };
        let mut late = Vec::new();
        for (m, e, t) in too_old {
            if admitted.contains(&e.event_id) {
                late.push((m, e));
                continue;
            }
            dead.push(DeadLetter {
                message: m.clone(),
                reason: OLDER_THAN_DEDUP_WINDOW,
                error: format!(
                    "event time {} is before the admission floor {} (DEDUP_TTL less {} s); re-drive it deliberately if it must be applied",
                    t.to_rfc3339(),
                    floor.to_rfc3339(),
                    idem_domain::ADMISSION_MARGIN.as_secs()
                ),
            });
        }
        let mut backoff = Backoff::new();
        // After a failure the handler could not pin on one event (a set-based statement of the whole
        // batch), the rest of the batch runs one event per transaction, so the failure lands on the event
        // that causes it and never on an innocent neighbour.
        let mut isolating = false;
        loop {
            let outcome = if isolating {
                self.apply_one_by_one(&mut events).await
            } else {
                let only_events: Vec<&InboundEvent> = events.iter().map(|(_, e)| e).collect();
                self.apply(&only_events, Dedup::Window).await
            };
            match outcome {
                BatchOutcome::Committed => break,
                BatchOutcome::EventFailed { error: HandlerError::Store(e), .. } if events.len() > 1 && !isolating => {
                    tracing::warn!(error = %e, "batch failed in a set-based statement; retrying event by event");
                    isolating = true;
                }
                BatchOutcome::Transient(e) => {
                    self.stats.transient_failures.inc_by(1);
                    tracing::warn!(error = %e, "batch rolled back on a transient failure; retrying");
                    if !backoff.wait(shutdown).await {
                        return false;
                    }
                }
                BatchOutcome::EventFailed { index, error } => {
                    let (msg, event) = &events[index];
                    let key = (event.partition, event.offset);
                    let (reason, give_up) = match &error {
                        HandlerError::Malformed(_) => ("malformed", true),
                        HandlerError::Rejected(_) | HandlerError::Store(_) => {
                            let n = rejections.entry(key).or_insert(0);
                            *n += 1;
                            ("rejected", *n > self.settings.max_rejections)
                        }
                    };
                    tracing::warn!(event_id = %event.event_id, partition = event.partition, offset = event.offset, error = %error, give_up, "event failed");
                    if give_up {
                        rejections.remove(&key);
                        dead.push(DeadLetter { message: (*msg).clone(), reason, error: error.to_string() });
                        events.remove(index);
                    } else if !backoff.wait(shutdown).await {
                        return false;
                    }
                }
            }
        }
        // Late admissions after the rest of the batch, one transaction each (rare: an operator's re-drive).
        for (m, e) in late {
            loop {
                match self.apply(&[&e], Dedup::LateAdmission).await {
                    BatchOutcome::Committed => break,
                    BatchOutcome::Transient(err) => {
                        tracing::warn!(error = %err, "late admission rolled back on a transient failure; retrying");
                        if !backoff.wait(shutdown).await {
                            return false;
                        }
                    }
                    BatchOutcome::EventFailed { error, .. } => {
                        let reason = if matches!(error, HandlerError::Malformed(_)) { "malformed" } else { "rejected" };
                        dead.push(DeadLetter { message: m.clone(), reason, error: error.to_string() });
                        break;
                    }
                }
            }
        }
        // dead letters of a partition go out in offset order, whichever step refused them
        dead.sort_by_key(|d| (d.message.partition, d.message.offset));
        for d in &dead {
            if !self.dead_letter(producer, d, shutdown).await {
                return false;
            }
        }
        // every message of the batch is applied or dead-lettered now: its rejection count is done with
        for m in batch {
            rejections.remove(&(m.partition, m.offset));
        }
        self.stats.retrying.set(rejections.len() as i64);
        true
    }

    /// One unit of work per event, in order; committed events leave `events`. On a failure, `index` 0 is
    /// the failing event (the first one left).
    async fn apply_one_by_one(&self, events: &mut Vec<(&Received, InboundEvent)>) -> BatchOutcome {
        while let Some((_, event)) = events.first() {
            match self.apply(&[event], Dedup::Window).await {
                BatchOutcome::Committed => {
                    events.remove(0);
                }
                BatchOutcome::EventFailed { error, .. } => return BatchOutcome::EventFailed { index: 0, error },
                transient @ BatchOutcome::Transient(_) => return transient,
            }
        }
        BatchOutcome::Committed
    }

    /// The ids among `too_old` an operator admitted late; `None` on shutdown.
    async fn late_admitted(
        &self,
        too_old: &[(&Received, InboundEvent, chrono::DateTime<chrono::Utc>)],
        shutdown: &CancellationToken,
    ) -> Option<HashSet<Uuid>> {
        if too_old.is_empty() {
            return Some(HashSet::new());
        }
        let ids: Vec<Uuid> = too_old.iter().map(|(_, e, _)| e.event_id).collect();
        let mut backoff = Backoff::new();
        loop {
            let found = async {
                let mut uow = self.tm.begin().await?;
                uow.processed_events().late_admitted(&self.settings.consumer.group_id, &ids).await
            };
            match found.await {
                Ok(admitted) => return Some(admitted.into_iter().collect()),
                Err(e) => {
                    self.stats.transient_failures.inc_by(1);
                    tracing::warn!(error = %e, "reading late admissions failed; retrying");
                    if !backoff.wait(shutdown).await {
                        return None;
                    }
                }
            }
        }
    }

    /// One unit of work over the batch. `dedup` says what records the events as applied.
    /// [`Self::apply_unbounded`] within `transaction_timeout`.
    async fn apply(&self, events: &[&InboundEvent], dedup: Dedup) -> BatchOutcome {
        let limit = self.settings.transaction_timeout;
        match tokio::time::timeout(limit, self.apply_unbounded(events, dedup)).await {
            Ok(outcome) => outcome,
            Err(_) => BatchOutcome::Transient(StoreError::Unavailable(format!(
                "the batch's transaction did not end within {} s: abandoned (rolled back unless its commit was \
                 under way) and retried",
                limit.as_secs()
            ))),
        }
    }

    async fn apply_unbounded(&self, events: &[&InboundEvent], dedup: Dedup) -> BatchOutcome {
        // Store failures outside the handler are never blamed on an event: retried, never dead-lettered.
        let failed = |e: StoreError| {
            if !e.is_transient() {
                tracing::error!(error = %e, "processed-event bookkeeping failed");
            }
            BatchOutcome::Transient(e)
        };
        if events.is_empty() {
            return BatchOutcome::Committed;
        }
        let mut uow = match self.tm.begin().await {
            Ok(u) => u,
            Err(e) => return BatchOutcome::Transient(e),
        };
        let now = self.clock.now();
        let ttl = self.settings.dedup_ttl;
        let rows: Vec<ProcessedEvent> = events
            .iter()
            .map(|e| ProcessedEvent {
                event_id: e.event_id,
                topic: e.topic.clone(),
                expires_at: ttl.retain_until(now, idem_domain::uuid_v7_time(e.event_id)),
            })
            .collect();
        let consumer = &self.settings.consumer.group_id;
        // Every application records the event's processed row, late admissions too: the row of an
        // earlier application may still be alive (a duplicate refused a minute after the first delivery
        // crossed the floor), and then the admitted copy is a duplicate.
        let mut fresh: HashSet<Uuid> = match uow.processed_events().record_new(consumer, &rows, now).await {
            Ok(ids) => ids.into_iter().collect(),
            Err(e) => return failed(e),
        };
        if dedup == Dedup::LateAdmission {
            // ... and the admission is consumed in the same transaction: applied only when both are new.
            for row in &rows {
                match uow.processed_events().apply_late_admission(consumer, row.event_id, now).await {
                    Ok(true) => {}
                    Ok(false) => {
                        fresh.remove(&row.event_id);
                    }
                    Err(e) => return failed(e),
                }
            }
        }
        // First occurrence of each new event id, in partition order.
        let mut applied = HashSet::with_capacity(fresh.len());
        let mut to_apply: Vec<(usize, &InboundEvent)> = Vec::with_capacity(fresh.len());
        for (index, event) in events.iter().enumerate() {
            if fresh.contains(&event.event_id) && applied.insert(event.event_id) {
                to_apply.push((index, event));
            }
        }
        let duplicates = (events.len() - to_apply.len()) as u64;
        let batch: Vec<&InboundEvent> = to_apply.iter().map(|(_, e)| *e).collect();
        match self.handler.handle_batch(uow.as_mut(), &batch).await {
            Ok(()) => {}
            Err(BatchError { error: HandlerError::Store(e), .. }) if e.is_transient() => {
                return BatchOutcome::Transient(e);
            }
            Err(BatchError { index, error }) => {
                let index = to_apply.get(index).map_or(0, |(i, _)| *i);
                return BatchOutcome::EventFailed { index, error };
            }
        }
        match uow.commit().await {
            Ok(()) => {
                self.stats.processed.inc_by(applied.len() as u64);
                self.stats.duplicates.inc_by(duplicates);
                BatchOutcome::Committed
            }
            Err(e) => BatchOutcome::Transient(e),
        }
    }

    /// Publishes a dead letter and waits for its acknowledgement (retrying until shutdown).
    async fn dead_letter(&self, producer: &FutureProducer, d: &DeadLetter, shutdown: &CancellationToken) -> bool {
        let m = &d.message;
        let (partition, offset) = (m.partition.to_string(), m.offset.to_string());
        let failed_at = self.clock.now().to_rfc3339();
        let mut headers = OwnedHeaders::new();
        // Provenance is ours alone: `dlq.*` headers a producer sent are dropped, or they would pass for it
        // (a forged `dlq.original.topic` redirected a re-drive to any topic).
        for (k, v) in m.headers.iter().filter(|(k, _)| !k.starts_with(wire::dlq::PREFIX)) {
            headers = headers.insert(Header { key: k, value: Some(v) });
        }
        for (k, v) in [
            (wire::dlq::REASON, d.reason),
            (wire::dlq::ERROR, d.error.as_str()),
            (wire::dlq::ORIGINAL_TOPIC, m.topic.as_str()),
            (wire::dlq::ORIGINAL_PARTITION, partition.as_str()),
            (wire::dlq::ORIGINAL_OFFSET, offset.as_str()),
            (wire::dlq::CONSUMER_GROUP, self.settings.consumer.group_id.as_str()),
            (wire::dlq::FAILED_AT, failed_at.as_str()),
        ] {
            headers = headers.insert(Header { key: k, value: Some(v.as_bytes()) });
        }
        let mut backoff = Backoff::new();
        // A new producer session, once the broker rejected the shared one.
        let mut fresh: Option<FutureProducer> = None;
        loop {
            let producer = fresh.as_ref().unwrap_or(producer);
            let mut record = FutureRecord::to(&self.settings.dlq_topic).payload(&m.payload).headers(headers.clone());
            if let Some(key) = &m.key {
                record = record.key(key);
            }
            if let Some(ts) = m.timestamp {
                record = record.timestamp(ts);
            }
            match producer.send(record, Duration::from_secs(10)).await {
                Ok(_) => {
                    self.stats.dead_lettered.inc_by(1);
                    tracing::warn!(topic = %self.settings.dlq_topic, reason = d.reason, error = %d.error, partition = m.partition, offset = m.offset, "message dead-lettered");
                    return true;
                }
                Err((e, _)) => {
                    tracing::warn!(error = %e, "dead-letter publish failed; retrying");
                    if breaks_session(&e) {
                        match self.settings.producer.client_config().create() {
                            Ok(p) => fresh = Some(p),
                            Err(e) => tracing::error!(error = %e, "cannot create a new producer"),
                        }
                    }
                    if !backoff.wait(shutdown).await {
                        return false;
                    }
                }
            }
        }
    }
}

/// The consumer's retry schedule: 50 ms doubling to 5 s, with jitter.
struct Backoff(idem_ports::Backoff);

impl Backoff {
    fn new() -> Self {
        Self(idem_ports::Backoff::new(Duration::from_millis(50), Duration::from_secs(5)))
    }

    /// Sleeps; false when shutdown came first.
    async fn wait(&mut self, shutdown: &CancellationToken) -> bool {
        crate::pause(self.0.next_delay(), shutdown).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::error::{KafkaError, RDKafkaErrorCode};

    #[test]
    fn broker_trouble_is_retried_and_only_a_fatal_client_is_replaced() {
        for code in [
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::OperationTimedOut,
            RDKafkaErrorCode::RequestTimedOut,
            RDKafkaErrorCode::NotCoordinator,
            RDKafkaErrorCode::CoordinatorNotAvailable,
            RDKafkaErrorCode::RebalanceInProgress,
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::PollExceeded,
        ] {
            assert_eq!(
                classify_consumer_error(&KafkaError::MessageConsumption(code)),
                ClientErrorAction::Retry,
                "{code:?}"
            );
        }
        assert_eq!(classify_consumer_error(&KafkaError::PartitionEOF(0)), ClientErrorAction::Ignore);
        assert_eq!(
            classify_consumer_error(&KafkaError::MessageConsumptionFatal(RDKafkaErrorCode::Fatal)),
            ClientErrorAction::Recreate
        );
    }
}

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
//! business rule is retried and dead-lettered after `max_rejections` attempts (the default [`RetryPolicy`];
//! `RunnerSettings::retry` chooses per error what is retried, how long, and what goes at once). Either way the batch is
//! re-applied without it, so one poison message never stalls its partition.
//!
//! # In detail
//!
//! `consumer::Runner` subscribes with `enable.auto.commit=false` and `enable.auto.offset.store=false`, and per
//! batch (up to `RunnerSettings::batch_size` messages or `batch_timeout`):
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
//! Under the default [`RetryPolicy`], malformed events (unparsable body, missing field) are dead-lettered at
//! once and events a business rule refuses are retried `RunnerSettings::max_rejections` times, then dead-lettered; transient store errors
//! roll back and retry the same batch with backoff and are never dead-lettered. Transient means connection
//! loss, lock and statement timeouts, serialization failures, resource (53xxx), I/O (58xxx) and internal
//! (XX000) errors (`adapters-postgres/src/error.rs`, `is_transient_sqlstate`). When a set-based statement of
//! the whole batch fails, the batch is retried one event per transaction so a rejection lands on the event
//! that caused it, never on a neighbour.
//!
//! **Admission floor.** An event whose UUID v7 id carries a time older than the dedup TTL less 1 h
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
//! runner. The facade's `Background` (and `idem serve`) creates topics and starts consumers in the background,
//! retrying, so a service's HTTP API works (writing to the outbox) while Kafka is down, including after a restart. The batch is re-applied
//! without the dead event, so a poison message never stalls its partition. Shutdown stops fetching, finishes or
//! rolls back the batch in hand, commits the last offsets synchronously and leaves the group.
//!
//! (The reference payment service's order handler, `idem_domain::usecases::OrderEventHandler`, is one such
//! handler: README, "For producers to `orders`".)

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use idem_domain::wire::headers as wire;
use idem_domain::{EventId, TtlPolicy};
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

mod admission;
mod apply;
pub mod dead_letters;
mod errors;
mod offsets;
mod received;
mod retry;
mod stats;

use apply::{BatchOutcome, Dedup};
use dead_letters::DeadLetter;
use received::Received;

pub use errors::{ClientErrorAction, RunnerError, classify_consumer_error};
use offsets::{Offsets, RunnerContext};
pub use retry::{Failure, RetryPolicy, Verdict};
pub use stats::ConsumerStats;

/// Header carrying the event id.
pub const EVENT_ID_HEADER: &str = wire::EVENT_ID;
/// Dead-letter reason of an event older than the dedup window (see `TtlPolicy::admission_floor`).
pub const OLDER_THAN_DEDUP_WINDOW: &str = "older-than-dedup-window";

/// Dead-letter reason of an event whose id carries a time too far in the future.
pub const FUTURE_DATED: &str = "future-dated-event-id";

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
    /// How many times an event rejected by a business rule is retried before it is dead-lettered (the
    /// default policy's bound; see [`Self::retry`]).
    pub max_rejections: u32,
    /// Which failed events are retried, how long, and which are dead-lettered at once; `None`:
    /// [`RetryPolicy::rejections`] with [`Self::max_rejections`].
    pub retry: Option<RetryPolicy>,
    /// Retention of processed-event rows.
    pub dedup_ttl: TtlPolicy,
    /// Longest time one batch's transaction may take, from BEGIN to COMMIT. One that takes longer (its
    /// connection black-holed by a failover, with no RST to end the wait) is abandoned: rolled back unless
    /// its commit was under way, and retried; the processed-event rows make the retry safe either way.
    pub transaction_timeout: Duration,
    /// Setting changes accepted deliberately (`consumer-group`, `dedup-storage`). Before it consumes, the
    /// runner checks its group, topic, dedup storage and dedup retention against what earlier starts
    /// recorded in the store (`TransactionManager::check_consumer`): **renaming the group** of a topic
    /// would start a group with no processed rows from the earliest offset and apply every event in the
    /// topic again, and **switching the dedup storage** would not read the rows that record what was
    /// processed, so both are refused ([`RunnerError::Settings`]) unless accepted here — after copying
    /// the old group's rows (README, "Changing settings"). A raised `dedup_ttl` is recorded and handled.
    pub accept_setting_changes: Vec<String>,
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
            retry: None,
            dedup_ttl,
            transaction_timeout: Duration::from_secs(60),
            accept_setting_changes: Vec::new(),
        }
    }

    /// The dead-letter producer's configuration: idem's producer with [`Self::dead_letter_max_bytes`].
    pub fn dead_letter_producer(&self) -> rdkafka::ClientConfig {
        let mut config = self.producer.client_config();
        config.set("message.max.bytes", self.dead_letter_max_bytes().to_string());
        config
    }

    /// The dead-letter producer's `message.max.bytes`: the largest message the consumer may fetch
    /// (`fetch.message.max.bytes`, 1 MiB by default) or produce, whichever is larger, plus 64 KiB for the
    /// provenance headers. A dead letter larger still is sent cut ([`dead_letters`]).
    pub fn dead_letter_max_bytes(&self) -> usize {
        let configured = |name: &str, default: usize| {
            self.producer.connection.property(name).and_then(|v| v.parse().ok()).unwrap_or(default)
        };
        let consumer = self.consumer.connection.property("fetch.message.max.bytes").and_then(|v| v.parse().ok());
        consumer.unwrap_or(1_048_576).max(configured("message.max.bytes", 1_000_000)) + 64 * 1024
    }
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
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<(), RunnerError> {
        let Some(raise) = self.check_settings(&shutdown).await? else { return Ok(()) };
        if let Some(r) = raise {
            self.settings.dedup_ttl = self.settings.dedup_ttl.raised_from(r.from, r.since);
        }
        let producer: FutureProducer = self.settings.dead_letter_producer().create().map_err(RunnerError::Config)?;
        let mut rejections: Failures = HashMap::new();
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

    /// The settings check of [`RunnerSettings::accept_setting_changes`], retried while the store is
    /// unreachable; `None` on shutdown.
    async fn check_settings(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<Option<Option<idem_ports::RetentionRaise>>, RunnerError> {
        let mut backoff = Backoff::new();
        loop {
            let identity = idem_ports::ConsumerIdentity {
                group: self.settings.consumer.group_id.clone(),
                topic: self.settings.topic.clone(),
                dedup_ttl: self.settings.dedup_ttl.ttl(),
                accept: self.settings.accept_setting_changes.clone(),
                now: self.clock.now(),
            };
            match self.tm.check_consumer(&identity).await {
                Ok(raise) => return Ok(Some(raise)),
                Err(idem_ports::SettingsCheckError::Refused(why)) => {
                    tracing::error!(topic = %self.settings.topic, group = %self.settings.consumer.group_id, "{why}");
                    return Err(RunnerError::Settings(why));
                }
                Err(idem_ports::SettingsCheckError::Store(e)) => {
                    tracing::warn!(error = %e, "cannot check the consumer's recorded settings; retrying");
                    if !backoff.wait(shutdown).await {
                        return Ok(None);
                    }
                }
            }
        }
    }

    async fn consume(
        &self,
        consumer: &StreamConsumer<RunnerContext>,
        producer: &FutureProducer,
        rejections: &mut Failures,
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
            self.stats.batch_started.set(self.clock.now().timestamp());
            let span = tracing::info_span!("batch", size = batch.len(), first_offset = batch[0].offset);
            let committed = self.process(producer, &batch, rejections, shutdown).instrument(span).await;
            if !committed {
                break Consumed::Stopped; // shutdown while the store was down: nothing committed or acknowledged
            }
            done.advance(&batch);
            // Async: a lost commit only means a redelivery, which the processed_event rows dedup.
            done.commit(consumer, CommitMode::Async);
            self.stats.batches.inc_by(1);
            self.stats.batch_started.set(0);
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
        rejections: &mut Failures,
        shutdown: &CancellationToken,
    ) -> bool {
        let now = self.clock.now();
        let ttl = self.settings.dedup_ttl;
        let floor = ttl.admission_floor(now);
        let admission::Sorted { mut events, too_old, mut dead } = admission::sort(batch, now, ttl);
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
                    let reason = if matches!(error, HandlerError::Malformed(_)) { "malformed" } else { "rejected" };
                    let (attempts, since) = rejections.entry(key).or_insert((0, std::time::Instant::now()));
                    *attempts += 1;
                    let failure = Failure { error: &error, attempts: *attempts, failing_for: since.elapsed() };
                    let verdict = match &self.settings.retry {
                        Some(policy) => policy.decide(&failure),
                        None => RetryPolicy::rejections(self.settings.max_rejections).decide(&failure),
                    };
                    tracing::warn!(event_id = %event.event_id, partition = event.partition, offset = event.offset, error = %error, ?verdict, "event failed");
                    let waited = match verdict {
                        Verdict::DeadLetter => {
                            rejections.remove(&key);
                            dead.push(DeadLetter { message: (*msg).clone(), reason, error: error.to_string() });
                            events.remove(index);
                            true
                        }
                        Verdict::Retry => backoff.wait(shutdown).await,
                        Verdict::RetryAfter(after) => tokio::select! {
                            _ = shutdown.cancelled() => false,
                            _ = tokio::time::sleep(after) => true,
                        },
                    };
                    if !waited {
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
}

/// Failures of events not applied yet, by partition and offset: how many, and since when.
type Failures = HashMap<(i32, i64), (u32, std::time::Instant)>;

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

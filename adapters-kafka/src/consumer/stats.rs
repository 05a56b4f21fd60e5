//! The consumer's counters and lag gauge.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Counters of a running consumer (Prometheus counters; register them with [`ConsumerStats::register`]).
#[derive(Debug, Default)]
pub struct ConsumerStats {
    /// Messages fetched.
    pub received: Counter,
    /// Events applied (new ids, committed).
    pub processed: Counter,
    /// Events skipped as already processed.
    pub duplicates: Counter,
    /// Messages dead-lettered.
    pub dead_lettered: Counter,
    /// Dead-letter publishes that failed (each retried, or for a permanent error sent cut).
    pub dead_letter_failures: Counter,
    /// When the batch in hand was received (Unix seconds), 0 while waiting for messages: a batch that
    /// neither commits nor rolls back shows here whether or not the client still polls.
    pub batch_started: Gauge,
    /// Batches committed.
    pub batches: Counter,
    /// Batches rolled back on a transient failure.
    pub transient_failures: Counter,
    /// Errors reported by the Kafka client (transport, timeouts, rebalance); each is waited out.
    pub kafka_errors: Counter,
    /// Messages behind the partitions' high watermarks, from librdkafka's statistics (every 5 s).
    pub lag: Gauge,
    /// Events a rule refused that wait for another attempt (their rejection counts are kept until the
    /// event is applied or dead-lettered, never longer).
    pub retrying: Gauge,
}

impl ConsumerStats {
    /// Registers the metrics under `idem_consumer_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("idem_consumer");
        r.register("messages_received", "Messages fetched from the input topic", self.received.clone());
        r.register("events_processed", "Events applied (new event ids, committed)", self.processed.clone());
        r.register("events_duplicate", "Events skipped as already processed (same event_id)", self.duplicates.clone());
        r.register("messages_dead_lettered", "Messages sent to the dead-letter topic", self.dead_lettered.clone());
        r.register(
            "dead_letter_failures",
            "Dead-letter publishes that failed (retried; a permanent refusal is sent again cut)",
            self.dead_letter_failures.clone(),
        );
        r.register(
            "batch_started_timestamp_seconds",
            "When the batch in hand was received (Unix seconds); 0 while waiting for messages",
            self.batch_started.clone(),
        );
        r.register("batches_committed", "Batches committed (database, then offsets)", self.batches.clone());
        r.register(
            "transient_failures",
            "Batches rolled back on a transient failure and retried",
            self.transient_failures.clone(),
        );
        r.register(
            "kafka_errors",
            "Errors reported by the Kafka client (transport, timeout, rebalance), retried with backoff",
            self.kafka_errors.clone(),
        );
        r.register("lag_messages", "Consumer lag summed over assigned partitions", self.lag.clone());
        r.register(
            "events_retrying",
            "Events refused by a rule that wait for another attempt before the dead-letter topic",
            self.retrying.clone(),
        );
    }
}

//! rdkafka client configurations, each setting with the reason it is there.

use std::time::Duration;

use rdkafka::ClientConfig;

/// Producer settings. The producer is configured for safety first.
#[derive(Debug, Clone)]
pub struct ProducerSettings {
    /// Bootstrap servers (`host:port,…`).
    pub brokers: String,
    /// How long a message may take to be acknowledged, retries included, before its delivery fails
    /// (`delivery.timeout.ms`). A failed delivery may still have been written: receivers dedup by event_id.
    pub delivery_timeout: Duration,
    /// `linger.ms`: how long to wait to fill a batch. 1 ms: the relay hands a whole claim to the producer at
    /// once, so its batches are already full; lingering only delays the round. With 5 ms the relay bench's
    /// p99 commit-to-publish at 1,000 msg/s was 40–81 ms, with 1 ms 16–24 ms (BENCHMARKS.md).
    pub linger: Duration,
}

impl ProducerSettings {
    /// The settings idem uses, for `brokers`.
    pub fn new(brokers: &str) -> Self {
        Self {
            brokers: brokers.to_owned(),
            delivery_timeout: Duration::from_secs(30),
            linger: Duration::from_millis(1),
        }
    }

    /// The librdkafka configuration, every setting with its reason.
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            // Idempotent producer: the broker drops retried duplicates within this producer session and
            // keeps per-partition order across retries.
            .set("enable.idempotence", "true")
            // A write counts only once every in-sync replica has it.
            .set("acks", "all")
            // At most 5 in flight per connection: the bound under which idempotence keeps ordering.
            .set("max.in.flight.requests.per.connection", "5")
            // Retry transient errors until the delivery timeout, not a fixed count.
            .set("retries", "2147483647")
            .set("delivery.timeout.ms", self.delivery_timeout.as_millis().to_string())
            .set("request.timeout.ms", "10000")
            .set("linger.ms", self.linger.as_millis().to_string())
            // The Java client's partitioner (murmur2 of the key, random for null keys): a key lands on the
            // same partition whichever client (Java, Go with a murmur2 balancer, librdkafka) produced it.
            .set("partitioner", "murmur2_random")
            .set("compression.type", "lz4")
            .set("message.max.bytes", "1000000");
        c
    }
}

/// Consumer settings.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// Bootstrap servers.
    pub brokers: String,
    /// Consumer group.
    pub group_id: String,
    /// `session.timeout.ms`: how long the group waits for a silent member before rebalancing.
    pub session_timeout: Duration,
    /// `max.poll.interval.ms`: how long the runner may go without polling (a batch retried through a
    /// database outage) before the member leaves the group; it rejoins at its next poll.
    pub max_poll_interval: Duration,
}

impl ConsumerSettings {
    /// The settings idem uses, for `brokers` and `group_id`.
    pub fn new(brokers: &str, group_id: &str) -> Self {
        Self {
            brokers: brokers.to_owned(),
            group_id: group_id.to_owned(),
            session_timeout: Duration::from_secs(10),
            max_poll_interval: Duration::from_secs(300),
        }
    }

    /// The librdkafka configuration (auto commit and offset store off).
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group_id)
            // Offsets are committed by the runner only after the database transaction of their messages
            // committed: never automatically, and never stored automatically on delivery to the app.
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // A new group starts from the beginning: no event is skipped.
            .set("auto.offset.reset", "earliest")
            // Skip messages of aborted producer transactions.
            .set("isolation.level", "read_committed")
            .set("session.timeout.ms", self.session_timeout.as_millis().to_string())
            .set("heartbeat.interval.ms", (self.session_timeout.as_millis() / 4).max(100).to_string())
            .set("max.poll.interval.ms", self.max_poll_interval.as_millis().to_string());
        c
    }
}

/// Errors after which the idempotent producer session cannot continue (its producer id or epoch is no
/// longer accepted): a new producer is needed.
pub(crate) fn breaks_session(e: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::error::RDKafkaErrorCode::*;
    matches!(
        e.rdkafka_error_code(),
        Some(ProducerFenced | InvalidProducerEpoch | OutOfOrderSequenceNumber | UnknownProducerId | Fatal)
    )
}

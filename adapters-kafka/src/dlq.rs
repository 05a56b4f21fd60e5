//! Reading and re-driving the dead-letter topic (`idem dlq`).
//!
//! A dead letter is the original message (key, payload, every header, `event_id` included) plus `dlq.*`
//! provenance headers written by the consumer (`consumer.rs::dead_letter`). Re-driving produces the original
//! message again to its source topic — same key, payload and headers, without the `dlq.*` ones — so the
//! consumer's dedup by `event_id` still holds.
//!
//! Provenance cannot be forged by whoever produces to the source topic: the consumer drops incoming `dlq.*`
//! headers before it appends its own, a provenance header is read from its last occurrence (the one the
//! consumer appended, also on dead letters written before that), and a re-drive goes to the topic the
//! caller names — `idem dlq redrive` names the consumer's own topic unless the operator names another.

use std::time::Duration;

use rdkafka::Offset;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use uuid::Uuid;

use idem_domain::wire::headers as wire;

use crate::client::KafkaConnection;
use crate::consumer::EVENT_ID_HEADER;

/// Prefix of the provenance headers the consumer adds to a dead letter.
pub const DLQ_HEADER_PREFIX: &str = wire::dlq::PREFIX;
/// Header a re-driven message carries: the dead letter it came from (`topic/partition/offset`).
pub const REDRIVEN_FROM_HEADER: &str = wire::REDRIVEN_FROM;

/// One message of the dead-letter topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterMessage {
    /// Partition in the dead-letter topic.
    pub partition: i32,
    /// Offset there.
    pub offset: i64,
    /// The original key.
    pub key: Option<Vec<u8>>,
    /// The original payload.
    pub payload: Vec<u8>,
    /// Every header: the original ones and the `dlq.*` provenance.
    pub headers: Vec<(String, Vec<u8>)>,
}

impl DeadLetterMessage {
    /// A header's value as text: the first occurrence, or for a `dlq.*` provenance header the last (the
    /// one the consumer appended).
    pub fn header(&self, name: &str) -> Option<String> {
        let text = |(_, v): &(String, Vec<u8>)| String::from_utf8_lossy(v).into_owned();
        if name.starts_with(DLQ_HEADER_PREFIX) {
            self.headers.iter().rev().find(|(k, _)| k == name).map(text)
        } else {
            self.headers.iter().find(|(k, _)| k == name).map(text)
        }
    }

    /// `dlq.reason` (empty if absent).
    pub fn reason(&self) -> String {
        self.header(wire::dlq::REASON).unwrap_or_default()
    }

    /// `dlq.original.topic`.
    pub fn source_topic(&self) -> Option<String> {
        self.header(wire::dlq::ORIGINAL_TOPIC)
    }

    /// `dlq.failed.at`.
    pub fn failed_at(&self) -> Option<chrono::DateTime<chrono::Utc>> {
        let at = self.header(wire::dlq::FAILED_AT)?;
        chrono::DateTime::parse_from_rfc3339(&at).ok().map(|t| t.with_timezone(&chrono::Utc))
    }

    /// The original `event_id`, when valid.
    pub fn event_id(&self) -> Option<Uuid> {
        self.header(EVENT_ID_HEADER).and_then(|v| Uuid::parse_str(&v).ok())
    }

    /// The original payload's size when the dead letter was cut to fit (`dlq.original.size`): its payload
    /// is only the start of the original, which stays at its source position.
    pub fn cut_from(&self) -> Option<u64> {
        self.header(wire::dlq::ORIGINAL_SIZE).and_then(|v| v.parse().ok())
    }

    /// `dlq.consumer.group`.
    pub fn consumer_group(&self) -> Option<String> {
        self.header(wire::dlq::CONSUMER_GROUP)
    }

    /// The headers of the original message (provenance headers removed).
    pub fn original_headers(&self) -> impl Iterator<Item = &(String, Vec<u8>)> {
        self.headers.iter().filter(|(k, _)| !k.starts_with(DLQ_HEADER_PREFIX) && k != REDRIVEN_FROM_HEADER)
    }
}

/// Reads every message of `topic` present when called (up to each partition's high watermark), without
/// joining a group or committing anything. `on_message` sees each as it arrives (progress).
pub fn read_all(
    cluster: &KafkaConnection,
    topic: &str,
    timeout: Duration,
    mut on_message: impl FnMut(&DeadLetterMessage),
) -> Result<Vec<DeadLetterMessage>, rdkafka::error::KafkaError> {
    let mut reader = Reader::open(cluster, topic, timeout)?;
    let mut out = Vec::new();
    loop {
        let batch = reader.next_batch(1000)?;
        if batch.is_empty() {
            return Ok(out);
        }
        for m in batch {
            on_message(&m);
            out.push(m);
        }
    }
}

/// Reads a dead-letter topic in batches, up to the high watermarks it found when opened (and on, until a
/// poll finds nothing: what was written meanwhile is read too), so a large topic
/// is never held in memory at once (`idem dlq redrive --all-matching` re-drives batch by batch). Blocking:
/// call it off the async workers.
pub struct Reader {
    consumer: BaseConsumer,
    /// Partitions still to read, with their end offsets.
    ends: std::collections::HashMap<i32, i64>,
    /// Every partition reached its end and a poll then found nothing more.
    done: bool,
    /// Longest wait for the next message.
    timeout: Duration,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader").field("partitions_left", &self.ends.len()).finish_non_exhaustive()
    }
}

impl Reader {
    /// Assigns every non-empty partition of `topic` from its start (no group is joined; nothing committed).
    pub fn open(cluster: &KafkaConnection, topic: &str, timeout: Duration) -> Result<Self, rdkafka::error::KafkaError> {
        // partitions are assigned by hand and nothing is committed: the group id is never used by the broker
        let consumer: BaseConsumer = cluster
            .client_config()
            .set("group.id", "idem-dlq-reader")
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .create()?;
        let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
        let partitions: Vec<i32> =
            metadata.topics().iter().flat_map(|t| t.partitions().iter().map(|p| p.id())).collect();
        let mut ends = std::collections::HashMap::new();
        let mut assignment = TopicPartitionList::new();
        for p in &partitions {
            let (low, high) = consumer.fetch_watermarks(topic, *p, timeout)?;
            if high > low {
                ends.insert(*p, high);
                assignment.add_partition_offset(topic, *p, Offset::Offset(low))?;
            }
        }
        if !ends.is_empty() {
            consumer.assign(&assignment)?;
        }
        let done = ends.is_empty();
        Ok(Self { consumer, ends, done, timeout })
    }

    /// Up to `max` further messages; empty once every partition was read to its end.
    pub fn next_batch(&mut self, max: usize) -> Result<Vec<DeadLetterMessage>, rdkafka::error::KafkaError> {
        let mut out = Vec::new();
        let deadline = std::time::Instant::now() + self.timeout;
        while !self.done && out.len() < max {
            if std::time::Instant::now() > deadline {
                return Err(rdkafka::error::KafkaError::MessageConsumption(
                    rdkafka::types::RDKafkaErrorCode::OperationTimedOut,
                ));
            }
            let Some(m) = self.consumer.poll(Duration::from_millis(200)) else {
                // Past every end offset the broker reported, reading goes on until a poll finds nothing:
                // tansu reports a batch written at once as one offset (Apache Kafka counts its records),
                // and stopping at that watermark read 1 of 20 dead letters.
                self.done = self.ends.is_empty();
                continue;
            };
            let m = m?;
            let message = DeadLetterMessage {
                partition: m.partition(),
                offset: m.offset(),
                key: m.key().map(<[u8]>::to_vec),
                payload: m.payload().unwrap_or_default().to_vec(),
                headers: m
                    .headers()
                    .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec())).collect())
                    .unwrap_or_default(),
            };
            if self.ends.get(&m.partition()).is_some_and(|end| m.offset() + 1 >= *end) {
                self.ends.remove(&m.partition());
            }
            out.push(message);
        }
        Ok(out)
    }
}

/// Produces `dead`'s original message to `to` (same key, payload and headers, plus
/// [`REDRIVEN_FROM_HEADER`]) and waits for the acknowledgement. `to` is the caller's choice, never read
/// from the dead letter: its source topic is a header, which only says where the consumer found it.
pub async fn redrive(
    producer: &FutureProducer,
    dlq_topic: &str,
    dead: &DeadLetterMessage,
    to: &str,
) -> Result<(), rdkafka::error::KafkaError> {
    let source = to;
    let from = format!("{dlq_topic}/{}/{}", dead.partition, dead.offset);
    // a `PRODUCER` span continuing the original message's trace; the re-driven copy carries its context
    let original: Vec<(&str, &[u8])> = dead.original_headers().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    let span = crate::trace::redrive_span(dlq_topic, to, original.iter().copied());
    let context = idem_ports::trace::headers_of(&span);
    let replaced =
        |k: &str| !context.is_empty() && (k == idem_ports::trace::TRACEPARENT || k == idem_ports::trace::TRACESTATE);
    let mut headers = OwnedHeaders::new();
    for (k, v) in original.iter().filter(|(k, _)| !replaced(k)) {
        headers = headers.insert(Header { key: k, value: Some(*v) });
    }
    for (k, v) in &context {
        headers = headers.insert(Header { key: k, value: Some(v.as_bytes()) });
    }
    headers = headers.insert(Header { key: REDRIVEN_FROM_HEADER, value: Some(from.as_bytes()) });
    let mut record = FutureRecord::to(source).payload(&dead.payload).headers(headers);
    if let Some(key) = &dead.key {
        record = record.key(key);
    }
    let sent = producer.send(record, Duration::from_secs(30));
    tracing::Instrument::instrument(sent, span).await.map(|_| ()).map_err(|(e, _)| e)
}

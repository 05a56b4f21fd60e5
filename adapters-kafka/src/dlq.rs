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
    brokers: &str,
    topic: &str,
    timeout: Duration,
    mut on_message: impl FnMut(&DeadLetterMessage),
) -> Result<Vec<DeadLetterMessage>, rdkafka::error::KafkaError> {
    // partitions are assigned by hand and nothing is committed: the group id is never used by the broker
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "idem-dlq-reader")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()?;
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    let partitions: Vec<i32> = metadata.topics().iter().flat_map(|t| t.partitions().iter().map(|p| p.id())).collect();
    let mut ends = std::collections::HashMap::new();
    let mut assignment = TopicPartitionList::new();
    for p in &partitions {
        let (low, high) = consumer.fetch_watermarks(topic, *p, timeout)?;
        if high > low {
            ends.insert(*p, high);
            assignment.add_partition_offset(topic, *p, Offset::Offset(low))?;
        }
    }
    let mut out = Vec::new();
    if ends.is_empty() {
        return Ok(out);
    }
    consumer.assign(&assignment)?;
    let deadline = std::time::Instant::now() + timeout;
    while !ends.is_empty() {
        if std::time::Instant::now() > deadline {
            return Err(rdkafka::error::KafkaError::MessageConsumption(
                rdkafka::types::RDKafkaErrorCode::OperationTimedOut,
            ));
        }
        let Some(m) = consumer.poll(Duration::from_millis(200)) else { continue };
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
        if ends.get(&m.partition()).is_some_and(|end| m.offset() + 1 >= *end) {
            ends.remove(&m.partition());
        }
        on_message(&message);
        out.push(message);
    }
    Ok(out)
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
    let mut headers = OwnedHeaders::new();
    for (k, v) in dead.original_headers() {
        headers = headers.insert(Header { key: k, value: Some(v) });
    }
    headers = headers.insert(Header { key: REDRIVEN_FROM_HEADER, value: Some(from.as_bytes()) });
    let mut record = FutureRecord::to(source).payload(&dead.payload).headers(headers);
    if let Some(key) = &dead.key {
        record = record.key(key);
    }
    producer.send(record, Duration::from_secs(30)).await.map(|_| ()).map_err(|(e, _)| e)
}

//! Publishing events outside the transactional outbox, the way idem's consumers need them.
//!
//! A service that is not on PostgreSQL, a batch job or a script can still feed an idem consumer: it must
//! send each event with an `event_id` header holding a UUID v7 (the id the consumer deduplicates by, whose
//! time bounds its dedup window), from an idempotent producer with `acks=all`. [`EventProducer`] does both.
//! A send whose outcome is unknown (a timeout) is retried with the **same** id — the error carries it
//! ([`SendError::event_id`]) for [`EventProducer::send_with_id`] — and the receiver then drops the copy.

use std::sync::Arc;
use std::time::Duration;

use idem_ports::IdGenerator;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use uuid::Uuid;

use crate::client::ProducerSettings;
use crate::consumer::EVENT_ID_HEADER;

/// Where an event went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sent {
    /// The `event_id` header it carries.
    pub event_id: Uuid,
    /// Partition and offset of the write.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
}

/// A send that failed: the broker may still have written it, so retry it with `event_id`
/// ([`EventProducer::send_with_id`]) and a receiver drops the copy; a new id would be applied twice.
#[derive(Debug)]
pub struct SendError {
    /// The `event_id` the event was sent with.
    pub event_id: Uuid,
    /// Why it failed.
    pub source: KafkaError,
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sending event {} failed (retry it with this id): {}", self.event_id, self.source)
    }
}

impl std::error::Error for SendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// An idempotent producer that stamps every event with a new UUID v7 `event_id` header.
#[derive(Clone)]
pub struct EventProducer {
    producer: FutureProducer,
    ids: Arc<dyn IdGenerator>,
}

impl std::fmt::Debug for EventProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventProducer")
    }
}

impl EventProducer {
    /// A producer with idem's settings (`settings`: idempotence, `acks=all`, murmur2 partitioning) and ids
    /// from `ids` (`UuidV7Generator` in production).
    pub fn new(settings: &ProducerSettings, ids: Arc<dyn IdGenerator>) -> Result<Self, KafkaError> {
        Ok(Self { producer: settings.client_config().create()?, ids })
    }

    /// Sends `payload` to `topic` under `key` with a new `event_id`; waits at most `timeout` for the
    /// acknowledgement. On an error the event may still have been written: retry with
    /// [`Self::send_with_id`] and the error's [`SendError::event_id`] to stay deduplicable.
    pub async fn send(&self, topic: &str, key: &str, payload: &[u8], timeout: Duration) -> Result<Sent, SendError> {
        self.send_with_id(self.new_event_id(), topic, key, payload, timeout).await
    }

    /// A new event id (UUID v7), for a caller that keeps it to retry with.
    pub fn new_event_id(&self) -> Uuid {
        self.ids.new_id()
    }

    /// Sends with a given `event_id` (a retry of a send whose outcome is unknown).
    pub async fn send_with_id(
        &self,
        event_id: Uuid,
        topic: &str,
        key: &str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Sent, SendError> {
        let id = event_id.to_string();
        let mut headers = OwnedHeaders::new().insert(Header { key: EVENT_ID_HEADER, value: Some(id.as_bytes()) });
        // the caller's trace continues in the message (nothing when tracing is off)
        for (k, v) in idem_ports::trace::current_headers() {
            headers = headers.insert(Header { key: &k, value: Some(v.as_bytes()) });
        }
        let record = FutureRecord::to(topic).key(key).payload(payload).headers(headers);
        let delivery =
            self.producer.send(record, timeout).await.map_err(|(source, _)| SendError { event_id, source })?;
        Ok(Sent { event_id, partition: delivery.partition, offset: delivery.offset })
    }

    /// Sends a message exactly as given: under `key` when there is one, with `headers` and nothing else
    /// (no `event_id` is added, no trace context). For messages idem's producers never send — a test of
    /// one without an `event_id`, another producer's envelope — and for events with more headers than the
    /// id (`event_type`, `content-type`: put the `event_id` header in yourself). Returns the partition and
    /// offset of the write.
    pub async fn send_raw(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: &[(&str, &[u8])],
        timeout: Duration,
    ) -> Result<(i32, i64), KafkaError> {
        let mut owned = OwnedHeaders::new();
        for (k, v) in headers {
            owned = owned.insert(Header { key: k, value: Some(*v) });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).payload(payload).headers(owned);
        if let Some(key) = key {
            record = record.key(key);
        }
        let delivery = self.producer.send(record, timeout).await.map_err(|(e, _)| e)?;
        Ok((delivery.partition, delivery.offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 46.7: a failed send keeps the id it stamped, so the natural retry is deduplicable (the error
    /// was a bare `KafkaError` and the id was lost: a retry sent a new one and the consumer applied both).
    #[tokio::test]
    async fn a_failed_send_keeps_its_event_id() {
        let mut settings = ProducerSettings::new("127.0.0.1:1");
        settings.delivery_timeout = Duration::from_secs(1);
        let producer = EventProducer::new(&settings, Arc::new(idem_ports::UuidV7Generator)).expect("a producer");
        let failed = producer.send("t", "k", b"{}", Duration::from_millis(300)).await.expect_err("no broker there");
        assert_eq!(failed.event_id.get_version_num(), 7, "{failed}");
        assert!(failed.to_string().contains(&failed.event_id.to_string()), "{failed}");
        let again = producer.send_with_id(failed.event_id, "t", "k", b"{}", Duration::from_millis(300)).await;
        assert_eq!(again.expect_err("still no broker").event_id, failed.event_id, "the retry keeps the id");
    }
}

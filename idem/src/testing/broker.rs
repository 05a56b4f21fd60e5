//! A broker, topics and messages for tests.

use std::sync::Arc;
use std::time::Duration;

use idem_kafka::{EventProducer, ProducerSettings};
use idem_ports::UuidV7Generator;
use tokio::sync::OnceCell;
use uuid::Uuid;

static BROKERS: OnceCell<String> = OnceCell::const_new();

/// Bootstrap servers of the test broker: `KAFKA_BROKERS`, or a broker in a container
/// ([`super::containers`]).
pub async fn kafka_brokers() -> anyhow::Result<String> {
    BROKERS
        .get_or_try_init(|| async {
            match std::env::var("KAFKA_BROKERS") {
                Ok(b) => Ok(b),
                Err(_) => super::containers::kafka().await,
            }
        })
        .await
        .cloned()
}

/// A topic name unique to this test run: `prefix-<uuid>`.
pub fn unique_topic(prefix: &str) -> String {
    format!("{prefix}-{}", Uuid::new_v4().simple())
}

/// Creates `topic` with `partitions` (replicated as the cluster allows); an existing one is kept.
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) -> anyhow::Result<()> {
    idem_kafka::admin::ensure_topics(&brokers.into(), &[topic], partitions, idem_kafka::admin::Replication::Auto)
        .await
        .map_err(anyhow::Error::msg)
}

/// Sends what a test needs: events as idem's producers send them (an `event_id`), the same event again
/// (a redelivery, a producer's retry), and raw messages (no `event_id`, a malformed one, any headers).
/// Every send waits for the broker's acknowledgement.
#[derive(Debug, Clone)]
pub struct TestProducer {
    producer: EventProducer,
}

const TIMEOUT: Duration = Duration::from_secs(10);

impl TestProducer {
    /// A producer with idem's settings on `brokers`.
    pub fn new(brokers: &str) -> anyhow::Result<Self> {
        Ok(Self { producer: EventProducer::new(&ProducerSettings::new(brokers), Arc::new(UuidV7Generator))? })
    }

    /// Sends an event with a new `event_id` (UUID v7); returns the id.
    pub async fn event(&self, topic: &str, key: &str, payload: &[u8]) -> anyhow::Result<Uuid> {
        Ok(self.producer.send(topic, key, payload, TIMEOUT).await?.event_id)
    }

    /// Sends an event with the given `event_id`: the same event delivered again.
    pub async fn event_with_id(&self, event_id: Uuid, topic: &str, key: &str, payload: &[u8]) -> anyhow::Result<()> {
        self.producer.send_with_id(event_id, topic, key, payload, TIMEOUT).await?;
        Ok(())
    }

    /// Sends a message exactly as given: `headers` only (no `event_id` unless among them). Returns its
    /// partition and offset.
    pub async fn raw(
        &self,
        topic: &str,
        key: Option<&str>,
        payload: &[u8],
        headers: &[(&str, &[u8])],
    ) -> anyhow::Result<(i32, i64)> {
        Ok(self.producer.send_raw(topic, key.map(str::as_bytes), payload, headers, TIMEOUT).await?)
    }
}

//! Kafka helpers for tests: topics, producing with headers, reading a topic back.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// A topic name unique to this test run.
pub fn unique_topic(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) -> anyhow::Result<()> {
    idem_kafka::admin::ensure_topics(brokers, &[topic], partitions)
        .await
        .map_err(anyhow::Error::msg)
}

pub fn producer(brokers: &str) -> anyhow::Result<FutureProducer> {
    Ok(idem_kafka::ProducerSettings::new(brokers)
        .client_config()
        .create()?)
}

/// Produces one message and waits for its acknowledgement.
pub async fn produce(
    producer: &FutureProducer,
    topic: &str,
    key: Option<&str>,
    payload: &[u8],
    headers: &[(&str, &[u8])],
) -> anyhow::Result<(i32, i64)> {
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header {
            key: k,
            value: Some(*v),
        });
    }
    let mut record = FutureRecord::to(topic).payload(payload).headers(h);
    if let Some(k) = key {
        record = record.key(k);
    }
    let delivery = producer
        .send(record, Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)?;
    Ok((delivery.partition, delivery.offset))
}

/// A message read back by [`read_topic`].
#[derive(Debug, Clone)]
pub struct Read {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Read {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }
}

/// Reads `topic` from the beginning with a fresh group until `want` messages arrived or `timeout` passed.
pub async fn read_topic(
    brokers: &str,
    topic: &str,
    want: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<Read>> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set(
            "group.id",
            format!("reader-{}", uuid::Uuid::new_v4().simple()),
        )
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .create()?;
    consumer.subscribe(&[topic])?;
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    while out.len() < want {
        let m = tokio::select! {
            _ = tokio::time::sleep_until(deadline) => break,
            m = consumer.recv() => m?,
        };
        out.push(Read {
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().unwrap_or_default().to_vec(),
            headers: m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                        .collect()
                })
                .unwrap_or_default(),
        });
    }
    Ok(out)
}

/// Polls `check` every 100 ms until it returns true or `timeout` passes; returns the last answer.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> anyhow::Result<bool>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await? {
            return Ok(true);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

//! Kafka adapter (rdkafka): the deduplicating consumer runner and the transactional-outbox relay.
//!
//! API boundary: [`consumer::Runner`] drives any [`idem_ports::EventHandler`]; [`relay::Relay`]
//! publishes `outbox_message` rows. rdkafka types stay inside this crate.

#![warn(missing_docs)]

pub mod admin;
pub mod client;
pub mod consumer;
pub mod dlq;
pub mod partitioner;
pub mod probe;
pub mod producer;
pub mod relay;
pub mod trace;

pub use client::{ConsumerSettings, KafkaConnection, ProducerSettings};
pub use producer::{EventProducer, SendError, Sent};

/// Sleeps `delay`; `false` when `shutdown` came first.
pub(crate) async fn pause(delay: std::time::Duration, shutdown: &tokio_util::sync::CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(delay) => true,
    }
}

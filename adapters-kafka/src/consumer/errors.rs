//! What ends the runner (nothing the broker does) and how client errors are classified.

/// Why the runner stopped: only a configuration the Kafka client refuses, which no retry can heal.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    #[error("invalid Kafka consumer configuration (fix the settings and restart): {0}")]
    /// librdkafka refused the configuration.
    Config(rdkafka::error::KafkaError),
    /// The settings would apply processed events again (a renamed group, a switched dedup storage):
    /// refused before consuming, with what to do.
    #[error("{0}")]
    Settings(String),
}

/// What the runner does with an error the Kafka client reported while consuming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientErrorAction {
    /// Not an error for the application (end of partition).
    Ignore,
    /// Transport, timeout, coordinator or rebalance trouble: log, count, back off, keep consuming. The
    /// client reconnects and rejoins the group by itself.
    Retry,
    /// The client instance is unusable (a fatal error): log, back off, create a new consumer.
    Recreate,
}

/// Classifies an error returned by `recv()`. Nothing the broker or the network does ends the runner.
pub fn classify_consumer_error(e: &rdkafka::error::KafkaError) -> ClientErrorAction {
    use rdkafka::error::KafkaError;
    match e {
        KafkaError::PartitionEOF(_) => ClientErrorAction::Ignore,
        KafkaError::MessageConsumptionFatal(_) => ClientErrorAction::Recreate,
        other if other.rdkafka_error_code() == Some(rdkafka::error::RDKafkaErrorCode::Fatal) => {
            ClientErrorAction::Recreate
        }
        _ => ClientErrorAction::Retry,
    }
}

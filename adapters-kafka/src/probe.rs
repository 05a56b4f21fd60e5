//! Broker reachability for readiness checks.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;

use crate::client::KafkaConnection;

/// Asks the cluster for its metadata.
#[derive(Clone)]
pub struct BrokerProbe {
    client: Arc<BaseConsumer>,
}

impl std::fmt::Debug for BrokerProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BrokerProbe")
    }
}

impl BrokerProbe {
    /// A probe of `cluster` (a client of its own, created once).
    pub fn new(cluster: &KafkaConnection) -> Result<Self, KafkaError> {
        let client: BaseConsumer = cluster.client_config().create()?;
        Ok(Self { client: Arc::new(client) })
    }

    /// Ok when a broker answered a metadata request within `timeout`.
    pub async fn check(&self, timeout: Duration) -> Result<(), String> {
        let client = self.client.clone();
        tokio::task::spawn_blocking(move || client.fetch_metadata(None, timeout).map(|_| ()).map_err(|e| e.to_string()))
            .await
            .map_err(|e| e.to_string())?
    }
}

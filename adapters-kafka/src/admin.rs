//! Topic creation at start-up (brokers such as tansu do not auto-create topics).

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;

/// Creates the topics that do not exist yet, each with `partitions` partitions.
pub async fn ensure_topics(brokers: &str, topics: &[&str], partitions: i32) -> Result<(), String> {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers).create().map_err(|e| format!("admin client: {e}"))?;
    let new: Vec<NewTopic<'_>> =
        topics.iter().map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(1))).collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = admin.create_topics(&new, &options).await.map_err(|e| format!("create topics: {e}"))?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => return Err(format!("create topic {topic}: {code}")),
        }
    }
    Ok(())
}

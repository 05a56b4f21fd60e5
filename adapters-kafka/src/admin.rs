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

/// [`ensure_topics`] until it succeeds or `shutdown` is cancelled (then `false`): a broker that is down at
/// start is waited for in the background, with backoff from 1 s to 30 s, every failure logged.
pub async fn ensure_topics_when_reachable(
    brokers: &str,
    topics: &[&str],
    partitions: i32,
    shutdown: &tokio_util::sync::CancellationToken,
) -> bool {
    let mut backoff = idem_ports::Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    loop {
        let pause = match ensure_topics(brokers, topics, partitions).await {
            Ok(()) => {
                tracing::info!(?topics, "topics ready");
                return true;
            }
            Err(e) => {
                let pause = backoff.next_delay();
                tracing::warn!(error = %e, retry_in = ?pause, "cannot create or check topics; retrying");
                pause
            }
        };
        if !crate::pause(pause, shutdown).await {
            return false;
        }
    }
}

//! Topic creation at start-up (brokers such as tansu do not auto-create topics).

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;

use crate::client::KafkaConnection;

/// The replication factor of the topics idem creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// 3 where the cluster has at least 3 brokers (so `acks=all` with `min.insync.replicas=2` survives a
    /// broker), else one replica per broker: a single-broker development cluster still works.
    Auto,
    /// Exactly this many replicas.
    Fixed(i32),
}

impl Replication {
    /// The factor for a cluster of `brokers` brokers.
    pub fn factor(self, brokers: usize) -> i32 {
        match self {
            Self::Fixed(n) => n,
            Self::Auto => i32::try_from(brokers.clamp(1, 3)).unwrap_or(3),
        }
    }
}

impl std::str::FromStr for Replication {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            n => match n.parse::<i32>() {
                Ok(n) if n >= 1 => Ok(Self::Fixed(n)),
                _ => Err(format!("replication factor must be 'auto' or a number of at least 1, got '{s}'")),
            },
        }
    }
}

/// Creates the topics that do not exist yet, each with `partitions` partitions and the replication factor
/// `replication` gives for the cluster (logged).
pub async fn ensure_topics(
    cluster: &KafkaConnection,
    topics: &[&str],
    partitions: i32,
    replication: Replication,
) -> Result<(), String> {
    let admin: AdminClient<DefaultClientContext> =
        cluster.client_config().create().map_err(|e| format!("admin client: {e}"))?;
    // librdkafka's metadata call blocks: off the async workers (a broker outage must not stall HTTP)
    let (admin, cluster) = tokio::task::spawn_blocking(move || {
        let brokers = admin.inner().fetch_metadata(None, Duration::from_secs(10)).map(|m| m.brokers().len());
        (admin, brokers)
    })
    .await
    .map_err(|e| format!("cluster metadata: {e}"))?;
    let cluster = cluster.map_err(|e| format!("cluster metadata: {e}"))?;
    let factor = replication.factor(cluster);
    tracing::info!(replication_factor = factor, brokers = cluster, ?replication, "creating missing topics");
    let new: Vec<NewTopic<'_>> =
        topics.iter().map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(factor))).collect();
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
    cluster: &KafkaConnection,
    topics: &[&str],
    partitions: i32,
    replication: Replication,
    shutdown: &tokio_util::sync::CancellationToken,
) -> bool {
    let mut backoff = idem_ports::Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    loop {
        let pause = match ensure_topics(cluster, topics, partitions, replication).await {
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

#[cfg(test)]
mod tests {
    use super::Replication;

    #[test]
    fn auto_replication_is_three_where_the_cluster_has_three_brokers() {
        assert_eq!(Replication::Auto.factor(1), 1);
        assert_eq!(Replication::Auto.factor(2), 2);
        assert_eq!(Replication::Auto.factor(3), 3);
        assert_eq!(Replication::Auto.factor(9), 3);
        assert_eq!(Replication::Fixed(5).factor(1), 5);
        assert_eq!("auto".parse(), Ok(Replication::Auto));
        assert_eq!("2".parse(), Ok(Replication::Fixed(2)));
        assert!("0".parse::<Replication>().is_err());
    }
}

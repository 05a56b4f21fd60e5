//! Dead letters: a refused message with its reason, published to the dead-letter topic with its provenance
//! (which a producer cannot forge: incoming `dlq.*` headers are dropped).

use super::*;

/// A message to dead-letter, and why.
pub(super) struct DeadLetter {
    pub(super) message: Received,
    pub(super) reason: &'static str,
    pub(super) error: String,
}

impl Runner {
    /// Publishes a dead letter and waits for its acknowledgement (retrying until shutdown).
    pub(super) async fn dead_letter(
        &self,
        producer: &FutureProducer,
        d: &DeadLetter,
        shutdown: &CancellationToken,
    ) -> bool {
        let m = &d.message;
        let (partition, offset) = (m.partition.to_string(), m.offset.to_string());
        let failed_at = self.clock.now().to_rfc3339();
        let mut headers = OwnedHeaders::new();
        // Provenance is ours alone: `dlq.*` headers a producer sent are dropped, or they would pass for it
        // (a forged `dlq.original.topic` redirected a re-drive to any topic).
        for (k, v) in m.headers.iter().filter(|(k, _)| !k.starts_with(wire::dlq::PREFIX)) {
            headers = headers.insert(Header { key: k, value: Some(v) });
        }
        for (k, v) in [
            (wire::dlq::REASON, d.reason),
            (wire::dlq::ERROR, d.error.as_str()),
            (wire::dlq::ORIGINAL_TOPIC, m.topic.as_str()),
            (wire::dlq::ORIGINAL_PARTITION, partition.as_str()),
            (wire::dlq::ORIGINAL_OFFSET, offset.as_str()),
            (wire::dlq::CONSUMER_GROUP, self.settings.consumer.group_id.as_str()),
            (wire::dlq::FAILED_AT, failed_at.as_str()),
        ] {
            headers = headers.insert(Header { key: k, value: Some(v.as_bytes()) });
        }
        let mut backoff = Backoff::new();
        // A new producer session, once the broker rejected the shared one.
        let mut fresh: Option<FutureProducer> = None;
        loop {
            let producer = fresh.as_ref().unwrap_or(producer);
            let mut record = FutureRecord::to(&self.settings.dlq_topic).payload(&m.payload).headers(headers.clone());
            if let Some(key) = &m.key {
                record = record.key(key);
            }
            if let Some(ts) = m.timestamp {
                record = record.timestamp(ts);
            }
            match producer.send(record, Duration::from_secs(10)).await {
                Ok(_) => {
                    self.stats.dead_lettered.inc_by(1);
                    tracing::warn!(topic = %self.settings.dlq_topic, reason = d.reason, error = %d.error, partition = m.partition, offset = m.offset, "message dead-lettered");
                    return true;
                }
                Err((e, _)) => {
                    tracing::warn!(error = %e, "dead-letter publish failed; retrying");
                    if breaks_session(&e) {
                        match self.settings.producer.client_config().create() {
                            Ok(p) => fresh = Some(p),
                            Err(e) => tracing::error!(error = %e, "cannot create a new producer"),
                        }
                    }
                    if !backoff.wait(shutdown).await {
                        return false;
                    }
                }
            }
        }
    }
}

//! Dead letters: a refused message with its reason, published to the dead-letter topic with its provenance
//! (which a producer cannot forge: incoming `dlq.*` headers are dropped).

use rdkafka::error::KafkaError;

use super::*;

/// A message to dead-letter, and why.
pub(super) struct DeadLetter {
    pub(super) message: Received,
    pub(super) reason: &'static str,
    pub(super) error: String,
}

/// The most of a refused payload a cut dead letter keeps (its original size is recorded, and the whole
/// message stays at its original position until the topic's retention removes it).
pub const CUT_PAYLOAD_BYTES: usize = 64 * 1024;
/// The most original headers a cut dead letter keeps, and the most bytes of each value.
const CUT_HEADERS: usize = 32;
const CUT_HEADER_VALUE_BYTES: usize = 1024;

/// The dead letter as first sent (the whole message), or cut after the producer or the broker refused that
/// for good (too large, an invalid record).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Form {
    Whole,
    Cut,
}

/// Produce errors no retry can cure: the message itself is refused. Authorization failures are not here:
/// an operator grants the permission and the retry succeeds (the failures counter and its alert say so).
fn refuses_the_message(e: &KafkaError) -> bool {
    use rdkafka::error::RDKafkaErrorCode::*;
    matches!(
        e.rdkafka_error_code(),
        Some(MessageSizeTooLarge | InvalidMessageSize | InvalidRecord | InvalidMessage | PolicyViolation)
    )
}

/// A part of `bytes` of at most `max` bytes (its start).
fn cut(bytes: &[u8], max: usize) -> &[u8] {
    &bytes[..bytes.len().min(max)]
}

impl Runner {
    /// The record's headers: the original ones (all of them, or for a cut dead letter the first
    /// [`CUT_HEADERS`], each value cut) without any `dlq.*` a producer sent, then idem's provenance.
    fn dead_letter_headers(&self, d: &DeadLetter, form: Form) -> OwnedHeaders {
        let m = &d.message;
        let (partition, offset, size) = (m.partition.to_string(), m.offset.to_string(), m.payload.len().to_string());
        let failed_at = self.clock.now().to_rfc3339();
        let mut headers = OwnedHeaders::new();
        // Provenance is ours alone: `dlq.*` headers a producer sent are dropped, or they would pass for it
        // (a forged `dlq.original.topic` redirected a re-drive to any topic).
        let original = m.headers.iter().filter(|(k, _)| !k.starts_with(wire::dlq::PREFIX));
        let (count, value_max) = match form {
            Form::Whole => (usize::MAX, usize::MAX),
            Form::Cut => (CUT_HEADERS, CUT_HEADER_VALUE_BYTES),
        };
        for (k, v) in original.take(count) {
            headers = headers.insert(Header { key: k, value: Some(cut(v, value_max)) });
        }
        let mut provenance = vec![
            (wire::dlq::REASON, d.reason),
            (wire::dlq::ERROR, d.error.as_str()),
            (wire::dlq::ORIGINAL_TOPIC, m.topic.as_str()),
            (wire::dlq::ORIGINAL_PARTITION, partition.as_str()),
            (wire::dlq::ORIGINAL_OFFSET, offset.as_str()),
            (wire::dlq::CONSUMER_GROUP, self.settings.consumer.group_id.as_str()),
            (wire::dlq::FAILED_AT, failed_at.as_str()),
        ];
        if form == Form::Cut {
            provenance.push((wire::dlq::ORIGINAL_SIZE, size.as_str()));
        }
        for (k, v) in provenance {
            headers = headers.insert(Header { key: k, value: Some(v.as_bytes()) });
        }
        headers
    }

    /// Publishes a dead letter and waits for its acknowledgement, retrying transient failures until
    /// shutdown. One the producer or the broker refuses for good (a message near the size limit, whose
    /// provenance headers push it over) is sent cut: the start of its payload, at most [`CUT_HEADERS`]
    /// original headers, its original size (`dlq.original.size`) and position. A cut dead letter is not
    /// re-driven (`idem dlq redrive` skips it): the whole message is at its original position.
    pub(super) async fn dead_letter(
        &self,
        producer: &FutureProducer,
        d: &DeadLetter,
        shutdown: &CancellationToken,
    ) -> bool {
        let m = &d.message;
        let headers = m.headers.iter().map(|(k, v)| (k.as_str(), v.as_slice()));
        let span = crate::trace::dead_letter_span(&m.topic, &self.settings.dlq_topic, d.reason, headers);
        tracing::Instrument::instrument(self.send_dead_letter(producer, d, shutdown), span).await
    }

    async fn send_dead_letter(&self, producer: &FutureProducer, d: &DeadLetter, shutdown: &CancellationToken) -> bool {
        let m = &d.message;
        // A dead letter that cannot fit is cut at once rather than refused first.
        let whole_size = m.payload.len()
            + m.key.as_ref().map_or(0, Vec::len)
            + m.headers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
        let mut form = if whole_size + 4096 > self.settings.dead_letter_max_bytes() { Form::Cut } else { Form::Whole };
        let mut backoff = Backoff::new();
        // A new producer session, once the broker rejected the shared one.
        let mut fresh: Option<FutureProducer> = None;
        loop {
            let producer = fresh.as_ref().unwrap_or(producer);
            let (payload, key) = match form {
                Form::Whole => (&m.payload[..], m.key.as_deref()),
                Form::Cut => {
                    (cut(&m.payload, CUT_PAYLOAD_BYTES), m.key.as_deref().map(|k| cut(k, CUT_HEADER_VALUE_BYTES)))
                }
            };
            let mut record =
                FutureRecord::to(&self.settings.dlq_topic).payload(payload).headers(self.dead_letter_headers(d, form));
            if let Some(key) = key {
                record = record.key(key);
            }
            if let Some(ts) = m.timestamp {
                record = record.timestamp(ts);
            }
            match producer.send(record, Duration::from_secs(10)).await {
                Ok(_) => {
                    self.stats.dead_lettered.inc_by(1);
                    tracing::warn!(topic = %self.settings.dlq_topic, reason = d.reason, error = %d.error, partition = m.partition, offset = m.offset, cut = form == Form::Cut, "message dead-lettered");
                    return true;
                }
                Err((e, _)) => {
                    self.stats.dead_letter_failures.inc_by(1);
                    if form == Form::Whole && refuses_the_message(&e) {
                        tracing::warn!(error = %e, partition = m.partition, offset = m.offset, size = m.payload.len(), "dead letter refused whole; sending it cut");
                        form = Form::Cut;
                        continue;
                    }
                    tracing::warn!(error = %e, "dead-letter publish failed; retrying");
                    if breaks_session(&e) {
                        match self.settings.dead_letter_producer().create() {
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

#[cfg(test)]
mod tests {
    use rdkafka::error::{KafkaError, RDKafkaErrorCode};

    /// Issue 38.1: a refusal of the message itself is not retried as it is (it would be refused for
    /// ever); transport trouble and missing permissions are.
    #[test]
    fn a_message_the_broker_refuses_is_sent_cut_and_transient_errors_are_retried() {
        let produce = |code| KafkaError::MessageProduction(code);
        for code in [RDKafkaErrorCode::MessageSizeTooLarge, RDKafkaErrorCode::InvalidRecord] {
            assert!(super::refuses_the_message(&produce(code)), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::NotEnoughReplicas,
        ] {
            assert!(!super::refuses_the_message(&produce(code)), "{code:?}");
        }
        assert_eq!(super::cut(b"abcdef", 4), b"abcd");
        assert_eq!(super::cut(b"ab", 4), b"ab");
    }
}

//! A message as the runner keeps it: detached from the consumer, its identifying headers validated.

use super::*;

/// A received message, detached from the consumer.
#[derive(Debug, Clone)]
pub(super) struct Received {
    pub(super) topic: String,
    pub(super) partition: i32,
    pub(super) offset: i64,
    pub(super) key: Option<Vec<u8>>,
    pub(super) payload: Vec<u8>,
    pub(super) headers: Vec<(String, Vec<u8>)>,
    pub(super) timestamp: Option<i64>,
}

impl Received {
    pub(super) fn from_message(m: &BorrowedMessage<'_>) -> Self {
        let headers = m
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec())).collect())
            .unwrap_or_default();
        Self {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().unwrap_or_default().to_vec(),
            headers,
            timestamp: m.timestamp().to_millis(),
        }
    }

    /// The first header `name`, compared ignoring ASCII case as [`InboundEvent::header`] does: a producer
    /// writing `Event_ID` means the dedup key, and reading it as missing would dead-letter the event.
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
    }

    /// Validates the identifying headers.
    pub(super) fn to_event(&self) -> Result<InboundEvent, String> {
        let event_id = match self.header(EVENT_ID_HEADER) {
            None => return Err("missing event_id header".into()),
            Some(raw) => EventId::parse_bytes(raw).map_err(|e| format!("invalid event_id header: {e}"))?,
        };
        let saga_id = match self.header(SAGA_ID_HEADER) {
            None => None,
            Some(raw) => Some(
                std::str::from_utf8(raw)
                    .ok()
                    .and_then(|s| Uuid::try_parse(s.trim()).ok())
                    .filter(|u| !u.is_nil())
                    .ok_or_else(|| "invalid saga_id header: must be a non-nil UUID".to_owned())?,
            ),
        };
        Ok(InboundEvent {
            event_id: event_id.as_uuid(),
            saga_id,
            topic: self.topic.clone(),
            partition: self.partition,
            offset: self.offset,
            key: self.key.clone(),
            payload: self.payload.clone(),
            headers: self.headers.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 46.11: the identifying headers are read ignoring case, like every header a handler reads.
    #[test]
    fn the_event_id_header_is_read_ignoring_case() {
        let v7 = |n: u8| uuid::Builder::from_unix_timestamp_millis(1_800_000_000_000, &[n; 10]).into_uuid();
        let (id, saga) = (v7(1), v7(2));
        let received = Received {
            topic: "t".into(),
            partition: 0,
            offset: 0,
            key: None,
            payload: b"{}".to_vec(),
            headers: vec![
                ("Event_ID".into(), id.to_string().into_bytes()),
                ("SAGA_ID".into(), saga.to_string().into_bytes()),
            ],
            timestamp: None,
        };
        let event = received.to_event().expect("the headers are there");
        assert_eq!((event.event_id, event.saga_id), (id, Some(saga)));
    }
}

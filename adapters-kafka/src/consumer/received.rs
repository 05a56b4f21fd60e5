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

    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_slice())
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

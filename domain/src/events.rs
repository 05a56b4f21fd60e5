//! Identifiers carried by messages: the Kafka `event_id` and saga steps.

use std::fmt;

use thiserror::Error;
use uuid::Uuid;

/// The creation time a UUID v7 carries (its first 48 bits, milliseconds since the epoch); `None` for other
/// versions. Used by the rules that depend on a message's or a key's age.
pub fn uuid_v7_time(id: Uuid) -> Option<chrono::DateTime<chrono::Utc>> {
    if id.get_version_num() != 7 {
        return None;
    }
    let (secs, nanos) = id.get_timestamp()?.to_unix();
    chrono::DateTime::from_timestamp(i64::try_from(secs).ok()?, nanos)
}

/// Why an event id was rejected.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EventIdError {
    #[error("event_id must be a UUID")]
    /// Not a UUID.
    Malformed,
    #[error("event_id must not be the nil UUID")]
    /// The nil UUID.
    Nil,
    #[error("event_id must be a UUID of version 4 or 7, got version {0}")]
    /// A UUID of another version than 4 or 7 (the version).
    UnsupportedVersion(usize),
}

/// The unique id of a message: a non-nil UUID, version 7 when idem generates it, version 4 or 7 accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(Uuid);

impl EventId {
    /// Parses the textual form found in a header (hyphenated, simple, or braced; case-insensitive).
    pub fn parse(s: &str) -> Result<Self, EventIdError> {
        if s.len() > 45 {
            return Err(EventIdError::Malformed);
        }
        let uuid = Uuid::try_parse(s.trim()).map_err(|_| EventIdError::Malformed)?;
        Self::try_from(uuid)
    }

    /// Parses raw header bytes, which must be UTF-8.
    pub fn parse_bytes(bytes: &[u8]) -> Result<Self, EventIdError> {
        std::str::from_utf8(bytes).map_err(|_| EventIdError::Malformed).and_then(Self::parse)
    }

    /// The id as a UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl TryFrom<Uuid> for EventId {
    type Error = EventIdError;

    fn try_from(uuid: Uuid) -> Result<Self, EventIdError> {
        if uuid.is_nil() {
            return Err(EventIdError::Nil);
        }
        match uuid.get_version_num() {
            4 | 7 => Ok(Self(uuid)),
            v => Err(EventIdError::UnsupportedVersion(v)),
        }
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

/// Why a saga step was rejected.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SagaStepError {
    #[error("saga_id must be a non-nil UUID")]
    /// The nil UUID as saga id.
    InvalidSagaId,
    #[error("step name must be 1 to 100 characters of a-z, 0-9, '_', '-' or '.'")]
    /// An empty, too long or non-ASCII step name.
    InvalidStep,
}

/// One step of one saga: it runs at most once per (saga_id, step).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SagaStep {
    saga_id: Uuid,
    step: String,
}

impl SagaStep {
    /// Validates a saga step.
    pub fn new(saga_id: Uuid, step: &str) -> Result<Self, SagaStepError> {
        if saga_id.is_nil() {
            return Err(SagaStepError::InvalidSagaId);
        }
        let valid = (1..=100).contains(&step.len())
            && step.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-' | b'.'));
        if !valid {
            return Err(SagaStepError::InvalidStep);
        }
        Ok(Self { saga_id, step: step.to_owned() })
    }

    /// The saga.
    pub fn saga_id(&self) -> Uuid {
        self.saga_id
    }

    /// The step's name.
    pub fn step(&self) -> &str {
        &self.step
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_v4_and_v7() {
        let v4 = "9b2f3f4e-8d7a-4c1b-9a7e-2f1d3c4b5a69";
        let v7 = "01936f8e-7b2a-7c3d-8e4f-5a6b7c8d9e0f";
        assert_eq!(EventId::parse(v4).map(|e| e.to_string()), Ok(v4.to_owned()));
        assert_eq!(EventId::parse(v7).map(|e| e.to_string()), Ok(v7.to_owned()));
    }

    #[test]
    fn rejects_nil_other_versions_and_garbage() {
        assert_eq!(EventId::parse("00000000-0000-0000-0000-000000000000"), Err(EventIdError::Nil));
        assert_eq!(EventId::parse("6ba7b810-9dad-11d1-80b4-00c04fd430c8"), Err(EventIdError::UnsupportedVersion(1)));
        assert_eq!(EventId::parse("not-a-uuid"), Err(EventIdError::Malformed));
        assert_eq!(EventId::parse(""), Err(EventIdError::Malformed));
        assert_eq!(EventId::parse_bytes(&[0xff, 0xfe]), Err(EventIdError::Malformed));
    }

    #[test]
    fn saga_steps() {
        let saga = Uuid::from_u128(0x0193_6f8e_7b2a_7c3d_8e4f_5a6b_7c8d_9e0f);
        assert!(SagaStep::new(saga, "refund-compensation").is_ok());
        assert_eq!(SagaStep::new(Uuid::nil(), "x"), Err(SagaStepError::InvalidSagaId));
        assert_eq!(SagaStep::new(saga, ""), Err(SagaStepError::InvalidStep));
        assert_eq!(SagaStep::new(saga, "Refund"), Err(SagaStepError::InvalidStep));
        assert_eq!(SagaStep::new(saga, &"a".repeat(101)), Err(SagaStepError::InvalidStep));
    }

    proptest! {
        #[test]
        fn event_id_parser_never_panics(s in "\\PC{0,60}") {
            let _ = EventId::parse(&s);
        }

        #[test]
        fn random_v4_round_trips(bits in any::<u128>()) {
            let uuid = uuid::Builder::from_random_bytes(bits.to_le_bytes()).into_uuid();
            let id = EventId::parse(&uuid.to_string()).expect("v4 accepted");
            prop_assert_eq!(id.as_uuid(), uuid);
        }
    }
}

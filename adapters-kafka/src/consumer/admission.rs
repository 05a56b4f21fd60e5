//! Admission: what a batch's messages are, before any transaction. A pure function of the messages, the
//! consumer's clock and its dedup window (`TtlPolicy::admission`): an event whose id carries no time (v4) or a
//! time inside the window is applied; one older than the window's floor may only be applied when an operator
//! admitted it (its dedup row may be gone); one dated too far ahead, or with invalid identifying headers, is
//! dead-lettered.

use chrono::{DateTime, Utc};
use idem_domain::{Admission, TtlPolicy};
use idem_ports::InboundEvent;

use super::{DeadLetter, FUTURE_DATED, Received};

/// A batch, sorted.
pub(super) struct Sorted<'m> {
    /// To apply, in offset order.
    pub(super) events: Vec<(&'m Received, InboundEvent)>,
    /// Older than the window's floor, with the time their id carries.
    pub(super) too_old: Vec<(&'m Received, InboundEvent, DateTime<Utc>)>,
    /// Refused for good.
    pub(super) dead: Vec<DeadLetter>,
}

/// Sorts `batch` at `now` under `ttl`.
pub(super) fn sort(batch: &[Received], now: DateTime<Utc>, ttl: TtlPolicy) -> Sorted<'_> {
    let mut sorted = Sorted { events: Vec::with_capacity(batch.len()), too_old: Vec::new(), dead: Vec::new() };
    for m in batch {
        match m.to_event() {
            // Ids without a time (v4) have no age to check: they are retained by processing time.
            Ok(e) => match idem_domain::uuid_v7_time(e.event_id).map(|t| (t, ttl.admission(now, Some(t)))) {
                None | Some((_, Admission::Admitted)) => sorted.events.push((m, e)),
                // Its dedup row may already be gone: applying it could apply it twice.
                Some((t, Admission::TooOld)) => sorted.too_old.push((m, e, t)),
                Some((t, Admission::FutureDated)) => sorted.dead.push(DeadLetter {
                    message: m.clone(),
                    reason: FUTURE_DATED,
                    error: format!(
                        "event time {} is more than {} s ahead of this consumer's clock: the producer's clock is wrong",
                        t.to_rfc3339(),
                        idem_domain::MAX_FUTURE_SKEW.as_secs()
                    ),
                }),
            },
            Err(error) => sorted.dead.push(DeadLetter { message: m.clone(), reason: "invalid-headers", error }),
        }
    }
    sorted
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn message(offset: i64, event_id: Option<String>) -> Received {
        Received {
            topic: "t".into(),
            partition: 0,
            offset,
            key: None,
            payload: b"{}".to_vec(),
            headers: event_id
                .map(|id| vec![(super::super::EVENT_ID_HEADER.to_owned(), id.into_bytes())])
                .unwrap_or_default(),
            timestamp: None,
        }
    }

    fn v7(at: DateTime<Utc>) -> String {
        let ms = u64::try_from(at.timestamp_millis()).unwrap_or(0);
        uuid::Builder::from_unix_timestamp_millis(ms, &[7; 10]).into_uuid().to_string()
    }

    #[test]
    fn a_batch_is_sorted_by_the_time_its_ids_carry_and_by_its_headers() {
        let ttl = TtlPolicy::new(Duration::from_secs(24 * 3600)).unwrap_or_else(|e| panic!("{e}"));
        let now =
            DateTime::parse_from_rfc3339("2026-12-04T12:00:00Z").map(|t| t.with_timezone(&Utc)).unwrap_or_default();
        let hours = |h: i64| now + chrono::Duration::hours(h);
        let batch = vec![
            message(0, Some(v7(hours(-1)))), // inside the window
            message(1, Some(uuid::Builder::from_random_bytes([1; 16]).into_uuid().to_string())), // v4: no time
            message(2, Some(v7(hours(-23) - chrono::Duration::minutes(30)))), // past the floor (TTL - 1 h)
            message(3, Some(v7(hours(25)))), // more than MAX_FUTURE_SKEW (24 h) ahead
            message(4, None),                // no event_id
            message(5, Some("not-a-uuid".into())),
        ];
        let sorted = sort(&batch, now, ttl);
        let offsets = |v: Vec<i64>| v;
        assert_eq!(offsets(sorted.events.iter().map(|(m, _)| m.offset).collect()), vec![0, 1]);
        assert_eq!(offsets(sorted.too_old.iter().map(|(m, _, _)| m.offset).collect()), vec![2]);
        let dead: Vec<(i64, &str)> = sorted.dead.iter().map(|d| (d.message.offset, d.reason)).collect();
        assert_eq!(dead, vec![(3, FUTURE_DATED), (4, "invalid-headers"), (5, "invalid-headers")]);
    }
}

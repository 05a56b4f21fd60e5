//! How long idempotency records and processed-event rows are kept.

use std::time::Duration;

use chrono::{DateTime, Utc};
use thiserror::Error;

/// Shortest accepted retention: a client retrying over a day-long incident must still be deduplicated.
pub const MIN_TTL: Duration = Duration::from_secs(24 * 3600);
/// Longest accepted retention: beyond it the tables grow and autovacuum works for nothing.
pub const MAX_TTL: Duration = Duration::from_secs(72 * 3600);

/// How far inside the retention the admission floor sits: covers clock skew between the machine that
/// minted an id's time and the machines that check it or clean up by it (NTP keeps them within
/// milliseconds; an hour is a wide margin), and a cleanup round that runs late or early. It costs only that
/// an event between `ttl - 1h` and `ttl` old is dead-lettered instead of applied.
pub const ADMISSION_MARGIN: Duration = Duration::from_secs(3600);

/// The furthest in the future an id's time may be: a producer clock a day ahead is broken, and such an id
/// would land outside the dedup partitions created ahead (and block creating its day's partition later).
pub const MAX_FUTURE_SKEW: Duration = Duration::from_secs(24 * 3600);

/// The latest id time a deduplicating receiver admits at `now` (see [`MAX_FUTURE_SKEW`]).
pub fn admission_ceiling(now: DateTime<Utc>) -> DateTime<Utc> {
    now + chrono::Duration::from_std(MAX_FUTURE_SKEW).unwrap_or(chrono::Duration::hours(24))
}

/// A retention outside the accepted range.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "TTL must be between 24h and 72h (rule R-DIST-IDEM-5: shorter lets a real retry through, longer bloats the table), got {}s",
    got.as_secs()
)]
pub struct TtlError {
    /// The duration given.
    pub got: Duration,
}

/// A retention of 24 h to 72 h, and the retention it was raised from, while rows written under that one
/// may still be the only record of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtlPolicy(Duration, Option<Raise>);

/// A retention raised from `from` at `since`: rows and records written before kept `from`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raise {
    /// The retention before.
    pub from: Duration,
    /// When the larger one took effect.
    pub since: DateTime<Utc>,
}

fn chrono(d: Duration) -> chrono::Duration {
    // every duration here is bounded by the range check or the margins: it always converts
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::hours(72))
}

impl TtlPolicy {
    /// A policy with `ttl`; refused outside 24–72 h.
    pub fn new(ttl: Duration) -> Result<Self, TtlError> {
        if (MIN_TTL..=MAX_TTL).contains(&ttl) { Ok(Self(ttl, None)) } else { Err(TtlError { got: ttl }) }
    }

    /// This retention, raised at `since` from `from`. Rows written before `since` expire `from` after
    /// they were written, so until none of them can matter the age rules keep `from`'s limits for the ids
    /// dated before the raise (see [`TtlPolicy::admission_floor`]); new rows get the larger retention at
    /// once. Raising the retention is then safe with no waiting; a lower or equal `from` is no raise.
    pub fn raised_from(self, from: Duration, since: DateTime<Utc>) -> Self {
        if from < self.0 { Self(self.0, Some(Raise { from, since })) } else { Self(self.0, None) }
    }

    /// The raise this policy is in, if any.
    pub fn raise(&self) -> Option<Raise> {
        self.1
    }

    /// Whether the raise (if any) still matters at `now`: ids dated before `since + MAX_FUTURE_SKEW` may
    /// have rows written under the old retention until the larger floor passes that time.
    pub fn in_transition(&self, now: DateTime<Utc>) -> bool {
        self.1.is_some_and(|r| now - chrono(self.0) + chrono(ADMISSION_MARGIN) < r.since + chrono(MAX_FUTURE_SKEW))
    }

    /// The oldest id time (less `margin`) whose record may still exist at `now`: `now - ttl + margin`, and
    /// during a raise, ids that may have been recorded before it (dated before `since + skew`) only
    /// back to `now - from + margin`.
    fn floor(&self, now: DateTime<Utc>, margin: Duration, skew: Duration) -> DateTime<Utc> {
        let base = now - chrono(self.0) + chrono(margin);
        match self.1 {
            Some(r) => base.max((r.since + chrono(skew)).min(now - chrono(r.from) + chrono(margin))),
            None => base,
        }
    }

    /// The retention.
    pub fn ttl(&self) -> Duration {
        self.0
    }

    /// The admission floor of a deduplicating receiver: a message whose id carries a time older than this
    /// may have been processed more than a retention ago, its dedup row already gone, so it must not be
    /// applied (it goes to the dead-letter topic as `older-than-dedup-window`). Every message admitted has
    /// a time after `now - ttl + ADMISSION_MARGIN`, and a row written for it is kept at least `ttl` after that
    /// time, so any later duplicate of it meets either its row or this floor.
    ///
    /// During a raise ([`TtlPolicy::raised_from`]) an id dated before `since + MAX_FUTURE_SKEW` may have been
    /// processed before the raise, its row kept only `from`: such ids are admitted only down to
    /// `now - from + margin`. Every other id was processed after the raise (the ceiling admits nothing dated
    /// further ahead than the skew), under the larger retention.
    pub fn admission_floor(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        self.floor(now, ADMISSION_MARGIN, MAX_FUTURE_SKEW)
    }

    /// The oldest creation time a UUID v7 `Idempotency-Key` may carry at `now` when its record is gone: the
    /// admission floor of events, for the same reasons. The margin covers the checking host's clock lagging
    /// the database's, by whose clock the cleaner deletes records (it refuses to run more than
    /// [`ADMISSION_MARGIN`] off): without it, a host 50 minutes behind accepted a key 50 minutes after its
    /// record was deleted and ran a refund twice (issue 32.4, `model/src/key_window.rs`). During a raise,
    /// keys dated before `since + MAX_FUTURE_SKEW` keep the old limit: old instances of a rolling deploy up
    /// to a day long may still have written records of the old retention.
    pub fn key_floor(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        self.admission_floor(now)
    }

    /// When something created at `now` expires.
    pub fn expires_at(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        now + chrono(self.0)
    }

    /// Whether a deduplicating receiver applies, at `now`, an event whose id carries `event_time` (`None`:
    /// an id without a time, a UUID v4, retained by processing time and always admitted).
    pub fn admission(&self, now: DateTime<Utc>, event_time: Option<DateTime<Utc>>) -> Admission {
        match event_time {
            Some(t) if t < self.admission_floor(now) => Admission::TooOld,
            Some(t) if t > admission_ceiling(now) => Admission::FutureDated,
            _ => Admission::Admitted,
        }
    }

    /// Until when the dedup row of an event processed at `processed_at`, whose id carries `event_time`,
    /// is kept: a retention after the **later** of the two.
    ///
    /// The invariant (model-checked in `model/`, `inbox_outbox`): *every admitted duplicate of an event
    /// finds that event's row*. A duplicate arriving at `now` is admitted only while
    /// `event_time >= now - ttl + ADMISSION_MARGIN`, i.e. until `event_time + ttl - ADMISSION_MARGIN`; the
    /// row lives until at least `event_time + ttl` and at least `processed_at + ttl`, so it outlives the
    /// admission by the margin. Counting from processing time alone broke it for ids dated ahead (up to
    /// [`MAX_FUTURE_SKEW`]): an id dated `D` ahead stayed admissible for `D - ADMISSION_MARGIN` after its
    /// row was gone.
    pub fn retain_until(&self, processed_at: DateTime<Utc>, event_time: Option<DateTime<Utc>>) -> DateTime<Utc> {
        self.expires_at(event_time.map_or(processed_at, |t| t.max(processed_at)))
    }
}

/// What a deduplicating receiver does with an event, by the time its id carries ([`TtlPolicy::admission`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Inside the window: deduplicated by its row and applied if new.
    Admitted,
    /// Older than the admission floor: its row may be gone; dead-lettered `older-than-dedup-window`.
    TooOld,
    /// Dated beyond [`MAX_FUTURE_SKEW`] ahead: the producer's clock is wrong; dead-lettered.
    FutureDated,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bounds_are_inclusive() {
        assert!(TtlPolicy::new(MIN_TTL).is_ok());
        assert!(TtlPolicy::new(MAX_TTL).is_ok());
        assert!(TtlPolicy::new(MIN_TTL - Duration::from_secs(1)).is_err());
        assert!(TtlPolicy::new(MAX_TTL + Duration::from_secs(1)).is_err());
    }

    #[test]
    fn error_names_the_rule() {
        let err = TtlPolicy::new(Duration::from_secs(3600)).expect_err("1h is too short");
        let text = err.to_string();
        assert!(text.contains("between 24h and 72h"), "{text}");
        assert!(text.contains("3600s"), "{text}");
    }

    #[test]
    fn expiry_adds_the_ttl() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).expect("valid");
        let policy = TtlPolicy::new(Duration::from_secs(48 * 3600)).expect("valid");
        assert_eq!(policy.expires_at(now) - now, chrono::Duration::hours(48));
    }

    #[test]
    fn the_admission_floor_sits_a_margin_inside_the_retention() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).expect("valid");
        let policy = TtlPolicy::new(Duration::from_secs(72 * 3600)).expect("valid");
        assert_eq!(now - policy.admission_floor(now), chrono::Duration::hours(71));
    }

    /// Issue 24.4: DEDUP_TTL raised from 24 h to 72 h. An event 23 h old processed just before the raise
    /// has a row until 24 h after processing; 30 h later the plain 72 h floor admits it again, the raised
    /// policy does not.
    #[test]
    fn a_raised_ttl_keeps_the_old_floor_for_ids_recorded_before_the_raise() {
        let processed = DateTime::from_timestamp(1_700_000_000, 0).expect("valid");
        let old = TtlPolicy::new(MIN_TTL).expect("valid");
        let event_time = processed - chrono::Duration::hours(23) + chrono::Duration::minutes(30);
        assert_eq!(old.admission(processed, Some(event_time)), Admission::Admitted);
        let row_until = old.retain_until(processed, Some(event_time));
        let duplicate_at = processed + chrono::Duration::hours(30);
        assert!(duplicate_at > row_until);
        let plain = TtlPolicy::new(MAX_TTL).expect("valid");
        assert_eq!(plain.admission(duplicate_at, Some(event_time)), Admission::Admitted, "the hole");
        let raised = plain.raised_from(MIN_TTL, processed + chrono::Duration::minutes(1));
        assert_eq!(raised.admission(duplicate_at, Some(event_time)), Admission::TooOld);
        // ids dated after the raise get the larger window at once
        let later = processed + chrono::Duration::hours(26);
        assert_eq!(raised.admission(later + chrono::Duration::hours(50), Some(later)), Admission::Admitted);
        assert!(raised.in_transition(duplicate_at));
        assert!(!raised.in_transition(processed + chrono::Duration::hours(24 + 72)));
    }

    #[test]
    fn an_id_dated_ahead_is_retained_from_its_own_time() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).expect("valid");
        let policy = TtlPolicy::new(MIN_TTL).expect("valid");
        let ahead = now + chrono::Duration::hours(10);
        assert_eq!(policy.retain_until(now, Some(ahead)), ahead + chrono::Duration::hours(24));
        assert_eq!(policy.retain_until(now, Some(now - chrono::Duration::hours(3))), now + chrono::Duration::hours(24));
        assert_eq!(policy.retain_until(now, None), now + chrono::Duration::hours(24));
    }

    proptest! {
        /// Raising the retention: a row written before the raise (old retention) is found by every
        /// duplicate admitted after it, under the raised policy.
        #[test]
        fn a_raise_admits_no_duplicate_whose_row_had_the_old_retention(
            old_h in 24i64..72,
            raise_by_h in 1i64..=48,
            event_offset_s in -(72 * 3600i64)..=(24 * 3600),
            raise_after_s in 0i64..(80 * 3600),
            later_s in 0i64..(250 * 3600),
        ) {
            let new_h = (old_h + raise_by_h).min(72);
            prop_assume!(new_h > old_h);
            let old = TtlPolicy::new(Duration::from_secs(old_h as u64 * 3600)).expect("in range");
            let processed = DateTime::from_timestamp(1_700_000_000, 0).expect("valid");
            let event_time = processed + chrono::Duration::seconds(event_offset_s);
            prop_assume!(old.admission(processed, Some(event_time)) == Admission::Admitted);
            let row_until = old.retain_until(processed, Some(event_time));
            let since = processed + chrono::Duration::seconds(raise_after_s);
            let raised = TtlPolicy::new(Duration::from_secs(new_h as u64 * 3600))
                .expect("in range")
                .raised_from(old.ttl(), since);
            let duplicate_at = since + chrono::Duration::seconds(later_s);
            if raised.admission(duplicate_at, Some(event_time)) == Admission::Admitted {
                prop_assert!(duplicate_at < row_until, "admitted at {duplicate_at} after the row expired at {row_until}");
            }
        }

        /// Every duplicate admitted after an event was processed finds its row: admission ends before the
        /// row's expiry, whatever the event's time (inside the admitted range) and the duplicate's arrival.
        #[test]
        fn an_admitted_duplicate_always_finds_the_row(
            ttl_h in 24i64..=72,
            event_offset_s in -(72 * 3600i64)..=(24 * 3600),
            later_s in 0i64..(200 * 3600),
        ) {
            let ttl = TtlPolicy::new(Duration::from_secs(ttl_h as u64 * 3600)).expect("in range");
            let processed = DateTime::from_timestamp(1_700_000_000, 0).expect("valid");
            let event_time = processed + chrono::Duration::seconds(event_offset_s);
            prop_assume!(ttl.admission(processed, Some(event_time)) == Admission::Admitted);
            let row_until = ttl.retain_until(processed, Some(event_time));
            let duplicate_at = processed + chrono::Duration::seconds(later_s);
            if ttl.admission(duplicate_at, Some(event_time)) == Admission::Admitted {
                prop_assert!(duplicate_at < row_until, "admitted at {duplicate_at} after the row expired at {row_until}");
            }
        }

        #[test]
        fn accepts_exactly_the_range(secs in 0u64..400_000) {
            let ok = TtlPolicy::new(Duration::from_secs(secs)).is_ok();
            prop_assert_eq!(ok, (24 * 3600..=72 * 3600).contains(&secs));
        }
    }
}

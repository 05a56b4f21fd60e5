//! The claim of a key, one sequence for every front end: the HTTP layer's claim-first path
//! (`idem_http`'s `claim.rs`) and `Idempotent` (scheduled jobs, queue handlers, CLIs). What each does with
//! the outcome differs (an HTTP answer, a typed result); how a key is claimed does not.

use chrono::{DateTime, Utc};
use idem_ports::{ClaimOutcome, IdempotencyClaim, IdempotencyRecord, StoreError, UnitOfWork};

use crate::{Fingerprint, IdempotencyKey, TtlPolicy};

/// What [`claim_key`] found (moved once per claim: the record is not boxed, as in `ClaimOutcome`).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum KeyClaim {
    /// The key is this unit of work's (a new key, or one whose record expired): run the operation.
    Claimed,
    /// A live record: decide with [`crate::decide`] (replay, conflict, in flight, take over).
    Existing(IdempotencyRecord),
    /// A UUID v7 key older than the retention whose record is gone: its first run may have happened and
    /// been forgotten, so it is refused, never run.
    Expired,
}

/// The claim of `key` in `scope` for the operation with `fingerprint`, made `now`: its record lives the
/// retention from now, or from the key's own time for a key dated ahead within the margin.
pub fn claim_for(
    scope: &str,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    ttl: &TtlPolicy,
    now: DateTime<Utc>,
) -> IdempotencyClaim {
    IdempotencyClaim {
        scope: scope.to_owned(),
        key: key.as_str().to_owned(),
        command_hash: *fingerprint.as_bytes(),
        created_at: now,
        expires_at: ttl.retain_until(now, key.first_sent()),
    }
}

/// Claims `claim` (of `key`) in `uow`, waiting at most `wait` for another unit holding the key
/// (`StoreError::LockTimeout` beyond). A key older than the retention is only looked up: it runs again
/// never, and replays while its record is still there (a late retry of a run that happened).
pub async fn claim_key(
    uow: &mut dyn UnitOfWork,
    claim: &IdempotencyClaim,
    key: &IdempotencyKey,
    ttl: &TtlPolicy,
    now: DateTime<Utc>,
    wait: std::time::Duration,
) -> Result<KeyClaim, StoreError> {
    if key.is_expired(ttl, now) {
        return Ok(match uow.idempotency().get(&claim.scope, &claim.key).await? {
            Some(record) if record.expires_at > now => KeyClaim::Existing(record),
            _ => KeyClaim::Expired,
        });
    }
    Ok(match uow.idempotency().claim(claim, now, wait).await? {
        ClaimOutcome::Claimed => KeyClaim::Claimed,
        ClaimOutcome::Existing(record) => KeyClaim::Existing(record),
    })
}

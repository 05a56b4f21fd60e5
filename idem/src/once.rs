//! Idempotent functions: any operation run once per (scope, key) in the caller's unit of work, with the
//! HTTP layer's record, replay, conflict and retention rules — for a scheduled job, a gRPC or queue handler,
//! a CLI.

use std::sync::Arc;
use std::time::Duration;

use idem_domain::usecases::{KeyClaim, claim_for, claim_key};
use idem_domain::{Decision, Fingerprint, IdempotencyKey, IdempotencyKeyError, TtlPolicy, decide};
use idem_ports::{Clock, StoreError, StoredResponse, UnitOfWork};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Runs operations once per (scope, key): [`Idempotent::claim`] in your unit of work, your writes in the
/// same unit, [`Idempotent::complete`] with the result, your commit. A retry with the key gets the stored
/// result back; the key with other input is a conflict; records live the TTL (24–72 h) and the cleaner
/// deletes them, as the HTTP layer's do (they share `idempotency_record`, so give each kind of caller a
/// scope of its own: `"job:nightly-fees"`, `"grpc:merchant-7"`).
///
/// ```no_run
/// # use idem::{Idempotent, Claimed, TransactionManager};
/// # use idem::domain::Fingerprint;
/// # async fn example(tm: &dyn TransactionManager, once: &Idempotent) -> Result<(), Box<dyn std::error::Error>> {
/// let input = serde_json::json!({ "merchant": "m-7", "month": "2026-11" });
/// let fingerprint = Fingerprint::of_call("monthly-fee", &input)?;
/// let mut uow = tm.begin().await?;
/// let fee: u64 = match once.claim(uow.as_mut(), "job:fees", "m-7/2026-11", fingerprint).await? {
///     Claimed::Replay(fee) => {
///         uow.commit().await?; // returns once a synchronous standby has the stored result
///         fee // charged before (this run is a retry): nothing runs again
///     }
///     Claimed::Run(pending) => {
///         let fee = 1_200; // your writes through `uow` (PgUnitOfWork::of for your SQL)
///         once.complete(uow.as_mut(), pending, &fee).await?;
///         uow.commit().await?;
///         fee
///     }
/// };
/// # let _ = fee; Ok(()) }
/// ```
///
/// An error of your own after `claim`: drop (roll back) the unit, and the key stays free for a retry —
/// committing it without `complete` would leave the key in flight until its record expires.
#[derive(Clone)]
pub struct Idempotent {
    clock: Arc<dyn Clock>,
    ttl: TtlPolicy,
    wait: Duration,
}

impl std::fmt::Debug for Idempotent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotent").field("ttl", &self.ttl).field("wait", &self.wait).finish_non_exhaustive()
    }
}

/// What [`Idempotent::claim`] found.
#[derive(Debug)]
#[must_use]
pub enum Claimed<T> {
    /// The key is yours in this unit of work: run the operation, then [`Idempotent::complete`].
    Run(Pending),
    /// The operation ran before with the same input: its stored result. Commit the unit before acting on
    /// it: its commit returns only once the store's synchronous standby has the result (a commit whose
    /// standby wait was cancelled is visible on the primary and on no standby; see
    /// `UnitOfWork::confirm_replication`).
    Replay(T),
}

/// A claimed key waiting for its result ([`Idempotent::complete`]).
#[derive(Debug)]
#[must_use = "complete the claim in the same unit of work, or roll the unit back"]
pub struct Pending {
    scope: String,
    key: String,
}

/// Why an operation was not run.
#[derive(Debug, thiserror::Error)]
pub enum OnceError {
    /// The key is not 1–255 printable ASCII characters.
    #[error(transparent)]
    InvalidKey(#[from] IdempotencyKeyError),
    /// A UUID v7 key older than the retention: its first run may have been forgotten, so it is not run.
    #[error("the key was created longer ago than records are kept; check the outcome, then use a new key")]
    KeyExpired,
    /// A UUID v7 key dated in the future (the caller's clock is wrong).
    #[error("the key carries a creation time in the future")]
    KeyFutureDated,
    /// The key was used with other input.
    #[error("the key was already used with other input")]
    Conflict,
    /// The same operation is running under the key in another unit of work (retry later).
    #[error("the operation is in flight under this key")]
    InFlight,
    /// The store failed (the unit of work is unusable: drop it).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The stored result does not read as the type asked for, or the result does not serialize.
    #[error("the result does not (de)serialize: {0}")]
    Result(#[from] serde_json::Error),
}

impl Idempotent {
    /// Records kept `ttl`; a claim waits at most 2 s for another unit holding the key.
    pub fn new(ttl: TtlPolicy, clock: Arc<dyn Clock>) -> Self {
        Self { clock, ttl, wait: Duration::from_secs(2) }
    }

    /// How long a claim waits for another unit of work holding the key before [`OnceError::InFlight`].
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Claims `key` in `scope` for the operation whose input has `fingerprint`, in `uow`.
    pub async fn claim<T: DeserializeOwned>(
        &self,
        uow: &mut dyn UnitOfWork,
        scope: &str,
        key: &str,
        fingerprint: Fingerprint,
    ) -> Result<Claimed<T>, OnceError> {
        let key = IdempotencyKey::parse(key)?;
        let now = self.clock.now();
        if key.is_future_dated(now) {
            return Err(OnceError::KeyFutureDated);
        }
        let claim = claim_for(scope, &key, &fingerprint, &self.ttl, now);
        // the HTTP layer's claim sequence: an old key runs only if its record is still there (a late retry
        // of a run that happened replays)
        let outcome = match claim_key(uow, &claim, &key, &self.ttl, now, self.wait).await {
            Err(StoreError::LockTimeout) => return Err(OnceError::InFlight),
            outcome => outcome?,
        };
        match outcome {
            KeyClaim::Claimed => Ok(Claimed::Run(Pending { scope: claim.scope, key: claim.key })),
            KeyClaim::Expired => Err(OnceError::KeyExpired),
            KeyClaim::Existing(record) => match decide(Some(&record), &fingerprint, now) {
                Decision::Replay(stored) => {
                    uow.confirm_replication().await?;
                    Ok(Claimed::Replay(serde_json::from_slice(&stored.body)?))
                }
                Decision::Conflict => Err(OnceError::Conflict),
                Decision::Execute | Decision::InFlight | Decision::Resume { .. } => Err(OnceError::InFlight),
            },
        }
    }

    /// Stores `result` as the answer of the claimed key, in the unit of work of its claim: a retry gets it.
    pub async fn complete<T: Serialize>(
        &self,
        uow: &mut dyn UnitOfWork,
        pending: Pending,
        result: &T,
    ) -> Result<(), OnceError> {
        let stored = StoredResponse { status_code: 200, headers: Vec::new(), body: serde_json::to_vec(result)? };
        uow.idempotency().complete(&pending.scope, &pending.key, &stored).await?;
        Ok(())
    }
}

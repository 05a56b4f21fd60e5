use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::StoreError;
use crate::records::{
    ClaimOutcome, HeldCall, HeldRequest, IdempotencyClaim, IdempotencyRecord, LapsedRecord, NewOutboxMessage,
    NewPayment, NewPendingPayment, NewRefund, OutboxRecord, PaymentInsert, PaymentRecord, PaymentStatus, PhaseHold,
    ProcessedEvent, RefundRecord, SagaStepClaim, StoredResponse, TakeOver,
};

/// Begins units of work. One implementation per store; it is a cheap handle, shared by value.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
#[async_trait]
pub trait TransactionManager: Send + Sync {
    /// Begins a transaction.
    ///
    /// MUST return [`StoreError::Unavailable`] when the store cannot be reached (so callers can answer
    /// "retry later" and execute nothing).
    async fn begin(&self) -> Result<Box<dyn UnitOfWork>, StoreError>;

    /// The **completed** idempotency record of `(scope, key)`, read without a transaction (one round trip),
    /// for the replay fast path: a completed record never changes until it expires, so a retry whose
    /// record is completed and matches can be answered from it without claiming the key. `None` when the
    /// key has no completed record — or when the store offers no such read (the default), and then the
    /// caller takes the full path.
    async fn completed_record(&self, _scope: &str, _key: &str) -> Result<Option<IdempotencyRecord>, StoreError> {
        Ok(None)
    }

    /// Checks what a consumer is about to consume with against what earlier starts recorded, and records
    /// it: a renamed group for the same topic (it would start from the earliest offset with no processed
    /// rows) or a switched dedup storage (its rows are not read) is [`SettingsCheckError::Refused`] unless
    /// the change is in `accept`; a raised dedup retention is recorded, and returned while it still
    /// matters (ids dated before it keep the old limits). The consumer runner calls it before it consumes.
    /// A store that records no settings checks nothing (the default).
    async fn check_consumer(&self, _consumer: &ConsumerIdentity) -> Result<Option<RetentionRaise>, SettingsCheckError> {
        Ok(None)
    }

    /// Returns once every commit visible now is on the standbys the store must confirm commits on — the
    /// replay fast path calls it before answering from a record it read outside a transaction. A commit
    /// whose wait for its synchronous standby was cancelled (an operator's cancel, a dropped client noticed
    /// by `client_connection_check_interval`, a terminated session) is visible on the primary although no
    /// standby has it: answered from, it would be a success the next failover takes back. MUST fail (a
    /// transient error) rather than return while that cannot be confirmed. A store without standbys has
    /// nothing to confirm (the default).
    async fn confirm_replicated(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// What a consumer runs with, for [`TransactionManager::check_consumer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerIdentity {
    /// The consumer group.
    pub group: String,
    /// The topic it reads.
    pub topic: String,
    /// Its dedup retention.
    pub dedup_ttl: Duration,
    /// Changes accepted deliberately: `consumer-group`, `dedup-storage`.
    pub accept: Vec<String>,
    /// Now, by the caller's clock (when a change takes effect).
    pub now: DateTime<Utc>,
}

/// A retention raised from `from` at `since`: rows written before kept `from`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionRaise {
    /// The retention before.
    pub from: Duration,
    /// When the larger one took effect.
    pub since: DateTime<Utc>,
}

/// Why a consumer may not start with its settings.
#[derive(Debug, thiserror::Error)]
pub enum SettingsCheckError {
    /// A change that would apply processed events again, with what to do.
    #[error("{0}")]
    Refused(String),
    /// The recorded settings could not be read or written.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// One database transaction and the repositories bound to it.
///
/// Everything done through the repositories of one unit of work commits or rolls back together.
/// [`UnitOfWork::commit`] consumes the unit; dropping it without committing rolls the transaction back, so
/// an early return or a panic can never leave half of a unit applied.
#[async_trait]
pub trait UnitOfWork: Send {
    /// Idempotency records: claim, complete, read.
    fn idempotency(&mut self) -> &mut dyn IdempotencyRepository;
    /// Processed-event rows of consumers (dedup by `event_id`).
    fn processed_events(&mut self) -> &mut dyn ProcessedEventRepository;
    /// The transactional outbox.
    fn outbox(&mut self) -> &mut dyn OutboxRepository;
    /// Saga steps, claimed once per `(saga_id, step)`.
    fn saga_steps(&mut self) -> &mut dyn SagaStepRepository;

    /// The adapter's own unit of work, for the application's queries in this same transaction: the
    /// PostgreSQL adapter's `PgUnitOfWork::of(uow)` downcasts through it and hands out the open
    /// connection. A wrapper around another unit of work returns the inner one's.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;

    /// Commits everything done through this unit. An error means nothing was committed, unless it is
    /// [`StoreError::Unavailable`] raised while the commit itself was in flight, in which case the outcome
    /// is unknown; idempotency keys and event ids make the retry safe either way.
    async fn commit(self: Box<Self>) -> Result<(), StoreError>;

    /// Rolls back explicitly (dropping does the same, without waiting for the server's answer).
    async fn rollback(self: Box<Self>) -> Result<(), StoreError>;

    /// Makes this unit's commit return only once everything committed before it — what it read included —
    /// is on the store's synchronous standbys ([`TransactionManager::confirm_replicated`] says why): call it
    /// before answering from a record this unit read (a replay, a duplicate event), then commit. A store
    /// without standbys has nothing to confirm (the default); a wrapper forwards it.
    async fn confirm_replication(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// The reference payment service's own unit of work: idem's, plus the service's repositories. idem's
/// library parts (layer, consumer runner, relay, cleaner) never use it; an application defines its own
/// the same way, or runs its SQL on the adapter's transaction directly.
#[async_trait]
pub trait PaymentUnitOfWork: UnitOfWork {
    /// Payments and refunds.
    fn payments(&mut self) -> &mut dyn PaymentRepository;
    /// The order projection.
    fn projections(&mut self) -> &mut dyn ProjectionRepository;

    /// [`PaymentRepository::insert_or_get`], and only when the payment is new, [`OutboxRepository::enqueue`]
    /// of `announcement` in the same unit. The default makes the two calls; a store may do both in one
    /// statement (one round trip fewer per charge).
    async fn insert_announced(
        &mut self,
        payment: &NewPayment,
        announcement: &NewOutboxMessage,
    ) -> Result<PaymentInsert, StoreError> {
        let insert = self.payments().insert_or_get(payment).await?;
        if matches!(insert, PaymentInsert::Inserted(_)) {
            self.outbox().enqueue(announcement).await?;
        }
        Ok(insert)
    }
}

/// How the payment service reaches its repositories from the unit of work idem's layer or consumer
/// runner hands it (the store's adapter provides it, for example `idem_postgres::payments_of`).
pub type PaymentsOf = for<'a> fn(&'a mut dyn UnitOfWork) -> Result<&'a mut dyn PaymentUnitOfWork, StoreError>;

/// Payments and their refunds.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
#[async_trait]
pub trait PaymentRepository: Send {
    /// Inserts a payment.
    ///
    /// MUST return [`StoreError::UniqueViolation`] with constraint `payment_provider_external_id_key`
    /// when a payment with the same (provider, external_payment_id) exists. In PostgreSQL that error
    /// aborts the transaction; use [`PaymentRepository::insert_or_get`] inside larger units.
    async fn insert(&mut self, payment: &NewPayment) -> Result<PaymentRecord, StoreError>;

    /// Inserts a payment unless one with the same (provider, external_payment_id) exists, in which case
    /// the existing payment is returned. Never aborts the surrounding transaction on the duplicate; a
    /// concurrent insert of the same pair waits for the other transaction and then sees its row.
    async fn insert_or_get(&mut self, payment: &NewPayment) -> Result<PaymentInsert, StoreError>;

    /// [`PaymentRepository::insert_or_get`] for many payments in one statement (plus one lookup for the
    /// duplicates). Returns one outcome per input, in input order. Two inputs with the same (provider,
    /// external_payment_id) yield `Inserted` for the first and `Existing` (that first row) for the second.
    async fn insert_many_or_get(&mut self, payments: &[NewPayment]) -> Result<Vec<PaymentInsert>, StoreError>;

    /// The payment with this id, if any.
    async fn get(&mut self, id: Uuid) -> Result<Option<PaymentRecord>, StoreError>;

    /// The payment with this id — of `merchant_id`, when given — locked for update until the unit ends. The
    /// merchant is in the locking statement, so another merchant's payment is never locked (nor waited for).
    async fn get_for_update(
        &mut self,
        id: Uuid,
        merchant_id: Option<String>,
    ) -> Result<Option<PaymentRecord>, StoreError>;

    /// The most recent payment of `merchant_id` for an order, locked for update until the unit ends.
    /// Order ids are only unique per merchant: never look one up across merchants.
    async fn find_by_order_for_update(
        &mut self,
        merchant_id: &str,
        order_id: Uuid,
    ) -> Result<Option<PaymentRecord>, StoreError>;

    /// Inserts a pending payment unless a payment with its id exists (a resumed attempt), and returns the
    /// payment as stored.
    async fn insert_pending(&mut self, payment: &NewPendingPayment) -> Result<PaymentRecord, StoreError>;

    /// Captures the pending payment `id` with the provider's charge id, and returns it; `None` when it is
    /// not pending (already captured — by the API path or a webhook — or declined): read it with
    /// [`PaymentRepository::get_for_update`]. The unique (provider, external_payment_id) still holds: a
    /// charge id another payment carries is [`StoreError::UniqueViolation`].
    async fn capture(
        &mut self,
        id: Uuid,
        external_payment_id: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<PaymentRecord>, StoreError>;

    /// Marks the pending payment `id` declined; `None` when it is not pending.
    async fn decline(&mut self, id: Uuid, now: DateTime<Utc>) -> Result<Option<PaymentRecord>, StoreError>;

    /// The refund with this id, if any.
    async fn get_refund(&mut self, id: Uuid) -> Result<Option<RefundRecord>, StoreError>;

    /// Payments idem charged through `provider` (`through_provider`) created at or after `since` and
    /// captured (wholly or partly refunded included), oldest first, at most `limit`, after `after` (a
    /// payment id of the previous page): what the reconciler looks for at the provider.
    async fn charged_through_provider_since(
        &mut self,
        provider: &str,
        since: DateTime<Utc>,
        after: Option<Uuid>,
        limit: i64,
    ) -> Result<Vec<PaymentRecord>, StoreError>;

    /// The payment the provider's charge `external_payment_id` was captured as, locked for update.
    async fn get_by_external_for_update(
        &mut self,
        provider: &str,
        external_payment_id: &str,
    ) -> Result<Option<PaymentRecord>, StoreError>;

    /// Records the provider's event `event_id` as applied, in this unit: false when it was applied before.
    async fn record_provider_event(
        &mut self,
        provider: &str,
        event_id: &str,
        kind: &str,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError>;

    /// Inserts a refund and sets the payment's refunded amount and status.
    async fn apply_refund(
        &mut self,
        refund: &NewRefund,
        refunded_amount: rust_decimal::Decimal,
        status: PaymentStatus,
    ) -> Result<RefundRecord, StoreError>;
}

/// Idempotency records of HTTP commands, keyed by (scope, key).
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
#[async_trait]
pub trait IdempotencyRepository: Send {
    /// Claims `claim.key` in `claim.scope` inside this unit of work.
    ///
    /// If no live record exists (none, or only one that expired before `now`), writes an in-flight record
    /// and returns [`ClaimOutcome::Claimed`]. If a live record exists, returns it. If another unit of work
    /// holds an uncommitted claim on the key, waits up to `wait` for it to end; past that, MUST return
    /// [`StoreError::LockTimeout`] (the unit is then unusable and must be dropped). The same bound may stay
    /// in force for the unit's later lock waits, so a handler never blocks unboundedly either.
    async fn claim(
        &mut self,
        claim: &IdempotencyClaim,
        now: DateTime<Utc>,
        wait: Duration,
    ) -> Result<ClaimOutcome, StoreError>;

    /// Stores the response of a claimed key and marks it completed.
    async fn complete(&mut self, scope: &str, key: &str, response: &StoredResponse) -> Result<(), StoreError>;

    /// Records `claim.key` completed with `response` in this unit of work, at its end, when nothing claimed
    /// it first: the business writes are already made in the unit, and the record commits with them.
    ///
    /// Same rules as [`IdempotencyRepository::claim`]: if no live record exists, writes the completed record
    /// and returns [`ClaimOutcome::Claimed`]; if one exists (committed by another unit), writes nothing and
    /// returns it — the caller MUST then roll the unit back (its writes were made for a key that was taken)
    /// and decide on the record; if another unit holds an uncommitted record of the key, waits up to `wait`
    /// for it, then [`StoreError::LockTimeout`]. The default claims and completes (two statements); a store
    /// does it in one.
    async fn insert_completed(
        &mut self,
        claim: &IdempotencyClaim,
        response: &StoredResponse,
        now: DateTime<Utc>,
        wait: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        match self.claim(claim, now, wait).await? {
            ClaimOutcome::Claimed => {
                self.complete(&claim.scope, &claim.key, response).await?;
                Ok(ClaimOutcome::Claimed)
            }
            existing => Ok(existing),
        }
    }

    /// The record for (scope, key), expired or not.
    async fn get(&mut self, scope: &str, key: &str) -> Result<Option<IdempotencyRecord>, StoreError>;

    /// Holds the record claimed (or taken over) in this unit between the phases of a foreign call: the
    /// lease of `hold.attempt` and its recovery point, written only while that attempt owns the record
    /// (false otherwise: another attempt took it over). Committing the unit commits the first phase.
    async fn hold(&mut self, scope: &str, key: &str, hold: &PhaseHold) -> Result<bool, StoreError> {
        let _ = (scope, key, hold);
        Err(StoreError::Other("this store does not hold records between phases".into()))
    }

    /// Takes over a record held by `attempt` whose lease lapsed and whose `not_before` passed, both on the
    /// database's clock: the next attempt holds it for `lease` from the database's now. `window`: the other
    /// side's idempotency window, measured from the record's first claim (`TakeOver::Taken::past_window`).
    async fn take_over(
        &mut self,
        scope: &str,
        key: &str,
        attempt: u32,
        lease: Duration,
        window: Option<Duration>,
    ) -> Result<TakeOver, StoreError> {
        let _ = (scope, key, attempt, lease, window);
        Err(StoreError::Other("this store does not hold records between phases".into()))
    }

    /// After an unknown outcome of `attempt`'s call: its lease ends now and no attempt may call again
    /// before `wait` from the database's now (the other side's `Retry-After`, else a backoff). False when
    /// another attempt took the record over.
    async fn defer(&mut self, scope: &str, key: &str, attempt: u32, wait: Duration) -> Result<bool, StoreError> {
        let _ = (scope, key, attempt, wait);
        Err(StoreError::Other("this store does not hold records between phases".into()))
    }

    /// How much of `attempt`'s lease is left on the database's clock; `None` when another attempt holds the
    /// record, it completed, was parked, or the lease lapsed.
    async fn lease_left(&mut self, scope: &str, key: &str, attempt: u32) -> Result<Option<Duration>, StoreError> {
        let _ = (scope, key, attempt);
        Err(StoreError::Other("this store does not hold records between phases".into()))
    }

    /// Locks the record for the second phase if `attempt` still holds it (the fencing check); false for a
    /// late original whose record was taken over.
    async fn owns(&mut self, scope: &str, key: &str, attempt: u32) -> Result<bool, StoreError> {
        let _ = (scope, key, attempt);
        Err(StoreError::Other("this store does not hold records between phases".into()))
    }

    /// Records held between phases, not parked, whose lease lapsed at least `grace` × 2^runs (at most
    /// `max_backoff`) before `now`: their client is taken to have gone away. At most `limit`, round-robin
    /// over scopes (each scope's oldest, then each one's second, …: one merchant's backlog never delays
    /// another's), skipping rows another unit has locked.
    async fn lapsed(
        &mut self,
        now: DateTime<Utc>,
        grace: Duration,
        max_backoff: Duration,
        limit: i64,
    ) -> Result<Vec<LapsedRecord>, StoreError> {
        let _ = (now, grace, max_backoff, limit);
        Err(StoreError::Other("this store does not hold records between phases".into()))
    }

    /// Cancels the held request of (scope, key) if its call never started (no attempt took it over: the
    /// completer has not sent it), under the record's lock: completed with `response`, so no attempt ever
    /// sends it. [`HeldCall::InProgress`] when an attempt took it (its call may be out), `None` when the key
    /// has no held request (absent or completed).
    async fn cancel_unstarted(
        &mut self,
        scope: &str,
        key: &str,
        response: &StoredResponse,
    ) -> Result<Option<HeldCall>, StoreError> {
        let _ = (scope, key, response);
        Err(StoreError::Other("this store does not hold records between phases".into()))
    }

    /// Keys of `scope`'s held requests (not completed) whose key starts with `key_prefix`, sent to `uri`,
    /// whose JSON body's top-level `field` is `value`: how a request held under an older key scheme is
    /// found by what it is about (an order's charge held under `event:<event_id>`).
    async fn held_with_field(
        &mut self,
        scope: &str,
        key_prefix: &str,
        uri: &str,
        field: &str,
        value: &str,
    ) -> Result<Vec<String>, StoreError> {
        let _ = (scope, key_prefix, uri, field, value);
        Err(StoreError::Other("this store does not hold records between phases".into()))
    }

    /// Holds `held` for the completer, lapsed from the start (in the caller's unit: an event's
    /// transaction); false when the key has a record already.
    async fn enqueue_held(&mut self, held: &HeldRequest) -> Result<bool, StoreError> {
        let _ = held;
        Err(StoreError::Other("this store does not hold records between phases".into()))
    }

    /// Counts one run of the completer on a held record (its backoff grows).
    async fn completer_ran(&mut self, scope: &str, key: &str) -> Result<(), StoreError> {
        let _ = (scope, key);
        Err(StoreError::Other("this store does not hold records between phases".into()))
    }

    /// Parks a record held between phases for an operator (`reason` says why): it is no longer taken over
    /// by a retry or the completer, and never cleaned up. False when it is not held (completed meanwhile).
    async fn park(&mut self, scope: &str, key: &str, reason: &str, now: DateTime<Utc>) -> Result<bool, StoreError> {
        let _ = (scope, key, reason, now);
        Err(StoreError::Other("this store does not hold records between phases".into()))
    }
}

/// Events already processed, per consumer.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
#[async_trait]
pub trait ProcessedEventRepository: Send {
    /// Records `events` as processed by `consumer` in one statement and returns the ids that were not
    /// recorded before (in no particular order; an id repeated within `events` counts once). A concurrent unit recording the same id waits for it to commit
    /// and then sees it as already recorded. Never raises on duplicates.
    async fn record_new(
        &mut self,
        consumer: &str,
        events: &[ProcessedEvent],
        created_at: DateTime<Utc>,
    ) -> Result<Vec<Uuid>, StoreError>;

    /// Whether `consumer` recorded `event_id`. A check outside the recording statement races with
    /// concurrent consumers; it exists for diagnostics and for measuring that naive shape, not for dedup.
    async fn is_processed(&mut self, consumer: &str, event_id: Uuid) -> Result<bool, StoreError>;

    /// Which of `event_ids` an operator admitted for `consumer` although they are older than the dedup
    /// window (`idem dlq redrive --admit-late`), applied already or not (an applied one is a duplicate).
    async fn late_admitted(&mut self, consumer: &str, event_ids: &[Uuid]) -> Result<Vec<Uuid>, StoreError>;

    /// Marks the late admission of `event_id` applied, in this unit of work; `false` if it was not
    /// admitted or is already applied (a concurrent unit doing the same waits, then gets `false`). The
    /// admission row stays: it is that event's dedup record.
    async fn apply_late_admission(
        &mut self,
        consumer: &str,
        event_id: Uuid,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError>;
}

/// The transactional outbox: messages written with the business change, published later by the relay.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
#[async_trait]
pub trait OutboxRepository: Send {
    /// Writes one message; it is published after this unit commits.
    async fn enqueue(&mut self, message: &NewOutboxMessage) -> Result<(), StoreError>;

    /// Enqueues many messages in one statement.
    async fn enqueue_many(&mut self, messages: &[NewOutboxMessage]) -> Result<(), StoreError>;

    /// Claims up to `limit` unpublished rows, oldest first, locked until this unit ends. Rows locked by
    /// another unit are skipped, and so are rows whose key another unit has claimed rows of, so that
    /// concurrent relays never publish one key's messages out of order nor a row twice at the same time.
    async fn claim_unpublished(&mut self, limit: i64) -> Result<Vec<OutboxRecord>, StoreError>;

    /// Deletes rows whose publish the broker acknowledged: one write per row, nothing left to clean up.
    /// Receivers dedup by event id, so nothing needs a published row afterwards.
    async fn delete_published(&mut self, ids: &[Uuid]) -> Result<(), StoreError>;

    /// Records a failed publish attempt of rows that stay unpublished.
    async fn record_failure(&mut self, ids: &[Uuid], error: &str) -> Result<(), StoreError>;

    /// Records that the broker refused rows for good (too large, not authorized, invalid); a row refused
    /// `quarantine_after` times is quarantined: never claimed again until an operator retries it, and the
    /// later rows of its key wait behind it. Returns how many rows this call quarantined.
    async fn record_rejection(&mut self, ids: &[Uuid], error: &str, quarantine_after: i32) -> Result<u64, StoreError>;

    /// Number of unpublished rows (the relay's backlog).
    async fn backlog(&mut self) -> Result<i64, StoreError>;
}

/// Wakes the relay when outbox rows are committed (for example PostgreSQL LISTEN/NOTIFY).
#[async_trait]
pub trait OutboxWakeup: Send {
    /// Returns when new rows may have been committed, or after `timeout` (the polling fallback).
    async fn wait(&mut self, timeout: Duration);
}

/// Saga steps, each run at most once per saga.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
#[async_trait]
pub trait SagaStepRepository: Send {
    /// Claims (saga_id, step): [`SagaStepClaim::Claimed`] when it never ran, otherwise its recorded
    /// outcome. A concurrent claim of the same step waits for this unit to end.
    async fn claim(&mut self, saga_id: Uuid, step: &str, now: DateTime<Utc>) -> Result<SagaStepClaim, StoreError>;

    /// Records the outcome of a claimed step.
    async fn complete(&mut self, saga_id: Uuid, step: &str, outcome: &serde_json::Value) -> Result<(), StoreError>;
}

/// The order projection kept by the event handler.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
#[async_trait]
pub trait ProjectionRepository: Send {
    /// Applies (version, status) to the order only if `version` is greater than the stored one (or the
    /// order is new). Returns whether it was applied.
    async fn apply_order_version(
        &mut self,
        order_id: Uuid,
        version: i64,
        status: &str,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError>;

    /// [`ProjectionRepository::apply_order_version`] for many distinct orders in one statement; returns
    /// the orders whose version was applied. Order ids MUST be distinct.
    async fn apply_order_versions(
        &mut self,
        versions: &[(Uuid, i64, String)],
        now: DateTime<Utc>,
    ) -> Result<Vec<Uuid>, StoreError>;
}

/// A unit of work made of mocks, for use-case tests in other crates. Commit and rollback record what
/// happened in `outcome`.
#[cfg(any(test, feature = "mocks"))]
pub mod fake {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// How a [`MockUnitOfWork`] ended.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum Ended {
        /// Neither committed nor rolled back yet.
        #[default]
        Open,
        /// `commit` was called.
        Committed,
        /// `rollback` was called.
        RolledBack,
    }

    /// A [`UnitOfWork`] whose repositories are mockall mocks.
    #[derive(Default)]
    pub struct MockUnitOfWork {
        /// Expectations of `payments()`.
        pub payments: MockPaymentRepository,
        /// Expectations of `idempotency()`.
        pub idempotency: MockIdempotencyRepository,
        /// Expectations of `processed_events()`.
        pub processed_events: MockProcessedEventRepository,
        /// Expectations of `outbox()`.
        pub outbox: MockOutboxRepository,
        /// Expectations of `saga_steps()`.
        pub saga_steps: MockSagaStepRepository,
        /// Expectations of `projections()`.
        pub projections: MockProjectionRepository,
        /// How the unit ended (shared, so a test can read it after the unit was consumed).
        pub ended: Arc<Mutex<Ended>>,
    }

    impl std::fmt::Debug for MockUnitOfWork {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("MockUnitOfWork").finish_non_exhaustive()
        }
    }

    impl PaymentUnitOfWork for MockUnitOfWork {
        fn payments(&mut self) -> &mut dyn PaymentRepository {
            &mut self.payments
        }
        fn projections(&mut self) -> &mut dyn ProjectionRepository {
            &mut self.projections
        }
    }

    /// [`PaymentsOf`] for units of work that are [`MockUnitOfWork`]s.
    pub fn mock_payments_of(uow: &mut dyn UnitOfWork) -> Result<&mut dyn PaymentUnitOfWork, StoreError> {
        match uow.as_any_mut().downcast_mut::<MockUnitOfWork>() {
            Some(mock) => Ok(mock),
            None => Err(StoreError::Other("not a MockUnitOfWork".into())),
        }
    }

    #[async_trait]
    impl UnitOfWork for MockUnitOfWork {
        fn idempotency(&mut self) -> &mut dyn IdempotencyRepository {
            &mut self.idempotency
        }
        fn processed_events(&mut self) -> &mut dyn ProcessedEventRepository {
            &mut self.processed_events
        }
        fn outbox(&mut self) -> &mut dyn OutboxRepository {
            &mut self.outbox
        }
        fn saga_steps(&mut self) -> &mut dyn SagaStepRepository {
            &mut self.saga_steps
        }
        fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
            self
        }
        async fn commit(self: Box<Self>) -> Result<(), StoreError> {
            *self.ended.lock().map_err(|e| StoreError::Other(e.to_string()))? = Ended::Committed;
            Ok(())
        }
        async fn rollback(self: Box<Self>) -> Result<(), StoreError> {
            *self.ended.lock().map_err(|e| StoreError::Other(e.to_string()))? = Ended::RolledBack;
            Ok(())
        }
    }
}

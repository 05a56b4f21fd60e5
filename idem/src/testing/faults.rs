//! Units of work whose commit fails the way production's do: the process dies before `COMMIT` reaches the
//! database (nothing was written), or the connection breaks after it (everything was written, and the
//! caller cannot tell). Everything but `commit` goes to the real unit of work, so your SQL on
//! `PgUnitOfWork::of` works through them.
//!
//! ```no_run
//! # use std::sync::Arc;
//! use idem::testing::faults::{FaultyCommits, dies_before_commit};
//! # async fn example(db: idem::testing::TestDb) {
//! // the first unit of work dies before COMMIT, the later ones commit
//! let tm = Arc::new(FaultyCommits::first(1, Arc::new(db.store.clone()), dies_before_commit));
//! # }
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use async_trait::async_trait;
use futures::future::BoxFuture;
use idem_ports::{
    IdempotencyRepository, OutboxRepository, ProcessedEventRepository, SagaStepRepository, StoreError,
    TransactionManager, UnitOfWork,
};

/// How one unit of work commits: given the real unit, the outcome its caller sees.
pub type Commit = Box<dyn FnOnce(Box<dyn UnitOfWork>) -> BoxFuture<'static, Result<(), StoreError>> + Send>;

/// A transaction manager whose units commit as `decide` says; `decide` runs at each `begin` (count
/// units there to fault only some of them).
pub struct FaultyCommits {
    inner: Arc<dyn TransactionManager>,
    decide: Box<dyn Fn() -> Commit + Send + Sync>,
}

impl std::fmt::Debug for FaultyCommits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FaultyCommits")
    }
}

impl FaultyCommits {
    /// Units of `inner` committing as `decide` says.
    pub fn new(inner: Arc<dyn TransactionManager>, decide: impl Fn() -> Commit + Send + Sync + 'static) -> Self {
        Self { inner, decide: Box::new(decide) }
    }

    /// The first `n` units of `inner` fail with `fault` ([`dies_before_commit`], [`dies_after_commit`]);
    /// the later ones commit.
    pub fn first(n: usize, inner: Arc<dyn TransactionManager>, fault: fn() -> Commit) -> Self {
        let left = AtomicUsize::new(n);
        Self::new(inner, move || {
            let faulty = left.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok();
            if faulty { fault() } else { commits() }
        })
    }
}

/// The real commit.
pub fn commits() -> Commit {
    Box::new(|uow| uow.commit())
}

/// The process dies before `COMMIT`: the transaction is dropped (the server rolls it back) and the caller
/// sees the connection gone.
pub fn dies_before_commit() -> Commit {
    Box::new(|uow| {
        Box::pin(async move {
            drop(uow);
            Err(StoreError::Unavailable("the process died before COMMIT".into()))
        })
    })
}

/// The connection breaks after `COMMIT` was sent: the transaction commits, and the caller sees an error
/// and cannot tell whether it did.
pub fn dies_after_commit() -> Commit {
    Box::new(|uow| {
        Box::pin(async move {
            uow.commit().await?;
            Err(StoreError::Unavailable("the connection broke after COMMIT was sent".into()))
        })
    })
}

#[async_trait]
impl TransactionManager for FaultyCommits {
    async fn begin(&self) -> Result<Box<dyn UnitOfWork>, StoreError> {
        let commit = (self.decide)();
        Ok(Box::new(FaultyUow { inner: self.inner.begin().await?, commit }))
    }
    async fn completed_record(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Option<idem_ports::IdempotencyRecord>, StoreError> {
        self.inner.completed_record(scope, key).await
    }
    async fn confirm_replicated(&self) -> Result<(), StoreError> {
        self.inner.confirm_replicated().await
    }
}

struct FaultyUow {
    inner: Box<dyn UnitOfWork>,
    commit: Commit,
}

#[async_trait]
impl UnitOfWork for FaultyUow {
    fn idempotency(&mut self) -> &mut dyn IdempotencyRepository {
        self.inner.idempotency()
    }
    fn processed_events(&mut self) -> &mut dyn ProcessedEventRepository {
        self.inner.processed_events()
    }
    fn outbox(&mut self) -> &mut dyn OutboxRepository {
        self.inner.outbox()
    }
    fn saga_steps(&mut self) -> &mut dyn SagaStepRepository {
        self.inner.saga_steps()
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self.inner.as_any_mut()
    }
    async fn commit(self: Box<Self>) -> Result<(), StoreError> {
        let Self { inner, commit } = *self;
        commit(inner).await
    }
    async fn rollback(self: Box<Self>) -> Result<(), StoreError> {
        self.inner.rollback().await
    }
    async fn confirm_replication(&mut self) -> Result<(), StoreError> {
        self.inner.confirm_replication().await
    }
}

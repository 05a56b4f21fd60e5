//! One wrapper for the tests' faulty commits: a crash before COMMIT, a hang after it, a slow commit, a
//! commit whose outcome is lost. Everything but `commit` goes to the real unit of work.

use std::sync::Arc;

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
    pub fn new(inner: Arc<dyn TransactionManager>, decide: impl Fn() -> Commit + Send + Sync + 'static) -> Self {
        Self { inner, decide: Box::new(decide) }
    }
}

/// The real commit.
pub fn commits() -> Commit {
    Box::new(|uow| uow.commit())
}

/// The process dies before COMMIT: the transaction is dropped (the server rolls it back) and the caller
/// sees the connection gone.
pub fn dies_before_commit() -> Commit {
    Box::new(|uow| {
        Box::pin(async move {
            drop(uow);
            Err(StoreError::Unavailable("the process died before COMMIT".into()))
        })
    })
}

#[async_trait]
impl TransactionManager for FaultyCommits {
    async fn begin(&self) -> Result<Box<dyn UnitOfWork>, StoreError> {
        let commit = (self.decide)();
        Ok(Box::new(FaultyUow { inner: self.inner.begin().await?, commit }))
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
}

//! Event handlers typed for PostgreSQL.

use std::sync::Arc;

use async_trait::async_trait;
use idem_kafka::consumer::{Runner, RunnerSettings};
use idem_ports::{Clock, EventHandler, HandlerError, InboundEvent, UnitOfWork};
use idem_postgres::{PgStore, PgUnitOfWork};

/// A deduplicating handler whose events are applied in a PostgreSQL unit of work: it gets
/// [`PgUnitOfWork`] (your SQL on [`PgUnitOfWork::connection`], idem's repositories through
/// [`UnitOfWork`]) instead of a `dyn UnitOfWork` to convert. Run it with [`pg_runner`].
#[async_trait]
pub trait PgEventHandler: Send + Sync {
    /// Applies one event not processed before by this consumer; everything written through `tx` commits
    /// with the event's processed-event row, or not at all.
    async fn handle(&self, tx: &mut PgUnitOfWork, event: &InboundEvent) -> Result<(), HandlerError>;
}

/// A consumer runner applying `handler` in units of work of `store`: the handler's unit of work is
/// PostgreSQL's by construction.
pub fn pg_runner(
    settings: RunnerSettings,
    store: PgStore,
    clock: Arc<dyn Clock>,
    handler: impl PgEventHandler + 'static,
) -> Runner {
    Runner::new(settings, Arc::new(store), clock, pg_handler(handler))
}

/// `handler` as the runner's port, for a [`Runner`] built by hand (over another transaction manager that
/// hands out PostgreSQL units of work, such as `testing::faults::FaultyCommits` around a `PgStore`).
pub fn pg_handler(handler: impl PgEventHandler + 'static) -> Arc<dyn EventHandler> {
    Arc::new(OnPostgres(handler))
}

/// The adapter [`pg_runner`] builds: the runner's units of work come from a `PgStore`.
struct OnPostgres<H>(H);

#[async_trait]
impl<H: PgEventHandler> EventHandler for OnPostgres<H> {
    async fn handle(&self, uow: &mut dyn UnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
        // a unit of work that is not PostgreSQL's is an error of wiring (`pg_runner` cannot make one)
        self.0.handle(PgUnitOfWork::of(uow)?, event).await
    }
}

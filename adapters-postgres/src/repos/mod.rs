//! The repository ports, implemented on one transaction (`PgUnitOfWork`), one module per port.

pub(crate) mod idempotency;
pub(crate) mod outbox;
mod payments;
mod processed_events;
mod saga;

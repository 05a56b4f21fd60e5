//! Driving port: what a message consumer calls to apply one event.

use async_trait::async_trait;
use thiserror::Error;

use crate::error::StoreError;
use crate::records::InboundEvent;
use crate::repositories::UnitOfWork;

/// Why an event could not be applied. The consumer decides from the variant: dead-letter at once, retry
/// a bounded number of times, or retry until the store is back.
#[derive(Debug, Error)]
pub enum HandlerError {
    /// The message can never be applied as sent (unparsable body, missing field): dead-lettered at once.
    #[error("malformed event: {0}")]
    Malformed(String),
    /// The message was refused by a business rule; retried a few times, then dead-lettered.
    #[error("event rejected: {0}")]
    Rejected(String),
    /// The store failed; transient failures are retried with backoff and never dead-lettered.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Applies events inside a unit of work owned by the caller (who also records them as processed).
#[async_trait]
pub trait EventHandler: Send + Sync {
    /// Applies one event that was not processed before by this consumer. Everything it writes goes
    /// through `uow`, so it commits with the processed-event row or not at all.
    async fn handle(
        &self,
        uow: &mut dyn UnitOfWork,
        event: &InboundEvent,
    ) -> Result<(), HandlerError>;
}

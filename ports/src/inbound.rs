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

/// The event of a batch that failed, by its index in the batch.
#[derive(Debug, Error)]
#[error("event {index} of the batch: {error}")]
pub struct BatchError {
    /// Position of the failed event in the batch.
    pub index: usize,
    /// Why it failed.
    pub error: HandlerError,
}

/// Applies events inside a unit of work owned by the caller (who also records them as processed).
#[async_trait]
pub trait EventHandler: Send + Sync {
    /// Applies one event that was not processed before by this consumer. Everything it writes goes
    /// through `uow`, so it commits with the processed-event row or not at all.
    async fn handle(&self, uow: &mut dyn UnitOfWork, event: &InboundEvent) -> Result<(), HandlerError>;

    /// Applies events in order, as [`EventHandler::handle`] would one by one (the default does exactly
    /// that). Handlers may override it with set-based statements; the effects MUST equal the sequential
    /// ones. On error the caller rolls the whole unit back.
    async fn handle_batch(&self, uow: &mut dyn UnitOfWork, events: &[&InboundEvent]) -> Result<(), BatchError> {
        for (index, event) in events.iter().enumerate() {
            self.handle(uow, event).await.map_err(|error| BatchError { index, error })?;
        }
        Ok(())
    }
}

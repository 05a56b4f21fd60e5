use thiserror::Error;

/// Errors a storage port may return. Adapters map their driver's errors onto these variants; callers
/// decide by variant, never by message.
#[derive(Debug, Error)]
pub enum StoreError {
    /// A uniqueness rule was violated. `constraint` is the name of the violated constraint, so callers can
    /// tell which rule (for example `payment_provider_external_id_key`).
    #[error("unique constraint {constraint} violated")]
    UniqueViolation {
        /// The violated constraint's name.
        constraint: String,
    },
    /// The row the operation needs does not exist.
    #[error("not found")]
    NotFound,
    /// Waiting for a lock held by a concurrent transaction took longer than allowed.
    #[error("lock wait timed out")]
    LockTimeout,
    /// The store could not be reached or the connection broke; retrying later may succeed.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The transaction was chosen as a serialization/deadlock victim; the whole unit may be retried.
    #[error("transaction must be retried: {0}")]
    Retryable(String),
    /// Anything else: a bug or a data problem that retrying will not fix.
    #[error("store error: {0}")]
    Other(String),
}

impl StoreError {
    /// Whether retrying the whole unit of work later can succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::Retryable(_) | Self::LockTimeout)
    }
}

/// Errors of a message publisher.
#[derive(Debug, Error)]
pub enum PublishError {
    /// The broker did not acknowledge in time or could not be reached; the message may or may not have been
    /// written, so a retry can duplicate it (receivers dedup by `event_id`).
    #[error("broker unavailable: {0}")]
    Unavailable(String),
    /// The broker rejected the message for good (too large, unknown topic, authorization).
    #[error("message rejected: {0}")]
    Rejected(String),
}

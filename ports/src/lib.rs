//! The boundary of idem.
//!
//! Traits that the domain's use cases call and the adapters implement, and the plain data types that
//! cross them. Nothing here performs I/O and no driver type (sqlx, rdkafka, axum) appears in a signature:
//! adapters translate their errors into [`StoreError`] / [`PublishError`].
//!
//! The transaction is a value: [`TransactionManager::begin`] returns a [`UnitOfWork`], the repositories
//! are reached through it, [`UnitOfWork::commit`] consumes it, and dropping it uncommitted rolls back.

#![warn(missing_docs)]

mod error;
mod inbound;
mod provider;
mod records;
mod repositories;
mod runtime;
pub mod trace;

pub use error::{PublishError, StoreError};
pub use inbound::{BatchError, EventHandler, HandlerError};
pub use provider::{
    Charge, ChargeRequest, Listed, Listing, Page, PaymentProvider, ProviderError, ProviderRefund, RefundRequest,
};
pub use records::{
    ClaimOutcome, HeldCall, HeldRequest, IdempotencyClaim, IdempotencyRecord, IdempotencyState, InboundEvent,
    LapsedRecord, NewOutboxMessage, NewPayment, NewPendingPayment, NewRefund, OrderVersion, OutboxRecord,
    PaymentInsert, PaymentRecord, PaymentStatus, PhaseHold, ProcessedEvent, RefundRecord, SagaStepClaim, StoredRequest,
    StoredResponse, TakeOver,
};
pub use repositories::{
    ConsumerIdentity, IdempotencyRepository, OutboxRepository, OutboxWakeup, PaymentRepository, PaymentUnitOfWork,
    PaymentsOf, ProcessedEventRepository, ProjectionRepository, RetentionRaise, SagaStepRepository, SettingsCheckError,
    TransactionManager, UnitOfWork,
};
#[cfg(any(test, feature = "mocks"))]
pub use repositories::{
    MockIdempotencyRepository, MockOutboxRepository, MockPaymentRepository, MockProcessedEventRepository,
    MockProjectionRepository, MockSagaStepRepository, MockTransactionManager,
    fake::{Ended, MockUnitOfWork, mock_payments_of},
};
pub use runtime::{Backoff, Clock, IdGenerator, SystemClock, UuidV7Generator};
#[cfg(any(test, feature = "mocks"))]
pub use runtime::{MockClock, MockIdGenerator};

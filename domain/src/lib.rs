//! The pure core of idem: validated values, payment rules, idempotency decisions, dedup and TTL policy,
//! and the use cases that run them over the ports.
//!
//! Architecture invariant: this crate does no I/O. It depends on `idem-ports` for the traits its use cases
//! call, and on no database, broker, HTTP or async-runtime crate. Time and ids come in through the
//! [`idem_ports::Clock`] and [`idem_ports::IdGenerator`] ports.

#![warn(missing_docs)]

pub mod events;
pub mod idempotency;
pub mod json;
pub mod money;
pub mod payment;
pub mod phases;
pub mod saga;
pub mod ttl;
pub mod usecases;
pub mod webhook;
pub mod wire;

pub use events::{EventId, EventIdError, SagaStep, SagaStepError, uuid_v7_time};
pub use idempotency::{Decision, Fingerprint, IdempotencyKey, IdempotencyKeyError, decide};
pub use money::{Amount, Currency, Money, MoneyError, format_amount};
pub use payment::{RefundPlan, RefundRuleError, plan_refund};
pub use ttl::{ADMISSION_MARGIN, Admission, MAX_FUTURE_SKEW, Raise, TtlError, TtlPolicy, admission_ceiling};

//! Saga steps that run at most once per (saga_id, step), usable by any service on the ports.
//!
//! ```text
//! match saga::begin_step(uow, &step, now).await? {
//!     StepStart::Done(outcome) => outcome,          // a repeat: return what was recorded
//!     StepStart::Run => {
//!         let outcome = do_the_step(uow).await?;    // writes through the same unit of work
//!         saga::finish_step(uow, &step, &outcome).await?;
//!         outcome
//!     }
//! }
//! ```
//! The claim row and the step's effects commit together; a concurrent run of the same step waits for the
//! first unit to end and then sees it as done.

use chrono::{DateTime, Utc};
use idem_ports::{SagaStepClaim, StoreError, UnitOfWork};
use serde_json::Value;

use crate::events::SagaStep;

/// Whether a step must run.
#[derive(Debug, Clone, PartialEq)]
pub enum StepStart {
    /// Never ran: run it in this unit of work, then call [`finish_step`].
    Run,
    /// Already ran; its recorded outcome.
    Done(Value),
}

/// Claims a step in `uow`.
pub async fn begin_step(
    uow: &mut dyn UnitOfWork,
    step: &SagaStep,
    now: DateTime<Utc>,
) -> Result<StepStart, StoreError> {
    Ok(match uow.saga_steps().claim(step.saga_id(), step.step(), now).await? {
        SagaStepClaim::Claimed => StepStart::Run,
        SagaStepClaim::Done(outcome) => StepStart::Done(outcome),
    })
}

/// Records the outcome of a step claimed with [`begin_step`].
pub async fn finish_step(uow: &mut dyn UnitOfWork, step: &SagaStep, outcome: &Value) -> Result<(), StoreError> {
    uow.saga_steps().complete(step.saga_id(), step.step(), outcome).await
}

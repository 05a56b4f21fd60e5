//! Fault-injection suite: the real `idem` binary against real PostgreSQL and tansu, with retrying clients,
//! injected faults, and the three invariants checked against the database and the topics afterwards:
//!
//! 1. every operation a client saw succeed exists exactly once;
//! 2. no operation has two effects (payments, refunds, projection, published events after dedup);
//! 3. every committed outbox row was published.
//!
//! `FAULTS_SCALE=full` runs the full size (see RELIABILITY.md); the default is the reduced CI size.
//! `scripts/faults.sh` runs the full size and prints the summary table.

#![allow(clippy::disallowed_methods)] // tests make their own ids and read the clock
#![allow(clippy::print_stdout, clippy::unwrap_used)]

mod harness;
mod phases;
mod scenarios;

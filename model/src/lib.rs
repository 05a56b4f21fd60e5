//! idem's protocols as finite state machines, checked exhaustively with [stateright].
//!
//! - [`http_claim`]: the `Idempotency-Key` claim, replay, crash, lock-wait timeout, expiry and cleanup.
//! - [`inbox_outbox`]: the deduplicating consumer (duplicate deliveries, crashes between the database
//!   commit and the offset commit, rebalances, evictions, the dedup window) and the outbox relay (crashes
//!   between publishing and marking), with receivers deduplicating by `event_id`.
//! - [`dedup_window`]: the dedup window with a real clock — admission floor and ceiling, row retention,
//!   cleanup, late admissions — using the domain's own rules (`TtlPolicy::admission`, `retain_until`).
//! - [`phases`]: phases around a foreign call (a provider charge) with leases, fencing and takeovers,
//!   crashes at every step and a provider deduplicating by key, on the domain's `phases` rules.
//! - [`key_window`]: the end of an `Idempotency-Key`'s retention with hosts' clocks off the database's,
//!   using the domain's key floor (`IdempotencyKey::is_expired`) and `retain_until`.
//!
//! Each model has an `Idem` variant — the protocol as the code implements it; every action is named after
//! the function that performs it — and broken variants, one changed rule each. The tests check every
//! reachable state of each variant: the invariants hold for `Idem`, and each invariant is violated by at
//! least one broken variant (so it can fail). The state spaces are bounded (a few clients, one key, one
//! partition, a fault budget); what the models leave out is listed in the README.

#![warn(missing_docs)]

pub mod dedup_window;
pub mod http_claim;
pub mod inbox_outbox;
pub mod key_window;
pub mod phases;
pub mod provider_edges;

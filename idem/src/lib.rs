//! idem, as one dependency: idempotent HTTP commands, deduplicating Kafka consumers and a transactional
//! outbox for Rust services on PostgreSQL.
//!
//! - [`http`] (feature `http`): the axum [`IdempotencyLayer`](http::IdempotencyLayer), the [`Tx`](http::Tx)
//!   extractor, problem+json ([`Problem`](http::Problem), [`ProblemJson`](http::ProblemJson)).
//! - [`postgres`] (feature `postgres`): the store ([`PgStore`](postgres::PgStore)), its unit of work and your
//!   own SQL in it ([`PgUnitOfWork`](postgres::PgUnitOfWork)), migrations, the cleaner.
//! - [`kafka`] (feature `kafka`): the deduplicating consumer [`Runner`](kafka::consumer::Runner), the outbox
//!   [`Relay`](kafka::relay::Relay), [`EventProducer`](kafka::EventProducer) for producers outside the outbox.
//! - [`PgTx`] (features `http` and `postgres`) and [`PgEventHandler`] with [`pg_runner`] (features `kafka`
//!   and `postgres`): the request's and the event's unit of work, typed for your own SQL.
//! - [`Dispatch`] (features `kafka` and `postgres`): one consumer for several kinds of event, each to its
//!   handler by the `event_type` header, payloads read into your types ([`TypedEventHandler`]).
//! - [`Background`] (features `kafka` and `postgres`): relay, outbox vacuum, cleaner, topic checks and
//!   consumers started in one call, under one shutdown token.
//! - [`Idempotent`]: any operation (a scheduled job, a gRPC or queue handler) run once per key in your unit
//!   of work, with the HTTP layer's record, replay, conflict and retention rules.
//! - [`testing`] (feature `testing`, for dev-dependencies): a database per test, a broker and messages,
//!   commits that die, an application log that counts effects, a shifted clock, a provider stand-in.
//! - At the root: the ports and values every service uses ([`NewOutboxMessage`], [`EventHandler`],
//!   [`TtlPolicy`], …), and [`TaskGroup`].
//!
//! The README's "Use idem in your own service" is a complete example on this crate alone.

#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(all(feature = "kafka", feature = "postgres"))]
mod background;
#[cfg(all(feature = "kafka", feature = "postgres"))]
mod dispatch;
mod once;
#[cfg(all(feature = "kafka", feature = "postgres"))]
mod pg_handler;
#[cfg(all(feature = "http", feature = "postgres"))]
mod pg_tx;
mod tasks;
#[cfg(feature = "testing")]
pub mod testing;

#[cfg(all(feature = "kafka", feature = "postgres"))]
pub use background::Background;
#[cfg(all(feature = "kafka", feature = "postgres"))]
pub use dispatch::{Dispatch, TypedEventHandler, Unhandled};
/// The rules without I/O: keys and fingerprints, the TTL policy, phases and leases, dedup admission.
#[doc(inline)]
pub use idem_domain as domain;
pub use idem_domain::TtlPolicy;
/// The boundary: unit of work, repositories, clock and id traits, and the records crossing them.
#[doc(inline)]
pub use idem_ports as ports;
pub use idem_ports::{
    Clock, EventHandler, HandlerError, IdGenerator, InboundEvent, NewOutboxMessage, StoreError, SystemClock,
    TransactionManager, UnitOfWork, UuidV7Generator,
};
pub use once::{Claimed, Idempotent, OnceError, Pending};
#[cfg(all(feature = "kafka", feature = "postgres"))]
pub use pg_handler::{PgEventHandler, pg_handler, pg_runner};
#[cfg(all(feature = "http", feature = "postgres"))]
pub use pg_tx::PgTx;
pub use tasks::TaskGroup;
/// The shutdown token [`Background`], [`TaskGroup`] and the HTTP server share.
pub use tokio_util::sync::CancellationToken;

/// For implementing [`EventHandler`] (an `async_trait` trait) without depending on the crate yourself.
pub use async_trait::async_trait;

/// The HTTP side: idempotency layer, unit-of-work extractor, problem+json, bounded server.
#[cfg(feature = "http")]
#[doc(inline)]
pub use idem_http as http;
/// The Kafka side: consumer runner, outbox relay, producers, client settings.
#[cfg(feature = "kafka")]
#[doc(inline)]
pub use idem_kafka as kafka;
/// The PostgreSQL side: store, unit of work, migrations, cleaner.
#[cfg(feature = "postgres")]
#[doc(inline)]
pub use idem_postgres as postgres;

//! The request's unit of work, typed for PostgreSQL.

use axum::extract::FromRequestParts;
use axum::http::{StatusCode, request::Parts};
use idem_http::{Problem, ProblemKind, Tx};
use idem_ports::UnitOfWork;
use idem_postgres::PgUnitOfWork;

/// Extractor: the request's unit of work (as [`Tx`]) known to be PostgreSQL's, so your own SQL runs on
/// [`PgTx::connection`] without a conversion that could fail in the handler. Whether the idempotency layer
/// of the route runs on a [`PgStore`](idem_postgres::PgStore) is checked once, when the handler is called: a
/// route whose layer runs on another store answers 500 and logs why, before the handler runs.
///
/// **Write through it, and only through it.** What the handler writes on [`PgTx::connection`] commits with
/// the key's idempotency record and the stored answer, or not at all. A write through the pool (or any
/// other connection) commits on its own: a crash between it and the layer's commit leaves the write without
/// its record (the retry executes again) or the record without the write. A handler that answers without
/// taking its `PgTx` at all is logged at `debug` with its route (`the handler answered without taking its
/// unit of work`).
#[derive(Debug)]
pub struct PgTx(Tx);

impl PgTx {
    /// The unit of work, for idem's repositories (outbox, processed events, saga steps).
    pub fn uow(&mut self) -> &mut dyn UnitOfWork {
        self.0.uow()
    }

    /// The PostgreSQL unit of work.
    pub fn pg(&mut self) -> &mut PgUnitOfWork {
        match PgUnitOfWork::of(self.0.uow()) {
            Ok(pg) => pg,
            // `from_request_parts` builds a PgTx only around a PostgreSQL unit of work
            Err(_) => unreachable!("checked when the PgTx was extracted"),
        }
    }

    /// The open transaction's connection, for your own sqlx queries (see [`PgUnitOfWork::connection`]).
    pub fn connection(&mut self) -> &mut sqlx::PgConnection {
        self.pg().connection()
    }

    /// Ends the first phase before a call to another system ([`Tx::foreign_call`]).
    pub async fn foreign_call(&mut self, step: &str) -> Result<idem_http::ForeignCall, Problem> {
        self.0.foreign_call(step).await
    }

    /// Starts the second phase after the call, if this attempt still owns the request ([`Tx::resume`]).
    pub async fn resume(&mut self, call: idem_http::ForeignCall) -> Result<(), Problem> {
        self.0.resume(call).await
    }

    /// Where a taken-over execution resumes ([`Tx::recovery_point`]).
    pub fn recovery_point(&self) -> Option<&str> {
        self.0.recovery_point()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for PgTx {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        let mut tx = Tx::from_request_parts(parts, state).await?;
        if PgUnitOfWork::of(tx.uow()).is_err() {
            tracing::error!("PgTx on a route whose idempotency layer does not run on a PgStore");
            return Err(Problem::new(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR));
        }
        Ok(Self(tx))
    }
}

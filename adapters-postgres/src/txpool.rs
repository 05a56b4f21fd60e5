//! The connections units of work run on.
//!
//! sqlx's pool pings a connection whenever it goes back to the pool (unconditionally in sqlx 0.8: it
//! cannot know whether a rollback is still pending), so every transaction taken from it costs one round
//! trip more than its statements — on a charge, one of seven, and on this 2-core machine round trips are
//! what a charge's CPU goes to (BENCHMARKS.md). Units of work know how they end, so they take their
//! connections from this pool instead:
//!
//! - committed or rolled back: the connection goes straight back, no round trip;
//! - dropped with its transaction open (an error path, a cancelled request): a task rolls it back before
//!   anyone else can take the connection; without a runtime the connection is closed (the server then
//!   rolls back);
//! - COMMIT or ROLLBACK failed (the outcome is unknown, the connection may be half-read): closed.
//!
//! A connection older than `max_lifetime` (30 min, as sqlx's pool) is closed and replaced when next taken.
//! A connection that rested longer than `ping_after_idle` is pinged before use, and one whose ping or
//! `BEGIN` fails is replaced (nothing ran on it yet), so connections that died while idle (a server
//! restart) cost a retry, not an error. Transactions keep sqlx's bookkeeping (`TransactionManager`), so an
//! application's own `begin()` on [`PgUnitOfWork::connection`](crate::PgUnitOfWork::connection) nests as a
//! savepoint. The other pool (sqlx's) serves everything that is not a unit of work: health checks, cleanup
//! batches, notifications, listeners.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Postgres, TransactionManager};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

type Manager = <Postgres as sqlx::Database>::TransactionManager;

/// A bounded pool of connections for transactions (see the module docs). Cheap to clone.
#[derive(Clone)]
pub(crate) struct TxPool {
    inner: Arc<Inner>,
}

struct Inner {
    options: PgConnectOptions,
    /// Most recently returned last: the warmest connection is reused first.
    idle: Mutex<Vec<Idle>>,
    /// One per connection that exists or is being opened: bounds the pool.
    permits: Arc<Semaphore>,
    acquire_timeout: Duration,
    ping_after_idle: Duration,
    max_lifetime: Duration,
}

/// A connection resting in the pool.
struct Idle {
    conn: PgConnection,
    opened: Instant,
    returned: Instant,
}

impl std::fmt::Debug for TxPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxPool").field("available", &self.inner.permits.available_permits()).finish_non_exhaustive()
    }
}

impl TxPool {
    pub(crate) fn new(
        options: PgConnectOptions,
        max_connections: u32,
        acquire_timeout: Duration,
        ping_after_idle: Duration,
        max_lifetime: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                options,
                idle: Mutex::new(Vec::new()),
                permits: Arc::new(Semaphore::new(max_connections.max(1) as usize)),
                acquire_timeout,
                ping_after_idle,
                max_lifetime,
            }),
        }
    }

    /// Refuses new transactions and closes the idle connections (those in use close when their unit ends).
    pub(crate) async fn close(&self) {
        self.inner.permits.close();
        let idle: Vec<_> =
            std::mem::take(&mut *self.inner.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        for idle in idle {
            let _ = idle.conn.close().await;
        }
    }

    /// A connection with a transaction begun on it. Waits at most `acquire_timeout` for a free
    /// connection (`PoolTimedOut`, which the store maps to "unavailable").
    pub(crate) async fn begin(&self) -> Result<TxConnection, sqlx::Error> {
        let deadline = Instant::now() + self.inner.acquire_timeout;
        let permit = tokio::time::timeout_at(deadline, self.inner.permits.clone().acquire_owned())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        loop {
            let (mut conn, opened, reused) = match self.inner.take_idle() {
                Some(Idle { conn, opened, .. }) if opened.elapsed() > self.inner.max_lifetime => {
                    let _ = conn.close().await; // lived long enough (server-side caches grow): replaced
                    continue;
                }
                Some(Idle { mut conn, opened, returned }) => {
                    if returned.elapsed() > self.inner.ping_after_idle && conn.ping().await.is_err() {
                        continue; // died while idle: dropped, try the next one
                    }
                    (conn, opened, true)
                }
                None => {
                    let connect = PgConnection::connect_with(&self.inner.options);
                    let conn =
                        tokio::time::timeout_at(deadline, connect).await.map_err(|_| sqlx::Error::PoolTimedOut)??;
                    (conn, Instant::now(), false)
                }
            };
            match Manager::begin(&mut conn, None).await {
                Ok(()) => {
                    return Ok(TxConnection {
                        conn: Some(conn),
                        opened,
                        inner: self.inner.clone(),
                        permit: Some(permit),
                    });
                }
                // nothing ran: a reused connection that fails here (it died while idle) is replaced
                Err(_) if reused => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

impl Inner {
    fn take_idle(&self) -> Option<Idle> {
        self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).pop()
    }

    fn put(&self, conn: PgConnection, opened: Instant) {
        if !self.permits.is_closed() {
            let idle = Idle { conn, opened, returned: Instant::now() };
            self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(idle);
        }
    }
}

/// A pooled connection with an open transaction (see the module docs for how it goes back).
pub(crate) struct TxConnection {
    conn: Option<PgConnection>,
    opened: Instant,
    inner: Arc<Inner>,
    /// Released after the connection is back in the pool (or closed).
    permit: Option<OwnedSemaphorePermit>,
}

impl std::fmt::Debug for TxConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TxConnection")
    }
}

impl TxConnection {
    pub(crate) fn connection(&mut self) -> &mut PgConnection {
        #[allow(clippy::expect_used)] // taken only by commit, rollback and drop, which consume self
        self.conn.as_mut().expect("the connection is present until the transaction ends")
    }

    pub(crate) async fn commit(mut self) -> Result<(), sqlx::Error> {
        self.end(true).await
    }

    pub(crate) async fn rollback(mut self) -> Result<(), sqlx::Error> {
        self.end(false).await
    }

    async fn end(&mut self, commit: bool) -> Result<(), sqlx::Error> {
        let Some(mut conn) = self.conn.take() else { return Ok(()) };
        let ended = if commit { Manager::commit(&mut conn).await } else { Manager::rollback(&mut conn).await };
        match ended {
            Ok(()) => {
                self.inner.put(conn, self.opened);
                Ok(())
            }
            Err(e) => Err(e), // outcome unknown, connection possibly half-read: it is closed here
        }
    }
}

impl Drop for TxConnection {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else { return };
        if Manager::get_transaction_depth(&conn) == 0 {
            self.inner.put(conn, self.opened);
            return;
        }
        // Dropped with its transaction open: roll back before the connection can be taken again.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return }; // closed: the server rolls back
        let (inner, permit, opened) = (self.inner.clone(), self.permit.take(), self.opened);
        runtime.spawn(async move {
            while Manager::get_transaction_depth(&conn) > 0 {
                if Manager::rollback(&mut conn).await.is_err() {
                    drop(permit);
                    return; // closed
                }
            }
            inner.put(conn, opened);
            drop(permit);
        });
    }
}

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
//! restart) cost a retry, not an error. Every step on a connection — the ping, `BEGIN`, the rollback of an
//! abandoned transaction — is bounded by `step_timeout`: after a failover that black-holes the old
//! connections (no RST), a stuck step costs that bound, not the kernel's ~15 minutes, and no slot is lost. Transactions keep sqlx's bookkeeping (`TransactionManager`), so an
//! application's own `begin()` on [`PgUnitOfWork::connection`](crate::PgUnitOfWork::connection) nests as a
//! savepoint. The other pool (sqlx's) serves everything that is not a unit of work: health checks, cleanup
//! batches, notifications, listeners.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgConnection;
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
    /// Where new connections go (one server, or the one found of several).
    servers: crate::servers::Servers,
    /// Most recently returned last: the warmest connection is reused first.
    idle: Mutex<Vec<Idle>>,
    /// One per connection that exists or is being opened: bounds the pool.
    permits: Arc<Semaphore>,
    bounds: Bounds,
    /// The statement transactions begin with (behind a transaction pooler), or plain `BEGIN`.
    begin_sql: Option<Arc<str>>,
}

/// Size and time bounds of the pool (see `PoolSettings`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    pub(crate) max_connections: u32,
    pub(crate) acquire_timeout: Duration,
    pub(crate) ping_after_idle: Duration,
    pub(crate) max_lifetime: Duration,
    /// Longest ping, `BEGIN` or rollback of an abandoned transaction: a connection that takes longer is
    /// considered lost (black-holed) and closed.
    pub(crate) step_timeout: Duration,
}

/// A connection resting in the pool.
struct Idle {
    conn: PgConnection,
    opened: Opened,
    returned: Instant,
}

/// When a connection was opened, and under which generation of the servers (a failover moves it on, and
/// a connection opened before is closed instead of reused).
#[derive(Debug, Clone, Copy)]
struct Opened {
    at: Instant,
    generation: u64,
}

impl std::fmt::Debug for TxPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxPool").field("available", &self.inner.permits.available_permits()).finish_non_exhaustive()
    }
}

impl TxPool {
    pub(crate) fn new(servers: crate::servers::Servers, bounds: Bounds, begin_sql: Option<Arc<str>>) -> Self {
        Self {
            inner: Arc::new(Inner {
                servers,
                idle: Mutex::new(Vec::new()),
                permits: Arc::new(Semaphore::new(bounds.max_connections.max(1) as usize)),
                bounds,
                begin_sql,
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
    /// connection (`PoolTimedOut`, which the store maps to "unavailable"); each step on a connection (ping,
    /// `BEGIN`) is bounded by `step_timeout`, and a reused connection that does not answer within it is
    /// dropped and replaced (nothing ran on it yet).
    pub(crate) async fn begin(&self) -> Result<TxConnection, sqlx::Error> {
        self.take(true).await
    }

    /// A connection without a transaction (a single read). It goes back to the pool only through
    /// [`TxConnection::release`], once the read completed: dropped before that (the request was cancelled
    /// mid-read, the read failed or hung), it is closed, since its socket may be mid-message or black-holed.
    pub(crate) async fn plain(&self) -> Result<TxConnection, sqlx::Error> {
        self.take(false).await
    }

    /// Closes the resting connections: one step just hung on a connection, and the others most likely went
    /// the same way (a failover that black-holes the old path), so each need not cost its own step bound.
    pub(crate) fn discard_idle(&self) {
        for idle in self.inner.drain_idle() {
            close_bounded(idle.conn, self.inner.bounds.step_timeout);
        }
    }

    /// The bound of one step on a connection (`DATABASE_STEP_TIMEOUT`).
    pub(crate) fn step_timeout(&self) -> Duration {
        self.inner.bounds.step_timeout
    }

    async fn take(&self, begin: bool) -> Result<TxConnection, sqlx::Error> {
        let bounds = self.inner.bounds;
        let deadline = Instant::now() + bounds.acquire_timeout;
        let permit = tokio::time::timeout_at(deadline, self.inner.permits.clone().acquire_owned())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        let step = |now: Instant| (now + bounds.step_timeout).min(deadline);
        loop {
            let (mut conn, opened, reused) = match self.inner.take_idle() {
                Some(Idle { conn, opened, .. }) if opened.at.elapsed() > bounds.max_lifetime => {
                    close_bounded(conn, bounds.step_timeout); // lived long enough (server-side caches grow)
                    continue;
                }
                Some(Idle { conn, opened, .. }) if opened.generation != self.inner.servers.generation() => {
                    close_bounded(conn, bounds.step_timeout); // to a server the URL's others replaced
                    continue;
                }
                Some(Idle { mut conn, opened, returned }) => {
                    if returned.elapsed() > bounds.ping_after_idle
                        && !matches!(tokio::time::timeout_at(step(Instant::now()), conn.ping()).await, Ok(Ok(())))
                    {
                        // died while idle, or black-holed: the other resting connections most likely went
                        // the same way (a server restart, a failover), so they are closed too rather than
                        // each costing its own step bound; the next attempt connects anew
                        for idle in self.inner.drain_idle() {
                            close_bounded(idle.conn, bounds.step_timeout);
                        }
                        continue;
                    }
                    (conn, opened, true)
                }
                None => {
                    let connect = self.inner.servers.connect();
                    let (conn, generation) =
                        tokio::time::timeout_at(deadline, connect).await.map_err(|_| sqlx::Error::PoolTimedOut)??;
                    (conn, Opened { at: Instant::now(), generation }, false)
                }
            };
            let statement = self.inner.begin_sql.as_ref().map(|sql| std::borrow::Cow::Owned(sql.to_string()));
            let begun = async { if begin { Manager::begin(&mut conn, statement).await } else { Ok(()) } };
            match tokio::time::timeout_at(step(Instant::now()), begun).await {
                Ok(Ok(())) => {
                    return Ok(TxConnection {
                        conn: Some(conn),
                        opened,
                        inner: self.inner.clone(),
                        permit: Some(permit),
                        released: false,
                    });
                }
                // nothing ran: a reused connection that fails or hangs here (it died while idle, or the
                // path to the server black-holes) is replaced
                Ok(Err(_)) | Err(_) if reused && Instant::now() < deadline => continue,
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(sqlx::Error::PoolTimedOut),
            }
        }
    }
}

/// Closes `conn` in the background, giving up (dropping the socket) after `bound`.
fn close_bounded(conn: PgConnection, bound: Duration) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let _ = tokio::time::timeout(bound, conn.close()).await;
        });
    }
}

impl Inner {
    fn take_idle(&self) -> Option<Idle> {
        self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).pop()
    }

    fn drain_idle(&self) -> Vec<Idle> {
        std::mem::take(&mut *self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    fn put(&self, conn: PgConnection, opened: Opened) {
        if !self.permits.is_closed() {
            let idle = Idle { conn, opened, returned: Instant::now() };
            self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(idle);
        }
    }
}

/// A pooled connection with an open transaction (see the module docs for how it goes back).
pub(crate) struct TxConnection {
    conn: Option<PgConnection>,
    opened: Opened,
    inner: Arc<Inner>,
    /// Released after the connection is back in the pool (or closed).
    permit: Option<OwnedSemaphorePermit>,
    /// A plain connection's read completed ([`TxConnection::release`]): it may be reused.
    released: bool,
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

    /// Returns a plain connection whose operation completed to the pool.
    pub(crate) fn release(mut self) {
        self.released = true;
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
            if self.released {
                self.inner.put(conn, self.opened);
            } else {
                // an operation outside a transaction that did not complete (cancelled by the request's
                // timeout, failed, hung on a black-holed path): its socket may be mid-message or dead, and
                // a connection returned moments ago is handed out again unpinged, so it is never reused
                close_bounded(conn, self.inner.bounds.step_timeout);
            }
            return;
        }
        // Dropped with its transaction open: roll back before the connection can be taken again. A
        // rollback that does not answer within the step bound (a black-holed connection) ends it: the
        // connection is dropped (the server rolls back when it notices) and its slot freed.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return }; // closed: the server rolls back
        let (inner, permit, opened) = (self.inner.clone(), self.permit.take(), self.opened);
        runtime.spawn(async move {
            let bound = inner.bounds.step_timeout;
            let rolled_back = tokio::time::timeout(bound, async {
                while Manager::get_transaction_depth(&conn) > 0 {
                    Manager::rollback(&mut conn).await?;
                }
                Ok::<_, sqlx::Error>(())
            })
            .await;
            if matches!(rolled_back, Ok(Ok(()))) {
                inner.put(conn, opened);
            }
            drop(permit);
        });
    }
}

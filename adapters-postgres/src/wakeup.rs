//! Waking outbox relays without serializing commits.
//!
//! A `NOTIFY` inside a business transaction takes a database-wide lock from pre-commit until the commit
//! record is flushed: on a disk whose flush takes milliseconds every such transaction commits alone and
//! group commit is lost. So nothing notifies inside business transactions. Instead:
//!
//! - **In process:** [`PgUnitOfWork`](crate::PgUnitOfWork) remembers that it wrote outbox rows and, after
//!   its commit succeeded, bumps the store's [`OutboxSignal`]; a relay in the same process wakes at once.
//! - **Across instances:** the same bump asks a background task to send one `NOTIFY outbox_message` in its
//!   own transaction, at most once per [`NOTIFY_DEBOUNCE`] whatever the commit rate. Only those small
//!   transactions contend for the notify lock. The payload is the sending instance's id, so a relay ignores
//!   its own process's notifications (it was already woken in process).
//! - **Fallback:** relays also poll every `poll_interval`, so a lost notification only delays a row.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use idem_ports::{OutboxWakeup, StoreError};
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, watch};

use crate::error::map_sqlx_error;

/// Channel of the cross-instance wake-up.
pub const OUTBOX_CHANNEL: &str = "outbox_message";

/// Shortest interval between two cross-instance notifications of one process: at most 40 small
/// transactions a second whatever the commit rate (at 10 ms they were 0.08 transactions per charge).
pub const NOTIFY_DEBOUNCE: Duration = Duration::from_millis(25);

/// Announces committed outbox rows to relays (see the module docs). Cheap to clone.
#[derive(Debug, Clone)]
pub struct OutboxSignal {
    inner: Arc<SignalInner>,
}

#[derive(Debug)]
struct SignalInner {
    local: watch::Sender<u64>,
    remote: Arc<Notify>,
    notifier: OnceLock<()>,
    instance: String,
    pool: PgPool,
    /// Behind a transaction pooler, the statement a transaction begins with.
    begin_sql: Option<Arc<str>>,
}

impl OutboxSignal {
    pub(crate) fn new(pool: PgPool, begin_sql: Option<Arc<str>>) -> Self {
        let (local, _) = watch::channel(0);
        #[allow(clippy::disallowed_methods)] // an instance id, not a domain id
        let instance = uuid::Uuid::new_v4().to_string();
        Self {
            inner: Arc::new(SignalInner {
                local,
                remote: Arc::new(Notify::new()),
                notifier: OnceLock::new(),
                instance,
                pool,
                begin_sql,
            }),
        }
    }

    /// Called after a transaction that wrote outbox rows committed.
    pub fn committed(&self) {
        self.inner.local.send_modify(|v| *v = v.wrapping_add(1));
        self.inner.notifier.get_or_init(|| self.spawn_notifier());
        self.inner.remote.notify_one();
    }

    fn spawn_notifier(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (remote, pool, instance, begin_sql) = (
            self.inner.remote.clone(),
            self.inner.pool.clone(),
            self.inner.instance.clone(),
            self.inner.begin_sql.clone(),
        );
        runtime.spawn(async move {
            loop {
                remote.notified().await;
                if pool.is_closed() {
                    return;
                }
                // in a transaction of its own: behind a transaction pooler, the statement's two round trips
                // must reach one server connection
                let notify = async {
                    let mut tx = match &begin_sql {
                        Some(sql) => pool.begin_with(sql.to_string()).await?,
                        None => pool.begin().await?,
                    };
                    sqlx::query("SELECT pg_notify($1, $2)")
                        .bind(OUTBOX_CHANNEL)
                        .bind(&instance)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await
                };
                if let Err(e) = notify.await {
                    tracing::debug!(error = %e, "outbox NOTIFY failed; relays of other instances will poll");
                }
                tokio::time::sleep(NOTIFY_DEBOUNCE).await;
            }
        });
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.local.subscribe()
    }
}

/// Waits for an in-process commit signal or another instance's `NOTIFY`, with the caller's timeout as the
/// polling fallback.
pub struct PgOutboxWakeup {
    listener: Option<PgListener>,
    local: watch::Receiver<u64>,
    instance: String,
    /// What the listener's pool follows: asked to find the current server when LISTEN fails.
    servers: Option<crate::servers::Servers>,
}

impl std::fmt::Debug for PgOutboxWakeup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PgOutboxWakeup")
    }
}

impl PgOutboxWakeup {
    /// Listens on the outbox channel (a dedicated connection) and shares `store`'s in-process signal.
    ///
    /// Behind a transaction pooler, LISTEN goes over the store's direct connection; without one, there
    /// is no listener: the relay is woken by its own process's commits and polls for other instances'.
    pub async fn connect(store: &crate::PgStore) -> Result<Self, StoreError> {
        let servers = store.listen_servers();
        let listener = match &servers {
            Some(servers) => {
                // the listener reconnects through this pool, which follows the URL's servers: after a
                // failover it reaches the new primary, never the old one again
                let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_lazy_with(servers.current());
                servers.follow(&pool);
                let mut listener = PgListener::connect_with(&pool).await.map_err(map_sqlx_error)?;
                listener.listen(OUTBOX_CHANNEL).await.map_err(map_sqlx_error)?;
                Some(listener)
            }
            None => {
                tracing::info!("no LISTEN behind a transaction pooler without DATABASE_DIRECT_URL: relays poll");
                None
            }
        };
        let signal = store.outbox_signal();
        let mut local = signal.subscribe();
        local.mark_unchanged();
        Ok(Self { listener, local, instance: signal.inner.instance.clone(), servers })
    }
}

#[async_trait]
impl OutboxWakeup for PgOutboxWakeup {
    async fn wait(&mut self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return,
                changed = self.local.changed() => {
                    if changed.is_err() {
                        tokio::time::sleep_until(deadline).await;
                    }
                    return;
                }
                n = async {
                    match self.listener.as_mut() {
                        Some(listener) => listener.try_recv().await,
                        None => std::future::pending().await,
                    }
                } => match n {
                    // This process's own notification: its relay was already woken in process.
                    Ok(Some(n)) if n.payload() == self.instance => continue,
                    Ok(Some(_)) => {
                        // Drain what else arrived meanwhile: one claim serves them all.
                        while self.listener.as_mut().and_then(PgListener::next_buffered).is_some() {}
                        return;
                    }
                    Ok(None) => return, // connection lost and re-established: poll now
                    Err(e) => {
                        tracing::warn!(error = %e, "outbox LISTEN failed; polling");
                        // a server that went away or became a standby: find the URL's current one, so the
                        // listener's next connection goes there
                        if let Some(servers) = &self.servers {
                            let _ = tokio::time::timeout_at(deadline, servers.resolve()).await;
                        }
                        tokio::time::sleep_until(deadline).await;
                        return;
                    }
                },
            }
        }
    }
}

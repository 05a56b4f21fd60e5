//! LISTEN/NOTIFY wake-up of outbox relays.

use std::time::Duration;

use async_trait::async_trait;
use idem_ports::{OutboxWakeup, StoreError};
use sqlx::postgres::PgListener;

use crate::error::map_sqlx_error;

/// Channel notified by the `outbox_message_notify` trigger.
pub const OUTBOX_CHANNEL: &str = "outbox_message";

/// Waits on `LISTEN outbox_message`, with the caller's timeout as the polling fallback.
pub struct PgOutboxWakeup {
    listener: PgListener,
}

impl std::fmt::Debug for PgOutboxWakeup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PgOutboxWakeup")
    }
}

impl PgOutboxWakeup {
    pub async fn connect(pool: &sqlx::PgPool) -> Result<Self, StoreError> {
        let mut listener = PgListener::connect_with(pool).await.map_err(map_sqlx_error)?;
        listener.listen(OUTBOX_CHANNEL).await.map_err(map_sqlx_error)?;
        Ok(Self { listener })
    }
}

#[async_trait]
impl OutboxWakeup for PgOutboxWakeup {
    async fn wait(&mut self, timeout: Duration) {
        match tokio::time::timeout(timeout, self.listener.try_recv()).await {
            Ok(Ok(Some(_))) | Err(_) => {
                // Drain what else arrived meanwhile: one claim serves them all.
                while self.listener.next_buffered().is_some() {}
            }
            Ok(Ok(None)) => {} // connection lost and re-established: poll now
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "outbox LISTEN failed; polling");
                tokio::time::sleep(timeout).await;
            }
        }
    }
}

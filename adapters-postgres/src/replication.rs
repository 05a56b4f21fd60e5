//! Confirming that what idem answers from is on the synchronous standbys (issue 34.4).
//!
//! PostgreSQL makes a commit visible before its synchronous standby confirmed it when the wait is cut
//! short — a cancel (`pg_cancel_backend`), a terminated session, a dropped client that
//! `client_connection_check_interval` notices: "The transaction has already committed locally, but might
//! not have been replicated to the standby." idem never cancels a commit's wait itself (a request that
//! gives up drops its connection; the backend goes on waiting), but a record visible on the primary can
//! still be one no standby has, and a replay answered from it is a success the next failover takes back.
//! So before answering from a record it read — a replay, a duplicate event — idem commits a write of its
//! own, which waits for the standby: its WAL comes after the record's, so once the standby has it, it has
//! the record. PostgreSQL waits only for a transaction that wrote WAL (a transaction id alone is not
//! enough), so the barrier touches a row of `idem_replication_barrier` (one of 64, in turn). It writes only
//! when `synchronous_standby_names` is set; without one, no commit waits for a standby and there is nothing
//! to confirm, and that answer is remembered for a second so replays on a single server cost no write.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// One statement, `$1` the slot: a row when a synchronous standby is configured (the transaction then
/// wrote WAL and its commit waits for the standby), none when none is.
pub(crate) const BARRIER: &str = "UPDATE idem_replication_barrier SET touched_at = now() \
     WHERE slot = $1 AND current_setting('synchronous_standby_names') <> '' RETURNING true";

/// Rows of `idem_replication_barrier`.
const SLOTS: u64 = 64;

/// How long "no synchronous standby" is believed without asking again.
const NO_STANDBY_MEMO: Duration = Duration::from_secs(1);

/// Until when the server was last seen without a synchronous standby, and the next slot. Shared by a
/// store's clones.
#[derive(Debug, Clone, Default)]
pub(crate) struct Memo(Arc<Mutex<Option<Instant>>>, Arc<AtomicU64>);

impl Memo {
    /// The barrier row to touch next: in turn, so concurrent barriers rarely meet on one row.
    pub(crate) fn slot(&self) -> i16 {
        i16::try_from(self.1.fetch_add(1, Ordering::Relaxed) % SLOTS).unwrap_or(0)
    }

    /// Whether the barrier can be skipped: the server had no synchronous standby a moment ago.
    pub(crate) fn no_standby(&self) -> bool {
        self.0.lock().ok().and_then(|until| *until).is_some_and(|until| Instant::now() < until)
    }

    /// What the barrier found.
    pub(crate) fn found(&self, standby: bool) {
        if let Ok(mut until) = self.0.lock() {
            *until = (!standby).then(|| Instant::now() + NO_STANDBY_MEMO);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn no_standby_is_believed_for_a_second_and_a_standby_at_once() {
        let memo = Memo::default();
        assert!(!memo.no_standby(), "nothing known: ask");
        memo.found(false);
        assert!(memo.no_standby());
        tokio::time::advance(NO_STANDBY_MEMO + Duration::from_millis(1)).await;
        assert!(!memo.no_standby(), "asked again after the memo ends");
        memo.found(false);
        memo.found(true);
        assert!(!memo.no_standby(), "a standby seen: every answer is confirmed");
    }

    #[test]
    fn slots_go_round_all_rows() {
        let memo = Memo::default();
        let slots: std::collections::BTreeSet<i16> = (0..SLOTS).map(|_| memo.slot()).collect();
        assert_eq!(slots, (0..64).collect(), "every row of the migration, each once per round");
        assert_eq!(memo.slot(), 0);
    }
}

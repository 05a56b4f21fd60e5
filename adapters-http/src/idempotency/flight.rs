//! What one process knows of its own requests: duplicates of a key it is executing wait in memory,
//! holding no connection ([`InFlight`]), and the share of recent replays turns the replay fast path on.

#[allow(clippy::wildcard_imports)]
use super::*;

/// The share of recent keyed requests that were replays, in millionths (an exponentially weighted
/// average with weight 1/64 per request; lock-free, races only blur it).
#[derive(Default)]
pub(super) struct ReplayShare(std::sync::atomic::AtomicU32);

impl ReplayShare {
    const ONE: u32 = 1_000_000;

    pub(super) fn record(&self, replayed: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let old = self.0.load(Relaxed);
        let target = if replayed { Self::ONE } else { 0 };
        let new = i64::from(old) + (i64::from(target) - i64::from(old)) / 64;
        self.0.store(u32::try_from(new.clamp(0, i64::from(Self::ONE))).unwrap_or(0), Relaxed);
    }

    pub(super) fn storm(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) > Self::ONE / 10
    }
}

/// The (scope, key) pairs this process is executing right now. A duplicate of one of them waits here,
/// holding no database connection, until the first request ends; only then does it claim in the database
/// (which stays the authority across instances) and replays. Without this, every waiting duplicate would
/// hold a pooled connection blocked on the claim row for up to `wait`.
#[derive(Default)]
pub(super) struct InFlight(std::sync::Mutex<HashMap<(String, String), DoneSignal>>);

/// Flips to `true` when the leading request of a key ends.
pub(super) type DoneSignal = Arc<watch::Sender<bool>>;

/// Held while this process executes a key; dropping it (the request ended, or was cancelled) lets the
/// waiting duplicates go.
pub(super) struct Leader {
    in_flight: Arc<InFlight>,
    slot: (String, String),
    done: DoneSignal,
}

impl Drop for Leader {
    fn drop(&mut self) {
        let mut map = self.in_flight.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.get(&self.slot).is_some_and(|s| Arc::ptr_eq(s, &self.done)) {
            map.remove(&self.slot);
        }
        drop(map);
        self.done.send_replace(true);
    }
}

impl InFlight {
    /// Becomes the leader of `slot`, waiting (up to `deadline`) while another request of this process
    /// leads it; with whether it waited. `None` when the deadline passed first.
    pub(super) async fn lead(
        self: &Arc<Self>,
        slot: (String, String),
        deadline: tokio::time::Instant,
    ) -> Option<(Leader, bool)> {
        let mut waited = false;
        loop {
            let mut running = {
                let mut map = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                match map.get(&slot) {
                    Some(other) => other.subscribe(),
                    None => {
                        let done = Arc::new(watch::channel(false).0);
                        map.insert(slot.clone(), done.clone());
                        return Some((Leader { in_flight: self.clone(), slot, done }, waited));
                    }
                }
            };
            waited = true;
            match tokio::time::timeout_at(deadline, running.wait_for(|done| *done)).await {
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ReplayShare;

    #[test]
    fn a_retry_storm_turns_the_fast_path_on_and_ordinary_traffic_off() {
        let share = ReplayShare::default();
        for _ in 0..1000 {
            share.record(false);
        }
        assert!(!share.storm(), "first executions alone");
        for _ in 0..20 {
            share.record(true);
        }
        assert!(share.storm(), "twenty replays in a row are a storm");
        for i in 0..1000 {
            share.record(i % 50 == 0); // 2 % replays: ordinary retries
        }
        assert!(!share.storm(), "a few retries among first executions");
    }
}

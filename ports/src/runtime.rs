use chrono::{DateTime, Utc};
use uuid::Uuid;

/// The source of time. The domain never reads the wall clock itself.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait Clock: Send + Sync {
    /// The current time.
    fn now(&self) -> DateTime<Utc>;
}

/// The source of new identifiers: UUID v7 (time-ordered, so b-tree inserts stay on the right edge and the
/// creation time can be read back from the id).
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait IdGenerator: Send + Sync {
    /// A new UUID v7.
    fn new_id(&self) -> Uuid;
}

/// [`Clock`] reading the system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)] // the one place the wall clock is read
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// [`IdGenerator`] producing UUID v7 values.
#[derive(Debug, Clone, Copy, Default)]
pub struct UuidV7Generator;

impl IdGenerator for UuidV7Generator {
    #[allow(clippy::disallowed_methods)] // the one place ids are generated
    fn new_id(&self) -> Uuid {
        Uuid::now_v7()
    }
}

/// Exponential backoff with jitter: the one retry schedule of the service's loops (consumer, relay, topic
/// creation) and of the HTTP client. Each delay doubles from `first` up to `max`; the delay given is drawn
/// uniformly from its upper half, so retries of many clients spread out.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: std::time::Duration,
    max: std::time::Duration,
    failures: u32,
}

impl Backoff {
    /// A schedule starting at `first`, doubling up to `max`.
    pub fn new(first: std::time::Duration, max: std::time::Duration) -> Self {
        Self { first, max, failures: 0 }
    }

    /// The delay before the next attempt, counting one more failure.
    pub fn next_delay(&mut self) -> std::time::Duration {
        let delay = self.nth(self.failures);
        self.failures = self.failures.saturating_add(1);
        delay
    }

    /// The delay after the `attempt`-th consecutive failure (0-based), with jitter; does not count.
    pub fn nth(&self, attempt: u32) -> std::time::Duration {
        let cap = self.first.saturating_mul(1u32 << attempt.min(20)).min(self.max);
        let ms = u64::try_from(cap.as_millis()).unwrap_or(u64::MAX).max(1);
        std::time::Duration::from_millis(rand::random_range(ms.div_ceil(2)..=ms))
    }

    /// After a success: the next failure waits `first` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// Consecutive failures counted so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn backoff_doubles_up_to_its_cap_with_jitter_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let delays: Vec<Duration> = (0..6).map(|_| b.next_delay()).collect();
        for (i, d) in delays.iter().enumerate() {
            let cap = Duration::from_millis(100 * (1 << i)).min(Duration::from_secs(1));
            assert!(*d <= cap && *d >= cap / 2, "attempt {i}: {d:?} outside [{:?}, {cap:?}]", cap / 2);
        }
        assert_eq!(b.failures(), 6);
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}

//! How many **new** idempotency keys a scope (a merchant) may store per second.
//!
//! Every executed request stores its answer for the retention (`IdempotencyConfig::ttl`), whether or not it
//! created anything: resending one charge under new keys creates no payment (the provider-id protection
//! answers "already charged") but stored 4,838 records (7.4 MB) in 5 s at concurrency 4 in the review, and
//! the per-merchant concurrency limit bounds parallelism, not volume. A token bucket per scope bounds it:
//! a request whose key is new and finds the bucket empty is refused `429` with `Retry-After`, before
//! anything runs or is stored; retries of known keys (replays, conflicts, in-flight answers) take no token.
//! Buckets are [governor]'s keyed GCRA limiter. A request recorded at commit takes its token before it
//! knows whether its key is new; one that turns out known gives it back ([`NewKeyQuota::give_back`]).

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

/// Scopes kept before idle buckets (full again) are dropped.
const SCOPES_KEPT: usize = 10_000;

/// New keys per second per scope, with a burst (see the module docs).
pub struct NewKeyQuota {
    limiter: DefaultKeyedRateLimiter<String>,
    /// Tokens given back per scope, and when the last was: taken before the bucket's while fresh (within
    /// one emission interval), never more than the burst.
    returned: std::sync::Mutex<std::collections::HashMap<String, (u32, std::time::Instant)>>,
    any_returned: std::sync::atomic::AtomicBool,
    per_second: NonZeroU32,
    burst: NonZeroU32,
}

impl std::fmt::Debug for NewKeyQuota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewKeyQuota").field("per_second", &self.per_second).field("burst", &self.burst).finish()
    }
}

impl NewKeyQuota {
    /// `per_second` new keys per scope on average, up to `burst` at once.
    pub fn new(per_second: NonZeroU32, burst: NonZeroU32) -> Self {
        let burst = burst.max(per_second);
        let limiter = RateLimiter::keyed(Quota::per_second(per_second).allow_burst(burst));
        Self { limiter, returned: Default::default(), any_returned: Default::default(), per_second, burst }
    }

    /// Takes one new key for `scope`; `Err` with how long until one is available.
    pub fn take(&self, scope: &str) -> Result<(), Duration> {
        if self.any_returned.load(std::sync::atomic::Ordering::Relaxed) {
            let mut returned = self.returned.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let fresh = match returned.get_mut(scope) {
                Some((n, at)) if at.elapsed() < self.interval() => {
                    *n -= 1;
                    Some(*n)
                }
                _ => None,
            };
            if fresh.is_none_or(|left| left == 0) {
                returned.remove(scope);
            }
            returned.retain(|_, (_, at)| at.elapsed() < self.interval());
            self.any_returned.store(!returned.is_empty(), std::sync::atomic::Ordering::Relaxed);
            if fresh.is_some() {
                return Ok(());
            }
        }
        if self.limiter.len() > SCOPES_KEPT {
            self.limiter.retain_recent();
        }
        self.limiter
            .check_key(&scope.to_owned())
            .map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now()))
    }

    /// Gives back a token [`take`](Self::take) gave for `scope` to a key that turned out known: the next
    /// new key of the scope takes it first, within one emission interval (`1 / per_second`). The bucket
    /// counts it spent meanwhile, so a token given back and not used soon expires: the quota is then
    /// stricter, never looser — at most the burst plus one new key in any interval.
    pub fn give_back(&self, scope: &str) {
        let mut returned = self.returned.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if returned.len() >= SCOPES_KEPT {
            returned.clear(); // bounded: a token forgotten only makes the quota stricter
        }
        let now = std::time::Instant::now();
        let entry = returned.entry(scope.to_owned()).or_insert((0, now));
        if entry.1.elapsed() >= self.interval() {
            entry.0 = 0;
        }
        *entry = ((entry.0 + 1).min(self.burst.get()), now);
        self.any_returned.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The time the bucket takes to gain one token.
    fn interval(&self) -> Duration {
        Duration::from_secs(1) / self.per_second.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_scope_has_its_own_burst_then_waits() {
        let n = |v| NonZeroU32::new(v).unwrap_or(NonZeroU32::MIN);
        let quota = NewKeyQuota::new(n(2), n(5));
        assert!((0..5).all(|_| quota.take("a").is_ok()), "the burst");
        let wait = quota.take("a").expect_err("the bucket is empty");
        assert!(wait > Duration::ZERO && wait <= Duration::from_millis(500), "{wait:?}");
        assert!(quota.take("b").is_ok(), "another scope is not limited by a's keys");
        quota.give_back("a");
        assert!(quota.take("a").is_ok(), "a token given back is taken again");
        assert!(quota.take("a").is_err(), "once");
    }

    /// A token given back and not used within one emission interval expires: the bucket counted it spent,
    /// and returned tokens kept for later would let a burst beyond the quota through.
    #[test]
    fn a_token_given_back_expires_and_never_exceeds_the_burst() {
        let n = |v| NonZeroU32::new(v).unwrap_or(NonZeroU32::MIN);
        let quota = NewKeyQuota::new(n(10), n(10)); // one token per 100 ms
        assert!((0..10).all(|_| quota.take("a").is_ok()), "the burst");
        for _ in 0..15 {
            quota.give_back("a");
        }
        assert!((0..10).all(|_| quota.take("a").is_ok()), "ten given back (the burst at most)");
        assert!(quota.take("a").is_err(), "not the fifteen");
        quota.give_back("a");
        std::thread::sleep(Duration::from_millis(150));
        assert!(quota.take("a").is_ok(), "the bucket's own refill");
        assert!(quota.take("a").is_err(), "the token given back 150 ms ago expired");
    }
}

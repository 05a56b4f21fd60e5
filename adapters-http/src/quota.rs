//! How many **new** idempotency keys a scope (a merchant) may store per second.
//!
//! Every executed request stores its answer for the retention (`IdempotencyConfig::ttl`), whether or not it
//! created anything: resending one charge under new keys creates no payment (the provider-id protection
//! answers "already charged") but stored 4,838 records (7.4 MB) in 5 s at concurrency 4 in the review, and
//! the per-merchant concurrency limit bounds parallelism, not volume. A token bucket per scope bounds it:
//! a request whose key is new and finds the bucket empty is refused `429` with `Retry-After`, before
//! anything runs or is stored; retries of known keys (replays, conflicts, in-flight answers) take no token.
//! Buckets are [governor]'s keyed GCRA limiter.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

/// Scopes kept before idle buckets (full again) are dropped.
const SCOPES_KEPT: usize = 10_000;

/// New keys per second per scope, with a burst (see the module docs).
pub struct NewKeyQuota {
    limiter: DefaultKeyedRateLimiter<String>,
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
        let limiter = RateLimiter::keyed(Quota::per_second(per_second).allow_burst(burst.max(per_second)));
        Self { limiter, per_second, burst }
    }

    /// Takes one new key for `scope`; `Err` with how long until one is available.
    pub fn take(&self, scope: &str) -> Result<(), Duration> {
        if self.limiter.len() > SCOPES_KEPT {
            self.limiter.retain_recent();
        }
        self.limiter
            .check_key(&scope.to_owned())
            .map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now()))
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
    }
}

//! Which failed events are retried, how long, and which are dead-lettered: the runner's retry policy.

use std::sync::Arc;
use std::time::Duration;

use idem_ports::HandlerError;

/// One failure of an event's handler (its transaction rolled back), as a [`RetryPolicy`] sees it. A
/// transient failure of the whole batch (the store unreachable) is not one: the batch is retried with
/// backoff until the store answers, whatever the policy.
#[derive(Debug)]
pub struct Failure<'a> {
    /// What the handler returned.
    pub error: &'a HandlerError,
    /// Failures of this event so far, this one included (1 at the first).
    pub attempts: u32,
    /// Time since its first failure (zero at the first).
    pub failing_for: Duration,
}

/// What happens to an event after a [`Failure`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Apply it again after the runner's backoff (50 ms doubling to 5 s); its partition waits.
    Retry,
    /// Apply it again after this long; its partition waits.
    RetryAfter(Duration),
    /// Publish it to the dead-letter topic with the error as its reason; the partition moves on.
    DeadLetter,
}

/// Decides, per failure, whether an event is retried (and when) or dead-lettered. The default
/// ([`RetryPolicy::rejections`] with `RunnerSettings::max_rejections`): a malformed event is dead-lettered at
/// once, any other failure is retried with backoff and dead-lettered after `max_rejections` retries.
///
/// ```
/// # use std::time::Duration;
/// use idem_kafka::consumer::{RetryPolicy, Verdict};
/// use idem_ports::HandlerError;
/// // a rejection whose rule may change soon (a limit an operator raises) is retried for ten minutes
/// let policy = RetryPolicy::new(|f| match f.error {
///     HandlerError::Rejected(why) if why.contains("limit") && f.failing_for < Duration::from_secs(600) => {
///         Verdict::RetryAfter(Duration::from_secs(30))
///     }
///     HandlerError::Store(_) if f.attempts <= 10 => Verdict::Retry,
///     _ => Verdict::DeadLetter,
/// });
/// # let _ = policy;
/// ```
#[derive(Clone)]
pub struct RetryPolicy(Arc<dyn Fn(&Failure<'_>) -> Verdict + Send + Sync>);

impl std::fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RetryPolicy")
    }
}

impl RetryPolicy {
    /// A policy of your own.
    pub fn new(decide: impl Fn(&Failure<'_>) -> Verdict + Send + Sync + 'static) -> Self {
        Self(Arc::new(decide))
    }

    /// The default: malformed events are dead-lettered at once; others are retried with backoff and
    /// dead-lettered at their failure after `max` retries.
    pub fn rejections(max: u32) -> Self {
        Self::new(move |f| match f.error {
            HandlerError::Malformed(_) => Verdict::DeadLetter,
            HandlerError::Rejected(_) | HandlerError::Store(_) if f.attempts > max => Verdict::DeadLetter,
            HandlerError::Rejected(_) | HandlerError::Store(_) => Verdict::Retry,
        })
    }

    /// The verdict on `failure`.
    pub fn decide(&self, failure: &Failure<'_>) -> Verdict {
        (self.0)(failure)
    }
}

#[cfg(test)]
mod tests {
    use idem_ports::StoreError;

    use super::*;

    fn verdict(policy: &RetryPolicy, error: &HandlerError, attempts: u32) -> Verdict {
        policy.decide(&Failure { error, attempts, failing_for: Duration::ZERO })
    }

    #[test]
    fn the_default_dead_letters_malformed_events_at_once_and_others_after_their_retries() {
        let policy = RetryPolicy::rejections(3);
        assert_eq!(verdict(&policy, &HandlerError::Malformed("x".into()), 1), Verdict::DeadLetter);
        let rejected = HandlerError::Rejected("rule".into());
        let failed = HandlerError::Store(StoreError::Other("constraint".into()));
        for error in [&rejected, &failed] {
            for attempts in 1..=3 {
                assert_eq!(verdict(&policy, error, attempts), Verdict::Retry, "{error} at {attempts}");
            }
            assert_eq!(verdict(&policy, error, 4), Verdict::DeadLetter, "{error}");
        }
    }
}

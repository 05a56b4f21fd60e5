//! Exactly once across a call to another system: phases, recovery points, leases with fencing.
//!
//! An effect at another system (a charge at a payment provider, an email, another service's API) cannot
//! join the database transaction that records it. So the work is cut in phases around the call:
//!
//! 1. **first phase** (one unit of work): claim the record, validate, write the intent (a `pending`
//!    payment) and a recovery point; the record is *in progress* under a [`Lease`] held by this attempt;
//! 2. **the call**, with no transaction open and no pooled connection held, under a [`downstream_key`]
//!    that is the same on every attempt, so the other side deduplicates a repeated call;
//! 3. **second phase** (one unit of work): record the foreign result, the business effect, the outbox row
//!    and the stored answer — committed only if this attempt still owns the record ([`may_complete`]: the
//!    attempt number is the fencing token).
//!
//! A retry or a takeover resumes at the recovery point, never from scratch: while the lease runs, a
//! duplicate is told the request is in flight ([`Claim::InFlight`]); once it lapsed (the process died, the
//! call hung past its bound), the next retry or the completer takes the record over with the next attempt
//! number ([`Claim::TakeOver`]), and the late original can neither complete (fenced out) nor call with
//! another key (the key does not depend on the attempt).
//!
//! These are the rules; `model/src/phases.rs` checks them exhaustively with crashes at every step, and the
//! stores and the layer apply them.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

/// How long an attempt owns an in-progress record without renewing it (`IDEMPOTENCY_LEASE`, 30 s by
/// default): long enough for a foreign call's bound, short enough that a crashed attempt's client or the
/// completer resumes soon.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// An attempt's hold on an in-progress record: its number (the fencing token; every takeover takes the
/// next one) and until when it holds without renewing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    /// 1 for the first attempt, one more for each takeover.
    pub attempt: u32,
    /// When it lapses unless renewed.
    pub until: DateTime<Utc>,
}

impl Lease {
    /// The first attempt's lease, from `now` for `length`.
    pub fn first(now: DateTime<Utc>, length: Duration) -> Self {
        Self { attempt: 1, until: now + chrono_duration(length) }
    }

    /// Whether it still holds at `now`.
    pub fn holds(&self, now: DateTime<Utc>) -> bool {
        now < self.until
    }

    /// The same attempt's lease renewed at `now` (while its call runs).
    pub fn renewed(self, now: DateTime<Utc>, length: Duration) -> Self {
        Self { attempt: self.attempt, until: now + chrono_duration(length) }
    }
}

fn chrono_duration(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::seconds(30))
}

/// Where an in-progress record is, as its store holds it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InProgress {
    /// The attempt holding it.
    pub lease: Lease,
    /// The last recovery point the record reached (the handler's own name: `intent-written`,
    /// `charge-called`, …): a resumed attempt starts there.
    pub recovery_point: String,
}

/// What an attempt may do with the record of its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// No record: this attempt claims it with the first lease and starts from the beginning.
    New(Lease),
    /// An attempt holds it: answer "in flight" and retry after the lease.
    InFlight {
        /// How long until the lease lapses (at least a second).
        retry_after: Duration,
    },
    /// The holder's lease lapsed: this attempt takes the record over with the next attempt number and
    /// resumes at the recovery point.
    TakeOver {
        /// The new lease.
        lease: Lease,
        /// Where to resume.
        resume_at: String,
    },
}

/// The claim of an attempt at `now` on a record in progress (`None`: no record yet). A record is taken
/// over only when its lease lapsed: taking over a live lease would put two calls in flight at once.
pub fn claim(existing: Option<&InProgress>, now: DateTime<Utc>, length: Duration) -> Claim {
    match existing {
        None => Claim::New(Lease::first(now, length)),
        Some(p) if p.lease.holds(now) => Claim::InFlight {
            retry_after: (p.lease.until - now).to_std().unwrap_or_default().max(Duration::from_secs(1)),
        },
        Some(p) => Claim::TakeOver {
            lease: Lease { attempt: p.lease.attempt + 1, until: now + chrono_duration(length) },
            resume_at: p.recovery_point.clone(),
        },
    }
}

/// Whether an attempt holding `mine` may commit its phase (the second one, a recovery point, a lease
/// renewal) on a record whose stored attempt is `stored`: only the current attempt may. A late original
/// whose record was taken over is fenced out: its phase commits nothing.
pub fn may_complete(stored: u32, mine: u32) -> bool {
    stored == mine
}

/// The idempotency key of a foreign call: derived from whose request it is (`scope` and `key`, or a
/// consumer and an `event_id`, or a `saga_id`) and the step's name, never from the attempt — so every
/// attempt, on every instance, after any restart, sends the same key for the same step, and two steps of
/// one request send different ones. 64 hexadecimal digits (a SHA-256), under the 255 characters every API
/// that takes such a key accepts.
pub fn downstream_key(scope: &str, key: &str, step: &str) -> String {
    let mut hash = Sha256::new();
    for part in [scope, key, step] {
        // length-prefixed, so ("ab", "c") and ("a", "bc") differ
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    hex::encode(hash.finalize())
}

/// The key a request's names derive from: its `key`, and for a claim that recorded one its `generation`
/// (the claim's time in microseconds) — so a key reused after its record expired names new intents and new
/// downstream calls. Keys are printable ASCII, so the `\0` separator cannot come from a client.
pub fn generational_key(key: &str, generation: Option<i64>) -> std::borrow::Cow<'_, str> {
    match generation {
        Some(g) => std::borrow::Cow::Owned(format!("{key}\0gen:{g}")),
        None => std::borrow::Cow::Borrowed(key),
    }
}

/// The id of an intent a request writes in its first phase (a `pending` payment), derived like
/// [`downstream_key`] from whose request it is and the intent's `name`: every attempt names the same row,
/// so a resumed attempt finds what an earlier one wrote. A UUID version 8 (custom) from the SHA-256.
pub fn intent_id(scope: &str, key: &str, name: &str) -> uuid::Uuid {
    let digest = downstream_key(scope, key, &format!("intent:{name}"));
    let mut bytes = [0u8; 16];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = u8::from_str_radix(&digest[2 * i..2 * i + 2], 16).unwrap_or_default();
    }
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// What a foreign call's answer means for the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallOutcome {
    /// It happened: the second phase records it.
    Succeeded,
    /// The other side refused for good (a declined card, a key reused with other parameters): a final
    /// answer, stored and replayed, never attempted again.
    Refused,
    /// The other side answered that nothing of this call is in process (its own `5xx`, `429` or "in
    /// progress", with its error body), or the connection was refused: the record stays at its recovery
    /// point and the call may be made again with the same key — not before the answer's `Retry-After`.
    Unknown,
    /// No answer (a timeout, a reset, a redirect never followed, a gateway's `502`/`503`/`504`): the call
    /// may still be in process, so the lease is kept until it lapses.
    NoAnswer,
    /// An answer that is not the other side's (an ingress's `404`, a `2xx` that is no charge) or that only
    /// an operator can fix (`401`/`403`: a wrong key): never stored as a refusal; held like
    /// [`CallOutcome::NoAnswer`], and an alert fires while it lasts.
    Unrecognised,
}

/// The outcome an HTTP answer of the other side means: its status (`None`: no answer — a timeout, a reset,
/// a refused connection) and whether its body is the other side's own (a charge for a `2xx`, its error
/// body otherwise). One table for every answer (ARCHITECTURE.md, "What the provider said"):
///
/// | answer | with the provider's body | without it |
/// | --- | --- | --- |
/// | `2xx` | succeeded | unrecognised |
/// | `3xx` (never followed) | no answer | no answer |
/// | `401`, `403` | unrecognised | unrecognised |
/// | `408`, `425` | no answer | no answer |
/// | `409`, `429` | unknown (nothing in process) | no answer |
/// | other `4xx` | refused | unrecognised |
/// | `5xx` | unknown (nothing in process) | no answer |
/// | none (timeout, reset) | no answer | no answer |
pub fn http_outcome(status: Option<u16>, providers_body: bool) -> CallOutcome {
    match (status, providers_body) {
        (Some(200..=299), true) => CallOutcome::Succeeded,
        (Some(200..=299), false) | (Some(401 | 403), _) => CallOutcome::Unrecognised,
        (Some(409 | 429), true) | (Some(500..=599), true) => CallOutcome::Unknown,
        (Some(408 | 425 | 409 | 429), _) | (Some(500..=599), false) => CallOutcome::NoAnswer,
        (Some(400..=499), true) => CallOutcome::Refused,
        (Some(400..=499), false) => CallOutcome::Unrecognised,
        (Some(_), _) | (None, _) => CallOutcome::NoAnswer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap_or_default()
    }

    #[test]
    fn a_live_lease_is_in_flight_and_a_lapsed_one_is_taken_over_with_the_next_attempt() {
        let lease = Duration::from_secs(30);
        let Claim::New(first) = claim(None, at(0), lease) else { panic!("a new record") };
        assert_eq!(first, Lease { attempt: 1, until: at(30) });
        let held = InProgress { lease: first, recovery_point: "intent-written".into() };
        assert_eq!(claim(Some(&held), at(10), lease), Claim::InFlight { retry_after: Duration::from_secs(20) });
        assert_eq!(claim(Some(&held), at(29), lease), Claim::InFlight { retry_after: Duration::from_secs(1) });
        assert_eq!(
            claim(Some(&held), at(30), lease),
            Claim::TakeOver { lease: Lease { attempt: 2, until: at(60) }, resume_at: "intent-written".into() }
        );
        assert!(may_complete(2, 2) && !may_complete(2, 1), "the late original is fenced out");
        assert_eq!(first.renewed(at(20), lease), Lease { attempt: 1, until: at(50) });
    }

    #[test]
    fn the_downstream_key_is_the_same_for_every_attempt_and_differs_by_step_and_request() {
        let k = downstream_key("merchant_a", "key-1", "charge");
        assert_eq!(k, downstream_key("merchant_a", "key-1", "charge"));
        assert_eq!(k.len(), 64);
        assert!(k.bytes().all(|b| b.is_ascii_hexdigit()), "{k}");
        for other in [
            downstream_key("merchant_a", "key-1", "refund"),
            downstream_key("merchant_b", "key-1", "charge"),
            downstream_key("merchant_a", "key-2", "charge"),
            downstream_key("merchant_", "akey-1", "charge"),
        ] {
            assert_ne!(k, other);
        }
        // pinned: a change of the derivation would make every retry across a deploy a new call
        assert_eq!(
            downstream_key("s", "k", "charge"),
            "d4ff8ba8714c9e0e3b8c0df59b60fa7d690093ab3351abffc3b69a995d4e29da"
        );
    }

    #[test]
    fn an_intent_id_is_the_same_for_every_attempt_and_differs_from_other_requests() {
        let id = intent_id("merchant_a", "key-1", "payment");
        assert_eq!(id, intent_id("merchant_a", "key-1", "payment"));
        assert_eq!(id.get_version_num(), 8);
        assert_ne!(id, intent_id("merchant_b", "key-1", "payment"));
        assert_ne!(id, intent_id("merchant_a", "key-1", "refund"));
    }

    #[test]
    fn answers_of_the_other_side_are_classified() {
        use CallOutcome::*;
        assert_eq!(http_outcome(Some(200), true), Succeeded);
        for refused in [400, 402, 404, 422] {
            assert_eq!(http_outcome(Some(refused), true), Refused, "{refused}");
            // issue 45: an ingress's 4xx without the provider's error body is never a refusal
            assert_eq!(http_outcome(Some(refused), false), Unrecognised, "{refused}");
        }
        for nothing_in_process in [409, 429, 500, 502, 503, 504] {
            assert_eq!(http_outcome(Some(nothing_in_process), true), Unknown, "{nothing_in_process}");
        }
        // issue 45: a gateway's 502/504 is no answer: the charge may still run behind it
        for no_answer in [None, Some(302), Some(307), Some(408), Some(409), Some(429), Some(500), Some(502), Some(504)]
        {
            assert_eq!(http_outcome(no_answer, false), NoAnswer, "{no_answer:?}");
        }
        for operators in [401, 403] {
            assert_eq!(http_outcome(Some(operators), true), Unrecognised);
            assert_eq!(http_outcome(Some(operators), false), Unrecognised);
        }
        assert_eq!(http_outcome(Some(200), false), Unrecognised, "a 2xx that is no charge");
    }
}

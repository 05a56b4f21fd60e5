//! Phases around a foreign call (a charge at a payment provider), with leases, fencing and takeovers: one
//! client key, two workers (the request's handler and a retry or the completer), crashes at every step,
//! lost responses, leases that lapse, and a provider that deduplicates by key.
//!
//! The rules come from the domain itself — [`phases::claim`] (new, in flight, takeover after a lapsed
//! lease), [`phases::may_complete`] (the attempt number fences a late original out) and
//! [`phases::downstream_key`] (the key of the call, the same on every attempt) — so a change to any of them
//! is model-checked here, not a copy of it.
//!
//! | action | implemented by |
//! | --- | --- |
//! | [`PhaseAction::Claim`] | the first phase: `phases::claim` on the record, the intent and the recovery point in one unit of work |
//! | [`PhaseAction::Call`] | the lease renewed by the attempt that holds it (`Lease::renewed`, fenced by `phases::may_complete`), then the call with the downstream key, no transaction open |
//! | [`PhaseAction::Answer`] | the provider processes a call: a new key charges once, a known key gets its first answer again, a key in process gets `409` (unknown) |
//! | [`PhaseAction::Complete`] | the second phase: committed only while `phases::may_complete` |
//! | [`PhaseAction::Crash`] | a worker dies (its call, if sent, still reaches the provider; its answer is lost) |
//! | [`PhaseAction::Lapse`] | time passes the lease of an attempt that stopped renewing it (a call's bound is shorter than the lease, so no call is in process then) |
//!
//! The provider here processes two calls with one key at once as two (it deduplicates only keys it has
//! already answered; Stripe's answers the second `409`): what keeps money safe here is that a takeover
//! waits for the lease, which outlives any call, and that an attempt renews its lease as its call starts,
//! so a late original is fenced out before it calls.
//!
//! Checked on idem's rules: [`AT_MOST_ONE_CHARGE`], [`ONE_COMPLETION`], [`ANSWER_IS_THE_PROVIDERS`], and
//! that every record reaches its final state. Each broken variant violates one.

use chrono::{DateTime, Utc};
use idem_domain::phases::{self, Claim, InProgress, Lease};
use stateright::{Model, Property};

/// The protocol checked, or a deliberately broken variant of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PhaseVariant {
    /// idem's rules.
    Idem,
    /// A fresh downstream key per attempt (the attempt number in the key).
    FreshKeyPerAttempt,
    /// The second phase commits without checking that the attempt still owns the record.
    NoFencing,
    /// A record is taken over while its lease still holds.
    TakeoverWithoutLapse,
}

/// The model's bounds.
#[derive(Clone, Debug)]
pub struct PhaseModel {
    /// The protocol or a broken variant.
    pub variant: PhaseVariant,
    /// Crashes in all.
    pub crashes: u8,
    /// Most attempts (takeovers included) on the record.
    pub attempts: u32,
}

/// A worker (a request's handler, a client's retry on another instance, the completer).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Worker {
    /// Not working on the key (and free to try it).
    Idle,
    /// Holds `attempt` after the first phase.
    Claimed(u32),
    /// Its call with `key` is at the provider.
    Calling(u32, String),
    /// The provider answered: a charge id (`None`: the outcome is unknown — kept for the layer's own
    /// paths; this provider always answers).
    Answered(u32, Option<u8>),
    /// Answered its client (completed, replayed, or fenced out); does nothing more.
    Done,
}

/// The record of the client key, as the store holds it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Record {
    /// Not claimed yet.
    Absent,
    /// Between the phases.
    InProgress(InProgress),
    /// The second phase committed: the stored answer (the provider's charge id).
    Completed(u8),
}

/// The state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PhaseState {
    /// The store's clock, seconds from the start.
    pub now: i64,
    /// The record.
    pub record: Record,
    /// The two workers.
    pub workers: [Worker; 2],
    /// Calls at the provider not processed yet: the key, the worker waiting (`None`: it crashed), and
    /// whether another call with the key was in process when it arrived.
    pub pending: Vec<(String, Option<usize>, bool)>,
    /// The provider's answers by key (a charge id each).
    pub answered: Vec<(String, u8)>,
    /// Charges the provider made.
    pub charges: u8,
    /// Second phases committed.
    pub completions: u8,
    /// Crashes left.
    pub crashes: u8,
}

/// The steps.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PhaseAction {
    /// A worker's first phase (or its resumption).
    Claim(usize),
    /// A worker calls the provider.
    Call(usize),
    /// The provider processes the pending call at this index.
    Answer(usize),
    /// A worker's second phase.
    Complete(usize),
    /// A worker crashes.
    Crash(usize),
    /// Every live lease lapses.
    Lapse,
}

const LEASE: std::time::Duration = phases::DEFAULT_LEASE;

fn at(t: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + t, 0).unwrap_or_default()
}

impl PhaseModel {
    /// Two crashes, four attempts.
    pub fn standard(variant: PhaseVariant) -> Self {
        Self { variant, crashes: 2, attempts: 4 }
    }

    fn key(&self, attempt: u32) -> String {
        match self.variant {
            PhaseVariant::FreshKeyPerAttempt => phases::downstream_key("m", "k", &format!("charge#{attempt}")),
            _ => phases::downstream_key("m", "k", "charge"),
        }
    }

    /// The first phase of `w` at `now`: the record's new state and the worker's, if it may proceed.
    fn claim(&self, s: &PhaseState) -> Option<(Record, Worker)> {
        let now = at(s.now);
        match &s.record {
            Record::Completed(_) => Some((s.record.clone(), Worker::Done)), // replayed
            Record::Absent => match phases::claim(None, now, LEASE) {
                Claim::New(lease) => Some((self.in_progress(lease), Worker::Claimed(lease.attempt))),
                _ => None,
            },
            Record::InProgress(p) => {
                let claim = match (self.variant, phases::claim(Some(p), now, LEASE)) {
                    (PhaseVariant::TakeoverWithoutLapse, Claim::InFlight { .. }) => Claim::TakeOver {
                        lease: Lease { attempt: p.lease.attempt + 1, until: p.lease.until },
                        resume_at: p.recovery_point.clone(),
                    },
                    (_, claim) => claim,
                };
                match claim {
                    Claim::TakeOver { lease, .. } if lease.attempt <= self.attempts => {
                        Some((self.in_progress(lease), Worker::Claimed(lease.attempt)))
                    }
                    _ => None, // in flight: the client is told to retry later
                }
            }
        }
    }

    fn in_progress(&self, lease: Lease) -> Record {
        Record::InProgress(InProgress { lease, recovery_point: "intent-written".into() })
    }
}

impl Model for PhaseModel {
    type State = PhaseState;
    type Action = PhaseAction;

    fn init_states(&self) -> Vec<PhaseState> {
        vec![PhaseState {
            now: 0,
            record: Record::Absent,
            workers: [Worker::Idle, Worker::Idle],
            pending: Vec::new(),
            answered: Vec::new(),
            charges: 0,
            completions: 0,
            crashes: self.crashes,
        }]
    }

    fn actions(&self, s: &PhaseState, actions: &mut Vec<PhaseAction>) {
        for (w, worker) in s.workers.iter().enumerate() {
            match worker {
                Worker::Idle if self.claim(s).is_some() => actions.push(PhaseAction::Claim(w)),
                Worker::Claimed(_) => actions.push(PhaseAction::Call(w)),
                Worker::Answered(..) => actions.push(PhaseAction::Complete(w)),
                _ => {}
            }
            if s.crashes > 0 && !matches!(worker, Worker::Idle | Worker::Done) {
                actions.push(PhaseAction::Crash(w));
            }
        }
        actions.extend((0..s.pending.len()).map(PhaseAction::Answer));
        // a lease lapses only when its holder stopped renewing it (it crashed or stalled outside a call) and
        // no call is in process: the holder renews while its call runs, and a call's bound is shorter than
        // the lease
        let calling = s.workers.iter().any(|w| matches!(w, Worker::Calling(..)));
        if s.pending.is_empty() && !calling && matches!(&s.record, Record::InProgress(p) if p.lease.holds(at(s.now))) {
            actions.push(PhaseAction::Lapse);
        }
    }

    fn next_state(&self, last: &PhaseState, action: PhaseAction) -> Option<PhaseState> {
        let mut s = last.clone();
        match action {
            PhaseAction::Claim(w) => {
                let (record, worker) = self.claim(&s)?;
                s.record = record;
                s.workers[w] = worker;
            }
            PhaseAction::Call(w) => {
                let Worker::Claimed(attempt) = s.workers[w] else { return None };
                // the lease is renewed as the call starts, by the attempt that holds it: a late original
                // whose record was taken over is fenced out before it calls
                let now = at(s.now);
                match &mut s.record {
                    Record::InProgress(p) if phases::may_complete(p.lease.attempt, attempt) => {
                        p.lease = p.lease.renewed(now, LEASE);
                    }
                    _ => {
                        s.workers[w] = Worker::Done;
                        return Some(s);
                    }
                }
                let key = self.key(attempt);
                let concurrent = s.pending.iter().any(|(k, ..)| *k == key);
                s.pending.push((key.clone(), Some(w), concurrent));
                s.workers[w] = Worker::Calling(attempt, key);
            }
            PhaseAction::Answer(i) => {
                let (key, waiting, concurrent) = s.pending.remove(i);
                let answer = match s.answered.iter().find(|(k, _)| *k == key) {
                    // a key it answered before this call arrived: its first answer again
                    Some((_, charge)) if !concurrent => *charge,
                    // a new key, or two calls with one key in process at once: each charges
                    _ => {
                        s.charges += 1;
                        if !s.answered.iter().any(|(k, _)| *k == key) {
                            s.answered.push((key.clone(), s.charges));
                        }
                        s.charges
                    }
                };
                if let Some(w) = waiting
                    && let Worker::Calling(attempt, k) = &s.workers[w]
                    && *k == key
                {
                    s.workers[w] = Worker::Answered(*attempt, Some(answer));
                }
            }
            PhaseAction::Complete(w) => {
                let Worker::Answered(attempt, answer) = s.workers[w] else { return None };
                let owns = match &s.record {
                    Record::InProgress(p) => {
                        self.variant == PhaseVariant::NoFencing || phases::may_complete(p.lease.attempt, attempt)
                    }
                    Record::Completed(_) => self.variant == PhaseVariant::NoFencing,
                    Record::Absent => false,
                };
                match (owns, answer) {
                    (true, Some(charge)) => {
                        s.record = Record::Completed(charge);
                        s.completions += 1;
                        s.workers[w] = Worker::Done;
                    }
                    // outcome unknown: the record stays at its recovery point; the client retries
                    (true, None) => s.workers[w] = Worker::Idle,
                    // fenced out: the client is told the outcome is unknown, its retry replays
                    (false, _) => s.workers[w] = Worker::Done,
                }
            }
            PhaseAction::Crash(w) => {
                s.crashes -= 1;
                s.workers[w] = Worker::Idle;
                for (_, waiting, _) in &mut s.pending {
                    if *waiting == Some(w) {
                        *waiting = None; // its call still reaches the provider; the answer is lost
                    }
                }
            }
            PhaseAction::Lapse => {
                let Record::InProgress(p) = &s.record else { return None };
                s.now = (p.lease.until - at(0)).num_seconds();
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(AT_MOST_ONE_CHARGE, |_, s: &PhaseState| s.charges <= 1),
            Property::always(ONE_COMPLETION, |_, s: &PhaseState| s.completions <= 1),
            Property::always(ANSWER_IS_THE_PROVIDERS, |_, s: &PhaseState| match s.record {
                Record::Completed(charge) => s.answered.first().is_some_and(|(_, first)| *first == charge),
                _ => true,
            }),
            Property::eventually(FINAL_STATE, |_, s: &PhaseState| matches!(s.record, Record::Completed(_))),
            Property::sometimes("a takeover completes after a crash", |_, s: &PhaseState| {
                matches!(&s.record, Record::Completed(_)) && s.crashes == 0 && s.charges == 1
            }),
            Property::sometimes("a late original is fenced out", |_, s: &PhaseState| {
                s.completions == 1 && s.workers.iter().all(|w| *w == Worker::Done) && s.now > 0
            }),
        ]
    }
}

/// The provider charges at most once for the client key, whatever crashes, lapses and takeovers happen.
pub const AT_MOST_ONE_CHARGE: &str = "at most one provider charge per client key";
/// The second phase (the business effect, the outbox row, the stored answer) commits at most once.
pub const ONE_COMPLETION: &str = "the second phase commits at most once";
/// The stored answer is the provider's answer to the key's charge.
pub const ANSWER_IS_THE_PROVIDERS: &str = "the stored answer is the provider's";
/// Every record reaches its final state (completed) on every path that ends.
pub const FINAL_STATE: &str = "every record reaches a final state";

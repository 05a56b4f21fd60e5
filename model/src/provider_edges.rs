//! Money through a provider at its edges (issue 45): the faults production has and `phases.rs` leaves out.
//! One client key, two workers on two hosts, a database clock that ticks, and:
//!
//! - **a host clock ahead** of the database's (worker 1's, by `skew` ticks);
//! - **commit latency**: a first phase's commit becomes visible some ticks after its statements ran (a
//!   wait for a synchronous standby), while its lease was already counting;
//! - **a gateway** in front of the provider that answers `504` while the call still runs behind it;
//! - **a provider that forgets keys** after its idempotency window and answers lookups by reference;
//! - crashes, and calls bounded in time (`CALL_BOUND` ticks, shorter than the lease);
//! - with [`EdgeModel::cancelling`], an order whose charge the consumer enqueued (attempt 0, as
//!   `enqueue_held` leaves it) and whose `OrderCancelled` the compensation handles at any moment — before,
//!   between and after the charge's phases — under the record's lock (`cancel_unstarted`).
//!
//! The rules come from the domain: [`phases::http_outcome`] classifies the gateway's answer, and
//! [`phases::may_complete`] fences late attempts. The rest mirrors the layer: takeover only when the lease
//! lapsed **on the database's clock**, a call only after a confirmation that the attempt holds more than the
//! call's bound of its lease, and past the layer's window a lookup instead of a call.
//!
//! | action | implemented by |
//! | --- | --- |
//! | [`EdgeAction::Claim`] | `handle` → `take_over` (SQL on `clock_timestamp()`), a new claim's insert |
//! | [`EdgeAction::Commit`] | the first phase's `COMMIT` becoming visible |
//! | [`EdgeAction::Call`] | `Tx::foreign_call` (`confirm_lease`), then `provider.charge`, or past the window `find_charge` |
//! | [`EdgeAction::Gateway`] | a `504` from a load balancer: `http_outcome(Some(504), false)` |
//! | [`EdgeAction::Process`] | the provider processing a call (a known key within its window: the first charge) |
//! | [`EdgeAction::Tick`] | time; the renewal task of an attempt whose call runs |
//! | [`EdgeAction::Cancel`] | `OrderEventHandler::compensate`: `cancel_unstarted`, else a wait, else the refund |
//!
//! Checked: [`AT_MOST_ONE_CHARGE`], [`ONE_CALL_IN_PROCESS`] and [`CANCELLED_MEANS_UNCHARGED`]. Each broken
//! variant (one defect the review reproduced) violates one of them.

use idem_domain::phases::{self, CallOutcome};
use stateright::{Model, Property};

/// The protocol, or the defect the review reproduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EdgeVariant {
    /// idem's rules.
    Idem,
    /// Leases compared with the host's clock (worker 1's is `skew` ahead).
    HostClock,
    /// The call starts without confirming the lease after the first phase's commit.
    NoConfirmAfterCommit,
    /// A gateway's `504` counts as "the provider answered, nothing in process": the lease is given up.
    GatewayIsAnAnswer,
    /// The window checked only by the completer: a retry past it sends the call again.
    WindowOnlyInTheCompleter,
    /// A cancellation that finds the order's charge not final finishes as "skipped" (the review's case).
    CancelSkipsAHeldCharge,
    /// A cancellation cancels a held charge whatever its attempt, though a call may be out.
    CancelAStartedCharge,
}

/// Lease length, in ticks.
pub const LEASE: u8 = 3;
/// The longest a call runs (its timeout), in ticks; the layer's `call_bound`.
pub const CALL_BOUND: u8 = 1;
/// The layer's window (`COMPLETER_WINDOW`), from the first claim.
pub const LAYER_WINDOW: u8 = 4;
/// The provider's key window, from the key's first call.
pub const PROVIDER_WINDOW: u8 = 6;
/// The last tick.
pub const MAX_T: u8 = 9;

/// The model's bounds.
#[derive(Clone, Debug)]
pub struct EdgeModel {
    /// The protocol or a broken variant.
    pub variant: EdgeVariant,
    /// How far worker 1's host clock is ahead of the database's.
    pub skew: u8,
    /// Crashes in all.
    pub crashes: u8,
    /// Most attempts on the record.
    pub attempts: u8,
    /// An order's charge, enqueued, and its cancellation (see [`EdgeModel::cancelling`]).
    pub cancellation: bool,
}

/// A worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Worker {
    /// Free to send (a retry, the completer).
    Idle,
    /// Its first phase ran; its commit is not visible yet.
    Committing {
        /// Its attempt.
        attempt: u8,
        /// Taken over past the layer's window.
        past_window: bool,
    },
    /// Its first phase is visible.
    Ready {
        /// Its attempt.
        attempt: u8,
        /// Taken over past the layer's window.
        past_window: bool,
    },
    /// Its call is out, sent at `since`.
    Calling {
        /// Its attempt.
        attempt: u8,
        /// When it was sent.
        since: u8,
    },
    /// Answered its client; does nothing more.
    Done,
}

/// The record of the key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Record {
    /// Not claimed.
    Absent,
    /// Enqueued by the order consumer (attempt 0): no call was ever sent.
    Enqueued,
    /// Completed by a cancellation before any call: it is never sent.
    Cancelled,
    /// Between the phases.
    Held {
        /// The attempt holding it.
        attempt: u8,
        /// Its lease, on the database's clock.
        lease_until: u8,
        /// Its first phase is not committed yet (its row is locked).
        locked: bool,
        /// Parked for an operator.
        parked: bool,
    },
    /// The second phase committed.
    Completed,
}

/// A call at the provider.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Pending {
    /// The worker waiting for its answer (`None`: it gave up or crashed).
    pub waiting: Option<usize>,
    /// The attempt that sent it.
    pub attempt: u8,
    /// When it was sent.
    pub since: u8,
    /// Whether the provider knew the key when it arrived (and so answers its first charge).
    pub known: bool,
}

/// The state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EdgeState {
    /// The database's clock.
    pub now: u8,
    /// The record.
    pub record: Record,
    /// The two workers.
    pub workers: [Worker; 2],
    /// Calls in process at the provider.
    pub pending: Vec<Pending>,
    /// When the provider first saw the key (it forgets it `PROVIDER_WINDOW` later).
    pub first_seen: Option<u8>,
    /// Charges the provider made.
    pub charges: u8,
    /// Crashes left.
    pub crashes: u8,
    /// The order's cancellation has been handled (compensated, or found nothing to compensate).
    pub cancelled: bool,
    /// Refunds the provider made (a compensation's refund, itself in phases: modelled as one step).
    pub refunds: u8,
}

/// The steps.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EdgeAction {
    /// A worker's first phase: a new claim or a takeover.
    Claim(usize),
    /// A first phase's commit becomes visible.
    Commit(usize),
    /// A worker calls (or looks up).
    Call(usize),
    /// The gateway answers a worker's call `504`; the call still runs.
    Gateway(usize),
    /// The provider processes a call.
    Process(usize),
    /// A worker crashes.
    Crash(usize),
    /// One tick of the database's clock.
    Tick,
    /// The order's cancellation is handled (enabled while it would not wait: a waiting event is retried).
    Cancel,
}

impl EdgeModel {
    /// A host 4 ticks ahead (more than a lease), two crashes, four attempts.
    pub fn standard(variant: EdgeVariant) -> Self {
        Self { variant, skew: 4, crashes: 1, attempts: 4, cancellation: false }
    }

    /// An order's charge enqueued by the consumer and cancelled at any moment, with a host clock 4 ticks
    /// ahead, a crash and three attempts.
    pub fn cancelling(variant: EdgeVariant) -> Self {
        Self { variant, skew: 4, crashes: 1, attempts: 3, cancellation: true }
    }

    /// What the compensation does with the record as it finds it: `None` while it waits (the event fails
    /// transiently and is retried), else the record after it and the refunds the provider makes.
    fn cancel(&self, s: &EdgeState) -> Option<(Record, u8)> {
        match (&s.record, self.variant) {
            // the review's defect: anything not captured is "skipped"
            (Record::Enqueued | Record::Held { .. }, EdgeVariant::CancelSkipsAHeldCharge) => {
                Some((s.record.clone(), s.refunds))
            }
            // attempt 0: never taken over, so never sent — cancelled under the record's lock
            (Record::Enqueued, _) => Some((Record::Cancelled, s.refunds)),
            (Record::Held { .. }, EdgeVariant::CancelAStartedCharge) => Some((Record::Cancelled, s.refunds)),
            // an attempt took it: its call may be out; the event waits until the charge is final
            (Record::Held { .. }, _) => None,
            // captured: refunded through the provider
            (Record::Completed, _) => Some((Record::Completed, s.charges.max(s.refunds))),
            (Record::Absent | Record::Cancelled, _) => Some((s.record.clone(), s.refunds)),
        }
    }

    /// What worker `w` takes to be now.
    fn host_now(&self, s: &EdgeState, w: usize) -> u8 {
        match (self.variant, w) {
            (EdgeVariant::HostClock, 1) => s.now.saturating_add(self.skew),
            _ => s.now,
        }
    }

    fn knows_key(s: &EdgeState) -> bool {
        s.first_seen.is_some_and(|t| s.now < t + PROVIDER_WINDOW)
    }

    /// Worker `w`'s first phase: the record and the worker after it, if it may proceed.
    fn claim(&self, s: &EdgeState, w: usize) -> Option<(Record, Worker)> {
        match &s.record {
            Record::Absent => Some((
                Record::Held { attempt: 1, lease_until: s.now + LEASE, locked: true, parked: false },
                Worker::Committing { attempt: 1, past_window: false },
            )),
            // the completer takes an enqueued charge over at once (attempt 0 holds no lease)
            Record::Enqueued => Some((
                Record::Held { attempt: 1, lease_until: s.now + LEASE, locked: true, parked: false },
                Worker::Committing { attempt: 1, past_window: s.now >= LAYER_WINDOW },
            )),
            Record::Held { attempt, lease_until, locked: false, parked: false } if *attempt < self.attempts => {
                // the takeover's condition, on the database's clock (or, broken, the host's)
                if *lease_until > self.host_now(s, w) {
                    return None;
                }
                let past_window = s.now >= LAYER_WINDOW;
                Some((
                    Record::Held { attempt: attempt + 1, lease_until: s.now + LEASE, locked: true, parked: false },
                    Worker::Committing { attempt: attempt + 1, past_window },
                ))
            }
            _ => None,
        }
    }

    fn holds(s: &EdgeState, attempt: u8) -> Option<u8> {
        match &s.record {
            Record::Held { attempt: a, lease_until, locked: false, parked: false }
                if phases::may_complete(u32::from(*a), u32::from(attempt)) =>
            {
                Some(*lease_until)
            }
            _ => None,
        }
    }
}

impl Model for EdgeModel {
    type State = EdgeState;
    type Action = EdgeAction;

    fn init_states(&self) -> Vec<EdgeState> {
        vec![EdgeState {
            now: 0,
            record: if self.cancellation { Record::Enqueued } else { Record::Absent },
            workers: [Worker::Idle, Worker::Idle],
            pending: Vec::new(),
            first_seen: None,
            charges: 0,
            crashes: self.crashes,
            cancelled: false,
            refunds: 0,
        }]
    }

    fn actions(&self, s: &EdgeState, actions: &mut Vec<EdgeAction>) {
        for (w, worker) in s.workers.iter().enumerate() {
            match worker {
                Worker::Idle if self.claim(s, w).is_some() => actions.push(EdgeAction::Claim(w)),
                Worker::Committing { .. } => actions.push(EdgeAction::Commit(w)),
                Worker::Ready { .. } => actions.push(EdgeAction::Call(w)),
                Worker::Calling { .. } => actions.push(EdgeAction::Gateway(w)),
                _ => {}
            }
            if s.crashes > 0 && !matches!(worker, Worker::Idle | Worker::Done) {
                actions.push(EdgeAction::Crash(w));
            }
        }
        actions.extend((0..s.pending.len()).map(EdgeAction::Process));
        if self.cancellation && !s.cancelled && self.cancel(s).is_some() {
            actions.push(EdgeAction::Cancel);
        }
        // calls are bounded: time does not pass a call's bound while it is in process
        if s.now < MAX_T && s.pending.iter().all(|p| s.now < p.since + CALL_BOUND) {
            actions.push(EdgeAction::Tick);
        }
    }

    fn next_state(&self, last: &EdgeState, action: EdgeAction) -> Option<EdgeState> {
        let mut s = last.clone();
        match action {
            EdgeAction::Claim(w) => {
                let (record, worker) = self.claim(&s, w)?;
                s.record = record;
                s.workers[w] = worker;
            }
            EdgeAction::Commit(w) => {
                let Worker::Committing { attempt, past_window } = s.workers[w] else { return None };
                if let Record::Held { attempt: a, locked, .. } = &mut s.record
                    && *a == attempt
                {
                    *locked = false;
                }
                s.workers[w] = Worker::Ready { attempt, past_window };
            }
            EdgeAction::Call(w) => {
                let Worker::Ready { attempt, past_window } = s.workers[w] else { return None };
                let Some(lease_until) = Self::holds(&s, attempt) else {
                    s.workers[w] = Worker::Done; // fenced out: taken over meanwhile
                    return Some(s);
                };
                // confirmed after the commit: more than the call's bound of the lease left, or nothing sent
                if self.variant != EdgeVariant::NoConfirmAfterCommit && lease_until <= s.now + CALL_BOUND {
                    if let Record::Held { lease_until, .. } = &mut s.record {
                        *lease_until = s.now; // given up: nothing was sent
                    }
                    s.workers[w] = Worker::Idle;
                    return Some(s);
                }
                if past_window && self.variant != EdgeVariant::WindowOnlyInTheCompleter {
                    // never sent again under a key the provider may have forgotten: looked up
                    s.record = if s.charges > 0 {
                        Record::Completed
                    } else {
                        Record::Held { attempt, lease_until, locked: false, parked: true }
                    };
                    s.workers[w] = Worker::Done;
                    return Some(s);
                }
                let known = Self::knows_key(&s);
                s.first_seen.get_or_insert(s.now);
                s.pending.push(Pending { waiting: Some(w), attempt, since: s.now, known });
                s.workers[w] = Worker::Calling { attempt, since: s.now };
            }
            EdgeAction::Gateway(w) => {
                let Worker::Calling { attempt, .. } = s.workers[w] else { return None };
                for p in &mut s.pending {
                    if p.waiting == Some(w) {
                        p.waiting = None; // the call runs on behind the gateway
                    }
                }
                let outcome = match self.variant {
                    EdgeVariant::GatewayIsAnAnswer => CallOutcome::Unknown,
                    _ => phases::http_outcome(Some(504), false),
                };
                if outcome == CallOutcome::Unknown
                    && let Record::Held { attempt: a, lease_until, .. } = &mut s.record
                    && *a == attempt
                {
                    *lease_until = s.now; // "nothing in process": the lease is given up
                }
                s.workers[w] = Worker::Idle;
            }
            EdgeAction::Process(i) => {
                let p = s.pending.remove(i);
                if !(p.known && Self::knows_key(&s)) {
                    s.charges += 1;
                }
                if let Some(w) = p.waiting
                    && matches!(s.workers[w], Worker::Calling { attempt, .. } if attempt == p.attempt)
                {
                    if Self::holds(&s, p.attempt).is_some() {
                        s.record = Record::Completed;
                    }
                    s.workers[w] = Worker::Done;
                }
            }
            EdgeAction::Crash(w) => {
                s.crashes -= 1;
                s.workers[w] = Worker::Idle;
                for p in &mut s.pending {
                    if p.waiting == Some(w) {
                        p.waiting = None;
                    }
                }
            }
            EdgeAction::Cancel => {
                let (record, refunds) = self.cancel(&s)?;
                s.record = record;
                s.refunds = refunds;
                s.cancelled = true;
            }
            EdgeAction::Tick => {
                s.now += 1;
                // the renewal task of an attempt whose call runs (every third of the lease: each tick)
                let renewing: Vec<u8> = s
                    .workers
                    .iter()
                    .filter_map(|w| match w {
                        Worker::Calling { attempt, since } if *since < s.now => Some(*attempt),
                        _ => None,
                    })
                    .collect();
                if let Record::Held { attempt, lease_until, .. } = &mut s.record
                    && renewing.contains(attempt)
                {
                    *lease_until = (*lease_until).max(s.now + LEASE);
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(AT_MOST_ONE_CHARGE, |_, s: &EdgeState| s.charges <= 1),
            Property::always(ONE_CALL_IN_PROCESS, |_, s: &EdgeState| s.pending.len() <= 1),
            Property::always(CANCELLED_MEANS_UNCHARGED, |_, s: &EdgeState| !s.cancelled || s.charges <= s.refunds),
            Property::sometimes("a charge is found by its lookup past the window", |_, s: &EdgeState| {
                s.record == Record::Completed && s.now >= LAYER_WINDOW && s.charges == 1
            }),
            Property::sometimes("a request is parked past the window", |_, s: &EdgeState| {
                matches!(s.record, Record::Held { parked: true, .. })
            }),
        ];
        if self.cancellation {
            properties.push(Property::sometimes("a charge is cancelled before its call", |_, s: &EdgeState| {
                s.cancelled && s.record == Record::Cancelled
            }));
            properties.push(Property::sometimes("a charge is refunded after a cancellation", |_, s: &EdgeState| {
                s.cancelled && s.refunds == 1
            }));
        }
        properties
    }
}

/// The provider charges at most once for the client key.
pub const AT_MOST_ONE_CHARGE: &str = "at most one provider charge per client key";
/// Once an order's cancellation is handled, every charge of it is refunded: none is made afterwards.
pub const CANCELLED_MEANS_UNCHARGED: &str = "a cancelled order ends with no charge or its charge refunded";
/// Never two calls with one key in process at the provider at once.
pub const ONE_CALL_IN_PROCESS: &str = "no two calls with one key in process at once";

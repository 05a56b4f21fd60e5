//! The HTTP `Idempotency-Key` protocol as a state machine.
//!
//! Several clients send requests under **one key**: some in the same scope (merchant) with the same request,
//! one with a different request, one in another scope. Each request runs the steps of
//! `adapters-http/src/idempotency.rs::handle` and `execute` as separate actions, so the checker interleaves
//! them in every order, and may crash the process at any step, time a lock wait out, let a completed
//! record expire, clean it up and claim the expired key again.
//!
//! The database is modelled by what matters here: committed rows, the uncommitted writes of each open
//! transaction, and the row lock a claim takes on `(scope, key)` (a second claim waits for the first
//! transaction to end, as `INSERT … ON CONFLICT` does).
//!
//! A send takes one of two paths, as `handle` chooses: **claim first** (the claim row before the handler:
//! a duplicate behind an in-process leader, an expired v7 key, an empty new-key bucket) or **record at
//! commit** (every other first send: the handler writes, then one statement inserts the completed record,
//! waiting on a concurrent uncommitted record of the key; a live record found there rolls the writes back
//! and the send is decided again on the claim-first path). The checker lets every send take either path.
//!
//! | action | implemented by |
//! | --- | --- |
//! | [`Action::Claim`] | `IdempotencyRepository::claim` (`adapters-postgres/src/repos.rs`), then `idem_domain::idempotency::decide` |
//! | [`Action::Execute`] | `execute` on the record-at-commit path: the handler's writes, no record yet |
//! | [`Action::Record`] | `IdempotencyRepository::insert_completed` (the completed record in the handler's transaction; on a live record, rollback and the claim-first path) |
//! | [`Action::LockTimeout`] | the `lock_timeout` set inside `claim`; `handle` answers 409 `request-in-flight` |
//! | [`Action::Handler`] | the inner service called by `execute` (the business writes, in the claim's transaction) |
//! | [`Action::Complete`] | `IdempotencyRepository::complete` |
//! | [`Action::Commit`] | `UnitOfWork::commit` at the end of `execute` |
//! | [`Action::Crash`] | the process dies: the open transaction rolls back; the client retries with its key |
//! | [`Action::Expire`] | time passes `expires_at` (`TtlPolicy::expires_at`) |
//! | [`Action::Cleanup`] | `Cleaner::run_once` deleting expired records (`adapters-postgres/src/cleanup.rs`) |
//!
//! Broken variants ([`HttpVariant`]) change one rule each and must violate an invariant.

use std::collections::BTreeMap;

use idem_domain::{Decision, Fingerprint};
use idem_ports::{IdempotencyRecord, IdempotencyState, StoredResponse};
use stateright::{Model, Property};

/// A merchant: idempotency records are scoped by it.
pub type Scope = u8;
/// Which request body a client sends (same number = byte-identical request, same fingerprint).
pub type Request = u8;

/// The protocol checked, or a deliberately broken variant of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HttpVariant {
    /// idem: the record is written in the transaction of the business writes, either claimed first and
    /// completed, or inserted completed at commit.
    Idem,
    /// The seed article's middleware shape: look the key up, run the handler in its own transaction, then
    /// write the record (an upsert) in another transaction after the handler.
    SeedMiddleware,
    /// Records keyed by the key alone, without the scope.
    UnscopedRecord,
    /// Record at commit that overwrites a live record instead of deferring to it (an upsert without the
    /// expiry condition): the handler's writes commit although the key was taken.
    RecordOverLiveRecord,
    /// Record at commit that does not wait for a concurrent uncommitted record (a read, then a plain
    /// insert into a table without the unique key): two first sends both commit.
    RecordWithoutWaiting,
}

/// One client: a scope, a request, and how many times it sends it (its retries reuse the key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    /// Its merchant.
    pub scope: Scope,
    /// Its request body.
    pub request: Request,
}

/// The model: clients sharing one key, and the bounds that keep the state space finite.
#[derive(Clone, Debug)]
pub struct ClaimProtocol {
    /// The clients, all on one key.
    pub clients: Vec<Client>,
    /// The protocol or a broken variant.
    pub variant: HttpVariant,
    /// Sends per client (the first plus retries after a crash or a 409 in flight).
    pub attempts: u8,
    /// Expiries per scope.
    pub expiries: u8,
}

/// An effect (a payment) committed by attempt `attempt` of client `client`. It is also the response body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Effect {
    /// The client that committed it.
    pub client: u8,
    /// Which of its sends.
    pub attempt: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
/// A record's state.
pub enum RecordState {
    /// Claimed, not completed (idem never commits this state).
    InFlight,
    /// Completed with the response of this effect.
    Completed(Effect),
}

/// An idempotency record as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Record {
    /// The request it was claimed for.
    pub request: Request,
    /// In flight or completed.
    pub state: RecordState,
    /// Past its expiry.
    pub expired: bool,
}

/// Where one client's current attempt is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// About to send (again).
    Ready,
    /// Its claim waits for another transaction's row lock.
    Waiting,
    /// Holds the claim (idem: an uncommitted in-flight record and the row lock).
    Claimed,
    /// Record at commit: the handler wrote its effect (uncommitted), no record and no lock yet.
    WroteUnclaimed,
    /// Record at commit: the record's insert waits for another transaction's row lock.
    RecordWaiting,
    /// Record at commit found a live record: its writes rolled back, the send is decided again claim-first.
    Redecide,
    /// The handler wrote its effect (uncommitted in idem).
    Wrote,
    /// idem: the record is completed in the open transaction. Seed: the handler's transaction committed.
    Completed,
    /// Got its answer and stops.
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
/// One client's progress.
pub struct ClientState {
    /// Where its current send is.
    pub phase: Phase,
    /// Which send (0-based).
    pub attempt: u8,
    /// The send took the record-at-commit path.
    pub at_commit: bool,
}

/// What a client was answered with an effect in it: executed (first answer) or replayed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Answer {
    /// The client answered.
    pub client: u8,
    /// The retention period (see [`HttpState::epoch`]) in which it was answered.
    pub epoch: u8,
    /// The effect in the answer.
    pub effect: Effect,
    /// Whether it was a replay.
    pub replayed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
/// The whole system: committed rows, open transactions, clients, answers.
pub struct HttpState {
    /// Committed records, by record slot (the scope; always 0 in [`HttpVariant::UnscopedRecord`]).
    pub records: BTreeMap<Scope, Record>,
    /// Retention periods per scope: increases when a record expires (a later claim may execute again).
    pub epoch: BTreeMap<Scope, u8>,
    /// Which client's open transaction holds the row lock of a slot.
    pub locks: BTreeMap<Scope, u8>,
    /// Committed effects: (scope, epoch, effect).
    pub effects: Vec<(Scope, u8, Effect)>,
    /// Each client's progress.
    pub clients: Vec<ClientState>,
    /// Answers with an effect, in order.
    pub answers: Vec<Answer>,
    /// Expiries so far, per slot.
    pub expiries: BTreeMap<Scope, u8>,
    /// Paths reached (for the "sometimes" properties): bit 0, a send recorded at commit committed; bit 1, a
    /// send recorded at commit found a live record and was decided again.
    pub paths: u8,
}

/// The steps; each names the client (or the scope) it acts on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// `IdempotencyRepository::claim` + `decide` for a client.
    Claim(u8),
    /// Record at commit: the handler runs before any record exists.
    Execute(u8),
    /// Record at commit: the completed record's insert (or the rollback on a live record).
    Record(u8),
    /// The claim's lock wait timed out (409 in flight).
    LockTimeout(u8),
    /// The handler's business writes.
    Handler(u8),
    /// `IdempotencyRepository::complete`.
    Complete(u8),
    /// `UnitOfWork::commit`.
    Commit(u8),
    /// The process dies: rollback, the client retries.
    Crash(u8),
    /// A completed record passes `expires_at`.
    Expire(Scope),
    /// The cleaner deletes an expired record.
    Cleanup(Scope),
}

impl ClaimProtocol {
    /// Four clients on one key: two identical requests and a different one in scope 0, the first request
    /// again in scope 1; three sends each, two expiries per scope.
    pub fn standard(variant: HttpVariant) -> Self {
        Self {
            clients: vec![
                Client { scope: 0, request: 1 },
                Client { scope: 0, request: 1 },
                Client { scope: 0, request: 2 },
                Client { scope: 1, request: 1 },
            ],
            variant,
            attempts: 3,
            expiries: 2,
        }
    }

    /// Whether sends may take the record-at-commit path (idem and its broken record-at-commit variants).
    fn records_at_commit(&self) -> bool {
        matches!(
            self.variant,
            HttpVariant::Idem | HttpVariant::RecordOverLiveRecord | HttpVariant::RecordWithoutWaiting
        )
    }

    fn slot(&self, c: u8) -> Scope {
        match self.variant {
            HttpVariant::UnscopedRecord => 0,
            _ => self.clients[c as usize].scope,
        }
    }

    fn effect(state: &HttpState, c: u8) -> Effect {
        Effect { client: c, attempt: state.clients[c as usize].attempt }
    }

    /// The client's attempt ended without an answer it keeps: it retries if it has sends left.
    fn retry_or_stop(&self, state: &mut HttpState, c: u8) {
        let client = &mut state.clients[c as usize];
        client.at_commit = false;
        if client.attempt + 1 < self.attempts {
            client.attempt += 1;
            client.phase = Phase::Ready;
        } else {
            client.phase = Phase::Done;
        }
    }

    fn answer(state: &mut HttpState, c: u8, scope: Scope, effect: Effect, replayed: bool) {
        let epoch = state.epoch.get(&scope).copied().unwrap_or(0);
        state.answers.push(Answer { client: c, epoch, effect, replayed });
        state.clients[c as usize].phase = Phase::Done;
    }

    /// `claim` + `decide`.
    fn claim(&self, state: &mut HttpState, c: u8) {
        let slot = self.slot(c);
        let client = self.clients[c as usize];
        let uses_lock = self.variant != HttpVariant::SeedMiddleware;
        if uses_lock && state.locks.get(&slot).is_some_and(|holder| *holder != c) {
            state.clients[c as usize].phase = Phase::Waiting;
            return;
        }
        // The decision is the domain's own `decide`, on the record as the store would hand it over.
        let stored = state.records.get(&slot).copied().map(as_stored);
        match idem_domain::decide(stored.as_ref(), &fingerprint(client.request), now()) {
            Decision::Execute => {
                if uses_lock {
                    state.locks.insert(slot, c);
                }
                state.clients[c as usize].phase = Phase::Claimed;
            }
            Decision::Conflict => {
                state.clients[c as usize].phase = Phase::Done; // 409/422 conflict
            }
            Decision::Replay(response) => {
                let effect = Effect { client: response.body[0], attempt: response.body[1] };
                Self::answer(state, c, client.scope, effect, true);
            }
            Decision::InFlight => self.retry_or_stop(state, c), // 409 request-in-flight
            // records here are claimed in one transaction, never held between phases (`phases.rs` models those)
            Decision::Resume { .. } => self.retry_or_stop(state, c),
        }
    }

    /// Record at commit: insert the completed record unless a live one exists; wait for another
    /// transaction's uncommitted record of the slot.
    fn record(&self, state: &mut HttpState, c: u8) {
        let slot = self.slot(c);
        if self.variant != HttpVariant::RecordWithoutWaiting && state.locks.get(&slot).is_some_and(|h| *h != c) {
            state.clients[c as usize].phase = Phase::RecordWaiting;
            return;
        }
        let live = state.records.get(&slot).is_some_and(|r| !r.expired);
        if live && self.variant != HttpVariant::RecordOverLiveRecord {
            // ON CONFLICT without the expiry condition: nothing inserted; the unit rolls back
            state.clients[c as usize].phase = Phase::Redecide;
            state.clients[c as usize].at_commit = false;
            state.paths |= 2;
            return;
        }
        if self.variant != HttpVariant::RecordWithoutWaiting {
            state.locks.insert(slot, c);
        }
        state.clients[c as usize].phase = Phase::Completed;
    }

    /// The business writes and the record become visible together (idem), or one after the other (seed).
    fn commit(&self, state: &mut HttpState, c: u8) {
        let slot = self.slot(c);
        let scope = self.clients[c as usize].scope;
        let effect = Self::effect(state, c);
        let epoch = state.epoch.get(&scope).copied().unwrap_or(0);
        state.effects.push((scope, epoch, effect));
        if state.clients[c as usize].at_commit {
            state.paths |= 1;
        }
        match self.variant {
            HttpVariant::SeedMiddleware => state.clients[c as usize].phase = Phase::Completed,
            _ => {
                let request = self.clients[c as usize].request;
                state.records.insert(slot, Record { request, state: RecordState::Completed(effect), expired: false });
                if state.locks.get(&slot) == Some(&c) {
                    state.locks.remove(&slot);
                }
                Self::answer(state, c, scope, effect, false);
            }
        }
    }
}

/// The model's clock for [`idem_domain::decide`]: expiry is an action here, so a record is dated to have
/// expired an hour before this time, or to expire an hour after it.
fn now() -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default()
}

/// The fingerprint of request `request` (same number, same bytes).
fn fingerprint(request: Request) -> Fingerprint {
    Fingerprint::from_bytes([request; 32])
}

/// A model record as the store returns it (the response body names the effect).
fn as_stored(r: Record) -> IdempotencyRecord {
    let (state, response) = match r.state {
        RecordState::InFlight => (IdempotencyState::InFlight, None),
        RecordState::Completed(e) => (
            IdempotencyState::Completed,
            Some(StoredResponse { status_code: 201, headers: Vec::new(), body: vec![e.client, e.attempt] }),
        ),
    };
    let hour = chrono::Duration::hours(1);
    IdempotencyRecord {
        scope: String::new(),
        key: String::new(),
        command_hash: *fingerprint(r.request).as_bytes(),
        state,
        response,
        created_at: now() - hour * 2,
        expires_at: if r.expired { now() - hour } else { now() + hour },
        phase: None,
    }
}

impl Model for ClaimProtocol {
    type State = HttpState;
    type Action = Action;

    fn init_states(&self) -> Vec<HttpState> {
        vec![HttpState {
            records: BTreeMap::new(),
            epoch: BTreeMap::new(),
            locks: BTreeMap::new(),
            effects: Vec::new(),
            clients: self
                .clients
                .iter()
                .map(|_| ClientState { phase: Phase::Ready, attempt: 0, at_commit: false })
                .collect(),
            answers: Vec::new(),
            expiries: BTreeMap::new(),
            paths: 0,
        }]
    }

    fn actions(&self, state: &HttpState, actions: &mut Vec<Action>) {
        for (i, client) in state.clients.iter().enumerate() {
            let c = i as u8;
            let slot = self.slot(c);
            match client.phase {
                Phase::Ready => {
                    actions.push(Action::Claim(c));
                    if self.records_at_commit() {
                        actions.push(Action::Execute(c));
                    }
                }
                Phase::Redecide => actions.push(Action::Claim(c)),
                Phase::WroteUnclaimed => actions.push(Action::Record(c)),
                Phase::RecordWaiting => {
                    if !state.locks.contains_key(&slot) {
                        actions.push(Action::Record(c));
                    }
                    actions.push(Action::LockTimeout(c));
                }
                Phase::Waiting => {
                    if !state.locks.contains_key(&slot) {
                        actions.push(Action::Claim(c));
                    }
                    actions.push(Action::LockTimeout(c));
                }
                Phase::Claimed => actions.push(Action::Handler(c)),
                Phase::Wrote => match self.variant {
                    HttpVariant::SeedMiddleware => actions.push(Action::Commit(c)),
                    _ => actions.push(Action::Complete(c)),
                },
                Phase::Completed => match self.variant {
                    HttpVariant::SeedMiddleware => actions.push(Action::Complete(c)),
                    _ => actions.push(Action::Commit(c)),
                },
                Phase::Done => {}
            }
            if matches!(
                client.phase,
                Phase::Waiting
                    | Phase::Claimed
                    | Phase::Wrote
                    | Phase::Completed
                    | Phase::WroteUnclaimed
                    | Phase::RecordWaiting
                    | Phase::Redecide
            ) {
                actions.push(Action::Crash(c));
            }
        }
        let scopes: Vec<Scope> = state.records.keys().copied().collect();
        for scope in scopes {
            let record = state.records[&scope];
            let expiries = state.expiries.get(&scope).copied().unwrap_or(0);
            if !record.expired && matches!(record.state, RecordState::Completed(_)) && expiries < self.expiries {
                actions.push(Action::Expire(scope));
            }
            if record.expired && !state.locks.contains_key(&scope) {
                actions.push(Action::Cleanup(scope));
            }
        }
    }

    fn next_state(&self, last: &HttpState, action: Action) -> Option<HttpState> {
        let mut state = last.clone();
        match action {
            Action::Claim(c) => self.claim(&mut state, c),
            Action::Execute(c) => {
                state.clients[c as usize].phase = Phase::WroteUnclaimed;
                state.clients[c as usize].at_commit = true;
            }
            Action::Record(c) => self.record(&mut state, c),
            Action::LockTimeout(c) => self.retry_or_stop(&mut state, c),
            Action::Handler(c) => state.clients[c as usize].phase = Phase::Wrote,
            Action::Complete(c) => match self.variant {
                HttpVariant::SeedMiddleware => {
                    // the record written after the handler committed, in its own transaction (upsert)
                    let client = self.clients[c as usize];
                    let effect = Self::effect(&state, c);
                    let record =
                        Record { request: client.request, state: RecordState::Completed(effect), expired: false };
                    state.records.insert(self.slot(c), record);
                    Self::answer(&mut state, c, client.scope, effect, false);
                }
                _ => state.clients[c as usize].phase = Phase::Completed,
            },
            Action::Commit(c) => self.commit(&mut state, c),
            Action::Crash(c) => {
                let slot = self.slot(c);
                if state.locks.get(&slot) == Some(&c) {
                    state.locks.remove(&slot);
                }
                self.retry_or_stop(&mut state, c);
            }
            Action::Expire(slot) => {
                if let Some(r) = state.records.get_mut(&slot) {
                    r.expired = true;
                }
                *state.expiries.entry(slot).or_default() += 1;
                // a new retention period for every scope whose record lives in this slot
                for client in &self.clients {
                    if self.variant != HttpVariant::UnscopedRecord && client.scope != slot {
                        continue;
                    }
                    state.epoch.insert(client.scope, last.epoch.get(&client.scope).copied().unwrap_or(0) + 1);
                }
            }
            Action::Cleanup(slot) => {
                state.records.remove(&slot);
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(AT_MOST_ONE_EFFECT, |_, s: &HttpState| {
                let mut seen = std::collections::BTreeSet::new();
                s.effects.iter().all(|(scope, epoch, _)| seen.insert((*scope, *epoch)))
            }),
            Property::always(REPLAY_EQUALS_FIRST, |m: &ClaimProtocol, s: &HttpState| {
                s.answers.iter().all(|a| {
                    let scope = m.clients[a.client as usize].scope;
                    let first = s.effects.iter().find(|(sc, ep, _)| *sc == scope && *ep == a.epoch);
                    first.is_some_and(|(_, _, e)| *e == a.effect)
                })
            }),
            Property::always(NO_REPLAY_ACROSS_SCOPES, |m: &ClaimProtocol, s: &HttpState| {
                s.answers
                    .iter()
                    .all(|a| m.clients[a.client as usize].scope == m.clients[a.effect.client as usize].scope)
            }),
            Property::always(RECORD_IFF_EFFECT, |m: &ClaimProtocol, s: &HttpState| {
                let records_have_effects = s.records.values().all(|r| match r.state {
                    RecordState::Completed(e) => s.effects.iter().any(|(_, _, x)| *x == e),
                    RecordState::InFlight => true,
                });
                let effects_have_records = s.effects.iter().all(|(scope, epoch, e)| {
                    let current = s.epoch.get(scope).copied().unwrap_or(0) == *epoch;
                    let slot = m.slot(e.client);
                    !current || s.records.get(&slot).is_some_and(|r| r.state == RecordState::Completed(*e))
                });
                records_have_effects && effects_have_records
            }),
            Property::sometimes("a request is replayed", |_, s: &HttpState| s.answers.iter().any(|a| a.replayed)),
            Property::sometimes("an expired key executes again", |_, s: &HttpState| {
                s.effects.iter().any(|(_, epoch, _)| *epoch > 0)
            }),
            Property::sometimes("a send recorded at commit commits", |_, s: &HttpState| s.paths & 1 != 0),
            Property::sometimes("a send recorded at commit defers to a live record", |_, s: &HttpState| {
                s.paths & 2 != 0
            }),
            Property::sometimes("a crashed request is retried and executes", |_, s: &HttpState| {
                s.effects.iter().any(|(_, _, e)| e.attempt > 0)
            }),
        ]
    }
}

/// At most one committed effect per (scope, key) within one retention period.
pub const AT_MOST_ONE_EFFECT: &str = "at most one committed effect per (scope, key) within retention";
/// Every answer carrying an effect (first or replayed) is the first effect committed for its scope and period.
pub const REPLAY_EQUALS_FIRST: &str = "every replay equals the first committed response";
/// A client is never answered with another scope's effect.
pub const NO_REPLAY_ACROSS_SCOPES: &str = "no replay across scopes";
/// A completed record never exists without its effect, nor a live effect without its record.
pub const RECORD_IFF_EFFECT: &str = "a completed record exists if and only if its effect does";

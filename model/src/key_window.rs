//! The end of an `Idempotency-Key`'s retention with real clocks: one UUID v7 key sent again and again by
//! a client to two hosts whose clocks are off the database's (within the hour the cleaner tolerates),
//! while the database's clock moves and the cleaner deletes expired records by it.
//!
//! The rules come from the domain itself — [`IdempotencyKey::is_expired`] (the key floor),
//! [`IdempotencyKey::is_future_dated`] and [`TtlPolicy::retain_until`] — so a change to any of them is
//! model-checked here, not a copy of it.
//!
//! | action | implemented by |
//! | --- | --- |
//! | [`KeyAction::Request`] | `adapters-http/src/idempotency.rs` `handle`: the key's age check, the record's lookup or claim (an expired record is taken over), the handler, the record with `retain_until` |
//! | [`KeyAction::Tick`] | the database's clock moves (30 s, 10 min, 1 h, 24 h); the hosts' clocks move with it, each at its offset |
//! | [`KeyAction::Cleanup`] | `Cleaner::run_once`: records whose `expires_at` passed by the database's clock are deleted |
//!
//! Checked: [`AT_MOST_ONE_EXECUTION`] on idem's rules; the rule without the clock margin (issue 32.4: a
//! host 50 minutes behind the database executed a refund twice) violates it.

use chrono::{DateTime, Utc};
use idem_domain::{IdempotencyKey, TtlPolicy};
use stateright::{Model, Property};

/// The protocol checked, or a deliberately broken variant of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyVariant {
    /// idem's rules.
    Idem,
    /// Issue 32.4: a key is refused only when older than the TTL by the checking host's clock, no margin.
    FloorWithoutMargin,
}

/// The model: the key's times, the hosts' clock offsets, the bounds.
#[derive(Clone, Debug)]
pub struct KeyWindow {
    /// The protocol or a broken variant.
    pub variant: KeyVariant,
    /// `IDEMPOTENCY_TTL`.
    pub ttl: TtlPolicy,
    /// Times (seconds from the start, by the database's clock) the key may carry; one is chosen.
    pub key_times: Vec<i64>,
    /// Offsets of a host's clock from the database's (seconds); each host gets one.
    pub offsets: Vec<i64>,
    /// Most requests.
    pub requests: u8,
    /// Most clock steps.
    pub ticks: u8,
}

/// The state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KeyState {
    /// The database's clock, seconds since the start.
    pub now: i64,
    /// The time the key carries.
    pub key_time: i64,
    /// Each host's clock offset from the database's.
    pub offsets: [i64; 2],
    /// `idempotency_record.expires_at`, while the record exists.
    pub record_expires: Option<i64>,
    /// Executions of the request.
    pub executed: u8,
    /// Requests answered from the record.
    pub replayed: u8,
    /// Requests refused as expired.
    pub refused: u8,
    /// Requests left.
    pub requests: u8,
    /// Clock steps left.
    pub ticks: u8,
}

/// The steps.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum KeyAction {
    /// The client sends the request to host 0 or 1.
    Request(usize),
    /// The database's clock moves this many seconds.
    Tick(i64),
    /// A cleanup round.
    Cleanup,
}

const STEPS: [i64; 4] = [30, 600, 3600, 24 * 3600];

fn at(t: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + t, 0).unwrap_or_default()
}

fn secs(t: DateTime<Utc>) -> i64 {
    t.timestamp() - 1_800_000_000
}

/// The UUID v7 key that carries `t`.
fn key_at(t: i64) -> IdempotencyKey {
    let millis = u64::try_from(at(t).timestamp_millis()).unwrap_or_default();
    let id = uuid::Builder::from_unix_timestamp_millis(millis, &[7; 10]).into_uuid();
    IdempotencyKey::parse(&id.to_string()).unwrap_or_else(|_| unreachable!())
}

impl KeyWindow {
    /// A 24 h TTL; keys dated now, 10 minutes back and 30 minutes ahead; hosts 50 minutes behind, on
    /// time, or 50 minutes ahead of the database; four requests; five clock steps.
    pub fn standard(variant: KeyVariant) -> Self {
        Self {
            variant,
            ttl: TtlPolicy::new(std::time::Duration::from_secs(24 * 3600)).unwrap_or_else(|_| unreachable!()),
            key_times: vec![0, -600, 1800],
            offsets: vec![-3000, 0, 3000],
            requests: 4,
            ticks: 5,
        }
    }

    /// Whether the key is too old to execute at the host's `now` when its record is gone.
    fn expired(&self, key: &IdempotencyKey, now: DateTime<Utc>) -> bool {
        match self.variant {
            KeyVariant::Idem => key.is_expired(&self.ttl, now),
            KeyVariant::FloorWithoutMargin => key.first_sent().is_some_and(|t| t < now - self.ttl_chrono()),
        }
    }

    fn ttl_chrono(&self) -> chrono::Duration {
        chrono::Duration::from_std(self.ttl.ttl()).unwrap_or_default()
    }

    /// `handle` on one host.
    fn request(&self, s: &mut KeyState, host: usize) {
        let now = at(s.now + s.offsets[host]);
        let key = key_at(s.key_time);
        if key.is_future_dated(now) {
            s.refused += 1;
            return;
        }
        // a live record answers; an expired one is taken over by a claim (`WHERE expires_at <= now`)
        if s.record_expires.is_some_and(|e| at(e) > now) {
            s.replayed += 1;
        } else if self.expired(&key, now) {
            s.refused += 1;
        } else {
            s.executed += 1;
            s.record_expires = Some(secs(self.ttl.retain_until(now, key.first_sent())));
        }
    }
}

impl Model for KeyWindow {
    type State = KeyState;
    type Action = KeyAction;

    fn init_states(&self) -> Vec<KeyState> {
        let mut states = Vec::new();
        for &key_time in &self.key_times {
            for &a in &self.offsets {
                for &b in &self.offsets {
                    states.push(KeyState {
                        now: 0,
                        key_time,
                        offsets: [a, b],
                        record_expires: None,
                        executed: 0,
                        replayed: 0,
                        refused: 0,
                        requests: self.requests,
                        ticks: self.ticks,
                    });
                }
            }
        }
        states
    }

    fn actions(&self, s: &KeyState, actions: &mut Vec<KeyAction>) {
        if s.requests > 0 {
            actions.extend([KeyAction::Request(0), KeyAction::Request(1)]);
        }
        if s.ticks > 0 {
            actions.extend(STEPS.iter().map(|&d| KeyAction::Tick(d)));
        }
        if s.record_expires.is_some_and(|e| e <= s.now) {
            actions.push(KeyAction::Cleanup);
        }
    }

    fn next_state(&self, last: &KeyState, action: KeyAction) -> Option<KeyState> {
        let mut s = last.clone();
        match action {
            KeyAction::Request(host) => {
                s.requests -= 1;
                self.request(&mut s, host);
            }
            KeyAction::Tick(d) => {
                s.ticks -= 1;
                s.now += d;
            }
            KeyAction::Cleanup => s.record_expires = None,
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(AT_MOST_ONE_EXECUTION, |_, s: &KeyState| s.executed <= 1),
            Property::sometimes("a request executes", |_, s: &KeyState| s.executed == 1),
            Property::sometimes("a retry is replayed", |_, s: &KeyState| s.executed == 1 && s.replayed > 0),
            Property::sometimes("a retry after the cleanup is refused", |_, s: &KeyState| {
                s.executed == 1 && s.record_expires.is_none() && s.refused > 0
            }),
        ]
    }
}

/// A UUID v7 key's request executes at most once, whatever the hosts' clocks (within the tolerated hour)
/// and whenever the cleaner runs.
pub const AT_MOST_ONE_EXECUTION: &str = "a v7 key executes at most once";

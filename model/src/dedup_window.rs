//! The dedup window with real time: one event, delivered again and again while a clock moves, a cleaner
//! deletes expired rows, and an operator re-drives dead letters with `--admit-late`.
//!
//! The inbox/outbox model abstracts time into one action ("the window passed"). This one keeps the clock,
//! because the holes it checks live in the arithmetic: when an event is admitted and how long its row is
//! kept. Both come from the domain itself — [`TtlPolicy::admission`] and [`TtlPolicy::retain_until`] — so a
//! change to either rule is model-checked here, not a copy of it.
//!
//! | action | implemented by |
//! | --- | --- |
//! | [`Action::Deliver`] | `Runner::process` (admission) → `Runner::apply` (`record_new`, `apply_late_admission`, handler) |
//! | [`Action::Tick`] | time passing (steps of 30 s, 1 h and 10 h: the edges of the margin and the windows) |
//! | [`Action::Cleanup`] | `Cleaner::run_once`: rows whose `expires_at` passed are deleted |
//! | [`Action::AdmitLate`] | `idem dlq redrive --admit-late`: a `late_admission` row, then the event produced again |
//!
//! Checked: [`NO_DUPLICATE_APPLIED`] on idem's rules; each broken variant violates it.

use chrono::{DateTime, Utc};
use idem_domain::{Admission, TtlPolicy};
use stateright::{Model, Property};

/// The protocol checked, or a deliberately broken variant of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WindowVariant {
    /// idem's rules.
    Idem,
    /// Issue 24.1: a late admission checks only `late_admission`, never the processed row.
    LateAdmissionWithoutRow,
    /// Issue 24.2: a row is kept a TTL after processing, whatever the time its id carries.
    RetainFromProcessing,
}

/// The model: the event's id time (seconds from the start), the TTL, the bounds.
#[derive(Clone, Debug)]
pub struct DedupWindow {
    /// The protocol or a broken variant.
    pub variant: WindowVariant,
    /// `DEDUP_TTL`.
    pub ttl: TtlPolicy,
    /// Times (seconds from the start) the event's id may carry; one is chosen at the start.
    pub event_times: Vec<i64>,
    /// Most deliveries.
    pub deliveries: u8,
    /// Most clock steps.
    pub ticks: u8,
}

/// The state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WindowState {
    /// Seconds since the start.
    pub now: i64,
    /// The time the event's id carries (seconds since the start).
    pub event_time: i64,
    /// `processed_event`: the row's expiry, while it exists.
    pub row_expires: Option<i64>,
    /// `late_admission`: admitted, and whether it was applied.
    pub admission: Option<bool>,
    /// Dead-lettered `older-than-dedup-window` (an operator may re-drive it).
    pub refused_late: bool,
    /// Applications of the event.
    pub applied: u8,
    /// An application after an earlier one that no operator decided: a duplicate got through.
    pub repeated: bool,
    /// Deliveries left.
    pub deliveries: u8,
    /// Clock steps left.
    pub ticks: u8,
}

/// The steps.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A delivery of the event.
    Deliver,
    /// The clock moves this many seconds.
    Tick(i64),
    /// A cleanup round.
    Cleanup,
    /// The operator admits the refused event late and re-drives it (the re-drive is a later delivery).
    AdmitLate,
}

/// Clock steps: inside the admission margin, about the margin, and across windows.
const STEPS: [i64; 3] = [30, 3600, 10 * 3600];

fn at(t: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + t, 0).unwrap_or_default()
}

fn secs(t: DateTime<Utc>) -> i64 {
    t.timestamp() - 1_800_000_000
}

impl DedupWindow {
    /// A 24 h TTL; ids dated on both edges of the admission floor (22 h 59 m 30 s back, 23 h back), now,
    /// and 10 h ahead; four deliveries; six clock steps.
    pub fn standard(variant: WindowVariant) -> Self {
        Self {
            variant,
            ttl: TtlPolicy::new(std::time::Duration::from_secs(24 * 3600)).unwrap_or_else(|_| unreachable!()),
            event_times: vec![-(23 * 3600 - 30), -(23 * 3600), 0, 10 * 3600],
            deliveries: 4,
            ticks: 6,
        }
    }

    /// `Runner::process` + `Runner::apply` for one delivery.
    fn deliver(&self, s: &mut WindowState) {
        let now = at(s.now);
        let event_time = at(s.event_time);
        match self.ttl.admission(now, Some(event_time)) {
            Admission::FutureDated => {}
            Admission::TooOld if s.admission == Some(false) => {
                // the late path: the admission is consumed; with idem's rule the processed row too
                let row_alive = s.row_expires.is_some();
                let row_new = match self.variant {
                    WindowVariant::LateAdmissionWithoutRow => true,
                    _ => self.record(s, now, event_time),
                };
                s.admission = Some(true);
                if row_new {
                    // Re-applying an event whose row is gone is the operator's decision (`--admit-late`
                    // says "at most once from here"); re-applying one whose row still exists is a duplicate.
                    s.repeated |= s.applied > 0 && row_alive;
                    s.applied += 1;
                }
            }
            Admission::TooOld => s.refused_late = true,
            Admission::Admitted => {
                if self.record(s, now, event_time) {
                    s.repeated |= s.applied > 0;
                    s.applied += 1;
                }
            }
        }
    }

    /// `record_new`: true when the row was new.
    fn record(&self, s: &mut WindowState, now: DateTime<Utc>, event_time: DateTime<Utc>) -> bool {
        if s.row_expires.is_some() {
            return false;
        }
        let until = match self.variant {
            WindowVariant::RetainFromProcessing => self.ttl.expires_at(now),
            _ => self.ttl.retain_until(now, Some(event_time)),
        };
        s.row_expires = Some(secs(until));
        true
    }
}

impl Model for DedupWindow {
    type State = WindowState;
    type Action = Action;

    fn init_states(&self) -> Vec<WindowState> {
        self.event_times
            .iter()
            .map(|&event_time| WindowState {
                now: 0,
                event_time,
                row_expires: None,
                admission: None,
                refused_late: false,
                applied: 0,
                repeated: false,
                deliveries: self.deliveries,
                ticks: self.ticks,
            })
            .collect()
    }

    fn actions(&self, s: &WindowState, actions: &mut Vec<Action>) {
        if s.deliveries > 0 {
            actions.push(Action::Deliver);
        }
        if s.ticks > 0 {
            actions.extend(STEPS.iter().map(|&d| Action::Tick(d)));
        }
        if s.row_expires.is_some_and(|e| e <= s.now) {
            actions.push(Action::Cleanup);
        }
        if s.refused_late && s.admission.is_none() {
            actions.push(Action::AdmitLate);
        }
    }

    fn next_state(&self, last: &WindowState, action: Action) -> Option<WindowState> {
        let mut s = last.clone();
        match action {
            Action::Deliver => {
                s.deliveries -= 1;
                self.deliver(&mut s);
            }
            Action::Tick(d) => {
                s.ticks -= 1;
                s.now += d;
            }
            Action::Cleanup => s.row_expires = None,
            Action::AdmitLate => s.admission = Some(false),
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(NO_DUPLICATE_APPLIED, |_, s: &WindowState| !s.repeated),
            Property::sometimes("an event is applied", |_, s: &WindowState| s.applied == 1),
            Property::sometimes("a late admission of a refused event is applied", |_, s: &WindowState| {
                s.admission == Some(true) && s.applied == 1
            }),
            Property::sometimes("a late admission finds the row of an earlier application", |_, s: &WindowState| {
                s.admission == Some(true) && s.applied == 1 && s.refused_late
            }),
            Property::sometimes("a row is cleaned up and the event refused later", |_, s: &WindowState| {
                s.applied == 1 && s.row_expires.is_none() && s.refused_late
            }),
        ]
    }
}

/// No delivery applies the event again while anything could know it was applied: every admitted duplicate
/// meets its row, and a late admission never re-applies an event whose row still exists. (Only an operator
/// admitting an event whose row was already cleaned up re-applies it: that is what `--admit-late` means.)
pub const NO_DUPLICATE_APPLIED: &str = "no duplicate applied while the event's row could tell";

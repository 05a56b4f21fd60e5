//! A clock the test moves.

use std::sync::Mutex;

use chrono::{DateTime, Utc};
use idem_ports::Clock;

/// The system clock moved by an offset the test changes while the code under test runs (give it as the
/// `Clock` of the layer, the runner or the cleaner).
#[derive(Debug, Default)]
pub struct ShiftedClock {
    offset: Mutex<chrono::Duration>,
}

impl ShiftedClock {
    /// The system clock, not shifted yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock `by` further (negative: back).
    pub fn advance(&self, by: chrono::Duration) {
        *self.offset.lock().unwrap_or_else(|p| p.into_inner()) += by;
    }
}

impl Clock for ShiftedClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now() + *self.offset.lock().unwrap_or_else(|p| p.into_inner())
    }
}

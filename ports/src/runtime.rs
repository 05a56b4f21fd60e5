use chrono::{DateTime, Utc};
use uuid::Uuid;

/// The source of time. The domain never reads the wall clock itself.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait Clock: Send + Sync {
    fn now(&self) -> DateTime<Utc>;
}

/// The source of new identifiers: UUID v7 (time-ordered, so b-tree inserts stay on the right edge and the
/// creation time can be read back from the id).
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait IdGenerator: Send + Sync {
    fn new_id(&self) -> Uuid;
}

/// [`Clock`] reading the system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)] // the one place the wall clock is read
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// [`IdGenerator`] producing UUID v7 values.
#[derive(Debug, Clone, Copy, Default)]
pub struct UuidV7Generator;

impl IdGenerator for UuidV7Generator {
    #[allow(clippy::disallowed_methods)] // the one place ids are generated
    fn new_id(&self) -> Uuid {
        Uuid::now_v7()
    }
}

//! The operator's subcommands: `idem dlq` (`dlq.rs`), `idem outbox` (`outbox.rs`), `idem keys` (`keys.rs`).
//! A readable table by default, `--json` for scripts; progress on long work (a bar in a terminal, plain lines
//! otherwise): the terminal output of all of them is `output.rs`.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use idem_kafka::consumer::OLDER_THAN_DEDUP_WINDOW;
use idem_kafka::dlq::{self, DeadLetterMessage};
use idem_ports::{Clock, SystemClock};
use idem_postgres::operations::{KeyRecord, OutboxFilter, OutboxRow, Redrive};
use serde_json::json;
use uuid::Uuid;

use crate::config::{DbArgs, KafkaArgs, OrdersArgs, parse_duration};

/// How long reading the dead-letter topic may take.
const READ_TIMEOUT: Duration = Duration::from_secs(60);

mod dlq_cmd;
mod keys;
mod outbox;
mod output;

pub use dlq_cmd::{DlqCommand, dlq};
pub use keys::{KeysCommand, keys};
pub use outbox::{OutboxCommand, outbox};
pub use output::Progress;
use output::untrusted;
use output::{print_json, print_table, say, short, time};

/// A position in the dead-letter topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub partition: i32,
    pub offset: i64,
}

impl std::str::FromStr for Position {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (p, o) = s.split_once(':').ok_or("expected partition:offset")?;
        Ok(Self {
            partition: p.parse().map_err(|_| format!("bad partition {p:?}"))?,
            offset: o.parse().map_err(|_| format!("bad offset {o:?}"))?,
        })
    }
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.partition, self.offset)
    }
}

fn position(m: &DeadLetterMessage) -> Position {
    Position { partition: m.partition, offset: m.offset }
}

/// RFC 3339, or a duration meaning "that long ago".
fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    let ago = parse_duration(s).map_err(|_| format!("{s:?} is neither an RFC 3339 time nor a duration"))?;
    Ok(SystemClock.now() - chrono::Duration::from_std(ago).map_err(|e| e.to_string())?)
}

/// Prints a reconciliation's report; `true` when nothing is left for an operator.
pub fn print_reconciliation(since: chrono::DateTime<chrono::Utc>, report: &idem_http::reconcile::Report) -> bool {
    say(&format!(
        "since {}: {} provider charges, {} refunds, {} payments captured through the provider",
        since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        report.charges,
        report.refunds,
        report.payments
    ));
    let rows: Vec<Vec<String>> = report
        .findings
        .iter()
        .map(|f| {
            vec![
                f.kind.as_str().to_owned(),
                f.payment.map_or_else(|| "-".to_owned(), |p| p.to_string()),
                untrusted(f.provider_id.as_deref().unwrap_or("-").as_bytes(), false),
                untrusted(f.detail.as_bytes(), false),
            ]
        })
        .collect();
    print_table(&["finding", "payment", "provider id", "detail"], &rows);
    let left = report.findings.iter().filter(|f| !f.kind.repaired()).count();
    say(&format!("{} repaired, {left} for an operator", report.findings.len() - left));
    left == 0
}

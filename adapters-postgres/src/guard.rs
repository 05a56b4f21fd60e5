//! The settings dedup and idempotency depend on, checked against what earlier starts recorded (table
//! `idem_setting`). Every consumer runner checks its own before it consumes
//! ([`TransactionManager::check_consumer`](idem_ports::TransactionManager::check_consumer)); a service's
//! idempotency layer records its retention with [`PgStore::check_idempotency_ttl`].
//!
//! Changing some settings silently re-opens what was already processed:
//!
//! | change | what would happen | here |
//! | --- | --- | --- |
//! | the dedup storage switched (or mixed in a rolling deploy) | the other storage's rows are not read: every event processed in the last dedup retention is applied again when redelivered | refused; accepting `dedup-storage` records it deliberately |
//! | the consumer group renamed for the same topic | the new group has no processed rows and starts from the earliest offset: every event still in the topic is applied again | refused; accepting `consumer-group` after copying the old group's rows (README) |
//! | a retention raised | rows written under the old retention expire sooner than the new age rules assume | handled: the raise is recorded and returned while it matters, so the age rules keep the old limits for ids and keys dated before it (`TtlPolicy::raised_from`) |
//! | a retention lowered | nothing: rows already written outlive the new rules | recorded |
//!
//! `idem serve` takes the accepted changes from `IDEM_ACCEPT_SETTING_CHANGE`, a service on the toolkit from
//! `RunnerSettings::accept_setting_changes`. Renaming a merchant (the scope of its keys) cannot be told from
//! adding one and is documented instead.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idem_ports::{ConsumerIdentity, RetentionRaise, SettingsCheckError, StoreError};

use crate::operations::RecordedSetting;
use crate::{DedupStorage, PgStore};

fn hours(d: Duration) -> String {
    format!("{}h", d.as_secs() / 3600)
}

fn parse_hours(v: &str) -> Option<Duration> {
    v.strip_suffix('h')?.parse::<u64>().ok().map(|h| Duration::from_secs(h * 3600))
}

fn storage_name(storage: DedupStorage) -> &'static str {
    match storage {
        DedupStorage::Table => "table",
        DedupStorage::Partitioned => "partitioned",
    }
}

fn set(name: String, value: String, previous: Option<String>, now: DateTime<Utc>) -> RecordedSetting {
    RecordedSetting { name, value, previous, changed_at: now }
}

/// A retention checked against its record: what to write, and the raise in effect.
fn retention(
    recorded: Option<&RecordedSetting>,
    name: String,
    want: Duration,
    now: DateTime<Utc>,
) -> (Option<RecordedSetting>, Option<RetentionRaise>) {
    match recorded {
        // unchanged: a raise recorded earlier holds while it matters
        Some(s) if parse_hours(&s.value) == Some(want) => {
            let raise = s.previous.as_deref().and_then(parse_hours).filter(|from| *from < want);
            (None, raise.map(|from| RetentionRaise { from, since: s.changed_at }))
        }
        Some(s) => {
            let from = parse_hours(&s.value);
            let raised = from.is_some_and(|f| f < want);
            // a raise during an earlier raise keeps the smallest retention still relevant
            let base = match (s.previous.as_deref().and_then(parse_hours), from) {
                (Some(p), Some(f)) if p < f => Some(p),
                (_, f) => f,
            };
            let write = set(name, hours(want), if raised { base.map(hours) } else { None }, now);
            match (raised, base) {
                (true, Some(from)) => {
                    tracing::warn!(setting = %write.name, from = %s.value, to = %hours(want), "retention raised: ids and keys dated before now keep the old limits until they no longer matter");
                    (Some(write), Some(RetentionRaise { from, since: now }))
                }
                _ => (Some(write), None),
            }
        }
        None => (Some(set(name, hours(want), None, now)), None),
    }
}

/// The consumer's settings against the records: the refusal, or what to write and the raise in effect.
fn check_consumer(
    recorded: &[RecordedSetting],
    c: &ConsumerIdentity,
    storage: &str,
) -> Result<(Vec<RecordedSetting>, Option<RetentionRaise>), String> {
    let find = |name: &str| recorded.iter().find(|s| s.name == name);
    let accepted = |what: &str| c.accept.iter().any(|a| a == what);
    let mut writes = Vec::new();

    let name = format!("dedup_storage/{}", c.group);
    match find(&name) {
        Some(s) if s.value != storage && !accepted("dedup-storage") => {
            return Err(format!(
                "DEDUP_STORAGE changed from {old} to {storage} for consumer group {group}: the events it processed in the \
                 last DEDUP_TTL are recorded in the {old} storage, which {storage} mode does not read, so each would be \
                 applied again when redelivered. Keep DEDUP_STORAGE={old}; or stop every instance of the group, let \
                 DEDUP_TTL pass with no redelivery possible (or accept the risk), then start with \
                 IDEM_ACCEPT_SETTING_CHANGE=dedup-storage (a service on the toolkit: \
                 RunnerSettings::accept_setting_changes)",
                old = s.value,
                group = c.group,
            ));
        }
        Some(s) if s.value == storage => {}
        _ => writes.push(set(name, storage.to_owned(), None, c.now)),
    }

    let name = format!("consumer_group/{}", c.topic);
    match find(&name) {
        Some(s) if s.value != c.group && !accepted("consumer-group") => {
            return Err(format!(
                "KAFKA_GROUP_ID changed from {old} to {group} for topic {topic}: group {group} has no processed-event \
                 rows and starts from the earliest offset, so every event still in {topic} would be applied again. Keep \
                 KAFKA_GROUP_ID={old}; or copy the old group's dedup rows first (README, \"Changing settings\") and \
                 start with IDEM_ACCEPT_SETTING_CHANGE=consumer-group (a service on the toolkit: \
                 RunnerSettings::accept_setting_changes)",
                old = s.value,
                group = c.group,
                topic = c.topic,
            ));
        }
        Some(s) if s.value == c.group => {}
        _ => writes.push(set(name, c.group.clone(), None, c.now)),
    }

    let name = format!("dedup_ttl/{}", c.group);
    let (write, raise) = retention(find(&name), name, c.dedup_ttl, c.now);
    writes.extend(write);
    Ok((writes, raise))
}

impl PgStore {
    /// [`TransactionManager::check_consumer`](idem_ports::TransactionManager::check_consumer) on this
    /// store's dedup storage (see the module docs).
    pub async fn check_consumer_settings(
        &self,
        consumer: &ConsumerIdentity,
    ) -> Result<Option<RetentionRaise>, SettingsCheckError> {
        let recorded = self.settings().await?;
        let (writes, raise) = check_consumer(&recorded, consumer, storage_name(self.dedup_storage()))
            .map_err(SettingsCheckError::Refused)?;
        for w in &writes {
            self.record_setting(w).await?;
        }
        Ok(raise)
    }

    /// Records the idempotency layer's retention (`IDEMPOTENCY_TTL`) and returns the raise in effect, if
    /// any: give it to the layer's policy (`TtlPolicy::raised_from`), so keys dated before a raise keep the
    /// old limit while records of the old retention may exist.
    pub async fn check_idempotency_ttl(
        &self,
        ttl: Duration,
        now: DateTime<Utc>,
    ) -> Result<Option<RetentionRaise>, StoreError> {
        let recorded = self.settings().await?;
        let name = "idempotency_ttl".to_owned();
        let (write, raise) = retention(recorded.iter().find(|s| s.name == name), name, ttl, now);
        if let Some(w) = write {
            self.record_setting(&w).await?;
        }
        Ok(raise)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(group: &str, accept: &[&str]) -> ConsumerIdentity {
        ConsumerIdentity {
            group: group.into(),
            topic: "bonus".into(),
            dedup_ttl: Duration::from_secs(72 * 3600),
            accept: accept.iter().map(|a| (*a).to_owned()).collect(),
            now: DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default(),
        }
    }

    #[test]
    fn a_rename_or_a_storage_switch_is_refused_unless_accepted() {
        let (first, _) = check_consumer(&[], &identity("wallet", &[]), "table").unwrap_or_default();
        assert_eq!(first.len(), 3, "storage, group and retention recorded");
        let err = check_consumer(&first, &identity("wallet-v2", &[]), "table").expect_err("rename refused");
        assert!(err.starts_with("KAFKA_GROUP_ID changed from wallet to wallet-v2 for topic bonus"), "{err}");
        assert!(check_consumer(&first, &identity("wallet-v2", &["consumer-group"]), "table").is_ok());
        let err = check_consumer(&first, &identity("wallet", &[]), "partitioned").expect_err("switch refused");
        assert!(err.starts_with("DEDUP_STORAGE changed from table to partitioned"), "{err}");
        let (again, raise) = check_consumer(&first, &identity("wallet", &[]), "table").unwrap_or_default();
        assert!(again.is_empty() && raise.is_none(), "nothing changed: {again:?}");
    }
}

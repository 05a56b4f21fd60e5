//! The settings dedup and idempotency depend on, checked against what the last start recorded.
//!
//! Changing some settings silently re-opens what was already processed:
//!
//! | change | what would happen | here |
//! | --- | --- | --- |
//! | `DEDUP_STORAGE` switched (or mixed in a rolling deploy) | the other storage's rows are not read: every event processed in the last `DEDUP_TTL` is applied again when redelivered | refused; `IDEM_ACCEPT_SETTING_CHANGE=dedup-storage` records it deliberately |
//! | `KAFKA_GROUP_ID` renamed for the same topic | the new group has no processed rows and starts from the earliest offset: every event still in the topic is applied again | refused; `IDEM_ACCEPT_SETTING_CHANGE=consumer-group` after copying the old group's rows (README) |
//! | `DEDUP_TTL` or `IDEMPOTENCY_TTL` raised | rows written under the old retention expire sooner than the new age rules assume | handled: the raise is recorded and the age rules keep the old limits for ids and keys dated before it (`TtlPolicy::raised_from`), until that no longer matters |
//! | a retention lowered | nothing: rows already written outlive the new rules | recorded |
//!
//! Renaming a merchant (the scope of its keys) cannot be told from adding one and is documented instead.

use anyhow::bail;
use chrono::{DateTime, Utc};
use idem_domain::TtlPolicy;
use idem_postgres::PgStore;
use idem_postgres::operations::RecordedSetting;

/// What a start may run with.
#[derive(Debug, Clone, Copy)]
pub struct Checked {
    /// `DEDUP_TTL`, with its raise while it matters.
    pub dedup_ttl: TtlPolicy,
    /// `IDEMPOTENCY_TTL`, with its raise while it matters.
    pub idempotency_ttl: TtlPolicy,
}

/// The settings of one start.
#[derive(Debug, Clone)]
pub struct Wanted<'a> {
    pub group: &'a str,
    pub topic: &'a str,
    pub dedup_storage: &'a str,
    pub dedup_ttl: TtlPolicy,
    pub idempotency_ttl: TtlPolicy,
    /// Changes the operator accepts deliberately (`dedup-storage`, `consumer-group`).
    pub accept: &'a [String],
}

fn hours(d: std::time::Duration) -> String {
    format!("{}h", d.as_secs() / 3600)
}

fn parse_hours(v: &str) -> Option<std::time::Duration> {
    v.strip_suffix('h')?.parse::<u64>().ok().map(|h| std::time::Duration::from_secs(h * 3600))
}

/// Checks `wanted` against the recorded settings, records the new ones, and returns the retentions to run
/// with. Refuses (an error naming what would be re-applied and how to proceed) an unsafe change.
pub async fn check(store: &PgStore, wanted: &Wanted<'_>, now: DateTime<Utc>) -> anyhow::Result<Checked> {
    let recorded = store.settings().await?;
    let find = |name: &str| recorded.iter().find(|s| s.name == name);
    let accepted = |what: &str| wanted.accept.iter().any(|a| a == what);
    let set = |name: String, value: String, previous: Option<String>| RecordedSetting {
        name,
        value,
        previous,
        changed_at: now,
    };
    let mut writes = Vec::new();

    let storage_name = format!("dedup_storage/{}", wanted.group);
    match find(&storage_name) {
        Some(s) if s.value != wanted.dedup_storage && !accepted("dedup-storage") => bail!(
            "DEDUP_STORAGE changed from {} to {} for consumer group {}: the events it processed in the last DEDUP_TTL \
             are recorded in the {} storage, which {} mode does not read, so each would be applied again when \
             redelivered. Keep DEDUP_STORAGE={}; or stop every instance of the group, let DEDUP_TTL pass with no \
             redelivery possible (or accept the risk), then start with IDEM_ACCEPT_SETTING_CHANGE=dedup-storage",
            s.value,
            wanted.dedup_storage,
            wanted.group,
            s.value,
            wanted.dedup_storage,
            s.value
        ),
        Some(s) if s.value == wanted.dedup_storage => {}
        _ => writes.push(set(storage_name, wanted.dedup_storage.to_owned(), None)),
    }

    let group_name = format!("consumer_group/{}", wanted.topic);
    match find(&group_name) {
        Some(s) if s.value != wanted.group && !accepted("consumer-group") => bail!(
            "KAFKA_GROUP_ID changed from {} to {} for topic {}: group {} has no processed-event rows and starts \
             from the earliest offset, so every event still in {} would be applied again. Keep KAFKA_GROUP_ID={}; \
             or copy the old group's dedup rows first (README, \"Changing settings\") and start with \
             IDEM_ACCEPT_SETTING_CHANGE=consumer-group",
            s.value,
            wanted.group,
            wanted.topic,
            wanted.group,
            wanted.topic,
            s.value
        ),
        Some(s) if s.value == wanted.group => {}
        _ => writes.push(set(group_name, wanted.group.to_owned(), None)),
    }

    let mut retention = |name: String, want: TtlPolicy| -> TtlPolicy {
        match find(&name) {
            // unchanged: a raise recorded earlier holds while it matters
            Some(s) if parse_hours(&s.value) == Some(want.ttl()) => match s.previous.as_deref().and_then(parse_hours) {
                Some(from) => want.raised_from(from, s.changed_at),
                None => want,
            },
            Some(s) => {
                let from = parse_hours(&s.value);
                let raised = from.is_some_and(|f| f < want.ttl());
                // a raise during an earlier raise keeps the smallest retention still relevant
                let base = match (s.previous.as_deref().and_then(parse_hours), from) {
                    (Some(p), Some(f)) if p < f => Some(p),
                    (_, f) => f,
                };
                writes.push(set(name, hours(want.ttl()), if raised { base.map(hours) } else { None }));
                match (raised, base) {
                    (true, Some(b)) => {
                        tracing::warn!(from = %s.value, to = %hours(want.ttl()), "retention raised: ids and keys dated before now keep the old limits until they no longer matter");
                        want.raised_from(b, now)
                    }
                    _ => want,
                }
            }
            None => {
                writes.push(set(name, hours(want.ttl()), None));
                want
            }
        }
    };
    let dedup_ttl = retention(format!("dedup_ttl/{}", wanted.group), wanted.dedup_ttl);
    let idempotency_ttl = retention("idempotency_ttl".to_owned(), wanted.idempotency_ttl);
    for w in &writes {
        store.record_setting(w).await?;
    }
    Ok(Checked { dedup_ttl, idempotency_ttl })
}

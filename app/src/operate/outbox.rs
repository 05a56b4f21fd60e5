//! `idem outbox list|retry`.

use super::*;

#[derive(Debug, Subcommand)]
pub enum OutboxCommand {
    /// List quarantined rows, or rows unpublished for longer than `--stuck-for`.
    List(OutboxListArgs),
    /// Release rows for new attempts (a quarantined row's attempts start again).
    Retry(OutboxRetryArgs),
}

#[derive(Debug, Args)]
pub struct OutboxListArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Only quarantined rows.
    #[arg(long, conflicts_with = "stuck_for")]
    pub quarantined: bool,
    /// Unpublished rows older than this (default 1m).
    #[arg(long, value_parser = parse_duration)]
    pub stuck_for: Option<Duration>,
    #[arg(long, default_value_t = 100)]
    pub limit: i64,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct OutboxRetryArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Outbox row ids.
    #[arg(required = true)]
    pub ids: Vec<Uuid>,
    /// The receivers' dedup retention: a row whose `event_id` is older than it less 1 h is refused by
    /// every idem receiver (`older-than-dedup-window`), and `retry` warns about it.
    #[arg(long, env = "DEDUP_TTL", default_value = "72h", value_parser = crate::config::parse_ttl)]
    pub dedup_ttl: idem_domain::TtlPolicy,
    #[arg(long)]
    pub json: bool,
}

fn outbox_json(r: &OutboxRow) -> serde_json::Value {
    json!({
        "id": r.id, "topic": r.topic, "key": r.key, "type": r.event_type, "created_at": r.created_at,
        "attempts": r.attempts, "last_error": r.last_error, "quarantined_at": r.quarantined_at,
    })
}

pub async fn outbox(command: OutboxCommand) -> anyhow::Result<()> {
    match command {
        OutboxCommand::List(args) => {
            let store = crate::connect(&args.db).await?;
            let filter = if args.quarantined {
                OutboxFilter::Quarantined
            } else {
                let stuck = args.stuck_for.unwrap_or(Duration::from_secs(60));
                OutboxFilter::UnpublishedBefore(SystemClock.now() - chrono::Duration::from_std(stuck)?)
            };
            let rows = store.outbox_rows(filter, args.limit).await?;
            if args.json {
                print_json(&json!(rows.iter().map(outbox_json).collect::<Vec<_>>()));
            } else {
                let table: Vec<Vec<String>> = rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.id.to_string(),
                            r.topic.clone(),
                            short(&r.key, 40),
                            r.event_type.clone(),
                            time(Some(r.created_at)),
                            r.attempts.to_string(),
                            time(r.quarantined_at),
                            short(&untrusted(r.last_error.as_deref().unwrap_or("-").as_bytes(), false), 60),
                        ]
                    })
                    .collect();
                print_table(
                    &["ID", "TOPIC", "KEY", "TYPE", "CREATED", "ATTEMPTS", "QUARANTINED", "LAST ERROR"],
                    &table,
                );
            }
            Ok(())
        }
        OutboxCommand::Retry(args) => {
            let store = crate::connect(&args.db).await?;
            let released = store.retry_outbox(&args.ids).await?;
            let missing: Vec<&Uuid> = args.ids.iter().filter(|id| !released.contains(id)).collect();
            // its event_id carries its commit time: past the receivers' admission floor it is dead-lettered
            let now = SystemClock.now();
            let too_old: Vec<&Uuid> = released
                .iter()
                .filter(|id| {
                    args.dedup_ttl.admission(now, idem_domain::uuid_v7_time(**id)) == idem_domain::Admission::TooOld
                })
                .collect();
            if args.json {
                print_json(
                    &json!({"released": released, "not_found_or_published": missing, "older_than_dedup_window": too_old}),
                );
            } else {
                say(&format!("released {} rows for new attempts", released.len()));
                for id in &missing {
                    say(&format!("  {id}: not found or already published"));
                }
                for id in &too_old {
                    say(&format!(
                        "  warning: {id} was committed longer ago than DEDUP_TTL less 1 h: idem receivers will dead-letter it as older-than-dedup-window (re-drive it there with --admit-late if it must be applied)"
                    ));
                }
            }
            anyhow::ensure!(missing.is_empty(), "{} ids were not unpublished outbox rows", missing.len());
            Ok(())
        }
    }
}

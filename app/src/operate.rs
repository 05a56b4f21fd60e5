//! The operator's subcommands: `idem dlq`, `idem outbox`, `idem keys`. A readable table by default,
//! `--json` for scripts; progress on long work (a bar in a terminal, plain lines otherwise).

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

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead letters (filters combine), with a summary by reason.
    List(DlqListArgs),
    /// Show one dead letter with its provenance headers.
    Show(DlqShowArgs),
    /// Re-drive dead letters to their source topic with their original event_id and headers.
    Redrive(DlqRedriveArgs),
}

#[derive(Debug, Clone, Args)]
pub struct Topics {
    #[command(flatten)]
    pub kafka: KafkaArgs,
    #[command(flatten)]
    pub orders: OrdersArgs,
}

#[derive(Debug, Clone, Args)]
pub struct DlqFilter {
    /// Only this reason (`malformed`, `rejected`, `older-than-dedup-window`, …).
    #[arg(long)]
    pub reason: Option<String>,
    /// Only dead letters of this source topic.
    #[arg(long)]
    pub source_topic: Option<String>,
    /// Only those that failed at or after this time (RFC 3339) or this long ago (`2h`).
    #[arg(long, value_parser = parse_time)]
    pub since: Option<DateTime<Utc>>,
    /// Only those that failed before this time (RFC 3339) or this long ago.
    #[arg(long, value_parser = parse_time)]
    pub until: Option<DateTime<Utc>>,
}

impl DlqFilter {
    fn matches(&self, m: &DeadLetterMessage) -> bool {
        self.reason.as_ref().is_none_or(|r| *r == m.reason())
            && self.source_topic.as_ref().is_none_or(|t| Some(t) == m.source_topic().as_ref())
            && self.since.is_none_or(|t| m.failed_at().is_some_and(|at| at >= t))
            && self.until.is_none_or(|t| m.failed_at().is_some_and(|at| at < t))
    }
}

#[derive(Debug, Args)]
pub struct DlqListArgs {
    #[command(flatten)]
    pub topics: Topics,
    #[command(flatten)]
    pub filter: DlqFilter,
    /// Most rows listed (the summary counts all).
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DlqShowArgs {
    #[command(flatten)]
    pub topics: Topics,
    /// `partition:offset` in the dead-letter topic, as `idem dlq list` prints it.
    pub position: Position,
    /// Also print the payload.
    #[arg(long)]
    pub payload: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("selection").required(true).multiple(true).args(["ids", "all_matching"])))]
pub struct DlqRedriveArgs {
    #[command(flatten)]
    pub topics: Topics,
    #[command(flatten)]
    pub db: DbArgs,
    /// Dead letters to re-drive (`partition:offset`, repeatable).
    #[arg(long = "id")]
    pub ids: Vec<Position>,
    /// Re-drive every dead letter matching the filters (for example a whole `--reason` group).
    #[arg(long)]
    pub all_matching: bool,
    #[command(flatten)]
    pub filter: DlqFilter,
    /// Admit events refused as older than the dedup window: each is then applied at most once.
    #[arg(long)]
    pub admit_late: bool,
    /// Who re-drives (recorded); default `$USER`.
    #[arg(long)]
    pub by: Option<String>,
    /// Re-drive to this topic. Default: the consumer's own topic (`KAFKA_ORDERS_TOPIC`); a dead letter
    /// whose source is another topic is skipped unless that topic is named here.
    #[arg(long)]
    pub to_topic: Option<String>,
    /// Show what would be re-driven, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long)]
    pub json: bool,
}

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

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// What idem stored for one Idempotency-Key of one merchant.
    Show(KeysShowArgs),
}

#[derive(Debug, Args)]
pub struct KeysShowArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The merchant (the key's scope).
    #[arg(long)]
    pub merchant: String,
    /// The Idempotency-Key, as the client sent it (bare form).
    #[arg(long)]
    pub key: String,
    /// Also print the stored response body.
    #[arg(long)]
    pub body: bool,
    #[arg(long)]
    pub json: bool,
}

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

/// Progress of long work: a bar when stderr is a terminal, a plain line every `every` items otherwise.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    label: &'static str,
    done: u64,
    every: u64,
}

impl Progress {
    pub fn new(label: &'static str, total: Option<u64>, every: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = match total {
                Some(n) => indicatif::ProgressBar::new(n),
                None => indicatif::ProgressBar::new_spinner(),
            };
            let style = indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
            bar.set_style(style.progress_chars("=> "));
            bar.set_message(label);
            bar
        });
        Self { bar, label, done: 0, every: every.max(1) }
    }

    pub fn set(&mut self, done: u64) {
        if let Some(bar) = &self.bar {
            bar.set_position(done);
        } else if done / self.every > self.done / self.every {
            eprintln!("{}: {done}", self.label);
        }
        self.done = done;
    }

    pub fn inc(&mut self) {
        self.set(self.done + 1);
    }

    pub fn finish(self) {
        match self.bar {
            Some(bar) => bar.finish_and_clear(),
            None => eprintln!("{}: {} done", self.label, self.done),
        }
    }
}

fn print_json(value: &serde_json::Value) {
    #[allow(clippy::print_stdout)] // the command's output
    {
        println!("{}", serde_json::to_string_pretty(value).unwrap_or_default());
    }
}

/// A table with aligned columns.
fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let text: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        text.join("  ").trim_end().to_owned()
    };
    #[allow(clippy::print_stdout)] // the command's output
    {
        println!("{}", line(header.iter().map(|h| (*h).to_owned()).collect()));
        for row in rows {
            println!("{}", line(row.clone()));
        }
    }
}

fn say(text: &str) {
    #[allow(clippy::print_stdout)] // the command's output
    {
        println!("{text}");
    }
}

fn short(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        format!("{}…", text.chars().take(max).collect::<String>())
    }
}

fn time(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)).unwrap_or_else(|| "-".into())
}

async fn read_dlq(topics: &Topics, label: &'static str) -> anyhow::Result<Vec<DeadLetterMessage>> {
    let (cluster, topic) = (topics.kafka.connection()?, topics.orders.dlq_topic());
    tokio::task::spawn_blocking(move || {
        let mut progress = Progress::new(label, None, 1000);
        let read = dlq::read_all(&cluster, &topic, READ_TIMEOUT, |_| progress.inc());
        progress.finish();
        read.with_context(|| format!("reading {topic}"))
    })
    .await?
}

fn dead_letter_json(m: &DeadLetterMessage, payload: bool) -> serde_json::Value {
    let headers: BTreeMap<&str, String> =
        m.headers.iter().map(|(k, v)| (k.as_str(), String::from_utf8_lossy(v).into_owned())).collect();
    let mut v = json!({
        "position": position(m).to_string(),
        "reason": m.reason(),
        "source_topic": m.source_topic(),
        "failed_at": m.failed_at(),
        "event_id": m.event_id(),
        "key": m.key.as_ref().map(|k| String::from_utf8_lossy(k).into_owned()),
        "headers": headers,
        "payload_bytes": m.payload.len(),
    });
    if payload {
        v["payload"] = json!(String::from_utf8_lossy(&m.payload));
    }
    v
}

pub async fn dlq(command: DlqCommand) -> anyhow::Result<()> {
    match command {
        DlqCommand::List(args) => dlq_list(args).await,
        DlqCommand::Show(args) => dlq_show(args).await,
        DlqCommand::Redrive(args) => dlq_redrive(args).await,
    }
}

/// Count, first and last failure time of one reason.
type ReasonSummary = (usize, Option<DateTime<Utc>>, Option<DateTime<Utc>>);

async fn dlq_list(args: DlqListArgs) -> anyhow::Result<()> {
    let all = read_dlq(&args.topics, "reading dead letters").await?;
    let matching: Vec<&DeadLetterMessage> = all.iter().filter(|m| args.filter.matches(m)).collect();
    let mut by_reason: BTreeMap<String, ReasonSummary> = BTreeMap::new();
    for m in &matching {
        let e = by_reason.entry(m.reason()).or_default();
        e.0 += 1;
        let at = m.failed_at();
        e.1 = match (e.1, at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        e.2 = e.2.max(at);
    }
    if args.json {
        let summary: Vec<_> = by_reason
            .iter()
            .map(|(r, (n, first, last))| json!({"reason": r, "count": n, "first": first, "last": last}))
            .collect();
        let rows: Vec<_> = matching.iter().take(args.limit).map(|m| dead_letter_json(m, false)).collect();
        print_json(
            &json!({"topic": args.topics.orders.dlq_topic(), "total": matching.len(), "by_reason": summary, "dead_letters": rows}),
        );
        return Ok(());
    }
    say(&format!("{} dead letters in {} match", matching.len(), args.topics.orders.dlq_topic()));
    let summary: Vec<Vec<String>> = by_reason
        .iter()
        .map(|(r, (n, first, last))| vec![r.clone(), n.to_string(), time(*first), time(*last)])
        .collect();
    print_table(&["REASON", "COUNT", "FIRST", "LAST"], &summary);
    say("");
    let rows: Vec<Vec<String>> = matching
        .iter()
        .take(args.limit)
        .map(|m| {
            vec![
                position(m).to_string(),
                time(m.failed_at()),
                m.reason(),
                m.source_topic().unwrap_or_default(),
                m.event_id().map(|e| e.to_string()).unwrap_or_else(|| "-".into()),
                short(&m.header(idem_domain::wire::headers::dlq::ERROR).unwrap_or_default(), 60),
            ]
        })
        .collect();
    print_table(&["POSITION", "FAILED AT", "REASON", "SOURCE", "EVENT ID", "ERROR"], &rows);
    Ok(())
}

async fn dlq_show(args: DlqShowArgs) -> anyhow::Result<()> {
    let all = read_dlq(&args.topics, "reading dead letters").await?;
    let m = all
        .iter()
        .find(|m| position(m) == args.position)
        .with_context(|| format!("no dead letter at {} in {}", args.position, args.topics.orders.dlq_topic()))?;
    if args.json {
        print_json(&dead_letter_json(m, args.payload));
        return Ok(());
    }
    let mut rows = vec![
        vec!["position".to_owned(), position(m).to_string()],
        vec!["key".to_owned(), m.key.as_ref().map(|k| String::from_utf8_lossy(k).into_owned()).unwrap_or_default()],
        vec!["payload".to_owned(), format!("{} bytes", m.payload.len())],
    ];
    rows.extend(m.headers.iter().map(|(k, v)| vec![k.clone(), String::from_utf8_lossy(v).into_owned()]));
    print_table(&["FIELD", "VALUE"], &rows);
    if args.payload {
        say(&String::from_utf8_lossy(&m.payload));
    }
    Ok(())
}

/// The next batch of `reader` (off the async workers); empty at the end.
async fn next_dead_letters(reader: dlq::Reader) -> anyhow::Result<(dlq::Reader, Vec<DeadLetterMessage>)> {
    tokio::task::spawn_blocking(move || {
        let mut reader = reader;
        let batch = reader.next_batch(500).context("reading dead letters");
        batch.map(|b| (reader, b))
    })
    .await?
}

async fn dlq_redrive(args: DlqRedriveArgs) -> anyhow::Result<()> {
    let dlq_topic = args.topics.orders.dlq_topic();
    let select =
        |m: &DeadLetterMessage| (args.ids.is_empty() || args.ids.contains(&position(m))) && args.filter.matches(m);
    let cluster = args.topics.kafka.connection()?;
    let mut reader = {
        let (cluster, topic) = (cluster.clone(), dlq_topic.clone());
        tokio::task::spawn_blocking(move || dlq::Reader::open(&cluster, &topic, READ_TIMEOUT))
            .await?
            .with_context(|| format!("reading {dlq_topic}"))?
    };
    // `--id`: every id must exist before anything changes (only those messages are kept). Otherwise the
    // topic is streamed: re-driven batch by batch, never held in memory whole.
    let mut chosen = Vec::new();
    if !args.ids.is_empty() {
        loop {
            let (r, batch) = next_dead_letters(reader).await?;
            reader = r;
            if batch.is_empty() {
                break;
            }
            chosen.extend(batch.into_iter().filter(|m| select(m)));
        }
        if let Some(missing) = args.ids.iter().find(|p| !chosen.iter().any(|m| position(m) == **p)) {
            anyhow::bail!("no dead letter at {missing} in {dlq_topic} matching the filters");
        }
    }
    let store = crate::connect(&args.db).await?;
    store.migrate_reference().await.context("applying migrations")?;
    let by = args.by.clone().or_else(|| std::env::var("USER").ok()).unwrap_or_else(|| "unknown".into());
    let producer: rdkafka::producer::FutureProducer =
        idem_kafka::ProducerSettings::new(&cluster).client_config().create()?;
    let target = args.to_topic.as_deref().unwrap_or(&args.topics.orders.orders_topic);
    let consumer_of = |m: &DeadLetterMessage| m.consumer_group().unwrap_or_else(|| args.topics.orders.group_id.clone());
    let (mut redriven, mut skipped, mut failed) = (Vec::new(), Vec::new(), Vec::new());
    let mut progress = Progress::new("re-driving", (!args.ids.is_empty()).then_some(chosen.len() as u64), 100);
    loop {
        let batch: Vec<DeadLetterMessage> = if args.ids.is_empty() {
            let (r, batch) = next_dead_letters(reader).await?;
            reader = r;
            if batch.is_empty() {
                break;
            }
            batch.into_iter().filter(|m| select(m)).collect()
        } else if chosen.is_empty() {
            break;
        } else {
            std::mem::take(&mut chosen)
        };
        for m in &batch {
            let pos = position(m);
            let late = m.reason() == OLDER_THAN_DEDUP_WINDOW;
            let skip = |why: &str| json!({"position": pos.to_string(), "event_id": m.event_id(), "why": why});
            if late && !args.admit_late {
                skipped.push(skip("older than the dedup window: needs --admit-late (then applied at most once)"));
            } else if m.source_topic().is_none() {
                skipped.push(skip("no dlq.original.topic header"));
            } else if m.source_topic().as_deref() != Some(target) && args.to_topic.is_none() {
                skipped.push(skip(&format!(
                "its source topic is not {target}, the topic this consumer reads: name a topic with --to-topic to re-drive it there"
            )));
            } else if store.redriven(&dlq_topic, pos.partition, pos.offset).await? {
                skipped.push(skip("re-driven already"));
            } else if let (true, Some(id)) = (late, m.event_id())
                && store.processed_anywhere(&consumer_of(m), id).await?
            {
                skipped.push(skip(
                    "applied already: its processed-event row still exists (a re-drive would be a duplicate)",
                ));
            } else if args.dry_run {
                redriven.push(json!({"position": pos.to_string(), "event_id": m.event_id(), "dry_run": true}));
            } else {
                let record = Redrive {
                    dlq_topic: dlq_topic.clone(),
                    dlq_partition: pos.partition,
                    dlq_offset: pos.offset,
                    event_id: m.event_id(),
                    source_topic: target.to_owned(),
                    reason: m.reason(),
                    by: by.clone(),
                    at: SystemClock.now(),
                    admitted_late: late,
                    consumer: consumer_of(m),
                };
                // Recorded after the broker's acknowledgement: a re-drive killed before it leaves nothing behind
                // (the dead letter can be re-driven again; two copies are deduplicated by their event_id).
                if late && let Some(event_id) = m.event_id() {
                    store.admit_late(&record.consumer, event_id, &record.by, record.at).await?;
                }
                if let Err(e) = dlq::redrive(&producer, &dlq_topic, m, target).await {
                    failed.push(json!({"position": pos.to_string(), "event_id": m.event_id(), "error": e.to_string()}));
                } else if !store.record_redrive(&record).await? {
                    skipped.push(skip("re-driven already (by someone else meanwhile)"));
                } else {
                    redriven
                        .push(json!({"position": pos.to_string(), "event_id": m.event_id(), "admitted_late": late}));
                }
            }
            progress.inc();
        }
    }
    progress.finish();
    store.close().await;
    if args.json {
        print_json(&json!({"redriven": redriven, "skipped": skipped, "failed": failed, "by": by}));
    } else {
        let verb = if args.dry_run { "would re-drive" } else { "re-driven" };
        say(&format!("{verb} {}, skipped {}, failed {} (by {by})", redriven.len(), skipped.len(), failed.len()));
        for s in skipped.iter().chain(&failed) {
            say(&format!(
                "  {} {}",
                s["position"].as_str().unwrap_or_default(),
                s["why"].as_str().or(s["error"].as_str()).unwrap_or_default()
            ));
        }
    }
    anyhow::ensure!(failed.is_empty(), "{} dead letters could not be re-driven", failed.len());
    Ok(())
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
                            short(r.last_error.as_deref().unwrap_or("-"), 60),
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

fn key_json(r: &KeyRecord, now: DateTime<Utc>, body: bool) -> serde_json::Value {
    let mut v = json!({
        "merchant": r.scope, "key": r.key, "state": r.state, "fingerprint_sha256": hex(&r.fingerprint),
        "status_code": r.status_code, "created_at": r.created_at, "expires_at": r.expires_at,
        "expired": r.expires_at <= now,
    });
    if body {
        v["body"] = json!(r.response_body.as_ref().map(|b| String::from_utf8_lossy(b).into_owned()));
    }
    v
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub async fn keys(command: KeysCommand) -> anyhow::Result<()> {
    let KeysCommand::Show(args) = command;
    let store = crate::connect(&args.db).await?;
    let record = store.key_record(&args.merchant, &args.key).await?;
    let Some(r) = record else {
        anyhow::bail!(
            "no idempotency record for key {:?} of merchant {:?} (never used, or expired and cleaned up)",
            args.key,
            args.merchant
        );
    };
    let now = SystemClock.now();
    let v = key_json(&r, now, args.body);
    if args.json {
        print_json(&v);
        return Ok(());
    }
    let mut rows: Vec<Vec<String>> =
        ["merchant", "key", "state", "fingerprint_sha256", "status_code", "created_at", "expires_at", "expired"]
            .iter()
            .map(|f| vec![(*f).to_owned(), v[*f].as_str().map(str::to_owned).unwrap_or_else(|| v[*f].to_string())])
            .collect();
    if args.body {
        rows.push(vec!["body".into(), v["body"].as_str().unwrap_or("-").to_owned()]);
    }
    print_table(&["FIELD", "VALUE"], &rows);
    Ok(())
}

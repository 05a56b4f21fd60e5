//! `idem dlq list|show|redrive`.

use super::*;

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

/// Reads the dead-letter topic in bounded batches (`dlq::Reader`), handing each message to `visit` until it
/// returns false: nothing holds the whole topic, payloads included, in memory.
async fn scan_dlq<S: Send + 'static>(
    topics: &Topics,
    label: &'static str,
    mut state: S,
    mut visit: impl FnMut(&mut S, DeadLetterMessage) -> bool + Send + 'static,
) -> anyhow::Result<S> {
    let (cluster, topic) = (topics.kafka.connection()?, topics.orders.dlq_topic());
    tokio::task::spawn_blocking(move || {
        let mut progress = Progress::new(label, None, 1000);
        let mut reader =
            dlq::Reader::open(&cluster, &topic, READ_TIMEOUT).with_context(|| format!("reading {topic}"))?;
        'read: loop {
            let batch = reader.next_batch(500).with_context(|| format!("reading {topic}"))?;
            if batch.is_empty() {
                break;
            }
            for m in batch {
                progress.inc();
                if !visit(&mut state, m) {
                    break 'read;
                }
            }
        }
        progress.finish();
        Ok(state)
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
    /// The summary by reason, the count, and the first `limit` matching dead letters with their payload's
    /// size (the payload itself is not kept).
    type Listed = (BTreeMap<String, ReasonSummary>, usize, Vec<(DeadLetterMessage, usize)>);
    let (filter, limit) = (args.filter.clone(), args.limit);
    let start: Listed = (BTreeMap::new(), 0, Vec::new());
    let (by_reason, total, listed) = scan_dlq(&args.topics, "reading dead letters", start, move |s, mut m| {
        if filter.matches(&m) {
            let e = s.0.entry(m.reason()).or_default();
            e.0 += 1;
            let at = m.failed_at();
            e.1 = match (e.1, at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            e.2 = e.2.max(at);
            s.1 += 1;
            if s.2.len() < limit {
                let size = m.payload.len();
                m.payload = Vec::new();
                s.2.push((m, size));
            }
        }
        true
    })
    .await?;
    let json_row = |(m, size): &(DeadLetterMessage, usize)| {
        let mut v = dead_letter_json(m, false);
        v["payload_bytes"] = json!(size);
        v
    };
    if args.json {
        let summary: Vec<_> = by_reason
            .iter()
            .map(|(r, (n, first, last))| json!({"reason": r, "count": n, "first": first, "last": last}))
            .collect();
        let rows: Vec<_> = listed.iter().map(json_row).collect();
        print_json(
            &json!({"topic": args.topics.orders.dlq_topic(), "total": total, "by_reason": summary, "dead_letters": rows}),
        );
        return Ok(());
    }
    say(&format!("{total} dead letters in {} match", args.topics.orders.dlq_topic()));
    let summary: Vec<Vec<String>> = by_reason
        .iter()
        .map(|(r, (n, first, last))| vec![untrusted(r.as_bytes(), false), n.to_string(), time(*first), time(*last)])
        .collect();
    print_table(&["REASON", "COUNT", "FIRST", "LAST"], &summary);
    say("");
    let rows: Vec<Vec<String>> = listed
        .iter()
        .map(|(m, _)| {
            vec![
                position(m).to_string(),
                time(m.failed_at()),
                untrusted(m.reason().as_bytes(), false),
                untrusted(m.source_topic().unwrap_or_default().as_bytes(), false),
                m.event_id().map(|e| e.to_string()).unwrap_or_else(|| "-".into()),
                short(
                    &untrusted(m.header(idem_domain::wire::headers::dlq::ERROR).unwrap_or_default().as_bytes(), false),
                    60,
                ),
            ]
        })
        .collect();
    print_table(&["POSITION", "FAILED AT", "REASON", "SOURCE", "EVENT ID", "ERROR"], &rows);
    Ok(())
}

async fn dlq_show(args: DlqShowArgs) -> anyhow::Result<()> {
    let wanted = args.position;
    let found = scan_dlq(&args.topics, "reading dead letters", None, move |found, m| {
        if position(&m) == wanted {
            *found = Some(m);
            return false; // found: the rest of the topic is not read
        }
        true
    })
    .await?;
    let m = found
        .as_ref()
        .with_context(|| format!("no dead letter at {} in {}", args.position, args.topics.orders.dlq_topic()))?;
    if args.json {
        print_json(&dead_letter_json(m, args.payload));
        return Ok(());
    }
    print_table(&["FIELD", "VALUE", "FROM"], &show_rows(m));
    if args.payload {
        say(&untrusted(&m.payload, true));
    }
    Ok(())
}

/// The rows of `idem dlq show`: every field a producer wrote escaped ([`untrusted`]), and each header
/// marked `idem` only when it is the consumer's own provenance (the last occurrence of a `dlq.*` name it
/// writes), `producer` otherwise — a lookalike such as `dIq.original.topic` is the producer's.
fn show_rows(m: &DeadLetterMessage) -> Vec<Vec<String>> {
    let own = |i: usize, k: &str| PROVENANCE.contains(&k) && !m.headers[i + 1..].iter().any(|(later, _)| later == k);
    let mut rows = vec![
        vec!["position".to_owned(), position(m).to_string(), "idem".to_owned()],
        vec![
            "key".to_owned(),
            m.key.as_deref().map(|k| untrusted(k, false)).unwrap_or_default(),
            "producer".to_owned(),
        ],
        vec!["payload".to_owned(), format!("{} bytes", m.payload.len()), "producer".to_owned()],
    ];
    rows.extend(m.headers.iter().enumerate().map(|(i, (k, v))| {
        let from = if own(i, k) { "idem" } else { "producer" };
        vec![untrusted(k.as_bytes(), false), untrusted(v, false), from.to_owned()]
    }));
    rows
}

/// The provenance headers the consumer writes.
const PROVENANCE: &[&str] = &[
    idem_domain::wire::headers::dlq::REASON,
    idem_domain::wire::headers::dlq::ERROR,
    idem_domain::wire::headers::dlq::ORIGINAL_TOPIC,
    idem_domain::wire::headers::dlq::ORIGINAL_PARTITION,
    idem_domain::wire::headers::dlq::ORIGINAL_OFFSET,
    idem_domain::wire::headers::dlq::CONSUMER_GROUP,
    idem_domain::wire::headers::dlq::FAILED_AT,
    idem_domain::wire::headers::dlq::ORIGINAL_SIZE,
];

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
    store.migrate_schema_first(&crate::REFERENCE_MIGRATOR).await.context("applying migrations")?;
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
            } else if let Some(size) = m.cut_from() {
                skipped.push(skip(&format!(
                    "cut to fit the dead-letter topic (the original has {size} bytes): re-produce it from its source position"
                )));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 38.4: a dead letter with planted escape sequences and a lookalike provenance header: every
    /// cell is free of controls, and only the consumer's own provenance is marked `idem`.
    #[test]
    fn show_escapes_what_producers_wrote_and_marks_whose_headers_are_whose() {
        let m = DeadLetterMessage {
            partition: 0,
            offset: 7,
            key: Some(b"\x1b]0;owned\x07".to_vec()),
            payload: b"{}".to_vec(),
            headers: vec![
                ("dIq.original.topic".into(), b"payments".to_vec()),
                ("dlq.reason".into(), b"forged-before".to_vec()),
                ("x-note".into(), b"\x1b[2Jall dead letters re-driven OK".to_vec()),
                ("dlq.reason".into(), b"malformed".to_vec()),
                ("dlq.original.topic".into(), b"orders".to_vec()),
            ],
        };
        let rows = show_rows(&m);
        for cell in rows.iter().flatten() {
            assert!(!cell.chars().any(char::is_control), "{cell:?}");
        }
        let from = |field: &str, value: &str| {
            rows.iter().find(|r| r[0] == field && r[1] == value).map(|r| r[2].clone()).unwrap_or_default()
        };
        assert_eq!(from("dIq.original.topic", "payments"), "producer");
        assert_eq!(from("dlq.reason", "forged-before"), "producer");
        assert_eq!(from("dlq.reason", "malformed"), "idem");
        assert_eq!(from("dlq.original.topic", "orders"), "idem");
        assert_eq!(from("x-note", "\\u{1b}[2Jall dead letters re-driven OK"), "producer");
        assert_eq!(from("key", "\\u{1b}]0;owned\\u{7}"), "producer");
    }
}

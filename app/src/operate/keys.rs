//! `idem keys show`, and the requests held between the phases of a foreign call: `idem keys held`,
//! `resume`, `abandon`.

use super::*;

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// What idem stored for one Idempotency-Key of one merchant.
    Show(KeysShowArgs),
    /// Requests held between the phases of a call to another system (in progress, or parked by the
    /// completer for an operator), oldest first.
    Held(KeysHeldArgs),
    /// Hands a held or parked request back to the completer: unparked, its backoff reset, re-sent at its
    /// next round with the same downstream key (after the other side's idempotency window that may act
    /// twice: check the other side first).
    Resume(KeyArgs),
    /// Ends a parked request for good with `409 request-abandoned`, replayed to every retry of its key.
    /// Only after checking the other side: nothing happened there, or it was compensated (refunded, voided).
    Abandon(KeysAbandonArgs),
}

#[derive(Debug, Args)]
pub struct KeysHeldArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Only the parked ones.
    #[arg(long)]
    pub parked: bool,
    /// At most this many.
    #[arg(long, default_value_t = 100)]
    pub limit: i64,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct KeyArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The merchant (the key's scope).
    #[arg(long)]
    pub merchant: String,
    /// The Idempotency-Key, as the client sent it (bare form).
    #[arg(long)]
    pub key: String,
}

#[derive(Debug, Args)]
pub struct KeysAbandonArgs {
    #[command(flatten)]
    pub key: KeyArgs,
    /// What the operator found (stored in the answer's `detail`, which the client sees).
    #[arg(long)]
    pub reason: String,
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

fn key_json(r: &KeyRecord, now: DateTime<Utc>, body: bool) -> serde_json::Value {
    let mut v = json!({
        "merchant": r.scope, "key": r.key, "state": r.state, "fingerprint_sha256": hex(&r.fingerprint),
        "status_code": r.status_code, "created_at": r.created_at, "expires_at": r.expires_at,
        "expired": r.expires_at <= now,
        // held between the phases of a foreign call: by which attempt, until when, resuming where
        "attempt": r.attempt, "lease_until": r.lease_until, "recovery_point": r.recovery_point,
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
    let args = match command {
        KeysCommand::Show(args) => args,
        KeysCommand::Held(args) => return held(args).await,
        KeysCommand::Resume(args) => {
            let store = crate::connect(&args.db).await?;
            if !store.resume_held(&args.merchant, &args.key).await? {
                anyhow::bail!(
                    "key {:?} of merchant {:?} is not parked or lapsed (not held between phases, or an attempt holds a live lease: its call may be in process)",
                    args.key,
                    args.merchant
                );
            }
            say(
                "handed back to the completer: it re-sends the request at its next round, under the same downstream key",
            );
            return Ok(());
        }
        KeysCommand::Abandon(args) => {
            let store = crate::connect(&args.key.db).await?;
            let kind = idem_http::ProblemKind::RequestAbandoned;
            let body = json!({
                "type": kind.type_uri(), "title": kind.title(), "status": 409,
                "detail": format!("an operator ended this request: {}", args.reason),
            });
            let (merchant, key) = (&args.key.merchant, &args.key.key);
            if !store.abandon_parked(merchant, key, 409, body.to_string().as_bytes()).await? {
                anyhow::bail!(
                    "key {key:?} of merchant {merchant:?} is not parked (only parked requests can be abandoned)"
                );
            }
            say("abandoned: every retry of the key is answered 409 request-abandoned");
            return Ok(());
        }
    };
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
            .into_iter()
            .chain(
                r.lease_until.is_some().then_some(["attempt", "lease_until", "recovery_point"]).into_iter().flatten(),
            )
            .map(|f| vec![f.to_owned(), v[f].as_str().map(str::to_owned).unwrap_or_else(|| v[f].to_string())])
            .collect();
    if args.body {
        rows.push(vec!["body".into(), v["body"].as_str().unwrap_or("-").to_owned()]);
    }
    print_table(&["FIELD", "VALUE"], &rows);
    Ok(())
}

async fn held(args: KeysHeldArgs) -> anyhow::Result<()> {
    let store = crate::connect(&args.db).await?;
    let records = store.held_records(args.parked, args.limit).await?;
    let now = SystemClock.now();
    let rows: Vec<serde_json::Value> = records
        .iter()
        .map(|r| {
            json!({
                "merchant": r.scope, "key": r.key, "attempt": r.attempt, "recovery_point": r.recovery_point,
                "created_at": r.created_at, "lease_until": r.lease_until, "lease_lapsed": r.lease_until <= now,
                "completer_runs": r.completer_runs, "parked_at": r.parked_at, "parked_reason": r.parked_reason,
                "request": r.request_uri,
            })
        })
        .collect();
    if args.json {
        print_json(&json!(rows));
        return Ok(());
    }
    let table: Vec<Vec<String>> = records
        .iter()
        .map(|r| {
            vec![
                untrusted(r.scope.as_bytes(), false),
                untrusted(r.key.as_bytes(), false),
                r.attempt.to_string(),
                untrusted(r.recovery_point.as_bytes(), false),
                time(Some(r.created_at)),
                if r.lease_until <= now { "lapsed".into() } else { time(Some(r.lease_until)) },
                r.completer_runs.to_string(),
                r.parked_reason.as_deref().map_or_else(|| "-".into(), |why| untrusted(why.as_bytes(), false)),
            ]
        })
        .collect();
    print_table(&["MERCHANT", "KEY", "ATTEMPT", "RECOVERY POINT", "CLAIMED", "LEASE", "RUNS", "PARKED"], &table);
    Ok(())
}

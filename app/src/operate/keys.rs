//! `idem keys show`.

use super::*;

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

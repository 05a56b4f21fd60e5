//! Running the binary, driving load, checking invariants.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idem_http::client::{ChargeRequest, IdemClient, RetryPolicy};
use idem_tests::TestDb;
use idem_tests::kafka::{read_topic, unique_topic};
use tokio::sync::Mutex;
use uuid::Uuid;

pub const API_KEY: &str = "faults_key_0123456789";

pub fn full() -> bool {
    std::env::var("FAULTS_SCALE").is_ok_and(|v| v == "full")
}

/// Picks `small` in CI, `large` at full size.
pub fn scale(small: usize, large: usize) -> usize {
    if full() { large } else { small }
}

fn idem_bin() -> std::path::PathBuf {
    std::env::var_os("IDEM_BIN").map(Into::into).unwrap_or_else(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
        let release = dir.join("release/idem");
        let debug = dir.join("debug/idem");
        if debug.exists() { debug } else { release }
    })
}

/// One `idem serve` process and what it needs to be restarted identically.
pub struct Service {
    child: Option<Child>,
    env: Vec<(String, String)>,
    /// `faketime -f` shift of `idem serve`'s wall clock (`None`: the host's clock).
    clock_shift: Option<String>,
    pub base: String,
    /// The admin listener (`/readyz`, `/metrics`).
    pub admin: String,
    pub orders_topic: String,
    pub payments_topic: String,
    pub group: String,
}

impl Service {
    /// Environment for a service on `db` and `brokers` with fresh topics and group.
    pub fn new(database_url: &str, brokers: &str) -> Self {
        let (port, admin_port) = (idem_tests::port_for_child(), idem_tests::port_for_child());
        let orders_topic = unique_topic("f-orders");
        let payments_topic = unique_topic("f-payments");
        let group = unique_topic("f-group");
        let env = vec![
            ("DATABASE_URL".into(), database_url.to_owned()),
            ("KAFKA_BROKERS".into(), brokers.to_owned()),
            ("HTTP_ADDR".into(), format!("127.0.0.1:{port}")),
            ("ADMIN_ADDR".into(), format!("127.0.0.1:{admin_port}")),
            ("IDEM_API_KEYS".into(), format!("faults:{API_KEY}")),
            ("KAFKA_ORDERS_TOPIC".into(), orders_topic.clone()),
            ("KAFKA_PAYMENTS_TOPIC".into(), payments_topic.clone()),
            ("KAFKA_GROUP_ID".into(), group.clone()),
            ("KAFKA_SESSION_TIMEOUT".into(), "6s".into()),
            ("KAFKA_TOPIC_PARTITIONS".into(), "3".into()),
            ("ORDERS_MERCHANT_ID".into(), "faults-orders".into()),
            ("OUTBOX_POLL_INTERVAL".into(), "200ms".into()),
            ("DATABASE_MAX_CONNECTIONS".into(), "20".into()),
            ("RUST_LOG".into(), "warn".into()),
        ];
        Self {
            child: None,
            env,
            clock_shift: None,
            base: format!("http://127.0.0.1:{port}"),
            admin: format!("http://127.0.0.1:{admin_port}"),
            orders_topic,
            payments_topic,
            group,
        }
    }

    #[allow(dead_code)] // used by the ops tests, which share this harness
    /// `idem <args>` with this service's environment (database, broker, topics, group), run to the end.
    pub fn idem(&self, args: &[&str]) -> anyhow::Result<std::process::Output> {
        self.idem_with_clock(None, args)
    }

    #[allow(dead_code)] // used by the ops tests, which share this harness
    /// `idem serve` with its log at info level captured: started, checked healthy, stopped with SIGTERM; or,
    /// when it does not start, what it printed before exiting. Returns stdout and stderr together.
    pub async fn serve_output(&self) -> anyhow::Result<String> {
        let mut cmd = Command::new(idem_bin());
        cmd.arg("serve").stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd.env("RUST_LOG", "info");
        let mut child = cmd.spawn()?;
        let pid = child.id().to_string();
        let http = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::time::Instant::now() < deadline && child.try_wait()?.is_none() {
            if http.get(format!("{}/healthz", self.base)).send().await.is_ok() {
                let _ = http.get(format!("{}/readyz", self.admin)).send().await;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await??;
        Ok(format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
    }

    #[allow(dead_code)] // used by the ops tests, which share this harness
    /// `idem <args>` started in the background (to be killed mid-way).
    pub fn idem_spawn(&self, args: &[&str]) -> anyhow::Result<std::process::Child> {
        let mut cmd = Command::new(idem_bin());
        cmd.args(args).env("RUST_LOG", "warn").stdout(Stdio::null()).stderr(Stdio::null());
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        Ok(cmd.spawn()?)
    }

    #[allow(dead_code)] // used by the ops tests, which share this harness
    /// `idem <args>` under Debian's `faketime -f <shift>` (for example `+2d`): the process's wall clock is
    /// moved, its monotonic clock is not.
    pub fn idem_with_clock(&self, shift: Option<&str>, args: &[&str]) -> anyhow::Result<std::process::Output> {
        let mut cmd = match shift {
            Some(shift) => {
                let mut c = Command::new("faketime");
                c.args(["-f", shift]).arg(idem_bin()).env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
                c
            }
            None => Command::new(idem_bin()),
        };
        cmd.args(args).env("RUST_LOG", "warn");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        Ok(cmd.output()?)
    }

    #[allow(dead_code)] // used by the phase faults only
    /// `idem serve` under Debian's `faketime -f <shift>` (for example `+40s`): its wall clock moved (the
    /// clock leases were once compared with), its monotonic clock not.
    pub fn with_clock_shift(mut self, shift: &str) -> Self {
        self.clock_shift = Some(shift.to_owned());
        self
    }

    pub fn with_env(mut self, key: &str, value: &str) -> Self {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Starts `idem serve` and waits until it answers. Its ports were free when picked, but another test
    /// process may bind one before idem does: then it moves to other free ports and starts again.
    pub async fn start(&mut self) -> anyhow::Result<()> {
        let mut attempt = 0;
        loop {
            match self.start_once().await {
                Err(e) if attempt < 3 && e.to_string().contains("Address already in use") => {
                    attempt += 1;
                    let (port, admin_port) = (idem_tests::port_for_child(), idem_tests::port_for_child());
                    self.env.retain(|(k, _)| k != "HTTP_ADDR" && k != "ADMIN_ADDR");
                    self.env.push(("HTTP_ADDR".into(), format!("127.0.0.1:{port}")));
                    self.env.push(("ADMIN_ADDR".into(), format!("127.0.0.1:{admin_port}")));
                    self.base = format!("http://127.0.0.1:{port}");
                    self.admin = format!("http://127.0.0.1:{admin_port}");
                }
                other => return other,
            }
        }
    }

    async fn start_once(&mut self) -> anyhow::Result<()> {
        let mut cmd = match &self.clock_shift {
            Some(shift) => {
                let mut c = Command::new("faketime");
                c.args(["-f", shift]).arg(idem_bin()).env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
                c
            }
            None => Command::new(idem_bin()),
        };
        // stderr goes to a log file (or the terminal with FAULTS_LOG) so a start that fails can say why
        let log = std::env::temp_dir().join(format!("idem-faults-{}.log", Uuid::now_v7()));
        let stderr = if std::env::var_os("FAULTS_LOG").is_some() {
            Stdio::inherit()
        } else {
            Stdio::from(std::fs::File::create(&log)?)
        };
        cmd.arg("serve").stdout(Stdio::null()).stderr(stderr);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn()?);
        // bounded: whatever else may hold the port (a collision) must not hang the probe
        let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build()?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let exited = loop {
            if http.get(format!("{}/healthz", self.base)).send().await.is_ok() {
                let _ = std::fs::remove_file(&log);
                return Ok(());
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                break Some(status);
            }
            if tokio::time::Instant::now() > deadline {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let tail: Vec<String> = std::fs::read_to_string(&log).unwrap_or_default().lines().map(str::to_owned).collect();
        let tail = tail[tail.len().saturating_sub(20)..].join("\n");
        let _ = std::fs::remove_file(&log);
        match exited {
            Some(status) => anyhow::bail!("idem exited before listening ({status}); its log ends:\n{tail}"),
            None => anyhow::bail!("idem did not listen within 60 s; its log ends:\n{tail}"),
        }
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// `kill -9`: no shutdown, no drain.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for the graceful exit; returns whether it exited successfully.
    pub fn terminate(&mut self) -> bool {
        match self.child.take() {
            Some(mut c) => {
                let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
                c.wait().map(|s| s.success()).unwrap_or(false)
            }
            None => true,
        }
    }

    pub fn client(&self) -> IdemClient {
        self.client_with(RetryPolicy {
            max_attempts: 200,
            base_delay: Duration::from_millis(50),
            max_delay: Duration::from_millis(500),
            timeout: Duration::from_secs(5),
        })
    }

    /// A client of this service that retries by `policy`.
    pub fn client_with(&self, policy: RetryPolicy) -> IdemClient {
        IdemClient::new(&self.base, API_KEY, policy).unwrap()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// What the clients saw succeed.
#[derive(Default)]
pub struct Ledger {
    /// external payment id → payment ids the client was given (must be one, and exist once)
    pub charges: Mutex<BTreeMap<String, BTreeSet<String>>>,
}

impl Ledger {
    pub async fn record(&self, external: &str, payment_id: &str) {
        self.charges.lock().await.entry(external.to_owned()).or_default().insert(payment_id.to_owned());
    }
}

#[allow(dead_code)] // used by the ops and deploy tests, which share this harness
/// The body of an `OrderPlaced` event for `order`, paid with provider payment id `external`.
pub fn placed(order: Uuid, external: &str) -> String {
    serde_json::json!({
        "type": "OrderPlaced", "order_id": order, "customer_id": Uuid::now_v7(), "amount": "10.00",
        "currency": "EUR", "provider": "ops", "external_payment_id": external, "version": 1,
    })
    .to_string()
}

pub fn charge_request(external: &str) -> ChargeRequest {
    ChargeRequest {
        order_id: Uuid::now_v7(),
        customer_id: Uuid::now_v7(),
        provider: "faults".into(),
        external_payment_id: external.to_owned(),
        amount: "10.00".into(),
        currency: "EUR".into(),
    }
}

/// Result of the invariant checks.
#[derive(Debug, Default, Clone)]
pub struct Findings {
    pub duplicates: usize,
    pub lost: usize,
    pub details: Vec<String>,
}

impl Findings {
    /// Adds another check's findings to these.
    pub fn absorb(&mut self, other: Findings) {
        self.duplicates += other.duplicates;
        self.lost += other.lost;
        self.details.extend(other.details);
    }

    pub fn dup(&mut self, what: String) {
        self.duplicates += 1;
        self.details.push(format!("duplicate: {what}"));
    }
    pub fn lost(&mut self, what: String) {
        self.lost += 1;
        self.details.push(format!("lost: {what}"));
    }
}

/// A scenario's database: every committed outbox row is logged for invariant 3 (the relay deletes the rows
/// it publishes), and every application of an order event for invariant 2 (the order handler is idempotent
/// on its own, so surviving payments cannot show an event applied twice).
pub async fn scenario_db() -> anyhow::Result<TestDb> {
    let db = TestDb::new().await?;
    db.log_outbox_rows().await?;
    idem_tests::effects::log_order_applications(&db).await?;
    idem_tests::effects::log_payment_attempts(&db).await?;
    Ok(db)
}

/// Invariants 1 and 2 for HTTP charges, 2 for Kafka-driven payments and refunds, 3 for the outbox.
pub async fn check(
    db: &TestDb,
    ledger: &Ledger,
    service: &Service,
    brokers: &str,
    orders: &BTreeSet<Uuid>,
) -> anyhow::Result<Findings> {
    let mut f = Findings::default();
    // invariant 1: every acknowledged charge exists exactly once, as the payment the client was given
    for (external, ids) in ledger.charges.lock().await.iter() {
        if ids.len() != 1 {
            f.dup(format!("{external} answered with {} different payments", ids.len()));
        }
        let rows: Vec<String> = sqlx::query_scalar("SELECT id::text FROM payment WHERE external_payment_id = $1")
            .bind(external)
            .fetch_all(db.pool())
            .await?;
        match rows.len() {
            0 => f.lost(format!("{external} acknowledged but not stored")),
            1 if !ids.contains(&rows[0]) => {
                f.lost(format!("{external}: stored payment differs from the acknowledged one"))
            }
            1 => {}
            n => f.dup(format!("{external} stored {n} times")),
        }
    }
    // invariant 2: one payment per order from events, at most one refund per payment, no double captures
    let doubled: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT order_id, count(*) FROM payment GROUP BY order_id HAVING count(*) > 1")
            .fetch_all(db.pool())
            .await?;
    for (order, n) in doubled {
        f.dup(format!("order {order} has {n} payments"));
    }
    let refunds: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT payment_id, count(*) FROM refund GROUP BY payment_id HAVING count(*) > 1")
            .fetch_all(db.pool())
            .await?;
    for (payment, n) in refunds {
        f.dup(format!("payment {payment} refunded {n} times"));
    }
    // executions, not survivors: each charge (HTTP or order event) executed once in a committed transaction,
    // which UNIQUE (provider, external_payment_id) alone would hide
    let payments_logged: bool =
        sqlx::query_scalar("SELECT to_regclass('test_payment_attempt') IS NOT NULL").fetch_one(db.pool()).await?;
    if payments_logged {
        for (external, n) in idem_tests::effects::charges_executed_twice(db).await? {
            f.dup(format!("charge {external} executed {n} times"));
        }
    }
    // applications, not survivors: each order event applied once. The scenarios send one OrderPlaced id
    // per order (some delivered twice) and, for a cancelled order, two OrderCancelled events with distinct
    // ids (a compensation sent twice): version 1 at most once, version 2 at most twice.
    let logged: bool =
        sqlx::query_scalar("SELECT to_regclass('test_application') IS NOT NULL").fetch_one(db.pool()).await?;
    if logged {
        for (order, version, n) in idem_tests::effects::orders_applied_twice(db).await? {
            if n > version.min(2) {
                f.dup(format!("order {order} version {version} applied {n} times"));
            }
        }
    }
    for order in orders {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM payment WHERE order_id = $1")
            .bind(order)
            .fetch_one(db.pool())
            .await?;
        if n == 0 {
            f.lost(format!("event-driven order {order} has no payment"));
        }
    }
    // invariant 3: every committed outbox row published, each event id once after dedup
    let drained = db.all_published_within(Duration::from_secs(60)).await?;
    if !drained {
        f.lost("outbox rows still unpublished after 60 s".into());
    }
    let rows = db.logged_outbox_rows().await?;
    let mut read = read_topic(brokers, &service.payments_topic, rows.len(), Duration::from_secs(30)).await?;
    let mut published: BTreeSet<String> = read.iter().filter_map(|m| m.header("event_id")).collect();
    if !rows.is_subset(&published) {
        // re-published rows (after a crash) take room in the first read: read more
        read = read_topic(brokers, &service.payments_topic, rows.len() * 3, Duration::from_secs(10)).await?;
        published = read.iter().filter_map(|m| m.header("event_id")).collect();
    }
    for id in rows.difference(&published) {
        f.lost(format!("outbox row {id} never arrived on {}", service.payments_topic));
    }
    Ok(f)
}

/// One line of the summary table.
#[derive(Debug, Clone)]
pub struct Summary {
    pub scenario: &'static str,
    pub operations: usize,
    pub faults: usize,
    pub findings: Findings,
}

pub fn print(summary: &Summary) {
    println!(
        "| {:<44} | {:>10} | {:>6} | {:>10} | {:>5} |",
        summary.scenario, summary.operations, summary.faults, summary.findings.duplicates, summary.findings.lost
    );
    for d in summary.findings.details.iter().take(10) {
        println!("|   {d}");
    }
}

//! Issue 34.3: a Jepsen-style run through real failovers. scripts/ha.sh's Patroni cluster (three nodes in
//! network namespaces, HAProxy), a private tansu behind a proxy that can be cut, and two `idem serve`
//! instances — one on HAProxy's URL, one on the multi-host URL — sharing the topics and the consumer group,
//! the relay and the order consumer running. Clients charge and refund with keys of their own and retry
//! with the same key on errors, timeouts and 503 up to a bound; a producer sends order events (some twice);
//! two more clients charge cards through a stand-in payment provider (issue 45), whose charges are counted
//! at the provider: one per client key, each acknowledged payment captured with it, nothing left held.
//! A nemesis runs a schedule of faults, each healed before the next: `kill-primary`, `isolate-primary`,
//! `partition-primary`, a broker cut and `kill -9` of an idem instance. Every invocation goes into a
//! history; after the faults, every unknown outcome is sent again with its key, and
//! [`idem_tests::history::check`] compares the history with the database and the payments topic.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use idem_http::client::{ChargeRequest, IdemClient, RetryPolicy};
use idem_tests::history::{self, Event, Invocation, Observed, Op, Outcome, Verdict};
use idem_tests::infra::HaCluster;
use idem_tests::kafka::{ProxiedBroker, produce, producer, read_topic};
use rust_decimal::Decimal;
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::harness::{API_KEY, Service, charge_request, placed};

/// The stand-in provider's API key.
const PROVIDER_KEY: &str = "sk_test_failover_0123";

/// A fault of the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    KillPrimary,
    IsolatePrimary,
    PartitionPrimary,
    BrokerCut,
    KillIdem,
}

impl Fault {
    pub const ALL: [Fault; 5] =
        [Fault::KillPrimary, Fault::IsolatePrimary, Fault::PartitionPrimary, Fault::BrokerCut, Fault::KillIdem];

    pub fn name(self) -> &'static str {
        match self {
            Fault::KillPrimary => "kill-primary",
            Fault::IsolatePrimary => "isolate-primary",
            Fault::PartitionPrimary => "partition-primary",
            Fault::BrokerCut => "broker-cut",
            Fault::KillIdem => "kill-idem",
        }
    }

    pub fn parse(name: &str) -> anyhow::Result<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name).ok_or_else(|| anyhow::anyhow!("no fault named {name}"))
    }
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct Run {
    /// ha.sh's port range (and network).
    pub base_port: u16,
    /// The control run: synchronous replication off, a lagging standby promotable.
    pub asynchronous: bool,
    pub schedule: Vec<Fault>,
    /// Load before each fault.
    pub quiet: Duration,
    /// How long a cut or a killed node stays so.
    pub hold: Duration,
}

impl Run {
    /// From `faults_var` (comma-separated names; else `default`) repeated `FAILOVER_ROUNDS` times
    /// (default 1), each held `FAILOVER_HOLD` seconds (default 12: longer than Patroni's `ttl`, so a cut
    /// primary is replaced while it is cut).
    pub fn from_env(faults_var: &str, base_port: u16, asynchronous: bool, default: &[Fault]) -> anyhow::Result<Self> {
        let faults = match std::env::var(faults_var) {
            Ok(names) => names.split(',').map(|n| Fault::parse(n.trim())).collect::<anyhow::Result<Vec<_>>>()?,
            Err(_) => default.to_vec(),
        };
        let rounds: usize = std::env::var("FAILOVER_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(1);
        let hold = std::env::var("FAILOVER_HOLD").ok().and_then(|h| h.parse().ok()).unwrap_or(12);
        Ok(Self {
            base_port,
            asynchronous,
            schedule: faults.repeat(rounds),
            quiet: Duration::from_secs(5),
            hold: Duration::from_secs(hold),
        })
    }
}

/// A fault as it happened, with the clients' recovery from it.
#[derive(Debug, Clone)]
pub struct Injected {
    pub fault: Fault,
    /// The wall clock at the fault (to match UUID v7 ids and logs).
    pub wall: chrono::DateTime<chrono::Utc>,
    pub at: Duration,
    pub healed: Duration,
    /// Whether a client succeeded within 60 s of the cluster being healthy again.
    pub recovered: bool,
    /// The longest time without a success from the fault on, and the time from the fault to steady state
    /// (`history::recovery`).
    pub outage: Duration,
    pub steady: Option<Duration>,
}

/// What a run found.
#[derive(Debug)]
pub struct Report {
    pub verdict: Verdict,
    pub faults: Vec<Injected>,
    pub orders: usize,
    /// Answers `500` and the like (not `503`): each a defect.
    pub server_errors: usize,
    /// The charges through the provider, checked at the provider.
    pub provider: ProviderVerdict,
    pub elapsed: Duration,
}

/// What the charges through the stand-in provider came to.
#[derive(Debug, Default)]
pub struct ProviderVerdict {
    /// Client keys sent, acknowledged (`201`) in the end, and unknown after the clients' bounded retries
    /// (each then sent again until definite).
    pub keys: usize,
    pub acknowledged: usize,
    pub unknown: usize,
    /// Charges the provider made.
    pub charges: usize,
    /// Each a defect: a second charge, an acknowledged payment without its charge, a record still held.
    pub violations: Vec<String>,
}

impl Report {
    pub fn print(&self, title: &str) {
        let v = &self.verdict;
        println!(
            "{title}: {} faults, {} invocations, {} acknowledged, {} unknown ({} resolved), {} order events; \
             lost {}, duplicated {}, inconsistent {}; {} answers 5xx other than 503; {:.0} s",
            self.faults.len(),
            v.invocations,
            v.acknowledged,
            v.unknown,
            v.unknown_resolved,
            self.orders,
            v.lost.len(),
            v.duplicated.len(),
            v.inconsistent.len(),
            self.server_errors,
            self.elapsed.as_secs_f64()
        );
        for f in &self.faults {
            println!(
                "  {:<18} at {:>6.1} s ({}), healed {:>5.1} s later; no success for {:.1} s, steady after {}",
                f.fault.name(),
                f.at.as_secs_f64(),
                f.wall.format("%H:%M:%S%.3f"),
                (f.healed - f.at).as_secs_f64(),
                f.outage.as_secs_f64(),
                f.steady.map_or("never".into(), |d| format!("{:.1} s", d.as_secs_f64())),
            );
        }
        if let Some((p50, max)) = self.recovery() {
            println!(
                "  database faults: no success for p50 {:.1} s, max {:.1} s",
                p50.as_secs_f64(),
                max.as_secs_f64()
            );
        }
        if !v.lost.is_empty() {
            let count = |is: &dyn Fn(&str) -> bool| v.lost.iter().filter(|l| is(l)).count();
            let counts = [
                format!("{} acknowledged charges", count(&|l| l.starts_with("charge "))),
                format!("{} acknowledged refunds", count(&|l| l.starts_with("refund ") && l.ends_with("not stored"))),
                format!("{} events of what is not stored", count(&|l| l.contains("published, but"))),
                format!("{} stored but never announced", count(&|l| l.contains("never announced"))),
                format!("{} order events unpaid", count(&|l| l.starts_with("order "))),
            ];
            println!("  lost: {}", counts.join(", "));
        }
        for line in v.lost.iter().chain(&v.duplicated).chain(&v.inconsistent).take(12) {
            println!("  {line}");
        }
        let p = &self.provider;
        println!(
            "  through the provider: {} client keys, {} acknowledged, {} unknown until the faults healed, \
             {} charges at the provider, {} violations",
            p.keys,
            p.acknowledged,
            p.unknown,
            p.charges,
            p.violations.len()
        );
        for line in p.violations.iter().take(12) {
            println!("  {line}");
        }
    }

    /// The outages of the database faults (p50, max).
    pub fn recovery(&self) -> Option<(Duration, Duration)> {
        let mut times: Vec<Duration> = self
            .faults
            .iter()
            .filter(|f| matches!(f.fault, Fault::KillPrimary | Fault::IsolatePrimary | Fault::PartitionPrimary))
            .map(|f| f.outage)
            .collect();
        times.sort();
        Some((*times.get(times.len() / 2)?, *times.last()?))
    }
}

/// What a client sends again for an unknown outcome: the same request.
#[derive(Debug, Clone)]
enum Request {
    Charge(ChargeRequest),
    Refund(Uuid, String),
}

type History = Arc<Mutex<Vec<(Invocation, Request)>>>;

/// A `5xx` the client does not retry (a `500`) says nothing of the outcome: unknown, and counted — the
/// service answers a database or broker condition with `503`.
fn outcome(reply: Result<idem_http::client::Reply, idem_http::client::ClientError>, errors: &AtomicUsize) -> Outcome {
    match reply {
        Ok(r) if r.status == 201 => Outcome::Ok { id: r.body["id"].as_str().unwrap_or_default().to_owned() },
        Ok(r) if r.status >= 500 => {
            errors.fetch_add(1, Relaxed);
            Outcome::Unknown
        }
        Ok(r) => Outcome::Failed { status: r.status },
        Err(_) => Outcome::Unknown,
    }
}

async fn send(client: &IdemClient, key: &str, request: &Request, errors: &AtomicUsize) -> Outcome {
    match request {
        Request::Charge(charge) => outcome(client.charge(key, charge).await, errors),
        Request::Refund(payment, amount) => outcome(client.refund(key, *payment, amount).await, errors),
    }
}

/// A client: charges, and every fourth operation refunds 4.00 of one of its acknowledged payments (each
/// at most once), until `stop`.
async fn client_loop(
    name: String,
    client: IdemClient,
    start: Instant,
    history: History,
    successes: Arc<Mutex<Vec<Duration>>>,
    errors: Arc<AtomicUsize>,
    stop: idem::CancellationToken,
) {
    let mut refundable: Vec<Uuid> = Vec::new();
    let mut n = 0u64;
    while !stop.is_cancelled() {
        n += 1;
        let key = IdemClient::new_key();
        let (op, request) = match n.is_multiple_of(4).then(|| refundable.pop()).flatten() {
            Some(payment) => (
                Op::Refund { payment: payment.to_string(), amount: Decimal::new(400, 2) },
                Request::Refund(payment, "4.00".into()),
            ),
            None => {
                let charge = charge_request(&format!("{name}-{}", Uuid::now_v7().simple()));
                let op = Op::Charge {
                    external: charge.external_payment_id.clone(),
                    amount: charge.amount.parse().unwrap_or_default(),
                };
                (op, Request::Charge(charge))
            }
        };
        let outcome = send(&client, &key, &request, &errors).await;
        let at = start.elapsed();
        if let Outcome::Ok { id } = &outcome {
            successes.lock().await.push(at);
            if matches!(op, Op::Charge { .. })
                && let Ok(id) = id.parse()
            {
                refundable.push(id);
            }
        }
        history.lock().await.push((Invocation { op, key, at, outcome, resolved: None }, request));
    }
}

/// Sends `OrderPlaced` events (provider ids `order-…`), a third of them twice with the same `event_id`,
/// each retried until the broker acknowledges it (through cuts), until `stop`.
async fn order_loop(brokers: String, topic: String, sent: Arc<Mutex<BTreeSet<String>>>, stop: idem::CancellationToken) {
    let Ok(p) = producer(&brokers) else { return };
    let mut n = 0u64;
    while !stop.is_cancelled() {
        n += 1;
        let order = Uuid::now_v7();
        let body = placed(order, &format!("order-{}", order.simple()));
        let (id, key) = (Uuid::now_v7().to_string(), order.to_string());
        for _ in 0..(if n.is_multiple_of(3) { 2 } else { 1 }) {
            while !stop.is_cancelled() {
                let headers: [(&str, &[u8]); 1] = [("event_id", id.as_bytes())];
                let sending = produce(&p, &topic, Some(&key), body.as_bytes(), &headers);
                if matches!(tokio::time::timeout(Duration::from_secs(5), sending).await, Ok(Ok(_))) {
                    sent.lock().await.insert(order.to_string());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A charge through the provider: its client key, its order, and what its client was told in the end.
#[derive(Debug, Clone)]
struct ThroughProvider {
    key: String,
    order: Uuid,
    body: serde_json::Value,
    outcome: Outcome,
}

/// Sends `body` with `key` until a definite answer or `patience` has passed: `409` in flight, `429`,
/// `503` (nothing executed, or the outcome unknown) and no answer are sent again with the key; a `5xx`
/// other than `503` is counted (a defect) and sent again.
async fn charge_through_provider(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    body: &serde_json::Value,
    patience: Duration,
    errors: &AtomicUsize,
) -> Outcome {
    let deadline = Instant::now() + patience;
    let mut wait = Duration::from_millis(200);
    loop {
        let sent = http.post(format!("{base}/payments")).bearer_auth(API_KEY).header("idempotency-key", key);
        if let Ok(resp) = sent.json(body).send().await {
            let status = resp.status().as_u16();
            let answer: serde_json::Value = resp.json().await.unwrap_or_default();
            match status {
                201 => return Outcome::Ok { id: answer["id"].as_str().unwrap_or_default().to_owned() },
                409 | 429 | 503 => {}
                s if s >= 500 => {
                    println!("through the provider: {key} answered {s}: {answer}");
                    errors.fetch_add(1, Relaxed);
                }
                s => return Outcome::Failed { status: s },
            }
        }
        if Instant::now() + wait > deadline {
            return Outcome::Unknown;
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(1));
    }
}

/// A client charging cards through the provider with keys of its own, each retried for a few seconds, until
/// `stop`.
async fn provider_loop(
    base: String,
    history: Arc<Mutex<Vec<ThroughProvider>>>,
    successes: Arc<Mutex<Vec<Duration>>>,
    start: Instant,
    errors: Arc<AtomicUsize>,
    stop: idem::CancellationToken,
) {
    let Ok(http) = reqwest::Client::builder().timeout(Duration::from_secs(5)).build() else { return };
    while !stop.is_cancelled() {
        let (key, order) = (IdemClient::new_key(), Uuid::now_v7());
        let body = serde_json::json!({"order_id": order, "customer_id": Uuid::now_v7(), "amount": "12.34",
                                      "currency": "EUR", "payment_method": "pm_card_visa"});
        let outcome = charge_through_provider(&http, &base, &key, &body, Duration::from_secs(8), &errors).await;
        if matches!(outcome, Outcome::Ok { .. }) {
            successes.lock().await.push(start.elapsed());
        }
        history.lock().await.push(ThroughProvider { key, order, body, outcome });
    }
}

/// Counts at the provider: one charge per client key (per order), each charge the captured payment of its
/// reference with its amount, every acknowledged payment charged there, and no record of these keys still
/// held.
async fn check_provider(
    url: &str,
    standin: &idem_tests::provider::StandIn,
    history: &[ThroughProvider],
) -> anyhow::Result<ProviderVerdict> {
    let db = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(url).await?;
    let mut v = ProviderVerdict { keys: history.len(), ..ProviderVerdict::default() };
    let charges = standin.charges_made();
    v.charges = charges.len();
    let mut by_order: BTreeMap<Uuid, Vec<String>> = BTreeMap::new();
    let mut by_reference: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (charge, amount_minor, reference) in &charges {
        by_reference.entry(reference.clone()).or_default().push(charge.clone());
        let row: Option<(Uuid, String, String, Decimal)> =
            sqlx::query_as("SELECT order_id, external_payment_id, status, amount FROM payment WHERE id::text = $1")
                .bind(reference)
                .fetch_optional(&db)
                .await?;
        match row {
            None => v.violations.push(format!("provider charge {charge} of payment {reference}: no such payment")),
            Some((order, external, status, amount)) => {
                by_order.entry(order).or_default().push(charge.clone());
                if external != *charge
                    || status != "captured"
                    || amount * Decimal::from(100) != Decimal::from(*amount_minor)
                {
                    v.violations.push(format!(
                        "provider charge {charge} of {amount_minor}: payment {reference} is {external} {status} of {amount}"
                    ));
                }
            }
        }
    }
    for (reference, ids) in by_reference.iter().filter(|(_, ids)| ids.len() > 1) {
        v.violations.push(format!("payment {reference} charged {} times at the provider: {ids:?}", ids.len()));
    }
    for (order, ids) in by_order.iter().filter(|(_, ids)| ids.len() > 1) {
        v.violations.push(format!("order {order} (one client key) charged {} times: {ids:?}", ids.len()));
    }
    for t in history {
        match &t.outcome {
            Outcome::Ok { id } => {
                v.acknowledged += 1;
                if by_reference.get(id).is_none_or(Vec::is_empty) {
                    v.violations.push(format!("key {}: acknowledged payment {id} has no provider charge", t.key));
                }
            }
            Outcome::Failed { status } if by_order.contains_key(&t.order) => {
                v.violations.push(format!("key {}: answered {status}, but its order was charged", t.key));
            }
            Outcome::Failed { status } => v.violations.push(format!("key {}: refused {status}", t.key)),
            Outcome::Unknown => v.violations.push(format!("key {}: unknown after the faults healed", t.key)),
        }
    }
    let keys: Vec<String> = history.iter().map(|t| t.key.clone()).collect();
    let held: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_record WHERE key = ANY($1) AND state = 'in_flight'")
            .bind(&keys)
            .fetch_one(&db)
            .await?;
    if held > 0 {
        v.violations.push(format!("{held} records of these keys still held once the faults healed"));
    }
    db.close().await;
    Ok(v)
}

/// Runs `run`'s schedule and checks the history.
pub async fn run(run: &Run) -> anyhow::Result<Report> {
    let started = Instant::now();
    let cluster = HaCluster::up(run.base_port)?;
    if run.asynchronous {
        cluster.run("async")?;
        cluster.wait_healthy(Duration::from_secs(60))?;
    }
    let broker = ProxiedBroker::start().await?;
    let (standin, provider) = idem_tests::provider::start(PROVIDER_KEY).await?;
    standin.delay_ms.store(300, Relaxed); // calls in process when a fault lands
    // the lease holds a call and a second's margin; a killed instance's calls are taken over within seconds
    let through = |service: Service| {
        service
            .with_env("PAYMENT_PROVIDER_URL", &provider)
            .with_env("PAYMENT_PROVIDER_NAME", "standin")
            .with_env("PAYMENT_PROVIDER_API_KEY", PROVIDER_KEY)
            .with_env("IDEMPOTENCY_LEASE", "6s")
            .with_env("PAYMENT_PROVIDER_TIMEOUT", "3s")
            .with_env("COMPLETER_INTERVAL", "2s")
    };
    let mut a = through(Service::new(&cluster.url, &broker.bootstrap).with_env("KAFKA_SESSION_TIMEOUT", "10s"));
    a.start().await?;
    let admin = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&cluster.url).await?;
    idem_tests::effects::log_payment_attempts_in(&admin).await?;
    sqlx::raw_sql(
        "CREATE TABLE test_application (n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, order_id uuid, version bigint);
         CREATE FUNCTION test_application_log() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO test_application (order_id, version) VALUES (NEW.order_id, NEW.version); RETURN NEW; END $$;
         CREATE TRIGGER test_application_log BEFORE INSERT ON order_projection
             FOR EACH ROW EXECUTE FUNCTION test_application_log();",
    )
    .execute(&admin)
    .await?;
    admin.close().await;
    let mut b = through(Service::new(&cluster.multihost_url, &broker.bootstrap))
        .with_env("KAFKA_SESSION_TIMEOUT", "10s")
        .with_env("KAFKA_ORDERS_TOPIC", &a.orders_topic)
        .with_env("KAFKA_PAYMENTS_TOPIC", &a.payments_topic)
        .with_env("KAFKA_GROUP_ID", &a.group);
    b.start().await?;

    // retried with the same key on errors, timeouts and 503 for several seconds, then unknown: shorter than
    // a failover, so some outcomes stay unknown until they are sent again after the faults
    let bounded = RetryPolicy {
        max_attempts: 10,
        base_delay: Duration::from_millis(100),
        max_delay: Duration::from_secs(1),
        timeout: Duration::from_secs(5),
    };
    let history: History = Arc::default();
    let successes: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let orders_sent: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let errors: Arc<AtomicUsize> = Arc::default();
    let stop = idem::CancellationToken::new();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (name, service) in [("jha0", &a), ("jha1", &a), ("jmh0", &b), ("jmh1", &b)] {
        let client = service.client_with(bounded.clone());
        let (history, successes, errors) = (history.clone(), successes.clone(), errors.clone());
        let task = client_loop(name.into(), client, start, history, successes, errors, stop.clone());
        tasks.push(tokio::spawn(task));
    }
    let orders = order_loop(broker.bootstrap.clone(), a.orders_topic.clone(), orders_sent.clone(), stop.clone());
    tasks.push(tokio::spawn(orders));
    let charged: Arc<Mutex<Vec<ThroughProvider>>> = Arc::default();
    for service in [&a, &b] {
        let (charged, successes, errors) = (charged.clone(), successes.clone(), errors.clone());
        tasks.push(tokio::spawn(provider_loop(service.base.clone(), charged, successes, start, errors, stop.clone())));
    }

    let mut injected = Vec::new();
    for fault in &run.schedule {
        tokio::time::sleep(run.quiet).await;
        let (at, wall) = (start.elapsed(), chrono::Utc::now());
        match fault {
            Fault::KillPrimary | Fault::IsolatePrimary | Fault::PartitionPrimary => {
                cluster.run(fault.name())?;
                tokio::time::sleep(run.hold).await;
                cluster.run("heal")?;
            }
            Fault::BrokerCut => {
                broker.proxy.cut();
                tokio::time::sleep(run.hold).await;
                broker.proxy.restore();
            }
            Fault::KillIdem => {
                b.kill9();
                tokio::time::sleep(Duration::from_secs(1)).await;
                b.start().await?;
            }
        }
        let healed = start.elapsed();
        // the next fault starts on a healthy cluster, with clients succeeding again (a partition healed
        // before a failover leaves commits waiting until the standby reconnects, seconds after `heal`)
        cluster.wait_healthy(Duration::from_secs(120))?;
        let ready = start.elapsed();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut recovered = false;
        while !recovered && Instant::now() < deadline {
            recovered = successes.lock().await.iter().any(|t| *t > ready);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        injected.push(Injected { fault: *fault, wall, at, healed, recovered, outage: Duration::ZERO, steady: None });
    }
    tokio::time::sleep(run.quiet).await;
    let stopped = start.elapsed();
    stop.cancel();
    for t in tasks {
        t.await?;
    }

    // every unknown outcome sent again, the same request with its key, until it is definite
    let patient = a.client_with(RetryPolicy {
        max_attempts: 120,
        base_delay: Duration::from_millis(200),
        max_delay: Duration::from_secs(1),
        timeout: Duration::from_secs(5),
    });
    let mut history = std::mem::take(&mut *history.lock().await);
    for (inv, request) in history.iter_mut().filter(|(i, _)| i.outcome == Outcome::Unknown) {
        inv.resolved = Some(send(&patient, &inv.key, request, &errors).await);
    }
    let history: Vec<Invocation> = history.into_iter().map(|(i, _)| i).collect();
    let mut charged = std::mem::take(&mut *charged.lock().await);
    let unknown = charged.iter().filter(|t| t.outcome == Outcome::Unknown).count();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    for t in charged.iter_mut().filter(|t| t.outcome == Outcome::Unknown) {
        // a record held by a killed attempt is taken over once its lease lapsed (6 s)
        t.outcome = charge_through_provider(&http, &a.base, &t.key, &t.body, Duration::from_secs(60), &errors).await;
    }

    let observed = observe(&cluster.url, &broker.bootstrap, &a.payments_topic, orders_sent).await?;
    let successes = {
        let mut s = successes.lock().await.clone();
        s.sort();
        s
    };
    let first_fault = injected.first().map_or(start.elapsed(), |f| f.at);
    let before = successes.iter().filter(|t| **t < first_fault).count();
    let baseline = before as f64 / first_fault.as_secs_f64().max(1.0);
    let ends: Vec<Duration> = injected.iter().skip(1).map(|f| f.at).chain([stopped]).collect();
    for (f, until) in injected.iter_mut().zip(ends) {
        (f.outage, f.steady) = history::recovery(&successes, f.at, until, baseline);
    }
    let verdict = history::check(&history, &observed);
    let provider = ProviderVerdict { unknown, ..check_provider(&cluster.url, &standin, &charged).await? };
    a.terminate();
    b.terminate();
    let server_errors = errors.load(Relaxed);
    Ok(Report {
        verdict,
        faults: injected,
        orders: observed.orders_sent.len(),
        server_errors,
        provider,
        elapsed: started.elapsed(),
    })
}

/// Reads payments, refunds, executions and order applications into `o`; returns the counts of payments,
/// refunds, unpublished outbox rows and applications, to tell whether anything moved since.
async fn read_database(db: &sqlx::PgPool, o: &mut Observed) -> anyhow::Result<(usize, usize, i64, usize)> {
    o.payments.clear();
    o.through_provider = sqlx::query_scalar("SELECT external_payment_id FROM payment WHERE through_provider")
        .fetch_all(db)
        .await?
        .into_iter()
        .collect();
    let rows: Vec<(String, String, Decimal)> =
        sqlx::query_as("SELECT external_payment_id, id::text, amount FROM payment").fetch_all(db).await?;
    for (external, id, amount) in rows {
        o.payments.entry(external).or_default().push((id, amount));
    }
    let rows: Vec<(String, String, Decimal)> =
        sqlx::query_as("SELECT id::text, payment_id::text, amount FROM refund").fetch_all(db).await?;
    o.refunds = rows.into_iter().map(|(id, p, a)| (id, (p, a))).collect();
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT external_payment_id, count(*) FROM test_payment_attempt WHERE external_payment_id IS NOT NULL
             GROUP BY 1",
    )
    .fetch_all(db)
    .await?;
    o.executions = rows.into_iter().collect();
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT o.order_id::text, (SELECT count(*) FROM test_application a WHERE a.order_id = o.order_id),
                (SELECT count(*) FROM payment p WHERE p.order_id = o.order_id)
         FROM (SELECT DISTINCT order_id FROM test_application) o",
    )
    .fetch_all(db)
    .await?;
    o.orders = rows.into_iter().map(|(order, applied, paid)| (order, (applied, paid))).collect::<BTreeMap<_, _>>();
    let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_message").fetch_one(db).await?;
    let payments = o.payments.values().map(Vec::len).sum();
    let applications = o.orders.values().map(|(a, _)| *a as usize).sum();
    Ok((payments, o.refunds.len(), outbox, applications))
}

/// Reads what the cluster and the topic hold once the outbox drained and the order events were consumed.
async fn observe(
    url: &str,
    brokers: &str,
    payments_topic: &str,
    orders_sent: Arc<Mutex<BTreeSet<String>>>,
) -> anyhow::Result<Observed> {
    let db = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(url).await?;
    let orders_sent = orders_sent.lock().await.clone();
    // settled: the outbox drained and every order event paid — or, where payments were lost (the control
    // run), nothing changed for 25 s
    let (deadline, mut last, mut still) = (Instant::now() + Duration::from_secs(120), (-1, -1), Instant::now());
    loop {
        let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_message").fetch_one(&db).await?;
        let paid: i64 =
            sqlx::query_scalar("SELECT count(DISTINCT order_id) FROM payment WHERE external_payment_id LIKE 'order-%'")
                .fetch_one(&db)
                .await?;
        if outbox == 0 && paid as usize >= orders_sent.len() {
            break;
        }
        if (outbox, paid) != last {
            (last, still) = ((outbox, paid), Instant::now());
        }
        // 25 s: a killed instance's partitions move to the other after the session timeout (10 s) and a
        // rebalance; order events waiting for that are not lost
        if Instant::now() > deadline || (outbox == 0 && still.elapsed() > Duration::from_secs(25)) {
            println!("not settled: {outbox} outbox rows, {paid} of {} order events paid", orders_sent.len());
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // The database and the topic, read as one state: the database, then the topic, then the database again,
    // until nothing changed between the two reads (a late consumer batch committed and published between
    // them would look like an event of a payment not stored — it did once, before this).
    let mut o = Observed { orders_sent, ..Observed::default() };
    for attempt in 0..5 {
        let before = read_database(&db, &mut o).await?;
        let announcements = o.payments.values().map(Vec::len).sum::<usize>() + o.refunds.len();
        o.events.clear();
        // re-published rows (after a crash) take room: read well past the count, up to the timeout
        for m in read_topic(brokers, payments_topic, announcements * 3, Duration::from_secs(20)).await? {
            let body: serde_json::Value = serde_json::from_slice(&m.payload).unwrap_or_default();
            o.events.push(Event {
                event_id: m.header("event_id").unwrap_or_default(),
                event_type: body["type"].as_str().unwrap_or_default().to_owned(),
                payment_id: body["payment_id"].as_str().unwrap_or_default().to_owned(),
                refund_id: body["refund_id"].as_str().map(str::to_owned),
                order_id: body["order_id"].as_str().unwrap_or_default().to_owned(),
            });
        }
        let after = read_database(&db, &mut o).await?;
        if before == after {
            break;
        }
        println!("the database changed while the topic was read ({before:?} -> {after:?}): read again ({attempt})");
    }
    // what the database says of an announced payment it does not hold (for the report)
    let stored: BTreeSet<&str> = o.payments.values().flatten().map(|(id, _)| id.as_str()).collect();
    let mut explained = BTreeSet::new();
    for m in &o.events {
        if m.event_type == "PaymentCaptured" && !stored.contains(m.payment_id.as_str()) && explained.insert(&m.order_id)
        {
            let facts: (i64, i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM payment WHERE order_id::text = $1),
                        (SELECT count(*) FROM test_application WHERE order_id::text = $1),
                        (SELECT count(*) FROM order_projection WHERE order_id::text = $1)",
            )
            .bind(&m.order_id)
            .fetch_one(&db)
            .await?;
            let minted = Uuid::parse_str(&m.payment_id).ok().and_then(|u| u.get_timestamp()).map(|t| t.to_unix());
            println!(
                "  announced payment {} (minted at unix {minted:?}) of order {} is not stored: (payments, \
                 applications, projection rows) of the order {facts:?}",
                m.payment_id, m.order_id
            );
        }
    }
    db.close().await;
    Ok(o)
}

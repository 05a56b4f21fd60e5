//! Shared helpers of the benchmarks: latency summaries and table printing.

#![allow(dead_code, clippy::print_stdout, clippy::disallowed_methods)]

use std::time::Duration;

pub mod load;
pub mod relay;

/// Throughput and latency of one measured phase.
#[derive(Debug, Clone)]
pub struct Summary {
    pub name: String,
    pub ops: usize,
    pub errors: usize,
    pub elapsed: Duration,
    pub p50: Duration,
    pub p99: Duration,
}

impl Summary {
    pub fn from_latencies(name: &str, mut latencies: Vec<Duration>, errors: usize, elapsed: Duration) -> Self {
        latencies.sort_unstable();
        let pick = |q: f64| {
            if latencies.is_empty() {
                Duration::ZERO
            } else {
                let idx = ((latencies.len() as f64 - 1.0) * q).round() as usize;
                latencies[idx.min(latencies.len() - 1)]
            }
        };
        Self { name: name.to_owned(), ops: latencies.len(), errors, elapsed, p50: pick(0.50), p99: pick(0.99) }
    }

    pub fn rate(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

pub fn print_table(rows: &[Summary]) {
    println!("{:<44} {:>10} {:>8} {:>12} {:>10} {:>10}", "phase", "ops", "errors", "ops/s", "p50 ms", "p99 ms");
    for r in rows {
        println!(
            "{:<44} {:>10} {:>8} {:>12.0} {:>10.2} {:>10.2}",
            r.name,
            r.ops,
            r.errors,
            r.rate(),
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3
        );
    }
}

pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Runs `pgbench` with a script and returns its transactions per second (excluding connection time).
pub fn pgbench(url: &str, script: &str, clients: usize, seconds: u64) -> anyhow::Result<f64> {
    let out = std::process::Command::new("pgbench")
        .args([
            "-n",
            "-M",
            "prepared",
            "-c",
            &clients.to_string(),
            "-j",
            "2",
            "-T",
            &seconds.to_string(),
            "-f",
            script,
            url,
        ])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(out.status.success(), "pgbench failed: {}{}", text, String::from_utf8_lossy(&out.stderr));
    text.lines()
        .find_map(|l| l.strip_prefix("tps = ").and_then(|r| r.split_whitespace().next()).and_then(|v| v.parse().ok()))
        .ok_or_else(|| anyhow::anyhow!("no tps in pgbench output: {text}"))
}

pub const API_KEY: &str = "bench_key_0123456789";

/// A new charge's body: fresh order, customer and provider payment id.
pub fn charge_body() -> String {
    serde_json::json!({
        "order_id": uuid::Uuid::now_v7(),
        "customer_id": uuid::Uuid::now_v7(),
        "provider": "bench",
        "external_payment_id": uuid::Uuid::now_v7().to_string(),
        "amount": "12.34",
        "currency": "EUR",
    })
    .to_string()
}

/// A running `idem serve`, stopped with SIGTERM when dropped.
pub struct Service {
    child: std::process::Child,
    pub base: String,
    /// The admin listener (`/metrics`).
    pub admin: String,
}

/// CPU seconds process `pid` has used so far (user + system, from `/proc`; USER_HZ is 100 on Linux).
pub fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat_ticks(&stat, &[11, 12]) / 100.0)
}

/// CPU seconds used by this process's children that ended and were waited for (pgbench runs).
pub fn children_cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat").map_or(0.0, |stat| stat_ticks(&stat, &[13, 14]) / 100.0)
}

/// CPU seconds used so far by every process whose command name starts with `prefix` (`postgres`: the
/// server and its backends; `tansu`: the broker), with the children they waited for (the postmaster
/// waits for every ended backend, so pgbench's connections are counted after they close).
pub fn cpu_seconds_of(prefix: &str) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else { return 0.0 };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|comm| comm.starts_with(prefix)))
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            Some(stat_ticks(&stat, &[11, 12, 13, 14]) / 100.0)
        })
        .sum()
}

/// Sum of the given fields of a `/proc/<pid>/stat` line, counted after the command name (which may hold
/// spaces): 11 utime, 12 stime, 13 cutime, 14 cstime.
fn stat_ticks(stat: &str, fields: &[usize]) -> f64 {
    let Some((_, rest)) = stat.rsplit_once(')') else { return 0.0 };
    let all: Vec<&str> = rest.split_whitespace().collect();
    fields.iter().filter_map(|&i| all.get(i)?.parse::<f64>().ok()).sum()
}

impl Service {
    /// CPU seconds the service process has used so far (user + system, from `/proc`).
    pub fn cpu_seconds(&self) -> Option<f64> {
        process_cpu_seconds(self.child.id())
    }

    /// The service's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The value of `metric` (a counter or gauge without labels) on the service's `/metrics`.
    pub async fn metric(&self, metric: &str) -> anyhow::Result<f64> {
        let text = reqwest::get(format!("{}/metrics", self.admin)).await?.text().await?;
        text.lines()
            .find_map(|l| l.strip_prefix(metric).and_then(|rest| rest.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| anyhow::anyhow!("{metric} not in /metrics"))
    }
}

impl Service {
    /// The process's resident memory (`VmRSS` in `/proc/<pid>/status`), in bytes.
    pub fn rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim();
        Some(kb.parse::<u64>().ok()? * 1024)
    }

    /// SIGKILL: the process ends wherever it is, as in a crash or an OOM kill.
    pub fn crash(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return; // already ended (crashed on purpose): nothing to stop
        }
        let _ = std::process::Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let _ = self.child.wait();
    }
}

/// Starts `idem serve` from `bin` on `port` against `db_url` and waits until it answers.
pub async fn start_service(bin: &str, db_url: &str, port: u16, layer: &str) -> anyhow::Result<Service> {
    start_service_with(bin, db_url, port, layer, &[]).await
}

/// [`start_service`] with extra environment for this service (after `BENCH_SERVICE_ENV`).
pub async fn start_service_with(
    bin: &str,
    db_url: &str,
    port: u16,
    layer: &str,
    env: &[(&str, &str)],
) -> anyhow::Result<Service> {
    let mut cmd = std::process::Command::new(bin);
    cmd.arg("serve")
        .env("DATABASE_URL", db_url)
        .env("HTTP_ADDR", format!("127.0.0.1:{port}"))
        .env("ADMIN_ADDR", format!("127.0.0.1:{}", port + 1000))
        .env("IDEM_API_KEYS", format!("bench:{API_KEY}"))
        .env("IDEMPOTENCY_LAYER", layer)
        // The pool keeps the service's default (32 connections) at every client count: group commit needs
        // concurrent committers, not one connection per client (BENCHMARKS.md: 32 against 72 at 64 clients).
        // One merchant drives all the load: its concurrency limit must not be what is measured.
        .env("MERCHANT_CONCURRENCY", env_or("BENCH_CONCURRENCY", 8usize).max(16).to_string())
        // ... nor its bound on new keys per second (thousands of new keys a second are the load)
        .env("MERCHANT_NEW_KEYS_PER_SECOND", "0")
        .env("RUST_LOG", "warn");
    // BENCH_SERVICE_ENV="K=V K2=V2": extra environment for the service only (for example
    // TOKIO_WORKER_THREADS=1 or DATABASE_MAX_CONNECTIONS=32), so a setting can be measured without
    // touching the load generator; it overrides the settings above, and `env` overrides it.
    for pair in std::env::var("BENCH_SERVICE_ENV").unwrap_or_default().split_whitespace() {
        if let Some((k, v)) = pair.split_once('=') {
            cmd.env(k, v);
        }
    }
    let child = cmd.envs(env.iter().copied()).spawn()?;
    answering(child, port, port + 1000).await
}

/// Starts another HTTP service (`bin` with `env`) on `port` and waits until it answers.
pub async fn start_process(bin: &str, port: u16, env: &[(&str, &str)]) -> anyhow::Result<Service> {
    let child =
        std::process::Command::new(bin).envs(env.iter().copied()).stdout(std::process::Stdio::null()).spawn()?;
    answering(child, port, port).await
}

/// `child` as a [`Service`] once `port` answers HTTP (any status).
async fn answering(child: std::process::Child, port: u16, admin_port: u16) -> anyhow::Result<Service> {
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    for _ in 0..200 {
        if client.get(format!("{base}/healthz")).send().await.is_ok() {
            return Ok(Service { child, base, admin: format!("http://127.0.0.1:{admin_port}") });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("idem did not start on port {port}")
}

/// Drops and creates database `name`; returns its URL.
pub async fn fresh_database(admin: &str, name: &str) -> anyhow::Result<String> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(admin).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).execute(&mut conn).await?;
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await?;
    Ok(idem_tests::with_database(admin, name))
}

/// A fresh, migrated database `name` behind a store.
pub async fn fresh_store(admin: &str, name: &str) -> anyhow::Result<idem_postgres::PgStore> {
    let url = fresh_database(admin, name).await?;
    let store = idem_postgres::PgStore::connect(&url, &idem_postgres::PoolSettings::default()).await?;
    store.migrate_schema_first(&idem_tests::REFERENCE_MIGRATOR).await?;
    Ok(store)
}

/// The database admin URL and the brokers, or `None` when cargo only probes the bench binary
/// (`--list`/`--test`): the benchmarks run only when asked.
pub fn bench_env() -> Option<(String, String)> {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return None;
    }
    let admin = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    Some((admin, brokers))
}

//! Shared helpers of the benchmarks: latency summaries and table printing.

#![allow(dead_code, clippy::print_stdout)]

use std::time::Duration;

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

//! Issue 44: what one hostile webhook costs the service. A release `idem serve` (IDEM_BIN) with a webhook
//! secret; BENCH_REQUESTS (300) requests of each shape from 3 clients, and the service's own CPU (from
//! `/proc`) per request:
//!
//! - **worst case**: a body at the route's limit (256 KiB) with the most signatures a header may carry
//!   (four), all wrong: one MAC over the body, `401`;
//! - **the review's request**: a 2 MB body and 200 signatures: `413` before any MAC work;
//! - **small**: a 100-byte body with one wrong signature (the floor: HTTP, routing, the refusal).
//!
//! Prints CPU per request and the worst case's ratio to 1 ms. Run with `scripts/bench.sh webhook`.

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::disallowed_methods)]

mod common;

use common::{bench_env, env_or, start_service_with};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Some((admin, _brokers)) = bench_env() else { return Ok(()) };
    let bin = std::env::var("IDEM_BIN").unwrap_or_else(|_| "target/release/idem".into());
    let url = common::fresh_database(&admin, "idem_bench_webhook").await?;
    let service = start_service_with(
        &bin,
        &url,
        18_480,
        "on",
        &[
            ("PAYMENT_PROVIDER_URL", "http://127.0.0.1:9"),
            ("PAYMENT_PROVIDER_API_KEY", "sk_bench_never_called"),
            ("PAYMENT_PROVIDER_WEBHOOK_SECRET", "whsec_bench_0123456789abcdef"),
        ],
    )
    .await?;
    let requests: usize = env_or("BENCH_REQUESTS", 300);
    let now = chrono::Utc::now().timestamp();
    let header = |n: usize| {
        let mut h = format!("t={now}");
        for _ in 0..n {
            h.push_str(&format!(",v1={}", "ab".repeat(32)));
        }
        h
    };
    let shapes = [
        ("worst case: 256 KiB, 4 signatures", vec![b' '; 256 * 1024], header(4), 401),
        ("the review's: 2 MB, 200 signatures", vec![b' '; 2 << 20], header(200), 413),
        ("small: 100 B, 1 signature", vec![b' '; 100], header(1), 401),
    ];
    let client = reqwest::Client::new();
    let target = format!("{}/webhooks/payment-provider", service.base);
    println!("{:<40} {:>14} {:>8}", "request", "CPU/request", "status");
    let mut worst = 0.0;
    for (name, body, header, expected) in shapes {
        let before = service.cpu_seconds().unwrap_or_default();
        let per_client = requests / 3;
        let mut tasks = Vec::new();
        for _ in 0..3 {
            let (client, target, body, header) = (client.clone(), target.clone(), body.clone(), header.clone());
            tasks.push(tokio::spawn(async move {
                let mut statuses = Vec::new();
                for _ in 0..per_client {
                    let sent = client
                        .post(&target)
                        .header("provider-signature", &header)
                        .body(body.clone())
                        .send()
                        .await
                        .map(|r| r.status().as_u16());
                    statuses.push(sent.unwrap_or(0));
                }
                statuses
            }));
        }
        let mut statuses = Vec::new();
        for t in tasks {
            statuses.extend(t.await?);
        }
        let cpu = (service.cpu_seconds().unwrap_or_default() - before) / statuses.len() as f64;
        // 0: the connection closed while the client still sent the body (after a 413, the server stops reading)
        let mut tally = std::collections::BTreeMap::<u16, usize>::new();
        for status in &statuses {
            *tally.entry(*status).or_default() += 1;
        }
        let shown: Vec<String> =
            tally.iter().map(|(s, n)| if *s == 0 { format!("closed x{n}") } else { format!("{s} x{n}") }).collect();
        assert!(tally.keys().all(|s| *s == expected || (*s == 0 && expected == 413)), "{name}: {shown:?}");
        println!("{name:<40} {:>11.3} ms   {}", cpu * 1e3, shown.join(", "));
        if expected == 401 && body.len() > 1024 {
            worst = cpu;
        }
    }
    println!("worst case / 1 ms of CPU: {:.2}", worst / 1e-3);
    Ok(())
}

//! Operating idem: the `idem dlq|outbox|keys|cleanup` subcommands driven against a running service, and
//! the shipped alert rules and dashboard checked against what the service exports.

#![allow(clippy::disallowed_methods)] // tests make their own ids and read the clock
#![allow(clippy::print_stdout, clippy::unwrap_used)]

#[allow(dead_code)]
#[path = "../faults/harness.rs"]
mod harness;
mod tracing;

use std::collections::BTreeSet;
use std::time::Duration;

use harness::{API_KEY, Service, charge_request, placed};
use idem_tests::TestDb;
use idem_tests::effects::{applications_of_order, log_order_applications};
use idem_tests::kafka::{eventually, produce, producer};
use serde_json::{Value, json};
use uuid::Uuid;

fn ops_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops")
}

/// Runs `idem <args>` for `service` and parses its `--json` output; fails with stderr when it fails.
fn idem_json(service: &Service, args: &[&str]) -> anyhow::Result<Value> {
    let mut args = args.to_vec();
    args.push("--json");
    let out = service.idem(&args)?;
    anyhow::ensure!(
        out.status.success(),
        "idem {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

async fn payments_of(db: &TestDb, external: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM payment WHERE external_payment_id = $1")
        .bind(external)
        .fetch_one(db.pool())
        .await?)
}

/// Dead letters are listed with a summary by reason and shown with their provenance; an event older than
/// the dedup window is re-driven only with `--admit-late`, then applied exactly once even when delivered
/// again; every re-drive is recorded with who did it.
#[tokio::test]
async fn dead_letters_are_listed_shown_and_redriven_once() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    log_order_applications(&db).await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&db.url, &brokers);
    service.start().await?;
    let p = producer(&brokers)?;
    let topic = service.orders_topic.clone();
    // one malformed body, one event 80 h old (DEDUP_TTL is 72 h)
    let bad_id = Uuid::now_v7().to_string();
    produce(&p, &topic, Some("k1"), b"{\"type\":", &[("event_id", bad_id.as_bytes())]).await?;
    let old_id = idem_tests::v7_at(chrono::Utc::now() - chrono::Duration::hours(80));
    let old_order = Uuid::now_v7();
    let old_body = placed(old_order, "pi_ops_late");
    let old_id_text = old_id.to_string();
    let old_headers: [(&str, &[u8]); 1] = [("event_id", old_id_text.as_bytes())];
    produce(&p, &topic, Some(&old_order.to_string()), old_body.as_bytes(), &old_headers).await?;

    let listed = eventually(Duration::from_secs(60), || async {
        Ok(idem_json(&service, &["dlq", "list"])?["total"].as_u64() == Some(2))
    })
    .await?;
    assert!(listed, "two dead letters expected: {}", idem_json(&service, &["dlq", "list"])?);
    let list = idem_json(&service, &["dlq", "list"])?;
    let reasons: BTreeSet<&str> =
        list["by_reason"].as_array().unwrap().iter().map(|r| r["reason"].as_str().unwrap()).collect();
    assert_eq!(reasons, BTreeSet::from(["malformed", "older-than-dedup-window"]), "{list}");
    let old = list["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["reason"] == "older-than-dedup-window")
        .unwrap()
        .clone();
    let position = old["position"].as_str().unwrap().to_owned();
    assert_eq!(old["event_id"], json!(old_id.to_string()));
    let filtered = idem_json(&service, &["dlq", "list", "--reason", "malformed"])?;
    assert_eq!(filtered["total"], 1, "{filtered}");

    let shown = idem_json(&service, &["dlq", "show", &position, "--payload"])?;
    assert_eq!(shown["headers"]["dlq.original.topic"], json!(topic), "{shown}");
    assert_eq!(shown["headers"]["dlq.consumer.group"], json!(service.group), "{shown}");
    assert!(shown["headers"]["dlq.error"].as_str().unwrap().contains("admission floor"), "{shown}");
    assert_eq!(shown["payload"], json!(old_body));

    // without --admit-late the old event is not re-driven
    let refused = idem_json(&service, &["dlq", "redrive", "--all-matching", "--reason", "older-than-dedup-window"])?;
    assert_eq!(refused["redriven"].as_array().unwrap().len(), 0, "{refused}");
    assert!(refused["skipped"][0]["why"].as_str().unwrap().contains("--admit-late"), "{refused}");

    let done = idem_json(
        &service,
        &["dlq", "redrive", "--all-matching", "--reason", "older-than-dedup-window", "--admit-late", "--by", "alice"],
    )?;
    assert_eq!(done["redriven"].as_array().unwrap().len(), 1, "{done}");
    let applied =
        eventually(Duration::from_secs(30), || async { Ok(payments_of(&db, "pi_ops_late").await? == 1) }).await?;
    assert!(applied, "the admitted event was never applied");

    // the same dead letter again: refused; the same event delivered again: not applied twice
    let again = idem_json(&service, &["dlq", "redrive", "--id", &position, "--admit-late"])?;
    assert_eq!(again["skipped"][0]["why"], "re-driven already", "{again}");
    produce(&p, &topic, Some(&old_order.to_string()), old_body.as_bytes(), &old_headers).await?;
    let marker = Uuid::now_v7();
    let (marker_body, marker_id) = (placed(marker, "pi_ops_marker"), Uuid::now_v7().to_string());
    produce(&p, &topic, Some(&marker.to_string()), marker_body.as_bytes(), &[("event_id", marker_id.as_bytes())])
        .await?;
    let behind =
        eventually(Duration::from_secs(30), || async { Ok(payments_of(&db, "pi_ops_marker").await? == 1) }).await?;
    assert!(behind, "the consumer stopped");
    assert_eq!(payments_of(&db, "pi_ops_late").await?, 1);
    // counted as applications: the order handler is idempotent on its own, payments cannot show a second one
    assert_eq!(applications_of_order(&db, old_order).await?, 1, "a late-admitted event was applied twice");

    let (by, late): (String, bool) =
        sqlx::query_as("SELECT redriven_by, admitted_late FROM dlq_redrive WHERE event_id = $1")
            .bind(old_id)
            .fetch_one(db.pool())
            .await?;
    assert_eq!((by.as_str(), late), ("alice", true));
    Ok(())
}

/// Issue 24.1 through the real binary: with `DEDUP_TTL=24h`, an event dated just inside the admission floor
/// is applied; the same event arrives again once the floor has passed it and is dead-lettered
/// `older-than-dedup-window`. `idem dlq redrive --admit-late` reports it as applied already (its processed row
/// is alive) and does not re-drive it; and a copy produced anyway with its admission recorded (what the old
/// re-drive did) is counted as a duplicate, not applied a second time.
#[tokio::test]
async fn a_late_redrive_of_an_event_applied_inside_the_window_is_not_applied_again() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    log_order_applications(&db).await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&db.url, &brokers).with_env("DEDUP_TTL", "24h");
    service.start().await?;
    let p = producer(&brokers)?;
    let topic = service.orders_topic.clone();
    // the admission floor of a 24 h window is 23 h back: it passes this id's time 8 s from now
    let crossing = chrono::Utc::now() + chrono::Duration::seconds(8);
    let id = idem_tests::v7_at(crossing - chrono::Duration::hours(23));
    let order = Uuid::now_v7();
    let body = placed(order, "pi_ops_edge");
    let id_text = id.to_string();
    let headers: [(&str, &[u8]); 1] = [("event_id", id_text.as_bytes())];
    produce(&p, &topic, Some(&order.to_string()), body.as_bytes(), &headers).await?;
    let applied =
        eventually(Duration::from_secs(30), || async { Ok(applications_of_order(&db, order).await? == 1) }).await?;
    assert!(applied, "the first delivery was not applied");
    let wait = (crossing + chrono::Duration::seconds(1) - chrono::Utc::now()).to_std().unwrap_or_default();
    tokio::time::sleep(wait).await;
    produce(&p, &topic, Some(&order.to_string()), body.as_bytes(), &headers).await?;
    let refused = eventually(Duration::from_secs(30), || async {
        Ok(idem_json(&service, &["dlq", "list", "--reason", "older-than-dedup-window"])?["total"].as_u64() == Some(1))
    })
    .await?;
    assert!(
        refused,
        "the second delivery past the floor was not dead-lettered: {}",
        idem_json(&service, &["dlq", "list"])?
    );
    let done = idem_json(
        &service,
        &["dlq", "redrive", "--all-matching", "--reason", "older-than-dedup-window", "--admit-late", "--by", "bob"],
    )?;
    assert_eq!(done["redriven"].as_array().unwrap().len(), 0, "{done}");
    assert!(done["skipped"][0]["why"].as_str().unwrap().contains("applied already"), "{done}");
    // the old re-drive: admission recorded, the message produced again
    sqlx::query(
        "INSERT INTO late_admission (consumer, event_id, admitted_by, admitted_at) VALUES ($1, $2, 'bob', now())",
    )
    .bind(&service.group)
    .bind(id)
    .execute(db.pool())
    .await?;
    produce(&p, &topic, Some(&order.to_string()), body.as_bytes(), &headers).await?;
    let marker = Uuid::now_v7();
    let (marker_body, marker_id) = (placed(marker, "pi_ops_edge_marker"), Uuid::now_v7().to_string());
    produce(&p, &topic, Some(&marker.to_string()), marker_body.as_bytes(), &[("event_id", marker_id.as_bytes())])
        .await?;
    let behind =
        eventually(Duration::from_secs(30), || async { Ok(applications_of_order(&db, marker).await? == 1) }).await?;
    assert!(behind, "the consumer stopped");
    assert_eq!(applications_of_order(&db, order).await?, 1, "the late-admitted copy was applied a second time");
    Ok(())
}

/// Issue 24.3: a producer to the orders topic forges the provenance headers of a dead letter. The dead
/// letter shows the consumer's own topic as its source, and a bulk re-drive produces it to the orders topic,
/// never to the payments topic the forged header named.
#[tokio::test]
async fn forged_dead_letter_headers_cannot_redirect_a_redrive() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&db.url, &brokers);
    service.start().await?;
    let p = producer(&brokers)?;
    let topic = service.orders_topic.clone();
    let forged_id = Uuid::now_v7().to_string();
    let payments = service.payments_topic.clone();
    produce(
        &p,
        &topic,
        Some("k-forged"),
        b"{\"attacker\":true}",
        &[
            ("event_id", forged_id.as_bytes()),
            ("dlq.original.topic", payments.as_bytes()),
            ("dlq.reason", b"malformed"),
            ("dlq.consumer.group", b"someone-else"),
        ],
    )
    .await?;
    let listed = eventually(Duration::from_secs(60), || async {
        Ok(idem_json(&service, &["dlq", "list"])?["total"].as_u64() == Some(1))
    })
    .await?;
    assert!(listed, "no dead letter: {}", idem_json(&service, &["dlq", "list"])?);
    let list = idem_json(&service, &["dlq", "list"])?;
    let dead = &list["dead_letters"][0];
    assert_eq!(dead["source_topic"], json!(topic), "the forged source topic was believed: {list}");
    let shown = idem_json(&service, &["dlq", "show", dead["position"].as_str().unwrap()])?;
    assert_eq!(shown["headers"]["dlq.consumer.group"], json!(service.group), "{shown}");

    let done = idem_json(&service, &["dlq", "redrive", "--all-matching", "--reason", "malformed", "--by", "ops"])?;
    assert_eq!(done["redriven"].as_array().unwrap().len(), 1, "{done}");
    let on_payments = idem_tests::kafka::read_topic(&brokers, &payments, 1, Duration::from_secs(8)).await?;
    assert!(
        on_payments.iter().all(|m| m.header("event_id").as_deref() != Some(forged_id.as_str())),
        "the forged message reached the payments topic"
    );
    let on_orders = idem_tests::kafka::read_topic(&brokers, &topic, 2, Duration::from_secs(20)).await?;
    let copies = on_orders.iter().filter(|m| m.header("event_id").as_deref() == Some(forged_id.as_str())).count();
    assert_eq!(copies, 2, "the re-drive went back to the orders topic");
    Ok(())
}

/// Issue 24.6 through the real binary: `idem cleanup --once` from a host whose clock is two days ahead
/// (Debian's `faketime`) refuses, naming the skew, and the live idempotency record stays.
#[tokio::test]
async fn cleanup_from_a_host_clock_two_days_ahead_deletes_nothing() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&db.url, &brokers);
    service.start().await?;
    let key = idem_http::client::IdemClient::new_key();
    let reply = service.client().charge(&key, &charge_request("pi_ops_skew")).await?;
    assert_eq!(reply.status, 201);
    let out = service.idem_with_clock(Some("+2d"), &["cleanup", "--once"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a cleanup from a clock two days ahead ran: {stderr}");
    assert!(stderr.contains("differs from the database's"), "{stderr}");
    assert_eq!(db.count("idempotency_record").await?, 1, "the live record was deleted");
    let ok = service.idem(&["cleanup", "--once"])?;
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert_eq!(db.count("idempotency_record").await?, 1);
    Ok(())
}

/// Issue 24.4: settings whose change would re-open processed events are recorded at start and checked at
/// the next one. Switching DEDUP_STORAGE or renaming KAFKA_GROUP_ID is refused with what would be re-applied
/// and how to proceed (and starts when accepted deliberately); a raised DEDUP_TTL starts, and an event dated
/// between the old and the new window is still refused, as its row may have had the old retention.
#[tokio::test]
async fn settings_that_would_reopen_processed_events_are_refused_or_handled() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&db.url, &brokers).with_env("DEDUP_TTL", "24h");
    service.start().await?;
    service.terminate();

    let mut switched = service.with_env("DEDUP_STORAGE", "partitioned");
    let refused = switched.start().await.expect_err("a DEDUP_STORAGE switch started");
    assert!(refused.to_string().contains("DEDUP_STORAGE changed from table to partitioned"), "{refused}");
    assert!(refused.to_string().contains("IDEM_ACCEPT_SETTING_CHANGE=dedup-storage"), "{refused}");
    let mut renamed = switched.with_env("DEDUP_STORAGE", "table").with_env("KAFKA_GROUP_ID", "renamed-group");
    let refused = renamed.start().await.expect_err("a renamed group started");
    assert!(refused.to_string().contains("KAFKA_GROUP_ID changed from"), "{refused}");
    let mut accepted = renamed.with_env("IDEM_ACCEPT_SETTING_CHANGE", "consumer-group");
    accepted.start().await?;
    accepted.terminate();

    // DEDUP_TTL raised from 24 h to 72 h: starts; an event 30 h old may have been processed under 24 h
    let mut raised = accepted.with_env("DEDUP_TTL", "72h");
    raised.start().await?;
    let previous: Option<String> =
        sqlx::query_scalar("SELECT previous FROM idem_setting WHERE name = 'dedup_ttl/renamed-group'")
            .fetch_one(db.pool())
            .await?;
    assert_eq!(previous.as_deref(), Some("24h"));
    let p = producer(&brokers)?;
    let order = Uuid::now_v7();
    let id = idem_tests::v7_at(chrono::Utc::now() - chrono::Duration::hours(30)).to_string();
    produce(
        &p,
        &raised.orders_topic,
        Some(&order.to_string()),
        placed(order, "pi_raise").as_bytes(),
        &[("event_id", id.as_bytes())],
    )
    .await?;
    let refused = eventually(Duration::from_secs(60), || async {
        Ok(idem_json(&raised, &["dlq", "list", "--reason", "older-than-dedup-window"])?["total"].as_u64() == Some(1))
    })
    .await?;
    assert!(refused, "an event older than the old window was admitted right after the raise");
    assert_eq!(payments_of(&db, "pi_raise").await?, 0);
    Ok(())
}

/// Issue 24.8: a re-drive killed while the broker had not acknowledged its message (librdkafka's mock
/// cluster answers every Produce request with a retriable error meanwhile) leaves nothing behind: once the
/// broker is back the dead letter is re-driven. It used to be recorded before producing, and so stayed
/// "re-driven already" for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_killed_before_the_broker_acked_can_be_redriven_later() -> anyhow::Result<()> {
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

    let db = TestDb::new().await?;
    let mock = MockCluster::new(1)?;
    let service = Service::new(&db.url, &mock.bootstrap_servers());
    let (orders, dlq) = (service.orders_topic.clone(), format!("{}.dlq", service.orders_topic));
    mock.create_topic(&orders, 1, 1)?;
    mock.create_topic(&dlq, 1, 1)?;
    let p = producer(&mock.bootstrap_servers())?;
    let id = Uuid::now_v7().to_string();
    let headers: [(&str, &[u8]); 4] = [
        ("event_id", id.as_bytes()),
        ("dlq.reason", b"malformed"),
        ("dlq.original.topic", orders.as_bytes()),
        ("dlq.failed.at", b"2026-12-04T00:00:00Z"),
    ];
    let (partition, offset) = produce(&p, &dlq, Some("k"), b"{}", &headers).await?;
    let position = format!("{partition}:{offset}");
    mock.request_errors(RDKafkaApiKey::Produce, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS; 500]);
    let mut stuck = service.idem_spawn(&["dlq", "redrive", "--id", &position])?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(stuck.try_wait()?.is_none(), "the re-drive should still wait for the broker's acknowledgement");
    stuck.kill()?;
    let _ = stuck.wait();
    mock.clear_request_errors(RDKafkaApiKey::Produce);
    let done = idem_json(&service, &["dlq", "redrive", "--id", &position])?;
    assert_eq!(
        done["redriven"].as_array().unwrap().len(),
        1,
        "the killed re-drive left the dead letter behind: {done}"
    );
    let again = idem_json(&service, &["dlq", "redrive", "--id", &position])?;
    assert_eq!(again["skipped"][0]["why"], "re-driven already", "{again}");
    Ok(())
}

/// Issue 23.7: 300 connections that send half a request header are disconnected after the header-read
/// timeout, an idle keep-alive connection too, and a normal client is served meanwhile. `axum::serve` kept
/// them all open for ever (no timer in hyper), until descriptors ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_requests_are_disconnected_and_others_are_served() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&db.url, &brokers).with_env("HTTP_HEADER_READ_TIMEOUT", "1s");
    service.start().await?;
    let addr = service.base.trim_start_matches("http://").to_owned();
    let mut half_sent = Vec::new();
    for _ in 0..300 {
        let mut s = tokio::net::TcpStream::connect(&addr).await?;
        s.write_all(b"POST /payments HTTP/1.1\r\nHost: idem\r\nContent-Le").await?;
        half_sent.push(s);
    }
    // an idle keep-alive connection after one request
    let mut idle = tokio::net::TcpStream::connect(&addr).await?;
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: idem\r\n\r\n").await?;
    let mut first = [0u8; 256];
    let n = idle.read(&mut first).await?;
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&first[..n])
    );
    let healthy = reqwest::get(format!("{}/healthz", service.base)).await?;
    assert_eq!(healthy.status(), 200, "a normal client was not served beside 300 half-sent requests");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut open = 0;
    for mut s in half_sent.into_iter().chain([idle]) {
        let mut buf = [0u8; 512];
        // the server closed it: EOF (or a 408 and then EOF) at once; still open: the read waits
        let closed = loop {
            match tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await {
                Err(_) => break false,
                Ok(Ok(0)) | Ok(Err(_)) => break true,
                Ok(Ok(_)) => continue,
            }
        };
        if !closed {
            open += 1;
        }
    }
    assert_eq!(open, 0, "connections still open after the header-read timeout");
    let healthy = reqwest::get(format!("{}/healthz", service.base)).await?;
    assert_eq!(healthy.status(), 200);
    Ok(())
}

/// Issue 23.6: no secret reaches the output of real runs. A database password (in the user-info, with an
/// `@`, and as a query parameter: the local server trusts loopback, so any password works) and the API
/// keys are grepped for in everything `idem serve` prints at info level with a valid configuration, with
/// an invalid one, and in `--help`.
#[tokio::test]
async fn no_secret_reaches_the_output_of_valid_or_invalid_runs() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let (user_pw, query_pw, key) = ("pw@with@ats_71", "querypw_8812", "zz_secret_key_5531");
    let with_password = db.url.replacen("postgres://postgres@", &format!("postgres://postgres:{user_pw}@"), 1);
    anyhow::ensure!(with_password != db.url, "cannot add a password to {}", db.url);
    let url = format!("{with_password}?password={query_pw}");
    let valid = Service::new(&url, &brokers).with_env("IDEM_API_KEYS", &format!("faults:{key}"));
    let invalid = Service::new(&url, &brokers).with_env("IDEM_API_KEYS", &format!("faults:{key},other:short"));
    let bad_url = Service::new(&format!("{with_password}?password={query_pw}&sslmode=bogus"), &brokers)
        .with_env("IDEM_API_KEYS", &format!("faults:{key}"));
    let mut outputs = Vec::new();
    for service in [&valid, &invalid, &bad_url] {
        outputs.push(service.serve_output().await?);
    }
    let help = valid.idem(&["serve", "--help"])?;
    outputs.push(format!("{}{}", String::from_utf8_lossy(&help.stdout), String::from_utf8_lossy(&help.stderr)));
    assert!(outputs[0].contains("HTTP API listening"), "the valid run did not start: {}", outputs[0]);
    assert!(outputs[1].contains("IDEM_API_KEYS"), "the invalid run did not say why: {}", outputs[1]);
    for (i, out) in outputs.iter().enumerate() {
        for secret in [user_pw, "with@ats", query_pw, key] {
            assert!(!out.contains(secret), "run {i} printed the secret {secret}:\n{out}");
        }
    }
    Ok(())
}

/// A poison row is listed as quarantined with its attempts and error; `retry` releases it.
#[tokio::test]
async fn quarantined_outbox_rows_are_listed_and_retried() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&db.url, &brokers);
    service.start().await?;
    let poison = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, headers, created_at)
         VALUES ($1, $2, 'payment', 'poison', 'PaymentCaptured', $3, '{}', now())",
    )
    .bind(poison)
    .bind(&service.payments_topic)
    .bind(json!({ "blob": "x".repeat(2 << 20) }))
    .execute(db.pool())
    .await?;
    let quarantined = eventually(Duration::from_secs(30), || async {
        Ok(idem_json(&service, &["outbox", "list", "--quarantined"])?.as_array().is_some_and(|a| !a.is_empty()))
    })
    .await?;
    assert!(quarantined, "the poison row was never listed as quarantined");
    let rows = idem_json(&service, &["outbox", "list", "--quarantined"])?;
    assert_eq!(rows[0]["id"], json!(poison.to_string()), "{rows}");
    assert!(rows[0]["attempts"].as_i64().unwrap() >= 1 && rows[0]["last_error"].as_str().is_some(), "{rows}");
    let stuck = idem_json(&service, &["outbox", "list", "--stuck-for", "0s"])?;
    assert!(stuck.as_array().unwrap().iter().any(|r| r["id"] == json!(poison.to_string())), "{stuck}");

    let retried = idem_json(&service, &["outbox", "retry", &poison.to_string()])?;
    assert_eq!(retried["released"], json!([poison.to_string()]), "{retried}");
    assert_eq!(retried["older_than_dedup_window"], json!([]), "{retried}");
    let requarantined = eventually(Duration::from_secs(30), || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox_message WHERE id = $1 AND quarantined_at IS NOT NULL")
                .bind(poison)
                .fetch_one(db.pool())
                .await?;
        Ok(n == 1)
    })
    .await?;
    assert!(requarantined, "the released row was not attempted again");
    // issue 24.8: a row committed 80 h ago would be refused by every receiver: retry says so
    let (old, old_too) = (
        idem_tests::v7_at(chrono::Utc::now() - chrono::Duration::hours(80)),
        idem_tests::v7_at(chrono::Utc::now() - chrono::Duration::hours(81)),
    );
    for id in [old, old_too] {
        sqlx::query(
            "INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, headers, created_at, quarantined_at)
             VALUES ($1, $2, 'payment', $1::text, 'PaymentCaptured', '{}', '{}', now() - interval '80 hours', now())",
        )
        .bind(id)
        .bind(&service.payments_topic)
        .execute(db.pool())
        .await?;
    }
    let warned = idem_json(&service, &["outbox", "retry", &old.to_string()])?;
    assert_eq!(warned["older_than_dedup_window"], json!([old.to_string()]), "{warned}");
    let text = service.idem(&["outbox", "retry", &old_too.to_string()])?;
    assert!(String::from_utf8_lossy(&text.stdout).contains("older-than-dedup-window"));
    // an unknown id is reported and fails the command
    let out = service.idem(&["outbox", "retry", &Uuid::now_v7().to_string()])?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("not found or already published"));
    Ok(())
}

/// `keys show` prints what was stored for a key; the body only when asked.
#[tokio::test]
async fn a_key_shows_its_state_fingerprint_and_times() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&db.url, &brokers);
    service.start().await?;
    let key = idem_http::client::IdemClient::new_key();
    let reply = service.client().charge(&key, &charge_request("pi_ops_key")).await?;
    assert_eq!(reply.status, 201);
    let shown = idem_json(&service, &["keys", "show", "--merchant", "faults", "--key", &key])?;
    assert_eq!(shown["state"], "completed", "{shown}");
    assert_eq!(shown["status_code"], 201);
    assert_eq!(shown["fingerprint_sha256"].as_str().unwrap().len(), 64);
    assert_eq!(shown["expired"], false);
    assert!(shown.get("body").is_none(), "the body is shown only with --body");
    let created = chrono::DateTime::parse_from_rfc3339(shown["created_at"].as_str().unwrap())?;
    let expires = chrono::DateTime::parse_from_rfc3339(shown["expires_at"].as_str().unwrap())?;
    assert_eq!(expires - created, chrono::Duration::hours(48), "IDEMPOTENCY_TTL default");
    let with_body = idem_json(&service, &["keys", "show", "--merchant", "faults", "--key", &key, "--body"])?;
    assert!(with_body["body"].as_str().unwrap().contains(reply.body["id"].as_str().unwrap()));
    // another merchant's view of the key: nothing
    let out = service.idem(&["keys", "show", "--merchant", "other", "--key", &key])?;
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("no idempotency record"));
    let table = service.idem(&["keys", "show", "--merchant", "faults", "--key", &key])?;
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("FIELD") && text.contains("completed"), "{text}");
    let _ = API_KEY;
    Ok(())
}

/// `cleanup --once` on a large table reports progress as plain lines when not on a terminal.
#[tokio::test]
async fn cleanup_once_reports_progress() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let service = Service::new(&db.url, &brokers);
    db.store.migrate_schema_first(&idem_tests::REFERENCE_MIGRATOR).await?;
    sqlx::query(
        "INSERT INTO processed_event (consumer_name, event_id, topic, created_at, expires_at)
         SELECT 'g', gen_random_uuid(), 't', now() - interval '4 days', now() - interval '1 day'
         FROM generate_series(1, 120000)",
    )
    .execute(db.pool())
    .await?;
    let out = service.idem(&["cleanup", "--once", "--cleanup-batch-size", "5000"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("deleting expired rows: 120000 done"), "{stderr}");
    assert_eq!(db.count("processed_event").await?, 0);
    Ok(())
}

/// The shipped alert rules pass `promtool check rules` and their unit tests (`promtool test rules`).
#[test]
fn alert_rules_pass_promtool() {
    let dir = ops_dir().join("prometheus");
    for args in [vec!["check", "rules", "alerts.yml"], vec!["test", "rules", "alerts_test.yml"]] {
        let out = std::process::Command::new("promtool")
            .args(&args)
            .current_dir(&dir)
            .output()
            .expect("promtool is installed by scripts/services.sh");
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // every alert has a unit test
    let rules = std::fs::read_to_string(dir.join("alerts.yml")).unwrap();
    let tests = std::fs::read_to_string(dir.join("alerts_test.yml")).unwrap();
    for alert in rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")) {
        assert!(tests.contains(&format!("alertname: {alert}")), "alert {alert} has no unit test");
    }
}

/// Every metric the rules and the dashboard name is exported by the service.
#[tokio::test]
async fn every_metric_in_the_rules_and_dashboard_exists() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    // with a payment provider configured (never called here): its metrics are exported too
    let mut service = Service::new(&db.url, &brokers)
        .with_env("PAYMENT_PROVIDER_URL", "http://127.0.0.1:9")
        .with_env("PAYMENT_PROVIDER_API_KEY", "sk_test_never_called_0123");
    service.start().await?;
    let text = reqwest::get(format!("{}/metrics", service.admin)).await?.text().await?;
    let mut exported = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (name, kind) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
            exported.insert(name.to_owned());
            match kind {
                "counter" => {
                    exported.insert(format!("{name}_total"));
                }
                "histogram" => {
                    for suffix in ["_bucket", "_sum", "_count"] {
                        exported.insert(format!("{name}{suffix}"));
                    }
                }
                _ => {}
            }
        }
    }
    let sources = [
        std::fs::read_to_string(ops_dir().join("prometheus/alerts.yml"))?,
        std::fs::read_to_string(ops_dir().join("grafana/idem-dashboard.json"))?,
    ];
    let mut named = BTreeSet::new();
    for source in &sources {
        let bytes = source.as_bytes();
        let mut i = 0;
        while let Some(at) = source[i..].find("idem_") {
            let start = i + at;
            let end = start
                + bytes[start..]
                    .iter()
                    .take_while(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || **b == b'_')
                    .count();
            named.insert(source[start..end].to_owned());
            i = end;
        }
    }
    named.remove("idem_"); // prose, not a metric
    assert!(named.len() >= 15, "rules and dashboard name {} metrics: {named:?}", named.len());
    let missing: Vec<&String> = named.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(missing.is_empty(), "named in rules or dashboard but not exported: {missing:?}");
    Ok(())
}

/// The schemathesis CLI installed by `scripts/services.sh` (or on the PATH).
fn schemathesis() -> std::path::PathBuf {
    let local = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.local/st-venv/bin/schemathesis");
    if local.exists() { local } else { "schemathesis".into() }
}

fn run_schemathesis(location: &str, base: &str, extra: &[&str]) -> std::process::Output {
    let auth = format!("Authorization: Bearer {API_KEY}");
    let dir = std::env::temp_dir().join(format!("st-{}", Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    std::process::Command::new(schemathesis())
        .args(["run", location, "--url", base, "--checks", "all", "-H", &auth, "--seed", "20261203"])
        .args(extra)
        .current_dir(&dir)
        .env("NO_COLOR", "1")
        .output()
        .expect("schemathesis is installed by scripts/services.sh")
}

/// The served API document is the contract: schemathesis, with every check and its stateful phase (links
/// from a charge to its read and refund), finds no request the server treats differently from the
/// document and no response the document does not describe.
#[tokio::test]
async fn schemathesis_finds_nothing_against_the_served_document() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&db.url, &brokers).with_env("MERCHANT_CONCURRENCY", "64");
    service.start().await?;
    let location = format!("{}/openapi.json", service.base);
    let out = tokio::task::spawn_blocking({
        let base = service.base.clone();
        move || run_schemathesis(&location, &base, &["--max-time", "45"])
    })
    .await?;
    let report = String::from_utf8_lossy(&out.stdout);
    println!("{report}");
    assert!(out.status.success(), "schemathesis found problems:\n{report}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(report.contains("Stateful") && report.contains("No issues found"), "{report}");
    let charges: i64 = db.count("payment").await?;
    assert!(charges > 0, "the run never reached a successful charge");
    Ok(())
}

/// The same run finds a document that promises more than the server accepts: without the amount rules,
/// a schema-valid amount of "0" is refused, and schemathesis reports it.
#[tokio::test]
async fn schemathesis_catches_a_document_that_drifted() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&db.url, &brokers);
    service.start().await?;
    let mut doc = idem_http::openapi::document();
    let amount = &mut doc["components"]["schemas"]["Amount"];
    amount.as_object_mut().unwrap().remove("pattern");
    doc["components"]["schemas"]["ChargeRequest"].as_object_mut().unwrap().remove("anyOf");
    let path = std::env::temp_dir().join(format!("drifted-{}.json", Uuid::now_v7().simple()));
    std::fs::write(&path, doc.to_string())?;
    let out = tokio::task::spawn_blocking({
        let (base, path) = (service.base.clone(), path.display().to_string());
        move || run_schemathesis(&path, &base, &["--phases", "coverage", "--include-operation-id", "chargePayment"])
    })
    .await?;
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "schemathesis accepted a drifted document:\n{report}");
    assert!(report.contains("Schema-valid request rejected") || report.contains("ST202"), "{report}");
    Ok(())
}

/// Issue 38.5: the demo compose file published PostgreSQL (password `postgres`), Kafka (no authentication)
/// and idem (a well-known demo key) on every host interface. Every published port is bound to loopback.
#[test]
fn the_demo_compose_file_publishes_only_on_loopback() -> anyhow::Result<()> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docker-compose.yml"))?;
    let mut published = 0;
    for line in text.lines().filter(|l| l.trim_start().starts_with("ports:")) {
        let list = line.split_once('[').and_then(|(_, rest)| rest.split_once(']')).map(|(l, _)| l).unwrap_or_default();
        for mapping in list.split(',').map(|m| m.trim().trim_matches('"')) {
            published += 1;
            assert!(mapping.starts_with("127.0.0.1:"), "{mapping} is published on every interface");
        }
    }
    assert!(published >= 3, "found {published} published ports");
    Ok(())
}

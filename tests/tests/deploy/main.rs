//! Deploying idem on production infrastructure (issue 23): the real `idem` binary against a TLS-only
//! PostgreSQL, through PgBouncer in transaction mode, with Kafka over TLS, with properties that would break
//! its guarantees, and through a database path a failover freezes.

#![allow(clippy::disallowed_methods)] // tests make their own ids and read the clock
#![allow(clippy::print_stdout, clippy::unwrap_used)]

mod failover;
#[allow(dead_code)]
#[path = "../faults/harness.rs"]
mod harness;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use harness::{Service, charge_request, placed};
use idem_http::client::IdemClient;
use idem_tests::TestDb;
use idem_tests::effects::{charges_executed_twice, log_order_applications, log_payment_attempts, orders_applied_twice};
use idem_tests::infra::{FreezingProxy, PgBouncer, Pki, TlsBroker, TlsPostgres};
use idem_tests::kafka::{eventually, produce, producer};
use uuid::Uuid;

async fn count(db: &TestDb, sql: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sql).fetch_one(db.pool()).await?)
}

/// `n` charges, `at_once` in flight, each then replayed once: every first answer 201, every replay the
/// same payment.
async fn charge_and_replay(client: &IdemClient, prefix: &str, n: usize, at_once: usize) -> anyhow::Result<()> {
    let requests: Vec<(String, String)> =
        (0..n).map(|i| (IdemClient::new_key(), format!("{prefix}-{i}-{}", Uuid::now_v7().simple()))).collect();
    for chunk in requests.chunks(at_once) {
        let firsts = futures::future::join_all(chunk.iter().map(|(key, external)| {
            let request = charge_request(external);
            async move {
                let first = client.charge(key, &request).await?;
                let again = client.charge(key, &request).await?;
                anyhow::Ok((first, again))
            }
        }))
        .await;
        for answer in firsts {
            let (first, again) = answer?;
            assert_eq!(first.status, 201, "{:?}", first.body);
            assert!(again.replayed && again.body == first.body, "the replay differs: {again:?} vs {first:?}");
        }
    }
    Ok(())
}

/// Issue 23.3: behind PgBouncer 1.18 in transaction mode (4 server connections for ~30 client ones, the
/// usual `ignore_startup_parameters = extra_float_digits`), with `DATABASE_POOLER=transaction`: charges and
/// their replays, order events consumed, the relay publishing, `idem cleanup` and `/readyz` all work, and
/// each charge and event is executed once. Before: 2 of 3 charges answered 500 (`42P05: prepared statement
/// "sqlx_s_1" already exists`), and the `options` startup parameter was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_runs_behind_pgbouncer_in_transaction_mode() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    log_payment_attempts(&db).await?;
    log_order_applications(&db).await?;
    let upstream: u16 = db.store.pool().connect_options().get_port();
    let bouncer = PgBouncer::start(upstream, 4).await?;
    let brokers = idem_tests::kafka_brokers().await?;
    // issue 32.5: without DATABASE_POOLER the start fails on `options`, and now says what fixes it
    let refused = Service::new(&bouncer.url_for(&db.url)?, &brokers).serve_output().await?;
    assert!(refused.contains("unsupported startup parameter"), "{refused}");
    assert!(refused.contains("set DATABASE_POOLER=transaction"), "no hint at the fix:\n{refused}");
    let mut service = Service::new(&bouncer.url_for(&db.url)?, &brokers)
        .with_env("DATABASE_POOLER", "transaction")
        .with_env("DATABASE_DIRECT_URL", &db.url);
    service.start().await?;
    let client = service.client();
    charge_and_replay(&client, "pgb", 30, 10).await?;

    // order events through the consumer, whose batches and bookkeeping run through the pooler
    let p = producer(&brokers)?;
    let orders: Vec<Uuid> = (0..10).map(|_| Uuid::now_v7()).collect();
    for order in &orders {
        let body = placed(*order, &format!("pgb-order-{order}"));
        let id = Uuid::now_v7().to_string();
        produce(&p, &service.orders_topic, Some(&order.to_string()), body.as_bytes(), &[("event_id", id.as_bytes())])
            .await?;
    }
    let applied = eventually(Duration::from_secs(60), || async {
        Ok(count(&db, "SELECT count(*) FROM order_projection").await? >= orders.len() as i64)
    })
    .await?;
    assert!(applied, "order events were not applied through the pooler");
    // the relay publishes every charge through the pooler: the outbox drains
    let drained = eventually(Duration::from_secs(60), || async {
        Ok(count(&db, "SELECT count(*) FROM outbox_message").await? == 0)
    })
    .await?;
    assert!(drained, "the relay did not drain the outbox through the pooler");
    let published =
        idem_tests::kafka::read_topic(&brokers, &service.payments_topic, 40, Duration::from_secs(30)).await?;
    assert_eq!(published.len(), 40, "30 charges and 10 orders publish 40 payment events");

    let ready = reqwest::get(format!("{}/readyz", service.admin)).await?;
    assert_eq!(ready.status(), 200, "{}", ready.text().await?);
    // an operator's cleanup through the pooler (only the pooled URL: nothing needs a session)
    let cleanup = Service::new(&bouncer.url_for(&db.url)?, &brokers)
        .with_env("DATABASE_POOLER", "transaction")
        .idem(&["cleanup", "--once"])?;
    assert!(cleanup.status.success(), "{}", String::from_utf8_lossy(&cleanup.stderr));

    assert_eq!(charges_executed_twice(&db).await?, vec![], "a charge was executed twice");
    assert_eq!(orders_applied_twice(&db).await?, vec![], "an order event was applied twice");
    assert_eq!(count(&db, "SELECT count(*) FROM payment").await?, 40);
    assert!(service.terminate(), "idem did not stop cleanly");
    Ok(())
}

/// Issue 23.1: a PostgreSQL that accepts only TLS with a SCRAM password (`hostssl … scram-sha-256`, plain TCP
/// rejected) serves idem with `sslmode=verify-full`; a root certificate of another CA is refused at start
/// with a message naming the certificate problem; the password appears in no output. Before: "TLS upgrade
/// required by connect options but SQLx was built without TLS support enabled".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_only_is_verified_and_a_wrong_ca_is_refused() -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let password = "tls_pw_8841";
    let pg = TlsPostgres::start(&pki, password).await?;
    // plain TCP is rejected by the server: the test really runs on a TLS-only cluster
    let plain = sqlx::PgPool::connect(&pg.url("127.0.0.1", "sslmode=disable")).await;
    let plain_error = plain.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(plain_error.contains("no encryption") || plain_error.contains("pg_hba"), "{plain_error}");

    let verified = pg.url("localhost", &format!("sslmode=verify-full&sslrootcert={}", pki.ca.display()));
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&verified, &brokers);
    service.start().await.map_err(|e| anyhow::anyhow!("{e}\nserver log:\n{}", pg.log()))?;
    charge_and_replay(&service.client(), "tls", 4, 4).await?;
    let ready = reqwest::get(format!("{}/readyz", service.admin)).await?;
    assert_eq!(ready.status(), 200);
    // an operator's subcommand over the same TLS connection
    let migrate = service.idem(&["migrate"])?;
    assert!(migrate.status.success(), "{}", String::from_utf8_lossy(&migrate.stderr));
    // every connection was TLS: the server lists none without it
    let check = sqlx::PgPool::connect(&verified).await?;
    let unencrypted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
         WHERE a.backend_type = 'client backend' AND NOT s.ssl",
    )
    .fetch_one(&check)
    .await?;
    assert_eq!(unencrypted, 0);
    let valid_output = service.serve_output().await?;
    service.terminate();

    let wrong = pg.url("localhost", &format!("sslmode=verify-full&sslrootcert={}", pki.other_ca.display()));
    let refused = Service::new(&wrong, &brokers).serve_output().await?;
    assert!(
        refused.contains("certificate") && !refused.contains("HTTP API listening"),
        "a certificate of another CA was not refused by name:\n{refused}"
    );
    for out in [&valid_output, &refused] {
        assert!(!out.contains(password), "the password was printed:\n{out}");
    }
    Ok(())
}

/// Issue 23.2: with `KAFKA_CONFIG_FILE` (`security.protocol=SSL`, the CA), payments are published and orders
/// consumed through a TLS-only broker front; with another CA, `/readyz` reports the broker down and the log
/// names the certificate problem while HTTP keeps serving (the charge waits in the outbox). Before: rdkafka
/// was built without SSL and no property could be set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_over_tls_publishes_and_consumes_and_a_wrong_ca_shows_in_readyz() -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let broker = TlsBroker::start(&pki).await?;
    let dir = tempfile::tempdir()?;
    let (good, bad) = (dir.path().join("good.properties"), dir.path().join("bad.properties"));
    std::fs::write(&good, broker.properties(&pki.ca))?;
    std::fs::write(&bad, broker.properties(&pki.other_ca))?;
    let cluster = idem_kafka::KafkaConnection::new(&broker.bootstrap).with_properties(&broker.properties(&pki.ca))?;

    let db = TestDb::new().await?;
    log_order_applications(&db).await?;
    let mut service =
        Service::new(&db.url, &broker.bootstrap).with_env("KAFKA_CONFIG_FILE", good.to_str().unwrap_or_default());
    service.start().await?;
    charge_and_replay(&service.client(), "ktls", 3, 3).await?;
    let p: rdkafka::producer::FutureProducer = idem_kafka::ProducerSettings::new(&cluster).client_config().create()?;
    let order = Uuid::now_v7();
    let id = Uuid::now_v7().to_string();
    let (body, key) = (placed(order, &format!("ktls-order-{order}")), order.to_string());
    // the topics exist once the service created them through TLS
    let created = eventually(Duration::from_secs(30), || async {
        let headers: [(&str, &[u8]); 1] = [("event_id", id.as_bytes())];
        Ok(produce(&p, &service.orders_topic, Some(&key), body.as_bytes(), &headers).await.is_ok())
    })
    .await?;
    assert!(created, "could not produce an order over TLS");
    let applied = eventually(Duration::from_secs(60), || async {
        Ok(count(&db, "SELECT count(*) FROM order_projection").await? == 1)
    })
    .await?;
    assert!(applied, "the order event was not consumed over TLS");
    let published =
        idem_tests::kafka::read_topic_from(&cluster, &service.payments_topic, 4, Duration::from_secs(30)).await?;
    assert_eq!(published.len(), 4, "3 charges and one order publish 4 payment events over TLS");
    let ready = reqwest::get(format!("{}/readyz", service.admin)).await?;
    assert_eq!(ready.status(), 200, "{}", ready.text().await?);
    service.terminate();

    // another CA: the API serves, readiness says the broker is unreachable, the log says why
    let db2 = TestDb::new().await?;
    let wrong = Service::new(&db2.url, &broker.bootstrap)
        .with_env("KAFKA_CONFIG_FILE", bad.to_str().unwrap_or_default())
        .with_env("SHUTDOWN_TIMEOUT", "2s"); // the relay's deliveries cannot finish: no long drain
    let mut wrong_started = wrong;
    wrong_started.start().await?;
    charge_and_replay(&wrong_started.client(), "ktls-bad", 1, 1).await?;
    let ready = reqwest::get(format!("{}/readyz", wrong_started.admin)).await?;
    let (status, text) = (ready.status(), ready.text().await?);
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("kafka") || text.contains("broker"), "{text}");
    assert_eq!(count(&db2, "SELECT count(*) FROM outbox_message").await?, 1, "the charge waits in the outbox");
    wrong_started.terminate();
    let log = Service::new(&db2.url, &broker.bootstrap)
        .with_env("KAFKA_CONFIG_FILE", bad.to_str().unwrap_or_default())
        .with_env("SHUTDOWN_TIMEOUT", "2s")
        .serve_output()
        .await?;
    assert!(
        log.contains("certificate verify failed") || log.contains("certificate"),
        "the log does not say why:\n{log}"
    );
    Ok(())
}

/// Issue 23.2: a properties file may not override what idem's guarantees rest on; the start fails naming
/// the property and the reason, never the value. A SASL password comes from a file and is never printed.
#[tokio::test]
async fn kafka_properties_that_break_guarantees_are_refused_at_start() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let dir = tempfile::tempdir()?;
    let props = dir.path().join("client.properties");
    std::fs::write(&props, "linger.ms=5\nenable.idempotence=false_secretish\n")?;
    let out =
        Service::new(&db.url, &brokers).with_env("KAFKA_CONFIG_FILE", props.to_str().unwrap()).serve_output().await?;
    assert!(out.contains("`enable.idempotence` cannot be set"), "{out}");
    assert!(!out.contains("false_secretish") && !out.contains("HTTP API listening"), "{out}");

    let password = dir.path().join("sasl");
    std::fs::write(&password, "sasl_pw_55120\n")?;
    std::fs::write(&props, "linger.ms=5\n")?;
    let out = Service::new(&db.url, &brokers)
        .with_env("KAFKA_CONFIG_FILE", props.to_str().unwrap())
        .with_env("KAFKA_SASL_PASSWORD_FILE", password.to_str().unwrap())
        .serve_output()
        .await?;
    assert!(out.contains("HTTP API listening"), "{out}");
    assert!(!out.contains("sasl_pw_55120"), "the SASL password was printed:\n{out}");
    // issue 23.5: this machine's server has no synchronous standby, and the start says what that risks
    assert!(out.contains("no synchronous standby"), "no warning about asynchronous replication:\n{out}");
    Ok(())
}

/// Issue 23.4: the database path freezes (a failover that black-holes the old connections: no RST, no
/// FIN) while new connections reach a healthy server. Requests in flight are answered within the request
/// timeout, new ones are served on fresh connections within seconds, and no pool slot stays lost: after
/// the freeze more charges than the pool has connections all succeed. Before: the ping and BEGIN on a
/// reused connection and the rollback of an abandoned one had no bound, so every slot hung on a frozen
/// connection until the kernel gave up (~15 min).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_database_path_serves_new_charges_within_seconds_and_loses_no_slot() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    log_payment_attempts(&db).await?;
    let upstream: u16 = db.store.pool().connect_options().get_port();
    let proxy = FreezingProxy::start(upstream).await?;
    let through = db.url.replacen(&format!(":{upstream}/"), &format!(":{}/", proxy.port), 1);
    anyhow::ensure!(through != db.url, "cannot route {} through the proxy", db.url);
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&through, &brokers)
        .with_env("DATABASE_MAX_CONNECTIONS", "6")
        .with_env("HTTP_REQUEST_TIMEOUT", "5s");
    service.start().await?;
    let client = service.client();
    charge_and_replay(&client, "warm", 12, 6).await?; // every pool connection opened and resting
    // a request in flight when the path freezes: a charge whose insert waits on a table lock
    let mut blocker = sqlx::PgConnection::connect(&db.url).await?;
    sqlx::query("BEGIN").execute(&mut blocker).await?;
    sqlx::query("LOCK TABLE payment IN EXCLUSIVE MODE").execute(&mut blocker).await?;
    let in_flight = {
        let url = format!("{}/payments", service.base);
        let body = serde_json::to_vec(&charge_request("frozen-in-flight"))?;
        tokio::spawn(async move {
            let started = Instant::now();
            let reply = reqwest::Client::new()
                .post(url)
                .header("Idempotency-Key", IdemClient::new_key())
                .header("Authorization", format!("Bearer {}", harness::API_KEY))
                .header("Content-Type", "application/json")
                .body(body)
                .send()
                .await;
            (reply.map(|r| r.status().as_u16()), started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.freeze();
    sqlx::query("ROLLBACK").execute(&mut blocker).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await; // the pool's connections rest: pinged before reuse
    let started = Instant::now();
    let reply = client.charge(&IdemClient::new_key(), &charge_request("after-freeze")).await?;
    let first_after = started.elapsed();
    assert_eq!(reply.status, 201);
    assert!(first_after < Duration::from_secs(10), "the first charge after the freeze took {first_after:?}");
    let (in_flight, waited) = in_flight.await?;
    assert_eq!(in_flight?, 503, "the request in flight on a frozen connection was not answered");
    assert!(waited < Duration::from_secs(8), "the request in flight was answered after {waited:?}");
    // no slot lost: twice the pool's size at once, all served
    let started = Instant::now();
    charge_and_replay(&client, "after", 12, 12).await?;
    println!(
        "first charge after the freeze {first_after:?}; 12 more charges and replays in {:?}; {} connections frozen",
        started.elapsed(),
        proxy.frozen()
    );
    assert!(proxy.frozen() >= 6, "the freeze caught {} connections only", proxy.frozen());
    assert_eq!(charges_executed_twice(&db).await?, vec![], "a charge was executed twice");
    Ok(())
}

/// Issue 32.2: one client retries a completed key every 200 ms while the database path freezes (pool of 2,
/// `HTTP_REQUEST_TIMEOUT=3s`). Before: with the replay fast path on (`always`, or `adaptive`, which a
/// retry storm turns on) the fast path's read was cancelled by the request timeout, its connection went
/// back to the top of the pool un-pinged, and every later request took it again and answered 503 for as
/// long as the traffic lasted. Now a connection whose operation did not complete is closed, the read is
/// bounded by `DATABASE_STEP_TIMEOUT`, and replays resume within seconds in every mode.
async fn replays_resume_after_a_freeze(mode: &str) -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let upstream: u16 = db.store.pool().connect_options().get_port();
    let proxy = FreezingProxy::start(upstream).await?;
    let through = db.url.replacen(&format!(":{upstream}/"), &format!(":{}/", proxy.port), 1);
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&through, &brokers)
        .with_env("DATABASE_MAX_CONNECTIONS", "2")
        .with_env("HTTP_REQUEST_TIMEOUT", "3s")
        .with_env("IDEMPOTENCY_REPLAY_FAST_PATH", mode);
    service.start().await?;
    let (url, key) = (format!("{}/payments", service.base), IdemClient::new_key());
    let body = serde_json::to_vec(&charge_request(&format!("replay-freeze-{mode}")))?;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    let send = || {
        http.post(&url)
            .header("Idempotency-Key", &key)
            .header("Authorization", format!("Bearer {}", harness::API_KEY))
            .header("Content-Type", "application/json")
            .body(body.clone())
            .send()
    };
    assert_eq!(send().await?.status(), 201);
    let started = Instant::now();
    let (mut frozen_at, mut answers) = (None, Vec::new());
    while started.elapsed() < Duration::from_secs(20) {
        if frozen_at.is_none() && started.elapsed() > Duration::from_secs(3) {
            proxy.freeze();
            frozen_at = Some(Instant::now());
        }
        let sent = Instant::now();
        let reply = send().await;
        let replayed =
            reply.as_ref().is_ok_and(|r| r.status() == 201 && r.headers().contains_key("idempotent-replayed"));
        answers.push((frozen_at.map(|f| sent.saturating_duration_since(f)), replayed));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after: Vec<_> = answers.iter().filter_map(|(since, ok)| since.map(|s| (s, *ok))).collect();
    let failed_late: Vec<_> = after.iter().filter(|(s, ok)| *s > Duration::from_secs(6) && !ok).collect();
    let late = after.iter().filter(|(s, _)| *s > Duration::from_secs(6)).count();
    println!(
        "{mode}: {} answers after the freeze, {} of the {late} sent 6 s after it failed",
        after.len(),
        failed_late.len()
    );
    assert!(answers.iter().filter(|(s, _)| s.is_none()).all(|(_, ok)| *ok), "replays failed before the freeze");
    assert!(late >= 3, "only {late} requests after the recovery window");
    assert!(failed_late.is_empty(), "{mode}: {} of {late} requests 6 s after the freeze failed", failed_late.len());
    assert!(proxy.frozen() >= 1, "the freeze caught no connection");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_resume_after_a_freeze_with_the_fast_path_always() -> anyhow::Result<()> {
    replays_resume_after_a_freeze("always").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_resume_after_a_freeze_with_the_fast_path_adaptive() -> anyhow::Result<()> {
    replays_resume_after_a_freeze("adaptive").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_resume_after_a_freeze_with_the_fast_path_never() -> anyhow::Result<()> {
    replays_resume_after_a_freeze("never").await
}

use sqlx::Connection;

/// Issue 38.5: every `/readyz` pinged the database and fetched broker metadata, so whoever reached an
/// exposed admin listener made the service work (and with the database path frozen, each call took the
/// ping's 2 s bound). It now serves the result of a background probe: with the path frozen, twenty calls
/// are each answered at once, and within seconds one says the database is unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_is_served_from_a_background_probe() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let upstream: u16 = db.store.pool().connect_options().get_port();
    let proxy = FreezingProxy::start(upstream).await?;
    let through = db.url.replacen(&format!(":{upstream}/"), &format!(":{}/", proxy.port), 1);
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&through, &brokers);
    service.start().await?;
    let ready = || async { anyhow::Ok(reqwest::get(format!("{}/readyz", service.admin)).await?) };
    let ok = eventually(Duration::from_secs(15), || async { Ok(ready().await?.status() == 200) }).await?;
    assert!(ok, "never ready");
    proxy.freeze();
    let mut slowest = Duration::ZERO;
    let mut answers = Vec::new();
    for _ in 0..20 {
        let started = Instant::now();
        let reply = ready().await?;
        slowest = slowest.max(started.elapsed());
        answers.push(reply.text().await?);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    println!("slowest /readyz with the database path frozen: {slowest:?}; answers: {answers:?}");
    assert!(slowest < Duration::from_millis(500), "a /readyz took {slowest:?}: it probed the database itself");
    // the proxy freezes the connections open at the freeze and passes new ones, so once the pool has replaced
    // its frozen connections the probe may say "ok" again: the probe must have noticed, not still say so
    let noticed = answers.iter().position(|a| a.contains("\"database\":\"unreachable\""));
    assert!(noticed.is_some(), "no /readyz said the database was unreachable: {answers:?}");
    Ok(())
}

/// Issue 32.5: `idem serve` asked to stop while the broker is cut (a relay round waiting for deliveries, the
/// consumer unable to leave its group) exited non-zero ("shutdown timed out") after the whole drain. A
/// clean shutdown exits 0 promptly whatever the broker does; the unpublished rows stay in the outbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_the_broker_is_cut_exits_cleanly_and_promptly() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let broker = idem_tests::kafka::ProxiedBroker::start().await?;
    let mut service = Service::new(&db.url, &broker.bootstrap).with_env("SHUTDOWN_TIMEOUT", "20s");
    service.start().await?;
    let client = service.client();
    charge_and_replay(&client, "before-cut", 3, 3).await?;
    let published = eventually(Duration::from_secs(30), || async {
        Ok(count(&db, "SELECT count(*) FROM outbox_message").await? == 0)
    })
    .await?;
    assert!(published, "the first charges were not published");
    broker.proxy.cut();
    charge_and_replay(&client, "during-cut", 3, 3).await?;
    tokio::time::sleep(Duration::from_secs(2)).await; // a relay round is waiting for its deliveries
    let asked = Instant::now();
    let clean = service.terminate();
    let took = asked.elapsed();
    println!("SIGTERM with the broker cut: exited cleanly {clean} after {took:?}");
    assert!(clean, "a shutdown with the broker cut exited non-zero");
    assert!(took < Duration::from_secs(10), "the shutdown took {took:?}");
    assert_eq!(count(&db, "SELECT count(*) FROM outbox_message").await?, 3, "the cut's charges wait in the outbox");
    Ok(())
}

/// Issue 32.5: behind PgBouncer in transaction mode a server connection is shared by every client, one
/// transaction at a time. Another client's session settings (`search_path`, `lock_timeout`,
/// `synchronous_commit`) leaked into idem's transactions, and idem's `DEALLOCATE ALL` removed the statements
/// another client had prepared. With one server connection for all: a charge succeeds whatever the other
/// client set, and the other client's statement survives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_pgbouncer_other_clients_settings_and_statements_are_left_alone() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    log_payment_attempts(&db).await?;
    let upstream: u16 = db.store.pool().connect_options().get_port();
    let bouncer = PgBouncer::start(upstream, 1).await?;
    let pooled = bouncer.url_for(&db.url)?;
    let mut other = sqlx::PgConnection::connect(&pooled).await?;
    sqlx::raw_sql(
        "SET search_path = nowhere; SET lock_timeout = '1ms'; SET synchronous_commit = off; \
         PREPARE other_client_stmt AS SELECT 42",
    )
    .execute(&mut other)
    .await?;
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&pooled, &brokers)
        .with_env("DATABASE_POOLER", "transaction")
        .with_env("DATABASE_DIRECT_URL", &db.url)
        .with_env("DATABASE_MAX_CONNECTIONS", "2")
        .with_env("DATABASE_BACKGROUND_CONNECTIONS", "2");
    service.start().await?;
    charge_and_replay(&service.client(), "pgb-shared", 3, 1).await?;
    // the simple protocol: one round trip, so the pooler cannot hand the server connection to idem between
    // a Parse and its Bind (the extended protocol's unnamed statement would be replaced meanwhile)
    let row = sqlx::raw_sql("EXECUTE other_client_stmt").fetch_one(&mut other).await?;
    let answer: i32 = sqlx::Row::try_get(&row, 0)?;
    assert_eq!(answer, 42, "the other client's prepared statement is gone");
    assert_eq!(charges_executed_twice(&db).await?, vec![], "a charge was executed twice");
    Ok(())
}

/// Issue 34.2: the URL HA tools hand out, `postgres://h1,h2/db?target_session_attrs=read-write`, which sqlx
/// cannot follow. It names a streaming standby first and the primary second: idem migrates and serves on the
/// primary. The primary then crashes and the standby is promoted (replication had caught up, so nothing
/// acknowledged is lost here: losing it is the cluster harness's subject): new charges reach the new
/// primary within seconds, through the same URL, and every acknowledged charge is there once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_host_url_follows_a_failover_to_the_promoted_standby() -> anyhow::Result<()> {
    use idem_tests::infra::PrivatePostgres;
    let primary = PrivatePostgres::start("").await?;
    let standby = primary.standby().await?;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
        standby.port, primary.port
    );
    let brokers = idem_tests::kafka_brokers().await?;
    let mut service = Service::new(&url, &brokers);
    service.start().await?;
    let client = service.client();
    charge_and_replay(&client, "mh-before", 10, 5).await?;

    let on_primary = sqlx::PgPool::connect(&primary.url("postgres")).await?;
    let on_standby = sqlx::PgPool::connect(&standby.url("postgres")).await?;
    let target: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(&on_primary).await?;
    let caught_up = eventually(Duration::from_secs(30), || async {
        Ok(sqlx::query_scalar::<_, bool>("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
            .bind(&target)
            .fetch_one(&on_standby)
            .await?)
    })
    .await?;
    assert!(caught_up, "the standby never replayed the primary's WAL");
    on_primary.close().await;

    primary.crash();
    let crashed = Instant::now();
    standby.promote()?;
    let first_success = std::sync::Mutex::new(None);
    let served = eventually(Duration::from_secs(60), || async {
        let reply =
            client.charge(&IdemClient::new_key(), &charge_request(&format!("mh-probe-{}", Uuid::now_v7()))).await;
        if matches!(&reply, Ok(r) if r.status == 201) {
            first_success.lock().expect("lock").get_or_insert(crashed.elapsed());
            return Ok(true);
        }
        Ok(false)
    })
    .await?;
    assert!(served, "no charge succeeded on the promoted standby");
    println!("first charge served {:?} after the primary crashed", first_success.lock().expect("lock"));
    charge_and_replay(&client, "mh-after", 10, 5).await?;

    let count = |pattern: &'static str| {
        let pool = on_standby.clone();
        async move {
            anyhow::Ok(
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payment WHERE external_payment_id LIKE $1")
                    .bind(pattern)
                    .fetch_one(&pool)
                    .await?,
            )
        }
    };
    assert_eq!(count("mh-before-%").await?, 10, "a charge acknowledged before the failover is missing");
    assert_eq!(count("mh-after-%").await?, 10);
    let ready = eventually(Duration::from_secs(15), || async {
        Ok(reqwest::get(format!("{}/readyz", service.admin)).await?.status() == 200)
    })
    .await?;
    assert!(ready, "/readyz never recovered after the failover");
    assert!(service.terminate(), "idem did not stop cleanly");
    Ok(())
}

/// Issue 34.2: a primary demoted while idem's connections to it stay open (here: made read-only by
/// `default_transaction_read_only`, while its standby is promoted). Each unit of work on a reused
/// connection failed with `25006` until the connection's lifetime (30 min) ended; a statement that finds its
/// server read-only now ends the generation of the connections, and the next unit of work finds the new
/// primary of the URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_to_a_demoted_primary_are_not_reused() -> anyhow::Result<()> {
    use idem_ports::TransactionManager;
    use idem_postgres::{PgStore, PgUnitOfWork, PoolSettings};
    use idem_tests::infra::PrivatePostgres;
    let primary = PrivatePostgres::start("").await?;
    let admin = sqlx::PgPool::connect(&primary.url("postgres")).await?;
    sqlx::raw_sql("CREATE TABLE test_write (n int)").execute(&admin).await?;
    let standby = primary.standby().await?;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
        primary.port, standby.port
    );
    let store = PgStore::connect(&url, &PoolSettings::default()).await?;
    let write = |n: i32| {
        let store = store.clone();
        async move {
            let mut uow = store.begin().await?;
            let pg = PgUnitOfWork::of(uow.as_mut())?;
            sqlx::query("INSERT INTO test_write VALUES ($1)")
                .bind(n)
                .execute(pg.connection())
                .await
                .map_err(idem_postgres::map_sqlx_error)?;
            uow.commit().await?;
            anyhow::Ok(())
        }
    };
    // connections open and resting in the pool, all to the primary
    futures::future::try_join_all((0..4).map(write)).await?;

    // the primary turns read-only with its sessions still open; the standby takes over
    sqlx::query("ALTER SYSTEM SET default_transaction_read_only = on").execute(&admin).await?;
    sqlx::query("SELECT pg_reload_conf()").execute(&admin).await?;
    standby.promote()?;
    tokio::time::sleep(Duration::from_millis(300)).await; // the reload reaches every session
    let mut failed = 0;
    let mut written = false;
    for n in 100..120 {
        match write(n).await {
            Ok(()) => {
                written = true;
                break;
            }
            Err(e) => {
                println!("unit of work {n}: {e}");
                failed += 1;
            }
        }
    }
    println!("units of work that failed before one reached the new primary: {failed}");
    assert!(written, "every unit of work failed on the demoted primary");
    assert!(failed <= 1, "{failed} units of work reused connections to the demoted primary");
    let on_new = sqlx::PgPool::connect(&standby.url("postgres")).await?;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM test_write WHERE n >= 100").fetch_one(&on_new).await?;
    assert_eq!(rows, 1, "the write went to the promoted standby");
    Ok(())
}

/// Issue 34.3: the synchronous cluster through every fault (`failover.rs`; `FAILOVER_FAULTS`,
/// `FAILOVER_ROUNDS` and `FAILOVER_HOLD` lengthen it, as `scripts/bench.sh failover` does). Nothing
/// acknowledged is lost, nothing is executed, applied or announced twice, every unknown outcome resolves,
/// and clients get successes again after every fault. Issue 45: two clients charge through a stand-in
/// provider meanwhile: one provider charge per client key, every acknowledged payment captured with it,
/// nothing left held once the faults healed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synchronous_cluster_through_every_fault_loses_and_duplicates_nothing() -> anyhow::Result<()> {
    let run = failover::Run::from_env("FAILOVER_FAULTS", 15500, false, &failover::Fault::ALL)?;
    let report = failover::run(&run).await?;
    report.print("synchronous replication");
    let v = &report.verdict;
    assert!(v.clean(), "lost {:?}, duplicated {:?}, inconsistent {:?}", v.lost, v.duplicated, v.inconsistent);
    assert_eq!(v.unknown_resolved, v.unknown, "an unknown outcome stayed unknown after the faults healed");
    assert_eq!(report.server_errors, 0, "answers 5xx other than 503 (a condition of the infrastructure is a 503)");
    assert!(v.acknowledged > 100, "too little load to mean anything: {v:?}");
    assert!(report.orders > 10, "too few order events: {}", report.orders);
    // issue 45: charges through the provider, counted at the provider
    let p = &report.provider;
    assert!(p.violations.is_empty(), "through the provider: {:?}", p.violations);
    assert_eq!(p.charges, p.acknowledged, "one provider charge per acknowledged client key, no other");
    assert!(p.acknowledged > 20, "too few charges through the provider: {p:?}");
    for f in &report.faults {
        assert!(f.recovered, "no client succeeded within 60 s of the heal of {}", f.fault.name());
    }
    let kinds: BTreeSet<failover::Fault> = report.faults.iter().map(|f| f.fault).collect();
    assert_eq!(kinds.len(), run.schedule.iter().collect::<BTreeSet<_>>().len(), "a fault was not injected");
    Ok(())
}

/// Issue 34.3, the control run: the same harness with synchronous replication off (and a lagging standby
/// promotable, as without it) and the primary cut from its peers and etcd while clients still reach it.
/// It keeps acknowledging commits until Patroni demotes it (its `ttl`), and the standby promoted meanwhile
/// never had them: the checker must see acknowledged writes lost — else it could not see them at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_asynchronous_control_run_shows_the_checker_sees_lost_writes() -> anyhow::Result<()> {
    let run = failover::Run::from_env("FAILOVER_CONTROL_FAULTS", 15600, true, &[failover::Fault::PartitionPrimary])?;
    let report = failover::run(&run).await?;
    report.print("asynchronous replication (control)");
    assert!(
        !report.verdict.lost.is_empty(),
        "the checker saw no loss without synchronous replication: {:?}",
        report.verdict
    );
    Ok(())
}

/// Issue 34.4: the cancelled standby wait. A primary with one synchronous standby, its WAL sender frozen
/// (SIGSTOP): every commit waits for the standby. A charge then gives up at idem's step timeout; its backend
/// keeps waiting, the commit invisible. Something ends the wait — here an operator's `pg_cancel_backend`;
/// `client_connection_check_interval` and `pg_terminate_backend` do the same — and PostgreSQL makes the
/// commit visible on the primary although the standby never received it ("The transaction has already
/// committed locally, but might not have been replicated to the standby"). A retry with the same key must
/// not be answered 201 from that record, on the replay fast path or the full one: the primary then
/// crashes, the standby is promoted, and every charge a client was told succeeded must be on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_standby_wait_was_cancelled_is_never_answered_as_a_success() -> anyhow::Result<()> {
    use idem_tests::infra::PrivatePostgres;
    let primary = PrivatePostgres::start("").await?;
    let standby = primary.standby().await?;
    let on_primary = sqlx::PgPool::connect(&primary.url("postgres")).await?;
    let on_standby = sqlx::PgPool::connect(&standby.url("postgres")).await?;
    sqlx::query("ALTER SYSTEM SET synchronous_standby_names = '*'").execute(&on_primary).await?;
    sqlx::query("SELECT pg_reload_conf()").execute(&on_primary).await?;
    let synchronous = eventually(Duration::from_secs(30), || async {
        Ok(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'")
            .fetch_one(&on_primary)
            .await?
            == 1)
    })
    .await?;
    assert!(synchronous, "the standby never became synchronous");
    let brokers = idem_tests::kafka_brokers().await?;
    let mut full_path =
        Service::new(&primary.url("postgres"), &brokers).with_env("IDEMPOTENCY_REPLAY_FAST_PATH", "never");
    full_path.start().await?;
    let mut fast_path =
        Service::new(&primary.url("postgres"), &brokers).with_env("IDEMPOTENCY_REPLAY_FAST_PATH", "always");
    fast_path.start().await?;
    // one attempt per call: the test decides what is sent again
    let once = idem_http::client::RetryPolicy {
        max_attempts: 1,
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(10),
        timeout: Duration::from_secs(10),
    };
    let (full, fast) = (full_path.client_with(once.clone()), fast_path.client_with(once));
    // answered 201 anywhere, first or replayed: (external id, payment id)
    let mut succeeded = Vec::new();
    let before = charge_request("sync-before");
    let key_before = IdemClient::new_key();
    let reply = full.charge(&key_before, &before).await?;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    succeeded.push(("sync-before".to_owned(), reply.body["id"].as_str().unwrap_or_default().to_owned()));
    // with the standby confirming, replays on both paths are answered (the barrier passes)
    for client in [&full, &fast] {
        let replay = client.charge(&key_before, &before).await?;
        assert_eq!((replay.status, &replay.body["id"]), (201, &reply.body["id"]), "a replay of a replicated charge");
    }

    // the primary's WAL sender, frozen: WAL already in a socket buffer would reach a frozen receiver later
    let sender: i32 = sqlx::query_scalar("SELECT pid FROM pg_stat_replication").fetch_one(&on_primary).await?;
    let signal = |sig: &str| std::process::Command::new("kill").args([sig, &sender.to_string()]).status();
    assert!(signal("-STOP")?.success());
    let request = charge_request("sync-cancelled");
    let key = IdemClient::new_key();
    match full.charge(&key, &request).await {
        Ok(first) => assert_ne!(first.status, 201, "answered before the standby confirmed: {:?}", first.body),
        Err(e) => println!("the first send got no answer: {e}"),
    }
    let cancelled = eventually(Duration::from_secs(10), || async {
        Ok(sqlx::query_scalar::<_, bool>(
            "SELECT coalesce(bool_or(pg_cancel_backend(pid)), false) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
        )
        .fetch_one(&on_primary)
        .await?)
    })
    .await?;
    assert!(cancelled, "no commit was waiting for the standby");
    let visible = eventually(Duration::from_secs(10), || async {
        Ok(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payment WHERE external_payment_id = 'sync-cancelled'")
            .fetch_one(&on_primary)
            .await?
            == 1)
    })
    .await?;
    assert!(visible, "the cancelled wait did not leave the commit visible on the primary (the scenario)");
    for (path, client) in [("full", &full), ("fast", &fast), ("fast", &fast)] {
        match client.charge(&key, &request).await {
            Ok(replay) => {
                println!("replay on the {path} path while the standby is frozen: {}", replay.status);
                if replay.status == 201 {
                    let id = replay.body["id"].as_str().unwrap_or_default().to_owned();
                    succeeded.push(("sync-cancelled".to_owned(), id));
                }
            }
            Err(e) => println!("replay on the {path} path while the standby is frozen: no answer ({e})"),
        }
    }
    // and the charge acknowledged before the freeze still replays: its record is replicated
    let replay_before = full.charge(&key_before, &before).await.map(|r| r.status);
    println!("replay of the replicated charge while the standby is frozen: {replay_before:?}");

    primary.crash(); // its frozen WAL sender is killed: the standby never receives the cancelled commit
    standby.promote()?;
    for (external, id) in &succeeded {
        let rows: Vec<(String,)> = sqlx::query_as("SELECT id::text FROM payment WHERE external_payment_id = $1")
            .bind(external)
            .fetch_all(&on_standby)
            .await?;
        assert_eq!(rows, vec![(id.clone(),)], "{external} was answered 201 but the promoted standby lacks it");
    }
    Ok(())
}

/// Issue 34.2, found by the failover harness: the relay's LISTEN connection was made on the host the
/// multi-host URL resolved at start and never followed the URL, so after a failover it reconnected to the
/// old server for good ("cannot execute LISTEN during recovery" 953 times in 5 minutes; relays fell back to
/// polling). Here the primary crashes and its standby is promoted; once the store has found the new
/// primary, another instance's NOTIFY wakes the waiting relay again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_wakeup_follows_a_multi_host_url_through_a_failover() -> anyhow::Result<()> {
    use idem_ports::{OutboxWakeup, TransactionManager};
    use idem_tests::infra::PrivatePostgres;
    let primary = PrivatePostgres::start("").await?;
    let standby = primary.standby().await?;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
        primary.port, standby.port
    );
    let store = idem_postgres::PgStore::connect(&url, &idem_postgres::PoolSettings::default()).await?;
    let mut wakeup = idem_postgres::PgOutboxWakeup::connect(&store).await?;
    let woken_by = |target: String| async move {
        // NOTIFY every 100 ms from "another instance"; a wait that returns well before its 3 s was woken
        let notify = sqlx::PgPool::connect(&target).await?;
        let stop = idem::CancellationToken::new();
        let notifier = {
            let stop = stop.clone();
            tokio::spawn(async move {
                while !stop.is_cancelled() {
                    let _ = sqlx::query("SELECT pg_notify($1, 'another-instance')")
                        .bind(idem_postgres::OUTBOX_CHANNEL)
                        .execute(&notify)
                        .await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        anyhow::Ok((stop, notifier))
    };
    let (stop, notifier) = woken_by(primary.url("postgres")).await?;
    let asked = Instant::now();
    wakeup.wait(Duration::from_secs(3)).await;
    assert!(asked.elapsed() < Duration::from_secs(1), "not woken before the failover");
    stop.cancel();
    notifier.await?;

    primary.crash();
    standby.promote()?;
    // the store finds the new primary through the URL (a relay's claims and every unit of work do)
    let found = eventually(Duration::from_secs(30), || async { Ok(store.begin().await.is_ok()) }).await?;
    assert!(found, "the store never found the promoted standby");
    let (stop, notifier) = woken_by(standby.url("postgres")).await?;
    let mut fastest = Duration::MAX;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && fastest >= Duration::from_secs(1) {
        let asked = Instant::now();
        wakeup.wait(Duration::from_secs(3)).await;
        fastest = fastest.min(asked.elapsed());
    }
    stop.cancel();
    notifier.await?;
    assert!(
        fastest < Duration::from_secs(1),
        "the relay's LISTEN never reached the new primary: waits took {fastest:?}"
    );
    Ok(())
}

/// Issue 45.7: a webhook redelivery was acknowledged `200 duplicate` from a `provider_event` row without the
/// replication barrier API replays go through: a row whose commit wait was cancelled is visible on the
/// primary alone, and the provider, told "done", stops delivering what the next failover takes back. With a
/// synchronous standby that does not confirm, the duplicate is `503` (delivered again later); once it
/// confirms, `200 duplicate`.
#[tokio::test]
async fn a_webhook_duplicate_is_acknowledged_only_once_the_standby_has_it() -> anyhow::Result<()> {
    use std::sync::Arc;

    use idem_ports::{SystemClock, TransactionManager, UuidV7Generator};
    let primary = idem_tests::infra::PrivatePostgres::start("").await?;
    let url = primary.url("postgres");
    let store = idem_postgres::PgStore::connect(&url, &idem_postgres::PoolSettings::default()).await?;
    store.migrate_schema_first(&idem_tests::REFERENCE_MIGRATOR).await?;
    let tm: Arc<dyn TransactionManager> = Arc::new(store.clone());
    let api = idem_http::ApiState {
        tm,
        payments_of: idem_postgres::payments_of,
        clock: Arc::new(SystemClock),
        ids: Arc::new(UuidV7Generator),
        payments_topic: "payments".into(),
        provider: None,
    };
    let secret = "whsec_barrier_0123456789";
    let state = idem_http::webhooks::WebhookState::new(api, "standin".into(), secret.as_bytes())?;
    let base = idem_tests::serve(idem_http::webhooks::router(state)).await?;
    let body =
        serde_json::to_vec(&serde_json::json!({"id": "evt_b1", "type": "customer.created", "data": {"object": {}}}))?;
    let deliver = || {
        let (base, body) = (base.clone(), body.clone());
        async move {
            let signature = idem_domain::webhook::sign(secret.as_bytes(), &body, chrono::Utc::now());
            let resp = reqwest::Client::new()
                .post(format!("{base}/webhooks/payment-provider"))
                .header("provider-signature", signature)
                .body(body)
                .send()
                .await?;
            Ok::<_, anyhow::Error>((resp.status().as_u16(), resp.text().await?))
        }
    };
    let first = deliver().await?;
    assert_eq!(first.0, 200, "{}", first.1);
    let admin = sqlx::PgPool::connect(&url).await?;
    sqlx::query("ALTER SYSTEM SET synchronous_standby_names = 'nonexistent'").execute(&admin).await?;
    sqlx::query("SELECT pg_reload_conf()").execute(&admin).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let unconfirmed = deliver().await?;
    assert_eq!(unconfirmed.0, 503, "acknowledged without a standby's confirmation: {}", unconfirmed.1);
    sqlx::query("ALTER SYSTEM RESET synchronous_standby_names").execute(&admin).await?;
    sqlx::query("SELECT pg_reload_conf()").execute(&admin).await?;
    // the barrier's own commit, still waiting, is released by the reload
    let confirmed = eventually(Duration::from_secs(10), || async { Ok(deliver().await?.0 == 200) }).await?;
    assert!(confirmed, "the duplicate is acknowledged once nothing is left to confirm");
    assert!(deliver().await?.1.contains("duplicate"));
    Ok(())
}

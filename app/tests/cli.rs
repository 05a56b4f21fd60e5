//! The real binary refuses invalid configuration before touching anything.

use std::process::Command;

#[test]
fn serve_refuses_a_ttl_outside_the_range_and_names_the_rule() {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("serve")
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("IDEM_API_KEYS", "m:key_0123456789ab")
        .env("IDEMPOTENCY_TTL", "100h")
        .output()
        .expect("idem runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("between 24h and 72h"), "{stderr}");
}

#[test]
fn serve_help_documents_every_setting() {
    let out = Command::new(env!("CARGO_BIN_EXE_idem")).args(["serve", "--help"]).output().expect("idem runs");
    let help = String::from_utf8_lossy(&out.stdout);
    for var in [
        "DATABASE_URL",
        "KAFKA_BROKERS",
        "HTTP_ADDR",
        "IDEM_API_KEYS",
        "KAFKA_ORDERS_TOPIC",
        "KAFKA_PAYMENTS_TOPIC",
        "KAFKA_GROUP_ID",
        "IDEMPOTENCY_TTL",
        "DEDUP_TTL",
        "CLEANUP_INTERVAL",
        "KAFKA_BATCH_SIZE",
        "OUTBOX_BATCH_SIZE",
    ] {
        assert!(help.contains(var), "--help lacks {var}");
    }
}

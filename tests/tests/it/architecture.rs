//! Workspace conventions checked by the suite: the dependency rule of the hexagon.

use std::collections::BTreeSet;
use std::process::Command;

/// Names of every package in the normal (non-dev, non-build) dependency tree of `package`, for the host
/// platform, as `cargo tree` resolves it.
fn dependency_tree(package: &str) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["tree", "--offline", "-p", package, "-e", "normal", "--prefix", "none", "-f", "{p}"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(out.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let mut names: BTreeSet<String> =
        text.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_owned).collect();
    names.remove(package);
    assert!(!names.is_empty() || package == "idem-ports", "empty tree for {package}: {text}");
    names
}

#[test]
fn domain_depends_on_ports_and_no_io_crate() {
    let deps = dependency_tree("idem-domain");
    assert!(deps.contains("idem-ports"), "idem-domain must depend on idem-ports: {deps:?}");
    for forbidden in [
        "sqlx",
        "sqlx-core",
        "rdkafka",
        "axum",
        "hyper",
        "tokio",
        "reqwest",
        "idem-postgres",
        "idem-kafka",
        "idem-http",
    ] {
        assert!(!deps.contains(forbidden), "idem-domain must not depend on {forbidden} (it does, transitively)");
    }
}

#[test]
fn ports_do_no_io_either() {
    let deps = dependency_tree("idem-ports");
    for forbidden in ["sqlx", "sqlx-core", "rdkafka", "axum", "hyper", "tokio", "idem-domain"] {
        assert!(!deps.contains(forbidden), "idem-ports must not depend on {forbidden}");
    }
}

#[test]
fn no_adapter_depends_on_another_adapter() {
    let adapters = ["idem-postgres", "idem-kafka", "idem-http"];
    for a in adapters {
        let deps = dependency_tree(a);
        assert!(deps.contains("idem-ports"), "{a} implements the ports, so it depends on idem-ports");
        for b in adapters.iter().filter(|b| **b != a) {
            assert!(!deps.contains(*b), "{a} must not depend on {b}");
        }
        assert!(!deps.contains("idem-app"), "{a} must not depend on idem-app");
    }
}

#[test]
fn the_ledger_service_uses_only_the_toolkits_public_crates() {
    let deps = dependency_tree("idem-ledger");
    for used in ["idem-ports", "idem-postgres", "idem-http"] {
        assert!(deps.contains(used), "idem-ledger is built on {used}: {deps:?}");
    }
    assert!(!deps.contains("idem-app"), "idem-ledger must not depend on the reference service's binary");
}

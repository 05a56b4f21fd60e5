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
        "idem-provider",
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
    let adapters = ["idem-postgres", "idem-kafka", "idem-http", "idem-provider"];
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
    for used in ["idem", "idem-ports", "idem-postgres", "idem-http"] {
        assert!(deps.contains(used), "idem-ledger is built on {used} (through the facade `idem`): {deps:?}");
    }
    assert!(!deps.contains("idem-app"), "idem-ledger must not depend on the reference service's binary");
    let facade = dependency_tree("idem");
    assert!(!facade.contains("idem-app"), "the facade must not depend on the reference service's binary");
}

/// Issue 36: a service without Kafka (`idem` with `http` and `postgres` only) builds no librdkafka, so it
/// needs neither cmake nor a C toolchain for it; with `kafka` the tree has it (the check can fail).
#[test]
fn the_facade_without_kafka_builds_no_librdkafka() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let tree = |features: &str| {
        let args = ["tree", "--offline", "-p", "idem", "--no-default-features", "-F", features, "-e", "normal,build"];
        let out = Command::new(&cargo).args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().expect("cargo tree");
        assert!(out.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("utf-8")
    };
    let without = tree("http,postgres");
    for native in ["rdkafka", "cmake"] {
        assert!(!without.contains(native), "idem without kafka depends on {native}:\n{without}");
    }
    assert!(tree("kafka").contains("rdkafka-sys"), "the kafka feature is what brings librdkafka");
}

/// Issue 36: the ledger and the example name only the facade among idem's crates, in their tests too
/// (`idem::testing` instead of the internal `idem-tests`): what they do, a user's crate can do.
#[test]
fn the_ledger_and_the_example_name_only_the_facade() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for manifest in ["ledger/Cargo.toml", "examples/inventory/Cargo.toml"] {
        let text = std::fs::read_to_string(root.join(manifest)).expect("manifest");
        let mut section = String::new();
        let mut named = Vec::new();
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line.to_owned();
            } else if section.ends_with("dependencies]") && line.starts_with("idem") {
                named.push(line.split(['=', '.', ' ']).next().unwrap_or_default().to_owned());
            }
        }
        assert!(named.contains(&"idem".to_owned()), "{manifest} does not use the facade: {named:?}");
        assert!(named.iter().all(|n| n == "idem"), "{manifest} names idem's inner crates: {named:?}");
    }
}

/// Every path and item ARCHITECTURE.md's tables name exists: a path relative to the repository's root (or,
/// for a bare file name, beside another path of its row), an item (`Runner::apply`, `decide`) in the files
/// of its row or, when the row names none that holds it, in the workspace's sources. The codemap cannot
/// drift from the code silently.
#[test]
fn every_path_and_item_in_the_architecture_tables_exists() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let sources = workspace_sources(&root);
    let mut checked = 0;
    for row in doc.lines().filter(|l| l.starts_with('|') && !l.starts_with("| ---")) {
        let tokens: Vec<&str> = row.split('`').skip(1).step_by(2).collect();
        let is_path = |t: &str| {
            t.contains('/') || [".rs", ".sql", ".toml", ".yml", ".json", ".md"].iter().any(|e| t.ends_with(e))
        };
        let mut dirs = Vec::new();
        let mut files = Vec::new();
        for t in tokens.iter().filter(|t| is_path(t)) {
            let t = t.trim_end_matches('/');
            // `domain/src/usecases/{charge,refund}.rs`
            let expanded: Vec<String> = match (t.find('{'), t.find('}')) {
                (Some(a), Some(b)) => {
                    t[a + 1..b].split(',').map(|x| format!("{}{x}{}", &t[..a], &t[b + 1..])).collect()
                }
                _ => vec![t.to_owned()],
            };
            for path in expanded {
                // `model/src/*.rs`: the directory holds such files
                let path = match path.rsplit_once("/*") {
                    Some((dir, _)) => dir.to_owned(),
                    None => path,
                };
                let direct = root.join(&path);
                let beside = dirs.iter().map(|d: &std::path::PathBuf| d.join(&path)).find(|p| p.exists());
                let found = if direct.exists() { Some(direct) } else { beside };
                let found =
                    found.unwrap_or_else(|| panic!("ARCHITECTURE.md names `{path}`, which does not exist: {row}"));
                if let Some(parent) = found.parent() {
                    dirs.push(parent.to_path_buf());
                }
                if found.is_file() {
                    files.push(std::fs::read_to_string(&found).unwrap_or_default());
                }
                checked += 1;
            }
        }
        let is_item = |t: &str| {
            !is_path(t)
                && t.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
                && t.len() > 3
        };
        for item in tokens.iter().filter(|t| is_item(t)) {
            let last = item.rsplit("::").next().unwrap_or(item);
            let in_row = files.iter().any(|f| f.contains(last));
            assert!(
                in_row || sources.contains(last),
                "ARCHITECTURE.md names `{item}`, found nowhere in the sources: {row}"
            );
            checked += 1;
        }
    }
    assert!(checked > 100, "only {checked} paths and items found in ARCHITECTURE.md's tables");
}

/// Every Rust and SQL source of the workspace, concatenated.
fn workspace_sources(root: &std::path::Path) -> String {
    fn walk(dir: &std::path::Path, out: &mut String) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if path.is_dir() && !name.starts_with('.') && name != "target" {
                walk(&path, out);
            } else if name.ends_with(".rs") || name.ends_with(".sql") {
                out.push_str(&std::fs::read_to_string(&path).unwrap_or_default());
            }
        }
    }
    let mut out = String::new();
    walk(root, &mut out);
    out
}

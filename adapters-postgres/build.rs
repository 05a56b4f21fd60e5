//! sqlx's `query!` macros decide when they expand whether to ask a database (`DATABASE_URL`) or read the
//! committed `.sqlx/` data (`SQLX_OFFLINE`). This workspace sets `SQLX_OFFLINE` in `.cargo/config.toml`, but
//! that file does not apply to crates that depend on idem from elsewhere: with a `DATABASE_URL` in their
//! environment (their own database, without idem's tables) the macros would ask it and the build would fail.
//! So this crate always expands from `.sqlx/`, unless `scripts/sqlx-prepare.sh` regenerates that data
//! (`SQLX_OFFLINE=false`).

fn main() {
    println!("cargo:rerun-if-env-changed=SQLX_OFFLINE");
    if std::env::var("SQLX_OFFLINE").is_ok_and(|v| v == "false") {
        return;
    }
    println!("cargo:rustc-env=SQLX_OFFLINE=true");
}

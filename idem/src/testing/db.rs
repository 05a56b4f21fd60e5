//! A database per test.

use std::time::Duration;

use anyhow::Context;
use idem_postgres::{PgStore, PoolSettings};
use sqlx::Connection;
use tokio::sync::OnceCell;

/// Prefix of per-test databases.
const DB_PREFIX: &str = "idem_test_";

static ADMIN_URL: OnceCell<String> = OnceCell::const_new();

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// URL of a server where the kit may create databases: `DATABASE_URL`, or a PostgreSQL container.
async fn admin_url() -> anyhow::Result<String> {
    ADMIN_URL
        .get_or_try_init(|| async {
            let url = match std::env::var("DATABASE_URL") {
                Ok(url) => url,
                Err(_) => super::containers::postgres().await?,
            };
            drop_stale_databases(&url).await?;
            Ok(url)
        })
        .await
        .cloned()
}

/// Drops per-test databases created more than 30 minutes ago: hundreds of leftovers keep autovacuum busy.
async fn drop_stale_databases(admin: &str) -> anyhow::Result<()> {
    let mut conn = sqlx::PgConnection::connect(admin).await.context("connecting to PostgreSQL")?;
    let names: Vec<String> = sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'idem\\_test\\_%'")
        .fetch_all(&mut conn)
        .await?;
    let cutoff = unix_now().saturating_sub(30 * 60);
    for name in names {
        let created = name
            .strip_prefix(DB_PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|secs| secs.parse::<u64>().ok());
        if created.is_some_and(|c| c < cutoff) {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&mut conn).await;
        }
    }
    Ok(())
}

/// A fresh database for one test (tests then run in parallel), created on the server of `DATABASE_URL`
/// or, when it is not set, in a PostgreSQL container ([`super::containers`]). Left behind after the test
/// for a look; the kit drops those older than 30 minutes.
#[derive(Debug, Clone)]
pub struct TestDb {
    /// The store on it (its pool).
    pub store: PgStore,
    /// Its URL.
    pub url: String,
    /// Its name (`idem_test_<unix seconds>_<uuid>`).
    pub name: String,
}

impl TestDb {
    /// A database with idem's tables.
    pub async fn new() -> anyhow::Result<Self> {
        let db = Self::unmigrated(PoolSettings::default()).await?;
        db.store.migrate().await?;
        Ok(db)
    }

    /// A database with idem's tables and yours (`sqlx::migrate!()`), as `PgStore::migrate_with` installs
    /// them in production.
    pub async fn with_migrations(migrator: &sqlx::migrate::Migrator) -> anyhow::Result<Self> {
        let db = Self::unmigrated(PoolSettings::default()).await?;
        db.store.migrate_with(Some(migrator)).await?;
        Ok(db)
    }

    /// A database with nothing in it, its pool built with `settings` (the caller migrates what it needs).
    pub async fn unmigrated(settings: PoolSettings) -> anyhow::Result<Self> {
        let admin = admin_url().await?;
        let name = format!("{DB_PREFIX}{}_{}", unix_now(), uuid::Uuid::new_v4().simple());
        let mut conn = sqlx::PgConnection::connect(&admin).await?;
        sqlx::query(&format!("CREATE DATABASE \"{name}\"")).execute(&mut conn).await?;
        conn.close().await?;
        let url = with_database(&admin, &name);
        let store = PgStore::connect(&url, &settings).await?;
        Ok(Self { store, url, name })
    }

    /// The store's pool, for the test's own queries.
    pub fn pool(&self) -> &sqlx::PgPool {
        self.store.pool()
    }

    /// Rows of `table` (a literal of the test: it is not quoted).
    pub async fn count(&self, table: &str) -> anyhow::Result<i64> {
        Ok(sqlx::query_scalar(&format!("SELECT count(*) FROM {table}")).fetch_one(self.pool()).await?)
    }

    /// Outbox rows not yet published (quarantined ones included): the relay deletes what it published.
    pub async fn unpublished(&self) -> anyhow::Result<i64> {
        self.count("outbox_message").await
    }

    /// Waits until every outbox row is published; false when `timeout` passed first.
    pub async fn all_published_within(&self, timeout: Duration) -> anyhow::Result<bool> {
        super::eventually(timeout, || async { Ok(self.unpublished().await? == 0) }).await
    }
}

/// `url` with its database name replaced by `db` (its query kept).
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let base = match base[scheme_end..].find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    match query {
        Some(q) => format!("{base}/{db}?{q}"),
        None => format!("{base}/{db}"),
    }
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn replaces_database_name() {
        assert_eq!(with_database("postgres://u@h:5432/postgres", "x"), "postgres://u@h:5432/x");
        assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
        assert_eq!(with_database("postgres://u@h/db?sslmode=disable", "x"), "postgres://u@h/x?sslmode=disable");
    }
}

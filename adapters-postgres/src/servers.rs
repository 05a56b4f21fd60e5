//! The servers a database URL names: one, or several in libpq's multi-host form
//! (`postgres://user@h1:5432,h2:5432,h3:5432/db?target_session_attrs=read-write`), which HA tools hand out
//! and sqlx does not follow (its issues #2290 and #3333).
//!
//! Every connection idem opens — units of work, the small pool, migrations, the relays' `LISTEN` — comes
//! from here. A new connection tries the server found last, then the others in the URL's order (libpq tries
//! them in order every time; starting from the last good one saves a dead first host's timeout on every
//! connection after a failover), each within `connect_timeout` (libpq's parameter, in seconds; 10 s by
//! default here, where libpq waits for the kernel), and keeps the first whose session matches
//! `target_session_attrs` as libpq defines it: `any` (default), `read-write` and `read-only` (by
//! `transaction_read_only`), `primary` and `standby` (by `pg_is_in_recovery()`), `prefer-standby` (a
//! standby, else any). When the server found changes (a failover), the generation moves on: connections
//! opened before are closed instead of reused, and the small pool connects to the new server. TLS settings
//! and credentials apply to every host.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_ports::StoreError;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::{Connection, Row};

/// Which sessions a connection may keep (libpq's `target_session_attrs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    Any,
    ReadWrite,
    ReadOnly,
    Primary,
    Standby,
    PreferStandby,
}

impl Target {
    fn parse(value: &str) -> Result<Self, StoreError> {
        Ok(match value {
            "any" => Self::Any,
            "read-write" => Self::ReadWrite,
            "read-only" => Self::ReadOnly,
            "primary" => Self::Primary,
            "standby" => Self::Standby,
            "prefer-standby" => Self::PreferStandby,
            other => {
                return Err(StoreError::Other(format!(
                    "invalid database url: target_session_attrs={other:?} (any, read-write, read-only, primary, \
                     standby, prefer-standby)"
                )));
            }
        })
    }

    /// Whether a session with these attributes is kept (`PreferStandby`'s fallback pass keeps any).
    fn accepts(self, in_recovery: bool, read_only: bool) -> bool {
        match self {
            Self::Any => true,
            Self::ReadWrite => !read_only,
            Self::ReadOnly => read_only,
            Self::Primary => !in_recovery,
            Self::Standby | Self::PreferStandby => in_recovery,
        }
    }
}

/// The servers of a URL (see the module docs). Cheap to clone.
#[derive(Clone)]
pub(crate) struct Servers(Arc<Inner>);

struct Inner {
    hosts: Vec<PgConnectOptions>,
    target: Target,
    connect_timeout: Duration,
    /// The server found last: tried first.
    preferred: AtomicUsize,
    /// Moves on whenever `preferred` changes.
    generation: AtomicU64,
    /// Pools that connect to the preferred server (their options follow it).
    pools: Mutex<Vec<PgPool>>,
}

impl std::fmt::Debug for Servers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the options: they hold the password
        f.debug_struct("Servers").field("hosts", &self.0.hosts.len()).field("target", &self.0.target).finish()
    }
}

const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Statements that found their server demoted or going away (`25006` read-only, `57P01`–`57P03`), in
/// this process: each one ends the generation of every set of servers, so no connection opened before is
/// reused (one to a demoted primary would fail every transaction until its lifetime ended) and the next
/// connection looks for the server to use again.
static SERVER_LOST: AtomicU64 = AtomicU64::new(0);

/// Records a statement that found its server demoted or going away (see [`SERVER_LOST`]).
pub(crate) fn server_lost() {
    SERVER_LOST.fetch_add(1, SeqCst);
}

impl Servers {
    /// One server, any session.
    pub(crate) fn single(options: PgConnectOptions) -> Self {
        Self::new(vec![options], Target::Any, DEFAULT_CONNECT_TIMEOUT)
    }

    fn new(hosts: Vec<PgConnectOptions>, target: Target, connect_timeout: Duration) -> Self {
        Self(Arc::new(Inner {
            hosts,
            target,
            connect_timeout,
            preferred: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            pools: Mutex::new(Vec::new()),
        }))
    }

    /// The servers of `url`; `parse` reads a single-host URL (the store's own parser, which keeps the
    /// parameters sqlx supports and refuses the ones it must not ignore).
    pub(crate) fn parse(
        url: &str,
        parse: impl Fn(&str) -> Result<PgConnectOptions, StoreError>,
    ) -> Result<Self, StoreError> {
        let (url, target, connect_timeout) = session_parameters(url)?;
        let hosts = split_hosts(&url)?.iter().map(|u| parse(u)).collect::<Result<Vec<_>, _>>()?;
        Ok(Self::new(hosts, target, connect_timeout))
    }

    /// The same servers with `f` applied to each one's options.
    pub(crate) fn map(&self, f: impl Fn(PgConnectOptions) -> PgConnectOptions) -> Self {
        Self::new(self.0.hosts.iter().cloned().map(f).collect(), self.0.target, self.0.connect_timeout)
    }

    /// Whether a connection may need checking (several hosts, or a session requirement).
    fn checks(&self) -> bool {
        self.0.hosts.len() > 1 || self.0.target != Target::Any
    }

    /// The options of the server found last.
    pub(crate) fn current(&self) -> PgConnectOptions {
        self.0.hosts[self.0.preferred.load(SeqCst).min(self.0.hosts.len() - 1)].clone()
    }

    /// Moves on whenever a new server is found, or a statement found its server demoted ([`SERVER_LOST`]):
    /// connections opened under an older generation are closed.
    pub(crate) fn generation(&self) -> u64 {
        self.0.generation.load(SeqCst).wrapping_add(SERVER_LOST.load(SeqCst))
    }

    /// Keeps `pool`'s connect options on the server found last.
    pub(crate) fn follow(&self, pool: &PgPool) {
        if self.checks() {
            self.0.pools.lock().unwrap_or_else(|p| p.into_inner()).push(pool.clone());
        }
    }

    /// A new connection to the first server that answers and matches (see the module docs), with the
    /// generation it belongs to.
    pub(crate) async fn connect(&self) -> Result<(PgConnection, u64), sqlx::Error> {
        if !self.checks() {
            return Ok((PgConnection::connect_with(&self.0.hosts[0]).await?, self.generation()));
        }
        let first = self.0.preferred.load(SeqCst);
        let order: Vec<usize> = std::iter::once(first).chain((0..self.0.hosts.len()).filter(|i| *i != first)).collect();
        let passes: &[Target] = match self.0.target {
            Target::PreferStandby => &[Target::Standby, Target::Any],
            target => &[target],
        };
        let mut last = None;
        for target in passes {
            for &i in &order {
                match self.try_host(i, *target).await {
                    Ok(conn) => {
                        if self.0.preferred.swap(i, SeqCst) != i {
                            self.0.generation.fetch_add(1, SeqCst);
                            tracing::info!(host = i, "database: connected to another server of the url");
                            for pool in self.0.pools.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                                pool.set_connect_options(self.0.hosts[i].clone());
                            }
                        }
                        return Ok((conn, self.generation()));
                    }
                    Err(e) => last = Some(e),
                }
            }
        }
        Err(last.unwrap_or(sqlx::Error::PoolTimedOut))
    }

    /// Finds the server to use now (after a connection failed or found its server demoted).
    pub(crate) async fn resolve(&self) {
        if self.checks()
            && let Ok((conn, _)) = self.connect().await
        {
            let _ = tokio::time::timeout(self.0.connect_timeout, conn.close()).await;
        }
    }

    async fn try_host(&self, i: usize, target: Target) -> Result<PgConnection, sqlx::Error> {
        let timeout = self.0.connect_timeout;
        let mut conn = tokio::time::timeout(timeout, PgConnection::connect_with(&self.0.hosts[i]))
            .await
            .map_err(|_| sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "connect_timeout")))??;
        if target == Target::Any {
            return Ok(conn);
        }
        let sql = "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'";
        let row = tokio::time::timeout(timeout, sqlx::query(sql).fetch_one(&mut conn))
            .await
            .map_err(|_| sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "session check")))??;
        if target.accepts(row.try_get(0)?, row.try_get(1)?) {
            return Ok(conn);
        }
        let _ = tokio::time::timeout(timeout, conn.close()).await;
        Err(not_target(i, target))
    }
}

/// A server of the URL whose session does not match `target_session_attrs` — during a failover, none may
/// for seconds: a connection failure (transient: `503`, retried), as libpq reports it, never a
/// configuration error (it was answered `500`, and a client stopped retrying a charge that then committed).
fn not_target(i: usize, target: Target) -> sqlx::Error {
    let what = format!("server {} of the url is not {target:?} now", i + 1);
    sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, what))
}

/// Takes `target_session_attrs` and `connect_timeout` out of `url` (sqlx knows neither).
fn session_parameters(url: &str) -> Result<(String, Target, Duration), StoreError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), Target::Any, DEFAULT_CONNECT_TIMEOUT));
    };
    let (mut target, mut timeout, mut kept) = (Target::Any, DEFAULT_CONNECT_TIMEOUT, Vec::new());
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("target_session_attrs", value)) => target = Target::parse(value)?,
            Some(("connect_timeout", value)) => {
                let secs: u64 = value.parse().map_err(|_| {
                    StoreError::Other(format!("invalid database url: connect_timeout={value:?} (whole seconds)"))
                })?;
                // libpq: 0 or absent waits indefinitely, and values below 2 mean 2
                timeout = if secs == 0 { DEFAULT_CONNECT_TIMEOUT } else { Duration::from_secs(secs.max(2)) };
            }
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    Ok((url, target, timeout))
}

/// One single-host URL per host of `url` (`postgres://u:p@h1:5432,h2,[::1]:5433/db?…`).
fn split_hosts(url: &str) -> Result<Vec<String>, StoreError> {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else { return Ok(vec![url.to_owned()]) };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    if !hosts.contains(',') {
        return Ok(vec![url.to_owned()]);
    }
    let scheme = &url[..scheme_end];
    let split: Vec<String> = hosts.split(',').map(|host| format!("{scheme}{userinfo}{host}{tail}")).collect();
    if hosts.split(',').any(str::is_empty) {
        return Err(StoreError::Other("invalid database url: an empty host in its host list".into()));
    }
    Ok(split)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 34.3: the failover harness saw `500`s from the multi-host instance while no server was
    /// read-write yet (`server 3 is not ReadWrite`, a configuration error): retryable now.
    #[test]
    fn no_server_matching_the_session_attributes_yet_is_transient() {
        let err = crate::map_sqlx_error(not_target(2, Target::ReadWrite));
        assert!(err.is_transient(), "{err}");
        assert!(err.to_string().contains("server 3 of the url is not ReadWrite"), "{err}");
    }

    #[test]
    fn a_host_list_becomes_one_url_per_host_with_everything_else_kept() {
        let urls = split_hosts("postgres://u:p%40ss@h1:5432,h2,[::1]:5433/db?sslmode=require").expect("valid");
        assert_eq!(
            urls,
            [
                "postgres://u:p%40ss@h1:5432/db?sslmode=require",
                "postgres://u:p%40ss@h2/db?sslmode=require",
                "postgres://u:p%40ss@[::1]:5433/db?sslmode=require",
            ]
        );
        assert_eq!(split_hosts("postgres://u@h/db").expect("valid"), ["postgres://u@h/db"]);
        assert!(split_hosts("postgres://u@h1,,h2/db").is_err());
    }

    #[test]
    fn session_parameters_are_read_and_removed() {
        let (url, target, timeout) =
            session_parameters("postgres://h1,h2/db?sslmode=disable&target_session_attrs=read-write&connect_timeout=3")
                .expect("valid");
        assert_eq!(
            (url.as_str(), target, timeout),
            ("postgres://h1,h2/db?sslmode=disable", Target::ReadWrite, Duration::from_secs(3))
        );
        assert!(session_parameters("postgres://h/db?target_session_attrs=leader").is_err());
        assert!(session_parameters("postgres://h/db?connect_timeout=soon").is_err());
        assert_eq!(session_parameters("postgres://h/db?connect_timeout=1").expect("valid").2, Duration::from_secs(2));
    }

    #[test]
    fn targets_accept_as_libpq_defines_them() {
        // (in recovery, read only): a primary, a primary with default_transaction_read_only, a standby
        let (primary, read_only_primary, standby) = ((false, false), (false, true), (true, true));
        let accepts = |t: Target, (r, ro): (bool, bool)| t.accepts(r, ro);
        assert!(accepts(Target::ReadWrite, primary) && !accepts(Target::ReadWrite, read_only_primary));
        assert!(!accepts(Target::ReadWrite, standby));
        assert!(accepts(Target::Primary, read_only_primary) && !accepts(Target::Primary, standby));
        assert!(accepts(Target::Standby, standby) && !accepts(Target::Standby, primary));
        assert!(accepts(Target::ReadOnly, read_only_primary) && accepts(Target::ReadOnly, standby));
        assert!(accepts(Target::Any, standby));
    }
}

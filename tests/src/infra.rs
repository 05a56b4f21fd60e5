//! Production infrastructure the deployment tests start from Debian's packages: a certificate authority,
//! a private TLS-only PostgreSQL cluster, PgBouncer in transaction mode, a TLS front (stunnel) before a
//! private tansu, and a proxy that freezes the connections it carries (no RST, no FIN: a failover that
//! black-holes them) while new ones pass.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use idem::testing::wait_for_port;
use tokio_util::sync::CancellationToken;

/// A CA with a server certificate for `localhost` and `127.0.0.1`, and a second CA that signed nothing
/// of it (the wrong trust anchor).
#[derive(Debug)]
pub struct Pki {
    _dir: tempfile::TempDir,
    pub ca: PathBuf,
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

impl Pki {
    pub fn new() -> anyhow::Result<Self> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let dir = tempfile::Builder::new().prefix("idem-pki-").tempdir()?;
        let ca = |name: &str| -> anyhow::Result<(rcgen::Certificate, KeyPair)> {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::new(Vec::<String>::new())?;
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, name);
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            Ok((params.self_signed(&key)?, key))
        };
        let (ca_cert, ca_key) = ca("idem test CA")?;
        let (other_cert, _) = ca("idem test CA")?; // same name, another key: only the signature tells
        let server_key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
        params.distinguished_name.push(DnType::CommonName, "localhost");
        let server = params.signed_by(&server_key, &ca_cert, &ca_key)?;
        let write = |name: &str, pem: String| -> anyhow::Result<PathBuf> {
            let path = dir.path().join(name);
            std::fs::write(&path, pem)?;
            Ok(path)
        };
        Ok(Self {
            ca: write("ca.pem", ca_cert.pem())?,
            other_ca: write("other-ca.pem", other_cert.pem())?,
            server_cert: write("server.pem", server.pem())?,
            server_key: write("server.key", server_key.serialize_pem())?,
            _dir: dir,
        })
    }
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0\n")).unwrap_or(false)
}

/// `program` run as the `postgres` user when the tests run as root (initdb, postgres and pgbouncer refuse
/// root).
fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn give_to_postgres(path: &Path) -> anyhow::Result<()> {
    if is_root() {
        let status = Command::new("chown").args(["-R", "postgres:postgres"]).arg(path).status()?;
        anyhow::ensure!(status.success(), "chown {}", path.display());
    }
    Ok(())
}

fn run(mut cmd: Command, what: &str) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// PostgreSQL's server programs (the newest installed major version, or `PG_BINDIR`).
pub fn pg_bindir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("PG_BINDIR") {
        return Ok(dir.into());
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")?
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin): &(u32, PathBuf)| bin.join("initdb").exists())
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin).context("no PostgreSQL server under /usr/lib/postgresql")
}

/// A private PostgreSQL cluster that accepts only TLS connections with a SCRAM password on TCP
/// (`hostssl … scram-sha-256`; plain TCP is rejected by `pg_hba.conf`). Stopped when dropped.
#[derive(Debug)]
pub struct TlsPostgres {
    dir: tempfile::TempDir,
    bindir: PathBuf,
    pub port: u16,
    pub password: String,
}

impl TlsPostgres {
    pub async fn start(pki: &Pki, password: &str) -> anyhow::Result<Self> {
        let bindir = pg_bindir()?;
        let dir = tempfile::Builder::new().prefix("idem-tlspg-").tempdir()?;
        let data = dir.path().join("data");
        let pwfile = dir.path().join("pw");
        std::fs::write(&pwfile, password)?;
        initdb(&bindir, dir.path(), &["--auth-host=scram-sha-256", &format!("--pwfile={}", pwfile.display())])?;
        std::fs::copy(&pki.server_cert, data.join("server.crt"))?;
        std::fs::copy(&pki.server_key, data.join("server.key"))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(data.join("server.key"), std::fs::Permissions::from_mode(0o600))?;
        }
        let port = configure_and_start(
            &bindir,
            dir.path(),
            "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\nfsync = off\nshared_buffers = 32MB\n\
             max_connections = 60\n",
            "local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256\nhostssl all all ::1/128 scram-sha-256\n",
        )?;
        Ok(Self { dir, bindir, port, password: password.to_owned() })
    }

    /// A URL for the `postgres` user with its password and `params` (`sslmode=…&sslrootcert=…`).
    pub fn url(&self, host: &str, params: &str) -> String {
        format!("postgres://postgres:{}@{host}:{}/postgres?{params}", self.password, self.port)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        stop_cluster(&self.bindir, self.dir.path());
    }
}

/// `initdb` of a private cluster in `dir/data`, superuser `postgres`, trust on the Unix socket.
fn initdb(bindir: &Path, dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    give_to_postgres(dir)?;
    let mut initdb = as_postgres(&bindir.join("initdb"));
    initdb.arg("-D").arg(dir.join("data")).args(["-U", "postgres", "--auth-local=trust"]).args(args);
    initdb.stdout(Stdio::null());
    run(initdb, "initdb")?;
    Ok(())
}

/// Appends `settings` to the cluster's configuration (on a free loopback port, its socket in `dir`), writes
/// `hba` as its `pg_hba.conf`, starts it and waits until it accepts connections; returns the port.
fn configure_and_start(bindir: &Path, dir: &Path, settings: &str, hba: &str) -> anyhow::Result<u16> {
    let data = dir.join("data");
    let port = crate::port_for_child();
    let conf = format!(
        "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n{settings}",
        dir.display()
    );
    let mut pg_conf = std::fs::OpenOptions::new().append(true).open(data.join("postgresql.conf"))?;
    std::io::Write::write_all(&mut pg_conf, conf.as_bytes())?;
    std::fs::write(data.join("pg_hba.conf"), hba)?;
    give_to_postgres(dir)?;
    let mut start = as_postgres(&bindir.join("pg_ctl"));
    start.arg("-D").arg(&data).arg("-l").arg(dir.join("log")).args(["-w", "start"]).stdout(Stdio::null());
    run(start, "pg_ctl start")?;
    Ok(port)
}

/// A private PostgreSQL cluster with `settings` appended to its configuration (for example
/// `wal_level = logical` for a logical-replication peer), trust authentication on loopback. Stopped when
/// dropped.
#[derive(Debug)]
pub struct PrivatePostgres {
    dir: tempfile::TempDir,
    bindir: PathBuf,
    pub port: u16,
}

impl PrivatePostgres {
    pub async fn start(settings: &str) -> anyhow::Result<Self> {
        let bindir = pg_bindir()?;
        let dir = tempfile::Builder::new().prefix("idem-pg-").tempdir()?;
        initdb(&bindir, dir.path(), &["--auth-host=trust"])?;
        let hba = "local all all trust\nhost all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n";
        let port = configure_and_start(&bindir, dir.path(), settings, hba)?;
        Ok(Self { dir, bindir, port })
    }

    /// The URL of `database` as the superuser `postgres`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// A streaming standby of this cluster (`pg_basebackup -R`), started and accepting read-only sessions.
    pub async fn standby(&self) -> anyhow::Result<Self> {
        let bindir = pg_bindir()?;
        let dir = tempfile::Builder::new().prefix("idem-pg-standby-").tempdir()?;
        give_to_postgres(dir.path())?;
        let mut base = as_postgres(&bindir.join("pg_basebackup"));
        base.arg("-D").arg(dir.path().join("data")).args(["-R", "-X", "stream", "-h", "127.0.0.1", "-U", "postgres"]);
        base.args(["-p", &self.port.to_string()]);
        run(base, "pg_basebackup")?;
        // the copied configuration names the primary's port and socket: the lines appended last win
        let hba = "local all all trust\nhost all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n";
        let port = configure_and_start(&bindir, dir.path(), "", hba)?;
        Ok(Self { dir, bindir, port })
    }

    /// Promotes this standby to a primary and waits until it is one.
    pub fn promote(&self) -> anyhow::Result<()> {
        let mut promote = as_postgres(&self.bindir.join("pg_ctl"));
        promote.arg("-D").arg(self.dir.path().join("data")).args(["-w", "promote"]).stdout(Stdio::null());
        run(promote, "pg_ctl promote")
    }

    /// Stops the server at once (`-m immediate`: no checkpoint, its clients' connections cut), as a crash.
    pub fn crash(&self) {
        stop_cluster(&self.bindir, self.dir.path());
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        stop_cluster(&self.bindir, self.dir.path());
    }
}

fn stop_cluster(bindir: &Path, dir: &Path) {
    let mut stop = as_postgres(&bindir.join("pg_ctl"));
    stop.arg("-D").arg(dir.join("data")).args(["-m", "immediate", "stop"]);
    let _ = stop.stdout(Stdio::null()).stderr(Stdio::null()).status();
}

/// Debian's PgBouncer in transaction pooling mode with the usual settings (`ignore_startup_parameters =
/// extra_float_digits`), in front of the server on `upstream_port`, with `pool_size` server connections per
/// database. Stopped when dropped.
#[derive(Debug)]
pub struct PgBouncer {
    _dir: tempfile::TempDir,
    child: Child,
    pub port: u16,
}

impl PgBouncer {
    pub async fn start(upstream_port: u16, pool_size: u32) -> anyhow::Result<Self> {
        let bin = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .context("pgbouncer is not installed (scripts/services.sh installs it)")?;
        let dir = tempfile::Builder::new().prefix("idem-pgbouncer-").tempdir()?;
        let port = crate::port_for_child();
        let ini = dir.path().join("pgbouncer.ini");
        std::fs::write(dir.path().join("users.txt"), "\"postgres\" \"\"\n")?;
        std::fs::write(
            &ini,
            format!(
                "[databases]\n* = host=127.0.0.1 port={upstream_port}\n\n[pgbouncer]\nlisten_addr = 127.0.0.1\n\
                 listen_port = {port}\nunix_socket_dir =\nauth_type = trust\nauth_file = {users}\n\
                 pool_mode = transaction\nignore_startup_parameters = extra_float_digits\n\
                 max_client_conn = 2000\ndefault_pool_size = {pool_size}\nlogfile = {log}\n",
                users = dir.path().join("users.txt").display(),
                log = dir.path().join("pgbouncer.log").display(),
            ),
        )?;
        give_to_postgres(dir.path())?;
        let child = as_postgres(&bin).arg(&ini).stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
        wait_for_port(port, "pgbouncer").await?;
        Ok(Self { _dir: dir, child, port })
    }

    /// `url` (a database on the upstream server) rewritten to go through this PgBouncer.
    pub fn url_for(&self, url: &str) -> anyhow::Result<String> {
        let (head, rest) = url.split_once("://").context("url without scheme")?;
        let (auth, after) = rest.rsplit_once('@').map(|(a, r)| (format!("{a}@"), r)).unwrap_or((String::new(), rest));
        let path = after.find('/').map(|i| &after[i..]).unwrap_or("/postgres");
        Ok(format!("{head}://{auth}127.0.0.1:{}{path}", self.port))
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // runuser forwards the signal to pgbouncer
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let _ = self.child.wait();
    }
}

/// A private tansu broker reachable only through Debian's stunnel (TLS with the [`Pki`]'s server
/// certificate): it advertises the TLS port, so every client connection is encrypted.
#[derive(Debug)]
pub struct TlsBroker {
    _dir: tempfile::TempDir,
    broker: Child,
    stunnel: Child,
    /// Bootstrap address (the TLS port).
    pub bootstrap: String,
}

impl TlsBroker {
    pub async fn start(pki: &Pki) -> anyhow::Result<Self> {
        let bin = crate::kafka::tansu_bin();
        anyhow::ensure!(bin.exists(), "tansu binary not found at {} (run scripts/services.sh)", bin.display());
        let stunnel_bin = ["/usr/bin/stunnel4", "/usr/bin/stunnel"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .context("stunnel4 is not installed (scripts/services.sh installs it)")?;
        let (broker_port, tls_port) = (crate::port_for_child(), crate::port_for_child());
        let broker = Command::new(bin)
            .arg("broker")
            .arg("--listener-url")
            .arg(format!("tcp://127.0.0.1:{broker_port}"))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://localhost:{tls_port}"))
            .arg("--storage-engine")
            .arg("memory://tansu/")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let dir = tempfile::Builder::new().prefix("idem-stunnel-").tempdir()?;
        let conf = dir.path().join("stunnel.conf");
        std::fs::write(
            &conf,
            format!(
                "foreground = yes\npid =\nsyslog = no\ndebug = 3\n[kafka]\naccept = 127.0.0.1:{tls_port}\n\
                 connect = 127.0.0.1:{broker_port}\ncert = {}\nkey = {}\n",
                pki.server_cert.display(),
                pki.server_key.display()
            ),
        )?;
        let stunnel = Command::new(stunnel_bin).arg(&conf).stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
        let me = Self { _dir: dir, broker, stunnel, bootstrap: format!("localhost:{tls_port}") };
        wait_for_port(broker_port, "tansu").await?;
        wait_for_port(tls_port, "stunnel").await?;
        Ok(me)
    }

    /// A properties file for clients of this broker, trusting `ca`.
    pub fn properties(&self, ca: &Path) -> String {
        format!(
            "security.protocol=SSL\nssl.ca.location={}\nssl.endpoint.identification.algorithm=https\n",
            ca.display()
        )
    }
}

impl Drop for TlsBroker {
    fn drop(&mut self) {
        for child in [&mut self.stunnel, &mut self.broker] {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A TCP proxy to `upstream` whose [`freeze`](Self::freeze) stops every connection it carries at that
/// moment: their bytes are no longer forwarded in either direction and the sockets stay open (no RST, no
/// FIN), as when a failover moves a virtual IP and the old path black-holes. Connections accepted later pass.
#[derive(Debug)]
pub struct FreezingProxy {
    pub port: u16,
    generation: Arc<Mutex<CancellationToken>>,
    frozen: Arc<std::sync::atomic::AtomicUsize>,
    stop: CancellationToken,
}

impl FreezingProxy {
    pub async fn start(upstream: u16) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let generation = Arc::new(Mutex::new(CancellationToken::new()));
        let (frozen, stop) = (Arc::new(std::sync::atomic::AtomicUsize::new(0)), CancellationToken::new());
        let (gen_loop, frozen_loop, stop_loop) = (generation.clone(), frozen.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let (client, _) = tokio::select! {
                    _ = stop_loop.cancelled() => return,
                    accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => continue },
                };
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else { continue };
                let freeze = gen_loop.lock().map(|g| g.clone()).unwrap_or_default();
                let (frozen, stop) = (frozen_loop.clone(), stop_loop.clone());
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let pump = async {
                        let _ = tokio::join!(tokio::io::copy(&mut cr, &mut sw), tokio::io::copy(&mut sr, &mut cw));
                    };
                    tokio::select! {
                        _ = pump => return,
                        _ = freeze.cancelled() => {}
                    }
                    // frozen: hold both sockets open and silent until the proxy is dropped
                    frozen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    stop.cancelled().await;
                    drop((cr, cw, sr, sw));
                });
            }
        });
        Ok(Self { port, generation, frozen, stop })
    }

    /// Freezes every connection open now; later ones pass.
    pub fn freeze(&self) {
        if let Ok(mut g) = self.generation.lock() {
            g.cancel();
            *g = CancellationToken::new();
        }
    }

    /// Connections frozen so far.
    pub fn frozen(&self) -> usize {
        self.frozen.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for FreezingProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The Patroni cluster of `scripts/ha.sh` (etcd, three PostgreSQL nodes with synchronous replication,
/// HAProxy), in a directory of its own on ports from `base_port`; taken down when dropped.
#[derive(Debug)]
pub struct HaCluster {
    dir: tempfile::TempDir,
    base_port: u16,
    /// Through HAProxy's read-write port.
    pub url: String,
    /// The three nodes, `target_session_attrs=read-write`.
    pub multihost_url: String,
}

impl HaCluster {
    pub fn up(base_port: u16) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("idem-ha-").tempdir()?;
        {
            use std::os::unix::fs::PermissionsExt;
            // the nodes run as `postgres`, in directories below this one
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        }
        let mut cluster = Self { dir, base_port, url: String::new(), multihost_url: String::new() };
        let printed = cluster.run("up")?;
        let line = |name: &str| {
            printed.lines().find_map(|l| l.strip_prefix(name)).map(str::to_owned).context("ha.sh up printed no URL")
        };
        cluster.url = line("DATABASE_URL=")?;
        cluster.multihost_url = line("DATABASE_MULTIHOST_URL=")?;
        Ok(cluster)
    }

    /// Runs `scripts/ha.sh COMMAND` on this cluster; returns what it printed.
    pub fn run(&self, command: &str) -> anyhow::Result<String> {
        self.run_args(&[command])
    }

    /// Waits until a primary runs and both other nodes stream from it (`ha.sh wait`), up to `bound`.
    pub fn wait_healthy(&self, bound: std::time::Duration) -> anyhow::Result<()> {
        let polls = (bound.as_millis() / 200).max(1).to_string();
        self.run_args(&["wait", &polls]).map(drop)
    }

    /// Runs `scripts/ha.sh ARGS…` on this cluster; returns what it printed.
    pub fn run_args(&self, args: &[&str]) -> anyhow::Result<String> {
        let command = args.join(" ");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/ha.sh");
        let out = Command::new(script)
            .args(args)
            .env("HA_DIR", self.dir.path().join("ha"))
            .env("HA_BASE_PORT", self.base_port.to_string())
            .output()
            .with_context(|| format!("running ha.sh {command}"))?;
        anyhow::ensure!(out.status.success(), "ha.sh {command} failed: {}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The name of the current primary (`n1`…`n3`), if one runs.
    pub fn primary(&self) -> anyhow::Result<Option<String>> {
        let status: serde_json::Value = serde_json::from_str(&self.run("status")?)?;
        Ok(status["primary"].as_str().map(str::to_owned))
    }
}

impl Drop for HaCluster {
    fn drop(&mut self) {
        let _ = self.run("down");
    }
}

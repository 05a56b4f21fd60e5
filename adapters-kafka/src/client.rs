//! rdkafka client configurations, each setting with the reason it is there.
//!
//! Every client idem creates (producer, consumer, dead-letter producer and reader, admin, probe) starts
//! from one [`KafkaConnection`]: the bootstrap servers plus the deployment's own librdkafka properties
//! (TLS, SASL, timeouts, debugging), typically read from a properties file. The properties idem's
//! guarantees rest on cannot be overridden that way ([`PROTECTED`]).

use std::time::Duration;

use rdkafka::ClientConfig;

/// librdkafka properties a deployment may not set: idem sets them (or relies on their defaults) for its
/// guarantees, each with the reason given when a properties file tries.
pub const PROTECTED: &[(&str, &str)] = &[
    ("bootstrap.servers", "set by KAFKA_BROKERS"),
    ("metadata.broker.list", "set by KAFKA_BROKERS"),
    ("group.id", "set by KAFKA_GROUP_ID, which idem guards against renames (a new group re-reads every event)"),
    (
        "enable.idempotence",
        "the producer must be idempotent: retries would otherwise write duplicates and reorder a key's events",
    ),
    ("enable.gapless.guarantee", "idempotent producer setting chosen by idem"),
    ("acks", "acks=all: an event counts as published only once every in-sync replica has it"),
    ("request.required.acks", "acks=all: an event counts as published only once every in-sync replica has it"),
    ("max.in.flight.requests.per.connection", "at most 5 in flight keeps a key's order under idempotence"),
    ("max.in.flight", "at most 5 in flight keeps a key's order under idempotence"),
    ("retries", "the producer retries until its delivery timeout, so a transient error never drops an event"),
    (
        "message.send.max.retries",
        "the producer retries until its delivery timeout, so a transient error never drops an event",
    ),
    (
        "partitioner",
        "murmur2_random: a key lands on the partition Java and Go producers choose, which its order depends on",
    ),
    ("transactional.id", "idem's relay publishes with an idempotent, non-transactional producer"),
    ("enable.auto.commit", "offsets are committed only after the database transaction of their events committed"),
    ("auto.commit.enable", "offsets are committed only after the database transaction of their events committed"),
    ("enable.auto.offset.store", "offsets are stored only after the database transaction of their events committed"),
    ("auto.offset.reset", "earliest: a new group starts from the beginning, so no event is skipped"),
    ("isolation.level", "read_committed: events of aborted producer transactions are never applied"),
    ("queuing.strategy", "fifo: a key's events are sent in the order they were produced"),
];

/// librdkafka's second names for one property (alias, the property it names), from its CONFIGURATION.md
/// (`tests/librdkafka-properties.tsv` checks the list against the pinned librdkafka).
const ALIASES: &[(&str, &str)] = &[
    ("acks", "request.required.acks"),
    ("bootstrap.servers", "metadata.broker.list"),
    ("compression.type", "compression.codec"),
    ("delivery.timeout.ms", "message.timeout.ms"),
    ("enable.auto.commit", "auto.commit.enable"),
    ("linger.ms", "queue.buffering.max.ms"),
    ("max.in.flight", "max.in.flight.requests.per.connection"),
    ("max.partition.fetch.bytes", "fetch.message.max.bytes"),
    ("retries", "message.send.max.retries"),
    ("sasl.mechanism", "sasl.mechanisms"),
    ("sasl.oauthbearer.client.credentials.client.id", "sasl.oauthbearer.client.id"),
    ("sasl.oauthbearer.client.credentials.client.secret", "sasl.oauthbearer.client.secret"),
];

/// Global properties whose own name starts with `topic.`; librdkafka reads any other `topic.X` as the
/// default topic configuration's `X`.
const TOPIC_NAMED: &[&str] = &[
    "topic.blacklist",
    "topic.metadata.propagation.max.ms",
    "topic.metadata.refresh.fast.cnt",
    "topic.metadata.refresh.fast.interval.ms",
    "topic.metadata.refresh.interval.ms",
    "topic.metadata.refresh.sparse",
];

/// The property librdkafka sets for `name`: without the `topic.` prefix it strips (`topic.acks` is
/// `acks`) and through its aliases (`acks` is `request.required.acks`), lower case. Two names with the same
/// canonical name set the same property, so idem compares and replaces properties by it.
pub fn canonical_property(name: &str) -> String {
    let mut name = name.trim().to_ascii_lowercase();
    while name.starts_with("topic.") && !TOPIC_NAMED.contains(&name.as_str()) {
        name.drain(.."topic.".len());
    }
    match ALIASES.iter().find(|(alias, _)| *alias == name) {
        Some((_, target)) => (*target).to_owned(),
        None => name,
    }
}

/// A property idem refused, or a properties file it could not read. Never holds a property's value.
#[derive(Debug, thiserror::Error)]
pub enum PropertyError {
    /// A protected property (see [`PROTECTED`]).
    #[error("Kafka property `{key}` cannot be set: {why}")]
    Protected {
        /// The property.
        key: String,
        /// Why idem owns it.
        why: &'static str,
    },
    /// A line that is not `key=value`, a comment or blank.
    #[error("line {line} of the Kafka properties is not `key=value`")]
    Malformed {
        /// 1-based line number.
        line: usize,
    },
}

/// Where and how to reach the cluster: bootstrap servers and the deployment's own librdkafka properties
/// (`security.protocol`, `ssl.ca.location`, `sasl.mechanism`, `sasl.username`, `sasl.password`, …),
/// applied to every client idem creates. `Debug` shows the property names, never their values.
#[derive(Clone, Default)]
pub struct KafkaConnection {
    brokers: String,
    properties: Vec<(String, String)>,
}

impl std::fmt::Debug for KafkaConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<&str> = self.properties.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("KafkaConnection").field("brokers", &self.brokers).field("properties", &keys).finish()
    }
}

impl KafkaConnection {
    /// `brokers` (`host:port,…`) with librdkafka's defaults (plaintext, no authentication).
    pub fn new(brokers: &str) -> Self {
        Self { brokers: brokers.to_owned(), properties: Vec::new() }
    }

    /// Adds one librdkafka property (a later value of the same property wins, whatever name it was given
    /// by). Refuses [`PROTECTED`] ones under any of their names: an alias, any case, a `topic.` prefix
    /// ([`canonical_property`]).
    pub fn with_property(mut self, key: &str, value: &str) -> Result<Self, PropertyError> {
        let key = key.trim();
        let canonical = canonical_property(key);
        if let Some((_, why)) = PROTECTED.iter().find(|(k, _)| canonical_property(k) == canonical) {
            return Err(PropertyError::Protected { key: key.to_owned(), why });
        }
        self.properties.retain(|(k, _)| canonical_property(k) != canonical);
        self.properties.push((key.to_owned(), value.to_owned()));
        Ok(self)
    }

    /// Adds the properties of a Java-style properties text, the format of Kafka's and librdkafka's own
    /// tools: `key=value` lines; blank lines and lines starting with `#` or `!` are ignored; spaces around
    /// the key and the value are trimmed.
    pub fn with_properties(mut self, text: &str) -> Result<Self, PropertyError> {
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with('!') {
                continue;
            }
            let (key, value) = line.split_once('=').ok_or(PropertyError::Malformed { line: i + 1 })?;
            if key.trim().is_empty() {
                return Err(PropertyError::Malformed { line: i + 1 });
            }
            self = self.with_property(key, value.trim())?;
        }
        Ok(self)
    }

    /// The deployment's value of a property, under whichever of its names it was given.
    pub fn property(&self, name: &str) -> Option<&str> {
        let canonical = canonical_property(name);
        self.properties.iter().find(|(k, _)| canonical_property(k) == canonical).map(|(_, v)| v.as_str())
    }

    /// The bootstrap servers.
    pub fn brokers(&self) -> &str {
        &self.brokers
    }

    /// The names of the deployment's properties (never their values: some are secrets).
    pub fn property_names(&self) -> impl Iterator<Item = &str> {
        self.properties.iter().map(|(k, _)| k.as_str())
    }

    /// A client configuration with the bootstrap servers and the deployment's properties (for clients
    /// that need nothing else).
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        self.apply(&mut c);
        c
    }

    /// Sets the bootstrap servers and the deployment's properties on `config`, over the client's own
    /// defaults (a deployment may tune `linger.ms`, say; the protected properties cannot be in the list).
    /// A property the client set under another name (`queue.buffering.max.ms` for `linger.ms`) is removed
    /// first: rdkafka's configuration is a map handed to librdkafka in no fixed order, so two names of one
    /// property would make the value that wins differ from one process to the next.
    pub fn apply<'c>(&self, config: &'c mut ClientConfig) -> &'c mut ClientConfig {
        let names: Vec<String> = config.config_map().keys().map(|k| (*k).to_owned()).collect();
        for (k, v) in std::iter::once(("bootstrap.servers", self.brokers.as_str()))
            .chain(self.properties.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        {
            let canonical = canonical_property(k);
            for name in names.iter().filter(|n| canonical_property(n) == canonical) {
                config.remove(name);
            }
            config.set(k, v);
        }
        config
    }
}

impl From<&str> for KafkaConnection {
    fn from(brokers: &str) -> Self {
        Self::new(brokers)
    }
}

impl From<&String> for KafkaConnection {
    fn from(brokers: &String) -> Self {
        Self::new(brokers)
    }
}

impl From<String> for KafkaConnection {
    fn from(brokers: String) -> Self {
        Self { brokers, properties: Vec::new() }
    }
}

impl From<&KafkaConnection> for KafkaConnection {
    fn from(connection: &KafkaConnection) -> Self {
        connection.clone()
    }
}

/// Producer settings. The producer is configured for safety first.
#[derive(Debug, Clone)]
pub struct ProducerSettings {
    /// The cluster and the deployment's properties.
    pub connection: KafkaConnection,
    /// How long a message may take to be acknowledged, retries included, before its delivery fails
    /// (`delivery.timeout.ms`). A failed delivery may still have been written: receivers dedup by event_id.
    pub delivery_timeout: Duration,
    /// `linger.ms`: how long to wait to fill a batch. 1 ms: the relay hands a whole claim to the producer at
    /// once, so its batches are already full; lingering only delays the round. With 5 ms the relay bench's
    /// p99 commit-to-publish at 1,000 msg/s was 40–81 ms, with 1 ms 16–24 ms (BENCHMARKS.md).
    pub linger: Duration,
}

impl ProducerSettings {
    /// The settings idem uses, for `connection` (a [`KafkaConnection`] or bootstrap servers).
    pub fn new(connection: impl Into<KafkaConnection>) -> Self {
        Self {
            connection: connection.into(),
            delivery_timeout: Duration::from_secs(30),
            linger: Duration::from_millis(1),
        }
    }

    /// The librdkafka configuration, every setting with its reason.
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c
            // Idempotent producer: the broker drops retried duplicates within this producer session and
            // keeps per-partition order across retries.
            .set("enable.idempotence", "true")
            // A write counts only once every in-sync replica has it.
            .set("acks", "all")
            // At most 5 in flight per connection: the bound under which idempotence keeps ordering.
            .set("max.in.flight.requests.per.connection", "5")
            // Retry transient errors until the delivery timeout, not a fixed count.
            .set("retries", "2147483647")
            .set("delivery.timeout.ms", self.delivery_timeout.as_millis().to_string())
            .set("request.timeout.ms", "10000")
            .set("linger.ms", self.linger.as_millis().to_string())
            // The Java client's partitioner (murmur2 of the key, random for null keys): a key lands on the
            // same partition whichever client (Java, Go with a murmur2 balancer, librdkafka) produced it.
            .set("partitioner", "murmur2_random")
            .set("compression.type", "lz4")
            .set("message.max.bytes", "1000000");
        self.connection.apply(&mut c);
        c
    }
}

/// Consumer settings.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// The cluster and the deployment's properties.
    pub connection: KafkaConnection,
    /// Consumer group.
    pub group_id: String,
    /// `session.timeout.ms`: how long the group waits for a silent member before rebalancing.
    pub session_timeout: Duration,
    /// `max.poll.interval.ms`: how long the runner may go without polling (a batch retried through a
    /// database outage) before the member leaves the group; it rejoins at its next poll.
    pub max_poll_interval: Duration,
}

impl ConsumerSettings {
    /// The settings idem uses, for `connection` (a [`KafkaConnection`] or bootstrap servers) and
    /// `group_id`.
    pub fn new(connection: impl Into<KafkaConnection>, group_id: &str) -> Self {
        Self {
            connection: connection.into(),
            group_id: group_id.to_owned(),
            session_timeout: Duration::from_secs(10),
            max_poll_interval: Duration::from_secs(300),
        }
    }

    /// The librdkafka configuration (auto commit and offset store off).
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("group.id", &self.group_id)
            // Offsets are committed by the runner only after the database transaction of their messages
            // committed: never automatically, and never stored automatically on delivery to the app.
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // A new group starts from the beginning: no event is skipped.
            .set("auto.offset.reset", "earliest")
            // Skip messages of aborted producer transactions.
            .set("isolation.level", "read_committed")
            .set("session.timeout.ms", self.session_timeout.as_millis().to_string())
            .set("heartbeat.interval.ms", (self.session_timeout.as_millis() / 4).max(100).to_string())
            .set("max.poll.interval.ms", self.max_poll_interval.as_millis().to_string());
        self.connection.apply(&mut c);
        c
    }
}

/// Errors after which the idempotent producer session cannot continue (its producer id or epoch is no
/// longer accepted): a new producer is needed.
pub(crate) fn breaks_session(e: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::error::RDKafkaErrorCode::*;
    matches!(
        e.rdkafka_error_code(),
        Some(ProducerFenced | InvalidProducerEpoch | OutOfOrderSequenceNumber | UnknownProducerId | Fatal)
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn properties_files_are_read_and_protected_properties_refused_without_their_values() {
        let text = "# TLS\nsecurity.protocol = SASL_SSL\n\n! comment\nsasl.password=p=ss word\n";
        let c = KafkaConnection::new("b:9093").with_properties(text).unwrap();
        assert_eq!(c.property_names().collect::<Vec<_>>(), ["security.protocol", "sasl.password"]);
        let config = ProducerSettings::new(&c).client_config();
        assert_eq!(config.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(config.get("sasl.password"), Some("p=ss word"));
        assert_eq!(config.get("bootstrap.servers"), Some("b:9093"));
        assert!(!format!("{c:?}").contains("p=ss"), "{c:?}");
        for key in ["enable.idempotence", "ACKS", "isolation.level", "group.id", "enable.auto.commit", "partitioner"] {
            let e = KafkaConnection::new("b").with_properties(&format!("{key}=secretvalue")).unwrap_err();
            let message = e.to_string();
            assert!(message.contains(&format!("`{key}`")) && !message.contains("secretvalue"), "{message}");
        }
        let e = KafkaConnection::new("b").with_properties("ok=1\nsasl.password secretvalue").unwrap_err();
        assert_eq!(e.to_string(), "line 2 of the Kafka properties is not `key=value`");
    }

    /// Every property librdkafka knows (its CONFIGURATION.md for the pinned version), under its own name,
    /// with a `topic.` prefix and in upper case, with values that would break a guarantee: each is either
    /// refused, or leaves the guarantees as idem set them in the configuration librdkafka itself holds.
    #[test]
    fn the_guarantees_survive_every_allowed_property() {
        let fixture = include_str!("../tests/librdkafka-properties.tsv");
        let pinned = fixture.lines().next().unwrap();
        let (_, version) = rdkafka::util::get_rdkafka_version();
        assert!(pinned.contains(&format!("librdkafka {version}:")), "regenerate the list for {version}: {pinned}");
        let rows: Vec<(&str, &str)> =
            fixture.lines().filter(|l| !l.starts_with('#')).map(|l| l.split_once('\t').unwrap()).collect();
        for (alias, target) in rows.iter().filter(|(_, t)| *t != "-") {
            assert_eq!(canonical_property(alias), *target, "librdkafka's alias {alias} is known");
        }
        let guarantees = [
            "enable.idempotence",
            "acks",
            "max.in.flight",
            "retries",
            "partitioner",
            "enable.auto.commit",
            "enable.auto.offset.store",
            "auto.offset.reset",
            "isolation.level",
            "group.id",
            "queuing.strategy",
            "transactional.id",
        ];
        let native = |c: &KafkaConnection| {
            let configs = [ProducerSettings::new(c).client_config(), ConsumerSettings::new(c, "g").client_config()];
            let natives: Vec<_> = configs.iter().map(ClientConfig::create_native_config).collect();
            natives.into_iter().map(|n| n.ok().map(|n| guarantees.map(|g| n.get(g).ok()))).collect::<Option<Vec<_>>>()
        };
        let base = KafkaConnection::new("b");
        let expected = native(&base).expect("idem's own configuration is valid");
        let values = ["1", "0", "-1", "false", "true", "latest", "random", "lifo", "read_uncommitted", "other"];
        let (mut tried, mut accepted) = (0, 0);
        for (name, _) in &rows {
            for form in [name.to_string(), format!("topic.{name}"), name.to_ascii_uppercase()] {
                for value in values {
                    tried += 1;
                    let Ok(c) = base.clone().with_property(&form, value) else { continue };
                    accepted += 1;
                    // a value librdkafka refuses stops the start; every configuration it takes keeps them
                    if let Some(got) = native(&c) {
                        assert_eq!(got, expected, "{form}={value} changed a guarantee");
                    }
                }
            }
        }
        assert!(accepted > tried / 2 && tried > 5_000, "{accepted} of {tried}");
        for form in ["topic.auto.offset.reset", "topic.partitioner", "topic.acks", "topic.request.required.acks"] {
            assert!(base.clone().with_property(form, "1").is_err(), "{form} is refused");
        }
        let c = KafkaConnection::new("b").with_properties("linger.ms=50\nsecurity.protocol=SSL").unwrap();
        let p = ProducerSettings::new(&c).client_config();
        assert_eq!((p.get("enable.idempotence"), p.get("acks")), (Some("true"), Some("all")));
        assert_eq!(p.get("linger.ms"), Some("50"), "a tunable property is the deployment's");
        let tuned = KafkaConnection::new("b").with_property("queue.buffering.max.ms", "70").unwrap();
        let p = ProducerSettings::new(&tuned).client_config();
        assert_eq!((p.get("linger.ms"), p.get("queue.buffering.max.ms")), (None, Some("70")), "one name per property");
        assert_eq!(p.create_native_config().unwrap().get("linger.ms").unwrap(), "70");
        let consumer = ConsumerSettings::new(&c, "g").client_config();
        assert_eq!(consumer.get("enable.auto.commit"), Some("false"));
        assert_eq!(consumer.get("security.protocol"), Some("SSL"));
    }
}

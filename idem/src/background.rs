//! Everything a service runs beside its requests, started in one call.

use std::time::Duration;

use idem_kafka::KafkaConnection;
use idem_kafka::admin::{Replication, ensure_topics_when_reachable};
use idem_kafka::consumer::Runner;
use idem_kafka::relay::Relay;
use idem_ports::SystemClock;
use idem_postgres::cleanup::Cleaner;
use idem_postgres::{PgOutboxWakeup, PgStore};
use tokio_util::sync::CancellationToken;

use crate::TaskGroup;

/// The background work of a service on idem, configured piece by piece and started by [`Background::start`]
/// as named tasks of one [`TaskGroup`] under one shutdown token:
///
/// - the outbox [`Relay`], woken by commits (in process, and across instances by `LISTEN` on the store's
///   connection) and polling as a fallback, with the outbox vacuum it needs (every 5 s by default; see
///   `PgStore::vacuum_outbox`);
/// - the [`Cleaner`] of expired idempotency records and processed events, every `interval`;
/// - the topics the consumers read (and their dead-letter topics), created when missing, retried in the
///   background while the broker is unreachable; the consumers start once they exist;
/// - the consumer [`Runner`]s.
///
/// Build the relay, cleaner and runners first to register their statistics (`stats()`) where you export
/// metrics.
#[must_use = "nothing runs until `start`"]
pub struct Background {
    store: PgStore,
    cluster: KafkaConnection,
    shutdown: CancellationToken,
    relay: Option<Relay>,
    vacuum_every: Duration,
    cleaner: Option<(Cleaner, Duration)>,
    topics: Vec<String>,
    partitions: i32,
    replication: Replication,
    consumers: Vec<Runner>,
}

impl std::fmt::Debug for Background {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Background")
            .field("relay", &self.relay.is_some())
            .field("cleaner", &self.cleaner.is_some())
            .field("topics", &self.topics)
            .field("consumers", &self.consumers.len())
            .finish_non_exhaustive()
    }
}

impl Background {
    /// Background work on `store` and the Kafka cluster `cluster`, with a shutdown token of its own.
    pub fn new(store: PgStore, cluster: impl Into<KafkaConnection>) -> Self {
        Self {
            store,
            cluster: cluster.into(),
            shutdown: CancellationToken::new(),
            relay: None,
            vacuum_every: Duration::from_secs(5),
            cleaner: None,
            topics: Vec::new(),
            partitions: 6,
            replication: Replication::Auto,
            consumers: Vec::new(),
        }
    }

    /// Stops everything when `token` is cancelled (share it with the HTTP server and the signal handler).
    pub fn shutdown_token(mut self, token: CancellationToken) -> Self {
        self.shutdown = token;
        self
    }

    /// Runs the outbox relay, its wake-ups and the outbox vacuum.
    pub fn relay(mut self, relay: Relay) -> Self {
        self.relay = Some(relay);
        self
    }

    /// How often the outbox is vacuumed while the relay runs (default 5 s).
    pub fn outbox_vacuum_every(mut self, every: Duration) -> Self {
        self.vacuum_every = every;
        self
    }

    /// Runs `cleaner` every `interval`.
    pub fn cleaner(mut self, cleaner: Cleaner, interval: Duration) -> Self {
        self.cleaner = Some((cleaner, interval));
        self
    }

    /// Creates `topics` when missing (with `partitions` and `replication`) before any consumer starts.
    pub fn topics(mut self, topics: &[&str], partitions: i32, replication: Replication) -> Self {
        self.topics = topics.iter().map(|t| (*t).to_owned()).collect();
        self.partitions = partitions;
        self.replication = replication;
        self
    }

    /// Runs a consumer (after the topics exist).
    pub fn consumer(mut self, runner: Runner) -> Self {
        self.consumers.push(runner);
        self
    }

    /// Starts everything; returns the task group, to which the caller may add its own tasks (the HTTP
    /// server) before [`TaskGroup::wait`]. Fails only when the relay's `LISTEN` connection cannot be opened.
    pub async fn start(self) -> Result<TaskGroup, idem_ports::StoreError> {
        let mut group = TaskGroup::new(self.shutdown.clone());
        if let Some(relay) = self.relay {
            let wakeup = PgOutboxWakeup::connect(&self.store).await?;
            let token = group.token();
            group.spawn("outbox relay", async move { Ok(relay.run(Box::new(wakeup), token).await?) });
            let (store, every, token) = (self.store.clone(), self.vacuum_every, group.token());
            group.spawn("outbox vacuum", async move {
                // a failure is logged and retried at the next tick, never ends the service
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = token.cancelled() => return Ok(()),
                        _ = tick.tick() => {}
                    }
                    if let Err(e) = store.vacuum_outbox().await {
                        tracing::warn!(error = %e, "outbox vacuum failed; retrying at the next interval");
                    }
                }
            });
        }
        if let Some((cleaner, interval)) = self.cleaner {
            let token = group.token();
            group.spawn("ttl cleaner", async move {
                cleaner.run(&SystemClock, interval, token).await;
                Ok(())
            });
        }
        if !self.consumers.is_empty() || !self.topics.is_empty() {
            let (cluster, topics, partitions, replication) =
                (self.cluster, self.topics, self.partitions, self.replication);
            let (consumers, token) = (self.consumers, group.token());
            // Kafka may be down at start: topics are created in the background, the consumers start once
            // they exist; requests are served meanwhile (payments wait in the outbox)
            group.spawn("consumers", async move {
                let names: Vec<&str> = topics.iter().map(String::as_str).collect();
                if !names.is_empty()
                    && !ensure_topics_when_reachable(&cluster, &names, partitions, replication, &token).await
                {
                    return Ok(());
                }
                let runs = consumers.into_iter().map(|runner| runner.run(token.clone()));
                for result in futures::future::join_all(runs).await {
                    result?;
                }
                Ok(())
            });
        }
        Ok(group)
    }
}

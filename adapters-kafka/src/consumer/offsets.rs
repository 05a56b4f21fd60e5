//! Assignment tracking and committable positions: what the rebalance callbacks and the runner commit.

use std::collections::{HashMap, HashSet};

use prometheus_client::metrics::gauge::Gauge;
use rdkafka::consumer::{CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use super::Received;

/// Tracks the assignment and the committable positions. Offsets are only ever recorded after their
/// transaction committed and auto-commit is off, so a revocation can never commit the offset of an
/// uncommitted message.
pub(super) struct RunnerContext {
    pub(super) lag: Gauge,
    pub(super) offsets: Offsets,
}

impl ClientContext for RunnerContext {
    fn stats(&self, statistics: rdkafka::Statistics) {
        let lag: i64 = statistics
            .topics
            .values()
            .flat_map(|t| t.partitions.values())
            .filter(|p| p.partition >= 0 && p.consumer_lag >= 0)
            .map(|p| p.consumer_lag)
            .sum();
        self.lag.set(lag);
    }
}

fn partitions(tpl: &TopicPartitionList) -> Vec<(String, i32)> {
    tpl.elements().iter().map(|e| (e.topic().to_owned(), e.partition())).collect()
}

impl ConsumerContext for RunnerContext {
    fn pre_rebalance(&self, consumer: &rdkafka::consumer::BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                // Commit what committed for the partitions leaving, then forget them: their next owner
                // moves them on, and a position of ours committed later would push it back.
                let revoked = partitions(tpl);
                let leaving = self.offsets.release(&revoked);
                if leaving.count() > 0
                    && let Err(e) = consumer.commit(&leaving, CommitMode::Sync)
                {
                    tracing::warn!(error = %e, "offset commit on revocation failed; the next owner re-reads and dedups");
                }
                tracing::info!(partitions = tpl.count(), "partitions revoked")
            }
            Rebalance::Assign(tpl) => {
                self.offsets.assign(&partitions(tpl));
                tracing::info!(partitions = tpl.count(), "partitions assigned")
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
        }
    }
}

/// Per assigned partition, the offset after the last message whose transaction committed. Only partitions
/// currently assigned are recorded and committed: a member never commits a position for a partition
/// another member owns (Kafka's classic group protocol accepts such a commit from any current member, and
/// it would move the owner's committed offset backwards).
#[derive(Default)]
pub(super) struct Offsets(std::sync::Mutex<OffsetsInner>);

#[derive(Default)]
struct OffsetsInner {
    assigned: HashSet<(String, i32)>,
    done: HashMap<(String, i32), i64>,
}

impl Offsets {
    fn lock(&self) -> std::sync::MutexGuard<'_, OffsetsInner> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn assign(&self, partitions: &[(String, i32)]) {
        let mut inner = self.lock();
        for p in partitions {
            inner.done.remove(p); // a position from an earlier ownership is stale
            inner.assigned.insert(p.clone());
        }
    }

    /// Forgets `partitions`; returns their last committable positions.
    pub(super) fn release(&self, partitions: &[(String, i32)]) -> TopicPartitionList {
        let mut inner = self.lock();
        let mut tpl = TopicPartitionList::new();
        for p in partitions {
            inner.assigned.remove(p);
            if let Some(offset) = inner.done.remove(p)
                && let Err(e) = tpl.add_partition_offset(&p.0, p.1, Offset::Offset(offset))
            {
                tracing::warn!(error = %e, "bad offset");
            }
        }
        tpl
    }

    pub(super) fn advance(&self, batch: &[Received]) {
        let mut inner = self.lock();
        for m in batch {
            let key = (m.topic.clone(), m.partition);
            if !inner.assigned.contains(&key) {
                continue; // revoked while the batch ran: its new owner re-reads and dedups
            }
            let e = inner.done.entry(key).or_insert(m.offset + 1);
            *e = (*e).max(m.offset + 1);
        }
    }

    pub(super) fn commit(&self, consumer: &StreamConsumer<RunnerContext>, mode: CommitMode) {
        let tpl = {
            let inner = self.lock();
            let mut tpl = TopicPartitionList::new();
            for ((topic, partition), offset) in &inner.done {
                if inner.assigned.contains(&(topic.clone(), *partition))
                    && let Err(e) = tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset))
                {
                    tracing::warn!(error = %e, "bad offset");
                }
            }
            tpl
        };
        if tpl.count() == 0 {
            return;
        }
        if let Err(e) = consumer.commit(&tpl, mode) {
            // Typically a rebalance under way: the partition's owner resumes from the last commit and
            // dedups what it sees again.
            tracing::warn!(error = %e, "offset commit failed");
        }
    }
}

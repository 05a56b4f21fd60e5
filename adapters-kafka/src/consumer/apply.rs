//! Applying a batch: one unit of work that records the events' processed rows and runs the handler on the
//! new ones, bounded by `transaction_timeout`; event by event to isolate a failure; late admissions.

use super::*;

/// What records an event as applied, in the transaction that applies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dedup {
    /// `record_new` in the processed-event table (every event inside the dedup window).
    Window,
    /// The operator's admission of an event older than the window: the admission is marked applied and
    /// the processed row recorded, and the event applied only when both were new.
    LateAdmission,
}

/// How a batch's transaction ended.
pub(super) enum BatchOutcome {
    Committed,
    /// An event failed for good or for now; `index` into the batch.
    EventFailed {
        index: usize,
        error: HandlerError,
    },
    Transient(StoreError),
}

impl Runner {
    /// One unit of work per event, in order; committed events leave `events`. On a failure, `index` 0 is
    /// the failing event (the first one left).
    pub(super) async fn apply_one_by_one(&self, events: &mut Vec<(&Received, InboundEvent)>) -> BatchOutcome {
        while let Some((_, event)) = events.first() {
            match self.apply(&[event], Dedup::Window).await {
                BatchOutcome::Committed => {
                    events.remove(0);
                }
                BatchOutcome::EventFailed { error, .. } => return BatchOutcome::EventFailed { index: 0, error },
                transient @ BatchOutcome::Transient(_) => return transient,
            }
        }
        BatchOutcome::Committed
    }

    /// The ids among `too_old` an operator admitted late; `None` on shutdown.
    pub(super) async fn late_admitted(
        &self,
        too_old: &[(&Received, InboundEvent, chrono::DateTime<chrono::Utc>)],
        shutdown: &CancellationToken,
    ) -> Option<HashSet<Uuid>> {
        if too_old.is_empty() {
            return Some(HashSet::new());
        }
        let ids: Vec<Uuid> = too_old.iter().map(|(_, e, _)| e.event_id).collect();
        let mut backoff = Backoff::new();
        loop {
            let found = async {
                let mut uow = self.tm.begin().await?;
                uow.processed_events().late_admitted(&self.settings.consumer.group_id, &ids).await
            };
            match found.await {
                Ok(admitted) => return Some(admitted.into_iter().collect()),
                Err(e) => {
                    self.stats.transient_failures.inc_by(1);
                    tracing::warn!(error = %e, "reading late admissions failed; retrying");
                    if !backoff.wait(shutdown).await {
                        return None;
                    }
                }
            }
        }
    }

    /// One unit of work over the batch. `dedup` says what records the events as applied.
    /// [`Self::apply_unbounded`] within `transaction_timeout`.
    pub(super) async fn apply(&self, events: &[&InboundEvent], dedup: Dedup) -> BatchOutcome {
        let limit = self.settings.transaction_timeout;
        match tokio::time::timeout(limit, self.apply_unbounded(events, dedup)).await {
            Ok(outcome) => outcome,
            Err(_) => BatchOutcome::Transient(StoreError::Unavailable(format!(
                "the batch's transaction did not end within {} s: abandoned (rolled back unless its commit was \
                 under way) and retried",
                limit.as_secs()
            ))),
        }
    }

    async fn apply_unbounded(&self, events: &[&InboundEvent], dedup: Dedup) -> BatchOutcome {
        // Store failures outside the handler are never blamed on an event: retried, never dead-lettered.
        let failed = |e: StoreError| {
            if !e.is_transient() {
                tracing::error!(error = %e, "processed-event bookkeeping failed");
            }
            BatchOutcome::Transient(e)
        };
        if events.is_empty() {
            return BatchOutcome::Committed;
        }
        let mut uow = match self.tm.begin().await {
            Ok(u) => u,
            Err(e) => return BatchOutcome::Transient(e),
        };
        let now = self.clock.now();
        let ttl = self.settings.dedup_ttl;
        let rows: Vec<ProcessedEvent> = events
            .iter()
            .map(|e| ProcessedEvent {
                event_id: e.event_id,
                topic: e.topic.clone(),
                expires_at: ttl.retain_until(now, idem_domain::uuid_v7_time(e.event_id)),
            })
            .collect();
        let consumer = &self.settings.consumer.group_id;
        // Every application records the event's processed row, late admissions too: the row of an
        // earlier application may still be alive (a duplicate refused a minute after the first delivery
        // crossed the floor), and then the admitted copy is a duplicate.
        let mut fresh: HashSet<Uuid> = match uow.processed_events().record_new(consumer, &rows, now).await {
            Ok(ids) => ids.into_iter().collect(),
            Err(e) => return failed(e),
        };
        if dedup == Dedup::LateAdmission {
            // ... and the admission is consumed in the same transaction: applied only when both are new.
            for row in &rows {
                match uow.processed_events().apply_late_admission(consumer, row.event_id, now).await {
                    Ok(true) => {}
                    Ok(false) => {
                        fresh.remove(&row.event_id);
                    }
                    Err(e) => return failed(e),
                }
            }
        }
        // First occurrence of each new event id, in partition order.
        let mut applied = HashSet::with_capacity(fresh.len());
        let mut to_apply: Vec<(usize, &InboundEvent)> = Vec::with_capacity(fresh.len());
        for (index, event) in events.iter().enumerate() {
            if fresh.contains(&event.event_id) && applied.insert(event.event_id) {
                to_apply.push((index, event));
            }
        }
        let duplicates = (events.len() - to_apply.len()) as u64;
        let batch: Vec<&InboundEvent> = to_apply.iter().map(|(_, e)| *e).collect();
        let span = crate::trace::consumer_span(consumer, &self.settings.topic, &batch);
        match tracing::Instrument::instrument(self.handler.handle_batch(uow.as_mut(), &batch), span).await {
            Ok(()) => {}
            Err(BatchError { error: HandlerError::Store(e), .. }) if e.is_transient() => {
                return BatchOutcome::Transient(e);
            }
            Err(BatchError { index, error }) => {
                let index = to_apply.get(index).map_or(0, |(i, _)| *i);
                return BatchOutcome::EventFailed { index, error };
            }
        }
        // a duplicate's offset is committed on the strength of its processed row, which a cancelled
        // commit wait can leave visible on the primary and on no standby: this commit waits for one
        if duplicates > 0
            && let Err(e) = uow.confirm_replication().await
        {
            return failed(e);
        }
        match uow.commit().await {
            Ok(()) => {
                self.stats.processed.inc_by(applied.len() as u64);
                self.stats.duplicates.inc_by(duplicates);
                BatchOutcome::Committed
            }
            Err(e) if e.is_transient() => BatchOutcome::Transient(e),
            // A commit refused for what the handlers did (a failed statement whose error a handler
            // swallowed, a deferred constraint): theirs, like a failure they returned, so it is isolated to
            // its event, counted, and dead-lettered after `max_rejections` instead of stalling the partition.
            Err(e) => match to_apply.first() {
                Some((index, _)) => {
                    tracing::warn!(error = %e, "the handlers' transaction could not commit");
                    BatchOutcome::EventFailed { index: *index, error: HandlerError::Store(e) }
                }
                None => failed(e),
            },
        }
    }
}

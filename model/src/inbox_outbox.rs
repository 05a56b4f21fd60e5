//! The Kafka consumer (inbox) and the outbox relay as one state machine.
//!
//! One partition of the input topic holds events, one of them delivered again (same `event_id`). The
//! members of a consumer group take turns owning it: a rebalance between batches, or an eviction of a
//! member in the middle of a batch (session or `max.poll.interval.ms` timeout) that leaves it running as a
//! zombie. Members and the relay may crash; time may pass an event's dedup window (its processed-event row
//! is then dropped with its partition). Outbox rows are published by a relay that may crash between
//! publishing and marking. Receivers of the output deduplicate by `event_id`.
//!
//! | action | implemented by (`adapters-kafka/src/consumer.rs` unless said) |
//! | --- | --- |
//! | [`Action::Poll`] | `Runner::next_batch` (`recv`) |
//! | [`Action::Process`] | `Runner::process` → `Runner::apply`: `record_new` + handler + `enqueue` + commit, one transaction; the admission floor (`TtlPolicy::admission_floor`) dead-letters events older than the dedup window |
//! | [`Action::CommitOffsets`] | `Offsets::advance` + `Offsets::commit` (owned partitions only) |
//! | [`Action::Rebalance`] | `RunnerContext::pre_rebalance`: `Offsets::release` commits and forgets on revoke, `Offsets::assign` on assign |
//! | [`Action::Evict`] | the coordinator removing a member that stopped polling; its later commits are refused (Kafka's generation check) |
//! | [`Action::Rejoin`] | the evicted member polling again: its partitions were lost (`Offsets::release`) |
//! | [`Action::CommitOtherPartitions`] | `Offsets::commit` run for a batch of another partition |
//! | [`Action::Crash`] | the process dies; it restarts from the committed offset |
//! | [`Action::PassDedupWindow`] | time passes `DEDUP_TTL`: the cleaner drops the event's processed row (`cleanup.rs`) |
//! | [`Action::Claim`], [`Action::Publish`], [`Action::Mark`] | `Relay::round` (`relay.rs`): `claim_unpublished`, send + delivery report, `delete_published` + commit |
//! | [`Action::RelayCrash`] | the relay's process dies: its transaction rolls back |

use std::collections::BTreeSet;

use stateright::{Model, Property};

/// An input event id.
pub type EventId = u8;
/// An output message's `event_id` (the outbox row id).
pub type OutputId = u8;

/// The protocol checked, or a deliberately broken variant of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KafkaVariant {
    /// idem's protocol.
    Idem,
    /// Offsets committed before the database transaction (ack first, then process).
    OffsetsBeforeDbCommit,
    /// Positions of revoked partitions kept and committed later (the stale-offset defect).
    StaleOffsetsAfterRebalance,
    /// No admission floor: an event older than the dedup window is applied without dedup protection.
    NoAdmissionFloor,
    /// The relay marks rows published before the broker acknowledged them.
    MarkBeforeDeliveryReport,
    /// The relay gives a message a new `event_id` on each publish instead of the row's id.
    EventIdAtPublish,
}

#[derive(Clone, Debug)]
/// The model: the input log, the members, the variant, the fault budget.
pub struct InboxOutbox {
    /// The partition's events, by offset.
    pub log: Vec<EventId>,
    /// Consumer group members.
    pub members: u8,
    /// The protocol or a broken variant.
    pub variant: KafkaVariant,
    /// Crashes, evictions, rebalances, relay crashes and passed windows, in total.
    pub faults: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
/// Where a member's batch is.
pub enum MemberPhase {
    /// Between batches.
    Idle,
    /// Read the message at this offset.
    Polled(u8),
    /// Its transaction for this offset committed; the offset is not yet committed.
    Processed(u8),
    /// Variant [`KafkaVariant::OffsetsBeforeDbCommit`]: offset committed, transaction not yet run.
    Acked(u8),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
/// One group member.
pub struct Member {
    /// Its batch.
    pub phase: MemberPhase,
    /// Next offset to read (meaningful while it owns the partition).
    pub position: u8,
    /// The committable position it holds for the partition (`Offsets::done`).
    pub done: Option<u8>,
    /// Removed from the group by the coordinator; its commits are refused until it rejoins.
    pub evicted: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
/// An outbox row.
pub struct Row {
    /// The input event it announces.
    pub event: EventId,
    /// Its `event_id`.
    pub id: OutputId,
    /// Marked published.
    pub published: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
/// Where the relay's round is.
pub enum RelayPhase {
    /// Between rounds.
    Idle,
    /// Claimed this row.
    Claimed(u8),
    /// Published this row, not marked yet.
    Published(u8),
    /// Variant [`KafkaVariant::MarkBeforeDeliveryReport`]: marked and committed, not yet sent.
    Marked(u8),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
/// The whole system.
pub struct KafkaState {
    /// Which member owns the partition.
    pub owner: Option<u8>,
    /// The members.
    pub members: Vec<Member>,
    /// The group's committed offset.
    pub committed: u8,
    /// Set when a commit moved the offset back.
    pub offset_regressed: bool,
    /// `processed_event` rows.
    pub processed: BTreeSet<EventId>,
    /// Events older than the dedup window.
    pub aged: BTreeSet<EventId>,
    /// State changes, one entry per application of an event.
    pub changes: Vec<EventId>,
    /// Events dead-lettered.
    pub dead_letters: BTreeSet<EventId>,
    /// Outbox rows.
    pub outbox: Vec<Row>,
    /// Next outbox id.
    pub next_id: OutputId,
    /// The relay.
    pub relay: RelayPhase,
    /// Output messages on the topic: (input event, event_id).
    pub output: BTreeSet<(EventId, OutputId)>,
    /// Faults left.
    pub faults: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
/// The steps.
pub enum Action {
    /// `Runner::next_batch` of a member.
    Poll(u8),
    /// `Runner::process` (one transaction).
    Process(u8),
    /// `Offsets::advance` + `Offsets::commit`.
    CommitOffsets(u8),
    /// A cooperative rebalance to this member.
    Rebalance(u8),
    /// The coordinator evicts this member mid-batch.
    Evict(u8),
    /// The evicted member polls again.
    Rejoin(u8),
    /// `Offsets::commit` for another partition's batch.
    CommitOtherPartitions(u8),
    /// The member's process dies.
    Crash(u8),
    /// Time passes the event's dedup window.
    PassDedupWindow(EventId),
    /// `claim_unpublished`.
    Claim,
    /// Send and wait for the delivery report.
    Publish,
    /// `delete_published` + commit (the model's "mark": the row leaves the set to publish).
    Mark,
    /// The relay's process dies.
    RelayCrash,
}

impl InboxOutbox {
    /// Two events, the first delivered three times (once after the second); three members; five faults.
    pub fn standard(variant: KafkaVariant) -> Self {
        Self { log: vec![0, 0, 1, 0], members: 3, variant, faults: 5 }
    }

    fn events(&self) -> BTreeSet<EventId> {
        self.log.iter().copied().collect()
    }

    /// The database transaction of one event: dedup row, state change, outbox row — or a dead letter.
    fn process(&self, s: &mut KafkaState, offset: u8) {
        let event = self.log[offset as usize];
        let floor = self.variant != KafkaVariant::NoAdmissionFloor;
        if floor && s.aged.contains(&event) {
            s.dead_letters.insert(event); // older-than-dedup-window
        } else if s.processed.insert(event) {
            s.changes.push(event);
            let id = s.next_id;
            s.next_id += 1;
            s.outbox.push(Row { event, id, published: false });
        }
    }

    fn commit_offset(s: &mut KafkaState, to: u8) {
        if to < s.committed {
            s.offset_regressed = true;
        }
        s.committed = to;
    }
}

impl Model for InboxOutbox {
    type State = KafkaState;
    type Action = Action;

    fn init_states(&self) -> Vec<KafkaState> {
        let member = Member { phase: MemberPhase::Idle, position: 0, done: None, evicted: false };
        vec![KafkaState {
            owner: Some(0),
            members: vec![member; self.members as usize],
            committed: 0,
            offset_regressed: false,
            processed: BTreeSet::new(),
            aged: BTreeSet::new(),
            changes: Vec::new(),
            dead_letters: BTreeSet::new(),
            outbox: Vec::new(),
            next_id: 0,
            relay: RelayPhase::Idle,
            output: BTreeSet::new(),
            faults: self.faults,
        }]
    }

    fn actions(&self, s: &KafkaState, actions: &mut Vec<Action>) {
        let fault = s.faults > 0;
        for (i, m) in s.members.iter().enumerate() {
            let i = i as u8;
            let owns = s.owner == Some(i);
            match m.phase {
                MemberPhase::Idle if owns && !m.evicted && (m.position as usize) < self.log.len() => {
                    actions.push(Action::Poll(i));
                }
                MemberPhase::Polled(_) if self.variant == KafkaVariant::OffsetsBeforeDbCommit => {
                    actions.push(Action::CommitOffsets(i));
                }
                MemberPhase::Polled(_) | MemberPhase::Acked(_) => actions.push(Action::Process(i)),
                MemberPhase::Processed(_) => actions.push(Action::CommitOffsets(i)),
                MemberPhase::Idle => {}
            }
            if m.phase == MemberPhase::Idle && m.evicted {
                actions.push(Action::Rejoin(i));
            }
            if !owns && !m.evicted && m.done.is_some() {
                actions.push(Action::CommitOtherPartitions(i));
            }
            if fault {
                actions.push(Action::Crash(i));
                if owns && m.phase != MemberPhase::Idle {
                    actions.push(Action::Evict(i));
                }
                // a cooperative rebalance happens while the members poll, between batches
                let current_idle = s.owner.is_none_or(|o| s.members[o as usize].phase == MemberPhase::Idle);
                if !owns && !m.evicted && m.phase == MemberPhase::Idle && current_idle {
                    actions.push(Action::Rebalance(i));
                }
            }
        }
        if fault {
            for e in self.events() {
                if !s.aged.contains(&e) {
                    actions.push(Action::PassDedupWindow(e));
                }
            }
        }
        match s.relay {
            RelayPhase::Idle if s.outbox.iter().any(|r| !r.published) => actions.push(Action::Claim),
            RelayPhase::Claimed(_) if self.variant == KafkaVariant::MarkBeforeDeliveryReport => {
                actions.push(Action::Mark)
            }
            RelayPhase::Claimed(_) | RelayPhase::Marked(_) => actions.push(Action::Publish),
            RelayPhase::Published(_) => actions.push(Action::Mark),
            RelayPhase::Idle => {}
        }
        if fault && s.relay != RelayPhase::Idle {
            actions.push(Action::RelayCrash);
        }
    }

    fn next_state(&self, last: &KafkaState, action: Action) -> Option<KafkaState> {
        let mut s = last.clone();
        let prune = self.variant != KafkaVariant::StaleOffsetsAfterRebalance;
        match action {
            Action::Poll(i) => {
                let m = &mut s.members[i as usize];
                m.phase = MemberPhase::Polled(m.position);
            }
            Action::Process(i) => {
                let (MemberPhase::Polled(o) | MemberPhase::Acked(o)) = s.members[i as usize].phase else {
                    return None;
                };
                self.process(&mut s, o);
                let m = &mut s.members[i as usize];
                m.phase = if m.phase == MemberPhase::Acked(o) { MemberPhase::Idle } else { MemberPhase::Processed(o) };
            }
            Action::CommitOffsets(i) => {
                let (MemberPhase::Processed(o) | MemberPhase::Polled(o)) = s.members[i as usize].phase else {
                    return None;
                };
                let owns = s.owner == Some(i);
                let m = &mut s.members[i as usize];
                let acked_first = m.phase == MemberPhase::Polled(o);
                m.phase = if acked_first { MemberPhase::Acked(o) } else { MemberPhase::Idle };
                m.position = o + 1;
                if owns || !prune {
                    m.done = Some(o + 1); // Offsets::advance skips partitions no longer assigned
                }
                if !m.evicted
                    && (owns || !prune)
                    && let Some(to) = m.done
                {
                    Self::commit_offset(&mut s, to);
                }
            }
            Action::Rebalance(to) => {
                s.faults -= 1;
                if let Some(from) = s.owner {
                    let old = &mut s.members[from as usize];
                    let leaving = if prune { old.done.take() } else { old.done };
                    if let Some(p) = leaving.filter(|_| !old.evicted) {
                        Self::commit_offset(&mut s, p);
                    }
                }
                s.owner = Some(to);
                let new = &mut s.members[to as usize];
                new.done = None; // Offsets::assign: a position from an earlier ownership is stale
                new.position = s.committed;
            }
            Action::Evict(i) => {
                s.faults -= 1;
                s.owner = None;
                s.members[i as usize].evicted = true;
            }
            Action::Rejoin(i) => {
                let m = &mut s.members[i as usize];
                m.evicted = false;
                if prune {
                    m.done = None;
                }
            }
            Action::CommitOtherPartitions(i) => {
                // Offsets::commit sends only assigned partitions; the broken variant sends every position
                if !prune && let Some(p) = s.members[i as usize].done {
                    Self::commit_offset(&mut s, p);
                }
                if prune {
                    return None;
                }
            }
            Action::Crash(i) => {
                s.faults -= 1;
                let committed = s.committed;
                let m = &mut s.members[i as usize];
                *m = Member { phase: MemberPhase::Idle, position: committed, done: None, evicted: false };
            }
            Action::PassDedupWindow(e) => {
                s.faults -= 1;
                s.aged.insert(e);
                s.processed.remove(&e);
            }
            Action::Claim => {
                let row = s.outbox.iter().position(|r| !r.published)? as u8;
                s.relay = RelayPhase::Claimed(row);
            }
            Action::Publish => {
                let (RelayPhase::Claimed(r) | RelayPhase::Marked(r)) = s.relay else { return None };
                let row = &s.outbox[r as usize];
                let id = if self.variant == KafkaVariant::EventIdAtPublish {
                    let id = s.next_id;
                    s.next_id += 1;
                    id
                } else {
                    row.id
                };
                s.output.insert((row.event, id));
                s.relay =
                    if matches!(s.relay, RelayPhase::Marked(_)) { RelayPhase::Idle } else { RelayPhase::Published(r) };
            }
            Action::Mark => {
                let (RelayPhase::Published(r) | RelayPhase::Claimed(r)) = s.relay else { return None };
                s.outbox[r as usize].published = true;
                s.relay =
                    if matches!(s.relay, RelayPhase::Claimed(_)) { RelayPhase::Marked(r) } else { RelayPhase::Idle };
            }
            Action::RelayCrash => {
                s.faults -= 1;
                s.relay = RelayPhase::Idle;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(AT_MOST_ONE_STATE_CHANGE, |m: &InboxOutbox, s: &KafkaState| {
                m.events().iter().all(|e| s.changes.iter().filter(|c| *c == e).count() <= 1)
            }),
            Property::always(AT_MOST_ONE_OUTPUT, |m: &InboxOutbox, s: &KafkaState| {
                m.events().iter().all(|e| s.output.iter().filter(|(x, _)| x == e).count() <= 1)
            }),
            Property::always(CONSISTENT_STATE_AND_OUTPUT, |m: &InboxOutbox, s: &KafkaState| {
                // an acknowledged event (every copy below the committed offset) was applied or dead-lettered
                let acked_applied = m.events().iter().all(|e| {
                    let last = m.log.iter().rposition(|x| x == e).unwrap_or(0) as u8;
                    last >= s.committed || s.changes.contains(e) || s.dead_letters.contains(e)
                });
                // every state change's output is on the topic or still waits in the outbox
                let output_not_lost =
                    s.outbox.iter().all(|r| !r.published || s.output.iter().any(|(e, _)| *e == r.event));
                // every output belongs to a state change
                let no_ghost = s.output.iter().all(|(e, _)| s.changes.contains(e));
                acked_applied && output_not_lost && no_ghost
            }),
            Property::always(OFFSETS_NEVER_REGRESS, |_, s: &KafkaState| !s.offset_regressed),
            Property::sometimes("every delivery consumed, duplicates absorbed", |m: &InboxOutbox, s: &KafkaState| {
                s.committed as usize == m.log.len() && s.changes.len() == 2
            }),
            Property::sometimes("an event past the dedup window is dead-lettered", |_, s: &KafkaState| {
                !s.dead_letters.is_empty()
            }),
            Property::sometimes("a zombie member processes after its eviction", |_, s: &KafkaState| {
                s.members.iter().any(|m| m.evicted && m.phase != MemberPhase::Idle) && s.owner.is_some()
            }),
        ]
    }
}

/// Each input event changes the state at most once.
pub const AT_MOST_ONE_STATE_CHANGE: &str = "at most one state change per event";
/// After receivers dedup by `event_id`, each input event produced at most one output message.
pub const AT_MOST_ONE_OUTPUT: &str = "at most one output per event after dedup by event_id";
/// Acknowledged input was applied (or dead-lettered), published output is on the topic, no ghost output.
pub const CONSISTENT_STATE_AND_OUTPUT: &str = "state and output consistent";
/// The group's committed offset never moves backwards.
pub const OFFSETS_NEVER_REGRESS: &str = "committed offsets never move backwards";

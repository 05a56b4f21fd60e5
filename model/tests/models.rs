//! Exhaustive checks: every invariant holds on idem's protocol and fails on a broken variant.

#![allow(clippy::print_stdout)]

use idem_model::dedup_window::{self, DedupWindow, WindowVariant};
use idem_model::http_claim::{self, ClaimProtocol, HttpVariant};
use idem_model::inbox_outbox::{self, InboxOutbox, KafkaVariant};
use idem_model::key_window::{self, KeyVariant, KeyWindow};
use idem_model::phases::{self, PhaseModel, PhaseVariant};
use std::collections::BTreeSet;

use stateright::{Checker, HasDiscoveries, Model};

fn check<M>(model: M) -> impl Checker<M>
where
    M: Model + Send + Sync + 'static,
    M::State: std::fmt::Debug + std::hash::Hash + Clone + PartialEq + Send + Sync + 'static,
    M::Action: std::fmt::Debug + Clone + PartialEq + Send + Sync + 'static,
{
    let checker = model.checker().threads(2).spawn_bfs().join();
    println!("{} states", checker.unique_state_count());
    checker
}

/// Some reachable state of `model` violates the invariant `name`: explores until the first one and prints
/// its trace (breadth first, so a shortest one, up to thread interleaving).
fn violated<M>(model: M, name: &'static str)
where
    M: Model + Send + Sync + 'static,
    M::State: std::fmt::Debug + std::hash::Hash + Clone + PartialEq + Send + Sync + 'static,
    M::Action: std::fmt::Debug + Clone + PartialEq + Send + Sync + 'static,
{
    let checker =
        model.checker().threads(2).finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name]))).spawn_bfs().join();
    let path = checker.assert_any_discovery(name);
    println!("{name}: violated after {:?}", path.into_actions());
}

#[test]
fn the_claim_protocol_keeps_every_invariant() {
    let checker = check(ClaimProtocol::standard(HttpVariant::Idem));
    assert!(checker.is_done(), "the state space was explored completely");
    // the "sometimes" properties prove the model reaches replays, re-execution after expiry and retries
    checker.assert_properties();
}

#[test]
fn the_seed_middleware_shape_breaks_the_claim_invariants() {
    for invariant in [http_claim::AT_MOST_ONE_EFFECT, http_claim::REPLAY_EQUALS_FIRST, http_claim::RECORD_IFF_EFFECT] {
        violated(ClaimProtocol::standard(HttpVariant::SeedMiddleware), invariant);
    }
}

#[test]
fn a_record_at_commit_that_overwrites_or_does_not_wait_executes_twice() {
    violated(ClaimProtocol::standard(HttpVariant::RecordOverLiveRecord), http_claim::AT_MOST_ONE_EFFECT);
    violated(ClaimProtocol::standard(HttpVariant::RecordWithoutWaiting), http_claim::AT_MOST_ONE_EFFECT);
}

#[test]
fn records_without_their_scope_replay_across_merchants() {
    violated(ClaimProtocol::standard(HttpVariant::UnscopedRecord), http_claim::NO_REPLAY_ACROSS_SCOPES);
}

#[test]
fn the_inbox_outbox_path_keeps_every_invariant() {
    let checker = check(InboxOutbox::standard(KafkaVariant::Idem));
    assert!(checker.is_done(), "the state space was explored completely");
    checker.assert_properties();
}

#[test]
fn offsets_committed_before_the_database_commit_lose_events() {
    violated(InboxOutbox::standard(KafkaVariant::OffsetsBeforeDbCommit), inbox_outbox::CONSISTENT_STATE_AND_OUTPUT);
}

#[test]
fn stale_offsets_after_a_rebalance_move_the_group_backwards() {
    violated(InboxOutbox::standard(KafkaVariant::StaleOffsetsAfterRebalance), inbox_outbox::OFFSETS_NEVER_REGRESS);
}

#[test]
fn without_the_admission_floor_a_late_duplicate_is_applied_twice() {
    violated(InboxOutbox::standard(KafkaVariant::NoAdmissionFloor), inbox_outbox::AT_MOST_ONE_STATE_CHANGE);
}

#[test]
fn a_relay_marking_before_the_delivery_report_loses_output() {
    violated(InboxOutbox::standard(KafkaVariant::MarkBeforeDeliveryReport), inbox_outbox::CONSISTENT_STATE_AND_OUTPUT);
}

#[test]
fn an_event_id_chosen_at_publish_duplicates_output_past_receiver_dedup() {
    violated(InboxOutbox::standard(KafkaVariant::EventIdAtPublish), inbox_outbox::AT_MOST_ONE_OUTPUT);
}

#[test]
fn the_dedup_window_with_a_clock_lets_no_duplicate_through() {
    let checker = check(DedupWindow::standard(WindowVariant::Idem));
    assert!(checker.is_done(), "the state space was explored completely");
    checker.assert_properties();
}

/// Issue 24.1: a late admission that checks only `late_admission` re-applies an event whose row is alive.
#[test]
fn a_late_admission_without_the_processed_row_applies_a_duplicate() {
    violated(DedupWindow::standard(WindowVariant::LateAdmissionWithoutRow), dedup_window::NO_DUPLICATE_APPLIED);
}

/// Issue 24.2: rows kept a TTL after processing let a duplicate of an id dated ahead through.
#[test]
fn retention_from_processing_time_lets_a_future_dated_duplicate_through() {
    violated(DedupWindow::standard(WindowVariant::RetainFromProcessing), dedup_window::NO_DUPLICATE_APPLIED);
}

#[test]
fn a_v7_key_executes_once_whatever_the_hosts_clocks() {
    let checker = check(KeyWindow::standard(KeyVariant::Idem));
    assert!(checker.is_done(), "the state space was explored completely");
    checker.assert_properties();
}

/// Issue 32.4: without the clock margin, a host behind the database accepts a key after its record was
/// cleaned up (a refund executed twice).
#[test]
fn a_key_floor_without_a_clock_margin_executes_twice() {
    violated(KeyWindow::standard(KeyVariant::FloorWithoutMargin), key_window::AT_MOST_ONE_EXECUTION);
}

#[test]
fn phases_around_a_provider_call_charge_once_and_always_finish() {
    let checker = check(PhaseModel::standard(PhaseVariant::Idem));
    assert!(checker.is_done(), "the state space was explored completely");
    checker.assert_properties();
}

/// Issue 33: a downstream key that changes with the attempt charges again after a lost response.
#[test]
fn a_fresh_downstream_key_per_attempt_charges_twice() {
    violated(PhaseModel::standard(PhaseVariant::FreshKeyPerAttempt), phases::AT_MOST_ONE_CHARGE);
}

/// Issue 33: a second phase without the fencing check lets a late original complete after the takeover.
#[test]
fn completion_without_fencing_completes_twice() {
    violated(PhaseModel::standard(PhaseVariant::NoFencing), phases::ONE_COMPLETION);
}

/// Issue 33: taking over a live lease puts two calls in process at once, which the provider charges twice.
#[test]
fn a_takeover_of_a_live_lease_charges_twice() {
    violated(PhaseModel::standard(PhaseVariant::TakeoverWithoutLapse), phases::AT_MOST_ONE_CHARGE);
}

/// Issue 45: the provider's edges — a host clock ahead, commit latency, a gateway's 504, a provider that
/// forgets keys after its window, crashes — and idem's rules still charge once with one call in process.
#[test]
fn at_the_providers_edges_idem_charges_once_with_one_call_in_process() {
    use idem_model::provider_edges::{EdgeModel, EdgeVariant};
    let checker = check(EdgeModel::standard(EdgeVariant::Idem));
    assert!(checker.is_done(), "the state space was explored completely");
    checker.assert_properties();
}

/// Issue 45: each defect the review reproduced, shown violated.
#[test]
fn each_edge_defect_charges_twice_or_calls_twice_at_once() {
    use idem_model::provider_edges::{self as edges, EdgeModel, EdgeVariant};
    violated(EdgeModel::standard(EdgeVariant::HostClock), edges::ONE_CALL_IN_PROCESS);
    violated(EdgeModel::standard(EdgeVariant::NoConfirmAfterCommit), edges::ONE_CALL_IN_PROCESS);
    violated(EdgeModel::standard(EdgeVariant::GatewayIsAnAnswer), edges::ONE_CALL_IN_PROCESS);
    violated(EdgeModel::standard(EdgeVariant::WindowOnlyInTheCompleter), edges::AT_MOST_ONE_CHARGE);
}

/// Issue 45.4: an order's charge cancelled before, between or after its phases, with the provider's edges:
/// it ends with no charge or its charge refunded, and still one charge with one call in process.
#[test]
fn a_cancelled_orders_charge_is_never_made_or_is_refunded() {
    use idem_model::provider_edges::{EdgeModel, EdgeVariant};
    let checker = check(EdgeModel::cancelling(EdgeVariant::Idem));
    assert!(checker.is_done(), "the state space was explored completely");
    checker.assert_properties();
}

/// Issue 45.4: a cancellation that skips a charge not yet final, or cancels one whose call may be out,
/// leaves a charge that is never refunded.
#[test]
fn a_cancellation_that_skips_or_cuts_a_started_charge_keeps_the_money() {
    use idem_model::provider_edges::{self as edges, EdgeModel, EdgeVariant};
    violated(EdgeModel::cancelling(EdgeVariant::CancelSkipsAHeldCharge), edges::CANCELLED_MEANS_UNCHARGED);
    violated(EdgeModel::cancelling(EdgeVariant::CancelAStartedCharge), edges::CANCELLED_MEANS_UNCHARGED);
}

//! A Jepsen-style history of a failover run and its checker (issue 34.3).
//!
//! Clients record every invocation — a charge or a refund under its own `Idempotency-Key` — with what it
//! ended as: acknowledged (201, with the id the client was given), refused (a definite 4xx), or unknown (no
//! definite answer within the client's retries). After the faults heal, every unknown is sent again with its
//! key and the answer recorded as its resolution. The checker then compares the history with what the
//! database and the payments topic hold, counting effects, not survivors (the charge attempt log, every
//! event on the topic, every application of an order event):
//!
//! - every acknowledged charge and refund exists exactly once, as acknowledged;
//! - no charge executed twice, no refund applied twice, nothing stored that no client asked for;
//! - an unknown outcome left 0 or 1 effects, and its retry answered consistently with what is stored;
//! - every payment and refund announced on the topic under one `event_id`, and no event for a payment or
//!   refund that does not exist (an acknowledged write that a failover took back);
//! - money conserved: refunds never exceed their payment;
//! - every order event applied once.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rust_decimal::Decimal;

/// What a client asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `POST /payments` of `amount` with provider payment id `external`.
    Charge { external: String, amount: Decimal },
    /// `POST /payments/{payment}/refund` of `amount`.
    Refund { payment: String, amount: Decimal },
}

/// How an invocation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Acknowledged: 201 with the id of the payment or refund.
    Ok { id: String },
    /// A definite refusal.
    Failed { status: u16 },
    /// No definite answer within the client's retries.
    Unknown,
}

/// One invocation.
#[derive(Debug, Clone)]
pub struct Invocation {
    pub op: Op,
    pub key: String,
    /// When it ended, since the run began.
    pub at: Duration,
    pub outcome: Outcome,
    /// For an unknown outcome: the answer to the same request sent again with its key after the faults.
    pub resolved: Option<Outcome>,
}

impl Invocation {
    /// The answer the client ends with: the resolution of an unknown outcome, else the outcome.
    pub fn last(&self) -> &Outcome {
        match (&self.outcome, &self.resolved) {
            (Outcome::Unknown, Some(r)) => r,
            (o, _) => o,
        }
    }
}

/// An event read from the payments topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub event_id: String,
    pub event_type: String,
    pub payment_id: String,
    pub refund_id: Option<String>,
    /// The payment's order (for reports).
    pub order_id: String,
}

/// What the database and the topic hold after the run.
#[derive(Debug, Default, Clone)]
pub struct Observed {
    /// external payment id → (payment id, amount) of every stored payment
    pub payments: BTreeMap<String, Vec<(String, Decimal)>>,
    /// refund id → (payment id, amount)
    pub refunds: BTreeMap<String, (String, Decimal)>,
    /// committed executions of each charge (the attempt log), by external payment id
    pub executions: BTreeMap<String, i64>,
    /// every event read from the payments topic
    pub events: Vec<Event>,
    /// orders sent as events (each once, some delivered twice)
    pub orders_sent: BTreeSet<String>,
    /// (order id → applications by the consumer, payments stored for it)
    pub orders: BTreeMap<String, (i64, i64)>,
    /// Provider ids of payments charged through a payment provider (the provider's charge ids, which no
    /// client names): checked by counting the provider's charges instead.
    pub through_provider: BTreeSet<String>,
}

/// What the checker found.
#[derive(Debug, Default, Clone)]
pub struct Verdict {
    pub invocations: usize,
    pub acknowledged: usize,
    pub unknown: usize,
    pub unknown_resolved: usize,
    pub lost: Vec<String>,
    pub duplicated: Vec<String>,
    pub inconsistent: Vec<String>,
}

impl Verdict {
    pub fn clean(&self) -> bool {
        self.lost.is_empty() && self.duplicated.is_empty() && self.inconsistent.is_empty()
    }
}

/// Checks `history` against `observed` (see the module docs).
pub fn check(history: &[Invocation], observed: &Observed) -> Verdict {
    let mut v = Verdict { invocations: history.len(), ..Verdict::default() };
    let mut asked_charges = BTreeSet::new();
    let mut asked_refunds: BTreeMap<&str, usize> = BTreeMap::new();
    for inv in history {
        if inv.outcome == Outcome::Unknown {
            v.unknown += 1;
            if !matches!(inv.last(), Outcome::Unknown) {
                v.unknown_resolved += 1;
            }
        }
        if matches!(inv.last(), Outcome::Ok { .. }) {
            v.acknowledged += 1;
        }
        match (&inv.op, inv.last()) {
            (Op::Charge { external, amount }, last) => {
                asked_charges.insert(external.as_str());
                let stored = observed.payments.get(external).map(Vec::as_slice).unwrap_or_default();
                match last {
                    Outcome::Ok { id } => match stored {
                        [] => v.lost.push(format!("charge {external} acknowledged as {id}, not stored")),
                        [(sid, samount)] if sid == id && samount == amount => {}
                        [(sid, samount)] => v.inconsistent.push(format!(
                            "charge {external} acknowledged as {id} of {amount}, stored as {sid} of {samount}"
                        )),
                        many => v.duplicated.push(format!("charge {external} stored {} times", many.len())),
                    },
                    Outcome::Failed { status } if !stored.is_empty() => {
                        v.inconsistent.push(format!("charge {external} refused ({status}) but stored"))
                    }
                    _ if stored.len() > 1 => {
                        v.duplicated.push(format!("charge {external} stored {} times", stored.len()))
                    }
                    _ => {}
                }
            }
            (Op::Refund { payment, amount }, last) => {
                *asked_refunds.entry(payment.as_str()).or_default() += 1;
                if let Outcome::Ok { id } = last {
                    match observed.refunds.get(id) {
                        None => v.lost.push(format!("refund {id} of payment {payment} acknowledged, not stored")),
                        Some((p, a)) if p == payment && a == amount => {}
                        Some((p, a)) => v
                            .inconsistent
                            .push(format!("refund {id} acknowledged for {payment} of {amount}, stored for {p} of {a}")),
                    }
                }
            }
        }
    }
    // executions, not survivors
    for (external, n) in &observed.executions {
        if *n > 1 {
            v.duplicated.push(format!("charge {external} executed {n} times"));
        }
    }
    let mut payment_ids: BTreeMap<&str, Decimal> = BTreeMap::new();
    for (external, rows) in &observed.payments {
        // payments of order events carry `order-…` provider ids; every other one a client asked for
        if !asked_charges.contains(external.as_str())
            && !external.starts_with("order-")
            && !observed.through_provider.contains(external)
        {
            v.inconsistent.push(format!("payment {external} stored though no client asked for it"));
        }
        for (id, amount) in rows {
            payment_ids.insert(id, *amount);
        }
    }
    // refunds: each one asked for, none applied twice (one refund invocation per payment in these runs),
    // never more than the payment
    let mut refunded: BTreeMap<&str, (usize, Decimal)> = BTreeMap::new();
    for (id, (payment, amount)) in &observed.refunds {
        let entry = refunded.entry(payment.as_str()).or_default();
        entry.0 += 1;
        entry.1 += *amount;
        if !payment_ids.contains_key(payment.as_str()) {
            v.inconsistent.push(format!("refund {id} of a payment that does not exist"));
        }
    }
    for (payment, (n, total)) in &refunded {
        let asked = asked_refunds.get(payment).copied().unwrap_or(0);
        if *n > asked {
            v.duplicated.push(format!("payment {payment}: {n} refunds stored, {asked} asked for"));
        }
        if let Some(amount) = payment_ids.get(payment)
            && total > amount
        {
            v.inconsistent.push(format!("payment {payment} refunded {total}, more than its {amount}"));
        }
    }
    // the topic: one event id per announcement, and no announcement of what does not exist
    let mut ids: BTreeMap<(&str, &str, Option<&str>), BTreeSet<&str>> = BTreeMap::new();
    for e in &observed.events {
        ids.entry((&e.event_type, &e.payment_id, e.refund_id.as_deref())).or_default().insert(&e.event_id);
    }
    for ((kind, payment, refund), event_ids) in &ids {
        if event_ids.len() > 1 {
            v.duplicated.push(format!("{kind} of {payment} published under {} event ids", event_ids.len()));
        }
        let exists = match refund {
            Some(r) => observed.refunds.contains_key(*r),
            None => payment_ids.contains_key(payment),
        };
        if !exists {
            v.lost.push(format!("{kind} of {payment} {} published, but it is not stored", refund.unwrap_or("")));
        }
    }
    for id in payment_ids.keys() {
        if !ids.keys().any(|(kind, p, _)| *kind == "PaymentCaptured" && p == id) {
            v.lost.push(format!("payment {id} never announced on the topic"));
        }
    }
    for (id, (payment, _)) in &observed.refunds {
        if !ids.keys().any(|(kind, p, r)| *kind == "PaymentRefunded" && p == payment && *r == Some(id.as_str())) {
            v.lost.push(format!("refund {id} never announced on the topic"));
        }
    }
    // order events: each applied once, each paid
    for order in &observed.orders_sent {
        match observed.orders.get(order) {
            None | Some((_, 0)) => v.lost.push(format!("order {order} sent as an event, no payment")),
            Some((applied, _)) if *applied > 1 => v.duplicated.push(format!("order {order} applied {applied} times")),
            Some((_, paid)) if *paid > 1 => v.duplicated.push(format!("order {order} paid {paid} times")),
            _ => {}
        }
    }
    v
}

/// For a fault at `fault` (and before `until`, the next fault or the end): the longest time without a
/// success (the outage clients saw, from the fault on), and the time from the fault to steady state — the
/// first whole second after that gap with at least half the `baseline` successes per second. `successes`
/// are sorted times since the run began.
pub fn recovery(
    successes: &[Duration],
    fault: Duration,
    until: Duration,
    baseline: f64,
) -> (Duration, Option<Duration>) {
    let after: Vec<Duration> = successes.iter().copied().filter(|t| *t >= fault && *t < until).collect();
    let mut gap = (until.saturating_sub(fault), until);
    if !after.is_empty() {
        gap = std::iter::once(fault)
            .chain(after.iter().copied())
            .zip(after.iter().copied())
            .map(|(a, b)| (b - a, b))
            .max()
            .unwrap_or_default();
    }
    let (outage, resumed) = gap;
    let steady = (0..).map(|s| resumed + Duration::from_secs(s)).take_while(|from| *from < until).find_map(|from| {
        let n = after.iter().filter(|t| **t >= from && **t < from + Duration::from_secs(1)).count();
        (n as f64 >= baseline / 2.0).then(|| from + Duration::from_secs(1) - fault)
    });
    (outage, steady)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Decimal {
        s.parse().expect("a decimal")
    }

    fn charge(external: &str, outcome: Outcome, resolved: Option<Outcome>) -> Invocation {
        Invocation {
            op: Op::Charge { external: external.into(), amount: d("10.00") },
            key: format!("k-{external}"),
            at: Duration::ZERO,
            outcome,
            resolved,
        }
    }

    fn ok(id: &str) -> Outcome {
        Outcome::Ok { id: id.into() }
    }

    fn captured(payment: &str, event_id: &str) -> Event {
        Event {
            event_id: event_id.into(),
            event_type: "PaymentCaptured".into(),
            payment_id: payment.into(),
            refund_id: None,
            order_id: String::new(),
        }
    }

    /// A clean run: two acknowledged charges (one after an unknown outcome), one refund, all announced.
    fn clean() -> (Vec<Invocation>, Observed) {
        let history = vec![
            charge("a", ok("p1"), None),
            charge("b", Outcome::Unknown, Some(ok("p2"))),
            Invocation {
                op: Op::Refund { payment: "p1".into(), amount: d("4.00") },
                key: "k-r".into(),
                at: Duration::ZERO,
                outcome: ok("r1"),
                resolved: None,
            },
        ];
        let mut o = Observed::default();
        o.payments.insert("a".into(), vec![("p1".into(), d("10.00"))]);
        o.payments.insert("b".into(), vec![("p2".into(), d("10.00"))]);
        o.refunds.insert("r1".into(), ("p1".into(), d("4.00")));
        o.executions.insert("a".into(), 1);
        o.executions.insert("b".into(), 1);
        o.events = vec![
            captured("p1", "e1"),
            captured("p1", "e1"), // the same event delivered twice: at-least-once, fine
            captured("p2", "e2"),
            Event {
                event_id: "e3".into(),
                event_type: "PaymentRefunded".into(),
                payment_id: "p1".into(),
                refund_id: Some("r1".into()),
                order_id: String::new(),
            },
        ];
        (history, o)
    }

    #[test]
    fn a_clean_run_is_clean() {
        let (history, observed) = clean();
        let v = check(&history, &observed);
        assert!(v.clean(), "{v:?}");
        assert_eq!((v.invocations, v.acknowledged, v.unknown, v.unknown_resolved), (3, 3, 1, 1));
    }

    #[test]
    fn an_acknowledged_charge_the_failover_took_back_is_lost_and_so_is_its_event() {
        let (history, mut observed) = clean();
        observed.payments.remove("b");
        let v = check(&history, &observed);
        assert!(v.lost.iter().any(|l| l.contains("charge b acknowledged")), "{v:?}");
        assert!(v.lost.iter().any(|l| l.contains("PaymentCaptured of p2")), "an event of a vanished payment: {v:?}");
    }

    #[test]
    fn an_acknowledged_refund_missing_is_lost() {
        let (history, mut observed) = clean();
        observed.refunds.clear();
        observed.events.retain(|e| e.refund_id.is_none());
        let v = check(&history, &observed);
        assert!(v.lost.iter().any(|l| l.contains("refund r1")), "{v:?}");
    }

    #[test]
    fn a_charge_executed_twice_or_announced_twice_is_duplicated() {
        let (history, mut observed) = clean();
        observed.executions.insert("a".into(), 2);
        observed.events.push(captured("p2", "e9"));
        let v = check(&history, &observed);
        assert!(v.duplicated.iter().any(|l| l.contains("executed 2 times")), "{v:?}");
        assert!(v.duplicated.iter().any(|l| l.contains("under 2 event ids")), "{v:?}");
    }

    #[test]
    fn a_refund_applied_twice_and_money_not_conserved_are_found() {
        let (history, mut observed) = clean();
        observed.refunds.insert("r2".into(), ("p1".into(), d("7.00")));
        observed.events.push(Event {
            event_id: "e4".into(),
            event_type: "PaymentRefunded".into(),
            payment_id: "p1".into(),
            refund_id: Some("r2".into()),
            order_id: String::new(),
        });
        let v = check(&history, &observed);
        assert!(v.duplicated.iter().any(|l| l.contains("2 refunds stored, 1 asked")), "{v:?}");
        assert!(v.inconsistent.iter().any(|l| l.contains("refunded 11.00")), "{v:?}");
    }

    #[test]
    fn an_answer_that_differs_from_what_is_stored_is_inconsistent() {
        let (mut history, observed) = clean();
        history[1].resolved = Some(ok("p-other"));
        history.push(charge("c", Outcome::Failed { status: 422 }, None));
        let mut observed = observed;
        observed.payments.insert("c".into(), vec![("p3".into(), d("10.00"))]);
        observed.events.push(captured("p3", "e5"));
        let v = check(&history, &observed);
        assert!(v.inconsistent.iter().any(|l| l.contains("stored as p2")), "{v:?}");
        assert!(v.inconsistent.iter().any(|l| l.contains("refused (422) but stored")), "{v:?}");
    }

    #[test]
    fn a_payment_nobody_asked_for_and_an_unannounced_one_are_found() {
        let (history, mut observed) = clean();
        observed.payments.insert("z".into(), vec![("p9".into(), d("1.00"))]);
        let v = check(&history, &observed);
        assert!(v.inconsistent.iter().any(|l| l.contains("payment z stored though no client")), "{v:?}");
        assert!(v.lost.iter().any(|l| l.contains("payment p9 never announced")), "{v:?}");
    }

    #[test]
    fn order_events_applied_twice_or_never_are_found() {
        let (history, mut observed) = clean();
        observed.orders_sent = ["o1", "o2", "o3"].map(String::from).into();
        observed.orders.insert("o1".into(), (1, 1));
        observed.orders.insert("o2".into(), (2, 1));
        let v = check(&history, &observed);
        assert!(v.duplicated.iter().any(|l| l.contains("order o2 applied 2 times")), "{v:?}");
        assert!(v.lost.iter().any(|l| l.contains("order o3")), "{v:?}");
        assert!(!v.lost.iter().any(|l| l.contains("order o1")), "{v:?}");
    }

    #[test]
    fn recovery_is_the_longest_gap_and_the_first_second_after_it_at_half_the_baseline() {
        let s = |ms: u64| Duration::from_millis(ms);
        // 10/s before a fault at 10 s; one request in flight answered at 10.05 s; nothing until 13.2 s;
        // then 2 successes in the next second, then 6
        let mut successes: Vec<Duration> = (0..100).map(|i| s(i * 100)).collect();
        successes.extend([s(10_050), s(13_200), s(13_900)]);
        successes.extend((0..6).map(|i| s(14_200 + i * 150)));
        let (outage, steady) = recovery(&successes, s(10_000), s(30_000), 10.0);
        assert_eq!(outage, s(3_150), "from 10.05 s to 13.2 s");
        assert_eq!(steady, Some(s(5_200)), "[14.2, 15.2) has 6 ≥ 5: steady 5.2 s after the fault");
        let (outage, steady) = recovery(&successes, s(20_000), s(25_000), 10.0);
        assert_eq!((outage, steady), (s(5_000), None), "no success before the next fault");
    }
}

//! §15 priority classes in the engine, on the memory backend with tokio's paused
//! clock: the waiter order across classes (weighted fair queueing, FIFO within a
//! class, cancellation keeps the order) and the class a call names.

mod support;

use std::sync::Arc;
use std::time::Duration;

use polygate::backend::memory::MemoryBackend;
use polygate::backend::Outcome;
use polygate::config::{PriorityConfig, ScopeConfig};
use polygate::engine::{Engine, EngineError, Grant};
use support::engine_cfg::*;
use tokio::sync::mpsc;

const OWNER: u64 = 1;
/// Every case here ends well within this much virtual time.
const LIMIT: Duration = Duration::from_secs(3600);

fn success() -> Outcome {
    Outcome::Success {
        tokens: None,
        split: None,
        count_attempt: true,
    }
}

fn class(name: &str, weight: f64) -> PriorityConfig {
    PriorityConfig {
        name: name.into(),
        weight,
        reserve: 0.0,
        limit: 1.0,
    }
}

/// One source behind a pacer of exactly one slot; naps so long that only freed
/// slots move the waiters (the order under test is the wake-up order).
fn paced_scope(classes: Vec<PriorityConfig>) -> ScopeConfig {
    let mut sc = scope("chat", vec![source("a")]);
    sc.pacer.initial = 1.0;
    sc.pacer.min = 1.0;
    sc.pacer.max = 1.0;
    sc.poll_interval = secs(100_000);
    sc.stall_window = secs(1_000_000);
    sc.default_priority = classes.len() - 1;
    sc.priorities = classes;
    sc
}

type Granted = (String, usize, Grant);

/// Hold the only slot, queue `waiters` (class, arrival index) in that order, then
/// release the slot `n` times, each grant being reported at once; returns who got
/// each grant.
async fn grant_order(
    e: &Arc<Engine<MemoryBackend>>,
    waiters: &[(&str, usize)],
    n: usize,
    cancel: &[usize],
) -> Vec<(String, usize)> {
    let c0 = e.begin_call(OWNER, "chat", None).unwrap();
    let held = e.acquire(OWNER, c0).await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel::<Granted>();
    let mut tasks = Vec::new();
    for (i, &(cls, idx)) in waiters.iter().enumerate() {
        let call = e.begin_call_as(OWNER, "chat", None, Some(cls)).unwrap();
        let (e2, tx) = (e.clone(), tx.clone());
        let cls = cls.to_string();
        tasks.push(tokio::spawn(async move {
            let g = e2.acquire(OWNER, call).await.unwrap();
            let _ = tx.send((cls, idx, g));
        }));
        // Each joins its queue before the next arrives.
        tokio::time::sleep(Duration::from_millis(1)).await;
        if cancel.contains(&i) {
            tasks[i].abort();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    assert_eq!(
        e.status().await[0].waiters as usize,
        waiters.len() - cancel.len()
    );
    let mut order = Vec::new();
    e.report(OWNER, held.permit, success()).await.unwrap();
    for _ in 0..n {
        let (cls, idx, g) = rx.recv().await.expect("a grant");
        order.push((cls, idx));
        e.report(OWNER, g.permit, success()).await.unwrap();
    }
    for t in tasks {
        t.abort();
    }
    order
}

fn count(order: &[(String, usize)], cls: &str) -> usize {
    order.iter().filter(|(c, _)| c == cls).count()
}

/// `n` waiters of each class, interleaved batch first.
fn mixed(n: usize) -> Vec<(&'static str, usize)> {
    (0..n)
        .flat_map(|i| [("batch", i), ("interactive", i)])
        .collect()
}

#[tokio::test(start_paused = true)]
async fn weights_8_to_1_give_interactive_8_of_9_grants_while_both_wait() {
    tokio::time::timeout(LIMIT, async {
        let e = engine(&config(vec![paced_scope(vec![
            class("interactive", 8.0),
            class("batch", 1.0),
        ])]));
        let order = grant_order(&e, &mixed(20), 18, &[]).await;
        let first9 = &order[..9];
        assert_eq!(count(first9, "interactive"), 8, "{order:?}");
        assert_eq!(count(&order, "interactive"), 16, "{order:?}");
        // Per class, in arrival order.
        for cls in ["interactive", "batch"] {
            let idx: Vec<usize> = order
                .iter()
                .filter(|(c, _)| c == cls)
                .map(|x| x.1)
                .collect();
            assert!(
                idx.windows(2).all(|w| w[0] < w[1]),
                "FIFO in {cls}: {idx:?}"
            );
        }
    })
    .await
    .expect("within the time limit");
}

#[tokio::test(start_paused = true)]
async fn equal_weights_alternate_and_neither_starves() {
    tokio::time::timeout(LIMIT, async {
        let e = engine(&config(vec![paced_scope(vec![
            class("interactive", 1.0),
            class("batch", 1.0),
        ])]));
        let order = grant_order(&e, &mixed(10), 20, &[]).await;
        assert_eq!(count(&order, "interactive"), 10);
        assert_eq!(count(&order, "batch"), 10);
        for w in order.windows(3) {
            assert!(
                !(w[0].0 == w[1].0 && w[1].0 == w[2].0),
                "no class served three times in a row while both wait: {order:?}"
            );
        }
        // Even at 1000:1 the light class is served, never starved.
        let e = engine(&config(vec![paced_scope(vec![
            class("interactive", 1000.0),
            class("batch", 1.0),
        ])]));
        let mut waiters: Vec<(&str, usize)> = (0..5).map(|i| ("batch", i)).collect();
        waiters.extend((0..5).map(|i| ("interactive", i)));
        let order = grant_order(&e, &waiters, 10, &[]).await;
        assert_eq!(count(&order, "batch"), 5);
    })
    .await
    .expect("within the time limit");
}

#[tokio::test(start_paused = true)]
async fn one_class_is_fifo_and_a_cancelled_waiter_leaves_the_order_intact() {
    tokio::time::timeout(LIMIT, async {
        let e = engine(&config(vec![paced_scope(vec![
            class("interactive", 8.0),
            class("batch", 1.0),
        ])]));
        let waiters: Vec<(&str, usize)> = (0..6).map(|i| ("batch", i)).collect();
        let order = grant_order(&e, &waiters, 4, &[1, 3]).await;
        let idx: Vec<usize> = order.iter().map(|x| x.1).collect();
        assert_eq!(
            idx,
            vec![0, 2, 4, 5],
            "cancelled 1 and 3 skipped, rest in order"
        );
        assert_eq!(e.live_counts().pacer_in_flight, 0, "nothing leaked");
    })
    .await
    .expect("within the time limit");
}

#[tokio::test(start_paused = true)]
async fn a_named_class_must_exist_and_a_scope_without_classes_takes_none() {
    let e = engine(&config(vec![
        paced_scope(vec![class("interactive", 8.0), class("batch", 1.0)]),
        scope("plain", vec![source("b")]),
    ]));
    let err = e
        .begin_call_as(OWNER, "chat", None, Some("bulk"))
        .unwrap_err();
    assert!(matches!(err, EngineError::UnknownPriority { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("\"bulk\"") && msg.contains("interactive, batch"),
        "{msg}"
    );
    let err = e
        .begin_call_as(OWNER, "plain", None, Some("interactive"))
        .unwrap_err();
    assert!(err.to_string().contains("has no priority classes"), "{err}");
    // Absent: the default class; no classes: no class needed.
    assert!(e.begin_call_as(OWNER, "chat", None, None).is_ok());
    let call = e.begin_call_as(OWNER, "plain", None, None).unwrap();
    assert_eq!(&*e.acquire(OWNER, call).await.unwrap().source, "b");
}

#[tokio::test(start_paused = true)]
async fn reload_changes_shares_but_refuses_changed_classes() {
    let sc = paced_scope(vec![class("interactive", 8.0), class("batch", 1.0)]);
    let e = engine(&config(vec![sc.clone()]));
    let mut heavier = sc.clone();
    heavier.priorities[1].weight = 2.0;
    heavier.priorities[0].reserve = 0.5;
    assert!(e.reload(&config(vec![heavier])).is_ok());
    let mut renamed = sc.clone();
    renamed.priorities[1].name = "bulk".into();
    let err = e.reload(&config(vec![renamed])).unwrap_err();
    assert!(err.to_string().contains("priority classes"), "{err}");
    let mut none = sc;
    none.priorities.clear();
    none.default_priority = 0;
    assert!(
        e.reload(&config(vec![none])).is_err(),
        "removing classes needs a restart"
    );
    // Still the running classes.
    assert!(e.begin_call_as(OWNER, "chat", None, Some("batch")).is_ok());
}

//! `--scenario priorities` (DESIGN §15, issue 13): what priority classes buy an
//! interactive caller behind a saturating batch load. In process, on the memory
//! backend (the waiter order is host-local; no socket needed to show it): a pacer of
//! 4 slots, every permit held [`HOLD`] (the upstream call), [`BATCH_TASKS`] batch
//! tasks calling back to back, and one interactive task making a call every
//! [`EVERY`]. The same load runs twice: without classes (one FIFO queue) and with
//! `interactive` (weight 8) ahead of `batch` (weight 1). The figures are the
//! interactive calls' waits for a permit (begin to grant), p50 and p99, both ways.
//! (Numbers of calls too: without classes a waiting call has no place in an order, so
//! an interactive call may lose every freed slot to a batch call asking again.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use polygate::backend::memory::MemoryBackend;
use polygate::backend::Outcome;
use polygate::engine::Engine;

use crate::{Line, Opts, Scenario};

/// How long each permit is held: the upstream call's duration.
const HOLD: Duration = Duration::from_millis(5);
/// Batch tasks calling back to back: 8 per pacer slot, always waiting.
const BATCH_TASKS: u64 = 32;
/// What a batch worker does between calls (reads the answer, builds the next
/// request). Without it, in process, a batch task would re-ask in the same instant
/// its permit is released and take the slot before any woken waiter runs.
const BATCH_GAP: Duration = Duration::from_millis(1);
/// The interactive task's pace.
const EVERY: Duration = Duration::from_millis(20);

/// The scope, with or without the §15 classes.
fn config(classes: bool) -> String {
    let prio = if classes {
        "[[scopes.llm.priorities]]\nname = \"interactive\"\nweight = 8\n\
         [[scopes.llm.priorities]]\nname = \"batch\"\nweight = 1\n"
    } else {
        ""
    };
    format!(
        "[scopes.llm]\nquota_full = \"wait\"\npoll_interval = \"50ms\"\nstall_window = \"10m\"\n\
         [scopes.llm.pacer]\ninitial = 4\nmin = 4\nmax = 4\n{prio}\
         [[scopes.llm.sources]]\nname = \"up\"\n"
    )
}

fn engine(classes: bool) -> Result<Arc<Engine<MemoryBackend>>, String> {
    crate::engine::in_process(&config(classes), &["up"])
}

/// One call of class `priority` (`None`: the scope's default); returns the wait for
/// its permit.
async fn call(
    e: &Engine<MemoryBackend>,
    owner: u64,
    priority: Option<&str>,
) -> Result<Duration, String> {
    let t0 = Instant::now();
    let call = e
        .begin_call_as(owner, "llm", None::<u64>, priority)
        .map_err(|e| e.to_string())?;
    let g = e.acquire(owner, call).await.map_err(|e| e.to_string())?;
    let waited = t0.elapsed();
    tokio::time::sleep(HOLD).await;
    let ok = Outcome::Success {
        tokens: Some(1),
        split: None,
        count_attempt: true,
    };
    e.report(owner, g.permit, ok)
        .await
        .map_err(|e| e.to_string())?;
    e.end_call(owner, call).await.map_err(|e| e.to_string())?;
    Ok(waited)
}

/// The interactive waits (sorted) and the batch calls completed, over `window`.
async fn run_once(classes: bool, window: Duration) -> Result<(Vec<Duration>, u64), String> {
    let e = engine(classes)?;
    let t0 = Instant::now();
    let batch: Vec<_> = (0..BATCH_TASKS)
        .map(|owner| {
            let e = e.clone();
            tokio::spawn(async move {
                let mut n = 0u64;
                while t0.elapsed() < window {
                    call(&e, owner, None).await?;
                    n += 1;
                    tokio::time::sleep(BATCH_GAP).await;
                }
                Ok::<_, String>(n)
            })
        })
        .collect();
    // Let the batch fill the queue first.
    tokio::time::sleep(HOLD * 4).await;
    let interactive = if classes { Some("interactive") } else { None };
    let mut waits = Vec::new();
    let mut tick = tokio::time::interval(EVERY);
    while t0.elapsed() < window {
        tick.tick().await;
        waits.push(call(&e, BATCH_TASKS, interactive).await?);
    }
    let mut done = 0;
    for h in batch {
        done += h.await.map_err(|e| e.to_string())??;
    }
    waits.sort();
    Ok((waits, done))
}

fn pct_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

pub fn run(rt: &tokio::runtime::Runtime, opts: &Opts) -> Result<Vec<Line>, String> {
    // Enough interactive calls for a p99 even at --seconds 1.
    let window = opts.window().max(Duration::from_secs(2));
    rt.block_on(async {
        let (fifo, fifo_batch) = run_once(false, window).await?;
        let (cls, cls_batch) = run_once(true, window).await?;
        let secs = window.as_secs_f64();
        let mut l = Line::new(Scenario::Priorities);
        l.num("interactive_p50_ms", pct_ms(&cls, 0.5))
            .num("interactive_p99_ms", pct_ms(&cls, 0.99))
            .num("interactive_p50_ms_without_classes", pct_ms(&fifo, 0.5))
            .num("interactive_p99_ms_without_classes", pct_ms(&fifo, 0.99))
            .num("interactive_max_ms", pct_ms(&cls, 1.0))
            .num("interactive_max_ms_without_classes", pct_ms(&fifo, 1.0))
            .num("interactive_calls", cls.len() as f64)
            .num("interactive_calls_without_classes", fifo.len() as f64)
            .num("batch_calls_per_s", cls_batch as f64 / secs)
            .num(
                "batch_calls_per_s_without_classes",
                fifo_batch as f64 / secs,
            )
            .num(
                "p99_ratio",
                pct_ms(&cls, 0.99) / pct_ms(&fifo, 0.99).max(f64::MIN_POSITIVE),
            );
        Ok(vec![l])
    })
}

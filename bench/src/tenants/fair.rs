//! `--scenario tenants`, part `fairness` (DESIGN §19 "Fair turns", issue 30): what
//! VTC buys quiet tenants beside a noisy one in a saturated scope. In process, on the
//! memory backend, on the real clock (the waiter order is host-local, as
//! `priorities` shows its classes): two scopes of one engine run side by side, each
//! a pacer of [`SLOTS`] slots whose permits are held [`HOLD`] (the upstream call),
//! once with `fairness = "vtc"` and once with `"fifo"`:
//!
//! - `mixed`: [`QUIET`] quiet tenants each start a call every [`QUIET_EVERY`]
//!   (open loop: a call that waits does not delay the next), and one noisy tenant
//!   keeps [`NOISY_WORKERS`] calls outstanding (a worker pool calling back to back).
//!   The scope serves `SLOTS / HOLD` = 200 calls/s; the quiet tenants ask for 2/3 of
//!   it, so the noisy tenant is served the remaining third, 10× one quiet tenant's
//!   rate, in both modes (both are work-conserving), and always has calls waiting.
//!   The figure is the quiet tenants' waits for a permit (begin to grant).
//! - `backlog`: [`BACKLOG`] tenants of different weights and call sizes, each with
//!   [`BACKLOG_WORKERS`] calls always outstanding (every one backlogged). VTC should
//!   give each the same tokens ÷ weight; Jain's index of those (1 = equal) says how
//!   close it came. Under FIFO every worker gets the same number of calls, whatever
//!   their size and weight: the control.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use polygate::backend::memory::MemoryBackend;
use polygate::backend::Outcome;
use polygate::engine::Engine;

use crate::Line;

/// Pacer slots of each scope.
const SLOTS: u32 = 4;
/// How long each permit is held: the upstream call's duration.
const HOLD: Duration = Duration::from_millis(20);
/// Quiet tenants of `mixed`.
const QUIET: usize = 20;
/// Each quiet tenant's pace: 20 tenants × 6.67 calls/s = 2/3 of the 200 calls/s the
/// scope serves.
const QUIET_EVERY: Duration = Duration::from_millis(150);
/// Calls the noisy tenant keeps outstanding (8 per slot, as `priorities`' batch).
const NOISY_WORKERS: usize = 32;
/// What a back-to-back worker does between calls (reads the answer, builds the next
/// request). Without it, in process, a worker would re-ask in the same instant its
/// permit is released, before any woken waiter runs (`priorities` says the same).
const GAP: Duration = Duration::from_millis(1);
/// Tokens of every `mixed` call (estimate = usage).
const MIXED_TOKENS: u64 = 100;
/// `backlog`'s tenants: (weight, tokens per call).
const BACKLOG: [(f64, u64); 4] = [(1.0, 100), (1.0, 300), (2.0, 100), (4.0, 200)];
/// Calls each `backlog` tenant keeps outstanding.
const BACKLOG_WORKERS: usize = 8;

/// Both scopes, with `fairness`.
fn config(fairness: &str) -> String {
    let mut s = String::new();
    for scope in ["mixed", "backlog"] {
        s.push_str(&format!(
            "[scopes.{scope}]\nquota_full = \"wait\"\npoll_interval = \"50ms\"\n\
             stall_window = \"10m\"\n[scopes.{scope}.pacer]\ninitial = {SLOTS}\n\
             min = {SLOTS}\nmax = {SLOTS}\n[scopes.{scope}.tenants]\n\
             fairness = \"{fairness}\"\n"
        ));
        if scope == "backlog" {
            for (i, (w, _)) in BACKLOG.iter().enumerate() {
                s.push_str(&format!(
                    "[[scopes.backlog.tenants.override]]\nname = \"b{i}\"\nweight = {w:?}\n"
                ));
            }
        }
        s.push_str(&format!(
            "[[scopes.{scope}.sources]]\nname = \"{scope}-up\"\n"
        ));
    }
    s
}

/// One call of `tenant` in `scope`, `tokens` estimated and used; returns the wait for
/// its permit and when it was granted.
async fn call(
    e: &Engine<MemoryBackend>,
    owner: u64,
    scope: &str,
    tenant: &str,
    tokens: u64,
) -> Result<(Duration, Instant), String> {
    let t0 = Instant::now();
    let call = e
        .begin_call_for(owner, scope, Some(tokens), None, Some(tenant))
        .map_err(|e| e.to_string())?;
    let g = e.acquire(owner, call).await.map_err(|e| e.to_string())?;
    let granted = Instant::now();
    tokio::time::sleep(HOLD).await;
    let ok = Outcome::Success {
        tokens: Some(tokens),
        split: None,
        count_attempt: true,
    };
    e.report(owner, g.permit, ok)
        .await
        .map_err(|e| e.to_string())?;
    e.end_call(owner, call).await.map_err(|e| e.to_string())?;
    Ok((granted - t0, granted))
}

/// What one run measured.
struct Run {
    /// Waits of the quiet tenants' calls begun in the window, sorted.
    quiet: Vec<Duration>,
    /// Calls of the noisy tenant granted in the window.
    noisy_calls: u64,
    /// Calls of the quiet tenants granted in the window.
    quiet_calls: u64,
    /// `backlog`: tokens granted in the window per tenant.
    backlog_tokens: Vec<u64>,
}

/// Workers calling back to back in `scope` as `tenant` until `stop`; returns the
/// calls and tokens granted inside `[from, until)`.
fn worker(
    e: &Arc<Engine<MemoryBackend>>,
    owner: u64,
    scope: &'static str,
    tenant: String,
    tokens: u64,
    window: (Instant, Instant),
    stop: &Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Result<(u64, u64), String>> {
    let (e, stop) = (e.clone(), stop.clone());
    tokio::spawn(async move {
        let (mut n, mut t) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            let (_, at) = call(&e, owner, scope, &tenant, tokens).await?;
            if at >= window.0 && at < window.1 {
                n += 1;
                t += tokens;
            }
            tokio::time::sleep(GAP).await;
        }
        Ok((n, t))
    })
}

/// One run of both scopes under `fairness`: `warmup`, then `window` measured.
async fn run_once(fairness: &str, warmup: Duration, window: Duration) -> Result<Run, String> {
    let e = crate::engine::in_process(&config(fairness), &["mixed-up", "backlog-up"])?;
    let t0 = Instant::now();
    let span = (t0 + warmup, t0 + warmup + window);
    let stop = Arc::new(AtomicBool::new(false));
    let mut owner = 0u64;
    let mut next = || {
        owner += 1;
        owner
    };
    let noisy: Vec<_> = (0..NOISY_WORKERS)
        .map(|_| {
            worker(
                &e,
                next(),
                "mixed",
                "noisy".into(),
                MIXED_TOKENS,
                span,
                &stop,
            )
        })
        .collect();
    let backlog: Vec<Vec<_>> = BACKLOG
        .iter()
        .enumerate()
        .map(|(i, &(_, tokens))| {
            (0..BACKLOG_WORKERS)
                .map(|_| worker(&e, next(), "backlog", format!("b{i}"), tokens, span, &stop))
                .collect()
        })
        .collect();
    // The quiet tenants: one ticker each, phases spread over the period; every call
    // its own task (open loop).
    let waits = Arc::new(Mutex::new(Vec::new()));
    let quiet: Vec<_> = (0..QUIET)
        .map(|q| {
            let (e, stop, waits) = (e.clone(), stop.clone(), waits.clone());
            let base = next() * 1_000_000;
            tokio::spawn(async move {
                let phase = QUIET_EVERY * q as u32 / QUIET as u32;
                tokio::time::sleep(phase).await;
                let mut tick = tokio::time::interval(QUIET_EVERY);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut calls = Vec::new();
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    k += 1;
                    let (e, waits) = (e.clone(), waits.clone());
                    let tenant = format!("q{q}");
                    calls.push(tokio::spawn(async move {
                        let begun = Instant::now();
                        let (wait, _) = call(&e, base + k, "mixed", &tenant, MIXED_TOKENS).await?;
                        if begun >= span.0 && begun < span.1 {
                            waits.lock().unwrap_or_else(|p| p.into_inner()).push(wait);
                        }
                        Ok::<_, String>(())
                    }));
                }
                for c in calls {
                    c.await.map_err(|e| e.to_string())??;
                }
                Ok::<_, String>(())
            })
        })
        .collect();
    tokio::time::sleep_until((span.1).into()).await;
    stop.store(true, Ordering::Relaxed);
    let mut noisy_calls = 0;
    for h in noisy {
        noisy_calls += h.await.map_err(|e| e.to_string())??.0;
    }
    let mut backlog_tokens = Vec::new();
    for hs in backlog {
        let mut t = 0;
        for h in hs {
            t += h.await.map_err(|e| e.to_string())??.1;
        }
        backlog_tokens.push(t);
    }
    for h in quiet {
        h.await.map_err(|e| e.to_string())??;
    }
    let mut quiet = std::mem::take(&mut *waits.lock().unwrap_or_else(|p| p.into_inner()));
    quiet.sort();
    Ok(Run {
        quiet_calls: quiet.len() as u64,
        quiet,
        noisy_calls,
        backlog_tokens,
    })
}

fn pct_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// Jain's fairness index of `x`: (Σx)² / (n Σx²); 1 when all are equal, 1/n when one
/// has everything.
pub fn jain(x: &[f64]) -> f64 {
    let (s, s2) = x.iter().fold((0.0, 0.0), |(s, s2), v| (s + v, s2 + v * v));
    if s2 == 0.0 {
        return f64::NAN;
    }
    s * s / (x.len() as f64 * s2)
}

/// `backlog`'s tokens ÷ weight per tenant.
fn weighted(tokens: &[u64]) -> Vec<f64> {
    tokens
        .iter()
        .zip(BACKLOG)
        .map(|(&t, (w, _))| t as f64 / w)
        .collect()
}

/// Runs both modes for `window` each (after a warm-up of a tenth of it, at most 2 s)
/// and fills the fairness keys of `l`.
pub async fn measure(l: &mut Line, window: Duration) -> Result<(), String> {
    let warmup = (window / 10).min(Duration::from_secs(2));
    let vtc = run_once("vtc", warmup, window).await?;
    let fifo = run_once("fifo", warmup, window).await?;
    let secs = window.as_secs_f64();
    let (v99, f99) = (pct_ms(&vtc.quiet, 0.99), pct_ms(&fifo.quiet, 0.99));
    l.num("quiet_p99_ms", v99)
        .num("quiet_p99_ms_fifo", f99)
        .num("quiet_p50_ms", pct_ms(&vtc.quiet, 0.5))
        .num("quiet_p50_ms_fifo", pct_ms(&fifo.quiet, 0.5))
        .num("quiet_p99_ratio", v99 / f99.max(f64::MIN_POSITIVE))
        .num("jain_index", jain(&weighted(&vtc.backlog_tokens)))
        .num("jain_index_fifo", jain(&weighted(&fifo.backlog_tokens)))
        .num(
            "quiet_calls_per_s",
            vtc.quiet_calls as f64 / secs / QUIET as f64,
        )
        .num("noisy_calls_per_s", vtc.noisy_calls as f64 / secs)
        .num("noisy_calls_per_s_fifo", fifo.noisy_calls as f64 / secs)
        .num("fair_seconds", secs)
        .set(
            "backlog_tokens_per_weight",
            weighted(&vtc.backlog_tokens)
                .into_iter()
                .map(|v| (v / secs).round())
                .collect::<Vec<_>>(),
        )
        .set(
            "backlog_tokens_per_weight_fifo",
            weighted(&fifo.backlog_tokens)
                .into_iter()
                .map(|v| (v / secs).round())
                .collect::<Vec<_>>(),
        );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::jain;

    #[test]
    fn jain_is_one_when_equal_and_one_over_n_when_one_has_all() {
        assert!((jain(&[3.0, 3.0, 3.0, 3.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[5.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        assert!(jain(&[1.0, 2.0]) < 1.0);
    }
}

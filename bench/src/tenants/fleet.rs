//! `--scenario tenants`, part `fleet` (DESIGN §19 "One atomic step", issue 30): is a
//! tenant's budget exact across a fleet? `--hosts` sidecar daemons share one
//! throwaway redis-server (as `fleet` runs its hosts: real processes), each serving
//! `--workers` workers of this process on their own connections. `--tenant-count`
//! tenants have small budgets, in tokens (`tpd`) and in dollars (`usd_per_day`, on a
//! priced source). Half the calls go to [`HOT`] hot tenants (many concurrent calls
//! on one ledger, from every host), half to any tenant. Each call is one of:
//!
//! | share | what the worker does | what it really spent |
//! |---|---|---|
//! | 3 % | sends `StartTenant` and closes the connection without reading the reply | 0 |
//! | 70 % | `Finish`, success, usage below the estimate | its usage |
//! | 10 % | `Finish`, cancelled | 0 |
//! | 5 % | `Finish`, transient failure (server error) | 0 |
//! | 6 % | `EndCall` without a report (an abandoned stream) | its estimate |
//! | 6 % | closes the connection holding the permit (a killed worker) | its estimate |
//!
//! ("Really spent" for the last two is the worst case: the sidecar cannot know how
//! much of a cut stream the provider billed, so it charges the estimate.) After every
//! call ended and every connection closed, each tenant's shared ledger is read back
//! (`TenantStatus`): `max_tenant_overrun_ratio` is the largest spent ÷ limit over
//! tenants and both budgets, spent being the larger of what the bench knows was spent
//! and what the ledger charged; `leaked_holds` the reservations still in flight.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipc_protocol::{CallSpec, FailureKind, Outcome, Reply, Request, Usage};

use super::wire::Client;
use crate::context::tempdir;
use crate::target::{Backend, Redis, Sidecar};
use crate::{Line, Opts};

/// Hot tenants: half the calls go to one of them.
const HOT: u64 = 16;
/// Every call's estimate, input + output tokens.
const EST: u64 = 100;
/// Tokens per UTC day of every tenant.
const TPD: u64 = 4000;
/// Dollars per UTC day of every tenant, n$ ($0.01).
const USD_DAY_N: u64 = 10_000_000;
/// The source's prices: n$ per input token ($1 per million) and per output token
/// ($5 per million).
const N_IN: u64 = 1000;
const N_OUT: u64 = 5000;

/// The scope every host adds to the bench configuration.
fn scope() -> String {
    format!(
        "[scopes.tn]\ncircuit_open = \"fail_fast\"\nquota_full = \"fail_fast\"\n\
         [scopes.tn.pacer]\ninitial = 100000\nmin = 1\nmax = 100000\n\
         [scopes.tn.tenants]\ndefault = {{ tpd = {TPD}, usd_per_day = {} }}\n\
         [[scopes.tn.sources]]\nname = \"tn-up\"\ntpm = 1000000000000\n\
         rpm = 1000000000000\ntimeout = \"60s\"\nusd_per_1m_input = {}\n\
         usd_per_1m_output = {}\n",
        USD_DAY_N as f64 / 1e9,
        N_IN as f64 / 1000.0,
        N_OUT as f64 / 1000.0,
    )
}

/// xorshift64*: enough randomness for a load, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) % n.max(1)
    }
}

/// What one worker saw, per tenant and in all.
#[derive(Default, Clone)]
struct Tally {
    /// Per tenant: tokens and n$ really spent (table above).
    tokens: Vec<u64>,
    usd: Vec<u64>,
    /// Calls started (a permit granted), refused by a tenant limit, failed otherwise.
    granted: u64,
    refused: u64,
    /// Per tenant: refused at least once.
    refused_tenant: Vec<bool>,
    errors: u64,
    /// The first unexpected error, for the line.
    first_error: Option<String>,
    /// Connections closed on purpose (pending or holding a permit).
    closed: u64,
    /// Calls ended without a report.
    abandoned: u64,
}

impl Tally {
    fn new(tenants: usize) -> Tally {
        Tally {
            tokens: vec![0; tenants],
            usd: vec![0; tenants],
            refused_tenant: vec![false; tenants],
            ..Tally::default()
        }
    }

    fn add(&mut self, o: &Tally) {
        for i in 0..self.tokens.len() {
            self.tokens[i] += o.tokens[i];
            self.usd[i] += o.usd[i];
            self.refused_tenant[i] |= o.refused_tenant[i];
        }
        self.granted += o.granted;
        self.refused += o.refused;
        self.errors += o.errors;
        self.closed += o.closed;
        self.abandoned += o.abandoned;
        if self.first_error.is_none() {
            self.first_error = o.first_error.clone();
        }
    }
}

fn tenant_id(i: u64) -> String {
    format!("t{i}")
}

/// One worker on `socket` until `deadline`.
async fn worker(
    socket: &Path,
    seed: u64,
    tenants: u64,
    deadline: Instant,
) -> Result<Tally, String> {
    let mut rng = Rng::new(seed);
    let mut t = Tally::new(tenants as usize);
    let mut c = Client::connect(socket).await?;
    while Instant::now() < deadline {
        let i = if rng.below(2) == 0 {
            rng.below(HOT.min(tenants))
        } else {
            rng.below(tenants)
        };
        let est_in = 10 + rng.below(81);
        let est_out = EST - est_in;
        let start = Request::StartTenant {
            spec: CallSpec {
                scope: "tn".into(),
                est_tokens: None,
                priority: None,
                est_input_tokens: Some(est_in),
                est_output_tokens: Some(est_out),
            },
            tenant: tenant_id(i),
        };
        let action = rng.below(100);
        if action < 3 {
            c.send(start).await?;
            t.closed += 1;
            c = Client::connect(socket).await?;
            continue;
        }
        let (call, permit) = match c.ask(start).await? {
            Reply::Started { call, permit, .. } => (call, permit),
            Reply::TenantLimited(_) => {
                t.refused += 1;
                t.refused_tenant[i as usize] = true;
                continue;
            }
            other => {
                t.errors += 1;
                t.first_error.get_or_insert(format!("{other:?}"));
                continue;
            }
        };
        t.granted += 1;
        // The upstream call.
        let wait = rng.below(3);
        if wait > 0 {
            tokio::time::sleep(Duration::from_millis(wait)).await;
        }
        let (spent_tokens, spent_usd) = if action < 73 {
            let (u_in, u_out) = (
                est_in / 2 + rng.below(est_in / 2 + 1),
                rng.below(est_out + 1),
            );
            let usage = Usage {
                tokens: None,
                input_tokens: Some(u_in),
                output_tokens: Some(u_out),
            };
            finish(
                &mut c,
                permit,
                Outcome::SuccessUsage {
                    usage,
                    count_attempt: true,
                },
                &mut t,
            )
            .await?;
            (u_in + u_out, u_in * N_IN + u_out * N_OUT)
        } else if action < 83 {
            finish(&mut c, permit, Outcome::Cancelled, &mut t).await?;
            (0, 0)
        } else if action < 88 {
            let kind = FailureKind::ServerError;
            finish(&mut c, permit, Outcome::Failure { kind }, &mut t).await?;
            (0, 0)
        } else if action < 94 {
            match c.ask(Request::EndCall { call }).await? {
                Reply::Ok => {}
                other => {
                    t.errors += 1;
                    t.first_error.get_or_insert(format!("EndCall: {other:?}"));
                }
            }
            t.abandoned += 1;
            (EST, est_in * N_IN + est_out * N_OUT)
        } else {
            t.closed += 1;
            c = Client::connect(socket).await?;
            (EST, est_in * N_IN + est_out * N_OUT)
        };
        t.tokens[i as usize] += spent_tokens;
        t.usd[i as usize] += spent_usd;
    }
    Ok(t)
}

async fn finish(
    c: &mut Client,
    permit: u64,
    outcome: Outcome,
    t: &mut Tally,
) -> Result<(), String> {
    match c.ask(Request::Finish { permit, outcome }).await? {
        Reply::Reported { .. } => {}
        other => {
            t.errors += 1;
            t.first_error.get_or_insert(format!("Finish: {other:?}"));
        }
    }
    Ok(())
}

/// One tenant's ledger as `TenantStatus` shows it: (tokens left in `tpd`, n$ spent
/// today, reservations in flight); `None`: never charged.
async fn ledger(c: &mut Client, tenant: &str) -> Result<Option<(f64, u64, u64)>, String> {
    let doc = match c
        .ask(Request::TenantStatus {
            scope: Some("tn".into()),
            tenant: tenant.into(),
        })
        .await?
    {
        Reply::StatusJson(s) => s,
        other => return Err(format!("TenantStatus answered {other:?}")),
    };
    let v: serde_json::Value = serde_json::from_str(&doc).map_err(|e| e.to_string())?;
    let s = &v["scopes"]["tn"];
    if let Some(e) = s["ledger_error"].as_str() {
        return Err(format!("ledger of {tenant}: {e}"));
    }
    let l = &s["ledger"];
    if l.is_null() {
        return Ok(None);
    }
    let level = l["levels"]["tpd"]
        .as_f64()
        .ok_or_else(|| format!("ledger of {tenant} without a tpd level: {doc}"))?;
    let usd = l["usd_spent_day"].as_f64().unwrap_or(0.0);
    let in_flight = l["in_flight"].as_u64().unwrap_or(0);
    Ok(Some((level, (usd * 1e9).round() as u64, in_flight)))
}

/// Every tenant's ledger: (tokens charged, n$ charged, in flight) each. The `tpd`
/// bucket refills a day's worth per day: the tokens charged are the limit plus its
/// refill since `t0` (before any charge), as of the moment each ledger is read, less
/// its level.
async fn ledgers(
    c: &mut Client,
    tenants: u64,
    t0: Instant,
) -> Result<Vec<(f64, u64, u64)>, String> {
    let mut out = Vec::with_capacity(tenants as usize);
    for i in 0..tenants {
        let read = ledger(c, &tenant_id(i)).await?;
        let refill = TPD as f64 * t0.elapsed().as_secs_f64() / 86_400.0;
        out.push(match read {
            None => (0.0, 0, 0),
            Some((level, usd, fl)) => ((TPD as f64 + refill - level).max(0.0), usd, fl),
        });
    }
    Ok(out)
}

/// Runs the fleet for `window` and fills the fleet keys of `l`.
pub async fn measure(
    l: &mut Line,
    opts: &Opts,
    tenants: u64,
    window: Duration,
) -> Result<(), String> {
    let dirs: Vec<_> = (0..opts.fleet.hosts.max(1))
        .map(|_| tempdir())
        .collect::<Result<_, _>>()?;
    let redis = Redis::start(dirs[0].path())?;
    let backend = Backend::Redis(redis.url.clone());
    let hosts: Vec<Sidecar> = dirs
        .iter()
        .map(|d| Sidecar::start_with(&opts.sidecar_bin, d.path(), &backend, &scope()))
        .collect::<Result<_, _>>()?;
    let day0 = wall_day();
    let t0 = Instant::now();
    let deadline = t0 + window;
    let mut tasks = Vec::new();
    for (h, sc) in hosts.iter().enumerate() {
        for w in 0..opts.fleet.workers.max(1) {
            let socket: Arc<Path> = sc.socket.as_path().into();
            let seed = (h * 1000 + w + 1) as u64;
            tasks.push(tokio::spawn(async move {
                worker(&socket, seed, tenants, deadline).await
            }));
        }
    }
    let mut all = Tally::new(tenants as usize);
    for task in tasks {
        all.add(&task.await.map_err(|e| e.to_string())??);
    }
    let ran = t0.elapsed();
    // Every call has ended and every worker's connection is closed: the hosts settle
    // what was abandoned as they see the connections go. Read until nothing is in
    // flight (or 5 s have passed).
    let mut c = Client::connect(&hosts[0].socket).await?;
    let settle0 = Instant::now();
    let mut read = ledgers(&mut c, tenants, t0).await?;
    while read.iter().map(|r| r.2).sum::<u64>() > 0 && settle0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        read = ledgers(&mut c, tenants, t0).await?;
    }
    let settle = settle0.elapsed();
    let refill = TPD as f64 * t0.elapsed().as_secs_f64() / 86_400.0;
    let (mut over, mut short_tokens, mut short_usd) = (0.0f64, 0.0f64, 0i64);
    let mut over_tokens = 0.0f64;
    let mut over_usd = 0.0f64;
    for (i, &(tok, usd, _)) in read.iter().enumerate() {
        let truth = (all.tokens[i] as f64, all.usd[i]);
        let t = truth.0.max(tok) / (TPD as f64 + refill);
        let d = truth.1.max(usd) as f64 / USD_DAY_N as f64;
        over_tokens = over_tokens.max(t);
        over_usd = over_usd.max(d);
        over = over.max(t).max(d);
        short_tokens = short_tokens.max(truth.0 - tok);
        short_usd = short_usd.max(truth.1 as i64 - usd as i64);
    }
    let secs = ran.as_secs_f64();
    l.num("max_tenant_overrun_ratio", over)
        .num("max_tenant_overrun_ratio_tokens", over_tokens)
        .num("max_tenant_overrun_ratio_usd", over_usd)
        .set("leaked_holds", read.iter().map(|r| r.2).sum::<u64>())
        .num("settle_ms", settle.as_secs_f64() * 1e3)
        .num("ledger_shortfall_tokens", short_tokens.max(0.0))
        .num("ledger_shortfall_usd", short_usd.max(0) as f64 / 1e9)
        .set("fleet_hosts", hosts.len())
        .set("fleet_workers", opts.fleet.workers.max(1))
        .set("fleet_tenants", tenants)
        .num("fleet_seconds", secs)
        .num(
            "fleet_calls_per_s",
            (all.granted + all.refused) as f64 / secs,
        )
        .set("calls_granted", all.granted)
        .set("calls_refused", all.refused)
        .set(
            "tenants_refused",
            all.refused_tenant.iter().filter(|r| **r).count(),
        )
        .set("calls_abandoned", all.abandoned)
        .set("connections_closed", all.closed)
        .set("calls_failed", all.errors)
        .set("day_changed", wall_day() != day0);
    if let Some(e) = all.first_error {
        l.set("first_failure", e);
    }
    Ok(())
}

/// The UTC day now (a dollar budget's window: a run across midnight is void).
fn wall_day() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400)
}

//! `--scenario tenants` (DESIGN §19, issue 30): one JSON line with three parts, each
//! runnable alone (`--tenant-parts fairness,fleet,cost`):
//!
//! - [`fair`]: quiet tenants' waits beside a noisy one with fair turns (VTC) and in
//!   arrival order, in process (`quiet_p99_ratio`, `jain_index`);
//! - [`fleet`]: tenants' budgets across sidecars sharing Redis, under cancels and
//!   aborted calls (`max_tenant_overrun_ratio`, `leaked_holds`);
//! - [`cost`]: what a tenant adds to a call, on memory and on Redis
//!   (`cost_ratio_memory`, `cost_ratio_redis`, Redis commands per call).
//!
//! A part not run leaves its keys `null`.

mod cost;
mod fair;
mod fleet;
mod wire;

use crate::context::Ctx;
use crate::{Line, Scenario};

/// The parts of the scenario.
pub const PARTS: [&str; 3] = ["fairness", "fleet", "cost"];

pub fn run(ctx: &mut Ctx) -> Result<Vec<Line>, String> {
    let opts = ctx.opts;
    let t = &opts.tenants;
    if let Some(p) = t.parts.iter().find(|p| !PARTS.contains(&p.as_str())) {
        return Err(format!(
            "--tenant-parts: unknown part {p:?} (parts: {})",
            PARTS.join(", ")
        ));
    }
    let wants = |p: &str| t.parts.iter().any(|x| x == p);
    let mut l = Line::new(Scenario::Tenants);
    ctx.rt.block_on(async {
        if wants("fairness") {
            fair::measure(&mut l, t.fair_window()).await?;
        }
        if wants("fleet") {
            fleet::measure(&mut l, opts, t.count, t.exact_window()).await?;
        }
        if wants("cost") {
            cost::measure(&mut l, opts).await?;
        }
        Ok::<_, String>(())
    })?;
    Ok(vec![l])
}

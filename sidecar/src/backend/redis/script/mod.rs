//! The one Lua script (`gate.lua`) and its operations, each with named arguments
//! (§6, §7, §10).
//!
//! # How it runs
//!
//! Every operation is one call of `gate.lua` (dispatching on its op name). The same
//! text serves two ways ([`Gate`]):
//! - as a **Redis Function** (Redis ≥ 7): the library `polygate_<hash>` registering
//!   the function of the same name, called with `FCALL`. The hash is the script's
//!   SHA-1 prefix, so two sidecar versions sharing a Redis (a rolling upgrade) each
//!   call their own code. On `Function not found` (a restart without persistence, a
//!   `FUNCTION FLUSH`, a new cluster node) the library is loaded (`FUNCTION LOAD
//!   REPLACE`, to every primary of a cluster) and the call retried once. Functions
//!   were measured cheaper than `EVALSHA` of the same text on Redis 7.0 (a script
//!   chunk rebuilds its closures on every call; a library builds them once).
//! - as a **script** (`EVALSHA`, with `SCRIPT LOAD` + retry on `NOSCRIPT`), when the
//!   server does not know `FCALL` (Redis < 7): the connection then stays on scripts.
//!
//! The combined hot-path operations are one call each: `AdmitArgs` = reserve +
//! try_enter (a breaker refusal takes nothing), `ReportArgs` = settle + verdict (+ the
//! 429 block). Every clock reading inside is one `redis.call('TIME')` per call (never
//! a host clock; Redis ≥ 5 replicates effects, so TIME followed by writes is fine).
//!
//! A source has two keys, both passed as keys and hash-tagged into one slot so Redis
//! Cluster routes the call by its first key: `{<prefix>:<source>}:b` (breaker hash)
//! and `{<prefix>:<source>}:q` (quota hash). §19: a tenant's ledger is
//! `{<prefix>:t:<scope>:<tenant>}` ([`tenant_key`]: `t#<length>:` for a scope whose
//! name has `:`), in a slot of its own: on one server it is the
//! third key of the source's admit and report; on a Redis Cluster the tenant ops run
//! on it alone ([`tenant_invocation`]).
//!
//! # Expiry and the epoch
//!
//! `gate.lua`'s header ("Expiry") is the rule: the breaker hash keeps no TTL while it
//! holds state the memory backend would still remember (OPEN, HALF_OPEN, a streak),
//! and once it reads as fresh it expires no sooner than `ttl_basis` (in `argv`)
//! after its level has decayed and after its last grant — so it comes back as the
//! memory backend's would (k = 0), with epoch 0, which no live permit carries. The
//! quota hash expires once it reads as full and unblocked. Neither expiry is
//! refreshed per call: the script keeps the deadline it set in the hash and moves
//! it only when it must.
//! `reset` bumps the epoch in place (it never deletes the breaker hash).
//!
//! # The module
//!
//! This module holds the script and how one call of it is built and run ([`Gate`],
//! [`Call`], [`Op`]); the argument layout is `argv` (its header: "Arguments"), the
//! reading of replies `reply`; both are re-exported here.

mod argv;
mod reply;

use std::sync::LazyLock;
use std::time::Duration;

use ::redis::{Cmd, Script, Value};

#[cfg(test)]
pub(super) use argv::SLOTS;
pub(super) use argv::{with_host, Announce, Argv, Slot, TenantSlots, TSLOTS};
pub(super) use reply::{
    applied, bool_at, dur_at, int_at, level_at, level_or_none, proto, state_at, u64_at,
};

use super::reach::Seen;
use crate::backend::{AdmittedRate, Applied, BResult, SeenCut};

/// `gate.lua`, ready to run either way.
pub(super) struct Gate {
    /// The script form (EVALSHA, with NOSCRIPT reload), for Redis < 7.
    pub script: Script,
    /// The function's (and its library's) name: `polygate_<SHA-1 prefix>`.
    pub function: String,
    /// `FUNCTION LOAD REPLACE` text of the library registering [`Gate::function`].
    pub library: String,
}

/// The last line of `gate.lua`: the script form's entry point.
const SCRIPT_ENTRY: &str = "return gate(KEYS, ARGV)\n";

impl Gate {
    fn new(text: &str) -> Gate {
        let script = Script::new(text);
        let function = format!("polygate_{}", &script.get_hash()[..16]);
        let body = text
            .strip_suffix(SCRIPT_ENTRY)
            .expect("gate.lua ends with its script entry point");
        let library =
            format!("#!lua name={function}\n{body}redis.register_function('{function}', gate)\n");
        Gate {
            script,
            function,
            library,
        }
    }
}

/// The one script; every operation dispatches on its op name (`ARGV[1]`).
pub(super) static GATE: LazyLock<Gate> = LazyLock::new(|| Gate::new(include_str!("../gate.lua")));

/// The breaker key of `source`.
pub(super) fn breaker_key(prefix: &str, source: &str) -> String {
    format!("{{{prefix}:{source}}}:b")
}

/// The quota key of `source`.
pub(super) fn quota_key(prefix: &str, source: &str) -> String {
    format!("{{{prefix}:{source}}}:q")
}

/// A source's two keys (breaker, quota), built once per configured source: a call
/// borrows them instead of formatting them again.
pub(super) fn keys(prefix: &str, source: &str) -> [String; 2] {
    [breaker_key(prefix, source), quota_key(prefix, source)]
}

/// The tenant ledger's key of `tenant` in `scope` (§19): its own hash tag, so on a
/// Redis Cluster it lives in its own slot (the tenant ops run on it alone there).
/// One key per (scope, tenant), whatever their bytes: `{prefix:t:<scope>:<tenant>}`
/// for a scope without `:` (the scope is what precedes the first `:`), and
/// `{prefix:t#<bytes of scope>:<scope>:<tenant>}` for one with it, so tenant `b:c` of
/// scope `a` and tenant `c` of scope `a:b` never share a ledger.
pub(super) fn tenant_key(prefix: &str, scope: &str, tenant: &str) -> String {
    if scope.contains(':') {
        format!("{{{prefix}:t#{}:{scope}:{tenant}}}", scope.len())
    } else {
        format!("{{{prefix}:t:{scope}:{tenant}}}")
    }
}

/// One call of `gate.lua`: its keys (a source's two, plus its call's tenant ledger on
/// one server; or a tenant ledger alone) and its arguments.
pub(super) struct Call<'a> {
    /// The keys, the first `n` of these: breaker key, then quota key (one slot), then
    /// the tenant's; or the tenant's alone.
    keys: [&'a str; 3],
    /// How many of `keys` the call passes.
    n: usize,
    /// ARGV, `op` first, written into the command as they are (integers as decimal
    /// text, with no string of their own).
    pub args: Vec<Slot<'a>>,
    /// §19: the tenant's slots, sent after `args` by a call with its tenant ledger
    /// (empty otherwise).
    tenant: Option<[Slot<'a>; TSLOTS.len()]>,
}

impl Call<'_> {
    /// The keys the call passes.
    fn keys(&self) -> &[&str] {
        &self.keys[..self.n]
    }

    /// `FCALL polygate_<hash> <n> <keys> <args>`, in one buffer sized up front.
    pub(super) fn fcall(&self) -> Cmd {
        let n = self.args.len() + self.tenant_args().len();
        let mut c = Cmd::with_capacity(6 + n, 160 + 12 * n);
        c.arg("FCALL").arg(GATE.function.as_str()).arg(self.n);
        for k in self.keys() {
            c.arg(*k);
        }
        for a in self.args.iter().chain(self.tenant_args()) {
            c.arg(a);
        }
        c
    }

    /// The tenant's slots this call sends after `args` (none without its ledger).
    fn tenant_args(&self) -> &[Slot<'_>] {
        self.tenant.as_ref().map_or(&[], |t| &t[..])
    }

    /// The same as an `EVALSHA` invocation.
    pub(super) fn script(&self) -> ::redis::ScriptInvocation<'static> {
        let mut inv = GATE.script.prepare_invoke();
        for k in self.keys() {
            inv.key(*k);
        }
        for a in self.args.iter().chain(self.tenant_args()) {
            inv.arg(a);
        }
        inv
    }
}

/// One call of `op` on a source whose keys are `keys`, ready to send.
pub(super) fn invocation<'a, O: Op>(keys: &'a [String; 2], op: &'a O) -> Call<'a> {
    Call {
        keys: [keys[0].as_str(), keys[1].as_str(), ""],
        n: 2,
        args: op.argv().slots(O::NAME),
        tenant: None,
    }
}

/// The same with the call's tenant ledger as a third key (§19, one server).
pub(super) fn invocation_with<'a, O: Op>(
    keys: &'a [String; 2],
    tenant: &'a str,
    op: &'a O,
) -> Call<'a> {
    let argv = op.argv();
    Call {
        keys: [keys[0].as_str(), keys[1].as_str(), tenant],
        n: 3,
        args: argv.slots(O::NAME),
        tenant: Some(argv.tenant_slots()),
    }
}

/// One call of a tenant op on the ledger `tenant` alone (§19, a Redis Cluster).
pub(super) fn tenant_invocation<'a, O: Op>(tenant: &'a str, op: &'a O) -> Call<'a> {
    let argv = op.argv();
    Call {
        keys: [tenant, "", ""],
        n: 1,
        args: argv.slots(O::NAME),
        tenant: Some(argv.tenant_slots()),
    }
}

/// One operation of `gate.lua`: its name, its arguments, and what its reply means.
pub(super) trait Op {
    /// The op name the script dispatches on (`ARGV[1]`).
    const NAME: &'static str;
    /// The reply, read.
    type Reply;
    /// The slots this operation fills.
    fn argv(&self) -> Argv<'_>;
    /// Read the script's reply.
    fn read(v: &[Value]) -> BResult<Self::Reply>;
    /// What the reply says of the source's shared state (§10: remembered for the
    /// local fallback). Nothing by default.
    fn seen(&self, _reply: &Self::Reply) -> Seen {
        Seen::default()
    }
    /// §18 `learn_rate` (§10): the learned factor in force the reply carries (ppm;
    /// `None`: the op carries none, or the source does not learn).
    fn factor(&self, _v: &[Value]) -> Option<u32> {
        None
    }
}

/// The factor a reply of admit or report carries as its element 7 (`gate.lua`
/// `with_factor`), when the source learns.
pub(super) fn factor_at(v: &[Value]) -> Option<u32> {
    if v.len() < 7 {
        return None;
    }
    int_at(v, 6).ok().map(|f| f.clamp(0, 1_000_000) as u32)
}

/// What an admit reply says its reservation was taken at (§18 `learn_rate`): the
/// factor (element 7) and the last cut's date (element 8, µs on Redis's clock; 0 =
/// none); [`AdmittedRate::WHOLE`] when the source does not learn.
pub(super) fn admitted_rate_at(v: &[Value]) -> AdmittedRate {
    match factor_at(v) {
        None => AdmittedRate::WHOLE,
        Some(ppm) => AdmittedRate {
            ppm,
            cut: match int_at(v, 7) {
                Ok(at) if at > 0 => SeenCut::At(Duration::from_micros(at as u64)),
                _ => SeenCut::None,
            },
        },
    }
}

/// What an [`Applied`] says of the breaker.
pub(super) fn seen_applied(a: &Applied) -> Seen {
    Seen {
        breaker: Some((a.state, a.retry_after)),
        quota: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_key_is_one_per_scope_and_tenant_whatever_their_bytes() {
        assert_eq!(tenant_key("p", "chat", "acme"), "{p:t:chat:acme}");
        let names = [
            "a", "a:b", "b:c", "c", "", ":", "a:", ":b", "1:a", "t#1", "}{",
        ];
        let mut seen = std::collections::HashMap::new();
        for scope in names {
            for tenant in names {
                let k = tenant_key("p", scope, tenant);
                if let Some(other) = seen.insert(k.clone(), (scope, tenant)) {
                    panic!("{k} is both {other:?} and {:?}", (scope, tenant));
                }
            }
        }
    }

    #[test]
    fn gate_lua_caps_a_block_like_the_memory_backend() {
        let us = crate::gate::quota::MAX_QUOTA_BLOCK.as_micros();
        assert_eq!(us, 7 * 24 * 3600 * 1_000_000);
        assert!(include_str!("../gate.lua").contains("local QMAX_BLOCK = 7 * 24 * 3600 * 1000000"));
    }

    #[test]
    fn the_function_library_is_the_script_registered_under_a_versioned_name() {
        let g = &*GATE;
        assert!(g.function.starts_with("polygate_") && g.function.len() == 25);
        assert!(g
            .library
            .starts_with(&format!("#!lua name={}\n", g.function)));
        assert!(g.library.ends_with(&format!(
            "redis.register_function('{}', gate)\n",
            g.function
        )));
        assert!(!g.library.contains(SCRIPT_ENTRY));
    }
}

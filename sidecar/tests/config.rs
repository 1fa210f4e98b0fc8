//! Config parsing and validation (§12, §12a): the shipped example, defaults, every
//! class of bad value, environment overrides, cross-scope quota conflicts.

use std::time::Duration;

use polygate::config::{load_file, parse_str, ConfigError, EXAMPLE_CONFIG};
use polygate::config::{
    BackendKind, BreakerConfig, Config, Mode, OnBackendError, PacerConfig, Selector, SidecarConfig,
    DEFAULT_MAX_ATTEMPTS, DEFAULT_POLL_INTERVAL, DEFAULT_SOURCE_TIMEOUT, DEFAULT_STALL_WINDOW,
};

const MINIMAL: &str = r#"
[[scopes.chat.sources]]
name = "a"
"#;

fn no_env() -> Vec<(String, String)> {
    Vec::new()
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn parse(toml: &str) -> Result<Config, ConfigError> {
    parse_str(toml, no_env())
}

/// Parses and expects an error whose message contains every needle.
fn err(toml: &str, needles: &[&str]) -> String {
    err_env(toml, &[], needles)
}

fn err_env(toml: &str, vars: &[(&str, &str)], needles: &[&str]) -> String {
    let msg = match parse_str(toml, env(vars)) {
        Ok(c) => panic!("expected an error containing {needles:?}, got {c:#?}"),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} lacks {n:?}");
    }
    msg
}

/// MINIMAL with `line` added to the `[scopes.chat]` table.
fn scope_with(line: &str) -> String {
    format!("[scopes.chat]\n{line}\n{MINIMAL}")
}

fn breaker_with(line: &str) -> String {
    format!("[scopes.chat.breaker]\n{line}\n{MINIMAL}")
}

fn pacer_with(line: &str) -> String {
    format!("[scopes.chat.pacer]\n{line}\n{MINIMAL}")
}

fn sidecar_with(line: &str) -> String {
    format!("[sidecar]\n{line}\n{MINIMAL}")
}

fn source_with(line: &str) -> String {
    format!("[[scopes.chat.sources]]\nname = \"a\"\n{line}\n")
}

// ---------------------------------------------------------------------------------

#[test]
fn example_parses() {
    let c = parse_str(EXAMPLE_CONFIG, no_env()).unwrap();
    // The example leaves the socket unset: the default for whoever runs it.
    assert_eq!(Ok(c.sidecar.socket), polygate::config::default_socket());
    assert_eq!(c.sidecar.socket_mode, 0o660);
    assert_eq!(c.sidecar.backend, BackendKind::Memory);
    let names: Vec<&str> = c.scopes.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["chat", "embedding"], "scopes keep config order");
    let chat = &c.scopes[0];
    assert!((2..=3).contains(&chat.sources.len()));
    assert_eq!(chat.quota_full, Mode::Wait);
    assert_eq!(chat.circuit_open, Mode::FailFast);
    assert_eq!(chat.breaker.max_cooldown, Duration::from_secs(600));
    assert_eq!(chat.sources[0].name, "openai-gpt4o");
    assert_eq!(chat.sources[0].tpm, Some(30000));
    assert_eq!(chat.sources[0].est_tokens, Some(1000));
    let emb = &c.scopes[1];
    assert_eq!(emb.sources.len(), 2);
    assert_eq!(emb.selector, Selector::Health);
    assert_eq!(emb.circuit_open, Mode::Wait);
}

#[test]
fn example_loads_from_file() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/polygate.toml");
    let c = load_file(std::path::Path::new(path), no_env()).unwrap();
    assert_eq!(c, parse(EXAMPLE_CONFIG).unwrap());
}

#[test]
fn missing_file_names_the_path() {
    let e = load_file(std::path::Path::new("/nonexistent/polygate.toml"), no_env()).unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }));
    assert_eq!(
        e.to_string(),
        "config file /nonexistent/polygate.toml not found"
    );
}

#[test]
fn defaults_fill_everything_but_sources() {
    let c = parse(MINIMAL).unwrap();
    assert_eq!(c.sidecar, SidecarConfig::default());
    assert_eq!(c.scopes.len(), 1);
    let s = &c.scopes[0];
    assert_eq!(s.name, "chat");
    assert_eq!(s.quota_full, Mode::Wait);
    assert_eq!(s.circuit_open, Mode::FailFast);
    assert_eq!(s.selector, Selector::Priority);
    assert_eq!(s.max_attempts, DEFAULT_MAX_ATTEMPTS);
    assert_eq!(s.poll_interval, DEFAULT_POLL_INTERVAL);
    assert_eq!(s.stall_window, DEFAULT_STALL_WINDOW);
    assert_eq!(s.breaker, BreakerConfig::default());
    assert_eq!(s.pacer, PacerConfig::default());
    let src = &s.sources[0];
    assert_eq!(src.name, "a");
    assert_eq!((src.tpm, src.rpm, src.est_tokens), (None, None, None));
    assert_eq!(src.timeout, DEFAULT_SOURCE_TIMEOUT);
}

#[test]
fn values_are_read() {
    let c = parse(
        r#"
[sidecar]
socket = "/tmp/pg.sock"
socket_mode = "0600"
allowed_uids = [1000]
allowed_gids = [990, 991]
admin_uids = [0, 1000]
backend = "redis"
redis_url = "redis://10.0.0.1:6380/2"
redis_cluster_nodes = ["redis://a:1", "redis://b:2"]
key_prefix = "pg"
on_backend_error = "fail_closed"
redis_timeout = "100ms"
max_frame = 1048576
shutdown_grace = "2s"

[scopes.x]
quota_full = "fail_fast"
circuit_open = "wait"
max_attempts = 7
poll_interval = "5ms"
stall_window = "1m"
selector = "health"
breaker = { failure_threshold = 2, failure_rate = 1, min_calls = 1, window = "10s", cooldown = "1s", max_cooldown = "1s" }
pacer = { initial = 2, min = 1.5, max = 2, increase = 0.25, decrease = 0.9 }

[[scopes.x.sources]]
name = "s"
tpm = 100
rpm = 7
est_tokens = 3
timeout = "250ms"
"#,
    )
    .unwrap();
    let sc = &c.sidecar;
    assert_eq!(sc.socket, "/tmp/pg.sock");
    assert_eq!(sc.socket_mode, 0o600);
    assert_eq!(sc.allowed_uids, [1000]);
    assert_eq!(sc.allowed_gids, [990, 991]);
    assert_eq!(sc.admin_uids, [0, 1000]);
    assert_eq!(sc.backend, BackendKind::Redis);
    assert_eq!(sc.redis_url, "redis://10.0.0.1:6380/2");
    assert_eq!(sc.redis_cluster_nodes, ["redis://a:1", "redis://b:2"]);
    assert_eq!(sc.key_prefix, "pg");
    assert_eq!(sc.on_backend_error, OnBackendError::FailClosed);
    assert_eq!(sc.redis_timeout, Duration::from_millis(100));
    assert_eq!(sc.max_frame, 1 << 20);
    assert_eq!(sc.shutdown_grace, Duration::from_secs(2));
    let s = &c.scopes[0];
    assert_eq!(s.quota_full, Mode::FailFast);
    assert_eq!(s.circuit_open, Mode::Wait);
    assert_eq!(s.max_attempts, 7);
    assert_eq!(s.poll_interval, Duration::from_millis(5));
    assert_eq!(s.stall_window, Duration::from_secs(60));
    assert_eq!(s.selector, Selector::Health);
    assert_eq!(
        s.breaker,
        BreakerConfig {
            failure_threshold: 2,
            failure_rate: 1.0,
            min_calls: 1,
            window: Duration::from_secs(10),
            cooldown: Duration::from_secs(1),
            max_cooldown: Duration::from_secs(1),
        }
    );
    assert_eq!(
        s.pacer,
        PacerConfig {
            initial: 2.0,
            min: 1.5,
            max: 2.0,
            increase: 0.25,
            decrease: 0.9,
        }
    );
    let src = &s.sources[0];
    assert_eq!(
        (src.tpm, src.rpm, src.est_tokens),
        (Some(100), Some(7), Some(3))
    );
    assert_eq!(src.timeout, Duration::from_millis(250));
}

#[test]
fn scopes_keep_config_order() {
    let c = parse(
        "[[scopes.zeta.sources]]\nname='a'\n[[scopes.alpha.sources]]\nname='b'\n\
         [[scopes.mid.sources]]\nname='c'\n",
    )
    .unwrap();
    let names: Vec<&str> = c.scopes.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["zeta", "alpha", "mid"]);
}

// ---------------------------------------------------------------------------------
// Bad values: each names the full key, the value, and the allowed values.

#[test]
fn bad_enums_name_key_value_and_allowed_values() {
    err(
        &scope_with("quota_full = \"sometimes\""),
        &[
            "scopes.chat.quota_full",
            "sometimes",
            "expected one of: wait, fail_fast",
        ],
    );
    err(
        &scope_with("circuit_open = \"later\""),
        &[
            "scopes.chat.circuit_open",
            "later",
            "expected one of: wait, fail_fast",
        ],
    );
    err(
        &scope_with("selector = \"random\""),
        &[
            "scopes.chat.selector",
            "random",
            "expected one of: priority, health",
        ],
    );
    err(
        &sidecar_with("backend = \"etcd\""),
        &["sidecar.backend", "etcd", "expected one of: memory, redis"],
    );
    err(
        &sidecar_with("on_backend_error = \"panic\""),
        &[
            "sidecar.on_backend_error",
            "panic",
            "expected one of: local, fail_closed",
        ],
    );
}

#[test]
fn bad_counts() {
    err(
        &scope_with("max_attempts = 0"),
        &["scopes.chat.max_attempts = 0", "at least 1"],
    );
    err(
        &scope_with("max_attempts = -3"),
        &["scopes.chat.max_attempts", "at least 1"],
    );
    err(
        &breaker_with("failure_threshold = 0"),
        &["scopes.chat.breaker.failure_threshold = 0", "at least 1"],
    );
    err(
        &breaker_with("min_calls = 0"),
        &["scopes.chat.breaker.min_calls = 0", "at least 1"],
    );
    err(
        &scope_with("max_attempts = 99999999999"),
        &["scopes.chat.max_attempts", "at most"],
    );
}

#[test]
fn bad_failure_rate() {
    for v in ["0", "0.0", "1.5", "-0.1", "nan"] {
        err(
            &breaker_with(&format!("failure_rate = {v}")),
            &["scopes.chat.breaker.failure_rate", "(0, 1]"],
        );
    }
}

#[test]
fn bad_durations() {
    for key in ["window", "cooldown", "max_cooldown"] {
        err(
            &breaker_with(&format!("{key} = \"0s\"")),
            &[&format!("scopes.chat.breaker.{key}"), "greater than zero"],
        );
    }
    for key in ["poll_interval", "stall_window"] {
        err(
            &scope_with(&format!("{key} = \"0ms\"")),
            &[&format!("scopes.chat.{key}"), "greater than zero"],
        );
        err(
            &scope_with(&format!("{key} = \"soon\"")),
            &[
                &format!("scopes.chat.{key}"),
                "\"soon\"",
                "50ms, 30s or 10m",
            ],
        );
    }
    err(
        &source_with("timeout = \"0s\""),
        &["scopes.chat.sources[0].timeout", "greater than zero"],
    );
    err(
        &sidecar_with("redis_timeout = \"fast\""),
        &["sidecar.redis_timeout", "fast", "duration"],
    );
    err(
        &sidecar_with("shutdown_grace = \"0s\""),
        &["sidecar.shutdown_grace", "greater than zero"],
    );
    // A bare number is not a duration (the unit is required).
    err(
        &scope_with("poll_interval = \"50\""),
        &["scopes.chat.poll_interval"],
    );
    // Wrong TOML type: the key path and the line are named.
    err(
        &scope_with("poll_interval = 50"),
        &["scopes.chat.poll_interval", "line 2"],
    );
}

#[test]
fn cooldown_must_not_exceed_max_cooldown() {
    err(
        &breaker_with("cooldown = \"20m\"\nmax_cooldown = \"10m\""),
        &[
            "scopes.chat.breaker.cooldown",
            "scopes.chat.breaker.max_cooldown",
            "20m",
            "10m",
        ],
    );
}

#[test]
fn bad_pacer() {
    err(
        &pacer_with("min = 0.5\ninitial = 1"),
        &["scopes.chat.pacer.min", "at least 1"],
    );
    err(
        &pacer_with("min = 4\ninitial = 2\nmax = 8"),
        &[
            "scopes.chat.pacer.min",
            "scopes.chat.pacer.initial",
            "min <= initial <= max",
        ],
    );
    err(
        &pacer_with("initial = 100\nmax = 64"),
        &[
            "scopes.chat.pacer.initial",
            "scopes.chat.pacer.max",
            "initial = 100",
        ],
    );
    err(
        &pacer_with("increase = 0"),
        &["scopes.chat.pacer.increase", "greater than 0"],
    );
    err(
        &pacer_with("increase = -1"),
        &["scopes.chat.pacer.increase"],
    );
    for d in ["0", "1", "1.5", "-0.5"] {
        err(
            &pacer_with(&format!("decrease = {d}")),
            &["scopes.chat.pacer.decrease", "(0, 1)"],
        );
    }
    err(
        &pacer_with("max = inf"),
        &["scopes.chat.pacer.max", "finite"],
    );
}

#[test]
fn bad_sources() {
    err(
        "[scopes.chat]\nmax_attempts = 2\n",
        &["scopes.chat.sources", "at least one source"],
    );
    err(
        "[scopes.chat]\nsources = []\n",
        &["scopes.chat.sources", "at least one source"],
    );
    err(
        "[[scopes.chat.sources]]\ntpm = 5\n",
        &["scopes.chat.sources[0].name", "name"],
    );
    err(
        "[[scopes.chat.sources]]\nname = \"\"\n",
        &["scopes.chat.sources[0].name", "empty"],
    );
    err(
        "[[scopes.chat.sources]]\nname = \"a\"\n[[scopes.chat.sources]]\nname = \"b\"\n\
         [[scopes.chat.sources]]\nname = \"a\"\n",
        &["scopes.chat.sources[2].name", "\"a\"", "unique"],
    );
    for key in ["tpm", "rpm", "est_tokens"] {
        err(
            &source_with(&format!("{key} = 0")),
            &[
                &format!("scopes.chat.sources[0].{key} = 0"),
                "greater than zero",
            ],
        );
        err(
            &source_with(&format!("{key} = -5")),
            &[
                &format!("scopes.chat.sources[0].{key}"),
                "greater than zero",
            ],
        );
    }
}

#[test]
fn bad_sidecar_values() {
    for v in ["600", "0660"] {
        // Both octal spellings are fine.
        let c = parse(&sidecar_with(&format!("socket_mode = \"{v}\""))).unwrap();
        assert_eq!(c.sidecar.socket_mode, u32::from_str_radix(v, 8).unwrap());
    }
    err(
        &sidecar_with("socket_mode = \"0999\""),
        &["sidecar.socket_mode", "0999", "octal"],
    );
    err(
        &sidecar_with("socket_mode = \"01777\""),
        &["sidecar.socket_mode", "octal"],
    );
    err(&sidecar_with("socket_mode = 660"), &["sidecar.socket_mode"]);
    err(
        &sidecar_with("max_frame = 1023"),
        &["sidecar.max_frame = 1023", "1024", "16777216"],
    );
    err(
        &sidecar_with("max_frame = 16777217"),
        &["sidecar.max_frame", "16777216"],
    );
    parse(&sidecar_with("max_frame = 1024")).unwrap();
    parse(&sidecar_with("max_frame = 16777216")).unwrap();
    err(&sidecar_with("socket = \"\""), &["sidecar.socket", "empty"]);
    err(
        &sidecar_with(&format!("socket = \"/{}\"", "x".repeat(120))),
        &["sidecar.socket", "at most"],
    );
    err(
        &sidecar_with("key_prefix = \"\""),
        &["sidecar.key_prefix", "empty"],
    );
    err(
        &sidecar_with("key_prefix = \"{pg}\""),
        &["sidecar.key_prefix", "hash tag"],
    );
    err(
        &sidecar_with("redis_url = \"http://x\""),
        &["sidecar.redis_url", "redis://"],
    );
    err(
        &sidecar_with("redis_cluster_nodes = [\"redis://a:1\", \"b:2\"]"),
        &["sidecar.redis_cluster_nodes[1]", "\"b:2\""],
    );
    err(&sidecar_with("admin_uids = [-1]"), &["sidecar.admin_uids"]);
}

#[test]
fn scopes_required_and_named() {
    err("", &["scopes", "at least one scope"]);
    err("[sidecar]\nbackend = \"memory\"\n", &["at least one scope"]);
    err(
        "[[scopes.\"\".sources]]\nname = \"a\"\n",
        &["scope name", "empty"],
    );
}

#[test]
fn unknown_keys_are_named() {
    err(
        &scope_with("max_atempts = 3"),
        &["scopes.chat.max_atempts", "unknown key"],
    );
    err(
        &breaker_with("cooldwn = \"1s\""),
        &["scopes.chat.breaker.cooldwn", "unknown key"],
    );
    err(
        &pacer_with("ceiling = 3"),
        &["scopes.chat.pacer.ceiling", "unknown key"],
    );
    err(
        &sidecar_with("sockett = \"/x\""),
        &["sidecar.sockett", "unknown key"],
    );
    err(
        &source_with("tmp = 5"),
        &["scopes.chat.sources[0].tmp", "unknown key"],
    );
    err(
        &format!("verbose = true\n{MINIMAL}"),
        &["verbose", "unknown key"],
    );
    err(
        &format!("[metrics]\nport = 1\n{MINIMAL}"),
        &["metrics", "unknown key"],
    );
}

#[test]
fn syntax_errors_give_a_line() {
    err("[scopes.chat\n", &["line 1"]);
    err(&format!("{MINIMAL}\nname = \"dup\"\n"), &["line"]);
}

#[test]
fn shared_source_must_agree_on_quota() {
    let two = |tpm2: &str, rpm2: &str| {
        format!(
            "[[scopes.chat.sources]]\nname = \"gpt\"\ntpm = 1000\nrpm = 10\n\
             [[scopes.batch.sources]]\nname = \"gpt\"\n{tpm2}\n{rpm2}\n"
        )
    };
    // Same quota, different timeout and estimate: fine (one global quota).
    let ok = parse(&two(
        "tpm = 1000",
        "rpm = 10\ntimeout = \"5s\"\nest_tokens = 9",
    ))
    .unwrap();
    assert_eq!(ok.scopes.len(), 2);
    let e = err(
        &two("tpm = 2000", "rpm = 10"),
        &["gpt", "scopes.chat", "scopes.batch", "tpm", "1000", "2000"],
    );
    assert!(e.contains("global quota"), "{e}");
    err(
        &two("tpm = 1000", ""),
        &["gpt", "scopes.chat", "scopes.batch", "rpm", "unset"],
    );
    // §18: one quota learns its rate for every scope or for none.
    err(
        &two("tpm = 1000", "rpm = 10\nlearn_rate = \"aimd\""),
        &["gpt", "learn_rate", "\"off\"", "\"aimd\""],
    );
    let e = parse(&two("tpm = 1000", "rpm = 11")).unwrap_err();
    assert!(matches!(
        e,
        ConfigError::SourceConflict { field: "rpm", ref first_scope, ref second_scope, .. }
            if first_scope == "chat" && second_scope == "batch"
    ));
}

// ---------------------------------------------------------------------------------
// Environment overrides.

#[test]
fn env_overrides_apply() {
    let toml = format!("{MINIMAL}\n[[scopes.long-jobs.sources]]\nname = \"b\"\n");
    let c = parse_str(
        &toml,
        env(&[
            ("CHAT__QUOTA_FULL", "fail_fast"),
            ("CHAT__CIRCUIT_OPEN", "wait"),
            ("CHAT__MAX_ATTEMPTS", "9"),
            ("CHAT__STALL_WINDOW", "90s"),
            ("CHAT__POLL_INTERVAL", "20ms"),
            ("CHAT__SELECTOR", "health"),
            ("CHAT__BREAKER__COOLDOWN", "5s"),
            ("CHAT__PACER__MAX", "10"),
            ("LONG_JOBS__CIRCUIT_OPEN", "wait"),
            ("SIDECAR__BACKEND", "redis"),
            ("SIDECAR__REDIS_URL", "redis://redis.internal:6379/1"),
            ("SIDECAR__SOCKET", "/tmp/override.sock"),
            ("SIDECAR__ON_BACKEND_ERROR", "fail_closed"),
            ("SIDECAR__KEY_PREFIX", "staging"),
        ]),
    )
    .unwrap();
    let chat = &c.scopes[0];
    assert_eq!(chat.quota_full, Mode::FailFast);
    assert_eq!(chat.circuit_open, Mode::Wait);
    assert_eq!(chat.max_attempts, 9);
    assert_eq!(chat.stall_window, Duration::from_secs(90));
    assert_eq!(chat.poll_interval, Duration::from_millis(20));
    assert_eq!(chat.selector, Selector::Health);
    assert_eq!(chat.breaker.cooldown, Duration::from_secs(5));
    assert_eq!(chat.pacer.max, 10.0);
    assert_eq!(c.scopes[1].name, "long-jobs");
    assert_eq!(c.scopes[1].circuit_open, Mode::Wait);
    assert_eq!(c.scopes[1].quota_full, Mode::Wait, "untouched");
    assert_eq!(c.sidecar.backend, BackendKind::Redis);
    assert_eq!(c.sidecar.redis_url, "redis://redis.internal:6379/1");
    assert_eq!(c.sidecar.socket, "/tmp/override.sock");
    assert_eq!(c.sidecar.on_backend_error, OnBackendError::FailClosed);
    assert_eq!(c.sidecar.key_prefix, "staging");
}

#[test]
fn env_overrides_beat_the_file() {
    let c = parse_str(
        &scope_with("circuit_open = \"fail_fast\"\nmax_attempts = 2"),
        env(&[("CHAT__CIRCUIT_OPEN", "wait"), ("CHAT__MAX_ATTEMPTS", "4")]),
    )
    .unwrap();
    assert_eq!(c.scopes[0].circuit_open, Mode::Wait);
    assert_eq!(c.scopes[0].max_attempts, 4);
}

#[test]
fn unrelated_env_is_ignored() {
    let c = parse_str(
        MINIMAL,
        env(&[
            ("PATH", "/usr/bin"),
            ("OTHER__QUOTA_FULL", "nonsense"),
            ("RUST__LOG", "x"),
            ("chat__quota_full", "nonsense"),
            ("CHATTY__QUOTA_FULL", "nonsense"),
        ]),
    )
    .unwrap();
    assert_eq!(c.scopes[0].quota_full, Mode::Wait);
}

#[test]
fn bad_env_values_name_the_variable() {
    let msg = err_env(MINIMAL, &[("CHAT__CIRCUIT_OPEN", "sometimes")], &[]);
    assert_eq!(
        msg,
        "CHAT__CIRCUIT_OPEN=sometimes: expected one of: wait, fail_fast"
    );
    err_env(
        MINIMAL,
        &[("CHAT__QUOTA_FULL", "never")],
        &["CHAT__QUOTA_FULL=never", "expected one of: wait, fail_fast"],
    );
    err_env(
        MINIMAL,
        &[("CHAT__SELECTOR", "best")],
        &["CHAT__SELECTOR=best", "expected one of: priority, health"],
    );
    err_env(
        MINIMAL,
        &[("CHAT__MAX_ATTEMPTS", "many")],
        &["CHAT__MAX_ATTEMPTS=many", "integer"],
    );
    err_env(
        MINIMAL,
        &[("CHAT__MAX_ATTEMPTS", "0")],
        &["CHAT__MAX_ATTEMPTS=0", "at least 1"],
    );
    err_env(
        MINIMAL,
        &[("CHAT__STALL_WINDOW", "forever")],
        &["CHAT__STALL_WINDOW=forever", "duration"],
    );
    err_env(
        MINIMAL,
        &[("CHAT__POLL_INTERVAL", "0s")],
        &["CHAT__POLL_INTERVAL=0s", "greater than zero"],
    );
    err_env(
        MINIMAL,
        &[("SIDECAR__BACKEND", "etcd")],
        &["SIDECAR__BACKEND=etcd", "expected one of: memory, redis"],
    );
    err_env(
        MINIMAL,
        &[("SIDECAR__ON_BACKEND_ERROR", "ignore")],
        &[
            "SIDECAR__ON_BACKEND_ERROR=ignore",
            "expected one of: local, fail_closed",
        ],
    );
    err_env(
        MINIMAL,
        &[("SIDECAR__SOCKET", "")],
        &["SIDECAR__SOCKET=", "empty"],
    );
    err_env(
        MINIMAL,
        &[("SIDECAR__REDIS_URL", "localhost")],
        &["SIDECAR__REDIS_URL=localhost"],
    );
    err_env(
        MINIMAL,
        &[("SIDECAR__KEY_PREFIX", "{x}")],
        &["SIDECAR__KEY_PREFIX={x}"],
    );
    // An override that breaks a pair of keys names the variable too.
    err_env(
        MINIMAL,
        &[("CHAT__BREAKER__COOLDOWN", "1h")],
        &["CHAT__BREAKER__COOLDOWN", "max_cooldown"],
    );
}

#[test]
fn unknown_key_under_known_prefix_is_an_error() {
    err_env(
        MINIMAL,
        &[("CHAT__QUOTA", "wait")],
        &["CHAT__QUOTA", "unknown key", "QUOTA_FULL", "CIRCUIT_OPEN"],
    );
    err_env(
        MINIMAL,
        &[("SIDECAR__SOCKETPATH", "/x")],
        &["SIDECAR__SOCKETPATH", "unknown key", "SOCKET", "BACKEND"],
    );
}

#[test]
fn env_prefix_collisions_are_rejected() {
    err(
        "[[scopes.a-b.sources]]\nname = \"x\"\n[[scopes.a_b.sources]]\nname = \"y\"\n",
        &["scopes.a-b", "scopes.a_b", "A_B__"],
    );
    err(
        "[[scopes.sidecar.sources]]\nname = \"x\"\n",
        &["scopes.sidecar", "SIDECAR__"],
    );
}

#[test]
fn admin_listen_parses_and_bad_values_name_the_key() {
    let base = "[scopes.chat]\n[[scopes.chat.sources]]\nname = \"a\"\n";
    let ok = polygate::config::parse_str(
        &format!("[sidecar]\nadmin_listen = \"127.0.0.1:9464\"\n{base}"),
        std::iter::empty(),
    )
    .unwrap();
    assert_eq!(
        ok.sidecar.admin_listen,
        Some("127.0.0.1:9464".parse().unwrap())
    );
    let none = polygate::config::parse_str(base, std::iter::empty()).unwrap();
    assert_eq!(none.sidecar.admin_listen, None, "off by default");
    let err = polygate::config::parse_str(
        &format!("[sidecar]\nadmin_listen = \"localhost\"\n{base}"),
        std::iter::empty(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("sidecar.admin_listen") && err.contains("127.0.0.1:9464"),
        "{err}"
    );
    let env = polygate::config::parse_str(
        base,
        [("SIDECAR__ADMIN_LISTEN".to_string(), "nope".to_string())],
    )
    .unwrap_err()
    .to_string();
    assert!(env.contains("SIDECAR__ADMIN_LISTEN"), "{env}");
}

/// DESIGN §7 / §12a: `sidecar.max_rate_limit_block` defaults to 10 min, is read from
/// the file and from `SIDECAR__MAX_RATE_LIMIT_BLOCK`, and a bad value names the key.
#[test]
fn max_rate_limit_block_defaults_parses_and_overrides() {
    let d = parse(MINIMAL).unwrap();
    assert_eq!(d.sidecar.max_rate_limit_block, Duration::from_secs(600));
    let c = parse(&sidecar_with("max_rate_limit_block = \"90s\"")).unwrap();
    assert_eq!(c.sidecar.max_rate_limit_block, Duration::from_secs(90));
    let c = parse_str(
        &sidecar_with("max_rate_limit_block = \"90s\""),
        env(&[("SIDECAR__MAX_RATE_LIMIT_BLOCK", "2m")]),
    )
    .unwrap();
    assert_eq!(c.sidecar.max_rate_limit_block, Duration::from_secs(120));
    err(
        &sidecar_with("max_rate_limit_block = \"0s\""),
        &["sidecar.max_rate_limit_block", "greater than zero"],
    );
    err(
        &sidecar_with("max_rate_limit_block = 600"),
        &["max_rate_limit_block", "durations are strings"],
    );
    err_env(
        MINIMAL,
        &[("SIDECAR__MAX_RATE_LIMIT_BLOCK", "soon")],
        &["SIDECAR__MAX_RATE_LIMIT_BLOCK=soon", "expected a duration"],
    );
}

/// DESIGN §10: `sidecar.degraded_share` is "auto" (the default) or a fraction in
/// (0, 1], from the file (string or number) and `SIDECAR__DEGRADED_SHARE`; a bad
/// value names the key and what is allowed.
#[test]
fn degraded_share_defaults_parses_and_overrides() {
    use polygate::config::DegradedShare;
    assert_eq!(
        parse(MINIMAL).unwrap().sidecar.degraded_share,
        DegradedShare::Auto
    );
    let share = |line: &str| parse(&sidecar_with(line)).unwrap().sidecar.degraded_share;
    assert_eq!(share("degraded_share = \"auto\""), DegradedShare::Auto);
    assert_eq!(
        share("degraded_share = 0.25"),
        DegradedShare::Fraction(0.25)
    );
    assert_eq!(share("degraded_share = 1"), DegradedShare::Fraction(1.0));
    assert_eq!(
        share("degraded_share = \"0.5\""),
        DegradedShare::Fraction(0.5)
    );
    let c = parse_str(MINIMAL, env(&[("SIDECAR__DEGRADED_SHARE", "0.1")])).unwrap();
    assert_eq!(c.sidecar.degraded_share, DegradedShare::Fraction(0.1));
    assert_eq!(DegradedShare::Auto.of(4), 0.25);
    assert_eq!(DegradedShare::Auto.of(0), 1.0, "this host at least");
    assert_eq!(DegradedShare::Fraction(0.3).of(10), 0.3);
    for bad in ["0", "1.5", "-0.2", "\"half\"", "\"nan\""] {
        err(
            &sidecar_with(&format!("degraded_share = {bad}")),
            &["sidecar.degraded_share", "\"auto\"", "at most 1"],
        );
    }
    err_env(
        MINIMAL,
        &[("SIDECAR__DEGRADED_SHARE", "all")],
        &["SIDECAR__DEGRADED_SHARE=all", "\"auto\""],
    );
}

#[test]
fn provider_quota_keys_default_parse_and_override() {
    use polygate::config::{TokensCharged, DEFAULT_BURST};
    // Defaults: today's buckets exactly.
    let c = parse(MINIMAL).unwrap();
    let s = &c.scopes[0].sources[0];
    assert_eq!(s.burst, DEFAULT_BURST);
    assert_eq!(s.burst, Duration::from_secs(60));
    assert_eq!(s.tokens_charged, TokensCharged::Actual);
    assert_eq!((s.itpm, s.otpm, s.rpd, s.tpd), (None, None, None, None));
    assert_eq!(s.est_output_tokens, None);
    // Values.
    let c = parse(&source_with(
        "burst = \"1s\"\ntokens_charged = \"estimate\"\nitpm = 4000\notpm = 800\nrpd = 1000\n\
         tpd = 90000\nest_output_tokens = 64\nrpm = 40",
    ))
    .unwrap();
    let s = &c.scopes[0].sources[0];
    assert_eq!(s.burst, Duration::from_secs(1));
    assert_eq!(s.tokens_charged, TokensCharged::Estimate);
    assert_eq!(
        (s.itpm, s.otpm, s.rpd, s.tpd),
        (Some(4000), Some(800), Some(1000), Some(90000))
    );
    assert_eq!(s.default_est_output_tokens(), 64);
    assert_eq!(s.default_est_input_tokens(), 100, "ceil(itpm / rpm)");
    assert_eq!(
        s.default_est_tokens(),
        164,
        "no tpm: the split's defaults summed"
    );
    // The output default derives from otpm like est_tokens from tpm.
    let c = parse(&source_with("otpm = 600\nrpm = 7\ntpm = 7000")).unwrap();
    let s = &c.scopes[0].sources[0];
    assert_eq!(s.default_est_output_tokens(), 86, "ceil(600 / 7)");
    assert_eq!(s.default_est_tokens(), 1000);
    assert_eq!(s.default_est_input_tokens(), 914, "what the total leaves");
    // Environment overrides by source index.
    let c = parse_str(
        &source_with("tpm = 100"),
        env(&[
            ("CHAT__SOURCES__0__BURST", "10s"),
            ("CHAT__SOURCES__0__TOKENS_CHARGED", "estimate"),
            ("CHAT__SOURCES__0__OTPM", "50"),
            ("CHAT__SOURCES__0__TPM", "200"),
        ]),
    )
    .unwrap();
    let s = &c.scopes[0].sources[0];
    assert_eq!(s.burst, Duration::from_secs(10));
    assert_eq!(s.tokens_charged, TokensCharged::Estimate);
    assert_eq!((s.otpm, s.tpm), (Some(50), Some(200)));
}

#[test]
fn bad_provider_quota_keys_name_the_key() {
    let k = "scopes.chat.sources[0]";
    err(
        &source_with("burst = \"2m\""),
        &[&format!("{k}.burst"), "at most 60s"],
    );
    err(
        &source_with("burst = \"0s\""),
        &[&format!("{k}.burst"), "greater than zero"],
    );
    err(
        &source_with("burst = \"soon\""),
        &[&format!("{k}.burst"), "duration"],
    );
    err(
        &source_with("tokens_charged = \"usage\""),
        &[&format!("{k}.tokens_charged"), "actual, estimate"],
    );
    for key in ["itpm", "otpm", "rpd", "tpd", "est_output_tokens"] {
        err(
            &source_with(&format!("{key} = 0")),
            &[&format!("{k}.{key}"), "greater than zero"],
        );
    }
    err(
        &source_with("tpd = 10000000000000"),
        &[&format!("{k}.tpd"), "at most"],
    );
    err(
        &source_with("est_output_tokens = 10000000000"),
        &[&format!("{k}.est_output_tokens"), "at most"],
    );
    err_env(
        MINIMAL,
        &[("CHAT__SOURCES__0__BURST", "forever")],
        &["CHAT__SOURCES__0__BURST", "duration"],
    );
    err_env(
        MINIMAL,
        &[("CHAT__SOURCES__0__ITPM", "many")],
        &["CHAT__SOURCES__0__ITPM", "integer"],
    );
    err_env(
        MINIMAL,
        &[("CHAT__SOURCES__0__NOPE", "1")],
        &["CHAT__SOURCES__0__NOPE", "BURST", "TOKENS_CHARGED"],
    );
    err_env(
        MINIMAL,
        &[("CHAT__SOURCES__3__RPD", "1")],
        &["CHAT__SOURCES__3__RPD", "source index"],
    );
}

#[test]
fn a_shared_source_agrees_on_every_provider_quota_key() {
    for (a, b, field) in [
        ("burst = \"1s\"", "", "burst"),
        ("tokens_charged = \"estimate\"", "", "tokens_charged"),
        ("itpm = 5", "itpm = 6", "itpm"),
        ("otpm = 5", "", "otpm"),
        ("rpd = 5", "", "rpd"),
        ("tpd = 5", "tpd = 7", "tpd"),
    ] {
        let toml = format!(
            "[[scopes.chat.sources]]\nname = \"a\"\n{a}\n[[scopes.batch.sources]]\nname = \"a\"\n{b}\n"
        );
        err(&toml, &["source `a`", &format!("sets {field} =")]);
    }
    // est_output_tokens is an estimate, not the quota: scopes may differ.
    parse(
        "[[scopes.chat.sources]]\nname = \"a\"\nest_output_tokens = 5\n\
         [[scopes.batch.sources]]\nname = \"a\"\n",
    )
    .unwrap();
}

#[test]
fn the_provider_examples_parse_as_the_rules_they_name() {
    use polygate::config::TokensCharged;
    let text = include_str!("../../examples/providers.toml");
    let c = parse_str(text, no_env()).unwrap();
    let s = &c.scopes[0].sources;
    let by = |n: &str| s.iter().find(|x| x.name == n).unwrap();
    let anthropic = by("anthropic-sonnet");
    assert!(anthropic.itpm.is_some() && anthropic.otpm.is_some());
    assert_eq!(
        anthropic.burst,
        Duration::from_millis(58_800),
        "60 s - 60 s / 50 rpm: one request of headroom"
    );
    assert_eq!(anthropic.tokens_charged, TokensCharged::Actual);
    let azure = by("azure-gpt4o");
    assert_eq!(azure.burst, Duration::from_millis(100), "60 s / 600 rpm");
    assert_eq!(azure.tokens_charged, TokensCharged::Estimate);
    let openai = by("openai-gpt4o");
    assert!(openai.rpd.is_some() && openai.tpd.is_some());
    let c = parse_str(EXAMPLE_CONFIG, no_env()).unwrap();
    let eu = &c.scopes[0].sources[1];
    assert_eq!(
        (eu.burst, eu.tokens_charged),
        (Duration::from_millis(125), TokensCharged::Estimate)
    );
}

// ---- §15 priority classes ----

const CLASSES: &str = r#"
[scopes.chat]
default_priority = "batch"
saturation = 0.75
[[scopes.chat.priorities]]
name = "interactive"
weight = 8
reserve = 0.3
[[scopes.chat.priorities]]
name = "batch"
weight = 1
limit = 0.7
[[scopes.chat.sources]]
name = "a"
"#;

#[test]
fn priorities_parse_with_defaults() {
    let c = parse(CLASSES).unwrap();
    let s = &c.scopes[0];
    assert_eq!(s.priorities.len(), 2);
    assert_eq!(s.priorities[0].name, "interactive");
    assert_eq!(s.priorities[0].weight, 8.0);
    assert_eq!(s.priorities[0].reserve, 0.3);
    assert_eq!(s.priorities[0].limit, 1.0, "limit defaults to the whole");
    assert_eq!(s.priorities[1].reserve, 0.0, "reserve defaults to none");
    assert_eq!(s.priorities[1].limit, 0.7);
    assert_eq!(s.default_priority, 1);
    assert_eq!(s.saturation, 0.75);
    // Without default_priority the last class listed is the default.
    let c = parse(&CLASSES.replace("default_priority = \"batch\"\n", "")).unwrap();
    assert_eq!(c.scopes[0].default_priority, 1);
    // No classes: none, and the default saturation.
    let c = parse(MINIMAL).unwrap();
    assert!(c.scopes[0].priorities.is_empty());
    assert_eq!(c.scopes[0].saturation, polygate::config::DEFAULT_SATURATION);
}

#[test]
fn bad_priorities_name_the_key() {
    err(
        &CLASSES
            .replace("reserve = 0.3", "reserve = 0.8\nlimit = 0.9")
            .replace("limit = 0.7", "reserve = 0.3"),
        &["scopes.chat.priorities[*].reserve", "sum to", "more than 1"],
    );
    err(
        &CLASSES.replace("limit = 0.7", "limit = 0.2\nreserve = 0.4"),
        &[
            "scopes.chat.priorities[1].limit",
            "scopes.chat.priorities[1].reserve",
            "must not be below reserve",
        ],
    );
    err(
        &CLASSES.replace(
            "default_priority = \"batch\"",
            "default_priority = \"bulk\"",
        ),
        &[
            "scopes.chat.default_priority",
            "\"bulk\"",
            "interactive, batch",
        ],
    );
    err(
        &scope_with("default_priority = \"batch\""),
        &[
            "scopes.chat.default_priority",
            "declares no priority classes",
        ],
    );
    err(
        &CLASSES.replace("weight = 1\n", "weight = 0\n"),
        &["scopes.chat.priorities[1].weight", "greater than 0"],
    );
    err(
        &CLASSES.replace("weight = 8", "weight = -2"),
        &["scopes.chat.priorities[0].weight"],
    );
    err(
        &CLASSES.replace("reserve = 0.3", "reserve = 1.5"),
        &["scopes.chat.priorities[0].reserve", "[0, 1]"],
    );
    err(
        &CLASSES.replace("limit = 0.7", "limit = 0"),
        &["scopes.chat.priorities[1].limit", "(0, 1]"],
    );
    err(
        &CLASSES.replace("name = \"batch\"", "name = \"interactive\""),
        &["scopes.chat.priorities[1].name", "already declared"],
    );
    err(
        &CLASSES.replace("name = \"batch\"", "name = \"bat ch\""),
        &["scopes.chat.priorities[1].name", "A-Z"],
    );
    err(
        &CLASSES.replace("name = \"batch\"\n", ""),
        &["scopes.chat.priorities[1].name", "needs a name"],
    );
    err(
        &CLASSES.replace("saturation = 0.75", "saturation = 1.2"),
        &["scopes.chat.saturation", "(0, 1]"],
    );
    err(
        &CLASSES.replace("weight = 8", "wieght = 8"),
        &["unknown key", "wieght"],
    );
}

#[test]
fn priority_scope_keys_override_from_env() {
    let c = parse_str(
        CLASSES,
        env(&[
            ("CHAT__DEFAULT_PRIORITY", "interactive"),
            ("CHAT__SATURATION", "0.5"),
        ]),
    )
    .unwrap();
    assert_eq!(c.scopes[0].default_priority, 0);
    assert_eq!(c.scopes[0].saturation, 0.5);
    err_env(
        CLASSES,
        &[("CHAT__DEFAULT_PRIORITY", "bulk")],
        &["CHAT__DEFAULT_PRIORITY", "interactive, batch"],
    );
    err_env(
        CLASSES,
        &[("CHAT__SATURATION", "2")],
        &["CHAT__SATURATION", "(0, 1]"],
    );
}

#[test]
fn worker_threads_is_a_thread_count_or_one_per_core() {
    assert_eq!(parse(MINIMAL).unwrap().sidecar.worker_threads, Some(1));
    let per_core = parse(&sidecar_with("worker_threads = 0")).unwrap();
    assert_eq!(per_core.sidecar.worker_threads, None);
    let one = parse(&sidecar_with("worker_threads = 1")).unwrap();
    assert_eq!(one.sidecar.worker_threads, Some(1));
    let by_env = parse_str(MINIMAL, env(&[("SIDECAR__WORKER_THREADS", "3")])).unwrap();
    assert_eq!(by_env.sidecar.worker_threads, Some(3));
    for bad in ["-2", "1025"] {
        err(
            &sidecar_with(&format!("worker_threads = {bad}")),
            &["sidecar.worker_threads", bad, "between 1 and 1024, or 0"],
        );
    }
    err(
        &sidecar_with("worker_threads = \"two\""),
        &["sidecar.worker_threads"],
    );
}

// ------------------------------------------------------------------ default socket

#[test]
fn default_socket_is_run_polygate_for_root_and_xdg_runtime_dir_for_others() {
    use polygate::config::default_socket_for;
    assert_eq!(
        default_socket_for(0, Some("/run/user/0")).unwrap(),
        "/run/polygate/sidecar.sock"
    );
    assert_eq!(
        default_socket_for(0, None).unwrap(),
        "/run/polygate/sidecar.sock"
    );
    assert_eq!(
        default_socket_for(1000, Some("/run/user/1000")).unwrap(),
        "/run/user/1000/polygate/sidecar.sock"
    );
    assert_eq!(
        default_socket_for(1000, Some("/run/user/1000/")).unwrap(),
        "/run/user/1000/polygate/sidecar.sock"
    );
    // No (absolute) XDG_RUNTIME_DIR: the error says what to set.
    for xdg in [None, Some(""), Some("relative/dir")] {
        let e = default_socket_for(1000, xdg).unwrap_err();
        for word in [
            "uid 1000",
            "XDG_RUNTIME_DIR",
            "[sidecar] socket",
            "POLYGATE_SOCKET",
        ] {
            assert!(e.contains(word), "{word:?} missing: {e}");
        }
    }
}

#[test]
fn an_explicit_socket_wins_over_the_default() {
    let c = parse(&sidecar_with("socket = \"/tmp/x/s.sock\"")).unwrap();
    assert_eq!(c.sidecar.socket, "/tmp/x/s.sock");
    let c = parse(MINIMAL).unwrap();
    assert_eq!(Ok(c.sidecar.socket), polygate::config::default_socket());
}

// ------------------------------------------------------------------ error wording

#[test]
fn value_errors_carry_the_line_of_the_value() {
    let toml = "[scopes.chat]\nquota_full = \"nope\"\n[[scopes.chat.sources]]\nname = \"a\"\n";
    let e = parse(toml).unwrap_err().to_string();
    assert_eq!(
        e,
        "scopes.chat.quota_full = \"nope\" (line 2): expected one of: wait, fail_fast"
    );
    // In the second entry of an array of tables, and in a nested table.
    let toml = "[[scopes.chat.sources]]\nname = \"a\"\n\n[[scopes.chat.sources]]\nname = \"b\"\ntpm = -5\n";
    let e = parse(toml).unwrap_err().to_string();
    assert!(
        e.starts_with("scopes.chat.sources[1].tpm = -5 (line 6): "),
        "{e}"
    );
    let toml = format!("[scopes.chat.breaker]\n\nfailure_rate = 7.0\n{MINIMAL}");
    let e = parse(&toml).unwrap_err().to_string();
    assert!(e.contains("failure_rate = 7 (line 3)"), "{e}");
    // From the environment: the variable is named, no line.
    let e = parse_str(MINIMAL, env(&[("CHAT__QUOTA_FULL", "nope")]))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("CHAT__QUOTA_FULL=nope: "), "{e}");
}

#[test]
fn type_errors_say_what_was_expected_in_words() {
    for (line, words) in [
        ("max_frame = 1.5", "expected a whole number"),
        ("max_frame = \"big\"", "expected a whole number"),
        ("allowed_uids = 5", "expected an array"),
    ] {
        let e = parse(&sidecar_with(line)).unwrap_err().to_string();
        assert!(e.contains(words), "{line}: {e}");
        assert!(!e.contains("i64") && !e.contains("sequence"), "{line}: {e}");
    }
    let e = parse(&source_with("tpd = \"x\"")).unwrap_err().to_string();
    assert!(
        e.contains("(line 3, column 7)") && e.contains("expected a whole number"),
        "{e}"
    );
    // A per-minute limit may also be "auto" (§18), and says so.
    let e = parse(&source_with("tpm = \"x\"")).unwrap_err().to_string();
    assert!(
        e.contains("(line 3)") && e.contains("expected a positive integer or \"auto\""),
        "{e}"
    );
}

#[test]
fn a_bad_source_index_names_the_range_plainly() {
    let three = "[[scopes.chat.sources]]\nname = \"a\"\n[[scopes.chat.sources]]\nname = \"b\"\n\
                 [[scopes.chat.sources]]\nname = \"c\"\n";
    let e = parse_str(three, env(&[("CHAT__SOURCES__3__RPD", "1")]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("a source index (0 to 2 in the file's order)"),
        "{e}"
    );
    assert!(!e.contains("  ") && !e.contains(".."), "{e}");
    let e = parse_str(MINIMAL, env(&[("CHAT__SOURCES__1__RPD", "1")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("a source index (0 in the file's order)"), "{e}");
}

#[test]
fn observed_limit_keys_parse_name_the_key_and_override() {
    use polygate::config::ObserveLimits;
    let k = "scopes.chat.sources[0]";
    // Defaults: off, no "auto".
    let s = parse(MINIMAL).unwrap().scopes[0].sources[0].clone();
    assert_eq!((s.observe_limits, s.auto), (ObserveLimits::Off, 0));
    // Values: "auto" per bucket is a bit in tpm, rpm, itpm, otpm order.
    let s = parse(&source_with(
        "observe_limits = \"on\"\ntpm = \"auto\"\nrpm = 60\notpm = \"AUTO\"",
    ))
    .unwrap()
    .scopes[0]
        .sources[0]
        .clone();
    assert_eq!(s.observe_limits, ObserveLimits::On);
    assert_eq!((s.tpm, s.rpm, s.otpm), (None, Some(60), None));
    assert_eq!(s.auto, 0b1001);
    // Bad values name the key and what is allowed.
    err(
        &source_with("observe_limits = \"yes\""),
        &[&format!("{k}.observe_limits"), "on, off"],
    );
    err(
        &source_with("rpm = \"lots\""),
        &[&format!("{k}.rpm"), "\"auto\""],
    );
    err(
        &source_with("itpm = 0"),
        &[&format!("{k}.itpm"), "greater than zero"],
    );
    // Environment: a number or auto.
    let s = parse_str(
        &source_with("tpm = 100"),
        env(&[
            ("CHAT__SOURCES__0__TPM", "auto"),
            ("CHAT__SOURCES__0__RPM", "30"),
            ("CHAT__SOURCES__0__OBSERVE_LIMITS", "on"),
        ]),
    )
    .unwrap()
    .scopes[0]
        .sources[0]
        .clone();
    assert_eq!((s.tpm, s.rpm, s.auto), (None, Some(30), 1));
    assert_eq!(s.observe_limits, ObserveLimits::On);
    err_env(
        MINIMAL,
        &[("CHAT__SOURCES__0__RPM", "many")],
        &["CHAT__SOURCES__0__RPM", "\"auto\""],
    );
}

#[test]
fn learn_rate_parses_names_a_bad_value_and_overrides() {
    use polygate::config::LearnRate;
    let k = "scopes.chat.sources[0]";
    // §18: off unless asked for.
    let s = parse(MINIMAL).unwrap().scopes[0].sources[0].clone();
    assert_eq!(s.learn_rate, LearnRate::Off);
    let s = parse(&source_with("learn_rate = \"aimd\"\nrpm = 60"))
        .unwrap()
        .scopes[0]
        .sources[0]
        .clone();
    assert_eq!(s.learn_rate, LearnRate::Aimd);
    err(
        &source_with("learn_rate = \"on\""),
        &[&format!("{k}.learn_rate"), "aimd, off"],
    );
    let s = parse_str(MINIMAL, env(&[("CHAT__SOURCES__0__LEARN_RATE", "aimd")]))
        .unwrap()
        .scopes[0]
        .sources[0]
        .clone();
    assert_eq!(s.learn_rate, LearnRate::Aimd);
    err_env(
        MINIMAL,
        &[("CHAT__SOURCES__0__LEARN_RATE", "fast")],
        &["CHAT__SOURCES__0__LEARN_RATE", "aimd, off"],
    );
}

#[test]
fn idle_exit_is_off_for_a_daemon_and_ten_minutes_when_autostarted() {
    use polygate::config::IdleExit;
    // §20: unset depends on how the process started.
    let unset = parse(MINIMAL).unwrap().sidecar.idle_exit;
    assert_eq!(unset, IdleExit::Default);
    assert_eq!(unset.resolve(false), None);
    assert_eq!(unset.resolve(true), Some(Duration::from_secs(600)));
    // Set, it applies either way; "off" turns it off for an autostarted one too.
    let set = parse(&sidecar_with("idle_exit = \"1500ms\""))
        .unwrap()
        .sidecar
        .idle_exit;
    assert_eq!(set, IdleExit::After(Duration::from_millis(1500)));
    assert_eq!(set.resolve(false), Some(Duration::from_millis(1500)));
    let off = parse(&sidecar_with("idle_exit = \"off\""))
        .unwrap()
        .sidecar
        .idle_exit;
    assert_eq!((off.resolve(false), off.resolve(true)), (None, None));
    // The environment's override.
    let env_set = parse_str(MINIMAL, env(&[("SIDECAR__IDLE_EXIT", "30s")])).unwrap();
    assert_eq!(
        env_set.sidecar.idle_exit,
        IdleExit::After(Duration::from_secs(30))
    );
    for bad in ["0s", "soon", "2years"] {
        err(
            &sidecar_with(&format!("idle_exit = \"{bad}\"")),
            &["sidecar.idle_exit", bad, "\"off\""],
        );
    }
    err_env(
        MINIMAL,
        &[("SIDECAR__IDLE_EXIT", "never")],
        &["SIDECAR__IDLE_EXIT=never", "\"off\""],
    );
}

/// §19: a dollar budget below one nano-dollar (the ledgers' unit) would round to a
/// budget of nothing that refuses every priced call: refused naming the key.
#[test]
fn a_dollar_budget_under_a_nano_dollar_is_refused_by_name() {
    let with = |budget: &str| {
        format!(
            "[scopes.chat]\n[scopes.chat.tenants]\ndefault = {{ usd_per_day = {budget} }}\n{MINIMAL}"
        )
    };
    err(
        &with("1e-10"),
        &["scopes.chat.tenants.default.usd_per_day", "0.000000001"],
    );
    err(&with("0.0"), &["scopes.chat.tenants.default.usd_per_day"]);
    let c = parse_str(&with("0.000000001"), env(&[])).expect("one n$ is a budget");
    assert_eq!(
        c.scopes[0].tenants.as_ref().unwrap().default.usd_per_day,
        Some(1)
    );
}

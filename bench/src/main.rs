//! `polygate-bench`: what the sidecar costs, next to its floor, in one run (DESIGN §16).
//!
//! Each scenario prints one JSON line (one per client count / mode where a scenario
//! takes a list). Speed goals live here, never in timed tests; the tool asserts
//! nothing, it measures and prints ratios. README ("Benchmarks") and
//! docs/benchmarks.md say how to run it and what the figures were.

mod context;
mod drivers;
mod echo;
mod engine;
mod flood;
mod frames;
mod load;
mod priorities;
mod procs;
mod scenarios;
mod target;
mod tenants;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use serde_json::{Map, Value};

#[derive(Debug, Parser)]
#[command(
    name = "polygate-bench",
    about = "PolyGate bench: sidecar figures next to a plain Unix-socket echo floor, one JSON line per scenario"
)]
struct Cli {
    /// Scenario to run (repeatable).
    #[arg(long, value_enum)]
    scenario: Vec<Scenario>,
    /// Run every scenario.
    #[arg(long)]
    all: bool,
    /// Connection counts of `throughput` and `redis`.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,256")]
    clients: Vec<usize>,
    /// Seconds each measurement runs (after a warm-up of a fifth of it, at most 1 s).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Repeat every measurement this many times and print the median of each figure.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// `latency`: pin the client, the sidecar and the echo servers to CPU 0 (on a VM a
    /// cross-core wake-up can cost more than the whole round trip; NOTES.md).
    #[arg(long)]
    pin: bool,
    /// The sidecar binary to start (temp config and socket).
    #[arg(long, default_value = "target/release/polygate-sidecar")]
    sidecar_bin: PathBuf,
    /// Measure a sidecar already listening here instead (it needs the bench scopes:
    /// `polygate-bench --print-config`).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Redis for `redis` and the driver scenarios instead of a throwaway
    /// `redis-server`.
    #[arg(long)]
    redis_url: Option<String>,
    /// Waiting calls of `waiters`.
    #[arg(long, default_value_t = 10_000)]
    waiters: usize,
    /// Sources of `status-flood`'s large scope.
    #[arg(long, default_value_t = 3000)]
    sources: usize,
    /// Concurrency of the driver scenarios (threads for sync, tasks for asyncio).
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Python for the driver and the redis-py baseline.
    #[arg(long, default_value = ".venv/bin/python")]
    python: PathBuf,
    /// The Python driver (its command line: bench/drivers/python_client.py).
    #[arg(long, default_value = "bench/drivers/python_client.py")]
    python_driver: PathBuf,
    /// The Node driver.
    #[arg(long, default_value = "bench/drivers/node_client.mjs")]
    node_driver: PathBuf,
    /// The Go driver's package directory.
    #[arg(long, default_value = "bench/drivers/go_client")]
    go_driver: PathBuf,
    /// `transport`: the Python HTTP transport's driver (DESIGN §17).
    #[arg(long, default_value = "bench/drivers/python_transport.py")]
    transport_driver: PathBuf,
    /// `fleet`: sidecars on one throwaway redis-server (DESIGN §7a).
    #[arg(long, default_value_t = 4)]
    hosts: usize,
    /// `fleet`: workers per host, each on its own binding connection.
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// `fleet`: the provider rule the fake upstream enforces.
    #[arg(long, value_enum, default_value = "token-bucket")]
    upstream: Upstream,
    /// `fleet`: `matching` (the examples/providers.toml block for the rule) or
    /// `default` (today's rpm + tpm, the control).
    #[arg(long, default_value = "matching")]
    fleet_config: String,
    /// `fleet`: the upstream deployment's requests and tokens per minute.
    #[arg(long, default_value_t = 60)]
    rpm: u64,
    #[arg(long, default_value_t = 6000)]
    tpm: u64,
    /// `fleet`: the driver (bench/fleet/fleet.py).
    #[arg(long, default_value = "bench/fleet/fleet.py")]
    fleet_driver: PathBuf,
    /// `fleet`: a throwaway 3-master / 3-replica Redis Cluster instead of one server.
    #[arg(long)]
    cluster: bool,
    /// `fleet`: a Redis fault at mid-run (DESIGN §10): `none`, `redis-pause`
    /// (SIGSTOP for `--fault-for` seconds), `master-kill` or `failover` (`--cluster`).
    #[arg(long, default_value = "none")]
    fault: String,
    /// `fleet`: how long `redis-pause` stops Redis, in seconds.
    #[arg(long, default_value_t = 10.0)]
    fault_for: f64,
    /// `fleet`: `sidecar.degraded_share` of every host (`auto` or a fraction).
    #[arg(long, default_value = "auto")]
    degraded_share: String,
    /// `fleet` (DESIGN §18): share of each limit a consumer outside PolyGate uses
    /// directly at the fake upstream.
    #[arg(long, default_value_t = 0.0)]
    foreign: f64,
    /// `fleet` (DESIGN §18): `on` (the provider's headers correct the buckets) or
    /// `off` (the control).
    #[arg(long, default_value = "on")]
    observe: String,
    /// `fleet` (DESIGN §18): configure the limits as `"auto"` (learned).
    #[arg(long)]
    auto: bool,
    /// `fleet` (DESIGN §18): the source's `learn_rate` (`aimd` | `off`).
    #[arg(long, default_value = "off")]
    learn_rate: String,
    /// `tenants` (DESIGN §19): the parts to run (`fairness`, `fleet`, `cost`).
    #[arg(long, value_delimiter = ',', default_value = "fairness,fleet,cost")]
    tenant_parts: Vec<String>,
    /// `tenants`, part `fairness`: seconds each of its two runs (VTC, FIFO) measures.
    #[arg(long, default_value_t = 60.0)]
    fair_seconds: f64,
    /// `tenants`, part `fleet`: seconds the workers call.
    #[arg(long, default_value_t = 20.0)]
    exact_seconds: f64,
    /// `tenants`, part `fleet`: how many tenants the workers call for.
    #[arg(long, default_value_t = 1000)]
    tenant_count: u64,
    /// Tiny durations and counts: checks that every scenario runs and prints its keys.
    #[arg(long)]
    smoke: bool,
    /// Print the sidecar configuration the bench uses and exit.
    #[arg(long)]
    print_config: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// (internal) Run an echo floor server until killed.
    #[command(hide = true)]
    EchoServer {
        #[arg(long)]
        kind: String,
        #[arg(long)]
        socket: PathBuf,
    },
}

/// The provider rules of the fleet scenario's fake upstream (DESIGN §7a).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Upstream {
    /// Anthropic: RPM, ITPM, OTPM continuous buckets.
    TokenBucket,
    /// Azure OpenAI: RPM and estimate-charged TPM per 1-second period.
    PerSecond,
    /// Fixed 60-second windows.
    FixedMinute,
}

impl Upstream {
    pub fn name(self) -> &'static str {
        match self {
            Upstream::TokenBucket => "token-bucket",
            Upstream::PerSecond => "per-second",
            Upstream::FixedMinute => "fixed-minute",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    Latency,
    Throughput,
    Redis,
    Waiters,
    Python,
    Node,
    Go,
    /// DESIGN §17: the Python HTTP transport's cost per request and per 1,000-chunk
    /// stream, against a local fake upstream, next to `run()` around the same request.
    Transport,
    /// The engine alone, in process (not part of --all's socket figures, but run by it).
    Engine,
    /// DESIGN §15: interactive latency behind a saturating batch load, with and
    /// without priority classes (in process, like `engine`).
    Priorities,
    /// DESIGN §7a: upstream 429s of N sidecars against a fake provider (not in --all:
    /// it measures counts over minutes, not the cost budget).
    Fleet,
    /// DESIGN §12: a healthy client's call latency with and without two clients
    /// flooding `StatusJson` on a config of `--sources` sources.
    StatusFlood,
    /// DESIGN §19: fair turns among tenants, tenants' budgets exact across a fleet on
    /// Redis, and what a tenant costs a call (not in --all: minutes, like `fleet`).
    Tenants,
}

impl Scenario {
    const ALL: [Scenario; 11] = [
        Scenario::Latency,
        Scenario::Throughput,
        Scenario::Redis,
        Scenario::Waiters,
        Scenario::Python,
        Scenario::Node,
        Scenario::Go,
        Scenario::Transport,
        Scenario::Engine,
        Scenario::Priorities,
        Scenario::StatusFlood,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Latency => "latency",
            Scenario::Throughput => "throughput",
            Scenario::Redis => "redis",
            Scenario::Waiters => "waiters",
            Scenario::Python => "python",
            Scenario::Node => "node",
            Scenario::Go => "go",
            Scenario::Transport => "transport",
            Scenario::Engine => "engine",
            Scenario::Priorities => "priorities",
            Scenario::Fleet => "fleet",
            Scenario::StatusFlood => "status_flood",
            Scenario::Tenants => "tenants",
        }
    }

    /// The keys every line of the scenario carries (null when not measured).
    pub fn keys(self) -> &'static [&'static str] {
        match self {
            Scenario::Latency => &["rtt_p50_us", "rtt_p99_us", "floor_p50_us", "ratio"],
            Scenario::Throughput => &[
                "clients",
                "calls_per_s",
                "call_p50_us",
                "call_p99_us",
                "floor_calls_per_s",
                "ratio",
                "calls_per_s_v1",
                "sidecar_cpu_per_frame_us",
                "sidecar_sys_per_frame_us",
                "floor_cpu_per_frame_us",
                "floor_sys_per_frame_us",
            ],
            Scenario::Redis => &[
                "clients",
                "calls_per_s",
                "call_p50_us",
                "call_p99_us",
                "calls_per_s_v1",
                "redis_cmds_per_call",
                "script_calls_per_call",
                "script_us_p50",
                "redis_cpu_pct",
                "sidecar_cpu_per_frame_us",
            ],
            Scenario::Waiters => &[
                "waiters",
                "rss_mib",
                "cpu_pct_while_waiting",
                "release_ms",
                "quota_cpu_pct_while_waiting",
            ],
            Scenario::Python => &["mode", "calls_per_s", "baseline_calls_per_s", "ratio"],
            Scenario::Node | Scenario::Go => {
                &["calls_per_s", "python_asyncio_calls_per_s", "ratio"]
            }
            Scenario::Transport => &[
                "plain_us",
                "transport_us",
                "run_http_us",
                "overhead_ratio",
                "cpu_overhead_ratio",
                "stream_cpu_ratio",
            ],
            Scenario::Fleet => &[
                "upstream",
                "upstream_429s",
                "startup_429s",
                "utilisation",
                "calls_ok",
                "calls_failed",
            ],
            Scenario::Priorities => &[
                "interactive_p50_ms",
                "interactive_p99_ms",
                "interactive_p50_ms_without_classes",
                "interactive_p99_ms_without_classes",
                "batch_calls_per_s",
            ],
            Scenario::StatusFlood => &[
                "sources",
                "call_p50_us",
                "call_p50_us_flooded",
                "call_p99_us",
                "call_p99_us_flooded",
                "p50_ratio",
                "status_replies_per_s",
            ],
            Scenario::Tenants => &[
                "quiet_p99_ms",
                "quiet_p99_ms_fifo",
                "quiet_p99_ratio",
                "jain_index",
                "max_tenant_overrun_ratio",
                "leaked_holds",
                "cost_ratio_memory",
                "cost_ratio_redis",
                "cost_added_us_memory",
                "cost_added_us_redis",
                "redis_round_trips_per_call",
                "redis_round_trips_per_call_tenant",
            ],
            Scenario::Engine => &[
                "calls_per_s_1_task",
                "calls_per_s_64_tasks",
                "metrics_hook_ns",
                "clock_reads_ns",
            ],
        }
    }
}

/// Everything a scenario needs to know about the run.
pub struct Opts {
    pub clients: Vec<usize>,
    pub seconds: f64,
    pub repeat: usize,
    pub pin: bool,
    pub sidecar_bin: PathBuf,
    pub socket: Option<PathBuf>,
    pub redis_url: Option<String>,
    pub waiters: usize,
    /// Sources of `status-flood`'s large scope.
    pub sources: usize,
    pub concurrency: usize,
    pub python: PathBuf,
    pub python_driver: PathBuf,
    pub node_driver: PathBuf,
    pub go_driver: PathBuf,
    /// `transport`'s driver (bench/drivers/python_transport.py).
    pub transport_driver: PathBuf,
    /// The fleet scenario's settings.
    pub fleet: Fleet,
    /// The tenants scenario's settings.
    pub tenants: Tenants,
}

/// What `--scenario tenants` runs.
pub struct Tenants {
    /// The parts to run.
    pub parts: Vec<String>,
    /// `fairness`: seconds of each of its two runs.
    pub fair_seconds: f64,
    /// `fleet`: seconds the workers call.
    pub exact_seconds: f64,
    /// `fleet`: tenants called for.
    pub count: u64,
}

impl Tenants {
    pub fn fair_window(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.fair_seconds)
    }

    pub fn exact_window(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.exact_seconds)
    }
}

/// What `--scenario fleet` runs.
pub struct Fleet {
    pub hosts: usize,
    pub workers: usize,
    pub upstream: Upstream,
    pub config: String,
    pub rpm: u64,
    pub tpm: u64,
    pub driver: PathBuf,
    /// A Redis Cluster with replicas instead of one server.
    pub cluster: bool,
    /// The Redis fault struck at mid-run.
    pub fault: String,
    /// How long `redis-pause` lasts, in seconds.
    pub fault_for: f64,
    /// `sidecar.degraded_share`.
    pub degraded_share: String,
    /// DESIGN §18: share of each limit a consumer outside PolyGate uses.
    pub foreign: f64,
    /// DESIGN §18: `on` | `off`, the sources' `observe_limits`.
    pub observe: String,
    /// DESIGN §18: the limits the headers carry configured as `"auto"`.
    pub auto: bool,
    /// DESIGN §18: `aimd` | `off`, the sources' `learn_rate`.
    pub learn_rate: String,
}

impl Opts {
    /// The warm-up before each measured window.
    pub fn warmup(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64((self.seconds / 5.0).min(1.0))
    }

    pub fn window(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.seconds)
    }
}

/// One output line under construction.
pub struct Line(pub Map<String, Value>);

impl Line {
    pub fn new(s: Scenario) -> Line {
        let mut m = Map::new();
        m.insert("scenario".into(), s.name().into());
        for k in s.keys() {
            m.insert((*k).into(), Value::Null);
        }
        Line(m)
    }

    pub fn set(&mut self, k: &str, v: impl Into<Value>) -> &mut Self {
        self.0.insert(k.to_string(), v.into());
        self
    }

    /// A float, rounded to 3 significant decimals (NaN/inf become null).
    pub fn num(&mut self, k: &str, v: f64) -> &mut Self {
        let v = if v.is_finite() {
            Value::from((v * 1000.0).round() / 1000.0)
        } else {
            Value::Null
        };
        self.0.insert(k.to_string(), v);
        self
    }

    pub fn opt(&mut self, k: &str, v: Option<f64>) -> &mut Self {
        match v {
            Some(v) => self.num(k, v),
            None => self.set(k, Value::Null),
        }
    }
}

/// The per-key median of repeated lines (numbers only; other values from the first).
fn median_of(lines: Vec<Line>) -> Line {
    let mut it = lines.into_iter();
    let Some(mut first) = it.next() else {
        return Line(Map::new());
    };
    let rest: Vec<Line> = it.collect();
    if rest.is_empty() {
        return first;
    }
    let keys: Vec<String> = first.0.keys().cloned().collect();
    for k in keys {
        let mut v: Vec<f64> = std::iter::once(&first)
            .chain(rest.iter())
            .filter_map(|l| l.0.get(&k).and_then(Value::as_f64))
            .collect();
        if v.len() != rest.len() + 1 || k == "clients" || k == "waiters" {
            continue;
        }
        v.sort_by(f64::total_cmp);
        first.num(&k, v[v.len() / 2]);
    }
    first.set("runs", rest.len() + 1);
    first
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::EchoServer { kind, socket }) = &cli.command {
        let Some(kind) = echo::Kind::parse(kind) else {
            eprintln!("unknown echo server kind {kind:?}");
            return ExitCode::FAILURE;
        };
        if let Err(e) = echo::serve(kind, socket) {
            eprintln!("echo server: {e}");
            return ExitCode::FAILURE;
        }
        return ExitCode::SUCCESS;
    }
    if cli.print_config {
        let socket = PathBuf::from("/tmp/polygate-bench.sock");
        print!("{}", target::config(&socket, &target::Backend::Memory));
        return ExitCode::SUCCESS;
    }
    let mut scenarios = if cli.all {
        Scenario::ALL.to_vec()
    } else {
        cli.scenario.clone()
    };
    scenarios.dedup();
    if scenarios.is_empty() {
        eprintln!("polygate-bench: name a --scenario (or --all); see --help");
        return ExitCode::from(2);
    }
    // Relative default paths are meant from the repository root.
    let root = procs::repo_root();
    let rel = |p: &PathBuf| {
        if p.is_relative() {
            root.join(p)
        } else {
            p.clone()
        }
    };
    let mut opts = Opts {
        clients: cli.clients.clone(),
        seconds: cli.seconds,
        repeat: cli.repeat.max(1),
        pin: cli.pin,
        sidecar_bin: rel(&cli.sidecar_bin),
        socket: cli.socket.clone(),
        redis_url: cli.redis_url.clone(),
        waiters: cli.waiters,
        sources: cli.sources,
        concurrency: cli.concurrency,
        python: rel(&cli.python),
        python_driver: rel(&cli.python_driver),
        node_driver: rel(&cli.node_driver),
        go_driver: rel(&cli.go_driver),
        transport_driver: rel(&cli.transport_driver),
        fleet: Fleet {
            hosts: cli.hosts,
            workers: cli.workers,
            upstream: cli.upstream,
            config: cli.fleet_config.clone(),
            rpm: cli.rpm,
            tpm: cli.tpm,
            driver: rel(&cli.fleet_driver),
            cluster: cli.cluster,
            fault: cli.fault.clone(),
            fault_for: cli.fault_for,
            degraded_share: cli.degraded_share.clone(),
            foreign: cli.foreign,
            observe: cli.observe.clone(),
            auto: cli.auto,
            learn_rate: cli.learn_rate.clone(),
        },
        tenants: Tenants {
            parts: cli.tenant_parts.clone(),
            fair_seconds: cli.fair_seconds,
            exact_seconds: cli.exact_seconds,
            count: cli.tenant_count.max(1),
        },
    };
    if cli.smoke {
        opts.seconds = opts.seconds.min(0.2);
        opts.clients = vec![1, 4];
        opts.waiters = opts.waiters.min(200);
        opts.sources = opts.sources.min(300);
        opts.concurrency = opts.concurrency.min(4);
        opts.repeat = 1;
        opts.tenants.fair_seconds = opts.tenants.fair_seconds.min(2.0);
        opts.tenants.exact_seconds = opts.tenants.exact_seconds.min(1.5);
        opts.tenants.count = opts.tenants.count.min(100);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("polygate-bench: cannot start a runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut ctx = context::Ctx::new(&opts, rt);
    let mut failed = false;
    for s in scenarios {
        let load = procs::loadavg();
        let runs: Vec<Vec<Line>> = (0..opts.repeat)
            .map(|_| scenarios::run(&mut ctx, s))
            .collect();
        // Transpose: the median of each line over the runs.
        let n = runs.iter().map(Vec::len).min().unwrap_or(0);
        let mut runs: Vec<std::vec::IntoIter<Line>> =
            runs.into_iter().map(Vec::into_iter).collect();
        for _ in 0..n {
            let lines: Vec<Line> = runs.iter_mut().filter_map(Iterator::next).collect();
            let mut line = median_of(lines);
            line.set("loadavg", load.clone());
            failed |= line.0.contains_key("error");
            println!("{}", Value::Object(line.0));
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

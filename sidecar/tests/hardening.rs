//! DESIGN §12 "Bounded under abuse", one test (or a few) per finding of issue 10:
//! numeric inputs checked before arithmetic (5), the socket directory and our own
//! socket file (6), client-triggered log lines summarised (2), and — through the
//! real server — the global memory budget (1), reply sizes (3), idle and partial-frame
//! timeouts (7) and the connection cap (8). Every test runs under a timeout; memory
//! and log bounds are asserted with generous margins, never timings.

mod support;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ipc_protocol::{BreakerState, CallSpec, ErrorKind, Outcome, Reply, Request, Usage};
use polygate::backend::memory::MemoryBackend;
use polygate::backend::State;
use polygate::clock::{Clock, ManualClock};
use polygate::config::parse_str;
use polygate::engine::{Engine, EngineError};
use support::daemon::{sidecar_command, Client, Daemon};

/// Every test body runs under this bound: a hang fails instead of eating the CI budget.
const TEST_TIMEOUT: Duration = Duration::from_secs(120);

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, f)
        .await
        .expect("test timed out")
}

const TWO_SOURCES: &str =
    "[[scopes.chat.sources]]\nname = \"a\"\n[[scopes.chat.sources]]\nname = \"b\"\n";

fn engine_at(uptime: Duration) -> (Arc<Engine<MemoryBackend>>, Arc<ManualClock>) {
    let cfg = parse_str(TWO_SOURCES, []).expect("valid config");
    let manual = Arc::new(ManualClock::new());
    manual.advance(uptime);
    let clock: Arc<dyn Clock> = manual.clone();
    let e = Engine::new(&cfg, MemoryBackend::new(clock.clone(), ["a", "b"]), clock);
    (e, manual)
}

// ---- item 5: numeric inputs -------------------------------------------------------

/// The largest `f64` below 2^64 seconds: `Duration::try_from_secs_f64` takes it, and
/// `now + d` overflowed once the process had been up for 2048 s (~34 min).
const HUGE_SECONDS: f64 = 18_446_744_073_709_549_568.0;

#[tokio::test]
async fn force_open_with_an_absurd_duration_is_refused_and_changes_nothing() {
    bounded(async {
        let (e, _clock) = engine_at(Duration::from_secs(35 * 60));
        let before = e.status().await;
        for secs in [HUGE_SECONDS, 1e12, 400.0 * 86_400.0] {
            let d = Duration::try_from_secs_f64(secs).expect("a valid Duration");
            let r = e.force_open("a", d).await;
            match r {
                Err(EngineError::InvalidArgument(m)) => {
                    assert!(m.contains("seconds"), "names the field: {m}")
                }
                other => panic!("force_open({secs}) = {other:?}"),
            }
        }
        assert_eq!(
            e.status().await,
            before,
            "a refused force_open changes nothing"
        );
        // A long but sane duration still works.
        let a = e
            .force_open("a", Duration::from_secs(30 * 86_400))
            .await
            .expect("30 days is accepted");
        assert_eq!(a.state, State::Open);
    })
    .await
}

/// Scopes of the daemon tests: `chat` fail-fast over sources a and b.
const SCOPES: &str = r#"
[scopes.chat]
circuit_open = "fail_fast"
quota_full = "fail_fast"

[[scopes.chat.sources]]
name = "a"
timeout = "10s"

[[scopes.chat.sources]]
name = "b"
timeout = "10s"
"#;

fn my_uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

fn error_kind(r: &Reply) -> Option<ErrorKind> {
    match r {
        Reply::Error(e) => Some(e.kind),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn wire_numbers_are_checked_before_any_arithmetic() {
    let d = Daemon::start(&format!("admin_uids = [{}]", my_uid()), SCOPES, &[]);
    bounded(async {
        let mut c = Client::connect(&d.socket, 2).await;
        for seconds in [HUGE_SECONDS, 1e12, f64::NAN, f64::INFINITY, -1.0, 0.0, -0.0] {
            let r = c
                .call(Request::ForceOpen {
                    source: "a".into(),
                    seconds,
                })
                .await;
            assert_eq!(
                error_kind(&r),
                Some(ErrorKind::InvalidArgument),
                "ForceOpen {seconds}: {r:?}"
            );
        }
        let Reply::Status(s) = c.call(Request::Status).await else {
            panic!("status")
        };
        let a = &s.scopes[0].sources[0];
        assert_eq!(
            (a.state, a.epoch),
            (BreakerState::Closed, 0),
            "nothing changed: {a:?}"
        );

        // Token counts: far beyond the limit, and a split whose sum overflows u64.
        let r = c
            .call(Request::BeginCall {
                scope: "chat".into(),
                est_tokens: Some(u64::MAX),
            })
            .await;
        assert_eq!(error_kind(&r), Some(ErrorKind::InvalidArgument), "{r:?}");
        let r = c
            .call(Request::Start(CallSpec {
                scope: "chat".into(),
                est_tokens: None,
                priority: None,
                est_input_tokens: Some(u64::MAX),
                est_output_tokens: Some(u64::MAX),
            }))
            .await;
        assert_eq!(error_kind(&r), Some(ErrorKind::InvalidArgument), "{r:?}");

        // A permit reported with absurd numbers stays the client's: nothing applied.
        let Reply::Started { permit, .. } = c
            .call(Request::Start(CallSpec {
                scope: "chat".into(),
                est_tokens: Some(10),
                priority: None,
                est_input_tokens: None,
                est_output_tokens: None,
            }))
            .await
        else {
            panic!("start")
        };
        for outcome in [
            Outcome::RateLimited {
                retry_after_s: Some(f64::NAN),
            },
            Outcome::RateLimited {
                retry_after_s: Some(f64::NEG_INFINITY),
            },
            Outcome::Success {
                tokens: Some(u64::MAX),
                count_attempt: true,
            },
            Outcome::SuccessUsage {
                usage: Usage {
                    tokens: None,
                    input_tokens: Some(u64::MAX),
                    output_tokens: Some(u64::MAX),
                },
                count_attempt: true,
            },
        ] {
            let r = c
                .call(Request::Report {
                    permit,
                    outcome: outcome.clone(),
                })
                .await;
            assert_eq!(
                error_kind(&r),
                Some(ErrorKind::InvalidArgument),
                "{outcome:?}: {r:?}"
            );
        }
        let r = c
            .call(Request::Finish {
                permit,
                outcome: Outcome::Cancelled,
            })
            .await;
        assert!(matches!(r, Reply::Reported { .. }), "still ours: {r:?}");

        // A finite 429 block of any size is accepted and cut to max_rate_limit_block
        // (DESIGN §7), with no overflow in the deadline arithmetic.
        let Reply::Started { permit, .. } = c
            .call(Request::Start(CallSpec {
                scope: "chat".into(),
                est_tokens: Some(10),
                priority: None,
                est_input_tokens: None,
                est_output_tokens: None,
            }))
            .await
        else {
            panic!("start")
        };
        let r = c
            .call(Request::Finish {
                permit,
                outcome: Outcome::RateLimited {
                    retry_after_s: Some(HUGE_SECONDS),
                },
            })
            .await;
        assert!(
            matches!(r, Reply::Reported { .. }),
            "accepted, capped: {r:?}"
        );
    })
    .await;
    let mut d = d;
    assert!(d.alive(), "{}", d.log_text());
    assert!(!d.log_text().contains("panicked"), "{}", d.log_text());
}

#[test]
fn config_numbers_are_capped_naming_the_key() {
    let source = |extra: &str| format!("[[scopes.chat.sources]]\nname = \"a\"\n{extra}\n");
    let cases = [
        (
            format!(
                "[scopes.chat.breaker]\ncooldown = \"100000000years\"\nmax_cooldown = \"100000000years\"\n{}",
                source("")
            ),
            "scopes.chat.breaker.cooldown",
        ),
        (source("timeout = \"500000000years\""), "timeout"),
        (
            format!("[scopes.chat]\nstall_window = \"1000years\"\n{}", source("")),
            "scopes.chat.stall_window",
        ),
        (
            format!("[sidecar]\nshutdown_grace = \"99999years\"\n{}", source("")),
            "sidecar.shutdown_grace",
        ),
        (source("tpm = 9223372036854775807"), "tpm"),
        (source("est_tokens = 2000000000000"), "est_tokens"),
        (
            format!("[scopes.chat.pacer]\nmax = 1e300\ninitial = 8.0\n{}", source("")),
            "scopes.chat.pacer.max",
        ),
        (
            format!("[scopes.chat.pacer]\nincrease = 1e300\n{}", source("")),
            "scopes.chat.pacer.increase",
        ),
    ];
    for (toml, key) in cases {
        match parse_str(&toml, []) {
            Err(e) => assert!(e.to_string().contains(key), "{key}: {e}"),
            Ok(_) => panic!("accepted {toml}"),
        }
    }
}

// ---- item 6: the socket's directory and our own socket file -------------------------

/// Run the binary on a config whose socket is `socket`; it must exit at once.
fn start_fails(socket: &std::path::Path) -> String {
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = cfg_dir.path().join("polygate.toml");
    std::fs::write(
        &cfg,
        format!("[sidecar]\nsocket = \"{}\"\n{SCOPES}", socket.display()),
    )
    .unwrap();
    let mut child = sidecar_command()
        .arg("--config")
        .arg(&cfg)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the sidecar started on {}", socket.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_socket_directory_other_users_can_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    std::fs::create_dir(&dir).unwrap();
    let socket = dir.join("sidecar.sock");
    for mode in [0o777, 0o1777, 0o770] {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
        let err = start_fails(&socket);
        assert!(
            err.contains(&dir.display().to_string()),
            "names the dir: {err}"
        );
        assert!(
            err.contains(&format!("{mode:04o}")),
            "names the mode: {err}"
        );
        assert!(err.contains("owned by uid"), "names the owner: {err}");
        assert!(!socket.exists(), "no socket was created");
    }
    // Owned by another user, even with a tight mode (needs root to arrange).
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    if nix::unistd::geteuid().is_root() {
        nix::unistd::chown(&dir, Some(nix::unistd::Uid::from_raw(4242)), None).unwrap();
        let err = start_fails(&socket);
        assert!(err.contains("uid 4242"), "names the owner: {err}");
    } else {
        eprintln!("not root: the 'owned by another uid' case needs chown; not run");
    }
}

#[test]
fn shutdown_removes_only_the_socket_this_process_created() {
    let mut d = Daemon::start("", SCOPES, &[]);
    let socket = d.socket.clone();
    // Someone replaces the socket file while the daemon runs.
    std::fs::rename(&socket, d.dir.path().join("ours.sock")).unwrap();
    let theirs = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let status = d.stop();
    assert!(status.success(), "{status:?}");
    assert!(
        socket.exists(),
        "the replacement socket must survive our shutdown: {}",
        d.log_text()
    );
    assert!(
        std::os::unix::net::UnixStream::connect(&socket).is_ok(),
        "and still be the other listener's"
    );
    drop(theirs);
}

// ---- item 8: the connection cap -----------------------------------------------------

/// Start the binary on `sidecar` lines under `ulimit -n {nofile}` (soft and hard);
/// returns its stderr once it exits, or kills it after `run_for` and returns that.
fn run_with_fd_limit(nofile: u32, sidecar: &str, run_for: Duration) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("polygate.toml");
    let socket = dir.path().join("s.sock");
    std::fs::write(
        &cfg,
        format!(
            "[sidecar]\nsocket = \"{}\"\n{sidecar}\n{SCOPES}",
            socket.display()
        ),
    )
    .unwrap();
    let mut sh = std::process::Command::new("sh");
    for (k, _) in std::env::vars().filter(|(k, _)| k.contains("__")) {
        sh.env_remove(k);
    }
    let mut child = sh
        .arg("-c")
        .arg(format!(
            "ulimit -n {nofile} && exec \"$POLYGATE_TEST_BIN\" --config \"$POLYGATE_TEST_CFG\""
        ))
        .env("POLYGATE_TEST_BIN", support::daemon::BIN)
        .env("POLYGATE_TEST_CFG", &cfg)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + run_for;
    let exited = loop {
        if child.try_wait().unwrap().is_some() {
            break true;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    (exited, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn max_connections_must_fit_the_fd_limit() {
    let (exited, err) = run_with_fd_limit(512, "max_connections = 1000", Duration::from_secs(20));
    assert!(exited, "refused at start-up: {err}");
    assert!(
        err.contains("max_connections = 1000") && err.contains("RLIMIT_NOFILE) is 512"),
        "names both numbers: {err}"
    );
    // Unset: derived from the limit, and the daemon serves.
    let (exited, err) = run_with_fd_limit(512, "", Duration::from_secs(3));
    assert!(!exited, "started: {err}");
    assert!(
        err.contains("max_connections=344"),
        "derived below 512: {err}"
    );
}

// ---- item 3: replies within the client's limit --------------------------------------

/// A scope `big` of `n` sources with ~100-byte names, fail-fast.
fn many_sources(n: usize) -> String {
    let mut s = String::from("[scopes.big]\ncircuit_open = \"fail_fast\"\n");
    for i in 0..n {
        s.push_str(&format!(
            "[[scopes.big.sources]]\nname = \"source-{i:04}-{}\"\n",
            "n".repeat(90)
        ));
    }
    s
}

#[tokio::test(flavor = "multi_thread")]
async fn replies_fit_the_client_and_status_may_reach_16_mib() {
    let d = Daemon::start(
        &format!("admin_uids = [{}]", my_uid()),
        &format!("{SCOPES}\n{}", many_sources(600)),
        &[],
    );
    bounded(async {
        // The CLI prints all 600 sources (the status reply is over 64 KiB).
        let socket = d.socket.clone();
        let out = tokio::task::spawn_blocking(move || {
            sidecar_command()
                .arg("status")
                .arg("--socket")
                .arg(&socket)
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{out:?}");
        assert_eq!(stdout.matches("source-").count(), 600, "{stdout}");

        // Both status replies over the wire, from a client accepting 16 MiB.
        let mut c = Client::connect(&d.socket, 2).await;
        let Reply::Status(s) = c.call(Request::Status).await else {
            panic!("Status")
        };
        assert_eq!(s.scopes[1].sources.len(), 600);
        let Reply::StatusJson(j) = c.call(Request::StatusJson).await else {
            panic!("StatusJson")
        };
        assert!(j.len() > 65536, "{}", j.len());

        // A 60 KB scope name: UnknownScope (not Internal), its echo cut short.
        let long = "s".repeat(60_000);
        for request in [
            Request::BeginCall {
                scope: long.clone(),
                est_tokens: None,
            },
            Request::Reset {
                source: long.clone(),
            },
        ] {
            c.next_id += 1;
            let id = c.next_id;
            c.send(id, request).await;
            let f = c.recv().await;
            assert_eq!(f.id, id);
            let encoded = ipc_protocol::encode_server(&f).unwrap().len();
            let Reply::Error(e) = f.reply else {
                panic!("{f:?}")
            };
            assert!(
                matches!(e.kind, ErrorKind::UnknownScope | ErrorKind::InvalidArgument),
                "{e:?}"
            );
            assert!(encoded < 1024, "an echo of {encoded} bytes");
        }

        // CircuitOpen over 600 long-named sources: more reasons than a frame holds.
        for i in 0..600 {
            let r = c
                .call(Request::ForceOpen {
                    source: format!("source-{i:04}-{}", "n".repeat(90)),
                    seconds: 600.0,
                })
                .await;
            assert_eq!(r, Reply::Ok);
        }
        c.next_id += 1;
        let id = c.next_id;
        let spec = CallSpec {
            scope: "big".into(),
            est_tokens: None,
            priority: None,
            est_input_tokens: None,
            est_output_tokens: None,
        };
        c.send(id, Request::Start(spec)).await;
        let f = c.recv().await;
        let encoded = ipc_protocol::encode_server(&f).unwrap().len();
        assert!(encoded <= 65536, "{encoded} bytes");
        let Reply::Error(e) = f.reply else {
            panic!("{f:?}")
        };
        assert_eq!(e.kind, ErrorKind::CircuitOpen, "{}", e.message);
        assert!(!e.per_source_reasons.is_empty());
    })
    .await;
}

// ---- items 7, 8, 1, 2 through the server: cap, idle, memory, log volume ------------

/// One frame (length prefix included) of `request` with id `id`.
fn frame_bytes(id: u64, request: Request) -> Vec<u8> {
    let payload = ipc_protocol::encode_client(&ipc_protocol::ClientFrame { id, request }).unwrap();
    let mut out = (payload.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(&payload);
    out
}

/// The connection ends (EOF or reset) within the reply timeout; frames before the end
/// are returned.
async fn until_closed(c: &mut Client) -> Vec<ipc_protocol::ServerFrame> {
    use futures_util::StreamExt;
    let mut frames = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), c.framed.next()).await {
            Ok(Some(Ok(f))) => frames.push(f),
            Ok(_) => return frames,
            Err(_) => panic!("still open after 10 s; got {frames:?}"),
        }
    }
}

/// Frames until one with id `id` (included) or the close.
async fn until_closed_or(c: &mut Client, id: u64) -> Vec<ipc_protocol::ServerFrame> {
    use futures_util::StreamExt;
    let mut frames = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), c.framed.next()).await {
            Ok(Some(Ok(f))) => {
                let last = f.id == id;
                frames.push(f);
                if last {
                    return frames;
                }
            }
            Ok(_) => return frames,
            Err(_) => panic!("no reply {id} and no close within 10 s; got {frames:?}"),
        }
    }
}

fn begin_chat() -> Request {
    Request::BeginCall {
        scope: "chat".into(),
        est_tokens: None,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn past_max_connections_a_worker_is_refused_overloaded_and_a_freed_slot_admits() {
    let d = Daemon::start("max_connections = 2\nadmin_uids = [4242]", SCOPES, &[]);
    bounded(async {
        let mut held = vec![
            Client::connect(&d.socket, 2).await,
            Client::connect(&d.socket, 2).await,
        ];
        for c in &mut held {
            assert!(matches!(
                c.call(begin_chat()).await,
                Reply::CallBegun { .. }
            ));
        }
        // The third is no admin (admin_uids = [4242]): the reserve is not its, so it
        // is refused `Overloaded` (id 0) and reads it after its Hello, no reset.
        let mut third = Client::raw(&d.socket).await.unwrap();
        let _ = third.try_send(1, support::daemon::hello(2)).await;
        let frames = until_closed(&mut third).await;
        let e = match frames.as_slice() {
            [f] if f.id == 0 => match &f.reply {
                Reply::Error(e) => e.clone(),
                r => panic!("{r:?}"),
            },
            other => panic!("{other:?}"),
        };
        assert_eq!(e.kind, ErrorKind::Overloaded, "{e:?}");
        assert!(e.message.contains("max_connections"), "{}", e.message);
        assert!(e.message.contains("admin_uids"), "{}", e.message);
        drop(third);
        drop(held.pop());

        // A freed slot lets a new worker in (the close is noticed asynchronously).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            // Until the closes are noticed a new connection may still be refused.
            // A refusal is written and the socket closed without reading: sending
            // may fail with a broken pipe, which is the same "not yet".
            let mut c = Client::raw(&d.socket).await.unwrap();
            let sent = c.try_send(1, support::daemon::hello(2)).await.is_ok()
                && c.try_send(2, begin_chat()).await.is_ok();
            let frames = if sent {
                until_closed_or(&mut c, 2).await
            } else {
                Vec::new()
            };
            if frames
                .iter()
                .any(|f| f.id == 2 && matches!(f.reply, Reply::CallBegun { .. }))
            {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "never admitted: {frames:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_and_stuck_partial_frames_are_closed_but_a_held_call_is_not() {
    let d = Daemon::start("idle_timeout = \"300ms\"", SCOPES, &[]);
    bounded(async {
        let mut idle = Client::connect(&d.socket, 2).await;
        let mut holder = Client::connect(&d.socket, 2).await;
        assert!(matches!(holder.call(begin_chat()).await, Reply::CallBegun { .. }));
        let mut partial = Client::connect(&d.socket, 2).await;
        let bytes = frame_bytes(7, Request::Ping);
        {
            use tokio::io::AsyncWriteExt;
            partial.framed.get_mut().write_all(&bytes[..3]).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(until_closed(&mut idle).await.is_empty(), "idle closed silently");
        let frames = until_closed(&mut partial).await;
        assert!(
            matches!(frames.as_slice(), [f] if matches!(&f.reply, Reply::Error(e) if e.kind == ErrorKind::Overloaded && e.message.contains("partial frame"))),
            "{frames:?}"
        );
        assert_eq!(holder.call(Request::Ping).await, Reply::Pong, "a call holder stays");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn clients_that_never_read_cannot_grow_memory_and_others_are_served() {
    let d = Daemon::start(
        "max_buffered = 8388608",
        &format!("{SCOPES}\n{}", many_sources(600)),
        &[],
    );
    bounded(async {
        let before = d.rss_kib();
        let mut hogs = Vec::new();
        for _ in 0..4 {
            let mut c = Client::connect(&d.socket, 2).await;
            let mut burst = Vec::new();
            for id in 0..3000u64 {
                burst.extend(frame_bytes(100 + id, Request::Status));
            }
            let stream = c.framed.get_mut();
            let (_r, mut w) = stream.split();
            use tokio::io::AsyncWriteExt;
            // Writes until the sidecar stops reading (then the write blocks).
            let _ = tokio::time::timeout(Duration::from_secs(3), w.write_all(&burst)).await;
            hogs.push(c);
        }
        let mut peak = 0;
        for _ in 0..10 {
            peak = peak.max(d.rss_kib());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut good = Client::connect(&d.socket, 2).await;
        assert_eq!(good.call(Request::Ping).await, Reply::Pong);
        assert!(
            peak < before + 100 * 1024,
            "RSS grew from {before} KiB to {peak} KiB"
        );
        drop(hogs);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(matches!(good.call(Request::Status).await, Reply::Status(_)));
    })
    .await;
    let mut d = d;
    assert!(d.alive());
}

/// Issue 29 item 2: twenty connections pipelining `Status` (a ~45 KB reply: 280
/// sources) and reading nothing. Every byte they make the sidecar hold — replies
/// being built, waiting for the sidecar-wide status pacing, built and not yet
/// written — must be within the reply budgets (1 MiB unsent per connection,
/// `max_buffered` in all), so RSS grows by at most 150 MB (the bound of issue 10;
/// before, each paced request held its own copy of the report outside any budget:
/// +650 MiB with two threads here); and a healthy client is still answered. Run on
/// the default current-thread runtime and on two worker threads (in a debug build
/// only two threads produce status bytes faster than the pacing lets out, so
/// requests wait for it: the case that grew).
#[tokio::test(flavor = "multi_thread")]
async fn twenty_connections_pipelining_status_unread_stay_within_the_reply_budget() {
    for threads in [1, 2] {
        let mut d = Daemon::start(
            &format!("worker_threads = {threads}"),
            &format!("{SCOPES}\n{}", many_sources(280)),
            &[],
        );
        bounded(status_flood(&d, threads)).await;
        assert!(d.alive());
    }
}

/// The flood of [`twenty_connections_pipelining_status_unread_stay_within_the_reply_budget`]
/// against `d` (`threads`: its `worker_threads`, for the messages).
async fn status_flood(d: &Daemon, threads: usize) {
    /// Connections that flood.
    const HOGS: usize = 20;
    /// `Status` frames each one pipelines: more than `max_in_flight` (1024) and
    /// than 1 MiB of replies, so the sidecar has to stop reading them.
    const FRAMES: u64 = 4000;
    /// How long RSS is watched once every flood is written (past the 2 s after
    /// which a connection that reads nothing is closed).
    const WATCH: Duration = Duration::from_secs(4);
    /// The bound of issue 10: 150 MB (VmRSS counts KiB).
    const GROWTH_KIB: u64 = 150_000_000 / 1024;
    let mut good = Client::connect(&d.socket, 2).await;
    let Reply::Status(s) = good.call(Request::Status).await else {
        panic!("status")
    };
    let size = ipc_protocol::encode_server(&ipc_protocol::ServerFrame {
        id: 0,
        reply: Reply::Status(s),
    })
    .unwrap()
    .len();
    assert!(size > 40_000, "a ~45 KB status reply: {size} bytes");
    let before = d.rss_kib();
    let mut burst = Vec::new();
    for id in 0..FRAMES {
        burst.extend(frame_bytes(100 + id, Request::Status));
    }
    let burst = Arc::new(burst);
    let mut writers = Vec::new();
    for _ in 0..HOGS {
        let mut c = Client::connect(&d.socket, 2).await;
        let burst = burst.clone();
        writers.push(tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            // Until the sidecar stops reading (then the write blocks) or closes.
            let _ =
                tokio::time::timeout(Duration::from_secs(3), c.framed.get_mut().write_all(&burst))
                    .await;
            c
        }));
    }
    let mut hogs = Vec::new();
    for w in writers {
        hogs.push(w.await.expect("writer"));
    }
    let mut peak = d.rss_kib().max(before);
    let watch = std::time::Instant::now();
    // Served during the flood (promptly or not: that is the bench's to measure).
    assert_eq!(
        good.call(Request::Ping).await,
        Reply::Pong,
        "{threads} threads"
    );
    while watch.elapsed() < WATCH {
        peak = peak.max(d.rss_kib());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "status flood, worker_threads = {threads}: RSS {before} KiB -> peak {peak} KiB \
         (+{} MiB)",
        (peak - before) / 1024
    );
    assert!(
        peak <= before + GROWTH_KIB,
        "worker_threads = {threads}: RSS grew from {before} KiB to {peak} KiB (+{} MiB, \
         bound 150 MB)",
        (peak - before) / 1024
    );
    // And after it (the flood's clients are still connected, or closed for not reading).
    let r = good.call(Request::Status).await;
    assert!(matches!(r, Reply::Status(_)), "{threads} threads: {r:?}");
    drop(hogs);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_bad_requests_writes_a_bounded_number_of_log_lines() {
    let d = Daemon::start("", SCOPES, &[]);
    bounded(async {
        let mut c = Client::connect(&d.socket, 2).await;
        let scope = "x".repeat(20_000);
        for round in 0..20u64 {
            for i in 0..100u64 {
                let r = Request::BeginCall {
                    scope: scope.clone(),
                    est_tokens: None,
                };
                c.send(1000 + round * 100 + i, r).await;
            }
            for _ in 0..100 {
                let f = c.recv().await;
                assert!(matches!(f.reply, Reply::Error(_)), "{f:?}");
            }
        }
    })
    .await;
    std::thread::sleep(Duration::from_millis(1500));
    let log = d.log_text();
    let lines = log.lines().count();
    assert!(lines < 100, "{lines} log lines for 2000 bad requests");
    assert!(log.len() < 64 * 1024, "{} bytes of log", log.len());
}

//! The agent, the allocator, the dashboard and `converge watch` stop on SIGTERM and on
//! Ctrl-C (SIGINT) while they are still trying to reach NATS at start-up (pointed at a port
//! where nothing listens), and on SIGTERM the
//! dashboard and watch also while connected, and all four also after the server went away
//! while they ran (dashboard and watch on Ctrl-C too): `systemctl stop` and Ctrl-C must not wait for a
//! server that may never come.

use converge_tests::bin_path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The agent's arguments in these tests: one fake GPU, its state in its work directory.
const AGENT_ARGS: [&str; 6] = [
    "--host-id",
    "sig1",
    "--fake-gpus",
    "1",
    "--state-dir",
    "state",
];

/// A loopback port nothing listens on (bound once to pick it, then released).
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Starts `binary` with `args` against a NATS URL where nothing listens, waits until its log
/// says it is retrying, sends SIGTERM and returns how long it took to exit, with its log.
fn stop_while_connecting(
    binary: &str,
    args: &[&str],
) -> (Duration, std::process::ExitStatus, String) {
    let url = format!("nats://127.0.0.1:{}", closed_port());
    stop_when_ready(binary, &url, args, "retrying in")
}

/// Starts `binary` with `args` against the NATS server at `url`, waits until its log
/// (stderr, `RUST_LOG=info`) contains `ready`, sends SIGTERM and returns how long it took to
/// exit, its exit status and its log. Panics when it exits before it is ready, is not ready
/// within 20 s, or still runs 10 s after the signal.
fn stop_when_ready(
    binary: &str,
    url: &str,
    args: &[&str],
    ready: &str,
) -> (Duration, std::process::ExitStatus, String) {
    let mut p = Logged::start(binary, url, args);
    p.wait_for(ready);
    p.stop()
}

/// A binary under test, its log (stderr) in a temporary directory that is also its working
/// directory.
struct Logged {
    what: String,
    child: std::process::Child,
    log: std::path::PathBuf,
    _work: tempfile::TempDir,
}

impl Drop for Logged {
    /// A test that failed half way leaves no process behind.
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Logged {
    fn start(binary: &str, url: &str, args: &[&str]) -> Self {
        let work = tempfile::tempdir().unwrap();
        let log = work.path().join("log");
        let child = Command::new(bin_path(binary))
            .args(["--nats-url", url])
            .args(args)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .current_dir(work.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Self {
            what: format!("{binary} {args:?}"),
            child,
            log,
            _work: work,
        }
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (at most 20 s) until the log contains `line`; panics if the process exits first.
    fn wait_for(&mut self, line: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = self.text();
            if text.contains(line) {
                return;
            }
            assert!(
                self.child.try_wait().unwrap().is_none(),
                "{} exited before {line:?}:\n{text}",
                self.what
            );
            assert!(
                Instant::now() < deadline,
                "{} never logged {line:?}:\n{text}",
                self.what
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends SIGTERM and waits for the exit (killed and a panic after 10 s).
    fn stop(&mut self) -> (Duration, std::process::ExitStatus, String) {
        self.stop_with("-TERM")
    }

    /// Sends `signal` (`-TERM`, `-INT`) and waits for the exit (killed and a panic after
    /// 10 s).
    fn stop_with(&mut self, signal: &str) -> (Duration, std::process::ExitStatus, String) {
        let ok = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
        let sent = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if sent.elapsed() > Duration::from_secs(10) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "{} still running 10 s after kill {signal}:\n{}",
                    self.what,
                    self.text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        (sent.elapsed(), status, self.text())
    }
}

/// `binary` exited with status 0 within 2 s of SIGTERM, saying it stopped before NATS.
fn assert_stops_at_once(binary: &str, args: &[&str]) {
    let (took, status, log) = stop_while_connecting(binary, args);
    println!("{binary} exited {took:?} after SIGTERM ({status})");
    assert!(took < Duration::from_secs(2), "took {took:?}:\n{log}");
    assert!(status.success(), "{status}:\n{log}");
    assert!(
        log.contains("stopped before NATS could be reached"),
        "{log}"
    );
}

#[test]
fn the_agent_stops_on_sigterm_while_nats_cannot_be_reached() {
    assert_stops_at_once("converge-agent", &AGENT_ARGS);
}

#[test]
fn the_allocator_stops_on_sigterm_while_nats_cannot_be_reached() {
    assert_stops_at_once("converge-allocator", &[]);
}

/// Connected and working, then the server goes away: the agent and the allocator, now
/// reconnecting, still stop within 9 s and 5 s of SIGTERM and exit 0 (before 2026-11-28 both waited
/// in their last flush for a reconnect that never came, until killed).
#[test]
fn the_agent_and_the_allocator_stop_on_sigterm_after_nats_went_away() {
    let mut nats = converge_tests::NatsServer::start();
    let allocator = Logged::start("converge-allocator", &nats.url, &[]);
    let agent = Logged::start("converge-agent", &nats.url, &AGENT_ARGS);
    // The bounds each waits on its way out with NATS gone: the allocator 2 s to hand its
    // lease back and 1 s for its last flush; the agent one 2 s heartbeat attempt, 5 s for
    // its outbox and 1 s for its last flush.
    let mut running = [
        (allocator, "allocator started", "allocator stopped", 5),
        (agent, "running: heartbeats to NATS", "agent stopped", 9),
    ];
    for (p, ready, _, _) in &mut running {
        p.wait_for(ready);
    }
    nats.stop();
    for (p, _, _, _) in &mut running {
        p.wait_for("disconnected from NATS");
    }
    for (p, _, stopped, within_s) in &mut running {
        let what = p.what.clone();
        let (took, status, log) = p.stop();
        println!("{what} (NATS gone) exited {took:?} after SIGTERM ({status})");
        assert!(
            took < Duration::from_secs(*within_s),
            "{what} took {took:?}:\n{log}"
        );
        assert!(status.success(), "{what}: {status}:\n{log}");
        assert!(log.contains(*stopped), "{what}:\n{log}");
        assert!(
            !log.contains("stopped before NATS could be reached"),
            "{log}"
        );
    }
}

/// How `converge` (dashboard, watch) ended after SIGTERM: a clean exit, or the signal's
/// default action (143 / killed by 15). Either way it is gone.
fn gone_on_sigterm(status: std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt as _;
    status.success() || status.code() == Some(143) || status.signal() == Some(15)
}

#[test]
fn the_dashboard_and_watch_stop_on_sigterm_while_nats_cannot_be_reached() {
    for args in [
        &["dashboard", "--listen", "127.0.0.1:0"][..],
        &["watch"][..],
    ] {
        let (took, status, log) = stop_while_connecting("converge", args);
        println!("converge {args:?} exited {took:?} after SIGTERM ({status})");
        assert!(
            took < Duration::from_secs(2),
            "{args:?} took {took:?}:\n{log}"
        );
        assert!(gone_on_sigterm(status), "{args:?}: {status}:\n{log}");
    }
}

/// Ctrl-C (SIGINT) as SIGTERM: each binary, while it waits for NATS, stops within 2 s;
/// the agent and the allocator exit 0 and say they stopped before NATS could be reached.
#[test]
fn every_binary_stops_on_ctrl_c_while_nats_cannot_be_reached() {
    use std::os::unix::process::ExitStatusExt as _;
    for (binary, args) in [
        ("converge-agent", &AGENT_ARGS[..]),
        ("converge-allocator", &[][..]),
        ("converge", &["dashboard", "--listen", "127.0.0.1:0"][..]),
        ("converge", &["watch"][..]),
    ] {
        let url = format!("nats://127.0.0.1:{}", closed_port());
        let mut p = Logged::start(binary, &url, args);
        p.wait_for("retrying in");
        let (took, status, log) = p.stop_with("-INT");
        println!("{binary} {args:?} exited {took:?} after SIGINT ({status})");
        assert!(
            took < Duration::from_secs(2),
            "{binary} {args:?} took {took:?}:\n{log}"
        );
        if binary == "converge" {
            // A clean exit, or SIGINT's default action (130 / killed by 2).
            assert!(
                status.success() || status.code() == Some(130) || status.signal() == Some(2),
                "{args:?}: {status}:\n{log}"
            );
        } else {
            assert!(status.success(), "{binary}: {status}:\n{log}");
            assert!(
                log.contains("stopped before NATS could be reached"),
                "{binary}: {log}"
            );
        }
    }
}

/// Connected, then the server goes away: the dashboard and watch, now reconnecting, still
/// stop within 2 s of SIGTERM (and of Ctrl-C), and the dashboard exits 0.
#[test]
fn the_dashboard_and_watch_stop_on_sigterm_and_ctrl_c_while_reconnecting() {
    for signal in ["-TERM", "-INT"] {
        let mut nats = converge_tests::NatsServer::start();
        let mut running = [
            (
                Logged::start(
                    "converge",
                    &nats.url,
                    &["dashboard", "--listen", "127.0.0.1:0"],
                ),
                "serving the dashboard",
            ),
            (
                Logged::start("converge", &nats.url, &["watch"]),
                "watching converge.v1.events",
            ),
        ];
        for (p, ready) in &mut running {
            p.wait_for(ready);
        }
        nats.stop();
        for (p, _) in &mut running {
            p.wait_for("disconnected from NATS");
        }
        for (p, ready) in &mut running {
            let (took, status, log) = p.stop_with(signal);
            println!("converge ({ready}, NATS gone) exited {took:?} after {signal} ({status})");
            assert!(
                took < Duration::from_secs(2),
                "{ready}: took {took:?} after {signal}:\n{log}"
            );
            if ready.starts_with("serving") {
                assert!(
                    status.success(),
                    "the dashboard stops cleanly: {status}:\n{log}"
                );
            } else {
                use std::os::unix::process::ExitStatusExt as _;
                let by_signal = if signal == "-TERM" { 15 } else { 2 };
                assert!(
                    status.success()
                        || status.code() == Some(128 + by_signal)
                        || status.signal() == Some(by_signal),
                    "watch after {signal}: {status}:\n{log}"
                );
            }
        }
    }
}

/// Connected to a real server, the dashboard (serving) and watch (following events) stop
/// within 2 s of SIGTERM; the dashboard exits 0 after closing its listener.
#[test]
fn the_dashboard_and_watch_stop_on_sigterm_while_connected() {
    let nats = converge_tests::NatsServer::start();
    for (args, ready) in [
        (
            &["dashboard", "--listen", "127.0.0.1:0"][..],
            "serving the dashboard",
        ),
        (&["watch"][..], "watching converge.v1.events"),
    ] {
        let (took, status, log) = stop_when_ready("converge", &nats.url, args, ready);
        println!("converge {args:?} (connected) exited {took:?} after SIGTERM ({status})");
        assert!(
            took < Duration::from_secs(2),
            "{args:?} took {took:?}:\n{log}"
        );
        assert!(gone_on_sigterm(status), "{args:?}: {status}:\n{log}");
        if args[0] == "dashboard" {
            assert!(
                status.success(),
                "the dashboard stops cleanly: {status}:\n{log}"
            );
        }
    }
}

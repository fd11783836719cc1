//! The agent, the allocator, the dashboard and `converge watch` stop on SIGTERM while they are
//! still trying to reach NATS at start-up (pointed at a port where nothing listens), and the
//! dashboard and watch also while connected: `systemctl stop` and Ctrl-C must not wait for a
//! server that may never come.

use converge_tests::bin_path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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

/// Starts `binary` with `args` against the NATS server at `url`, waits until its log (stderr,
/// `RUST_LOG=info`) contains `ready`, sends SIGTERM and returns how long it took to exit, its
/// exit status and its log. Panics when it exits before it is ready, is not ready within
/// 20 s, or still runs 10 s after the signal.
fn stop_when_ready(
    binary: &str,
    url: &str,
    args: &[&str],
    ready: &str,
) -> (Duration, std::process::ExitStatus, String) {
    let work = tempfile::tempdir().unwrap();
    let log = work.path().join("log");
    let mut child = Command::new(bin_path(binary))
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
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains(ready) {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "{binary} {args:?} exited before {ready:?}:\n{text}"
        );
        assert!(
            Instant::now() < deadline,
            "{binary} {args:?} never logged {ready:?}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let sent = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if sent.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{binary} {args:?} still running 10 s after SIGTERM:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        sent.elapsed(),
        status,
        std::fs::read_to_string(&log).unwrap_or_default(),
    )
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
    assert_stops_at_once(
        "converge-agent",
        &[
            "--host-id",
            "sig1",
            "--fake-gpus",
            "1",
            "--state-dir",
            "state",
        ],
    );
}

#[test]
fn the_allocator_stops_on_sigterm_while_nats_cannot_be_reached() {
    assert_stops_at_once("converge-allocator", &[]);
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

//! The agent and the allocator stop on SIGTERM while they are still trying to reach NATS at
//! start-up (pointed at a port where nothing listens): `systemctl stop` and Ctrl-C must not
//! wait for a server that may never come.

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
    let work = tempfile::tempdir().unwrap();
    let log = work.path().join("log");
    let url = format!("nats://127.0.0.1:{}", closed_port());
    let mut child = Command::new(bin_path(binary))
        .args(["--nats-url", &url])
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
        if text.contains("retrying in") {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "{binary} exited before retrying:\n{text}"
        );
        assert!(
            Instant::now() < deadline,
            "{binary} never said it retries:\n{text}"
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
                "{binary} still running 10 s after SIGTERM:\n{}",
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

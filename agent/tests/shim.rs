//! The worker shim (`converge-agent worker-shim`) as the supervisor uses it, with real
//! processes: exit codes and signals come through as the worker's, stdout reaches the
//! reader, the group's SIGTERM stops the worker, and a closed lifeline (the agent gone)
//! stops the whole group, SIGKILL after the grace for a worker that ignores SIGTERM.

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::io::{BufRead, BufReader};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `sh -c script` through the shim as the agent does: leader of a new process group,
/// lifeline as stdin (the write end is returned), stdout piped. The group's stderr (the
/// shim's "the agent is gone" lines, the shell's "Terminated") goes to the test's captured
/// output, shown only when the test fails.
fn shim(script: &str, grace_ms: u64) -> (Child, std::io::PipeWriter) {
    let (read, write) = std::io::pipe().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_converge-agent"))
        .args([
            "worker-shim",
            "--stop-grace-ms",
            &grace_ms.to_string(),
            "--",
            "sh",
            "-c",
            script,
        ])
        .stdin(Stdio::from(read))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    // A thread started by the test's thread writes into that test's capture.
    let stderr = BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            eprintln!("{line}");
        }
    });
    (child, write)
}

/// The first stdout line (the scripts print their pid first).
fn first_line(child: &mut Child) -> (String, BufReader<std::process::ChildStdout>) {
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    (line.trim().to_string(), out)
}

fn alive(pid: u32) -> bool {
    converge_agent::strays::read_stat(pid).is_some_and(|s| !s.zombie)
}

fn wait_gone(pid: u32, within: Duration) -> Duration {
    let start = Instant::now();
    while alive(pid) {
        assert!(
            start.elapsed() < within,
            "pid {pid} still alive after {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    start.elapsed()
}

#[test]
fn exit_codes_signals_and_stdout_come_through() {
    let (mut c, _life) = shim("echo hello; echo world; exit 7", 1000);
    let (first, mut out) = first_line(&mut c);
    assert_eq!(first, "hello");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert_eq!(rest, "world\n");
    assert_eq!(c.wait().unwrap().code(), Some(7));

    let (mut c, _life) = shim("exit 0", 1000);
    assert!(c.wait().unwrap().success());

    // Killed by a signal: the shim dies of the same one.
    for (sig, name) in [(15, "TERM"), (9, "KILL"), (10, "USR1"), (6, "ABRT")] {
        let (mut c, _life) = shim(&format!("kill -{name} $$"), 1000);
        let s = c.wait().unwrap();
        assert_eq!((s.code(), s.signal()), (None, Some(sig)), "SIG{name}");
    }

    // A command that cannot run: 127, as from a shell.
    let (read, _write) = std::io::pipe().unwrap();
    let s = Command::new(env!("CARGO_BIN_EXE_converge-agent"))
        .args([
            "worker-shim",
            "--stop-grace-ms",
            "10",
            "--",
            "/nonexistent/x",
        ])
        .stdin(Stdio::from(read))
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(s.code(), Some(127));
    // Bad arguments.
    let s = Command::new(env!("CARGO_BIN_EXE_converge-agent"))
        .args(["worker-shim", "--", "true"])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(s.code(), Some(2));
}

#[test]
fn sigterm_to_the_group_stops_the_worker_and_the_shim_reports_it() {
    // The worker exits 143 on SIGTERM, like converge-trainer after its checkpoint.
    let (mut c, _life) = shim(
        "trap 'exit 143' TERM; echo $$; while :; do sleep 0.05; done",
        5000,
    );
    let (pid, _out) = first_line(&mut c);
    let pid: u32 = pid.parse().unwrap();
    assert!(alive(pid));
    let leader = c.id();
    assert_ne!(pid, leader, "the worker runs under the shim");
    assert_eq!(converge_agent::strays::read_stat(pid).unwrap().pgrp, leader);
    killpg(Pid::from_raw(leader as i32), Signal::SIGTERM).unwrap();
    assert_eq!(c.wait().unwrap().code(), Some(143));
    wait_gone(pid, Duration::from_secs(2));

    // A worker with the default action dies of SIGTERM; so does the shim.
    let (mut c, _life) = shim("echo $$; exec sleep 300", 5000);
    let (pid, _out) = first_line(&mut c);
    killpg(Pid::from_raw(c.id() as i32), Signal::SIGTERM).unwrap();
    assert_eq!(c.wait().unwrap().signal(), Some(15));
    wait_gone(pid.parse().unwrap(), Duration::from_secs(2));

    // SIGKILL to the group takes both.
    let (mut c, _life) = shim("trap '' TERM; echo $$; while :; do sleep 0.05; done", 5000);
    let (pid, _out) = first_line(&mut c);
    killpg(Pid::from_raw(c.id() as i32), Signal::SIGKILL).unwrap();
    assert_eq!(c.wait().unwrap().signal(), Some(9));
    wait_gone(pid.parse().unwrap(), Duration::from_secs(2));
}

#[test]
fn a_closed_lifeline_stops_the_group() {
    // A worker that stops on SIGTERM, with a child of its own in the group.
    let (mut c, life) = shim("sleep 300 & echo $$ $!; wait", 10_000);
    let (pids, _out) = first_line(&mut c);
    let pids: Vec<u32> = pids.split(' ').map(|p| p.parse().unwrap()).collect();
    assert!(pids.iter().all(|&p| alive(p)));
    drop(life);
    for &p in &pids {
        let took = wait_gone(p, Duration::from_secs(3));
        assert!(took < Duration::from_secs(3), "{took:?}");
    }
    c.wait().unwrap();

    // A worker that ignores SIGTERM: SIGKILL after the grace (1 s).
    let (mut c, life) = shim("trap '' TERM; echo $$; while :; do sleep 0.05; done", 1000);
    let (pid, _out) = first_line(&mut c);
    let pid: u32 = pid.parse().unwrap();
    let start = Instant::now();
    drop(life);
    std::thread::sleep(Duration::from_millis(500));
    assert!(alive(pid), "SIGKILL came before the grace");
    wait_gone(pid, Duration::from_secs(4));
    assert!(start.elapsed() >= Duration::from_millis(900));
    assert_eq!(c.wait().unwrap().signal(), Some(9));
}

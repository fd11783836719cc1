//! Helpers shared by the trainer's end-to-end tests (`binary.rs`, `ps.rs`, `shadow.rs`).
#![allow(dead_code)] // each test file uses its own subset

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Every variable of the worker contract, cleared before each run so that the test's own
/// environment cannot leak in.
pub const CONTRACT_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "CONVERGE_JOB_ID",
    "CONVERGE_GENERATION",
    "CONVERGE_CHECKPOINT_DIR",
    "CONVERGE_DATA_DIR",
    "CONVERGE_NUM_PS",
    "CONVERGE_BATCH_SIZE",
    "CONVERGE_ACCUM_STEPS",
    "CONVERGE_TOTAL_BATCH",
    "CONVERGE_REFERENCE_BATCH",
];

/// Slow training for a job to stop midway: many epochs, a step delay, a line every 5 steps.
pub const SLOW: [&str; 6] = [
    "--epochs",
    "1000",
    "--step-delay-ms",
    "5",
    "--log-every",
    "5",
];

pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data")
}

/// A trainer command with a clean worker environment, job `job`, checkpoints in `ckpt`
/// and the repository's data.
pub fn trainer(ckpt: &Path, job: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_converge-trainer"));
    for v in CONTRACT_VARS {
        cmd.env_remove(v);
    }
    cmd.env("CONVERGE_CHECKPOINT_DIR", ckpt)
        .env("CONVERGE_JOB_ID", job)
        .arg("--data-dir")
        .arg(data_dir());
    cmd
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The JSON of every `CONVERGE_PROGRESS` line.
pub fn progress(stdout: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("CONVERGE_PROGRESS "))
        .map(|j| serde_json::from_str(j).expect("progress JSON"))
        .collect()
}

/// The checkpoint in `dir`.
pub fn checkpoint(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("checkpoint.json")).expect("checkpoint exists");
    serde_json::from_str(&text).unwrap()
}

/// Waits until the checkpoint in `dir` is of `generation`; panics with `what` after `limit`.
pub fn wait_for_checkpoint_of(dir: &Path, generation: u64, limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    while checkpoint(dir)["generation"] != generation {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn show(what: &str, out: &Output) {
    eprintln!(
        "--- {what}: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A trainer command for rank `rank` of a `world`-rank optdigits job `job` of generation
/// `generation` whose last `num_ps` ranks are shards (0: no shards), meeting at
/// 127.0.0.1:`port`, with `args`; stdout and stderr piped.
#[allow(clippy::too_many_arguments)]
pub fn rank_command(
    ckpt: &Path,
    job: &str,
    rank: usize,
    world: usize,
    num_ps: usize,
    generation: u64,
    port: u16,
    args: &[&str],
) -> Command {
    let mut cmd = trainer(ckpt, job);
    cmd.env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("CONVERGE_GENERATION", generation.to_string())
        .args(["--dataset", "optdigits", "--rendezvous-timeout", "30"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if num_ps > 0 {
        cmd.env("CONVERGE_NUM_PS", num_ps.to_string());
    }
    cmd
}

/// Waits for every `(rank, child)` (all within `limit`, killing them all on a timeout);
/// their outputs in rank order.
pub fn wait_all(mut children: Vec<(usize, Child)>, limit: Duration) -> Vec<Output> {
    children.sort_by_key(|(r, _)| *r);
    let start = Instant::now();
    let mut outs = Vec::new();
    let mut pending = children.into_iter();
    while let Some((rank, mut child)) = pending.next() {
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > limit {
                let _ = child.kill();
                for (_, mut c) in pending.by_ref() {
                    let _ = c.kill();
                }
                let out = child.wait_with_output().unwrap();
                show(&format!("rank {rank} (killed)"), &out);
                panic!("rank {rank} did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        outs.push(child.wait_with_output().unwrap());
    }
    outs
}

/// Every rank's exit code.
pub fn codes(outs: &[Output]) -> Vec<Option<i32>> {
    outs.iter().map(|o| o.status.code()).collect()
}

/// Shows every rank's exit status and stderr.
pub fn show_all(what: &str, outs: &[Output]) {
    for (rank, out) in outs.iter().enumerate() {
        show(&format!("{what} rank {rank}"), out);
    }
}

/// Checks the ranks' exit codes, showing every rank's stderr when they are not `want`.
pub fn expect_codes(what: &str, outs: &[Output], want: &[Option<i32>]) {
    if codes(outs) != want {
        show_all(what, outs);
        panic!("{what}: exit codes {:?}, not {want:?}", codes(outs));
    }
}

/// Sends `signal` (`-TERM`, `-KILL`) to `pid` with kill(1); whether it was delivered.
pub fn signal(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap()
        .success()
}

/// Reads `stdout` to its end in a thread: every `CONVERGE_PROGRESS` line's JSON, each also
/// sent on the receiver as it arrives.
pub fn follow_progress(stdout: ChildStdout) -> (mpsc::Receiver<Value>, JoinHandle<Vec<Value>>) {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        let mut all = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let line = line.unwrap();
            if let Some(json) = line.strip_prefix("CONVERGE_PROGRESS ") {
                let v: Value = serde_json::from_str(json).expect("progress JSON");
                let _ = tx.send(v.clone());
                all.push(v);
            }
        }
        all
    });
    (rx, handle)
}

/// A number of a JSON object.
pub fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"))
}

/// A whole number of a JSON object.
pub fn u(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}"))
}

/// A process's stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

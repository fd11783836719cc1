//! Helpers shared by the trainer's end-to-end tests (`binary.rs`, `ps.rs`).
#![allow(dead_code)] // each test file uses its own subset

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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

pub fn show(what: &str, out: &Output) {
    eprintln!(
        "--- {what}: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

//! The simulator's commands as a user runs them: `simulate` writes a Pollux-shaped
//! summary.json, `workload` writes a workload `simulate` accepts, bad input is refused.

use std::path::Path;
use std::process::Command;

fn allocator() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_converge-sim"));
    cmd.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    cmd
}

/// Runs `cmd` to its end, its output captured (not printed), and asserts it succeeded,
/// showing that output when it did not.
fn succeeds(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn simulate_writes_a_pollux_shaped_summary() {
    let out = tempfile::tempdir().unwrap();
    succeeds(
        allocator()
            .args([
                "simulate",
                "--workload",
                "data/pollux/workloads-0.5/workload-1.csv",
                "--policy",
                "tiresias",
                "--out",
            ])
            .arg(out.path()),
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("summary.json")).unwrap())
            .unwrap();
    let jcts = summary["jcts"]["workloads-0.5/workload-1"]
        .as_object()
        .unwrap();
    assert_eq!(jcts.len(), 80, "every job finished and has a JCT");
    assert!(jcts.values().all(|v| v.as_f64().unwrap() > 0.0));
    let mean = summary["mean"].as_f64().unwrap();
    let avg = summary["avgs"]["workloads-0.5/workload-1"]
        .as_f64()
        .unwrap();
    assert!((mean - avg).abs() < 1e-9 && mean > 0.0);
    for key in [
        "jct",
        "makespan",
        "restarts",
        "utilization",
        "avg_normalized_loss",
        "mean_time_to_90",
        "mean_time_to_95",
        "decision_ms",
    ] {
        assert!(!summary[key].is_null(), "summary lacks {key}");
    }
}

#[test]
fn generated_workloads_simulate() {
    let dir = tempfile::tempdir().unwrap();
    let workload = dir.path().join("w.csv");
    succeeds(
        allocator()
            .args([
                "workload", "--jobs", "20", "--hours", "2", "--seed", "5", "--out",
            ])
            .arg(&workload),
    );
    let text = std::fs::read_to_string(&workload).unwrap();
    assert_eq!(text.lines().count(), 21);
    succeeds(
        allocator()
            .args(["simulate", "--policy", "fair", "--workload"])
            .arg(&workload)
            .arg("--out")
            .arg(dir.path()),
    );
}

#[test]
fn bad_input_is_refused_with_the_reason() {
    let out = allocator()
        .args([
            "simulate",
            "--workload",
            "data/pollux/workloads/workload-1.csv",
            "--policy",
            "lottery",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("fifo, fair, tiresias, optimus, quality"),
        "{stderr}"
    );
    let out = allocator()
        .args(["simulate", "--workload", "nope.csv"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("nope.csv"),
        "{stderr}"
    );
    let out = allocator()
        .args([
            "simulate",
            "--workload",
            "data/pollux/workloads/workload-1.csv",
            "--interference",
            "1.5",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--interference"));
}

/// `explore-report` writes the same report whatever the number of threads (its runs are
/// deterministic and kept in order), on a small configuration of two workloads.
#[test]
fn explore_report_is_the_same_on_one_thread_and_on_two() {
    let out = tempfile::tempdir().unwrap();
    let report = |threads: &str| {
        let path = out.path().join(format!("explore-{threads}.md"));
        succeeds(allocator().args([
            "explore-report",
            "--seeds",
            "1,2",
            "--sweeps",
            "4",
            "--hours",
            "0.5",
            "--sensitivity-sweeps",
            "4",
            "--sensitivity-plateau",
            "0.01",
            "--early-stop-rules",
            "none,predicted",
            "--threads",
            threads,
            "--out",
            path.to_str().unwrap(),
        ]));
        std::fs::read_to_string(path).unwrap()
    };
    let one = report("1");
    assert!(one.contains("| `quality` |"), "{one}");
    assert_eq!(one, report("2"));
}

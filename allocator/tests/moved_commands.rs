//! The simulator's old subcommands on `converge-allocator` answer with an error that names
//! the new command (`converge-sim`), and the old `CONVERGE_EPOCH` variable with one that names
//! `CONVERGE_SCHEDULING_INTERVAL`; both kept for one release.

use std::process::Command;

#[test]
fn simulator_subcommands_name_their_new_command() {
    for sub in [
        "simulate",
        "workload",
        "report",
        "bench-decision",
        "predict-bench",
        "makespan-bench",
        "ps-bench",
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_converge-allocator"))
            .args([sub, "--workload", "data/pollux/workloads/workload-1.csv"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{sub}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("`converge-sim {sub}`")),
            "{sub}: {err}"
        );
        assert!(out.stdout.is_empty(), "{sub}");
    }
    let help = Command::new(env!("CARGO_BIN_EXE_converge-allocator"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("converge-sim"), "{text}");
    assert!(text.contains("--scheduling-interval"), "{text}");
}

#[test]
fn the_old_scheduling_period_variable_is_refused_with_its_new_name() {
    let out = Command::new(env!("CARGO_BIN_EXE_converge-allocator"))
        .env("CONVERGE_EPOCH", "5s")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("CONVERGE_SCHEDULING_INTERVAL"), "{err}");
}

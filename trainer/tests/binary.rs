//! End-to-end tests of the `converge-trainer` binary: two ranks on loopback, resume at
//! another world size, SIGTERM handling, refusal of a mismatched checkpoint and the
//! learning-rate rules at a planned batch.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{
    SLOW, checkpoint, follow_progress, free_port, progress, show, signal, wait_for_checkpoint_of,
};

/// A trainer command with a clean worker environment and the repository's data.
fn trainer(ckpt: &Path, args: &[&str]) -> Command {
    let mut cmd = common::trainer(ckpt, "test-job");
    cmd.args(args);
    cmd
}

fn checkpoint_step(dir: &Path) -> u64 {
    checkpoint(dir)["step"].as_u64().unwrap()
}

fn wait_with_timeout(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("the trainer did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Runs rank 1, then rank 0, of a two-rank job of generation 1 with `args` and the
/// variables `env` to their end (120 s each at most); their outputs, rank 0's first.
fn run_two_ranks(ckpt: &Path, args: &[&str], env: &[(&str, &str)]) -> (Output, Output) {
    let port = free_port().to_string();
    let spawn = |rank: &str| {
        trainer(ckpt, args)
            .env("RANK", rank)
            .env("LOCAL_RANK", rank)
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("CONVERGE_GENERATION", "1")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let rank1 = spawn("1");
    let rank0 = spawn("0");
    let out0 = wait_with_timeout(rank0, Duration::from_secs(120));
    let out1 = wait_with_timeout(rank1, Duration::from_secs(120));
    (out0, out1)
}

#[test]
fn two_ranks_train_then_one_rank_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let common = [
        "--dataset",
        "optdigits",
        "--max-steps",
        "100",
        "--log-every",
        "10",
        "--eval-every",
        "50",
    ];
    let (out0, out1) = run_two_ranks(&ckpt, &common, &[]);
    show("rank 0", &out0);
    show("rank 1", &out1);
    assert_eq!(out0.status.code(), Some(0));
    assert_eq!(out1.status.code(), Some(0));
    assert!(
        progress(&out1.stdout).is_empty(),
        "only rank 0 reports progress"
    );

    let lines = progress(&out0.stdout);
    assert_eq!(lines.len(), 10, "one line every 10 steps");
    let (first, last) = (&lines[0], &lines[lines.len() - 1]);
    assert_eq!(first["step"], 10);
    assert_eq!(first["samples"], 10 * 2 * 32);
    assert_eq!(last["step"], 100);
    assert_eq!(last["samples"], 100 * 2 * 32);
    let (l0, l1) = (
        first["loss"].as_f64().unwrap(),
        last["loss"].as_f64().unwrap(),
    );
    assert!(l1 < 0.6 * l0, "loss fell from {l0} to only {l1}");
    assert!(last["eval_loss"].as_f64().unwrap() < 1.0);
    assert!(lines[2].get("eval_loss").is_none());
    assert!(lines[4]["eval_loss"].is_number());
    // Every line reports the all-reduce time per step (> 0 with two ranks) and the model
    // size: softmax on optdigits has 10 x 64 + 10 = 650 f64 parameters.
    for line in &lines {
        let sync = line["sync_s"].as_f64().expect("sync_s");
        assert!(sync > 0.0 && sync.is_finite(), "{line}");
        assert_eq!(line["model_bytes"], 650 * 8, "{line}");
    }
    assert_eq!(checkpoint_step(&ckpt), 100);

    // World size 1 resumes where world size 2 stopped.
    let out = trainer(&ckpt, &["--dataset", "optdigits", "--max-steps", "130"])
        .output()
        .unwrap();
    show("resumed", &out);
    assert_eq!(out.status.code(), Some(0));
    let lines = progress(&out.stdout);
    let first = lines[0]["step"].as_u64().unwrap();
    assert!(
        first > 100,
        "resumed run started at step {first}, not after 100"
    );
    assert_eq!(lines[0]["samples"], 100 * 2 * 32 + 10 * 32);
    assert_eq!(lines.last().unwrap()["step"], 130);
    assert!(lines.last().unwrap()["eval_loss"].is_number());
    // A single rank synchronizes nothing: sync 0, the same model size.
    for line in &lines {
        assert_eq!(line["sync_s"].as_f64(), Some(0.0), "{line}");
        assert_eq!(line["model_bytes"], 650 * 8, "{line}");
    }
    assert!(lines[0]["loss"].as_f64().unwrap() < 0.8 * l0);
    assert_eq!(checkpoint_step(&ckpt), 130);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("resumed from checkpoint at step 100"),
        "{stderr}"
    );
}

#[test]
fn sigterm_checkpoints_and_exits_143() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let args = [
        &["--dataset", "optdigits"][..],
        &SLOW,
        &["--checkpoint-every", "3600"],
    ]
    .concat();
    let mut child = trainer(&ckpt, &args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A progress line shows that training is under way.
    let (rx, _) = follow_progress(child.stdout.take().unwrap());
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a progress line");
    assert_eq!(line["step"], 5, "{line}");
    assert!(!ckpt.join("checkpoint.json").exists(), "no checkpoint yet");
    assert!(signal(child.id(), "-TERM"));
    let out = wait_with_timeout(child, Duration::from_secs(30));
    show("terminated", &out);
    assert_eq!(out.status.code(), Some(143));
    assert!(checkpoint_step(&ckpt) >= 5);
}

#[test]
fn a_checkpoint_for_another_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let out = trainer(&ckpt, &["--dataset", "optdigits", "--max-steps", "3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let lines = progress(&out.stdout);
    assert_eq!(lines.len(), 1, "only the final line at step 3");
    assert_eq!(lines[0]["step"], 3);
    assert!(lines[0]["eval_loss"].is_number());
    let out = trainer(
        &ckpt,
        &[
            "--dataset",
            "optdigits",
            "--model",
            "mlp",
            "--max-steps",
            "5",
        ],
    )
    .output()
    .unwrap();
    show("mismatch", &out);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("incompatible checkpoint"), "{stderr}");
    assert!(progress(&out.stdout).is_empty());
    assert_eq!(checkpoint_step(&ckpt), 3, "the checkpoint is left alone");
}

#[test]
fn nonsensical_model_and_dataset_pairs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = trainer(dir.path(), &["--dataset", "a9a", "--model", "softmax"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("does not fit --dataset a9a"), "{stderr}");
}

#[test]
fn a_stale_generation_is_fenced_by_a_newer_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let run = |generation: &str, steps: &str| {
        trainer(
            &ckpt,
            &[
                "--dataset",
                "optdigits",
                "--max-steps",
                steps,
                "--log-every",
                "10",
            ],
        )
        .env("CONVERGE_GENERATION", generation)
        .output()
        .unwrap()
    };
    assert_eq!(run("1", "20").status.code(), Some(0));
    assert_eq!(run("3", "40").status.code(), Some(0));
    assert_eq!(checkpoint(&ckpt)["generation"], 3);
    let before = std::fs::read(ckpt.join("checkpoint.json")).unwrap();

    // Generation 2 starts after generation 3 has checkpointed: it stops at once, writes
    // nothing and reports no progress.
    let stale = run("2", "80");
    show("stale", &stale);
    assert_ne!(stale.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&stale.stderr).contains("fenced"));
    assert!(progress(&stale.stdout).is_empty());
    assert_eq!(std::fs::read(ckpt.join("checkpoint.json")).unwrap(), before);

    // A running generation 4 finds generation 9's checkpoint at its next save: it stops
    // without overwriting it.
    let mut running = trainer(
        &ckpt,
        &[
            "--dataset",
            "optdigits",
            "--max-steps",
            "100000",
            "--log-every",
            "10",
            "--step-delay-ms",
            "5",
            "--checkpoint-every",
            "0.2",
        ],
    )
    .env("CONVERGE_GENERATION", "4")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for_checkpoint_of(
        &ckpt,
        4,
        Duration::from_secs(30),
        "generation 4 never checkpointed",
    );
    let mut newer = checkpoint(&ckpt);
    newer["generation"] = 9.into();
    let newer_text = serde_json::to_string(&newer).unwrap();
    std::fs::write(ckpt.join("checkpoint.json"), &newer_text).unwrap();
    let _ = running.stdin.take();
    let out = wait_with_timeout(running, Duration::from_secs(30));
    show("generation 4", &out);
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("fenced"));
    assert_eq!(
        std::fs::read_to_string(ckpt.join("checkpoint.json")).unwrap(),
        newer_text
    );
}

/// The final progress line's training and held-out losses and the first line's loss.
fn losses(stdout: &[u8]) -> (f64, f64, f64) {
    let lines = progress(stdout);
    let (first, last) = (&lines[0], &lines[lines.len() - 1]);
    (
        first["loss"].as_f64().unwrap(),
        last["loss"].as_f64().unwrap(),
        last["eval_loss"].as_f64().unwrap(),
    )
}

/// Runs `cmd` to its end, shows its stderr and checks that it exited 0; its output and
/// stderr.
fn run_ok(what: &str, cmd: &mut Command) -> (Output, String) {
    let out = cmd.output().unwrap();
    show(what, &out);
    assert_eq!(out.status.code(), Some(0), "{what}");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stderr)
}

/// One rank under AdaScale for `steps` steps at a planned batch of 128 (reference 32),
/// with `extra` options.
fn adascale_alone(ckpt: &Path, steps: &str, extra: &[&str]) -> Command {
    let mut cmd = trainer(
        ckpt,
        &[
            "--dataset",
            "optdigits",
            "--max-steps",
            steps,
            "--lr-scaling",
            "adascale",
        ],
    );
    cmd.args(extra)
        .env("CONVERGE_BATCH_SIZE", "128")
        .env("CONVERGE_REFERENCE_BATCH", "32");
    cmd
}

/// AdaScale at a planned batch 4x the reference (two ranks, 64 samples each, reference 32):
/// the gain from the first step's statistics on, the loss falls further than without
/// scaling, the smoothed statistics reach the checkpoint and carry over to the next
/// generation (one rank, another batch); with `--no-grad-stats` the rule falls back to the
/// square-root rule and says so.
#[test]
fn adascale_at_four_times_the_reference_batch() {
    let dir = tempfile::tempdir().unwrap();
    let run_two = |ckpt: &Path, rule: &str| {
        let (out0, out1) = run_two_ranks(
            ckpt,
            &[
                "--dataset",
                "optdigits",
                "--max-steps",
                "60",
                "--log-every",
                "10",
                "--lr-scaling",
                rule,
            ],
            &[
                ("CONVERGE_BATCH_SIZE", "64"),
                ("CONVERGE_REFERENCE_BATCH", "32"),
            ],
        );
        show(&format!("{rule} rank 0"), &out0);
        assert_eq!(out0.status.code(), Some(0));
        assert_eq!(out1.status.code(), Some(0));
        out0
    };
    let ada = dir.path().join("adascale");
    let out = run_two(&ada, "adascale");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("lr 0.05 x AdaScale gain (1 to 4.0000)"),
        "{stderr}"
    );
    assert!(stderr.contains("AdaScale from step 1 on: gain"), "{stderr}");
    assert!(!stderr.contains("has no statistics"), "{stderr}");
    let (first, last, eval) = losses(&out.stdout);
    assert!(last < 0.3 * first, "loss fell from {first} to only {last}");
    let unscaled = run_two(&dir.path().join("none"), "none");
    let (_, _, eval_none) = losses(&unscaled.stdout);
    assert!(
        eval < eval_none,
        "AdaScale's held-out loss {eval} is not below the unscaled {eval_none}"
    );
    // The checkpoint keeps the smoothed statistics: 60 steps observed, progress between
    // 60 (gain 1) and 240 (gain 4) steps at the reference batch.
    let scaling = checkpoint(&ada)["scaling"].clone();
    assert_eq!(scaling["observations"], 60, "{scaling}");
    let progress_60 = scaling["progress"].as_f64().unwrap();
    assert!((60.0..=240.0).contains(&progress_60), "{scaling}");

    // The next generation, one rank at 128 per step, starts from them.
    let mut resumed = adascale_alone(&ada, "80", &[]);
    let (_, stderr) = run_ok("adascale resumed", resumed.env("CONVERGE_GENERATION", "2"));
    assert!(
        stderr.contains(
            "AdaScale starts from the checkpoint's smoothed gradient statistics (60 steps observed"
        ),
        "{stderr}"
    );
    let scaling = checkpoint(&ada)["scaling"].clone();
    assert_eq!(scaling["observations"], 80, "{scaling}");
    assert!(scaling["progress"].as_f64().unwrap() > progress_60 + 20.0);

    // Without statistics: the square-root rule, said in the log.
    let mut nostats = adascale_alone(&dir.path().join("nostats"), "60", &["--no-grad-stats"]);
    let (out, stderr) = run_ok("adascale without statistics", &mut nostats);
    assert!(
        stderr.contains(
            "AdaScale needs the gradient statistics, which --no-grad-stats turns off: lr 0.05 scaled to 0.1 by the square-root rule instead"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("AdaScale from step"), "{stderr}");
    let (first, last, _) = losses(&out.stdout);
    assert!(last < 0.3 * first, "loss fell from {first} to only {last}");
}

//! End-to-end tests of the parameter-server mode (`CONVERGE_NUM_PS`) of the
//! `converge-trainer` binary: workers and shards as real processes on loopback.

use std::path::Path;
use std::process::{Child, Output};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::{
    SLOW, checkpoint, codes, expect_codes, f, follow_progress, free_port, progress, rank_command,
    show_all, signal, u, wait_all,
};

/// optdigits has 3,823 training rows.
const OPTDIGITS_ROWS: f64 = 3823.0;

/// One generation of a job: `world` ranks of which the last `num_ps` are shards
/// (`num_ps == 0` is ring mode). Ranks are spawned shards first, rank 0 last.
struct Job {
    children: Vec<(usize, Child)>,
}

impl Job {
    fn spawn(ckpt: &Path, world: usize, num_ps: usize, generation: u64, args: &[&str]) -> Job {
        let port = free_port();
        let mut children: Vec<(usize, Child)> = (0..world)
            .rev()
            .map(|rank| {
                let mut cmd =
                    rank_command(ckpt, "ps-test", rank, world, num_ps, generation, port, args);
                (
                    rank,
                    cmd.env("LOCAL_RANK", rank.to_string()).spawn().unwrap(),
                )
            })
            .collect();
        children.reverse();
        Job { children }
    }

    /// A slow job of generation 1 once rank 0 has reported progress, and the handle that
    /// returns rank 0's progress lines.
    fn training_slowly(ckpt: &Path, world: usize, num_ps: usize) -> (Job, JoinHandle<Vec<Value>>) {
        let mut job = Job::spawn(ckpt, world, num_ps, 1, &SLOW);
        let (rx, lines) = job.follow_rank0();
        rx.recv_timeout(Duration::from_secs(30))
            .expect("a progress line");
        (job, lines)
    }

    fn pid(&self, rank: usize) -> u32 {
        self.children[rank].1.id()
    }

    /// Sends `sig` to rank `rank`, which must still be there.
    fn signal(&self, rank: usize, sig: &str) {
        assert!(signal(self.pid(rank), sig), "kill {sig} rank {rank}");
    }

    /// Rank 0's progress lines as they arrive, and a handle that returns all of them.
    fn follow_rank0(&mut self) -> (mpsc::Receiver<Value>, JoinHandle<Vec<Value>>) {
        follow_progress(self.children[0].1.stdout.take().unwrap())
    }

    /// Waits for every rank (all within `limit`), killing the rest on a timeout.
    fn wait(self, limit: Duration) -> Vec<Output> {
        wait_all(self.children, limit)
    }
}

/// Test 1: two workers and one shard train for three epochs; everybody exits 0, the loss
/// falls, the checkpoint is there, and a ring-mode run resumes from it.
#[test]
fn two_workers_and_one_shard_train_three_epochs() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let args = ["--epochs", "3", "--log-every", "10", "--eval-every", "100"];
    let outs = Job::spawn(&ckpt, 3, 1, 1, &args).wait(Duration::from_secs(60));
    expect_codes("ps 2+1", &outs, &[Some(0); 3]);
    assert!(progress(&outs[1].stdout).is_empty(), "only rank 0 reports");
    assert!(progress(&outs[2].stdout).is_empty(), "only rank 0 reports");
    let shard_log = String::from_utf8_lossy(&outs[2].stderr);
    assert!(shard_log.contains("ps shard 0/1 (rank 2"), "{shard_log}");
    assert!(shard_log.contains("training complete"), "{shard_log}");

    let lines = progress(&outs[0].stdout);
    let steps = (3.0 * OPTDIGITS_ROWS / 64.0).ceil() as u64;
    let (first, last) = (&lines[0], lines.last().unwrap());
    assert_eq!(u(first, "step"), 10);
    assert_eq!(
        u(first, "samples"),
        10 * 2 * 32,
        "global batch is 2 workers x 32"
    );
    assert_eq!(u(last, "step"), steps);
    assert_eq!(u(last, "samples"), steps * 64);
    assert!(f(last, "epoch") >= 3.0);
    let (l0, l1) = (f(first, "loss"), f(last, "loss"));
    assert!(l1 < 0.3 * l0, "loss fell from {l0} to only {l1}");
    assert!(f(last, "eval_loss") < 0.5);
    // Worker 0 reports its push-and-pull time per step and the model size (650 f64).
    for line in &lines {
        let sync = f(line, "sync_s");
        assert!(sync > 0.0 && sync.is_finite(), "{line}");
        assert_eq!(u(line, "model_bytes"), 650 * 8, "{line}");
    }
    let ck = checkpoint(&ckpt);
    assert_eq!(u(&ck, "step"), steps);
    assert_eq!(u(&ck, "samples"), steps * 64);
    assert_eq!(ck["params"].as_array().unwrap().len(), 650);
    assert!(ck["momentum"].as_array().unwrap().iter().any(|m| m != 0.0));
    eprintln!(
        "ps 2+1, {steps} steps: loss {l0} -> {l1}, eval {} in {:.2} s",
        last["eval_loss"],
        started.elapsed().as_secs_f64()
    );

    // The PS checkpoint resumes in ring mode.
    let more = (steps + 20).to_string();
    let outs = Job::spawn(&ckpt, 2, 0, 2, &["--max-steps", &more]).wait(Duration::from_secs(60));
    expect_codes("ring resume", &outs, &[Some(0); 2]);
    let lines = progress(&outs[0].stdout);
    assert_eq!(u(&lines[0], "step"), steps + 10);
    assert_eq!(u(&lines[0], "samples"), (steps + 10) * 64);
    assert!(f(&lines[0], "loss") < 0.3 * l0);
    assert_eq!(u(&checkpoint(&ckpt), "step"), steps + 20);
}

/// Test 2: SIGTERM to every rank mid-run (as the agent does on a resize): all exit 143 and
/// worker 0 checkpoints; the job then resumes with one worker and two shards, continuing
/// steps and samples, and the loss keeps falling.
#[test]
fn sigterm_then_resume_with_one_worker_and_two_shards() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let args = [&SLOW[..], &["--checkpoint-every", "3600"]].concat();
    let mut job = Job::spawn(&ckpt, 3, 1, 1, &args);
    let (rx, lines) = job.follow_rank0();
    let seen = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("progress lines from rank 0");
        if u(&line, "step") >= 15 {
            break line;
        }
    };
    assert!(!ckpt.join("checkpoint.json").exists(), "no checkpoint yet");
    for rank in 0..3 {
        job.signal(rank, "-TERM");
    }
    let outs = job.wait(Duration::from_secs(30));
    expect_codes("terminated", &outs, &[Some(143); 3]);
    let lines = lines.join().unwrap();
    let gen1_first_loss = f(&lines[0], "loss");
    let ck = checkpoint(&ckpt);
    let (ck_step, ck_samples) = (u(&ck, "step"), u(&ck, "samples"));
    assert!(ck_step >= u(&seen, "step"), "checkpoint at {ck_step}");
    assert!(ck_step >= u(lines.last().unwrap(), "step"));
    assert_eq!(ck_samples, ck_step * 64);

    // Generation 2: one worker, two shards.
    let target = ck_step + 60;
    let target_arg = target.to_string();
    let outs = Job::spawn(
        &ckpt,
        3,
        2,
        2,
        &["--max-steps", &target_arg, "--log-every", "10"],
    )
    .wait(Duration::from_secs(60));
    expect_codes("resumed 1+2", &outs, &[Some(0); 3]);
    let stderr0 = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        stderr0.contains(&format!("resumed from checkpoint at step {ck_step}")),
        "{stderr0}"
    );
    for (rank, shard) in [(1, "ps shard 0/2"), (2, "ps shard 1/2")] {
        let log = String::from_utf8_lossy(&outs[rank].stderr);
        assert!(log.contains(shard), "{log}");
        assert!(
            log.contains(&format!("from step {ck_step} (samples {ck_samples})")),
            "{log}"
        );
    }
    let resumed = progress(&outs[0].stdout);
    let first = &resumed[0];
    let first_step = u(first, "step");
    assert!(first_step > ck_step && first_step <= ck_step + 10);
    assert_eq!(
        u(first, "samples"),
        ck_samples + (first_step - ck_step) * 32,
        "one worker: 32 samples per step"
    );
    let last = resumed.last().unwrap();
    assert_eq!(u(last, "step"), target);
    assert_eq!(u(last, "samples"), ck_samples + 60 * 32);
    let (r0, r1) = (f(first, "loss"), f(last, "loss"));
    assert!(
        r0 < 0.8 * gen1_first_loss,
        "resumed at loss {r0}, generation 1 began at {gen1_first_loss}"
    );
    assert!(r1 < r0, "loss went from {r0} to {r1} after resuming");
    assert_eq!(u(&checkpoint(&ckpt), "step"), target);
    eprintln!(
        "terminated at step {ck_step}; generation 1 first loss {gen1_first_loss}; resumed 1+2: loss {r0} -> {r1}; {:.2} s",
        started.elapsed().as_secs_f64()
    );
}

/// A SIGTERM that reaches only a shard stops the whole job at one step boundary: the
/// shard asks the workers to vote stop, every rank exits 143 and the checkpoint is whole.
#[test]
fn sigterm_to_a_shard_alone_stops_the_job_consistently() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let (job, lines) = Job::training_slowly(&ckpt, 4, 2);
    job.signal(3, "-TERM");
    let outs = job.wait(Duration::from_secs(30));
    expect_codes("shard terminated", &outs, &[Some(143); 4]);
    drop(lines.join().unwrap());
    let shard_log = String::from_utf8_lossy(&outs[3].stderr);
    assert!(
        shard_log.contains("asking the workers to stop"),
        "{shard_log}"
    );
    let ck = checkpoint(&ckpt);
    let step = u(&ck, "step");
    assert!(step >= 5);
    assert_eq!(u(&ck, "samples"), step * 64);
    let stderr0 = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        stderr0.contains(&format!("checkpointed step {step} ")),
        "{stderr0}"
    );
}

/// A shard that dies makes every worker exit 1 promptly with a message naming it.
#[test]
fn a_killed_shard_fails_the_workers() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let (job, lines) = Job::training_slowly(&ckpt, 3, 1);
    let killed = Instant::now();
    job.signal(2, "-KILL");
    let outs = job.wait(Duration::from_secs(30));
    show_all("shard killed", &outs);
    assert!(killed.elapsed() < Duration::from_secs(10));
    assert_eq!(codes(&outs)[..2], [Some(1), Some(1)]);
    drop(lines.join().unwrap());
    for out in &outs[..2] {
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(
            log.contains("lost the parameter servers")
                && log.contains("parameter-server shard 0 (rank 2"),
            "{log}"
        );
    }
}

/// Test 3: parameter servers and ring all-reduce reach the same loss on the same data and
/// steps. With two workers the shard adds the same two numbers the ring adds, so the runs
/// are bit-identical; with three workers and two shards only the order of additions
/// differs.
#[test]
fn ps_and_ring_reach_the_same_loss() {
    let started = Instant::now();
    let args = [
        "--max-steps",
        "150",
        "--log-every",
        "10",
        "--eval-every",
        "50",
    ];
    let run = |world: usize, num_ps: usize| {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("ckpt");
        let outs = Job::spawn(&ckpt, world, num_ps, 1, &args).wait(Duration::from_secs(60));
        expect_codes(
            &format!("world {world}, {num_ps} shard(s)"),
            &outs,
            &vec![Some(0); world],
        );
        let lines = progress(&outs[0].stdout);
        let ck = checkpoint(&ckpt);
        (lines, ck)
    };
    let close = |a: f64, b: f64, tol: f64| (a - b).abs() <= tol * a.abs().max(b.abs());
    for (workers, shards, tol) in [(2, 1, 1e-12), (3, 2, 1e-6)] {
        let (ring, ring_ck) = run(workers, 0);
        let (ps, ps_ck) = run(workers + shards, shards);
        assert_eq!(ring.len(), ps.len());
        let (rl, pl) = (ring.last().unwrap(), ps.last().unwrap());
        assert_eq!(u(rl, "step"), 150);
        assert_eq!(u(pl, "samples"), u(rl, "samples"));
        let worst_line = ring
            .iter()
            .zip(&ps)
            .map(|(r, p)| (f(r, "loss") - f(p, "loss")).abs())
            .fold(0.0, f64::max);
        let params = |ck: &Value| -> Vec<f64> {
            ck["params"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        };
        let worst_param = params(&ring_ck)
            .iter()
            .zip(&params(&ps_ck))
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        eprintln!(
            "{workers} workers: ring final loss {} eval {}; ps ({shards} shard(s)) final loss {} eval {}; largest difference in a progress line {worst_line:e}, in a parameter {worst_param:e}",
            rl["loss"], rl["eval_loss"], pl["loss"], pl["eval_loss"]
        );
        assert!(
            close(f(rl, "loss"), f(pl, "loss"), tol),
            "{rl} vs {pl} (tolerance {tol})"
        );
        assert!(close(f(rl, "eval_loss"), f(pl, "eval_loss"), tol));
        assert!(worst_param <= tol, "parameters differ by {worst_param}");
    }
    eprintln!("compared in {:.2} s", started.elapsed().as_secs_f64());
}

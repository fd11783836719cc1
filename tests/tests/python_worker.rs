//! A Python worker through the real system: `examples/python/numpy_worker.py` (numpy and
//! the converge-worker kit of `python/`) as a job's command, run by real agents and a
//! real allocator over a real nats-server. The loss it reports falls in the job's status,
//! the job grows to a second host by SIGTERM, checkpoint and resume, and completes; the
//! agent's worker-contract environment (torchrun's variables included) and a `[batch]`
//! job's planned batch reach the worker.
//!
//! Needs `CONVERGE_PYTHON`: an interpreter with numpy and the kit (`run-tests.sh` makes
//! one in `target/py`). Without it the tests print why and pass, unless
//! `CONVERGE_REQUIRE_PYTHON=1`, where they fail.

use converge_bus::Bus;
use converge_common::{EndReason, HostTelemetry, JobPhase, JobSpec, JobStatus};
use converge_tests::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The interpreter from `CONVERGE_PYTHON`, checked to import numpy and the kit; `None`
/// (the test is skipped, with the reason printed) when unset and not required.
fn python() -> Option<PathBuf> {
    let required = std::env::var("CONVERGE_REQUIRE_PYTHON").as_deref() == Ok("1");
    let Some(python) = std::env::var_os("CONVERGE_PYTHON").filter(|p| !p.is_empty()) else {
        assert!(
            !required,
            "CONVERGE_REQUIRE_PYTHON=1 but CONVERGE_PYTHON is not set: point it at a Python \
             with numpy and the converge-worker kit (`pip install ./python numpy`); \
             run-tests.sh makes one in target/py"
        );
        eprintln!(
            "SKIPPED: CONVERGE_PYTHON is not set (a Python with numpy and `pip install ./python`; \
             run-tests.sh sets it, CONVERGE_REQUIRE_PYTHON=1 makes this a failure)"
        );
        return None;
    };
    let python = PathBuf::from(python);
    let out = std::process::Command::new(&python)
        .args(["-c", "import numpy, converge_worker"])
        .output()
        .unwrap_or_else(|e| panic!("CONVERGE_PYTHON={} cannot run: {e}", python.display()));
    assert!(
        out.status.success(),
        "CONVERGE_PYTHON={} lacks numpy or the converge-worker kit: {}",
        python.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(python)
}

/// The numpy worker's job spec: `args` after the script, and `extra` TOML (`[batch]`).
fn numpy_job(python: &Path, id: &str, max_workers: u32, args: &[&str], extra: &str) -> JobSpec {
    let script = repo_root().join("examples/python/numpy_worker.py");
    let mut command = vec![
        python.display().to_string(),
        script.display().to_string(),
        "--data-dir".into(),
        repo_root().join("data").display().to_string(),
    ];
    command.extend(args.iter().map(|a| a.to_string()));
    let toml = format!(
        "id = {id:?}\ncommand = {command:?}\nmin_workers = 1\nmax_workers = {max_workers}\n\
         max_restarts = 0\n{extra}\n[labels]\nmodel = \"softmax\"\ndataset = \"optdigits\"\n"
    );
    let mut spec = JobSpec::from_toml(&toml).unwrap_or_else(|e| panic!("{e}:\n{toml}"));
    spec.submitted_at = converge_bus::unix_now();
    spec
}

/// The `CONVERGE_WORKER_ENV` line the worker printed first, from its log file.
fn worker_env(work: &Path, job: &str, generation: u64, rank: u32) -> serde_json::Value {
    let log = work
        .join("logs")
        .join(job)
        .join(format!("gen{generation}-rank{rank}.log"));
    let text = std::fs::read_to_string(&log)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", log.display()));
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("CONVERGE_WORKER_ENV "))
        .unwrap_or_else(|| panic!("no CONVERGE_WORKER_ENV line in {}:\n{text}", log.display()));
    serde_json::from_str(line).unwrap()
}

/// What the agent must have given rank `rank` of the job's generation, as the worker's
/// kit read it.
fn check_env(work: &Path, s: &JobStatus, rank: u32) -> serde_json::Value {
    let job = s.job.as_str();
    let seen = worker_env(work, job, s.generation, rank);
    let c = &seen["contract"];
    let placed = s.placement.iter().find(|p| p.rank == rank).unwrap();
    let gpus: Vec<String> = placed.gpus.iter().map(u32::to_string).collect();
    assert_eq!(c["rank"], rank, "{seen}");
    assert_eq!(c["world_size"], s.world_size, "{seen}");
    assert_eq!(c["local_rank"], 0, "one worker per host: {seen}");
    assert_eq!(c["job_id"], job, "{seen}");
    assert_eq!(c["generation"], s.generation, "{seen}");
    assert_eq!(c["master_port"], s.master_port.unwrap(), "{seen}");
    assert_eq!(c["master_addr"], "127.0.0.1", "{seen}");
    assert_eq!(c["num_ps"], 0, "{seen}");
    assert_eq!(c["cuda_visible_devices"], gpus.join(","), "{seen}");
    let ckpt = work.join("checkpoints").join(job);
    assert_eq!(c["checkpoint_dir"], ckpt.display().to_string(), "{seen}");
    // torchrun's variables, as the kit and the script read them.
    assert_eq!(
        c["group_rank"], rank,
        "GROUP_RANK = RANK - LOCAL_RANK: {seen}"
    );
    assert_eq!(c["run_id"], job, "{seen}");
    assert_eq!(c["restart_count"], s.generation, "{seen}");
    let env = &seen["env"];
    assert_eq!(env["ROLE_RANK"], rank.to_string(), "{seen}");
    assert_eq!(env["LOCAL_WORLD_SIZE"], "1", "{seen}");
    assert_eq!(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "1", "{seen}");
    seen
}

async fn malformed_lines(bus: &Bus, host: &str) -> (u64, u64) {
    let (t, _) = bus
        .get::<HostTelemetry>(&bus.hosts, host)
        .await
        .unwrap()
        .unwrap();
    (t.malformed_progress_lines, t.ignored_gradient_stats)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numpy_worker_trains_grows_to_a_second_host_resumes_and_completes() {
    let Some(python) = python() else { return };
    let (nats, work, bus) = start_test().await;
    let job = "py-numpy";
    let mut progress = subscribe_progress(&bus, job).await;
    let a1 = start_agent(agent_config(&nats, "n1", 1, work.path()));
    let allocator = start_allocator(allocator_config(&nats, Duration::ZERO));
    // 12 epochs of optdigits at 32 samples per worker per step, 10 ms per step: about
    // 15 s alone, 8 s on two workers.
    let spec = numpy_job(
        &python,
        job,
        2,
        &[
            "--epochs",
            "12",
            "--step-delay-ms",
            "10",
            "--log-every",
            "10",
            "--eval-every",
            "50",
            "--checkpoint-every",
            "0.5",
        ],
        "",
    );
    bus.put(&bus.jobs, job, &spec).await.unwrap();

    let s1 = wait_for_status(&bus, job, 60, "the job running on n1", |s| {
        s.phase == JobPhase::Running && s.world_size == 1
    })
    .await;

    // The first generation's reports: the kit's line reaches the allocator whole.
    let first = next_report(&mut progress, 60).await;
    assert_eq!((first.generation, first.rank), (s1.generation, 0));
    let mut last = first.clone();
    while last.line.step < first.line.step + 150 {
        last = next_report(&mut progress, 60).await;
        assert_eq!(last.generation, s1.generation, "no resize with one GPU");
    }
    assert!(
        last.line.loss < 0.7 * first.line.loss,
        "the numpy worker's loss did not fall: {} -> {}",
        first.line.loss,
        last.line.loss
    );
    assert_eq!(last.line.model_bytes, Some((64 * 10 + 10) * 8));
    assert_eq!(
        last.line.sync_s,
        Some(0.0),
        "one worker synchronizes nothing"
    );
    assert!(
        last.line.grad_sqr.is_some_and(|g| g >= 0.0) && last.line.grad_var.is_some_and(|v| v > 0.0),
        "the kit's gradient statistics were dropped: {last:?}"
    );
    assert!(last.line.epoch.is_some_and(|e| e > 0.0));
    check_env(work.path(), &s1, 0);

    // A second host joins: the allocator grows the job, the agent stops the first
    // generation (SIGTERM: checkpoint, exit) and both hosts resume from the checkpoint.
    let a2 = start_agent(agent_config(&nats, "n2", 1, work.path()));
    let grown = first_report_after(&mut progress, s1.generation, 60, &mut last).await;
    let s2 = job_status(&bus, job).await.unwrap();
    assert_eq!(
        (s2.world_size, grown.workers),
        (2, Some(2)),
        "{s2:?} {grown:?}"
    );
    assert!(
        grown.line.step > 0
            && grown.line.step + 30 >= last.line.step
            && grown.line.step <= last.line.step + 30,
        "resumed at step {} but the previous generation reached {}",
        grown.line.step,
        last.line.step
    );
    assert!(
        grown.line.loss < 0.7 * first.line.loss,
        "the new generation started over: {} (first {})",
        grown.line.loss,
        first.line.loss
    );
    assert!(grown.line.sync_s.is_some_and(|s| s > 0.0), "{grown:?}");
    check_env(work.path(), &s2, 0);
    check_env(work.path(), &s2, 1);

    // Rank 0's exit 0 completes the job; its status keeps the falling loss.
    let done = wait_for(Duration::from_secs(120), "the job completed", || async {
        let s = job_status(&bus, job).await?;
        assert!(
            !matches!(s.phase, JobPhase::Failed | JobPhase::Cancelled),
            "the job ended badly: {s:?}"
        );
        (s.phase == JobPhase::Completed).then_some(s)
    })
    .await;
    assert_eq!(
        done.end.as_ref().map(|e| e.reason),
        Some(EndReason::Finished)
    );
    let (first_loss, loss) = (done.first_loss.unwrap(), done.loss.unwrap());
    assert!(
        loss < 0.5 * first_loss,
        "status loss {first_loss} -> {loss}"
    );
    assert!(done.eval_loss.is_some_and(|e| e < 0.5), "{done:?}");
    assert!(done.samples >= 12 * 3823, "{done:?}");
    // The final checkpoint: the kit's header names the last generation.
    let header = std::fs::read(
        work.path()
            .join("checkpoints")
            .join(job)
            .join("checkpoint.ckpt"),
    )
    .expect("the final checkpoint");
    let first_line = String::from_utf8_lossy(header.split(|&b| b == b'\n').next().unwrap());
    assert!(
        first_line.starts_with("CONVERGE-CHECKPOINT 1 ")
            && first_line.contains(&format!("\"generation\":{}", s2.generation)),
        "{first_line}"
    );
    for host in ["n1", "n2"] {
        assert_eq!(malformed_lines(&bus, host).await, (0, 0), "{host}");
    }

    for a in [a1, a2] {
        a.stop().await;
    }
    allocator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_jobs_planned_batch_reaches_the_numpy_worker() {
    let Some(python) = python() else { return };
    let (nats, work, bus) = start_test().await;
    let job = "py-batch";
    let a1 = start_agent(agent_config(&nats, "n1", 1, work.path()));
    let allocator = start_allocator(allocator_config(&nats, Duration::from_secs(600)));
    let spec = numpy_job(
        &python,
        job,
        1,
        &[
            "--epochs",
            "3",
            "--log-every",
            "10",
            "--step-delay-ms",
            "10",
        ],
        "[batch]\nreference = 64\nmax_total = 128\nmin_per_worker = 8\nmax_per_worker = 32\n",
    );
    bus.put(&bus.jobs, job, &spec).await.unwrap();
    // A finished job's status has no placement: keep the latest running one.
    let mut running: Option<JobStatus> = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let done = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the job did not complete in 90 s: {running:?}"
        );
        if let Some(s) = job_status(&bus, job).await {
            assert!(
                !matches!(s.phase, JobPhase::Failed | JobPhase::Cancelled),
                "the job ended badly: {s:?}"
            );
            if s.phase == JobPhase::Completed {
                break s;
            }
            if s.phase == JobPhase::Running && !s.placement.is_empty() {
                running = Some(s);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(done.loss.unwrap() < done.first_loss.unwrap(), "{done:?}");
    let running = running.expect("the job was seen running");
    let plan = running
        .batch
        .as_ref()
        .and_then(|b| b.plan)
        .expect("a running [batch] job has a planned batch");
    let seen = check_env(work.path(), &running, 0);
    let b = &seen["contract"]["batch"];
    assert_eq!(
        (
            &b["per_worker"],
            &b["accum_steps"],
            &b["total"],
            &b["reference"]
        ),
        (
            &plan.per_worker.into(),
            &plan.accum_steps.into(),
            &plan.total.into(),
            &64.into()
        ),
        "{seen}"
    );
    assert!(plan.per_worker <= 32, "{plan:?}");
    assert_eq!(malformed_lines(&bus, "n1").await, (0, 0));
    a1.stop().await;
    allocator.stop().await;
}

/// The PyTorch examples' job specs (submitted on GPU hosts by tests/gpu/run.sh) are valid,
/// run on one GPU, and name scripts that exist relative to the repository root, where
/// the agent runs them from. Needs no Python.
#[test]
fn pytorch_example_specs_are_valid_and_fit_one_gpu() {
    for (file, id, script) in [
        (
            "ddp_mnist.toml",
            "ddp-mnist",
            "examples/pytorch/ddp_mnist.py",
        ),
        (
            "plain_mnist.toml",
            "plain-mnist",
            "examples/pytorch/plain_mnist.py",
        ),
    ] {
        let path = repo_root().join("examples/pytorch").join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let spec = JobSpec::from_toml(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(spec.id.as_str(), id);
        assert_eq!((spec.gpus_per_worker, spec.min_workers), (1, 1), "{file}");
        assert_eq!(
            spec.command[..2],
            ["python3".to_string(), script.to_string()]
        );
        assert!(repo_root().join(script).is_file(), "{script} is missing");
        let data = spec.command.iter().position(|a| a == "--data-dir").unwrap();
        assert!(
            repo_root()
                .join(&spec.command[data + 1])
                .join("mnist_subset")
                .is_dir()
        );
    }
}

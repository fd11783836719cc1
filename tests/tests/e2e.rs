//! End to end on loopback: a real nats-server, in-process agents and allocator, the
//! `converge` CLI and real `converge-trainer` processes.

use converge_common::{HostTelemetry, JobPhase, WorkerPhase, codec::decode};
use converge_tests::*;
use futures::StreamExt;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_worker_job_across_agents_trains_and_resumes_after_resize() {
    let (nats, work, bus) = start_test().await;
    let mut progress = subscribe_progress(&bus, "opt").await;
    let mut agents = start_agents(&nats, &["n1", "n2"], 1, work.path());
    let allocator = start_allocator(allocator_config(&nats, Duration::ZERO));

    let spec = TrainerJob::new("opt", 1000)
        .workers(2, 3)
        .write(work.path());
    nats.submit(&spec);

    // Placed over both single-GPU hosts.
    let s = wait_for_status(&bus, "opt", 30, "job running on n1 and n2", |s| {
        s.phase == JobPhase::Running && s.world_size == 2
    })
    .await;
    assert_eq!(placed_hosts(&s), ["n1", "n2"]);

    // The loss falls.
    let first = next_report(&mut progress, 30).await;
    let mut last = first.clone();
    while last.line.step < first.line.step + 150 {
        last = next_report(&mut progress, 30).await;
        assert_eq!(
            last.generation, s.generation,
            "no resize while only two GPUs exist"
        );
    }
    assert!(
        last.line.loss < 0.6 * first.line.loss,
        "loss did not fall: {} -> {}",
        first.line.loss,
        last.line.loss
    );

    // A third host joins: the job grows to three workers and resumes from its checkpoint.
    agents.push(start_agent(agent_config(&nats, "n3", 1, work.path())));
    let grown = first_report_after(&mut progress, s.generation, 30, &mut last).await;
    let s2 = job_status(&bus, "opt").await.unwrap();
    assert_eq!(s2.world_size, 3, "{s2:?}");
    assert!(
        grown.line.step > 0,
        "the new generation restarted at step 0"
    );
    assert!(
        grown.line.step + 30 >= last.line.step && grown.line.step <= last.line.step + 30,
        "resumed at step {} but the previous generation reached {}",
        grown.line.step,
        last.line.step
    );

    // Cancel through the CLI: the job ends and every worker stops.
    let out = converge(&nats, &["cancel", "opt"]);
    succeeded(&out);
    wait_for(
        Duration::from_secs(30),
        "cancelled and no workers left",
        || async {
            let s = job_status(&bus, "opt").await?;
            let mut alive = 0;
            for h in ["n1", "n2", "n3"] {
                let (t, _) = bus.get::<HostTelemetry>(&bus.hosts, h).await.ok()??;
                alive += t
                    .workers
                    .iter()
                    .filter(|w| w.phase == WorkerPhase::Running || w.phase == WorkerPhase::Stopping)
                    .count();
            }
            (s.phase == JobPhase::Cancelled && alive == 0).then_some(())
        },
    )
    .await;
    let out = converge(&nats, &["--json", "jobs", "--all"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["status"]["phase"], "cancelled");

    for a in agents {
        a.stop().await;
    }
    allocator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocator_restart_rebuilds_state_and_rewrites_no_plan() {
    let (nats, work, bus) = start_test().await;
    let agent = start_agent(agent_config(&nats, "n1", 2, work.path()));
    let first = start_allocator(allocator_config(&nats, Duration::from_secs(600)));
    let spec = TrainerJob::new("steady", 1000)
        .workers(1, 2)
        .write(work.path());
    nats.submit(&spec);

    let before = wait_for_status(&bus, "steady", 60, "job running with a fitted curve", |s| {
        s.phase == JobPhase::Running && s.curve.is_some()
    })
    .await;
    let plan_rev = bus.plans.entry("n1").await.unwrap().unwrap().revision;
    let pids = |t: HostTelemetry| -> Vec<u32> { t.workers.iter().filter_map(|w| w.pid).collect() };
    let pids_before = pids(telemetry(&bus, "n1").await.unwrap());

    // Like kill -9, three times: no shutdown path runs. Each new allocator reads the specs
    // and heartbeats before its first step: one that stepped as soon as it had rebuilt the
    // progress history, before any heartbeat arrived, took the host for lost and restarted
    // the job (about one run in six).
    let mut allocator = first;
    for round in 1..=3 {
        allocator.abort();
        let restarted_at = converge_bus::unix_now();
        allocator = start_allocator(allocator_config(&nats, Duration::from_secs(600)));
        let after = wait_for_status(
            &bus,
            "steady",
            30,
            "status rewritten by the new allocator",
            |s| s.updated_at > restarted_at + 0.5,
        )
        .await;
        assert_eq!(after.phase, JobPhase::Running, "restart {round}");
        assert_eq!(
            after.generation, before.generation,
            "restart {round}: the job was restarted needlessly"
        );
        assert_eq!(after.placement, before.placement, "restart {round}");
        assert_eq!(
            after.first_loss, before.first_loss,
            "restart {round}: loss history not rebuilt from the stream"
        );
        assert!(after.curve.is_some() && after.step >= before.step);
    }

    // Three more epochs: still the same plan revision and the same worker processes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let plan_rev_after = bus.plans.entry("n1").await.unwrap().unwrap().revision;
    assert_eq!(
        plan_rev_after, plan_rev,
        "the restarted allocator rewrote an unchanged plan"
    );
    let pids_after = pids(telemetry(&bus, "n1").await.unwrap());
    assert_eq!(pids_after, pids_before);

    allocator.stop().await;
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_refuses_bad_specs_with_the_reason_and_writes_nothing() {
    let (nats, work, bus) = start_test().await;
    let cases = [
        ("id = \"a.b\"\ncommand = [\"x\"]\n", "'.'"),
        (
            "id = \"ok\"\ncommand = [\"x\"]\nmin_workers = 4\nmax_workers = 2\n",
            "max_workers",
        ),
        (
            "id = \"ok\"\ncommand = [\"x\"]\n[env]\nWORLD_SIZE = \"9\"\n",
            "WORLD_SIZE",
        ),
        (
            "id = \"ok\"\ncommand = [\"x\"]\ngpus = 2\n",
            "unknown field",
        ),
    ];
    for (text, reason) in cases {
        let path = work.path().join("bad.toml");
        std::fs::write(&path, text).unwrap();
        let out = converge(&nats, &["submit", path.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(reason),
            "{text:?}: {stderr}"
        );
    }
    let out = converge(&nats, &["submit", "/nonexistent.toml"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read job spec"));
    let (specs, _) = (
        bus.load_all::<converge_common::JobSpec>(&bus.jobs, &Default::default())
            .await
            .unwrap(),
        (),
    );
    assert!(specs.is_empty(), "a refused spec was written");

    // A duplicate id is refused too.
    let good = TrainerJob::new("dup", 1000)
        .workers(1, 1)
        .write(work.path());
    assert!(
        converge(&nats, &["submit", good.to_str().unwrap()])
            .status
            .success()
    );
    let out = converge(&nats, &["submit", good.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("already exists"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameter_server_job_trains_with_a_shard_next_to_its_workers() {
    let (nats, work, bus) = start_test().await;
    let mut progress = subscribe_progress(&bus, "ps").await;
    let agent = start_agent(agent_config(&nats, "n1", 2, work.path()));
    let allocator = start_allocator(allocator_config(&nats, Duration::ZERO));

    let trainer = bin_path("converge-trainer");
    let data = repo_root().join("data");
    let spec = work.path().join("ps.toml");
    std::fs::write(
        &spec,
        format!(
            r#"id = "ps"
command = ["{}", "--dataset", "optdigits", "--data-dir", "{}", "--epochs", "4",
           "--step-delay-ms", "5", "--log-every", "5", "--checkpoint-every", "5"]
arch = "ps"
max_ps = 1
min_workers = 2
max_workers = 2
"#,
            trainer.display(),
            data.display()
        ),
    )
    .unwrap();
    nats.submit(&spec);

    // Two workers and one shard (no GPU) run on n1.
    wait_for(
        Duration::from_secs(30),
        "2 workers + 1 shard on n1",
        || async {
            let (t, _) = bus.get::<HostTelemetry>(&bus.hosts, "n1").await.ok()??;
            let ranks: Vec<u32> = t
                .workers
                .iter()
                .filter(|w| w.job.as_str() == "ps" && w.phase == WorkerPhase::Running)
                .map(|w| w.rank)
                .collect();
            (ranks.len() == 3).then_some(())
        },
    )
    .await;
    // The status names the shard the planner placed: next to the workers, rank 2.
    let running = job_status(&bus, "ps")
        .await
        .expect("status of a running job");
    let shards: Vec<(u32, &str)> = running
        .ps_placement
        .iter()
        .map(|r| (r.rank, r.host.as_str()))
        .collect();
    assert_eq!(shards, [(2, "n1")]);
    let first = next_report(&mut progress, 30).await;
    let done = wait_for_phase(&bus, "ps", JobPhase::Completed, 60).await;
    let mut last = first.clone();
    while let Ok(Some(msg)) =
        tokio::time::timeout(Duration::from_millis(200), progress.next()).await
    {
        last = decode(&msg.payload).unwrap();
    }
    let loss = done.loss.unwrap_or(last.line.loss);
    assert!(
        loss < 0.5 * first.line.loss,
        "loss did not fall: {} -> {loss}",
        first.line.loss
    );

    agent.stop().await;
    allocator.stop().await;
}

/// Two `[batch]` jobs through the allocator: the plan carries each generation's batch to
/// the trainer, which applies it (with its scaled learning rate) and reports gradient
/// statistics; the job that reports none (`--no-grad-stats`) keeps its reference batch,
/// and `converge jobs` says which is which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_jobs_get_their_batch_and_the_one_without_statistics_stays_fixed() {
    let (nats, work, bus) = start_test().await;
    let _agent = start_agent(agent_config(&nats, "n1", 2, work.path()));
    let _allocator = start_allocator(allocator_config(&nats, Duration::ZERO));
    let table = "reference = 32\nmax_total = 256\nmin_per_worker = 8\nmax_per_worker = 64";
    for job in [
        TrainerJob::new("adapt", 1000).batch(table),
        TrainerJob::new("fixed", 1000)
            .batch(table)
            .arg("--no-grad-stats"),
    ] {
        nats.submit(&job.write(work.path()));
    }
    let adapt = wait_for(
        Duration::from_secs(60),
        "adapt running with a plan and gradient statistics",
        || async {
            let s = job_status(&bus, "adapt").await?;
            let b = s.batch.as_ref()?;
            (s.phase == JobPhase::Running
                && b.plan.is_some()
                && b.adaptive
                && b.gradient_reports >= 3)
                .then_some(s)
        },
    )
    .await;
    let b = adapt.batch.as_ref().unwrap();
    let plan = b.plan.unwrap();
    plan.check(adapt.world_size).unwrap();
    assert!(b.noise_scale.is_some_and(|n| n > 0.0), "{b:?}");
    assert_eq!(b.ignored_gradient_stats, 0);
    // The trainer read the plan: its log names the planned total, and its learning rate
    // follows AdaScale's gain (its default rule) from its gradient statistics.
    let log = work
        .path()
        .join(format!("logs/adapt/gen{}-rank0.log", adapt.generation));
    let expect = format!("planned batch {} ", plan.total);
    wait_for(
        Duration::from_secs(30),
        "the trainer's log names the planned batch and AdaScale's gain",
        || async {
            let text = std::fs::read_to_string(&log).ok()?;
            (text.contains(&expect) && text.contains("AdaScale from step")).then_some(())
        },
    )
    .await;
    let fixed = wait_for_status(&bus, "fixed", 30, "fixed running with reports", |s| {
        s.phase == JobPhase::Running && s.step > 10
    })
    .await;
    let b = fixed.batch.as_ref().unwrap();
    assert!(!b.adaptive && b.gradient_reports == 0, "{b:?}");
    assert_eq!(b.plan.unwrap().total, 32, "keeps its reference batch");
    let log = work
        .path()
        .join(format!("logs/fixed/gen{}-rank0.log", fixed.generation));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("AdaScale needs the gradient statistics"),
        "without statistics the trainer says it uses the square-root rule: {text}"
    );

    let out = converge(&nats, &["jobs"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("adaptive"), "{table}");
    assert!(table.contains("fixed (no gradient statistics)"), "{table}");
    let out = converge(&nats, &["--json", "jobs"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let modes: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["batch_mode"].as_str().unwrap())
        .collect();
    assert!(modes.contains(&"adaptive") && modes.contains(&"fixed (no gradient statistics)"));
}

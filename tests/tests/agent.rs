//! Agent against a real nats-server: starts, resizes and stops real trainer processes from
//! plans written to KV; counts malformed progress lines; restarts crashed workers with
//! backoff and gives up after the limit.

use converge_common::{
    AssignedBatch, HostId, HostPlan, HostTelemetry, JobId, PROTOCOL_VERSION, ProgressReport,
    WorkerAssignment, WorkerPhase, codec::decode, subjects,
};
use converge_tests::*;
use futures::StreamExt;
use std::collections::BTreeMap;
use std::time::Duration;

fn worker(
    job: &str,
    generation: u64,
    rank: u32,
    world_size: u32,
    gpu: u32,
    command: Vec<String>,
) -> WorkerAssignment {
    WorkerAssignment {
        job: JobId::new(job).unwrap(),
        generation,
        rank,
        world_size,
        local_rank: rank,
        local_world_size: world_size,
        gpus: vec![gpu],
        master_addr: "127.0.0.1".into(),
        master_port: 21000 + generation as u16 * 10,
        command,
        env: BTreeMap::new(),
        max_restarts: 2,
        num_ps: 0,
        hosts: 0,
        batch: None,
        node_rank: None,
        shadow: None,
    }
}

fn trainer_command() -> Vec<String> {
    vec![
        bin_path("converge-trainer").display().to_string(),
        "--dataset".into(),
        "optdigits".into(),
        "--data-dir".into(),
        repo_root().join("data").display().to_string(),
        "--epochs".into(),
        "1000".into(),
        "--step-delay-ms".into(),
        "10".into(),
        "--log-every".into(),
        "5".into(),
        "--checkpoint-every".into(),
        "1".into(),
    ]
}

fn plan(host: &str, workers: Vec<WorkerAssignment>) -> HostPlan {
    HostPlan {
        protocol: PROTOCOL_VERSION,
        host: HostId::new(host).unwrap(),
        workers,
    }
}

/// A test's start with one agent of two fake GPUs for `host`: the server, the work
/// directory, a bus, a subscription to every progress report and the agent.
async fn start_with_agent(
    host: &str,
) -> (
    NatsServer,
    tempfile::TempDir,
    converge_bus::Bus,
    async_nats::Subscriber,
    Running,
) {
    let (nats, work, bus) = start_test().await;
    let progress = bus.client.subscribe(subjects::PROGRESS_ALL).await.unwrap();
    let agent = start_agent(agent_config(&nats, host, 2, work.path()));
    (nats, work, bus, progress, agent)
}

/// Polls `host`'s telemetry until `ready` holds for it and returns it, or panics with
/// `what` after `secs` seconds.
async fn wait_for_telemetry(
    bus: &converge_bus::Bus,
    host: &str,
    secs: u64,
    what: &str,
    ready: impl Fn(&HostTelemetry) -> bool,
) -> HostTelemetry {
    wait_for(Duration::from_secs(secs), what, || async {
        let t = telemetry(bus, host).await?;
        ready(&t).then_some(t)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_starts_resizes_and_stops_real_workers() {
    let (_nats, work, bus, mut progress, agent) = start_with_agent("n1").await;

    // Generation 1: two ranks on this host.
    let cmd = trainer_command();
    bus.put(
        &bus.plans,
        "n1",
        &plan(
            "n1",
            vec![
                worker("opt", 1, 0, 2, 0, cmd.clone()),
                worker("opt", 1, 1, 2, 1, cmd.clone()),
            ],
        ),
    )
    .await
    .unwrap();
    let gen1_pids: Vec<u32> = wait_for(
        Duration::from_secs(30),
        "two running workers in telemetry",
        || async {
            let t = telemetry(&bus, "n1").await?;
            let pids: Vec<u32> = t
                .workers
                .iter()
                .filter(|w| w.phase == WorkerPhase::Running && w.generation == 1)
                .filter_map(|w| w.pid)
                .collect();
            (pids.len() == 2 && t.gpus.iter().filter(|g| g.utilization_pct > 0.0).count() == 2)
                .then_some(pids)
        },
    )
    .await;
    assert!(gen1_pids.iter().all(|&p| pid_alive(p)));

    // Progress flows; wait until a checkpoint has surely been written (1 s interval).
    let mut last_gen1 = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while tokio::time::Instant::now() < deadline {
        let msg = tokio::time::timeout(Duration::from_secs(30), progress.next())
            .await
            .expect("progress within 30 s")
            .unwrap();
        let r: ProgressReport = decode(&msg.payload).unwrap();
        assert_eq!((r.job.as_str(), r.generation), ("opt", 1));
        // On this host's subject of the job, the only one its NATS user may publish to.
        assert_eq!(msg.subject.as_str(), "converge.v1.progress.opt.n1");
        if r.line.step >= 60 {
            last_gen1 = Some(r);
            break;
        }
    }
    let last_gen1 = last_gen1.expect("generation 1 reached step 60");
    // The trainer's measured all-reduce time and model size (650 f64) reach the report.
    let sync = last_gen1.line.sync_s.expect("sync time in the report");
    assert!(sync > 0.0 && sync.is_finite(), "{sync}");
    assert_eq!(last_gen1.line.model_bytes, Some(650 * 8));

    // Generation 2: one rank. The old generation is stopped first, then the new one resumes.
    bus.put(
        &bus.plans,
        "n1",
        &plan("n1", vec![worker("opt", 2, 0, 1, 0, cmd.clone())]),
    )
    .await
    .unwrap();
    let first_gen2 = loop {
        let r = next_report(&mut progress, 30).await;
        if r.generation == 2 {
            break r;
        }
    };
    assert!(
        gen1_pids.iter().all(|&p| !pid_alive(p)),
        "generation 1 processes still alive"
    );
    assert!(
        first_gen2.line.step > 0,
        "generation 2 started at step 0 instead of the checkpoint"
    );
    assert!(
        first_gen2.line.step + 40 >= last_gen1.line.step,
        "resumed too far back: {} vs {}",
        first_gen2.line.step,
        last_gen1.line.step
    );
    let log = work.path().join("logs/opt/gen2-rank0.log");
    assert!(
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("CONVERGE_PROGRESS"),
        "worker log {log:?}"
    );

    // Empty plan: everything stops.
    let gen2_pid = wait_for(Duration::from_secs(10), "generation 2 pid", || async {
        telemetry(&bus, "n1")
            .await?
            .workers
            .iter()
            .find(|w| w.generation == 2 && w.phase == WorkerPhase::Running)
            .and_then(|w| w.pid)
    })
    .await;
    bus.put(&bus.plans, "n1", &plan("n1", vec![]))
        .await
        .unwrap();
    wait_for(Duration::from_secs(20), "no workers left", || async {
        let t = telemetry(&bus, "n1").await?;
        (t.workers.is_empty() && !pid_alive(gen2_pid)).then_some(())
    })
    .await;
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_lines_are_counted_and_crashes_back_off_then_fail() {
    let (_nats, work, bus, mut progress, agent) = start_with_agent("n2").await;

    let sh = |script: &str| vec!["sh".to_string(), "-c".to_string(), script.to_string()];
    bus.put(&bus.plans, "n2", &plan("n2", vec![
        worker("chatty", 1, 0, 1, 0, sh("echo 'CONVERGE_PROGRESS {bad json'; echo 'CONVERGE_PROGRESS {\"step\":1,\"samples\":8,\"loss\":NaN}'; echo 'CONVERGE_PROGRESS {\"step\":1,\"samples\":8,\"loss\":0.6,\"sync_s\":-1}'; echo 'CONVERGE_PROGRESS {\"step\":1,\"samples\":8,\"loss\":0.6,\"sync_rounds_per_s\":2,\"model_gap\":-0.1}'; echo 'CONVERGE_PROGRESS {\"step\":2,\"samples\":16,\"loss\":0.5,\"sync_s\":0.25,\"model_bytes\":4096,\"sync_rounds_per_s\":6.5,\"model_gap\":0.0125}'; echo hello; exec sleep 60")),
        worker("crashy", 1, 0, 1, 1, sh("echo dying >&2; exit 3")),
    ])).await.unwrap();

    let r = next_report(&mut progress, 20).await;
    assert_eq!(
        (r.job.as_str(), r.line.step, r.line.samples, r.line.loss),
        ("chatty", 2, 16, 0.5)
    );
    assert_eq!(
        (r.line.sync_s, r.line.model_bytes),
        (Some(0.25), Some(4096))
    );
    assert_eq!(
        (r.line.sync_rounds_per_s, r.line.model_gap),
        (Some(6.5), Some(0.0125)),
        "a shadow worker's sync figures reach the report"
    );

    let t = wait_for_telemetry(&bus, "n2", 20, "crashy failed after 2 restarts", |t| {
        t.workers
            .iter()
            .any(|w| w.job.as_str() == "crashy" && w.phase == WorkerPhase::Failed)
    })
    .await;
    assert_eq!(
        t.malformed_progress_lines, 4,
        "bad JSON, NaN loss, negative sync time and negative model gap are all malformed"
    );
    let crashy = t
        .workers
        .iter()
        .find(|w| w.job.as_str() == "crashy")
        .unwrap();
    assert_eq!((crashy.restarts, crashy.last_exit_code), (2, Some(3)));
    let chatty = t
        .workers
        .iter()
        .find(|w| w.job.as_str() == "chatty")
        .unwrap();
    assert_eq!(
        chatty.phase,
        WorkerPhase::Running,
        "the agent kept serving the other worker"
    );
    let log = std::fs::read_to_string(work.path().join("logs/crashy/gen1-rank0.log")).unwrap();
    assert_eq!(
        log.matches("dying").count(),
        3,
        "one start and two restarts, all logged"
    );

    // Garbage in the plan key is refused, and the agent keeps its workers.
    bus.plans.put("n2", "{not a plan".into()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t = telemetry(&bus, "n2").await.unwrap();
    assert!(
        t.workers
            .iter()
            .any(|w| w.job.as_str() == "chatty" && w.phase == WorkerPhase::Running)
    );
    agent.stop().await;
}

/// The plan's batch reaches the worker as contract variables; progress lines with missing,
/// NaN or negative gradient statistics are counted in the telemetry and reported without
/// them; valid statistics pass through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planned_batches_reach_workers_and_bad_gradient_statistics_are_counted_and_ignored() {
    let (_nats, _work, bus, mut progress, agent) = start_with_agent("n3").await;

    // Samples are the planned total per step; grad_var echoes the per-worker batch and
    // grad_sqr the accumulation steps + reference, so the report shows what the worker read.
    let script = r#"
T=$CONVERGE_TOTAL_BATCH
echo "CONVERGE_PROGRESS {\"step\":1,\"samples\":$T,\"loss\":0.9,\"grad_sqr\":NaN,\"grad_var\":1}"
echo "CONVERGE_PROGRESS {\"step\":2,\"samples\":$((2*T)),\"loss\":0.8,\"grad_sqr\":-1,\"grad_var\":1}"
echo "CONVERGE_PROGRESS {\"step\":3,\"samples\":$((3*T)),\"loss\":0.7,\"grad_var\":1}"
echo "CONVERGE_PROGRESS {\"step\":4,\"samples\":$((4*T)),\"loss\":0.6,\"grad_sqr\":$((CONVERGE_ACCUM_STEPS+CONVERGE_REFERENCE_BATCH)),\"grad_var\":$CONVERGE_BATCH_SIZE}"
exec sleep 60"#;
    let mut w = worker(
        "adaptive",
        1,
        0,
        2,
        0,
        vec!["sh".into(), "-c".into(), script.into()],
    );
    w.batch = Some(AssignedBatch {
        total: 96,
        per_worker: 16,
        accum_steps: 2,
        reference: 32,
    });
    let mut rank1 = worker("adaptive", 1, 1, 2, 1, vec!["sleep".into(), "60".into()]);
    rank1.batch = w.batch;
    bus.put(&bus.plans, "n3", &plan("n3", vec![w, rank1]))
        .await
        .unwrap();

    let mut reports = Vec::new();
    while reports.len() < 4 {
        reports.push(next_report(&mut progress, 20).await);
    }
    let samples: Vec<u64> = reports.iter().map(|r| r.line.samples).collect();
    assert_eq!(
        samples,
        [96, 192, 288, 384],
        "every line's loss is reported"
    );
    for r in &reports[..3] {
        assert_eq!(
            (r.line.grad_sqr, r.line.grad_var),
            (None, None),
            "bad pair dropped"
        );
    }
    assert_eq!(
        (reports[3].line.grad_sqr, reports[3].line.grad_var),
        (Some(34.0), Some(16.0)),
        "CONVERGE_ACCUM_STEPS + CONVERGE_REFERENCE_BATCH, CONVERGE_BATCH_SIZE"
    );
    let t = wait_for_telemetry(
        &bus,
        "n3",
        10,
        "three ignored statistics in the telemetry",
        |t| t.ignored_gradient_stats == 3,
    )
    .await;
    assert_eq!(t.malformed_progress_lines, 0, "no line was refused");
    agent.stop().await;
}

/// One job's workers on a host report (below their rate limits: 40 a second each, 80 the
/// job) while the bus stalls for 35 s: the job fills its own queue in the agent's outbox
/// (the oldest dropped, counted) and another job's reports all arrive, in order, once the
/// bus is back. With one queue for every job (before), a flood filled it and the other
/// job's reports were dropped; this test then ran 40 workers of one job, which the job's
/// shared rate limit now holds to 100 reports a second, too few to fill the outbox's
/// channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_flooding_a_stalled_bus_loses_only_its_own_reports() {
    let (nats, work, bus) = start_test().await;
    let mut progress = bus.client.subscribe(subjects::PROGRESS_ALL).await.unwrap();
    let mut cfg = agent_config(&nats, "n4", 2, work.path());
    // Not fenced during the 35 s stall (the allocator is not running here).
    cfg.fence_after = Duration::from_secs(60);
    let agent = start_agent(cfg);
    let sh = |script: &str| vec!["sh".to_string(), "-c".to_string(), script.to_string()];
    // Each flooding worker prints a line every 25 ms for 80 s: under its rate limit and,
    // with two, under the job's, so none is coalesced and every report the job skips is
    // one the outbox dropped. (perl-base
    // is on every Debian system; its `select` sleeps.)
    let flood = r#"perl -e '$| = 1; for my $i (1 .. 3200) { printf "CONVERGE_PROGRESS {\"step\":%d,\"samples\":%d,\"loss\":0.5}\n", $i, 8 * $i; select(undef, undef, undef, 0.025) }'; exec sleep 120"#;
    let steady = r#"for i in $(seq 1 30); do echo "CONVERGE_PROGRESS {\"step\":$i,\"samples\":$((8 * i)),\"loss\":0.9}"; sleep 0.5; done; exec sleep 120"#;
    const FLOOD_RANKS: u32 = 2;
    let mut workers = vec![worker("steady", 1, 0, 1, 0, sh(steady))];
    workers.extend((0..FLOOD_RANKS).map(|r| worker("flood", 1, r, FLOOD_RANKS, 1 + r, sh(flood))));
    bus.put(&bus.plans, "n4", &plan("n4", workers))
        .await
        .unwrap();

    // Once both jobs report, the bus stalls for 35 s: the two workers offer the outbox about
    // 2,700 reports meanwhile (perl prints a little under 40 a second), more than the
    // job's queue (2,000).
    let (mut flood_seen, mut steady_steps) = (0u64, Vec::<u64>::new());
    // A report retried after the stall may reach this (core) subscription twice; the
    // stream stores it once (its message id).
    let note =
        |r: ProgressReport, flood_seen: &mut u64, steady_steps: &mut Vec<u64>| match r.job.as_str()
        {
            "flood" => *flood_seen += 1,
            _ if steady_steps.last() == Some(&r.line.step) => {}
            _ => steady_steps.push(r.line.step),
        };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while flood_seen == 0 || steady_steps.is_empty() {
        let Some(r) = report_before(&mut progress, deadline).await else {
            panic!("no report of both jobs in 30 s");
        };
        note(r, &mut flood_seen, &mut steady_steps);
    }
    nats.pause();
    tokio::time::sleep(Duration::from_secs(35)).await;
    nats.resume();

    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while steady_steps.len() < 30 {
        let Some(r) = report_before(&mut progress, deadline).await else {
            panic!("after the stall: steady's steps {steady_steps:?} ({flood_seen} flood reports)");
        };
        note(r, &mut flood_seen, &mut steady_steps);
    }
    assert_eq!(
        steady_steps,
        (1..=30).collect::<Vec<u64>>(),
        "every steady report, in order"
    );
    // The flood's drops are counted (its workers stay under their rate limits, so nothing
    // else is skipped): about 700.
    let t = wait_for_telemetry(&bus, "n4", 20, "the flood's dropped reports counted", |t| {
        t.skipped_progress_reports >= 200
    })
    .await;
    eprintln!(
        "steady: 30 of 30; flood: {flood_seen} reports seen, {} skipped",
        t.skipped_progress_reports
    );
    agent.stop().await;
}

/// Four workers of one job on one host, each printing progress lines as fast as it can
/// (5,001 in a burst): the job's reports together stay within the job's shared limit
/// (its burst plus its rate, and each worker's last report over it), not four times a
/// worker's; every worker's last report (its final step) arrives, in order; the agent
/// counts what it skipped. Before the job's limit each worker had only its own, and the
/// job sent up to four times as many.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_workers_on_one_host_share_the_jobs_report_rate() {
    use converge_agent::supervisor::{JOB_REPORT_BURST, JOB_REPORTS_PER_S};
    let (nats, work, bus) = start_test().await;
    let mut progress = bus.client.subscribe(subjects::PROGRESS_ALL).await.unwrap();
    let agent = start_agent(agent_config(&nats, "n5", 4, work.path()));
    let sh = |script: &str| vec!["sh".to_string(), "-c".to_string(), script.to_string()];
    let flood = r#"awk 'BEGIN { for (i = 1; i <= 5001; i++) printf "CONVERGE_PROGRESS {\"step\":%d,\"samples\":%d,\"loss\":0.5}\n", i, 8 * i }'; exec sleep 60"#;
    bus.put(
        &bus.plans,
        "n5",
        &plan(
            "n5",
            (0..4)
                .map(|r| worker("wide", 1, r, 4, r, sh(flood)))
                .collect(),
        ),
    )
    .await
    .unwrap();
    let mut steps: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    // Timed from the first report: the limits start with it, not with the workers' start.
    let mut first: Option<std::time::Instant> = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while steps.len() < 4 || steps.values().any(|s| s.last() != Some(&5001)) {
        let Ok(Some(msg)) = tokio::time::timeout_at(deadline, progress.next()).await else {
            panic!(
                "after 60 s: last steps {:?}",
                steps.values().map(|s| s.last()).collect::<Vec<_>>()
            );
        };
        first.get_or_insert_with(std::time::Instant::now);
        let r: ProgressReport = decode(&msg.payload).unwrap();
        let rank = steps.entry(r.rank).or_default();
        // A report retried after a lost acknowledgement may reach this (core) subscription
        // twice.
        if rank.last() != Some(&r.line.step) {
            rank.push(r.line.step);
        }
    }
    let elapsed = first.expect("reports").elapsed().as_secs_f64();
    let sent: usize = steps.values().map(Vec::len).sum();
    // 0.2 s: the first reports' way from the limiter to this subscription. With each
    // worker's limit only, the 4 bursts alone (400) are past this.
    let most = f64::from(JOB_REPORT_BURST) + f64::from(JOB_REPORTS_PER_S) * (elapsed + 0.2) + 4.0;
    assert!(
        (sent as f64) <= most,
        "{sent} reports of the job's 4 workers in {elapsed:.1} s, at most {most:.0}"
    );
    for (rank, s) in &steps {
        assert!(s.windows(2).all(|w| w[0] < w[1]), "rank {rank}: in order");
    }
    let skipped = 4 * 5001 - sent as u64;
    let t = wait_for_telemetry(&bus, "n5", 10, "the skipped reports counted", |t| {
        t.skipped_progress_reports == skipped
    })
    .await;
    eprintln!(
        "4 workers: {sent} of 20004 reports sent in {elapsed:.1} s (at most {most:.0}), {} skipped",
        t.skipped_progress_reports
    );
    agent.stop().await;
}

/// A worker printing progress lines as fast as it can (20,001 in a burst) costs its own job
/// intermediate reports only: each of the same host's other worker's 20 reports arrives,
/// the flooding worker sends at most its burst plus its rate, its last report (the final
/// step) arrives, and the agent counts what it skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_worker_loses_only_its_own_intermediate_reports() {
    let (_nats, _work, bus, mut progress, agent) = start_with_agent("n3").await;

    let sh = |script: &str| vec!["sh".to_string(), "-c".to_string(), script.to_string()];
    let flood = r#"awk 'BEGIN { for (i = 1; i <= 20001; i++) printf "CONVERGE_PROGRESS {\"step\":%d,\"samples\":%d,\"loss\":0.5}\n", i, 8 * i }'; exec sleep 60"#;
    let steady = r#"for i in $(seq 1 20); do echo "CONVERGE_PROGRESS {\"step\":$i,\"samples\":$((8 * i)),\"loss\":0.9}"; sleep 0.1; done; exec sleep 60"#;
    let started = std::time::Instant::now();
    bus.put(
        &bus.plans,
        "n3",
        &plan(
            "n3",
            vec![
                worker("flood", 1, 0, 1, 0, sh(flood)),
                worker("steady", 1, 0, 1, 1, sh(steady)),
            ],
        ),
    )
    .await
    .unwrap();

    let (mut flood_steps, mut steady_steps) = (Vec::new(), Vec::new());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while steady_steps.len() < 20 || flood_steps.last() != Some(&20001) {
        let Ok(Some(msg)) = tokio::time::timeout_at(deadline, progress.next()).await else {
            panic!(
                "after 30 s: steady's steps {steady_steps:?}, flood's last {:?} of {}",
                flood_steps.last(),
                flood_steps.len()
            );
        };
        let r: ProgressReport = decode(&msg.payload).unwrap();
        match r.job.as_str() {
            "flood" => flood_steps.push(r.line.step),
            _ => steady_steps.push(r.line.step),
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(
        steady_steps,
        (1..=20).collect::<Vec<u64>>(),
        "every steady report, in order"
    );
    let most = f64::from(converge_agent::supervisor::REPORT_BURST)
        + f64::from(converge_agent::supervisor::REPORTS_PER_S) * elapsed
        + 1.0;
    assert!(
        (flood_steps.len() as f64) <= most,
        "{} flood reports in {elapsed:.1} s, at most {most:.0}",
        flood_steps.len()
    );
    assert!(
        flood_steps.windows(2).all(|w| w[0] < w[1]),
        "in order, newest kept"
    );
    let skipped = 20001 - flood_steps.len() as u64;
    let t = wait_for_telemetry(&bus, "n3", 10, "the skipped reports counted", |t| {
        t.skipped_progress_reports == skipped
    })
    .await;
    eprintln!(
        "flood: {} of 20001 reports sent in {elapsed:.1} s, {} skipped; steady: 20 of 20",
        flood_steps.len(),
        t.skipped_progress_reports
    );
    agent.stop().await;
}

/// The agent binary, stopped (SIGTERM) while the bus is stalled and its worker's reports
/// wait in the outbox: it keeps trying to send them for 5 s, then counts and logs what it
/// leaves, and exits 0. Before (2026-11-28) the agent stopped waiting for its outbox after
/// 5 s and said nothing of what was left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_agent_logs_the_reports_it_could_not_send() {
    let (nats, work, bus) = start_test().await;
    let log = work.path().join("agent.log");
    let mut agent = std::process::Command::new(bin_path("converge-agent"))
        .args([
            "--nats-url",
            &nats.url,
            "--host-id",
            "n6",
            "--fake-gpus",
            "1",
        ])
        .args(["--fence-after", "60s"])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .current_dir(work.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let text = || std::fs::read_to_string(&log).unwrap_or_default();
    let talk = r#"i=0; while true; do i=$((i + 1)); echo "CONVERGE_PROGRESS {\"step\":$i,\"samples\":$((8 * i)),\"loss\":0.5}"; sleep 0.05; done"#;
    let sh = vec!["sh".to_string(), "-c".to_string(), talk.to_string()];
    wait_for(
        Duration::from_secs(20),
        "the agent's first heartbeat",
        || async { bus.get::<HostTelemetry>(&bus.hosts, "n6").await.ok()? },
    )
    .await;
    bus.put(
        &bus.plans,
        "n6",
        &plan("n6", vec![worker("talk", 1, 0, 1, 0, sh)]),
    )
    .await
    .unwrap();
    let mut progress = bus
        .client
        .subscribe(subjects::progress_of_job(&JobId::new("talk").unwrap()))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    report_before(&mut progress, deadline)
        .await
        .expect("a report of the worker");
    // Reports queue while the server is stopped, then the agent is told to stop.
    nats.pause();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = std::time::Instant::now();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &agent.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let status = loop {
        if let Some(status) = agent.try_wait().unwrap() {
            break status;
        }
        if sent.elapsed() > Duration::from_secs(15) {
            let _ = agent.kill();
            nats.resume();
            panic!("the agent still runs 15 s after SIGTERM:\n{}", text());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    nats.resume();
    let took = sent.elapsed();
    let text = text();
    println!("the agent exited {took:?} after SIGTERM ({status})");
    assert!(status.success(), "{status}:\n{text}");
    let left = text
        .lines()
        .find(|l| l.contains("progress reports not sent at shutdown"))
        .unwrap_or_else(|| panic!("no line for the reports left:\n{text}"));
    println!("{left}");
    assert!(!left.contains("left=0"), "{left}");
    assert!(text.contains("agent stopped"), "{text}");
}

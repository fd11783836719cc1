//! NATS faults with real processes on loopback: a short NATS restart leaves workers running
//! (same PIDs, no new generation); a NATS outage longer than the agent's `--fence-after`
//! makes the agent stop its workers (self-fencing), and when NATS is back the job resumes
//! from its checkpoint without having trained twice. Each test prints its recovery time.

use converge_common::{HostTelemetry, JobPhase, subjects};
use converge_tests::*;
use std::time::{Duration, Instant};

async fn pids(bus: &converge_bus::Bus, host: &str, job: &str) -> Option<(Vec<u32>, f64)> {
    let (t, _) = bus.get::<HostTelemetry>(&bus.hosts, host).await.ok()??;
    let pids = t
        .workers
        .iter()
        .filter(|w| w.job.as_str() == job)
        .filter_map(|w| w.pid)
        .collect();
    Some((pids, t.time))
}

/// The pids of `job`'s workers on n1 once there are any (30 s at most).
async fn worker_pids(bus: &converge_bus::Bus, job: &str) -> Vec<u32> {
    let (pids, _) = wait_for(Duration::from_secs(30), "worker pid", || async {
        pids(bus, "n1", job).await.filter(|(p, _)| !p.is_empty())
    })
    .await;
    pids
}

/// Waits until none of `pids` is alive; panics with `what` after 20 s.
async fn wait_for_exits(pids: &[u32], what: &str) {
    wait_for(Duration::from_secs(20), what, || async {
        pids.iter().all(|&p| !pid_alive(p)).then_some(())
    })
    .await;
}

fn submit(nats: &NatsServer, dir: &std::path::Path, id: &str) {
    nats.submit(&TrainerJob::new(id, 100_000).write(dir));
}

/// The highest step in the progress stream for `job` (its last report from n1, the tests'
/// one host).
async fn last_step(bus: &converge_bus::Bus, job: &str) -> Option<u64> {
    let stream = bus.js.get_stream(subjects::PROGRESS_STREAM).await.ok()?;
    let msg = stream
        .get_last_raw_message_by_subject(&subjects::progress(
            &job.parse().ok()?,
            &"n1".parse().ok()?,
        ))
        .await
        .ok()?;
    let r: converge_common::ProgressReport = converge_common::codec::decode(&msg.payload).ok()?;
    Some(r.line.step)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_leaves_workers_running() {
    let (mut nats, work, bus) = start_test().await;
    let _agent = start_agent(agent_config(&nats, "n1", 1, work.path()));
    let _allocator = start_allocator(allocator_config(&nats, Duration::from_secs(30)));
    submit(&nats, work.path(), "steady");
    let before = wait_for_phase(&bus, "steady", JobPhase::Running, 30).await;
    let pids_before = worker_pids(&bus, "steady").await;
    let step_before = wait_for(Duration::from_secs(30), "progress", || async {
        last_step(&bus, "steady").await
    })
    .await;

    let restarted = Instant::now();
    nats.restart();
    let back_at = converge_bus::unix_now();
    // The agent's heartbeat is fresh again, with the same worker processes.
    let (pids_after, _) = wait_for(Duration::from_secs(30), "fresh heartbeat", || async {
        pids(&bus, "n1", "steady")
            .await
            .filter(|(_, time)| *time > back_at)
    })
    .await;
    let recovery = restarted.elapsed();
    assert_eq!(pids_after, pids_before, "workers were restarted");
    assert!(pids_before.iter().all(|&p| pid_alive(p)));
    // Progress flows again and the allocator changed nothing.
    wait_for(
        Duration::from_secs(30),
        "progress after the restart",
        || async {
            let step = last_step(&bus, "steady").await?;
            (step > step_before + 20).then_some(())
        },
    )
    .await;
    let after = job_status(&bus, "steady").await.unwrap();
    assert_eq!(
        (after.phase, after.generation),
        (JobPhase::Running, before.generation)
    );
    eprintln!(
        "NATS restart: heartbeat back after {recovery:?}; workers kept (pids {pids_after:?}), generation {} unchanged",
        after.generation
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_nats_outage_fences_workers_and_the_job_resumes_from_its_checkpoint() {
    let (mut nats, work, bus) = start_test().await;
    let mut cfg = agent_config(&nats, "n1", 1, work.path());
    cfg.fence_after = Duration::from_secs(3);
    let _agent = start_agent(cfg);
    let _allocator = start_allocator(allocator_config(&nats, Duration::from_secs(30)));
    submit(&nats, work.path(), "fenced");
    let pids_before = worker_pids(&bus, "fenced").await;
    wait_for(Duration::from_secs(30), "progress", || async {
        last_step(&bus, "fenced").await.filter(|&s| s > 50)
    })
    .await;

    nats.stop();
    let down = Instant::now();
    // Within fence-after plus the worker's checkpoint and exit, the worker is gone.
    wait_for_exits(&pids_before, "worker stopped by the fence").await;
    let fenced_after = down.elapsed();
    let checkpoint = work
        .path()
        .join("checkpoints")
        .join("fenced")
        .join("checkpoint.json");
    let ckpt: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&checkpoint).unwrap()).unwrap();
    let saved_step = ckpt["step"].as_u64().expect("checkpoint step");

    tokio::time::sleep(Duration::from_secs(2)).await;
    nats.start_again();
    let back = Instant::now();
    let back_at = converge_bus::unix_now();
    let bus = nats.bus().await;
    // A worker runs again (in a fresh heartbeat) and resumes at the checkpoint's step.
    let (pids_after, _) = wait_for(Duration::from_secs(60), "worker back", || async {
        pids(&bus, "n1", "fenced")
            .await
            .filter(|(p, time)| !p.is_empty() && *time > back_at)
    })
    .await;
    let resumed = wait_for(
        Duration::from_secs(60),
        "progress after the outage",
        || async { last_step(&bus, "fenced").await.filter(|&s| s > saved_step) },
    )
    .await;
    let recovery = back.elapsed();
    assert_ne!(pids_after, pids_before);
    assert!(
        resumed > saved_step && resumed < saved_step + 200,
        "{saved_step} -> {resumed}"
    );
    let s = job_status(&bus, "fenced").await.unwrap();
    assert_eq!(s.phase, JobPhase::Running);
    eprintln!(
        "NATS down: workers fenced {fenced_after:?} after it went away (checkpoint at step {saved_step}); \
         {recovery:?} after it came back the job trained again from step {saved_step} (generation {})",
        s.generation
    );
}

/// A progress report published twice under one message id, as the agent's outbox retries a
/// report whose acknowledgement did not come in time: the stream stores it once and
/// acknowledges the second publish as a duplicate; another id is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_progress_report_is_stored_once() {
    init_tracing();
    let nats = NatsServer::start();
    let bus = nats.bus().await;
    let (job, host) = ("dedup".parse().unwrap(), "n1".parse().unwrap());
    let report = converge_common::ProgressReport::new(job, 1, 0, host, 10, 320, 0.7, 1.0);
    let subject = subjects::progress(&report.job, &report.host);
    let wait = Duration::from_secs(5);
    let publish = |id: &'static str| bus.publish_acked_once(subject.clone(), &report, id, wait);
    assert!(
        !publish("dedup.n1.g1.r0.s10.a")
            .await
            .expect("first publish")
    );
    assert!(
        publish("dedup.n1.g1.r0.s10.a").await.expect("retry"),
        "the retry is acknowledged as a duplicate"
    );
    assert!(!publish("dedup.n1.g1.r0.s10.b").await.expect("another id"));
    let mut stream = bus.js.get_stream(subjects::PROGRESS_STREAM).await.unwrap();
    let info = stream.info().await.unwrap();
    assert_eq!(info.state.messages, 2, "{:?}", info.state);
}

/// A worker that ignores SIGTERM on a host cut off from NATS: with a stop grace of 60 s (as
/// the systemd example ships) it would outlive the allocator's host timeout (15 s) by far,
/// and its job's next generation elsewhere would train beside it. The fence stops it with
/// the fence grace instead: gone within fence-after (2 s) + fence grace (2 s) + slack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_worker_that_ignores_sigterm_is_killed_within_the_fence_grace() {
    let (mut nats, work, bus) = start_test().await;
    let mut cfg = agent_config(&nats, "n1", 1, work.path());
    cfg.stop_grace = Duration::from_secs(60);
    cfg.fence_after = Duration::from_secs(2);
    cfg.fence_grace = Duration::from_secs(2);
    let _agent = start_agent(cfg);
    let _allocator = start_allocator(allocator_config(&nats, Duration::from_secs(30)));
    let spec = work.path().join("stubborn.toml");
    std::fs::write(
        &spec,
        r#"id = "stubborn"
command = ["/bin/sh", "-c", "trap '' TERM; while true; do sleep 0.2; done"]
min_workers = 1
max_workers = 1
"#,
    )
    .unwrap();
    nats.submit(&spec);
    let pids_before = worker_pids(&bus, "stubborn").await;
    nats.stop();
    let down = Instant::now();
    wait_for_exits(&pids_before, "the stubborn worker killed by the fence").await;
    let gone = down.elapsed();
    eprintln!("a worker ignoring SIGTERM was gone {gone:?} after NATS went away");
    assert!(
        gone < Duration::from_secs(9),
        "gone only after {gone:?}: the fence used the stop grace"
    );
}

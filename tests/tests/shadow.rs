//! A ShadowSync job (`arch = "shadow"`, S-MA) running live through the agents next to a
//! ring all-reduce job on one local cluster: a real nats-server, in-process agents and
//! allocator, the `converge` CLI and real `converge-trainer` workers. The shadow job's
//! progress reports carry its background sync rounds per second and model gap, its status
//! and `converge jobs` show them, and the ring job runs and completes as it would alone.

use converge_common::{JobPhase, JobStatus, ProgressReport, codec::decode, subjects};
use converge_tests::*;
use futures::StreamExt;
use std::time::Duration;

/// `job` as an `arch = "shadow"` job with `[shadow] algorithm = "ma"`.
fn shadow_toml(job: &TrainerJob) -> String {
    let ring = job.toml();
    assert!(ring.contains("\nmin_workers = "), "{ring}");
    format!(
        "{}[shadow]\nalgorithm = \"ma\"\n",
        ring.replacen("\nmin_workers = ", "\narch = \"shadow\"\nmin_workers = ", 1)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_job_runs_through_the_agents_next_to_a_ring_job() {
    let (nats, work, bus) = start_test().await;
    let mut progress = bus.client.subscribe(subjects::PROGRESS_ALL).await.unwrap();
    // Two hosts of two GPUs: room for both two-worker jobs at once.
    let agents = start_agents(&nats, &["n1", "n2"], 2, work.path());
    let allocator = start_allocator(allocator_config(&nats, Duration::from_secs(600)));

    // About 1,200 local steps of 10 ms per worker: 15-25 s on two busy cores.
    let shadow = TrainerJob::new("shadow-ma", 20).workers(2, 2);
    let ring = TrainerJob::new("ring", 20).workers(2, 2);
    let shadow_spec = work.path().join("shadow-ma.toml");
    std::fs::write(&shadow_spec, shadow_toml(&shadow)).unwrap();
    let ring_spec = ring.write(work.path());
    for spec in [&shadow_spec, &ring_spec] {
        nats.submit(spec);
    }

    // Both run at once, each with its two workers.
    let (sh, rg) = wait_for(
        Duration::from_secs(30),
        "both jobs running with two workers",
        || async {
            let sh = job_status(&bus, "shadow-ma").await?;
            let rg = job_status(&bus, "ring").await?;
            let running = |s: &JobStatus| s.phase == JobPhase::Running && s.world_size == 2;
            (running(&sh) && running(&rg)).then_some((sh, rg))
        },
    )
    .await;

    // Reports until both jobs completed: the shadow job's rank 0 reports sync rounds and
    // model gaps, the ring job's never do.
    let (mut shadow_reports, mut ring_reports) = (Vec::<ProgressReport>::new(), Vec::new());
    let mut seen_in_status: Option<JobStatus> = None;
    let finished = |s: &Option<JobStatus>| s.as_ref().is_some_and(|s| s.phase.is_terminal());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let (mut sh_now, mut rg_now) = (None, None);
    while !(finished(&sh_now) && finished(&rg_now)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "jobs did not finish within 90 s: {sh_now:?} {rg_now:?}"
        );
        if let Ok(Some(msg)) =
            tokio::time::timeout(Duration::from_millis(500), progress.next()).await
        {
            let r: ProgressReport = decode(&msg.payload).unwrap();
            match r.job.as_str() {
                "shadow-ma" => shadow_reports.push(r),
                "ring" => ring_reports.push(r),
                other => panic!("a report of an unknown job {other}"),
            }
        }
        sh_now = job_status(&bus, "shadow-ma").await;
        rg_now = job_status(&bus, "ring").await;
        if let Some(s) = &sh_now
            && s.sync_rounds_per_s.is_some_and(|r| r > 0.0)
            && seen_in_status.is_none()
        {
            seen_in_status = Some(s.clone());
        }
    }
    let (sh_end, rg_end) = (sh_now.unwrap(), rg_now.unwrap());

    // The shadow job completed in its first generation, its rank 0 synchronizing in the
    // background all along.
    assert_eq!(sh_end.phase, JobPhase::Completed, "{sh_end:?}");
    assert_eq!(sh_end.generation, sh.generation, "the shadow job restarted");
    let rank0: Vec<&ProgressReport> = shadow_reports.iter().filter(|r| r.rank == 0).collect();
    assert!(rank0.len() >= 5, "{} rank-0 reports", rank0.len());
    let synced: Vec<&&ProgressReport> = rank0
        .iter()
        .filter(|r| r.line.sync_rounds_per_s.is_some_and(|x| x > 0.0))
        .collect();
    assert!(
        synced.len() * 2 >= rank0.len(),
        "most rank-0 reports carry sync rounds: {} of {}",
        synced.len(),
        rank0.len()
    );
    assert!(
        synced.iter().all(|r| r
            .line
            .model_gap
            .is_some_and(|g| g.is_finite() && (0.0..=2.0).contains(&g))),
        "{synced:?}"
    );
    assert!(
        rank0.iter().all(|r| r.line.sync_s.is_none_or(|s| s == 0.0)),
        "a shadow step never waits on the network"
    );
    let (first, last) = (rank0[0], rank0[rank0.len() - 1]);
    assert!(
        last.line.loss < 0.8 * first.line.loss,
        "the shadow job's loss did not fall: {} -> {}",
        first.line.loss,
        last.line.loss
    );
    // Its status showed the figures while it ran (and keeps the last ones).
    let shown = seen_in_status.expect("the shadow job's status showed its sync rounds");
    assert!(shown.model_gap.is_some_and(f64::is_finite), "{shown:?}");
    assert!(sh_end.sync_rounds_per_s.is_some(), "{sh_end:?}");

    // The ring job: completed in its first generation, no shadow figures anywhere.
    assert_eq!(rg_end.phase, JobPhase::Completed, "{rg_end:?}");
    assert_eq!(rg_end.generation, rg.generation, "the ring job restarted");
    assert!(!ring_reports.is_empty());
    assert!(
        ring_reports
            .iter()
            .all(|r| r.line.sync_rounds_per_s.is_none() && r.line.model_gap.is_none()),
        "a ring job reports no shadow figures"
    );
    assert_eq!((rg_end.sync_rounds_per_s, rg_end.model_gap), (None, None));
    let ring0: Vec<&ProgressReport> = ring_reports.iter().filter(|r| r.rank == 0).collect();
    assert!(
        ring0.last().unwrap().line.loss < 0.8 * ring0[0].line.loss,
        "the ring job's loss did not fall"
    );

    // `converge jobs` shows the shadow job's figures, not the ring job's.
    let out = converge(&nats, &["jobs", "--all"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("sync "), "{text}");
    let out = converge(&nats, &["--json", "jobs", "--all"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let status_of = |id: &str| {
        listed
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["spec"]["id"] == id)
            .map(|j| j["status"].clone())
            .unwrap()
    };
    assert!(status_of("shadow-ma")["sync_rounds_per_s"].is_number());
    assert!(status_of("ring").get("sync_rounds_per_s").is_none());

    for a in agents {
        a.stop().await;
    }
    allocator.stop().await;
}

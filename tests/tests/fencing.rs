//! Compare-and-set writes against a real nats-server (`Bus::put_expecting`, which the
//! allocator uses for every plan and job status): a replaced leader's late write, based on
//! the revision it read before the new leader wrote, is refused and leaves the new leader's
//! value in place.

use converge_bus::BusError;
use converge_common::{HostId, HostPlan, PROTOCOL_VERSION};
use converge_tests::*;

fn plan() -> HostPlan {
    HostPlan {
        protocol: PROTOCOL_VERSION,
        host: HostId::new("n1").unwrap(),
        workers: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_leaders_late_write_does_not_stick() {
    init_tracing();
    let nats = NatsServer::start();
    let old_leader = nats.bus().await;
    let new_leader = nats.bus().await;

    // Both read the key absent; the old leader creates it.
    let first = old_leader
        .put_expecting(&old_leader.plans, "n1", &plan(), None)
        .await
        .expect("created");
    // A second create on an existing key conflicts.
    let again = new_leader
        .put_expecting(&new_leader.plans, "n1", &plan(), None)
        .await;
    assert!(
        matches!(again, Err(BusError::Conflict { expected: None, .. })),
        "{again:?}"
    );

    // Both have read revision `first`. The new leader writes on it...
    let second = new_leader
        .put_expecting(&new_leader.plans, "n1", &plan(), Some(first))
        .await
        .expect("the new leader's write");
    assert!(second > first);
    // ... and the old leader's late write on the same revision is refused.
    let late = old_leader
        .put_expecting(&old_leader.plans, "n1", &plan(), Some(first))
        .await;
    match late {
        Err(e @ BusError::Conflict { .. }) => {
            assert!(
                e.to_string().contains("changed since revision Some("),
                "{e}"
            );
        }
        other => panic!("the late write went through: {other:?}"),
    }
    let (_, revision) = new_leader
        .get::<HostPlan>(&new_leader.plans, "n1")
        .await
        .unwrap()
        .expect("stored");
    assert_eq!(revision, second, "the new leader's write stays");
    // Writing on the revision it now reads works again.
    old_leader
        .put_expecting(&old_leader.plans, "n1", &plan(), Some(second))
        .await
        .expect("a write on the current revision");
}

/// A server, a one-GPU agent `n1`, the allocator (metrics recorded in this process) and
/// `job`, a long converge-trainer job, submitted with `converge submit`.
async fn one_host_with_a_long_job(
    job: &str,
) -> (
    NatsServer,
    tempfile::TempDir,
    converge_bus::Bus,
    Running,
    Running,
) {
    init_tracing();
    converge_bus::metrics::recorder();
    let (nats, work, bus) = start_test().await;
    let agent = start_agent(agent_config(&nats, "n1", 1, work.path()));
    let allocator = start_allocator(allocator_config(&nats, std::time::Duration::from_secs(30)));
    std::fs::write(
        work.path().join(format!("{job}.toml")),
        fast_job(job, 100_000),
    )
    .unwrap();
    nats.submit(&work.path().join(format!("{job}.toml")));
    (nats, work, bus, agent, allocator)
}

/// A replaced leader's late write to a key the leader has not written since it took over
/// passes compare-and-set (the revision is still the one both read): here a stale plan
/// that stops a running job's worker, written on the plan's current revision as such a
/// leader would. The leader sees on its watch of the plans that it did not write it,
/// re-reads, and writes its own plan over it: the job's worker of the same generation
/// runs, the job stays running in that generation, and the write is counted. Before
/// (2026-11-28), the leader's view still said the host held its plan, so it never wrote
/// it again: the stale plan stuck, and the worker stayed stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_write_to_a_key_the_leader_has_not_written_since_is_written_over() {
    use converge_common::{HostTelemetry, JobPhase};
    use std::time::Duration;
    let (_nats, _work, bus, agent, allocator) = one_host_with_a_long_job("long").await;
    let running = |t: &HostTelemetry| {
        t.workers
            .iter()
            .find(|w| w.job.as_str() == "long" && w.pid.is_some())
            .map(|w| (w.generation, w.pid))
    };
    let (generation, pid) = wait_for(Duration::from_secs(30), "long's worker", || async {
        let (t, _) = bus.get::<HostTelemetry>(&bus.hosts, "n1").await.ok()??;
        running(&t)
    })
    .await;
    let counted_before = metric_sum("converge_allocator_foreign_writes_total{");

    let (placed, revision) = bus
        .get::<HostPlan>(&bus.plans, "n1")
        .await
        .unwrap()
        .expect("n1's plan");
    assert_eq!(placed.workers.len(), 1, "{placed:?}");
    bus.put_expecting(&bus.plans, "n1", &plan(), Some(revision))
        .await
        .expect("the stale write passes compare-and-set");

    // The leader writes its plan over the stale one, and the same generation's worker
    // runs: the one the stale plan stopped, started again, or the same process when the
    // leader was faster than the agent.
    let stale_at = std::time::Instant::now();
    wait_for(
        Duration::from_secs(20),
        "the leader's plan back",
        || async {
            let (stored, rev) = bus.get::<HostPlan>(&bus.plans, "n1").await.ok()??;
            (rev > revision + 1 && stored == placed).then_some(())
        },
    )
    .await;
    let restored_in = stale_at.elapsed();
    let running_again = wait_for(Duration::from_secs(20), "the worker running", || async {
        let (t, _) = bus.get::<HostTelemetry>(&bus.hosts, "n1").await.ok()??;
        running(&t)
    })
    .await;
    assert_eq!(running_again.0, generation, "the same generation");
    println!(
        "stale plan written over in {restored_in:?}; worker pid {:?} (before: {pid:?})",
        running_again.1
    );
    let status = job_status(&bus, "long").await.expect("long's status");
    assert_eq!(status.phase, JobPhase::Running, "{status:?}");
    assert_eq!(status.generation, generation, "{status:?}");
    assert!(metric_sum("converge_allocator_foreign_writes_total{") >= counted_before + 1.0);
    allocator.stop().await;
    agent.stop().await;
}

/// A value that does not decode, written under a running job's status key while the leader
/// runs (another writer's, or a corrupted one): the leader sees the newer entry, re-reads
/// (recording the key's revision although its value is unusable) and writes a status over
/// it; the job runs on, and no write conflict repeats. Before (2026-11-28) the re-read left
/// the key without a revision, every write of its status was a refused create, and the
/// leader re-read and retried at every step without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_status_is_written_over_once() {
    use converge_common::JobPhase;
    use std::time::Duration;
    let (_nats, _work, bus, agent, allocator) = one_host_with_a_long_job("steady").await;
    let running = wait_for_status(&bus, "steady", 30, "running", |s| {
        s.phase == JobPhase::Running
    })
    .await;

    bus.status
        .put("steady", "{\"protocol\":1, not json".into())
        .await
        .unwrap();
    let again = wait_for_status(&bus, "steady", 20, "a status written over it", |s| {
        s.phase == JobPhase::Running
    })
    .await;
    assert_eq!(again.generation, running.generation, "{again:?}");
    // No loop: the status keeps being written in place, without conflicts.
    let conflicts = metric_sum("converge_allocator_write_conflicts_total{");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        metric_sum("converge_allocator_write_conflicts_total{"),
        conflicts,
        "write conflicts repeat"
    );
    assert!(job_status(&bus, "steady").await.is_some());
    allocator.stop().await;
    agent.stop().await;
}

//! Two allocator replicas against one real nats-server: the leader lease lets only one
//! schedule; when the leader dies (its task aborted, no hand-back, like `kill -9`) the other
//! takes over within the documented time and the running job is not restarted; a clean stop
//! hands the lease back.

use converge_common::{JobPhase, LeaderLease, codec::decode, subjects};
use converge_tests::*;
use std::time::{Duration, Instant};

/// The lease's holder, `None` when there is no lease.
async fn holder(bus: &converge_bus::Bus) -> Option<String> {
    let store = bus.js.get_key_value(subjects::BUCKET_LEADER).await.ok()?;
    let entry = store.entry(subjects::LEADER_KEY).await.ok()??;
    if entry.operation != async_nats::jetstream::kv::Operation::Put {
        return None;
    }
    decode::<LeaderLease>(&entry.value).ok().map(|l| l.holder)
}

fn config(nats: &NatsServer, replica: &str) -> converge_allocator::service::AllocatorConfig {
    let mut cfg = allocator_config(nats, Duration::from_secs(30));
    cfg.replica_id = replica.into();
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_allocator_takes_over_without_restarting_jobs() {
    let (nats, work, bus) = start_test().await;
    let _agents = start_agents(&nats, &["n1", "n2"], 1, work.path());
    let first = start_allocator(config(&nats, "alloc-a"));
    wait_for(Duration::from_secs(10), "alloc-a leads", || async {
        (holder(&bus).await.as_deref() == Some("alloc-a")).then_some(())
    })
    .await;
    let second = start_allocator(config(&nats, "alloc-b"));

    nats.submit(
        &TrainerJob::new("opt", 1000)
            .workers(2, 2)
            .write(work.path()),
    );
    let running = wait_for_status(&bus, "opt", 30, "job running", |s| {
        s.phase == JobPhase::Running && s.world_size == 2
    })
    .await;
    // The standby has not taken the lease while the leader renews it (several TTLs).
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(holder(&bus).await.as_deref(), Some("alloc-a"));

    // The leader dies without handing back.
    let killed = Instant::now();
    first.abort();
    wait_for(Duration::from_secs(15), "alloc-b leads", || async {
        (holder(&bus).await.as_deref() == Some("alloc-b")).then_some(())
    })
    .await;
    let handover = killed.elapsed();
    let ttl = config(&nats, "x").lease_ttl;
    eprintln!("handover after the leader died: {handover:?} (lease {ttl:?})");
    assert!(
        handover <= ttl * 4 / 3 + Duration::from_secs(2),
        "{handover:?}"
    );

    // The new leader re-reads what the old one wrote and leaves the job alone.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = job_status(&bus, "opt").await.unwrap();
    assert_eq!(after.phase, JobPhase::Running);
    assert_eq!(after.generation, running.generation, "{after:?}");
    assert_eq!(after.placement, running.placement);
    // It does decide: a cancel is carried out.
    succeeded(&converge(&nats, &["cancel", "opt"]));
    wait_for_phase(&bus, "opt", JobPhase::Cancelled, 15).await;

    // A clean stop hands the lease back at once.
    second.stop().await;
    assert_eq!(holder(&bus).await, None);
}

/// A leader that stopped between writing a new generation's plan and its status: the next
/// leader continues from a generation past the planned one, with plans and status agreeing,
/// and never issues the planned number again nor goes back to an older one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_planned_without_its_status_is_not_issued_again() {
    let (nats, work, bus) = start_test().await;
    let _agent = start_agent(agent_config(&nats, "n1", 1, work.path()));
    let first = start_allocator(config(&nats, "alloc-a"));
    nats.submit(&TrainerJob::new("opt", 1000).write(work.path()));
    let running = wait_for_status(&bus, "opt", 30, "job running", |s| {
        s.phase == JobPhase::Running && s.world_size == 1
    })
    .await;
    first.abort();

    // What the crashed leader left: n1's plan already at the next generation, the status not.
    let (mut plan, _) = bus
        .get::<converge_common::HostPlan>(&bus.plans, "n1")
        .await
        .unwrap()
        .expect("n1's plan");
    let planned = running.generation + 1;
    for w in plan.workers.iter_mut().filter(|w| w.job.as_str() == "opt") {
        w.generation = planned;
    }
    bus.put(&bus.plans, "n1", &plan).await.unwrap();

    let second = start_allocator(config(&nats, "alloc-b"));
    let (status, plan_generations) = wait_for(
        Duration::from_secs(30),
        "status and plan at one new generation",
        || async {
            let s = job_status(&bus, "opt").await?;
            let (p, _) = bus
                .get::<converge_common::HostPlan>(&bus.plans, "n1")
                .await
                .ok()??;
            let gens: Vec<u64> = p
                .workers
                .iter()
                .filter(|w| w.job.as_str() == "opt")
                .map(|w| w.generation)
                .collect();
            (s.generation != running.generation
                && !gens.is_empty()
                && gens.iter().all(|&g| g == s.generation))
            .then_some((s, gens))
        },
    )
    .await;
    assert!(
        status.generation > planned,
        "generation {} after {planned} was planned: {plan_generations:?}",
        status.generation
    );
    assert_eq!(
        status.placement, running.placement,
        "the placement is unchanged"
    );
    second.stop().await;
}

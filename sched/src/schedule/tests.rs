use super::observe::{ring_nic_traffic, step_times};
use super::ps::colocated_shards;
use super::*;
use crate::contention::JobCost;
use crate::ps_plan::{PsHost, PsJob};
use converge_common::{
    ChangeCause, EndReason, GpuSample, MAX_ALLOCATION_CHANGES, RankPlacement, SyncArch,
    WorkerAssignment, WorkerPhase, WorkerState,
};
use std::collections::BTreeSet;

fn job(id: &str, min: u32, max: u32, submitted_at: f64) -> JobSpec {
    let mut spec = JobSpec::from_toml(&format!(
        "id = \"{id}\"\ncommand = [\"train\"]\nmin_workers = {min}\nmax_workers = {max}\n"
    ))
    .unwrap();
    spec.submitted_at = submitted_at;
    spec
}

fn host(id: &str, gpus: u32, time: f64, workers: Vec<WorkerState>) -> HostTelemetry {
    HostTelemetry {
        agent_version: "test".into(),
        gpus: (0..gpus)
            .map(|index| GpuSample::idle(index, format!("GPU-{id}-{index}"), "fake", 1))
            .collect(),
        workers,
        ..HostTelemetry::new(
            HostId::new(id).unwrap(),
            format!("10.0.0.{}", id.len()),
            time,
        )
    }
}

/// A progress report of `job`'s `rank` on `host` (no optional fields).
#[allow(clippy::too_many_arguments)]
fn progress(
    job: &str,
    generation: u64,
    rank: u32,
    host: &str,
    step: u64,
    samples: u64,
    loss: f64,
    time: f64,
) -> converge_common::ProgressReport {
    let (job, host) = (JobId::new(job).unwrap(), HostId::new(host).unwrap());
    converge_common::ProgressReport::new(job, generation, rank, host, step, samples, loss, time)
}

fn worker(job: &str, generation: u64, rank: u32, phase: WorkerPhase) -> WorkerState {
    WorkerState {
        job: JobId::new(job).unwrap(),
        generation,
        rank,
        phase,
        pid: Some(100 + rank),
        restarts: 0,
        last_exit_code: None,
        gpus: vec![rank],
    }
}

/// The cluster state a test drives through steps.
type World = State;

impl State {
    fn add_host(&mut self, t: HostTelemetry) {
        self.hosts.insert(t.host.clone(), t);
    }
    fn status(&self, id: &str) -> &JobStatus {
        &self.statuses[&JobId::new(id).unwrap()]
    }
}

#[test]
fn a_job_is_placed_runs_and_completes() {
    let mut w = World::default();
    w.specs
        .insert(JobId::new("a").unwrap(), job("a", 2, 2, 1.0));
    w.add_host(host("h1", 1, 10.0, vec![]));
    w.add_host(host("h2", 1, 10.0, vec![]));
    let out = w.step(10.0, true);
    let s = w.status("a");
    // Nothing of an older generation runs, so the job starts in the same step.
    assert_eq!(
        (s.phase, s.generation, s.world_size),
        (JobPhase::Running, 1, 2)
    );
    let plan1 = &out.plans[&HostId::new("h1").unwrap()];
    let plan2 = &out.plans[&HostId::new("h2").unwrap()];
    assert_eq!((plan1.workers.len(), plan2.workers.len()), (1, 1));
    let rank0_host = &s.placement[0].host;
    let master = &out.plans[rank0_host].workers[0].master_addr;
    assert!(
        out.plans
            .values()
            .all(|p| &p.workers[0].master_addr == master)
    );
    assert_eq!(plan1.workers[0].master_port, s.master_port.unwrap());
    // torchrun's node rank: 0 on rank 0's host, 1 on the other.
    assert_eq!(out.plans[rank0_host].workers[0].node_rank, Some(0));
    assert!(
        out.plans
            .values()
            .all(|p| p.workers[0].node_rank == Some(u32::from(p.workers[0].rank != 0)))
    );
    // The status keeps the change and why, for the dashboard's timeline.
    let started = &s.allocations[..];
    assert_eq!(started.len(), 1, "{started:?}");
    assert_eq!(
        (
            started[0].cause,
            started[0].generation,
            started[0].from_workers
        ),
        (ChangeCause::Started, 1, 0)
    );
    assert_eq!((started[0].workers, started[0].hosts), (2, 2));
    assert!(started[0].reason.contains("quality policy"), "{started:?}");

    // Rank 0 exits 0: the job completes and leaves every plan.
    let h = rank0_host.clone();
    w.add_host(host(
        h.as_str(),
        1,
        11.0,
        vec![worker("a", 1, 0, WorkerPhase::Succeeded)],
    ));
    let other = if h.as_str() == "h1" { "h2" } else { "h1" };
    w.add_host(host(
        other,
        1,
        11.0,
        vec![worker("a", 1, 1, WorkerPhase::Running)],
    ));
    let out = w.step(11.0, false);
    assert_eq!(w.status("a").phase, JobPhase::Completed);
    assert!(out.plans.values().all(|p| p.workers.is_empty()));
    assert!(out.events.iter().any(|e| matches!(
        e.kind,
        EventKind::JobFinished {
            phase: JobPhase::Completed,
            ..
        }
    )));
}

#[test]
fn a_new_address_of_rank_0s_host_restarts_the_job() {
    let mut w = World::default();
    w.specs
        .insert(JobId::new("a").unwrap(), job("a", 1, 1, 1.0));
    w.add_host(host("h1", 1, 10.0, vec![]));
    let out = w.step(10.0, true);
    let s = w.status("a").clone();
    assert_eq!(s.master_addr.as_deref(), Some("10.0.0.2"));
    assert_eq!(
        out.plans[&HostId::new("h1").unwrap()].workers[0].master_addr,
        "10.0.0.2"
    );
    // Same address: nothing changes.
    w.add_host(host(
        "h1",
        1,
        11.0,
        vec![worker("a", 1, 0, WorkerPhase::Running)],
    ));
    w.step(11.0, true);
    assert_eq!(w.status("a").generation, s.generation);
    // The agent comes back under another address.
    let mut t = host("h1", 1, 12.0, vec![worker("a", 1, 0, WorkerPhase::Running)]);
    t.addr = "10.0.0.99".into();
    w.add_host(t);
    let out = w.step(12.0, false);
    let moved = w.status("a");
    assert_eq!(moved.generation, s.generation + 1);
    assert_eq!(moved.phase, JobPhase::Restarting);
    assert_eq!(moved.master_addr.as_deref(), Some("10.0.0.99"));
    assert_ne!(moved.master_port, s.master_port);
    assert!(out.events.iter().any(|e| e.message.contains("10.0.0.99")));
    let last = moved.allocations.last().unwrap();
    assert_eq!(
        (last.cause, last.generation),
        (ChangeCause::Address, moved.generation)
    );
    assert_eq!(moved.allocations.len(), 2);
}

#[test]
fn a_lost_host_and_the_cap_show_in_the_allocation_history() {
    let mut w = World::default();
    w.specs
        .insert(JobId::new("a").unwrap(), job("a", 1, 1, 1.0));
    w.add_host(host("h1", 1, 10.0, vec![]));
    w.add_host(host("h2", 1, 10.0, vec![]));
    w.step(10.0, true);
    let first = w.status("a").placement[0].host.clone();
    let other = if first.as_str() == "h1" { "h2" } else { "h1" };
    // The job's host goes silent past the host timeout; the other one stays live.
    w.add_host(host(other, 1, 40.0, vec![]));
    w.step(40.0, true);
    let s = w.status("a");
    assert_eq!(s.placement[0].host.as_str(), other);
    // Taken off the lost host (generation 1 ends), then placed again (generation 2).
    let causes: Vec<_> = s
        .allocations
        .iter()
        .map(|c| (c.cause, c.generation, c.workers))
        .collect();
    assert_eq!(
        causes,
        [
            (ChangeCause::Started, 1, 1),
            (ChangeCause::HostLost, 1, 0),
            (ChangeCause::Started, 2, 1)
        ]
    );
    let lost = &s.allocations[1];
    assert!(lost.reason.contains(first.as_str()), "{}", lost.reason);

    let mut s = s.clone();
    for g in 0..(MAX_ALLOCATION_CHANGES as u64 + 5) {
        s.generation = 100 + g;
        s.record_allocation(50.0, 1, ChangeCause::Moved, "moved".into());
    }
    assert_eq!(s.allocations.len(), MAX_ALLOCATION_CHANGES);
    assert_eq!(
        s.allocations.last().unwrap().generation,
        100 + MAX_ALLOCATION_CHANGES as u64 + 4
    );
}

#[test]
fn refits_beyond_the_budget_wait_for_a_later_step() {
    let mut w = World::default();
    w.settings.fit_budget = 1;
    let loss = |k: u64| 2.0 / (1.0 + k as f64 / 300.0) + 0.2;
    for id in ["a", "b"] {
        w.specs.insert(JobId::new(id).unwrap(), job(id, 1, 1, 1.0));
        let h = w.histories.entry(JobId::new(id).unwrap()).or_default();
        for i in 1..=30u64 {
            h.add(&progress(id, 1, 0, "h1", i, i * 10, loss(i * 10), i as f64));
        }
    }
    w.add_host(host("h1", 2, 10.0, vec![]));
    w.step(10.0, false);
    // One fit per step: "a" (first by id among equals) now, "b" at the next step.
    assert!(w.status("a").curve.is_some());
    assert!(w.status("b").curve.is_none());
    w.step(10.5, false);
    assert!(w.status("b").curve.is_some());
    let id = JobId::new("a").unwrap();
    assert_eq!(w.cache.refit_pending(&id, &w.histories[&id]), None);
}

#[test]
fn a_failure_beside_a_lost_host_reschedules_instead_of_failing() {
    let mut w = World::default();
    w.specs
        .insert(JobId::new("a").unwrap(), job("a", 2, 2, 1.0));
    w.add_host(host("h1", 1, 10.0, vec![]));
    w.add_host(host("h2", 1, 10.0, vec![]));
    w.step(10.0, true);
    let s = w.status("a").clone();
    assert_eq!(s.world_size, 2);
    // h2 goes silent; h1's rank fails because its ring peer vanished.
    let on_h1 = s
        .placement
        .iter()
        .find(|p| p.host.as_str() == "h1")
        .unwrap();
    w.add_host(host(
        "h1",
        1,
        30.0,
        vec![worker("a", 1, on_h1.rank, WorkerPhase::Failed)],
    ));
    w.step(30.0, false);
    let s = w.status("a");
    assert_eq!(s.phase, JobPhase::Pending, "{s:?}");
    assert!(s.message.as_deref().unwrap_or("").contains("h2"));
}

#[test]
fn a_host_cannot_finish_ranks_placed_elsewhere() {
    let mut w = World::default();
    w.specs
        .insert(JobId::new("a").unwrap(), job("a", 1, 1, 1.0));
    w.add_host(host("h1", 1, 10.0, vec![]));
    w.add_host(host("h2", 0, 10.0, vec![]));
    w.step(10.0, true);
    assert_eq!(w.status("a").placement[0].host.as_str(), "h1");
    // h2 runs nothing of the job but claims its rank 0 succeeded, then failed.
    for phase in [WorkerPhase::Succeeded, WorkerPhase::Failed] {
        w.add_host(host("h2", 0, 11.0, vec![worker("a", 1, 0, phase)]));
        w.add_host(host(
            "h1",
            1,
            11.0,
            vec![worker("a", 1, 0, WorkerPhase::Running)],
        ));
        w.step(11.0, false);
        assert_eq!(w.status("a").phase, JobPhase::Running, "{phase:?}");
    }
    // The host the rank is placed on is believed.
    w.add_host(host(
        "h1",
        1,
        12.0,
        vec![worker("a", 1, 0, WorkerPhase::Succeeded)],
    ));
    w.step(12.0, false);
    assert_eq!(w.status("a").phase, JobPhase::Completed);
}

/// Step time of a PS job's status under the planner's model (default model size and
/// compute, default link speed on every host).
fn ps_step_time(s: &JobStatus, hosts: &[&str]) -> f64 {
    let count = |list: &[RankPlacement], h: &str| {
        list.iter().filter(|r| r.host.as_str() == h).count() as u32
    };
    let ps_hosts: Vec<PsHost> = hosts
        .iter()
        .map(|_| PsHost::new(8, 8, 2.0 * DEFAULT_LINK_BYTES_PER_S))
        .collect();
    let workers: Vec<u32> = hosts.iter().map(|h| count(&s.placement, h)).collect();
    let shards: Vec<u32> = hosts.iter().map(|h| count(&s.ps_placement, h)).collect();
    let job = PsJob::new(
        DEFAULT_PS_MODEL_BYTES,
        JobCost::default().compute_s,
        s.world_size..=s.world_size,
        1..=s.world_size,
    );
    crate::ps_plan::step_time_s(&ps_hosts, &job, &workers, &shards)
}

#[test]
fn parameter_server_jobs_get_planned_shards() {
    for max_ps in [None, Some(1), Some(2)] {
        let mut w = World::default();
        let mut spec = job("ps", 3, 3, 1.0);
        spec.arch = SyncArch::Ps;
        spec.max_ps = max_ps;
        w.specs.insert(JobId::new("ps").unwrap(), spec);
        w.add_host(host("h1", 2, 10.0, vec![]));
        w.add_host(host("h2", 2, 10.0, vec![]));
        let out = w.step(10.0, true);
        let s = w.status("ps").clone();
        converge_common::codec::Message::validate(&s).unwrap();
        assert_eq!((s.phase, s.world_size), (JobPhase::Running, 3));
        let shards = s.ps_placement.len();
        assert!(
            shards >= 1 && shards <= max_ps.unwrap_or(3) as usize,
            "{max_ps:?}"
        );
        let all: Vec<&WorkerAssignment> = out.plans.values().flat_map(|p| &p.workers).collect();
        assert_eq!(all.len(), 3 + shards, "{max_ps:?}");
        for a in &all {
            assert_eq!((a.world_size, a.num_ps), (3 + shards as u32, shards as u32));
        }
        // The shards in the plans are the status's, ranks after the workers, no GPUs.
        for shard in &s.ps_placement {
            let a = out.plans[&shard.host]
                .workers
                .iter()
                .find(|a| a.rank == shard.rank)
                .unwrap();
            assert!(a.gpus.is_empty());
        }
        for p in out.plans.values() {
            converge_common::codec::Message::validate(p).unwrap();
        }
        // The plan is at least as fast as co-locating a shard with each worker host
        // (the fallback) under the planner's own model.
        let mut colocated = s.clone();
        colocated.ps_placement = colocated_shards(3, &s.placement, &w.specs[&s.job]);
        assert!(
            ps_step_time(&s, &["h1", "h2"]) <= ps_step_time(&colocated, &["h1", "h2"]) + 1e-9,
            "{max_ps:?}: {:?}",
            s.ps_placement
        );
        // Nothing new: nothing moves.
        w.step(11.0, true);
        assert_eq!(w.status("ps"), &s);
    }
}

#[test]
fn parameter_server_shards_stay_with_workers_on_one_host_and_fall_back_without_slots() {
    // Two workers fit on h1: the planner keeps every byte on h1 (shards there too).
    let mut w = World::default();
    let mut spec = job("ps", 2, 2, 1.0);
    spec.arch = SyncArch::Ps;
    w.specs.insert(JobId::new("ps").unwrap(), spec.clone());
    w.add_host(host("h1", 2, 10.0, vec![]));
    w.add_host(host("h2", 2, 10.0, vec![]));
    w.step(10.0, true);
    let s = w.status("ps");
    let worker_hosts: BTreeSet<&HostId> = s.placement.iter().map(|r| &r.host).collect();
    assert_eq!(worker_hosts.len(), 1);
    assert!(!s.ps_placement.is_empty());
    assert!(
        s.ps_placement
            .iter()
            .all(|r| worker_hosts.contains(&r.host))
    );

    // No shard slot anywhere: no plan, one shard per worker host (co-location).
    let mut w = World::default();
    w.settings.ps_shards_per_host = 0;
    let mut spec = job("ps", 3, 3, 1.0);
    spec.arch = SyncArch::Ps;
    w.specs.insert(JobId::new("ps").unwrap(), spec);
    w.add_host(host("h1", 2, 10.0, vec![]));
    w.add_host(host("h2", 2, 10.0, vec![]));
    w.step(10.0, true);
    let s = w.status("ps");
    let shard_hosts: Vec<&str> = s.ps_placement.iter().map(|r| r.host.as_str()).collect();
    assert_eq!(shard_hosts, ["h1", "h2"]);
}

#[test]
fn a_lost_shard_host_sends_the_job_back_to_pending() {
    let mut w = World::default();
    let mut a = job("a", 2, 2, 1.0);
    a.arch = SyncArch::Ps;
    w.specs.insert(JobId::new("a").unwrap(), a);
    w.add_host(host("h1", 2, 10.0, vec![]));
    w.add_host(host("h3", 0, 10.0, vec![]));
    w.step(10.0, true);
    // The job runs on h1 with its shard moved to h3, which holds none of its workers.
    let id = JobId::new("a").unwrap();
    let s = w.statuses.get_mut(&id).unwrap();
    assert_eq!((s.phase, s.world_size), (JobPhase::Running, 2));
    s.ps_placement = vec![RankPlacement {
        rank: 2,
        host: HostId::new("h3").unwrap(),
        gpus: vec![],
    }];
    w.hosts.remove(&HostId::new("h3").unwrap());
    let out = w.step(11.0, false);
    let s = w.status("a");
    assert_eq!((s.phase, s.world_size), (JobPhase::Pending, 0));
    assert!(s.placement.is_empty() && s.ps_placement.is_empty());
    assert!(out.events.iter().any(|e| matches!(
        &e.kind,
        EventKind::HostLost { host } if host.as_str() == "h3"
    )));
}

#[test]
fn a_resize_waits_for_the_old_generation_to_exit() {
    let mut w = World::default();
    // Free restarts, so that growing from 1 to 2 workers pays off.
    w.settings.policy_params.restart_cost_s = 0.0;
    w.settings.policy = Arc::new(Quality {
        params: w.settings.policy_params,
    });
    w.specs
        .insert(JobId::new("a").unwrap(), job("a", 1, 2, 1.0));
    w.add_host(host("h1", 1, 10.0, vec![]));
    w.step(10.0, true);
    assert_eq!(w.status("a").world_size, 1);
    // A second host joins while generation 1 runs on h1.
    w.add_host(host(
        "h1",
        1,
        20.0,
        vec![worker("a", 1, 0, WorkerPhase::Running)],
    ));
    w.add_host(host("h2", 1, 20.0, vec![]));
    let out = w.step(20.0, true);
    let s = w.status("a");
    assert_eq!(
        (s.phase, s.generation, s.world_size),
        (JobPhase::Restarting, 2, 2)
    );
    assert!(
        out.plans.values().all(|p| p.workers.is_empty()),
        "old generation must stop first"
    );
    // Still stopping: no change.
    w.add_host(host(
        "h1",
        1,
        21.0,
        vec![worker("a", 1, 0, WorkerPhase::Stopping)],
    ));
    w.step(21.0, false);
    assert_eq!(w.status("a").phase, JobPhase::Restarting);
    // Gone: the new generation is planned on both hosts.
    w.add_host(host("h1", 1, 22.0, vec![]));
    let out = w.step(22.0, false);
    assert_eq!(w.status("a").phase, JobPhase::Running);
    let planned: usize = out.plans.values().map(|p| p.workers.len()).sum();
    assert_eq!(planned, 2);
    assert!(
        out.plans
            .values()
            .flat_map(|p| &p.workers)
            .all(|x| x.generation == 2)
    );
}

#[test]
fn failures_lost_hosts_cancellations_and_refused_specs() {
    let mut w = World::default();
    for id in ["crash", "lost", "gone"] {
        w.specs.insert(JobId::new(id).unwrap(), job(id, 1, 1, 1.0));
    }
    w.refused
        .insert(JobId::new("bad").unwrap(), "`command` is empty".into());
    w.add_host(host("h1", 2, 10.0, vec![]));
    w.add_host(host("h2", 1, 10.0, vec![]));
    w.step(10.0, true);
    assert_eq!(w.status("bad").phase, JobPhase::Failed);
    assert!(
        w.status("bad")
            .message
            .as_ref()
            .unwrap()
            .contains("command")
    );
    let on = |id: &str, w: &World| w.status(id).placement[0].host.to_string();
    let crash_host = on("crash", &w);
    let lost_host = on("lost", &w);

    // The crashing job's worker failed for good; the other job's host stops reporting.
    let mut failed = worker("crash", 1, 0, WorkerPhase::Failed);
    failed.last_exit_code = Some(3);
    failed.restarts = 3;
    for h in ["h1", "h2"] {
        let t = if h == lost_host { 10.0 } else { 40.0 };
        let ws = if h == crash_host {
            vec![failed.clone()]
        } else {
            vec![]
        };
        w.add_host(host(h, if h == "h1" { 2 } else { 1 }, t, ws));
    }
    let mut spec = job("gone", 1, 1, 1.0);
    spec.cancelled = true;
    w.specs.insert(JobId::new("gone").unwrap(), spec);
    w.step(40.0, true);
    let crash = w.status("crash");
    assert_eq!(crash.phase, JobPhase::Failed);
    assert!(
        crash.message.as_ref().unwrap().contains("exit code 3"),
        "{crash:?}"
    );
    assert_eq!(w.status("gone").phase, JobPhase::Cancelled);
    let lost = w.status("lost");
    // First-fit put "crash" and "gone" on h1 and "lost" on h2; "lost" is placed again on
    // the live host, in a new generation.
    assert_ne!(lost_host, crash_host);
    assert!(
        lost.placement.iter().all(|p| p.host.as_str() != lost_host),
        "{lost:?}"
    );
    assert_eq!((lost.generation, lost.world_size), (2, 1));
    // Finished jobs keep their status on later steps.
    let before = w.statuses.clone();
    w.step(41.0, true);
    for id in ["crash", "gone", "bad"] {
        assert_eq!(w.status(id), &before[&JobId::new(id).unwrap()]);
    }
}

#[test]
fn statuses_show_observed_and_predicted_step_times() {
    let id = JobId::new("s").unwrap();
    // 32 samples per worker per step: 64 per step with 2 workers, 128 with 4.
    let report = |generation: u64, rank: u32, host: &str, step: u64, time: f64| {
        let per_step = if generation == 1 { 64 } else { 128 };
        progress(
            id.as_str(),
            generation,
            rank,
            host,
            step,
            step * per_step,
            1.0,
            time,
        )
    };
    let mut h = JobHistory::default();
    // Generation 1: 2 ranks on h1, 0.1 s per step.
    h.add(&report(1, 0, "h1", 0, 0.0));
    h.add(&report(1, 1, "h1", 0, 0.0));
    h.add(&report(1, 0, "h1", 100, 10.0));
    let mut status = new_status(&id, 0.0, 0.0);
    status.generation = 1;
    status.world_size = 2;
    let prior = ThroughputPrior::default();
    let mut cache = FitCache::new();
    // Only one generation: observed, nothing to predict from.
    let (observed, predicted) = step_times(&status, &h.step_observations(), &mut cache, &prior);
    assert!((observed.unwrap() - 0.1).abs() < 1e-12);
    assert_eq!(predicted, None);
    // Generation 2: 4 ranks on h1 and h2, 0.2 s per step.
    for (rank, host) in [(0, "h1"), (1, "h1"), (2, "h2"), (3, "h2")] {
        h.add(&report(2, rank, host, 100, 20.0));
    }
    h.add(&report(2, 0, "h1", 150, 30.0));
    status.generation = 2;
    status.world_size = 4;
    status.placement = ["h1", "h1", "h2", "h2"]
        .iter()
        .enumerate()
        .map(|(rank, host)| RankPlacement {
            rank: rank as u32,
            host: HostId::new(*host).unwrap(),
            gpus: vec![rank as u32 % 2],
        })
        .collect();
    let (observed, predicted) = step_times(&status, &h.step_observations(), &mut cache, &prior);
    assert!((observed.unwrap() - 0.2).abs() < 1e-12);
    // Predicted from generation 1 alone: slower than 2 ranks on one host (the prior's
    // sync terms), finite.
    let predicted = predicted.unwrap();
    assert!(predicted.is_finite() && predicted > 0.1, "{predicted}");
}

#[test]
fn batch_jobs_adapt_with_statistics_and_keep_their_reference_without() {
    let mut w = World::default();
    let batch =
        "[batch]\nreference = 32\nmax_total = 1024\nmin_per_worker = 8\nmax_per_worker = 128\n";
    for (id, table) in [("ad", batch), ("fx", batch), ("plain", "")] {
        let mut spec = JobSpec::from_toml(&format!(
            "id = \"{id}\"\ncommand = [\"train\"]\nmin_workers = 1\nmax_workers = 2\n{table}"
        ))
        .unwrap();
        spec.submitted_at = 1.0;
        w.specs.insert(spec.id.clone(), spec);
    }
    w.add_host(host("h1", 6, 10.0, vec![]));
    let out = w.step(10.0, true);
    // First generation: no statistics yet, so every `[batch]` job runs the smallest total
    // its world size allows (32, or 8 per worker above 4 workers), the plan carries it.
    for id in ["ad", "fx"] {
        let s = w.status(id);
        let b = s.batch.as_ref().unwrap();
        assert!(!b.adaptive, "{id}");
        let plan = b.plan.unwrap();
        assert_eq!((plan.total, plan.reference), (32, 32), "{id}");
        plan.check(s.world_size).unwrap();
        for a in out.plans[&HostId::new("h1").unwrap()]
            .workers
            .iter()
            .filter(|a| a.job.as_str() == id)
        {
            assert_eq!(a.batch, Some(plan));
        }
    }
    assert_eq!(w.status("plain").batch, None);
    assert!(
        out.plans[&HostId::new("h1").unwrap()]
            .workers
            .iter()
            .filter(|a| a.job.as_str() == "plain")
            .all(|a| a.batch.is_none())
    );
    // Generation 1 runs: "ad" reports statistics with a large noise scale (10⁵
    // samples), "fx" only bad ones.
    for id in ["ad", "fx"] {
        let generation = w.status(id).generation;
        let workers = w.status(id).world_size;
        let mut h = JobHistory::default();
        for i in 0..20u64 {
            let mut r = progress(
                id,
                generation,
                0,
                "h1",
                i * 10,
                i * 320,
                1.0 / (1.0 + i as f64),
                10.0 + i as f64,
            );
            r.workers = Some(workers);
            r.hosts = Some(1);
            if id == "ad" {
                (r.line.grad_sqr, r.line.grad_var) = (Some(1e-3), Some(100.0));
            } else {
                (r.line.grad_sqr, r.line.grad_var) = (Some(f64::NAN), Some(-1.0));
            }
            h.add(&r);
        }
        w.histories.insert(JobId::new(id).unwrap(), h);
    }
    w.add_host(host("h1", 6, 31.0, vec![]));
    w.step(31.0, false);
    let ad = w.status("ad").batch.clone().unwrap();
    assert!(ad.adaptive);
    assert!((ad.noise_scale.unwrap() - 1e5).abs() < 1.0, "{ad:?}");
    assert_eq!(ad.gradient_reports, 20);
    // The batch does not change without a new generation.
    assert_eq!(ad.plan.unwrap().total, 32);
    let fx = w.status("fx").batch.clone().unwrap();
    assert!(!fx.adaptive);
    assert_eq!((fx.ignored_gradient_stats, fx.gradient_reports), (20, 0));
    // The next decision restarts "ad" once, on its placement, with a goodput batch.
    let (gen_ad, gen_fx) = (w.status("ad").generation, w.status("fx").generation);
    w.add_host(host("h1", 6, 32.0, vec![]));
    let out = w.step(32.0, true);
    let s = w.status("ad");
    assert_eq!(s.generation, gen_ad + 1);
    let b = s.batch.as_ref().unwrap();
    assert!(
        b.planned_with_statistics && b.plan.unwrap().total > 32,
        "{b:?}"
    );
    assert!(
        out.events
            .iter()
            .any(|e| e.message.contains("with its first gradient statistics")),
        "{:?}",
        out.events
    );
    assert_eq!(w.status("fx").generation, gen_fx, "fx has no statistics");
    // Once is enough: the next decision keeps it.
    w.add_host(host("h1", 6, 33.0, vec![]));
    w.step(33.0, true);
    assert_eq!(w.status("ad").generation, gen_ad + 1);
    // h1 is lost, h2 (8 GPUs) appears: every job is placed again as a new generation.
    w.add_host(host("h2", 8, 100.0, vec![]));
    w.step(100.0, true);
    let s = w.status("ad");
    assert!(s.world_size > 0 && s.placement.iter().all(|p| p.host.as_str() == "h2"));
    let plan = s.batch.as_ref().unwrap().plan.unwrap();
    plan.check(s.world_size).unwrap();
    // Almost no efficiency lost to larger batches: the goodput plan is above the
    // reference, within the limits.
    assert!(
        plan.total > 32 && plan.total <= 1024 && plan.per_worker <= 128,
        "{plan:?}"
    );
    let eff = s.batch.as_ref().unwrap().efficiency.unwrap();
    assert!(eff > 0.9 && eff <= 1.0, "{eff}");
    let s = w.status("fx");
    let plan = s.batch.as_ref().unwrap().plan.unwrap();
    assert_eq!(
        plan.total,
        32.max(8 * s.world_size),
        "fx keeps its reference"
    );
    assert_eq!(w.status("plain").batch, None);
}

#[test]
fn reaching_the_target_loss_completes_the_job() {
    let mut w = World::default();
    let mut spec = job("t", 1, 1, 1.0);
    spec.target_loss = Some(0.4);
    let id = JobId::new("t").unwrap();
    w.specs.insert(id.clone(), spec);
    w.add_host(host("h1", 1, 10.0, vec![]));
    w.step(10.0, true);
    let report = |samples: u64, loss: f64| {
        progress(
            "t",
            1,
            0,
            "h1",
            samples / 32,
            samples,
            loss,
            10.0 + samples as f64 / 1000.0,
        )
    };
    let history = w.histories.entry(id.clone()).or_default();
    history.add(&report(320, 0.7));
    history.add(&report(640, 0.5));
    w.step(11.0, false);
    assert_eq!(w.status("t").phase, JobPhase::Running);
    assert_eq!(w.status("t").first_loss, Some(0.7));
    assert_eq!(
        w.status("t").epoch_samples,
        None,
        "no report carried an epoch"
    );
    let mut first_below = report(960, 0.39);
    first_below.line.epoch = Some(3.0);
    w.histories.get_mut(&id).unwrap().add(&first_below);
    w.step(12.0, false);
    // One report below the target is not enough: the mean of the latest reports
    // (0.7, 0.5, 0.39: 0.53) is still above it.
    assert_eq!(w.status("t").phase, JobPhase::Running);
    for (k, loss) in [(4u64, 0.38), (5, 0.37), (6, 0.36), (7, 0.35)] {
        let mut r = report(320 * k, loss);
        r.line.epoch = Some(k as f64);
        w.histories.get_mut(&id).unwrap().add(&r);
    }
    let out = w.step(13.0, false);
    let s = w.status("t");
    assert_eq!(s.phase, JobPhase::Completed, "{s:?}");
    assert_eq!(s.epoch_samples, Some(320.0), "320 samples an epoch");
    assert!(
        s.message.as_ref().unwrap().contains("target loss 0.4"),
        "{s:?}"
    );
    // The latest five reports average 0.37.
    assert!(s.message.as_ref().unwrap().contains("0.3700"), "{s:?}");
    assert_eq!((s.samples, s.loss), (2240, Some(0.35)));
    assert!(out.plans.values().all(|p| p.workers.is_empty()));
}

#[test]
fn stop_criteria_end_jobs_with_their_reason() {
    // Plateau: a curve that flattens ends the job as converged, with its end figures.
    let mut w = World::default();
    let mut spec = job("p", 1, 1, 1.0);
    spec.stop = Some(converge_common::StopSpec {
        plateau: Some(converge_common::PlateauSpec {
            min_improvement: 0.01,
            window_epochs: 2.0,
        }),
        ..Default::default()
    });
    let id = JobId::new("p").unwrap();
    w.specs.insert(id.clone(), spec);
    w.add_host(host("h1", 1, 10.0, vec![]));
    w.step(10.0, true);
    let mut ended_at = None;
    for i in 1..=60u64 {
        let samples = i * 320;
        let mut r = progress(
            "p",
            1,
            0,
            "h1",
            i * 10,
            samples,
            1.0 / (1.0 + samples as f64 / 500.0) + 0.2,
            10.0 + i as f64,
        );
        // 1,000 samples per epoch.
        r.line.epoch = Some(samples as f64 / 1000.0);
        w.histories.entry(id.clone()).or_default().add(&r);
        w.add_host(host("h1", 1, 10.0 + i as f64, vec![]));
        w.step(10.0 + i as f64, false);
        if w.status("p").phase.is_terminal() {
            ended_at = Some(i);
            break;
        }
    }
    let s = w.status("p");
    assert_eq!(s.phase, JobPhase::Completed, "{s:?}");
    assert!(ended_at.unwrap() > 7, "not before two epochs have run");
    let end = s.end.as_ref().unwrap();
    assert_eq!(end.reason, EndReason::Converged);
    assert!(end.loss.is_some() && end.gpu_hours > 0.0, "{end:?}");
    let predicted = end.predicted_loss.unwrap();
    assert!((predicted - 0.2).abs() < 0.05, "{predicted}");
    assert!(s.message.as_ref().unwrap().contains("converged"));

    // Deadline: ends a job even while it waits for GPUs (no host here).
    let mut w = World::default();
    let mut spec = job("d", 1, 1, 1.0);
    spec.stop = Some(converge_common::StopSpec {
        deadline_s: Some(30.0),
        ..Default::default()
    });
    w.specs.insert(JobId::new("d").unwrap(), spec);
    w.step(20.0, true);
    assert_eq!(w.status("d").phase, JobPhase::Pending);
    w.step(31.0, true);
    let s = w.status("d");
    assert_eq!(s.phase, JobPhase::Completed);
    assert_eq!(s.end.as_ref().unwrap().reason, EndReason::Deadline);

    // A target at or above the first loss is refused once that loss is known.
    let mut w = World::default();
    let mut spec = job("t", 1, 1, 1.0);
    spec.target_loss = Some(0.9);
    let id = JobId::new("t").unwrap();
    w.specs.insert(id.clone(), spec);
    w.add_host(host("h1", 1, 10.0, vec![]));
    w.step(10.0, true);
    w.histories
        .entry(id)
        .or_default()
        .add(&progress("t", 1, 0, "h1", 10, 320, 0.8, 11.0));
    w.step(11.0, false);
    let s = w.status("t");
    assert_eq!(s.phase, JobPhase::Failed);
    assert!(
        s.message
            .as_ref()
            .unwrap()
            .contains("not below the job's first loss")
    );
    assert!(s.end.is_none());
}

/// The policy and placement pairs the host-restriction tests run under.
const RESTRICTED_CASES: [(&str, PlacementKind); 5] = [
    ("quality", PlacementKind::FirstFit),
    ("quality", PlacementKind::Bco),
    ("pollux", PlacementKind::FirstFit),
    ("fifo", PlacementKind::Bco),
    ("fair", PlacementKind::FirstFit),
];

/// An empty world scheduling with `policy` and `placement`.
fn world_with(policy: &str, placement: PlacementKind) -> World {
    let mut w = world_with_policy(policy);
    w.settings.placement = placement;
    w
}

/// An empty world scheduling with `policy` and the default placement.
fn world_with_policy(policy: &str) -> World {
    let mut w = World::default();
    w.settings.policy =
        Arc::from(crate::policies::by_name(policy, w.settings.policy_params).unwrap());
    w
}

/// The status of job `id` running on `hosts` (rank `r` on GPU `r` of `hosts[r]`) at
/// `step_s` seconds per step.
fn running_on(id: &str, hosts: &[&str], step_s: f64) -> (JobId, JobStatus) {
    let job = JobId::new(id).unwrap();
    let mut s = new_status(&job, 0.0, 0.0);
    s.phase = JobPhase::Running;
    s.placement = hosts
        .iter()
        .enumerate()
        .map(|(rank, h)| RankPlacement {
            rank: rank as u32,
            host: HostId::new(*h).unwrap(),
            gpus: vec![rank as u32],
        })
        .collect();
    s.world_size = hosts.len() as u32;
    s.step_time_s = Some(step_s);
    (job, s)
}

/// The hosts of a job's placement.
fn hosts_of(s: &JobStatus) -> BTreeSet<String> {
    s.placement.iter().map(|p| p.host.to_string()).collect()
}

/// Asserts that job `id` of `w` runs, on `host` alone; `what` names the case.
fn assert_runs_only_on(w: &World, id: &str, host: &str, what: &str) {
    let s = w.status(id);
    assert!(s.world_size >= 1, "{what}: {s:?}");
    assert_eq!(hosts_of(s), BTreeSet::from([host.to_string()]), "{what}");
}

/// Asserts that job `id` of `w` waits with no workers and returns its status; `what`
/// names the case.
fn assert_waits<'a>(w: &'a World, id: &str, what: &str) -> &'a JobStatus {
    let s = w.status(id);
    assert_eq!((s.phase, s.world_size), (JobPhase::Pending, 0), "{what}");
    s
}

#[test]
fn selector_jobs_run_only_on_matching_hosts_or_wait_with_the_reason() {
    let labelled = |id: &str, gpus: u32, time: f64, zone: &str| {
        let mut t = host(id, gpus, time, vec![]);
        t.labels.insert("zone".into(), zone.into());
        t.labels.insert("gpu.count".into(), gpus.to_string());
        t
    };
    for (policy, placement) in RESTRICTED_CASES {
        let what = format!("{policy} with {placement:?}");
        let mut w = world_with(policy, placement);
        w.add_host(labelled("h1", 4, 10.0, "a"));
        w.add_host(labelled("h2", 4, 10.0, "b"));
        let mut picky = job("picky", 1, 8, 1.0);
        picky.selector.insert("zone".into(), "b".into());
        let mut waiting = job("waiting", 1, 2, 2.0);
        waiting.selector.insert("zone".into(), "c".into());
        waiting.selector.insert("gpu.count".into(), "2".into());
        for spec in [picky, waiting, job("free", 1, 2, 3.0)] {
            w.specs.insert(spec.id.clone(), spec);
        }
        w.step(10.0, true);
        let picky = w.status("picky");
        assert!(picky.world_size <= 4, "{what}: {picky:?}");
        assert_runs_only_on(&w, "picky", "h2", &what);
        assert_eq!(
            assert_waits(&w, "waiting", &what).message.as_deref(),
            Some("no live host matches selector gpu.count=2,zone=c"),
            "{what}"
        );
        assert!(w.status("free").world_size >= 1, "{what}");

        // A matching host appears: the waiting job goes there, and the reason goes.
        w.add_host(labelled("h3", 2, 11.0, "c"));
        w.step(11.0, true);
        assert_runs_only_on(&w, "waiting", "h3", &what);
        assert_eq!(w.status("waiting").message, None, "{what}");
        assert_runs_only_on(&w, "picky", "h2", &what);

        // Its host is relabelled: the running job is taken off it and waits again.
        w.add_host(labelled("h3", 2, 12.0, "d"));
        w.step(12.0, true);
        let waiting = assert_waits(&w, "waiting", &what);
        assert!(
            waiting
                .message
                .as_deref()
                .unwrap()
                .starts_with("no live host matches"),
            "{what}: {waiting:?}"
        );
    }
}

#[test]
fn each_generations_step_times_count_for_its_hosts_gpu_type() {
    let typed = |id: &str, kind: &str| {
        let mut t = host(id, 2, 10.0, vec![]);
        t.labels.insert("gpu.type".into(), kind.into());
        t
    };
    let live_hosts = [
        typed("t4-1", "t4"),
        typed("a100-1", "a100"),
        typed("a100-2", "a100"),
    ];
    let live: BTreeMap<&HostId, &HostTelemetry> = live_hosts.iter().map(|t| (&t.host, t)).collect();
    // One worker, 32 samples per step: 1 s per step on t4 (generation 1), 0.25 s on
    // a100 (generation 2); generation 3 spans t4 and a100 and counts for neither.
    let mut h = JobHistory::default();
    // Steps and samples go on from one generation to the next (a resume from the last
    // checkpoint).
    for (generation, host, step_s, t0) in [(1, "t4-1", 1.0, 0.0), (2, "a100-1", 0.25, 100.0)] {
        let base = 40 * (generation - 1);
        for i in 0..5u64 {
            let time = t0 + step_s * 10.0 * i as f64;
            let step = base + 10 * i;
            h.add(&progress(
                "j",
                generation,
                0,
                host,
                step,
                32 * step,
                1.0,
                time,
            ));
        }
    }
    for (rank, host) in [(0, "t4-1"), (1, "a100-2")] {
        for i in 0..5u64 {
            let time = 200.0 + 5.0 * i as f64;
            let step = 80 + 10 * i;
            h.add(&progress(
                "j",
                3,
                rank,
                host,
                step,
                2560 + 640 * i,
                1.0,
                time,
            ));
        }
    }
    let seen = h.step_observations();
    assert_eq!(seen.len(), 3, "{seen:?}");
    let mut cache = FitCache::new();
    let prior = crate::throughput::ThroughputPrior::default();
    let id = JobId::new("j").unwrap();
    let speeds: BTreeMap<String, f64> = observations_by_type(&h, &seen, &live)
        .iter()
        .filter_map(|(t, on_type)| {
            let model = cache.model_on_type(&id, t, on_type, &prior);
            Some((t.clone(), crate::gpu_types::speed(&model, 32.0)?))
        })
        .collect();
    assert_eq!(
        speeds.keys().collect::<Vec<_>>(),
        ["a100", "t4"],
        "{speeds:?}"
    );
    // Compute-only single-worker steps: the speeds are 32 samples per step time.
    let ratio = speeds["a100"] / speeds["t4"];
    assert!((ratio - 4.0).abs() < 0.4, "{speeds:?}");

    // Only the t4 host still live: generation 3 counts for t4 now (its live hosts carry
    // one type), generation 2 for none.
    let one: BTreeMap<&HostId, &HostTelemetry> =
        live_hosts[..1].iter().map(|t| (&t.host, t)).collect();
    let by_type = observations_by_type(&h, &seen, &one);
    assert_eq!(by_type.keys().collect::<Vec<_>>(), ["t4"]);
    assert_eq!(by_type["t4"].len(), 2);
}

#[test]
fn gpu_type_jobs_run_only_on_their_types_or_wait_with_the_reason() {
    let typed = |id: &str, gpus: u32, time: f64, kind: &str| {
        let mut t = host(id, gpus, time, vec![]);
        t.labels.insert("gpu.type".into(), kind.into());
        t
    };
    for (policy, placement) in RESTRICTED_CASES {
        let what = format!("{policy} with {placement:?}");
        let mut w = world_with(policy, placement);
        w.add_host(typed("t4-1", 4, 10.0, "t4"));
        w.add_host(typed("a100-1", 4, 10.0, "a100"));
        let mut fast = job("fast", 1, 8, 1.0);
        fast.gpu_types = Some(vec!["a100".into(), "h100".into()]);
        let mut newest = job("newest", 1, 2, 2.0);
        newest.gpu_types = Some(vec!["h100".into()]);
        for spec in [fast, newest, job("any", 1, 2, 3.0)] {
            w.specs.insert(spec.id.clone(), spec);
        }
        w.step(10.0, true);
        assert_runs_only_on(&w, "fast", "a100-1", &what);
        assert_eq!(
            assert_waits(&w, "newest", &what).message.as_deref(),
            Some("no live host offers GPU type h100 (live hosts' types: a100, t4)"),
            "{what}"
        );
        assert!(w.status("any").world_size >= 1, "{what}");

        // An H100 host joins: the waiting job goes there and the reason goes.
        w.add_host(typed("h100-1", 2, 11.0, "h100"));
        w.step(11.0, true);
        assert_runs_only_on(&w, "newest", "h100-1", &what);
        assert_eq!(w.status("newest").message, None, "{what}");
        assert!(
            hosts_of(w.status("fast")).iter().all(|h| h != "t4-1"),
            "{what}: never on a T4"
        );
    }
}

#[test]
fn selector_parameter_server_jobs_keep_workers_and_shards_on_matching_hosts() {
    let mut w = World::default();
    for (id, zone) in [("h1", "a"), ("h2", "b"), ("h3", "b")] {
        let mut t = host(id, 2, 10.0, vec![]);
        t.labels.insert("zone".into(), zone.into());
        w.add_host(t);
    }
    let mut spec = JobSpec::from_toml(
        "id = \"ps\"\ncommand = [\"t\"]\narch = \"ps\"\nmin_workers = 2\nmax_workers = 4\n[selector]\nzone = \"b\"\n",
    )
    .unwrap();
    spec.submitted_at = 1.0;
    w.specs.insert(spec.id.clone(), spec);
    w.step(10.0, true);
    let s = w.status("ps");
    assert!(s.world_size >= 2, "{s:?}");
    assert!(
        s.placement
            .iter()
            .chain(&s.ps_placement)
            .all(|p| p.host.as_str() != "h1"),
        "{s:?}"
    );
}

#[test]
fn the_service_runs_any_policy() {
    let mut w = world_with_policy("fair");
    w.specs
        .insert(JobId::new("a").unwrap(), job("a", 1, 4, 1.0));
    w.specs
        .insert(JobId::new("b").unwrap(), job("b", 1, 4, 2.0));
    w.add_host(host("h1", 4, 10.0, vec![]));
    w.step(10.0, true);
    assert_eq!((w.status("a").world_size, w.status("b").world_size), (2, 2));
}

#[test]
fn tiresias_in_the_service_sees_attained_service_and_requested_sizes() {
    let mut w = world_with_policy("tiresias");
    // `veteran` arrived first but has had 17 GPU-hours (2 workers, 8.5 h apart reports);
    // `fresh` has had none. One host of 2 GPUs: least attained service goes first.
    let mut veteran = job("veteran", 1, 2, 1.0);
    veteran.workers = Some(2);
    let mut fresh = job("fresh", 1, 4, 2.0);
    fresh.workers = Some(2);
    w.specs.insert(JobId::new("veteran").unwrap(), veteran);
    w.specs.insert(JobId::new("fresh").unwrap(), fresh);
    let mut h = JobHistory::default();
    for (samples, time) in [(100, 0.0), (200, 8.5 * 3600.0)] {
        let mut r = progress("veteran", 1, 0, "h1", samples / 10, samples, 1.0, time);
        r.workers = Some(2);
        h.add(&r);
    }
    assert_eq!(h.attained_gpu_seconds(1), 17.0 * 3600.0);
    w.histories.insert(JobId::new("veteran").unwrap(), h);
    w.add_host(host("h1", 2, 40_000.0, vec![]));
    w.step(40_000.0, true);
    // `fresh` runs at the 2 workers it asked for (not its maximum of 4), `veteran` waits.
    assert_eq!(w.status("fresh").world_size, 2);
    assert_eq!(w.status("veteran").world_size, 0);
}

#[test]
fn own_multi_host_rings_are_taken_off_the_measured_nic_load() {
    let ring = running_on;
    let statuses: BTreeMap<JobId, JobStatus> = [
        // 4 ranks on h1 and h2, 10 MB every 0.2 s: 1.5 · 10 MB / 0.2 s = 75 MB/s each.
        ring("a", &["h1", "h1", "h2", "h2"], 0.2),
        // 2 ranks on h2 and h3, 10 MB every 0.1 s: 100 MB/s.
        ring("b", &["h2", "h3"], 0.1),
        // One host: no NIC traffic.
        ring("c", &["h4", "h4"], 0.1),
        // No model size reported yet: not counted.
        ring("d", &["h4", "h5"], 0.1),
    ]
    .into_iter()
    .collect();
    let specs: BTreeMap<JobId, JobSpec> = ["a", "b", "c", "d"]
        .iter()
        .map(|id| (JobId::new(*id).unwrap(), job(id, 1, 4, 0.0)))
        .collect();
    let mut histories: BTreeMap<JobId, JobHistory> = BTreeMap::new();
    for id in ["a", "b", "c"] {
        let mut r = progress(id, 1, 0, "h1", 10, 100, 1.0, 1.0);
        r.line.model_bytes = Some(10_000_000);
        histories
            .entry(JobId::new(id).unwrap())
            .or_default()
            .add(&r);
    }
    let traffic = ring_nic_traffic(&statuses, &specs, &histories);
    let at = |h: &str| traffic.get(&HostId::new(h).unwrap()).copied();
    assert!((at("h1").unwrap() - 75e6).abs() < 1.0, "{traffic:?}");
    assert!((at("h2").unwrap() - 175e6).abs() < 1.0, "{traffic:?}");
    assert!((at("h3").unwrap() - 100e6).abs() < 1.0, "{traffic:?}");
    assert_eq!((at("h4"), at("h5")), (None, None));
    // A parameter-server job's traffic stays in the measured load.
    let mut ps = specs.clone();
    ps.get_mut(&JobId::new("b").unwrap()).unwrap().arch = SyncArch::Ps;
    let traffic = ring_nic_traffic(&statuses, &ps, &histories);
    assert_eq!(traffic.get(&HostId::new("h3").unwrap()), None);
}

#[test]
fn contention_is_measured_on_multi_host_jobs_that_share_a_host() {
    let running = |id: &str, hosts: &[&str], observed: f64, predicted: f64| {
        let (job, mut s) = running_on(id, hosts, observed);
        s.generation = 2;
        s.predicted_step_time_s = Some(predicted);
        (job, s)
    };
    let none = BTreeMap::new();
    // Two rings share h2, each twice as slow as predicted: slowdown 1 per shared job.
    let mut statuses: BTreeMap<JobId, JobStatus> = [
        running("a", &["h1", "h2"], 2.0, 1.0),
        running("b", &["h2", "h3"], 0.6, 0.3),
    ]
    .into_iter()
    .collect();
    assert!((measured_contention(&statuses, &none) - 1.0).abs() < 1e-12);
    // A single-host job and a ring alone on its hosts add nothing.
    statuses.extend([
        running("c", &["h4", "h4"], 9.0, 1.0),
        running("d", &["h5", "h6"], 9.0, 1.0),
    ]);
    assert!((measured_contention(&statuses, &none) - 1.0).abs() < 1e-12);
    // Faster than predicted counts against the mean; the mean never goes below 0.
    let (id, faster) = running("e", &["h1", "h3"], 0.5, 1.0);
    statuses.insert(id, faster);
    // h1: a, e; h2: a, b; h3: b, e → sharing 2 each: (1 + 1 − 0.5) / 3.
    assert!((measured_contention(&statuses, &none) - 0.5).abs() < 1e-12);
    let calm: BTreeMap<JobId, JobStatus> = [
        running("a", &["h1", "h2"], 0.5, 1.0),
        running("b", &["h2", "h3"], 0.5, 1.0),
    ]
    .into_iter()
    .collect();
    assert_eq!(measured_contention(&calm, &none), 0.0);
    assert_eq!(measured_contention(&BTreeMap::new(), &none), 0.0);
}

/// A shadow job's step time excludes synchronization: a shadow job sharing hosts with
/// a slowed ring neither adds its own (unslowed) step as a sample nor counts as a
/// sharer.
#[test]
fn shadow_jobs_are_left_out_of_measured_contention() {
    let running = |id: &str, hosts: &[&str], observed: f64, predicted: f64| {
        let (job, mut s) = running_on(id, hosts, observed);
        s.predicted_step_time_s = Some(predicted);
        (job, s)
    };
    let statuses: BTreeMap<JobId, JobStatus> = [
        running("a", &["h1", "h2"], 2.0, 1.0),
        running("b", &["h2", "h3"], 2.0, 1.0),
        running("s", &["h1", "h3"], 0.1, 0.1),
    ]
    .into_iter()
    .collect();
    let mut specs: BTreeMap<JobId, JobSpec> = ["a", "b", "s"]
        .into_iter()
        .map(|id| (JobId::new(id).unwrap(), job(id, 1, 2, 0.0)))
        .collect();
    // As ring jobs: s's unslowed step pulls the mean down to (1 + 1 + 0) / 3.
    assert!((measured_contention(&statuses, &specs) - 2.0 / 3.0).abs() < 1e-12);
    let s = specs.get_mut(&JobId::new("s").unwrap()).unwrap();
    s.arch = SyncArch::Shadow;
    s.shadow = Some(converge_common::ShadowSpec {
        algorithm: converge_common::ShadowAlgorithm::Ma,
        block_momentum: None,
        block_lr: None,
        block_nesterov: false,
        elastic_alpha: None,
        hogwild_threads: None,
    });
    assert!((measured_contention(&statuses, &specs) - 1.0).abs() < 1e-12);
}

#[test]
fn bco_placement_puts_a_job_that_fits_on_one_host_there() {
    // `small` (2 GPUs) goes first on h1; `wide` (2 workers × 2 GPUs) then fits on h2
    // alone. First fit fills h1's 2 free GPUs first and spans both hosts; BCO does not.
    for (placement, spanned) in [(PlacementKind::FirstFit, 2), (PlacementKind::Bco, 1)] {
        let mut w = world_with("fifo", placement);
        let mut small = job("small", 1, 1, 1.0);
        small.gpus_per_worker = 2;
        let mut wide = job("wide", 2, 2, 2.0);
        wide.gpus_per_worker = 2;
        w.specs.insert(JobId::new("small").unwrap(), small);
        w.specs.insert(JobId::new("wide").unwrap(), wide);
        w.add_host(host("h1", 4, 10.0, vec![]));
        w.add_host(host("h2", 4, 10.0, vec![]));
        w.step(10.0, true);
        let s = w.status("wide");
        assert_eq!(s.world_size, 2, "{placement:?}");
        let hosts: BTreeSet<_> = s.placement.iter().map(|r| &r.host).collect();
        assert_eq!(hosts.len(), spanned, "{placement:?}: {:?}", s.placement);
    }
}

#[test]
fn bco_keeps_a_spanning_ring_off_hosts_whose_nics_the_agents_report_busy() {
    // Four hosts of 2 GPUs on 1 Gbit/s links; `wide` (2 workers × 2 GPUs) must span two
    // of them. The agents on h1 and h2 report their NICs 90 % busy with traffic
    // Converge did not schedule: BCO puts the ring on h3 and h4, first fit on h1 and h2
    // (id order). With quiet NICs BCO has no reason to leave h1 and h2.
    let busy_nic = |rate: f64| converge_common::NicSample {
        name: "eth0".into(),
        rx_bytes_per_s: rate,
        tx_bytes_per_s: rate,
        link_speed_bps: Some(1_000_000_000),
    };
    let hosts_of_wide = |placement: PlacementKind, busy: f64| {
        let mut w = world_with("fifo", placement);
        let mut wide = job("wide", 2, 2, 1.0);
        wide.gpus_per_worker = 2;
        w.specs.insert(JobId::new("wide").unwrap(), wide);
        for h in ["h1", "h2", "h3", "h4"] {
            let mut t = host(h, 2, 10.0, vec![]);
            let load = if h == "h1" || h == "h2" { busy } else { 0.0 };
            t.nics = vec![busy_nic(load)];
            w.add_host(t);
        }
        w.step(10.0, true);
        let s = w.status("wide");
        assert_eq!(s.world_size, 2, "{placement:?}");
        s.placement
            .iter()
            .map(|r| r.host.to_string())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>()
    };
    let ninety_percent = 0.9 * 125e6;
    assert_eq!(
        hosts_of_wide(PlacementKind::Bco, ninety_percent),
        ["h3", "h4"]
    );
    assert_eq!(
        hosts_of_wide(PlacementKind::FirstFit, ninety_percent),
        ["h1", "h2"]
    );
    assert_eq!(hosts_of_wide(PlacementKind::Bco, 0.0), ["h1", "h2"]);
}

#[test]
fn stepping_twice_without_news_changes_nothing() {
    let mut w = World::default();
    w.specs
        .insert(JobId::new("a").unwrap(), job("a", 1, 4, 1.0));
    w.specs
        .insert(JobId::new("b").unwrap(), job("b", 1, 4, 2.0));
    w.add_host(host("h1", 4, 10.0, vec![]));
    let first = w.step(10.0, true);
    let statuses = w.statuses.clone();
    let second = w.step(10.5, true);
    assert_eq!(w.statuses, statuses);
    assert_eq!(first.plans, second.plans);
    let used: usize = second
        .plans
        .values()
        .flat_map(|p| &p.workers)
        .map(|x| x.gpus.len())
        .sum();
    assert!(used <= 4);
}

mod equal_inputs {
    use super::*;
    use proptest::prelude::*;

    /// A cluster of 1–3 hosts and 1–5 jobs, each job with 0–40 rank-0 reports of a
    /// noisy decreasing loss over two generations, stepped three times.
    fn arbitrary_world() -> impl Strategy<Value = (World, Vec<f64>)> {
        (
            prop::collection::vec(1u32..=4, 1..=3),
            prop::collection::vec((1u32..=2, 0u32..=3, 0usize..=40, 0.0..0.2f64), 1..=5),
            any::<bool>(),
        )
            .prop_map(|(hosts, jobs, bco)| {
                let mut w = World::default();
                if bco {
                    w.settings.placement = PlacementKind::Bco;
                }
                for (i, gpus) in hosts.iter().enumerate() {
                    w.add_host(host(&format!("h{i}"), *gpus, 100.0, vec![]));
                }
                for (j, (min, extra, points, noise)) in jobs.into_iter().enumerate() {
                    let name = format!("j{j}");
                    let id = JobId::new(&name).unwrap();
                    w.specs
                        .insert(id.clone(), job(&name, min, min + extra, j as f64));
                    let mut h = JobHistory::default();
                    for k in 0..points {
                        let generation = if k < points / 2 { 1 } else { 2 };
                        let samples = (k as u64 + 1) * 64;
                        let wiggle = if k % 2 == 0 { noise } else { -noise };
                        let loss = 2.0 / (1.0 + samples as f64 / 500.0) + 0.1 + wiggle * 0.1;
                        let time = 10.0 + k as f64;
                        h.add(&progress(
                            &name,
                            generation,
                            0,
                            "h0",
                            k as u64 * 2,
                            samples,
                            loss,
                            time,
                        ));
                    }
                    w.histories.insert(id, h);
                }
                (w, vec![60.0, 61.0, 90.0])
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// The cache is part of a step's input and output: equal inputs with equal caches
        /// give equal outcomes and leave equal caches, step after step.
        #[test]
        fn equal_inputs_and_caches_give_equal_outcomes((world, times) in arbitrary_world()) {
            let mut a = world;
            let mut b = a.clone();
            for now in times {
                let first = a.step(now, true);
                let second = b.step(now, true);
                prop_assert_eq!(first, second);
                prop_assert_eq!(&a.cache, &b.cache);
            }
            // And a cache cloned mid-way gives the same next step as the original.
            let mut c = b.cache.clone();
            fn inputs(w: &World) -> Inputs<'_> {
                Inputs {
                    now: 120.0,
                    specs: &w.specs,
                    refused_specs: &w.refused,
                    statuses: &w.statuses,
                    hosts: &w.hosts,
                    histories: &w.histories,
                    queues: &w.queues,
                    queue_statuses: &w.queue_statuses,
                }
            }
            let out_c = step(inputs(&b), &b.settings, &mut c, true);
            let mut cache_a = a.cache.clone();
            let out_a = step(inputs(&a), &a.settings, &mut cache_a, true);
            prop_assert_eq!(out_a, out_c);
        }
    }
}

/// Three trials of one sweep on three hosts, the default early stopping, 40 reports each
/// of a loss that levels off at `floors`; held-out losses 10 % above the training loss when
/// `eval`, and `work` samples declared. Returns the world and the samples at which trial 3
/// was stopped.
fn sweep_of_three(eval: bool, work: Option<u64>) -> (World, Option<u64>) {
    let mut w = World::default();
    let floors = [0.10, 0.12, 0.60];
    for (i, _) in floors.iter().enumerate() {
        let id = format!("sw-{}", i + 1);
        let mut spec = job(&id, 1, 1, 1.0);
        spec.sweep = Some(JobId::new("sw").unwrap());
        spec.early_stop = Some(converge_common::EarlyStopSpec::default());
        spec.work_samples = work;
        w.specs.insert(JobId::new(&id).unwrap(), spec);
        w.add_host(host(&format!("h{}", i + 1), 1, 10.0, vec![]));
    }
    w.step(10.0, true);
    let mut stopped_at = None;
    for i in 1..=40u64 {
        let samples = i * 100;
        let now = 10.0 + i as f64;
        for (k, floor) in floors.iter().enumerate() {
            let id = format!("sw-{}", k + 1);
            if w.status(&id).phase.is_terminal() {
                continue;
            }
            let host_id = w.status(&id).placement[0].host.to_string();
            let mut r = progress(
                &id,
                1,
                0,
                &host_id,
                i,
                samples,
                1.0 / (1.0 + samples as f64 / 500.0) + floor,
                now,
            );
            r.line.epoch = Some(samples as f64 / 1000.0);
            r.line.eval_loss = eval.then_some(1.1 * r.line.loss);
            w.histories
                .entry(JobId::new(&id).unwrap())
                .or_default()
                .add(&r);
        }
        for h in 1..=3 {
            w.add_host(host(&format!("h{h}"), 1, now, vec![]));
        }
        w.step(now, false);
        if stopped_at.is_none() && w.status("sw-3").phase.is_terminal() {
            stopped_at = Some(samples);
        }
    }
    (w, stopped_at)
}

#[test]
fn a_sweeps_early_stopping_ends_the_trial_that_cannot_reach_the_best() {
    // Trial 3's loss levels off far above the others'. The default `predicted` rule
    // (keep 1) ends it once it has run an epoch.
    let (w, stopped_at) = sweep_of_three(false, None);
    let s = w.status("sw-3");
    assert_eq!(s.phase, JobPhase::Completed, "{s:?}");
    assert_eq!(s.end.as_ref().unwrap().reason, EndReason::EarlyStopped);
    assert!(
        s.message
            .as_ref()
            .unwrap()
            .contains("early stopped by its sweep"),
        "{s:?}"
    );
    assert!(stopped_at.unwrap() >= 1000, "not before one epoch");
    for id in ["sw-1", "sw-2"] {
        assert!(!w.status(id).phase.is_terminal(), "{id} goes on");
    }
}

#[test]
fn with_held_out_losses_and_declared_work_the_trial_is_judged_by_its_held_out_curve() {
    let (w, stopped_at) = sweep_of_three(true, Some(6000));
    let s = w.status("sw-3");
    assert_eq!(
        s.end.as_ref().unwrap().reason,
        EndReason::EarlyStopped,
        "{s:?}"
    );
    let message = s.message.as_ref().unwrap();
    assert!(
        message.contains("its held-out loss cannot get below"),
        "{message}"
    );
    assert!(stopped_at.unwrap() >= 1000, "not before one epoch");
    assert!(!w.status("sw-1").phase.is_terminal(), "the best goes on");
    // The step fitted the held-out curve of the trial still running: at its declared end
    // it predicts 1.1 × (1 / (1 + 6000 / 500) + 0.10).
    let id = JobId::new("sw-1").unwrap();
    let mut cache = w.cache.clone();
    let curve = cache
        .eval_curve(&id, &w.histories[&id], &w.settings.fit, false)
        .expect("a held-out curve");
    let want = 1.1 * (1.0 / 13.0 + 0.10);
    let got = curve.predict(6000.0);
    assert!((got - want).abs() / want < 0.05, "{got} against {want}");
}

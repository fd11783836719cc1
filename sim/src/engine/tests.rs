use super::*;
use crate::apps::load_all;
use converge_sched::decide::decide;
use converge_sched::policies::PolicyParams;
use converge_sched::policies::{POLICY_NAMES, by_name};
use std::collections::BTreeSet;

use crate::test_support::{apps, workload};

/// The policy called `name`; Pollux with a short search (what these tests check holds
/// for any search length, and the full one costs minutes here).
fn policy(name: &str) -> Box<dyn Policy> {
    if name == "pollux" {
        return Box::new(converge_sched::policies::Pollux {
            population: 20,
            generations: 10,
            ..Default::default()
        });
    }
    by_name(name, PolicyParams::default()).unwrap()
}

fn run(name: &str, jobs: &[WorkloadJob], cfg: &SimConfig) -> SimResult {
    simulate(apps(), jobs, policy(name).as_ref(), cfg).unwrap()
}

/// The applications with two GPU types written from the Pollux step times into a
/// temporary traces folder: `slow` (as measured) and `fast` (every step and sync time
/// halved).
fn two_type_apps() -> BTreeMap<String, Application> {
    let traces = crate::apps::test_trace_dirs();
    let dir = tempfile::tempdir().unwrap();
    let mut apps = load_all(&traces).unwrap();
    for (name, app) in &mut apps {
        std::fs::create_dir_all(dir.path().join(name)).unwrap();
        let from = crate::apps::app_dir(&traces, name).unwrap().join(name);
        for file in ["placements", "scalability"] {
            let text = std::fs::read_to_string(from.join(format!("{file}.csv"))).unwrap();
            let mut lines = text.lines();
            let header = lines.next().unwrap();
            let columns: Vec<&str> = header.split(',').collect();
            let mut fast = format!("{header}\n");
            for line in lines.filter(|l| !l.trim().is_empty()) {
                let cells: Vec<String> = line
                    .split(',')
                    .zip(&columns)
                    .map(|(cell, column)| match *column {
                        "step_time" | "sync_time" => {
                            (cell.trim().parse::<f64>().unwrap() / 2.0).to_string()
                        }
                        _ => cell.to_string(),
                    })
                    .collect();
                fast += &format!("{}\n", cells.join(","));
            }
            let at = |t: &str| dir.path().join(name).join(format!("{file}-{t}.csv"));
            std::fs::write(at("slow"), &text).unwrap();
            std::fs::write(at("fast"), fast).unwrap();
        }
        app.load_gpu_type(dir.path(), "slow").unwrap();
        app.load_gpu_type(dir.path(), "fast").unwrap();
    }
    apps
}

fn group(gpu_type: &str, nodes: u32) -> NodeGroup {
    NodeGroup {
        gpu_type: gpu_type.into(),
        nodes,
        gpus_per_node: 4,
    }
}

#[test]
fn on_a_mixed_cluster_jobs_run_on_one_type_at_that_types_speed() {
    let apps = two_type_apps();
    // One job alone: twice as fast on `fast` as on `slow` (restart delay aside).
    let lone: Vec<WorkloadJob> = workload(40)
        .into_iter()
        .filter(|j| j.application == "cifar10")
        .take(1)
        .map(|j| WorkloadJob { time: 0.0, ..j })
        .collect();
    let jct = |gpu_type: &str| {
        let cfg = SimConfig {
            gpu_groups: vec![group(gpu_type, 2)],
            restart_delay_s: 0.0,
            ..SimConfig::default()
        };
        let r = simulate(&apps, &lone, policy("fifo").as_ref(), &cfg).unwrap();
        r.jobs[0].completed_at.unwrap()
    };
    let (slow, fast) = (jct("slow"), jct("fast"));
    assert!(
        (fast / slow - 0.5).abs() < 0.05,
        "fast {fast} s, slow {slow} s"
    );

    // A mixed cluster: every placement of every decision is on one type, for a policy
    // that places through `place` and for pollux, which allocates on hosts itself.
    let jobs = workload(30);
    for (name, placement) in [
        ("quality", PlacementKind::Bco),
        ("tiresias", PlacementKind::FirstFit),
        ("pollux", PlacementKind::FirstFit),
    ] {
        let cfg = SimConfig {
            gpu_groups: vec![group("slow", 2), group("fast", 2)],
            placement,
            record_decisions: true,
            ..SimConfig::default()
        };
        let r = simulate(&apps, &jobs, policy(name).as_ref(), &cfg).unwrap();
        assert!(r.finished, "{name}");
        assert_eq!(r.policy_violations, 0, "{name}");
        let mut spanning_nodes = 0;
        let mut types_used = BTreeSet::new();
        for d in &r.decisions {
            let type_of = |h: &HostId| {
                d.hosts
                    .iter()
                    .find(|x| &x.host == h)
                    .unwrap()
                    .gpu_type
                    .clone()
            };
            for ranks in d.allocation.placements.values() {
                let types: BTreeSet<_> = ranks.iter().map(|r| type_of(&r.host)).collect();
                assert!(types.len() <= 1, "{name} at {}: {ranks:?}", d.now);
                types_used.extend(types);
                spanning_nodes += usize::from(nodes_of(ranks).len() > 1);
            }
        }
        assert_eq!(types_used.len(), 2, "{name}: both types used");
        assert!(spanning_nodes > 0, "{name}: some jobs span nodes");
        // The GPU time per type adds up to the GPU time held, job by job.
        for j in &r.jobs {
            let by_type: f64 = j.gpu_seconds_by_type.values().sum();
            assert!(j.gpu_seconds > 0.0, "{name}: {}", j.name);
            assert!(
                (by_type - j.gpu_seconds).abs() <= 1e-6 * j.gpu_seconds,
                "{name}: {}: {by_type} of {} GPU-s",
                j.name,
                j.gpu_seconds
            );
        }
        let summary = crate::summary::summarize(name, &[("w".into(), r.clone())]);
        let held: f64 = r.jobs.iter().map(|j| j.gpu_seconds).sum();
        assert!(
            (summary.gpu_hours_per_job * 3600.0 * r.jobs.len() as f64 - held).abs() < 1e-6 * held
        );
        let by_type: f64 = summary
            .gpu_hours_by_type
            .values()
            .flat_map(|t| t.values())
            .sum();
        assert!((by_type * 3600.0 - held).abs() < 1e-6 * held, "{name}");
        let types_with_time: BTreeSet<&String> = summary
            .gpu_hours_by_type
            .values()
            .flat_map(|t| t.keys())
            .collect();
        assert_eq!(
            types_with_time.len(),
            2,
            "{name}: {:?}",
            summary.gpu_hours_by_type
        );
    }

    // A type without step times is refused by name.
    let cfg = SimConfig {
        gpu_groups: vec![group("slow", 1), group("h100", 1)],
        ..SimConfig::default()
    };
    let err = simulate(&apps, &jobs, policy("fifo").as_ref(), &cfg).unwrap_err();
    assert!(
        matches!(&err, SimError::MissingGpuType { gpu_type, .. } if gpu_type == "h100"),
        "{err}"
    );
}

#[test]
fn jobs_in_queues_the_run_does_not_define_are_refused_by_name() {
    let mut jobs = workload(6);
    jobs[0].queue = Some("team-a".into());
    jobs[1].queue = Some("team-b".into());
    jobs[2].queue = Some("team-b".into());
    let mut cfg = SimConfig {
        nodes: 2,
        ..SimConfig::default()
    };
    let spec = |name: &str| QueueSpec {
        name: name.parse().unwrap(),
        quota_gpus: 4,
        ..QueueSpec::implicit_default()
    };
    cfg.queues.insert("team-a".parse().unwrap(), spec("team-a"));
    let err = simulate(apps(), &jobs, policy("fifo").as_ref(), &cfg).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, SimError::MissingQueues { jobs: 2, .. }),
        "{text}"
    );
    assert!(text.contains("team-b (2 job(s))"), "{text}");
    assert!(text.contains("defined: default, team-a"), "{text}");
    // Defined, it runs.
    cfg.queues.insert("team-b".parse().unwrap(), spec("team-b"));
    assert!(simulate(apps(), &jobs, policy("fifo").as_ref(), &cfg).is_ok());
}

#[test]
fn every_decision_is_what_decide_returns_and_is_applied_as_is() {
    let jobs = workload(40);
    for (name, placement) in [
        ("quality", PlacementKind::Bco),
        ("tiresias", PlacementKind::FirstFit),
        ("optimus", PlacementKind::Bco),
        ("sjf-bco", PlacementKind::Bco),
        ("pollux", PlacementKind::FirstFit),
    ] {
        let cfg = SimConfig {
            nodes: 4,
            interference: 0.5,
            placement,
            record_decisions: true,
            ..SimConfig::default()
        };
        let policy = policy(name);
        let result = simulate(apps(), &jobs, policy.as_ref(), &cfg).unwrap();
        assert!(result.decisions.len() > 10, "{name}");
        for d in &result.decisions {
            let cluster = ClusterState {
                now: d.now,
                hosts: &d.hosts,
                contention_per_shared_job: d.contention_per_shared_job,
            };
            let again = decide(&cluster, &d.jobs, policy.as_ref(), placement);
            assert_eq!(again, d.allocation, "{name} at {}", d.now);
        }
        // What the next decision sees as each job's placement is what the previous one
        // placed: the simulator changes nothing.
        for pair in result.decisions.windows(2) {
            for job in &pair[1].jobs {
                let placed = pair[0].allocation.placements.get(&job.id);
                assert_eq!(
                    job.placement.as_slice(),
                    placed.map_or(&[][..], Vec::as_slice),
                    "{name}: {} at {}",
                    job.id,
                    pair[1].now
                );
            }
        }
        // Only what the policy declares is filled in.
        let inputs = policy.inputs();
        let views = result.decisions.iter().flat_map(|d| &d.allocation.views);
        for view in views {
            if !inputs.curves {
                assert!(view.curve.is_none(), "{name}");
            }
            if !(inputs.estimates || inputs.oracle) {
                assert!(
                    view.throughput.is_none() && view.remaining_work.is_none(),
                    "{name}"
                );
            }
        }
    }
}

/// `--work target-loss`: no job's declared work reaches the policy. A job's remaining work
/// is unknown until its curve is fitted, then the curve's estimate to its target, which
/// differs from the declared work the default mode passes.
#[test]
fn without_declared_work_the_policy_sees_only_the_curves_estimate() {
    let jobs = workload(20);
    let policy = by_name("quality", PolicyParams::default()).unwrap();
    let run = |work| {
        let cfg = SimConfig {
            nodes: 4,
            record_decisions: true,
            work,
            ..SimConfig::default()
        };
        simulate(apps(), &jobs, policy.as_ref(), &cfg).unwrap()
    };
    let declared = run(WorkKnowledge::Declared);
    let target = run(WorkKnowledge::TargetLoss);
    let first = |r: &SimResult| -> BTreeMap<JobId, Option<f64>> {
        let mut seen = BTreeMap::new();
        for d in &r.decisions {
            for v in &d.jobs {
                seen.entry(v.id.clone()).or_insert(v.remaining_work);
            }
        }
        seen
    };
    // A job's first decision: declared work is known at once, a curve needs reports.
    let (d0, t0) = (first(&declared), first(&target));
    assert!(d0.values().all(|w| w.is_some_and(|w| w > 0.0)), "{d0:?}");
    assert!(t0.values().all(Option::is_none), "{t0:?}");
    // Later the curve's estimates arrive for some jobs, and are not the declared figures.
    let estimates: Vec<f64> = target
        .decisions
        .iter()
        .flat_map(|d| d.jobs.iter().filter_map(|v| v.remaining_work))
        .collect();
    assert!(!estimates.is_empty(), "no curve reached its target");
    // Each view of the target-loss run is scored against the truth; the declared run's
    // views are not.
    assert!(declared.work_estimates.is_empty());
    let views: usize = target.decisions.iter().map(|d| d.jobs.len()).sum();
    let scored = &target.work_estimates;
    assert!(
        !scored.is_empty() && scored.len() <= views,
        "{} of {views}",
        scored.len()
    );
    assert_eq!(
        scored.iter().filter(|e| e.ratio.is_some()).count(),
        estimates.len(),
        "one score per estimate told"
    );
    assert!(scored.iter().all(|e| (0.0..=1.0).contains(&e.done)));
    let ends =
        |r: &SimResult| -> Vec<Option<f64>> { r.jobs.iter().map(|j| j.completed_at).collect() };
    assert_ne!(
        ends(&declared),
        ends(&target),
        "the knowledge changed nothing"
    );
}

#[test]
fn contention_measured_on_shared_nodes_reaches_the_decision() {
    let jobs = workload(40);
    let cfg = SimConfig {
        nodes: 4,
        interference: 0.5,
        placement: PlacementKind::Bco,
        record_decisions: true,
        ..SimConfig::default()
    };
    let policy = by_name("quality", PolicyParams::default()).unwrap();
    let result = simulate(apps(), &jobs, policy.as_ref(), &cfg).unwrap();
    // 1/(1 − 0.5) − 1 = 1 extra step per shared job once two multi-node jobs share a node.
    let last = result.decisions.last().unwrap().contention_per_shared_job;
    assert!(last > 0.0 && last <= 1.0 + 1e-12, "{last}");
    let calm = simulate(
        apps(),
        &jobs,
        policy.as_ref(),
        &SimConfig {
            interference: 0.0,
            ..cfg.clone()
        },
    )
    .unwrap();
    assert!(
        calm.decisions
            .iter()
            .all(|d| d.contention_per_shared_job == 0.0)
    );
    // The ablation flag passes none, whatever the jobs show. A cheaper policy suffices
    // (the measurement does not depend on it); first fit shares nodes between multi-node
    // jobs more often than BCO.
    let tiresias = by_name("tiresias", PolicyParams::default()).unwrap();
    let first_fit = SimConfig {
        placement: PlacementKind::FirstFit,
        ..cfg
    };
    let measured = simulate(apps(), &jobs, tiresias.as_ref(), &first_fit).unwrap();
    assert!(
        measured
            .decisions
            .iter()
            .any(|d| d.contention_per_shared_job > 0.0)
    );
    let ignored = SimConfig {
        ignore_contention: true,
        ..first_fit
    };
    let ignored = simulate(apps(), &jobs, tiresias.as_ref(), &ignored).unwrap();
    assert!(
        ignored
            .decisions
            .iter()
            .all(|d| d.contention_per_shared_job == 0.0)
    );
}

#[test]
fn a_lone_job_finishes_when_its_step_times_say() {
    let job = WorkloadJob {
        name: "cifar10-0".into(),
        time: 0.0,
        application: "cifar10".into(),
        num_replicas: 2,
        batch_size: 256,
        queue: None,
        priority: PriorityClass::Normal,
    };
    let cfg = SimConfig::default();
    let result = run("fifo", std::slice::from_ref(&job), &cfg);
    let done = result.jobs[0].completed_at.expect("finished");
    // Independently: placed at the first decision (t = 60 s) on one node with 2 GPUs,
    // 30 s of restart delay, then it trains at the measured step times until its
    // completion epoch.
    let app = &apps()["cifar10"];
    let mut alone = SimJob::new("alone", app, 0.0, 2, 256);
    alone.reallocate(app, vec![2], cfg.restart_delay_s, None);
    let mut t = 60.0;
    while alone.completed_at.is_none() {
        alone.step(app, t, 1.0, 0.0);
        t += 1.0;
    }
    let expected = alone.completed_at.unwrap();
    assert!(
        (done - expected).abs() <= 1.0,
        "simulated {done} s, step times imply {expected} s"
    );
    // And the run time is what the step time and the statistical progress imply.
    let (step_time, _) = app.throughput(&[2], f64::from(alone.atomic_bsz()));
    assert!(step_time > 0.0);
    assert_eq!(result.jobs[0].restarts, 0);
}

#[test]
fn runs_are_deterministic_for_a_seed() {
    let jobs = workload(30);
    let cfg = SimConfig {
        seed: 7,
        ..SimConfig::default()
    };
    let a = run("quality", &jobs, &cfg);
    let b = run("quality", &jobs, &cfg);
    assert_eq!(a.jobs, b.jobs);
    let strip = |r: &SimResult| {
        r.intervals
            .iter()
            .map(|i| (i.time, i.utilization, i.avg_normalized_loss))
            .collect::<Vec<_>>()
    };
    assert_eq!(strip(&a), strip(&b));
}

#[test]
fn adaptive_jobs_get_batch_plans_within_their_limits_unless_batches_are_fixed() {
    let jobs = workload(30);
    for fixed_batch in [false, true] {
        let cfg = SimConfig {
            nodes: 4,
            record_decisions: true,
            fixed_batch,
            ..SimConfig::default()
        };
        let result = run("quality", &jobs, &cfg);
        assert!(result.finished);
        let mut totals: BTreeMap<&JobId, BTreeSet<u32>> = BTreeMap::new();
        for d in &result.decisions {
            for (id, plan) in &d.allocation.batches {
                let view = d.jobs.iter().find(|j| &j.id == id).unwrap();
                let limits = view.adaptive.as_ref().unwrap().limits;
                let workers = d.allocation.placements[id].len() as u32;
                assert_eq!(
                    plan.total,
                    workers * plan.per_worker * (plan.accum_steps + 1)
                );
                assert!(plan.total >= limits.reference && plan.total <= limits.max_total);
                assert!(plan.per_worker >= limits.min_per_worker);
                assert!(plan.per_worker <= limits.max_per_worker);
                totals.entry(id).or_default().insert(plan.total);
            }
        }
        if fixed_batch {
            assert!(totals.is_empty(), "fixed batches got plans: {totals:?}");
        } else {
            // Batches follow allocations (and gradient statistics): several jobs run
            // more than one batch size.
            let changed = totals.values().filter(|t| t.len() > 1).count();
            assert!(changed >= 2, "{totals:?}");
        }
    }
}

#[test]
fn with_batch_per_generation_a_placed_job_keeps_its_batch() {
    // A lone adaptive job, placed once: by default its batch grows with its gradient
    // noise scale every interval; under the service's rule it keeps its first one, and
    // so it ends later.
    let job = WorkloadJob {
        name: "cifar10-0".into(),
        time: 0.0,
        application: "cifar10".into(),
        num_replicas: 1,
        batch_size: 128,
        queue: None,
        priority: PriorityClass::Normal,
    };
    let ends: Vec<(f64, u32)> = [false, true]
        .into_iter()
        .map(|batch_per_generation| {
            let cfg = SimConfig {
                nodes: 1,
                batch_per_generation,
                ..SimConfig::default()
            };
            let r = run("quality", std::slice::from_ref(&job), &cfg);
            (r.jobs[0].completed_at.unwrap(), r.jobs[0].restarts)
        })
        .collect();
    assert_eq!((ends[0].1, ends[1].1), (0, 0), "{ends:?}");
    assert!(ends[1].0 > ends[0].0, "{ends:?}");
}

#[test]
fn every_policy_respects_capacity_on_every_interval() {
    let jobs = workload(40);
    let cfg = SimConfig {
        nodes: 4,
        ..SimConfig::default()
    };
    for name in POLICY_NAMES {
        let r = run(name, &jobs, &cfg);
        assert_eq!(r.policy_violations, 0, "{name}");
        assert!(
            r.intervals.iter().all(|i| i.utilization <= 1.0 + 1e-12),
            "{name}"
        );
        assert!(r.finished, "{name} left jobs unfinished");
        assert!(
            r.jobs
                .iter()
                .all(|j| j.completed_at.unwrap() > j.submitted_at),
            "{name}"
        );
    }
}

#[test]
fn interference_slows_jobs_that_share_nodes() {
    // Two 6-GPU jobs on a 3-node cluster of 4 GPUs each must share a node.
    let jobs: Vec<WorkloadJob> = (0..2)
        .map(|i| WorkloadJob {
            name: format!("cifar10-{i}"),
            time: 0.0,
            application: "cifar10".into(),
            num_replicas: 6,
            batch_size: 2048,
            queue: None,
            priority: PriorityClass::Normal,
        })
        .collect();
    let base = SimConfig {
        nodes: 3,
        ..SimConfig::default()
    };
    let calm = run("tiresias", &jobs, &base);
    let noisy = run(
        "tiresias",
        &jobs,
        &SimConfig {
            interference: 0.5,
            ..base
        },
    );
    let jct = |r: &SimResult| r.jobs.iter().map(|j| j.completed_at.unwrap()).sum::<f64>();
    assert!(
        jct(&noisy) > 1.3 * jct(&calm),
        "{} vs {}",
        jct(&noisy),
        jct(&calm)
    );
}

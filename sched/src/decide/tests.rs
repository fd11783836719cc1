use super::*;
use crate::benchgen::{BenchBatches, BenchConfig, DECISION_TIME_S, DecisionInputs};
use crate::policies::{POLICY_NAMES, PolicyParams, by_name};
use proptest::prelude::*;

/// Small generated clusters (adaptive jobs, so Pollux has goodput), with each job's
/// bounds clamped to what the whole cluster holds.
fn inputs(seed: u64, jobs: usize, nodes: u32, gpus_per_node: u32) -> DecisionInputs {
    let mut inputs = DecisionInputs::generate(&BenchConfig {
        jobs,
        nodes,
        gpus_per_node,
        gpu_types: 1,
        seed,
    })
    .with_batches(BenchBatches::Adaptive, seed);
    for view in &mut inputs.views {
        let per_node = gpus_per_node / view.gpus_per_worker.max(1);
        let cap = per_node * nodes;
        view.max_workers = view.max_workers.min(cap);
        view.min_workers = view.min_workers.min(view.max_workers);
        view.requested_workers = view.requested_workers.min(view.max_workers);
    }
    inputs
}

fn run(
    inputs: &DecisionInputs,
    views: &[JobView],
    policy: &str,
    placement: PlacementKind,
) -> Allocation {
    let policy = by_name(policy, PolicyParams::default()).unwrap();
    decide(
        &cluster_at(DECISION_TIME_S, &inputs.hosts),
        views,
        policy.as_ref(),
        placement,
    )
}

/// A cluster of `hosts` at `now`, with no contention measured.
fn cluster_at(now: f64, hosts: &[HostFree]) -> ClusterState<'_> {
    ClusterState {
        now,
        hosts,
        contention_per_shared_job: 0.0,
    }
}

fn setup() -> impl Strategy<Value = (u64, usize, u32, u32, Vec<Option<Vec<bool>>>)> {
    (any::<u64>(), 2usize..10, 2u32..6, 2u32..9).prop_flat_map(|(seed, jobs, nodes, gpus)| {
        let selectors = prop::collection::vec(
            prop::option::weighted(0.5, prop::collection::vec(any::<bool>(), nodes as usize)),
            jobs,
        );
        (Just(seed), Just(jobs), Just(nodes), Just(gpus), selectors)
    })
}

fn queued(
    inputs: &DecisionInputs,
    views: &[JobView],
    policy: &str,
    placement: PlacementKind,
    specs: &BTreeMap<QueueId, QueueSpec>,
    previous: &BTreeMap<QueueId, QueueStatus>,
) -> QueuedAllocation {
    let policy = by_name(policy, PolicyParams::default()).unwrap();
    decide_queued(
        &cluster_at(DECISION_TIME_S, &inputs.hosts),
        views,
        policy.as_ref(),
        placement,
        &QueueSetup {
            specs,
            previous,
            half_life_s: queues::DEFAULT_USAGE_HALF_LIFE_S,
        },
    )
}

fn spec(name: &str, quota: u32, borrow: Option<u32>) -> (QueueId, QueueSpec) {
    let id: QueueId = name.parse().unwrap();
    (
        id.clone(),
        QueueSpec {
            name: id,
            quota_gpus: quota,
            borrowing_limit_gpus: borrow,
            ..QueueSpec::implicit_default()
        },
    )
}

/// A pending or running 1-GPU-per-worker job of `queue`, fixed at `workers`.
fn gang(id: &str, queue: &str, priority: PriorityClass, workers: u32, at: f64) -> JobView {
    let base = inputs(1, 2, 2, 4).views[0].clone();
    JobView {
        id: id.parse().unwrap(),
        gpus_per_worker: 1,
        min_workers: workers,
        max_workers: workers,
        requested_workers: workers,
        workers_declared: true,
        submitted_at: at,
        placement: Vec::new(),
        hosts: None,
        queue: queue.parse().unwrap(),
        priority,
        started_at: None,
        shadow: None,
        ..base
    }
}

/// On a cluster of several GPU types the decision projects each job's speed on the
/// types it has not run on, reports it, and places the job on its fastest type; on a
/// cluster of one type it reports nothing and decides as before.
#[test]
fn on_several_gpu_types_jobs_get_projected_speeds_and_their_fastest_type() {
    let base = gang("x", "default", PriorityClass::Normal, 2, 0.0);
    let job = |id: &str, speeds: &[(&str, f64)]| JobView {
        id: id.parse().unwrap(),
        family: Some("bert".into()),
        gpu_type_speeds: speeds.iter().map(|&(t, v)| (t.to_string(), v)).collect(),
        ..base.clone()
    };
    let views = [
        job("old", &[("t4", 10.0), ("a100", 40.0)]),
        job("new", &[("t4", 5.0)]),
    ];
    let typed = |name: &str, t: &str| {
        HostFree::new(name.parse().unwrap(), (0..2).collect()).with_gpu_type(t)
    };
    let hosts = [
        typed("h1", "t4"),
        typed("h2", "t4"),
        typed("h3", "a100"),
        typed("h4", "a100"),
    ];
    let cluster = cluster_at(10.0, &hosts);
    let quality = by_name("quality", PolicyParams::default()).unwrap();
    let d = decide(&cluster, &views, quality.as_ref(), PlacementKind::FirstFit);
    let new = &d.gpu_type_speeds[&"new".parse::<JobId>().unwrap()];
    assert_eq!(
        new["a100"],
        crate::gpu_types::TypeSpeed {
            samples_per_s: 20.0,
            measured: false
        }
    );
    assert!(new["t4"].measured);
    // Both are fastest on a100, which holds both (2 workers each).
    for id in ["old", "new"] {
        let ranks = &d.placements[&id.parse::<JobId>().unwrap()];
        assert_eq!(ranks.len(), 2, "{id}");
        assert!(
            ranks
                .iter()
                .all(|r| ["h3", "h4"].contains(&r.host.as_str())),
            "{id}: {ranks:?}"
        );
    }
    // One type: no speeds, the same decision as without them.
    let untyped: Vec<HostFree> = hosts
        .iter()
        .map(|h| HostFree::new(h.host.clone(), h.gpus.clone()))
        .collect();
    let one = ClusterState {
        hosts: &untyped,
        ..cluster
    };
    let plain: Vec<JobView> = views
        .iter()
        .map(|v| JobView {
            family: None,
            gpu_type_speeds: BTreeMap::new(),
            ..v.clone()
        })
        .collect();
    let d = decide(&one, &views, quality.as_ref(), PlacementKind::FirstFit);
    assert!(d.gpu_type_speeds.is_empty());
    assert_eq!(
        d,
        decide(&one, &plain, quality.as_ref(), PlacementKind::FirstFit)
    );
}

/// On a mixed cluster Sia and the quality policy pick each job's GPU type themselves and
/// placement keeps the job to that type's hosts, moving a running job whose size is
/// unchanged: the job 4x faster on a100 (relative to its t4 speed) gets the a100 host,
/// the one that gains 1.2x leaves it for the t4 host (both jobs old enough for their
/// restart budgets to allow the move).
#[test]
fn type_picking_policies_place_each_job_on_the_type_they_chose() {
    let model = ThroughputModel::from_coefficients([0.0025, 0.02, 0.01, 0.1, 0.01], 5);
    let base = gang("x", "default", PriorityClass::Normal, 2, 0.0);
    let job = |id: &str, speeds: &[(&str, f64)], at: f64| JobView {
        id: id.parse().unwrap(),
        min_workers: 1,
        max_workers: 2,
        submitted_at: at,
        model: Some(model.clone()),
        batch: BatchSize::PerWorker(32.0),
        adaptive: None,
        oracle: None,
        curve: None,
        family: Some(id.into()),
        gpu_type_speeds: speeds.iter().map(|&(t, v)| (t.to_string(), v)).collect(),
        ..base.clone()
    };
    let rank = |rank: u32, host: &str, gpu: u32| RankPlacement {
        rank,
        host: host.parse().unwrap(),
        gpus: vec![gpu],
    };
    let views = [
        job("gainer", &[("t4", 10.0), ("a100", 40.0)], 0.0),
        JobView {
            placement: vec![rank(0, "h2", 0), rank(1, "h2", 1)],
            ..job("flat", &[("t4", 10.0), ("a100", 12.0)], 1.0)
        },
    ];
    let hosts = [
        HostFree::new("h1".parse().unwrap(), vec![0, 1]).with_gpu_type("t4"),
        HostFree::new("h2".parse().unwrap(), vec![0, 1]).with_gpu_type("a100"),
    ];
    let cluster = cluster_at(10_000.0, &hosts);
    for name in ["sia", "quality"] {
        let policy = by_name(name, PolicyParams::default()).unwrap();
        let d = decide(&cluster, &views, policy.as_ref(), PlacementKind::FirstFit);
        for (id, host) in [("gainer", "h2"), ("flat", "h1")] {
            let ranks = &d.placements[&id.parse::<JobId>().unwrap()];
            assert_eq!(ranks.len(), 2, "{name}, {id}: {d:?}");
            assert!(
                ranks.iter().all(|r| r.host.as_str() == host),
                "{name}, {id}: {ranks:?}"
            );
        }
    }
}

/// A shadow job's throughput table is compute-only and linear in the workers, in
/// ring-equivalent samples (÷ the penalty) while the policy has no curve of it, in its
/// own samples once it has one; a ring job with the same model pays its sync. Under BCO
/// every shadow job gets a background cost, with or without a model.
#[test]
fn shadow_jobs_get_compute_only_tables_at_the_measured_penalty() {
    // compute 0.1 s at batch 32 (θ_c·32 + θ_0), inter-node sync θ_inter = 0.1 s.
    let model = ThroughputModel::from_coefficients([0.0025, 0.02, 0.01, 0.1, 0.01], 5);
    let base = gang("r", "default", PriorityClass::Normal, 4, 0.0);
    let job = |id: &str, shadow: Option<ShadowAlgorithm>| JobView {
        id: id.parse().unwrap(),
        min_workers: 1,
        max_workers: 8,
        model: Some(model.clone()),
        batch: BatchSize::PerWorker(32.0),
        adaptive: None,
        oracle: None,
        curve: None,
        shadow,
        ..base.clone()
    };
    let views = [
        job("ring", None),
        job("ma", Some(ShadowAlgorithm::Ma)),
        job("easgd", Some(ShadowAlgorithm::Easgd)),
    ];
    let hosts: Vec<HostFree> = (0..2)
        .map(|h| HostFree::new(format!("h{h}").parse().unwrap(), (0..4).collect()))
        .collect();
    let policy = by_name("optimus", PolicyParams::default()).unwrap();
    let d = decide(
        &cluster_at(0.0, &hosts),
        &views,
        policy.as_ref(),
        PlacementKind::Bco,
    );
    let table = |id: &str| {
        d.views
            .iter()
            .find(|v| v.id.as_str() == id)
            .unwrap()
            .throughput
            .clone()
            .unwrap()
    };
    for (id, penalty) in [("ma", 1.02), ("easgd", 1.02)] {
        let t = table(id);
        for (i, rate) in t.iter().enumerate() {
            let linear = (i + 1) as f64 * 320.0 / penalty;
            assert!((rate - linear).abs() < 1e-6, "{id} {i}: {rate} vs {linear}");
        }
    }
    // The ring job: 8 workers span two hosts and pay θ_inter·r(8) + θ_α.
    let ring = table("ring");
    assert!(ring[7] < 0.5 * 8.0 * 320.0, "{ring:?}");
}

/// Applies a decision: each job's placement becomes what was placed.
fn apply(views: &mut [JobView], d: &Allocation, now: f64) {
    for v in views.iter_mut() {
        let new = d.placements.get(&v.id).cloned().unwrap_or_default();
        if new != v.placement {
            v.started_at = (!new.is_empty()).then_some(now);
        }
        v.placement = new;
    }
}

fn gpus_of(d: &Allocation, views: &[JobView], queue: &str) -> u32 {
    views
        .iter()
        .filter(|v| v.queue.as_str() == queue)
        .filter_map(|v| d.placements.get(&v.id))
        .map(|r| r.iter().map(|p| p.gpus.len() as u32).sum::<u32>())
        .sum()
}

#[test]
fn idle_quota_is_lent_then_reclaimed_by_preempting_whole_borrower_jobs() {
    let inputs = inputs(3, 2, 2, 4); // 2 hosts × 4 GPUs
    let specs: BTreeMap<_, _> = [spec("a", 4, None), spec("b", 4, None)].into();
    let none = BTreeMap::new();
    let mut views: Vec<JobView> = (0..4)
        .map(|i| {
            gang(
                &format!("a{i}"),
                "a",
                PriorityClass::Normal,
                2,
                f64::from(i),
            )
        })
        .collect();
    for policy in ["fifo", "quality"] {
        let mut views = views.clone();
        let d = queued(
            &inputs,
            &views,
            policy,
            PlacementKind::FirstFit,
            &specs,
            &none,
        );
        assert_eq!(
            gpus_of(&d.allocation, &views, "a"),
            8,
            "{policy}: b's quota is lent"
        );
        assert_eq!(d.statuses[&"b".parse::<QueueId>().unwrap()].lent_gpus, 4);
        apply(&mut views, &d.allocation, 60.0);
        // b needs its quota back: exactly two of a's 2-GPU jobs go, the newest.
        views.push(gang("b0", "b", PriorityClass::Normal, 4, 100.0));
        let d = queued(
            &inputs,
            &views,
            policy,
            PlacementKind::FirstFit,
            &specs,
            &d.statuses,
        );
        assert_eq!(gpus_of(&d.allocation, &views, "b"), 4, "{policy}");
        assert_eq!(gpus_of(&d.allocation, &views, "a"), 4, "{policy}");
        let out: BTreeSet<&str> = d.preempted.keys().map(JobId::as_str).collect();
        assert_eq!(out.len(), 2, "{policy}: {out:?}");
    }
    // A queue that does not exist: its job waits, the others are untouched.
    views.push(gang("x0", "gone", PriorityClass::High, 1, 0.5));
    let d = queued(
        &inputs,
        &views,
        "fifo",
        PlacementKind::FirstFit,
        &specs,
        &none,
    );
    assert_eq!(d.unknown_queue.len(), 1);
    assert!(
        d.allocation
            .placements
            .get(&JobId::new("x0").unwrap())
            .is_none_or(Vec::is_empty)
    );
}

/// GPUs a queue's budget leaves unused (here: a gang larger than its share) are split
/// by the other queues' fair shares, not handed to the first queue by name.
#[test]
fn unused_budget_goes_to_queues_by_fair_share_not_by_name() {
    let inputs = inputs(3, 2, 2, 4); // 2 hosts × 4 GPUs
    let weighted = |name: &str, weight: f64| {
        let (id, mut s) = spec(name, 0, None);
        s.weight = weight;
        (id, s)
    };
    let specs: BTreeMap<_, _> = [weighted("a", 1.0), weighted("b", 3.0), weighted("c", 4.0)].into();
    let mut views: Vec<JobView> = Vec::new();
    for q in ["a", "b"] {
        for i in 0..8 {
            views.push(gang(
                &format!("{q}{i}"),
                q,
                PriorityClass::Normal,
                1,
                f64::from(i),
            ));
        }
    }
    // c's share is 4 GPUs; its only job needs 5: its 4 GPUs are left over.
    views.push(gang("c0", "c", PriorityClass::Normal, 5, 0.0));
    let d = queued(
        &inputs,
        &views,
        "fifo",
        PlacementKind::FirstFit,
        &specs,
        &BTreeMap::new(),
    );
    assert_eq!(gpus_of(&d.allocation, &views, "c"), 0);
    // Shares 1 : 3 of the 8 minus c's; the 4 left over split 1 : 3.
    assert_eq!(gpus_of(&d.allocation, &views, "a"), 2);
    assert_eq!(gpus_of(&d.allocation, &views, "b"), 6);
}

#[test]
fn a_high_priority_job_preempts_the_newest_lower_jobs_of_its_queue_only() {
    let inputs = inputs(3, 2, 2, 4);
    let specs: BTreeMap<_, _> = [spec("a", 4, Some(0)), spec("b", 4, Some(0))].into();
    let none = BTreeMap::new();
    let mut views = vec![
        gang("a-old", "a", PriorityClass::Normal, 2, 0.0),
        gang("a-new", "a", PriorityClass::Normal, 2, 1.0),
        gang("b-low", "b", PriorityClass::Low, 4, 2.0),
    ];
    let d = queued(
        &inputs,
        &views,
        "fifo",
        PlacementKind::FirstFit,
        &specs,
        &none,
    );
    apply(&mut views, &d.allocation, 60.0);
    views[1].started_at = Some(70.0);
    views.push(gang("a-high", "a", PriorityClass::High, 2, 100.0));
    let d = queued(
        &inputs,
        &views,
        "fifo",
        PlacementKind::FirstFit,
        &specs,
        &d.statuses,
    );
    let ran = |id: &str| {
        d.allocation
            .placements
            .get(&JobId::new(id).unwrap())
            .is_some_and(|r| !r.is_empty())
    };
    assert!(
        ran("a-high") && ran("a-old") && ran("b-low"),
        "{:?}",
        d.allocation.placements
    );
    assert!(!ran("a-new"));
    assert_eq!(
        d.preempted.keys().map(JobId::as_str).collect::<Vec<_>>(),
        vec!["a-new"]
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Every policy and placement: a selector job's workers are on its hosts only, never
    /// more than they hold, and the decision keeps its contract.
    #[test]
    fn never_a_worker_on_a_host_outside_the_selector(
        (seed, jobs, nodes, gpus, selectors) in setup()
    ) {
        let inputs = inputs(seed, jobs, nodes, gpus);
        let mut views = inputs.views.clone();
        for (view, selector) in views.iter_mut().zip(&selectors) {
            view.hosts = selector.as_ref().map(|marks| {
                inputs
                    .hosts
                    .iter()
                    .zip(marks)
                    .filter(|(_, m)| **m)
                    .map(|(h, _)| h.host.clone())
                    .collect()
            });
        }
        for policy in POLICY_NAMES {
            for placement in [PlacementKind::FirstFit, PlacementKind::Bco] {
                let what = format!("{policy} with {placement:?}");
                let d = run(&inputs, &views, policy, placement);
                prop_assert!(!d.violates(&inputs.hosts), "{}", what);
                for view in &views {
                    let Some(allowed) = &view.hosts else { continue };
                    let ranks = d.placements.get(&view.id).map_or(&[][..], Vec::as_slice);
                    for r in ranks {
                        prop_assert!(
                            allowed.contains(&r.host),
                            "{}: {} on {} outside {:?}", what, view.id, r.host, allowed
                        );
                    }
                    let cap = eligible_capacity(view, &inputs.hosts).unwrap();
                    let decided = d.workers.get(&view.id).copied().unwrap_or(0);
                    prop_assert!(decided <= cap, "{}: {} got {} > {}", what, view.id, decided, cap);
                }
            }
        }
    }

    /// Everything in the implicit default queue (or in one queue that may borrow
    /// without limit) is exactly today's decision.
    #[test]
    fn one_queue_without_limits_is_exactly_the_decision_without_queues(
        (seed, jobs, nodes, gpus, _selectors) in setup()
    ) {
        let inputs = inputs(seed, jobs, nodes, gpus);
        let none: BTreeMap<QueueId, QueueStatus> = BTreeMap::new();
        let no_queues: BTreeMap<QueueId, QueueSpec> = BTreeMap::new();
        let team: BTreeMap<_, _> = [spec("team-a", 3, None)].into();
        let mut in_team = inputs.views.clone();
        for v in &mut in_team {
            v.queue = "team-a".parse().unwrap();
        }
        for policy in POLICY_NAMES {
            for placement in [PlacementKind::FirstFit, PlacementKind::Bco] {
                let plain = run(&inputs, &inputs.views, policy, placement);
                let q = queued(&inputs, &inputs.views, policy, placement, &no_queues, &none);
                prop_assert_eq!(&plain, &q.allocation, "{} {:?}", policy, placement);
                prop_assert!(q.preempted.is_empty());
                let t = queued(&inputs, &in_team, policy, placement, &team, &none);
                prop_assert_eq!(&plain, &t.allocation, "{} {:?}", policy, placement);
            }
        }
    }

    /// Any queues and classes: the decision keeps its contract, no queue holds more
    /// than its quota plus borrowing limit, and jobs are reclaimed (preempted for
    /// another queue) only from queues that held more than their quota.
    #[test]
    fn queues_never_lose_their_quota_to_borrowers(
        (seed, jobs, nodes, gpus, _selectors) in setup(),
        marks in prop::collection::vec((0usize..3, 0usize..3), 10),
        quotas in prop::collection::vec((0u32..8, prop::option::of(0u32..6)), 3),
    ) {
        let inputs = inputs(seed, jobs, nodes, gpus);
        let names = ["qa", "qb", "qc"];
        let specs: BTreeMap<_, _> = names
            .iter()
            .zip(&quotas)
            .map(|(n, (q, b))| spec(n, *q, *b))
            .collect();
        let mut views = inputs.views.clone();
        for (v, (q, c)) in views.iter_mut().zip(&marks) {
            v.queue = names[*q].parse().unwrap();
            v.priority = PriorityClass::ALL[*c];
        }
        let none = BTreeMap::new();
        for policy in ["fifo", "quality", "tiresias", "fair"] {
            let d = queued(&inputs, &views, policy, PlacementKind::FirstFit, &specs, &none);
            prop_assert!(!d.allocation.violates(&inputs.hosts), "{}", policy);
            let total: u32 = inputs.hosts.iter().map(|h| h.gpus.len() as u32).sum();
            let quota_sum: u32 = specs.values().map(|s| s.quota_gpus).sum();
            for (name, s) in &specs {
                let held = gpus_of(&d.allocation, &views, name.as_str());
                prop_assert!(held <= s.max_gpus(), "{}: {} holds {}", policy, name, held);
                let status = &d.statuses[name];
                prop_assert_eq!(status.gpus_in_use, held);
                // Borrowed GPUs are reclaimed only from a queue that held more than its
                // quota before the decision.
                let before: u32 = views
                    .iter()
                    .filter(|v| v.queue == *name)
                    .map(|v| v.placement.iter().map(|r| r.gpus.len() as u32).sum::<u32>())
                    .sum();
                for (id, why) in &d.preempted {
                    let mine = views.iter().any(|v| v.id == *id && v.queue == *name);
                    if mine && why.contains("over its fair share") && quota_sum <= total {
                        prop_assert!(before > s.quota_gpus, "{}: {} reclaimed from {} within quota", policy, id, name);
                    }
                }
            }
        }
    }

    /// A selector every host matches changes nothing: the decision is the one without
    /// selectors.
    #[test]
    fn a_selector_matching_every_host_changes_nothing(
        (seed, jobs, nodes, gpus, _selectors) in setup()
    ) {
        let inputs = inputs(seed, jobs, nodes, gpus);
        let everywhere: BTreeSet<HostId> = inputs.hosts.iter().map(|h| h.host.clone()).collect();
        let mut views = inputs.views.clone();
        for view in &mut views {
            view.hosts = Some(everywhere.clone());
        }
        for policy in POLICY_NAMES {
            for placement in [PlacementKind::FirstFit, PlacementKind::Bco] {
                let plain = run(&inputs, &inputs.views, policy, placement);
                let matched = run(&inputs, &views, policy, placement);
                prop_assert_eq!(&plain.workers, &matched.workers, "{} {:?}", policy, placement);
                prop_assert_eq!(&plain.placements, &matched.placements, "{} {:?}", policy, placement);
                prop_assert_eq!(&plain.batches, &matched.batches, "{} {:?}", policy, placement);
            }
        }
    }
}

/// A job whose spec allows a larger micro-batch on a GPU type gets plans in that
/// micro-batch when placed there, and the base one elsewhere: on the t4 host its plan keeps
/// micro-batches of at most 8 (larger totals by accumulation), on the a100 host, where 32
/// fit, it runs a larger micro-batch with fewer accumulation steps.
#[test]
fn a_micro_batch_per_gpu_type_shapes_the_plan_on_that_type() {
    let limits = BatchLimits::new(64, 1024, 4, 8).unwrap();
    let job = JobView {
        min_workers: 1,
        max_workers: 1,
        requested_workers: 1,
        model: Some(ThroughputModel::from_coefficients(
            [0.002, 0.05, 0.01, 0.1, 0.01],
            5,
        )),
        adaptive: Some(AdaptiveBatch {
            limits,
            max_per_worker_by_type: [("a100".to_string(), 32)].into(),
            gradient: GradientStats::new(64.0, 1e5),
        }),
        ..gang("j", "default", PriorityClass::Normal, 1, 0.0)
    };
    let plan_on = |gpu_type: &str| {
        let hosts = [HostFree::new("h".parse().unwrap(), vec![0]).with_gpu_type(gpu_type)];
        let quality = by_name("quality", PolicyParams::default()).unwrap();
        let d = decide(
            &cluster_at(10.0, &hosts),
            std::slice::from_ref(&job),
            quality.as_ref(),
            PlacementKind::FirstFit,
        );
        d.batches[&job.id]
    };
    let (t4, a100) = (plan_on("t4"), plan_on("a100"));
    assert!(t4.per_worker <= 8, "{t4:?}");
    assert!(a100.per_worker > 8 && a100.per_worker <= 32, "{a100:?}");
    assert!(a100.accum_steps < t4.accum_steps, "{t4:?} {a100:?}");
    // Without the entry the a100 host plans as the t4 one.
    let mut plain = job.clone();
    if let Some(a) = plain.adaptive.as_mut() {
        a.max_per_worker_by_type.clear();
    }
    let hosts = [HostFree::new("h".parse().unwrap(), vec![0]).with_gpu_type("a100")];
    let quality = by_name("quality", PolicyParams::default()).unwrap();
    let d = decide(
        &cluster_at(10.0, &hosts),
        &[plain],
        quality.as_ref(),
        PlacementKind::FirstFit,
    );
    assert_eq!(d.batches[&job.id], t4);
}

/// A job's own tables per GPU type: none for a job that names no micro-batch per type
/// (policies then scale its table by the speed factor); for one that does, computed on
/// first read, on a type twice as fast at computing faster than its own table at one worker
/// but by less than twice with workers on two hosts (synchronization kept), and faster
/// still where the type holds a larger micro-batch.
#[test]
fn type_tables_exist_for_jobs_with_micro_batches_per_type_and_keep_synchronization() {
    let model = ThroughputModel::from_coefficients([0.002, 0.05, 0.01, 0.1, 0.01], 5);
    let limits = BatchLimits::new(64, 1024, 4, 8).unwrap();
    let adaptive = |by_type: &[(&str, u32)]| AdaptiveBatch {
        limits,
        max_per_worker_by_type: by_type.iter().map(|&(t, m)| (t.to_string(), m)).collect(),
        gradient: GradientStats::new(64.0, 1e5),
    };
    let job = JobView {
        min_workers: 1,
        max_workers: 8,
        requested_workers: 1,
        model: Some(model.clone()),
        adaptive: Some(adaptive(&[])),
        ..gang("j", "default", PriorityClass::Normal, 1, 0.0)
    };
    let view = PolicyJob {
        goodput: Some(GoodputFn {
            model,
            gradient: GradientStats::new(64.0, 1e5),
            limits,
        }),
        throughput: Some(vec![1.0; 8]),
        ..crate::policies::test_support::job("j", 0.0, 1, 8)
    };
    let pool = |name: &str| GpuTypePool {
        name: Some(name.to_string()),
        gpus: 8,
        nodes: 2,
        gpus_per_node: 4,
    };
    let pools = [pool("t4"), pool("fast"), pool("big")];
    let types = JobTypes {
        factors: vec![Some(1.0), Some(2.0), Some(2.0)],
        current: None,
        eligible_gpus: vec![8, 8, 8],
        tables: Vec::new(),
    };
    let none = type_tables(&job, &view, &types, &pools, PlacementKind::FirstFit, 0.0);
    assert!(none.is_empty());
    let with = JobView {
        adaptive: Some(adaptive(&[("big", 32)])),
        ..job
    };
    let tables = type_tables(&with, &view, &types, &pools, PlacementKind::FirstFit, 0.0);
    let [Some(t4), Some(fast), Some(big)] = &tables[..] else {
        panic!("{tables:?}");
    };
    let (t4, fast, big) = (t4.get(), fast.get(), big.get());
    assert_eq!(t4.len(), 8);
    assert!(fast[0] > 1.5 * t4[0], "{t4:?} {fast:?}");
    assert!(fast[7] / t4[7] < fast[0] / t4[0], "{t4:?} {fast:?}");
    assert!(big[0] > fast[0], "{fast:?} {big:?}");
}

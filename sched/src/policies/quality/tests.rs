use super::*;
use crate::fit::{Curve, CurveFamily};
use crate::policies::test_support::make_current_feasible;
use proptest::prelude::*;

/// `job_value` of a job decided alone at time 0.
fn value_alone(job: &PolicyJob, workers: u32, params: &PolicyParams) -> f64 {
    job_value(job, workers, params, &job_terms(&[job], 0.0, params)[0])
}

fn id(name: &str) -> JobId {
    JobId::new(name).unwrap()
}

/// A pending job without history: 1 GPU per worker, 1 to `max_workers` workers.
fn job(name: &str, max_workers: u32) -> PolicyJob {
    crate::policies::test_support::job(name, 0.0, max_workers, max_workers)
}

/// `0.33 + 0.36/(1 + k/2000)` in the inv_linear form: far from converged at `k = 0`.
fn steep_curve() -> Curve {
    Curve {
        family: CurveFamily::InvLinear,
        params: vec![1.0 / (0.36 * 2000.0), 1.0 / 0.36, 0.33],
        rmse: 0.0,
        points: 100,
    }
}

/// A constant loss of 0.33: converged.
fn flat_curve() -> Curve {
    Curve {
        family: CurveFamily::InvLinear,
        params: vec![0.0, 1e6, 0.33],
        rmse: 0.0,
        points: 100,
    }
}

fn with_curve(mut job: PolicyJob, curve: Curve) -> PolicyJob {
    job.curve = Some(curve);
    job.loss_scale = 0.36;
    job.samples_per_s_per_worker = Some(100.0);
    job
}

fn running(mut job: PolicyJob, workers: u32) -> PolicyJob {
    job.current_workers = workers;
    job
}

/// SLAQ's objective (most tests below are about it).
fn slaq() -> PolicyParams {
    PolicyParams {
        objective: Objective::Loss,
        ..PolicyParams::default()
    }
}

/// A cluster of `total_gpus` GPUs at time 0.
fn view(total_gpus: u32) -> ClusterView {
    ClusterView {
        total_gpus,
        gpus_per_node: 8,
        now: 0.0,
    }
}

fn workers_of(decision: &Decision, name: &str) -> u32 {
    decision.workers[&id(name)]
}

/// Runs the policy `rounds` times, each round starting from the previous decision.
fn settle(
    total_gpus: u32,
    jobs: &[PolicyJob],
    params: &PolicyParams,
    rounds: usize,
) -> Vec<Decision> {
    let mut jobs = jobs.to_vec();
    let mut decisions = Vec::new();
    for _ in 0..rounds {
        let decision = quality_allocate(&view(total_gpus), &jobs, params);
        for job in &mut jobs {
            job.current_workers = decision.workers[&job.id];
        }
        decisions.push(decision);
    }
    decisions
}

#[test]
fn value_is_zero_without_workers_and_pays_the_restart() {
    let params = slaq();
    for j in [job("new", 8), with_curve(job("fitted", 8), steep_curve())] {
        assert_eq!(value_alone(&j, 0, &params), 0.0);
        let moving = value_alone(&j, 2, &params);
        let staying = value_alone(&running(j.clone(), 2), 2, &params);
        assert!(moving > 0.0 && staying > moving, "{moving} {staying}");
    }
    // Without a curve the restart costs the fraction restart/horizon of the gain.
    let new = job("new", 8);
    assert!((value_alone(&new, 1, &params) - 0.5 * 0.5).abs() < 1e-12);
    // With a curve the value is the normalized predicted drop over w·r·T samples.
    let fitted = running(with_curve(job("fitted", 8), steep_curve()), 2);
    let curve = steep_curve();
    let expected = (curve.predict(0.0) - curve.predict(2.0 * 100.0 * 60.0)) / 0.36;
    assert!((value_alone(&fitted, 2, &params) - expected).abs() < 1e-12);
    // A restart as long as the horizon leaves nothing to gain by changing.
    let costly = PolicyParams {
        restart_cost_s: 60.0,
        ..params
    };
    assert_eq!(value_alone(&fitted, 3, &costly), 0.0);
}

#[test]
fn new_jobs_get_gpus_before_converged_ones() {
    let converged = running(with_curve(job("converged", 8), flat_curve()), 4);
    let new = job("new", 8);
    let decision = quality_allocate(&view(8), &[converged, new], &slaq());
    assert_eq!(workers_of(&decision, "converged"), 1);
    assert_eq!(workers_of(&decision, "new"), 7);
}

#[test]
fn jobs_without_a_curve_get_only_what_fitted_jobs_leave() {
    let steep = running(with_curve(job("steep", 6), steep_curve()), 4);
    let new = job("new", 8);
    let free_restarts = PolicyParams {
        restart_cost_s: 0.0,
        ..slaq()
    };
    let decision = quality_allocate(&view(8), &[steep.clone(), new.clone()], &free_restarts);
    assert_eq!(workers_of(&decision, "new"), 2, "{decision:?}");
    assert_eq!(workers_of(&decision, "steep"), 6);
    // Alone, the new job takes every idle GPU (work conservation).
    let decision = quality_allocate(&view(8), &[new], &slaq());
    assert_eq!(workers_of(&decision, "new"), 8);
}

#[test]
fn converged_job_keeps_its_gpus_when_nobody_needs_them() {
    let converged = running(with_curve(job("converged", 8), flat_curve()), 4);
    let decision = quality_allocate(&view(8), &[converged], &slaq());
    assert_eq!(workers_of(&decision, "converged"), 4);
}

#[test]
fn growth_must_beat_the_restart_cost() {
    // From 2 to 3 workers: 3·30 s of work instead of 2·60 s, so it is not worth it.
    let steady = running(with_curve(job("steady", 3), steep_curve()), 2);
    let params = slaq();
    assert_eq!(
        workers_of(
            &quality_allocate(&view(8), std::slice::from_ref(&steady), &params),
            "steady"
        ),
        2
    );
    // Without a restart cost the extra worker is taken.
    let free_restarts = PolicyParams {
        restart_cost_s: 0.0,
        ..params
    };
    assert_eq!(
        workers_of(
            &quality_allocate(&view(8), std::slice::from_ref(&steady), &free_restarts),
            "steady"
        ),
        3
    );
    // A big jump does beat the restart: 8 workers for 30 s beat 2 for 60 s.
    let mut wide = steady;
    wide.max_workers = 8;
    assert_eq!(
        workers_of(&quality_allocate(&view(8), &[wide], &params), "steady"),
        8
    );
}

#[test]
fn running_jobs_are_admitted_first() {
    let mut old = running(job("old", 4), 4);
    old.min_workers = 4;
    old.submitted_at = 10.0;
    let early_pending = job("early", 4);
    let decision = quality_allocate(&view(4), &[early_pending.clone(), old.clone()], &slaq());
    assert_eq!(workers_of(&decision, "old"), 4);
    assert_eq!(workers_of(&decision, "early"), 0);
    // Capacity shrank below the running job's minimum: it is stopped, the other fits.
    let decision = quality_allocate(&view(3), &[early_pending, old], &slaq());
    assert_eq!(workers_of(&decision, "old"), 0);
    assert_eq!(workers_of(&decision, "early"), 3);
}

#[test]
fn under_loss_an_arrival_displaces_a_running_job_whose_curve_is_flat() {
    // `flat` runs on the only GPU and its curve predicts almost nothing more.
    let flat_curve = Curve {
        family: CurveFamily::InvLinear,
        params: vec![1e-6, 1e-3, 0.1],
        rmse: 0.0,
        points: 50,
    };
    let mut flat = running(with_curve(job("flat", 1), flat_curve), 1);
    flat.samples = 1e9;
    flat.loss_scale = 1.0;
    let arrival = job("new", 1);
    let decision = quality_allocate(&view(1), &[flat.clone(), arrival.clone()], &slaq());
    assert_eq!(workers_of(&decision, "new"), 1);
    assert_eq!(workers_of(&decision, "flat"), 0);
    // Deciding again on the applied decision changes nothing.
    let (mut flat, mut arrival) = (flat, arrival);
    flat.current_workers = 0;
    arrival.current_workers = 1;
    let again = quality_allocate(&view(1), &[flat.clone(), arrival.clone()], &slaq());
    assert_eq!(workers_of(&again, "new"), 1);
    // Under the default (`jct` for jobs that are not exploratory), running jobs keep their
    // place.
    let default = PolicyParams::default();
    flat.current_workers = 1;
    arrival.current_workers = 0;
    let decision = quality_allocate(&view(1), &[flat, arrival], &default);
    assert_eq!(workers_of(&decision, "flat"), 1);
}

#[test]
fn jobs_that_can_never_run_get_nothing() {
    let mut no_gpus = job("no-gpus", 4);
    no_gpus.gpus_per_worker = 0;
    let mut inverted = job("inverted", 2);
    inverted.min_workers = 3;
    let decision = quality_allocate(&view(16), &[no_gpus, inverted], &slaq());
    assert_eq!(workers_of(&decision, "no-gpus"), 0);
    assert_eq!(workers_of(&decision, "inverted"), 0);
}

#[test]
fn gpus_go_in_whole_workers() {
    let mut wide = job("wide", 8);
    wide.gpus_per_worker = 3;
    let decision = quality_allocate(&view(10), &[wide], &slaq());
    assert_eq!(workers_of(&decision, "wide"), 3);
}

#[test]
fn decisions_do_not_flap() {
    let mut pending_wide = with_curve(job("wide", 4), steep_curve());
    pending_wide.gpus_per_worker = 2;
    pending_wide.submitted_at = 3.0;
    let mut late_new = job("late-new", 4);
    late_new.submitted_at = 4.0;
    let jobs = [
        running(with_curve(job("steep", 8), steep_curve()), 2),
        running(with_curve(job("converged", 4), flat_curve()), 4),
        pending_wide,
        late_new,
    ];
    for total_gpus in [4, 8, 12, 16, 24] {
        let decisions = settle(total_gpus, &jobs, &slaq(), 4);
        assert_eq!(decisions[1], decisions[0], "{total_gpus} GPUs");
        assert_eq!(decisions[3], decisions[0], "{total_gpus} GPUs");
    }
}

fn arbitrary_curve() -> impl Strategy<Value = Option<Curve>> {
    let curve = |family, params: Vec<f64>| {
        Some(Curve {
            family,
            params,
            rmse: 0.0,
            points: 10,
        })
    };
    prop_oneof![
        Just(None),
        (0.0..1e-2f64, 0.1..10.0f64, 0.0..1.0f64)
            .prop_map(move |(a, b, c)| curve(CurveFamily::InvLinear, vec![a, b, c])),
        (0.0..1e-6f64, 0.0..1e-2f64, 0.1..10.0f64, 0.0..1.0f64)
            .prop_map(move |(a, b, c, d)| curve(CurveFamily::InvQuadratic, vec![a, b, c, d])),
        (0.0..1e-3f64, 0.0..1.0f64, 0.0..5.0f64)
            .prop_map(move |(a, b, amplitude)| curve(CurveFamily::Exp, vec![a, b, amplitude])),
    ]
}

/// A job as the property tests see it; `current_workers` is made feasible by [`cluster`].
fn arbitrary_job(index: usize) -> impl Strategy<Value = PolicyJob> {
    (
        (1u32..=4, 0u32..=4, 0u32..=8, 0u32..=8),
        0u32..6,
        arbitrary_curve(),
        (0.0..1e5f64, prop_oneof![Just(0.0), 0.01..2.0f64]),
        prop::option::of(0.0..500.0f64),
        (
            prop::option::of(prop::collection::vec(
                prop_oneof![Just(0.0), Just(f64::NAN), 0.0..1e4f64],
                0..10,
            )),
            prop::option::of(prop_oneof![Just(f64::NAN), Just(-1.0), 0.0..1e7f64]),
        ),
        any::<bool>(),
    )
        .prop_map(
            move |(
                (gpus_per_worker, min, extra, current),
                submitted,
                curve,
                (samples, loss_scale),
                rate,
                (throughput, remaining_work),
                exploratory,
            )| {
                PolicyJob {
                    gpus_per_worker,
                    min_workers: min,
                    // Now and then a maximum below the minimum (an invalid job).
                    max_workers: if extra == 0 {
                        min.saturating_sub(1)
                    } else {
                        min + extra
                    },
                    current_workers: current,
                    submitted_at: f64::from(submitted),
                    curve,
                    samples,
                    loss_scale,
                    samples_per_s_per_worker: rate,
                    requested_workers: min + extra,
                    throughput,
                    remaining_work,
                    exploratory,
                    ..PolicyJob::new(JobId::new(format!("job-{index}")).unwrap())
                }
            },
        )
}

/// A running job of `max` 1-GPU workers with a throughput table and known remaining work.
fn sized(name: &str, max: u32, table: &[f64], remaining: f64) -> PolicyJob {
    let mut j = job(name, max);
    j.throughput = Some(table.to_vec());
    j.remaining_work = Some(remaining);
    j
}

#[test]
fn completion_objective_favours_the_job_closest_to_done() {
    let params = PolicyParams {
        objective: Objective::Jct,
        restart_cost_s: 0.0,
        ..slaq()
    };
    let linear = [100.0, 200.0, 300.0, 400.0];
    let short = sized("short", 4, &linear, 1e5);
    let long = sized("long", 4, &linear, 1e7);
    // 5 GPUs: each gets one, the short job the rest (shortest remaining first).
    let decision = quality_allocate(&view(5), &[long.clone(), short.clone()], &params);
    assert_eq!(workers_of(&decision, "short"), 4);
    assert_eq!(workers_of(&decision, "long"), 1);
    // A job that does not scale gets no extra GPU even if it is the shortest.
    let flat = sized("flat", 4, &[100.0, 100.0, 100.0, 100.0], 1e5);
    let decision = quality_allocate(&view(5), &[long, flat], &params);
    assert_eq!(workers_of(&decision, "flat"), 1);
    assert_eq!(workers_of(&decision, "long"), 4);
}

#[test]
fn completion_weights_follow_hesrpt_ranks() {
    let params = PolicyParams {
        objective: Objective::Jct,
        ..PolicyParams::default()
    };
    let linear = [100.0, 200.0, 300.0, 400.0];
    let jobs: Vec<PolicyJob> = [1e7, 1e5, 1e6, 1e4]
        .iter()
        .enumerate()
        .map(|(i, &work)| sized(&format!("j{i}"), 4, &linear, work))
        .collect();
    let refs: Vec<&PolicyJob> = jobs.iter().collect();
    let terms = job_terms(&refs, 0.0, &params);
    let w: Vec<f64> = terms.iter().map(|t| t.completion_weight).collect();
    // Less remaining time, more weight: j3 (1e4) > j1 (1e5) > j2 (1e6) > j0 (1e7).
    assert!(w[3] > w[1] && w[1] > w[2] && w[2] > w[0], "{w:?}");
    // The weights are heSRPT's shares: Σ weight^c / m = Σ θ = 1.
    let c = 1.0 / (1.0 - params.speedup_exponent);
    let sum: f64 = w.iter().map(|x| x.powf(c)).sum::<f64>() / w.len() as f64;
    assert!((sum - 1.0).abs() < 1e-9, "{sum}");
    // One job alone has an equal share: weight 1.
    assert!((job_terms(&refs[..1], 0.0, &params)[0].completion_weight - 1.0).abs() < 1e-12);
}

#[test]
fn the_restart_budget_limits_restarts_to_a_share_of_age() {
    let params = PolicyParams::default();
    let charged = params.restart_cost_s / params.restart_budget;
    let mut j = running(sized("j", 8, &[100.0, 200.0, 300.0, 400.0], 1e7), 2);
    let factor = |j: &PolicyJob, now: f64| job_terms(&[j], now, &params)[0].change_factor;
    // Young: changing is worth little; old: nearly all of it.
    assert_eq!(factor(&j, 0.0), 0.0);
    assert!((factor(&j, 1e5) - 1e5 / (1e5 + charged)).abs() < 1e-12);
    // Every restart is charged δ/ρ of age: past the budget, nothing.
    j.restarts = 10;
    assert_eq!(factor(&j, 10.0 * charged), 0.0);
    // A job's own measured restart cost replaces the configured one.
    j.restarts = 1;
    j.restart_cost_s = Some(0.0);
    assert!((factor(&j, 100.0) - 1.0).abs() < 1e-12);
    // Past its budget a running job keeps its size even though growing would pay.
    let mut busy = running(sized("busy", 4, &[100.0, 200.0, 300.0, 400.0], 1e7), 1);
    busy.restarts = 3;
    let cluster = ClusterView {
        now: 3.0 * charged,
        ..view(4)
    };
    assert_eq!(
        workers_of(
            &quality_allocate(&cluster, &[busy.clone()], &params),
            "busy"
        ),
        1
    );
    busy.restarts = 0;
    assert_eq!(
        workers_of(&quality_allocate(&cluster, &[busy], &params), "busy"),
        4
    );
}

#[test]
fn the_throughput_table_replaces_linear_scaling() {
    let params = PolicyParams {
        objective: Objective::Jct,
        ..slaq()
    };
    let j = sized("j", 8, &[100.0, 150.0], 1e6);
    assert_eq!(throughput(&j, 1, &params), 100.0);
    assert_eq!(throughput(&j, 2, &params), 150.0);
    // Beyond the table, its last entry.
    assert_eq!(throughput(&j, 8, &params), 150.0);
    let broken = sized("broken", 8, &[f64::NAN, -5.0], 1e6);
    assert_eq!(throughput(&broken, 1, &params), 0.0);
    assert_eq!(throughput(&broken, 2, &params), 0.0);
    // Without a table: linear at the measured rate, else the prior.
    let mut plain = job("plain", 8);
    assert_eq!(throughput(&plain, 3, &params), 300.0);
    plain.samples_per_s_per_worker = Some(7.0);
    assert_eq!(throughput(&plain, 3, &params), 21.0);
}

#[test]
fn unknown_remaining_work_is_guessed_from_the_work_done() {
    let params = PolicyParams {
        objective: Objective::Jct,
        ..slaq()
    };
    let mut j = job("j", 4);
    j.samples = 1e6;
    assert_eq!(remaining_work(&j, &params), 1e6);
    // At least one horizon at one worker's rate (100 samples/s × 60 s).
    j.samples = 10.0;
    assert_eq!(remaining_work(&j, &params), 6000.0);
    j.remaining_work = Some(f64::NAN);
    assert_eq!(remaining_work(&j, &params), 6000.0);
    j.remaining_work = Some(5e5);
    assert_eq!(remaining_work(&j, &params), 5e5);
}

#[test]
fn both_adds_the_two_values() {
    // At its current size, where no restart factor applies.
    let fitted = running(with_curve(job("fitted", 8), steep_curve()), 2);
    let value = |objective| {
        value_alone(
            &fitted,
            2,
            &PolicyParams {
                objective,
                ..slaq()
            },
        )
    };
    let (loss, jct, both) = (
        value(Objective::Loss),
        value(Objective::Jct),
        value(Objective::Both),
    );
    assert!(loss > 0.0 && jct > 0.0);
    assert!((both - (loss + jct)).abs() < 1e-12);
}

#[test]
fn a_job_waiting_past_max_wait_is_admitted_before_running_ones() {
    let params = PolicyParams {
        max_wait_s: 600.0,
        ..PolicyParams::default()
    };
    let mut old = running(job("old", 4), 4);
    old.min_workers = 4;
    let mut waiting = job("waiting", 4);
    waiting.min_workers = 4;
    waiting.submitted_at = 100.0;
    let at = |now| ClusterView { now, ..view(4) };
    let decision = quality_allocate(&at(500.0), &[old.clone(), waiting.clone()], &params);
    assert_eq!(workers_of(&decision, "old"), 4);
    assert_eq!(workers_of(&decision, "waiting"), 0);
    let decision = quality_allocate(&at(700.0), &[old.clone(), waiting.clone()], &params);
    assert_eq!(workers_of(&decision, "old"), 0);
    assert_eq!(workers_of(&decision, "waiting"), 4);
    // A job that ran before (preempted) waits for its turn: no preemption chain.
    let preempted = PolicyJob {
        attained_gpu_seconds: 60.0,
        ..waiting
    };
    let decision = quality_allocate(&at(700.0), &[old, preempted], &params);
    assert_eq!(workers_of(&decision, "old"), 4);
    assert_eq!(workers_of(&decision, "waiting"), 0);
}

/// Pools of one node each, `(name, GPUs)`.
fn one_node_pools(pools: &[(&str, u32)]) -> Vec<crate::policies::GpuTypePool> {
    pools
        .iter()
        .map(|&(name, g)| crate::policies::GpuTypePool {
            name: Some(name.to_owned()),
            gpus: g,
            nodes: 1,
            gpus_per_node: g,
        })
        .collect()
}

/// A job sized for slow GPUs that only the slow type could hold at that size goes to a
/// small pool of GPUs four times as fast, where a quarter as many give it the same
/// throughput: the assignment counts a job's GPUs on a faster type at equal throughput
/// (`workers_on_type`). Counting its slow-type size everywhere left it on the slow type.
#[test]
fn a_job_sized_for_slow_gpus_fits_a_small_pool_of_fast_ones() {
    let pools = one_node_pools(&[("slow", 16), ("fast", 4)]);
    let mut j = job("bert", 16);
    j.throughput = Some((1..=16).map(|w| 100.0 * f64::from(w)).collect());
    j.remaining_work = Some(1e9);
    let types = [crate::policies::JobTypes {
        factors: vec![Some(1.0), Some(4.0)],
        current: None,
        eligible_gpus: vec![16, 4],
        tables: Vec::new(),
    }];
    // Old enough that its restart budget lets it grow.
    let cluster = ClusterView {
        total_gpus: 20,
        gpus_per_node: 16,
        now: 1e5,
    };
    let jobs = [j];
    // Steps 1–4 size it as on one pool: more GPUs than the fast type has.
    let (_, first) = quality_sizes(&cluster, &jobs, &PolicyParams::default());
    assert!(first[0] > 4, "sized {}", first[0]);
    let d = Quality::default()
        .allocate_on_types(&cluster, &pools, &jobs, &types)
        .unwrap();
    let id = &jobs[0].id;
    assert_eq!(d.types.get(id), Some(&1), "{d:?}");
    assert_eq!(d.workers[id], 4, "{d:?}");
    assert_eq!(workers_on_type(&jobs[0], &types[0], 16, None, 1), 4);
    assert_eq!(workers_on_type(&jobs[0], &types[0], 16, None, 0), 16);
    // Sized in workers of the fast type already: no second division.
    assert_eq!(workers_on_type(&jobs[0], &types[0], 4, Some(1), 1), 4);
}

/// Equal-throughput sizes never go below the job's minimum nor above its size, count from
/// the type the size is in, and assume nothing of a type without a figure.
#[test]
fn workers_on_a_faster_type_stay_between_the_minimum_and_the_size() {
    let mut j = job("j", 8);
    j.min_workers = 3;
    let jt = crate::policies::JobTypes {
        factors: vec![Some(2.0), Some(100.0), Some(0.5), None],
        current: None,
        eligible_gpus: vec![8, 8, 8, 8],
        tables: Vec::new(),
    };
    assert_eq!(workers_on_type(&j, &jt, 8, None, 0), 4);
    assert_eq!(workers_on_type(&j, &jt, 8, None, 1), 3);
    assert_eq!(workers_on_type(&j, &jt, 2, None, 1), 2);
    assert_eq!(workers_on_type(&j, &jt, 8, None, 2), 8);
    // 8 workers of type 0 are 16 at the table's speed: type 1 is 50 times type 0.
    assert_eq!(workers_on_type(&j, &jt, 8, Some(0), 1), 3);
    assert_eq!(workers_on_type(&j, &jt, 8, Some(1), 0), 8);
    assert_eq!(workers_on_type(&j, &jt, 8, Some(0), 0), 8);
    // A type without a figure is not assumed faster, although every known one is.
    assert_eq!(workers_on_type(&j, &jt, 8, None, 3), 8);
}

fn objectives() -> impl Strategy<Value = Objective> {
    prop_oneof![
        Just(Objective::Loss),
        Just(Objective::Jct),
        Just(Objective::Both),
        Just(Objective::Auto)
    ]
}

/// [`cluster`] with every throughput table replaced by one a throughput model gives:
/// increasing and concave in workers (Amdahl's law, `r·k / (1 + s·(k − 1))`, `r` the
/// one-worker rate, `s` the serial share). The greedy hand-out is exact for such
/// diminishing returns; on arbitrary tables (nothing until the seventh worker, then
/// much) no greedy is, and applying its decision can make a better one visible.
fn realistic_cluster() -> impl Strategy<Value = (u32, Vec<PolicyJob>)> {
    (
        cluster(),
        prop::collection::vec((1.0..1e4f64, 0.0..1.0f64), 20),
    )
        .prop_map(|((total_gpus, mut jobs), shapes)| {
            for (job, (rate, serial)) in jobs.iter_mut().zip(shapes) {
                if let Some(table) = &mut job.throughput {
                    *table = (1..=table.len())
                        .map(|k| rate * k as f64 / (1.0 + serial * (k as f64 - 1.0)))
                        .collect();
                }
            }
            (total_gpus, jobs)
        })
}

/// A cluster of 0..64 GPUs with 0..20 jobs whose current allocations fit.
fn cluster() -> impl Strategy<Value = (u32, Vec<PolicyJob>)> {
    (0u32..64, 0usize..20).prop_flat_map(|(total_gpus, count)| {
        let jobs: Vec<_> = (0..count).map(arbitrary_job).collect();
        jobs.prop_map(move |mut jobs| {
            make_current_feasible(total_gpus, &mut jobs);
            (total_gpus, jobs)
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// On several GPU types, whatever the jobs, their speeds and where they run: no
    /// type hands out more GPUs than it has, every job with workers has a type it may
    /// use with room for them, and sizes stay within each job's bounds.
    #[test]
    fn on_several_types_no_type_is_oversubscribed(
        specs in proptest::collection::vec(
            (1u32..=8, 0u32..=8, 0usize..3, proptest::collection::vec(0.2f64..8.0, 3),
             proptest::option::of(0usize..3), 1u32..=2),
            1..14,
        ),
        gpus in proptest::collection::vec(1u32..=16, 3),
    ) {
        let pools: Vec<crate::policies::GpuTypePool> = gpus
            .iter()
            .enumerate()
            .map(|(k, &g)| crate::policies::GpuTypePool {
                name: Some(format!("t{k}")),
                gpus: g,
                nodes: 1,
                gpus_per_node: g,
            })
            .collect();
        let mut jobs = Vec::new();
        let mut types = Vec::new();
        for (n, (max, current, on, factors, limited, per_worker)) in specs.iter().enumerate() {
            let mut j = job(&format!("j{n}"), *max);
            j.gpus_per_worker = *per_worker;
            j.throughput = Some((1..=*max).map(|w| f64::from(w).sqrt() * 100.0).collect());
            j.remaining_work = Some(1e5 * (n + 1) as f64);
            j.submitted_at = n as f64;
            let runs = *current > 0 && current * per_worker <= gpus[*on];
            if runs {
                j.current_workers = (*current).min(*max);
                j.attained_gpu_seconds = 100.0;
            }
            jobs.push(j);
            types.push(crate::policies::JobTypes {
                factors: factors.iter().map(|&f| Some(f)).collect(),
                current: runs.then_some(*on),
                eligible_gpus: gpus
                    .iter()
                    .enumerate()
                    .map(|(k, &g)| if Some(k) == *limited { 0 } else { g })
                    .collect(),
                tables: Vec::new(),
            });
        }
        let cluster = ClusterView {
            total_gpus: gpus.iter().sum(),
            gpus_per_node: 16,
            now: 1000.0,
        };
        let policy = Quality::default();
        let d = policy.allocate_on_types(&cluster, &pools, &jobs, &types).unwrap();
        let mut used = [0u32; 3];
        for (i, j) in jobs.iter().enumerate() {
            let w = d.workers[&j.id];
            match d.types.get(&j.id) {
                Some(&t) => {
                    prop_assert!(w >= 1 && w <= j.max_workers, "{}: {w}", j.id);
                    prop_assert!(types[i].eligible_gpus[t] >= w * j.gpus_per_worker);
                    used[t] += w * j.gpus_per_worker;
                }
                None => prop_assert_eq!(w, 0, "{} has workers but no type", j.id),
            }
        }
        for t in 0..3 {
            prop_assert!(used[t] <= gpus[t], "type {t}: {} of {}", used[t], gpus[t]);
        }
    }

    #[test]
    fn decisions_respect_capacity_and_bounds(
        (total_gpus, jobs) in cluster(),
        restart_cost_s in prop_oneof![Just(30.0), 0.0..120.0f64],
        objective in objectives(),
        now in prop_oneof![Just(0.0), 0.0..1e4f64],
    ) {
        let params = PolicyParams { restart_cost_s, objective, max_wait_s: 100.0, ..slaq() };
        let cluster = ClusterView { now, ..view(total_gpus) };
        let decision = quality_allocate(&cluster, &jobs, &params);
        for job in &jobs {
            let v = value_alone(job, decision.workers[&job.id], &params);
            prop_assert!(v.is_finite() && v >= 0.0, "{} valued {}", job.id, v);
        }
        prop_assert_eq!(decision.workers.len(), jobs.len());
        let mut used = 0u64;
        for job in &jobs {
            let workers = decision.workers[&job.id];
            used += gpus(job, workers);
            prop_assert!(
                workers == 0 || (job.min_workers.max(1) <= workers && workers <= job.max_workers),
                "{} got {} workers", job.id, workers
            );
        }
        prop_assert!(used <= u64::from(total_gpus));
    }

    /// The default objective decides as `loss` when every job is exploratory and as `jct`
    /// when none is; on a mix each job is valued by its own objective and the decision
    /// keeps to capacity and bounds.
    #[test]
    fn auto_decides_as_loss_on_exploratory_jobs_and_as_jct_on_the_others(
        (total_gpus, jobs) in cluster(),
        mix in prop::collection::vec(any::<bool>(), 20),
        now in prop_oneof![Just(0.0), 0.0..1e4f64],
    ) {
        let cluster = ClusterView { now, ..view(total_gpus) };
        let with = |objective| PolicyParams { objective, max_wait_s: 100.0, ..slaq() };
        let auto = with(Objective::Auto);
        let jobs: Vec<PolicyJob> = jobs
            .iter()
            .map(|j| PolicyJob { exploratory: false, ..j.clone() })
            .collect();
        prop_assert_eq!(
            quality_allocate(&cluster, &jobs, &auto),
            quality_allocate(&cluster, &jobs, &with(Objective::Jct))
        );
        let trials: Vec<PolicyJob> = jobs
            .iter()
            .map(|j| PolicyJob { exploratory: true, ..j.clone() })
            .collect();
        prop_assert_eq!(
            quality_allocate(&cluster, &trials, &auto),
            quality_allocate(&cluster, &trials, &with(Objective::Loss))
        );
        let mixed: Vec<PolicyJob> = jobs
            .iter()
            .zip(mix)
            .map(|(j, exploratory)| PolicyJob { exploratory, ..j.clone() })
            .collect();
        let decision = quality_allocate(&cluster, &mixed, &auto);
        let mut used = 0u64;
        for job in &mixed {
            let workers = decision.workers[&job.id];
            used += gpus(job, workers);
            prop_assert!(
                workers == 0 || (job.min_workers.max(1) <= workers && workers <= job.max_workers),
                "{} got {} workers", job.id, workers
            );
            let v = value_alone(job, workers, &auto);
            prop_assert!(v.is_finite() && v >= 0.0, "{} valued {}", job.id, v);
        }
        prop_assert!(used <= u64::from(total_gpus));
    }

    #[test]
    fn decisions_are_deterministic_and_ignore_input_order(
        (total_gpus, jobs, shuffled) in cluster().prop_flat_map(|(total_gpus, jobs)| {
            (Just(total_gpus), Just(jobs.clone()), Just(jobs).prop_shuffle())
        }),
        objective in objectives(),
    ) {
        let params = PolicyParams { objective, ..slaq() };
        let decision = quality_allocate(&view(total_gpus), &jobs, &params);
        prop_assert_eq!(&decision, &quality_allocate(&view(total_gpus), &jobs, &params));
        prop_assert_eq!(&decision, &quality_allocate(&view(total_gpus), &shuffled, &params));
    }

    #[test]
    fn applying_a_decision_and_deciding_again_changes_nothing(
        (total_gpus, jobs) in realistic_cluster(),
        restart_cost_s in 0.0..100.0f64,
        objective in objectives(),
    ) {
        let params = PolicyParams { restart_cost_s, objective, ..slaq() };
        let decisions = settle(total_gpus, &jobs, &params, 3);
        prop_assert_eq!(&decisions[1], &decisions[0]);
        prop_assert_eq!(&decisions[2], &decisions[0]);
    }

    #[test]
    fn a_restart_as_long_as_the_horizon_changes_nothing(
        (total_gpus, mut jobs) in cluster(),
        restart_cost_s in 60.0..1000.0f64,
    ) {
        jobs.retain(|j| j.current_workers > 0);
        let params = PolicyParams { restart_cost_s, ..slaq() };
        let decision = quality_allocate(&view(total_gpus), &jobs, &params);
        for job in &jobs {
            prop_assert_eq!(decision.workers[&job.id], job.current_workers, "{}", job.id);
        }
    }

    #[test]
    fn a_lone_steep_job_gets_its_maximum(
        gpus_per_worker in 1u32..=4,
        min_workers in 1u32..=4,
        extra in 0u32..=12,
        current in prop::option::of(0u32..=16),
        spare_gpus in 0u32..8,
        samples in 0.0..2000.0f64,
    ) {
        let max_workers = min_workers + extra;
        let mut steep = with_curve(job("steep", max_workers), steep_curve());
        steep.gpus_per_worker = gpus_per_worker;
        steep.min_workers = min_workers;
        steep.samples = samples;
        // A pending job, or a running one whose growth costs no restart (with a restart,
        // growing by little can rightly lose to staying: see growth_must_beat_the_restart_cost).
        steep.current_workers = current.map_or(0, |c| c.clamp(min_workers, max_workers));
        let restart_cost_s = if current.is_some() { 0.0 } else { 30.0 };
        let params = PolicyParams { restart_cost_s, ..slaq() };
        let total_gpus = max_workers * gpus_per_worker + spare_gpus;
        let decision = quality_allocate(&view(total_gpus), &[steep], &params);
        prop_assert_eq!(workers_of(&decision, "steep"), max_workers);
    }

    #[test]
    fn a_converged_job_stays_at_its_minimum_while_a_steep_one_wants_gpus(
        (flat_min, flat_extra, flat_current) in (1u32..=3, 0u32..=4, 0u32..=7),
        (steep_max, gpus_per_worker) in (1u32..=16, 1u32..=2),
        flat_first in any::<bool>(),
    ) {
        let mut flat = with_curve(job("flat", flat_min + flat_extra), flat_curve());
        flat.min_workers = flat_min;
        flat.current_workers = if flat_current == 0 { 0 } else { flat_current.clamp(flat_min, flat.max_workers) };
        flat.submitted_at = if flat_first { 0.0 } else { 1.0 };
        let mut steep = with_curve(job("steep", steep_max), steep_curve());
        steep.gpus_per_worker = gpus_per_worker;
        steep.submitted_at = if flat_first { 1.0 } else { 0.0 };
        // The steep job alone could use every GPU the flat one does not need at minimum.
        let total_gpus = flat_min + steep_max * gpus_per_worker;
        let decision = quality_allocate(&view(total_gpus), &[flat, steep], &slaq());
        prop_assert!(workers_of(&decision, "flat") <= flat_min, "{:?}", decision);
        prop_assert_eq!(workers_of(&decision, "steep"), steep_max);
    }
}

/// A sweep trial on 8 free GPUs grows only as far as its per-GPU throughput holds
/// (`trial_growth_efficiency`, default 1), from the workers it runs with or, pending, from
/// its minimum, and not beyond its requested size before a step time is measured; a job
/// that is not exploratory with the same table and objective, or the trial with the rule
/// off, takes the GPUs a speedup below linear (or the linear prior) still gains from.
#[test]
fn a_trial_grows_only_while_its_per_gpu_throughput_holds() {
    // SLAQ's objective for every job, and free restarts: any gain is worth a change, so
    // only the rule limits growth.
    let params = PolicyParams {
        restart_cost_s: 0.0,
        ..slaq()
    };
    // Linear to 2 workers, then below linear: 100, 200, 240, 260 … samples/s.
    let table = [100.0, 200.0, 240.0, 260.0, 270.0, 275.0, 278.0, 280.0];
    let trial = |exploratory: bool| {
        let mut j = running(with_curve(job("t", 8), steep_curve()), 1);
        j.throughput = Some(table.to_vec());
        j.exploratory = exploratory;
        j
    };
    let decide = |job: PolicyJob, params: &PolicyParams| {
        workers_of(&quality_allocate(&view(8), &[job], params), "t")
    };
    assert_eq!(
        decide(trial(true), &params),
        2,
        "linear growth is GPU-hours neutral"
    );
    assert_eq!(
        decide(trial(false), &params),
        8,
        "a job that is not a trial grows"
    );
    let off = PolicyParams {
        trial_growth_efficiency: 0.0,
        ..params
    };
    assert_eq!(
        decide(trial(true), &off),
        8,
        "with the rule off a trial grows"
    );
    // Pending, it starts at its minimum and grows from there alike.
    assert_eq!(decide(running(trial(true), 0), &params), 2);
    // Already at 4 (say its table was refitted since): it keeps its 4 and grows no further.
    assert_eq!(decide(running(trial(true), 4), &params), 4);
    // Half the per-GPU throughput of 1 worker is 50 samples/s: up to 5 workers (54).
    let half = PolicyParams {
        trial_growth_efficiency: 0.5,
        ..params
    };
    assert_eq!(decide(trial(true), &half), 5);
    // Without a table (no step time measured) only the linear prior speaks for growth:
    // the trial keeps its workers, a pending one starts at the `workers` its spec sets
    // (or, unset, at its minimum: the default request, `max_workers`, is no measurement),
    // and a job that is not a trial grows on the prior.
    let unmeasured = |exploratory: bool, current: u32, requested: Option<u32>| {
        let mut j = running(trial(exploratory), current);
        j.throughput = None;
        j.requested_workers = requested.unwrap_or(j.max_workers);
        j.workers_declared = requested.is_some();
        j
    };
    assert_eq!(decide(unmeasured(true, 1, Some(1)), &params), 1);
    assert_eq!(decide(unmeasured(true, 0, Some(1)), &params), 1);
    assert_eq!(decide(unmeasured(true, 0, Some(3)), &params), 3);
    assert_eq!(decide(unmeasured(true, 2, Some(3)), &params), 3);
    assert_eq!(decide(unmeasured(true, 0, Some(8)), &params), 8);
    assert_eq!(decide(unmeasured(true, 0, None), &params), 1);
    assert_eq!(decide(unmeasured(true, 2, None), &params), 2);
    assert_eq!(decide(unmeasured(false, 1, Some(1)), &params), 8);
    assert_eq!(decide(unmeasured(true, 1, Some(1)), &off), 8);
    // An empty table is no measurement either.
    let mut empty = unmeasured(true, 1, None);
    empty.throughput = Some(Vec::new());
    assert_eq!(decide(empty, &params), 1);
}

/// On a type where the job has its own table (`JobTypes::tables`: a job that names
/// micro-batches per type) the sizing per type reads it instead of the job's table times
/// the speed ratio: the same job, given the fast pool, grows to its 4 GPUs when its table
/// scaled by the ratio says it scales, and stays at 1 when its own table there says a
/// second worker adds nothing.
#[test]
fn the_sizing_on_a_type_reads_the_jobs_own_table_there() {
    let pools = one_node_pools(&[("slow", 4), ("fast", 4)]);
    let mut j = job("j", 4);
    j.throughput = Some((1..=4).map(|w| 100.0 * f64::from(w)).collect());
    j.remaining_work = Some(1e9);
    let cluster = ClusterView {
        total_gpus: 8,
        gpus_per_node: 4,
        now: 1e5,
    };
    let jobs = [j];
    let decide = |tables: Vec<Option<crate::policies::TypeTable>>| {
        let types = [crate::policies::JobTypes {
            factors: vec![Some(1.0), Some(2.0)],
            current: None,
            eligible_gpus: vec![4, 4],
            tables,
        }];
        Quality::default()
            .allocate_on_types(&cluster, &pools, &jobs, &types)
            .unwrap()
    };
    let id = &jobs[0].id;
    let scaled = decide(Vec::new());
    assert_eq!(
        (scaled.types.get(id), scaled.workers[id]),
        (Some(&1), 4),
        "{scaled:?}"
    );
    let flat = crate::policies::TypeTable::from_values(vec![200.0; 4]);
    let own = decide(vec![None, Some(flat)]);
    assert_eq!(
        (own.types.get(id), own.workers[id]),
        (Some(&1), 1),
        "{own:?}"
    );
}

/// The type choice reads a job's own tables where it has them: job `b` computes only 1.5
/// times as fast on the fast type, but its own table there (a larger micro-batch) gives it 4
/// times its goodput, against `a`'s 2 times from the compute speed alone; the one fast GPU
/// goes to `b`. Without `b`'s tables it goes to `a`.
#[test]
fn the_type_choice_reads_the_jobs_own_tables() {
    let pools = one_node_pools(&[("slow", 4), ("fast", 1)]);
    let mut jobs = [job("a", 1), job("b", 1)];
    for j in &mut jobs {
        j.throughput = Some(vec![100.0]);
        j.remaining_work = Some(1e9);
    }
    let cluster = ClusterView {
        total_gpus: 5,
        gpus_per_node: 4,
        now: 1e5,
    };
    let decide = |b_tables: Vec<Option<crate::policies::TypeTable>>| {
        let types = [
            crate::policies::JobTypes {
                factors: vec![Some(1.0), Some(2.0)],
                current: None,
                eligible_gpus: vec![4, 1],
                tables: Vec::new(),
            },
            crate::policies::JobTypes {
                factors: vec![Some(1.0), Some(1.5)],
                current: None,
                eligible_gpus: vec![4, 1],
                tables: b_tables,
            },
        ];
        let d = Quality::default()
            .allocate_on_types(&cluster, &pools, &jobs, &types)
            .unwrap();
        (
            d.types.get(&jobs[0].id).copied(),
            d.types.get(&jobs[1].id).copied(),
        )
    };
    assert_eq!(decide(Vec::new()), (Some(1), Some(0)));
    let table = |v: f64| Some(crate::policies::TypeTable::from_values(vec![v]));
    assert_eq!(decide(vec![table(100.0), table(400.0)]), (Some(0), Some(1)));
}

/// Two jobs that gain alike on a fast type with room for one: the one with less time left
/// (the larger completion weight) gets it, although the other arrived first (SRPT: it
/// finishes and frees the GPU sooner). Unweighted, their regrets per GPU tie and the
/// earlier arrival took the fast GPU.
#[test]
fn a_fast_type_goes_first_to_the_job_with_least_time_left() {
    let pools = one_node_pools(&[("slow", 4), ("fast", 1)]);
    let mut long = crate::policies::test_support::job("long", 0.0, 1, 1);
    let mut short = crate::policies::test_support::job("short", 1.0, 1, 1);
    long.remaining_work = Some(1e9);
    short.remaining_work = Some(1e6);
    for j in [&mut long, &mut short] {
        j.throughput = Some(vec![100.0]);
    }
    let jobs = [long, short];
    let cluster = ClusterView {
        total_gpus: 5,
        gpus_per_node: 4,
        now: 1e5,
    };
    let refs: Vec<&PolicyJob> = jobs.iter().collect();
    let terms = job_terms(&refs, cluster.now, &PolicyParams::default());
    assert!(terms[1].completion_weight > terms[0].completion_weight);
    let types = [0, 1].map(|_| crate::policies::JobTypes {
        factors: vec![Some(1.0), Some(2.0)],
        current: None,
        eligible_gpus: vec![4, 1],
        tables: Vec::new(),
    });
    let d = Quality::default()
        .allocate_on_types(&cluster, &pools, &jobs, &types)
        .unwrap();
    assert_eq!(d.types.get(&jobs[1].id), Some(&1), "{d:?}");
    assert_eq!(d.types.get(&jobs[0].id), Some(&0), "{d:?}");
    // A job valued by loss reduction alone weighs 1, whatever its rank.
    let mut trial = jobs[0].clone();
    trial.exploratory = true;
    assert_eq!(
        type_weight(&trial, &terms[0], &PolicyParams::default()),
        1.0
    );
    assert_eq!(
        type_weight(&jobs[1], &terms[1], &PolicyParams::default()),
        terms[1].completion_weight
    );
}

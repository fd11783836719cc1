//! Offline research code for the parameter-server planner of
//! [`converge_sched::ps_plan`]: the exhaustive optimum on small instances, the online
//! placement of a sequence of jobs (the seeded random instances are
//! `converge_sched::ps_plan::fixtures`, feature `benchgen`). Used by
//! `converge-sim ps-bench` ([`crate::ps_bench`]) and by tests; the allocator needs none of it,
//! so it lives here and not in `converge-sched`. Pure like the planner: no I/O, no clock,
//! randomness only from the caller's seed.

use converge_sched::ps_plan::{
    PsHost, PsJob, PsMethod, PsPlan, commit_ps_plan, feasible_pairs, plan_ps_job, search_pairs,
    shard_slots, step_time_s, worker_slots,
};

/// Calls `f` with every `v` such that `Σ v = sum` and `v_h ≤ caps_h`.
fn for_each_composition(caps: &[u32], sum: u32, f: &mut impl FnMut(&[u32])) {
    fn rec(
        caps: &[u32],
        suffix: &[u64],
        at: usize,
        left: u32,
        v: &mut Vec<u32>,
        f: &mut impl FnMut(&[u32]),
    ) {
        if at == caps.len() {
            if left == 0 {
                f(v);
            }
            return;
        }
        // The hosts after this one hold at most suffix[at + 1].
        let min_here = u64::from(left).saturating_sub(suffix[at + 1]) as u32;
        for n in min_here..=caps[at].min(left) {
            v.push(n);
            rec(caps, suffix, at + 1, left - n, v, f);
            v.pop();
        }
    }
    let mut suffix = vec![0u64; caps.len() + 1];
    for h in (0..caps.len()).rev() {
        suffix[h] = suffix[h + 1] + u64::from(caps[h]);
    }
    if suffix[0] < u64::from(sum) {
        return;
    }
    rec(
        caps,
        &suffix,
        0,
        sum,
        &mut Vec::with_capacity(caps.len()),
        f,
    );
}

/// Number of vectors `v` with `Σ v = sum`, `v_h ≤ caps_h`.
fn count_compositions(caps: &[u32], sum: u32) -> u128 {
    let mut ways = vec![0u128; sum as usize + 1];
    ways[0] = 1;
    for &cap in caps {
        let mut next = vec![0u128; sum as usize + 1];
        for (s, &n) in ways.iter().enumerate() {
            if n == 0 {
                continue;
            }
            for add in 0..=cap.min(sum - s as u32) {
                next[s + add as usize] += n;
            }
        }
        ways = next;
    }
    ways[sum as usize]
}

/// Number of placements [`optimal_ps_job`] evaluates (each costs one step-time evaluation);
/// use it to keep the exhaustive search to small instances.
pub fn exact_search_size(hosts: &[PsHost], job: &PsJob) -> u128 {
    feasible_pairs(hosts, job)
        .iter()
        .map(|(w, p, xs, ys)| count_compositions(xs, *w) * count_compositions(ys, *p))
        .sum()
}

/// The best placement for fixed `(w, p)` by exhaustive search over every integer `x` and `y`
/// within capacity: `(workers per host, shards per host, step time in s)`, or `None` when it
/// does not fit. Exponential: for tiny instances.
pub fn optimal_ps_fixed(
    hosts: &[PsHost],
    job: &PsJob,
    w: u32,
    p: u32,
) -> Option<(Vec<u32>, Vec<u32>, f64)> {
    if !job.is_valid() || w == 0 || p == 0 {
        return None;
    }
    let xs = worker_slots(hosts, job, w);
    let ys = shard_slots(hosts, p);
    let mut best: Option<(Vec<u32>, Vec<u32>, f64)> = None;
    for_each_composition(&ys, p, &mut |y| {
        for_each_composition(&xs, w, &mut |x| {
            let step = step_time_s(hosts, job, x, y);
            if best.as_ref().is_none_or(|b| step < b.2) {
                best = Some((x.to_vec(), y.to_vec(), step));
            }
        });
    });
    best
}

/// The exact optimum of the job's objective (throughput, or the covering variant with
/// `target_fraction`) by exhaustive search over every `(w, p)` and every placement. Its cost is
/// [`exact_search_size`]; meant for tiny instances (a few hosts, `w ≤ 4`, `p ≤ 2` is
/// instantaneous). Its bounds are the trivial ones.
pub fn optimal_ps_job(hosts: &[PsHost], job: &PsJob) -> Option<PsPlan> {
    search_pairs(hosts, job, PsMethod::Exact, |w, p, _, _| {
        optimal_ps_fixed(hosts, job, w, p)
    })
}

/// Places arriving jobs one by one with [`plan_ps_job`] (job `i` seeded by `seed` and `i`),
/// each on the capacity the earlier ones left ([`commit_ps_plan`]). A job that does not fit
/// gets `None` and takes nothing.
pub fn place_ps_jobs_online(hosts: &[PsHost], jobs: &[PsJob], seed: u64) -> Vec<Option<PsPlan>> {
    place_ps_jobs_online_with(hosts, jobs, seed, plan_ps_job).0
}

/// [`place_ps_jobs_online`] with any planner `plan(free hosts, job, seed)`; also returns the
/// capacity left at the end.
pub fn place_ps_jobs_online_with(
    hosts: &[PsHost],
    jobs: &[PsJob],
    seed: u64,
    mut plan: impl FnMut(&[PsHost], &PsJob, u64) -> Option<PsPlan>,
) -> (Vec<Option<PsPlan>>, Vec<PsHost>) {
    let mut free = hosts.to_vec();
    let plans = jobs
        .iter()
        .enumerate()
        .map(|(i, job)| {
            let job_seed = seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let placed = plan(&free, job, job_seed);
            if let Some(p) = &placed {
                commit_ps_plan(&mut free, hosts, job, p);
            }
            placed
        })
        .collect();
    (plans, free)
}

#[cfg(test)]
mod tests {
    use converge_sched::ps_plan::{
        MIN_RESIDUAL_NIC_FRACTION, PsOptions, lp_bound_comm_s, plan_ps_job_with,
    };
    use proptest::prelude::*;

    use super::*;
    use converge_sched::ps_plan::fixtures::{check_capacity, close, colocation_instance};

    const GBE10: f64 = 1.25e9;

    #[test]
    fn colocation_is_the_exhaustive_optimum() {
        // One shard with each pair of workers, not on the CPU host. (The plan itself is
        // tested in `converge_sched::ps_plan`.)
        let (hosts, job) = colocation_instance();
        let plan = plan_ps_job(&hosts, &job, 7).unwrap();
        let exact = optimal_ps_job(&hosts, &job).unwrap();
        assert!(close(plan.step_time_s, exact.step_time_s));
        assert_eq!(exact.shards_per_host, plan.shards_per_host);
    }

    #[test]
    fn online_never_exceeds_capacity() {
        let hosts: Vec<PsHost> = (0..4)
            .map(|h| PsHost::new(4 + h, 2 + h % 2, GBE10 * f64::from(1 + h)))
            .collect();
        let jobs: Vec<PsJob> = (0..10)
            .map(|i| PsJob {
                gpus_per_worker: 1 + i % 2,
                target_fraction: 0.8,
                ..PsJob::new(1e8 * f64::from(1 + i), 0.3, 1..=6, 1..=2)
            })
            .collect();
        let plans = place_ps_jobs_online(&hosts, &jobs, 11);
        assert_eq!(plans, place_ps_jobs_online(&hosts, &jobs, 11));
        let mut used_gpus = vec![0u32; hosts.len()];
        let mut used_cpus = vec![0u32; hosts.len()];
        let mut free = hosts.clone();
        for (job, plan) in jobs.iter().zip(&plans) {
            let Some(plan) = plan else { continue };
            check_capacity(&free, job, plan);
            for &(h, n) in &plan.workers_per_host {
                used_gpus[h] += n * job.gpus_per_worker;
            }
            for &(h, n) in &plan.shards_per_host {
                used_cpus[h] += n;
            }
            commit_ps_plan(&mut free, &hosts, job, plan);
        }
        assert!(plans.iter().any(Option::is_some));
        for h in 0..hosts.len() {
            assert!(used_gpus[h] <= hosts[h].free_gpus);
            assert!(used_cpus[h] <= hosts[h].free_cpu_slots);
            assert!(
                free[h].nic_bytes_per_s >= MIN_RESIDUAL_NIC_FRACTION * hosts[h].nic_bytes_per_s
            );
        }
    }

    #[test]
    fn compositions_are_counted_and_enumerated_alike() {
        for (caps, sum) in [(vec![2, 3, 1], 3), (vec![4, 4, 4, 4], 7), (vec![0, 2], 3)] {
            let mut n = 0u128;
            for_each_composition(&caps, sum, &mut |v| {
                assert_eq!(v.iter().sum::<u32>(), sum);
                n += 1;
            });
            assert_eq!(n, count_compositions(&caps, sum));
        }
    }

    fn tiny_instance() -> impl Strategy<Value = (Vec<PsHost>, PsJob, u64)> {
        let host = (
            0u32..=4,
            0u32..=2,
            prop::sample::select(vec![1.25e9, 3.125e9, 12.5e9]),
        )
            .prop_map(|(g, c, b)| PsHost::new(g, c, b));
        (
            prop::collection::vec(host, 1..=3),
            1e7f64..2e9,
            0.05f64..1.0,
            1u32..=4,
            1u32..=2,
            any::<u64>(),
        )
            .prop_map(|(hosts, m, tc, w, p, seed)| (hosts, PsJob::new(m, tc, 1..=w, 1..=p), seed))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// LP bound ≤ exact optimum ≤ rounded plan, per (w, p) and for the whole job;
        /// capacities hold.
        #[test]
        fn lp_bound_le_exact_le_rounded((hosts, job, seed) in tiny_instance()) {
            let plan = plan_ps_job(&hosts, &job, seed);
            let exact = optimal_ps_job(&hosts, &job);
            prop_assert_eq!(plan.is_some(), exact.is_some());
            let (Some(plan), Some(exact)) = (plan, exact) else { return Ok(()) };
            check_capacity(&hosts, &job, &plan);
            check_capacity(&hosts, &job, &exact);
            let plain = PsOptions { local_search_starts: 0, ..PsOptions::default() };
            let rounded = plan_ps_job_with(&hosts, &job, seed, &plain).unwrap();
            check_capacity(&hosts, &job, &rounded);
            prop_assert!(exact.throughput >= rounded.throughput * (1.0 - 1e-7));
            prop_assert!(plan.throughput >= rounded.throughput * (1.0 - 1e-7));
            let tol = 1e-7;
            // Throughput: LP bound ≥ exact ≥ ours.
            prop_assert!(plan.lp_bound_throughput >= exact.throughput * (1.0 - tol));
            prop_assert!(exact.throughput >= plan.throughput * (1.0 - tol));
            // Step time at the chosen w.
            let best_same_w = (job.min_shards..=job.max_shards)
                .filter_map(|p| optimal_ps_fixed(&hosts, &job, plan.workers, p))
                .map(|(_, _, s)| s)
                .fold(f64::INFINITY, f64::min);
            prop_assert!(plan.lp_bound_step_time_s <= best_same_w * (1.0 + tol));
            prop_assert!(best_same_w <= plan.step_time_s * (1.0 + tol));
            // Every pair.
            for w in job.min_workers..=job.max_workers {
                for p in job.min_shards..=job.max_shards {
                    let lp = lp_bound_comm_s(&hosts, &job, w, p);
                    let ex = optimal_ps_fixed(&hosts, &job, w, p);
                    prop_assert_eq!(lp.is_some(), ex.is_some());
                    if let (Some(lp), Some((_, _, s))) = (lp, ex) {
                        prop_assert!(job.compute_s + lp <= s * (1.0 + tol), "{} > {}", job.compute_s + lp, s);
                    }
                }
            }
        }
    }
}

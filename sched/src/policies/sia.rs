//! Sia's scheduling policy, as a baseline (Jayaram Subramanya et al., "Sia:
//! Heterogeneity-aware, goodput-optimized ML-cluster scheduling", SOSP'23, §4, and its
//! artifact's simulator, `siasosp23/artifacts`, `sia-simulator/sia.py`).
//!
//! # What it decides
//!
//! For every job at once, one **configuration**: a GPU type and a number of GPUs of it, or
//! nothing. The configurations of a type whose nodes hold `n` GPUs are `1, 2, 4, …` GPUs up
//! to `n` (one node) and then whole nodes, `2n, 3n, …` up to the type's size.
//!
//! # Objective (Sia's MILP)
//!
//! - `G(j, c)`: job `j`'s goodput in configuration `c` — on the type its model describes,
//!   goodput at the best batch ([`crate::goodput`]); on another type that goodput scaled by
//!   the job's speed ratio between the types ([`JobTypes::factors`], from
//!   [`crate::gpu_types`]). A job with no goodput model yet, or a type with no known ratio,
//!   gets only its smallest configuration there (its minimum workers), valued as the job's
//!   smallest goodput (Sia's rule for a job it has not profiled). A job's minimum is always
//!   one of its configurations, also when it is not one of Sia's counts (e.g. 3 GPUs).
//! - Normalized per job by its smallest goodput over all configurations: `v = G / G_min`
//!   (≥ 1).
//! - A configuration other than the job's current one is multiplied by Pollux's restart
//!   factor `max(age − restarts·δ, 0) / (age + δ)` (`δ`: the job's measured restart cost,
//!   else [`Sia::restart_cost_s`]; 1 while `age < δ`).
//! - Minimize `Σ x(j, c) · min(round₂(v^p), clip) + λ_n · (jobs − Σ x)` with `p < 0`, subject
//!   to: at most one configuration per job, and per GPU type at most its GPUs. `λ_n > 1`
//!   makes every allocation better than none.
//!
//! Solved exactly with `good_lp`'s pure-Rust `microlp` branch and bound (the artifact uses
//! CBC or GLPK with a 10⁻⁴ relative gap). Configurations that cannot be optimal are dropped
//! first: those valued no better than nothing (`a ≥ λ_n`) and those that use more GPUs of a
//! type for no better value.
//!
//! # Differences from the artifact
//!
//! - Pure: the previous configuration is read from the job's current placement (the
//!   artifact keeps it in the policy object), so a current size that is not a configuration
//!   (e.g. 3 GPUs) has no "unchanged" configuration.
//! - The artifact forbids changing a job that is checkpointing; here nothing is frozen.
//! - The artifact projects a type it has not seen from one profiled GPU of each type; here
//!   the ratios are learned from the jobs that ran on both types ([`crate::gpu_types`]).
//! - Per-application restart costs (the artifact's table: ImageNet 250 s, BERT 120 s, …) are
//!   the job's own measured cost where it has one.
//! - A job's largest configuration is capped like Pollux's (`min(max_workers, 2 × the
//!   largest world size measured, 64)`), as the artifact caps it at what was profiled.
//! - Placement inside a type is Converge's ([`crate::placement`]), which keeps unchanged
//!   jobs where they are; the artifact's simulator re-packs every type each round.

use std::collections::BTreeMap;

use good_lp::{Expression, ProblemVariables, Solution as _, SolverModel as _, microlp, variable};

use super::{
    ClusterView, Decision, GpuTypePool, JobTypes, Policy, PolicyInputs, PolicyJob, TypeDecision,
    arrival_order,
};

/// Settings of the Sia baseline (the artifact's values by default).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sia {
    /// Fairness exponent `p` (negative; the artifact: −0.5). A value that is not negative
    /// is taken as −0.5.
    pub p: f64,
    /// Penalty of a job left without GPUs, `λ_n` (the artifact: 1.1; above 1).
    pub lambda_n: f64,
    /// Seconds a restart costs a job that has not measured its own (the artifact's default:
    /// 30).
    pub restart_cost_s: f64,
    /// Largest value of a configuration's `v^p` (the artifact: 3000).
    pub clip: f64,
}

impl Default for Sia {
    fn default() -> Self {
        Self {
            p: -0.5,
            lambda_n: 1.1,
            restart_cost_s: 30.0,
            clip: 3000.0,
        }
    }
}

/// Most workers a configuration gives one job (Pollux's and Sia's 64).
const MAX_CONFIG_WORKERS: u32 = 64;

/// The GPU counts Sia considers on a type whose nodes hold `per_node` GPUs and that has
/// `nodes` of them: powers of two up to one node, then whole nodes.
fn gpu_counts(per_node: u32, nodes: u32) -> Vec<u32> {
    let per_node = per_node.max(1);
    let mut counts = Vec::new();
    let mut g = 1;
    while g < per_node {
        counts.push(g);
        g *= 2;
    }
    counts.extend((1..=nodes).map(|k| k * per_node));
    counts
}

/// One candidate: job (index into the arrival order), pool, workers, and its objective
/// coefficient `a = min(round₂(v^p), clip)`.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    job: usize,
    pool: usize,
    workers: u32,
    gpus: u32,
    a: f64,
}

impl Sia {
    fn exponent(&self) -> f64 {
        if self.p < 0.0 { self.p } else { -0.5 }
    }

    /// The candidates of one job, before normalization: `(pool, workers, goodput or None
    /// for "unknown, valued as the smallest")`.
    fn raw_configs(
        &self,
        pools: &[GpuTypePool],
        job: &PolicyJob,
        types: &JobTypes,
    ) -> Vec<(usize, u32, Option<f64>)> {
        let Some(min) = super::minimum_workers(job) else {
            return Vec::new();
        };
        let gpw = job.gpus_per_worker;
        // A goodput model is trusted up to twice the largest world size it measured; a
        // throughput table (an oracle's, or a model's at a fixed batch) up to its length.
        let most = match (&job.goodput, &job.throughput) {
            (Some(g), _) => job
                .max_workers
                .min((2 * g.model.max_workers_observed()).max(1)),
            (None, Some(table)) => job.max_workers.min(table.len() as u32),
            (None, None) => min,
        }
        .clamp(min, MAX_CONFIG_WORKERS.max(min));
        let mut out = Vec::new();
        for (t, pool) in pools.iter().enumerate() {
            let eligible = types.eligible_gpus.get(t).copied().unwrap_or(pool.gpus);
            let factor = types.factors.get(t).copied().flatten();
            let per_node = pool.gpus_per_node.max(1);
            let known = factor.is_some() && (job.goodput.is_some() || job.throughput.is_some());
            // Sia's counts, and the job's minimum (a count it may need that is not one of
            // them, e.g. 3 GPUs: without it such a job would never run).
            let mut counts = gpu_counts(per_node, pool.nodes);
            let least = min * gpw;
            if !counts.contains(&least) {
                counts.push(least);
                counts.sort_unstable();
            }
            for gpus in counts {
                if gpus > eligible || !gpus.is_multiple_of(gpw) {
                    continue;
                }
                let w = gpus / gpw;
                if w < min || w > job.max_workers {
                    continue;
                }
                if !known {
                    // Not profiled there: its smallest configuration only.
                    if w == min {
                        out.push((t, w, None));
                    }
                    continue;
                }
                if w > most {
                    continue;
                }
                let nodes = gpus.div_ceil(per_node);
                // The job's own table on the type where the decision built one (its model
                // with the type's compute speed and micro-batch), else its goodput scaled
                // by the type's speed factor.
                let own = types
                    .tables
                    .get(t)
                    .and_then(Option::as_ref)
                    .and_then(|table| table.get().get(w as usize - 1).copied());
                let g = match (own, &job.goodput, &job.throughput) {
                    (Some(g), _, _) => g,
                    (None, Some(g), _) => {
                        g.best(w, nodes).map_or(0.0, |(_, v)| v) * factor.unwrap_or(1.0)
                    }
                    (None, None, Some(table)) => {
                        table.get(w as usize - 1).copied().unwrap_or(0.0) * factor.unwrap_or(1.0)
                    }
                    (None, None, None) => 0.0,
                };
                if g.is_finite() && g > 0.0 {
                    out.push((t, w, Some(g)));
                }
            }
        }
        out
    }

    /// Every job's candidates (normalized, restart-charged, pruned), jobs in `order`.
    fn candidates(
        &self,
        cluster: &ClusterView,
        pools: &[GpuTypePool],
        jobs: &[PolicyJob],
        types: &[JobTypes],
        order: &[usize],
    ) -> Vec<Candidate> {
        let p = self.exponent();
        let mut all = Vec::new();
        for (k, &i) in order.iter().enumerate() {
            let (job, job_types) = (&jobs[i], &types[i]);
            let raw = self.raw_configs(pools, job, job_types);
            let smallest = raw
                .iter()
                .filter_map(|&(_, _, g)| g)
                .reduce(f64::min)
                .unwrap_or(1.0);
            let age = (cluster.now - job.submitted_at).max(0.0);
            let delay = job
                .restart_cost_s
                .filter(|d| d.is_finite() && *d >= 0.0)
                .unwrap_or(self.restart_cost_s)
                .max(0.0);
            let restart = if age < delay {
                1.0
            } else {
                (age - f64::from(job.restarts) * delay).max(0.0) / (age + delay)
            };
            let current = job_types.current.filter(|_| job.current_workers > 0);
            let mut mine: Vec<Candidate> = raw
                .into_iter()
                .filter_map(|(t, w, g)| {
                    let mut v = g.map_or(1.0, |g| g / smallest);
                    // Only a running job pays for a change (Sia scales nothing for a job
                    // without a previous configuration).
                    if current.is_some() && (current != Some(t) || job.current_workers != w) {
                        v *= restart;
                    }
                    let a = if v > 0.0 {
                        ((v.powf(p) * 100.0).round() / 100.0).min(self.clip)
                    } else {
                        self.clip
                    };
                    // No better than no allocation: never optimal.
                    (a < self.lambda_n).then_some(Candidate {
                        job: k,
                        pool: t,
                        workers: w,
                        gpus: w * job.gpus_per_worker,
                        a,
                    })
                })
                .collect();
            // On one type, more GPUs for no lower cost is never optimal.
            mine.sort_by(|x, y| {
                (x.pool, x.gpus)
                    .cmp(&(y.pool, y.gpus))
                    .then(x.a.total_cmp(&y.a))
            });
            let mut best: BTreeMap<usize, f64> = BTreeMap::new();
            mine.retain(|c| {
                let b = best.entry(c.pool).or_insert(f64::INFINITY);
                if c.a < *b {
                    *b = c.a;
                    true
                } else {
                    false
                }
            });
            all.extend(mine);
        }
        all
    }

    /// The MILP's choice: per job in `order`, the chosen candidate (index into `cands`).
    fn solve(&self, pools: &[GpuTypePool], jobs: usize, cands: &[Candidate]) -> Vec<Option<usize>> {
        let mut chosen = vec![None; jobs];
        if cands.is_empty() {
            return chosen;
        }
        let mut vars = ProblemVariables::new();
        let x: Vec<_> = cands
            .iter()
            .map(|_| vars.add(variable().integer().min(0).max(1)))
            .collect();
        // Minimize Σ a·x + λ_n·(jobs − Σ x) ⇔ maximize Σ (λ_n − a)·x.
        let objective: Expression = cands
            .iter()
            .zip(&x)
            .map(|(c, &v)| (self.lambda_n - c.a) * v)
            .sum();
        let mut model = vars.maximise(objective).using(microlp);
        let mut per_job: Vec<Expression> = vec![Expression::default(); jobs];
        let mut per_pool: Vec<Expression> = vec![Expression::default(); pools.len()];
        for (c, &v) in cands.iter().zip(&x) {
            per_job[c.job] += v;
            per_pool[c.pool] += f64::from(c.gpus) * v;
        }
        for e in per_job {
            model = model.with(e.leq(1));
        }
        for (e, pool) in per_pool.into_iter().zip(pools) {
            model = model.with(e.leq(f64::from(pool.gpus)));
        }
        match model.solve() {
            Ok(solution) => {
                for (i, (c, &v)) in cands.iter().zip(&x).enumerate() {
                    if solution.value(v) > 0.5 {
                        chosen[c.job] = Some(i);
                    }
                }
            }
            Err(_) => {
                // The MILP is always feasible (nothing allocated); a solver failure falls
                // back to the greedy: best value per GPU first, while the type has room.
                let mut by_gain: Vec<usize> = (0..cands.len()).collect();
                by_gain.sort_by(|&a, &b| {
                    let gain = |c: &Candidate| (self.lambda_n - c.a) / f64::from(c.gpus.max(1));
                    gain(&cands[b]).total_cmp(&gain(&cands[a])).then(a.cmp(&b))
                });
                let mut left: Vec<u32> = pools.iter().map(|p| p.gpus).collect();
                for i in by_gain {
                    let c = &cands[i];
                    if chosen[c.job].is_none() && left[c.pool] >= c.gpus {
                        left[c.pool] -= c.gpus;
                        chosen[c.job] = Some(i);
                    }
                }
            }
        }
        chosen
    }
}

impl Policy for Sia {
    fn name(&self) -> &'static str {
        "sia"
    }

    fn inputs(&self) -> PolicyInputs {
        PolicyInputs {
            goodput: true,
            estimates: true,
            gpu_types: true,
            ..PolicyInputs::default()
        }
    }

    /// On one GPU type: the same MILP on one pool of `total_gpus` on nodes of
    /// `gpus_per_node`.
    fn allocate(&self, cluster: &ClusterView, jobs: &[PolicyJob]) -> Decision {
        let per_node = cluster.gpus_per_node.max(1);
        let pool = GpuTypePool {
            name: None,
            gpus: cluster.total_gpus,
            nodes: cluster.total_gpus.div_ceil(per_node),
            gpus_per_node: per_node,
        };
        let types: Vec<JobTypes> = jobs
            .iter()
            .map(|j| JobTypes {
                factors: vec![Some(1.0)],
                current: (j.current_workers > 0).then_some(0),
                eligible_gpus: vec![cluster.total_gpus],
                tables: Vec::new(),
            })
            .collect();
        let decided = self
            .allocate_on_types(cluster, std::slice::from_ref(&pool), jobs, &types)
            .unwrap_or_default();
        Decision {
            workers: decided.workers,
        }
    }

    fn allocate_on_types(
        &self,
        cluster: &ClusterView,
        pools: &[GpuTypePool],
        jobs: &[PolicyJob],
        types: &[JobTypes],
    ) -> Option<TypeDecision> {
        let mut decision = TypeDecision::default();
        for job in jobs {
            decision.workers.entry(job.id.clone()).or_insert(0);
        }
        if types.len() != jobs.len() {
            return None;
        }
        let order = arrival_order(jobs);
        let cands = self.candidates(cluster, pools, jobs, types, &order);
        let chosen = self.solve(pools, order.len(), &cands);
        for (k, pick) in chosen.into_iter().enumerate() {
            if let Some(c) = pick.map(|i| &cands[i]) {
                let id = &jobs[order[k]].id;
                decision.workers.insert(id.clone(), c.workers);
                decision.types.insert(id.clone(), c.pool);
            }
        }
        Some(decision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::TypeTable;
    use converge_common::JobId;

    /// A 1-GPU-per-worker job of 1 to `max` workers, running `current` of them.
    fn job(id: &str, current: u32, max: u32) -> PolicyJob {
        PolicyJob {
            current_workers: current,
            ..crate::policies::test_support::job(id, 0.0, 1, max)
        }
    }

    fn pool(name: &str, nodes: u32, per_node: u32) -> GpuTypePool {
        GpuTypePool {
            name: Some(name.to_owned()),
            gpus: nodes * per_node,
            nodes,
            gpus_per_node: per_node,
        }
    }

    fn view(total: u32, now: f64) -> ClusterView {
        ClusterView {
            total_gpus: total,
            gpus_per_node: 4,
            now,
        }
    }

    #[test]
    fn configurations_are_powers_of_two_within_a_node_then_whole_nodes() {
        assert_eq!(gpu_counts(4, 3), [1, 2, 4, 8, 12]);
        assert_eq!(gpu_counts(8, 2), [1, 2, 4, 8, 16]);
        assert_eq!(gpu_counts(1, 2), [1, 2]);
    }

    /// Sia's decision for two jobs with the same linear throughput table (`gainer`, then
    /// `flat`, which arrived later) on a slow and a fast pool of 4 GPUs each, with what the
    /// decision knows of each one's types.
    fn gainer_and_flat(gainer: JobTypes, flat: JobTypes) -> TypeDecision {
        let pools = [pool("slow", 1, 4), pool("fast", 1, 4)];
        let mut g = job("gainer", 0, 4);
        g.throughput = Some((1..=4).map(f64::from).collect());
        let mut f = job("flat", 0, 4);
        f.throughput = g.throughput.clone();
        f.submitted_at = 1.0;
        Sia::default()
            .allocate_on_types(&view(8, 0.0), &pools, &[g, f], &[gainer, flat])
            .unwrap()
    }

    /// Both pools eligible, no current type, the given speed factors and tables.
    fn types_of(factors: [f64; 2], tables: Vec<Option<TypeTable>>) -> JobTypes {
        JobTypes {
            factors: factors.map(Some).to_vec(),
            current: None,
            eligible_gpus: vec![4, 4],
            tables,
        }
    }

    /// Two jobs with linear throughput tables, one twice as fast on the second type as on the
    /// first, the other the same on both: each type is full and the job that gains from the
    /// fast type holds it.
    #[test]
    fn the_job_that_gains_most_from_a_type_gets_it() {
        let d = gainer_and_flat(
            types_of([1.0, 2.0], Vec::new()),
            types_of([1.0, 1.1], Vec::new()),
        );
        let id = |s: &str| s.parse::<JobId>().unwrap();
        assert_eq!(d.types[&id("gainer")], 1, "{d:?}");
        assert_eq!(d.types[&id("flat")], 0, "{d:?}");
        assert_eq!(d.workers[&id("gainer")], 4);
        assert_eq!(d.workers[&id("flat")], 4);
    }

    /// Two jobs with the same throughput tables; by the speed factors alone the second
    /// gains more from the fast type (1.1 against 1.0), but the decision's own table of the
    /// first on the fast type (a larger micro-batch fits there) shows it gains 2.2: Sia
    /// reads that table instead of the factor, and gives the first job the fast type.
    #[test]
    fn a_jobs_own_table_on_a_type_outweighs_its_factor() {
        let linear = |k: f64| {
            Some(TypeTable::from_values(
                (1..=4).map(|w| k * f64::from(w)).collect(),
            ))
        };
        let d = gainer_and_flat(
            types_of([1.0, 1.0], vec![linear(1.0), linear(2.2)]),
            types_of([1.0, 1.1], Vec::new()),
        );
        let id = |s: &str| s.parse::<JobId>().unwrap();
        assert_eq!(d.types[&id("gainer")], 1, "{d:?}");
        assert_eq!(d.types[&id("flat")], 0, "{d:?}");
    }

    /// More jobs than GPUs: every GPU is handed out and no type holds more than it has. With
    /// λ_n = 1.1 a first GPU is worth 1.1 − 1 = 0.1 and a second one that nearly doubles
    /// goodput (v = 1.9) is worth 1.1 − 1.9^−0.5 = 0.37 for the job: Sia gives the 2-GPU type
    /// to one job rather than to two.
    #[test]
    fn every_gpu_is_used_and_no_type_oversubscribed() {
        let pools = [pool("a", 1, 2), pool("b", 1, 1)];
        let jobs: Vec<PolicyJob> = (0..5)
            .map(|i| {
                let mut j = job(&format!("j{i}"), 0, 2);
                j.submitted_at = f64::from(i);
                j.throughput = Some(vec![1.0, 1.9]);
                j
            })
            .collect();
        let types: Vec<JobTypes> = jobs
            .iter()
            .map(|_| JobTypes {
                factors: vec![Some(1.0), Some(1.0)],
                current: None,
                eligible_gpus: vec![2, 1],
                tables: Vec::new(),
            })
            .collect();
        let d = Sia::default()
            .allocate_on_types(&view(3, 0.0), &pools, &jobs, &types)
            .unwrap();
        let mut used = [0u32; 2];
        for (id, &t) in &d.types {
            used[t] += d.workers[id];
        }
        assert_eq!(used, [2, 1], "{d:?}");
        let mut sizes: Vec<u32> = d.workers.values().copied().filter(|&w| w > 0).collect();
        sizes.sort_unstable();
        assert_eq!(sizes, [1, 2], "{d:?}");
        assert_eq!(d.workers.len(), 5);
    }

    /// A running job keeps its configuration when another one is worth only a little more:
    /// the restart factor charges every change.
    #[test]
    fn a_change_must_pay_for_its_restart() {
        let pools = [pool("a", 1, 4)];
        let mut running = job("running", 2, 4);
        running.submitted_at = 0.0;
        running.restarts = 3;
        running.throughput = Some(vec![1.0, 2.0, 2.05, 2.1]);
        let types = [JobTypes {
            factors: vec![Some(1.0)],
            current: Some(0),
            eligible_gpus: vec![4],
            tables: Vec::new(),
        }];
        let id = "running".parse::<JobId>().unwrap();
        let d = Sia::default()
            .allocate_on_types(&view(4, 200.0), &pools, &[running.clone()], &types)
            .unwrap();
        assert_eq!(d.workers[&id], 2, "{d:?}");
        // Without the restart charge (a young job), the larger configuration wins.
        running.restarts = 0;
        running.current_workers = 0;
        let fresh = [JobTypes {
            current: None,
            ..types[0].clone()
        }];
        let d = Sia::default()
            .allocate_on_types(&view(4, 200.0), &pools, &[running], &fresh)
            .unwrap();
        assert_eq!(d.workers[&id], 4, "{d:?}");
    }

    /// A job with no model yet gets one GPU (its smallest configuration), on some type.
    #[test]
    fn an_unprofiled_job_gets_its_smallest_configuration() {
        let pools = [pool("a", 1, 4), pool("b", 1, 8)];
        let j = job("new", 0, 8);
        let types = [JobTypes {
            factors: vec![None, None],
            current: None,
            eligible_gpus: vec![4, 8],
            tables: Vec::new(),
        }];
        let d = Sia::default()
            .allocate_on_types(&view(12, 0.0), &pools, &[j], &types)
            .unwrap();
        assert_eq!(d.workers.values().copied().collect::<Vec<_>>(), [1]);
        assert_eq!(d.types.len(), 1);
    }

    /// A job whose minimum is not one of Sia's counts (3 GPUs on 4-GPU nodes) still gets a
    /// configuration: its minimum.
    #[test]
    fn a_minimum_outside_sias_counts_is_a_configuration() {
        let pools = [pool("a", 2, 4)];
        let mut j = job("three", 0, 3);
        j.min_workers = 3;
        let types = [JobTypes {
            factors: vec![None],
            current: None,
            eligible_gpus: vec![8],
            tables: Vec::new(),
        }];
        let d = Sia::default()
            .allocate_on_types(&view(8, 0.0), &pools, &[j], &types)
            .unwrap();
        assert_eq!(d.workers.values().copied().collect::<Vec<_>>(), [3]);
    }

    /// On one type, `allocate` runs the same MILP and respects the total.
    #[test]
    fn on_one_type_allocate_respects_the_total() {
        let jobs: Vec<PolicyJob> = (0..3)
            .map(|i| {
                let mut j = job(&format!("j{i}"), 0, 8);
                j.submitted_at = f64::from(i);
                j.throughput = Some((1..=8).map(|w| f64::from(w).sqrt()).collect());
                j
            })
            .collect();
        let d = Sia::default().allocate(&view(8, 0.0), &jobs);
        let total: u32 = d.workers.values().sum();
        assert!(total <= 8, "{d:?}");
        assert!(d.workers.values().all(|&w| w >= 1), "{d:?}");
    }
}

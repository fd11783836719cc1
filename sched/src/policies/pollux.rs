//! Pollux's scheduling policy, as a baseline (Qiao et al., "Pollux: Co-adaptive Cluster
//! Scheduling for Goodput-Optimized Deep Learning", OSDI'21, §4.2, and its artifact's
//! simulator, `petuum/adaptdl` branch `osdi21-artifact`, `simulator/pollux.py`).
//!
//! # What it maximizes
//!
//! Each job's **speedup** on `r` workers over `n` hosts is its goodput at the best batch for
//! that allocation ([`crate::goodput`]) divided by its goodput on a *fair share* —
//! `⌈GPUs / jobs⌉` workers on `⌈hosts · share⌉` hosts; a job without a throughput model yet
//! is taken to scale linearly (`r / fair workers`). The speedup is scaled so that one
//! host's worth of GPUs counts 1, and a job whose allocation changes is charged for the
//! restart: multiplied by `max(age − restarts·δ, 0) / (age + δ)` (`δ` = the restart delay,
//! 30 s). The cluster's value is the **power mean** with `p = −1` of `scaled + 0.001` over
//! all jobs — a job with nothing weighs heavily, so everyone gets something before anyone
//! gets much.
//!
//! # Search
//!
//! A genetic algorithm over allocation matrices (`jobs × hosts`, workers of each job on each
//! host), seeded with the current allocation: each generation breeds `population` children
//! from binary-tournament parents by single-point crossover over jobs, mutates them
//! (Pollux's three moves: a job back to its current allocation, zeroing some of a job's hosts,
//! raising some entries up to a host's capacity), repairs them and keeps the best
//! `population` distinct matrices of parents and children. **Repair** is Pollux's, in job
//! order (least attained service first, then submission): at most one multi-host job per
//! host (its interference avoidance); at most the job's maximum workers (`min(max_workers,
//! max(2 × the largest world size measured, 1))`, Pollux's "twice what was profiled"), trimmed
//! from randomly chosen hosts, on at most 16 hosts; host capacity; and at least the job's
//! minimum or nothing.
//!
//! # Differences from the artifact
//!
//! - The artifact keeps the last population between decisions to seed the next; the policy
//!   here is a pure function, so each search starts from the current allocation alone.
//! - The artifact runs NSGA-II on two objectives (the power mean and cluster utility, for
//!   autoscaling) and then takes the best power mean; with a fixed cluster only the first
//!   matters, so survival here is by it alone (elitist, duplicates removed).
//! - Randomness is a ChaCha8 stream seeded from [`Pollux::seed`] and the decision time, so a
//!   decision is reproducible.
//! - Goodput's throughput part is Converge's fitted [`crate::throughput::ThroughputModel`], not
//!   Pollux's `PerfParams` (both are fitted on the job's own step times), and the best batch
//!   is found in closed form rather than on a 50-point grid.

use std::cell::RefCell;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{ClusterView, Decision, HostDecision, Policy, PolicyInputs, PolicyJob};
use crate::goodput::GoodputFn;

/// Settings of the Pollux baseline (the artifact's values by default).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pollux {
    /// Matrices kept per generation (the artifact: 100).
    pub population: usize,
    /// Generations per decision (the artifact: 100).
    pub generations: usize,
    /// Seed of the search's random stream (mixed with the decision time).
    pub seed: u64,
    /// Seconds a restart costs a job, for the restart penalty, until the job has measured its
    /// own ([`PolicyJob::restart_cost_s`], which every policy is told; the artifact: 30).
    pub restart_cost_s: f64,
}

impl Default for Pollux {
    fn default() -> Self {
        Self {
            population: 100,
            generations: 100,
            seed: 0,
            restart_cost_s: 30.0,
        }
    }
}

/// Most hosts one job spans (the artifact's `max_nodes`).
const MAX_HOSTS_PER_JOB: usize = 16;

/// Per-job data the search reads.
struct JobInfo<'a> {
    goodput: Option<&'a GoodputFn>,
    /// Goodput on a fair share (`None`: the job scales linearly).
    base: Option<f64>,
    fair_workers: u32,
    /// Speedups computed so far, at `nodes · (max_workers + 1) + workers`; NaN = not yet.
    speedup: RefCell<Vec<f64>>,
    max_workers: u32,
    min_workers: u32,
    gpus_per_worker: u32,
    /// Restart penalty factor (1 = none).
    restart_factor: f64,
    /// Hosts the job may use (its selector), by host index; `None`: all.
    allowed: Option<Vec<bool>>,
}

impl JobInfo<'_> {
    fn allows(&self, host: usize) -> bool {
        self.allowed
            .as_ref()
            .is_none_or(|a| a.get(host).copied().unwrap_or(false))
    }
}

impl JobInfo<'_> {
    /// Speedup on `workers` workers over `nodes` hosts (0 beyond the job's bounds).
    fn speedup(&self, nodes: usize, workers: u32) -> f64 {
        if workers > self.max_workers || nodes > MAX_HOSTS_PER_JOB || nodes == 0 {
            return 0.0;
        }
        let i = nodes * (self.max_workers as usize + 1) + workers as usize;
        let known = self.speedup.borrow()[i];
        if !known.is_nan() {
            return known;
        }
        let v = match (self.goodput, self.base) {
            (Some(g), Some(base)) => g.best(workers, nodes as u32).map_or(0.0, |(_, v)| v / base),
            _ => f64::from(workers) / f64::from(self.fair_workers.max(1)),
        };
        self.speedup.borrow_mut()[i] = v;
        v
    }
}

struct Problem<'a> {
    jobs: Vec<JobInfo<'a>>,
    host_gpus: &'a [u32],
    base: Vec<u32>,
    /// Scale of a speedup: dominant share × hosts.
    scale: f64,
}

impl Problem<'_> {
    fn hosts(&self) -> usize {
        self.host_gpus.len()
    }

    fn row<'s>(&self, state: &'s [u32], j: usize) -> &'s [u32] {
        let h = self.hosts();
        &state[j * h..(j + 1) * h]
    }

    fn value(&self, state: &[u32]) -> f64 {
        let mut sum = 0.0;
        for (j, job) in self.jobs.iter().enumerate() {
            let row = self.row(state, j);
            let workers: u32 = row.iter().sum();
            let nodes = row.iter().filter(|&&c| c > 0).count();
            let mut s = job.speedup(nodes, workers) * self.scale;
            if row != self.row(&self.base, j) {
                s *= job.restart_factor;
            }
            sum += 1.0 / (s + 1e-3);
        }
        self.jobs.len() as f64 / sum
    }

    /// Pollux's repair (module docs), in place.
    fn repair(&self, state: &mut [u32], rng: &mut ChaCha8Rng) {
        let h = self.hosts();
        let n_jobs = self.jobs.len();
        // Nothing on a host outside a job's selector.
        for (j, job) in self.jobs.iter().enumerate() {
            if job.allowed.is_some() {
                for (n, c) in state[j * h..(j + 1) * h].iter_mut().enumerate() {
                    if !job.allows(n) {
                        *c = 0;
                    }
                }
            }
        }
        // At most one multi-host job per host, earlier jobs first.
        let mut taken = vec![false; h];
        for j in 0..n_jobs {
            let row = &mut state[j * h..(j + 1) * h];
            if row.iter().filter(|&&c| c > 0).count() > 1 {
                for (n, c) in row.iter_mut().enumerate() {
                    if *c > 0 {
                        if taken[n] {
                            *c = 0;
                        } else {
                            taken[n] = true;
                        }
                    }
                }
            }
        }
        // At most max workers on at most MAX_HOSTS_PER_JOB hosts, hosts in random order.
        let mut order: Vec<usize> = (0..h).collect();
        for (j, job) in self.jobs.iter().enumerate() {
            let row = &mut state[j * h..(j + 1) * h];
            let total: u32 = row.iter().sum();
            let spanned = row.iter().filter(|&&c| c > 0).count();
            if total <= job.max_workers && spanned <= MAX_HOSTS_PER_JOB {
                // Nothing to trim (the shuffle would not change the row).
                continue;
            }
            for i in (1..h).rev() {
                order.swap(i, rng.gen_range(0..=i));
            }
            let (mut total, mut hosts) = (0u32, 0usize);
            for &n in &order {
                if row[n] == 0 {
                    continue;
                }
                if hosts >= MAX_HOSTS_PER_JOB || total >= job.max_workers {
                    row[n] = 0;
                    continue;
                }
                row[n] = row[n].min(job.max_workers - total);
                total += row[n];
                hosts += 1;
            }
        }
        // Host capacity, earlier jobs first.
        let mut used = vec![0u32; h];
        for (j, job) in self.jobs.iter().enumerate() {
            let gpw = job.gpus_per_worker.max(1);
            for n in 0..h {
                let c = &mut state[j * h + n];
                if *c == 0 {
                    continue;
                }
                let room = (self.host_gpus[n] - used[n]) / gpw;
                *c = (*c).min(room);
                used[n] += *c * gpw;
            }
        }
        // At least the minimum, or nothing.
        for (j, job) in self.jobs.iter().enumerate() {
            let row = &mut state[j * h..(j + 1) * h];
            if row.iter().sum::<u32>() < job.min_workers.max(1) {
                row.fill(0);
            }
        }
    }

    /// Pollux's mutation (module docs), in place.
    fn mutate(&self, state: &mut [u32], rng: &mut ChaCha8Rng) {
        let h = self.hosts();
        for j in 0..self.jobs.len() {
            if rng.r#gen::<f64>() < 0.1 {
                state[j * h..(j + 1) * h].copy_from_slice(self.row(&self.base, j));
            }
            if rng.r#gen::<f64>() < 0.1 {
                for c in &mut state[j * h..(j + 1) * h] {
                    if rng.r#gen::<f64>() < 0.1 {
                        *c = 0;
                    }
                }
            }
        }
        let mut used = vec![0u32; h];
        for j in 0..self.jobs.len() {
            let gpw = self.jobs[j].gpus_per_worker.max(1);
            for n in 0..h {
                used[n] += state[j * h + n] * gpw;
            }
        }
        // Each host where one more worker fits is raised with probability p1 (1 / such
        // hosts); one the job already uses with p1 + p2 − p1·p2 (p2: 1 / such hosts it uses).
        // Drawn by geometric skips over the two kinds of hosts, the same distribution as one
        // draw per host at a fraction of the draws.
        let mut fit_only = Vec::with_capacity(h);
        let mut fit_used = Vec::with_capacity(h);
        for (j, job) in self.jobs.iter().enumerate() {
            let gpw = job.gpus_per_worker.max(1);
            fit_only.clear();
            fit_used.clear();
            for n in 0..h {
                if used[n] + gpw <= self.host_gpus[n] && job.allows(n) {
                    if state[j * h + n] > 0 {
                        fit_used.push(n);
                    } else {
                        fit_only.push(n);
                    }
                }
            }
            let n_fit = fit_only.len() + fit_used.len();
            if n_fit == 0 {
                continue;
            }
            let p1 = 1.0 / n_fit as f64;
            let p_used = if fit_used.is_empty() {
                0.0
            } else {
                let p2 = 1.0 / fit_used.len() as f64;
                p1 + p2 - p1 * p2
            };
            for (hosts, p) in [(&fit_only, p1), (&fit_used, p_used)] {
                let mut i = skip(rng, p);
                while i < hosts.len() {
                    let n = hosts[i];
                    let cap = self.host_gpus[n] / gpw;
                    let c = &mut state[j * h + n];
                    *c = rng.gen_range((*c).min(cap)..=cap);
                    i += 1 + skip(rng, p);
                }
            }
        }
    }
}

/// Failures before the first success of a Bernoulli(`p`) sequence (geometric), capped.
fn skip(rng: &mut ChaCha8Rng, p: f64) -> usize {
    if p >= 1.0 {
        return 0;
    }
    if p <= 0.0 {
        return usize::MAX / 2;
    }
    let u: f64 = rng.r#gen::<f64>();
    let k = ((1.0 - u).ln() / (1.0 - p).ln()).floor();
    if k.is_finite() && k < 1e9 {
        k as usize
    } else {
        usize::MAX / 2
    }
}

fn mix(seed: u64, now: f64) -> u64 {
    let mut z = seed ^ now.to_bits().rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Pollux {
    fn job_info<'a>(
        &self,
        cluster: &ClusterView,
        job: &'a PolicyJob,
        fair: (u32, u32),
        hosts: usize,
    ) -> JobInfo<'a> {
        let (fair_workers, fair_nodes) = fair;
        let measured = job
            .goodput
            .as_ref()
            .map_or(0, |g| g.model.max_workers_observed());
        let max_workers = job.max_workers.min((2 * measured).max(1)).min(64);
        let base = job.goodput.as_ref().and_then(|g| {
            let w = fair_workers.min(g.limits.max_workers()).max(1);
            g.best(w, fair_nodes.min(w))
                .map(|(_, v)| v)
                .filter(|v| *v > 0.0)
        });
        let age = (cluster.now - job.submitted_at).max(0.0);
        // The job's measured restart cost, as every other policy is told, else the default.
        let delay = job
            .restart_cost_s
            .filter(|d| d.is_finite() && *d >= 0.0)
            .unwrap_or(self.restart_cost_s)
            .max(0.0);
        let restart_factor = if age + delay > 0.0 {
            (age - f64::from(job.restarts) * delay).max(0.0) / (age + delay)
        } else {
            0.0
        };
        JobInfo {
            goodput: job.goodput.as_ref(),
            base,
            fair_workers,
            speedup: RefCell::new(vec![
                f64::NAN;
                (MAX_HOSTS_PER_JOB + 1) * (max_workers as usize + 1)
            ]),
            max_workers,
            min_workers: job.min_workers.max(1),
            gpus_per_worker: job.gpus_per_worker,
            restart_factor,
            allowed: job.eligible_hosts.as_ref().map(|list| {
                let mut allowed = vec![false; hosts];
                for &n in list {
                    if let Some(a) = allowed.get_mut(n) {
                        *a = true;
                    }
                }
                allowed
            }),
        }
    }
}

impl Policy for Pollux {
    fn name(&self) -> &'static str {
        "pollux"
    }

    fn inputs(&self) -> PolicyInputs {
        // Its speedups come from `PolicyJob::goodput`; no throughput tables needed.
        PolicyInputs {
            goodput: true,
            hosts: true,
            ..PolicyInputs::default()
        }
    }

    /// Without hosts: the search on hosts of `gpus_per_node` GPUs holding `total_gpus`.
    fn allocate(&self, cluster: &ClusterView, jobs: &[PolicyJob]) -> Decision {
        let per = cluster.gpus_per_node.max(1);
        let mut hosts = vec![per; (cluster.total_gpus / per) as usize];
        if !cluster.total_gpus.is_multiple_of(per) {
            hosts.push(cluster.total_gpus % per);
        }
        let mut jobs = jobs.to_vec();
        for j in &mut jobs {
            j.current_hosts.clear();
            j.eligible_hosts = None;
        }
        let decision = self
            .allocate_on_hosts(cluster, &hosts, &jobs)
            .unwrap_or_default();
        Decision {
            workers: decision.workers,
        }
    }

    fn allocate_on_hosts(
        &self,
        cluster: &ClusterView,
        host_gpus: &[u32],
        jobs: &[PolicyJob],
    ) -> Option<HostDecision> {
        let mut decision = HostDecision::default();
        // Distinct ids, least attained service first, then submission (the artifact's order).
        let mut order: Vec<usize> = super::arrival_order(jobs)
            .into_iter()
            .filter(|&i| jobs[i].gpus_per_worker > 0 && jobs[i].max_workers > 0)
            .collect();
        for j in jobs {
            decision.workers.insert(j.id.clone(), 0);
        }
        order.sort_by(|&a, &b| {
            jobs[a]
                .attained_gpu_seconds
                .total_cmp(&jobs[b].attained_gpu_seconds)
                .then(jobs[a].submitted_at.total_cmp(&jobs[b].submitted_at))
                .then_with(|| jobs[a].id.cmp(&jobs[b].id))
        });
        let h = host_gpus.len();
        let total: u32 = host_gpus.iter().sum();
        if order.is_empty() || h == 0 || total == 0 {
            return Some(decision);
        }
        let gpw = order
            .iter()
            .map(|&i| jobs[i].gpus_per_worker)
            .max()
            .unwrap_or(1);
        let share = f64::from(gpw) / f64::from(total);
        let fair_workers = (f64::from(total) / f64::from(gpw) / order.len() as f64).ceil() as u32;
        let fair_nodes = (h as f64 * share).ceil().max(1.0) as u32;
        let infos: Vec<JobInfo> = order
            .iter()
            .map(|&i| self.job_info(cluster, &jobs[i], (fair_workers.max(1), fair_nodes), h))
            .collect();
        let mut base = vec![0u32; order.len() * h];
        for (j, &i) in order.iter().enumerate() {
            for &(n, c) in &jobs[i].current_hosts {
                if n < h {
                    base[j * h + n] += c;
                }
            }
        }
        let problem = Problem {
            jobs: infos,
            host_gpus,
            base: base.clone(),
            scale: share * h as f64,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(mix(self.seed, cluster.now));
        let mut start = base;
        problem.repair(&mut start, &mut rng);
        let mut population: Vec<(Vec<u32>, f64)> = vec![(start.clone(), problem.value(&start))];
        let size = self.population.max(2);
        for _ in 0..self.generations {
            let mut children = Vec::with_capacity(size);
            while children.len() < size {
                let pick = |rng: &mut ChaCha8Rng| {
                    let a = rng.gen_range(0..population.len());
                    let b = rng.gen_range(0..population.len());
                    if population[a].1 >= population[b].1 {
                        a
                    } else {
                        b
                    }
                };
                let (pa, pb) = (pick(&mut rng), pick(&mut rng));
                let point = rng.gen_range(0..problem.jobs.len()) * h;
                let (a, b) = (&population[pa].0, &population[pb].0);
                let mut c1: Vec<u32> = a[..point].iter().chain(&b[point..]).copied().collect();
                let mut c2: Vec<u32> = b[..point].iter().chain(&a[point..]).copied().collect();
                for c in [&mut c1, &mut c2] {
                    problem.mutate(c, &mut rng);
                    problem.repair(c, &mut rng);
                }
                children.push(c1);
                children.push(c2);
            }
            for c in children {
                let v = problem.value(&c);
                population.push((c, v));
            }
            population.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            population.dedup_by(|a, b| a.0 == b.0);
            population.truncate(size);
        }
        let best = &population[0].0;
        for (j, &i) in order.iter().enumerate() {
            let row = problem.row(best, j);
            let workers: u32 = row.iter().sum();
            if workers == 0 {
                continue;
            }
            decision.workers.insert(jobs[i].id.clone(), workers);
            decision.hosts.insert(
                jobs[i].id.clone(),
                row.iter()
                    .enumerate()
                    .filter(|(_, c)| **c > 0)
                    .map(|(n, c)| (n, *c))
                    .collect(),
            );
        }
        Some(decision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::goodput::{BatchLimits, GoodputFn, GradientStats};
    use crate::policies::test_support::{cluster, job};
    use crate::throughput::{StepObservation, ThroughputModel, ThroughputPrior};

    fn scaling_job(name: &str, submitted_at: f64, noise: f64) -> PolicyJob {
        let obs: Vec<StepObservation> = [(1, 1), (2, 1), (4, 1), (8, 2)]
            .iter()
            .map(|&(w, n)| StepObservation {
                workers: w,
                nodes: n,
                local_batch: 64.0,
                step_time_s: 0.2 + 0.01 * f64::from(w) + if n > 1 { 0.1 } else { 0.0 },
                sync_time_s: None,
            })
            .collect();
        let mut j = job(name, submitted_at, 1, 32);
        j.goodput = Some(GoodputFn {
            model: ThroughputModel::fit(&obs, &ThroughputPrior::default()),
            gradient: GradientStats::new(1.0, noise),
            limits: BatchLimits::new(64, 4096, 16, 128).unwrap(),
        });
        j
    }

    fn hosts_cluster() -> (ClusterView, Vec<u32>) {
        let mut c = cluster(16);
        c.gpus_per_node = 4;
        (c, vec![4; 4])
    }

    /// The restart penalty uses the job's measured restart cost when it has one (as every
    /// policy is told), else `restart_cost_s`.
    #[test]
    fn the_restart_penalty_uses_the_measured_restart_cost() {
        let (mut c, hosts) = hosts_cluster();
        c.now = 600.0;
        let mut j = scaling_job("a", 0.0, 10.0);
        j.restarts = 2;
        let p = Pollux::default();
        let factor = |j: &PolicyJob| p.job_info(&c, j, (4, 1), hosts.len()).restart_factor;
        // Default 30 s: (600 − 2·30) / (600 + 30).
        assert!((factor(&j) - 540.0 / 630.0).abs() < 1e-12, "{}", factor(&j));
        j.restart_cost_s = Some(120.0);
        assert!((factor(&j) - 360.0 / 720.0).abs() < 1e-12, "{}", factor(&j));
        // A cost that is not a number falls back to the default.
        j.restart_cost_s = Some(f64::NAN);
        assert!((factor(&j) - 540.0 / 630.0).abs() < 1e-12, "{}", factor(&j));
    }

    #[test]
    fn every_job_gets_something_and_capacity_holds() {
        let (c, hosts) = hosts_cluster();
        let jobs: Vec<PolicyJob> = (0..6)
            .map(|i| scaling_job(&format!("j{i}"), f64::from(i), 10.0))
            .collect();
        let d = Pollux::default()
            .allocate_on_hosts(&c, &hosts, &jobs)
            .unwrap();
        assert_eq!(d.workers.len(), 6);
        assert!(d.workers.values().all(|&w| w >= 1), "{d:?}");
        let mut used = [0u32; 4];
        for placed in d.hosts.values() {
            for &(n, w) in placed {
                used[n] += w;
            }
        }
        assert!(used.iter().all(|&u| u <= 4), "{used:?}");
        // At most one multi-host job per host.
        let mut multi = [0u32; 4];
        for placed in d.hosts.values().filter(|p| p.len() > 1) {
            for &(n, _) in placed {
                multi[n] += 1;
            }
        }
        assert!(multi.iter().all(|&m| m <= 1), "{multi:?}");
    }

    #[test]
    fn a_lone_scalable_job_grows_to_twice_what_was_measured() {
        let (c, hosts) = hosts_cluster();
        let d = Pollux::default()
            .allocate_on_hosts(&c, &hosts, &[scaling_job("a", 0.0, 100.0)])
            .unwrap();
        assert_eq!(
            d.workers[&converge_common::JobId::new("a").unwrap()],
            16,
            "{d:?}"
        );
    }

    #[test]
    fn a_selector_job_gets_workers_on_its_hosts_only() {
        let (c, hosts) = hosts_cluster();
        for eligible in [vec![1], vec![0, 3], vec![]] {
            let mut jobs: Vec<PolicyJob> = (0..3)
                .map(|i| scaling_job(&format!("j{i}"), f64::from(i), 100.0))
                .collect();
            jobs[0].eligible_hosts = Some(eligible.clone());
            // Its current allocation on a host it may no longer use is dropped too.
            jobs[0].current_hosts = vec![(2, 2)];
            jobs[0].current_workers = 2;
            let d = Pollux::default()
                .allocate_on_hosts(&c, &hosts, &jobs)
                .unwrap();
            let placed = d.hosts.get(&jobs[0].id).cloned().unwrap_or_default();
            assert!(
                placed.iter().all(|(n, _)| eligible.contains(n)),
                "{eligible:?}: {placed:?}"
            );
            let workers: u32 = placed.iter().map(|(_, w)| w).sum();
            assert_eq!(d.workers[&jobs[0].id], workers);
            if !eligible.is_empty() {
                assert!(workers >= 1, "{eligible:?}: {d:?}");
            }
        }
    }

    #[test]
    fn decisions_are_reproducible() {
        let (c, hosts) = hosts_cluster();
        let jobs: Vec<PolicyJob> = (0..5)
            .map(|i| scaling_job(&format!("j{i}"), f64::from(i), 5.0))
            .collect();
        let p = Pollux::default();
        assert_eq!(
            p.allocate_on_hosts(&c, &hosts, &jobs),
            p.allocate_on_hosts(&c, &hosts, &jobs)
        );
    }
}

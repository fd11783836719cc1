//! Offline makespan scheduling of ring-all-reduce jobs on a GPU cluster with NIC contention:
//! SJF-BCO, a first-fit FIFO baseline, and an exact search to check both against (design
//! brief §5.2–5.3).
//!
//! # Source
//!
//! Yu, Ji, Rajan, Liu, "On Scheduling Ring-All-Reduce Learning Jobs in Multi-Tenant GPU
//! Clusters with Communication Contention", MobiHoc'22: minimize the makespan of a batch of
//! ring-all-reduce jobs; *Smallest Job First* by estimated GPU-time, each job placed so as to
//! *Balance Contention and Overhead* (BCO), searching the contention threshold `κ` as their
//! LWF-κ does and keeping the best schedule. The paper's full text (its ILP reformulation and
//! the constants of its approximation ratio) is not at hand; this module implements that
//! framing on the step-time model of [`converge_sched::contention`], and measures the result against
//! exact optima on small instances ([`optimal`], `converge-sim makespan-bench`) instead
//! of relying on the paper's bound.
//!
//! # Model (units: GPUs, steps, seconds)
//!
//! An [`Instance`] is `servers` identical servers of `gpus_per_server` GPUs each and a batch
//! of jobs, all present at time 0. A job ([`MakespanJob`]) needs `gpus` GPUs (one worker per
//! GPU), runs `iterations` steps and never changes size or place once started (gang,
//! non-preemptive). Its placement is the number of its GPUs on each server; it spans the
//! servers where that number is positive and is *multi-server* when it spans more than one.
//!
//! Its seconds per step, at any moment, are [`JobCost::step_time_s`]`(spanned, contention)`:
//! on one server `compute + intra_sync`, whatever else runs; across `n > 1` servers
//! `compute + overhead·(n − 1) + sync·c`, where the *contention* `c` is the largest number of
//! running multi-server jobs (itself included) on any server it spans: the rings sharing the
//! busiest NIC split its bandwidth.
//!
//! A schedule is simulated event by event ([`evaluate`]): between two events (a start or a
//! finish) every running job progresses at `1 / step_time` steps per second under the
//! contention of that interval; rates are recomputed at every event. The *makespan* is the
//! last finish. All times are in seconds from 0.
//!
//! # List scheduling ([`list_schedule`])
//!
//! Given an order of the jobs and a [`PlacementRule`], at time 0 and at every finish the
//! scheduler walks the jobs not yet started in order and starts each for which the rule finds
//! a placement in the free GPUs. [`ListMode::Strict`] stops at the first job that cannot
//! start (it blocks all later ones, the classic list scheduling that approximation bounds
//! such as Graham's are proved for); [`ListMode::Backfill`] skips it and tries the later
//! ones. **SJF-BCO uses strict order**, as the paper's list scheduling does; backfilling is
//! available for comparison.
//!
//! Placement rules ([`PlacementRule`]):
//!
//! - **First fit**: servers in index order, each filled as far as the job needs before the
//!   next is used (as [`converge_sched::placement::place`] does with hosts in id order); the job
//!   waits if fewer GPUs than it needs are free in total.
//! - **BCO-κ**: a job that fits on one server goes there, best fit (the server with the
//!   fewest free GPUs that still hold it; ties: lowest index), adding no NIC contention.
//!   Otherwise the candidates are the servers carrying fewer than `κ` multi-server jobs,
//!   taken by most free GPUs first (ties: lowest index) until the job fits, so every NIC it
//!   uses carries at most `κ` rings afterwards; if the candidates cannot hold it, it waits.
//!   Small `κ` avoids contention at the price of spanning more servers (or waiting); large
//!   `κ` packs jobs onto fewer servers that share NICs. A server carrying
//!   `gpus_per_server` multi-server jobs has no free GPU, so every `κ ≥ gpus_per_server`
//!   behaves like `κ = gpus_per_server` (no threshold).
//!
//! # SJF-BCO ([`sjf_bco`])
//!
//! 1. Order the jobs by estimated size, smallest first ([`MakespanJob::estimated_gpu_seconds`]):
//!    `gpus × iterations × step_time(fewest servers, contention 1)` GPU-seconds, the fewest
//!    servers being `⌈gpus / gpus_per_server⌉`; ties by index.
//! 2. For each `κ = 1, …, gpus_per_server` (every distinct threshold; see above), run the
//!    strict list scheduler in that order with BCO-κ.
//! 3. Keep the schedule with the smallest makespan (ties: the smallest `κ`).
//!
//! Cost: `O(gpus_per_server · jobs² · servers · log servers)` per instance; well under a
//! millisecond for 30 jobs on 16 servers.
//!
//! The baseline [`fifo_first_fit`] runs the jobs in their given (arrival) order, strict, with
//! first fit, as the `fifo` policy with first-fit placement does online.
//!
//! # The exact optimum ([`optimal`]) and what "exact" means
//!
//! [`optimal`] returns a schedule of minimum makespan among the **event-start schedules**: the
//! non-preemptive schedules in which every job starts at time 0 or at the moment some other
//! job finishes, each on any placement (any number of its GPUs on any server with room).
//! Depth-first branch and bound: at each event, start any subset of the waiting jobs on any
//! placements that fit (jobs started at the same moment are chosen in index order, so each
//! subset is visited once), or let time run to the next finish. Pruning, none of which loses
//! an optimum of that class:
//!
//! - **Server symmetry.** Servers holding exactly the same running jobs with the same number
//!   of GPUs each (in particular, empty servers) are interchangeable, so within each such
//!   class only placements with non-increasing GPU counts in server-index order are tried.
//! - **Identical jobs** (same GPUs, iterations and cost) start in index order.
//! - **Bound.** A branch is cut when `now + max(longest remaining job, remaining GPU-seconds
//!   / GPUs)` cannot beat the best makespan so far, with every remaining duration taken at
//!   contention 1 on its fastest possible span (a lower bound, since contention never makes
//!   a step faster). The incumbent starts as the best of the list schedules (SJF and FIFO
//!   orders, first fit and every BCO-κ, strict and backfilling), all of which are
//!   event-start schedules.
//!
//! So `optimal(i).makespan_s ≤` the makespan of **every list schedule** of `i` (any order,
//! any placement rule, strict or backfilling: list schedulers only act at time 0 and at
//! finishes), which is what the ratios of `makespan-bench` compare against; improvements
//! smaller than a relative `1e-12` are not pursued.
//!
//! It is **not claimed to be the optimum over all schedules**: starting a job on purpose at a
//! moment when nothing finishes is not explored. If step times did not depend on the other
//! jobs (no contention term), moving each job, in start order, back to the last finish (or
//! 0) before its start would keep every GPU free when used and never delay a finish, so
//! event-start schedules would contain an optimum; here starting a multi-server job earlier
//! can slow the jobs sharing its NICs and delay their finishes, and we have no proof that
//! such a delay never pays off.
//!
//! The search is exponential. On `makespan-bench`'s 600 default-shaped instances (2–6 jobs
//! of 1–8 GPUs, 3–4 servers of 4 GPUs, release build) it took 0.2 s on average for 6 jobs
//! and 5.2 s (11.5 million nodes) at worst. [`optimal_with_limit`] caps the nodes visited
//! and says whether the result is proven.
//!
//! Everything here is pure: no I/O, no clock, no randomness, deterministic (the bench that
//! prints and times is `converge-sim makespan-bench`).

use std::cmp::Ordering;

use converge_sched::contention::JobCost;

/// One job of an [`Instance`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MakespanJob {
    /// GPUs the job needs, one per worker, all started together.
    pub gpus: u32,
    /// Steps to run.
    pub iterations: f64,
    /// Seconds per step as a function of the placement ([`JobCost::step_time_s`]).
    pub cost: JobCost,
}

impl MakespanJob {
    /// A job of `gpus` GPUs running `iterations` steps at `cost`.
    pub fn new(gpus: u32, iterations: f64, cost: JobCost) -> Self {
        Self {
            gpus,
            iterations,
            cost,
        }
    }

    /// The fewest servers of `gpus_per_server` GPUs the job fits on: `⌈gpus / gpus_per_server⌉`.
    pub fn fewest_servers(&self, gpus_per_server: u32) -> u32 {
        self.gpus.div_ceil(gpus_per_server.max(1))
    }

    /// SJF-BCO's estimated size, in GPU-seconds: `gpus × iterations × step_time(fewest
    /// servers, contention 1)`.
    pub fn estimated_gpu_seconds(&self, gpus_per_server: u32) -> f64 {
        let step = self
            .cost
            .step_time_s(self.fewest_servers(gpus_per_server), 1);
        f64::from(self.gpus) * self.iterations * step
    }
}

/// Why an [`Instance`] was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InstanceError {
    #[error("the cluster has no GPUs ({servers} servers × {gpus_per_server} GPUs)")]
    NoGpus { servers: u32, gpus_per_server: u32 },
    #[error("job {job} needs {gpus} GPUs; a job needs 1 to {capacity} (the cluster's GPUs)")]
    Gpus {
        job: usize,
        gpus: u32,
        capacity: u64,
    },
    #[error("job {job}: iterations {iterations} is not a finite non-negative number")]
    Iterations { job: usize, iterations: f64 },
}

/// A makespan problem: identical servers and a batch of jobs present at time 0. Every job
/// fits in the empty cluster (checked by [`Instance::new`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Instance {
    servers: u32,
    gpus_per_server: u32,
    jobs: Vec<MakespanJob>,
}

impl Instance {
    /// `servers` servers of `gpus_per_server` GPUs and `jobs`. Refused: a cluster without
    /// GPUs, a job with 0 GPUs or more than the cluster has, iterations that are not finite
    /// and non-negative.
    pub fn new(
        servers: u32,
        gpus_per_server: u32,
        jobs: Vec<MakespanJob>,
    ) -> Result<Self, InstanceError> {
        let capacity = u64::from(servers) * u64::from(gpus_per_server);
        if capacity == 0 {
            return Err(InstanceError::NoGpus {
                servers,
                gpus_per_server,
            });
        }
        for (job, j) in jobs.iter().enumerate() {
            if j.gpus == 0 || u64::from(j.gpus) > capacity {
                return Err(InstanceError::Gpus {
                    job,
                    gpus: j.gpus,
                    capacity,
                });
            }
            if !(j.iterations.is_finite() && j.iterations >= 0.0) {
                return Err(InstanceError::Iterations {
                    job,
                    iterations: j.iterations,
                });
            }
        }
        Ok(Self {
            servers,
            gpus_per_server,
            jobs,
        })
    }

    pub fn servers(&self) -> u32 {
        self.servers
    }

    pub fn gpus_per_server(&self) -> u32 {
        self.gpus_per_server
    }

    pub fn jobs(&self) -> &[MakespanJob] {
        &self.jobs
    }

    /// All GPUs of the cluster.
    pub fn capacity(&self) -> u64 {
        u64::from(self.servers) * u64::from(self.gpus_per_server)
    }

    /// A lower bound on any schedule's makespan: the longest job alone and the total
    /// GPU-seconds over the cluster's GPUs, each job at contention 1 on its fastest span.
    pub fn lower_bound_s(&self) -> f64 {
        let durations: Vec<f64> = (0..self.jobs.len())
            .map(|j| self.jobs[j].iterations * self.fastest_step_s(j))
            .collect();
        let longest = durations.iter().copied().fold(0.0, f64::max);
        let area: f64 = durations
            .iter()
            .zip(&self.jobs)
            .map(|(d, j)| d * f64::from(j.gpus))
            .sum();
        longest.max(area / self.capacity() as f64)
    }

    /// The fastest step job `j` can ever run at: contention 1, on the number of servers
    /// (one, or the fewest beyond one it can span) that minimizes the step time.
    fn fastest_step_s(&self, j: usize) -> f64 {
        let job = &self.jobs[j];
        let fewest = job.fewest_servers(self.gpus_per_server);
        let multi = job.cost.step_time_s(fewest.max(2), 1);
        if fewest <= 1 {
            let one = job.cost.step_time_s(1, 1);
            // A job of one GPU cannot span two servers.
            if job.gpus >= 2 && self.servers >= 2 {
                one.min(multi)
            } else {
                one
            }
        } else {
            multi
        }
    }
}

/// Where and when one job ran.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledJob {
    /// Start, seconds from 0.
    pub start_s: f64,
    /// Finish, seconds from 0.
    pub finish_s: f64,
    /// The job's GPUs on each server (index = server); sums to the job's `gpus`.
    pub placement: Vec<u32>,
}

impl ScheduledJob {
    /// Servers the job spans.
    pub fn servers_spanned(&self) -> u32 {
        self.placement.iter().filter(|&&g| g > 0).count() as u32
    }
}

/// A complete schedule: every job of the instance, indexed like its jobs.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub jobs: Vec<ScheduledJob>,
    /// The last finish, seconds (0 without jobs).
    pub makespan_s: f64,
}

impl Schedule {
    /// The start and placement of every job, as [`evaluate`] takes them.
    pub fn plan(&self) -> Vec<PlannedJob> {
        self.jobs
            .iter()
            .map(|j| PlannedJob {
                start_s: j.start_s,
                placement: j.placement.clone(),
            })
            .collect()
    }

    /// Job indices by start time (ties: index).
    pub fn start_order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.jobs.len()).collect();
        order.sort_by(|&a, &b| self.jobs[a].start_s.total_cmp(&self.jobs[b].start_s));
        order
    }
}

/// One job's start and placement, the input of [`evaluate`].
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedJob {
    pub start_s: f64,
    /// GPUs on each server (index = server).
    pub placement: Vec<u32>,
}

/// Why [`evaluate`] refused a plan.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("the plan has {planned} jobs, the instance {jobs}")]
    Jobs { planned: usize, jobs: usize },
    #[error("job {job}: the placement must list every server and sum to the job's GPUs")]
    Placement { job: usize },
    #[error("job {job}: start {start_s} is not a finite non-negative time")]
    Start { job: usize, start_s: f64 },
    #[error("job {job} starts at {time_s} s on GPUs that are not free")]
    Capacity { job: usize, time_s: f64 },
}

/// How a list scheduler treats a job that cannot start yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ListMode {
    /// It blocks every later job until it starts (SJF-BCO's mode).
    #[default]
    Strict,
    /// Later jobs that can start do.
    Backfill,
}

/// Where a list scheduler puts a job (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacementRule {
    /// Servers in index order, each filled before the next.
    FirstFit,
    /// Best fit on one server, else the servers with fewer than `kappa` multi-server jobs,
    /// most free GPUs first.
    Bco { kappa: u32 },
}

/// Relative tolerance under which two finishes count as simultaneous.
const SAME_TIME: f64 = 1e-10;

/// A running job.
#[derive(Debug, Clone, Copy)]
struct Running {
    job: usize,
    /// Servers spanned.
    servers: u32,
    /// Steps left.
    remaining: f64,
}

/// The state of a schedule being built: time, free GPUs, contention, running jobs.
#[derive(Debug, Clone)]
struct Sim<'a> {
    instance: &'a Instance,
    time: f64,
    free: Vec<u32>,
    /// Running multi-server jobs per server.
    multi: Vec<u32>,
    running: Vec<Running>,
    /// Per job; empty until started.
    placement: Vec<Vec<u32>>,
    start: Vec<f64>,
    finish: Vec<f64>,
    started: Vec<bool>,
    unstarted: usize,
}

impl<'a> Sim<'a> {
    fn new(instance: &'a Instance) -> Self {
        let n = instance.jobs.len();
        let servers = instance.servers as usize;
        Self {
            instance,
            time: 0.0,
            free: vec![instance.gpus_per_server; servers],
            multi: vec![0; servers],
            running: Vec::new(),
            placement: vec![Vec::new(); n],
            start: vec![f64::NAN; n],
            finish: vec![f64::NAN; n],
            started: vec![false; n],
            unstarted: n,
        }
    }

    fn fits(&self, placement: &[u32]) -> bool {
        placement.len() == self.free.len() && placement.iter().zip(&self.free).all(|(p, f)| p <= f)
    }

    /// Starts `job` now on `placement` (which fits).
    fn start(&mut self, job: usize, placement: Vec<u32>) {
        let servers = placement.iter().filter(|&&g| g > 0).count() as u32;
        for (s, &g) in placement.iter().enumerate() {
            self.free[s] -= g;
            if servers > 1 && g > 0 {
                self.multi[s] += 1;
            }
        }
        self.running.push(Running {
            job,
            servers,
            remaining: self.instance.jobs[job].iterations,
        });
        self.placement[job] = placement;
        self.start[job] = self.time;
        self.started[job] = true;
        self.unstarted -= 1;
    }

    /// Seconds per step of `r` under the current contention.
    fn step_s(&self, r: &Running) -> f64 {
        let cost = &self.instance.jobs[r.job].cost;
        if r.servers <= 1 {
            return cost.step_time_s(1, 1);
        }
        let contention = self.placement[r.job]
            .iter()
            .zip(&self.multi)
            .filter(|(g, _)| **g > 0)
            .map(|(_, &m)| m)
            .max()
            .unwrap_or(1);
        cost.step_time_s(r.servers, contention)
    }

    /// Lets time run to the next finish, or to `until` if that comes first (then nothing
    /// finishes). With nothing running, time jumps to `until` (if finite).
    fn advance(&mut self, until: f64) {
        if self.running.is_empty() {
            if until.is_finite() {
                self.time = self.time.max(until);
            }
            return;
        }
        let steps: Vec<f64> = self.running.iter().map(|r| self.step_s(r)).collect();
        let to_finish: Vec<f64> = self
            .running
            .iter()
            .zip(&steps)
            .map(|(r, s)| r.remaining * s)
            .collect();
        let next = to_finish.iter().copied().fold(f64::INFINITY, f64::min);
        if until.is_finite() && self.time + next > until + SAME_TIME * until.abs().max(1.0) {
            let dt = (until - self.time).max(0.0);
            for (r, s) in self.running.iter_mut().zip(&steps) {
                if *s > 0.0 {
                    r.remaining = (r.remaining - dt / s).max(0.0);
                }
            }
            self.time = until;
            return;
        }
        self.time += next;
        let mut kept = Vec::with_capacity(self.running.len());
        let mut done = Vec::new();
        for ((r, s), t) in self.running.iter().zip(&steps).zip(&to_finish) {
            if *t <= next * (1.0 + SAME_TIME) {
                done.push(r.job);
            } else {
                let mut r = *r;
                r.remaining = (r.remaining - next / s).max(0.0);
                kept.push(r);
            }
        }
        self.running = kept;
        for job in done {
            self.finish[job] = self.time;
            let multi_server = self.placement[job].iter().filter(|&&g| g > 0).count() > 1;
            for (s, &g) in self.placement[job].iter().enumerate() {
                self.free[s] += g;
                if multi_server && g > 0 {
                    self.multi[s] -= 1;
                }
            }
        }
    }

    /// Runs the started jobs to completion.
    fn run_out(&mut self) {
        while !self.running.is_empty() {
            self.advance(f64::INFINITY);
        }
    }

    fn into_schedule(self) -> Schedule {
        let jobs: Vec<ScheduledJob> = (0..self.instance.jobs.len())
            .map(|j| ScheduledJob {
                start_s: self.start[j],
                finish_s: self.finish[j],
                placement: self.placement[j].clone(),
            })
            .collect();
        let makespan_s = jobs.iter().map(|j| j.finish_s).fold(0.0, f64::max);
        Schedule { jobs, makespan_s }
    }

    /// Where `rule` puts `job` now, if anywhere.
    fn place(&self, job: usize, rule: PlacementRule) -> Option<Vec<u32>> {
        let need = self.instance.jobs[job].gpus;
        let total: u64 = self.free.iter().map(|&f| u64::from(f)).sum();
        if u64::from(need) > total {
            return None;
        }
        let mut placement = vec![0u32; self.free.len()];
        match rule {
            PlacementRule::FirstFit => {
                let mut left = need;
                for (s, &f) in self.free.iter().enumerate() {
                    let take = f.min(left);
                    placement[s] = take;
                    left -= take;
                    if left == 0 {
                        break;
                    }
                }
                Some(placement)
            }
            PlacementRule::Bco { kappa } => {
                let best_fit = (0..self.free.len())
                    .filter(|&s| self.free[s] >= need)
                    .min_by_key(|&s| (self.free[s], s));
                if let Some(s) = best_fit {
                    placement[s] = need;
                    return Some(placement);
                }
                let mut candidates: Vec<usize> = (0..self.free.len())
                    .filter(|&s| self.multi[s] < kappa && self.free[s] > 0)
                    .collect();
                candidates.sort_by_key(|&s| (std::cmp::Reverse(self.free[s]), s));
                let mut left = need;
                for s in candidates {
                    let take = self.free[s].min(left);
                    placement[s] = take;
                    left -= take;
                    if left == 0 {
                        return Some(placement);
                    }
                }
                None
            }
        }
    }
}

/// `order` made a permutation of `0..n`: valid first occurrences, then the missing jobs in
/// index order.
fn complete_order(order: &[usize], n: usize) -> Vec<usize> {
    let mut seen = vec![false; n];
    let mut out = Vec::with_capacity(n);
    for &j in order.iter().chain(&(0..n).collect::<Vec<_>>()) {
        if j < n && !seen[j] {
            seen[j] = true;
            out.push(j);
        }
    }
    out
}

/// The list schedule of `instance` in `order` (a permutation of the job indices; invalid and
/// repeated entries are ignored and missing jobs go last, in index order) with `rule`, in
/// `mode` (see the module documentation).
pub fn list_schedule(
    instance: &Instance,
    order: &[usize],
    rule: PlacementRule,
    mode: ListMode,
) -> Schedule {
    let mut pending = complete_order(order, instance.jobs.len());
    let mut sim = Sim::new(instance);
    loop {
        let mut i = 0;
        while i < pending.len() {
            let job = pending[i];
            if let Some(placement) = sim.place(job, rule) {
                sim.start(job, placement);
                pending.remove(i);
            } else if mode == ListMode::Strict {
                break;
            } else {
                i += 1;
            }
        }
        if sim.running.is_empty() {
            // Every job fits in the empty cluster under every rule (κ ≥ 1 admits every
            // server there), so nothing is left.
            debug_assert!(pending.is_empty());
            break;
        }
        sim.advance(f64::INFINITY);
    }
    sim.into_schedule()
}

/// SJF's order: by [`MakespanJob::estimated_gpu_seconds`], smallest first, ties by index.
pub fn sjf_order(instance: &Instance) -> Vec<usize> {
    let sizes: Vec<f64> = instance
        .jobs
        .iter()
        .map(|j| j.estimated_gpu_seconds(instance.gpus_per_server))
        .collect();
    let mut order: Vec<usize> = (0..instance.jobs.len()).collect();
    order.sort_by(|&a, &b| sizes[a].total_cmp(&sizes[b]).then(a.cmp(&b)));
    order
}

/// The distinct BCO thresholds: `1..=gpus_per_server`.
fn kappas(instance: &Instance) -> std::ops::RangeInclusive<u32> {
    1..=instance.gpus_per_server.max(1)
}

/// The best list schedule in `order` over BCO-κ for every distinct `κ` (`1..=gpus_per_server`),
/// in `mode`, with the `κ` that produced it (ties: the smallest).
pub fn bco_over_kappa(instance: &Instance, order: &[usize], mode: ListMode) -> (u32, Schedule) {
    let mut best: Option<(u32, Schedule)> = None;
    for kappa in kappas(instance) {
        let schedule = list_schedule(instance, order, PlacementRule::Bco { kappa }, mode);
        if best
            .as_ref()
            .is_none_or(|(_, b)| schedule.makespan_s < b.makespan_s)
        {
            best = Some((kappa, schedule));
        }
    }
    best.unwrap_or_else(|| (1, Sim::new(instance).into_schedule()))
}

/// SJF-BCO in `mode`: [`bco_over_kappa`] in [`sjf_order`].
pub fn sjf_bco_with(instance: &Instance, mode: ListMode) -> (u32, Schedule) {
    bco_over_kappa(instance, &sjf_order(instance), mode)
}

/// SJF-BCO (see the module documentation): strict list order.
pub fn sjf_bco(instance: &Instance) -> Schedule {
    sjf_bco_with(instance, ListMode::Strict).1
}

/// FIFO with first fit: the jobs in index (arrival) order, strict.
pub fn fifo_first_fit(instance: &Instance) -> Schedule {
    let order: Vec<usize> = (0..instance.jobs.len()).collect();
    list_schedule(instance, &order, PlacementRule::FirstFit, ListMode::Strict)
}

/// Simulates `plan` (a start and a placement per job, indexed like the instance's jobs)
/// under the contention model, and returns the schedule with its finishes. Jobs starting at
/// the moment others finish get the freed GPUs (finishes first, within a relative `1e-10`).
pub fn evaluate(instance: &Instance, plan: &[PlannedJob]) -> Result<Schedule, PlanError> {
    let n = instance.jobs.len();
    if plan.len() != n {
        return Err(PlanError::Jobs {
            planned: plan.len(),
            jobs: n,
        });
    }
    for (job, p) in plan.iter().enumerate() {
        let sum: u64 = p.placement.iter().map(|&g| u64::from(g)).sum();
        if p.placement.len() != instance.servers as usize
            || sum != u64::from(instance.jobs[job].gpus)
        {
            return Err(PlanError::Placement { job });
        }
        if !(p.start_s.is_finite() && p.start_s >= 0.0) {
            return Err(PlanError::Start {
                job,
                start_s: p.start_s,
            });
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| plan[a].start_s.total_cmp(&plan[b].start_s).then(a.cmp(&b)));
    let mut sim = Sim::new(instance);
    let mut next = 0;
    while next < n || !sim.running.is_empty() {
        let now = sim.time + SAME_TIME * sim.time.max(1.0);
        let due: Vec<usize> = order[next..]
            .iter()
            .copied()
            .take_while(|&j| plan[j].start_s <= now)
            .collect();
        next += due.len();
        // Jobs that take no time first: their GPUs are busy for an instant only, so at the
        // same moment others may start on them after they are done.
        let (instant, mut due): (Vec<usize>, Vec<usize>) = due.into_iter().partition(|&job| {
            let spanned = plan[job].placement.iter().filter(|&&g| g > 0).count() as u32;
            let j = &instance.jobs[job];
            j.iterations == 0.0 || j.cost.step_time_s(spanned, 1) == 0.0
        });
        for job in instant {
            if !sim.fits(&plan[job].placement) {
                sim.advance(sim.time);
            }
            if !sim.fits(&plan[job].placement) {
                return Err(PlanError::Capacity {
                    job,
                    time_s: sim.time,
                });
            }
            sim.start(job, plan[job].placement.clone());
            sim.start[job] = plan[job].start_s.min(sim.time);
            sim.advance(sim.time);
        }
        // Then what fits; when nothing does, the jobs finishing at this moment go first.
        while !due.is_empty() {
            let waiting = due.len();
            due.retain(|&job| {
                if !sim.fits(&plan[job].placement) {
                    return true;
                }
                sim.start(job, plan[job].placement.clone());
                // The plan's start, not the (possibly slightly later) simulated time.
                sim.start[job] = plan[job].start_s.min(sim.time);
                false
            });
            if due.len() < waiting {
                continue;
            }
            let running = sim.running.len();
            sim.advance(sim.time);
            if sim.running.len() == running {
                return Err(PlanError::Capacity {
                    job: due[0],
                    time_s: sim.time,
                });
            }
        }
        let until = order.get(next).map_or(f64::INFINITY, |&j| plan[j].start_s);
        sim.advance(until);
    }
    Ok(sim.into_schedule())
}

/// The result of [`optimal_with_limit`].
#[derive(Debug, Clone, PartialEq)]
pub struct Optimum {
    /// The best schedule found.
    pub schedule: Schedule,
    /// Search nodes visited.
    pub nodes: u64,
    /// Whether the search finished, so that `schedule` is optimal among event-start
    /// schedules (see the module documentation); `false` when the node limit stopped it.
    pub proven: bool,
}

/// The minimum-makespan event-start schedule (see the module documentation for exactly what
/// is optimal). Exponential time; meant for up to about 6 jobs on 3–4 servers of 4 GPUs.
pub fn optimal(instance: &Instance) -> Schedule {
    optimal_with_limit(instance, u64::MAX).schedule
}

/// As [`optimal`], visiting at most `max_nodes` search nodes; the result says whether it is
/// proven optimal. Never worse than the best list schedule of SJF and FIFO order.
pub fn optimal_with_limit(instance: &Instance, max_nodes: u64) -> Optimum {
    let n = instance.jobs.len();
    let min_duration: Vec<f64> = (0..n)
        .map(|j| instance.jobs[j].iterations * instance.fastest_step_s(j))
        .collect();
    let first_identical: Vec<usize> = (0..n)
        .map(|j| {
            (0..j)
                .find(|&k| instance.jobs[k] == instance.jobs[j])
                .unwrap_or(j)
        })
        .collect();
    let mut search = Search {
        instance,
        min_duration,
        first_identical,
        best: incumbent(instance),
        nodes: 0,
        max_nodes,
        stopped: false,
    };
    search.dfs(Sim::new(instance), 0);
    Optimum {
        schedule: search.best,
        nodes: search.nodes,
        proven: !search.stopped,
    }
}

/// The best list schedule of the SJF and FIFO orders, first fit and every BCO-κ, strict and
/// backfilling.
fn incumbent(instance: &Instance) -> Schedule {
    let fifo: Vec<usize> = (0..instance.jobs.len()).collect();
    let sjf = sjf_order(instance);
    let rules: Vec<PlacementRule> = std::iter::once(PlacementRule::FirstFit)
        .chain(kappas(instance).map(|kappa| PlacementRule::Bco { kappa }))
        .collect();
    let mut best: Option<Schedule> = None;
    for order in [&sjf, &fifo] {
        for &rule in &rules {
            for mode in [ListMode::Strict, ListMode::Backfill] {
                let s = list_schedule(instance, order, rule, mode);
                if best.as_ref().is_none_or(|b| s.makespan_s < b.makespan_s) {
                    best = Some(s);
                }
            }
        }
    }
    best.unwrap_or_else(|| Sim::new(instance).into_schedule())
}

/// Branch and bound over event-start schedules.
struct Search<'a> {
    instance: &'a Instance,
    /// Each job's shortest possible duration (fastest step × iterations).
    min_duration: Vec<f64>,
    /// The lowest index of a job identical to each job.
    first_identical: Vec<usize>,
    best: Schedule,
    nodes: u64,
    max_nodes: u64,
    stopped: bool,
}

impl Search<'_> {
    /// Whether a branch whose makespan is at least `bound` can still improve on the best.
    fn promising(&self, bound: f64) -> bool {
        bound < self.best.makespan_s * (1.0 - 1e-12)
    }

    /// Lower bound on the makespan of every completion of `sim`.
    fn bound(&self, sim: &Sim<'_>) -> f64 {
        let mut longest: f64 = 0.0;
        let mut area = 0.0;
        for r in &sim.running {
            let job = &self.instance.jobs[r.job];
            let d = r.remaining * job.cost.step_time_s(r.servers, 1);
            longest = longest.max(d);
            area += d * f64::from(job.gpus);
        }
        for (j, d) in self.min_duration.iter().enumerate() {
            if !sim.started[j] {
                longest = longest.max(*d);
                area += d * f64::from(self.instance.jobs[j].gpus);
            }
        }
        sim.time + longest.max(area / self.instance.capacity() as f64)
    }

    /// Explores every completion of `sim` in which the jobs starting now have index at least
    /// `from`.
    fn dfs(&mut self, sim: Sim<'_>, from: usize) {
        if self.stopped {
            return;
        }
        if self.nodes >= self.max_nodes {
            self.stopped = true;
            return;
        }
        self.nodes += 1;
        if sim.unstarted == 0 {
            let mut sim = sim;
            sim.run_out();
            let schedule = sim.into_schedule();
            if schedule.makespan_s < self.best.makespan_s {
                self.best = schedule;
            }
            return;
        }
        if !self.promising(self.bound(&sim)) {
            return;
        }
        for job in from..self.instance.jobs.len() {
            if sim.started[job] {
                continue;
            }
            let twin = self.first_identical[job];
            if twin != job
                && (twin..job).any(|k| !sim.started[k] && self.first_identical[k] == twin)
            {
                continue;
            }
            for placement in canonical_placements(&sim, self.instance.jobs[job].gpus) {
                let mut child = sim.clone();
                child.start(job, placement);
                self.dfs(child, job + 1);
                if self.stopped {
                    return;
                }
            }
        }
        if !sim.running.is_empty() {
            let mut child = sim;
            child.advance(f64::INFINITY);
            self.dfs(child, 0);
        }
    }
}

/// Every placement of `gpus` GPUs on the free GPUs of `sim`, up to the symmetry of servers
/// that hold exactly the same running jobs with the same GPUs each: within each such class,
/// counts are non-increasing in server order. Fewest servers first.
fn canonical_placements(sim: &Sim<'_>, gpus: u32) -> Vec<Vec<u32>> {
    let servers = sim.free.len();
    let mut signatures: Vec<Vec<(usize, u32)>> = vec![Vec::new(); servers];
    for r in &sim.running {
        for (s, &g) in sim.placement[r.job].iter().enumerate() {
            if g > 0 {
                signatures[s].push((r.job, g));
            }
        }
    }
    for sig in &mut signatures {
        sig.sort_unstable();
    }
    // Classes of servers with equal signatures, by first server.
    let mut classes: Vec<Vec<usize>> = Vec::new();
    for s in 0..servers {
        if sim.free[s] == 0 {
            continue;
        }
        match classes
            .iter_mut()
            .find(|c| signatures[c[0]] == signatures[s])
        {
            Some(class) => class.push(s),
            None => classes.push(vec![s]),
        }
    }
    let slots: Vec<usize> = classes.iter().flatten().copied().collect();
    // `room[i]`: free GPUs on slots i.. (to cut hopeless branches).
    let mut room = vec![0u32; slots.len() + 1];
    for i in (0..slots.len()).rev() {
        room[i] = room[i + 1] + sim.free[slots[i]];
    }
    // The slot index where each slot's class starts.
    let mut class_start = Vec::with_capacity(slots.len());
    for class in &classes {
        let start = class_start.len();
        class_start.extend(std::iter::repeat_n(start, class.len()));
    }
    let mut out = Vec::new();
    let mut current = vec![0u32; servers];
    fill(
        sim,
        &slots,
        &class_start,
        &room,
        0,
        gpus,
        &mut current,
        &mut out,
    );
    out.sort_by(|a: &Vec<u32>, b: &Vec<u32>| {
        let span = |p: &Vec<u32>| p.iter().filter(|&&g| g > 0).count();
        span(a).cmp(&span(b)).then_with(|| b.cmp(a))
    });
    out
}

#[allow(clippy::too_many_arguments)]
fn fill(
    sim: &Sim<'_>,
    slots: &[usize],
    class_start: &[usize],
    room: &[u32],
    i: usize,
    left: u32,
    current: &mut Vec<u32>,
    out: &mut Vec<Vec<u32>>,
) {
    if left == 0 {
        out.push(current.clone());
        return;
    }
    if i == slots.len() || room[i] < left {
        return;
    }
    let server = slots[i];
    let mut most = sim.free[server].min(left);
    if class_start[i] < i {
        // Same class as the previous slot: no more than it got.
        most = most.min(current[slots[i - 1]]);
    }
    for g in (0..=most).rev() {
        current[server] = g;
        fill(sim, slots, class_start, room, i + 1, left - g, current, out);
    }
    current[server] = 0;
}

/// Compares two makespans for tables (NaN last).
pub fn cmp_f64(a: f64, b: f64) -> Ordering {
    a.total_cmp(&b)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn cost(compute: f64, overhead: f64, sync: f64) -> JobCost {
        JobCost::new(compute, overhead, sync)
    }

    fn instance(servers: u32, gpus_per_server: u32, jobs: &[(u32, f64, JobCost)]) -> Instance {
        let jobs = jobs
            .iter()
            .map(|&(g, i, c)| MakespanJob::new(g, i, c))
            .collect();
        Instance::new(servers, gpus_per_server, jobs).unwrap()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    /// Every list schedule of every order (all permutations), rule and mode.
    fn every_list_schedule(instance: &Instance) -> Vec<Schedule> {
        fn permutations(n: usize) -> Vec<Vec<usize>> {
            if n == 0 {
                return vec![Vec::new()];
            }
            let mut out = Vec::new();
            for p in permutations(n - 1) {
                for at in 0..=p.len() {
                    let mut q = p.clone();
                    q.insert(at, n - 1);
                    out.push(q);
                }
            }
            out
        }
        let mut rules = vec![PlacementRule::FirstFit];
        rules.extend(kappas(instance).map(|kappa| PlacementRule::Bco { kappa }));
        let mut out = Vec::new();
        for order in permutations(instance.jobs().len()) {
            for &rule in &rules {
                for mode in [ListMode::Strict, ListMode::Backfill] {
                    out.push(list_schedule(instance, &order, rule, mode));
                }
            }
        }
        out
    }

    /// The event-start optimum without symmetry breaking, identical-job pruning, bounds or
    /// index order among simultaneous starts: every placement, every order.
    fn brute_force(instance: &Instance) -> f64 {
        fn all_placements(
            free: &[u32],
            left: u32,
            at: usize,
            cur: &mut Vec<u32>,
            out: &mut Vec<Vec<u32>>,
        ) {
            if left == 0 {
                let mut p = cur.clone();
                p.resize(free.len(), 0);
                out.push(p);
                return;
            }
            if at == free.len() {
                return;
            }
            for g in 0..=free[at].min(left) {
                cur.push(g);
                all_placements(free, left - g, at + 1, cur, out);
                cur.pop();
            }
        }
        fn go(sim: Sim<'_>, best: &mut f64) {
            if sim.unstarted == 0 {
                let mut sim = sim;
                sim.run_out();
                *best = best.min(sim.into_schedule().makespan_s);
                return;
            }
            for job in 0..sim.instance.jobs.len() {
                if sim.started[job] {
                    continue;
                }
                let mut placements = Vec::new();
                all_placements(
                    &sim.free,
                    sim.instance.jobs[job].gpus,
                    0,
                    &mut Vec::new(),
                    &mut placements,
                );
                for p in placements {
                    let mut child = sim.clone();
                    child.start(job, p);
                    go(child, best);
                }
            }
            if !sim.running.is_empty() {
                let mut child = sim;
                child.advance(f64::INFINITY);
                go(child, best);
            }
        }
        let mut best = f64::INFINITY;
        go(Sim::new(instance), &mut best);
        best
    }

    /// Checks a schedule's consistency: every job placed with its GPUs, and re-simulating its
    /// starts and placements gives the same finishes.
    fn check(instance: &Instance, schedule: &Schedule) {
        assert_eq!(schedule.jobs.len(), instance.jobs().len());
        for (job, s) in instance.jobs().iter().zip(&schedule.jobs) {
            assert_eq!(s.placement.iter().sum::<u32>(), job.gpus);
            assert!(s.start_s >= 0.0 && s.finish_s >= s.start_s, "{s:?}");
        }
        let again = evaluate(instance, &schedule.plan()).unwrap();
        for (a, b) in again.jobs.iter().zip(&schedule.jobs) {
            assert!(close(a.finish_s, b.finish_s), "{a:?} vs {b:?}");
        }
        assert!(close(again.makespan_s, schedule.makespan_s));
        assert!(schedule.makespan_s >= instance.lower_bound_s() * (1.0 - 1e-9));
    }

    #[test]
    fn two_whole_server_jobs_run_side_by_side() {
        let i = instance(2, 4, &[(4, 100.0, cost(1.0, 0.1, 1.0)); 2]);
        for s in [optimal(&i), sjf_bco(&i), fifo_first_fit(&i)] {
            assert_eq!(s.makespan_s, 100.0);
            assert_eq!(s.jobs[0].servers_spanned(), 1);
            assert_eq!(s.jobs[1].servers_spanned(), 1);
            assert_ne!(s.jobs[0].placement, s.jobs[1].placement);
            check(&i, &s);
        }
    }

    #[test]
    fn first_fit_splits_a_job_that_bco_keeps_on_one_server() {
        // 2 servers × 4: first fit puts the 4-GPU job on 2 + 2 GPUs of both servers (step
        // 1 + 1 s), best fit keeps it whole (step 1 s).
        let c = cost(1.0, 0.0, 1.0);
        let i = instance(2, 4, &[(2, 100.0, c), (4, 100.0, c), (2, 100.0, c)]);
        let fifo = fifo_first_fit(&i);
        assert_eq!(fifo.jobs[1].placement, [2, 2]);
        assert_eq!(fifo.makespan_s, 200.0);
        let sjf = sjf_bco(&i);
        assert_eq!(sjf.makespan_s, 100.0);
        assert_eq!(sjf_order(&i), [0, 2, 1]);
        assert_eq!(optimal(&i).makespan_s, 100.0);
        check(&i, &fifo);
        check(&i, &sjf);
    }

    #[test]
    fn two_jobs_that_must_share_a_nic_run_together_at_contention_two() {
        // 3 servers × 4, two 6-GPU jobs: together they share a server's NIC (step 1 + 2·1 =
        // 3 s, both done at 300 s), one after the other they take 2·200 = 400 s.
        let c = cost(1.0, 0.0, 1.0);
        let i = instance(3, 4, &[(6, 100.0, c), (6, 100.0, c)]);
        let opt = optimal(&i);
        assert_eq!(opt.makespan_s, 300.0);
        assert_eq!(opt.jobs[0].start_s, 0.0);
        assert_eq!(opt.jobs[1].start_s, 0.0);
        // κ = 1 refuses the shared NIC and serializes (400 s); κ = 2 finds 300 s.
        let strict1 = list_schedule(
            &i,
            &[0, 1],
            PlacementRule::Bco { kappa: 1 },
            ListMode::Strict,
        );
        assert_eq!(strict1.makespan_s, 400.0);
        let (kappa, sjf) = sjf_bco_with(&i, ListMode::Strict);
        assert_eq!((kappa, sjf.makespan_s), (2, 300.0));
        assert_eq!(brute_force(&i), 300.0);
        check(&i, &opt);
    }

    #[test]
    fn rates_change_at_every_start_and_finish() {
        // Both jobs at contention 2 (3 s per step) until the short one is done at 300 s with
        // the long one at 100 of 200 steps; then 100 steps alone at 2 s: 500 s.
        let c = cost(1.0, 0.0, 1.0);
        let i = instance(3, 4, &[(6, 100.0, c), (6, 200.0, c)]);
        let plan = [
            PlannedJob {
                start_s: 0.0,
                placement: vec![4, 2, 0],
            },
            PlannedJob {
                start_s: 0.0,
                placement: vec![0, 2, 4],
            },
        ];
        let s = evaluate(&i, &plan).unwrap();
        assert!(close(s.jobs[0].finish_s, 300.0));
        assert!(close(s.jobs[1].finish_s, 500.0));
        // Starting the second at 150 s: the first runs 150 steps... no, 150 s at 2 s = 75
        // steps alone, then 25 steps at 3 s (75 s): done at 225 s; the second ran 25 steps
        // by then, 175 left at 2 s: 225 + 350 = 575 s.
        let late = [
            plan[0].clone(),
            PlannedJob {
                start_s: 150.0,
                placement: vec![0, 2, 4],
            },
        ];
        let s = evaluate(&i, &late).unwrap();
        assert!(close(s.jobs[0].finish_s, 225.0));
        assert!(close(s.jobs[1].finish_s, 575.0));
    }

    #[test]
    fn evaluate_refuses_bad_plans() {
        let c = cost(1.0, 0.0, 1.0);
        let i = instance(2, 4, &[(4, 10.0, c), (2, 10.0, c)]);
        let p = |start_s: f64, placement: Vec<u32>| PlannedJob { start_s, placement };
        assert_eq!(
            evaluate(&i, &[p(0.0, vec![4, 0])]),
            Err(PlanError::Jobs {
                planned: 1,
                jobs: 2
            })
        );
        assert_eq!(
            evaluate(&i, &[p(0.0, vec![4, 0]), p(0.0, vec![1, 0])]),
            Err(PlanError::Placement { job: 1 })
        );
        assert_eq!(
            evaluate(&i, &[p(0.0, vec![4, 0]), p(0.0, vec![2])]),
            Err(PlanError::Placement { job: 1 })
        );
        assert!(matches!(
            evaluate(&i, &[p(f64::NAN, vec![4, 0]), p(0.0, vec![0, 2])]),
            Err(PlanError::Start { job: 0, .. })
        ));
        assert_eq!(
            evaluate(&i, &[p(0.0, vec![4, 0]), p(5.0, vec![2, 0])]),
            Err(PlanError::Capacity {
                job: 1,
                time_s: 5.0
            })
        );
        // At the first one's finish the GPUs are free again; an idle gap is allowed.
        let s = evaluate(&i, &[p(0.0, vec![4, 0]), p(10.0, vec![2, 0])]).unwrap();
        assert_eq!(s.makespan_s, 20.0);
        let s = evaluate(&i, &[p(3.0, vec![4, 0]), p(50.0, vec![1, 1])]).unwrap();
        assert_eq!((s.jobs[0].finish_s, s.makespan_s), (13.0, 70.0));
    }

    #[test]
    fn instances_are_validated() {
        let c = JobCost::default();
        assert!(matches!(
            Instance::new(0, 4, vec![]),
            Err(InstanceError::NoGpus { .. })
        ));
        assert!(matches!(
            Instance::new(2, 4, vec![MakespanJob::new(9, 1.0, c)]),
            Err(InstanceError::Gpus {
                job: 0,
                gpus: 9,
                capacity: 8
            })
        ));
        assert!(matches!(
            Instance::new(
                2,
                4,
                vec![MakespanJob::new(1, 1.0, c), MakespanJob::new(0, 1.0, c)]
            ),
            Err(InstanceError::Gpus { job: 1, .. })
        ));
        assert!(matches!(
            Instance::new(2, 4, vec![MakespanJob::new(1, f64::INFINITY, c)]),
            Err(InstanceError::Iterations { job: 0, .. })
        ));
        let empty = Instance::new(2, 4, vec![]).unwrap();
        for s in [optimal(&empty), sjf_bco(&empty), fifo_first_fit(&empty)] {
            assert_eq!(s.makespan_s, 0.0);
            assert!(s.jobs.is_empty());
        }
    }

    #[test]
    fn strict_order_blocks_and_backfilling_does_not() {
        // One server of 4 GPUs: a (3 GPUs, 100 s), b (4 GPUs, 100 s), c (1 GPU, 50 s).
        let c = cost(1.0, 0.0, 1.0);
        let i = instance(1, 4, &[(3, 100.0, c), (4, 100.0, c), (1, 50.0, c)]);
        let strict = list_schedule(&i, &[0, 1, 2], PlacementRule::FirstFit, ListMode::Strict);
        assert_eq!(
            strict.jobs.iter().map(|j| j.start_s).collect::<Vec<_>>(),
            [0.0, 100.0, 200.0]
        );
        assert_eq!(strict.makespan_s, 250.0);
        let backfill = list_schedule(&i, &[0, 1, 2], PlacementRule::FirstFit, ListMode::Backfill);
        assert_eq!(backfill.jobs[2].start_s, 0.0);
        assert_eq!(backfill.makespan_s, 200.0);
        assert_eq!(optimal(&i).makespan_s, 200.0);
        // Invalid and repeated order entries are ignored; missing jobs go last.
        assert_eq!(
            list_schedule(&i, &[7, 0, 0], PlacementRule::FirstFit, ListMode::Strict),
            strict
        );
    }

    #[test]
    fn bco_waits_for_a_server_under_the_threshold() {
        // 3 servers × 4; a 6-GPU job runs on [4, 2, 0]; a second 6-GPU job under κ = 1 may
        // only use server 2 (4 GPUs) and waits; under κ = 2 it takes [0, 2, 4].
        let c = cost(1.0, 0.0, 1.0);
        let i = instance(3, 4, &[(6, 10.0, c), (6, 10.0, c)]);
        let mut sim = Sim::new(&i);
        let first = sim.place(0, PlacementRule::Bco { kappa: 1 }).unwrap();
        assert_eq!(first, [4, 2, 0]);
        sim.start(0, first);
        assert_eq!(sim.place(1, PlacementRule::Bco { kappa: 1 }), None);
        assert_eq!(
            sim.place(1, PlacementRule::Bco { kappa: 2 }).unwrap(),
            [0, 2, 4]
        );
        // First fit takes whatever is free, NICs regardless.
        assert_eq!(sim.place(1, PlacementRule::FirstFit).unwrap(), [0, 2, 4]);
        // Best fit on one server: the fullest that still holds it.
        let j = instance(3, 4, &[(3, 1.0, c), (1, 1.0, c), (1, 1.0, c)]);
        let mut sim = Sim::new(&j);
        sim.start(0, vec![0, 3, 0]);
        assert_eq!(
            sim.place(1, PlacementRule::Bco { kappa: 1 }).unwrap(),
            [0, 1, 0]
        );
        sim.start(1, vec![0, 1, 0]);
        assert_eq!(
            sim.place(2, PlacementRule::Bco { kappa: 1 }).unwrap(),
            [1, 0, 0]
        );
    }

    #[test]
    fn sjf_bco_beats_first_fit_fifo_under_contention() {
        // 4 servers × 4. FIFO's first fit spreads the 2- and 6-GPU jobs over shared NICs;
        // SJF-BCO packs the small jobs whole and gives the large ones their own servers.
        let c = cost(0.5, 0.05, 1.0);
        let i = instance(
            4,
            4,
            &[
                (6, 300.0, c),
                (2, 200.0, c),
                (6, 300.0, c),
                (2, 200.0, c),
                (3, 100.0, c),
                (5, 150.0, c),
            ],
        );
        let fifo = fifo_first_fit(&i);
        let sjf = sjf_bco(&i);
        let opt = optimal(&i);
        assert!(
            sjf.makespan_s < fifo.makespan_s,
            "{} vs {}",
            sjf.makespan_s,
            fifo.makespan_s
        );
        assert!(opt.makespan_s <= sjf.makespan_s);
        for s in [&fifo, &sjf, &opt] {
            check(&i, s);
        }
    }

    #[test]
    fn everything_is_deterministic() {
        let c1 = cost(0.7, 0.03, 0.9);
        let c2 = cost(0.3, 0.01, 0.6);
        let i = instance(
            3,
            4,
            &[
                (5, 200.0, c1),
                (3, 300.0, c2),
                (7, 150.0, c1),
                (2, 400.0, c2),
            ],
        );
        assert_eq!(sjf_bco(&i), sjf_bco(&i));
        assert_eq!(fifo_first_fit(&i), fifo_first_fit(&i));
        let a = optimal_with_limit(&i, u64::MAX);
        let b = optimal_with_limit(&i, u64::MAX);
        assert_eq!(a, b);
        assert!(a.proven);
        // A node limit of 1 stops the search with the list-schedule incumbent.
        let capped = optimal_with_limit(&i, 1);
        assert!(!capped.proven);
        assert!(capped.schedule.makespan_s >= a.schedule.makespan_s);
        assert!(capped.schedule.makespan_s <= sjf_bco(&i).makespan_s);
    }

    /// A small random instance: 2–`max_jobs` jobs on `servers` × `gpus` servers.
    fn small_instance(
        servers: std::ops::RangeInclusive<u32>,
        gpus: std::ops::RangeInclusive<u32>,
        max_jobs: usize,
    ) -> impl Strategy<Value = Instance> {
        (servers, gpus).prop_flat_map(move |(servers, gpus_per_server)| {
            let capacity = servers * gpus_per_server;
            let job = (
                1..=capacity.min(8),
                prop_oneof![Just(0.0), 1.0..500.0f64],
                (0.1..1.0f64, 0.0..0.2f64, 0.0..2.0f64, 0.0..0.3f64),
            )
                .prop_map(|(g, iterations, (c, o, s, intra))| {
                    MakespanJob::new(
                        g,
                        iterations.round(),
                        JobCost {
                            compute_s: c,
                            overhead_s_per_server: o,
                            sync_s: s,
                            intra_sync_s: intra * s,
                            background_sync: false,
                        },
                    )
                });
            prop::collection::vec(job, 1..=max_jobs)
                .prop_map(move |jobs| Instance::new(servers, gpus_per_server, jobs).unwrap())
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// The search finds exactly what an unpruned enumeration of the same schedules finds.
        #[test]
        fn optimal_matches_brute_force(instance in small_instance(2..=3, 2..=3, 3)) {
            let opt = optimal(&instance);
            let brute = brute_force(&instance);
            prop_assert!(close(opt.makespan_s, brute), "{} vs {}", opt.makespan_s, brute);
            check(&instance, &opt);
        }

        /// The optimum is at most every list schedule (every order, rule and mode), in
        /// particular SJF-BCO's and FIFO's; every schedule is consistent.
        #[test]
        fn optimal_is_at_most_every_list_schedule(instance in small_instance(2..=4, 4..=4, 4)) {
            let opt = optimal(&instance);
            check(&instance, &opt);
            let sjf = sjf_bco(&instance);
            let fifo = fifo_first_fit(&instance);
            check(&instance, &sjf);
            check(&instance, &fifo);
            // Within rounding: the same schedule may be summed in another order.
            let at_most = |a: f64, b: f64| a <= b * (1.0 + 1e-9);
            prop_assert!(at_most(opt.makespan_s, sjf.makespan_s));
            prop_assert!(at_most(opt.makespan_s, fifo.makespan_s));
            for s in every_list_schedule(&instance) {
                prop_assert!(
                    at_most(opt.makespan_s, s.makespan_s),
                    "{} > {}",
                    opt.makespan_s,
                    s.makespan_s
                );
            }
        }
    }
}

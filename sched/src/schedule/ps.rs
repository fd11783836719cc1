//! Parameter-server jobs: shard placement (the planner of Yu et al. 2021, else co-location)
//! and the ranks of their shards.

use super::observe::eligible_hosts;
use super::{DEFAULT_LINK_BYTES_PER_S, DEFAULT_PS_MODEL_BYTES, PS_TARGET_FRACTION, Settings};
use crate::contention::{HostNic, JobCost};
use crate::history::JobHistory;
use crate::ps_plan::{PsHost, PsJob, PsPlan, plan_ps_job};
use crate::throughput::ThroughputModel;
use converge_common::{HostId, HostTelemetry, JobId, JobSpec, JobStatus, RankPlacement};
use std::collections::{BTreeMap, BTreeSet};

/// The parameter-server shards of a running `arch = "ps"` job (none for other jobs): those
/// the planner placed ([`JobStatus::ps_placement`]), else (statuses written before the
/// planner, or when it found no plan) co-location: one per host its workers use, in rank
/// order of first appearance, at most `max_ps`, so that pushes and pulls stay on the host
/// (locality, after Yu et al., IEEE TNSE 2021). Shards take the ranks after the workers and
/// no GPU.
pub(super) fn ps_shards(status: &JobStatus, spec: &JobSpec) -> Vec<RankPlacement> {
    if !spec.has_ps_shards() || status.world_size == 0 {
        return Vec::new();
    }
    if !status.ps_placement.is_empty() {
        return status.ps_placement.clone();
    }
    colocated_shards(status.world_size, &status.placement, spec)
}

/// One shard per host of `placement`, in rank order of first appearance, at most `max_ps`.
pub(super) fn colocated_shards(
    world_size: u32,
    placement: &[RankPlacement],
    spec: &JobSpec,
) -> Vec<RankPlacement> {
    let mut hosts: Vec<&HostId> = Vec::new();
    let mut ranks: Vec<&RankPlacement> = placement.iter().collect();
    ranks.sort_by_key(|p| p.rank);
    for p in ranks {
        if !hosts.contains(&&p.host) {
            hosts.push(&p.host);
        }
    }
    hosts
        .into_iter()
        .take(spec.max_ps.unwrap_or(u32::MAX) as usize)
        .enumerate()
        .map(|(i, host)| RankPlacement {
            rank: world_size + i as u32,
            host: host.clone(),
            gpus: Vec::new(),
        })
        .collect()
}

/// What [`plan_ps_jobs`] reads besides the placements.
pub(super) struct PsContext<'a> {
    pub(super) settings: &'a Settings,
    pub(super) live: &'a BTreeMap<&'a HostId, &'a HostTelemetry>,
    pub(super) nics: &'a BTreeMap<&'a HostId, HostNic>,
    pub(super) histories: &'a BTreeMap<JobId, JobHistory>,
    pub(super) models: &'a BTreeMap<JobId, (ThroughputModel, f64)>,
}

/// Shards of every active `arch = "ps"` job, and the workers of those being (re)placed, by
/// the LP planner of [`crate::ps_plan`] (Yu et al., IEEE TNSE 2021; design brief §5.2).
///
/// A PS job whose workers keep their placement keeps its shards. A PS job that the
/// placement moved or resized (and got workers) is planned again, in priority order: with
/// the worker count the policy gave it fixed, the planner chooses how many shards
/// (1..=`max_ps`, default up to one per worker) and where the workers and shards go, on
/// each live host's GPUs not used by other jobs, the shard slots left
/// ([`Settings::ps_shards_per_host`]) and its NIC (link speed × NIC factor, both
/// directions; [`DEFAULT_LINK_BYTES_PER_S`] when unknown). The job's step is priced with its
/// reported model size ([`DEFAULT_PS_MODEL_BYTES`] before one) and the compute time of its
/// throughput model (1 s before one). The plan's workers replace the placement's (same
/// count; GPUs lowest first on each host, ranks in host order); the placement's own ranks
/// stay when the plan uses the same hosts with the same counts. With no plan (no shard slot
/// free), the shards are co-located with the workers as before the planner.
pub(super) fn plan_ps_jobs(
    cx: &PsContext<'_>,
    active: &[(JobStatus, &JobSpec)],
    placed: &mut BTreeMap<JobId, Vec<RankPlacement>>,
) -> BTreeMap<JobId, Vec<RankPlacement>> {
    let mut shards: BTreeMap<JobId, Vec<RankPlacement>> = BTreeMap::new();
    let mut replan: Vec<(&JobStatus, &JobSpec)> = Vec::new();
    for (s, spec) in active {
        // S-EASGD shadow jobs keep their central copy on shards planned the same way (the
        // planner's price of a step stands for their sync round: a faster round, more
        // rounds per second).
        if !spec.has_ps_shards() {
            continue;
        }
        let ranks = placed.get(&s.job).map_or(&[][..], Vec::as_slice);
        if ranks.is_empty() {
            continue;
        }
        if ranks == s.placement.as_slice() {
            shards.insert(s.job.clone(), s.ps_placement.clone());
        } else {
            replan.push((s, spec));
        }
    }
    let hosts: Vec<&HostId> = cx.live.keys().copied().collect();
    for (s, spec) in replan {
        let mine = placed.get(&s.job).cloned().unwrap_or_default();
        let mut used: BTreeMap<&HostId, BTreeSet<u32>> = BTreeMap::new();
        for (job, ranks) in placed.iter() {
            if *job != s.job {
                for r in ranks {
                    used.entry(&r.host).or_default().extend(&r.gpus);
                }
            }
        }
        let mut slots_used: BTreeMap<&HostId, u32> = BTreeMap::new();
        for (job, list) in &shards {
            if *job != s.job {
                for r in list {
                    *slots_used.entry(&r.host).or_default() += 1;
                }
            }
        }
        // A selector job's workers and shards stay on the hosts it matches.
        let allowed = eligible_hosts(spec, cx.live);
        let allows = |h: &HostId| allowed.as_ref().is_none_or(|set| set.contains(h));
        let free: Vec<Vec<u32>> = hosts
            .iter()
            .map(|h| {
                if !allows(h) {
                    return Vec::new();
                }
                let taken = used.get(h);
                cx.live[h]
                    .gpus
                    .iter()
                    .map(|g| g.index)
                    .filter(|g| taken.is_none_or(|t| !t.contains(g)))
                    .collect()
            })
            .collect();
        let ps_hosts: Vec<PsHost> = hosts
            .iter()
            .zip(&free)
            .map(|(h, gpus)| {
                let nic = cx.nics[h];
                PsHost::new(
                    gpus.len() as u32,
                    if allows(h) {
                        cx.settings
                            .ps_shards_per_host
                            .saturating_sub(slots_used.get(h).copied().unwrap_or(0))
                    } else {
                        0
                    },
                    2.0 * nic.link_bytes_per_s.unwrap_or(DEFAULT_LINK_BYTES_PER_S) * nic.factor,
                )
            })
            .collect();
        let workers = mine.len() as u32;
        let model = cx.models.get(&s.job);
        let job = PsJob {
            model_bytes: cx
                .histories
                .get(&s.job)
                .and_then(JobHistory::model_bytes)
                .map_or(DEFAULT_PS_MODEL_BYTES, |b| b as f64),
            compute_s: model.map_or(JobCost::default().compute_s, |(m, b)| {
                JobCost::from_model(m, workers, *b).compute_s
            }),
            samples_per_worker: model.map_or(1.0, |(_, b)| *b),
            gpus_per_worker: spec.gpus_per_worker,
            min_workers: workers,
            max_workers: workers,
            min_shards: 1,
            max_shards: spec.max_ps.unwrap_or(workers).max(1),
            target_fraction: PS_TARGET_FRACTION,
        };
        let plan = plan_ps_job(&ps_hosts, &job, s.generation + 1);
        let (ranks, list) = match plan {
            Some(plan) => ps_ranks(&plan, &hosts, &free, &mine, spec.gpus_per_worker),
            None => {
                let list = colocated_shards(workers, &mine, spec);
                (mine, list)
            }
        };
        placed.insert(s.job.clone(), ranks);
        shards.insert(s.job.clone(), list);
    }
    shards
}

/// Worker ranks and shard ranks of a PS plan (host indices into `hosts`; `free[h]` the
/// GPUs free for the job on host `h`, increasing). Keeps `placed` (the placement's ranks)
/// when the plan puts the same number of workers on the same hosts.
pub(super) fn ps_ranks(
    plan: &PsPlan,
    hosts: &[&HostId],
    free: &[Vec<u32>],
    placed: &[RankPlacement],
    gpus_per_worker: u32,
) -> (Vec<RankPlacement>, Vec<RankPlacement>) {
    let mut counts: BTreeMap<&HostId, u32> = BTreeMap::new();
    for r in placed {
        *counts.entry(&r.host).or_default() += 1;
    }
    let planned: BTreeMap<&HostId, u32> = plan
        .workers_per_host
        .iter()
        .map(|&(h, n)| (hosts[h], n))
        .collect();
    let workers = if planned == counts {
        placed.to_vec()
    } else {
        let per = gpus_per_worker as usize;
        let mut ranks = Vec::with_capacity(plan.workers as usize);
        for &(h, n) in &plan.workers_per_host {
            for chunk in free[h].chunks_exact(per).take(n as usize) {
                ranks.push(RankPlacement {
                    rank: ranks.len() as u32,
                    host: hosts[h].clone(),
                    gpus: chunk.to_vec(),
                });
            }
        }
        ranks
    };
    let world_size = workers.len() as u32;
    let shards = plan
        .shards_per_host
        .iter()
        .flat_map(|&(h, n)| std::iter::repeat_n(hosts[h], n as usize))
        .enumerate()
        .map(|(i, host)| RankPlacement {
            rank: world_size + i as u32,
            host: host.clone(),
            gpus: Vec::new(),
        })
        .collect();
    (workers, shards)
}

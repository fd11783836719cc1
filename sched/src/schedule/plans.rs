//! Host plans: what each live host must run (workers and shards of the current generations).

use super::Inputs;
use super::ps::ps_shards;
use converge_common::{
    HostId, HostPlan, HostTelemetry, JobId, JobPhase, JobStatus, PROTOCOL_VERSION, RankPlacement,
    SyncArch, WorkerAssignment,
};
use std::collections::{BTreeMap, BTreeSet};

/// Host plans from job statuses: every `running` job's ranks on their hosts.
pub(super) fn plans(
    inp: Inputs<'_>,
    statuses: &BTreeMap<JobId, JobStatus>,
    live: &BTreeMap<&HostId, &HostTelemetry>,
) -> BTreeMap<HostId, HostPlan> {
    let mut plans: BTreeMap<HostId, HostPlan> = inp
        .hosts
        .keys()
        .map(|h| {
            (
                h.clone(),
                HostPlan {
                    protocol: PROTOCOL_VERSION,
                    host: h.clone(),
                    workers: Vec::new(),
                },
            )
        })
        .collect();
    for status in statuses.values() {
        if status.phase != JobPhase::Running {
            continue;
        }
        let (Some(spec), Some(port)) = (inp.specs.get(&status.job), status.master_port) else {
            continue;
        };
        let Some(rank0) = status.placement.iter().find(|p| p.rank == 0) else {
            continue;
        };
        let Some(master_addr) = live.get(&rank0.host).map(|t| t.addr.clone()) else {
            continue;
        };
        let shards = ps_shards(status, spec);
        let num_ps = shards.len() as u32;
        let worker_hosts = status
            .placement
            .iter()
            .map(|p| &p.host)
            .collect::<BTreeSet<_>>()
            .len() as u32;
        let world_size = status.world_size + num_ps;
        let mut by_host: BTreeMap<&HostId, Vec<&RankPlacement>> = BTreeMap::new();
        for p in status.placement.iter().chain(&shards) {
            by_host.entry(&p.host).or_default().push(p);
        }
        // Hosts in order of the lowest rank each runs: torchrun's node rank.
        let mut node_order: Vec<(u32, &HostId)> = by_host
            .iter()
            .map(|(h, ranks)| (ranks.iter().map(|p| p.rank).min().unwrap_or(0), *h))
            .collect();
        node_order.sort();
        let node_rank = |h: &HostId| {
            node_order
                .iter()
                .position(|(_, x)| *x == h)
                .map(|i| i as u32)
        };
        for (host, ranks) in by_host {
            let node_rank = node_rank(host);
            let plan = plans.entry(host.clone()).or_insert_with(|| HostPlan {
                protocol: PROTOCOL_VERSION,
                host: host.clone(),
                workers: Vec::new(),
            });
            for (local_rank, p) in ranks.iter().enumerate() {
                plan.workers.push(WorkerAssignment {
                    job: status.job.clone(),
                    generation: status.generation,
                    rank: p.rank,
                    world_size,
                    local_rank: local_rank as u32,
                    local_world_size: ranks.len() as u32,
                    gpus: p.gpus.clone(),
                    master_addr: master_addr.clone(),
                    master_port: port,
                    command: spec.command.clone(),
                    env: spec.env.clone(),
                    max_restarts: spec.max_restarts,
                    num_ps,
                    hosts: worker_hosts,
                    batch: status.batch.as_ref().and_then(|b| b.plan),
                    node_rank,
                    shadow: spec.shadow.filter(|_| spec.arch == SyncArch::Shadow),
                });
            }
        }
    }
    plans
}

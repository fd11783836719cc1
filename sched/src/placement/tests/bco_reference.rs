use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use converge_common::{HostId, JobId, RankPlacement};

use super::super::{HostFree, PlacementRequest};
use super::reference::{keep_current, second_pass};
use crate::contention::JobCost;

type Free<'a> = BTreeMap<&'a HostId, BTreeSet<u32>>;

pub fn place_bco(
    hosts: &[HostFree],
    requests: &[PlacementRequest],
    costs: &BTreeMap<JobId, JobCost>,
) -> BTreeMap<JobId, Vec<RankPlacement>> {
    let mut free: Free = BTreeMap::new();
    for host in hosts {
        free.entry(&host.host).or_default().extend(&host.gpus);
    }
    let mut seen = BTreeSet::new();
    let requests: Vec<&PlacementRequest> =
        requests.iter().filter(|r| seen.insert(&r.job)).collect();
    let mut multi: BTreeMap<HostId, usize> = BTreeMap::new();
    let mut placed = BTreeMap::new();
    for request in &requests {
        let keepable = request.workers as usize == request.current.len()
            && request.workers >= request.min_workers;
        if keepable && keep_current(request, &mut free) {
            count_multi(&request.current, &mut multi);
            placed.insert(request.job.clone(), request.current.clone());
        }
    }
    for request in second_pass(&requests, &placed, &free) {
        let cost = costs.get(&request.job).copied().unwrap_or_default();
        let ranks = place_one(request, &cost, &mut free, &multi);
        count_multi(&ranks, &mut multi);
        placed.insert(request.job.clone(), ranks);
    }
    placed
}

fn count_multi(ranks: &[RankPlacement], multi: &mut BTreeMap<HostId, usize>) {
    let hosts: BTreeSet<&HostId> = ranks.iter().map(|r| &r.host).collect();
    if hosts.len() > 1 {
        for host in hosts {
            *multi.entry(host.clone()).or_default() += 1;
        }
    }
}

fn place_one(
    request: &PlacementRequest,
    cost: &JobCost,
    free: &mut Free,
    multi: &BTreeMap<HostId, usize>,
) -> Vec<RankPlacement> {
    let per_worker = request.gpus_per_worker as usize;
    let wanted = request.workers as usize;
    if per_worker == 0 || wanted == 0 || request.workers < request.min_workers {
        return Vec::new();
    }
    let current: BTreeSet<&HostId> = request.current.iter().map(|r| &r.host).collect();
    let level = |host: &HostId| multi.get(host).copied().unwrap_or(0);
    // Hosts with room for a worker, and their free GPUs.
    let room: Vec<(HostId, usize)> = free
        .iter()
        .filter(|(host, gpus)| gpus.len() >= per_worker && request.allows(host))
        .map(|(host, gpus)| ((*host).clone(), gpus.len()))
        .collect();
    let order =
        |(host, free): &(HostId, usize)| (Reverse(*free), !current.contains(host), host.clone());
    let capacity: usize = room.iter().map(|(_, f)| f / per_worker).sum();
    let picks: Vec<(HostId, usize)> = if capacity < wanted {
        if capacity < request.min_workers as usize || capacity == 0 {
            return Vec::new();
        }
        let mut all = room.clone();
        all.sort_by_key(order);
        all.into_iter().map(|(h, f)| (h, f / per_worker)).collect()
    } else if let Some((host, _)) = room
        .iter()
        .filter(|(_, f)| *f >= wanted * per_worker)
        .min_by_key(|(h, f)| (*f, !current.contains(h), h.clone()))
    {
        vec![(host.clone(), wanted)]
    } else {
        let max_level = room.iter().map(|(h, _)| level(h)).max().unwrap_or(0);
        let mut best: Option<(f64, Vec<(HostId, usize)>)> = None;
        for kappa in 1..=max_level + 1 {
            let mut candidates: Vec<(HostId, usize)> = room
                .iter()
                .filter(|(h, _)| level(h) < kappa)
                .cloned()
                .collect();
            candidates.sort_by_key(order);
            let (mut picks, mut count, mut worst) = (Vec::new(), 0, 0);
            for (host, f) in candidates {
                if count == wanted {
                    break;
                }
                let fits = (f / per_worker).min(wanted - count);
                worst = worst.max(level(&host));
                picks.push((host, fits));
                count += fits;
            }
            if count < wanted {
                continue;
            }
            let time = cost.step_time_s(picks.len() as u32, worst as u32 + 1);
            if best
                .as_ref()
                .is_none_or(|(t, p)| time < *t || (time == *t && picks.len() < p.len()))
            {
                best = Some((time, picks));
            }
        }
        best.unwrap().1
    };
    let mut ranks = Vec::new();
    for (host, workers) in picks {
        let gpus: Vec<u32> = free[&host]
            .iter()
            .copied()
            .take(workers * per_worker)
            .collect();
        for chunk in gpus.chunks_exact(per_worker) {
            ranks.push(RankPlacement {
                rank: ranks.len() as u32,
                host: host.clone(),
                gpus: chunk.to_vec(),
            });
        }
        if let Some(host_free) = free.get_mut(&host) {
            for gpu in gpus {
                host_free.remove(&gpu);
            }
        }
    }
    ranks
}

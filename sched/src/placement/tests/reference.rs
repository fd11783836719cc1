use std::collections::{BTreeMap, BTreeSet};

use converge_common::{HostId, JobId, RankPlacement};

use super::super::{HostFree, PlacementRequest};

pub fn place(
    hosts: &[HostFree],
    requests: &[PlacementRequest],
) -> BTreeMap<JobId, Vec<RankPlacement>> {
    let mut free: BTreeMap<&HostId, BTreeSet<u32>> = BTreeMap::new();
    for host in hosts {
        free.entry(&host.host).or_default().extend(&host.gpus);
    }
    let mut seen = BTreeSet::new();
    let requests: Vec<&PlacementRequest> =
        requests.iter().filter(|r| seen.insert(&r.job)).collect();

    let mut placed = BTreeMap::new();
    for request in &requests {
        let wanted = request.workers as usize;
        let keepable = wanted == request.current.len() && request.workers >= request.min_workers;
        if keepable && keep_current(request, &mut free) {
            placed.insert(request.job.clone(), request.current.clone());
        }
    }
    for request in second_pass(&requests, &placed, &free) {
        placed.insert(request.job.clone(), first_fit(request, &mut free));
    }
    placed
}

/// The requests not kept, restricted ones first by the free GPUs of their hosts,
/// then the others, each group in request order.
pub fn second_pass<'r>(
    requests: &[&'r PlacementRequest],
    placed: &BTreeMap<JobId, Vec<RankPlacement>>,
    free: &BTreeMap<&HostId, BTreeSet<u32>>,
) -> Vec<&'r PlacementRequest> {
    let left: Vec<&PlacementRequest> = requests
        .iter()
        .copied()
        .filter(|r| !placed.contains_key(&r.job))
        .collect();
    let mut restricted: Vec<(usize, &PlacementRequest)> = Vec::new();
    let mut others = Vec::new();
    for r in left {
        if r.hosts.is_some() {
            let gpus = free
                .iter()
                .filter(|(h, _)| r.allows(h))
                .map(|(_, g)| g.len())
                .sum();
            restricted.push((gpus, r));
        } else {
            others.push(r);
        }
    }
    restricted.sort_by_key(|(gpus, _)| *gpus);
    restricted
        .into_iter()
        .map(|(_, r)| r)
        .chain(others)
        .collect()
}

/// Takes the request's current GPUs out of `free` if its current placement is still valid
/// (see [`place`]); leaves `free` untouched and returns `false` otherwise.
pub fn keep_current(
    request: &PlacementRequest,
    free: &mut BTreeMap<&HostId, BTreeSet<u32>>,
) -> bool {
    let mut claimed: BTreeSet<(&HostId, u32)> = BTreeSet::new();
    for (index, rank) in request.current.iter().enumerate() {
        let Some(host_free) = free.get(&rank.host).filter(|_| request.allows(&rank.host)) else {
            return false;
        };
        let well_formed = rank.rank as usize == index
            && request.gpus_per_worker > 0
            && rank.gpus.len() == request.gpus_per_worker as usize;
        if !well_formed
            || !rank
                .gpus
                .iter()
                .all(|gpu| host_free.contains(gpu) && claimed.insert((&rank.host, *gpu)))
        {
            return false;
        }
    }
    for (host, gpu) in claimed {
        if let Some(host_free) = free.get_mut(host) {
            host_free.remove(&gpu);
        }
    }
    true
}

/// First-fit placement of one request (see [`place`]), taking its GPUs out of `free`.
fn first_fit(
    request: &PlacementRequest,
    free: &mut BTreeMap<&HostId, BTreeSet<u32>>,
) -> Vec<RankPlacement> {
    let per_worker = request.gpus_per_worker as usize;
    if per_worker == 0 {
        return Vec::new();
    }
    let current_hosts: BTreeSet<&HostId> = request.current.iter().map(|r| &r.host).collect();
    let (preferred, others): (Vec<&HostId>, Vec<&HostId>) = free
        .keys()
        .copied()
        .filter(|h| request.allows(h))
        .partition(|h| current_hosts.contains(h));
    let mut ranks: Vec<RankPlacement> = Vec::new();
    for host in preferred.into_iter().chain(others) {
        let gpus: Vec<u32> = free[host].iter().copied().collect();
        for chunk in gpus.chunks_exact(per_worker) {
            if ranks.len() == request.workers as usize {
                break;
            }
            ranks.push(RankPlacement {
                rank: ranks.len() as u32,
                host: host.clone(),
                gpus: chunk.to_vec(),
            });
        }
    }
    if ranks.len() < request.min_workers as usize {
        return Vec::new();
    }
    for rank in &ranks {
        if let Some(host_free) = free.get_mut(&rank.host) {
            for gpu in &rank.gpus {
                host_free.remove(gpu);
            }
        }
    }
    ranks
}

//! Placement: turns each job's worker count into ranks on hosts' GPUs, keeping unchanged jobs
//! exactly where they are so they do not restart, and picks each generation's rendezvous port.
//! Pure functions; design brief §4 (resize, fresh `MASTER_PORT` per generation) and §5.3 (a
//! policy's output is a GPU count and a placement per job).
//!
//! Two placements share one contract ([`PlacementKind`], [`place_with`]):
//!
//! - [`place`]: first fit, hosts in id order.
//! - [`place_bco`]: SJF-BCO's placement (Yu, Ji, Rajan, Liu, MobiHoc'22), which balances NIC
//!   contention (multi-server jobs sharing a host) against the overhead of spanning more
//!   servers, scoring candidates with the step-time model of [`crate::contention`]: best fit
//!   on one server when the job fits there, otherwise a search over contention thresholds
//!   `κ = 1, 2, …` as LWF-κ does (see [`place_bco`]).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use converge_common::{HostId, JobId, RankPlacement};

use crate::contention::{JobCost, MIN_NIC_FACTOR};

/// A live host, the indices of all its GPUs (as in `CUDA_VISIBLE_DEVICES`) and the share of
/// its NIC left for all-reduce traffic.
#[derive(Debug, Clone, PartialEq)]
pub struct HostFree {
    pub host: HostId,
    pub gpus: Vec<u32>,
    /// [`crate::contention::nic_factor`] of the host's NIC from the agent's measurements, in
    /// `[MIN_NIC_FACTOR, 1]` (1: idle or unknown; values outside are clamped, NaN counts as
    /// 1). Only [`place_bco`] reads it: a sync over this host takes `1 / nic_factor` times
    /// as long.
    pub nic_factor: f64,
    /// The generation of the host's GPUs (its `gpu.type` label,
    /// [`converge_common::labels::gpu_type`]); `None`: not known. When the hosts carry more
    /// than one type (`None` counting as one), a job's new placement uses GPUs of one type
    /// only (see [`place`]): a ring all-reduce runs at its slowest member's speed, so a job
    /// spread over a T4 and an A100 runs at T4 speed on both.
    pub gpu_type: Option<String>,
    /// The nominal speed of the host's GPUs (its `gpu.speed` label,
    /// [`converge_common::labels::host_gpu_speed`]); `None`: not reported. Only the
    /// projection of speeds to types no job has measured against another reads it
    /// ([`crate::gpu_types`]).
    pub gpu_speed: Option<f64>,
}

impl HostFree {
    /// A host whose NIC counts as idle (`nic_factor` 1), GPU type unknown.
    pub fn new(host: HostId, gpus: Vec<u32>) -> Self {
        Self {
            host,
            gpus,
            nic_factor: 1.0,
            gpu_type: None,
            gpu_speed: None,
        }
    }

    /// The same host with GPUs of type `gpu_type`.
    pub fn with_gpu_type(mut self, gpu_type: impl Into<String>) -> Self {
        self.gpu_type = Some(gpu_type.into());
        self
    }

    /// The same host with GPUs of nominal speed `speed`.
    pub fn with_gpu_speed(mut self, speed: f64) -> Self {
        self.gpu_speed = Some(speed);
        self
    }

    fn sane_nic_factor(&self) -> f64 {
        if self.nic_factor.is_nan() {
            1.0
        } else {
            self.nic_factor.clamp(MIN_NIC_FACTOR, 1.0)
        }
    }
}

/// The distinct GPU types of the hosts that have GPUs, sorted (`None`, a host whose type is
/// not known, counts as one type). Placement uses one type per job when there are two or
/// more.
pub fn gpu_types_of(hosts: &[HostFree]) -> Vec<Option<&str>> {
    let mut types: Vec<Option<&str>> = hosts
        .iter()
        .filter(|h| !h.gpus.is_empty())
        .map(|h| h.gpu_type.as_deref())
        .collect();
    types.sort_unstable();
    types.dedup();
    types
}

/// One job's wish: `workers` workers of `gpus_per_worker` GPUs each.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacementRequest {
    pub job: JobId,
    /// Workers the policy decided; 0 places nothing.
    pub workers: u32,
    /// GPUs per worker, all on one host; a request with 0 is never placed.
    pub gpus_per_worker: u32,
    /// Fewest workers worth placing when not all fit.
    pub min_workers: u32,
    /// Where the job runs now (empty when not running).
    pub current: Vec<RankPlacement>,
    /// The only hosts it may use (its selector's matches); `None`: any host. A current
    /// placement on another host is not kept.
    pub hosts: Option<BTreeSet<HostId>>,
    /// The job's speed on each GPU type, measured or projected (samples per second per
    /// GPU, [`crate::gpu_types`]); empty when none is known. On a cluster of several types
    /// it picks the type of a new placement (see [`place`], rule 3).
    pub gpu_type_speeds: BTreeMap<String, f64>,
    /// The one GPU type the job must run on (a policy that picks types chose it,
    /// [`crate::policies::Policy::allocate_on_types`]); `None`: placement picks (see
    /// [`place`], rule 3). A current placement on another type is not kept; a type no host
    /// carries places nothing.
    pub gpu_type: Option<String>,
}

impl PlacementRequest {
    /// Whether the job may use `host`.
    pub fn allows(&self, host: &HostId) -> bool {
        self.hosts.as_ref().is_none_or(|set| set.contains(host))
    }
}

/// Places every request on `hosts` and returns, for each requested job, its ranks
/// (`0..n`, rank 0 first); an empty list when the job gets no GPUs.
///
/// 1. A request whose `workers` equals its current number of ranks keeps its current placement
///    exactly if that is still valid: ranks `0..n` in order, each with `gpus_per_worker`
///    distinct GPUs of a listed host, none used by a job kept before it (in request order).
/// 2. The other requests, in request order (the caller's priority order) except that requests
///    restricted to some hosts go first, fewest free GPUs on their hosts first (see
///    `second_pass_order`), are placed first-fit:
///    hosts the job currently uses first, then the others, each group in host-id order; a host
///    is filled before the next is used; every worker's GPUs are on one host, lowest indices
///    first. If not all workers fit, as many as fit are placed when that is at least
///    `min_workers`, otherwise none.
///
/// 3. **GPU types.** When the hosts with GPUs carry more than one GPU type
///    ([`HostFree::gpu_type`], [`gpu_types_of`]), a request the first pass did not keep
///    uses GPUs of one type only (`FreeGpus::one_type`): with speeds
///    ([`PlacementRequest::gpu_type_speeds`]) its fastest type with room for every worker;
///    otherwise its current type if that has room, else the type with the most room among
///    those with room for every worker, else the one with the most room. Requests keep
///    their order. A request with [`PlacementRequest::gpu_type`] uses that type only, on
///    any cluster, and keeps its current placement (rule 1) only if it is on that type.
///    [`place_bco`] follows the same rule.
///
/// So every job gets no ranks or between `min_workers` and `workers` of them (a request for
/// fewer workers than its minimum gets none). A request with `hosts` gets GPUs of those
/// hosts only, in both passes (a host it may not use is skipped as if it were full).
///
/// No GPU is ever given twice. Hosts listed twice count once with the union of their GPUs;
/// a job requested twice is placed for its first request only.
pub fn place(
    hosts: &[HostFree],
    requests: &[PlacementRequest],
) -> BTreeMap<JobId, Vec<RankPlacement>> {
    let (mut free, requests, mut placed) = keep_pass(hosts, requests);
    for i in second_pass_order(&free, &requests, &placed) {
        placed[i] = Some(free.first_fit(requests[i]));
    }
    by_job(&requests, placed)
}

/// The requests the keep pass left unplaced, in the order the second pass places them:
/// those restricted to some hosts (a selector, GPU types) first, fewest free GPUs on their
/// hosts first, then the unrestricted ones; request order otherwise (the sort is stable).
/// A job that may run anywhere cannot take the only GPUs a restricted job may use while
/// others are free (most constrained first); without restricted jobs the order is the
/// request order.
fn second_pass_order(
    free: &FreeGpus<'_>,
    requests: &[&PlacementRequest],
    placed: &[Option<Vec<RankPlacement>>],
) -> Vec<usize> {
    let eligible = |r: &PlacementRequest| -> usize {
        free.hosts
            .iter()
            .filter(|slot| r.allows(slot.host))
            .map(|slot| slot.free.len())
            .sum()
    };
    let mut order: Vec<(bool, usize, usize)> = placed
        .iter()
        .enumerate()
        .filter(|(_, p)| p.is_none())
        .map(|(i, _)| {
            let r = requests[i];
            let restricted = r.hosts.is_some();
            (!restricted, if restricted { eligible(r) } else { 0 }, i)
        })
        .collect();
    order.sort_by_key(|&(unrestricted, gpus, _)| (unrestricted, gpus));
    order.into_iter().map(|(_, _, i)| i).collect()
}

/// The first pass of every placement: the requests without repeated jobs (first request
/// wins), in order, and for each the placement kept when its worker count is unchanged and
/// its current ranks are still valid and free (`None` for the others, which the caller
/// places), with the free GPUs left.
fn keep_pass<'a, 'r>(
    hosts: &'a [HostFree],
    requests: &'r [PlacementRequest],
) -> (
    FreeGpus<'a>,
    Vec<&'r PlacementRequest>,
    Vec<Option<Vec<RankPlacement>>>,
) {
    let mut free = FreeGpus::new(hosts);
    let mut seen = BTreeSet::new();
    let requests: Vec<&PlacementRequest> =
        requests.iter().filter(|r| seen.insert(&r.job)).collect();
    let placed = requests
        .iter()
        .map(|request| {
            let wanted = request.workers as usize;
            let keepable =
                wanted == request.current.len() && request.workers >= request.min_workers;
            (keepable && free.keep_current(request)).then(|| request.current.clone())
        })
        .collect();
    (free, requests, placed)
}

/// Each request's ranks by job (empty when it got none).
fn by_job(
    requests: &[&PlacementRequest],
    placed: Vec<Option<Vec<RankPlacement>>>,
) -> BTreeMap<JobId, Vec<RankPlacement>> {
    requests
        .iter()
        .zip(placed)
        .map(|(request, ranks)| (request.job.clone(), ranks.unwrap_or_default()))
        .collect()
}

/// The free GPUs of every host during one [`place`]: the hosts in id order (listed twice
/// counts once, with the union of the GPUs), each with its free GPUs in increasing order, and
/// a max-tree over the hosts' free counts, so that first fit finds the next host with room
/// for a worker without scanning the full ones.
struct FreeGpus<'a> {
    hosts: Vec<HostSlot<'a>>,
    /// The distinct GPU types of the hosts, sorted (`None` first); one entry (or none, with
    /// no hosts) on a cluster of one type.
    types: Vec<Option<&'a str>>,
    /// Free GPUs per type (indexed like `types`).
    type_free: Vec<usize>,
    /// Per type (indexed like `types`), the number of its hosts with `f` free GPUs at index
    /// `f`: room in whole workers of any size per type without a scan of the hosts.
    type_hosts_by_free: Vec<Vec<usize>>,
    /// Every host's free count (a host's position is its index).
    tree: MaxTree,
    /// On a cluster of several types, one max-tree per type over its hosts only (empty on
    /// one type), so that first fit within a type skips the other types' hosts.
    type_trees: Vec<MaxTree>,
    /// Each host's position among its type's hosts (in its [`MaxTree`]).
    type_pos: Vec<usize>,
}

/// A max-tree over the free counts of some hosts: leaves (from `leaves` on) hold each
/// member's free count, node `i` the largest count under it (children `2i`, `2i + 1`);
/// unused leaves hold 0.
struct MaxTree {
    /// The hosts (indices into [`FreeGpus::hosts`]), increasing.
    members: Vec<usize>,
    tree: Vec<usize>,
    leaves: usize,
}

impl MaxTree {
    fn new(members: Vec<usize>, free: impl Fn(usize) -> usize) -> Self {
        let leaves = members.len().next_power_of_two();
        let mut tree = vec![0; 2 * leaves];
        for (i, &h) in members.iter().enumerate() {
            tree[leaves + i] = free(h);
        }
        for node in (1..leaves).rev() {
            tree[node] = tree[2 * node].max(tree[2 * node + 1]);
        }
        Self {
            members,
            tree,
            leaves,
        }
    }

    /// The free count of the member at `pos`.
    fn get(&self, pos: usize) -> usize {
        self.tree[self.leaves + pos]
    }

    fn set(&mut self, pos: usize, free: usize) {
        let mut node = self.leaves + pos;
        self.tree[node] = free;
        while node > 1 {
            node /= 2;
            self.tree[node] = self.tree[2 * node].max(self.tree[2 * node + 1]);
        }
    }

    /// The first member host at host index `from` or later with at least `need` free GPUs.
    fn first_with(&self, from: usize, need: usize) -> Option<usize> {
        let start = self.members.partition_point(|&h| h < from);
        self.first_below(1, 0, self.leaves, start, need)
            .map(|pos| self.members[pos])
    }

    fn first_below(
        &self,
        node: usize,
        low: usize,
        high: usize,
        from: usize,
        need: usize,
    ) -> Option<usize> {
        if high <= from || self.tree[node] < need {
            return None;
        }
        if high - low == 1 {
            return (low < self.members.len()).then_some(low);
        }
        let middle = low + (high - low) / 2;
        self.first_below(2 * node, low, middle, from, need)
            .or_else(|| self.first_below(2 * node + 1, middle, high, from, need))
    }
}

struct HostSlot<'a> {
    host: &'a HostId,
    /// Free GPUs, increasing, no duplicates.
    free: Vec<u32>,
    /// The host's NIC factor (the smallest when the host is listed twice).
    nic_factor: f64,
    /// Index of the host's GPU type in [`FreeGpus::types`] (its first listing's type).
    gpu_type: usize,
}

impl HostSlot<'_> {
    /// Takes the first `workers · per_worker` free GPUs, `per_worker` a worker, as the next
    /// ranks of `ranks`.
    fn take_workers(&mut self, workers: usize, per_worker: usize, ranks: &mut Vec<RankPlacement>) {
        for chunk in self
            .free
            .drain(..workers * per_worker)
            .as_slice()
            .chunks_exact(per_worker)
        {
            ranks.push(RankPlacement {
                rank: ranks.len() as u32,
                host: self.host.clone(),
                gpus: chunk.to_vec(),
            });
        }
    }
}

impl<'a> FreeGpus<'a> {
    fn new(hosts: &'a [HostFree]) -> Self {
        let mut listed: Vec<&HostFree> = hosts.iter().collect();
        listed.sort_by(|a, b| a.host.cmp(&b.host));
        let mut slots: Vec<HostSlot<'a>> = Vec::with_capacity(listed.len());
        let mut first_types: Vec<Option<&'a str>> = Vec::with_capacity(listed.len());
        for host in listed {
            match slots.last_mut() {
                Some(last) if *last.host == host.host => {
                    last.free.extend(&host.gpus);
                    last.nic_factor = last.nic_factor.min(host.sane_nic_factor());
                }
                _ => {
                    slots.push(HostSlot {
                        host: &host.host,
                        free: host.gpus.clone(),
                        nic_factor: host.sane_nic_factor(),
                        gpu_type: 0,
                    });
                    first_types.push(host.gpu_type.as_deref());
                }
            }
        }
        // The types of the hosts with GPUs (a host without GPUs adds no type).
        let mut types: Vec<Option<&'a str>> = slots
            .iter()
            .zip(&first_types)
            .filter(|(slot, _)| !slot.free.is_empty())
            .map(|(_, t)| *t)
            .collect();
        types.sort_unstable();
        types.dedup();
        let mut type_free = vec![0; types.len()];
        for (slot, t) in slots.iter_mut().zip(&first_types) {
            slot.free.sort_unstable();
            slot.free.dedup();
            slot.gpu_type = types.binary_search(t).unwrap_or(0);
            if let Some(free) = type_free.get_mut(slot.gpu_type) {
                *free += slot.free.len();
            }
        }
        let most_free = slots.iter().map(|slot| slot.free.len()).max().unwrap_or(0);
        let mut type_hosts_by_free = vec![vec![0; most_free + 1]; types.len()];
        for slot in &slots {
            if let Some(counts) = type_hosts_by_free.get_mut(slot.gpu_type) {
                counts[slot.free.len()] += 1;
            }
        }
        let mut type_pos = vec![0; slots.len()];
        let type_trees: Vec<MaxTree> = if types.len() > 1 {
            let mut members: Vec<Vec<usize>> = vec![Vec::new(); types.len()];
            for (i, slot) in slots.iter().enumerate() {
                type_pos[i] = members[slot.gpu_type].len();
                members[slot.gpu_type].push(i);
            }
            members
                .into_iter()
                .map(|m| MaxTree::new(m, |h| slots[h].free.len()))
                .collect()
        } else {
            Vec::new()
        };
        let tree = MaxTree::new((0..slots.len()).collect(), |h| slots[h].free.len());
        Self {
            hosts: slots,
            types,
            type_free,
            type_hosts_by_free,
            tree,
            type_trees,
            type_pos,
        }
    }

    /// Room per type for `request`, in whole workers on the hosts it may use (indexed like
    /// `types`): from the per-type free counts, without a scan of the hosts unless the
    /// request is restricted to some of them.
    fn room(&self, request: &PlacementRequest) -> std::borrow::Cow<'_, [usize]> {
        let per_worker = request.gpus_per_worker.max(1) as usize;
        if request.hosts.is_some() {
            self.room_by_scan(request).into()
        } else if per_worker > 1 {
            self.type_hosts_by_free
                .iter()
                .map(|counts| {
                    counts
                        .iter()
                        .enumerate()
                        .map(|(f, &hosts)| hosts * (f / per_worker))
                        .sum()
                })
                .collect::<Vec<usize>>()
                .into()
        } else {
            // One GPU per worker: the free GPUs kept per type.
            (&self.type_free[..]).into()
        }
    }

    /// [`FreeGpus::room`] by a scan of every host the request may use.
    fn room_by_scan(&self, request: &PlacementRequest) -> Vec<usize> {
        let per_worker = request.gpus_per_worker.max(1) as usize;
        let mut free = vec![0; self.types.len()];
        for slot in self.hosts.iter().filter(|s| request.allows(s.host)) {
            if let Some(room) = free.get_mut(slot.gpu_type) {
                *room += slot.free.len() / per_worker;
            }
        }
        free
    }

    /// The one GPU type (index in `types`) a new placement of `request` uses when the hosts
    /// with GPUs carry several types; `None` on a cluster of one type (no restriction).
    /// Room is counted in whole workers on the hosts the request allows. With speeds
    /// ([`PlacementRequest::gpu_type_speeds`]): the fastest type with room for every worker
    /// (a type without a speed counts as the slowest known one; ties to the current type,
    /// then to the most room). Otherwise, or when no type has room for every worker: the
    /// type of the job's current placement (its rank 0's host) if it has room for every
    /// worker; else the type with the most room among those with room for every worker;
    /// else the type with the most room (as many workers as fit are placed there); ties go
    /// to the type first in name order.
    fn one_type(&self, request: &PlacementRequest) -> Option<usize> {
        if let Some(name) = &request.gpu_type {
            // The policy's type; one no host carries matches no host.
            return Some(
                self.types
                    .iter()
                    .position(|t| *t == Some(name.as_str()))
                    .unwrap_or(usize::MAX),
            );
        }
        if self.types.len() < 2 {
            return None;
        }
        let free = self.room(request);
        let need = request.workers as usize;
        let current = request
            .current
            .first()
            .and_then(|rank| self.find(&rank.host))
            .map(|host| self.hosts[host].gpu_type);
        // With speeds: the fastest type with room (a type without a speed counts as the
        // slowest known one), ties to the current type, then to the most free GPUs.
        let known: Vec<f64> = request.gpu_type_speeds.values().copied().collect();
        if let Some(slowest) = known.iter().copied().reduce(f64::min) {
            let speed = |t: usize| {
                self.types[t]
                    .and_then(|name| request.gpu_type_speeds.get(name))
                    .copied()
                    .unwrap_or(slowest)
            };
            let best = (0..free.len())
                .filter(|&t| free[t] >= need)
                .max_by(|&a, &b| {
                    speed(a)
                        .total_cmp(&speed(b))
                        .then((current == Some(a)).cmp(&(current == Some(b))))
                        .then(free[a].cmp(&free[b]))
                        .then(b.cmp(&a))
                });
            if best.is_some() {
                return best;
            }
        }
        if let Some(t) = current.filter(|&t| free[t] >= need) {
            return Some(t);
        }
        let most = |fits: bool| {
            (0..free.len())
                .filter(|&t| !fits || free[t] >= need)
                .max_by_key(|&t| (free[t], Reverse(t)))
        };
        most(true).or_else(|| most(false))
    }

    /// Index of `host`, if listed.
    fn find(&self, host: &HostId) -> Option<usize> {
        self.hosts.binary_search_by(|s| s.host.cmp(host)).ok()
    }

    /// The first host at index `from` or later with at least `need` free GPUs.
    fn first_with(&self, from: usize, need: usize) -> Option<usize> {
        self.tree.first_with(from, need)
    }

    /// Records host `index`'s new free count in the trees.
    fn update(&mut self, index: usize) {
        let t = self.hosts[index].gpu_type;
        let (before, now) = (self.tree.get(index), self.hosts[index].free.len());
        if let Some(free) = self.type_free.get_mut(t) {
            *free = *free + now - before;
        }
        if let Some(counts) = self.type_hosts_by_free.get_mut(t) {
            counts[before] -= 1;
            if counts.len() <= now {
                counts.resize(now + 1, 0);
            }
            counts[now] += 1;
        }
        self.tree.set(index, now);
        if let Some(tree) = self.type_trees.get_mut(t) {
            tree.set(self.type_pos[index], now);
        }
    }

    /// Takes the request's current GPUs if its current placement is still valid (see
    /// [`place`]); changes nothing and returns `false` otherwise.
    fn keep_current(&mut self, request: &PlacementRequest) -> bool {
        let wanted_type = request.gpu_type.as_ref().map(|_| self.one_type(request));
        let mut claimed: Vec<(usize, u32)> = Vec::new();
        // Consecutive ranks are mostly on one host: look a host up only when it changes.
        let mut last: Option<(&HostId, usize)> = None;
        for (index, rank) in request.current.iter().enumerate() {
            let host = match last {
                Some((id, host)) if *id == rank.host => host,
                _ => {
                    let Some(host) = self.find(&rank.host).filter(|&h| {
                        request.allows(&rank.host)
                            && wanted_type.is_none_or(|t| t == Some(self.hosts[h].gpu_type))
                    }) else {
                        return false;
                    };
                    last = Some((&rank.host, host));
                    host
                }
            };
            let well_formed = rank.rank as usize == index
                && request.gpus_per_worker > 0
                && rank.gpus.len() == request.gpus_per_worker as usize;
            let free = &self.hosts[host].free;
            if !well_formed || !rank.gpus.iter().all(|gpu| free.binary_search(gpu).is_ok()) {
                return false;
            }
            claimed.extend(rank.gpus.iter().map(|&gpu| (host, gpu)));
        }
        claimed.sort_unstable();
        if claimed.windows(2).any(|pair| pair[0] == pair[1]) {
            return false;
        }
        for (position, &(host, gpu)) in claimed.iter().enumerate() {
            let free = &mut self.hosts[host].free;
            if let Ok(at) = free.binary_search(&gpu) {
                free.remove(at);
            }
            if claimed.get(position + 1).is_none_or(|next| next.0 != host) {
                self.update(host);
            }
        }
        true
    }

    /// First-fit placement of one request (see [`place`]), taking its GPUs.
    fn first_fit(&mut self, request: &PlacementRequest) -> Vec<RankPlacement> {
        let per_worker = request.gpus_per_worker as usize;
        if per_worker == 0 {
            return Vec::new();
        }
        let only = self.one_type(request);
        let of_type = |slot: &HostSlot<'_>| only.is_none_or(|t| slot.gpu_type == t);
        let wanted = request.workers as usize;
        let mut preferred: Vec<usize> = request
            .current
            .iter()
            .filter(|rank| request.allows(&rank.host))
            .filter_map(|rank| self.find(&rank.host))
            .filter(|&host| of_type(&self.hosts[host]))
            .collect();
        preferred.sort_unstable();
        preferred.dedup();
        // (host, workers on it), in placement order.
        let mut picks: Vec<(usize, usize)> = Vec::new();
        let mut count = 0;
        let mut take = |host: usize, count: &mut usize| {
            let fits = (self.hosts[host].free.len() / per_worker).min(wanted - *count);
            if fits > 0 {
                picks.push((host, fits));
                *count += fits;
            }
        };
        for &host in &preferred {
            if count == wanted {
                break;
            }
            take(host, &mut count);
        }
        let mut from = 0;
        while count < wanted {
            // Within the job's type, its own tree: the other types' hosts are never visited.
            let next = match only.and_then(|t| self.type_trees.get(t)) {
                Some(tree) => tree.first_with(from, per_worker),
                None => self.first_with(from, per_worker),
            };
            let Some(host) = next else {
                break;
            };
            from = host + 1;
            let slot = &self.hosts[host];
            if preferred.binary_search(&host).is_err() && request.allows(slot.host) && of_type(slot)
            {
                take(host, &mut count);
            }
        }
        if count < request.min_workers as usize {
            return Vec::new();
        }
        let mut ranks = Vec::with_capacity(count);
        for (host, workers) in picks {
            self.hosts[host].take_workers(workers, per_worker, &mut ranks);
            self.update(host);
        }
        ranks
    }
}

/// Which placement [`place_with`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum PlacementKind {
    /// [`place`]: first fit, hosts in id order.
    #[default]
    FirstFit,
    /// [`place_bco`]: balance contention and overhead (SJF-BCO's placement).
    Bco,
}

/// Places with the placement `kind` (see [`place`] and [`place_bco`]); `costs` is used by
/// [`PlacementKind::Bco`] only.
pub fn place_with(
    kind: PlacementKind,
    hosts: &[HostFree],
    requests: &[PlacementRequest],
    costs: &BTreeMap<JobId, JobCost>,
) -> BTreeMap<JobId, Vec<RankPlacement>> {
    match kind {
        PlacementKind::FirstFit => place(hosts, requests),
        PlacementKind::Bco => place_bco(hosts, requests, costs),
    }
}

/// Placement that balances NIC contention against the overhead of spanning servers, after
/// SJF-BCO (Yu, Ji, Rajan, Liu, MobiHoc'22; design brief §5.3), with the step-time model of
/// [`crate::contention`]. Same contract as [`place`]: every job gets no ranks or between
/// `min_workers` and `workers` of them, ranks `0..n` with rank 0 first, no GPU twice, a
/// worker's GPUs on one host; hosts listed twice count once, a job requested twice is
/// placed for its first request only; and the first pass is exactly [`place`]'s: a request
/// whose `workers` equals its current number of ranks keeps its current placement if that
/// is still valid.
///
/// A request for fewer workers than its minimum gets none. A request with `hosts` sees only
/// those hosts in every step below (capacity, best fit, candidates).
///
/// The other requests are placed in request order (the caller's priority; restricted requests
/// first, as in [`place`]), each with its
/// cost from `costs` ([`JobCost::default`] when missing: compute 1 s, overhead 0.05 s per
/// extra server, sync 0.5 s). A job is *multi-server* when its ranks span more than one
/// host; each host counts the multi-server jobs on it (kept ones included), `c`, which is
/// the contention its NIC sees. A host whose NIC is busy with other traffic
/// ([`HostFree::nic_factor`] `f < 1`) has the *load* `(c + 1) / f` and sits at the
/// contention level `⌈(c + 1) / f⌉ − 1` (an idle NIC: level `c`), so a half-busy NIC ranks
/// like an idle one already shared by a multi-server job.
///
/// 1. **Fits on one server**: if some host has `workers·gpus_per_worker` free GPUs, the job
///    goes on the one with the fewest free GPUs that still fits it (best fit, so large holes
///    stay for large jobs; ties: a host the job uses now, then the lowest host id). A job on
///    one server uses no NIC and adds no contention.
/// 2. **Must span servers** (the κ search of LWF-κ): for each contention threshold
///    `κ = 1, 2, …`, the candidates are the hosts at a contention level below `κ` with
///    room for a worker, taken by most free GPUs first (ties: hosts the job uses now, then
///    host id) until all workers fit. The candidate is scored with
///    [`JobCost::step_time_with_nic_s`]`(servers, c + 1, f)` of its host with the largest
///    load (with idle NICs: [`JobCost::step_time_s`]`(servers, c + 1)`, `c` being the most
///    multi-server jobs on any of its hosts). Only the thresholds that change the candidate set are tried (one past each
///    contention level present), up to the one that admits every host. The fastest candidate
///    wins; ties go to fewer servers, then to the smaller `κ`. So a job spreads over
///    uncontended hosts when the extra overhead costs less than sharing a NIC, and packs onto
///    fewer, busier hosts when it does not.
/// 3. **Shadow jobs** (a cost with [`JobCost::background_sync`], [`crate::shadow`]): their
///    step is the same on any placement, so instead of 1 and 2 they take the leftovers:
///    hosts with the fewest multi-server jobs first, then the fewest free GPUs, then the
///    busiest NIC (see `BcoIndex::leftovers`). They are never counted as multi-server jobs
///    (their traffic reaches other jobs through the measured NIC factor).
/// 4. **Does not fit at all**: as many workers as fit are placed (on every host with room,
///    most free GPUs first) if that is at least `min_workers`, otherwise none, as
///    [`place`] does.
///
/// Cost: after an `O(hosts · log hosts)` index (hosts by free GPUs, and per contention level
/// by free GPUs descending), each request costs `O(L² · workers + L · workers · log hosts)`
/// with `L` the number of contention levels present (at most a host's GPU count): only the
/// first `workers` hosts of each level can ever be taken.
pub fn place_bco(
    hosts: &[HostFree],
    requests: &[PlacementRequest],
    costs: &BTreeMap<JobId, JobCost>,
) -> BTreeMap<JobId, Vec<RankPlacement>> {
    let (free, requests, mut placed) = keep_pass(hosts, requests);
    let mut multi = vec![0usize; free.hosts.len()];
    let background = |job: &JobId| costs.get(job).is_some_and(|c| c.background_sync);
    for (request, ranks) in requests.iter().zip(&placed) {
        let Some(ranks) = ranks.as_ref().filter(|_| !background(&request.job)) else {
            continue;
        };
        for host in spanned(&free, ranks) {
            multi[host] += 1;
        }
    }
    let order = second_pass_order(&free, &requests, &placed);
    let mut index = BcoIndex::new(free, multi);
    let default_cost = JobCost::default();
    for i in order {
        let cost = costs.get(&requests[i].job).unwrap_or(&default_cost);
        placed[i] = Some(index.place(requests[i], cost));
    }
    by_job(&requests, placed)
}

/// Indices of the hosts a placement spans when it spans more than one (empty otherwise).
fn spanned(free: &FreeGpus<'_>, ranks: &[RankPlacement]) -> Vec<usize> {
    let mut hosts: Vec<usize> = Vec::new();
    for rank in ranks {
        if hosts
            .last()
            .is_none_or(|&h| *free.hosts[h].host != rank.host)
            && let Some(h) = free.find(&rank.host)
        {
            hosts.push(h);
        }
    }
    hosts.sort_unstable();
    hosts.dedup();
    if hosts.len() > 1 { hosts } else { Vec::new() }
}

/// The free GPUs of [`place_bco`] with its indexes. Only hosts with a free GPU are indexed.
struct BcoIndex<'a> {
    free: FreeGpus<'a>,
    /// Multi-server jobs on each host (by host index).
    multi: Vec<usize>,
    /// `(free GPUs, host)`: best fit.
    by_free: BTreeSet<(usize, usize)>,
    /// `levels[c]`: `(free GPUs descending, host)` of the hosts with `c` multi-server jobs.
    levels: Vec<BTreeSet<(Reverse<usize>, usize)>>,
    /// Hosts per free-GPU count: the cluster's capacity in workers of any size.
    free_counts: BTreeMap<usize, usize>,
}

impl<'a> BcoIndex<'a> {
    fn new(free: FreeGpus<'a>, multi: Vec<usize>) -> Self {
        let mut index = Self {
            free,
            multi,
            by_free: BTreeSet::new(),
            levels: Vec::new(),
            free_counts: BTreeMap::new(),
        };
        for host in 0..index.free.hosts.len() {
            index.insert(host);
        }
        index
    }

    fn free_len(&self, host: usize) -> usize {
        self.free.hosts[host].free.len()
    }

    /// Contention a job joining `host` as a multi-server job would see there, NIC factor
    /// included: `(multi-server jobs + 1) / nic_factor`.
    fn load(&self, host: usize) -> f64 {
        (self.multi[host] + 1) as f64 / self.free.hosts[host].nic_factor
    }

    /// The host's contention level: its multi-server jobs on an idle NIC; on a busy NIC the
    /// level of an idle host with the same [`BcoIndex::load`], `⌈load⌉ − 1`.
    fn level(&self, host: usize) -> usize {
        if self.free.hosts[host].nic_factor >= 1.0 {
            self.multi[host]
        } else {
            (self.load(host) - 1e-9).ceil().max(1.0) as usize - 1
        }
    }

    /// Adds `host` to the indexes under its current free count and level.
    fn insert(&mut self, host: usize) {
        let free = self.free_len(host);
        if free == 0 {
            return;
        }
        let level = self.level(host);
        if self.levels.len() <= level {
            self.levels.resize_with(level + 1, BTreeSet::new);
        }
        self.by_free.insert((free, host));
        self.levels[level].insert((Reverse(free), host));
        *self.free_counts.entry(free).or_default() += 1;
    }

    /// Removes `host` from the indexes (before its free count or level changes).
    fn remove(&mut self, host: usize) {
        let free = self.free_len(host);
        if free == 0 {
            return;
        }
        self.by_free.remove(&(free, host));
        let level = self.level(host);
        self.levels[level].remove(&(Reverse(free), host));
        if let Some(count) = self.free_counts.get_mut(&free) {
            *count -= 1;
            if *count == 0 {
                self.free_counts.remove(&free);
            }
        }
    }

    /// Workers of `per_worker` GPUs that fit in the whole cluster (on the hosts `allowed`
    /// marks, when given).
    fn capacity(&self, per_worker: usize, allowed: Option<&[bool]>) -> usize {
        match allowed {
            None => self
                .free_counts
                .range(per_worker..)
                .map(|(&free, &hosts)| free / per_worker * hosts)
                .sum(),
            Some(allowed) => self
                .by_free
                .range((per_worker, 0)..)
                .filter(|&&(_, host)| allowed[host])
                .map(|&(free, _)| free / per_worker)
                .sum(),
        }
    }

    /// Places one request (see [`place_bco`]), taking its GPUs.
    fn place(&mut self, request: &PlacementRequest, cost: &JobCost) -> Vec<RankPlacement> {
        let per_worker = request.gpus_per_worker as usize;
        let wanted = request.workers as usize;
        if per_worker == 0 || wanted == 0 || request.workers < request.min_workers {
            return Vec::new();
        }
        // The hosts a selector allows, of the one GPU type the job may use on a cluster of
        // several, by index (`None`: all).
        let only = self.free.one_type(request);
        let allowed: Option<Vec<bool>> = (request.hosts.is_some() || only.is_some()).then(|| {
            self.free
                .hosts
                .iter()
                .map(|slot| request.allows(slot.host) && only.is_none_or(|t| slot.gpu_type == t))
                .collect()
        });
        let allowed = allowed.as_deref();
        let ok = |host: usize| allowed.is_none_or(|a| a[host]);
        let mut preferred: Vec<usize> = request
            .current
            .iter()
            .filter_map(|rank| self.free.find(&rank.host))
            .filter(|&host| ok(host))
            .collect();
        preferred.sort_unstable();
        preferred.dedup();
        let key = |index: &Self, host: usize| {
            (
                Reverse(index.free_len(host)),
                preferred.binary_search(&host).is_err(),
                host,
            )
        };
        let capacity = self.capacity(per_worker, allowed);
        let picks: Vec<(usize, usize)> = if capacity < wanted {
            if capacity < request.min_workers as usize || capacity == 0 {
                return Vec::new();
            }
            let mut all: Vec<usize> = self
                .by_free
                .range((per_worker, 0)..)
                .map(|&(_, host)| host)
                .filter(|&host| ok(host))
                .collect();
            all.sort_unstable_by_key(|&host| key(self, host));
            all.into_iter()
                .map(|host| (host, self.free_len(host) / per_worker))
                .collect()
        } else if cost.background_sync {
            self.leftovers(wanted, per_worker, &preferred, allowed)
        } else if let Some(host) = self.best_fit(wanted * per_worker, &preferred, allowed) {
            vec![(host, wanted)]
        } else {
            self.spread(wanted, per_worker, (&preferred, allowed), cost, key)
        };
        self.take(&picks, per_worker, !cost.background_sync)
    }

    /// A shadow job's hosts ([`JobCost::background_sync`], [`crate::shadow`] rule 4): those
    /// with room for a worker (and `allowed`), the fewest multi-server (ring) jobs first
    /// (its background traffic would slow their syncs), then the fewest free GPUs (the
    /// leftovers: whole hosts stay for jobs that pay for spanning), then the busiest NIC
    /// (which those jobs avoid), then hosts it uses now, then host order; taken until
    /// `wanted` workers fit (they do: the caller checked the capacity).
    fn leftovers(
        &self,
        wanted: usize,
        per_worker: usize,
        preferred: &[usize],
        allowed: Option<&[bool]>,
    ) -> Vec<(usize, usize)> {
        let mut hosts: Vec<usize> = self
            .by_free
            .range((per_worker, 0)..)
            .map(|&(_, host)| host)
            .filter(|&host| allowed.is_none_or(|a| a[host]))
            .collect();
        hosts.sort_by(|&a, &b| {
            self.multi[a]
                .cmp(&self.multi[b])
                .then(self.free_len(a).cmp(&self.free_len(b)))
                .then(
                    self.free.hosts[a]
                        .nic_factor
                        .total_cmp(&self.free.hosts[b].nic_factor),
                )
                .then(
                    preferred
                        .binary_search(&a)
                        .is_err()
                        .cmp(&preferred.binary_search(&b).is_err()),
                )
                .then(a.cmp(&b))
        });
        let mut picks = Vec::new();
        let mut count = 0;
        for host in hosts {
            let fits = (self.free_len(host) / per_worker).min(wanted - count);
            picks.push((host, fits));
            count += fits;
            if count == wanted {
                break;
            }
        }
        picks
    }

    /// The host with the fewest free GPUs, at least `need` (ties: preferred, then lowest),
    /// among those `allowed` marks (all when `None`).
    fn best_fit(
        &self,
        need: usize,
        preferred: &[usize],
        allowed: Option<&[bool]>,
    ) -> Option<usize> {
        let &(fewest, first) = self
            .by_free
            .range((need, 0)..)
            .find(|&&(_, host)| allowed.is_none_or(|a| a[host]))?;
        Some(
            preferred
                .iter()
                .copied()
                .find(|&host| self.free_len(host) == fewest)
                .unwrap_or(first),
        )
    }

    /// The κ search of [`place_bco`] for a job that needs several servers; `wanted` workers
    /// fit in the cluster (on the hosts `allowed` marks, the only candidates when given).
    /// Returns `(host, workers)` in placement order.
    fn spread(
        &self,
        wanted: usize,
        per_worker: usize,
        (preferred, allowed): (&[usize], Option<&[bool]>),
        cost: &JobCost,
        key: impl Fn(&Self, usize) -> (Reverse<usize>, bool, usize),
    ) -> Vec<(usize, usize)> {
        // Every candidate set's first `wanted` hosts are among each level's first `wanted`
        // hosts (each takes at least one worker) and the preferred ones.
        let mut candidates: Vec<usize> = Vec::new();
        for level in &self.levels {
            candidates.extend(
                level
                    .iter()
                    .take_while(|(Reverse(free), _)| *free >= per_worker)
                    .filter(|&&(_, host)| allowed.is_none_or(|a| a[host]))
                    .take(wanted)
                    .map(|&(_, host)| host),
            );
        }
        candidates.extend(
            preferred
                .iter()
                .copied()
                .filter(|&host| self.free_len(host) >= per_worker),
        );
        candidates.sort_unstable_by_key(|&host| key(self, host));
        candidates.dedup();
        let mut thresholds: Vec<usize> = candidates.iter().map(|&h| self.level(h) + 1).collect();
        thresholds.sort_unstable();
        thresholds.dedup();

        let mut best: Option<(f64, Vec<(usize, usize)>)> = None;
        for kappa in thresholds {
            let mut picks = Vec::new();
            let mut count = 0;
            // The host with the largest load: its sync is the slowest.
            let mut worst: Option<usize> = None;
            for &host in &candidates {
                if self.level(host) >= kappa {
                    continue;
                }
                let fits = (self.free_len(host) / per_worker).min(wanted - count);
                picks.push((host, fits));
                count += fits;
                if worst.is_none_or(|w| self.load(host) > self.load(w)) {
                    worst = Some(host);
                }
                if count == wanted {
                    break;
                }
            }
            let Some(worst) = worst.filter(|_| count == wanted) else {
                continue;
            };
            let time = cost.step_time_with_nic_s(
                picks.len() as u32,
                self.multi[worst] as u32 + 1,
                self.free.hosts[worst].nic_factor,
            );
            let better = best.as_ref().is_none_or(|(best_time, best_picks)| {
                time < *best_time || (time == *best_time && picks.len() < best_picks.len())
            });
            if better {
                best = Some((time, picks));
            }
        }
        best.map(|(_, picks)| picks).unwrap_or_default()
    }

    /// Takes `workers` workers' GPUs (lowest indices first) on each listed host, in order,
    /// and counts the job on its hosts if it spans several and `counts` (not a shadow job).
    fn take(
        &mut self,
        picks: &[(usize, usize)],
        per_worker: usize,
        counts: bool,
    ) -> Vec<RankPlacement> {
        let multi_server = counts && picks.len() > 1;
        let mut ranks = Vec::with_capacity(picks.iter().map(|p| p.1).sum());
        for &(host, workers) in picks {
            self.remove(host);
            self.free.hosts[host].take_workers(workers, per_worker, &mut ranks);
            self.free.update(host);
            if multi_server {
                self.multi[host] += 1;
            }
            self.insert(host);
        }
        ranks
    }
}

/// Ports handed out by [`master_port`]: below Linux's default ephemeral range (32768–60999),
/// so a rendezvous port never collides with an outgoing connection's port.
pub const MASTER_PORT_RANGE: std::ops::Range<u16> = 20000..30000;

/// The rendezvous port (`MASTER_PORT`) of `job`'s generation `generation`: a stable hash
/// (64-bit FNV-1a of the id, a `0xff` separator and the generation's little-endian bytes) into
/// [`MASTER_PORT_RANGE`], then the next port not in `taken`, wrapping around. Deterministic
/// across processes and versions. If every port is taken, the hashed port is returned.
pub fn master_port(job: &JobId, generation: u64, taken: &BTreeSet<u16>) -> u16 {
    const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let bytes = job
        .as_str()
        .bytes()
        .chain([0xff])
        .chain(generation.to_le_bytes());
    let hash = bytes.fold(FNV_OFFSET_BASIS, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(FNV_PRIME)
    });
    let span = MASTER_PORT_RANGE.end - MASTER_PORT_RANGE.start;
    let start = (hash % u64::from(span)) as u16;
    (0..span)
        .map(|offset| MASTER_PORT_RANGE.start + (start + offset) % span)
        .find(|port| !taken.contains(port))
        .unwrap_or(MASTER_PORT_RANGE.start + start)
}

#[cfg(test)]
mod tests;

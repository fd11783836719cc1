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
            let slot = &mut self.hosts[host];
            for chunk in slot
                .free
                .drain(..workers * per_worker)
                .as_slice()
                .chunks_exact(per_worker)
            {
                ranks.push(RankPlacement {
                    rank: ranks.len() as u32,
                    host: slot.host.clone(),
                    gpus: chunk.to_vec(),
                });
            }
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
            let slot = &mut self.free.hosts[host];
            for chunk in slot
                .free
                .drain(..workers * per_worker)
                .as_slice()
                .chunks_exact(per_worker)
            {
                ranks.push(RankPlacement {
                    rank: ranks.len() as u32,
                    host: slot.host.clone(),
                    gpus: chunk.to_vec(),
                });
            }
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The placement as first written (a linear scan of every host per request), kept as the
    /// reference the faster [`place`] must agree with.
    mod reference {
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
                let keepable =
                    wanted == request.current.len() && request.workers >= request.min_workers;
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
                let Some(host_free) = free.get(&rank.host).filter(|_| request.allows(&rank.host))
                else {
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
            let current_hosts: BTreeSet<&HostId> =
                request.current.iter().map(|r| &r.host).collect();
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
    }

    /// [`place_bco`] written directly from its documentation with linear scans (every
    /// threshold `κ = 1..=max + 1`, every host), the reference the indexed version must agree
    /// with.
    mod bco_reference {
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
            let order = |(host, free): &(HostId, usize)| {
                (Reverse(*free), !current.contains(host), host.clone())
            };
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
    }

    fn host(name: &str, gpus: &[u32]) -> HostFree {
        HostFree::new(HostId::new(name).unwrap(), gpus.to_vec())
    }

    fn job_id(name: &str) -> JobId {
        JobId::new(name).unwrap()
    }

    fn rank(rank: u32, host: &str, gpus: &[u32]) -> RankPlacement {
        RankPlacement {
            rank,
            host: HostId::new(host).unwrap(),
            gpus: gpus.to_vec(),
        }
    }

    fn request(
        name: &str,
        workers: u32,
        gpus_per_worker: u32,
        min_workers: u32,
    ) -> PlacementRequest {
        PlacementRequest {
            job: job_id(name),
            workers,
            gpus_per_worker,
            min_workers,
            current: Vec::new(),
            hosts: None,
            gpu_type_speeds: BTreeMap::new(),
            gpu_type: None,
        }
    }

    fn currently(mut request: PlacementRequest, current: Vec<RankPlacement>) -> PlacementRequest {
        request.current = current;
        request
    }

    #[test]
    fn first_fit_fills_hosts_in_id_order_without_splitting_workers() {
        let hosts = [host("b", &[0, 1, 2]), host("a", &[3, 1, 0])];
        let placed = place(&hosts, &[request("j", 3, 2, 1)]);
        // Host a (sorted GPUs 0, 1, 3) holds one 2-GPU worker, host b another; GPU 3 of a and
        // GPU 2 of b stay free because a worker never spans hosts.
        assert_eq!(
            placed[&job_id("j")],
            vec![rank(0, "a", &[0, 1]), rank(1, "b", &[0, 1])]
        );
    }

    #[test]
    fn partial_placement_needs_the_minimum() {
        let hosts = [host("a", &[0, 1, 2, 3])];
        let placed = place(&hosts, &[request("big", 6, 1, 2), request("none", 3, 1, 1)]);
        assert_eq!(placed[&job_id("big")].len(), 4);
        assert!(placed[&job_id("none")].is_empty());
        let placed = place(&hosts, &[request("big", 6, 1, 5), request("fits", 3, 1, 1)]);
        assert!(placed[&job_id("big")].is_empty());
        assert_eq!(placed[&job_id("fits")].len(), 3);
    }

    #[test]
    fn unchanged_jobs_keep_their_placement_even_when_later_in_priority() {
        let hosts = [host("a", &[0, 1, 2, 3]), host("b", &[0, 1])];
        let kept_ranks = vec![rank(0, "b", &[1]), rank(1, "a", &[2])];
        let placed = place(
            &hosts,
            &[
                request("new", 4, 1, 1),
                currently(request("kept", 2, 1, 1), kept_ranks.clone()),
            ],
        );
        assert_eq!(placed[&job_id("kept")], kept_ranks);
        assert_eq!(
            placed[&job_id("new")],
            vec![
                rank(0, "a", &[0]),
                rank(1, "a", &[1]),
                rank(2, "a", &[3]),
                rank(3, "b", &[0])
            ]
        );
    }

    #[test]
    fn invalid_current_placements_are_replaced() {
        let hosts = [host("a", &[0, 1]), host("b", &[0, 1])];
        let cases = [
            ("host gone", vec![rank(0, "gone", &[0])]),
            ("gpu gone", vec![rank(0, "a", &[7])]),
            ("wrong gpu count", vec![rank(0, "a", &[0, 1])]),
            ("ranks out of order", vec![rank(1, "a", &[0])]),
        ];
        for (why, current) in cases {
            let placed = place(&hosts, &[currently(request("j", 1, 1, 1), current)]);
            assert_eq!(placed[&job_id("j")], vec![rank(0, "a", &[0])], "{why}");
        }
        // The same GPU twice within a job, or already kept by an earlier job.
        let twice = vec![rank(0, "b", &[1]), rank(1, "b", &[1])];
        let placed = place(&hosts, &[currently(request("j", 2, 1, 1), twice)]);
        assert_eq!(
            placed[&job_id("j")],
            vec![rank(0, "b", &[0]), rank(1, "b", &[1])]
        );
        let placed = place(
            &hosts,
            &[
                currently(request("first", 1, 1, 1), vec![rank(0, "a", &[1])]),
                currently(request("second", 1, 1, 1), vec![rank(0, "a", &[1])]),
            ],
        );
        assert_eq!(placed[&job_id("first")], vec![rank(0, "a", &[1])]);
        assert_eq!(placed[&job_id("second")], vec![rank(0, "a", &[0])]);
    }

    #[test]
    fn resized_jobs_prefer_the_hosts_they_use() {
        let hosts = [host("a", &[0, 1]), host("b", &[0, 1, 2, 3])];
        let current = vec![rank(0, "b", &[2]), rank(1, "b", &[3])];
        let placed = place(&hosts, &[currently(request("grow", 5, 1, 1), current)]);
        assert_eq!(
            placed[&job_id("grow")],
            vec![
                rank(0, "b", &[0]),
                rank(1, "b", &[1]),
                rank(2, "b", &[2]),
                rank(3, "b", &[3]),
                rank(4, "a", &[0]),
            ]
        );
    }

    /// `r` restricted to the hosts `names`.
    fn only(r: PlacementRequest, names: &[&str]) -> PlacementRequest {
        PlacementRequest {
            hosts: Some(names.iter().map(|n| HostId::new(*n).unwrap()).collect()),
            ..r
        }
    }

    /// A request with a `gpu_type` uses that type's hosts only: a job of unchanged size on
    /// another type moves, and a type no host carries places nothing.
    #[test]
    fn a_requested_gpu_type_is_the_only_one_used() {
        let hosts = [
            host("a", &[0, 1]).with_gpu_type("t4"),
            host("c", &[0, 1]).with_gpu_type("a100"),
        ];
        let typed = |r: PlacementRequest, t: &str| PlacementRequest {
            gpu_type: Some(t.to_owned()),
            ..r
        };
        let on_a = |r: PlacementRequest| PlacementRequest {
            current: (0..2)
                .map(|g| RankPlacement {
                    rank: g,
                    host: HostId::new("a").unwrap(),
                    gpus: vec![g],
                })
                .collect(),
            ..r
        };
        for kind in [PlacementKind::FirstFit, PlacementKind::Bco] {
            let placed = place_with(
                kind,
                &hosts,
                &[
                    typed(on_a(request("moves", 2, 1, 1)), "a100"),
                    typed(request("nowhere", 1, 1, 1), "h100"),
                    typed(request("stays", 2, 1, 1), "t4"),
                ],
                &BTreeMap::new(),
            );
            let on = |job: &str| -> Vec<&str> {
                placed[&job_id(job)]
                    .iter()
                    .map(|r| r.host.as_str())
                    .collect()
            };
            assert_eq!(on("moves"), ["c", "c"], "{kind:?}");
            assert!(on("nowhere").is_empty(), "{kind:?}");
            assert_eq!(on("stays"), ["a", "a"], "{kind:?}");
        }
    }

    #[test]
    fn on_a_cluster_of_several_gpu_types_each_new_placement_uses_one_type() {
        // t4: 2 hosts × 2 GPUs; a100: 3 hosts × 2 GPUs.
        let hosts = [
            host("a", &[0, 1]).with_gpu_type("t4"),
            host("b", &[0, 1]).with_gpu_type("t4"),
            host("c", &[0, 1]).with_gpu_type("a100"),
            host("d", &[0, 1]).with_gpu_type("a100"),
            host("e", &[0, 1]).with_gpu_type("a100"),
        ];
        let on = |r: PlacementRequest, current: &[(&str, u32)]| PlacementRequest {
            current: current
                .iter()
                .enumerate()
                .map(|(rank, &(h, gpu))| RankPlacement {
                    rank: rank as u32,
                    host: HostId::new(h).unwrap(),
                    gpus: vec![gpu],
                })
                .collect(),
            ..r
        };
        for kind in [PlacementKind::FirstFit, PlacementKind::Bco] {
            let placed = place_with(
                kind,
                &hosts,
                &[
                    // Runs on t4 and grows from 2 to 3: t4 has room for 3 (its own 2 GPUs
                    // are free again), so it stays on t4, though a100 has more free GPUs.
                    on(request("grows-on-t4", 3, 1, 1), &[("a", 0), ("a", 1)]),
                    // New, 3 workers: only a100 has room for 3 (t4 has 1 GPU left on b,
                    // which first fit alone would have taken with c's two).
                    request("new", 3, 1, 1),
                    // 5 workers, 3 a100 GPUs and 1 t4 left: as many as fit, on a100.
                    request("too-big", 5, 1, 2),
                ],
                &BTreeMap::new(),
            );
            let types = |job: &str| -> BTreeSet<&str> {
                placed[&job_id(job)]
                    .iter()
                    .map(|r| {
                        let h = hosts.iter().find(|h| h.host == r.host).unwrap();
                        h.gpu_type.as_deref().unwrap()
                    })
                    .collect()
            };
            assert_eq!(placed[&job_id("grows-on-t4")].len(), 3, "{kind:?}");
            assert_eq!(types("grows-on-t4"), BTreeSet::from(["t4"]), "{kind:?}");
            assert_eq!(placed[&job_id("new")].len(), 3, "{kind:?}");
            assert_eq!(types("new"), BTreeSet::from(["a100"]), "{kind:?}");
            assert_eq!(placed[&job_id("too-big")].len(), 3, "{kind:?}");
            assert_eq!(types("too-big"), BTreeSet::from(["a100"]), "{kind:?}");

            // A job restricted to some hosts counts only their free GPUs: 2 on t4 (b), 2
            // on a100 (c): the tie goes to the type first in name order, a100.
            let placed = place_with(
                kind,
                &hosts,
                &[only(request("restricted", 2, 1, 1), &["b", "c"])],
                &BTreeMap::new(),
            );
            assert_eq!(
                servers_of(&placed[&job_id("restricted")]),
                ["c"],
                "{kind:?}"
            );

            // Without types, or with one type among the hosts that have GPUs (a CPU-only
            // host of another type adds none), nothing changes: the job spans a and b.
            for one in [
                vec![host("a", &[0]), host("b", &[0, 1])],
                vec![
                    host("a", &[0]).with_gpu_type("t4"),
                    host("b", &[0, 1]).with_gpu_type("t4"),
                    host("cpu", &[]).with_gpu_type("none"),
                ],
            ] {
                let placed = place_with(kind, &one, &[request("j", 3, 1, 1)], &BTreeMap::new());
                assert_eq!(servers_of(&placed[&job_id("j")]), ["a", "b"], "{kind:?}");
            }

            // Room counts whole workers: three T4 hosts with one free GPU each hold no
            // 2-GPU worker; the A100 host holds one.
            let scattered = [
                host("a", &[0]).with_gpu_type("t4"),
                host("b", &[1]).with_gpu_type("t4"),
                host("d", &[2]).with_gpu_type("t4"),
                host("c", &[0, 1]).with_gpu_type("a100"),
            ];
            let placed = place_with(
                kind,
                &scattered,
                &[request("wide-worker", 1, 2, 1)],
                &BTreeMap::new(),
            );
            assert_eq!(
                servers_of(&placed[&job_id("wide-worker")]),
                ["c"],
                "{kind:?}"
            );
        }
    }

    #[test]
    fn with_speeds_each_job_gets_its_fastest_type_with_room_in_request_order() {
        // t4: 2 hosts × 2 GPUs; a100: 1 host × 2 GPUs.
        let hosts = [
            host("a", &[0, 1]).with_gpu_type("t4"),
            host("b", &[0, 1]).with_gpu_type("t4"),
            host("c", &[0, 1]).with_gpu_type("a100"),
        ];
        let speeds = |r: PlacementRequest, pairs: &[(&str, f64)]| PlacementRequest {
            gpu_type_speeds: pairs.iter().map(|&(t, v)| (t.to_string(), v)).collect(),
            ..r
        };
        for kind in [PlacementKind::FirstFit, PlacementKind::Bco] {
            let placed = place_with(
                kind,
                &hosts,
                &[
                    // Requested first (the policy's priority order): its fastest type, a100,
                    // although t4 has more free GPUs.
                    speeds(request("first", 2, 1, 2), &[("t4", 10.0), ("a100", 12.0)]),
                    // Fastest on a100 too, which is full now: its next fastest with room.
                    speeds(request("second", 2, 1, 2), &[("t4", 10.0), ("a100", 40.0)]),
                    // Only t4 known: a100 counts as its slowest known type.
                    speeds(request("t4-only", 2, 1, 2), &[("t4", 10.0)]),
                ],
                &BTreeMap::new(),
            );
            assert_eq!(servers_of(&placed[&job_id("first")]), ["c"], "{kind:?}");
            let t4: BTreeSet<String> = ["second", "t4-only"]
                .iter()
                .flat_map(|j| servers_of(&placed[&job_id(j)]))
                .collect();
            assert_eq!(t4, BTreeSet::from(["a".into(), "b".into()]), "{kind:?}");
            // No speeds: the most free GPUs: "first" goes to t4 (4 free), "second" to a100
            // (2 free each, tie to the first name).
            let placed = place_with(
                kind,
                &hosts,
                &[request("first", 2, 1, 2), request("second", 2, 1, 2)],
                &BTreeMap::new(),
            );
            let first = servers_of(&placed[&job_id("first")]);
            assert!(first == ["a"] || first == ["b"], "{kind:?}: {first:?}");
            assert_eq!(servers_of(&placed[&job_id("second")]), ["c"], "{kind:?}");
        }
    }

    #[test]
    fn restricted_jobs_are_placed_before_jobs_that_may_go_anywhere() {
        // The only host "narrow" may use is the first one first fit would give "wide",
        // requested first (higher priority), and "anywhere", requested second.
        let hosts = [host("a", &[0, 1]), host("b", &[0, 1]), host("c", &[0, 1])];
        for kind in [PlacementKind::FirstFit, PlacementKind::Bco] {
            let placed = place_with(
                kind,
                &hosts,
                &[
                    only(request("wide", 2, 1, 1), &["a", "b"]),
                    request("anywhere", 2, 1, 1),
                    only(request("narrow", 2, 1, 2), &["a"]),
                ],
                &BTreeMap::new(),
            );
            assert_eq!(servers_of(&placed[&job_id("narrow")]), ["a"], "{kind:?}");
            assert_eq!(servers_of(&placed[&job_id("wide")]), ["b"], "{kind:?}");
            assert_eq!(servers_of(&placed[&job_id("anywhere")]), ["c"], "{kind:?}");
        }
    }

    #[test]
    fn selector_jobs_get_gpus_of_their_hosts_only() {
        let hosts = [
            host("a", &[0, 1, 2, 3]),
            host("b", &[0, 1]),
            host("c", &[0, 1]),
        ];
        for kind in [PlacementKind::FirstFit, PlacementKind::Bco] {
            let placed = place_with(
                kind,
                &hosts,
                &[
                    only(request("on-c", 2, 1, 1), &["c"]),
                    only(request("on-b-c", 4, 1, 1), &["b", "c"]),
                    request("anywhere", 2, 1, 1),
                ],
                &BTreeMap::new(),
            );
            assert_eq!(servers_of(&placed[&job_id("on-c")]), ["c"], "{kind:?}");
            // Only b is left of its hosts: 2 of its 4 workers.
            assert_eq!(servers_of(&placed[&job_id("on-b-c")]), ["b"], "{kind:?}");
            assert_eq!(servers_of(&placed[&job_id("anywhere")]), ["a"], "{kind:?}");
            // No matching host, or too few GPUs on the matching ones for the minimum: nothing.
            let placed = place_with(
                kind,
                &hosts,
                &[
                    only(request("nowhere", 1, 1, 1), &["gone"]),
                    only(request("too-small", 3, 1, 3), &["b"]),
                ],
                &BTreeMap::new(),
            );
            assert!(placed[&job_id("nowhere")].is_empty(), "{kind:?}");
            assert!(placed[&job_id("too-small")].is_empty(), "{kind:?}");
            // A running job whose host no longer matches is moved, not kept.
            let moved = currently(
                only(request("moved", 1, 1, 1), &["b"]),
                vec![rank(0, "a", &[0])],
            );
            let placed = place_with(kind, &hosts, &[moved], &BTreeMap::new());
            assert_eq!(
                placed[&job_id("moved")],
                vec![rank(0, "b", &[0])],
                "{kind:?}"
            );
        }
    }

    #[test]
    fn zero_workers_or_zero_gpus_place_nothing() {
        let hosts = [host("a", &[0, 1])];
        let placed = place(
            &hosts,
            &[
                currently(request("stopped", 0, 1, 1), vec![rank(0, "a", &[0])]),
                request("cpu-only", 2, 0, 0),
            ],
        );
        assert!(placed[&job_id("stopped")].is_empty());
        assert!(placed[&job_id("cpu-only")].is_empty());
    }

    #[test]
    fn master_port_is_stable_and_skips_taken_ports() {
        let job = job_id("mnist-mlp");
        let none = BTreeSet::new();
        let port = master_port(&job, 3, &none);
        // Pinned: the hash must not change between versions, or a restarted allocator would
        // move running jobs' ports.
        assert_eq!(port, 28_022);
        let taken: BTreeSet<u16> = [port, port + 1].into();
        assert_eq!(master_port(&job, 3, &taken), port + 2);
        let all: BTreeSet<u16> = MASTER_PORT_RANGE.collect();
        assert_eq!(master_port(&job, 3, &all), port);
        let near_end: BTreeSet<u16> = (port..MASTER_PORT_RANGE.end).collect();
        assert_eq!(master_port(&job, 3, &near_end), MASTER_PORT_RANGE.start);
    }

    fn arbitrary_hosts() -> impl Strategy<Value = Vec<HostFree>> {
        prop::collection::vec(prop::collection::btree_set(0u32..8, 0..8), 0..6).prop_flat_map(
            |sets| {
                let hosts: Vec<_> = sets
                    .into_iter()
                    .enumerate()
                    .map(|(i, gpus)| {
                        Just(gpus.into_iter().collect::<Vec<u32>>())
                            .prop_shuffle()
                            .prop_map(move |gpus| host(&format!("host-{i}"), &gpus))
                    })
                    .collect();
                hosts
            },
        )
    }

    /// Requests whose current placements are arbitrary (often invalid or overlapping).
    fn arbitrary_requests() -> impl Strategy<Value = Vec<PlacementRequest>> {
        let one = (
            0u32..6,
            1u32..=4,
            0u32..=6,
            prop::collection::vec((0usize..7, prop::collection::vec(0u32..10, 0..4)), 0..4),
            selector_hosts(),
        );
        prop::collection::vec(one, 0..8).prop_map(|raw| {
            raw.into_iter()
                .enumerate()
                .map(
                    |(i, (workers, gpus_per_worker, min, current, hosts))| PlacementRequest {
                        job: job_id(&format!("job-{i}")),
                        workers,
                        gpus_per_worker,
                        min_workers: min.min(workers),
                        current: current
                            .into_iter()
                            .enumerate()
                            .map(|(r, (h, gpus))| rank(r as u32, &format!("host-{h}"), &gpus))
                            .collect(),
                        hosts,
                        gpu_type_speeds: BTreeMap::new(),
                        gpu_type: None,
                    },
                )
                .collect()
        })
    }

    /// No selector (most often), or the hosts a selector matched among `host-0..7`.
    fn selector_hosts() -> impl Strategy<Value = Option<BTreeSet<HostId>>> {
        prop_oneof![
            2 => Just(None),
            1 => prop::collection::btree_set(0usize..7, 0..4).prop_map(|set| Some(
                set.into_iter()
                    .map(|h| HostId::new(format!("host-{h}")).unwrap())
                    .collect()
            )),
        ]
    }

    fn check_valid(
        hosts: &[HostFree],
        requests: &[PlacementRequest],
        placed: &BTreeMap<JobId, Vec<RankPlacement>>,
    ) -> Result<(), TestCaseError> {
        prop_assert_eq!(placed.len(), requests.len());
        let mut used = BTreeSet::new();
        for request in requests {
            let ranks = &placed[&request.job];
            let count = ranks.len() as u32;
            prop_assert!(count <= request.workers);
            prop_assert!(count == 0 || count >= request.min_workers);
            for (index, rank) in ranks.iter().enumerate() {
                prop_assert_eq!(rank.rank as usize, index);
                prop_assert_eq!(rank.gpus.len(), request.gpus_per_worker as usize);
                let host = hosts.iter().find(|h| h.host == rank.host);
                prop_assert!(host.is_some(), "unknown host {}", rank.host);
                prop_assert!(
                    request.allows(&rank.host),
                    "{} placed on {}, outside its selector",
                    request.job,
                    rank.host
                );
                for gpu in &rank.gpus {
                    prop_assert!(
                        host.unwrap().gpus.contains(gpu),
                        "no GPU {} on {}",
                        gpu,
                        rank.host
                    );
                    prop_assert!(
                        used.insert((rank.host.clone(), *gpu)),
                        "GPU {} of {} given twice",
                        gpu,
                        rank.host
                    );
                }
            }
        }
        Ok(())
    }

    /// Hosts that may be listed twice and GPU lists that may repeat an index.
    fn hosts_with_repeats() -> impl Strategy<Value = Vec<HostFree>> {
        prop::collection::vec((0usize..7, prop::collection::vec(0u32..10, 0..10)), 0..9).prop_map(
            |raw| {
                raw.into_iter()
                    .map(|(h, gpus)| host(&format!("host-{h}"), &gpus))
                    .collect()
            },
        )
    }

    /// Requests on up to 7 hosts, with repeated jobs and partly valid current placements.
    fn requests_with_repeats() -> impl Strategy<Value = Vec<PlacementRequest>> {
        let one = (
            0usize..10,
            0u32..9,
            0u32..=4,
            0u32..=6,
            prop::collection::vec((0usize..8, prop::collection::vec(0u32..10, 0..4)), 0..6),
            any::<bool>(),
            selector_hosts(),
        );
        prop::collection::vec(one, 0..12).prop_map(|raw| {
            raw.into_iter()
                .map(|(j, workers, gpus_per_worker, min, current, tidy, hosts)| {
                    // Tidy current placements have the right shape, so more of them are kept.
                    let current = current
                        .into_iter()
                        .enumerate()
                        .map(|(r, (h, mut gpus))| {
                            if tidy {
                                gpus.resize(gpus_per_worker as usize, r as u32);
                            }
                            rank(r as u32, &format!("host-{h}"), &gpus)
                        })
                        .collect::<Vec<_>>();
                    PlacementRequest {
                        job: job_id(&format!("job-{j}")),
                        workers: if tidy { current.len() as u32 } else { workers },
                        gpus_per_worker,
                        min_workers: min,
                        current,
                        hosts,
                        gpu_type_speeds: BTreeMap::new(),
                        gpu_type: None,
                    }
                })
                .collect()
        })
    }

    /// On generated clusters of three GPU types, with each job's measured speeds: the
    /// per-type trees and free counts give the same placements as first fit over every host
    /// filtered by type, with room counted by a scan; each new placement uses one type.
    #[test]
    fn per_type_indexes_agree_with_scanning_every_host() {
        use crate::benchgen::{BenchConfig, DecisionInputs};
        for seed in 1..=3 {
            let inputs = DecisionInputs::generate(&BenchConfig {
                jobs: 300,
                nodes: 200,
                gpus_per_node: 8,
                gpu_types: 3,
                seed,
            });
            let mut requests = inputs.requests(&inputs.allocate());
            for (r, &i) in requests.iter_mut().zip(&inputs.priority) {
                r.gpu_type_speeds = inputs.views[i].gpu_type_speeds.clone();
            }
            let fast = place(&inputs.hosts, &requests);
            let (mut free, reqs, mut placed) = keep_pass(&inputs.hosts, &requests);
            free.type_trees.clear();
            for i in second_pass_order(&free, &reqs, &placed) {
                assert_eq!(free.room(reqs[i]).to_vec(), free.room_by_scan(reqs[i]));
                placed[i] = Some(free.first_fit(reqs[i]));
            }
            let scanned = by_job(&reqs, placed);
            assert_eq!(fast, scanned, "seed {seed}");
            let type_of: BTreeMap<&HostId, Option<&str>> = inputs
                .hosts
                .iter()
                .map(|h| (&h.host, h.gpu_type.as_deref()))
                .collect();
            let mut anew = 0;
            for (k, r) in requests.iter().enumerate() {
                let ranks = &fast[&r.job];
                if ranks.is_empty() || *ranks == inputs.current[inputs.priority[k]] {
                    continue;
                }
                anew += 1;
                let types: BTreeSet<_> = ranks.iter().map(|rk| type_of[&rk.host]).collect();
                assert_eq!(types.len(), 1, "{}: {ranks:?}", r.job);
            }
            assert!(anew > 50, "seed {seed}: only {anew} placed anew");
        }
    }

    #[test]
    fn agrees_with_the_reference_on_generated_clusters() {
        use crate::benchgen::{BenchConfig, DecisionInputs};
        for (seed, jobs, nodes) in [(1, 200, 150), (2, 400, 300), (3, 300, 500)] {
            let inputs = DecisionInputs::generate(&BenchConfig {
                jobs,
                nodes,
                gpus_per_node: 8,
                gpu_types: 1,
                seed,
            });
            let requests = inputs.requests(&inputs.allocate());
            assert_eq!(
                place(&inputs.hosts, &requests),
                reference::place(&inputs.hosts, &requests),
                "seed {seed}"
            );
            // Also from scratch, and with every job resized by one worker.
            let fresh: Vec<PlacementRequest> = requests
                .iter()
                .map(|r| PlacementRequest {
                    workers: r.workers + 1,
                    ..r.clone()
                })
                .collect();
            assert_eq!(
                place(&inputs.hosts, &fresh),
                reference::place(&inputs.hosts, &fresh),
                "seed {seed}"
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        #[test]
        fn placements_are_valid(hosts in arbitrary_hosts(), requests in arbitrary_requests()) {
            let placed = place(&hosts, &requests);
            check_valid(&hosts, &requests, &placed)?;
        }

        #[test]
        fn unchanged_jobs_keep_their_placement(
            hosts in arbitrary_hosts(),
            requests in arbitrary_requests(),
            lost_host in 0usize..7,
            resized in prop::collection::vec(any::<bool>(), 8),
        ) {
            let first = place(&hosts, &requests);
            // Next round: one host is gone and some jobs ask for one worker more.
            let survivors: Vec<HostFree> = hosts.iter().filter(|h| h.host.as_str() != format!("host-{lost_host}")).cloned().collect();
            let next: Vec<PlacementRequest> = requests
                .iter()
                .zip(&resized)
                .map(|(r, &resize)| PlacementRequest {
                    workers: first[&r.job].len() as u32 + u32::from(resize),
                    current: first[&r.job].clone(),
                    ..r.clone()
                })
                .collect();
            let second = place(&survivors, &next);
            check_valid(&survivors, &next, &second)?;
            for (request, &resize) in next.iter().zip(&resized) {
                let on_survivors = request.current.iter().all(|r| survivors.iter().any(|h| h.host == r.host));
                if !resize && on_survivors {
                    prop_assert_eq!(&second[&request.job], &request.current);
                }
            }
        }

        #[test]
        fn agrees_with_the_reference(
            hosts in prop_oneof![arbitrary_hosts(), hosts_with_repeats()],
            requests in prop_oneof![arbitrary_requests(), requests_with_repeats()],
        ) {
            prop_assert_eq!(place(&hosts, &requests), reference::place(&hosts, &requests));
        }

        #[test]
        fn master_ports_are_in_range_deterministic_and_free(
            name in "[a-z0-9][a-z0-9_-]{0,20}",
            generation in any::<u64>(),
            taken in prop::collection::btree_set(20_000u16..30_000, 0..500),
        ) {
            let job = job_id(&name);
            let port = master_port(&job, generation, &taken);
            prop_assert!(MASTER_PORT_RANGE.contains(&port));
            prop_assert!(!taken.contains(&port));
            prop_assert_eq!(port, master_port(&job, generation, &taken));
        }
    }

    // ---- BCO placement ----

    /// Distinct hosts of a placement, in id order.
    fn servers_of(ranks: &[RankPlacement]) -> Vec<String> {
        let hosts: BTreeSet<String> = ranks.iter().map(|r| r.host.to_string()).collect();
        hosts.into_iter().collect()
    }

    /// `n` one-GPU ranks of the given `(host, gpu)` pairs.
    fn ranks_on(gpus: &[(&str, u32)]) -> Vec<RankPlacement> {
        gpus.iter()
            .enumerate()
            .map(|(i, &(h, g))| rank(i as u32, h, &[g]))
            .collect()
    }

    /// Seven 8-GPU hosts `a`..`g`; two multi-server jobs on `a`+`b` and `c`+`d` (one GPU on
    /// each, so those hosts keep 7 free GPUs); single-server jobs leave `e`, `f`, `g` with
    /// `free_elsewhere` free GPUs each.
    fn contended_cluster(free_elsewhere: u32) -> (Vec<HostFree>, Vec<PlacementRequest>) {
        let hosts: Vec<HostFree> = ["a", "b", "c", "d", "e", "f", "g"]
            .iter()
            .map(|h| host(h, &[0, 1, 2, 3, 4, 5, 6, 7]))
            .collect();
        let mut kept = vec![
            currently(request("m1", 2, 1, 1), ranks_on(&[("a", 0), ("b", 0)])),
            currently(request("m2", 2, 1, 1), ranks_on(&[("c", 0), ("d", 0)])),
        ];
        let used = 8 - free_elsewhere;
        for h in ["e", "f", "g"] {
            let gpus: Vec<(&str, u32)> = (0..used).map(|g| (h, g)).collect();
            kept.push(currently(
                request(&format!("s-{h}"), used, 1, 1),
                ranks_on(&gpus),
            ));
        }
        (hosts, kept)
    }

    #[test]
    fn bco_avoids_contended_servers_when_free_ones_suffice() {
        // e, f, g have 6 free GPUs each, a-d 7 but each already carries a multi-server job.
        let (hosts, mut requests) = contended_cluster(6);
        requests.push(request("new", 12, 1, 1));
        let costs = BTreeMap::new();
        let bco = place_bco(&hosts, &requests, &costs);
        let ff = place(&hosts, &requests);
        assert_eq!(bco[&job_id("new")].len(), 12);
        // κ = 1: e + f, contention 1 (1 + 0.05 + 0.5 s) beats κ = 2: a + b, contention 2
        // (1 + 0.05 + 1.0 s); first fit takes a and b.
        assert_eq!(servers_of(&bco[&job_id("new")]), ["e", "f"]);
        assert_eq!(servers_of(&ff[&job_id("new")]), ["a", "b"]);
        for kept in &requests[..5] {
            assert_eq!(bco[&kept.job], kept.current);
        }
        // With 5 free GPUs each, e, f, g: three servers at contention 1 (1.6 s) still beat
        // two at contention 2 (2.05 s).
        let (hosts, mut requests) = contended_cluster(5);
        requests.push(request("new", 12, 1, 1));
        let bco = place_bco(&hosts, &requests, &costs);
        assert_eq!(servers_of(&bco[&job_id("new")]), ["e", "f", "g"]);
    }

    #[test]
    fn bco_shares_a_nic_when_spreading_costs_more() {
        // e, f, g have 2 free GPUs each: 14 workers need a-d anyway. With a large per-server
        // overhead and cheap sync, two contended servers (a, b) win over spreading.
        let (hosts, mut requests) = contended_cluster(2);
        requests.push(request("new", 14, 1, 1));
        let costs = BTreeMap::from([(job_id("new"), JobCost::new(1.0, 1.0, 0.01))]);
        let bco = place_bco(&hosts, &requests, &costs);
        assert_eq!(servers_of(&bco[&job_id("new")]), ["a", "b"]);
        // Expensive sync instead: κ = 1 (e, f, g: 6 workers) cannot fit 14, so contention 2 is
        // unavoidable; the job takes the fewest servers there.
        let costs = BTreeMap::from([(job_id("new"), JobCost::new(1.0, 0.0, 10.0))]);
        let bco = place_bco(&hosts, &requests, &costs);
        assert_eq!(servers_of(&bco[&job_id("new")]), ["a", "b"]);
    }

    #[test]
    fn bco_avoids_busy_nics() {
        // Four idle 4-GPU hosts; a and b have NICs half busy with other traffic. An 8-worker
        // job must span two hosts: c and d (load 1) beat a and b (load 2), which first fit
        // and BCO with idle NICs take.
        let mut hosts: Vec<HostFree> = ["a", "b", "c", "d"]
            .iter()
            .map(|h| host(h, &[0, 1, 2, 3]))
            .collect();
        let costs = BTreeMap::new();
        let requests = [request("j", 8, 1, 1)];
        let idle = place_bco(&hosts, &requests, &costs);
        assert_eq!(servers_of(&idle[&job_id("j")]), ["a", "b"]);
        hosts[0].nic_factor = 0.5;
        hosts[1].nic_factor = 0.5;
        let busy = place_bco(&hosts, &requests, &costs);
        assert_eq!(servers_of(&busy[&job_id("j")]), ["c", "d"]);
        // 12 workers need three hosts, so a busy one: its load (2) sets the sync term
        // whichever hosts join it, and candidates under a threshold go by free GPUs, then id.
        let busy = place_bco(&hosts, &[request("j", 12, 1, 1)], &costs);
        assert_eq!(servers_of(&busy[&job_id("j")]), ["a", "b", "c"]);
        // A NaN factor counts as idle; out-of-range factors are clamped.
        hosts[0].nic_factor = f64::NAN;
        hosts[1].nic_factor = 7.0;
        let placed = place_bco(&hosts, &requests, &costs);
        assert_eq!(servers_of(&placed[&job_id("j")]), ["a", "b"]);
    }

    #[test]
    fn bco_best_fits_jobs_that_fit_on_one_server() {
        let hosts = [
            host("a", &[0, 1, 2, 3, 4, 5, 6, 7]),
            host("b", &[0, 1, 2, 3]),
            host("c", &[0, 1, 2, 3]),
            host("d", &[0, 1, 2]),
        ];
        let costs = BTreeMap::new();
        let placed = place_bco(&hosts, &[request("j", 3, 1, 1)], &costs);
        assert_eq!(servers_of(&placed[&job_id("j")]), ["d"]);
        let placed = place_bco(&hosts, &[request("j", 2, 2, 1)], &costs);
        assert_eq!(servers_of(&placed[&job_id("j")]), ["b"]);
        // Tie between b and c (4 free each): the host the job already uses.
        let resized = currently(request("j", 4, 1, 1), vec![rank(0, "c", &[1])]);
        let placed = place_bco(&hosts, &[resized], &costs);
        assert_eq!(servers_of(&placed[&job_id("j")]), ["c"]);
        // First fit would spread this one over a and b.
        let requests = [request("big", 6, 1, 1), request("j", 4, 1, 1)];
        let placed = place_bco(&hosts, &requests, &costs);
        assert_eq!(servers_of(&placed[&job_id("big")]), ["a"]);
        assert_eq!(servers_of(&placed[&job_id("j")]), ["b"]);
    }

    /// A shadow job takes the leftovers: the smallest holes first, spanning hosts, so the
    /// ring jobs after it each get a whole host (as a ring job, it would take a whole host
    /// and leave the second ring job straddling two).
    #[test]
    fn bco_gives_shadow_jobs_the_leftovers_and_keeps_ring_jobs_packed() {
        let hosts = [
            host("h1", &[0, 1, 2, 3]),
            host("h2", &[0, 1, 2, 3]),
            host("h3", &[0, 1, 2, 3]),
        ];
        let kept = currently(
            request("k", 3, 1, 1),
            vec![
                rank(0, "h1", &[0]),
                rank(1, "h1", &[1]),
                rank(2, "h1", &[2]),
            ],
        );
        let requests = [
            kept,
            request("s", 2, 1, 1),
            request("r1", 4, 1, 1),
            request("r2", 3, 1, 1),
        ];
        let mut costs = BTreeMap::from([(job_id("s"), JobCost::background(0.1))]);
        let placed = place_bco(&hosts, &requests, &costs);
        assert_eq!(servers_of(&placed[&job_id("s")]), ["h1", "h2"]);
        assert_eq!(servers_of(&placed[&job_id("r1")]), ["h3"]);
        assert_eq!(servers_of(&placed[&job_id("r2")]), ["h2"]);
        // The same job as a ring job: best fit on one host, and r2 must span two.
        costs.insert(job_id("s"), JobCost::new(0.1, 0.01, 0.1));
        let placed = place_bco(&hosts, &requests, &costs);
        assert_eq!(placed[&job_id("s")].len(), 2);
        assert_eq!(servers_of(&placed[&job_id("s")]).len(), 1);
        assert_eq!(servers_of(&placed[&job_id("r2")]).len(), 2);
    }

    /// A shadow job keeps off the hosts whose NICs carry multi-server ring jobs (its
    /// background traffic would slow their syncs), takes busy NICs before idle ones, and a
    /// shadow job spanning hosts is not contention for the ring jobs placed after it.
    #[test]
    fn bco_keeps_shadow_traffic_off_ring_jobs_and_does_not_count_it_as_contention() {
        let mut hosts = vec![
            host("h1", &[0, 1, 2, 3]),
            host("h2", &[0, 1, 2, 3]),
            host("h3", &[0, 1, 2, 3]),
            host("h4", &[0, 1, 2, 3]),
        ];
        let ring = currently(
            request("ring", 2, 1, 1),
            vec![rank(0, "h1", &[0]), rank(1, "h2", &[0])],
        );
        let costs = BTreeMap::from([(job_id("s"), JobCost::background(0.1))]);
        let placed = place_bco(&hosts, &[ring.clone(), request("s", 2, 1, 1)], &costs);
        assert_eq!(servers_of(&placed[&job_id("s")]), ["h3"]);
        // Among equal hosts, the busiest NIC.
        hosts[3].nic_factor = 0.3;
        let placed = place_bco(&hosts, &[ring, request("s", 2, 1, 1)], &costs);
        assert_eq!(servers_of(&placed[&job_id("s")]), ["h4"]);
        // A kept shadow job on h1 and h2, and a ring job that must span two hosts (6 workers
        // on 4-GPU hosts, h3 and h4 busy with 1 GPU each): h1 and h2 have the most room and
        // count no contention, so they are its cheapest pair.
        let hosts = [
            host("h1", &[0, 1, 2, 3]),
            host("h2", &[0, 1, 2, 3]),
            host("h3", &[0, 1, 2, 3]),
            host("h4", &[0, 1, 2, 3]),
        ];
        let shadow = currently(
            request("s", 2, 1, 1),
            vec![rank(0, "h1", &[0]), rank(1, "h2", &[0])],
        );
        let other = currently(
            request("o", 2, 1, 1),
            vec![rank(0, "h3", &[0]), rank(1, "h4", &[0])],
        );
        let placed = place_bco(
            &hosts,
            &[shadow.clone(), other.clone(), request("r", 6, 1, 1)],
            &costs,
        );
        assert_eq!(servers_of(&placed[&job_id("r")]), ["h1", "h2"]);
        // Counted as a ring job instead, h1-h2 and h3-h4 are alike (contention 2 either
        // way): the tie goes to the lower ids, so check only that o's hosts are contended.
        let ring_costs = BTreeMap::new();
        let placed = place_bco(&hosts, &[shadow, other, request("r", 6, 1, 1)], &ring_costs);
        assert_eq!(placed[&job_id("r")].len(), 6);
    }

    #[test]
    fn bco_places_what_fits_when_the_cluster_is_short() {
        let hosts = [host("a", &[0, 1, 2]), host("b", &[0, 1, 2, 3])];
        let costs = BTreeMap::new();
        let placed = place_bco(&hosts, &[request("j", 5, 2, 2)], &costs);
        // 1 + 2 two-GPU workers fit: b first (most free), then a.
        assert_eq!(
            placed[&job_id("j")],
            vec![
                rank(0, "b", &[0, 1]),
                rank(1, "b", &[2, 3]),
                rank(2, "a", &[0, 1])
            ]
        );
        let placed = place_bco(&hosts, &[request("j", 5, 2, 4)], &costs);
        assert!(placed[&job_id("j")].is_empty());
        let placed = place_bco(
            &hosts,
            &[request("none", 0, 1, 0), request("cpu", 2, 0, 0)],
            &costs,
        );
        assert!(placed.values().all(Vec::is_empty));
    }

    #[test]
    fn place_with_dispatches_and_kinds_parse() {
        let hosts = [host("a", &[0, 1, 2, 3, 4, 5]), host("b", &[0, 1, 2])];
        let requests = [request("j", 3, 1, 1)];
        let costs = BTreeMap::new();
        assert_eq!(
            place_with(PlacementKind::FirstFit, &hosts, &requests, &costs),
            place(&hosts, &requests)
        );
        assert_eq!(
            place_with(PlacementKind::Bco, &hosts, &requests, &costs),
            place_bco(&hosts, &requests, &costs)
        );
        assert_eq!(PlacementKind::default(), PlacementKind::FirstFit);
        assert_eq!(
            serde_json::to_string(&PlacementKind::FirstFit).unwrap(),
            "\"first-fit\""
        );
        assert_eq!(
            serde_json::from_str::<PlacementKind>("\"bco\"").unwrap(),
            PlacementKind::Bco
        );
        #[cfg(feature = "clap")]
        assert_eq!(
            <PlacementKind as clap::ValueEnum>::from_str("first-fit", false).unwrap(),
            PlacementKind::FirstFit
        );
    }

    #[test]
    fn bco_agrees_with_the_reference_on_generated_clusters() {
        use crate::benchgen::{BenchConfig, DecisionInputs};
        for (seed, jobs, nodes) in [(1, 200, 150), (2, 400, 300), (3, 300, 500)] {
            let inputs = DecisionInputs::generate(&BenchConfig {
                jobs,
                nodes,
                gpus_per_node: 8,
                gpu_types: 1,
                seed,
            });
            let requests = inputs.requests(&inputs.allocate());
            let costs: BTreeMap<JobId, JobCost> = requests
                .iter()
                .enumerate()
                .filter(|(i, _)| i % 3 != 0)
                .map(|(i, r)| {
                    let sync = [0.05, 0.5, 5.0][i % 3];
                    (r.job.clone(), JobCost::new(1.0, 0.1, sync))
                })
                .collect();
            let fresh: Vec<PlacementRequest> = requests
                .iter()
                .map(|r| PlacementRequest {
                    workers: r.workers + 1,
                    ..r.clone()
                })
                .collect();
            for requests in [&requests, &fresh] {
                let placed = place_bco(&inputs.hosts, requests, &costs);
                assert_eq!(
                    placed,
                    bco_reference::place_bco(&inputs.hosts, requests, &costs),
                    "seed {seed}"
                );
                check_valid(&inputs.hosts, requests, &placed).unwrap();
            }
        }
    }

    /// Times [`place`] and [`place_bco`] on the 10,000-job, 12,500-host generated cluster.
    /// `cargo test --release -p converge-sched --lib bco_timing -- --ignored --nocapture`
    #[test]
    #[ignore = "timing; run in release with --ignored --nocapture"]
    #[allow(clippy::disallowed_methods, clippy::disallowed_types)] // a timing run, ignored by default
    fn bco_timing_on_the_benchgen_cluster() {
        use crate::benchgen::{BenchConfig, DecisionInputs};
        use std::time::{Duration, Instant};
        let inputs = DecisionInputs::generate(&BenchConfig::default());
        let requests = inputs.requests(&inputs.allocate());
        let resized: Vec<PlacementRequest> = requests
            .iter()
            .map(|r| PlacementRequest {
                workers: r.workers + 1,
                ..r.clone()
            })
            .collect();
        let costs = BTreeMap::new();
        let median = |f: &dyn Fn() -> BTreeMap<JobId, Vec<RankPlacement>>| {
            let mut times: Vec<Duration> = (0..7)
                .map(|_| {
                    let start = Instant::now();
                    std::hint::black_box(f());
                    start.elapsed()
                })
                .collect();
            times.sort();
            times[times.len() / 2]
        };
        let shape = |placed: &BTreeMap<JobId, Vec<RankPlacement>>| {
            let mut multi: BTreeMap<&HostId, usize> = BTreeMap::new();
            let (mut jobs, mut spanning, mut servers) = (0, 0, 0);
            for ranks in placed.values().filter(|r| !r.is_empty()) {
                let hosts: BTreeSet<&HostId> = ranks.iter().map(|r| &r.host).collect();
                jobs += 1;
                servers += hosts.len();
                if hosts.len() > 1 {
                    spanning += 1;
                    for h in hosts {
                        *multi.entry(h).or_default() += 1;
                    }
                }
            }
            let gpus: usize = placed.values().flatten().map(|r| r.gpus.len()).sum();
            let max = multi.values().max().copied().unwrap_or(0);
            let shared = multi.values().filter(|&&c| c > 1).count();
            format!(
                "{jobs} jobs / {gpus} GPUs placed, {spanning} multi-server, {servers} \
                 job-servers, NICs shared by >1 multi-server job: {shared}, max contention {max}"
            )
        };
        for (name, requests) in [("decision", &requests), ("every job +1 worker", &resized)] {
            let ff = median(&|| place(&inputs.hosts, requests));
            let bco = median(&|| place_bco(&inputs.hosts, requests, &costs));
            println!(
                "{name}: place {:.1} ms, place_bco {:.1} ms ({} requests, {} hosts)",
                ff.as_secs_f64() * 1e3,
                bco.as_secs_f64() * 1e3,
                requests.len(),
                inputs.hosts.len()
            );
            println!("  first fit: {}", shape(&place(&inputs.hosts, requests)));
            let bco_placed = place_bco(&inputs.hosts, requests, &costs);
            println!("  bco:       {}", shape(&bco_placed));
            // Jobs first fit places and BCO does not, by GPUs per worker.
            let ff_placed = place(&inputs.hosts, requests);
            let mut lost: BTreeMap<u32, usize> = BTreeMap::new();
            for r in requests.iter() {
                if bco_placed[&r.job].is_empty() && !ff_placed[&r.job].is_empty() {
                    *lost.entry(r.gpus_per_worker).or_default() += 1;
                }
            }
            println!("  placed by first fit only, by GPUs per worker: {lost:?}");
        }
    }

    fn arbitrary_costs() -> impl Strategy<Value = BTreeMap<JobId, JobCost>> {
        prop::collection::vec(
            prop::option::of((0.0..2.0_f64, 0.0..1.0_f64, 0.0..2.0_f64, 0.0..0.5_f64)),
            12,
        )
        .prop_map(|raw| {
            raw.into_iter()
                .enumerate()
                .filter_map(|(i, cost)| {
                    let (compute_s, overhead_s_per_server, sync_s, intra_sync_s) = cost?;
                    Some((
                        job_id(&format!("job-{i}")),
                        JobCost {
                            compute_s,
                            overhead_s_per_server,
                            sync_s,
                            intra_sync_s,
                            background_sync: false,
                        },
                    ))
                })
                .collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        #[test]
        fn bco_placements_are_valid(
            hosts in arbitrary_hosts(),
            requests in arbitrary_requests(),
            costs in arbitrary_costs(),
        ) {
            let placed = place_bco(&hosts, &requests, &costs);
            check_valid(&hosts, &requests, &placed)?;
        }

        #[test]
        fn bco_agrees_with_the_reference(
            hosts in prop_oneof![arbitrary_hosts(), hosts_with_repeats()],
            requests in prop_oneof![arbitrary_requests(), requests_with_repeats()],
            costs in arbitrary_costs(),
        ) {
            prop_assert_eq!(
                place_bco(&hosts, &requests, &costs),
                bco_reference::place_bco(&hosts, &requests, &costs)
            );
        }

        /// The first pass is `place`'s: whatever it keeps, both placements return unchanged.
        #[test]
        fn bco_keeps_exactly_what_place_keeps(
            hosts in prop_oneof![arbitrary_hosts(), hosts_with_repeats()],
            requests in prop_oneof![arbitrary_requests(), requests_with_repeats()],
            costs in arbitrary_costs(),
        ) {
            let mut free = FreeGpus::new(&hosts);
            let mut seen = BTreeSet::new();
            let kept: Vec<&PlacementRequest> = requests
                .iter()
                .filter(|r| seen.insert(&r.job))
                .filter(|r| {
                    r.workers as usize == r.current.len()
                        && r.workers >= r.min_workers
                        && free.keep_current(r)
                })
                .collect();
            let bco = place_bco(&hosts, &requests, &costs);
            let ff = place(&hosts, &requests);
            for request in kept {
                prop_assert_eq!(&bco[&request.job], &request.current);
                prop_assert_eq!(&ff[&request.job], &request.current);
            }
        }

        #[test]
        fn bco_unchanged_jobs_keep_their_placement(
            hosts in arbitrary_hosts(),
            requests in arbitrary_requests(),
            costs in arbitrary_costs(),
            lost_host in 0usize..7,
            resized in prop::collection::vec(any::<bool>(), 8),
        ) {
            let first = place_bco(&hosts, &requests, &costs);
            let survivors: Vec<HostFree> = hosts
                .iter()
                .filter(|h| h.host.as_str() != format!("host-{lost_host}"))
                .cloned()
                .collect();
            let next: Vec<PlacementRequest> = requests
                .iter()
                .zip(&resized)
                .map(|(r, &resize)| PlacementRequest {
                    workers: first[&r.job].len() as u32 + u32::from(resize),
                    current: first[&r.job].clone(),
                    ..r.clone()
                })
                .collect();
            let second = place_bco(&survivors, &next, &costs);
            check_valid(&survivors, &next, &second)?;
            for (request, &resize) in next.iter().zip(&resized) {
                let on_survivors = request
                    .current
                    .iter()
                    .all(|r| survivors.iter().any(|h| h.host == r.host));
                if !resize && on_survivors {
                    prop_assert_eq!(&second[&request.job], &request.current);
                }
            }
        }

        /// On the same cluster state (every earlier job kept), a new job that fits on one
        /// server gets one server from BCO, never more than first fit gives it, and both place
        /// as many workers.
        #[test]
        fn bco_never_spans_more_servers_than_first_fit_for_a_one_server_job(
            hosts in arbitrary_hosts(),
            requests in arbitrary_requests(),
            costs in arbitrary_costs(),
            workers in 1u32..10,
            gpus_per_worker in 1u32..=4,
            current_host in 0usize..7,
        ) {
            let first = place_bco(&hosts, &requests, &costs);
            let mut next: Vec<PlacementRequest> = requests
                .iter()
                .map(|r| PlacementRequest {
                    workers: first[&r.job].len() as u32,
                    min_workers: r.min_workers.min(first[&r.job].len() as u32),
                    current: first[&r.job].clone(),
                    ..r.clone()
                })
                .collect();
            let new = job_id("new");
            // Sometimes "resized" from one worker elsewhere (its GPU is not held).
            let current = if current_host < 6 {
                vec![rank(0, &format!("host-{current_host}"), &vec![99; gpus_per_worker as usize])]
            } else {
                Vec::new()
            };
            next.push(currently(request("new", workers, gpus_per_worker, 1), current));
            let bco = place_bco(&hosts, &next, &costs);
            let ff = place(&hosts, &next);
            for request in &requests {
                prop_assert_eq!(&bco[&request.job], &first[&request.job]);
                prop_assert_eq!(&ff[&request.job], &first[&request.job]);
            }
            let used: BTreeSet<(&HostId, u32)> = first
                .values()
                .flatten()
                .flat_map(|r| r.gpus.iter().map(move |&g| (&r.host, g)))
                .collect();
            let fits_on_one = hosts.iter().any(|h| {
                let free = h.gpus.iter().filter(|&&g| !used.contains(&(&h.host, g))).count();
                free >= (workers * gpus_per_worker) as usize
            });
            prop_assert_eq!(bco[&new].len(), ff[&new].len());
            if fits_on_one {
                prop_assert_eq!(bco[&new].len(), workers as usize);
                prop_assert_eq!(servers_of(&bco[&new]).len(), 1);
                prop_assert!(servers_of(&bco[&new]).len() <= servers_of(&ff[&new]).len());
            }
        }
    }
}

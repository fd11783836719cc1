//! Placement: turns each job's worker count into ranks on hosts' GPUs (first fit, keeping
//! unchanged jobs exactly where they are so they do not restart), and picks each generation's
//! rendezvous port. Pure functions; design brief §4 (resize, fresh `MASTER_PORT` per
//! generation) and §5.3 (a policy's output is a GPU count and a placement per job).

use std::collections::{BTreeMap, BTreeSet};

use converge_common::{HostId, JobId, RankPlacement};

/// A live host and the indices of all its GPUs (as in `CUDA_VISIBLE_DEVICES`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFree {
    pub host: HostId,
    pub gpus: Vec<u32>,
}

/// One job's wish: `workers` workers of `gpus_per_worker` GPUs each.
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

/// Places every request on `hosts` and returns, for each requested job, its ranks
/// (`0..n`, rank 0 first); an empty list when the job gets no GPUs.
///
/// 1. A request whose `workers` equals its current number of ranks keeps its current placement
///    exactly if that is still valid: ranks `0..n` in order, each with `gpus_per_worker`
///    distinct GPUs of a listed host, none used by a job kept before it (in request order).
/// 2. The other requests, in request order (the caller's priority order), are placed first-fit:
///    hosts the job currently uses first, then the others, each group in host-id order; a host
///    is filled before the next is used; every worker's GPUs are on one host, lowest indices
///    first. If not all workers fit, as many as fit are placed when that is at least
///    `min_workers`, otherwise none.
///
/// So every job gets no ranks or between `min_workers` and `workers` of them (a request for
/// fewer workers than its minimum gets none).
///
/// No GPU is ever given twice. Hosts listed twice count once with the union of their GPUs;
/// a job requested twice is placed for its first request only.
pub fn place(
    hosts: &[HostFree],
    requests: &[PlacementRequest],
) -> BTreeMap<JobId, Vec<RankPlacement>> {
    let mut free = FreeGpus::new(hosts);
    let mut seen = BTreeSet::new();
    let requests: Vec<&PlacementRequest> =
        requests.iter().filter(|r| seen.insert(&r.job)).collect();

    let mut placed: Vec<Option<Vec<RankPlacement>>> = requests
        .iter()
        .map(|request| {
            let wanted = request.workers as usize;
            let keepable =
                wanted == request.current.len() && request.workers >= request.min_workers;
            (keepable && free.keep_current(request)).then(|| request.current.clone())
        })
        .collect();
    for (request, ranks) in requests.iter().zip(&mut placed) {
        if ranks.is_none() {
            *ranks = Some(free.first_fit(request));
        }
    }
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
    /// Leaves (from `leaves` on) hold each host's free count; node `i` holds the largest
    /// count under it (children `2i`, `2i + 1`); unused leaves hold 0.
    tree: Vec<usize>,
    leaves: usize,
}

struct HostSlot<'a> {
    host: &'a HostId,
    /// Free GPUs, increasing, no duplicates.
    free: Vec<u32>,
}

impl<'a> FreeGpus<'a> {
    fn new(hosts: &'a [HostFree]) -> Self {
        let mut listed: Vec<&HostFree> = hosts.iter().collect();
        listed.sort_by(|a, b| a.host.cmp(&b.host));
        let mut slots: Vec<HostSlot<'a>> = Vec::with_capacity(listed.len());
        for host in listed {
            match slots.last_mut() {
                Some(last) if *last.host == host.host => last.free.extend(&host.gpus),
                _ => slots.push(HostSlot {
                    host: &host.host,
                    free: host.gpus.clone(),
                }),
            }
        }
        for slot in &mut slots {
            slot.free.sort_unstable();
            slot.free.dedup();
        }
        let leaves = slots.len().next_power_of_two();
        let mut tree = vec![0; 2 * leaves];
        for (i, slot) in slots.iter().enumerate() {
            tree[leaves + i] = slot.free.len();
        }
        for node in (1..leaves).rev() {
            tree[node] = tree[2 * node].max(tree[2 * node + 1]);
        }
        Self {
            hosts: slots,
            tree,
            leaves,
        }
    }

    /// Index of `host`, if listed.
    fn find(&self, host: &HostId) -> Option<usize> {
        self.hosts.binary_search_by(|s| s.host.cmp(host)).ok()
    }

    /// The first host at index `from` or later with at least `need` free GPUs.
    fn first_with(&self, from: usize, need: usize) -> Option<usize> {
        self.first_below(1, 0, self.leaves, from, need)
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
            return (low < self.hosts.len()).then_some(low);
        }
        let middle = low + (high - low) / 2;
        self.first_below(2 * node, low, middle, from, need)
            .or_else(|| self.first_below(2 * node + 1, middle, high, from, need))
    }

    /// Records host `index`'s new free count in the tree.
    fn update(&mut self, index: usize) {
        let mut node = self.leaves + index;
        self.tree[node] = self.hosts[index].free.len();
        while node > 1 {
            node /= 2;
            self.tree[node] = self.tree[2 * node].max(self.tree[2 * node + 1]);
        }
    }

    /// Takes the request's current GPUs if its current placement is still valid (see
    /// [`place`]); changes nothing and returns `false` otherwise.
    fn keep_current(&mut self, request: &PlacementRequest) -> bool {
        let mut claimed: Vec<(usize, u32)> = Vec::new();
        // Consecutive ranks are mostly on one host: look a host up only when it changes.
        let mut last: Option<(&HostId, usize)> = None;
        for (index, rank) in request.current.iter().enumerate() {
            let host = match last {
                Some((id, host)) if *id == rank.host => host,
                _ => {
                    let Some(host) = self.find(&rank.host) else {
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
        let wanted = request.workers as usize;
        let mut preferred: Vec<usize> = request
            .current
            .iter()
            .filter_map(|rank| self.find(&rank.host))
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
            let Some(host) = self.first_with(from, per_worker) else {
                break;
            };
            from = host + 1;
            if preferred.binary_search(&host).is_err() {
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
            for request in &requests {
                if !placed.contains_key(&request.job) {
                    placed.insert(request.job.clone(), first_fit(request, &mut free));
                }
            }
            placed
        }

        /// Takes the request's current GPUs out of `free` if its current placement is still valid
        /// (see [`place`]); leaves `free` untouched and returns `false` otherwise.
        fn keep_current(
            request: &PlacementRequest,
            free: &mut BTreeMap<&HostId, BTreeSet<u32>>,
        ) -> bool {
            let mut claimed: BTreeSet<(&HostId, u32)> = BTreeSet::new();
            for (index, rank) in request.current.iter().enumerate() {
                let Some(host_free) = free.get(&rank.host) else {
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

    fn host(name: &str, gpus: &[u32]) -> HostFree {
        HostFree {
            host: HostId::new(name).unwrap(),
            gpus: gpus.to_vec(),
        }
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
        );
        prop::collection::vec(one, 0..8).prop_map(|raw| {
            raw.into_iter()
                .enumerate()
                .map(
                    |(i, (workers, gpus_per_worker, min, current))| PlacementRequest {
                        job: job_id(&format!("job-{i}")),
                        workers,
                        gpus_per_worker,
                        min_workers: min.min(workers),
                        current: current
                            .into_iter()
                            .enumerate()
                            .map(|(r, (h, gpus))| rank(r as u32, &format!("host-{h}"), &gpus))
                            .collect(),
                    },
                )
                .collect()
        })
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
        );
        prop::collection::vec(one, 0..12).prop_map(|raw| {
            raw.into_iter()
                .map(|(j, workers, gpus_per_worker, min, current, tidy)| {
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
                    }
                })
                .collect()
        })
    }

    #[test]
    fn agrees_with_the_reference_on_generated_clusters() {
        use crate::benchgen::{BenchConfig, DecisionInputs};
        for (seed, jobs, nodes) in [(1, 200, 150), (2, 400, 300), (3, 300, 500)] {
            let inputs = DecisionInputs::generate(&BenchConfig {
                jobs,
                nodes,
                gpus_per_node: 8,
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
}

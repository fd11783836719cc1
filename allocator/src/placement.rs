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
/// No GPU is ever given twice. Hosts listed twice count once with the union of their GPUs;
/// a job requested twice is placed for its first request only.
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
        if request.workers as usize == request.current.len() && keep_current(request, &mut free) {
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
fn keep_current(request: &PlacementRequest, free: &mut BTreeMap<&HostId, BTreeSet<u32>>) -> bool {
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
    let current_hosts: BTreeSet<&HostId> = request.current.iter().map(|r| &r.host).collect();
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
    if ranks.len() < request.workers as usize && ranks.len() < request.min_workers as usize {
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

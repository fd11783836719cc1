use super::*;
use proptest::prelude::*;

/// The placement as first written (a linear scan of every host per request), kept as the
/// reference the faster [`place`] must agree with.
mod reference;

/// [`place_bco`] written directly from its documentation with linear scans (every
/// threshold `κ = 1..=max + 1`, every host), the reference the indexed version must agree
/// with.
mod bco_reference;

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

fn request(name: &str, workers: u32, gpus_per_worker: u32, min_workers: u32) -> PlacementRequest {
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
    prop::collection::vec(prop::collection::btree_set(0u32..8, 0..8), 0..6).prop_flat_map(|sets| {
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
    })
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

/// The generated cluster of `nodes` hosts of 8 GPUs of one type and `jobs` jobs from
/// `seed`, and the placement requests of its allocation.
fn generated(
    seed: u64,
    jobs: usize,
    nodes: u32,
) -> (crate::benchgen::DecisionInputs, Vec<PlacementRequest>) {
    use crate::benchgen::{BenchConfig, DecisionInputs};
    let inputs = DecisionInputs::generate(&BenchConfig {
        jobs,
        nodes,
        gpus_per_node: 8,
        gpu_types: 1,
        seed,
    });
    let requests = inputs.requests(&inputs.allocate());
    (inputs, requests)
}

/// `requests` with one worker more each.
fn one_worker_more(requests: &[PlacementRequest]) -> Vec<PlacementRequest> {
    requests
        .iter()
        .map(|r| PlacementRequest {
            workers: r.workers + 1,
            ..r.clone()
        })
        .collect()
}

#[test]
fn agrees_with_the_reference_on_generated_clusters() {
    for (seed, jobs, nodes) in [(1, 200, 150), (2, 400, 300), (3, 300, 500)] {
        let (inputs, requests) = generated(seed, jobs, nodes);
        assert_eq!(
            place(&inputs.hosts, &requests),
            reference::place(&inputs.hosts, &requests),
            "seed {seed}"
        );
        // Also from scratch, and with every job resized by one worker.
        let fresh = one_worker_more(&requests);
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
    for (seed, jobs, nodes) in [(1, 200, 150), (2, 400, 300), (3, 300, 500)] {
        let (inputs, requests) = generated(seed, jobs, nodes);
        let costs: BTreeMap<JobId, JobCost> = requests
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 3 != 0)
            .map(|(i, r)| {
                let sync = [0.05, 0.5, 5.0][i % 3];
                (r.job.clone(), JobCost::new(1.0, 0.1, sync))
            })
            .collect();
        let fresh = one_worker_more(&requests);
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
    let resized = one_worker_more(&requests);
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

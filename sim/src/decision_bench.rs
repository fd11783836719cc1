//! `converge-sim bench-decision`: times one allocation decision at scale on the clusters
//! that [`converge_sched::benchgen`] generates (single-threaded, minimum and median over
//! repeats); `converge-sim report` uses [`time_decisions`] for its scale section. This part
//! reads the clock and prints; the inputs and the decision are pure.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use converge_common::{JobId, RankPlacement};

use converge_sched::benchgen::{BenchBatches, BenchConfig, DecisionInputs};

/// `converge-sim bench-decision`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchDecisionArgs {
    /// Active jobs (about 70 % running with placed allocations, the rest pending).
    #[arg(long, default_value_t = 10_000)]
    pub jobs: usize,
    /// Hosts in the cluster.
    #[arg(long, default_value_t = 12_500)]
    pub nodes: u32,
    /// GPUs per host.
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: u32,
    /// GPU types: with more than one, host n is of type `type-{n mod K}` and every job has
    /// measured speeds per type (the decision projects the others and the quality policy
    /// gives each job a type by comparative advantage).
    #[arg(long, default_value_t = 1)]
    pub gpu_types: u32,
    /// Decisions timed; min and median are reported.
    #[arg(long, default_value_t = 5)]
    pub repeat: usize,
    /// Seed of the generated cluster.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Times of one decision.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Timing {
    policy: Duration,
    placement: Duration,
    total: Duration,
}

/// Minimum and median of one part of the decision over the repeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MinMedian {
    pub min: Duration,
    pub median: Duration,
}

impl MinMedian {
    fn of(mut times: Vec<Duration>) -> Self {
        times.sort();
        Self {
            min: times.first().copied().unwrap_or_default(),
            median: if times.is_empty() {
                Duration::ZERO
            } else {
                median(&times)
            },
        }
    }
}

/// What the last timed decision did, as a sanity check of the inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecisionOutcome {
    /// Jobs given at least one worker.
    pub admitted: usize,
    /// GPUs the policy handed out.
    pub allocated_gpus: u64,
    /// GPUs the placement placed.
    pub placed_gpus: usize,
    /// Jobs whose placement differs from their current one.
    pub placed_anew: usize,
}

/// The times of `repeat` decisions on the same inputs ([`time_decisions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecisionTimes {
    /// Decisions timed.
    pub repeat: usize,
    /// [`DecisionInputs::allocate`] (`quality_allocate`).
    pub policy: MinMedian,
    /// Building the placement requests and [`DecisionInputs::place`].
    pub placement: MinMedian,
    /// The whole decision, [`DecisionInputs::decide`] (`converge_sched::decide::decide`),
    /// timed on its own.
    pub total: MinMedian,
    /// What the last decision did.
    pub outcome: DecisionOutcome,
}

/// Times `repeat` whole decisions (policy, then placement) on `inputs`, one after the other
/// on the calling thread.
pub fn time_decisions(inputs: &DecisionInputs, repeat: usize) -> DecisionTimes {
    let mut timings = Vec::with_capacity(repeat);
    let mut outcome = DecisionOutcome::default();
    for _ in 0..repeat {
        let start = Instant::now();
        let decision = std::hint::black_box(inputs.allocate());
        let decided = Instant::now();
        let placed = std::hint::black_box(inputs.place(&inputs.requests(&decision)));
        let end = Instant::now();
        drop((decision, placed));
        let whole = Instant::now();
        let allocation = std::hint::black_box(inputs.decide());
        let done = Instant::now();
        timings.push(Timing {
            policy: decided - start,
            placement: end - decided,
            total: done - whole,
        });
        outcome = describe_outcome(inputs, &allocation.workers, &allocation.placements);
    }
    let column = |part: fn(&Timing) -> Duration| MinMedian::of(timings.iter().map(part).collect());
    DecisionTimes {
        repeat,
        policy: column(|t| t.policy),
        placement: column(|t| t.placement),
        total: column(|t| t.total),
        outcome,
    }
}

/// Median and 95th percentile (nearest rank, [`crate::summary::quantiles`]) of one way of
/// deciding over the repeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MedianP95 {
    pub median: Duration,
    pub p95: Duration,
}

/// [`DecisionInputs::decide`] on the same jobs with each [`BenchBatches`] mode, the modes
/// interleaved within every repeat (so that a slower stretch of the machine hits all of
/// them), one after the other on the calling thread.
pub fn time_batch_modes(inputs: &DecisionInputs, repeat: usize) -> Vec<(BenchBatches, MedianP95)> {
    let variants: Vec<(BenchBatches, DecisionInputs)> = BenchBatches::ALL
        .iter()
        .map(|&mode| (mode, inputs.with_batches(mode, 1)))
        .collect();
    let mut times: Vec<Vec<Duration>> = vec![Vec::with_capacity(repeat); variants.len()];
    for _ in 0..repeat.max(1) {
        for (slot, (_, v)) in times.iter_mut().zip(&variants) {
            let start = Instant::now();
            let allocation = std::hint::black_box(v.decide());
            slot.push(start.elapsed());
            drop(allocation);
        }
    }
    variants
        .iter()
        .zip(times)
        .map(|((mode, _), t)| {
            let seconds: Vec<f64> = t.iter().map(Duration::as_secs_f64).collect();
            let q = crate::summary::quantiles(&seconds).unwrap_or_default();
            (
                *mode,
                MedianP95 {
                    median: Duration::from_secs_f64(q.p50),
                    p95: Duration::from_secs_f64(q.p95),
                },
            )
        })
        .collect()
}

/// Runs `converge-sim bench-decision`: generates the inputs, times `repeat` decisions
/// on the calling thread and prints the minimum and median of each part.
pub fn run_bench_decision(args: &BenchDecisionArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.repeat > 0, "--repeat must be at least 1");
    anyhow::ensure!(
        args.gpu_types <= args.nodes,
        "--gpu-types ({}) must not exceed --nodes ({})",
        args.gpu_types,
        args.nodes
    );
    anyhow::ensure!(
        args.nodes > 0 && args.gpus_per_node > 0,
        "the cluster needs at least one GPU"
    );
    anyhow::ensure!(
        args.nodes.checked_mul(args.gpus_per_node).is_some(),
        "--nodes × --gpus-per-node must fit in 32 bits"
    );
    let cfg = BenchConfig {
        jobs: args.jobs,
        nodes: args.nodes,
        gpus_per_node: args.gpus_per_node,
        gpu_types: args.gpu_types,
        seed: args.seed,
    };
    let started = Instant::now();
    let inputs = DecisionInputs::generate(&cfg);
    println!(
        "inputs: {} jobs ({} running on {} GPUs), {} nodes × {} GPUs = {} GPUs of {} type(s), \
         seed {} (generated in {:.2} s)",
        inputs.jobs.len(),
        inputs.running(),
        inputs.gpus_in_use(),
        cfg.nodes,
        cfg.gpus_per_node,
        inputs.total_gpus,
        cfg.gpu_types.max(1),
        cfg.seed,
        started.elapsed().as_secs_f64(),
    );

    let times = time_decisions(&inputs, args.repeat);
    let o = times.outcome;
    println!(
        "decision: {} jobs admitted, {} GPUs allocated, {} placed, {} jobs placed anew",
        o.admitted, o.allocated_gpus, o.placed_gpus, o.placed_anew
    );
    println!(
        "one decision, single-threaded, {} repeats (placement includes building the requests):",
        args.repeat
    );
    for (name, part) in [
        ("policy (quality_allocate)", times.policy),
        ("placement (place)", times.placement),
        ("total (decide)", times.total),
    ] {
        println!(
            "  {name:<26} min {:>9.2} ms   median {:>9.2} ms",
            millis(part.min),
            millis(part.median),
        );
    }
    println!(
        "the whole decision (decide) side by side, same jobs, {} repeats interleaved:",
        args.repeat
    );
    for (mode, t) in time_batch_modes(&inputs, args.repeat) {
        println!(
            "  {:<38} median {:>9.2} ms   p95 {:>9.2} ms",
            mode.as_str(),
            millis(t.median),
            millis(t.p95)
        );
    }
    Ok(())
}

/// What a decision did, as a sanity check of the inputs.
fn describe_outcome(
    inputs: &DecisionInputs,
    workers: &BTreeMap<JobId, u32>,
    placed: &BTreeMap<JobId, Vec<RankPlacement>>,
) -> DecisionOutcome {
    let allocated_gpus: u64 = inputs
        .jobs
        .iter()
        .map(|j| u64::from(workers[&j.id]) * u64::from(j.gpus_per_worker))
        .sum();
    let placed_gpus: usize = placed
        .values()
        .flat_map(|ranks| ranks.iter().map(|r| r.gpus.len()))
        .sum();
    let admitted = workers.values().filter(|&&w| w > 0).count();
    let placed_anew = inputs
        .jobs
        .iter()
        .zip(&inputs.current)
        .filter(|(j, current)| placed.get(&j.id).is_some_and(|p| p != *current))
        .count();
    DecisionOutcome {
        admitted,
        allocated_gpus,
        placed_gpus,
        placed_anew,
    }
}

/// Milliseconds in `d`.
pub fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The median of sorted durations (the mean of the middle two for an even count).
fn median(sorted: &[Duration]) -> Duration {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_decisions_report_ordered_times_and_the_outcome() {
        // A small cluster: 300 jobs on 300 hosts of 8 GPUs.
        let inputs = DecisionInputs::generate(&BenchConfig {
            jobs: 300,
            nodes: 300,
            ..BenchConfig::default()
        });
        let times = time_decisions(&inputs, 3);
        assert_eq!(times.repeat, 3);
        for part in [times.policy, times.placement, times.total] {
            assert!(part.min <= part.median);
        }
        let allocation = inputs.decide();
        assert_eq!(
            times.outcome,
            describe_outcome(&inputs, &allocation.workers, &allocation.placements),
            "the decision is deterministic"
        );
        assert!(times.outcome.admitted > 0 && times.outcome.placed_gpus > 0);
    }
}

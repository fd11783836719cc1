//! `converge-sim` binary: the trace-driven simulator (`simulate`, `workload`, `report`) and
//! the research benches (`bench-decision`, `predict-bench`, `makespan-bench`, `ps-bench`).

use clap::{Parser, Subcommand};
use converge_sim::cli::{SimulateArgs, WorkloadArgs, run_simulate, run_workload};
use converge_sim::decision_bench::{BenchDecisionArgs, run_bench_decision};
use converge_sim::explore_report::{
    ExploreArgs, ExploreReportArgs, ExploreWorkloadArgs, run_explore, run_explore_report,
    run_explore_workload,
};
use converge_sim::makespan_bench::{MakespanBenchArgs, run_makespan_bench};
use converge_sim::predict_bench::{PredictBenchArgs, run_predict_bench};
use converge_sim::ps_bench::{PsBenchArgs, run_ps_bench};
use converge_sim::queues_bench::{QueuesArgs, run_queues};
use converge_sim::report::{ReportArgs, run_report};

/// Converge simulator: replays workloads through the allocator's own decision
/// (`converge-sched`) on a simulated GPU cluster with the measured Pollux traces, and runs the
/// research benches. Deterministic for a seed.
#[derive(Debug, Parser)]
#[command(name = "converge-sim", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Simulate a workload (Pollux format) on a simulated cluster with one policy, using the
    /// measured Pollux traces; writes OUT/summary.json.
    Simulate(SimulateArgs),
    /// Sample a new workload from the Philly trace, the way the Pollux workloads were made.
    Workload(WorkloadArgs),
    /// Write docs/benchmarks.md and its plots: the simulator comparison on the Pollux
    /// workloads, the loss-prediction benchmark and the scale benchmark.
    ///
    /// Runs every policy over the eight 1.0× and eight 0.5× Pollux workloads (fifo, fair,
    /// tiresias, optimus, and the quality policy once per objective: quality with the
    /// default, quality-loss, quality-both) next to the published Pollux, Tiresias and Optimus
    /// numbers, with SLAQ's metrics against fair and the targets; the loss-prediction
    /// benchmark's headline tables (predict-bench writes the detailed docs/prediction.md);
    /// and the scale benchmark (one decision for 10,000 jobs, as bench-decision), run on one
    /// thread before the simulations.
    Report(ReportArgs),
    /// A workload split among teams' queues (quotas, borrowing limits, weights; one team may
    /// flood the cluster, one high-priority job may arrive on a full cluster): writes
    /// OUT/queues.md (each team's share over time against its quota, lending, the
    /// high-priority job's start and the jobs it preempted) and OUT/queue-shares.svg.
    Queues(QueuesArgs),
    /// Sample an exploratory workload: sweeps of short trials (one per recorded run of a
    /// model × dataset pair in data/curves/sweep, or with --pollux-curves also of a Pollux
    /// application's validation runs) arriving as a Poisson process, sized by Philly trace
    /// jobs scaled from hours to minutes.
    ExploreWorkload(ExploreWorkloadArgs),
    /// Simulate an exploratory workload under one or more policies; every trial ends by its
    /// stop criteria (plateau rule) or at the end of its recorded curve. Prints SLAQ's
    /// measures (average normalized loss, time to 80/90/95 % loss reduction).
    Explore(ExploreArgs),
    /// Write docs/exploratory.md: SLAQ's measures and sweep GPU-hours per policy over
    /// several generated exploratory workloads, against fair share and against running
    /// every trial to its end (--pollux-curves: the same over the wider set of sweeps,
    /// written to docs/exploratory-pollux.md).
    ExploreReport(ExploreReportArgs),
    /// Production jobs and sweeps on one cluster: each Pollux workload alone and with a
    /// stream of sweeps, through the allocator's own scheduling step; prints the production
    /// jobs' mean JCT both ways and the sweeps' SLAQ measures and GPU-hours, per policy.
    MixedWorkload(converge_sim::mixed_workload::MixedWorkloadArgs),
    /// Time one allocation decision (quality policy, then placement) on a generated cluster,
    /// single-threaded: by default 10,000 active jobs (about 70 % running) on 12,500 nodes ×
    /// 8 GPUs. Prints the minimum and median over the repeats of the policy, the placement
    /// and the total. Build with `--release` for meaningful figures.
    BenchDecision(BenchDecisionArgs),
    /// Compare four loss-curve predictors (SLAQ's strawman, SLAQ's fit, Optimus's fit and
    /// ours) on the Pollux validation curves and the recorded converge-trainer curves; writes
    /// docs/prediction.md.
    PredictBench(PredictBenchArgs),
    /// Offline makespan scheduling: SJF-BCO and first-fit FIFO against the exact optimum on
    /// seeded random small instances, and against each other on larger ones; prints Markdown
    /// tables (and writes them with --out). Build with `--release`.
    MakespanBench(MakespanBenchArgs),
    /// Parameter-server jobs: the LP-relaxation + randomized-rounding planner (workers,
    /// shards, placement) against its LP bound, the exhaustive optimum and greedy on seeded
    /// random small instances; prints Markdown tables (and writes them with --out). Build with
    /// `--release`.
    PsBench(PsBenchArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Simulate(args) => run_simulate(&args),
        Command::Workload(args) => run_workload(&args),
        Command::Report(args) => run_report(&args),
        Command::Queues(args) => run_queues(&args),
        Command::PredictBench(args) => run_predict_bench(&args),
        Command::ExploreWorkload(args) => run_explore_workload(&args),
        Command::Explore(args) => run_explore(&args),
        Command::ExploreReport(args) => run_explore_report(&args),
        Command::MixedWorkload(args) => converge_sim::mixed_workload::run_mixed_workload(&args),
        Command::BenchDecision(args) => run_bench_decision(&args),
        Command::MakespanBench(args) => run_makespan_bench(&args),
        Command::PsBench(args) => run_ps_bench(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("converge-sim: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

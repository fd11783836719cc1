//! `converge-allocator` binary: runs the allocator service (default), the simulator's
//! commands (`simulate`, `workload`, `report`), `bench-decision` (the time of one
//! allocation decision at scale), `predict-bench` (the loss-prediction benchmark),
//! `makespan-bench` (SJF-BCO against first-fit FIFO and the exact optimum), or `ps-bench`
//! (the parameter-server planner against its LP bound).

use clap::{Parser, Subcommand};
use converge_allocator::benchgen::{BenchDecisionArgs, run_bench_decision};
use converge_allocator::makespan::bench::{MakespanBenchArgs, run_makespan_bench};
use converge_allocator::predict::bench::{PredictBenchArgs, run_predict_bench};
use converge_allocator::ps_plan::bench::{PsBenchArgs, run_ps_bench};
use converge_allocator::service::{AllocatorConfig, run};
use converge_allocator::sim::cli::{SimulateArgs, WorkloadArgs, run_simulate, run_workload};
use converge_allocator::sim::report::{ReportArgs, run_report};
use tokio_util::sync::CancellationToken;

/// Converge allocator: decides how many GPUs each training job gets and where, from the
/// jobs' loss curves (SLAQ quality policy), and writes host plans that the agents carry out.
/// Keeps no local state: everything is rebuilt from NATS on start. Without a subcommand it
/// runs the service.
#[derive(Debug, Parser)]
#[command(
    name = "converge-allocator",
    version,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    config: AllocatorConfig,
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
    /// default, quality-loss, quality-jct) next to the published Pollux, Tiresias and Optimus
    /// numbers, with SLAQ's metrics against fair and the targets; the loss-prediction
    /// benchmark's headline tables (predict-bench writes the detailed docs/prediction.md);
    /// and the scale benchmark (one decision for 10,000 jobs, as bench-decision), run on one
    /// thread before the simulations.
    Report(ReportArgs),
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
    converge_bus::init_tracing("info");
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Simulate(args)) => run_simulate(&args),
        Some(Command::Workload(args)) => run_workload(&args),
        Some(Command::Report(args)) => run_report(&args),
        Some(Command::PredictBench(args)) => run_predict_bench(&args),
        Some(Command::BenchDecision(args)) => run_bench_decision(&args),
        Some(Command::MakespanBench(args)) => run_makespan_bench(&args),
        Some(Command::PsBench(args)) => run_ps_bench(&args),
        None => serve(cli.config),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("converge-allocator: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

fn serve(config: AllocatorConfig) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        tokio::spawn(async move {
            converge_bus::shutdown_signal().await;
            token.cancel();
        });
        run(config, shutdown).await
    })
}

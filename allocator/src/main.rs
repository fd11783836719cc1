//! `converge-allocator` binary: runs the allocator service. The simulator and the research
//! benches moved to `converge-sim`; their old subcommands here answer with a clear error that
//! names the new command (kept for one release).

use clap::Parser;
use converge_allocator::service::{AllocatorConfig, run};
use tokio_util::sync::CancellationToken;

/// Converge allocator: decides how many GPUs each training job gets and where, from the
/// jobs' loss curves (SLAQ quality policy), and writes host plans that the agents carry out.
/// Keeps no local state: everything is rebuilt from NATS on start.
///
/// The simulator and the benches are `converge-sim` (simulate, workload, report,
/// bench-decision, predict-bench, makespan-bench, ps-bench).
#[derive(Debug, Parser)]
#[command(name = "converge-allocator", version)]
struct Cli {
    #[command(flatten)]
    config: AllocatorConfig,
}

/// Subcommands that moved to `converge-sim`.
const MOVED: [&str; 7] = [
    "simulate",
    "workload",
    "report",
    "bench-decision",
    "predict-bench",
    "makespan-bench",
    "ps-bench",
];

fn main() -> std::process::ExitCode {
    if let Some(first) = std::env::args().nth(1)
        && MOVED.contains(&first.as_str())
    {
        eprintln!(
            "converge-allocator: `converge-allocator {first}` moved to `converge-sim {first}` \
             (same arguments); converge-allocator now only runs the service"
        );
        return std::process::ExitCode::from(2);
    }
    if std::env::var_os("CONVERGE_EPOCH").is_some() {
        eprintln!(
            "converge-allocator: CONVERGE_EPOCH was renamed CONVERGE_SCHEDULING_INTERVAL (same \
             value, e.g. 10s); set that instead and unset CONVERGE_EPOCH"
        );
        return std::process::ExitCode::from(2);
    }
    converge_bus::init_tracing("info");
    let cli = Cli::parse();
    match serve(cli.config) {
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

//! `converge-allocator` binary: parse configuration, run the service until SIGINT/SIGTERM.

use clap::Parser;
use converge_allocator::service::{AllocatorConfig, run};
use tokio_util::sync::CancellationToken;

/// Converge allocator: decides how many GPUs each training job gets and where, from the
/// jobs' loss curves (SLAQ quality policy), and writes host plans that the agents carry out.
/// Keeps no local state: everything is rebuilt from NATS on start.
#[derive(Debug, Parser)]
#[command(name = "converge-allocator", version)]
struct Cli {
    #[command(flatten)]
    config: AllocatorConfig,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    converge_bus::init_tracing("info");
    let cli = Cli::parse();
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    tokio::spawn(async move {
        converge_bus::shutdown_signal().await;
        token.cancel();
    });
    match run(cli.config, shutdown).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("converge-allocator: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

//! `converge-agent` binary: parse configuration, run the agent until SIGINT/SIGTERM, then
//! stop the workers gracefully. A second signal exits at once.

use clap::Parser;
use converge_agent::{AgentConfig, run};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    converge_bus::init_tracing("info");
    let cfg = AgentConfig::parse();
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    tokio::spawn(async move {
        converge_bus::shutdown_signal().await;
        tracing::info!("signal received: stopping workers (signal again to exit at once)");
        token.cancel();
        converge_bus::shutdown_signal().await;
        std::process::exit(130);
    });
    match run(cfg, shutdown).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("converge-agent: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

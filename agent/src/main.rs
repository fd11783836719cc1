//! `converge-agent` binary: parse configuration, run the agent until SIGINT/SIGTERM, then
//! stop the workers gracefully. A second signal exits at once.

use clap::Parser;
use converge_agent::{AgentConfig, run};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let cfg = AgentConfig::parse();
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("signal received: stopping workers (signal again to exit at once)");
        token.cancel();
        wait_for_signal().await;
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

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

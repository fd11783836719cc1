//! `converge-agent` binary: parse configuration, run the agent until SIGINT/SIGTERM, then
//! stop the workers gracefully. A second signal exits at once.
//!
//! `converge-agent worker-shim …` is the hidden mode the agent starts its workers through
//! (`converge_agent::shim`); it runs before, and without, the async runtime.

use clap::Parser;
use converge_agent::{AgentConfig, run, shim};
use tokio_util::sync::CancellationToken;

fn main() -> std::process::ExitCode {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == shim::SUBCOMMAND)
    {
        return shim::main(std::env::args_os().skip(2).collect());
    }
    converge_bus::init_tracing("info");
    let mut cfg = AgentConfig::parse();
    // Workers start through this very binary, even once it was replaced on disk.
    cfg.worker_shim
        .get_or_insert_with(|| std::path::PathBuf::from("/proc/self/exe"));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("converge-agent: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    runtime.block_on(async {
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
    })
}

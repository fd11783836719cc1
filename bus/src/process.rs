//! What every binary's process shares: logging setup (binaries and tests), the shutdown
//! signal, and the wall-clock time as UNIX seconds.

/// Logs to stderr, filtered by `RUST_LOG` (default `default_filter`, e.g. `info`).
pub fn init_tracing(default_filter: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Logging for tests (every test binary that logs calls this, directly or through
/// `converge_tests::init_tracing`), filtered by `RUST_LOG` (default `warn`). Lines go to
/// libtest's output capture, not to stderr: a passing test prints none of the warnings it
/// provokes on purpose (servers killed, buckets not ready yet), a failing test shows its own
/// lines under its `---- stdout ----` heading. The capture follows the test into every thread
/// its thread starts, so the tokio runtime's workers and blocking threads of a
/// `#[tokio::test(flavor = "multi_thread")]` are captured too, each test's apart from the
/// others'. `cargo test -- --nocapture` prints them live instead. Calls after the first do
/// nothing.
pub fn init_test_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Resolves on the next SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Current time as UNIX seconds.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

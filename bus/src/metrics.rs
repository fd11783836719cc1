//! Prometheus metrics of a Converge process, served over HTTP at `GET /metrics`.
//!
//! The `metrics` facade records; `metrics-exporter-prometheus` (default features off, so no
//! second TLS provider beside async-nats' ring; see the dependency notes) renders the text
//! format; `axum` serves it; `metrics-process` adds the process's own figures
//! (`process_resident_memory_bytes`, `process_cpu_seconds_total`, open file descriptors…),
//! refreshed on every scrape. Metric names follow Prometheus' conventions: base units
//! (seconds, bytes), `_total` for counters.

use std::net::SocketAddr;
use std::sync::OnceLock;

use axum::{Router, extract::State, routing::get};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

/// Bucket bounds (seconds) of every histogram whose name ends in `_seconds`: 100 µs to 60 s.
pub const SECONDS_BUCKETS: [f64; 19] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0,
    3.0, 5.0, 10.0, 15.0, 60.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder on first use and returns its handle (the same handle
/// afterwards: several services in one process, as in the tests, share one registry).
///
/// # Panics
/// If another `metrics` recorder was installed first by code outside this module.
pub fn recorder() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
                .expect("bucket list is not empty")
                .install_recorder()
                .expect("no other metrics recorder is installed")
        })
        .clone()
}

/// The text exposition of every metric recorded so far, process metrics refreshed first.
pub fn render() -> String {
    static PROCESS: OnceLock<metrics_process::Collector> = OnceLock::new();
    let handle = recorder();
    let process = PROCESS.get_or_init(|| {
        let c = metrics_process::Collector::default();
        c.describe();
        c
    });
    process.collect();
    handle.render()
}

async fn metrics_page(State(()): State<()>) -> String {
    render()
}

/// Binds `addr` and serves `GET /metrics` until `shutdown` is cancelled. Returns the bound
/// address (useful with port 0) once listening; serving goes on in a spawned task.
///
/// # Errors
/// The bind error (address in use, permission denied) with the address in its message.
pub async fn serve(addr: SocketAddr, shutdown: CancellationToken) -> std::io::Result<SocketAddr> {
    recorder();
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot serve metrics on {addr}: {e}"))
    })?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics_page))
        .with_state(());
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::warn!("metrics endpoint stopped: {e}");
        }
    });
    tracing::info!(%bound, "serving Prometheus metrics at /metrics");
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn serves_recorded_metrics_and_process_memory() {
        let shutdown = CancellationToken::new();
        let addr = serve("127.0.0.1:0".parse().unwrap(), shutdown.clone())
            .await
            .unwrap();
        metrics::counter!("converge_test_things_total").increment(3);
        metrics::histogram!("converge_test_wait_seconds").record(0.02);
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut page = String::new();
        stream.read_to_string(&mut page).await.unwrap();
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        assert!(page.contains("converge_test_things_total 3"), "{page}");
        assert!(
            page.contains("converge_test_wait_seconds_bucket{le=\"0.025\"} 1"),
            "{page}"
        );
        let rss = page
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .expect("process memory is exported");
        assert!(rss.trim().parse::<f64>().unwrap() > 1e6, "{rss}");
        shutdown.cancel();
    }
}

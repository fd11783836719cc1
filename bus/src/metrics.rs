//! Prometheus metrics of a Converge process, served over HTTP at `GET /metrics`.
//!
//! The `metrics` facade records; `metrics-exporter-prometheus` (default features off, so no
//! second TLS provider beside async-nats' ring; see the dependency notes) renders the text
//! format; `axum` routes and `hyper` serves it, with limits (see [`ServeLimits`]);
//! `metrics-process` adds the process's own figures (`process_resident_memory_bytes`,
//! `process_cpu_seconds_total`, open file descriptors…), refreshed on every scrape. Metric
//! names follow Prometheus' conventions: base units (seconds, bytes), `_total` for counters,
//! except the families that copy another exporter's names and units (the agent's DCGM
//! families).
//!
//! Series whose label sets come and go (one per job, per GPU, per NIC) are not recorded
//! through the facade, which never forgets a series: a service publishes them as a
//! [`Snapshot`] of [`Family`]s, replaced as a whole on every update, so a job or an
//! interface that is gone, or a reading that is missing, has no series on the next scrape.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::{Router, extract::State, routing::get};
use metrics_exporter_prometheus::formatting::{sanitize_description, sanitize_label_value};
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

/// Prometheus metric type of a [`Family`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
}

/// A sample's labels: names in order, values unescaped.
pub type Labels = Vec<(&'static str, String)>;

/// One metric family of a [`Snapshot`]: name, help, type and its samples.
#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    /// Label sets (names in order, values unescaped) and values.
    pub samples: Vec<(Labels, f64)>,
}

impl Family {
    pub fn gauge(name: &'static str, help: &'static str) -> Self {
        Self {
            name,
            help,
            kind: Kind::Gauge,
            samples: Vec::new(),
        }
    }

    pub fn counter(name: &'static str, help: &'static str) -> Self {
        Self {
            kind: Kind::Counter,
            ..Self::gauge(name, help)
        }
    }

    /// Adds one sample.
    pub fn push(&mut self, labels: Labels, value: f64) {
        self.samples.push((labels, value));
    }

    /// Adds one sample when there is a value: a missing reading has no series, never 0.
    pub fn push_some(&mut self, labels: Labels, value: Option<f64>) {
        if let Some(v) = value {
            self.push(labels, v);
        }
    }
}

/// The families one owner (an agent, an allocator replica) currently exports.
pub type Snapshot = Vec<Family>;

fn snapshots() -> &'static Mutex<BTreeMap<String, Snapshot>> {
    static SNAPSHOTS: OnceLock<Mutex<BTreeMap<String, Snapshot>>> = OnceLock::new();
    SNAPSHOTS.get_or_init(Default::default)
}

/// Replaces everything `owner` exports (its series missing from `families` are gone from
/// the next scrape).
pub fn set_snapshot(owner: &str, families: Snapshot) {
    let mut all = snapshots().lock().unwrap_or_else(|e| e.into_inner());
    all.insert(owner.to_string(), families);
}

/// Removes everything `owner` exports.
pub fn remove_snapshot(owner: &str) {
    let mut all = snapshots().lock().unwrap_or_else(|e| e.into_inner());
    all.remove(owner);
}

/// Removes an owner's snapshot when dropped (a service that stops takes its series along).
#[derive(Debug)]
pub struct SnapshotGuard(pub String);

impl Drop for SnapshotGuard {
    fn drop(&mut self) {
        remove_snapshot(&self.0);
    }
}

fn write_value(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "+Inf" } else { "-Inf" });
    } else {
        let _ = write!(out, "{v}");
    }
}

/// The text exposition of snapshots: families of the same name merged (several owners in
/// one process, as in the tests), the first sample of a repeated label set kept, families
/// without samples left out.
pub fn render_snapshots<'a>(owners: impl IntoIterator<Item = &'a Snapshot>) -> String {
    type Merged<'f> = (&'f Family, Vec<&'f (Labels, f64)>);
    let mut merged: BTreeMap<&'static str, Merged<'a>> = BTreeMap::new();
    for snapshot in owners {
        for family in snapshot {
            let entry = merged.entry(family.name).or_insert((family, Vec::new()));
            for sample in &family.samples {
                if !entry.1.iter().any(|s| s.0 == sample.0) {
                    entry.1.push(sample);
                }
            }
        }
    }
    let mut out = String::new();
    for (name, (family, samples)) in merged {
        if samples.is_empty() {
            continue;
        }
        let kind = match family.kind {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        };
        let _ = writeln!(out, "# HELP {name} {}", sanitize_description(family.help));
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            out.push_str(name);
            if !labels.is_empty() {
                out.push('{');
                for (i, (k, v)) in labels.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    let _ = write!(out, "{k}=\"{}\"", sanitize_label_value(v));
                }
                out.push('}');
            }
            out.push(' ');
            write_value(&mut out, *value);
            out.push('\n');
        }
    }
    out
}

/// The text exposition of every metric recorded so far, process metrics refreshed first,
/// then every owner's current snapshot.
pub fn render() -> String {
    static PROCESS: OnceLock<metrics_process::Collector> = OnceLock::new();
    let handle = recorder();
    let process = PROCESS.get_or_init(|| {
        let c = metrics_process::Collector::default();
        c.describe();
        c
    });
    process.collect();
    let mut page = handle.render();
    let all = snapshots().lock().unwrap_or_else(|e| e.into_inner());
    if !page.is_empty() && !page.ends_with('\n') {
        page.push('\n');
    }
    page.push_str(&render_snapshots(all.values()));
    page
}

async fn metrics_page(State(()): State<()>) -> String {
    render()
}

/// Bounds on what one client can hold of the metrics endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Connections served at once; one more is closed at once (a flood of idle clients
    /// delays scrapes by at most `header_read_timeout`).
    pub max_connections: usize,
    /// A client must have sent a whole request head within this time, else its connection
    /// is closed (a client that connects and sends nothing holds a slot this long).
    pub header_read_timeout: Duration,
    /// Largest request head (hyper's read buffer; at least 8192): a larger one is answered
    /// with 431 and the connection closed.
    pub max_header_bytes: usize,
    /// Longest life of one connection (keep-alive included); it then finishes its request
    /// in flight and is closed.
    pub max_connection_age: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            header_read_timeout: Duration::from_secs(5),
            max_header_bytes: 16 * 1024,
            max_connection_age: Duration::from_secs(60),
        }
    }
}

/// Binds `addr` and serves `GET /metrics` until `shutdown` is cancelled, with the default
/// [`ServeLimits`]. Returns the bound address (useful with port 0) once listening; serving
/// goes on in a spawned task.
///
/// # Errors
/// The bind error (address in use, permission denied) with the address in its message.
pub async fn serve(addr: SocketAddr, shutdown: CancellationToken) -> std::io::Result<SocketAddr> {
    serve_with(addr, ServeLimits::default(), shutdown).await
}

/// [`serve`] with other limits. Read-only: `GET` (and `HEAD`) `/metrics` only; other
/// methods get 405, other paths 404.
///
/// # Errors
/// The bind error (address in use, permission denied) with the address in its message.
pub async fn serve_with(
    addr: SocketAddr,
    limits: ServeLimits,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    recorder();
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot serve metrics on {addr}: {e}"))
    })?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics_page))
        .with_state(());
    serve_router(listener, app, limits, shutdown);
    tracing::info!(%bound, "serving Prometheus metrics at /metrics");
    Ok(bound)
}

/// Serves `app` on `listener` in a spawned task until `shutdown` is cancelled, within
/// `limits` (HTTP/1.1 through hyper: connections, request-head time and size, connection
/// age). The metrics endpoint and `converge dashboard` both serve through it.
pub fn serve_router(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ServeLimits,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                _ = shutdown.cancelled() => break,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: let it pass, don't spin.
                        tracing::warn!("HTTP endpoint cannot accept: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                tracing::debug!(%peer, "HTTP endpoint busy: connection closed");
                continue;
            };
            let service = hyper_util::service::TowerToHyperService::new(app.clone());
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                let _slot = slot;
                let mut builder = hyper::server::conn::http1::Builder::new();
                builder
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(limits.header_read_timeout)
                    .max_buf_size(limits.max_header_bytes.max(8192));
                let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                let mut conn = std::pin::pin!(conn);
                tokio::select! {
                    served = conn.as_mut() => {
                        if let Err(e) = served {
                            tracing::debug!(%peer, "HTTP connection: {e}");
                        }
                        return;
                    }
                    _ = tokio::time::sleep(limits.max_connection_age) => {}
                    _ = shutdown.cancelled() => {}
                }
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(limits.header_read_timeout, conn).await;
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Sends `raw` on a new connection and reads until the server closes it (at most 10 s).
    async fn exchange(addr: SocketAddr, raw: &[u8]) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        // A refused request may be answered (and closed) before it is all written.
        let _ = stream.write_all(raw).await;
        let mut page = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut page)).await;
        String::from_utf8_lossy(&page).into_owned()
    }

    fn get(path: &str) -> Vec<u8> {
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").into_bytes()
    }

    #[tokio::test]
    async fn serves_recorded_metrics_and_process_memory() {
        let shutdown = CancellationToken::new();
        let addr = serve("127.0.0.1:0".parse().unwrap(), shutdown.clone())
            .await
            .unwrap();
        metrics::counter!("converge_test_things_total").increment(3);
        metrics::histogram!("converge_test_wait_seconds").record(0.02);
        let page = exchange(addr, &get("/metrics")).await;
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

    #[tokio::test]
    async fn read_only_unknown_paths_404_other_methods_405() {
        let shutdown = CancellationToken::new();
        let addr = serve("127.0.0.1:0".parse().unwrap(), shutdown.clone())
            .await
            .unwrap();
        let page = exchange(addr, &get("/nothing-here")).await;
        assert!(page.starts_with("HTTP/1.1 404"), "{page}");
        for method in ["POST", "PUT", "DELETE", "PATCH"] {
            let raw = format!(
                "{method} /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
            );
            let page = exchange(addr, raw.as_bytes()).await;
            assert!(page.starts_with("HTTP/1.1 405"), "{method}: {page}");
        }
        let page = exchange(
            addr,
            b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        assert!(!page.contains("# TYPE"), "HEAD has no body: {page}");
        shutdown.cancel();
    }

    #[tokio::test]
    async fn huge_header_is_refused_and_the_endpoint_keeps_serving() {
        let shutdown = CancellationToken::new();
        let addr = serve("127.0.0.1:0".parse().unwrap(), shutdown.clone())
            .await
            .unwrap();
        let mut raw = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
        raw.extend(std::iter::repeat_n(b'a', 1 << 20));
        raw.extend_from_slice(b"\r\n\r\n");
        let page = exchange(addr, &raw).await;
        // hyper answers 431 once the head outgrows its 16 KiB buffer (observed here) and
        // closes; a client still writing may see a reset instead of the answer.
        assert!(
            page.is_empty() || page.starts_with("HTTP/1.1 431"),
            "{page}"
        );
        assert!(!page.contains("# TYPE"), "{page}");
        let page = exchange(addr, &get("/metrics")).await;
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        shutdown.cancel();
    }

    #[tokio::test]
    async fn silent_client_blocks_no_scrape_and_is_dropped_after_the_header_timeout() {
        let shutdown = CancellationToken::new();
        let limits = ServeLimits {
            header_read_timeout: Duration::from_millis(700),
            ..ServeLimits::default()
        };
        let addr = serve_with("127.0.0.1:0".parse().unwrap(), limits, shutdown.clone())
            .await
            .unwrap();
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        let started = Instant::now();
        let page = exchange(addr, &get("/metrics")).await;
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        // The server closes the silent connection once the header timeout has passed.
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf))
            .await
            .expect("the server closes a silent connection");
        assert!(matches!(read, Ok(0) | Err(_)) || buf.starts_with(b"HTTP/1.1 408"));
        assert!(
            started.elapsed() >= Duration::from_millis(600),
            "{:?}",
            started.elapsed()
        );
        shutdown.cancel();
    }

    #[tokio::test]
    async fn connections_beyond_the_limit_are_closed_at_once() {
        let shutdown = CancellationToken::new();
        let limits = ServeLimits {
            max_connections: 2,
            header_read_timeout: Duration::from_secs(3),
            ..ServeLimits::default()
        };
        let addr = serve_with("127.0.0.1:0".parse().unwrap(), limits, shutdown.clone())
            .await
            .unwrap();
        let _a = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _b = tokio::net::TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        let page = exchange(addr, &get("/metrics")).await;
        assert!(page.is_empty(), "third connection served: {page}");
        assert!(started.elapsed() < Duration::from_secs(1));
        drop((_a, _b));
        let page = exchange(addr, &get("/metrics")).await;
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        shutdown.cancel();
    }

    #[test]
    fn snapshots_merge_by_family_and_drop_what_is_gone() {
        let mut util = Family::gauge("converge_test_util", "Utilization \"now\"");
        util.push(vec![("gpu", "0".into()), ("UUID", "GPU-a\"b".into())], 93.0);
        util.push_some(vec![("gpu", "1".into())], None);
        let mut other = Family::gauge("converge_test_util", "ignored: the first help wins");
        other.push(vec![("gpu", "0".into()), ("UUID", "GPU-a\"b".into())], 1.0);
        other.push(vec![("gpu", "2".into())], f64::NAN);
        let empty = Family::counter("converge_test_nothing_total", "never shown");
        let text = render_snapshots([&vec![util, empty], &vec![other]]);
        assert_eq!(
            text,
            "# HELP converge_test_util Utilization \"now\"\n\
             # TYPE converge_test_util gauge\n\
             converge_test_util{gpu=\"0\",UUID=\"GPU-a\\\"b\"} 93\n\
             converge_test_util{gpu=\"2\"} NaN\n"
        );

        let mut jobs = Family::gauge("converge_test_job_loss", "loss");
        jobs.push(vec![("job", "a".into())], 0.5);
        set_snapshot("test/owner", vec![jobs]);
        assert!(render().contains("converge_test_job_loss{job=\"a\"} 0.5"));
        {
            let _guard = SnapshotGuard("test/owner".into());
            set_snapshot(
                "test/owner",
                vec![Family::gauge("converge_test_job_loss", "loss")],
            );
            assert!(!render().contains("converge_test_job_loss"));
        }
        let mut again = Family::gauge("converge_test_job_loss", "loss");
        again.push(vec![("job", "b".into())], 0.25);
        set_snapshot("test/owner", vec![again]);
        let _guard = SnapshotGuard("test/owner".into());
        assert!(render().contains("converge_test_job_loss{job=\"b\"} 0.25"));
        drop(_guard);
        assert!(!render().contains("converge_test_job_loss"));
    }
}

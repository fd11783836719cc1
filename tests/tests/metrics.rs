//! Prometheus endpoints scraped over HTTP: a real agent (fake GPUs) must export the DCGM and
//! node_exporter names with their labels and sane values (the GPUs a worker holds labelled
//! with its `job_id` and `rank`, idle ones without), the allocator its per-job series (gone
//! once the job has finished, and a counted write conflict or foreign write when another
//! writer changed a status), and the endpoint must stay read-only and bounded.

use converge_common::{JobPhase, JobSpec};
use converge_tests::*;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A free loopback port (bound, then released for the service to bind).
fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Sends `raw` and reads the answer until the server closes (at most 10 s).
async fn exchange(addr: SocketAddr, raw: &[u8]) -> String {
    try_exchange(addr, raw).await.expect("the endpoint accepts")
}

/// [`exchange`], `None` while the endpoint does not accept connections yet.
async fn try_exchange(addr: SocketAddr, raw: &[u8]) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let _ = stream.write_all(raw).await;
    let mut page = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut page)).await;
    Some(String::from_utf8_lossy(&page).into_owned())
}

fn request(method: &str, path: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .into_bytes()
}

/// One sample of the text exposition: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the sample lines of a text exposition (label values unescaped). Panics on a line
/// that is not valid, so a malformed page fails the test.
fn parse(page: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in page.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect(line);
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((name, rest)) => {
                let rest = rest.strip_suffix('}').expect(line);
                let mut labels = BTreeMap::new();
                let mut chars = rest.chars().peekable();
                loop {
                    let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
                    if key.is_empty() {
                        break;
                    }
                    assert_eq!(chars.next(), Some('"'), "{line}");
                    let mut value = String::new();
                    while let Some(c) = chars.next() {
                        match c {
                            '\\' => match chars.next() {
                                Some('n') => value.push('\n'),
                                Some(c) => value.push(c),
                                None => panic!("{line}"),
                            },
                            '"' => break,
                            c => value.push(c),
                        }
                    }
                    labels.insert(key, value);
                    if chars.peek() == Some(&',') {
                        chars.next();
                    }
                }
                (name.to_string(), labels)
            }
        };
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "{line}"
        );
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

/// Scrapes `addr` until `ready` holds for what it serves and returns that, or panics with
/// `what` after `secs` seconds.
async fn wait_for_scrape(
    addr: SocketAddr,
    secs: u64,
    what: &str,
    ready: impl Fn(&[Sample]) -> bool,
) -> Vec<Sample> {
    wait_for(Duration::from_secs(secs), what, || async {
        let s = scrape(addr).await;
        ready(&s).then_some(s)
    })
    .await
}

async fn scrape(addr: SocketAddr) -> Vec<Sample> {
    let page = exchange(addr, &request("GET", "/metrics")).await;
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    let body = page.split_once("\r\n\r\n").expect("a body").1;
    parse(body)
}

fn series<'a>(samples: &'a [Sample], name: &str) -> Vec<&'a Sample> {
    samples.iter().filter(|s| s.name == name).collect()
}

fn job_value(samples: &[Sample], name: &str, job: &str) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.name == name && s.labels.get("job_id").map(String::as_str) == Some(job))
        .map(|s| s.value)
}

/// The agent's per-GPU families.
const DCGM: [&str; 5] = [
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_SM_CLOCK",
];

/// Progress lines for 12 s (60 reports, loss falling), then exit 0.
const JOB: &str = r#"id = "metrics-job"
command = ["/bin/sh", "-c", 'i=1; while [ $i -le 60 ]; do echo "CONVERGE_PROGRESS {\"step\":$i,\"samples\":$((i*32)),\"loss\":$((1000/(i+1))).5}"; i=$((i+1)); sleep 0.2; done']
min_workers = 1
max_workers = 1
gpus_per_worker = 2
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_and_allocator_metrics_over_http() {
    let (nats, work, bus) = start_test().await;
    let agent_addr = free_addr();
    let mut cfg = agent_config(&nats, "metrics-host", 4, work.path());
    cfg.metrics_addr = Some(agent_addr);
    cfg.telemetry_interval = Duration::from_millis(200);
    let agent = start_agent(cfg);
    let alloc_addr = free_addr();
    let mut acfg = allocator_config(&nats, Duration::ZERO);
    acfg.metrics_addr = Some(alloc_addr);
    let allocator = start_allocator(acfg);

    // The agent's GPUs under dcgm-exporter's names and labels.
    let samples = wait_for(
        Duration::from_secs(20),
        "the agent's GPU series",
        || async {
            let page = try_exchange(agent_addr, &request("GET", "/metrics")).await?;
            let samples = page
                .starts_with("HTTP/1.1 200")
                .then(|| parse(page.split_once("\r\n\r\n").unwrap().1))?;
            (series(&samples, "DCGM_FI_DEV_GPU_UTIL").len() == 4).then_some(samples)
        },
    )
    .await;
    for name in DCGM {
        let found = series(&samples, name);
        assert_eq!(found.len(), 4, "{name}: {found:?}");
        for (i, s) in found.iter().enumerate() {
            let keys: Vec<&str> = s.labels.keys().map(String::as_str).collect();
            assert_eq!(
                keys,
                ["Hostname", "UUID", "device", "gpu", "modelName"],
                "{s:?}"
            );
            let gpu = &s.labels["gpu"];
            assert!(found.iter().filter(|o| &o.labels["gpu"] == gpu).count() == 1);
            assert_eq!(s.labels["device"], format!("nvidia{gpu}"), "{s:?}");
            assert_eq!(s.labels["Hostname"], "metrics-host");
            assert_eq!(s.labels["UUID"], format!("GPU-fake-metrics-host-{gpu}"));
            assert_eq!(s.labels["modelName"], "Converge fake GPU");
            assert!(gpu.parse::<usize>().unwrap() < 4, "{i} {s:?}");
        }
    }
    let by_gpu = |name: &str, gpu: &str| {
        series(&samples, name)
            .into_iter()
            .find(|s| s.labels["gpu"] == gpu)
            .unwrap()
            .value
    };
    for gpu in ["0", "1", "2", "3"] {
        let util = by_gpu("DCGM_FI_DEV_GPU_UTIL", gpu);
        assert!((0.0..=100.0).contains(&util), "{util}");
        let total = by_gpu("DCGM_FI_DEV_FB_USED", gpu) + by_gpu("DCGM_FI_DEV_FB_FREE", gpu);
        assert_eq!(total, 16_384.0, "16 GiB fake GPUs in MiB");
        let watts = by_gpu("DCGM_FI_DEV_POWER_USAGE", gpu);
        assert!(watts == 50.0 || watts == 250.0, "{watts} W");
        let mhz = by_gpu("DCGM_FI_DEV_SM_CLOCK", gpu);
        assert!(mhz == 210.0 || mhz == 1755.0, "{mhz} MHz");
    }

    // NICs under node_exporter's names: counters per device, loopback included, and a speed
    // exactly where the telemetry knows one.
    let rx = series(&samples, "node_network_receive_bytes_total");
    let tx = series(&samples, "node_network_transmit_bytes_total");
    let lo_rx = rx
        .iter()
        .find(|s| s.labels.get("device").map(String::as_str) == Some("lo"))
        .expect("loopback receive counter")
        .value;
    assert!(lo_rx > 0.0, "NATS runs on loopback: {lo_rx}");
    assert_eq!(rx.len(), tx.len());
    assert!(rx.iter().all(|s| s.labels.len() == 1 && s.value >= 0.0));
    let reported = telemetry(&bus, "metrics-host")
        .await
        .expect("the host's telemetry");
    for nic in &reported.nics {
        let speed = series(&samples, "node_network_speed_bytes")
            .into_iter()
            .find(|s| s.labels["device"] == nic.name)
            .map(|s| s.value);
        assert_eq!(
            speed,
            nic.link_speed_bps.map(|b| b as f64 / 8.0),
            "{}",
            nic.name
        );
    }
    // The agent's own series.
    for name in [
        "converge_agent_fenced",
        "converge_agent_worker_restarts_total",
        "converge_agent_malformed_progress_lines_total",
        "converge_agent_ignored_gradient_stats_total",
        "converge_agent_heartbeat_failures_total",
        "process_resident_memory_bytes",
    ] {
        assert_eq!(series(&samples, name).len(), 1, "{name}");
    }
    assert_eq!(series(&samples, "converge_agent_fenced")[0].value, 0.0);
    assert_eq!(series(&samples, "converge_agent_workers").len(), 5);

    // A job: the allocator exports its series while it runs, and none once it completed.
    let spec = JobSpec::from_toml(JOB).unwrap();
    bus.jobs
        .create("metrics-job", serde_json::to_vec(&spec).unwrap().into())
        .await
        .unwrap();
    let families = [
        "converge_job_loss",
        "converge_job_workers",
        "converge_job_samples_per_second",
    ];
    let what = "the job's loss, workers and throughput on the allocator's endpoint";
    let running = wait_for_scrape(alloc_addr, 30, what, |s| {
        families
            .iter()
            .all(|n| job_value(s, n, "metrics-job").is_some())
    })
    .await;
    assert_eq!(
        job_value(&running, "converge_job_workers", "metrics-job"),
        Some(1.0)
    );
    let loss = job_value(&running, "converge_job_loss", "metrics-job").unwrap();
    assert!(loss > 0.0 && loss < 1000.0, "{loss}");
    assert!(job_value(&running, "converge_job_samples_per_second", "metrics-job").unwrap() > 0.0);
    for s in running
        .iter()
        .filter(|s| s.name.starts_with("converge_job_"))
    {
        assert_eq!(s.labels.keys().collect::<Vec<_>>(), ["job_id"], "{s:?}");
    }
    assert!(
        running
            .iter()
            .any(|s| s.name == "converge_allocator_allocation_changes_total"
                && s.labels.get("cause").map(String::as_str) == Some("started")
                && s.value >= 1.0),
        "the job's start is counted"
    );
    // The worker shows on the agent's endpoint.
    let on_agent = scrape(agent_addr).await;
    let running_workers = on_agent
        .iter()
        .find(|s| s.name == "converge_agent_workers" && s.labels["phase"] == "running")
        .unwrap()
        .value;
    assert!(running_workers <= 1.0);
    // The GPUs its worker holds carry the job and the rank on every DCGM family; the other
    // GPUs none, and each GPU still has one series per family.
    let held = wait_for_scrape(
        agent_addr,
        20,
        "the job's id on the agent's GPU series",
        |s| {
            s.iter().any(|s| {
                s.name == "DCGM_FI_DEV_GPU_UTIL"
                    && s.labels.get("job_id").map(String::as_str) == Some("metrics-job")
            })
        },
    )
    .await;
    let reported = telemetry(&bus, "metrics-host")
        .await
        .expect("the host's telemetry");
    let worker = reported
        .workers
        .iter()
        .find(|w| w.job.as_str() == "metrics-job")
        .expect("the job's worker in the telemetry");
    assert_eq!(worker.gpus.len(), 2, "{worker:?}");
    for name in DCGM {
        let found = series(&held, name);
        assert_eq!(found.len(), 4, "{name}: {found:?}");
        let mut labelled: Vec<u32> = Vec::new();
        for s in &found {
            match s.labels.get("job_id") {
                Some(job) => {
                    assert_eq!(job, "metrics-job", "{s:?}");
                    assert_eq!(s.labels["rank"], "0", "{s:?}");
                    let keys: Vec<&str> = s.labels.keys().map(String::as_str).collect();
                    assert_eq!(
                        keys,
                        [
                            "Hostname",
                            "UUID",
                            "device",
                            "gpu",
                            "job_id",
                            "modelName",
                            "rank"
                        ],
                        "{s:?}"
                    );
                    labelled.push(s.labels["gpu"].parse().unwrap());
                }
                None => assert!(!s.labels.contains_key("rank"), "{s:?}"),
            }
        }
        labelled.sort_unstable();
        let mut expected = worker.gpus.clone();
        expected.sort_unstable();
        assert_eq!(
            labelled, expected,
            "{name}: the worker's CUDA_VISIBLE_DEVICES"
        );
    }
    for s in series(&held, "DCGM_FI_DEV_GPU_UTIL") {
        let busy = s.labels.contains_key("job_id");
        assert_eq!(
            s.value >= 90.0,
            busy,
            "fake GPUs are busy where held: {s:?}"
        );
    }
    let predicted = wait_for(Duration::from_secs(20), "a predicted loss", || async {
        job_value(
            &scrape(alloc_addr).await,
            "converge_job_predicted_loss",
            "metrics-job",
        )
    })
    .await;
    assert!(predicted.is_finite() && predicted >= 0.0, "{predicted}");

    // Another writer (a new leader, as far as this one can tell) changes the job's status:
    // the allocator notices, counted either as a write conflict (its next write, based on
    // the revision it read, is refused) or as a foreign write (its watch of the statuses
    // showed it first), re-reads, and the job goes on to complete.
    let (mut foreign, _) = bus
        .get::<converge_common::JobStatus>(&bus.status, "metrics-job")
        .await
        .unwrap()
        .expect("a status");
    foreign.message = Some("written by another allocator".into());
    bus.put(&bus.status, "metrics-job", &foreign).await.unwrap();
    wait_for_scrape(
        alloc_addr,
        20,
        "a counted write conflict or foreign write",
        |s| {
            s.iter().any(|s| {
                (s.name == "converge_allocator_write_conflicts_total"
                    || s.name == "converge_allocator_foreign_writes_total")
                    && s.labels.get("bucket").map(String::as_str) == Some("status")
                    && s.value >= 1.0
            })
        },
    )
    .await;

    wait_for_phase(&bus, "metrics-job", JobPhase::Completed, 40).await;
    wait_for_scrape(
        alloc_addr,
        10,
        "the finished job's series to disappear",
        |s| {
            !s.iter()
                .any(|s| s.labels.get("job_id").map(String::as_str) == Some("metrics-job"))
        },
    )
    .await;
    // Its worker has exited: the agent's GPU series are back to idle (no job_id, no rank),
    // with no series left over from the job.
    wait_for_scrape(agent_addr, 10, "the agent's GPU series back to idle", |s| {
        DCGM.iter().all(|name| {
            let found = series(s, name);
            found.len() == 4
                && found
                    .iter()
                    .all(|s| !s.labels.contains_key("job_id") && !s.labels.contains_key("rank"))
        })
    })
    .await;
    let after = scrape(alloc_addr).await;
    assert!(
        after
            .iter()
            .any(|s| s.name == "converge_allocator_jobs_finished_total"
                && s.labels.get("phase").map(String::as_str) == Some("completed")),
        "the completion is counted"
    );
    // Node counters only grow.
    let lo_rx_later = series(
        &scrape(agent_addr).await,
        "node_network_receive_bytes_total",
    )
    .into_iter()
    .find(|s| s.labels["device"] == "lo")
    .unwrap()
    .value;
    assert!(lo_rx_later > lo_rx, "{lo_rx} -> {lo_rx_later}");

    // Read-only and bounded, on the real agent's endpoint.
    let page = exchange(agent_addr, &request("GET", "/")).await;
    assert!(page.starts_with("HTTP/1.1 404"), "{page}");
    let page = exchange(agent_addr, &request("POST", "/metrics")).await;
    assert!(page.starts_with("HTTP/1.1 405"), "{page}");
    let mut huge = b"GET /metrics HTTP/1.1\r\nHost: test\r\nX-Big: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 1 << 20));
    huge.extend_from_slice(b"\r\n\r\n");
    let page = exchange(agent_addr, &huge).await;
    assert!(
        page.is_empty() || page.starts_with("HTTP/1.1 431"),
        "{page}"
    );
    let silent = tokio::net::TcpStream::connect(agent_addr).await.unwrap();
    let started = Instant::now();
    let samples = scrape(agent_addr).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a silent client delays a scrape: {:?}",
        started.elapsed()
    );
    assert_eq!(series(&samples, "DCGM_FI_DEV_GPU_UTIL").len(), 4);
    drop(silent);
    assert!(agent.is_running() && allocator.is_running());

    allocator.stop().await;
    agent.stop().await;
    // A stopped agent takes its series along.
    assert!(!converge_bus::metrics::render().contains("Hostname=\"metrics-host\""));
}

//! `converge-loadgen`: loads one allocator the way a large cluster would, over a real NATS.
//!
//! - **Agents:** `--agents` simulated hosts of `--gpus-per-agent` fake GPUs each; every
//!   `--telemetry-interval` each writes its `HostTelemetry` heartbeat to KV `converge-hosts`
//!   (what the allocator reads) and publishes it on its telemetry subject, as a real agent
//!   does. They run no workers (they do not act on plans).
//! - **Jobs:** `--jobs` job specs are submitted first (command `sleep infinity`, never run);
//!   the allocator places them on the simulated hosts.
//! - **Progress:** `--reports-per-s` progress reports in all (every rank of every job in
//!   turn, `--ranks-per-job` ranks, a falling loss with noise), published to the JetStream
//!   progress stream with acknowledgement (with `--retry-like-agent`, as
//!   `converge-agent`'s outbox publishes them: one message id per report, each attempt
//!   waiting 2 s for its acknowledgement, retried for 30 s; a report not acknowledged by
//!   then is lost), at most `--max-in-flight` unacknowledged. Each report
//!   of rank `r` comes from the host the allocator placed rank `r` on, with the job's
//!   current generation, as the job statuses say (followed by a KV watch: the allocator
//!   refuses reports from other hosts and of ranks placed elsewhere); a job not placed
//!   yet, and a rank the job does not have, send none. The agents keep writing heartbeats
//!   until the drain below ends.
//! - **Measured:** every `--scrape-every` the allocator's `/metrics` (`--metrics-url`):
//!   step (decision) time, ingest lag (stream → allocator), reports applied, input queue and
//!   resident memory. After `--duration` it stops sending and waits until the allocator has
//!   applied every acknowledged report (or `--drain-timeout`), then prints a Markdown
//!   summary (and JSON with `--summary`): a report acknowledged by JetStream but never
//!   applied by the allocator counts as lost.
//!
//! - **Flood** (`--flood-hosts N`): N compromised agents, each publishing `--flood-bytes`
//!   reports (garbage the allocator refuses as malformed, each on its own host's subject
//!   with a new job id, so every one is a new subject) as fast as JetStream acknowledges
//!   them, `--flood-in-flight` at once each, while the honest load runs. Measured besides:
//!   the progress stream's bytes (its largest size seen against its bound), the honest
//!   heartbeats that failed, and the allocator's failed plan and status writes
//!   (`converge_allocator_write_failures_total`). `deploy/flood-bench.sh` runs it on a
//!   three-server cluster and times a restarted allocator's first decision after it.
//!
//! The allocator must be started with `--metrics-addr`, and its progress counter must not
//! move for other reasons during the run (no real agents on the same NATS).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Parser;
use converge_bus::{Bus, NatsArgs, Rejects, humantime_duration, unix_now};
use converge_common::codec::encode;
use converge_common::{
    GpuSample, HostId, HostTelemetry, JobId, JobSpec, JobStatus, NicSample, PROTOCOL_VERSION,
    ProgressReport, WorkerProgressLine, subjects,
};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde::Serialize;

#[derive(Debug, Parser)]
#[command(name = "converge-loadgen", version, about, long_about = None)]
struct Args {
    #[command(flatten)]
    nats: NatsArgs,
    /// Simulated agents (hosts).
    #[arg(long, default_value_t = 2000)]
    agents: u32,
    /// Fake GPUs per simulated agent.
    #[arg(long, default_value_t = 8)]
    gpus_per_agent: u32,
    /// Heartbeat period of every simulated agent.
    #[arg(long, default_value = "1s", value_parser = humantime_duration)]
    telemetry_interval: Duration,
    /// Jobs submitted before the load starts.
    #[arg(long, default_value_t = 1000)]
    jobs: u32,
    /// Progress reports per second, all jobs and ranks together.
    #[arg(long, default_value_t = 10_000)]
    reports_per_s: u32,
    /// Ranks (workers) reporting per job: every step brings one report from each, as
    /// agents send every worker's progress lines; only rank 0's form the loss curve.
    #[arg(long, default_value_t = 8)]
    ranks_per_job: u32,
    /// How long to send.
    #[arg(long, default_value = "5m", value_parser = humantime_duration)]
    duration: Duration,
    /// Unacknowledged JetStream publishes allowed at once.
    #[arg(long, default_value_t = 4096)]
    max_in_flight: usize,
    /// Publish each honest report as `converge-agent`'s outbox does: under its message id,
    /// each attempt waiting 2 s, retried for 30 s, lost only after that (what a flood
    /// costs an agent). Without it, one acknowledged publish each, a failure counted at
    /// once: cheaper for the load generator and the server, which share the allocator's
    /// cores here (the ingest benchmark's figures are measured so).
    #[arg(long)]
    retry_like_agent: bool,
    /// The allocator's metrics page (started with `--metrics-addr`).
    #[arg(long, default_value = "http://127.0.0.1:9464/metrics")]
    metrics_url: String,
    /// How often to scrape the allocator and print a progress line.
    #[arg(long, default_value = "10s", value_parser = humantime_duration)]
    scrape_every: Duration,
    /// After sending, how long to wait for the allocator to apply every report.
    #[arg(long, default_value = "2m", value_parser = humantime_duration)]
    drain_timeout: Duration,
    /// Prefix of host and job ids (`<prefix>-h00042`, `<prefix>-j0042`).
    #[arg(long, default_value = "load")]
    prefix: String,
    /// Also write the summary as JSON here.
    #[arg(long)]
    summary: Option<std::path::PathBuf>,
    /// Compromised agents flooding the progress stream as fast as it acknowledges.
    #[arg(long, default_value_t = 0)]
    flood_hosts: u32,
    /// Bytes of each flood message (the stream refuses more than 64 KiB).
    #[arg(long, default_value_t = 60_000)]
    flood_bytes: usize,
    /// Unacknowledged publishes each flooding agent keeps in flight.
    #[arg(long, default_value_t = 4096)]
    flood_in_flight: usize,
}

/// One scrape of the allocator's metrics.
#[derive(Debug, Clone, Default)]
struct Scrape {
    reports_applied: f64,
    /// `(le, cumulative count)` of `converge_allocator_step_seconds` (both labels summed).
    step_buckets: Vec<(f64, f64)>,
    step_sum: f64,
    step_count: f64,
    lag_buckets: Vec<(f64, f64)>,
    lag_sum: f64,
    lag_count: f64,
    rss_bytes: f64,
    input_queue: f64,
    hosts_live: f64,
    /// Plan and status writes that failed, both buckets.
    write_failures: f64,
}

fn scrape(url: &str) -> anyhow::Result<Scrape> {
    let body = ureq::get(url)
        .call()
        .with_context(|| format!("GET {url}"))?
        .body_mut()
        .read_to_string()
        .with_context(|| format!("read {url}"))?;
    let lines = body.lines().map(|l| Ok(l.to_string()));
    let parsed = prometheus_parse::Scrape::parse(lines).context("parse metrics page")?;
    let mut s = Scrape::default();
    let mut step: BTreeMap<u64, f64> = BTreeMap::new();
    let mut lag: BTreeMap<u64, f64> = BTreeMap::new();
    for sample in parsed.samples {
        use prometheus_parse::Value;
        match (sample.metric.as_str(), &sample.value) {
            (
                "converge_allocator_progress_reports_total",
                Value::Counter(v) | Value::Untyped(v),
            ) => s.reports_applied = *v,
            ("process_resident_memory_bytes", Value::Gauge(v) | Value::Untyped(v)) => {
                s.rss_bytes = *v
            }
            ("converge_allocator_input_queue", Value::Gauge(v) | Value::Untyped(v)) => {
                s.input_queue = *v
            }
            ("converge_allocator_hosts_live", Value::Gauge(v) | Value::Untyped(v)) => {
                s.hosts_live = *v
            }
            ("converge_allocator_write_failures_total", Value::Counter(v) | Value::Untyped(v)) => {
                s.write_failures += v
            }
            ("converge_allocator_step_seconds", Value::Histogram(h)) => {
                for b in h {
                    *step.entry(b.less_than.to_bits()).or_default() += b.count;
                }
            }
            ("converge_allocator_step_seconds_sum", Value::Untyped(v)) => s.step_sum += v,
            ("converge_allocator_step_seconds_count", Value::Untyped(v)) => s.step_count += v,
            ("converge_allocator_ingest_lag_seconds", Value::Histogram(h)) => {
                for b in h {
                    *lag.entry(b.less_than.to_bits()).or_default() += b.count;
                }
            }
            ("converge_allocator_ingest_lag_seconds_sum", Value::Untyped(v)) => s.lag_sum += v,
            ("converge_allocator_ingest_lag_seconds_count", Value::Untyped(v)) => s.lag_count += v,
            _ => {}
        }
    }
    let sorted = |m: BTreeMap<u64, f64>| {
        let mut v: Vec<(f64, f64)> = m.into_iter().map(|(k, c)| (f64::from_bits(k), c)).collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    };
    s.step_buckets = sorted(step);
    s.lag_buckets = sorted(lag);
    Ok(s)
}

/// Quantile `q` of the observations between two scrapes of a cumulative histogram, by
/// linear interpolation inside the bucket (as Prometheus' `histogram_quantile`); the
/// largest finite bound when it falls in the `+Inf` bucket.
fn quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|&(le, c)| {
            let b = before
                .iter()
                .find(|(l, _)| *l == le)
                .map_or(0.0, |(_, c)| *c);
            (le, c - b)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, c) in &delta {
        if c >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let within = if c > prev.1 {
                (rank - prev.1) / (c - prev.1)
            } else {
                1.0
            };
            return Some(prev.0 + (le - prev.0) * within);
        }
        prev = (le, c);
    }
    Some(prev.0)
}

impl Counters {
    /// Counts an honest report's outcome: acknowledged (after retries or not), or not
    /// (with `--retry-like-agent`, after the agent's patience).
    fn delivered(&self, outcome: Result<converge_bus::Delivered, converge_bus::ReportLost>) {
        match outcome {
            Ok(d) => {
                self.reports_acked.fetch_add(1, Ordering::Relaxed);
                if d.retries > 0 {
                    self.reports_retried.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(lost) => {
                tracing::warn!("{lost}");
                self.reports_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    telemetry_written: AtomicU64,
    telemetry_failed: AtomicU64,
    /// Heartbeats not acknowledged within [`HEARTBEAT_ACK_TIMEOUT`].
    telemetry_late: AtomicU64,
    reports_sent: AtomicU64,
    reports_acked: AtomicU64,
    /// Reports acknowledged only after one or more retries.
    reports_retried: AtomicU64,
    /// Reports not acknowledged (with `--retry-like-agent`: within the agent's 30 s of
    /// retries, lost as the agent would lose them).
    reports_failed: AtomicU64,
    flood_acked: AtomicU64,
    flood_failed: AtomicU64,
}

#[derive(Debug, Serialize)]
struct Summary {
    agents: u32,
    jobs: u32,
    target_reports_per_s: u32,
    duration_s: f64,
    telemetry_per_s: f64,
    telemetry_failed: u64,
    /// Heartbeats not acknowledged within 2 s (a real agent counts them as not stored).
    telemetry_late: u64,
    /// Heartbeat write to acknowledgement, seconds (a late one counts as 2 s; one refused
    /// at once is not timed).
    heartbeat_latency_p50_s: Option<f64>,
    heartbeat_latency_p99_s: Option<f64>,
    heartbeat_latency_max_s: Option<f64>,
    /// The longest time any agent went without an acknowledged heartbeat (seconds), from
    /// its first attempt to the end of the drain (agents write until then): the allocator
    /// judges a host lost after `--host-timeout` (15 s) without one.
    heartbeat_gap_max_s: f64,
    reports_acked: u64,
    reports_per_s: f64,
    /// Acknowledged only after retrying (as the agent does, same message id, for 30 s).
    reports_retried: u64,
    /// Not acknowledged (with `--retry-like-agent`: within 30 s of retries, lost as the
    /// agent would lose them).
    reports_failed: u64,
    reports_applied: f64,
    reports_lost: f64,
    drain_s: f64,
    step_p50_s: Option<f64>,
    step_p99_s: Option<f64>,
    step_mean_s: Option<f64>,
    steps: f64,
    ingest_lag_p50_s: Option<f64>,
    ingest_lag_p99_s: Option<f64>,
    ingest_lag_mean_s: Option<f64>,
    rss_start_bytes: f64,
    rss_peak_bytes: f64,
    rss_end_bytes: f64,
    hosts_live_end: f64,
    /// The fewest live hosts any scrape during the run saw (not the one after the drain,
    /// when the simulated agents have stopped); `None` without a scrape during the run.
    hosts_live_min: Option<f64>,
    flood_hosts: u32,
    flood_reports_acked: u64,
    flood_mib_per_s: f64,
    flood_failed: u64,
    /// Largest size of the progress stream seen during the run, and its bound.
    stream_bytes_max: u64,
    stream_bytes_bound: i64,
    plan_and_status_write_failures: f64,
}

fn host_id(prefix: &str, i: u32) -> HostId {
    HostId::new(format!("{prefix}-h{i:05}")).expect("valid host id")
}

fn job_id(prefix: &str, i: u32) -> JobId {
    JobId::new(format!("{prefix}-j{i:05}")).expect("valid job id")
}

fn telemetry(host: &HostId, gpus: u32) -> HostTelemetry {
    HostTelemetry {
        agent_version: format!("loadgen-{}", env!("CARGO_PKG_VERSION")),
        gpus: (0..gpus)
            .map(|index| GpuSample::idle(index, format!("GPU-{host}-{index}"), "loadgen", 80 << 30))
            .collect(),
        nics: vec![NicSample {
            name: "eth0".into(),
            rx_bytes_per_s: 0.0,
            tx_bytes_per_s: 0.0,
            link_speed_bps: Some(100_000_000_000),
        }],
        cpu_pct: 1.0,
        memory_used_bytes: 1 << 30,
        memory_total_bytes: 512 << 30,
        ..HostTelemetry::new(host.clone(), "10.255.255.1", unix_now())
    }
}

async fn submit_jobs(bus: &Bus, args: &Args) -> anyhow::Result<()> {
    let mut puts = FuturesUnordered::new();
    for j in 0..args.jobs {
        let toml = format!(
            "id = \"{}\"\ncommand = [\"sleep\", \"infinity\"]\nmin_workers = 1\nmax_workers = 8\n",
            job_id(&args.prefix, j)
        );
        let mut spec = JobSpec::from_toml(&toml)?;
        spec.submitted_at = unix_now();
        let key = spec.id.to_string();
        let payload = Bytes::from(encode(&spec));
        puts.push(async move { bus.jobs.put(key, payload).await });
        if puts.len() >= 256 {
            puts.next().await.transpose()?;
        }
    }
    while let Some(r) = puts.next().await {
        r?;
    }
    Ok(())
}

/// How long a real agent waits for its heartbeat's acknowledgement before it counts the
/// heartbeat as not stored (agent `publish_telemetry`).
const HEARTBEAT_ACK_TIMEOUT: Duration = Duration::from_secs(2);

/// What the simulated agents measured of their own heartbeats.
#[derive(Debug, Default)]
struct Heartbeats {
    /// Seconds from each put to its acknowledgement (or to the timeout).
    latencies_s: Vec<f32>,
    /// Per agent, the longest time between two acknowledged heartbeats (seconds).
    longest_gap_s: Vec<f64>,
}

/// Every simulated agent is its own task, as every real agent is its own process: once per
/// interval (first ticks spread evenly over one interval) it writes its heartbeat to KV and
/// waits for the acknowledgement at most [`HEARTBEAT_ACK_TIMEOUT`], as `converge-agent`
/// does, then publishes it on its telemetry subject. A slow bus therefore delays each
/// agent's next heartbeat by its own write's latency, never by other agents' writes.
/// They keep writing until `stop` is set, after the drain: a real agent does not stop
/// while the allocator still reads its reports, and a silent one is judged lost after
/// `--host-timeout`, its reports then refused.
async fn run_agents(
    bus: Arc<Bus>,
    args: Arc<Args>,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
) -> Heartbeats {
    let mut agents = tokio::task::JoinSet::new();
    for i in 0..args.agents {
        let host = host_id(&args.prefix, i);
        let (bus, counters, interval) = (bus.clone(), counters.clone(), args.telemetry_interval);
        let stop = stop.clone();
        let gpus = args.gpus_per_agent;
        let offset = interval.mul_f64(f64::from(i) / f64::from(args.agents.max(1)));
        agents.spawn(async move {
            let mut latencies = Vec::new();
            let mut longest_gap = 0.0f64;
            // The last acknowledged heartbeat, or the agent's first tick before one.
            let mut last_stored: Option<Instant> = None;
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + offset, interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let put = Instant::now();
                last_stored.get_or_insert(put);
                let payload = Bytes::from(encode(&telemetry(&host, gpus)));
                let stored = tokio::time::timeout(
                    HEARTBEAT_ACK_TIMEOUT,
                    bus.hosts.put(host.as_str(), payload.clone()),
                )
                .await;
                match stored {
                    Ok(Ok(_)) => {
                        latencies.push(put.elapsed().as_secs_f32());
                        counters.telemetry_written.fetch_add(1, Ordering::Relaxed);
                        let now = Instant::now();
                        if let Some(last) = last_stored {
                            longest_gap = longest_gap.max((now - last).as_secs_f64());
                        }
                        last_stored = Some(now);
                    }
                    // Refused at once (no latency to speak of): counted, not timed.
                    Ok(Err(_)) => {
                        counters.telemetry_failed.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        latencies.push(HEARTBEAT_ACK_TIMEOUT.as_secs_f32());
                        counters.telemetry_late.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let _ = bus
                    .client
                    .publish(subjects::telemetry(&host), payload)
                    .await;
            }
            // The silence at the end counts up to the end of the run, not to when the
            // last write returned.
            if let Some(last) = last_stored {
                let end = Instant::now().max(last);
                longest_gap = longest_gap.max((end - last).as_secs_f64());
            }
            (latencies, longest_gap)
        });
    }
    let mut out = Heartbeats::default();
    while let Some(done) = agents.join_next().await {
        if let Ok((latencies, gap)) = done {
            out.latencies_s.extend(latencies);
            out.longest_gap_s.push(gap);
        }
    }
    out
}

/// The `q` quantile (0..=1) of `values` by the nearest rank; `None` when empty.
fn nearest_rank(values: &mut [f32], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f32::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    Some(f64::from(values[rank - 1]))
}

/// Each placed job's generation and the host of each of its ranks, by rank.
type Placements = std::sync::Mutex<BTreeMap<JobId, (u64, Vec<HostId>)>>;

/// Follows every job's placement in the job statuses (a KV watch, re-created after an
/// error) until `until`.
async fn follow_placements(bus: Arc<Bus>, placed: Arc<Placements>, until: Instant) {
    let rejects = Rejects::default();
    while Instant::now() < until {
        match bus.status.watch_with_history(">").await {
            Ok(mut watch) => {
                while let Some(Ok(entry)) = watch.next().await {
                    let Some(mut s) = rejects.decode::<JobStatus>("kv", &entry.key, &entry.value)
                    else {
                        continue;
                    };
                    let mut map = placed.lock().expect("not poisoned");
                    if s.generation == 0 || s.placement.is_empty() {
                        map.remove(&s.job);
                        continue;
                    }
                    s.placement.sort_by_key(|p| p.rank);
                    let hosts = s.placement.into_iter().map(|p| p.host).collect();
                    map.insert(s.job, (s.generation, hosts));
                }
            }
            Err(e) => tracing::warn!("cannot watch job statuses: {e}"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Progress reports at the target rate, in 10 ms batches, acknowledged by JetStream (retried
/// as the agent retries), each
/// from the host its rank is placed on (ranks the job does not have send nothing).
async fn run_progress(bus: Arc<Bus>, args: Arc<Args>, counters: Arc<Counters>, until: Instant) {
    let jobs: Vec<JobId> = (0..args.jobs).map(|j| job_id(&args.prefix, j)).collect();
    let placed = Arc::new(Placements::default());
    tokio::spawn(follow_placements(bus.clone(), placed.clone(), until));
    let mut steps = vec![0u64; jobs.len()];
    let per_tick = f64::from(args.reports_per_s) / 100.0;
    let mut owed = 0.0;
    let mut next = 0usize;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut acks = FuturesUnordered::new();
    let mut noise = 0x9E37_79B9_7F4A_7C15u64;
    while Instant::now() < until {
        tokio::select! {
            _ = tick.tick() => {
                owed += per_tick;
                let ranks = args.ranks_per_job.max(1) as usize;
                let slots = (jobs.len() * ranks).max(1);
                // Positions looked at this tick: a full round finds no placed rank left.
                let mut looked = 0usize;
                while owed >= 1.0 && acks.len() < args.max_in_flight && looked < slots {
                    looked += 1;
                    let (j, rank) = (next / ranks, (next % ranks) as u32);
                    next = (next + 1) % slots;
                    let Some((generation, host)) = placed
                        .lock()
                        .expect("not poisoned")
                        .get(&jobs[j])
                        .and_then(|(g, hosts)| Some((*g, hosts.get(rank as usize)?.clone())))
                    else {
                        // Not placed yet, or placed with fewer ranks: the allocator accepts
                        // a rank's report only from the host that rank is placed on, so
                        // the next placed rank sends instead (the rate stays the one asked).
                        continue;
                    };
                    owed -= 1.0;
                    if rank == 0 {
                        steps[j] += 1;
                    }
                    let step = steps[j];
                    // xorshift noise in [-0.01, 0.01]
                    noise ^= noise << 13;
                    noise ^= noise >> 7;
                    noise ^= noise << 17;
                    let jitter = (noise % 2001) as f64 / 100_000.0 - 0.01;
                    let report = ProgressReport {
                        protocol: PROTOCOL_VERSION,
                        job: jobs[j].clone(),
                        generation,
                        rank,
                        host,
                        line: WorkerProgressLine {
                            epoch: Some(step as f64 / 100.0),
                            ..WorkerProgressLine::new(
                                step,
                                step * 64,
                                2.0 / (1.0 + step as f64 / 500.0) + 0.1 + jitter,
                            )
                        },
                        time: unix_now(),
                        workers: Some(args.ranks_per_job.max(1)),
                        hosts: Some(1),
                    };
                    counters.reports_sent.fetch_add(1, Ordering::Relaxed);
                    let bus = bus.clone();
                    let like_agent = args.retry_like_agent;
                    acks.push(async move {
                        if like_agent {
                            // As the agent's outbox sends it: one message id, retried.
                            return bus.publish_report(&report).await;
                        }
                        let subject = subjects::progress(&report.job, &report.host);
                        bus.publish_acked(subject.clone(), &report)
                            .await
                            .map(|()| converge_bus::Delivered {
                                retries: 0,
                                duplicate: false,
                            })
                            .map_err(|last| converge_bus::ReportLost {
                                retries: 0,
                                elapsed: Duration::ZERO,
                                last,
                            })
                    });
                }
                // Reports not sent because too many are in flight are dropped from the
                // schedule (the achieved rate is reported).
                owed = owed.min(per_tick);
            }
            Some(r) = acks.next(), if !acks.is_empty() => counters.delivered(r),
        }
    }
    while let Some(r) = acks.next().await {
        counters.delivered(r);
    }
}

/// One compromised agent: reports of `--flood-bytes` garbage on its own progress subject,
/// each with a new job id, as fast as JetStream acknowledges, until `until`.
async fn run_flood(
    bus: Arc<Bus>,
    args: Arc<Args>,
    counters: Arc<Counters>,
    index: u32,
    until: Instant,
) {
    let host = HostId::new(format!("{}-flood-h{index}", args.prefix)).expect("a valid host id");
    let pad = "x".repeat(args.flood_bytes.saturating_sub(64));
    let mut acks = FuturesUnordered::new();
    let mut n = 0u64;
    while Instant::now() < until {
        while acks.len() < args.flood_in_flight {
            n += 1;
            let job =
                JobId::new(format!("{}-flood-{index}-{n}", args.prefix)).expect("a valid job id");
            let payload = Bytes::from(format!("{{\"flood\":{n},\"pad\":\"{pad}\"}}"));
            let publish = bus.js.publish(subjects::progress(&job, &host), payload);
            acks.push(async move {
                publish
                    .await?
                    .await
                    .map(|_| ())
                    .map_err(anyhow::Error::from)
            });
        }
        match acks.next().await {
            Some(Ok(())) => counters.flood_acked.fetch_add(1, Ordering::Relaxed),
            Some(Err(_)) => counters.flood_failed.fetch_add(1, Ordering::Relaxed),
            None => 0,
        };
    }
    while let Some(r) = acks.next().await {
        match r {
            Ok(()) => counters.flood_acked.fetch_add(1, Ordering::Relaxed),
            Err(_) => counters.flood_failed.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// The progress stream's size in bytes and its bound (`max_bytes`).
async fn stream_bytes(bus: &Bus) -> anyhow::Result<(u64, i64)> {
    let mut stream = bus.js.get_stream(subjects::PROGRESS_STREAM).await?;
    let info = stream.info().await?;
    Ok((info.state.bytes, info.config.max_bytes))
}

async fn scrape_async(url: &str) -> anyhow::Result<Scrape> {
    let url = url.to_string();
    tokio::task::spawn_blocking(move || scrape(&url)).await?
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // A retry of an honest report is counted, not logged: a flood would print thousands.
    converge_bus::init_tracing("info,converge_bus::publish=error");
    let args = Arc::new(Args::parse());
    // Opens what the allocator made as it is (its replicas kept); creates with
    // `--bus-replicas` only what is missing.
    let bus = Arc::new(
        Bus::connect(
            &args.nats,
            "converge-loadgen",
            converge_bus::Setup::OpenOrCreate,
        )
        .await?,
    );
    let start_scrape = scrape_async(&args.metrics_url)
        .await
        .context("the allocator's metrics (start it with --metrics-addr)")?;

    tracing::info!(jobs = args.jobs, "submitting jobs");
    submit_jobs(&bus, &args).await?;
    let counters = Arc::new(Counters::default());
    let started = Instant::now();
    let until = started + args.duration;
    tracing::info!(
        agents = args.agents,
        reports_per_s = args.reports_per_s,
        duration = ?args.duration,
        "load started"
    );
    let agents_stop = Arc::new(AtomicBool::new(false));
    let agents = tokio::spawn(run_agents(
        bus.clone(),
        args.clone(),
        counters.clone(),
        agents_stop.clone(),
    ));
    let progress = tokio::spawn(run_progress(
        bus.clone(),
        args.clone(),
        counters.clone(),
        until,
    ));
    // Each compromised agent on its own connection, as a real agent has: a flood shares
    // no socket with the honest agents' heartbeats, so what it delays is what the servers
    // share, not this process's one connection.
    let mut floods = Vec::new();
    for i in 0..args.flood_hosts {
        let flooder = Bus::connect(
            &args.nats,
            &format!("converge-loadgen-flood-{i}"),
            converge_bus::Setup::OpenOrCreate,
        )
        .await
        .context("a flooding agent's connection")?;
        floods.push(tokio::spawn(run_flood(
            Arc::new(flooder),
            args.clone(),
            counters.clone(),
            i,
            until,
        )));
    }
    let (mut stream_max, mut stream_bound) = stream_bytes(&bus).await?;

    let mut peak_rss = start_scrape.rss_bytes;
    let mut hosts_live_min = f64::INFINITY;
    let mut last = start_scrape.clone();
    let mut last_at = Instant::now();
    let mut last_acked = 0;
    while Instant::now() < until {
        tokio::time::sleep(
            args.scrape_every
                .min(until.saturating_duration_since(Instant::now())),
        )
        .await;
        match stream_bytes(&bus).await {
            Ok((bytes, bound)) => {
                stream_max = stream_max.max(bytes);
                stream_bound = bound;
            }
            Err(e) => tracing::warn!("cannot read the progress stream's size: {e:#}"),
        }
        match scrape_async(&args.metrics_url).await {
            Ok(s) => {
                peak_rss = peak_rss.max(s.rss_bytes);
                hosts_live_min = hosts_live_min.min(s.hosts_live);
                let acked = counters.reports_acked.load(Ordering::Relaxed);
                let secs = last_at.elapsed().as_secs_f64();
                println!(
                    "t={:>5.0}s acked {:>8.0}/s applied {:>8.0}/s step p99 {} lag p99 {} queue {:>6.0} hosts {:>5.0} rss {:.0} MiB",
                    started.elapsed().as_secs_f64(),
                    (acked - last_acked) as f64 / secs,
                    (s.reports_applied - last.reports_applied) / secs,
                    fmt_s(quantile(&last.step_buckets, &s.step_buckets, 0.99)),
                    fmt_s(quantile(&last.lag_buckets, &s.lag_buckets, 0.99)),
                    s.input_queue,
                    s.hosts_live,
                    s.rss_bytes / 1048576.0,
                );
                last = s;
                last_at = Instant::now();
                last_acked = acked;
            }
            Err(e) => tracing::warn!("scrape failed: {e:#}"),
        }
    }
    let _ = progress.await;
    for f in floods {
        let _ = f.await;
    }
    let sent_for = started.elapsed();
    if let Ok((bytes, _)) = stream_bytes(&bus).await {
        stream_max = stream_max.max(bytes);
    }

    // Drain: wait until the allocator applied every acknowledged report.
    let acked = counters.reports_acked.load(Ordering::Relaxed);
    let drain_started = Instant::now();
    let end = loop {
        let s = scrape_async(&args.metrics_url).await?;
        peak_rss = peak_rss.max(s.rss_bytes);
        let applied = s.reports_applied - start_scrape.reports_applied;
        if applied >= acked as f64 || drain_started.elapsed() > args.drain_timeout {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    agents_stop.store(true, Ordering::Relaxed);
    let mut heartbeats = agents.await.unwrap_or_default();
    let heartbeat_secs = started.elapsed().as_secs_f64();
    let applied = end.reports_applied - start_scrape.reports_applied;
    let secs = sent_for.as_secs_f64();
    let mean = |sum: f64, count: f64| (count > 0.0).then(|| sum / count);
    let summary = Summary {
        agents: args.agents,
        jobs: args.jobs,
        target_reports_per_s: args.reports_per_s,
        duration_s: secs,
        telemetry_per_s: counters.telemetry_written.load(Ordering::Relaxed) as f64 / heartbeat_secs,
        telemetry_failed: counters.telemetry_failed.load(Ordering::Relaxed),
        telemetry_late: counters.telemetry_late.load(Ordering::Relaxed),
        heartbeat_latency_p50_s: nearest_rank(&mut heartbeats.latencies_s, 0.5),
        heartbeat_latency_p99_s: nearest_rank(&mut heartbeats.latencies_s, 0.99),
        heartbeat_latency_max_s: nearest_rank(&mut heartbeats.latencies_s, 1.0),
        heartbeat_gap_max_s: heartbeats.longest_gap_s.iter().copied().fold(0.0, f64::max),
        reports_acked: acked,
        reports_per_s: acked as f64 / secs,
        reports_retried: counters.reports_retried.load(Ordering::Relaxed),
        reports_failed: counters.reports_failed.load(Ordering::Relaxed),
        reports_applied: applied,
        reports_lost: (acked as f64 - applied).max(0.0),
        drain_s: drain_started.elapsed().as_secs_f64(),
        step_p50_s: quantile(&start_scrape.step_buckets, &end.step_buckets, 0.5),
        step_p99_s: quantile(&start_scrape.step_buckets, &end.step_buckets, 0.99),
        step_mean_s: mean(
            end.step_sum - start_scrape.step_sum,
            end.step_count - start_scrape.step_count,
        ),
        steps: end.step_count - start_scrape.step_count,
        ingest_lag_p50_s: quantile(&start_scrape.lag_buckets, &end.lag_buckets, 0.5),
        ingest_lag_p99_s: quantile(&start_scrape.lag_buckets, &end.lag_buckets, 0.99),
        ingest_lag_mean_s: mean(
            end.lag_sum - start_scrape.lag_sum,
            end.lag_count - start_scrape.lag_count,
        ),
        rss_start_bytes: start_scrape.rss_bytes,
        rss_peak_bytes: peak_rss,
        rss_end_bytes: end.rss_bytes,
        hosts_live_end: end.hosts_live,
        hosts_live_min: hosts_live_min.is_finite().then_some(hosts_live_min),
        flood_hosts: args.flood_hosts,
        flood_reports_acked: counters.flood_acked.load(Ordering::Relaxed),
        flood_mib_per_s: counters.flood_acked.load(Ordering::Relaxed) as f64
            * args.flood_bytes as f64
            / 1048576.0
            / secs,
        flood_failed: counters.flood_failed.load(Ordering::Relaxed),
        stream_bytes_max: stream_max,
        stream_bytes_bound: stream_bound,
        plan_and_status_write_failures: end.write_failures - start_scrape.write_failures,
    };
    print_summary(&summary);
    if let Some(path) = &args.summary {
        std::fs::write(path, serde_json::to_string_pretty(&summary)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    if summary.reports_lost > 0.0 || summary.reports_failed > 0 {
        anyhow::bail!(
            "{} acknowledged reports not applied, {} not acknowledged",
            summary.reports_lost,
            summary.reports_failed
        );
    }
    Ok(())
}

fn fmt_s(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| {
        if v < 1.0 {
            format!("{:.1} ms", v * 1e3)
        } else {
            format!("{v:.2} s")
        }
    })
}

fn print_summary(s: &Summary) {
    println!();
    println!("| figure | value |");
    println!("|---|---|");
    println!("| simulated agents / jobs | {} / {} |", s.agents, s.jobs);
    println!("| sending time | {:.0} s |", s.duration_s);
    println!(
        "| heartbeats written (run and drain) | {:.0}/s ({} failed, {} not acknowledged within 2 s) |",
        s.telemetry_per_s, s.telemetry_failed, s.telemetry_late
    );
    println!(
        "| heartbeat acknowledgement p50 / p99 / max | {} / {} / {} |",
        fmt_s(s.heartbeat_latency_p50_s),
        fmt_s(s.heartbeat_latency_p99_s),
        fmt_s(s.heartbeat_latency_max_s)
    );
    println!(
        "| longest time an agent went without an acknowledged heartbeat (run and drain) | {:.1} s |",
        s.heartbeat_gap_max_s
    );
    println!(
        "| progress reports acknowledged | {} ({:.0}/s of {} asked; {} after retries, {} failed) |",
        s.reports_acked,
        s.reports_per_s,
        s.target_reports_per_s,
        s.reports_retried,
        s.reports_failed
    );
    println!(
        "| applied by the allocator / lost | {:.0} / {:.0} (drained in {:.1} s) |",
        s.reports_applied, s.reports_lost, s.drain_s
    );
    println!(
        "| step (decision) time p50 / p99 / mean | {} / {} / {} ({:.0} steps) |",
        fmt_s(s.step_p50_s),
        fmt_s(s.step_p99_s),
        fmt_s(s.step_mean_s),
        s.steps
    );
    println!(
        "| ingest lag p50 / p99 / mean | {} / {} / {} |",
        fmt_s(s.ingest_lag_p50_s),
        fmt_s(s.ingest_lag_p99_s),
        fmt_s(s.ingest_lag_mean_s)
    );
    println!(
        "| allocator resident memory start / peak / end | {:.0} / {:.0} / {:.0} MiB |",
        s.rss_start_bytes / 1048576.0,
        s.rss_peak_bytes / 1048576.0,
        s.rss_end_bytes / 1048576.0
    );
    println!(
        "| live hosts: fewest seen during the run / after the drain | {} / {:.0} |",
        s.hosts_live_min.map_or("-".into(), |n| format!("{n:.0}")),
        s.hosts_live_end
    );
    println!(
        "| plan and status writes failed | {:.0} |",
        s.plan_and_status_write_failures
    );
    if s.flood_hosts > 0 {
        println!(
            "| flood: hosts / reports acknowledged / rate | {} / {} ({} failed) / {:.1} MiB/s |",
            s.flood_hosts, s.flood_reports_acked, s.flood_failed, s.flood_mib_per_s
        );
    }
    println!(
        "| progress stream: largest size / bound | {:.1} / {:.1} MiB |",
        s.stream_bytes_max as f64 / 1048576.0,
        s.stream_bytes_bound as f64 / 1048576.0
    );
}

#[cfg(test)]
mod tests {
    use super::{nearest_rank, quantile};

    #[test]
    fn nearest_rank_quantiles() {
        let mut v = [0.4f32, 0.1, 0.3, 0.2];
        assert_eq!(nearest_rank(&mut v, 0.5), Some(f64::from(0.2f32)));
        assert_eq!(nearest_rank(&mut v, 0.99), Some(f64::from(0.4f32)));
        assert_eq!(nearest_rank(&mut v, 0.0), Some(f64::from(0.1f32)));
        assert_eq!(nearest_rank(&mut [], 0.5), None);
    }

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let before = [(0.1, 0.0), (1.0, 0.0), (f64::INFINITY, 0.0)];
        let after = [(0.1, 50.0), (1.0, 100.0), (f64::INFINITY, 100.0)];
        assert_eq!(quantile(&before, &after, 0.5), Some(0.1));
        let q = quantile(&before, &after, 0.75).unwrap();
        assert!((q - 0.55).abs() < 1e-12, "{q}");
        // Only what happened between the scrapes counts.
        let later = [(0.1, 50.0), (1.0, 100.0), (f64::INFINITY, 200.0)];
        assert_eq!(quantile(&after, &later, 0.5), Some(1.0));
        assert_eq!(quantile(&after, &after, 0.5), None);
    }
}

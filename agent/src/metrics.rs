//! The agent's Prometheus metrics (`--metrics-addr`), rebuilt from every telemetry sample:
//!
//! - GPUs under dcgm-exporter's names, units and labels (`DCGM_FI_DEV_GPU_UTIL` %,
//!   `DCGM_FI_DEV_FB_USED` / `_FB_FREE` MiB, `DCGM_FI_DEV_POWER_USAGE` W,
//!   `DCGM_FI_DEV_SM_CLOCK` MHz; labels `gpu`, `UUID`, `device`, `modelName`, `Hostname`),
//!   so dashboards written for dcgm-exporter work unchanged, plus `job_id` and `rank` of the
//!   worker holding the GPU, as dcgm-exporter adds `pod`, `namespace` and `container` (see
//!   [`gpu_holders`]);
//! - NICs under node_exporter's names (`node_network_receive_bytes_total`,
//!   `node_network_transmit_bytes_total`, `node_network_speed_bytes`; label `device`);
//! - the agent's own `converge_agent_*` series.
//!
//! Each sample replaces the agent's whole snapshot ([`converge_bus::metrics::set_snapshot`]):
//! a reading the source does not give (power, SM clock, link speed) has no series, never a
//! 0, and an interface that disappeared has none either. So when a GPU changes hands, the
//! series with the previous holder's `job_id` and `rank` are gone from the next sample on
//! (Prometheus marks them stale at its next scrape) and never report an old job.

use converge_bus::metrics::{Family, Labels, Snapshot, SnapshotGuard, set_snapshot};
use converge_common::{HostTelemetry, JobId, WorkerPhase, WorkerState};
use std::collections::{BTreeMap, HashMap};

const MIB: u64 = 1024 * 1024;

/// Counters kept between samples, and the NIC byte counters (sysinfo; the telemetry carries
/// rates only).
pub struct AgentMetrics {
    owner: SnapshotGuard,
    networks: sysinfo::Networks,
    counters: Counters,
    restarts_seen: HashMap<(JobId, u64, u32), u32>,
}

impl std::fmt::Debug for AgentMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentMetrics")
            .field("owner", &self.owner)
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

/// The agent's own counters and state, besides what a telemetry sample carries.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    /// Worker restarts seen since start (summed over workers and generations).
    pub worker_restarts: u64,
    /// Heartbeats that NATS did not acknowledge.
    pub heartbeat_failures: u64,
    /// Telemetry samples taken.
    pub samples: u64,
    /// Whether the agent has fenced itself (stopped its workers for lack of heartbeats).
    pub fenced: bool,
}

/// One NIC's byte counters since boot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicTotals {
    pub device: String,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

impl AgentMetrics {
    /// The metrics of the agent `host` (its snapshot is removed when this is dropped).
    ///
    /// # Errors
    /// sysinfo's, when it cannot list the network interfaces.
    pub fn new(host: &str) -> Result<Self, String> {
        Ok(Self {
            owner: SnapshotGuard(format!("agent/{host}")),
            networks: sysinfo::Networks::new_with_refreshed_list()
                .map_err(|e| format!("sysinfo: {e}"))?,
            counters: Counters::default(),
            restarts_seen: HashMap::new(),
        })
    }

    /// Counts a heartbeat NATS did not acknowledge.
    pub fn heartbeat_failed(&mut self) {
        self.counters.heartbeat_failures += 1;
    }

    /// Rebuilds the exported series from `t`, the sample just taken.
    pub fn update(&mut self, t: &HostTelemetry, fenced: bool) {
        self.counters.samples += 1;
        self.counters.fenced = fenced;
        // Restarts: a worker's count grows within its generation; add what grew since the
        // previous sample and forget workers that are gone.
        let mut seen = HashMap::with_capacity(t.workers.len());
        for w in &t.workers {
            let key = (w.job.clone(), w.generation, w.rank);
            let before = self.restarts_seen.get(&key).copied().unwrap_or(0);
            self.counters.worker_restarts += u64::from(w.restarts.saturating_sub(before));
            seen.insert(key, w.restarts.max(before));
        }
        self.restarts_seen = seen;
        self.networks.refresh(true);
        let mut nics: Vec<NicTotals> = self
            .networks
            .iter()
            .map(|(name, data)| NicTotals {
                device: name.to_string_lossy().into_owned(),
                rx_bytes: data.total_received(),
                tx_bytes: data.total_transmitted(),
            })
            .collect();
        nics.sort_by(|a, b| a.device.cmp(&b.device));
        set_snapshot(&self.owner.0, families(t, &nics, &self.counters));
    }
}

/// The exported families of one sample (pure: the unit tests call it).
pub fn families(t: &HostTelemetry, nics: &[NicTotals], c: &Counters) -> Snapshot {
    let mut util = Family::gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).");
    let mut fb_used = Family::gauge("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).");
    let mut fb_free = Family::gauge("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).");
    let mut power = Family::gauge("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).");
    let mut clock = Family::gauge("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).");
    let holders = gpu_holders(&t.workers);
    let host = t.host.to_string();
    for g in &t.gpus {
        // dcgm-exporter's label names and order (it adds pci_bus_id, which the telemetry
        // does not carry), then the holder's, where dcgm-exporter puts a pod's: absent on an
        // idle GPU, as dcgm-exporter leaves out `pod` (in Prometheus, the same as empty).
        let holder = holders.get(&g.index);
        let mut base: Labels = Vec::with_capacity(if holder.is_some() { 7 } else { 5 });
        base.extend([
            ("gpu", g.index.to_string()),
            ("UUID", g.uuid.clone()),
            ("device", format!("nvidia{}", g.index)),
            ("modelName", g.name.clone()),
            ("Hostname", host.clone()),
        ]);
        if let Some(w) = holder {
            base.push(("job_id", w.job.to_string()));
            base.push(("rank", w.rank.to_string()));
        }
        let labels = || base.clone();
        util.push(labels(), g.utilization_pct.clamp(0.0, 100.0));
        // MiB as DCGM reports them, used + free = total.
        let total_mib = g.memory_total_bytes / MIB;
        let used_mib = ((g.memory_used_bytes + MIB / 2) / MIB).min(total_mib);
        fb_used.push(labels(), used_mib as f64);
        fb_free.push(labels(), (total_mib - used_mib) as f64);
        power.push_some(labels(), g.power_mw.map(|mw| mw as f64 / 1000.0));
        clock.push_some(labels(), g.sm_clock_mhz.map(f64::from));
    }

    let mut rx = Family::counter(
        "node_network_receive_bytes_total",
        "Network device statistic receive_bytes.",
    );
    let mut tx = Family::counter(
        "node_network_transmit_bytes_total",
        "Network device statistic transmit_bytes.",
    );
    for n in nics {
        rx.push(vec![("device", n.device.clone())], n.rx_bytes as f64);
        tx.push(vec![("device", n.device.clone())], n.tx_bytes as f64);
    }
    let mut speed = Family::gauge(
        "node_network_speed_bytes",
        "Network device property: speed_bytes.",
    );
    for n in &t.nics {
        speed.push_some(
            vec![("device", n.name.clone())],
            n.link_speed_bps.map(|bps| bps as f64 / 8.0),
        );
    }

    let mut workers = Family::gauge(
        "converge_agent_workers",
        "Workers this agent supervises, by phase",
    );
    let mut by_phase: BTreeMap<&'static str, usize> = BTreeMap::new();
    for phase in [
        WorkerPhase::Running,
        WorkerPhase::Backoff,
        WorkerPhase::Stopping,
        WorkerPhase::Succeeded,
        WorkerPhase::Failed,
    ] {
        by_phase.insert(phase_name(phase), 0);
    }
    for w in &t.workers {
        *by_phase.entry(phase_name(w.phase)).or_default() += 1;
    }
    for (phase, n) in by_phase {
        workers.push(vec![("phase", phase.to_string())], n as f64);
    }
    let one = |name, help, value: f64, counter: bool| {
        let mut f = if counter {
            Family::counter(name, help)
        } else {
            Family::gauge(name, help)
        };
        f.push(Vec::new(), value);
        f
    };
    let mut info = Family::gauge(
        "converge_agent_info",
        "Agent version and GPU source (value 1)",
    );
    info.push(
        vec![
            ("version", t.agent_version.clone()),
            ("gpu_source", t.gpu_source.clone()),
        ],
        1.0,
    );
    vec![
        util,
        fb_used,
        fb_free,
        power,
        clock,
        rx,
        tx,
        speed,
        workers,
        info,
        one(
            "converge_agent_gpus",
            "GPUs the agent reports",
            t.gpus.len() as f64,
            false,
        ),
        one(
            "converge_agent_worker_restarts_total",
            "Worker restarts after a crash, since the agent started",
            c.worker_restarts as f64,
            true,
        ),
        one(
            "converge_agent_fenced",
            "1 while the agent has stopped its workers for lack of heartbeats (--fence-after)",
            if c.fenced { 1.0 } else { 0.0 },
            false,
        ),
        one(
            "converge_agent_malformed_progress_lines_total",
            "Malformed CONVERGE_PROGRESS lines from workers",
            t.malformed_progress_lines as f64,
            true,
        ),
        one(
            "converge_agent_ignored_gradient_stats_total",
            "Progress lines whose gradient statistics were invalid and dropped",
            t.ignored_gradient_stats as f64,
            true,
        ),
        one(
            "converge_agent_skipped_progress_reports_total",
            "Progress reports not sent: replaced by a newer one of a worker over its rate limit, dropped with the outbox (or the job's queue there) full, or given up after 30 s of retries",
            t.skipped_progress_reports as f64,
            true,
        ),
        one(
            "converge_agent_heartbeat_failures_total",
            "Telemetry samples whose heartbeat NATS did not acknowledge",
            c.heartbeat_failures as f64,
            true,
        ),
        one(
            "converge_agent_telemetry_samples_total",
            "Telemetry samples taken (published or not)",
            c.samples as f64,
            true,
        ),
        one(
            "converge_agent_last_sample_timestamp_seconds",
            "UNIX time of the latest telemetry sample",
            t.time,
            false,
        ),
    ]
}

/// The worker holding each GPU of the sample, by GPU index: a worker holds the GPUs of its
/// assignment (its `CUDA_VISIBLE_DEVICES`) while its process may exist, i.e. while it is
/// running or stopping ([`WorkerPhase::is_alive`]). A worker in backoff (crashed, restart
/// pending), succeeded or failed holds none: its GPUs are idle until a process runs on them
/// again. The agent never starts a worker on a GPU a live worker holds, so a GPU has at most
/// one holder; were there two, the running one wins, then the first in the sample's order.
pub fn gpu_holders(workers: &[WorkerState]) -> BTreeMap<u32, &WorkerState> {
    let mut holders: BTreeMap<u32, &WorkerState> = BTreeMap::new();
    for w in workers.iter().filter(|w| w.phase.is_alive()) {
        for &gpu in &w.gpus {
            holders
                .entry(gpu)
                .and_modify(|held| {
                    if held.phase != WorkerPhase::Running && w.phase == WorkerPhase::Running {
                        *held = w;
                    }
                })
                .or_insert(w);
        }
    }
    holders
}

fn phase_name(p: WorkerPhase) -> &'static str {
    match p {
        WorkerPhase::Running => "running",
        WorkerPhase::Backoff => "backoff",
        WorkerPhase::Stopping => "stopping",
        WorkerPhase::Succeeded => "succeeded",
        WorkerPhase::Failed => "failed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_bus::metrics::render_snapshots;
    use converge_common::{GpuSample, NicSample, PROTOCOL_VERSION, WorkerState};

    fn telemetry() -> HostTelemetry {
        HostTelemetry {
            protocol: PROTOCOL_VERSION,
            host: "node-1".parse().unwrap(),
            addr: "10.0.0.1".into(),
            time: 1_700_000_000.5,
            agent_version: "0.1.0".into(),
            gpu_source: "nvml".into(),
            gpus: vec![
                GpuSample {
                    index: 0,
                    uuid: "GPU-0a".into(),
                    name: "NVIDIA H100 80GB HBM3".into(),
                    memory_total_bytes: 81_559 * MIB,
                    memory_used_bytes: 1_000 * MIB + 3,
                    utilization_pct: 87.0,
                    power_mw: Some(312_456),
                    sm_clock_mhz: Some(1_980),
                },
                GpuSample {
                    index: 1,
                    uuid: "GPU-1b".into(),
                    name: "NVIDIA H100 80GB HBM3".into(),
                    memory_total_bytes: 81_559 * MIB,
                    memory_used_bytes: 0,
                    utilization_pct: 0.0,
                    power_mw: None,
                    sm_clock_mhz: None,
                },
            ],
            nics: vec![
                NicSample {
                    name: "eth0".into(),
                    rx_bytes_per_s: 1.0,
                    tx_bytes_per_s: 2.0,
                    link_speed_bps: Some(100_000_000_000),
                },
                NicSample {
                    name: "lo".into(),
                    rx_bytes_per_s: 0.0,
                    tx_bytes_per_s: 0.0,
                    link_speed_bps: None,
                },
            ],
            cpu_pct: 3.0,
            memory_used_bytes: 1,
            memory_total_bytes: 2,
            workers: vec![WorkerState {
                job: "j".parse().unwrap(),
                generation: 2,
                rank: 0,
                phase: WorkerPhase::Backoff,
                pid: None,
                restarts: 2,
                last_exit_code: Some(1),
                gpus: vec![0],
            }],
            malformed_progress_lines: 4,
            ignored_gradient_stats: 5,
            skipped_progress_reports: 6,
            labels: Default::default(),
        }
    }

    #[test]
    fn dcgm_and_node_exporter_names_units_and_labels() {
        let nics = [NicTotals {
            device: "eth0".into(),
            rx_bytes: 123,
            tx_bytes: 456,
        }];
        let c = Counters {
            worker_restarts: 7,
            heartbeat_failures: 1,
            samples: 9,
            fenced: true,
        };
        let text = render_snapshots([&families(&telemetry(), &nics, &c)]);
        let l0 = r#"{gpu="0",UUID="GPU-0a",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1"}"#;
        let l1 = r#"{gpu="1",UUID="GPU-1b",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1"}"#;
        for line in [
            format!("DCGM_FI_DEV_GPU_UTIL{l0} 87"),
            format!("DCGM_FI_DEV_GPU_UTIL{l1} 0"),
            format!("DCGM_FI_DEV_FB_USED{l0} 1000"),
            format!("DCGM_FI_DEV_FB_FREE{l0} 80559"),
            format!("DCGM_FI_DEV_FB_USED{l1} 0"),
            format!("DCGM_FI_DEV_FB_FREE{l1} 81559"),
            format!("DCGM_FI_DEV_POWER_USAGE{l0} 312.456"),
            format!("DCGM_FI_DEV_SM_CLOCK{l0} 1980"),
            "# TYPE node_network_receive_bytes_total counter".into(),
            r#"node_network_receive_bytes_total{device="eth0"} 123"#.into(),
            r#"node_network_transmit_bytes_total{device="eth0"} 456"#.into(),
            r#"node_network_speed_bytes{device="eth0"} 12500000000"#.into(),
            r#"converge_agent_workers{phase="backoff"} 1"#.into(),
            r#"converge_agent_workers{phase="running"} 0"#.into(),
            "converge_agent_worker_restarts_total 7".into(),
            "converge_agent_fenced 1".into(),
            "converge_agent_malformed_progress_lines_total 4".into(),
            "converge_agent_ignored_gradient_stats_total 5".into(),
            "converge_agent_skipped_progress_reports_total 6".into(),
            "converge_agent_heartbeat_failures_total 1".into(),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        // The only worker is in backoff: no process holds GPU 0, so no job labels.
        assert!(!text.contains("job_id="), "{text}");
        // Missing readings have no series (never 0).
        assert!(
            !text.contains(&format!("DCGM_FI_DEV_POWER_USAGE{l1}")),
            "{text}"
        );
        assert!(
            !text.contains(&format!("DCGM_FI_DEV_SM_CLOCK{l1}")),
            "{text}"
        );
        assert!(
            !text.contains(r#"node_network_speed_bytes{device="lo"}"#),
            "{text}"
        );
    }

    #[test]
    fn restarts_count_growth_only_and_survive_generations() {
        let mut m = AgentMetrics::new("restarts-test").unwrap();
        let mut t = telemetry();
        t.host = "restarts-test".parse().unwrap();
        m.update(&t, false);
        assert_eq!(m.counters.worker_restarts, 2);
        m.update(&t, false);
        assert_eq!(m.counters.worker_restarts, 2, "same count: nothing new");
        t.workers[0].restarts = 3;
        m.update(&t, false);
        assert_eq!(m.counters.worker_restarts, 3);
        t.workers[0].generation = 3;
        t.workers[0].restarts = 0;
        m.update(&t, true);
        assert_eq!(
            m.counters.worker_restarts, 3,
            "a new generation starts at 0"
        );
        assert!(m.counters.fenced);
        let page = converge_bus::metrics::render();
        assert!(
            page.contains(r#"Hostname="restarts-test""#),
            "the snapshot is exported"
        );
        drop(m);
        let page = converge_bus::metrics::render();
        assert!(
            !page.contains(r#"Hostname="restarts-test""#),
            "removed on drop"
        );
    }

    fn worker(job: &str, rank: u32, phase: WorkerPhase, gpus: &[u32]) -> WorkerState {
        WorkerState {
            job: job.parse().unwrap(),
            generation: 1,
            rank,
            phase,
            pid: phase.is_alive().then_some(100 + rank),
            restarts: 0,
            last_exit_code: None,
            gpus: gpus.to_vec(),
        }
    }

    #[test]
    fn live_workers_hold_their_gpus_running_ones_first() {
        let workers = [
            worker("old", 0, WorkerPhase::Stopping, &[0, 1]),
            worker("new", 1, WorkerPhase::Running, &[1, 2]),
            worker("crashed", 0, WorkerPhase::Backoff, &[3]),
            worker("done", 0, WorkerPhase::Succeeded, &[4]),
            worker("gone", 0, WorkerPhase::Failed, &[5]),
        ];
        let held: Vec<(u32, &str, u32)> = gpu_holders(&workers)
            .into_iter()
            .map(|(gpu, w)| (gpu, w.job.as_str(), w.rank))
            .collect();
        assert_eq!(held, [(0, "old", 0), (1, "new", 1), (2, "new", 1)]);
        assert!(gpu_holders(&[]).is_empty());
    }

    #[test]
    fn gpu_series_carry_the_holders_job_and_rank() {
        let mut t = telemetry();
        t.workers = vec![worker("train-7", 3, WorkerPhase::Running, &[1])];
        let text = render_snapshots([&families(&t, &[], &Counters::default())]);
        let l0 = r#"{gpu="0",UUID="GPU-0a",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1"}"#;
        let l1 = r#"{gpu="1",UUID="GPU-1b",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",job_id="train-7",rank="3"}"#;
        for line in [
            format!("DCGM_FI_DEV_GPU_UTIL{l0} 87"),
            format!("DCGM_FI_DEV_GPU_UTIL{l1} 0"),
            format!("DCGM_FI_DEV_FB_USED{l1} 0"),
            format!("DCGM_FI_DEV_FB_FREE{l1} 81559"),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        // One series per GPU and family, whoever holds it.
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("DCGM_FI_DEV_GPU_UTIL{"))
                .count(),
            2
        );
    }

    #[test]
    fn a_gpu_changing_hands_leaves_no_stale_series() {
        let host = "hands-test";
        let mut m = AgentMetrics::new(host).unwrap();
        let mut t = telemetry();
        t.host = host.parse().unwrap();
        let ours = |page: &str| -> Vec<String> {
            page.lines()
                .filter(|l| {
                    l.starts_with("DCGM_FI_DEV_GPU_UTIL{")
                        && l.contains(&format!(r#"Hostname="{host}""#))
                })
                .map(str::to_string)
                .collect()
        };
        let holders_of_gpu0 = |page: &str| -> Vec<String> {
            ours(page)
                .into_iter()
                .filter(|l| l.contains(r#"gpu="0""#))
                .collect()
        };
        t.workers = vec![worker("job-a", 0, WorkerPhase::Running, &[0])];
        m.update(&t, false);
        let page = converge_bus::metrics::render();
        let gpu0 = holders_of_gpu0(&page);
        assert_eq!(gpu0.len(), 1, "{gpu0:?}");
        assert!(gpu0[0].contains(r#"job_id="job-a",rank="0""#), "{gpu0:?}");

        // Stopping still holds it; then job-a's worker is gone and job-b's rank 2 runs there.
        t.workers[0].phase = WorkerPhase::Stopping;
        m.update(&t, false);
        assert!(holders_of_gpu0(&converge_bus::metrics::render())[0].contains("job-a"));
        t.workers = vec![
            worker("job-a", 0, WorkerPhase::Succeeded, &[0]),
            worker("job-b", 2, WorkerPhase::Running, &[0, 1]),
        ];
        m.update(&t, false);
        let page = converge_bus::metrics::render();
        let series = ours(&page);
        assert_eq!(series.len(), 2, "one series per GPU: {series:?}");
        assert!(
            !page
                .lines()
                .any(|l| l.contains(&format!(r#"Hostname="{host}""#)) && l.contains("job-a")),
            "no stale series:\n{page}"
        );
        assert!(
            series
                .iter()
                .all(|l| l.contains(r#"job_id="job-b",rank="2""#)),
            "{series:?}"
        );

        // Idle again: the job labels are gone, the GPUs' series stay.
        t.workers.clear();
        m.update(&t, false);
        let series = ours(&converge_bus::metrics::render());
        assert_eq!(series.len(), 2, "{series:?}");
        assert!(
            series
                .iter()
                .all(|l| !l.contains("job_id=") && !l.contains("rank=")),
            "{series:?}"
        );
    }
}

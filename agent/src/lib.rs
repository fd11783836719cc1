//! `converge-agent`: the node daemon. Reports GPU (NVML or fake), NIC and host telemetry,
//! keeps its latest telemetry in KV as the host's heartbeat, watches its own plan key and
//! reconciles worker processes to it, and publishes the workers' progress reports.

pub mod gpu;
pub mod host;
pub mod isolation;
pub mod labels;
pub mod metrics;
pub mod outbox;
pub mod reconcile;
pub mod shim;
pub mod strays;
pub mod supervisor;

use anyhow::Context as _;
use converge_bus::{Bus, KvChange, KvDecoder, NatsArgs, Rejects, humantime_duration, unix_now};
use converge_common::{
    Event, EventKind, HostId, HostPlan, HostTelemetry, PROTOCOL_VERSION, ProgressReport,
    WorkerAssignment, subjects,
};
use futures::StreamExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use supervisor::{ExitNotice, Outgoing, Supervisor, SupervisorConfig};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// Default telemetry (and heartbeat) interval.
pub const DEFAULT_TELEMETRY_INTERVAL: &str = "1s";
/// Default time between SIGTERM and SIGKILL when stopping a worker.
pub const DEFAULT_STOP_GRACE: &str = "10s";
/// How often the supervisor re-checks backoffs and grace periods.
pub const RECONCILE_TICK: Duration = Duration::from_millis(200);
/// Telemetry is published at most this often, even when workers change faster.
pub const MIN_TELEMETRY_SPACING: Duration = Duration::from_millis(200);
/// How often the plan is re-read even without a watch update (safety net after reconnects).
pub const PLAN_RESYNC: Duration = Duration::from_secs(15);

/// Command line and environment of `converge-agent`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "converge-agent",
    version,
    about = "Converge node agent: reports GPU, NIC and host telemetry over NATS and runs the \
             training workers the allocator plans for this host.",
    long_about = None
)]
pub struct AgentConfig {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// This host's id (letters, digits, '_' and '-'); default: the hostname up to its first dot.
    #[arg(long, env = "CONVERGE_HOST_ID")]
    pub host_id: Option<String>,
    /// Address other hosts use to reach this one (MASTER_ADDR of jobs whose rank 0 runs
    /// here); default: the local address of the route to the NATS server.
    #[arg(long, env = "CONVERGE_ADVERTISE_ADDR")]
    pub advertise_addr: Option<String>,
    /// Pretend this host has N GPUs (machines without GPUs: development, CI, local cluster).
    /// Without it the agent uses NVML and exits if NVML cannot be loaded.
    #[arg(long, env = "CONVERGE_FAKE_GPUS")]
    pub fake_gpus: Option<u32>,
    /// The fake GPUs' type, reported as the host's `gpu.type` label (e.g. `t4`, `a100`), so
    /// that local and CI clusters can mix GPU generations; default `fake`. A label value:
    /// letters, digits, '-', '_', '.'. Needs --fake-gpus.
    #[arg(long, env = "CONVERGE_FAKE_GPU_TYPE", requires = "fake_gpus", value_parser = parse_gpu_type)]
    pub fake_gpu_type: Option<String>,
    /// How fast the fake GPUs are, as a fraction of this machine's real speed, in (0, 1]:
    /// given to workers as `CONVERGE_GPU_SPEED`, and converge-trainer stretches each step's
    /// compute time by 1/speed (0.5: steps take twice as long). Needs --fake-gpus.
    #[arg(long, env = "CONVERGE_FAKE_GPU_SPEED", requires = "fake_gpus", value_parser = parse_gpu_speed)]
    pub fake_gpu_speed: Option<f64>,
    /// How often telemetry (the heartbeat) is published, e.g. 1s or 500ms.
    #[arg(long, env = "CONVERGE_TELEMETRY_INTERVAL", default_value = DEFAULT_TELEMETRY_INTERVAL, value_parser = humantime_duration)]
    pub telemetry_interval: Duration,
    /// Directory for worker logs (`<dir>/<job>/gen<g>-rank<r>.log`).
    #[arg(long, env = "CONVERGE_LOG_DIR", default_value = "converge-work/logs")]
    pub log_dir: PathBuf,
    /// Root of job checkpoint directories (`<root>/<job>`); must be shared by all hosts for
    /// jobs to move between hosts.
    #[arg(
        long,
        env = "CONVERGE_CHECKPOINT_ROOT",
        default_value = "converge-work/checkpoints"
    )]
    pub checkpoint_root: PathBuf,
    /// Directory of the agent's own state: the process groups of the workers it runs
    /// (`<dir>/workers-<host id>.state`), read on start so that workers left by an earlier
    /// run of the agent (killed with its shims, say) are stopped before anything starts.
    /// Local disk; one file per host id, so agents of one machine may share it.
    #[arg(
        long,
        env = "CONVERGE_STATE_DIR",
        default_value = "converge-work/state"
    )]
    pub state_dir: PathBuf,
    /// Variables of the agent's environment that workers inherit: names, or prefixes ending
    /// in `*` (repeatable; the environment variable takes a comma-separated list). Workers
    /// get these, the job's `env` and the worker contract, nothing else; the agent's NATS
    /// settings and credentials never, whatever this says. Giving the flag replaces the
    /// default list.
    #[arg(
        long = "worker-env",
        value_name = "NAME",
        env = "CONVERGE_WORKER_ENV",
        value_delimiter = ',',
        default_value = isolation::DEFAULT_WORKER_ENV,
        value_parser = isolation::EnvAllowList::parse_entry
    )]
    pub worker_env: Vec<String>,
    /// Run each job's workers under a user id of its own from this range, `FIRST-LAST` (or
    /// one id for every job), e.g. `61000-61999`: ids no account uses, each also the
    /// group. The job's checkpoint directory is handed to that id (mode 0700) before each
    /// start, so jobs cannot read or overwrite each other's checkpoints, read each other's
    /// or the agent's environment, or edit the agent's state. Needs the agent to run as
    /// root. Unset: workers run as the agent's user.
    #[arg(long, value_name = "FIRST-LAST", env = "CONVERGE_WORKER_UIDS", value_parser = isolation::UidRange::parse)]
    pub worker_uids: Option<isolation::UidRange>,
    /// A cgroup v2 directory the agent may write (made when its parent is one; under
    /// systemd: the unit's own with `Delegate=yes`): each worker runs in a cgroup of its
    /// own below it (`<DIR>/<host id>/<job>.g<generation>.r<rank>.<n>`), killed whole when the worker ends or is stopped, so that nothing it
    /// started (`setsid`, daemons) outlives it; cgroups an earlier run left are killed at
    /// start. Unset: processes that leave the worker's process group are out of reach.
    #[arg(long, value_name = "DIR", env = "CONVERGE_WORKER_CGROUP")]
    pub worker_cgroup: Option<PathBuf>,
    /// Time a worker gets between SIGTERM and SIGKILL to checkpoint and exit.
    #[arg(long, env = "CONVERGE_STOP_GRACE", default_value = DEFAULT_STOP_GRACE, value_parser = humantime_duration)]
    pub stop_grace: Duration,
    /// First restart delay of a crashed worker; doubles per restart.
    #[arg(long, env = "CONVERGE_BACKOFF_BASE", default_value = "1s", value_parser = humantime_duration)]
    pub backoff_base: Duration,
    /// Longest restart delay.
    #[arg(long, env = "CONVERGE_BACKOFF_CAP", default_value = "30s", value_parser = humantime_duration)]
    pub backoff_cap: Duration,
    /// Self-fencing: when no heartbeat has reached NATS for this long, stop every worker
    /// (SIGTERM, so they checkpoint) and start them again only from the plan read after
    /// the connection is back. Keep it below the allocator's `--host-timeout` (15 s) minus
    /// the time workers need to checkpoint, so that workers of a cut-off host have stopped
    /// before the allocator places their jobs elsewhere and no job trains twice. A NATS
    /// restart shorter than this leaves workers running. `0s` turns it off.
    #[arg(long, env = "CONVERGE_FENCE_AFTER", default_value = "10s", value_parser = humantime_duration)]
    pub fence_after: Duration,
    /// Time a worker stopped by the self-fence gets between SIGTERM and SIGKILL (the stop
    /// grace when that is shorter). The allocator places a silent host's jobs elsewhere
    /// after its `--host-timeout` (15 s): keep `--fence-after` + this below it, so that no
    /// two generations of a job train, or write its checkpoint, at once. A worker that
    /// checkpoints more slowly loses the steps since its last periodic checkpoint.
    #[arg(long, env = "CONVERGE_FENCE_GRACE", default_value = "4s", value_parser = humantime_duration)]
    pub fence_grace: Duration,
    /// Serve Prometheus metrics at `http://<addr>/metrics` (e.g. `0.0.0.0:9465`): the GPUs
    /// under dcgm-exporter's names (`DCGM_FI_DEV_*`, labelled with the `job_id` and `rank`
    /// of the worker holding each GPU), the NICs under node_exporter's
    /// (`node_network_*`), workers by phase, restarts, fencing, malformed progress lines,
    /// heartbeat failures and the process's CPU and memory; refreshed with every telemetry
    /// sample. Off when unset.
    #[arg(long, env = "CONVERGE_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// A custom label of this host, `key=value` (repeatable; the environment variable takes
    /// a comma-separated list), which job selectors match; `gpu.*` keys are reserved for the
    /// labels the agent sets itself (`gpu.model`, `gpu.memory`, `gpu.count`).
    #[arg(long = "label", value_name = "KEY=VALUE", env = "CONVERGE_AGENT_LABELS", value_delimiter = ',', value_parser = labels::parse_label_arg)]
    pub labels: Vec<String>,
    /// Link speed of a NIC in Mbit/s, `NIC=MBITS` (repeatable; the environment variable takes
    /// a comma-separated list), reported instead of the speed the kernel gives: for virtual
    /// NICs (a veth says 10000 whatever shapes it), links shaped with `tc`, or NICs that
    /// report none. The allocator's contention model measures each host's NIC load against
    /// this speed.
    #[arg(long = "link-speed", value_name = "NIC=MBITS", env = "CONVERGE_LINK_SPEED", value_delimiter = ',', value_parser = host::parse_link_speed)]
    pub link_speeds: Vec<(String, u64)>,
    /// Print one telemetry sample (GPUs, NICs over one second, CPU, memory) as JSON and
    /// exit, without connecting to NATS: checks the GPU source on a new node.
    #[arg(long)]
    pub probe: bool,
    /// The program workers start through (`converge-agent worker-shim`, see [`shim`]): the
    /// binary sets its own; `None` starts workers directly, without a lifeline (library
    /// use only: such workers outlive a killed agent).
    #[arg(skip)]
    pub worker_shim: Option<PathBuf>,
}

/// `--fake-gpu-type`: a label value ([`converge_common::labels::validate_value`]), not empty.
fn parse_gpu_type(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("a GPU type may not be empty".into());
    }
    converge_common::labels::validate_value(converge_common::labels::GPU_TYPE, text)?;
    Ok(text.to_string())
}

/// `--fake-gpu-speed`: a number in (0, 1].
fn parse_gpu_speed(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!(
            "{text:?} is not a speed in (0, 1] (a fraction of this machine's real speed)"
        )),
    }
}

/// Runs the agent until `shutdown` is cancelled, then stops its workers (SIGTERM, grace,
/// SIGKILL) and returns.
pub async fn run(cfg: AgentConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let host = match &cfg.host_id {
        Some(h) => HostId::new(h.clone()).with_context(|| format!("invalid --host-id {h:?}"))?,
        None => HostId::new(host::default_host_id()).context("cannot derive a host id")?,
    };
    let mut gpus = gpu::open_gpu_source(
        host.as_str(),
        cfg.fake_gpus,
        cfg.fake_gpu_type.clone(),
        cfg.fake_gpu_speed,
    )
    .map_err(anyhow::Error::msg)?;
    let host_labels = labels::host_labels(
        &cfg.labels,
        &gpus.sample(&Default::default()),
        gpus.gpu_type(),
        gpus.gpu_speed(),
    )
    .map_err(|e| anyhow::anyhow!("invalid --label: {e}"))?;
    let mut host_sampler =
        host::HostSampler::with_link_speeds(&cfg.link_speeds).map_err(anyhow::Error::msg)?;
    let addr = cfg
        .advertise_addr
        .clone()
        .unwrap_or_else(|| route_addr(&cfg.nats.url));
    if cfg.probe {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let h = host_sampler.sample();
        let sample = HostTelemetry {
            protocol: PROTOCOL_VERSION,
            host,
            addr,
            time: unix_now(),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            gpu_source: gpus.kind().to_string(),
            gpus: gpus.sample(&Default::default()),
            nics: h.nics,
            cpu_pct: h.cpu_pct,
            memory_used_bytes: h.memory_used_bytes,
            memory_total_bytes: h.memory_total_bytes,
            workers: Vec::new(),
            malformed_progress_lines: 0,
            ignored_gradient_stats: 0,
            skipped_progress_reports: 0,
            labels: host_labels,
        };
        println!("{}", serde_json::to_string_pretty(&sample)?);
        return Ok(());
    }
    tracing::info!(%host, %addr, gpus = gpus.count(), source = gpus.kind(), "agent starting");
    let fence_total = cfg.fence_after + cfg.fence_grace.min(cfg.stop_grace);
    if !cfg.fence_after.is_zero() && fence_total >= Duration::from_secs(15) {
        tracing::warn!(
            fence_after = ?cfg.fence_after,
            fence_grace = ?cfg.fence_grace,
            "--fence-after + --fence-grace is {fence_total:?}: at the allocator's default \
             --host-timeout (15 s) a cut-off host's workers may still run when their jobs \
             start elsewhere; lower them or raise --host-timeout"
        );
    }
    if cfg.worker_uids.is_some() && !isolation::can_change_users() {
        anyhow::bail!(
            "--worker-uids needs the agent to run as root (it starts workers under other users and hands them their checkpoint directories)"
        );
    }
    // Each agent keeps its workers' cgroups under `<--worker-cgroup>/<host id>`, so that
    // agents of one machine sharing the directory never kill each other's as strays.
    let worker_cgroup = match &cfg.worker_cgroup {
        Some(root) => {
            isolation::check_cgroup_root(root).map_err(anyhow::Error::msg)?;
            let mine = root.join(host.as_str());
            isolation::check_cgroup_root(&mine).map_err(anyhow::Error::msg)?;
            Some(mine)
        }
        None => None,
    };
    // Workers left by an earlier run go before anything else happens. The state directory
    // is the agent's alone (workers cannot read or forge the records of what it runs).
    isolation::prepare_state_dir(&cfg.state_dir)
        .with_context(|| format!("cannot create --state-dir {}", cfg.state_dir.display()))?;
    let state_file = strays::state_path(&cfg.state_dir, host.as_str());
    strays::stop_strays(&state_file, cfg.stop_grace).await;
    if let Some(root) = &worker_cgroup {
        isolation::remove_stray_cgroups(root).await;
    }
    strays::StateFile {
        boot_id: strays::boot_id(),
        workers: Vec::new(),
    }
    .write(&state_file)
    .with_context(|| format!("cannot write {}", state_file.display()))?;
    if cfg.worker_shim.is_none() {
        tracing::warn!("workers start without the worker shim: they outlive a killed agent");
    }
    let mut agent_metrics = match cfg.metrics_addr {
        Some(a) => {
            converge_bus::metrics::serve(a, shutdown.clone()).await?;
            Some(metrics::AgentMetrics::new(host.as_str()).map_err(anyhow::Error::msg)?)
        }
        None => None,
    };

    // A secured server lets an agent open the buckets but not create or change them.
    // SIGTERM or Ctrl-C while NATS cannot be reached (yet) stops the agent at once.
    let client_name = format!("converge-agent/{host}");
    let bus = tokio::select! {
        bus = Bus::connect(&cfg.nats, &client_name, converge_bus::Setup::OpenOrCreate) => bus?,
        () = shutdown.cancelled() => {
            tracing::info!("stopped before NATS could be reached");
            return Ok(());
        }
    };
    let rejects = Arc::new(Rejects::default());
    tracing::info!(
        interval = ?cfg.telemetry_interval,
        "running: heartbeats to NATS, following this host's plan"
    );

    let (exit_tx, mut exit_rx) = mpsc::channel::<ExitNotice>(1024);
    let (out_tx, out_rx) = mpsc::channel::<Outgoing>(10_000);

    let (plan_tx, mut plan_rx) = watch::channel::<Option<Vec<WorkerAssignment>>>(None);
    let plan_task = tokio::spawn(watch_plan(
        bus.clone(),
        host.clone(),
        plan_tx,
        rejects.clone(),
        shutdown.clone(),
    ));

    let mut sup = Supervisor::new(
        SupervisorConfig {
            host: host.clone(),
            log_dir: cfg.log_dir.clone(),
            checkpoint_root: cfg.checkpoint_root.clone(),
            stop_grace: cfg.stop_grace,
            backoff_base: cfg.backoff_base,
            backoff_cap: cfg.backoff_cap,
            worker_shim: cfg.worker_shim.clone(),
            state_file: Some(state_file),
            gpu_speed: cfg.fake_gpu_speed,
            worker_env: isolation::EnvAllowList::new(cfg.worker_env.clone()),
            worker_uids: cfg.worker_uids,
            worker_cgroup,
        },
        exit_tx,
        out_tx.clone(),
    );
    let outbox_stop = CancellationToken::new();
    let outbox = tokio::spawn(run_outbox(
        bus.clone(),
        host.clone(),
        out_rx,
        sup.outbox_drops(),
        outbox_stop.clone(),
    ));

    let mut telemetry_tick = tokio::time::interval(cfg.telemetry_interval);
    telemetry_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reconcile_tick = tokio::time::interval(RECONCILE_TICK);
    let mut last_published = tokio::time::Instant::now() - MIN_TELEMETRY_SPACING;
    let mut dirty = true;
    let mut stopping_since: Option<tokio::time::Instant> = None;
    let mut last_heartbeat = tokio::time::Instant::now();
    let mut fenced = false;

    loop {
        tokio::select! {
            // Shutdown first: the plan watch ends with the same token, and its closed
            // channel must not end the loop before the workers are stopped.
            biased;
            _ = shutdown.cancelled(), if stopping_since.is_none() => {
                tracing::info!("shutting down: stopping all workers");
                sup.stop_all();
                stopping_since = Some(tokio::time::Instant::now());
                dirty = true;
            }
            changed = plan_rx.changed(), if stopping_since.is_none() => {
                if changed.is_err() {
                    // The plan watch ended (shutdown): stop the workers, then leave.
                    sup.stop_all();
                    stopping_since = Some(tokio::time::Instant::now());
                    dirty = true;
                    continue;
                }
                let plan = plan_rx.borrow_and_update().clone();
                if let Some(plan) = plan.filter(|_| !fenced) {
                    let workers = plan.len();
                    sup.set_plan(plan);
                    dirty |= sup.reconcile();
                    emit(&out_tx, &host, EventKind::PlanApplied { workers }, format!("{host} applied a plan of {workers} workers"));
                }
            }
            Some(notice) = exit_rx.recv() => {
                sup.on_exit(notice);
                sup.reconcile();
                dirty = true;
            }
            _ = reconcile_tick.tick() => {
                dirty |= sup.reconcile();
            }
            _ = telemetry_tick.tick() => {
                dirty = true;
            }
        }
        if stopping_since.is_some() && sup.all_stopped() {
            break;
        }
        if dirty && last_published.elapsed() >= MIN_TELEMETRY_SPACING {
            let (workers, busy) = sup.snapshot();
            let h = host_sampler.sample();
            let telemetry = HostTelemetry {
                protocol: PROTOCOL_VERSION,
                host: host.clone(),
                addr: addr.clone(),
                time: unix_now(),
                agent_version: env!("CARGO_PKG_VERSION").to_string(),
                gpu_source: gpus.kind().to_string(),
                gpus: gpus.sample(&busy),
                nics: h.nics,
                cpu_pct: h.cpu_pct,
                memory_used_bytes: h.memory_used_bytes,
                memory_total_bytes: h.memory_total_bytes,
                workers,
                malformed_progress_lines: sup.malformed_lines(),
                ignored_gradient_stats: sup.ignored_gradient_stats(),
                skipped_progress_reports: sup.skipped_reports(),
                labels: host_labels.clone(),
            };
            let stored = publish_telemetry(&bus, &telemetry).await;
            last_published = tokio::time::Instant::now();
            dirty = false;
            if stored {
                last_heartbeat = last_published;
                if fenced && let Some(plan) = read_plan(&bus, &host).await {
                    fenced = false;
                    tracing::warn!(
                        workers = plan.len(),
                        "NATS is back: following the current plan again"
                    );
                    sup.unfence();
                    sup.set_plan(plan);
                    sup.reconcile();
                    emit(
                        &out_tx,
                        &host,
                        EventKind::PlanApplied {
                            workers: sup.snapshot().0.len(),
                        },
                        format!("{host} is back and follows its plan"),
                    );
                }
            } else if !fenced
                && !cfg.fence_after.is_zero()
                && last_heartbeat.elapsed() >= cfg.fence_after
                && stopping_since.is_none()
            {
                fenced = true;
                tracing::error!(
                    silent = ?last_heartbeat.elapsed(),
                    grace = ?cfg.fence_grace.min(cfg.stop_grace),
                    "no heartbeat reached NATS for --fence-after: stopping every worker so that \
                     nothing trains twice once the allocator places them elsewhere"
                );
                sup.fence(cfg.fence_grace, std::time::Instant::now());
                sup.reconcile();
                dirty = true;
            }
            if let Some(m) = agent_metrics.as_mut() {
                if !stored {
                    m.heartbeat_failed();
                }
                m.update(&telemetry, fenced);
            }
        }
    }
    plan_task.abort();
    drop(out_tx);
    drop(sup);
    // The workers are stopped: their last reports are in the outbox (or on their way, from
    // readers whose stdout is still open). It gives up by itself after OUTBOX_DRAIN,
    // saying what it left; this bound is the backstop.
    outbox_stop.cancel();
    let _ = tokio::time::timeout(OUTBOX_DRAIN + Duration::from_secs(1), outbox).await;
    if !bus.flush_within(Duration::from_secs(1)).await {
        tracing::warn!("the last buffered messages did not reach NATS within 1 s; stopping anyway");
    }
    tracing::info!(refused_messages = rejects.total(), "agent stopped");
    Ok(())
}

/// The plan of `host` as stored now (`Some(empty)` when it has none), `None` when it
/// cannot be read within 2 s.
async fn read_plan(bus: &Bus, host: &HostId) -> Option<Vec<WorkerAssignment>> {
    let get = bus.get::<converge_common::HostPlan>(&bus.plans, host.as_str());
    match tokio::time::timeout(Duration::from_secs(2), get).await {
        Ok(Ok(plan)) => Some(plan.map(|(p, _)| p.workers).unwrap_or_default()),
        Ok(Err(e)) => {
            tracing::warn!("cannot read this host's plan: {e}");
            None
        }
        Err(_) => None,
    }
}

/// Stores the heartbeat in KV and publishes it; returns whether the KV write was
/// acknowledged (the heartbeat the allocator reads).
async fn publish_telemetry(bus: &Bus, telemetry: &HostTelemetry) -> bool {
    // The heartbeat in KV must not stall the supervisor for long when NATS is away.
    let put = bus.put(&bus.hosts, telemetry.host.as_str(), telemetry);
    let stored = match tokio::time::timeout(Duration::from_secs(2), put).await {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => {
            tracing::warn!("heartbeat not stored: {e}");
            false
        }
        Err(_) => {
            tracing::warn!("heartbeat not stored: NATS did not answer within 2 s");
            false
        }
    };
    if let Err(e) = bus
        .publish(subjects::telemetry(&telemetry.host), telemetry)
        .await
    {
        tracing::warn!("telemetry not published: {e}");
    }
    stored
}

fn emit(out: &mpsc::Sender<Outgoing>, host: &HostId, kind: EventKind, message: String) {
    let _ = out.try_send(Outgoing::Event(Event::new(
        unix_now(),
        format!("agent/{host}"),
        kind,
        message,
    )));
}

/// How long the outbox keeps sending what waits after the agent was told to stop.
const OUTBOX_DRAIN: Duration = Duration::from_secs(5);

/// Publishes progress reports (JetStream, acknowledged, retried) on this host's subject of
/// each job (`converge.v1.progress.<job>.<host>`: the only ones a secured server lets this
/// agent publish to) and events (core NATS). Reports wait in one bounded queue per job
/// ([`outbox::JobQueues`]), served in turn, one report at a time; the channel from the
/// workers is read while a report is being sent, so a job that reports faster than NATS
/// acknowledges drops its own oldest reports and no other job's. Drops and reports given
/// up after their retries are added to `dropped` (the host's skipped reports). Once `stop`
/// is cancelled (shutdown, the workers stopped), what waits is still sent for at most
/// [`OUTBOX_DRAIN`]; what is left then (NATS away or slow) is counted in `dropped` and
/// logged. It ends earlier when the channel is closed and everything is sent.
async fn run_outbox(
    bus: Bus,
    host: HostId,
    mut rx: mpsc::Receiver<Outgoing>,
    dropped: Arc<std::sync::atomic::AtomicU64>,
    stop: CancellationToken,
) {
    use std::sync::atomic::Ordering;
    type Sent = (
        ProgressReport,
        Result<converge_bus::Delivered, converge_bus::ReportLost>,
    );
    enum Next {
        Item(Option<Outgoing>),
        Sent(Sent),
    }
    let mut queues = outbox::JobQueues::new(outbox::OUTBOX_PER_JOB);
    // Set when `stop` is cancelled: the end of the shutdown's drain.
    let mut drain_until: Option<tokio::time::Instant> = None;
    let mut sending: Option<std::pin::Pin<Box<dyn std::future::Future<Output = Sent> + Send>>> =
        None;
    let mut open = true;
    loop {
        if sending.is_none() {
            match queues.pop() {
                Some(report) => {
                    let bus = bus.clone();
                    sending = Some(Box::pin(async move {
                        let result = bus.publish_report(&report).await;
                        (report, result)
                    }));
                }
                None if !open => break,
                None => {}
            }
        }
        let sent = async {
            match sending.as_mut() {
                Some(f) => f.await,
                None => std::future::pending().await,
            }
        };
        let drained = async {
            match drain_until {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let next = tokio::select! {
            () = stop.cancelled(), if drain_until.is_none() => {
                drain_until = Some(tokio::time::Instant::now() + OUTBOX_DRAIN);
                continue;
            }
            item = rx.recv(), if open => Next::Item(item),
            done = sent => Next::Sent(done),
            () = drained => {
                let left = queues.len() + usize::from(sending.is_some());
                if left > 0 {
                    dropped.fetch_add(left as u64, Ordering::Relaxed);
                    tracing::warn!(
                        left,
                        "progress reports not sent at shutdown: NATS did not take them within {OUTBOX_DRAIN:?}"
                    );
                }
                break;
            }
        };
        match next {
            Next::Item(None) => open = false,
            Next::Item(Some(Outgoing::Progress(report))) => {
                debug_assert_eq!(report.host, host, "reports name the agent's host");
                let job = report.job.clone();
                if queues.push(&job, report).is_some() {
                    let n = dropped.fetch_add(1, Ordering::Relaxed) + 1;
                    if n.is_power_of_two() {
                        tracing::warn!(
                            %job,
                            skipped_total = n,
                            "the job's outbox queue is full ({} reports): its oldest report dropped",
                            outbox::OUTBOX_PER_JOB
                        );
                    }
                }
            }
            Next::Item(Some(Outgoing::Event(event))) => {
                // Best effort, and never long: a stalled client must not stop the outbox
                // from reading the workers' reports into their jobs' queues.
                let publish = publish_event(&bus, &event);
                if tokio::time::timeout(Duration::from_millis(200), publish)
                    .await
                    .is_err()
                {
                    tracing::debug!("event not published within 200 ms");
                }
            }
            Next::Sent((report, result)) => {
                sending = None;
                match result {
                    Ok(delivery) if delivery.duplicate => tracing::info!(
                        msg_id = report.msg_id(),
                        "progress report was stored by an earlier attempt"
                    ),
                    Ok(_) => {}
                    Err(lost) => {
                        dropped.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(job = %report.job, "{lost}");
                    }
                }
            }
        }
    }
}

/// Publishes a worker or host event (core NATS, best effort).
async fn publish_event(bus: &Bus, event: &Event) {
    let subject = match &event.kind {
        EventKind::WorkerStarted { job, .. }
        | EventKind::WorkerExited { job, .. }
        | EventKind::WorkerFailed { job, .. } => subjects::job_events(job),
        _ => {
            let host = event.source.trim_start_matches("agent/");
            match HostId::new(host) {
                Ok(h) => subjects::host_events(&h),
                Err(_) => return,
            }
        }
    };
    if let Err(e) = bus.publish(subject, event).await {
        tracing::debug!("event not published: {e}");
    }
}

/// Follows this host's plan key: the current value first, then every update. A deleted
/// key means "no workers". Re-creates the watch if it ends and re-reads the key every
/// [`PLAN_RESYNC`] (the plan is level-triggered, so reading it twice is harmless).
async fn watch_plan(
    bus: Bus,
    host: HostId,
    tx: watch::Sender<Option<Vec<WorkerAssignment>>>,
    rejects: Arc<Rejects>,
    shutdown: CancellationToken,
) {
    // A plan naming another host than its key is refused (logged) and ignored; an
    // undecodable one is counted in `rejects` and ignored; a deleted key is no workers.
    let decoder = KvDecoder::named(rejects, |p: &HostPlan| &p.host);
    let apply = |entry: &async_nats::jetstream::kv::Entry| match decoder.decode(entry) {
        KvChange::Put(_, plan) => Some(plan.workers),
        KvChange::Deleted(_) => Some(Vec::new()),
        _ => None,
    };
    let send = |plan: Vec<WorkerAssignment>| {
        tx.send_if_modified(|cur| {
            if cur.as_ref() == Some(&plan) {
                false
            } else {
                *cur = Some(plan);
                true
            }
        });
    };
    while !shutdown.is_cancelled() {
        // `watch_key`, not `Store::watch`: its consumer-create subject names the key, so a
        // secured server can let this host watch its own plan and no other.
        let mut watch = match bus.watch_key(&bus.plans, host.as_str(), true).await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!("cannot watch plan: {e}; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        // The watch delivers nothing when the key was never written: start with no workers.
        if let Ok(None) = bus.plans.entry(host.as_str()).await {
            send(Vec::new());
        }
        let mut resync = tokio::time::interval(PLAN_RESYNC);
        resync.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                entry = watch.next() => match entry {
                    Some(Ok(entry)) => {
                        if let Some(plan) = apply(&entry) { send(plan); }
                    }
                    Some(Err(e)) => { tracing::warn!("plan watch error: {e}"); break; }
                    None => { tracing::warn!("plan watch ended; re-creating"); break; }
                },
                _ = resync.tick() => {
                    if let Ok(entry) = bus.plans.entry(host.as_str()).await {
                        // A key never written: no workers.
                        let plan = entry.as_ref().map_or(Some(Vec::new()), apply);
                        if let Some(plan) = plan { send(plan); }
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The local IP address of the route to the first NATS server in `url` (no packet is
/// sent); `127.0.0.1` if it cannot be determined.
pub fn route_addr(url: &str) -> String {
    let first = url.split(',').next().unwrap_or(url);
    let hostport = first
        .split("://")
        .last()
        .unwrap_or(first)
        .rsplit('@')
        .next()
        .unwrap_or(first);
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:4222")
    };
    use std::net::{ToSocketAddrs, UdpSocket};
    let target = hostport.to_socket_addrs().ok().and_then(|mut a| a.next());
    target
        .and_then(|t| {
            let sock = UdpSocket::bind("0.0.0.0:0").ok()?;
            sock.connect(t).ok()?;
            sock.local_addr().ok()
        })
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|| "127.0.0.1".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn fake_gpu_type_and_speed_are_checked_and_need_fake_gpus() {
        let parse = |extra: &[&str]| {
            AgentConfig::try_parse_from(["converge-agent"].iter().chain(extra).copied())
        };
        let cfg = parse(&[
            "--fake-gpus",
            "2",
            "--fake-gpu-type",
            "t4",
            "--fake-gpu-speed",
            "0.5",
        ])
        .unwrap();
        assert_eq!(cfg.fake_gpu_type.as_deref(), Some("t4"));
        assert_eq!(cfg.fake_gpu_speed, Some(0.5));
        for bad in [
            &["--fake-gpus", "2", "--fake-gpu-speed", "0"][..],
            &["--fake-gpus", "2", "--fake-gpu-speed", "1.5"],
            &["--fake-gpus", "2", "--fake-gpu-speed", "NaN"],
            &["--fake-gpus", "2", "--fake-gpu-type", "a b"],
            &["--fake-gpus", "2", "--fake-gpu-type", ""],
            &["--fake-gpu-type", "t4"],
            &["--fake-gpu-speed", "0.5"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn isolation_flags_default_to_the_allow_list_and_refuse_bad_values() {
        let parse = |extra: &[&str]| {
            AgentConfig::try_parse_from(["converge-agent"].iter().chain(extra).copied())
        };
        let cfg = parse(&[]).unwrap();
        let default: Vec<String> = isolation::DEFAULT_WORKER_ENV
            .split(',')
            .map(str::to_string)
            .collect();
        assert_eq!(cfg.worker_env, default);
        assert_eq!((cfg.worker_uids, cfg.worker_cgroup), (None, None));
        let cfg = parse(&[
            "--worker-env",
            "PATH,MY_*",
            "--worker-uids",
            "61000-61999",
            "--worker-cgroup",
            "/sys/fs/cgroup/converge",
        ])
        .unwrap();
        assert_eq!(cfg.worker_env, ["PATH", "MY_*"]);
        assert_eq!(
            cfg.worker_uids,
            Some(isolation::UidRange {
                first: 61000,
                last: 61999
            })
        );
        for bad in [
            &["--worker-env", "A-B"][..],
            &["--worker-uids", "0-100"],
            &["--worker-uids", "x"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn route_to_loopback_nats_is_loopback() {
        assert_eq!(route_addr("nats://127.0.0.1:4222"), "127.0.0.1");
        assert_eq!(
            route_addr("nats://user:pw@127.0.0.1:4222,nats://x:1"),
            "127.0.0.1"
        );
        assert_eq!(route_addr("localhost"), "127.0.0.1");
    }
}

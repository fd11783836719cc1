//! Worker supervision: starts worker processes with the worker-contract environment, stops
//! them (SIGTERM to the process group, grace period, SIGKILL), restarts crashed ones with
//! capped backoff, writes one log file per worker, and turns `CONVERGE_PROGRESS` lines into
//! progress reports. Decisions come from [`crate::reconcile::decide`]; this module only
//! carries them out.
//!
//! Each worker starts through the worker shim ([`crate::shim`]) when one is configured (the
//! binary always does): the shim leads the worker's process group, holds the read end of
//! the worker's lifeline (the agent keeps the write end until the worker is reaped) and
//! ends the group when the agent dies. The pid the supervisor knows, reports and signals
//! (`killpg`) is the shim's, which is the process group id. Every start and exit rewrites
//! the state file ([`crate::strays`]) that a restarted agent reads to stop strays.

use crate::isolation::{EnvAllowList, UidRange, WorkerCgroup};
use crate::reconcile::{Action, WorkerKey, WorkerView, decide, restart_delay};
use converge_bus::unix_now;
use converge_common::{
    Event, EventKind, GradientReading, HostId, JobId, PROTOCOL_VERSION, ProgressReport, ShadowSpec,
    SyncArch, WorkerAssignment, WorkerPhase, WorkerProgressLine, WorkerState,
    jobspec::{GPU_SPEED_ENV as GPU_SPEED_VAR, SHADOW_ENV},
};
use futures::StreamExt;
use governor::clock::{Clock, DefaultClock};
use governor::{Quota, RateLimiter};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::num::NonZeroU32;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, LinesCodec, LinesCodecError};

/// What the agent counts of its workers' progress lines (totals since it started).
#[derive(Debug, Default)]
struct LineCounters {
    /// Lines that are not a valid progress line, or too long.
    malformed: AtomicU64,
    /// Lines whose gradient statistics were bad (the rest reported).
    ignored_gradient: AtomicU64,
    /// Reports dropped because the outbox was full (its channel, or the job's queue
    /// there) or given up after their retries (the outbox task counts those through
    /// [`Supervisor::outbox_drops`]).
    dropped: Arc<AtomicU64>,
    /// Worker events dropped because the outbox was full (best effort; logged).
    dropped_events: AtomicU64,
    /// Reports replaced by a newer one of the same worker while over its rate limit.
    coalesced: AtomicU64,
}

/// Most progress reports one worker sends per second, on average; above it, each report
/// replaces the one waiting and the latest goes out when the rate allows (step, samples
/// and loss are cumulative, so only intermediate curve points are lost, and counted). A
/// flooding worker thus costs its own job some curve points and no other job anything.
/// converge-trainer's default (a report every 5 steps) stays well below it.
pub const REPORTS_PER_S: u32 = 50;
/// Reports one worker may send at once above [`REPORTS_PER_S`] (a burst after a pause).
pub const REPORT_BURST: u32 = 100;
/// Most progress reports one job's workers on this host send per second together, on
/// average, whatever their number: a report must pass its worker's limit and then its
/// job's, and waits (replaced by newer ones, as above) for whichever is exhausted. Eight
/// workers of converge-trainer at its default stay below it.
pub const JOB_REPORTS_PER_S: u32 = 100;
/// Reports one job's workers on this host may send at once above [`JOB_REPORTS_PER_S`].
pub const JOB_REPORT_BURST: u32 = 200;

/// The rate limit one job's workers on this host share ([`JOB_REPORTS_PER_S`]).
type JobLimiter = governor::DefaultDirectRateLimiter;

/// Longest stdout line kept, in bytes; longer lines are counted as malformed and skipped.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Supervision settings.
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    pub host: HostId,
    /// Worker logs go to `<log_dir>/<job>/gen<generation>-rank<rank>.log`.
    pub log_dir: PathBuf,
    /// `CONVERGE_CHECKPOINT_DIR` of a worker is `<checkpoint_root>/<job>`.
    pub checkpoint_root: PathBuf,
    /// Time between SIGTERM and SIGKILL.
    pub stop_grace: Duration,
    /// First restart delay of a crashed worker; doubles per restart up to `backoff_cap`.
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// The agent binary to start workers through (`worker-shim` mode); `None`: directly.
    pub worker_shim: Option<PathBuf>,
    /// Where the live workers' process groups are recorded; `None`: nowhere.
    pub state_file: Option<PathBuf>,
    /// The fake GPUs' relative speed (`--fake-gpu-speed`), given to workers as
    /// `CONVERGE_GPU_SPEED`; `None` (real GPUs, or not set): the variable is unset.
    pub gpu_speed: Option<f64>,
    /// The variables of the agent's environment workers inherit (`--worker-env`).
    pub worker_env: EnvAllowList,
    /// The user ids jobs' workers run under, one per job (`--worker-uids`); `None`: the
    /// agent's own user.
    pub worker_uids: Option<UidRange>,
    /// The cgroup v2 directory each worker gets a cgroup of its own in
    /// (`--worker-cgroup`); `None`: no cgroups.
    pub worker_cgroup: Option<PathBuf>,
}

/// Something for the outbox task to publish.
#[derive(Debug)]
pub enum Outgoing {
    Progress(ProgressReport),
    Event(Event),
}

/// A worker process ended.
#[derive(Debug)]
pub struct ExitNotice {
    pub key: WorkerKey,
    /// Which start of the worker this was (restarts bump it), so late notices are ignored.
    pub incarnation: u64,
    pub status: std::io::Result<std::process::ExitStatus>,
}

#[derive(Debug)]
struct Worker {
    assignment: WorkerAssignment,
    phase: WorkerPhase,
    pid: Option<u32>,
    /// Start time of `pid` (clock ticks after boot), for the state file.
    start_ticks: Option<u64>,
    restarts: u32,
    last_exit_code: Option<i32>,
    restart_at: Option<Instant>,
    kill_at: Option<Instant>,
    incarnation: u64,
    /// The user id its current start runs under (`--worker-uids`).
    uid: Option<u32>,
}

/// Owns the host's worker processes.
#[derive(Debug)]
pub struct Supervisor {
    cfg: SupervisorConfig,
    /// Time between SIGTERM and SIGKILL of the stops decided now: `cfg.stop_grace`, or the
    /// shorter fence grace while the agent is fenced ([`Supervisor::fence`]).
    grace: Duration,
    plan: Vec<WorkerAssignment>,
    workers: BTreeMap<WorkerKey, Worker>,
    exit_tx: mpsc::Sender<ExitNotice>,
    outbox: mpsc::Sender<Outgoing>,
    counters: Arc<LineCounters>,
    /// Each job's shared rate limit, held by its workers' line readers: a job's entry
    /// goes when the last of them ends.
    job_limiters: BTreeMap<JobId, std::sync::Weak<JobLimiter>>,
    incarnations: u64,
    boot_id: String,
}

impl Supervisor {
    pub fn new(
        cfg: SupervisorConfig,
        exit_tx: mpsc::Sender<ExitNotice>,
        outbox: mpsc::Sender<Outgoing>,
    ) -> Self {
        Self {
            grace: cfg.stop_grace,
            cfg,
            plan: Vec::new(),
            workers: BTreeMap::new(),
            exit_tx,
            outbox,
            counters: Arc::default(),
            job_limiters: BTreeMap::new(),
            incarnations: 0,
            boot_id: crate::strays::boot_id(),
        }
    }

    /// The rate limit `job`'s workers on this host share: the one its running workers
    /// hold, or a new one.
    fn job_limiter(&mut self, job: &JobId) -> Arc<JobLimiter> {
        self.job_limiters.retain(|_, l| l.strong_count() > 0);
        if let Some(l) = self
            .job_limiters
            .get(job)
            .and_then(std::sync::Weak::upgrade)
        {
            return l;
        }
        let l = Arc::new(RateLimiter::direct(
            Quota::per_second(NonZeroU32::new(JOB_REPORTS_PER_S).expect("positive"))
                .allow_burst(NonZeroU32::new(JOB_REPORT_BURST).expect("positive")),
        ));
        self.job_limiters.insert(job.clone(), Arc::downgrade(&l));
        l
    }

    /// Malformed `CONVERGE_PROGRESS` lines seen so far.
    pub fn malformed_lines(&self) -> u64 {
        self.counters.malformed.load(Ordering::Relaxed)
    }

    /// The counter the outbox task adds its own drops to (a job's queue full, a report
    /// given up after its retries): part of [`Supervisor::skipped_reports`].
    pub fn outbox_drops(&self) -> Arc<AtomicU64> {
        self.counters.dropped.clone()
    }

    /// Progress reports not sent so far: replaced by a newer one of the same worker over
    /// its rate limit ([`REPORTS_PER_S`]), dropped because the outbox (its channel, or the
    /// job's queue there) was full, or given up after 30 s of retries.
    pub fn skipped_reports(&self) -> u64 {
        self.counters.coalesced.load(Ordering::Relaxed)
            + self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Progress lines whose gradient statistics were dropped (one of the pair missing, not
    /// a number, negative or both 0) so far; their other figures were reported.
    pub fn ignored_gradient_stats(&self) -> u64 {
        self.counters.ignored_gradient.load(Ordering::Relaxed)
    }

    /// Replaces the desired workers (the latest plan).
    pub fn set_plan(&mut self, plan: Vec<WorkerAssignment>) {
        self.plan = plan;
    }

    /// Self-fencing: stops every worker (at the next [`Supervisor::reconcile`]) with at most
    /// `grace` between SIGTERM and SIGKILL (the stop grace when that is shorter), so that
    /// they are gone before the allocator places their jobs elsewhere. Workers already
    /// stopping keep their deadline if it is sooner and get `grace` otherwise.
    pub fn fence(&mut self, grace: Duration, now: Instant) {
        self.grace = grace.min(self.cfg.stop_grace);
        self.plan = Vec::new();
        let latest = now + self.grace;
        for w in self.workers.values_mut() {
            if let Some(at) = w.kill_at.as_mut() {
                *at = (*at).min(latest);
            }
        }
    }

    /// Back from a fence: stops decided from now on get the stop grace again.
    pub fn unfence(&mut self) {
        self.grace = self.cfg.stop_grace;
    }

    /// Whether no worker process is alive.
    pub fn all_stopped(&self) -> bool {
        self.workers.values().all(|w| !w.phase.is_alive())
    }

    /// Worker states for telemetry, and the GPUs held by running workers.
    pub fn snapshot(&self) -> (Vec<WorkerState>, BTreeSet<u32>) {
        let states = self
            .workers
            .iter()
            .map(|(k, w)| WorkerState {
                job: k.job.clone(),
                generation: k.generation,
                rank: k.rank,
                phase: w.phase,
                pid: w.pid,
                restarts: w.restarts,
                last_exit_code: w.last_exit_code,
                gpus: w.assignment.gpus.clone(),
            })
            .collect();
        let busy = self
            .workers
            .values()
            .filter(|w| w.phase == WorkerPhase::Running)
            .flat_map(|w| w.assignment.gpus.iter().copied())
            .collect();
        (states, busy)
    }

    /// Moves the workers one step towards the plan. Returns whether anything changed.
    pub fn reconcile(&mut self) -> bool {
        let now = Instant::now();
        let views: BTreeMap<WorkerKey, WorkerView> = self
            .workers
            .iter()
            .map(|(k, w)| {
                (
                    k.clone(),
                    WorkerView {
                        phase: w.phase,
                        gpus: w.assignment.gpus.clone(),
                        restart_at: w.restart_at,
                        kill_at: w.kill_at,
                    },
                )
            })
            .collect();
        let actions = decide(&self.plan, &views, now);
        let changed = !actions.is_empty();
        for action in actions {
            match action {
                Action::Start(key) => self.start(key),
                Action::Terminate(key) => self.signal(&key, Signal::SIGTERM, now),
                Action::Kill(key) => self.signal(&key, Signal::SIGKILL, now),
                Action::Forget(key) => {
                    self.workers.remove(&key);
                }
            }
        }
        changed
    }

    /// Stops every worker (used on agent shutdown): the plan becomes empty.
    pub fn stop_all(&mut self) {
        self.plan.clear();
        self.reconcile();
    }

    fn start(&mut self, key: WorkerKey) {
        let Some(assignment) = self.plan.iter().find(|a| WorkerKey::of(a) == key).cloned() else {
            return;
        };
        self.incarnations += 1;
        let incarnation = self.incarnations;
        let entry = self.workers.entry(key.clone()).or_insert_with(|| Worker {
            assignment: assignment.clone(),
            phase: WorkerPhase::Running,
            pid: None,
            start_ticks: None,
            restarts: 0,
            last_exit_code: None,
            restart_at: None,
            kill_at: None,
            incarnation,
            uid: None,
        });
        entry.assignment = assignment.clone();
        entry.phase = WorkerPhase::Running;
        entry.restart_at = None;
        entry.kill_at = None;
        entry.incarnation = incarnation;
        entry.pid = None;
        entry.start_ticks = None;
        entry.uid = None;
        let uid = match self.worker_uid(&key) {
            Ok(uid) => uid,
            Err(e) => {
                tracing::error!(worker = %key, "cannot start worker: {e}");
                self.exit_soon(key, incarnation, 126);
                return;
            }
        };
        if let Some(w) = self.workers.get_mut(&key) {
            w.uid = uid;
        }
        let cgroup = match &self.cfg.worker_cgroup {
            Some(root) => match WorkerCgroup::create(
                root,
                key.job.as_str(),
                key.generation,
                key.rank,
                incarnation,
            ) {
                Ok(cg) => Some(cg),
                Err(e) => {
                    tracing::error!(worker = %key, root = %root.display(), "cannot make the worker's cgroup: {e}; not started");
                    self.exit_soon(key, incarnation, 125);
                    return;
                }
            },
            None => None,
        };
        let job_limiter = self.job_limiter(&key.job);
        let Some(entry) = self.workers.get_mut(&key) else {
            return;
        };

        match spawn_worker(
            &self.cfg,
            &assignment,
            uid,
            cgroup.as_ref(),
            Reporting {
                outbox: self.outbox.clone(),
                counters: self.counters.clone(),
                job_limiter,
            },
        ) {
            Ok((mut child, lifeline)) => {
                let pid = child.id().unwrap_or(0);
                entry.pid = Some(pid);
                entry.start_ticks = crate::strays::read_stat(pid).map(|s| s.start_ticks);
                tracing::info!(worker = %key, pid, gpus = ?assignment.gpus, "worker started");
                self.emit(
                    EventKind::WorkerStarted {
                        job: key.job.clone(),
                        generation: key.generation,
                        rank: key.rank,
                        pid,
                    },
                    format!("started {key} as pid {pid} on {}", self.cfg.host),
                );
                let exit_tx = self.exit_tx.clone();
                tokio::spawn(async move {
                    let status = child.wait().await;
                    // The shim has exited: its lifeline can close.
                    drop(lifeline);
                    // Whatever the worker left running (setsid, daemons) goes before its
                    // exit counts, so no process of this start outlives it.
                    if let Some(cg) = cgroup {
                        end_cgroup(&key, &cg).await;
                    }
                    let _ = exit_tx
                        .send(ExitNotice {
                            key,
                            incarnation,
                            status,
                        })
                        .await;
                });
                self.save_state();
            }
            Err(e) => {
                tracing::error!(worker = %key, command = ?assignment.command, "cannot start worker: {e}");
                if let Some(cg) = cgroup {
                    let _ = std::fs::remove_dir(&cg.path);
                }
                // Treat a failed spawn as an exit with code 127 (command not runnable), so it
                // goes through the same backoff and failure accounting.
                self.exit_soon(key, incarnation, 127);
            }
        }
    }

    /// Reports an exit with `code` for a start that could not happen, so that it goes
    /// through the same backoff and failure accounting as a crash.
    fn exit_soon(&self, key: WorkerKey, incarnation: u64, code: i32) {
        let exit_tx = self.exit_tx.clone();
        tokio::spawn(async move {
            let _ = exit_tx
                .send(ExitNotice {
                    key,
                    incarnation,
                    status: Ok(std::process::ExitStatus::from_raw(code << 8)),
                })
                .await;
        });
    }

    /// The user id `key`'s worker runs under: its job's on this host when another of its
    /// workers runs, else [`UidRange::uid_for`] among the ids other jobs here do not hold.
    /// `Ok(None)`: no `--worker-uids`. `Err`: every id of the range is taken.
    fn worker_uid(&self, key: &WorkerKey) -> Result<Option<u32>, String> {
        let Some(range) = self.cfg.worker_uids else {
            return Ok(None);
        };
        if let Some(uid) = self
            .workers
            .iter()
            .find(|(k, w)| k.job == key.job && w.uid.is_some())
            .and_then(|(_, w)| w.uid)
        {
            return Ok(Some(uid));
        }
        let taken = |uid: u32| {
            self.workers
                .iter()
                .any(|(k, w)| k.job != key.job && w.uid == Some(uid))
        };
        range
            .uid_for(key.job.as_str(), taken)
            .map(Some)
            .ok_or_else(|| {
                format!(
                    "all {} user ids of --worker-uids are held by other jobs on this host",
                    range.count()
                )
            })
    }

    fn signal(&mut self, key: &WorkerKey, signal: Signal, now: Instant) {
        let Some(w) = self.workers.get_mut(key) else {
            return;
        };
        if signal == Signal::SIGTERM {
            w.phase = WorkerPhase::Stopping;
            w.kill_at = Some(now + self.grace);
            tracing::info!(worker = %key, "stopping worker (SIGTERM to its process group)");
        } else {
            // Do not send SIGKILL again on every reconcile while the exit is being reaped.
            w.kill_at = None;
            tracing::warn!(worker = %key, grace = ?self.grace, "worker ignored SIGTERM for the grace period; SIGKILL");
        }
        if let Some(pid) = w.pid.filter(|&p| p > 0)
            && let Err(e) = killpg(Pid::from_raw(pid as i32), signal)
        {
            tracing::debug!(worker = %key, pid, "killpg {signal}: {e}");
        }
    }

    /// Records a worker's exit: planned workers that exit 0 succeed; non-zero exits go to
    /// backoff until the restart limit, then fail; stopped workers are forgotten.
    pub fn on_exit(&mut self, notice: ExitNotice) {
        let Some(w) = self.workers.get_mut(&notice.key) else {
            return;
        };
        if w.incarnation != notice.incarnation {
            return;
        }
        let (code, signal) = match &notice.status {
            Ok(s) => (s.code(), s.signal()),
            Err(e) => {
                tracing::error!(worker = %notice.key, "cannot wait for worker: {e}");
                (None, None)
            }
        };
        let key = notice.key;
        w.pid = None;
        w.start_ticks = None;
        w.last_exit_code = code;
        let exited = EventKind::WorkerExited {
            job: key.job.clone(),
            generation: key.generation,
            rank: key.rank,
            code,
            signal,
        };
        let how = match (code, signal) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(s)) => format!("signal {s}"),
            _ => "unknown status".to_string(),
        };
        match w.phase {
            WorkerPhase::Stopping => {
                tracing::info!(worker = %key, "worker stopped ({how})");
                self.workers.remove(&key);
                self.emit(exited, format!("{key} stopped ({how})"));
            }
            _ if code == Some(0) => {
                w.phase = WorkerPhase::Succeeded;
                tracing::info!(worker = %key, "worker finished successfully");
                self.emit(exited, format!("{key} finished (exit code 0)"));
            }
            _ if w.restarts < w.assignment.max_restarts => {
                let delay = restart_delay(w.restarts, self.cfg.backoff_base, self.cfg.backoff_cap);
                w.restarts += 1;
                w.phase = WorkerPhase::Backoff;
                w.restart_at = Some(Instant::now() + delay);
                let restarts = w.restarts;
                tracing::warn!(worker = %key, restarts, ?delay, "worker crashed ({how}); restarting after backoff");
                self.emit(
                    exited,
                    format!("{key} crashed ({how}); restart {restarts} in {delay:?}"),
                );
            }
            _ => {
                w.phase = WorkerPhase::Failed;
                let restarts = w.restarts;
                tracing::error!(worker = %key, restarts, "worker crashed ({how}) after its last allowed restart; giving up");
                self.emit(
                    EventKind::WorkerFailed {
                        job: key.job.clone(),
                        generation: key.generation,
                        rank: key.rank,
                        restarts,
                    },
                    format!("{key} failed ({how}) after {restarts} restarts"),
                );
            }
        }
        self.save_state();
    }

    /// Rewrites the state file with the workers alive now.
    fn save_state(&self) {
        let Some(path) = &self.cfg.state_file else {
            return;
        };
        let file = crate::strays::StateFile {
            boot_id: self.boot_id.clone(),
            workers: self
                .workers
                .iter()
                .filter_map(|(k, w)| {
                    Some(crate::strays::Recorded {
                        job: k.job.as_str().to_string(),
                        generation: k.generation,
                        rank: k.rank,
                        pid: w.pid.filter(|&p| p > 1)?,
                        start_ticks: w.start_ticks?,
                    })
                })
                .collect(),
        };
        if let Err(e) = file.write(path) {
            tracing::error!(path = %path.display(), "cannot write the worker state file: {e}; a restarted agent will not find these workers");
        }
    }

    fn emit(&self, kind: EventKind, message: String) {
        let event = Event::new(
            unix_now(),
            format!("agent/{}", self.cfg.host),
            kind,
            message,
        );
        if self.outbox.try_send(Outgoing::Event(event)).is_err() {
            let n = self.counters.dropped_events.fetch_add(1, Ordering::Relaxed) + 1;
            tracing::warn!(dropped_total = n, "outbox full; worker event dropped");
        }
    }
}

fn log_path(cfg: &SupervisorConfig, a: &WorkerAssignment) -> PathBuf {
    cfg.log_dir
        .join(a.job.as_str())
        .join(format!("gen{}-rank{}.log", a.generation, a.rank))
}

/// The report for one parsed progress line of a worker: the line as the worker sent it
/// (the sync time, model size and a shadow job's sync rounds per second and model gap
/// included), except that its gradient statistics are kept only when both are valid, on the
/// worker's `base` (job, generation, rank, host, workers, hosts), read at `time` (UNIX
/// seconds).
fn progress_report(base: &ProgressReport, mut p: WorkerProgressLine, time: f64) -> ProgressReport {
    let gradient = p.gradient().valid();
    p.grad_sqr = gradient.map(|(s, _)| s);
    p.grad_var = gradient.map(|(_, v)| v);
    ProgressReport {
        line: p,
        time,
        ..base.clone()
    }
}

/// The batch variables of the worker contract, set for `[batch]` jobs only.
const BATCH_VARS: [&str; 4] = converge_common::contract::BATCH_ENV;

/// The worker-contract environment of assignment `a` (docs/protocol.md, "Worker
/// contract"): the variables to set, which override the job spec's `env`, and those to
/// remove from the inherited environment. The contract's one definition is
/// `converge_common::contract::VARIABLES`; a test checks that this sets exactly the
/// variables the table gives each kind of job and removes the rest of its conditional ones.
///
/// torchrun's variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
/// `MASTER_ADDR`, `MASTER_PORT`, `ROLE_RANK` (= `RANK`: every rank has the one role),
/// `TORCHELASTIC_RUN_ID` (the job id), `TORCHELASTIC_RESTART_COUNT` (the generation) and
/// `GROUP_RANK`, the plan's node rank (this host's index among the job's hosts, by the
/// lowest rank each runs, as torchrun numbers nodes). A plan from an allocator older than
/// the field gives none; `GROUP_RANK` is then the lowest rank on this host, `RANK −
/// LOCAL_RANK` (0 on rank 0's host and distinct between hosts, as placement gives each host
/// a contiguous block of ranks). `TORCH_NCCL_ASYNC_ERROR_HANDLING`
/// is 1, so that NCCL errors abort the worker instead of hanging it; a job's own `env`
/// cannot override the contract's variables but can set this one (it is left alone when
/// the spec sets it).
fn worker_env(
    a: &WorkerAssignment,
    checkpoint_dir: &std::path::Path,
    gpu_speed: Option<f64>,
) -> (Vec<(&'static str, OsString)>, Vec<&'static str>) {
    let gpus: Vec<String> = a.gpus.iter().map(u32::to_string).collect();
    let mut set: Vec<(&'static str, OsString)> = [
        ("RANK", a.rank.to_string()),
        ("WORLD_SIZE", a.world_size.to_string()),
        ("LOCAL_RANK", a.local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", a.local_world_size.to_string()),
        (
            "GROUP_RANK",
            a.node_rank
                .unwrap_or_else(|| a.rank.saturating_sub(a.local_rank))
                .to_string(),
        ),
        ("ROLE_RANK", a.rank.to_string()),
        ("MASTER_ADDR", a.master_addr.clone()),
        ("MASTER_PORT", a.master_port.to_string()),
        ("TORCHELASTIC_RUN_ID", a.job.as_str().to_string()),
        ("TORCHELASTIC_RESTART_COUNT", a.generation.to_string()),
        ("CUDA_VISIBLE_DEVICES", gpus.join(",")),
        ("CONVERGE_JOB_ID", a.job.as_str().to_string()),
        ("CONVERGE_GENERATION", a.generation.to_string()),
        ("CONVERGE_NUM_PS", a.num_ps.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k, OsString::from(v)))
    .collect();
    set.push((
        "CONVERGE_CHECKPOINT_DIR",
        checkpoint_dir.as_os_str().to_owned(),
    ));
    if !a.env.contains_key("TORCH_NCCL_ASYNC_ERROR_HANDLING") {
        set.push(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1".into()));
    }
    // The batch of `[batch]` jobs; unset otherwise, so that the program keeps its own.
    let unset = match &a.batch {
        Some(b) => {
            let values = [b.per_worker, b.accum_steps, b.total, b.reference];
            set.extend(
                BATCH_VARS
                    .into_iter()
                    .zip(values.map(|v| OsString::from(v.to_string()))),
            );
            Vec::new()
        }
        None => BATCH_VARS.to_vec(),
    };
    // The sync architecture, and a shadow job's `[shadow]` table: the parameters it gives,
    // the others unset so that the program's defaults apply.
    let mut unset = unset;
    match gpu_speed {
        Some(speed) => set.push((GPU_SPEED_VAR, speed.to_string().into())),
        None => unset.push(GPU_SPEED_VAR),
    }
    let sync = if a.shadow.is_some() {
        SyncArch::Shadow
    } else if a.num_ps > 0 {
        SyncArch::Ps
    } else {
        SyncArch::Ring
    };
    set.push(("CONVERGE_SYNC", sync.as_str().into()));
    let shadow = a.shadow.as_ref().map(ShadowSpec::env).unwrap_or_default();
    for name in SHADOW_ENV {
        match shadow.iter().find(|(k, _)| *k == name) {
            Some((k, v)) => set.push((k, OsString::from(v))),
            None => unset.push(name),
        }
    }
    (set, unset)
}

/// The program to start the shim as: `/proc/self/exe` (the binary's choice) is replaced by
/// the file it names, so that the shim's `comm` (`ps`, `top`) reads `converge-agent`, not
/// `exe`, unless that file was deleted or replaced (an upgrade) since the agent started.
fn shim_program(shim: &std::path::Path) -> PathBuf {
    if shim == std::path::Path::new("/proc/self/exe")
        && let Ok(target) = std::fs::read_link(shim)
        && !target.to_string_lossy().ends_with(" (deleted)")
    {
        return target;
    }
    shim.to_path_buf()
}

/// Kills and removes a worker's cgroup once its shim has exited, logging the processes the
/// worker left behind.
async fn end_cgroup(key: &WorkerKey, cg: &WorkerCgroup) {
    match cg.kill_and_remove(CGROUP_KILL_WAIT).await {
        Ok(0) => {}
        Ok(n) => {
            tracing::warn!(worker = %key, processes = n, "killed the processes the worker left running (its cgroup)")
        }
        Err(e) => {
            tracing::error!(worker = %key, cgroup = %cg.path.display(), "cannot end the worker's cgroup: {e}")
        }
    }
}

/// How long the agent waits for a killed worker cgroup to empty.
const CGROUP_KILL_WAIT: Duration = Duration::from_secs(10);

/// Where a worker's progress reports go: the outbox, the host's counters, and its job's
/// shared rate limit ([`JOB_REPORTS_PER_S`]).
struct Reporting {
    outbox: mpsc::Sender<Outgoing>,
    counters: Arc<LineCounters>,
    job_limiter: Arc<JobLimiter>,
}

/// Starts one worker process in its own process group (through the shim, which leads the
/// group, when configured), with the worker-contract environment, stderr appended to its
/// log file and stdout read line by line. Returns the child (the shim, or the worker) and
/// the write end of its lifeline, to hold until the child is reaped.
fn spawn_worker(
    cfg: &SupervisorConfig,
    a: &WorkerAssignment,
    uid: Option<u32>,
    cgroup: Option<&WorkerCgroup>,
    reporting: Reporting,
) -> std::io::Result<(tokio::process::Child, Option<std::io::PipeWriter>)> {
    let Reporting {
        outbox,
        counters,
        job_limiter,
    } = reporting;
    let log_file = log_path(cfg, a);
    crate::isolation::prepare_private_dir(
        log_file.parent().expect("log path has a parent"),
        uid.is_some(),
    )?;
    let checkpoint_dir = cfg.checkpoint_root.join(a.job.as_str());
    crate::isolation::prepare_checkpoint_dir(&checkpoint_dir, uid)?;
    let stderr_log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_file)?;

    let (mut cmd, lifeline) = match &cfg.worker_shim {
        Some(shim) => {
            let mut cmd = tokio::process::Command::new(shim_program(shim));
            let procs = cgroup.map(WorkerCgroup::procs_file);
            cmd.arg0("converge-agent").args(crate::shim::shim_args(
                cfg.stop_grace,
                procs.as_deref(),
                uid,
                &a.command,
            ));
            // Close-on-exec on both ends: no other child inherits the write end.
            let (read, write) = std::io::pipe()?;
            cmd.stdin(Stdio::from(read));
            (cmd, Some(write))
        }
        None => {
            let mut cmd = tokio::process::Command::new(&a.command[0]);
            cmd.args(&a.command[1..]).stdin(Stdio::null());
            if let Some(uid) = uid {
                cmd.uid(uid).gid(uid);
            }
            (cmd, None)
        }
    };
    // An explicit environment: the allowed part of the agent's (never its NATS settings or
    // credentials), the job's `env`, the contract. A job's `env` may set any name.
    cmd.env_clear()
        .envs(cfg.worker_env.inherited(std::env::vars_os()))
        .envs(&a.env)
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr_log))
        .process_group(0)
        .kill_on_drop(false);
    let (set, unset) = worker_env(a, &checkpoint_dir, cfg.gpu_speed);
    cmd.envs(set);
    for k in unset {
        cmd.env_remove(k);
    }
    let mut child = cmd.spawn()?;
    drop(cmd);
    // Without the shim (library use) the worker joins its cgroup just after it started.
    if cfg.worker_shim.is_none()
        && let (Some(cg), Some(pid)) = (cgroup, child.id())
    {
        std::fs::write(cg.procs_file(), pid.to_string())?;
    }
    let stdout = child.stdout.take().expect("stdout is piped");
    let report_base = ProgressReport {
        protocol: PROTOCOL_VERSION,
        job: a.job.clone(),
        generation: a.generation,
        rank: a.rank,
        host: cfg.host.clone(),
        line: WorkerProgressLine::new(0, 0, 0.0),
        time: 0.0,
        workers: Some(a.world_size.saturating_sub(a.num_ps)),
        hosts: (a.hosts > 0).then_some(a.hosts),
    };
    tokio::spawn(async move {
        let mut log = match tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_file)
            .await
        {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!(path = %log_file.display(), "cannot open worker log: {e}");
                None
            }
        };
        let mut lines = FramedRead::new(stdout, LinesCodec::new_with_max_length(MAX_LINE_BYTES));
        let limiter = RateLimiter::direct(
            Quota::per_second(NonZeroU32::new(REPORTS_PER_S).expect("positive"))
                .allow_burst(NonZeroU32::new(REPORT_BURST).expect("positive")),
        );
        let clock = DefaultClock::default();
        // When the rate limit lets a report out, from now.
        let free_at = |not_until: governor::NotUntil<_>| {
            tokio::time::Instant::now() + not_until.wait_time_from(clock.now())
        };
        // The worker's limit, then the job's (a report the job's limit holds back has
        // used one of the worker's: the job's workers share the job's rate, each at most
        // its own).
        let admit = || {
            limiter.check().map_err(free_at)?;
            job_limiter.check().map_err(free_at)
        };
        // The newest report over the rate limit, and when the limit lets it out.
        let mut waiting: Option<(ProgressReport, tokio::time::Instant)> = None;
        let send = |report: ProgressReport| {
            if outbox.try_send(Outgoing::Progress(report)).is_err() {
                counters.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(job = %report_base.job, "outbox full; progress report dropped");
            }
        };
        loop {
            let due = waiting.as_ref().map(|(_, at)| *at);
            let next = tokio::select! {
                line = lines.next() => line,
                () = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {
                    match admit() {
                        Ok(()) => {
                            if let Some((report, _)) = waiting.take() {
                                send(report);
                            }
                        }
                        Err(free) => {
                            if let Some((_, at)) = waiting.as_mut() {
                                *at = free;
                            }
                        }
                    }
                    continue;
                }
            };
            let Some(line) = next else { break };
            let line = match line {
                Ok(l) => l,
                Err(LinesCodecError::MaxLineLengthExceeded) => {
                    counters.malformed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(job = %report_base.job, rank = report_base.rank, "worker printed a line over {MAX_LINE_BYTES} bytes; skipped");
                    continue;
                }
                Err(LinesCodecError::Io(e)) => {
                    tracing::debug!("worker stdout closed: {e}");
                    break;
                }
            };
            if let Some(f) = log.as_mut() {
                let _ = f.write_all(line.as_bytes()).await;
                let _ = f.write_all(b"\n").await;
            }
            match WorkerProgressLine::parse(&line) {
                Ok(None) => {}
                Ok(Some(p)) => {
                    if p.gradient() == GradientReading::Invalid {
                        let n = counters.ignored_gradient.fetch_add(1, Ordering::Relaxed) + 1;
                        tracing::warn!(job = %report_base.job, rank = report_base.rank, ignored_total = n, grad_sqr = ?p.grad_sqr, grad_var = ?p.grad_var, "progress line with bad gradient statistics (missing one, not a number, negative or both 0): statistics ignored, the rest reported");
                    }
                    let report = progress_report(&report_base, p, unix_now());
                    if let Some((old, _)) = waiting.as_mut() {
                        *old = report;
                        let n = counters.coalesced.fetch_add(1, Ordering::Relaxed) + 1;
                        if n.is_power_of_two() {
                            tracing::warn!(job = %report_base.job, rank = report_base.rank, coalesced_total = n, "worker reports progress faster than {REPORTS_PER_S} lines/s (or its job's workers on this host faster than {JOB_REPORTS_PER_S} together): the newest report replaces the one waiting");
                        }
                    } else {
                        match admit() {
                            Ok(()) => send(report),
                            Err(free) => waiting = Some((report, free)),
                        }
                    }
                }
                Err(e) => {
                    let n = counters.malformed.fetch_add(1, Ordering::Relaxed) + 1;
                    let shown: String = line.chars().take(200).collect();
                    tracing::warn!(job = %report_base.job, rank = report_base.rank, malformed_total = n, line = %shown, "malformed progress line: {e}");
                }
            }
        }
        // The worker's last report goes out even over the limit: it holds its final step.
        if let Some((report, _)) = waiting.take() {
            send(report);
        }
        if let Some(f) = log.as_mut() {
            let _ = f.flush().await;
        }
    });
    Ok((child, lifeline))
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_common::{JobId, Message};

    fn assignment(rank: u32, local_rank: u32, local_world_size: u32) -> WorkerAssignment {
        WorkerAssignment {
            job: JobId::new("mnist-ddp").unwrap(),
            generation: 7,
            rank,
            world_size: 4,
            local_rank,
            local_world_size,
            gpus: vec![2, 3],
            master_addr: "10.0.0.5".into(),
            master_port: 23456,
            command: vec!["python3".into()],
            env: BTreeMap::new(),
            max_restarts: 3,
            num_ps: 0,
            hosts: 2,
            batch: None,
            node_rank: None,
            shadow: None,
        }
    }

    fn env_map(a: &WorkerAssignment) -> (BTreeMap<&'static str, String>, Vec<&'static str>) {
        let (set, unset) = worker_env(a, std::path::Path::new("/ckpt/mnist-ddp"), None);
        let map: BTreeMap<_, _> = set
            .into_iter()
            .map(|(k, v)| (k, v.into_string().unwrap()))
            .collect();
        (map, unset)
    }

    #[test]
    fn worker_env_has_the_contract_and_torchruns_variables() {
        let mut a = assignment(3, 1, 2);
        a.batch = Some(converge_common::AssignedBatch {
            total: 96,
            per_worker: 12,
            accum_steps: 1,
            reference: 64,
        });
        let (env, unset) = env_map(&a);
        let expect = [
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "2"),
            ("ROLE_RANK", "3"),
            ("MASTER_ADDR", "10.0.0.5"),
            ("MASTER_PORT", "23456"),
            ("TORCHELASTIC_RUN_ID", "mnist-ddp"),
            ("TORCHELASTIC_RESTART_COUNT", "7"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ("CUDA_VISIBLE_DEVICES", "2,3"),
            ("CONVERGE_JOB_ID", "mnist-ddp"),
            ("CONVERGE_GENERATION", "7"),
            ("CONVERGE_CHECKPOINT_DIR", "/ckpt/mnist-ddp"),
            ("CONVERGE_NUM_PS", "0"),
            ("CONVERGE_BATCH_SIZE", "12"),
            ("CONVERGE_ACCUM_STEPS", "1"),
            ("CONVERGE_TOTAL_BATCH", "96"),
            ("CONVERGE_REFERENCE_BATCH", "64"),
            ("CONVERGE_SYNC", "ring"),
        ];
        let got: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut want = expect.to_vec();
        want.sort();
        assert_eq!(got, want);
        assert_eq!(unset[0], GPU_SPEED_VAR, "real GPUs: no speed");
        assert_eq!(unset[1..], SHADOW_ENV);
    }

    /// `worker_env` against the contract's table (`converge_common::contract`): for a batch
    /// job, a parameter-server job (a worker and a shard), a shadow job, a fake GPU's
    /// speed and a spec that sets the NCCL setting itself, exactly the table's variables
    /// that apply to the job are set (once each), the table's other conditional ones are
    /// removed, and no name outside the table is set or removed.
    #[test]
    fn worker_env_sets_exactly_the_contract_tables_variables() {
        use converge_common::contract::{VARIABLES, When};
        let mut batch = assignment(3, 1, 2);
        batch.batch = Some(converge_common::AssignedBatch {
            total: 96,
            per_worker: 12,
            accum_steps: 1,
            reference: 64,
        });
        let mut ps_worker = assignment(0, 0, 2);
        ps_worker.num_ps = 1;
        let mut ps_shard = assignment(3, 1, 2);
        ps_shard.num_ps = 1;
        ps_shard.gpus = Vec::new();
        let mut shadow = assignment(0, 0, 1);
        shadow.shadow = Some(ShadowSpec {
            algorithm: converge_common::ShadowAlgorithm::Bmuf,
            block_momentum: Some(0.25),
            block_lr: None,
            block_nesterov: true,
            elastic_alpha: None,
            hogwild_threads: None,
        });
        let mut own_nccl = assignment(0, 0, 1);
        own_nccl
            .env
            .insert("TORCH_NCCL_ASYNC_ERROR_HANDLING".into(), "0".into());
        let cases = [
            ("batch job", batch, None),
            ("parameter-server job, worker", ps_worker, None),
            ("parameter-server job, shard", ps_shard, None),
            ("shadow job", shadow, None),
            ("fake GPU", assignment(0, 0, 1), Some(0.5)),
            ("spec's own NCCL setting", own_nccl, None),
        ];
        for (what, a, speed) in cases {
            let (set, unset) = worker_env(&a, std::path::Path::new("/ckpt/mnist-ddp"), speed);
            let set_names: BTreeSet<&str> = set.iter().map(|(k, _)| *k).collect();
            let unset_names: BTreeSet<&str> = unset.iter().copied().collect();
            assert_eq!(
                set_names.len(),
                set.len(),
                "{what}: a variable is set twice"
            );
            assert_eq!(unset_names.len(), unset.len(), "{what}: removed twice");
            let given: Vec<&str> = a
                .shadow
                .as_ref()
                .map(ShadowSpec::env)
                .unwrap_or_default()
                .into_iter()
                .map(|(k, _)| k)
                .collect();
            let (mut want_set, mut want_unset) = (BTreeSet::new(), BTreeSet::new());
            for v in VARIABLES {
                let applies = match v.when {
                    When::Always => true,
                    When::SpecDefault => !a.env.contains_key(v.name),
                    When::FakeGpuSpeed => speed.is_some(),
                    When::Batch => a.batch.is_some(),
                    When::Shadow => a.shadow.is_some(),
                    When::ShadowParameter => given.contains(&v.name),
                };
                if applies {
                    want_set.insert(v.name);
                } else if v.when != When::SpecDefault {
                    want_unset.insert(v.name);
                }
            }
            assert_eq!(set_names, want_set, "{what}: the variables set");
            assert_eq!(unset_names, want_unset, "{what}: the variables removed");
        }
        // A shard has no GPU: the variable is set, empty.
        let mut shard = assignment(3, 1, 2);
        shard.num_ps = 1;
        shard.gpus = Vec::new();
        let (env, _) = env_map(&shard);
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "");
        assert_eq!(env["CONVERGE_SYNC"], "ps");
    }

    #[test]
    fn worker_env_gives_a_fake_gpus_speed() {
        let a = assignment(0, 0, 1);
        let (set, unset) = worker_env(&a, std::path::Path::new("/c"), Some(0.25));
        assert!(set.iter().any(|(k, v)| *k == GPU_SPEED_VAR && v == "0.25"));
        assert!(!unset.contains(&GPU_SPEED_VAR));
    }

    #[test]
    fn worker_env_gives_a_shadow_job_its_table_and_unsets_the_rest() {
        let mut a = assignment(0, 0, 1);
        a.shadow = Some(ShadowSpec {
            algorithm: converge_common::ShadowAlgorithm::Bmuf,
            block_momentum: Some(0.25),
            block_lr: None,
            block_nesterov: true,
            elastic_alpha: None,
            hogwild_threads: Some(2),
        });
        let (env, unset) = env_map(&a);
        assert_eq!(env["CONVERGE_SYNC"], "shadow");
        assert_eq!(env["CONVERGE_SHADOW_ALGORITHM"], "bmuf");
        assert_eq!(env["CONVERGE_SHADOW_BLOCK_MOMENTUM"], "0.25");
        assert_eq!(env["CONVERGE_SHADOW_BLOCK_NESTEROV"], "true");
        assert_eq!(env["CONVERGE_SHADOW_HOGWILD_THREADS"], "2");
        assert!(unset.contains(&"CONVERGE_SHADOW_BLOCK_LR"));
        assert!(unset.contains(&"CONVERGE_SHADOW_ELASTIC_ALPHA"));
        assert!(!unset.contains(&"CONVERGE_SHADOW_ALGORITHM"));
        // A parameter-server job without a table.
        let mut ps = assignment(0, 0, 1);
        ps.num_ps = 1;
        ps.world_size = 2;
        assert_eq!(env_map(&ps).0["CONVERGE_SYNC"], "ps");
    }

    #[test]
    fn worker_env_unsets_the_batch_of_other_jobs_and_keeps_the_specs_nccl_setting() {
        let mut a = assignment(0, 0, 1);
        a.env
            .insert("TORCH_NCCL_ASYNC_ERROR_HANDLING".into(), "3".into());
        let (env, unset) = env_map(&a);
        assert!(!env.contains_key("TORCH_NCCL_ASYNC_ERROR_HANDLING"));
        assert!(!env.keys().any(|k| k.starts_with("CONVERGE_BATCH")));
        assert_eq!(&unset[..BATCH_VARS.len()], BATCH_VARS);
        assert_eq!(env["GROUP_RANK"], "0");
        // The plan's node rank wins over the fallback.
        let mut b = assignment(3, 1, 2);
        b.node_rank = Some(1);
        assert_eq!(env_map(&b).0["GROUP_RANK"], "1");
    }

    #[test]
    fn group_rank_is_zero_on_rank_zeros_host_and_distinct_across_hosts() {
        // Placements give each host a contiguous block of ranks (sched's placement): one
        // rank then three, two and two, three then one.
        for blocks in [&[1, 3][..], &[2, 2], &[3, 1], &[1, 1, 1, 1], &[4]] {
            let mut by_host: Vec<BTreeSet<String>> = Vec::new();
            let mut rank = 0;
            for &n in blocks {
                let mut groups = BTreeSet::new();
                for local in 0..n {
                    let (env, _) = env_map(&assignment(rank, local, n));
                    groups.insert(env["GROUP_RANK"].clone());
                    rank += 1;
                }
                assert_eq!(groups.len(), 1, "{blocks:?}: one GROUP_RANK per host");
                by_host.push(groups);
            }
            assert!(by_host[0].contains("0"), "{blocks:?}");
            let all: BTreeSet<_> = by_host.iter().flatten().collect();
            assert_eq!(
                all.len(),
                blocks.len(),
                "{blocks:?}: hosts share a GROUP_RANK"
            );
        }
    }

    #[test]
    fn progress_reports_carry_the_line_and_the_assignment() {
        let base = ProgressReport {
            protocol: PROTOCOL_VERSION,
            job: JobId::new("j").unwrap(),
            generation: 3,
            rank: 0,
            host: HostId::new("h").unwrap(),
            line: WorkerProgressLine::new(0, 0, 0.0),
            time: 0.0,
            workers: Some(4),
            hosts: Some(2),
        };
        let line = r#"CONVERGE_PROGRESS {"step":20,"samples":2560,"loss":0.4,"epoch":0.5,"sync_s":0.003,"model_bytes":5200}"#;
        let p = WorkerProgressLine::parse(line).unwrap().unwrap();
        let r = progress_report(&base, p, 12.5);
        assert_eq!(
            (r.line.step, r.line.samples, r.line.loss, r.line.epoch),
            (20, 2560, 0.4, Some(0.5))
        );
        assert_eq!(
            (r.line.sync_s, r.line.model_bytes),
            (Some(0.003), Some(5200))
        );
        assert_eq!(
            (r.workers, r.hosts, r.generation, r.time),
            (Some(4), Some(2), 3, 12.5)
        );
        assert!(r.validate().is_ok());
        // A worker that does not measure them: both absent.
        let p = WorkerProgressLine::parse(r#"CONVERGE_PROGRESS {"step":1,"samples":8,"loss":0.9}"#)
            .unwrap()
            .unwrap();
        let r = progress_report(&base, p, 1.0);
        assert_eq!((r.line.sync_s, r.line.model_bytes), (None, None));
        assert_eq!((r.line.grad_sqr, r.line.grad_var), (None, None));
        assert_eq!((r.line.sync_rounds_per_s, r.line.model_gap), (None, None));
        // A shadow worker's (converge-trainer --shadow) sync rounds and model gap.
        let p = WorkerProgressLine::parse(
            r#"CONVERGE_PROGRESS {"step":40,"samples":5120,"loss":0.7,"sync_s":0,"model_bytes":1626880,"sync_rounds_per_s":13.6,"model_gap":0.0065}"#,
        )
        .unwrap()
        .unwrap();
        let r = progress_report(&base, p, 2.0);
        assert_eq!(
            (r.line.sync_rounds_per_s, r.line.model_gap),
            (Some(13.6), Some(0.0065))
        );
        assert_eq!((r.line.sync_s, r.line.samples), (Some(0.0), 5120));
        assert!(r.validate().is_ok());
        // Valid statistics are copied; bad ones are dropped and the rest is kept.
        let p = WorkerProgressLine::parse(
            r#"CONVERGE_PROGRESS {"step":1,"samples":8,"loss":0.9,"grad_sqr":0.25,"grad_var":4}"#,
        )
        .unwrap()
        .unwrap();
        let r = progress_report(&base, p, 1.0);
        assert_eq!((r.line.grad_sqr, r.line.grad_var), (Some(0.25), Some(4.0)));
        let p = WorkerProgressLine::parse(
            r#"CONVERGE_PROGRESS {"step":1,"samples":8,"loss":0.9,"grad_sqr":NaN,"grad_var":4}"#,
        )
        .unwrap()
        .unwrap();
        let r = progress_report(&base, p, 1.0);
        assert_eq!(
            (r.line.loss, r.line.grad_sqr, r.line.grad_var),
            (0.9, None, None)
        );
        assert!(r.validate().is_ok());
    }
}

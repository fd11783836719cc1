//! Job specs: what a user submits (`converge submit job.toml`) and what the allocator reads
//! from KV `converge-jobs`. Parsing from TOML and every check a spec must pass live here, so
//! the CLI refuses a bad spec with the same reason the allocator would.

use crate::codec::{PROTOCOL_VERSION, default_protocol};
use crate::ids::{JobId, QueueId};
use crate::queues::PriorityClass;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Largest number of workers a job may ask for.
pub const MAX_WORKERS: u32 = 4096;
/// Largest number of GPUs per worker (one worker never spans hosts).
pub const MAX_GPUS_PER_WORKER: u32 = 16;
/// Environment variables set by the agent (worker contract) that a spec may not override:
/// every variable of [`crate::contract::VARIABLES`] but the one the spec may set itself
/// (`TORCH_NCCL_ASYNC_ERROR_HANDLING`, [`crate::contract::When::SpecDefault`]).
pub const RESERVED_ENV: [&str; crate::contract::RESERVED_COUNT] = crate::contract::RESERVED;

pub use crate::contract::{GPU_SPEED_ENV, SHADOW_ENV};

/// Most Hogwild training threads per worker a `[shadow]` table may ask for (the trainer's
/// own bound).
pub const MAX_HOGWILD_THREADS: u32 = 64;

/// Largest batch (total or per worker) a `[batch]` table may name, in samples.
pub const MAX_BATCH: u32 = 1 << 24;

/// Adaptive batch settings, the `[batch]` table of a job spec: the job lets the allocator
/// choose its batch size with its allocation (Pollux's goodput, docs/scheduling.md
/// "Adaptive batch sizes in the live cluster"). All sizes are in samples. A job without the
/// table keeps the batch its command sets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchSpec {
    /// `B₀`: the total batch per optimizer step the job's learning rate was tuned for; the
    /// smallest total the allocator gives it, and what it keeps while its program reports no
    /// gradient statistics.
    pub reference: u32,
    /// Largest total batch per optimizer step (where the program's learning-rate scaling
    /// still holds).
    pub max_total: u32,
    /// Smallest per-worker micro-batch worth running (default 1).
    #[serde(default = "default_one")]
    pub min_per_worker: u32,
    /// Largest per-worker micro-batch (what fits in a worker's memory; default
    /// `max_total`). Larger totals use gradient accumulation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_per_worker: Option<u32>,
    /// Largest per-worker micro-batch on particular GPU types, where it differs from
    /// `max_per_worker` (`max_per_worker_by_gpu_type = { a100 = 48 }`: an A100 with 40 GB
    /// holds a micro-batch four times what a 16 GB T4 holds). Keys are GPU types as hosts
    /// report them (`gpu.type`); a type not listed uses `max_per_worker`. A job placed on a
    /// type listed here gets batch plans with that type's micro-batch, so it needs fewer
    /// gradient-accumulation steps there.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub max_per_worker_by_gpu_type: BTreeMap<String, u32>,
}

impl BatchSpec {
    /// The effective largest per-worker micro-batch.
    pub fn max_per_worker(&self) -> u32 {
        self.max_per_worker.unwrap_or(self.max_total)
    }

    /// The largest per-worker micro-batch on `gpu_type` (`None`: hosts without a type):
    /// `max_per_worker_by_gpu_type`'s entry, else [`BatchSpec::max_per_worker`].
    pub fn max_per_worker_on(&self, gpu_type: Option<&str>) -> u32 {
        gpu_type
            .and_then(|t| self.max_per_worker_by_gpu_type.get(t).copied())
            .unwrap_or_else(|| self.max_per_worker())
    }
}

/// How a job's workers synchronize.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SyncArch {
    /// Data parallel with ring all-reduce of gradients (the default).
    #[default]
    Ring,
    /// Data parallel through parameter-server shards: the allocator adds shard processes
    /// (no GPU), choosing how many (at most `max_ps`) and on which hosts together with the
    /// workers' placement (LP planner, see docs/scheduling.md); the shards get the ranks
    /// after the workers and every process `CONVERGE_NUM_PS`.
    Ps,
    /// ShadowSync (Zheng et al., arXiv 2003.03477): workers train without waiting for each
    /// other while a background thread per worker synchronizes the model, with the
    /// algorithm and parameters of the `[shadow]` table ([`ShadowSpec`]). Its step time
    /// excludes synchronization; contention lowers its sync frequency instead
    /// (docs/communication.md, "Shadow jobs in the scheduler"). S-EASGD jobs get
    /// parameter-server shards as `ps` jobs do (`max_ps`).
    Shadow,
}

impl SyncArch {
    /// The value of the worker contract's `CONVERGE_SYNC`: `ring`, `ps` or `shadow`.
    pub fn as_str(self) -> &'static str {
        match self {
            SyncArch::Ring => "ring",
            SyncArch::Ps => "ps",
            SyncArch::Shadow => "shadow",
        }
    }
}

/// A shadow job's synchronization algorithm (`[shadow] algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShadowAlgorithm {
    /// S-MA: model averaging by ring all-reduce among the workers' shadow threads.
    Ma,
    /// S-BMUF: block momentum on the averaged model.
    Bmuf,
    /// S-EASGD: elastic averaging against a central copy on parameter-server shards.
    Easgd,
}

impl ShadowAlgorithm {
    /// The spec's and `CONVERGE_SHADOW_ALGORITHM`'s spelling: `ma`, `bmuf`, `easgd`.
    pub fn as_str(self) -> &'static str {
        match self {
            ShadowAlgorithm::Ma => "ma",
            ShadowAlgorithm::Bmuf => "bmuf",
            ShadowAlgorithm::Easgd => "easgd",
        }
    }

    /// The paper's name: S-MA, S-BMUF, S-EASGD.
    pub fn paper_name(self) -> &'static str {
        match self {
            ShadowAlgorithm::Ma => "S-MA",
            ShadowAlgorithm::Bmuf => "S-BMUF",
            ShadowAlgorithm::Easgd => "S-EASGD",
        }
    }

    /// All three, in this order.
    pub const ALL: [ShadowAlgorithm; 3] = [
        ShadowAlgorithm::Ma,
        ShadowAlgorithm::Bmuf,
        ShadowAlgorithm::Easgd,
    ];
}

/// The `[shadow]` table of an `arch = "shadow"` job. Parameters left out take the
/// program's defaults (converge-trainer: block momentum `min(1 − 1/W, 0.5)`, block learning
/// rate `1 − η`, moving rate `0.9 / W` with `W` workers, one Hogwild thread), so they
/// follow the world size of each generation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShadowSpec {
    pub algorithm: ShadowAlgorithm,
    /// S-BMUF block momentum η, in [0, 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_momentum: Option<f64>,
    /// S-BMUF block learning rate ζ, > 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_lr: Option<f64>,
    /// S-BMUF: Nesterov block momentum (workers restart each block from `x + η v`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub block_nesterov: bool,
    /// S-EASGD moving rate α, in (0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic_alpha: Option<f64>,
    /// Hogwild training threads per worker, 1 to [`MAX_HOGWILD_THREADS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hogwild_threads: Option<u32>,
}

impl ShadowSpec {
    /// Checks every parameter's range and that each belongs to the algorithm (the
    /// trainer refuses another algorithm's options at start; the spec is refused at submit
    /// instead).
    pub fn validate(&self) -> Result<(), String> {
        let bmuf = self.algorithm == ShadowAlgorithm::Bmuf;
        if let Some(eta) = self.block_momentum
            && !(eta.is_finite() && (0.0..1.0).contains(&eta))
        {
            return Err(format!("`block_momentum` is {eta}; it must be in [0, 1)"));
        }
        if let Some(zeta) = self.block_lr
            && !(zeta.is_finite() && zeta > 0.0)
        {
            return Err(format!(
                "`block_lr` is {zeta}; the block learning rate must be a positive number"
            ));
        }
        if let Some(alpha) = self.elastic_alpha
            && !(alpha.is_finite() && alpha > 0.0 && alpha <= 1.0)
        {
            return Err(format!(
                "`elastic_alpha` is {alpha}; the moving rate must be in (0, 1]"
            ));
        }
        if let Some(t) = self.hogwild_threads
            && !(1..=MAX_HOGWILD_THREADS).contains(&t)
        {
            return Err(format!(
                "`hogwild_threads` is {t}; it must be between 1 and {MAX_HOGWILD_THREADS}"
            ));
        }
        if !bmuf
            && (self.block_momentum.is_some() || self.block_lr.is_some() || self.block_nesterov)
        {
            return Err(format!(
                "`block_momentum`, `block_lr` and `block_nesterov` are for `algorithm = \"bmuf\"`, not \"{}\"",
                self.algorithm.as_str()
            ));
        }
        if self.algorithm != ShadowAlgorithm::Easgd && self.elastic_alpha.is_some() {
            return Err(format!(
                "`elastic_alpha` is for `algorithm = \"easgd\"`, not \"{}\"",
                self.algorithm.as_str()
            ));
        }
        Ok(())
    }

    /// The worker contract's shadow variables ([`SHADOW_ENV`]) this table sets: the
    /// algorithm, and each parameter it gives.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut vars = vec![(SHADOW_ENV[0], self.algorithm.as_str().to_string())];
        if let Some(eta) = self.block_momentum {
            vars.push((SHADOW_ENV[1], eta.to_string()));
        }
        if let Some(zeta) = self.block_lr {
            vars.push((SHADOW_ENV[2], zeta.to_string()));
        }
        if self.block_nesterov {
            vars.push((SHADOW_ENV[3], "true".to_string()));
        }
        if let Some(alpha) = self.elastic_alpha {
            vars.push((SHADOW_ENV[4], alpha.to_string()));
        }
        if let Some(t) = self.hogwild_threads {
            vars.push((SHADOW_ENV[5], t.to_string()));
        }
        vars
    }
}

/// When the allocator ends a job before its program exits (the `[stop]` table): SLAQ's
/// exploratory jobs, which people watch and kill once the loss flattens. Each criterion is
/// optional; the first one met ends the job (status `completed`, with the reason, the loss
/// at the end and the loss its fitted curve predicted it would reach). The agents stop the
/// workers as for any resize (SIGTERM, checkpoint, exit). docs/scheduling.md "Stop criteria".
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StopSpec {
    /// Training loss (in the job's own units) at which the job has reached its target: the
    /// mean of rank 0's latest five reported losses and, once a curve is fitted, the curve's
    /// loss at the job's progress, both at or below it. Must be below the job's first
    /// reported loss (a later check: the allocator fails a job whose first loss is already
    /// at or below its target).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_loss: Option<f64>,
    /// Plateau rule: the job has converged when its fitted curve predicts a relative loss
    /// improvement per epoch below `min_improvement` over the next `window_epochs` epochs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plateau: Option<PlateauSpec>,
    /// Seconds after submission at which the job is ended, whatever its loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_s: Option<f64>,
    /// GPU-hours of service (GPUs × hours its workers ran and reported) after which the job
    /// is ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_gpu_hours: Option<f64>,
}

/// The plateau rule of a `[stop]` table (`[stop.plateau]`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlateauSpec {
    /// Relative improvement per epoch, `(L(k) − L(k + E)) / L(k)` with `E` the samples of one
    /// epoch, below which the job counts as converged; in (0, 1). E.g. 0.01 = 1 % per epoch.
    pub min_improvement: f64,
    /// Epochs the improvement is judged over (ahead of the job's progress, on its fitted
    /// curve); the rule applies only once the job has run this many epochs. At least 1
    /// (fractions allowed).
    pub window_epochs: f64,
}

/// How a sweep stops its weak trials early (`[sweep] early_stop`; docs/scheduling.md "Sweep
/// early stopping"). Each trial's spec carries its sweep's rule; the allocator applies it
/// across the trials of the sweep and ends a stopped trial as `completed` with the reason
/// `early stopped` and why in its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum EarlyStopRule {
    /// Stop a trial once the best final loss its fitted curve predicts, less the prediction
    /// error band, is still worse than what `keep` other trials have already attained: it
    /// cannot reach the best trials. The default for sweeps.
    #[default]
    Predicted,
    /// Asynchronous successive halving (ASHA; Li et al., MLSys'20) with reduction factor 3:
    /// at rungs of `min_epochs × 3^r` epochs a trial goes on only if its loss there is in the
    /// best third of the trials that reached that rung before it.
    Asha,
    /// No early stopping: each trial runs until its own program or `[stop]` ends it.
    None,
}

impl EarlyStopRule {
    /// As written in a sweep file.
    pub fn as_str(self) -> &'static str {
        match self {
            EarlyStopRule::Predicted => "predicted",
            EarlyStopRule::Asha => "asha",
            EarlyStopRule::None => "none",
        }
    }
}

/// A sweep trial's early-stopping settings (its spec's `early_stop` table, set for each
/// trial from the sweep file's `[sweep]` keys by `converge submit`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopSpec {
    /// The rule.
    #[serde(default)]
    pub rule: EarlyStopRule,
    /// Trials the rule never stops (at least 1): it never leaves fewer than `keep` trials of
    /// the sweep not early-stopped; under `predicted` these are the `keep` best.
    #[serde(default = "default_keep")]
    pub keep: u32,
    /// Relative error band of a predicted final loss per doubling of the samples ahead
    /// (`predicted` rule), in [0, 0.25) (until 2026-11-29 a flat band in [0, 1)): a trial is stopped only when its prediction less
    /// this fraction times `clamp(log₂(end / done), 1, 4)` is above the loss `keep` other
    /// trials have attained; a trial whose known end is more than 16 times (4 doublings) the
    /// samples it has done is not judged yet. Default [`DEFAULT_EARLY_STOP_BAND`].
    #[serde(default = "default_band")]
    pub band: f64,
    /// Epochs a trial runs before any rule may stop it (a curve needs points to fit), and
    /// ASHA's first rung. Above 0. Default 1.
    #[serde(default = "default_min_epochs")]
    pub min_epochs: f64,
}

/// Default [`EarlyStopSpec::keep`]: 1, as ASHA's top rung. With six trials a sweep, two
/// kept trials that run to their end alone hold a third of its run-to-the-end GPU-hours
/// (docs/scheduling.md, "Sweep early stopping", has what each default gives).
pub const DEFAULT_EARLY_STOP_KEEP: u32 = 1;
/// Default [`EarlyStopSpec::band`]: 0.02 per doubling of the samples ahead. The
/// allocator's curve fit forecasts the held-out loss of this project's trainer runs a
/// quarter of the remaining run ahead with a median error of 2.2 % (docs/prediction.md,
/// `converge-sim predict-bench`).
pub const DEFAULT_EARLY_STOP_BAND: f64 = 0.02;

fn default_keep() -> u32 {
    DEFAULT_EARLY_STOP_KEEP
}
fn default_band() -> f64 {
    DEFAULT_EARLY_STOP_BAND
}
fn default_min_epochs() -> f64 {
    1.0
}

impl Default for EarlyStopSpec {
    fn default() -> Self {
        Self {
            rule: EarlyStopRule::default(),
            keep: DEFAULT_EARLY_STOP_KEEP,
            band: DEFAULT_EARLY_STOP_BAND,
            min_epochs: 1.0,
        }
    }
}

impl EarlyStopSpec {
    /// Checks the bounds; `Err` says which value is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if self.keep == 0 {
            return Err("`keep` is 0; at least one trial must go on".into());
        }
        if !(self.band.is_finite() && (0.0..0.25).contains(&self.band)) {
            return Err(format!(
                "`band` is {}; it must be in [0, 0.25): it is per doubling of the samples \
                 ahead, up to 4 doublings, and a band of 1 or more would stop no trial",
                self.band
            ));
        }
        if !(self.min_epochs.is_finite() && self.min_epochs > 0.0) {
            return Err(format!(
                "`min_epochs` is {}; it must be above 0",
                self.min_epochs
            ));
        }
        Ok(())
    }
}

/// Most parameter-server shards a job may ask for.
pub const MAX_PS: u32 = 256;

/// Most non-zero worker exits a job may tolerate (`max_restarts`): each restart waits a
/// capped backoff, so a larger budget only keeps a crashing job holding GPUs for hours.
pub const MAX_RESTARTS: u32 = 100;

fn default_one() -> u32 {
    1
}
fn default_max_restarts() -> u32 {
    3
}
fn is_normal(p: &PriorityClass) -> bool {
    *p == PriorityClass::Normal
}

/// A training job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    #[serde(default = "default_protocol")]
    pub protocol: u32,
    /// Unique id: `[A-Za-z0-9][A-Za-z0-9_-]{0,63}`.
    pub id: JobId,
    /// Program and arguments run for every rank (found on the agent's PATH if not absolute).
    pub command: Vec<String>,
    /// Extra environment for every rank (may not set the worker-contract variables).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// GPUs each worker gets, all on one host (default 1).
    #[serde(default = "default_one")]
    pub gpus_per_worker: u32,
    /// Fewest workers the job can run with (default 1).
    #[serde(default = "default_one")]
    pub min_workers: u32,
    /// Most workers the job can use (default: `min_workers`).
    #[serde(default)]
    pub max_workers: Option<u32>,
    /// Workers the user asks for, between `min_workers` and `max_workers` (default:
    /// `max_workers`). Fixed-size policies (fifo, tiresias, sjf-bco) run the job at this
    /// size; elastic ones (quality, fair, optimus) choose within the bounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<u32>,
    #[serde(default)]
    pub arch: SyncArch,
    /// Most parameter-server shards (`arch = "ps"` and S-EASGD shadow jobs only; default: as
    /// many as workers).
    #[serde(default)]
    pub max_ps: Option<u32>,
    /// ShadowSync's algorithm and parameters (`[shadow]`; required with `arch = "shadow"`,
    /// refused otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ShadowSpec>,
    /// Training loss at which the job counts as converged: the allocator stops it and marks
    /// it completed.
    #[serde(default)]
    pub target_loss: Option<f64>,
    /// Declared work: the samples the job processes in all, over every worker (epochs ×
    /// dataset size: `work_samples = 1_500_000` for 30 epochs of 50,000 samples, as a
    /// trainer's `--epochs` implies). When given, the allocator's completion-time estimate
    /// is this minus the samples reported so far; without it, the fitted loss curve's
    /// estimate to `target_loss`, else none. For a `[batch]` job whose workers report
    /// gradient statistics, the samples done count at the reference batch's efficiency
    /// (samples at a larger batch do less each; Pollux's scale-invariant progress), since
    /// its rate is a goodput. For a sweep's trial it is also where the trial ends, in raw
    /// samples, for its sweep's early stopping (`predicted`), and the trial stays
    /// exploratory ([`JobSpec::is_exploratory`]). It does not stop the job (the program
    /// ends itself; `[stop]` ends it early). Refused: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_samples: Option<u64>,
    /// Non-zero exits of a worker tolerated (with capped backoff) before the job fails.
    #[serde(default = "default_max_restarts")]
    pub max_restarts: u32,
    /// Stop criteria (`[stop]`): when the allocator ends the job on its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopSpec>,
    /// The sweep this job is a trial of (set by `converge submit sweep.toml`; same rules as
    /// a job id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep: Option<JobId>,
    /// The sweep's early stopping (`early_stop = { rule = "predicted", keep = 1 }`), set on
    /// each trial by `converge submit` from the sweep file; only with `sweep`. `None`: the
    /// trial is never stopped for the sweep's sake.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stop: Option<EarlyStopSpec>,
    /// Adaptive batch settings (`[batch]`); `None`: the batch is the command's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchSpec>,
    /// Free-form labels shown by the CLI (e.g. `model`, `dataset`).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Node selector (`[selector]`): the job's workers (and parameter-server shards) go only
    /// to hosts whose labels ([`crate::HostTelemetry::labels`]) have every pair, each with
    /// exactly this value (e.g. `"gpu.model" = "NVIDIA-H100-80GB-HBM3"`, `zone = "a"`).
    /// Empty: any host. Same syntax and bounds as host labels ([`crate::labels`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub selector: BTreeMap<String, String>,
    /// The GPU types (generations) the job may run on (`gpu_types = ["a100", "h100"]`): its
    /// workers go only to hosts whose `gpu.type` label ([`crate::labels::GPU_TYPE`]) is one
    /// of them. `None`: any type. Refused: an empty list, a type listed twice, a type that
    /// is not a label value. A job whose types no live host offers waits, pending, with the
    /// reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_types: Option<Vec<String>>,
    /// The queue the job is scheduled in (`queue = "team-a"`; see [`crate::queues`]).
    /// `None`: the [`crate::DEFAULT_QUEUE`]. `converge submit` refuses a queue that does not
    /// exist; a job whose queue is deleted later waits, pending, with the reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueId>,
    /// Priority class within its queue (`priority = "high"`; default `normal`): a pending
    /// job may preempt whole running jobs of lower classes of its queue.
    #[serde(default, skip_serializing_if = "is_normal")]
    pub priority: PriorityClass,
    /// Submission time (UNIX seconds); set by `converge submit`.
    #[serde(default)]
    pub submitted_at: f64,
    /// Set by `converge cancel`: the allocator stops the job's workers.
    #[serde(default)]
    pub cancelled: bool,
}

/// Why a job spec was refused.
#[derive(Debug, thiserror::Error)]
pub enum JobSpecError {
    #[error("cannot parse job spec: {0}")]
    Parse(#[from] toml::de::Error),
    #[error(
        "`command` is empty: give the program and its arguments, e.g. command = [\"converge-trainer\", \"--dataset\", \"a9a\"]"
    )]
    EmptyCommand,
    #[error("`gpus_per_worker` is {0}; it must be between 1 and {MAX_GPUS_PER_WORKER}")]
    GpusPerWorker(u32),
    #[error("`min_workers` is {0}; it must be between 1 and {MAX_WORKERS}")]
    MinWorkers(u32),
    #[error("`max_workers` ({max}) is below `min_workers` ({min}) or above {MAX_WORKERS}")]
    MaxWorkers { min: u32, max: u32 },
    #[error(
        "`workers` ({workers}) must be between `min_workers` ({min}) and `max_workers` ({max})"
    )]
    Workers { workers: u32, min: u32, max: u32 },
    #[error("`target_loss` must be a finite number, got {0}")]
    TargetLoss(f64),
    #[error("`work_samples` must be above 0 (the samples the job processes in all)")]
    WorkSamples,
    #[error(
        "`max_ps` is only for `arch = \"ps\"` jobs and shadow jobs with `algorithm = \"easgd\"`"
    )]
    MaxPsWithoutPs,
    #[error("`max_ps` must be between 1 and {MAX_PS}, got {0}")]
    MaxPs(u32),
    #[error("`env` may not set {0}: the agent sets it (worker contract)")]
    ReservedEnv(String),
    #[error("`env` key {0:?} is not a valid environment variable name")]
    BadEnvName(String),
    #[error("`[stop]`: {0}")]
    Stop(String),
    #[error("`early_stop`: {0}")]
    EarlyStop(String),
    #[error("`[batch]`: {0}")]
    Batch(String),
    #[error("`[selector]`: {0}")]
    Selector(String),
    #[error("`gpu_types`: {0}")]
    GpuTypes(String),
    #[error("`[shadow]`: {0}")]
    Shadow(String),
    #[error("unsupported protocol version {0}")]
    Protocol(u32),
    #[error("`max_restarts` is {0}; it must be at most {MAX_RESTARTS}")]
    MaxRestarts(u32),
    #[error("{0} holds a NUL byte, which no program can be given")]
    NulByte(String),
    #[error("`labels` {0} holds a control character (it would reach terminals as is)")]
    LabelControl(String),
}

impl JobSpec {
    /// Parses and validates a TOML job spec (the file given to `converge submit`).
    pub fn from_toml(text: &str) -> Result<Self, JobSpecError> {
        let spec: JobSpec = toml::from_str(text)?;
        spec.validate()?;
        Ok(spec)
    }

    /// The effective maximum number of workers.
    pub fn max_workers(&self) -> u32 {
        self.max_workers.unwrap_or(self.min_workers)
    }

    /// The target loss: `[stop] target_loss`, else the top-level `target_loss`.
    pub fn target_loss(&self) -> Option<f64> {
        self.stop.and_then(|s| s.target_loss).or(self.target_loss)
    }

    /// Whether the job is exploratory: without a target loss, a trial of a sweep (its
    /// declared work, `work_samples`, only says where it ends: a sweep is run to find its
    /// best trial, not to finish every trial), or a job with stop criteria that does not
    /// declare its work. The default objective values such a job by its predicted loss
    /// reduction (SLAQ's) and any other by its completion time (docs/scheduling.md,
    /// "Objectives").
    pub fn is_exploratory(&self) -> bool {
        self.target_loss().is_none()
            && (self.sweep.is_some() || (self.stop.is_some() && self.work_samples.is_none()))
    }

    /// The name of the job's queue: `queue`, else [`crate::DEFAULT_QUEUE`].
    pub fn queue_name(&self) -> &str {
        self.queue
            .as_ref()
            .map_or(crate::queues::DEFAULT_QUEUE, QueueId::as_str)
    }

    /// Whether the job's processes include parameter-server shards: `arch = "ps"`, and
    /// shadow jobs with S-EASGD (their central copy lives on the shards).
    pub fn has_ps_shards(&self) -> bool {
        match self.arch {
            SyncArch::Ps => true,
            SyncArch::Shadow => self
                .shadow
                .is_some_and(|s| s.algorithm == ShadowAlgorithm::Easgd),
            SyncArch::Ring => false,
        }
    }

    /// The shadow algorithm of an `arch = "shadow"` job (`None` for other jobs).
    pub fn shadow_algorithm(&self) -> Option<ShadowAlgorithm> {
        match self.arch {
            SyncArch::Shadow => self.shadow.map(|s| s.algorithm),
            _ => None,
        }
    }

    /// Workers the user asked for: `workers`, else `max_workers()`.
    pub fn requested_workers(&self) -> u32 {
        self.workers.unwrap_or_else(|| self.max_workers())
    }

    /// Checks everything the types do not.
    pub fn validate(&self) -> Result<(), JobSpecError> {
        if self.protocol != PROTOCOL_VERSION {
            return Err(JobSpecError::Protocol(self.protocol));
        }
        if self.command.is_empty() || self.command[0].trim().is_empty() {
            return Err(JobSpecError::EmptyCommand);
        }
        if let Some(i) = self.command.iter().position(|a| a.contains('\0')) {
            return Err(JobSpecError::NulByte(format!("`command` argument {i}")));
        }
        if let Some((k, _)) = self.env.iter().find(|(_, v)| v.contains('\0')) {
            return Err(JobSpecError::NulByte(format!("`env` value of {k}")));
        }
        if self.max_restarts > MAX_RESTARTS {
            return Err(JobSpecError::MaxRestarts(self.max_restarts));
        }
        if let Some((k, v)) = self
            .labels
            .iter()
            .find(|(k, v)| k.chars().chain(v.chars()).any(char::is_control))
        {
            return Err(JobSpecError::LabelControl(format!("{k:?} = {v:?}")));
        }
        if !(1..=MAX_GPUS_PER_WORKER).contains(&self.gpus_per_worker) {
            return Err(JobSpecError::GpusPerWorker(self.gpus_per_worker));
        }
        if !(1..=MAX_WORKERS).contains(&self.min_workers) {
            return Err(JobSpecError::MinWorkers(self.min_workers));
        }
        let max = self.max_workers();
        if max < self.min_workers || max > MAX_WORKERS {
            return Err(JobSpecError::MaxWorkers {
                min: self.min_workers,
                max,
            });
        }
        if let Some(w) = self.workers
            && !(self.min_workers..=max).contains(&w)
        {
            return Err(JobSpecError::Workers {
                workers: w,
                min: self.min_workers,
                max,
            });
        }
        if let Some(t) = self.target_loss
            && !t.is_finite()
        {
            return Err(JobSpecError::TargetLoss(t));
        }
        if self.work_samples == Some(0) {
            return Err(JobSpecError::WorkSamples);
        }
        match (self.arch, &self.shadow) {
            (SyncArch::Shadow, None) => {
                return Err(JobSpecError::Shadow(
                    "`arch = \"shadow\"` needs the table, e.g. [shadow] algorithm = \"ma\" (or \"bmuf\", \"easgd\")".into(),
                ));
            }
            (SyncArch::Shadow, Some(s)) => s.validate().map_err(JobSpecError::Shadow)?,
            (_, Some(_)) => {
                return Err(JobSpecError::Shadow(
                    "the table is only for `arch = \"shadow\"` jobs".into(),
                ));
            }
            _ => {}
        }
        match self.max_ps {
            Some(_) if !self.has_ps_shards() => return Err(JobSpecError::MaxPsWithoutPs),
            Some(p) if !(1..=MAX_PS).contains(&p) => return Err(JobSpecError::MaxPs(p)),
            _ => {}
        }
        if let Some(b) = &self.batch {
            self.validate_batch(b)?;
        }
        if let Some(stop) = &self.stop {
            stop.validate().map_err(JobSpecError::Stop)?;
            if let (Some(a), Some(b)) = (self.target_loss, stop.target_loss) {
                return Err(JobSpecError::Stop(format!(
                    "`target_loss` is given twice ({a} at the top, {b} in `[stop]`): keep one"
                )));
            }
        }
        if let Some(e) = &self.early_stop {
            if self.sweep.is_none() {
                return Err(JobSpecError::EarlyStop(
                    "only a sweep's trials stop early: the job has no `sweep`".into(),
                ));
            }
            e.validate().map_err(JobSpecError::EarlyStop)?;
        }
        crate::labels::validate(&self.selector).map_err(JobSpecError::Selector)?;
        if let Some(types) = &self.gpu_types {
            validate_gpu_types(types).map_err(JobSpecError::GpuTypes)?;
        }
        for key in self.env.keys() {
            if crate::contract::is_reserved(key) {
                return Err(JobSpecError::ReservedEnv(key.clone()));
            }
            let valid = !key.is_empty()
                && !key.starts_with(|c: char| c.is_ascii_digit())
                && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(JobSpecError::BadEnvName(key.clone()));
            }
        }
        Ok(())
    }
}

impl StopSpec {
    /// Checks every criterion: finite, positive where a negative or zero value could never
    /// be met (or is met at once), a plateau window of at least one epoch.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(t) = self.target_loss
            && !t.is_finite()
        {
            return Err(format!("`target_loss` must be a finite number, got {t}"));
        }
        if let Some(p) = &self.plateau {
            if !(p.min_improvement.is_finite()
                && p.min_improvement > 0.0
                && p.min_improvement < 1.0)
            {
                return Err(format!(
                    "`plateau.min_improvement` is {}; it must be a relative improvement per epoch in (0, 1), e.g. 0.01",
                    p.min_improvement
                ));
            }
            if !(p.window_epochs.is_finite() && p.window_epochs >= 1.0) {
                return Err(format!(
                    "`plateau.window_epochs` is {}; it must be at least 1 epoch",
                    p.window_epochs
                ));
            }
        }
        if let Some(d) = self.deadline_s
            && !(d.is_finite() && d > 0.0)
        {
            return Err(format!(
                "`deadline_s` is {d}; it must be a positive number of seconds after submission"
            ));
        }
        if let Some(b) = self.max_gpu_hours
            && !(b.is_finite() && b > 0.0)
        {
            return Err(format!(
                "`max_gpu_hours` is {b}; the GPU-time budget must be a positive number of GPU-hours"
            ));
        }
        if self.target_loss.is_none()
            && self.plateau.is_none()
            && self.deadline_s.is_none()
            && self.max_gpu_hours.is_none()
        {
            return Err(
                "the table is empty: give at least one of `target_loss`, `plateau`, `deadline_s`, `max_gpu_hours`"
                    .into(),
            );
        }
        Ok(())
    }
}

/// Checks a job's `gpu_types`: not empty, each a non-empty label value, none twice.
fn validate_gpu_types(types: &[String]) -> Result<(), String> {
    if types.is_empty() {
        return Err(
            "the list is empty, so no host could run the job: name at least one type \
             (e.g. gpu_types = [\"a100\"]), or leave the key out for any type"
                .into(),
        );
    }
    let mut seen = BTreeSet::new();
    for t in types {
        if t.is_empty() {
            return Err("a GPU type may not be empty".into());
        }
        crate::labels::validate_value(crate::labels::GPU_TYPE, t)?;
        if !seen.insert(t) {
            return Err(format!("{t:?} is listed twice"));
        }
    }
    Ok(())
}

impl JobSpec {
    /// Whether a host with `labels` may run the job's workers: its `[selector]` matches and,
    /// with `gpu_types`, the host's GPU type ([`crate::labels::host_gpu_type`]) is listed.
    pub fn allows_host(&self, labels: &BTreeMap<String, String>) -> bool {
        crate::labels::matches(&self.selector, labels)
            && self.gpu_types.as_ref().is_none_or(|types| {
                crate::labels::host_gpu_type(labels).is_some_and(|t| types.contains(&t))
            })
    }

    /// Whether the job restricts its hosts at all (`[selector]` or `gpu_types`).
    pub fn restricts_hosts(&self) -> bool {
        !self.selector.is_empty() || self.gpu_types.is_some()
    }

    fn validate_batch(&self, b: &BatchSpec) -> Result<(), JobSpecError> {
        let bad = |m: String| Err(JobSpecError::Batch(m));
        if self.arch != SyncArch::Ring {
            return bad("adaptive batch sizes are for `arch = \"ring\"` jobs only".into());
        }
        let max_per = b.max_per_worker();
        for (name, v) in [
            ("reference", b.reference),
            ("max_total", b.max_total),
            ("min_per_worker", b.min_per_worker),
            ("max_per_worker", max_per),
        ] {
            if !(1..=MAX_BATCH).contains(&v) {
                return bad(format!(
                    "`{name}` is {v}; it must be between 1 and {MAX_BATCH} samples"
                ));
            }
        }
        if b.max_total < b.reference {
            return bad(format!(
                "`max_total` ({}) is below `reference` ({}): the reference batch must be allowed",
                b.max_total, b.reference
            ));
        }
        if b.min_per_worker > max_per {
            return bad(format!(
                "`min_per_worker` ({}) is above `max_per_worker` ({max_per})",
                b.min_per_worker
            ));
        }
        for (gpu_type, &v) in &b.max_per_worker_by_gpu_type {
            let key = format!("`max_per_worker_by_gpu_type.{gpu_type}`");
            if gpu_type.is_empty() {
                return bad("`max_per_worker_by_gpu_type`: a GPU type may not be empty".into());
            }
            crate::labels::validate_value(crate::labels::GPU_TYPE, gpu_type)
                .or_else(|e| bad(format!("{key}: {e}")))?;
            if !(1..=MAX_BATCH).contains(&v) {
                return bad(format!(
                    "{key} is {v}; it must be between 1 and {MAX_BATCH} samples"
                ));
            }
            if b.min_per_worker > v {
                return bad(format!(
                    "`min_per_worker` ({}) is above {key} ({v})",
                    b.min_per_worker
                ));
            }
        }
        let smallest = u64::from(self.min_workers) * u64::from(b.min_per_worker);
        if smallest > u64::from(b.max_total) {
            return bad(format!(
                "`min_workers` × `min_per_worker` ({smallest}) is above `max_total` ({}): the job could never run",
                b.max_total
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_is_exploratory_as_a_sweep_trial_or_with_stop_criteria_and_no_target_or_declared_work()
    {
        let spec = |extra: &str| {
            JobSpec::from_toml(&format!("id = \"j\"\ncommand = [\"train\"]\n{extra}")).unwrap()
        };
        assert!(!spec("").is_exploratory(), "a plain job");
        assert!(spec("sweep = \"s\"").is_exploratory(), "a sweep's trial");
        let plateau = "[stop.plateau]\nmin_improvement = 0.01\nwindow_epochs = 2.0";
        assert!(spec(plateau).is_exploratory(), "stop criteria, no target");
        assert!(
            !spec("sweep = \"s\"\ntarget_loss = 0.1").is_exploratory(),
            "a target loss"
        );
        assert!(
            spec("sweep = \"s\"\nwork_samples = 1000").is_exploratory(),
            "a sweep's trial that declares its work"
        );
        assert!(
            !spec(&format!("work_samples = 1000\n{plateau}")).is_exploratory(),
            "stop criteria and declared work"
        );
        assert!(
            !spec("[stop]\ntarget_loss = 0.1").is_exploratory(),
            "a target in [stop]"
        );
    }

    fn check(toml_text: &str, expect: &str) {
        match JobSpec::from_toml(toml_text) {
            Ok(_) => assert_eq!(expect, "ok", "spec was accepted"),
            Err(e) => assert!(
                e.to_string().contains(expect),
                "error {:?} does not mention {:?}",
                e.to_string(),
                expect
            ),
        }
    }

    #[test]
    fn queue_and_priority_parse_with_defaults_and_bad_ones_are_refused() {
        let base = "id = \"q\"\ncommand = [\"t\"]\n";
        let plain = JobSpec::from_toml(base).unwrap();
        assert_eq!(
            (plain.queue_name(), plain.priority),
            ("default", PriorityClass::Normal)
        );
        let json = serde_json::to_string(&plain).unwrap();
        assert!(
            !json.contains("queue") && !json.contains("priority"),
            "{json}"
        );
        let s = JobSpec::from_toml(&format!("{base}queue = \"team-a\"\npriority = \"high\"\n"))
            .unwrap();
        assert_eq!(
            (s.queue_name(), s.priority),
            ("team-a", PriorityClass::High)
        );
        let back: JobSpec = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        check(&format!("{base}queue = \"team a\"\n"), "only ASCII letters");
        check(
            &format!("{base}priority = \"urgent\"\n"),
            "unknown variant `urgent`",
        );
    }

    #[test]
    fn env_may_set_no_contract_variable_but_the_nccl_default() {
        let base = "id = \"j\"\ncommand = [\"t\"]\n[env]\n";
        for v in crate::contract::VARIABLES {
            let spec = format!("{base}{} = \"1\"\n", v.name);
            if v.when.reserved() {
                assert!(RESERVED_ENV.contains(&v.name), "{}", v.name);
                check(
                    &spec,
                    &format!("`env` may not set {}: the agent sets it", v.name),
                );
            } else {
                assert!(!RESERVED_ENV.contains(&v.name), "{}", v.name);
                check(&spec, "ok");
            }
        }
        assert_eq!(RESERVED_ENV.len(), crate::contract::VARIABLES.len() - 1);
    }

    #[test]
    fn parameter_server_jobs_parse_and_max_ps_is_checked() {
        let base = "id = \"p\"\ncommand = [\"t\"]\n";
        let ps = JobSpec::from_toml(&format!("{base}arch = \"ps\"\nmax_ps = 2\n")).unwrap();
        assert_eq!((ps.arch, ps.max_ps), (SyncArch::Ps, Some(2)));
        let err = JobSpec::from_toml(&format!("{base}max_ps = 2\n")).unwrap_err();
        assert!(err.to_string().contains("only for"), "{err}");
        let err = JobSpec::from_toml(&format!("{base}arch = \"ps\"\nmax_ps = 0\n")).unwrap_err();
        assert!(err.to_string().contains("between 1"), "{err}");
        let err =
            JobSpec::from_toml(&format!("{base}[env]\nCONVERGE_NUM_PS = \"3\"\n")).unwrap_err();
        assert!(err.to_string().contains("CONVERGE_NUM_PS"), "{err}");
    }

    #[test]
    fn shadow_jobs_parse_with_defaults_and_bad_parameters_are_refused() {
        let base = "id = \"s\"\ncommand = [\"t\"]\nmax_workers = 4\narch = \"shadow\"\n";
        let ma = JobSpec::from_toml(&format!("{base}[shadow]\nalgorithm = \"ma\"\n")).unwrap();
        let s = ma.shadow.unwrap();
        assert_eq!(ma.arch, SyncArch::Shadow);
        assert_eq!(ma.shadow_algorithm(), Some(ShadowAlgorithm::Ma));
        assert_eq!(
            (
                s.block_momentum,
                s.block_lr,
                s.block_nesterov,
                s.elastic_alpha,
                s.hogwild_threads
            ),
            (None, None, false, None, None)
        );
        assert!(!ma.has_ps_shards());
        // Only the algorithm reaches the workers: the trainer's defaults follow W.
        assert_eq!(
            s.env(),
            vec![("CONVERGE_SHADOW_ALGORITHM", "ma".to_string())]
        );
        let json = serde_json::to_string(&ma).unwrap();
        assert_eq!(serde_json::from_str::<JobSpec>(&json).unwrap(), ma);

        let bmuf = JobSpec::from_toml(&format!(
            "{base}[shadow]\nalgorithm = \"bmuf\"\nblock_momentum = 0\nblock_lr = 0.5\nblock_nesterov = true\nhogwild_threads = 4\n"
        ))
        .unwrap();
        assert_eq!(
            bmuf.shadow.unwrap().env(),
            vec![
                ("CONVERGE_SHADOW_ALGORITHM", "bmuf".to_string()),
                ("CONVERGE_SHADOW_BLOCK_MOMENTUM", "0".to_string()),
                ("CONVERGE_SHADOW_BLOCK_LR", "0.5".to_string()),
                ("CONVERGE_SHADOW_BLOCK_NESTEROV", "true".to_string()),
                ("CONVERGE_SHADOW_HOGWILD_THREADS", "4".to_string()),
            ]
        );
        let easgd = JobSpec::from_toml(&format!(
            "{base}max_ps = 2\n[shadow]\nalgorithm = \"easgd\"\nelastic_alpha = 1\n"
        ))
        .unwrap();
        assert!(easgd.has_ps_shards());
        assert_eq!(easgd.max_ps, Some(2));

        for (table, expect) in [
            (
                "algorithm = \"bmuf\"\nblock_momentum = 1",
                "`block_momentum` is 1; it must be in [0, 1)",
            ),
            (
                "algorithm = \"bmuf\"\nblock_momentum = -0.1",
                "must be in [0, 1)",
            ),
            (
                "algorithm = \"bmuf\"\nblock_momentum = nan",
                "must be in [0, 1)",
            ),
            ("algorithm = \"bmuf\"\nblock_lr = 0", "`block_lr` is 0"),
            (
                "algorithm = \"easgd\"\nelastic_alpha = 0",
                "`elastic_alpha` is 0; the moving rate must be in (0, 1]",
            ),
            (
                "algorithm = \"easgd\"\nelastic_alpha = 1.5",
                "must be in (0, 1]",
            ),
            (
                "algorithm = \"ma\"\nhogwild_threads = 0",
                "`hogwild_threads` is 0",
            ),
            (
                "algorithm = \"ma\"\nhogwild_threads = 65",
                "between 1 and 64",
            ),
            (
                "algorithm = \"ma\"\nblock_momentum = 0.5",
                "are for `algorithm = \"bmuf\"`, not \"ma\"",
            ),
            (
                "algorithm = \"bmuf\"\nelastic_alpha = 0.5",
                "is for `algorithm = \"easgd\"`",
            ),
            ("algorithm = \"sgd\"", "unknown variant `sgd`"),
            ("algorithm = \"ma\"\nalpha = 0.5", "unknown field `alpha`"),
        ] {
            check(&format!("{base}[shadow]\n{table}\n"), expect);
        }
        check(base, "`arch = \"shadow\"` needs the table");
        check(
            "id = \"s\"\ncommand = [\"t\"]\n[shadow]\nalgorithm = \"ma\"\n",
            "only for `arch = \"shadow\"` jobs",
        );
        check(
            &format!("{base}max_ps = 1\n[shadow]\nalgorithm = \"ma\"\n"),
            "`max_ps` is only for",
        );
        check(
            &format!(
                "{base}[shadow]\nalgorithm = \"ma\"\n[batch]\nreference = 8\nmax_total = 16\n"
            ),
            "adaptive batch sizes are for `arch = \"ring\"` jobs only",
        );
        for var in [
            "CONVERGE_SYNC",
            "CONVERGE_SHADOW_ALGORITHM",
            "CONVERGE_SHADOW_ELASTIC_ALPHA",
        ] {
            check(
                &format!("{base}[shadow]\nalgorithm = \"ma\"\n[env]\n{var} = \"x\"\n"),
                var,
            );
        }
    }

    #[test]
    fn batch_tables_parse_and_are_checked() {
        let base = "id = \"b\"\ncommand = [\"t\"]\nmax_workers = 4\n";
        let s = JobSpec::from_toml(&format!(
            "{base}[batch]\nreference = 64\nmax_total = 1024\n"
        ))
        .unwrap();
        let b = s.batch.unwrap();
        assert_eq!((b.reference, b.max_total, b.min_per_worker), (64, 1024, 1));
        assert_eq!(b.max_per_worker(), 1024);
        assert!(JobSpec::from_toml(base).unwrap().batch.is_none());
        for (table, expect) in [
            ("reference = 0\nmax_total = 8", "`reference` is 0"),
            ("reference = 64\nmax_total = 32", "below `reference`"),
            (
                "reference = 64\nmax_total = 128\nmin_per_worker = 16\nmax_per_worker = 8",
                "above `max_per_worker`",
            ),
            ("reference = 64\nmax_total = 99999999", "between 1 and"),
            (
                "reference = 64\nmax_total = 128\nmax_per_worker = 0",
                "`max_per_worker` is 0",
            ),
            ("reference = 64", "missing field `max_total`"),
            (
                "reference = 64\nmax_total = 128\nsize = 3",
                "unknown field `size`",
            ),
            ("reference = -1\nmax_total = 128", "invalid value"),
        ] {
            check(&format!("{base}[batch]\n{table}\n"), expect);
        }
        check(
            "id = \"b\"\ncommand = [\"t\"]\nmin_workers = 4\n[batch]\nreference = 8\nmax_total = 16\nmin_per_worker = 8\n",
            "could never run",
        );
        check(
            "id = \"b\"\ncommand = [\"t\"]\narch = \"ps\"\n[batch]\nreference = 8\nmax_total = 16\n",
            "jobs only",
        );
        check(
            &format!("{base}[env]\nCONVERGE_BATCH_SIZE = \"3\"\n"),
            "may not set CONVERGE_BATCH_SIZE",
        );
    }

    /// A micro-batch per GPU type: parsed, used on the types it names (`max_per_worker`
    /// elsewhere), and refused when it is 0, below `min_per_worker` or keyed by a type name
    /// hosts cannot carry.
    #[test]
    fn micro_batches_per_gpu_type_parse_apply_and_are_checked() {
        let base = "id = \"b\"\ncommand = [\"t\"]\n[batch]\nreference = 64\nmax_total = 1024\nmin_per_worker = 4\nmax_per_worker = 12\n";
        let s = JobSpec::from_toml(&format!(
            "{base}max_per_worker_by_gpu_type = {{ a100 = 48 }}\n"
        ))
        .unwrap();
        let b = s.batch.unwrap();
        assert_eq!(b.max_per_worker_on(Some("a100")), 48);
        assert_eq!(b.max_per_worker_on(Some("t4")), 12);
        assert_eq!(b.max_per_worker_on(None), 12);
        assert!(
            JobSpec::from_toml(base)
                .unwrap()
                .batch
                .unwrap()
                .max_per_worker_by_gpu_type
                .is_empty()
        );
        for (entry, expect) in [
            ("a100 = 0", "`max_per_worker_by_gpu_type.a100` is 0"),
            (
                "a100 = 2",
                "`min_per_worker` (4) is above `max_per_worker_by_gpu_type.a100` (2)",
            ),
            ("\"a 100\" = 48", "`max_per_worker_by_gpu_type.a 100`"),
            ("a100 = -1", "invalid value"),
        ] {
            check(
                &format!("{base}max_per_worker_by_gpu_type = {{ {entry} }}\n"),
                expect,
            );
        }
    }

    #[test]
    fn the_example_specs_are_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/jobs");
        let mut adaptive = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            let spec = JobSpec::from_toml(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"));
            adaptive += usize::from(spec.batch.is_some());
        }
        assert!(adaptive >= 2, "at least two example jobs adapt their batch");
    }

    #[test]
    fn minimal_spec_gets_defaults() {
        let s = JobSpec::from_toml("id = \"j1\"\ncommand = [\"true\"]\n").unwrap();
        assert_eq!(
            (s.gpus_per_worker, s.min_workers, s.max_workers()),
            (1, 1, 1)
        );
        assert_eq!(s.arch, SyncArch::Ring);
        assert_eq!(s.max_restarts, 3);
    }

    #[test]
    fn refusals_say_why() {
        check("id = \"j\"\ncommand = [\"t\"]\nmax_workers = 4\n", "ok");
        check(
            "id = \"j\"\ncommand = [\"t\"]\nmax_workers = 4\nworkers = 2\n",
            "ok",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\nmin_workers = 2\nmax_workers = 4\nworkers = 5\n",
            "`workers` (5) must be between `min_workers` (2) and `max_workers` (4)",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\nmin_workers = 2\nmax_workers = 4\nworkers = 1\n",
            "`workers` (1)",
        );
        check("id = \"j.x\"\ncommand = [\"t\"]\n", "'.'");
        check("id = \"j\"\ncommand = []\n", "`command` is empty");
        check(
            "id = \"j\"\ncommand = [\"t\"]\ngpus_per_worker = 0\n",
            "gpus_per_worker",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\nmin_workers = 3\nmax_workers = 2\n",
            "max_workers",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\n[env]\nRANK = \"0\"\n",
            "may not set RANK",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\n[env]\n\"A-B\" = \"0\"\n",
            "not a valid",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\ntarget_loss = nan\n",
            "finite",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\nwork_samples = 1_500_000\n",
            "ok",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\nwork_samples = 0\n",
            "`work_samples` must be above 0",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\nwork_samples = -5\n",
            "work_samples",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\ngpu = 1\n",
            "unknown field `gpu`",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\narch = \"mesh\"\n",
            "unknown variant `mesh`",
        );
        check("command = [\"t\"]\n", "missing field `id`");
    }

    #[test]
    fn hostile_specs_are_refused_with_the_reason() {
        check(
            "id = \"j\"\ncommand = [\"t\", \"a\\u0000b\"]\n",
            "`command` argument 1 holds a NUL byte",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\n[env]\nX = \"a\\u0000\"\n",
            "`env` value of X holds a NUL byte",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\nmax_restarts = 4294967295\n",
            "`max_restarts` is 4294967295; it must be at most 100",
        );
        check("id = \"j\"\ncommand = [\"t\"]\nmax_restarts = 100\n", "ok");
        check(
            "id = \"j\"\ncommand = [\"t\"]\n[labels]\nmodel = \"\\u001b[2Jx\"\n",
            "`labels` \"model\" = \"\\u{1b}[2Jx\" holds a control character",
        );
        check(
            "id = \"j\"\ncommand = [\"t\"]\n[labels]\nmodel = \"résumé-π\"\n",
            "ok",
        );
    }

    #[test]
    fn gpu_types_parse_restrict_hosts_and_bad_lists_are_refused() {
        let base = "id = \"g\"\ncommand = [\"t\"]\n";
        let any = JobSpec::from_toml(base).unwrap();
        assert!(any.gpu_types.is_none() && !any.restricts_hosts());
        let spec =
            JobSpec::from_toml(&format!("{base}gpu_types = [\"a100\", \"h100\"]\n")).unwrap();
        assert_eq!(
            spec.gpu_types.as_deref(),
            Some(&["a100".to_string(), "h100".to_string()][..])
        );
        assert!(spec.restricts_hosts());
        let host = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(spec.allows_host(&host(&[("gpu.type", "a100")])));
        assert!(!spec.allows_host(&host(&[("gpu.type", "t4")])));
        assert!(
            !spec.allows_host(&host(&[("gpu.count", "0")])),
            "a host without GPUs"
        );
        // An older agent without gpu.type: the type comes from its model.
        assert!(spec.allows_host(&host(&[("gpu.model", "NVIDIA-H100-80GB-HBM3")])));
        assert!(any.allows_host(&host(&[("gpu.type", "t4")])));
        // With a selector, both must hold.
        let both = JobSpec::from_toml(&format!(
            "{base}gpu_types = [\"t4\"]\n[selector]\nzone = \"a\"\n"
        ))
        .unwrap();
        assert!(both.allows_host(&host(&[("gpu.type", "t4"), ("zone", "a")])));
        assert!(!both.allows_host(&host(&[("gpu.type", "t4"), ("zone", "b")])));
        assert!(!both.allows_host(&host(&[("gpu.type", "a100"), ("zone", "a")])));
        for (line, want) in [
            ("gpu_types = []", "`gpu_types`: the list is empty"),
            ("gpu_types = [\"t4\", \"t4\"]", "\"t4\" is listed twice"),
            ("gpu_types = [\"\"]", "may not be empty"),
            ("gpu_types = [\"a b\"]", "is not valid"),
            ("gpu_types = \"t4\"", "invalid type"),
            ("gpu_type = [\"t4\"]", "unknown field `gpu_type`"),
        ] {
            let e = JobSpec::from_toml(&format!("{base}{line}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{line}: {e}");
        }
    }

    #[test]
    fn selectors_parse_and_bad_pairs_are_refused() {
        let base = "id = \"s\"\ncommand = [\"t\"]\n";
        let plain = JobSpec::from_toml(base).unwrap();
        assert!(plain.selector.is_empty());
        let json = serde_json::to_value(&plain).unwrap();
        assert!(
            json.get("selector").is_none(),
            "an empty selector is not written (older readers refuse unknown fields)"
        );
        let s = JobSpec::from_toml(&format!(
            "{base}[selector]\nzone = \"a\"\n\"gpu.model\" = \"NVIDIA-H100-80GB-HBM3\"\n"
        ))
        .unwrap();
        assert_eq!(s.selector["zone"], "a");
        assert_eq!(s.selector["gpu.model"], "NVIDIA-H100-80GB-HBM3");
        let back: JobSpec = serde_json::from_value(serde_json::to_value(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        for (table, expect) in [
            ("\"bad key\" = \"a\"", "label key \"bad key\" is not valid"),
            ("zone = \"a b\"", "value \"a b\" is not valid"),
            ("zone = 3", "invalid type"),
        ] {
            check(&format!("{base}[selector]\n{table}\n"), expect);
        }
        let many: String = (0..65).map(|i| format!("k{i} = \"v\"\n")).collect();
        check(
            &format!("{base}[selector]\n{many}"),
            "`[selector]`: 65 labels",
        );
    }

    #[test]
    fn stop_tables_parse_and_impossible_criteria_are_refused() {
        let base = "id = \"s\"\ncommand = [\"t\"]\n";
        let s = JobSpec::from_toml(&format!(
            "{base}[stop]\ntarget_loss = 0.3\ndeadline_s = 600\nmax_gpu_hours = 0.5\n[stop.plateau]\nmin_improvement = 0.01\nwindow_epochs = 3\n"
        ))
        .unwrap();
        let stop = s.stop.unwrap();
        assert_eq!(stop.target_loss, Some(0.3));
        assert_eq!(s.target_loss(), Some(0.3));
        assert_eq!(
            stop.plateau,
            Some(PlateauSpec {
                min_improvement: 0.01,
                window_epochs: 3.0
            })
        );
        assert_eq!(
            (stop.deadline_s, stop.max_gpu_hours),
            (Some(600.0), Some(0.5))
        );
        let legacy = JobSpec::from_toml(&format!("{base}target_loss = 0.2\n")).unwrap();
        assert_eq!(legacy.target_loss(), Some(0.2));
        for (table, expect) in [
            ("max_gpu_hours = -1", "`max_gpu_hours` is -1"),
            ("max_gpu_hours = 0", "positive number of GPU-hours"),
            ("deadline_s = 0", "`deadline_s` is 0"),
            ("deadline_s = inf", "`deadline_s` is inf"),
            ("target_loss = nan", "finite"),
            (
                "[stop.plateau]\nmin_improvement = 0.01\nwindow_epochs = 0",
                "`plateau.window_epochs` is 0",
            ),
            (
                "[stop.plateau]\nmin_improvement = 0\nwindow_epochs = 2",
                "`plateau.min_improvement` is 0",
            ),
            (
                "[stop.plateau]\nmin_improvement = 1.5\nwindow_epochs = 2",
                "in (0, 1)",
            ),
            (
                "[stop.plateau]\nmin_improvement = 0.1",
                "missing field `window_epochs`",
            ),
            ("", "the table is empty"),
            ("budget = 3", "unknown field `budget`"),
        ] {
            check(&format!("{base}[stop]\n{table}\n"), expect);
        }
        check(
            &format!("{base}target_loss = 0.1\n[stop]\ntarget_loss = 0.2\n"),
            "given twice",
        );
    }
}

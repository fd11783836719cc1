//! Message types of protocol v1. Every top-level message has a `protocol` field that must
//! equal [`PROTOCOL_VERSION`]; [`crate::codec::decode`] checks size, JSON shape, version and
//! content.
//!
//! Units are in field names or docs: times are UNIX seconds (f64), sizes bytes, rates per
//! second, power milliwatts, utilization percent (0–100).

use crate::codec::{Message, PROTOCOL_VERSION, default_protocol};
use crate::ids::{HostId, JobId};
use crate::jobspec::JobSpec;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

fn finite(name: &str, x: f64) -> Result<(), String> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(format!("{name} must be a finite number, got {x}"))
    }
}

// ---------------------------------------------------------------------------------------
// Telemetry
// ---------------------------------------------------------------------------------------

/// One GPU as seen by the agent (NVML or the fake source).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    /// NVML index on the host, 0-based; the value used in `CUDA_VISIBLE_DEVICES`.
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total_bytes: u64,
    pub memory_used_bytes: u64,
    /// GPU utilization over the last sample period, percent (DCGM_FI_DEV_GPU_UTIL).
    pub utilization_pct: f64,
    /// Board power draw in milliwatts, when the source reports it.
    pub power_mw: Option<u64>,
    /// Streaming-multiprocessor clock in MHz (DCGM_FI_DEV_SM_CLOCK), when the source reports
    /// it; absent in telemetry from agents older than the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_clock_mhz: Option<u32>,
}

impl GpuSample {
    /// GPU `index` at rest: `memory_total_bytes` of memory, none used, 0 % utilization, no
    /// power or clock reading. For simulated hosts, load generators and tests.
    pub fn idle(
        index: u32,
        uuid: impl Into<String>,
        name: impl Into<String>,
        memory_total_bytes: u64,
    ) -> Self {
        Self {
            index,
            uuid: uuid.into(),
            name: name.into(),
            memory_total_bytes,
            memory_used_bytes: 0,
            utilization_pct: 0.0,
            power_mw: None,
            sm_clock_mhz: None,
        }
    }
}

/// One network interface.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NicSample {
    pub name: String,
    pub rx_bytes_per_s: f64,
    pub tx_bytes_per_s: f64,
    /// Negotiated link speed in bits per second, when the driver reports one.
    #[serde(default)]
    pub link_speed_bps: Option<u64>,
}

/// Supervision state of one worker process on a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerPhase {
    /// Process is running.
    Running,
    /// Exited non-zero; waiting out its backoff before a restart.
    Backoff,
    /// SIGTERM sent; waiting for it to exit (SIGKILL after the grace period).
    Stopping,
    /// Exited 0. Kept until the plan drops it.
    Succeeded,
    /// Exited non-zero more often than its restart limit; not restarted again.
    Failed,
}

impl WorkerPhase {
    /// Whether a process may still exist (so its GPUs and the job's checkpoint are in use).
    pub fn is_alive(self) -> bool {
        matches!(self, WorkerPhase::Running | WorkerPhase::Stopping)
    }
}

/// One worker's state in a telemetry message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerState {
    pub job: JobId,
    pub generation: u64,
    pub rank: u32,
    pub phase: WorkerPhase,
    pub pid: Option<u32>,
    /// Restarts of this worker within its generation.
    pub restarts: u32,
    pub last_exit_code: Option<i32>,
    pub gpus: Vec<u32>,
}

/// A host's telemetry and heartbeat, published every telemetry interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostTelemetry {
    #[serde(default = "default_protocol")]
    pub protocol: u32,
    pub host: HostId,
    /// Address other hosts reach this host at (used as `MASTER_ADDR` when it holds rank 0).
    pub addr: String,
    /// Time of the sample (UNIX seconds, agent's clock).
    pub time: f64,
    /// Agent version (crate version).
    pub agent_version: String,
    /// `"nvml"` or `"fake"`.
    pub gpu_source: String,
    pub gpus: Vec<GpuSample>,
    pub nics: Vec<NicSample>,
    /// Host CPU utilization, percent of all cores.
    pub cpu_pct: f64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub workers: Vec<WorkerState>,
    /// `CONVERGE_PROGRESS` lines this agent could not parse since it started.
    pub malformed_progress_lines: u64,
    /// Progress lines whose gradient statistics (`grad_sqr`, `grad_var`) were missing one of
    /// the two, not numbers, negative or both 0, since the agent started: the statistics
    /// were dropped, the rest of the line reported (absent in older agents' telemetry).
    #[serde(default)]
    pub ignored_gradient_stats: u64,
    /// Progress reports of this host's workers not sent since the agent started: replaced by
    /// a newer report of the same worker while it printed faster than the agent's per-worker
    /// rate limit, dropped with the outbox (or the job's queue there) full, or given up
    /// after 30 s of retries (absent in older agents' telemetry).
    #[serde(default)]
    pub skipped_progress_reports: u64,
    /// The host's labels (`gpu.model`, `gpu.memory`, `gpu.count` and the agent's custom
    /// `--label`s), which job selectors match ([`crate::labels`]); absent from older
    /// agents' telemetry (no labels). Checked: a bad key or value, or more than
    /// [`crate::labels::MAX_LABELS`], refuses the message.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

impl HostTelemetry {
    /// A heartbeat of `host`, reachable at `addr`, stamped `time` (UNIX seconds, the agent's
    /// clock), with nothing on it: this protocol version, no GPUs, NICs, workers or labels,
    /// zero usage and counters, `gpu_source` `"fake"` and an empty agent version. For
    /// simulated hosts, load generators and tests; set what matters with struct update syntax
    /// (`HostTelemetry { gpus, ..HostTelemetry::new(host, addr, time) }`).
    pub fn new(host: HostId, addr: impl Into<String>, time: f64) -> Self {
        Self {
            protocol: PROTOCOL_VERSION,
            host,
            addr: addr.into(),
            time,
            agent_version: String::new(),
            gpu_source: "fake".into(),
            gpus: Vec::new(),
            nics: Vec::new(),
            cpu_pct: 0.0,
            memory_used_bytes: 0,
            memory_total_bytes: 0,
            workers: Vec::new(),
            malformed_progress_lines: 0,
            ignored_gradient_stats: 0,
            skipped_progress_reports: 0,
            labels: BTreeMap::new(),
        }
    }
}

impl Message for HostTelemetry {
    fn protocol(&self) -> u32 {
        self.protocol
    }
    fn validate(&self) -> Result<(), String> {
        finite("time", self.time)?;
        finite("cpu_pct", self.cpu_pct)?;
        for g in &self.gpus {
            finite("utilization_pct", g.utilization_pct)?;
        }
        for n in &self.nics {
            finite("rx_bytes_per_s", n.rx_bytes_per_s)?;
            finite("tx_bytes_per_s", n.tx_bytes_per_s)?;
        }
        crate::labels::validate(&self.labels).map_err(|e| format!("labels: {e}"))?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Progress
// ---------------------------------------------------------------------------------------

/// The JSON a worker prints after `CONVERGE_PROGRESS ` on stdout (worker contract), and
/// the figures of a [`ProgressReport`] (its `line`). Written, the gradient statistics and
/// ShadowSync figures are left out when absent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerProgressLine {
    /// Optimizer steps since the job began (continues across generations).
    pub step: u64,
    /// Training samples processed since the job began (continues across generations).
    pub samples: u64,
    /// Training loss (mean over the steps since the previous line).
    pub loss: f64,
    /// Held-out loss, when the worker evaluated one at this step.
    #[serde(default)]
    pub eval_loss: Option<f64>,
    /// Epochs of data processed (samples / training-set size), when known.
    #[serde(default)]
    pub epoch: Option<f64>,
    /// Seconds per optimizer step the worker spent synchronizing gradients or parameters
    /// (the ring all-reduce, or the push and pull of parameter-server mode), mean over the
    /// steps since the previous line; 0 for a single worker. Finite and >= 0 when present.
    #[serde(default)]
    pub sync_s: Option<f64>,
    /// Bytes of the parameters the job synchronizes (the model size), when known.
    #[serde(default)]
    pub model_bytes: Option<u64>,
    /// Squared L2 norm of the true (mean per-sample) gradient, an unbiased estimate over the
    /// steps since the previous line (AdaptDL's `grad_sqr`). With `grad_var`; see
    /// [`GradientReading`]. `null`, `NaN` or `Infinity` read as not a number.
    #[serde(
        default,
        deserialize_with = "number_or_nan",
        skip_serializing_if = "Option::is_none"
    )]
    pub grad_sqr: Option<f64>,
    /// Trace of the covariance of one sample's gradient (so a gradient averaged over `b`
    /// samples has variance `grad_var / b`), same window; `grad_var / grad_sqr` is the
    /// gradient noise scale in samples.
    #[serde(
        default,
        deserialize_with = "number_or_nan",
        skip_serializing_if = "Option::is_none"
    )]
    pub grad_var: Option<f64>,
    /// ShadowSync workers (trainer `--shadow`): background synchronization rounds completed
    /// per second since the previous line; their step time excludes synchronization, so
    /// contention shows here instead. Finite and >= 0 when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_rounds_per_s: Option<f64>,
    /// ShadowSync workers: mean relative distance `||local - synchronized|| / max(||local||,
    /// ||synchronized||)` between the worker's model and the synchronized one over those
    /// rounds (0 to 2). Finite and >= 0 when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_gap: Option<f64>,
}

/// What a bare `NaN`, `Infinity` or `-Infinity` of a progress line is read as (see
/// [`WorkerProgressLine::parse`]): only the gradient statistics accept it.
const NOT_A_NUMBER: &str = "\u{1}converge-not-a-number";

/// A present field that is `null` (or a bare `NaN`/`Infinity`) reads as NaN, so that a
/// worker's non-numeric statistics are told apart from absent ones (`#[serde(default)]`
/// covers absence).
fn number_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    use serde::de::Error;
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::Number(n) => Ok(Some(n.as_f64().unwrap_or(f64::NAN))),
        serde_json::Value::Null => Ok(Some(f64::NAN)),
        serde_json::Value::String(s) if s == NOT_A_NUMBER => Ok(Some(f64::NAN)),
        other => Err(D::Error::custom(format!("expected a number, got {other}"))),
    }
}

/// What a progress line says about the gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GradientReading {
    /// No statistics (neither field): the program does not report them.
    Absent,
    /// Both present, finite, `>= 0` and not both 0.
    Valid { sqr: f64, var: f64 },
    /// One missing, not a number, negative, infinite, or both 0: counted and ignored.
    Invalid,
}

impl GradientReading {
    /// Classifies a pair of optional statistics.
    pub fn of(sqr: Option<f64>, var: Option<f64>) -> Self {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        match (sqr, var) {
            (None, None) => GradientReading::Absent,
            (Some(s), Some(v)) if ok(s) && ok(v) && s + v > 0.0 => {
                GradientReading::Valid { sqr: s, var: v }
            }
            _ => GradientReading::Invalid,
        }
    }

    /// The statistics if valid.
    pub fn valid(self) -> Option<(f64, f64)> {
        match self {
            GradientReading::Valid { sqr, var } => Some((sqr, var)),
            _ => None,
        }
    }
}

/// `s` with the bare JSON-incompatible tokens `NaN`, `Infinity` and `-Infinity` that
/// Python's `json.dumps` writes (outside strings) replaced by the string [`NOT_A_NUMBER`],
/// which only the gradient statistics accept; `None` if there are none.
fn nan_tokens_to_null(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let (mut out, mut in_string, mut escaped, mut changed, mut i) =
        (String::with_capacity(s.len()), false, false, false, 0);
    while i < bytes.len() {
        let c = bytes[i];
        if in_string {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_string = false;
            }
        } else if c == b'"' {
            in_string = true;
        } else {
            let rest = &s[i..];
            if let Some(token) = ["-Infinity", "Infinity", "NaN"]
                .into_iter()
                .find(|t| rest.starts_with(t))
            {
                out.push_str(&serde_json::to_string(NOT_A_NUMBER).expect("a string serializes"));
                i += token.len();
                changed = true;
                continue;
            }
        }
        // Multi-byte characters are copied byte-wise through their `char`.
        let ch = rest_char(s, i);
        out.push(ch);
        i += ch.len_utf8();
    }
    changed.then_some(out)
}

fn rest_char(s: &str, i: usize) -> char {
    s[i..].chars().next().expect("index on a char boundary")
}

/// Prefix of a progress line on a worker's stdout.
pub const PROGRESS_LINE_PREFIX: &str = "CONVERGE_PROGRESS ";

impl WorkerProgressLine {
    /// Parses one stdout line. `Ok(None)` if the line is not a progress line at all.
    pub fn parse(line: &str) -> Result<Option<Self>, String> {
        let Some(rest) = line.trim().strip_prefix(PROGRESS_LINE_PREFIX.trim_end()) else {
            return Ok(None);
        };
        if !(rest.is_empty() || rest.starts_with(char::is_whitespace)) {
            return Ok(None);
        }
        let text = rest.trim();
        let p: WorkerProgressLine = match serde_json::from_str(text) {
            Ok(p) => p,
            // Python's json.dumps writes NaN and Infinity bare: the gradient statistics read
            // them as not a number (ignored and counted, the rest of the line intact); in
            // any other field they still make the line malformed.
            Err(e) => match nan_tokens_to_null(text) {
                Some(fixed) => {
                    serde_json::from_str(&fixed).map_err(|_| format!("bad progress JSON: {e}"))?
                }
                None => return Err(format!("bad progress JSON: {e}")),
            },
        };
        finite("loss", p.loss)?;
        if let Some(e) = p.eval_loss {
            finite("eval_loss", e)?;
        }
        if let Some(s) = p.sync_s {
            sync_time("sync_s", s)?;
        }
        if let Some(r) = p.sync_rounds_per_s {
            sync_time("sync_rounds_per_s", r)?;
        }
        if let Some(g) = p.model_gap {
            sync_time("model_gap", g)?;
        }
        Ok(Some(p))
    }

    /// The line's gradient statistics, classified.
    pub fn gradient(&self) -> GradientReading {
        GradientReading::of(self.grad_sqr, self.grad_var)
    }
}

/// One progress report on `converge.v1.progress.<job>`: a worker's progress line plus who
/// and when.
///
/// On the wire the line's keys sit beside the report's own (`#[serde(flatten)]`), with one
/// renaming: the line's `sync_s` is the report's `sync_time_s`. A
/// report's JSON is thus what it was when the report repeated the line's fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressReport {
    #[serde(default = "default_protocol")]
    pub protocol: u32,
    pub job: JobId,
    pub generation: u64,
    pub rank: u32,
    pub host: HostId,
    /// The worker's progress line as the agent copied it: its step, samples, loss and
    /// optional figures. Its `sync_s` (seconds per optimizer step spent synchronizing,
    /// finite and >= 0) is the wire's `sync_time_s`. Its `grad_sqr` and `grad_var` are
    /// copied by the agent only when both are valid ([`GradientReading::Valid`]); a report
    /// whose pair is not valid is still accepted: the allocator ignores and counts the pair,
    /// never the loss. `sync_rounds_per_s` and `model_gap` are a ShadowSync job's
    /// (`arch = "shadow"`), absent for other jobs and in reports of older agents.
    #[serde(flatten, with = "report_line")]
    pub line: WorkerProgressLine,
    /// When the agent read the line (UNIX seconds).
    pub time: f64,
    /// Data-parallel workers of the generation (parameter-server shards not counted), from
    /// the worker's assignment; absent in reports of agents older than this field.
    #[serde(default)]
    pub workers: Option<u32>,
    /// Hosts the generation's workers span, from the worker's assignment.
    #[serde(default)]
    pub hosts: Option<u32>,
}

/// How a [`ProgressReport`] writes and reads its [`WorkerProgressLine`]: the line's keys,
/// with `sync_s` named `sync_time_s`, the report's name for it since before the report
/// held the line.
///
/// Reading keeps what reports read before they held the line: a `sync_s` key is not a
/// report's (ignored), and a `null` `grad_sqr` or `grad_var` is absent (in a worker's line
/// it is not a number, [`GradientReading::Invalid`]).
mod report_line {
    use super::WorkerProgressLine;
    use serde::de::Error as _;
    use serde::ser::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use serde_json::{Map, Value};

    pub fn serialize<S: Serializer>(line: &WorkerProgressLine, s: S) -> Result<S::Ok, S::Error> {
        let Value::Object(mut map) = serde_json::to_value(line).map_err(S::Error::custom)? else {
            return Err(S::Error::custom("a progress line serializes to an object"));
        };
        if let Some(sync) = map.remove("sync_s") {
            map.insert("sync_time_s".into(), sync);
        }
        map.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<WorkerProgressLine, D::Error> {
        let mut map = Map::<String, Value>::deserialize(d)?;
        map.remove("sync_s");
        if let Some(sync) = map.remove("sync_time_s") {
            map.insert("sync_s".into(), sync);
        }
        for key in ["grad_sqr", "grad_var"] {
            if map.get(key) == Some(&Value::Null) {
                map.remove(key);
            }
        }
        serde_json::from_value(Value::Object(map)).map_err(D::Error::custom)
    }
}

impl WorkerProgressLine {
    /// A line with the required figures and every optional one absent.
    pub fn new(step: u64, samples: u64, loss: f64) -> Self {
        Self {
            step,
            samples,
            loss,
            eval_loss: None,
            epoch: None,
            sync_s: None,
            model_bytes: None,
            grad_sqr: None,
            grad_var: None,
            sync_rounds_per_s: None,
            model_gap: None,
        }
    }
}

impl ProgressReport {
    /// A report of the current protocol with the required fields; every optional field
    /// (`workers`, `hosts` and the line's `eval_loss`, `epoch`, `sync_s`, `model_bytes`,
    /// gradient statistics and ShadowSync figures) absent.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        job: JobId,
        generation: u64,
        rank: u32,
        host: HostId,
        step: u64,
        samples: u64,
        loss: f64,
        time: f64,
    ) -> Self {
        Self {
            protocol: PROTOCOL_VERSION,
            job,
            generation,
            rank,
            host,
            line: WorkerProgressLine::new(step, samples, loss),
            time,
            workers: None,
            hosts: None,
        }
    }

    /// The report's gradient statistics, classified.
    pub fn gradient(&self) -> GradientReading {
        self.line.gradient()
    }

    /// The report's JetStream message id (`Nats-Msg-Id`): job, host, generation, rank,
    /// step, and a hash of the encoded report, so that a retry of one report is the same id
    /// and two different reports never are (a restarted agent re-sending one is dropped
    /// too). The hash is the standard library's SipHash with fixed keys: stable for one
    /// build.
    pub fn msg_id(&self) -> String {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::hash::DefaultHasher::new();
        crate::codec::encode(self).hash(&mut hasher);
        format!(
            "{}.{}.g{}.r{}.s{}.{:016x}",
            self.job,
            self.host,
            self.generation,
            self.rank,
            self.line.step,
            hasher.finish()
        )
    }
}

impl Message for ProgressReport {
    fn protocol(&self) -> u32 {
        self.protocol
    }
    fn validate(&self) -> Result<(), String> {
        let line = &self.line;
        finite("loss", line.loss)?;
        finite("time", self.time)?;
        if let Some(e) = line.eval_loss {
            finite("eval_loss", e)?;
        }
        // The line's `sync_s`, named as on the wire.
        if let Some(s) = line.sync_s {
            sync_time("sync_time_s", s)?;
        }
        if let Some(r) = line.sync_rounds_per_s {
            sync_time("sync_rounds_per_s", r)?;
        }
        if let Some(g) = line.model_gap {
            sync_time("model_gap", g)?;
        }
        Ok(())
    }
}

/// A synchronization figure (a time, a rate, a distance): finite and not negative.
fn sync_time(name: &str, x: f64) -> Result<(), String> {
    finite(name, x)?;
    if x < 0.0 {
        return Err(format!("{name} must not be negative, got {x}"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Plans
// ---------------------------------------------------------------------------------------

/// One worker the allocator wants running on a host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerAssignment {
    pub job: JobId,
    /// The job's generation: bumped on every allocation change; workers of other
    /// generations are stopped (fencing).
    pub generation: u64,
    pub rank: u32,
    pub world_size: u32,
    pub local_rank: u32,
    pub local_world_size: u32,
    /// GPU indices on this host, in `CUDA_VISIBLE_DEVICES` order.
    pub gpus: Vec<u32>,
    pub master_addr: String,
    pub master_port: u16,
    /// Program and arguments.
    pub command: Vec<String>,
    /// Extra environment from the job spec.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Non-zero exits tolerated (with backoff) before the worker is marked failed.
    pub max_restarts: u32,
    /// Parameter-server shards among the job's `world_size` processes (the last ranks;
    /// they get no GPU); 0 for ring all-reduce jobs. Passed as `CONVERGE_NUM_PS`.
    #[serde(default)]
    pub num_ps: u32,
    /// Hosts the job's workers span in this generation (0 when not given); copied into
    /// progress reports for the allocator's throughput model.
    #[serde(default)]
    pub hosts: u32,
    /// The batch the worker runs (jobs with a `[batch]` table only; absent in older plans
    /// and for other jobs). Passed as `CONVERGE_BATCH_SIZE`, `CONVERGE_ACCUM_STEPS`,
    /// `CONVERGE_TOTAL_BATCH` and `CONVERGE_REFERENCE_BATCH`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<AssignedBatch>,
    /// Index of this host among the job's hosts, ordered by the lowest rank each runs (0 on
    /// rank 0's host): torchrun's node rank, passed as `GROUP_RANK`. Absent in older plans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_rank: Option<u32>,
    /// The `[shadow]` table of an `arch = "shadow"` job (absent for other jobs and in older
    /// plans): the agent sets `CONVERGE_SYNC=shadow` and the table's variables
    /// ([`crate::jobspec::SHADOW_ENV`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<crate::ShadowSpec>,
}

/// A generation's batch, in samples: `total = workers × per_worker × (accum_steps + 1)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssignedBatch {
    /// Samples per optimizer step over all workers.
    pub total: u32,
    /// Samples per worker per forward/backward pass (micro-batch).
    pub per_worker: u32,
    /// Extra micro-batches each worker accumulates per optimizer step (0 = none).
    pub accum_steps: u32,
    /// The job's `[batch] reference` (`B₀`), the total its learning rate was tuned for.
    pub reference: u32,
}

impl AssignedBatch {
    /// Whether the figures agree with `workers` data-parallel workers.
    pub fn check(&self, workers: u32) -> Result<(), String> {
        let expect =
            u64::from(workers) * u64::from(self.per_worker) * (u64::from(self.accum_steps) + 1);
        if self.per_worker == 0 || self.reference == 0 || u64::from(self.total) != expect {
            return Err(format!(
                "batch {} is not {workers} workers × {} × ({} + 1) with a positive reference",
                self.total, self.per_worker, self.accum_steps
            ));
        }
        Ok(())
    }
}

/// The desired workers of one host (KV `converge-plans`, key = host id). Level-triggered:
/// the agent reconciles to the latest value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostPlan {
    #[serde(default = "default_protocol")]
    pub protocol: u32,
    pub host: HostId,
    pub workers: Vec<WorkerAssignment>,
}

impl Message for HostPlan {
    fn protocol(&self) -> u32 {
        self.protocol
    }
    fn validate(&self) -> Result<(), String> {
        for w in &self.workers {
            if w.rank >= w.world_size {
                return Err(format!("rank {} >= world size {}", w.rank, w.world_size));
            }
            if w.local_rank >= w.local_world_size {
                return Err(format!(
                    "local rank {} >= local world size {}",
                    w.local_rank, w.local_world_size
                ));
            }
            if w.command.is_empty() {
                return Err(format!("worker {}/{} has an empty command", w.job, w.rank));
            }
            if w.num_ps >= w.world_size {
                return Err(format!(
                    "worker {}/{}: {} parameter-server shards leave no worker in a world of {}",
                    w.job, w.rank, w.num_ps, w.world_size
                ));
            }
            if let Some(b) = &w.batch {
                b.check(w.world_size - w.num_ps)
                    .map_err(|e| format!("worker {}/{}: {e}", w.job, w.rank))?;
            }
        }
        let mut keys: Vec<_> = self.workers.iter().map(|w| (&w.job, w.rank)).collect();
        keys.sort();
        if keys.windows(2).any(|p| p[0] == p[1]) {
            return Err("a (job, rank) appears twice in the plan".into());
        }
        let mut gpus: Vec<u32> = self.workers.iter().flat_map(|w| w.gpus.clone()).collect();
        gpus.sort_unstable();
        if gpus.windows(2).any(|p| p[0] == p[1]) {
            return Err("a GPU is given to two workers".into());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Jobs
// ---------------------------------------------------------------------------------------

/// A job spec as stored in KV `converge-jobs` (written by the CLI).
impl Message for JobSpec {
    fn protocol(&self) -> u32 {
        self.protocol
    }
    fn validate(&self) -> Result<(), String> {
        JobSpec::validate(self).map_err(|e| e.to_string())
    }
}

/// Lifecycle phase of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobPhase {
    /// Admitted, waiting for GPUs.
    Pending,
    /// Workers of the current generation are planned.
    Running,
    /// Allocation changed: waiting for the previous generation's workers to exit before
    /// the new generation is planned.
    Restarting,
    Completed,
    Failed,
    Cancelled,
}

impl JobPhase {
    /// The phase as written on the wire (`pending`, `running`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            JobPhase::Pending => "pending",
            JobPhase::Running => "running",
            JobPhase::Restarting => "restarting",
            JobPhase::Completed => "completed",
            JobPhase::Failed => "failed",
            JobPhase::Cancelled => "cancelled",
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobPhase::Completed | JobPhase::Failed | JobPhase::Cancelled
        )
    }
}

/// Where one rank of a job runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankPlacement {
    pub rank: u32,
    pub host: HostId,
    pub gpus: Vec<u32>,
}

/// A fitted loss curve `loss(k)` with `k` = samples processed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FittedCurve {
    /// `inv_quadratic` = 1/(a·k²+b·k+c)+d, `inv_linear` = 1/(a·k+b)+c,
    /// `exp` = A·e^(−a·k)+b (SLAQ's e^(−a·k)+b with an amplitude, for any loss scale).
    pub family: String,
    /// Parameters with `k` in samples: `[a, b, c, d]`, `[a, b, c]`, or `[a, b, A]` for `exp`.
    pub params: Vec<f64>,
    /// Weighted root-mean-square error of the fit, in loss units.
    pub rmse: f64,
    /// Points the fit used.
    pub points: usize,
}

/// A job's status (KV `converge-job-status`, key = job id; written by the allocator only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    #[serde(default = "default_protocol")]
    pub protocol: u32,
    pub job: JobId,
    pub phase: JobPhase,
    /// 0 until the job is first placed; +1 on every allocation change.
    pub generation: u64,
    /// Workers of the current generation (0 while pending).
    pub world_size: u32,
    pub placement: Vec<RankPlacement>,
    /// Parameter-server shards of an `arch = "ps"` job (ranks `world_size..`, no GPUs), as
    /// the allocator's planner placed them; empty for ring jobs, and for PS jobs placed
    /// before this field existed (their shards then sit one per worker host).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ps_placement: Vec<RankPlacement>,
    /// Address of rank 0's host when the generation was placed (`MASTER_ADDR`); when that
    /// host comes back under another address, the job restarts as a new generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    pub step: u64,
    pub samples: u64,
    pub first_loss: Option<f64>,
    pub loss: Option<f64>,
    pub eval_loss: Option<f64>,
    /// Samples per epoch, as the job's own reports imply (`samples / epoch` of a rank-0
    /// report that carried `epoch`); absent before one did, and in statuses written before
    /// the field existed. `samples / epoch_samples` is the epoch the job is in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch_samples: Option<f64>,
    pub curve: Option<FittedCurve>,
    /// Loss the fitted curve predicts one horizon ahead at the current allocation.
    pub predicted_loss: Option<f64>,
    /// Observed throughput of the current allocation, samples per second.
    pub samples_per_s: Option<f64>,
    /// Observed seconds per step of the current generation (rank 0's reports).
    #[serde(default)]
    pub step_time_s: Option<f64>,
    /// Seconds per step the allocator's throughput model, fitted on the job's earlier
    /// generations only, predicts for the current world size and servers spanned; `None`
    /// while the job has not run in an earlier generation.
    #[serde(default)]
    pub predicted_step_time_s: Option<f64>,
    pub submitted_at: f64,
    pub started_at: Option<f64>,
    pub finished_at: Option<f64>,
    pub updated_at: f64,
    /// Why the job is in its phase (failure reason, cancellation...), for humans.
    pub message: Option<String>,
    /// The batch of a job with a `[batch]` table (absent for other jobs and in statuses
    /// written before the field existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<JobBatch>,
    /// How a finished job ended, when it ended by the allocator's stop criteria or by its
    /// program (absent while it runs, and for cancelled or failed jobs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<JobEnd>,
    /// The job's latest allocation changes, oldest first, at most
    /// [`MAX_ALLOCATION_CHANGES`] (older ones are dropped): every new generation the
    /// allocator gave it, with the reason. Empty in statuses written before the field existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allocations: Vec<AllocationChange>,
    /// ShadowSync jobs: rank 0's latest `sync_rounds_per_s` of the current generation
    /// (background synchronization rounds per second; see [`ProgressReport`]), absent until
    /// the generation reported one, for other jobs, and in statuses of older allocators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_rounds_per_s: Option<f64>,
    /// ShadowSync jobs: rank 0's latest `model_gap` of the current generation (the relative
    /// distance between a worker's model and the synchronized one, 0 to 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_gap: Option<f64>,
    /// On a cluster of several GPU types: the job's speed on each type, measured where it
    /// ran there, projected from other jobs' ratios where it has not (the allocator's
    /// estimate, `converge_sched::gpu_types`; docs/heterogeneous.md). Empty on a cluster of
    /// one type, before the job has step times, and in statuses of older allocators.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu_type_speeds: BTreeMap<String, GpuTypeSpeed>,
}

/// A job's speed on one GPU type ([`JobStatus::gpu_type_speeds`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GpuTypeSpeed {
    /// Compute throughput per GPU, samples per second (finite, > 0).
    pub samples_per_s: f64,
    /// Measured on this type (`true`) or projected from another (`false`).
    pub measured: bool,
}

/// Most entries kept in [`JobStatus::allocations`] (about 100 bytes each).
pub const MAX_ALLOCATION_CHANGES: usize = 64;

/// Why a job's allocation changed ([`AllocationChange::cause`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeCause {
    /// First placement, or placed again after waiting preempted.
    Started,
    /// The policy gave it more workers.
    Grown,
    /// The policy gave it fewer workers (but at least one).
    Shrunk,
    /// The policy took all its workers (it waits, pending, for GPUs).
    Preempted,
    /// Same number of workers on other GPUs or hosts (placement).
    Moved,
    /// A host it ran on stopped reporting: its workers are gone (0 workers) until the policy
    /// places it again.
    HostLost,
    /// Same workers, a new batch plan (its first gradient statistics, or a goodput gain
    /// that pays for the restart).
    Batch,
    /// Rank 0's host answers at a new address; restarted with the same placement.
    Address,
}

impl ChangeCause {
    /// As written on the wire (`host_lost`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeCause::Started => "started",
            ChangeCause::Grown => "grown",
            ChangeCause::Shrunk => "shrunk",
            ChangeCause::Preempted => "preempted",
            ChangeCause::Moved => "moved",
            ChangeCause::HostLost => "host_lost",
            ChangeCause::Batch => "batch",
            ChangeCause::Address => "address",
        }
    }
}

/// One allocation change of a job: the generation it started, its size and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllocationChange {
    /// When the allocator decided it, unix seconds.
    pub time: f64,
    /// The new generation (for [`ChangeCause::HostLost`]: the generation that lost its host;
    /// the job waits with 0 workers until it is placed again as the next one).
    pub generation: u64,
    /// Workers before the change.
    pub from_workers: u32,
    /// Workers of the new generation (0: preempted).
    pub workers: u32,
    /// Distinct hosts of the new generation's workers.
    pub hosts: u32,
    pub cause: ChangeCause,
    /// One sentence for humans: the policy and what changed (the matching event's message).
    pub reason: String,
}

impl JobStatus {
    /// The status of a job just admitted: pending, generation 0, nothing placed or reported.
    pub fn pending(job: JobId, submitted_at: f64, now: f64) -> Self {
        Self {
            protocol: PROTOCOL_VERSION,
            job,
            phase: JobPhase::Pending,
            generation: 0,
            world_size: 0,
            placement: Vec::new(),
            ps_placement: Vec::new(),
            master_addr: None,
            master_port: None,
            step: 0,
            samples: 0,
            first_loss: None,
            loss: None,
            eval_loss: None,
            epoch_samples: None,
            curve: None,
            predicted_loss: None,
            samples_per_s: None,
            step_time_s: None,
            predicted_step_time_s: None,
            submitted_at,
            started_at: None,
            finished_at: None,
            updated_at: now,
            message: None,
            batch: None,
            end: None,
            allocations: Vec::new(),
            sync_rounds_per_s: None,
            model_gap: None,
            gpu_type_speeds: BTreeMap::new(),
        }
    }

    /// Records the change that gave the job its current generation, world size and
    /// placement (call it after setting them): appends to [`JobStatus::allocations`],
    /// dropping the oldest entries beyond [`MAX_ALLOCATION_CHANGES`].
    pub fn record_allocation(
        &mut self,
        time: f64,
        from_workers: u32,
        cause: ChangeCause,
        reason: String,
    ) {
        let hosts: std::collections::BTreeSet<&HostId> =
            self.placement.iter().map(|p| &p.host).collect();
        let change = AllocationChange {
            time,
            generation: self.generation,
            from_workers,
            workers: self.world_size,
            hosts: hosts.len() as u32,
            cause,
            reason,
        };
        self.allocations.push(change);
        let extra = self
            .allocations
            .len()
            .saturating_sub(MAX_ALLOCATION_CHANGES);
        self.allocations.drain(..extra);
    }
}

/// Why a job ended by itself or by one of its `[stop]` criteria.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    /// Rank 0 exited with code 0: the program finished its own work.
    Finished,
    /// The plateau rule: the fitted curve predicts less than the rule's improvement per epoch.
    Converged,
    /// The target loss was reached.
    TargetReached,
    /// The GPU-time budget (`max_gpu_hours`) is spent.
    Budget,
    /// The deadline (`deadline_s` after submission) passed.
    Deadline,
    /// The sweep's early-stopping rule (`[sweep] early_stop`) stopped the trial: it could
    /// not reach the sweep's best trials.
    EarlyStopped,
}

impl EndReason {
    /// As written on the wire and shown by the CLI (`converged`, `target reached`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Finished => "finished",
            EndReason::Converged => "converged",
            EndReason::TargetReached => "target reached",
            EndReason::Budget => "budget",
            EndReason::Deadline => "deadline",
            EndReason::EarlyStopped => "early stopped",
        }
    }
}

/// How a completed job ended ([`JobStatus::end`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobEnd {
    pub reason: EndReason,
    /// Rank 0's latest reported training loss when the job ended.
    pub loss: Option<f64>,
    /// The loss the job's fitted curve predicts it would have reached had it run on
    /// (the curve's asymptote); `None` without a fitted curve.
    pub predicted_loss: Option<f64>,
    /// GPU-hours of service the job received (its reports' attained service).
    pub gpu_hours: f64,
}

/// How a `[batch]` job's batch is chosen, and what the allocator knows of its gradient.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobBatch {
    /// `true` once the job has reported valid gradient statistics: its batch follows its
    /// allocation (goodput). `false`: it keeps its reference batch and is scheduled by
    /// throughput alone.
    pub adaptive: bool,
    /// The job's `[batch] reference` (`B₀`), samples.
    pub reference: u32,
    /// The batch of the current generation (`None` while no generation runs or before the
    /// first placement).
    pub plan: Option<AssignedBatch>,
    /// Whether `plan` was chosen with gradient statistics (goodput); a running job whose
    /// plan was not restarts once with a goodput plan when its statistics arrive.
    #[serde(default)]
    pub planned_with_statistics: bool,
    /// Estimated gradient noise scale `grad_var / grad_sqr`, samples (smoothed over the
    /// reports).
    #[serde(default)]
    pub noise_scale: Option<f64>,
    /// Statistical efficiency of `plan.total` relative to `reference`, in (0, 1].
    #[serde(default)]
    pub efficiency: Option<f64>,
    /// Rank-0 reports with valid gradient statistics so far.
    #[serde(default)]
    pub gradient_reports: u64,
    /// Rank-0 reports whose gradient statistics were ignored (one missing, not a number,
    /// negative or both 0).
    #[serde(default)]
    pub ignored_gradient_stats: u64,
}

impl JobBatch {
    /// A `[batch]` job's batch before anything is known: not adaptive, no plan.
    pub fn new(reference: u32) -> Self {
        Self {
            adaptive: false,
            reference,
            plan: None,
            planned_with_statistics: false,
            noise_scale: None,
            efficiency: None,
            gradient_reports: 0,
            ignored_gradient_stats: 0,
        }
    }
}

impl Message for JobStatus {
    fn protocol(&self) -> u32 {
        self.protocol
    }
    fn validate(&self) -> Result<(), String> {
        if self.placement.len() != self.world_size as usize {
            return Err(format!(
                "placement has {} ranks but world size is {}",
                self.placement.len(),
                self.world_size
            ));
        }
        for (i, shard) in self.ps_placement.iter().enumerate() {
            if shard.rank != self.world_size + i as u32 || !shard.gpus.is_empty() {
                return Err(format!(
                    "parameter-server shard {i} must have rank {} and no GPUs",
                    self.world_size + i as u32
                ));
            }
        }
        if let Some(r) = self.sync_rounds_per_s {
            sync_time("sync_rounds_per_s", r)?;
        }
        if let Some(g) = self.model_gap {
            sync_time("model_gap", g)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Leadership
// ---------------------------------------------------------------------------------------

/// The allocator leader's lease (KV `converge-leader`, key `allocator`): only the holder
/// writes plans and job statuses. The holder renews it (compare-and-set on the KV
/// revision) every third of `ttl_s`; another replica takes it over when it has seen the
/// same revision for `ttl_s` on its own monotonic clock, so replicas' wall clocks need not
/// agree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaderLease {
    #[serde(default = "default_protocol")]
    pub protocol: u32,
    /// Replica id of the holder (`converge-allocator --replica-id`).
    pub holder: String,
    /// +1 at every change of holder.
    pub term: u64,
    /// Lease length, seconds.
    pub ttl_s: f64,
    /// When the holder last renewed it (UNIX seconds, the holder's clock; informational).
    pub renewed_at: f64,
}

impl Message for LeaderLease {
    fn protocol(&self) -> u32 {
        self.protocol
    }
    fn validate(&self) -> Result<(), String> {
        finite("ttl_s", self.ttl_s)?;
        finite("renewed_at", self.renewed_at)?;
        if self.holder.is_empty() || self.holder.len() > 256 {
            return Err("holder must be 1 to 256 bytes".into());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------

/// What happened. Events are best-effort notifications (core NATS) for `converge watch`
/// and tests; state lives in KV, never only in an event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventKind {
    WorkerStarted {
        job: JobId,
        generation: u64,
        rank: u32,
        pid: u32,
    },
    WorkerExited {
        job: JobId,
        generation: u64,
        rank: u32,
        code: Option<i32>,
        signal: Option<i32>,
    },
    WorkerFailed {
        job: JobId,
        generation: u64,
        rank: u32,
        restarts: u32,
    },
    PlanApplied {
        workers: usize,
    },
    JobSubmitted {
        job: JobId,
    },
    AllocationChanged {
        job: JobId,
        generation: u64,
        from_workers: u32,
        to_workers: u32,
    },
    JobFinished {
        job: JobId,
        phase: JobPhase,
    },
    HostLost {
        host: HostId,
    },
}

/// An event on `converge.v1.events.job.<job>` or `converge.v1.events.host.<host>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    #[serde(default = "default_protocol")]
    pub protocol: u32,
    pub time: f64,
    /// Process that emitted it: `agent/<host>`, `allocator`, `cli`.
    pub source: String,
    #[serde(flatten)]
    pub kind: EventKind,
    /// One human sentence.
    pub message: String,
}

impl Message for Event {
    fn protocol(&self) -> u32 {
        self.protocol
    }
}

impl Event {
    pub fn new(time: f64, source: impl Into<String>, kind: EventKind, message: String) -> Self {
        Self {
            protocol: PROTOCOL_VERSION,
            time,
            source: source.into(),
            kind,
            message,
        }
    }
}

#[cfg(test)]
mod tests;

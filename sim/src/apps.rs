//! Application and job model of the trace-driven simulator.
//!
//! This follows the job model of the Pollux simulator (Qiao et al., "Pollux: Co-adaptive
//! Cluster Scheduling for Goodput-Optimized Deep Learning", OSDI'21; its public simulator in
//! `petuum/adaptdl`, branch `osdi21-artifact`, files `simulator/applications.py` and
//! `simulator/simulator.py`), over the measured traces in `../shared/data/pollux/traces/<app>/`. It is a
//! re-implementation from the published behavior, not a translation of that code.
//!
//! Units: times are `f64` seconds, batch sizes are samples, statistical progress is counted in
//! iterations at the application's smallest batch size (the `progress` column of the
//! validation files), and "epochs" are whole passes over the data set.
//!
//! # Application ([`Application`])
//!
//! - **Constants.** `init_batch_size` / `max_batch_size` are the smallest / largest batch size
//!   with a `validation-<B>.csv`; `min_local_bsz` / `max_local_bsz` the smallest / largest
//!   per-GPU batch in `placements.csv` (Pollux overrides yolov3's to 8); `max_epochs` is
//!   Pollux's per-application constant (bert 2, cifar10 100, deepspeech2 80, imagenet 90,
//!   ncf 10, yolov3 50). None of the six has a target metric, so a job completes after
//!   `max_epochs` epochs whatever its batch size ([`Application::completion_epoch`] is
//!   `max_epochs − 1`, the last epoch index).
//! - **Throughput** ([`Application::throughput`]). A placement (GPUs per node, zeros dropped)
//!   is rotated to its lexicographically smallest rotation (`4123` → `1234`). If that
//!   placement has rows in `placements.csv`, step and sync times are linear in the per-GPU
//!   batch between its rows (scipy `interp1d`). Otherwise they come from a 3-D piecewise-linear
//!   interpolation over `(num_nodes, num_replicas, local_bsz)` of the mean of the placement
//!   rows grouped by those three values plus the rows of `scalability.csv`, on a Delaunay
//!   tetrahedralization (Pollux: scipy `LinearNDInterpolator`, i.e. qhull), with
//!   `num_nodes` capped at the largest node count measured (16).
//! - **Statistical efficiency.** [`Application::grad_stats`] interpolates `grad_sqr`,
//!   `grad_var` linearly in the batch size between the two validation files that bracket it;
//!   [`Application::progress`] is the smallest cumulative `progress` over all validation files
//!   at the end of the previous epoch.
//!
//! # Job ([`SimJob`])
//!
//! A fixed target batch size `B` on `R` GPUs runs `local = ⌈B/R⌉` samples per GPU, split into
//! `accum + 1` micro-batches of `atomic = ⌈local/(accum+1)⌉ ≤ max_local_bsz` (at least two
//! micro-batches on a single GPU when `B > init_batch_size`), with `atomic` capped so that the
//! effective batch never exceeds `max_batch_size`. Per optimizer step it takes
//! `T = step + (step − sync)·accum` seconds and gains `(var + sqr)/(var/s + sqr)` units of
//! statistical progress, with `s = effective batch / init_batch_size` (the gradient-noise
//! gain of the Pollux paper, §3.1), times `(1 − interference)`. When progress reaches the next
//! epoch's progress, the time to get there is rounded to whole seconds (as Pollux does); the
//! job completes when it passes the last epoch. A new non-empty placement costs a restart
//! delay (Pollux: 30 s) without progress but with GPU time counted.
//!
//! Pollux's cluster applies interference only to a job spread over several nodes that shares
//! a node with another multi-node job; the published runs use no interference.
//!
//! # Differences from Pollux, and why
//!
//! - **Out-of-range inputs are clamped instead of failing.** Pollux's `interp1d` raises and its
//!   `LinearNDInterpolator` returns NaN (then asserts) outside the measured range. Here the
//!   per-GPU batch is clamped into the measured range of the placement (or of the
//!   interpolation hull along the `local_bsz` axis at that node/replica count), the node count
//!   into `[1, 16]`, and a replica count outside the hull is moved to the nearest measured
//!   replica count for that node count. A batch size outside the validated range is clamped
//!   into it for the statistical efficiency; `atomic` is at least 1; an epoch crossing never
//!   takes longer than the time left in the step (Pollux asserts it).
//! - **Degenerate Delaunay cells.** The measured points lie on a grid, so many groups of
//!   five or more points are cospherical and the Delaunay tetrahedralization is not unique.
//!   qhull breaks those ties by its own internal (merge and vertex-numbering) order; here an
//!   exact-arithmetic (integer) Bowyer–Watson insertion in data order breaks them. Both are
//!   valid Delaunay tetrahedralizations of the same points: they agree on every measured
//!   point, between two measured batch sizes of a measured `(num_nodes, num_replicas)`, and
//!   wherever the data are locally linear, and differ only inside degenerate cells.
//!   Measured against scipy 1.17.1 (`LinearNDInterpolator` on the same points) at 42,000
//!   random queries, 7,000 per application:
//!   - 6,000 placements of 1–4 nodes (all in `placements.csv`): identical (largest relative
//!     difference 1.2e-16, scipy's `interp1d` rounding).
//!   - 36,000 placements of 5–16 nodes, `num_nodes ≤ num_replicas ≤ min(4·num_nodes, 64)`,
//!     per-GPU batch uniform between the smallest and largest usable value (one in five at
//!     a measured value). scipy gives NaN (Pollux would stop) at 6,361 of them; at the other
//!     29,639 the step time's relative difference has median 0 (57 % agree within 1e-9),
//!     mean 0.74 %, 90th percentile 2.4 %, 99th 8.3 %, maximum 30 % (cifar10, 10 nodes,
//!     26 replicas, batch 142); the signed mean is −0.06 % (every application within
//!     ±0.15 %), so there is no bias. For the fewest-nodes placements alone: 90th
//!     percentile 1.6 %, 99th 5.6 %, maximum 22 %. The sync time differs by at most 28 % of
//!     the step time. qhull's own choices in these cells look arbitrary (either diagonal of
//!     a degenerate rectangle about equally often, and zero-volume simplices), so no other
//!     tie-breaking rule would match it better short of running qhull itself.
//! - Placements with a part above 9 GPUs, or more than 15 nodes, never match a
//!   `placements.csv` row (Pollux concatenates the digits into one integer id).
//! - [`Application::loss_like`], [`SimJob::remaining_progress`] and
//!   [`SimJob::progress_rate`] are additions for this project's policies.
//!
//! `throughput` allocates nothing: the interpolation is reduced at load time to one sorted
//! list of breakpoints along `local_bsz` per integer `(num_nodes, num_replicas)`, which is
//! exact because the interpolant is linear inside every tetrahedron.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The six applications of the Pollux traces.
pub const APP_NAMES: [&str; 6] = [
    "bert",
    "cifar10",
    "deepspeech2",
    "imagenet",
    "ncf",
    "yolov3",
];

/// Pollux's restart (re-scale) delay, seconds.
pub const POLLUX_RESTART_DELAY_S: f64 = 30.0;

/// Largest absolute trace coordinate (`num_nodes`, `num_replicas`, `local_bsz`) accepted, so
/// that the exact integer predicates of the tetrahedralization cannot overflow.
const MAX_COORD: u32 = 1 << 20;

/// Per-application constants of Pollux's `APPLICATIONS` table: (name, max_epochs,
/// max_local_bsz override).
const POLLUX_CONSTANTS: [(&str, u32, Option<u32>); 6] = [
    ("bert", 2, None),
    ("cifar10", 100, None),
    ("ncf", 10, None),
    ("imagenet", 90, None),
    ("deepspeech2", 80, None),
    ("yolov3", 50, Some(8)),
];

/// A trace file that could not be read or makes no sense.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file or directory could not be read.
    #[error("{path}: {source}")]
    Io {
        /// File or directory.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A row could not be parsed or holds an invalid value.
    #[error("{path}:{line}: {reason}")]
    Row {
        /// File.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// The file (or the application's set of files) is unusable as a whole.
    #[error("{path}: {reason}")]
    File {
        /// File or directory.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No traces folder holds the application.
    #[error(
        "no traces of application {app} (<folder>/{app}/placements.csv) in {searched}; pass \
         --traces with a folder that has them, such as a copy of the Pollux artifact's \
         simulator/traces (the applications' traces are not in this repository, see data/README.md)"
    )]
    Missing {
        /// Application name.
        app: String,
        /// The folders searched, comma-separated.
        searched: String,
    },
}

/// One measured training application (see the module docs).
#[derive(Debug, Clone)]
pub struct Application {
    /// Name (the trace directory's name).
    pub name: String,
    /// Smallest validated total batch size, samples; the reference of the efficiency gain.
    pub init_batch_size: u32,
    /// Largest validated total batch size, samples.
    pub max_batch_size: u32,
    /// Smallest measured per-GPU batch, samples.
    pub min_local_bsz: u32,
    /// Largest per-GPU batch that fits (measured, or Pollux's override), samples.
    pub max_local_bsz: u32,
    /// Epochs until completion.
    pub max_epochs: u32,
    /// Validation runs, sorted by batch size.
    validations: Vec<Validation>,
    /// Whether the validation metric increases during training (Pollux's test: first row of
    /// the smallest batch size below its last row).
    metric_increases: bool,
    /// 100 for a higher-is-better metric reported in percent, else 1.
    metric_scale: f64,
    /// Step times of `placements.csv` / `scalability.csv` (the Pollux artifact's T4
    /// measurements; the Sia artifact's `aws`).
    steps: StepTable,
    /// Step times measured on other GPU types (`placements-<type>.csv`,
    /// `scalability-<type>.csv` of the Sia artifact), loaded by
    /// [`Application::load_gpu_type`].
    by_type: BTreeMap<String, StepTable>,
    /// Factor on every step and sync time (1: as measured; the Sia artifact's calibration,
    /// [`SIA_SLOWDOWNS`], otherwise).
    pub step_scale: f64,
    /// Whether a GPU type's own largest measured micro-batch applies on it
    /// ([`Application::max_local_bsz_on`]: the A100 `dgx-ext` traces hold micro-batches up
    /// to four times the T4's, as the Sia artifact's simulator uses them); `false`: every
    /// type runs at most `max_local_bsz`, the base measurements' (`--base-micro-batch`).
    /// `false` for an application as loaded; the command line's applications set it.
    pub micro_batch_per_type: bool,
}

/// The step times of one application on one GPU type: placement rows and an interpolation.
#[derive(Debug, Clone)]
struct StepTable {
    /// Rows of the placements file per placement, keyed by [`placement_key`] of the digits.
    exact: HashMap<u64, Curve>,
    /// Interpolation for the placements not in the placements file.
    interp: Interpolator,
    /// Smallest and largest per-GPU batch of the placement rows, samples.
    local_bsz: (u32, u32),
}

impl StepTable {
    /// `(step_time_s, sync_time_s)` as measured (see [`Application::throughput`]).
    fn eval(&self, placement: &[u32], local_bsz: f64) -> (f64, f64) {
        let (nodes, replicas, key) = canonical(placement);
        if nodes == 0 {
            return (f64::INFINITY, 0.0);
        }
        if let Some(curve) = key.and_then(|k| self.exact.get(&k)) {
            return curve.eval(local_bsz);
        }
        self.interp.eval(nodes, replicas, local_bsz)
    }

    /// Reads a placements file and a scalability file (see the module docs).
    fn load(placements_path: &Path, scalability_path: &Path) -> Result<StepTable, TraceError> {
        let file_err = |path: &Path, reason: String| TraceError::File {
            path: path.to_path_buf(),
            reason,
        };
        let mut rows: BTreeMap<Vec<u32>, BTreeMap<u32, [f64; 2]>> = BTreeMap::new();
        read_csv(placements_path, |r: PlacementRow, _| {
            let parts = parse_placement(&r.placement)?;
            check_coord("local_bsz", r.local_bsz)?;
            check_times(r.step_time, r.sync_time)?;
            let old = rows
                .entry(parts)
                .or_default()
                .insert(r.local_bsz, [r.step_time, r.sync_time]);
            if old.is_some() {
                return Err(format!(
                    "duplicate row for placement {} and local_bsz {}",
                    r.placement, r.local_bsz
                ));
            }
            Ok(())
        })?;
        if rows.is_empty() {
            return Err(file_err(placements_path, "no rows".into()));
        }
        let mut exact = HashMap::new();
        // Mean per (num_nodes, num_replicas, local_bsz), in that order (pandas groupby).
        let mut groups: BTreeMap<[u32; 3], ([f64; 2], u32)> = BTreeMap::new();
        let (mut min_local, mut max_local) = (u32::MAX, 0u32);
        for (parts, by_bsz) in &rows {
            let key = placement_key(parts)
                .ok_or_else(|| file_err(placements_path, "bad placement".into()))?;
            let curve = Curve {
                xs: by_bsz.keys().map(|&b| f64::from(b)).collect(),
                ys: by_bsz.values().copied().collect(),
            };
            exact.insert(key, curve);
            let nodes = parts.len() as u32;
            let replicas: u32 = parts.iter().sum();
            for (&bsz, y) in by_bsz {
                min_local = min_local.min(bsz);
                max_local = max_local.max(bsz);
                let g = groups
                    .entry([nodes, replicas, bsz])
                    .or_insert(([0.0; 2], 0));
                g.0[0] += y[0];
                g.0[1] += y[1];
                g.1 += 1;
            }
        }
        let mut points: Vec<[i64; 3]> = Vec::new();
        let mut values: Vec<[f64; 2]> = Vec::new();
        for (k, (sum, count)) in &groups {
            points.push(k.map(i64::from));
            let c = f64::from(*count);
            values.push([sum[0] / c, sum[1] / c]);
        }

        // Scalability runs (appended after the grouped placements, as Pollux does).
        read_csv(scalability_path, |r: ScalabilityRow, _| {
            check_coord("num_nodes", r.num_nodes)?;
            check_coord("num_replicas", r.num_replicas)?;
            check_coord("local_bsz", r.local_bsz)?;
            check_times(r.step_time, r.sync_time)?;
            if r.num_replicas < r.num_nodes {
                return Err("num_replicas must be at least num_nodes".into());
            }
            points.push([r.num_nodes, r.num_replicas, r.local_bsz].map(i64::from));
            values.push([r.step_time, r.sync_time]);
            Ok(())
        })?;
        // A point measured twice keeps its first value (qhull keeps one of them too).
        let mut seen = std::collections::HashSet::new();
        let (points, values): (Vec<_>, Vec<_>) = points
            .into_iter()
            .zip(values)
            .filter(|(p, _)| seen.insert(*p))
            .unzip();
        let interp = Interpolator::build(&points, &values).ok_or_else(|| {
            file_err(
                scalability_path,
                "placements and scalability rows are all coplanar: nothing to interpolate in 3-D"
                    .into(),
            )
        })?;
        Ok(StepTable {
            exact,
            interp,
            local_bsz: (min_local, max_local),
        })
    }
}

/// The Sia artifact's calibration (its `simulator_config.py`, `SLOWDOWNS`, fitted on its
/// `rtx` cluster): each application's measured step times are multiplied by its factor on
/// every GPU type. Applications not listed keep theirs.
pub const SIA_SLOWDOWNS: [(&str, f64); 6] = [
    ("cifar10", 1.8),
    ("imagenet", 1.2),
    ("yolov3", 1.2),
    ("bert", 1.2),
    ("deepspeech2", 1.2),
    ("ncf", 1.5),
];

/// One `validation-<B>.csv`.
#[derive(Debug, Clone)]
struct Validation {
    batch_size: u32,
    progress: Vec<f64>,
    iteration: Vec<f64>,
    metric: Vec<f64>,
    grad_sqr: Vec<f64>,
    grad_var: Vec<f64>,
}

/// One measured validation run of an application ([`Application::validation_runs`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ValidationRun {
    /// Total batch size of the run, samples.
    pub batch_size: u32,
    /// Samples trained on at each row. Rows are at equal statistical progress (one epoch
    /// apart at the application's smallest batch size), so a larger batch's rows lie more
    /// than an epoch of samples apart.
    pub samples: Vec<f64>,
    /// Samples in one epoch of the training set.
    pub epoch_samples: f64,
    /// Loss-like validation value at each row (lower is better).
    pub loss: Vec<f64>,
}

#[derive(Deserialize)]
struct ValidationRow {
    progress: f64,
    iteration: f64,
    metric: f64,
    grad_sqr: f64,
    grad_var: f64,
}

#[derive(Deserialize)]
struct PlacementRow {
    placement: String,
    local_bsz: u32,
    step_time: f64,
    sync_time: f64,
}

#[derive(Deserialize)]
struct ScalabilityRow {
    num_nodes: u32,
    num_replicas: u32,
    local_bsz: u32,
    step_time: f64,
    sync_time: f64,
}

/// Reads every row of a CSV file with a header, handing each row and its line to `f`.
fn read_csv<T, F>(path: &Path, mut f: F) -> Result<(), TraceError>
where
    T: for<'de> Deserialize<'de>,
    F: FnMut(T, u64) -> Result<(), String>,
{
    let row_err = |line: u64, reason: String| TraceError::Row {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(true)
        .trim(csv::Trim::All)
        .from_path(path)
        .map_err(|e| match e.into_kind() {
            csv::ErrorKind::Io(source) => TraceError::Io {
                path: path.to_path_buf(),
                source,
            },
            other => TraceError::File {
                path: path.to_path_buf(),
                reason: format!("{other:?}"),
            },
        })?;
    let headers = rdr
        .headers()
        .map_err(|e| row_err(1, e.to_string()))?
        .clone();
    let mut record = csv::StringRecord::new();
    loop {
        match rdr.read_record(&mut record) {
            Ok(false) => break,
            Ok(true) => {}
            Err(e) => {
                let line = e.position().map_or(0, csv::Position::line);
                return Err(row_err(line, e.to_string()));
            }
        }
        let line = record.position().map_or(0, csv::Position::line);
        let row: T = record
            .deserialize(Some(&headers))
            .map_err(|e| row_err(line, e.to_string()))?;
        f(row, line).map_err(|reason| row_err(line, reason))?;
    }
    Ok(())
}

fn check_finite(name: &str, v: f64, positive: bool) -> Result<(), String> {
    if !v.is_finite() || v < 0.0 || (positive && v <= 0.0) {
        let want = if positive { "positive" } else { "non-negative" };
        return Err(format!("{name} must be finite and {want}, got {v}"));
    }
    Ok(())
}

fn check_times(step_time: f64, sync_time: f64) -> Result<(), String> {
    check_finite("step_time", step_time, true)?;
    check_finite("sync_time", sync_time, false)
}

fn check_coord(name: &str, v: u32) -> Result<(), String> {
    if v == 0 || v > MAX_COORD {
        return Err(format!("{name} must be in 1..={MAX_COORD}, got {v}"));
    }
    Ok(())
}

fn read_validation(path: &Path, batch_size: u32) -> Result<Validation, TraceError> {
    let mut v = Validation {
        batch_size,
        progress: Vec::new(),
        iteration: Vec::new(),
        metric: Vec::new(),
        grad_sqr: Vec::new(),
        grad_var: Vec::new(),
    };
    read_csv(path, |r: ValidationRow, _| {
        check_finite("progress", r.progress, false)?;
        check_finite("iteration", r.iteration, false)?;
        check_finite("grad_sqr", r.grad_sqr, false)?;
        check_finite("grad_var", r.grad_var, false)?;
        if !r.metric.is_finite() {
            return Err(format!("metric must be finite, got {}", r.metric));
        }
        if let Some(&last) = v.progress.last()
            && r.progress <= last
        {
            return Err(format!(
                "progress must increase, {} after {last}",
                r.progress
            ));
        }
        v.progress.push(r.progress);
        v.iteration.push(r.iteration);
        v.metric.push(r.metric);
        v.grad_sqr.push(r.grad_sqr);
        v.grad_var.push(r.grad_var);
        Ok(())
    })?;
    if v.progress.is_empty() {
        return Err(TraceError::File {
            path: path.to_path_buf(),
            reason: "no rows".into(),
        });
    }
    Ok(v)
}

/// Digits of a `placements.csv` placement id.
fn parse_placement(s: &str) -> Result<Vec<u32>, String> {
    if s.is_empty() || s.len() > 15 {
        return Err(format!("placement {s:?} must have 1 to 15 digits"));
    }
    s.chars()
        .map(|c| match c.to_digit(10) {
            Some(d) if d > 0 => Ok(d),
            _ => Err(format!(
                "placement {s:?} must be digits 1-9 (GPUs per node)"
            )),
        })
        .collect()
}

/// Key of a placement given as non-zero parts (4 bits per part, length in the top 4 bits);
/// None when it cannot be a `placements.csv` id (a part above 9 or more than 15 nodes).
fn placement_key(parts: &[u32]) -> Option<u64> {
    if parts.is_empty() || parts.len() > 15 || parts.iter().any(|&p| p > 9) {
        return None;
    }
    let digits = parts.iter().fold(0u64, |k, &p| (k << 4) | u64::from(p));
    Some(((parts.len() as u64) << 60) | digits)
}

/// Maximum number of nodes handled without allocation by [`Application::throughput`].
const STACK_NODES: usize = 64;

/// `(num_nodes, num_replicas, key of the smallest rotation)` of a placement, zeros dropped.
fn canonical(placement: &[u32]) -> (u32, u32, Option<u64>) {
    let mut buf = [0u32; STACK_NODES];
    let mut n = 0usize;
    let mut replicas = 0u32;
    let mut fits = true;
    for &p in placement.iter().filter(|&&p| p > 0) {
        if n < STACK_NODES {
            buf[n] = p;
        } else {
            fits = false;
        }
        n += 1;
        replicas = replicas.saturating_add(p);
    }
    let nodes = u32::try_from(n).unwrap_or(u32::MAX);
    if !fits || n == 0 || n > 15 {
        return (nodes, replicas, None);
    }
    let parts = &buf[..n];
    let rot = |s: usize, i: usize| parts[(s + i) % n];
    let mut best = 0usize;
    for s in 1..n {
        for i in 0..n {
            match rot(s, i).cmp(&rot(best, i)) {
                std::cmp::Ordering::Less => {
                    best = s;
                    break;
                }
                std::cmp::Ordering::Greater => break,
                std::cmp::Ordering::Equal => {}
            }
        }
    }
    let mut rotated = [0u32; 15];
    for (i, slot) in rotated.iter_mut().take(n).enumerate() {
        *slot = rot(best, i);
    }
    (nodes, replicas, placement_key(&rotated[..n]))
}

/// A piecewise-linear curve `x → (step_time, sync_time)` over sorted knots, clamped at its
/// ends.
#[derive(Debug, Clone, Default)]
struct Curve {
    xs: Vec<f64>,
    ys: Vec<[f64; 2]>,
}

impl Curve {
    fn eval(&self, x: f64) -> (f64, f64) {
        let n = self.xs.len();
        if n == 0 {
            return (f64::INFINITY, 0.0);
        }
        if x.is_nan() || x <= self.xs[0] {
            return (self.ys[0][0], self.ys[0][1]);
        }
        if x >= self.xs[n - 1] {
            return (self.ys[n - 1][0], self.ys[n - 1][1]);
        }
        let hi = self.xs.partition_point(|&v| v < x);
        if self.xs[hi] == x {
            return (self.ys[hi][0], self.ys[hi][1]);
        }
        let lo = hi - 1;
        let (x0, x1) = (self.xs[lo], self.xs[hi]);
        let f = |k: usize| {
            let slope = (self.ys[hi][k] - self.ys[lo][k]) / (x1 - x0);
            slope * (x - x0) + self.ys[lo][k]
        };
        (f(0), f(1))
    }
}

/// 3-D linear interpolation over `(num_nodes, num_replicas, local_bsz)`, reduced to one curve
/// along `local_bsz` per integer `(num_nodes, num_replicas)` cell.
#[derive(Debug, Clone)]
struct Interpolator {
    n_min: u32,
    n_max: u32,
    r_max: u32,
    /// Curve per cell `(n − n_min)·r_max + (r − 1)`; empty where the line misses the hull.
    columns: Vec<Curve>,
    /// For each cell, the cell whose curve is used (itself, or the nearest non-empty one).
    redirect: Vec<u32>,
}

impl Interpolator {
    fn cell(&self, n: u32, r: u32) -> usize {
        ((n - self.n_min) * self.r_max + (r - 1)) as usize
    }

    fn eval(&self, n: u32, r: u32, local_bsz: f64) -> (f64, f64) {
        let n = n.clamp(self.n_min, self.n_max);
        let r = r.clamp(1, self.r_max);
        let cell = self.redirect[self.cell(n, r)] as usize;
        self.columns[cell].eval(local_bsz)
    }

    /// Builds the interpolation of `values` at integer `points` (distinct).
    fn build(points: &[[i64; 3]], values: &[[f64; 2]]) -> Option<Interpolator> {
        let tri = delaunay::Triangulation::build(points)?;
        let n_min = points.iter().map(|p| p[0]).min()? as u32;
        let n_max = points.iter().map(|p| p[0]).max()? as u32;
        let r_max = points.iter().map(|p| p[1]).max()? as u32;
        let width = r_max as usize;
        let cells = (n_max - n_min + 1) as usize * width;
        let mut knots: Vec<Vec<(f64, [f64; 2])>> = vec![Vec::new(); cells];
        for tet in tri.finite_tets() {
            let p = tet.map(|i| points[i as usize]);
            let lo = |k: usize| p.iter().map(|q| q[k]).min().unwrap_or(0);
            let hi = |k: usize| p.iter().map(|q| q[k]).max().unwrap_or(0);
            let (n_lo, n_hi) = (lo(0).max(i64::from(n_min)), hi(0).min(i64::from(n_max)));
            let (r_lo, r_hi) = (lo(1).max(1), hi(1).min(i64::from(r_max)));
            for n in n_lo..=n_hi {
                for r in r_lo..=r_hi {
                    if let Some(seg) = line_through_tet(&p, n, r) {
                        let cell = (n - i64::from(n_min)) as usize * width + (r - 1) as usize;
                        for (z, w) in seg {
                            let mut y = [0.0; 2];
                            for (i, &vi) in tet.iter().enumerate() {
                                y[0] += w[i] * values[vi as usize][0];
                                y[1] += w[i] * values[vi as usize][1];
                            }
                            knots[cell].push((z, y));
                        }
                    }
                }
            }
        }
        let columns: Vec<Curve> = knots
            .into_iter()
            .map(|mut ks| {
                ks.sort_by(|a, b| a.0.total_cmp(&b.0));
                let mut c = Curve::default();
                for (z, y) in ks {
                    if let Some(&last) = c.xs.last()
                        && z - last <= 1e-9 * z.abs().max(1.0)
                    {
                        continue;
                    }
                    c.xs.push(z);
                    c.ys.push(y);
                }
                c
            })
            .collect();
        let mut redirect = vec![0u32; cells];
        let rows = (n_max - n_min + 1) as usize;
        for (cell, slot) in redirect.iter_mut().enumerate() {
            let (row, col) = (cell / width, cell % width);
            let mut best: Option<(usize, usize, usize)> = None;
            for other_row in 0..rows {
                for other_col in 0..width {
                    let other = other_row * width + other_col;
                    if columns[other].xs.is_empty() {
                        continue;
                    }
                    let d = (row.abs_diff(other_row), col.abs_diff(other_col), other);
                    if best.is_none_or(|b| (d.0, d.1) < (b.0, b.1)) {
                        best = Some(d);
                    }
                }
            }
            *slot = best?.2 as u32;
        }
        Some(Interpolator {
            n_min,
            n_max,
            r_max,
            columns,
            redirect,
        })
    }
}

/// Where the vertical line `(n, r, ·)` crosses the tetrahedron `p`: the two end points
/// (`local_bsz`, barycentric weights), or None when it misses.
fn line_through_tet(p: &[[i64; 3]; 4], n: i64, r: i64) -> Option<[(f64, [f64; 4]); 2]> {
    // Solve X = p3 + Σ λi (pi − p3) for X = (n, r, z): λ = adj(T)·(X − p3) / det(T), exact
    // in integers except for the final division.
    let d = |i: usize, k: usize| i128::from(p[i][k] - p[3][k]);
    let t = [
        [d(0, 0), d(1, 0), d(2, 0)],
        [d(0, 1), d(1, 1), d(2, 1)],
        [d(0, 2), d(1, 2), d(2, 2)],
    ];
    let cof =
        |r0: usize, r1: usize, c0: usize, c1: usize| t[r0][c0] * t[r1][c1] - t[r0][c1] * t[r1][c0];
    // adj[i][j] = cofactor(j, i).
    let adj = [
        [cof(1, 2, 1, 2), -cof(0, 2, 1, 2), cof(0, 1, 1, 2)],
        [-cof(1, 2, 0, 2), cof(0, 2, 0, 2), -cof(0, 1, 0, 2)],
        [cof(1, 2, 0, 1), -cof(0, 2, 0, 1), cof(0, 1, 0, 1)],
    ];
    let det = t[0][0] * adj[0][0] + t[0][1] * adj[1][0] + t[0][2] * adj[2][0];
    if det == 0 {
        return None;
    }
    let x0 = [i128::from(n - p[3][0]), i128::from(r - p[3][1])];
    // det·λi(z) = a[i] + b[i]·(z − p3.z), for i = 0..4 (λ3 = 1 − Σ).
    let mut a = [0i128; 4];
    let mut b = [0i128; 4];
    for i in 0..3 {
        a[i] = adj[i][0] * x0[0] + adj[i][1] * x0[1];
        b[i] = adj[i][2];
    }
    a[3] = det - a[0] - a[1] - a[2];
    b[3] = -b[0] - b[1] - b[2];
    let sign = det.signum();
    let (mut lo, mut hi) = (f64::NEG_INFINITY, f64::INFINITY);
    for i in 0..4 {
        let (ai, bi) = (a[i] * sign, b[i] * sign);
        if bi == 0 {
            if ai < 0 {
                return None;
            }
        } else {
            let root = -(ai as f64) / (bi as f64);
            if bi > 0 {
                lo = lo.max(root);
            } else {
                hi = hi.min(root);
            }
        }
    }
    if lo.is_nan() || hi.is_nan() || lo > hi || !lo.is_finite() || !hi.is_finite() {
        return None;
    }
    let z3 = p[3][2] as f64;
    let det_f = det as f64;
    let weights = |dz: f64| {
        let mut w = [0.0; 4];
        for i in 0..4 {
            w[i] = ((a[i] as f64) + (b[i] as f64) * dz) / det_f;
        }
        w
    };
    Some([(lo + z3, weights(lo)), (hi + z3, weights(hi))])
}

impl Application {
    /// Loads `traces_dir/<name>/` (placements.csv, scalability.csv, validation-*.csv) with
    /// Pollux's constants for the six known applications (`max_epochs` defaults to the
    /// shortest validation run for other names).
    pub fn load(traces_dir: &Path, name: &str) -> Result<Application, TraceError> {
        let dir = traces_dir.join(name);
        let file_err = |path: &Path, reason: String| TraceError::File {
            path: path.to_path_buf(),
            reason,
        };

        // Validation runs.
        let entries = std::fs::read_dir(&dir).map_err(|source| TraceError::Io {
            path: dir.clone(),
            source,
        })?;
        let mut validations = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| TraceError::Io {
                path: dir.clone(),
                source,
            })?;
            let file_name = entry.file_name();
            let Some(fname) = file_name.to_str() else {
                continue;
            };
            let Some(bsz) = fname
                .strip_prefix("validation-")
                .and_then(|s| s.strip_suffix(".csv"))
            else {
                continue;
            };
            let path = entry.path();
            let batch_size: u32 = bsz.parse().ok().filter(|&b| b > 0).ok_or_else(|| {
                file_err(
                    &path,
                    format!("batch size {bsz:?} is not a positive integer"),
                )
            })?;
            validations.push(read_validation(&path, batch_size)?);
        }
        validations.sort_by_key(|v| v.batch_size);
        let (Some(first), Some(last)) = (validations.first(), validations.last()) else {
            return Err(file_err(&dir, "no validation-<batch size>.csv".into()));
        };
        let init_batch_size = first.batch_size;
        let max_batch_size = last.batch_size;
        let metric_increases = first.metric[0] < first.metric[first.metric.len() - 1];
        let max_metric = validations
            .iter()
            .flat_map(|v| v.metric.iter().copied())
            .fold(f64::NEG_INFINITY, f64::max);
        let metric_scale = if metric_increases && max_metric > 1.0 {
            100.0
        } else {
            1.0
        };
        let min_rows = validations
            .iter()
            .map(|v| v.progress.len())
            .min()
            .unwrap_or(0);

        // Step times.
        let steps = StepTable::load(&dir.join("placements.csv"), &dir.join("scalability.csv"))?;
        let (min_local, max_local) = steps.local_bsz;

        let known = POLLUX_CONSTANTS.iter().find(|c| c.0 == name);
        let max_epochs = known.map_or(min_rows as u32, |c| c.1);
        let max_local_bsz = known.and_then(|c| c.2).unwrap_or(max_local);
        if max_epochs == 0 || max_epochs as usize > min_rows {
            return Err(file_err(
                &dir,
                format!(
                    "max_epochs {max_epochs} needs that many rows in every validation file (shortest has {min_rows})"
                ),
            ));
        }
        if max_batch_size < min_local {
            return Err(file_err(
                &dir,
                "largest batch size below the smallest per-GPU batch".into(),
            ));
        }
        Ok(Application {
            name: name.to_string(),
            init_batch_size,
            max_batch_size,
            min_local_bsz: min_local,
            max_local_bsz,
            max_epochs,
            validations,
            metric_increases,
            metric_scale,
            steps,
            by_type: BTreeMap::new(),
            step_scale: 1.0,
            micro_batch_per_type: false,
        })
    }

    /// The largest per-GPU micro-batch on GPUs of the types `gpu_types` (a placement's
    /// distinct types; empty: the base measurements'): with
    /// [`Application::micro_batch_per_type`], the smallest of the types' largest measured
    /// micro-batches (a type without measurements counting as `max_local_bsz`), else
    /// `max_local_bsz`.
    pub fn max_local_bsz_on(&self, gpu_types: &[String]) -> u32 {
        if !self.micro_batch_per_type {
            return self.max_local_bsz;
        }
        gpu_types
            .iter()
            .map(|t| {
                self.by_type
                    .get(t)
                    .map_or(self.max_local_bsz, |s| s.local_bsz.1)
            })
            .min()
            .unwrap_or(self.max_local_bsz)
    }

    /// Each loaded GPU type's largest micro-batch where it differs from `max_local_bsz`
    /// (a job spec's `max_per_worker_by_gpu_type`); empty without
    /// [`Application::micro_batch_per_type`].
    pub fn max_local_bsz_by_type(&self) -> BTreeMap<String, u32> {
        if !self.micro_batch_per_type {
            return BTreeMap::new();
        }
        self.by_type
            .iter()
            .filter(|(_, s)| s.local_bsz.1 != self.max_local_bsz && s.local_bsz.1 > 0)
            .map(|(t, s)| (t.clone(), s.local_bsz.1))
            .collect()
    }

    /// Whether step times of `gpu_type` are loaded.
    pub fn has_gpu_type(&self, gpu_type: &str) -> bool {
        self.by_type.contains_key(gpu_type)
    }

    /// Loads the step times measured on `gpu_type` from `traces_dir/<name>/`
    /// (`placements-<type>.csv`, `scalability-<type>.csv`, as the Sia artifact names them).
    /// The batch limits stay those of `placements.csv`.
    pub fn load_gpu_type(&mut self, traces_dir: &Path, gpu_type: &str) -> Result<(), TraceError> {
        let dir = traces_dir.join(&self.name);
        let table = StepTable::load(
            &dir.join(format!("placements-{gpu_type}.csv")),
            &dir.join(format!("scalability-{gpu_type}.csv")),
        )?;
        self.by_type.insert(gpu_type.to_string(), table);
        Ok(())
    }

    /// `(step_time_s, sync_time_s)` of a placement whose GPUs are of the types `gpu_types`
    /// (the distinct types of its nodes; empty: the types of `placements.csv`): each type's
    /// measurements for the whole placement, the slowest one (a ring all-reduce runs at its
    /// slowest member's speed), times [`Application::step_scale`]. A type without loaded
    /// measurements counts as `placements.csv`'s.
    pub fn throughput_on(
        &self,
        gpu_types: &[String],
        placement: &[u32],
        local_bsz: f64,
    ) -> (f64, f64) {
        let (step, sync) = if gpu_types.is_empty() {
            self.steps.eval(placement, local_bsz)
        } else {
            gpu_types
                .iter()
                .map(|t| {
                    self.by_type
                        .get(t)
                        .unwrap_or(&self.steps)
                        .eval(placement, local_bsz)
                })
                .fold((0.0, 0.0), |a, b| if b.0 > a.0 { b } else { a })
        };
        (step * self.step_scale, sync * self.step_scale)
    }

    /// `(step_time_s, sync_time_s)`: seconds per optimizer step (one micro-batch per GPU)
    /// and the part of it spent synchronizing gradients, for a placement given as GPUs per
    /// node (zeros ignored; any rotation gives the same result) and a per-GPU batch. An empty
    /// placement gives `(∞, 0)`. Never NaN; inputs outside the measurements are clamped (see
    /// the module docs).
    pub fn throughput(&self, placement: &[u32], local_bsz: f64) -> (f64, f64) {
        self.throughput_on(&[], placement, local_bsz)
    }

    /// The two validated batch sizes that bracket `batch_size` (clamped into the validated
    /// range): indices and the weight of the upper one (Pollux's linear rule).
    fn bracket(&self, batch_size: u32) -> (usize, usize, u32, u32, u32) {
        let b = batch_size.clamp(self.init_batch_size, self.max_batch_size);
        let upper = self.validations.partition_point(|v| v.batch_size < b);
        let lower = if self.validations[upper].batch_size == b {
            upper
        } else {
            upper - 1
        };
        let (lb, ub) = (
            self.validations[lower].batch_size,
            self.validations[upper].batch_size,
        );
        (lower, upper, lb, ub, b)
    }

    /// Pollux's interpolation of a per-epoch column between the bracketing batch sizes.
    fn interpolate(&self, batch_size: u32, column: impl Fn(&Validation) -> f64) -> f64 {
        let (lower, upper, lb, ub, b) = self.bracket(batch_size);
        let lo = column(&self.validations[lower]);
        if lower == upper {
            return lo;
        }
        let hi = column(&self.validations[upper]);
        let (b, lb, ub) = (f64::from(b), f64::from(lb), f64::from(ub));
        ((b - lb) * hi + (ub - b) * lo) / (ub - lb)
    }

    /// `(grad_sqr, grad_var)` during `epoch` (0-based) at total batch size `batch_size`,
    /// linear in the batch size between the bracketing validation runs.
    pub fn grad_stats(&self, batch_size: u32, epoch: u32) -> (f64, f64) {
        let row = |v: &Validation| (epoch as usize).min(v.grad_sqr.len() - 1);
        (
            self.interpolate(batch_size, |v| v.grad_sqr[row(v)]),
            self.interpolate(batch_size, |v| v.grad_var[row(v)]),
        )
    }

    /// Statistical progress (iterations at `init_batch_size`) at the start of `epoch`: 0 for
    /// epoch 0, else the smallest cumulative progress over the validation runs after epoch
    /// `epoch − 1`.
    pub fn progress(&self, epoch: u32) -> f64 {
        if epoch == 0 {
            return 0.0;
        }
        self.validations
            .iter()
            .map(|v| v.progress[(epoch as usize - 1).min(v.progress.len() - 1)])
            .fold(f64::INFINITY, f64::min)
    }

    /// The last epoch (0-based) a job runs: it completes when it passes it. No application
    /// has a target metric, so this is `max_epochs − 1` for every batch size.
    pub fn completion_epoch(&self, _batch_size: u32) -> u32 {
        self.max_epochs - 1
    }

    /// Optimizer steps after completing `epoch` (0-based) at `batch_size` (Pollux's
    /// `get_iteration`, used by its Optimus policy), linear between validated batch sizes.
    pub fn iteration(&self, batch_size: u32, epoch: u32) -> f64 {
        let row = |v: &Validation| (epoch as usize).min(v.iteration.len() - 1);
        self.interpolate(batch_size, |v| v.iteration[row(v)])
    }

    /// A loss-like signal (lower is better, ≥ 0) of the validation metric at fractional epoch
    /// `epoch` for this batch size: `1 − metric` for higher-is-better metrics (metric / 100
    /// when reported in percent, as bert's), the metric itself otherwise (deepspeech2's word
    /// error rate, yolov3's score). Row `k` of a validation file (measured at the end of epoch
    /// `k`) is the value at `epoch = k`; linear between rows and between the bracketing batch
    /// sizes; the first / last row before / after.
    pub fn loss_like(&self, batch_size: u32, epoch: f64) -> f64 {
        let at = |k: usize| self.interpolate(batch_size, |v| v.metric[k.min(v.metric.len() - 1)]);
        let rows = self
            .validations
            .iter()
            .map(|v| v.metric.len())
            .min()
            .unwrap_or(1);
        let metric = if epoch.is_nan() || epoch <= 0.0 {
            at(0)
        } else if epoch >= (rows - 1) as f64 {
            at(rows - 1)
        } else {
            let k = epoch.floor() as usize;
            let t = epoch - k as f64;
            at(k) * (1.0 - t) + at(k + 1) * t
        };
        self.as_loss(metric)
    }

    /// A validation metric as a loss-like value (see [`Application::loss_like`]), ≥ 0.
    fn as_loss(&self, metric: f64) -> f64 {
        let loss = if self.metric_increases {
            1.0 - metric / self.metric_scale
        } else {
            metric
        };
        loss.max(0.0)
    }

    /// Each measured validation run (`validation-<B>.csv`), by batch size, as a loss curve
    /// against the samples it trained on: row `r` at `iteration[r] · B` samples (the run's
    /// own optimizer steps times its total batch size), loss-like value as
    /// [`Application::loss_like`]; the training set's size is taken from the smallest batch
    /// size's run (its last row's samples over its rows: one row per epoch at that batch
    /// size).
    pub fn validation_runs(&self) -> Vec<ValidationRun> {
        let Some(first) = self.validations.first() else {
            return Vec::new();
        };
        let rows = first.iteration.len().max(1) as f64;
        let epoch_samples =
            first.iteration.last().copied().unwrap_or(0.0) * f64::from(first.batch_size) / rows;
        self.validations
            .iter()
            .map(|v| {
                let samples: Vec<f64> = v
                    .iteration
                    .iter()
                    .map(|i| i * f64::from(v.batch_size))
                    .collect();
                ValidationRun {
                    batch_size: v.batch_size,
                    samples,
                    epoch_samples,
                    loss: v.metric.iter().map(|&m| self.as_loss(m)).collect(),
                }
            })
            .collect()
    }

    /// Per-GPU micro-batch and gradient-accumulation steps for a fixed total batch size on
    /// `replicas` GPUs (Pollux's `Job.update_local_bsz` with a target batch size).
    pub fn batch_config(&self, batch_size: u32, replicas: u32) -> (u32, u32) {
        self.batch_config_on(&[], batch_size, replicas)
    }

    /// [`Application::batch_config`] on GPUs of the types `gpu_types`, in the micro-batches
    /// they hold ([`Application::max_local_bsz_on`]).
    pub fn batch_config_on(
        &self,
        gpu_types: &[String],
        batch_size: u32,
        replicas: u32,
    ) -> (u32, u32) {
        if replicas == 0 {
            return (0, 0);
        }
        let local = (f64::from(batch_size) / f64::from(replicas) - 1e-8)
            .ceil()
            .max(1.0);
        let max_local = self.max_local_bsz_on(gpu_types);
        let mut accum = ((local / f64::from(max_local) - 1e-8).ceil() - 1.0).max(0.0) as u32;
        if replicas == 1 && batch_size > self.init_batch_size {
            accum = accum.max(1);
        }
        let atomic = (local / f64::from(accum + 1) - 1e-8).ceil() as u32;
        let count = f64::from(replicas) * f64::from(accum + 1);
        let cap = (f64::from(self.max_batch_size) / count).floor() as u32;
        (atomic.min(cap).max(1), accum)
    }

    /// Seconds per optimizer step (accumulation included), effective batch size and
    /// efficiency gain of `replicas` GPUs on `placement` running micro-batches of `atomic`
    /// with `accum` accumulation steps in `epoch`.
    fn step_model(
        &self,
        (gpu_types, placement): (&[String], &[u32]),
        replicas: u32,
        atomic: u32,
        accum: u32,
        epoch: u32,
    ) -> (f64, f64, f64) {
        let batch = replicas * atomic * (accum + 1);
        let (step, sync) = self.throughput_on(gpu_types, placement, f64::from(atomic));
        let total = step + (step - sync) * f64::from(accum);
        let scale = f64::from(batch) / f64::from(self.init_batch_size);
        let (sqr, var) = self.grad_stats(batch, epoch);
        let gain = (var + sqr) / (var / scale + sqr);
        (total, f64::from(batch), gain)
    }
}

/// Where the simulator looks for the applications' traces unless told otherwise, relative to
/// the repository root, in order. The applications' step times and validation curves are not
/// in this repository (their files are byte-identical to files of the Sia artifact, which has
/// no licence; see `data/README.md`): they come from a copy of the Pollux artifact's
/// `simulator/traces`, which this workspace and CI keep at `../shared/data/pollux/traces`.
/// The repository's folder holds `philly.csv`.
pub const DEFAULT_TRACE_DIRS: [&str; 2] = ["data/pollux/traces", "../shared/data/pollux/traces"];

/// [`DEFAULT_TRACE_DIRS`] under the repository root `root`.
pub fn default_trace_dirs(root: &Path) -> Vec<PathBuf> {
    DEFAULT_TRACE_DIRS.iter().map(|d| root.join(d)).collect()
}

/// [`DEFAULT_TRACE_DIRS`] under this crate's repository, for tests.
#[cfg(test)]
pub(crate) fn test_trace_dirs() -> Vec<PathBuf> {
    default_trace_dirs(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
}

/// The first of `dirs` that holds `relative` (a file or folder), if any.
pub fn find_in(dirs: &[PathBuf], relative: &str) -> Option<PathBuf> {
    dirs.iter().map(|d| d.join(relative)).find(|p| p.exists())
}

/// The folder among `dirs` that application `name` is loaded from: the first one with
/// `<name>/placements.csv`.
///
/// # Errors
/// [`TraceError::Missing`] when none has it.
pub fn app_dir<'a>(dirs: &'a [PathBuf], name: &str) -> Result<&'a Path, TraceError> {
    dirs.iter()
        .find(|d| d.join(name).join("placements.csv").is_file())
        .map(PathBuf::as_path)
        .ok_or_else(|| TraceError::Missing {
            app: name.to_string(),
            searched: dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Loads the six applications of [`APP_NAMES`], each from the first of `dirs` that has it
/// ([`app_dir`]; by default [`DEFAULT_TRACE_DIRS`]).
///
/// # Errors
/// [`TraceError::Missing`] when no folder has an application, or the first error reading one.
pub fn load_all(dirs: &[PathBuf]) -> Result<BTreeMap<String, Application>, TraceError> {
    APP_NAMES
        .iter()
        .map(|&name| {
            let dir = app_dir(dirs, name)?;
            Ok((name.to_string(), Application::load(dir, name)?))
        })
        .collect()
}

/// One simulated job with a fixed target batch size (Tiresias/Optimus/FIFO/fair/quality all
/// run fixed batch sizes here), following Pollux's `Job` model (see the module docs).
#[derive(Debug, Clone)]
pub struct SimJob {
    /// Job name.
    pub name: String,
    /// Application name.
    pub app: String,
    /// Submission time, seconds.
    pub submitted_at: f64,
    /// Total batch size the job trains with, samples.
    pub target_batch_size: u32,
    /// GPUs the user asked for.
    pub requested_replicas: u32,
    /// GPUs per node, in node order, zeros dropped; empty when not running.
    pub placement: Vec<u32>,
    /// Epochs completed.
    pub epoch: u32,
    /// Statistical progress (iterations at the application's `init_batch_size`).
    pub progress: f64,
    /// Completion time, seconds.
    pub completed_at: Option<f64>,
    /// GPU-seconds held while placed (restart delays included).
    pub attained_gpu_seconds: f64,
    /// Restarts: placements after the first start.
    pub restarts: u32,
    /// Seconds of restart delay still to serve.
    pub restarting_for_s: f64,
    /// A shadow variant (`arch = "shadow"`): its step is the trace's step less its sync
    /// time (compute only, background synchronization) on any placement, interference does
    /// not slow it (it lowers its sync frequency), and each step's statistical progress is
    /// divided by the algorithm's measured penalty
    /// ([`converge_sched::shadow::statistical_penalty`]).
    pub shadow: Option<converge_common::ShadowAlgorithm>,
    /// The GPU types of the current placement's nodes, distinct and sorted (empty: the
    /// types of `placements.csv`, or not placed); set by the simulator with each placement.
    /// The job runs at the slowest one's speed ([`Application::throughput_on`]).
    pub gpu_types: Vec<String>,
    atomic_bsz: u32,
    accum_steps: u32,
    started: bool,
}

impl SimJob {
    /// A job submitted at `submitted_at` (seconds), not placed.
    pub fn new(
        name: impl Into<String>,
        app: &Application,
        submitted_at: f64,
        requested_replicas: u32,
        target_batch_size: u32,
    ) -> Self {
        SimJob {
            name: name.into(),
            app: app.name.clone(),
            submitted_at,
            target_batch_size,
            requested_replicas,
            placement: Vec::new(),
            epoch: 0,
            progress: 0.0,
            completed_at: None,
            attained_gpu_seconds: 0.0,
            restarts: 0,
            restarting_for_s: 0.0,
            shadow: None,
            gpu_types: Vec::new(),
            atomic_bsz: 0,
            accum_steps: 0,
            started: false,
        }
    }

    /// `step_model` of the job's application, for a shadow variant compute-only (the
    /// trace's `step_time − sync_time`, also for each accumulation pass) with the gain
    /// divided by its statistical-efficiency penalty.
    fn model(
        &self,
        app: &Application,
        placement: &[u32],
        replicas: u32,
        (atomic, accum): (u32, u32),
    ) -> (f64, f64, f64) {
        let (total, batch, gain) = app.step_model(
            (&self.gpu_types, placement),
            replicas,
            atomic,
            accum,
            self.epoch,
        );
        match self.shadow {
            None => (total, batch, gain),
            Some(algo) => {
                let (step, sync) = app.throughput_on(&self.gpu_types, placement, f64::from(atomic));
                let compute = (step - sync).max(step * 1e-3) * f64::from(accum + 1);
                (
                    compute,
                    batch,
                    gain / converge_sched::shadow::statistical_penalty(algo),
                )
            }
        }
    }

    /// Per-GPU micro-batch of the current placement (0 when not placed), samples.
    pub fn atomic_bsz(&self) -> u32 {
        self.atomic_bsz
    }

    /// Gradient-accumulation steps of the current placement.
    pub fn accum_steps(&self) -> u32 {
        self.accum_steps
    }

    /// Effective total batch size of the current placement (0 when not placed), samples.
    pub fn batch_size(&self) -> u32 {
        self.replicas() * self.atomic_bsz * (self.accum_steps + 1)
    }

    fn replicas(&self) -> u32 {
        self.placement.iter().sum()
    }

    /// Changes the placement; a non-empty new placement costs `restart_delay_s` with no
    /// progress (Pollux: 30 s) and counts a restart (the first start counts 0, as Pollux's
    /// `num_restarts`). Every call with a non-empty placement is a restart, even if it equals
    /// the current one: call it only on a change. An empty placement stops the job (and
    /// drops any restart delay left; the next placement starts a new one). The job runs
    /// `batch` (per-GPU micro-batch, accumulation steps) when given, else its target batch
    /// split by [`Application::batch_config`].
    pub fn reallocate(
        &mut self,
        app: &Application,
        placement: Vec<u32>,
        restart_delay_s: f64,
        batch: Option<(u32, u32)>,
    ) {
        let mut placement = placement;
        placement.retain(|&g| g > 0);
        self.placement = placement;
        if self.placement.is_empty() {
            self.atomic_bsz = 0;
            self.accum_steps = 0;
            self.restarting_for_s = 0.0;
            return;
        }
        self.set_batch(app, batch);
        self.restarting_for_s = restart_delay_s.max(0.0);
        if self.started {
            self.restarts += 1;
        }
        self.started = true;
    }

    /// Runs `batch` (per-GPU micro-batch, accumulation steps) from now on, without a restart
    /// (an adaptive job re-tunes its batch in process, as AdaptDL's do), or the target batch
    /// split over the current placement when `None`. The target batch becomes the new total.
    pub fn set_batch(&mut self, app: &Application, batch: Option<(u32, u32)>) {
        if self.placement.is_empty() {
            return;
        }
        let (atomic, accum) = match batch {
            Some((atomic, accum)) if atomic > 0 => (atomic, accum),
            _ => app.batch_config_on(&self.gpu_types, self.target_batch_size, self.replicas()),
        };
        self.atomic_bsz = atomic;
        self.accum_steps = accum;
        if batch.is_some() {
            self.target_batch_size = self.batch_size();
        }
    }

    /// Gradient statistics a worker would report now (`(grad_sqr, grad_var)` at the current
    /// batch and epoch), `None` when not placed.
    pub fn grad_stats(&self, app: &Application) -> Option<(f64, f64)> {
        (!self.placement.is_empty()).then(|| app.grad_stats(self.batch_size(), self.epoch))
    }

    /// Advances the job from time `now` by `seconds` under `interference` (0..1, goodput ×
    /// (1 − interference)); sets `completed_at` (absolute seconds) when it passes its
    /// completion epoch. Returns the samples processed in this interval. A job that is not
    /// placed, or already complete, does nothing.
    pub fn step(&mut self, app: &Application, now: f64, seconds: f64, interference: f64) -> f64 {
        if self.placement.is_empty()
            || self.completed_at.is_some()
            || seconds.is_nan()
            || seconds <= 0.0
        {
            return 0.0;
        }
        let gpus = f64::from(self.replicas());
        let delay = self.restarting_for_s.min(seconds);
        self.attained_gpu_seconds += delay * gpus;
        self.restarting_for_s -= delay;
        let mut elapsed = delay;
        let mut left = seconds - delay;
        let slow = if self.shadow.is_some() {
            1.0
        } else {
            1.0 - interference.clamp(0.0, 1.0)
        };
        let mut samples = 0.0;
        let replicas = self.replicas();
        while left > 0.0 && self.completed_at.is_none() {
            let (total, batch, gain) = self.model(
                app,
                &self.placement,
                replicas,
                (self.atomic_bsz, self.accum_steps),
            );
            let goodput = gain / total * slow;
            let sample_rate = batch / total * slow;
            let next = app.progress(self.epoch + 1);
            if self.progress + goodput * left < next {
                self.progress += goodput * left;
                samples += sample_rate * left;
                self.attained_gpu_seconds += left * gpus;
                elapsed += left;
                left = 0.0;
            } else {
                self.epoch += 1;
                let delta = ((next - self.progress) / goodput)
                    .round_ties_even()
                    .min(left);
                if self.epoch > app.completion_epoch(batch as u32) {
                    self.completed_at = Some(now + elapsed + delta);
                }
                self.progress = next;
                samples += sample_rate * delta;
                self.attained_gpu_seconds += delta * gpus;
                elapsed += delta;
                left -= delta;
            }
        }
        samples
    }

    /// Samples per second and seconds per optimizer step of the current placement (what an
    /// agent would observe, no interference), None when not placed.
    pub fn observed_step(&self, app: &Application) -> Option<(f64, f64)> {
        if self.placement.is_empty() {
            return None;
        }
        let (step, sync) =
            app.throughput_on(&self.gpu_types, &self.placement, f64::from(self.atomic_bsz));
        let total = if self.shadow.is_some() {
            (step - sync).max(step * 1e-3) * f64::from(self.accum_steps + 1)
        } else {
            step + (step - sync) * f64::from(self.accum_steps)
        };
        Some((f64::from(self.batch_size()) / total, total))
    }

    /// Oracle for the Optimus+Oracle baseline: statistical progress left until completion.
    pub fn remaining_progress(&self, app: &Application) -> f64 {
        if self.completed_at.is_some() {
            return 0.0;
        }
        let end = app.progress(app.completion_epoch(self.target_batch_size) + 1);
        (end - self.progress).max(0.0)
    }

    /// Oracle for the Optimus+Oracle baseline: progress per second (no interference, no
    /// restart delay) in the current epoch with `replicas` GPUs packed on the fewest nodes of
    /// `gpus_per_node` GPUs, with the same throughput model and gain as [`SimJob::step`].
    pub fn progress_rate(&self, app: &Application, replicas: u32, gpus_per_node: u32) -> f64 {
        if replicas == 0 || gpus_per_node == 0 {
            return 0.0;
        }
        let mut placement = vec![gpus_per_node; (replicas / gpus_per_node) as usize];
        if !replicas.is_multiple_of(gpus_per_node) {
            placement.push(replicas % gpus_per_node);
        }
        let (atomic, accum) = app.batch_config(self.target_batch_size, replicas);
        let (total, _, gain) = self.model(app, &placement, replicas, (atomic, accum));
        gain / total
    }
}

/// Delaunay tetrahedralization of integer points by Bowyer–Watson insertion with exact
/// (`i128`) predicates and a symbolic vertex at infinity (hull faces are tetrahedra with
/// [`delaunay::INF`] as fourth vertex). Ties between cospherical points are broken by
/// insertion order.
mod delaunay;

#[cfg(test)]
mod tests;

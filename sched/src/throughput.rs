//! Per-job throughput model: seconds per optimizer step as a function of the number of
//! data-parallel workers, the servers they span and the per-worker batch, fitted per job by
//! non-negative least squares (design brief §5.2). It turns "one more GPU" into samples per
//! second for the scheduling policy.
//!
//! # The model
//!
//! Following the brief (an Optimus/Pollux-style model: Peng et al., "Optimus", EuroSys'18;
//! Qiao et al., "Pollux", OSDI'21), a step is compute plus gradient synchronisation,
//! `t(w, P) = t_compute + t_sync(w, P)`. For a ring all-reduce of `M` bytes,
//! `t_sync ≈ α·(servers spanned − 1) + 2·(w−1)/w · M / B_eff`, where `B_eff` is the
//! intra-node bandwidth when the ring stays on one server and the NIC bandwidth otherwise.
//! With the per-job constants (`M`, both bandwidths, `α`, the per-sample compute cost) folded
//! into five non-negative coefficients `θ`, for `w` workers spanning `n` servers with a
//! per-worker batch of `b` samples:
//!
//! ```text
//! t(w, n, b) = θ_c·b + θ_0 + θ_intra·[n = 1]·r(w) + θ_inter·[n > 1]·r(w) + θ_α·log₂ n
//! r(w)       = 2·(w − 1)/w            (0 for w = 1, 1 for w = 2, → 2 for large w)
//! ```
//!
//! The spanning term `θ_α·log₂ n` (0 on one server, `θ_α` on two, 1.58·θ_α on three, 2·θ_α
//! on four) is the cost of a ring leaving its server beyond the bandwidth term: a flat ring
//! has one edge out of and one into every server it spans, all working in parallel, and
//! each of its `2(w−1)` exchanges waits for the slowest of them, whose expected delay grows
//! like the logarithm of their number, not linearly. Measured on the shaped cluster
//! (`data/netns/ring-steps.csv`, docs/communication.md): a 4-rank ring's sync time is
//! 42, 51 and 53 ms on 2, 3 and 4 hosts. A linear `θ_α·(n − 1)` (this model's earlier form),
//! fitted on 1–2 servers, put 4 hosts 10 % too slow.
//!
//! | coefficient | index | unit | meaning |
//! |---|---|---|---|
//! | `θ_c` | 0 | s/sample | forward/backward compute per sample on one worker |
//! | `θ_0` | 1 | s | fixed per-step cost (optimizer update, data loading, launch) |
//! | `θ_intra` | 2 | s | `M / B_intra`: ring all-reduce volume over intra-node bandwidth |
//! | `θ_inter` | 3 | s | `M / B_NIC`: the same over the network |
//! | `θ_α` | 4 | s | latency/overhead of spanning servers, times `log₂ n` |
//!
//! Times are seconds, batches are samples, throughput is samples per second:
//! [`ThroughputModel::samples_per_s`] is `w·b / t(w, n, b)`. Compute and synchronisation
//! are added, not overlapped (Pollux's `(t_grad^γ + t_sync^γ)^(1/γ)` overlap, and SJF-BCO's
//! overhead/contention terms, come later). [`packed_nodes`] gives the `n` of the tightest
//! packing of a worker count onto servers.
//!
//! # The fit
//!
//! [`ThroughputModel::fit`] regresses the observed step times on the five features
//! `[b, 1, [n=1]·r(w), [n>1]·r(w), n−1]` with `θ ≥ 0` (the `nnls` crate, a port of
//! Lawson–Hanson's NNLS as used by `scipy.optimize.nnls`). Observations that are not usable
//! (`workers` or `nodes` 0, a batch or step time that is not finite and positive) are
//! skipped. To keep the problem well scaled, every feature column is divided by its
//! root-mean-square over the rows and the targets by the median step time, so each scaled
//! coefficient is "seconds of a typical observation's step, in units of the median step".
//!
//! ## Synchronization rows
//!
//! A trainer that measures its synchronization (the worker contract's `sync_s`: seconds per
//! step in the ring all-reduce, or in the parameter-server push and pull) gives the fit a
//! second row for that observation, on the communication features alone (the spanning term
//! included: a trainer's timer around its all-reduce covers the wait for the slowest
//! cross-server edge too):
//!
//! ```text
//! step row:  t(w, n, b) ≈ θ_c·b + θ_0 + θ_intra·[n = 1]·r(w) + θ_inter·[n > 1]·r(w) + θ_α·log₂ n
//! sync row:  sync(w, n) ≈               θ_intra·[n = 1]·r(w) + θ_inter·[n > 1]·r(w) + θ_α·log₂ n
//! ```
//!
//! Both are in seconds per step and weigh the same (one row each, scaled like the step rows:
//! the column RMS is taken over all rows, the target divided by the median step time). A
//! sync time is used only when it is finite and `>= 0`
//! ([`StepObservation::usable_sync_time_s`]), and only for two workers or more (with one
//! worker the row's features are all 0); it is capped at the observation's step time. The
//! sync row pins the split between compute and communication that step times alone leave
//! to the prior: from one configuration on several servers it gives the communication
//! `θ_inter·r(w) + θ_α·log₂ n` exactly and leaves `θ_c·b + θ_0` to the rest of the step;
//! the prior splits the communication between its two terms, so other world sizes on the
//! same number of servers are predicted within a few percent (unit test
//! `sync_times_pin_the_communication_split_from_one_configuration`), and two world sizes on
//! several servers separate them. With no sync time in any observation the rows, the
//! scaling and the result are exactly those of the step rows alone.
//!
//! # The prior
//!
//! With no data ([`ThroughputModel::prior`]) a job runs `samples_per_s_per_worker` samples/s
//! on one worker, so the single-worker step at the reference batch `b_ref` is
//! `t1 = b_ref / samples_per_s_per_worker`, split as `θ_c·b_ref = 0.9·t1`, `θ_0 = 0.1·t1`, and
//! `θ_intra = intra_sync_fraction·t1`, `θ_inter = inter_sync_fraction·t1`,
//! `θ_α = per_node_overhead_fraction·t1`. A two-worker ring on one server thus adds
//! `intra_sync_fraction·t1` (`r(2) = 1`) and a large one up to twice that (`r → 2`).
//!
//! Once observations exist, the prior is first **anchored** to them: `b_ref` becomes the
//! (lower) median batch of the observations with the fewest workers (fewest nodes among
//! those), and the prior's scale `t1` is chosen so that the prior reproduces those
//! observations (median over them of `observed / prior-shape`, i.e. `t1` is the observed step
//! minus what the prior's sync terms would add). The prior then only supplies the *shape* —
//! the 0.9/0.1 compute split and the sync fractions — not the job's speed. A reference
//! observation with a usable sync time below its step time anchors on the rest instead:
//! `(step − sync) / (prior shape without the communication terms)`, so the prior's compute
//! terms agree with the measured compute rather than absorbing the communication; the
//! prior's communication terms (`θ_intra`, `θ_inter`, `θ_α`) are then scaled together so
//! that the prior reproduces the measured sync time, keeping the prior's proportions between
//! them (one configuration cannot separate bandwidth from spanning).
//!
//! The anchored prior enters the NNLS as ridge pseudo-observations, but **only along the
//! directions the data cannot identify**: with `X̃` the scaled design and `G = X̃ᵀX̃/N` (unit
//! diagonal for every observed feature, eigenpairs `(λ_j, v_j)`), one row
//! `sqrt(weight·N)·φ_j·v_jᵀ(θ̃ − θ̃_prior) = 0` is appended per direction with
//! `φ_j = max(0, 1 − λ_j/0.01)`. Rows are in the same scaled step-seconds as the data rows,
//! and `weight·N` makes the prior worth `weight` of the data, whatever `N`. So:
//!
//! - directions the data pins down (`λ_j ≥ 0.01`) get no prior at all, and noise-free
//!   observations spanning enough configurations are fitted exactly;
//! - directions with no data at all (`λ_j = 0`: a feature never observed, or two features
//!   that moved together in every observation) are set by the anchored prior, whatever the
//!   weight (as long as it is positive), because the data has no curvature there;
//! - weakly identified directions (`0 < λ_j < 0.01`) are a blend, the prior weighing
//!   `weight·φ_j²` against the data's `λ_j`.
//!
//! # When the fit is identifiable
//!
//! All five coefficients are identified (the scaled Gram matrix has full rank) when the
//! observations include
//!
//! - at least two batch sizes, which separates `θ_c` from `θ_0`;
//! - one-server runs at two different worker counts (one of them may be a single worker),
//!   which gives `θ_intra`;
//! - multi-server runs in which `r(w)` and `log₂ n` do not move in proportion, e.g. two worker
//!   counts on the same number of servers, which separates `θ_inter` from `θ_α`.
//!
//! A multi-worker observation with a sync time also identifies its communication coefficient
//! (`θ_intra` on one server, `θ_inter` on several) by itself.
//!
//! Otherwise the prior fills in exactly the missing directions. A single configuration
//! identifies only its own step time: the anchored prior reproduces it exactly and spreads it
//! over the terms in the prior's proportions (with its sync time: its communication
//! coefficient and the rest of its step, the rest spread in the prior's proportions; the
//! other communication coefficient is the prior's fraction of the compute). A fixed batch (as in a running job) never
//! separates `θ_c` from `θ_0`: predictions at that batch follow the data, other batches the
//! prior's 0.9/0.1 split. Multi-server runs on two servers only (`r` = 1, 1.5, 1.75 at 2, 4,
//! 8 workers against a constant `log₂ n`) do separate `θ_inter` from `θ_α`, but only just:
//! for Pollux's layout (1, 2, 4 workers on one node; 2, 4, 8 on two) the non-zero
//! eigenvalues of `G` go down to 0.017, just above the 0.01 cut.
//!
//! # Accuracy on measured data
//!
//! On Pollux's measured step times (`../shared/data/pollux/traces/*/placements.csv`), fitting 1, 2, 4
//! and 8 workers on 1–2 nodes at one per-GPU batch, the median relative error on the fitted
//! rows is up to 20 % depending on the application and batch (cifar10 at batch 129: 9.7 %,
//! 90th percentile 14.5 %). The misfit is structural: there, cross-node synchronisation grows
//! roughly linearly with the workers, while `r(w)` saturates; Pollux's own model uses a term
//! linear in `w`. Small batches, where the measured sync time shrinks as compute grows
//! (overlap), fit worst.
//!
//! Pollux's files also hold a measured sync time per row (test `pollux_sync_times_report`,
//! median / p90 relative error over every placement, all batches). Fitted on the 1–8-worker,
//! 1–2-node rows, adding the sync rows helps a little on all six applications (cifar10
//! 6.8 % → 6.5 % median, 27.3 % → 26.2 % p90; imagenet 13.7 % → 12.3 %; ncf 30.4 % →
//! 29.4 %; deepspeech2 8.0 % → 6.5 % median, p90 26.5 % → 19.9 %). Fitted on one
//! configuration (the first 4-workers-on-2-nodes row) it is worse on all six (cifar10 4.1 %
//! → 5.8 %, ncf 13.0 % → 27.4 % median): Pollux's sync times vary from placement to placement
//! far more than `r(w)` allows (ncf at batch 513: 33 ms for 4 GPUs on 2 nodes, 11 ms for 2 on
//! 2, 18–23 ms for 7 on 3), so the one measured sync extrapolates its noise, while the fit
//! without it predicts nearly the observed step everywhere, which those flat measurements
//! happen to favour.
//!
//! Everything here is pure and deterministic (no I/O, no clock, no randomness) and never
//! panics: a problem that is not finite falls back to the anchored prior, then to the plain
//! prior, and the solver runs under `catch_unwind` because the `nnls` crate keeps one
//! `panic!` on a path its author reports as unreachable (the property test below reaches it
//! with pathological inputs, step times near 1e300 s; the panic message is still printed).

use ndarray::{Array1, Array2};

/// Largest step time an observation may report, seconds (one day).
pub const MAX_STEP_TIME_S: f64 = 86_400.0;

/// Largest per-worker batch an observation may report, samples.
pub const MAX_LOCAL_BATCH: f64 = 1e9;

/// Number of coefficients `θ`.
const K: usize = 5;

/// Share of the prior's single-worker step that is per-sample compute (`θ_c·b_ref`); the rest
/// (`1 − COMPUTE_SHARE`) is the fixed per-step cost `θ_0`.
const COMPUTE_SHARE: f64 = 0.9;

/// Eigenvalue of the normalized Gram matrix at and above which a direction counts as
/// identified by the data and gets no prior (a linear ramp to full prior weight at 0).
const IDENTIFIED_EIGENVALUE: f64 = 1e-2;

/// Reference per-worker batch of the prior when neither the caller nor any observation gives
/// one (samples).
pub const DEFAULT_PRIOR_LOCAL_BATCH: f64 = 32.0;

/// One measured configuration of a job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepObservation {
    /// Data-parallel workers (ranks), >= 1.
    pub workers: u32,
    /// Servers spanned, >= 1.
    pub nodes: u32,
    /// Samples per worker per step.
    pub local_batch: f64,
    /// Seconds per optimizer step (observed).
    pub step_time_s: f64,
    /// Seconds per optimizer step spent synchronizing gradients (the communication part of
    /// `step_time_s`), when the trainer reported it. Used by the fit only when
    /// [`StepObservation::usable_sync_time_s`] accepts it.
    pub sync_time_s: Option<f64>,
}

impl StepObservation {
    /// Whether [`ThroughputModel::fit`] uses this observation: at least one worker and one
    /// node, a positive batch of at most [`MAX_LOCAL_BATCH`] samples and a positive step
    /// time of at most [`MAX_STEP_TIME_S`] (larger values are reporting errors, and keep the
    /// solver away from overflow).
    pub fn is_usable(&self) -> bool {
        self.workers >= 1
            && self.nodes >= 1
            && self.local_batch > 0.0
            && self.local_batch <= MAX_LOCAL_BATCH
            && self.step_time_s > 0.0
            && self.step_time_s <= MAX_STEP_TIME_S
    }

    /// The synchronization time the fit uses for this observation: the reported one when it
    /// is finite and `>= 0`, capped at the step time (synchronization is part of the step);
    /// `None` when absent or not a number, or when the ring moves nothing (one worker: the
    /// communication features are all 0, so the row would say nothing about `θ`).
    pub fn usable_sync_time_s(&self) -> Option<f64> {
        let sync = self.sync_time_s?;
        (sync.is_finite() && sync >= 0.0 && ring_factor(self.workers) > 0.0)
            .then(|| sync.min(self.step_time_s))
    }
}

/// Prior used before (and to regularize) the fit. Out-of-range fields (not finite, or
/// negative; a throughput that is not positive) are replaced by the defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ThroughputPrior {
    /// Single-worker throughput assumed with no data (samples/s; default 100).
    pub samples_per_s_per_worker: f64,
    /// `θ_intra` as a fraction of the single-worker step: the extra step time of a two-worker
    /// ring on one server (up to twice this for a large ring; default 0.05).
    pub intra_sync_fraction: f64,
    /// The same across servers (`θ_inter`; default 0.25).
    pub inter_sync_fraction: f64,
    /// Extra step time per extra server spanned (`θ_α`) as a fraction of the single-worker
    /// step (default 0.02).
    pub per_node_overhead_fraction: f64,
    /// Weight of the prior pseudo-observations relative to the data along weakly identified
    /// directions (default 0.1; see the module docs). 0 turns the prior off in the fit.
    pub weight: f64,
}

impl Default for ThroughputPrior {
    fn default() -> Self {
        Self {
            samples_per_s_per_worker: 100.0,
            intra_sync_fraction: 0.02,
            inter_sync_fraction: 0.05,
            per_node_overhead_fraction: 0.01,
            weight: 0.1,
        }
    }
}

impl ThroughputPrior {
    /// This prior with every out-of-range field replaced by its default.
    pub fn sanitized(&self) -> Self {
        let d = Self::default();
        let non_negative = |v: f64, default: f64| {
            if v.is_finite() && v >= 0.0 {
                v
            } else {
                default
            }
        };
        Self {
            samples_per_s_per_worker: if self.samples_per_s_per_worker.is_finite()
                && self.samples_per_s_per_worker > 0.0
            {
                self.samples_per_s_per_worker
            } else {
                d.samples_per_s_per_worker
            },
            intra_sync_fraction: non_negative(self.intra_sync_fraction, d.intra_sync_fraction),
            inter_sync_fraction: non_negative(self.inter_sync_fraction, d.inter_sync_fraction),
            per_node_overhead_fraction: non_negative(
                self.per_node_overhead_fraction,
                d.per_node_overhead_fraction,
            ),
            weight: non_negative(self.weight, d.weight),
        }
    }

    /// The prior's `θ` for a single-worker step of 1 s at reference batch `b_ref`: multiply
    /// by `t1` (seconds) for the prior proper. Assumes a sanitized prior and `b_ref > 0`.
    fn shape(&self, b_ref: f64) -> [f64; K] {
        [
            COMPUTE_SHARE / b_ref,
            1.0 - COMPUTE_SHARE,
            self.intra_sync_fraction,
            self.inter_sync_fraction,
            self.per_node_overhead_fraction,
        ]
    }
}

/// `t(w, n, b) = θ_c·b + θ_0 + θ_intra·[n==1]·2(w−1)/w + θ_inter·[n>1]·2(w−1)/w + θ_α·log₂ n`,
/// all `θ ≥ 0` (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct ThroughputModel {
    /// `[θ_c (s/sample), θ_0, θ_intra, θ_inter, θ_α (s)]`, finite and non-negative.
    theta: [f64; K],
    /// Usable observations the model was fitted on (0 for the plain prior).
    observations: usize,
    /// Largest world size among them (0 for the prior or given coefficients).
    max_workers: u32,
}

/// Ring all-reduce volume factor `2·(w−1)/w` (0 for 0 or 1 worker).
pub fn ring_factor(workers: u32) -> f64 {
    if workers <= 1 {
        0.0
    } else {
        let w = f64::from(workers);
        2.0 * (w - 1.0) / w
    }
}

/// The model's features `[b, 1, [n=1]·r(w), [n>1]·r(w), log₂ n]`; 0 nodes count as 1.
pub fn features(workers: u32, nodes: u32, local_batch: f64) -> [f64; K] {
    let r = ring_factor(workers);
    let (intra, inter) = if nodes <= 1 { (r, 0.0) } else { (0.0, r) };
    [local_batch, 1.0, intra, inter, spanning(nodes)]
}

/// The spanning feature `log₂ n` of `n` servers (0 for one server, or 0 servers): see the
/// module docs for why it grows like a logarithm.
pub fn spanning(nodes: u32) -> f64 {
    f64::from(nodes.max(1)).log2()
}

fn dot(a: &[f64; K], b: &[f64; K]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Lower median of finite values (`None` when empty).
fn lower_median(mut values: Vec<f64>) -> Option<f64> {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    Some(values[(values.len() - 1) / 2])
}

/// Root mean square, computed without overflow for huge entries.
fn rms(values: impl Iterator<Item = f64> + Clone) -> f64 {
    let max = values.clone().fold(0.0_f64, |m, v| m.max(v.abs()));
    if max == 0.0 || !max.is_finite() {
        return max;
    }
    let (sum, count) = values.fold((0.0, 0usize), |(s, c), v| (s + (v / max).powi(2), c + 1));
    max * (sum / count as f64).sqrt()
}

/// Eigen-decomposition of a symmetric matrix by cyclic Jacobi rotations: eigenvalues and the
/// matching eigenvectors as the columns of the second matrix (`v[i][j]` = component `i` of
/// vector `j`).
fn symmetric_eigen(mut a: [[f64; K]; K]) -> ([f64; K], [[f64; K]; K]) {
    let mut v = [[0.0; K]; K];
    for (i, row) in v.iter_mut().enumerate() {
        row[i] = 1.0;
    }
    for _sweep in 0..100 {
        let mut off = 0.0;
        let mut total = 0.0;
        for (p, row) in a.iter().enumerate() {
            for (q, x) in row.iter().enumerate() {
                total += x * x;
                if p != q {
                    off += x * x;
                }
            }
        }
        if off <= 1e-30 * total || !off.is_finite() {
            break;
        }
        for p in 0..K {
            for q in p + 1..K {
                let apq = a[p][q];
                if apq == 0.0 {
                    continue;
                }
                let theta = (a[q][q] - a[p][p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for row in a.iter_mut() {
                    let (akp, akq) = (row[p], row[q]);
                    row[p] = c * akp - s * akq;
                    row[q] = s * akp + c * akq;
                }
                let (upper, lower) = a.split_at_mut(q);
                for (apk, aqk) in upper[p].iter_mut().zip(lower[0].iter_mut()) {
                    let (x, y) = (*apk, *aqk);
                    *apk = c * x - s * y;
                    *aqk = s * x + c * y;
                }
                for row in v.iter_mut() {
                    let (vkp, vkq) = (row[p], row[q]);
                    row[p] = c * vkp - s * vkq;
                    row[q] = s * vkp + c * vkq;
                }
            }
        }
    }
    let mut values = [0.0; K];
    for (k, value) in values.iter_mut().enumerate() {
        *value = a[k][k];
    }
    (values, v)
}

/// NNLS of `a·x ≈ b`, `x ≥ 0`; `None` unless every input and output is finite.
fn solve_nnls(a: Vec<f64>, b: Vec<f64>) -> Option<[f64; K]> {
    if a.is_empty() || a.len() != b.len() * K || a.iter().chain(&b).any(|v| !v.is_finite()) {
        return None;
    }
    let rows = b.len();
    let a = Array2::from_shape_vec((rows, K), a).ok()?;
    let b = Array1::from_vec(b);
    // `nnls` keeps one `panic!` on a round-off path its author reports as never taken: turn
    // it into a fallback rather than a crash of the scheduler.
    let (x, _residual) = std::panic::catch_unwind(|| nnls::nnls(a.view(), b.view())).ok()?;
    let mut out = [0.0; K];
    for (o, v) in out.iter_mut().zip(x.iter()) {
        if !v.is_finite() {
            return None;
        }
        *o = v.max(0.0);
    }
    Some(out)
}

impl ThroughputModel {
    /// The prior alone (no observations), for a job whose per-worker batch is `local_batch`
    /// (the reference batch `b_ref`; [`DEFAULT_PRIOR_LOCAL_BATCH`] if not finite and
    /// positive).
    pub fn prior(prior: &ThroughputPrior, local_batch: f64) -> Self {
        let prior = prior.sanitized();
        let b_ref = if local_batch.is_finite() && local_batch > 0.0 {
            local_batch
        } else {
            DEFAULT_PRIOR_LOCAL_BATCH
        };
        let t1 = b_ref / prior.samples_per_s_per_worker;
        let theta = prior.shape(b_ref).map(|s| s * t1);
        if theta.iter().all(|v| v.is_finite()) {
            Self {
                theta,
                observations: 0,
                max_workers: 0,
            }
        } else {
            // Only reachable with an extreme batch/throughput ratio: use the default prior at
            // the default batch.
            let d = ThroughputPrior::default();
            let t1 = DEFAULT_PRIOR_LOCAL_BATCH / d.samples_per_s_per_worker;
            Self {
                theta: d.shape(DEFAULT_PRIOR_LOCAL_BATCH).map(|s| s * t1),
                observations: 0,
                max_workers: 0,
            }
        }
    }

    /// A model with the given coefficients `[θ_c, θ_0, θ_intra, θ_inter, θ_α]`; entries that
    /// are not finite and non-negative become 0.
    pub fn from_coefficients(theta: [f64; K], observations: usize) -> Self {
        Self {
            theta: theta.map(|v| if v.is_finite() && v > 0.0 { v } else { 0.0 }),
            observations,
            max_workers: 0,
        }
    }

    /// The same job on a GPU `speed` times as fast at computing (a [`crate::gpu_types`]
    /// ratio): the compute coefficients `θ_c` and `θ_0` divided by `speed`, the
    /// synchronization ones (`θ_intra`, `θ_inter`, `θ_α`: placement and network, not the
    /// GPU) kept. A `speed` that is not finite and positive returns the model unchanged.
    pub fn on_faster_gpu(&self, speed: f64) -> Self {
        if !(speed.is_finite() && speed > 0.0) {
            return self.clone();
        }
        let mut theta = self.theta;
        theta[0] /= speed;
        theta[1] /= speed;
        Self {
            theta,
            observations: self.observations,
            max_workers: self.max_workers,
        }
    }

    /// NNLS fit of θ on the observations plus prior pseudo-observations (a ridge toward the
    /// prior anchored at the observed step time of the fewest-worker configuration, applied
    /// only along the directions the data cannot identify; see the module docs). Skips
    /// observations that are not usable ([`StepObservation::is_usable`]). Never panics; with no
    /// usable observation returns the prior (at the first finite positive batch among the
    /// observations, else [`DEFAULT_PRIOR_LOCAL_BATCH`]).
    pub fn fit(observations: &[StepObservation], prior: &ThroughputPrior) -> Self {
        let prior = prior.sanitized();
        let usable: Vec<StepObservation> = observations
            .iter()
            .copied()
            .filter(StepObservation::is_usable)
            .collect();
        let Some((b_ref, anchored)) = anchored_prior(&usable, &prior) else {
            let b = observations
                .iter()
                .map(|o| o.local_batch)
                .find(|b| b.is_finite() && *b > 0.0)
                .unwrap_or(DEFAULT_PRIOR_LOCAL_BATCH);
            return Self::prior(&prior, b);
        };
        let n = usable.len();
        let max_workers = usable.iter().map(|o| o.workers).max().unwrap_or(0);
        match fit_theta(&usable, &anchored, prior.weight) {
            Some(theta) => Self {
                theta,
                observations: n,
                max_workers,
            },
            None if anchored.iter().all(|v| v.is_finite()) => Self {
                theta: anchored,
                observations: n,
                max_workers,
            },
            None => Self::prior(&prior, b_ref),
        }
    }

    /// Predicted seconds per step; finite and > 0 for every input (0 workers count as one
    /// worker, 0 nodes as one node, a batch that is not finite and positive as 0, or the
    /// largest finite batch for `+∞`).
    pub fn step_time_s(&self, workers: u32, nodes: u32, local_batch: f64) -> f64 {
        let b = if local_batch.is_finite() && local_batch > 0.0 {
            local_batch
        } else if local_batch == f64::INFINITY {
            f64::MAX
        } else {
            0.0
        };
        let t = dot(&self.theta, &features(workers, nodes, b));
        if t.is_nan() {
            f64::MIN_POSITIVE
        } else {
            t.clamp(f64::MIN_POSITIVE, f64::MAX)
        }
    }

    /// Predicted samples per second = `workers·local_batch / step_time` (0 for 0 workers or a
    /// batch that is not positive). Never NaN, negative or infinite.
    pub fn samples_per_s(&self, workers: u32, nodes: u32, local_batch: f64) -> f64 {
        if workers == 0 || local_batch.is_nan() || local_batch <= 0.0 {
            return 0.0;
        }
        let b = local_batch.min(f64::MAX);
        let rate = f64::from(workers) * b / self.step_time_s(workers, nodes, b);
        if rate.is_nan() {
            0.0
        } else {
            rate.clamp(0.0, f64::MAX)
        }
    }

    /// Seconds of one forward/backward pass on `local_batch` samples with no synchronization,
    /// `θ_c·b + θ_0` (what a gradient-accumulation step costs; see [`crate::goodput`]).
    pub fn compute_time_s(&self, local_batch: f64) -> f64 {
        let b = if local_batch.is_finite() && local_batch > 0.0 {
            local_batch
        } else {
            0.0
        };
        (self.theta[0] * b + self.theta[1]).clamp(0.0, f64::MAX)
    }

    /// `[θ_c (s/sample), θ_0 (s), θ_intra (s), θ_inter (s), θ_α (s)]`.
    pub fn coefficients(&self) -> [f64; K] {
        self.theta
    }

    /// Usable observations the model was fitted on (0 for the prior alone).
    pub fn observations(&self) -> usize {
        self.observations
    }

    /// Largest world size among the observations the model was fitted on (0 for the prior
    /// or a model built from coefficients).
    pub fn max_workers_observed(&self) -> u32 {
        self.max_workers
    }
}

/// The prior anchored to the observations: `(b_ref, θ_prior)` with `b_ref` the lower median
/// batch of the fewest-workers (then fewest-nodes) observations and `t1` the median over them
/// of `observed step / prior shape`, or, for an observation with a usable sync time (below
/// its step time), of `(step − sync) / prior shape without the communication terms`; the
/// prior's communication coefficients are then scaled so that it reproduces the median
/// reference's sync time. `None` without observations or when not finite.
fn anchored_prior(usable: &[StepObservation], prior: &ThroughputPrior) -> Option<(f64, [f64; K])> {
    let min_workers = usable.iter().map(|o| o.workers).min()?;
    let min_nodes = usable
        .iter()
        .filter(|o| o.workers == min_workers)
        .map(|o| o.nodes)
        .min()?;
    let reference: Vec<&StepObservation> = usable
        .iter()
        .filter(|o| o.workers == min_workers && o.nodes == min_nodes)
        .collect();
    let b_ref = lower_median(reference.iter().map(|o| o.local_batch).collect())?;
    let shape = prior.shape(b_ref);
    let t1 = lower_median(
        reference
            .iter()
            .map(|o| {
                let f = features(o.workers, o.nodes, o.local_batch);
                match o.usable_sync_time_s() {
                    // The measured communication is not the prior's to guess: scale the
                    // prior's other terms to the rest of the step.
                    Some(sync) if o.step_time_s > sync => {
                        let sf = sync_features(o.workers, o.nodes);
                        let rest: [f64; K] = std::array::from_fn(|k| f[k] - sf[k]);
                        (o.step_time_s - sync) / dot(&shape, &rest)
                    }
                    _ => o.step_time_s / dot(&shape, &f),
                }
            })
            .collect(),
    )?;
    let mut theta = shape.map(|s| s * t1);
    // The reference's measured sync sets the scale of the prior's communication terms
    // (their proportions stay the prior's): what the one configuration cannot split between
    // bandwidth and spanning is split as the prior would, not by the solver's geometry.
    let comm_scale = lower_median(
        reference
            .iter()
            .filter_map(|o| {
                let sync = o.usable_sync_time_s()?;
                let prior_sync = dot(&theta, &sync_features(o.workers, o.nodes));
                (prior_sync > 0.0).then(|| sync / prior_sync)
            })
            .collect(),
    );
    if let Some(scale) = comm_scale.filter(|s| s.is_finite()) {
        for v in &mut theta[2..] {
            *v *= scale;
        }
    }
    (b_ref.is_finite() && theta.iter().all(|v| v.is_finite() && *v >= 0.0))
        .then_some((b_ref, theta))
}

/// The communication features `[0, 0, [n=1]·r(w), [n>1]·r(w), log₂ n]`: the part of
/// [`features`] that a measured synchronization time is regressed on.
pub fn sync_features(workers: u32, nodes: u32) -> [f64; K] {
    let f = features(workers, nodes, 0.0);
    [0.0, 0.0, f[2], f[3], f[4]]
}

/// The least-squares rows of the usable observations: one step row per observation
/// ([`features`] → step time), then one sync row per observation with a usable sync time
/// ([`sync_features`] → sync time). Both in seconds, with the same weight.
fn design_rows(usable: &[StepObservation]) -> (Vec<[f64; K]>, Vec<f64>) {
    let mut x: Vec<[f64; K]> = usable
        .iter()
        .map(|o| features(o.workers, o.nodes, o.local_batch))
        .collect();
    let mut y: Vec<f64> = usable.iter().map(|o| o.step_time_s).collect();
    for o in usable {
        if let Some(sync) = o.usable_sync_time_s() {
            x.push(sync_features(o.workers, o.nodes));
            y.push(sync);
        }
    }
    (x, y)
}

/// The scaled NNLS with prior rows along the weakly identified directions (module docs).
fn fit_theta(usable: &[StepObservation], anchored: &[f64; K], weight: f64) -> Option<[f64; K]> {
    let (x, y) = design_rows(usable);
    let n = x.len();
    let y_scale = lower_median(usable.iter().map(|o| o.step_time_s).collect())?;
    let mut scale = [1.0; K];
    for (k, c) in scale.iter_mut().enumerate() {
        let r = rms(x.iter().map(|row| row[k]));
        if r.is_finite() && r > 0.0 {
            *c = r;
        }
    }
    // Scaled design X̃ (column k divided by its RMS) and targets ỹ (in median steps).
    let xs: Vec<[f64; K]> = x
        .iter()
        .map(|row| std::array::from_fn(|k| row[k] / scale[k]))
        .collect();
    let ys: Vec<f64> = y.iter().map(|t| t / y_scale).collect();
    let prior_scaled: [f64; K] = std::array::from_fn(|k| anchored[k] * scale[k] / y_scale);

    let mut a: Vec<f64> = xs.iter().flatten().copied().collect();
    let mut b = ys;
    if weight > 0.0 {
        let mut gram = [[0.0; K]; K];
        for row in &xs {
            for p in 0..K {
                for q in 0..K {
                    gram[p][q] += row[p] * row[q] / n as f64;
                }
            }
        }
        if gram.iter().flatten().any(|v| !v.is_finite()) {
            return None;
        }
        let (values, vectors) = symmetric_eigen(gram);
        let strength = (weight * n as f64).sqrt();
        for (j, &lambda) in values.iter().enumerate() {
            let phi = (1.0 - lambda / IDENTIFIED_EIGENVALUE).clamp(0.0, 1.0);
            if phi <= 0.0 {
                continue;
            }
            let row: [f64; K] = std::array::from_fn(|k| strength * phi * vectors[k][j]);
            b.push(dot(&row, &prior_scaled));
            a.extend_from_slice(&row);
        }
    }
    let scaled = solve_nnls(a, b)?;
    let theta: [f64; K] = std::array::from_fn(|k| scaled[k] * y_scale / scale[k]);
    theta.iter().all(|v| v.is_finite()).then_some(theta)
}

/// Fewest nodes `workers` workers of `gpus_per_worker` GPUs span when packed onto nodes of
/// `gpus_per_node` GPUs (a worker never splits across nodes):
/// `ceil(workers / floor(gpus_per_node / gpus_per_worker))`, at least 1. A worker larger
/// than a node takes `ceil(gpus_per_worker / gpus_per_node)` whole nodes of its own;
/// `gpus_per_worker` 0 counts as 1 and `gpus_per_node` 0 as one worker per node.
pub fn packed_nodes(workers: u32, gpus_per_worker: u32, gpus_per_node: u32) -> u32 {
    let workers = workers.max(1);
    let gpus_per_worker = gpus_per_worker.max(1);
    if gpus_per_node == 0 {
        return workers;
    }
    let per_node = gpus_per_node / gpus_per_worker;
    if per_node == 0 {
        workers.saturating_mul(gpus_per_worker.div_ceil(gpus_per_node))
    } else {
        workers.div_ceil(per_node)
    }
    .max(1)
}

/// The measured Pollux step times, for the tests of this model and of the contention model.
#[cfg(test)]
pub(crate) mod pollux_rows {
    use std::path::Path;

    /// One row of a Pollux `placements.csv`: (workers, nodes, local batch, step time).
    pub type Row = (u32, u32, f64, f64);

    /// The rows of `../shared/data/pollux/traces/<app>/placements.csv`.
    pub fn pollux_rows(app: &str) -> Vec<Row> {
        pollux_rows_with_sync(app)
            .into_iter()
            .map(|(row, _)| row)
            .collect()
    }

    /// The rows of `../shared/data/pollux/traces/<app>/placements.csv` with their measured sync time
    /// (seconds per step). They are not in this repository: they are read from the copy of the
    /// Pollux artifact beside it (`../shared/data/pollux/traces`, data/README.md).
    #[allow(clippy::disallowed_methods)] // a test fixture reading measured data
    pub fn pollux_rows_with_sync(app: &str) -> Vec<(Row, f64)> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let path = ["data/pollux/traces", "../shared/data/pollux/traces"]
            .iter()
            .map(|dir| root.join(dir).join(app).join("placements.csv"))
            .find(|p| p.is_file())
            .unwrap_or_else(|| panic!("no placements.csv of {app}"));
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines = text.lines();
        assert_eq!(
            lines.next().unwrap().trim(),
            "placement,local_bsz,step_time,sync_time"
        );
        lines
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let f: Vec<&str> = l.trim().split(',').collect();
                // The placement id concatenates the GPUs on each node (1-9 per node).
                let digits: Vec<u32> = f[0].chars().map(|c| c.to_digit(10).unwrap()).collect();
                (
                    (
                        digits.iter().sum(),
                        digits.len() as u32,
                        f[1].parse().unwrap(),
                        f[2].parse().unwrap(),
                    ),
                    f[3].parse().unwrap(),
                )
            })
            .collect()
    }

    /// The `q` quantile of `v` (nearest rank).
    pub fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * q).round() as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::pollux_rows::{Row, pollux_rows, pollux_rows_with_sync, quantile};
    use super::*;
    use proptest::prelude::*;

    fn rel(a: f64, b: f64) -> f64 {
        (a - b).abs() / b.abs().max(1e-300)
    }

    /// A twice-as-fast GPU halves the compute part of a step and keeps the
    /// synchronization part: one worker runs twice as fast, eight on two hosts less than
    /// twice; a speed that is not finite and positive changes nothing.
    #[test]
    fn a_faster_gpu_divides_the_compute_and_keeps_the_synchronization() {
        let m = ThroughputModel::from_coefficients([0.002, 0.05, 0.01, 0.1, 0.01], 5);
        let fast = m.on_faster_gpu(2.0);
        assert!(rel(fast.compute_time_s(32.0), m.compute_time_s(32.0) / 2.0) < 1e-12);
        assert!(
            rel(
                fast.samples_per_s(1, 1, 32.0),
                2.0 * m.samples_per_s(1, 1, 32.0)
            ) < 1e-12
        );
        let sync = |m: &ThroughputModel| m.step_time_s(8, 2, 32.0) - m.compute_time_s(32.0);
        assert!(rel(sync(&fast), sync(&m)) < 1e-12);
        let gain = fast.samples_per_s(8, 2, 32.0) / m.samples_per_s(8, 2, 32.0);
        assert!(gain > 1.0 && gain < 2.0, "{gain}");
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(m.on_faster_gpu(bad), m);
        }
    }

    fn synthetic(theta: [f64; K], configs: &[(u32, u32, f64)]) -> Vec<StepObservation> {
        configs
            .iter()
            .map(|&(w, n, b)| StepObservation {
                workers: w,
                nodes: n,
                local_batch: b,
                step_time_s: dot(&theta, &features(w, n, b)),
                sync_time_s: None,
            })
            .collect()
    }

    fn rich_configs() -> Vec<(u32, u32, f64)> {
        let mut configs = Vec::new();
        for &b in &[32.0, 64.0, 128.0] {
            for &w in &[1, 2, 4, 8, 16] {
                for &n in &[1, 2, 4] {
                    if n <= w && (n > 1 || w <= 8) {
                        configs.push((w, n, b));
                    }
                }
            }
        }
        configs
    }

    /// Eigenvalues of the scaled Gram matrix `G` of the fit (module docs), ascending.
    fn gram_eigenvalues(obs: &[StepObservation]) -> Vec<f64> {
        let x: Vec<[f64; K]> = obs
            .iter()
            .map(|o| features(o.workers, o.nodes, o.local_batch))
            .collect();
        let scale: [f64; K] = std::array::from_fn(|k| rms(x.iter().map(|r| r[k])));
        let mut gram = [[0.0; K]; K];
        for row in &x {
            for p in 0..K {
                for q in 0..K {
                    gram[p][q] += row[p] / scale[p] * row[q] / scale[q] / x.len() as f64;
                }
            }
        }
        let mut values = symmetric_eigen(gram).0.to_vec();
        values.sort_by(f64::total_cmp);
        values
    }

    #[test]
    fn eigen_decomposition_reconstructs_the_matrix() {
        let m = [
            [4.0, 1.0, 0.5, 0.0, 2.0],
            [1.0, 3.0, 0.0, 0.1, 0.0],
            [0.5, 0.0, 2.0, 0.3, 0.0],
            [0.0, 0.1, 0.3, 1.0, 0.7],
            [2.0, 0.0, 0.0, 0.7, 5.0],
        ];
        let (values, v) = symmetric_eigen(m);
        for p in 0..K {
            for q in 0..K {
                let r: f64 = (0..K).map(|j| v[p][j] * values[j] * v[q][j]).sum();
                assert!((r - m[p][q]).abs() < 1e-12, "({p},{q}): {r} vs {}", m[p][q]);
            }
        }
    }

    #[test]
    fn recovers_known_coefficients_from_noise_free_observations() {
        let configs = rich_configs();
        for theta in [
            [0.002, 0.01, 0.03, 0.08, 0.015],
            [1e-4, 0.5, 0.001, 2.0, 0.3],
            [0.05, 0.002, 0.2, 0.1, 0.001],
        ] {
            let obs = synthetic(theta, &configs);
            assert!(gram_eigenvalues(&obs)[0] > IDENTIFIED_EIGENVALUE);
            // A prior far from the truth must not bias an identified fit.
            let prior = ThroughputPrior {
                samples_per_s_per_worker: 7.0,
                intra_sync_fraction: 0.9,
                inter_sync_fraction: 0.0,
                per_node_overhead_fraction: 0.5,
                weight: 1.0,
            };
            let model = ThroughputModel::fit(&obs, &prior);
            assert_eq!(model.observations(), obs.len());
            for (k, (got, want)) in model.coefficients().iter().zip(theta).enumerate() {
                assert!(rel(*got, want) < 1e-6, "θ[{k}] = {got}, want {want}");
            }
            let default_fit = ThroughputModel::fit(&obs, &ThroughputPrior::default());
            for (got, want) in default_fit.coefficients().iter().zip(theta) {
                assert!(rel(*got, want) < 1e-6);
            }
        }
    }

    #[test]
    fn zero_coefficients_are_recovered_as_zero() {
        let theta = [0.002, 0.01, 0.0, 0.08, 0.0];
        let obs = synthetic(theta, &rich_configs());
        let model = ThroughputModel::fit(&obs, &ThroughputPrior::default());
        let got = model.coefficients();
        for k in 0..K {
            assert!((got[k] - theta[k]).abs() < 1e-9, "θ[{k}] = {}", got[k]);
        }
    }

    #[test]
    fn prior_matches_its_definition() {
        let p = ThroughputPrior::default();
        let m = ThroughputModel::prior(&p, 64.0);
        let t1 = 64.0 / 100.0;
        let c = m.coefficients();
        assert!(rel(c[0] * 64.0, 0.9 * t1) < 1e-12);
        assert!(rel(c[1], 0.1 * t1) < 1e-12);
        assert!(rel(c[2], p.intra_sync_fraction * t1) < 1e-12);
        assert!(rel(c[3], p.inter_sync_fraction * t1) < 1e-12);
        assert!(rel(c[4], p.per_node_overhead_fraction * t1) < 1e-12);
        assert_eq!(m.observations(), 0);
        assert!(rel(m.samples_per_s(1, 1, 64.0), 100.0) < 1e-12);
        assert!(
            rel(
                m.step_time_s(2, 1, 64.0),
                (1.0 + p.intra_sync_fraction) * t1
            ) < 1e-12
        );
        // No usable observation: the prior.
        let bad = [StepObservation {
            workers: 0,
            nodes: 1,
            local_batch: 64.0,
            step_time_s: 1.0,
            sync_time_s: None,
        }];
        assert_eq!(ThroughputModel::fit(&bad, &p), m);
        assert_eq!(
            ThroughputModel::fit(&[], &p),
            ThroughputModel::prior(&p, DEFAULT_PRIOR_LOCAL_BATCH)
        );
    }

    #[test]
    fn one_observation_is_reproduced_and_scaling_is_sublinear() {
        let p = ThroughputPrior::default();
        for (w, n, b, t) in [(1, 1, 128.0, 0.1), (4, 1, 64.0, 0.3), (8, 2, 32.0, 0.05)] {
            let obs = [StepObservation {
                workers: w,
                nodes: n,
                local_batch: b,
                step_time_s: t,
                sync_time_s: None,
            }];
            let m = ThroughputModel::fit(&obs, &p);
            assert_eq!(m.observations(), 1);
            assert!(
                rel(m.step_time_s(w, n, b), t) < 0.03,
                "{w}/{n}/{b}: {}",
                m.step_time_s(w, n, b)
            );
            let one = m.samples_per_s(1, 1, b);
            let eight = m.samples_per_s(8, 1, b);
            let eight_two = m.samples_per_s(8, 2, b);
            assert!(eight < 8.0 * one, "{eight} vs 8·{one}");
            assert!(
                eight > one,
                "more workers must still help: {eight} vs {one}"
            );
            assert!(
                eight_two < eight,
                "spanning servers costs: {eight_two} vs {eight}"
            );
        }
    }

    #[test]
    fn prior_is_anchored_to_the_single_worker_observation() {
        // The job is 4× slower than the prior assumes; the fit follows the data.
        let obs = [StepObservation {
            workers: 1,
            nodes: 1,
            local_batch: 100.0,
            step_time_s: 4.0,
            sync_time_s: None,
        }];
        let p = ThroughputPrior::default();
        let m = ThroughputModel::fit(&obs, &p);
        let c = m.coefficients();
        assert!(rel(c[0] * 100.0, 3.6) < 1e-9 && rel(c[1], 0.4) < 1e-9);
        assert!(rel(c[2], p.intra_sync_fraction * 4.0) < 1e-9);
        assert!(rel(c[3], p.inter_sync_fraction * 4.0) < 1e-9);
        assert!(rel(c[4], p.per_node_overhead_fraction * 4.0) < 1e-9);
    }

    /// Step and sync times of `w` workers on `n` servers at batch `b` under `theta`: the
    /// step is the full model, the sync its communication terms (`θ_intra`/`θ_inter`/`θ_α`).
    fn with_sync(theta: [f64; K], w: u32, n: u32, b: f64) -> StepObservation {
        StepObservation {
            workers: w,
            nodes: n,
            local_batch: b,
            step_time_s: dot(&theta, &features(w, n, b)),
            sync_time_s: Some(dot(&theta, &sync_features(w, n))),
        }
    }

    #[test]
    fn sync_times_pin_the_communication_split_from_one_configuration() {
        // A communication-heavy job (θ_inter is 6 of the prior's 0.05 fractions of the
        // single-worker step) observed in ONE configuration: 4 workers on 2 servers.
        let theta = [0.003, 0.01, 0.02, 0.3, 0.005];
        let b = 32.0;
        let seen = with_sync(theta, 4, 2, b);
        let prior = ThroughputPrior::default();
        let with = ThroughputModel::fit(&[seen], &prior);
        let without = ThroughputModel::fit(
            &[StepObservation {
                sync_time_s: None,
                ..seen
            }],
            &prior,
        );
        println!(
            "θ with sync {:?}, without {:?}, truth {theta:?}",
            with.coefficients(),
            without.coefficients()
        );
        // The measured communication, θ_inter·r(4) + θ_α·log₂ 2, is the fit's exactly; one
        // configuration cannot split it between bandwidth and spanning, so the prior does.
        let c = with.coefficients();
        let sync = seen.sync_time_s.unwrap();
        assert!(rel(c[3] * ring_factor(4) + c[4], sync) < 0.01, "{c:?}");
        assert!(rel(without.coefficients()[3], theta[3]) > 0.5);
        // Both reproduce the observed step.
        for m in [&with, &without] {
            assert!(rel(m.step_time_s(4, 2, b), seen.step_time_s) < 0.03);
        }
        // Other world sizes on two servers (and more servers): the fit with the sync time
        // predicts them better.
        for (w, n) in [(2, 2), (8, 2), (16, 2), (8, 4)] {
            let truth = dot(&theta, &features(w, n, b));
            let e_with = rel(with.step_time_s(w, n, b), truth);
            let e_without = rel(without.step_time_s(w, n, b), truth);
            println!("  w={w} n={n}: error with sync {e_with:.4}, without {e_without:.4}");
            assert!(e_with < e_without, "{w}/{n}: {e_with} vs {e_without}");
            if n == 2 {
                assert!(e_with < 0.25, "{w}/{n}: {e_with}");
            }
        }
        // A second world size on the same servers separates the two: θ_inter exactly.
        let two = ThroughputModel::fit(&[seen, with_sync(theta, 2, 2, b)], &prior);
        let inter = two.coefficients()[3];
        assert!(
            rel(inter, theta[3]) < 0.03,
            "θ_inter {inter} vs {}",
            theta[3]
        );
        for (w, n) in [(8, 2), (16, 2)] {
            let truth = dot(&theta, &features(w, n, b));
            assert!(rel(two.step_time_s(w, n, b), truth) < 0.03, "{w}/{n}");
        }
    }

    #[test]
    fn sync_times_agree_with_an_identified_fit() {
        // Noise-free step and sync times over many configurations: the sync rows are
        // consistent with the step rows, and the exact coefficients are still recovered.
        let theta = [0.002, 0.01, 0.03, 0.08, 0.015];
        let obs: Vec<StepObservation> = rich_configs()
            .iter()
            .map(|&(w, n, b)| with_sync(theta, w, n, b))
            .collect();
        let model = ThroughputModel::fit(&obs, &ThroughputPrior::default());
        for (k, (got, want)) in model.coefficients().iter().zip(theta).enumerate() {
            assert!(rel(*got, want) < 1e-6, "θ[{k}] = {got}, want {want}");
        }
    }

    #[test]
    fn sync_time_is_ignored_when_not_usable() {
        let theta = [0.003, 0.01, 0.02, 0.3, 0.005];
        let seen = with_sync(theta, 4, 2, 32.0);
        let prior = ThroughputPrior::default();
        let without = ThroughputModel::fit(
            &[StepObservation {
                sync_time_s: None,
                ..seen
            }],
            &prior,
        );
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.1] {
            let o = StepObservation {
                sync_time_s: Some(bad),
                ..seen
            };
            assert_eq!(o.usable_sync_time_s(), None, "{bad}");
            assert_eq!(ThroughputModel::fit(&[o], &prior), without, "{bad}");
        }
        // One worker moves nothing over the ring: its sync row would be all zeros.
        let alone = StepObservation {
            workers: 1,
            nodes: 1,
            sync_time_s: Some(0.001),
            ..seen
        };
        assert_eq!(alone.usable_sync_time_s(), None);
        assert_eq!(
            ThroughputModel::fit(&[alone], &prior),
            ThroughputModel::fit(
                &[StepObservation {
                    sync_time_s: None,
                    ..alone
                }],
                &prior
            )
        );
        // A sync time above the step time is capped at it.
        let over = StepObservation {
            sync_time_s: Some(10.0 * seen.step_time_s),
            ..seen
        };
        assert_eq!(over.usable_sync_time_s(), Some(seen.step_time_s));
    }

    #[test]
    fn packed_nodes_examples() {
        assert_eq!(packed_nodes(1, 1, 8), 1);
        assert_eq!(packed_nodes(8, 1, 8), 1);
        assert_eq!(packed_nodes(9, 1, 8), 2);
        assert_eq!(packed_nodes(3, 3, 8), 2); // 2 per node
        assert_eq!(packed_nodes(4, 2, 8), 1);
        assert_eq!(packed_nodes(0, 1, 8), 1);
        assert_eq!(packed_nodes(2, 16, 8), 4); // a worker of 2 whole nodes
        assert_eq!(packed_nodes(3, 0, 4), 1);
        assert_eq!(packed_nodes(3, 1, 0), 3);
        assert_eq!(packed_nodes(u32::MAX, 1, 1), u32::MAX);
    }

    fn wild_f64() -> impl Strategy<Value = f64> {
        prop_oneof![
            Just(0.0),
            Just(-0.0),
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(f64::MAX),
            Just(f64::MIN_POSITIVE),
            Just(1e300),
            Just(1e-300),
            -1e3..1e3_f64,
            1e-6..1e6_f64,
            0.01..10.0_f64,
        ]
    }

    fn observation() -> impl Strategy<Value = StepObservation> {
        (0u32..20, 0u32..6, wild_f64(), wild_f64()).prop_map(|(w, n, b, t)| StepObservation {
            workers: w,
            nodes: n,
            local_batch: b,
            step_time_s: t,
            sync_time_s: None,
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        #[test]
        fn predictions_are_always_finite_and_non_negative(
            obs in prop::collection::vec(observation(), 0..12),
            sps in wild_f64(),
            frac in wild_f64(),
            weight in wild_f64(),
            queries in prop::collection::vec((0u32..1000, 0u32..100, wild_f64()), 1..8),
        ) {
            let prior = ThroughputPrior {
                samples_per_s_per_worker: sps,
                intra_sync_fraction: frac,
                inter_sync_fraction: frac,
                per_node_overhead_fraction: frac,
                weight,
            };
            let fitted = ThroughputModel::fit(&obs, &prior);
            let plain = ThroughputModel::prior(&prior, sps);
            for m in [&fitted, &plain] {
                for c in m.coefficients() {
                    prop_assert!(c.is_finite() && c >= 0.0, "θ {:?}", m.coefficients());
                }
                for &(w, n, b) in &queries {
                    let t = m.step_time_s(w, n, b);
                    prop_assert!(t.is_finite() && t > 0.0, "t({w},{n},{b}) = {t}");
                    let s = m.samples_per_s(w, n, b);
                    prop_assert!(s.is_finite() && s >= 0.0, "sps({w},{n},{b}) = {s}");
                    if w == 0 {
                        prop_assert_eq!(s, 0.0);
                    }
                }
            }
            // The usable observations, or 0 when the fit fell back to the plain prior.
            let usable = obs.iter().filter(|o| o.is_usable()).count();
            prop_assert!(fitted.observations() == usable || fitted.observations() == 0);
            // Deterministic.
            prop_assert_eq!(ThroughputModel::fit(&obs, &prior), fitted);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn predictions_with_sync_times_are_always_finite_and_non_negative(
            obs in prop::collection::vec(
                (observation(), prop::option::of(wild_f64())),
                0..12,
            ),
            queries in prop::collection::vec((0u32..1000, 0u32..100, wild_f64()), 1..8),
        ) {
            let obs: Vec<StepObservation> = obs
                .into_iter()
                .map(|(o, sync)| StepObservation { sync_time_s: sync, ..o })
                .collect();
            let fitted = ThroughputModel::fit(&obs, &ThroughputPrior::default());
            for c in fitted.coefficients() {
                prop_assert!(c.is_finite() && c >= 0.0, "θ {:?}", fitted.coefficients());
            }
            for &(w, n, b) in &queries {
                let t = fitted.step_time_s(w, n, b);
                prop_assert!(t.is_finite() && t > 0.0, "t({w},{n},{b}) = {t}");
            }
            prop_assert_eq!(ThroughputModel::fit(&obs, &ThroughputPrior::default()), fitted);
        }
    }

    /// Rows fitted in the Pollux check: 1, 2, 4 and 8 workers on 1 or 2 nodes.
    fn in_fit_set(r: &Row) -> bool {
        matches!(r.0, 1 | 2 | 4 | 8) && r.1 <= 2
    }

    /// A row as an observation without sync time.
    fn row_observation(r: &Row) -> StepObservation {
        StepObservation {
            workers: r.0,
            nodes: r.1,
            local_batch: r.2,
            step_time_s: r.3,
            sync_time_s: None,
        }
    }

    /// Relative step-time errors of a fit on `fit_rows`, evaluated on `eval_rows`.
    fn errors(fit_rows: &[&Row], eval_rows: &[&Row]) -> Vec<f64> {
        let obs: Vec<StepObservation> = fit_rows.iter().map(|r| row_observation(r)).collect();
        let m = ThroughputModel::fit(&obs, &ThroughputPrior::default());
        eval_rows
            .iter()
            .map(|r| rel(m.step_time_s(r.0, r.1, r.2), r.3))
            .collect()
    }

    /// Per app and fixed local batch: median/p90 relative error on the fitted rows
    /// (in-sample) and on every placement at that batch (1–16 workers on 1–4 nodes).
    fn pollux_report(app: &str) -> Vec<(String, (f64, f64, f64, f64))> {
        let rows = pollux_rows(app);
        let mut batches: Vec<f64> = rows.iter().map(|r| r.2).collect();
        batches.sort_by(f64::total_cmp);
        batches.dedup();
        let mut out = Vec::new();
        for &b in &batches {
            let at_b: Vec<&Row> = rows.iter().filter(|r| r.2 == b).collect();
            let fit_rows: Vec<&Row> = at_b.iter().copied().filter(|r| in_fit_set(r)).collect();
            let inside = errors(&fit_rows, &fit_rows);
            let all = errors(&fit_rows, &at_b);
            out.push((
                format!("{b:>6}"),
                (
                    quantile(inside.clone(), 0.5),
                    quantile(inside, 0.9),
                    quantile(all.clone(), 0.5),
                    quantile(all, 0.9),
                ),
            ));
        }
        // All batches at once (θ_c and θ_0 become separable).
        let fit_rows: Vec<&Row> = rows.iter().filter(|r| in_fit_set(r)).collect();
        let all_rows: Vec<&Row> = rows.iter().collect();
        let inside = errors(&fit_rows, &fit_rows);
        let all = errors(&fit_rows, &all_rows);
        out.push((
            "   all".to_string(),
            (
                quantile(inside.clone(), 0.5),
                quantile(inside, 0.9),
                quantile(all.clone(), 0.5),
                quantile(all, 0.9),
            ),
        ));
        out
    }

    #[test]
    fn fits_pollux_cifar10_step_times() {
        let report = pollux_report("cifar10");
        println!("cifar10 batch: fitted-rows median/p90 | all-placements median/p90");
        for (b, (m, p, am, ap)) in &report {
            println!("  {b}: {m:.3} / {p:.3} | {am:.3} / {ap:.3}");
        }
        // Per-GPU batch 129 (closest to the usual 128): fitted on 1, 2, 4, 8 workers on 1-2
        // nodes (placements 1, 2, 4, 11, 13, 22, 44).
        let rows = pollux_rows("cifar10");
        let obs: Vec<StepObservation> = rows
            .iter()
            .filter(|r| r.2 == 129.0 && in_fit_set(r))
            .map(row_observation)
            .collect();
        let m = ThroughputModel::fit(&obs, &ThroughputPrior::default());
        println!(
            "cifar10 @129 θ = {:?}, scaled-Gram eigenvalues {:.3?}",
            m.coefficients(),
            gram_eigenvalues(&obs)
        );
        for o in &obs {
            let t = m.step_time_s(o.workers, o.nodes, o.local_batch);
            println!(
                "  w={} n={} measured {:.4} predicted {t:.4}",
                o.workers, o.nodes, o.step_time_s
            );
        }
        let stats = |key: &str| report.iter().find(|(b, _)| b.trim() == key).unwrap().1;
        let (median, p90, all_median, _) = stats("129");
        // Measured: 0.097 / 0.145 on the fitted rows, 0.201 over every placement at that
        // batch. The misfit is structural: Pollux's measured cross-node sync grows about
        // linearly in the workers (0.133, 0.163-0.190, 0.231 s at 2, 4, 8 workers on 2 nodes),
        // while the brief's ring term 2(w-1)/w saturates.
        assert!(median < 0.12, "median relative error {median}");
        assert!(p90 < 0.18, "p90 relative error {p90}");
        assert!(all_median < 0.25, "all-placements median {all_median}");
        // Every batch at once (θ_c and θ_0 separable); measured 0.095 / 0.220.
        let (median, p90, _, _) = stats("all");
        assert!(median < 0.12, "all-batches median relative error {median}");
        assert!(p90 < 0.26, "all-batches p90 relative error {p90}");
    }

    /// Pollux's measured sync times fed to the fit, per app, every batch: median and p90
    /// relative step-time error over every placement at the batch, fitted (a) on the rows
    /// of [`in_fit_set`] and (b) on the one configuration of 4 workers on 2 nodes, each
    /// without and with the sync times: `[(a) without, (a) with, (b) without, (b) with]`.
    fn pollux_sync_report(app: &str) -> [(f64, f64); 4] {
        let rows = pollux_rows_with_sync(app);
        let mut batches: Vec<f64> = rows.iter().map(|(r, _)| r.2).collect();
        batches.sort_by(f64::total_cmp);
        batches.dedup();
        let observation = |&(r, sync): &(Row, f64), with_sync: bool| StepObservation {
            workers: r.0,
            nodes: r.1,
            local_batch: r.2,
            step_time_s: r.3,
            sync_time_s: with_sync.then_some(sync),
        };
        let mut errors: [Vec<f64>; 4] = Default::default();
        for b in batches {
            let at_b: Vec<&(Row, f64)> = rows.iter().filter(|(r, _)| r.2 == b).collect();
            let fit_rows: Vec<&(Row, f64)> = at_b
                .iter()
                .copied()
                .filter(|(r, _)| in_fit_set(r))
                .collect();
            let one: Vec<&(Row, f64)> = fit_rows
                .iter()
                .copied()
                .filter(|(r, _)| (r.0, r.1) == (4, 2))
                .take(1)
                .collect();
            for (i, (set, with_sync)) in [
                (&fit_rows, false),
                (&fit_rows, true),
                (&one, false),
                (&one, true),
            ]
            .into_iter()
            .enumerate()
            {
                if set.is_empty() {
                    continue;
                }
                let obs: Vec<StepObservation> =
                    set.iter().map(|r| observation(r, with_sync)).collect();
                let m = ThroughputModel::fit(&obs, &ThroughputPrior::default());
                errors[i].extend(
                    at_b.iter()
                        .map(|(r, _)| rel(m.step_time_s(r.0, r.1, r.2), r.3)),
                );
            }
        }
        errors.map(|e| (quantile(e.clone(), 0.5), quantile(e, 0.9)))
    }

    /// The applications of the Pollux traces.
    const POLLUX_APPS: [&str; 6] = [
        "bert",
        "cifar10",
        "deepspeech2",
        "imagenet",
        "ncf",
        "yolov3",
    ];

    #[test]
    fn pollux_sync_times_report() {
        println!(
            "app: all placements median/p90, fitted on 1-8 workers on 1-2 nodes without | with \
             sync; fitted on 4 workers on 2 nodes without | with sync"
        );
        for app in POLLUX_APPS {
            let [a, a_sync, b, b_sync] = pollux_sync_report(app);
            println!(
                "  {app}: {:.3}/{:.3} | {:.3}/{:.3}; {:.3}/{:.3} | {:.3}/{:.3}",
                a.0, a.1, a_sync.0, a_sync.1, b.0, b.1, b_sync.0, b_sync.1
            );
            for (m, p) in [a, a_sync, b, b_sync] {
                assert!(m.is_finite() && p.is_finite());
            }
        }
    }

    #[test]
    fn pollux_report_all_apps() {
        for app in POLLUX_APPS {
            let report = pollux_report(app);
            println!("{app} batch: fitted-rows median/p90 | all-placements median/p90");
            for (b, (m, p, am, ap)) in &report {
                println!("  {b}: {m:.3} / {p:.3} | {am:.3} / {ap:.3}");
                assert!(m.is_finite() && am.is_finite());
            }
        }
    }
}

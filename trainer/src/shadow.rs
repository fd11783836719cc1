//! ShadowSync: background synchronization of the dense parameters (Zheng et al., "ShadowSync:
//! Performing Synchronization in the Background for Highly Scalable Distributed Training",
//! arXiv 2003.03477).
//!
//! # Contract
//!
//! `--shadow ALGORITHM` takes synchronization out of the training loop. Every worker trains
//! its own copy of the model with local SGD steps (with `--hogwild-threads T > 1`, T threads
//! update that copy without locks, Hogwild-style), never waiting for a peer. One background
//! ("shadow") thread per worker keeps synchronizing the copy with the other workers, round
//! after round, as fast as the links allow (`--sync-interval-ms` sets a minimum time between
//! rounds). A round reads a snapshot `s` of the local parameters, computes a target `x*` with
//! the peers, and moves the local copy by `x* - s`, so that the local steps taken while the
//! round was on the wire are kept. The algorithms, as the paper states them:
//!
//! - **S-MA** (`ma`): model averaging. The shadow threads all-reduce their snapshots over a
//!   ring (the ring mode's rendezvous and TCP ring, [`crate::ring`]); `x* = mean(s_i)`.
//! - **S-BMUF** (`bmuf`): blockwise model-update filtering (Chen and Huo, ICASSP 2016) on the
//!   averaged model. With `x_prev` the global model after the previous round,
//!   `Δ = mean(s_i) - x_prev`, `v = η v + ζ Δ`, `x_prev += v`, and `x* = x_prev` (or
//!   `x_prev + η v` with `--block-nesterov`). Block momentum `η` (`--block-momentum`, in
//!   [0, 1), default `min(1 - 1/W, 0.5)`) and block learning rate `ζ` (`--block-lr`, default
//!   `1 - η`: a long-run block gain `ζ / (1 - η)` of 1). fairseq's `bmuf.py` and CNTK's
//!   `BlockMomentumSGD` default to `η = 1 - 1/W` and `ζ = 1`, meant for blocks of many local
//!   steps; with background rounds every few steps that diverged, and `η = 0.75` with gain 1
//!   lagged (docs/communication.md has the figures). Every worker computes the same `x_prev`
//!   and `v` from the bit-identical average.
//! - **S-EASGD** (`easgd`): elastic averaging (Zhang, Choromanska and LeCun, NIPS 2015)
//!   against a central copy held by the parameter-server shards (`CONVERGE_NUM_PS = p >= 1`,
//!   the rank layout of [`crate::ps`]). Each round the worker sends each shard its slice of
//!   `s`; the shard applies `δ = α (s - c); c += δ` at once (asynchronously: it waits for no
//!   other worker) and answers `δ`; the worker applies `x -= δ`. Moving rate `α`
//!   (`--elastic-alpha`, in (0, 1], default `0.9 / W`, TensorFlow's `β/τ/N` with `β = 0.9`
//!   and one round per elastic period). Before the elastic step the center takes `1/W` of the
//!   worker's own progress since its previous round, `c += (s - last) / W`
//!   ([`forwarded_elastic_step`], which says why: the plain step, `--elastic-plain`, runs the
//!   job at `W / (W + 1)` of the synchronous pace).
//!
//! # Progress, data and the end of a job
//!
//! A worker's share of the job is `ceil(remaining samples / W)`; its T threads are the
//! sub-workers `rank * T + t` of `W * T`, and sub-worker `s`'s `k`-th local step trains on the
//! global positions `start + (k W T + s) b .. + b` of the data order. A progress line's `step`
//! counts rank 0's local steps divided by T (so the step time the allocator derives is one
//! local step, synchronization excluded); `samples` is rank 0's own samples plus the other
//! workers' as of the last round plus their estimated samples since (at rank 0's pace);
//! `eval_loss` is the held-out loss of rank 0's model (the final line: the consensus
//! model's, at the exact sample count of the final round). Rank 0 adds `sync_s: 0` (the training loop never waits for
//! a peer), `sync_rounds_per_s` (completed rounds per second since the previous line) and
//! `model_gap` (mean over those rounds of `||s - x*|| / max(||s||, ||x*||)`, the relative
//! distance between the local and the synchronized model; for S-EASGD `x*` is the central
//! copy before the step).
//!
//! The end: a worker that received SIGTERM stops its training threads before its next round.
//! In S-MA and S-BMUF the first round in which every worker's threads had stopped before its
//! snapshot (every share done, or every worker terminated; every rank sees the same sums) is
//! the final one; a round that shows a termination while some worker still trained is
//! followed by one final round for which every worker stops first. In S-EASGD a worker whose
//! share is done or that learns of a termination (its own, or from a shard's answer) stops
//! its threads and sends its halted model in a final round, which the shards answer once
//! every worker has sent its own. Either way the consensus is of the halted models: the
//! average (S-MA), the global model `x_prev` (S-BMUF) or the central copy (S-EASGD, sent to
//! worker 0 only). Rank 0 checkpoints it with its own momentum (thread 0's) and, for S-BMUF,
//! the block velocity `v` (`block_velocity`); the format is the ring's, so a job resumes at
//! any world size in any mode. Rank 0 also checkpoints the last consensus every `--checkpoint-every`
//! seconds (for S-EASGD it asks a shard for its central slice along with the round).
//!
//! # Failures
//!
//! A round only changes the local model after it completed and its result passed the checks
//! (length, sequence, finite values, plausible counts). A sync peer that closes, stalls past
//! the I/O timeout or sends malformed or truncated data is dropped with the reason in the log;
//! the worker keeps training on its local model (`sync_rounds_per_s` falls to 0) and ends as
//! it would alone: rank 0 checkpoints its local model at the end. In S-MA and S-BMUF the ring
//! cannot route around a missing rank, so dropping one peer ends the synchronization of the
//! generation; in S-EASGD a worker drops only the failed shard (its slice stays local) and a
//! shard drops only the failed worker. Checkpoints are written atomically from completed
//! rounds only, so no lost worker can leave a torn or half-averaged checkpoint.

use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde::{Deserialize, Serialize};

use crate::ps::{
    self, Frame, Link, PsConfig, ShardConnection, ShardOutcome, WorkerLink, loss_meta, meta_loss,
    shard_range,
};
use crate::ring::{self, Ring};

/// The ShadowSync algorithms, as named on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ShadowAlgo {
    /// S-MA: model averaging by ring all-reduce.
    Ma,
    /// S-BMUF: block momentum on the averaged model.
    Bmuf,
    /// S-EASGD: elastic averaging against the parameter-server shards' central copy.
    Easgd,
}

impl ShadowAlgo {
    /// The name used in the paper.
    pub fn paper_name(self) -> &'static str {
        match self {
            ShadowAlgo::Ma => "S-MA",
            ShadowAlgo::Bmuf => "S-BMUF",
            ShadowAlgo::Easgd => "S-EASGD",
        }
    }
}

impl std::fmt::Display for ShadowAlgo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.paper_name())
    }
}

/// Checks a block momentum `η`: in [0, 1).
pub fn check_block_momentum(eta: f64) -> Result<()> {
    ensure!(
        eta.is_finite() && (0.0..1.0).contains(&eta),
        "--block-momentum must be in [0, 1), not {eta}: the block velocity would not decay"
    );
    Ok(())
}

/// Checks a moving rate `α`: in (0, 1].
pub fn check_alpha(alpha: f64) -> Result<()> {
    ensure!(
        alpha.is_finite() && alpha > 0.0 && alpha <= 1.0,
        "--elastic-alpha must be in (0, 1], not {alpha}: 0 never synchronizes and above 1 the elastic step overshoots the center"
    );
    Ok(())
}

/// The default block momentum for `workers` workers: `min(1 - 1/W, 0.5)`.
///
/// BMUF's usual `1 - 1/W` (fairseq, CNTK) is meant for blocks of many local steps; with a
/// background round every few local steps its velocity lags the workers by `1/(1 - η)`
/// rounds, and in the measurements of docs/communication.md `η = 0.75` (W = 4) ended 2 to 9 %
/// above the synchronous ring's loss where `η = 0.5` stayed within 1 %.
pub fn default_block_momentum(workers: usize) -> f64 {
    (1.0 - 1.0 / workers.max(1) as f64).min(0.5)
}

/// The default moving rate for `workers` workers: `min(1, 0.9 / W)`.
pub fn default_alpha(workers: usize) -> f64 {
    (0.9 / workers.max(1) as f64).min(1.0)
}

/// A parameter vector that several threads read and update without locks (Hogwild): each
/// value is an `f64` in an `AtomicU64`. Reads and writes of single values are atomic;
/// read-modify-write sequences are not, so concurrent updates of one value may lose one of
/// them, as in Hogwild.
#[derive(Debug)]
pub struct SharedParams {
    values: Vec<AtomicU64>,
}

impl SharedParams {
    /// The vector `x`.
    pub fn new(x: &[f64]) -> SharedParams {
        SharedParams {
            values: x.iter().map(|v| AtomicU64::new(v.to_bits())).collect(),
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether the vector is empty.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Copies the current values into `out`.
    pub fn read_into(&self, out: &mut [f64]) {
        for (o, a) in out.iter_mut().zip(&self.values) {
            *o = f64::from_bits(a.load(Ordering::Relaxed));
        }
    }

    /// A copy of the current values.
    pub fn to_vec(&self) -> Vec<f64> {
        let mut v = vec![0.0; self.len()];
        self.read_into(&mut v);
        v
    }

    /// `x += scale * d`, value by value.
    pub fn add_scaled(&self, d: &[f64], scale: f64) {
        for (a, d) in self.values.iter().zip(d) {
            let x = f64::from_bits(a.load(Ordering::Relaxed));
            a.store((x + scale * d).to_bits(), Ordering::Relaxed);
        }
    }

    /// `x += target - base`, value by value: moves the vector as a round moved `base`.
    pub fn add_difference(&self, target: &[f64], base: &[f64]) {
        for ((a, t), b) in self.values.iter().zip(target).zip(base) {
            let x = f64::from_bits(a.load(Ordering::Relaxed));
            a.store((x + (t - b)).to_bits(), Ordering::Relaxed);
        }
    }
}

/// S-BMUF's state, identical on every worker: the global model after the previous round and
/// the block velocity.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockMomentum {
    /// `x_prev`: the global model.
    pub global: Vec<f64>,
    /// `v`: the block velocity.
    pub velocity: Vec<f64>,
    /// Block momentum `η`.
    pub eta: f64,
    /// Block learning rate `ζ`.
    pub zeta: f64,
    /// Whether workers restart from `x_prev + η v` (Nesterov) rather than `x_prev`.
    pub nesterov: bool,
}

impl BlockMomentum {
    /// One block update from the average of the workers' models; returns the model the
    /// workers continue from.
    pub fn step(&mut self, average: &[f64]) -> Vec<f64> {
        for ((g, v), a) in self.global.iter_mut().zip(&mut self.velocity).zip(average) {
            *v = self.eta * *v + self.zeta * (a - *g);
            *g += *v;
        }
        self.start_point()
    }

    /// The model the workers continue from: `x_prev`, or `x_prev + η v` with Nesterov.
    pub fn start_point(&self) -> Vec<f64> {
        if !self.nesterov {
            return self.global.clone();
        }
        self.global
            .iter()
            .zip(&self.velocity)
            .map(|(g, v)| g + self.eta * v)
            .collect()
    }
}

/// EASGD's elastic step on one slice: `δ = α (x - c); c += δ`; returns `δ` (the worker
/// applies `x -= δ`).
pub fn elastic_step(x: &[f64], center: &mut [f64], alpha: f64) -> Vec<f64> {
    x.iter()
        .zip(center.iter_mut())
        .map(|(x, c)| {
            let d = alpha * (x - *c);
            *c += d;
            d
        })
        .collect()
}

/// S-EASGD's step at a shard for one worker's round, with the center's share of the
/// gradient forwarded: `c += (x - last) / n`, then the elastic step `δ = α (x - c); c += δ`,
/// and `last = x - δ` (the worker's model once it applied `δ`); returns `δ`.
///
/// Why: the elastic step alone moves the worker by `-δ` and the center by `+δ`, so it
/// conserves `Σ x_i + c`. Once the copies are coupled, the W workers' gradient steps are
/// spread over W + 1 copies and the job moves at `W / (W + 1)` of the synchronous pace,
/// whatever `α` and however often the rounds (measured: 1.28 times the ring's samples on
/// optdigits at W = 4 for α from 0.05 to 0.9, and 1.01 with the learning rate scaled by
/// (W + 1) / W; docs/communication.md). `x - last` is exactly the worker's own local
/// steps since its previous round (the elastic pull it applied is taken out), and the center
/// takes `1/n` of it, as the synchronous average of n workers would: the center then keeps
/// the pace of the workers' mean, and the elastic step only pulls the copies together.
/// `n` is the number of workers still served; `forward = false` is the paper's plain step.
pub fn forwarded_elastic_step(
    x: &[f64],
    center: &mut [f64],
    last: &mut [f64],
    alpha: f64,
    n: usize,
    forward: bool,
) -> Vec<f64> {
    if forward {
        let share = 1.0 / n.max(1) as f64;
        for ((c, x), l) in center.iter_mut().zip(x).zip(last.iter()) {
            *c += share * (x - l);
        }
    }
    let delta = elastic_step(x, center, alpha);
    for ((l, x), d) in last.iter_mut().zip(x).zip(&delta) {
        *l = x - d;
    }
    delta
}

/// The relative distance of two models, `||a - b|| / max(||a||, ||b||)`, in [0, 2] (0 when
/// both are 0): bounded even when one of them is still near zero, as a fresh linear model is.
pub fn relative_gap(a: &[f64], b: &[f64]) -> f64 {
    let (mut diff, mut na, mut nb) = (0.0, 0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        diff += (x - y) * (x - y);
        na += x * x;
        nb += y * y;
    }
    if diff == 0.0 {
        0.0
    } else {
        (diff / na.max(nb)).sqrt()
    }
}

// ---------------------------------------------------------------------------------------
// S-MA and S-BMUF: one round over the ring
// ---------------------------------------------------------------------------------------

/// What a worker contributes to a round of S-MA or S-BMUF.
#[derive(Debug, Clone, Copy)]
pub struct RoundIn<'a> {
    /// The snapshot of the local parameters.
    pub params: &'a [f64],
    /// Samples this worker trained on in this generation.
    pub samples: u64,
    /// Whether this worker's training threads had stopped before the snapshot (its share is
    /// done, or it was terminated): the snapshot is its final model.
    pub done: bool,
    /// Whether this worker received a termination signal.
    pub stop: bool,
}

/// The outcome of a round, the same on every worker.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundOut {
    /// The mean of the snapshots.
    pub average: Vec<f64>,
    /// Samples all workers trained on in this generation.
    pub samples: u64,
    /// Workers whose training threads had stopped.
    pub done: usize,
    /// Workers that received a termination signal.
    pub stop: usize,
}

/// Trailer values after the parameters: samples, done, stop.
const TRAILER: usize = 3;

/// One round of S-MA / S-BMUF: all-reduces the snapshots and the counters. Every worker
/// must call it with the same parameter count. Fails, leaving nothing changed, if the ring
/// fails or a peer's contribution is implausible.
pub fn ring_round(ring: &mut Ring, inp: &RoundIn<'_>) -> Result<RoundOut> {
    let p = inp.params.len();
    let w = ring.world_size();
    let mut buf = Vec::with_capacity(p + TRAILER);
    buf.extend_from_slice(inp.params);
    buf.push(inp.samples as f64);
    buf.push(f64::from(u8::from(inp.done)));
    buf.push(f64::from(u8::from(inp.stop)));
    ensure!(
        buf.iter().all(|v| v.is_finite()),
        "the local model is not finite"
    );
    ring.all_reduce_sum(&mut buf)?;
    if let Some(j) = buf.iter().position(|v| !v.is_finite()) {
        bail!("malformed data from a peer: value {j} of the sum is not finite");
    }
    let count = |v: f64, max: f64, what: &str| -> Result<f64> {
        ensure!(
            v >= 0.0 && v <= max && v.fract() == 0.0,
            "malformed data from a peer: {what} sums to {v}, expected a whole number in 0..={max}"
        );
        Ok(v)
    };
    let samples = count(buf[p], 2f64.powi(53), "the sample count")?;
    ensure!(
        samples >= inp.samples as f64,
        "malformed data from a peer: the sample count sums to {samples}, below this worker's own {}",
        inp.samples
    );
    let done = count(buf[p + 1], w as f64, "the finished-worker count")?;
    let stop = count(buf[p + 2], w as f64, "the stop-vote count")?;
    let scale = 1.0 / w as f64;
    Ok(RoundOut {
        average: buf[..p].iter().map(|v| v * scale).collect(),
        samples: samples as u64,
        done: done as usize,
        stop: stop as usize,
    })
}

// ---------------------------------------------------------------------------------------
// S-EASGD: workers and the shards holding the central copy
// ---------------------------------------------------------------------------------------

/// Magic bytes that open a worker's connection to an S-EASGD shard.
const EASGD_MAGIC: &[u8; 4] = b"CVES";

// Frame kinds, worker to shard.
const E_INIT: u8 = 21;
const E_ELASTIC: u8 = 22;
const E_FINISH: u8 = 23;
// Frame kinds, shard to worker.
const E_START: u8 = 31;
const E_DELTA: u8 = 32;
const E_FINAL: u8 = 33;
// Flags, worker to shard (in INIT: the center update).
const F_FORWARD: u64 = 8;
const F_DONE: u64 = 1;
const F_STOP: u64 = 2;
const F_WANT_CENTER: u64 = 4;
// Flags, shard to worker.
const F_STOP_REQUESTED: u64 = 1;
const F_ALL_DONE: u64 = 2;
const F_HAS_CENTER: u64 = 4;

/// Where a worker starts: worker 0's state as the shards relayed it.
#[derive(Debug, Clone, PartialEq)]
pub struct EasgdStart {
    /// Steps completed since the job began.
    pub step: u64,
    /// Samples consumed since the job began.
    pub samples: u64,
    /// Seed of the data order.
    pub seed: u64,
    /// The most recently reported loss.
    pub last_loss: Option<f64>,
    /// The central copy (the parameters every worker starts from).
    pub center: Vec<f64>,
}

/// What worker 0 hands the shards at the start.
#[derive(Debug, Clone, Copy)]
pub struct EasgdInit<'a> {
    /// Steps completed since the job began.
    pub step: u64,
    /// Samples consumed since the job began.
    pub samples: u64,
    /// Seed of the data order.
    pub seed: u64,
    /// The most recently reported loss.
    pub last_loss: Option<f64>,
    /// The parameters: the central copy starts from them.
    pub params: &'a [f64],
    /// The moving rate `α`.
    pub alpha: f64,
    /// Whether the center takes its share of each worker's progress
    /// ([`forwarded_elastic_step`]); `false`: the paper's plain elastic step.
    pub forward: bool,
}

/// The outcome of one elastic round for a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct EasgdRound {
    /// `δ`, full length (zeros in the slices of dropped shards).
    pub delta: Vec<f64>,
    /// The central copy after the step, when asked for and every live shard sent it (the
    /// slices of dropped shards are the snapshot's).
    pub center: Option<Vec<f64>>,
    /// Samples all workers reported to the first live shard.
    pub samples: u64,
    /// A worker or shard received a termination signal.
    pub stop: bool,
    /// Every worker finished its share.
    pub all_done: bool,
}

/// A connection to one shard, and whether the worker still synchronizes with it.
struct ShardConn {
    conn: ShardConnection,
    alive: bool,
}

impl std::ops::Deref for ShardConn {
    type Target = ShardConnection;

    fn deref(&self) -> &ShardConnection {
        &self.conn
    }
}

/// A worker's connections to the S-EASGD shards.
pub struct EasgdClient {
    shards: Vec<ShardConn>,
    num_params: usize,
    io_timeout: Duration,
    cancel: Arc<AtomicBool>,
    seq: u64,
    /// This worker's rank (worker 0 alone receives the central copy in the final round).
    rank: usize,
    who: String,
}

impl std::fmt::Debug for EasgdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EasgdClient")
            .field("shards", &self.shards.len())
            .field("live", &self.live_shards())
            .finish()
    }
}

impl EasgdClient {
    /// Rendezvous (rank 0 serves it, on `master` if given), connects to every shard and
    /// receives the start: worker 0 passes `init`, the others `None`.
    pub fn connect(
        cfg: &PsConfig,
        master: Option<TcpListener>,
        num_params: usize,
        init: Option<EasgdInit<'_>>,
        cancel: Arc<AtomicBool>,
    ) -> Result<(EasgdClient, EasgdStart)> {
        let who = ps::worker_name(cfg, init.is_some())?;
        let shards =
            ps::connect_to_shards(cfg, master, num_params, EASGD_MAGIC, "S-EASGD", &cancel)?
                .into_iter()
                .map(|conn| ShardConn { conn, alive: true })
                .collect();
        let me = EasgdClient {
            shards,
            num_params,
            io_timeout: cfg.io_timeout,
            cancel,
            seq: 0,
            rank: cfg.rank,
            who,
        };
        let failed = AtomicU8::new(0);
        if let Some(init) = &init {
            ensure!(
                init.params.len() == num_params,
                "the initial state has the wrong length"
            );
            check_alpha(init.alpha)?;
            ps::on_each(me.shards.len(), &failed, |k| {
                let sh = &me.shards[k];
                let mut f = Frame::new(E_INIT, 0);
                f.flags = if init.forward { F_FORWARD } else { 0 };
                let [has_loss, loss] = loss_meta(init.last_loss);
                f.meta = vec![
                    init.step,
                    init.samples,
                    init.seed,
                    has_loss,
                    loss,
                    init.alpha.to_bits(),
                ];
                f.values = init.params[sh.range.clone()].to_vec();
                me.link(sh, &failed)
                    .write(&f)
                    .with_context(|| me.peer(sh, "sending the initial state to"))
            })?;
        }
        let starts = ps::on_each(me.shards.len(), &failed, |k| {
            let sh = &me.shards[k];
            let f = me
                .link(sh, &failed)
                .read(sh.range.len())
                .with_context(|| me.peer(sh, "waiting for the start from"))?;
            ensure!(
                f.kind == E_START
                    && f.meta.len() == 5
                    && f.values.len() == sh.range.len()
                    && f.values.iter().all(|v| v.is_finite()),
                "{}: expected a START with {} finite values",
                me.peer(sh, "bad answer from"),
                sh.range.len()
            );
            Ok(f)
        })?;
        let m0 = &starts[0].meta;
        ensure!(
            starts.iter().all(|f| f.meta == *m0),
            "the S-EASGD shards start from different states"
        );
        let mut center = vec![0.0; num_params];
        for (sh, f) in me.shards.iter().zip(&starts) {
            center[sh.range.clone()].copy_from_slice(&f.values);
        }
        eprintln!(
            "{}: connected to {} S-EASGD shard(s): {}",
            me.who,
            me.shards.len(),
            ps::describe_shards(me.shards.iter().map(|s| (s.shard, s.addr, s.range.len())))
        );
        let start = EasgdStart {
            step: m0[0],
            samples: m0[1],
            seed: m0[2],
            last_loss: meta_loss(m0[3], m0[4]),
            center,
        };
        Ok((me, start))
    }

    fn link<'a>(&'a self, sh: &'a ShardConn, failed: &'a AtomicU8) -> Link<'a> {
        sh.link(self.io_timeout, &self.cancel, failed)
    }

    fn peer(&self, sh: &ShardConn, what: &str) -> String {
        sh.peer(what, "S-EASGD")
    }

    /// Shards still synchronized with.
    pub fn live_shards(&self) -> usize {
        self.shards.iter().filter(|s| s.alive).count()
    }

    /// Exchanges one frame with every live shard: sends `kind` with this worker's slice of
    /// `x`, reads the answer and checks it: kind `answer`, with the slice (`sliced`; twice
    /// with the center) or no values. A shard whose exchange fails is dropped (logged); its
    /// answer is `None`.
    fn exchange(
        &mut self,
        kind: u8,
        x: &[f64],
        samples: u64,
        flags: u64,
        answer: u8,
        sliced: bool,
    ) -> Vec<Option<Frame>> {
        self.seq += 1;
        let seq = self.seq;
        let failed = AtomicU8::new(0);
        let me = &*self;
        let results: Vec<Result<Frame>> = thread::scope(|s| {
            let hs: Vec<_> = me
                .shards
                .iter()
                .map(|sh| {
                    let failed = &failed;
                    s.spawn(move || -> Result<Frame> {
                        if !sh.alive {
                            bail!("dropped before");
                        }
                        let mut f = Frame::new(kind, seq);
                        f.flags = flags;
                        f.meta = vec![samples, 0];
                        f.values = x[sh.range.clone()].to_vec();
                        // Each shard link fails on its own: `failed` is never raised.
                        let link = me.link(sh, failed);
                        link.write(&f).context("sending failed")?;
                        let len = sh.range.len();
                        let r = link.read(2 * len).context("receiving failed")?;
                        ensure!(
                            r.seq == seq,
                            "out of step: answered round {} to round {seq}",
                            r.seq
                        );
                        let with_center = r.flags & F_HAS_CENTER != 0;
                        let want = match (sliced, with_center) {
                            (false, _) => 0,
                            (true, false) => len,
                            (true, true) => 2 * len,
                        };
                        ensure!(
                            r.kind == answer && r.meta.len() == 2 && r.values.len() == want,
                            "malformed answer: kind {} with {} metadata words and {} values, expected kind {answer} with 2 and {want}",
                            r.kind,
                            r.meta.len(),
                            r.values.len()
                        );
                        ensure!(
                            r.values.iter().all(|v| v.is_finite()),
                            "malformed answer: non-finite values"
                        );
                        Ok(r)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("thread panicked")))
                })
                .collect()
        });
        let mut out = Vec::with_capacity(results.len());
        for (sh, r) in self.shards.iter_mut().zip(results) {
            match r {
                Ok(f) => out.push(Some(f)),
                Err(e) => {
                    if sh.alive {
                        eprintln!(
                            "{}: dropping S-EASGD shard {} (rank {}, {}): {e:#}; its slice {}..{} now trains locally only",
                            self.who, sh.shard, sh.rank, sh.addr, sh.range.start, sh.range.end
                        );
                        let _ = sh.stream.shutdown(std::net::Shutdown::Both);
                        sh.alive = false;
                    }
                    out.push(None);
                }
            }
        }
        out
    }

    /// One elastic round with the snapshot `x`. Fails only when no shard is left.
    pub fn round(
        &mut self,
        x: &[f64],
        samples: u64,
        done: bool,
        stop: bool,
        want_center: bool,
    ) -> Result<EasgdRound> {
        ensure!(x.len() == self.num_params, "parameter vector length");
        ensure!(self.live_shards() > 0, "every S-EASGD shard was dropped");
        let flags = if done { F_DONE } else { 0 }
            | if stop { F_STOP } else { 0 }
            | if want_center { F_WANT_CENTER } else { 0 };
        let answers = self.exchange(E_ELASTIC, x, samples, flags, E_DELTA, true);
        let mut r = EasgdRound {
            delta: vec![0.0; self.num_params],
            center: want_center.then(|| x.to_vec()),
            samples: 0,
            stop: false,
            all_done: true,
        };
        let mut first = true;
        let mut any = false;
        for (sh, a) in self.shards.iter().zip(&answers) {
            let Some(f) = a else { continue };
            any = true;
            let len = sh.range.len();
            r.delta[sh.range.clone()].copy_from_slice(&f.values[..len]);
            match (&mut r.center, f.flags & F_HAS_CENTER != 0) {
                (Some(c), true) => c[sh.range.clone()].copy_from_slice(&f.values[len..]),
                (Some(_), false) => r.center = None,
                _ => {}
            }
            if first {
                r.samples = f.meta[0];
                first = false;
            }
            r.stop |= f.meta[1] & F_STOP_REQUESTED != 0;
            r.all_done &= f.meta[1] & F_ALL_DONE != 0;
        }
        ensure!(any, "every S-EASGD shard was dropped");
        Ok(r)
    }

    /// The final round: sends the halted model `x` and, once every worker has finished,
    /// receives the samples of all workers and, on worker 0 (the one that checkpoints and
    /// reports it), the central copy (the slices of dropped shards are `x`'s). The other
    /// workers get `x` back: the shards do not send them the model, which halves the final
    /// round's traffic on the shards' links.
    pub fn finish(&mut self, x: &[f64], samples: u64, stop: bool) -> (Vec<f64>, Option<u64>) {
        let flags = F_DONE | if stop { F_STOP } else { 0 };
        let sliced = self.rank == 0;
        let answers = self.exchange(E_FINISH, x, samples, flags, E_FINAL, sliced);
        let mut center = x.to_vec();
        let mut total = None;
        for (sh, a) in self.shards.iter().zip(&answers) {
            if let Some(f) = a {
                if sliced {
                    center[sh.range.clone()].copy_from_slice(&f.values[..sh.range.len()]);
                }
                total.get_or_insert(f.meta[0]);
            }
        }
        (center, total)
    }
}

/// What a shard knows about the workers, under one lock.
struct Hub {
    center: Vec<f64>,
    /// Each worker's model (this slice) as it was once it applied its previous round's `δ`.
    last: Vec<Vec<f64>>,
    samples: Vec<u64>,
    done: Vec<bool>,
    /// Finished (sent FINISH) or dropped: no longer waited for.
    gone: Vec<bool>,
    dropped: Vec<bool>,
    stop: bool,
}

impl Hub {
    fn all_done(&self) -> bool {
        self.done
            .iter()
            .zip(&self.dropped)
            .all(|(done, dropped)| *done || *dropped)
    }
}

/// Runs S-EASGD shard `cfg.rank - workers`: holds the central copy of its slice and serves
/// every worker's elastic rounds as they come, until every worker finished (`Completed`) or
/// a termination (`Terminated`). A worker that sends a malformed or truncated frame, or
/// whose connection fails, is dropped with the reason in the log; the others are served on.
pub fn run_easgd_shard(cfg: &PsConfig, cancel: &Arc<AtomicBool>) -> Result<ShardOutcome> {
    cfg.check()?;
    let workers = cfg.workers();
    ensure!(cfg.rank >= workers, "rank {} is not a shard", cfg.rank);
    let shard = cfg.rank - workers;
    let who = format!("S-EASGD shard {shard}/{} (rank {})", cfg.num_ps, cfg.rank);
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let listener =
        TcpListener::bind(("0.0.0.0", 0)).context("cannot bind the S-EASGD shard listener")?;
    let port = listener.local_addr()?.port();
    eprintln!("{who}: listening on port {port}");
    ring::rendezvous(&cfg.ring_config(), cfg.num_ps, None, port, cancel)?;
    let (links, num_params) =
        ps::accept_workers(&listener, cfg, EASGD_MAGIC, &who, deadline, cancel)?;
    let range = shard_range(num_params, shard, cfg.num_ps);
    let len = range.len();
    let failed = AtomicU8::new(0);
    fn link<'a>(
        w: &'a WorkerLink,
        cfg: &PsConfig,
        cancel: &'a AtomicBool,
        failed: &'a AtomicU8,
    ) -> Link<'a> {
        Link {
            stream: &w.stream,
            timeout: cfg.io_timeout,
            cancel,
            failed,
        }
    }
    let init = link(&links[0], cfg, cancel, &failed)
        .read(len)
        .with_context(|| {
            format!(
                "waiting for the initial state from worker 0 ({})",
                links[0].peer
            )
        })?;
    ensure!(
        init.kind == E_INIT
            && init.flags & !F_FORWARD == 0
            && init.meta.len() == 6
            && init.values.len() == len
            && init.values.iter().all(|v| v.is_finite()),
        "expected an INIT with {len} finite values from worker 0"
    );
    let m = &init.meta;
    let alpha = f64::from_bits(m[5]);
    check_alpha(alpha).context("worker 0 sent a bad moving rate")?;
    let forward = init.flags & F_FORWARD != 0;
    let [has_loss, loss_bits] = loss_meta(meta_loss(m[3], m[4]));
    eprintln!(
        "{who}: {workers} worker(s) connected; central copy of parameters {}..{} of {num_params} from step {} (samples {}), moving rate {alpha}, {}",
        range.start,
        range.end,
        m[0],
        m[1],
        if forward {
            "the center takes 1/n of each worker's progress"
        } else {
            "plain elastic step"
        }
    );
    for w in &links {
        let mut f = Frame::new(E_START, 0);
        f.meta = vec![m[0], m[1], m[2], has_loss, loss_bits];
        f.values = init.values.clone();
        link(w, cfg, cancel, &failed)
            .write(&f)
            .with_context(|| format!("sending the start to worker {} ({})", w.index, w.peer))?;
    }
    let hub = Mutex::new(Hub {
        last: vec![init.values.clone(); workers],
        center: init.values,
        samples: vec![0; workers],
        done: vec![false; workers],
        gone: vec![false; workers],
        dropped: vec![false; workers],
        stop: false,
    });
    let changed = Condvar::new();
    let serve = |w: &WorkerLink| -> Result<()> {
        let k = w.index;
        let link = Link {
            stream: &w.stream,
            timeout: cfg.io_timeout,
            cancel,
            failed: &AtomicU8::new(0),
        };
        let mut seq = 0u64;
        loop {
            seq += 1;
            let f = link.read(len).context("receiving failed")?;
            ensure!(
                f.seq == seq,
                "out of step: sent round {} while round {seq} was due",
                f.seq
            );
            ensure!(
                matches!(f.kind, E_ELASTIC | E_FINISH)
                    && f.meta.len() == 2
                    && f.values.len() == len,
                "malformed frame: kind {} with {} metadata words and {} values, expected an elastic round with 2 and {len}",
                f.kind,
                f.meta.len(),
                f.values.len()
            );
            if let Some(j) = f.values.iter().position(|v| !v.is_finite()) {
                bail!("malformed frame: value {j} is not finite");
            }
            let mut h = hub.lock().expect("not poisoned");
            let served = h.dropped.iter().filter(|d| !**d).count();
            let Hub { center, last, .. } = &mut *h;
            let delta =
                forwarded_elastic_step(&f.values, center, &mut last[k], alpha, served, forward);
            h.samples[k] = h.samples[k].max(f.meta[0]);
            h.done[k] |= f.flags & F_DONE != 0;
            if f.flags & F_STOP != 0 || cancel.load(Ordering::SeqCst) {
                if !h.stop {
                    eprintln!(
                        "{who}: termination requested (by {}); the workers stop at their next round",
                        if f.flags & F_STOP != 0 {
                            format!("worker {k}")
                        } else {
                            "a signal to this shard".to_string()
                        }
                    );
                }
                h.stop = true;
            }
            let mut out;
            if f.kind == E_FINISH {
                h.gone[k] = true;
                changed.notify_all();
                while !h.gone.iter().all(|g| *g) {
                    h = changed
                        .wait_timeout(h, Duration::from_millis(200))
                        .expect("not poisoned")
                        .0;
                }
                out = Frame::new(E_FINAL, seq);
                // Worker 0 checkpoints and reports the consensus; the others only end.
                if k == 0 {
                    out.values = h.center.clone();
                }
            } else {
                out = Frame::new(E_DELTA, seq);
                out.values = delta;
                if f.flags & F_WANT_CENTER != 0 {
                    out.flags = F_HAS_CENTER;
                    out.values.extend_from_slice(&h.center);
                }
            }
            let flags = if h.stop { F_STOP_REQUESTED } else { 0 }
                | if h.all_done() { F_ALL_DONE } else { 0 };
            out.meta = vec![h.samples.iter().sum(), flags];
            drop(h);
            link.write(&out).context("sending failed")?;
            if out.kind == E_FINAL {
                return Ok(());
            }
        }
    };
    thread::scope(|s| {
        for w in &links {
            let (serve, hub, changed, who) = (&serve, &hub, &changed, &who);
            s.spawn(move || {
                if let Err(e) = serve(w) {
                    let mut h = hub.lock().expect("not poisoned");
                    if !h.gone[w.index] {
                        eprintln!(
                            "{who}: dropping worker {} ({}): {e:#}; serving the others",
                            w.index, w.peer
                        );
                        h.gone[w.index] = true;
                        h.dropped[w.index] = true;
                        changed.notify_all();
                    }
                    let _ = w.stream.shutdown(std::net::Shutdown::Both);
                }
            });
        }
    });
    let h = hub.into_inner().expect("not poisoned");
    let dropped = h.dropped.iter().filter(|d| **d).count();
    ensure!(
        dropped < workers,
        "every worker was dropped; the central copy is not checkpointed by anyone"
    );
    eprintln!(
        "{who}: {} at {} samples ({dropped} worker(s) dropped)",
        if h.stop {
            "stopped"
        } else {
            "training complete"
        },
        h.samples.iter().sum::<u64>()
    );
    Ok(if h.stop {
        ShardOutcome::Terminated
    } else {
        ShardOutcome::Completed
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::{HANDSHAKE_LEN, configure};
    use crate::ring::RingConfig;
    use std::io::Write;

    #[test]
    fn parameters_are_range_checked() {
        assert!(check_alpha(0.5).is_ok() && check_alpha(1.0).is_ok());
        for bad in [0.0, -0.1, 1.01, f64::NAN, f64::INFINITY] {
            let e = check_alpha(bad).unwrap_err().to_string();
            assert!(e.contains("(0, 1]"), "{e}");
        }
        assert!(check_block_momentum(0.0).is_ok() && check_block_momentum(0.999).is_ok());
        for bad in [1.0, -0.01, f64::NAN] {
            let e = check_block_momentum(bad).unwrap_err().to_string();
            assert!(e.contains("[0, 1)"), "{e}");
        }
        assert_eq!(default_block_momentum(4), 0.5);
        assert_eq!(default_block_momentum(1), 0.0);
        assert_eq!(default_alpha(1), 0.9);
        assert_eq!(default_alpha(3), 0.3);
    }

    #[test]
    fn block_momentum_follows_the_formulas_and_reduces_to_averaging() {
        let mut bm = BlockMomentum {
            global: vec![1.0, 2.0],
            velocity: vec![0.5, 0.0],
            eta: 0.5,
            zeta: 2.0,
            nesterov: false,
        };
        // Δ = (2, 1); v = 0.5 v + 2 Δ = (4.25, 2); x = (5.25, 4).
        let x = bm.step(&[3.0, 3.0]);
        assert_eq!(x, vec![5.25, 4.0]);
        assert_eq!(bm.velocity, vec![4.25, 2.0]);
        bm.nesterov = true;
        assert_eq!(bm.start_point(), vec![5.25 + 0.5 * 4.25, 5.0]);
        // η = 0 and ζ = 1 is plain model averaging.
        let mut ma = BlockMomentum {
            global: vec![0.0; 3],
            velocity: vec![0.0; 3],
            eta: 0.0,
            zeta: 1.0,
            nesterov: false,
        };
        assert_eq!(ma.step(&[1.0, -2.0, 0.5]), vec![1.0, -2.0, 0.5]);
        assert_eq!(ma.step(&[3.0, 3.0, 3.0]), vec![3.0, 3.0, 3.0]);
    }

    #[test]
    fn the_elastic_step_moves_both_copies_toward_each_other() {
        let mut c = vec![0.0, 10.0];
        let d = elastic_step(&[4.0, 2.0], &mut c, 0.25);
        assert_eq!(d, vec![1.0, -2.0]);
        assert_eq!(c, vec![1.0, 8.0]);
        assert_eq!(relative_gap(&[3.0, 4.0], &[3.0, 4.0]), 0.0);
        assert!((relative_gap(&[3.0, 4.0], &[0.0, 5.0]) - (10f64).sqrt() / 5.0).abs() < 1e-12);
        assert_eq!(relative_gap(&[3.0, 4.0], &[0.0, 0.0]), 1.0);
    }

    #[test]
    fn the_center_takes_its_share_of_the_progress_before_the_elastic_step() {
        // The worker was at 2 after its previous round and has stepped to 6; two workers.
        let (mut c, mut last) = (vec![0.0], vec![2.0]);
        let d = forwarded_elastic_step(&[6.0], &mut c, &mut last, 0.5, 2, true);
        // c = 0 + (6 - 2) / 2 = 2; δ = 0.5 (6 - 2) = 2; c = 4; last = 6 - 2 = 4.
        assert_eq!((d, c, last), (vec![2.0], vec![4.0], vec![4.0]));
        // Plain: the elastic step alone, `last` still follows the worker.
        let (mut c, mut last) = (vec![0.0], vec![2.0]);
        let d = forwarded_elastic_step(&[6.0], &mut c, &mut last, 0.5, 2, false);
        assert_eq!((d, c, last), (vec![3.0], vec![3.0], vec![3.0]));
    }

    /// W workers step by the same gradient in turn, a round each after every local step (the
    /// synchronous ring would move its model by `g` per step): with the progress forwarded
    /// the center and the workers keep that pace; with the plain elastic step they settle at
    /// `W / (W + 1)` of it, for any moving rate.
    #[test]
    fn with_forwarding_the_center_keeps_the_synchronous_pace() {
        let g = 1.0;
        for workers in [1, 4, 8] {
            for alpha in [0.05, 0.9 / workers as f64, 1.0] {
                for forward in [true, false] {
                    let mut x = vec![vec![0.0]; workers];
                    let mut last = x.clone();
                    let mut c = vec![0.0];
                    let mut at = Vec::new();
                    for step in 0..4000 {
                        for (xi, li) in x.iter_mut().zip(&mut last) {
                            xi[0] += g;
                            let d = forwarded_elastic_step(xi, &mut c, li, alpha, workers, forward);
                            xi[0] -= d[0];
                        }
                        if step == 2000 || step == 3999 {
                            at.push(c[0]);
                        }
                    }
                    let pace = (at[1] - at[0]) / 1999.0 / g;
                    let want = if forward {
                        1.0
                    } else {
                        workers as f64 / (workers + 1) as f64
                    };
                    assert!(
                        (pace - want).abs() < 1e-3,
                        "W = {workers}, α = {alpha}, forward {forward}: pace {pace}, expected {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn shared_params_apply_a_round_on_top_of_local_steps() {
        let x = SharedParams::new(&[1.0, 2.0, 3.0]);
        let snapshot = x.to_vec();
        // A local step lands while the round is on the wire.
        x.add_scaled(&[1.0, 0.0, -1.0], -0.5);
        x.add_difference(&[0.0, 0.0, 0.0], &snapshot);
        assert_eq!(x.to_vec(), vec![-0.5, 0.0, 0.5]);
    }

    fn ring_config(rank: usize, world: usize, port: u16) -> RingConfig {
        RingConfig {
            rank,
            world_size: world,
            generation: 3,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            rendezvous_timeout: Duration::from_secs(20),
            io_timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn three_workers_average_and_count() {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let mut master = Some(master);
        let outs: Vec<RoundOut> = thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let l = if r == 0 { master.take() } else { None };
                    s.spawn(move || {
                        let mut ring = Ring::connect_with_listener(
                            &ring_config(r, 3, port),
                            l,
                            Arc::new(AtomicBool::new(false)),
                        )
                        .unwrap();
                        let params = vec![r as f64; 4];
                        let inp = RoundIn {
                            params: &params,
                            samples: 10 * (r as u64 + 1),
                            done: r == 1,
                            stop: false,
                        };
                        ring_round(&mut ring, &inp).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for o in outs {
            assert_eq!(o.average, vec![1.0; 4]);
            assert_eq!((o.samples, o.done, o.stop), (60, 1, 0));
        }
    }

    /// A peer whose contribution is not finite, or whose counters are impossible, fails the
    /// round on the honest worker with a reason, and nothing is returned to apply.
    #[test]
    fn malformed_contributions_are_refused() {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let bad_peer = thread::spawn(move || {
            let mut ring =
                Ring::connect(&ring_config(1, 2, port), Arc::new(AtomicBool::new(false))).unwrap();
            // NaN parameters; then a done count of 7 (above the world size).
            let mut a = vec![f64::NAN, 0.0, 0.0, 0.0, 0.0];
            let _ = ring.all_reduce_sum(&mut a);
            let mut b = vec![0.0, 0.0, 0.0, 7.0, 0.0];
            let _ = ring.all_reduce_sum(&mut b);
        });
        let mut ring = Ring::connect_with_listener(
            &ring_config(0, 2, port),
            Some(master),
            Arc::new(AtomicBool::new(false)),
        )
        .unwrap();
        let params = vec![1.0, 2.0];
        let inp = RoundIn {
            params: &params,
            samples: 0,
            done: false,
            stop: false,
        };
        let e = format!("{:#}", ring_round(&mut ring, &inp).unwrap_err());
        assert!(e.contains("not finite"), "{e}");
        let e = format!("{:#}", ring_round(&mut ring, &inp).unwrap_err());
        assert!(e.contains("finished-worker count"), "{e}");
        bad_peer.join().unwrap();
    }

    fn ps_config(rank: usize, world: usize, num_ps: usize, port: u16) -> PsConfig {
        PsConfig {
            rank,
            world_size: world,
            num_ps,
            generation: 2,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            rendezvous_timeout: Duration::from_secs(20),
            io_timeout: Duration::from_secs(5),
        }
    }

    /// One worker, a real shard and a shard that answers an elastic round with a malformed
    /// frame: the worker drops that shard (its slice stays local), keeps synchronizing the
    /// other slice, and ends with the real shard's central slice and its own for the other.
    #[test]
    fn a_shard_answering_garbage_is_dropped_and_the_other_shard_serves_on() {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let n = 4;
        let real = thread::spawn(move || {
            run_easgd_shard(&ps_config(1, 3, 2, port), &Arc::new(AtomicBool::new(false)))
        });
        let fake = thread::spawn(move || {
            let cancel = AtomicBool::new(false);
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let own = listener.local_addr().unwrap().port();
            ring::rendezvous(
                &ps_config(2, 3, 2, port).ring_config(),
                2,
                None,
                own,
                &cancel,
            )
            .unwrap();
            let (mut s, _) = listener.accept().unwrap();
            let mut hs = [0u8; HANDSHAKE_LEN];
            std::io::Read::read_exact(&mut s, &mut hs).unwrap();
            configure(&s).unwrap();
            let failed = AtomicU8::new(0);
            let link = Link {
                stream: &s,
                timeout: Duration::from_secs(5),
                cancel: &cancel,
                failed: &failed,
            };
            let len = shard_range(n, 1, 2).len();
            let init = link.read(len).unwrap();
            let mut start = Frame::new(E_START, 0);
            start.meta = init.meta[..5].to_vec();
            start.values = init.values.clone();
            link.write(&start).unwrap();
            let round = link.read(len).unwrap();
            // An answer one value short, with a NaN.
            let mut bad = Frame::new(E_DELTA, round.seq);
            bad.meta = vec![0, 0];
            bad.values = vec![f64::NAN; len - 1];
            link.write(&bad).unwrap();
            // Wait for the worker to hang up.
            let _ = link.read(len);
        });
        let start = vec![0.0; n];
        let (mut c, _) = EasgdClient::connect(
            &ps_config(0, 3, 2, port),
            Some(master),
            n,
            Some(EasgdInit {
                step: 0,
                samples: 0,
                seed: 1,
                last_loss: None,
                params: &start,
                alpha: 0.5,
                forward: false,
            }),
            Arc::new(AtomicBool::new(false)),
        )
        .unwrap();
        let r = c.round(&[2.0; 4], 8, false, false, false).unwrap();
        assert_eq!(c.live_shards(), 1);
        // Shard 0 (values 0..2) answered δ = 0.5 (2 - 0); the dropped slice moves nothing.
        assert_eq!(r.delta, vec![1.0, 1.0, 0.0, 0.0]);
        let r = c.round(&[1.0; 4], 16, true, false, false).unwrap();
        assert_eq!(r.delta, vec![0.0; 4]);
        assert!(r.all_done);
        let (center, total) = c.finish(&[3.0; 4], 16, false);
        // Shard 0's center: 1 + 0.5 (3 - 1) = 2; the dropped slice is the worker's own.
        assert_eq!(center, vec![2.0, 2.0, 3.0, 3.0]);
        assert_eq!(total, Some(16));
        drop(c);
        assert_eq!(real.join().unwrap().unwrap(), ShardOutcome::Completed);
        fake.join().unwrap();
    }

    /// Two workers and two shards: the elastic rounds follow the formula against the central
    /// copy, the final round returns it, and a worker that then sends garbage to a shard is
    /// dropped by it while the other worker is served to the end.
    #[test]
    fn easgd_rounds_follow_the_formula_and_a_garbage_worker_is_dropped() {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let alpha = 0.5;
        let shards: Vec<_> = (2..4)
            .map(|rank| {
                thread::spawn(move || {
                    run_easgd_shard(
                        &ps_config(rank, 4, 2, port),
                        &Arc::new(AtomicBool::new(false)),
                    )
                })
            })
            .collect();
        let start = vec![0.0, 0.0, 0.0];
        // Worker 1 connects, does one round, then sends a truncated frame and closes.
        let w1 = thread::spawn(move || {
            let (mut c, s) = EasgdClient::connect(
                &ps_config(1, 4, 2, port),
                None,
                3,
                None,
                Arc::new(AtomicBool::new(false)),
            )
            .unwrap();
            assert_eq!(s.center, vec![0.0; 3]);
            let r = c.round(&[4.0, 4.0, 4.0], 8, false, false, false).unwrap();
            for sh in &c.shards {
                let mut st = &sh.stream;
                st.write_all(&[1, 2, 3]).unwrap();
                let _ = sh.stream.shutdown(std::net::Shutdown::Both);
            }
            r
        });
        let (mut c0, s0) = EasgdClient::connect(
            &ps_config(0, 4, 2, port),
            Some(master),
            3,
            Some(EasgdInit {
                step: 5,
                samples: 100,
                seed: 9,
                last_loss: Some(0.25),
                params: &start,
                alpha,
                forward: false,
            }),
            Arc::new(AtomicBool::new(false)),
        )
        .unwrap();
        assert_eq!((s0.step, s0.samples, s0.seed), (5, 100, 9));
        let r1 = w1.join().unwrap();
        // Worker 1 went first: δ = 0.5 (4 - 0) = 2; the center is 2.
        assert_eq!(r1.delta, vec![2.0; 3]);
        let r0 = c0
            .round(&[-2.0, -2.0, -2.0], 16, true, false, true)
            .unwrap();
        // δ = 0.5 (-2 - 2) = -2; the center is 0.
        assert_eq!(r0.delta, vec![-2.0; 3]);
        assert_eq!(r0.center, Some(vec![0.0; 3]));
        assert_eq!(r0.samples, 24);
        // Worker 1 is dropped (truncated frame), so worker 0 alone makes everybody done.
        let mut all_done = r0.all_done;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !all_done && Instant::now() < deadline {
            all_done = c0
                .round(&[0.0; 3], 16, true, false, false)
                .unwrap()
                .all_done;
        }
        assert!(all_done);
        let (center, total) = c0.finish(&[2.0, 2.0, 2.0], 16, false);
        assert_eq!(center, vec![1.0; 3]);
        assert_eq!(total, Some(24));
        for h in shards {
            assert_eq!(h.join().unwrap().unwrap(), ShardOutcome::Completed);
        }
    }
}

//! Parameter-server mode: synchronous SGD with the parameters sharded over server ranks.
//!
//! # Contract
//!
//! `CONVERGE_NUM_PS=p` (p ≥ 1; unset, empty or 0 means ring mode) splits the job's
//! `WORLD_SIZE` processes into roles:
//!
//! - ranks `0..WORLD_SIZE-p` are **workers**; worker `i` is rank `i`, and the data-parallel
//!   world is `WORLD_SIZE-p` (the global batch is `(WORLD_SIZE-p) * --batch-size`, and
//!   worker `i` trains on slice `i` of it, exactly as rank `i` does in ring mode);
//! - ranks `WORLD_SIZE-p..WORLD_SIZE` are **parameter-server shards**; shard `s` is rank
//!   `WORLD_SIZE-p+s` and owns the slice `[s*n/p, (s+1)*n/p)` of the flat parameter vector
//!   of `n` values (and of the momentum buffer).
//!
//! Rank 0 is always worker 0: it serves the rendezvous on `MASTER_ADDR:MASTER_PORT`, prints
//! the `CONVERGE_PROGRESS` lines and writes the checkpoint, as in ring mode. The lines'
//! `sync_s` is the time worker 0 spends in [`PsWorker::step`] (push, the shards' update,
//! pull), per step.
//!
//! # Connections
//!
//! Every shard binds a listener on `0.0.0.0` and an ephemeral port and joins the rendezvous
//! with that port (workers send port 0). The master records the address it observes for
//! each rank, as for ring addresses (so there is no address override), checks that every
//! rank has the same `WORLD_SIZE`, generation and `CONVERGE_NUM_PS`, and sends everybody the
//! list. Every worker then connects to every shard and opens the connection with a
//! handshake: the magic `CVPS`, its worker index (u32), the generation (u64), the number of
//! workers (u32) and its model size (u64), little-endian. A shard drops connections of
//! another generation and fails if the workers disagree on the model size.
//!
//! # Messages
//!
//! After the handshake, both directions carry frames: a header of four little-endian u64
//! (`kind | flags << 8`, sequence number, number of u64 metadata words, number of f64
//! values), the metadata words, then the values.
//!
//! 1. Worker 0 sends each shard an `INIT` frame with the state it starts from (its
//!    checkpoint if `CONVERGE_CHECKPOINT_DIR` holds one, else a fresh initialization): step,
//!    samples, seed, last loss, learning rate, momentum coefficient, and the shard's slices
//!    of the parameters and momentum. **Shards never read the checkpoint or the dataset**:
//!    worker 0 hands them their slices, so their checkpoint directory need not be shared.
//! 2. Each shard answers every worker with `START` (step, samples, seed, last loss and the
//!    parameter slice): every worker begins from worker 0's state.
//! 3. Each step, every worker sends each shard a `GRAD` frame with its gradient slice (the
//!    sum over its minibatch), its loss sum and its example count. The shard waits for all
//!    workers, sums the slices in worker order, divides by the total example count, applies
//!    `m = μ m + g; w -= lr m` to its slice and answers `UPDATED` with the new parameter
//!    slice and the total loss and count (so worker 0 reports the mean loss over the global
//!    batch, as in ring mode; with two workers the arithmetic is bit-identical to the
//!    ring's). Worker 0 asks for the momentum slice too (`WANT_STATE`) on steps after which
//!    it checkpoints.
//! 4. A worker that got SIGTERM sends `STOP` instead of `GRAD`. A shard that got any `STOP`
//!    abandons the step and answers `STOPPED` with its slices of the last completed step
//!    (momentum included for worker 0), then exits 143; worker 0 writes the checkpoint of
//!    that step and every worker exits 143. A shard that got SIGTERM itself keeps serving
//!    and sets `STOP_REQUESTED` in its answers, so the workers vote `STOP` on the next step:
//!    every shard then abandons the same step and the checkpoint is consistent.
//! 5. After the last step every worker sends `DONE`; the shards acknowledge and exit 0.
//!
//! # Failures
//!
//! A read or write that makes no progress for the I/O timeout (60 s, as for the ring), a
//! closed connection, or a frame out of step fails the rank with exit code 1 and a message
//! naming the peer; the agent restarts the generation. Worker 0 keeps the checkpoint it
//! wrote last (periodic or on termination): the momentum of later steps lived on the
//! shards.

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

use crate::ring::{self, IoBuf, POLL, RingConfig, check_cancel, connect_with_retry, io_loop};

/// Magic bytes that open a worker's connection to a shard.
const PS_MAGIC: &[u8; 4] = b"CVPS";
/// Bytes of the handshake: magic, worker index, generation, workers, model size.
pub(crate) const HANDSHAKE_LEN: usize = 4 + 4 + 8 + 4 + 8;
/// Bytes of a frame header.
const HEADER_LEN: usize = 32;
/// Most metadata words a frame may carry.
const MAX_META: u64 = 16;

// Frame kinds, worker to shard.
const INIT: u8 = 1;
const GRAD: u8 = 2;
const STOP: u8 = 3;
const DONE: u8 = 4;
// Frame kinds, shard to worker.
const START: u8 = 11;
const UPDATED: u8 = 12;
const STOPPED: u8 = 13;
const DONE_ACK: u8 = 14;
const DIVERGED: u8 = 15;
// Flags.
/// `GRAD`: send the momentum slice along with the parameters.
const WANT_STATE: u64 = 1;
/// `UPDATED`/`STOPPED`: the momentum slice follows the parameter slice.
const HAS_STATE: u64 = 2;
/// `UPDATED`: the shard received a termination signal; vote `STOP` next step.
const STOP_REQUESTED: u64 = 4;

/// The role of a rank, from `RANK`, `WORLD_SIZE` and `CONVERGE_NUM_PS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A data-parallel worker: `index` of `workers` (ring mode: every rank).
    Worker { index: usize, workers: usize },
    /// A parameter-server shard: `index` of `shards`.
    Shard { index: usize, shards: usize },
}

impl Role {
    /// The role of `rank` in a job of `world_size` ranks of which the last `num_ps` are
    /// shards. `num_ps` must be below `world_size` (at least one worker).
    pub fn of(rank: usize, world_size: usize, num_ps: usize) -> Role {
        let workers = world_size - num_ps;
        if rank < workers {
            Role::Worker {
                index: rank,
                workers,
            }
        } else {
            Role::Shard {
                index: rank - workers,
                shards: num_ps,
            }
        }
    }
}

/// The slice of a vector of `n` values that shard `s` of `p` owns.
pub fn shard_range(n: usize, s: usize, p: usize) -> Range<usize> {
    (s * n / p)..((s + 1) * n / p)
}

/// Who a rank is in a parameter-server job and how to reach the master.
#[derive(Debug, Clone)]
pub struct PsConfig {
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// All ranks of the job, workers and shards.
    pub world_size: usize,
    /// Number of shards (`CONVERGE_NUM_PS`), at least 1 and below `world_size`.
    pub num_ps: usize,
    /// The job generation; all ranks must agree on it.
    pub generation: u64,
    /// Host name or IP address of rank 0.
    pub master_addr: String,
    /// Port rank 0 listens on for the rendezvous.
    pub master_port: u16,
    /// How long the rendezvous and the connections between workers and shards may take.
    pub rendezvous_timeout: Duration,
    /// How long an exchange may go without progress before the peer counts as failed.
    pub io_timeout: Duration,
}

impl PsConfig {
    pub(crate) fn workers(&self) -> usize {
        self.world_size - self.num_ps
    }

    pub(crate) fn ring_config(&self) -> RingConfig {
        RingConfig {
            rank: self.rank,
            world_size: self.world_size,
            generation: self.generation,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
            rendezvous_timeout: self.rendezvous_timeout,
            io_timeout: self.io_timeout,
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        ensure!(
            self.num_ps >= 1 && self.num_ps < self.world_size,
            "CONVERGE_NUM_PS={} needs WORLD_SIZE of at least {} (one worker or more), not {}",
            self.num_ps,
            self.num_ps + 1,
            self.world_size
        );
        ensure!(
            self.rank < self.world_size,
            "rank {} is not below world size {}",
            self.rank,
            self.world_size
        );
        Ok(())
    }
}

/// The training state that travels between worker 0, the shards and the other workers.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Steps completed since the job began.
    pub step: u64,
    /// Samples consumed since the job began.
    pub samples: u64,
    /// Seed of the data order.
    pub seed: u64,
    /// The most recently reported loss.
    pub last_loss: Option<f64>,
    /// The full parameter vector.
    pub params: Vec<f64>,
    /// The full momentum buffer (empty where a worker did not receive it).
    pub momentum: Vec<f64>,
}

/// What a worker sends for one step.
#[derive(Debug, Clone, Copy)]
pub enum Push<'a> {
    /// The worker's gradient sum over its minibatch, its loss sum and example count;
    /// `want_state` asks for the momentum too.
    Grad {
        grad: &'a [f64],
        loss_sum: f64,
        count: f64,
        want_state: bool,
    },
    /// A termination vote: the step is abandoned by every rank.
    Stop,
}

/// How a step ended for a worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepResult {
    /// The shards applied the step; the parameters (and momentum, if `has_state`) are the
    /// new ones. `loss_sum` and `count` are over all workers' examples.
    Updated {
        loss_sum: f64,
        count: f64,
        has_state: bool,
        stop_requested: bool,
    },
    /// Some rank voted to stop: the step was abandoned. The parameters (and momentum, if
    /// `has_state`) are those of the last completed step.
    Stopped { has_state: bool },
    /// A shard found a non-finite gradient and did not apply the step.
    Diverged,
}

/// A frame as it travels on the wire.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Frame {
    pub(crate) kind: u8,
    pub(crate) flags: u64,
    pub(crate) seq: u64,
    pub(crate) meta: Vec<u64>,
    pub(crate) values: Vec<f64>,
}

impl Frame {
    pub(crate) fn new(kind: u8, seq: u64) -> Frame {
        Frame {
            kind,
            flags: 0,
            seq,
            meta: Vec::new(),
            values: Vec::new(),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + 8 * (self.meta.len() + self.values.len()));
        out.extend_from_slice(&(u64::from(self.kind) | (self.flags << 8)).to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&(self.meta.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.values.len() as u64).to_le_bytes());
        for m in &self.meta {
            out.extend_from_slice(&m.to_le_bytes());
        }
        for v in &self.values {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    fn kind_name(&self) -> &'static str {
        kind_name(self.kind)
    }
}

fn kind_name(kind: u8) -> &'static str {
    match kind {
        INIT => "INIT",
        GRAD => "GRAD",
        STOP => "STOP",
        DONE => "DONE",
        START => "START",
        UPDATED => "UPDATED",
        STOPPED => "STOPPED",
        DONE_ACK => "DONE_ACK",
        DIVERGED => "DIVERGED",
        _ => "unknown",
    }
}

pub(crate) fn u64_at(b: &[u8], k: usize) -> u64 {
    u64::from_le_bytes(b[8 * k..8 * k + 8].try_into().expect("8 bytes"))
}

/// I/O on one connection with the timeout, termination and abort rules of the ring.
pub(crate) struct Link<'a> {
    pub(crate) stream: &'a TcpStream,
    pub(crate) timeout: Duration,
    pub(crate) cancel: &'a AtomicBool,
    pub(crate) failed: &'a AtomicU8,
}

impl Link<'_> {
    pub(crate) fn write(&self, frame: &Frame) -> Result<()> {
        io_loop(
            self.stream,
            &mut IoBuf::Write(&frame.encode()),
            self.timeout,
            self.cancel,
            self.failed,
        )
    }

    /// Reads one frame of at most `max_values` values.
    pub(crate) fn read(&self, max_values: usize) -> Result<Frame> {
        let mut header = [0u8; HEADER_LEN];
        self.read_exact(&mut header)?;
        let tag = u64_at(&header, 0);
        let (seq, n_meta, n_values) = (u64_at(&header, 1), u64_at(&header, 2), u64_at(&header, 3));
        ensure!(
            n_meta <= MAX_META && n_values <= max_values as u64,
            "malformed frame: {n_meta} metadata words and {n_values} values (at most {MAX_META} and {max_values})"
        );
        let mut rest = vec![0u8; 8 * (n_meta + n_values) as usize];
        self.read_exact(&mut rest)?;
        let words: Vec<u64> = (0..rest.len() / 8).map(|k| u64_at(&rest, k)).collect();
        let (meta, values) = words.split_at(n_meta as usize);
        Ok(Frame {
            kind: (tag & 0xff) as u8,
            flags: tag >> 8,
            seq,
            meta: meta.to_vec(),
            values: values.iter().map(|&w| f64::from_bits(w)).collect(),
        })
    }

    fn read_exact(&self, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        io_loop(
            self.stream,
            &mut IoBuf::Read(buf),
            self.timeout,
            self.cancel,
            self.failed,
        )
    }
}

/// Runs `f(k)` for `k in 0..n` on scoped threads (inline when `n == 1`) and returns the
/// results in order. The first failure sets `failed`, which makes the other threads'
/// socket loops give up within [`POLL`] instead of waiting for their timeout; the error
/// returned is the first one that happened.
pub(crate) fn on_each<T: Send>(
    n: usize,
    failed: &AtomicU8,
    f: impl Fn(usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let first_error = std::sync::Mutex::new(None::<anyhow::Error>);
    let run = |k: usize| match f(k) {
        Ok(v) => Some(v),
        Err(e) => {
            // The error is recorded before the flag is raised, so the cause is recorded
            // before the other threads give up because of it.
            let mut slot = first_error.lock().expect("not poisoned");
            slot.get_or_insert(e);
            failed.store(1, Ordering::SeqCst);
            None
        }
    };
    let results: Vec<Option<T>> = if n == 1 {
        vec![run(0)]
    } else {
        thread::scope(|s| {
            let handles: Vec<_> = (0..n).map(|k| s.spawn(move || run(k))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(None))
                .collect()
        })
    };
    if let Some(e) = first_error.into_inner().expect("not poisoned") {
        return Err(e);
    }
    results
        .into_iter()
        .map(|r| r.ok_or_else(|| anyhow!("a connection thread panicked")))
        .collect()
}

pub(crate) fn configure(stream: &TcpStream) -> Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(POLL))?;
    stream.set_write_timeout(Some(POLL))?;
    Ok(())
}

pub(crate) fn loss_meta(last_loss: Option<f64>) -> [u64; 2] {
    [
        u64::from(last_loss.is_some()),
        last_loss.unwrap_or(0.0).to_bits(),
    ]
}

pub(crate) fn meta_loss(present: u64, bits: u64) -> Option<f64> {
    (present != 0).then(|| f64::from_bits(bits))
}

/// A worker's connections to every shard.
pub struct PsWorker {
    index: usize,
    shards: Vec<ShardConnection>,
    num_params: usize,
    io_timeout: Duration,
    cancel: std::sync::Arc<AtomicBool>,
}

impl std::fmt::Debug for PsWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsWorker")
            .field("index", &self.index)
            .field("shards", &self.shards.len())
            .field("num_params", &self.num_params)
            .finish()
    }
}

/// What worker 0 hands the shards at the start: its state and its optimizer settings.
#[derive(Debug, Clone)]
pub struct InitState<'a> {
    /// The state to start from (the momentum must be full length).
    pub snapshot: &'a Snapshot,
    /// Learning rate.
    pub lr: f64,
    /// Momentum coefficient.
    pub momentum: f64,
}

impl PsWorker {
    /// Rendezvous (rank 0 serves it, on `master` if given), connects to every shard and
    /// starts training: worker 0 passes `init`, the others `None`. Returns the connections
    /// and the state every worker starts from (its momentum is `init`'s for worker 0 and
    /// empty for the others).
    pub fn connect(
        cfg: &PsConfig,
        master: Option<TcpListener>,
        num_params: usize,
        init: Option<InitState<'_>>,
        cancel: std::sync::Arc<AtomicBool>,
    ) -> Result<(PsWorker, Snapshot)> {
        let who = worker_name(cfg, init.is_some())?;
        let shards = connect_to_shards(
            cfg,
            master,
            num_params,
            PS_MAGIC,
            "parameter-server",
            &cancel,
        )?;
        let me = PsWorker {
            index: cfg.rank,
            shards,
            num_params,
            io_timeout: cfg.io_timeout,
            cancel,
        };
        let failed = AtomicU8::new(0);
        if let Some(init) = &init {
            let snap = init.snapshot;
            ensure!(
                snap.params.len() == num_params && snap.momentum.len() == num_params,
                "the initial state has the wrong length"
            );
            on_each(me.shards.len(), &failed, |k| {
                let sh = &me.shards[k];
                let mut f = Frame::new(INIT, snap.step);
                let [has_loss, loss] = loss_meta(snap.last_loss);
                f.meta = vec![
                    snap.step,
                    snap.samples,
                    snap.seed,
                    has_loss,
                    loss,
                    init.lr.to_bits(),
                    init.momentum.to_bits(),
                ];
                f.values = snap.params[sh.range.clone()].to_vec();
                f.values.extend_from_slice(&snap.momentum[sh.range.clone()]);
                me.link(sh, &failed)
                    .write(&f)
                    .with_context(|| me.peer(sh, "sending the initial state to"))
            })?;
        }
        let starts = on_each(me.shards.len(), &failed, |k| {
            let sh = &me.shards[k];
            let f = me
                .link(sh, &failed)
                .read(sh.range.len())
                .with_context(|| me.peer(sh, "waiting for the start from"))?;
            ensure!(
                f.kind == START && f.meta.len() == 5 && f.values.len() == sh.range.len(),
                "{}: expected START with {} values, got {} with {}",
                me.peer(sh, "bad answer from"),
                sh.range.len(),
                f.kind_name(),
                f.values.len()
            );
            Ok(f)
        })?;
        let m0 = &starts[0].meta;
        for (sh, f) in me.shards.iter().zip(&starts) {
            ensure!(
                f.meta == *m0,
                "shards {} and {} start from different states",
                me.shards[0].shard,
                sh.shard
            );
        }
        let mut params = vec![0.0; num_params];
        for (sh, f) in me.shards.iter().zip(&starts) {
            params[sh.range.clone()].copy_from_slice(&f.values);
        }
        let snapshot = Snapshot {
            step: m0[0],
            samples: m0[1],
            seed: m0[2],
            last_loss: meta_loss(m0[3], m0[4]),
            params,
            momentum: init
                .map(|i| i.snapshot.momentum.clone())
                .unwrap_or_default(),
        };
        eprintln!(
            "{who}: connected to {} parameter-server shard(s): {}",
            me.shards.len(),
            describe_shards(me.shards.iter().map(|s| (s.shard, s.addr, s.range.len())))
        );
        Ok((me, snapshot))
    }

    fn link<'a>(&'a self, sh: &'a ShardConnection, failed: &'a AtomicU8) -> Link<'a> {
        sh.link(self.io_timeout, &self.cancel, failed)
    }

    fn peer(&self, sh: &ShardConnection, what: &str) -> String {
        sh.peer(what, "parameter-server")
    }

    /// Pushes step `seq`'s gradient (or a stop vote) to every shard and pulls the answer.
    /// `params` (full length) receives the new parameters; `momentum` (full length, or
    /// empty) receives the momentum where the shards send it.
    pub fn step(
        &mut self,
        seq: u64,
        push: Push<'_>,
        params: &mut [f64],
        momentum: &mut [f64],
    ) -> Result<StepResult> {
        ensure!(params.len() == self.num_params, "parameter vector length");
        let failed = AtomicU8::new(0);
        let me = &*self;
        let replies = on_each(me.shards.len(), &failed, |k| {
            let sh = &me.shards[k];
            let mut f = match push {
                Push::Grad {
                    grad,
                    loss_sum,
                    count,
                    want_state,
                } => {
                    let mut f = Frame::new(GRAD, seq);
                    f.flags = if want_state { WANT_STATE } else { 0 };
                    f.meta = vec![loss_sum.to_bits(), count.to_bits()];
                    f.values = grad[sh.range.clone()].to_vec();
                    f
                }
                Push::Stop => Frame::new(STOP, seq),
            };
            let link = me.link(sh, &failed);
            link.write(&f)
                .with_context(|| me.peer(sh, &format!("step {seq}: sending to")))?;
            f = link
                .read(2 * sh.range.len())
                .with_context(|| me.peer(sh, &format!("step {seq}: waiting for")))?;
            ensure!(
                f.seq == seq,
                "{} is out of step: it answered step {} to step {seq}",
                me.peer(sh, "parameter-server"),
                f.seq
            );
            Ok(f)
        })?;
        // Every shard saw the same pushes, so they all answer the same kind; a mix means
        // the shards are out of step with one another.
        let kind = replies[0].kind;
        if replies.iter().any(|f| f.kind == DIVERGED) {
            return Ok(StepResult::Diverged);
        }
        ensure!(
            replies.iter().all(|f| f.kind == kind),
            "the parameter-server shards disagree on whether step {seq} happened"
        );
        let mut all_state = true;
        let mut stop_requested = false;
        for (sh, f) in self.shards.iter().zip(&replies) {
            let has_state = f.flags & HAS_STATE != 0;
            let len = sh.range.len();
            let want = if has_state { 2 * len } else { len };
            let metas = if f.kind == UPDATED { 2 } else { 0 };
            ensure!(
                matches!(f.kind, UPDATED | STOPPED)
                    && f.values.len() == want
                    && f.meta.len() == metas,
                "{}: unexpected {} frame with {} values",
                self.peer(sh, "bad answer from"),
                f.kind_name(),
                f.values.len()
            );
            params[sh.range.clone()].copy_from_slice(&f.values[..len]);
            if has_state && momentum.len() == self.num_params {
                momentum[sh.range.clone()].copy_from_slice(&f.values[len..]);
            }
            all_state &= has_state;
            stop_requested |= f.flags & STOP_REQUESTED != 0;
        }
        if kind == STOPPED {
            return Ok(StepResult::Stopped {
                has_state: all_state,
            });
        }
        // Every shard sums the same pushes in the same order: shard 0's totals stand for all.
        Ok(StepResult::Updated {
            loss_sum: f64::from_bits(replies[0].meta[0]),
            count: f64::from_bits(replies[0].meta[1]),
            has_state: all_state,
            stop_requested,
        })
    }

    /// Tells every shard that training is complete and waits for the acknowledgements.
    pub fn finish(&mut self, seq: u64) -> Result<()> {
        let failed = AtomicU8::new(0);
        let me = &*self;
        on_each(me.shards.len(), &failed, |k| {
            let sh = &me.shards[k];
            let link = me.link(sh, &failed);
            link.write(&Frame::new(DONE, seq))
                .with_context(|| me.peer(sh, "sending DONE to"))?;
            let f = link
                .read(0)
                .with_context(|| me.peer(sh, "waiting for the acknowledgement of"))?;
            ensure!(
                f.kind == DONE_ACK,
                "{}: expected DONE_ACK, got {}",
                me.peer(sh, "bad answer from"),
                f.kind_name()
            );
            Ok(())
        })?;
        Ok(())
    }
}

/// How a shard's run ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardOutcome {
    /// Every worker reported the end of training.
    Completed,
    /// A termination vote stopped the job.
    Terminated,
}

pub(crate) struct WorkerLink {
    pub(crate) stream: TcpStream,
    pub(crate) index: usize,
    pub(crate) peer: SocketAddr,
}

/// Runs parameter-server shard `cfg.rank - workers` until the workers finish (`Completed`),
/// a termination vote (`Terminated`), or a failure (an error). `cancel` is the termination
/// flag: the shard keeps serving and asks the workers to vote `STOP`.
pub fn run_shard(cfg: &PsConfig, cancel: &std::sync::Arc<AtomicBool>) -> Result<ShardOutcome> {
    cfg.check()?;
    let workers = cfg.workers();
    ensure!(cfg.rank >= workers, "rank {} is not a shard", cfg.rank);
    let shard = cfg.rank - workers;
    let who = format!("ps shard {shard}/{} (rank {})", cfg.num_ps, cfg.rank);
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let listener =
        TcpListener::bind(("0.0.0.0", 0)).context("cannot bind the parameter-server listener")?;
    let port = listener.local_addr()?.port();
    eprintln!("{who}: listening on port {port}");
    ring::rendezvous(&cfg.ring_config(), cfg.num_ps, None, port, cancel)?;
    let (links, num_params) = accept_workers(&listener, cfg, PS_MAGIC, &who, deadline, cancel)?;
    let range = shard_range(num_params, shard, cfg.num_ps);
    let len = range.len();
    let failed = AtomicU8::new(0);
    let peer = |w: &WorkerLink| format!("worker {} ({})", w.index, w.peer);

    // Worker 0's initial state.
    let init = worker_link(&links[0], cfg, cancel, &failed)
        .read(2 * len)
        .with_context(|| format!("waiting for the initial state from {}", peer(&links[0])))?;
    ensure!(
        init.kind == INIT && init.meta.len() == 7 && init.values.len() == 2 * len,
        "expected INIT with {} values from worker 0, got {} with {}",
        2 * len,
        init.kind_name(),
        init.values.len()
    );
    let m = &init.meta;
    let (mut step, samples, seed) = (m[0], m[1], m[2]);
    let last_loss = meta_loss(m[3], m[4]);
    let (lr, mu) = (f64::from_bits(m[5]), f64::from_bits(m[6]));
    ensure!(
        lr.is_finite() && lr > 0.0 && (0.0..1.0).contains(&mu),
        "worker 0 sent a bad learning rate {lr} or momentum {mu}"
    );
    let mut params = init.values[..len].to_vec();
    let mut momentum = init.values[len..].to_vec();
    eprintln!(
        "{who}: {workers} worker(s) connected; serving parameters {}..{} of {num_params} from step {step} (samples {samples}), lr {lr}, momentum {mu}",
        range.start, range.end
    );
    let [has_loss, loss_bits] = loss_meta(last_loss);
    on_each(links.len(), &failed, |k| {
        let mut f = Frame::new(START, step);
        f.meta = vec![step, samples, seed, has_loss, loss_bits];
        f.values = params.clone();
        worker_link(&links[k], cfg, cancel, &failed)
            .write(&f)
            .with_context(|| format!("sending the start to {}", peer(&links[k])))
    })?;

    let mut grad = vec![0.0; len];
    let mut warned_stop = false;
    loop {
        let seq = step + 1;
        let failed = AtomicU8::new(0);
        let pushes = on_each(links.len(), &failed, |k| {
            let w = &links[k];
            let f = worker_link(w, cfg, cancel, &failed)
                .read(len)
                .with_context(|| format!("step {seq}: waiting for {}", peer(w)))?;
            ensure!(
                f.seq == seq,
                "{} is out of step: it sent step {} while this shard is at step {seq}",
                peer(w),
                f.seq
            );
            let ok = match f.kind {
                GRAD => f.meta.len() == 2 && f.values.len() == len,
                STOP | DONE => f.values.is_empty(),
                _ => false,
            };
            ensure!(
                ok,
                "{} sent a malformed {} frame ({} values)",
                peer(w),
                f.kind_name(),
                f.values.len()
            );
            Ok(f)
        })?;
        let done = pushes.iter().filter(|f| f.kind == DONE).count();
        if done > 0 {
            ensure!(
                done == pushes.len(),
                "the workers disagree on whether training is complete at step {step}"
            );
            on_each(links.len(), &failed, |k| {
                worker_link(&links[k], cfg, cancel, &failed)
                    .write(&Frame::new(DONE_ACK, seq))
                    .with_context(|| format!("acknowledging the end to {}", peer(&links[k])))
            })?;
            eprintln!("{who}: training complete at step {step}");
            return Ok(ShardOutcome::Completed);
        }
        if pushes.iter().any(|f| f.kind == STOP) {
            eprintln!(
                "{who}: a rank voted to stop; abandoning step {seq}, handing worker 0 the state of step {step}"
            );
            on_each(links.len(), &failed, |k| {
                let mut f = Frame::new(STOPPED, seq);
                f.values = params.clone();
                if links[k].index == 0 {
                    f.flags = HAS_STATE;
                    f.values.extend_from_slice(&momentum);
                }
                worker_link(&links[k], cfg, cancel, &failed)
                    .write(&f)
                    .with_context(|| format!("answering the stop to {}", peer(&links[k])))
            })?;
            return Ok(ShardOutcome::Terminated);
        }
        // Sum in worker order, starting from worker 0's slice (no added zero), so that two
        // workers give exactly the ring's sums.
        let mut loss_sum = f64::from_bits(pushes[0].meta[0]);
        let mut count = f64::from_bits(pushes[0].meta[1]);
        grad.copy_from_slice(&pushes[0].values);
        for f in &pushes[1..] {
            loss_sum += f64::from_bits(f.meta[0]);
            count += f64::from_bits(f.meta[1]);
            for (g, v) in grad.iter_mut().zip(&f.values) {
                *g += v;
            }
        }
        if count.is_nan() || count <= 0.0 || grad.iter().any(|g| !g.is_finite()) {
            eprintln!("{who}: step {seq}: non-finite gradient; not applying it");
            let _ = on_each(links.len(), &failed, |k| {
                worker_link(&links[k], cfg, cancel, &failed).write(&Frame::new(DIVERGED, seq))
            });
            bail!("training diverged at step {seq} (non-finite gradient); try a smaller --lr");
        }
        for ((w, m), g) in params.iter_mut().zip(&mut momentum).zip(&grad) {
            *m = mu * *m + g / count;
            *w -= lr * *m;
        }
        step = seq;
        let stop_requested = cancel.load(Ordering::SeqCst);
        if stop_requested && !warned_stop {
            eprintln!("{who}: termination requested; asking the workers to stop after step {step}");
            warned_stop = true;
        }
        on_each(links.len(), &failed, |k| {
            let mut f = Frame::new(UPDATED, seq);
            f.meta = vec![loss_sum.to_bits(), count.to_bits()];
            f.values = params.clone();
            if stop_requested {
                f.flags |= STOP_REQUESTED;
            }
            if pushes[k].flags & WANT_STATE != 0 {
                f.flags |= HAS_STATE;
                f.values.extend_from_slice(&momentum);
            }
            worker_link(&links[k], cfg, cancel, &failed)
                .write(&f)
                .with_context(|| format!("step {seq}: answering {}", peer(&links[k])))
        })?;
    }
}

fn worker_link<'a>(
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

/// Accepts one connection from every worker of this generation whose handshake opens with
/// `magic`; returns them in worker order with the model size they agree on.
pub(crate) fn accept_workers(
    listener: &TcpListener,
    cfg: &PsConfig,
    magic: &[u8; 4],
    who: &str,
    deadline: Instant,
    cancel: &AtomicBool,
) -> Result<(Vec<WorkerLink>, usize)> {
    let workers = cfg.workers();
    listener.set_nonblocking(true)?;
    let mut slots: Vec<Option<(WorkerLink, u64)>> = (0..workers).map(|_| None).collect();
    let mut joined = 0;
    while joined < workers {
        check_cancel(cancel)?;
        if Instant::now() >= deadline {
            let missing: Vec<String> = (0..workers)
                .filter(|&k| slots[k].is_none())
                .map(|k| k.to_string())
                .collect();
            bail!(
                "timed out after {} s waiting for worker(s) {} to connect",
                cfg.rendezvous_timeout.as_secs_f64(),
                missing.join(", ")
            );
        }
        let (mut stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e).context("accepting a worker connection"),
        };
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut hs = [0u8; HANDSHAKE_LEN];
        if let Err(e) = stream.read_exact(&mut hs) {
            eprintln!("{who}: ignoring a connection from {peer}: {e}");
            continue;
        }
        let index = u32::from_le_bytes(hs[4..8].try_into()?) as usize;
        let generation = u64::from_le_bytes(hs[8..16].try_into()?);
        let their_workers = u32::from_le_bytes(hs[16..20].try_into()?) as usize;
        let num_params = u64::from_le_bytes(hs[20..28].try_into()?);
        let problem = if &hs[..4] != magic {
            Some(format!(
                "not a {} handshake",
                String::from_utf8_lossy(magic)
            ))
        } else if generation != cfg.generation {
            Some(format!("generation {generation}, not {}", cfg.generation))
        } else if their_workers != workers || index >= workers {
            Some(format!(
                "worker {index} of {their_workers}, but this job has {workers} worker(s)"
            ))
        } else if slots[index].is_some() {
            Some(format!("worker {index} connected twice"))
        } else {
            None
        };
        if let Some(problem) = problem {
            eprintln!("{who}: ignoring a connection from {peer}: {problem}");
            continue;
        }
        configure(&stream)?;
        slots[index] = Some((
            WorkerLink {
                stream,
                index,
                peer,
            },
            num_params,
        ));
        joined += 1;
    }
    let slots: Vec<(WorkerLink, u64)> = slots.into_iter().flatten().collect();
    let n = slots[0].1;
    if let Some((w, m)) = slots.iter().find(|(_, m)| *m != n) {
        bail!(
            "worker {} has a model of {m} parameters but worker 0 has {n}: are all ranks run with the same options?",
            w.index
        );
    }
    Ok((slots.into_iter().map(|(w, _)| w).collect(), n as usize))
}

/// Checks a worker's settings (`cfg.check`, its rank is a worker's, and worker 0 alone
/// brings the initial state: `has_init`) and returns its name in messages,
/// `worker <rank>/<workers>`. Used by the parameter-server worker and S-EASGD's client.
pub(crate) fn worker_name(cfg: &PsConfig, has_init: bool) -> Result<String> {
    cfg.check()?;
    let workers = cfg.workers();
    ensure!(cfg.rank < workers, "rank {} is not a worker", cfg.rank);
    ensure!(
        (cfg.rank == 0) == has_init,
        "exactly worker 0 provides the initial state"
    );
    Ok(format!("worker {}/{workers}", cfg.rank))
}

/// `shard <index> at <address> (<values> values), …` of a worker's shards, given as
/// `(index, address, values)`, for the line it logs once connected.
pub(crate) fn describe_shards(shards: impl Iterator<Item = (usize, SocketAddr, usize)>) -> String {
    shards
        .map(|(shard, addr, len)| format!("shard {shard} at {addr} ({len} values)"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A worker's TCP connection to one shard, handshake sent ([`connect_to_shards`]).
pub(crate) struct ShardConnection {
    pub stream: TcpStream,
    /// The shard's slice of the parameters.
    pub range: std::ops::Range<usize>,
    pub shard: usize,
    pub rank: usize,
    pub addr: SocketAddr,
}

impl ShardConnection {
    /// I/O on this connection with `timeout`, `cancel` and `failed` ([`Link`]).
    pub(crate) fn link<'a>(
        &'a self,
        timeout: Duration,
        cancel: &'a AtomicBool,
        failed: &'a AtomicU8,
    ) -> Link<'a> {
        Link {
            stream: &self.stream,
            timeout,
            cancel,
            failed,
        }
    }

    /// `<what> <kind> shard <index> (rank <rank>, <address>)`, the shard in messages;
    /// `kind` is parameter-server or S-EASGD.
    pub(crate) fn peer(&self, what: &str, kind: &str) -> String {
        format!(
            "{what} {kind} shard {} (rank {}, {})",
            self.shard, self.rank, self.addr
        )
    }
}

/// A worker's side of the shards' rendezvous: joins it, connects to every shard (ranks
/// after the workers) within the rendezvous timeout and sends the handshake that starts
/// with `magic` (rank, generation, workers, parameters). `what` names the shards in errors
/// (parameter-server, S-EASGD). Used by the parameter-server worker and S-EASGD's client.
pub(crate) fn connect_to_shards(
    cfg: &PsConfig,
    master: Option<TcpListener>,
    num_params: usize,
    magic: &[u8],
    what: &str,
    cancel: &AtomicBool,
) -> Result<Vec<ShardConnection>> {
    let workers = cfg.workers();
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let addresses = ring::rendezvous(&cfg.ring_config(), cfg.num_ps, master, 0, cancel)?;
    let mut shards = Vec::with_capacity(cfg.num_ps);
    for s in 0..cfg.num_ps {
        let rank = workers + s;
        let addr: SocketAddr = addresses[rank]
            .parse()
            .with_context(|| format!("bad shard address {:?}", addresses[rank]))?;
        let mut stream = connect_with_retry(addr, deadline, cancel).with_context(|| {
            format!("cannot connect to {what} shard {s} (rank {rank}) at {addr}")
        })?;
        let mut hs = Vec::with_capacity(HANDSHAKE_LEN);
        hs.extend_from_slice(magic);
        hs.extend_from_slice(&(cfg.rank as u32).to_le_bytes());
        hs.extend_from_slice(&cfg.generation.to_le_bytes());
        hs.extend_from_slice(&(workers as u32).to_le_bytes());
        hs.extend_from_slice(&(num_params as u64).to_le_bytes());
        std::io::Write::write_all(&mut stream, &hs)?;
        configure(&stream)?;
        shards.push(ShardConnection {
            stream,
            range: shard_range(num_params, s, cfg.num_ps),
            shard: s,
            rank,
            addr,
        });
    }
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn roles_and_ranges() {
        let worker = |index, workers| Role::Worker { index, workers };
        let shard = |index, shards| Role::Shard { index, shards };
        for ((rank, world_size, num_ps), role) in [
            ((0, 3, 1), worker(0, 2)),
            ((1, 3, 1), worker(1, 2)),
            ((2, 3, 1), shard(0, 1)),
            ((2, 3, 2), shard(1, 2)),
            ((0, 3, 0), worker(0, 3)),
        ] {
            assert_eq!(
                Role::of(rank, world_size, num_ps),
                role,
                "{rank} of {world_size}"
            );
        }
        let n = 650;
        for p in 1..=4 {
            let rs: Vec<_> = (0..p).map(|s| shard_range(n, s, p)).collect();
            assert_eq!(rs[0].start, 0);
            assert_eq!(rs[p - 1].end, n);
            assert!(rs.windows(2).all(|w| w[0].end == w[1].start));
            let lens: Vec<usize> = rs.iter().map(|r| r.len()).collect();
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
        }
    }

    #[test]
    fn frames_round_trip() {
        let (a, b) = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            (a, l.accept().unwrap().0)
        };
        configure(&a).unwrap();
        configure(&b).unwrap();
        let cancel = AtomicBool::new(false);
        let failed = AtomicU8::new(0);
        let mk = |s| Link {
            stream: s,
            timeout: Duration::from_secs(5),
            cancel: &cancel,
            failed: &failed,
        };
        let mut f = Frame::new(GRAD, 42);
        f.flags = WANT_STATE;
        f.meta = vec![0.5f64.to_bits(), 7];
        f.values = vec![1.0, -2.5, f64::MIN_POSITIVE];
        mk(&a).write(&f).unwrap();
        assert_eq!(mk(&b).read(3).unwrap(), f);
        mk(&a).write(&f).unwrap();
        let err = mk(&b).read(2).unwrap_err();
        assert!(format!("{err:#}").contains("malformed frame"), "{err:#}");
    }

    fn config(rank: usize, world: usize, num_ps: usize, port: u16) -> PsConfig {
        PsConfig {
            rank,
            world_size: world,
            num_ps,
            generation: 5,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            rendezvous_timeout: Duration::from_secs(20),
            io_timeout: Duration::from_secs(20),
        }
    }

    /// Two workers and two shards in threads: one SGD step matches the formula, the
    /// second step is stopped and worker 0 gets the state of the first.
    #[test]
    fn two_workers_two_shards_step_and_stop() {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let (n, lr, mu) = (7usize, 0.1, 0.5);
        let w0: Vec<f64> = (0..n).map(|i| i as f64).collect();
        let m0: Vec<f64> = (0..n).map(|i| 0.25 * i as f64).collect();
        let grads = [vec![1.0; n], (0..n).map(|i| i as f64).collect::<Vec<_>>()];
        let shards: Vec<_> = (2..4)
            .map(|rank| {
                thread::spawn(move || {
                    run_shard(&config(rank, 4, 2, port), &Arc::new(AtomicBool::new(false)))
                })
            })
            .collect();
        let mut master = Some(master);
        let results: Vec<_> = thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let master = if rank == 0 { master.take() } else { None };
                    let (w0, m0, grads) = (&w0, &m0, &grads);
                    s.spawn(move || {
                        let snap = Snapshot {
                            step: 3,
                            samples: 96,
                            seed: u64::MAX - 1,
                            last_loss: Some(0.7),
                            params: w0.clone(),
                            momentum: m0.clone(),
                        };
                        let init = (rank == 0).then_some(InitState {
                            snapshot: &snap,
                            lr,
                            momentum: mu,
                        });
                        let (mut c, start) = PsWorker::connect(
                            &config(rank, 4, 2, port),
                            master,
                            n,
                            init,
                            Arc::new(AtomicBool::new(false)),
                        )
                        .unwrap();
                        assert_eq!(
                            (start.step, start.samples, start.seed),
                            (3, 96, u64::MAX - 1)
                        );
                        assert_eq!(start.last_loss, Some(0.7));
                        assert_eq!(&start.params, w0);
                        let mut params = start.params.clone();
                        let mut mom = vec![0.0; n];
                        let r = c
                            .step(
                                4,
                                Push::Grad {
                                    grad: &grads[rank],
                                    loss_sum: 1.0 + rank as f64,
                                    count: 2.0,
                                    want_state: rank == 0,
                                },
                                &mut params,
                                &mut mom,
                            )
                            .unwrap();
                        let after_one = (params.clone(), mom.clone());
                        let push = if rank == 1 {
                            Push::Stop
                        } else {
                            Push::Grad {
                                grad: &grads[0],
                                loss_sum: 0.0,
                                count: 2.0,
                                want_state: false,
                            }
                        };
                        mom.fill(0.0);
                        let stopped = c.step(5, push, &mut params, &mut mom).unwrap();
                        (r, after_one, stopped, params, mom)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for h in shards {
            assert_eq!(h.join().unwrap().unwrap(), ShardOutcome::Terminated);
        }
        let want_m: Vec<f64> = (0..n)
            .map(|i| mu * m0[i] + (grads[0][i] + grads[1][i]) / 4.0)
            .collect();
        let want_w: Vec<f64> = (0..n).map(|i| w0[i] - lr * want_m[i]).collect();
        for (rank, (r, (p1, m1), stopped, p2, m2)) in results.into_iter().enumerate() {
            assert_eq!(
                r,
                StepResult::Updated {
                    loss_sum: 3.0,
                    count: 4.0,
                    has_state: rank == 0,
                    stop_requested: false
                }
            );
            assert_eq!(p1, want_w);
            assert_eq!(p2, want_w, "the stopped step left the parameters alone");
            assert_eq!(
                stopped,
                StepResult::Stopped {
                    has_state: rank == 0
                }
            );
            if rank == 0 {
                assert_eq!(m1, want_m);
                assert_eq!(m2, want_m);
            } else {
                assert!(m1.iter().chain(&m2).all(|&v| v == 0.0));
            }
        }
    }

    #[test]
    fn a_worker_that_disappears_fails_the_shard() {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let shard = thread::spawn(move || {
            let mut cfg = config(1, 2, 1, port);
            cfg.io_timeout = Duration::from_secs(5);
            run_shard(&cfg, &Arc::new(AtomicBool::new(false)))
        });
        let snap = Snapshot {
            step: 0,
            samples: 0,
            seed: 1,
            last_loss: None,
            params: vec![0.0; 3],
            momentum: vec![0.0; 3],
        };
        let (c, _) = PsWorker::connect(
            &config(0, 2, 1, port),
            Some(master),
            3,
            Some(InitState {
                snapshot: &snap,
                lr: 0.1,
                momentum: 0.9,
            }),
            Arc::new(AtomicBool::new(false)),
        )
        .unwrap();
        drop(c);
        let err = shard.join().unwrap().unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("waiting for worker 0"), "{msg}");
    }
}

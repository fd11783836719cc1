//! The training loop: data-parallel SGD with momentum, progress lines, checkpoints and
//! the exit codes of the worker contract.
//!
//! Gradients are averaged by ring all-reduce ([`crate::ring`]) or, with
//! `CONVERGE_NUM_PS=p`, by parameter-server shards ([`crate::ps`], which documents that
//! mode's contract); ranks that are shards run [`crate::ps::run_shard`] instead of this loop.

use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::batch::{
    ContractBatch, LrScaling, SmoothedStats, StatsWindow, significant, step_estimate,
};
use crate::checkpoint::{self, Checkpoint};
use crate::cli::{Args, WorkerEnv};
use crate::data::{self, Dataset, Split, Task};
use crate::model::Model;
use crate::order::DataOrder;
use crate::ps::{
    self, InitState, PsConfig, PsWorker, Push, Role, ShardOutcome, Snapshot, StepResult,
};
use crate::ring::{Interrupted, Ring, RingConfig};
use crate::shadow::ShadowAlgo;

mod shadow_run;

/// Exit code after finishing.
pub const EXIT_OK: i32 = 0;
/// Exit code after a failure, for example a failed peer.
pub const EXIT_FAILED: i32 = 1;
/// Exit code for refused options, environment, data or checkpoint.
pub const EXIT_REFUSED: i32 = 2;
/// Exit code after a termination signal (128 + SIGTERM).
pub const EXIT_TERMINATED: i32 = 143;

/// Held-out rows evaluated at most, to keep evaluation cheap.
pub const EVAL_CAP: usize = 2_000;
/// How long an all-reduce (or a parameter-server exchange) may go without progress before
/// the peer counts as failed.
pub const RING_IO_TIMEOUT: Duration = Duration::from_secs(60);
/// The prefix of progress lines on stdout.
pub const PROGRESS_PREFIX: &str = "CONVERGE_PROGRESS ";

/// A problem with the options, environment, data or checkpoint: the run is refused with
/// exit code 2 rather than failed.
#[derive(Debug)]
pub struct Refused(pub String);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

fn refuse(e: anyhow::Error) -> anyhow::Error {
    Refused(format!("{e:#}")).into()
}

/// How a run ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The epoch or step limit was reached.
    Completed,
    /// A termination signal stopped the run at a step boundary.
    Terminated,
}

impl From<ShardOutcome> for Outcome {
    /// A shard's run ends as its workers' does.
    fn from(outcome: ShardOutcome) -> Self {
        match outcome {
            ShardOutcome::Completed => Outcome::Completed,
            ShardOutcome::Terminated => Outcome::Terminated,
        }
    }
}

/// One `CONVERGE_PROGRESS` line.
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    /// Steps since the job began.
    pub step: u64,
    /// Samples since the job began.
    pub samples: u64,
    /// Mean training loss over the steps since the previous line.
    pub loss: f64,
    /// Samples divided by the training-set size.
    pub epoch: f64,
    /// Held-out loss, when evaluated at this line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// Seconds per step spent synchronizing (the all-reduce, or the parameter-server push
    /// and pull), mean over the steps since the previous line; 0 for a single rank. Absent
    /// when no step ran in this process since the previous line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_s: Option<f64>,
    /// Bytes of the parameters the ranks synchronize (parameter count × 8: `f64`).
    pub model_bytes: u64,
    /// Squared norm of the mean gradient, mean of the per-step estimates since the previous
    /// line ([`crate::batch`]); absent without an estimate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_sqr: Option<f64>,
    /// Variance of one sample's gradient (trace of the covariance), same window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_var: Option<f64>,
    /// ShadowSync: synchronization rounds rank 0's background thread completed per second
    /// since the previous line ([`crate::shadow`]); absent in the other modes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_rounds_per_s: Option<f64>,
    /// ShadowSync: mean over those rounds of `||local - synchronized|| / max(||local||,
    /// ||synchronized||)`; absent without a round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_gap: Option<f64>,
}

impl Progress {
    /// The line as printed, without the newline.
    pub fn line(&self) -> String {
        let json = serde_json::to_string(self).expect("progress serializes");
        format!("{PROGRESS_PREFIX}{json}")
    }
}

fn round_to(x: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (x * scale).round() / scale
}

/// Registers SIGTERM and SIGINT, reads the environment, trains, and returns the exit code.
pub fn main_with_args(args: Args) -> i32 {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Err(e) = signal_hook::flag::register(sig, stop.clone()) {
            eprintln!("converge-trainer: cannot install the handler for signal {sig}: {e}");
            return EXIT_FAILED;
        }
    }
    let env = match WorkerEnv::from_process() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("converge-trainer: refused: bad worker environment: {e:#}");
            return EXIT_REFUSED;
        }
    };
    run(&args, &env, stop)
}

/// Trains with the given options and environment until done, terminated or failed, and
/// returns the exit code. `stop` is the termination flag.
pub fn run(args: &Args, env: &WorkerEnv, stop: Arc<AtomicBool>) -> i32 {
    let who = who(env);
    let result = match env.role() {
        Role::Shard { .. } if args.shadow == Some(ShadowAlgo::Easgd) => {
            shadow_run::serve_easgd_shard(args, env, &stop)
        }
        Role::Shard { .. } => serve_shard(args, env, &stop),
        Role::Worker { .. } => Trainer::new(args, env, stop).and_then(|t| t.train()),
    };
    match result {
        Ok(Outcome::Completed) => {
            eprintln!("{who}: finished");
            EXIT_OK
        }
        Ok(Outcome::Terminated) => {
            eprintln!("{who}: terminated by signal; exiting with {EXIT_TERMINATED}");
            EXIT_TERMINATED
        }
        Err(e) if e.is::<Interrupted>() => {
            eprintln!("{who}: terminated by signal ({e:#}); exiting with {EXIT_TERMINATED}");
            EXIT_TERMINATED
        }
        Err(e) if e.is::<Refused>() => {
            eprintln!("{who}: refused: {e:#}");
            EXIT_REFUSED
        }
        Err(e) => {
            eprintln!("{who}: error: {e:#}");
            EXIT_FAILED
        }
    }
}

/// How a rank names itself in its log lines.
fn who(env: &WorkerEnv) -> String {
    match env.role() {
        _ if env.num_ps == 0 => format!("rank {}/{}", env.rank, env.world_size),
        Role::Worker { index, workers } => {
            format!(
                "worker {index}/{workers} (rank {}/{})",
                env.rank, env.world_size
            )
        }
        Role::Shard { index, shards } => {
            format!(
                "ps shard {index}/{shards} (rank {}/{})",
                env.rank, env.world_size
            )
        }
    }
}

fn ps_config(args: &Args, env: &WorkerEnv) -> PsConfig {
    PsConfig {
        rank: env.rank,
        world_size: env.world_size,
        num_ps: env.num_ps,
        generation: env.generation,
        master_addr: env.master_addr.clone(),
        master_port: env.master_port,
        rendezvous_timeout: Duration::from_secs_f64(args.rendezvous_timeout),
        io_timeout: RING_IO_TIMEOUT,
    }
}

/// What a shard logs as it starts: `<who> generation <g>: job <id>, <role> for <n>
/// worker(s), dataset <dataset>, model <model>`.
fn shard_banner(args: &Args, env: &WorkerEnv, role: &str) -> String {
    format!(
        "{} generation {}: job {}, {role} for {} worker(s), dataset {}, model {}",
        who(env),
        env.generation,
        env.job_id.as_deref().unwrap_or("(unset)"),
        env.workers(),
        args.dataset,
        args.model_kind(),
    )
}

/// A parameter-server shard: checks the options, then serves its slice until the workers
/// finish or stop. It reads neither the dataset nor the checkpoint.
fn serve_shard(args: &Args, env: &WorkerEnv, stop: &Arc<AtomicBool>) -> Result<Outcome> {
    args.validate().map_err(refuse)?;
    eprintln!(
        "{}, local rank {}",
        shard_banner(args, env, "parameter-server shard"),
        env.local_rank.as_deref().unwrap_or("(unset)"),
    );
    Ok(ps::run_shard(&ps_config(args, env), stop)?.into())
}

/// The optimizer state that checkpoints carry.
#[derive(Debug, Clone)]
struct State {
    step: u64,
    samples: u64,
    seed: u64,
    last_loss: Option<f64>,
    params: Vec<f64>,
    momentum: Vec<f64>,
    /// Whether `momentum` belongs to `step`. Always so in ring mode; in parameter-server
    /// mode the momentum lives on the shards and worker 0 pulls it only when it
    /// checkpoints.
    momentum_fresh: bool,
    /// The smoothed gradient statistics and AdaScale's progress (ring mode; kept unchanged
    /// by the other modes).
    scaling: SmoothedStats,
}

impl State {
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            step: self.step,
            samples: self.samples,
            seed: self.seed,
            last_loss: self.last_loss,
            params: self.params.clone(),
            momentum: self.momentum.clone(),
        }
    }
}

/// How the ranks of a job combine their gradients.
enum Sync {
    /// A single rank.
    Alone,
    /// Ring all-reduce.
    Ring(Ring),
    /// Parameter-server shards.
    Ps(PsWorker),
}

struct Trainer<'a> {
    args: &'a Args,
    env: &'a WorkerEnv,
    stop: Arc<AtomicBool>,
    who: String,
    data: Dataset,
    model: Model,
    /// The learning rate of every step; with AdaScale, of the steps without statistics
    /// (the square-root rule).
    lr: f64,
    /// `--lr` (or the model's default), tuned at the reference batch.
    lr0: f64,
    /// The planned batch, when this mode applies it (ring mode).
    batch: Option<ContractBatch>,
    /// Whether the learning rate follows AdaScale's gain (`--lr-scaling adascale`, a planned
    /// batch and gradient statistics).
    adascale: bool,
    /// Samples per worker per micro-batch (`CONVERGE_BATCH_SIZE`, else `--batch-size`).
    per_worker: usize,
    /// Extra micro-batches per optimizer step (`CONVERGE_ACCUM_STEPS`).
    accum_steps: usize,
    /// Whether the step computes gradient statistics (ring mode, not `--no-grad-stats`).
    grad_stats: bool,
    eval_idx: Vec<usize>,
    ckpt_dir: Option<PathBuf>,
}

impl<'a> Trainer<'a> {
    fn new(args: &'a Args, env: &'a WorkerEnv, stop: Arc<AtomicBool>) -> Result<Trainer<'a>> {
        let who = who(env);
        args.validate().map_err(refuse)?;
        args.check_shadow_env(env).map_err(refuse)?;
        let kind = args.model_kind();
        let lr0 = args.learning_rate();
        let grad_stats = env.num_ps == 0 && args.shadow.is_none() && !args.no_grad_stats;
        let mut adascale = false;
        let (per_worker, accum_steps, lr, batch) = match env.batch {
            Some(_) if args.shadow.is_some() => {
                eprintln!(
                    "{who}: ShadowSync mode ignores the planned batch (CONVERGE_BATCH_SIZE); using --batch-size"
                );
                (args.batch_size, 0, lr0, None)
            }
            Some(b) if env.num_ps == 0 => {
                let lr = args.lr_scaling.scale(lr0, b.total, b.reference);
                let planned = format!(
                    "{who}: planned batch {} ({} per worker x {} micro-batch(es)), reference {}",
                    b.total,
                    b.per_worker,
                    b.accum_steps + 1,
                    b.reference,
                );
                match args.lr_scaling {
                    LrScaling::AdaScale if grad_stats => {
                        adascale = true;
                        eprintln!(
                            "{planned}: lr {lr0} x AdaScale gain (1 to {:.4}) from the smoothed gradient statistics; square-root rule (lr {lr}) for a step without statistics",
                            b.total as f64 / b.reference as f64
                        )
                    }
                    LrScaling::AdaScale => eprintln!(
                        "{planned}: AdaScale needs the gradient statistics, which --no-grad-stats turns off: lr {lr0} scaled to {lr} by the square-root rule instead"
                    ),
                    rule => eprintln!("{planned}: lr {lr0} scaled to {lr} ({} rule)", rule.name()),
                }
                (b.per_worker, b.accum_steps, lr, Some(b))
            }
            Some(_) => {
                eprintln!(
                    "{who}: parameter-server mode ignores the planned batch (CONVERGE_BATCH_SIZE); using --batch-size"
                );
                (args.batch_size, 0, lr0, None)
            }
            None => (args.batch_size, 0, lr0, None),
        };
        let global = per_worker * (accum_steps + 1) * env.workers();
        eprintln!(
            "{who} generation {}: job {}, dataset {}, model {kind}, batch size {} per worker x {} micro-batch(es) ({} global), lr {lr}, momentum {}, seed {}, local rank {}, CUDA_VISIBLE_DEVICES {}",
            env.generation,
            env.job_id.as_deref().unwrap_or("(unset)"),
            args.dataset,
            per_worker,
            accum_steps + 1,
            global,
            args.momentum,
            args.seed,
            env.local_rank.as_deref().unwrap_or("(unset)"),
            env.cuda_visible_devices.as_deref().unwrap_or("(unset)"),
        );
        let started = Instant::now();
        let data = data::load(args.dataset, &args.data_dir).map_err(refuse)?;
        eprintln!(
            "{who}: loaded {} from {} in {:.2} s: {} training and {} held-out rows, {} features",
            args.dataset,
            args.data_dir.display(),
            started.elapsed().as_secs_f64(),
            data.train.rows,
            data.test.rows,
            data.features()
        );
        if let Task::Regression { mean, std } = data.task {
            eprintln!(
                "{who}: linreg target is the release year standardized by the training mean {mean:.3} and std {std:.3}; the loss is the MSE in those units (held-out: every tenth row)"
            );
        }
        let model =
            Model::for_task(kind, data.task, data.features(), args.hidden).map_err(refuse)?;
        let eval_idx = strided(data.test.rows, EVAL_CAP);
        if env.num_ps > 0 {
            eprintln!(
                "{who}: parameter-server mode: {} worker(s) and {} shard(s) over {} parameters",
                env.workers(),
                env.num_ps,
                model.num_params()
            );
        }
        let ckpt_dir = env.checkpoint_dir.clone();
        if ckpt_dir.is_none() {
            eprintln!("{who}: CONVERGE_CHECKPOINT_DIR is not set: checkpointing is disabled");
        }
        Ok(Trainer {
            args,
            env,
            stop,
            who,
            data,
            model,
            lr,
            lr0,
            batch,
            adascale,
            per_worker,
            accum_steps,
            grad_stats,
            eval_idx,
            ckpt_dir,
        })
    }

    /// Loads the checkpoint, if any, or initializes fresh state.
    fn initial_state(&self) -> Result<State> {
        let loaded = match &self.ckpt_dir {
            Some(dir) => Checkpoint::read(dir).map_err(refuse)?,
            None => None,
        };
        let Some(ck) = loaded else {
            return Ok(State {
                step: 0,
                samples: 0,
                seed: self.args.seed,
                last_loss: None,
                params: self.model.init(self.args.seed),
                momentum: vec![0.0; self.model.num_params()],
                momentum_fresh: true,
                scaling: SmoothedStats::default(),
            });
        };
        // Generation 0: run by hand, outside a Converge generation (allocators start at 1).
        if self.env.generation > 0 && ck.generation > self.env.generation {
            return Err(Fenced {
                ours: self.env.generation,
                newer: ck.generation,
            }
            .into());
        }
        ck.check_compatible(self.args.dataset, &self.model)
            .map_err(|e| refuse(e.context("incompatible checkpoint")))?;
        if ck.seed != self.args.seed {
            eprintln!(
                "{}: the checkpoint was written with --seed {}; keeping that seed so the data order continues",
                self.who, ck.seed
            );
        }
        Ok(State {
            step: ck.step,
            samples: ck.samples,
            seed: ck.seed,
            last_loss: ck.last_loss,
            params: ck.params,
            momentum: ck.momentum,
            momentum_fresh: true,
            scaling: ck.scaling.unwrap_or_default(),
        })
    }

    fn train(self) -> Result<Outcome> {
        if let Some(algo) = self.args.shadow {
            return self.train_shadow(algo);
        }
        let env = self.env;
        let rank0 = env.rank == 0;
        let ps_mode = env.num_ps > 0;
        // In parameter-server mode only worker 0 reads the checkpoint; the others start
        // from the state the shards relay from it.
        let mut state = if rank0 || !ps_mode {
            self.initial_state()?
        } else {
            State {
                step: 0,
                samples: 0,
                seed: self.args.seed,
                last_loss: None,
                params: Vec::new(),
                momentum: Vec::new(),
                momentum_fresh: false,
                scaling: SmoothedStats::default(),
            }
        };
        let mut sync = Sync::Alone;
        if ps_mode {
            let snap = state.snapshot();
            let init = rank0.then_some(InitState {
                snapshot: &snap,
                lr: self.lr,
                momentum: self.args.momentum,
            });
            let (client, start) = PsWorker::connect(
                &ps_config(self.args, env),
                None,
                self.model.num_params(),
                init,
                self.stop.clone(),
            )
            .context("rendezvous with the parameter servers failed")?;
            if !rank0 && start.seed != self.args.seed {
                eprintln!(
                    "{}: worker 0 runs with seed {}; using it so the data order agrees",
                    self.who, start.seed
                );
            }
            state = State {
                step: start.step,
                samples: start.samples,
                seed: start.seed,
                last_loss: start.last_loss,
                params: start.params,
                momentum_fresh: rank0,
                momentum: start.momentum,
                // Worker 0's, from its checkpoint: parameter-server mode keeps it unchanged.
                scaling: state.scaling,
            };
            sync = Sync::Ps(client);
        } else if env.world_size > 1 {
            let cfg = RingConfig {
                rank: env.rank,
                world_size: env.world_size,
                generation: env.generation,
                master_addr: env.master_addr.clone(),
                master_port: env.master_port,
                rendezvous_timeout: Duration::from_secs_f64(self.args.rendezvous_timeout),
                io_timeout: RING_IO_TIMEOUT,
            };
            let mut r = Ring::connect(&cfg, self.stop.clone()).context("rendezvous failed")?;
            // Every rank starts from rank 0's state, so ranks whose checkpoint directory
            // is not shared with rank 0 still resume consistently.
            broadcast_state(&mut r, &mut state, &self.who)
                .context("broadcasting the initial state failed")?;
            sync = Sync::Ring(r);
        }
        if state.step > 0 {
            eprintln!(
                "{} generation {} resumed from checkpoint at step {} (samples {})",
                self.who, env.generation, state.step, state.samples
            );
        } else {
            eprintln!(
                "{} generation {}: starting at step 0",
                self.who, env.generation
            );
        }
        self.train_loop(state, sync)
    }

    fn train_loop(&self, mut state: State, mut sync: Sync) -> Result<Outcome> {
        let (args, env) = (self.args, self.env);
        let rank0 = env.rank == 0;
        let n_train = self.data.train.rows;
        // The data-parallel world: every rank in ring mode, the workers in PS mode.
        let (per_worker, workers) = (self.per_worker, env.workers());
        let global_batch = (workers * per_worker * (self.accum_steps + 1)) as u64;
        let target_samples = (args.epochs * n_train as f64).ceil() as u64;
        let done =
            |s: &State| s.samples >= target_samples || args.max_steps.is_some_and(|m| s.step >= m);
        let p = self.model.num_params();
        // The buffer holds the gradient sum, then the loss sum, the example count, the stop
        // votes, the sum of the micro-gradients' squared norms and their count, so one
        // all-reduce carries them all.
        let mut buf = vec![0.0; p + 5];
        let mut half = if self.grad_stats {
            vec![0.0; p]
        } else {
            Vec::new()
        };
        let mut stats = StatsWindow::default();
        // The batch the smoothed statistics and AdaScale's gain are measured against.
        let (total, reference) = match self.batch {
            Some(b) => (b.total, b.reference),
            None => (global_batch as usize, global_batch as usize),
        };
        // The gain of the latest step, while AdaScale sets the learning rate.
        let mut adascale_gain: Option<f64> = None;
        if self.adascale && rank0 && state.scaling.estimate().is_some() {
            eprintln!(
                "{}: AdaScale starts from the checkpoint's smoothed gradient statistics ({} steps observed, scale-invariant progress {:.1})",
                self.who, state.scaling.observations, state.scaling.progress
            );
        }
        let mut order = DataOrder::new(state.seed, n_train);
        // Set when a parameter-server shard received a termination signal.
        let mut ps_stop_requested = false;
        let mut window_loss = 0.0;
        let mut window_sync = Duration::ZERO;
        let mut window_steps = 0u64;
        let mut steps_run = 0u64;
        let mut last_ckpt = Instant::now();
        let delay = Duration::from_millis(args.step_delay_ms);
        let checkpoint_every = Duration::from_secs_f64(args.checkpoint_every);

        if done(&state) {
            eprintln!(
                "{}: the job is already complete at step {} (samples {})",
                self.who, state.step, state.samples
            );
        }
        while !done(&state) {
            let stopping = self.stop.load(Ordering::SeqCst) || ps_stop_requested;
            if stopping && matches!(sync, Sync::Alone) {
                return self.terminate(&state, rank0);
            }
            buf.fill(0.0);
            if !stopping {
                let computing = Instant::now();
                // Micro-batch j of the step covers global positions
                // [samples + j·W·b, samples + (j+1)·W·b); this rank takes its slice of each.
                for j in 0..=self.accum_steps {
                    let offset = state.samples + (j * workers * per_worker) as u64;
                    let idx = order.rank_slice(offset, env.rank, per_worker);
                    buf[p] += self.micro_batch(&state.params, &idx, &mut buf, &mut half);
                    buf[p + 1] += idx.len() as f64;
                }
                // Each micro-batch takes the emulated accelerator time, stretched by
                // 1/--gpu-speed; without one, a slower GPU stretches the compute itself.
                let accelerator = if delay.is_zero() {
                    computing.elapsed().mul_f64(1.0 / args.gpu_speed - 1.0)
                } else {
                    (delay * (self.accum_steps as u32 + 1)).div_f64(args.gpu_speed)
                };
                if !accelerator.is_zero() {
                    std::thread::sleep(accelerator);
                }
            } else {
                buf[p + 2] = 1.0;
            }
            // Whether rank 0 checkpoints after this step (decided before it, because in PS
            // mode worker 0 must ask the shards for the momentum along with the step).
            let mut checkpoint_due = None;
            let mean_loss = if let Sync::Ps(client) = &mut sync {
                let next = State {
                    step: state.step + 1,
                    samples: state.samples + global_batch,
                    params: Vec::new(),
                    momentum: Vec::new(),
                    ..state
                };
                let want_state = rank0
                    && self.ckpt_dir.is_some()
                    && (done(&next) || last_ckpt.elapsed() >= checkpoint_every);
                checkpoint_due = Some(want_state);
                let push = if stopping {
                    Push::Stop
                } else {
                    Push::Grad {
                        grad: &buf[..p],
                        loss_sum: buf[p],
                        count: buf[p + 1],
                        want_state,
                    }
                };
                let seq = state.step + 1;
                let sync_started = Instant::now();
                let result = client.step(seq, push, &mut state.params, &mut state.momentum);
                window_sync += sync_started.elapsed();
                match result {
                    Err(e) => return self.sync_failed(&state, e),
                    Ok(StepResult::Stopped { has_state }) => {
                        state.momentum_fresh = rank0 && has_state;
                        if rank0 {
                            eprintln!(
                                "{}: a rank received a termination signal; stopping at step {}",
                                self.who, state.step
                            );
                        }
                        return self.terminate(&state, rank0);
                    }
                    Ok(StepResult::Diverged) => bail!(
                        "training diverged at step {seq} (non-finite gradient); try a smaller --lr"
                    ),
                    Ok(StepResult::Updated {
                        loss_sum,
                        count,
                        has_state,
                        stop_requested,
                    }) => {
                        state.momentum_fresh = rank0 && has_state;
                        ps_stop_requested |= stop_requested;
                        let mean_loss = loss_sum / count;
                        if !mean_loss.is_finite() || state.params.iter().any(|w| !w.is_finite()) {
                            bail!(
                                "training diverged at step {seq} (non-finite loss or parameters); try a smaller --lr"
                            );
                        }
                        mean_loss
                    }
                }
            } else {
                if let Sync::Ring(r) = &mut sync {
                    let sync_started = Instant::now();
                    let result = r.all_reduce_sum(&mut buf);
                    window_sync += sync_started.elapsed();
                    if let Err(e) = result {
                        return self.sync_failed(&state, e);
                    }
                }
                if buf[p + 2] > 0.0 {
                    // Some rank was asked to stop: the step is abandoned on every rank.
                    if rank0 {
                        eprintln!(
                            "{}: a rank received a termination signal; stopping at step {}",
                            self.who, state.step
                        );
                    }
                    return self.terminate(&state, rank0);
                }
                let count = buf[p + 1];
                let mean_loss = buf[p] / count;
                if !mean_loss.is_finite() || buf[..p].iter().any(|g| !g.is_finite()) {
                    bail!(
                        "training diverged at step {} (non-finite loss or gradient); try a smaller --lr",
                        state.step + 1
                    );
                }
                // Every rank holds the same sums, so every rank finds the same estimates,
                // gain and learning rate.
                let gain = if self.grad_stats {
                    let total_sqr: f64 = buf[..p].iter().map(|g| (g / count).powi(2)).sum();
                    let micro = buf[p + 4];
                    let estimate = step_estimate(total_sqr, buf[p + 3] / micro, micro, count);
                    stats.add(estimate);
                    state.scaling.observe(estimate, total, reference);
                    state.scaling.gain(total, reference)
                } else {
                    None
                };
                state.scaling.advance(gain);
                let lr = match gain {
                    Some(g) if self.adascale => {
                        if rank0 && adascale_gain.is_none() {
                            eprintln!(
                                "{}: AdaScale from step {} on: gain {g:.4}, lr {:.6}",
                                self.who,
                                state.step + 1,
                                self.lr0 * g
                            );
                        }
                        adascale_gain = Some(g);
                        self.lr0 * g
                    }
                    _ => {
                        if rank0 && adascale_gain.is_some() {
                            eprintln!(
                                "{}: AdaScale has no statistics at step {}: square-root rule, lr {}",
                                self.who,
                                state.step + 1,
                                self.lr
                            );
                        }
                        adascale_gain = None;
                        self.lr
                    }
                };
                let mu = args.momentum;
                for ((w, m), g) in state
                    .params
                    .iter_mut()
                    .zip(&mut state.momentum)
                    .zip(&buf[..p])
                {
                    *m = mu * *m + g / count;
                    *w -= lr * *m;
                }
                mean_loss
            };
            state.step += 1;
            state.samples += global_batch;
            window_loss += mean_loss;
            window_steps += 1;
            steps_run += 1;

            if !rank0 {
                continue;
            }
            let finished = done(&state);
            if finished || state.step.is_multiple_of(args.log_every) {
                let evaluate =
                    finished || (args.eval_every > 0 && state.step.is_multiple_of(args.eval_every));
                let loss = window_loss / window_steps as f64;
                let sync_s = window_sync.as_secs_f64() / window_steps as f64;
                state.last_loss = Some(loss);
                self.report(&state, loss, evaluate, Some(sync_s), stats.take());
                if evaluate && let Some(g) = adascale_gain {
                    eprintln!(
                        "{}: step {}: AdaScale gain {g:.4}, lr {:.6}, scale-invariant progress {:.1} steps at the reference batch",
                        self.who,
                        state.step,
                        self.lr0 * g,
                        state.scaling.progress
                    );
                }
                window_loss = 0.0;
                window_sync = Duration::ZERO;
                window_steps = 0;
            }
            let due = checkpoint_due.unwrap_or_else(|| last_ckpt.elapsed() >= checkpoint_every);
            if !finished && due {
                if let Err(e) = self.save(&state) {
                    if e.is::<Fenced>() {
                        return Err(e);
                    }
                    eprintln!("{}: warning: periodic checkpoint failed: {e:#}", self.who);
                }
                last_ckpt = Instant::now();
            }
        }
        if rank0 {
            if steps_run == 0 {
                // Nothing was trained in this process (the job was already complete):
                // report the state as it stands.
                let loss = match state.last_loss {
                    Some(l) => l,
                    None => {
                        self.mean_loss(&state.params, &self.data.train, &strided(n_train, EVAL_CAP))
                    }
                };
                self.report(&state, loss, true, None, None);
            }
            self.save(&state).context("final checkpoint failed")?;
        }
        if let Sync::Ps(client) = &mut sync
            && let Err(e) = client.finish(state.step + 1)
        {
            // Training is complete (and checkpointed by worker 0); a shard that is gone
            // by now changes nothing.
            eprintln!(
                "{}: warning: telling the parameter servers that training is complete failed: {e:#}",
                self.who
            );
        }
        Ok(Outcome::Completed)
    }

    fn mean_loss(&self, params: &[f64], split: &Split, idx: &[usize]) -> f64 {
        self.model.loss(params, split, idx) / idx.len() as f64
    }

    /// One micro-batch `idx` of this rank: adds its gradient sum to `buf[..p]` and returns
    /// its loss sum. With gradient statistics it is computed as two halves, each half's
    /// squared mean-gradient norm added to `buf[p + 3]` and counted in `buf[p + 4]`
    /// (`half` is scratch space of `p`).
    fn micro_batch(&self, params: &[f64], idx: &[usize], buf: &mut [f64], half: &mut [f64]) -> f64 {
        let p = params.len();
        if !self.grad_stats {
            return self
                .model
                .loss_and_grad(params, &self.data.train, idx, &mut buf[..p]);
        }
        let (a, b) = idx.split_at(idx.len() / 2);
        let mut loss = 0.0;
        for part in [a, b] {
            if part.is_empty() {
                continue;
            }
            half.fill(0.0);
            loss += self
                .model
                .loss_and_grad(params, &self.data.train, part, half);
            let n = part.len() as f64;
            let mut sqr = 0.0;
            for (g, h) in buf[..p].iter_mut().zip(half.iter()) {
                *g += h;
                sqr += (h / n) * (h / n);
            }
            buf[p + 3] += sqr;
            buf[p + 4] += 1.0;
        }
        loss
    }

    /// Prints a progress line; `sync_s` is the mean synchronization time per step since the
    /// previous line (`None` when no step ran since), `grad` the window's gradient
    /// statistics.
    fn report(
        &self,
        state: &State,
        loss: f64,
        evaluate: bool,
        sync_s: Option<f64>,
        grad: Option<(f64, f64)>,
    ) {
        let eval_loss = evaluate.then(|| {
            round_to(
                self.mean_loss(&state.params, &self.data.test, &self.eval_idx),
                6,
            )
        });
        let line = Progress {
            step: state.step,
            samples: state.samples,
            loss: round_to(loss, 6),
            epoch: round_to(state.samples as f64 / self.data.train.rows as f64, 4),
            eval_loss,
            // Microsecond resolution; a positive time never rounds down to 0.
            sync_s: sync_s.map(|s| {
                if s > 0.0 {
                    round_to(s, 6).max(1e-6)
                } else {
                    0.0
                }
            }),
            model_bytes: model_bytes(self.model.num_params()),
            grad_sqr: grad.map(|(s, _)| significant(s)),
            grad_var: grad.map(|(_, v)| significant(v)),
            sync_rounds_per_s: None,
            model_gap: None,
        }
        .line();
        let mut out = std::io::stdout().lock();
        // A closed stdout must not stop training; the checkpoint still records progress.
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }

    fn save(&self, state: &State) -> Result<()> {
        self.save_with(state, None)
    }

    /// Writes the checkpoint of `state`, with S-BMUF's block velocity if given.
    fn save_with(&self, state: &State, block_velocity: Option<&[f64]>) -> Result<()> {
        let Some(dir) = &self.ckpt_dir else {
            return Ok(());
        };
        if !state.momentum_fresh {
            bail!(
                "the momentum of step {} is on the parameter-server shards; the previous checkpoint stands",
                state.step
            );
        }
        Checkpoint {
            format_version: checkpoint::FORMAT_VERSION,
            dataset: self.args.dataset,
            model: self.model.kind,
            hidden: self.model.hidden,
            step: state.step,
            samples: state.samples,
            last_loss: state.last_loss,
            seed: state.seed,
            world_size: self.env.world_size,
            generation: self.env.generation,
            params: state.params.clone(),
            momentum: state.momentum.clone(),
            block_velocity: block_velocity.map(<[f64]>::to_vec),
            scaling: (state.scaling != SmoothedStats::default()).then_some(state.scaling),
        }
        // Generation fencing at the storage (for processes run by an agent: generation >
        // 0): a checkpoint written by a newer generation means this process is a stale
        // worker (its host was cut off and the job placed elsewhere); it must neither
        // overwrite that checkpoint nor go on training. Checked under the directory's lock.
        .write_fenced(dir)?
        .map_or(Ok(()), |newer| {
            Err(Fenced {
                ours: self.env.generation,
                newer,
            }
            .into())
        })
    }

    /// Stops at a step boundary: rank 0 checkpoints the last completed step.
    fn terminate(&self, state: &State, rank0: bool) -> Result<Outcome> {
        if rank0 {
            match self.save(state) {
                Ok(()) if self.ckpt_dir.is_some() => {
                    eprintln!(
                        "{}: checkpointed step {} (samples {})",
                        self.who, state.step, state.samples
                    )
                }
                Ok(()) => {}
                Err(e) => eprintln!(
                    "{}: error: checkpoint on termination failed: {e:#}",
                    self.who
                ),
            }
        }
        Ok(Outcome::Terminated)
    }

    /// The ring or the parameter servers broke mid-step: rank 0 checkpoints the last
    /// completed step (the failed step never touched the parameters) if it holds all of
    /// its state, then the run ends as terminated or failed.
    fn sync_failed(&self, state: &State, err: anyhow::Error) -> Result<Outcome> {
        let terminating = self.stop.load(Ordering::SeqCst) || err.is::<Interrupted>();
        let ps_mode = self.env.num_ps > 0;
        let what = if ps_mode {
            "parameter-server exchange"
        } else {
            "all-reduce"
        };
        eprintln!(
            "{}: {what} of step {} failed: {err:#}",
            self.who,
            state.step + 1
        );
        if self.env.rank == 0 && self.ckpt_dir.is_some() && !state.momentum_fresh {
            eprintln!(
                "{}: not checkpointing step {}: its momentum was on the parameter-server shards; the previous checkpoint stands",
                self.who, state.step
            );
        } else if self.env.rank == 0 {
            match self.save(state) {
                Ok(()) if self.ckpt_dir.is_some() => eprintln!(
                    "{}: checkpointed the last completed step {} (samples {})",
                    self.who, state.step, state.samples
                ),
                Ok(()) => {}
                Err(e) => eprintln!(
                    "{}: error: checkpoint after the failure failed: {e:#}",
                    self.who
                ),
            }
        }
        if terminating {
            return Ok(Outcome::Terminated);
        }
        if ps_mode {
            return Err(err.context(format!(
                "lost the parameter servers during step {}",
                state.step + 1
            )));
        }
        Err(err.context(format!(
            "a peer failed during step {}; the ring is broken",
            state.step + 1
        )))
    }
}

/// Replaces `state` on every rank with rank 0's, through one all-reduce in which the other
/// ranks contribute zeros (x + 0 is exact, so the copy is bit-identical).
fn broadcast_state(ring: &mut Ring, state: &mut State, who: &str) -> Result<()> {
    let p = state.params.len();
    let mut buf = vec![0.0; 11 + 2 * p];
    let x = 6 + 2 * p;
    if ring.rank() == 0 {
        buf[0] = state.step as f64;
        buf[1] = state.samples as f64;
        buf[2] = (state.seed >> 32) as f64;
        buf[3] = (state.seed & 0xffff_ffff) as f64;
        buf[4] = if state.last_loss.is_some() { 1.0 } else { 0.0 };
        buf[5] = state.last_loss.unwrap_or(0.0);
        buf[6..6 + p].copy_from_slice(&state.params);
        buf[6 + p..x].copy_from_slice(&state.momentum);
        let s = &state.scaling;
        buf[x..].copy_from_slice(&[
            s.sqr_biased,
            s.var_biased,
            s.unbias,
            s.observations as f64,
            s.progress,
        ]);
    }
    ring.all_reduce_sum(&mut buf)?;
    let theirs = State {
        step: buf[0] as u64,
        samples: buf[1] as u64,
        seed: ((buf[2] as u64) << 32) | buf[3] as u64,
        last_loss: (buf[4] > 0.0).then_some(buf[5]),
        params: buf[6..6 + p].to_vec(),
        momentum: buf[6 + p..x].to_vec(),
        momentum_fresh: true,
        scaling: SmoothedStats {
            sqr_biased: buf[x],
            var_biased: buf[x + 1],
            unbias: buf[x + 2],
            observations: buf[x + 3] as u64,
            progress: buf[x + 4],
        },
    };
    if ring.rank() != 0 && (theirs.step != state.step || theirs.samples != state.samples) {
        eprintln!(
            "{who}: using rank 0's state at step {} (samples {}) instead of the local one at step {} (samples {})",
            theirs.step, theirs.samples, state.step, state.samples
        );
    }
    *state = theirs;
    Ok(())
}

/// Bytes of `num_params` parameters as the ranks exchange them (`f64`, 8 bytes each).
pub fn model_bytes(num_params: usize) -> u64 {
    (num_params as u64).saturating_mul(std::mem::size_of::<f64>() as u64)
}

/// At most `cap` indices spread evenly over `0..n`.
fn strided(n: usize, cap: usize) -> Vec<usize> {
    if n <= cap {
        return (0..n).collect();
    }
    (0..cap).map(|i| i * n / cap).collect()
}

/// A checkpoint written by a newer generation of the job was found where this process
/// checkpoints: it belongs to a fenced (stale) generation and stops.
#[derive(Debug)]
pub struct Fenced {
    /// This process's generation (`CONVERGE_GENERATION`).
    pub ours: u64,
    /// The generation that wrote the checkpoint.
    pub newer: u64,
}

impl std::fmt::Display for Fenced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fenced: generation {} wrote the checkpoint, this process is generation {}; it stops without checkpointing",
            self.newer, self.ours
        )
    }
}

impl std::error::Error for Fenced {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line_has_the_contract_format() {
        let p = Progress {
            step: 120,
            samples: 3840,
            loss: 0.53,
            epoch: 0.118,
            eval_loss: Some(0.55),
            sync_s: Some(0.0123),
            model_bytes: 5200,
            grad_sqr: None,
            grad_var: None,
            sync_rounds_per_s: None,
            model_gap: None,
        };
        assert_eq!(
            p.line(),
            r#"CONVERGE_PROGRESS {"step":120,"samples":3840,"loss":0.53,"epoch":0.118,"eval_loss":0.55,"sync_s":0.0123,"model_bytes":5200}"#
        );
        let p = Progress {
            eval_loss: None,
            sync_s: None,
            ..p
        };
        assert_eq!(
            p.line(),
            r#"CONVERGE_PROGRESS {"step":120,"samples":3840,"loss":0.53,"epoch":0.118,"model_bytes":5200}"#
        );
        assert_eq!(model_bytes(650), 5200);
        let p = Progress {
            grad_sqr: Some(0.0153),
            grad_var: Some(2.41),
            ..p
        };
        assert!(
            p.line()
                .ends_with(r#""model_bytes":5200,"grad_sqr":0.0153,"grad_var":2.41}"#),
            "{}",
            p.line()
        );
    }

    #[test]
    fn strided_eval_indices_are_capped_and_spread() {
        assert_eq!(strided(5, 10), vec![0, 1, 2, 3, 4]);
        let s = strided(16_281, EVAL_CAP);
        assert_eq!(s.len(), EVAL_CAP);
        assert!(s.windows(2).all(|w| w[0] < w[1]));
        assert!(*s.last().unwrap() > 16_000);
    }
}

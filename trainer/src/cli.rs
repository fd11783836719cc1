//! Command-line options and the worker environment set by the node agent.

use std::path::PathBuf;

use anyhow::{Context, Result, bail, ensure};
use clap::{Parser, ValueEnum};

use crate::batch::{ContractBatch, LrScaling};
use crate::data::DatasetName;
use crate::model::ModelKind;
use crate::ps::Role;
use crate::shadow::{self, ShadowAlgo};

const ABOUT: &str = "Converge's reference data-parallel trainer: SGD with momentum on real \
datasets, gradients averaged by ring all-reduce or parameter servers over TCP, checkpoint and \
resume at any world size.";

const LONG_ABOUT: &str = "\
Converge's reference data-parallel trainer: SGD with momentum on real datasets, gradients \
averaged by ring all-reduce (default) or by parameter-server shards over TCP, checkpoint and \
resume at any world size and in either mode.

Worker environment (torchrun-compatible, set by the node agent):
  RANK, WORLD_SIZE          this worker's rank and the number of ranks; without WORLD_SIZE
                            the trainer runs alone (rank 0 of 1, no networking)
  MASTER_ADDR, MASTER_PORT  where rank 0 runs the rendezvous (default 127.0.0.1:29500)
  LOCAL_RANK, LOCAL_WORLD_SIZE, CUDA_VISIBLE_DEVICES
                            logged only; the trainer computes on the CPU
  CONVERGE_JOB_ID, CONVERGE_GENERATION
                            job identity; all ranks must be in the same generation
  CONVERGE_CHECKPOINT_DIR   where rank 0 keeps checkpoint.json; every rank resumes from it;
                            without it there is no checkpointing
  CONVERGE_NUM_PS           p >= 1 selects parameter-server mode (unset or 0: ring mode)
  CONVERGE_BATCH_SIZE, CONVERGE_ACCUM_STEPS, CONVERGE_TOTAL_BATCH, CONVERGE_REFERENCE_BATCH
                            the batch the allocator planned for a job with a [batch] table
                            (samples per worker per micro-batch, extra micro-batches per step,
                            samples per step over all workers, the total --lr is tuned for);
                            they override --batch-size, and the learning rate follows
                            --lr-scaling (default adascale: lr = --lr x AdaScale's gain
                            from the smoothed gradient statistics, between 1 and
                            total / reference; see --lr-scaling). Ignored in
                            parameter-server and ShadowSync modes.

Parameter-server mode (CONVERGE_NUM_PS=p): WORLD_SIZE counts every process. Ranks
0..WORLD_SIZE-p are workers (the data-parallel world is WORLD_SIZE-p, the global batch
(WORLD_SIZE-p) x --batch-size); ranks WORLD_SIZE-p..WORLD_SIZE are shards, shard s owning the
s-th of p contiguous, near-equal slices of the flat parameter vector and its momentum. Rank 0
is worker 0: it serves the rendezvous, prints the progress lines and writes the checkpoint, as
in ring mode. Shards listen on an ephemeral port (0.0.0.0) and register it at the rendezvous;
workers reach them at the address rank 0 observed. Each step every worker pushes its gradient
slices to the shards, a shard waits for all workers, averages, applies the SGD-with-momentum
update to its slice and answers with the new slice. Worker 0 hands the shards their slices at
the start (from its checkpoint, or a fresh initialization), so shards read neither the data
nor the checkpoint, and pulls the momentum from them when it checkpoints. On SIGTERM the step
in flight is abandoned on every rank, worker 0 checkpoints the last completed step and all
ranks exit 143; at the end shards exit 0. The checkpoint is the same as in ring mode, so a job
resumes in either mode and at any split of workers and shards. A rank that loses a peer exits 1
(after the I/O timeout of 60 s at most); worker 0 then keeps its last checkpoint, since the
momentum of later steps was on the shards.

ShadowSync mode (--shadow ma|bmuf|easgd; see the trainer's shadow module docs): workers train their own copy of the model with local SGD steps (--hogwild-threads lock-free threads each) and never wait for a peer; a background thread per worker synchronizes the copy round after round: S-MA averages the models by ring all-reduce, S-BMUF applies block momentum (--block-momentum, --block-lr, --block-nesterov) to the average, S-EASGD moves each model and a central copy on CONVERGE_NUM_PS >= 1 shards toward each other (--elastic-alpha). Peers are reached as in ring mode (or parameter-server mode for S-EASGD). A peer that fails or sends malformed data is dropped (logged) and the worker trains on alone. Progress lines add sync_rounds_per_s and model_gap (the relative distance between the local and the synchronized model); sync_s is 0, the step time is a local step's. Started by converge-agent for an arch = \"shadow\" job, the spec's [shadow] table arrives as CONVERGE_SHADOW_ALGORITHM, CONVERGE_SHADOW_BLOCK_MOMENTUM, CONVERGE_SHADOW_BLOCK_LR, CONVERGE_SHADOW_BLOCK_NESTEROV, CONVERGE_SHADOW_ELASTIC_ALPHA and CONVERGE_SHADOW_HOGWILD_THREADS, the defaults of those options (command-line options win).

Rank 0 prints progress lines on stdout:
  CONVERGE_PROGRESS {\"step\":120,\"samples\":3840,\"loss\":0.53,\"epoch\":0.118,\"eval_loss\":0.55,\"sync_s\":0.0021,\"model_bytes\":5200,\"grad_sqr\":0.0153,\"grad_var\":2.41}
sync_s is rank 0's mean time per step in the all-reduce (ring mode) or in the push and pull
of its parameter slices (parameter-server mode) since the previous line, waiting for slower
ranks included; 0 with a single rank. model_bytes is the parameter count x 8 (f64).
grad_sqr (squared norm of the mean gradient) and grad_var (variance of one sample's
gradient, trace of the covariance) are unbiased estimates from the step's micro-gradients
(each worker computes each micro-batch as two halves), averaged since the previous line and
clamped at 0 (ring mode only; --no-grad-stats leaves them out).
Everything else goes to stderr.

Exit codes: 0 finished, 1 failure (for example a peer failed), 2 refused (bad options or
environment, missing data, incompatible checkpoint), 143 terminated by SIGTERM or SIGINT
after checkpointing the last completed step.";

/// Options of `converge-trainer`.
#[derive(Parser, Debug, Clone)]
#[command(name = "converge-trainer", version, about = ABOUT, long_about = LONG_ABOUT)]
pub struct Args {
    /// Dataset to train on, read from --data-dir.
    #[arg(long, value_enum)]
    pub dataset: DatasetName,

    /// Model to train [default: logreg for a9a, linreg for millionsong, softmax for
    /// optdigits, mlp for mnist]. Logreg fits only a9a, linreg only millionsong, softmax and
    /// mlp only optdigits or mnist.
    #[arg(long, value_enum)]
    pub model: Option<ModelKind>,

    /// Folder holding the datasets (a9a/, millionsong/, optdigits/, mnist_subset/).
    #[arg(
        long,
        env = "CONVERGE_DATA_DIR",
        default_value = "data",
        value_name = "DIR"
    )]
    pub data_dir: PathBuf,

    /// Examples per worker per step; the global batch is WORLD_SIZE times this
    /// (WORLD_SIZE - CONVERGE_NUM_PS times this in parameter-server mode). CONVERGE_BATCH_SIZE
    /// overrides it.
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub batch_size: usize,

    /// How the learning rate follows the planned total batch (CONVERGE_TOTAL_BATCH) when
    /// --lr was tuned at CONVERGE_REFERENCE_BATCH. adascale: lr x gain, AdaScale's gain
    /// (grad_var/reference + grad_sqr) / (grad_var/total + grad_sqr) from AdaptDL's smoothed
    /// gradient statistics (grad_var per sample), every step, between 1 (exact gradients)
    /// and total/reference (all noise); a step without statistics (--no-grad-stats, or a
    /// batch of one sample) uses the square-root rule, which the log says. The statistics
    /// are kept in the checkpoint, so a new generation continues with them; the log shows
    /// AdaScale's scale-invariant progress (the sum of the gains, in steps at the reference
    /// batch), which the stop rule does not use: --epochs and --max-steps count samples and
    /// steps. sqrt: lr x sqrt(total/reference); linear: lr x total/reference; none: lr.
    #[arg(long, value_enum, default_value_t = LrScaling::AdaScale)]
    pub lr_scaling: LrScaling,

    /// Leave the gradient statistics (grad_sqr, grad_var) out of the progress lines: a job
    /// with a `[batch]` table then keeps its reference batch.
    #[arg(long)]
    pub no_grad_stats: bool,

    /// Learning rate [default: 0.05 for logreg, 0.01 for linreg, 0.05 for softmax, 0.02 for
    /// mlp].
    #[arg(long, value_name = "RATE")]
    pub lr: Option<f64>,

    /// SGD momentum coefficient, in [0, 1).
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,

    /// Hidden units of the mlp model (ignored by the other models).
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub hidden: usize,

    /// Seed of the data order and of the mlp initialization. A resumed job keeps the seed
    /// stored in its checkpoint.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Stop once the job has processed this many passes over the training set, counted
    /// in samples from the job's beginning (fractions allowed).
    #[arg(long, default_value_t = 5.0, value_name = "E")]
    pub epochs: f64,

    /// Also stop once the job reaches this step, counted from the job's beginning.
    #[arg(long, value_name = "N")]
    pub max_steps: Option<u64>,

    /// Print a progress line every this many steps, with the mean training loss since the
    /// previous line.
    #[arg(long, default_value_t = 10, value_name = "STEPS")]
    pub log_every: u64,

    /// Add the held-out loss (at most 2,000 held-out rows) to the progress line every this
    /// many steps; 0 evaluates only at the end.
    #[arg(long, default_value_t = 100, value_name = "STEPS")]
    pub eval_every: u64,

    /// Seconds between periodic checkpoints written by rank 0; 0 checkpoints after every
    /// step.
    #[arg(long, default_value_t = 15.0, value_name = "SECONDS")]
    pub checkpoint_every: f64,

    /// Emulated accelerator time per step in milliseconds, slept after computing the
    /// gradient. For clusters with fake GPUs: on a machine without GPUs it lets many
    /// workers share a few cores and makes throughput scale with the number of workers as
    /// it would with real GPUs.
    #[arg(long, default_value_t = 0, value_name = "MS")]
    pub step_delay_ms: u64,

    /// The GPU's speed as a fraction of this machine's, in (0, 1]: each step's accelerator
    /// time (the --step-delay-ms sleep, or without one the measured compute) is stretched
    /// by 1/speed. Agents with fake GPUs of a slower type set it (`--fake-gpu-speed`), so
    /// that a local cluster mixes GPU generations; 1 on real GPUs.
    #[arg(long, env = "CONVERGE_GPU_SPEED", default_value_t = 1.0, value_name = "FRACTION",
          value_parser = parse_speed)]
    pub gpu_speed: f64,

    /// Seconds to wait for all ranks to join the rendezvous and connect the ring (or the
    /// workers to the parameter-server shards).
    #[arg(long, default_value_t = 120.0, value_name = "SECONDS")]
    pub rendezvous_timeout: f64,

    /// ShadowSync: synchronize in a background thread with this algorithm instead of in
    /// every step: ma (model averaging, S-MA), bmuf (block momentum, S-BMUF) or easgd
    /// (elastic averaging against the CONVERGE_NUM_PS shards, S-EASGD).
    #[arg(
        long,
        value_enum,
        value_name = "ALGORITHM",
        env = "CONVERGE_SHADOW_ALGORITHM"
    )]
    pub shadow: Option<ShadowAlgo>,

    /// S-BMUF block momentum η, in [0, 1) [default: min(1 - 1/workers, 0.5); fairseq and
    /// CNTK use 1 - 1/workers for blocks of many local steps].
    #[arg(long, value_name = "ETA", env = "CONVERGE_SHADOW_BLOCK_MOMENTUM")]
    pub block_momentum: Option<f64>,

    /// S-BMUF block learning rate ζ (> 0) [default: 1 - η, so that the block step's gain
    /// ζ / (1 - η) is 1; fairseq's and CNTK's ζ = 1 amplifies the step 1/(1 - η)-fold, which
    /// diverged in the measurements of docs/communication.md with a round every few local
    /// steps].
    #[arg(long, value_name = "ZETA", env = "CONVERGE_SHADOW_BLOCK_LR")]
    pub block_lr: Option<f64>,

    /// S-BMUF: workers restart each block from x + η v (Nesterov block momentum).
    #[arg(long, env = "CONVERGE_SHADOW_BLOCK_NESTEROV")]
    pub block_nesterov: bool,

    /// S-EASGD moving rate α, in (0, 1] [default: 0.9 / workers].
    #[arg(long, value_name = "ALPHA", env = "CONVERGE_SHADOW_ELASTIC_ALPHA")]
    pub elastic_alpha: Option<f64>,

    /// S-EASGD: the paper's plain elastic step at the shards. By default the central copy
    /// also takes 1/W of each worker's local progress since its previous round, so that the
    /// job keeps the synchronous pace; the plain step spreads the workers' steps over W + 1
    /// copies (W / (W + 1) of the pace, measured in docs/communication.md). For comparison.
    #[arg(long)]
    pub elastic_plain: bool,

    /// ShadowSync: training threads per worker updating its model lock-free (Hogwild).
    #[arg(
        long,
        default_value_t = 1,
        value_name = "N",
        env = "CONVERGE_SHADOW_HOGWILD_THREADS"
    )]
    pub hogwild_threads: usize,

    /// ShadowSync: least time between two synchronization rounds of a worker's background
    /// thread (0: back to back).
    #[arg(long, default_value_t = 0, value_name = "MS")]
    pub sync_interval_ms: u64,
}

impl Args {
    /// The model to train: `--model`, or the dataset's default.
    pub fn model_kind(&self) -> ModelKind {
        self.model.unwrap_or(ModelKind::default_for(self.dataset))
    }

    /// The learning rate: `--lr`, or the model's default.
    pub fn learning_rate(&self) -> f64 {
        self.lr.unwrap_or(self.model_kind().default_lr())
    }

    /// Refuses options that make no sense.
    pub fn validate(&self) -> Result<()> {
        self.model_kind().check_pair(self.dataset)?;
        ensure!(self.batch_size >= 1, "--batch-size must be at least 1");
        let lr = self.learning_rate();
        ensure!(
            lr.is_finite() && lr > 0.0,
            "--lr must be a positive number, not {lr}"
        );
        ensure!(
            (0.0..1.0).contains(&self.momentum),
            "--momentum must be in [0, 1), not {}",
            self.momentum
        );
        ensure!(
            self.epochs.is_finite() && self.epochs > 0.0,
            "--epochs must be a positive number, not {}",
            self.epochs
        );
        ensure!(self.log_every >= 1, "--log-every must be at least 1");
        ensure!(
            self.checkpoint_every.is_finite() && self.checkpoint_every >= 0.0,
            "--checkpoint-every must be a non-negative number of seconds"
        );
        ensure!(
            self.rendezvous_timeout.is_finite() && self.rendezvous_timeout > 0.0,
            "--rendezvous-timeout must be a positive number of seconds"
        );
        if self.model_kind() == ModelKind::Mlp {
            ensure!(self.hidden >= 1, "--hidden must be at least 1");
        }
        self.validate_shadow()
    }

    /// Refuses ShadowSync options out of range or without their algorithm.
    fn validate_shadow(&self) -> Result<()> {
        if let Some(eta) = self.block_momentum {
            shadow::check_block_momentum(eta)?;
        }
        if let Some(alpha) = self.elastic_alpha {
            shadow::check_alpha(alpha)?;
        }
        if let Some(zeta) = self.block_lr {
            ensure!(
                zeta.is_finite() && zeta > 0.0,
                "--block-lr must be a positive number, not {zeta}"
            );
        }
        ensure!(
            (1..=64).contains(&self.hogwild_threads),
            "--hogwild-threads must be in 1..=64, not {}",
            self.hogwild_threads
        );
        let algo = self.shadow;
        let bmuf_only =
            self.block_momentum.is_some() || self.block_lr.is_some() || self.block_nesterov;
        ensure!(
            !bmuf_only || algo == Some(ShadowAlgo::Bmuf),
            "--block-momentum, --block-lr and --block-nesterov apply to --shadow bmuf only"
        );
        ensure!(
            (self.elastic_alpha.is_none() && !self.elastic_plain)
                || algo == Some(ShadowAlgo::Easgd),
            "--elastic-alpha and --elastic-plain apply to --shadow easgd only"
        );
        ensure!(
            algo.is_some() || (self.hogwild_threads == 1 && self.sync_interval_ms == 0),
            "--hogwild-threads and --sync-interval-ms apply to --shadow only"
        );
        Ok(())
    }

    /// Refuses a ShadowSync algorithm that does not fit the job's ranks.
    pub fn check_shadow_env(&self, env: &WorkerEnv) -> Result<()> {
        match self.shadow {
            Some(ShadowAlgo::Easgd) => ensure!(
                env.num_ps >= 1,
                "--shadow easgd keeps the central copy on parameter-server shards: set CONVERGE_NUM_PS to 1 or more (WORLD_SIZE counts the workers and the shards)"
            ),
            Some(a @ (ShadowAlgo::Ma | ShadowAlgo::Bmuf)) => ensure!(
                env.num_ps == 0,
                "--shadow {} synchronizes the workers among themselves: unset CONVERGE_NUM_PS (it is {}) or use --shadow easgd",
                a.to_possible_value()
                    .map(|v| v.get_name().to_string())
                    .unwrap_or_default(),
                env.num_ps
            ),
            None => {}
        }
        Ok(())
    }
}

/// The worker contract's environment variables.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerEnv {
    /// `RANK` (0 when running alone).
    pub rank: usize,
    /// `WORLD_SIZE` (1 when unset).
    pub world_size: usize,
    /// `LOCAL_RANK`, if set.
    pub local_rank: Option<String>,
    /// `LOCAL_WORLD_SIZE`, if set.
    pub local_world_size: Option<String>,
    /// `MASTER_ADDR` (default 127.0.0.1).
    pub master_addr: String,
    /// `MASTER_PORT` (default 29500).
    pub master_port: u16,
    /// `CUDA_VISIBLE_DEVICES`, if set.
    pub cuda_visible_devices: Option<String>,
    /// `CONVERGE_JOB_ID`, if set.
    pub job_id: Option<String>,
    /// `CONVERGE_GENERATION` (0 when unset).
    pub generation: u64,
    /// `CONVERGE_CHECKPOINT_DIR`; no checkpointing when unset.
    pub checkpoint_dir: Option<PathBuf>,
    /// `CONVERGE_NUM_PS`: parameter-server shards among the `world_size` ranks (0, the
    /// default, is ring mode).
    pub num_ps: usize,
    /// The planned batch (`CONVERGE_BATCH_SIZE` and the rest), when set.
    pub batch: Option<ContractBatch>,
}

impl WorkerEnv {
    /// Reads the process environment.
    pub fn from_process() -> Result<WorkerEnv> {
        WorkerEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get`; empty values count as unset.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<WorkerEnv> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        fn parse<T: std::str::FromStr>(name: &str, v: &str) -> Result<T>
        where
            T::Err: std::error::Error + Send + Sync + 'static,
        {
            v.trim()
                .parse()
                .with_context(|| format!("{name}={v:?} is not a valid number"))
        }
        let (rank, world_size) = match get("WORLD_SIZE") {
            None => (0, 1),
            Some(w) => {
                let world: usize = parse("WORLD_SIZE", &w)?;
                ensure!(world >= 1, "WORLD_SIZE must be at least 1");
                let rank: usize = match get("RANK") {
                    Some(r) => parse("RANK", &r)?,
                    None if world == 1 => 0,
                    None => bail!("WORLD_SIZE={world} is set but RANK is not"),
                };
                ensure!(rank < world, "RANK={rank} is not below WORLD_SIZE={world}");
                (rank, world)
            }
        };
        let master_port = match get("MASTER_PORT") {
            Some(p) => parse("MASTER_PORT", &p)?,
            None => 29500,
        };
        let generation = match get("CONVERGE_GENERATION") {
            Some(g) => parse("CONVERGE_GENERATION", &g)?,
            None => 0,
        };
        let num_ps: usize = match get("CONVERGE_NUM_PS") {
            Some(p) => parse("CONVERGE_NUM_PS", &p)?,
            None => 0,
        };
        ensure!(
            num_ps < world_size,
            "CONVERGE_NUM_PS={num_ps} leaves no worker among WORLD_SIZE={world_size} ranks: WORLD_SIZE counts workers and parameter-server shards"
        );
        let batch = ContractBatch::from_lookup(get, world_size - num_ps)?;
        Ok(WorkerEnv {
            rank,
            world_size,
            local_rank: get("LOCAL_RANK"),
            local_world_size: get("LOCAL_WORLD_SIZE"),
            master_addr: get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".to_string()),
            master_port,
            cuda_visible_devices: get("CUDA_VISIBLE_DEVICES"),
            job_id: get("CONVERGE_JOB_ID"),
            generation,
            checkpoint_dir: get("CONVERGE_CHECKPOINT_DIR").map(PathBuf::from),
            num_ps,
            batch,
        })
    }

    /// The number of data-parallel workers: `WORLD_SIZE - CONVERGE_NUM_PS`.
    pub fn workers(&self) -> usize {
        self.world_size - self.num_ps
    }

    /// This rank's role.
    pub fn role(&self) -> Role {
        Role::of(self.rank, self.world_size, self.num_ps)
    }
}

/// `--gpu-speed`: a number in (0, 1].
fn parse_speed(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("{text:?} is not a speed in (0, 1]")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<WorkerEnv> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        WorkerEnv::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn without_world_size_the_worker_runs_alone() {
        let e = env(&[("RANK", "3")]).unwrap();
        assert_eq!((e.rank, e.world_size, e.generation), (0, 1, 0));
        assert_eq!(e.checkpoint_dir, None);
    }

    #[test]
    fn the_contract_variables_are_read() {
        let e = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.5"),
            ("MASTER_PORT", "29400"),
            ("CONVERGE_GENERATION", "3"),
            ("CONVERGE_CHECKPOINT_DIR", "/ckpt/job-1"),
            ("CONVERGE_JOB_ID", "job-1"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.master_port, e.generation),
            (1, 4, 29400, 3)
        );
        assert_eq!(e.master_addr, "10.0.0.5");
        assert_eq!(e.checkpoint_dir, Some(PathBuf::from("/ckpt/job-1")));
        assert_eq!(e.job_id.as_deref(), Some("job-1"));
        assert_eq!(e.batch, None);
        let e = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("CONVERGE_BATCH_SIZE", "8"),
            ("CONVERGE_ACCUM_STEPS", "2"),
            ("CONVERGE_TOTAL_BATCH", "96"),
            ("CONVERGE_REFERENCE_BATCH", "32"),
        ])
        .unwrap();
        assert_eq!(e.batch.unwrap().total, 96);
        assert!(
            env(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "4"),
                ("CONVERGE_BATCH_SIZE", "8"),
                ("CONVERGE_TOTAL_BATCH", "64"),
            ])
            .is_err()
        );
    }

    #[test]
    fn bad_contract_values_are_refused() {
        assert!(env(&[("WORLD_SIZE", "2")]).is_err());
        assert!(env(&[("WORLD_SIZE", "2"), ("RANK", "2")]).is_err());
        assert!(env(&[("WORLD_SIZE", "two"), ("RANK", "0")]).is_err());
        assert!(env(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "70000")]).is_err());
        assert!(env(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("CONVERGE_NUM_PS", "2")]).is_err());
        assert!(env(&[("CONVERGE_NUM_PS", "1")]).is_err());
        assert!(
            env(&[
                ("WORLD_SIZE", "2"),
                ("RANK", "0"),
                ("CONVERGE_NUM_PS", "-1")
            ])
            .is_err()
        );
    }

    #[test]
    fn parameter_server_roles() {
        let e = env(&[("WORLD_SIZE", "3"), ("RANK", "0")]).unwrap();
        assert_eq!((e.num_ps, e.workers()), (0, 3));
        assert_eq!(
            e.role(),
            Role::Worker {
                index: 0,
                workers: 3
            }
        );
        let e = env(&[("WORLD_SIZE", "3"), ("RANK", "0"), ("CONVERGE_NUM_PS", "0")]).unwrap();
        assert_eq!(e.num_ps, 0);
        let ps = |rank: &str, p: &str| {
            env(&[("WORLD_SIZE", "5"), ("RANK", rank), ("CONVERGE_NUM_PS", p)])
                .unwrap()
                .role()
        };
        assert_eq!(
            ps("0", "2"),
            Role::Worker {
                index: 0,
                workers: 3
            }
        );
        assert_eq!(
            ps("2", "2"),
            Role::Worker {
                index: 2,
                workers: 3
            }
        );
        assert_eq!(
            ps("3", "2"),
            Role::Shard {
                index: 0,
                shards: 2
            }
        );
        assert_eq!(
            ps("4", "2"),
            Role::Shard {
                index: 1,
                shards: 2
            }
        );
        assert_eq!(
            ps("4", "4"),
            Role::Shard {
                index: 3,
                shards: 4
            }
        );
    }

    #[test]
    fn defaults_and_pair_checks() {
        let a = Args::try_parse_from(["converge-trainer", "--dataset", "mnist"]).unwrap();
        assert_eq!(a.model_kind(), ModelKind::Mlp);
        assert_eq!(
            (a.batch_size, a.hidden, a.seed, a.log_every, a.eval_every),
            (32, 64, 1, 10, 100)
        );
        assert_eq!((a.momentum, a.epochs, a.checkpoint_every), (0.9, 5.0, 15.0));
        assert_eq!(a.lr_scaling, LrScaling::AdaScale);
        a.validate().unwrap();
        let a = Args::try_parse_from(["converge-trainer", "--dataset", "a9a", "--model", "mlp"])
            .unwrap();
        let err = a.validate().unwrap_err().to_string();
        assert!(err.contains("logreg is for a9a"), "{err}");
        assert!(Args::try_parse_from(["converge-trainer"]).is_err());
        assert!(Args::try_parse_from(["converge-trainer", "--dataset", "cifar"]).is_err());
    }

    #[test]
    fn shadow_options_are_checked() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["converge-trainer", "--dataset", "optdigits"];
            argv.extend_from_slice(extra);
            Args::try_parse_from(argv).unwrap()
        };
        let err = |extra: &[&str]| parse(extra).validate().unwrap_err().to_string();
        parse(&["--shadow", "bmuf", "--block-momentum", "0.5"])
            .validate()
            .unwrap();
        parse(&["--shadow", "easgd", "--elastic-alpha", "1"])
            .validate()
            .unwrap();
        for bad in ["1", "1.5", "-0.1", "NaN"] {
            let e = err(&["--shadow", "bmuf", &format!("--block-momentum={bad}")]);
            assert!(e.contains("--block-momentum must be in [0, 1)"), "{e}");
        }
        for bad in ["0", "1.01", "-1", "inf"] {
            let e = err(&["--shadow", "easgd", &format!("--elastic-alpha={bad}")]);
            assert!(e.contains("--elastic-alpha must be in (0, 1]"), "{e}");
        }
        assert!(err(&["--shadow", "ma", "--block-momentum", "0.5"]).contains("bmuf only"));
        assert!(err(&["--elastic-alpha", "0.5"]).contains("easgd only"));
        assert!(err(&["--shadow", "ma", "--elastic-plain"]).contains("easgd only"));
        parse(&["--shadow", "easgd", "--elastic-plain"])
            .validate()
            .unwrap();
        assert!(err(&["--hogwild-threads", "2"]).contains("--shadow only"));
        assert!(err(&["--shadow", "ma", "--hogwild-threads", "0"]).contains("1..=64"));
        let ps = env(&[("WORLD_SIZE", "3"), ("RANK", "0"), ("CONVERGE_NUM_PS", "1")]).unwrap();
        let ring = env(&[("WORLD_SIZE", "3"), ("RANK", "0")]).unwrap();
        let e = parse(&["--shadow", "easgd"])
            .check_shadow_env(&ring)
            .unwrap_err()
            .to_string();
        assert!(e.contains("CONVERGE_NUM_PS to 1 or more"), "{e}");
        parse(&["--shadow", "easgd"]).check_shadow_env(&ps).unwrap();
        let e = parse(&["--shadow", "ma"])
            .check_shadow_env(&ps)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unset CONVERGE_NUM_PS"), "{e}");
    }

    /// The worker contract's table (`converge_common::contract::VARIABLES`; this crate does
    /// not depend on converge-common) as the checked-in JSON the Python kit reads, which
    /// converge-common's tests keep equal to the table: (name, when, required).
    fn contract_table() -> Vec<(String, String, bool)> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../python/converge_worker/contract_variables.json");
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        json["variables"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| {
                (
                    v["name"].as_str().unwrap().to_string(),
                    v["when"].as_str().unwrap().to_string(),
                    v["required"].as_bool().unwrap(),
                )
            })
            .collect()
    }

    /// Variables the trainer reads that are not the agent's: the datasets' folder
    /// (`--data-dir`), which workers inherit from the agent's environment (`--worker-env`).
    const NOT_THE_AGENTS: [&str; 1] = ["CONVERGE_DATA_DIR"];

    /// Every variable the trainer reads (through [`WorkerEnv`], its batch, and its options'
    /// `env` fallbacks) or names in its `--help` is in the worker contract's table, and it
    /// reads every variable a program may require and every batch, shadow and GPU-speed one.
    #[test]
    fn the_trainer_reads_the_worker_contract_by_the_tables_names() {
        use clap::CommandFactory;
        use std::cell::RefCell;
        use std::collections::BTreeSet;
        let table = contract_table();
        let in_table = |name: &str| table.iter().any(|(n, _, _)| n == name);
        // A parameter-server job's worker environment with a planned batch, so that every
        // lookup happens.
        let full: HashMap<&str, &str> = [
            ("RANK", "1"),
            ("WORLD_SIZE", "3"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.5"),
            ("MASTER_PORT", "29400"),
            ("CUDA_VISIBLE_DEVICES", "0"),
            ("CONVERGE_JOB_ID", "job-1"),
            ("CONVERGE_GENERATION", "3"),
            ("CONVERGE_CHECKPOINT_DIR", "/ckpt/job-1"),
            ("CONVERGE_NUM_PS", "1"),
            ("CONVERGE_BATCH_SIZE", "8"),
            ("CONVERGE_ACCUM_STEPS", "1"),
            ("CONVERGE_TOTAL_BATCH", "32"),
            ("CONVERGE_REFERENCE_BATCH", "16"),
        ]
        .into_iter()
        .collect();
        let asked = RefCell::new(BTreeSet::new());
        WorkerEnv::from_lookup(|k| {
            asked.borrow_mut().insert(k.to_string());
            full.get(k).map(|v| v.to_string())
        })
        .unwrap();
        let mut read = asked.into_inner();
        read.extend(
            Args::command()
                .get_arguments()
                .filter_map(|a| a.get_env())
                .map(|e| e.to_str().unwrap().to_string()),
        );
        for name in &read {
            assert!(
                in_table(name) || NOT_THE_AGENTS.contains(&name.as_str()),
                "the trainer reads {name}, which is not in the worker contract's table \
                 (common/src/contract.rs)"
            );
        }
        for (name, when, required) in &table {
            let needed = *required
                || ["batch", "shadow", "shadow_parameter", "fake_gpu_speed"]
                    .contains(&when.as_str());
            assert!(
                !needed || read.contains(name),
                "the trainer does not read the contract's {name} ({when})"
            );
        }
        // Its --help names the contract's variables only, and every one it reads from the
        // environment directly.
        let named: BTreeSet<&str> = LONG_ABOUT
            .split(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .filter(|w| w.contains('_') && w.starts_with(|c: char| c.is_ascii_uppercase()))
            .collect();
        for name in &named {
            // CONVERGE_PROGRESS: the progress lines' prefix, not a variable.
            assert!(
                in_table(name) || *name == "CONVERGE_PROGRESS",
                "--help names {name}, not in the contract"
            );
        }
        for name in full.keys() {
            assert!(
                named.contains(name) || !name.contains('_') && LONG_ABOUT.contains(name),
                "--help does not describe {name}"
            );
        }
    }
}

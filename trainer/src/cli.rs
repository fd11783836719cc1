//! Command-line options and the worker environment set by the node agent.

use std::path::PathBuf;

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;

use crate::data::DatasetName;
use crate::model::ModelKind;

const ABOUT: &str = "Converge's reference data-parallel trainer: SGD with momentum on real \
datasets, gradients averaged by ring all-reduce over TCP, checkpoint and resume at any world size.";

const LONG_ABOUT: &str = "\
Converge's reference data-parallel trainer: SGD with momentum on real datasets, gradients \
averaged by ring all-reduce over TCP, checkpoint and resume at any world size.

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

Rank 0 prints progress lines on stdout:
  CONVERGE_PROGRESS {\"step\":120,\"samples\":3840,\"loss\":0.53,\"epoch\":0.118,\"eval_loss\":0.55}
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

    /// Examples per worker per step; the global batch is WORLD_SIZE times this.
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub batch_size: usize,

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

    /// Seconds to wait for all ranks to join the rendezvous and connect the ring.
    #[arg(long, default_value_t = 120.0, value_name = "SECONDS")]
    pub rendezvous_timeout: f64,
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
        })
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
    }

    #[test]
    fn bad_contract_values_are_refused() {
        assert!(env(&[("WORLD_SIZE", "2")]).is_err());
        assert!(env(&[("WORLD_SIZE", "2"), ("RANK", "2")]).is_err());
        assert!(env(&[("WORLD_SIZE", "two"), ("RANK", "0")]).is_err());
        assert!(env(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "70000")]).is_err());
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
        a.validate().unwrap();
        let a = Args::try_parse_from(["converge-trainer", "--dataset", "a9a", "--model", "mlp"])
            .unwrap();
        let err = a.validate().unwrap_err().to_string();
        assert!(err.contains("logreg is for a9a"), "{err}");
        assert!(Args::try_parse_from(["converge-trainer"]).is_err());
        assert!(Args::try_parse_from(["converge-trainer", "--dataset", "cifar"]).is_err());
    }
}

//! Checkpoints: the training state in `checkpoint.json`, written atomically.
//!
//! Generation fencing ([`Checkpoint::write_fenced`]): a process of an older generation of
//! the job must not overwrite a newer generation's checkpoint. The check and the write
//! happen under an exclusive lock on `.checkpoint.json.lock` in the directory (`flock`;
//! NFS clients carry it to the server as a POSIX lock; the Python kit locks `.<name>.lock`
//! the same way), so a stale writer that passed its check cannot rename over a checkpoint
//! written in between.
//!
//! Rank 0 writes a temporary file in the checkpoint directory, flushes it to disk, renames
//! it over `checkpoint.json` and syncs the directory, so a reader sees either the old or
//! the new checkpoint, never a torn one. Rank 0 reads it on start and hands its state to
//! the others (by broadcast in ring mode, through the shards in parameter-server mode), so
//! all ranks begin with identical parameters at any world size. Both modes write and read
//! the same format: a job resumes in either mode.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use serde::{Deserialize, Serialize};

use crate::batch::SmoothedStats;
use crate::data::DatasetName;
use crate::model::{Model, ModelKind};

/// The checkpoint file name inside `CONVERGE_CHECKPOINT_DIR`.
pub const FILE_NAME: &str = "checkpoint.json";
/// Version of the checkpoint format written by this trainer.
pub const FORMAT_VERSION: u32 = 1;

/// Everything needed to continue a job exactly where it stopped.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Format version ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// Dataset trained on.
    pub dataset: DatasetName,
    /// Model trained.
    pub model: ModelKind,
    /// Hidden units (0 for models without a hidden layer).
    pub hidden: usize,
    /// Optimizer steps completed since the job began.
    pub step: u64,
    /// Training samples consumed since the job began.
    pub samples: u64,
    /// The most recently reported training loss, if any.
    #[serde(default)]
    pub last_loss: Option<f64>,
    /// The seed the data order and initialization came from.
    pub seed: u64,
    /// World size of the generation that wrote this checkpoint (informational).
    pub world_size: usize,
    /// Generation that wrote this checkpoint (informational).
    pub generation: u64,
    /// The flat parameter vector.
    pub params: Vec<f64>,
    /// The SGD momentum buffer, same length as `params`.
    pub momentum: Vec<f64>,
    /// S-BMUF's block velocity, same length as `params`, when a ShadowSync S-BMUF job wrote
    /// the checkpoint ([`crate::shadow`]); other modes ignore it and write none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_velocity: Option<Vec<f64>>,
    /// The smoothed gradient statistics and AdaScale's scale-invariant progress
    /// ([`SmoothedStats`]), when the job has any: a resumed AdaScale job keeps its gain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<SmoothedStats>,
}

/// The lock file of the checkpoint in a directory ([`lock`]).
pub const LOCK_NAME: &str = ".checkpoint.json.lock";

/// Takes the exclusive lock of the checkpoint in `dir` (creating `dir`, and the lock file
/// with mode 0600 when missing), waiting while another writer holds it; released when the
/// returned file is dropped. `Err`: the directory or the lock file cannot be made or
/// locked.
pub fn lock(dir: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::create_dir_all(dir)
        .with_context(|| format!("cannot create checkpoint directory {}", dir.display()))?;
    let path = dir.join(LOCK_NAME);
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot open the checkpoint lock {}", path.display()))?;
    file.lock()
        .with_context(|| format!("cannot lock {}", path.display()))?;
    Ok(file)
}

/// The checkpoint's path inside `dir`.
pub fn path_in(dir: &Path) -> PathBuf {
    dir.join(FILE_NAME)
}

impl Checkpoint {
    /// Refuses a checkpoint written for another dataset, model or parameter shape.
    pub fn check_compatible(&self, dataset: DatasetName, model: &Model) -> Result<()> {
        ensure!(
            self.format_version == FORMAT_VERSION,
            "checkpoint format version {} is not the supported version {FORMAT_VERSION}",
            self.format_version
        );
        if self.dataset != dataset || self.model != model.kind || self.hidden != model.hidden {
            bail!(
                "the checkpoint is for --dataset {} --model {} (hidden {}), but this run is --dataset {dataset} --model {} (hidden {})",
                self.dataset,
                self.model,
                self.hidden,
                model.kind,
                model.hidden
            );
        }
        let n = model.num_params();
        ensure!(
            self.params.len() == n && self.momentum.len() == n,
            "the checkpoint holds {} parameters and {} momentum values, but the model has {n} parameters",
            self.params.len(),
            self.momentum.len()
        );
        if let Some(v) = &self.block_velocity {
            ensure!(
                v.len() == n,
                "the checkpoint holds {} block-velocity values, but the model has {n} parameters",
                v.len()
            );
        }
        ensure!(
            self.params
                .iter()
                .chain(&self.momentum)
                .chain(self.block_velocity.iter().flatten())
                .all(|v| v.is_finite()),
            "the checkpoint holds non-finite values"
        );
        ensure!(
            self.scaling.is_none_or(|s| s.is_valid()),
            "the checkpoint's smoothed gradient statistics are out of range"
        );
        Ok(())
    }

    /// Writes the checkpoint's JSON and a newline to `out` through a 64 KiB buffer.
    /// serde_json writes every token on its own: unbuffered, that is one `write` system
    /// call per number and punctuation mark, and the 2 MB checkpoint of `mnist-mlp` took
    /// 11.6 s to write on fuse-overlayfs (a container's root file system), where a small
    /// write costs about 50 µs; the job's rank 0 then held up every stop and resize.
    fn write_json<W: Write>(&self, out: W) -> Result<()> {
        let mut out = BufWriter::with_capacity(1 << 16, out);
        serde_json::to_writer(&mut out, self)?;
        out.write_all(b"\n")?;
        out.flush()?;
        Ok(())
    }

    /// Writes `dir/checkpoint.json` atomically, creating `dir` if needed.
    pub fn write_atomic(&self, dir: &Path) -> Result<()> {
        fs::create_dir_all(dir)
            .with_context(|| format!("cannot create checkpoint directory {}", dir.display()))?;
        let target = path_in(dir);
        // A unique name, created exclusively (`.checkpoint.json.tmp.<random>`): writers on
        // shared storage never share a temporary file, even with equal process ids on
        // different hosts. Removed when dropped unless persisted.
        let result = (|| -> Result<()> {
            let mut tmp = tempfile::Builder::new()
                .prefix(&format!(".{FILE_NAME}.tmp."))
                .tempfile_in(dir)?;
            self.write_json(tmp.as_file_mut())?;
            tmp.as_file().sync_all()?;
            tmp.persist(&target).map_err(|e| e.error)?;
            // Make the rename itself durable.
            File::open(dir)?.sync_all()?;
            Ok(())
        })();
        result.with_context(|| format!("cannot write checkpoint {}", target.display()))
    }

    /// Writes the checkpoint unless `dir` holds one of a newer generation than
    /// `self.generation` (when that is above 0: generation 0, a run by hand, is never
    /// fenced): the check and the write under the directory's [`lock`]. `Ok(Some(newer))`:
    /// fenced by generation `newer`, nothing written. A corrupt existing checkpoint says
    /// nothing about generations and is overwritten.
    pub fn write_fenced(&self, dir: &Path) -> Result<Option<u64>> {
        let _lock = lock(dir)?;
        if self.generation > 0
            && let Ok(Some(existing)) = Checkpoint::read(dir)
            && existing.generation > self.generation
        {
            return Ok(Some(existing.generation));
        }
        self.write_atomic(dir)?;
        Ok(None)
    }

    /// Reads `dir/checkpoint.json`; `Ok(None)` if there is none.
    pub fn read(dir: &Path) -> Result<Option<Checkpoint>> {
        let path = path_in(dir);
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let ckpt = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a valid checkpoint", path.display()))?;
        Ok(Some(ckpt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(model: &Model) -> Checkpoint {
        let n = model.num_params();
        Checkpoint {
            format_version: FORMAT_VERSION,
            dataset: DatasetName::Optdigits,
            model: model.kind,
            hidden: model.hidden,
            step: 120,
            samples: 3840,
            last_loss: Some(0.53),
            seed: 1,
            world_size: 2,
            generation: 3,
            // Values with long binary expansions must survive the text round trip.
            params: (0..n)
                .map(|i| (i as f64 + 0.1).sqrt() / 3.0 - 1e-300)
                .collect(),
            momentum: (0..n).map(|i| -(i as f64) * 1e-7 / 7.0).collect(),
            block_velocity: None,
            scaling: Some(SmoothedStats {
                sqr_biased: -0.0123 / 7.0,
                var_biased: 2.41 / 3.0,
                unbias: 0.3,
                observations: 300,
                progress: 612.5,
            }),
        }
    }

    /// Counts the `write` calls that reach the file.
    struct Counted(Vec<u8>, usize);

    impl Write for Counted {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.1 += 1;
            self.0.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A checkpoint reaches its file in 64 KiB pieces, not one `write` per token: the
    /// MNIST MLP's (50,890 parameters and as much momentum, 2 MB of JSON) took 11.6 s to
    /// write unbuffered on a container's fuse-overlayfs. Same bytes either way.
    #[test]
    fn a_checkpoint_is_written_in_few_large_writes() {
        let model = Model::new(ModelKind::Mlp, 784, 64, 10);
        let ckpt = sample(&model);
        let mut file = Counted(Vec::new(), 0);
        ckpt.write_json(&mut file).unwrap();
        let bytes = file.0.len();
        assert!(bytes > 1_000_000, "{bytes} bytes");
        assert!(
            file.1 <= bytes / (1 << 16) + 2,
            "{} writes for {bytes} bytes",
            file.1
        );
        let mut expected = serde_json::to_vec(&ckpt).unwrap();
        expected.push(b'\n');
        assert_eq!(file.0, expected);
    }

    #[test]
    fn round_trip_is_exact_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("job/ckpt");
        assert_eq!(Checkpoint::read(&sub).unwrap(), None);
        let model = Model::new(ModelKind::Mlp, 64, 5, 10);
        let ckpt = sample(&model);
        ckpt.write_atomic(&sub).unwrap();
        let back = Checkpoint::read(&sub).unwrap().unwrap();
        assert_eq!(back, ckpt);
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.params), bits(&ckpt.params));
        back.check_compatible(DatasetName::Optdigits, &model)
            .unwrap();

        // Overwriting replaces the file; only checkpoint.json remains in the directory.
        let mut later = ckpt.clone();
        later.step = 240;
        later.write_atomic(&sub).unwrap();
        assert_eq!(Checkpoint::read(&sub).unwrap().unwrap().step, 240);
        let names: Vec<String> = fs::read_dir(&sub)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![FILE_NAME.to_string()]);
    }

    #[test]
    fn a_stale_generation_never_overwrites_a_newer_ones_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let model = Model::new(ModelKind::Mlp, 64, 5, 10);
        let mut stale = sample(&model);
        stale.generation = 1;
        stale.write_atomic(dir.path()).unwrap();
        // A newer generation holds the lock while it writes; the stale writer, which
        // could have passed its check before, waits and then finds the newer checkpoint.
        let held = lock(dir.path()).unwrap();
        let writer = {
            let (dir, stale) = (dir.path().to_path_buf(), stale.clone());
            std::thread::spawn(move || stale.write_fenced(&dir).unwrap())
        };
        std::thread::sleep(std::time::Duration::from_millis(300));
        let mut newer = sample(&model);
        newer.generation = 2;
        newer.step = 999;
        newer.write_atomic(dir.path()).unwrap();
        drop(held);
        assert_eq!(writer.join().unwrap(), Some(2), "fenced by generation 2");
        assert_eq!(Checkpoint::read(dir.path()).unwrap().unwrap(), newer);
        // Generation 2 and a run by hand (generation 0) write.
        assert_eq!(newer.write_fenced(dir.path()).unwrap(), None);
        let mut by_hand = sample(&model);
        by_hand.generation = 0;
        assert_eq!(by_hand.write_fenced(dir.path()).unwrap(), None);
    }

    #[test]
    fn another_writers_temporary_file_is_never_used() {
        // A writer on another host with the same process id (shared storage): the old
        // `.checkpoint.json.tmp.<pid>` name would have been truncated and renamed under it.
        let dir = tempfile::tempdir().unwrap();
        let theirs = dir
            .path()
            .join(format!(".{FILE_NAME}.tmp.{}", std::process::id()));
        fs::write(&theirs, "their half-written checkpoint").unwrap();
        let model = Model::new(ModelKind::Mlp, 64, 5, 10);
        let ckpt = sample(&model);
        ckpt.write_atomic(dir.path()).unwrap();
        assert_eq!(
            fs::read_to_string(&theirs).unwrap(),
            "their half-written checkpoint"
        );
        assert_eq!(Checkpoint::read(dir.path()).unwrap().unwrap(), ckpt);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn mismatched_checkpoints_are_refused() {
        let model = Model::new(ModelKind::Mlp, 64, 5, 10);
        let ckpt = sample(&model);
        let err = ckpt
            .check_compatible(DatasetName::Mnist, &model)
            .unwrap_err();
        assert!(err.to_string().contains("--dataset optdigits"), "{err}");
        let softmax = Model::new(ModelKind::Softmax, 64, 0, 10);
        assert!(
            ckpt.check_compatible(DatasetName::Optdigits, &softmax)
                .is_err()
        );
        let wider = Model::new(ModelKind::Mlp, 64, 6, 10);
        assert!(
            ckpt.check_compatible(DatasetName::Optdigits, &wider)
                .is_err()
        );
        let mut short = ckpt.clone();
        short.momentum.pop();
        assert!(
            short
                .check_compatible(DatasetName::Optdigits, &model)
                .is_err()
        );
        let mut velocity = ckpt.clone();
        velocity.block_velocity = Some(vec![0.0; model.num_params() - 1]);
        assert!(
            velocity
                .check_compatible(DatasetName::Optdigits, &model)
                .is_err()
        );
        velocity.block_velocity = Some(vec![0.5; model.num_params()]);
        velocity
            .check_compatible(DatasetName::Optdigits, &model)
            .unwrap();
        for bad in [f64::NAN, 1.5, -0.1] {
            let mut stats = ckpt.clone();
            stats.scaling.as_mut().unwrap().unbias = bad;
            assert!(
                stats
                    .check_compatible(DatasetName::Optdigits, &model)
                    .is_err(),
                "unbias {bad}"
            );
        }
        // A checkpoint of an older trainer, without statistics, still reads.
        let mut old = serde_json::to_value(&ckpt).unwrap();
        old.as_object_mut().unwrap().remove("scaling");
        let old: Checkpoint = serde_json::from_value(old).unwrap();
        assert_eq!(old.scaling, None);
        old.check_compatible(DatasetName::Optdigits, &model)
            .unwrap();
        let mut future = ckpt;
        future.format_version = 99;
        assert!(
            future
                .check_compatible(DatasetName::Optdigits, &model)
                .is_err()
        );
    }

    #[test]
    fn a_corrupt_checkpoint_is_an_error_not_a_fresh_start() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(path_in(dir.path()), "{\"format_version\":1,").unwrap();
        assert!(Checkpoint::read(dir.path()).is_err());
    }
}

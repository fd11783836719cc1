//! Reproducible randomness and the global sample order.
//!
//! Sample order is a deterministic permutation per data epoch, drawn from ChaCha8 seeded by
//! the run's seed and the epoch index. The epochs' permutations are concatenated into one
//! endless sequence of sample positions. The global batch of a step covers positions
//! `[samples, samples + world_size * batch_size)`, and rank `r` takes the slice
//! `[r * batch_size, (r + 1) * batch_size)` of it. Because the order depends only on the
//! seed and the sample count, a job resumed from a checkpoint at any world size continues
//! with exactly the positions it would have seen without the restart.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};

/// Independent random streams derived from one seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// The sample permutation of one data epoch.
    DataOrder = 1,
    /// Parameter initialization.
    Init = 2,
}

/// A ChaCha8 generator for `(seed, index, stream)`; distinct triples give independent
/// streams (the triple is the 256-bit key, not a sum that could collide).
pub fn rng(seed: u64, index: u64, stream: Stream) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&index.to_le_bytes());
    key[16..24].copy_from_slice(&(stream as u64).to_le_bytes());
    ChaCha8Rng::from_seed(key)
}

/// A uniform draw from `[0, 1)` with 53 random bits.
pub fn uniform(rng: &mut impl RngCore) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A standard normal draw (Box-Muller).
pub fn normal(rng: &mut impl RngCore) -> f64 {
    let u1 = 1.0 - uniform(rng); // In (0, 1], so the logarithm is finite.
    let u2 = uniform(rng);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A uniform draw from `0..n` (Lemire's multiply-shift; the bias is below 2^-40 for the
/// dataset sizes used here and, above all, it is the same on every machine).
fn below(rng: &mut impl RngCore, n: usize) -> usize {
    ((rng.next_u64() as u128 * n as u128) >> 64) as usize
}

/// The sample permutation of data epoch `epoch` for a training set of `n` examples.
pub fn epoch_permutation(seed: u64, epoch: u64, n: usize) -> Vec<usize> {
    let mut rng = rng(seed, epoch, Stream::DataOrder);
    let mut perm: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = below(&mut rng, i + 1);
        perm.swap(i, j);
    }
    perm
}

/// Maps global sample positions to training-set indices, caching the permutations of
/// the epochs in use.
#[derive(Debug)]
pub struct DataOrder {
    seed: u64,
    n: usize,
    cache: Vec<(u64, Vec<usize>)>,
}

impl DataOrder {
    /// The order for a training set of `n` examples (`n > 0`) under `seed`.
    pub fn new(seed: u64, n: usize) -> DataOrder {
        assert!(n > 0, "empty training set");
        DataOrder {
            seed,
            n,
            cache: Vec::new(),
        }
    }

    /// The training-set index at global position `pos`.
    pub fn index_at(&mut self, pos: u64) -> usize {
        let epoch = pos / self.n as u64;
        let offset = (pos % self.n as u64) as usize;
        if let Some((_, perm)) = self.cache.iter().find(|(e, _)| *e == epoch) {
            return perm[offset];
        }
        let perm = epoch_permutation(self.seed, epoch, self.n);
        let idx = perm[offset];
        // A batch spans at most two epochs unless it is larger than the training set; keep
        // the two most recent.
        if self.cache.len() >= 2 {
            self.cache.remove(0);
        }
        self.cache.push((epoch, perm));
        idx
    }

    /// The indices at positions `[start, start + len)`.
    pub fn range(&mut self, start: u64, len: usize) -> Vec<usize> {
        (0..len as u64).map(|k| self.index_at(start + k)).collect()
    }

    /// The slice of the global batch starting at `samples` that rank `rank` trains on.
    pub fn rank_slice(&mut self, samples: u64, rank: usize, batch_size: usize) -> Vec<usize> {
        self.range(samples + (rank * batch_size) as u64, batch_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutations_are_reproducible_and_differ_by_epoch() {
        let a = epoch_permutation(1, 0, 1000);
        assert_eq!(a, epoch_permutation(1, 0, 1000));
        assert_ne!(a, epoch_permutation(1, 1, 1000));
        assert_ne!(a, epoch_permutation(2, 0, 1000));
        // Seed 1 epoch 1 is not seed 2 epoch 0: the pair is not summed.
        assert_ne!(epoch_permutation(1, 1, 1000), epoch_permutation(2, 0, 1000));
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_ne!(a, sorted, "it is shuffled");
    }

    #[test]
    fn union_of_rank_slices_is_the_global_batch() {
        let n = 97; // Batches straddle epoch boundaries.
        for world in [1, 2, 3, 4] {
            let b = 8;
            let mut order = DataOrder::new(5, n);
            let mut samples = 0u64;
            for _step in 0..40 {
                let global = order.range(samples, world * b);
                let mut union = Vec::new();
                for r in 0..world {
                    union.extend(order.rank_slice(samples, r, b));
                }
                assert_eq!(union, global);
                samples += (world * b) as u64;
            }
        }
    }

    #[test]
    fn resuming_at_another_world_size_continues_the_same_positions() {
        let (n, b) = (50, 4);
        // The reference is the sequence of training indices the job sees without any restart.
        let reference = DataOrder::new(9, n).range(0, 400);

        // Generation 1 runs 7 steps at world size 2 and saves `samples`; generation 2 is
        // a fresh process (fresh cache) at world size 3; generation 3 runs at world size 1.
        let mut seen = Vec::new();
        let mut samples = 0u64;
        for (world, steps) in [(2usize, 7), (3, 9), (1, 13)] {
            let mut order = DataOrder::new(9, n);
            for _ in 0..steps {
                for r in 0..world {
                    seen.extend(order.rank_slice(samples, r, b));
                }
                samples += (world * b) as u64;
            }
        }
        assert_eq!(samples as usize, seen.len());
        assert_eq!(seen, reference[..seen.len()]);
        // Every example appears exactly once per epoch.
        let mut first_epoch = seen[..n].to_vec();
        first_epoch.sort_unstable();
        assert_eq!(first_epoch, (0..n).collect::<Vec<_>>());
    }
}

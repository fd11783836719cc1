//! The models: losses and gradients over one flat parameter vector.
//!
//! Every model keeps its parameters in a single `Vec<f64>` so that all-reduce, the
//! optimizer and checkpoints treat them generically. Layouts:
//!
//! - `logreg` and `linreg`: `d` weights, then the bias.
//! - `softmax`: a `classes x d` weight matrix (row per class), then `classes` biases.
//! - `mlp`: a `hidden x d` matrix, `hidden` biases, a `classes x hidden` matrix, then
//!   `classes` biases.

use std::fmt;

use anyhow::{Result, bail};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::data::{DatasetName, Split, Task};
use crate::order;

/// The models the trainer knows, as named on the command line and in checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Logistic regression with binary cross entropy (a9a).
    Logreg,
    /// Linear regression with mean squared error on the standardized target (millionsong).
    Linreg,
    /// Multinomial logistic regression with cross entropy (optdigits, mnist).
    Softmax,
    /// One hidden ReLU layer and a softmax output (optdigits, mnist).
    Mlp,
}

impl ModelKind {
    /// The name as written on the command line and in checkpoints.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Logreg => "logreg",
            ModelKind::Linreg => "linreg",
            ModelKind::Softmax => "softmax",
            ModelKind::Mlp => "mlp",
        }
    }

    /// The default learning rate, tuned so the loss clearly falls within a few hundred
    /// steps at the default batch size and momentum.
    pub fn default_lr(self) -> f64 {
        match self {
            ModelKind::Logreg => 0.05,
            ModelKind::Linreg => 0.01,
            ModelKind::Softmax => 0.05,
            ModelKind::Mlp => 0.02,
        }
    }

    /// The model used when `--model` is not given.
    pub fn default_for(dataset: DatasetName) -> ModelKind {
        match dataset {
            DatasetName::A9a => ModelKind::Logreg,
            DatasetName::Millionsong => ModelKind::Linreg,
            DatasetName::Optdigits => ModelKind::Softmax,
            DatasetName::Mnist => ModelKind::Mlp,
        }
    }

    /// Refuses a model that makes no sense on a dataset.
    pub fn check_pair(self, dataset: DatasetName) -> Result<()> {
        let ok = match self {
            ModelKind::Logreg => dataset == DatasetName::A9a,
            ModelKind::Linreg => dataset == DatasetName::Millionsong,
            ModelKind::Softmax | ModelKind::Mlp => {
                matches!(dataset, DatasetName::Optdigits | DatasetName::Mnist)
            }
        };
        if !ok {
            bail!(
                "--model {self} does not fit --dataset {dataset}: logreg is for a9a (binary labels), \
                 linreg for millionsong (regression), softmax and mlp for optdigits or mnist (10 classes)"
            );
        }
        Ok(())
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A model's kind and shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Model {
    /// Which model.
    pub kind: ModelKind,
    /// Input features per example.
    pub inputs: usize,
    /// Hidden units (only `mlp`; zero otherwise).
    pub hidden: usize,
    /// Output classes (only `softmax` and `mlp`; one otherwise).
    pub classes: usize,
}

impl Model {
    /// A model of `kind` for `inputs` features. `hidden` is used by `mlp` only and
    /// `classes` by `softmax` and `mlp` only.
    pub fn new(kind: ModelKind, inputs: usize, hidden: usize, classes: usize) -> Model {
        let (hidden, classes) = match kind {
            ModelKind::Logreg | ModelKind::Linreg => (0, 1),
            ModelKind::Softmax => (0, classes),
            ModelKind::Mlp => (hidden, classes),
        };
        Model {
            kind,
            inputs,
            hidden,
            classes,
        }
    }

    /// The model of `kind` shaped for a dataset with this task and feature count.
    pub fn for_task(kind: ModelKind, task: Task, inputs: usize, hidden: usize) -> Result<Model> {
        let classes = match (kind, task) {
            (ModelKind::Logreg, Task::Binary) | (ModelKind::Linreg, Task::Regression { .. }) => 1,
            (ModelKind::Softmax | ModelKind::Mlp, Task::Classes(c)) => c,
            _ => bail!("model {kind} does not fit a {task:?} task"),
        };
        if kind == ModelKind::Mlp && hidden == 0 {
            bail!("--hidden must be at least 1 for the mlp model");
        }
        Ok(Model::new(kind, inputs, hidden, classes))
    }

    /// Length of the flat parameter vector.
    pub fn num_params(&self) -> usize {
        let (d, h, c) = (self.inputs, self.hidden, self.classes);
        match self.kind {
            ModelKind::Logreg | ModelKind::Linreg => d + 1,
            ModelKind::Softmax => c * d + c,
            ModelKind::Mlp => h * d + h + c * h + c,
        }
    }

    /// Initial parameters: zeros for the linear models, He-normal weights (zero biases)
    /// from `seed` for the MLP.
    pub fn init(&self, seed: u64) -> Vec<f64> {
        let mut p = vec![0.0; self.num_params()];
        if self.kind == ModelKind::Mlp {
            let (d, h, c) = (self.inputs, self.hidden, self.classes);
            let mut rng: ChaCha8Rng = order::rng(seed, 0, order::Stream::Init);
            let s1 = (2.0 / d as f64).sqrt();
            for w in &mut p[..h * d] {
                *w = s1 * order::normal(&mut rng);
            }
            let s2 = (2.0 / h as f64).sqrt();
            let w2 = h * d + h;
            for w in &mut p[w2..w2 + c * h] {
                *w = s2 * order::normal(&mut rng);
            }
        }
        p
    }

    /// Adds the gradient of the summed loss over the examples `idx` of `data` into
    /// `grad` (length `num_params`) and returns the summed loss.
    pub fn loss_and_grad(
        &self,
        params: &[f64],
        data: &Split,
        idx: &[usize],
        grad: &mut [f64],
    ) -> f64 {
        self.run(params, data, idx, Some(grad))
    }

    /// The summed loss over the examples `idx` of `data`.
    pub fn loss(&self, params: &[f64], data: &Split, idx: &[usize]) -> f64 {
        self.run(params, data, idx, None)
    }

    fn run(
        &self,
        params: &[f64],
        data: &Split,
        idx: &[usize],
        mut grad: Option<&mut [f64]>,
    ) -> f64 {
        assert_eq!(params.len(), self.num_params(), "parameter vector length");
        assert_eq!(data.features, self.inputs, "feature count");
        if let Some(g) = grad.as_deref() {
            assert_eq!(g.len(), params.len(), "gradient vector length");
        }
        let mut scratch = Scratch::new(self);
        let mut total = 0.0;
        for &i in idx {
            let x = data.row(i);
            scratch.nonzero.clear();
            scratch.nonzero.extend(
                x.iter()
                    .enumerate()
                    .filter(|(_, v)| **v != 0.0)
                    .map(|(j, _)| j),
            );
            total += match self.kind {
                ModelKind::Logreg | ModelKind::Linreg => {
                    self.linear(params, x, data.y[i], &scratch.nonzero, grad.as_deref_mut())
                }
                ModelKind::Softmax => {
                    self.softmax(params, x, data.y[i], &mut scratch, grad.as_deref_mut())
                }
                ModelKind::Mlp => self.mlp(params, x, data.y[i], &mut scratch, grad.as_deref_mut()),
            };
        }
        total
    }

    fn linear(&self, p: &[f64], x: &[f64], y: f64, nz: &[usize], grad: Option<&mut [f64]>) -> f64 {
        let d = self.inputs;
        let z = p[d] + nz.iter().map(|&j| p[j] * x[j]).sum::<f64>();
        let (loss, dz) = if self.kind == ModelKind::Logreg {
            // Binary cross entropy of sigmoid(z) against y in {0, 1}, computed stably as
            // softplus(z) - y z.
            let loss = z.max(0.0) - y * z + (-z.abs()).exp().ln_1p();
            (loss, sigmoid(z) - y)
        } else {
            let r = z - y;
            (r * r, 2.0 * r)
        };
        if let Some(g) = grad {
            for &j in nz {
                g[j] += dz * x[j];
            }
            g[d] += dz;
        }
        loss
    }

    fn softmax(
        &self,
        p: &[f64],
        x: &[f64],
        y: f64,
        s: &mut Scratch,
        grad: Option<&mut [f64]>,
    ) -> f64 {
        let (d, c) = (self.inputs, self.classes);
        let bias = c * d;
        for k in 0..c {
            let w = &p[k * d..(k + 1) * d];
            s.logits[k] = p[bias + k] + s.nonzero.iter().map(|&j| w[j] * x[j]).sum::<f64>();
        }
        let loss = cross_entropy(&mut s.logits, y as usize);
        if let Some(g) = grad {
            // After cross_entropy, the logits hold the loss gradient with respect to them.
            for k in 0..c {
                let dz = s.logits[k];
                let gw = &mut g[k * d..(k + 1) * d];
                for &j in &s.nonzero {
                    gw[j] += dz * x[j];
                }
                g[bias + k] += dz;
            }
        }
        loss
    }

    fn mlp(&self, p: &[f64], x: &[f64], y: f64, s: &mut Scratch, grad: Option<&mut [f64]>) -> f64 {
        let (d, h, c) = (self.inputs, self.hidden, self.classes);
        let (b1, w2, b2) = (h * d, h * d + h, h * d + h + c * h);
        for u in 0..h {
            let w = &p[u * d..(u + 1) * d];
            let a = p[b1 + u] + s.nonzero.iter().map(|&j| w[j] * x[j]).sum::<f64>();
            s.hidden[u] = a.max(0.0);
        }
        for k in 0..c {
            let w = &p[w2 + k * h..w2 + (k + 1) * h];
            s.logits[k] = p[b2 + k] + w.iter().zip(&s.hidden).map(|(w, a)| w * a).sum::<f64>();
        }
        let loss = cross_entropy(&mut s.logits, y as usize);
        if let Some(g) = grad {
            s.dhidden.fill(0.0);
            for k in 0..c {
                let dz = s.logits[k];
                let w = &p[w2 + k * h..w2 + (k + 1) * h];
                let gw = &mut g[w2 + k * h..w2 + (k + 1) * h];
                for u in 0..h {
                    gw[u] += dz * s.hidden[u];
                    s.dhidden[u] += dz * w[u];
                }
                g[b2 + k] += dz;
            }
            for u in 0..h {
                if s.hidden[u] <= 0.0 {
                    continue;
                }
                let da = s.dhidden[u];
                let gw = &mut g[u * d..(u + 1) * d];
                for &j in &s.nonzero {
                    gw[j] += da * x[j];
                }
                g[b1 + u] += da;
            }
        }
        loss
    }
}

/// Per-call working memory, so the per-example loops do not allocate.
struct Scratch {
    nonzero: Vec<usize>,
    logits: Vec<f64>,
    hidden: Vec<f64>,
    dhidden: Vec<f64>,
}

impl Scratch {
    fn new(m: &Model) -> Scratch {
        Scratch {
            nonzero: Vec::with_capacity(m.inputs),
            logits: vec![0.0; m.classes],
            hidden: vec![0.0; m.hidden],
            dhidden: vec![0.0; m.hidden],
        }
    }
}

fn sigmoid(z: f64) -> f64 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

/// Returns the cross entropy of softmax(`logits`) against class `y` and overwrites
/// `logits` with the gradient of that loss with respect to the logits.
fn cross_entropy(logits: &mut [f64], y: usize) -> f64 {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // The loss uses the shifted logit rather than ln(p_y), which stays finite even when
    // p_y underflows to zero.
    let shifted_y = logits[y] - max;
    let mut sum = 0.0;
    for z in logits.iter_mut() {
        *z = (*z - max).exp();
        sum += *z;
    }
    for z in logits.iter_mut() {
        *z /= sum;
    }
    logits[y] -= 1.0;
    sum.ln() - shifted_y
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::rand_core::SeedableRng;

    /// A small random dataset with some exact zeros, as the real features have.
    fn toy_split(rows: usize, features: usize, label: impl Fn(usize) -> f64) -> Split {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut x = Vec::new();
        for _ in 0..rows * features {
            let v = order::uniform(&mut rng);
            x.push(if v < 0.3 { 0.0 } else { v });
        }
        Split {
            rows,
            features,
            x,
            y: (0..rows).map(label).collect(),
        }
    }

    fn random_params(m: &Model, seed: u64) -> Vec<f64> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..m.num_params())
            .map(|_| 0.5 * order::normal(&mut rng))
            .collect()
    }

    fn check_gradient(m: Model, data: &Split) {
        let p = random_params(&m, 3);
        let idx: Vec<usize> = (0..data.rows).collect();
        let mut g = vec![0.0; p.len()];
        let loss = m.loss_and_grad(&p, data, &idx, &mut g);
        assert!((loss - m.loss(&p, data, &idx)).abs() < 1e-12);
        let eps = 1e-6;
        let mut worst: f64 = 0.0;
        for j in 0..p.len() {
            let mut q = p.clone();
            q[j] = p[j] + eps;
            let up = m.loss(&q, data, &idx);
            q[j] = p[j] - eps;
            let down = m.loss(&q, data, &idx);
            let numeric = (up - down) / (2.0 * eps);
            let err = (numeric - g[j]).abs() / (1.0 + numeric.abs());
            worst = worst.max(err);
        }
        assert!(
            worst < 1e-6,
            "{:?}: worst relative gradient error {worst}",
            m.kind
        );
        assert!(g.iter().any(|v| v.abs() > 1e-3), "gradient is not all zero");
    }

    #[test]
    fn logreg_gradient_matches_finite_differences() {
        let data = toy_split(6, 5, |i| (i % 2) as f64);
        check_gradient(Model::new(ModelKind::Logreg, 5, 0, 1), &data);
    }

    #[test]
    fn linreg_gradient_matches_finite_differences() {
        let data = toy_split(6, 4, |i| i as f64 * 0.3 - 0.7);
        check_gradient(Model::new(ModelKind::Linreg, 4, 0, 1), &data);
    }

    #[test]
    fn softmax_gradient_matches_finite_differences() {
        let data = toy_split(7, 5, |i| (i % 3) as f64);
        check_gradient(Model::new(ModelKind::Softmax, 5, 0, 3), &data);
    }

    #[test]
    fn mlp_gradient_matches_finite_differences() {
        let data = toy_split(7, 5, |i| (i % 3) as f64);
        check_gradient(Model::new(ModelKind::Mlp, 5, 6, 3), &data);
    }

    #[test]
    fn initial_losses_are_the_textbook_values() {
        let data = toy_split(4, 5, |i| (i % 2) as f64);
        let idx = [0, 1, 2, 3];
        let m = Model::new(ModelKind::Logreg, 5, 0, 1);
        let l = m.loss(&m.init(1), &data, &idx) / 4.0;
        assert!((l - 2f64.ln()).abs() < 1e-12);
        let m = Model::new(ModelKind::Softmax, 5, 0, 10);
        let l = m.loss(&m.init(1), &data, &idx) / 4.0;
        assert!((l - 10f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn mlp_init_is_seeded_he_normal() {
        let m = Model::new(ModelKind::Mlp, 784, 64, 10);
        let a = m.init(1);
        assert_eq!(a, m.init(1));
        assert_ne!(a, m.init(2));
        assert_eq!(a.len(), 784 * 64 + 64 + 64 * 10 + 10);
        let w1 = &a[..784 * 64];
        let var = w1.iter().map(|w| w * w).sum::<f64>() / w1.len() as f64;
        assert!(
            (var * 784.0 / 2.0 - 1.0).abs() < 0.05,
            "He variance off: {var}"
        );
        assert!(a[784 * 64..784 * 64 + 64].iter().all(|&b| b == 0.0));
    }

    #[test]
    fn nonsensical_pairs_are_refused() {
        assert!(ModelKind::Logreg.check_pair(DatasetName::A9a).is_ok());
        assert!(ModelKind::Logreg.check_pair(DatasetName::Mnist).is_err());
        assert!(ModelKind::Linreg.check_pair(DatasetName::A9a).is_err());
        assert!(ModelKind::Mlp.check_pair(DatasetName::Optdigits).is_ok());
        assert!(
            ModelKind::Softmax
                .check_pair(DatasetName::Millionsong)
                .is_err()
        );
        for ds in [
            DatasetName::A9a,
            DatasetName::Millionsong,
            DatasetName::Optdigits,
            DatasetName::Mnist,
        ] {
            assert!(ModelKind::default_for(ds).check_pair(ds).is_ok());
        }
    }
}

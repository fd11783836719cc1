//! Loading the real datasets in `data/` into dense, row-major feature matrices.
//!
//! Every dataset is read into a training split and a held-out split. Features are scaled
//! the way the models expect them (optdigits divided by 16, MNIST divided by 255, a9a and
//! millionsong as stored), and labels are mapped to what the losses use: 0/1 for a9a,
//! a class index for optdigits and MNIST, and the release year standardized by the
//! training mean and standard deviation for millionsong.

use std::fmt;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use serde::{Deserialize, Serialize};

/// Number of one-hot features in the LIBSVM `a9a` files.
pub const A9A_FEATURES: usize = 123;
/// Number of timbre features in the millionsong file.
pub const MILLIONSONG_FEATURES: usize = 12;
/// Number of 4x4-block counts per optdigits image.
pub const OPTDIGITS_FEATURES: usize = 64;
/// Number of pixels per MNIST image.
pub const MNIST_FEATURES: usize = 784;
/// Number of digit classes in optdigits and MNIST.
pub const DIGIT_CLASSES: usize = 10;

/// The datasets the trainer knows, as named on the command line and in checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DatasetName {
    /// UCI Adult census income (LIBSVM `a9a`), binary classification, 123 features.
    A9a,
    /// YearPredictionMSD subset, regression of the release year from 12 features.
    Millionsong,
    /// UCI optical digits, 10 classes, 64 features (8x8 block counts 0..16).
    Optdigits,
    /// MNIST subset, 10 classes, 784 pixels 0..255.
    Mnist,
}

impl DatasetName {
    /// The name as written on the command line and in checkpoints.
    pub fn as_str(self) -> &'static str {
        match self {
            DatasetName::A9a => "a9a",
            DatasetName::Millionsong => "millionsong",
            DatasetName::Optdigits => "optdigits",
            DatasetName::Mnist => "mnist",
        }
    }
}

impl fmt::Display for DatasetName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the labels of a dataset mean.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Task {
    /// Binary classification with labels 0 and 1.
    Binary,
    /// Regression on a standardized target; `mean` and `std` undo the standardization.
    Regression { mean: f64, std: f64 },
    /// Multi-class classification with labels `0..classes`.
    Classes(usize),
}

/// One split of a dataset: `rows` examples with `features` dense features each.
#[derive(Clone, Debug, Default)]
pub struct Split {
    /// Number of examples.
    pub rows: usize,
    /// Number of features per example.
    pub features: usize,
    /// Row-major features, `rows * features` values.
    pub x: Vec<f64>,
    /// One label per example (0/1, class index, or standardized target).
    pub y: Vec<f64>,
}

impl Split {
    fn with_features(features: usize) -> Split {
        Split {
            features,
            ..Split::default()
        }
    }

    fn push(&mut self, row: &[f64], label: f64) {
        debug_assert_eq!(row.len(), self.features);
        self.x.extend_from_slice(row);
        self.y.push(label);
        self.rows += 1;
    }

    /// The features of example `i`.
    pub fn row(&self, i: usize) -> &[f64] {
        &self.x[i * self.features..(i + 1) * self.features]
    }
}

/// A loaded dataset: a training split and a held-out split with the same features.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// Which dataset this is.
    pub name: DatasetName,
    /// What the labels mean.
    pub task: Task,
    /// Training examples.
    pub train: Split,
    /// Held-out examples used for `eval_loss`.
    pub test: Split,
}

impl Dataset {
    /// Number of features per example.
    pub fn features(&self) -> usize {
        self.train.features
    }
}

/// Loads `name` from the data directory laid out as in `data/README.md`.
pub fn load(name: DatasetName, dir: &Path) -> Result<Dataset> {
    let read = |rel: &str| -> Result<String> {
        let path = dir.join(rel);
        std::fs::read_to_string(&path).with_context(|| {
            format!(
                "cannot read {} (set --data-dir or CONVERGE_DATA_DIR to the folder holding the datasets)",
                path.display()
            )
        })
    };
    let ds = match name {
        DatasetName::A9a => {
            let train = parse_libsvm(&read("a9a/a9a.txt")?, A9A_FEATURES).context("a9a/a9a.txt")?;
            let test = parse_libsvm(&read("a9a/a9a.t")?, A9A_FEATURES).context("a9a/a9a.t")?;
            Dataset {
                name,
                task: Task::Binary,
                train,
                test,
            }
        }
        DatasetName::Millionsong => {
            let all = parse_millionsong(&read("millionsong/millionsong.txt")?)
                .context("millionsong/millionsong.txt")?;
            let (train, test, mean, std) = split_millionsong(all)?;
            Dataset {
                name,
                task: Task::Regression { mean, std },
                train,
                test,
            }
        }
        DatasetName::Optdigits => {
            let train = parse_optdigits(&read("optdigits/optdigits.tra")?)
                .context("optdigits/optdigits.tra")?;
            let test = parse_optdigits(&read("optdigits/optdigits.tes")?)
                .context("optdigits/optdigits.tes")?;
            Dataset {
                name,
                task: Task::Classes(DIGIT_CLASSES),
                train,
                test,
            }
        }
        DatasetName::Mnist => {
            let train = parse_mnist(&read("mnist_subset/mnist_train.csv")?)
                .context("mnist_subset/mnist_train.csv")?;
            let test = parse_mnist(&read("mnist_subset/mnist_test.csv")?)
                .context("mnist_subset/mnist_test.csv")?;
            Dataset {
                name,
                task: Task::Classes(DIGIT_CLASSES),
                train,
                test,
            }
        }
    };
    ensure!(ds.train.rows > 0, "{name}: the training split is empty");
    ensure!(ds.test.rows > 0, "{name}: the held-out split is empty");
    Ok(ds)
}

/// Non-empty lines with any trailing carriage return removed, numbered from 1.
fn lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim_end_matches('\r')))
        .filter(|(_, l)| !l.trim().is_empty())
}

fn number(field: &str, line: usize) -> Result<f64> {
    let v: f64 = field
        .trim()
        .parse()
        .with_context(|| format!("line {line}: {field:?} is not a number"))?;
    ensure!(v.is_finite(), "line {line}: {field:?} is not finite");
    Ok(v)
}

/// Parses LIBSVM text (`±1 idx:val ...`, 1-based indices) into dense rows of `features`
/// values; label +1 becomes 1 and -1 becomes 0.
pub fn parse_libsvm(text: &str, features: usize) -> Result<Split> {
    let mut split = Split::with_features(features);
    let mut row = vec![0.0; features];
    for (n, line) in lines(text) {
        let mut fields = line.split_ascii_whitespace();
        let label = number(fields.next().unwrap_or_default(), n)?;
        let label = if label == 1.0 {
            1.0
        } else if label == -1.0 {
            0.0
        } else {
            bail!("line {n}: label {label} is neither +1 nor -1")
        };
        row.fill(0.0);
        for field in fields {
            let (idx, val) = field
                .split_once(':')
                .with_context(|| format!("line {n}: {field:?} is not idx:value"))?;
            let idx: usize = idx
                .parse()
                .with_context(|| format!("line {n}: bad feature index {idx:?}"))?;
            ensure!(
                (1..=features).contains(&idx),
                "line {n}: feature index {idx} outside 1..={features}"
            );
            row[idx - 1] = number(val, n)?;
        }
        split.push(&row, label);
    }
    Ok(split)
}

/// Parses the millionsong CSV (no header; year, then 12 features). Returns the raw years
/// and a split whose labels are the raw years too.
pub fn parse_millionsong(text: &str) -> Result<Split> {
    let mut split = Split::with_features(MILLIONSONG_FEATURES);
    let mut row = Vec::with_capacity(MILLIONSONG_FEATURES);
    for (n, line) in lines(text) {
        row.clear();
        let mut fields = line.split(',');
        let year = number(fields.next().unwrap_or_default(), n)?;
        for f in fields {
            row.push(number(f, n)?);
        }
        ensure!(
            row.len() == MILLIONSONG_FEATURES,
            "line {n}: expected {MILLIONSONG_FEATURES} features after the year, found {}",
            row.len()
        );
        split.push(&row, year);
    }
    Ok(split)
}

/// Splits millionsong rows into training and held-out rows and standardizes the year by
/// the training mean and standard deviation. Every tenth row (rows 9, 19, 29, ... counting
/// from 0) is held out. The file is ordered roughly by era (its last rows are almost all
/// songs from 1920 to 1950), so holding out its last 10% would evaluate on a different
/// distribution than the model trains on; a strided split is just as deterministic.
fn split_millionsong(all: Split) -> Result<(Split, Split, f64, f64)> {
    let d = all.features;
    let mut train = Split::with_features(d);
    let mut test = Split::with_features(d);
    for i in 0..all.rows {
        let target = if i % 10 == 9 { &mut test } else { &mut train };
        target.push(all.row(i), all.y[i]);
    }
    ensure!(
        train.rows >= 2 && test.rows >= 1,
        "millionsong has only {} rows",
        all.rows
    );
    let n = train.rows as f64;
    let mean = train.y.iter().sum::<f64>() / n;
    let var = train.y.iter().map(|y| (y - mean).powi(2)).sum::<f64>() / n;
    let std = var.sqrt();
    ensure!(std > 0.0, "millionsong: every training year is the same");
    for y in train.y.iter_mut().chain(test.y.iter_mut()) {
        *y = (*y - mean) / std;
    }
    Ok((train, test, mean, std))
}

/// Parses an optdigits CSV (one header row, 64 counts 0..16, then the class); features
/// are divided by 16.
pub fn parse_optdigits(text: &str) -> Result<Split> {
    let mut split = Split::with_features(OPTDIGITS_FEATURES);
    let mut row = Vec::with_capacity(OPTDIGITS_FEATURES + 1);
    for (n, line) in lines(text) {
        let first = line.split(',').next().unwrap_or_default().trim();
        if split.rows == 0 && first.parse::<f64>().is_err() {
            // The single header row ("Block 1,Block 2,...") carries no data.
            continue;
        }
        row.clear();
        for f in line.split(',') {
            row.push(number(f, n)?);
        }
        ensure!(
            row.len() == OPTDIGITS_FEATURES + 1,
            "line {n}: expected {} fields, found {}",
            OPTDIGITS_FEATURES + 1,
            row.len()
        );
        let class = class_label(row[OPTDIGITS_FEATURES], n)?;
        for v in &mut row[..OPTDIGITS_FEATURES] {
            ensure!(
                (0.0..=16.0).contains(v),
                "line {n}: count {v} outside 0..16"
            );
            *v /= 16.0;
        }
        split.push(&row[..OPTDIGITS_FEATURES], class);
    }
    Ok(split)
}

/// Parses an MNIST subset CSV (label, 784 pixels 0..255, an empty trailing field); pixels
/// are divided by 255.
pub fn parse_mnist(text: &str) -> Result<Split> {
    let mut split = Split::with_features(MNIST_FEATURES);
    let mut row = Vec::with_capacity(MNIST_FEATURES);
    for (n, line) in lines(text) {
        let line = line.strip_suffix(',').unwrap_or(line);
        let mut fields = line.split(',');
        let class = class_label(number(fields.next().unwrap_or_default(), n)?, n)?;
        row.clear();
        for f in fields {
            let v = number(f, n)?;
            ensure!(
                (0.0..=255.0).contains(&v),
                "line {n}: pixel {v} outside 0..255"
            );
            row.push(v / 255.0);
        }
        ensure!(
            row.len() == MNIST_FEATURES,
            "line {n}: expected {MNIST_FEATURES} pixels, found {}",
            row.len()
        );
        split.push(&row, class);
    }
    Ok(split)
}

fn class_label(v: f64, line: usize) -> Result<f64> {
    ensure!(
        v.fract() == 0.0 && (0.0..DIGIT_CLASSES as f64).contains(&v),
        "line {line}: class {v} is not an integer in 0..{DIGIT_CLASSES}"
    );
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn data_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data")
    }

    fn class_counts(s: &Split) -> [usize; DIGIT_CLASSES] {
        let mut c = [0; DIGIT_CLASSES];
        for &y in &s.y {
            c[y as usize] += 1;
        }
        c
    }

    #[test]
    fn a9a_rows_features_and_labels() {
        let ds = load(DatasetName::A9a, &data_dir()).unwrap();
        assert_eq!(ds.train.rows, 32_561);
        assert_eq!(ds.test.rows, 16_281);
        assert_eq!(ds.features(), 123);
        assert_eq!(ds.train.x.len(), 32_561 * 123);
        for s in [&ds.train, &ds.test] {
            assert!(s.y.iter().all(|&y| y == 0.0 || y == 1.0));
            assert!(s.x.iter().all(|&v| v == 0.0 || v == 1.0));
        }
        // About a quarter of Adult earns more than 50K.
        let pos = ds.train.y.iter().filter(|&&y| y == 1.0).count();
        assert_eq!(pos, 7_841);
        // The first training row is "-1 3:1 11:1 14:1 ...".
        let r = ds.train.row(0);
        assert_eq!(ds.train.y[0], 0.0);
        assert_eq!((r[2], r[10], r[13], r[0]), (1.0, 1.0, 1.0, 0.0));
    }

    #[test]
    fn millionsong_rows_split_and_standardized_years() {
        let text = std::fs::read_to_string(data_dir().join("millionsong/millionsong.txt")).unwrap();
        let raw = parse_millionsong(&text).unwrap();
        assert_eq!(raw.rows, 6_724);
        assert_eq!(raw.features, 12);
        assert_eq!(raw.y[0], 2001.0);
        assert!(raw.y.iter().all(|y| (1922.0..=2011.0).contains(y)));
        assert!(raw.x.iter().all(|v| (-0.5..=1.5).contains(v)));

        let ds = load(DatasetName::Millionsong, &data_dir()).unwrap();
        assert_eq!(ds.train.rows + ds.test.rows, 6_724);
        assert_eq!(ds.test.rows, 672);
        let Task::Regression { mean, std } = ds.task else {
            panic!("millionsong is a regression task")
        };
        assert!((1970.0..1990.0).contains(&mean), "mean year {mean}");
        assert!((10.0..30.0).contains(&std), "year std {std}");
        let n = ds.train.rows as f64;
        let m: f64 = ds.train.y.iter().sum::<f64>() / n;
        let v: f64 = ds.train.y.iter().map(|y| (y - m).powi(2)).sum::<f64>() / n;
        assert!(m.abs() < 1e-9 && (v - 1.0).abs() < 1e-9);
        // Every tenth row is held out, in file order; the others train.
        assert_eq!(ds.test.row(0), raw.row(9));
        assert_eq!(ds.test.row(671), raw.row(6719));
        assert!((ds.test.y[671] * std + mean - raw.y[6719]).abs() < 1e-9);
        assert_eq!(ds.train.row(9), raw.row(10));
        // The held-out years come from the same era as the training years.
        let held_mean: f64 = ds.test.y.iter().sum::<f64>() / ds.test.rows as f64;
        assert!(
            held_mean.abs() < 0.2,
            "held-out mean {held_mean} (standardized)"
        );
    }

    #[test]
    fn optdigits_rows_features_and_classes() {
        let ds = load(DatasetName::Optdigits, &data_dir()).unwrap();
        assert_eq!(ds.train.rows, 3_823);
        assert_eq!(ds.test.rows, 1_797);
        assert_eq!(ds.features(), 64);
        for s in [&ds.train, &ds.test] {
            assert!(s.x.iter().all(|v| (0.0..=1.0).contains(v)));
            assert!(class_counts(s).iter().all(|&c| c > 100));
        }
        assert!(ds.train.x.contains(&1.0), "some count is 16");
    }

    #[test]
    fn mnist_rows_features_and_classes() {
        let ds = load(DatasetName::Mnist, &data_dir()).unwrap();
        assert_eq!(ds.train.rows, 2_000);
        assert_eq!(ds.test.rows, 200);
        assert_eq!(ds.features(), 784);
        assert_eq!(ds.train.y[0], 7.0);
        assert!(ds.train.x.iter().all(|v| (0.0..=1.0).contains(v)));
        assert!(ds.train.x.contains(&1.0));
        assert!(class_counts(&ds.train).iter().all(|&c| c > 100));
    }

    #[test]
    fn malformed_rows_are_refused_with_the_line_number() {
        let err = parse_libsvm("+1 1:1 \n-1 124:1 \n", 123).unwrap_err();
        assert!(format!("{err:#}").contains("line 2"), "{err:#}");
        assert!(parse_libsvm("0 1:1\n", 123).is_err());
        assert!(parse_optdigits("Block 1\r\n1,2\n").is_err());
        assert!(parse_mnist("3,1,2,\r\n").is_err());
        assert!(parse_millionsong("2001.0,0.5\n").is_err());
    }
}

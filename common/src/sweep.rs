//! Sweeps: one file, many trial jobs (`converge submit sweep.toml`). A sweep file names the
//! sweep, the parameter values to try (a grid, expanded to every combination, or an explicit
//! list of trials) and a job spec template whose `{name}` placeholders take each trial's
//! values. Expansion is pure and refuses, with the reason, anything it cannot expand
//! exactly: it never truncates and never guesses.
//!
//! ```toml
//! [sweep]
//! id = "optdigits-lr"            # same rules as a job id; trials are optdigits-lr-01, -02, ...
//! [sweep.grid]                   # every combination; or [[sweep.trials]] tables, one per trial
//! model = ["softmax", "mlp"]
//! lr = [0.01, 0.05]
//! [job]                          # a job spec without `id`
//! command = ["converge-trainer", "--dataset", "optdigits", "--model", "{model}", "--lr", "{lr}"]
//! max_workers = 4
//! ```
//!
//! **Order.** Grid trials are numbered in nested-loop order over the parameters as the file
//! lists them: the first parameter varies slowest, the last fastest (above: softmax/0.01,
//! softmax/0.05, mlp/0.01, mlp/0.05). Listed trials keep the file's order.
//!
//! **Ids.** Trial `n` (from 1) is `<sweep id>-<n>`, `n` zero-padded to the digits of the
//! trial count (`-01` … `-12`), so the ids sort in trial order; the sweep id must leave room
//! for the suffix within a job id's 64 characters.
//!
//! **Placeholders.** `{name}` in `command`, in `env` values and in `labels` values is
//! replaced by the trial's value of parameter `name`; `{{` writes a literal `{`. Other braces
//! (`{"a": 1}`) are left alone. Parameter names are `[A-Za-z_][A-Za-z0-9_-]*`.
//!
//! **Values** are strings, integers, floats or booleans, written as TOML reads them: `0.05`
//! stays `0.05`, `1e-4` becomes `0.0001`, `1.0` stays `1.0`, `16` is `16`.
//!
//! **Each trial** is the template with `id`, `sweep` (the sweep id) and one label per
//! parameter, `param.<name>` = its value, then validated as any job spec
//! ([`JobSpec::validate`]).

use crate::ids::{IdError, JobId, MAX_ID_LEN};
use crate::jobspec::{
    DEFAULT_EARLY_STOP_KEEP, EarlyStopRule, EarlyStopSpec, JobSpec, JobSpecError,
};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// Prefix of the labels that carry a trial's parameter values (`param.lr = "0.05"`).
pub const PARAM_LABEL_PREFIX: &str = "param.";

/// Default largest number of trials `converge submit` expands a sweep to (`--max-trials`).
pub const DEFAULT_MAX_TRIALS: usize = 64;

/// Why a sweep file was refused.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("cannot parse sweep file: {0}")]
    Parse(#[from] toml::de::Error),
    #[error("`[sweep]` has both `grid` and `trials`: give one of them")]
    GridAndTrials,
    #[error(
        "`[sweep]` has neither `grid` nor `trials`: give `[sweep.grid]` (lists of values, every combination is a trial) or `[[sweep.trials]]` tables (one per trial)"
    )]
    NoGridOrTrials,
    #[error("`[sweep] trials` is an empty list: give at least one `[[sweep.trials]]` table")]
    NoTrials,
    #[error("the sweep names no parameter: a trial needs at least one value to vary")]
    NoParameters,
    #[error("parameter `{0}` has an empty list of values: the grid would have no trial")]
    EmptyValues(String),
    #[error("parameter `{0}` of `[sweep.grid]` is not a list: write e.g. `{0} = [0.01, 0.1]`")]
    NotAList(String),
    #[error(
        "parameter `{param}` has the value {value}: values must be strings, integers, finite floats or booleans"
    )]
    BadValue { param: String, value: String },
    #[error(
        "parameter name {0:?} is not valid: use letters, digits, '_' and '-', starting with a letter or '_'"
    )]
    BadParamName(String),
    #[error("parameter `{param}` lists the value {value} twice")]
    DuplicateValue { param: String, value: String },
    #[error(
        "trial {trial} sets {got:?} but trial 1 sets {expected:?}: every trial must set the same parameters"
    )]
    DifferingKeys {
        trial: usize,
        expected: Vec<String>,
        got: Vec<String>,
    },
    #[error("trials {first} and {second} are the same trial ({params})")]
    DuplicateTrial {
        first: usize,
        second: usize,
        params: String,
    },
    #[error(
        "the sweep expands to {count} trials, more than the {max} allowed (refused, not truncated): sweep fewer values, or raise the limit (`converge submit --max-trials`)"
    )]
    TooManyTrials { count: u128, max: usize },
    #[error(
        "`{field}` uses the placeholder {{{name}}} but no parameter `{name}` is defined (parameters: {defined:?}; write {{{{ for a literal brace)"
    )]
    UndefinedPlaceholder {
        name: String,
        field: String,
        defined: Vec<String>,
    },
    #[error(
        "parameter `{0}` is used by no placeholder in `[job]` `command` or `env`: every trial would run the same program (write {{{0}}} where the value goes)"
    )]
    UnusedParameter(String),
    #[error("`[job]` may not set `{0}`: the sweep sets it for each trial")]
    ReservedKey(&'static str),
    #[error(
        "`[job]` label `{0}` is reserved: the sweep sets the `param.<name>` labels of each trial"
    )]
    LabelClash(String),
    #[error(
        "`[sweep] keep` is {keep} but the sweep has {trials} trials: early stopping keeps at most every trial"
    )]
    KeepAboveTrials { keep: u32, trials: usize },
    #[error("`[sweep]` early stopping: {0}")]
    EarlyStop(String),
    #[error("sweep id {id:?} is not valid: {source}")]
    BadId { id: String, source: IdError },
    #[error(
        "sweep id {id:?} is too long for its trial ids: {longest:?} has {len} characters, at most {MAX_ID_LEN} are allowed"
    )]
    IdTooLong {
        id: String,
        longest: String,
        len: usize,
    },
    #[error("trial {trial} ({params}) refused: {source}")]
    Trial {
        trial: JobId,
        params: String,
        source: Box<JobSpecError>,
    },
    #[error("job {0} already exists: choose another sweep id (or pass --id)")]
    DuplicateId(JobId),
    #[error(
        "sweep {sweep} already exists ({trials} trials): choose another sweep id (or pass --id)"
    )]
    SweepExists { sweep: JobId, trials: usize },
}

/// A parsed sweep file, before expansion ([`SweepFile::expand`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SweepFile {
    /// The sweep's id (`[sweep] id`); `converge submit --id` replaces it.
    pub id: JobId,
    /// Parameter names in the file's order.
    pub params: Vec<String>,
    /// What to try.
    pub values: Values,
    /// The `[job]` template.
    pub job: toml::Table,
    /// `[sweep] early_stop`, `keep`, `band`, `min_epochs` as the file gives them; expansion
    /// fills the defaults ([`SweepFile::early_stop_spec`]).
    pub early_stop: RawEarlyStop,
}

/// The early-stopping keys of a sweep file's `[sweep]` table, each optional.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RawEarlyStop {
    pub rule: Option<EarlyStopRule>,
    pub keep: Option<u32>,
    pub band: Option<f64>,
    pub min_epochs: Option<f64>,
}

/// The values of a sweep's parameters, as formatted strings in the order of
/// [`SweepFile::params`].
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// `[sweep.grid]`: each parameter's list; the trials are every combination.
    Grid(Vec<Vec<String>>),
    /// `[[sweep.trials]]`: one list of values per trial.
    Trials(Vec<Vec<String>>),
}

/// One trial of an expanded sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct Trial {
    /// The trial's job spec (validated).
    pub spec: JobSpec,
    /// Parameter name and value, in the sweep's parameter order.
    pub params: Vec<(String, String)>,
}

/// An expanded sweep: its trials in order, each a valid job spec.
#[derive(Debug, Clone, PartialEq)]
pub struct Sweep {
    pub id: JobId,
    /// Parameter names in the file's order.
    pub params: Vec<String>,
    pub trials: Vec<Trial>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    sweep: RawSweep,
    job: toml::Table,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSweep {
    id: String,
    #[serde(default)]
    early_stop: Option<EarlyStopRule>,
    #[serde(default)]
    keep: Option<u32>,
    #[serde(default)]
    band: Option<f64>,
    #[serde(default)]
    min_epochs: Option<f64>,
    #[serde(default)]
    grid: Option<BTreeMap<String, toml::Spanned<toml::Value>>>,
    #[serde(default)]
    trials: Option<Vec<BTreeMap<String, toml::Spanned<toml::Value>>>>,
}

/// Whether `text` is a sweep file (it has a `[sweep]` table) rather than a job spec. A file
/// that does not parse counts as a sweep when a line opens a `[sweep]` or `[sweep.…]` table,
/// so its parse error is reported as a sweep file's.
pub fn is_sweep_file(text: &str) -> bool {
    match toml::from_str::<toml::Table>(text) {
        Ok(t) => t.contains_key("sweep"),
        Err(_) => text.lines().any(|l| {
            let l = l.trim_start();
            l.starts_with("[sweep]") || l.starts_with("[sweep.") || l.starts_with("[[sweep.")
        }),
    }
}

/// Parses and expands a sweep file with at most `max_trials` trials.
pub fn expand(text: &str, max_trials: usize) -> Result<Sweep, SweepError> {
    SweepFile::from_toml(text)?.expand(max_trials)
}

/// The parameters of a trial's spec, from its `param.*` labels (name order).
pub fn trial_params(spec: &JobSpec) -> Vec<(&str, &str)> {
    spec.labels
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(PARAM_LABEL_PREFIX)?, v.as_str())))
        .collect()
}

/// `name=value` pairs joined by `, ` (how errors and the CLI name a trial's values).
pub fn describe<K: AsRef<str>, V: AsRef<str>>(params: &[(K, V)]) -> String {
    params
        .iter()
        .map(|(k, v)| format!("{}={}", k.as_ref(), v.as_ref()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Refuses a sweep whose trial ids, or whose sweep id, are already taken by `existing` jobs
/// (`converge submit` checks this before writing any trial).
pub fn check_unused<'a>(
    sweep: &Sweep,
    existing: impl IntoIterator<Item = &'a JobSpec>,
) -> Result<(), SweepError> {
    let ids: BTreeSet<&JobId> = sweep.trials.iter().map(|t| &t.spec.id).collect();
    let mut of_sweep = 0;
    for spec in existing {
        if ids.contains(&spec.id) {
            return Err(SweepError::DuplicateId(spec.id.clone()));
        }
        of_sweep += usize::from(spec.sweep.as_ref() == Some(&sweep.id));
    }
    if of_sweep > 0 {
        return Err(SweepError::SweepExists {
            sweep: sweep.id.clone(),
            trials: of_sweep,
        });
    }
    Ok(())
}

impl SweepFile {
    /// Parses a sweep file and checks its structure: the sweep id, grid or trials (not both,
    /// not neither), parameter names and values. Expansion checks the rest.
    pub fn from_toml(text: &str) -> Result<Self, SweepError> {
        let raw: RawFile = toml::from_str(text)?;
        let id = JobId::new(raw.sweep.id.clone()).map_err(|source| SweepError::BadId {
            id: raw.sweep.id.clone(),
            source,
        })?;
        // File order, from where each value starts.
        let ordered = |m: &BTreeMap<String, toml::Spanned<toml::Value>>| {
            let mut keys: Vec<(usize, String)> =
                m.iter().map(|(k, v)| (v.span().start, k.clone())).collect();
            keys.sort();
            keys.into_iter().map(|(_, k)| k).collect::<Vec<_>>()
        };
        let (params, values) = match (raw.sweep.grid, raw.sweep.trials) {
            (Some(_), Some(_)) => return Err(SweepError::GridAndTrials),
            (None, None) => return Err(SweepError::NoGridOrTrials),
            (Some(grid), None) => {
                let params = ordered(&grid);
                let mut lists = Vec::with_capacity(params.len());
                for p in &params {
                    check_name(p)?;
                    let toml::Value::Array(items) = grid[p].get_ref() else {
                        return Err(SweepError::NotAList(p.clone()));
                    };
                    if items.is_empty() {
                        return Err(SweepError::EmptyValues(p.clone()));
                    }
                    let mut list: Vec<String> = Vec::with_capacity(items.len());
                    for v in items {
                        let s = format_value(p, v)?;
                        if list.contains(&s) {
                            return Err(SweepError::DuplicateValue {
                                param: p.clone(),
                                value: s,
                            });
                        }
                        list.push(s);
                    }
                    lists.push(list);
                }
                (params, Values::Grid(lists))
            }
            (None, Some(trials)) => {
                let Some(first) = trials.first() else {
                    return Err(SweepError::NoTrials);
                };
                let params = ordered(first);
                let expected: BTreeSet<&String> = first.keys().collect();
                let mut rows = Vec::with_capacity(trials.len());
                for (i, t) in trials.iter().enumerate() {
                    if t.keys().collect::<BTreeSet<_>>() != expected {
                        return Err(SweepError::DifferingKeys {
                            trial: i + 1,
                            expected: params.clone(),
                            got: ordered(t),
                        });
                    }
                    let mut row = Vec::with_capacity(params.len());
                    for p in &params {
                        check_name(p)?;
                        row.push(format_value(p, t[p].get_ref())?);
                    }
                    if let Some(j) = rows.iter().position(|r| *r == row) {
                        return Err(SweepError::DuplicateTrial {
                            first: j + 1,
                            second: i + 1,
                            params: describe(&params.iter().zip(&row).collect::<Vec<_>>()),
                        });
                    }
                    rows.push(row);
                }
                (params, Values::Trials(rows))
            }
        };
        if params.is_empty() {
            return Err(SweepError::NoParameters);
        }
        Ok(SweepFile {
            id,
            params,
            values,
            job: raw.job,
            early_stop: RawEarlyStop {
                rule: raw.sweep.early_stop,
                keep: raw.sweep.keep,
                band: raw.sweep.band,
                min_epochs: raw.sweep.min_epochs,
            },
        })
    }

    /// The early stopping every trial of a sweep of `trials` trials gets: the file's keys,
    /// the rest at their defaults (rule `predicted`; `keep` the default, 1, or every trial
    /// of a smaller sweep). Refuses a `keep` above the trial count and out-of-range values.
    pub fn early_stop_spec(&self, trials: usize) -> Result<EarlyStopSpec, SweepError> {
        let trials_u32 = u32::try_from(trials).unwrap_or(u32::MAX);
        let d = EarlyStopSpec::default();
        let spec = EarlyStopSpec {
            rule: self.early_stop.rule.unwrap_or(d.rule),
            keep: self
                .early_stop
                .keep
                .unwrap_or(DEFAULT_EARLY_STOP_KEEP.min(trials_u32.max(1))),
            band: self.early_stop.band.unwrap_or(d.band),
            min_epochs: self.early_stop.min_epochs.unwrap_or(d.min_epochs),
        };
        if spec.keep > trials_u32 {
            return Err(SweepError::KeepAboveTrials {
                keep: spec.keep,
                trials,
            });
        }
        spec.validate().map_err(SweepError::EarlyStop)?;
        Ok(spec)
    }

    /// Number of trials the sweep expands to (saturating; a grid's product can be huge).
    pub fn count(&self) -> u128 {
        match &self.values {
            Values::Grid(lists) => lists
                .iter()
                .fold(1u128, |n, l| n.saturating_mul(l.len() as u128)),
            Values::Trials(rows) => rows.len() as u128,
        }
    }

    /// Every trial's parameter values, in trial order.
    fn combinations(&self) -> Vec<Vec<String>> {
        match &self.values {
            Values::Trials(rows) => rows.clone(),
            Values::Grid(lists) => {
                let mut out: Vec<Vec<String>> = vec![Vec::new()];
                for list in lists {
                    out = out
                        .into_iter()
                        .flat_map(|prefix| {
                            list.iter().map(move |v| {
                                let mut row = prefix.clone();
                                row.push(v.clone());
                                row
                            })
                        })
                        .collect();
                }
                out
            }
        }
    }

    /// Expands the sweep into at most `max_trials` validated trial specs, or refuses it.
    pub fn expand(&self, max_trials: usize) -> Result<Sweep, SweepError> {
        let count = self.count();
        if count > max_trials as u128 {
            return Err(SweepError::TooManyTrials {
                count,
                max: max_trials,
            });
        }
        let count = count as usize;
        let width = count.to_string().len();
        let longest = format!("{}-{count:0width$}", self.id);
        if longest.len() > MAX_ID_LEN {
            return Err(SweepError::IdTooLong {
                id: self.id.to_string(),
                len: longest.len(),
                longest,
            });
        }
        for key in ["id", "sweep", "early_stop"] {
            if self.job.contains_key(key) {
                return Err(SweepError::ReservedKey(key));
            }
        }
        if let Some(toml::Value::Table(labels)) = self.job.get("labels")
            && let Some(k) = labels.keys().find(|k| k.starts_with(PARAM_LABEL_PREFIX))
        {
            return Err(SweepError::LabelClash(k.clone()));
        }
        self.check_placeholders()?;
        let early_stop = self.early_stop_spec(count)?;
        let mut trials = Vec::with_capacity(count);
        for (n, row) in self.combinations().into_iter().enumerate() {
            let params: Vec<(String, String)> = self.params.iter().cloned().zip(row).collect();
            let id = JobId::new(format!("{}-{:0width$}", self.id, n + 1)).map_err(|source| {
                SweepError::BadId {
                    id: self.id.to_string(),
                    source,
                }
            })?;
            let spec = self
                .trial_spec(&id, &params, early_stop)
                .map_err(|source| SweepError::Trial {
                    trial: id.clone(),
                    params: describe(&params),
                    source: Box::new(source),
                })?;
            trials.push(Trial { spec, params });
        }
        Ok(Sweep {
            id: self.id.clone(),
            params: self.params.clone(),
            trials,
        })
    }

    /// Every placeholder names a parameter, and every parameter is used in `command` or `env`.
    fn check_placeholders(&self) -> Result<(), SweepError> {
        let mut used: BTreeSet<String> = BTreeSet::new();
        for (field, text, counts) in template_strings(&self.job) {
            for name in placeholders(text) {
                if !self.params.iter().any(|p| p == name) {
                    return Err(SweepError::UndefinedPlaceholder {
                        name: name.into(),
                        field,
                        defined: self.params.clone(),
                    });
                }
                if counts {
                    used.insert(name.into());
                }
            }
        }
        match self.params.iter().find(|p| !used.contains(*p)) {
            Some(p) => Err(SweepError::UnusedParameter(p.clone())),
            None => Ok(()),
        }
    }

    /// The template with the trial's values, id, sweep and parameter labels, parsed and
    /// validated as a job spec.
    fn trial_spec(
        &self,
        id: &JobId,
        params: &[(String, String)],
        early_stop: EarlyStopSpec,
    ) -> Result<JobSpec, JobSpecError> {
        let values: BTreeMap<&str, &str> = params
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let mut job = self.job.clone();
        let subst = |v: &mut toml::Value| {
            if let toml::Value::String(s) = v {
                *s = substitute(s, &values);
            }
        };
        if let Some(toml::Value::Array(args)) = job.get_mut("command") {
            args.iter_mut().for_each(subst);
        }
        for table in ["env", "labels"] {
            if let Some(toml::Value::Table(t)) = job.get_mut(table) {
                t.iter_mut().for_each(|(_, v)| subst(v));
            }
        }
        let labels = job
            .entry("labels")
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(labels) = labels {
            for (k, v) in params {
                labels.insert(
                    format!("{PARAM_LABEL_PREFIX}{k}"),
                    toml::Value::String(v.clone()),
                );
            }
        }
        job.insert("id".into(), toml::Value::String(id.to_string()));
        job.insert("sweep".into(), toml::Value::String(self.id.to_string()));
        let mut spec: JobSpec = toml::Value::Table(job).try_into()?;
        spec.early_stop = Some(early_stop);
        spec.validate()?;
        Ok(spec)
    }
}

/// Strings of the template that may hold placeholders: `(field, text, counts as a use)`.
/// Labels may name parameters but do not count as using them (they change no run).
fn template_strings(job: &toml::Table) -> Vec<(String, &str, bool)> {
    let mut out = Vec::new();
    if let Some(toml::Value::Array(args)) = job.get("command") {
        for (i, a) in args.iter().enumerate() {
            if let Some(s) = a.as_str() {
                out.push((format!("command[{i}]"), s, true));
            }
        }
    }
    for (table, counts) in [("env", true), ("labels", false)] {
        if let Some(toml::Value::Table(t)) = job.get(table) {
            for (k, v) in t {
                if let Some(s) = v.as_str() {
                    out.push((format!("{table}.{k}"), s, counts));
                }
            }
        }
    }
    out
}

fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn check_name(p: &str) -> Result<(), SweepError> {
    if is_name(p) {
        Ok(())
    } else {
        Err(SweepError::BadParamName(p.into()))
    }
}

/// Splits `s` into literal text and placeholder names, calling `f` for each piece:
/// `Ok(text)` for literal text (`{{` already unescaped), `Err(name)` for `{name}`.
fn scan<'a>(s: &'a str, mut f: impl FnMut(Result<&'a str, &'a str>)) {
    let mut rest = s;
    while let Some(i) = rest.find('{') {
        f(Ok(&rest[..i]));
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('{') {
            f(Ok("{"));
            rest = tail;
            continue;
        }
        match after.find('}') {
            Some(j) if is_name(&after[..j]) => {
                f(Err(&after[..j]));
                rest = &after[j + 1..];
            }
            _ => {
                f(Ok("{"));
                rest = after;
            }
        }
    }
    f(Ok(rest));
}

/// The placeholder names in `s`, in order.
fn placeholders(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    scan(s, |piece| {
        if let Err(name) = piece {
            out.push(name);
        }
    });
    out
}

/// `s` with every `{name}` replaced by its value (names were checked beforehand; an unknown
/// one is kept as written) and `{{` by `{`.
fn substitute(s: &str, values: &BTreeMap<&str, &str>) -> String {
    let mut out = String::with_capacity(s.len());
    scan(s, |piece| match piece {
        Ok(text) => out.push_str(text),
        Err(name) => match values.get(name) {
            Some(v) => out.push_str(v),
            None => {
                let _ = write!(out, "{{{name}}}");
            }
        },
    });
    out
}

/// A parameter value as the text placeholders and labels get.
fn format_value(param: &str, v: &toml::Value) -> Result<String, SweepError> {
    let bad = || SweepError::BadValue {
        param: param.into(),
        value: v.to_string(),
    };
    Ok(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Float(f) if f.is_finite() => format_float(*f),
        _ => return Err(bad()),
    })
}

/// The shortest text that reads back as `f`, always with a decimal point: `0.05`, `0.0001`
/// (for `1e-4`), `1.0`, `-2.5`.
fn format_float(f: f64) -> String {
    let s = f.to_string();
    if s.contains('.') { s } else { format!("{s}.0") }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEMPLATE: &str = r#"
[job]
command = ["converge-trainer", "--dataset", "optdigits", "--lr", "{lr}", "--batch-size", "{batch}"]
max_workers = 4
[job.stop]
deadline_s = 900
[job.stop.plateau]
min_improvement = 0.01
window_epochs = 2
[job.labels]
dataset = "optdigits"
"#;

    fn grid(params: &str) -> String {
        format!("[sweep]\nid = \"opt\"\n[sweep.grid]\n{params}\n{TEMPLATE}")
    }

    fn refused(text: &str, max: usize) -> SweepError {
        match expand(text, max) {
            Ok(s) => panic!("accepted with {} trials", s.trials.len()),
            Err(e) => e,
        }
    }

    fn assert_refused(text: &str, max: usize, expect: &str) {
        let e = refused(text, max).to_string();
        assert!(
            e.contains(expect),
            "error {e:?} does not mention {expect:?}"
        );
    }

    fn with_sweep_keys(keys: &str, params: &str) -> String {
        format!("[sweep]\nid = \"opt\"\n{keys}\n[sweep.grid]\n{params}\n{TEMPLATE}")
    }

    #[test]
    fn trials_get_the_sweeps_early_stopping_with_defaults_filled() {
        let s = expand(&grid("lr = [0.01, 0.05, 0.2]\nbatch = [16]"), 64).unwrap();
        for t in &s.trials {
            assert_eq!(t.spec.early_stop, Some(EarlyStopSpec::default()));
        }
        let s = expand(&grid("lr = [0.01]\nbatch = [16]"), 64).unwrap();
        assert_eq!(
            s.trials[0].spec.early_stop.unwrap().keep,
            1,
            "a one-trial sweep keeps its trial"
        );
        let s = expand(
            &with_sweep_keys(
                "early_stop = \"asha\"\nkeep = 3\nmin_epochs = 0.5",
                "lr = [0.01, 0.05, 0.2]\nbatch = [16]",
            ),
            64,
        )
        .unwrap();
        let e = s.trials[2].spec.early_stop.unwrap();
        assert_eq!(
            (e.rule, e.keep, e.min_epochs, e.band),
            (
                EarlyStopRule::Asha,
                3,
                0.5,
                crate::jobspec::DEFAULT_EARLY_STOP_BAND
            )
        );
        // The spec round-trips through TOML as the allocator reads it.
        let text = toml::to_string(&s.trials[0].spec).unwrap();
        assert_eq!(JobSpec::from_toml(&text).unwrap(), s.trials[0].spec);
    }

    #[test]
    fn bad_early_stopping_is_refused_at_submit() {
        let three = "lr = [0.01, 0.05, 0.2]\nbatch = [16]";
        assert_refused(
            &with_sweep_keys("early_stop = \"median\"", three),
            64,
            "unknown variant `median`",
        );
        assert_refused(
            &with_sweep_keys("keep = 4", three),
            64,
            "`[sweep] keep` is 4 but the sweep has 3 trials",
        );
        assert_refused(&with_sweep_keys("keep = 0", three), 64, "`keep` is 0");
        assert_refused(&with_sweep_keys("band = 1.5", three), 64, "`band` is 1.5");
        assert_refused(&with_sweep_keys("band = 0.3", three), 64, "`band` is 0.3");
        assert_refused(
            &with_sweep_keys("min_epochs = 0", three),
            64,
            "`min_epochs` is 0",
        );
        let t = TEMPLATE.replace("[job]\n", "[job]\nearly_stop = { rule = \"none\" }\n");
        assert_refused(
            &format!("[sweep]\nid = \"opt\"\n[sweep.grid]\n{three}\n{t}"),
            64,
            "`[job]` may not set `early_stop`",
        );
        // A job that is no trial may not carry it.
        let job = "id = \"j\"\ncommand = [\"x\"]\nearly_stop = { rule = \"asha\" }\n";
        let e = JobSpec::from_toml(job).unwrap_err().to_string();
        assert!(e.contains("only a sweep's trials stop early"), "{e}");
        let trial = format!("{job}sweep = \"s\"\n");
        assert!(JobSpec::from_toml(&trial).is_ok());
    }

    #[test]
    fn a_grid_expands_to_every_combination_in_file_order() {
        let s = expand(&grid("lr = [0.01, 0.05, 0.2]\nbatch = [16, 64]"), 64).unwrap();
        assert_eq!(s.id.as_str(), "opt");
        assert_eq!(s.params, ["lr", "batch"]);
        let got: Vec<(String, String)> = s
            .trials
            .iter()
            .map(|t| (t.spec.id.to_string(), describe(&t.params)))
            .collect();
        let want = [
            ("opt-1", "lr=0.01, batch=16"),
            ("opt-2", "lr=0.01, batch=64"),
            ("opt-3", "lr=0.05, batch=16"),
            ("opt-4", "lr=0.05, batch=64"),
            ("opt-5", "lr=0.2, batch=16"),
            ("opt-6", "lr=0.2, batch=64"),
        ];
        assert_eq!(
            got,
            want.map(|(a, b)| (a.to_string(), b.to_string())).to_vec()
        );
        let t = &s.trials[2].spec;
        assert_eq!(
            t.command,
            [
                "converge-trainer",
                "--dataset",
                "optdigits",
                "--lr",
                "0.05",
                "--batch-size",
                "16"
            ]
        );
        assert_eq!(t.sweep.as_ref().map(JobId::as_str), Some("opt"));
        assert_eq!(t.labels["param.lr"], "0.05");
        assert_eq!(t.labels["param.batch"], "16");
        assert_eq!(t.labels["dataset"], "optdigits");
        assert_eq!(trial_params(t), [("batch", "16"), ("lr", "0.05")]);
        assert_eq!(t.max_workers(), 4);
        let stop = t.stop.unwrap();
        assert_eq!(stop.deadline_s, Some(900.0));
        assert_eq!(stop.plateau.unwrap().window_epochs, 2.0);

        // The file's order, not the alphabet's: `batch` first varies slowest now.
        let s = expand(&grid("batch = [16, 64]\nlr = [0.01, 0.05, 0.2]"), 64).unwrap();
        assert_eq!(describe(&s.trials[1].params), "batch=16, lr=0.05");
    }

    #[test]
    fn ids_are_padded_to_sort_in_trial_order() {
        let s = expand(&grid("lr = [1, 2, 3, 4, 5, 6]\nbatch = [\"a\", \"b\"]"), 12).unwrap();
        let ids: Vec<&str> = s.trials.iter().map(|t| t.spec.id.as_str()).collect();
        assert_eq!(ids.first(), Some(&"opt-01"));
        assert_eq!(ids.last(), Some(&"opt-12"));
        assert!(ids.is_sorted());
    }

    #[test]
    fn values_are_written_as_the_file_reads() {
        for (value, text) in [
            ("0.05", "0.05"),
            ("1e-4", "0.0001"),
            ("1.0", "1.0"),
            ("-2.5", "-2.5"),
            ("3", "3"),
            ("true", "true"),
            ("\"mlp\"", "mlp"),
            ("0.1", "0.1"),
            ("2.5e3", "2500.0"),
        ] {
            let s = expand(&grid(&format!("lr = [{value}]\nbatch = [8]")), 1).unwrap();
            assert_eq!(s.trials[0].spec.command[4], text, "{value}");
        }
        assert_eq!(format_float(0.1 + 0.2), "0.30000000000000004");
    }

    #[test]
    fn listed_trials_keep_their_order_and_values() {
        let text = format!(
            "[sweep]\nid = \"opt\"\n[[sweep.trials]]\nlr = 0.01\nbatch = 16\n[[sweep.trials]]\nbatch = 64\nlr = 0.2\n{TEMPLATE}"
        );
        let s = expand(&text, 2).unwrap();
        assert_eq!(s.params, ["lr", "batch"]);
        assert_eq!(describe(&s.trials[0].params), "lr=0.01, batch=16");
        assert_eq!(describe(&s.trials[1].params), "lr=0.2, batch=64");
        assert_eq!(s.trials[1].spec.id.as_str(), "opt-2");
    }

    #[test]
    fn placeholders_fill_env_and_labels_and_braces_escape() {
        let text = r#"
[sweep]
id = "e"
[sweep.grid]
model = ["mlp"]
lr = [0.5]
[job]
command = ["run", "--json={\"a\": 1}", "{{model}", "x{lr}y"]
[job.env]
MODEL = "{model}"
[job.labels]
model = "{model}"
note = "lr {lr}"
"#;
        let s = expand(text, 1).unwrap();
        let spec = &s.trials[0].spec;
        assert_eq!(
            spec.command,
            ["run", "--json={\"a\": 1}", "{model}", "x0.5y"]
        );
        assert_eq!(spec.env["MODEL"], "mlp");
        assert_eq!(spec.labels["model"], "mlp");
        assert_eq!(spec.labels["note"], "lr 0.5");
        assert_eq!(spec.labels["param.model"], "mlp");
    }

    #[test]
    fn too_many_trials_are_refused_with_the_count_never_truncated() {
        let text = grid("lr = [0.01, 0.05, 0.2]\nbatch = [16, 64]");
        let e = refused(&text, 5);
        assert!(
            matches!(e, SweepError::TooManyTrials { count: 6, max: 5 }),
            "{e:?}"
        );
        assert!(e.to_string().contains("expands to 6 trials"), "{e}");
        assert_eq!(expand(&text, 6).unwrap().trials.len(), 6);
        // A product that does not fit any machine word is counted, not overflowed.
        let big: Vec<String> = (0..40).map(|i| i.to_string()).collect();
        let huge: String = (0..25)
            .map(|p| format!("p{p} = [{}]\n", big.join(", ")))
            .collect();
        let e = refused(&grid(&format!("{huge}lr = [1]\nbatch = [1]")), 64);
        assert!(
            matches!(e, SweepError::TooManyTrials { count, .. } if count == u128::MAX),
            "{e:?}"
        );
    }

    #[test]
    fn every_refusal_says_why() {
        let both = format!(
            "[sweep]\nid = \"opt\"\n[sweep.grid]\nlr = [1]\nbatch = [1]\n[[sweep.trials]]\nlr = 1\nbatch = 1\n{TEMPLATE}"
        );
        assert_refused(&both, 64, "both `grid` and `trials`");
        assert_refused(
            &format!("[sweep]\nid = \"opt\"\n{TEMPLATE}"),
            64,
            "neither `grid` nor `trials`",
        );
        assert_refused(
            &format!("[sweep]\nid = \"opt\"\ntrials = []\n{TEMPLATE}"),
            64,
            "empty list",
        );
        assert_refused(&grid(""), 64, "names no parameter");
        assert_refused(
            &grid("lr = []\nbatch = [1]"),
            64,
            "`lr` has an empty list of values",
        );
        assert_refused(&grid("lr = 0.1\nbatch = [1]"), 64, "`lr = [0.01, 0.1]`");
        assert_refused(
            &grid("lr = [[0.1]]\nbatch = [1]"),
            64,
            "`lr` has the value [0.1]",
        );
        assert_refused(&grid("lr = [nan]\nbatch = [1]"), 64, "finite floats");
        assert_refused(
            &grid("lr = [0.1, 0.10]\nbatch = [1]"),
            64,
            "`lr` lists the value 0.1 twice",
        );
        assert_refused(
            &grid("lr = [0.1]\nbatch = [1]\n\"a.b\" = [1]"),
            64,
            "\"a.b\" is not valid",
        );
        let differing = format!(
            "[sweep]\nid = \"opt\"\n[[sweep.trials]]\nlr = 0.01\nbatch = 16\n[[sweep.trials]]\nlr = 0.2\n{TEMPLATE}"
        );
        let e = refused(&differing, 64);
        assert!(
            matches!(&e, SweepError::DifferingKeys { trial: 2, got, .. } if got == &["lr"]),
            "{e:?}"
        );
        let same = format!(
            "[sweep]\nid = \"opt\"\n[[sweep.trials]]\nlr = 0.2\nbatch = 16\n[[sweep.trials]]\nlr = 0.2\nbatch = 16\n{TEMPLATE}"
        );
        assert_refused(
            &same,
            64,
            "trials 1 and 2 are the same trial (lr=0.2, batch=16)",
        );
        // Placeholders: one without a parameter, a parameter without a placeholder.
        let e = refused(&grid("lr = [0.1]"), 64).to_string();
        assert!(
            e.contains("`command[6]` uses the placeholder {batch}") && e.contains("[\"lr\"]"),
            "{e}"
        );
        assert_refused(
            &grid("lr = [0.1]\nbatch = [1]\nseed = [1, 2]"),
            64,
            "parameter `seed` is used by no placeholder",
        );
        // A parameter named only in a label changes no run.
        let label_only = TEMPLATE.replace("dataset = \"optdigits\"", "seed = \"{seed}\"");
        assert_refused(
            &format!(
                "[sweep]\nid = \"opt\"\n[sweep.grid]\nlr = [0.1]\nbatch = [1]\nseed = [1]\n{label_only}"
            ),
            64,
            "`seed` is used by no placeholder",
        );
        assert_refused(
            &grid("lr = [0.1]\nbatch = [1]").replace("[job]\n", "[job]\nid = \"x\"\n"),
            64,
            "`[job]` may not set `id`",
        );
        assert_refused(
            &grid("lr = [0.1]\nbatch = [1]").replace("[job]\n", "[job]\nsweep = \"x\"\n"),
            64,
            "may not set `sweep`",
        );
        assert_refused(
            &grid("lr = [0.1]\nbatch = [1]").replace("id = \"opt\"", "id = \"o.p\""),
            64,
            "sweep id \"o.p\" is not valid",
        );
        let long = "a".repeat(62);
        let e = refused(
            &grid("lr = [0.1, 0.2]\nbatch = [1, 2, 3, 4, 5]").replace("opt", &long),
            64,
        );
        assert!(
            matches!(&e, SweepError::IdTooLong { len: 65, longest, .. } if longest.ends_with("-10")),
            "{e:?}"
        );
        assert!(
            expand(
                &grid("lr = [0.1, 0.2]\nbatch = [1]").replace("opt", &long),
                64
            )
            .is_ok(),
            "62 + \"-2\" fits"
        );
        assert_refused(
            &grid("lr = [0.1]\nbatch = [1]").replace("[sweep]\n", "bogus = 1\n[sweep]\n"),
            64,
            "unknown field `bogus`",
        );
        assert_refused(
            "[sweep]\nid = \"opt\"\n[sweep.grid]\nlr = [1]\n",
            64,
            "missing field `job`",
        );
    }

    #[test]
    fn a_clashing_label_is_refused() {
        let text = grid("lr = [0.1]\nbatch = [1]").replace(
            "dataset = \"optdigits\"",
            "dataset = \"optdigits\"\n\"param.lr\" = \"mine\"",
        );
        let e = refused(&text, 64);
        assert!(
            matches!(&e, SweepError::LabelClash(l) if l == "param.lr"),
            "{e:?}"
        );
    }

    #[test]
    fn invalid_trials_name_the_trial_and_its_values() {
        let text = grid("lr = [0.1]\nbatch = [1, 2]").replace("max_workers = 4", "max_workers = 0");
        let e = refused(&text, 64);
        let msg = e.to_string();
        assert!(
            msg.starts_with("trial opt-1 (lr=0.1, batch=1) refused: `max_workers` (0)"),
            "{msg}"
        );
        // The values reach validation: a value that makes a bad env name would be refused
        // by the spec's own check, and a value in a reserved variable too.
        let text = grid("lr = [0.1]\nbatch = [1]").replace(
            "[job.labels]",
            "[job.env]\nRANK = \"{batch}\"\n[job.labels]",
        );
        assert_refused(
            &text,
            64,
            "trial opt-1 (lr=0.1, batch=1) refused: `env` may not set RANK",
        );
        let text = grid("lr = [0.1]\nbatch = [1]").replace("max_workers = 4", "gpus = 2");
        assert_refused(&text, 64, "unknown field `gpus`");
    }

    #[test]
    fn ids_in_use_and_sweeps_in_use_are_refused() {
        let s = expand(&grid("lr = [0.1, 0.2]\nbatch = [1]"), 64).unwrap();
        let other = JobSpec::from_toml("id = \"other\"\ncommand = [\"t\"]\n").unwrap();
        check_unused(&s, [&other]).unwrap();
        let taken = JobSpec::from_toml("id = \"opt-2\"\ncommand = [\"t\"]\n").unwrap();
        assert_refused_with(
            check_unused(&s, [&other, &taken]),
            "job opt-2 already exists",
        );
        let mut earlier = other.clone();
        earlier.sweep = Some(JobId::new("opt").unwrap());
        assert_refused_with(
            check_unused(&s, [&earlier]),
            "sweep opt already exists (1 trials)",
        );
    }

    fn assert_refused_with(r: Result<(), SweepError>, expect: &str) {
        let e = r.unwrap_err().to_string();
        assert!(e.contains(expect), "{e:?} does not mention {expect:?}");
    }

    #[test]
    fn sweep_files_are_told_from_job_specs() {
        assert!(is_sweep_file(&grid("lr = [1]\nbatch = [1]")));
        assert!(is_sweep_file("[sweep.grid]\nlr = [1\n"));
        assert!(!is_sweep_file("id = \"j\"\ncommand = [\"t\"]\n"));
        assert!(!is_sweep_file("id = \"j\"\ncommand = [\n"));
    }

    #[test]
    fn the_example_sweeps_expand_and_validate() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/sweeps");
        let mut files = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(is_sweep_file(&text), "{path:?}");
            let s = expand(&text, DEFAULT_MAX_TRIALS).unwrap_or_else(|e| panic!("{path:?}: {e}"));
            assert!(s.trials.len() >= 2, "{path:?}");
            for t in &s.trials {
                assert!(t.spec.stop.is_some(), "{path:?}: trials stop by themselves");
            }
            files += 1;
        }
        assert!(files >= 1);
    }
}

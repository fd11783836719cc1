//! Throughput per (job, GPU type): what a job measured on each type it ran on, and a
//! projection for the types it has not run on yet.
//!
//! A job's **speed** on a type is its compute throughput per GPU there, samples per second:
//! `b / compute_time_s(b)` of the throughput model fitted on the job's step observations on
//! that type alone ([`crate::throughput::ThroughputModel::compute_time_s`]), at the job's
//! latest per-worker batch `b` (the same `b` for every type, so that the ratios compare like
//! with like). Synchronization is left out: it depends on the placement, not the GPU type.
//!
//! **Projection.** For a type `u` the job has not measured, from a type `t` it has measured
//! (its fastest one): `speed(u) = speed(t) · ρ(u, t)`, with `ρ(u, t)` the median over the
//! other jobs that measured both `u` and `t` of `speed(u) / speed(t)`, taken over the jobs of
//! the same family (the same model: the simulator's application, a job spec's `model` label)
//! when at least one such job measured both, otherwise over every job. With no job that
//! measured both, the ratio of the two types' **nominal speeds** is used where the hosts
//! report them (`gpu.speed`, [`converge_common::labels::GPU_SPEED`]: a fake GPU source's
//! configured speed): it starts a cluster whose jobs have each run on one type only, and is
//! replaced by measured ratios as soon as one job has run on both. Without either, the type
//! stays unknown. Sia (Jayaram Subramanya et al., SOSP'23, §4.2)
//! instead profiles every new job on one GPU of each type and scales the model learned on
//! one type by the profiled ratio; learning the ratios from the jobs already running costs no
//! profiling run and, within a family, carries the ratio a profile would measure (the
//! families' GPU-type ratios differ widely: BERT gains far more from an A100 than CIFAR-10
//! does, which is what makes matching jobs to types pay).
//!
//! Pure: no clock, no I/O.

use std::collections::BTreeMap;

use crate::throughput::ThroughputModel;

/// A job's speed on a GPU type from the model fitted on its observations there: `b /
/// compute_time_s(b)` samples per second per GPU at per-worker batch `b`; `None` when that
/// is not finite and positive.
pub fn speed(model: &ThroughputModel, local_batch: f64) -> Option<f64> {
    let v = local_batch / model.compute_time_s(local_batch);
    usable(v).then_some(v)
}

/// A job's speed on one GPU type: compute throughput per GPU, samples per second (see the
/// module docs), measured there or projected from another type ([`project`]).
pub use converge_common::GpuTypeSpeed as TypeSpeed;

/// One job's input to [`project`]: its family and what it measured per type (samples per
/// second per GPU; non-finite or non-positive values are ignored).
#[derive(Debug, Clone, Copy)]
pub struct Measured<'a> {
    pub family: Option<&'a str>,
    pub speeds: &'a BTreeMap<String, f64>,
}

fn usable(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

/// The median of `v` (the mean of the middle two for an even count); `None` when empty.
pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Every job's speed on each of `types`: measured where it measured it, projected where a
/// ratio is known (see the module docs), absent otherwise. Output in the order of `jobs`.
/// `O(jobs² · types)` in the worst case (every job compared with every other of its family
/// for each type pair it needs); jobs measure few types, so in practice linear.
///
/// `nominal`: each type's nominal speed (any unit, the same for all types; types without one
/// left out), the last resort for a ratio.
pub fn project(
    jobs: &[Measured<'_>],
    types: &[&str],
    nominal: &BTreeMap<&str, f64>,
) -> Vec<BTreeMap<String, TypeSpeed>> {
    // Ratios speed(u) / speed(t) per (family, u, t) and per (u, t) over all jobs.
    let mut by_family: BTreeMap<(&str, &str, &str), Vec<f64>> = BTreeMap::new();
    let mut overall: BTreeMap<(&str, &str), Vec<f64>> = BTreeMap::new();
    for job in jobs {
        for (u, &su) in job.speeds.iter().filter(|(_, v)| usable(**v)) {
            for (t, &st) in job.speeds.iter().filter(|(_, v)| usable(**v)) {
                if u == t {
                    continue;
                }
                overall.entry((u, t)).or_default().push(su / st);
                if let Some(f) = job.family {
                    by_family.entry((f, u, t)).or_default().push(su / st);
                }
            }
        }
    }
    let by_family: BTreeMap<_, f64> = by_family
        .into_iter()
        .filter_map(|(k, v)| Some((k, median(v)?)))
        .collect();
    let overall: BTreeMap<_, f64> = overall
        .into_iter()
        .filter_map(|(k, v)| Some((k, median(v)?)))
        .collect();
    jobs.iter()
        .map(|job| {
            let mut out: BTreeMap<String, TypeSpeed> = job
                .speeds
                .iter()
                .filter(|(_, v)| usable(**v))
                .map(|(t, &v)| {
                    (
                        t.clone(),
                        TypeSpeed {
                            samples_per_s: v,
                            measured: true,
                        },
                    )
                })
                .collect();
            // The measured types, fastest first: the projection's base.
            let mut bases: Vec<(String, f64)> = out
                .iter()
                .map(|(t, s)| (t.clone(), s.samples_per_s))
                .collect();
            bases.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            for &u in types {
                if out.contains_key(u) {
                    continue;
                }
                let ratio = |t: &str| {
                    job.family
                        .and_then(|f| by_family.get(&(f, u, t)))
                        .or_else(|| overall.get(&(u, t)))
                        .copied()
                        .or_else(|| {
                            let (nu, nt) = (nominal.get(u)?, nominal.get(t)?);
                            Some(nu / nt).filter(|r| usable(*r))
                        })
                };
                if let Some(projected) = bases
                    .iter()
                    .find_map(|(t, speed)| ratio(t).map(|r| speed * r))
                    .filter(|v| usable(*v))
                {
                    out.insert(
                        u.to_string(),
                        TypeSpeed {
                            samples_per_s: projected,
                            measured: false,
                        },
                    );
                }
            }
            out
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn speeds(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|&(t, v)| (t.to_string(), v)).collect()
    }

    #[test]
    fn unmeasured_types_are_projected_from_the_same_familys_ratio_first() {
        // bert gains 4× on a100, cifar10 1.5×; a new bert job measured only t4.
        let bert_a = speeds(&[("t4", 10.0), ("a100", 40.0)]);
        let bert_b = speeds(&[("t4", 20.0), ("a100", 80.0)]);
        let cifar = speeds(&[("t4", 100.0), ("a100", 150.0)]);
        let new_bert = speeds(&[("t4", 5.0)]);
        let new_other = speeds(&[("t4", 7.0)]);
        let lone = speeds(&[("rtx", 3.0)]);
        let jobs = [
            Measured {
                family: Some("bert"),
                speeds: &bert_a,
            },
            Measured {
                family: Some("bert"),
                speeds: &bert_b,
            },
            Measured {
                family: Some("cifar10"),
                speeds: &cifar,
            },
            Measured {
                family: Some("bert"),
                speeds: &new_bert,
            },
            Measured {
                family: Some("resnet"),
                speeds: &new_other,
            },
            Measured {
                family: None,
                speeds: &lone,
            },
        ];
        let out = project(&jobs, &["t4", "a100", "rtx"], &BTreeMap::new());
        // Measured values are kept as measured.
        assert_eq!(
            out[0]["a100"],
            TypeSpeed {
                samples_per_s: 40.0,
                measured: true
            }
        );
        // The new bert job: bert's own ratio (4), not the all-jobs median (of 4, 4, 1.5).
        assert_eq!(
            out[3]["a100"],
            TypeSpeed {
                samples_per_s: 20.0,
                measured: false
            }
        );
        // A family with no job on a100: the ratio over every job, median of 4, 4, 1.5.
        assert!((out[4]["a100"].samples_per_s - 28.0).abs() < 1e-9);
        // No job measured rtx with anything else: rtx stays unknown for everyone, and so
        // does every type for the job that measured only rtx.
        assert!(out.iter().take(5).all(|o| !o.contains_key("rtx")));
        assert_eq!(out[5].len(), 1);
    }

    #[test]
    fn bad_measurements_are_ignored() {
        let a = speeds(&[("t4", f64::NAN), ("a100", 0.0)]);
        let b = speeds(&[("t4", 1.0), ("a100", 2.0)]);
        let jobs = [
            Measured {
                family: None,
                speeds: &a,
            },
            Measured {
                family: None,
                speeds: &b,
            },
        ];
        let out = project(&jobs, &["t4", "a100"], &BTreeMap::new());
        assert!(out[0].is_empty());
        assert_eq!(out[1].len(), 2);
    }

    #[test]
    fn without_a_job_that_measured_both_types_the_nominal_speeds_give_the_ratio() {
        let on_t4 = speeds(&[("t4", 10.0)]);
        let on_a100 = speeds(&[("a100", 30.0)]);
        let jobs = [
            Measured {
                family: Some("mlp"),
                speeds: &on_t4,
            },
            Measured {
                family: Some("mlp"),
                speeds: &on_a100,
            },
        ];
        let types = ["t4", "a100"];
        // Without nominal speeds no ratio is known.
        let out = project(&jobs, &types, &BTreeMap::new());
        assert!(!out[0].contains_key("a100") && !out[1].contains_key("t4"));
        let nominal = BTreeMap::from([("t4", 0.25), ("a100", 1.0)]);
        let out = project(&jobs, &types, &nominal);
        assert_eq!(
            out[0]["a100"],
            TypeSpeed {
                samples_per_s: 40.0,
                measured: false
            }
        );
        assert_eq!(out[1]["t4"].samples_per_s, 7.5);
        // A job that measured both replaces the nominal ratio with its own (2×).
        let both = speeds(&[("t4", 10.0), ("a100", 20.0)]);
        let jobs = [
            jobs[0],
            Measured {
                family: Some("mlp"),
                speeds: &both,
            },
        ];
        let out = project(&jobs, &types, &nominal);
        assert_eq!(out[0]["a100"].samples_per_s, 20.0);
        // A type without a nominal speed stays unknown.
        let out = project(&jobs[..1], &["t4", "h100"], &nominal);
        assert!(!out[0].contains_key("h100"));
    }
}

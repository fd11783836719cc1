//! `converge jobs --sweep ID`: a sweep's trials ranked best first, as a table or as JSON
//! (the same ranking).
//!
//! **Ranking.** By **held-out loss** (`eval_loss`, the latest rank 0 reported) when every
//! trial that reports a loss reports one: a sweep picks the model that generalizes, and the
//! allocator's early stopping judges trials the same way ([`converge_common::EarlyStopRule`]).
//! As there, a trial that has not ended, has not evaluated yet and is still in its first
//! `min_epochs` epochs (its sweep's early-stopping setting, 1 without one; the epoch from
//! `status.epoch_samples`) does not count: a trial that starts late does not switch the
//! ranking to training loss until its first evaluation. It is ranked after the evaluated
//! trials meanwhile.
//! Failed and cancelled trials do not count either. Otherwise (a trial reports no held-out
//! loss; the table's title says which) a trial's
//! score is its predicted training loss (for an ended trial the loss its fitted curve
//! predicts it would have reached, `status.end.predicted_loss`; for the others the
//! allocator's one-horizon prediction, `status.predicted_loss`), or its current loss while it
//! has no prediction. Lower is better; ties go to the lower current loss, then to the trial
//! id. Trials without any loss yet come last, in id order.

use crate::tables;
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use converge_common::sweep::trial_params;
use converge_common::{JobId, JobPhase, JobSpec, JobStatus};
use serde_json::json;
use std::cmp::Ordering;
use std::collections::BTreeSet;

/// One trial in the ranking.
#[derive(Debug, Clone, Copy)]
pub struct Ranked<'a> {
    /// 1 = best.
    pub rank: usize,
    pub spec: &'a JobSpec,
    pub status: Option<&'a JobStatus>,
}

fn finite(x: Option<f64>) -> Option<f64> {
    x.filter(|v| v.is_finite())
}

impl Ranked<'_> {
    /// Rank 0's latest loss (at the end, for an ended trial).
    pub fn loss(&self) -> Option<f64> {
        let s = self.status?;
        finite(s.end.as_ref().and_then(|e| e.loss).or(s.loss))
    }

    /// The loss the trial is predicted to reach: its fitted curve's at the end for an ended
    /// trial, the allocator's current prediction otherwise.
    pub fn predicted_loss(&self) -> Option<f64> {
        let s = self.status?;
        finite(match &s.end {
            Some(e) => e.predicted_loss,
            None => s.predicted_loss,
        })
    }

    /// GPU-hours of service, known once the trial has ended.
    pub fn gpu_hours(&self) -> Option<f64> {
        self.status?.end.as_ref().map(|e| e.gpu_hours)
    }

    /// Rank 0's latest held-out loss.
    pub fn held_out(&self) -> Option<f64> {
        finite(self.status?.eval_loss)
    }

    /// Not ended, not evaluated yet and still in its first `min_epochs` epochs ([module
    /// docs](self)); `false` while its epoch is unknown.
    pub fn young(&self) -> bool {
        let Some(s) = self.status else { return false };
        let min_epochs = self.spec.early_stop.as_ref().map_or(1.0, |e| e.min_epochs);
        !s.phase.is_terminal()
            && self.held_out().is_none()
            && s.epoch_samples
                .is_some_and(|e| e > 0.0 && (s.samples as f64) < min_epochs * e)
    }

    /// The training-loss score: the predicted loss, else the current loss.
    pub fn score(&self) -> Option<f64> {
        self.predicted_loss().or_else(|| self.loss())
    }

    /// `submitted`, the phase, or the phase with how the trial ended (`completed (converged)`).
    pub fn state(&self) -> String {
        self.status.map_or("submitted".into(), tables::phase)
    }
}

/// What a sweep's trials are ranked by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Basis {
    /// Every trial with a loss reports a held-out loss.
    HeldOut,
    /// Predicted training loss; the first trial (by id) that reports a loss but no held-out
    /// loss, if any.
    Training(Option<JobId>),
    /// Predicted training loss: every trial that reports a loss is still in its first
    /// epochs and none has evaluated yet.
    NotEvaluatedYet,
}

impl Basis {
    /// For the table's title.
    pub fn describe(&self) -> String {
        match self {
            Basis::HeldOut => "ranked by held-out loss".into(),
            Basis::Training(Some(id)) => {
                format!("ranked by predicted training loss: trial {id} reports no held-out loss")
            }
            Basis::Training(None) => {
                "ranked by predicted training loss: no trial reports a loss yet".into()
            }
            Basis::NotEvaluatedYet => {
                "ranked by predicted training loss: no trial has evaluated yet".into()
            }
        }
    }
}

/// What the trials of `rows` are ranked by ([module docs](self)).
pub fn basis(rows: &[Ranked<'_>]) -> Basis {
    // Failed and cancelled trials are no candidates (nor are they for the allocator).
    let mut reporting: Vec<&Ranked<'_>> = rows
        .iter()
        .filter(|r| r.loss().is_some())
        .filter(|r| {
            !r.status
                .is_some_and(|s| matches!(s.phase, JobPhase::Failed | JobPhase::Cancelled))
        })
        .collect();
    reporting.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
    match reporting
        .iter()
        .find(|r| r.held_out().is_none() && !r.young())
    {
        None if reporting.iter().any(|r| r.held_out().is_some()) => Basis::HeldOut,
        None if reporting.is_empty() => Basis::Training(None),
        None => Basis::NotEvaluatedYet,
        Some(r) => Basis::Training(Some(r.spec.id.clone())),
    }
}

/// The trials of `sweep` among `specs`, best first, ranked 1...
pub fn rank<'a>(sweep: &JobId, specs: &'a [JobSpec], statuses: &'a [JobStatus]) -> Vec<Ranked<'a>> {
    let mut rows: Vec<Ranked<'a>> = specs
        .iter()
        .filter(|s| s.sweep.as_ref() == Some(sweep))
        .map(|spec| Ranked {
            rank: 0,
            spec,
            status: statuses.iter().find(|st| st.job == spec.id),
        })
        .collect();
    // None sorts after every value.
    let by = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => a.total_cmp(&b),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    };
    let held_out = basis(&rows) == Basis::HeldOut;
    let score = |r: &Ranked<'_>| if held_out { r.held_out() } else { r.score() };
    rows.sort_by(|a, b| {
        by(score(a), score(b))
            .then_with(|| by(a.loss(), b.loss()))
            .then_with(|| a.spec.id.cmp(&b.spec.id))
    });
    for (i, r) in rows.iter_mut().enumerate() {
        r.rank = i + 1;
    }
    rows
}

/// The sweep's parameter names (of every trial, in name order).
fn param_names(rows: &[Ranked<'_>]) -> Vec<String> {
    let names: BTreeSet<&str> = rows
        .iter()
        .flat_map(|r| trial_params(r.spec).into_iter().map(|(k, _)| k))
        .collect();
    names.into_iter().map(String::from).collect()
}

fn loss(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.4}"))
}

/// The ranking as a table: rank, trial, one column per parameter, state, workers,
/// GPU-hours, loss now, predicted loss.
pub fn table(rows: &[Ranked<'_>]) -> Table {
    let params = param_names(rows);
    let mut header = vec!["RANK".to_string(), "TRIAL".to_string()];
    header.extend(params.iter().cloned());
    header.extend(
        ["STATE", "WORKERS", "GPU-h", "LOSS", "PREDICTED", "HELD-OUT"]
            .into_iter()
            .map(String::from),
    );
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY).set_header(header);
    for r in rows {
        let values = trial_params(r.spec);
        let mut row = vec![r.rank.to_string(), r.spec.id.to_string()];
        row.extend(params.iter().map(|p| {
            values
                .iter()
                .find(|(k, _)| k == p)
                .map_or("-".into(), |(_, v)| v.to_string())
        }));
        row.push(r.state());
        row.push(
            r.status
                .filter(|s| !s.phase.is_terminal())
                .map_or("-".into(), |s| s.world_size.to_string()),
        );
        row.push(r.gpu_hours().map_or("-".into(), |h| format!("{h:.4}")));
        row.push(loss(r.loss()));
        row.push(loss(r.predicted_loss()));
        row.push(loss(r.held_out()));
        t.add_row(row);
    }
    t
}

/// The ranking as JSON: one object per trial, best first, with the columns of the table,
/// the phase and end reason apart, and the spec and status as `converge jobs --json` gives
/// them.
pub fn json(rows: &[Ranked<'_>]) -> serde_json::Value {
    rows.iter()
        .map(|r| {
            let params: serde_json::Map<String, serde_json::Value> = trial_params(r.spec)
                .into_iter()
                .map(|(k, v)| (k.to_string(), json!(v)))
                .collect();
            let end = r.status.and_then(|s| s.end.as_ref());
            json!({
                "rank": r.rank,
                "job": r.spec.id,
                "params": params,
                "phase": r.status.map_or("submitted", |s| s.phase.as_str()),
                "end_reason": end.map(|e| e.reason),
                "state": r.state(),
                "workers": r.status.map_or(0, |s| s.world_size),
                "gpu_hours": r.gpu_hours(),
                "loss": r.loss(),
                "predicted_loss": r.predicted_loss(),
                "held_out_loss": r.held_out(),
                "spec": r.spec,
                "status": r.status,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tables::tests::running_status;
    use converge_common::sweep::expand;
    use converge_common::{EndReason, JobEnd};

    const SWEEP: &str = r#"
[sweep]
id = "s"
[sweep.grid]
lr = [0.01, 0.05, 0.2]
batch = [16, 64]
[job]
command = ["t", "--lr", "{lr}", "--batch-size", "{batch}"]
"#;

    fn specs() -> Vec<JobSpec> {
        let mut specs: Vec<JobSpec> = expand(SWEEP, 64)
            .unwrap()
            .trials
            .into_iter()
            .map(|t| t.spec)
            .collect();
        specs.push(JobSpec::from_toml("id = \"other\"\ncommand = [\"t\"]\n").unwrap());
        specs
    }

    fn status(
        job: &str,
        phase: JobPhase,
        loss: Option<f64>,
        predicted: Option<f64>,
        end: Option<JobEnd>,
    ) -> JobStatus {
        let mut s = running_status();
        s.job = JobId::new(job).unwrap();
        s.phase = phase;
        s.world_size = 2;
        s.loss = loss;
        s.predicted_loss = predicted;
        s.end = end;
        s
    }

    fn end(reason: EndReason, loss: f64, predicted: Option<f64>, gpu_hours: f64) -> JobEnd {
        JobEnd {
            reason,
            loss: Some(loss),
            predicted_loss: predicted,
            gpu_hours,
        }
    }

    /// s-1 converged (predicted 0.20), s-2 runs (predicted 0.15), s-3 runs without a
    /// curve (loss 0.18), s-4 hit its deadline (its curve predicted 0.30; its status'
    /// one-horizon prediction, 0.01, is ignored once ended), s-5 failed at loss 0.9,
    /// s-6 is pending; `other` is no trial.
    fn statuses() -> Vec<JobStatus> {
        use JobPhase::*;
        vec![
            status(
                "s-1",
                Completed,
                Some(0.25),
                Some(0.01),
                Some(end(EndReason::Converged, 0.25, Some(0.2), 0.125)),
            ),
            status("s-2", Running, Some(0.4), Some(0.15), None),
            status("s-3", Running, Some(0.18), None, None),
            status(
                "s-4",
                Completed,
                Some(0.35),
                Some(0.01),
                Some(end(EndReason::Deadline, 0.35, Some(0.3), 0.5)),
            ),
            status("s-5", Failed, Some(0.9), None, None),
            status("other", Running, Some(0.0), Some(0.0), None),
        ]
    }

    #[test]
    fn trials_rank_by_predicted_loss_then_loss_and_other_jobs_are_left_out() {
        let specs = specs();
        let statuses = statuses();
        let rows = rank(&JobId::new("s").unwrap(), &specs, &statuses);
        let order: Vec<(usize, &str, Option<f64>)> = rows
            .iter()
            .map(|r| (r.rank, r.spec.id.as_str(), r.score()))
            .collect();
        assert_eq!(
            order,
            [
                (1, "s-2", Some(0.15)),
                (2, "s-3", Some(0.18)),
                (3, "s-1", Some(0.2)),
                (4, "s-4", Some(0.3)),
                (5, "s-5", Some(0.9)),
                (6, "s-6", None),
            ]
        );
        assert_eq!(rows[2].state(), "completed (converged)");
        assert_eq!(rows[3].state(), "completed (deadline)");
        assert_eq!(rows[4].state(), "failed");
        assert_eq!(rows[5].state(), "submitted");
        assert_eq!(rows[2].gpu_hours(), Some(0.125));
        assert_eq!(rows[0].gpu_hours(), None);
        assert!(rank(&JobId::new("t").unwrap(), &specs, &statuses).is_empty());
    }

    #[test]
    fn ties_go_to_the_lower_loss_then_the_id() {
        let specs = specs();
        let statuses = vec![
            status("s-1", JobPhase::Running, Some(0.5), Some(0.2), None),
            status("s-2", JobPhase::Running, Some(0.4), Some(0.2), None),
            status("s-3", JobPhase::Running, Some(f64::NAN), None, None),
        ];
        let rows = rank(&JobId::new("s").unwrap(), &specs, &statuses);
        let ids: Vec<&str> = rows.iter().map(|r| r.spec.id.as_str()).collect();
        assert_eq!(ids, ["s-2", "s-1", "s-3", "s-4", "s-5", "s-6"]);
    }

    #[test]
    fn the_table_and_the_json_show_the_same_ranking() {
        let specs = specs();
        let statuses = statuses();
        let rows = rank(&JobId::new("s").unwrap(), &specs, &statuses);
        let text = table(&rows).to_string();
        let lines: Vec<&str> = text.lines().collect();
        for col in [
            "RANK",
            "TRIAL",
            "batch",
            "lr",
            "STATE",
            "GPU-h",
            "LOSS",
            "PREDICTED",
        ] {
            assert!(lines[1].contains(col), "{col}: {}", lines[1]);
        }
        let first = lines.iter().position(|l| l.contains("s-2")).unwrap();
        let third = lines.iter().position(|l| l.contains("s-1 ")).unwrap();
        assert!(first < third, "{text}");
        let converged = lines[third];
        for cell in [
            "3",
            "16",
            "0.01",
            "completed (converged)",
            "0.125",
            "0.2500",
            "0.2000",
        ] {
            assert!(converged.contains(cell), "{cell}: {converged}");
        }
        assert!(!text.contains("other"));

        let j = json(&rows);
        let arr = j.as_array().unwrap();
        assert_eq!(arr.len(), 6);
        assert_eq!(arr[0]["job"], "s-2");
        assert_eq!(arr[0]["rank"], 1);
        assert_eq!(arr[0]["params"]["lr"], "0.01");
        assert_eq!(arr[0]["params"]["batch"], "64");
        assert_eq!(arr[0]["phase"], "running");
        assert_eq!(arr[0]["end_reason"], serde_json::Value::Null);
        assert_eq!(arr[2]["end_reason"], "converged");
        assert_eq!(arr[2]["state"], "completed (converged)");
        assert_eq!(arr[2]["gpu_hours"], 0.125);
        assert_eq!(arr[2]["predicted_loss"], 0.2);
        assert_eq!(arr[2]["loss"], 0.25);
        assert_eq!(arr[3]["end_reason"], "deadline");
        assert_eq!(arr[5]["phase"], "submitted");
        assert_eq!(arr[5]["status"], serde_json::Value::Null);
    }

    #[test]
    fn trials_rank_by_held_out_loss_when_every_reporting_trial_has_one() {
        let specs = specs();
        let mut statuses = statuses();
        // Held-out losses reverse the training order of s-2 and s-1.
        for (job, eval) in [
            ("s-1", 0.30),
            ("s-2", 0.50),
            ("s-3", 0.40),
            ("s-4", 0.60),
            ("s-5", 0.90),
        ] {
            statuses
                .iter_mut()
                .find(|s| s.job.as_str() == job)
                .unwrap()
                .eval_loss = Some(eval);
        }
        let rows = rank(&JobId::new("s").unwrap(), &specs, &statuses);
        assert_eq!(basis(&rows), Basis::HeldOut);
        let ids: Vec<&str> = rows.iter().map(|r| r.spec.id.as_str()).collect();
        assert_eq!(ids, ["s-1", "s-3", "s-2", "s-4", "s-5", "s-6"]);
        assert!(table(&rows).to_string().contains("HELD-OUT"));
        assert_eq!(json(&rows)[0]["held_out_loss"], 0.3);
        // One reporting trial without held-out loss: the training ranking, and why.
        statuses
            .iter_mut()
            .find(|s| s.job.as_str() == "s-3")
            .unwrap()
            .eval_loss = None;
        let rows = rank(&JobId::new("s").unwrap(), &specs, &statuses);
        let b = basis(&rows);
        assert_eq!(b, Basis::Training(Some(JobId::new("s-3").unwrap())));
        assert!(
            b.describe().contains("trial s-3 reports no held-out loss"),
            "{}",
            b.describe()
        );
        assert_eq!(rows[0].spec.id.as_str(), "s-2");

        // s-3 is young (half way through its first epoch, no evaluation yet): it does not
        // switch the ranking to training loss, and waits after the evaluated trials.
        let s3 = statuses
            .iter_mut()
            .find(|s| s.job.as_str() == "s-3")
            .unwrap();
        s3.epoch_samples = Some(1000.0);
        s3.samples = 500;
        let rows = rank(&JobId::new("s").unwrap(), &specs, &statuses);
        assert_eq!(basis(&rows), Basis::HeldOut);
        let ids: Vec<&str> = rows.iter().map(|r| r.spec.id.as_str()).collect();
        assert_eq!(ids, ["s-1", "s-2", "s-4", "s-5", "s-3", "s-6"]);
        // Past its first epoch (the default min_epochs) without an evaluation, it does.
        let s3 = statuses
            .iter_mut()
            .find(|s| s.job.as_str() == "s-3")
            .unwrap();
        s3.samples = 1500;
        let rows = rank(&JobId::new("s").unwrap(), &specs, &statuses);
        assert_eq!(
            basis(&rows),
            Basis::Training(Some(JobId::new("s-3").unwrap()))
        );
        // Every reporting trial young and none evaluated: training loss, and why.
        let mut young_only = statuses.clone();
        for s in &mut young_only {
            s.eval_loss = None;
            s.phase = JobPhase::Running;
            s.epoch_samples = Some(1000.0);
            s.samples = 10;
        }
        let rows = rank(&JobId::new("s").unwrap(), &specs, &young_only);
        assert_eq!(basis(&rows), Basis::NotEvaluatedYet);
        assert!(
            basis(&rows)
                .describe()
                .contains("no trial has evaluated yet")
        );
        // A failed trial without held-out loss does not switch the ranking.
        let mut failed = statuses.clone();
        let s3 = failed.iter_mut().find(|s| s.job.as_str() == "s-3").unwrap();
        s3.epoch_samples = None;
        s3.phase = JobPhase::Failed;
        let rows = rank(&JobId::new("s").unwrap(), &specs, &failed);
        assert_eq!(basis(&rows), Basis::HeldOut);
        // An ended trial is never young.
        let s3 = statuses
            .iter_mut()
            .find(|s| s.job.as_str() == "s-3")
            .unwrap();
        s3.samples = 500;
        s3.phase = JobPhase::Completed;
        let rows = rank(&JobId::new("s").unwrap(), &specs, &statuses);
        assert!(!rows.iter().any(|r| r.young()));
        assert_eq!(
            basis(&rows),
            Basis::Training(Some(JobId::new("s-3").unwrap()))
        );
    }
}

//! ShadowSync jobs' synchronization figures in their statuses: rank 0's latest
//! `sync_rounds_per_s` and `model_gap` of the job's current generation, taken from the
//! progress reports the service accepted and written into [`JobStatus`] after each step
//! (`converge jobs`, the dashboard). The scheduling step does not read them.
//!
//! Like the progress histories, this is rebuilt from the progress stream on start, so the
//! allocator keeps no state of its own.

use converge_common::{JobId, JobStatus, ProgressReport};
use std::collections::BTreeMap;

/// One job's latest figures.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Latest {
    generation: u64,
    /// When the agent read the line (the report's `time`).
    time: f64,
    sync_rounds_per_s: Option<f64>,
    model_gap: Option<f64>,
}

/// Rank 0's latest shadow figures per job.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ShadowFigures(BTreeMap<JobId, Latest>);

impl ShadowFigures {
    /// Takes `r` if it is rank 0's, carries a figure, and is not older (by generation, then
    /// time) than what the job has. Reports were validated on decoding (finite, >= 0).
    pub fn note(&mut self, r: &ProgressReport) {
        if r.rank != 0 || (r.line.sync_rounds_per_s.is_none() && r.line.model_gap.is_none()) {
            return;
        }
        let new = Latest {
            generation: r.generation,
            time: r.time,
            sync_rounds_per_s: r.line.sync_rounds_per_s,
            model_gap: r.line.model_gap,
        };
        let keep_old = self
            .0
            .get(&r.job)
            .is_some_and(|old| (old.generation, old.time) > (new.generation, new.time));
        if !keep_old {
            self.0.insert(r.job.clone(), new);
        }
    }

    /// Sets `status`'s figures to the job's latest of its current generation; both absent
    /// when that generation reported none yet (a new generation does not show the previous
    /// one's sync rate).
    pub fn stamp(&self, status: &mut JobStatus) {
        let latest = self
            .0
            .get(&status.job)
            .filter(|l| l.generation == status.generation);
        status.sync_rounds_per_s = latest.and_then(|l| l.sync_rounds_per_s);
        status.model_gap = latest.and_then(|l| l.model_gap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_common::HostId;

    fn report(generation: u64, rank: u32, time: f64, rounds: Option<f64>) -> ProgressReport {
        let mut r = ProgressReport::new(
            JobId::new("sh").unwrap(),
            generation,
            rank,
            HostId::new("h").unwrap(),
            10,
            100,
            0.5,
            time,
        );
        r.line.sync_rounds_per_s = rounds;
        r.line.model_gap = rounds.map(|x| x / 1000.0);
        r
    }

    fn status(generation: u64) -> JobStatus {
        let mut s = JobStatus::pending(JobId::new("sh").unwrap(), 0.0, 0.0);
        s.generation = generation;
        s
    }

    #[test]
    fn statuses_show_rank_0s_latest_figures_of_the_current_generation() {
        let mut f = ShadowFigures::default();
        let mut s = status(1);
        f.stamp(&mut s);
        assert_eq!((s.sync_rounds_per_s, s.model_gap), (None, None));
        f.note(&report(1, 0, 10.0, Some(12.0)));
        f.note(&report(1, 1, 11.0, Some(99.0))); // not rank 0
        f.note(&report(1, 0, 12.0, None)); // no figure: a ring job's, or before a round
        f.note(&report(1, 0, 9.0, Some(1.0))); // older, delivered late
        f.stamp(&mut s);
        assert_eq!(
            (s.sync_rounds_per_s, s.model_gap),
            (Some(12.0), Some(0.012))
        );
        f.note(&report(1, 0, 13.0, Some(0.0)));
        f.stamp(&mut s);
        assert_eq!(s.sync_rounds_per_s, Some(0.0), "a dropped sync reads 0");
        // A new generation shows nothing until it reports; a late report of the previous one
        // does not come back.
        let mut s2 = status(2);
        f.stamp(&mut s2);
        assert_eq!((s2.sync_rounds_per_s, s2.model_gap), (None, None));
        f.note(&report(2, 0, 20.0, Some(7.0)));
        f.note(&report(1, 0, 21.0, Some(5.0)));
        f.stamp(&mut s2);
        assert_eq!(s2.sync_rounds_per_s, Some(7.0));
        // A ring job never gets the fields.
        let mut ring = JobStatus::pending(JobId::new("ring").unwrap(), 0.0, 0.0);
        f.stamp(&mut ring);
        assert_eq!((ring.sync_rounds_per_s, ring.model_gap), (None, None));
    }
}

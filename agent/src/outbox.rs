//! The agent's outbox of progress reports: one bounded queue per job, served in turn, so
//! that a job whose workers report faster than NATS acknowledges (or one that reports while
//! the bus is slow or away) fills only its own queue and loses only its own reports.
//!
//! Each worker's reports are already rate-limited ([`crate::supervisor::REPORTS_PER_S`]),
//! and each job's on the host ([`crate::supervisor::JOB_REPORTS_PER_S`]); this bounds what
//! a job can hold in the outbox while the bus is slow or away, and keeps one job's backlog from delaying another's reports by more than one report each
//! turn. The reports themselves are sent one at a time, each retried for
//! [`converge_bus::PROGRESS_PATIENCE`] ([`converge_bus::Bus::publish_report`]).

use converge_common::JobId;
use std::collections::{BTreeMap, VecDeque};

/// Reports one job may have waiting in the outbox: 20 s of one job at its rate limit on
/// this host ([`crate::supervisor::JOB_REPORTS_PER_S`]), about 1 MB.
pub const OUTBOX_PER_JOB: usize = 2_000;

/// Queues of items (progress reports) per job, served round-robin.
#[derive(Debug)]
pub struct JobQueues<T> {
    queues: BTreeMap<JobId, VecDeque<T>>,
    /// Jobs with items waiting, in the order they are served next; each once.
    turn: VecDeque<JobId>,
    per_job: usize,
}

impl<T> JobQueues<T> {
    /// Empty queues of at most `per_job` items each (at least 1).
    pub fn new(per_job: usize) -> Self {
        Self {
            queues: BTreeMap::new(),
            turn: VecDeque::new(),
            per_job: per_job.max(1),
        }
    }

    /// Queues `item` behind `job`'s others. When `job` already has `per_job` waiting, its
    /// oldest is dropped and returned (a curve keeps its newest points: step, samples and
    /// loss are cumulative); other jobs' queues are untouched.
    pub fn push(&mut self, job: &JobId, item: T) -> Option<T> {
        let queue = match self.queues.get_mut(job) {
            Some(q) => q,
            None => {
                self.turn.push_back(job.clone());
                self.queues.entry(job.clone()).or_default()
            }
        };
        let dropped = if queue.len() >= self.per_job {
            queue.pop_front()
        } else {
            None
        };
        queue.push_back(item);
        dropped
    }

    /// The next item to send: the oldest of the job whose turn it is, which then goes to
    /// the back of the line. `None`: nothing waits.
    pub fn pop(&mut self) -> Option<T> {
        let job = self.turn.pop_front()?;
        let queue = self
            .queues
            .get_mut(&job)
            .expect("every job in turn has a queue");
        let item = queue.pop_front().expect("queues in turn are not empty");
        if queue.is_empty() {
            self.queues.remove(&job);
        } else {
            self.turn.push_back(job);
        }
        Some(item)
    }

    /// Items waiting, all jobs together.
    pub fn len(&self) -> usize {
        self.queues.values().map(VecDeque::len).sum()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.turn.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(s: &str) -> JobId {
        s.parse().unwrap()
    }

    #[test]
    fn a_flooding_job_fills_only_its_own_queue_and_jobs_are_served_in_turn() {
        let mut q = JobQueues::new(3);
        // Job `a` floods: ten items into a queue of three, the oldest dropped each time.
        let dropped: Vec<u32> = (0..10).filter_map(|i| q.push(&job("a"), i)).collect();
        assert_eq!(dropped, [0, 1, 2, 3, 4, 5, 6]);
        // Job `b` reports two: both kept, whatever `a` did.
        assert_eq!(q.push(&job("b"), 100), None);
        assert_eq!(q.push(&job("b"), 101), None);
        assert_eq!(q.len(), 5);
        // Served in turn, oldest first within a job: `b` waits behind one of `a`'s, not
        // behind all of them.
        let order: Vec<u32> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(order, [7, 100, 8, 101, 9]);
        assert!(q.is_empty());
        assert_eq!(q.pop(), None);
        // A job whose queue emptied gets a new turn when it reports again.
        assert_eq!(q.push(&job("b"), 102), None);
        assert_eq!(q.pop(), Some(102));
    }
}

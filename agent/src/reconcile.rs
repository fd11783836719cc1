//! The agent's reconcile decision as a pure function: given the host plan (desired workers)
//! and what the supervisor knows of its workers, which workers to start, signal or forget.
//! No I/O and no clock: `now` is an argument, so tests check decisions without processes.

use converge_common::{JobId, WorkerAssignment, WorkerPhase};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// Identity of a worker: one rank of one generation of a job.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerKey {
    pub job: JobId,
    pub generation: u64,
    pub rank: u32,
}

impl WorkerKey {
    pub fn of(a: &WorkerAssignment) -> Self {
        Self {
            job: a.job.clone(),
            generation: a.generation,
            rank: a.rank,
        }
    }
}

impl std::fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/gen{}/rank{}", self.job, self.generation, self.rank)
    }
}

/// What the decision needs to know of one supervised worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView {
    pub phase: WorkerPhase,
    pub gpus: Vec<u32>,
    /// While in `Backoff`: when the restart is due.
    pub restart_at: Option<Instant>,
    /// While in `Stopping`: when SIGKILL is due.
    pub kill_at: Option<Instant>,
}

/// One step the supervisor should take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start (or, after a backoff, restart) the planned worker.
    Start(WorkerKey),
    /// Send SIGTERM to the worker's process group; SIGKILL follows after the grace period.
    Terminate(WorkerKey),
    /// The grace period passed: SIGKILL the process group.
    Kill(WorkerKey),
    /// Drop an exited worker that is no longer planned.
    Forget(WorkerKey),
}

/// Decides the next actions. Rules:
/// - a planned worker that does not exist starts, unless one of its GPUs is still held by a
///   live worker, or an older generation of the same job still runs on this host (its
///   checkpoint must be written first); it then starts on a later call;
/// - a planned worker in `Backoff` restarts once its delay has passed; `Succeeded` and
///   `Failed` workers stay as they are (the allocator reads their state from telemetry);
/// - a running worker that is no longer planned gets SIGTERM, then SIGKILL at `kill_at`;
/// - an exited worker that is no longer planned is forgotten.
pub fn decide(
    plan: &[WorkerAssignment],
    workers: &BTreeMap<WorkerKey, WorkerView>,
    now: Instant,
) -> Vec<Action> {
    let planned: BTreeSet<WorkerKey> = plan.iter().map(WorkerKey::of).collect();
    let mut actions = Vec::new();

    // GPUs and job generations still held by live processes.
    let mut held_gpus = BTreeSet::new();
    let mut live_generations: BTreeMap<&JobId, BTreeSet<u64>> = BTreeMap::new();
    for (key, w) in workers {
        if w.phase.is_alive() {
            held_gpus.extend(w.gpus.iter().copied());
            live_generations
                .entry(&key.job)
                .or_default()
                .insert(key.generation);
        }
    }

    for (key, w) in workers {
        if planned.contains(key) {
            if w.phase == WorkerPhase::Backoff && w.restart_at.is_none_or(|t| t <= now) {
                actions.push(Action::Start(key.clone()));
            }
            continue;
        }
        match w.phase {
            WorkerPhase::Running => actions.push(Action::Terminate(key.clone())),
            WorkerPhase::Stopping => {
                if w.kill_at.is_some_and(|t| t <= now) {
                    actions.push(Action::Kill(key.clone()));
                }
            }
            WorkerPhase::Backoff | WorkerPhase::Succeeded | WorkerPhase::Failed => {
                actions.push(Action::Forget(key.clone()))
            }
        }
    }

    for a in plan {
        let key = WorkerKey::of(a);
        if workers.contains_key(&key) {
            continue;
        }
        let gpu_busy = a.gpus.iter().any(|g| held_gpus.contains(g));
        let older_alive = live_generations
            .get(&a.job)
            .is_some_and(|gens| gens.iter().any(|&g| g < a.generation));
        if !gpu_busy && !older_alive {
            held_gpus.extend(a.gpus.iter().copied());
            actions.push(Action::Start(key));
        }
    }
    actions
}

/// Delay before restart number `restarts + 1` of a crashed worker: `base · 2^restarts`,
/// capped at `cap`.
pub fn restart_delay(restarts: u32, base: Duration, cap: Duration) -> Duration {
    let factor = 2u32.saturating_pow(restarts.min(20));
    base.saturating_mul(factor).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap as Map;

    fn assignment(job: &str, generation: u64, rank: u32, gpus: &[u32]) -> WorkerAssignment {
        WorkerAssignment {
            job: JobId::new(job).unwrap(),
            generation,
            rank,
            world_size: 4,
            local_rank: 0,
            local_world_size: 1,
            gpus: gpus.to_vec(),
            master_addr: "127.0.0.1".into(),
            master_port: 20000,
            command: vec!["true".into()],
            env: Map::new(),
            max_restarts: 3,
            num_ps: 0,
            hosts: 0,
            batch: None,
            node_rank: None,
            shadow: None,
        }
    }

    fn view(phase: WorkerPhase, gpus: &[u32]) -> WorkerView {
        WorkerView {
            phase,
            gpus: gpus.to_vec(),
            restart_at: None,
            kill_at: None,
        }
    }

    fn key(job: &str, generation: u64, rank: u32) -> WorkerKey {
        WorkerKey {
            job: JobId::new(job).unwrap(),
            generation,
            rank,
        }
    }

    #[test]
    fn starts_missing_and_terminates_removed() {
        let plan = [assignment("a", 1, 0, &[0]), assignment("a", 1, 1, &[1])];
        let mut workers = Map::new();
        workers.insert(key("a", 1, 0), view(WorkerPhase::Running, &[0]));
        workers.insert(key("b", 1, 0), view(WorkerPhase::Running, &[2]));
        let now = Instant::now();
        assert_eq!(
            decide(&plan, &workers, now),
            vec![
                Action::Terminate(key("b", 1, 0)),
                Action::Start(key("a", 1, 1))
            ]
        );
    }

    #[test]
    fn new_generation_waits_for_the_old_one_to_exit() {
        let plan = [assignment("a", 2, 0, &[3])];
        let mut workers = Map::new();
        workers.insert(key("a", 1, 0), view(WorkerPhase::Stopping, &[0]));
        let now = Instant::now();
        assert_eq!(decide(&plan, &workers, now), vec![]);
        workers.get_mut(&key("a", 1, 0)).unwrap().kill_at = Some(now);
        assert_eq!(
            decide(&plan, &workers, now),
            vec![Action::Kill(key("a", 1, 0))]
        );
        workers.remove(&key("a", 1, 0));
        assert_eq!(
            decide(&plan, &workers, now),
            vec![Action::Start(key("a", 2, 0))]
        );
    }

    #[test]
    fn gpu_held_by_a_stopping_worker_delays_the_start() {
        let plan = [assignment("b", 1, 0, &[0])];
        let mut workers = Map::new();
        workers.insert(key("a", 1, 0), view(WorkerPhase::Stopping, &[0]));
        assert_eq!(decide(&plan, &workers, Instant::now()), vec![]);
    }

    #[test]
    fn backoff_restarts_when_due_and_finished_workers_stay() {
        let now = Instant::now();
        let plan = [
            assignment("a", 1, 0, &[0]),
            assignment("a", 1, 1, &[1]),
            assignment("a", 1, 2, &[2]),
        ];
        let mut workers = Map::new();
        let mut backoff = view(WorkerPhase::Backoff, &[0]);
        backoff.restart_at = Some(now + Duration::from_secs(5));
        workers.insert(key("a", 1, 0), backoff);
        workers.insert(key("a", 1, 1), view(WorkerPhase::Succeeded, &[1]));
        workers.insert(key("a", 1, 2), view(WorkerPhase::Failed, &[2]));
        assert_eq!(decide(&plan, &workers, now), vec![]);
        assert_eq!(
            decide(&plan, &workers, now + Duration::from_secs(5)),
            vec![Action::Start(key("a", 1, 0))]
        );
        // Once unplanned, exited workers are forgotten.
        assert_eq!(
            decide(&[], &workers, now),
            vec![
                Action::Forget(key("a", 1, 0)),
                Action::Forget(key("a", 1, 1)),
                Action::Forget(key("a", 1, 2)),
            ]
        );
    }

    #[test]
    fn restart_delay_is_capped_exponential() {
        let base = Duration::from_secs(1);
        let cap = Duration::from_secs(30);
        let delays: Vec<u64> = (0..7)
            .map(|r| restart_delay(r, base, cap).as_secs())
            .collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(restart_delay(u32::MAX, base, cap), cap);
    }
}

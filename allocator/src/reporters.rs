//! Which hosts may report a job's progress: the acceptance rule of the progress stream.
//! Pure: the service feeds it the statuses it reads and writes and asks it about each
//! report before the report reaches the job's history (and so its fit).
//!
//! On a secured server an agent may publish progress only on its own host's subjects
//! (`converge.v1.progress.<job>.<host>`), so the subject's host token names the sender. A
//! report is **accepted** when
//!
//! 1. its subject is `converge.v1.progress.<report.job>.<report.host>` (else `wrong_subject`;
//!    in the start-up replay, a report of an older release on the job's subject without a
//!    host, `converge.v1.progress.<report.job>`, is taken by its `host` field: the updated
//!    stream no longer stores that subject, so such reports predate the upgrade and keep
//!    the curves of jobs that run across it), and
//! 2. its generation is one whose placement the allocator knows — the job's current
//!    generation or the one before it (workers of the previous generation keep reporting
//!    while they stop) — and its host is among that generation's hosts: the workers'
//!    (`placement`) and the parameter-server shards' (`ps_placement`), every host any status
//!    of that generation placed something on (else `not_placed`), and its `rank` is one that
//!    generation placed on that host (else `wrong_rank`: a host of a multi-host job cannot
//!    speak for rank 0, whose reports make the job's loss curve and can end it); or
//! 3. during the start-up replay only (the reports that were already in the stream when the
//!    allocator started), it was stored before its generation ended (plus
//!    [`SUPERSEDED_GRACE_S`], or [`ENDED_GRACE_S`] for one placed nowhere) and that generation is older than every generation whose placement
//!    the allocator knows (its end: the next allocation change the job's status records),
//!    or is one the statuses place on no host (a job that finished, or lost its host and
//!    waits; its end: `finished_at`, or the change that took the host): those placements
//!    are gone from the statuses, so such reports are taken as the history they are. A
//!    forged report refused while the allocator ran is no longer there (see
//!    [`Refusal::certain`]), or, when it was kept (an older generation's), it was stored
//!    after its generation ended and is refused now. An older generation's report with no
//!    recorded end (statuses of older allocators) is taken.
//!
//! Everything else is refused with `not_placed`: a job without a placed status, a generation
//! newer than the job's current one (not placed yet: a forged one would make every real
//! report stale), and, after the replay, a generation older than the known ones.

use converge_common::{ChangeCause, HostId, JobId, JobStatus, ProgressReport, subjects};
use std::collections::{BTreeMap, BTreeSet};

/// Generations remembered per job: the current one and the one before.
const GENERATIONS: usize = 2;

/// Why a report was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The label it is counted under: `wrong_subject`, `not_placed` or `wrong_rank`.
    pub kind: &'static str,
    /// For the log.
    pub reason: String,
    /// The refusal holds whatever the allocator learns later, so the leader deletes the
    /// report from the stream: a subject that does not match the report, a host outside the
    /// placement of a known generation, a generation not placed yet, a job never placed. Not
    /// certain: a generation older than the known ones after the replay (after a restart
    /// the allocator knows only the current generation's hosts, so the previous
    /// generation's last reports may be real; the next replay takes it only if it was
    /// stored before that generation ended). Deleting the certain ones is what makes rule
    /// 3 safe: a report the leader refused is not in the stream to be replayed later.
    pub certain: bool,
}

/// The hosts of each job's latest generations and the ranks each placed there, from the
/// statuses the allocator reads (at start, from its status watch) and writes (its steps'
/// outcomes).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Reporters {
    jobs: BTreeMap<JobId, BTreeMap<u64, BTreeMap<HostId, BTreeSet<u32>>>>,
    /// Per job, the generation its last status places on no host and when that generation
    /// ended (the job finished, or lost a host), when the status says.
    ended: BTreeMap<JobId, (u64, f64)>,
    /// Per job, its last status's allocation changes as (generation, time, cause): when
    /// each recorded generation began, or lost its host. Rule 3 takes a report of a
    /// generation older than the known ones only when it was stored before that
    /// generation ended by these records.
    changes: BTreeMap<JobId, Vec<(u64, f64, ChangeCause)>>,
}

/// How long after its generation ended a report may have been stored and still be taken as
/// that generation's history in the replay, in seconds: its workers stop within the agent's
/// stop grace (10 s), and the allocator's clock (the end) and the NATS server's (the
/// storing) may differ by a few seconds.
pub const ENDED_GRACE_S: f64 = 15.0;

/// The same for a generation older than the known ones, which ended when the next one was
/// decided (its status's allocation change), in seconds: its workers stop only once their
/// agent read the new plan, within the stop grace (10 s), and each report's publish is
/// retried for 30 s ([`converge_bus::PROGRESS_PATIENCE`]); a generation's last reports may
/// therefore be stored up to about 45 s after the decision. Reports stored later still
/// (queued longer in a slow agent's outbox) are refused by the replay and deleted: stale
/// points of a generation long replaced.
pub const SUPERSEDED_GRACE_S: f64 = 60.0;

/// When `status`'s generation, placed on no host, ended: the job's end for a finished
/// job, the allocation change that took its host for one that lost it. `None` otherwise
/// (never placed, or no record).
fn generation_end(status: &JobStatus) -> Option<f64> {
    if !(status.placement.is_empty() && status.ps_placement.is_empty()) {
        return None;
    }
    if status.phase.is_terminal() {
        return status.finished_at;
    }
    status
        .allocations
        .iter()
        .rev()
        .find(|a| a.generation == status.generation && a.cause == ChangeCause::HostLost)
        .map(|a| a.time)
}

/// When generation `generation` ended by `changes` (a job's allocation changes): the first
/// change to a later generation, or the change that took its host. A record list that
/// dropped its oldest entries still bounds the end from above: the earliest change kept
/// is after it. `None`: no change recorded after it (statuses of older allocators carry
/// none).
fn ended_by(changes: &[(u64, f64, ChangeCause)], generation: u64) -> Option<f64> {
    changes
        .iter()
        .filter(|(g, _, cause)| {
            *g > generation || (*g == generation && *cause == ChangeCause::HostLost)
        })
        .map(|&(_, time, _)| time)
        .min_by(f64::total_cmp)
}

impl Reporters {
    /// Learns the hosts and ranks of `status`'s generation (added to what earlier statuses of
    /// the same generation placed: a generation that lost a host keeps it). Generation 0 (never
    /// placed) adds nothing; only the `GENERATIONS` newest generations are kept.
    pub fn note(&mut self, status: &JobStatus) {
        if status.generation == 0 {
            return;
        }
        let gens = self.jobs.entry(status.job.clone()).or_default();
        if gens.len() >= GENERATIONS
            && gens
                .first_key_value()
                .is_some_and(|(&oldest, _)| status.generation < oldest)
        {
            // A status older than what is known (read late) changes nothing.
            return;
        }
        match generation_end(status) {
            Some(end) => {
                self.ended
                    .insert(status.job.clone(), (status.generation, end));
            }
            None => {
                self.ended.remove(&status.job);
            }
        }
        self.changes.insert(
            status.job.clone(),
            status
                .allocations
                .iter()
                .map(|a| (a.generation, a.time, a.cause))
                .collect(),
        );
        let gens = self.jobs.entry(status.job.clone()).or_default();
        let hosts = gens.entry(status.generation).or_default();
        for p in status.placement.iter().chain(&status.ps_placement) {
            hosts.entry(p.host.clone()).or_default().insert(p.rank);
        }
        while gens.len() > GENERATIONS {
            gens.pop_first();
        }
    }

    /// Forgets a job (its status was deleted).
    pub fn forget(&mut self, job: &JobId) {
        self.jobs.remove(job);
        self.ended.remove(job);
        self.changes.remove(job);
    }

    /// Whether `report`, read from `subject`, may reach the job's history; `replay`: it was
    /// in the stream when the allocator started. See the module's documentation. The
    /// report's storing time is not known here: see [`Reporters::check_stored`].
    pub fn check(
        &self,
        subject: &str,
        report: &ProgressReport,
        replay: bool,
    ) -> Result<(), Refusal> {
        self.check_stored(subject, report, replay, None)
    }

    /// [`Reporters::check`] for a report the stream stored at `stored_at` (UNIX seconds,
    /// the NATS server's clock): in the replay, a report of a generation the statuses place
    /// on no host is taken when it was stored before that generation ended (plus
    /// [`ENDED_GRACE_S`]).
    pub fn check_stored(
        &self,
        subject: &str,
        report: &ProgressReport,
        replay: bool,
        stored_at: Option<f64>,
    ) -> Result<(), Refusal> {
        let refuse = |kind, reason: String, certain| {
            Err(Refusal {
                kind,
                reason,
                certain,
            })
        };
        let before_hosts = replay && subject == subjects::progress_without_host(&report.job);
        if subject != subjects::progress(&report.job, &report.host) && !before_hosts {
            return refuse(
                "wrong_subject",
                format!(
                    "report of job {} from host {} on subject {subject}",
                    report.job, report.host
                ),
                true,
            );
        }
        let what = || {
            format!(
                "report of job {} generation {} rank {} from host {}",
                report.job, report.generation, report.rank, report.host
            )
        };
        let Some(gens) = self.jobs.get(&report.job) else {
            return refuse(
                "not_placed",
                format!("{}: the job was never placed", what()),
                true,
            );
        };
        let (&newest, _) = gens.last_key_value().expect("no empty entries");
        let (&oldest, _) = gens.first_key_value().expect("no empty entries");
        if report.generation > newest {
            return refuse(
                "not_placed",
                format!("{}: the job's generation is {newest}", what()),
                true,
            );
        }
        if let Some(hosts) = gens.get(&report.generation) {
            let ended = self.ended.get(&report.job);
            if hosts.is_empty()
                && replay
                && let (Some(&(generation, end)), Some(at)) = (ended, stored_at)
                && generation == report.generation
                && at <= end + ENDED_GRACE_S
            {
                // The statuses read at start place this generation nowhere (the job
                // finished, or lost its host): its placement is gone, so, as rule 3, the
                // reports stored before it ended are the job's history. A later one is
                // refused below (and deleted): no worker of it was running any more.
                return Ok(());
            }
            match hosts.get(&report.host) {
                Some(ranks) if ranks.contains(&report.rank) => return Ok(()),
                Some(ranks) => {
                    return refuse(
                        "wrong_rank",
                        format!(
                            "{}: generation {} placed rank{} {} on {}",
                            what(),
                            report.generation,
                            if ranks.len() == 1 { "" } else { "s" },
                            ranks
                                .iter()
                                .map(u32::to_string)
                                .collect::<Vec<_>>()
                                .join(", "),
                            report.host
                        ),
                        true,
                    );
                }
                None => {}
            }
            return refuse(
                "not_placed",
                format!(
                    "{}: generation {} is placed on {}",
                    what(),
                    report.generation,
                    join(hosts)
                ),
                true,
            );
        }
        if replay && report.generation < oldest {
            let end = self
                .changes
                .get(&report.job)
                .and_then(|c| ended_by(c, report.generation));
            return match (end, stored_at) {
                (Some(end), Some(at)) if at > end + SUPERSEDED_GRACE_S => refuse(
                    "not_placed",
                    format!(
                        "{}: stored {:.0} s after generation {} ended",
                        what(),
                        at - end,
                        report.generation
                    ),
                    true,
                ),
                // Stored before it ended, or no record of its end: history.
                _ => Ok(()),
            };
        }
        refuse(
            "not_placed",
            format!(
                "{}: only generations {} are known",
                what(),
                gens.keys()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(" and ")
            ),
            false,
        )
    }
}

fn join(hosts: &BTreeMap<HostId, BTreeSet<u32>>) -> String {
    if hosts.is_empty() {
        return "no host".into();
    }
    hosts
        .keys()
        .map(HostId::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(generation: u64, hosts: &[&str], shards: &[&str]) -> JobStatus {
        let place = |hosts: &[&str], first: usize| {
            hosts
                .iter()
                .enumerate()
                .map(|(i, h)| serde_json::json!({"rank": first + i, "host": h, "gpus": []}))
                .collect::<Vec<_>>()
        };
        serde_json::from_value(serde_json::json!({
            "job": "j", "phase": "running", "generation": generation,
            "world_size": hosts.len(), "placement": place(hosts, 0),
            "ps_placement": place(shards, hosts.len()),
            "step": 0, "samples": 0, "submitted_at": 1.0, "updated_at": 2.0
        }))
        .unwrap()
    }

    fn report_of(job: &str, generation: u64, host: &str, rank: u32) -> ProgressReport {
        serde_json::from_value(serde_json::json!({
            "protocol": 1, "job": job, "generation": generation, "rank": rank, "host": host,
            "step": 1, "samples": 10, "loss": 0.5, "time": 1.0
        }))
        .unwrap()
    }

    /// The tests' placements give host `b` rank 1 and host `s` (a shard) rank 2 where they
    /// are placed, every other host rank 0.
    fn report(job: &str, generation: u64, host: &str) -> ProgressReport {
        let rank = match host {
            "b" => 1,
            "s" => 2,
            _ => 0,
        };
        report_of(job, generation, host, rank)
    }

    fn check(r: &Reporters, generation: u64, host: &str, replay: bool) -> Result<(), Refusal> {
        let rep = report("j", generation, host);
        r.check(&subjects::progress(&rep.job, &rep.host), &rep, replay)
    }

    #[test]
    fn a_host_reports_only_the_ranks_placed_on_it() {
        let mut r = Reporters::default();
        r.note(&status(3, &["a", "b"], &["s"]));
        let check_rank = |host: &str, rank: u32, replay: bool| {
            let rep = report_of("j", 3, host, rank);
            r.check(&subjects::progress(&rep.job, &rep.host), &rep, replay)
        };
        assert_eq!(check_rank("a", 0, false), Ok(()));
        assert_eq!(check_rank("b", 1, false), Ok(()));
        assert_eq!(check_rank("s", 2, false), Ok(()));
        // b is a host of the job, but rank 0 (whose reports make the curve) is on a.
        for replay in [false, true] {
            let e = check_rank("b", 0, replay).unwrap_err();
            assert_eq!((e.kind, e.certain), ("wrong_rank", true), "{e:?}");
            assert!(e.reason.contains("placed rank 1 on b"), "{}", e.reason);
        }
        assert_eq!(check_rank("a", 7, false).unwrap_err().kind, "wrong_rank");
        // A generation placed twice on one host lists both ranks.
        let mut r2 = Reporters::default();
        r2.note(&status(1, &["a", "a"], &[]));
        let rep = report_of("j", 1, "a", 1);
        assert_eq!(
            r2.check(&subjects::progress(&rep.job, &rep.host), &rep, false),
            Ok(())
        );
        let rep = report_of("j", 1, "a", 2);
        let e = r2
            .check(&subjects::progress(&rep.job, &rep.host), &rep, false)
            .unwrap_err();
        assert!(e.reason.contains("placed ranks 0, 1 on a"), "{}", e.reason);
    }

    #[test]
    fn current_and_previous_generations_from_their_hosts_only() {
        let mut r = Reporters::default();
        r.note(&status(3, &["a", "b"], &["s"]));
        r.note(&status(4, &["c"], &[]));
        for (generation, host) in [(4, "c"), (3, "a"), (3, "b"), (3, "s")] {
            assert_eq!(
                check(&r, generation, host, false),
                Ok(()),
                "{generation} {host}"
            );
        }
        for (generation, host) in [(4, "a"), (3, "c"), (5, "c"), (2, "a")] {
            for replay in [false, true] {
                let e = check(&r, generation, host, replay);
                let ok_in_replay = replay && generation == 2;
                assert_eq!(
                    e.is_ok(),
                    ok_in_replay,
                    "{generation} {host} {replay}: {e:?}"
                );
                if let Err(e) = e {
                    assert_eq!(e.kind, "not_placed");
                    assert_eq!(e.certain, generation != 2, "{e:?}");
                }
            }
        }
        // A third generation pushes the first out; an old status changes nothing.
        r.note(&status(5, &["d"], &[]));
        r.note(&status(3, &["x"], &[]));
        assert!(check(&r, 3, "a", false).is_err());
        assert!(check(&r, 4, "c", false).is_ok() && check(&r, 5, "d", false).is_ok());
        assert!(check(&r, 3, "x", false).is_err());
    }

    #[test]
    fn a_generation_keeps_every_host_it_was_placed_on() {
        let mut r = Reporters::default();
        r.note(&status(2, &["a", "b"], &[]));
        // The generation lost host b: the job waits with no placement.
        r.note(&status(2, &[], &[]));
        assert!(check(&r, 2, "b", false).is_ok());
        // Never placed: nothing known, every report refused.
        r.note(&status(0, &[], &[]));
        let rep = report("other", 1, "a");
        let e = r
            .check(&subjects::progress(&rep.job, &rep.host), &rep, true)
            .unwrap_err();
        assert!(e.certain && e.reason.contains("never placed"), "{e:?}");
        r.forget(&"j".parse().unwrap());
        assert!(check(&r, 2, "a", true).is_err());
    }

    #[test]
    fn a_generation_placed_nowhere_is_history_in_the_replay_until_it_ended() {
        let at = |r: &Reporters, generation: u64, host: &str, replay: bool, stored: f64| {
            let rep = report("j", generation, host);
            let subject = subjects::progress(&rep.job, &rep.host);
            r.check_stored(&subject, &rep, replay, Some(stored))
        };
        // Read at start: the job finished at t = 100 in generation 2, so its status places
        // it on no host.
        let mut finished = status(2, &[], &[]);
        finished.phase = converge_common::JobPhase::Completed;
        finished.finished_at = Some(100.0);
        let mut r = Reporters::default();
        r.note(&finished);
        for host in ["a", "b"] {
            assert_eq!(at(&r, 2, host, true, 90.0), Ok(()), "{host}");
            assert_eq!(at(&r, 2, host, true, 100.0 + ENDED_GRACE_S), Ok(()));
            // Stored after it ended (a forged report no leader deleted), after the replay,
            // or with no storing time: refused, for good.
            for e in [
                at(&r, 2, host, true, 101.0 + ENDED_GRACE_S),
                at(&r, 2, host, false, 90.0),
                check(&r, 2, host, true),
            ] {
                let e = e.unwrap_err();
                assert_eq!((e.kind, e.certain), ("not_placed", true), "{e:?}");
            }
        }
        assert!(at(&r, 3, "a", true, 90.0).is_err(), "a newer generation");
        assert!(at(&r, 1, "a", true, 1e9).is_ok(), "an older one (rule 3)");

        // A job that lost its host at t = 50 and waits keeps generation 2, placed nowhere.
        let mut lost = status(2, &[], &[]);
        lost.allocations = vec![
            serde_json::from_value(serde_json::json!({"time": 50.0, "generation": 2,
                "from_workers": 1, "workers": 0, "hosts": 0, "cause": "host_lost",
                "reason": "host a lost"}))
            .unwrap(),
        ];
        let mut r = Reporters::default();
        r.note(&lost);
        assert_eq!(at(&r, 2, "a", true, 40.0), Ok(()));
        assert!(at(&r, 2, "a", true, 500.0).is_err());
        // Without a record of when it ended (a job preempted: a new generation placed
        // nowhere), nothing of that generation is taken.
        let mut r = Reporters::default();
        r.note(&status(4, &[], &[]));
        assert!(at(&r, 4, "a", true, 1.0).is_err());
        // Placed again: the placed generation is checked by its hosts.
        r.note(&status(5, &["c"], &[]));
        assert_eq!(check(&r, 5, "c", false), Ok(()));
        assert!(at(&r, 5, "a", true, 1.0).is_err());
    }

    #[test]
    fn an_older_generations_report_is_history_in_the_replay_only_if_stored_before_it_ended() {
        let change = |generation: u64, time: f64, cause: &str| {
            serde_json::from_value(serde_json::json!({"time": time, "generation": generation,
                "from_workers": 1, "workers": 1, "hosts": 1, "cause": cause,
                "reason": "r"}))
            .unwrap()
        };
        let at = |r: &Reporters, generation: u64, replay: bool, stored: f64| {
            let rep = report("j", generation, "x");
            let subject = subjects::progress(&rep.job, &rep.host);
            r.check_stored(&subject, &rep, replay, Some(stored))
        };
        // Generations 1 (t = 10), 2 (t = 100), 3 (t = 200) and 4 (t = 300); the
        // allocator knows 3 and 4, so generations 1 and 2 fall under rule 3.
        let mut s = status(4, &["a"], &[]);
        s.allocations = vec![
            change(1, 10.0, "started"),
            change(2, 100.0, "grown"),
            change(3, 200.0, "moved"),
            change(4, 300.0, "shrunk"),
        ];
        let mut r = Reporters::default();
        r.note(&status(3, &["a"], &[]));
        r.note(&s);
        // Generation 2 ended at t = 200: a report stored before that (and the grace) is
        // its history, one stored later is a forgery no leader deleted while the allocator
        // ran (the host check no longer applies: its placement is gone): refused, deleted.
        assert_eq!(at(&r, 2, true, 150.0), Ok(()));
        assert_eq!(at(&r, 2, true, 200.0 + SUPERSEDED_GRACE_S), Ok(()));
        let e = at(&r, 2, true, 201.0 + SUPERSEDED_GRACE_S).unwrap_err();
        assert_eq!((e.kind, e.certain), ("not_placed", true), "{e:?}");
        assert_eq!(at(&r, 1, true, 100.0), Ok(()));
        assert!(
            at(&r, 1, true, 170.0).is_err(),
            "generation 1 ended at t = 100"
        );
        // After the replay: refused but kept, the next replay judges it by its time.
        let e = at(&r, 2, false, 150.0).unwrap_err();
        assert!(!e.certain, "{e:?}");
        // Records that dropped generation 2's successor still bound its end: the earliest
        // kept change (t = 300) came after it.
        s.allocations = vec![change(4, 300.0, "shrunk")];
        r.note(&s);
        assert_eq!(at(&r, 2, true, 300.0), Ok(()));
        assert!(at(&r, 2, true, 400.0).is_err());
        // A status older than the known generations (read late) changes no record.
        let mut late = status(1, &["a"], &[]);
        late.allocations.clear();
        r.note(&late);
        assert!(at(&r, 2, true, 400.0).is_err(), "still bounded by t = 300");
        // A generation that lost its host ended then, even before a next one.
        s.allocations = vec![change(2, 120.0, "host_lost"), change(4, 300.0, "shrunk")];
        r.note(&s);
        assert!(at(&r, 2, true, 190.0).is_err());
        // No record at all (a status of an older allocator): taken, as before.
        s.allocations.clear();
        r.note(&s);
        assert_eq!(at(&r, 2, true, 1e9), Ok(()));
    }

    #[test]
    fn the_subject_must_name_the_reports_job_and_host() {
        let mut r = Reporters::default();
        r.note(&status(1, &["a", "b"], &[]));
        let rep = report("j", 1, "a");
        let other_host = subjects::progress(&rep.job, &"b".parse().unwrap());
        let other_job = subjects::progress(&"k".parse().unwrap(), &rep.host);
        for subject in [other_host.as_str(), &other_job, "converge.v1.progress.k"] {
            let e = r.check(subject, &rep, true).unwrap_err();
            assert_eq!((e.kind, e.certain), ("wrong_subject", true), "{subject}");
        }
        // The subject of an older release, without the host: in the replay only, and
        // still by the placement.
        let old = subjects::progress_without_host(&rep.job);
        assert_eq!(old, "converge.v1.progress.j");
        assert_eq!(r.check(&old, &rep, true), Ok(()));
        assert_eq!(
            r.check(&old, &rep, false).unwrap_err().kind,
            "wrong_subject"
        );
        let elsewhere = report("j", 1, "c");
        assert_eq!(
            r.check(&old, &elsewhere, true).unwrap_err().kind,
            "not_placed"
        );
    }
}

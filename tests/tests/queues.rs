//! Queues and priorities end to end, on real processes: a real nats-server, the `converge`
//! binary, in-process agents with fake GPUs running real `converge-trainer` workers, and
//! the allocator.
//!
//! - `converge queue` round trip and the refusals (unknown queue at submit, negative quota,
//!   an existing queue, delete while jobs name it);
//! - gang preemption by priority: a cluster full of low-priority jobs, a high-priority job
//!   arrives and runs within two scheduling periods plus restart time, exactly the
//!   preempted jobs' workers stop, and they resume from their checkpoints later;
//! - lending and reclaim between two queues of equal quota.

use converge_common::{JobPhase, JobSpec, JobStatus, QueueSpec, QueueStatus, WorkerPhase};
use converge_tests::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Runs `converge args` and returns its stdout; panics with its stderr if it failed.
fn ok(nats: &NatsServer, args: &[&str]) -> String {
    let out = converge(nats, args);
    assert!(
        out.status.success(),
        "converge {args:?} failed: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs `converge args`, expects it to fail, and returns its stderr.
fn refused(nats: &NatsServer, args: &[&str]) -> String {
    let out = converge(nats, args);
    assert!(
        !out.status.success(),
        "converge {args:?} should have failed: {}",
        text(&out.stdout)
    );
    text(&out.stderr)
}

/// `job`'s spec with a queue and priority, written to `<dir>/<id>.toml`.
fn write_job(job: &TrainerJob, queue: Option<&str>, priority: &str, dir: &Path) -> PathBuf {
    let queue = queue.map_or(String::new(), |q| format!("queue = \"{q}\"\n"));
    let path = dir.join(format!("{}.toml", job.id));
    std::fs::write(
        &path,
        format!("{queue}priority = \"{priority}\"\n{}", job.toml()),
    )
    .unwrap();
    path
}

fn submit(nats: &NatsServer, path: &Path) {
    ok(nats, &["submit", path.to_str().unwrap()]);
}

/// Queue rows of `converge --json queue list`, by name.
/// Submits a 1000-epoch trainer job `id` to `queue` at normal priority.
fn submit_to(nats: &NatsServer, id: &str, queue: &str, dir: &Path) {
    let job = TrainerJob::new(id, 1000);
    submit(nats, &write_job(&job, Some(queue), "normal", dir));
}

/// The queue buckets, created if need be.
async fn queue_buckets(bus: &converge_bus::Bus) -> converge_bus::QueueBuckets {
    bus.open_queues(converge_bus::Setup::CreateOrUpdate)
        .await
        .expect("open the queue buckets")
}

fn queue_list(nats: &NatsServer) -> BTreeMap<String, serde_json::Value> {
    let out = ok(nats, &["--json", "queue", "list"]);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).expect("JSON list");
    rows.into_iter()
        .map(|r| (r["name"].as_str().unwrap().to_string(), r))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_commands_round_trip_and_refuse_bad_input() {
    let (nats, work, bus) = start_test().await;
    let qb = queue_buckets(&bus).await;

    // Only the implicit default queue at first.
    let list = queue_list(&nats);
    assert_eq!(list.keys().collect::<Vec<_>>(), ["default"]);
    assert_eq!(list["default"]["implicit"], true);
    assert_eq!(list["default"]["spec"]["quota_gpus"], 0);

    let out = ok(
        &nats,
        &[
            "queue",
            "create",
            "team-a",
            "--quota",
            "4",
            "--borrowing-limit",
            "2",
            "--weight",
            "2",
        ],
    );
    assert!(
        out.contains("created queue team-a: quota 4 GPUs, borrowing limit 2, weight 2"),
        "{out}"
    );
    let err = refused(&nats, &["queue", "create", "team-a", "--quota", "1"]);
    assert!(
        err.contains("queue team-a already exists") && err.contains("converge queue set team-a"),
        "{err}"
    );
    // A negative quota reaches the protocol's check and says why (not a parse error).
    let err = refused(&nats, &["queue", "create", "team-b", "--quota", "-1"]);
    assert!(
        err.contains("--quota refused") && err.contains("cannot be below zero"),
        "{err}"
    );
    assert!(!err.contains("invalid value"), "{err}");
    let err = refused(
        &nats,
        &["queue", "create", "team-b", "--quota", "1", "--weight", "0"],
    );
    assert!(err.contains("`weight` is 0"), "{err}");
    let err = refused(
        &nats,
        &[
            "queue",
            "create",
            "team-b",
            "--quota",
            "1",
            "--borrowing-limit",
            "-4",
        ],
    );
    assert!(err.contains("cannot be below zero"), "{err}");
    let err = refused(&nats, &["queue", "create", "team.b", "--quota", "1"]);
    assert!(err.contains("invalid queue name"), "{err}");
    assert!(
        bus.get::<QueueSpec>(&qb.queues, "team-b")
            .await
            .unwrap()
            .is_none(),
        "nothing refused was written"
    );

    // set changes what it is given, keeps the rest.
    ok(&nats, &["queue", "set", "team-a", "--quota", "6"]);
    let (a, _) = bus
        .get::<QueueSpec>(&qb.queues, "team-a")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (a.quota_gpus, a.borrowing_limit_gpus, a.weight),
        (6, Some(2), 2.0)
    );
    assert!(a.updated_at >= a.created_at && a.created_at > 0.0);
    ok(
        &nats,
        &["queue", "set", "team-a", "--borrowing-limit", "unlimited"],
    );
    let list = queue_list(&nats);
    assert_eq!(list["team-a"]["spec"]["quota_gpus"], 6);
    assert!(list["team-a"]["spec"]["borrowing_limit_gpus"].is_null());
    let err = refused(&nats, &["queue", "set", "team-a", "--quota", "-2"]);
    assert!(err.contains("cannot be below zero"), "{err}");
    let err = refused(&nats, &["queue", "set", "team-x", "--quota", "1"]);
    assert!(
        err.contains("no queue team-x; existing queues: default, team-a"),
        "{err}"
    );
    let err = refused(&nats, &["queue", "set", "team-a"]);
    assert!(err.contains("nothing to change"), "{err}");

    // The table.
    let table = ok(&nats, &["queue", "list"]);
    assert!(
        table.contains("default (implicit)") && table.contains("team-a"),
        "{table}"
    );

    // Submit: an unknown queue is refused with the existing ones, a sweep too; nothing written.
    let stray = write_job(
        &TrainerJob::new("stray", 1),
        Some("team-z"),
        "normal",
        work.path(),
    );
    let err = refused(&nats, &["submit", stray.to_str().unwrap()]);
    assert!(
        err.contains("job spec stray refused: queue \"team-z\" does not exist; existing queues: default, team-a"),
        "{err}"
    );
    let sweep = work.path().join("sweep.toml");
    std::fs::write(
        &sweep,
        "[sweep]\nid = \"sw\"\n[sweep.grid]\nlr = [0.1, 0.2]\n[job]\nqueue = \"team-z\"\n\
         command = [\"converge-trainer\", \"--lr\", \"{lr}\"]\n",
    )
    .unwrap();
    let err = refused(&nats, &["submit", sweep.to_str().unwrap()]);
    assert!(err.contains("queue \"team-z\" does not exist"), "{err}");
    for id in ["stray", "sw-1", "sw-2"] {
        assert!(
            bus.get::<JobSpec>(&bus.jobs, id).await.unwrap().is_none(),
            "{id} was written"
        );
    }

    // A job in team-a (high) and one in the default queue are accepted and shown.
    let job = TrainerJob::new("hi", 1);
    submit(&nats, &write_job(&job, Some("team-a"), "high", work.path()));
    submit(
        &nats,
        &write_job(&TrainerJob::new("plain", 1), None, "normal", work.path()),
    );
    let jobs: Vec<serde_json::Value> =
        serde_json::from_str(&ok(&nats, &["--json", "jobs"])).unwrap();
    let hi = jobs.iter().find(|j| j["spec"]["id"] == "hi").unwrap();
    assert_eq!(
        (&hi["queue_name"], &hi["priority"], &hi["queue_exists"]),
        (
            &serde_json::json!("team-a"),
            &serde_json::json!("high"),
            &serde_json::json!(true)
        )
    );
    let table = ok(&nats, &["jobs"]);
    assert!(
        table.contains("team-a/high") && table.contains("default/normal"),
        "{table}"
    );

    // Delete: refused while `hi` names the queue, unless --force; then `hi` shows its queue
    // as missing.
    let err = refused(&nats, &["queue", "delete", "team-a"]);
    assert!(
        err.contains("queue team-a has 1 active job(s): hi") && err.contains("--force"),
        "{err}"
    );
    assert!(
        bus.get::<QueueSpec>(&qb.queues, "team-a")
            .await
            .unwrap()
            .is_some()
    );
    let out = ok(&nats, &["queue", "delete", "team-a", "--force"]);
    assert!(
        out.contains("deleted queue team-a") && out.contains("hi"),
        "{out}"
    );
    let table = ok(&nats, &["jobs"]);
    assert!(table.contains("team-a (missing)/high"), "{table}");
    let err = refused(&nats, &["queue", "delete", "team-a"]);
    assert!(err.contains("no queue team-a"), "{err}");
    let err = refused(&nats, &["queue", "delete", "default"]);
    assert!(err.contains("nothing to delete"), "{err}");
    let err = refused(&nats, &["queue", "create", "default", "--quota", "1"]);
    assert!(err.contains("converge queue set default"), "{err}");
    ok(&nats, &["queue", "set", "default", "--quota", "2"]);
    let list = queue_list(&nats);
    assert_eq!(list["default"]["implicit"], false);
    assert_eq!(list["default"]["spec"]["quota_gpus"], 2);
    ok(&nats, &["queue", "delete", "default"]);
    assert_eq!(queue_list(&nats)["default"]["implicit"], true);
}

/// Every worker the hosts report: job → (generation, pids of running workers).
async fn workers(bus: &converge_bus::Bus, hosts: &[&str]) -> BTreeMap<String, (u64, Vec<u32>)> {
    let mut out: BTreeMap<String, (u64, Vec<u32>)> = BTreeMap::new();
    for h in hosts {
        let Some(t) = telemetry(bus, h).await else {
            continue;
        };
        for w in t.workers {
            if w.phase != WorkerPhase::Running {
                continue;
            }
            let e = out.entry(w.job.to_string()).or_default();
            e.0 = e.0.max(w.generation);
            e.1.extend(w.pid);
        }
    }
    for (_, pids) in out.values_mut() {
        pids.sort_unstable();
    }
    out
}

async fn status(bus: &converge_bus::Bus, job: &str) -> JobStatus {
    job_status(bus, job)
        .await
        .unwrap_or_else(|| panic!("no status of {job}"))
}

/// The hosts of the preemption and lending tests, two GPUs each.
const HOSTS: [&str; 2] = ["n1", "n2"];
/// Their allocator's scheduling period.
const PERIOD: Duration = Duration::from_secs(2);

/// Agents for [`HOSTS`] and an allocator that schedules every [`PERIOD`].
fn start_cluster(nats: &NatsServer, dir: &Path) -> (Vec<Running>, Running) {
    let agents = start_agents(nats, &HOSTS, 2, dir);
    let mut cfg = allocator_config(nats, Duration::ZERO);
    cfg.scheduling_interval = PERIOD;
    (agents, start_allocator(cfg))
}

/// The jobs of `ids` whose generation or running workers differ between `before` and
/// `after` (as [`workers`] reports them).
fn changed<'a>(
    ids: &[&'a str],
    before: &BTreeMap<String, (u64, Vec<u32>)>,
    after: &BTreeMap<String, (u64, Vec<u32>)>,
) -> Vec<&'a str> {
    ids.iter()
        .copied()
        .filter(|id| after.get(*id) != before.get(*id))
        .collect()
}

/// Waits until each of `jobs` is running with `n` workers running on the hosts.
async fn wait_running(
    bus: &converge_bus::Bus,
    hosts: &[&str],
    jobs: &[(&str, usize)],
    secs: u64,
    what: &str,
) -> BTreeMap<String, (u64, Vec<u32>)> {
    wait_for(Duration::from_secs(secs), what, || async {
        let w = workers(bus, hosts).await;
        for (job, n) in jobs {
            let s = job_status(bus, job).await?;
            let (generation, pids) = w.get(*job)?;
            if s.phase != JobPhase::Running || *generation != s.generation || pids.len() != *n {
                return None;
            }
        }
        Some(w)
    })
    .await
}

/// The preemption target: four low-priority one-GPU jobs fill the cluster; a
/// high-priority two-worker job arrives. It must be placed within two scheduling periods
/// and running within two periods plus the restart time (the preempted workers' checkpoint
/// and exit, the new workers' start); exactly two low jobs (whole jobs) are preempted, the
/// other two keep their generation and worker processes, and the preempted ones resume from
/// their checkpoints once the high-priority job has finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_high_priority_job_preempts_exactly_the_low_priority_jobs_it_needs() {
    let (nats, work, bus) = start_test().await;
    let (hosts, period) = (HOSTS, PERIOD);
    let (agents, allocator) = start_cluster(&nats, work.path());

    let low = ["low-1", "low-2", "low-3", "low-4"];
    for id in low {
        let job = TrainerJob::new(id, 1000);
        submit(&nats, &write_job(&job, None, "low", work.path()));
        // Distinct start times: the newest are preempted first.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let jobs: Vec<(&str, usize)> = low.iter().map(|id| (*id, 1)).collect();
    let before = wait_running(&bus, &hosts, &jobs, 60, "four low-priority jobs running").await;
    // Let them checkpoint (every second) and report.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut steps_before = BTreeMap::new();
    for id in low {
        steps_before.insert(id, status(&bus, id).await.step);
    }

    let urgent = TrainerJob::new("urgent", 2).workers(2, 2);
    let path = write_job(&urgent, None, "high", work.path());
    let submitted = Instant::now();
    submit(&nats, &path);
    let placed = wait_for(Duration::from_secs(30), "urgent placed", || async {
        let s = job_status(&bus, "urgent").await?;
        (s.generation >= 1 && s.placement.len() == 2).then(|| submitted.elapsed())
    })
    .await;
    let after = wait_running(&bus, &hosts, &[("urgent", 2)], 60, "urgent running").await;
    let running = submitted.elapsed();
    let preempted = changed(&low, &before, &after);
    let kept: Vec<&str> = low
        .iter()
        .copied()
        .filter(|id| after.get(*id) == before.get(*id))
        .collect();
    println!(
        "preemption: urgent placed {:.2} s and running {:.2} s after submission \
         (scheduling period {:.0} s); preempted {preempted:?}, kept {kept:?}",
        placed.as_secs_f64(),
        running.as_secs_f64(),
        period.as_secs_f64()
    );
    assert_eq!(
        preempted.len(),
        2,
        "exactly the two jobs it needs: preempted {preempted:?}, before {before:?}, after {after:?}"
    );
    for id in &kept {
        let s = status(&bus, id).await;
        assert_eq!(s.phase, JobPhase::Running, "{id} keeps running");
        assert_eq!(s.generation, before[*id].0, "{id} keeps its generation");
    }
    for id in &preempted {
        let s = status(&bus, id).await;
        assert_eq!(s.phase, JobPhase::Pending, "{id}: {s:?}");
        assert!(
            !after.contains_key(*id),
            "{id}'s workers stopped: {after:?}"
        );
        for pid in &before[*id].1 {
            assert!(!pid_alive(*pid), "{id}'s worker {pid} still alive");
        }
    }
    assert!(
        placed <= 2 * period + Duration::from_millis(500),
        "placed after {placed:?}, more than two scheduling periods"
    );
    // Restart time: the preempted workers checkpoint and exit (the trainer does at once on
    // SIGTERM; the agent's stop grace is 10 s) and the new workers start.
    assert!(
        running <= 2 * period + Duration::from_secs(10),
        "running after {running:?}"
    );

    // The urgent job finishes; the preempted jobs resume from their checkpoints.
    wait_for_phase(&bus, "urgent", JobPhase::Completed, 120).await;
    let resumed = wait_running(&bus, &hosts, &jobs, 60, "the preempted jobs resumed").await;
    for id in &preempted {
        assert!(resumed[*id].0 > before[*id].0, "{id}: a new generation");
        let s = wait_for_status(&bus, id, 30, "progress after resuming", |s| {
            s.step > steps_before[id]
        })
        .await;
        assert!(
            s.step >= steps_before[id],
            "{id} resumed from its checkpoint"
        );
    }
    for id in &kept {
        assert_eq!(resumed[*id], before[*id], "{id} untouched throughout");
    }

    allocator.stop().await;
    for a in agents {
        a.stop().await;
    }
}

async fn queue_status(
    bus: &converge_bus::Bus,
    qb: &converge_bus::QueueBuckets,
    q: &str,
) -> Option<QueueStatus> {
    bus.get::<QueueStatus>(&qb.status, q)
        .await
        .ok()
        .flatten()
        .map(|(s, _)| s)
}

/// Lending and reclaim: queues team-a and team-b with 2 GPUs of quota each on a 4-GPU
/// cluster. team-a alone submits four one-GPU jobs: it borrows team-b's idle quota within
/// one scheduling period. team-b then submits two jobs: its quota is reclaimed by preempting
/// two whole team-a jobs, and both queues end at their quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_quota_is_lent_and_reclaimed() {
    let (nats, work, bus) = start_test().await;
    let qb = queue_buckets(&bus).await;
    ok(&nats, &["queue", "create", "team-a", "--quota", "2"]);
    ok(&nats, &["queue", "create", "team-b", "--quota", "2"]);
    let (hosts, period) = (HOSTS, PERIOD);
    let (agents, allocator) = start_cluster(&nats, work.path());
    for h in hosts {
        wait_for(Duration::from_secs(20), "both hosts' heartbeats", || {
            telemetry(&bus, h)
        })
        .await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    let a_jobs = ["a-1", "a-2", "a-3", "a-4"];
    let one_each = a_jobs.map(|id| (id, 1));
    let submitted = Instant::now();
    for id in a_jobs {
        submit_to(&nats, id, "team-a", work.path());
    }
    let lent = wait_for(
        Duration::from_secs(30),
        "team-a placed on 4 GPUs",
        || async {
            for id in a_jobs {
                let s = job_status(&bus, id).await?;
                if s.placement.is_empty() {
                    return None;
                }
            }
            Some(submitted.elapsed())
        },
    )
    .await;
    let before = wait_running(&bus, &hosts, &one_each, 60, "team-a's four jobs running").await;
    let a = wait_for(Duration::from_secs(10), "team-a's status", || async {
        queue_status(&bus, &qb, "team-a")
            .await
            .filter(|s| s.gpus_in_use == 4)
    })
    .await;
    assert_eq!((a.borrowed_gpus, a.running_jobs), (2, 4), "{a:?}");
    let b = queue_status(&bus, &qb, "team-b").await;
    println!(
        "lending: team-a's four jobs placed {:.2} s after submission (scheduling period {:.0} s); \
         team-a {a:?}; team-b {b:?}",
        lent.as_secs_f64(),
        period.as_secs_f64()
    );
    assert!(
        lent <= period + Duration::from_secs(1),
        "team-b's idle quota lent after {lent:?}, more than one scheduling period"
    );
    assert_eq!(b.map_or(0, |b| b.lent_gpus), 2, "team-b lends its 2 GPUs");
    tokio::time::sleep(Duration::from_secs(2)).await;

    // team-b wants its quota back.
    let b_jobs = ["b-1", "b-2"];
    let reclaim_at = Instant::now();
    for id in b_jobs {
        submit_to(&nats, id, "team-b", work.path());
    }
    let after = wait_running(
        &bus,
        &hosts,
        &[("b-1", 1), ("b-2", 1)],
        60,
        "team-b's jobs running",
    )
    .await;
    let reclaimed = reclaim_at.elapsed();
    let preempted = changed(&a_jobs, &before, &after);
    println!(
        "reclaim: team-b's jobs running {:.2} s after submission; team-a jobs preempted {preempted:?}",
        reclaimed.as_secs_f64()
    );
    assert_eq!(preempted.len(), 2, "two whole borrower jobs: {after:?}");
    for id in &preempted {
        assert!(!after.contains_key(*id), "{id} stopped whole");
        assert_eq!(status(&bus, id).await.phase, JobPhase::Pending);
    }
    let (a, b) = wait_for(Duration::from_secs(10), "both queues at quota", || async {
        let a = queue_status(&bus, &qb, "team-a").await?;
        let b = queue_status(&bus, &qb, "team-b").await?;
        (a.gpus_in_use == 2 && b.gpus_in_use == 2).then_some((a, b))
    })
    .await;
    assert_eq!((a.borrowed_gpus, b.borrowed_gpus), (0, 0), "{a:?} {b:?}");
    assert_eq!(a.pending_jobs, 2, "{a:?}");

    // A third team-b job waits: both queues are at their quota, nothing is lent. The
    // preempted team-a jobs say why they wait, the new one what its queue holds.
    submit_to(&nats, "b-3", "team-b", work.path());
    tokio::time::sleep(2 * period).await;
    let jobs = ok(&nats, &["jobs"]);
    println!("{jobs}");
    assert!(
        jobs.contains("waiting for queue team-b: 2 GPUs in use, fair share 2.0, quota 2"),
        "{jobs}"
    );
    assert!(jobs.contains("over its fair share"), "{jobs}");
    let table = ok(&nats, &["queue", "list"]);
    println!("{table}");

    // team-b deleted with --force: its jobs stop and wait with the reason; team-a's pending
    // jobs take the GPUs no quota covers any more.
    let err = refused(&nats, &["queue", "delete", "team-b"]);
    assert!(err.contains("3 active job(s): b-1, b-2, b-3"), "{err}");
    ok(&nats, &["queue", "delete", "team-b", "--force"]);
    let after_delete = wait_running(
        &bus,
        &hosts,
        &one_each,
        60,
        "team-a's four jobs running again",
    )
    .await;
    for id in ["b-1", "b-2", "b-3"] {
        let s = status(&bus, id).await;
        assert_eq!(s.phase, JobPhase::Pending, "{id}: {s:?}");
        assert_eq!(
            s.message.as_deref(),
            Some("queue \"team-b\" does not exist"),
            "{id}"
        );
        assert!(!after_delete.contains_key(id), "{id}'s workers stopped");
    }
    let jobs = ok(&nats, &["jobs"]);
    assert!(
        jobs.contains("team-b (missing)/normal")
            && jobs.contains("queue \"team-b\" does not exist"),
        "{jobs}"
    );
    allocator.stop().await;
    for a in agents {
        a.stop().await;
    }
}

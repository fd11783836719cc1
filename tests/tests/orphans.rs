//! No orphan workers, with the real `converge-agent` binary and real processes: a SIGKILLed
//! agent takes its workers down (SIGTERM through the worker shim's lifeline, SIGKILL after
//! the stop grace for a worker that ignores it); a worker left alive by an agent killed
//! together with its shim is stopped by the restarted agent before it starts that rank
//! again, never two copies at once; the state file's pid-reuse check spares a process that
//! only shares a recorded pid. Workers get none of the agent's NATS settings and only the
//! allowed part of its environment; with `--worker-uids` and `--worker-cgroup` jobs cannot
//! read each other's checkpoints or the agent's state and environment, and a process that
//! left its worker's process group dies with the worker.

use converge_agent::strays::{self, ProcStat, Recorded, StateFile};
use converge_common::{HostId, HostPlan, HostTelemetry, JobId, PROTOCOL_VERSION, WorkerAssignment};
use converge_tests::*;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A shell loop printing a progress line every 100 ms; `ignore_term` makes it ignore SIGTERM
/// (and SIGPIPE, which its next line would get once the agent is gone).
fn looping(ignore_term: bool) -> Vec<String> {
    let trap = if ignore_term {
        "trap '' TERM PIPE; "
    } else {
        ""
    };
    let script = format!(
        "{trap}i=0; while :; do i=$((i+1)); \
         echo \"CONVERGE_PROGRESS {{\\\"step\\\":$i,\\\"samples\\\":$((i*8)),\\\"loss\\\":0.5}}\"; \
         sleep 0.1; done"
    );
    vec!["sh".into(), "-c".into(), script]
}

fn worker(job: &str, rank: u32, world: u32, command: Vec<String>) -> WorkerAssignment {
    WorkerAssignment {
        job: JobId::new(job).unwrap(),
        generation: 1,
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        gpus: vec![rank],
        master_addr: "127.0.0.1".into(),
        master_port: 21900,
        command,
        env: BTreeMap::new(),
        max_restarts: 3,
        num_ps: 0,
        hosts: 1,
        batch: None,
        node_rank: Some(0),
        shadow: None,
    }
}

async fn put_plan(bus: &converge_bus::Bus, host: &str, workers: Vec<WorkerAssignment>) {
    let plan = HostPlan {
        protocol: PROTOCOL_VERSION,
        host: HostId::new(host).unwrap(),
        workers,
    };
    bus.put(&bus.plans, host, &plan).await.unwrap();
}

/// The real agent binary as a child process; its log goes to `<work>/agent-<n>.log`.
fn spawn_agent(nats: &NatsServer, host: &str, work: &Path, n: u32) -> (Child, PathBuf) {
    spawn_agent_with_env(nats, host, work, n, &[], &[])
}

/// [`spawn_agent`] with `env` added to the agent's environment and `args` to its flags.
fn spawn_agent_with_env(
    nats: &NatsServer,
    host: &str,
    work: &Path,
    n: u32,
    env: &[(&str, &str)],
    args: &[&str],
) -> (Child, PathBuf) {
    let log = work.join(format!("agent-{n}.log"));
    let child = Command::new(bin_path("converge-agent"))
        .envs(env.iter().copied())
        .args(args)
        .args(["--nats-url", &nats.url, "--host-id", host])
        .args(["--advertise-addr", "127.0.0.1", "--fake-gpus", "2"])
        .args(["--telemetry-interval", "300ms", "--stop-grace", "2s"])
        .args(["--backoff-base", "200ms", "--backoff-cap", "1s"])
        .arg("--log-dir")
        .arg(work.join("logs"))
        .arg("--checkpoint-root")
        .arg(work.join("checkpoints"))
        .arg("--state-dir")
        .arg(work.join("state"))
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    (child, log)
}

fn kill9(pid: u32) {
    let ok = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -KILL {pid}");
}

/// Live (not zombie) processes of process group `pgid`.
fn group(pgid: u32) -> Vec<u32> {
    strays::scan_proc()
        .into_iter()
        .filter(|p| p.pgrp == pgid && !p.zombie)
        .map(|p| p.pid)
        .collect()
}

/// Process groups of live processes whose environment carries `CONVERGE_JOB_ID=job` and
/// `RANK=rank`: one per running copy of that rank (shim and worker share it).
fn rank_groups(job: &str, rank: u32) -> BTreeSet<u32> {
    let want = [format!("CONVERGE_JOB_ID={job}"), format!("RANK={rank}")];
    strays::scan_proc()
        .into_iter()
        .filter(|p: &ProcStat| !p.zombie)
        .filter(|p| {
            std::fs::read(format!("/proc/{}/environ", p.pid)).is_ok_and(|env| {
                want.iter()
                    .all(|w| env.split(|&b| b == 0).any(|v| v == w.as_bytes()))
            })
        })
        .map(|p| p.pgrp)
        .collect()
}

/// The running workers' pids (= process groups) by rank, from the heartbeat.
async fn running(bus: &converge_bus::Bus, host: &str, job: &str) -> BTreeMap<u32, u32> {
    let Ok(Some((t, _))) = bus.get::<HostTelemetry>(&bus.hosts, host).await else {
        return BTreeMap::new();
    };
    t.workers
        .iter()
        .filter(|w| w.job.as_str() == job && w.phase == converge_common::WorkerPhase::Running)
        .filter_map(|w| Some((w.rank, w.pid?)))
        .collect()
}

async fn wait_gone(pids: &[u32], within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|&p| pid_alive(p)).collect();
        if left.is_empty() {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "still alive after {within:?}: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_agent_takes_its_workers_down() {
    let (nats, work, bus) = start_test().await;
    let (mut agent, agent_log) = spawn_agent(&nats, "o1", work.path(), 1);
    // Rank 0 stops on SIGTERM; rank 1 ignores it and needs the SIGKILL after the grace.
    put_plan(
        &bus,
        "o1",
        vec![
            worker("orph", 0, 2, looping(false)),
            worker("orph", 1, 2, looping(true)),
        ],
    )
    .await;
    let groups = wait_for(Duration::from_secs(20), "both workers running", || async {
        let r = running(&bus, "o1", "orph").await;
        (r.len() == 2).then_some(r)
    })
    .await;
    // Each worker runs under its shim, in the shim's process group.
    let mut members = BTreeMap::new();
    for (&rank, &pgid) in &groups {
        let m = wait_for(Duration::from_secs(5), "shim and worker", || async {
            let g = group(pgid);
            (g.len() >= 2).then_some(g)
        })
        .await;
        assert!(m.contains(&pgid), "rank {rank}: the shim leads the group");
        members.insert(rank, m);
    }
    // stdout still reaches the agent: it copies the progress lines into the log file.
    let log0 = work.path().join("logs/orph/gen1-rank0.log");
    wait_for(
        Duration::from_secs(5),
        "progress lines in the log",
        || async {
            let text = std::fs::read_to_string(&log0).unwrap_or_default();
            (text.matches("CONVERGE_PROGRESS").count() >= 3).then_some(())
        },
    )
    .await;

    agent.kill().unwrap(); // SIGKILL
    agent.wait().unwrap();
    let killed = Instant::now();
    wait_gone(&members[&0], Duration::from_secs(2)).await;
    let t0 = killed.elapsed();
    wait_gone(&members[&1], Duration::from_secs(6)).await;
    let t1 = killed.elapsed();
    println!(
        "after the agent's SIGKILL: rank 0 (stops on SIGTERM) gone in {t0:?}, rank 1 (ignores it) in {t1:?}"
    );
    assert!(
        t1 >= Duration::from_millis(1500),
        "rank 1 was killed before the 2 s grace: {t1:?}"
    );
    for pgid in groups.values() {
        assert!(group(*pgid).is_empty(), "group {pgid} left");
    }
    assert!(rank_groups("orph", 0).is_empty() && rank_groups("orph", 1).is_empty());
    let shim_said = std::fs::read_to_string(work.path().join("logs/orph/gen1-rank1.log")).unwrap();
    assert!(
        shim_said.contains("the agent is gone") && shim_said.contains("SIGKILL"),
        "{shim_said}"
    );
    let said = std::fs::read_to_string(agent_log).unwrap();
    assert!(said.contains("worker started"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_stops_strays_before_starting_the_rank_again() {
    let (nats, work, bus) = start_test().await;
    let (mut agent, _) = spawn_agent(&nats, "o2", work.path(), 1);
    put_plan(&bus, "o2", vec![worker("stray", 0, 1, looping(true))]).await;
    let old = wait_for(Duration::from_secs(20), "worker running", || async {
        running(&bus, "o2", "stray").await.get(&0).copied()
    })
    .await;
    let members = wait_for(Duration::from_secs(5), "shim and worker", || async {
        let g = group(old);
        (g.len() >= 2).then_some(g)
    })
    .await;
    let state = std::fs::read_to_string(work.path().join("state/workers-o2.state")).unwrap();
    assert!(
        state.contains(&format!("worker {old} ")),
        "state file: {state}"
    );

    // The agent and its shim die together: the worker (which ignores SIGTERM) is left over.
    agent.kill().unwrap();
    kill9(old);
    agent.wait().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let left: Vec<u32> = members
        .iter()
        .copied()
        .filter(|&p| p != old && pid_alive(p))
        .collect();
    assert!(!left.is_empty(), "no stray left to test with");
    assert_eq!(rank_groups("stray", 0), BTreeSet::from([old]));

    // Watch every 10 ms that no two copies of the rank run at once.
    let most = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (most, stop) = (most.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                most.fetch_max(rank_groups("stray", 0).len(), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let restarted = Instant::now();
    let (mut again, log) = spawn_agent(&nats, "o2", work.path(), 2);
    let new = wait_for(
        Duration::from_secs(20),
        "the rank running again",
        || async {
            running(&bus, "o2", "stray")
                .await
                .get(&0)
                .copied()
                .filter(|&p| p != old)
        },
    )
    .await;
    let took = restarted.elapsed();
    stop.store(true, Ordering::SeqCst);
    watcher.join().unwrap();
    assert!(left.iter().all(|&p| !pid_alive(p)), "the stray survived");
    assert_eq!(rank_groups("stray", 0), BTreeSet::from([new]));
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "two copies of the rank ran at once (or none was seen)"
    );
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        said.contains("stray worker of an earlier run") && said.contains("SIGKILL"),
        "{said}"
    );
    println!(
        "the restarted agent stopped the stray (SIGTERM ignored, SIGKILL after 2 s) and ran the rank again {took:?} after its start"
    );
    again.kill().unwrap();
    again.wait().unwrap();
    wait_gone(&group(new), Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_file_check_spares_a_reused_pid() {
    let (nats, work, bus) = start_test().await;
    // Two process groups of `sleep`: the state file records one with its start time, the
    // other with another start time (as if its pid had been reused).
    let sleeper = || {
        Command::new("sleep")
            .arg("300")
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let (mut ours, mut other) = (sleeper(), sleeper());
    let start = |c: &Child| strays::read_stat(c.id()).unwrap().start_ticks;
    let record = |c: &Child, start_ticks: u64| Recorded {
        job: "old".into(),
        generation: 1,
        rank: 0,
        pid: c.id(),
        start_ticks,
    };
    std::fs::create_dir_all(work.path().join("state")).unwrap();
    StateFile {
        boot_id: strays::boot_id(),
        workers: vec![
            record(&ours, start(&ours)),
            record(&other, start(&other) + 1),
        ],
    }
    .write(&work.path().join("state/workers-o3.state"))
    .unwrap();

    let (mut agent, log) = spawn_agent(&nats, "o3", work.path(), 1);
    // Strays are stopped before the agent connects: its first heartbeat comes after.
    wait_for(Duration::from_secs(15), "the agent's heartbeat", || async {
        bus.get::<HostTelemetry>(&bus.hosts, "o3")
            .await
            .ok()
            .flatten()
    })
    .await;
    let status = ours.try_wait().unwrap();
    assert!(
        status.is_some_and(|s| std::os::unix::process::ExitStatusExt::signal(&s) == Some(15)),
        "the recorded group was not stopped: {status:?}"
    );
    assert!(
        other.try_wait().unwrap().is_none(),
        "a reused pid was killed"
    );
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains(&format!("pgid={}", ours.id())), "{said}");
    assert!(!said.contains(&format!("pgid={}", other.id())), "{said}");
    // The state file now lists the agent's own workers: none.
    let state = StateFile::parse(
        &std::fs::read_to_string(work.path().join("state/workers-o3.state")).unwrap(),
    )
    .unwrap();
    assert!(state.workers.is_empty(), "{state:?}");
    other.kill().unwrap();
    other.wait().unwrap();
    agent.kill().unwrap();
    agent.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_get_none_of_the_agents_nats_settings() {
    let (nats, work, bus) = start_test().await;
    let secret = work.path().join("nats-password");
    std::fs::write(&secret, "s3cret").unwrap();
    let url = nats.url.clone();
    // What an operator's unit gives the agent: its NATS URL, a password file and systemd's
    // credentials directory (the URL flag wins over the variable; both are the same server).
    let agent_env = [
        ("CONVERGE_NATS_URL", url.as_str()),
        ("CONVERGE_NATS_CONNECT_TIMEOUT", "5s"),
        ("CREDENTIALS_DIRECTORY", work.path().to_str().unwrap()),
        ("CONVERGE_DATA_DIR", "/srv/data"),
        // Not on the allow-list (--worker-env): an operator's or a CI's secret.
        ("AWS_SECRET_ACCESS_KEY", "not-for-workers"),
        ("NCCL_SOCKET_IFNAME", "eth0"),
    ];
    let (mut agent, _) = spawn_agent_with_env(&nats, "e1", work.path(), 1, &agent_env, &[]);
    // Written whole, then renamed: the test never reads half a file.
    let dump = "env > \"$CONVERGE_CHECKPOINT_DIR/env.tmp\" && \
                mv \"$CONVERGE_CHECKPOINT_DIR/env.tmp\" \"$CONVERGE_CHECKPOINT_DIR/env.txt\"; \
                exec sleep 30"
        .to_string();
    let mut w = worker("envjob", 0, 1, vec!["sh".into(), "-c".into(), dump]);
    // A job may still set such a name for itself.
    w.env
        .insert("CONVERGE_NATS_INBOX_PREFIX".into(), "_JOB_OWN".into());
    put_plan(&bus, "e1", vec![w]).await;
    let file = work.path().join("checkpoints/envjob/env.txt");
    let env = wait_for(
        Duration::from_secs(20),
        "the worker's environment",
        || async {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            (!text.is_empty()).then_some(text)
        },
    )
    .await;
    let _ = agent.kill();
    let _ = agent.wait();
    let names: BTreeSet<&str> = env.lines().filter_map(|l| l.split('=').next()).collect();
    for withheld in [
        "CONVERGE_NATS_URL",
        "CONVERGE_NATS_CONNECT_TIMEOUT",
        "CREDENTIALS_DIRECTORY",
        "AWS_SECRET_ACCESS_KEY",
    ] {
        assert!(
            !names.contains(withheld),
            "the worker got {withheld}:\n{env}"
        );
    }
    assert!(
        !env.contains(&url),
        "the NATS URL reached the worker:\n{env}"
    );
    assert!(
        env.lines().any(|l| l == "CONVERGE_DATA_DIR=/srv/data"),
        "{env}"
    );
    assert!(
        env.lines()
            .any(|l| l == "CONVERGE_NATS_INBOX_PREFIX=_JOB_OWN"),
        "{env}"
    );
    assert!(env.lines().any(|l| l == "CONVERGE_JOB_ID=envjob"), "{env}");
    assert!(env.lines().any(|l| l == "NCCL_SOCKET_IFNAME=eth0"), "{env}");
    assert!(names.contains("PATH"), "{env}");
}

/// The cgroup v2 mount point (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a hybrid
/// layout).
fn cgroup2_mount() -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
        })
        .expect("this test needs a cgroup v2 hierarchy (none in /proc/self/mounts)")
}

/// Prints a log file when the test fails (before its temporary directory goes).
struct PrintOnPanic(PathBuf);

impl Drop for PrintOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.0).unwrap_or_default();
            eprintln!("--- {} ---\n{text}", self.0.display());
        }
    }
}

/// Removes empty directories when dropped, ignoring errors.
struct RemoveDirsOnDrop(Vec<PathBuf>);

impl Drop for RemoveDirsOnDrop {
    fn drop(&mut self) {
        for dir in &self.0 {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// `key=value` lines of a file a worker wrote whole.
fn read_report(path: &Path) -> Option<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(
        text.lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

/// Hostile jobs on an agent started with `--worker-uids` and `--worker-cgroup` (the real
/// binary, a real nats-server, as root): each job's workers run under a user id of their
/// own, so job A cannot read or write job B's checkpoint directory, read the agent's state
/// file or its environment (`/proc/<agent>/environ`, where its NATS password would be);
/// a process A started with `setsid` (out of its process group, where the agent's
/// SIGTERM and SIGKILL go) and ignoring SIGTERM is killed with A's cgroup when A is
/// stopped. Fails without the flags: A reads B's secret and the escaped process lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_isolated_from_each_other_and_from_the_agent() {
    init_tracing();
    let euid = Command::new("id").arg("-u").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&euid.stdout).trim(),
        "0",
        "this test starts workers under other users: run it as root (CI does)"
    );
    let nats = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    // Workers under other users must reach their checkpoint directories below it.
    std::fs::set_permissions(
        work.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let cgroup_root = cgroup2_mount().join(format!("converge-test-{}", std::process::id()));
    let bus = nats.bus().await;
    let (mut agent, log) = spawn_agent_with_env(
        &nats,
        "i1",
        work.path(),
        1,
        &[("AWS_SECRET_ACCESS_KEY", "agent-secret-in-environ")],
        &[
            "--worker-uids",
            "61000-61999",
            "--worker-cgroup",
            cgroup_root.to_str().expect("a UTF-8 cgroup path"),
        ],
    );
    let ckpt = |job: &str| work.path().join("checkpoints").join(job);
    let state = work.path().join("state/workers-i1.state");
    let _log_on_failure = PrintOnPanic(log.clone());
    // On failure too, the test's cgroups go (deepest first; removing a busy one fails).
    let _cgroups = RemoveDirsOnDrop(vec![cgroup_root.join("i1"), cgroup_root.clone()]);

    // Job B keeps a secret in its checkpoint directory.
    let b_script = "echo b-secret > \"$CONVERGE_CHECKPOINT_DIR/secret\"; \
                    echo \"uid=$(id -u)\" > \"$CONVERGE_CHECKPOINT_DIR/ready.tmp\"; \
                    mv \"$CONVERGE_CHECKPOINT_DIR/ready.tmp\" \"$CONVERGE_CHECKPOINT_DIR/ready\"; \
                    exec sleep 300";
    let b = worker(
        "iso-b",
        0,
        1,
        vec!["sh".into(), "-c".into(), b_script.into()],
    );
    put_plan(&bus, "i1", vec![b.clone()]).await;
    let b_ready = wait_for(Duration::from_secs(20), "job B's worker", || async {
        read_report(&ckpt("iso-b").join("ready")).filter(|r| r.contains_key("uid"))
    })
    .await;

    // Job A tries everything, and leaves a process outside its process group.
    let a_script = r#"d="$CONVERGE_CHECKPOINT_DIR"
setsid sh -c 'trap "" TERM; echo $$ > "$0/escapee.tmp"; mv "$0/escapee.tmp" "$0/escapee"; while :; do sleep 1; done' "$d" &
{
  echo "uid=$(id -u)"
  if cat "$OTHER/secret" >/dev/null 2>&1; then echo read_other=yes; else echo read_other=no; fi
  if echo x 2>/dev/null > "$OTHER/planted"; then echo wrote_other=yes; else echo wrote_other=no; fi
  if cat "$STATE" >/dev/null 2>&1; then echo read_state=yes; else echo read_state=no; fi
  if grep -q agent-secret "/proc/$AGENT_PID/environ" 2>/dev/null; then echo read_agent_env=yes; else echo read_agent_env=no; fi
} > "$d/report.tmp"
mv "$d/report.tmp" "$d/report"
exec sleep 300"#;
    let mut a = worker(
        "iso-a",
        1,
        2,
        vec!["sh".into(), "-c".into(), a_script.into()],
    );
    a.env.extend([
        ("OTHER".to_string(), ckpt("iso-b").display().to_string()),
        ("STATE".to_string(), state.display().to_string()),
        ("AGENT_PID".to_string(), agent.id().to_string()),
    ]);
    put_plan(&bus, "i1", vec![b.clone(), a]).await;
    let report = wait_for(Duration::from_secs(20), "job A's report", || async {
        read_report(&ckpt("iso-a").join("report"))
    })
    .await;
    let escapee: u32 = wait_for(
        Duration::from_secs(10),
        "job A's escaped process",
        || async {
            std::fs::read_to_string(ckpt("iso-a").join("escapee"))
                .ok()?
                .trim()
                .parse()
                .ok()
        },
    )
    .await;

    let uid = |r: &BTreeMap<String, String>| r["uid"].parse::<u32>().unwrap();
    let (uid_a, uid_b) = (uid(&report), uid(&b_ready));
    assert!((61000..=61999).contains(&uid_a), "{report:?}");
    assert!((61000..=61999).contains(&uid_b), "{b_ready:?}");
    assert_ne!(uid_a, uid_b, "two jobs share a user id");
    for (what, expect) in [
        ("read_other", "no"),
        ("wrote_other", "no"),
        ("read_state", "no"),
        ("read_agent_env", "no"),
    ] {
        assert_eq!(report[what], expect, "job A: {what}: {report:?}");
    }
    use std::os::unix::fs::MetadataExt;
    for (job, owner) in [("iso-a", uid_a), ("iso-b", uid_b)] {
        let meta = std::fs::metadata(ckpt(job)).unwrap();
        assert_eq!((meta.uid(), meta.mode() & 0o777), (owner, 0o700), "{job}");
    }
    let state_meta = std::fs::metadata(&state).unwrap();
    assert_eq!(
        state_meta.mode() & 0o077,
        0,
        "the state file is the agent's alone"
    );
    // The escaped process left A's process group: the agent's killpg cannot reach it.
    let stat = strays::read_stat(escapee).expect("the escaped process runs");
    assert!(!stat.zombie);
    assert_eq!(
        stat.pgrp, escapee,
        "setsid made it a group (and session) leader"
    );

    // A leaves the plan: its worker is stopped, and its cgroup with the escaped process.
    put_plan(&bus, "i1", vec![b]).await;
    let started = Instant::now();
    wait_for(
        Duration::from_secs(15),
        "the escaped process to be killed",
        || async {
            strays::read_stat(escapee)
                .is_none_or(|s| s.zombie)
                .then_some(())
        },
    )
    .await;
    let killed_after = started.elapsed();
    let host_cgroup = cgroup_root.join("i1");
    let a_cgroups = || {
        std::fs::read_dir(&host_cgroup)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("iso-a."))
                    .count()
            })
            .unwrap_or(0)
    };
    wait_for(
        Duration::from_secs(10),
        "job A's cgroup to be removed",
        || async { (a_cgroups() == 0).then_some(()) },
    )
    .await;
    eprintln!("the escaped process was gone {killed_after:?} after job A left the plan");

    put_plan(&bus, "i1", vec![]).await;
    wait_for(
        Duration::from_secs(15),
        "job B's cgroup to be removed",
        || async {
            // Interface files (cgroup.procs...) stay; no worker's cgroup does.
            std::fs::read_dir(&host_cgroup)
                .is_ok_and(|d| !d.flatten().any(|e| e.path().is_dir()))
                .then_some(())
        },
    )
    .await;
    let _ = agent.kill();
    let _ = agent.wait();
    std::fs::remove_dir(&host_cgroup).unwrap();
    std::fs::remove_dir(&cgroup_root).unwrap();
}

//! NATS security: a real nats-server configured by `deploy/nats/gen-config.sh` (one account,
//! one user per role, the permissions of docs/security.md), the allocator, two agents and
//! the `converge` CLI each with its own user. A job runs end to end while the server refuses
//! what each role may not do; refusals are the server's permissions violations, reported at
//! once, not timeouts; nothing refused stops a process. Progress the server lets an agent
//! publish is still refused by the allocator unless the job is placed on the agent's host,
//! and no client can purge a bucket with a rollup header.

use converge_bus::{Bus, BusError, DenialKind, NatsArgs, Setup};
use converge_common::{HostPlan, HostTelemetry, JobPhase, JobSpec, PROTOCOL_VERSION, subjects};
use converge_tests::*;
use futures::StreamExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A refusal must come from the server (its permissions violation), well before any
/// request timeout (5 s for JetStream, 10 s for requests).
const REFUSAL_WITHIN: Duration = Duration::from_secs(3);

fn converge_as(s: &SecuredNats, user: &str, args: &[&str]) -> std::process::Output {
    Command::new(bin_path("converge"))
        .env("CONVERGE_NATS_URL", &s.nats.url)
        .env("CONVERGE_NATS_USER", user)
        .env("CONVERGE_NATS_PASSWORD_FILE", s.password_file(user))
        .env_remove("CONVERGE_NATS_PASSWORD")
        .env_remove("CONVERGE_NATS_CREDS")
        .args(args)
        .output()
        .expect("run converge")
}

/// Awaits `op` and checks that the server refused it: a permissions violation for
/// `subject`, reported within [`REFUSAL_WITHIN`].
async fn refused<T: std::fmt::Debug>(
    what: &str,
    subject: &str,
    op: impl std::future::Future<Output = Result<T, BusError>>,
) {
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(15), op)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within 15 s"));
    match result {
        Err(BusError::Denied { denial, .. }) => {
            assert_eq!(denial.subject, subject, "{what}");
            assert_eq!(denial.kind, DenialKind::Publish, "{what}");
        }
        other => panic!("{what}: expected a permissions violation for {subject}, got {other:?}"),
    }
    assert!(
        started.elapsed() < REFUSAL_WITHIN,
        "{what}: refused after {:?}, which looks like a timeout",
        started.elapsed()
    );
}

/// A one-worker plan for `host` whose command is `marker` (built from JSON, so that new
/// optional fields of the protocol need no change here).
fn plan(host: &str, marker: &str) -> HostPlan {
    serde_json::from_value(serde_json::json!({
        "protocol": PROTOCOL_VERSION,
        "host": host,
        "workers": [{
            "job": "j", "generation": 1, "rank": 0, "world_size": 1, "local_rank": 0,
            "local_world_size": 1, "gpus": [0], "master_addr": "127.0.0.1",
            "master_port": 20000, "command": [marker], "max_restarts": 0
        }]
    }))
    .expect("a valid plan")
}

fn write_spec(dir: &Path, id: &str) -> std::path::PathBuf {
    write_spec_sized(dir, id, 2)
}

fn write_spec_sized(dir: &Path, id: &str, workers: u32) -> std::path::PathBuf {
    TrainerJob {
        step_delay_ms: 5,
        checkpoint_every_s: 5,
        ..TrainerJob::new(id, 6)
    }
    .workers(workers, workers)
    .write(dir)
}

/// The allocator, two agents and the CLI with their own users run a two-worker job to
/// completion; meanwhile a second connection as `agent-n1` (a compromised agent) and one
/// as `cli` try what their roles may not, and each attempt is refused by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secured_cluster_runs_a_job_and_refuses_what_each_role_may_not_do() {
    init_tracing();
    let s = SecuredNats::start(&["n1", "n2"]);
    let work = tempfile::tempdir().unwrap();

    // The allocator creates the buckets; agents and the CLI may only open them.
    let allocator = s.start_allocator();
    let cli = s.cli_bus().await;
    let agent = |host: &str| s.start_agent(host, work.path());
    let (agent1, agent2) = (agent("n1"), agent("n2"));

    let spec = write_spec(work.path(), "secure");
    submit_as_cli(&s, &spec);
    let running = wait_for_status(&cli, "secure", 30, "job running on n1 and n2", |s| {
        s.phase == JobPhase::Running && s.world_size == 2
    })
    .await;
    assert_eq!(placed_hosts(&running), ["n1", "n2"]);

    // A second connection with n1's credentials.
    let a1 = s.bus_as("agent-n1", Setup::OpenOrCreate).await.unwrap();
    // Its own plan: get and watch work.
    let (own, _) = a1
        .get::<HostPlan>(&a1.plans, "n1")
        .await
        .unwrap()
        .expect("n1 has a plan");
    assert_eq!(own.host.as_str(), "n1");
    assert!(own.workers.iter().any(|w| w.job.as_str() == "secure"));
    let mut watch = a1.watch_key(&a1.plans, "n1", true).await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .expect("the watch delivers the current plan")
        .unwrap()
        .unwrap();
    assert_eq!(first.key, "n1");
    drop(watch);

    // Another host's plan: no read, no watch (ours or the client's own), no write.
    refused(
        "agent-n1 reads n2's plan",
        "$JS.API.DIRECT.GET.KV_converge-plans.$KV.converge-plans.n2",
        a1.get::<HostPlan>(&a1.plans, "n2"),
    )
    .await;
    let started = Instant::now();
    match a1.watch_key(&a1.plans, "n2", true).await {
        Err(BusError::Denied { denial, .. }) => {
            assert!(
                denial
                    .subject
                    .starts_with("$JS.API.CONSUMER.CREATE.KV_converge-plans.")
                    && denial.subject.ends_with(".$KV.converge-plans.n2"),
                "{denial}"
            );
            assert!(started.elapsed() < REFUSAL_WITHIN);
        }
        Err(e) => panic!("agent-n1 watches n2's plan: expected a refusal, got {e}"),
        Ok(_) => panic!("agent-n1 watches n2's plan: expected a refusal, got a watch"),
    }
    // async-nats' own watch creates its consumer through the subject without the key:
    // refused for agents altogether.
    let denial = a1
        .denials
        .guard(|_| true, a1.plans.watch_with_history("n2"))
        .await
        .err()
        .expect("Store::watch_with_history refused");
    assert_eq!(denial.subject, "$JS.API.CONSUMER.CREATE.KV_converge-plans");
    refused(
        "agent-n1 writes n2's plan",
        "$KV.converge-plans.n2",
        a1.put(&a1.plans, "n2", &plan("n2", "evil")),
    )
    .await;
    refused(
        "agent-n1 writes its own plan",
        "$KV.converge-plans.n1",
        a1.put(&a1.plans, "n1", &plan("n1", "evil")),
    )
    .await;

    // Job status and specs: no writes; specs not even readable.
    let mut forged = job_status(&cli, "secure").await.unwrap();
    forged.phase = JobPhase::Failed;
    refused(
        "agent-n1 writes a job status",
        "$KV.converge-job-status.secure",
        a1.put(&a1.status, "secure", &forged),
    )
    .await;
    let (mut spec, _) = cli
        .get::<JobSpec>(&cli.jobs, "secure")
        .await
        .unwrap()
        .unwrap();
    spec.cancelled = true;
    refused(
        "agent-n1 cancels the job",
        "$KV.converge-jobs.secure",
        a1.put(&a1.jobs, "secure", &spec),
    )
    .await;
    spec.id = "other".parse().unwrap();
    refused(
        "agent-n1 submits a job",
        "$KV.converge-jobs.other",
        a1.put(&a1.jobs, "other", &spec),
    )
    .await;
    refused(
        "agent-n1 reads a job spec",
        "$JS.API.DIRECT.GET.KV_converge-jobs.$KV.converge-jobs.secure",
        a1.get::<JobSpec>(&a1.jobs, "secure"),
    )
    .await;
    // The viewer (the dashboard's user) reads specs but writes none.
    let viewer = s.bus_as("viewer", Setup::OpenOrCreate).await.unwrap();
    assert!(
        viewer
            .get::<JobSpec>(&viewer.jobs, "secure")
            .await
            .unwrap()
            .is_some()
    );
    refused(
        "viewer cancels the job",
        "$KV.converge-jobs.secure",
        viewer.put(&viewer.jobs, "secure", &spec),
    )
    .await;
    refused(
        "viewer submits a job",
        "$KV.converge-jobs.other",
        viewer.put(&viewer.jobs, "other", &spec),
    )
    .await;

    // Another host's heartbeat and telemetry.
    let (t2, _) = cli
        .get::<HostTelemetry>(&cli.hosts, "n2")
        .await
        .unwrap()
        .unwrap();
    refused(
        "agent-n1 writes n2's heartbeat",
        "$KV.converge-hosts.n2",
        a1.put(&a1.hosts, "n2", &t2),
    )
    .await;
    let mut denials = a1.denials.subscribe();
    a1.publish(subjects::telemetry(&t2.host), &t2)
        .await
        .unwrap();
    a1.client.flush().await.unwrap();
    let d = tokio::time::timeout(REFUSAL_WITHIN, denials.recv())
        .await
        .expect("the server refuses n2's telemetry subject")
        .unwrap();
    assert_eq!(d.subject, "converge.v1.telemetry.n2");
    // Nobody else's replies: the inboxes of other users are not subscribable.
    let mut denials = a1.denials.subscribe();
    let _sniff = a1.client.subscribe("_INBOX.>").await.unwrap();
    a1.client.flush().await.unwrap();
    let d = tokio::time::timeout(REFUSAL_WITHIN, denials.recv())
        .await
        .expect("the server refuses a subscription to every inbox")
        .unwrap();
    assert_eq!(
        (d.kind, d.subject.as_str()),
        (DenialKind::Subscribe, "_INBOX.>")
    );

    // The CLI writes specs, never plans or statuses.
    refused(
        "cli writes a plan",
        "$KV.converge-plans.n1",
        cli.put(&cli.plans, "n1", &plan("n1", "evil")),
    )
    .await;
    refused(
        "cli writes a job status",
        "$KV.converge-job-status.secure",
        cli.put(&cli.status, "secure", &forged),
    )
    .await;
    refused(
        "cli reads a plan",
        "$JS.API.DIRECT.GET.KV_converge-plans.$KV.converge-plans.n1",
        cli.get::<HostPlan>(&cli.plans, "n1"),
    )
    .await;

    // Nothing of that disturbed the cluster: the job completes, every process still runs.
    let done = wait_for_status(&cli, "secure", 120, "the job completes", |s| {
        s.phase.is_terminal()
    })
    .await;
    assert_eq!(done.phase, JobPhase::Completed, "{done:?}");
    assert_eq!(
        done.generation, running.generation,
        "the refused operations caused a re-placement"
    );
    assert!(allocator.is_running() && agent1.is_running() && agent2.is_running());
    for h in ["n1", "n2"] {
        let (t, _) = cli
            .get::<HostTelemetry>(&cli.hosts, h)
            .await
            .unwrap()
            .unwrap();
        assert!(
            converge_bus::unix_now() - t.time < 5.0,
            "{h}'s heartbeat is stale"
        );
    }
    let out = converge_as(&s, "cli", &["--json", "hosts"]);
    succeeded(&out);
    let out = converge_as(&s, "cli", &["--json", "jobs", "--all"]);
    succeeded(&out);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["status"]["phase"], "completed");
    dashboard_reads_the_cluster_as_viewer(&s).await;

    agent1.stop().await;
    agent2.stop().await;
    allocator.stop().await;
}

/// `converge dashboard` with the viewer user's credentials (read only) reads the job's
/// status, its progress reports (the viewer may follow the progress stream, nothing more)
/// and the queues' statuses.
async fn dashboard_reads_the_cluster_as_viewer(s: &SecuredNats) {
    use std::io::{BufRead as _, Read as _, Write as _};
    let mut child = Command::new(bin_path("converge"))
        .env("CONVERGE_NATS_URL", &s.nats.url)
        .env("CONVERGE_NATS_USER", "viewer")
        .env("CONVERGE_NATS_PASSWORD_FILE", s.password_file("viewer"))
        .env_remove("CONVERGE_NATS_PASSWORD")
        .env_remove("CONVERGE_NATS_CREDS")
        .args(["dashboard", "--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run converge dashboard");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("dashboard: http://")
        .and_then(|a| a.strip_suffix('/'))
        .unwrap_or_else(|| panic!("no dashboard address in {line:?}"))
        .to_string();
    let state = wait_for(Duration::from_secs(20), "the dashboard's state", || {
        let addr = addr.clone();
        async move {
            let mut conn = std::net::TcpStream::connect(&addr).ok()?;
            // The dashboard answers only to loopback names in Host (DNS rebinding).
            let request =
                format!("GET /api/state HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
            conn.write_all(request.as_bytes()).ok()?;
            let mut page = String::new();
            conn.read_to_string(&mut page).ok()?;
            let body = page.split_once("\r\n\r\n")?.1;
            let state: serde_json::Value = serde_json::from_str(body).ok()?;
            let job = state["jobs"]
                .as_array()?
                .iter()
                .find(|j| j["job"] == "secure")?
                .clone();
            (job["reports"].as_u64()? > 0).then_some(state)
        }
    })
    .await;
    assert_eq!(state["hosts"].as_array().unwrap().len(), 2, "{state}");
    // The queue buckets are readable too: the allocator's status of the default queue.
    let default = state["queues"]
        .as_array()
        .and_then(|q| q.iter().find(|q| q["name"] == "default"))
        .unwrap_or_else(|| panic!("no default queue in {}", state["queues"]));
    assert!(default["updated_at"].is_number(), "{default}");
    let _ = child.kill();
    let _ = child.wait();
}

/// The allocator's refusals of `kind` from the process's metrics registry.
fn refused_by_allocator(kind: &str) -> f64 {
    let prefix = format!("converge_allocator_refused_messages{{kind=\"{kind}\"}} ");
    converge_bus::metrics::render()
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Thirty progress lines at once (loss falling with the samples), then nothing: the job's
/// fit settles and stays as it is unless another report arrives.
const QUIET_JOB: &str = r#"id = "victim"
command = ["/bin/sh", "-c", 'i=1; while [ $i -le 30 ]; do echo "CONVERGE_PROGRESS {\"step\":$i,\"samples\":$((i*32)),\"loss\":$((1000/(i+1))).5}"; i=$((i+1)); done; exec sleep 600']
min_workers = 1
max_workers = 1
"#;

/// `converge submit spec` as the `cli` user; panics with its stderr if it is refused.
fn submit_as_cli(s: &SecuredNats, spec: &Path) {
    succeeded(&converge_as(s, "cli", &["submit", spec.to_str().unwrap()]));
}

/// `job`'s status once it runs with all thirty reports of [`QUIET_JOB`] in and a curve
/// fitted, and `fit` of it no longer changes over two seconds.
async fn settled_fit<K: PartialEq>(
    cli: &Bus,
    job: &str,
    fit: impl Fn(&converge_common::JobStatus) -> K,
) -> converge_common::JobStatus {
    wait_for(Duration::from_secs(60), "the job's fit settles", || async {
        let a = job_status(cli, job).await?;
        if a.phase != JobPhase::Running || a.samples != 960 || a.curve.is_none() {
            return None;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let b = job_status(cli, job).await?;
        (fit(&a) == fit(&b)).then_some(b)
    })
    .await
}

/// A rank 0 report of `job` for `generation` from `host`, far ahead of any real one
/// (a billion samples, loss 1e-6).
fn forged_report(job: &str, generation: u64, host: &str) -> converge_common::ProgressReport {
    serde_json::from_value(serde_json::json!({
        "protocol": PROTOCOL_VERSION, "job": job, "generation": generation,
        "rank": 0, "host": host, "step": 1_000_000, "samples": 1_000_000_000u64,
        "loss": 1e-6, "time": converge_bus::unix_now()
    }))
    .unwrap()
}

/// Waits until the allocator has counted `more` refusals of `kind` than `before`.
async fn wait_for_refusals(kind: &str, before: f64, more: f64) {
    wait_for(Duration::from_secs(10), "the refusals counted", || async {
        (refused_by_allocator(kind) >= before + more).then_some(())
    })
    .await;
}

/// The progress stream, read as the allocator (the cli user may follow the stream, not
/// get messages).
async fn progress_stream(s: &SecuredNats) -> async_nats::jetstream::stream::Stream {
    let alloc = s.bus_as("allocator", Setup::CreateOrUpdate).await.unwrap();
    alloc
        .js
        .get_stream(subjects::PROGRESS_STREAM)
        .await
        .unwrap()
}

/// Waits until the last message on `subject` of `stream` passes `gone` (`None`: the
/// subject holds none; `Some`: the payload of the last one).
async fn wait_for_forged_deleted(
    stream: &async_nats::jetstream::stream::Stream,
    subject: &str,
    gone: impl Fn(Option<String>) -> bool,
) {
    wait_for(
        Duration::from_secs(10),
        "the forged reports deleted from the stream",
        || async {
            use async_nats::jetstream::stream::LastRawMessageErrorKind;
            let last = match stream.get_last_raw_message_by_subject(subject).await {
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => None,
                Err(e) => panic!("reading the stream: {e}"),
                Ok(last) => Some(String::from_utf8_lossy(&last.payload).into_owned()),
            };
            gone(last).then_some(())
        },
    )
    .await;
}

/// A two-rank job placed on n1 and n2 (one GPU each): the host of rank 1, compromised,
/// publishes "rank 0" reports of the job's generation on its own subject. The server lets
/// it (its own subject), the allocator refuses them as `wrong_rank` (the generation placed
/// rank 1 there), counts them and deletes them from the stream; the job's fit, made from
/// rank 0's reports, stays as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_of_a_job_cannot_speak_for_rank_0() {
    init_tracing();
    converge_bus::metrics::recorder();
    let s = SecuredNats::start(&["n1", "n2"]);
    let work = tempfile::tempdir().unwrap();
    let allocator = s.start_allocator();
    let cli = s.cli_bus().await;
    let mut agents = Vec::new();
    for host in ["n1", "n2"] {
        agents.push(s.start_agent(host, &work.path().join(host)));
    }
    let spec = work.path().join("pair.toml");
    std::fs::write(
        &spec,
        QUIET_JOB
            .replace("\"victim\"", "\"pair\"")
            .replace("max_workers = 1", "max_workers = 2")
            .replace("min_workers = 1", "min_workers = 2"),
    )
    .unwrap();
    submit_as_cli(&s, &spec);
    let fingerprint = |a: &converge_common::JobStatus| {
        (
            a.generation,
            a.step,
            a.samples,
            a.loss,
            a.first_loss,
            serde_json::to_string(&a.curve).unwrap(),
        )
    };
    let before = settled_fit(&cli, "pair", fingerprint).await;
    let host_of = |rank: u32| {
        before
            .placement
            .iter()
            .find(|p| p.rank == rank)
            .unwrap_or_else(|| panic!("no rank {rank} in {:?}", before.placement))
            .host
            .clone()
    };
    let (rank0_host, rank1_host) = (host_of(0), host_of(1));
    assert_ne!(rank0_host, rank1_host, "{:?}", before.placement);

    let attacker = s
        .bus_as(&format!("agent-{rank1_host}"), Setup::OpenOrCreate)
        .await
        .unwrap();
    let job: converge_common::JobId = "pair".parse().unwrap();
    let subject = subjects::progress(&job, &rank1_host);
    let forged = forged_report("pair", before.generation, rank1_host.as_str());
    let refused_before = refused_by_allocator("wrong_rank");
    for _ in 0..2 {
        attacker
            .publish_acked(subject.clone(), &forged)
            .await
            .expect("an agent may publish on its own subject");
    }
    wait_for_refusals("wrong_rank", refused_before, 2.0).await;
    // Deleted: nothing forged is left on the subject (the agents publish rank 0's lines
    // only, so the subject is empty or holds an honest report).
    let stream = progress_stream(&s).await;
    wait_for_forged_deleted(&stream, &subject, |last| {
        last.is_none_or(|text| !text.contains("1000000000"))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = job_status(&cli, "pair").await.unwrap();
    assert_eq!(fingerprint(&after), fingerprint(&before), "{after:?}");
    assert_eq!(host_of(0), rank0_host);
    assert!(allocator.is_running() && agents.iter().all(Running::is_running));
    for agent in agents {
        agent.stop().await;
    }
    allocator.stop().await;
}

/// A compromised agent (`agent-n1`) against a job placed on n2 only: progress on n2's
/// subject is refused by the server; progress on its own subject for the job is refused by
/// the allocator (counted, deleted from the stream, the job's fit unchanged); a rollup
/// header on its own heartbeat key cannot purge the hosts bucket. The allocator still
/// deletes and purges keys through the stream API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compromised_agent_cannot_forge_progress_or_purge_heartbeats() {
    init_tracing();
    converge_bus::metrics::recorder();
    let s = SecuredNats::start(&["n1", "n2"]);
    let work = tempfile::tempdir().unwrap();
    let allocator = s.start_allocator();
    let cli = s.cli_bus().await;
    let agent2 = s.start_agent("n2", work.path());
    let spec = work.path().join("victim.toml");
    std::fs::write(&spec, QUIET_JOB).unwrap();
    submit_as_cli(&s, &spec);
    // Placed on n2, all thirty reports in, a curve fitted and no longer changing.
    let settled = |a: &converge_common::JobStatus| {
        (
            a.phase,
            a.generation,
            a.step,
            a.samples,
            a.loss,
            a.first_loss,
            serde_json::to_string(&a.curve).unwrap(),
            a.placement.clone(),
        )
    };
    let before = settled_fit(&cli, "victim", settled).await;
    let hosts: Vec<&str> = before.placement.iter().map(|p| p.host.as_str()).collect();
    assert_eq!(hosts, ["n2"]);

    let a1 = s.bus_as("agent-n1", Setup::OpenOrCreate).await.unwrap();
    let forged = |generation: u64, host: &str| forged_report("victim", generation, host);
    let victim: converge_common::JobId = "victim".parse().unwrap();
    let (n1, n2) = (
        "n1".parse::<converge_common::HostId>().unwrap(),
        "n2".parse::<converge_common::HostId>().unwrap(),
    );
    // n2's subject: the server refuses it.
    let own_subject = subjects::progress(&victim, &n1);
    let n2_subject = subjects::progress(&victim, &n2);
    refused(
        "agent-n1 publishes progress on n2's subject",
        &n2_subject,
        a1.publish_acked(n2_subject.clone(), &forged(before.generation, "n2")),
    )
    .await;
    // Its own subject: stored, then refused by the allocator (n1 is not in the placement,
    // and the next generation is not placed yet), counted and deleted from the stream.
    let refused_before = refused_by_allocator("not_placed");
    for generation in [before.generation, before.generation + 1] {
        a1.publish_acked(own_subject.clone(), &forged(generation, "n1"))
            .await
            .expect("an agent may publish on its own subject");
    }
    let stream = progress_stream(&s).await;
    wait_for_forged_deleted(&stream, &own_subject, |last| last.is_none()).await;
    wait_for_refusals("not_placed", refused_before, 2.0).await;
    // A few steps later the job is as it was: same progress, same fit.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = job_status(&cli, "victim").await.unwrap();
    assert_eq!(settled(&after), settled(&before), "{after:?}");

    // The rollup attack: a message on its own heartbeat key with `Nats-Rollup: all` would
    // purge every host's heartbeat; the bucket refuses rollups.
    let (mut t, _) = cli
        .get::<HostTelemetry>(&cli.hosts, "n2")
        .await
        .unwrap()
        .expect("n2's heartbeat");
    t.host = n1.clone();
    for rollup in ["all", "sub"] {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Rollup", rollup);
        let ack = a1
            .js
            .publish_with_headers(
                "$KV.converge-hosts.n1",
                headers,
                converge_common::codec::encode(&t).into(),
            )
            .await
            .expect("published")
            .await;
        let e = ack.expect_err("a rollup was accepted");
        assert!(e.to_string().contains("rollup"), "{rollup}: {e}");
    }
    a1.hosts.purge("n1").await.expect_err("a KV purge rolls up");
    let info = a1.js.get_stream("KV_converge-hosts").await.unwrap();
    assert!(!info.cached_info().config.allow_rollup);
    assert!(
        cli.get::<HostTelemetry>(&cli.hosts, "n2")
            .await
            .unwrap()
            .is_some(),
        "n2's heartbeat survives"
    );
    assert!(
        cli.get::<HostTelemetry>(&cli.hosts, "n1")
            .await
            .unwrap()
            .is_none(),
        "nothing of the attack was stored"
    );

    // The allocator's user still deletes a key (a KV delete marker) and purges one through
    // the stream API; it never needs a rollup.
    let alloc = s.bus_as("allocator", Setup::CreateOrUpdate).await.unwrap();
    alloc
        .put(&alloc.plans, "n9", &plan("n9", "x"))
        .await
        .unwrap();
    alloc.plans.delete("n9").await.expect("KV delete");
    assert!(
        alloc
            .get::<HostPlan>(&alloc.plans, "n9")
            .await
            .unwrap()
            .is_none()
    );
    alloc
        .js
        .get_stream("KV_converge-plans")
        .await
        .unwrap()
        .purge()
        .filter("$KV.converge-plans.n9")
        .await
        .expect("stream purge of one key");

    assert!(allocator.is_running() && agent2.is_running());
    let still = job_status(&cli, "victim").await.unwrap();
    assert_eq!(still.phase, JobPhase::Running, "{still:?}");
    agent2.stop().await;
    allocator.stop().await;
}

/// A cluster of the previous release: the progress stream on `converge.v1.progress.<job>`
/// and KV buckets that allow rollups (async-nats' defaults), where a rollup header purges
/// the hosts bucket. `Bus::open` (the allocator's `CreateOrUpdate`) updates both in place:
/// the stream takes the per-host subjects and keeps its reports, the buckets keep their
/// keys, refuse rollups and take their byte and value bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_stream_and_buckets_are_updated_in_place() {
    use async_nats::jetstream::{kv, stream};
    init_tracing();
    let nats = NatsServer::start();
    let client = converge_bus::connect(&nats.args(), "converge-test")
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client.clone());
    js.create_stream(stream::Config {
        name: subjects::PROGRESS_STREAM.into(),
        subjects: vec!["converge.v1.progress.*".into()],
        max_messages_per_subject: 5_000,
        ..Default::default()
    })
    .await
    .unwrap();
    let hosts = js
        .create_key_value(kv::Config {
            bucket: subjects::BUCKET_HOSTS.into(),
            history: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    let rollup_all = |key: &str| {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Rollup", "all");
        let js = js.clone();
        let subject = format!("$KV.{}.{key}", subjects::BUCKET_HOSTS);
        async move {
            js.publish_with_headers(subject, headers, "x".into())
                .await
                .unwrap()
                .await
        }
    };
    // The hole, before the update: a's rollup purges b.
    hosts.put("a", "1".into()).await.unwrap();
    hosts.put("b", "2".into()).await.unwrap();
    rollup_all("a").await.expect("rollups allowed");
    assert!(hosts.get("b").await.unwrap().is_none(), "b purged");
    hosts.put("b", "2".into()).await.unwrap();
    js.publish("converge.v1.progress.old-job", "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();

    let bus = Bus::open(client).await.expect("updated in place");
    let mut progress = bus.js.get_stream(subjects::PROGRESS_STREAM).await.unwrap();
    let info = progress.info().await.unwrap();
    assert_eq!(info.config.subjects, [subjects::PROGRESS_ALL]);
    assert_eq!(
        info.config.max_messages_per_subject,
        subjects::PROGRESS_MAX_PER_JOB_AND_HOST
    );
    assert_eq!(info.state.messages, 1, "the old report is kept");
    // Bounded: reports of at most 64 KiB, 2 GiB in all (oldest out first). A larger publish
    // is refused by the server and nothing is stored.
    assert_eq!(
        info.config.max_message_size,
        subjects::PROGRESS_MAX_MESSAGE_BYTES
    );
    assert_eq!(info.config.max_bytes, subjects::PROGRESS_MAX_BYTES);
    assert_eq!(info.config.discard, stream::DiscardPolicy::Old);
    let big = vec![b' '; subjects::PROGRESS_MAX_MESSAGE_BYTES as usize + 1];
    let refused = match js.publish("converge.v1.progress.j.h", big.into()).await {
        Ok(ack) => ack.await.is_err(),
        Err(_) => true,
    };
    assert!(refused, "a report over 64 KiB was stored");
    assert_eq!(progress.info().await.unwrap().state.messages, 1);
    let mut kv_stream = bus.js.get_stream("KV_converge-hosts").await.unwrap();
    assert!(!kv_stream.info().await.unwrap().config.allow_rollup);
    // Every bucket, the old one included, is bounded in bytes and value size (before
    // 2026-11-28 none was: 1 MiB values, no byte bound), and a heartbeat over its bound is
    // refused while the host's last one stays.
    for bucket in subjects::ALL_BUCKETS
        .into_iter()
        .chain(subjects::QUEUE_BUCKETS)
    {
        let bounds = subjects::bucket_bounds(bucket);
        let mut stream = bus.js.get_stream(format!("KV_{bucket}")).await.unwrap();
        let config = stream.info().await.unwrap().config.clone();
        assert_eq!(
            (config.max_bytes, config.max_message_size),
            (bounds.max_bytes, bounds.max_value_bytes),
            "{bucket}"
        );
        assert_eq!(config.discard, stream::DiscardPolicy::New, "{bucket}");
    }
    let heartbeat_bound = subjects::bucket_bounds(subjects::BUCKET_HOSTS).max_value_bytes;
    let big = vec![b' '; heartbeat_bound as usize + 1];
    assert!(
        bus.hosts.put("b", big.into()).await.is_err(),
        "a heartbeat over {heartbeat_bound} bytes was stored"
    );
    assert_eq!(
        bus.hosts.get("b").await.unwrap().as_deref(),
        Some(&b"2"[..])
    );
    let e = rollup_all("a").await.expect_err("rollups refused");
    assert!(e.to_string().contains("rollup"), "{e}");
    assert_eq!(
        bus.hosts.get("b").await.unwrap().as_deref(),
        Some(&b"2"[..])
    );
    // New reports go to the per-host subjects only.
    bus.js
        .publish("converge.v1.progress.new-job.h1", "{}".into())
        .await
        .unwrap()
        .await
        .expect("a per-host subject is stored");
    let old = bus
        .js
        .publish("converge.v1.progress.old-job", "{}".into())
        .await;
    assert!(
        match old {
            Ok(ack) => ack.await.is_err(),
            Err(_) => true,
        },
        "the old subject is no longer the stream's"
    );
    // Opening again changes nothing.
    Bus::open(bus.client.clone()).await.expect("idempotent");
}

/// Requests an agent could craft by hand to read another host's plan through the subjects
/// it may publish to: the server answers none of them with that plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crafted_requests_do_not_reveal_another_hosts_plan() {
    init_tracing();
    let s = SecuredNats::start(&["n1", "n2"]);
    let alloc = s.bus_as("allocator", Setup::CreateOrUpdate).await.unwrap();
    alloc
        .put(&alloc.plans, "n1", &plan("n1", "marker-of-n1"))
        .await
        .unwrap();
    let rev2 = alloc
        .put(&alloc.plans, "n2", &plan("n2", "secret-of-n2"))
        .await
        .unwrap();
    let a1 = s.bus_as("agent-n1", Setup::OpenOrCreate).await.unwrap();
    let leaks = |bytes: &[u8]| String::from_utf8_lossy(bytes).contains("secret-of-n2");

    // Direct get on the own key's subject, with a body asking for n2's key or revision.
    let own = "$JS.API.DIRECT.GET.KV_converge-plans.$KV.converge-plans.n1";
    for body in [
        serde_json::json!({"last_by_subj": "$KV.converge-plans.n2"}),
        serde_json::json!({"seq": rev2}),
    ] {
        let reply = tokio::time::timeout(
            Duration::from_secs(5),
            a1.client.request(own, body.to_string().into()),
        )
        .await
        .expect("an answer");
        if let Ok(msg) = reply {
            assert!(
                !leaks(&msg.payload),
                "direct get with {body} leaked n2's plan"
            );
        }
    }

    // Consumer creation on the own key's subject with another filter in the body.
    let deliver = "_INBOX.agent-n1.crafted";
    let mut delivered = a1.client.subscribe(deliver).await.unwrap();
    let create = "$JS.API.CONSUMER.CREATE.KV_converge-plans.crafted.$KV.converge-plans.n1";
    for config in [
        serde_json::json!({"name": "crafted", "filter_subject": "$KV.converge-plans.n2"}),
        serde_json::json!({"name": "crafted", "filter_subject": "$KV.converge-plans.>"}),
        serde_json::json!({"name": "crafted", "filter_subjects": ["$KV.converge-plans.n2"]}),
        serde_json::json!({"name": "crafted", "filter_subjects": ["$KV.converge-plans.n1", "$KV.converge-plans.n2"]}),
    ] {
        let mut config = config;
        config["deliver_subject"] = deliver.into();
        config["ack_policy"] = "none".into();
        config["deliver_policy"] = "all".into();
        let body = serde_json::json!({"stream_name": "KV_converge-plans", "config": config});
        let reply = tokio::time::timeout(
            Duration::from_secs(5),
            a1.client.request(create, body.to_string().into()),
        )
        .await
        .expect("an answer")
        .expect("the JetStream API answers");
        let answer: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
        assert!(
            answer.get("error").is_some(),
            "consumer with {config} was created: {answer}"
        );
    }
    while let Ok(Some(msg)) =
        tokio::time::timeout(Duration::from_millis(500), delivered.next()).await
    {
        assert!(
            !leaks(&msg.payload),
            "a crafted consumer delivered n2's plan"
        );
    }

    // The unfiltered creation subject, and the stream's message API, are refused.
    for subject in [
        "$JS.API.CONSUMER.CREATE.KV_converge-plans",
        "$JS.API.CONSUMER.CREATE.KV_converge-plans.crafted",
        "$JS.API.STREAM.MSG.GET.KV_converge-plans",
        "$JS.API.DIRECT.GET.KV_converge-plans",
    ] {
        let body = serde_json::json!({"last_by_subj": "$KV.converge-plans.n2"});
        let req = a1.client.request(subject, body.to_string().into());
        let denied = a1.denials.guard(|d| d.subject == subject, req).await;
        assert!(denied.is_err(), "{subject} was not refused: {denied:?}");
    }
}

/// No credentials, a wrong password or an unknown user: the server refuses the connection
/// and the client says so at once, without retrying and without printing the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_credentials_cannot_connect() {
    init_tracing();
    let s = SecuredNats::start(&["n1"]);
    let wrong = s.dir.path().join("wrong.password");
    std::fs::write(&wrong, "not-the-password-42\n").unwrap();
    let cases = [
        ("no credentials", s.nats.args()),
        (
            "wrong password",
            NatsArgs {
                password_file: Some(wrong.clone()),
                ..s.args_as("agent-n1")
            },
        ),
        (
            "unknown user",
            NatsArgs {
                user: Some("agent-n9".into()),
                password_file: Some(wrong.clone()),
                ..s.nats.args()
            },
        ),
        (
            "wrong password in the URL",
            NatsArgs {
                url: s
                    .nats
                    .url
                    .replace("nats://", "nats://cli:not-the-password-42@"),
                ..s.nats.args()
            },
        ),
    ];
    for (what, args) in cases {
        let started = Instant::now();
        let e = converge_bus::connect(&args, "converge-test")
            .await
            .expect_err(what);
        assert!(matches!(e, BusError::Refused { .. }), "{what}: {e}");
        let text = e.to_string();
        assert!(text.contains("authorization violation"), "{what}: {text}");
        assert!(!text.contains("not-the-password-42"), "{what}: {text}");
        assert!(
            started.elapsed() < REFUSAL_WITHIN,
            "{what}: took {:?}",
            started.elapsed()
        );
    }

    // The right password in the URL works, and the reply inbox follows the URL's user.
    let pw = std::fs::read_to_string(s.password_file("allocator")).unwrap();
    let args = NatsArgs {
        url: s
            .nats
            .url
            .replace("nats://", &format!("nats://allocator:{}@", pw.trim())),
        ..s.nats.args()
    };
    assert!(!format!("{args:?}").contains(pw.trim()));
    Bus::connect(&args, "converge-test", Setup::CreateOrUpdate)
        .await
        .expect("the allocator's URL credentials");

    // The CLI fails with the reason and without the password.
    let out = Command::new(bin_path("converge"))
        .env("CONVERGE_NATS_URL", &s.nats.url)
        .env("CONVERGE_NATS_USER", "cli")
        .env("CONVERGE_NATS_PASSWORD", "not-the-password-42")
        .env_remove("CONVERGE_NATS_PASSWORD_FILE")
        .args(["jobs"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("refused the connection"), "{stderr}");
    assert!(!stderr.contains("not-the-password-42"), "{stderr}");
    // An unreadable password file is named.
    let out = Command::new(bin_path("converge"))
        .env("CONVERGE_NATS_URL", &s.nats.url)
        .env("CONVERGE_NATS_USER", "cli")
        .env("CONVERGE_NATS_PASSWORD_FILE", s.dir.path().join("nope"))
        .env_remove("CONVERGE_NATS_PASSWORD")
        .args(["jobs"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--nats-password-file") && stderr.contains("nope"),
        "{stderr}"
    );
}

/// Only the allocator creates the buckets and the stream: agents and the CLI open existing
/// ones and say what to do when they are missing. On an open server anyone still creates
/// them, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_allocator_creates_buckets_on_a_secured_server() {
    init_tracing();
    let s = SecuredNats::start(&["n1"]);
    for user in ["agent-n1", "cli"] {
        let started = Instant::now();
        let e = s
            .bus_as(user, Setup::OpenOrCreate)
            .await
            .expect_err("no buckets yet");
        assert!(matches!(e, BusError::Missing { .. }), "{user}: {e}");
        assert!(e.to_string().contains("start the allocator first"), "{e}");
        assert!(started.elapsed() < REFUSAL_WITHIN, "{user}: {e}");
        let e = s
            .bus_as(user, Setup::CreateOrUpdate)
            .await
            .expect_err("not allowed");
        assert!(matches!(e, BusError::Denied { .. }), "{user}: {e}");
    }
    let out = converge_as(&s, "cli", &["jobs"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("start the allocator first"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let alloc = s
        .bus_as("allocator", Setup::CreateOrUpdate)
        .await
        .expect("the allocator creates the buckets");
    for user in ["agent-n1", "cli"] {
        s.bus_as(user, Setup::OpenOrCreate)
            .await
            .unwrap_or_else(|e| panic!("{user} opens the buckets: {e}"));
    }
    // The agent process runs and its heartbeat arrives.
    let work = tempfile::tempdir().unwrap();
    let agent = s.start_agent("n1", work.path());
    wait_for(Duration::from_secs(10), "n1's heartbeat", || async {
        alloc
            .get::<HostTelemetry>(&alloc.hosts, "n1")
            .await
            .ok()
            .flatten()
    })
    .await;
    assert!(agent.is_running());
    agent.stop().await;

    // Open server: an agent alone creates everything, as before security existed.
    let open = NatsServer::start();
    let bus = Bus::connect(&open.args(), "converge-test", Setup::OpenOrCreate)
        .await
        .expect("created on an open server");
    bus.put(&bus.plans, "n1", &plan("n1", "x")).await.unwrap();
    bus.js
        .get_stream(subjects::PROGRESS_STREAM)
        .await
        .expect("progress stream created");
}

/// TLS with a test CA from `deploy/nats/gen-tls.sh`: clients that trust the CA connect,
/// others are refused at once; with client verification a client certificate is needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_test_ca() {
    init_tracing();
    if Command::new("openssl").arg("version").output().is_err() {
        eprintln!("openssl not found: TLS test skipped");
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    let gen_tls = |out: &Path, clients: &str| {
        let out = Command::new(repo_root().join("deploy/nats/gen-tls.sh"))
            .arg("--out")
            .arg(out)
            .args(["--names", "localhost", "--ips", "127.0.0.1"])
            .args(["--clients", clients])
            .output()
            .unwrap();
        succeeded(&out);
    };
    gen_tls(certs.path(), "allocator");
    let other_ca = tempfile::tempdir().unwrap();
    gen_tls(other_ca.path(), "allocator");
    let p = |f: &str| certs.path().join(f).to_str().unwrap().to_string();

    // Server certificate only.
    let s = SecuredNats::start_with(
        &["n1"],
        &[
            "--tls-cert",
            &p("server.pem"),
            "--tls-key",
            &p("server-key.pem"),
        ],
    );
    let trusted = NatsArgs {
        tls_ca: Some(certs.path().join("ca.pem")),
        ..s.args_as("allocator")
    };
    Bus::connect(&trusted, "converge-test", Setup::CreateOrUpdate)
        .await
        .expect("TLS with the test CA");
    for (what, args) in [
        ("no CA", s.args_as("allocator")),
        (
            "another CA",
            NatsArgs {
                tls_ca: Some(other_ca.path().join("ca.pem")),
                ..s.args_as("allocator")
            },
        ),
    ] {
        let started = Instant::now();
        let e = converge_bus::connect(&args, "converge-test")
            .await
            .expect_err(what);
        assert!(matches!(e, BusError::Refused { .. }), "{what}: {e}");
        assert!(started.elapsed() < REFUSAL_WITHIN, "{what}: {e}");
    }
    drop(s);

    // Client certificates required.
    let s = SecuredNats::start_with(
        &["n1"],
        &[
            "--tls-cert",
            &p("server.pem"),
            "--tls-key",
            &p("server-key.pem"),
            "--tls-ca",
            &p("ca.pem"),
            "--tls-verify",
        ],
    );
    let trusted = NatsArgs {
        tls_ca: Some(certs.path().join("ca.pem")),
        ..s.args_as("allocator")
    };
    let with_cert = NatsArgs {
        tls_cert: Some(certs.path().join("clients/allocator.pem")),
        tls_key: Some(certs.path().join("clients/allocator-key.pem")),
        ..trusted.clone()
    };
    Bus::connect(&with_cert, "converge-test", Setup::CreateOrUpdate)
        .await
        .expect("TLS with a client certificate");
    let trusted = NatsArgs {
        connect_timeout: Some(Duration::from_secs(2)),
        ..trusted
    };
    let e = converge_bus::connect(&trusted, "converge-test")
        .await
        .expect_err("no client certificate");
    assert!(
        matches!(e, BusError::Refused { .. } | BusError::Connect { .. }),
        "{e}"
    );
}

/// After the server restarts, every process reconnects with its own user and the agent
/// follows its plan again (its watch is re-created through the subjects it may use).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secured_cluster_recovers_from_a_server_restart() {
    init_tracing();
    let mut s = SecuredNats::start(&["n1"]);
    let work = tempfile::tempdir().unwrap();
    let allocator = s.start_allocator();
    s.cli_bus().await;
    let agent = s.start_agent("n1", work.path());
    let heartbeat = |s: &SecuredNats| {
        let args = s.args_as("cli");
        async move {
            let cli = Bus::connect(&args, "converge-test", Setup::OpenOrCreate)
                .await
                .ok()?;
            let (t, _) = cli.get::<HostTelemetry>(&cli.hosts, "n1").await.ok()??;
            (converge_bus::unix_now() - t.time < 3.0).then_some(())
        }
    };
    wait_for(Duration::from_secs(10), "n1's heartbeat", || heartbeat(&s)).await;

    s.nats.restart();
    wait_for(
        Duration::from_secs(20),
        "n1's heartbeat after the restart",
        || heartbeat(&s),
    )
    .await;
    let spec = write_spec_sized(work.path(), "after-restart", 1);
    submit_as_cli(&s, &spec);
    let cli = s.bus_as("cli", Setup::OpenOrCreate).await.unwrap();
    let done = wait_for_status(&cli, "after-restart", 90, "the job completes", |s| {
        s.phase.is_terminal()
    })
    .await;
    assert_eq!(done.phase, JobPhase::Completed, "{done:?}");
    assert!(allocator.is_running() && agent.is_running());
    agent.stop().await;
    allocator.stop().await;
}

/// A queue status as the allocator writes it (KV `converge-queue-status`).
fn queue_status(queue: &str, in_use: u32) -> converge_common::QueueStatus {
    converge_common::QueueStatus {
        protocol: PROTOCOL_VERSION,
        queue: queue.parse().unwrap(),
        gpus_in_use: in_use,
        borrowed_gpus: 0,
        lent_gpus: 0,
        fair_share_gpus: f64::from(in_use),
        usage_gpu_seconds: 0.0,
        half_life_s: 3600.0,
        running_jobs: 0,
        pending_jobs: 0,
        updated_at: 1.0,
    }
}

/// The queue buckets: the allocator creates them and alone writes queue statuses; the CLI
/// creates, changes, lists and deletes queues (`converge queue`) and reads statuses but
/// cannot write one; an agent has no right on either bucket (opening, reading or writing a
/// queue is a permissions violation); a rollup on the queues bucket is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_are_written_by_the_cli_and_queue_statuses_by_the_allocator_only() {
    init_tracing();
    let s = SecuredNats::start(&["n1"]);
    let alloc = s
        .bus_as("allocator", Setup::CreateOrUpdate)
        .await
        .expect("the allocator creates every bucket");
    let alloc_q = alloc
        .open_queues(Setup::CreateOrUpdate)
        .await
        .expect("the allocator opens the queue buckets");

    // The CLI manages queues through the binary.
    let ok = |out: std::process::Output| {
        succeeded(&out);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    ok(converge_as(
        &s,
        "cli",
        &["queue", "create", "team-a", "--quota", "2"],
    ));
    ok(converge_as(
        &s,
        "cli",
        &["queue", "create", "team-b", "--quota", "1"],
    ));
    ok(converge_as(
        &s,
        "cli",
        &["queue", "set", "team-a", "--weight", "2"],
    ));
    let (spec, _) = alloc
        .get::<converge_common::QueueSpec>(&alloc_q.queues, "team-a")
        .await
        .unwrap()
        .expect("the allocator reads the queue");
    assert_eq!((spec.quota_gpus, spec.weight), (2, 2.0));

    // Only the allocator writes statuses; the CLI reads them.
    alloc
        .put(&alloc_q.status, "team-a", &queue_status("team-a", 2))
        .await
        .expect("the allocator writes a queue status");
    let list = ok(converge_as(&s, "cli", &["--json", "queue", "list"]));
    let rows: serde_json::Value = serde_json::from_str(&list).unwrap();
    let a = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "team-a")
        .expect("team-a listed");
    assert_eq!(a["status"]["gpus_in_use"], 2, "{list}");

    let cli = s.bus_as("cli", Setup::OpenOrCreate).await.unwrap();
    let cli_q = cli
        .open_queues(Setup::OpenOrCreate)
        .await
        .expect("cli opens");
    refused(
        "cli writes a queue status",
        "$KV.converge-queue-status.team-a",
        cli.put(&cli_q.status, "team-a", &queue_status("team-a", 99)),
    )
    .await;
    let (st, _) = cli
        .get::<converge_common::QueueStatus>(&cli_q.status, "team-a")
        .await
        .unwrap()
        .expect("status readable");
    assert_eq!(st.gpus_in_use, 2, "the forged status was not stored");

    // An agent can neither open, read nor write a queue or a queue status.
    let agent = s.bus_as("agent-n1", Setup::OpenOrCreate).await.unwrap();
    let started = Instant::now();
    let e = agent
        .open_queues(Setup::OpenOrCreate)
        .await
        .expect_err("an agent may not open the queue buckets");
    assert!(e.is_denied(), "{e}");
    assert!(started.elapsed() < REFUSAL_WITHIN, "{e}");
    let forged = converge_common::QueueSpec {
        name: "team-a".parse().unwrap(),
        quota_gpus: 1000,
        ..converge_common::QueueSpec::implicit_default()
    };
    for (what, subject) in [
        ("agent writes a queue", "$KV.converge-queues.team-a"),
        ("agent creates a queue", "$KV.converge-queues.team-n1"),
    ] {
        refused(
            what,
            subject,
            agent.publish_acked(subject.to_string(), &forged),
        )
        .await;
    }
    refused(
        "agent writes a queue status",
        "$KV.converge-queue-status.team-a",
        agent.publish_acked(
            "$KV.converge-queue-status.team-a".to_string(),
            &queue_status("team-a", 0),
        ),
    )
    .await;
    let direct_get = "$JS.API.DIRECT.GET.KV_converge-queues.$KV.converge-queues.team-a";
    refused(
        "agent reads a queue",
        direct_get,
        agent.refusable(|| "a read".into(), direct_get, async {
            agent
                .client
                .request(direct_get, bytes::Bytes::new())
                .await
                .map_err(|e| BusError::Config(e.to_string()))
        }),
    )
    .await;
    let (spec, _) = alloc
        .get::<converge_common::QueueSpec>(&alloc_q.queues, "team-a")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(spec.quota_gpus, 2, "the forged queue was not stored");
    assert!(
        alloc
            .get::<converge_common::QueueSpec>(&alloc_q.queues, "team-n1")
            .await
            .unwrap()
            .is_none()
    );

    // The CLI's rollup on a queue it may write does not purge the others.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Rollup", "all");
    let ack = cli
        .js
        .publish_with_headers(
            "$KV.converge-queues.team-a",
            headers,
            converge_common::codec::encode(&spec).into(),
        )
        .await
        .expect("published")
        .await;
    let e = ack.expect_err("a rollup was accepted");
    assert!(e.to_string().contains("rollup"), "{e}");
    assert!(
        cli.get::<converge_common::QueueSpec>(&cli_q.queues, "team-b")
            .await
            .unwrap()
            .is_some(),
        "team-b survives"
    );

    // And deletes through the CLI.
    ok(converge_as(&s, "cli", &["queue", "delete", "team-b"]));
    assert!(
        alloc
            .get::<converge_common::QueueSpec>(&alloc_q.queues, "team-b")
            .await
            .unwrap()
            .is_none()
    );
}

/// An account whose storage cannot hold the streams' reservations: the allocator's start
/// fails with the server's error, the figure Converge needs and what to raise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_little_account_storage_is_refused_with_what_to_raise() {
    init_tracing();
    let s = SecuredNats::start_with(&["n1"], &["--max-store", "1G"]);
    let started = std::time::Instant::now();
    let e = match s.bus_as("allocator", Setup::CreateOrUpdate).await {
        Ok(_) => panic!("the streams were created within 1 GB"),
        Err(e) => e.to_string(),
    };
    println!("refused after {:?}: {e}", started.elapsed());
    let figure = format!(
        "{} MiB per replica",
        subjects::reserved_bytes() / (1024 * 1024)
    );
    assert!(e.contains(&figure) && e.contains("--max-store"), "{e}");
}

/// The account's JetStream limits from `gen-config.sh` hold: the server reports them, and
/// consumers past `--max-consumers` and connections past `--max-connections` are refused
/// (a client opening either without end is stopped there instead of exhausting the
/// server); the streams Converge creates fit within `--max-store` (the allocator opened
/// them all under the limits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_account_has_bounded_storage_and_consumers() {
    use async_nats::jetstream::consumer::pull;
    init_tracing();
    // An account limit far above any test machine's disk: the generated configuration
    // must still start (the server's own store is sized to the limit, not to the disk).
    let s = SecuredNats::start_with(
        &["n1"],
        &[
            "--max-consumers",
            "6",
            "--max-store",
            "1000T",
            "--max-connections",
            "8",
        ],
    );
    let alloc = s
        .bus_as("allocator", Setup::CreateOrUpdate)
        .await
        .expect("the streams fit within the account's limits");
    let account = alloc.js.query_account().await.unwrap();
    assert_eq!(account.limits.max_storage, Some(1_000_000_000_000_000));
    assert_eq!(account.limits.max_memory, Some(256_000_000));
    assert_eq!(account.limits.max_streams, Some(32));
    assert_eq!(account.limits.max_consumers, Some(6));
    assert!(
        account.streams >= 5,
        "the allocator's streams: {}",
        account.streams
    );
    let stream = alloc
        .js
        .get_stream(subjects::PROGRESS_STREAM)
        .await
        .unwrap();
    let mut refused = None;
    for i in 0..10 {
        let created = stream
            .create_consumer(pull::Config {
                durable_name: Some(format!("flood-{i}")),
                ..Default::default()
            })
            .await;
        if let Err(e) = created {
            refused = Some((i, e.to_string()));
            break;
        }
    }
    let (at, e) = refused.expect("consumers past the limit are refused");
    assert!(at <= 6, "refused only at consumer {at}");
    assert!(e.to_lowercase().contains("maximum consumers"), "{e}");

    // Connections past --max-connections are refused by the server (the allocator's bus
    // holds one already): a client opening connections without end stops there.
    let password = std::fs::read_to_string(s.password_file("viewer")).unwrap();
    let mut held = Vec::new();
    let mut refused = None;
    for i in 0..12 {
        let opened = tokio::time::timeout(
            std::time::Duration::from_secs(3),
            async_nats::ConnectOptions::with_user_and_password(
                "viewer".into(),
                password.trim().into(),
            )
            .connect(s.nats.url.as_str()),
        )
        .await;
        match opened {
            Ok(Ok(c)) => {
                // A connection the server refused after accepting it dies at its first
                // round trip.
                match tokio::time::timeout(std::time::Duration::from_secs(2), c.flush()).await {
                    Ok(Ok(())) => held.push(c),
                    other => {
                        refused = Some((i, format!("{other:?}")));
                        break;
                    }
                }
            }
            other => {
                refused = Some((i, format!("{other:?}")));
                break;
            }
        }
    }
    let (at, e) = refused.expect("connections past the limit are refused");
    assert!(at <= 8, "refused only at connection {at}");
    println!("connection {at} refused: {e}");
    drop(held);
}

//! Node labels and selectors end to end: two agents with different custom labels, a job
//! that selects one of them, `converge submit` refusing a selector no host satisfies,
//! `converge jobs` showing why a job waits and `converge hosts` the labels; two agents with
//! fake GPUs of different types and speeds, jobs restricted to one type by `gpu_types`.

use converge_common::{HostTelemetry, JobPhase, JobSpec, WorkerPhase};
use converge_tests::*;
use std::process::Command;
use std::time::Duration;

/// The first telemetry `host` reports (20 s at most).
async fn reported(bus: &converge_bus::Bus, host: &str) -> HostTelemetry {
    wait_for(Duration::from_secs(20), "the host's telemetry", || {
        telemetry(bus, host)
    })
    .await
}

/// A trainer job's spec with a `[selector]` table of `selector` (TOML lines).
fn with_selector(job: &TrainerJob, selector: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join(format!("{}.toml", job.id));
    std::fs::write(&path, format!("{}[selector]\n{selector}\n", job.toml())).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_only_on_hosts_its_selector_matches() {
    let (nats, work, bus) = start_test().await;
    let mut a = agent_config(&nats, "n1", 2, work.path());
    a.labels = vec!["zone=a".into(), "rack=r1".into()];
    let mut b = agent_config(&nats, "n2", 2, work.path());
    b.labels = vec!["zone=b,rack=r1".into()];
    let agents = [start_agent(a), start_agent(b)];
    let allocator = start_allocator(allocator_config(&nats, Duration::ZERO));

    // Both hosts report their labels, GPU labels included.
    for (host, zone) in [("n1", "a"), ("n2", "b")] {
        let t = reported(&bus, host).await;
        assert_eq!(t.labels["zone"], zone, "{t:?}");
        assert_eq!(t.labels["rack"], "r1");
        assert_eq!(t.labels["gpu.count"], "2");
        assert_eq!(t.labels["gpu.memory"], "16");
        assert_eq!(t.labels["gpu.model"], "Converge-fake-GPU");
    }
    let out = converge(&nats, &["hosts"]);
    let table = succeeded(&out);
    assert!(table.contains("LABELS"), "{table}");
    assert!(table.contains("rack=r1,zone=a"), "{table}");
    assert!(table.contains("rack=r1,zone=b"), "{table}");

    // Four workers asked for, only zone b's two GPUs may be used: two workers, both on n2.
    let job = TrainerJob::new("picky", 1000).workers(1, 4);
    let spec = with_selector(&job, "zone = \"b\"", work.path());
    nats.submit(&spec);
    let s = wait_for_status(&bus, "picky", 30, "picky running", |s| {
        s.phase == JobPhase::Running && s.world_size >= 1
    })
    .await;
    assert!(
        s.placement.iter().all(|p| p.host.as_str() == "n2"),
        "{:?}",
        s.placement
    );
    assert!(s.world_size <= 2, "{s:?}");
    wait_for(
        Duration::from_secs(30),
        "picky's workers running on n2 and none on n1",
        || async {
            let (n2, _) = bus.get::<HostTelemetry>(&bus.hosts, "n2").await.ok()??;
            let (n1, _) = bus.get::<HostTelemetry>(&bus.hosts, "n1").await.ok()??;
            let running = n2
                .workers
                .iter()
                .filter(|w| w.job.as_str() == "picky" && w.phase == WorkerPhase::Running)
                .count();
            let elsewhere = n1.workers.iter().any(|w| w.job.as_str() == "picky");
            assert!(!elsewhere, "a picky worker on n1: {:?}", n1.workers);
            (running == s.world_size as usize).then_some(())
        },
    )
    .await;
    // A job without a selector may use the other host.
    let free = TrainerJob::new("free", 1000).write(work.path());
    nats.submit(&free);
    let f = wait_for_phase(&bus, "free", JobPhase::Running, 30).await;
    assert_eq!(f.placement[0].host.as_str(), "n1", "{f:?}");
    let again = job_status(&bus, "picky").await.unwrap();
    assert!(again.placement.iter().all(|p| p.host.as_str() == "n2"));

    // A selector no known host satisfies is refused at submit, with the labels hosts have.
    let nowhere = with_selector(
        &TrainerJob::new("nowhere", 10),
        "zone = \"c\"\n\"gpu.count\" = \"2\"",
        work.path(),
    );
    let out = converge(&nats, &["submit", nowhere.to_str().unwrap()]);
    assert!(!out.status.success(), "submit should be refused");
    let err = text(&out.stderr);
    assert!(
        err.contains(
            "job spec nowhere refused: `[selector]` gpu.count=2,zone=c matches none of the 2 known hosts"
        ),
        "{err}"
    );
    assert!(err.contains("zone=a (1 host), zone=b (1 host)"), "{err}");
    assert!(err.contains("n1: gpu.count=2,"), "{err}");
    assert!(
        job_status(&bus, "nowhere").await.is_none()
            && bus
                .get::<JobSpec>(&bus.jobs, "nowhere")
                .await
                .unwrap()
                .is_none(),
        "a refused spec is not written"
    );

    // Written past the CLI (or before its hosts left), such a job waits with the reason.
    let waiting = TrainerJob::new("waiting", 10).toml();
    create_job(&bus, &format!("{waiting}[selector]\nzone = \"c\"\n")).await;
    let s = wait_for_status(&bus, "waiting", 30, "waiting job's reason", |s| {
        s.message.is_some()
    })
    .await;
    assert_eq!(s.phase, JobPhase::Pending);
    assert_eq!(
        s.message.as_deref(),
        Some("no live host matches selector zone=c")
    );
    let out = converge(&nats, &["jobs"]);
    let table = succeeded(&out);
    assert!(
        table.contains("pending: no live host matches selector zone=c"),
        "{table}"
    );

    for a in agents {
        a.stop().await;
    }
    allocator.stop().await;
}

/// A trainer job's spec restricted to `types`.
fn with_gpu_types(job: &TrainerJob, types: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join(format!("{}.toml", job.id));
    let toml = job.toml();
    // `gpu_types` is a top-level key: before the first table of the spec.
    let (head, tables) = toml.split_at(toml.find("\n[").map_or(toml.len(), |i| i + 1));
    std::fs::write(&path, format!("{head}gpu_types = {types}\n{tables}")).unwrap();
    path
}

/// An agent for `host` with `gpus` fake GPUs of type `kind`, at `speed` times the nominal
/// speed (`None`: the agent's default).
fn typed_agent(
    nats: &NatsServer,
    host: &str,
    gpus: u32,
    dir: &std::path::Path,
    kind: &str,
    speed: Option<f64>,
) -> converge_agent::AgentConfig {
    let mut cfg = agent_config(nats, host, gpus, dir);
    cfg.fake_gpu_type = Some(kind.into());
    cfg.fake_gpu_speed = speed;
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_run_on_their_gpu_types_and_a_slower_type_trains_slower() {
    let (nats, work, bus) = start_test().await;
    let slow = typed_agent(&nats, "t4-1", 2, work.path(), "t4", Some(0.25));
    let fast = typed_agent(&nats, "a100-1", 2, work.path(), "a100", None);
    let agents = [start_agent(slow), start_agent(fast)];
    let allocator = start_allocator(allocator_config(&nats, Duration::ZERO));

    for (host, kind) in [("t4-1", "t4"), ("a100-1", "a100")] {
        let t = reported(&bus, host).await;
        assert_eq!(t.labels["gpu.type"], kind, "{t:?}");
        assert_eq!(t.labels["gpu.model"], format!("Converge-fake-GPU-{kind}"));
    }
    let out = converge(&nats, &["hosts"]);
    let table = succeeded(&out);
    assert!(table.contains("GPU TYPE"), "{table}");
    assert!(table.contains("GPUs by type: a100 2, t4 2"), "{table}");

    // The same job on each type (20 ms of accelerator time per step on an A100, four times
    // that on the T4 at speed 0.25), and one for a type nobody has.
    let mut on_a100 = TrainerJob::new("on-a100", 1000);
    on_a100.step_delay_ms = 20;
    let mut on_t4 = TrainerJob::new("on-t4", 1000);
    on_t4.step_delay_ms = 20;
    for (job, types) in [(&on_a100, "[\"a100\", \"h100\"]"), (&on_t4, "[\"t4\"]")] {
        let spec = with_gpu_types(job, types, work.path());
        nats.submit(&spec);
    }
    let newest = with_gpu_types(&TrainerJob::new("on-h100", 10), "[\"h100\"]", work.path());
    nats.submit(&newest);

    let mut rates = Vec::new();
    for (id, host) in [("on-a100", "a100-1"), ("on-t4", "t4-1")] {
        let s = wait_for_status(&bus, id, 60, "a measured throughput", |s| {
            s.phase == JobPhase::Running && s.step >= 30 && s.samples_per_s.is_some()
        })
        .await;
        assert!(
            s.placement.iter().all(|p| p.host.as_str() == host),
            "{id}: {:?}",
            s.placement
        );
        rates.push(s.samples_per_s.unwrap());
    }
    eprintln!("samples/s on the A100 and the T4 (speed 0.25): {rates:?}");
    // A quarter of the speed: well under half the throughput, whatever the compute adds.
    assert!(
        rates[1] < 0.5 * rates[0],
        "samples/s on the A100 and the T4: {rates:?}"
    );
    // The allocator measures each job's speed on its type (the cluster mixes two), and
    // projects none: no job has run on both.
    for (id, kind) in [("on-a100", "a100"), ("on-t4", "t4")] {
        let s = wait_for_status(&bus, id, 30, "a speed per GPU type", |s| {
            !s.gpu_type_speeds.is_empty()
        })
        .await;
        let speeds = &s.gpu_type_speeds;
        assert_eq!(
            speeds.keys().collect::<Vec<_>>(),
            [kind],
            "{id}: {speeds:?}"
        );
        assert!(
            speeds[kind].measured && speeds[kind].samples_per_s > 0.0,
            "{id}: {speeds:?}"
        );
    }

    let s = wait_for_status(&bus, "on-h100", 30, "the h100 job's reason", |s| {
        s.message.is_some()
    })
    .await;
    assert_eq!((s.phase, s.world_size), (JobPhase::Pending, 0));
    assert_eq!(
        s.message.as_deref(),
        Some("no live host offers GPU type h100 (live hosts' types: a100, t4)")
    );
    let out = converge(&nats, &["jobs"]);
    let table = text(&out.stdout);
    assert!(
        table.contains("no live host offers GPU type h100"),
        "{table}"
    );

    // Refused at submit: an empty list, a type twice.
    for (types, want) in [
        ("[]", "the list is empty"),
        ("[\"t4\", \"t4\"]", "listed twice"),
    ] {
        let spec = with_gpu_types(&TrainerJob::new("bad-types", 10), types, work.path());
        let out = converge(&nats, &["submit", spec.to_str().unwrap()]);
        assert!(!out.status.success(), "{types}: accepted");
        assert!(
            text(&out.stderr).contains(want),
            "{types}: {}",
            text(&out.stderr)
        );
    }

    for a in agents {
        a.stop().await;
    }
    allocator.stop().await;
}

/// A job running on T4s (fake, a quarter of the speed) moves to an A100 host when one joins:
/// no job has run on both types, so the allocator projects its A100 speed from the hosts'
/// nominal speeds (`gpu.speed`), and the move pays for its restart. After it, the job trains
/// faster and its A100 speed is measured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_moves_to_a_faster_gpu_type_when_one_joins() {
    let (nats, work, bus) = start_test().await;
    let t4 = start_agent(typed_agent(&nats, "t4-1", 1, work.path(), "t4", Some(0.25)));
    // A restart costs something, so that a move needs a reason: without a known speed on
    // the A100 the job would stay where it runs.
    let allocator = start_allocator(allocator_config(&nats, Duration::from_secs(3)));
    assert_eq!(reported(&bus, "t4-1").await.labels["gpu.speed"], "0.25");

    let mut job = TrainerJob::new("mover", 1000);
    job.step_delay_ms = 20;
    nats.submit(&job.write(work.path()));
    let on_t4 = wait_for_status(&bus, "mover", 60, "the job running on the T4", |s| {
        s.phase == JobPhase::Running && s.step >= 30 && s.samples_per_s.is_some()
    })
    .await;
    assert!(
        on_t4.placement.iter().all(|p| p.host.as_str() == "t4-1"),
        "{:?}",
        on_t4.placement
    );

    let fast = typed_agent(&nats, "a100-1", 1, work.path(), "a100", Some(1.0));
    let a100 = start_agent(fast);
    let moved = wait_for(Duration::from_secs(90), "the job on the A100", || async {
        let s = job_status(&bus, "mover").await?;
        (s.phase == JobPhase::Running
            && s.generation > on_t4.generation
            && s.placement.iter().all(|p| p.host.as_str() == "a100-1")
            && s.samples_per_s.is_some())
        .then_some(s)
    })
    .await;
    // The T4 speed stays measured; the A100's was projected (4× from the nominal speeds)
    // until the job measured it there.
    let measured = wait_for(
        Duration::from_secs(60),
        "its A100 speed measured",
        || async {
            let s = job_status(&bus, "mover").await?;
            let speeds = &s.gpu_type_speeds;
            (s.generation == moved.generation
                && speeds.get("a100").is_some_and(|v| v.measured)
                && speeds.get("t4").is_some_and(|v| v.measured))
            .then_some(s)
        },
    )
    .await;
    let (t4_speed, a100_speed) = (
        measured.gpu_type_speeds["t4"].samples_per_s,
        measured.gpu_type_speeds["a100"].samples_per_s,
    );
    eprintln!(
        "samples/s on the T4 {:?}, then on the A100 {:?}; speed per GPU t4 {t4_speed:.1}, a100 {a100_speed:.1}",
        on_t4.samples_per_s, moved.samples_per_s
    );
    assert!(
        a100_speed > 2.0 * t4_speed,
        "t4 {t4_speed}, a100 {a100_speed}"
    );

    t4.stop().await;
    a100.stop().await;
    allocator.stop().await;
}

#[test]
fn the_agent_refuses_malformed_or_reserved_labels_at_start() {
    for (label, expect) in [
        ("gpu.model=fast", "label gpu.model is reserved"),
        ("zone", "not of the form key=value"),
        ("zone=a b", "value \"a b\" is not valid"),
    ] {
        let out = Command::new(bin_path("converge-agent"))
            .args(["--fake-gpus", "1", "--label", label])
            .env("CONVERGE_NATS_URL", "nats://127.0.0.1:1")
            .output()
            .expect("run converge-agent");
        assert!(!out.status.success(), "{label}: started");
        let err = text(&out.stderr);
        assert!(err.contains(expect), "{label}: {err}");
    }
    let out = Command::new(bin_path("converge-agent"))
        .args(["--fake-gpus", "1"])
        .env("CONVERGE_AGENT_LABELS", "zone=a,gpu.count=9")
        .env("CONVERGE_NATS_URL", "nats://127.0.0.1:1")
        .output()
        .expect("run converge-agent");
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("reserved"),
        "{}",
        text(&out.stderr)
    );
}

//! Hostile input on every subject and bucket, against a real nats-server with an agent and
//! the allocator running: malformed JSON, wrong protocol versions, invalid content, ids
//! that are not valid ids, specs that `converge submit` refuses (NUL bytes, restart limits,
//! control characters in labels), queues with invalid quotas or weights, reports on another job's
//! subject and oversized payloads. Each is refused or counted; no process stops; a real job
//! submitted afterwards trains and completes; the agent's running workers are untouched.
//! (Credentials and permissions: `security.rs`.)

use bytes::Bytes;
use converge_common::{HostTelemetry, JobPhase, subjects};
use converge_tests::*;
use std::process::Command;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_messages_are_refused_and_nothing_is_lost() {
    init_tracing();
    converge_bus::metrics::recorder();
    let (nats, work, bus) = start_test().await;
    let agent = start_agent(agent_config(&nats, "n1", 2, work.path()));
    let allocator = start_allocator(allocator_config(&nats, Duration::from_secs(30)));

    // A long job runs first: its worker must survive everything below.
    let long = work.path().join("long.toml");
    std::fs::write(&long, fast_job("long", 100_000)).unwrap();
    let submit = |path: &std::path::Path| {
        Command::new(bin_path("converge"))
            .args(["--nats-url", &nats.url, "submit", path.to_str().unwrap()])
            .output()
            .unwrap()
    };
    assert!(submit(&long).status.success());
    let pid_of = |t: HostTelemetry, job: &str| {
        t.workers
            .iter()
            .find(|w| w.job.as_str() == job)
            .and_then(|w| w.pid)
    };
    let pid = wait_for(Duration::from_secs(30), "long job's worker", || async {
        let (t, _) = bus.get::<HostTelemetry>(&bus.hosts, "n1").await.ok()??;
        pid_of(t, "long")
    })
    .await;
    let refused_before = metric_sum("converge_allocator_refused_messages{");

    let json = |v: serde_json::Value| Bytes::from(serde_json::to_vec(&v).unwrap());
    let garbage = Bytes::from_static(b"{\"protocol\":1, this is not json");
    let wrong_version = json(serde_json::json!({"protocol": 99, "id": "x", "command": ["x"]}));
    let big = Bytes::from(vec![b'x'; 2 << 20]);

    // Job specs (KV converge-jobs), read by the allocator.
    bus.jobs.put("bad-json", garbage.clone()).await.unwrap();
    bus.jobs
        .put("bad-version", wrong_version.clone())
        .await
        .unwrap();
    bus.jobs
        .put(
            "bad-content",
            json(serde_json::json!({"protocol": 1, "id": "bad-content", "command": [], "min_workers": 0})),
        )
        .await
        .unwrap();
    bus.jobs
        .put(
            "other-id",
            json(serde_json::json!({"protocol": 1, "id": "not-the-key", "command": ["x"]})),
        )
        .await
        .unwrap();
    // What `converge submit` refuses, written past it: a NUL byte in the command, a restart
    // limit without bound, a label that would reach terminals as an escape sequence.
    // Each as JSON (the bucket) and as the TOML a user would submit.
    let refused_specs = [
        (
            "nul-command",
            serde_json::json!({"protocol": 1, "id": "nul-command", "command": ["python3", "-c\u{0}rm"]}),
            "command = [\"python3\", \"-c\\u0000rm\"]\n",
            "NUL byte",
        ),
        (
            "endless-restarts",
            serde_json::json!({"protocol": 1, "id": "endless-restarts", "command": ["x"], "max_restarts": 4_294_967_295_u64}),
            "command = [\"x\"]\nmax_restarts = 4294967295\n",
            "max_restarts",
        ),
        (
            "escape-label",
            serde_json::json!({"protocol": 1, "id": "escape-label", "command": ["x"], "labels": {"model": "\u{1b}[2J"}}),
            "command = [\"x\"]\n[labels]\nmodel = \"\\u001b[2J\"\n",
            "control character",
        ),
    ];
    for (key, spec, _, _) in &refused_specs {
        bus.jobs.put(*key, json(spec.clone())).await.unwrap();
    }
    bus.jobs.put("a.b", garbage.clone()).await.unwrap();
    assert!(
        bus.jobs.put("huge", big.clone()).await.is_err(),
        "oversized spec accepted"
    );

    // Heartbeats (KV converge-hosts and the telemetry subject).
    bus.hosts.put("n7", garbage.clone()).await.unwrap();
    bus.hosts.put("n8", wrong_version.clone()).await.unwrap();
    bus.hosts
        .put("n9", json(serde_json::json!({"protocol": 1, "host": "n9"})))
        .await
        .unwrap();
    bus.client
        .publish(subjects::telemetry(&"n1".parse().unwrap()), garbage.clone())
        .await
        .unwrap();

    // Progress (JetStream), read by the allocator.
    let progress = |job: &str| subjects::progress(&job.parse().unwrap(), &"n1".parse().unwrap());
    let mut undecodable = Vec::new();
    for payload in [garbage.clone(), wrong_version.clone()] {
        let ack = bus
            .js
            .publish(progress("long"), payload)
            .await
            .unwrap()
            .await
            .unwrap();
        undecodable.push(ack.sequence);
    }
    // A valid report on another job's subject.
    let foreign = serde_json::json!({"protocol": 1, "job": "long", "generation": 1, "rank": 0,
        "host": "n1", "step": 1, "samples": 10, "loss": 0.5, "time": 1.0});
    bus.js
        .publish(progress("someone-else"), json(foreign))
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(
        match bus.js.publish(progress("long"), big.clone()).await {
            Ok(ack) => ack.await.is_err(),
            Err(_) => true,
        },
        "oversized report accepted"
    );

    // Plans (KV converge-plans): a garbage plan for a host that has none, and a wrong-version
    // plan for a host that does not exist; the agent of n1 keeps its last valid plan.
    bus.plans.put("n5", garbage.clone()).await.unwrap();
    bus.plans.put("n6", wrong_version.clone()).await.unwrap();
    // Statuses (KV converge-job-status), read by the CLI and the allocator on restart.
    bus.status.put("ghost", garbage.clone()).await.unwrap();
    // Queues (KV converge-queues, written by the CLI; converge-queue-status, by the
    // allocator): undecodable, wrong version, a negative quota, a zero weight, a name that is
    // not its key, and a garbage status. None becomes a queue.
    let queue_buckets = bus
        .open_queues(converge_bus::Setup::OpenOrCreate)
        .await
        .unwrap();
    let queue = |name: &str, quota: i64, weight: f64| {
        json(
            serde_json::json!({"protocol": 1, "name": name, "quota_gpus": quota, "weight": weight}),
        )
    };
    for (key, value) in [
        ("q-json", garbage.clone()),
        ("q-version", wrong_version.clone()),
        ("q-negative", queue("q-negative", -1, 1.0)),
        ("q-weightless", queue("q-weightless", 1, 0.0)),
        ("q-other", queue("not-the-key", 1, 1.0)),
    ] {
        queue_buckets.queues.put(key, value).await.unwrap();
    }
    queue_buckets
        .status
        .put("q-ghost", garbage.clone())
        .await
        .unwrap();
    // Events: anyone may publish junk; `converge watch` refuses it.
    bus.client
        .publish("converge.v1.events.job.long".to_string(), garbage.clone())
        .await
        .unwrap();

    // The allocator counted what reached it: 6 specs (json, version, content, NUL, restarts,
    // label; the foreign
    // id and the invalid key are refused by id checks, not counted), 3 heartbeats, 3 reports
    // (2 undecodable, one on another job's subject), 1 status (its status watch), 4 queue
    // specs (json, version, quota, weight; the name that is not its key is not counted) and
    // 1 queue status.
    wait_for(Duration::from_secs(10), "refusals counted", || async {
        let counted = metric_sum("converge_allocator_refused_messages{") - refused_before;
        (counted >= 18.0).then_some(())
    })
    .await;
    // The leader deletes undecodable progress messages from the stream, as it deletes
    // refused reports: a flood of garbage is neither kept nor replayed after a restart.
    let stream = bus.js.get_stream(subjects::PROGRESS_STREAM).await.unwrap();
    wait_for(
        Duration::from_secs(10),
        "undecodable reports deleted",
        || async {
            let mut gone = true;
            for &seq in &undecodable {
                gone &= stream.get_raw_message(seq).await.is_err();
            }
            gone.then_some(())
        },
    )
    .await;
    let bad = job_status(&bus, "bad-content").await;
    assert!(
        bad.as_ref().is_some_and(|s| s.phase == JobPhase::Failed
            && s.message.as_deref().unwrap_or("").contains("refused")),
        "{bad:?}"
    );
    // Each spec `converge submit` would refuse fails with the reason when written past it,
    // and `converge submit` refuses it with the same reason before anything is written.
    for (key, _, toml, reason) in &refused_specs {
        let status = wait_for(Duration::from_secs(10), "refused spec's status", || async {
            job_status(&bus, key).await
        })
        .await;
        let message = status.message.as_deref().unwrap_or("");
        assert!(
            status.phase == JobPhase::Failed
                && message.contains("refused")
                && message.contains(reason),
            "{key}: {status:?}"
        );
        let path = work.path().join(format!("{key}.toml"));
        std::fs::write(&path, format!("id = \"{key}-submitted\"\n{toml}")).unwrap();
        let out = submit(&path);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(reason),
            "{key}: converge submit: {}\n{stderr}",
            out.status
        );
        assert!(
            bus.jobs
                .get(format!("{key}-submitted"))
                .await
                .unwrap()
                .is_none(),
            "{key}: a refused spec reached the bucket"
        );
    }

    // Nothing stopped, nothing lost: the long job's worker is the same process, the CLI
    // lists the jobs, and a new job trains to completion.
    assert!(agent.is_running() && allocator.is_running());
    let (t, _) = bus
        .get::<HostTelemetry>(&bus.hosts, "n1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(pid_of(t, "long"), Some(pid));
    assert!(pid_alive(pid));
    let listed = Command::new(bin_path("converge"))
        .args(["--nats-url", &nats.url, "jobs"])
        .output()
        .unwrap();
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    assert!(String::from_utf8_lossy(&listed.stdout).contains("long"));
    // The CLI lists the queues past the hostile entries, and shows none of them.
    let queues = Command::new(bin_path("converge"))
        .args(["--nats-url", &nats.url, "queue", "list"])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&queues.stdout);
    assert!(
        queues.status.success(),
        "{}",
        String::from_utf8_lossy(&queues.stderr)
    );
    for hostile in [
        "q-json",
        "q-version",
        "q-negative",
        "q-weightless",
        "q-other",
    ] {
        assert!(!listed.contains(hostile), "{hostile} listed:\n{listed}");
    }
    // A job for the entry whose name is not its key is refused at submit: the allocator
    // would never run it.
    let stray = work.path().join("stray.toml");
    std::fs::write(
        &stray,
        format!("queue = \"q-other\"\n{}", fast_job("stray", 3)),
    )
    .unwrap();
    let refused = submit(&stray);
    assert!(
        !refused.status.success()
            && String::from_utf8_lossy(&refused.stderr)
                .contains("queue \"q-other\" does not exist"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let short = work.path().join("short.toml");
    std::fs::write(&short, fast_job("short", 3)).unwrap();
    assert!(submit(&short).status.success());
    wait_for_phase(&bus, "short", JobPhase::Completed, 60).await;
    assert!(agent.is_running() && allocator.is_running());
    allocator.stop().await;
    agent.stop().await;
}

/// Text an agent controls (its heartbeat's address, version, GPU and NIC names; the
/// message of an event it publishes) reaches `converge hosts` and `converge watch` with
/// its control characters escaped: a hostile agent cannot clear the operator's screen,
/// move the cursor or retitle the window. (The escaping itself:
/// `cli/src/text.rs`; newlines are kept, so a message can still span lines.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_supplied_text_reaches_terminals_escaped() {
    use converge_common::{Event, EventKind, JobId};
    init_tracing();
    let (nats, work, bus) = start_test().await;
    let agent = start_agent(agent_config(&nats, "n1", 1, work.path()));
    let (mut t, _) = wait_for(Duration::from_secs(20), "n1's heartbeat", || async {
        bus.get::<HostTelemetry>(&bus.hosts, "n1").await.ok()?
    })
    .await;
    let hostile = "\u{1b}[2J\u{1b}]0;owned\u{7}\r";
    t.host = "n9".parse().unwrap();
    t.addr = format!("10.0.0.9{hostile}");
    t.agent_version = format!("0.1{hostile}");
    t.gpus[0].name = format!("A100{hostile}");
    if let Some(nic) = t.nics.first_mut() {
        nic.name = format!("eth0{hostile}");
    }
    bus.put(&bus.hosts, "n9", &t).await.unwrap();

    // `converge watch`, its output and log in files; the event is published once its log
    // says it subscribed.
    let (out_path, log_path) = (work.path().join("watch.out"), work.path().join("watch.log"));
    let mut watch = std::process::Command::new(bin_path("converge"))
        .args(["--nats-url", &nats.url, "watch"])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let read = |p: &std::path::Path| std::fs::read(p).unwrap_or_default();
    let wait_for_text = |path: &std::path::Path, text: &'static str, what: &'static str| {
        let path = path.to_path_buf();
        wait_for(Duration::from_secs(20), what, move || {
            let found = String::from_utf8_lossy(&read(&path)).contains(text);
            async move { found.then_some(()) }
        })
    };
    wait_for_text(
        &log_path,
        "watching converge.v1.events",
        "converge watch subscribed",
    )
    .await;
    let event = Event::new(
        converge_bus::unix_now(),
        "agent/n9",
        EventKind::JobFinished {
            job: JobId::new("x").unwrap(),
            phase: converge_common::JobPhase::Completed,
        },
        format!("job x finished{hostile}"),
    );
    bus.client
        .publish(
            "converge.v1.events.job.x".to_string(),
            converge_common::encode(&event).into(),
        )
        .await
        .unwrap();
    bus.client.flush().await.unwrap();
    wait_for_text(
        &out_path,
        "job x finished",
        "converge watch printed the event",
    )
    .await;
    let _ = watch.kill();
    let _ = watch.wait();
    let watched = read(&out_path);

    let hosts = Command::new(bin_path("converge"))
        .args(["--nats-url", &nats.url, "hosts"])
        .output()
        .unwrap();
    assert!(
        hosts.status.success(),
        "{}",
        String::from_utf8_lossy(&hosts.stderr)
    );
    for (what, out) in [("hosts", &hosts.stdout), ("watch", &watched)] {
        let text = String::from_utf8_lossy(out);
        assert!(
            !out.iter().any(|&b| b == 0x1b || b == 0x07 || b == b'\r'),
            "converge {what} printed a control character:\n{text:?}"
        );
        assert!(
            text.contains("\\u{1b}[2J"),
            "converge {what}, escaped:\n{text}"
        );
    }
    agent.stop().await;
}

//! Liveness by the heartbeat's arrival, not the agent's clock (docs/security.md): a host whose
//! clock is a minute behind stays live while its heartbeats keep coming, and a host whose
//! clock is an hour ahead is lost once its heartbeats stop, as any other. Real nats-server,
//! real allocator; the two hosts' heartbeats are written to KV `converge-hosts` as their
//! agents would (with the skewed `time`), so no clock needs changing.

use converge_common::{GpuSample, HostTelemetry, JobPhase, codec::encode};
use converge_tests::*;
use std::time::Duration;

/// A heartbeat of `host` with two idle fake GPUs, stamped `time` (UNIX seconds).
fn heartbeat(host: &str, time: f64) -> HostTelemetry {
    let gpu = |i: u32| GpuSample::idle(i, format!("GPU-{host}-{i}"), "Converge fake GPU", 1 << 34);
    HostTelemetry {
        agent_version: "test".into(),
        gpus: vec![gpu(0), gpu(1)],
        labels: [("gpu.count", "2"), ("gpu.type", "fake")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        ..HostTelemetry::new(host.parse().expect("a valid host id"), "127.0.0.1", time)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liveness_follows_the_heartbeats_arrival_not_the_agents_clock() {
    init_tracing();
    let nats = NatsServer::start();
    let bus = nats.bus().await;
    let allocator = start_allocator(allocator_config(&nats, Duration::ZERO));

    // "ahead" (clock an hour fast) sends one heartbeat and dies; "behind" (a minute slow,
    // twelve host timeouts) keeps sending one a second.
    let now = converge_bus::unix_now();
    bus.hosts
        .put("ahead", encode(&heartbeat("ahead", now + 3600.0)).into())
        .await
        .unwrap();
    let beating = {
        let hosts = bus.hosts.clone();
        tokio::spawn(async move {
            for _ in 0..120 {
                let t = heartbeat("behind", converge_bus::unix_now() - 60.0);
                hosts.put("behind", encode(&t).into()).await.unwrap();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    // Past the 5 s host timeout since "ahead"'s only heartbeat.
    tokio::time::sleep(Duration::from_secs(8)).await;

    // First-fit takes hosts in id order: "ahead" first, if it were live.
    let job = TrainerJob::new("placed", 1000).workers(2, 2);
    create_job(&bus, &job.toml()).await;
    let s = wait_for_status(&bus, "placed", 30, "the job placed", |s| {
        s.phase != JobPhase::Pending && !s.placement.is_empty()
    })
    .await;
    let hosts: Vec<&str> = s.placement.iter().map(|p| p.host.as_str()).collect();
    assert_eq!(hosts, ["behind", "behind"], "{s:?}");

    beating.abort();
    allocator.stop().await;
}

//! The start-up replay of the progress stream under a flood (issue: one agent can fill the
//! stream): a restarted allocator reads only the subjects of jobs with a status or a plan.
//! Alone in its test binary: it compares the process's metric counters before and after.

use bytes::Bytes;
use converge_common::{JobPhase, subjects};
use converge_tests::*;
use futures::StreamExt;
use std::process::Command;
use std::time::Duration;

/// A flood of reports for job ids nobody placed, left in the stream while no allocator
/// ran (so no leader deleted them), is not read by a restarted allocator's replay: the
/// replay reads only the subjects of jobs with a status or a plan, so a restart takes as
/// long as the honest history needs. That history is replayed in full, a finished job's
/// too (its status places it nowhere any more, so its reports are taken up to when it
/// ended), while a report forged for it after it ended, and garbage on a placed job's
/// subject, are read and refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_allocator_replays_the_placed_jobs_history_and_skips_a_flood() {
    init_tracing();
    converge_bus::metrics::recorder();
    let (nats, work, bus) = start_test().await;
    let agent = start_agent(agent_config(&nats, "n1", 1, work.path()));
    let allocator = start_allocator(allocator_config(&nats, Duration::ZERO));
    let submit = |id: &str, epochs: u32| {
        let spec = work.path().join(format!("{id}.toml"));
        std::fs::write(&spec, fast_job(id, epochs)).unwrap();
        let submitted = Command::new(bin_path("converge"))
            .args(["--nats-url", &nats.url, "submit", spec.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(submitted.status.success());
    };
    // A job that finishes (its status then places it nowhere), then one that runs.
    submit("done", 2);
    wait_for_phase(&bus, "done", JobPhase::Completed, 60).await;
    let done_reports = metric_sum("converge_allocator_progress_reports_total");
    submit("honest", 100_000);
    wait_for(
        Duration::from_secs(60),
        "the honest job's reports",
        || async {
            (metric_sum("converge_allocator_progress_reports_total") >= done_reports + 20.0)
                .then_some(())
        },
    )
    .await;
    // Both stop: the history no longer grows, and the job's status still places it on n1.
    allocator.stop().await;
    agent.stop().await;
    let status = job_status(&bus, "honest").await.unwrap();
    assert_eq!(status.phase, JobPhase::Running, "{status:?}");

    // The history, as the stream holds it: the finished job's and the running one's.
    let stream = bus.js.get_stream(subjects::PROGRESS_STREAM).await.unwrap();
    let mut history = 0;
    for job in ["done", "honest"] {
        let reports = stream
            .info_with_subjects(subjects::progress_of_job(&job.parse().unwrap()))
            .await
            .unwrap()
            .map(|s| s.map(|(_, n)| n).unwrap_or(0))
            .fold(0usize, |a, n| async move { a + n })
            .await;
        assert!(reports > 0, "no report of {job} in the stream");
        history += reports;
    }

    // A forged report for the finished job, from n1 (a host it ran on), stored after the
    // job ended (past the grace for its workers' last reports) while no leader ran to
    // delete it: the replay must not take it as history.
    let done = job_status(&bus, "done").await.unwrap();
    let ended = done.finished_at.expect("finished_at");
    let wait =
        ended + converge_allocator::reporters::ENDED_GRACE_S + 1.0 - converge_bus::unix_now();
    if wait > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(wait)).await;
    }
    let forged = serde_json::json!({"protocol": 1, "job": "done", "generation": done.generation,
        "rank": 0, "host": "n1", "step": 1_000_000, "samples": 1_000_000_000u64, "loss": 0.001,
        "time": 1.0});
    bus.js
        .publish(
            subjects::progress(&"done".parse().unwrap(), &"n1".parse().unwrap()),
            Bytes::from(serde_json::to_vec(&forged).unwrap()),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    // The flood, while no allocator runs: garbage and well-formed reports for 2,000 job ids
    // nobody placed, then one garbage report on the honest job's own subject, last.
    let n1: converge_common::HostId = "n1".parse().unwrap();
    let mut acks = Vec::new();
    for i in 0..2_000 {
        let job = format!("flood-{i}").parse().unwrap();
        let payload = if i % 2 == 0 {
            Bytes::from_static(b"{\"protocol\":1, garbage")
        } else {
            Bytes::from(
                serde_json::to_vec(
                    &serde_json::json!({"protocol": 1, "job": format!("flood-{i}"),
                    "generation": 1, "rank": 0, "host": "n1", "step": 1, "samples": 10,
                    "loss": 0.5, "time": 1.0}),
                )
                .unwrap(),
            )
        };
        acks.push(
            bus.js
                .publish(subjects::progress(&job, &n1), payload)
                .await
                .unwrap(),
        );
    }
    for ack in acks {
        ack.await.unwrap();
    }
    bus.js
        .publish(
            subjects::progress(&"honest".parse().unwrap(), &n1),
            Bytes::from_static(b"not a report"),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    let (applied_before, refused_before) = (
        metric_sum("converge_allocator_progress_reports_total"),
        metric_sum("converge_allocator_refused_messages{"),
    );
    let allocator = start_allocator(allocator_config(&nats, Duration::ZERO));
    // Every report on the placed jobs' subjects read: the history, the forged report and
    // the garbage on the honest job's subject.
    let read = || {
        (metric_sum("converge_allocator_progress_reports_total") - applied_before)
            + (metric_sum("converge_allocator_refused_messages{") - refused_before)
    };
    wait_for(
        Duration::from_secs(30),
        "the replay reaching its end",
        || async { (read() >= (history + 2) as f64).then_some(()) },
    )
    .await;
    let applied = metric_sum("converge_allocator_progress_reports_total") - applied_before;
    let refused = metric_sum("converge_allocator_refused_messages{") - refused_before;
    assert_eq!(
        applied as usize, history,
        "the history (the finished job's too) is replayed in full, and the forged report is not"
    );
    assert_eq!(
        refused, 2.0,
        "the forged report and the garbage on the placed jobs' subjects are read and refused; \
         the 2,000 flood reports are not read"
    );
    assert!(allocator.is_running());
    allocator.stop().await;
}

//! Sweeps through the real `converge` binary and a real nats-server: a sweep file is refused
//! whole or submitted whole, and `converge jobs --sweep ID` ranks its trials best first
//! (`--json` and the table). The first test writes the trials' statuses itself, as the
//! allocator would, so the ranking it reads back is known exactly; the second runs the
//! trials to their end with an agent, the allocator and `converge-trainer`; the third has the
//! allocator stop a weak trial early (`[sweep] early_stop`).

use converge_common::{JobPhase, JobSpec, JobStatus, codec::encode};
use converge_tests::*;
use std::time::Duration;

/// A 2 × 2 sweep of a program that is never run (the statuses are written by the test).
const SWEEP: &str = r#"
[sweep]
id = "lr-sweep"
[sweep.grid]
lr = [0.01, 0.2]
batch = [16, 64]
[job]
command = ["converge-trainer", "--dataset", "optdigits", "--lr", "{lr}", "--batch-size", "{batch}"]
max_workers = 2
[job.stop]
deadline_s = 600
"#;

/// A status as the allocator writes it.
fn status(job: &str, phase: &str, loss: f64, predicted: f64, end: serde_json::Value) -> JobStatus {
    let placement = if phase == "running" {
        serde_json::json!([{ "rank": 0, "host": "n1", "gpus": [0] },
                           { "rank": 1, "host": "n1", "gpus": [1] }])
    } else {
        serde_json::json!([])
    };
    serde_json::from_value(serde_json::json!({
        "protocol": 1, "job": job, "phase": phase, "generation": 1,
        "world_size": placement.as_array().unwrap().len(), "placement": placement,
        "master_port": null, "step": 100, "samples": 3200, "first_loss": 2.3, "loss": loss,
        "eval_loss": null, "curve": null, "predicted_loss": predicted, "samples_per_s": 500.0,
        "submitted_at": 0.0, "started_at": 1.0, "finished_at": null, "updated_at": 2.0,
        "message": null, "end": end
    }))
    .unwrap()
}

async fn specs(bus: &converge_bus::Bus) -> Vec<JobSpec> {
    bus.load_all::<JobSpec>(&bus.jobs, &Default::default())
        .await
        .unwrap()
        .into_values()
        .map(|(s, _)| s)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_is_submitted_whole_and_its_trials_are_ranked_best_first() {
    let (nats, work, bus) = start_test().await;
    let file = work.path().join("sweep.toml");
    std::fs::write(&file, SWEEP).unwrap();
    let file = file.to_str().unwrap();

    // Too many trials: refused with the count, nothing written.
    let out = converge(&nats, &["submit", "--max-trials", "3", file]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("expands to 4 trials"),
        "{stderr}"
    );
    assert!(specs(&bus).await.is_empty(), "a refused sweep was written");

    let stdout = succeeded(&converge(&nats, &["submit", file]));
    assert!(
        stdout.contains("submitted sweep lr-sweep: 4 trials"),
        "{stdout}"
    );
    assert!(stdout.contains("lr-sweep-3  lr=0.2, batch=16"), "{stdout}");
    let stored = specs(&bus).await;
    assert_eq!(stored.len(), 4);
    assert!(
        stored
            .iter()
            .all(|s| s.sweep.as_ref().map(|s| s.as_str()) == Some("lr-sweep"))
    );

    // The same sweep again: refused before anything is written.
    let out = converge(&nats, &["submit", file]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("job lr-sweep-1 already exists"),
        "{stderr}"
    );
    // Under another id it is a new sweep; its trials are not lr-sweep's.
    let out = succeeded(&converge(
        &nats,
        &["--json", "submit", "--id", "again", file],
    ));
    let again: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(again["sweep"], "again");
    assert_eq!(again["trials"][3]["job"], "again-4");
    assert_eq!(again["trials"][3]["params"]["lr"], "0.2");
    assert_eq!(specs(&bus).await.len(), 8);

    // The allocator's view of lr-sweep: trial 1 converged (its curve predicted 0.21),
    // trial 2 runs (predicted 0.12), trial 3 hit its deadline (predicted 0.35), trial 4
    // is pending with no loss yet.
    let end = |reason: &str, loss: f64, predicted: f64, gpu_hours: f64| {
        serde_json::json!({ "reason": reason, "loss": loss, "predicted_loss": predicted,
                            "gpu_hours": gpu_hours })
    };
    for s in [
        status(
            "lr-sweep-1",
            "completed",
            0.25,
            0.05,
            end("converged", 0.25, 0.21, 0.02),
        ),
        status("lr-sweep-2", "running", 0.30, 0.12, serde_json::Value::Null),
        status(
            "lr-sweep-3",
            "completed",
            0.40,
            0.05,
            end("deadline", 0.40, 0.35, 0.16),
        ),
    ] {
        bus.status
            .put(s.job.as_str(), encode(&s).into())
            .await
            .unwrap();
    }

    let out = succeeded(&converge(&nats, &["jobs", "--sweep", "lr-sweep", "--json"]));
    let ranked: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = ranked.as_array().unwrap();
    let order: Vec<(u64, &str)> = rows
        .iter()
        .map(|r| (r["rank"].as_u64().unwrap(), r["job"].as_str().unwrap()))
        .collect();
    assert_eq!(
        order,
        [
            (1, "lr-sweep-2"),
            (2, "lr-sweep-1"),
            (3, "lr-sweep-3"),
            (4, "lr-sweep-4")
        ]
    );
    assert_eq!(rows[0]["predicted_loss"], 0.12);
    assert_eq!(rows[0]["state"], "running");
    assert_eq!(rows[1]["end_reason"], "converged");
    assert_eq!(rows[1]["state"], "completed (converged)");
    assert_eq!(rows[1]["predicted_loss"], 0.21);
    assert_eq!(rows[1]["gpu_hours"], 0.02);
    assert_eq!(rows[1]["params"]["lr"], "0.01");
    assert_eq!(rows[1]["params"]["batch"], "16");
    assert_eq!(rows[2]["state"], "completed (deadline)");
    assert_eq!(rows[3]["state"], "submitted");

    let out = succeeded(&converge(&nats, &["jobs", "--sweep", "lr-sweep"]));
    // The title says what ranks the trials (these statuses carry no held-out loss).
    let (title, table) = out.split_once('\n').unwrap();
    assert!(
        title.contains(
            "ranked by predicted training loss: trial lr-sweep-1 reports no held-out loss"
        ),
        "{title}"
    );
    let pos = |s: &str| table.find(s).unwrap_or_else(|| panic!("{s}: {table}"));
    assert!(pos("lr-sweep-2") < pos("lr-sweep-1") && pos("lr-sweep-1") < pos("lr-sweep-3"));
    assert!(table.contains("completed (converged)"), "{table}");
    assert!(!table.contains("again"), "{table}");
    // Finished jobs show how they ended in the plain listing too.
    let all = succeeded(&converge(&nats, &["jobs", "--all"]));
    assert!(all.contains("completed (deadline)"), "{all}");

    let out = converge(&nats, &["jobs", "--sweep", "nope"]);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("no sweep nope")
    );
}

/// Two trials run to their end through the allocator: each completes with how it ended,
/// its GPU-hours and its losses, and the ranking lists both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_trials_run_to_their_end_and_are_ranked() {
    let (nats, work, bus) = start_test().await;
    let _agent = start_agent(agent_config(&nats, "n1", 2, work.path()));
    let _allocator = start_allocator(allocator_config(&nats, Duration::ZERO));
    let sweep = format!(
        r#"
[sweep]
id = "run"
[sweep.grid]
lr = [0.02, 0.2]
[job]
command = ["{}", "--dataset", "optdigits", "--data-dir", "{}", "--lr", "{{lr}}",
           "--epochs", "2", "--step-delay-ms", "5", "--log-every", "5", "--checkpoint-every", "1"]
[job.stop]
deadline_s = 300
"#,
        bin_path("converge-trainer").display(),
        repo_root().join("data").display(),
    );
    let file = work.path().join("run.toml");
    std::fs::write(&file, sweep).unwrap();
    succeeded(&converge(&nats, &["submit", file.to_str().unwrap()]));
    for trial in ["run-1", "run-2"] {
        wait_for(Duration::from_secs(120), trial, || async {
            let s = job_status(&bus, trial).await?;
            (s.phase == JobPhase::Completed).then_some(())
        })
        .await;
    }
    let out = succeeded(&converge(&nats, &["--json", "jobs", "--sweep", "run"]));
    let ranked: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = ranked.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["rank"], i + 1);
        assert_eq!(r["phase"], "completed", "{r}");
        assert!(r["end_reason"].is_string(), "{r}");
        assert!(r["gpu_hours"].as_f64().is_some_and(|h| h > 0.0), "{r}");
        assert!(r["loss"].as_f64().is_some(), "{r}");
    }
    // By held-out loss when both trials report one, else by predicted training loss.
    let held_out = rows.iter().all(|r| r["held_out_loss"].is_f64());
    let score = |r: &serde_json::Value| {
        if held_out {
            return r["held_out_loss"].as_f64().unwrap();
        }
        r["predicted_loss"]
            .as_f64()
            .or_else(|| r["loss"].as_f64())
            .unwrap()
    };
    assert!(score(&rows[0]) <= score(&rows[1]), "{rows:?}");
    let table = succeeded(&converge(&nats, &["jobs", "--sweep", "run"]));
    assert!(table.contains("completed ("), "{table}");
}

/// ASHA early stopping, live: three real trainers, the third with a learning rate too small
/// to learn much and slowed down so it reaches the first rung (1 epoch) last. Its loss there
/// is not the best of the three, so the allocator ends it, `completed` with the reason
/// `early stopped`, and its agent stops its worker; the other two run to their end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweeps_early_stopping_ends_its_weak_trial() {
    let (nats, work, bus) = start_test().await;
    let _agent = start_agent(agent_config(&nats, "n1", 3, work.path()));
    let _allocator = start_allocator(allocator_config(&nats, Duration::ZERO));
    let sweep = format!(
        r#"
[sweep]
id = "es"
early_stop = "asha"
keep = 1
[[sweep.trials]]
lr = 0.2
delay = 2
[[sweep.trials]]
lr = 0.05
delay = 2
[[sweep.trials]]
lr = 0.0002
delay = 30
[job]
command = ["{}", "--dataset", "optdigits", "--data-dir", "{}", "--lr", "{{lr}}",
           "--epochs", "3", "--step-delay-ms", "{{delay}}", "--log-every", "5",
           "--eval-every", "20", "--checkpoint-every", "1"]
[job.stop]
deadline_s = 300
"#,
        bin_path("converge-trainer").display(),
        repo_root().join("data").display(),
    );
    let file = work.path().join("es.toml");
    std::fs::write(&file, sweep).unwrap();
    succeeded(&converge(&nats, &["submit", file.to_str().unwrap()]));
    let mut ends = Vec::new();
    for trial in ["es-1", "es-2", "es-3"] {
        let s = wait_for(Duration::from_secs(180), trial, || async {
            let s = job_status(&bus, trial).await?;
            s.phase.is_terminal().then_some(s)
        })
        .await;
        assert_eq!(s.phase, JobPhase::Completed, "{trial}: {s:?}");
        ends.push(s.end.as_ref().map(|e| e.reason));
    }
    use converge_common::EndReason::{EarlyStopped, Finished};
    assert_eq!(ends[2], Some(EarlyStopped), "the weak trial: {ends:?}");
    assert!(
        ends[..2].contains(&Some(Finished)),
        "keep 1: a good trial runs to its end: {ends:?}"
    );
    let weak = job_status(&bus, "es-3").await.unwrap();
    let message = weak.message.unwrap_or_default();
    assert!(
        message.contains("asha") && message.contains("rung of 1 epochs"),
        "{message}"
    );
    assert!(
        weak.samples < 3 * 3823,
        "stopped before its end: {}",
        weak.samples
    );
    let table = succeeded(&converge(&nats, &["jobs", "--sweep", "es"]));
    assert!(table.contains("completed (early stopped)"), "{table}");
}

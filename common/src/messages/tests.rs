use super::*;
use crate::codec::{MAX_MESSAGE_BYTES, decode, encode};

fn job(s: &str) -> JobId {
    JobId::new(s).unwrap()
}
fn host(s: &str) -> HostId {
    HostId::new(s).unwrap()
}

fn round_trip<T: Message + PartialEq + std::fmt::Debug>(msg: T) {
    let bytes = encode(&msg);
    let back: T = decode(&bytes).unwrap();
    assert_eq!(back, msg);
}

fn sample_plan() -> HostPlan {
    HostPlan {
        protocol: PROTOCOL_VERSION,
        host: host("node-1"),
        workers: vec![WorkerAssignment {
            job: job("a9a"),
            generation: 3,
            rank: 1,
            world_size: 2,
            local_rank: 0,
            local_world_size: 1,
            gpus: vec![2],
            master_addr: "10.0.0.1".into(),
            master_port: 23456,
            command: vec!["converge-trainer".into()],
            env: BTreeMap::new(),
            max_restarts: 3,
            num_ps: 0,
            hosts: 0,
            batch: Some(AssignedBatch {
                total: 128,
                per_worker: 32,
                accum_steps: 1,
                reference: 64,
            }),
            node_rank: Some(0),
            shadow: None,
        }],
    }
}

#[test]
fn round_trips() {
    round_trip(sample_plan());
    round_trip(ProgressReport {
        protocol: 1,
        job: job("a9a"),
        generation: 2,
        rank: 0,
        host: host("h"),
        line: WorkerProgressLine {
            eval_loss: Some(0.6),
            epoch: Some(0.02),
            sync_s: Some(0.012),
            model_bytes: Some(5200),
            grad_sqr: Some(0.25),
            grad_var: Some(3.5),
            sync_rounds_per_s: Some(6.5),
            model_gap: Some(0.0134),
            ..WorkerProgressLine::new(10, 640, 0.5)
        },
        time: 1.7e9,
        workers: Some(2),
        hosts: Some(1),
    });
    round_trip(Event::new(
        1.0,
        "allocator",
        EventKind::AllocationChanged {
            job: job("x"),
            generation: 2,
            from_workers: 1,
            to_workers: 3,
        },
        "grew".into(),
    ));
    round_trip(sample_telemetry());
}

fn sample_telemetry() -> HostTelemetry {
    HostTelemetry {
        protocol: 1,
        host: host("h"),
        addr: "127.0.0.1".into(),
        time: 5.0,
        agent_version: "0.1.0".into(),
        gpu_source: "fake".into(),
        gpus: vec![GpuSample {
            index: 0,
            uuid: "GPU-fake".into(),
            name: "Fake".into(),
            memory_total_bytes: 1 << 34,
            memory_used_bytes: 0,
            utilization_pct: 0.0,
            power_mw: None,
            sm_clock_mhz: None,
        }],
        nics: vec![NicSample {
            name: "lo".into(),
            rx_bytes_per_s: 1.0,
            tx_bytes_per_s: 2.0,
            link_speed_bps: Some(10_000_000_000),
        }],
        cpu_pct: 3.0,
        memory_used_bytes: 1,
        memory_total_bytes: 2,
        workers: vec![WorkerState {
            job: job("a"),
            generation: 1,
            rank: 0,
            phase: WorkerPhase::Backoff,
            pid: None,
            restarts: 1,
            last_exit_code: Some(1),
            gpus: vec![0],
        }],
        malformed_progress_lines: 0,
        ignored_gradient_stats: 0,
        skipped_progress_reports: 0,
        labels: [("gpu.count", "1"), ("zone", "a")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

#[test]
fn telemetry_labels_are_optional_and_checked() {
    let mut v: serde_json::Value = serde_json::from_slice(&encode(&sample_telemetry())).unwrap();
    assert_eq!(v["labels"]["zone"], "a");
    v.as_object_mut().unwrap().remove("labels");
    let old = decode::<HostTelemetry>(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert!(
        old.labels.is_empty(),
        "an older agent's telemetry has no labels"
    );
    for (key, value) in [("bad key", "a"), ("zone", "a b"), ("-x", "1")] {
        v["labels"] = serde_json::json!({ key: value });
        let e = decode::<HostTelemetry>(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert_eq!(e.kind(), "invalid", "{key}={value}: {e}");
        assert!(e.to_string().contains("labels"), "{e}");
    }
    let many: serde_json::Map<String, serde_json::Value> = (0..65)
        .map(|i| (format!("k{i}"), serde_json::Value::from("v")))
        .collect();
    v["labels"] = many.into();
    let e = decode::<HostTelemetry>(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert_eq!(e.kind(), "invalid", "{e}");
    v["labels"] = serde_json::json!({ "zone": 3 });
    let e = decode::<HostTelemetry>(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert_eq!(e.kind(), "malformed", "{e}");
}

#[test]
fn rejects_wrong_version_oversize_garbage_and_bad_ids() {
    let mut v: serde_json::Value = serde_json::from_slice(&encode(&sample_plan())).unwrap();
    v["protocol"] = 2.into();
    let e = decode::<HostPlan>(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert_eq!(e.kind(), "wrong_version", "{e}");

    v["protocol"] = 1.into();
    v["host"] = "a.b".into();
    let e = decode::<HostPlan>(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert_eq!(e.kind(), "malformed", "{e}");

    v.as_object_mut().unwrap().remove("protocol");
    let e = decode::<HostPlan>(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert_eq!(e.kind(), "invalid", "{e}");

    assert_eq!(
        decode::<HostPlan>(b"{not json").unwrap_err().kind(),
        "malformed"
    );
    let big = vec![b' '; MAX_MESSAGE_BYTES + 1];
    assert_eq!(decode::<HostPlan>(&big).unwrap_err().kind(), "too_large");
}

#[test]
fn rejects_inconsistent_plans() {
    let mut p = sample_plan();
    p.workers[0].rank = 2;
    assert!(p.validate().unwrap_err().contains("world size"));
    let mut p = sample_plan();
    let mut w = p.workers[0].clone();
    w.rank = 0;
    p.workers.push(w);
    assert!(p.validate().unwrap_err().contains("GPU"));
}

#[test]
fn phase_names_match_the_wire() {
    for p in [
        JobPhase::Pending,
        JobPhase::Running,
        JobPhase::Restarting,
        JobPhase::Completed,
        JobPhase::Failed,
        JobPhase::Cancelled,
    ] {
        assert_eq!(serde_json::to_value(p).unwrap(), p.as_str());
    }
}

#[test]
fn progress_line_parsing() {
    let ok =
        WorkerProgressLine::parse(r#"CONVERGE_PROGRESS {"step":120,"samples":30720,"loss":0.53}"#)
            .unwrap()
            .unwrap();
    assert_eq!((ok.step, ok.samples, ok.loss), (120, 30720, 0.53));
    assert_eq!(WorkerProgressLine::parse("epoch 3 done").unwrap(), None);
    assert!(WorkerProgressLine::parse("CONVERGE_PROGRESS {\"step\":1}").is_err());
    assert!(
        WorkerProgressLine::parse(r#"CONVERGE_PROGRESS {"step":1,"samples":1,"loss":NaN}"#)
            .is_err()
    );
    assert!(WorkerProgressLine::parse("CONVERGE_PROGRESS ").is_err());
    // Lines without the optional fields still parse.
    assert_eq!((ok.sync_s, ok.model_bytes), (None, None));
}

#[test]
fn progress_line_sync_time_and_model_size() {
    let p = WorkerProgressLine::parse(
        r#"CONVERGE_PROGRESS {"step":10,"samples":640,"loss":0.5,"sync_s":0.0125,"model_bytes":5200}"#,
    )
    .unwrap()
    .unwrap();
    assert_eq!((p.sync_s, p.model_bytes), (Some(0.0125), Some(5200)));
    let zero = WorkerProgressLine::parse(
        r#"CONVERGE_PROGRESS {"step":10,"samples":640,"loss":0.5,"sync_s":0}"#,
    )
    .unwrap()
    .unwrap();
    assert_eq!(zero.sync_s, Some(0.0));
    assert_eq!((zero.sync_rounds_per_s, zero.model_gap), (None, None));
    let shadow = WorkerProgressLine::parse(
        r#"CONVERGE_PROGRESS {"step":10,"samples":640,"loss":0.5,"sync_s":0,"sync_rounds_per_s":42.5,"model_gap":0.012}"#,
    )
    .unwrap()
    .unwrap();
    assert_eq!(
        (shadow.sync_rounds_per_s, shadow.model_gap),
        (Some(42.5), Some(0.012))
    );
    for bad in [
        r#"{"step":1,"samples":1,"loss":0.5,"sync_s":-0.1}"#,
        r#"{"step":1,"samples":1,"loss":0.5,"sync_s":NaN}"#,
        r#"{"step":1,"samples":1,"loss":0.5,"sync_s":"fast"}"#,
        r#"{"step":1,"samples":1,"loss":0.5,"sync_s":1e999}"#,
        r#"{"step":1,"samples":1,"loss":0.5,"model_bytes":-1}"#,
        r#"{"step":1,"samples":1,"loss":0.5,"model_bytes":1.5}"#,
        r#"{"step":1,"samples":1,"loss":0.5,"sync_rounds_per_s":-1}"#,
        r#"{"step":1,"samples":1,"loss":0.5,"sync_rounds_per_s":"many"}"#,
        r#"{"step":1,"samples":1,"loss":0.5,"model_gap":-0.5}"#,
        r#"{"step":1,"samples":1,"loss":0.5,"model_gap":1e999}"#,
    ] {
        let line = format!("CONVERGE_PROGRESS {bad}");
        assert!(WorkerProgressLine::parse(&line).is_err(), "{line}");
    }
}

/// The wire JSON of a progress report, pinned: every key of a full report and of a
/// minimal one (`ProgressReport::new`), so that a change of the struct cannot change what
/// allocators of other versions read. Written only through `decode`, `encode`, `new` and
/// `gradient`, which every version of the struct has.
#[test]
fn progress_report_wire_format_is_pinned() {
    let full = serde_json::json!({
        "protocol": 1, "job": "a9a", "generation": 2, "rank": 1, "host": "h",
        "step": 10, "samples": 640, "loss": 0.5, "eval_loss": 0.6, "epoch": 0.02,
        "time": 1.7e9, "workers": 2, "hosts": 1, "sync_time_s": 0.012,
        "model_bytes": 5200, "grad_sqr": 0.25, "grad_var": 3.5,
        "sync_rounds_per_s": 6.5, "model_gap": 0.0134
    });
    let r: ProgressReport = decode(&serde_json::to_vec(&full).unwrap()).unwrap();
    assert_eq!(
        r.gradient(),
        GradientReading::Valid {
            sqr: 0.25,
            var: 3.5
        }
    );
    let wire: serde_json::Value = serde_json::from_slice(&encode(&r)).unwrap();
    assert_eq!(wire, full);
    assert_eq!(decode::<ProgressReport>(&encode(&r)).unwrap(), r);
    // A minimal report: the four older optional keys written as null, the newer ones
    // (gradient statistics, ShadowSync figures) not written at all.
    let minimal = serde_json::json!({
        "protocol": 1, "job": "a9a", "generation": 2, "rank": 1, "host": "h",
        "step": 10, "samples": 640, "loss": 0.5, "eval_loss": null, "epoch": null,
        "time": 1.7e9, "workers": null, "hosts": null, "sync_time_s": null,
        "model_bytes": null
    });
    let m = ProgressReport::new(job("a9a"), 2, 1, host("h"), 10, 640, 0.5, 1.7e9);
    let wire: serde_json::Value = serde_json::from_slice(&encode(&m)).unwrap();
    assert_eq!(wire, minimal);
    assert_eq!(decode::<ProgressReport>(&encode(&m)).unwrap(), m);
    // Reading: the required keys only; `sync_s` is not a report key (ignored); null
    // gradient statistics read as absent; a bad pair is accepted and reads as invalid.
    let required = serde_json::json!({
        "protocol": 1, "job": "a9a", "generation": 2, "rank": 1, "host": "h",
        "step": 10, "samples": 640, "loss": 0.5, "time": 1.7e9
    });
    let old: ProgressReport = decode(&serde_json::to_vec(&required).unwrap()).unwrap();
    assert_eq!(old, m);
    let mut v = required.clone();
    v["sync_s"] = 0.5.into();
    let stray: ProgressReport = decode(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert_eq!(stray, m);
    let wire: serde_json::Value = serde_json::from_slice(&encode(&stray)).unwrap();
    assert_eq!(wire, minimal);
    let mut v = required.clone();
    v["grad_sqr"] = serde_json::Value::Null;
    v["grad_var"] = serde_json::Value::Null;
    let nulls: ProgressReport = decode(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert_eq!(nulls.gradient(), GradientReading::Absent);
    let mut v = required.clone();
    v["grad_sqr"] = (-1.0).into();
    v["grad_var"] = 1.0.into();
    let bad: ProgressReport = decode(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert_eq!(bad.gradient(), GradientReading::Invalid);
    // Refused: a missing required key, a wrong type, bare NaN, a negative sync time
    // (invalid, naming the key).
    for key in ["step", "samples", "loss", "time", "job", "rank"] {
        let mut v = required.clone();
        v.as_object_mut().unwrap().remove(key);
        assert!(
            decode::<ProgressReport>(&serde_json::to_vec(&v).unwrap()).is_err(),
            "{key}"
        );
    }
    let mut v = full.clone();
    v["sync_rounds_per_s"] = "many".into();
    assert!(decode::<ProgressReport>(&serde_json::to_vec(&v).unwrap()).is_err());
    let text = serde_json::to_string(&full)
        .unwrap()
        .replace("\"grad_sqr\":0.25", "\"grad_sqr\":NaN");
    assert!(text.contains("NaN"));
    assert!(decode::<ProgressReport>(text.as_bytes()).is_err());
    let mut v = full.clone();
    v["sync_time_s"] = (-0.5).into();
    let e = decode::<ProgressReport>(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert_eq!(e.kind(), "invalid", "{e}");
    assert!(e.to_string().contains("sync_time_s"), "{e}");
}

#[test]
fn a_written_progress_line_reads_back_as_itself() {
    // Absent gradient statistics are not written (a `null` would read as not a number).
    let plain = WorkerProgressLine::new(3, 24, 0.75);
    let text = serde_json::to_string(&plain).unwrap();
    assert!(
        !text.contains("grad_") && !text.contains("model_gap"),
        "{text}"
    );
    let back = WorkerProgressLine::parse(&format!("{PROGRESS_LINE_PREFIX}{text}"));
    assert_eq!(back.unwrap().unwrap(), plain);
    let full = WorkerProgressLine {
        eval_loss: Some(0.8),
        epoch: Some(0.1),
        sync_s: Some(0.01),
        model_bytes: Some(5200),
        grad_sqr: Some(0.25),
        grad_var: Some(3.5),
        sync_rounds_per_s: Some(6.5),
        model_gap: Some(0.01),
        ..plain
    };
    let text = serde_json::to_string(&full).unwrap();
    let back = WorkerProgressLine::parse(&format!("{PROGRESS_LINE_PREFIX}{text}"));
    assert_eq!(back.unwrap().unwrap(), full);
    // In a report, the same line: its `sync_s` is the wire's `sync_time_s`.
    let mut r = ProgressReport::new(job("j"), 1, 0, host("h"), 3, 24, 0.75, 1.0);
    r.line = full.clone();
    let wire: serde_json::Value = serde_json::from_slice(&encode(&r)).unwrap();
    assert_eq!(
        (wire["sync_time_s"].as_f64(), wire.get("sync_s")),
        (Some(0.01), None)
    );
    assert_eq!(decode::<ProgressReport>(&encode(&r)).unwrap().line, full);
}

#[test]
fn progress_report_sync_time_is_validated_and_optional() {
    let base = ProgressReport {
        protocol: 1,
        job: job("a9a"),
        generation: 2,
        rank: 0,
        host: host("h"),
        line: WorkerProgressLine {
            sync_s: Some(0.0),
            model_bytes: Some(5200),
            ..WorkerProgressLine::new(10, 640, 0.5)
        },
        time: 1.7e9,
        workers: Some(2),
        hosts: Some(1),
    };
    assert!(base.validate().is_ok());
    for bad in [-1e-9, f64::NAN, f64::INFINITY] {
        let mut r = base.clone();
        r.line.sync_s = Some(bad);
        assert!(r.validate().unwrap_err().contains("sync_time_s"), "{bad}");
    }
    // Reports of agents older than the fields decode with both absent.
    let mut v: serde_json::Value = serde_json::from_slice(&encode(&base)).unwrap();
    let obj = v.as_object_mut().unwrap();
    obj.remove("sync_time_s");
    obj.remove("model_bytes");
    let old: ProgressReport = decode(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert_eq!((old.line.sync_s, old.line.model_bytes), (None, None));
    // A negative sync time on the wire is refused as invalid.
    v["sync_time_s"] = (-0.5).into();
    let e = decode::<ProgressReport>(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert_eq!(e.kind(), "invalid", "{e}");
}

#[test]
fn progress_report_shadow_figures_round_trip_are_optional_and_validated() {
    let mut shadow = ProgressReport::new(job("sh"), 1, 0, host("h"), 40, 5120, 0.7, 1.7e9);
    shadow.line.sync_s = Some(0.0);
    shadow.line.sync_rounds_per_s = Some(13.6);
    shadow.line.model_gap = Some(0.0065);
    let back: ProgressReport = decode(&encode(&shadow)).unwrap();
    assert_eq!(back, shadow);
    // Zero is a valid figure (a generation whose synchronization was dropped).
    let mut zero = shadow.clone();
    zero.line.sync_rounds_per_s = Some(0.0);
    zero.line.model_gap = Some(0.0);
    assert!(zero.validate().is_ok());
    // Absent in reports of other jobs: not written at all, and reports of agents older
    // than the fields decode with both absent.
    let plain = ProgressReport::new(job("sh"), 1, 0, host("h"), 40, 5120, 0.7, 1.7e9);
    let text = String::from_utf8(encode(&plain)).unwrap();
    assert!(
        !text.contains("sync_rounds_per_s") && !text.contains("model_gap"),
        "{text}"
    );
    let old: ProgressReport = decode(text.as_bytes()).unwrap();
    assert_eq!(
        (old.line.sync_rounds_per_s, old.line.model_gap),
        (None, None)
    );
    // Negative, NaN and infinite figures are refused, naming the field.
    for bad in [-1e-9, -3.0, f64::NAN, f64::INFINITY] {
        let (mut rounds, mut gap) = (shadow.clone(), shadow.clone());
        rounds.line.sync_rounds_per_s = Some(bad);
        gap.line.model_gap = Some(bad);
        for (field, r) in [("sync_rounds_per_s", rounds), ("model_gap", gap)] {
            assert!(r.validate().unwrap_err().contains(field), "{field} {bad}");
        }
    }
    // On the wire: a negative figure is refused as invalid, a string as malformed.
    let mut v: serde_json::Value = serde_json::from_slice(&encode(&shadow)).unwrap();
    v["model_gap"] = (-0.5).into();
    let e = decode::<ProgressReport>(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert_eq!(e.kind(), "invalid", "{e}");
    assert!(e.to_string().contains("model_gap"), "{e}");
    v["model_gap"] = 0.01.into();
    v["sync_rounds_per_s"] = "many".into();
    assert!(decode::<ProgressReport>(&serde_json::to_vec(&v).unwrap()).is_err());
}

#[test]
fn job_status_shadow_figures_are_optional_and_validated() {
    let mut s = JobStatus::pending(job("sh"), 1.0, 1.0);
    let text = String::from_utf8(encode(&s)).unwrap();
    assert!(!text.contains("sync_rounds_per_s"), "{text}");
    s.sync_rounds_per_s = Some(6.8);
    s.model_gap = Some(0.0134);
    let back: JobStatus = decode(&encode(&s)).unwrap();
    assert_eq!(
        (back.sync_rounds_per_s, back.model_gap),
        (Some(6.8), Some(0.0134))
    );
    s.model_gap = Some(f64::NAN);
    assert!(s.validate().unwrap_err().contains("model_gap"));
    s.model_gap = None;
    s.sync_rounds_per_s = Some(-1.0);
    assert!(s.validate().unwrap_err().contains("sync_rounds_per_s"));
}

#[test]
fn gradient_statistics_in_progress_lines_are_classified_never_refused() {
    let parse = |json: &str| {
        WorkerProgressLine::parse(&format!("CONVERGE_PROGRESS {json}"))
            .unwrap()
            .unwrap()
    };
    let p = parse(r#"{"step":1,"samples":8,"loss":0.9,"grad_sqr":0.5,"grad_var":2.0}"#);
    assert_eq!(p.gradient(), GradientReading::Valid { sqr: 0.5, var: 2.0 });
    let p = parse(r#"{"step":1,"samples":8,"loss":0.9}"#);
    assert_eq!(p.gradient(), GradientReading::Absent);
    // Missing one, null, negative, both zero, and Python's bare NaN / Infinity: the
    // line (its loss) stays, the statistics are invalid.
    for json in [
        r#"{"step":1,"samples":8,"loss":0.9,"grad_sqr":0.5}"#,
        r#"{"step":1,"samples":8,"loss":0.9,"grad_var":0.5}"#,
        r#"{"step":1,"samples":8,"loss":0.9,"grad_sqr":null,"grad_var":1.0}"#,
        r#"{"step":1,"samples":8,"loss":0.9,"grad_sqr":-1.0,"grad_var":1.0}"#,
        r#"{"step":1,"samples":8,"loss":0.9,"grad_sqr":0.0,"grad_var":0.0}"#,
        r#"{"step":1,"samples":8,"loss":0.9,"grad_sqr":NaN,"grad_var":1.0}"#,
        r#"{"step":1,"samples":8,"loss":0.9,"grad_sqr":1.0,"grad_var":Infinity}"#,
        r#"{"step":1,"samples":8,"loss":0.9,"grad_sqr":-Infinity,"grad_var":NaN}"#,
    ] {
        let p = parse(json);
        assert_eq!(
            (p.loss, p.gradient()),
            (0.9, GradientReading::Invalid),
            "{json}"
        );
    }
    // NaN inside a string is left alone; a NaN loss is still a malformed line.
    let p =
        parse(r#"{"step":1,"samples":8,"loss":0.9,"eval_loss":null,"grad_sqr":NaN,"grad_var":1}"#);
    assert_eq!(p.gradient(), GradientReading::Invalid);
    assert!(
        WorkerProgressLine::parse(r#"CONVERGE_PROGRESS {"step":1,"samples":8,"loss":NaN}"#)
            .is_err()
    );
    assert_eq!(
        nan_tokens_to_null(r#"{"k":"NaN é","v":NaN}"#).unwrap(),
        r#"{"k":"NaN é","v":"\u0001converge-not-a-number"}"#
    );
    assert_eq!(nan_tokens_to_null(r#"{"k":"NaN"}"#), None);
    // A report with a bad pair on the wire is accepted; the pair reads as invalid.
    let mut r = ProgressReport::new(job("j"), 1, 0, host("h"), 1, 8, 0.9, 1.0);
    r.line.grad_sqr = Some(-1.0);
    r.line.grad_var = Some(1.0);
    let back: ProgressReport = decode(&encode(&r)).unwrap();
    assert_eq!(back.gradient(), GradientReading::Invalid);
}

#[test]
fn plans_with_inconsistent_batches_are_refused_and_older_plans_have_none() {
    let mut plan = sample_plan();
    assert!(plan.validate().is_ok());
    plan.workers[0].batch.as_mut().unwrap().total = 100;
    assert!(plan.validate().unwrap_err().contains("batch 100"));
    let mut v: serde_json::Value = serde_json::from_slice(&encode(&sample_plan())).unwrap();
    v["workers"][0].as_object_mut().unwrap().remove("batch");
    let old: HostPlan = decode(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert_eq!(old.workers[0].batch, None);
}

#[test]
fn a_report_keeps_its_message_id_and_different_reports_differ() {
    let report = |step: u64, loss: f64| {
        let (job, host) = ("j".parse().unwrap(), "h".parse().unwrap());
        ProgressReport::new(job, 2, 1, host, step, step * 32, loss, 10.0)
    };
    let a = report(20, 0.5);
    let id = a.msg_id();
    assert_eq!(id, a.clone().msg_id(), "a retry must reuse the id");
    assert!(id.starts_with("j.h.g2.r1.s20."), "{id}");
    // Same job, host, generation, rank and step, other content: another id (a worker
    // printing two lines for one step loses neither).
    assert_ne!(id, report(20, 0.4).msg_id());
    let mut later = a.clone();
    later.time = 11.0;
    assert_ne!(id, later.msg_id());
    assert_ne!(id, report(21, 0.5).msg_id());
}

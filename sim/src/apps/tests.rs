use super::*;
use std::sync::OnceLock;

/// The folder application `app` is loaded from under [`test_trace_dirs`].
fn traces(app: &str) -> PathBuf {
    app_dir(&test_trace_dirs(), app).expect("traces").join(app)
}

fn apps() -> &'static BTreeMap<String, Application> {
    static APPS: OnceLock<BTreeMap<String, Application>> = OnceLock::new();
    APPS.get_or_init(|| load_all(&test_trace_dirs()).expect("traces load"))
}

#[test]
fn a_missing_application_is_named_with_the_folders_searched() {
    let dirs = [
        PathBuf::from("/nonexistent/a"),
        PathBuf::from("/nonexistent/b"),
    ];
    let err = load_all(&dirs).unwrap_err();
    let TraceError::Missing { app, searched } = &err else {
        panic!("{err}");
    };
    assert_eq!(app, "bert");
    assert_eq!(searched, "/nonexistent/a, /nonexistent/b");
    assert!(err.to_string().contains("--traces"), "{err}");
}

#[test]
fn each_application_comes_from_the_first_folder_that_has_it() {
    let dirs = test_trace_dirs();
    // The repository's folder has no application: each comes from the second one.
    assert_eq!(app_dir(&dirs, "cifar10").unwrap(), dirs[1]);
    // A folder that has it first wins over a later one that has it too.
    let twice = vec![dirs[1].clone(), dirs[1].join("../traces"), dirs[0].clone()];
    assert_eq!(app_dir(&twice, "bert").unwrap(), twice[0]);
}

fn placement_rows(app: &str) -> Vec<(String, f64, f64, f64)> {
    let mut out = Vec::new();
    read_csv(&traces(app).join("placements.csv"), |r: PlacementRow, _| {
        out.push((
            r.placement,
            f64::from(r.local_bsz),
            r.step_time,
            r.sync_time,
        ));
        Ok(())
    })
    .expect("placements.csv");
    out
}

fn digits(s: &str) -> Vec<u32> {
    s.chars().map(|c| c.to_digit(10).expect("digit")).collect()
}

#[test]
fn pollux_constants() {
    let a = apps();
    let epochs: Vec<(&str, u32)> = a.iter().map(|(k, v)| (k.as_str(), v.max_epochs)).collect();
    assert_eq!(
        epochs,
        [
            ("bert", 2),
            ("cifar10", 100),
            ("deepspeech2", 80),
            ("imagenet", 90),
            ("ncf", 10),
            ("yolov3", 50)
        ]
    );
    let c = &a["cifar10"];
    assert_eq!((c.init_batch_size, c.max_batch_size), (128, 4096));
    assert_eq!((c.min_local_bsz, c.max_local_bsz), (32, 1024));
    assert_eq!(a["yolov3"].max_local_bsz, 8);
    assert_eq!(a["ncf"].max_batch_size, 32768);
    for app in a.values() {
        assert_eq!(
            app.completion_epoch(app.init_batch_size),
            app.max_epochs - 1
        );
    }
}

#[test]
fn throughput_matches_every_placement_row_and_its_rotations() {
    for (name, app) in apps() {
        for (p, bsz, step, sync) in placement_rows(name) {
            let mut parts = digits(&p);
            for _ in 0..parts.len() {
                assert_eq!(
                    app.throughput(&parts, bsz),
                    (step, sync),
                    "{name} {parts:?} {bsz}"
                );
                parts.rotate_left(1);
            }
            let mut with_zeros = vec![0];
            with_zeros.extend(digits(&p).iter().flat_map(|&g| [g, 0]));
            assert_eq!(app.throughput(&with_zeros, bsz), (step, sync));
        }
    }
    // '1234' and '4123' are the same placement.
    let c = &apps()["cifar10"];
    assert_eq!(
        c.throughput(&[4, 1, 2, 3], 64.0),
        c.throughput(&[1, 2, 3, 4], 64.0)
    );
    // ... but '1324' is another one.
    assert_ne!(
        c.throughput(&[1, 3, 2, 4], 64.0),
        c.throughput(&[1, 2, 3, 4], 64.0)
    );
}

#[test]
fn throughput_is_linear_between_local_bsz_rows_and_clamped_outside() {
    let rows = placement_rows("cifar10");
    let at = |p: &str, b: f64| {
        rows.iter()
            .find(|r| r.0 == p && r.1 == b)
            .map(|r| (r.2, r.3))
            .expect("row")
    };
    let c = &apps()["cifar10"];
    let (lo, hi) = (at("22", 64.0), at("22", 91.0));
    for t in [0.25, 0.5, 0.9] {
        let b = 64.0 + 27.0 * t;
        let (s, y) = c.throughput(&[2, 2], b);
        assert!((s - (lo.0 + t * (hi.0 - lo.0))).abs() < 1e-12);
        assert!((y - (lo.1 + t * (hi.1 - lo.1))).abs() < 1e-12);
    }
    assert_eq!(c.throughput(&[2, 2], 1.0), at("22", 32.0));
    assert_eq!(c.throughput(&[2, 2], 1e9), at("22", 1024.0));
    assert_eq!(c.throughput(&[], 64.0), (f64::INFINITY, 0.0));
}

#[test]
fn interpolation_hits_scalability_rows_and_stays_finite() {
    for (name, app) in apps() {
        let path = traces(name).join("scalability.csv");
        let mut rows = Vec::new();
        read_csv(&path, |r: ScalabilityRow, _| {
            rows.push(r);
            Ok(())
        })
        .expect("scalability.csv");
        for r in rows {
            // 16 nodes x 4 GPUs: a packed placement of num_replicas over num_nodes.
            let mut placement = vec![r.num_replicas / r.num_nodes; r.num_nodes as usize];
            for slot in placement
                .iter_mut()
                .take((r.num_replicas % r.num_nodes) as usize)
            {
                *slot += 1;
            }
            let (s, y) = app.throughput(&placement, f64::from(r.local_bsz));
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1e-9);
            assert!(
                close(s, r.step_time) && close(y, r.sync_time),
                "{name} {placement:?}"
            );
        }
        for n in 1..=20u32 {
            for r in [n, 2 * n, 4 * n, 4 * n + 3, 100] {
                let p = vec![r.div_ceil(n); n as usize];
                for b in [0.0, 1.0, 17.5, 100.0, 1e6] {
                    let (s, y) = app.throughput(&p, b);
                    assert!(
                        s.is_finite() && y.is_finite() && s > 0.0 && y >= 0.0,
                        "{name} {p:?} {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn triangulations_are_delaunay_and_fill_the_hull() {
    // Small degenerate grid: every cube's corners are cospherical.
    let mut pts = Vec::new();
    for x in 0..4 {
        for y in 0..4 {
            for z in 0..3 {
                pts.push([x, y, z * 7]);
            }
        }
    }
    delaunay::Triangulation::build(&pts)
        .expect("3-D")
        .check()
        .expect("valid");
    // The cifar10 interpolation points.
    let app = "cifar10";
    let mut pts = std::collections::BTreeSet::new();
    for (p, b, _, _) in placement_rows(app) {
        let d = digits(&p);
        pts.insert([d.len() as i64, d.iter().sum::<u32>() as i64, b as i64]);
    }
    let mut pts: Vec<[i64; 3]> = pts.into_iter().collect();
    read_csv(
        &traces(app).join("scalability.csv"),
        |r: ScalabilityRow, _| {
            pts.push([r.num_nodes, r.num_replicas, r.local_bsz].map(i64::from));
            Ok(())
        },
    )
    .expect("scalability.csv");
    delaunay::Triangulation::build(&pts)
        .expect("3-D")
        .check()
        .expect("valid");
    assert!(
        delaunay::Triangulation::build(&[[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]).is_none()
    );
}

#[test]
fn predicates_have_the_documented_signs() {
    let (a, b, c, d) = ([0, 0, 0], [4, 0, 0], [0, 4, 0], [0, 0, 4]);
    assert!(delaunay::orient(&a, &b, &c, &d) > 0);
    assert!(delaunay::insphere(&a, &b, &c, &d, &[1, 1, 1]) > 0);
    assert!(delaunay::insphere(&a, &b, &c, &d, &[10, 10, 10]) < 0);
    assert_eq!(delaunay::insphere(&a, &b, &c, &d, &[4, 4, 0]), 0);
}

#[test]
fn statistics_come_from_the_bracketing_validation_files() {
    let c = &apps()["cifar10"];
    // cifar10/validation-256.csv row 0 and validation-512.csv row 1.
    assert_eq!(
        c.grad_stats(256, 0),
        (17.379458169870425, 13.937760473946334)
    );
    assert_eq!(
        c.grad_stats(512, 1),
        (0.6935198677965431, 1.7814744166924186)
    );
    // Halfway between 1024 and 2048, epoch 0: the mean of both rows.
    let (s, v) = c.grad_stats(1536, 0);
    assert!((s - (8.978532644212862 + 10.73321269096998) / 2.0).abs() < 1e-12);
    assert!((v - (6.740279795719679 + 5.4859538034431825) / 2.0).abs() < 1e-12);
    // Outside the validated range: the nearest file.
    assert_eq!(c.grad_stats(8192, 0), c.grad_stats(4096, 0));
    assert_eq!(c.grad_stats(1, 0), c.grad_stats(128, 0));
    // Progress: the smallest over the files at the end of the previous epoch.
    assert_eq!(c.progress(0), 0.0);
    assert_eq!(c.progress(1), 390.71438596642224);
    assert_eq!(c.progress(2), 781.5989447399924);
    assert_eq!(c.iteration(2048, 0), 112.0);
    // Metrics: cifar10 accuracy, bert in percent, deepspeech2 word error rate.
    assert!((c.loss_like(128, 0.0) - (1.0 - 0.4455)).abs() < 1e-12);
    assert!((c.loss_like(128, 0.5) - (1.0 - (0.4455 + 0.6007) / 2.0)).abs() < 1e-12);
    assert!((apps()["bert"].loss_like(12, 1.0) - (1.0 - 0.8861300061544314)).abs() < 1e-12);
    assert!((apps()["deepspeech2"].loss_like(20, 0.0) - 99.47931732716228).abs() < 1e-12);
    for app in apps().values() {
        let b = app.init_batch_size;
        let end = f64::from(app.completion_epoch(b));
        assert!(
            app.loss_like(b, end) < app.loss_like(b, 0.0),
            "{}",
            app.name
        );
        assert!(app.loss_like(b, end + 5.0) >= 0.0);
    }
}

#[test]
fn validation_runs_are_loss_curves_in_samples_and_epochs() {
    let c = &apps()["cifar10"];
    let runs = c.validation_runs();
    let batches: Vec<u32> = runs.iter().map(|r| r.batch_size).collect();
    assert_eq!(batches, [128, 256, 512, 1024, 2048, 4096]);
    // cifar10's runs: 100 rows each; the smallest batch's run sets the epoch (50,000
    // samples: 39,062 steps of 128 over 100 rows).
    let small = &runs[0];
    assert_eq!(small.samples.len(), 100);
    assert_eq!(small.samples[0], 390.0 * 128.0);
    assert!((small.samples[99] / small.epoch_samples - 100.0).abs() < 1e-9);
    assert!((small.loss[0] - (1.0 - 0.4455)).abs() < 1e-12);
    // A larger batch's run: its own steps times its batch, in epochs of the same size.
    let large = &runs[5];
    assert_eq!(large.samples[0], 106.0 * 4096.0);
    assert_eq!(large.epoch_samples, small.epoch_samples);
    assert!((large.samples[0] / large.epoch_samples - 106.0 * 4096.0 / 50_000.0).abs() < 1e-3);
    assert!((large.loss[99] - (1.0 - 0.9412)).abs() < 1e-12);
    // deepspeech2's word error rate is already a loss; bert's score is in percent.
    assert!((apps()["deepspeech2"].validation_runs()[0].loss[0] - 99.47931732716228).abs() < 1e-12);
    assert!(
        (apps()["bert"].validation_runs()[0].loss[1] - (1.0 - 0.8861300061544314)).abs() < 1e-12
    );
    for app in apps().values() {
        for r in app.validation_runs() {
            assert!(r.samples.windows(2).all(|w| w[1] > w[0]), "{}", app.name);
            assert_eq!(r.samples.len(), r.loss.len());
            assert!(r.epoch_samples > 0.0);
            assert!(r.loss.iter().all(|l| l.is_finite() && *l >= 0.0));
        }
    }
}

#[test]
fn batch_config_follows_pollux() {
    let a = apps();
    let c = &a["cifar10"];
    assert_eq!(c.batch_config(128, 1), (128, 0));
    // Above init_batch_size on one GPU: at least two micro-batches.
    assert_eq!(c.batch_config(2048, 1), (1024, 1));
    assert_eq!(c.batch_config(2048, 6), (342, 0));
    // Capped so that the effective batch stays within max_batch_size.
    assert_eq!(c.batch_config(4096, 3), (682, 1)); // local 1366 -> 2 x 683 -> cap 682
    let y = &a["yolov3"];
    assert_eq!(y.batch_config(64, 4), (8, 1));
}

/// Completion time of a job started at 0 alone on a fixed placement: the restart delay
/// plus, per epoch, the progress to cover over the goodput (gain / seconds per step),
/// rounded to whole seconds when `round` (Pollux rounds each epoch crossing).
fn expected_completion(
    app: &Application,
    placement: &[u32],
    batch: u32,
    delay: f64,
    round: bool,
) -> f64 {
    let replicas: u32 = placement.iter().sum();
    let (atomic, accum) = app.batch_config(batch, replicas);
    let eff = f64::from(replicas * atomic * (accum + 1));
    let (step, sync) = app.throughput(placement, f64::from(atomic));
    let total = step + (step - sync) * f64::from(accum);
    let mut t = delay;
    for e in 0..app.max_epochs {
        let (sqr, var) = app.grad_stats(eff as u32, e);
        let scale = eff / f64::from(app.init_batch_size);
        let gain = (var + sqr) / (var / scale + sqr);
        let dt = (app.progress(e + 1) - app.progress(e)) / (gain / total);
        t += if round { dt.round_ties_even() } else { dt };
    }
    t
}

fn run_alone(app: &Application, job: &mut SimJob, start: f64, interval: f64) -> f64 {
    let mut now = start;
    while job.completed_at.is_none() {
        job.step(app, now, interval, 0.0);
        now += interval;
        assert!(now < 1e8, "never completes");
    }
    job.completed_at.expect("completed")
}

#[test]
fn cifar10_on_one_gpu_finishes_when_its_step_times_say() {
    let app = &apps()["cifar10"];
    // Batch 128 (= init_batch_size) on one GPU: no accumulation, gain 1, so one unit of
    // progress per step of the '1' placement at 128 (between its rows at 91 and 129).
    let rows = placement_rows("cifar10");
    let row = |b: f64| rows.iter().find(|r| r.0 == "1" && r.1 == b).expect("row").2;
    let step = row(91.0) + (row(129.0) - row(91.0)) * (128.0 - 91.0) / (129.0 - 91.0);
    // Progress at each epoch boundary: the smallest over the validation files.
    let mut bounds = vec![f64::INFINITY; 100];
    for b in [128, 256, 512, 1024, 2048, 4096] {
        let path = traces("cifar10").join(format!("validation-{b}.csv"));
        let text = std::fs::read_to_string(path).expect("validation file");
        for (e, line) in text.lines().skip(1).take(100).enumerate() {
            let p: f64 = line
                .split(',')
                .next()
                .expect("progress")
                .parse()
                .expect("number");
            bounds[e] = bounds[e].min(p);
        }
    }
    let (mut exact, mut prev) = (1000.0 + 30.0, 0.0);
    for &p in &bounds {
        exact += ((p - prev) * step).round_ties_even();
        prev = p;
    }
    let smooth = 1030.0 + bounds[99] * step;
    // One long step: every epoch crossing is rounded from its start, as above.
    let mut job = SimJob::new("c", app, 1000.0, 1, 128);
    job.reallocate(app, vec![1], POLLUX_RESTART_DELAY_S, None);
    job.step(app, 1000.0, 1e9, 0.0);
    let done = job.completed_at.expect("completed");
    assert!((done - exact).abs() < 1.0, "{done} vs {exact}");
    assert_eq!((job.epoch, job.restarts), (100, 0));
    assert!((job.attained_gpu_seconds - (done - 1000.0)).abs() < 1e-6);
    // 60 s intervals: within half a second per epoch of the unrounded time.
    let mut job = SimJob::new("c", app, 1000.0, 1, 128);
    job.reallocate(app, vec![1], POLLUX_RESTART_DELAY_S, None);
    let done = run_alone(app, &mut job, 1000.0, 60.0);
    assert!((done - smooth).abs() <= 50.0, "{done} vs {smooth}");
    assert_eq!(done, done.round());
}

#[test]
fn completion_time_is_exact_within_a_second() {
    for (name, placement, batch) in [
        ("cifar10", vec![2, 2], 512),
        ("bert", vec![4, 4], 96),
        ("ncf", vec![1], 1024),
        ("yolov3", vec![4, 4, 4, 4, 4], 256),
        ("imagenet", vec![4; 12], 3200),
        ("deepspeech2", vec![3, 3], 320),
    ] {
        let app = &apps()[name];
        let exact = expected_completion(app, &placement, batch, 30.0, true);
        let mut job = SimJob::new(name, app, 0.0, 1, batch);
        job.reallocate(app, placement.clone(), 30.0, None);
        job.step(app, 0.0, 1e9, 0.0);
        let done = job.completed_at.expect("completed");
        assert!((done - exact).abs() < 1.0, "{name}: {done} vs {exact}");
        // Any interval grid: within half a second per epoch of the unrounded time.
        let smooth = expected_completion(app, &placement, batch, 30.0, false);
        let slack = 0.5 * f64::from(app.max_epochs) + 1e-6;
        for interval in [60.0, 7.0] {
            let mut job = SimJob::new(name, app, 0.0, 1, batch);
            job.reallocate(app, placement.clone(), 30.0, None);
            let done = run_alone(app, &mut job, 0.0, interval);
            assert!((done - smooth).abs() <= slack, "{name}: {done} vs {smooth}");
        }
    }
}

#[test]
fn restarts_cost_exactly_the_delay() {
    let app = &apps()["imagenet"];
    let mut a = SimJob::new("a", app, 0.0, 4, 800);
    a.reallocate(app, vec![4], 30.0, None);
    let mut b = SimJob::new("b", app, 0.0, 4, 800);
    b.reallocate(app, vec![0, 4, 0], 30.0, None);
    assert_eq!(b.placement, vec![4]);
    a.step(app, 0.0, 60.0, 0.0);
    b.step(app, 0.0, 60.0, 0.0);
    for k in 1..=5 {
        // Same placement again: a restart with nothing else changed.
        b.reallocate(app, vec![4], 30.0, None);
        let now = 60.0 * f64::from(k);
        a.step(app, now, 60.0, 0.0);
        b.step(app, now, 60.0, 0.0);
    }
    assert_eq!((a.restarts, b.restarts), (0, 5));
    assert_eq!((a.epoch, b.epoch), (0, 0));
    let goodput = a.progress_rate(app, 4, 4);
    assert!((a.progress - b.progress - 150.0 * goodput).abs() < 1e-9 * a.progress);
    assert_eq!(a.attained_gpu_seconds, b.attained_gpu_seconds);
    // To completion in one step each: the 150 s show up whole.
    a.step(app, 360.0, 1e9, 0.0);
    b.step(app, 360.0, 1e9, 0.0);
    let (da, db) = (
        a.completed_at.expect("a done"),
        b.completed_at.expect("b done"),
    );
    assert!((db - da - 150.0).abs() < 1.0, "{da} {db}");
    let app = &apps()["cifar10"];
    let mut c = SimJob::new("c", app, 0.0, 4, 512);
    c.reallocate(app, vec![4], 30.0, None);
    let samples = c.step(app, 0.0, 20.0, 0.0);
    assert_eq!((samples, c.progress, c.restarting_for_s), (0.0, 0.0, 10.0));
    assert_eq!(c.attained_gpu_seconds, 80.0);
    c.step(app, 20.0, 10.0, 0.0);
    assert_eq!((c.progress, c.restarting_for_s), (0.0, 0.0));
    let s = c.step(app, 30.0, 10.0, 0.0);
    let (rate, _) = c.observed_step(app).expect("placed");
    assert!((s - 10.0 * rate).abs() < 1e-9);
    c.reallocate(app, vec![], 30.0, None);
    assert_eq!(c.observed_step(app), None);
    assert_eq!(c.step(app, 40.0, 60.0, 0.0), 0.0);
    assert_eq!(c.restarts, 0);
}

#[test]
fn interference_slows_goodput() {
    let app = &apps()["cifar10"];
    let mut a = SimJob::new("a", app, 0.0, 8, 1024);
    a.reallocate(app, vec![4, 4], 0.0, None);
    let mut b = a.clone();
    let sa = a.step(app, 0.0, 50.0, 0.0);
    let sb = b.step(app, 0.0, 50.0, 0.5);
    assert!((sb - sa / 2.0).abs() < 1e-9 && (b.progress - a.progress / 2.0).abs() < 1e-9);
}

/// A shadow variant: compute-only steps (the trace's step less its sync), not slowed by
/// interference, and its statistical progress per sample divided by the penalty.
#[test]
fn shadow_variants_run_compute_only_steps_at_the_measured_penalty() {
    let app = &apps()["cifar10"];
    let mut ring = SimJob::new("r", app, 0.0, 8, 1024);
    ring.reallocate(app, vec![4, 4], 0.0, None);
    let mut shadow = ring.clone();
    shadow.shadow = Some(converge_common::ShadowAlgorithm::Easgd);
    let (step, sync) = app.throughput(&[4, 4], f64::from(ring.atomic_bsz()));
    assert!(sync > 0.0);
    let (_, observed) = shadow.observed_step(app).unwrap();
    assert!((observed - (step - sync) * f64::from(ring.accum_steps() + 1)).abs() < 1e-12);
    let mut slowed = shadow.clone();
    let (ring0, shadow0) = (ring.clone(), shadow.clone());
    let s_ring = ring.step(app, 0.0, 50.0, 0.0);
    let s_shadow = shadow.step(app, 0.0, 50.0, 0.0);
    let s_slowed = slowed.step(app, 0.0, 50.0, 0.5);
    assert!(s_shadow > s_ring);
    assert!((s_slowed - s_shadow).abs() < 1e-9);
    // Progress per sample within one epoch: the ring's divided by S-EASGD's penalty.
    let (mut ring, mut shadow) = (ring0, shadow0);
    let (p_ring, p_shadow) = (ring.progress, shadow.progress);
    let (e_ring, e_shadow) = (ring.epoch, shadow.epoch);
    let s_ring = ring.step(app, 50.0, 0.5, 0.0);
    let s_shadow = shadow.step(app, 50.0, 0.5, 0.0);
    assert_eq!((ring.epoch, shadow.epoch), (e_ring, e_shadow));
    let ratio = ((ring.progress - p_ring) / s_ring) / ((shadow.progress - p_shadow) / s_shadow);
    assert!(
        (ratio - converge_sched::shadow::PENALTY_EASGD).abs() < 1e-9,
        "{ratio}"
    );
}

#[test]
fn oracle_matches_step() {
    let app = &apps()["imagenet"];
    let mut job = SimJob::new("i", app, 0.0, 16, 3200);
    assert!((job.remaining_progress(app) - app.progress(90)).abs() < 1e-9);
    let rate = job.progress_rate(app, 16, 4);
    job.reallocate(app, vec![4, 4, 4, 4], 0.0, None);
    job.step(app, 0.0, 100.0, 0.0);
    assert!((job.progress - 100.0 * rate).abs() < 1e-9 * job.progress);
    assert!((job.remaining_progress(app) - (app.progress(90) - job.progress)).abs() < 1e-6);
    assert_eq!(job.progress_rate(app, 0, 4), 0.0);
    assert!(job.progress_rate(app, 32, 4) > rate);
}

/// A GPU type whose measurements go to larger micro-batches than the base ones (as the
/// Sia artifact's A100 traces do): with `micro_batch_per_type` its jobs run them, fewer
/// accumulation steps for the same total; without it, and on types not loaded, the base
/// limit holds. Specs are told the type's limit where it differs.
#[test]
fn a_type_measured_with_larger_micro_batches_runs_them() {
    let mut app = apps()["cifar10"].clone();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("cifar10")).unwrap();
    for file in ["placements", "scalability"] {
        let text = std::fs::read_to_string(traces("cifar10").join(format!("{file}.csv"))).unwrap();
        let mut lines = text.lines();
        let header = lines.next().unwrap();
        let columns: Vec<&str> = header.split(',').collect();
        let mut big = format!("{header}\n");
        for line in lines.filter(|l| !l.trim().is_empty()) {
            let cells: Vec<String> = line
                .split(',')
                .zip(&columns)
                .map(|(cell, column)| match *column {
                    "local_bsz" => (cell.trim().parse::<u32>().unwrap() * 4).to_string(),
                    _ => cell.to_string(),
                })
                .collect();
            big += &format!("{}\n", cells.join(","));
        }
        std::fs::write(
            dir.path().join("cifar10").join(format!("{file}-big.csv")),
            big,
        )
        .unwrap();
    }
    app.load_gpu_type(dir.path(), "big").unwrap();
    let base = app.max_local_bsz;
    let measured = 4 * app.steps.local_bsz.1;
    let big = ["big".to_string()];
    assert!(measured > base);
    assert_eq!(app.max_local_bsz_on(&big), base);
    assert!(app.max_local_bsz_by_type().is_empty());
    let total = 2 * 2 * base;
    assert_eq!(
        app.batch_config_on(&big, total, 2),
        app.batch_config(total, 2)
    );

    app.micro_batch_per_type = true;
    assert_eq!(app.max_local_bsz_on(&big), measured);
    assert_eq!(app.max_local_bsz_on(&["other".to_string()]), base);
    assert_eq!(app.max_local_bsz_on(&[]), base);
    assert_eq!(
        app.max_local_bsz_by_type(),
        [("big".to_string(), measured)].into()
    );
    let (_, accum_base) = app.batch_config(total, 2);
    let (atomic, accum_big) = app.batch_config_on(&big, total, 2);
    assert_eq!((accum_base, accum_big), (1, 0));
    assert_eq!(atomic, 2 * base);
}

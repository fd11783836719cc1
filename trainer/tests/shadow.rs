//! End-to-end tests of the ShadowSync mode (`--shadow`) of the `converge-trainer` binary:
//! workers (and S-EASGD shards) as real processes on loopback, checkpoints resumed at other
//! world sizes and in other modes, termination, and sync peers that send bad data.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::{
    checkpoint, codes, expect_codes, follow_progress, free_port, progress, rank_command, show_all,
    signal, stderr, wait_all, wait_for_checkpoint_of,
};

/// optdigits has 3,823 training rows; softmax has 650 parameters.
const OPTDIGITS_ROWS: u64 = 3823;
const SOFTMAX_PARAMS: usize = 650;

/// Spawns `ranks` of one generation of an optdigits job meeting at 127.0.0.1:`port`.
fn spawn(
    ckpt: &Path,
    world: usize,
    num_ps: usize,
    generation: u64,
    port: u16,
    ranks: impl Iterator<Item = usize>,
    args: &[&str],
) -> Vec<(usize, Child)> {
    ranks
        .map(|rank| {
            let mut cmd = rank_command(
                ckpt,
                "shadow-test",
                rank,
                world,
                num_ps,
                generation,
                port,
                args,
            );
            (rank, cmd.spawn().unwrap())
        })
        .collect()
}

/// Spawns every rank of one generation, the last first.
fn spawn_all(
    ckpt: &Path,
    world: usize,
    num_ps: usize,
    generation: u64,
    args: &[&str],
) -> Vec<(usize, Child)> {
    let ranks = (0..world).rev();
    spawn(ckpt, world, num_ps, generation, free_port(), ranks, args)
}

/// Runs one generation to its end (all ranks within `limit`); outputs in rank order.
fn run(
    ckpt: &Path,
    world: usize,
    num_ps: usize,
    generation: u64,
    args: &[&str],
    limit: Duration,
) -> Vec<Output> {
    wait_all(spawn_all(ckpt, world, num_ps, generation, args), limit)
}

/// Spawns all `world` ranks with the `shadow` options, training slowly (200 epochs, 2 ms a
/// step, a line every 5 steps), then sends SIGTERM to the ranks `targets` once
/// `when_to_stop` returns; the outputs in rank order and rank 0's progress lines.
fn terminated(
    ckpt: &Path,
    world: usize,
    num_ps: usize,
    generation: u64,
    shadow: &[&str],
    targets: &[usize],
    when_to_stop: impl FnOnce(),
) -> (Vec<Output>, Vec<Value>) {
    let slowly = [
        "--epochs",
        "200",
        "--step-delay-ms",
        "2",
        "--log-every",
        "5",
    ];
    let args = [shadow, &slowly].concat();
    let mut children = spawn_all(ckpt, world, num_ps, generation, &args);
    children.sort_by_key(|(r, _)| *r);
    let (_, lines) = follow_progress(children[0].1.stdout.take().unwrap());
    when_to_stop();
    for rank in targets {
        let _ = signal(children[*rank].1.id(), "-TERM");
    }
    let outs = wait_all(children, Duration::from_secs(60));
    (outs, lines.join().unwrap())
}

/// S-MA with two workers, then S-BMUF with three (two Hogwild threads each) resuming from
/// its checkpoint, then the ring mode with one: each generation continues the job's samples
/// and steps; the shadow progress lines carry the synchronization figures, and S-BMUF
/// checkpoints its velocity.
#[test]
fn shadow_jobs_train_and_resume_at_other_world_sizes_and_modes() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let limit = Duration::from_secs(120);
    let outs = run(&ckpt, 2, 0, 1, &["--shadow", "ma", "--epochs", "2"], limit);
    expect_codes("S-MA", &outs, &[Some(0), Some(0)]);
    let lines = progress(&outs[0].stdout);
    assert!(lines.len() >= 3, "{lines:?}");
    assert!(progress(&outs[1].stdout).is_empty(), "only rank 0 reports");
    let last = lines.last().unwrap();
    assert!(
        last["samples"].as_u64().unwrap() >= 2 * OPTDIGITS_ROWS,
        "{last}"
    );
    assert!(last["eval_loss"].as_f64().unwrap() < 1.0, "{last}");
    for l in &lines {
        assert_eq!(l["sync_s"].as_f64(), Some(0.0), "{l}");
        assert!(l["sync_rounds_per_s"].as_f64().unwrap() >= 0.0, "{l}");
    }
    assert!(
        lines.iter().any(|l| l["model_gap"].as_f64().is_some()),
        "some line reports the gap: {lines:?}"
    );
    let first = lines.first().unwrap()["loss"].as_f64().unwrap();
    assert!(last["loss"].as_f64().unwrap() < first, "{first} -> {last}");
    let c1 = checkpoint(&ckpt);
    assert_eq!(c1["world_size"], 2);
    assert!(c1.get("block_velocity").is_none(), "S-MA keeps no velocity");
    let (step1, samples1) = (
        c1["step"].as_u64().unwrap(),
        c1["samples"].as_u64().unwrap(),
    );

    let outs = run(
        &ckpt,
        3,
        0,
        2,
        &[
            "--shadow",
            "bmuf",
            "--block-momentum",
            "0.3",
            "--hogwild-threads",
            "2",
            "--epochs",
            "3",
        ],
        limit,
    );
    expect_codes("S-BMUF", &outs, &[Some(0); 3]);
    assert!(stderr(&outs[1]).contains(&format!("resumed from checkpoint at step {step1}")));
    assert!(stderr(&outs[0]).contains("block momentum η = 0.3"));
    let e2 = stderr(&outs[2]);
    assert!(e2.contains("2 training thread(s)"), "{e2}");
    let c2 = checkpoint(&ckpt);
    assert_eq!(
        (c2["world_size"].as_u64(), c2["generation"].as_u64()),
        (Some(3), Some(2))
    );
    assert!(c2["step"].as_u64().unwrap() > step1);
    assert!(c2["samples"].as_u64().unwrap() >= 3 * OPTDIGITS_ROWS.max(samples1 / 2));
    let v = c2["block_velocity"].as_array().expect("velocity");
    assert_eq!(v.len(), SOFTMAX_PARAMS);
    assert!(v.iter().any(|x| x.as_f64().unwrap() != 0.0));

    let outs = run(&ckpt, 1, 0, 3, &["--epochs", "3.5"], limit);
    expect_codes("ring", &outs, &[Some(0)]);
    let c3 = checkpoint(&ckpt);
    assert!(c3["samples"].as_u64().unwrap() >= (3.5 * OPTDIGITS_ROWS as f64) as u64);
    assert!(c3.get("block_velocity").is_none());
}

/// S-EASGD with two workers and a shard: SIGTERM to every rank mid-training ends all with
/// 143 and a checkpoint of the central copy; a one-worker S-MA run resumes from it.
#[test]
fn easgd_terminates_with_a_checkpoint_and_resumes_in_another_algorithm() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    // Wait for a few progress lines from rank 0, then terminate every rank.
    let (outs, lines) = terminated(
        &ckpt,
        3,
        1,
        4,
        &["--shadow", "easgd", "--elastic-alpha", "0.4"],
        &[0, 1, 2],
        || {
            let started = Instant::now();
            loop {
                std::thread::sleep(Duration::from_millis(300));
                if ckpt.join("checkpoint.json").exists()
                    || started.elapsed() > Duration::from_secs(8)
                {
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(500));
        },
    );
    expect_codes("S-EASGD", &outs, &[Some(143); 3]);
    assert!(stderr(&outs[2]).contains("S-EASGD shard 0/1"));
    assert!(!lines.is_empty());
    assert!(
        lines
            .iter()
            .all(|l| l["sync_rounds_per_s"].as_f64().is_some())
    );
    let c = checkpoint(&ckpt);
    let samples = c["samples"].as_u64().unwrap();
    assert!(samples > 0 && samples < 200 * OPTDIGITS_ROWS, "{samples}");
    assert_eq!(c["generation"], 4);

    let epochs = format!("{}", samples as f64 / OPTDIGITS_ROWS as f64 + 0.5);
    let outs = run(
        &ckpt,
        1,
        0,
        5,
        &["--shadow", "ma", "--epochs", &epochs],
        Duration::from_secs(60),
    );
    expect_codes("resume", &outs, &[Some(0)]);
    assert!(stderr(&outs[0]).contains("resumed from checkpoint"));
    assert!(checkpoint(&ckpt)["samples"].as_u64().unwrap() > samples);
}

/// S-BMUF with two workers terminated mid-training, once by SIGTERM to rank 1 only (rank 0
/// learns it from a round, and every worker stops before the final round) and once to both
/// (each stops before its next round, which is then the final one): both ranks end with 143,
/// and rank 0's last line and checkpoint hold the consensus at the same exact sample count.
#[test]
fn ring_shadow_jobs_end_on_a_termination_of_any_rank() {
    for targets in [vec![1], vec![0, 1]] {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("ckpt");
        let (outs, lines) = terminated(&ckpt, 2, 0, 6, &["--shadow", "bmuf"], &targets, || {
            std::thread::sleep(Duration::from_millis(1500))
        });
        expect_codes(&format!("SIGTERM to {targets:?}"), &outs, &[Some(143); 2]);
        let err = stderr(&outs[0]);
        assert!(err.contains("checkpointed the synchronized model"), "{err}");
        let last = lines.last().expect("progress lines");
        let c = checkpoint(&ckpt);
        assert_eq!(c["samples"], last["samples"], "{last}");
        let samples = c["samples"].as_u64().unwrap();
        assert!(samples > 0 && samples < 200 * OPTDIGITS_ROWS, "{samples}");
        assert!(last["eval_loss"].as_f64().unwrap().is_finite(), "{last}");
        assert_eq!(
            c["block_velocity"].as_array().map(Vec::len),
            Some(SOFTMAX_PARAMS)
        );
    }
}

/// Out-of-range ShadowSync parameters are refused with exit code 2 and a clear reason.
#[test]
fn out_of_range_shadow_parameters_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (args, want) in [
        (
            vec!["--shadow", "easgd", "--elastic-alpha", "1.5"],
            "--elastic-alpha must be in (0, 1]",
        ),
        (
            vec!["--shadow", "easgd", "--elastic-alpha", "0"],
            "--elastic-alpha must be in (0, 1]",
        ),
        (
            vec!["--shadow", "bmuf", "--block-momentum", "1"],
            "--block-momentum must be in [0, 1)",
        ),
        (
            vec!["--shadow", "easgd"],
            "set CONVERGE_NUM_PS to 1 or more",
        ),
    ] {
        let out = common::trainer(dir.path(), "bad")
            .args(["--dataset", "optdigits"])
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = stderr(&out);
        assert!(
            err.contains("refused") && err.contains(want),
            "{args:?}: {err}"
        );
    }
}

/// How the fake rank 1 misbehaves in its first synchronization round.
#[derive(Clone, Copy, Debug)]
enum Misbehaviour {
    /// A frame header, five bytes of values, then the connection closes.
    Truncated,
    /// A complete round whose values are NaN.
    NotFinite,
}

fn frame(seq: u64, values: &[f64]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&(values.len() as u64).to_le_bytes());
    for v in values {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b
}

fn read_frame(s: &mut TcpStream, len: usize) -> Vec<f64> {
    let mut b = vec![0u8; 16 + 8 * len];
    s.read_exact(&mut b).unwrap();
    b[16..]
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Rank 1 of a two-worker S-MA job, speaking the wire protocol by hand: it joins the
/// rendezvous and the ring, takes part in the broadcast of rank 0's state, then sends bad
/// data in the first synchronization round.
fn fake_rank1(port: u16, generation: u64, how: Misbehaviour) {
    let ring = TcpListener::bind("127.0.0.1:0").unwrap();
    let ring_port = ring.local_addr().unwrap().port();
    let deadline = Instant::now() + Duration::from_secs(30);
    let master = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("cannot reach rank 0: {e}"),
        }
    };
    let hello = serde_json::json!({
        "rank": 1, "world_size": 2, "generation": generation, "ring_port": ring_port, "num_ps": 0
    });
    (&master)
        .write_all(format!("{hello}\n").as_bytes())
        .unwrap();
    let mut reply = String::new();
    BufReader::new(&master).read_line(&mut reply).unwrap();
    let reply: Value = serde_json::from_str(&reply).unwrap();
    let rank0 = reply["addresses"][0].as_str().unwrap().to_string();
    let mut out = TcpStream::connect(rank0).unwrap();
    let mut hs = b"CVRG".to_vec();
    hs.extend_from_slice(&1u32.to_le_bytes());
    hs.extend_from_slice(&generation.to_le_bytes());
    out.write_all(&hs).unwrap();
    let (mut inc, _) = ring.accept().unwrap();
    let mut theirs = [0u8; 16];
    inc.read_exact(&mut theirs).unwrap();
    // The broadcast of rank 0's state: 6 + 2p values and the 5 of the smoothed gradient
    // statistics, rank 1 contributes zeros.
    let n = 11 + 2 * SOFTMAX_PARAMS;
    let (c0, c1) = (n / 2, n - n / 2);
    out.write_all(&frame(1, &vec![0.0; c1])).unwrap();
    let chunk0 = read_frame(&mut inc, c0);
    out.write_all(&frame(2, &chunk0)).unwrap();
    read_frame(&mut inc, c1);
    // The first round: p + 3 values.
    let n = SOFTMAX_PARAMS + 3;
    let (c0, c1) = (n / 2, n - n / 2);
    match how {
        Misbehaviour::Truncated => {
            let f = frame(3, &vec![1.0; c1]);
            out.write_all(&f[..16 + 5]).unwrap();
        }
        Misbehaviour::NotFinite => {
            out.write_all(&frame(3, &vec![f64::NAN; c1])).unwrap();
            read_frame(&mut inc, c0);
            out.write_all(&frame(4, &vec![f64::NAN; c0])).unwrap();
            read_frame(&mut inc, c1);
        }
    }
    drop(out);
    drop(inc);
}

/// A sync peer that sends a truncated frame, or non-finite values, is dropped with the
/// reason in rank 0's log; rank 0 trains on with its local model, reports, checkpoints and
/// exits 0.
#[test]
fn a_sync_peer_sending_bad_data_is_dropped_and_the_worker_trains_on() {
    for how in [Misbehaviour::Truncated, Misbehaviour::NotFinite] {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("ckpt");
        let port = free_port();
        let children = spawn(
            &ckpt,
            2,
            0,
            7,
            port,
            std::iter::once(0),
            &["--shadow", "ma", "--epochs", "2", "--log-every", "5"],
        );
        let peer = std::thread::spawn(move || fake_rank1(port, 7, how));
        let outs = wait_all(children, Duration::from_secs(60));
        peer.join().unwrap();
        let err = stderr(&outs[0]);
        if outs[0].status.code() != Some(0) {
            show_all(&format!("{how:?}"), &outs);
            panic!("{how:?}: exit code {:?}", outs[0].status.code());
        }
        let want = match how {
            Misbehaviour::Truncated => "the peer closed the connection",
            Misbehaviour::NotFinite => "malformed data from a peer",
        };
        assert!(
            err.contains("dropping the synchronization") && err.contains(want),
            "{how:?}: {err}"
        );
        assert!(
            err.contains("ending with this worker's local model"),
            "{err}"
        );
        let lines = progress(&outs[0].stdout);
        let last = lines.last().unwrap();
        // Rank 0 trained its own share (half of two epochs) on its local model.
        assert!(
            last["samples"].as_u64().unwrap() >= OPTDIGITS_ROWS,
            "{last}"
        );
        assert!(last["eval_loss"].as_f64().unwrap().is_finite());
        assert_eq!(last["sync_rounds_per_s"].as_f64(), Some(0.0), "{last}");
        let c = checkpoint(&ckpt);
        assert!(
            c["params"]
                .as_array()
                .unwrap()
                .iter()
                .all(|v| v.as_f64().is_some_and(f64::is_finite))
        );
    }
}

/// Generation fencing as in the other modes: a stale generation stops at once without
/// writing; a running one that finds a newer generation's checkpoint at a periodic save
/// stops without overwriting it.
#[test]
fn stale_shadow_generations_are_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let limit = Duration::from_secs(60);
    let outs = run(&ckpt, 2, 0, 3, &["--shadow", "ma", "--epochs", "1"], limit);
    assert_eq!(codes(&outs), vec![Some(0), Some(0)]);
    let before = std::fs::read(ckpt.join("checkpoint.json")).unwrap();
    let outs = run(&ckpt, 2, 0, 2, &["--shadow", "ma", "--epochs", "2"], limit);
    for o in &outs {
        assert_ne!(o.status.code(), Some(0));
        assert!(stderr(o).contains("fenced"), "{}", stderr(o));
        assert!(progress(&o.stdout).is_empty());
    }
    assert_eq!(std::fs::read(ckpt.join("checkpoint.json")).unwrap(), before);

    // One worker of generation 4 checkpoints every round of its periodic saves; a checkpoint
    // of generation 9 appears: it stops without overwriting it.
    let mut children = spawn(
        &ckpt,
        1,
        0,
        4,
        free_port(),
        std::iter::once(0),
        &[
            "--shadow",
            "ma",
            "--epochs",
            "500",
            "--checkpoint-every",
            "0.2",
            "--step-delay-ms",
            "1",
        ],
    );
    wait_for_checkpoint_of(&ckpt, 4, Duration::from_secs(20), "no periodic checkpoint");
    let mut newer = checkpoint(&ckpt);
    newer["generation"] = 9.into();
    let tmp = ckpt.join("newer.tmp");
    std::fs::write(&tmp, serde_json::to_vec(&newer).unwrap()).unwrap();
    std::fs::rename(&tmp, ckpt.join("checkpoint.json")).unwrap();
    let written = std::fs::read(ckpt.join("checkpoint.json")).unwrap();
    let outs = wait_all(std::mem::take(&mut children), Duration::from_secs(30));
    assert_ne!(outs[0].status.code(), Some(0));
    assert!(stderr(&outs[0]).contains("fenced"), "{}", stderr(&outs[0]));
    assert_eq!(
        std::fs::read(ckpt.join("checkpoint.json")).unwrap(),
        written
    );
}

//! The ShadowSync training loop ([`crate::shadow`] documents the contract): the training
//! threads, the background (shadow) thread, progress lines and checkpoints.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::thread;

use super::*;
use crate::shadow::{
    self, BlockMomentum, EasgdClient, EasgdInit, RoundIn, SharedParams, relative_gap, ring_round,
};

/// An S-EASGD shard: checks the options, then holds its slice of the central copy until the
/// workers finish or stop. It reads neither the dataset nor the checkpoint.
pub(super) fn serve_easgd_shard(
    args: &Args,
    env: &WorkerEnv,
    stop: &Arc<AtomicBool>,
) -> Result<Outcome> {
    args.validate().map_err(refuse)?;
    args.check_shadow_env(env).map_err(refuse)?;
    eprintln!(
        "{}",
        shard_banner(args, env, "S-EASGD shard (central copy)")
    );
    Ok(shadow::run_easgd_shard(&ps_config(args, env), stop)?.into())
}

/// How a worker synchronizes in the background.
enum Background {
    /// Nobody to synchronize with (one S-MA/S-BMUF worker).
    Alone,
    /// S-MA (no block momentum) or S-BMUF over the ring.
    Ring(Ring, Option<BlockMomentum>),
    /// S-EASGD with the shards.
    Easgd(EasgdClient, f64),
}

/// The fixed facts of this generation.
struct Ctx {
    step0: u64,
    samples0: u64,
    seed: u64,
    last_loss0: Option<f64>,
    threads: usize,
    workers: usize,
    /// Samples this worker trains on in this generation.
    share: u64,
    /// Whether a background thread synchronizes (not alone).
    synced: bool,
}

/// What the training threads, the shadow thread and the reporter share.
struct Shared {
    params: SharedParams,
    /// Set to stop the training threads (the job is ending).
    halt: AtomicBool,
    /// Training threads still running.
    running: AtomicUsize,
    /// Samples claimed by this worker's threads in this generation.
    samples: AtomicU64,
    /// Local steps of this worker's threads in this generation.
    steps: AtomicU64,
    diverged: AtomicBool,
    /// Thread 0's momentum buffer (the checkpoint's).
    momentum0: Mutex<Vec<f64>>,
    /// Training loss sum and sample count since the previous progress line.
    window: Mutex<(f64, u64)>,
    sync: Mutex<SyncWindow>,
    /// The last reported loss and sample count (rank 0).
    reported: Mutex<(Option<f64>, u64)>,
}

struct SyncWindow {
    rounds: u64,
    gap_sum: f64,
    since: Instant,
    /// Samples of the other workers as of the last round.
    others: u64,
    /// This worker's samples at the last round.
    own_at_round: u64,
    lost: bool,
}

/// The consensus a final round agreed on.
struct Final {
    params: Vec<f64>,
    momentum: Vec<f64>,
    velocity: Option<Vec<f64>>,
    /// Samples of all workers in this generation.
    samples: u64,
    stopped: bool,
}

impl Trainer<'_> {
    /// Trains with ShadowSync `algo` until every worker finished its share, a termination, or
    /// a failure.
    pub(super) fn train_shadow(self, algo: ShadowAlgo) -> Result<Outcome> {
        let (args, env) = (self.args, self.env);
        let rank0 = env.rank == 0;
        let workers = env.workers();
        let p = self.model.num_params();
        let easgd = algo == ShadowAlgo::Easgd;
        let mut state = if rank0 || !easgd {
            self.initial_state()?
        } else {
            State {
                step: 0,
                samples: 0,
                seed: args.seed,
                last_loss: None,
                params: Vec::new(),
                momentum: vec![0.0; p],
                momentum_fresh: true,
                scaling: SmoothedStats::default(),
            }
        };
        let mut velocity = if algo == ShadowAlgo::Bmuf && rank0 {
            match &self.ckpt_dir {
                Some(dir) => Checkpoint::read(dir)
                    .ok()
                    .flatten()
                    .and_then(|c| c.block_velocity),
                None => None,
            }
        } else {
            None
        };
        let background = match algo {
            ShadowAlgo::Easgd => {
                let alpha = args.elastic_alpha.unwrap_or(shadow::default_alpha(workers));
                let init = rank0.then_some(EasgdInit {
                    step: state.step,
                    samples: state.samples,
                    seed: state.seed,
                    last_loss: state.last_loss,
                    params: &state.params,
                    alpha,
                    forward: !args.elastic_plain,
                });
                let (client, start) =
                    EasgdClient::connect(&ps_config(args, env), None, p, init, self.stop.clone())
                        .context("rendezvous with the S-EASGD shards failed")?;
                state.step = start.step;
                state.samples = start.samples;
                state.seed = start.seed;
                state.last_loss = start.last_loss;
                state.params = start.center;
                eprintln!(
                    "{}: S-EASGD with {} shard(s), moving rate α = {alpha}",
                    self.who, env.num_ps
                );
                Background::Easgd(client, alpha)
            }
            _ if workers == 1 => Background::Alone,
            _ => {
                let cfg = RingConfig {
                    rank: env.rank,
                    world_size: env.world_size,
                    generation: env.generation,
                    master_addr: env.master_addr.clone(),
                    master_port: env.master_port,
                    rendezvous_timeout: Duration::from_secs_f64(args.rendezvous_timeout),
                    io_timeout: RING_IO_TIMEOUT,
                };
                let mut ring =
                    Ring::connect(&cfg, self.stop.clone()).context("rendezvous failed")?;
                broadcast_state(&mut ring, &mut state, &self.who)
                    .context("broadcasting the initial state failed")?;
                let bm = if algo == ShadowAlgo::Bmuf {
                    // Rank 0's block velocity (from its checkpoint) reaches every worker.
                    let mut v = velocity.take().unwrap_or_else(|| vec![0.0; p]);
                    if !rank0 {
                        v.fill(0.0);
                    }
                    ring.all_reduce_sum(&mut v)
                        .context("broadcasting the block velocity failed")?;
                    let eta = args
                        .block_momentum
                        .unwrap_or(shadow::default_block_momentum(workers));
                    let zeta = args.block_lr.unwrap_or(1.0 - eta);
                    eprintln!(
                        "{}: S-BMUF block momentum η = {eta}, block learning rate ζ = {zeta}{}",
                        self.who,
                        if args.block_nesterov {
                            ", Nesterov"
                        } else {
                            ""
                        }
                    );
                    Some(BlockMomentum {
                        global: state.params.clone(),
                        velocity: v,
                        eta,
                        zeta,
                        nesterov: args.block_nesterov,
                    })
                } else {
                    None
                };
                Background::Ring(ring, bm)
            }
        };
        if let Background::Ring(_, Some(bm)) = &background {
            state.params = bm.start_point();
        }
        let target_samples = (args.epochs * self.data.train.rows as f64).ceil() as u64;
        let remaining = target_samples.saturating_sub(state.samples);
        let ctx = Ctx {
            step0: state.step,
            samples0: state.samples,
            seed: state.seed,
            last_loss0: state.last_loss,
            threads: args.hogwild_threads,
            workers,
            share: remaining.div_ceil(workers as u64),
            synced: !matches!(background, Background::Alone),
        };
        if state.step > 0 {
            eprintln!(
                "{} generation {} resumed from checkpoint at step {} (samples {})",
                self.who, env.generation, state.step, state.samples
            );
        }
        eprintln!(
            "{} generation {}: {algo} from step {} (samples {}), {} training thread(s), this worker's share {} samples",
            self.who, env.generation, state.step, state.samples, ctx.threads, ctx.share
        );
        let shared = Shared {
            params: SharedParams::new(&state.params),
            halt: AtomicBool::new(false),
            running: AtomicUsize::new(ctx.threads),
            samples: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            diverged: AtomicBool::new(false),
            momentum0: Mutex::new(state.momentum.clone()),
            window: Mutex::new((0.0, 0)),
            sync: Mutex::new(SyncWindow {
                rounds: 0,
                gap_sum: 0.0,
                since: Instant::now(),
                others: 0,
                own_at_round: 0,
                lost: false,
            }),
            reported: Mutex::new((state.last_loss, state.samples)),
        };
        let momentum = state.momentum.clone();
        let fin = thread::scope(|s| {
            let (me, sh, ctx) = (&self, &shared, &ctx);
            let trainers: Vec<_> = (0..ctx.threads)
                .map(|t| {
                    let m = momentum.clone();
                    s.spawn(move || me.train_thread(sh, ctx, t, m))
                })
                .collect();
            let shadow = match background {
                Background::Alone => {
                    // Nobody to synchronize with: the local model is the job's, and rank 0
                    // checkpoints it every --checkpoint-every seconds as ring mode does.
                    if me.env.rank == 0 && me.ckpt_dir.is_some() {
                        s.spawn(move || me.checkpoint_alone(sh, ctx));
                    }
                    None
                }
                Background::Ring(ring, bm) => {
                    Some(s.spawn(move || me.shadow_ring(sh, ctx, ring, bm)))
                }
                Background::Easgd(client, alpha) => {
                    Some(s.spawn(move || me.shadow_easgd(sh, ctx, client, alpha)))
                }
            };
            for t in trainers {
                if t.join().is_err() {
                    sh.diverged.store(true, Ordering::SeqCst);
                }
            }
            shadow.and_then(|h| h.join().ok().flatten())
        });
        if shared.diverged.load(Ordering::SeqCst) {
            bail!("training diverged (non-finite loss or gradient); try a smaller --lr");
        }
        let steps = ctx.step0 + shared.steps.load(Ordering::SeqCst) / ctx.threads as u64;
        let (outcome, final_state, velocity) = match fin {
            Some(f) => {
                let st = State {
                    step: steps,
                    samples: ctx.samples0 + f.samples,
                    seed: ctx.seed,
                    last_loss: shared.reported.lock().expect("not poisoned").0,
                    params: f.params,
                    momentum: f.momentum,
                    momentum_fresh: true,
                    scaling: SmoothedStats::default(),
                };
                let outcome = if f.stopped {
                    Outcome::Terminated
                } else {
                    Outcome::Completed
                };
                (outcome, st, f.velocity)
            }
            None => {
                if ctx.synced {
                    eprintln!(
                        "{}: synchronization was lost; ending with this worker's local model",
                        self.who
                    );
                }
                let others = shared.sync.lock().expect("not poisoned").others;
                let st = State {
                    step: steps,
                    samples: ctx.samples0 + shared.samples.load(Ordering::SeqCst) + others,
                    seed: ctx.seed,
                    last_loss: shared.reported.lock().expect("not poisoned").0,
                    params: shared.params.to_vec(),
                    momentum: shared.momentum0.lock().expect("not poisoned").clone(),
                    momentum_fresh: true,
                    scaling: SmoothedStats::default(),
                };
                let outcome = if self.stop.load(Ordering::SeqCst) {
                    Outcome::Terminated
                } else {
                    Outcome::Completed
                };
                (outcome, st, None)
            }
        };
        if rank0 {
            let completed = outcome == Outcome::Completed;
            let st = final_state;
            self.shadow_report(&shared, &ctx, Some(&st), true);
            self.save_with(&st, velocity.as_deref())
                .context(if completed {
                    "final checkpoint failed"
                } else {
                    "checkpoint on termination failed"
                })?;
            if self.ckpt_dir.is_some() {
                eprintln!(
                    "{}: checkpointed the {} model at step {} (samples {})",
                    self.who,
                    if ctx.synced { "synchronized" } else { "local" },
                    st.step,
                    st.samples
                );
            }
        }
        Ok(outcome)
    }

    /// Training thread `t`: local SGD steps on the shared model until its worker's share is
    /// done, the job halts or a termination signal.
    fn train_thread(&self, sh: &Shared, ctx: &Ctx, t: usize, mut momentum: Vec<f64>) {
        let (args, env) = (self.args, self.env);
        let b = self.per_worker;
        let subs = (ctx.workers * ctx.threads) as u64;
        let sub = (env.rank * ctx.threads + t) as u64;
        let mut order = DataOrder::new(ctx.seed, self.data.train.rows);
        let p = self.model.num_params();
        let (mut x, mut g) = (vec![0.0; p], vec![0.0; p]);
        let delay = Duration::from_millis(args.step_delay_ms);
        let mu = args.momentum;
        let mut k = 0u64;
        loop {
            if sh.halt.load(Ordering::SeqCst) || self.stop.load(Ordering::SeqCst) {
                break;
            }
            let steps = ctx.step0 + sh.steps.load(Ordering::SeqCst) / ctx.threads as u64;
            if args.max_steps.is_some_and(|m| steps >= m) {
                break;
            }
            let claimed = sh
                .samples
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| {
                    (c < ctx.share).then_some(c + b as u64)
                });
            if claimed.is_err() {
                break;
            }
            let idx = order.range(ctx.samples0 + (k * subs + sub) * b as u64, b);
            sh.params.read_into(&mut x);
            g.fill(0.0);
            let loss = self.model.loss_and_grad(&x, &self.data.train, &idx, &mut g);
            if !loss.is_finite() || g.iter().any(|v| !v.is_finite()) {
                sh.diverged.store(true, Ordering::SeqCst);
                sh.halt.store(true, Ordering::SeqCst);
                break;
            }
            let n = idx.len() as f64;
            let mut m0 = (t == 0).then(|| sh.momentum0.lock().expect("not poisoned"));
            let m: &mut Vec<f64> = match &mut m0 {
                Some(guard) => guard,
                None => &mut momentum,
            };
            for (m, g) in m.iter_mut().zip(&g) {
                *m = mu * *m + g / n;
            }
            sh.params.add_scaled(m, -self.lr);
            drop(m0);
            if !delay.is_zero() {
                thread::sleep(delay);
            }
            k += 1;
            sh.steps.fetch_add(1, Ordering::SeqCst);
            {
                let mut w = sh.window.lock().expect("not poisoned");
                w.0 += loss;
                w.1 += idx.len() as u64;
            }
            if env.rank == 0 && t == 0 && k.is_multiple_of(args.log_every) {
                let evaluate = args.eval_every > 0 && k.is_multiple_of(args.eval_every);
                self.shadow_report(sh, ctx, None, evaluate);
            }
        }
        sh.running.fetch_sub(1, Ordering::SeqCst);
    }

    /// Rank 0's progress line; `fin` is the final state (evaluated on its parameters).
    fn shadow_report(&self, sh: &Shared, ctx: &Ctx, fin: Option<&State>, evaluate: bool) {
        let (window_loss, window_n) = std::mem::take(&mut *sh.window.lock().expect("not poisoned"));
        let own = sh.samples.load(Ordering::SeqCst);
        let (rounds, gap, elapsed, others) = {
            let mut w = sh.sync.lock().expect("not poisoned");
            // The others' samples since the last round, estimated at this worker's pace
            // (unless synchronization was lost: then only what was last heard).
            let since = if w.lost {
                0
            } else {
                own.saturating_sub(w.own_at_round) * (ctx.workers as u64 - 1)
            };
            // Never more than the other workers' shares.
            let others = (w.others + since).min(ctx.share * (ctx.workers as u64 - 1));
            let out = (w.rounds, w.gap_sum, w.since.elapsed(), others);
            w.rounds = 0;
            w.gap_sum = 0.0;
            w.since = Instant::now();
            out
        };
        let mut reported = sh.reported.lock().expect("not poisoned");
        let loss = if window_n > 0 {
            window_loss / window_n as f64
        } else {
            match reported.0.or(ctx.last_loss0) {
                Some(l) => l,
                None => self.mean_loss(
                    &sh.params.to_vec(),
                    &self.data.train,
                    &strided(self.data.train.rows, EVAL_CAP),
                ),
            }
        };
        let (step, samples, params) = match fin {
            Some(st) => (st.step, st.samples, st.params.clone()),
            None => (
                ctx.step0 + sh.steps.load(Ordering::SeqCst) / ctx.threads as u64,
                ctx.samples0 + own + others,
                Vec::new(),
            ),
        };
        // The final line has the exact count of the final round; the others never go back.
        let samples = if fin.is_some() {
            samples
        } else {
            samples.max(reported.1)
        };
        *reported = (Some(loss), samples);
        drop(reported);
        let eval_loss = evaluate.then(|| {
            let params = if fin.is_some() {
                params
            } else {
                sh.params.to_vec()
            };
            round_to(self.mean_loss(&params, &self.data.test, &self.eval_idx), 6)
        });
        let secs = elapsed.as_secs_f64();
        let line = Progress {
            step,
            samples,
            loss: round_to(loss, 6),
            epoch: round_to(samples as f64 / self.data.train.rows as f64, 4),
            eval_loss,
            sync_s: Some(0.0),
            model_bytes: model_bytes(self.model.num_params()),
            grad_sqr: None,
            grad_var: None,
            sync_rounds_per_s: (ctx.synced && secs > 0.0)
                .then(|| round_to(rounds as f64 / secs, 3)),
            model_gap: (rounds > 0).then(|| significant(gap / rounds as f64)),
        }
        .line();
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }

    /// Records a completed round's figures.
    fn record_round(&self, sh: &Shared, gap: f64, own: u64, total: u64) {
        let mut w = sh.sync.lock().expect("not poisoned");
        w.rounds += 1;
        w.gap_sum += gap;
        w.others = total.saturating_sub(own);
        w.own_at_round = own;
    }

    /// Stops the training threads and waits until they have.
    fn halt_training(&self, sh: &Shared) {
        sh.halt.store(true, Ordering::SeqCst);
        while sh.running.load(Ordering::SeqCst) > 0 {
            thread::sleep(Duration::from_millis(2));
        }
    }

    fn lose_sync(&self, sh: &Shared, what: &str, e: &anyhow::Error) {
        eprintln!(
            "{}: dropping the synchronization ({what}): {e:#}; training on with the local model",
            self.who
        );
        sh.sync.lock().expect("not poisoned").lost = true;
    }

    /// Waits out `--sync-interval-ms` since `last`.
    fn throttle(&self, last: Instant) {
        let gap = Duration::from_millis(self.args.sync_interval_ms);
        if let Some(rest) = gap.checked_sub(last.elapsed()) {
            thread::sleep(rest);
        }
    }

    /// Rank 0's periodic checkpoint of a consensus model.
    fn checkpoint_consensus(
        &self,
        sh: &Shared,
        ctx: &Ctx,
        params: &[f64],
        velocity: Option<&[f64]>,
        samples: u64,
    ) {
        let st = State {
            step: ctx.step0 + sh.steps.load(Ordering::SeqCst) / ctx.threads as u64,
            samples: ctx.samples0 + samples,
            seed: ctx.seed,
            last_loss: sh.reported.lock().expect("not poisoned").0,
            params: params.to_vec(),
            momentum: sh.momentum0.lock().expect("not poisoned").clone(),
            momentum_fresh: true,
            scaling: SmoothedStats::default(),
        };
        if let Err(e) = self.save_with(&st, velocity) {
            eprintln!("{}: warning: periodic checkpoint failed: {e:#}", self.who);
            if e.is::<Fenced>() {
                // A newer generation owns the checkpoint: this one stops.
                sh.halt.store(true, Ordering::SeqCst);
                self.stop.store(true, Ordering::SeqCst);
            }
        }
    }

    /// A single worker's periodic checkpoints of its local model while it trains.
    fn checkpoint_alone(&self, sh: &Shared, ctx: &Ctx) {
        let every = Duration::from_secs_f64(self.args.checkpoint_every);
        let mut last = Instant::now();
        while sh.running.load(Ordering::SeqCst) > 0 {
            thread::sleep(every.min(Duration::from_millis(100)));
            if last.elapsed() >= every && sh.running.load(Ordering::SeqCst) > 0 {
                let own = sh.samples.load(Ordering::SeqCst);
                self.checkpoint_consensus(sh, ctx, &sh.params.to_vec(), None, own);
                last = Instant::now();
            }
        }
    }

    /// S-MA / S-BMUF shadow thread: rounds over the ring until the final round; `None` when
    /// the synchronization was lost.
    fn shadow_ring(
        &self,
        sh: &Shared,
        ctx: &Ctx,
        mut ring: Ring,
        mut bm: Option<BlockMomentum>,
    ) -> Option<Final> {
        let rank0 = self.env.rank == 0;
        let checkpoint_every = Duration::from_secs_f64(self.args.checkpoint_every);
        let mut last_ckpt = Instant::now();
        let mut last_round = Instant::now() - Duration::from_secs(3600);
        let mut final_round = false;
        loop {
            let stop = self.stop.load(Ordering::SeqCst);
            if final_round || stop {
                // The end is known (a round showed a termination, or this worker got one):
                // the training threads stop first, so that the snapshot is the final model.
                self.halt_training(sh);
            } else {
                self.throttle(last_round);
            }
            last_round = Instant::now();
            let done = sh.running.load(Ordering::SeqCst) == 0;
            let own = sh.samples.load(Ordering::SeqCst);
            let snapshot = sh.params.to_vec();
            let inp = RoundIn {
                params: &snapshot,
                samples: own,
                done,
                stop,
            };
            let out = match ring_round(&mut ring, &inp) {
                Ok(out) => out,
                Err(e) => {
                    self.lose_sync(sh, "ring round", &e);
                    return None;
                }
            };
            let target = match &mut bm {
                Some(bm) => bm.step(&out.average),
                None => out.average.clone(),
            };
            sh.params.add_difference(&target, &snapshot);
            let consensus = match &bm {
                Some(bm) => bm.global.clone(),
                None => out.average,
            };
            let gap = relative_gap(&snapshot, &target);
            self.record_round(sh, gap, own, out.samples);
            // Every worker's threads had stopped before its snapshot: this round's consensus
            // is the final one, at the exact sample count.
            if final_round || out.done == ctx.workers {
                return Some(Final {
                    params: consensus,
                    momentum: sh.momentum0.lock().expect("not poisoned").clone(),
                    velocity: bm.map(|b| b.velocity),
                    samples: out.samples,
                    stopped: out.stop > 0,
                });
            }
            if out.stop > 0 {
                final_round = true;
                continue;
            }
            if rank0 && self.ckpt_dir.is_some() && last_ckpt.elapsed() >= checkpoint_every {
                let v = bm.as_ref().map(|b| b.velocity.as_slice());
                self.checkpoint_consensus(sh, ctx, &consensus, v, out.samples);
                last_ckpt = Instant::now();
            }
        }
    }

    /// S-EASGD shadow thread: elastic rounds with the shards until the final round; `None`
    /// when every shard was dropped.
    fn shadow_easgd(
        &self,
        sh: &Shared,
        ctx: &Ctx,
        mut client: EasgdClient,
        alpha: f64,
    ) -> Option<Final> {
        let rank0 = self.env.rank == 0;
        let checkpoint_every = Duration::from_secs_f64(self.args.checkpoint_every);
        let mut last_ckpt = Instant::now();
        let mut last_round = Instant::now() - Duration::from_secs(3600);
        loop {
            self.throttle(last_round);
            last_round = Instant::now();
            let done = sh.running.load(Ordering::SeqCst) == 0;
            let own = sh.samples.load(Ordering::SeqCst);
            let snapshot = sh.params.to_vec();
            let want_center =
                rank0 && self.ckpt_dir.is_some() && last_ckpt.elapsed() >= checkpoint_every;
            let stop = self.stop.load(Ordering::SeqCst);
            // Terminated here: straight to the final round, which tells the shards (and
            // through them the other workers) and gives the consensus; an elastic round first
            // would only delay the end by a round trip through the shards.
            let r = if stop {
                None
            } else {
                match client.round(&snapshot, own, done, stop, want_center) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        self.lose_sync(sh, "elastic round", &e);
                        return None;
                    }
                }
            };
            if let Some(r) = &r {
                sh.params.add_scaled(&r.delta, -1.0);
                // The center the worker was pulled to: c = s - δ/α.
                let center: Vec<f64> = snapshot
                    .iter()
                    .zip(&r.delta)
                    .map(|(s, d)| s - d / alpha)
                    .collect();
                self.record_round(sh, relative_gap(&snapshot, &center), own, r.samples);
                if let Some(c) = &r.center {
                    self.checkpoint_consensus(sh, ctx, c, None, r.samples);
                    last_ckpt = Instant::now();
                }
            }
            let (r_stop, all_done) = r.as_ref().map_or((true, false), |r| (r.stop, r.all_done));
            if r_stop || all_done {
                self.halt_training(sh);
                let x = sh.params.to_vec();
                let own = sh.samples.load(Ordering::SeqCst);
                let (center, total) = client.finish(&x, own, r_stop || stop);
                if client.live_shards() == 0 {
                    eprintln!(
                        "{}: no S-EASGD shard answered the final round; ending with the local model",
                        self.who
                    );
                    return None;
                }
                return Some(Final {
                    params: center,
                    momentum: sh.momentum0.lock().expect("not poisoned").clone(),
                    velocity: None,
                    samples: total.unwrap_or(own),
                    stopped: r_stop || stop,
                });
            }
        }
    }
}

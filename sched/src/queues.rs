//! Queues in the decision: each queue's GPU budget for one scheduling step (its quota while
//! its jobs need it, plus its fair share of the GPUs other queues leave idle), the decayed
//! usage that fair share remembers, and the choice of whole jobs to preempt when a queue's
//! running jobs no longer fit in what it may hold (docs/scheduling.md, "Queues, fair share
//! and priorities"). Pure: [`crate::decide::decide_queued`] calls it; nothing here reads a
//! clock.
//!
//! # Budgets
//! With `C` GPUs on the live hosts and, per queue `q`, its quota `Q`, the most it may hold
//! `M = Q + borrowing limit`, its weight `w`, its demand `D` (GPUs its schedulable jobs could
//! use: the largest size of each job under a policy that resizes, the requested size under
//! one that does not) and its decayed usage `U`:
//!
//! 1. **Guaranteed**: `g = min(Q, D)`. When the guarantees exceed `C` (hosts lost, quotas
//!    overcommitted) they are scaled down together, `g = min(Q, D, λ·Q)` with `λ` such that
//!    they sum to `C`.
//! 2. **Lent**: the spare `S = C − Σ g` (idle quota and GPUs no quota covers) goes to the
//!    queues whose demand exceeds their guarantee, each at most `min(D, M) − g`, by
//!    weighted water-filling with memory: `b = clamp(w·L − e, 0, min(D, M) − g)` with the
//!    level `L` such that `Σ b = min(S, Σ caps)`, where `e = max(0, U/τ − Q)` is how many
//!    GPUs beyond its quota the queue held on average over the decay's memory `τ = h / ln 2`
//!    (`h` the half-life). A queue that borrowed heavily in the last hours gets less of
//!    what is lent now; one that lent its quota gets more. The fair share is `g + b`.
//! 3. **Budget**: GPUs nobody demands go to the queues by weight up to `M` (so a lone queue
//!    may size its jobs on the whole cluster, as without queues), then the real shares are
//!    rounded to whole GPUs (floors, then the largest remainders, ties by name), never below
//!    a queue's guarantee.
//!
//! # Usage decay
//! `U(t) = U(t₀)·2^(−(t−t₀)/h) + G·τ·(1 − 2^(−(t−t₀)/h))`, where `G` is the GPUs the queue
//! held since the previous step at `t₀` (the constant-rate integral of `G·2^(−(t−s)/h)`):
//! GPU-seconds, each halved every `h` since it was used. A queue holding `G` GPUs for ever
//! tends to `G·τ`. The previous `U`, `G` and `t₀` are the queue's last
//! [`QueueStatus`]; the allocator keeps no other state.
//!
//! # Preemption
//! [`victims`]: when a group of running jobs at their floors (the minimum size under a policy
//! that resizes, else the current size) holds more GPUs than it may keep, whole jobs are
//! preempted, most recently started first, then the smallest set is kept: each preempted
//! job whose GPUs turn out not to be needed is spared again, latest chosen first.

use converge_common::{JobId, PROTOCOL_VERSION, QueueId, QueueSpec, QueueStatus};
use std::collections::BTreeMap;

/// Default half-life of the usage decay, seconds: one hour. Long enough that a team that
/// borrowed the whole cluster for an afternoon yields to the others for the next hour or two;
/// short enough that last week does not count. 0 (Kueue's default) forgets usage at once,
/// which makes the fair share memoryless: whoever asks in the current step gets an equal
/// cut, however much it used before.
pub const DEFAULT_USAGE_HALF_LIFE_S: f64 = 3600.0;

/// The decay's memory `τ = h / ln 2` (seconds): a queue holding `G` GPUs for ever reaches a
/// decayed usage of `G·τ`. 0 when the half-life is not positive.
pub fn memory_s(half_life_s: f64) -> f64 {
    if half_life_s.is_finite() && half_life_s > 0.0 {
        half_life_s / std::f64::consts::LN_2
    } else {
        0.0
    }
}

/// The queue's decayed usage at `now` (GPU-seconds) from its previous status: the old usage
/// decayed, plus the GPUs it held since then, integrated with the decay. 0 without a
/// previous status or a positive half-life; a status from the future counts as now.
pub fn decayed_usage(previous: Option<&QueueStatus>, now: f64, half_life_s: f64) -> f64 {
    let Some(p) = previous else { return 0.0 };
    let tau = memory_s(half_life_s);
    if tau <= 0.0 {
        return 0.0;
    }
    let dt = (now - p.updated_at).max(0.0);
    let keep = (-dt / tau).exp();
    let usage = p.usage_gpu_seconds.max(0.0) * keep + f64::from(p.gpus_in_use) * tau * (1.0 - keep);
    if usage.is_finite() { usage } else { 0.0 }
}

/// One queue as the budgets see it.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueDemand {
    pub name: QueueId,
    /// Nominal quota, GPUs.
    pub quota_gpus: u32,
    /// Most GPUs it may hold ([`QueueSpec::max_gpus`]).
    pub max_gpus: u32,
    pub weight: f64,
    /// GPUs its schedulable jobs could use.
    pub demand_gpus: u64,
    /// Decayed usage at decision time, GPU-seconds ([`decayed_usage`]).
    pub usage_gpu_seconds: f64,
}

impl QueueDemand {
    /// The queue `spec` with `demand` and `usage`.
    pub fn new(spec: &QueueSpec, demand_gpus: u64, usage_gpu_seconds: f64) -> Self {
        Self {
            name: spec.name.clone(),
            quota_gpus: spec.quota_gpus,
            max_gpus: spec.max_gpus(),
            weight: if spec.weight.is_finite() && spec.weight > 0.0 {
                spec.weight
            } else {
                1.0
            },
            demand_gpus,
            usage_gpu_seconds,
        }
    }
}

/// A queue's share of one step, see the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share {
    /// Guaranteed GPUs: its quota while its jobs need it.
    pub guaranteed: f64,
    /// Fair share: the guarantee plus its part of the lent GPUs.
    pub fair_share: f64,
    /// Whole GPUs its jobs may be sized on in this step (at least `floor(guaranteed)`).
    pub budget: u32,
}

/// Each queue's share of `total_gpus` (same order as `queues`); see the module docs.
pub fn shares(queues: &[QueueDemand], total_gpus: u32, half_life_s: f64) -> Vec<Share> {
    let n = queues.len();
    let total = f64::from(total_gpus);
    let demand: Vec<f64> = queues.iter().map(|q| q.demand_gpus as f64).collect();
    let quota: Vec<f64> = queues.iter().map(|q| f64::from(q.quota_gpus)).collect();
    let most: Vec<f64> = queues.iter().map(|q| f64::from(q.max_gpus)).collect();
    // 1. Guarantees, scaled down together by quota when they exceed the cluster.
    let mut guaranteed: Vec<f64> = (0..n).map(|i| quota[i].min(demand[i])).collect();
    if guaranteed.iter().sum::<f64>() > total {
        let caps = guaranteed.clone();
        let lambda = level(total, |l| {
            (0..n).map(|i| (quota[i] * l).clamp(0.0, caps[i])).sum()
        });
        guaranteed = (0..n)
            .map(|i| (quota[i] * lambda).clamp(0.0, caps[i]))
            .collect();
    }
    // 2. The spare, by weight and past borrowing.
    let tau = memory_s(half_life_s);
    let excess: Vec<f64> = queues
        .iter()
        .map(|q| {
            if tau > 0.0 {
                (q.usage_gpu_seconds / tau - f64::from(q.quota_gpus)).max(0.0)
            } else {
                0.0
            }
        })
        .collect();
    let spare = (total - guaranteed.iter().sum::<f64>()).max(0.0);
    let caps: Vec<f64> = (0..n)
        .map(|i| (demand[i].min(most[i]) - guaranteed[i]).max(0.0))
        .collect();
    let lent_out = spare.min(caps.iter().sum());
    let borrow = |l: f64, i: usize| (queues[i].weight * l - excess[i]).clamp(0.0, caps[i]);
    let lent: Vec<f64> = if lent_out > 0.0 {
        let l = level(lent_out, |l| (0..n).map(|i| borrow(l, i)).sum());
        (0..n).map(|i| borrow(l, i)).collect()
    } else {
        vec![0.0; n]
    };
    let fair: Vec<f64> = (0..n).map(|i| guaranteed[i] + lent[i]).collect();
    // 3. What nobody demands, by weight up to each queue's most; then whole GPUs.
    let idle = (total - fair.iter().sum::<f64>()).max(0.0);
    let room: Vec<f64> = (0..n)
        .map(|i| {
            if queues[i].demand_gpus > 0 {
                (most[i] - fair[i]).max(0.0)
            } else {
                0.0
            }
        })
        .collect();
    let topped: Vec<f64> = if idle > 0.0 && room.iter().sum::<f64>() > 0.0 {
        let give = idle.min(room.iter().sum());
        let extra = |l: f64, i: usize| (queues[i].weight * l).clamp(0.0, room[i]);
        let l = level(give, |l| (0..n).map(|i| extra(l, i)).sum());
        (0..n).map(|i| fair[i] + extra(l, i)).collect()
    } else {
        fair.clone()
    };
    let budgets = whole_gpus(queues, &topped, &guaranteed, total_gpus);
    (0..n)
        .map(|i| Share {
            guaranteed: guaranteed[i],
            fair_share: fair[i],
            budget: budgets[i],
        })
        .collect()
}

/// How many of `amount` spare GPUs to offer each queue that can still grow, so that GPUs
/// in use per unit of fair share end as level as possible (water-filling:
/// `extra_i = clamp(l·fair_i − used_i, 0, room_i)`), in whole GPUs summing to
/// `min(amount, Σ room)`: floors, then one more each to the largest remainders, ties to the
/// earlier index. `used`, `fair` and `room` are per queue, in the same order; a fair share
/// that is not positive and finite counts as a tiny one (such a queue gets GPUs last).
pub fn leftover_offers(used: &[u64], fair: &[f64], room: &[u64], amount: u64) -> Vec<u64> {
    let n = used.len().min(fair.len()).min(room.len());
    let fair: Vec<f64> = fair[..n]
        .iter()
        .map(|f| if f.is_finite() && *f > 0.0 { *f } else { 1e-6 })
        .collect();
    let target = amount.min(room[..n].iter().sum()) as f64;
    if n == 0 || target <= 0.0 {
        return vec![0; n];
    }
    let extra = |l: f64, i: usize| (l * fair[i] - used[i] as f64).clamp(0.0, room[i] as f64);
    let l = level(target, |l| (0..n).map(|i| extra(l, i)).sum());
    let real: Vec<f64> = (0..n).map(|i| extra(l, i)).collect();
    let mut whole: Vec<u64> = real.iter().map(|x| (x + 1e-9).floor() as u64).collect();
    let mut short = (target as u64).saturating_sub(whole.iter().sum());
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        let frac = |i: usize| real[i] - whole[i] as f64;
        frac(b).total_cmp(&frac(a)).then(a.cmp(&b))
    });
    for i in order {
        if short == 0 {
            break;
        }
        if whole[i] < room[i] {
            whole[i] += 1;
            short -= 1;
        }
    }
    whole
}

/// The level `l ≥ 0` at which the non-decreasing `sum(l)` reaches `target` (bisection;
/// deterministic). The caller makes sure the target is reachable.
fn level(target: f64, sum: impl Fn(f64) -> f64) -> f64 {
    let mut hi = 1.0;
    while sum(hi) < target && hi < 1e18 {
        hi *= 2.0;
    }
    let mut lo = 0.0;
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if sum(mid) < target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

/// Real shares rounded to whole GPUs summing to at most `total`: floors (never below the
/// guarantee's floor), then one more GPU each to the largest remainders, ties by name.
fn whole_gpus(queues: &[QueueDemand], real: &[f64], guaranteed: &[f64], total: u32) -> Vec<u32> {
    let eps = 1e-6;
    let mut out: Vec<u32> = real
        .iter()
        .zip(guaranteed)
        .map(|(r, g)| ((r + eps).floor().max((g + eps).floor())).max(0.0) as u32)
        .collect();
    let sum_real: f64 = real.iter().sum();
    let target = (u64::from(total)).min((sum_real + eps).floor() as u64);
    let mut given: u64 = out.iter().map(|&b| u64::from(b)).sum();
    let mut order: Vec<usize> = (0..queues.len()).collect();
    order.sort_by(|&a, &b| {
        let fa = real[a] - f64::from(out[a]);
        let fb = real[b] - f64::from(out[b]);
        fb.total_cmp(&fa)
            .then_with(|| queues[a].name.cmp(&queues[b].name))
    });
    for i in order {
        if given >= target {
            break;
        }
        if real[i] - f64::from(out[i]) > eps {
            out[i] += 1;
            given += 1;
        }
    }
    out
}

/// A running job that a group may have to give up.
#[derive(Debug, Clone, PartialEq)]
pub struct Running {
    pub id: JobId,
    /// GPUs it keeps at least if it stays (its floor).
    pub floor_gpus: u64,
    /// When its run started (seconds); the most recent goes first. `None` sorts as oldest.
    pub started_at: Option<f64>,
}

/// The running jobs to preempt, whole, so that the others' floors fit in `allowed` GPUs: the
/// most recently started first (then the larger id), then each chosen job that is not needed
/// after all is spared again, latest chosen first. Empty when they fit.
pub fn victims(running: &[Running], allowed: u64) -> Vec<JobId> {
    let mut held: u64 = running.iter().map(|r| r.floor_gpus).sum();
    if held <= allowed {
        return Vec::new();
    }
    let mut order: Vec<&Running> = running.iter().collect();
    order.sort_by(|a, b| {
        let (sa, sb) = (
            a.started_at.unwrap_or(f64::NEG_INFINITY),
            b.started_at.unwrap_or(f64::NEG_INFINITY),
        );
        sb.total_cmp(&sa).then_with(|| b.id.cmp(&a.id))
    });
    let mut chosen: Vec<&Running> = Vec::new();
    for r in order {
        if held <= allowed {
            break;
        }
        if r.floor_gpus == 0 {
            continue;
        }
        held -= r.floor_gpus;
        chosen.push(r);
    }
    // Spare what is not needed: the latest chosen first.
    let mut keep = vec![true; chosen.len()];
    for i in (0..chosen.len()).rev() {
        if held + chosen[i].floor_gpus <= allowed {
            held += chosen[i].floor_gpus;
            keep[i] = false;
        }
    }
    chosen
        .into_iter()
        .zip(keep)
        .filter(|(_, k)| *k)
        .map(|(r, _)| r.id.clone())
        .collect()
}

/// What one queue holds after a decision, for its [`QueueStatus`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Held {
    pub gpus: u32,
    pub running_jobs: u32,
    pub pending_jobs: u32,
}

/// Each queue's status after a decision at `now`: GPUs held, borrowed (beyond its quota) and
/// lent (its idle quota that other queues' borrowing used, shared among the lenders in
/// proportion to their idle quota after the GPUs no quota covers), its fair share and its
/// decayed usage. `queues`, `shares` and `held` in the same order.
pub fn statuses(
    queues: &[QueueDemand],
    shares: &[Share],
    held: &[Held],
    total_gpus: u32,
    now: f64,
    half_life_s: f64,
) -> Vec<QueueStatus> {
    let borrowed: Vec<u32> = queues
        .iter()
        .zip(held)
        .map(|(q, h)| h.gpus.saturating_sub(q.quota_gpus))
        .collect();
    let idle: Vec<u32> = queues
        .iter()
        .zip(held)
        .map(|(q, h)| q.quota_gpus.saturating_sub(h.gpus))
        .collect();
    let quotas: u64 = queues.iter().map(|q| u64::from(q.quota_gpus)).sum();
    let unassigned = u64::from(total_gpus).saturating_sub(quotas);
    let from_lenders = borrowed
        .iter()
        .map(|&b| u64::from(b))
        .sum::<u64>()
        .saturating_sub(unassigned);
    let idle_total: u64 = idle.iter().map(|&i| u64::from(i)).sum();
    let lent = proportional(&idle, from_lenders.min(idle_total), queues);
    (0..queues.len())
        .map(|i| QueueStatus {
            protocol: PROTOCOL_VERSION,
            queue: queues[i].name.clone(),
            gpus_in_use: held[i].gpus,
            borrowed_gpus: borrowed[i],
            lent_gpus: lent[i],
            fair_share_gpus: finite(shares[i].fair_share),
            usage_gpu_seconds: finite(queues[i].usage_gpu_seconds),
            half_life_s: finite(half_life_s),
            running_jobs: held[i].running_jobs,
            pending_jobs: held[i].pending_jobs,
            updated_at: finite(now),
        })
        .collect()
}

fn finite(x: f64) -> f64 {
    if x.is_finite() { x.max(0.0) } else { 0.0 }
}

/// `amount` split in proportion to `weights` (whole units; floors, then the largest
/// remainders, ties by name).
fn proportional(weights: &[u32], amount: u64, queues: &[QueueDemand]) -> Vec<u32> {
    let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
    if total == 0 || amount == 0 {
        return vec![0; weights.len()];
    }
    let exact: Vec<f64> = weights
        .iter()
        .map(|&w| amount as f64 * f64::from(w) / total as f64)
        .collect();
    let mut out: Vec<u32> = exact.iter().map(|e| e.floor() as u32).collect();
    let mut given: u64 = out.iter().map(|&o| u64::from(o)).sum();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| {
        (exact[b] - exact[b].floor())
            .total_cmp(&(exact[a] - exact[a].floor()))
            .then_with(|| queues[a].name.cmp(&queues[b].name))
    });
    for i in order {
        if given >= amount {
            break;
        }
        if out[i] < weights[i] {
            out[i] += 1;
            given += 1;
        }
    }
    out
}

/// The name of the default queue, the queue of every job whose spec names none.
pub fn default_queue() -> QueueId {
    QueueId::new(converge_common::DEFAULT_QUEUE).expect("valid queue name")
}

/// The queues a decision knows: those in `specs`, plus the implicit [`QueueSpec::implicit_default`]
/// when nobody created a `default` queue.
pub fn with_default(specs: &BTreeMap<QueueId, QueueSpec>) -> BTreeMap<QueueId, QueueSpec> {
    let mut all = specs.clone();
    let default = QueueSpec::implicit_default();
    all.entry(default.name.clone()).or_insert(default);
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn q(name: &str, quota: u32, borrow: Option<u32>, weight: f64, demand: u64) -> QueueDemand {
        QueueDemand {
            name: name.parse().unwrap(),
            quota_gpus: quota,
            max_gpus: borrow.map_or(u32::MAX, |b| quota + b),
            weight,
            demand_gpus: demand,
            usage_gpu_seconds: 0.0,
        }
    }

    fn budgets(queues: &[QueueDemand], total: u32) -> Vec<u32> {
        shares(queues, total, DEFAULT_USAGE_HALF_LIFE_S)
            .iter()
            .map(|s| s.budget)
            .collect()
    }

    #[test]
    fn idle_quota_is_lent_and_taken_back() {
        // Team b idle: team a borrows all of b's quota.
        let a = q("team-a", 8, None, 1.0, 40);
        let b = q("team-b", 8, None, 1.0, 0);
        assert_eq!(budgets(&[a.clone(), b.clone()], 16), vec![16, 0]);
        // b needs 3 again: it gets them back at once.
        let b3 = QueueDemand {
            demand_gpus: 3,
            ..b.clone()
        };
        let s = shares(&[a.clone(), b3], 16, DEFAULT_USAGE_HALF_LIFE_S);
        assert_eq!((s[0].budget, s[1].budget), (13, 3));
        assert_eq!(s[1].guaranteed, 3.0);
        // Both flood: each its quota.
        let b40 = QueueDemand {
            demand_gpus: 40,
            ..b
        };
        assert_eq!(budgets(&[a, b40], 16), vec![8, 8]);
    }

    #[test]
    fn borrowing_limits_and_weights_hold() {
        let a = q("a", 4, Some(2), 1.0, 40);
        let b = q("b", 4, None, 1.0, 40);
        let c = q("c", 8, None, 1.0, 0);
        // c's 8 idle GPUs: a may take 2 more, b the rest.
        assert_eq!(budgets(&[a, b, c], 16), vec![6, 10, 0]);
        let a = q("a", 0, None, 3.0, 40);
        let b = q("b", 0, None, 1.0, 40);
        assert_eq!(budgets(&[a, b], 16), vec![12, 4]);
    }

    #[test]
    fn a_lone_queue_may_use_the_whole_cluster_up_to_its_limit() {
        let d = q("default", 0, None, 1.0, 3);
        assert_eq!(budgets(std::slice::from_ref(&d), 16), vec![16]);
        let s = shares(&[d], 16, DEFAULT_USAGE_HALF_LIFE_S);
        assert_eq!(s[0].fair_share, 3.0);
        assert_eq!(budgets(&[q("a", 2, Some(3), 1.0, 40)], 16), vec![5]);
    }

    #[test]
    fn past_borrowing_lowers_the_share_of_what_is_lent() {
        let tau = memory_s(DEFAULT_USAGE_HALF_LIFE_S);
        // a held 8 GPUs beyond a quota of 0 for a long time: e = 8.
        let a = QueueDemand {
            usage_gpu_seconds: 8.0 * tau,
            ..q("a", 0, None, 1.0, 40)
        };
        let b = q("b", 0, None, 1.0, 40);
        let s = shares(&[a.clone(), b.clone()], 16, DEFAULT_USAGE_HALF_LIFE_S);
        assert_eq!((s[0].budget, s[1].budget), (4, 12));
        // Without memory (half-life 0) the split is even.
        let s = shares(&[a, b], 16, 0.0);
        assert_eq!((s[0].budget, s[1].budget), (8, 8));
    }

    #[test]
    fn overcommitted_quotas_are_scaled_down_together() {
        let a = q("a", 12, None, 1.0, 40);
        let b = q("b", 4, None, 1.0, 40);
        let s = shares(&[a, b], 8, DEFAULT_USAGE_HALF_LIFE_S);
        assert_eq!((s[0].budget, s[1].budget), (6, 2));
    }

    #[test]
    fn leftover_evens_gpus_per_fair_share_within_room() {
        // a holds 1 of share 1, b 3 of share 3: 4 spare split 1 : 3.
        assert_eq!(
            leftover_offers(&[1, 3], &[1.0, 3.0], &[10, 10], 4),
            vec![1, 3]
        );
        // The one behind catches up first.
        assert_eq!(
            leftover_offers(&[0, 3], &[1.0, 1.0], &[10, 10], 3),
            vec![3, 0]
        );
        // Room caps; what one cannot take goes to the other; never more than all rooms.
        assert_eq!(
            leftover_offers(&[0, 0], &[1.0, 1.0], &[1, 10], 6),
            vec![1, 5]
        );
        assert_eq!(
            leftover_offers(&[0, 0], &[1.0, 1.0], &[1, 2], 6),
            vec![1, 2]
        );
        // Whole GPUs: remainders by size, ties to the first; a zero share comes last.
        assert_eq!(
            leftover_offers(&[0, 0, 0], &[1.0, 1.0, 1.0], &[5, 5, 5], 4),
            vec![2, 1, 1]
        );
        assert_eq!(
            leftover_offers(&[0, 0], &[0.0, 1.0], &[5, 5], 3),
            vec![0, 3]
        );
        assert_eq!(leftover_offers(&[], &[], &[], 3), Vec::<u64>::new());
    }

    #[test]
    fn usage_decays_with_its_half_life() {
        let h = 3600.0;
        let status = |usage: f64, gpus: u32, at: f64| QueueStatus {
            protocol: PROTOCOL_VERSION,
            queue: "a".parse().unwrap(),
            gpus_in_use: gpus,
            borrowed_gpus: 0,
            lent_gpus: 0,
            fair_share_gpus: 0.0,
            usage_gpu_seconds: usage,
            half_life_s: h,
            running_jobs: 0,
            pending_jobs: 0,
            updated_at: at,
        };
        let u = decayed_usage(Some(&status(1000.0, 0, 0.0)), h, h);
        assert!((u - 500.0).abs() < 1e-9, "{u}");
        // Holding 4 GPUs for a short dt adds about 4·dt.
        let u = decayed_usage(Some(&status(0.0, 4, 0.0)), 1.0, h);
        assert!((u - 4.0).abs() < 1e-3, "{u}");
        // Forever: G·τ.
        let u = decayed_usage(Some(&status(0.0, 4, 0.0)), 1e9, h);
        assert!((u - 4.0 * memory_s(h)).abs() < 1e-6, "{u}");
        assert_eq!(decayed_usage(None, 10.0, h), 0.0);
        assert_eq!(decayed_usage(Some(&status(10.0, 4, 0.0)), 10.0, 0.0), 0.0);
        // Steps compose: two half-steps equal one step.
        let one = decayed_usage(Some(&status(100.0, 3, 0.0)), 600.0, h);
        let mid = decayed_usage(Some(&status(100.0, 3, 0.0)), 300.0, h);
        let two = decayed_usage(Some(&status(mid, 3, 300.0)), 600.0, h);
        assert!((one - two).abs() < 1e-9, "{one} {two}");
    }

    fn running(id: &str, gpus: u64, started: f64) -> Running {
        Running {
            id: id.parse().unwrap(),
            floor_gpus: gpus,
            started_at: Some(started),
        }
    }

    #[test]
    fn victims_are_the_newest_and_no_more_than_needed() {
        let jobs = [
            running("old", 4, 0.0),
            running("mid", 2, 10.0),
            running("new", 1, 20.0),
        ];
        assert!(victims(&jobs, 7).is_empty());
        let ids = |v: Vec<JobId>| v.iter().map(|j| j.to_string()).collect::<Vec<_>>();
        assert_eq!(ids(victims(&jobs, 6)), vec!["new"]);
        // 2 must go: new (1) is not enough, mid (2) is; new is spared again.
        assert_eq!(ids(victims(&jobs, 5)), vec!["mid"]);
        assert_eq!(ids(victims(&jobs, 0)), vec!["new", "mid", "old"]);
    }

    proptest! {
        #[test]
        fn budgets_fit_the_cluster_and_keep_guarantees(
            total in 0u32..64,
            specs in prop::collection::vec(
                (0u32..20, prop::option::of(0u32..20), 0.1f64..5.0, 0u64..40, 0.0f64..1e6),
                1..6,
            ),
        ) {
            let queues: Vec<QueueDemand> = specs
                .iter()
                .enumerate()
                .map(|(i, &(quota, borrow, weight, demand, usage))| QueueDemand {
                    usage_gpu_seconds: usage,
                    ..q(&format!("q{i}"), quota, borrow, weight, demand)
                })
                .collect();
            let s = shares(&queues, total, DEFAULT_USAGE_HALF_LIFE_S);
            let sum: u64 = s.iter().map(|x| u64::from(x.budget)).sum();
            prop_assert!(sum <= u64::from(total));
            let fair: f64 = s.iter().map(|x| x.fair_share).sum();
            prop_assert!(fair <= f64::from(total) + 1e-6);
            let demanded: u64 = queues.iter().map(|q| q.demand_gpus.min(u64::from(q.max_gpus))).sum();
            // Work-conserving: all the demand or all the cluster is shared out.
            prop_assert!(fair + 1e-6 >= (demanded as f64).min(f64::from(total)));
            for (q, x) in queues.iter().zip(&s) {
                prop_assert!(x.budget <= q.max_gpus);
                prop_assert!(f64::from(x.budget) + 1e-6 >= x.guaranteed.floor());
                prop_assert!(x.guaranteed <= f64::from(q.quota_gpus) + 1e-9);
                if queues.iter().map(|q| u64::from(q.quota_gpus)).sum::<u64>() <= u64::from(total) {
                    // Quotas within the cluster are honoured in full while needed.
                    let want = q.demand_gpus.min(u64::from(q.quota_gpus)) as f64;
                    prop_assert!((x.guaranteed - want).abs() < 1e-6);
                    prop_assert!(u64::from(x.budget) >= want as u64);
                }
            }
        }

        #[test]
        fn victims_free_enough_and_each_is_needed(
            floors in prop::collection::vec((0u64..8, 0u32..100), 0..10),
            allowed in 0u64..40,
        ) {
            let jobs: Vec<Running> = floors
                .iter()
                .enumerate()
                .map(|(i, &(g, t))| running(&format!("j{i}"), g, f64::from(t)))
                .collect();
            let v = victims(&jobs, allowed);
            let kept: u64 = jobs.iter().filter(|j| !v.contains(&j.id)).map(|j| j.floor_gpus).sum();
            prop_assert!(kept <= allowed);
            for id in &v {
                let g = jobs.iter().find(|j| &j.id == id).unwrap().floor_gpus;
                prop_assert!(kept + g > allowed, "{} was not needed", id);
            }
        }
    }
}

//! Contention model: a job's seconds per optimizer step on a candidate placement, given how
//! many servers it spans and how many multi-server jobs share the busiest of their NICs
//! (design brief §5.2–5.3). It is what [`crate::placement::place_bco`] weighs when it trades
//! NIC contention against the overhead of spanning more servers.
//!
//! # Source
//!
//! SJF-BCO (Yu, Ji, Rajan, Liu, "On Scheduling Ring-All-Reduce Learning Jobs in Multi-Tenant
//! GPU Clusters with Communication Contention", MobiHoc'22) models a ring-all-reduce job's
//! iteration as computation, plus a communication overhead that grows with the number of
//! servers the ring spans, plus a communication time that grows with the contention on the
//! servers' network links: the number of multi-server jobs sharing a server's NIC. The
//! paper's exact constants are not at hand; the shape is the brief's (§5.2), which is also
//! that of [`crate::throughput`]:
//!
//! ```text
//! t_sync ≈ α·(servers − 1) + 2·(w−1)/w · M / B_eff
//! B_eff  = B_intra                      on one server
//!        = B_NIC · f / contention       across servers
//! ```
//!
//! `M` is the gradient size (bytes), `B_NIC` the NIC bandwidth, `contention` the number of
//! multi-server jobs (this one included) whose rings cross the NIC of the most loaded server
//! the job uses, and `f ∈ (0, 1]` that server's NIC calibration factor ([`nic_factor`]).
//! A job on one server syncs over the intra-node links and sees no NIC contention.
//!
//! # The cost of one job ([`JobCost`])
//!
//! For `w` workers with a per-worker batch of `b` samples, spanning `n` servers, with
//! contention `c ≥ 1` on its worst NIC (all times in seconds per step):
//!
//! ```text
//! n = 1:  t = compute + intra_sync
//! n > 1:  t = compute + overhead·(n − 1) + sync·c / f
//! ```
//!
//! From a fitted per-job [`ThroughputModel`]
//! (`t(w, n, b) = θ_c·b + θ_0 + θ_intra·[n=1]·r(w) + θ_inter·[n>1]·r(w) + θ_α·(n−1)`,
//! `r(w) = 2(w−1)/w`), [`JobCost::from_model`] sets
//!
//! | field | value | meaning |
//! |---|---|---|
//! | `compute_s` | `θ_c·b + θ_0` | forward/backward and the fixed per-step cost |
//! | `intra_sync_s` | `θ_intra·r(w)` | ring all-reduce over intra-node links (one server) |
//! | `overhead_s_per_server` | `θ_α` | latency/overhead per server spanned beyond the first |
//! | `sync_s` | `θ_inter·r(w)` | ring all-reduce over one uncontended NIC |
//!
//! so that at contention 1 and `f = 1` the step time equals the model's exactly. Contention
//! divides the NIC bandwidth among the rings sharing it (fair sharing of the bottleneck
//! link), so the sync term grows linearly in `c`; the compute and overhead terms do not.
//!
//! # Calibration
//!
//! - Per job: the five `θ` are fitted by NNLS on the job's observed step times
//!   ([`ThroughputModel::fit`]); the agents report workers, servers spanned, per-worker batch
//!   and seconds per step.
//! - Per host: [`nic_factor`] turns an agent's measured NIC throughput and the link speed
//!   into the fraction of the link left for all-reduce; the sync term of a job is divided by
//!   the factor of its worst server. The service takes both from the agents' telemetry
//!   ([`host_nic`]: the fastest non-loopback NIC that reports a link speed, its busier
//!   direction). The agents measure all traffic on the NIC, the Converge rings' own
//!   included, so a host running a multi-server job is charged for it twice (once in
//!   `contention`, once in the factor): a conservative bias toward hosts with quiet NICs.
//!   The factor is meant for traffic Converge does not schedule (storage, other tenants).
//!
//! # Accuracy on measured data
//!
//! Checked against Pollux's measured step times (`data/pollux/traces/<app>/placements.csv`:
//! one job alone, so contention 1, on 1–4 nodes of 1–4 GPUs each, one worker per GPU, at
//! several per-GPU batches). Per application and per-GPU batch a model is fitted
//! ([`ThroughputModel::fit`], default prior) on the 1- and 2-node rows and evaluated through
//! [`JobCost::from_model`] and [`JobCost::step_time_s`]`(nodes, 1)` on every row at that batch,
//! 3- and 4-node rows included. Median / 90th percentile of the absolute relative error (the
//! test `pollux_step_times_at_contention_one` prints this table):
//!
//! | app | rows | all rows | 1–2 nodes (fitted) | 3–4 nodes (extrapolated) | 3–4 median signed | fitted on all rows |
//! |---|---|---|---|---|---|---|
//! | bert | 540 | 48.7 % / 60.6 % | 2.8 % / 14.6 % | 50.5 % / 61.6 % | +50.5 % | 5.1 % / 21.5 % |
//! | cifar10 | 1183 | 9.3 % / 34.8 % | 4.8 % / 15.4 % | 11.3 % / 35.6 % | +11.1 % | 3.8 % / 15.1 % |
//! | deepspeech2 | 754 | 8.0 % / 27.6 % | 2.5 % / 12.0 % | 9.6 % / 28.8 % | +9.1 % | 3.4 % / 12.8 % |
//! | imagenet | 864 | 16.2 % / 44.9 % | 3.2 % / 14.4 % | 20.2 % / 46.1 % | +20.2 % | 3.6 % / 15.6 % |
//! | ncf | 1661 | 30.6 % / 50.3 % | 6.6 % / 18.0 % | 33.1 % / 51.6 % | +33.1 % | 7.1 % / 20.6 % |
//! | yolov3 | 540 | 37.7 % / 54.3 % | 5.4 % / 17.9 % | 39.4 % / 55.7 % | +39.4 % | 5.4 % / 23.2 % |
//!
//! Within the fitted range the model is good (median 2.5–6.6 %), but extrapolating from two
//! servers to three or four over-predicts, by a median of 9–50 %: in every application the
//! measured step at a fixed worker count is *slowest on two nodes* and faster on three or four
//! (bert at 8 samples per GPU: 4 GPUs take 2.10 s as `22`, 1.28 s as `112`, 1.31 s as
//! `1111`). With only `n − 1 = 1` among the fitted multi-server rows, `θ_α` absorbs the
//! two-node penalty and the linear overhead term then charges it again for every further
//! server. Fitted on all rows (1–4 nodes), the same five terms give 3.4–7.1 % median, so the
//! form is adequate once the job has been observed on more than two servers; before that,
//! [`JobCost`] overstates the cost of spanning many servers, which biases
//! [`crate::placement::place_bco`] toward fewer servers with more contention.
//!
//! The contention term itself (`c > 1`) is not in those traces (they measure one job alone);
//! its linear form is the fair-share assumption above, not a measurement.
//!
//! Everything here is pure (no I/O, no clock) and never returns NaN or a negative time.

use crate::throughput::{ThroughputModel, ring_factor};
use converge_common::NicSample;

/// Smallest NIC factor [`nic_factor`] returns: a saturated NIC still leaves the all-reduce
/// this share of the link (sync at most 20× slower), so one bad measurement cannot make a
/// host look infinitely slow.
pub const MIN_NIC_FACTOR: f64 = 0.05;

/// Per-step cost terms of one job at a fixed worker count and per-worker batch (seconds per
/// step; see the module docs). Fields that are not finite and non-negative count as 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobCost {
    /// Compute and fixed per-step cost, `θ_c·b + θ_0` (s).
    pub compute_s: f64,
    /// Extra time per server spanned beyond the first, `θ_α` (s).
    pub overhead_s_per_server: f64,
    /// Ring all-reduce over one uncontended NIC, `θ_inter·2(w−1)/w` (s); multiplied by the
    /// contention and divided by the NIC factor.
    pub sync_s: f64,
    /// Ring all-reduce when all workers share one server, `θ_intra·2(w−1)/w` (s).
    pub intra_sync_s: f64,
}

impl Default for JobCost {
    /// The cost assumed for a job without an estimate: compute 1 s, overhead 0.05 s per
    /// extra server, sync 0.5 s per step across servers, no intra-node sync.
    fn default() -> Self {
        Self::new(1.0, 0.05, 0.5)
    }
}

/// `v` if finite and non-negative, else 0.
fn sane(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 { v } else { 0.0 }
}

impl JobCost {
    /// A cost with no intra-node sync term.
    pub fn new(compute_s: f64, overhead_s_per_server: f64, sync_s: f64) -> Self {
        Self {
            compute_s,
            overhead_s_per_server,
            sync_s,
            intra_sync_s: 0.0,
        }
    }

    /// From a fitted model at `workers` workers and per-worker batch `local_batch` (samples):
    /// compute = `θ_c·b + θ_0`, intra-node sync = `θ_intra·r(w)`, overhead = `θ_α`,
    /// sync = `θ_inter·r(w)` with `r(w) = 2(w−1)/w`. A batch that is not finite and positive
    /// counts as the model does ([`ThroughputModel::step_time_s`]).
    pub fn from_model(model: &ThroughputModel, workers: u32, local_batch: f64) -> Self {
        let [_, _, intra, inter, alpha] = model.coefficients();
        let r = ring_factor(workers);
        Self {
            // One worker on one server: θ_c·b + θ_0 exactly (r(1) = 0, no extra server).
            compute_s: model.step_time_s(1, 1, local_batch),
            overhead_s_per_server: alpha,
            sync_s: inter * r,
            intra_sync_s: intra * r,
        }
    }

    /// Seconds per step on `servers` servers where the worst server's NIC is shared by
    /// `contention` multi-server jobs (this one included; 0 counts as 1). One server (or 0):
    /// compute plus the intra-node term, whatever the contention.
    pub fn step_time_s(&self, servers: u32, contention: u32) -> f64 {
        self.step_time_with_nic_s(servers, contention, 1.0)
    }

    /// As [`JobCost::step_time_s`], with the sync term divided by `nic_factor` (the
    /// [`nic_factor`] of the worst server, the one with the largest `contention / factor`;
    /// clamped into `[MIN_NIC_FACTOR, 1]`, 1 when not a number).
    pub fn step_time_with_nic_s(&self, servers: u32, contention: u32, nic_factor: f64) -> f64 {
        let compute = sane(self.compute_s);
        let t = if servers <= 1 {
            compute + sane(self.intra_sync_s)
        } else {
            let factor = if nic_factor.is_nan() {
                1.0
            } else {
                nic_factor.clamp(MIN_NIC_FACTOR, 1.0)
            };
            compute
                + sane(self.overhead_s_per_server) * f64::from(servers - 1)
                + sane(self.sync_s) * f64::from(contention.max(1)) / factor
        };
        t.min(f64::MAX)
    }
}

/// Effective share of a host's NIC left for all-reduce, in `[MIN_NIC_FACTOR, 1]`:
/// `1 − measured / link_speed`, where `measured_bytes_per_s` is the throughput the agent
/// measures on the NIC from other traffic and `link_speed_bytes_per_s` the link's nominal
/// speed (both bytes per second, same direction). A host whose NIC is already busy gets a
/// smaller factor, and a job's sync time on it scales by `1 / factor`. Unknown or unusable
/// inputs (no link speed, a speed that is not finite and positive, a measurement that is
/// not a finite non-negative number other than `+∞`) give 1: no calibration.
pub fn nic_factor(link_speed_bytes_per_s: Option<f64>, measured_bytes_per_s: f64) -> f64 {
    let Some(link) = link_speed_bytes_per_s.filter(|s| s.is_finite() && *s > 0.0) else {
        return 1.0;
    };
    if measured_bytes_per_s.is_nan() || measured_bytes_per_s <= 0.0 {
        return 1.0;
    }
    (1.0 - measured_bytes_per_s / link).clamp(MIN_NIC_FACTOR, 1.0)
}

/// What the allocator knows of a host's network from its agent's telemetry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostNic {
    /// Nominal link speed of the NIC used, bytes per second in one direction; `None` when
    /// no NIC reports one (loopback-only hosts, virtual NICs without a speed).
    pub link_bytes_per_s: Option<f64>,
    /// [`nic_factor`] of that NIC (1 without a link speed).
    pub factor: f64,
}

/// The host's data NIC and its factor: among the NICs other than loopback (`lo`) that report
/// a link speed, the fastest (ties: the busier); its measured load is the busier direction,
/// `max(rx, tx)` bytes/s. Link speeds are bits/s on the wire ([`NicSample::link_speed_bps`]).
pub fn host_nic(nics: &[NicSample]) -> HostNic {
    let busy = |n: &NicSample| n.rx_bytes_per_s.max(n.tx_bytes_per_s);
    let best = nics
        .iter()
        .filter(|n| n.name != "lo")
        .filter_map(|n| Some((n.link_speed_bps.filter(|&b| b > 0)?, n)))
        .max_by(|(sa, a), (sb, b)| sa.cmp(sb).then(busy(a).total_cmp(&busy(b))));
    match best {
        Some((bps, nic)) => {
            let link = bps as f64 / 8.0;
            HostNic {
                link_bytes_per_s: Some(link),
                factor: nic_factor(Some(link), busy(nic)),
            }
        }
        None => HostNic {
            link_bytes_per_s: None,
            factor: 1.0,
        },
    }
}

/// Largest slowdown one measurement may contribute to [`ContentionSamples`]: a step 10× its
/// uncontended time.
pub const MAX_SLOWDOWN: f64 = 9.0;

/// Contention measured on the cluster: per job observed with `sharing ≥ 2` multi-host jobs on
/// its busiest NIC, its slowdown (extra seconds per step over its uncontended step time, as a
/// fraction of that step time) divided by the `sharing − 1` other jobs. Their mean, never
/// below 0 ([`ContentionSamples::per_shared_job`]), is what
/// [`crate::decide::ClusterState`] carries: multi-host sizes that share a host expect that
/// slowdown, and BCO's costs charge at least that fraction of compute as sync per shared job.
/// The simulator adds its jobs' measured slowdowns; the service adds each running multi-host
/// job's observed step time against the step time predicted by its throughput model fitted
/// on its earlier generations.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ContentionSamples {
    sum: f64,
    count: u64,
}

impl ContentionSamples {
    /// Adds one job's measured slowdown (extra step time as a fraction of its uncontended
    /// step time) while `sharing` multi-host jobs, itself included, share one of its NICs.
    /// Ignored when `sharing < 2` or the figure is not finite. A slowdown is clamped into
    /// `[−1, MAX_SLOWDOWN]` (a job ran faster than predicted counts as negative, so noisy
    /// predictions cancel instead of only pushing the mean up).
    pub fn add(&mut self, slowdown: f64, sharing: u32) {
        if sharing >= 2 && slowdown.is_finite() {
            self.sum += slowdown.clamp(-1.0, MAX_SLOWDOWN) / f64::from(sharing - 1);
            self.count += 1;
        }
    }

    /// Mean slowdown per additional shared job (a fraction of the step time); 0 when nothing
    /// was measured or the mean is negative.
    pub fn per_shared_job(&self) -> f64 {
        if self.count > 0 {
            (self.sum / self.count as f64).max(0.0)
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::throughput::pollux_rows::{Row, pollux_rows, quantile};
    use crate::throughput::{StepObservation, ThroughputPrior};
    use proptest::prelude::*;

    fn rel(a: f64, b: f64) -> f64 {
        (a - b).abs() / b.abs().max(1e-300)
    }

    #[test]
    fn step_time_follows_the_formula() {
        let cost = JobCost {
            compute_s: 1.0,
            overhead_s_per_server: 0.1,
            sync_s: 0.4,
            intra_sync_s: 0.05,
        };
        assert_eq!(cost.step_time_s(1, 1), 1.05);
        assert_eq!(cost.step_time_s(1, 7), 1.05);
        assert_eq!(cost.step_time_s(0, 0), 1.05);
        assert!(rel(cost.step_time_s(2, 1), 1.0 + 0.1 + 0.4) < 1e-15);
        assert!(rel(cost.step_time_s(4, 3), 1.0 + 0.3 + 1.2) < 1e-15);
        assert_eq!(cost.step_time_s(3, 0), cost.step_time_s(3, 1));
        assert!(rel(cost.step_time_with_nic_s(2, 2, 0.5), 1.0 + 0.1 + 1.6) < 1e-15);
        assert_eq!(
            cost.step_time_with_nic_s(2, 2, f64::NAN),
            cost.step_time_s(2, 2)
        );
        assert!(
            rel(
                cost.step_time_with_nic_s(2, 1, 0.0),
                1.1 + 0.4 / MIN_NIC_FACTOR
            ) < 1e-15
        );
        let default = JobCost::default();
        assert_eq!(
            (
                default.compute_s,
                default.overhead_s_per_server,
                default.sync_s,
                default.intra_sync_s
            ),
            (1.0, 0.05, 0.5, 0.0)
        );
    }

    #[test]
    fn nic_factor_examples() {
        assert_eq!(nic_factor(None, 1e9), 1.0);
        assert_eq!(nic_factor(Some(0.0), 1e9), 1.0);
        assert_eq!(nic_factor(Some(f64::NAN), 1e9), 1.0);
        assert_eq!(nic_factor(Some(1.25e9), 0.0), 1.0);
        assert_eq!(nic_factor(Some(1.25e9), -5.0), 1.0);
        assert_eq!(nic_factor(Some(1.25e9), f64::NAN), 1.0);
        assert!(rel(nic_factor(Some(1.25e9), 0.25e9), 0.8) < 1e-15);
        assert_eq!(nic_factor(Some(1.25e9), 2e9), MIN_NIC_FACTOR);
        assert_eq!(nic_factor(Some(1.25e9), f64::INFINITY), MIN_NIC_FACTOR);
        // Busier NIC, smaller factor, slower sync.
        let cost = JobCost::default();
        let idle = cost.step_time_with_nic_s(2, 1, nic_factor(Some(1e10), 1e9));
        let busy = cost.step_time_with_nic_s(2, 1, nic_factor(Some(1e10), 5e9));
        assert!(busy > idle);
    }

    fn wild() -> impl Strategy<Value = f64> {
        prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(f64::MAX),
            Just(-1.0),
            Just(0.0),
            0.0..10.0_f64,
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// At contention 1 the cost reproduces the model it came from.
        #[test]
        fn cost_matches_the_model_at_contention_one(
            theta in prop::array::uniform5(0.0..1.0_f64),
            workers in 1u32..64,
            nodes in 1u32..16,
            batch in 1.0..1000.0_f64,
        ) {
            let model = ThroughputModel::from_coefficients(theta, 0);
            let cost = JobCost::from_model(&model, workers, batch);
            let want = model.step_time_s(workers, nodes, batch);
            prop_assert!(rel(cost.step_time_s(nodes, 1), want) < 1e-12);
        }

        /// Monotone: more contention, a busier NIC, or (for a fixed cost) more servers beyond
        /// the first never make a step faster; the result is always finite and non-negative.
        #[test]
        fn step_time_is_monotone_and_finite(
            fields in (wild(), wild(), wild(), wild()),
            servers in 0u32..100,
            contention in 0u32..100,
            factor in wild(),
            link in prop::option::of(wild()),
            measured in wild(),
        ) {
            let cost = JobCost {
                compute_s: fields.0,
                overhead_s_per_server: fields.1,
                sync_s: fields.2,
                intra_sync_s: fields.3,
            };
            let t = cost.step_time_with_nic_s(servers, contention, factor);
            prop_assert!(t.is_finite() && t >= 0.0, "t = {}", t);
            prop_assert!(cost.step_time_with_nic_s(servers, contention + 1, factor) >= t);
            if servers >= 2 {
                prop_assert!(cost.step_time_with_nic_s(servers + 1, contention, factor) >= t);
            }
            let f = nic_factor(link, measured);
            prop_assert!((MIN_NIC_FACTOR..=1.0).contains(&f), "factor {}", f);
        }
    }

    /// Relative errors of [`JobCost`] (contention 1) for `app`, per row: per per-GPU batch,
    /// a model fitted on the rows of at most `fit_nodes` nodes at that batch predicts every
    /// row at it. Returns `(nodes, signed relative error)` per row.
    fn pollux_errors(app: &str, fit_nodes: u32) -> Vec<(u32, f64)> {
        let rows = pollux_rows(app);
        let mut batches: Vec<f64> = rows.iter().map(|r| r.2).collect();
        batches.sort_by(f64::total_cmp);
        batches.dedup();
        let mut out = Vec::new();
        for b in batches {
            let at_b: Vec<&Row> = rows.iter().filter(|r| r.2 == b).collect();
            let obs: Vec<StepObservation> = at_b
                .iter()
                .filter(|r| r.1 <= fit_nodes)
                .map(|r| StepObservation {
                    workers: r.0,
                    nodes: r.1,
                    local_batch: r.2,
                    step_time_s: r.3,
                    sync_time_s: None,
                })
                .collect();
            let model = ThroughputModel::fit(&obs, &ThroughputPrior::default());
            for r in at_b {
                let cost = JobCost::from_model(&model, r.0, r.2);
                out.push((r.1, (cost.step_time_s(r.1, 1) - r.3) / r.3));
            }
        }
        out
    }

    #[test]
    fn pollux_step_times_at_contention_one() {
        // (app, bound on the median, bound on the 90th percentile of |relative error| over
        // all rows, fitted on 1-2 nodes): a little above what was measured (module docs).
        let bounds = [
            ("bert", 0.52, 0.64),
            ("cifar10", 0.11, 0.38),
            ("deepspeech2", 0.10, 0.30),
            ("imagenet", 0.19, 0.48),
            ("ncf", 0.33, 0.53),
            ("yolov3", 0.40, 0.57),
        ];
        println!(
            "|relative error| median / p90; fitted per per-GPU batch on the 1-2-node rows \
             (last columns: fitted on all rows)"
        );
        println!(
            "{:<12} {:>5}  {:>15}  {:>15}  {:>15}  {:>11}  {:>15}",
            "app", "rows", "all rows", "1-2 nodes", "3-4 nodes", "3-4 signed", "all-rows fit"
        );
        for (app, max_median, max_p90) in bounds {
            let errors = pollux_errors(app, 2);
            let abs = |e: &[(u32, f64)], keep: &dyn Fn(u32) -> bool| -> Vec<f64> {
                e.iter().filter(|x| keep(x.0)).map(|x| x.1.abs()).collect()
            };
            let stats = |v: Vec<f64>| (quantile(v.clone(), 0.5), quantile(v, 0.9));
            let (median, p90) = stats(abs(&errors, &|_| true));
            let near = stats(abs(&errors, &|n| n <= 2));
            let far = stats(abs(&errors, &|n| n > 2));
            let far_signed = quantile(
                errors.iter().filter(|x| x.0 > 2).map(|x| x.1).collect(),
                0.5,
            );
            let in_sample = stats(abs(&pollux_errors(app, u32::MAX), &|_| true));
            let pct = |(m, p): (f64, f64)| format!("{:>5.1}% /{:>5.1}%", 100.0 * m, 100.0 * p);
            println!(
                "{app:<12} {:>5}  {}  {}  {}  {:>+10.1}%  {}",
                errors.len(),
                pct((median, p90)),
                pct(near),
                pct(far),
                100.0 * far_signed,
                pct(in_sample),
            );
            assert!(median < max_median, "{app}: median {median}");
            assert!(p90 < max_p90, "{app}: p90 {p90}");
            // Within the fitted range the model is much closer.
            assert!(near.0 < 0.08 && near.1 < 0.20, "{app}: 1-2 nodes {near:?}");
            // Fitted on all rows, the model form itself fits (module docs).
            assert!(
                in_sample.0 < 0.08 && in_sample.1 < 0.25,
                "{app}: all-rows fit {in_sample:?}"
            );
        }
    }

    fn nic(name: &str, rx: f64, tx: f64, bps: Option<u64>) -> NicSample {
        NicSample {
            name: name.into(),
            rx_bytes_per_s: rx,
            tx_bytes_per_s: tx,
            link_speed_bps: bps,
        }
    }

    #[test]
    fn host_nic_takes_the_fastest_real_nic_and_its_busier_direction() {
        // 10 Gbit/s = 1.25e9 bytes/s; 0.5e9 bytes/s out: factor 1 − 0.4 = 0.6.
        let nics = [
            nic("lo", 9e9, 9e9, Some(100_000_000_000)),
            nic("eth0", 1e8, 5e8, Some(10_000_000_000)),
            nic("eth1", 0.0, 0.0, Some(1_000_000_000)),
            nic("docker0", 1e9, 1e9, None),
        ];
        let h = host_nic(&nics);
        assert_eq!(h.link_bytes_per_s, Some(1.25e9));
        assert!(rel(h.factor, 0.6) < 1e-12, "{}", h.factor);
        // No link speed anywhere (or only loopback): idle.
        let h = host_nic(&[nic("lo", 1e9, 1e9, Some(1)), nic("veth", 1e9, 0.0, None)]);
        assert_eq!(h.link_bytes_per_s, None);
        assert_eq!(h.factor, 1.0);
        assert_eq!(host_nic(&[]).factor, 1.0);
        // A saturated NIC bottoms out at MIN_NIC_FACTOR.
        let h = host_nic(&[nic("eth0", 5e9, 0.0, Some(8_000_000_000))]);
        assert_eq!(h.factor, MIN_NIC_FACTOR);
    }
}

//! `converge-sched`: every scheduling decision of Converge as a pure function of its inputs.
//!
//! The allocator service (`converge-allocator`) and the simulator (`converge-sim`) call the
//! same functions with the same kinds of inputs: [`decide::decide`] (job views → policy →
//! placement requests and costs → placements) inside the service's lifecycle step
//! ([`schedule::step`]) and inside the simulator's interval loop. Nothing here does I/O,
//! reads a clock or draws unseeded randomness; the crate's `Cargo.toml` has no async, I/O,
//! logging or plotting dependency, so purity is enforced by Cargo, not by a comment.
//!
//! | module | what |
//! |---|---|
//! | [`fit`] | loss-curve fits (SLAQ's families), prediction, inversion |
//! | [`fit_cache`] | the caller-owned cache of curve and throughput fits |
//! | [`history`] | a job's progress history (rank 0's curve, generations' step times) |
//! | [`throughput`] | per-job step-time model fitted by NNLS |
//! | [`goodput`] | statistical efficiency and the best batch size per allocation |
//! | [`contention`] | a job's step time on a placement under NIC contention |
//! | [`policies`] | every policy behind the [`policies::Policy`] trait |
//! | [`placement`] | first fit and BCO placement, master ports |
//! | [`decide`] | the decision: job views → policy → placements |
//! | [`schedule`] | the service's lifecycle step around [`decide::decide`] |
//! | [`stop`] | stop criteria: when the allocator ends a job (target, plateau, budget, deadline) |
//! | [`ps_plan`] | parameter-server planner (LP relaxation + rounding) |
//! | [`queues`] | queues: quotas, lending, fair share with usage decay, gang preemption |
//! | `benchgen` | seeded synthetic clusters for the decision benchmarks (feature `benchgen`: tests and the simulator only) |

// No printing outside tests (`clippy.toml` allows it in tests); clocks, files, environment
// and unseeded randomness are refused by `clippy.toml`'s disallowed methods and types.
#![warn(clippy::print_stdout, clippy::print_stderr, clippy::dbg_macro)]

#[cfg(any(test, feature = "benchgen"))]
pub mod benchgen;
pub mod contention;
pub mod decide;
pub mod fit;
pub mod fit_cache;
pub mod goodput;
pub mod gpu_types;
pub mod history;
pub mod outlook;
pub mod placement;
pub mod policies;
pub mod ps_plan;
pub mod queues;
pub mod schedule;
pub mod shadow;
pub mod stop;
pub mod sweep_stop;
pub mod throughput;

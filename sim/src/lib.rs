//! `converge-sim`: the trace-driven simulator and the research benches. The simulator replays
//! a workload on a simulated cluster and asks `converge-sched`'s [`converge_sched::decide`]
//! for every decision, with the inputs the service would have; everything here that is not
//! the decision is the harness: the applications' measured behaviour, workloads, reports,
//! plots and timing.

pub mod apps;
pub mod cli;
pub mod decision_bench;
pub mod engine;
pub mod explore;
pub mod explore_report;
pub mod makespan;
pub mod makespan_bench;
pub mod markdown;
pub mod mixed_report;
pub mod mixed_workload;
pub mod predict;
pub mod predict_bench;
pub mod ps_bench;
pub mod ps_offline;
pub mod queues_bench;
pub mod report;
pub mod summary;
pub mod sweep_world;
#[cfg(test)]
mod test_support;
pub mod workload;
pub mod world;

//! The trace-driven simulator: the same policy and placement code as the service, fed
//! what the service would see, over the measured Pollux workloads.

pub mod apps;
pub mod cli;
pub mod engine;
pub mod report;
pub mod summary;
pub mod workload;

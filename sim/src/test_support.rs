//! What the simulator's unit tests share: the applications of the test traces (loaded once)
//! and the first jobs of the Pollux 1.0× workload 1.

use crate::apps::{Application, load_all};
use crate::workload::{WorkloadJob, read_workload};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

/// The applications of [`crate::apps::test_trace_dirs`], loaded once per test binary.
pub(crate) fn apps() -> &'static BTreeMap<String, Application> {
    static APPS: OnceLock<BTreeMap<String, Application>> = OnceLock::new();
    APPS.get_or_init(|| load_all(&crate::apps::test_trace_dirs()).unwrap())
}

/// The first `n` jobs of `data/pollux/workloads/workload-1.csv`.
pub(crate) fn workload(n: usize) -> Vec<WorkloadJob> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/pollux/workloads/workload-1.csv");
    read_workload(&path).unwrap().into_iter().take(n).collect()
}

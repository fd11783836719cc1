//! Helpers shared by the unit tests.

use converge_common::{JobPhase, JobStatus};

/// A job status at generation 3 with two workers, in `phase`, with `loss`.
pub(crate) fn status(job: &str, phase: JobPhase, loss: Option<f64>) -> JobStatus {
    let mut s: JobStatus = serde_json::from_value(serde_json::json!({
        "job": job, "phase": "pending", "generation": 3, "world_size": 2,
        "placement": [], "step": 10, "samples": 100, "submitted_at": 1.0, "updated_at": 2.0
    }))
    .unwrap();
    s.phase = phase;
    s.loss = loss;
    s
}

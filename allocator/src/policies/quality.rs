//! The quality policy behind the [`Policy`] trait: an adapter over
//! [`crate::policy::quality_allocate`], SLAQ's quality-driven scheduling (Zhang, Stafman, Or,
//! Freedman, "SLAQ: Quality-Driven Scheduling for Distributed Machine Learning", SoCC'17)
//! with a restart cost. See [`crate::policy`] for the algorithm; nothing is changed here.

use crate::policy::{Decision, PolicyJob, PolicyParams, quality_allocate};

use super::{ClusterView, Policy};

/// SLAQ's quality policy with the given settings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Quality {
    /// Settings of the quality policy (horizon, restart cost, priors).
    pub params: PolicyParams,
}

impl Policy for Quality {
    fn name(&self) -> &'static str {
        "quality"
    }

    fn allocate(&self, cluster: &ClusterView, jobs: &[PolicyJob]) -> Decision {
        quality_allocate(cluster, jobs, &self.params)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{cluster, job};
    use super::*;

    #[test]
    fn the_adapter_decides_as_quality_allocate_with_its_params() {
        let mut running = job("running", 0.0, 1, 8);
        running.current_workers = 2;
        let jobs = [running, job("new", 1.0, 1, 8), job("later", 2.0, 1, 3)];
        for restart_cost_s in [0.0, 30.0, 90.0] {
            let params = PolicyParams {
                restart_cost_s,
                ..PolicyParams::default()
            };
            for total_gpus in [0, 3, 8, 13] {
                let policy = Quality { params };
                assert_eq!(
                    policy.allocate(&cluster(total_gpus), &jobs),
                    quality_allocate(&cluster(total_gpus), &jobs, &params),
                );
            }
        }
        // The params reach the policy: a restart as long as the horizon freezes a running job.
        let frozen = Quality {
            params: PolicyParams {
                restart_cost_s: 60.0,
                ..PolicyParams::default()
            },
        };
        let decision = frozen.allocate(&cluster(8), &jobs[..1]);
        assert_eq!(decision.workers.values().copied().collect::<Vec<_>>(), [2]);
        let free = Quality {
            params: PolicyParams {
                restart_cost_s: 0.0,
                ..PolicyParams::default()
            },
        };
        let decision = free.allocate(&cluster(8), &jobs[..1]);
        assert_eq!(decision.workers.values().copied().collect::<Vec<_>>(), [8]);
    }
}

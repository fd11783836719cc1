//! NATS subject, stream and KV bucket names of protocol v1. Every name any process uses is
//! built here; see `docs/protocol.md` for who writes and who reads each.

use crate::ids::{HostId, JobId};

/// Prefix of every subject.
pub const PREFIX: &str = "converge.v1";

/// Core subject of a host's telemetry (also its heartbeat): `converge.v1.telemetry.<host>`.
pub fn telemetry(host: &HostId) -> String {
    format!("{PREFIX}.telemetry.{host}")
}
/// Wildcard over all hosts' telemetry.
pub const TELEMETRY_ALL: &str = "converge.v1.telemetry.*";

/// JetStream subject of a job's progress reports: `converge.v1.progress.<job>`.
pub fn progress(job: &JobId) -> String {
    format!("{PREFIX}.progress.{job}")
}
/// Wildcard over all jobs' progress.
pub const PROGRESS_ALL: &str = "converge.v1.progress.*";
/// JetStream stream holding progress reports.
pub const PROGRESS_STREAM: &str = "CONVERGE_PROGRESS";
/// Progress reports kept per job (per subject) in the stream.
pub const PROGRESS_MAX_PER_JOB: i64 = 5_000;
/// Age after which progress reports leave the stream, in seconds (7 days).
pub const PROGRESS_MAX_AGE_S: u64 = 7 * 24 * 3600;

/// Core subject of events about a job: `converge.v1.events.job.<job>`.
pub fn job_events(job: &JobId) -> String {
    format!("{PREFIX}.events.job.{job}")
}
/// Core subject of events about a host: `converge.v1.events.host.<host>`.
pub fn host_events(host: &HostId) -> String {
    format!("{PREFIX}.events.host.{host}")
}
/// Wildcard over all events.
pub const EVENTS_ALL: &str = "converge.v1.events.>";

/// KV bucket of job specs, key = job id. Written by the CLI, read by the allocator.
pub const BUCKET_JOBS: &str = "converge-jobs";
/// KV bucket of job statuses, key = job id. Written by the allocator only.
pub const BUCKET_JOB_STATUS: &str = "converge-job-status";
/// KV bucket of host plans, key = host id. Written by the allocator, read by each agent.
pub const BUCKET_PLANS: &str = "converge-plans";
/// KV bucket of the latest telemetry per host, key = host id. Written by each agent.
pub const BUCKET_HOSTS: &str = "converge-hosts";

/// KV bucket of the allocator leader's lease ([`crate::LeaderLease`]), key [`LEADER_KEY`].
/// Written by allocator replicas only; created by the allocator.
pub const BUCKET_LEADER: &str = "converge-leader";
/// The key of the lease in [`BUCKET_LEADER`].
pub const LEADER_KEY: &str = "allocator";

/// All KV buckets of protocol v1.
pub const ALL_BUCKETS: [&str; 4] = [BUCKET_JOBS, BUCKET_JOB_STATUS, BUCKET_PLANS, BUCKET_HOSTS];

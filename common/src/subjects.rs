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

/// JetStream subject of the progress reports of a job's workers on one host:
/// `converge.v1.progress.<job>.<host>`. An agent publishes only on its own host's subjects
/// (the NATS permissions of a secured server say so), so the host token names the sender;
/// the report's `host` field must equal it.
pub fn progress(job: &JobId, host: &HostId) -> String {
    format!("{PREFIX}.progress.{job}.{host}")
}
/// Wildcard over one job's progress, all hosts: `converge.v1.progress.<job>.*`.
pub fn progress_of_job(job: &JobId) -> String {
    format!("{PREFIX}.progress.{job}.*")
}
/// The progress subject of releases before [`progress`] named the host,
/// `converge.v1.progress.<job>`: no longer one of the stream's subjects, read only in the
/// reports an updated stream still holds.
pub fn progress_without_host(job: &JobId) -> String {
    format!("{PREFIX}.progress.{job}")
}
/// Wildcard over all jobs' and hosts' progress: the subjects of [`PROGRESS_STREAM`].
pub const PROGRESS_ALL: &str = "converge.v1.progress.*.*";
/// JetStream stream holding progress reports.
pub const PROGRESS_STREAM: &str = "CONVERGE_PROGRESS";
/// Progress reports kept per subject, i.e. per job and host, in the stream. A job's
/// history is bounded by this times the hosts it has run on; rank 0's host keeps at least
/// as many of rank 0's reports as the per-job bound of 5,000 did before the subjects named
/// the host (the host's other ranks share its subject, no other host's do).
pub const PROGRESS_MAX_PER_JOB_AND_HOST: i64 = 5_000;
/// Age after which progress reports leave the stream, in seconds (7 days).
pub const PROGRESS_MAX_AGE_S: u64 = 7 * 24 * 3600;
/// Largest progress report the stream stores, in bytes (64 KiB: the agent's own limit on a
/// worker's line; a report is a few hundred bytes). The server refuses a larger publish.
pub const PROGRESS_MAX_MESSAGE_BYTES: i32 = 64 * 1024;
/// Most bytes the progress stream holds (2 GiB, about 7 million reports); beyond it the
/// oldest reports go first. However many subjects an agent makes up on its own host's
/// subjects, the stream cannot take the server's storage from the buckets (heartbeats,
/// plans, statuses).
pub const PROGRESS_MAX_BYTES: i64 = 2 * 1024 * 1024 * 1024;

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

/// KV bucket of queues ([`crate::QueueSpec`]), key = queue name. Written by the CLI
/// (`converge queue create|set|delete`), read by the allocator.
pub const BUCKET_QUEUES: &str = "converge-queues";
/// KV bucket of what each queue holds ([`crate::QueueStatus`]), key = queue name. Written
/// by the allocator only; read by the CLI and the allocator's next leader (decayed usage).
pub const BUCKET_QUEUE_STATUS: &str = "converge-queue-status";

/// KV bucket of the allocator leader's lease ([`crate::LeaderLease`]), key [`LEADER_KEY`].
/// Written by allocator replicas only; created by the allocator.
pub const BUCKET_LEADER: &str = "converge-leader";
/// The key of the lease in [`BUCKET_LEADER`].
pub const LEADER_KEY: &str = "allocator";

/// The KV buckets every process opens (`converge_bus::Bus::open_with`).
pub const ALL_BUCKETS: [&str; 4] = [BUCKET_JOBS, BUCKET_JOB_STATUS, BUCKET_PLANS, BUCKET_HOSTS];
/// The queue buckets: created by the allocator with the others, opened by the allocator
/// and the CLI only (`converge_bus::Bus::open_queues`); agents have no permission on them.
pub const QUEUE_BUCKETS: [&str; 2] = [BUCKET_QUEUES, BUCKET_QUEUE_STATUS];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_subjects_name_job_and_host() {
        let job: JobId = "mnist-1".parse().unwrap();
        let host: HostId = "node_2".parse().unwrap();
        let subject = progress(&job, &host);
        assert_eq!(subject, "converge.v1.progress.mnist-1.node_2");
        assert_eq!(progress_of_job(&job), "converge.v1.progress.mnist-1.*");
    }
}

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

/// Storage bounds of a KV bucket's stream, per replica. A bucket at `max_bytes` refuses
/// puts (discard new): new keys, and, depending on the NATS version and the replicas, new
/// revisions of existing keys too; the bounds are set far above what a cluster stores, so
/// that they stop a flood rather than normal use. A value over `max_value_bytes` is refused
/// by the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketBounds {
    /// Most bytes the bucket's stream holds, per replica (a NATS account reserves this
    /// times the replicas from its JetStream storage when the stream is created).
    pub max_bytes: i64,
    /// Largest value stored, in bytes.
    pub max_value_bytes: i32,
}

const MIB: i64 = 1024 * 1024;

/// The bounds of `bucket` (one of [`ALL_BUCKETS`], [`QUEUE_BUCKETS`] or [`BUCKET_LEADER`]).
/// Measured on a one-host cluster (2026-11-28, `/jsz`): a heartbeat of a host with 8 GPUs
/// is about 3.3 KiB, a plan 1 KiB, a job status 1 KiB (the status bucket keeps one revision
/// a job), a job spec 350 bytes. So the status bucket holds about a million jobs' statuses
/// and the spec bucket about as many specs; the hosts and plans buckets hold tens of
/// thousands of hosts. Job specs and statuses are kept after a job ends (no retention
/// yet): a cluster that reaches these bounds refuses new jobs. The heartbeat, which agents write, has a value bound below the codec's
/// [`crate::MAX_MESSAGE_BYTES`]: 128 KiB, about 40 times a real one, so that one
/// compromised agent cannot store a 1 MiB heartbeat; so do queues (64 KiB) and the lease
/// (4 KiB), whose values have a fixed size.
pub fn bucket_bounds(bucket: &str) -> BucketBounds {
    let codec = crate::MAX_MESSAGE_BYTES as i32;
    let (max_bytes, max_value_bytes) = match bucket {
        BUCKET_HOSTS => (128 * MIB, 128 * 1024),
        BUCKET_PLANS => (256 * MIB, codec),
        BUCKET_JOBS => (512 * MIB, codec),
        BUCKET_JOB_STATUS => (1024 * MIB, codec),
        // A queue and its status are a few hundred bytes, whatever the queue holds.
        BUCKET_QUEUES | BUCKET_QUEUE_STATUS => (16 * MIB, 64 * 1024),
        BUCKET_LEADER => (MIB, 4096),
        _ => (256 * MIB, codec),
    };
    BucketBounds {
        max_bytes,
        max_value_bytes,
    }
}

/// Bytes the protocol's streams reserve per replica in all: every bucket's `max_bytes` and
/// the progress stream's [`PROGRESS_MAX_BYTES`] (about 3.9 GiB). A NATS account needs this
/// times `--bus-replicas` of JetStream file storage (gen-config.sh's `--max-store`, 16 GB
/// by default, holds it three times).
pub fn reserved_bytes() -> i64 {
    ALL_BUCKETS
        .into_iter()
        .chain(QUEUE_BUCKETS)
        .chain([BUCKET_LEADER])
        .map(|b| bucket_bounds(b).max_bytes)
        .sum::<i64>()
        + PROGRESS_MAX_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_streams_fit_three_times_in_the_default_account_storage() {
        // gen-config.sh --max-store 16G, as NATS reads it.
        let default_max_store = 16_000_000_000_i64;
        assert!(
            3 * reserved_bytes() <= default_max_store,
            "{}",
            reserved_bytes()
        );
        for b in ALL_BUCKETS
            .into_iter()
            .chain(QUEUE_BUCKETS)
            .chain([BUCKET_LEADER])
        {
            let bounds = bucket_bounds(b);
            assert!(
                bounds.max_bytes >= 256 * i64::from(bounds.max_value_bytes),
                "{b}"
            );
        }
        assert_eq!(bucket_bounds(BUCKET_HOSTS).max_value_bytes, 128 * 1024);
    }

    #[test]
    fn progress_subjects_name_job_and_host() {
        let job: JobId = "mnist-1".parse().unwrap();
        let host: HostId = "node_2".parse().unwrap();
        let subject = progress(&job, &host);
        assert_eq!(subject, "converge.v1.progress.mnist-1.node_2");
        assert_eq!(progress_of_job(&job), "converge.v1.progress.mnist-1.*");
    }
}

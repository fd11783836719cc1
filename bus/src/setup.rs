//! Creating, opening or updating the protocol's JetStream streams: the KV buckets' and the
//! progress stream's configurations, and [`Setup`] (create or update, or open or create),
//! retried while a cluster cannot place them yet.

use crate::{BusError, Denial, DenialKind, Denials};
use async_nats::jetstream::{self, stream};
use backon::{ExponentialBuilder, Retryable};
use converge_common::subjects;
use std::time::Duration;

/// How [`Bus::open_with`](crate::Bus::open_with) treats the buckets and the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    /// Create what is missing and update what exists to this build's configuration: the
    /// allocator, which owns them (and every process before security existed).
    CreateOrUpdate,
    /// Open what exists, create only what is missing: agents and the CLI, whose NATS users
    /// on a secured server may read the buckets' configuration but not change it. A
    /// missing bucket such a user may not create is [`BusError::Missing`].
    OpenOrCreate,
}

/// The stream behind KV `bucket`: what async-nats' `kv::Config` would make of the bucket's
/// settings (history, age, value size and bytes from [`subjects::bucket_bounds`], direct
/// gets, `deny_delete`, discard new), except that
/// **rollups are refused** (`allow_rollup_hdrs: false`). A KV bucket created by a client
/// allows a message with the header `Nats-Rollup: all` on any key the publisher may write to
/// purge every other key of the bucket: an agent could drop every host's heartbeat, the CLI
/// every job spec. No Converge process purges a key (`kv.purge` is the one KV operation that
/// needs a rollup; deletes are `KV-Operation: DEL` markers), so the buckets need none.
pub fn kv_stream_config(bucket: &str) -> stream::Config {
    let (description, history, max_age) = match bucket {
        subjects::BUCKET_HOSTS => (
            "latest telemetry per host (heartbeat)",
            1,
            Duration::from_secs(24 * 3600),
        ),
        subjects::BUCKET_PLANS => ("desired workers per host", 5, Duration::ZERO),
        subjects::BUCKET_JOBS => ("job specs", 5, Duration::ZERO),
        subjects::BUCKET_QUEUES => (
            "queues: quota, borrowing limit, weight (converge queue)",
            5,
            Duration::ZERO,
        ),
        subjects::BUCKET_QUEUE_STATUS => (
            "what each queue holds, written by the allocator",
            5,
            Duration::ZERO,
        ),
        // One revision: nothing reads a status's history, and a job costs one status.
        _ => ("job statuses", 1, Duration::ZERO),
    };
    let bounds = subjects::bucket_bounds(bucket);
    stream::Config {
        name: format!("KV_{bucket}"),
        description: Some(description.to_string()),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: history,
        max_age,
        max_message_size: bounds.max_value_bytes,
        max_bytes: bounds.max_bytes,
        allow_rollup: false,
        deny_delete: true,
        deny_purge: false,
        allow_direct: true,
        // Bus::open_with sets --bus-replicas.
        num_replicas: 1,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    }
}

/// The progress stream: one subject per job and host ([`subjects::PROGRESS_ALL`]), at most
/// [`subjects::PROGRESS_MAX_PER_JOB_AND_HOST`] reports per subject, 7 days, reports of at
/// most [`subjects::PROGRESS_MAX_MESSAGE_BYTES`], [`subjects::PROGRESS_MAX_BYTES`] in all
/// (oldest out first); no rollups.
pub fn progress_stream_config() -> stream::Config {
    stream::Config {
        name: subjects::PROGRESS_STREAM.to_string(),
        description: Some("training progress reports, one per worker progress line".into()),
        subjects: vec![subjects::PROGRESS_ALL.to_string()],
        max_messages_per_subject: subjects::PROGRESS_MAX_PER_JOB_AND_HOST,
        max_age: Duration::from_secs(subjects::PROGRESS_MAX_AGE_S),
        max_message_size: subjects::PROGRESS_MAX_MESSAGE_BYTES,
        max_bytes: subjects::PROGRESS_MAX_BYTES,
        discard: stream::DiscardPolicy::Old,
        allow_rollup: false,
        // Read by sequence with direct gets while the allocator's consumer cannot deliver
        // (a NATS cluster that lost a server: `read_after`).
        allow_direct: true,
        ..Default::default()
    }
}

fn is_js_api(d: &Denial) -> bool {
    d.kind == DenialKind::Publish && d.subject.starts_with("$JS.API.")
}

/// Whether a stream lookup failed because the stream does not exist.
fn stream_not_found(e: &jetstream::context::GetStreamError) -> bool {
    use jetstream::context::GetStreamErrorKind;
    match e.kind() {
        GetStreamErrorKind::JetStream(js) => {
            js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
        }
        _ => false,
    }
}

/// How long [`ensure_stream`] retries while JetStream cannot place a stream yet (a cluster
/// whose servers are still starting, electing a leader or catching up).
const SETUP_PATIENCE: Duration = Duration::from_secs(30);

/// Why creating or updating a stream failed: worth another try, or not.
enum SetupFailure {
    /// JetStream is not ready: no meta leader yet, too few servers known for the replicas,
    /// a request timed out. Retried for [`SETUP_PATIENCE`].
    NotReady(String),
    /// Anything else, including a permissions violation.
    Fatal(BusError),
}

/// Whether a JetStream error code says "not ready yet" rather than "wrong".
fn js_not_ready(code: jetstream::ErrorCode) -> bool {
    use jetstream::ErrorCode as C;
    [
        C::CLUSTER_NOT_AVAILABLE,
        C::CLUSTER_NO_PEERS,
        C::CLUSTER_INCOMPLETE,
        C::CLUSTER_NOT_LEADER,
        C::INSUFFICIENT_RESOURCES,
    ]
    .contains(&code)
}

fn create_failure(e: &jetstream::context::CreateStreamError) -> Option<String> {
    use jetstream::context::CreateStreamErrorKind as K;
    match e.kind() {
        K::JetStream(js) if js_not_ready(js.error_code()) => Some(e.to_string()),
        K::TimedOut | K::JetStreamUnavailable => Some(e.to_string()),
        _ => None,
    }
}

/// A stream creation's error, with what to do when the account or the server has too
/// little JetStream storage for the streams' reservations (error 10047).
fn with_storage_hint(e: &jetstream::context::CreateStreamError) -> String {
    use jetstream::context::CreateStreamErrorKind as K;
    match e.kind() {
        K::JetStream(js) if js.error_code() == jetstream::ErrorCode::STORAGE_RESOURCES_EXCEEDED => {
            format!(
                "{e}: Converge's streams reserve {} MiB per replica (docs/deploy.md, \
                 \"Storage\"): raise deploy/nats/gen-config.sh --max-store or the server's \
                 max_file_store",
                subjects::reserved_bytes() / (1024 * 1024)
            )
        }
        _ => e.to_string(),
    }
}

/// [`ensure_stream`] for KV bucket `bucket` ([`kv_stream_config`]) with `replicas`
/// replicas; returns the bucket's name in messages, `KV bucket <bucket>`.
pub(crate) async fn ensure_bucket(
    js: &jetstream::Context,
    denials: &Denials,
    setup: Setup,
    bucket: &str,
    replicas: usize,
) -> Result<String, BusError> {
    let what = format!("KV bucket {bucket}");
    let config = stream::Config {
        num_replicas: replicas,
        ..kv_stream_config(bucket)
    };
    ensure_stream(js, denials, setup, config, &what).await?;
    Ok(what)
}

/// Makes sure the stream `config` describes exists as `setup` says: created or updated to
/// `config` ([`Setup::CreateOrUpdate`]), or opened as it is and created only when missing
/// ([`Setup::OpenOrCreate`]). `what` names it in errors; a permissions violation becomes
/// [`BusError::Denied`] (or [`BusError::Missing`] when a missing stream may not be created).
///
/// Replicas: an existing stream whose replicas differ from `config.num_replicas` is
/// changed in place with [`Setup::CreateOrUpdate`] (JetStream copies its messages to the
/// new peers; logged), and only reported with [`Setup::OpenOrCreate`]. While JetStream
/// cannot place the stream yet (a cluster still forming, fewer servers up than replicas)
/// the attempt is repeated for [`SETUP_PATIENCE`]; after that the error says what to do.
pub(crate) async fn ensure_stream(
    js: &jetstream::Context,
    denials: &Denials,
    setup: Setup,
    config: stream::Config,
    what: &str,
) -> Result<(), BusError> {
    let replicas = config.num_replicas;
    let attempt = || ensure_stream_once(js, denials, setup, config.clone(), what);
    let backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(250))
        .with_max_delay(Duration::from_secs(2))
        .with_total_delay(Some(SETUP_PATIENCE))
        .without_max_times();
    let result = attempt
        .retry(backoff)
        .when(|e| matches!(e, SetupFailure::NotReady(_)))
        .notify(|e, after| {
            if let SetupFailure::NotReady(m) = e {
                tracing::warn!("{what} not ready ({m}); trying again in {after:?}");
            }
        })
        .await;
    match result {
        Ok(()) => Ok(()),
        Err(SetupFailure::Fatal(e)) => Err(e),
        Err(SetupFailure::NotReady(message)) => Err(BusError::Setup {
            what: what.to_string(),
            message: format!(
                "{message}, still after {SETUP_PATIENCE:?}; with {replicas} replica(s) \
                 (--bus-replicas, CONVERGE_BUS_REPLICAS) it needs a NATS cluster of at least \
                 {replicas} JetStream server(s) up and routed to each other: start the \
                 missing servers or lower --bus-replicas; or the NATS account or server \
                 lacks storage: Converge's streams reserve {} MiB per replica (raise \
                 deploy/nats/gen-config.sh --max-store or the server's max_file_store)",
                subjects::reserved_bytes() / (1024 * 1024)
            ),
        }),
    }
}

async fn ensure_stream_once(
    js: &jetstream::Context,
    denials: &Denials,
    setup: Setup,
    config: stream::Config,
    what: &str,
) -> Result<(), SetupFailure> {
    let fatal = |message: String| {
        SetupFailure::Fatal(BusError::Setup {
            what: what.to_string(),
            message,
        })
    };
    let create_err = |e: jetstream::context::CreateStreamError| match create_failure(&e) {
        Some(m) => SetupFailure::NotReady(m),
        None => fatal(with_storage_hint(&e)),
    };
    let wanted = config.num_replicas;
    let found = denials
        .guard(is_js_api, js.get_stream(config.name.clone()))
        .await
        .map_err(|denial| {
            SetupFailure::Fatal(BusError::Denied {
                action: format!("reading the configuration of {what}"),
                denial,
            })
        })?;
    let existing = match found {
        Ok(stream) => Some(stream.cached_info().clone()),
        Err(e) if stream_not_found(&e) => None,
        Err(e) => {
            use jetstream::context::GetStreamErrorKind as K;
            return Err(match e.kind() {
                K::JetStream(js) if js_not_ready(js.error_code()) => {
                    SetupFailure::NotReady(e.to_string())
                }
                K::Request => SetupFailure::NotReady(e.to_string()),
                _ => fatal(e.to_string()),
            });
        }
    };
    match (setup, existing) {
        (Setup::OpenOrCreate, Some(info)) => {
            if info.config.num_replicas != wanted {
                tracing::info!(
                    "{what} has {} replica(s), --bus-replicas says {wanted}: the allocator \
                     (which owns it) changes it when it starts with --bus-replicas {wanted}",
                    info.config.num_replicas
                );
            }
            Ok(())
        }
        (Setup::OpenOrCreate, None) => {
            let created = denials
                .guard(is_js_api, js.get_or_create_stream(config))
                .await
                .map_err(|denial| {
                    SetupFailure::Fatal(BusError::Missing {
                        what: what.to_string(),
                        denial,
                    })
                })?;
            match created {
                Ok(_) => {
                    tracing::info!("created {what} with {wanted} replica(s)");
                    Ok(())
                }
                Err(e) => match e.kind() {
                    jetstream::context::CreateStreamErrorKind::JetStream(js)
                        if js_not_ready(js.error_code()) =>
                    {
                        Err(SetupFailure::NotReady(e.to_string()))
                    }
                    _ => Err(fatal(with_storage_hint(&e))),
                },
            }
        }
        (Setup::CreateOrUpdate, existing) => {
            let before = existing.as_ref().map(|i| i.config.num_replicas);
            let info = denials
                .guard(is_js_api, js.create_or_update_stream(config))
                .await
                .map_err(|denial| {
                    SetupFailure::Fatal(BusError::Denied {
                        action: format!("creating or updating {what}"),
                        denial,
                    })
                })?
                .map_err(create_err)?;
            let leader = info
                .cluster
                .as_ref()
                .and_then(|c| c.leader.clone())
                .unwrap_or_else(|| "-".into());
            match before {
                None => tracing::info!(
                    leader,
                    "created {what} with {} replica(s)",
                    info.config.num_replicas
                ),
                Some(b) if b != info.config.num_replicas => tracing::info!(
                    leader,
                    "changed {what} from {b} to {} replica(s) in place (JetStream copies \
                     its messages to the new replicas)",
                    info.config.num_replicas
                ),
                Some(_) => tracing::debug!(leader, "{what}: {wanted} replica(s)"),
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_and_stream_refuse_rollups() {
        for bucket in subjects::ALL_BUCKETS
            .into_iter()
            .chain(subjects::QUEUE_BUCKETS)
        {
            let c = kv_stream_config(bucket);
            assert!(
                !c.allow_rollup && c.deny_delete && c.allow_direct,
                "{bucket}"
            );
            assert_eq!(c.subjects, [format!("$KV.{bucket}.>")]);
            assert!(c.max_bytes > 0 && c.max_message_size > 0, "{bucket}");
        }
        let c = progress_stream_config();
        assert!(!c.allow_rollup && c.allow_direct);
        assert_eq!(c.subjects, [subjects::PROGRESS_ALL]);
    }
}

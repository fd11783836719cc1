//! The [`Bus`] handle on the protocol's JetStream objects: opening its buckets and stream
//! (and the queue buckets apart, [`QueueBuckets`]), and running operations the server's
//! permissions may refuse.

use crate::setup::{ensure_bucket, ensure_stream, progress_stream_config};
use crate::{BusError, Denials, NatsArgs, Setup, connect_tracked};
use async_nats::jetstream::{self, kv, stream};
use converge_common::subjects;

/// Handles on the queue buckets ([`Bus::open_queues`]): the allocator and the CLI open them,
/// agents never do (their NATS users have no permission on them).
#[derive(Clone)]
pub struct QueueBuckets {
    /// KV `converge-queues`: queue specs, key = queue name (written by `converge queue`).
    pub queues: kv::Store,
    /// KV `converge-queue-status`: what each queue holds (written by the allocator only).
    pub status: kv::Store,
}

impl std::fmt::Debug for QueueBuckets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueBuckets").finish_non_exhaustive()
    }
}

/// Handles on the protocol's JetStream objects.
#[derive(Clone)]
pub struct Bus {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    /// KV `converge-jobs`: job specs.
    pub jobs: kv::Store,
    /// KV `converge-job-status`: job statuses.
    pub status: kv::Store,
    /// KV `converge-plans`: host plans.
    pub plans: kv::Store,
    /// KV `converge-hosts`: latest telemetry per host (heartbeat).
    pub hosts: kv::Store,
    /// The connection's permission violations (empty for a bus from [`Bus::open`]).
    pub denials: Denials,
    /// Replicas of the buckets and the stream (`--bus-replicas`): what this process creates
    /// other buckets with (the allocator's leader lease, for one).
    pub replicas: usize,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bus").finish_non_exhaustive()
    }
}

impl Bus {
    /// Creates (or opens, if they exist) the four KV buckets and the progress stream,
    /// updating existing buckets to this build's configuration ([`Setup::CreateOrUpdate`]).
    /// Idempotent. Permission violations are not tracked: use [`Bus::connect`] for that.
    pub async fn open(client: async_nats::Client) -> Result<Self, BusError> {
        Self::open_with(client, Denials::new(), Setup::CreateOrUpdate, 1).await
    }

    /// Connects as `name` ([`connect_tracked`]) and opens the buckets and the stream as
    /// `setup` says. Operations on the returned bus that the server's permissions refuse
    /// fail at once with [`BusError::Denied`].
    pub async fn connect(args: &NatsArgs, name: &str, setup: Setup) -> Result<Self, BusError> {
        let (client, denials) = connect_tracked(args, name).await?;
        Self::open_with(client, denials, setup, usize::from(args.replicas)).await
    }

    /// Opens the four KV buckets and the progress stream as `setup` says, with `replicas`
    /// replicas where this creates or updates them (see `ensure_stream`); `denials` are
    /// the connection's permission violations (from [`connect_tracked`]).
    pub async fn open_with(
        client: async_nats::Client,
        denials: Denials,
        setup: Setup,
        replicas: usize,
    ) -> Result<Self, BusError> {
        let js = jetstream::new(client.clone());
        let setup_err = |what: String, message: String| BusError::Setup { what, message };
        let info = client.server_info();
        if setup == Setup::CreateOrUpdate {
            match &info.cluster {
                Some(cluster) if replicas == 1 => tracing::warn!(
                    "NATS server {} is part of cluster {cluster}, but the buckets and the \
                     progress stream keep 1 replica (--bus-replicas 1): they become \
                     unavailable whenever that one server is down; set --bus-replicas 3 \
                     (CONVERGE_BUS_REPLICAS) on a cluster of three or more servers",
                    info.server_name
                ),
                _ => tracing::info!(
                    cluster = info.cluster.as_deref().unwrap_or("-"),
                    "buckets and progress stream with {replicas} replica(s) (--bus-replicas)"
                ),
            }
        }
        let mut stores = Vec::new();
        for bucket in subjects::ALL_BUCKETS {
            let what = ensure_bucket(&js, &denials, setup, bucket, replicas).await?;
            let store = js
                .get_key_value(bucket)
                .await
                .map_err(|e| setup_err(what, e.to_string()))?;
            stores.push(store);
        }
        // Also moves a stream of an older release to this one's subjects and limits in place
        // (with `Setup::CreateOrUpdate`): the reports it holds stay.
        let what = format!("stream {}", subjects::PROGRESS_STREAM);
        let config = stream::Config {
            num_replicas: replicas,
            ..progress_stream_config()
        };
        ensure_stream(&js, &denials, setup, config, &what).await?;
        // The allocator owns the queue buckets too: it creates them at start, so that the
        // CLI of a secured cluster finds them. Agents never open them.
        if setup == Setup::CreateOrUpdate {
            for bucket in subjects::QUEUE_BUCKETS {
                ensure_bucket(&js, &denials, setup, bucket, replicas).await?;
            }
        }
        let mut it = stores.into_iter();
        let mut next = || it.next().expect("four buckets");
        Ok(Self {
            jobs: next(),
            status: next(),
            plans: next(),
            hosts: next(),
            client,
            js,
            denials,
            replicas,
        })
    }

    /// Opens the queue buckets (KV `converge-queues` and `converge-queue-status`) as `setup`
    /// says: the allocator with [`Setup::CreateOrUpdate`] (which [`Bus::open_with`] has
    /// already done for it), the CLI with [`Setup::OpenOrCreate`]. On a secured server a
    /// missing bucket is [`BusError::Missing`] for the CLI (start the allocator first).
    pub async fn open_queues(&self, setup: Setup) -> Result<QueueBuckets, BusError> {
        let mut stores = Vec::new();
        for bucket in subjects::QUEUE_BUCKETS {
            let what = ensure_bucket(&self.js, &self.denials, setup, bucket, self.replicas).await?;
            let store = self
                .js
                .get_key_value(bucket)
                .await
                .map_err(|e| BusError::Setup {
                    what,
                    message: e.to_string(),
                })?;
            stores.push(store);
        }
        let mut it = stores.into_iter();
        let mut next = || it.next().expect("two buckets");
        Ok(QueueBuckets {
            queues: next(),
            status: next(),
        })
    }

    /// Runs `fut`, an operation that publishes to `subject`; a permissions violation the
    /// server reports for `subject` meanwhile ends it with [`BusError::Denied`].
    pub async fn refusable<T>(
        &self,
        action: impl Fn() -> String,
        subject: &str,
        fut: impl std::future::Future<Output = Result<T, BusError>>,
    ) -> Result<T, BusError> {
        self.denials
            .guard(|d| d.subject == subject, fut)
            .await
            .map_err(|denial| BusError::Denied {
                action: action(),
                denial,
            })?
    }
}

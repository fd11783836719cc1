//! Small NATS helpers shared by Converge's binaries: connecting with retry (with user and
//! password, a credentials file or an nkey, optionally over TLS), creating or opening the
//! protocol's KV buckets and progress stream, typed KV reads/writes, watches and publishes,
//! permission violations turned into errors, and counting rejected messages.
//!
//! Kept out of `converge-common` so that `common` stays free of async dependencies.

mod denials;
pub mod metrics;
mod secure;

use async_nats::jetstream::{self, kv, stream};
use backon::{ExponentialBuilder, Retryable};
use bytes::Bytes;
use converge_common::messages::{DecodeError, Message, decode, encode};
use converge_common::subjects;
use futures::StreamExt;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

pub use async_nats;
pub use denials::{Denial, DenialKind, Denials};
pub use secure::{Secret, redact_url, url_user};

/// Prefix of the JetStream API subjects (no JetStream domain).
const JS_API: &str = "$JS.API";

/// Default NATS URL of every binary.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// How to reach NATS and as whom; flattened into each binary's command line. Secrets never
/// appear in `Debug` output or error messages (the URL's password is shown as `***`).
/// See `docs/security.md` for the users and permissions of a secured cluster.
#[derive(Clone, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated: give every server of a NATS cluster
    /// (`nats://n1:4222,nats://n2:4222,nats://n3:4222`), so that this process connects to
    /// any of them and reconnects to a surviving one when its server goes away. With
    /// several URLs the client uses exactly these (servers the cluster announces are not
    /// added) and gives up on an unreachable one after 2 s. `nats://user:password@host:port`
    /// works too (credentials in the first URL), and `tls://host:port` requires TLS.
    #[arg(
        long = "nats-url",
        env = "CONVERGE_NATS_URL",
        default_value = DEFAULT_NATS_URL,
        hide_env_values = true
    )]
    pub url: String,
    /// NATS credentials file (JWT + nkey seed), if the server requires one.
    #[arg(
        long = "nats-creds",
        env = "CONVERGE_NATS_CREDS",
        id = "nats_creds",
        value_name = "FILE"
    )]
    pub creds: Option<PathBuf>,
    /// NATS user name (user and password authentication), e.g. `allocator`, `cli` or
    /// `agent-<host>` on a server configured by deploy/nats/gen-config.sh.
    #[arg(
        long = "nats-user",
        env = "CONVERGE_NATS_USER",
        id = "nats_user",
        value_name = "USER",
        conflicts_with_all = ["nats_creds", "nats_nkey"]
    )]
    pub user: Option<String>,
    /// Password of --nats-user. Prefer --nats-password-file: a command line is visible to
    /// every user of the host.
    #[arg(
        long = "nats-password",
        env = "CONVERGE_NATS_PASSWORD",
        id = "nats_password",
        value_name = "PASSWORD",
        hide_env_values = true,
        requires = "nats_user",
        conflicts_with = "nats_password_file"
    )]
    pub password: Option<Secret>,
    /// File holding the password of --nats-user (its first line).
    #[arg(
        long = "nats-password-file",
        env = "CONVERGE_NATS_PASSWORD_FILE",
        id = "nats_password_file",
        value_name = "FILE",
        requires = "nats_user"
    )]
    pub password_file: Option<PathBuf>,
    /// File holding this user's nkey seed (`SU…`), for servers with nkey users.
    #[arg(
        long = "nats-nkey",
        env = "CONVERGE_NATS_NKEY",
        id = "nats_nkey",
        value_name = "FILE",
        conflicts_with = "nats_creds"
    )]
    pub nkey: Option<PathBuf>,
    /// CA certificate (PEM) that signed the server's certificate; requires TLS.
    #[arg(
        long = "nats-tls-ca",
        env = "CONVERGE_NATS_TLS_CA",
        id = "nats_tls_ca",
        value_name = "FILE"
    )]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM), for servers that verify clients; with --nats-tls-key.
    #[arg(
        long = "nats-tls-cert",
        env = "CONVERGE_NATS_TLS_CERT",
        id = "nats_tls_cert",
        value_name = "FILE",
        requires = "nats_tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --nats-tls-cert.
    #[arg(
        long = "nats-tls-key",
        env = "CONVERGE_NATS_TLS_KEY",
        id = "nats_tls_key",
        value_name = "FILE",
        requires = "nats_tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// Prefix of this process's reply subjects; default `_INBOX.<user>` when the user name
    /// is known (--nats-user or the URL), else `_INBOX`. Needed with --nats-creds or
    /// --nats-nkey on a server that restricts inboxes per user.
    #[arg(
        long = "nats-inbox-prefix",
        env = "CONVERGE_NATS_INBOX_PREFIX",
        id = "nats_inbox_prefix",
        value_name = "PREFIX"
    )]
    pub inbox_prefix: Option<String>,
    /// Give up connecting after this long (e.g. `30s`); unset = keep retrying.
    #[arg(long = "nats-connect-timeout", env = "CONVERGE_NATS_CONNECT_TIMEOUT", value_parser = humantime_duration)]
    pub connect_timeout: Option<Duration>,
    /// Replicas (copies on distinct NATS servers) of the KV buckets and the progress
    /// stream: 1 for a single server, 3 for a three-server cluster (then any one server may
    /// fail), at most the number of JetStream servers in the cluster (1 to 5). The
    /// allocator creates them with this many and changes existing ones to it in place; an
    /// agent or the CLI uses it only when it creates a missing one.
    #[arg(
        long = "bus-replicas",
        env = "CONVERGE_BUS_REPLICAS",
        default_value_t = 1,
        value_name = "N",
        value_parser = clap::value_parser!(u8).range(1..=5)
    )]
    pub replicas: u8,
}

impl Default for NatsArgs {
    /// The default URL, no credentials, no TLS, retrying forever.
    fn default() -> Self {
        Self {
            url: DEFAULT_NATS_URL.to_string(),
            creds: None,
            user: None,
            password: None,
            password_file: None,
            nkey: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            inbox_prefix: None,
            connect_timeout: None,
            replicas: 1,
        }
    }
}

impl std::fmt::Debug for NatsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsArgs")
            .field("url", &self.redacted_url())
            .field("creds", &self.creds)
            .field("user", &self.user)
            .field("password", &self.password)
            .field("password_file", &self.password_file)
            .field("nkey", &self.nkey)
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("inbox_prefix", &self.inbox_prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("replicas", &self.replicas)
            .finish()
    }
}

/// Parses a duration such as `500ms`, `10s` or `2m` (humantime syntax) for clap.
pub fn humantime_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (write e.g. 500ms, 10s or 2m)"))
}

/// Errors of the bus helpers, by operation.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// `url` has its password replaced by `***`.
    #[error("cannot connect to NATS at {url}: {source}")]
    Connect {
        url: String,
        source: async_nats::ConnectError,
    },
    /// The server refused the credentials, or the TLS handshake failed: retrying would not
    /// help.
    #[error("NATS at {url} refused the connection ({auth}): {source}; {hint}")]
    Refused {
        url: String,
        auth: String,
        hint: &'static str,
        source: async_nats::ConnectError,
    },
    #[error("cannot read {what} {path}: {source}")]
    File {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("NATS settings: {0}")]
    Config(String),
    #[error(
        "cannot create or open {what}: {message} (is JetStream enabled, `nats-server -js`, version 2.10 or later?)"
    )]
    Setup { what: String, message: String },
    #[error(
        "{what} is missing and this NATS user may not create it ({denial}): start the \
         allocator first, or give this user stream-create rights"
    )]
    Missing { what: String, denial: Denial },
    /// The server refused the operation: the user's permissions do not allow it.
    #[error("NATS refused {action}: {denial} (see docs/security.md for each role's permissions)")]
    Denied { action: String, denial: Denial },
    #[error("KV {bucket}/{key}: {message}")]
    Kv {
        bucket: String,
        key: String,
        message: String,
    },
    #[error("KV {bucket}/{key} holds a value this build refuses: {source}")]
    Decode {
        bucket: String,
        key: String,
        source: DecodeError,
    },
    #[error("publish to {subject}: {message}")]
    Publish { subject: String, message: String },
    /// A compare-and-set write found the key changed since the writer read it (another
    /// writer got there first); nothing was written.
    #[error(
        "KV {bucket}/{key} changed since revision {expected:?} was read (another writer); not written"
    )]
    Conflict {
        bucket: String,
        key: String,
        /// The revision the writer expected; `None`: it expected no value.
        expected: Option<u64>,
    },
}

impl BusError {
    /// Whether the server refused the operation for lack of permissions.
    pub fn is_denied(&self) -> bool {
        matches!(self, Self::Denied { .. } | Self::Missing { .. })
    }
}

/// Connects to NATS as `name`, retrying with capped exponential backoff (0.1 s doubling up
/// to 5 s) until connected or `connect_timeout` passes. Reconnects after a later
/// disconnect are handled by the client. Credentials the server refuses, and TLS failures,
/// end the attempt at once ([`BusError::Refused`]); files named by `args` are read first
/// and a missing or malformed one is reported with the flag that named it.
pub async fn connect(args: &NatsArgs, name: &str) -> Result<async_nats::Client, BusError> {
    connect_tracked(args, name).await.map(|(client, _)| client)
}

/// [`connect`], also returning the connection's permission violations.
pub async fn connect_tracked(
    args: &NatsArgs,
    name: &str,
) -> Result<(async_nats::Client, Denials), BusError> {
    let base = secure::connect_options(args)?;
    let servers = args.server_addrs()?;
    // One server: wait for it as long as a slow TLS handshake may take. Several (a
    // cluster): these and no others (the addresses a cluster announces may not be
    // reachable from here, and an unreachable one would cost a timeout per reconnect), and
    // a dead one abandoned after 2 s (nats.go's default) for the next.
    let several = servers.len() > 1;
    let attempt_timeout = Duration::from_secs(if several { 2 } else { 5 });
    let inbox = format!("{}.", args.inbox_prefix()?);
    let denials = Denials::new();
    let url = args.redacted_url();
    let attempt = || async {
        let reporter = denials.clone();
        let inbox = inbox.clone();
        let mut opts = base
            .clone()
            .name(name)
            .connection_timeout(attempt_timeout)
            .max_reconnects(None)
            .event_callback(move |event| {
                let reporter = reporter.clone();
                let inbox = inbox.clone();
                async move { on_event(event, &reporter, &inbox) }
            });
        if several {
            opts = opts.ignore_discovered_servers();
        }
        opts.connect(servers.clone()).await.map_err(|source| {
            use async_nats::ConnectErrorKind as K;
            let kind = if is_tls_failure(&source) {
                K::Tls
            } else {
                source.kind()
            };
            let hint = match kind {
                K::AuthorizationViolation | K::Authentication => {
                    "check the user and password (--nats-user, --nats-password-file), \
                     --nats-creds or --nats-nkey against the server's configuration"
                }
                K::Tls => {
                    "check --nats-tls-ca (the CA that signed the server's certificate, whose \
                     names must include the host in --nats-url) and the client certificate"
                }
                _ => {
                    return BusError::Connect {
                        url: url.clone(),
                        source,
                    };
                }
            };
            BusError::Refused {
                url: url.clone(),
                auth: secure::describe_auth(args),
                hint,
                source,
            }
        })
    };
    let mut backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .without_max_times();
    if let Some(limit) = args.connect_timeout {
        backoff = backoff.with_total_delay(Some(limit));
    }
    let client = attempt
        .retry(backoff)
        .when(|e| matches!(e, BusError::Connect { .. }))
        .notify(|e, after| tracing::warn!("{e}; retrying in {after:?}"))
        .await?;
    let info = client.server_info();
    tracing::info!(
        server = %info.server_name,
        cluster = info.cluster.as_deref().unwrap_or("-"),
        servers = servers.len(),
        "connected to NATS server {} of {}",
        info.server_name,
        url
    );
    Ok((client, denials))
}

/// Whether connecting failed in the TLS handshake (an untrusted or mismatched certificate,
/// a refused client certificate): the client reports most of these as I/O errors.
fn is_tls_failure(e: &async_nats::ConnectError) -> bool {
    if e.kind() == async_nats::ConnectErrorKind::Tls {
        return true;
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(err) = cause {
        if err.is::<async_nats::rustls::Error>() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io
                .get_ref()
                .is_some_and(|inner| inner.is::<async_nats::rustls::Error>())
        {
            return true;
        }
        cause = err.source();
    }
    false
}

fn on_event(event: async_nats::Event, denials: &Denials, inbox: &str) {
    use async_nats::{Event, ServerError};
    match event {
        Event::Disconnected => tracing::warn!("disconnected from NATS"),
        Event::Connected => tracing::info!("connected to NATS"),
        Event::ServerError(ServerError::Other(text)) => match Denial::parse(&text) {
            Some(denial) => {
                if denial.subject.starts_with("$JS.API.CONSUMER.DELETE.") {
                    // An ordered consumer re-created after a reconnect first deletes its
                    // predecessor; users without delete rights (agents) leave that to the
                    // server, which removes idle consumers by itself.
                    tracing::debug!("NATS refused deleting a replaced consumer: {denial}");
                } else if denial.kind == DenialKind::Subscribe && denial.subject.starts_with(inbox)
                {
                    tracing::error!(
                        "NATS refused this client's reply inbox ({denial}): every request \
                         will time out; set --nats-inbox-prefix to the prefix this user may \
                         subscribe to (default _INBOX.<user>)"
                    );
                } else {
                    tracing::warn!("NATS refused an operation: {denial}");
                }
                denials.report(denial);
            }
            None => tracing::warn!("NATS server error: {text}"),
        },
        Event::ServerError(e) => tracing::warn!("NATS server error: {e}"),
        other => tracing::debug!(event = %other, "NATS event"),
    }
}

/// How [`Bus::open_with`] treats the buckets and the stream.
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

/// The stream behind KV `bucket`: what async-nats' `kv::Config` would make of the bucket's
/// settings (history, age, value size, direct gets, `deny_delete`, discard new), except that
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
        _ => ("job statuses", 5, Duration::ZERO),
    };
    stream::Config {
        name: format!("KV_{bucket}"),
        description: Some(description.to_string()),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: history,
        max_age,
        max_message_size: converge_common::MAX_MESSAGE_BYTES as i32,
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
async fn ensure_stream(
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
                 missing servers or lower --bus-replicas"
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
        None => fatal(e.to_string()),
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
                    _ => Err(fatal(e.to_string())),
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

/// Follows a KV bucket until `tx` closes: every key's current value first, then each
/// change, each entry turned into a message by `read` (`None`: nothing to send). Once the
/// values the bucket held when the follower started have been read (at once for an empty
/// bucket), `caught_up()` is sent, if it gives a message. Entries reach `read` in increasing
/// revision per key (an entry no newer than the last one read for its key is skipped), but
/// `read` may see a key's entry again after a re-watch.
///
/// On a NATS cluster a watch's consumer lives on one server, and creating one needs
/// JetStream's meta leader: when a server dies, a watch can go silent (its consumer was on
/// that server, or on a replica that no longer catches up), and no new one can be created
/// while the surviving servers elect a meta leader (seconds; over ten on a loaded machine).
/// So whenever the watch has been quiet for [`KV_QUIET`], the follower reads the bucket's
/// newer entries itself, by revision, with direct gets (answered by any replica, no consumer
/// needed), and delivers them; a watch that leaves such an entry undelivered for
/// [`KV_STALL`] is re-created. While there is no watch (being created, bounded to
/// [`KV_WATCH_CREATE`], or waiting to be tried again after a failure) the direct reads go
/// on every half [`KV_QUIET`]: creating a watch never holds them up.
pub async fn follow_kv<T>(
    store: kv::Store,
    tx: tokio::sync::mpsc::Sender<T>,
    mut read: impl FnMut(kv::Entry) -> Option<T>,
    caught_up: impl Fn() -> Option<T>,
) {
    type Creating = std::pin::Pin<Box<dyn Future<Output = Result<kv::Watch, String>> + Send>>;
    // A watch being created, bounded to KV_WATCH_CREATE.
    let create = |store: &kv::Store| -> Creating {
        let store = store.clone();
        Box::pin(async move {
            match tokio::time::timeout(KV_WATCH_CREATE, store.watch_with_history(">")).await {
                Ok(Ok(w)) => Ok(w),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("timed out after {KV_WATCH_CREATE:?}")),
            }
        })
    };
    let mut done = false;
    let signal = async |tx: &tokio::sync::mpsc::Sender<T>, done: &mut bool| {
        *done = true;
        match caught_up() {
            Some(m) => tx.send(m).await.is_ok(),
            None => true,
        }
    };
    // (The bucket's stream info as opened: no request.)
    if matches!(store.status().await, Ok(ref s) if s.values() == 0) && !signal(&tx, &mut done).await
    {
        return;
    }
    // The latest revision delivered per key, and over the bucket.
    let mut known: BTreeMap<String, u64> = BTreeMap::new();
    let mut latest = 0u64;
    // Delivers `entry` if it is newer than what its key had; false once `tx` is closed.
    let mut deliver =
        async |entry: kv::Entry, known: &mut BTreeMap<String, u64>, latest: &mut u64| -> bool {
            *latest = (*latest).max(entry.revision);
            let seen = known.entry(entry.key.clone()).or_default();
            if entry.revision <= *seen {
                return true;
            }
            *seen = entry.revision;
            match read(entry) {
                Some(m) => tx.send(m).await.is_ok(),
                None => true,
            }
        };
    let mut watch: Option<kv::Watch> = None;
    let mut creating: Option<Creating> = Some(create(&store));
    // Failed attempts in a row, and when to try again (0.5 to 5 s, growing with them).
    let mut failures = 0u32;
    let mut retry_at = tokio::time::Instant::now();
    let mut last_delivery = tokio::time::Instant::now();
    // A revision read directly that the watch had not delivered, and when.
    let mut missed: Option<(u64, tokio::time::Instant)> = None;
    let mut tick = tokio::time::interval(KV_QUIET / 2);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            created = async { creating.as_mut()?.await.into() }, if creating.is_some() => {
                creating = None;
                match created {
                    Some(Ok(w)) => {
                        if failures > 0 {
                            tracing::info!(bucket = %store.name, "watching again after {failures} failed attempt(s)");
                        }
                        failures = 0;
                        watch = Some(w);
                        last_delivery = tokio::time::Instant::now();
                        missed = None;
                    }
                    Some(Err(e)) => {
                        failures += 1;
                        tracing::warn!(bucket = %store.name, "cannot watch: {e} (attempt {failures}; reading directly meanwhile)");
                        retry_at = tokio::time::Instant::now()
                            + Duration::from_millis(500 * u64::from(failures.clamp(1, 10)));
                    }
                    None => {}
                }
            }
            entry = async { watch.as_mut()?.next().await }, if watch.is_some() => {
                match entry {
                    Some(Ok(entry)) => {
                        last_delivery = tokio::time::Instant::now();
                        if missed.is_some_and(|(rev, _)| entry.revision >= rev) {
                            missed = None;
                        }
                        let last_of_start = !done && entry.delta == 0;
                        if !deliver(entry, &mut known, &mut latest).await {
                            return;
                        }
                        if last_of_start && !signal(&tx, &mut done).await {
                            return;
                        }
                    }
                    end => {
                        match end {
                            Some(Err(e)) => tracing::warn!(bucket = %store.name, "watch error: {e}; watching again"),
                            _ => tracing::warn!(bucket = %store.name, "watch ended; watching again"),
                        }
                        watch = None;
                        creating = Some(create(&store));
                    }
                }
            }
            _ = tick.tick() => {
                if watch.is_none() && creating.is_none() && tokio::time::Instant::now() >= retry_at {
                    creating = Some(create(&store));
                }
                // Only once caught up (a watch's first values are the current ones), and
                // with a watch only once it has been quiet.
                if !done || (watch.is_some() && last_delivery.elapsed() < KV_QUIET) {
                    continue;
                }
                let before = latest;
                match read_newer(&store, latest).await {
                    Ok(entries) => {
                        tracing::debug!(bucket = %store.name, after = latest, "read directly: {} entries", entries.len());
                        for entry in entries {
                            if !deliver(entry, &mut known, &mut latest).await {
                                return;
                            }
                        }
                    }
                    Err(e) => tracing::debug!(bucket = %store.name, "direct read: {e}"),
                }
                if watch.is_some() {
                    if latest > before && missed.is_none() {
                        missed = Some((latest, tokio::time::Instant::now()));
                    }
                    if let Some((rev, since)) = missed
                        && since.elapsed() >= KV_STALL
                    {
                        tracing::warn!(
                            bucket = %store.name,
                            "watch stalled: revision {rev} was read directly, the watch \
                             delivered nothing for {:?} (its consumer's server may be \
                             gone); watching again",
                            last_delivery.elapsed()
                        );
                        watch = None;
                        missed = None;
                        creating = Some(create(&store));
                    }
                }
            }
        }
        if tx.is_closed() {
            return;
        }
    }
}

/// The messages of `stream` on `filter` after sequence `after`, in order, read with direct
/// gets (the next message on `filter` from a sequence: answered by any replica, no consumer
/// or leader needed; the stream must allow direct gets): at most `max`, for at most
/// `budget` in all, each read bounded to 1 s. An error only when nothing could be read.
pub async fn read_after(
    stream: &jetstream::stream::Stream,
    filter: &str,
    after: u64,
    max: usize,
    budget: Duration,
) -> Result<Vec<jetstream::message::StreamMessage>, String> {
    let started = tokio::time::Instant::now();
    let mut out = Vec::new();
    let mut next = after + 1;
    while out.len() < max && started.elapsed() < budget {
        let get = stream.direct_get_next_for_subject(filter, Some(next));
        let failed = match tokio::time::timeout(Duration::from_secs(1), get).await {
            Ok(Ok(msg)) => {
                next = msg.sequence + 1;
                out.push(msg);
                continue;
            }
            Ok(Err(e)) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => break,
            Ok(Err(e)) => e.to_string(),
            Err(_) => "direct get timed out after 1s".to_string(),
        };
        if out.is_empty() {
            return Err(failed);
        }
        break;
    }
    Ok(out)
}

/// The entries of `store` after revision `after` ([`read_after`] on the bucket's subjects,
/// 1000 at most, for 2 s at most).
async fn read_newer(store: &kv::Store, after: u64) -> Result<Vec<kv::Entry>, String> {
    let filter = format!("{}>", store.prefix);
    let messages = read_after(&store.stream, &filter, after, 1000, Duration::from_secs(2)).await?;
    Ok(messages
        .into_iter()
        .map(|msg| {
            let operation = msg
                .headers
                .get("KV-Operation")
                .and_then(|v| v.as_str().parse::<kv::Operation>().ok())
                .unwrap_or(kv::Operation::Put);
            let key = msg
                .subject
                .strip_prefix(store.prefix.as_str())
                .unwrap_or(msg.subject.as_str())
                .to_string();
            kv::Entry {
                bucket: store.name.clone(),
                key,
                value: msg.payload,
                revision: msg.sequence,
                delta: 0,
                created: msg.time,
                operation,
                seen_current: false,
            }
        })
        .collect())
}

/// How long a [`follow_kv`] watch may be quiet before the follower reads newer entries
/// directly (then every half of this while it stays quiet). The allocator's --host-timeout
/// (15 s) must cover a stream leader's election (4 to 9 s here, during which heartbeats
/// cannot be written) plus this and a read.
pub const KV_QUIET: Duration = Duration::from_secs(1);

/// How long a [`follow_kv`] watch may leave an entry read directly undelivered before it is
/// re-created (a watch is re-created with every key's current value: not at the first lag).
pub const KV_STALL: Duration = Duration::from_secs(3);

/// How long creating a [`follow_kv`] watch may take before it is abandoned and tried again
/// (the direct reads go on meanwhile).
const KV_WATCH_CREATE: Duration = Duration::from_secs(3);

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
    /// replicas where this creates or updates them (see [`ensure_stream`]); `denials` are
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
            let what = format!("KV bucket {bucket}");
            let config = stream::Config {
                num_replicas: replicas,
                ..kv_stream_config(bucket)
            };
            ensure_stream(&js, &denials, setup, config, &what).await?;
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
                let what = format!("KV bucket {bucket}");
                let config = stream::Config {
                    num_replicas: replicas,
                    ..kv_stream_config(bucket)
                };
                ensure_stream(&js, &denials, setup, config, &what).await?;
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
            let what = format!("KV bucket {bucket}");
            let config = stream::Config {
                num_replicas: self.replicas,
                ..kv_stream_config(bucket)
            };
            ensure_stream(&self.js, &self.denials, setup, config, &what).await?;
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

    /// Writes `msg` under `key`; returns the new revision.
    pub async fn put<T: Message>(
        &self,
        store: &kv::Store,
        key: &str,
        msg: &T,
    ) -> Result<u64, BusError> {
        let subject = format!("{}{key}", store.prefix);
        let put = async {
            store
                .put(key, Bytes::from(encode(msg)))
                .await
                .map_err(|e| BusError::Kv {
                    bucket: store.name.clone(),
                    key: key.to_string(),
                    message: e.to_string(),
                })
        };
        self.refusable(
            || format!("a write of KV {}/{key}", store.name),
            &subject,
            put,
        )
        .await
    }

    /// Writes `msg` under `key` only if the key is still as the writer last saw it:
    /// at revision `expected`, or absent (or deleted) for `None`. Returns the new revision;
    /// [`BusError::Conflict`] when another writer changed the key since (nothing written).
    /// The allocator writes plans and statuses this way, so that a replaced leader's late
    /// write cannot overwrite what the new leader wrote.
    pub async fn put_expecting<T: Message>(
        &self,
        store: &kv::Store,
        key: &str,
        msg: &T,
        expected: Option<u64>,
    ) -> Result<u64, BusError> {
        let subject = format!("{}{key}", store.prefix);
        let kv_error = |message: String| BusError::Kv {
            bucket: store.name.clone(),
            key: key.to_string(),
            message,
        };
        let conflict = || BusError::Conflict {
            bucket: store.name.clone(),
            key: key.to_string(),
            expected,
        };
        let value = Bytes::from(encode(msg));
        let put = async {
            match expected {
                Some(revision) => store.update(key, value, revision).await.map_err(|e| {
                    if e.kind() == kv::UpdateErrorKind::WrongLastRevision {
                        conflict()
                    } else {
                        kv_error(e.to_string())
                    }
                }),
                None => store.create(key, value).await.map_err(|e| {
                    if e.kind() == kv::CreateErrorKind::AlreadyExists {
                        conflict()
                    } else {
                        kv_error(e.to_string())
                    }
                }),
            }
        };
        self.refusable(
            || format!("a write of KV {}/{key}", store.name),
            &subject,
            put,
        )
        .await
    }

    /// Reads and decodes `key`; `Ok(None)` if absent or deleted.
    pub async fn get<T: Message>(
        &self,
        store: &kv::Store,
        key: &str,
    ) -> Result<Option<(T, u64)>, BusError> {
        let subject = format!(
            "{JS_API}.DIRECT.GET.{}.{}{key}",
            store.stream_name, store.prefix
        );
        let read = async {
            store.entry(key).await.map_err(|e| BusError::Kv {
                bucket: store.name.clone(),
                key: key.to_string(),
                message: e.to_string(),
            })
        };
        let entry = self
            .refusable(
                || format!("a read of KV {}/{key}", store.name),
                &subject,
                read,
            )
            .await?;
        let Some(entry) = entry else { return Ok(None) };
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        let msg = decode(&entry.value).map_err(|source| BusError::Decode {
            bucket: store.name.clone(),
            key: key.to_string(),
            source,
        })?;
        Ok(Some((msg, entry.revision)))
    }

    /// Follows one key of `store`: with `with_history` its current value first (if any),
    /// then every change (puts, deletes, purges) as a [`kv::Entry`].
    ///
    /// Unlike [`kv::Store::watch`], which creates its consumer through
    /// `$JS.API.CONSUMER.CREATE.<stream>` (a subject that does not name the key, so a
    /// permission cannot tell keys apart), this names the consumer, so the request goes to
    /// `$JS.API.CONSUMER.CREATE.<stream>.<name>.$KV.<bucket>.<key>`: an agent's NATS user
    /// may watch its own plan key and no other (the server checks that the filter in the
    /// subject is the consumer's filter). A refused watch is [`BusError::Denied`].
    pub async fn watch_key(
        &self,
        store: &kv::Store,
        key: &str,
        with_history: bool,
    ) -> Result<futures::stream::BoxStream<'static, Result<kv::Entry, BusError>>, BusError> {
        use jetstream::consumer::{DeliverPolicy, ReplayPolicy, push};
        let filter = format!("{}{key}", store.prefix);
        let inbox = self.client.new_inbox();
        let name = format!(
            "watch_{}",
            inbox.rsplit('.').next().unwrap_or("x").replace('-', "_")
        );
        let subject = format!(
            "{JS_API}.CONSUMER.CREATE.{}.{name}.{filter}",
            store.stream_name
        );
        let kv_err = |e: &dyn std::fmt::Display| BusError::Kv {
            bucket: store.name.clone(),
            key: key.to_string(),
            message: format!("watch: {e}"),
        };
        let create = async {
            let consumer = store
                .stream
                .create_consumer(push::OrderedConfig {
                    name: Some(name.clone()),
                    deliver_subject: inbox.clone(),
                    description: Some("converge key watch".to_string()),
                    filter_subject: filter.clone(),
                    replay_policy: ReplayPolicy::Instant,
                    deliver_policy: if with_history {
                        DeliverPolicy::LastPerSubject
                    } else {
                        DeliverPolicy::New
                    },
                    ..Default::default()
                })
                .await
                .map_err(|e| kv_err(&e))?;
            consumer.messages().await.map_err(|e| kv_err(&e))
        };
        let messages = self
            .denials
            .guard(
                |d| d.subject == subject || (d.subject == inbox && d.kind == DenialKind::Subscribe),
                create,
            )
            .await
            .map_err(|denial| BusError::Denied {
                action: format!("a watch of KV {}/{key}", store.name),
                denial,
            })??;
        let bucket = store.name.clone();
        let prefix = store.prefix.clone();
        let stream = messages.map(move |msg| {
            let err = |m: String| BusError::Kv {
                bucket: bucket.clone(),
                key: "*".into(),
                message: format!("watch: {m}"),
            };
            let msg = msg.map_err(|e| err(e.to_string()))?;
            let info = msg.info().map_err(|e| err(e.to_string()))?;
            let operation = msg
                .headers
                .as_ref()
                .and_then(|h| h.get("KV-Operation"))
                .and_then(|v| v.as_str().parse::<kv::Operation>().ok())
                .unwrap_or(kv::Operation::Put);
            let key = msg
                .subject
                .strip_prefix(prefix.as_str())
                .unwrap_or(msg.subject.as_str())
                .to_string();
            Ok(kv::Entry {
                bucket: bucket.clone(),
                key,
                value: msg.payload.clone(),
                revision: info.stream_sequence,
                delta: info.pending,
                created: info.published,
                operation,
                seen_current: info.pending == 0,
            })
        });
        Ok(stream.boxed())
    }

    /// Reads every live key of `store`, decoding each value (the key listing is tried up to
    /// [`KEYS_ATTEMPTS`] times, each bounded to [`KEYS_ATTEMPT`]). Values that fail to decode are
    /// counted in `rejects` and skipped.
    pub async fn load_all<T: Message>(
        &self,
        store: &kv::Store,
        rejects: &Rejects,
    ) -> Result<BTreeMap<String, (T, u64)>, BusError> {
        use futures::TryStreamExt;
        let kv_err = |e: &dyn std::fmt::Display| BusError::Kv {
            bucket: store.name.clone(),
            key: "*".into(),
            message: e.to_string(),
        };
        // The keys are the subjects the stream's info lists (its leader answers). Not
        // `kv::Store::keys`, which reads them through an ephemeral consumer: on a NATS
        // cluster that just lost a server, creating one waits for a new meta leader, and one
        // placed on the dead peer never answers (the CLI's listings timed out for over a
        // minute). A stream whose leader died answers once the others elect one (seconds),
        // hence the attempts, each bounded to KEYS_ATTEMPT.
        let list = || async {
            let listing = async {
                store
                    .stream
                    .info_with_subjects(format!("{}>", store.prefix))
                    .await
                    .map_err(|e| e.to_string())?
                    .map_ok(|(subject, _)| {
                        subject
                            .strip_prefix(store.prefix.as_str())
                            .unwrap_or(&subject)
                            .to_string()
                    })
                    .try_collect::<Vec<String>>()
                    .await
                    .map_err(|e| e.to_string())
            };
            match tokio::time::timeout(KEYS_ATTEMPT, listing).await {
                Ok(r) => r,
                Err(_) => Err(format!("listing keys timed out after {KEYS_ATTEMPT:?}")),
            }
        };
        let keys: Vec<String> = list
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(200))
                    .with_max_times(KEYS_ATTEMPTS - 1),
            )
            .await
            .map_err(|e| kv_err(&e))?;
        let mut out = BTreeMap::new();
        for key in keys {
            match self.get::<T>(store, &key).await {
                Ok(Some(v)) => {
                    out.insert(key, v);
                }
                Ok(None) => {}
                Err(BusError::Decode { source, .. }) => {
                    rejects.record(&format!("kv:{}", store.name), &key, &source)
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Publishes on a core subject (best effort: may be lost across a disconnect).
    pub async fn publish<T: Message>(&self, subject: String, msg: &T) -> Result<(), BusError> {
        self.client
            .publish(subject.clone(), Bytes::from(encode(msg)))
            .await
            .map_err(|e| BusError::Publish {
                subject,
                message: e.to_string(),
            })
    }

    /// Publishes to JetStream and waits for the server's acknowledgement (the client's
    /// default timeout, 5 s).
    pub async fn publish_acked<T: Message>(
        &self,
        subject: String,
        msg: &T,
    ) -> Result<(), BusError> {
        let payload = Bytes::from(encode(msg));
        self.publish_acked_message(
            subject,
            jetstream::message::PublishMessage::build().payload(payload),
        )
        .await
        .map(|_| ())
    }

    /// Publishes `msg` to JetStream under the message id `msg_id` (the `Nats-Msg-Id`
    /// header) and waits at most `wait` for the acknowledgement. A stream stores one message
    /// per id within its duplicate window (2 min by default): a retry of a publish whose
    /// acknowledgement was lost or came too late is acknowledged again, not stored twice.
    /// `Ok(true)`: the stream already held `msg_id` (a duplicate, not stored). `Err`: not
    /// acknowledged within `wait` (stored or not), refused by the server (e.g. a stream
    /// electing its leader: "no responders"), or denied by the server's permissions.
    pub async fn publish_acked_once<T: Message>(
        &self,
        subject: String,
        msg: &T,
        msg_id: &str,
        wait: Duration,
    ) -> Result<bool, BusError> {
        let message = jetstream::message::PublishMessage::build()
            .payload(Bytes::from(encode(msg)))
            .message_id(msg_id);
        match tokio::time::timeout(wait, self.publish_acked_message(subject.clone(), message)).await
        {
            Ok(result) => result,
            Err(_) => Err(BusError::Publish {
                subject,
                message: format!("no acknowledgement within {wait:?}"),
            }),
        }
    }

    /// Publishes `message` to JetStream and waits for its acknowledgement; whether it was a
    /// duplicate.
    async fn publish_acked_message(
        &self,
        subject: String,
        message: jetstream::message::PublishMessage,
    ) -> Result<bool, BusError> {
        let err = |e: &dyn std::fmt::Display| BusError::Publish {
            subject: subject.clone(),
            message: e.to_string(),
        };
        let publish = async {
            let ack = self
                .js
                .send_publish(subject.clone(), message)
                .await
                .map_err(|e| err(&e))?;
            let ack = ack.await.map_err(|e| err(&e))?;
            Ok(ack.duplicate)
        };
        self.refusable(|| format!("a publish to {subject}"), &subject, publish)
            .await
    }
}

/// How long one attempt to list a bucket's keys may take ([`Bus::load_all`]).
pub const KEYS_ATTEMPT: Duration = Duration::from_secs(3);
/// Attempts to list a bucket's keys before [`Bus::load_all`] gives up (with the pauses
/// between them, over 20 s: a stream leader's election on a loaded machine).
pub const KEYS_ATTEMPTS: usize = 6;

/// Counts messages a process refused, by where they came from and why. Every refusal is
/// logged once at `warn`; the process keeps serving.
#[derive(Debug, Default)]
pub struct Rejects {
    counts: Mutex<BTreeMap<(String, &'static str), u64>>,
}

impl Rejects {
    /// Records one refused message from `source` (a subject or `kv:<bucket>`).
    pub fn record(&self, source: &str, key: &str, error: &DecodeError) {
        self.refuse(source, key, error.kind(), error);
    }

    /// Records one message from `source` that decoded but is refused for what it says or
    /// where it came from, under `kind` (a fixed label, e.g. `wrong_subject`).
    pub fn refuse(
        &self,
        source: &str,
        key: &str,
        kind: &'static str,
        reason: &dyn std::fmt::Display,
    ) {
        tracing::warn!(source, key, kind, "refused message: {reason}");
        let mut counts = self.counts.lock().expect("not poisoned");
        *counts.entry((source.to_string(), kind)).or_default() += 1;
    }

    /// Decodes `bytes`, recording a refusal on error.
    pub fn decode<T: Message>(&self, source: &str, key: &str, bytes: &[u8]) -> Option<T> {
        match decode(bytes) {
            Ok(m) => Some(m),
            Err(e) => {
                self.record(source, key, &e);
                None
            }
        }
    }

    /// Total refusals so far.
    pub fn total(&self) -> u64 {
        self.counts.lock().expect("not poisoned").values().sum()
    }

    /// Refusals by (source, kind).
    pub fn snapshot(&self) -> BTreeMap<(String, &'static str), u64> {
        self.counts.lock().expect("not poisoned").clone()
    }

    /// Refusals by kind, all sources together (bounded labels for metrics).
    pub fn by_kind(&self) -> BTreeMap<&'static str, u64> {
        let mut out = BTreeMap::new();
        for ((_, kind), n) in self.counts.lock().expect("not poisoned").iter() {
            *out.entry(*kind).or_default() += n;
        }
        out
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `default_filter`, e.g. `info`).
pub fn init_tracing(default_filter: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Logging for tests (every test binary that logs calls this, directly or through
/// `converge_tests::init_tracing`), filtered by `RUST_LOG` (default `warn`). Lines go to
/// libtest's output capture, not to stderr: a passing test prints none of the warnings it
/// provokes on purpose (servers killed, buckets not ready yet), a failing test shows its own
/// lines under its `---- stdout ----` heading. The capture follows the test into every thread
/// its thread starts, so the tokio runtime's workers and blocking threads of a
/// `#[tokio::test(flavor = "multi_thread")]` are captured too, each test's apart from the
/// others'. `cargo test -- --nocapture` prints them live instead. Calls after the first do
/// nothing.
pub fn init_test_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Resolves on the next SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Current time as UNIX seconds.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_count_by_kind() {
        let rejects = Rejects::default();
        rejects.refuse("a", "k", "not_placed", &"x");
        rejects.refuse("b", "k", "not_placed", &"x");
        rejects.refuse("b", "k", "wrong_subject", &"x");
        assert_eq!(rejects.total(), 3);
        assert_eq!(
            rejects.by_kind().into_iter().collect::<Vec<_>>(),
            [("not_placed", 2), ("wrong_subject", 1)]
        );
    }

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
        }
        let c = progress_stream_config();
        assert!(!c.allow_rollup && c.allow_direct);
        assert_eq!(c.subjects, [subjects::PROGRESS_ALL]);
    }

    #[test]
    fn durations() {
        assert_eq!(humantime_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(humantime_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(humantime_duration("fast").unwrap_err().contains("10s"));
    }
}

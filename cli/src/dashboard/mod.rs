//! `converge dashboard`: a read-only web page of the cluster, served by the CLI.
//!
//! It follows the same NATS state as `converge jobs`, `converge hosts` and `converge queue
//! list` (KV `converge-jobs`, `converge-job-status`, `converge-hosts`, `converge-queues`,
//! `converge-queue-status`) plus the progress stream (rank 0's loss reports, for the
//! curves), keeps the latest picture in memory ([`view::Model`]), and serves:
//!
//! | path | what |
//! |---|---|
//! | `GET /` | the page (HTML, script and style embedded in the binary: no CDN) |
//! | `GET /api/state` | the picture as JSON ([`view::State`]) |
//! | `GET /api/events` | server-sent events: one `state` event (the same JSON) at connect and after every change, at most one per [`REBUILD_EVERY`] |
//!
//! Every other path answers 404 and every other method 405: nothing can be written through
//! the dashboard. It runs apart from the allocator, with the CLI's credentials, so a slow or
//! hostile browser cannot delay a scheduling decision; inside the dashboard, connections are
//! bounded by [`LIMITS`] and event streams capped at [`MAX_EVENT_CLIENTS`].

pub mod view;

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer::push};
use axum::Router;
use axum::extract::State as AxumState;
use axum::http::{StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use converge_bus::metrics::ServeLimits;
use converge_bus::{Bus, KvChange, KvDecoder, KvStore, Rejects, follow_kv_typed, unix_now};
use converge_common::{
    HostId, HostTelemetry, JobId, JobSpec, JobStatus, ProgressReport, QueueId, QueueSpec,
    QueueStatus, decode, subjects,
};
use futures::StreamExt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Semaphore, mpsc, watch};
use view::{LossPoint, Model};

/// Shortest time between two rebuilds of the picture (and two events to each browser).
pub const REBUILD_EVERY: Duration = Duration::from_millis(500);

/// The picture is rebuilt at least this often even without news, so that hosts turn
/// *lost* when their telemetry stops.
pub const REFRESH_EVERY: Duration = Duration::from_secs(5);

/// Most browsers following `/api/events` at once; more get 503.
pub const MAX_EVENT_CLIENTS: usize = 64;

/// What one client can hold of the dashboard: 128 connections, 5 s to send a request head
/// of at most 16 KiB (a larger one gets 431), connections closed after 10 minutes (a
/// browser's event stream then reconnects by itself).
pub const LIMITS: ServeLimits = ServeLimits {
    max_connections: 128,
    header_read_timeout: Duration::from_secs(5),
    max_header_bytes: 16 * 1024,
    max_connection_age: Duration::from_secs(600),
};

/// Most loss points kept per job (the oldest go first).
pub const MAX_POINTS_KEPT: usize = 5_000;

/// Most jobs without a status whose points are kept: reports may arrive before the job's
/// status (at start the stream and the buckets are read side by side), but an id that never
/// gets one (a deleted job's late reports, or ids a compromised agent makes up on its own
/// subjects) must not grow the dashboard's memory. Beyond it, the unknown job whose latest
/// point is oldest is forgotten. Memory bound: this × [`MAX_POINTS_KEPT`] × 32 bytes, 40 MB.
pub const MAX_UNKNOWN_JOBS: usize = 256;

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");

/// Settings of `converge dashboard`.
#[derive(Debug, Clone)]
pub struct Options {
    pub listen: SocketAddr,
    /// Telemetry older than this marks a host lost (the allocator's `--host-timeout`).
    pub host_timeout: Duration,
    /// Ended jobs shown (most recent first).
    pub max_ended: usize,
}

/// One thing read off NATS (boxed: the messages are large): a change of one of the five
/// KV buckets, each kept in its [`KvStore`] of the model, or of the progress stream.
enum Input {
    Spec(Box<KvChange<JobId, JobSpec>>),
    Status(Box<KvChange<JobId, JobStatus>>),
    Host(Box<KvChange<HostId, HostTelemetry>>),
    Queue(Box<KvChange<QueueId, QueueSpec>>),
    QueueStatus(Box<KvChange<QueueId, QueueStatus>>),
    Progress(Box<ProgressReport>),
    Refused,
    /// The progress stream has delivered what it held at start.
    ProgressCaughtUp,
}

/// The first picture is published after this long even if a source has not caught up (a
/// source that cannot be read is logged; the page then shows what the others hold).
pub const FIRST_PICTURE_WITHIN: Duration = Duration::from_secs(15);

#[derive(Clone)]
struct Shared {
    state: watch::Receiver<Arc<String>>,
    clients: Arc<Semaphore>,
}

/// Follows the cluster and serves the page until Ctrl-C or SIGTERM. Prints
/// `dashboard: http://ADDR/` on stdout once listening.
///
/// # Errors
/// The listen address cannot be bound, or NATS cannot be read at start.
pub async fn run(bus: &Bus, opts: Options) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .with_context(|| format!("cannot listen on {}", opts.listen))?;
    let bound = listener.local_addr()?;
    let queues = crate::queues::open(bus).await?;
    let (tx, rx) = mpsc::channel::<Input>(4096);
    let mut tasks = tokio::task::JoinSet::new();
    // A value stored under a key it does not name is no value to the allocator (it ignores
    // it, or refuses the job), so it is refused here too. Undecodable values are logged
    // (through a `Rejects` of the dashboard's own, which nothing exports) and counted in the
    // page's `refused`.
    let rejects = Arc::new(Rejects::default());
    let r = || rejects.clone();
    tasks.spawn(follow_kv_typed(
        bus.jobs.clone(),
        KvDecoder::named(r(), |s: &JobSpec| &s.id),
        tx.clone(),
        |c| Input::Spec(Box::new(c)),
    ));
    tasks.spawn(follow_kv_typed(
        bus.status.clone(),
        KvDecoder::named(r(), |s: &JobStatus| &s.job),
        tx.clone(),
        |c| Input::Status(Box::new(c)),
    ));
    tasks.spawn(follow_kv_typed(
        bus.hosts.clone(),
        KvDecoder::named(r(), |t: &HostTelemetry| &t.host),
        tx.clone(),
        |c| Input::Host(Box::new(c)),
    ));
    tasks.spawn(follow_kv_typed(
        queues.queues,
        KvDecoder::named(r(), |q: &QueueSpec| &q.name),
        tx.clone(),
        |c| Input::Queue(Box::new(c)),
    ));
    tasks.spawn(follow_kv_typed(
        queues.status,
        KvDecoder::named(r(), |s: &QueueStatus| &s.queue),
        tx.clone(),
        |c| Input::QueueStatus(Box::new(c)),
    ));
    tasks.spawn(follow_progress(bus.client.clone(), bus.js.clone(), tx));
    let (state_tx, state_rx) = watch::channel(Arc::new(String::new()));
    tasks.spawn(keep_picture(rx, state_tx, opts.clone()));

    let shared = Shared {
        state: state_rx,
        clients: Arc::new(Semaphore::new(MAX_EVENT_CLIENTS)),
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let router = router(shared, bound.ip().is_loopback());
    converge_bus::metrics::serve_router(listener, router, LIMITS, shutdown.clone());
    println!("dashboard: http://{bound}/");
    tracing::info!(%bound, "serving the dashboard");
    converge_bus::shutdown_signal().await;
    shutdown.cancel();
    tasks.abort_all();
    Ok(())
}

/// The page's Content-Security-Policy: its own script and stylesheet (plus the inline style
/// attributes of its bars and charts), `data:` images (the empty icon), requests to itself
/// only, no frames, forms or base URL.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
                   img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

/// Whether a `Host` header names this machine's loopback (`localhost`, `127.0.0.1`,
/// `[::1]`, any port): the only names a loopback-bound dashboard answers to, so that a web
/// page whose DNS name was rebound to 127.0.0.1 cannot read it from a browser.
fn loopback_host(host: Option<&header::HeaderValue>) -> bool {
    let Some(host) = host.and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Every answer carries the CSP, `nosniff` and `no-referrer`; a dashboard bound to loopback
/// refuses (403) a request whose `Host` is not a loopback name.
async fn guard(
    AxumState(loopback): AxumState<bool>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let mut response = if loopback && !loopback_host(request.headers().get(header::HOST)) {
        (
            StatusCode::FORBIDDEN,
            "this dashboard listens on loopback and answers only to localhost, 127.0.0.1 or \
             [::1] in the Host header\n",
        )
            .into_response()
    } else {
        next.run(request).await
    };
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        header::HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        header::HeaderValue::from_static("no-referrer"),
    );
    response
}

fn router(shared: Shared, loopback: bool) -> Router {
    Router::new()
        .route("/", get(|| async { Html(INDEX_HTML) }))
        .route(
            "/app.js",
            get(|| async {
                (
                    [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
                    APP_JS,
                )
            }),
        )
        .route(
            "/app.css",
            get(|| async { ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], APP_CSS) }),
        )
        .route("/api/state", get(state_json))
        .route("/api/events", get(events))
        .fallback(|| async { (StatusCode::NOT_FOUND, "no such page\n") })
        .layer(axum::middleware::from_fn_with_state(loopback, guard))
        .with_state(shared)
}

async fn state_json(AxumState(shared): AxumState<Shared>) -> Response {
    let body = shared.state.borrow().clone();
    if body.is_empty() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "still reading the cluster\n",
        )
            .into_response();
    }
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body.as_str().to_owned(),
    )
        .into_response()
}

async fn events(AxumState(shared): AxumState<Shared>) -> Response {
    let Ok(permit) = shared.clients.clone().try_acquire_owned() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "too many dashboards open\n",
        )
            .into_response();
    };
    let mut rx = shared.state.clone();
    rx.mark_changed();
    let stream = futures::stream::unfold((rx, permit), |(mut rx, permit)| async move {
        loop {
            rx.changed().await.ok()?;
            let body = rx.borrow_and_update().clone();
            if !body.is_empty() {
                let event = SseEvent::default().event("state").data(body.as_str());
                return Some((Ok::<_, std::convert::Infallible>(event), (rx, permit)));
            }
        }
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// Owns the model: applies inputs, rebuilds the JSON at most every [`REBUILD_EVERY`] when
/// something changed, and every [`REFRESH_EVERY`] anyway.
async fn keep_picture(
    mut rx: mpsc::Receiver<Input>,
    out: watch::Sender<Arc<String>>,
    opts: Options,
) {
    let mut model = Model::default();
    let mut version = 0u64;
    let mut dirty = true;
    let mut progress_caught_up = false;
    let started = tokio::time::Instant::now();
    let mut last_build = tokio::time::Instant::now() - REFRESH_EVERY;
    let mut tick = tokio::time::interval(REBUILD_EVERY);
    loop {
        tokio::select! {
            input = rx.recv() => {
                let Some(input) = input else { return };
                progress_caught_up |= matches!(input, Input::ProgressCaughtUp);
                apply(&mut model, input);
                dirty = true;
                // Drain what is queued before building.
                while let Ok(input) = rx.try_recv() {
                    progress_caught_up |= matches!(input, Input::ProgressCaughtUp);
                    apply(&mut model, input);
                }
            }
            _ = tick.tick() => {}
        }
        // Nothing is published before every source has delivered what it held at start:
        // until then /api/state answers 503 and the page waits.
        if !(progress_caught_up && kv_caught_up(&model)) && started.elapsed() < FIRST_PICTURE_WITHIN
        {
            continue;
        }
        let since = last_build.elapsed();
        if (dirty && since >= REBUILD_EVERY) || since >= REFRESH_EVERY {
            version += 1;
            let state = view::build(
                &model,
                version,
                unix_now(),
                opts.host_timeout.as_secs_f64(),
                opts.max_ended,
            );
            match serde_json::to_string(&state) {
                Ok(json) => {
                    out.send_replace(Arc::new(json));
                }
                Err(e) => tracing::warn!("dashboard state not serialized: {e}"),
            }
            dirty = false;
            last_build = tokio::time::Instant::now();
        }
    }
}

/// Whether each of the five buckets has delivered what it held at start.
fn kv_caught_up(m: &Model) -> bool {
    m.specs.is_caught_up()
        && m.statuses.is_caught_up()
        && m.hosts.is_caught_up()
        && m.queues.is_caught_up()
        && m.queue_statuses.is_caught_up()
}

/// Applies a KV change to its store (a refused value counts in `refused` and leaves the
/// key's last valid value; a bad key, counted in the follower's `Rejects`, is ignored).
fn apply_kv<K: Ord, V>(store: &mut KvStore<K, V>, change: KvChange<K, V>, refused: &mut u64) {
    *refused += u64::from(matches!(change, KvChange::Refused { .. }));
    store.apply(change);
}

fn apply(model: &mut Model, input: Input) {
    match input {
        Input::Spec(c) => apply_kv(&mut model.specs, *c, &mut model.refused),
        Input::Status(c) => {
            if let KvChange::Deleted(id) = &*c {
                model.points.remove(id);
            }
            apply_kv(&mut model.statuses, *c, &mut model.refused);
        }
        Input::Host(c) => apply_kv(&mut model.hosts, *c, &mut model.refused),
        Input::Queue(c) => apply_kv(&mut model.queues, *c, &mut model.refused),
        Input::QueueStatus(c) => apply_kv(&mut model.queue_statuses, *c, &mut model.refused),
        Input::Progress(r) => {
            if !model.statuses.contains_key(&r.job) && !model.points.contains_key(&r.job) {
                forget_unknown_beyond(model, MAX_UNKNOWN_JOBS - 1);
            }
            let points = model.points.entry(r.job.clone()).or_default();
            points.push(LossPoint {
                time: r.time,
                samples: r.line.samples as f64,
                loss: r.line.loss,
                generation: r.generation,
            });
            if points.len() > MAX_POINTS_KEPT {
                let extra = points.len() - MAX_POINTS_KEPT;
                points.drain(..extra);
            }
        }
        Input::Refused => model.refused += 1,
        Input::ProgressCaughtUp => {}
    }
}

/// Forgets the points of jobs without a status, the one whose latest point is oldest
/// first, until at most `keep` such jobs are left.
fn forget_unknown_beyond(model: &mut Model, keep: usize) {
    let mut unknown: Vec<(f64, JobId)> = model
        .points
        .iter()
        .filter(|(job, _)| !model.statuses.contains_key(*job))
        .map(|(job, p)| (p.last().map_or(f64::NEG_INFINITY, |l| l.time), job.clone()))
        .collect();
    if unknown.len() <= keep {
        return;
    }
    unknown.sort_by(|a, b| a.0.total_cmp(&b.0));
    let extra = unknown.len() - keep;
    for (_, job) in unknown.into_iter().take(extra) {
        model.points.remove(&job);
    }
}

/// Follows the progress stream from its start (rank 0's reports only), through an ordered
/// push consumer on the connection's inbox; after an error it goes on from the report after
/// the last one read.
async fn follow_progress(
    client: async_nats::Client,
    js: jetstream::Context,
    tx: mpsc::Sender<Input>,
) {
    let mut last_seq = 0u64;
    let mut caught_up = false;
    loop {
        if let Err(e) = follow_progress_once(&client, &js, &tx, &mut last_seq, &mut caught_up).await
        {
            tracing::warn!("progress stream: {e}; following again after report {last_seq}");
        }
        if tx.is_closed() {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn follow_progress_once(
    client: &async_nats::Client,
    js: &jetstream::Context,
    tx: &mpsc::Sender<Input>,
    last_seq: &mut u64,
    caught_up: &mut bool,
) -> anyhow::Result<()> {
    let mut stream = js.get_stream(subjects::PROGRESS_STREAM).await?;
    if !*caught_up && stream.info().await?.state.messages == 0 {
        *caught_up = true;
        if tx.send(Input::ProgressCaughtUp).await.is_err() {
            return Ok(());
        }
    }
    let consumer = stream
        .create_consumer(push::OrderedConfig {
            deliver_subject: client.new_inbox(),
            filter_subject: subjects::PROGRESS_ALL.to_string(),
            deliver_policy: if *last_seq == 0 {
                jetstream::consumer::DeliverPolicy::All
            } else {
                jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: *last_seq + 1,
                }
            },
            replay_policy: jetstream::consumer::ReplayPolicy::Instant,
            description: Some("converge dashboard".into()),
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    while let Some(msg) = messages.next().await {
        let msg = msg?;
        let mut last_of_start = false;
        if let Ok(info) = msg.info() {
            *last_seq = info.stream_sequence;
            last_of_start = !*caught_up && info.pending == 0;
        }
        let input = match decode::<ProgressReport>(&msg.payload) {
            Ok(r) if msg.subject.as_str() != subjects::progress(&r.job, &r.host) => {
                Some(Input::Refused)
            }
            Ok(r) if r.rank != 0 => None,
            Ok(r) => Some(Input::Progress(Box::new(r))),
            Err(_) => Some(Input::Refused),
        };
        if let Some(input) = input
            && tx.send(input).await.is_err()
        {
            return Ok(());
        }
        if last_of_start {
            *caught_up = true;
            if tx.send(Input::ProgressCaughtUp).await.is_err() {
                return Ok(());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(job: &str, time: f64) -> Input {
        Input::Progress(Box::new(
            serde_json::from_value(serde_json::json!({
                "protocol": 1, "job": job, "generation": 1, "rank": 0, "host": "h",
                "step": 1, "samples": 10, "loss": 0.5, "time": time
            }))
            .unwrap(),
        ))
    }

    #[test]
    fn points_of_jobs_without_a_status_are_bounded() {
        let mut m = Model::default();
        let status: JobStatus = serde_json::from_value(serde_json::json!({
            "job": "known", "phase": "running", "generation": 1, "world_size": 1,
            "placement": [], "step": 0, "samples": 0, "submitted_at": 1.0, "updated_at": 2.0
        }))
        .unwrap();
        apply(
            &mut m,
            Input::Status(Box::new(KvChange::Put(status.job.clone(), status))),
        );
        apply(&mut m, report("known", 0.0));
        for i in 0..(MAX_UNKNOWN_JOBS + 50) {
            apply(&mut m, report(&format!("made-up-{i}"), 1.0 + i as f64));
        }
        // The known job keeps its points; the newest unknown ids are kept, the oldest gone.
        assert!(m.points.contains_key(&"known".parse::<JobId>().unwrap()));
        assert_eq!(m.points.len(), MAX_UNKNOWN_JOBS + 1);
        assert!(
            !m.points
                .contains_key(&"made-up-0".parse::<JobId>().unwrap())
        );
        let last = format!("made-up-{}", MAX_UNKNOWN_JOBS + 49);
        assert!(m.points.contains_key(&last.parse::<JobId>().unwrap()));
        // A report of a job already kept adds to it without evicting anyone.
        apply(&mut m, report(&last, 1e6));
        assert_eq!(m.points.len(), MAX_UNKNOWN_JOBS + 1);
    }

    #[test]
    fn kv_changes_keep_the_model_and_refusals_are_counted() {
        let mut m = Model::default();
        let q = QueueSpec::implicit_default();
        let name = q.name.clone();
        apply(
            &mut m,
            Input::Queue(Box::new(KvChange::Put(name.clone(), q.clone()))),
        );
        // A refused value is counted and leaves the last readable one; a bad key is not
        // counted here (its follower's `Rejects` counts it).
        let refused = KvChange::Refused {
            key: name.clone(),
            reason: "x".into(),
        };
        apply(&mut m, Input::Queue(Box::new(refused)));
        let bad_key = KvChange::BadKey {
            key: "x.y".into(),
            reason: "x".into(),
        };
        apply(&mut m, Input::Queue(Box::new(bad_key)));
        assert_eq!((m.refused, m.queues.get(&name)), (1, Some(&q)));
        // A deleted status takes its job's points along.
        apply(&mut m, report("gone", 1.0));
        let gone: JobId = "gone".parse().unwrap();
        apply(
            &mut m,
            Input::Status(Box::new(KvChange::Deleted(gone.clone()))),
        );
        assert!(!m.points.contains_key(&gone));
        // Caught up once each of the five buckets is.
        assert!(!kv_caught_up(&m));
        apply(&mut m, Input::Spec(Box::new(KvChange::CaughtUp)));
        apply(&mut m, Input::Status(Box::new(KvChange::CaughtUp)));
        apply(&mut m, Input::Host(Box::new(KvChange::CaughtUp)));
        apply(&mut m, Input::Queue(Box::new(KvChange::CaughtUp)));
        assert!(!kv_caught_up(&m));
        apply(&mut m, Input::QueueStatus(Box::new(KvChange::CaughtUp)));
        assert!(kv_caught_up(&m));
    }

    #[test]
    fn a_loopback_dashboard_answers_only_to_loopback_names() {
        let ok = |h: &str| loopback_host(Some(&header::HeaderValue::from_str(h).unwrap()));
        for host in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "localhost:8080",
            "LOCALHOST",
            "[::1]:8080",
            "127.0.0.2:80",
        ] {
            assert!(ok(host), "{host}");
        }
        for host in [
            "evil.example:8080",
            "127.0.0.1.evil.example",
            "localhost.evil.example:8080",
            "10.0.0.5:8080",
            "[::2]:8080",
            "",
        ] {
            assert!(!ok(host), "{host}");
        }
        assert!(!loopback_host(None), "no Host header");
    }
}

//! The progress follower: reads the progress stream from its start (the histories), then
//! follows it, through a consumer or directly when the consumer stalls, and sends each report
//! to the main loop; and the deletion of the reports the leader refused for good.

use crate::followers::Input;
use async_nats::jetstream;
use converge_bus::Rejects;
use converge_common::{JobId, ProgressReport, subjects};
use futures::StreamExt;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;

/// A decoded progress report as read from the stream, not yet checked against the job's
/// placement ([`Reporters::check`](crate::reporters::Reporters::check)).
pub(crate) struct Progress {
    pub(crate) report: ProgressReport,
    pub(crate) subject: String,
    /// Its sequence in the stream (0 when unknown).
    pub(crate) seq: u64,
    /// When the stream stored it (UNIX seconds, the server's clock).
    pub(crate) stored_at: Option<f64>,
    /// It was in the stream when the allocator started (the history's replay).
    pub(crate) replay: bool,
}

/// Hands a refused report's sequence to [`delete_refused`]; when its queue is full (a flood
/// faster than deletions), the report stays in the stream until its bounds evict it, and
/// that is counted (`converge_allocator_refused_kept_total`).
pub(crate) fn queue_deletion(refused_tx: &mpsc::Sender<u64>, seq: u64) {
    static KEPT: AtomicU64 = AtomicU64::new(0);
    if refused_tx.try_send(seq).is_err() {
        metrics::counter!("converge_allocator_refused_kept_total").increment(1);
        let n = KEPT.fetch_add(1, Ordering::Relaxed) + 1;
        if is_power_of_ten(n) {
            tracing::warn!(
                kept_total = n,
                "refused progress report left in the stream: the deletion queue is full \
                 (a flood faster than deletions; the stream's bounds evict it)"
            );
        }
    }
}

/// 1, 10, 100, …: the counts at which a counted event that may come by the thousand is
/// logged again.
fn is_power_of_ten(mut n: u64) -> bool {
    while n >= 10 && n.is_multiple_of(10) {
        n /= 10;
    }
    n == 1
}

/// Deletes the progress reports the leader refused for good ([`crate::reporters::Refusal`]'s
/// `certain`) from the stream, so that no later replay and no reader of the stream sees them.
pub(crate) async fn delete_refused(js: jetstream::Context, mut rx: mpsc::Receiver<u64>) {
    let mut stream = None;
    while let Some(seq) = rx.recv().await {
        if stream.is_none() {
            stream = js.get_stream(subjects::PROGRESS_STREAM).await.ok();
        }
        let Some(s) = &stream else { continue };
        match s.delete_message(seq).await {
            Ok(_) => tracing::debug!(seq, "refused progress report deleted from the stream"),
            Err(e) => {
                // Counted: such a report stays in the stream until its bounds evict it.
                metrics::counter!("converge_allocator_refused_delete_failures_total").increment(1);
                tracing::debug!(seq, "refused progress report not deleted: {e}");
            }
        }
    }
}

/// Reads the progress stream from its start (the histories), signals when it has caught up
/// with what was there at start, then follows new reports. After an error, or when the
/// client reconnects to NATS (a restarted server has lost the consumer, which the client
/// would only notice after 15 s without heartbeats), it goes on from the report after the
/// last one it read; until a consumer works again (creating one needs JetStream's meta
/// leader, which a cluster that lost a server may be electing), it reads the new reports
/// directly ([`converge_bus::read_after`]).
pub(crate) async fn follow_progress(
    client: async_nats::Client,
    js: jetstream::Context,
    tx: mpsc::Sender<Input>,
    rejects: Arc<Rejects>,
    replay: Option<ReplayFilter>,
) {
    let mut at = ProgressPosition::default();
    if let Some(r) = replay {
        at.last_at_start = r.last_seq;
        at.replay_filter = r.jobs.iter().map(subjects::progress_of_job).collect();
        if at.replay_filter.is_empty() {
            // No job has a status or a plan: nothing in the stream can be accepted.
            tracing::info!(
                skipped = r.last_seq,
                "progress history: no job to replay; reports up to {} skipped",
                r.last_seq
            );
            at.last_seq = r.last_seq;
        }
    }
    let mut failures = 0u32;
    loop {
        match follow_progress_once(&client, &js, &tx, &rejects, &mut at).await {
            Ok(Ended::Replayed | Ended::Unfiltered) => {
                failures = 0;
                continue; // at once, every subject from here
            }
            Ok(Ended::Reconnected) => {
                failures = 0;
                tracing::info!(after = at.last_seq, "progress stream: following again")
            }
            Err(e) => {
                failures += 1;
                if !at.caught_up && !at.replay_filter.is_empty() && failures >= 2 {
                    // The filtered consumer could not be created twice (or stalled): the
                    // whole stream instead, from where the replay is.
                    tracing::warn!(
                        "progress history: the filtered replay failed twice; reading every subject"
                    );
                    at.replay_filter.clear();
                }
                tracing::warn!(
                    "progress stream: {e}; following again after report {} (attempt {failures})",
                    at.last_seq
                )
            }
        }
        if tx.is_closed() {
            return;
        }
        // The pause before the next attempt, reading directly meanwhile.
        let pause = Duration::from_millis(500 * u64::from(failures.clamp(1, 6)));
        if read_directly_during(tokio::time::sleep(pause), &tx, &rejects, &mut at)
            .await
            .is_none()
        {
            return;
        }
    }
}

/// Runs `work` to its end while reading new reports directly every half
/// [`PROGRESS_QUIET`] (once caught up with the stream's start and the stream is known): a
/// consumer being created (bounded, but seconds while a cluster elects its meta leader) or
/// a pause between attempts holds up no report. `None` once `tx` is closed.
async fn read_directly_during<F: Future>(
    work: F,
    tx: &mpsc::Sender<Input>,
    rejects: &Rejects,
    at: &mut ProgressPosition,
) -> Option<F::Output> {
    let mut work = std::pin::pin!(work);
    let mut tick = tokio::time::interval(PROGRESS_QUIET / 2);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            out = &mut work => return Some(out),
            _ = tick.tick() => {
                if !at.caught_up {
                    continue;
                }
                let Some(stream) = at.stream.clone() else { continue };
                if let Err(e) = forward_direct(&stream, tx, rejects, at).await {
                    if tx.is_closed() {
                        return None;
                    }
                    tracing::debug!("progress stream: {e}");
                }
            }
        }
    }
}

/// Where [`follow_progress`] is in the progress stream.
#[derive(Default)]
struct ProgressPosition {
    /// The stream, once looked up (a lookup needs its leader; reading directly does not).
    stream: Option<jetstream::stream::Stream>,
    /// The last report read (0: none).
    last_seq: u64,
    /// Whether the reports that were in the stream at the first start have been read.
    caught_up: bool,
    /// The stream's last report when the current consumer was created; with
    /// `replay_filter`, the stream's last report before the allocator read the statuses and
    /// plans ([`ReplayFilter::last_seq`]).
    last_at_start: u64,
    /// Until caught up: the subjects the replay reads (one wildcard per job with a status
    /// or a plan); empty: every subject.
    replay_filter: Vec<String>,
}

/// What the start-up replay may skip. Every report the acceptance rule can take belongs to
/// a job with a status or a plan ([`crate::reporters`]: a job never placed is refused), and
/// the leader writes a job's plan before its workers can report, so the jobs of the
/// statuses and plans read after the stream's last report `last_seq` cover every report up
/// to it that the replay would accept. The rest (reports a flooding agent made up for job
/// ids nobody placed) stays unread: the server skips it, so a restart takes as long as the
/// accepted history, not the stream, needs.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ReplayFilter {
    /// The progress stream's last sequence, read before the statuses and plans.
    pub(crate) last_seq: u64,
    /// The jobs with a status or a plan.
    pub(crate) jobs: Vec<JobId>,
}

/// Most jobs whose subjects the start-up replay filters on; with more, it reads the whole
/// stream (one filter subject per job goes into the consumer's configuration, a request
/// to the server of about 60 bytes a job).
pub(crate) const REPLAY_FILTER_MAX_JOBS: usize = 2_000;

/// The progress stream's last sequence (`None`: it could not be read within 6 s, e.g. a
/// cluster electing the stream's leader). Read before the statuses and plans, for
/// [`ReplayFilter`].
pub(crate) async fn last_sequence(js: &jetstream::Context) -> Option<u64> {
    let read = async {
        let mut stream = js.get_stream(subjects::PROGRESS_STREAM).await.ok()?;
        Some(stream.info().await.ok()?.state.last_sequence)
    };
    tokio::time::timeout(PROGRESS_STALL * 2, read)
        .await
        .ok()
        .flatten()
}

/// The replay's filter over the jobs read after `last_seq` (`None`: the whole stream is
/// read, when `last_seq` is unknown or there are more than [`REPLAY_FILTER_MAX_JOBS`]).
pub(crate) fn replay_filter(last_seq: Option<u64>, jobs: BTreeSet<JobId>) -> Option<ReplayFilter> {
    let last_seq = last_seq?;
    if jobs.len() > REPLAY_FILTER_MAX_JOBS {
        tracing::info!(
            jobs = jobs.len(),
            "progress history: more jobs than the replay filters on ({REPLAY_FILTER_MAX_JOBS}); reading the whole stream"
        );
        return None;
    }
    Some(ReplayFilter {
        last_seq,
        jobs: jobs.into_iter().collect(),
    })
}

/// How [`follow_progress_once`] ended without an error.
enum Ended {
    /// The filtered replay reached the end of the history ([`ReplayFilter::last_seq`]).
    Replayed,
    /// The consumer ended, or the client reconnected.
    Reconnected,
    /// The filtered replay gave way to reading every subject (most reports were the
    /// filter's), from where it was.
    Unfiltered,
}

/// Sends the report stored as `seq` (unless already read) and moves `at` past it; sends
/// [`Input::ProgressCaughtUp`] once, with the last report that was in the stream at start.
async fn forward_report(
    tx: &mpsc::Sender<Input>,
    rejects: &Rejects,
    at: &mut ProgressPosition,
    (subject, payload, seq, stored_at): (&str, &[u8], u64, Option<f64>),
) -> anyhow::Result<()> {
    if seq != 0 && seq <= at.last_seq {
        return Ok(()); // already read (before a reconnect, or directly)
    }
    if let Some(report) = rejects.decode::<ProgressReport>(subject, "", payload) {
        // Checked against the job's placement by the receiver (`Reporters::check`).
        let progress = Progress {
            report,
            subject: subject.to_string(),
            seq,
            stored_at,
            replay: !at.caught_up,
        };
        tx.send(Input::Progress(Box::new(progress))).await?;
    } else if seq != 0 {
        // Malformed, another protocol version, too large: deleted by the leader too, so a
        // flood of garbage neither stays in the stream nor is replayed after a restart.
        tx.send(Input::Undecodable(seq)).await?;
    }
    at.last_seq = at.last_seq.max(seq);
    if !at.caught_up && seq >= at.last_at_start {
        tx.send(Input::ProgressCaughtUp).await?;
        at.caught_up = true;
    }
    Ok(())
}

/// Reads the reports after `at.last_seq` directly (any replica answers; no consumer) and
/// forwards them; returns how many.
async fn forward_direct(
    stream: &jetstream::stream::Stream,
    tx: &mpsc::Sender<Input>,
    rejects: &Rejects,
    at: &mut ProgressPosition,
) -> anyhow::Result<usize> {
    let messages = converge_bus::read_after(
        stream,
        subjects::PROGRESS_ALL,
        at.last_seq,
        1000,
        PROGRESS_QUIET,
    )
    .await
    .map_err(|e| anyhow::anyhow!("direct read: {e}"))?;
    let n = messages.len();
    for msg in messages {
        let stored_at = msg.time.unix_timestamp_nanos() as f64 / 1e9;
        let report = (
            msg.subject.as_str(),
            &msg.payload[..],
            msg.sequence,
            Some(stored_at),
        );
        forward_report(tx, rejects, at, report).await?;
    }
    Ok(n)
}

/// How long the progress consumer may be quiet before newer reports are read directly
/// (then every 500 ms while it stays quiet; also the bound on each direct read).
const PROGRESS_QUIET: Duration = Duration::from_secs(1);

/// How long the progress consumer may leave a report read directly undelivered before
/// [`follow_progress_once`] re-creates it; creating it is bounded to twice this.
const PROGRESS_STALL: Duration = Duration::from_secs(3);

/// Follows the progress stream from `at.last_seq + 1` until the consumer ends or the client
/// reconnects (`Ok`) or stalls (`Err`), updating `at`.
async fn follow_progress_once(
    client: &async_nats::Client,
    js: &jetstream::Context,
    tx: &mpsc::Sender<Input>,
    rejects: &Rejects,
    at: &mut ProgressPosition,
) -> anyhow::Result<Ended> {
    let filtered = !at.caught_up && !at.replay_filter.is_empty();
    let deliver_policy = if at.last_seq == 0 {
        jetstream::consumer::DeliverPolicy::All
    } else {
        jetstream::consumer::DeliverPolicy::ByStartSequence {
            start_sequence: at.last_seq + 1,
        }
    };
    // Bounded: on a cluster electing its meta leader, creating a consumer can hang for as
    // long as the election (and longer when it lands on a dead server).
    let filter = at.replay_filter.clone();
    let setup = async {
        let mut stream = js.get_stream(subjects::PROGRESS_STREAM).await?;
        let state = stream.info().await?.state.clone();
        let (last_at_start, stored) = (state.last_sequence, state.messages);
        let config = if filtered {
            jetstream::consumer::pull::OrderedConfig {
                filter_subjects: filter,
                deliver_policy,
                ..Default::default()
            }
        } else {
            jetstream::consumer::pull::OrderedConfig {
                filter_subject: subjects::PROGRESS_ALL.to_string(),
                deliver_policy,
                ..Default::default()
            }
        };
        let consumer = stream.create_consumer(config).await?;
        // The reports left for it at creation (with the filter: of the filter's jobs).
        let pending = consumer.cached_info().num_pending;
        let messages = consumer.messages().await?;
        anyhow::Ok((stream, last_at_start, stored, pending, messages))
    };
    // (Reports are read directly meanwhile, from the last one read: the consumer's first
    // deliveries of those are skipped.)
    let bounded = tokio::time::timeout(PROGRESS_STALL * 2, setup);
    let (stream, last_at_start, stored, pending, mut messages) =
        read_directly_during(bounded, tx, rejects, at)
            .await
            .ok_or_else(|| anyhow::anyhow!("the allocator's loop has stopped"))?
            .map_err(|_| {
                anyhow::anyhow!(
                    "creating its consumer timed out after {:?}",
                    PROGRESS_STALL * 2
                )
            })??;
    at.stream = Some(stream.clone());
    if filtered && pending == 0 {
        finish_replay(tx, at).await?;
        return Ok(Ended::Replayed);
    }
    if filtered && pending.saturating_mul(2) >= stored {
        // Most of the stream is the filter's: reading it whole is faster (the server
        // matches every report against every job's subject otherwise; measured twice as
        // slow on a stream of honest reports only).
        tracing::info!(
            pending,
            stored,
            "progress history: most reports are of jobs with a status or a plan; reading every subject"
        );
        at.replay_filter.clear();
        return Ok(Ended::Unfiltered);
    }
    if !at.caught_up && !filtered {
        at.last_at_start = last_at_start;
        if last_at_start <= at.last_seq {
            tx.send(Input::ProgressCaughtUp).await?;
            at.caught_up = true;
        }
    }
    let mut state_tick = tokio::time::interval(Duration::from_millis(500));
    let mut was_connected = true;
    // On a NATS cluster the consumer lives on one server, which may die while this client
    // stays connected to another (or end up on a replica that no longer catches up): when
    // it is quiet for PROGRESS_QUIET, newer reports are read directly, and when it still
    // has not delivered one of those PROGRESS_STALL later, it is re-created (from the next
    // report). Before the first catch-up (a replay) it is re-created after 3 stall periods.
    let mut last_delivery = tokio::time::Instant::now();
    let mut missed: Option<(u64, tokio::time::Instant)> = None;
    loop {
        let msg = tokio::select! {
            msg = messages.next() => match msg {
                Some(m) => m,
                None => return Ok(Ended::Reconnected),
            },
            _ = state_tick.tick() => {
                let connected =
                    client.connection_state() == async_nats::connection::State::Connected;
                if connected && !was_connected {
                    return Ok(Ended::Reconnected);
                }
                was_connected = connected;
                if !connected || last_delivery.elapsed() < PROGRESS_QUIET {
                    continue;
                }
                if filtered && !history_left(&stream, &at.replay_filter, at.last_seq, at.last_at_start).await {
                    // Quiet, and no report of the filter's jobs is left up to the history's
                    // end (the consumer's own pending count can stay above 0 when the
                    // stream dropped reports meanwhile).
                    finish_replay(tx, at).await?;
                    return Ok(Ended::Replayed);
                }
                if !at.caught_up {
                    if filtered && last_delivery.elapsed() >= PROGRESS_STALL * 3 {
                        // The server finds the filter's reports too slowly (seen on a
                        // stream of 590,000 reports on as many subjects, its servers still
                        // busy with a flood): read the whole stream instead, from here.
                        at.replay_filter.clear();
                        anyhow::bail!(
                            "filtered replay stalled: nothing arrived for {:?} after report {}; \
                             reading every subject instead",
                            last_delivery.elapsed(),
                            at.last_seq
                        );
                    }
                    if last_delivery.elapsed() >= PROGRESS_STALL * 3 {
                        anyhow::bail!(
                            "consumer stalled while replaying: nothing arrived for {:?} after \
                             report {} (the stream held {} at start)",
                            last_delivery.elapsed(),
                            at.last_seq,
                            at.last_at_start
                        );
                    }
                    continue;
                }
                let before = at.last_seq;
                if let Err(e) = forward_direct(&stream, tx, rejects, at).await {
                    if tx.is_closed() {
                        return Err(e);
                    }
                    tracing::debug!("progress stream: {e}");
                }
                if at.last_seq > before && missed.is_none() {
                    missed = Some((at.last_seq, tokio::time::Instant::now()));
                }
                if let Some((seq, since)) = missed
                    && since.elapsed() >= PROGRESS_STALL
                {
                    anyhow::bail!(
                        "consumer stalled: report {seq} was read directly, the consumer \
                         delivered nothing for {:?} (its server may be gone)",
                        last_delivery.elapsed()
                    );
                }
                continue;
            }
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!("progress consumer: {e}");
                continue;
            }
        };
        last_delivery = tokio::time::Instant::now();
        let info = msg.info().ok();
        let seq = info.as_ref().map_or(0, |i| i.stream_sequence);
        let info_pending = info.as_ref().map(|i| i.pending);
        let stored_at = info.map(|i| i.published.unix_timestamp_nanos() as f64 / 1e9);
        if missed.is_some_and(|(s, _)| seq >= s) {
            missed = None;
        }
        if filtered && seq > at.last_at_start {
            // Past the history: from here on every subject is read, from the history's end.
            finish_replay(tx, at).await?;
            return Ok(Ended::Replayed);
        }
        forward_report(
            tx,
            rejects,
            at,
            (msg.subject.as_str(), &msg.payload[..], seq, stored_at),
        )
        .await?;
        if filtered && (at.caught_up || info_pending == Some(0)) {
            finish_replay(tx, at).await?;
            return Ok(Ended::Replayed);
        }
    }
}

/// Whether a report on one of `filter`'s subjects is stored after `after` and up to
/// `until`: the next report for each subject, read from the stream's leader (a direct get
/// could be answered by a replica that is behind), 32 at a time, each bounded by 1 s.
/// `true` when unsure (a read failed or timed out).
async fn history_left(
    stream: &jetstream::stream::Stream,
    filter: &[String],
    after: u64,
    until: u64,
) -> bool {
    if after >= until {
        return false;
    }
    let next = |subject: &String| {
        let get = stream
            .raw_message_builder()
            .sequence(after + 1)
            .next_by_subject(subject.clone())
            .send();
        async move {
            match tokio::time::timeout(Duration::from_secs(1), get).await {
                Ok(Ok(msg)) => msg.sequence <= until,
                Ok(Err(e)) => e.kind() != jetstream::stream::RawMessageErrorKind::NoMessageFound,
                Err(_) => true,
            }
        }
    };
    futures::stream::iter(filter)
        .map(next)
        .buffer_unordered(32)
        .any(|left| async move { left })
        .await
}

/// Ends a filtered replay: every report of the filter's jobs up to the history's end has
/// been read, so reading goes on after it, on every subject; what the filter skipped is
/// counted in the log.
async fn finish_replay(tx: &mpsc::Sender<Input>, at: &mut ProgressPosition) -> anyhow::Result<()> {
    tracing::info!(
        jobs = at.replay_filter.len(),
        until = at.last_at_start,
        "progress history replayed: the reports of jobs with a status or a plan; the other \
         subjects' reports were not read (each would be refused: no job of theirs was placed)"
    );
    at.replay_filter.clear();
    at.last_seq = at.last_seq.max(at.last_at_start);
    if !at.caught_up {
        tx.send(Input::ProgressCaughtUp).await?;
        at.caught_up = true;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn kept_refusals_are_logged_at_powers_of_ten() {
        let logged: Vec<u64> = (1..=1000).filter(|&n| super::is_power_of_ten(n)).collect();
        assert_eq!(logged, [1, 10, 100, 1000]);
    }

    use super::*;

    fn jobs(n: usize) -> BTreeSet<JobId> {
        (0..n).map(|i| format!("j{i}").parse().unwrap()).collect()
    }

    #[test]
    fn the_replay_filters_on_known_jobs_up_to_its_bound() {
        let filter = replay_filter(Some(42), jobs(3)).unwrap();
        assert_eq!(filter.last_seq, 42);
        assert_eq!(filter.jobs.len(), 3);
        assert!(
            replay_filter(Some(42), jobs(REPLAY_FILTER_MAX_JOBS)).is_some(),
            "at the bound"
        );
        // Past the bound, or with the stream's end unknown: the whole stream is read.
        assert_eq!(
            replay_filter(Some(42), jobs(REPLAY_FILTER_MAX_JOBS + 1)),
            None
        );
        assert_eq!(replay_filter(None, jobs(3)), None);
    }
}

//! Publishing with the [`Bus`]: on core NATS (best effort) or to JetStream, acknowledged,
//! optionally under a message id that makes retries idempotent.

use crate::{Bus, BusError};
use async_nats::jetstream;
use bytes::Bytes;
use converge_common::{Message, ProgressReport, encode, subjects};
use std::time::Duration;

/// How long [`Bus::publish_report`] retries a progress report NATS does not acknowledge.
/// On a NATS cluster a stream whose leader died refuses writes at once ("no stream found")
/// until a new leader is elected, 4 to 9 s later; five quick retries would give up before
/// that.
pub const PROGRESS_PATIENCE: Duration = Duration::from_secs(30);

/// How long one attempt to publish a progress report waits for its acknowledgement
/// (milliseconds on a healthy bus, replicated or not; a publish sent to a leader that dies
/// meanwhile is never acknowledged).
const PROGRESS_ACK_WAIT: Duration = Duration::from_secs(2);

/// The pause before the `attempt`th retry of a progress report: 200 ms more for each,
/// at most 1 s (a stream's new leader, elected 4 to 9 s after its old one died, gets the
/// waiting reports within a second of its election).
fn progress_retry_pause(attempt: u32) -> Duration {
    Duration::from_millis((200 * u64::from(attempt)).min(1000))
}

/// A progress report the stream acknowledged (see [`Bus::publish_report`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    /// Attempts that failed before the one acknowledged.
    pub retries: u32,
    /// The stream already held the report: an earlier attempt was stored after all.
    pub duplicate: bool,
}

/// A progress report given up after [`PROGRESS_PATIENCE`]: lost.
#[derive(Debug, thiserror::Error)]
#[error("progress report lost after {retries} retries in {elapsed:?}: {last}")]
pub struct ReportLost {
    pub retries: u32,
    pub elapsed: Duration,
    /// The last attempt's error.
    pub last: BusError,
}

impl Bus {
    /// Sends what the client still buffers to the server, waiting at most `wait`: a process
    /// stopping while NATS is away must not wait for a reconnect that may never come (the
    /// client's own `flush` waits until it is connected again). `false`: not flushed within
    /// `wait`, or the flush failed (what was buffered is lost; the caller logs it).
    pub async fn flush_within(&self, wait: Duration) -> bool {
        matches!(
            tokio::time::timeout(wait, self.client.flush()).await,
            Ok(Ok(()))
        )
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

    /// Publishes a progress report the way `converge-agent` does: on its job's subject for
    /// its host (`converge.v1.progress.<job>.<host>`), under [`ProgressReport::msg_id`], each
    /// attempt waiting 2 s, retried after a pause (200 ms more each time, at most 1 s) until
    /// [`PROGRESS_PATIENCE`] has passed since the first. The same message id makes a retry of
    /// a report the stream did store a duplicate the stream drops. Each retry is logged
    /// (warn). `Err`: lost, never acknowledged (it may still have been stored late).
    pub async fn publish_report(&self, report: &ProgressReport) -> Result<Delivered, ReportLost> {
        let subject = subjects::progress(&report.job, &report.host);
        let msg_id = report.msg_id();
        let started = tokio::time::Instant::now();
        let mut retries = 0u32;
        loop {
            match self
                .publish_acked_once(subject.clone(), report, &msg_id, PROGRESS_ACK_WAIT)
                .await
            {
                Ok(duplicate) => return Ok(Delivered { retries, duplicate }),
                Err(e) if started.elapsed() < PROGRESS_PATIENCE => {
                    retries += 1;
                    tracing::warn!("{e}; retry {retries}");
                    tokio::time::sleep(progress_retry_pause(retries)).await;
                }
                Err(last) => {
                    return Err(ReportLost {
                        retries,
                        elapsed: started.elapsed(),
                        last,
                    });
                }
            }
        }
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

#[cfg(test)]
mod tests {
    use super::progress_retry_pause;

    #[test]
    fn report_retries_pause_longer_each_time_up_to_a_second() {
        let pauses: Vec<u64> = (1..=7)
            .map(|a| progress_retry_pause(a).as_millis() as u64)
            .collect();
        assert_eq!(pauses, [200, 400, 600, 800, 1000, 1000, 1000]);
    }
}

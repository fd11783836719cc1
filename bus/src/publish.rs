//! Publishing with the [`Bus`]: on core NATS (best effort) or to JetStream, acknowledged,
//! optionally under a message id that makes retries idempotent.

use crate::{Bus, BusError};
use async_nats::jetstream;
use bytes::Bytes;
use converge_common::{Message, encode};
use std::time::Duration;

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

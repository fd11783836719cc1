//! Reading a stream's messages by sequence with direct gets ([`read_after`]): the progress
//! stream's and the KV buckets' reads that need no consumer or leader.

use async_nats::jetstream;
use std::time::Duration;

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

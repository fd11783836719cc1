//! [`Rejects`]: the counter of messages a process refused, by source and kind.

use converge_common::{DecodeError, Message, decode};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Refusals logged per second at most, after a first burst of [`LOG_BURST`].
pub const LOG_PER_S: NonZeroU32 = NonZeroU32::new(10).unwrap();
/// Refusals logged at once before [`LOG_PER_S`] applies.
pub const LOG_BURST: NonZeroU32 = NonZeroU32::new(100).unwrap();
/// Distinct (source, kind) pairs counted apart; refusals of further pairs are counted under
/// ([`OTHER_SOURCES`], kind) (a flood on a new subject per message must not grow the table).
pub const MAX_SOURCES: usize = 1024;
/// The source under which refusals past [`MAX_SOURCES`] (source, kind) pairs are counted.
pub const OTHER_SOURCES: &str = "(other sources)";

/// Counts messages a process refused, by where they came from and why, and logs them at
/// `warn`: every refusal while refusals are rare, then at most [`LOG_PER_S`] a second (after
/// a burst of [`LOG_BURST`]); the next line logged says how many were not. Every refusal is
/// counted either way; the process keeps serving. A flood of malformed messages therefore
/// costs the process neither its log nor its memory.
#[derive(Debug)]
pub struct Rejects {
    counts: Mutex<BTreeMap<(String, &'static str), u64>>,
    log: DefaultDirectRateLimiter,
    /// Refusals not logged since the last line that was.
    unlogged: AtomicU64,
}

impl Default for Rejects {
    fn default() -> Self {
        Self {
            counts: Mutex::default(),
            log: RateLimiter::direct(Quota::per_second(LOG_PER_S).allow_burst(LOG_BURST)),
            unlogged: AtomicU64::new(0),
        }
    }
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
        if self.log.check().is_ok() {
            match self.unlogged.swap(0, Ordering::Relaxed) {
                0 => tracing::warn!(source, key, kind, "refused message: {reason}"),
                n => tracing::warn!(
                    source,
                    key,
                    kind,
                    not_logged = n,
                    "refused message: {reason} ({n} refusals before this one were counted, \
                     not logged: more than {LOG_PER_S} a second)"
                ),
            }
        } else {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
        }
        let mut counts = self.counts.lock().expect("not poisoned");
        let known = counts.contains_key(&(source.to_string(), kind));
        let source = if known || counts.len() < MAX_SOURCES {
            source
        } else {
            OTHER_SOURCES
        };
        *counts.entry((source.to_string(), kind)).or_default() += 1;
    }

    /// Logs how many refusals were counted but not logged since the last line that was, if
    /// any, and returns that number: called on a timer (the allocator's lifecycle tick,
    /// once a second), so the count of a flood's last second is logged once the flood ends
    /// instead of waiting for the next refusal. One line per call at most.
    pub fn log_unlogged(&self) -> u64 {
        let n = self.unlogged.swap(0, Ordering::Relaxed);
        if n > 0 {
            tracing::warn!(
                not_logged = n,
                "{n} refused messages were counted, not logged (more than {LOG_PER_S} a second); \
                 converge_*_refused_messages has them by kind"
            );
        }
        n
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

    /// Refusals by (source, kind); pairs past the first [`MAX_SOURCES`] are counted under
    /// ([`OTHER_SOURCES`], kind).
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

    /// A flood on a new subject per message: every refusal is counted, the table stays
    /// bounded, and only the burst plus what the rate allows is logged.
    #[test]
    fn a_flood_of_refusals_is_counted_in_full_and_bounded_in_memory_and_log() {
        let rejects = Rejects::default();
        let n = 20_000u64;
        for i in 0..n {
            rejects.refuse(&format!("progress.flood-{i}.h0"), "", "invalid", &"x");
        }
        assert_eq!(rejects.total(), n);
        let counts = rejects.snapshot();
        assert_eq!(counts.len(), MAX_SOURCES + 1);
        assert_eq!(
            counts[&(OTHER_SOURCES.to_string(), "invalid")],
            n - MAX_SOURCES as u64
        );
        // Far fewer than n were logged: the rest wait in `unlogged` for the next line.
        let unlogged = rejects.unlogged.load(Ordering::Relaxed);
        assert!(
            unlogged >= n - u64::from(LOG_BURST.get()) - 1_000,
            "{unlogged} of {n} not logged"
        );
        // When the flood ends, the timer's call logs what is left, once.
        assert_eq!(rejects.log_unlogged(), unlogged);
        assert_eq!(rejects.log_unlogged(), 0);
        // A source counted apart stays apart once the table is full.
        rejects.refuse("progress.flood-0.h0", "", "invalid", &"x");
        assert_eq!(
            rejects.snapshot()[&("progress.flood-0.h0".to_string(), "invalid")],
            2
        );
    }
}

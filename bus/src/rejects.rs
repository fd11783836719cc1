//! [`Rejects`]: the counter of messages a process refused, by source and kind.

use converge_common::{DecodeError, Message, decode};
use std::collections::BTreeMap;
use std::sync::Mutex;

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
}

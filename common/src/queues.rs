//! Queues and priority classes: how teams share the cluster (docs/scheduling.md "Queues,
//! fair share and priorities").
//!
//! A *queue* ([`QueueSpec`], KV `converge-queues`, key = queue name, written by
//! `converge queue create|set|delete`) has a nominal GPU quota the cluster guarantees it, a
//! borrowing limit (how many GPUs beyond its quota it may use while other queues leave
//! theirs idle) and a weight in the fair share of lent GPUs. A job names its queue in its
//! spec (`queue = "team-a"`); a job without one is in the [`DEFAULT_QUEUE`]. The default
//! queue exists even when nobody created it: quota 0, no borrowing limit, weight 1, so a
//! cluster without queues schedules every job from one pool, as before queues existed.
//!
//! The allocator publishes what each queue holds ([`QueueStatus`], KV
//! `converge-queue-status`): GPUs in use and borrowed, its fair share and its decayed usage
//! (the allocator's only memory of past use; it keeps no local state, so a new leader
//! resumes the decay from there).
//!
//! A job's *priority class* ([`PriorityClass`]) orders jobs within their queue: a pending
//! job of a higher class may preempt whole jobs of lower classes (gang preemption), never
//! GPUs another queue holds within its quota.

use crate::codec::{Message, PROTOCOL_VERSION};
use crate::ids::QueueId;
use serde::{Deserialize, Serialize};

/// Name of the queue of jobs whose spec names none.
pub const DEFAULT_QUEUE: &str = "default";
/// Largest nominal quota or borrowing limit a queue may have, in GPUs.
pub const MAX_QUEUE_GPUS: u32 = 1 << 20;
/// Largest weight a queue may have (weights are relative; 1 is the default).
pub const MAX_QUEUE_WEIGHT: f64 = 1000.0;

fn default_protocol() -> u32 {
    PROTOCOL_VERSION
}
fn default_weight() -> f64 {
    1.0
}

/// A queue (KV `converge-queues`, key = its name).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueSpec {
    #[serde(default = "default_protocol")]
    pub protocol: u32,
    pub name: QueueId,
    /// Nominal quota, in GPUs: what the queue is guaranteed. GPUs it leaves idle are lent
    /// to other queues and reclaimed (by preemption of the borrowers' jobs) when its own
    /// jobs need them.
    pub quota_gpus: u32,
    /// Most GPUs beyond `quota_gpus` the queue may borrow from other queues' idle quota;
    /// `None`: no limit (any idle GPU), `Some(0)`: never borrows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub borrowing_limit_gpus: Option<u32>,
    /// Relative weight in the fair share of lent GPUs (finite, > 0, at most
    /// [`MAX_QUEUE_WEIGHT`]; default 1).
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// When it was created and last changed, UNIX seconds (set by the CLI).
    #[serde(default)]
    pub created_at: f64,
    #[serde(default)]
    pub updated_at: f64,
}

impl QueueSpec {
    /// The queue every job without a `queue` belongs to when nobody created one: quota 0,
    /// no borrowing limit, weight 1.
    pub fn implicit_default() -> Self {
        Self {
            protocol: PROTOCOL_VERSION,
            name: QueueId::new(DEFAULT_QUEUE).expect("valid queue name"),
            quota_gpus: 0,
            borrowing_limit_gpus: None,
            weight: 1.0,
            created_at: 0.0,
            updated_at: 0.0,
        }
    }

    /// Most GPUs the queue may hold: quota plus borrowing limit (saturating; `u32::MAX`
    /// without a limit).
    pub fn max_gpus(&self) -> u32 {
        match self.borrowing_limit_gpus {
            Some(b) => self.quota_gpus.saturating_add(b),
            None => u32::MAX,
        }
    }

    /// Checks what the types do not; the error says which field and why.
    pub fn check(&self) -> Result<(), String> {
        if self.protocol != PROTOCOL_VERSION {
            return Err(format!("unsupported protocol version {}", self.protocol));
        }
        check_quota("quota_gpus", i64::from(self.quota_gpus))?;
        if let Some(b) = self.borrowing_limit_gpus {
            check_quota("borrowing_limit_gpus", i64::from(b))?;
        }
        check_weight(self.weight)?;
        for (name, t) in [
            ("created_at", self.created_at),
            ("updated_at", self.updated_at),
        ] {
            if !t.is_finite() || t < 0.0 {
                return Err(format!("`{name}` must be a finite time ≥ 0, got {t}"));
            }
        }
        Ok(())
    }
}

/// Checks a quota or borrowing limit given as a signed number (what a user typed), so a
/// negative one is refused with the reason rather than a parse error.
pub fn check_quota(field: &str, gpus: i64) -> Result<u32, String> {
    if gpus < 0 {
        return Err(format!(
            "`{field}` is {gpus}; a number of GPUs cannot be below zero"
        ));
    }
    if gpus > i64::from(MAX_QUEUE_GPUS) {
        return Err(format!(
            "`{field}` is {gpus} GPUs; at most {MAX_QUEUE_GPUS} are allowed"
        ));
    }
    Ok(gpus as u32)
}

/// Checks a queue weight: finite, > 0 and at most [`MAX_QUEUE_WEIGHT`].
pub fn check_weight(weight: f64) -> Result<(), String> {
    if !(weight.is_finite() && weight > 0.0 && weight <= MAX_QUEUE_WEIGHT) {
        return Err(format!(
            "`weight` is {weight}; it must be a number above 0 and at most {MAX_QUEUE_WEIGHT}"
        ));
    }
    Ok(())
}

impl Message for QueueSpec {
    fn protocol(&self) -> u32 {
        self.protocol
    }
    fn validate(&self) -> Result<(), String> {
        self.check()
    }
}

/// A job's priority class (`priority = "high"` in its spec; default `normal`). Within a
/// queue, a pending job may preempt whole running jobs of a *lower* class, newest first and
/// never more than it needs; jobs of one class never preempt each other. Across queues,
/// only GPUs a queue borrows beyond its quota can be taken back, and only by the queue that
/// lent them (reclaim), whatever the classes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(rename_all = "snake_case")]
pub enum PriorityClass {
    /// Best effort: preempted first.
    Low,
    /// The default.
    #[default]
    Normal,
    /// Preempts `normal` and `low` jobs of its queue.
    High,
}

impl PriorityClass {
    /// Every class, lowest first.
    pub const ALL: [PriorityClass; 3] = [
        PriorityClass::Low,
        PriorityClass::Normal,
        PriorityClass::High,
    ];

    /// As written in a job spec (`low`, `normal`, `high`).
    pub fn as_str(self) -> &'static str {
        match self {
            PriorityClass::Low => "low",
            PriorityClass::Normal => "normal",
            PriorityClass::High => "high",
        }
    }

    /// Its numeric value (higher wins), as Kubernetes' PriorityClass values: 0, 100, 1000.
    pub fn value(self) -> i32 {
        match self {
            PriorityClass::Low => 0,
            PriorityClass::Normal => 100,
            PriorityClass::High => 1000,
        }
    }
}

impl std::fmt::Display for PriorityClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a queue holds, as the allocator last decided (KV `converge-queue-status`, key =
/// queue name; written by the allocator only, every scheduling step in which it changed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueStatus {
    #[serde(default = "default_protocol")]
    pub protocol: u32,
    pub queue: QueueId,
    /// GPUs its running jobs hold.
    pub gpus_in_use: u32,
    /// Of those, GPUs beyond its quota (borrowed from other queues' idle quota).
    pub borrowed_gpus: u32,
    /// GPUs of its quota lent to other queues (quota it leaves idle while others use it).
    pub lent_gpus: u32,
    /// GPUs the fair share gives it at this step (its quota while it needs that, plus its
    /// share of the lent GPUs), which its jobs' allocation follows.
    pub fair_share_gpus: f64,
    /// Decayed usage, GPU-seconds: `Σ gpus·dt`, each term halved every `half_life_s`
    /// since it was used. Lower usage per weight borrows first.
    pub usage_gpu_seconds: f64,
    /// Half-life of the decay, seconds, as configured when `usage_gpu_seconds` was computed.
    pub half_life_s: f64,
    pub running_jobs: u32,
    pub pending_jobs: u32,
    /// When the allocator computed it, UNIX seconds (the time `usage_gpu_seconds` is at).
    pub updated_at: f64,
}

impl Message for QueueStatus {
    fn protocol(&self) -> u32 {
        self.protocol
    }
    fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("fair_share_gpus", self.fair_share_gpus),
            ("usage_gpu_seconds", self.usage_gpu_seconds),
            ("half_life_s", self.half_life_s),
            ("updated_at", self.updated_at),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("`{name}` must be finite and ≥ 0, got {v}"));
            }
        }
        if self.borrowed_gpus > self.gpus_in_use {
            return Err(format!(
                "`borrowed_gpus` ({}) exceeds `gpus_in_use` ({})",
                self.borrowed_gpus, self.gpus_in_use
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};

    fn queue(quota: u32, borrow: Option<u32>, weight: f64) -> QueueSpec {
        QueueSpec {
            name: "team-a".parse().unwrap(),
            quota_gpus: quota,
            borrowing_limit_gpus: borrow,
            weight,
            ..QueueSpec::implicit_default()
        }
    }

    #[test]
    fn a_queue_round_trips_and_bad_values_are_refused_with_the_field() {
        let q = queue(8, Some(4), 2.0);
        assert_eq!(q.max_gpus(), 12);
        let back: QueueSpec = decode(&encode(&q)).unwrap();
        assert_eq!(back, q);
        assert_eq!(queue(8, None, 1.0).max_gpus(), u32::MAX);
        for w in [0.0, -1.0, f64::NAN, f64::INFINITY, 1001.0] {
            let err = queue(1, None, w).check().unwrap_err();
            assert!(err.contains("weight"), "{err}");
        }
        let err = check_quota("quota_gpus", -1).unwrap_err();
        assert!(err.contains("below zero"), "{err}");
        assert_eq!(check_quota("quota_gpus", 3), Ok(3));
        assert!(check_quota("quota_gpus", i64::from(MAX_QUEUE_GPUS) + 1).is_err());
        let negative = br#"{"protocol":1,"name":"a","quota_gpus":-2}"#;
        assert!(decode::<QueueSpec>(negative).is_err());
        let unknown = br#"{"protocol":1,"name":"a","quota_gpus":2,"quota":3}"#;
        assert!(decode::<QueueSpec>(unknown).is_err());
    }

    #[test]
    fn priority_classes_order_and_parse() {
        assert!(PriorityClass::High > PriorityClass::Normal);
        assert!(PriorityClass::Normal > PriorityClass::Low);
        assert_eq!(PriorityClass::default(), PriorityClass::Normal);
        for c in PriorityClass::ALL {
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(json, format!("\"{}\"", c.as_str()));
            assert_eq!(serde_json::from_str::<PriorityClass>(&json).unwrap(), c);
        }
        assert!(serde_json::from_str::<PriorityClass>("\"urgent\"").is_err());
        let values: Vec<i32> = PriorityClass::ALL.iter().map(|c| c.value()).collect();
        assert!(values.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_queue_status_with_more_borrowed_than_used_is_refused() {
        let s = QueueStatus {
            protocol: PROTOCOL_VERSION,
            queue: "team-a".parse().unwrap(),
            gpus_in_use: 2,
            borrowed_gpus: 3,
            lent_gpus: 0,
            fair_share_gpus: 2.0,
            usage_gpu_seconds: 10.0,
            half_life_s: 3600.0,
            running_jobs: 1,
            pending_jobs: 0,
            updated_at: 1.0,
        };
        assert!(decode::<QueueStatus>(&encode(&s)).is_err());
        let ok = QueueStatus {
            borrowed_gpus: 1,
            ..s
        };
        assert_eq!(decode::<QueueStatus>(&encode(&ok)).unwrap(), ok);
    }
}

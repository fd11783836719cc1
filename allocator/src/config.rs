//! The allocator's command line and environment ([`AllocatorConfig`]) and the pure step's
//! settings derived from it.

use converge_bus::{NatsArgs, humantime_duration};
use converge_sched::placement::PlacementKind;
use converge_sched::policies::{Objective, PolicyParams};
use converge_sched::schedule::Settings;
use std::time::Duration;

/// Command line and environment of `converge-allocator`.
#[derive(Debug, Clone, clap::Args)]
pub struct AllocatorConfig {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Scheduling interval: how often the policy re-decides allocations (it also runs when a
    /// job is submitted or finishes and when hosts come or go). SLAQ uses 10 s. `--epoch`
    /// is the old name, accepted for one release (`CONVERGE_EPOCH` is refused with a message
    /// naming the new variable).
    #[arg(
        long,
        visible_alias = "epoch",
        env = "CONVERGE_SCHEDULING_INTERVAL",
        default_value = "10s",
        value_parser = humantime_duration
    )]
    pub scheduling_interval: Duration,
    /// How far ahead the policy predicts each job's loss reduction.
    #[arg(long, env = "CONVERGE_HORIZON", default_value = "60s", value_parser = humantime_duration)]
    pub horizon: Duration,
    /// Time a job loses when its allocation changes (checkpoint, restart, rendezvous). A
    /// running job is resized only if the predicted gain over the horizon, with this much
    /// less time to make it, beats keeping its allocation. 0 disables the hysteresis.
    #[arg(long, env = "CONVERGE_RESTART_COST", default_value = "30s", value_parser = humantime_duration)]
    pub restart_cost: Duration,
    /// A host whose heartbeat is older than this is lost; its jobs are placed elsewhere.
    #[arg(long, env = "CONVERGE_HOST_TIMEOUT", default_value = "15s", value_parser = humantime_duration)]
    pub host_timeout: Duration,
    /// Policy that sizes jobs: quality (the default), fair, fifo, tiresias, optimus or sjf-bco. The
    /// service does not track attained service, so tiresias keeps every job in its first
    /// queue; optimus uses the throughput model and, for a job with a target loss, the
    /// samples its curve predicts to reach it.
    #[arg(long, env = "CONVERGE_POLICY", default_value = "quality", value_parser = parse_policy)]
    pub policy: String,
    /// What the quality policy maximizes over the horizon: `auto` (the default: `loss` for
    /// exploratory jobs, a sweep's trials without a target loss and jobs with stop criteria
    /// but no target loss or declared work; `jct` for any other), `both` (the sum of the two below), `jct` (each
    /// job's speedup weighted by its rank by remaining time, which favours jobs close to
    /// completion) or `loss` (SLAQ's normalized loss reduction). A job's
    /// remaining work is known when it has a `target_loss` its fitted curve reaches; else it
    /// is guessed as the work it has done so far.
    #[arg(long, env = "CONVERGE_OBJECTIVE", value_enum, default_value_t = Objective::default())]
    pub objective: Objective,
    /// Placement: `first-fit` (hosts in id order) or `bco` (balance contention between
    /// multi-host jobs on shared NICs against the overhead of spanning hosts, priced by each
    /// job's throughput model; the default: in the simulator it lowers the quality policy's
    /// mean JCT, by 28 % under Pollux's interference; see docs/scheduling.md).
    #[arg(long, env = "CONVERGE_PLACEMENT", value_enum, default_value_t = PlacementKind::Bco)]
    pub placement: PlacementKind,
    /// Starvation guard: a job that has never run and is pending this long since submission
    /// is admitted ahead of running jobs (which may stop one at its minimum to make room); a
    /// preempted job waits for its turn.
    #[arg(long, env = "CONVERGE_MAX_WAIT", default_value = "30m", value_parser = humantime_duration)]
    pub max_wait: Duration,
    /// Parameter-server shards one host may run, all jobs together (each is a CPU process
    /// without a GPU). The planner of `arch = "ps"` jobs places shards within this bound;
    /// with 0 it finds no plan and puts one shard next to each worker host.
    #[arg(long, env = "CONVERGE_PS_SHARDS_PER_HOST", default_value_t = converge_sched::schedule::DEFAULT_PS_SHARDS_PER_HOST)]
    pub ps_shards_per_host: u32,
    /// Serve Prometheus metrics at `http://<addr>/metrics` (e.g. `0.0.0.0:9464`): step
    /// (decision) time, progress ingest lag, reports ingested, writes, jobs by phase, live
    /// hosts, refused messages, leadership and the process's memory. Off when unset.
    #[arg(long, env = "CONVERGE_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Most loss curves refitted in one scheduling step; the others keep their last fit
    /// until a later step. Bounds the step (decision) time when many jobs report at once.
    #[arg(long, env = "CONVERGE_FIT_BUDGET", default_value_t = converge_sched::schedule::DEFAULT_FIT_BUDGET)]
    pub fit_budget: usize,
    /// This replica's id for the leader lease (unique among replicas; default: the host
    /// name). Run several replicas with the same NATS for failover: only the lease holder
    /// schedules and writes.
    #[arg(long, env = "CONVERGE_REPLICA_ID", default_value_t = default_replica_id())]
    pub replica_id: String,
    /// Leader lease length: a replica takes over when the leader has not renewed for this
    /// long (renewals every third of it). Handover after a leader dies takes between ⅔ and
    /// 1⅓ of it; a leader that stops cleanly hands over within a third of it.
    #[arg(long, env = "CONVERGE_LEASE_TTL", default_value = "10s", value_parser = humantime_duration)]
    pub lease_ttl: Duration,
    /// Half-life of each queue's decayed GPU usage in the fair share of lent GPUs: a queue
    /// that borrowed heavily gets less of what is lent for about this long. Not 0 (that
    /// would forget usage at once; see docs/scheduling.md, "Queues, fair share and
    /// priorities").
    #[arg(long, env = "CONVERGE_USAGE_HALF_LIFE", default_value = "1h", value_parser = parse_half_life)]
    pub usage_half_life: Duration,
}

fn parse_half_life(s: &str) -> Result<Duration, String> {
    let d = humantime_duration(s)?;
    if d.is_zero() {
        return Err("the usage half-life must be above 0 (e.g. 1h)".into());
    }
    Ok(d)
}

/// The host name, or `allocator` when it cannot be read.
pub fn default_replica_id() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "allocator".into())
}

fn parse_policy(s: &str) -> Result<String, String> {
    converge_sched::policies::by_name(s, PolicyParams::default())
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

impl AllocatorConfig {
    /// The pure step's settings from the command line.
    pub fn settings(&self) -> Settings {
        let policy_params = PolicyParams {
            horizon_s: self.horizon.as_secs_f64(),
            restart_cost_s: self.restart_cost.as_secs_f64(),
            objective: self.objective,
            max_wait_s: self.max_wait.as_secs_f64(),
            ..PolicyParams::default()
        };
        let policy = converge_sched::policies::by_name(&self.policy, policy_params)
            .map(std::sync::Arc::from)
            .unwrap_or_else(|_| Settings::default().policy);
        Settings {
            host_timeout_s: self.host_timeout.as_secs_f64(),
            placement: self.placement,
            policy_params,
            policy,
            ps_shards_per_host: self.ps_shards_per_host,
            fit_budget: self.fit_budget,
            usage_half_life_s: self.usage_half_life.as_secs_f64(),
            ..Settings::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_usage_half_life_defaults_to_an_hour_and_refuses_zero() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            cfg: AllocatorConfig,
        }
        let cli = Cli::try_parse_from(["converge-allocator"]).unwrap();
        assert_eq!(cli.cfg.usage_half_life, Duration::from_secs(3600));
        assert_eq!(cli.cfg.settings().usage_half_life_s, 3600.0);
        let cli = Cli::try_parse_from(["converge-allocator", "--usage-half-life", "20m"]).unwrap();
        assert_eq!(cli.cfg.settings().usage_half_life_s, 1200.0);
        assert!(Cli::try_parse_from(["converge-allocator", "--usage-half-life", "0s"]).is_err());
    }
}

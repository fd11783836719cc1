//! `converge queue create|set|list|delete`: the queues teams share the cluster through (KV
//! `converge-queues`, key = queue name; docs/scheduling.md "Queues, fair share and
//! priorities"), and `converge submit`'s refusal of a job whose queue does not exist.
//!
//! Everything a user typed is checked before the network is touched, with
//! `converge_common::queues`' own checks (a negative quota is read as a signed number so that
//! the refusal says why, not that `-1` is not a valid unsigned number). Writes are
//! compare-and-set: `create` refuses an existing queue, `set` and `delete` refuse a queue that
//! changed meanwhile.

use anyhow::{Context as _, bail};
use clap::Subcommand;
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use converge_bus::{Bus, BusError, QueueBuckets, Rejects, Setup};
use converge_common::queues::{self, DEFAULT_QUEUE};
use converge_common::{JobId, JobSpec, JobStatus, QueueId, QueueSpec, QueueStatus};
use std::collections::{BTreeMap, BTreeSet};

/// A borrowing limit as typed: a number of GPUs (checked like a quota, so that a negative
/// one is refused with the reason) or `unlimited`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Unlimited,
    Gpus(i64),
}

impl std::str::FromStr for Limit {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("unlimited") || s.eq_ignore_ascii_case("none") {
            return Ok(Limit::Unlimited);
        }
        s.trim()
            .parse::<i64>()
            .map(Limit::Gpus)
            .map_err(|_| format!("{s:?} is neither a number of GPUs nor `unlimited`"))
    }
}

impl Limit {
    /// The spec's `borrowing_limit_gpus`: `None` for unlimited, a checked count otherwise.
    fn check(self) -> Result<Option<u32>, String> {
        match self {
            Limit::Unlimited => Ok(None),
            Limit::Gpus(n) => queues::check_quota("borrowing_limit_gpus", n).map(Some),
        }
    }
}

/// Explains the units and what each setting does; shared by `create` and `set`.
const QUEUE_SEMANTICS: &str = "\
Units: every quota and limit is a number of GPUs (a job of 3 workers × 2 GPUs holds 6).

  quota            GPUs the queue is guaranteed: while its jobs need them, no other queue
                   keeps them (GPUs another queue borrowed are reclaimed by preempting whole
                   jobs of that queue, from their latest checkpoint). Quota it leaves idle
                   is lent to queues that need more.
  borrowing limit  most GPUs beyond its quota the queue may borrow from idle quota and
                   GPUs no quota covers; `unlimited` (the default) or 0 (never borrows).
  weight           its relative share of what is lent (default 1, above 0, at most 1000):
                   borrowers get lent GPUs in proportion to their weights, less for a
                   queue that borrowed heavily lately. That memory is each queue's decayed
                   usage (GPU-seconds, halved every half-life: converge-allocator
                   --usage-half-life, default 1h), shown by `converge queue list`.

Within a queue, jobs are ordered by priority class (`priority = \"low\"|\"normal\"|\"high\"`
in the job spec): a pending job may preempt whole running jobs of a lower class of its
queue, never more than it needs, and never GPUs another queue holds within its quota.
A job names its queue with `queue = \"NAME\"`; jobs without one are in the `default` queue,
which always exists (quota 0, unlimited borrowing, weight 1, until changed with
`converge queue set default`).";

/// `converge queue …`.
#[derive(Debug, Subcommand)]
pub enum QueueCommand {
    /// Create a queue with a GPU quota. Refused if it exists (change it with `converge
    /// queue set`).
    #[command(after_long_help = QUEUE_SEMANTICS)]
    Create {
        /// Queue name: letters, digits, `-` and `_`, at most 64 (what `queue = "…"` in a
        /// job spec names).
        name: String,
        /// Nominal quota, in GPUs: what the queue is guaranteed (0 or more).
        #[arg(long, value_name = "GPUS", allow_negative_numbers = true)]
        quota: i64,
        /// Most GPUs beyond the quota the queue may borrow from other queues' idle quota:
        /// a number of GPUs (0: never borrows) or `unlimited`.
        #[arg(
            long,
            value_name = "GPUS|unlimited",
            default_value = "unlimited",
            allow_negative_numbers = true
        )]
        borrowing_limit: Limit,
        /// Relative weight in the fair share of lent GPUs (above 0, at most 1000).
        #[arg(
            long,
            value_name = "W",
            default_value_t = 1.0,
            allow_negative_numbers = true
        )]
        weight: f64,
    },
    /// Change a queue's quota, borrowing limit or weight (any of them; the others stay).
    /// The allocator applies the change at its next scheduling step: a lower quota or
    /// limit may preempt the queue's newest jobs.
    #[command(after_long_help = QUEUE_SEMANTICS)]
    Set {
        /// Queue name (`default` too: setting it stores it with these values).
        name: String,
        /// New nominal quota, in GPUs (0 or more).
        #[arg(long, value_name = "GPUS", allow_negative_numbers = true)]
        quota: Option<i64>,
        /// New borrowing limit: a number of GPUs (0: never borrows) or `unlimited`.
        #[arg(long, value_name = "GPUS|unlimited", allow_negative_numbers = true)]
        borrowing_limit: Option<Limit>,
        /// New weight in the fair share of lent GPUs (above 0, at most 1000).
        #[arg(long, value_name = "W", allow_negative_numbers = true)]
        weight: Option<f64>,
    },
    /// List the queues: quota, borrowing limit and weight, and what the allocator last
    /// published for each (GPUs in use, borrowed beyond the quota, lent to others, fair
    /// share, decayed usage in GPU-hours, running and pending jobs). `--json` for scripts.
    #[command(after_long_help = QUEUE_SEMANTICS)]
    List,
    /// Delete a queue. Refused while jobs that are not finished name it (their ids are
    /// listed), unless --force: those jobs are then stopped (from their checkpoint) and
    /// wait, pending, with the reason `queue "NAME" does not exist`, until a queue of that
    /// name is created again (they resume) or they are cancelled.
    Delete {
        /// Queue name.
        name: String,
        /// Delete it even though active jobs name it.
        #[arg(long)]
        force: bool,
    },
}

/// Changes `converge queue set` applies, checked.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Changes {
    pub quota_gpus: Option<u32>,
    pub borrowing_limit_gpus: Option<Option<u32>>,
    pub weight: Option<f64>,
}

impl Changes {
    /// Applies the changes to `spec` at `now`.
    pub fn apply(&self, spec: &QueueSpec, now: f64) -> QueueSpec {
        let mut out = spec.clone();
        if let Some(q) = self.quota_gpus {
            out.quota_gpus = q;
        }
        if let Some(b) = self.borrowing_limit_gpus {
            out.borrowing_limit_gpus = b;
        }
        if let Some(w) = self.weight {
            out.weight = w;
        }
        out.updated_at = now;
        out
    }
}

/// A queue command whose input has been checked: nothing here touches the network.
#[derive(Debug, Clone, PartialEq)]
pub enum Checked {
    Create(QueueSpec),
    Set(QueueId, Changes),
    List,
    Delete(QueueId, bool),
}

fn queue_name(name: &str) -> anyhow::Result<QueueId> {
    QueueId::new(name).with_context(|| format!("invalid queue name {name:?}"))
}

/// Checks what the user typed (name, quota, limit, weight) with the protocol's own checks.
pub fn check(cmd: &QueueCommand, now: f64) -> anyhow::Result<Checked> {
    let flag = |name: &'static str| move |e: String| anyhow::anyhow!("--{name} refused: {e}");
    Ok(match cmd {
        QueueCommand::Create {
            name,
            quota,
            borrowing_limit,
            weight,
        } => {
            let spec = QueueSpec {
                name: queue_name(name)?,
                quota_gpus: queues::check_quota("quota_gpus", *quota).map_err(flag("quota"))?,
                borrowing_limit_gpus: borrowing_limit.check().map_err(flag("borrowing-limit"))?,
                weight: *weight,
                created_at: now,
                updated_at: now,
                ..QueueSpec::implicit_default()
            };
            spec.check().map_err(flag("weight"))?;
            Checked::Create(spec)
        }
        QueueCommand::Set {
            name,
            quota,
            borrowing_limit,
            weight,
        } => {
            let name = queue_name(name)?;
            if quota.is_none() && borrowing_limit.is_none() && weight.is_none() {
                bail!(
                    "nothing to change: give --quota GPUS, --borrowing-limit GPUS|unlimited \
                     or --weight W"
                );
            }
            let changes = Changes {
                quota_gpus: quota
                    .map(|q| queues::check_quota("quota_gpus", q))
                    .transpose()
                    .map_err(flag("quota"))?,
                borrowing_limit_gpus: borrowing_limit
                    .map(Limit::check)
                    .transpose()
                    .map_err(flag("borrowing-limit"))?,
                weight: weight
                    .map(|w| queues::check_weight(w).map(|()| w))
                    .transpose()
                    .map_err(flag("weight"))?,
            };
            Checked::Set(name, changes)
        }
        QueueCommand::List => Checked::List,
        QueueCommand::Delete { name, force } => Checked::Delete(queue_name(name)?, *force),
    })
}

/// Jobs naming `queue` that are not finished (not cancelled, no terminal status).
pub fn active_jobs<'a>(
    queue: &QueueId,
    specs: &'a [JobSpec],
    statuses: &[JobStatus],
) -> Vec<&'a JobId> {
    specs
        .iter()
        .filter(|s| s.queue_name() == queue.as_str() && !s.cancelled)
        .filter(|s| {
            statuses
                .iter()
                .find(|st| st.job == s.id)
                .is_none_or(|st| !st.phase.is_terminal())
        })
        .map(|s| &s.id)
        .collect()
}

/// The queues a job may name: the stored ones and `default`.
pub fn known_names(stored: &BTreeMap<String, (QueueSpec, u64)>) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = stored.keys().cloned().collect();
    names.insert(DEFAULT_QUEUE.to_string());
    names
}

/// Why `spec` is refused at submit: its queue does not exist. `None` when it does (the
/// `default` queue always does).
pub fn unknown_queue(spec: &JobSpec, known: &BTreeSet<String>) -> Option<String> {
    let q = spec.queue_name();
    if q == DEFAULT_QUEUE || known.contains(q) {
        return None;
    }
    let list: Vec<&str> = known.iter().map(String::as_str).collect();
    Some(format!(
        "queue \"{q}\" does not exist; existing queues: {} (create it with `converge queue \
         create {q} --quota GPUS`, or leave `queue` out for the default queue)",
        list.join(", ")
    ))
}

fn limit(b: Option<u32>) -> String {
    b.map_or("unlimited".into(), |b| b.to_string())
}

fn weight(w: f64) -> String {
    format!("{w}")
}

/// One row of `converge queue list`: the queue, whether it is the implicit default, and the
/// allocator's last status of it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Row {
    pub name: QueueId,
    /// The `default` queue nobody stored: its built-in values.
    pub implicit: bool,
    pub spec: QueueSpec,
    pub status: Option<QueueStatus>,
}

/// Rows for every stored queue, the implicit default when it is not stored, and a queue
/// the allocator still reports but that is gone (deleted with --force while jobs named it)
/// is left out: its jobs show the reason in `converge jobs`.
pub fn rows(
    specs: &BTreeMap<String, (QueueSpec, u64)>,
    statuses: &BTreeMap<String, (QueueStatus, u64)>,
) -> Vec<Row> {
    rows_of(specs.values().map(|(s, _)| s), |name| {
        statuses.get(name.as_str()).map(|(st, _)| st)
    })
}

/// [`rows`] over any store of specs and statuses (the dashboard keeps them without
/// revisions): `specs` are the stored queues (each keyed by its own name), `status(name)`
/// the allocator's last status of a queue.
pub fn rows_of<'a>(
    specs: impl IntoIterator<Item = &'a QueueSpec>,
    status: impl Fn(&QueueId) -> Option<&'a QueueStatus>,
) -> Vec<Row> {
    let mut out: Vec<Row> = specs
        .into_iter()
        .map(|s| Row {
            name: s.name.clone(),
            implicit: false,
            spec: s.clone(),
            status: status(&s.name).cloned(),
        })
        .collect();
    if !out.iter().any(|r| r.name.as_str() == DEFAULT_QUEUE) {
        let spec = QueueSpec::implicit_default();
        out.push(Row {
            name: spec.name.clone(),
            implicit: true,
            status: status(&spec.name).cloned(),
            spec,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The `converge queue list` table.
pub fn table(rows: &[Row]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY).set_header(vec![
        "QUEUE",
        "QUOTA",
        "BORROW LIMIT",
        "WEIGHT",
        "IN USE",
        "BORROWED",
        "LENT",
        "FAIR SHARE",
        "USAGE (GPU-h, decayed)",
        "RUNNING",
        "PENDING",
    ]);
    for r in rows {
        let name = if r.implicit {
            format!("{} (implicit)", r.name)
        } else {
            r.name.to_string()
        };
        let mut row = vec![
            name,
            r.spec.quota_gpus.to_string(),
            limit(r.spec.borrowing_limit_gpus),
            weight(r.spec.weight),
        ];
        match &r.status {
            Some(s) => row.extend([
                s.gpus_in_use.to_string(),
                s.borrowed_gpus.to_string(),
                s.lent_gpus.to_string(),
                format!("{:.1}", s.fair_share_gpus),
                format!(
                    "{:.2} (half-life {})",
                    s.usage_gpu_seconds / 3600.0,
                    crate::text::age(s.half_life_s)
                ),
                s.running_jobs.to_string(),
                s.pending_jobs.to_string(),
            ]),
            None => row.extend(std::iter::repeat_n("-".to_string(), 7)),
        }
        t.add_row(row);
    }
    t
}

/// Opens the queue buckets (the CLI's user may read both, and write queues only).
pub async fn open(bus: &Bus) -> anyhow::Result<QueueBuckets> {
    Ok(bus.open_queues(Setup::OpenOrCreate).await?)
}

/// Every stored queue, by name.
pub async fn load(
    bus: &Bus,
    buckets: &QueueBuckets,
) -> anyhow::Result<BTreeMap<String, (QueueSpec, u64)>> {
    let rejects = Rejects::default();
    let mut stored = bus
        .load_all::<QueueSpec>(&buckets.queues, &rejects)
        .await
        .context("cannot read the queues (KV converge-queues)")?;
    // A spec stored under a key that is not its name is no queue to the allocator (it
    // ignores it): the CLI must not offer it either, or a job submitted to it would wait
    // forever.
    stored.retain(|key, (spec, _)| {
        let same = spec.name.as_str() == key;
        if !same {
            tracing::warn!(
                key = %key,
                name = %spec.name,
                "ignoring queue entry whose name is not its key"
            );
        }
        same
    });
    Ok(stored)
}

/// Refuses specs whose queue does not exist (reads the queues only when a spec names one
/// other than `default`).
pub async fn check_submitted<'a>(
    bus: &Bus,
    specs: impl IntoIterator<Item = &'a JobSpec>,
) -> anyhow::Result<()> {
    let specs: Vec<&JobSpec> = specs
        .into_iter()
        .filter(|s| s.queue_name() != DEFAULT_QUEUE)
        .collect();
    if specs.is_empty() {
        return Ok(());
    }
    let buckets = open(bus).await?;
    let known = known_names(&load(bus, &buckets).await?);
    for spec in specs {
        if let Some(why) = unknown_queue(spec, &known) {
            bail!("job spec {} refused: {why}", spec.id);
        }
    }
    Ok(())
}

/// Runs `fut`, a write of `key` in the queues bucket: a permissions violation fails it at
/// once instead of after the request's timeout.
async fn write<T>(
    bus: &Bus,
    buckets: &QueueBuckets,
    key: &str,
    what: &str,
    fut: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let subject = format!("{}{key}", buckets.queues.prefix);
    let action = || format!("{what} of KV {}/{key}", buckets.queues.name);
    match bus
        .denials
        .guard(|d| d.subject == subject, fut)
        .await
        .map_err(|denial| BusError::Denied {
            action: action(),
            denial,
        }) {
        Ok(r) => r,
        Err(e) => Err(e.into()),
    }
}

/// Carries out a checked queue command.
pub async fn run(bus: &Bus, cmd: Checked, json: bool, now: f64) -> anyhow::Result<()> {
    let buckets = open(bus).await?;
    match cmd {
        Checked::Create(spec) => {
            let key = spec.name.to_string();
            if key == DEFAULT_QUEUE && bus.get::<QueueSpec>(&buckets.queues, &key).await?.is_none()
            {
                bail!(
                    "the default queue always exists (quota 0, unlimited borrowing, weight 1); \
                     change it with `converge queue set default --quota GPUS …`"
                );
            }
            let bytes = converge_common::codec::encode(&spec);
            let create = async {
                match buckets.queues.create(&key, bytes.into()).await {
                    Ok(_) => Ok(()),
                    Err(e)
                        if e.kind()
                            == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists =>
                    {
                        bail!(
                            "queue {key} already exists; change it with `converge queue set \
                             {key} --quota GPUS` (or --borrowing-limit, --weight)"
                        )
                    }
                    Err(e) => Err(e).context("cannot store the queue"),
                }
            };
            write(bus, &buckets, &key, "a write", create).await?;
            print_spec(&spec, "created", json)?;
        }
        Checked::Set(name, changes) => {
            let key = name.to_string();
            let current = bus.get::<QueueSpec>(&buckets.queues, &key).await?;
            let (old, revision) = match current {
                Some((spec, rev)) => (spec, Some(rev)),
                None if key == DEFAULT_QUEUE => (
                    QueueSpec {
                        created_at: now,
                        ..QueueSpec::implicit_default()
                    },
                    None,
                ),
                None => {
                    let known = known_names(&load(bus, &buckets).await?);
                    bail!(
                        "no queue {key}; existing queues: {} (create it with `converge queue \
                         create {key} --quota GPUS`)",
                        known.into_iter().collect::<Vec<_>>().join(", ")
                    );
                }
            };
            let spec = changes.apply(&old, now);
            spec.check().map_err(|e| anyhow::anyhow!("{e}"))?;
            let bytes = converge_common::codec::encode(&spec);
            let store = async {
                match revision {
                    Some(rev) => buckets
                        .queues
                        .update(&key, bytes.into(), rev)
                        .await
                        .map(|_| ())
                        .with_context(|| {
                            format!("queue {key} changed or was deleted meanwhile; try again")
                        }),
                    None => buckets
                        .queues
                        .create(&key, bytes.into())
                        .await
                        .map(|_| ())
                        .with_context(|| format!("queue {key} was created meanwhile; try again")),
                }
            };
            write(bus, &buckets, &key, "a write", store).await?;
            print_spec(&spec, "updated", json)?;
        }
        Checked::List => {
            let specs = load(bus, &buckets).await?;
            let rejects = Rejects::default();
            let statuses = bus
                .load_all::<QueueStatus>(&buckets.status, &rejects)
                .await
                .context("cannot read the queues' statuses (KV converge-queue-status)")?;
            let rows = rows(&specs, &statuses);
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                println!("{}", crate::text::terminal_safe(&table(&rows).to_string()));
            }
        }
        Checked::Delete(name, force) => {
            let key = name.to_string();
            let Some((_, revision)) = bus.get::<QueueSpec>(&buckets.queues, &key).await? else {
                if key == DEFAULT_QUEUE {
                    bail!(
                        "the default queue has not been changed (it is implicit: quota 0, \
                         unlimited borrowing, weight 1); there is nothing to delete"
                    );
                }
                let known = known_names(&load(bus, &buckets).await?);
                bail!(
                    "no queue {key}; existing queues: {}",
                    known.into_iter().collect::<Vec<_>>().join(", ")
                );
            };
            let (specs, statuses) = crate::load_jobs(bus).await?;
            let active: Vec<String> = active_jobs(&name, &specs, &statuses)
                .into_iter()
                .map(ToString::to_string)
                .collect();
            if !active.is_empty() && !force && key != DEFAULT_QUEUE {
                bail!(
                    "queue {key} has {} active job(s): {}; cancel them (converge cancel ID) or \
                     delete with --force (they then wait, pending, until a queue {key} exists \
                     again)",
                    active.len(),
                    active.join(", ")
                );
            }
            let delete = async {
                buckets
                    .queues
                    .delete_expect_revision(&key, Some(revision))
                    .await
                    .with_context(|| format!("queue {key} changed meanwhile; try again"))
            };
            write(bus, &buckets, &key, "a delete", delete).await?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({ "deleted": key, "active_jobs": active })
                );
            } else if key == DEFAULT_QUEUE {
                println!(
                    "deleted the stored default queue: it is back to quota 0, unlimited \
                     borrowing, weight 1"
                );
            } else if active.is_empty() {
                println!("deleted queue {key}");
            } else {
                println!(
                    "deleted queue {key}; its {} active job(s) wait, pending, until a queue \
                     {key} exists again: {}",
                    active.len(),
                    active.join(", ")
                );
            }
        }
    }
    Ok(())
}

fn print_spec(spec: &QueueSpec, verb: &str, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(spec)?);
    } else {
        println!(
            "{verb} queue {}: quota {} GPUs, borrowing limit {}, weight {}",
            spec.name,
            spec.quota_gpus,
            limit(spec.borrowing_limit_gpus),
            weight(spec.weight)
        );
    }
    Ok(())
}

/// What `converge jobs` knows of the queues its jobs name: which exist and the allocator's
/// last status of each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Context {
    pub known: BTreeSet<String>,
    pub specs: BTreeMap<String, QueueSpec>,
    pub statuses: BTreeMap<String, QueueStatus>,
}

impl Context {
    /// Reads the queues and their statuses.
    pub async fn load(bus: &Bus) -> anyhow::Result<Self> {
        let buckets = open(bus).await?;
        let stored = load(bus, &buckets).await?;
        let rejects = Rejects::default();
        let statuses = bus
            .load_all::<QueueStatus>(&buckets.status, &rejects)
            .await
            .context("cannot read the queues' statuses (KV converge-queue-status)")?;
        Ok(Self {
            known: known_names(&stored),
            specs: stored.into_iter().map(|(k, (s, _))| (k, s)).collect(),
            statuses: statuses.into_iter().map(|(k, (s, _))| (k, s)).collect(),
        })
    }

    /// Whether `spec`'s queue exists.
    pub fn exists(&self, spec: &JobSpec) -> bool {
        let q = spec.queue_name();
        q == DEFAULT_QUEUE || self.known.contains(q)
    }

    /// Why a pending job of a queue other than `default` waits, when the allocator gave no
    /// reason: its queue is missing, or what the queue holds against its fair share and
    /// quota (`waiting for queue team-a: 4 GPUs in use, fair share 4.0, quota 2`).
    pub fn waiting(&self, spec: &JobSpec, status: Option<&JobStatus>) -> Option<String> {
        let q = spec.queue_name();
        if q == DEFAULT_QUEUE
            || status.is_some_and(|s| {
                s.phase != converge_common::JobPhase::Pending
                    || s.message.as_ref().is_some_and(|m| !m.is_empty())
            })
        {
            return None;
        }
        if !self.exists(spec) {
            return Some(format!("queue \"{q}\" does not exist"));
        }
        let quota = self.specs.get(q).map_or(0, |s| s.quota_gpus);
        let st = self.statuses.get(q)?;
        Some(format!(
            "waiting for queue {q}: {} GPUs in use, fair share {:.1}, quota {quota}",
            st.gpus_in_use, st.fair_share_gpus
        ))
    }
}

/// How `converge jobs` shows a job's queue and priority, e.g. `team-a/high`; a queue that
/// does not exist (deleted, or written past the CLI) is marked `(missing)`.
pub fn cell(spec: &JobSpec, ctx: Option<&Context>) -> String {
    let missing = ctx.is_some_and(|c| !c.exists(spec));
    format!(
        "{}{}/{}",
        spec.queue_name(),
        if missing { " (missing)" } else { "" },
        spec.priority
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct T {
        #[command(subcommand)]
        q: QueueCommand,
    }

    fn parse(args: &[&str]) -> Result<QueueCommand, clap::Error> {
        T::try_parse_from(std::iter::once("queue").chain(args.iter().copied())).map(|t| t.q)
    }

    fn checked(args: &[&str]) -> anyhow::Result<Checked> {
        check(&parse(args).expect("parses"), 10.0)
    }

    #[test]
    fn create_checks_quota_limit_and_weight_with_the_reason() {
        let Checked::Create(spec) = checked(&["create", "team-a", "--quota", "8"]).unwrap() else {
            panic!("create")
        };
        assert_eq!(
            (spec.quota_gpus, spec.borrowing_limit_gpus, spec.weight),
            (8, None, 1.0)
        );
        assert_eq!((spec.created_at, spec.updated_at), (10.0, 10.0));
        let Checked::Create(spec) = checked(&[
            "create",
            "team-b",
            "--quota",
            "4",
            "--borrowing-limit",
            "2",
            "--weight",
            "2.5",
        ])
        .unwrap() else {
            panic!("create")
        };
        assert_eq!(spec.max_gpus(), 6);
        assert_eq!(spec.weight, 2.5);

        let err = checked(&["create", "team-a", "--quota", "-1"]).unwrap_err();
        assert!(err.to_string().contains("below zero"), "{err}");
        let err = checked(&["create", "t", "--quota", "1", "--borrowing-limit", "-3"]).unwrap_err();
        assert!(
            err.to_string().contains("borrowing_limit_gpus")
                && err.to_string().contains("below zero"),
            "{err}"
        );
        for w in ["0", "-2", "1001", "nan"] {
            let err = checked(&["create", "t", "--quota", "1", "--weight", w]).unwrap_err();
            assert!(err.to_string().contains("weight"), "{w}: {err}");
        }
        let err = checked(&["create", "team a", "--quota", "1"]).unwrap_err();
        assert!(err.to_string().contains("invalid queue name"), "{err}");
        let err = parse(&["create", "t", "--quota", "1", "--borrowing-limit", "lots"]).unwrap_err();
        assert!(err.to_string().contains("unlimited"), "{err}");
        assert!(parse(&["create", "t"]).is_err(), "--quota is required");
    }

    #[test]
    fn set_changes_only_what_is_given() {
        let Checked::Set(name, changes) = checked(&[
            "set",
            "team-a",
            "--borrowing-limit",
            "unlimited",
            "--weight",
            "3",
        ])
        .unwrap() else {
            panic!("set")
        };
        assert_eq!(name.as_str(), "team-a");
        let old = QueueSpec {
            quota_gpus: 4,
            borrowing_limit_gpus: Some(0),
            created_at: 1.0,
            ..QueueSpec::implicit_default()
        };
        let new = changes.apply(&old, 20.0);
        assert_eq!(
            (new.quota_gpus, new.borrowing_limit_gpus, new.weight),
            (4, None, 3.0)
        );
        assert_eq!((new.created_at, new.updated_at), (1.0, 20.0));
        let err = checked(&["set", "team-a"]).unwrap_err();
        assert!(err.to_string().contains("nothing to change"), "{err}");
        let err = checked(&["set", "team-a", "--quota", "-5"]).unwrap_err();
        assert!(err.to_string().contains("below zero"), "{err}");
    }

    fn job(id: &str, queue: Option<&str>) -> JobSpec {
        let q = queue.map_or(String::new(), |q| format!("queue = \"{q}\"\n"));
        JobSpec::from_toml(&format!("id = \"{id}\"\ncommand = [\"t\"]\n{q}")).unwrap()
    }

    #[test]
    fn unknown_queues_are_refused_listing_the_existing_ones() {
        let stored = BTreeMap::from([(
            "team-a".to_string(),
            (
                QueueSpec {
                    name: "team-a".parse().unwrap(),
                    ..QueueSpec::implicit_default()
                },
                1,
            ),
        )]);
        let known = known_names(&stored);
        assert_eq!(unknown_queue(&job("a", None), &known), None);
        assert_eq!(unknown_queue(&job("a", Some("default")), &known), None);
        assert_eq!(unknown_queue(&job("a", Some("team-a")), &known), None);
        let why = unknown_queue(&job("a", Some("team-z")), &known).unwrap();
        assert!(
            why.contains("queue \"team-z\" does not exist; existing queues: default, team-a"),
            "{why}"
        );
        let mut ctx = Context {
            known,
            ..Context::default()
        };
        assert_eq!(
            cell(&job("a", Some("team-z")), Some(&ctx)),
            "team-z (missing)/normal"
        );
        assert_eq!(cell(&job("a", None), Some(&ctx)), "default/normal");
        assert_eq!(
            ctx.waiting(&job("a", Some("team-z")), None).as_deref(),
            Some("queue \"team-z\" does not exist")
        );
        assert_eq!(ctx.waiting(&job("a", Some("team-a")), None), None);
        ctx.statuses.insert(
            "team-a".into(),
            serde_json::from_value(serde_json::json!({
                "queue": "team-a", "gpus_in_use": 4, "borrowed_gpus": 0, "lent_gpus": 0,
                "fair_share_gpus": 4.0, "usage_gpu_seconds": 0.0, "half_life_s": 3600.0,
                "running_jobs": 2, "pending_jobs": 1, "updated_at": 1.0
            }))
            .unwrap(),
        );
        assert_eq!(
            ctx.waiting(&job("a", Some("team-a")), None).as_deref(),
            Some("waiting for queue team-a: 4 GPUs in use, fair share 4.0, quota 0")
        );
        let mut running = crate::tables::tests::running_status();
        assert_eq!(ctx.waiting(&job("a", Some("team-a")), Some(&running)), None);
        running.phase = converge_common::JobPhase::Pending;
        running.message = Some("preempted by higher-priority jobs of queue team-a".into());
        assert_eq!(ctx.waiting(&job("a", Some("team-a")), Some(&running)), None);
    }

    #[test]
    fn the_example_job_names_a_queue_and_a_priority() {
        let spec = JobSpec::from_toml(include_str!("../../examples/jobs/optdigits-urgent.toml"))
            .expect("the example parses");
        assert_eq!(
            (spec.queue_name(), spec.priority),
            ("vision", converge_common::PriorityClass::High)
        );
    }

    #[test]
    fn active_jobs_are_those_not_finished() {
        let specs = vec![
            job("a", Some("team-a")),
            job("b", Some("team-a")),
            job("c", Some("team-a")),
            job("d", Some("team-b")),
            JobSpec {
                cancelled: true,
                ..job("e", Some("team-a"))
            },
        ];
        let mut done = crate::tables::tests::running_status();
        done.job = "b".parse().unwrap();
        done.phase = converge_common::JobPhase::Completed;
        let mut running = crate::tables::tests::running_status();
        running.job = "c".parse().unwrap();
        let q: QueueId = "team-a".parse().unwrap();
        let ids: Vec<&str> = active_jobs(&q, &specs, &[done, running])
            .into_iter()
            .map(JobId::as_str)
            .collect();
        assert_eq!(ids, ["a", "c"]);
    }

    #[test]
    fn the_list_shows_the_implicit_default_and_the_allocators_figures() {
        let a = QueueSpec {
            name: "team-a".parse().unwrap(),
            quota_gpus: 4,
            borrowing_limit_gpus: Some(2),
            weight: 2.0,
            ..QueueSpec::implicit_default()
        };
        let status = QueueStatus {
            protocol: converge_common::PROTOCOL_VERSION,
            queue: a.name.clone(),
            gpus_in_use: 6,
            borrowed_gpus: 2,
            lent_gpus: 0,
            fair_share_gpus: 5.5,
            usage_gpu_seconds: 7200.0,
            half_life_s: 3600.0,
            running_jobs: 2,
            pending_jobs: 1,
            updated_at: 1.0,
        };
        let specs = BTreeMap::from([("team-a".to_string(), (a, 1))]);
        let statuses = BTreeMap::from([("team-a".to_string(), (status, 3))]);
        let rows = rows(&specs, &statuses);
        assert_eq!(
            rows.iter()
                .map(|r| (r.name.as_str(), r.implicit))
                .collect::<Vec<_>>(),
            [("default", true), ("team-a", false)]
        );
        let text = table(&rows).to_string();
        assert!(text.contains("default (implicit)"), "{text}");
        assert!(text.contains("unlimited"), "{text}");
        assert!(text.contains("2.00 (half-life 1h00m)"), "{text}");
        assert!(text.contains("5.5"), "{text}");
    }
}

//! Workloads for the simulator: reading the Pollux workload format
//! (`name,time,application,num_replicas,batch_size`) and sampling new workloads from the
//! Philly trace the way the Pollux artifact made its eight (its `simulator/workload.py`):
//! jobs of at least 60 s and under 1,000 GPU-hours, submission time of day shifted by a
//! start hour and kept within the window, and an application chosen by GPU time
//! (< 1 GPU-h: cifar10 or ncf; 1–10: deepspeech2, half of them turned into bert; 10–100:
//! yolov3; more: imagenet).
//!
//! One deviation: Pollux draws each job's (replicas, batch size) from configurations its
//! application model rates 50–80 % efficient; we draw uniformly from the configurations the
//! eight published workloads use for that application (`data/pollux/workloads`), which are
//! exactly those picks.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// One job of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadJob {
    pub name: String,
    /// Submission time, seconds from the start of the workload.
    pub time: f64,
    pub application: String,
    /// Replicas (GPUs) the user asked for.
    pub num_replicas: u32,
    /// Total batch size across replicas.
    pub batch_size: u32,
    /// The job's queue (team); `None`: the default queue. Read from an optional `queue`
    /// column, or set by [`assign_queues`].
    pub queue: Option<String>,
    /// Its priority class (default `normal`).
    pub priority: converge_common::PriorityClass,
}

/// Why a workload or trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {reason}")]
    Parse {
        path: String,
        line: usize,
        reason: String,
    },
    #[error("{0}")]
    Invalid(String),
}

fn parse_err(path: &Path, line: usize, reason: impl Into<String>) -> WorkloadError {
    WorkloadError::Parse {
        path: path.display().to_string(),
        line,
        reason: reason.into(),
    }
}

fn read(path: &Path) -> Result<String, WorkloadError> {
    std::fs::read_to_string(path).map_err(|source| WorkloadError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Reads a workload CSV (header `name,time,application,num_replicas,batch_size`), sorted by
/// submission time.
pub fn read_workload(path: &Path) -> Result<Vec<WorkloadJob>, WorkloadError> {
    parse_workload(&read(path)?, path)
}

/// Parses workload CSV text; `path` is only used in error messages.
pub fn parse_workload(text: &str, path: &Path) -> Result<Vec<WorkloadJob>, WorkloadError> {
    let mut lines = text.lines().enumerate();
    let header = lines.next().map(|(_, l)| l.trim()).unwrap_or_default();
    let with_queue = header == "name,time,application,num_replicas,batch_size,queue";
    if header != "name,time,application,num_replicas,batch_size" && !with_queue {
        return Err(parse_err(
            path,
            1,
            format!(
                "expected header name,time,application,num_replicas,batch_size, found {header:?}"
            ),
        ));
    }
    let mut jobs = Vec::new();
    for (i, line) in lines {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        let fields = if with_queue { 6 } else { 5 };
        if f.len() != fields {
            return Err(parse_err(
                path,
                i + 1,
                format!("expected {fields} fields, found {}", f.len()),
            ));
        }
        let num = |s: &str, what: &str| -> Result<f64, WorkloadError> {
            s.trim()
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| {
                    parse_err(
                        path,
                        i + 1,
                        format!("{what} {s:?} is not a non-negative number"),
                    )
                })
        };
        let job = WorkloadJob {
            name: f[0].trim().to_string(),
            time: num(f[1], "time")?,
            application: f[2].trim().to_string(),
            num_replicas: num(f[3], "num_replicas")? as u32,
            batch_size: num(f[4], "batch_size")? as u32,
            queue: f
                .get(5)
                .map(|q| q.trim().to_string())
                .filter(|q| !q.is_empty()),
            priority: converge_common::PriorityClass::Normal,
        };
        if let Some(q) = &job.queue
            && q.parse::<converge_common::QueueId>().is_err()
        {
            return Err(parse_err(
                path,
                i + 1,
                format!("queue {q:?} is not a valid queue name"),
            ));
        }
        if converge_common::ids::validate_id(&job.name).is_err() {
            return Err(parse_err(
                path,
                i + 1,
                format!("job name {:?} is not a valid job id", job.name),
            ));
        }
        if job.num_replicas == 0 || job.batch_size == 0 {
            return Err(parse_err(
                path,
                i + 1,
                "num_replicas and batch_size must be positive",
            ));
        }
        jobs.push(job);
    }
    jobs.sort_by(|a, b| a.time.total_cmp(&b.time).then(a.name.cmp(&b.name)));
    Ok(jobs)
}

/// Writes a workload in the Pollux format, with a sixth column `queue` when a job has one.
pub fn to_csv(jobs: &[WorkloadJob]) -> String {
    let queues = jobs.iter().any(|j| j.queue.is_some());
    let mut out = String::from("name,time,application,num_replicas,batch_size");
    out.push_str(if queues { ",queue\n" } else { "\n" });
    for j in jobs {
        let _ = write!(
            out,
            "{},{},{},{},{}",
            j.name, j.time as u64, j.application, j.num_replicas, j.batch_size
        );
        if queues {
            let _ = write!(out, ",{}", j.queue.as_deref().unwrap_or_default());
        }
        out.push('\n');
    }
    out
}

/// The queue of a Philly job: its virtual cluster, `vc-<hashed id>` (the trace has 15).
pub fn team_of_cluster(cluster: &str) -> Option<String> {
    let id: String = cluster
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(16)
        .collect::<String>()
        .to_ascii_lowercase();
    (!id.is_empty()).then(|| format!("vc-{id}"))
}

/// How the simulator puts a workload's jobs into queues.
#[derive(Debug, Clone, PartialEq)]
pub enum Teams {
    /// As the workload file says (its `queue` column; none: the default queue).
    AsWritten,
    /// `n` teams `team-1` … `team-n` by a seeded hash of the job name (FNV-1a of the seed
    /// and the name, modulo `n`): deterministic, independent of the job's size and time, for
    /// workloads without a user field (the Pollux workloads).
    Hash { teams: u32, seed: u64 },
}

/// Puts every job of `jobs` in a queue as `teams` says.
pub fn assign_queues(jobs: &mut [WorkloadJob], teams: &Teams) {
    let Teams::Hash { teams, seed } = *teams else {
        return;
    };
    let n = teams.max(1);
    for job in jobs {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in seed.to_le_bytes().iter().chain(job.name.as_bytes()) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        job.queue = Some(format!("team-{}", h % u64::from(n) + 1));
    }
}

/// One usable row of the Philly trace.
#[derive(Debug, Clone, PartialEq)]
pub struct PhillyJob {
    /// Seconds since midnight of the submission.
    pub time_of_day: u32,
    pub duration_s: f64,
    pub num_gpus: u32,
    pub gpu_time_s: f64,
    /// Its virtual cluster (the trace's hashed `cluster` field): the team it belongs to.
    pub cluster: String,
}

/// Reads `philly.csv` (`timestamp,duration,num_gpus,gpu_time,cluster`), keeping jobs of at
/// least 60 s and under 1,000 GPU-hours, as Pollux did.
pub fn read_philly(path: &Path) -> Result<Vec<PhillyJob>, WorkloadError> {
    let text = read(path)?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().skip(1) {
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        if f.len() < 4 {
            return Err(parse_err(
                path,
                i + 1,
                "expected timestamp,duration,num_gpus,gpu_time,cluster",
            ));
        }
        // "2017-10-09 07:01:55"
        let clock = f[0].split(' ').nth(1).unwrap_or("");
        let hms: Vec<u32> = clock.split(':').filter_map(|x| x.parse().ok()).collect();
        let (Some(&h), Some(&m), Some(&s)) = (hms.first(), hms.get(1), hms.get(2)) else {
            return Err(parse_err(path, i + 1, format!("bad timestamp {:?}", f[0])));
        };
        let number = |s: &str| s.trim().parse::<f64>().ok().filter(|x| x.is_finite());
        let (Some(duration_s), Some(num_gpus), Some(gpu_time_s)) =
            (number(f[1]), number(f[2]), number(f[3]))
        else {
            return Err(parse_err(
                path,
                i + 1,
                "duration, num_gpus and gpu_time must be numbers",
            ));
        };
        if duration_s >= 60.0 && gpu_time_s < 1000.0 * 3600.0 {
            out.push(PhillyJob {
                time_of_day: h * 3600 + m * 60 + s,
                duration_s,
                num_gpus: num_gpus as u32,
                gpu_time_s,
                cluster: f.get(4).map_or("", |c| c.trim()).to_string(),
            });
        }
    }
    Ok(out)
}

/// The (replicas, batch size) configurations each application uses in the workloads of
/// `dir` (e.g. `data/pollux/workloads`), sorted.
pub fn configurations(dir: &Path) -> Result<BTreeMap<String, Vec<(u32, u32)>>, WorkloadError> {
    let mut configs: BTreeMap<String, Vec<(u32, u32)>> = BTreeMap::new();
    let entries = std::fs::read_dir(dir).map_err(|source| WorkloadError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let mut files: Vec<_> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "csv"))
        .collect();
    files.sort();
    for file in files {
        for job in read_workload(&file)? {
            let list = configs.entry(job.application).or_default();
            if !list.contains(&(job.num_replicas, job.batch_size)) {
                list.push((job.num_replicas, job.batch_size));
            }
        }
    }
    for list in configs.values_mut() {
        list.sort_unstable();
    }
    Ok(configs)
}

/// Samples `num_jobs` jobs submitted within `hours` hours of the trace's time of day
/// shifted by `start_hour`, deterministically for `seed`.
pub fn generate(
    philly: &[PhillyJob],
    configs: &BTreeMap<String, Vec<(u32, u32)>>,
    num_jobs: usize,
    start_hour: u32,
    hours: u32,
    seed: u64,
) -> Result<Vec<WorkloadJob>, WorkloadError> {
    let window: Vec<(u32, &PhillyJob)> = philly
        .iter()
        .filter_map(|j| {
            let t = (j.time_of_day + 24 * 3600 - (start_hour % 24) * 3600) % (24 * 3600);
            (t / 3600 < hours).then_some((t, j))
        })
        .collect();
    if window.len() < num_jobs {
        return Err(WorkloadError::Invalid(format!(
            "only {} trace jobs fall in the {hours}-hour window; asked for {num_jobs}",
            window.len()
        )));
    }
    for app in [
        "cifar10",
        "ncf",
        "deepspeech2",
        "bert",
        "yolov3",
        "imagenet",
    ] {
        if configs.get(app).is_none_or(Vec::is_empty) {
            return Err(WorkloadError::Invalid(format!(
                "no configurations known for {app}"
            )));
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Two more streams so that turning deepspeech2 into bert does not shift other picks.
    let mut bert_rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(3));
    let picked = rand::seq::index::sample(&mut rng, window.len(), num_jobs);
    let mut jobs = Vec::with_capacity(num_jobs);
    for index in picked.iter() {
        let (time, trace_job) = window[index];
        let hours_of_gpu = trace_job.gpu_time_s / 3600.0;
        let mut app = if hours_of_gpu < 1.0 {
            if rng.gen_bool(0.5) { "cifar10" } else { "ncf" }
        } else if hours_of_gpu < 10.0 {
            "deepspeech2"
        } else if hours_of_gpu < 100.0 {
            "yolov3"
        } else {
            "imagenet"
        };
        let mut config = *configs[app].choose(&mut rng).expect("checked non-empty");
        if app == "deepspeech2" && bert_rng.gen_bool(0.5) {
            app = "bert";
            config = *configs[app]
                .choose(&mut bert_rng)
                .expect("checked non-empty");
        }
        jobs.push(WorkloadJob {
            name: String::new(),
            time: f64::from(time),
            application: app.to_string(),
            num_replicas: config.0,
            batch_size: config.1,
            queue: team_of_cluster(&trace_job.cluster),
            priority: converge_common::PriorityClass::Normal,
        });
    }
    jobs.sort_by(|a, b| {
        a.time
            .total_cmp(&b.time)
            .then(a.application.cmp(&b.application))
    });
    for (i, job) in jobs.iter_mut().enumerate() {
        job.name = format!("{}-{i}", job.application);
    }
    Ok(jobs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn data() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/pollux")
    }

    #[test]
    fn reads_the_published_workloads() {
        let jobs = read_workload(&data().join("workloads/workload-1.csv")).unwrap();
        assert_eq!(jobs.len(), 160);
        assert_eq!(jobs[0].name, "cifar10-0");
        assert_eq!(
            (jobs[0].time, jobs[0].num_replicas, jobs[0].batch_size),
            (107.0, 6, 2048)
        );
        assert!(jobs.windows(2).all(|w| w[0].time <= w[1].time));
        assert!(jobs.iter().all(|j| j.time < 8.0 * 3600.0));
        let half = read_workload(&data().join("workloads-0.5/workload-1.csv")).unwrap();
        assert_eq!(half.len(), 80);
    }

    #[test]
    fn bad_rows_are_refused_with_line_numbers() {
        let p = Path::new("w.csv");
        let head = "name,time,application,num_replicas,batch_size\n";
        let e = parse_workload(&format!("{head}a,1,cifar10,0,64\n"), p).unwrap_err();
        assert!(e.to_string().contains("w.csv:2"), "{e}");
        let e = parse_workload(&format!("{head}a.b,1,cifar10,1,64\n"), p).unwrap_err();
        assert!(e.to_string().contains("not a valid job id"), "{e}");
        let e = parse_workload("time,name\n", p).unwrap_err();
        assert!(e.to_string().contains("expected header"), "{e}");
        let e = parse_workload(&format!("{head}a,x,cifar10,1,64\n"), p).unwrap_err();
        assert!(e.to_string().contains("time \"x\""), "{e}");
    }

    #[test]
    fn generated_workloads_look_like_the_published_ones() {
        let philly = read_philly(&data().join("traces/philly.csv")).unwrap();
        assert!(
            philly
                .iter()
                .all(|j| j.duration_s >= 60.0 && j.gpu_time_s < 3.6e6)
        );
        let configs = configurations(&data().join("workloads")).unwrap();
        assert_eq!(configs["ncf"], vec![(1, 32768)]);
        let a = generate(&philly, &configs, 160, 2, 8, 7).unwrap();
        let b = generate(&philly, &configs, 160, 2, 8, 7).unwrap();
        assert_eq!(a, b, "deterministic for a seed");
        let c = generate(&philly, &configs, 160, 2, 8, 8).unwrap();
        assert_ne!(a, c);
        assert_eq!(a.len(), 160);
        assert!(a.iter().all(|j| j.time < 8.0 * 3600.0));
        assert!(
            a.iter()
                .all(|j| configs[&j.application].contains(&(j.num_replicas, j.batch_size)))
        );
        // The application mix of the published 1.0x workloads: mostly short jobs.
        let mut count: BTreeMap<&str, usize> = BTreeMap::new();
        for j in &a {
            *count.entry(j.application.as_str()).or_default() += 1;
        }
        let short = count.get("cifar10").unwrap_or(&0) + count.get("ncf").unwrap_or(&0);
        assert!(short > 100, "{count:?}");
        assert!(count.get("imagenet").unwrap_or(&0) < &10, "{count:?}");
        // Round trip through the CSV format.
        let text = to_csv(&a);
        assert_eq!(parse_workload(&text, Path::new("x")).unwrap(), a);
    }
}

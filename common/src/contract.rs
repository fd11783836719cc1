//! The worker contract (docs/protocol.md, "Worker contract"): the environment variables the
//! agent gives every training process, defined once, here, in [`VARIABLES`].
//!
//! Every other side is checked against this table by a test: the names a job spec's `env`
//! may not set ([`crate::jobspec::RESERVED_ENV`], derived from it), what the agent sets
//! (`worker_env` in agent/src/supervisor.rs), what converge-trainer reads
//! (trainer/src/cli.rs), the Python kit's `AGENT_VARIABLES` and `BATCH_VARIABLES`
//! (python/converge_worker/contract.py, which reads [`JSON_FILE`], generated from this
//! table by [`to_json`]) and the "Worker contract" section of docs/protocol.md.
//!
//! After a change to the table, regenerate the JSON file with
//! `CONVERGE_UPDATE_CONTRACT=1 cargo test -p converge-common contract` (the test fails
//! while the checked-in file differs).
//!
//! Like [`crate::codec`], this module sits at the bottom of the crate: it imports no other
//! module.

use serde::Serialize;

/// The worker-contract variable giving a fake GPU's relative speed, in (0, 1], set by
/// agents started with `--fake-gpus` and `--fake-gpu-speed` only (unset on real GPUs):
/// converge-trainer stretches each step's compute time by its inverse, so that a local
/// cluster can mix fast and slow GPU types.
pub const GPU_SPEED_ENV: &str = "CONVERGE_GPU_SPEED";

/// The worker-contract variables of a shadow job's `[shadow]` table (docs/protocol.md,
/// "Worker contract"), set by the agent only for the parameters the spec gives (the others
/// are unset, so the program's defaults apply) and for `arch = "shadow"` jobs only:
/// `CONVERGE_SHADOW_ALGORITHM` (`ma`, `bmuf`, `easgd`), `CONVERGE_SHADOW_BLOCK_MOMENTUM`,
/// `CONVERGE_SHADOW_BLOCK_LR`, `CONVERGE_SHADOW_BLOCK_NESTEROV` (`true`),
/// `CONVERGE_SHADOW_ELASTIC_ALPHA`, `CONVERGE_SHADOW_HOGWILD_THREADS`. converge-trainer reads
/// them as the defaults of `--shadow`, `--block-momentum`, `--block-lr`,
/// `--block-nesterov`, `--elastic-alpha` and `--hogwild-threads`.
pub const SHADOW_ENV: [&str; 6] = [
    "CONVERGE_SHADOW_ALGORITHM",
    "CONVERGE_SHADOW_BLOCK_MOMENTUM",
    "CONVERGE_SHADOW_BLOCK_LR",
    "CONVERGE_SHADOW_BLOCK_NESTEROV",
    "CONVERGE_SHADOW_ELASTIC_ALPHA",
    "CONVERGE_SHADOW_HOGWILD_THREADS",
];

/// The batch variables of the worker contract, set for jobs with a `[batch]` table only
/// (removed for others), in this order: micro-batch per worker, accumulation steps, total,
/// reference.
pub const BATCH_ENV: [&str; 4] = [
    "CONVERGE_BATCH_SIZE",
    "CONVERGE_ACCUM_STEPS",
    "CONVERGE_TOTAL_BATCH",
    "CONVERGE_REFERENCE_BATCH",
];

/// Where the table is checked in as JSON for the Python kit, from the repository root.
pub const JSON_FILE: &str = "python/converge_worker/contract_variables.json";

/// Which workers the agent gives a variable. A conditional variable is removed from the
/// worker's inherited environment when it does not apply, so a worker never sees a stale
/// value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum When {
    /// Every worker of every job.
    Always,
    /// Every worker, with the agent's default value unless the job spec's `env` sets the
    /// variable itself: the one contract variable a spec may set (not reserved).
    SpecDefault,
    /// Workers of agents with fake GPUs started with `--fake-gpu-speed` only.
    FakeGpuSpeed,
    /// Workers of jobs with a `[batch]` table (adaptive batch size) only.
    Batch,
    /// Workers of shadow jobs (`arch = "shadow"`) only.
    Shadow,
    /// Workers of shadow jobs whose `[shadow]` table gives this parameter only.
    ShadowParameter,
}

impl When {
    /// Whether a job spec's `env` may not set the variable (it is the agent's).
    pub const fn reserved(self) -> bool {
        !matches!(self, When::SpecDefault)
    }

    /// Whether the agent sets the variable on every worker (whatever its value).
    pub const fn every_worker(self) -> bool {
        matches!(self, When::Always | When::SpecDefault)
    }
}

/// One variable of the worker contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variable {
    /// The environment variable's name.
    pub name: &'static str,
    /// Which workers get it.
    pub when: When,
    /// Whether a program may treat its absence under an agent (`CONVERGE_JOB_ID` set) as
    /// an error: the variables every agent of protocol v1 sets (the Python kit's
    /// `AGENT_VARIABLES`). The other always-set ones came later (older agents leave them
    /// unset, so programs take them as optional) or are a setting, not information.
    pub required: bool,
    /// What it holds, with its units, in one line.
    pub meaning: &'static str,
}

const fn var(name: &'static str, when: When, required: bool, meaning: &'static str) -> Variable {
    Variable {
        name,
        when,
        required,
        meaning,
    }
}

/// The worker contract: every variable the agent sets on (or removes from) a worker's
/// environment. The order is the documented one (torchrun's, then Converge's).
pub const VARIABLES: [Variable; 28] = [
    var(
        "RANK",
        When::Always,
        true,
        "this process's rank in the generation, 0 to WORLD_SIZE - 1 (workers first, then parameter-server shards)",
    ),
    var(
        "WORLD_SIZE",
        When::Always,
        true,
        "processes in the generation: the workers plus CONVERGE_NUM_PS parameter-server shards",
    ),
    var(
        "LOCAL_RANK",
        When::Always,
        true,
        "this process's index among the job's processes on this host, 0 to LOCAL_WORLD_SIZE - 1",
    ),
    var(
        "LOCAL_WORLD_SIZE",
        When::Always,
        true,
        "the job's processes on this host",
    ),
    var(
        "GROUP_RANK",
        When::Always,
        false,
        "torchrun's node rank: this host's index among the job's hosts by lowest rank (0 on rank 0's host; RANK - LOCAL_RANK with plans from older allocators)",
    ),
    var(
        "ROLE_RANK",
        When::Always,
        false,
        "torchrun's role rank: equal to RANK (every process has the one role)",
    ),
    var(
        "MASTER_ADDR",
        When::Always,
        true,
        "address of rank 0's host, where rank 0 serves the rendezvous",
    ),
    var(
        "MASTER_PORT",
        When::Always,
        true,
        "TCP port of rank 0's rendezvous, 20000 to 29999, fresh for every generation",
    ),
    var(
        "TORCHELASTIC_RUN_ID",
        When::Always,
        false,
        "torchrun's run id: the job id (= CONVERGE_JOB_ID)",
    ),
    var(
        "TORCHELASTIC_RESTART_COUNT",
        When::Always,
        false,
        "torchrun's restart count: the generation (= CONVERGE_GENERATION)",
    ),
    var(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        When::SpecDefault,
        false,
        "1 (NCCL errors abort the worker instead of hanging it) unless the spec's env sets another value",
    ),
    var(
        "CUDA_VISIBLE_DEVICES",
        When::Always,
        true,
        "comma-separated indices of the host's GPUs given to this process; empty for parameter-server shards",
    ),
    var("CONVERGE_JOB_ID", When::Always, true, "the job's id"),
    var(
        "CONVERGE_GENERATION",
        When::Always,
        true,
        "the allocation's generation, a count bumped on every allocation change (fences older checkpoints)",
    ),
    var(
        "CONVERGE_CHECKPOINT_DIR",
        When::Always,
        true,
        "the job's checkpoint directory, <agent --checkpoint-root>/<job>, on storage shared across hosts",
    ),
    var(
        "CONVERGE_NUM_PS",
        When::Always,
        true,
        "parameter-server shards among the WORLD_SIZE processes (the last ranks); 0 for ring jobs",
    ),
    var(
        "CONVERGE_SYNC",
        When::Always,
        false,
        "the spec's sync architecture: ring, ps or shadow",
    ),
    var(
        GPU_SPEED_ENV,
        When::FakeGpuSpeed,
        false,
        "the fake GPUs' speed as a fraction of the machine's, in (0, 1]; converge-trainer stretches each step's accelerator time by its inverse",
    ),
    var(
        BATCH_ENV[0],
        When::Batch,
        false,
        "samples per worker per forward/backward pass (the micro-batch)",
    ),
    var(
        BATCH_ENV[1],
        When::Batch,
        false,
        "extra micro-batches each worker accumulates per optimizer step (0 = none)",
    ),
    var(
        BATCH_ENV[2],
        When::Batch,
        false,
        "samples per optimizer step over all workers: workers x CONVERGE_BATCH_SIZE x (CONVERGE_ACCUM_STEPS + 1)",
    ),
    var(
        BATCH_ENV[3],
        When::Batch,
        false,
        "samples per optimizer step the job's learning rate was tuned for (the spec's [batch] reference)",
    ),
    var(
        SHADOW_ENV[0],
        When::Shadow,
        false,
        "the ShadowSync algorithm of the [shadow] table: ma, bmuf or easgd",
    ),
    var(
        SHADOW_ENV[1],
        When::ShadowParameter,
        false,
        "S-BMUF block momentum eta, a fraction in [0, 1)",
    ),
    var(
        SHADOW_ENV[2],
        When::ShadowParameter,
        false,
        "S-BMUF block learning rate zeta, a factor above 0",
    ),
    var(
        SHADOW_ENV[3],
        When::ShadowParameter,
        false,
        "S-BMUF Nesterov block momentum: true when the table asks for it",
    ),
    var(
        SHADOW_ENV[4],
        When::ShadowParameter,
        false,
        "S-EASGD moving rate alpha, a fraction in (0, 1]",
    ),
    var(
        SHADOW_ENV[5],
        When::ShadowParameter,
        false,
        "training threads per worker updating its model lock-free (Hogwild), 1 to 64",
    ),
];

/// The variable called `name`, if the contract has one.
pub fn get(name: &str) -> Option<&'static Variable> {
    VARIABLES.iter().find(|v| v.name == name)
}

/// Whether `name` is a contract variable that a job spec's `env` may not set.
pub fn is_reserved(name: &str) -> bool {
    get(name).is_some_and(|v| v.when.reserved())
}

/// The names of the variables [`When`] says, in the table's order.
pub fn names(when: When) -> impl Iterator<Item = &'static str> {
    VARIABLES
        .iter()
        .filter(move |v| v.when == when)
        .map(|v| v.name)
}

/// How many of the variables are reserved.
pub const RESERVED_COUNT: usize = {
    let mut n = 0;
    let mut i = 0;
    while i < VARIABLES.len() {
        if VARIABLES[i].when.reserved() {
            n += 1;
        }
        i += 1;
    }
    n
};

/// The reserved variables' names ([`When::reserved`]), in the table's order.
pub const RESERVED: [&str; RESERVED_COUNT] = {
    let mut out = [""; RESERVED_COUNT];
    let (mut i, mut j) = (0, 0);
    while i < VARIABLES.len() {
        if VARIABLES[i].when.reserved() {
            out[j] = VARIABLES[i].name;
            j += 1;
        }
        i += 1;
    }
    out
};

/// One variable as [`JSON_FILE`] holds it: the table's fields and `reserved`.
#[derive(Serialize)]
struct JsonVariable {
    name: &'static str,
    when: When,
    required: bool,
    reserved: bool,
    meaning: &'static str,
}

#[derive(Serialize)]
struct JsonTable {
    #[serde(rename = "_comment")]
    comment: &'static str,
    variables: Vec<JsonVariable>,
}

/// The table as the contents of [`JSON_FILE`]: pretty-printed, ending in a newline.
pub fn to_json() -> String {
    let table = JsonTable {
        comment: "Generated from common/src/contract.rs (the worker contract's one definition); do not edit. Regenerate: CONVERGE_UPDATE_CONTRACT=1 cargo test -p converge-common contract",
        variables: VARIABLES
            .iter()
            .map(|v| JsonVariable {
                name: v.name,
                when: v.when,
                required: v.required,
                reserved: v.when.reserved(),
                meaning: v.meaning,
            })
            .collect(),
    };
    let mut text = serde_json::to_string_pretty(&table).expect("the table serializes");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::path::PathBuf;

    fn repo_file(path: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(path)
    }

    #[test]
    fn the_table_is_well_formed() {
        let mut seen = BTreeSet::new();
        for v in VARIABLES {
            assert!(seen.insert(v.name), "{} is listed twice", v.name);
            let valid = !v.name.is_empty()
                && !v.name.starts_with(|c: char| c.is_ascii_digit())
                && v.name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            assert!(valid, "{:?} is not an environment variable name", v.name);
            assert!(
                !v.meaning.is_empty() && !v.meaning.contains('\n') && v.meaning.is_ascii(),
                "{}: the meaning is one line of ASCII",
                v.name
            );
            assert!(
                !v.required || v.when == When::Always,
                "{}: only variables every worker gets can be required",
                v.name
            );
        }
        assert_eq!(names(When::Batch).collect::<Vec<_>>(), BATCH_ENV);
        let shadow: Vec<_> = VARIABLES
            .iter()
            .filter(|v| matches!(v.when, When::Shadow | When::ShadowParameter))
            .map(|v| v.name)
            .collect();
        assert_eq!(shadow, SHADOW_ENV);
        assert_eq!(names(When::Shadow).collect::<Vec<_>>(), [SHADOW_ENV[0]]);
        assert_eq!(
            names(When::FakeGpuSpeed).collect::<Vec<_>>(),
            [GPU_SPEED_ENV]
        );
    }

    #[test]
    fn reserved_names_are_the_agents() {
        let expect: Vec<_> = VARIABLES
            .iter()
            .filter(|v| v.when != When::SpecDefault)
            .map(|v| v.name)
            .collect();
        assert_eq!(RESERVED, expect[..]);
        assert!(is_reserved("RANK") && is_reserved("CONVERGE_SHADOW_BLOCK_LR"));
        assert!(!is_reserved("TORCH_NCCL_ASYNC_ERROR_HANDLING"));
        assert!(!is_reserved("CONVERGE_DATA_DIR") && !is_reserved("rank"));
        assert_eq!(get("CONVERGE_NUM_PS").map(|v| v.when), Some(When::Always));
    }

    /// The checked-in JSON the Python kit reads is the table. Set
    /// `CONVERGE_UPDATE_CONTRACT=1` to rewrite it.
    #[test]
    fn the_python_kits_json_file_is_the_table() {
        let path = repo_file(JSON_FILE);
        let want = to_json();
        if std::env::var_os("CONVERGE_UPDATE_CONTRACT").is_some_and(|v| !v.is_empty()) {
            std::fs::write(&path, &want).unwrap();
            return;
        }
        let got = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            got == want,
            "{JSON_FILE} differs from the worker contract's table (common/src/contract.rs); \
             regenerate it with: CONVERGE_UPDATE_CONTRACT=1 cargo test -p converge-common contract"
        );
        let parsed: serde_json::Value = serde_json::from_str(&got).unwrap();
        assert_eq!(
            parsed["variables"].as_array().unwrap().len(),
            VARIABLES.len()
        );
    }

    /// Backtick-quoted words in docs/protocol.md's "Worker contract" section that look like
    /// variable names but are not the contract's.
    const DOCUMENTED_OTHERS: [&str; 6] = [
        "CONVERGE_UPDATE_CONTRACT", // regenerates the JSON file
        "CONVERGE_PROGRESS",        // the progress lines' prefix
        "REPORTS_PER_S",            // the agent's rate limits on progress reports
        "REPORT_BURST",
        "JOB_REPORTS_PER_S",
        "JOB_REPORT_BURST",
    ];

    #[test]
    fn the_protocol_documents_every_variable_and_no_other() {
        let text = std::fs::read_to_string(repo_file("docs/protocol.md")).unwrap();
        let start = text
            .find("\n## Worker contract")
            .expect("docs/protocol.md has a Worker contract section");
        let section = &text[start + 1..];
        let section = &section[..section.find("\n## ").unwrap_or(section.len())];
        assert!(
            section.contains("common/src/contract.rs"),
            "the section names where the contract is defined"
        );
        // Code spans: `NAME`, `NAME=value`.
        let quoted: BTreeSet<&str> = section
            .split('`')
            .skip(1)
            .step_by(2)
            .map(|span| span.split('=').next().unwrap_or(span))
            .filter(|w| {
                (w.contains('_') || get(w).is_some())
                    && w.chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            })
            .collect();
        for v in VARIABLES {
            assert!(
                quoted.contains(v.name),
                "docs/protocol.md's Worker contract section does not mention `{}`",
                v.name
            );
        }
        for w in quoted {
            assert!(
                get(w).is_some() || DOCUMENTED_OTHERS.contains(&w),
                "docs/protocol.md's Worker contract section names `{w}`, which is not in \
                 common/src/contract.rs"
            );
        }
    }
}

//! Node labels and job selectors (docs/protocol.md "Node labels and selectors").
//!
//! An agent reports its host's labels in [`crate::HostTelemetry::labels`]: the GPU labels
//! it measures ([`GPU_MODEL`], [`GPU_MEMORY`], [`GPU_COUNT`]) and custom ones from its
//! configuration. A job spec's `[selector]` table ([`crate::JobSpec::selector`]) names the
//! labels a host must have, each with exactly that value, for the job's workers to go there.
//!
//! Keys and values follow Kubernetes' label syntax: a key is a name of at most 63
//! characters (`[A-Za-z0-9]`, then `-`, `_`, `.` or alphanumerics, ending alphanumeric),
//! optionally after a DNS-subdomain prefix and `/` (`example.com/rack`, prefix at most 253
//! characters, lowercase); a value is empty or a name of at most 63 characters. A map holds
//! at most [`MAX_LABELS`] pairs.

use std::collections::BTreeMap;

/// Most labels a host may report, and most pairs a selector may name.
pub const MAX_LABELS: usize = 64;
/// Longest name part of a key, and longest value.
pub const MAX_NAME_LEN: usize = 63;
/// Longest prefix of a key (before `/`).
pub const MAX_PREFIX_LEN: usize = 253;
/// Keys starting with this are set by the agent from its GPUs: a custom label may not
/// use them.
pub const RESERVED_PREFIX: &str = "gpu.";
/// The GPU model as the GPU source names it (NVML's device name, e.g.
/// `NVIDIA-H100-80GB-HBM3`), characters a label value cannot hold replaced by `-`.
pub const GPU_MODEL: &str = "gpu.model";
/// Memory of the host's first GPU, whole GiB (rounded), e.g. `80`.
pub const GPU_MEMORY: &str = "gpu.memory";
/// GPUs on the host, e.g. `8`.
pub const GPU_COUNT: &str = "gpu.count";
/// The GPU type (generation) of the host's GPUs, [`gpu_type`] of the model name (`h100`,
/// `a100`, `t4`, `rtx2080ti`), or the type a fake GPU source was given. Jobs restrict the
/// types they run on with `gpu_types` ([`crate::JobSpec::gpu_types`]).
pub const GPU_TYPE: &str = "gpu.type";
/// The nominal speed of the host's GPUs relative to other types (a positive number, e.g.
/// `0.25`), where the GPU source knows it: a fake GPU source reports its configured speed
/// (`--fake-gpu-speed`). The allocator uses the ratio of two types' nominal speeds to
/// project a job's speed onto a type until some job has run on both (sched's
/// `gpu_types`). NVML hosts do not report it.
pub const GPU_SPEED: &str = "gpu.speed";

/// A name: 1..=63 characters, alphanumeric at both ends, `-`, `_`, `.` inside.
fn valid_name(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_NAME_LEN
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A DNS subdomain: 1..=253 characters, dot-separated lowercase labels of alphanumerics
/// and `-`, each alphanumeric at both ends.
fn valid_prefix(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_PREFIX_LEN
        && s.split('.').all(|part| {
            let b = part.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        })
}

/// Checks a label key (see the module docs).
pub fn validate_key(key: &str) -> Result<(), String> {
    let ok = match key.split_once('/') {
        Some((prefix, name)) => valid_prefix(prefix) && valid_name(name),
        None => valid_name(key),
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "label key {key:?} is not valid: a name of at most {MAX_NAME_LEN} characters \
             (letters, digits, '-', '_', '.'; a letter or digit at both ends), optionally \
             after a lowercase DNS prefix and '/' (e.g. example.com/rack)"
        ))
    }
}

/// Checks a label value (see the module docs).
pub fn validate_value(key: &str, value: &str) -> Result<(), String> {
    if value.is_empty() || valid_name(value) {
        Ok(())
    } else {
        Err(format!(
            "label {key}: value {value:?} is not valid: at most {MAX_NAME_LEN} characters \
             (letters, digits, '-', '_', '.'; a letter or digit at both ends), or empty"
        ))
    }
}

/// Checks every pair of a label map or selector and its size.
pub fn validate(labels: &BTreeMap<String, String>) -> Result<(), String> {
    if labels.len() > MAX_LABELS {
        return Err(format!(
            "{} labels, at most {MAX_LABELS} allowed",
            labels.len()
        ));
    }
    for (k, v) in labels {
        validate_key(k)?;
        validate_value(k, v)?;
    }
    Ok(())
}

/// Parses one `key=value` pair (an agent's `--label`), checked.
pub fn parse_pair(text: &str) -> Result<(String, String), String> {
    let Some((key, value)) = text.split_once('=') else {
        return Err(format!("label {text:?} is not of the form key=value"));
    };
    let (key, value) = (key.trim(), value.trim());
    validate_key(key)?;
    validate_value(key, value)?;
    Ok((key.to_string(), value.to_string()))
}

/// Whether `labels` has every pair of `selector` with exactly its value (an empty selector
/// matches every host).
pub fn matches(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    selector
        .iter()
        .all(|(k, v)| labels.get(k).is_some_and(|have| have == v))
}

/// `k=v,k2=v2`, keys in order; `-` for an empty map.
pub fn format(labels: &BTreeMap<String, String>) -> String {
    if labels.is_empty() {
        return "-".into();
    }
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// A free-form name (e.g. a GPU model, `NVIDIA H100 80GB HBM3`) as a label value: every
/// character a value cannot hold becomes `-`, runs of `-` collapse, the ends are trimmed to
/// alphanumerics and the result to 63 characters (`NVIDIA-H100-80GB-HBM3`).
pub fn sanitize_value(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        let c = if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
            c
        } else {
            '-'
        };
        if !(c == '-' && out.ends_with('-')) {
            out.push(c);
        }
    }
    let mut out: String = out
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .chars()
        .take(MAX_NAME_LEN)
        .collect();
    while out.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
        out.pop();
    }
    out
}

/// Words of a GPU model name that say nothing about its generation: vendor and product
/// lines (`NVIDIA`, `Tesla`, `GeForce`, `Quadro`), memory (`40GB`), form factor and memory
/// technology (`SXM4`, `PCIe`, `HBM3`, `NVL`). Compared in lowercase.
fn uninformative(word: &str) -> bool {
    const WORDS: [&str; 6] = ["nvidia", "tesla", "geforce", "quadro", "pcie", "nvl"];
    let prefixed = |prefix: &str| {
        word.strip_prefix(prefix)
            .is_some_and(|rest| rest.chars().all(|c| c.is_ascii_digit() || c == 'e'))
    };
    WORDS.contains(&word)
        || prefixed("sxm")
        || prefixed("hbm")
        || word
            .strip_suffix("gb")
            .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
}

/// The GPU type of a model name as NVML reports it: lowercase, the vendor, product line,
/// memory size and form-factor words dropped (`uninformative`), the rest joined without
/// separators. `NVIDIA H100 80GB HBM3` → `h100`, `NVIDIA A100-SXM4-40GB` → `a100`,
/// `Tesla T4` → `t4`, `NVIDIA GeForce RTX 2080 Ti` → `rtx2080ti`, `NVIDIA RTX A6000` →
/// `rtxa6000`. A model name with nothing else left keeps its own words (so an unknown
/// model still gets a type of its own, never none); an empty one is `unknown`. Always a
/// valid label value of at most 63 characters.
pub fn gpu_type(model: &str) -> String {
    let lower = model.to_ascii_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    let kept: String = words
        .iter()
        .filter(|w| !uninformative(w))
        .copied()
        .collect();
    let name = if kept.is_empty() {
        words.join("-")
    } else {
        kept
    };
    let name = sanitize_value(&name);
    if name.is_empty() {
        "unknown".into()
    } else {
        name
    }
}

/// A host's GPU type: its `gpu.type` label, or for an agent older than that label
/// [`gpu_type`] of its `gpu.model`; `None` for a host without GPUs.
pub fn host_gpu_type(labels: &BTreeMap<String, String>) -> Option<String> {
    labels
        .get(GPU_TYPE)
        .cloned()
        .or_else(|| labels.get(GPU_MODEL).map(|m| gpu_type(m)))
}

/// A host's nominal GPU speed: its `gpu.speed` label when that is a finite positive number.
pub fn host_gpu_speed(labels: &BTreeMap<String, String>) -> Option<f64> {
    labels
        .get(GPU_SPEED)
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
}

/// GPUs per type ([`host_gpu_type`]; `-` for a host with GPUs but no type) over `hosts`.
pub fn gpus_by_type<'a>(
    hosts: impl IntoIterator<Item = &'a crate::HostTelemetry>,
) -> BTreeMap<String, usize> {
    let mut per_type = BTreeMap::new();
    for h in hosts.into_iter().filter(|h| !h.gpus.is_empty()) {
        let kind = host_gpu_type(&h.labels).unwrap_or_else(|| "-".into());
        *per_type.entry(kind).or_default() += h.gpus.len();
    }
    per_type
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_types_from_nvml_model_names() {
        for (model, want) in [
            ("NVIDIA H100 80GB HBM3", "h100"),
            ("NVIDIA H100 PCIe", "h100"),
            ("NVIDIA H100 NVL", "h100"),
            ("NVIDIA H200", "h200"),
            ("NVIDIA A100-SXM4-40GB", "a100"),
            ("NVIDIA A100-SXM4-80GB", "a100"),
            ("NVIDIA A100 80GB PCIe", "a100"),
            ("Tesla V100-SXM2-16GB", "v100"),
            ("Tesla V100-PCIE-32GB", "v100"),
            ("Tesla T4", "t4"),
            ("NVIDIA GeForce RTX 2080 Ti", "rtx2080ti"),
            ("NVIDIA GeForce RTX 3090", "rtx3090"),
            ("NVIDIA RTX A6000", "rtxa6000"),
            ("NVIDIA A10G", "a10g"),
            ("NVIDIA L4", "l4"),
            ("NVIDIA L40S", "l40s"),
            ("Tesla P100-PCIE-16GB", "p100"),
            ("Quadro RTX 8000", "rtx8000"),
            ("NVIDIA H100 80GB HBM3e", "h100"),
        ] {
            assert_eq!(gpu_type(model), want, "{model}");
        }
    }

    #[test]
    fn a_hosts_type_is_its_label_or_else_from_its_model() {
        assert_eq!(
            host_gpu_type(&map(&[(GPU_TYPE, "t4"), (GPU_MODEL, "x")])).as_deref(),
            Some("t4")
        );
        assert_eq!(
            host_gpu_type(&map(&[(GPU_MODEL, "NVIDIA-A100-SXM4-40GB")])).as_deref(),
            Some("a100")
        );
        assert_eq!(host_gpu_type(&map(&[(GPU_COUNT, "0")])), None);
    }

    #[test]
    fn an_unknown_or_odd_model_still_gets_a_valid_type() {
        assert_eq!(gpu_type("NVIDIA"), "nvidia");
        assert_eq!(gpu_type("NVIDIA Tesla"), "nvidia-tesla");
        assert_eq!(gpu_type(""), "unknown");
        assert_eq!(gpu_type("  ---  "), "unknown");
        assert_eq!(gpu_type("Ünïcode GPU 9000"), "ncodegpu9000");
        let long = gpu_type(&"x".repeat(200));
        assert_eq!(long.len(), MAX_NAME_LEN);
        for model in ["NVIDIA", "", "Ünïcode GPU 9000", &"y".repeat(200), "H100"] {
            let t = gpu_type(model);
            assert!(
                validate_value(GPU_TYPE, &t).is_ok() && !t.is_empty(),
                "{model}: {t}"
            );
        }
    }

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn keys_and_values_follow_kubernetes_syntax() {
        for key in [
            "zone",
            "gpu.model",
            "a",
            "rack_1",
            "example.com/rack",
            "a-b.c/x.y",
        ] {
            assert!(validate_key(key).is_ok(), "{key}");
        }
        let long = "x".repeat(64);
        let long_prefix = format!("{}/x", "a".repeat(254));
        for key in [
            "",
            "-zone",
            "zone-",
            "has space",
            "a=b",
            "Example.com/rack",
            "/rack",
            "example.com/",
            "a/b/c",
            "zoné",
            long.as_str(),
            long_prefix.as_str(),
        ] {
            assert!(validate_key(key).is_err(), "{key:?}");
        }
        for value in ["", "a", "NVIDIA-H100-80GB-HBM3", "16", "v1.2_3"] {
            assert!(validate_value("k", value).is_ok(), "{value}");
        }
        for value in ["-a", "a b", "a/b", "x,y", long.as_str()] {
            assert!(validate_value("k", value).is_err(), "{value:?}");
        }
    }

    #[test]
    fn maps_are_bounded_and_pairs_parse() {
        let many: BTreeMap<String, String> = (0..=MAX_LABELS)
            .map(|i| (format!("k{i}"), "v".into()))
            .collect();
        assert!(validate(&many).unwrap_err().contains("at most 64"));
        assert!(validate(&map(&[("zone", "a"), ("gpu.count", "8")])).is_ok());
        assert!(validate(&map(&[("zone", "a b")])).is_err());
        assert_eq!(parse_pair("zone=a").unwrap(), ("zone".into(), "a".into()));
        assert_eq!(parse_pair("tier=").unwrap(), ("tier".into(), String::new()));
        assert!(parse_pair("zone").unwrap_err().contains("key=value"));
        assert!(parse_pair("=a").is_err());
        assert!(parse_pair("zone=a=b").is_err());
    }

    #[test]
    fn a_selector_matches_exact_pairs_only() {
        let host = map(&[("zone", "a"), ("gpu.count", "8")]);
        assert!(matches(&map(&[]), &host));
        assert!(matches(&map(&[("zone", "a")]), &host));
        assert!(matches(&map(&[("zone", "a"), ("gpu.count", "8")]), &host));
        assert!(!matches(&map(&[("zone", "b")]), &host));
        assert!(!matches(&map(&[("rack", "1")]), &host));
        assert!(!matches(&map(&[("zone", "")]), &map(&[])));
        assert_eq!(format(&map(&[("b", "2"), ("a", "1")])), "a=1,b=2");
        assert_eq!(format(&map(&[])), "-");
    }

    #[test]
    fn gpu_names_become_values() {
        assert_eq!(
            sanitize_value("NVIDIA H100 80GB HBM3"),
            "NVIDIA-H100-80GB-HBM3"
        );
        assert_eq!(sanitize_value("Converge fake GPU"), "Converge-fake-GPU");
        assert_eq!(sanitize_value("  (weird)  name!! "), "weird-name");
        assert_eq!(sanitize_value("???"), "");
        let long = sanitize_value(&format!("{}-{}", "a".repeat(62), "b".repeat(10)));
        assert!(validate_value("k", &long).is_ok(), "{long}");
        assert_eq!(long, "a".repeat(62));
    }
}

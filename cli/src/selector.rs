//! `converge submit`'s check of a job's `[selector]` against the labels the known hosts
//! report (KV `converge-hosts`): a spec no host could ever run is refused with the reason
//! and the labels the hosts do have, instead of waiting forever.

use std::collections::BTreeMap;

use converge_common::labels::{format, matches};
use converge_common::{HostTelemetry, JobSpec};

/// Label sets listed in a refusal, at most.
const MAX_LISTED: usize = 10;

/// Why no known host can run `spec` (its selector matches none of `hosts`); `None` when
/// one can, or when the spec has no selector.
pub fn refusal(spec: &JobSpec, hosts: &[HostTelemetry]) -> Option<String> {
    if spec.selector.is_empty() || hosts.iter().any(|h| matches(&spec.selector, &h.labels)) {
        return None;
    }
    let wanted = format(&spec.selector);
    if hosts.is_empty() {
        return Some(format!(
            "`[selector]` {wanted} matches no known host: no host has reported to KV \
             converge-hosts yet (start an agent with --label, then submit)"
        ));
    }
    // For each selector key, the values hosts have.
    let mut per_key = Vec::new();
    for key in spec.selector.keys() {
        let mut values: BTreeMap<&str, usize> = BTreeMap::new();
        for h in hosts {
            if let Some(v) = h.labels.get(key) {
                *values.entry(v.as_str()).or_default() += 1;
            }
        }
        per_key.push(if values.is_empty() {
            format!("no host has label {key}")
        } else {
            let list: Vec<String> = values
                .iter()
                .map(|(v, n)| format!("{key}={v} ({n} host{})", if *n == 1 { "" } else { "s" }))
                .collect();
            format!("hosts have {}", list.join(", "))
        });
    }
    // Each distinct label set, with its hosts.
    let mut sets: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for h in hosts {
        sets.entry(format(&h.labels))
            .or_default()
            .push(h.host.as_str());
    }
    let mut listed: Vec<String> = sets
        .iter()
        .take(MAX_LISTED)
        .map(|(labels, names)| format!("  {}: {labels}", names.join(", ")))
        .collect();
    if sets.len() > MAX_LISTED {
        listed.push(format!(
            "  … and {} more label sets (converge hosts)",
            sets.len() - MAX_LISTED
        ));
    }
    Some(format!(
        "`[selector]` {wanted} matches none of the {} known hosts ({}); their labels:\n{}",
        hosts.len(),
        per_key.join("; "),
        listed.join("\n")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(id: &str, labels: &[(&str, &str)]) -> HostTelemetry {
        HostTelemetry {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..HostTelemetry::new(id.parse().unwrap(), "127.0.0.1", 0.0)
        }
    }

    fn spec(selector: &str) -> JobSpec {
        JobSpec::from_toml(&format!(
            "id = \"j\"\ncommand = [\"t\"]\n[selector]\n{selector}\n"
        ))
        .unwrap()
    }

    #[test]
    fn a_selector_no_host_matches_is_refused_with_the_labels_hosts_have() {
        let hosts = [
            host("n1", &[("zone", "a"), ("gpu.count", "1")]),
            host("n2", &[("zone", "b"), ("gpu.count", "1")]),
            host("n3", &[("zone", "b"), ("gpu.count", "1")]),
        ];
        assert_eq!(refusal(&spec("zone = \"b\""), &hosts), None);
        let plain = JobSpec::from_toml("id = \"j\"\ncommand = [\"t\"]\n").unwrap();
        assert_eq!(refusal(&plain, &[]), None);

        let why = refusal(&spec("zone = \"c\"\nrack = \"r1\""), &hosts).unwrap();
        assert!(
            why.starts_with("`[selector]` rack=r1,zone=c matches none of the 3 known hosts"),
            "{why}"
        );
        assert!(why.contains("no host has label rack"), "{why}");
        assert!(
            why.contains("hosts have zone=a (1 host), zone=b (2 hosts)"),
            "{why}"
        );
        assert!(why.contains("  n1: gpu.count=1,zone=a"), "{why}");
        assert!(why.contains("  n2, n3: gpu.count=1,zone=b"), "{why}");

        let why = refusal(&spec("zone = \"a\""), &[]).unwrap();
        assert!(why.contains("no host has reported"), "{why}");
    }

    #[test]
    fn many_label_sets_are_cut_short() {
        let hosts: Vec<HostTelemetry> = (0..25)
            .map(|i| host(&format!("n{i}"), &[("rack", &format!("r{i}"))]))
            .collect();
        let why = refusal(&spec("rack = \"none\""), &hosts).unwrap();
        assert_eq!(why.lines().count(), 1 + MAX_LISTED + 1, "{why}");
        assert!(why.contains("… and 15 more label sets"), "{why}");
    }
}

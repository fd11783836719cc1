//! The host's labels, reported in every telemetry sample ([`HostTelemetry::labels`]): the GPU
//! labels measured at start (`gpu.model`, `gpu.type`, `gpu.memory`, `gpu.count`) and the custom ones
//! of the agent's configuration (`--label key=value`, `CONVERGE_AGENT_LABELS`). Job
//! selectors match them (docs/protocol.md "Node labels and selectors").
//!
//! [`HostTelemetry::labels`]: converge_common::HostTelemetry::labels

use std::collections::BTreeMap;

use converge_common::GpuSample;
use converge_common::labels::{
    GPU_COUNT, GPU_MEMORY, GPU_MODEL, GPU_SPEED, GPU_TYPE, MAX_LABELS, RESERVED_PREFIX, gpu_type,
    parse_pair, sanitize_value,
};

/// Checks one custom label argument (`key=value`), as clap's value parser for `--label`:
/// Kubernetes label syntax, and no key under the reserved `gpu.` prefix.
pub fn parse_label_arg(text: &str) -> Result<String, String> {
    let (key, _) = parse_pair(text)?;
    if key.starts_with(RESERVED_PREFIX) {
        return Err(format!(
            "label {key} is reserved: the agent sets {GPU_MODEL}, {GPU_TYPE}, {GPU_MEMORY}, \
             {GPU_COUNT} and {GPU_SPEED} from its GPUs, and custom labels may not use the \
             {RESERVED_PREFIX:?} prefix"
        ));
    }
    Ok(text.to_string())
}

/// The custom labels of `args` (each `key=value`, or several separated by commas; empty
/// entries are skipped). Refused with the reason when one is malformed, reserved, given
/// twice with different values, or when there are too many.
pub fn custom_labels(args: &[String]) -> Result<BTreeMap<String, String>, String> {
    let mut labels = BTreeMap::new();
    for text in args
        .iter()
        .flat_map(|a| a.split(','))
        .filter(|t| !t.trim().is_empty())
    {
        parse_label_arg(text)?;
        let (key, value) = parse_pair(text)?;
        if let Some(old) = labels.get(&key)
            && *old != value
        {
            return Err(format!(
                "label {key} is given twice, as {old:?} and {value:?}"
            ));
        }
        labels.insert(key, value);
    }
    let room = MAX_LABELS - 5;
    if labels.len() > room {
        return Err(format!(
            "{} custom labels, at most {room} allowed",
            labels.len()
        ));
    }
    Ok(labels)
}

/// The GPU labels of a host with `gpus`: `gpu.count`, and from the first GPU `gpu.model`
/// (its name as a label value), `gpu.type` (`source_type`, the type a fake source was
/// given, else [`gpu_type`] of the name) and `gpu.memory` (whole GiB, rounded); the model
/// is absent when the name has nothing a label value can hold, all three without GPUs;
/// `gpu.speed` when the source knows its nominal speed (`source_speed`).
pub fn gpu_labels(
    gpus: &[GpuSample],
    source_type: Option<&str>,
    source_speed: Option<f64>,
) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    labels.insert(GPU_COUNT.to_string(), gpus.len().to_string());
    if let Some(first) = gpus.first() {
        let model = sanitize_value(&first.name);
        if !model.is_empty() {
            labels.insert(GPU_MODEL.to_string(), model);
        }
        let kind = source_type.map_or_else(|| gpu_type(&first.name), str::to_string);
        labels.insert(GPU_TYPE.to_string(), kind);
        let gib = (first.memory_total_bytes as f64 / (1u64 << 30) as f64).round() as u64;
        labels.insert(GPU_MEMORY.to_string(), gib.to_string());
        if let Some(speed) = source_speed.filter(|s| s.is_finite() && *s > 0.0) {
            labels.insert(GPU_SPEED.to_string(), speed.to_string());
        }
    }
    labels
}

/// Every label of the host: the GPU labels and the custom ones (checked as
/// [`custom_labels`] does).
pub fn host_labels(
    custom: &[String],
    gpus: &[GpuSample],
    source_type: Option<&str>,
    source_speed: Option<f64>,
) -> Result<BTreeMap<String, String>, String> {
    let mut labels = custom_labels(custom)?;
    labels.extend(gpu_labels(gpus, source_type, source_speed));
    converge_common::labels::validate(&labels)?;
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{FAKE_GPU_MEMORY_BYTES, FakeGpus, GpuSource};

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn fake_gpus_and_custom_labels_make_the_host_labels() {
        let mut gpus = FakeGpus::new("h", 4);
        let labels = host_labels(
            &args(&["zone=a", "rack=r1,example.com/tier=gold", ""]),
            &gpus.sample(&Default::default()),
            gpus.gpu_type(),
            gpus.gpu_speed(),
        )
        .unwrap();
        let expected: BTreeMap<String, String> = [
            ("example.com/tier", "gold"),
            ("gpu.count", "4"),
            ("gpu.memory", "16"),
            ("gpu.model", "Converge-fake-GPU"),
            ("gpu.type", "fake"),
            ("rack", "r1"),
            ("zone", "a"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(labels, expected);
        assert_eq!(FAKE_GPU_MEMORY_BYTES >> 30, 16);
        assert_eq!(
            host_labels(&[], &[], None, None).unwrap(),
            BTreeMap::from([("gpu.count".to_string(), "0".to_string())])
        );
    }

    #[test]
    fn nvml_names_and_memory_become_values() {
        let mut gpu = FakeGpus::new("h", 1).sample(&Default::default()).remove(0);
        gpu.name = "NVIDIA H100 80GB HBM3".into();
        gpu.memory_total_bytes = 85_520_809_984;
        let labels = gpu_labels(&[gpu.clone(), gpu], None, None);
        assert_eq!(labels["gpu.model"], "NVIDIA-H100-80GB-HBM3");
        assert_eq!(labels["gpu.type"], "h100");
        assert_eq!(labels["gpu.memory"], "80");
        assert_eq!(labels["gpu.count"], "2");
    }

    #[test]
    fn bad_or_reserved_custom_labels_are_refused_with_the_reason() {
        for (arg, expect) in [
            ("zone", "key=value"),
            ("bad key=a", "label key \"bad key\" is not valid"),
            ("zone=a b", "value \"a b\" is not valid"),
            ("gpu.model=fast", "label gpu.model is reserved"),
            ("gpu.anything=1", "reserved"),
        ] {
            let e = custom_labels(&args(&[arg])).unwrap_err();
            assert!(e.contains(expect), "{arg}: {e}");
            assert!(parse_label_arg(arg).is_err(), "{arg}");
        }
        let e = custom_labels(&args(&["zone=a", "zone=b"])).unwrap_err();
        assert!(e.contains("given twice"), "{e}");
        assert!(custom_labels(&args(&["zone=a", "zone=a"])).is_ok());
        let many: Vec<String> = (0..61).map(|i| format!("k{i}=v")).collect();
        assert!(custom_labels(&many).unwrap_err().contains("at most 59"));
        let e = custom_labels(&args(&["gpu.type=a100"])).unwrap_err();
        assert!(e.contains("gpu.type"), "{e}");
    }

    #[test]
    fn a_typed_fake_source_reports_its_type_and_names_it_in_the_model() {
        let mut gpus = FakeGpus::new("h", 2)
            .with_type(Some("t4".into()))
            .with_speed(Some(0.25));
        let labels = host_labels(
            &[],
            &gpus.sample(&Default::default()),
            gpus.gpu_type(),
            gpus.gpu_speed(),
        )
        .unwrap();
        assert_eq!(labels["gpu.type"], "t4");
        assert_eq!(labels["gpu.speed"], "0.25");
        assert_eq!(converge_common::labels::host_gpu_speed(&labels), Some(0.25));
        assert_eq!(labels["gpu.model"], "Converge-fake-GPU-t4");
    }
}

//! GPU sources behind one trait: NVML (through nvml-wrapper, loaded at run time) on GPU
//! nodes, and a fake source for machines without GPUs whose utilization follows the workers
//! placed on it.

use converge_common::GpuSample;
use std::collections::BTreeSet;

/// Where a host's GPU inventory and samples come from.
pub trait GpuSource: Send {
    /// `"nvml"` or `"fake"`, reported in telemetry.
    fn kind(&self) -> &'static str;
    /// Number of GPUs on the host.
    fn count(&self) -> u32;
    /// Samples every GPU. `busy` holds the indices of GPUs assigned to running workers (the
    /// fake source derives utilization from it; NVML ignores it and measures).
    fn sample(&mut self, busy: &BTreeSet<u32>) -> Vec<GpuSample>;
    /// The GPU type this source was told its GPUs are (the fake source's `--fake-gpu-type`);
    /// `None`: the type is [`converge_common::labels::gpu_type`] of the model name.
    fn gpu_type(&self) -> Option<&str> {
        None
    }
    /// The nominal speed this source was told its GPUs have (the fake source's
    /// `--fake-gpu-speed`), reported as the host's `gpu.speed`; `None`: not known.
    fn gpu_speed(&self) -> Option<f64> {
        None
    }
}

/// Memory of one fake GPU, in bytes (16 GiB).
pub const FAKE_GPU_MEMORY_BYTES: u64 = 16 * 1024 * 1024 * 1024;

/// A host's pretend GPUs, for development and tests on machines without GPUs. A GPU with a
/// running worker reports 90–99 % utilization, 60 % memory used, 250 W and an SM clock of
/// 1,755 MHz; an idle one 0 %, no memory, 50 W and 210 MHz.
#[derive(Debug)]
pub struct FakeGpus {
    host: String,
    count: u32,
    tick: u64,
    gpu_type: Option<String>,
    gpu_speed: Option<f64>,
}

/// The fake GPUs' model name without a type.
pub const FAKE_GPU_MODEL: &str = "Converge fake GPU";

impl FakeGpus {
    pub fn new(host: &str, count: u32) -> Self {
        Self {
            host: host.to_string(),
            count,
            tick: 0,
            gpu_type: None,
            gpu_speed: None,
        }
    }

    /// Fake GPUs of type `gpu_type` (a label value, e.g. `t4`): reported as the host's
    /// `gpu.type`, and in the model name (`Converge fake GPU (t4)`).
    pub fn with_type(mut self, gpu_type: Option<String>) -> Self {
        self.gpu_type = gpu_type;
        self
    }

    /// Fake GPUs of nominal speed `speed` (the fraction of real speed the workers are told to
    /// run at): reported as the host's `gpu.speed`.
    pub fn with_speed(mut self, speed: Option<f64>) -> Self {
        self.gpu_speed = speed;
        self
    }
}

impl GpuSource for FakeGpus {
    fn kind(&self) -> &'static str {
        "fake"
    }
    fn count(&self) -> u32 {
        self.count
    }
    fn gpu_type(&self) -> Option<&str> {
        Some(self.gpu_type.as_deref().unwrap_or("fake"))
    }
    fn gpu_speed(&self) -> Option<f64> {
        self.gpu_speed
    }
    fn sample(&mut self, busy: &BTreeSet<u32>) -> Vec<GpuSample> {
        self.tick += 1;
        (0..self.count)
            .map(|index| {
                let is_busy = busy.contains(&index);
                // A small deterministic wobble so dashboards show a live signal.
                let wobble = ((self.tick + u64::from(index)) % 10) as f64;
                GpuSample {
                    index,
                    uuid: format!("GPU-fake-{}-{index}", self.host),
                    name: match &self.gpu_type {
                        Some(t) => format!("{FAKE_GPU_MODEL} ({t})"),
                        None => FAKE_GPU_MODEL.into(),
                    },
                    memory_total_bytes: FAKE_GPU_MEMORY_BYTES,
                    memory_used_bytes: if is_busy {
                        FAKE_GPU_MEMORY_BYTES / 5 * 3
                    } else {
                        0
                    },
                    utilization_pct: if is_busy { 90.0 + wobble } else { 0.0 },
                    power_mw: Some(if is_busy { 250_000 } else { 50_000 }),
                    sm_clock_mhz: Some(if is_busy { 1_755 } else { 210 }),
                }
            })
            .collect()
    }
}

/// GPUs measured through NVML (`libnvidia-ml.so.1`, loaded at run time).
pub struct NvmlGpus {
    nvml: nvml_wrapper::Nvml,
    count: u32,
}

impl std::fmt::Debug for NvmlGpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlGpus")
            .field("count", &self.count)
            .finish()
    }
}

impl NvmlGpus {
    /// Loads NVML. `Err` carries NVML's reason (typically that the library is missing,
    /// i.e. no NVIDIA driver on this machine).
    pub fn init() -> Result<Self, String> {
        let nvml = nvml_wrapper::Nvml::init().map_err(|e| e.to_string())?;
        let count = nvml.device_count().map_err(|e| e.to_string())?;
        Ok(Self { nvml, count })
    }
}

impl GpuSource for NvmlGpus {
    fn kind(&self) -> &'static str {
        "nvml"
    }
    fn count(&self) -> u32 {
        self.count
    }
    fn sample(&mut self, _busy: &BTreeSet<u32>) -> Vec<GpuSample> {
        let mut out = Vec::with_capacity(self.count as usize);
        for index in 0..self.count {
            let device = match self.nvml.device_by_index(index) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(index, "NVML cannot open GPU: {e}");
                    continue;
                }
            };
            let memory = device.memory_info().ok();
            out.push(GpuSample {
                index,
                uuid: device
                    .uuid()
                    .unwrap_or_else(|_| format!("GPU-unknown-{index}")),
                name: device.name().unwrap_or_else(|_| "unknown".into()),
                memory_total_bytes: memory.as_ref().map_or(0, |m| m.total),
                memory_used_bytes: memory.as_ref().map_or(0, |m| m.used),
                utilization_pct: device.utilization_rates().map_or(0.0, |u| f64::from(u.gpu)),
                power_mw: device.power_usage().ok().map(u64::from),
                sm_clock_mhz: device
                    .clock_info(nvml_wrapper::enum_wrappers::device::Clock::SM)
                    .ok(),
            });
        }
        out
    }
}

/// Picks the GPU source: the fake one when `fake_gpus` is set, else NVML. Without either,
/// returns a message that tells the operator what to do.
pub fn open_gpu_source(
    host: &str,
    fake_gpus: Option<u32>,
    fake_type: Option<String>,
    fake_speed: Option<f64>,
) -> Result<Box<dyn GpuSource>, String> {
    if let Some(n) = fake_gpus {
        return Ok(Box::new(
            FakeGpus::new(host, n)
                .with_type(fake_type)
                .with_speed(fake_speed),
        ));
    }
    match NvmlGpus::init() {
        Ok(nvml) => Ok(Box::new(nvml)),
        Err(reason) => Err(format!(
            "no GPU source: NVML could not be loaded ({reason}). Run the agent on a node with \
             the NVIDIA driver installed, or pass --fake-gpus N to pretend N GPUs (for machines \
             without GPUs: development, CI, the local cluster)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_utilization_follows_workers() {
        let mut gpus = FakeGpus::new("h", 4);
        let busy: BTreeSet<u32> = [1, 3].into();
        let s = gpus.sample(&busy);
        assert_eq!(s.len(), 4);
        for g in &s {
            let expect_busy = busy.contains(&g.index);
            assert_eq!(g.utilization_pct >= 90.0, expect_busy, "{g:?}");
            assert_eq!(g.memory_used_bytes > 0, expect_busy);
        }
        assert!(s.iter().all(|g| g.uuid.starts_with("GPU-fake-h-")));
    }

    #[test]
    fn without_nvml_or_fake_the_error_says_what_to_do() {
        // This machine may or may not have NVML; only check the message when it has none.
        if let Err(msg) = open_gpu_source("h", None, None, None) {
            assert!(msg.contains("--fake-gpus"), "{msg}");
        }
        assert_eq!(
            open_gpu_source("h", Some(2), None, None).unwrap().count(),
            2
        );
    }
}

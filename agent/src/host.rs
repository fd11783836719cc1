//! Host telemetry through sysinfo: per-NIC receive/transmit rates and host CPU and memory.

use converge_common::NicSample;
use std::time::Instant;

/// Samples NIC rates (bytes per second since the previous sample) and CPU/memory.
pub struct HostSampler {
    networks: sysinfo::Networks,
    system: sysinfo::System,
    last: Instant,
}

impl std::fmt::Debug for HostSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSampler").finish_non_exhaustive()
    }
}

/// One host sample.
#[derive(Debug, Clone, PartialEq)]
pub struct HostSample {
    pub nics: Vec<NicSample>,
    /// CPU utilization over all cores since the previous sample, percent.
    pub cpu_pct: f64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
}

impl HostSampler {
    pub fn new() -> Result<Self, String> {
        let networks =
            sysinfo::Networks::new_with_refreshed_list().map_err(|e| format!("sysinfo: {e}"))?;
        let mut system = sysinfo::System::new().map_err(|e| format!("sysinfo: {e}"))?;
        system.refresh_cpu_usage();
        system.refresh_memory();
        Ok(Self {
            networks,
            system,
            last: Instant::now(),
        })
    }

    /// Samples now. Rates are deltas since the previous call divided by the elapsed time.
    pub fn sample(&mut self) -> HostSample {
        let now = Instant::now();
        let elapsed = now.duration_since(self.last).as_secs_f64().max(1e-3);
        self.last = now;
        self.networks.refresh(true);
        self.system.refresh_cpu_usage();
        self.system.refresh_memory();
        let mut nics: Vec<NicSample> = self
            .networks
            .iter()
            .map(|(name, data)| NicSample {
                name: name.to_string_lossy().into_owned(),
                rx_bytes_per_s: data.received() as f64 / elapsed,
                tx_bytes_per_s: data.transmitted() as f64 / elapsed,
                link_speed_bps: data.receive_link_speed(),
            })
            .collect();
        nics.sort_by(|a, b| a.name.cmp(&b.name));
        HostSample {
            nics,
            cpu_pct: f64::from(self.system.global_cpu_usage()),
            memory_used_bytes: self.system.used_memory(),
            memory_total_bytes: self.system.total_memory(),
        }
    }
}

/// The machine's hostname made into a valid host id: the part before the first dot, with
/// any character outside `[A-Za-z0-9_-]` replaced by `-`.
pub fn default_host_id() -> String {
    let name = sysinfo::System::host_name().unwrap_or_else(|_| "localhost".into());
    sanitize_host_id(&name)
}

fn sanitize_host_id(name: &str) -> String {
    let short = name.split('.').next().unwrap_or(name);
    let mut id: String = short
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(converge_common::ids::MAX_ID_LEN)
        .collect();
    if !id.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        id.insert(0, 'h');
        id.truncate(converge_common::ids::MAX_ID_LEN);
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_ids_from_hostnames() {
        assert_eq!(sanitize_host_id("gpu-07.cluster.local"), "gpu-07");
        assert_eq!(sanitize_host_id("node 1"), "node-1");
        assert_eq!(sanitize_host_id("_x"), "h_x");
        assert!(converge_common::ids::validate_id(&default_host_id()).is_ok());
    }

    #[test]
    fn samples_loopback_and_memory() {
        let mut s = HostSampler::new().unwrap();
        let sample = s.sample();
        assert!(sample.memory_total_bytes > 0);
        assert!(
            sample.nics.iter().any(|n| n.name == "lo"),
            "{:?}",
            sample.nics
        );
        assert!(sample.nics.iter().all(|n| n.rx_bytes_per_s >= 0.0));
    }
}

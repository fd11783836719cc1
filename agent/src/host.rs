//! Host telemetry through sysinfo: per-NIC receive/transmit rates and host CPU and memory.

use converge_common::NicSample;
use std::collections::BTreeMap;
use std::time::Instant;

/// Samples NIC rates (bytes per second since the previous sample) and CPU/memory.
pub struct HostSampler {
    networks: sysinfo::Networks,
    system: sysinfo::System,
    last: Instant,
    /// Link speeds set by the operator (`--link-speed`), bits per second by NIC name.
    link_speeds: BTreeMap<String, u64>,
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
    /// A sampler reporting the kernel's link speeds.
    pub fn new() -> Result<Self, String> {
        Self::with_link_speeds(&[])
    }

    /// A sampler that reports `link_speeds` (`(NIC name, Mbit/s)`, from `--link-speed`)
    /// instead of the speed the kernel gives for those NICs.
    pub fn with_link_speeds(link_speeds: &[(String, u64)]) -> Result<Self, String> {
        let networks =
            sysinfo::Networks::new_with_refreshed_list().map_err(|e| format!("sysinfo: {e}"))?;
        let mut system = sysinfo::System::new().map_err(|e| format!("sysinfo: {e}"))?;
        system.refresh_cpu_usage();
        system.refresh_memory();
        Ok(Self {
            networks,
            system,
            last: Instant::now(),
            link_speeds: link_speeds
                .iter()
                .map(|(nic, mbits)| (nic.clone(), mbits.saturating_mul(1_000_000)))
                .collect(),
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
            .map(|(name, data)| {
                let name = name.to_string_lossy().into_owned();
                NicSample {
                    rx_bytes_per_s: data.received() as f64 / elapsed,
                    tx_bytes_per_s: data.transmitted() as f64 / elapsed,
                    link_speed_bps: self
                        .link_speeds
                        .get(&name)
                        .copied()
                        .or_else(|| data.receive_link_speed()),
                    name,
                }
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

/// Parses one `--link-speed` value, `NIC=MBITS` (the interface name and its speed in Mbit/s,
/// the unit of `/sys/class/net/<nic>/speed`), e.g. `eth0=1000`.
pub fn parse_link_speed(arg: &str) -> Result<(String, u64), String> {
    let (nic, mbits) = arg
        .split_once('=')
        .ok_or_else(|| format!("{arg:?} is not NIC=MBITS (e.g. eth0=1000)"))?;
    let nic = nic.trim();
    // Linux interface names: 1 to 15 bytes, no '/', no whitespace.
    if nic.is_empty() || nic.len() > 15 || nic.contains(['/', ' ', '\t']) {
        return Err(format!("{nic:?} is not a network interface name"));
    }
    let mbits: u64 = mbits
        .trim()
        .parse()
        .ok()
        .filter(|&m| m > 0 && m <= 10_000_000)
        .ok_or_else(|| format!("{mbits:?} is not a link speed in Mbit/s (1 to 10000000)"))?;
    Ok((nic.to_string(), mbits))
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
    fn link_speed_arguments() {
        assert_eq!(parse_link_speed("eth0=1000"), Ok(("eth0".into(), 1000)));
        assert_eq!(parse_link_speed(" veth1 = 250 "), Ok(("veth1".into(), 250)));
        for bad in [
            "eth0", "=1000", "eth0=", "eth0=0", "eth0=1g", "eth0=-5", "a/b=10",
        ] {
            assert!(parse_link_speed(bad).is_err(), "{bad}");
        }
        assert!(parse_link_speed("a-name-longer-than-15=10").is_err());
    }

    #[test]
    fn link_speeds_given_replace_the_kernels() {
        let mut s = HostSampler::with_link_speeds(&[("lo".into(), 1000)]).unwrap();
        let lo = s
            .sample()
            .nics
            .into_iter()
            .find(|n| n.name == "lo")
            .unwrap();
        assert_eq!(lo.link_speed_bps, Some(1_000_000_000));
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

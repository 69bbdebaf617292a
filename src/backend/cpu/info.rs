//! What the CPU backend reports about the machine: the CPU's model name, memory, and the size of
//! its last-level cache (the cache a benchmark must defeat). Read from /proc and /sys on Linux;
//! elsewhere, or where a file cannot be read, a stated fallback.

use super::simd::kernel_isa;
use crate::backend::{slugify, BackendKind, DeviceInfo};

/// LLC size assumed when /sys does not tell: larger than most, so that cold-cache timing copies
/// enough weights rather than too few.
pub(super) const FALLBACK_LLC_BYTES: u64 = 32 << 20;

pub(super) fn cpu_info() -> DeviceInfo {
    let threads = super::pool::threads() as u32;
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| model_name(&s));
    let slug = match &model {
        Some(name) if !slugify(name).is_empty() => slugify(name),
        _ => slugify(&format!("cpu {}", std::env::consts::ARCH)),
    };
    let name = model.unwrap_or_else(|| format!("{} CPU", std::env::consts::ARCH));
    let memory_bytes = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| mem_total_bytes(&s))
        .unwrap_or(0);
    DeviceInfo {
        backend: BackendKind::Cpu,
        ordinal: 0,
        name,
        slug,
        // The kernel build that runs is part of the arch: a profile timed with AVX2 kernels does
        // not describe the baseline build.
        arch: format!("{}+{}", std::env::consts::ARCH, kernel_isa()),
        compute_units: threads,
        memory_bytes,
        l2_bytes: largest_cache_bytes().unwrap_or(FALLBACK_LLC_BYTES),
        driver_version: None,
        runtime_version: None,
    }
}

/// The first "model name" line of /proc/cpuinfo (x86), else "Model" or "Hardware" (some ARM
/// kernels), with runs of spaces collapsed.
fn model_name(cpuinfo: &str) -> Option<String> {
    for key in ["model name", "Model", "Hardware"] {
        let found = cpuinfo.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k.trim() == key).then(|| v.split_whitespace().collect::<Vec<_>>().join(" "))
        });
        if let Some(v) = found.filter(|v| !v.is_empty()) {
            return Some(v);
        }
    }
    None
}

/// "MemTotal:  131072000 kB" → bytes.
/// The host's memory (MemTotal), 0 when unknown.
pub fn host_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| mem_total_bytes(&s))
        .unwrap_or(0)
}

fn mem_total_bytes(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut parts = line["MemTotal:".len()..].split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    let unit = parts.next().unwrap_or("B");
    Some(value * unit_bytes(unit)?)
}

/// The largest data or unified cache of cpu0 (its LLC), from sysfs.
fn largest_cache_bytes() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
        .filter(|e| std::fs::read_to_string(e.path().join("type")).map_or(true, |t| t.trim() != "Instruction"))
        .filter_map(|e| std::fs::read_to_string(e.path().join("size")).ok())
        .filter_map(|s| cache_size_bytes(&s))
        .max()
}

/// sysfs cache sizes: "32768K", "1M", "512K\n".
fn cache_size_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    Some(digits.parse::<u64>().ok()? * unit_bytes(unit)?)
}

fn unit_bytes(unit: &str) -> Option<u64> {
    match unit.trim() {
        "" | "B" => Some(1),
        "K" | "kB" | "KB" | "KiB" => Some(1 << 10),
        "M" | "MB" | "MiB" => Some(1 << 20),
        "G" | "GB" | "GiB" => Some(1 << 30),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_model_name_of_x86_cpuinfo() {
        let s = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC   7B13 64-Core Processor\n";
        assert_eq!(model_name(s).as_deref(), Some("AMD EPYC 7B13 64-Core Processor"));
        assert_eq!(model_name("processor : 0\nBogoMIPS : 50\n"), None);
    }

    #[test]
    fn reads_memtotal_in_bytes() {
        let s = "MemTotal:       131811884 kB\nMemFree:        1000 kB\n";
        assert_eq!(mem_total_bytes(s), Some(131_811_884 * 1024));
        assert_eq!(mem_total_bytes("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn parses_sysfs_cache_sizes() {
        assert_eq!(cache_size_bytes("32768K\n"), Some(32 << 20));
        assert_eq!(cache_size_bytes("1M"), Some(1 << 20));
        assert_eq!(cache_size_bytes("512"), Some(512));
        assert_eq!(cache_size_bytes("12Q"), None);
        assert_eq!(cache_size_bytes(""), None);
    }

    #[test]
    fn info_is_filled_in() {
        let i = cpu_info();
        assert!(!i.name.is_empty() && !i.slug.is_empty());
        assert_eq!(i.slug, slugify(&i.slug), "slug must already be normalised");
        assert!(i.compute_units >= 1);
        assert!(i.l2_bytes > 0);
    }
}

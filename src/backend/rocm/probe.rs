//! Device discovery: gfx arch, compute units, wavefront width, LDS per block, memory. Every step
//! is a HIP call through the run-time-loaded [`HipApi`]; a machine without ROCm gets a reason.

use std::ffi::c_char;

use super::hip::{self, attr, HipApi, PROP_BUFFER, PROP_GCN_ARCH_NAME};
use super::launch::default_wave_for_arch;
use super::{hiprtc, RocmDevice};
use crate::backend::{slugify, BackendKind, BackendStatus, DeviceInfo};
use crate::error::{FdppError, Result};

/// hipInit, then the device count. hipInit is what fails (hipErrorNoDevice, or
/// hipErrorInvalidDevice) when the runtime is installed but there is no AMD GPU or /dev/kfd.
pub fn device_count() -> Result<usize> {
    let api = hip::api_or_unavailable()?;
    // SAFETY: plain call; flags must be 0.
    let r = unsafe { (api.init)(0) };
    if r != hip::HIP_SUCCESS {
        return Err(FdppError::BackendUnavailable {
            backend: "rocm",
            reason: format!(
                "{} loaded, but hipInit failed: {} ({r}); no AMD GPU is visible (is /dev/kfd present and readable?)",
                api.lib.name,
                api.error_string(r)
            ),
        });
    }
    let mut n = 0;
    // SAFETY: out-parameter.
    let r = unsafe { (api.get_device_count)(&mut n) };
    if r != hip::HIP_SUCCESS {
        return Err(FdppError::BackendUnavailable {
            backend: "rocm",
            reason: format!("hipGetDeviceCount failed: {} ({r})", api.error_string(r)),
        });
    }
    Ok(n.max(0) as usize)
}

fn version(f: unsafe extern "C" fn(*mut i32) -> i32) -> Option<i32> {
    let mut v = 0;
    // SAFETY: out-parameter.
    (unsafe { f(&mut v) } == hip::HIP_SUCCESS).then_some(v)
}

/// HIP encodes versions as major·10⁷ + minor·10⁵ + patch.
pub fn format_hip_version(v: i32) -> String {
    format!("{}.{}.{}", v / 10_000_000, (v / 100_000) % 100, v % 100_000)
}

/// The `gcnArchName` ("gfx90a:sramecc+:xnack-") of a hipDeviceProp_t image: at its 5.x offset,
/// else the first NUL-terminated "gfx<digits/letters>[:features]" string anywhere in the struct
/// (the 6.x layout moved it; the device name, which comes first, never has that form).
pub fn arch_from_props(props: &[u8]) -> Option<String> {
    let at = |off: usize| -> Option<String> {
        let field = props.get(off..)?;
        let field = &field[..field.len().min(256)];
        let end = field.iter().position(|&b| b == 0)?;
        let s = std::str::from_utf8(&field[..end]).ok()?;
        let target = s.split(':').next()?;
        let tail = target.strip_prefix("gfx")?;
        let ok = tail.len() >= 3
            && tail.starts_with(|c: char| c.is_ascii_digit())
            && tail.chars().all(|c| c.is_ascii_digit() || c.is_ascii_lowercase());
        ok.then(|| s.to_string())
    };
    at(PROP_GCN_ARCH_NAME).or_else(|| {
        (0..props.len().saturating_sub(3))
            .filter(|&i| &props[i..i + 3] == b"gfx" && (i == 0 || props[i - 1] == 0))
            .find_map(at)
    })
}

fn attribute(api: &HipApi, a: i32, dev: i32, what: &str) -> Result<i32> {
    let mut v = 0;
    // SAFETY: out-parameter.
    api.check(unsafe { (api.device_get_attribute)(&mut v, a, dev) }, what)?;
    Ok(v)
}

/// Everything fdpp needs about one device.
pub fn device(api: &HipApi, ordinal: usize) -> Result<RocmDevice> {
    let dev = ordinal as i32;
    let mut name = [0 as c_char; 256];
    // SAFETY: the buffer holds 256 bytes, as passed.
    api.check(
        unsafe { (api.device_get_name)(name.as_mut_ptr(), 256, dev) },
        "hipDeviceGetName",
    )?;
    let bytes: Vec<u8> = name.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    let name = String::from_utf8_lossy(&bytes).into_owned();
    let mut mem = 0usize;
    // SAFETY: out-parameter.
    api.check(unsafe { (api.device_total_mem)(&mut mem, dev) }, "hipDeviceTotalMem")?;
    // Room to spare past the 5.x layout, in case a runtime writes a longer struct.
    let mut props = vec![0u8; PROP_BUFFER];
    // SAFETY: the buffer is larger than any hipDeviceProp_t layout.
    api.check(
        unsafe { (api.get_device_properties)(props.as_mut_ptr().cast(), dev) },
        "hipGetDeviceProperties",
    )?;
    let full_arch = arch_from_props(&props).ok_or_else(|| {
        FdppError::device(
            "rocm",
            format!("device {ordinal} ({name}): no gfx arch in hipDeviceProp_t.gcnArchName"),
        )
    })?;
    // hiprtc wants the bare target ("gfx90a"), not the feature suffixes.
    let arch = full_arch.split(':').next().unwrap_or(&full_arch).to_string();
    let cus = attribute(api, attr::MULTIPROCESSOR_COUNT, dev, "compute units")?;
    let l2 = attribute(api, attr::L2_CACHE_SIZE, dev, "L2 size")?;
    // Every AMD GPU fdpp targets has 64 KiB of LDS per workgroup; a value outside (0, 1 MiB]
    // means the attribute enum moved under us, and 64 KiB is the safe reading.
    let lds = match attribute(api, attr::MAX_SHARED_MEMORY_PER_BLOCK, dev, "LDS per block")? {
        v if v > 0 && v <= 1 << 20 => v,
        _ => 64 << 10,
    };
    let reported_wave = attribute(api, attr::WARP_SIZE, dev, "wavefront size")?;
    let wave = match reported_wave {
        32 | 64 => reported_wave as u32,
        _ => default_wave_for_arch(&arch).unwrap_or(64),
    };
    let info = DeviceInfo {
        backend: BackendKind::Rocm,
        ordinal,
        slug: slugify(&format!("{name} {arch}")),
        name,
        arch: arch.clone(),
        compute_units: cus.max(0) as u32,
        memory_bytes: mem as u64,
        l2_bytes: l2.max(0) as u64,
        driver_version: version(api.driver_get_version).map(format_hip_version),
        runtime_version: version(api.runtime_get_version).map(|v| {
            let rtc = hiprtc::api().ok().and_then(|h| h.version());
            match rtc {
                Some(r) => format!("hip {} (hiprtc {r})", format_hip_version(v)),
                None => format!("hip {}", format_hip_version(v)),
            }
        }),
    };
    Ok(RocmDevice {
        info,
        wave,
        lds_per_block: lds.max(0) as u32,
    })
}

pub fn probe() -> BackendStatus {
    let mut st = BackendStatus {
        backend: BackendKind::Rocm,
        available: false,
        reason: None,
        devices: vec![],
    };
    let n = match device_count() {
        Err(e) => {
            st.reason = Some(reason_of(e));
            return st;
        }
        Ok(0) => {
            st.reason = Some("the HIP runtime reports no devices".into());
            return st;
        }
        Ok(n) => n,
    };
    let Ok(api) = hip::api() else {
        st.reason = Some("HIP runtime vanished after hipInit".into());
        return st;
    };
    for i in 0..n {
        match device(api, i) {
            Ok(d) => st.devices.push(d.info),
            Err(e) => st.reason = Some(format!("device {i}: {e}")),
        }
    }
    st.available = !st.devices.is_empty();
    if st.available {
        if let Err(e) = hiprtc::api_or_unavailable() {
            st.available = false;
            st.reason = Some(reason_of(e));
        }
    }
    st
}

fn reason_of(e: FdppError) -> String {
    match e {
        FdppError::BackendUnavailable { reason, .. } => reason,
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_arch_is_read_from_the_gcn_arch_name_field() {
        let mut p = vec![0u8; hip::PROP_BYTES];
        p[..18].copy_from_slice(b"AMD Instinct MI210");
        let s = b"gfx90a:sramecc+:xnack-";
        p[PROP_GCN_ARCH_NAME..PROP_GCN_ARCH_NAME + s.len()].copy_from_slice(s);
        assert_eq!(arch_from_props(&p).as_deref(), Some("gfx90a:sramecc+:xnack-"));
        // Another layout: the field elsewhere is still found.
        let mut q = vec![0u8; 1600];
        q[..19].copy_from_slice(b"AMD Instinct MI300X");
        q[1000..1006].copy_from_slice(b"gfx942");
        assert_eq!(arch_from_props(&q).as_deref(), Some("gfx942"));
        // No arch anywhere (or only text that merely contains "gfx"): None.
        let mut r = vec![0u8; 1600];
        r[10..16].copy_from_slice(b"mygfx9");
        r[400..403].copy_from_slice(b"gfx");
        assert_eq!(arch_from_props(&r), None);
        assert_eq!(arch_from_props(&p[..100]), None);
    }

    #[test]
    fn hip_versions_decode() {
        assert_eq!(format_hip_version(50_221_153), "5.2.21153");
        assert_eq!(format_hip_version(60_342_134), "6.3.42134");
    }

    #[test]
    fn probing_never_panics_and_explains_an_absence() {
        let st = probe();
        assert_eq!(st.backend, BackendKind::Rocm);
        if !st.available {
            let r = st.reason.unwrap_or_default();
            assert!(r.contains("libamdhip64") || r.contains("hip"), "{r}");
        }
    }
}

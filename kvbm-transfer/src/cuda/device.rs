//! Finding a GPU without crashing, and what we learn about it once.
//!
//! cudarc loads libcuda at run time. Its first driver call panics when the
//! library is missing, so [`probe`] checks that libcuda loads before touching
//! anything else and reports "no CUDA" as a value. Entry points newer than the
//! oldest driver we support (`cuMemcpyBatchAsync_v2`) are looked up in the
//! loaded library before use (`cuMemcpy3DBatchAsync_v2` too); calling one the
//! driver lacks would also panic.

use std::ffi::{CStr, c_char, c_int};
use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUdevice_attribute};

use super::error::{CudaError, CudaResult, check};
use super::kernel::CopyKernel;

/// What [`probe`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// libcuda loaded and reports this many devices (at least one).
    Devices(usize),
    /// libcuda is not installed or could not be loaded.
    NoDriver,
    /// libcuda loaded but reports no device (or failed to initialise).
    NoDevice,
}

/// Checks, without panicking, whether a CUDA device is usable here.
pub fn probe() -> Probe {
    // SAFETY: `is_culib_present` only tries to dlopen libcuda and closes it.
    if !unsafe { sys::is_culib_present() } {
        return Probe::NoDriver;
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Probe::Devices(n as usize),
        _ => Probe::NoDevice,
    }
}

/// True when the loaded driver exports `symbol`. Must only be called after
/// [`probe`] saw a driver.
pub(crate) fn driver_has(symbol: &str) -> bool {
    // SAFETY: the library was loaded by `probe`; looking a symbol up has no
    // side effects, and the returned pointer is not called here.
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(symbol.as_bytes())
            .is_ok()
    }
}

/// One opened GPU: its primary context, the copy kernel loaded into it, and
/// the facts the copy paths decide on. Cheap to clone.
#[derive(Clone)]
pub struct CudaDevice {
    pub(crate) inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    // Declared (and so dropped) before `ctx`: the module lives in the context.
    pub(crate) kernel: CopyKernel,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) ordinal: usize,
    pub(crate) name: String,
    pub(crate) sm_count: u32,
    pub(crate) numa_node: Option<u32>,
    pub(crate) host_ptr_is_device_ptr: bool,
    pub(crate) has_batch_copy: bool,
    pub(crate) has_batch_copy_3d: bool,
    pub(crate) max_pitch: u64,
    pub(crate) host_link_bytes_per_s: f64,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("sm_count", &self.inner.sm_count)
            .field("numa_node", &self.inner.numa_node)
            .field("has_batch_copy", &self.inner.has_batch_copy)
            .field("has_batch_copy_3d", &self.inner.has_batch_copy_3d)
            .field("max_pitch", &self.inner.max_pitch)
            .field("host_link_bytes_per_s", &self.inner.host_link_bytes_per_s)
            .finish()
    }
}

impl CudaDevice {
    /// Opens device `ordinal`: probes for the driver first, so a machine
    /// without CUDA gets [`CudaError::NoDriver`] / [`CudaError::NoDevice`]
    /// instead of a panic.
    pub fn open(ordinal: usize) -> CudaResult<Self> {
        let count = match probe() {
            Probe::NoDriver => return Err(CudaError::NoDriver),
            Probe::NoDevice => return Err(CudaError::NoDevice { ordinal, count: 0 }),
            Probe::Devices(n) => n,
        };
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| CudaError::driver("cuDevicePrimaryCtxRetain", e.0))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".to_string());
        let attr = |a: CUdevice_attribute| {
            ctx.attribute(a)
                .map_err(|e| CudaError::driver("cuDeviceGetAttribute", e.0))
        };
        let sm_count = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let host_ptr_is_device_ptr =
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)?
                != 0;
        let pci = pci_bus_id(ctx.cu_device());
        let numa_node = pci.as_deref().and_then(pci_numa_node);
        let host_link_bytes_per_s = pci
            .as_deref()
            .and_then(pci_link_bytes_per_s)
            .unwrap_or(FALLBACK_LINK_BYTES_PER_S);
        let has_batch_copy = driver_has("cuMemcpyBatchAsync_v2");
        let has_batch_copy_3d = driver_has("cuMemcpy3DBatchAsync_v2");
        let max_pitch = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH)?.max(0) as u64;
        let kernel = CopyKernel::load(&ctx)?;
        tracing::debug!(
            ordinal,
            %name,
            sm_count,
            ?numa_node,
            has_batch_copy,
            host_link_bytes_per_s,
            "opened CUDA device"
        );
        Ok(CudaDevice {
            inner: Arc::new(DeviceInner {
                kernel,
                ctx,
                ordinal,
                name,
                sm_count,
                numa_node,
                host_ptr_is_device_ptr,
                has_batch_copy,
                has_batch_copy_3d,
                max_pitch,
                host_link_bytes_per_s,
            }),
        })
    }

    /// Makes this device's context current on the calling thread. Every
    /// public operation does this itself; callers need it only for their own
    /// raw driver calls.
    pub fn bind(&self) -> CudaResult<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("cuCtxSetCurrent", e.0))
    }

    /// The cudarc context (the device's primary context), for interop with
    /// other cudarc users such as cuBLAS.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The device's marketing name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    /// The host NUMA node the GPU is attached to, where the OS says.
    pub fn numa_node(&self) -> Option<u32> {
        self.inner.numa_node
    }

    /// Whether the driver has `cuMemcpyBatchAsync_v2` (one call per batch).
    pub fn has_batch_copy(&self) -> bool {
        self.inner.has_batch_copy
    }

    /// Whether the driver has `cuMemcpy3DBatchAsync_v2` (pitched copies,
    /// one call per batch).
    pub fn has_batch_copy_3d(&self) -> bool {
        self.inner.has_batch_copy_3d
    }

    /// The largest pitch a pitched copy may use (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`).
    pub fn max_pitch(&self) -> u64 {
        self.inner.max_pitch
    }

    /// An upper bound of the host link's rate in one direction, in bytes
    /// per second: the PCIe link's top speed and width (from sysfs) after
    /// line encoding, times the payload share of a 256-byte transfer
    /// packet. No copy between host and device moves faster, so a copy of
    /// `n` bytes takes at least `n` over this. Where sysfs does not say,
    /// a PCIe 5.0 x16 link is assumed (too high a bound for a slower link
    /// only makes waiters poll earlier).
    pub fn host_link_bytes_per_s(&self) -> f64 {
        self.inner.host_link_bytes_per_s
    }

    /// Synchronises the whole context (used by tests and benches).
    pub fn synchronize(&self) -> CudaResult<()> {
        self.bind()?;
        // SAFETY: the context is current on this thread.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Bytes of device memory free and total.
    pub fn memory_info(&self) -> CudaResult<(usize, usize)> {
        self.bind()?;
        self.inner
            .ctx
            .mem_get_info()
            .map_err(|e| CudaError::driver("cuMemGetInfo", e.0))
    }
}

/// The GPU's PCI address as sysfs names it (`0000:19:00.0`).
fn pci_bus_id(dev: sys::CUdevice) -> Option<String> {
    let mut buf = [0 as c_char; 32];
    // SAFETY: `buf` is writable for its full length, which we pass.
    let rc = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, dev) };
    check("cuDeviceGetPCIBusId", rc).ok()?;
    // SAFETY: the driver wrote a NUL-terminated string into `buf`.
    let id = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .to_lowercase();
    Some(id)
}

fn pci_attribute(id: &str, name: &str) -> Option<String> {
    std::fs::read_to_string(format!("/sys/bus/pci/devices/{id}/{name}")).ok()
}

/// Reads the NUMA node of the GPU's PCI device from sysfs.
fn pci_numa_node(id: &str) -> Option<u32> {
    pci_attribute(id, "numa_node")?
        .trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// The PCIe link's top rate in one direction (see
/// [`CudaDevice::host_link_bytes_per_s`]), from sysfs `max_link_speed`
/// (`32.0 GT/s PCIe`) and `max_link_width` (`16`).
fn pci_link_bytes_per_s(id: &str) -> Option<f64> {
    let speed = pci_attribute(id, "max_link_speed")?;
    let width = pci_attribute(id, "max_link_width")?;
    link_bytes_per_s(&speed, &width)
}

/// Bytes per second of payload a PCIe link of `speed` (sysfs text, in
/// GT/s) and `width` lanes carries at most in one direction.
fn link_bytes_per_s(speed: &str, width: &str) -> Option<f64> {
    let gts: f64 = speed.split_whitespace().next()?.parse().ok()?;
    let lanes: f64 = width.trim().parse().ok()?;
    if !(gts > 0.0 && lanes > 0.0) {
        return None;
    }
    // 8b/10b up to 5 GT/s (PCIe 1.x, 2.x), 128b/130b from 8 GT/s on; the
    // flits of PCIe 6.0 carry about as much.
    let encoding = if gts <= 5.0 { 0.8 } else { 128.0 / 130.0 };
    Some(gts * 1e9 * lanes * encoding / 8.0 * TLP_PAYLOAD_SHARE)
}

/// The share of a transfer packet that is payload: 256 bytes of data in
/// about 280 on the wire (header, sequence number, CRC, framing).
const TLP_PAYLOAD_SHARE: f64 = 256.0 / 280.0;

/// The host link assumed where sysfs does not say: PCIe 5.0 x16.
const FALLBACK_LINK_BYTES_PER_S: f64 = 32e9 * 16.0 * (128.0 / 130.0) / 8.0 * TLP_PAYLOAD_SHARE;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_rate_comes_from_speed_width_and_encoding() {
        // PCIe 5.0 x16: 63 GB/s on the wire, 57.6 of payload.
        let gen5 = link_bytes_per_s("32.0 GT/s PCIe\n", "16\n").unwrap();
        assert!((gen5 / 1e9 - 57.6).abs() < 0.1, "{gen5}");
        assert_eq!(gen5, FALLBACK_LINK_BYTES_PER_S);
        // PCIe 2.0 x8 (8b/10b): 4 GB/s on the wire.
        let gen2 = link_bytes_per_s("5 GT/s", "8").unwrap();
        assert!(
            (gen2 / 1e9 - 4.0 * TLP_PAYLOAD_SHARE).abs() < 1e-9,
            "{gen2}"
        );
        assert_eq!(link_bytes_per_s("Unknown", "16"), None);
        assert_eq!(link_bytes_per_s("8 GT/s", "0"), None);
    }
}

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
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            self.kernel.unload();
        }
    }
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
        let numa_node = pci_numa_node(ctx.cu_device());
        let has_batch_copy = driver_has("cuMemcpyBatchAsync_v2");
        let has_batch_copy_3d = driver_has("cuMemcpy3DBatchAsync_v2");
        let max_pitch = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH)?.max(0) as u64;
        let kernel = CopyKernel::load()?;
        tracing::debug!(ordinal, %name, sm_count, ?numa_node, has_batch_copy, "opened CUDA device");
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

/// Reads the NUMA node of the GPU's PCI device from sysfs.
fn pci_numa_node(dev: sys::CUdevice) -> Option<u32> {
    let mut buf = [0 as c_char; 32];
    // SAFETY: `buf` is writable for its full length, which we pass.
    let rc = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, dev) };
    check("cuDeviceGetPCIBusId", rc).ok()?;
    // SAFETY: the driver wrote a NUL-terminated string into `buf`.
    let id = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .to_lowercase();
    let node = std::fs::read_to_string(format!("/sys/bus/pci/devices/{id}/numa_node")).ok()?;
    node.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

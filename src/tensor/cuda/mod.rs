//! The CUDA backend (feature `cuda`): every tensor lives on one GPU; matrix products run on
//! cuBLAS, everything else on NVRTC-compiled kernels (`kernels.cu`).
//!
//! cudarc loads the CUDA libraries dynamically, so this builds without a CUDA toolkit and a
//! binary with the feature still starts on a machine without a GPU. cudarc *panics* when a
//! library it needs cannot be loaded, so [`CudaBackend::new`] first probes for the driver,
//! cuBLAS and NVRTC and returns [`TensorError::NoCudaDriver`] (or
//! [`TensorError::MissingCudaLibrary`]) before making any other cudarc call.
//!
//! Layout: this file holds the backend, its buffers and the helpers every operation uses;
//! `backend.rs` implements [`Backend`](crate::tensor::Backend); `blas.rs` maps row-major products
//! onto column-major cuBLAS and builds attention from them; `kernels.rs` compiles and indexes the
//! kernels.
//!
//! `bf16` buffers are stored as raw 16-bit words and widened into a temporary `f32` buffer
//! around each operation (as the CPU backend does), so every kernel is written once, in `f32`.

/// Launches kernel `$k` of `$self` with config `$cfg` and the listed arguments, which must
/// match the kernel's parameter list in `kernels.cu` in order and type.
macro_rules! launch {
    ($self:expr, $op:expr, $k:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let func = $self.inner.kernels.get($k);
        let mut builder = $self.inner.stream.launch_builder(func);
        $( cudarc::driver::PushKernelArg::arg(&mut builder, $arg); )*
        // SAFETY: the arguments follow the kernel's signature in kernels.cu (checked by
        // reading; the names are checked by a test), the caller checked every buffer length
        // against the element counts passed, and `$cfg` is the shape the kernel expects.
        unsafe { builder.launch($cfg) }
            .map(|_| ())
            .map_err(|e| $crate::tensor::TensorError::Device(format!("{}: kernel {:?}: {e}", $op, $k)))
    }};
}

mod backend;
mod blas;
mod kernels;
mod loss;
mod norm;

use std::ops::Deref;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use self::kernels::{K, Kernels};
use super::{DType, Result};
use crate::tensor::TensorError;

/// A buffer in GPU memory: `f32` values, or `bf16` bit patterns.
#[derive(Debug)]
pub struct CudaBuf(Storage);

#[derive(Debug)]
enum Storage {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl CudaBuf {
    fn len(&self) -> usize {
        match &self.0 {
            Storage::F32(s) => s.len(),
            Storage::Bf16(s) => s.len(),
        }
    }

    /// Number of elements (the same as `Backend::len`, without a backend at hand).
    pub fn element_count(&self) -> usize {
        self.len()
    }

    /// The storage type (the same as `Backend::dtype`, without a backend at hand).
    pub fn storage_dtype(&self) -> DType {
        match self.0 {
            Storage::F32(_) => DType::F32,
            Storage::Bf16(_) => DType::Bf16,
        }
    }

    /// The device memory itself, for code that moves buffers between GPUs (NCCL in
    /// `comm::nccl_transport`) without a round trip through the host.
    pub fn into_data(self) -> CudaData {
        match self.0 {
            Storage::F32(s) => CudaData::F32(s),
            Storage::Bf16(s) => CudaData::Bf16(s),
        }
    }
}

/// A [`CudaBuf`]'s device memory: `f32` values, or `bf16` bit patterns. Converting back
/// with `CudaBuf::from` gives a buffer any [`CudaBackend`] on the same GPU can use (cudarc
/// orders its use on the backend's stream after the stream that wrote it).
#[derive(Debug)]
pub enum CudaData {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl From<CudaData> for CudaBuf {
    fn from(data: CudaData) -> Self {
        CudaBuf(match data {
            CudaData::F32(s) => Storage::F32(s),
            CudaData::Bf16(s) => Storage::Bf16(s),
        })
    }
}

/// The CUDA backend for one GPU. Cheap to clone: clones share the context, the stream (so
/// their work is ordered), the cuBLAS handle and the loaded kernels.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
    storage: DType,
}

struct Inner {
    ordinal: usize,
    device_name: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// cuBLAS handles must not be used from two host threads at once.
    blas: Mutex<CudaBlas>,
    kernels: Kernels,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.inner.ordinal)
            .field("device", &self.inner.device_name)
            .field("storage", &self.storage)
            .finish()
    }
}

/// Checks that the driver, cuBLAS and NVRTC libraries can be loaded. This is the only safe
/// first step: any other cudarc call panics when its library is missing.
fn probe_libraries() -> std::result::Result<(), TensorError> {
    // SAFETY: these only try to dlopen the library names cudarc would use and close them.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Err(TensorError::NoCudaDriver);
        }
        if !cudarc::cublas::sys::is_culib_present() {
            return Err(TensorError::MissingCudaLibrary {
                library: "cuBLAS (libcublas)",
            });
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Err(TensorError::MissingCudaLibrary {
                library: "NVRTC (libnvrtc)",
            });
        }
    }
    Ok(())
}

/// Text of a panic payload (cudarc panics on missing symbols in an old driver).
pub(crate) fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "the CUDA library panicked".into())
}

/// Number of CUDA devices, after checking that the libraries load.
pub(crate) fn device_count() -> std::result::Result<usize, TensorError> {
    probe_libraries()?;
    match catch_unwind(CudaContext::device_count) {
        Ok(Ok(n)) => Ok(n.max(0) as usize),
        // A driver without a GPU (e.g. a container with the library mounted): no devices.
        Ok(Err(e)) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => Ok(0),
        Ok(Err(e)) => Err(TensorError::CudaInit {
            ordinal: 0,
            message: format!("cuInit: {e}"),
        }),
        Err(p) => Err(TensorError::CudaInit {
            ordinal: 0,
            message: panic_text(p),
        }),
    }
}

impl CudaBackend {
    /// The backend on GPU `ordinal`: creates a context and a stream, a cuBLAS handle, and
    /// loads the kernels (compiled by NVRTC on the first call in the process).
    ///
    /// Without a CUDA driver this returns [`TensorError::NoCudaDriver`] ("no CUDA driver
    /// found; use --device cpu"), never a panic.
    pub fn new(ordinal: usize) -> std::result::Result<Self, TensorError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(TensorError::NoSuchDevice { ordinal, count });
        }
        let init = || -> std::result::Result<Inner, String> {
            let ctx = CudaContext::new(ordinal).map_err(|e| format!("creating a context: {e}"))?;
            let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
            let stream = ctx
                .new_stream()
                .map_err(|e| format!("creating a stream: {e}"))?;
            let blas = CudaBlas::new(stream.clone())
                .map_err(|e| format!("creating a cuBLAS handle: {e}"))?;
            let kernels = Kernels::load(&ctx)?;
            Ok(Inner {
                ordinal,
                device_name,
                ctx,
                stream,
                blas: Mutex::new(blas),
                kernels,
            })
        };
        let inner = match catch_unwind(AssertUnwindSafe(init)) {
            Ok(Ok(inner)) => inner,
            Ok(Err(message)) => return Err(TensorError::CudaInit { ordinal, message }),
            Err(p) => {
                return Err(TensorError::CudaInit {
                    ordinal,
                    message: panic_text(p),
                });
            }
        };
        Ok(CudaBackend {
            inner: Arc::new(inner),
            storage: DType::F32,
        })
    }

    /// The same backend, asking the model to store parameters and activations as `dtype`.
    pub fn with_storage(mut self, dtype: DType) -> Self {
        self.storage = dtype;
        self
    }

    /// The GPU ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// Waits until all work queued on the backend's stream has finished (for wall-clock
    /// timing of an action).
    pub fn synchronize(&self) -> Result<()> {
        self.inner
            .stream
            .synchronize()
            .map_err(|e| TensorError::Device(format!("synchronize: {e}")))
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// A new uninitialised `f32` buffer (to be fully overwritten by the caller).
    fn alloc_f32(&self, op: &'static str, len: usize) -> Result<CudaSlice<f32>> {
        let s = self.stream();
        let r = if len == 0 {
            s.null()
        } else {
            // SAFETY: every caller overwrites all `len` elements before reading them.
            unsafe { s.alloc::<f32>(len) }
        };
        r.map_err(dev(op))
    }

    /// `f32` values of `buf`: borrowed for `f32` storage, widened into a new buffer for `bf16`.
    fn read<'a>(&self, op: &'static str, buf: &'a CudaBuf) -> Result<F32Ref<'a>> {
        match &buf.0 {
            Storage::F32(s) => Ok(F32Ref::Borrowed(s)),
            Storage::Bf16(s) => Ok(F32Ref::Owned(self.widen(op, s)?)),
        }
    }

    /// Runs `f` on `buf` as an `f32` buffer, rounding back afterwards for `bf16` storage.
    fn write<R>(
        &self,
        op: &'static str,
        buf: &mut CudaBuf,
        f: impl FnOnce(&mut CudaSlice<f32>) -> Result<R>,
    ) -> Result<R> {
        match &mut buf.0 {
            Storage::F32(s) => f(s),
            Storage::Bf16(s) => {
                let mut wide = self.widen(op, s)?;
                let r = f(&mut wide)?;
                self.narrow_into(op, &wide, s)?;
                Ok(r)
            }
        }
    }

    fn widen(&self, op: &'static str, src: &CudaSlice<u16>) -> Result<CudaSlice<f32>> {
        let n = src.len();
        let mut dst = self.alloc_f32(op, n)?;
        if n > 0 {
            let n64 = n as u64;
            launch!(
                self,
                op,
                K::Bf16ToF32,
                kernels::elementwise(n),
                [src, &mut dst, &n64]
            )?;
        }
        Ok(dst)
    }

    fn narrow_into(
        &self,
        op: &'static str,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let n = src.len();
        if n > 0 {
            let n64 = n as u64;
            launch!(
                self,
                op,
                K::F32ToBf16,
                kernels::elementwise(n),
                [src, dst, &n64]
            )?;
        }
        Ok(())
    }

    /// One elementwise launch over `n` elements (no-op for `n = 0`).
    pub(super) fn elementwise_len(n: usize) -> Option<(u64, cudarc::driver::LaunchConfig)> {
        (n > 0).then(|| (n as u64, kernels::elementwise(n)))
    }

    pub(super) fn zeros_slice<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        op: &'static str,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        let s = self.stream();
        if len == 0 {
            s.null()
        } else {
            s.alloc_zeros::<T>(len)
        }
        .map_err(dev(op))
    }

    /// Copies a host array a kernel reads as it is (token ids, targets, positions,
    /// frequencies) to the device.
    fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        op: &'static str,
        host: &[T],
    ) -> Result<CudaSlice<T>> {
        let s = self.stream();
        if host.is_empty() {
            s.null()
        } else {
            s.clone_htod(host)
        }
        .map_err(dev(op))
    }

    fn download<T: cudarc::driver::DeviceRepr>(
        &self,
        op: &'static str,
        src: &CudaSlice<T>,
    ) -> Result<Vec<T>> {
        if src.is_empty() {
            return Ok(Vec::new());
        }
        self.stream().clone_dtoh(src).map_err(dev(op))
    }
}

/// `f32` view of a buffer: the buffer itself, or a widened temporary copy.
enum F32Ref<'a> {
    Borrowed(&'a CudaSlice<f32>),
    Owned(CudaSlice<f32>),
}

impl Deref for F32Ref<'_> {
    type Target = CudaSlice<f32>;

    fn deref(&self) -> &CudaSlice<f32> {
        match self {
            F32Ref::Borrowed(s) => s,
            F32Ref::Owned(s) => s,
        }
    }
}

/// Maps a driver or cuBLAS error to [`TensorError::Device`], naming the operation.
fn dev<E: std::fmt::Display>(op: &'static str) -> impl Fn(E) -> TensorError {
    move |e| TensorError::Device(format!("{op}: {e}"))
}

/// `rows` as a grid dimension (one block per row).
fn grid_rows(op: &'static str, rows: usize) -> Result<u32> {
    u32::try_from(rows)
        .ok()
        .filter(|&r| r <= i32::MAX as u32)
        .ok_or_else(|| TensorError::Invalid {
            op,
            reason: format!("{rows} rows exceed one CUDA grid"),
        })
}

// The tests that need a GPU live in tests/cuda_backend.rs; these run everywhere.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_without_a_driver_is_a_clear_error_not_a_panic() {
        // SAFETY: dlopen probe only.
        let driver = unsafe { cudarc::driver::sys::is_culib_present() };
        match CudaBackend::new(0) {
            Ok(b) => assert!(driver, "a backend without a driver: {b:?}"),
            Err(e) => {
                if !driver {
                    assert_eq!(e, TensorError::NoCudaDriver);
                    assert_eq!(e.to_string(), "no CUDA driver found; use --device cpu");
                }
            }
        }
    }

    #[test]
    fn device_count_without_a_driver_is_an_error() {
        // SAFETY: dlopen probe only.
        if unsafe { !cudarc::driver::sys::is_culib_present() } {
            assert_eq!(device_count(), Err(TensorError::NoCudaDriver));
            let cuda = crate::tensor::device::Device::Cuda { ordinal: 0 };
            assert_eq!(cuda.check_available(), Err(TensorError::NoCudaDriver));
        }
    }

    #[test]
    fn grid_check_names_the_problem() {
        assert_eq!(grid_rows("op", 7).unwrap(), 7);
        assert!(grid_rows("op", 1 << 40).is_err());
    }
}

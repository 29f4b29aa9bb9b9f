//! [`TensorError`]: what can go wrong in a tensor operation or in choosing and opening the
//! device it runs on; the one error of the `tensor` layer.

/// What can go wrong in a tensor operation, or with the device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    // ---- operations (`Backend`)
    /// A buffer's length does not match the shape given to the operation.
    #[error("{op}: operand `{operand}` has {got} elements, expected {expected}")]
    Shape {
        op: &'static str,
        operand: &'static str,
        expected: usize,
        got: usize,
    },
    /// A token id or target is outside the vocabulary.
    #[error("{op}: id {id} at position {position} is out of range (vocabulary {vocab})")]
    IdOutOfRange {
        op: &'static str,
        id: u32,
        position: usize,
        vocab: usize,
    },
    /// A parameter of the operation itself is invalid (zero heads, …).
    #[error("{op}: {reason}")]
    Invalid { op: &'static str, reason: String },
    /// The device failed (allocation, launch, copy); the message comes from the driver.
    #[error("device error: {0}")]
    Device(String),

    // ---- choosing and opening a device (`device`)
    /// The device string does not parse.
    #[error("invalid device `{input}`: {reason} (expected cpu, cpu:THREADS, cuda or cuda:ORDINAL)")]
    DeviceParse { input: String, reason: String },
    /// This binary was built without the `cuda` feature.
    #[error("this build has no CUDA support (rebuild with `--features cuda`); use --device cpu")]
    CudaNotCompiled,
    /// The CUDA driver library (libcuda) cannot be loaded: no GPU driver on this machine.
    #[error("no CUDA driver found; use --device cpu")]
    NoCudaDriver,
    /// The driver is there but a CUDA library the backend needs is not.
    #[error(
        "the CUDA driver is present but the {library} library is not (install the CUDA toolkit libraries); use --device cpu"
    )]
    MissingCudaLibrary { library: &'static str },
    /// The requested ordinal is past the last GPU.
    #[error("cuda:{ordinal} does not exist: {count} CUDA device(s) found")]
    NoSuchDevice { ordinal: usize, count: usize },
    /// The driver refused to initialise the device (driver too old, device busy, …).
    #[error("cannot initialise cuda:{ordinal}: {message}")]
    CudaInit { ordinal: usize, message: String },
}

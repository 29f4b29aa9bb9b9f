//! A cudarc call on the communicator's thread as a [`CommError::Call`]: its error, with
//! NCCL's result code and text where cudarc prints neither, or its panic.

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::comm::CommError;
use crate::tensor::cuda::panic_text;

/// The text of a cudarc error in [`CommError::Call`].
pub(crate) trait CallText {
    fn text(&self) -> String;
}

impl CallText for cudarc::driver::DriverError {
    fn text(&self) -> String {
        format!("{self:?}")
    }
}

/// cudarc's NCCL error prints neither the result code nor NCCL's text for it: both are
/// given here (a caller tells "two ranks on one GPU", `ncclInvalidUsage`, from the rest).
impl CallText for cudarc::nccl::result::NcclError {
    fn text(&self) -> String {
        // SAFETY: ncclGetErrorString takes any result code and returns a static
        // NUL-terminated string, or null, which is checked.
        let said = unsafe { cudarc::nccl::sys::ncclGetErrorString(self.0) };
        let said = match said.is_null() {
            true => "no text".into(),
            false => unsafe { std::ffi::CStr::from_ptr(said) }.to_string_lossy(),
        };
        format!("{:?} ({said})", self.0)
    }
}

/// Runs a cudarc call, turning its error or panic into [`CommError::Call`].
pub(crate) fn call<T, E: CallText>(
    rank: usize,
    op: &'static str,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, CommError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(CommError::Call {
            rank,
            op,
            message: e.text(),
        }),
        Err(p) => Err(CommError::Call {
            rank,
            op,
            message: panic_text(p),
        }),
    }
}

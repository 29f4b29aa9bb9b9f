//! Device selection: which backend a stage computes on, as given on the command line or in a
//! job file (`--device cpu`, `cpu:2`, `cuda`, `cuda:1`), and whether that device can be used
//! here.
//!
//! CUDA is detected at run time (the `cuda` feature loads the driver dynamically), so a binary
//! built with CUDA support still runs on a machine without a GPU: asking for a CUDA device
//! there is a clear [`TensorError`], never a panic.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::tensor::TensorError;

/// A compute device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Device {
    /// The CPU backend on `threads` threads (`cpu` alone is one thread: a pipeline stage
    /// computes on its own thread, see DESIGN.md "Clocks").
    Cpu { threads: usize },
    /// The CUDA GPU with this ordinal (`cuda` alone is ordinal 0).
    Cuda { ordinal: usize },
}

impl Default for Device {
    fn default() -> Self {
        Device::Cpu { threads: 1 }
    }
}

impl Device {
    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda { .. })
    }

    /// Checks that this device can be used here: for the CPU, that a products library
    /// `PIPEFILL_BLAS` names can be used (`tensor/cpu/blas.rs`); for CUDA, that the
    /// feature is compiled in, the driver and libraries load, and the ordinal exists.
    pub fn check_available(&self) -> Result<(), TensorError> {
        match *self {
            Device::Cpu { .. } => super::cpu::check_blas(),
            Device::Cuda { ordinal } => {
                let count = cuda_device_count()?;
                if ordinal < count {
                    Ok(())
                } else {
                    Err(TensorError::NoSuchDevice { ordinal, count })
                }
            }
        }
    }
}

/// Number of CUDA devices on this machine, or why CUDA cannot be used at all.
pub fn cuda_device_count() -> Result<usize, TensorError> {
    #[cfg(feature = "cuda")]
    {
        super::cuda::device_count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(TensorError::CudaNotCompiled)
    }
}

/// A backend that each rank of a single-process job opens for itself: the CPU backend on
/// one thread (the runtime runs the ranks side by side), or GPU `rank mod count` of this
/// machine's, storing parameters and activations in the job's `train.precision`. Code
/// generic over it (the in-process pipeline, the RL loop) runs on either.
pub trait RankBackend: super::Backend + Sized {
    /// Rank `rank`'s backend, storing in `precision`.
    fn for_rank(rank: usize, precision: super::DType) -> Result<Self, super::TensorError>;

    /// The backends of this process's ranks `ranks`, storing in `precision`: by default
    /// [`RankBackend::for_rank`] each; a device whose compute threads the ranks can share
    /// gives them one set of `threads` (`threads` ≤ 1: one thread each).
    fn for_ranks(
        ranks: std::ops::Range<usize>,
        precision: super::DType,
        threads: usize,
    ) -> Result<Vec<Self>, super::TensorError> {
        let _ = threads;
        ranks.map(|rank| Self::for_rank(rank, precision)).collect()
    }
}

impl RankBackend for super::CpuBackend {
    fn for_rank(_rank: usize, precision: super::DType) -> Result<Self, super::TensorError> {
        Ok(super::CpuBackend::new(1)?.with_storage(precision))
    }

    /// One pool of `threads` threads that every rank's operations run in: while a rank
    /// waits in a bubble, the others' products split over its cores instead of leaving
    /// them idle. Products and reductions give the same bits on any number of threads, so
    /// the result is that of one thread per rank.
    fn for_ranks(
        ranks: std::ops::Range<usize>,
        precision: super::DType,
        threads: usize,
    ) -> Result<Vec<Self>, super::TensorError> {
        if threads <= 1 {
            return ranks.map(|rank| Self::for_rank(rank, precision)).collect();
        }
        let shared = super::CpuBackend::new(threads)?.with_storage(precision);
        Ok(ranks.map(|_| shared.clone()).collect())
    }
}

#[cfg(feature = "cuda")]
impl RankBackend for super::cuda::CudaBackend {
    fn for_rank(rank: usize, precision: super::DType) -> Result<Self, super::TensorError> {
        let count = cuda_device_count()?;
        Ok(super::cuda::CudaBackend::new(rank % count.max(1))?.with_storage(precision))
    }
}

/// Work to run on the backend of a device kind, chosen at run time ([`on_backend`]): the
/// one generic method stands for the closure Rust cannot make generic.
pub trait OnBackend {
    type Output;
    fn run<B: RankBackend>(self) -> Self::Output;
}

/// Runs `work` with the CPU backend, or with `cuda` the CUDA one; without the `cuda`
/// feature a GPU is [`TensorError::CudaNotCompiled`].
pub fn on_backend<W: OnBackend>(cuda: bool, work: W) -> Result<W::Output, TensorError> {
    if !cuda {
        return Ok(work.run::<super::CpuBackend>());
    }
    #[cfg(feature = "cuda")]
    {
        Ok(work.run::<super::cuda::CudaBackend>())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(TensorError::CudaNotCompiled)
    }
}

/// One line per device kind saying whether it can be used here (for `pipefill devices`
/// and error messages).
pub fn availability_report() -> String {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cuda = match cuda_device_count() {
        Ok(0) => "cuda: driver present, no device found".to_string(),
        Ok(n) => format!("cuda: {n} device(s) (cuda:0 … cuda:{})", n - 1),
        Err(e) => format!("cuda: unavailable: {e}"),
    };
    format!("cpu: available, {threads} hardware thread(s)\n{cuda}")
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu { threads: 1 } => write!(f, "cpu"),
            Device::Cpu { threads } => write!(f, "cpu:{threads}"),
            Device::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

impl FromStr for Device {
    type Err = TensorError;

    fn from_str(input: &str) -> Result<Self, TensorError> {
        let fail = |reason: String| TensorError::DeviceParse {
            input: input.to_string(),
            reason,
        };
        let text = input.trim().to_ascii_lowercase();
        let (kind, index) = match text.split_once(':') {
            Some((kind, index)) => (kind, Some(index)),
            None => (text.as_str(), None),
        };
        let number = |what: &str| -> Result<Option<usize>, TensorError> {
            match index {
                None => Ok(None),
                Some(s) => s
                    .parse::<usize>()
                    .map(Some)
                    .map_err(|_| fail(format!("{what} `{s}` is not a non-negative integer"))),
            }
        };
        match kind {
            "cpu" => match number("thread count")? {
                None => Ok(Device::Cpu { threads: 1 }),
                Some(0) => Err(fail("the thread count must be at least 1".into())),
                Some(threads) => Ok(Device::Cpu { threads }),
            },
            "cuda" => Ok(Device::Cuda {
                ordinal: number("device ordinal")?.unwrap_or(0),
            }),
            "" => Err(fail("the device kind is empty".into())),
            other => Err(fail(format!("unknown device kind `{other}`"))),
        }
    }
}

impl TryFrom<String> for Device {
    type Error = TensorError;

    fn try_from(s: String) -> Result<Self, TensorError> {
        s.parse()
    }
}

impl From<Device> for String {
    fn from(d: Device) -> String {
        d.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What [`on_backend`] ran: the name of the backend the work opened for rank 0.
    struct BackendName;
    impl OnBackend for BackendName {
        type Output = Result<String, TensorError>;
        fn run<B: RankBackend>(self) -> Self::Output {
            Ok(B::for_rank(0, crate::tensor::DType::F32)?.name())
        }
    }

    #[test]
    fn cpu_ranks_share_the_threads_they_are_given_or_compute_on_one_each() {
        use crate::tensor::{Backend, CpuBackend, DType};
        let shared = CpuBackend::for_ranks(4..7, DType::Bf16, 2).unwrap();
        assert_eq!(shared.len(), 3);
        for be in &shared {
            assert_eq!((be.threads(), be.storage_dtype()), (2, DType::Bf16));
        }
        let alone = CpuBackend::for_ranks(0..2, DType::F32, 1).unwrap();
        assert!(alone.iter().all(|be| be.threads() == 1), "{alone:?}");
    }

    #[test]
    fn on_backend_runs_the_cpu_backend_or_the_gpu_one_where_it_exists() {
        let cpu = on_backend(false, BackendName).unwrap().unwrap();
        assert!(cpu.starts_with("cpu"), "{cpu}");
        let gpu = on_backend(true, BackendName);
        if cfg!(feature = "cuda") {
            // Compiled in: the work runs on the CUDA backend, which opens cuda:0, or fails
            // to only where this machine has no usable GPU.
            match gpu.expect("with the cuda feature the work runs") {
                Ok(name) => assert!(name.starts_with("cuda:0"), "{name}"),
                Err(e) => assert!(cuda_device_count().map_or(true, |n| n == 0), "{e}"),
            }
        } else {
            assert_eq!(gpu.unwrap_err(), TensorError::CudaNotCompiled);
        }
    }

    #[test]
    fn parses_every_documented_form() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu { threads: 1 });
        assert_eq!(
            "cpu:2".parse::<Device>().unwrap(),
            Device::Cpu { threads: 2 }
        );
        assert_eq!(
            "cuda".parse::<Device>().unwrap(),
            Device::Cuda { ordinal: 0 }
        );
        assert_eq!(
            "cuda:1".parse::<Device>().unwrap(),
            Device::Cuda { ordinal: 1 }
        );
        assert_eq!(
            " CUDA:3 ".parse::<Device>().unwrap(),
            Device::Cuda { ordinal: 3 }
        );
    }

    #[test]
    fn display_round_trips() {
        for d in [
            Device::Cpu { threads: 1 },
            Device::Cpu { threads: 4 },
            Device::Cuda { ordinal: 0 },
            Device::Cuda { ordinal: 7 },
        ] {
            assert_eq!(d.to_string().parse::<Device>().unwrap(), d);
        }
        assert_eq!(Device::Cpu { threads: 1 }.to_string(), "cpu");
        assert_eq!(Device::Cuda { ordinal: 0 }.to_string(), "cuda:0");
    }

    #[test]
    fn rejects_bad_strings_with_a_reason() {
        for (input, needle) in [
            ("gpu", "unknown device kind `gpu`"),
            ("cpu:0", "at least 1"),
            ("cpu:two", "`two` is not a non-negative integer"),
            ("cuda:", "`` is not a non-negative integer"),
            ("cuda:-1", "`-1`"),
            ("cuda:1:2", "`1:2`"),
            ("", "empty"),
        ] {
            let err = input.parse::<Device>().unwrap_err();
            let text = err.to_string();
            assert!(
                matches!(err, TensorError::DeviceParse { .. }),
                "{input}: {err:?}"
            );
            assert!(text.contains(needle), "{input}: `{text}` lacks `{needle}`");
            assert!(
                text.contains(&format!("`{input}`")),
                "{input}: `{text}` does not name it"
            );
        }
    }

    #[test]
    fn serde_uses_the_string_form() {
        #[derive(Debug, Serialize, Deserialize)]
        struct Job {
            device: Device,
        }
        let job: Job = toml::from_str("device = \"cuda:2\"").unwrap();
        assert_eq!(job.device, Device::Cuda { ordinal: 2 });
        assert_eq!(toml::to_string(&job).unwrap().trim(), "device = \"cuda:2\"");
        let bad = toml::from_str::<Job>("device = \"tpu\"")
            .unwrap_err()
            .to_string();
        assert!(bad.contains("unknown device kind `tpu`"), "{bad}");
    }

    #[test]
    fn cpu_is_always_available() {
        assert_eq!(Device::Cpu { threads: 3 }.check_available(), Ok(()));
        assert!(availability_report().starts_with("cpu: available"));
    }

    #[test]
    fn cuda_availability_is_an_error_not_a_panic_without_a_driver() {
        // On a machine with a working GPU this is Ok; everywhere else it must be a clear
        // error naming the way out (or the missing feature).
        match (Device::Cuda { ordinal: 0 }).check_available() {
            Ok(()) => {}
            Err(e) => {
                let text = e.to_string();
                assert!(
                    text.contains("--device cpu") || matches!(e, TensorError::NoSuchDevice { .. }),
                    "{text}"
                );
            }
        }
        #[cfg(not(feature = "cuda"))]
        assert_eq!(
            (Device::Cuda { ordinal: 0 }).check_available(),
            Err(TensorError::CudaNotCompiled)
        );
    }
}

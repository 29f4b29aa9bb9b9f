//! Which transport a multi-process run's ranks talk over: TCP or NCCL.
//!
//! The job's `transport` value ([`TransportKind`]: `"auto"`, `"tcp"` or `"nccl"`; set in
//! the job file or with `--set transport=...`) meets the device the ranks compute on:
//! - `auto`: NCCL when the ranks compute on a CUDA GPU and NCCL can be used there, TCP
//!   otherwise (a CUDA run without libnccl falls back to TCP, with a logged warning);
//! - `tcp`: always TCP (the mesh of `comm::tcp`);
//! - `nccl`: NCCL, or one clear error saying what is missing (a CPU run, a build without
//!   the `cuda` feature, no driver, no libnccl, no such GPU) instead of a silent fallback.
//!
//! The decision ([`decide`]) is separate from probing the machine, so its rules are tested
//! on any machine; [`select_transport`] probes for real (never panicking without a GPU:
//! the probe dlopens the libraries before any other cudarc call).

use serde::{Deserialize, Serialize};

use super::tcp_transport::GroupError;
use crate::tensor::device::{Device, DeviceError};

/// The `transport` a job asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// NCCL on CUDA GPUs where it can be used, TCP otherwise.
    #[default]
    Auto,
    /// TCP between processes, whatever the device.
    Tcp,
    /// NCCL between GPUs; an error where it cannot be used.
    Nccl,
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::Auto => "auto",
            TransportKind::Tcp => "tcp",
            TransportKind::Nccl => "nccl",
        })
    }
}

/// The transport a run uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selected {
    Tcp,
    /// NCCL between the ranks' GPUs; this rank's is `ordinal`.
    Nccl {
        ordinal: usize,
    },
}

/// Why a run's transport cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// NCCL asked for, but the ranks do not compute on a GPU.
    #[error(
        "transport = \"nccl\" needs the ranks to compute on a CUDA GPU, but this run computes on {device}; use transport = \"tcp\" or \"auto\""
    )]
    NcclNeedsCudaDevice { device: Device },
    /// NCCL asked for on a GPU, but CUDA or NCCL cannot be used here.
    #[error("transport = \"nccl\" cannot be used on {device}: {reason}")]
    NcclUnavailable { device: Device, reason: DeviceError },
    /// A transport over a range of mesh ranks that is wrong.
    #[error(transparent)]
    Group(#[from] GroupError),
    /// Setting up NCCL failed (the id exchange or a communicator).
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Nccl(#[from] super::nccl::NcclError),
}

/// The rules: `nccl_ready(ordinal)` says whether NCCL can be used on that GPU.
pub fn decide(
    requested: TransportKind,
    device: Device,
    nccl_ready: impl FnOnce(usize) -> Result<(), DeviceError>,
) -> Result<Selected, TransportError> {
    match (requested, device) {
        (TransportKind::Tcp, _) | (TransportKind::Auto, Device::Cpu { .. }) => Ok(Selected::Tcp),
        (TransportKind::Nccl, Device::Cpu { .. }) => {
            Err(TransportError::NcclNeedsCudaDevice { device })
        }
        (TransportKind::Auto, Device::Cuda { ordinal }) => match nccl_ready(ordinal) {
            Ok(()) => Ok(Selected::Nccl { ordinal }),
            Err(reason) => {
                tracing::warn!("{device}: NCCL cannot be used ({reason}); using TCP");
                Ok(Selected::Tcp)
            }
        },
        (TransportKind::Nccl, Device::Cuda { ordinal }) => match nccl_ready(ordinal) {
            Ok(()) => Ok(Selected::Nccl { ordinal }),
            Err(reason) => Err(TransportError::NcclUnavailable { device, reason }),
        },
    }
}

/// Whether NCCL can be used on GPU `ordinal` of this machine (probing dlopens only).
pub fn nccl_ready(ordinal: usize) -> Result<(), DeviceError> {
    #[cfg(feature = "cuda")]
    {
        if let Err(e) = super::nccl::probe() {
            return Err(match e {
                super::nccl::NcclError::Device(d) => d,
                other => DeviceError::CudaInit {
                    ordinal,
                    message: other.to_string(),
                },
            });
        }
        Device::Cuda { ordinal }.check_available()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(DeviceError::CudaNotCompiled)
    }
}

/// The transport of a run whose ranks compute on `device`, as the job asked.
pub fn select_transport(
    requested: TransportKind,
    device: Device,
) -> Result<Selected, TransportError> {
    decide(requested, device, nccl_ready)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPU: Device = Device::Cpu { threads: 1 };
    const GPU1: Device = Device::Cuda { ordinal: 1 };

    fn ready(_: usize) -> Result<(), DeviceError> {
        Ok(())
    }

    fn no_driver(_: usize) -> Result<(), DeviceError> {
        Err(DeviceError::NoCudaDriver)
    }

    #[test]
    fn auto_picks_nccl_only_on_a_gpu_where_it_can_be_used() {
        assert_eq!(
            decide(TransportKind::Auto, GPU1, ready).unwrap(),
            Selected::Nccl { ordinal: 1 }
        );
        assert_eq!(
            decide(TransportKind::Auto, GPU1, no_driver).unwrap(),
            Selected::Tcp
        );
        assert_eq!(
            decide(TransportKind::Auto, CPU, |_| unreachable!()).unwrap(),
            Selected::Tcp
        );
    }

    #[test]
    fn tcp_is_tcp_whatever_the_device() {
        for device in [CPU, GPU1] {
            assert_eq!(
                decide(TransportKind::Tcp, device, |_| unreachable!()).unwrap(),
                Selected::Tcp
            );
        }
    }

    #[test]
    fn nccl_without_cuda_is_one_clear_error() {
        let err = decide(TransportKind::Nccl, CPU, |_| unreachable!()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "transport = \"nccl\" needs the ranks to compute on a CUDA GPU, but this run computes on cpu; use transport = \"tcp\" or \"auto\""
        );
        let err = decide(TransportKind::Nccl, GPU1, no_driver).unwrap_err();
        assert_eq!(
            err.to_string(),
            "transport = \"nccl\" cannot be used on cuda:1: no CUDA driver found; use --device cpu"
        );
        let err = decide(TransportKind::Nccl, GPU1, |_| {
            Err(DeviceError::CudaNotCompiled)
        })
        .unwrap_err();
        assert!(err.to_string().contains("--features cuda"), "{err}");
        assert_eq!(
            decide(TransportKind::Nccl, GPU1, ready).unwrap(),
            Selected::Nccl { ordinal: 1 }
        );
    }

    #[test]
    fn this_machine_s_probe_agrees_with_the_rules() {
        // Whatever this machine has, a CPU run is TCP and the probe never panics.
        assert_eq!(
            select_transport(TransportKind::Auto, CPU).unwrap(),
            Selected::Tcp
        );
        let gpu = Device::Cuda { ordinal: 0 };
        match nccl_ready(0) {
            Ok(()) => assert_eq!(
                select_transport(TransportKind::Nccl, gpu).unwrap(),
                Selected::Nccl { ordinal: 0 }
            ),
            Err(reason) => {
                let err = select_transport(TransportKind::Nccl, gpu).unwrap_err();
                assert!(err.to_string().ends_with(&reason.to_string()), "{err}");
                assert_eq!(
                    select_transport(TransportKind::Auto, gpu).unwrap(),
                    Selected::Tcp
                );
            }
        }
        #[cfg(not(feature = "cuda"))]
        assert_eq!(nccl_ready(0), Err(DeviceError::CudaNotCompiled));
    }

    #[test]
    fn the_job_value_parses_from_lowercase_names() {
        #[derive(Deserialize)]
        struct Job {
            transport: TransportKind,
        }
        for (text, kind) in [
            ("auto", TransportKind::Auto),
            ("tcp", TransportKind::Tcp),
            ("nccl", TransportKind::Nccl),
        ] {
            let job: Job = toml::from_str(&format!("transport = \"{text}\"")).unwrap();
            assert_eq!(job.transport, kind);
            assert_eq!(kind.to_string(), text);
        }
        let err = toml::from_str::<Job>("transport = \"mpi\"").err().unwrap();
        assert!(err.to_string().contains("unknown variant"), "{err}");
    }
}

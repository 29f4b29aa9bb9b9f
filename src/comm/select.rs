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
//!
//! Every rank decides for itself, but a transport only works when every rank uses it:
//! NCCL's communicators wait for all their members, so one rank on TCP (or one that failed
//! to set up its GPU) would leave the others waiting forever. The ranks of a GPU run
//! therefore send their own [`Choice`] to rank 0, which settles the run's transport with
//! [`agree`]: any rank's failure fails every rank, naming it; NCCL only where every rank
//! can use it.

use serde::{Deserialize, Serialize};

use super::frame;
use super::link::{Channel, PeerLink};
use crate::comm::CommError;
use crate::tensor::TensorError;
use crate::tensor::device::Device;

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

/// Channel of the ranks' [`Choice`]s and rank 0's verdict ([`settle`]).
pub const TRANSPORT_CHANNEL: Channel = u32::MAX - 9;

/// The rules: `nccl_ready(ordinal)` says whether NCCL can be used on that GPU.
pub fn decide(
    requested: TransportKind,
    device: Device,
    nccl_ready: impl FnOnce(usize) -> Result<(), TensorError>,
) -> Result<Selected, CommError> {
    match (requested, device) {
        (TransportKind::Tcp, _) | (TransportKind::Auto, Device::Cpu { .. }) => Ok(Selected::Tcp),
        (TransportKind::Nccl, Device::Cpu { .. }) => Err(CommError::NcclNeedsCudaDevice { device }),
        (TransportKind::Auto, Device::Cuda { ordinal }) => match nccl_ready(ordinal) {
            Ok(()) => Ok(Selected::Nccl { ordinal }),
            Err(reason) => {
                tracing::warn!("{device}: NCCL cannot be used ({reason}); using TCP");
                Ok(Selected::Tcp)
            }
        },
        (TransportKind::Nccl, Device::Cuda { ordinal }) => match nccl_ready(ordinal) {
            Ok(()) => Ok(Selected::Nccl { ordinal }),
            Err(reason) => Err(CommError::NcclUnavailable { device, reason }),
        },
    }
}

/// Whether NCCL can be used on GPU `ordinal` of this machine (probing dlopens only).
pub fn nccl_ready(ordinal: usize) -> Result<(), TensorError> {
    #[cfg(feature = "cuda")]
    {
        if let Err(e) = super::nccl::probe() {
            return Err(match e {
                CommError::Device(d) => d,
                other => TensorError::CudaInit {
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
        Err(TensorError::CudaNotCompiled)
    }
}

/// The transport of a run whose ranks compute on `device`, as the job asked.
pub fn select_transport(requested: TransportKind, device: Device) -> Result<Selected, CommError> {
    decide(requested, device, nccl_ready)
}

/// One rank's own outcome, sent to rank 0 so that every rank uses the same transport.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Choice {
    Tcp,
    Nccl,
    /// This rank cannot compute or communicate as the job asks (the reason, as text).
    Failed(String),
}

impl From<&Result<Selected, CommError>> for Choice {
    fn from(own: &Result<Selected, CommError>) -> Self {
        match own {
            Ok(Selected::Tcp) => Choice::Tcp,
            Ok(Selected::Nccl { .. }) => Choice::Nccl,
            Err(e) => Choice::Failed(e.to_string()),
        }
    }
}

/// The run's transport from every rank's [`Choice`] (index = rank): the first failed
/// rank fails the run; otherwise NCCL when every rank can use it, TCP when any cannot
/// (only `auto` leaves a rank on TCP while others could use NCCL: `nccl` fails instead).
pub fn agree(choices: &[Choice]) -> Result<Choice, CommError> {
    if let Some((rank, reason)) = choices.iter().enumerate().find_map(|(r, c)| match c {
        Choice::Failed(reason) => Some((r, reason)),
        _ => None,
    }) {
        return Err(CommError::OtherRank {
            rank,
            reason: reason.clone(),
        });
    }
    let tcp: Vec<usize> = (0..choices.len())
        .filter(|&r| choices[r] == Choice::Tcp)
        .collect();
    if tcp.is_empty() && !choices.is_empty() {
        return Ok(Choice::Nccl);
    }
    if tcp.len() < choices.len() {
        tracing::warn!("ranks {tcp:?} cannot use NCCL: every rank uses TCP");
    }
    Ok(Choice::Tcp)
}

/// Rank 0's answer on the wire: the agreed choice, or the failed rank and its reason.
type Verdict = Result<Choice, (usize, String)>;

/// The transport every rank of `link` uses: each sends its own choice to rank 0, which
/// [`agree`]s and answers every rank. All ranks call it at the same point, before any of
/// them creates a communicator.
pub fn settle(link: &dyn PeerLink, own: Choice) -> Result<Choice, CommError> {
    let broken = |reason: String| CommError::Agreement { reason };
    if link.rank() != 0 {
        let bytes = frame::encode(&own).map_err(|e| broken(e.to_string()))?;
        link.send(0, TRANSPORT_CHANNEL, &bytes)
            .map_err(|e| broken(e.to_string()))?;
        let bytes = link
            .recv(0, TRANSPORT_CHANNEL)
            .map_err(|e| broken(e.to_string()))?;
        let verdict: Verdict =
            frame::decode(&bytes).map_err(|e| broken(format!("rank 0's verdict: {e}")))?;
        return verdict.map_err(|(rank, reason)| CommError::OtherRank { rank, reason });
    }
    let mut choices = vec![own];
    for from in 1..link.world() {
        let bytes = link
            .recv(from, TRANSPORT_CHANNEL)
            .map_err(|e| broken(e.to_string()))?;
        choices
            .push(frame::decode(&bytes).map_err(|e| broken(format!("rank {from}'s choice: {e}")))?);
    }
    let agreed = agree(&choices);
    let verdict: Verdict = match &agreed {
        Ok(choice) => Ok(choice.clone()),
        Err(CommError::OtherRank { rank, reason }) => Err((*rank, reason.clone())),
        Err(other) => Err((0, other.to_string())),
    };
    let bytes = frame::encode(&verdict).map_err(|e| broken(e.to_string()))?;
    for peer in 1..link.world() {
        link.send(peer, TRANSPORT_CHANNEL, &bytes)
            .map_err(|e| broken(e.to_string()))?;
    }
    agreed
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPU: Device = Device::Cpu { threads: 1 };
    const GPU1: Device = Device::Cuda { ordinal: 1 };

    fn ready(_: usize) -> Result<(), TensorError> {
        Ok(())
    }

    fn no_driver(_: usize) -> Result<(), TensorError> {
        Err(TensorError::NoCudaDriver)
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
            Err(TensorError::CudaNotCompiled)
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
        assert_eq!(nccl_ready(0), Err(TensorError::CudaNotCompiled));
    }

    #[test]
    fn every_rank_uses_nccl_or_none_does() {
        use Choice::{Failed, Nccl, Tcp};
        assert_eq!(agree(&[Nccl, Nccl, Nccl]).unwrap(), Nccl);
        assert_eq!(agree(&[Tcp, Tcp]).unwrap(), Tcp);
        // One rank without NCCL (auto fell back there) puts every rank on TCP.
        assert_eq!(agree(&[Nccl, Tcp, Nccl]).unwrap(), Tcp);
        assert_eq!(agree(&[]).unwrap(), Tcp);
        // A failed rank fails the run, named, even when the others agree.
        let err = agree(&[
            Nccl,
            Nccl,
            Failed("no CUDA driver found".into()),
            Failed("x".into()),
        ])
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "rank 2 cannot set up its device or transport: no CUDA driver found"
        );
    }

    #[test]
    fn the_ranks_settle_on_one_transport() {
        use crate::comm::link::InProcessLink;
        let run = |choices: Vec<Choice>| -> Vec<Result<Choice, String>> {
            let links = InProcessLink::group(choices.len());
            let handles: Vec<_> = links
                .into_iter()
                .zip(choices)
                .map(|(link, own)| {
                    std::thread::spawn(move || settle(&link, own).map_err(|e| e.to_string()))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        };
        assert_eq!(
            run(vec![Choice::Nccl, Choice::Nccl, Choice::Nccl]),
            vec![Ok(Choice::Nccl); 3]
        );
        assert_eq!(
            run(vec![Choice::Nccl, Choice::Tcp]),
            vec![Ok(Choice::Tcp); 2]
        );
        // Rank 1 failed: every rank (rank 0 included) fails naming it.
        let failed = run(vec![
            Choice::Nccl,
            Choice::Failed("cuda:1 does not exist".into()),
            Choice::Nccl,
        ]);
        let text = "rank 1 cannot set up its device or transport: cuda:1 does not exist";
        assert_eq!(failed, vec![Err(text.to_string()); 3]);
        assert_eq!(run(vec![Choice::Tcp]), vec![Ok(Choice::Tcp)]);
    }

    #[test]
    fn a_rank_s_own_outcome_becomes_its_choice() {
        assert_eq!(Choice::from(&Ok(Selected::Tcp)), Choice::Tcp);
        assert_eq!(
            Choice::from(&Ok(Selected::Nccl { ordinal: 3 })),
            Choice::Nccl
        );
        let failed = decide(TransportKind::Nccl, CPU, |_| unreachable!());
        let Choice::Failed(reason) = Choice::from(&failed) else {
            panic!("{failed:?} is not a failure");
        };
        assert!(
            reason.contains("needs the ranks to compute on a CUDA GPU"),
            "{reason}"
        );
        // The wire form round-trips (it travels to rank 0 on the mesh).
        let bytes = crate::comm::frame::encode(&Choice::Failed(reason.clone())).unwrap();
        let back: Choice = crate::comm::frame::decode(&bytes).unwrap();
        assert_eq!(back, Choice::Failed(reason));
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

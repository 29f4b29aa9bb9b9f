//! NCCL unique ids (feature `cuda`): how the ranks of one communicator meet.
//!
//! The id exchange ([`share_id`]): NCCL ranks meet through a 128-byte unique id that one
//! member creates. It travels as a rendezvous message ([`Rendezvous::NcclId`], the same
//! bincode enum as the address table, fuzzed with it) over the job's [`PeerLink`] (the
//! TCP mesh the rendezvous on rank 0 set up), on a channel of its own, from the group's
//! first member to the others. Rank 0's rendezvous itself does not create the ids: it
//! knows neither the groups (dp × pp) nor whether the ranks use NCCL, and a leader per
//! group keeps that knowledge where it is. A leader that cannot create an id sends
//! [`Rendezvous::NcclIdFailed`] instead, failing every member with its reason rather than
//! leaving them waiting.
//!
//! The channels every NCCL user of the mesh takes are listed here, in one place.

use cudarc::nccl::Id;

use super::frame;
use super::link::{Channel, PeerLink};
use super::nccl::{call, probe};
use super::rendezvous::Rendezvous;
use crate::comm::CommError;

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const NCCL_ID_BYTES: usize = 128;

/// The [`PeerLink`] channel the data-parallel groups' ids travel on. Groups with
/// different leaders may share it. NCCL's channels sit below those of `tcp_transport`
/// (`u32::MAX - 1..=3`) and of `launch::profile` (`u32::MAX - 4..=7`).
pub const NCCL_ID_CHANNEL: Channel = u32::MAX - 16;

/// The channel the stage-link communicators' ids travel on (`nccl_transport`).
pub const NCCL_LINK_ID_CHANNEL: Channel = u32::MAX - 17;

/// The channel of the stage-link transport's headers (`nccl_transport`).
pub const NCCL_HEADER_CHANNEL: Channel = u32::MAX - 18;

/// An NCCL unique id: the rendezvous token of one communicator.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; NCCL_ID_BYTES]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The first bytes identify it in logs; the rest is noise.
        write!(f, "NcclId({:02x?}…)", &self.0[..8])
    }
}

impl NcclId {
    /// A fresh id from libnccl (after the [`probe`]).
    pub fn create() -> Result<Self, CommError> {
        probe()?;
        let id = call(0, "ncclGetUniqueId", Id::new)?;
        // `c_char` is `i8` or `u8` by platform; the bits are what travels.
        Ok(NcclId(id.internal().map(|c| c as u8)))
    }

    /// The id in `bytes`, which must be exactly [`NCCL_ID_BYTES`] long.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(NcclId)
    }

    pub fn as_bytes(&self) -> &[u8; NCCL_ID_BYTES] {
        &self.0
    }

    pub(super) fn to_cudarc(self) -> Id {
        Id::uninit(self.0.map(|b| b as std::ffi::c_char))
    }
}

/// Gives every member of `group` (global ranks; the first is the leader) the same id: the
/// leader runs `create` and sends the outcome to the others on `channel` of `link`.
/// Communicators whose groups share a leader must use different channels.
pub fn share_id(
    link: &dyn PeerLink,
    group: &[usize],
    channel: Channel,
    create: impl FnOnce() -> Result<NcclId, CommError>,
) -> Result<NcclId, CommError> {
    let rank = link.rank();
    let not_member = || CommError::NotNcclMember {
        rank,
        group: group.to_vec(),
    };
    let &leader = group.first().ok_or_else(not_member)?;
    if !group.contains(&rank) {
        return Err(not_member());
    }
    if rank == leader {
        let made = create();
        let message = match &made {
            Ok(id) => Rendezvous::NcclId {
                id: id.as_bytes().to_vec(),
            },
            Err(e) => Rendezvous::NcclIdFailed {
                reason: e.to_string(),
            },
        };
        let frame = frame::encode(&message).map_err(|e| CommError::BadId {
            from: leader,
            reason: e.to_string(),
        })?;
        for &peer in group.iter().filter(|&&r| r != leader) {
            link.send(peer, channel, &frame)?;
        }
        return made;
    }
    id_from_frame(leader, &link.recv(leader, channel)?)
}

/// The id in a leader's frame, or why there is none.
pub fn id_from_frame(leader: usize, frame: &[u8]) -> Result<NcclId, CommError> {
    let bad = |reason: String| CommError::BadId {
        from: leader,
        reason,
    };
    match frame::decode::<Rendezvous>(frame).map_err(|e| bad(e.to_string()))? {
        Rendezvous::NcclId { id } => NcclId::from_bytes(&id)
            .ok_or_else(|| bad(format!("{} bytes, expected {NCCL_ID_BYTES}", id.len()))),
        Rendezvous::NcclIdFailed { reason } => Err(CommError::LeaderFailed { leader, reason }),
        other => Err(bad(format!("{} instead of an id", other.kind()))),
    }
}

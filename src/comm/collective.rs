//! Collectives over a [`PeerLink`]: the ring all-reduce that sums the gradients of one
//! pipeline stage across its data-parallel replicas, and [`all_gather`] of small frames
//! (the measured costs a launched `schedule = "auto"` job plans from).
//!
//! [`all_reduce_sum`] is the bandwidth-optimal ring (reduce-scatter, then all-gather): the
//! buffer is cut into one chunk per member; in `n − 1` rounds each member passes one chunk to
//! its successor, which adds its own values to it, so each chunk ends fully summed on exactly
//! one member; `n − 1` more rounds pass the summed chunks around. Every member therefore
//! holds bitwise the same result, whatever the timing: each chunk is summed once, in a fixed
//! order (starting at the member after its owner and going round the ring). That order is
//! not rank order, so the sum can differ from a left-to-right sum in the last bits; it is
//! the same on every replica, which is what keeps replicas' parameters identical.
//!
//! Frames are the chunk's `f32` values, little-endian. A collective uses one channel;
//! collectives of disjoint groups may share it (their (sender, receiver) pairs differ).

use super::link::{Channel, PeerLink};
use crate::comm::CommError;

/// The `n` chunk ranges of a buffer of `len` values: sizes differ by at most one, the
/// longer ones first, so every member computes the same cut.
fn chunk_ranges(len: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    let (base, extra) = (len / n, len % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let size = base + usize::from(i < extra);
            let range = start..start + size;
            start += size;
            range
        })
        .collect()
}

fn encode(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Receives chunk `range` from `peer` and hands each value to `apply(own, received)`.
fn recv_chunk(
    link: &dyn PeerLink,
    peer: usize,
    channel: Channel,
    own: &mut [f32],
    apply: impl Fn(&mut f32, f32),
) -> Result<(), CommError> {
    let frame = link.recv(peer, channel)?;
    if frame.len() != own.len() * 4 {
        return Err(CommError::Length {
            peer,
            channel,
            expected: own.len() * 4,
            got: frame.len(),
            values: own.len(),
        });
    }
    for (o, bytes) in own.iter_mut().zip(frame.chunks_exact(4)) {
        apply(
            o,
            f32::from_le_bytes(bytes.try_into().expect("chunks of 4")),
        );
    }
    Ok(())
}

/// This rank's position in `group`, which must hold it once and no rank twice.
fn position(link: &dyn PeerLink, group: &[usize]) -> Result<usize, CommError> {
    let me = link.rank();
    let pos = group
        .iter()
        .position(|&r| r == me)
        .ok_or_else(|| CommError::NotMember {
            rank: me,
            group: group.to_vec(),
        })?;
    if let Some(&dup) = group
        .iter()
        .enumerate()
        .find_map(|(i, r)| group[..i].contains(r).then_some(r))
    {
        return Err(CommError::Duplicate {
            rank: dup,
            group: group.to_vec(),
        });
    }
    Ok(pos)
}

/// Every member's `frame`, in group order, on every member of `group` (this rank's own
/// included, as given). Each member sends its frame to every other member, then reads one
/// from each in group order; the frames are meant to be small (a few measured figures), so
/// sending everything before reading cannot fill a link. Every member must call it with the
/// same group and channel.
pub fn all_gather(
    link: &dyn PeerLink,
    group: &[usize],
    channel: Channel,
    frame: &[u8],
) -> Result<Vec<Vec<u8>>, CommError> {
    let pos = position(link, group)?;
    for (i, &peer) in group.iter().enumerate() {
        if i != pos {
            link.send(peer, channel, frame)?;
        }
    }
    group
        .iter()
        .enumerate()
        .map(|(i, &peer)| {
            if i == pos {
                Ok(frame.to_vec())
            } else {
                Ok(link.recv(peer, channel)?)
            }
        })
        .collect()
}

/// Every member's `frame` on the first member of `group`, in group order (its own left
/// empty: it has it); the others send theirs and get `None`. Every member must call it
/// with the same group and channel.
pub fn gather_to_first(
    link: &dyn PeerLink,
    group: &[usize],
    channel: Channel,
    frame: &[u8],
) -> Result<Option<Vec<Vec<u8>>>, CommError> {
    let pos = position(link, group)?;
    if pos != 0 {
        link.send(group[0], channel, frame)?;
        return Ok(None);
    }
    let mut frames = vec![Vec::new()];
    for &peer in &group[1..] {
        frames.push(link.recv(peer, channel)?);
    }
    Ok(Some(frames))
}

/// Sums `buf` element-wise over the members of `group` (global ranks, in ring order; this
/// rank must be one of them), leaving the sum in every member's `buf`, bitwise the same on
/// all. Every member must call it with the same group, channel and buffer length.
/// It is [`reduce_scatter_sum`] then [`all_gather_chunks`]: the sharded optimizer's
/// reduce-scatter gives its chunk the same bits as this all-reduce does.
pub fn all_reduce_sum(
    link: &dyn PeerLink,
    group: &[usize],
    channel: Channel,
    buf: &mut [f32],
) -> Result<(), CommError> {
    reduce_scatter_sum(link, group, channel, buf)?;
    all_gather_chunks(link, group, channel, buf)
}

/// The chunk of a buffer of `len` values that the member at `pos` of a group of `n` owns
/// after [`reduce_scatter_sum`]: the same cut on every member.
pub fn owned_chunk(len: usize, n: usize, pos: usize) -> std::ops::Range<usize> {
    chunk_ranges(len, n)[(pos + 1) % n].clone()
}

/// The first half of the ring all-reduce: sums `buf` over `group` so that this member's
/// chunk ([`owned_chunk`] of its position, returned) holds the sum over every member; the
/// rest of `buf` holds partial sums. Every member must call it with the same group,
/// channel and buffer length.
pub fn reduce_scatter_sum(
    link: &dyn PeerLink,
    group: &[usize],
    channel: Channel,
    buf: &mut [f32],
) -> Result<std::ops::Range<usize>, CommError> {
    let pos = position(link, group)?;
    let n = group.len();
    let chunks = chunk_ranges(buf.len(), n);
    if n == 1 {
        return Ok(0..buf.len());
    }
    let next = group[(pos + 1) % n];
    let prev = group[(pos + n - 1) % n];
    // In round s this member sends chunk (pos − s) and adds its own values to chunk
    // (pos − s − 1) received from its predecessor. After n − 1 rounds chunk (pos + 1)
    // holds the sum over every member.
    for s in 0..n - 1 {
        let send = chunks[(pos + n - s) % n].clone();
        link.send(next, channel, &encode(&buf[send]))?;
        let recv = chunks[(pos + 2 * n - s - 1) % n].clone();
        // received + own: the partial sum travels round the ring and each member adds its
        // own term to its right, a fixed order independent of timing.
        recv_chunk(link, prev, channel, &mut buf[recv], |o, r| *o += r)?;
    }
    Ok(chunks[(pos + 1) % n].clone())
}

/// The second half of the ring all-reduce: each member's chunk ([`owned_chunk`]) of
/// `buf` goes round the ring, so every member ends with every member's chunk (what it held
/// elsewhere is overwritten). Every member must call it with the same group, channel and
/// buffer length.
pub fn all_gather_chunks(
    link: &dyn PeerLink,
    group: &[usize],
    channel: Channel,
    buf: &mut [f32],
) -> Result<(), CommError> {
    let pos = position(link, group)?;
    let n = group.len();
    if n == 1 {
        return Ok(());
    }
    let next = group[(pos + 1) % n];
    let prev = group[(pos + n - 1) % n];
    let chunks = chunk_ranges(buf.len(), n);
    for s in 0..n - 1 {
        let send = chunks[(pos + 1 + n - s) % n].clone();
        link.send(next, channel, &encode(&buf[send]))?;
        let recv = chunks[(pos + n - s) % n].clone();
        recv_chunk(link, prev, channel, &mut buf[recv], |o, r| *o = r)?;
    }
    Ok(())
}

/// Sums one pipeline rank's gradients with those of the same rank in the other
/// data-parallel replicas (the same stages), in place, before the optimizer step; every
/// replica ends with bitwise the same sum. The pipelined trainer calls it once per step and
/// rank with all of the rank's gradients concatenated in model order.
pub trait GradSync: Send + Sync + std::fmt::Debug {
    /// `rank` is the caller's rank within its pipeline (`0..pp`).
    fn all_reduce(&self, rank: usize, grads: &mut [f32]) -> Result<(), CommError>;

    /// The sharded optimizer's reduce-scatter (ZeRO-1): sums `grads` over the replicas so
    /// that the returned range, this replica's chunk, holds bitwise what
    /// [`GradSync::all_reduce`] would leave there; the rest holds partial sums.
    fn reduce_scatter(
        &self,
        rank: usize,
        grads: &mut [f32],
    ) -> Result<std::ops::Range<usize>, CommError> {
        let _ = (rank, grads);
        Err(self.unsupported("the reduce-scatter"))
    }

    /// The chunk of a buffer of `len` values this replica owns: the range
    /// [`GradSync::reduce_scatter`] sums for it.
    fn owned(&self, rank: usize, len: usize) -> Result<std::ops::Range<usize>, CommError> {
        let _ = (rank, len);
        Err(self.unsupported("the sharded optimizer's chunk"))
    }

    /// The sharded optimizer's all-gather: every replica's chunk of `buf` (the range
    /// [`GradSync::reduce_scatter`] returned to it) to every replica.
    fn all_gather(&self, rank: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let _ = (rank, buf);
        Err(self.unsupported("the all-gather"))
    }

    /// Every replica's `frame`, indexed by the chunk that replica owns (chunk `c` of
    /// [`chunk_cut`]).
    fn gather_by_chunk(&self, rank: usize, frame: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let _ = (rank, frame);
        Err(self.unsupported("the gather of small frames"))
    }

    /// Every replica's `frame` on the first replica (`Some`, indexed by the chunk each
    /// replica owns, as [`GradSync::gather_by_chunk`]; its own left empty); the others send
    /// theirs (`None`).
    fn gather_to_first(
        &self,
        rank: usize,
        frame: &[u8],
    ) -> Result<Option<Vec<Vec<u8>>>, CommError> {
        let _ = (rank, frame);
        Err(self.unsupported("the gather to the first replica"))
    }

    /// The error of a collective this exchange does not have.
    fn unsupported(&self, what: &'static str) -> CommError {
        CommError::Unsupported {
            what,
            sync: format!("{self:?}"),
        }
    }
}

/// The `n` chunks a buffer of `len` values is cut into by the ring (the longer first):
/// the sharded optimizer's cut of a rank's flat parameters, the same on every replica.
pub fn chunk_cut(len: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    chunk_ranges(len, n.max(1))
}

/// [`GradSync`] by [`all_reduce_sum`] over [`PeerLink`]s, for a job of `dp` replicas of a
/// `pp`-rank pipeline, global rank `replica × pp + pipeline rank`. It holds the link ends of
/// the pipeline ranks this replica runs here: one in a process per rank, all `pp` when a
/// whole pipeline runs in one process.
pub struct RingGradSync {
    /// Link end by pipeline rank.
    ends: std::collections::BTreeMap<usize, std::sync::Arc<dyn PeerLink>>,
    dp: usize,
    pp: usize,
    channel: Channel,
    /// [`RingGradSync::tied`]: the two pipeline ranks of a tied embedding's copies.
    pair: Option<[usize; 2]>,
}

/// Channel of the tied embedding's gradient sum ([`RingGradSync::tied`]); apart from the
/// replicas' [`GRAD_CHANNEL`] since the groups share members.
pub const TIE_CHANNEL: Channel = u32::MAX - 11;

/// Channel of the gradient all-reduce between data-parallel replicas.
pub const GRAD_CHANNEL: Channel = u32::MAX - 7;

impl RingGradSync {
    /// Syncs over `ends` (each at its own global rank) on `channel`.
    pub fn new(
        ends: Vec<std::sync::Arc<dyn PeerLink>>,
        dp: usize,
        pp: usize,
        channel: Channel,
    ) -> Self {
        let ends = ends
            .into_iter()
            .map(|l| (l.rank() % pp.max(1), l))
            .collect();
        RingGradSync {
            ends,
            dp,
            pp,
            channel,
            pair: None,
        }
    }

    /// The sum of a tied embedding's two copies ([`crate::model::tie`]) between pipeline
    /// ranks `first` (the first stage's) and `last` (the last stage's) of the same replica,
    /// over `ends` as [`RingGradSync::new`] takes them. A sum of two, so both ranks get
    /// bitwise `a + b`, the reference trainer's sum.
    pub fn tied(
        ends: Vec<std::sync::Arc<dyn PeerLink>>,
        pp: usize,
        [first, last]: [usize; 2],
        channel: Channel,
    ) -> Self {
        RingGradSync {
            pair: Some([first.min(last), first.max(last)]),
            ..Self::new(ends, 1, pp, channel)
        }
    }
}

/// The data-parallel group of global rank `rank` in a job of `dp` replicas of `pp` ranks:
/// the same pipeline rank of every replica, by replica (the first leads). Every
/// [`GradSync`] groups its replicas so.
pub fn replica_group(rank: usize, dp: usize, pp: usize) -> Vec<usize> {
    let stage = rank % pp.max(1);
    (0..dp).map(|d| d * pp + stage).collect()
}

impl std::fmt::Debug for RingGradSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranks: Vec<usize> = self.ends.values().map(|l| l.rank()).collect();
        f.debug_struct("RingGradSync")
            .field("global_ranks", &ranks)
            .field("dp", &self.dp)
            .field("pp", &self.pp)
            .field("channel", &self.channel)
            .field("pair", &self.pair)
            .finish()
    }
}

impl RingGradSync {
    /// Pipeline rank `rank`'s link end and its group.
    fn end(&self, rank: usize) -> Result<(&dyn PeerLink, Vec<usize>), CommError> {
        let link = self.ends.get(&rank).ok_or_else(|| CommError::NotMember {
            rank,
            group: self.ends.keys().copied().collect(),
        })?;
        let group = match self.pair {
            Some(pair) => {
                let base = link.rank() - link.rank() % self.pp.max(1);
                pair.map(|r| base + r).to_vec()
            }
            None => replica_group(link.rank(), self.dp, self.pp),
        };
        Ok((link.as_ref(), group))
    }
}

impl GradSync for RingGradSync {
    fn all_reduce(&self, rank: usize, grads: &mut [f32]) -> Result<(), CommError> {
        let (link, group) = self.end(rank)?;
        all_reduce_sum(link, &group, self.channel, grads)
    }

    fn reduce_scatter(
        &self,
        rank: usize,
        grads: &mut [f32],
    ) -> Result<std::ops::Range<usize>, CommError> {
        let (link, group) = self.end(rank)?;
        reduce_scatter_sum(link, &group, self.channel, grads)
    }

    fn owned(&self, rank: usize, len: usize) -> Result<std::ops::Range<usize>, CommError> {
        let (link, group) = self.end(rank)?;
        Ok(owned_chunk(len, group.len(), position(link, &group)?))
    }

    fn all_gather(&self, rank: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let (link, group) = self.end(rank)?;
        all_gather_chunks(link, &group, self.channel, buf)
    }

    fn gather_by_chunk(&self, rank: usize, frame: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let (link, group) = self.end(rank)?;
        let mut frames = all_gather(link, &group, self.channel, frame)?;
        // The member at position p owns chunk p + 1: rotate right by one.
        frames.rotate_right(1);
        Ok(frames)
    }

    fn gather_to_first(
        &self,
        rank: usize,
        frame: &[u8],
    ) -> Result<Option<Vec<Vec<u8>>>, CommError> {
        let (link, group) = self.end(rank)?;
        let frames = gather_to_first(link, &group, self.channel, frame)?;
        Ok(frames.map(|mut frames| {
            frames.rotate_right(1);
            frames
        }))
    }
}

#[cfg(test)]
#[path = "collective_tests.rs"]
mod tests;

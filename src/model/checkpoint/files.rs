//! The files of a checkpoint on disk: how they are written (atomically, with their size and
//! hash) and how they are read back (only what the checkpoint lists, never more).
//!
//! A manifest or sidecar is input like any other: the names it gives its shards and its
//! drafter must be plain file names ([`plain_name`]: no `/`, no `..`, not absolute), so a
//! checkpoint only ever reads inside its own directory. Every file read is a regular file
//! (not a symlink, a directory, a device or a pipe) whose size on disk is the one listed,
//! checked from its metadata before a byte is read, and at most [`MAX_FILE_BYTES`]
//! ([`MAX_META_BYTES`] for a manifest or sidecar); the read takes at most that many bytes,
//! so a file that grows while it is read is refused too.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};

use super::HostTensor;
use crate::model::ModelError;

/// The most bytes one tensor file of a checkpoint may hold (256 GiB: the parameters, both
/// AdamW moments and the master weights of a 16-billion-parameter model).
pub const MAX_FILE_BYTES: u64 = 256 << 30;
/// The most bytes a manifest or sidecar may hold.
pub const MAX_META_BYTES: u64 = 64 << 20;

/// Whether `name` is a plain file name: one normal path component, nothing that leaves the
/// directory it is joined to.
pub fn plain_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!(
        (parts.next(), parts.next()),
        (Some(Component::Normal(part)), None) if part == OsStr::new(name)
    ) && !name.contains(['/', '\\'])
}

/// Checks a file name that the listing `listing` (a manifest or sidecar) gives in `field`:
/// a plain file name, declared at most [`MAX_FILE_BYTES`] long.
pub(crate) fn check_listed(
    listing: &Path,
    field: &str,
    name: &str,
    bytes: u64,
) -> Result<(), ModelError> {
    let refuse = |reason: String| ModelError::Listed {
        path: listing.to_path_buf(),
        field: field.to_string(),
        name: name.to_string(),
        reason,
    };
    if !plain_name(name) {
        return Err(refuse(
            "is not a plain file name inside the checkpoint directory".into(),
        ));
    }
    if bytes > MAX_FILE_BYTES {
        return Err(refuse(format!(
            "declares {bytes} bytes, more than a checkpoint file may hold ({MAX_FILE_BYTES})"
        )));
    }
    Ok(())
}

/// What kind of file `meta` describes, when it is not a regular file.
fn irregular(meta: &fs::Metadata) -> Option<&'static str> {
    let kind = meta.file_type();
    if kind.is_file() {
        None
    } else if kind.is_symlink() {
        Some("a symlink")
    } else if kind.is_dir() {
        Some("a directory")
    } else {
        Some("a device, pipe or socket")
    }
}

/// The metadata of `listing`'s file `name` in `dir` (its `field`, declared `bytes` long):
/// a regular file of exactly that size, checked without reading it. The name is checked
/// first ([`check_listed`]), so nothing outside `dir` is looked at.
pub(crate) fn stat_listed(
    dir: &Path,
    listing: &Path,
    field: &str,
    name: &str,
    bytes: u64,
) -> Result<(PathBuf, fs::Metadata), ModelError> {
    check_listed(listing, field, name, bytes)?;
    let path = dir.join(name);
    let meta = stat(&path)?;
    if let Some(kind) = irregular(&meta) {
        return Err(ModelError::Listed {
            path: listing.to_path_buf(),
            field: field.to_string(),
            name: name.to_string(),
            reason: format!("is {kind}, not a regular file"),
        });
    }
    if meta.len() != bytes {
        return Err(ModelError::Size {
            path,
            expected: bytes,
            got: meta.len(),
        });
    }
    Ok((path, meta))
}

fn stat(path: &Path) -> Result<fs::Metadata, ModelError> {
    fs::symlink_metadata(path).map_err(|error| ModelError::CheckpointIo {
        path: path.to_path_buf(),
        error,
    })
}

/// Opens the regular file `path` whose metadata `meta` was checked, refused if it is not
/// that file any more.
fn open_checked(path: &Path, meta: &fs::Metadata) -> Result<fs::File, ModelError> {
    let io = |error| ModelError::CheckpointIo {
        path: path.to_path_buf(),
        error,
    };
    let file = fs::File::open(path).map_err(io)?;
    let opened = file.metadata().map_err(io)?;
    if irregular(&opened).is_some() || !same_file(meta, &opened) {
        return Err(ModelError::Irregular {
            path: path.to_path_buf(),
            kind: "a file replaced while it was opened",
        });
    }
    Ok(file)
}

/// Reads the regular file `path` whose metadata `meta` was checked: at most its size, and
/// refused if it is not that file any more or not that size.
fn read_checked(path: &Path, meta: &fs::Metadata) -> Result<Vec<u8>, ModelError> {
    let io = |error| ModelError::CheckpointIo {
        path: path.to_path_buf(),
        error,
    };
    let file = open_checked(path, meta)?;
    let len = meta.len();
    // The size is what the listing declared and the disk holds, not what memory can hold:
    // a sparse file of 200 GiB is both. Over the available memory, or where the allocator
    // refuses it, the read is one error instead of an allocation failure's abort.
    let available = crate::input::machine_memory().map_or(u64::MAX, |m| m.bytes);
    let over = || ModelError::OverMemory {
        path: path.to_path_buf(),
        bytes: len,
        available,
    };
    if len > available {
        return Err(over());
    }
    let mut data = Vec::new();
    data.try_reserve_exact(usize::try_from(len).map_err(|_| over())?)
        .map_err(|_| over())?;
    file.take(len.saturating_add(1))
        .read_to_end(&mut data)
        .map_err(io)?;
    if data.len() as u64 != len {
        return Err(ModelError::Size {
            path: path.to_path_buf(),
            expected: len,
            got: data.len() as u64,
        });
    }
    Ok(data)
}

#[cfg(unix)]
fn same_file(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

#[cfg(not(unix))]
fn same_file(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    a.len() == b.len()
}

/// Reads the regular file `path` (a manifest or sidecar, or a tensor file whose size is
/// checked by the caller) of at most `limit` bytes.
pub(crate) fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, ModelError> {
    let meta = stat(path)?;
    if let Some(kind) = irregular(&meta) {
        return Err(ModelError::Irregular {
            path: path.to_path_buf(),
            kind,
        });
    }
    if meta.len() > limit {
        return Err(ModelError::TooLarge {
            path: path.to_path_buf(),
            bytes: meta.len(),
            limit,
        });
    }
    read_checked(path, &meta)
}

/// Reads the regular file `path` of exactly `bytes` bytes (its listing's figure), checking
/// its size before reading.
pub(crate) fn read_exact(path: &Path, bytes: u64) -> Result<Vec<u8>, ModelError> {
    if bytes > MAX_FILE_BYTES {
        return Err(ModelError::TooLarge {
            path: path.to_path_buf(),
            bytes,
            limit: MAX_FILE_BYTES,
        });
    }
    let meta = stat(path)?;
    if let Some(kind) = irregular(&meta) {
        return Err(ModelError::Irregular {
            path: path.to_path_buf(),
            kind,
        });
    }
    if meta.len() != bytes {
        return Err(ModelError::Size {
            path: path.to_path_buf(),
            expected: bytes,
            got: meta.len(),
        });
    }
    read_checked(path, &meta)
}

/// The tensors `names` of the file `listing` lists as `name` in `dir` (its `field`), with its
/// size `bytes` and hash `hash`: both checked before the tensors are parsed.
pub(crate) fn read_listed_tensors(
    dir: &Path,
    listing: &Path,
    field: &str,
    (name, bytes, hash): (&str, u64, &str),
    names: &[String],
) -> Result<Vec<HostTensor>, ModelError> {
    let (path, meta) = stat_listed(dir, listing, field, name, bytes)?;
    let data = read_checked(&path, &meta)?;
    check_hash(&path, &data, hash, listing)?;
    read_f32_tensors(&path, &data, names)
}

/// Checks the listed file `name` of `dir` (`listing`'s `field`, `bytes` long, hashing to
/// `hash`) without holding it: it is streamed through its hash 1 MiB at a time, so the
/// memory used stays flat whatever the file's size.
pub(crate) fn verify_listed(
    dir: &Path,
    listing: &Path,
    field: &str,
    (name, bytes, hash): (&str, u64, &str),
) -> Result<(), ModelError> {
    let (path, meta) = stat_listed(dir, listing, field, name, bytes)?;
    let mut file = open_checked(&path, &meta)?.take(bytes.saturating_add(1));
    let (mut h, mut read, mut buf) = (Fnv1a::default(), 0u64, vec![0u8; 1 << 20]);
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|error| ModelError::CheckpointIo {
                path: path.clone(),
                error,
            })?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        read += n as u64;
    }
    if read != bytes {
        return Err(ModelError::Size {
            path,
            expected: bytes,
            got: read,
        });
    }
    check_digest(&path, h.finish(), hash, listing)
}

/// Refuses the bytes `data` of `path` unless their hash is `hash`, as `listing` records it.
pub(crate) fn check_hash(
    path: &Path,
    data: &[u8],
    hash: &str,
    listing: &Path,
) -> Result<(), ModelError> {
    check_digest(path, fingerprint(data), hash, listing)
}

/// Refuses `path` unless its hash `got` is `hash`, as `listing` records it.
fn check_digest(path: &Path, got: String, hash: &str, listing: &Path) -> Result<(), ModelError> {
    if got != hash {
        return Err(ModelError::Corrupted {
            path: path.to_path_buf(),
            got,
            expected: hash.to_string(),
            listing: listing
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        });
    }
    Ok(())
}

/// Writes `tensors` as the safetensors file `path` (atomically), its metadata's `format`
/// entry `format`; returns its size and hash. See [`write_tensor_refs`].
pub(crate) fn write_tensor_file(
    path: &Path,
    tensors: &[HostTensor],
    format: &str,
) -> Result<(u64, String), ModelError> {
    write_tensor_refs(path, &tensors.iter().collect::<Vec<_>>(), format)
}

/// Bytes of the buffer the tensors' values are converted in on their way to the file.
const WRITE_CHUNK: usize = 1 << 16;

/// Writes `tensors` as the safetensors file `path` (atomically), its metadata's `format`
/// entry `format`; returns its size and hash. The file is streamed: its header, then each
/// tensor's values converted a [`WRITE_CHUNK`] at a time and hashed as they pass, so a
/// write holds no copy of the tensors (the bytes are those `safetensors::serialize` gives).
pub(crate) fn write_tensor_refs(
    path: &Path,
    tensors: &[&HostTensor],
    format: &str,
) -> Result<(u64, String), ModelError> {
    let mut sorted = tensors.to_vec();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(w) = sorted.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(ModelError::CheckpointTensor {
            path: path.to_path_buf(),
            name: w[0].name.clone(),
            reason: "is given twice".into(),
        });
    }
    let mut infos = Vec::with_capacity(sorted.len());
    let mut offset = 0usize;
    for t in &sorted {
        if t.shape.iter().product::<usize>() != t.data.len() {
            return Err(ModelError::CheckpointTensor {
                path: path.to_path_buf(),
                name: t.name.clone(),
                reason: format!(
                    "shape {:?} does not hold its {} values",
                    t.shape,
                    t.data.len()
                ),
            });
        }
        let end = offset + 4 * t.data.len();
        infos.push((
            t.name.clone(),
            TensorInfo {
                dtype: Dtype::F32,
                shape: t.shape.clone(),
                data_offsets: (offset, end),
            },
        ));
        offset = end;
    }
    let bad = |reason: String| ModelError::BadTensors {
        path: path.to_path_buf(),
        reason,
    };
    let info = HashMap::from([("format".to_string(), format.to_string())]);
    let meta = Metadata::new(Some(info), infos).map_err(|e| bad(e.to_string()))?;
    let mut header = serde_json::to_vec(&meta).map_err(|e| bad(e.to_string()))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut hashed = (Fnv1a::default(), 0u64);
    write_atomic_with(path, &mut |file| {
        let mut out = HashingWriter {
            inner: std::io::BufWriter::with_capacity(WRITE_CHUNK, file),
            hash: Fnv1a::default(),
            bytes: 0,
        };
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        let mut chunk = Vec::with_capacity(WRITE_CHUNK);
        for t in &sorted {
            for values in t.data.chunks(WRITE_CHUNK / 4) {
                chunk.clear();
                chunk.extend(values.iter().flat_map(|x| x.to_le_bytes()));
                out.write_all(&chunk)?;
            }
        }
        out.inner.flush()?;
        hashed = (out.hash, out.bytes);
        Ok(())
    })?;
    Ok((hashed.1, hashed.0.finish()))
}

/// A writer that hashes ([`Fnv1a`]) and counts the bytes it passes on.
struct HashingWriter<W: Write> {
    inner: W,
    hash: Fnv1a,
    bytes: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The f32 tensors `names` of the safetensors bytes `data` read from `path` (named in errors).
pub(crate) fn read_f32_tensors(
    path: &Path,
    data: &[u8],
    names: &[String],
) -> Result<Vec<HostTensor>, ModelError> {
    let st = SafeTensors::deserialize(data).map_err(|e| ModelError::BadTensors {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    names
        .iter()
        .map(|name| {
            let err = |reason: String| ModelError::CheckpointTensor {
                path: path.to_path_buf(),
                name: name.clone(),
                reason,
            };
            let view = st.tensor(name).map_err(|e| err(e.to_string()))?;
            if view.dtype() != Dtype::F32 {
                return Err(err(format!("dtype {:?}, expected F32", view.dtype())));
            }
            Ok(HostTensor {
                name: name.clone(),
                shape: view.shape().to_vec(),
                data: view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            })
        })
        .collect()
}

/// Writes `bytes` to `path` through a temporary file in the same directory (so the rename
/// is atomic on POSIX filesystems): readers see the old file or the new one, never a mix.
/// The file and then its directory are synced, so once this returns the new file survives
/// a crash (a checkpoint's manifest may then be written over it).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    write_atomic_with(path, &mut |file| file.write_all(bytes))
}

/// [`write_atomic`] of what `fill` writes into the temporary file. A failed write removes
/// the temporary file; the error names `path`.
pub fn write_atomic_with(
    path: &Path,
    fill: &mut dyn FnMut(&mut fs::File) -> std::io::Result<()>,
) -> Result<(), ModelError> {
    let io = |error| ModelError::CheckpointIo {
        path: path.to_path_buf(),
        error,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
    let result = (|| {
        let mut f = fs::File::create(&tmp)?;
        fill(&mut f)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        match path.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(dir) => fs::File::open(dir)?.sync_all(),
            None => Ok(()),
        }
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(io)
}

/// File name of the manifest inside a sharded checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The manifest's `format` value.
pub const SHARDED_FORMAT: &str = "pipefill-sharded-checkpoint";

/// FNV-1a 64 of `bytes`, as 16 hex digits: a cheap check that a shard is the one written
/// (not a defence against tampering).
pub fn fingerprint(bytes: &[u8]) -> String {
    let mut h = Fnv1a::default();
    h.update(bytes);
    h.finish()
}

/// FNV-1a 64 fed a piece at a time ([`fingerprint`] of the concatenation), so a file can be
/// hashed as it streams past instead of read whole.
#[derive(Debug, Clone, Copy)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    pub fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// The hash, hex, as the manifests write it.
    pub fn finish(&self) -> String {
        format!("{:016x}", self.0)
    }
}

#[cfg(test)]
#[path = "files_tests.rs"]
mod tests;

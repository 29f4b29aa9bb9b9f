//! The weight files of a Hugging Face model directory: `model.safetensors`, or the shards
//! named by `model.safetensors.index.json`.
//!
//! Only headers are read up front (each is checked by the `safetensors` crate: offsets
//! contiguous, sizes matching shapes, no overflow; and the file's length must be the header's
//! promise, so a truncated file is refused before any tensor is read). A tensor's bytes are
//! then read on demand with one seek and one read, so a rank reads just its stage's
//! parameters. Every shard named by the index must be a path inside the model directory:
//! absolute paths, `..` and symlinks that lead out of it are refused.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::Dtype;
use safetensors::tensor::Metadata;

use crate::model::ModelError;

/// The single-file form.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The sharded form's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// safetensors' own limit on a header (100 MB).
const MAX_HEADER: u64 = 100_000_000;
/// The largest model.safetensors.index.json read (a 405B model's is under 200 KB).
const MAX_INDEX_BYTES: u64 = 64 << 20;

/// One weight file's parsed header.
struct Shard {
    path: PathBuf,
    /// Where the data section starts (8 + header length).
    data_start: u64,
    meta: Metadata,
}

/// Every tensor of a model directory, by Hugging Face name, with where its bytes are.
pub struct WeightFiles {
    shards: Vec<Shard>,
    /// Tensor name → index into `shards`.
    index: BTreeMap<String, usize>,
    /// Tensor bytes read so far (what a rank's stage cost it in reads).
    read: AtomicU64,
}

/// A tensor's header entry.
#[derive(Clone, Debug)]
pub struct TensorMeta {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

fn io(path: &Path, e: std::io::Error) -> ModelError {
    ModelError::File {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

impl WeightFiles {
    /// Opens the weights of model directory `dir`: the index when there is one, else
    /// `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let index_path = dir.join(INDEX_FILE);
        if index_path.exists() {
            return Self::open_index(dir, &index_path);
        }
        let single = dir.join(SINGLE_FILE);
        if !single.exists() {
            return Err(ModelError::File {
                path: dir.to_path_buf(),
                reason: format!("has neither {SINGLE_FILE} nor {INDEX_FILE}"),
            });
        }
        let shard = read_header(&single)?;
        let index = shard
            .meta
            .tensors()
            .into_keys()
            .map(|name| (name, 0))
            .collect();
        Ok(WeightFiles {
            shards: vec![shard],
            index,
            read: AtomicU64::new(0),
        })
    }

    fn open_index(dir: &Path, index_path: &Path) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::File {
            path: index_path.to_path_buf(),
            reason,
        };
        let text = crate::input::read(index_path, MAX_INDEX_BYTES, "a safetensors index")?;
        let json: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| bad(format!("is not JSON: {e}")))?;
        let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
            return Err(bad("has no `weight_map` object".into()));
        };
        let root = dir.canonicalize().map_err(|e| io(dir, e))?;
        let mut files: BTreeMap<String, usize> = BTreeMap::new();
        let mut shards = Vec::new();
        let mut index = BTreeMap::new();
        for (tensor, file) in map {
            let Some(file) = file.as_str() else {
                return Err(bad(format!("tensor `{tensor}`: {file} is not a file name")));
            };
            let i = match files.get(file) {
                Some(&i) => i,
                None => {
                    let path = inside(&root, file).map_err(|reason| {
                        bad(format!("tensor `{tensor}`: shard \"{file}\" {reason}"))
                    })?;
                    shards.push(read_header(&path)?);
                    files.insert(file.to_string(), shards.len() - 1);
                    shards.len() - 1
                }
            };
            if shards[i].meta.info(tensor).is_none() {
                return Err(ModelError::HfTensor {
                    path: shards[i].path.clone(),
                    tensor: tensor.clone(),
                    reason: format!("is listed in {INDEX_FILE} but not in the file"),
                });
            }
            index.insert(tensor.clone(), i);
        }
        // A tensor a shard holds but the index does not list is one the loader would miss.
        for s in &shards {
            if let Some(extra) = s
                .meta
                .tensors()
                .into_keys()
                .find(|n| !index.contains_key(n))
            {
                return Err(ModelError::HfTensor {
                    path: s.path.clone(),
                    tensor: extra,
                    reason: format!("is in the file but not in {INDEX_FILE}"),
                });
            }
        }
        Ok(WeightFiles {
            shards,
            index,
            read: AtomicU64::new(0),
        })
    }

    /// Bytes of tensor data read so far (headers not counted).
    pub fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// Bytes of tensor data `name` holds in its file, if it is there.
    pub fn data_bytes(&self, name: &str) -> Option<u64> {
        let info = self.shards[*self.index.get(name)?].meta.info(name)?;
        Some((info.data_offsets.1 - info.data_offsets.0) as u64)
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The file holding `name`, if any does.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.index.get(name).map(|&i| self.shards[i].path.as_path())
    }

    /// `name`'s dtype and shape.
    pub fn meta(&self, name: &str) -> Option<TensorMeta> {
        let s = &self.shards[*self.index.get(name)?];
        let info = s.meta.info(name)?;
        Some(TensorMeta {
            dtype: info.dtype,
            shape: info.shape.clone(),
        })
    }

    /// `name`'s values as `f32` (from f32, bf16 or f16), row-major in the file's shape. The
    /// caller has checked the shape, so the allocation is the one it expects.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let Some(&i) = self.index.get(name) else {
            return Err(ModelError::HfTensor {
                path: self
                    .shards
                    .first()
                    .map(|s| s.path.clone())
                    .unwrap_or_default(),
                tensor: name.to_string(),
                reason: "is missing".into(),
            });
        };
        let s = &self.shards[i];
        let info = s.meta.info(name).expect("indexed names are in their shard");
        let bad = |reason: String| ModelError::HfTensor {
            path: s.path.clone(),
            tensor: name.to_string(),
            reason,
        };
        let width = match info.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            other => {
                return Err(bad(format!(
                    "has dtype {other:?} (f32, bf16 and f16 are read)"
                )));
            }
        };
        let (start, end) = info.data_offsets;
        let mut bytes = vec![0u8; end - start];
        let (mut f, _) = crate::input::open(&s.path)?;
        f.seek(SeekFrom::Start(s.data_start + start as u64))
            .and_then(|_| f.read_exact(&mut bytes))
            .map_err(|e| bad(format!("cannot be read: {e}")))?;
        self.read.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        let values = match info.dtype {
            Dtype::F32 => bytes
                .chunks_exact(width)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(width)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(width)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        };
        Ok(values)
    }
}

/// `root/file` when `file` is a relative path of plain components and the file it names
/// (after symlinks) is inside `root` (canonical); else why not.
fn inside(root: &Path, file: &str) -> Result<PathBuf, String> {
    let rel = Path::new(file);
    if file.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err("is not a plain path inside the model directory".into());
    }
    let path = root.join(rel);
    let real = path
        .canonicalize()
        .map_err(|e| format!("cannot be opened: {e}"))?;
    if !real.starts_with(root) {
        return Err(format!(
            "leads out of the model directory (to {})",
            real.display()
        ));
    }
    Ok(real)
}

/// Reads and checks one file's header, and that the file is as long as the header says.
fn read_header(path: &Path) -> Result<Shard, ModelError> {
    let bad = |reason: String| ModelError::File {
        path: path.to_path_buf(),
        reason,
    };
    let (mut f, len) = crate::input::open(path)?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| bad(format!("is truncated: {len} bytes, no safetensors header")))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER {
        return Err(bad(format!(
            "has a {n}-byte safetensors header, over the format's limit of {MAX_HEADER} bytes"
        )));
    }
    if 8 + n > len {
        return Err(bad(format!(
            "is truncated or not safetensors: a {n}-byte header in a {len}-byte file"
        )));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|e| io(path, e))?;
    let meta: Metadata = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("has a bad safetensors header: {e}")))?;
    let want = 8 + n + meta.data_len() as u64;
    if len != want {
        return Err(bad(format!(
            "is {} ({len} bytes; its header describes {want})",
            if len < want { "truncated" } else { "too long" }
        )));
    }
    Ok(Shard {
        path: path.to_path_buf(),
        data_start: 8 + n,
        meta,
    })
}

//! The directory an export writes ([`super::export`]): what it may be, and what
//! `--overwrite` replaces in it.
//!
//! An export writes `config.json`, `model.safetensors` and the source's tokenizer files,
//! each atomically over any file of the same name; it removes nothing. So `--overwrite`
//! replaces those files and leaves every other one, and a directory is refused where that
//! would destroy or confuse something:
//!
//! - the checkpoint the export reads: the output may not be it, hold it or lie inside it
//!   (canonical paths compared; a path not made yet is resolved from its nearest existing
//!   parent), so `export RUN -o RUN/checkpoint --overwrite` cannot replace the checkpoint's
//!   own tensor file;
//! - the source model's directory;
//! - without `--overwrite`, a directory that is not empty;
//! - with it, a directory holding a pipefill checkpoint (its sidecar, manifest or tensor
//!   file: the export would replace that checkpoint's `model.safetensors`), or weight files
//!   the export does not write (another `*.safetensors`, a `model.safetensors.index.json`),
//!   which a reader would take for the model instead of the exported one.

use std::path::{Component, Path, PathBuf};

use super::files::{INDEX_FILE, SINGLE_FILE};
use crate::model::ModelError;
use crate::model::checkpoint::sharded::MANIFEST_FILE;
use crate::model::checkpoint::sweep::written_by_pipefill;
use crate::model::checkpoint::{META_FILE, TENSOR_FILE};

/// Checks, reading only, that an export may write into `out` as `opts` say (see the
/// module docs); the error names `out` and why not.
pub fn check_out_dir(out: &Path, opts: &ExportOptions) -> Result<(), ModelError> {
    let fail = |reason: String| ModelError::Export {
        path: out.to_path_buf(),
        reason,
    };
    let here = resolved(out);
    if let Some(read) = &opts.checkpoint {
        let read = resolved(read);
        let how = if here == read {
            Some("is")
        } else if here.starts_with(&read) {
            Some("lies inside")
        } else if read.starts_with(&here) {
            Some("holds")
        } else {
            None
        };
        if let Some(how) = how {
            return Err(fail(format!(
                "it {how} the checkpoint being exported ({}): the export would write over \
                 it; choose an output directory outside it",
                read.display()
            )));
        }
    }
    if let Some(src) = &opts.source
        && resolved(src) == here
    {
        return Err(fail("it is the source model's directory".into()));
    }
    let entries = match std::fs::read_dir(out) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(fail(e.to_string())),
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if names.is_empty() {
        return Ok(());
    }
    if !opts.overwrite {
        return Err(fail(
            "the directory exists and is not empty (pass --overwrite to replace its model)".into(),
        ));
    }
    names.sort();
    let checkpoint = [META_FILE, MANIFEST_FILE]
        .iter()
        .find(|n| names.iter().any(|m| m == *n))
        .map(|n| n.to_string())
        .or_else(|| {
            written_by_pipefill(&out.join(TENSOR_FILE)).then(|| format!("{TENSOR_FILE} of one"))
        });
    if let Some(file) = checkpoint {
        return Err(fail(format!(
            "it holds a pipefill checkpoint ({file}): the export would replace its \
             {TENSOR_FILE}; export into another directory"
        )));
    }
    let foreign: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| (n.ends_with(".safetensors") && *n != SINGLE_FILE) || *n == INDEX_FILE)
        .collect();
    if !foreign.is_empty() {
        let shown: Vec<&str> = foreign.iter().take(3).copied().collect();
        let more = match foreign.len() - shown.len() {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        return Err(fail(format!(
            "it holds weight files this export does not write ({}{more}), which a reader would \
             take for the model: --overwrite replaces only {SINGLE_FILE}, config.json and the \
             tokenizer files; remove them or choose another directory",
            shown.join(", ")
        )));
    }
    Ok(())
}

/// [`check_out_dir`], then creates `out` if it is not there.
pub(super) fn prepare_dir(out: &Path, opts: &ExportOptions) -> Result<(), ModelError> {
    check_out_dir(out, opts)?;
    std::fs::create_dir_all(out).map_err(|e| ModelError::Export {
        path: out.to_path_buf(),
        reason: format!("cannot create it: {e}"),
    })
}

/// `path` made absolute with its symlinks resolved: its nearest existing ancestor
/// canonicalized, and the components below that (not made yet) appended as written.
fn resolved(path: &Path) -> PathBuf {
    let abs = match path.is_absolute() {
        true => path.to_path_buf(),
        false => std::env::current_dir().map_or_else(|_| path.to_path_buf(), |d| d.join(path)),
    };
    let parts: Vec<Component> = abs.components().collect();
    for i in (0..=parts.len()).rev() {
        let Ok(mut base) = parts[..i].iter().collect::<PathBuf>().canonicalize() else {
            continue;
        };
        for part in &parts[i..] {
            match part {
                Component::ParentDir => {
                    base.pop();
                }
                Component::Normal(name) => base.push(name),
                _ => {}
            }
        }
        return base;
    }
    abs
}

/// The weights' type in an export.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExportDtype {
    #[default]
    F32,
    Bf16,
}

impl std::str::FromStr for ExportDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" | "float32" => Ok(ExportDtype::F32),
            "bf16" | "bfloat16" => Ok(ExportDtype::Bf16),
            other => Err(format!("dtype \"{other}\": f32 or bf16")),
        }
    }
}

/// How [`export()`](super::export) writes.
#[derive(Clone, Debug, Default)]
pub struct ExportOptions {
    pub dtype: ExportDtype,
    /// Write into a non-empty directory: the files an export writes are replaced, every
    /// other file stays ([`check_out_dir`]).
    pub overwrite: bool,
    /// The Hugging Face directory the model came from: its architecture and config fields
    /// are kept, its tokenizer files copied.
    pub source: Option<PathBuf>,
    /// The checkpoint the tensors were read from: the output may not be it, hold it or lie
    /// inside it.
    pub checkpoint: Option<PathBuf>,
}

#[cfg(test)]
#[path = "export_dir_tests.rs"]
mod tests;

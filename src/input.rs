//! Reading the files a user hands the program: job files, schedule files, model directories
//! (config.json, safetensors headers, the shard index), tokenizer files, data, reports.
//!
//! One reader for all of them, so every such read has the same two guarantees:
//! - **Regular files only.** A path is opened without blocking and checked with `fstat` on
//!   the open descriptor: a FIFO (which would block a plain `open` until a writer comes), a
//!   directory, a socket or a device (`/dev/zero`) is one error naming it, before a byte is
//!   read.
//! - **Bounded.** A whole-file read states the most it will take; a larger file is refused
//!   from its size, and the read itself stops one byte past the cap (a file that grows while
//!   it is read is refused too), so no size from the outside sizes an allocation unchecked.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Why an input file cannot be read; each names the file.
#[derive(Debug, Error)]
#[error("{} {}", self.path().display(), self.reason())]
pub enum InputError {
    Io {
        path: PathBuf,
        source: io::Error,
    },
    NotFile {
        path: PathBuf,
        kind: &'static str,
    },
    TooBig {
        path: PathBuf,
        len: u64,
        cap: u64,
        what: &'static str,
    },
    NotText {
        path: PathBuf,
        source: std::str::Utf8Error,
    },
}

impl InputError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            InputError::Io { path, .. }
            | InputError::NotFile { path, .. }
            | InputError::TooBig { path, .. }
            | InputError::NotText { path, .. } => path,
        }
    }

    /// What is wrong with the file, without its name (for an error that names it itself).
    pub fn reason(&self) -> String {
        match self {
            InputError::Io { source, .. } => format!("cannot be read: {source}"),
            InputError::NotFile { kind, .. } => format!("is {kind}, not a regular file"),
            InputError::TooBig { len, cap, what, .. } => {
                format!("is {len} bytes, over the limit of {cap} bytes for {what}")
            }
            InputError::NotText { source, .. } => format!("is not UTF-8 text: {source}"),
        }
    }
}

/// What kind of non-regular file `t` is, in words.
fn kind(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else {
        "not a file"
    }
}

/// Opens `path` for reading when it is a regular file (see the module docs); returns the
/// file and its length.
pub fn open(path: &Path) -> Result<(File, u64), InputError> {
    let io_err = |source| InputError::Io {
        path: path.to_path_buf(),
        source,
    };
    // O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one;
    // on a regular file the flag changes nothing.
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io_err)?;
    let meta = file.metadata().map_err(io_err)?;
    if !meta.is_file() {
        return Err(InputError::NotFile {
            path: path.to_path_buf(),
            kind: kind(meta.file_type()),
        });
    }
    Ok((file, meta.len()))
}

/// `path`'s bytes when it is a regular file of at most `cap` bytes; `what` names the kind of
/// file in the error ("a job file").
pub fn read(path: &Path, cap: u64, what: &'static str) -> Result<Vec<u8>, InputError> {
    let (file, len) = open(path)?;
    let too_big = |len| InputError::TooBig {
        path: path.to_path_buf(),
        len,
        cap,
        what,
    };
    if len > cap {
        return Err(too_big(len));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| InputError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    if bytes.len() as u64 > cap {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// [`read`] as UTF-8 text.
pub fn read_text(path: &Path, cap: u64, what: &'static str) -> Result<String, InputError> {
    let bytes = read(path, cap, what)?;
    String::from_utf8(bytes).map_err(|e| InputError::NotText {
        path: path.to_path_buf(),
        source: e.utf8_error(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("job.toml");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = read(&fifo, 1 << 20, "a job file").unwrap_err().to_string();
        assert!(err.contains("is a FIFO, not a regular file"), "{err}");
    }

    #[test]
    fn a_directory_and_a_device_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = read(dir.path(), 10, "x").unwrap_err().to_string();
        assert!(err.contains("is a directory"), "{err}");
        let err = read(Path::new("/dev/zero"), 10, "x")
            .unwrap_err()
            .to_string();
        assert!(err.contains("/dev/zero is a device"), "{err}");
    }

    #[test]
    fn the_cap_is_checked_and_text_must_be_utf8() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"0123456789").unwrap();
        assert_eq!(read(&path, 10, "x").unwrap().len(), 10);
        let err = read(&path, 9, "a report").unwrap_err().to_string();
        assert!(
            err.contains("is 10 bytes, over the limit of 9 bytes for a report"),
            "{err}"
        );
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        let err = read_text(&path, 10, "x").unwrap_err().to_string();
        assert!(err.contains("is not UTF-8"), "{err}");
    }
}

/// The machine's memory as `/proc/meminfo` gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub bytes: u64,
    /// `MemAvailable` (else `MemTotal`, on kernels without it).
    pub available: bool,
}

/// This machine's [`MemInfo`]; `None` where `/proc/meminfo` cannot be read.
pub fn machine_memory() -> Option<MemInfo> {
    meminfo(&read_text(Path::new("/proc/meminfo"), 1 << 20, "/proc/meminfo").ok()?)
}

/// The [`MemInfo`] of `/proc/meminfo`'s text: `MemAvailable`, else `MemTotal`.
pub fn meminfo(text: &str) -> Option<MemInfo> {
    let at = |available| move |bytes| MemInfo { bytes, available };
    proc_field(text, "MemAvailable")
        .map(at(true))
        .or_else(|| proc_field(text, "MemTotal").map(at(false)))
}

/// The bytes of field `name` of a `/proc` text of `Name: N kB` lines (`/proc/meminfo`,
/// `/proc/self/status`); `None` where it is missing, not a number of kB, or overflows.
pub fn proc_field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix(':')?.trim();
        let kib: u64 = rest
            .strip_suffix("kB")
            .unwrap_or(rest)
            .trim()
            .parse()
            .ok()?;
        kib.checked_mul(1024)
    })
}

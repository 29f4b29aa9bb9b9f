//! The process's peak resident memory, reported when a run ends so that it stands beside
//! the estimate printed when it started (`memory: ... estimated`) without an outside tool
//! (`/usr/bin/time -f %M` reads the same figure).

use crate::config::memory::Bytes;

/// The process's resident peak (`VmHWM` of `/proc/self/status`), where Linux gives it.
pub fn peak_resident() -> Option<u64> {
    let path = std::path::Path::new("/proc/self/status");
    vm_hwm(&crate::input::read_text(path, 1 << 20, "/proc/self/status").ok()?)
}

/// `VmHWM`'s bytes in the text of a `/proc/<pid>/status`.
fn vm_hwm(status: &str) -> Option<u64> {
    crate::input::proc_field(status, "VmHWM")
}

/// `"memory: peak 224.2 MiB resident (this process)"`, or `None` where it is not known. A
/// launched rank's is its own process's.
pub fn peak_line() -> Option<String> {
    peak_resident().map(|b| format!("memory: peak {} resident (this process)", Bytes(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_read_from_the_status_text() {
        let status = "Name:\tpipefill\nVmPeak:\t  300 kB\nVmHWM:\t  229580 kB\nVmRSS:\t 1 kB\n";
        assert_eq!(vm_hwm(status), Some(229_580 * 1024));
        assert_eq!(vm_hwm("VmHWM:\t12 MB\n"), None, "an unknown unit");
        assert_eq!(vm_hwm("VmRSS:\t12 kB\n"), None);
        assert_eq!(vm_hwm("VmHWM:\t99999999999999999999 kB\n"), None);
        #[cfg(target_os = "linux")]
        {
            let line = peak_line().unwrap();
            assert!(
                line.starts_with("memory: peak ") && line.ends_with(" resident (this process)")
            );
        }
    }
}

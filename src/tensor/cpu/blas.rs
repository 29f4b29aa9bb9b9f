//! Intel MKL's matrix product, loaded at run time where it is installed.
//!
//! The `gemm` and `faer` crates run as fast as MKL on operands that sit in the cache, but a
//! training step reads its weights and activations from memory, and there they fall
//! behind: at SmolLM-135M's shapes, with the caches flushed before each product, faer ran
//! a product reading its right operand transposed (`dY·Wᵀ`, a layer's input gradient) at
//! 108–136 GF/s and gemm an attention projection at 102, where MKL, the library PyTorch
//! computes with on x86, ran them at 189–229 (docs/benchmarks.md, "MKL's products"). So
//! the products go to MKL when it is found, and to the crates otherwise: the library is
//! opened with `dlopen`, so building needs no MKL and a machine without it runs as before.
//!
//! `PIPEFILL_BLAS` chooses: unset, `libmkl_rt.so.3` and then `libmkl_rt.so.2` are tried on
//! the loader's path; `none` keeps the crates; any other value is the path of an MKL
//! runtime library (`…/lib/libmkl_rt.so.3` of the `mkl` wheel). A named library that
//! cannot be used is an error the backend reports, not a silent fallback.
//!
//! **Same bits on any thread count.** The pipeline's stages must agree bitwise with the
//! reference trainer whatever threads each has, and a product split over threads
//! differently may round differently: MKL's does at some shapes. MKL's strict conditional
//! numerical reproducibility (`MKL_CBWR_Set(MKL_CBWR_AUTO | MKL_CBWR_STRICT)`) makes its
//! products the same bits on any number of threads (checked at 30 shape and layout cases,
//! docs/benchmarks.md), so the library is used only where that mode is accepted. OpenBLAS has no such mode (its results change
//! with its thread count at some shapes), so it is not used.
//!
//! MKL threads with GNU OpenMP (`libgomp`, the C compiler's runtime) where that loads, and
//! sequentially otherwise; each call runs on the calling backend's thread count
//! (`MKL_Set_Num_Threads_Local`; the lower-case names are Fortran's, taking pointers).

use std::ffi::{CStr, CString, c_int, c_void};
use std::sync::OnceLock;

/// `CblasRowMajor`, `CblasNoTrans`, `CblasTrans` (cblas.h).
const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;
/// `MKL_CBWR_AUTO | MKL_CBWR_STRICT` and `MKL_CBWR_SUCCESS` (mkl_cbwr.h).
const CBWR_AUTO_STRICT: c_int = 2 | 0x10000;
const CBWR_SUCCESS: c_int = 0;
/// `MKL_THREADING_SEQUENTIAL`, `MKL_THREADING_GNU` (mkl_service.h).
const THREADING_SEQUENTIAL: c_int = 1;
const THREADING_GNU: c_int = 3;

/// `cblas_sgemm`'s signature in MKL's LP64 interface (32-bit integers), `mkl_rt`'s default.
type Sgemm = unsafe extern "C" fn(
    layout: c_int,
    trans_a: c_int,
    trans_b: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: f32,
    c: *mut f32,
    ldc: c_int,
);

/// `int MKL_Set_Num_Threads_Local(int)`.
type SetThreads = unsafe extern "C" fn(c_int) -> c_int;

/// The loaded library: its `cblas_sgemm`, and where it came from.
#[derive(Debug)]
pub struct Blas {
    sgemm: Sgemm,
    set_threads: SetThreads,
    /// The library's file name or path, as opened.
    pub name: String,
}

/// The library [`PIPEFILL_BLAS`](self) names, or the default one when it is unset.
enum Choice {
    None,
    Default,
    Path(String),
}

fn choice(var: Option<String>) -> Choice {
    match var {
        None => Choice::Default,
        Some(v) if v == "none" => Choice::None,
        Some(v) => Choice::Path(v),
    }
}

/// The process's MKL, loaded on first use: `Ok(None)` where none is to be used (none found,
/// or `PIPEFILL_BLAS=none`), an error naming the library where the one `PIPEFILL_BLAS`
/// names cannot be used.
pub fn get() -> Result<Option<&'static Blas>, String> {
    static BLAS: OnceLock<Result<Option<Blas>, String>> = OnceLock::new();
    BLAS.get_or_init(|| match choice(std::env::var("PIPEFILL_BLAS").ok()) {
        Choice::None => Ok(None),
        Choice::Default => Ok(["libmkl_rt.so.3", "libmkl_rt.so.2"]
            .into_iter()
            .find_map(|name| open(name).ok())),
        Choice::Path(path) => open(&path)
            .map(Some)
            .map_err(|e| format!("PIPEFILL_BLAS={path}: {e}")),
    })
    .as_ref()
    .map(Option::as_ref)
    .map_err(Clone::clone)
}

/// Opens `name`, finds what is called in it, and sets MKL's threading and strict CNR mode.
fn open(name: &str) -> Result<Blas, String> {
    let handle = dl_open(name).ok_or_else(|| dl_error("cannot be loaded"))?;
    let find = |sym: &CStr| {
        symbol(handle, sym).ok_or_else(|| {
            format!(
                "has no {} (not an MKL runtime library)",
                sym.to_string_lossy()
            )
        })
    };
    let sgemm = find(c"cblas_sgemm")?;
    let set_threads = find(c"MKL_Set_Num_Threads_Local")?;
    let set_layer = find(c"MKL_Set_Threading_Layer")?;
    let cbwr_set = find(c"MKL_CBWR_Set")?;
    let disable_fast_mm = find(c"MKL_Disable_Fast_MM")?;
    let layer = if dl_open("libgomp.so.1").is_some() {
        THREADING_GNU
    } else {
        THREADING_SEQUENTIAL
    };
    // SAFETY: MKL's `int MKL_Set_Threading_Layer(int)`, `int MKL_Disable_Fast_MM(void)` and
    // `int MKL_CBWR_Set(int)`, called before any computation as MKL asks. Without its own
    // allocator MKL takes its buffers from malloc and returns them, instead of keeping a
    // pool that the memory estimate would have to guess.
    let cbwr = unsafe {
        let set_layer: unsafe extern "C" fn(c_int) -> c_int = std::mem::transmute(set_layer);
        set_layer(layer);
        let disable: unsafe extern "C" fn() -> c_int = std::mem::transmute(disable_fast_mm);
        disable();
        let cbwr_set: unsafe extern "C" fn(c_int) -> c_int = std::mem::transmute(cbwr_set);
        cbwr_set(CBWR_AUTO_STRICT)
    };
    if cbwr != CBWR_SUCCESS {
        return Err(format!(
            "refused strict reproducibility (MKL_CBWR_Set returned {cbwr}), without which \
             its products would change with the thread count"
        ));
    }
    // SAFETY: the standard CBLAS signature and MKL's `int MKL_Set_Num_Threads_Local(int)`.
    unsafe {
        Ok(Blas {
            sgemm: std::mem::transmute::<*mut c_void, Sgemm>(sgemm),
            set_threads: std::mem::transmute::<*mut c_void, SetThreads>(set_threads),
            name: name.to_string(),
        })
    }
}

/// `dlopen(name, RTLD_NOW | RTLD_LOCAL)`; the handle is never closed, so what is taken
/// from it stays valid for the process's life.
fn dl_open(name: &str) -> Option<*mut c_void> {
    let cname = CString::new(name).ok()?;
    // SAFETY: a NUL-terminated path.
    let handle = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    (!handle.is_null()).then_some(handle)
}

fn symbol(handle: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    // SAFETY: a handle dlopen returned and a NUL-terminated name.
    let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

fn dl_error(what: &str) -> String {
    // SAFETY: dlerror returns a NUL-terminated message or null.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        what.to_string()
    } else {
        // SAFETY: non-null, NUL-terminated, valid until the next dl call on this thread.
        let msg = unsafe { CStr::from_ptr(msg) }.to_string_lossy();
        format!("{what} ({msg})")
    }
}

/// An operand as CBLAS takes it: row-major with a leading dimension, maybe transposed.
#[derive(Clone, Copy, Debug)]
pub(super) struct Operand {
    pub trans: bool,
    pub ld: usize,
}

impl Operand {
    /// A `rows × cols` matrix at strides `(rs, cs)`, if CBLAS can read it: one stride 1,
    /// the other at least the contiguous side's length.
    pub fn of(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<Operand> {
        if cs == 1 && rs >= cols.max(1) {
            Some(Operand {
                trans: false,
                ld: rs,
            })
        } else if rs == 1 && cs >= rows.max(1) {
            Some(Operand {
                trans: true,
                ld: cs,
            })
        } else {
            None
        }
    }
}

/// Products below this many multiply-adds stay on the crates, where MKL's cost per call
/// (its thread setting and OpenMP team) outweighs its speed: the default job (d_model 64)
/// ran at 11,843 tokens/s with every product on MKL against 12,973 on the crates, and at
/// 12,215 against 12,410 with this bound. The choice depends on the product's shape only,
/// so the reference trainer and the pipeline still compute each product alike.
const MIN_WORK: usize = 1 << 22;

/// MKL, where it computes a product of `work` multiply-adds: loaded, and the product at
/// least [`MIN_WORK`]. The one place that decides, for the product itself and for where
/// the backend calls it from.
pub(super) fn for_product(work: usize) -> Option<&'static Blas> {
    if work < MIN_WORK {
        return None;
    }
    get().ok().flatten()
}

/// Whether every size fits CBLAS's `int`.
pub(super) fn fits(sizes: &[usize]) -> bool {
    sizes.iter().all(|&x| c_int::try_from(x).is_ok())
}

impl Blas {
    /// `c = alpha·op(a)·op(b) + beta·c` for `op(a): [m, k]`, `op(b): [k, n]`, `c` row-major
    /// with leading dimension `ldc`, on `threads` threads.
    ///
    /// # Safety
    /// The pointers must reach every element the operands' shapes and leading dimensions
    /// name, `c` must not alias `a` or `b`, `m`, `n`, `k` must be positive, and every size
    /// must [`fit`](fits).
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn sgemm(
        &self,
        (m, k, n): (usize, usize, usize),
        threads: usize,
        alpha: f32,
        a: *const f32,
        oa: Operand,
        b: *const f32,
        ob: Operand,
        beta: f32,
        c: *mut f32,
        ldc: usize,
    ) {
        // Sizes the caller checked with `fits`.
        let int = |x: usize| x as c_int;
        let t = |o: Operand| if o.trans { TRANS } else { NO_TRANS };
        let (m, n, k) = (int(m), int(n), int(k));
        let (lda, ldb, ldc) = (int(oa.ld), int(ob.ld), int(ldc));
        // SAFETY: the caller's contract; the sizes are checked to fit. The thread count is
        // the calling thread's own setting.
        unsafe {
            (self.set_threads)(int(threads.max(1)));
            (self.sgemm)(
                ROW_MAJOR,
                t(oa),
                t(ob),
                m,
                n,
                k,
                alpha,
                a,
                lda,
                b,
                ldb,
                beta,
                c,
                ldc,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operands_as_cblas_reads_them() {
        // A 3 × 5 matrix: row-major (ld 5, or more for a view into wider rows), or the
        // transpose of a row-major 5 × 3 (ld 3).
        assert!(matches!(
            Operand::of(3, 5, 5, 1),
            Some(Operand {
                trans: false,
                ld: 5
            })
        ));
        assert!(matches!(
            Operand::of(3, 5, 8, 1),
            Some(Operand {
                trans: false,
                ld: 8
            })
        ));
        assert!(matches!(
            Operand::of(3, 5, 1, 3),
            Some(Operand { trans: true, ld: 3 })
        ));
        // Rows overlapping, or neither stride 1: not CBLAS's.
        assert!(Operand::of(3, 5, 4, 1).is_none());
        assert!(Operand::of(3, 5, 1, 2).is_none());
        assert!(Operand::of(3, 5, 10, 2).is_none());
        assert!(fits(&[1, c_int::MAX as usize]));
        assert!(!fits(&[1, c_int::MAX as usize + 1]));
    }

    #[test]
    fn the_setting_names_the_library() {
        assert!(matches!(choice(None), Choice::Default));
        assert!(matches!(choice(Some("none".into())), Choice::None));
        assert!(
            matches!(choice(Some("/opt/mkl/libmkl_rt.so.3".into())), Choice::Path(p) if p == "/opt/mkl/libmkl_rt.so.3")
        );
    }

    #[test]
    fn a_library_that_is_not_mkl_is_refused_by_name() {
        let missing = open("/nonexistent/libmkl_rt.so.3").unwrap_err();
        assert!(missing.contains("cannot be loaded"), "{missing}");
        // The C library loads but has no CBLAS.
        let libc = open("libc.so.6").unwrap_err();
        assert!(libc.contains("has no cblas_sgemm"), "{libc}");
    }
}

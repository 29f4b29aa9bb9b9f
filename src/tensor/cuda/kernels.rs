//! The NVRTC side of the CUDA backend: the kernel source (`kernels.cu`, compiled to PTX once
//! per process and shared by every backend), the table of kernel entry points, and the launch
//! shapes the kernels are written for.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use cudarc::nvrtc::{CompileOptions, Ptx};

/// CUDA C source of every non-GEMM kernel.
pub(super) const SOURCE: &str = include_str!("kernels.cu");

macro_rules! kernel_table {
    ($($variant:ident => $name:literal,)*) => {
        /// A kernel of `kernels.cu`; the discriminant indexes [`Kernels`].
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(super) enum K {
            $($variant,)*
        }

        /// Entry-point names, in [`K`] order.
        pub(super) const NAMES: &[&str] = &[$($name,)*];

        /// Variant names, in [`K`] order (for the launch-site test).
        #[cfg(test)]
        const VARIANTS: &[&str] = &[$(stringify!($variant),)*];
    };
}

kernel_table! {
    F32ToBf16 => "f32_to_bf16",
    Bf16ToF32 => "bf16_to_f32",
    FillF32 => "fill_f32",
    FillU16 => "fill_u16",
    AddF32 => "add_f32",
    AxpyF32 => "axpy_f32",
    ScaleF32 => "scale_f32",
    MulF32 => "mul_f32",
    RopeF32 => "rope_f32",
    RepeatKvF32 => "repeat_kv_f32",
    RepeatKvBwdF32 => "repeat_kv_bwd_f32",
    ActivationFwd => "activation_fwd",
    ActivationBwd => "activation_bwd",
    AddBroadcastRows => "add_broadcast_rows",
    SoftmaxRows => "softmax_rows",
    RmsnormFwd => "rmsnorm_fwd",
    RmsnormBwdInput => "rmsnorm_bwd_input",
    RmsnormBwdWeight => "rmsnorm_bwd_weight",
    SumRows => "sum_rows",
    CausalSoftmax => "causal_softmax",
    AttentionDscores => "attention_dscores",
    EmbeddingFwd => "embedding_fwd",
    EmbeddingBwd => "embedding_bwd",
    CrossEntropyFwd => "cross_entropy_fwd",
    CrossEntropyBwd => "cross_entropy_bwd",
    SumSquaresPartial => "sum_squares_partial",
    AdamwF32 => "adamw_f32",
}

/// The loaded entry points of one backend's module, indexed by [`K`].
pub(super) struct Kernels(Vec<CudaFunction>);

impl Kernels {
    /// Compiles (first call in the process only) and loads every kernel into `ctx`.
    pub(super) fn load(ctx: &Arc<CudaContext>) -> Result<Self, String> {
        let ptx = ptx()?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| format!("loading the kernel PTX: {e}"))?;
        let functions = NAMES
            .iter()
            .map(|name| {
                module
                    .load_function(name)
                    .map_err(|e| format!("kernel `{name}` not found in the PTX: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Kernels(functions))
    }

    pub(super) fn get(&self, k: K) -> &CudaFunction {
        // Every K has an entry: `load` fills the table from NAMES, which lists K in order.
        &self.0[k as usize]
    }
}

/// The PTX of [`SOURCE`], compiled once per process (NVRTC takes about a second).
fn ptx() -> Result<Ptx, String> {
    static PTX: OnceLock<Result<Ptx, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        let opts = CompileOptions {
            name: Some("pipefill_kernels.cu".into()),
            ..Default::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
            .map_err(|e| format!("NVRTC could not compile the kernels: {e}"))
    })
    .clone()
}

/// Threads per block of the elementwise (grid-stride) kernels.
const ELEMENTWISE_BLOCK: u32 = 256;
/// Cap on elementwise blocks: enough to fill a large GPU, the grid-stride loop does the rest.
const ELEMENTWISE_MAX_BLOCKS: usize = 8192;

/// Launch shape of a grid-stride kernel over `n > 0` elements.
pub(super) fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n
        .div_ceil(ELEMENTWISE_BLOCK as usize)
        .clamp(1, ELEMENTWISE_MAX_BLOCKS);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (ELEMENTWISE_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launch shape of a one-block-per-row kernel: a warp multiple between 32 and 256 threads,
/// no wider than the row needs. `rows` must fit a grid (checked by the caller).
pub(super) fn per_row(rows: u32, cols: usize) -> LaunchConfig {
    let threads = cols.next_power_of_two().clamp(32, 256) as u32;
    LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launch shape of the column-sum kernels (`rmsnorm_bwd_weight`, `sum_rows`): blocks of
/// 32 columns × 8 row lanes, as `kernels.cu` hard-codes.
pub(super) fn per_column_group(width: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (width.div_ceil(32) as u32, 1, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}

/// Blocks of `sum_squares_partial` for `n > 0` elements (one partial sum each).
pub(super) fn sum_squares_blocks(n: usize) -> usize {
    n.div_ceil(ELEMENTWISE_BLOCK as usize).clamp(1, 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table and the source must agree: a name missing from the source would only show
    /// on a GPU, so check it here.
    #[test]
    fn every_table_entry_is_a_kernel_of_the_source() {
        for name in NAMES {
            let signature = format!("extern \"C\" __global__ void {name}(");
            assert!(
                SOURCE.contains(&signature),
                "kernels.cu has no `{signature}`"
            );
        }
        let defined = SOURCE.matches("extern \"C\" __global__ void ").count();
        assert_eq!(
            defined,
            NAMES.len(),
            "kernels.cu defines kernels the table does not list"
        );
    }

    /// Number of parameters of kernel `name` in the source.
    fn kernel_arity(name: &str) -> usize {
        let sig = format!("extern \"C\" __global__ void {name}(");
        let start = SOURCE.find(&sig).unwrap() + sig.len();
        let params = &SOURCE[start..start + SOURCE[start..].find(')').unwrap()];
        params.split(',').count()
    }

    /// Every `launch!` in the backend passes as many arguments as its kernel takes: a
    /// mismatch would only show on a GPU (as garbage or a fault), so count them here.
    #[test]
    fn every_launch_site_passes_the_kernels_parameter_count() {
        let files = [
            ("mod.rs", include_str!("mod.rs")),
            ("backend.rs", include_str!("backend.rs")),
            ("blas.rs", include_str!("blas.rs")),
            ("loss.rs", include_str!("loss.rs")),
        ];
        let mut launched = std::collections::BTreeSet::new();
        for (file, text) in files {
            // Skip the macro definition itself.
            for call in text.split("launch!(").skip(1).filter(|c| c.contains("K::")) {
                let after = &call[call.find("K::").unwrap() + 3..];
                let variant: String = after.chars().take_while(|c| c.is_alphanumeric()).collect();
                let index = VARIANTS.iter().position(|v| *v == variant);
                let Some(index) = index else { continue };
                let open = call.find('[').unwrap();
                let close = open + call[open..].find(']').unwrap();
                let args = call[open + 1..close]
                    .split(',')
                    .filter(|a| !a.trim().is_empty())
                    .count();
                let want = kernel_arity(NAMES[index]);
                assert_eq!(
                    args, want,
                    "{file}: launch of {variant} passes {args} arguments, the kernel takes {want}"
                );
                launched.insert(index);
            }
        }
        // Every kernel is launched somewhere.
        let missing: Vec<&str> = (0..NAMES.len())
            .filter(|i| !launched.contains(i))
            .map(|i| VARIANTS[i])
            .collect();
        assert!(missing.is_empty(), "kernels never launched: {missing:?}");
    }

    /// NVRTC needs no GPU: where the library is installed (the CUDA toolkit, or the
    /// `nvidia-cuda-nvrtc-cu12` wheel on `LD_LIBRARY_PATH`) the kernels must compile, and the
    /// PTX must define every entry point. `PIPEFILL_PTX_OUT=path` also writes the PTX (to run
    /// `ptxas` on it).
    #[test]
    fn kernels_compile_with_nvrtc_where_it_is_installed() {
        // SAFETY: dlopen probe only.
        if unsafe { !cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("SKIP: libnvrtc not found, the kernel source was not compiled");
            return;
        }
        let ptx = ptx().unwrap_or_else(|e| panic!("{e}"));
        let text = ptx.to_src();
        for name in NAMES {
            assert!(
                text.contains(&format!(".entry {name}(")),
                "PTX lacks `{name}`"
            );
        }
        if let Ok(path) = std::env::var("PIPEFILL_PTX_OUT") {
            std::fs::write(path, text).unwrap();
        }
    }

    #[test]
    fn launch_shapes_cover_their_work() {
        for n in [1, 255, 256, 257, 10_000_000] {
            let c = elementwise(n);
            assert!(c.grid_dim.0 >= 1 && c.grid_dim.0 as usize <= ELEMENTWISE_MAX_BLOCKS);
            assert_eq!(c.block_dim, (256, 1, 1));
        }
        assert_eq!(per_row(7, 1).block_dim.0, 32);
        assert_eq!(per_row(7, 48).block_dim.0, 64);
        assert_eq!(per_row(7, 100_000).block_dim.0, 256);
        assert_eq!(per_row(7, 48).grid_dim, (7, 1, 1));
        assert_eq!(per_column_group(33).grid_dim.0, 2);
        assert_eq!(per_column_group(32).block_dim, (32, 8, 1));
        assert_eq!(sum_squares_blocks(1), 1);
        assert_eq!(sum_squares_blocks(usize::MAX / 2), 1024);
    }
}

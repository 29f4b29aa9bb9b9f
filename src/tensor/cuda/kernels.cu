// pipefill CUDA kernels: every backend operation that is not a matrix product.
//
// Compiled at run time by NVRTC (once per process, see kernels.rs) and loaded as one module.
// Conventions (mirroring src/tensor/cpu/kernels.rs, which is the reference):
// - all arithmetic is f32; bf16 buffers are widened/rounded by the conversion kernels around
//   these, so every kernel here reads and writes f32;
// - element counts are 64-bit (`unsigned long long`); elementwise kernels use grid-stride loops
//   so any launch grid covers any length;
// - "row" kernels run one block per row; their block size is a multiple of 32 (at most 1024)
//   and they reduce with warp shuffles plus one shared slot per warp.

typedef unsigned long long u64;

#define IGNORE_TARGET 0xffffffffu
#define NEG_BIG (-3.402823466e+38f)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum of `v` over the block; every thread gets the result. Safe to call repeatedly: the
// leading barrier keeps a previous call's readers ahead of this call's writers.
__device__ float block_sum(float v) {
    __shared__ float slots[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) slots[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? slots[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) slots[0] = v;
    }
    __syncthreads();
    return slots[0];
}

__device__ double block_sum_d(double v) {
    __shared__ double slots[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) slots[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? slots[lane] : 0.0;
        v = warp_sum_d(v);
        if (lane == 0) slots[0] = v;
    }
    __syncthreads();
    return slots[0];
}

__device__ float block_max(float v) {
    __shared__ float slots[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) slots[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? slots[lane] : NEG_BIG;
        v = warp_max(v);
        if (lane == 0) slots[0] = v;
    }
    __syncthreads();
    return slots[0];
}

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

// ---- storage conversion and fills ------------------------------------------------------

// Round to nearest even, quiet NaNs: the same rule as half::bf16::from_f32 on the host.
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

extern "C" __global__ void f32_to_bf16(const float* src, unsigned short* dst, u64 n) {
    GRID_STRIDE(i, n) dst[i] = f32_to_bf16_bits(src[i]);
}

extern "C" __global__ void bf16_to_f32(const unsigned short* src, float* dst, u64 n) {
    GRID_STRIDE(i, n) dst[i] = __uint_as_float(((unsigned int)src[i]) << 16);
}

extern "C" __global__ void fill_f32(float* dst, float value, u64 n) {
    GRID_STRIDE(i, n) dst[i] = value;
}

extern "C" __global__ void fill_u16(unsigned short* dst, unsigned short value, u64 n) {
    GRID_STRIDE(i, n) dst[i] = value;
}

// ---- elementwise -------------------------------------------------------------------------

extern "C" __global__ void add_f32(const float* a, const float* b, float* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

extern "C" __global__ void axpy_f32(float alpha, const float* src, float* dst, u64 n) {
    GRID_STRIDE(i, n) dst[i] += alpha * src[i];
}

extern "C" __global__ void scale_f32(float* buf, float alpha, u64 n) {
    GRID_STRIDE(i, n) buf[i] *= alpha;
}

extern "C" __global__ void mul_f32(const float* a, const float* b, float* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = a[i] * b[i];
}

// ---- positions and heads -------------------------------------------------------------------

// Rotary embedding (Llama's rotate_half) of x: [rows, heads, 2·half] into out, row r at
// positions[r]: for i < half and a = positions[r]·inv_freq[i], out[i] = x[i]·cos a −
// x[i+half]·sin a and out[i+half] = x[i+half]·cos a + x[i]·sin a; sign = −1 rotates by −a (the
// input gradient). One thread per pair, n = rows·heads·half; the angle is computed in f32 as
// the CPU backend does (no fast math: cosf/sinf keep full range).
extern "C" __global__ void rope_f32(const float* x, float* out, const unsigned int* positions,
                                    const float* inv_freq, u64 heads, u64 half, float sign, u64 n) {
    GRID_STRIDE(k, n) {
        const u64 i = k % half, head = k / half, r = head / heads;
        const float a = (float)positions[r] * inv_freq[i];
        const float c = cosf(a), s = sign * sinf(a);
        const u64 base = head * 2 * half;
        const float x1 = x[base + i], x2 = x[base + half + i];
        out[base + i] = x1 * c - x2 * s;
        out[base + half + i] = x2 * c + x1 * s;
    }
}

// Grouped-query sharing: dst[row, h, :] = src[row, h / rep, :], dst: [rows, kv_heads·rep,
// head_dim]. n = rows·kv_heads·rep·head_dim.
extern "C" __global__ void repeat_kv_f32(const float* src, float* dst, u64 kv_heads, u64 rep,
                                         u64 head_dim, u64 n) {
    GRID_STRIDE(i, n) {
        const u64 j = i % head_dim, h = (i / head_dim) % (kv_heads * rep);
        const u64 row = i / (head_dim * kv_heads * rep);
        dst[i] = src[(row * kv_heads + h / rep) * head_dim + j];
    }
}

// Its gradient: dst[row, g, :] = Σ_{r < rep} src[row, g·rep + r, :], summed in increasing r
// (the CPU backend's order, so the two agree bit for bit). n = rows·kv_heads·head_dim.
extern "C" __global__ void repeat_kv_bwd_f32(const float* src, float* dst, u64 kv_heads, u64 rep,
                                             u64 head_dim, u64 n) {
    GRID_STRIDE(i, n) {
        const u64 j = i % head_dim, g = (i / head_dim) % kv_heads, row = i / (head_dim * kv_heads);
        const float* s = src + (row * kv_heads + g) * rep * head_dim + j;
        float acc = s[0];
        for (u64 r = 1; r < rep; ++r) acc += s[r * head_dim];
        dst[i] = acc;
    }
}

#define SQRT_2_OVER_PI 0.7978846f
#define GELU_C 0.044715f

// kind: 0 = GELU (tanh approximation), 1 = SiLU.
extern "C" __global__ void activation_fwd(const float* x, float* out, u64 n, int kind) {
    GRID_STRIDE(i, n) {
        const float v = x[i];
        if (kind == 0) {
            out[i] = 0.5f * v * (1.0f + tanhf(SQRT_2_OVER_PI * (v + GELU_C * v * v * v)));
        } else {
            out[i] = v * (1.0f / (1.0f + expf(-v)));
        }
    }
}

extern "C" __global__ void activation_bwd(const float* x, const float* dy, float* dx, u64 n, int kind) {
    GRID_STRIDE(i, n) {
        const float v = x[i];
        float grad;
        if (kind == 0) {
            const float t = tanhf(SQRT_2_OVER_PI * (v + GELU_C * v * v * v));
            const float du = SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_C * v * v);
            grad = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
        } else {
            const float s = 1.0f / (1.0f + expf(-v));
            grad = s * (1.0f + v * (1.0f - s));
        }
        dx[i] = dy[i] * grad;
    }
}

// dst[i] += row[i % width] for every element of dst: [batch, width].
extern "C" __global__ void add_broadcast_rows(const float* row, float* dst, u64 width, u64 n) {
    GRID_STRIDE(i, n) dst[i] += row[i % width];
}

// ---- row-wise ----------------------------------------------------------------------------

// out[r] = softmax(x[r]) over `cols` columns; grid.x = rows.
extern "C" __global__ void softmax_rows(const float* x, float* out, u64 cols) {
    const float* xr = x + (u64)blockIdx.x * cols;
    float* outr = out + (u64)blockIdx.x * cols;
    float m = NEG_BIG;
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, xr[j]);
    m = block_max(m);
    float s = 0.0f;
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
        const float e = expf(xr[j] - m);
        outr[j] = e;
        s += e;
    }
    const float inv = 1.0f / block_sum(s);
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x) outr[j] *= inv;
}

// rstd[r] = 1/sqrt(mean(x[r]^2) + eps); out[r] = x[r] * rstd[r] * w; grid.x = rows.
extern "C" __global__ void rmsnorm_fwd(const float* x, const float* w, float* out, float* rstd,
                                       u64 dim, float eps) {
    const u64 r = blockIdx.x;
    const float* xr = x + r * dim;
    float* outr = out + r * dim;
    float ss = 0.0f;
    for (u64 j = threadIdx.x; j < dim; j += blockDim.x) ss += xr[j] * xr[j];
    const float s = 1.0f / sqrtf(block_sum(ss) / (float)dim + eps);
    for (u64 j = threadIdx.x; j < dim; j += blockDim.x) outr[j] = xr[j] * s * w[j];
    if (threadIdx.x == 0) rstd[r] = s;
}

// dx[r] = rstd·(g − n·mean(g·n)) with g = dy·w, n = x·rstd; grid.x = rows.
extern "C" __global__ void rmsnorm_bwd_input(const float* x, const float* w, const float* rstd,
                                             const float* dy, float* dx, u64 dim) {
    const u64 r = blockIdx.x;
    const float* xr = x + r * dim;
    const float* dyr = dy + r * dim;
    float* dxr = dx + r * dim;
    const float s = rstd[r];
    float dot = 0.0f;
    for (u64 j = threadIdx.x; j < dim; j += blockDim.x) dot += dyr[j] * w[j] * xr[j] * s;
    dot = block_sum(dot) / (float)dim;
    for (u64 j = threadIdx.x; j < dim; j += blockDim.x) dxr[j] = s * (dyr[j] * w[j] - xr[j] * s * dot);
}

// Column sums over rows (the next two kernels), without atomics so they are deterministic:
// a block (32, 8) owns 32 columns and walks every row with its 8 thread rows, then folds the
// 8 partial sums in shared memory and adds the total once.

// dw[j] += Σ_r dy[r, j] · x[r, j] · rstd[r]; grid.x = ceil(dim / 32), block (32, 8).
extern "C" __global__ void rmsnorm_bwd_weight(const float* x, const float* rstd, const float* dy,
                                              float* dw, u64 rows, u64 dim) {
    __shared__ float part[8][33];
    const u64 j = (u64)blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (j < dim) {
        for (u64 r = threadIdx.y; r < rows; r += 8) acc += dy[r * dim + j] * x[r * dim + j] * rstd[r];
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < dim) {
        float total = 0.0f;
        for (int y = 0; y < 8; ++y) total += part[y][threadIdx.x];
        dw[j] += total;
    }
}

// out[j] += Σ_b src[b, j]; grid.x = ceil(width / 32), block (32, 8).
extern "C" __global__ void sum_rows(const float* src, float* out, u64 batch, u64 width) {
    __shared__ float part[8][33];
    const u64 j = (u64)blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (j < width) {
        for (u64 b = threadIdx.y; b < batch; b += 8) acc += src[b * width + j];
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < width) {
        float total = 0.0f;
        for (int y = 0; y < 8; ++y) total += part[y][threadIdx.x];
        out[j] += total;
    }
}

// ---- attention (the products run on cuBLAS; these are the row-wise pieces) --------------

// In place on scores [pairs·seq, seq] (already scaled by 1/sqrt(head_dim)): row r is query
// position i = r % seq; softmax over keys j <= i, zeros for j > i. grid.x = pairs·seq.
extern "C" __global__ void causal_softmax(float* s, u64 seq) {
    const u64 r = blockIdx.x;
    const u64 i = r % seq;
    float* row = s + r * seq;
    float m = NEG_BIG;
    for (u64 j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, row[j]);
    m = block_max(m);
    float sum = 0.0f;
    for (u64 j = threadIdx.x; j <= i; j += blockDim.x) {
        const float e = expf(row[j] - m);
        row[j] = e;
        sum += e;
    }
    const float inv = 1.0f / block_sum(sum);
    for (u64 j = threadIdx.x; j < seq; j += blockDim.x) row[j] = j <= i ? row[j] * inv : 0.0f;
}

// In place dP -> dS on [pairs·seq, seq]: dS = P∘(dP − Σ_j dP∘P)·scale over keys j <= i,
// zeros above the diagonal. grid.x = pairs·seq.
extern "C" __global__ void attention_dscores(const float* p, float* dp, u64 seq, float scale) {
    const u64 r = blockIdx.x;
    const u64 i = r % seq;
    const float* pr = p + r * seq;
    float* dr = dp + r * seq;
    float dot = 0.0f;
    for (u64 j = threadIdx.x; j <= i; j += blockDim.x) dot += dr[j] * pr[j];
    dot = block_sum(dot);
    for (u64 j = threadIdx.x; j < seq; j += blockDim.x) {
        dr[j] = j <= i ? pr[j] * (dr[j] - dot) * scale : 0.0f;
    }
}

// ---- embeddings ---------------------------------------------------------------------------

// out[t, :] = table[ids[t], :]; ids were range-checked on the host. n = ids·dim.
extern "C" __global__ void embedding_fwd(const float* table, const unsigned int* ids, float* out,
                                         u64 dim, u64 n) {
    GRID_STRIDE(i, n) {
        const u64 t = i / dim, j = i % dim;
        out[i] = table[(u64)ids[t] * dim + j];
    }
}

// dtable[ids[t], :] += dy[t, :]; repeated ids collide, hence atomicAdd. n = ids·dim.
extern "C" __global__ void embedding_bwd(const unsigned int* ids, const float* dy, float* dtable,
                                         u64 dim, u64 n) {
    GRID_STRIDE(i, n) {
        const u64 t = i / dim, j = i % dim;
        atomicAdd(&dtable[(u64)ids[t] * dim + j], dy[i]);
    }
}

// ---- loss ---------------------------------------------------------------------------------

// probs[r] = softmax(logits[r]); loss[r] = logsumexp(logits[r]) − logits[r, t] (0 when the
// target is IGNORE_TARGET). grid.x = rows.
extern "C" __global__ void cross_entropy_fwd(const float* logits, const unsigned int* targets,
                                             float* probs, float* loss, u64 vocab) {
    const u64 r = blockIdx.x;
    const float* xr = logits + r * vocab;
    float* pr = probs + r * vocab;
    float m = NEG_BIG;
    for (u64 j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, xr[j]);
    m = block_max(m);
    float s = 0.0f;
    for (u64 j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float e = expf(xr[j] - m);
        pr[j] = e;
        s += e;
    }
    s = block_sum(s);
    const float inv = 1.0f / s;
    for (u64 j = threadIdx.x; j < vocab; j += blockDim.x) pr[j] *= inv;
    if (threadIdx.x == 0) {
        const unsigned int t = targets[r];
        loss[r] = t == IGNORE_TARGET ? 0.0f : (logf(s) + m) - xr[t];
    }
}

// dlogits[r, j] = scale·(probs[r, j] − [j == t]), 0 for ignored rows. n = rows·vocab.
extern "C" __global__ void cross_entropy_bwd(const float* probs, const unsigned int* targets,
                                             float* dlogits, u64 vocab, float scale, u64 n) {
    GRID_STRIDE(i, n) {
        const unsigned int t = targets[i / vocab];
        const u64 j = i % vocab;
        if (t == IGNORE_TARGET) {
            dlogits[i] = 0.0f;
        } else {
            dlogits[i] = scale * probs[i] - (j == (u64)t ? scale : 0.0f);
        }
    }
}

// ---- reductions and optimizer -------------------------------------------------------------

// partial[block] = Σ x² over the block's grid-stride share, in double; the host adds the
// partials (deterministic, no double atomics needed on old architectures).
extern "C" __global__ void sum_squares_partial(const float* x, double* partial, u64 n) {
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        const double v = (double)x[i];
        acc += v * v;
    }
    acc = block_sum_d(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One AdamW step on f32 arrays; bc1 = 1 − β1^t and bc2 = 1 − β2^t come from the host.
extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, u64 n, float lr,
                                     float beta1, float beta2, float eps, float weight_decay,
                                     float bc1, float bc2, float grad_scale) {
    GRID_STRIDE(i, n) {
        const float gi = g[i] * grad_scale;
        const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float mhat = mi / bc1;
        const float vhat = vi / bc2;
        p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * p[i]);
    }
}

// Decode attention on CPU in fp32: one query position per row against that row's cached K / V.
//
// Built and loaded at first use by rollyard/cpu_kernels.py (g++ -O3 -march=native -fopenmp;
// the OpenMP runtime is torch's own, already loaded, so both share one thread pool).
//
// Per (row b, K/V head h): the G query heads that share h, scores against positions 0..n-1,
// softmax, weighted sum of V. The work per item is a few KB of K / V read once, so the cost is
// memory traffic and per-item overhead, which is where batched tiny matmuls (torch.bmm) lose:
// ~2.5x at 32 rows x 4 heads x 68 positions with warm caches, ~2.7x with K / V coming from DRAM
// (software prefetch ahead of the hardware prefetcher, which restarts at every item's block).
//
// Written with GCC vector extensions, not intrinsics: -march=native lowers them to AVX-512,
// AVX2 pairs or NEON as the machine has.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>

namespace {

constexpr int PD = 16;  // prefetch distance, in positions
typedef float f16v __attribute__((vector_size(64)));  // 16 floats
typedef float f8v __attribute__((vector_size(32)));   // 8 floats
typedef float f4v __attribute__((vector_size(16)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef int32_t i8v __attribute__((vector_size(32)));

template <typename T> struct Lanes { static constexpr int n = sizeof(T) / sizeof(float); };
template <typename T> struct IntOf;
template <> struct IntOf<f16v> { typedef i16v type; };
template <> struct IntOf<f8v> { typedef i8v type; };

template <typename T> inline T ld(const float* p) { T v; std::memcpy(&v, p, sizeof v); return v; }
// the same lanes from a bf16 cache (uint16 bit patterns): widened exactly to fp32
template <typename T> inline T ld(const uint16_t* p) {
    typedef typename IntOf<T>::type I;
    typedef uint16_t H __attribute__((vector_size(sizeof(T) / 2)));
    H h;
    std::memcpy(&h, p, sizeof h);
    I i = __builtin_convertvector(h, I) << 16;
    T v;
    std::memcpy(&v, &i, sizeof v);
    return v;
}
template <typename T> inline void st(float* p, T v) { std::memcpy(p, &v, sizeof v); }

inline float hsum(f8v a) {
    f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}
inline float hsum(f16v v) {
    return hsum(f8v(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)));
}

// exp(x) for x <= 0 (scores after subtracting their max): 2^k * p(r), |r| <= ln2 / 2, with the
// Cephes expf polynomial (relative error ~2e-7); x below -87 gives exp(-87), which the softmax
// sum (>= 1, from the max itself) cannot see.
template <typename T>
inline T vexp(T x) {
    typedef typename IntOf<T>::type I;
    const T lo = T{} - 87.0f;
    x = x < lo ? lo : x;
    T k = x * 1.44269504088896341f;
    k = __builtin_convertvector(__builtin_convertvector(k + (k < 0 ? T{} - 0.5f : T{} + 0.5f), I), T);
    T r = x - k * 0.693359375f + k * 2.12194440e-4f;
    T p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    I e = (__builtin_convertvector(k, I) + 127) << 23;
    T two;
    std::memcpy(&two, &e, sizeof two);
    return p * two;
}

// One (row, K/V head): q [G, NV * VW] (already scaled), k / v rows ``sw`` floats apart, n positions, of which the
// first P are read at kp / vp instead (another row's copy of the same prompt: see decode_attn).
// ``s``: scratch of G * round_up(n, 16) floats. T: the vector type (VW floats); NV * VW = head_dim.
template <typename T, int G, int NV, typename E>
void item(const float* q, const E* k, const E* v, const E* kp, const E* vp, int P, int64_t sw, int n, float* out,
          float* s) {
    constexpr int VW = Lanes<T>::n;
    T qv[G][NV];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < NV; j++) qv[g][j] = ld<T>(q + (g * NV + j) * VW);
    const int nc = (n + VW - 1) / VW, ld_s = nc * VW;
    for (int w = 0; w < n; w++) {
        const E* kr = (w < P ? kp : k) + w * sw;
        const int f = w + PD;  // the position prefetched: K's, then V's first rows
        const E* pf = f < n ? (f < P ? kp : k) + f * sw : (f - n < P ? vp : v) + (f - n) * sw;
        for (int j = 0; j < NV; j += 64 / (int)sizeof(E) / VW) __builtin_prefetch(pf + j * VW);
        T kv[NV];
        for (int j = 0; j < NV; j++) kv[j] = ld<T>(kr + j * VW);
        for (int g = 0; g < G; g++) {
            T acc = qv[g][0] * kv[0];
            for (int j = 1; j < NV; j++) acc += qv[g][j] * kv[j];
            s[g * ld_s + w] = hsum(acc);
        }
    }
    for (int g = 0; g < G; g++) {
        float* sg = s + g * ld_s;
        for (int w = n; w < ld_s; w++) sg[w] = -INFINITY;  // padding: exp gives exp(-87), below z's ulp
        T mv = ld<T>(sg);
        for (int c = 1; c < nc; c++) { T x = ld<T>(sg + c * VW); mv = mv > x ? mv : x; }
        float m = mv[0];
        for (int i = 1; i < VW; i++) m = std::fmax(m, mv[i]);
        T zv = T{};
        for (int c = 0; c < nc; c++) { T e = vexp(ld<T>(sg + c * VW) - m); st(sg + c * VW, e); zv += e; }
        const float inv = 1.0f / hsum(zv);
        for (int w = 0; w < n; w++) sg[w] *= inv;
    }
    T acc[G][NV];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < NV; j++) acc[g][j] = T{};
    for (int w = 0; w < n; w++) {
        const E* vr = (w < P ? vp : v) + w * sw;
        if (w + PD < n)
            for (int j = 0; j < NV; j += 64 / (int)sizeof(E) / VW)
                __builtin_prefetch((w + PD < P ? vp : v) + (w + PD) * sw + j * VW);
        for (int j = 0; j < NV; j++) {
            T x = ld<T>(vr + j * VW);
            for (int g = 0; g < G; g++) acc[g][j] += s[g * ld_s + w] * x;
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < NV; j++) st(out + (g * NV + j) * VW, acc[g][j]);
}

template <typename E>
using item_fn = void (*)(const float*, const E*, const E*, const E*, const E*, int, int64_t, int, float*, float*);

// head_dim 16, 32, 64, 128, 256 (Gemma 3) in 16-float vectors; 8, 24, 40 in 8-float ones (the tiny presets).
template <int G, typename E>
item_fn<E> pick_hd(int hd) {
    switch (hd) {
        case 16: return item<f16v, G, 1, E>;
        case 32: return item<f16v, G, 2, E>;
        case 64: return item<f16v, G, 4, E>;
        case 128: return item<f16v, G, 8, E>;
        case 256: return item<f16v, G, 16, E>;
        case 8: return item<f8v, G, 1, E>;
        case 24: return item<f8v, G, 3, E>;
        case 40: return item<f8v, G, 5, E>;
        default: return nullptr;
    }
}

template <typename E>
item_fn<E> pick(int g, int hd) {
    switch (g) {
        case 1: return pick_hd<1, E>(hd);
        case 2: return pick_hd<2, E>(hd);
        case 3: return pick_hd<3, E>(hd);
        case 4: return pick_hd<4, E>(hd);
        case 5: return pick_hd<5, E>(hd);
        case 6: return pick_hd<6, E>(hd);
        case 7: return pick_hd<7, E>(hd);
        case 8: return pick_hd<8, E>(hd);
        default: return nullptr;
    }
}

// share: null, or per row (src, P): its first P positions are read from row src's K / V, a bitwise copy of the
// same prompt (GRPO's samples of one prompt): the rows of a group then read one copy, which stays in cache, instead
// of a copy each from memory. The numbers are those of reading its own copy.
template <typename E>
int decode_attn(const float* q, int64_t sq, const E* K, const E* V, int64_t sb, int64_t sh, int64_t sw,
                const int64_t* lens, const int64_t* share, int B, int KVH, int G, int hd, int width, float* out,
                float* scratch, int threads) {
    item_fn<E> fn = pick<E>(G, hd);
    if (!fn) return -1;
    const int64_t per_thread = (int64_t)G * (width + 16);
    const int items = B * KVH;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int it = 0; it < items; it++) {
        const int b = it / KVH, h = it % KVH;
        const int n = lens ? (int)(lens[b] < width ? lens[b] : width) : width;
        if (n <= 0) {  // nothing to attend to (not a state the engine produces): zeros, not 0 / 0
            std::memset(out + (int64_t)it * G * hd, 0, sizeof(float) * G * hd);
            continue;
        }
        const int64_t src = share ? share[2 * b] : b;
        const int P = share ? (int)share[2 * b + 1] : 0;
        fn(q + b * sq + (int64_t)h * G * hd, K + b * sb + h * sh, V + b * sb + h * sh, K + src * sb + h * sh,
           V + src * sb + h * sh, P, sw, n, out + (int64_t)it * G * hd, scratch + omp_get_thread_num() * per_thread);
    }
    return 0;
}

}  // namespace

extern "C" {

// Whether (G, hd) has a kernel: G query heads per K/V head in 1..8, hd in {8, 16, 24, 32, 40, 64, 128, 256}.
int rollyard_decode_attn_supports(int G, int hd) { return pick<float>(G, hd) != nullptr; }

// q: [B, KVH, G, hd] with row stride ``sq`` (floats), heads contiguous inside a row, already
// scaled. K, V: strides ``sb`` (row), ``sh`` (head), ``sw`` (position) in elements, last dim
// contiguous. lens: positions each row attends (0..lens[b]-1), or NULL for ``width`` everywhere. share: NULL, or
// [B][2] (src, P): row b's first P positions read from row src (a bitwise copy of them).
// out: [B, KVH * G * hd] contiguous. scratch: threads * G * (width + 16) floats. Returns 0, or -1
// for an unsupported (G, hd).
int rollyard_decode_attn_f32(const float* q, int64_t sq, const float* K, const float* V, int64_t sb,
                             int64_t sh, int64_t sw, const int64_t* lens, const int64_t* share, int B, int KVH,
                             int G, int hd, int width, float* out, float* scratch, int threads) {
    return decode_attn<float>(q, sq, K, V, sb, sh, sw, lens, share, B, KVH, G, hd, width, out, scratch, threads);
}

// The same over a bf16 cache (K, V: bf16 bit patterns, widened exactly; the arithmetic is fp32's).
int rollyard_decode_attn_bf16kv(const float* q, int64_t sq, const uint16_t* K, const uint16_t* V, int64_t sb,
                                int64_t sh, int64_t sw, const int64_t* lens, const int64_t* share, int B, int KVH,
                                int G, int hd, int width, float* out, float* scratch, int threads) {
    return decode_attn<uint16_t>(q, sq, K, V, sb, sh, sw, lens, share, B, KVH, G, hd, width, out, scratch,
                                 threads);
}

}  // extern "C"

namespace {

float sum_squares(const float* x, int64_t d) {
    f16v acc = f16v{};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) { f16v v = ld<f16v>(x + i); acc += v * v; }
    float s = hsum(acc);
    for (; i < d; i++) s += x[i] * x[i];
    return s;
}

}  // namespace

extern "C" {

// RMSNorm of ``rows`` rows of ``d`` floats, ``sx`` floats apart: out[r] = x[r] / sqrt(mean(x[r]^2)
// + eps) * w (w: NULL for none). out: [rows, d] contiguous. The decode step's norms are 32 rows of
// a few hundred floats, where torch's CPU rms_norm (pow, mean, add, rsqrt, two muls, each its own
// kernel) costs ~25 us a call; threads only for large inputs. rinv: each row's 1 / rms, for the
// training backward (NULL: not kept).
void rollyard_rms_norm_f32(const float* x, int64_t sx, const float* w, int64_t rows, int64_t d, float eps,
                           float* out, float* rinv, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d >= (1 << 17))
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * sx;
        float* o = out + r * d;
        const float inv = 1.0f / std::sqrt(sum_squares(xr, d) / (float)d + eps);
        if (rinv) rinv[r] = inv;
        int64_t i = 0;
        if (w) {
            for (; i + 16 <= d; i += 16) st(o + i, ld<f16v>(xr + i) * inv * ld<f16v>(w + i));
            for (; i < d; i++) o[i] = xr[i] * inv * w[i];
        } else {
            for (; i + 16 <= d; i += 16) st(o + i, ld<f16v>(xr + i) * inv);
            for (; i < d; i++) o[i] = xr[i] * inv;
        }
    }
}

}  // extern "C"

// ---- training: RMSNorm backward (its forward is rollyard_rms_norm_f32 with rinv), SwiGLU -----

extern "C" {

// Backward of y = x * rinv * w: dx = rinv * (g - xhat * mean(g * xhat)) with g = dy * w and
// xhat = x * rinv; dw = sum over rows of dy * xhat (per-thread partial sums in ``partial``,
// threads x d floats, then added up).
void rollyard_rms_norm_bwd_f32(const float* x, const float* w, const float* rinv, const float* dy, int64_t rows,
                               int64_t d, float* dx, float* dw, float* partial, int threads) {
    for (int64_t i = 0; i < (int64_t)threads * d; i++) partial[i] = 0.0f;
    int used = 1;
#pragma omp parallel num_threads(threads)
    {
        float* pw = partial + (int64_t)omp_get_thread_num() * d;
#pragma omp single
        used = omp_get_num_threads();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float* xr = x + r * d;
            const float* g = dy + r * d;
            const float inv = rinv[r];
            f16v acc = f16v{};
            float dot = 0.0f;
            int64_t i = 0;
            for (; i + 16 <= d; i += 16) {
                f16v xh = ld<f16v>(xr + i) * inv, gy = ld<f16v>(g + i);
                acc += gy * ld<f16v>(w + i) * xh;
                st(pw + i, ld<f16v>(pw + i) + gy * xh);
            }
            dot = hsum(acc);
            for (; i < d; i++) {
                const float xh = xr[i] * inv;
                dot += g[i] * w[i] * xh;
                pw[i] += g[i] * xh;
            }
            const float m = dot / (float)d;
            float* o = dx + r * d;
            for (i = 0; i + 16 <= d; i += 16)
                st(o + i, (ld<f16v>(g + i) * ld<f16v>(w + i) - ld<f16v>(xr + i) * inv * m) * inv);
            for (; i < d; i++) o[i] = (g[i] * w[i] - xr[i] * inv * m) * inv;
        }
    }
    for (int64_t i = 0; i < d; i++) {
        float s = 0.0f;
        for (int t = 0; t < used; t++) s += partial[(int64_t)t * d + i];
        dw[i] = s;
    }
}

// silu(a) and its derivative from e = exp(-|a|): sigmoid = 1 / (1 + e) for a >= 0, e / (1 + e) else.
static inline void silu_parts(f16v a, f16v* silu, f16v* dsilu) {
    const f16v zero = f16v{};
    f16v e = vexp(a < zero ? a : zero - a);
    f16v one = zero + 1.0f;
    f16v s = (a < zero ? e : one) / (one + e);
    *silu = a * s;
    *dsilu = s * (one + a * (one - s));
}

// SwiGLU forward: gu [rows, 2 * I] (gate | up), out [rows, I] = silu(gate) * up. I % 16 == 0.
void rollyard_swiglu_fwd_f32(const float* gu, int64_t rows, int64_t I, float* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gu + r * 2 * I;
        for (int64_t i = 0; i < I; i += 16) {
            f16v s, ds;
            silu_parts(ld<f16v>(g + i), &s, &ds);
            st(out + r * I + i, s * ld<f16v>(g + I + i));
        }
    }
}

// SwiGLU backward: dgu [rows, 2 * I] = (dout * up * silu'(gate) | dout * silu(gate)).
void rollyard_swiglu_bwd_f32(const float* gu, const float* dout, int64_t rows, int64_t I, float* dgu, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gu + r * 2 * I;
        float* o = dgu + r * 2 * I;
        for (int64_t i = 0; i < I; i += 16) {
            f16v s, ds;
            silu_parts(ld<f16v>(g + i), &s, &ds);
            f16v d = ld<f16v>(dout + r * I + i);
            st(o + i, d * ld<f16v>(g + I + i) * ds);
            st(o + I + i, d * s);
        }
    }
}

}  // extern "C"

// ---- training: q|k|v split + RoPE into attention's layouts ---------------------------------------
//
// y [B, T, (H + 2 KVH) hd] (one fused q|k|v projection) -> q [B, KVH, G T, hd] (the G query heads
// of a K/V head stacked along the query axis), k, v [B, KVH, T, hd], RoPE on q and k:
// out[i] = x[i] cos[t, i] + x[(i + hd/2) % hd] ss[t, i] (ss: sin with rotate_half's sign folded in).

namespace {

inline void rope_row(const float* x, const float* c, const float* s, int hd, float* out) {
    const int h = hd / 2;
    for (int i = 0; i < h; i++) out[i] = x[i] * c[i] + x[i + h] * s[i];
    for (int i = h; i < hd; i++) out[i] = x[i] * c[i] + x[i - h] * s[i];
}

// The adjoint: dx[j] = d[j] cos[j] + d[(j + hd/2) % hd] ss[(j + hd/2) % hd].
inline void rope_row_bwd(const float* d, const float* c, const float* s, int hd, float* dx) {
    const int h = hd / 2;
    for (int j = 0; j < h; j++) dx[j] = d[j] * c[j] + d[j + h] * s[j + h];
    for (int j = h; j < hd; j++) dx[j] = d[j] * c[j] + d[j - h] * s[j - h];
}

}  // namespace

extern "C" {

void rollyard_qkv_rope_fwd_f32(const float* y, int B, int T, int H, int KVH, int hd, const float* cos,
                               const float* ss, float* q, float* k, float* v, int threads) {
    const int G = H / KVH;
    const int64_t n = (int64_t)(H + 2 * KVH) * hd;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bt = 0; bt < (int64_t)B * T; bt++) {
        const int64_t b = bt / T;
        const int t = (int)(bt % T);
        const float* row = y + bt * n;
        const float* c = cos + (int64_t)t * hd;
        const float* s = ss + (int64_t)t * hd;
        for (int h = 0; h < H; h++) {
            const int kv = h / G, g = h % G;
            rope_row(row + (int64_t)h * hd, c, s, hd, q + (((b * KVH + kv) * G + g) * T + t) * hd);
        }
        for (int kv = 0; kv < KVH; kv++) {
            const int64_t at = ((b * KVH + kv) * T + t) * hd;
            rope_row(row + (int64_t)(H + kv) * hd, c, s, hd, k + at);
            std::memcpy(v + at, row + (int64_t)(H + KVH + kv) * hd, sizeof(float) * hd);
        }
    }
}

void rollyard_qkv_rope_bwd_f32(const float* dq, const float* dk, const float* dv, int B, int T, int H, int KVH,
                               int hd, const float* cos, const float* ss, float* dy, int threads) {
    const int G = H / KVH;
    const int64_t n = (int64_t)(H + 2 * KVH) * hd;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bt = 0; bt < (int64_t)B * T; bt++) {
        const int64_t b = bt / T;
        const int t = (int)(bt % T);
        float* row = dy + bt * n;
        const float* c = cos + (int64_t)t * hd;
        const float* s = ss + (int64_t)t * hd;
        for (int h = 0; h < H; h++) {
            const int kv = h / G, g = h % G;
            rope_row_bwd(dq + (((b * KVH + kv) * G + g) * T + t) * hd, c, s, hd, row + (int64_t)h * hd);
        }
        for (int kv = 0; kv < KVH; kv++) {
            const int64_t at = ((b * KVH + kv) * T + t) * hd;
            rope_row_bwd(dk + at, c, s, hd, row + (int64_t)(H + kv) * hd);
            std::memcpy(row + (int64_t)(H + KVH + kv) * hd, dv + at, sizeof(float) * hd);
        }
    }
}

}  // extern "C"

// ---- decode: RoPE on q and k, and the new K / V into the cache ----------------------------------

static inline uint16_t bf16_rne(float f) {  // torch's float -> bfloat16 (round to nearest even; NaN -> quiet NaN)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

namespace {

inline void put_row(float* dst, const float* src, int hd) { std::memcpy(dst, src, sizeof(float) * hd); }
inline void put_row(uint16_t* dst, const float* src, int hd) {  // rounded to bf16 as torch's cast rounds
    for (int i = 0; i < hd; i++) dst[i] = bf16_rne(src[i]);
}

template <typename E>
void rope_write(const float* y, int64_t sy, int B, int H, int KVH, int hd, const float* cos, const float* ss,
                const int64_t* pos, int64_t same_pos, float* qout, E* K, E* V, int64_t sb, int64_t sh, int64_t sw) {
    std::vector<float> k(hd);
    for (int b = 0; b < B; b++) {
        const int64_t p = pos ? pos[b] : same_pos;
        const float* row = y + (int64_t)b * sy;
        const float* c = cos + p * hd;
        const float* s = ss + p * hd;
        for (int h = 0; h < H; h++) rope_row(row + (int64_t)h * hd, c, s, hd, qout + ((int64_t)b * H + h) * hd);
        for (int kv = 0; kv < KVH; kv++) {
            const int64_t at = b * sb + kv * sh + p * sw;
            rope_row(row + (int64_t)(H + kv) * hd, c, s, hd, k.data());
            put_row(K + at, k.data(), hd);
            put_row(V + at, row + (int64_t)(H + KVH + kv) * hd, hd);
        }
    }
}

}  // namespace

extern "C" {

// y: [B, (H + 2 KVH) hd] rows ``sy`` floats apart, one position per row: at ``pos[b]`` (or
// ``same_pos`` for every row when pos is NULL). Writes RoPE'd q to qout [B, H hd] and RoPE'd k and
// v into the cache at K / V + b sb + kv sh + position sw. cos / ss: full [context, hd] tables.
void rollyard_decode_rope_write_f32(const float* y, int64_t sy, int B, int H, int KVH, int hd, const float* cos,
                                    const float* ss, const int64_t* pos, int64_t same_pos, float* qout, float* K,
                                    float* V, int64_t sb, int64_t sh, int64_t sw) {
    rope_write<float>(y, sy, B, H, KVH, hd, cos, ss, pos, same_pos, qout, K, V, sb, sh, sw);
}

// The same into a bf16 cache (K / V: bf16 bit patterns, strides in elements): k and v rounded to bf16 as torch's
// cast rounds; q stays fp32.
void rollyard_decode_rope_write_bf16kv(const float* y, int64_t sy, int B, int H, int KVH, int hd, const float* cos,
                                       const float* ss, const int64_t* pos, int64_t same_pos, float* qout,
                                       uint16_t* K, uint16_t* V, int64_t sb, int64_t sh, int64_t sw) {
    rope_write<uint16_t>(y, sy, B, H, KVH, hd, cos, ss, pos, same_pos, qout, K, V, sb, sh, sw);
}

}  // extern "C"

// ---- AdamW with bf16 moments (trainer.optimizer_state=bf16) -------------------------------------------
// One pass per parameter: m and v are read from bf16, updated in fp32 exactly as torch.optim.AdamW does
// (decoupled weight decay, bias corrections), the fp32 weight is updated, and the moments are written back
// rounded stochastically: v's increment per step, (1 - beta2) g^2 ~ 1e-3 of v, is below bf16's resolution
// (2^-8), so round-to-nearest would freeze v. The random bits are a counter hash (splitmix64) of
// (seed, index): reproducible, different per step and per parameter (the caller's seed), no state.
static inline uint64_t splitmix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}
static inline float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}
// Adds 16 random bits below bf16's last mantissa bit and truncates: rounds up with probability equal to the
// dropped fraction (a carry into the exponent is the correct rounding). Finite inputs only (moments are).
static inline uint16_t f32_to_bf16_sr(float f, uint32_t r16) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return (uint16_t)((b + r16) >> 16);
}

template <bool ZERO_GRAD>
static void adamw_bf16_state(float* p, const float* g, uint16_t* m, uint16_t* v, int64_t n, float lr, float beta1,
                             float beta2, float eps, float wd, float bc1, float bc2, uint64_t seed, int threads) {
    const float step = lr / bc1, decay = 1.f - lr * wd, inv_sqrt_bc2 = 1.f / std::sqrt(bc2);
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= (1 << 16))
    for (int64_t i = 0; i < n; i++) {
        const float gi = ZERO_GRAD ? 0.f : g[i];
        const float mi = beta1 * bf16_to_f32(m[i]) + (1.f - beta1) * gi;
        const float vi = beta2 * bf16_to_f32(v[i]) + (1.f - beta2) * gi * gi;
        p[i] = p[i] * decay - step * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
        const uint64_t r = splitmix(seed ^ (uint64_t)i * 0xd1b54a32d192ed03ULL);
        m[i] = f32_to_bf16_sr(mi, (uint32_t)(r & 0xffff));
        v[i] = f32_to_bf16_sr(vi, (uint32_t)((r >> 16) & 0xffff));
    }
}

// g == nullptr: the step on an exactly zero gradient (a step whose every sample was skipped), no gradient read;
// the same arithmetic as with a zero-filled g (0 * (1 - beta1) adds exactly nothing), so the same bits. Two loops
// (a template), so that neither holds a branch that would keep it from vectorizing.
extern "C" void rollyard_adamw_bf16_state(float* p, const float* g, uint16_t* m, uint16_t* v, int64_t n,
                                          float lr, float beta1, float beta2, float eps, float wd,
                                          float bc1, float bc2, uint64_t seed, int threads) {
    if (g == nullptr)
        adamw_bf16_state<true>(p, g, m, v, n, lr, beta1, beta2, eps, wd, bc1, bc2, seed, threads);
    else
        adamw_bf16_state<false>(p, g, m, v, n, lr, beta1, beta2, eps, wd, bc1, bc2, seed, threads);
}

// ---- AdamW's step on an exactly zero gradient (fp32 moments) -------------------------------------------
// A step whose every sample was skipped (zero advantage) still takes AdamW's step on its zero gradient, as the
// unskipped step would: the moments decay and the weight moves by the decayed momentum. With g = 0 the update
// needs no gradient, so none is allocated, zero-filled, clipped or read: one pass over (p, m, v), 24 B per
// parameter against 28 B plus a 4 B/parameter zero fill. torch.optim.AdamW's order of operations: the decoupled
// decay first, then m <- lerp(m, 0, 1 - beta1), v <- beta2 v, then p -= step_size m / (sqrt(v) / sqrt(bc2) + eps).
// Bit for bit torch's fused CPU AdamW on g = 0: w1 = 1 - beta1 rounded from double as torch's coefficient (1.f - 0.9f
// is not the float nearest 0.1); m's lerp as its one fused multiply-add, and no other contraction (torch rounds each
// vector op), so the compiler may not fuse p * decay - ... into one.
extern "C" __attribute__((optimize("fp-contract=off")))
void rollyard_adamw_f32_zero_grad(float* p, float* m, float* v, int64_t n, float step_size, float decay, float w1,
                                  float beta2, float sqrt_bc2, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= (1 << 16))
    for (int64_t i = 0; i < n; i++) {
        const float mi = std::fma(w1, -m[i], m[i]);  // lerp(m, 0, w1)
        const float vi = v[i] * beta2;
        const float pd = p[i] * decay;
        p[i] = pd - step_size * mi / (std::sqrt(vi) / sqrt_bc2 + eps);
        m[i] = mi;
        v[i] = vi;
    }
}

// ---- the LM head's softmax statistics in training (trainer/head.py) ------------------------------------------------
//
// Per row of logits z [rows, V] (row stride ldz), fp32 or bf16 (trainer/head.py's bf16 head: each element widened to
// fp32 as it is read, its bits shifted up 16, so no fp32 copy of the logits: SmolLM2's 256 x 49152 chunk would be
// 50 MB, ~13 ms of page faults and a pass each time it is made), scaled by s = 1 / temperature (1 for the fp32 head,
// which divides its logits itself: x * 1 is x, the same bits): the log-partition logz = logsumexp(s z) (the max, then
// the log of the sum of exp(s z - max): two reads of the row, no buffer; torch's logsumexp measured 29 ms on SmolLM2's
// 236 x 49152 chunk, 2 threads) and the target's log-prob; the entropy of softmax(s z), logz - sum_v exp(s z_v - logz)
// s z_v, in one read of the row (torch: a subtraction into a [rows, V] buffer, an exp and a batched dot, three passes;
// 25 ms for that chunk); and the backward's gradient in place: fp32, d logp / dz = -g * exp(z - logz) (torch: a
// subtraction, an exp and a multiply, three passes); bf16, the whole d (sum_r g_r logp_r) / dz, (1[v = y_r] - p_rv)
// g_r s, written over the row in bf16 (round to nearest even, NaN kept NaN: torch's cast). exp is vexp's (relative
// error ~2e-7 against torch's exp).
namespace {
inline float wide(float x) { return x; }
inline float wide(uint16_t h) {
    const uint32_t i = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}

// A row's max (16 lanes, then the lanes and the tail in order)
template <typename E>
inline float row_max(const E* zr, int64_t V) {
    f16v mv = f16v{} - INFINITY;
    int64_t v = 0;
    for (; v + 16 <= V; v += 16) {
        const f16v x = ld<f16v>(zr + v);
        mv = x > mv ? x : mv;
    }
    float m = -INFINITY;
    for (int i = 0; i < 16; i++) m = mv[i] > m ? mv[i] : m;
    for (; v < V; v++) m = wide(zr[v]) > m ? wide(zr[v]) : m;
    return m;
}

// logz and lp = s z[target] - logz (s > 0: the max of s z is s times the max of z)
template <typename E>
inline void logsumexp_rows(const E* z, int64_t rows, int64_t V, int64_t ldz, float s, const int64_t* targets,
                           float* logz, float* lp, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * V >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const E* zr = z + r * ldz;
        const float m = row_max(zr, V) * s;
        const f16v M = f16v{} + m, S = f16v{} + s;
        f16v acc = f16v{};
        int64_t v = 0;
        for (; v + 16 <= V; v += 16) acc += vexp(ld<f16v>(zr + v) * S - M);
        float tail = 0.0f;
        for (; v < V; v++) tail += std::exp(wide(zr[v]) * s - m);
        logz[r] = m + std::log(hsum(acc) + tail);
        if (lp) lp[r] = wide(zr[targets[r]]) * s - logz[r];
    }
}

template <typename E>
inline void entropy_rows(const E* z, int64_t rows, int64_t V, int64_t ldz, float s, const float* logz, float* out,
                         int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * V >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const E* zr = z + r * ldz;
        const float L = logz[r];
        const f16v Lv = f16v{} + L, S = f16v{} + s;
        f16v acc = f16v{};
        int64_t v = 0;
        for (; v + 16 <= V; v += 16) {
            const f16v x = ld<f16v>(zr + v) * S;
            acc += vexp(x - Lv) * x;
        }
        float tail = 0.0f;
        for (; v < V; v++) {
            const float x = wide(zr[v]) * s;
            tail += std::exp(x - L) * x;
        }
        out[r] = L - (hsum(acc) + tail);
    }
}

typedef uint32_t u16w __attribute__((vector_size(64)));  // 16 x uint32
typedef uint16_t h16w __attribute__((vector_size(32)));  // 16 x uint16

inline uint16_t f32_bf(float f) {
    if (f != f) return 0x7FC0;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline void st_bf16(uint16_t* p, f16v x) {
    u16w u;
    std::memcpy(&u, &x, 64);
    const u16w nan = (u16w)(x != x);
    u = (((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) & ~nan) | (nan & 0x7FC0u);
    const h16w h = __builtin_convertvector(u, h16w);
    std::memcpy(p, &h, 32);
}
}  // namespace

extern "C" void rollyard_softmax_entropy_f32(const float* z, int64_t rows, int64_t V, int64_t ldz, const float* logz,
                                             float* out, int threads) {
    entropy_rows(z, rows, V, ldz, 1.0f, logz, out, threads);
}

extern "C" void rollyard_logsumexp_f32(const float* z, int64_t rows, int64_t V, int64_t ldz, const int64_t* targets,
                                       float* logz, float* lp, int threads) {
    logsumexp_rows(z, rows, V, ldz, 1.0f, targets, logz, lp, threads);
}

extern "C" void rollyard_softmax_grad_f32(float* z, int64_t rows, int64_t V, int64_t ldz, const float* logz,
                                          const float* g, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * V >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        float* zr = z + r * ldz;
        const float L = logz[r];
        const f16v Lv = f16v{} + L, gv = f16v{} - g[r];
        int64_t v = 0;
        for (; v + 16 <= V; v += 16) st(zr + v, vexp(ld<f16v>(zr + v) - Lv) * gv);
        for (; v < V; v++) zr[v] = std::exp(zr[v] - L) * -g[r];
    }
}

extern "C" void rollyard_logsumexp_bf16(const uint16_t* z, int64_t rows, int64_t V, int64_t ldz, float s,
                                        const int64_t* targets, float* logz, float* lp, int threads) {
    logsumexp_rows(z, rows, V, ldz, s, targets, logz, lp, threads);
}

extern "C" void rollyard_softmax_entropy_bf16(const uint16_t* z, int64_t rows, int64_t V, int64_t ldz, float s,
                                              const float* logz, float* out, int threads) {
    entropy_rows(z, rows, V, ldz, s, logz, out, threads);
}

// z overwritten in bf16 with (1[v = y_r] - exp(s z_v - logz_r)) g_r s: d (sum_r g_r logp_r) / d z, one pass
extern "C" void rollyard_logprob_grad_bf16(uint16_t* z, int64_t rows, int64_t V, int64_t ldz, float s,
                                           const float* logz, const float* g, const int64_t* targets, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * V >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        uint16_t* zr = z + r * ldz;
        const float L = logz[r], gs = g[r] * s;
        const float at = wide(zr[targets[r]]) * s;  // read before the row is overwritten
        const f16v Lv = f16v{} + L, S = f16v{} + s, G = f16v{} - gs;
        int64_t v = 0;
        for (; v + 16 <= V; v += 16) st_bf16(zr + v, vexp(ld<f16v>(zr + v) * S - Lv) * G);
        for (; v < V; v++) zr[v] = f32_bf(std::exp(wide(zr[v]) * s - L) * -gs);
        zr[targets[r]] = f32_bf((1.0f - std::exp(at - L)) * gs);
    }
}

// ---- the gradient norm (trainer/trainer.py): each tensor's sum of squares ---------------------------------------------
// Tensor i (`sizes[i]` fp32 values at `ptrs[i]`): its squares summed over chunks of CH values (16-lane fp32 vectors,
// then the lanes and the tail in double, in order), the chunks' sums added in double in chunk order into `out[i]`:
// the same value for any thread count. One read of the gradients, both threads on it (torch's get_total_norm: a
// foreach fp32 norm per tensor, then the norm of those: ~63 ms for SmolLM2's 0.54 GB on 2 threads here).
extern "C" void rollyard_sum_squares_f32(const float* const* ptrs, const int64_t* sizes, int n, double* out,
                                         int threads) {
    constexpr int64_t CH = 1 << 16;
    std::vector<int64_t> first(n + 1, 0);  // tensor i's chunks: [first[i], first[i + 1])
    for (int i = 0; i < n; i++) first[i + 1] = first[i] + (sizes[i] + CH - 1) / CH;
    std::vector<double> part(first[n]);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < first[n]; c++) {
        int t = 0;
        while (first[t + 1] <= c) t++;
        const int64_t o = (c - first[t]) * CH, e = o + CH < sizes[t] ? o + CH : sizes[t];
        const float* x = ptrs[t];
        f16v acc = f16v{};
        int64_t i = o;
        for (; i + 16 <= e; i += 16) {
            const f16v v = ld<f16v>(x + i);
            acc += v * v;
        }
        double sum = 0.0;
        for (int l = 0; l < 16; l++) sum += acc[l];
        for (; i < e; i++) sum += (double)x[i] * x[i];
        part[c] = sum;
    }
    for (int i = 0; i < n; i++) {
        double sum = 0.0;
        for (int64_t c = first[i]; c < first[i + 1]; c++) sum += part[c];
        out[i] = sum;
    }
}

// ---- the rollout's draw: inverse CDF over unnormalised weights -------------------------------------------------
// Row b of ``w [rows, V]`` (non-negative floats): the running sum c_i = w_0 + ... + w_i in double, added in index
// order (torch's CPU cumsum of the fp64 weights: one double accumulator, each float widened exactly), the target
// u = r[b] * c_{V-1}, and the first i with c_i > u (V - 1 if none): ``searchsorted(c, u, right=True)`` clamped,
// the same index bit for bit. Two things make it cheaper than cumsum + searchsorted, without changing one sum:
// - no [rows, V] fp64 copy nor running-sum tensor: the sums are read as they are made;
// - eight rows at a time, one accumulator each: eight independent chains of adds where one row's chain waits on
//   each add's latency. The running sum is kept at the end of every block of 64; the search scans those, then
//   re-adds the one block from its start, which repeats the same adds from the same value.
// ``totals`` (may be NULL): each row's c_{V-1}.
extern "C" void rollyard_inverse_cdf_f32(const float* w, int64_t rows, int64_t V, const double* r, int64_t* out,
                                         double* totals, int threads) {
    constexpr int R = 8;
    constexpr int64_t BLK = 64;
    const int64_t nb = (V + BLK - 1) / BLK, groups = (rows + R - 1) / R;
#pragma omp parallel num_threads(threads) if (rows * V >= (1 << 17))
    {
        double* ends = new double[R * nb];
#pragma omp for schedule(static)
        for (int64_t gi = 0; gi < groups; gi++) {
            const int64_t r0 = gi * R;
            const int n = (int)(rows - r0 < R ? rows - r0 : R);
            const float* row[R];
            for (int k = 0; k < R; k++) row[k] = w + (r0 + (k < n ? k : n - 1)) * V;  // short group: repeats
            double acc[R] = {};
            for (int64_t b = 0; b < nb; b++) {
                const int64_t hi = (b + 1) * BLK < V ? (b + 1) * BLK : V;
                for (int64_t i = b * BLK; i < hi; i++)
                    for (int k = 0; k < R; k++) acc[k] += (double)row[k][i];
                for (int k = 0; k < R; k++) ends[k * nb + b] = acc[k];
            }
            for (int k = 0; k < n; k++) {
                const double* e = ends + k * nb;
                const double u = r[r0 + k] * e[nb - 1];
                if (totals) totals[r0 + k] = e[nb - 1];
                int64_t b = 0;
                while (b < nb && !(e[b] > u)) b++;
                int64_t pick = V - 1;
                if (b < nb) {
                    double c = b ? e[b - 1] : 0.0;
                    const int64_t hi = (b + 1) * BLK < V ? (b + 1) * BLK : V;
                    for (int64_t i = b * BLK; i < hi; i++) {
                        c += (double)row[k][i];
                        if (c > u) { pick = i; break; }
                    }
                }
                out[r0 + k] = pick;
            }
        }
        delete[] ends;
    }
}

// ---- the rollout's draw from softmax(z), fused (rollout/engine.py `_sample`) ---------------------------------------
//
// Per row of logits z [rows, V] (row stride ldz): m = max(z); the weights w_i = exp(z_i - m) (vexp's, relative error
// ~2e-7) a 64-wide block at a time (softmax_block): the block's sum (16-lane fp32 adds, then the lanes in double) and
// the running block ends in double; the draw is the first index whose running sum (the block end before it, then the
// block's weights, computed again, bit for bit, and added in double one by one) exceeds u = r[row] * total, else the
// block's last index with a non-zero weight (the one-by-one sums rounding below the block's end), else V - 1; lp =
// z[tok] - m - log(total). Two reads of a row and no [rows, V] write, where log_softmax, exp and the inverse-CDF kernel
// read it four times and write it twice. Tokens with z_i < m - 87 get exp(-87) (~1.6e-38 of the max's weight), not 0:
// never drawn at any vocabulary size below ~1e37. Rows in parallel; a row's numbers do not depend on the thread count.
namespace {
constexpr int64_t DRAW_BLK = 64;
inline double softmax_block(const float* zr, int64_t lo, int64_t hi, float m, float* wb) {
    const f16v M = f16v{} + m;
    f16v acc = f16v{};
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        const f16v e = vexp(ld<f16v>(zr + i) - M);
        st(wb + (i - lo), e);
        acc += e;
    }
    double s = 0.0;
    for (int k = 0; k < 16; k++) s += (double)acc[k];
    for (; i < hi; i++) {
        wb[i - lo] = std::exp(zr[i] - m);
        s += (double)wb[i - lo];
    }
    return s;
}
}  // namespace

extern "C" void rollyard_softmax_draw_f32(const float* z, int64_t rows, int64_t V, int64_t ldz, const double* r,
                                          int64_t* out, float* lp, int threads) {
    const int64_t nb = (V + DRAW_BLK - 1) / DRAW_BLK;
#pragma omp parallel num_threads(threads) if (rows * V >= (1 << 16))
    {
        double* ends = new double[nb];
        alignas(64) float wb[DRAW_BLK];
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            const float* zr = z + row * ldz;
            const float m = row_max(zr, V);
            double total = 0.0;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t lo = b * DRAW_BLK;
                total += softmax_block(zr, lo, lo + DRAW_BLK < V ? lo + DRAW_BLK : V, m, wb);
                ends[b] = total;
            }
            const double u = r[row] * total;
            int64_t b = 0;
            while (b < nb && !(ends[b] > u)) b++;
            int64_t pick = V - 1;
            if (b < nb) {
                const int64_t lo = b * DRAW_BLK, hi = lo + DRAW_BLK < V ? lo + DRAW_BLK : V;
                softmax_block(zr, lo, hi, m, wb);
                double c = b ? ends[b - 1] : 0.0;
                pick = -1;
                for (int64_t i = lo; i < hi && pick < 0; i++) {
                    c += (double)wb[i - lo];
                    if (c > u) pick = i;
                }
                for (int64_t i = hi - 1; pick < 0 && i >= lo; i--)
                    if (wb[i - lo] > 0.0f) pick = i;
                if (pick < 0) pick = hi - 1;
            }
            out[row] = pick;
            lp[row] = (float)((double)zr[pick] - (double)m - std::log(total));
        }
        delete[] ends;
    }
}

// ---- bf16 GEMM for the decode engine: y = round_bf16(bf16(x) @ W^T + bias) (+ add), fp32 in and out ----------------
//
// The rollout's matmuls at bf16 precision (model/fast.py, `mixed`): fp32 activations, bf16 weights, output rounded to
// bf16 as a bf16 matmul's is, then used in fp32. torch runs that as a cast of x, oneDNN's bf16 matmul and a cast back
// (three calls, two fresh tensors). Here it is one call, and the weights sit in a layout written in one pass from
// the trainer's fp32 tensors (cast, scale and layout together: no separate reorder at a weight refresh).
//
// Layout `P`: W [N, K] (N % 64 == 0, K % 32 == 0) as [N/64][K/32][16][64][2] bf16: block (nb, kb) holds columns
// nb*64.. and inputs kb*32..; within it, pair p's 64 columns' (k = 2p, 2p+1) values side by side, so one 64-byte
// load is 16 columns' pairs: the operand of vdpbf16ps. (oneDNN's AB16b64a2b for these shapes.)
//
// Kernel: per 64-column block, row groups of up to 6 rows x 4 vectors of 16 columns = 24 accumulators; each row's
// bf16 pair broadcast from memory; K in order, one accumulator per output (no K split), so the sum is a chain of
// vdpbf16ps in input order. The next block's weights are prefetched into L2 while the first row group runs, which
// overlaps the weights' stream from memory with the arithmetic at decode's 1-32 rows.
//
// Without AVX512-BF16 (AVX-512F, or AVX2 + FMA: most laptops) the same layout runs on fp32 FMAs: a pair's two bf16
// weights become fp32 in registers (a shift, a mask: bf16 is fp32's upper half), the input is rounded to bf16 once
// into an fp32 scratch, and each pair is two FMAs in vdpbf16ps' order (odd input, then even). A product of two bf16
// values is exact in fp32, so each FMA rounds as vdpbf16ps' step does: the numbers are the native kernel's (but for
// subnormals, which vdpbf16ps flushes). What it buys over fp32 weights: half the bytes a decode step streams.
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define ROLLYARD_GEMM_BF16 1
#define ROLLYARD_BF16_NATIVE 1
#elif defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ROLLYARD_GEMM_BF16 1
#endif

namespace {

// fp32 -> bf16 (nearest even; NaN -> quiet NaN) -> fp32, as torch's cast: a bf16 matmul's output rounding
#if defined(__AVX512F__) && defined(__AVX512BF16__)
inline __m512 round_bf16(__m512 v) {  // vcvtneps2bf16
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
#elif defined(__AVX512F__)
inline __m512 round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000)));
}
#elif defined(__AVX2__)
inline __m256 round_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}
#endif

// One input step of an fp32 tile: MR rows' input k (row stride ldx) times the 64 (AVX-512) or 16 (AVX2) columns'
// weights at wk, into the accumulators: one FMA per output, so each output's sum runs over the inputs in order.
#if defined(__AVX512F__)
template <int MR>
inline __attribute__((always_inline)) void fma_step(const float* x, int64_t ldx, int64_t k, const float* wk,
                                                    __m512 (&acc)[MR][4]) {
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    for (int r = 0; r < MR; r++) {
        const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
        acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(a, w2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(a, w3, acc[r][3]);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
template <int MR>
inline __attribute__((always_inline)) void fma_step(const float* x, int64_t ldx, int64_t k, const float* wk,
                                                    __m256 (&acc)[MR][2]) {
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
    for (int r = 0; r < MR; r++) {
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
        acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
    }
}
#endif

// The decode matmuls' work split: (column block, row group of `mr` rows) units in block order, split evenly over the
// team's threads (a block's groups may go to two). Inside an OpenMP parallel region.
struct Units {
    int64_t groups, u0, u1, last;  // this thread's units [u0, u1); its last block (-1: none)
};
inline Units thread_units(int64_t M, int64_t mr, int64_t nblocks) {
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t groups = (M + mr - 1) / mr, units = nblocks * groups;
    const int64_t u0 = units * t / T, u1 = units * (t + 1) / T;
    return {groups, u0, u1, u1 > u0 ? (u1 - 1) / groups : -1};
}

// fn(nb, m0, rows, first, n) for each of this thread's units: its block, first row and row count, and its share of
// the next block's `lines` cache lines to prefetch while it runs (lines [first, first + n); none past its last block)
template <typename F>
inline void for_units(int64_t M, int64_t mr, int64_t nblocks, int64_t lines, F&& fn) {
    const Units us = thread_units(M, mr, nblocks);
    const int64_t share = (lines + us.groups - 1) / us.groups;
    for (int64_t u = us.u0; u < us.u1; u++) {
        const int64_t nb = u / us.groups, g = u % us.groups, m0 = g * mr;
        const int64_t first = g * share < lines ? g * share : lines;
        fn(nb, m0, (int)(M - m0 < mr ? M - m0 : mr), first,
           nb < us.last ? (first + share < lines ? share : lines - first) : 0);
    }
}

// A tile's output vector (__m512 or __m256): + bias, then (R) rounded to bf16 as a bf16 matmul's output, then + add
// (the residual), stored; `bias` / `add` / `y` point at the vector's columns (bias, add null: none)
template <bool R, typename V>
inline void out_vec(V v, const float* bias, const float* add, float* y) {
    if (bias) v += ld<V>(bias);
    if constexpr (R) v = round_bf16(v);
    if (add) v += ld<V>(add);
    st(y, v);
}

inline uint16_t bf16_rne_nb(float f) {  // bf16_rne without a branch (vectorizes)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);
}

// A weight pack's output takes streaming stores (transpose16<true>) where it starts on a 64-byte line and this build
// has AVX-512 (every result row is then a whole line); store_fence orders them before the pack returns.
inline bool streams(const void* out) {
#ifdef __AVX512F__
    return ((uintptr_t)out & 63) == 0;
#else
    (void)out;
    return false;
#endif
}

inline void store_fence() {
#ifdef __AVX512F__
    _mm_sfence();
#endif
}

// dst[p * ld_dst + i] = src[i * ld_src + p] for a 16 x 16 block of uint32. NT: each result row (a 64-byte line
// at a 64-byte aligned dst, ld_dst a multiple of 16) written with a streaming store, not read into the cache first:
// a weight pack's output is written once and read by the next decode step from memory anyway (the caller fences).
template <bool NT = false>
inline void transpose16(const uint32_t* src, int64_t ld_src, uint32_t* dst, int64_t ld_dst) {
#ifdef __AVX512F__
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * ld_src);
    for (int i = 0; i < 8; i++) {  // per 128-bit lane: pairs of rows interleaved
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {  // u[4g + j], lane L: rows 4g..4g+3, element 4L + j
        r[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g + 0], t[4 * g + 2]);
        r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g + 0], t[4 * g + 2]);
        r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; j++) {  // row 4L + j of the result: lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
        const __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        const __m512i w[4] = {_mm512_shuffle_i32x4(v0, v2, 0x88), _mm512_shuffle_i32x4(v0, v2, 0xDD),
                              _mm512_shuffle_i32x4(v1, v3, 0x88), _mm512_shuffle_i32x4(v1, v3, 0xDD)};
        for (int q = 0; q < 4; q++) {
            if constexpr (NT) _mm512_stream_si512((__m512i*)(dst + (4 * q + j) * ld_dst), w[q]);
            else _mm512_storeu_si512(dst + (4 * q + j) * ld_dst, w[q]);
        }
    }
#else
    for (int p = 0; p < 16; p++)
        for (int i = 0; i < 16; i++) dst[p * ld_dst + i] = src[i * ld_src + p];
#endif
}

}  // namespace

// dst [cols, rows] (contiguous) = the transpose of src [rows, cols] (row stride ld), 32-bit elements: 16 x 16 blocks
// through registers, threads over 16-column strips (each reads a strip of src down its rows and writes 16 whole rows
// of dst). torch's copy of a transposed fp32 matrix ran at ~2-5 GB/s on the trainer's shapes (a 314 x 3072 gradient:
// 1.5 ms, against 0.28 ms to copy it as it lies); oneDNN's matmul needs its input contiguous.
extern "C" void rollyard_transpose_32(const uint32_t* src, int64_t rows, int64_t cols, int64_t ld, uint32_t* dst,
                                      int threads) {
    const int64_t rb = rows / 16, cb = cols / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * cols >= (1 << 16))
    for (int64_t j = 0; j < cb; j++) {
        for (int64_t i = 0; i < rb; i++) transpose16(src + i * 16 * ld + j * 16, ld, dst + j * 16 * rows + i * 16, rows);
        for (int64_t i = rb * 16; i < rows; i++)
            for (int c = 0; c < 16; c++) dst[(j * 16 + c) * rows + i] = src[i * ld + j * 16 + c];
    }
    for (int64_t c = cb * 16; c < cols; c++)
        for (int64_t i = 0; i < rows; i++) dst[c * rows + i] = src[i * ld + c];
}

namespace {

#if defined(ROLLYARD_GEMM_BF16) && defined(__AVX512F__)
// The input, rounded to bf16: with AVX512-BF16 as bf16 pairs (k even low, k odd high), `kp` pairs a row; without it
// held as fp32, each pair's two swapped (odd input first: 2 * kp floats a row).
#ifdef ROLLYARD_BF16_NATIVE
using XS = uint32_t;
constexpr int64_t XS_PER_PAIR = 1;
#else
using XS = float;
constexpr int64_t XS_PER_PAIR = 2;
#endif

// MR rows x the block's 64 columns. Without AVX512-BF16 this tile runs up to one row group (decode at small batch,
// bound by the weights' bytes) and widens each pair in registers.
template <int MR>
inline void gemm_tile(const XS* xs, int64_t kp, const uint16_t* wb, int64_t kblocks, const char* pf, int64_t pf_lines,
                      const float* bias, int64_t col0, const float* add, int64_t ldadd, float* y, int64_t ldy) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
    // pf: this tile's share of the next column block (pf_lines cache lines), one line per pair step, into L2
    int64_t line = 0;
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t* blk = wb + kb * 2048;
        for (int p = 0; p < 16; p++) {
            if (line < pf_lines) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
            const uint16_t* wp = blk + p * 128;
            const XS* xp = xs + XS_PER_PAIR * (kb * 16 + p);
#ifdef ROLLYARD_BF16_NATIVE
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
            __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64);
            __m512bh w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
            for (int r = 0; r < MR; r++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32((int)xp[r * kp]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
            }
#else
            const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {  // columns 0-31, then 32-63: 4 widened vectors live, not 8
                const __m512i r0 = _mm512_loadu_si512(wp + 64 * h), r1 = _mm512_loadu_si512(wp + 64 * h + 32);
                const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(r0, 16));
                const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(r0, hi));
                const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(r1, 16));
                const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(r1, hi));
                for (int r = 0; r < MR; r++) {
                    const __m512 xo = _mm512_set1_ps(xp[r * 2 * kp]), xe = _mm512_set1_ps(xp[r * 2 * kp + 1]);
                    acc[r][2 * h] = _mm512_fmadd_ps(xe, e0, _mm512_fmadd_ps(xo, o0, acc[r][2 * h]));
                    acc[r][2 * h + 1] = _mm512_fmadd_ps(xe, e1, _mm512_fmadd_ps(xo, o1, acc[r][2 * h + 1]));
                }
            }
#endif
        }
    }
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 4; q++)
            out_vec<true>(acc[r][q], bias ? bias + col0 + q * 16 : nullptr,
                          add ? add + r * ldadd + col0 + q * 16 : nullptr, y + r * ldy + col0 + q * 16);
}
#elif defined(ROLLYARD_GEMM_BF16)
// AVX2: MR rows x 16 columns (two 8-float vectors) of a block at `wb` (offset to the tile's columns' pairs); the
// block's four 16-column tiles run one after another (as the fp32 AVX2 tile). The same FMA order: the same numbers.
// The input as the AVX-512 build's.
using XS = float;
constexpr int64_t XS_PER_PAIR = 2;

template <int MR>
inline void gemm_tile(const float* xs, int64_t kp, const uint16_t* wb, int64_t kblocks, const char* pf,
                      int64_t pf_lines, const float* bias, int64_t col0, const float* add, int64_t ldadd, float* y,
                      int64_t ldy) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    int64_t line = 0;
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t* blk = wb + kb * 2048;
        for (int p = 0; p < 16; p++) {
            if (line < pf_lines) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
            const uint16_t* wp = blk + p * 128;
            const float* xp = xs + 2 * (kb * 16 + p);
            const __m256i r0 = _mm256_loadu_si256((const __m256i*)wp), r1 = _mm256_loadu_si256((const __m256i*)(wp + 16));
            const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(r0, 16));
            const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(r0, hi));
            const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(r1, 16));
            const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(r1, hi));
            for (int r = 0; r < MR; r++) {
                const __m256 xo = _mm256_broadcast_ss(xp + r * 2 * kp), xe = _mm256_broadcast_ss(xp + r * 2 * kp + 1);
                acc[r][0] = _mm256_fmadd_ps(xe, e0, _mm256_fmadd_ps(xo, o0, acc[r][0]));
                acc[r][1] = _mm256_fmadd_ps(xe, e1, _mm256_fmadd_ps(xo, o1, acc[r][1]));
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 2; q++)
            out_vec<true>(acc[r][q], bias ? bias + col0 + q * 8 : nullptr, add ? add + r * ldadd + col0 + q * 8 : nullptr,
                          y + r * ldy + col0 + q * 8);
}

// One row x the block's 64 columns (decode at batch 1): the block's pairs read in order, a whole 256-byte pair at a
// time, where the 16-column tiles would read each pair's quarter in four passes (the weights' stream from memory
// strided); the same FMA order per output, so the same numbers.
inline void gemm_row_bf16(const float* xs, const uint16_t* wb, int64_t kblocks, const char* pf, int64_t pf_lines,
                          const float* bias, int64_t col0, const float* add, float* y) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    int64_t line = 0;
    for (int64_t j = 0; j < kblocks * 16; j++) {  // pair j
        if (line < pf_lines) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
        const uint16_t* wp = wb + j * 128;
        const __m256 xo = _mm256_broadcast_ss(xs + 2 * j), xe = _mm256_broadcast_ss(xs + 2 * j + 1);
        for (int q = 0; q < 8; q++) {
            const __m256i r = _mm256_loadu_si256((const __m256i*)(wp + 16 * q));
            const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16)), o = _mm256_castsi256_ps(_mm256_and_si256(r, hi));
            acc[q] = _mm256_fmadd_ps(xe, e, _mm256_fmadd_ps(xo, o, acc[q]));
        }
    }
    for (int q = 0; q < 8; q++)  // acc[q]: columns 8q.. (pair layout: 16 columns x 2 per 32 bf16)
        out_vec<true>(acc[q], bias ? bias + col0 + q * 8 : nullptr, add ? add + col0 + q * 8 : nullptr, y + col0 + q * 8);
}
#endif

#if defined(ROLLYARD_GEMM_BF16) && !defined(ROLLYARD_BF16_NATIVE)
// Past one row group the weights are widened once per chunk of KC inputs (by the first row group's tile, as it goes)
// and every row group of the block runs over the chunk from L1, its accumulators kept in a buffer between chunks:
// widening in registers for every row group (a shift and a mask per 16 weights, on the ports the FMAs use) cost ~35%
// over fp32 at 32 rows; a whole block widened at once (147-393 KB) was bound by writing it out to L2 (~23 GB/s
// here), and a chunk widened in a pass of its own (16 KB) still cost ~25% (the stores do not overlap the FMAs).
constexpr int64_t KC = 64;  // inputs a chunk: 64 x 64 fp32 = 16 KB

// acc [rows][64] (+)= x [rows, kc] (row stride ldx) @ w [kc][64] (fp32, this chunk), one FMA per input in order.
// W: first widen each pair of `raw` (layout P, the chunk's first pair) into w just before its FMAs, so the stores
// run beside the arithmetic (the block's first row group does this; the others read w).
template <int MR, bool W>
inline void chunk_tile(const float* x, int64_t ldx, float* w, int64_t kc, float* acc, bool first,
                       const uint16_t* raw) {
#if defined(__AVX512F__)
    __m512 a[MR][4];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 4; q++) a[r][q] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * 64 + 16 * q);
    for (int64_t k = 0; k < kc; k++) {
        float* wk = w + k * 64;
        if constexpr (W) {
            if (!(k & 1)) {  // pair k / 2: rows k (odd input) and k + 1 (even)
                const uint16_t* wp = raw + k * 64;
                for (int q = 0; q < 4; q++) {
                    const __m512i r = _mm512_loadu_si512(wp + 32 * q);
                    _mm512_storeu_ps(wk + 16 * q, _mm512_castsi512_ps(
                        _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u))));
                    _mm512_storeu_ps(wk + 64 + 16 * q, _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)));
                }
            }
        }
        fma_step<MR>(x, ldx, k, wk, a);
    }
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 4; q++) _mm512_storeu_ps(acc + r * 64 + 16 * q, a[r][q]);
#else
    for (int q = 0; q < 4; q++) {  // 16 columns at a time: MR x 2 accumulators
        __m256 a[MR][2];
        for (int r = 0; r < MR; r++)
            for (int h = 0; h < 2; h++)
                a[r][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * 64 + 16 * q + 8 * h);
        for (int64_t k = 0; k < kc; k++) {
            float* wk = w + k * 64 + 16 * q;
            if constexpr (W) {
                if (!(k & 1)) {  // this strip's 16 columns of pair k / 2
                    const uint16_t* wp = raw + k * 64 + 32 * q;
                    for (int h = 0; h < 2; h++) {
                        const __m256i r = _mm256_loadu_si256((const __m256i*)(wp + 16 * h));
                        _mm256_storeu_ps(wk + 8 * h, _mm256_castsi256_ps(
                            _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u))));
                        _mm256_storeu_ps(wk + 64 + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(r, 16)));
                    }
                }
            }
            fma_step<MR>(x, ldx, k, wk, a);
        }
        for (int r = 0; r < MR; r++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc + r * 64 + 16 * q + 8 * h, a[r][h]);
    }
#endif
}

template <int MR, bool W>
inline void chunk_rows(const float* x, int64_t ldx, float* w, int64_t kc, float* acc, bool first, const uint16_t* raw,
                       int rows) {
    if (rows == MR) chunk_tile<MR, W>(x, ldx, w, kc, acc, first, raw);
    else if constexpr (MR > 1) chunk_rows<MR - 1, W>(x, ldx, w, kc, acc, first, raw, rows);
}

// y rows [rows][64 at col0] = round_bf16(acc + bias) + add
inline void chunk_out(const float* acc, int rows, const float* bias, int64_t col0, const float* add, int64_t ldadd,
                      float* y, int64_t ldy) {
#if defined(__AVX512F__)
    constexpr int W = 16;
#else
    constexpr int W = 8;
#endif
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 64; c += W) {
#if defined(__AVX512F__)
            const __m512 v = _mm512_loadu_ps(acc + r * 64 + c);
#else
            const __m256 v = _mm256_loadu_ps(acc + r * 64 + c);
#endif
            out_vec<true>(v, bias ? bias + col0 + c : nullptr, add ? add + r * ldadd + col0 + c : nullptr,
                          y + r * ldy + col0 + c);
        }
}
#endif

#ifdef ROLLYARD_GEMM_BF16
template <int MR>
inline void gemm_rows(const XS* xs, int64_t kp, const uint16_t* wb, int64_t kblocks, const char* pf,
                      int64_t pf_lines, const float* bias, int64_t col0, const float* add, int64_t ldadd, float* y,
                      int64_t ldy, int rows) {
    if (rows == MR) gemm_tile<MR>(xs, kp, wb, kblocks, pf, pf_lines, bias, col0, add, ldadd, y, ldy);
    else if constexpr (MR > 1)
        gemm_rows<MR - 1>(xs, kp, wb, kblocks, pf, pf_lines, bias, col0, add, ldadd, y, ldy, rows);
}
#endif

}  // namespace

// 2: vdpbf16ps (AVX512-BF16); 1: the widening kernel (fp32 FMAs over bf16 weights); 0: none in this build
extern "C" int rollyard_gemm_bf16_available() {
#if defined(ROLLYARD_BF16_NATIVE)
    return 2;
#elif defined(ROLLYARD_GEMM_BF16)
    return 1;
#else
    return 0;
#endif
}

// Write the fused weight [sum(rows), K] of `nparts` row blocks (part i: `rows[i]` rows of fp32 (`bf16` 0) or bf16
// (1) values at `srcs[i]`, row-major, times `scales[i]` when that is not 1) into layout P at `out`, rounded to bf16 as
// torch's cast rounds (a product in fp32 first). Columns N = sum(rows) % 64 == 0, K % 32 == 0 (the caller checks).
extern "C" void rollyard_pack_bf16(const void* const* srcs, const int64_t* rows, const float* scales, const int* bf16,
                                   int nparts, int64_t K, uint16_t* out, int threads) {
    int64_t N = 0;
    for (int i = 0; i < nparts; i++) N += rows[i];
    const int64_t nblocks = N / 64, kblocks = K / 32, kp = K / 2;
    const bool nt = streams(out);
#pragma omp parallel num_threads(threads)
    {
        // a block's 64 rows as bf16 pairs, row-major (read in order), then written out pair-major (layout P)
        uint32_t* buf = new uint32_t[64 * kp];
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            for (int c = 0; c < 64; c++) {
                int64_t n = nb * 64 + c, part = 0;
                while (n >= rows[part]) n -= rows[part++];
                const float s = scales[part];
                uint32_t* dst = buf + c * kp;
                if (bf16[part]) {
                    const uint32_t* src = (const uint32_t*)((const uint16_t*)srcs[part] + n * K);
                    if (s == 1.0f) {
                        std::memcpy(dst, src, kp * 4);
                    } else {
                        for (int64_t j = 0; j < kp; j++)
                            dst[j] = bf16_rne(bf16_to_f32((uint16_t)src[j]) * s)
                                     | (uint32_t)bf16_rne(bf16_to_f32((uint16_t)(src[j] >> 16)) * s) << 16;
                    }
                } else {
                    const float* src = (const float*)srcs[part] + n * K;
                    uint16_t* d16 = (uint16_t*)dst;  // a pair (k even, k odd) is one uint32, low half first
                    if (s == 1.0f) {
                        for (int64_t k = 0; k < K; k++) d16[k] = bf16_rne_nb(src[k]);
                    } else {
                        for (int64_t k = 0; k < K; k++) d16[k] = bf16_rne_nb(src[k] * s);
                    }
                }
            }
            uint32_t* o = (uint32_t*)(out + nb * kblocks * 2048);
            for (int64_t kb = 0; kb < kblocks; kb++, o += 1024)
                for (int cg = 0; cg < 4; cg++) {
                    if (nt) transpose16<true>(buf + cg * 16 * kp + kb * 16, kp, o + cg * 16, 64);
                    else transpose16(buf + cg * 16 * kp + kb * 16, kp, o + cg * 16, 64);
                }
        }
        store_fence();
        delete[] buf;
    }
}

// ---- fp32 GEMM for the decode engine: y = x @ W^T + bias (+ add), fp32 throughout ------------------------------------
//
// The rollout's matmuls at fp32 precision (a CPU without native bf16, or rollout.precision=fp32). Layout `Q`:
// W [N, K] (N % 64 == 0, K % 16 == 0) as [N/64][K][64] fp32: block nb holds columns nb*64.., input k's 64 values side
// by side (four 16-float vectors). Kernel as the bf16 one's: per block, row groups of up to 6 rows x 4 vectors = 24
// accumulators (AVX2: 4 rows x 16 columns, the block's four column tiles in turn), one FMA chain per output in input
// order (the thread count and the ISA change nothing), the next block prefetched into L2 while this one is computed;
// then + bias, then + add.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ROLLYARD_GEMM_F32 1
#endif

namespace {

#if defined(ROLLYARD_GEMM_F32) && defined(__AVX512F__)
template <int MR>
inline void gemm_tile_f32(const float* x, int64_t ldx, const float* wb, int64_t K, const char* pf, int64_t pf_lines,
                          const float* bias, int64_t col0, const float* add, int64_t ldadd, float* y, int64_t ldy) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
    const int64_t per_k = (pf_lines + K - 1) / (K > 0 ? K : 1);  // prefetches per input step
    int64_t line = 0;
    for (int64_t k = 0; k < K; k++) {
        for (int64_t i = 0; i < per_k && line < pf_lines; i++) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
        fma_step<MR>(x, ldx, k, wb + k * 64, acc);
    }
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 4; q++)
            out_vec<false>(acc[r][q], bias ? bias + col0 + q * 16 : nullptr,
                           add ? add + r * ldadd + col0 + q * 16 : nullptr, y + r * ldy + col0 + q * 16);
}
#endif

#if defined(ROLLYARD_GEMM_F32) && !defined(__AVX512F__)
// AVX2: MR rows x 16 columns (two 8-float vectors) of a block at `wb` (offset to the tile's columns), the same FMA chain
// per output as the AVX-512 tile's (so the same numbers); a block's four 16-column tiles run one after another.
template <int MR>
inline void gemm_tile_f32(const float* x, int64_t ldx, const float* wb, int64_t K, const char* pf,
                          int64_t pf_lines, const float* bias, int64_t col0, const float* add, int64_t ldadd,
                          float* y, int64_t ldy) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t per = (pf_lines + K - 1) / (K > 0 ? K : 1);
    int64_t line = 0;
    for (int64_t k = 0; k < K; k++) {
        for (int64_t i = 0; i < per && line < pf_lines; i++) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
        fma_step<MR>(x, ldx, k, wb + k * 64, acc);
    }
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 2; q++)
            out_vec<false>(acc[r][q], bias ? bias + col0 + q * 8 : nullptr,
                           add ? add + r * ldadd + col0 + q * 8 : nullptr, y + r * ldy + col0 + q * 8);
}

// One row x the block's 64 columns (decode at batch 1), each input's 256 bytes read in order (see gemm_row_bf16)
inline void gemm_row_f32(const float* x, const float* wb, int64_t K, const char* pf, int64_t pf_lines,
                         const float* bias, int64_t col0, const float* add, float* y) {
    __m256 acc[8];
    for (int q = 0; q < 8; q++) acc[q] = _mm256_setzero_ps();
    const int64_t per = (pf_lines + K - 1) / (K > 0 ? K : 1);
    int64_t line = 0;
    for (int64_t k = 0; k < K; k++) {
        for (int64_t i = 0; i < per && line < pf_lines; i++) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
        const __m256 a = _mm256_broadcast_ss(x + k);
        for (int q = 0; q < 8; q++) acc[q] = _mm256_fmadd_ps(a, _mm256_loadu_ps(wb + k * 64 + 8 * q), acc[q]);
    }
    for (int q = 0; q < 8; q++)
        out_vec<false>(acc[q], bias ? bias + col0 + q * 8 : nullptr, add ? add + col0 + q * 8 : nullptr, y + col0 + q * 8);
}
#endif

#ifdef ROLLYARD_GEMM_F32
// `rows` (1..MR) rows through this build's tile (AVX-512: 64 columns; AVX2: 16).
template <int MR>
inline void gemm_rows_f32(const float* x, int64_t ldx, const float* wb, int64_t K, const char* pf, int64_t pf_lines,
                          const float* bias, int64_t col0, const float* add, int64_t ldadd, float* y, int64_t ldy,
                          int rows) {
    if (rows == MR) gemm_tile_f32<MR>(x, ldx, wb, K, pf, pf_lines, bias, col0, add, ldadd, y, ldy);
    else if constexpr (MR > 1) gemm_rows_f32<MR - 1>(x, ldx, wb, K, pf, pf_lines, bias, col0, add, ldadd, y, ldy, rows);
}
#endif

}  // namespace

extern "C" int rollyard_gemm_f32_available() {
#ifdef ROLLYARD_GEMM_F32
    return 1;
#else
    return 0;
#endif
}

// Write the fused weight [sum(rows), K] of `nparts` fp32 row blocks (part i: `rows[i]` rows at `srcs[i]`, row-major,
// times `scales[i]` when that is not 1) into layout Q at `out`. N = sum(rows) % 64 == 0, K % 16 == 0 (the caller checks).
extern "C" void rollyard_pack_f32(const float* const* srcs, const int64_t* rows, const float* scales, int nparts,
                                  int64_t K, float* out, int threads) {
    int64_t N = 0;
    for (int i = 0; i < nparts; i++) N += rows[i];
    const int64_t nblocks = N / 64;
    const bool nt = streams(out);
#pragma omp parallel num_threads(threads)
    {
        float* buf = new float[64 * K];  // a block's 64 rows, scaled, row-major; then transposed out
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            for (int c = 0; c < 64; c++) {
                int64_t n = nb * 64 + c, part = 0;
                while (n >= rows[part]) n -= rows[part++];
                const float s = scales[part], *src = srcs[part] + n * K;
                if (s == 1.0f) std::memcpy(buf + c * K, src, sizeof(float) * K);
                else for (int64_t k = 0; k < K; k++) buf[c * K + k] = src[k] * s;
            }
            float* o = out + nb * K * 64;
            for (int64_t kb = 0; kb < K / 16; kb++)
                for (int cg = 0; cg < 4; cg++) {
                    const uint32_t* from = (const uint32_t*)(buf + cg * 16 * K + kb * 16);
                    uint32_t* to = (uint32_t*)(o + kb * 16 * 64 + cg * 16);
                    if (nt) transpose16<true>(from, K, to, 64);
                    else transpose16(from, K, to, 64);
                }
        }
        store_fence();
        delete[] buf;
    }
}

// y [M, N] (row stride ldy) = x @ W^T + bias + add: x [M, K] fp32 (row stride ldx), W in layout Q (`w`), bias [N] or
// null, add [M, N] (row stride ldadd) or null (it may be y itself). Returns 0, or 1 where this build has neither AVX-512
// nor AVX2 with FMA.
extern "C" int rollyard_gemm_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, int64_t N,
                                 const float* bias, const float* add, int64_t ldadd, float* y, int64_t ldy,
                                 int threads) {
#ifdef ROLLYARD_GEMM_F32
    const int64_t nblocks = N / 64;
#ifdef __AVX512F__
    constexpr int MR = 6;
#else
    constexpr int MR = 4;  // AVX2's 16 registers: 4 rows x 2 vectors of accumulators
#endif
#pragma omp parallel num_threads(threads) if (M * N * K >= (1 << 18))
    for_units(M, MR, nblocks, K * 4, [&](int64_t nb, int64_t m0, int rows, int64_t first, int64_t n) {
        const float* wb = w + nb * K * 64;  // a block: K x 256 bytes
        const char* pf = (const char*)(wb + K * 64) + 64 * first;
        const float* ad = add ? add + m0 * ldadd : nullptr;
#ifdef __AVX512F__
        gemm_rows_f32<MR>(x + m0 * ldx, ldx, wb, K, pf, n, bias, nb * 64, ad, ldadd, y + m0 * ldy, ldy, rows);
#else
        if (rows == 1) {  // the block's 64 columns at once: its bytes read in order
            gemm_row_f32(x + m0 * ldx, wb, K, pf, n, bias, nb * 64, ad, y + m0 * ldy);
            return;
        }
        for (int q = 0; q < 4; q++)  // the block's 16-column tiles; the first prefetches the next block
            gemm_rows_f32<MR>(x + m0 * ldx, ldx, wb + 16 * q, K, pf, q ? 0 : n, bias, nb * 64 + 16 * q, ad, ldadd,
                              y + m0 * ldy, ldy, rows);
#endif
    });
    return 0;
#else
    return 1;  // no such kernel in this build (the flags leave unused parameters unwarned)
#endif
}

// ---- the rollout's int8 weights (layout R): fp32 arithmetic on a quarter of fp32's bytes ---------------------------
//
// Layout R: [N/64] blocks of 64 columns; a block holds its inputs in groups of Q8_GROUP (the last one may be shorter):
// a group's kg rows of the 64 columns' int8 weights (input k's 64 bytes in one cache line), then 4 rows holding the
// 64 columns' fp32 scales for that group. Column n's weights in group g are quantized symmetrically, round to nearest
// even: s = max|w[n, g's inputs]| / 127, q = round(w / s) in [-127, 127] (s = 0 and q = 0 for an all-zero group). A
// matmul widens each group to fp32 (q * s, one rounding) and runs fp32 FMAs over it, so its numbers are
// rollyard_gemm_f32's over the dequantized weights, bit for bit, whatever the row count or thread count.
constexpr int64_t Q8_GROUP = 64;

inline int64_t q8_block_bytes(int64_t K) { return K * 64 + (K + Q8_GROUP - 1) / Q8_GROUP * 256; }

// A block's 64 rows are scaled into a buffer, transposed (input-major, as layout Q's), then quantized a group at a
// time in loops over the 64 columns (the compiler vectorizes them): SmolLM2's refresh 0.2 -> 0.05 s at 2 threads.
// Block nb of the stacked parts into `o` (q8_block_bytes(K)); buf and t: 64 * K floats each.
inline void q8_pack_block(const float* const* srcs, const int64_t* rows, const float* scales, int64_t K, int64_t nb,
                          float* buf, float* t, int8_t* o) {
    for (int c = 0; c < 64; c++) {
        int64_t n = nb * 64 + c, part = 0;
        while (n >= rows[part]) n -= rows[part++];
        const float ps = scales[part], *src = srcs[part] + n * K;
        for (int64_t k = 0; k < K; k++) buf[c * K + k] = ps == 1.0f ? src[k] : src[k] * ps;
    }
    for (int64_t kb = 0; kb < K / 16; kb++)
        for (int cg = 0; cg < 4; cg++)
            transpose16((const uint32_t*)(buf + cg * 16 * K + kb * 16), K, (uint32_t*)(t + kb * 16 * 64 + cg * 16), 64);
    for (int64_t k0 = 0; k0 < K; k0 += Q8_GROUP) {
        const int64_t kg = K - k0 < Q8_GROUP ? K - k0 : Q8_GROUP;
        int8_t* og = o + k0 * 64 + k0 / Q8_GROUP * 256;
        float amax[64] = {0.0f}, sc[64], inv_ok[64];
        for (int64_t k = k0; k < k0 + kg; k++)
            for (int c = 0; c < 64; c++) {
                const float a = std::fabs(t[k * 64 + c]);
                amax[c] = a > amax[c] ? a : amax[c];
            }
        for (int c = 0; c < 64; c++) {
            sc[c] = amax[c] / 127.0f;
            inv_ok[c] = sc[c] > 0.0f ? 1.0f : 0.0f;
        }
        std::memcpy(og + kg * 64, sc, sizeof(sc));
        for (int64_t k = 0; k < kg; k++)
            for (int c = 0; c < 64; c++) {
                float q = std::nearbyint(t[(k0 + k) * 64 + c] / (inv_ok[c] > 0.0f ? sc[c] : 1.0f)) * inv_ok[c];
                q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
                og[k * 64 + c] = (int8_t)q;
            }
    }
}

extern "C" void rollyard_pack_q8(const float* const* srcs, const int64_t* rows, const float* scales, int nparts,
                                 int64_t K, int8_t* out, int threads) {
    int64_t N = 0;
    for (int i = 0; i < nparts; i++) N += rows[i];
    const int64_t nblocks = N / 64;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> buf(64 * K), t(K * 64);  // the block's rows scaled; the same transposed: t[k * 64 + c]
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++)
            q8_pack_block(srcs, rows, scales, K, nb, buf.data(), t.data(), out + nb * q8_block_bytes(K));
    }
}

#ifdef ROLLYARD_GEMM_F32
namespace {
// An int8 matmul runs a block a chunk of QC inputs at a time: the block's first row group widens the chunk (q * s, one
// rounding) just before its FMAs and stores it (64 x 64 fp32 = 16 KB) for the block's other row groups, which run over
// it from L1, each one's accumulators kept in a buffer between chunks; a lone row group widens in registers only.
// Widening a whole block into a buffer first (147-393 KB at SmolLM2's shapes) ran at ~9 GB/s of int8 at one row (the
// stores to L2 bound it) and at ~60% of the FMA peak at 32 rows (each row group re-reading it from L2); chunked, one
// row reads ~18 GB/s and 32 rows run at ~85% of the peak. (The same chunking over layout Q's fp32 blocks measured no
// faster than rollyard_gemm_f32's tiles, which are bound by streaming four times the bytes.)
constexpr int64_t QC = Q8_GROUP;  // a chunk: one quantization group

// acc [rows][64] (+)= x [rows, kc] (row stride ldx) @ w [kc][64] fp32, one FMA per input in order. WIDEN 0: w is the
// widened chunk; 1: widen `raw` (int8, 64 a row, times the 64 scales `sc`) and store it into w as it goes; 2: widen
// in registers only. The `npf` lines at `pf` (the next block's share) go to L2 spread over the inputs, about one an
// input: issued in one burst per chunk, they held one row to 9.4-11.6 GB/s of int8 (12.0-12.8 GB/s spread, SmolLM2's
// 30 layers in-process interleaved); two blocks ahead, or into L1 instead, measured slower.
template <int MR, int WIDEN>
inline void qchunk_tile(const float* x, int64_t ldx, float* w, int64_t kc, float* acc, bool first,
                        const int8_t* raw, const float* sc, const char* pf, int64_t npf) {
    const int64_t per_k = (npf + kc - 1) / kc;
    int64_t line = 0;
#if defined(__AVX512F__)
    __m512 a[MR][4];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 4; q++) a[r][q] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * 64 + 16 * q);
    for (int64_t k = 0; k < kc; k++) {
        for (int64_t i = 0; i < per_k && line < npf; i++) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
        __m512 wv[4];
        for (int q = 0; q < 4; q++) {
            if constexpr (WIDEN == 0) {
                wv[q] = _mm512_loadu_ps(w + k * 64 + 16 * q);
            } else {
                const __m128i b = _mm_loadu_si128((const __m128i*)(raw + k * 64 + 16 * q));
                wv[q] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_loadu_ps(sc + 16 * q));
                if constexpr (WIDEN == 1) _mm512_storeu_ps(w + k * 64 + 16 * q, wv[q]);
            }
        }
        for (int r = 0; r < MR; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
            for (int q = 0; q < 4; q++) a[r][q] = _mm512_fmadd_ps(xv, wv[q], a[r][q]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 4; q++) _mm512_storeu_ps(acc + r * 64 + 16 * q, a[r][q]);
#else
    for (int q = 0; q < 4; q++) {  // 16 columns at a time: MR x 2 accumulators
        __m256 a[MR][2];
        for (int r = 0; r < MR; r++)
            for (int h = 0; h < 2; h++)
                a[r][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * 64 + 16 * q + 8 * h);
        for (int64_t k = 0; k < kc; k++) {
            if (q == 0)
                for (int64_t i = 0; i < per_k && line < npf; i++) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
            __m256 wv[2];
            for (int h = 0; h < 2; h++) {
                const int64_t at = k * 64 + 16 * q + 8 * h;
                if constexpr (WIDEN == 0) {
                    wv[h] = _mm256_loadu_ps(w + at);
                } else {
                    const __m128i b = _mm_loadl_epi64((const __m128i*)(raw + at));
                    wv[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_loadu_ps(sc + 16 * q + 8 * h));
                    if constexpr (WIDEN == 1) _mm256_storeu_ps(w + at, wv[h]);
                }
            }
            for (int r = 0; r < MR; r++) {
                const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
                a[r][0] = _mm256_fmadd_ps(xv, wv[0], a[r][0]);
                a[r][1] = _mm256_fmadd_ps(xv, wv[1], a[r][1]);
            }
        }
        for (int r = 0; r < MR; r++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc + r * 64 + 16 * q + 8 * h, a[r][h]);
    }
#endif
}

template <int MR, int WIDEN>
inline void qchunk_rows(const float* x, int64_t ldx, float* w, int64_t kc, float* acc, bool first, const int8_t* raw,
                        const float* sc, int rows, const char* pf, int64_t npf) {
    if (rows == MR) qchunk_tile<MR, WIDEN>(x, ldx, w, kc, acc, first, raw, sc, pf, npf);
    else if constexpr (MR > 1) qchunk_rows<MR - 1, WIDEN>(x, ldx, w, kc, acc, first, raw, sc, rows, pf, npf);
}

#if defined(__AVX512F__)
constexpr int QMC = 6;  // a chunk tile's rows: 24 accumulators
#else
constexpr int QMC = 4;
#endif

// y = x @ dequant(W)^T + bias + add over layout R's blocks, chunked as above
void gemm_q8_chunked(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, int64_t N, const float* bias,
                     const float* add, int64_t ldadd, float* y, int64_t ldy, int threads) {
    const int64_t nblocks = N / 64, bstride = q8_block_bytes(K);
    const int64_t lines = bstride / 64;
#pragma omp parallel num_threads(threads) if (M * N * K >= (1 << 18))
    {
        const Units us = thread_units(M, QMC, nblocks);
        static thread_local std::vector<float> wide, accs;
        if ((int64_t)wide.size() < QC * 64) wide.resize(QC * 64);
        if ((int64_t)accs.size() < us.groups * QMC * 64) accs.resize(us.groups * QMC * 64);
        for (int64_t nb = us.u1 > us.u0 ? us.u0 / us.groups : 0; nb <= us.last; nb++) {
            const int64_t ga = nb * us.groups > us.u0 ? 0 : us.u0 - nb * us.groups;
            const int64_t gb = (nb + 1) * us.groups < us.u1 ? us.groups : us.u1 - nb * us.groups;
            const char* wb = (const char*)w + nb * bstride;
            const char* next = nb < us.last ? wb + bstride : nullptr;
            const int64_t nchunks = (K + QC - 1) / QC;
            const int64_t per = next ? (lines + nchunks * (gb - ga) - 1) / (nchunks * (gb - ga)) : 0;
            int64_t line = 0;
            for (int64_t k0 = 0; k0 < K; k0 += QC) {
                const int64_t kc = K - k0 < QC ? K - k0 : QC;
                for (int64_t g = ga; g < gb; g++) {
                    const int64_t npf = per < lines - line ? per : lines - line;
                    const char* pf = next ? next + 64 * line : nullptr;
                    line += npf;
                    const int rows = (int)(M - g * QMC < QMC ? M - g * QMC : QMC);
                    const float* xg = x + g * QMC * ldx + k0;
                    float* ag = accs.data() + g * QMC * 64;
                    const int8_t* raw = (const int8_t*)wb + k0 * 64 + k0 / QC * 256;  // the group's weights
                    const float* sc = (const float*)(raw + kc * 64);                    // and its scales
                    if (gb - ga == 1)
                        qchunk_rows<QMC, 2>(xg, ldx, nullptr, kc, ag, k0 == 0, raw, sc, rows, pf, npf);
                    else if (g == ga)
                        qchunk_rows<QMC, 1>(xg, ldx, wide.data(), kc, ag, k0 == 0, raw, sc, rows, pf, npf);
                    else
                        qchunk_rows<QMC, 0>(xg, ldx, wide.data(), kc, ag, k0 == 0, nullptr, nullptr, rows, pf, npf);
                }
            }
            for (int64_t g = ga; g < gb; g++) {
                const int64_t m0 = g * QMC;
                const int rows = (int)(M - m0 < QMC ? M - m0 : QMC);
                const float* ac = accs.data() + g * QMC * 64;
#if defined(__AVX512F__)
                for (int r = 0; r < rows; r++)
                    for (int c = 0; c < 64; c += 16)
                        out_vec<false>(_mm512_loadu_ps(ac + r * 64 + c), bias ? bias + nb * 64 + c : nullptr,
                                       add ? add + (m0 + r) * ldadd + nb * 64 + c : nullptr, y + (m0 + r) * ldy + nb * 64 + c);
#else
                for (int r = 0; r < rows; r++)
                    for (int c = 0; c < 64; c += 8)
                        out_vec<false>(_mm256_loadu_ps(ac + r * 64 + c), bias ? bias + nb * 64 + c : nullptr,
                                       add ? add + (m0 + r) * ldadd + nb * 64 + c : nullptr, y + (m0 + r) * ldy + nb * 64 + c);
#endif
            }
        }
    }
}
}  // namespace
#endif

// y [M, N] (row stride ldy) = x @ dequant(W)^T + bias + add, as rollyard_gemm_f32 with layout R's weights (`w`).
// Returns 0, or 1 where this build has neither AVX-512 nor AVX2 with FMA.
extern "C" int rollyard_gemm_q8(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, int64_t N,
                                const float* bias, const float* add, int64_t ldadd, float* y, int64_t ldy,
                                int threads) {
#ifdef ROLLYARD_GEMM_F32
    gemm_q8_chunked(x, ldx, M, K, w, N, bias, add, ldadd, y, ldy, threads);
    return 0;
#else
    return 1;
#endif
}

// ---- int8 weights x int8 activations (layout V): exact integer dot products (rollout.precision=w8a8) ----------------
//
// Layout V: [N/64] blocks of 64 columns; a block holds G = ceil(K / 64) groups of 64 inputs (the last zero-padded),
// V_GROUP_BYTES each: 16 quads of 4 inputs, a quad 4 vectors of 16 columns x 4 bytes (vector v's bytes 4c..4c+3: column
// 16v + c's int8 weights for the group's inputs 4j..4j+3, what AVX512-VNNI's vpdpbusd multiplies), then the 64 columns'
// fp32 scales, then their int32 sums of the group's weights times 128 (the unsigned-input correction). The weights and
// scales are layout R's, the same quantization. A matmul quantizes x per row and group likewise (sx = max|x| / 127,
// xq = round(x * (1 / sx)), half to even), sums xq * q per group exactly in int32, and accumulates
// y = fma(float(sum), sw * sx, y) over the groups in order; then + bias, then + add. The sums are exact, so every ISA
// (VNNI's vpdpbusd over xq + 128, AVX2's vpmaddubsw over |xq| and the signed weights) and every row or thread count
// computes the same numbers.
constexpr int64_t V_GROUP_BYTES = 4096 + 256 + 256;

struct w8a8_t {  // a layout V weight's element type (the decode layer's matmul overload)
    int8_t v;
};

// A group's quads from layout R's rows (og: kg rows of 64 columns' int8, the rest zero): quad j's bytes 4c..4c+3 are
// column c's inputs 4j..4j+3 (vector c / 16, lane c % 16). Byte interleaves, 16 columns at a time (a byte-scattering
// loop made the whole pack ~2.3x int8's: SmolLM2's 30 layers 103 ms against 45).
inline void w8a8_interleave(const int8_t* og, int64_t kg, int8_t* ov) {
    alignas(64) int8_t rows[64 * 64];
    std::memcpy(rows, og, kg * 64);
    std::memset(rows + kg * 64, 0, (64 - kg) * 64);
    for (int j = 0; j < 16; j++) {
        const int8_t* r = rows + 4 * j * 64;
        int8_t* oq = ov + j * 256;
#if defined(__AVX512F__) || defined(__AVX2__)
        for (int c = 0; c < 64; c += 16) {
            const __m128i a = _mm_loadu_si128((const __m128i*)(r + c)), b = _mm_loadu_si128((const __m128i*)(r + 64 + c));
            const __m128i d = _mm_loadu_si128((const __m128i*)(r + 128 + c)), e = _mm_loadu_si128((const __m128i*)(r + 192 + c));
            const __m128i ab0 = _mm_unpacklo_epi8(a, b), ab1 = _mm_unpackhi_epi8(a, b);
            const __m128i de0 = _mm_unpacklo_epi8(d, e), de1 = _mm_unpackhi_epi8(d, e);
            _mm_storeu_si128((__m128i*)(oq + 4 * c), _mm_unpacklo_epi16(ab0, de0));
            _mm_storeu_si128((__m128i*)(oq + 4 * c + 16), _mm_unpackhi_epi16(ab0, de0));
            _mm_storeu_si128((__m128i*)(oq + 4 * c + 32), _mm_unpacklo_epi16(ab1, de1));
            _mm_storeu_si128((__m128i*)(oq + 4 * c + 48), _mm_unpackhi_epi16(ab1, de1));
        }
#else
        for (int c = 0; c < 64; c++)
            for (int i = 0; i < 4; i++) oq[4 * c + i] = r[i * 64 + c];
#endif
    }
}

extern "C" void rollyard_pack_w8a8(const float* const* srcs, const int64_t* rows, const float* scales, int nparts,
                                   int64_t K, int8_t* out, int threads) {
    int64_t N = 0;
    for (int i = 0; i < nparts; i++) N += rows[i];
    const int64_t nblocks = N / 64, G = (K + 63) / 64;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> buf(64 * K), t(K * 64);
        std::vector<int8_t> r(q8_block_bytes(K));  // the block in layout R, rearranged below
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            q8_pack_block(srcs, rows, scales, K, nb, buf.data(), t.data(), r.data());
            for (int64_t g = 0; g < G; g++) {
                const int64_t kg = K - g * 64 < 64 ? K - g * 64 : 64;
                const int8_t* og = r.data() + g * 64 * 64 + g * 256;
                int8_t* ov = out + (nb * G + g) * V_GROUP_BYTES;
                w8a8_interleave(og, kg, ov);
                int32_t sums[64] = {0};
                for (int64_t k = 0; k < kg; k++)
                    for (int c = 0; c < 64; c++) sums[c] += og[k * 64 + c];
                std::memcpy(ov + 4096, og + kg * 64, 256);
                for (int c = 0; c < 64; c++) sums[c] *= 128;
                std::memcpy(ov + 4352, sums, 256);
            }
        }
    }
}

#ifdef ROLLYARD_GEMM_F32
namespace {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ROLLYARD_W8A8_VNNI 1
constexpr int VMR = 6;  // rows a tile: 24 int32 accumulators, 4 weight vectors, 1 broadcast (the fp32 sums in L1)
#else
constexpr int VMR = 2;  // AVX2: a 16-column quarter at a time, 4 + 4 accumulators
#endif

// Row m of x [M, K] quantized per group of 64 inputs into xq [G * 64] (zero past K) and sx [G]: sx = max|x| / 127,
// xq = round(x * (1 / sx)) half to even (0 where sx is 0); with VNNI the bytes hold xq + 128 (vpdpbusd's unsigned
// operand). A reciprocal and multiplies, not a division per input: a decode step quantizes every matmul's input.
void quantize_row(const float* x, int64_t K, int8_t* xq, float* sx) {
    const int64_t G = (K + 63) / 64;
    for (int64_t g = 0; g < G; g++) {
        const float* xg = x + g * 64;
        const int64_t kg = K - g * 64 < 64 ? K - g * 64 : 64;
        int8_t* o = xq + g * 64;
#ifdef __AVX512F__
        __m512 v[4];
        __m512 amax = _mm512_setzero_ps();
        for (int q = 0; q < 4; q++) {
            const int64_t left = kg - 16 * q;
            const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            v[q] = _mm512_maskz_loadu_ps(m, xg + 16 * q);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v[q]));
        }
        const float s = _mm512_reduce_max_ps(amax) / 127.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
        const __m512 vi = _mm512_set1_ps(inv);
        for (int q = 0; q < 4; q++) {
            __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(v[q], vi));  // MXCSR's default: nearest, ties to even
            i = _mm512_max_epi32(_mm512_min_epi32(i, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
#ifdef ROLLYARD_W8A8_VNNI
            i = _mm512_add_epi32(i, _mm512_set1_epi32(128));
#endif
            _mm_storeu_si128((__m128i*)(o + 16 * q), _mm512_cvtepi32_epi8(i));
        }
#else
        float amax = 0.0f;
        for (int64_t k = 0; k < kg; k++) amax = std::fabs(xg[k]) > amax ? std::fabs(xg[k]) : amax;
        const float s = amax / 127.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
        if (kg == 64) {
            const __m256 vi = _mm256_set1_ps(inv);
            for (int q = 0; q < 8; q += 2) {  // 16 inputs: two vectors packed to 16 bytes
                __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * q), vi));
                __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * q + 8), vi));
                const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
                a = _mm256_max_epi32(_mm256_min_epi32(a, hi), lo);
                b = _mm256_max_epi32(_mm256_min_epi32(b, hi), lo);
                const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // 16 x int16, in order
                const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
                _mm_storeu_si128((__m128i*)(o + 8 * q), bytes);
            }
        } else {
            for (int64_t k = 0; k < 64; k++) {
                float q = k < kg ? std::nearbyint(xg[k] * inv) : 0.0f;
                o[k] = (int8_t)(q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q));
            }
        }
#endif
        sx[g] = s;
    }
}

// y rows [MR] x the block's 64 columns over all G groups; the `npf` lines at `pf` (the next block's share) to L2 spread
// over the quads.
template <int MR>
inline void w8a8_tile(const int8_t* xq, const float* sx, int64_t G, const int8_t* wb, const char* pf, int64_t npf,
                      const float* bias, const float* add, int64_t ldadd, float* y, int64_t ldy) {
    const int64_t per = (npf + G * 16 - 1) / (G * 16);
    int64_t line = 0;
#ifdef ROLLYARD_W8A8_VNNI
    alignas(64) float af[MR][64];  // the fp32 sums between groups
    for (int64_t g = 0; g < G; g++) {
        const int8_t* wg = wb + g * V_GROUP_BYTES;
        __m512i ai[MR][4];
        for (int r = 0; r < MR; r++)
            for (int q = 0; q < 4; q++) ai[r][q] = _mm512_setzero_si512();
        for (int j = 0; j < 16; j++) {
            for (int64_t i = 0; i < per && line < npf; i++) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
            __m512i w[4];
            for (int q = 0; q < 4; q++) w[q] = _mm512_loadu_si512(wg + j * 256 + q * 64);
            for (int r = 0; r < MR; r++) {
                int32_t quad;
                std::memcpy(&quad, xq + r * G * 64 + g * 64 + 4 * j, 4);
                const __m512i b = _mm512_set1_epi32(quad);
                for (int q = 0; q < 4; q++) ai[r][q] = _mm512_dpbusd_epi32(ai[r][q], b, w[q]);
            }
        }
        for (int q = 0; q < 4; q++) {
            const __m512 sw = _mm512_loadu_ps((const float*)(wg + 4096) + 16 * q);
            const __m512i corr = _mm512_loadu_si512(wg + 4352 + 64 * q);
            for (int r = 0; r < MR; r++) {
                const __m512 prev = g ? _mm512_load_ps(af[r] + 16 * q) : _mm512_setzero_ps();
                _mm512_store_ps(af[r] + 16 * q, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ai[r][q], corr)),
                                                                _mm512_mul_ps(sw, _mm512_set1_ps(sx[r * G + g])), prev));
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < 4; q++)
            out_vec<false>(_mm512_load_ps(af[r] + 16 * q), bias ? bias + 16 * q : nullptr,
                           add ? add + r * ldadd + 16 * q : nullptr, y + r * ldy + 16 * q);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    for (int qq = 0; qq < 4; qq++) {  // 16 columns: two vectors of 8
        __m256 af[MR][2];
        for (int r = 0; r < MR; r++) af[r][0] = af[r][1] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const int8_t* wg = wb + g * V_GROUP_BYTES;
            __m256i ai[MR][2];
            for (int r = 0; r < MR; r++) ai[r][0] = ai[r][1] = _mm256_setzero_si256();
            for (int j = 0; j < 16; j++) {
                if (qq == 0)
                    for (int64_t i = 0; i < per && line < npf; i++) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
                const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wg + j * 256 + qq * 64));
                const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wg + j * 256 + qq * 64 + 32));
                for (int r = 0; r < MR; r++) {
                    int32_t quad;
                    std::memcpy(&quad, xq + r * G * 64 + g * 64 + 4 * j, 4);
                    const __m256i b = _mm256_set1_epi32(quad), a = _mm256_abs_epi8(b);
                    // |x| * (w with x's sign): each pair's sum within int16 (|x|, |w| <= 127), exact
                    ai[r][0] = _mm256_add_epi32(ai[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(w0, b)), ones));
                    ai[r][1] = _mm256_add_epi32(ai[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(w1, b)), ones));
                }
            }
            for (int h = 0; h < 2; h++) {
                const __m256 sw = _mm256_loadu_ps((const float*)(wg + 4096) + 16 * qq + 8 * h);
                for (int r = 0; r < MR; r++)
                    af[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[r][h]), _mm256_mul_ps(sw, _mm256_set1_ps(sx[r * G + g])),
                                               af[r][h]);
            }
        }
        for (int r = 0; r < MR; r++)
            for (int h = 0; h < 2; h++) {
                const int64_t c = 16 * qq + 8 * h;
                out_vec<false>(af[r][h], bias ? bias + c : nullptr, add ? add + r * ldadd + c : nullptr, y + r * ldy + c);
            }
    }
#endif
}

template <int MR>
inline void w8a8_rows(const int8_t* xq, const float* sx, int64_t G, const int8_t* wb, const char* pf, int64_t npf,
                      const float* bias, const float* add, int64_t ldadd, float* y, int64_t ldy, int rows) {
    if (rows == MR) w8a8_tile<MR>(xq, sx, G, wb, pf, npf, bias, add, ldadd, y, ldy);
    else if constexpr (MR > 1) w8a8_rows<MR - 1>(xq, sx, G, wb, pf, npf, bias, add, ldadd, y, ldy, rows);
}
}  // namespace
#endif

// Whether rollyard_gemm_w8a8 runs on AVX512-VNNI's vpdpbusd in this build (else AVX2's vpmaddubsw; the same numbers).
extern "C" int rollyard_w8a8_vnni() {
#ifdef ROLLYARD_W8A8_VNNI
    return 1;
#else
    return 0;
#endif
}

// y [M, N] (row stride ldy) = the layout V matmul of x [M, K] (row stride ldx) with `w`, + bias, + add (as
// rollyard_gemm_f32's). The quantized rows go into buffers of the calling thread's own. Returns 0, or 1 where this
// build has neither AVX-512 nor AVX2 with FMA.
extern "C" int rollyard_gemm_w8a8(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, int64_t N,
                                  const float* bias, const float* add, int64_t ldadd, float* y, int64_t ldy,
                                  int threads) {
#ifdef ROLLYARD_GEMM_F32
    const int64_t G = (K + 63) / 64, nblocks = N / 64, bstride = G * V_GROUP_BYTES;
    static thread_local std::vector<int8_t> xq;
    static thread_local std::vector<float> sx;
    if ((int64_t)xq.size() < M * G * 64) xq.resize(M * G * 64);
    if ((int64_t)sx.size() < M * G) sx.resize(M * G);
    int8_t* xqd = xq.data();
    float* sxd = sx.data();
#pragma omp parallel num_threads(threads) if (M * N * K >= (1 << 18))
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x + m * ldx, K, xqd + m * G * 64, sxd + m * G);
        for_units(M, VMR, nblocks, bstride / 64, [&](int64_t nb, int64_t m0, int rows, int64_t first, int64_t n) {
            const int8_t* wb = w + nb * bstride;
            w8a8_rows<VMR>(xqd + m0 * G * 64, sxd + m0 * G, G, wb, (const char*)(wb + bstride) + 64 * first, n,
                           bias ? bias + nb * 64 : nullptr, add ? add + m0 * ldadd + nb * 64 : nullptr, ldadd,
                           y + m0 * ldy + nb * 64, ldy, rows);
        });
    }
    return 0;
#else
    return 1;
#endif
}

// y [M, N] (row stride ldy) = round_bf16(bf16(x) @ W^T + bias) + add: x [M, K] fp32 (row stride ldx), W in layout P
// (`w`), bias [N] fp32 or null, add [M, N] fp32 (row stride ldadd) or null (it may be y itself). x rounded to bf16 goes
// into a buffer of the calling thread's own, kept for the next call. Returns 0, or 1 where this build has neither
// AVX512-BF16, nor AVX-512F, nor AVX2 with FMA (nothing done).
extern "C" int rollyard_gemm_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                                  const float* bias, const float* add, int64_t ldadd, float* y, int64_t ldy,
                                  int threads) {
#ifdef ROLLYARD_GEMM_BF16
    static thread_local std::vector<XS> own;  // the rounded input: XS_PER_PAIR elements per pair of inputs
    if ((int64_t)own.size() < M * (K / 2) * XS_PER_PAIR) own.resize(M * (K / 2) * XS_PER_PAIR);
#ifdef ROLLYARD_BF16_NATIVE
    uint16_t* xb = (uint16_t*)own.data();
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xb[m * K + k] = bf16_rne(x[m * ldx + k]);
#else
    for (int64_t m = 0; m < M; m++) {  // rounded to bf16, each pair swapped: odd input first (K % 32 == 0)
        const float* xm = x + m * ldx;
        float* o = own.data() + m * K;
#if defined(__AVX512F__)
        for (int64_t k = 0; k < K; k += 16)
            _mm512_storeu_ps(o + k, _mm512_permute_ps(round_bf16(_mm512_loadu_ps(xm + k)), 0xB1));
#else
        for (int64_t k = 0; k < K; k += 8)
            _mm256_storeu_ps(o + k, _mm256_permute_ps(round_bf16(_mm256_loadu_ps(xm + k)), 0xB1));
#endif
    }
#endif
    const XS* xs = own.data();
    const int64_t nblocks = N / 64, kblocks = K / 32, kp = K / 2;
#if defined(ROLLYARD_BF16_NATIVE)
    constexpr int MR = 6;
#elif defined(__AVX512F__)
    constexpr int MR = 5;  // 20 accumulators + 4 widened weights + 2 inputs: at 6 rows the compiler spilled to the stack
#else
    constexpr int MR = 4;  // AVX2's 16 registers: 4 rows x 2 vectors of accumulators
#endif
#ifndef ROLLYARD_BF16_NATIVE
    constexpr int MC = 6;  // the chunk tile's rows (AVX-512: 24 accumulators; AVX2: 12, a 16-column strip at a time)
#endif
#ifndef ROLLYARD_BF16_NATIVE
    if (M > MR) {  // past one row group: this thread's units block by block, each chunk widened once for them all
#pragma omp parallel num_threads(threads) if (M * N * K >= (1 << 18))
        {
            const Units us = thread_units(M, MC, nblocks);
            static thread_local std::vector<float> wide, accs;
            if ((int64_t)wide.size() < KC * 64) wide.resize(KC * 64);
            if ((int64_t)accs.size() < us.groups * MC * 64) accs.resize(us.groups * MC * 64);
            for (int64_t nb = us.u1 > us.u0 ? us.u0 / us.groups : 0; nb <= us.last; nb++) {
                const int64_t ga = nb * us.groups > us.u0 ? 0 : us.u0 - nb * us.groups;
                const int64_t gb = (nb + 1) * us.groups < us.u1 ? us.groups : us.u1 - nb * us.groups;
                const uint16_t* wb = w + nb * kblocks * 2048;
                const char* next = nb < us.last ? (const char*)(wb + kblocks * 2048) : nullptr;
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t kc = K - k0 < KC ? K - k0 : KC;
                    // the next block's matching chunk into L2 (kc * 2 lines), a share before each row group's tile
                    const int64_t nl = next ? kc * 2 : 0, per = (nl + (gb - ga) - 1) / (gb - ga);
                    for (int64_t g = ga; g < gb; g++) {
                        for (int64_t l = (g - ga) * per; l < nl && l < (g - ga + 1) * per; l++)
                            _mm_prefetch(next + k0 * 128 + 64 * l, _MM_HINT_T1);
                        const int rows = (int)(M - g * MC < MC ? M - g * MC : MC);
                        const float* xg = xs + g * MC * K + k0;
                        float* ag = accs.data() + g * MC * 64;
                        if (g == ga)  // widens the chunk as it goes
                            chunk_rows<MC, true>(xg, K, wide.data(), kc, ag, k0 == 0, wb + k0 * 64, rows);
                        else
                            chunk_rows<MC, false>(xg, K, wide.data(), kc, ag, k0 == 0, nullptr, rows);
                    }
                }
                for (int64_t g = ga; g < gb; g++) {
                    const int64_t m0 = g * MC;
                    chunk_out(accs.data() + g * MC * 64, (int)(M - m0 < MC ? M - m0 : MC), bias, nb * 64,
                              add ? add + m0 * ldadd : nullptr, ldadd, y + m0 * ldy, ldy);
                }
            }
        }
        return 0;
    }
#endif
#pragma omp parallel num_threads(threads) if (M * N * K >= (1 << 18))
    for_units(M, MR, nblocks, kblocks * 64, [&](int64_t nb, int64_t m0, int rows, int64_t first, int64_t n) {
        const uint16_t* wb = w + nb * kblocks * 2048;  // the next block's lines: kblocks * 64
        const char* pf = (const char*)(wb + kblocks * 2048) + 64 * first;
        const XS* xr = xs + m0 * XS_PER_PAIR * kp;
        const float* ad = add ? add + m0 * ldadd : nullptr;
#if defined(__AVX512F__)
        gemm_rows<MR>(xr, kp, wb, kblocks, pf, n, bias, nb * 64, ad, ldadd, y + m0 * ldy, ldy, rows);
#else
        if (rows == 1) {  // the block's 64 columns at once: its bytes read in order
            gemm_row_bf16(xr, wb, kblocks, pf, n, bias, nb * 64, ad, y + m0 * ldy);
            return;
        }
        for (int q = 0; q < 4; q++)  // the block's 16-column tiles (32 bf16 of each pair); the first prefetches
            gemm_rows<MR>(xr, kp, wb + 32 * q, kblocks, pf, q ? 0 : n, bias, nb * 64 + 16 * q, ad, ldadd,
                          y + m0 * ldy, ldy, rows);
#endif
    });
    return 0;
#else
    return 1;  // no such kernel in this build (the flags leave unused parameters unwarned)
#endif
}

// ---- one Llama-family decoder layer of a decode step (model/llama.py: the same calls, in one) -------------------------
//
// x [B, D] (contiguous, updated in place) through: RMSNorm (w_in), the fused q|k|v matmul (+ bqkv), RoPE with the
// k / v write into the cache layer (K / V, strides in elements), attention over `lens` (or `width` for every row;
// `share`: decode_attn's),
// o_proj (+ bo) added to x, RMSNorm (w_post), the [gate | up] matmul, SwiGLU, down_proj added to x. Each step is the
// function the per-op path calls (rms_norm, gemm_bf16 / gemm_f32, decode_rope_write, decode_attn, swiglu_fwd), in the
// same order on the same values: the result is that path's, bit for bit, without its ~10 calls from Python and their
// tensors. Returns 0, or nonzero (nothing done past that point) where a piece cannot run: no such matmul kernel in
// this build (1), or an attention shape without a kernel (-1). W: the weights' element (bf16 bits in layout P, or fp32
// in layout Q), E: the cache's.
namespace {

inline int gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* b,
                const float* add, int64_t ldadd, float* y, int64_t ldy, int threads) {
    return rollyard_gemm_bf16(x, ldx, M, K, w, N, b, add, ldadd, y, ldy, threads);
}

inline int gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, int64_t N, const float* b,
                const float* add, int64_t ldadd, float* y, int64_t ldy, int threads) {
    return rollyard_gemm_f32(x, ldx, M, K, w, N, b, add, ldadd, y, ldy, threads);
}

inline int gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, int64_t N, const float* b,
                const float* add, int64_t ldadd, float* y, int64_t ldy, int threads) {
    return rollyard_gemm_q8(x, ldx, M, K, w, N, b, add, ldadd, y, ldy, threads);
}

inline int gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const w8a8_t* w, int64_t N, const float* b,
                const float* add, int64_t ldadd, float* y, int64_t ldy, int threads) {
    return rollyard_gemm_w8a8(x, ldx, M, K, (const int8_t*)w, N, b, add, ldadd, y, ldy, threads);
}

template <typename W, typename E>
int decode_layer(float* x, int64_t B, int64_t D, const float* w_in, float eps_in, const float* w_post, float eps_post,
                 const W* wqkv, const float* bqkv, const W* wo, const float* bo, const W* wgu, int64_t I, const W* wd,
                 const float* cos, const float* sin, const int64_t* pos, int64_t same_pos, int H, int KVH, int hd,
                 E* Kc, E* Vc, int64_t sb, int64_t sh, int64_t sw, const int64_t* lens, const int64_t* share, int width,
                 int threads) {
    const int64_t nqkv = (int64_t)(H + 2 * KVH) * hd, nq = (int64_t)H * hd, G = H / KVH;
    static thread_local std::vector<float> buf;
    const int64_t need = B * D + B * nqkv + 2 * B * nq + B * 2 * I + B * I + (int64_t)threads * G * (width + 16);
    if ((int64_t)buf.size() < need) buf.resize(need);
    float* h = buf.data();
    float* y = h + B * D;
    float* q = y + B * nqkv;
    float* o = q + B * nq;
    float* gu = o + B * nq;
    float* a = gu + B * 2 * I;
    float* scratch = a + B * I;
    rollyard_rms_norm_f32(x, D, w_in, B, D, eps_in, h, nullptr, threads);
    int rc = gemm(h, D, B, D, wqkv, nqkv, bqkv, nullptr, 0, y, nqkv, threads);
    if (rc) return rc;
    rope_write<E>(y, nqkv, (int)B, H, KVH, hd, cos, sin, pos, same_pos, q, Kc, Vc, sb, sh, sw);
    rc = decode_attn<E>(q, nq, Kc, Vc, sb, sh, sw, lens, share, (int)B, KVH, (int)G, hd, width, o, scratch, threads);
    if (rc) return rc;
    gemm(o, nq, B, nq, wo, D, bo, x, D, x, D, threads);
    rollyard_rms_norm_f32(x, D, w_post, B, D, eps_post, h, nullptr, threads);
    gemm(h, D, B, D, wgu, 2 * I, nullptr, nullptr, 0, gu, 2 * I, threads);
    rollyard_swiglu_fwd_f32(gu, B, I, a, threads);
    gemm(a, I, B, I, wd, D, nullptr, x, D, x, D, threads);
    return 0;
}

}  // namespace

extern "C" int rollyard_decode_layer_bf16(float* x, int64_t B, int64_t D, const float* w_in, float eps_in,
                                          const float* w_post, float eps_post, const uint16_t* wqkv, const float* bqkv,
                                          const uint16_t* wo, const float* bo, const uint16_t* wgu, int64_t I,
                                          const uint16_t* wd, const float* cos, const float* sin, const int64_t* pos,
                                          int64_t same_pos, int H, int KVH, int hd, uint16_t* Kc, uint16_t* Vc,
                                          int64_t sb, int64_t sh, int64_t sw, const int64_t* lens,
                                          const int64_t* share, int width, int threads) {
    return decode_layer<uint16_t, uint16_t>(x, B, D, w_in, eps_in, w_post, eps_post, wqkv, bqkv, wo, bo, wgu, I, wd,
                                            cos, sin, pos, same_pos, H, KVH, hd, Kc, Vc, sb, sh, sw, lens, share,
                                            width, threads);
}

// The same with fp32 weights in layout Q over an fp32 cache.
extern "C" int rollyard_decode_layer_f32(float* x, int64_t B, int64_t D, const float* w_in, float eps_in,
                                         const float* w_post, float eps_post, const float* wqkv, const float* bqkv,
                                         const float* wo, const float* bo, const float* wgu, int64_t I,
                                         const float* wd, const float* cos, const float* sin, const int64_t* pos,
                                         int64_t same_pos, int H, int KVH, int hd, float* Kc, float* Vc, int64_t sb,
                                         int64_t sh, int64_t sw, const int64_t* lens, const int64_t* share, int width,
                                         int threads) {
    return decode_layer<float, float>(x, B, D, w_in, eps_in, w_post, eps_post, wqkv, bqkv, wo, bo, wgu, I, wd, cos,
                                      sin, pos, same_pos, H, KVH, hd, Kc, Vc, sb, sh, sw, lens, share, width, threads);
}

// The same with int8 weights in layout R over an fp32 cache.
extern "C" int rollyard_decode_layer_q8(float* x, int64_t B, int64_t D, const float* w_in, float eps_in,
                                        const float* w_post, float eps_post, const int8_t* wqkv, const float* bqkv,
                                        const int8_t* wo, const float* bo, const int8_t* wgu, int64_t I,
                                        const int8_t* wd, const float* cos, const float* sin, const int64_t* pos,
                                        int64_t same_pos, int H, int KVH, int hd, float* Kc, float* Vc, int64_t sb,
                                        int64_t sh, int64_t sw, const int64_t* lens, const int64_t* share, int width,
                                        int threads) {
    return decode_layer<int8_t, float>(x, B, D, w_in, eps_in, w_post, eps_post, wqkv, bqkv, wo, bo, wgu, I, wd, cos,
                                       sin, pos, same_pos, H, KVH, hd, Kc, Vc, sb, sh, sw, lens, share, width, threads);
}

extern "C" int rollyard_decode_layer_w8a8(float* x, int64_t B, int64_t D, const float* w_in, float eps_in,
                                          const float* w_post, float eps_post, const int8_t* wqkv, const float* bqkv,
                                          const int8_t* wo, const float* bo, const int8_t* wgu, int64_t I,
                                          const int8_t* wd, const float* cos, const float* sin, const int64_t* pos,
                                          int64_t same_pos, int H, int KVH, int hd, float* Kc, float* Vc, int64_t sb,
                                          int64_t sh, int64_t sw, const int64_t* lens, const int64_t* share, int width,
                                          int threads) {
    using W = const w8a8_t*;
    return decode_layer<w8a8_t, float>(x, B, D, w_in, eps_in, w_post, eps_post, (W)wqkv, bqkv, (W)wo, bo, (W)wgu, I,
                                       (W)wd, cos, sin, pos, same_pos, H, KVH, hd, Kc, Vc, sb, sh, sw, lens, share,
                                       width, threads);
}

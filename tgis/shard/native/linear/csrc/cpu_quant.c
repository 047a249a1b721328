/*
 * Weight-only quantized matrix products on AVX-512 CPUs: tgis.shard.native._cpu_quant.
 *
 * A weight W [N, K] is stored as unsigned integers q of 4 or 8 bits with, per output row n
 * and group g of `group` consecutive input columns, a scale s[n, g] and a scaled zero point
 * sz[n, g] = s[n, g] * zero[n, g], so that W[n, k] = s[n, g] * q[n, k] - sz[n, g] with
 * g = k / group. The layout (tgis's own, written by cpu_quant.py), in blocks of 32 values:
 *
 *   8 bits: packed [N, K] uint8, one byte per value;
 *   4 bits: packed [N, K / 2] uint8, 16 bytes per block: byte j of block b holds value
 *           32 * b + j in its low nibble and value 32 * b + 16 + j in its high nibble;
 *
 * with K and `group` multiples of 32 and `group` dividing K. The bytes are ordered as the
 * kernel reads them: rows in tiles of 16 (ROW_TILE; the last tile padded), and within a
 * tile, spans of 16 blocks (512 values, K_TILE_BLOCKS) of its 16 rows one after the other,
 * so that one tile's span is one contiguous run of memory (a 4 KB stream for 4 bits).
 *
 * matmul: y[m, n] = sum_k x[m, k] * W[n, k] for the rows of a decode step. Each block of
 * 16 bytes is widened once to 16 32-bit lanes (vpmovzxbd) and turned into weights: for 4
 * bits by looking both nibbles up in a 16-entry table of the group's s * i - sz (vpermps
 * reads an index's low 4 bits), for 8 bits by converting and scaling; each weight vector
 * is then used by up to 8 rows of x (float32 accumulators in registers), so a decode step
 * reads 1/4 (4 bits) or 1/2 (8 bits) of the bytes of a bfloat16 weight, once.
 * dequantize: W as bfloat16 or float32, for large steps multiplied by oneDNN afterwards.
 *
 * AVX-512 only (F, BW, VL, DQ): `available()` says whether this processor has it, and
 * cpu_quant.py uses PyTorch's int4/int8 kernels where it does not. Output rows are shared
 * out between OpenMP threads from torch's own pool (the module binds to the libgomp torch
 * loaded). No Python objects in the loops (the GIL is released).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define INLINE static inline __attribute__((always_inline))

#define ROWS_PER_PASS 8  /* rows of x accumulated together (8 accumulator registers) */
#define ROW_TILE 16      /* output rows per unit of work between threads, and of the layout */
#define K_TILE_BLOCKS 16 /* 512 values: 8 rows of x over them are 16 KB, within L1 */
#define PREFETCH_AHEAD 8192 /* bytes of the weight stream fetched ahead of the products */

typedef struct {
    const uint8_t *packed;
    const float *scales; /* [N, groups] */
    const float *szeros; /* [N, groups] */
    int64_t n, k, group, bits;
} QuantWeight;

/* Row n's bytes for blocks [b0, b1) of a span (see the layout above): block b is at
 * (b - b0) * bytes_per_block from the result. */
INLINE const uint8_t *span_of(const QuantWeight *w, int64_t n, int64_t b0, int64_t b1,
                              const int bits) {
    const int64_t per_block = bits == 8 ? 32 : 16, row_bytes = w->k / 32 * per_block;
    const int64_t tile = n / ROW_TILE, r = n % ROW_TILE;
    return w->packed + tile * ROW_TILE * row_bytes + ROW_TILE * b0 * per_block +
           r * (b1 - b0) * per_block;
}

/* The 32 weights of block b of a row (lo: values 0-15 of the block, hi: 16-31), given the
 * block's group's scale and scaled zero (s, sz broadcast) and, for 4 bits, its table. */
AVX512 INLINE void weights_of_block(const uint8_t *row, int64_t b, const int bits,
                                    __m512 table, __m512 s, __m512 sz, __m512 *lo, __m512 *hi) {
    if (bits == 4) {
        __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * b)));
        *lo = _mm512_permutexvar_ps(packed, table);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(packed, 4), table);
    } else {
        const uint8_t *bytes = row + 32 * b;
        __m512 first = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes)));
        __m512 second = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 16))));
        *lo = _mm512_fmsub_ps(first, s, sz);
        *hi = _mm512_fmsub_ps(second, s, sz);
    }
}

AVX512 INLINE __m512 group_table(float s, float sz) {
    const __m512 iota =
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmsub_ps(_mm512_set1_ps(s), iota, _mm512_set1_ps(sz));
}

/* Rows m0 .. m0 + rows of x against output rows n .. n + R - 1 over the blocks [b0, b1) of
 * K (see tile_span): each block of x is loaded once for the R output rows, each block of
 * weights decoded once for the rows of x. `rows` and `R` are constants where this is
 * inlined (rows * R <= 8: 2 * rows * R accumulators in registers). */
AVX512 INLINE void row_block(const QuantWeight *w, int64_t n, int64_t first, const float *x,
                             int64_t m0, int64_t b0, int64_t b1, int64_t g0,
                             float part[ROW_TILE][ROWS_PER_PASS], const int rows, const int R,
                             const int bits) {
    const int64_t k = w->k, groups = k / w->group, per_group = w->group / 32;
    const int64_t per_block = bits == 8 ? 32 : 16;
    const uint8_t *wrows[4];
    const float *scales[4], *szeros[4];
    __m512 acc[4][4][2];
    for (int r = 0; r < R; r++) {
        wrows[r] = span_of(w, n + r, b0, b1, bits) - per_block * b0;
        scales[r] = w->scales + (n + r) * groups;
        szeros[r] = w->szeros + (n + r) * groups;
        for (int m = 0; m < rows; m++) acc[m][r][0] = acc[m][r][1] = _mm512_setzero_ps();
    }
    for (int64_t g = g0; g * per_group < b1; g++) {
        __m512 s[4], sz[4], table[4];
        for (int r = 0; r < R; r++) {
            s[r] = _mm512_set1_ps(scales[r][g]);
            sz[r] = _mm512_set1_ps(szeros[r][g]);
            table[r] = bits == 4 ? group_table(scales[r][g], szeros[r][g]) : s[r];
        }
        const int64_t start = g * per_group > b0 ? g * per_group : b0;
        const int64_t stop = (g + 1) * per_group < b1 ? (g + 1) * per_group : b1;
        for (int64_t b = start; b < stop; b++) {
            __m512 lo[4], hi[4];
            if (bits == 8 || (b & 1) == 0) /* the stream ahead, a line per 64 bytes */
                for (int r = 0; r < R; r++)
                    _mm_prefetch((const char *)(wrows[r] + per_block * b) + PREFETCH_AHEAD,
                                 _MM_HINT_T0);
            for (int r = 0; r < R; r++)
                weights_of_block(wrows[r], b, bits, table[r], s[r], sz[r], &lo[r], &hi[r]);
            for (int m = 0; m < rows; m++) {
                const float *xm = x + (m0 + m) * k + 32 * b;
                const __m512 x0 = _mm512_loadu_ps(xm), x1 = _mm512_loadu_ps(xm + 16);
                for (int r = 0; r < R; r++) {
                    acc[m][r][0] = _mm512_fmadd_ps(lo[r], x0, acc[m][r][0]);
                    acc[m][r][1] = _mm512_fmadd_ps(hi[r], x1, acc[m][r][1]);
                }
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int r = 0; r < R; r++)
            part[n + r - first][m] +=
                _mm512_reduce_add_ps(_mm512_add_ps(acc[m][r][0], acc[m][r][1]));
}

/* Partial products of output rows [first, end) (at most ROW_TILE) with rows m0 .. m0 + rows
 * of x over the blocks [b0, b1) of K, added into part[n - first][m]. `rows` and `bits` are
 * constants where this is inlined, so the accumulators stay in registers: two per row of x
 * (the block's two halves), four when there is one row, so that consecutive fused
 * multiply-adds do not wait on each other. */
AVX512 INLINE void tile_span(const QuantWeight *w, int64_t first, int64_t end, const float *x,
                             int64_t m0, int64_t b0, int64_t b1,
                             float part[ROW_TILE][ROWS_PER_PASS], const int rows,
                             const int bits) {
    const int64_t k = w->k, groups = k / w->group, per_group = w->group / 32;
    const int lanes = rows == 1 ? 4 : 2;
    const int64_t g0 = b0 / per_group; /* the tile's first group (one division per tile) */
    int64_t n = first;
    /* few rows of x: several output rows at a time share each load of x */
    const int R = rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
    if (R > 1)
        for (; n + R <= end; n += R) row_block(w, n, first, x, m0, b0, b1, g0, part, rows, R, bits);
    for (; n < end; n++) {
        const uint8_t *row = span_of(w, n, b0, b1, bits) - (bits == 8 ? 32 : 16) * b0;
        const float *scales = w->scales + n * groups, *szeros = w->szeros + n * groups;
        __m512 acc[ROWS_PER_PASS][4];
        for (int m = 0; m < rows; m++)
            for (int a = 0; a < lanes; a++) acc[m][a] = _mm512_setzero_ps();
        for (int64_t g = g0; g * per_group < b1; g++) {
            const __m512 s = _mm512_set1_ps(scales[g]), sz = _mm512_set1_ps(szeros[g]);
            const __m512 table = bits == 4 ? group_table(scales[g], szeros[g]) : s;
            const int64_t start = g * per_group > b0 ? g * per_group : b0;
            const int64_t stop = (g + 1) * per_group < b1 ? (g + 1) * per_group : b1;
            int64_t b = start;
            if (rows == 1) { /* two blocks at a time into four accumulators */
                for (; b + 1 < stop; b += 2) {
                    __m512 lo, hi, lo2, hi2;
                    weights_of_block(row, b, bits, table, s, sz, &lo, &hi);
                    weights_of_block(row, b + 1, bits, table, s, sz, &lo2, &hi2);
                    const float *xm = x + m0 * k + 32 * b;
                    acc[0][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xm), acc[0][0]);
                    acc[0][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xm + 16), acc[0][1]);
                    acc[0][2] = _mm512_fmadd_ps(lo2, _mm512_loadu_ps(xm + 32), acc[0][2]);
                    acc[0][3] = _mm512_fmadd_ps(hi2, _mm512_loadu_ps(xm + 48), acc[0][3]);
                }
            }
            for (; b < stop; b++) {
                __m512 lo, hi;
                if (bits == 8 || (b & 1) == 0)
                    _mm_prefetch((const char *)(row + (bits == 8 ? 32 : 16) * b) + PREFETCH_AHEAD,
                                 _MM_HINT_T0);
                weights_of_block(row, b, bits, table, s, sz, &lo, &hi);
                for (int m = 0; m < rows; m++) {
                    const float *xm = x + (m0 + m) * k + 32 * b;
                    acc[m][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xm), acc[m][0]);
                    acc[m][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xm + 16), acc[m][1]);
                }
            }
        }
        for (int m = 0; m < rows; m++) {
            __m512 sum = _mm512_add_ps(acc[m][0], acc[m][1]);
            if (lanes == 4) sum = _mm512_add_ps(sum, _mm512_add_ps(acc[m][2], acc[m][3]));
            part[n - first][m] += _mm512_reduce_add_ps(sum);
        }
    }
}

#define SPAN_CASE(R)                                                           \
    case R:                                                                    \
        if (w->bits == 4)                                                      \
            tile_span(w, first, end, x, m0, b0, b1, part, R, 4);               \
        else                                                                   \
            tile_span(w, first, end, x, m0, b0, b1, part, R, 8);               \
        break;

AVX512 static void matmul(const QuantWeight *w, const float *x, float *y, int64_t rows,
                          int threads) {
    const int64_t tiles = (w->n + ROW_TILE - 1) / ROW_TILE, blocks = w->k / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = t * ROW_TILE;
        const int64_t end = first + ROW_TILE < w->n ? first + ROW_TILE : w->n;
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS_PER_PASS) {
            const int count = (int)(rows - m0 < ROWS_PER_PASS ? rows - m0 : ROWS_PER_PASS);
            float part[ROW_TILE][ROWS_PER_PASS] = {{0}};
            for (int64_t b0 = 0; b0 < blocks; b0 += K_TILE_BLOCKS) {
                const int64_t b1 = b0 + K_TILE_BLOCKS < blocks ? b0 + K_TILE_BLOCKS : blocks;
                switch (count) {
                    SPAN_CASE(1)
                    SPAN_CASE(2)
                    SPAN_CASE(3)
                    SPAN_CASE(4)
                    SPAN_CASE(5)
                    SPAN_CASE(6)
                    SPAN_CASE(7)
                    SPAN_CASE(8)
                }
            }
            for (int64_t n = first; n < end; n++)
                for (int m = 0; m < count; m++) y[(m0 + m) * w->n + n] = part[n - first][m];
        }
    }
}

/* The same products with bfloat16 rows of x (processors with AVX512-BF16): each block's
 * weights are rounded to bfloat16 pairs (vcvtne2ps2bf16) and multiplied by vdpbf16ps, 32
 * products per instruction where an fp32 FMA does 16, with float32 accumulation. For
 * steps of several rows, where the fp32 products are what limits the kernel. */
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

AVX512BF16 INLINE void row_block_bf16(const QuantWeight *w, int64_t n, int64_t first,
                                      const uint16_t *x, int64_t m0, int64_t b0, int64_t b1,
                                      int64_t g0, float part[ROW_TILE][ROWS_PER_PASS],
                                      const int rows, const int R, const int bits) {
    const int64_t k = w->k, groups = k / w->group, per_group = w->group / 32;
    const int64_t per_block = bits == 8 ? 32 : 16;
    const uint8_t *wrows[4];
    const float *scales[4], *szeros[4];
    __m512 acc[8][4];
    for (int r = 0; r < R; r++) {
        wrows[r] = span_of(w, n + r, b0, b1, bits) - per_block * b0;
        scales[r] = w->scales + (n + r) * groups;
        szeros[r] = w->szeros + (n + r) * groups;
        for (int m = 0; m < rows; m++) acc[m][r] = _mm512_setzero_ps();
    }
    for (int64_t g = g0; g * per_group < b1; g++) {
        __m512 s[4], sz[4], table[4];
        for (int r = 0; r < R; r++) {
            s[r] = _mm512_set1_ps(scales[r][g]);
            sz[r] = _mm512_set1_ps(szeros[r][g]);
            table[r] = bits == 4 ? group_table(scales[r][g], szeros[r][g]) : s[r];
        }
        const int64_t start = g * per_group > b0 ? g * per_group : b0;
        const int64_t stop = (g + 1) * per_group < b1 ? (g + 1) * per_group : b1;
        for (int64_t b = start; b < stop; b++) {
            __m512bh wbf[4];
            if (bits == 8 || (b & 1) == 0)
                for (int r = 0; r < R; r++)
                    _mm_prefetch((const char *)(wrows[r] + per_block * b) + PREFETCH_AHEAD,
                                 _MM_HINT_T0);
            for (int r = 0; r < R; r++) {
                __m512 lo, hi;
                weights_of_block(wrows[r], b, bits, table[r], s[r], sz[r], &lo, &hi);
                wbf[r] = _mm512_cvtne2ps_pbh(hi, lo); /* [lo 0-15, hi 0-15] as x is laid */
            }
            for (int m = 0; m < rows; m++) {
                const __m512bh xb =
                    (__m512bh)_mm512_loadu_si512((const void *)(x + (m0 + m) * k + 32 * b));
                for (int r = 0; r < R; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wbf[r], xb);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int r = 0; r < R; r++) part[n + r - first][m] += _mm512_reduce_add_ps(acc[m][r]);
}

#define BF16_CASE(ROWS, R)                                                                  \
    case ROWS:                                                                              \
        for (n = first; n + R <= end; n += R)                                               \
            if (w->bits == 4)                                                               \
                row_block_bf16(w, n, first, x, m0, b0, b1, g0, part, ROWS, R, 4);           \
            else                                                                            \
                row_block_bf16(w, n, first, x, m0, b0, b1, g0, part, ROWS, R, 8);           \
        for (; n < end; n++)                                                                \
            if (w->bits == 4)                                                               \
                row_block_bf16(w, n, first, x, m0, b0, b1, g0, part, ROWS, 1, 4);           \
            else                                                                            \
                row_block_bf16(w, n, first, x, m0, b0, b1, g0, part, ROWS, 1, 8);           \
        break;

AVX512BF16 static void matmul_bf16(const QuantWeight *w, const uint16_t *x, float *y,
                                   int64_t rows, int threads) {
    const int64_t tiles = (w->n + ROW_TILE - 1) / ROW_TILE, blocks = w->k / 32;
    const int64_t per_group = w->group / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = t * ROW_TILE;
        const int64_t end = first + ROW_TILE < w->n ? first + ROW_TILE : w->n;
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS_PER_PASS) {
            const int count = (int)(rows - m0 < ROWS_PER_PASS ? rows - m0 : ROWS_PER_PASS);
            float part[ROW_TILE][ROWS_PER_PASS] = {{0}};
            for (int64_t b0 = 0; b0 < blocks; b0 += K_TILE_BLOCKS) {
                const int64_t b1 = b0 + K_TILE_BLOCKS < blocks ? b0 + K_TILE_BLOCKS : blocks;
                const int64_t g0 = b0 / per_group;
                int64_t n;
                switch (count) {
                    BF16_CASE(1, 4)
                    BF16_CASE(2, 4)
                    BF16_CASE(3, 4)
                    BF16_CASE(4, 4)
                    BF16_CASE(5, 2)
                    BF16_CASE(6, 2)
                    BF16_CASE(7, 2)
                    BF16_CASE(8, 2)
                }
            }
            for (int64_t n = first; n < end; n++)
                for (int m = 0; m < count; m++) y[(m0 + m) * w->n + n] = part[n - first][m];
        }
    }
}

/* float32 to bfloat16, rounding to nearest even (as torch does; no NaNs here). */
AVX512 INLINE __m256i to_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

AVX512 INLINE void dequantize_row(const QuantWeight *w, int64_t n, void *out, const int bf16,
                                  const int bits) {
    const int64_t k = w->k, groups = k / w->group, per_group = w->group / 32, blocks = k / 32;
    for (int64_t b0 = 0; b0 < blocks; b0 += K_TILE_BLOCKS) {
        const int64_t b1 = b0 + K_TILE_BLOCKS < blocks ? b0 + K_TILE_BLOCKS : blocks;
        const uint8_t *row = span_of(w, n, b0, b1, bits) - (bits == 8 ? 32 : 16) * b0;
        for (int64_t b = b0; b < b1; b++) {
            const int64_t g = b / per_group;
            const float sg = w->scales[n * groups + g], szg = w->szeros[n * groups + g];
            const __m512 s = _mm512_set1_ps(sg), sz = _mm512_set1_ps(szg);
            const __m512 table = bits == 4 ? group_table(sg, szg) : s;
            __m512 lo, hi;
            weights_of_block(row, b, bits, table, s, sz, &lo, &hi);
            if (bf16) {
                uint16_t *dst = (uint16_t *)out + n * k + 32 * b;
                _mm256_storeu_si256((__m256i *)dst, to_bf16(lo));
                _mm256_storeu_si256((__m256i *)(dst + 16), to_bf16(hi));
            } else {
                float *dst = (float *)out + n * k + 32 * b;
                _mm512_storeu_ps(dst, lo);
                _mm512_storeu_ps(dst + 16, hi);
            }
        }
    }
}

AVX512 static void dequantize(const QuantWeight *w, void *out, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < w->n; n++) {
        if (w->bits == 4) {
            if (bf16)
                dequantize_row(w, n, out, 1, 4);
            else
                dequantize_row(w, n, out, 0, 4);
        } else {
            if (bf16)
                dequantize_row(w, n, out, 1, 8);
            else
                dequantize_row(w, n, out, 0, 8);
        }
    }
}

static int has_avx512_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}

static int has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

static int parse_weight(QuantWeight *w, Py_ssize_t packed, Py_ssize_t scales,
                        Py_ssize_t szeros, long long n, long long k, long long group,
                        long long bits) {
    if (!has_avx512()) {
        PyErr_SetString(PyExc_RuntimeError, "cpu_quant needs AVX-512 (F, BW, VL, DQ)");
        return 0;
    }
    if ((bits != 4 && bits != 8) || group <= 0 || group % 32 || k % group || n <= 0) {
        PyErr_SetString(PyExc_ValueError,
                        "quantized weight: bits 4 or 8, group a multiple of 32 dividing K");
        return 0;
    }
    w->packed = (const uint8_t *)packed;
    w->scales = (const float *)scales;
    w->szeros = (const float *)szeros;
    w->n = n;
    w->k = k;
    w->group = group;
    w->bits = bits;
    return 1;
}

static PyObject *py_available(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(has_avx512());
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t packed, scales, szeros, x, y;
    long long n, k, group, bits, rows;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "nnnnnLLLLL|i", &packed, &scales, &szeros, &x, &y, &n, &k,
                          &group, &bits, &rows, &threads))
        return NULL;
    QuantWeight w;
    if (!parse_weight(&w, packed, scales, szeros, n, k, group, bits)) return NULL;
    if (rows <= 0) {
        PyErr_SetString(PyExc_ValueError, "matmul: rows must be positive");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS matmul(&w, (const float *)x, (float *)y, rows,
                                  threads > 0 ? threads : 1);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_matmul_bf16(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t packed, scales, szeros, x, y;
    long long n, k, group, bits, rows;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "nnnnnLLLLL|i", &packed, &scales, &szeros, &x, &y, &n, &k,
                          &group, &bits, &rows, &threads))
        return NULL;
    QuantWeight w;
    if (!parse_weight(&w, packed, scales, szeros, n, k, group, bits)) return NULL;
    if (!has_avx512_bf16() || rows <= 0) {
        PyErr_SetString(PyExc_ValueError, "matmul_bf16: needs AVX512-BF16 and rows > 0");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS matmul_bf16(&w, (const uint16_t *)x, (float *)y, rows,
                                       threads > 0 ? threads : 1);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_has_bf16(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(has_avx512() && has_avx512_bf16());
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t packed, scales, szeros, out;
    long long n, k, group, bits;
    int bf16 = 1, threads = 1;
    if (!PyArg_ParseTuple(args, "nnnnLLLL|ii", &packed, &scales, &szeros, &out, &n, &k, &group,
                          &bits, &bf16, &threads))
        return NULL;
    QuantWeight w;
    if (!parse_weight(&w, packed, scales, szeros, n, k, group, bits)) return NULL;
    Py_BEGIN_ALLOW_THREADS dequantize(&w, (void *)out, bf16, threads > 0 ? threads : 1);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"available", py_available, METH_NOARGS,
     "available(): whether this processor runs the kernels (AVX-512 F, BW, VL, DQ)"},
    {"matmul", py_matmul, METH_VARARGS,
     "matmul(packed, scales, szeros, x, y, n, k, group, bits, rows, threads=1): y [rows, n] "
     "(float32) = x [rows, k] (float32) @ W.T (addresses as integers)"},
    {"has_bf16", py_has_bf16, METH_NOARGS,
     "has_bf16(): whether matmul_bf16 runs here (AVX512-BF16)"},
    {"matmul_bf16", py_matmul_bf16, METH_VARARGS,
     "matmul_bf16(packed, scales, szeros, x, y, n, k, group, bits, rows, threads=1): as "
     "matmul with x [rows, k] in bfloat16 and the weights rounded to bfloat16"},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(packed, scales, szeros, out, n, k, group, bits, bf16=1, threads=1): W [n, k] "
     "into out, as bfloat16 (bf16=1) or float32"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cpu_quant",
    "Weight-only 4- and 8-bit matrix products on AVX-512 CPUs (see cpu_quant.c)", -1, methods,
};

PyMODINIT_FUNC PyInit__cpu_quant(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ROW_TILE", ROW_TILE) < 0 ||
        PyModule_AddIntConstant(m, "K_TILE_BLOCKS", K_TILE_BLOCKS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

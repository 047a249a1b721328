/*
 * Paged decode attention on the CPU, reading keys and values in place through the block
 * table (no gather), for float32 and bfloat16 caches: tgis.shard.native.attention._cpu_attention.
 *
 * For each sequence s (one query token each) and each KV head h, the G = heads / kv_heads
 * query heads that share h attend to the sequence's first context_lens[s] cached tokens:
 *
 *   score[g][t] = scale * dot(q[s, h*G + g], K[t, h])      t = start .. context_lens[s] - 1
 *   (or softcap * tanh(score / softcap) when softcap > 0: Gemma 2's logit soft-capping)
 *   out[s, h*G + g] = sum_t softmax(score[g])[t] * V[t, h]
 *
 * (with attention sinks, gpt-oss's, sinks[h*G + g] is one more logit in the softmax's
 * denominator: softmax over the scores and the sink, the sink's share dropped)
 *
 * where start is 0, or context_lens[s] - window for a layer with a sliding window (the keys
 * p - window < t <= p of the query at p = context_lens[s] - 1): the blocks wholly before
 * start are never read (nor checked: they may have been given back).
 *
 * where token t lives in block block_tables[s, t / block_size] at offset t % block_size of a
 * cache laid out [num_blocks, block_size, kv_heads, head_dim]. Queries, scores, the softmax
 * and the output are float32; a bfloat16 cache is widened as it is read (a bfloat16 is the
 * top half of a float32). The loops are written with GCC's generic 16-lane vectors, so each
 * compiled variant keeps them in registers: 16 dot products reduced together, a polynomial
 * exp, 64 output lanes accumulated over every value row (see decode below). The (sequence,
 * KV head) pairs are shared out between OpenMP threads (decode_all). Plain C with no
 * Python objects in the loop (the GIL is released); built by setup.py as an optional
 * extension, compiled for x86-64-v4 (AVX-512), v3 (AVX2, FMA) and baseline x86-64, chosen
 * at load time (target_clones); tgis/shard/native/attention/cpu_paged.py falls back to the
 * torch reference when it is missing.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* TGIS_SINGLE_TARGET builds one variant for the -march given (the tests build each one). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(TGIS_SINGLE_TARGET)
#define TGIS_CLONES \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TGIS_CLONES
#endif

typedef struct {
    const float *q;           /* [seqs, heads, head_dim] */
    const void *k_cache;      /* [num_blocks, block_size, kv_heads, head_dim], float or bf16 */
    const void *v_cache;
    float *out;               /* [seqs, heads, head_dim] */
    const int64_t *tables;    /* [seqs, table_stride] */
    const int64_t *context;   /* [seqs] */
    int64_t seqs, heads, kv_heads, head_dim, block_size, table_stride, num_blocks, max_context;
    int64_t window;           /* > 0: a sliding window, the last ``window`` keys only */
    float scale;
    float softcap;            /* > 0: scores capped to softcap * tanh(score / softcap) */
    const float *sinks;       /* [heads] each query head's sink logit, or NULL: none */
} DecodeArgs;

/* 16 lanes in one vector (GCC's generic vectors: one AVX-512, two AVX2 or four SSE registers,
 * as each clone compiles them). */
typedef float vec16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t u32x16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));

static inline vec16 load16_f32(const float *p) { return *(const vec16 *)p; }

/* bfloat16 is the top half of a float32: widen by shifting into place. */
static inline vec16 load16_bf16(const uint16_t *p) {
    return (vec16)(__builtin_convertvector(*(const u16x16 *)p, u32x16) << 16);
}

/* Lane t of the result is the sum of the 16 lanes of v[t] (a transposing reduction tree:
 * 15 adds for 16 sums, instead of 15 per sum). */
static inline vec16 sum_each16(const vec16 v[16]) {
    vec16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                       19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                       22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                       22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
}

static inline float widen(uint16_t bits) {
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)bits << 16};
    return v.f;
}

/* Lane-wise partial products of dot(a, b) (their 16 lanes sum to it). */
static inline vec16 dot_lanes_f32(const float *restrict a, const float *restrict b, int64_t n) {
    vec16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc += load16_f32(a + i) * load16_f32(b + i);
    for (; i < n; i++) acc[0] += a[i] * b[i];
    return acc;
}

static inline vec16 dot_lanes_bf16(const float *restrict a, const uint16_t *restrict b,
                                   int64_t n) {
    vec16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc += load16_f32(a + i) * load16_bf16(b + i);
    for (; i < n; i++) acc[0] += a[i] * widen(b[i]);
    return acc;
}

typedef int32_t i32x16 __attribute__((vector_size(64), aligned(4)));

/* e^x for x <= 0 (a score minus its row's maximum) on 16 lanes: x = n ln2 + r with
 * |r| <= ln2 / 2 (n rounded to nearest by adding and subtracting 1.5 * 2^23, which the
 * compiler may not fold away without -ffast-math), e^r by its Taylor polynomial to r^6
 * (relative error below 2e-7, about one float32 rounding), 2^n built in the exponent bits.
 * Below -87 the result is e^-87 (~1e-38) instead of smaller: nothing next to the row's
 * maximum term, 1. */
static inline vec16 exp16_nonpositive(vec16 x) {
    const i32x16 low = x < -87.0f;
    x = (vec16)(((i32x16)x & ~low) | ((i32x16)((vec16){0} - 87.0f) & low));
    const vec16 n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    const vec16 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    vec16 p = (vec16){0} + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
    return p * (vec16)bits;
}

/* The same for one value (the lanes past a multiple of 16). */
static inline float exp_nonpositive(float x) { return exp16_nonpositive((vec16){0} + x)[0]; }

/* sc[0 .. n) <- softmax(sc), n >= 1: 16 lanes at a time, the rest one by one; with a
 * ``sink`` (not NULL) its logit joins the maximum and the denominator only. */
static inline void softmax_in_place(float *restrict sc, int64_t n, const float *sink) {
    float max = sink != NULL && *sink > sc[0] ? *sink : sc[0];
    int64_t t = 0;
    if (n >= 16) {
        vec16 top = load16_f32(sc);
        for (t = 16; t + 16 <= n; t += 16) {
            const vec16 x = load16_f32(sc + t);
            const i32x16 more = x > top;
            top = (vec16)(((i32x16)x & more) | ((i32x16)top & ~more));
        }
        for (int i = 0; i < 16; i++) max = top[i] > max ? top[i] : max;
    }
    for (; t < n; t++) max = sc[t] > max ? sc[t] : max;
    vec16 sum = {0};
    float total = 0.0f;
    for (t = 0; t + 16 <= n; t += 16) {
        const vec16 e = exp16_nonpositive(load16_f32(sc + t) - max);
        *(vec16 *)(sc + t) = e;
        sum += e;
    }
    for (; t < n; t++) {
        sc[t] = exp_nonpositive(sc[t] - max);
        total += sc[t];
    }
    for (int i = 0; i < 16; i++) total += sum[i];
    if (sink != NULL) total += exp_nonpositive(*sink - max);
    const float inv = 1.0f / total;
    for (t = 0; t + 16 <= n; t += 16) *(vec16 *)(sc + t) = load16_f32(sc + t) * inv;
    for (; t < n; t++) sc[t] *= inv;
}

/* One work item: sequence s and KV head h, i.e. the ``group`` query heads that read h.
 * Returns 0, or -1 when the sequence's context is empty, longer than max_context or its
 * table, or names a block out of range (nothing is written for it). ``scores`` holds
 * group * max_context floats. Scores: for each block, 16 keys at a time, each query head's
 * 16 dot products reduced together (sum_each16). Softmax per head. Values: per query head,
 * 64 output lanes at a time held in four vector accumulators over every key. */
#define DEFINE_DECODE(NAME, ELEM, DOT, LOAD16, TO_FLOAT)                                          \
TGIS_CLONES \
static int NAME(const DecodeArgs *a, int64_t s, int64_t h, float *scores) { \
    const int64_t heads = a->heads, group = a->heads / a->kv_heads, dim = a->head_dim; \
    const int64_t bs = a->block_size; \
    const int64_t row = a->kv_heads * dim; /* elements between consecutive tokens of a block */ \
    const int64_t length = a->context[s]; \
    const int64_t *table = a->tables + s * a->table_stride; \
    const int64_t blocks = (length + bs - 1) / bs; \
    if (length <= 0 || length > a->max_context || blocks > a->table_stride) return -1; \
    /* keys start .. length - 1 are read: blocks b0 .. blocks - 1, from offset lo(b) */ \
    const int64_t start = a->window > 0 && length > a->window ? length - a->window : 0; \
    const int64_t keys = length - start, b0 = start / bs; \
    for (int64_t b = b0; b < blocks; b++) { \
        if (table[b] < 0 || table[b] >= a->num_blocks) return -1; \
    } \
    const float *q = a->q + (s * heads + h * group) * dim; \
    float *out = a->out + (s * heads + h * group) * dim; \
    for (int64_t b = b0; b < blocks; b++) { \
        const int64_t first = b * bs, lo = start > first ? start - first : 0; \
        const int64_t n = length - first < bs ? length - first : bs; \
        const ELEM *k = (const ELEM *)a->k_cache + table[b] * bs * row + h * dim; \
        for (int64_t t0 = lo; t0 < n; t0 += 16) { \
            const int64_t m = n - t0 < 16 ? n - t0 : 16; \
            for (int64_t g = 0; g < group; g++) { \
                const ELEM *kh = k + t0 * row; \
                vec16 lanes[16]; \
                for (int64_t t = 0; t < 16; t++) \
                    lanes[t] = t < m ? DOT(q + g * dim, kh + t * row, dim) : (vec16){0}; \
                const vec16 sums = sum_each16(lanes); \
                float *dst = scores + g * keys + first + t0 - start; \
                for (int64_t t = 0; t < m; t++) dst[t] = a->scale * sums[t]; \
                if (a->softcap > 0) \
                    for (int64_t t = 0; t < m; t++) \
                        dst[t] = a->softcap * tanhf(dst[t] / a->softcap); \
            } \
        } \
    } \
    for (int64_t g = 0; g < group; g++) \
        softmax_in_place(scores + g * keys, keys, a->sinks ? a->sinks + h * group + g : NULL); \
    const ELEM *v_head = (const ELEM *)a->v_cache + h * dim; \
    for (int64_t g = 0; g < group; g++) { \
        const float *w = scores + g * keys - start; /* w[t]: key t's weight */ \
        float *o = out + g * dim; \
        int64_t d = 0; \
        for (; d + 64 <= dim; d += 64) { \
            vec16 acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0}; \
            for (int64_t b = b0; b < blocks; b++) { \
                const int64_t first = b * bs, lo = start > first ? start - first : 0; \
                const int64_t n = length - first < bs ? length - first : bs; \
                const ELEM *v = v_head + (table[b] * bs + lo) * row + d; \
                for (int64_t i = lo; i < n; i++, v += row) { \
                    const float p = w[first + i]; \
                    acc0 += p * LOAD16(v); \
                    acc1 += p * LOAD16(v + 16); \
                    acc2 += p * LOAD16(v + 32); \
                    acc3 += p * LOAD16(v + 48); \
                } \
            } \
            *(vec16 *)(o + d) = acc0; \
            *(vec16 *)(o + d + 16) = acc1; \
            *(vec16 *)(o + d + 32) = acc2; \
            *(vec16 *)(o + d + 48) = acc3; \
        } \
        for (; d + 16 <= dim; d += 16) { \
            vec16 acc = {0}; \
            for (int64_t b = b0; b < blocks; b++) { \
                const int64_t first = b * bs, lo = start > first ? start - first : 0; \
                const int64_t n = length - first < bs ? length - first : bs; \
                const ELEM *v = v_head + (table[b] * bs + lo) * row + d; \
                for (int64_t i = lo; i < n; i++, v += row) acc += w[first + i] * LOAD16(v); \
            } \
            *(vec16 *)(o + d) = acc; \
        } \
        for (; d < dim; d++) { \
            float acc = 0.0f; \
            for (int64_t b = b0; b < blocks; b++) { \
                const int64_t first = b * bs, lo = start > first ? start - first : 0; \
                const int64_t n = length - first < bs ? length - first : bs; \
                const ELEM *v = v_head + (table[b] * bs + lo) * row + d; \
                for (int64_t i = lo; i < n; i++, v += row) acc += w[first + i] * TO_FLOAT(*v); \
            } \
            o[d] = acc; \
        } \
    } \
    return 0; \
}

DEFINE_DECODE(decode_f32, float, dot_lanes_f32, load16_f32, (float))
DEFINE_DECODE(decode_bf16, uint16_t, dot_lanes_bf16, load16_bf16, widen)

/* Every (sequence, KV head) item, handed out one at a time (an atomic counter: contexts
 * differ in length) to ``threads`` OpenMP threads. Loaded after torch, this module binds to
 * the libgomp torch already loaded (same soname), so the team is torch's own pool, whose
 * workers are already spinning for the next op, not a second set of threads competing for
 * the cores. Only GOMP_parallel and omp_get_thread_num are used: any libgomp has them.
 * ``scores`` holds threads * group * max_context floats. Returns 0, or -1 as above. */
static int decode_all(const DecodeArgs *a, float *scores, int threads, int bf16) {
    const int64_t items = a->seqs * a->kv_heads;
    const int64_t per_thread = (a->heads / a->kv_heads) * (a->max_context > 0 ? a->max_context : 1);
    int64_t next = 0;
    int status = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
        float *mine = scores + (int64_t)omp_get_thread_num() * per_thread;
#else
        float *mine = scores;
#endif
        int failed = 0;
        for (;;) {
            const int64_t item = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (item >= items) break;
            const int64_t s = item / a->kv_heads, h = item % a->kv_heads;
            failed |= bf16 ? decode_bf16(a, s, h, mine) : decode_f32(a, s, h, mine);
        }
        if (failed) __atomic_store_n(&status, -1, __ATOMIC_RELAXED);
    }
    return status;
}

static PyObject *paged_decode_attention(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t q, k_cache, v_cache, out, tables, context;
    DecodeArgs a;
    long long seqs, heads, kv_heads, head_dim, block_size, table_stride, num_blocks, max_context;
    double scale;
    int bf16 = 0, threads = 1;
    long long window = 0;
    double softcap = 0.0;
    Py_ssize_t sinks = 0;
    if (!PyArg_ParseTuple(args, "nnnnnnLLLLLLLLd|iiLdn", &q, &k_cache, &v_cache, &out, &tables,
                          &context, &seqs, &heads, &kv_heads, &head_dim, &block_size,
                          &table_stride, &num_blocks, &max_context, &scale, &bf16, &threads,
                          &window, &softcap, &sinks)) {
        return NULL;
    }
#ifndef _OPENMP
    threads = 1;
#endif
    if (threads < 1) threads = 1;
    if (seqs < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0 ||
        block_size <= 0 || table_stride < 0 || num_blocks <= 0 || max_context < 0 || window < 0 ||
        softcap < 0) {
        PyErr_SetString(PyExc_ValueError, "paged_decode_attention: bad shape arguments");
        return NULL;
    }
    a.q = (const float *)q;
    a.k_cache = (const void *)k_cache;
    a.v_cache = (const void *)v_cache;
    a.out = (float *)out;
    a.tables = (const int64_t *)tables;
    a.context = (const int64_t *)context;
    a.seqs = seqs;
    a.heads = heads;
    a.kv_heads = kv_heads;
    a.head_dim = head_dim;
    a.block_size = block_size;
    a.table_stride = table_stride;
    a.num_blocks = num_blocks;
    a.max_context = max_context;
    a.window = window;
    a.scale = (float)scale;
    a.softcap = (float)softcap;
    a.sinks = (const float *)sinks;
    float *scores = malloc((size_t)(max_context > 0 ? max_context : 1) *
                           (size_t)(heads / kv_heads) * (size_t)threads * sizeof(float));
    if (scores == NULL) return PyErr_NoMemory();
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = decode_all(&a, scores, threads, bf16);
    Py_END_ALLOW_THREADS
    free(scores);
    if (status != 0) {
        PyErr_SetString(PyExc_ValueError,
                        "paged_decode_attention: a context is empty or too long, or a block id "
                        "is out of range");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"paged_decode_attention", paged_decode_attention, METH_VARARGS,
     "paged_decode_attention(q, k_cache, v_cache, out, block_tables, context_lens, seqs, heads, "
     "kv_heads, head_dim, block_size, table_stride, num_blocks, max_context, scale[, bf16[, "
     "threads[, window[, softcap[, sinks]]]]]): decode attention (float32 queries and output) over a "
     "float32 cache, or a bfloat16 one when bf16 is 1, by data pointers (see cpu_paged.py), on "
     "``threads`` OpenMP threads (1 when built without OpenMP), over the last ``window`` "
     "keys of each sequence when window > 0, the scores soft-capped when softcap > 0, with "
     "each query head's sink logit in the softmax when sinks (a float32 [heads] pointer) is "
     "not 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cpu_attention",
    .m_doc = "Paged decode attention on the CPU (float32 or bfloat16 cache), reading it in place.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__cpu_attention(void) { return PyModule_Create(&module); }

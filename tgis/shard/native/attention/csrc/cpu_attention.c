/*
 * Paged decode attention on the CPU, reading keys and values in place through the block
 * table (no gather), for float32 and bfloat16 caches: tgis.shard.native.attention._cpu_attention.
 *
 * For each sequence s (one query token each) and each KV head h, the G = heads / kv_heads
 * query heads that share h attend to the sequence's first context_lens[s] cached tokens:
 *
 *   score[g][t] = scale * dot(q[s, h*G + g], K[t, h])      t = 0 .. context_lens[s] - 1
 *   out[s, h*G + g] = sum_t softmax(score[g])[t] * V[t, h]
 *
 * where token t lives in block block_tables[s, t / block_size] at offset t % block_size of a
 * cache laid out [num_blocks, block_size, kv_heads, head_dim]. Each key and value row is
 * read once for the G heads that use it. Queries, scores, the softmax and the output are
 * float32; a bfloat16 cache is widened row by row as it is read (a bfloat16 is the top half
 * of a float32). Plain C with no Python objects in the loop (the
 * GIL is released; with threads > 1 the sequences are split into that many ranges of about
 * equal total context, one POSIX thread each); built by setup.py as an optional extension, compiled for AVX-512, AVX2
 * and baseline x86-64, chosen at load time (target_clones); tgis/shard/native/attention/cpu_paged.py
 * falls back to the torch reference when it is missing.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TGIS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
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
    float scale;
} DecodeArgs;

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static inline void axpy(float *restrict y, float alpha, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
}

static inline float widen(uint16_t bits) {
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)bits << 16};
    return v.f;
}

static inline float dot_bf16(const float *restrict a, const uint16_t *restrict b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * widen(b[i]);
    return sum;
}

static inline void axpy_bf16(float *restrict y, float alpha, const uint16_t *restrict x,
                             int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += alpha * widen(x[i]);
}

/* Returns 0, or -1 when a sequence's context is empty, longer than max_context or its table,
 * or names a block out of range (nothing is written for that sequence). ``scores`` holds
 * heads * max_context floats. Keys and values are read in cache order, each row once for
 * every head: one pass over the keys (scores), a softmax per head, one pass over the values. */
#define DEFINE_DECODE(NAME, ELEM, DOT, AXPY)                                          \
TGIS_CLONES \
static int NAME(const DecodeArgs *a, float *scores) { \
    const int64_t heads = a->heads, group = a->heads / a->kv_heads, dim = a->head_dim; \
    const int64_t bs = a->block_size; \
    const int64_t row = a->kv_heads * dim; /* elements between consecutive tokens of a block */ \
    int status = 0; \
    for (int64_t s = 0; s < a->seqs; s++) { \
        const int64_t length = a->context[s]; \
        const int64_t *table = a->tables + s * a->table_stride; \
        const int64_t blocks = (length + bs - 1) / bs; \
        if (length <= 0 || length > a->max_context || blocks > a->table_stride) { \
            status = -1; \
            continue; \
        } \
        int bad = 0; \
        for (int64_t b = 0; b < blocks; b++) { \
            if (table[b] < 0 || table[b] >= a->num_blocks) bad = 1; \
        } \
        if (bad) { \
            status = -1; \
            continue; \
        } \
        const float *q = a->q + s * heads * dim; \
        float *out = a->out + s * heads * dim; \
        for (int64_t b = 0; b < blocks; b++) { \
            const int64_t first = b * bs; \
            const int64_t n = length - first < bs ? length - first : bs; \
            const ELEM *k = (const ELEM *)a->k_cache + table[b] * bs * row; \
            for (int64_t i = 0; i < n; i++, k += row) { \
                for (int64_t hq = 0; hq < heads; hq++) { \
                    const ELEM *kh = k + (hq / group) * dim; \
                    scores[hq * length + first + i] = a->scale * DOT(q + hq * dim, kh, dim); \
                } \
            } \
        } \
        for (int64_t hq = 0; hq < heads; hq++) { \
            float *sc = scores + hq * length; \
            float max = sc[0]; \
            for (int64_t t = 1; t < length; t++) max = sc[t] > max ? sc[t] : max; \
            float total = 0.0f; \
            for (int64_t t = 0; t < length; t++) { \
                sc[t] = expf(sc[t] - max); \
                total += sc[t]; \
            } \
            const float inv = 1.0f / total; \
            for (int64_t t = 0; t < length; t++) sc[t] *= inv; \
        } \
        memset(out, 0, (size_t)(heads * dim) * sizeof(float)); \
        for (int64_t b = 0; b < blocks; b++) { \
            const int64_t first = b * bs; \
            const int64_t n = length - first < bs ? length - first : bs; \
            const ELEM *v = (const ELEM *)a->v_cache + table[b] * bs * row; \
            for (int64_t i = 0; i < n; i++, v += row) { \
                for (int64_t hq = 0; hq < heads; hq++) { \
                    AXPY(out + hq * dim, scores[hq * length + first + i], v + (hq / group) * dim, \
                         dim); \
                } \
            } \
        } \
    } \
    return status; \
}

DEFINE_DECODE(decode_f32, float, dot, axpy)
DEFINE_DECODE(decode_bf16, uint16_t, dot_bf16, axpy_bf16)

#define MAX_THREADS 64

typedef struct {
    DecodeArgs args; /* this range's sequences */
    int bf16;
    float *scores;
    int status;
} Range;

static void *run_range(void *arg) {
    Range *r = (Range *)arg;
    r->status = r->bf16 ? decode_bf16(&r->args, r->scores) : decode_f32(&r->args, r->scores);
    return NULL;
}

/* Split a's sequences into up to ``threads`` ranges of about equal total context (the work
 * of a sequence is proportional to its context) and run them on that many threads, the
 * calling one included. Returns decode's status, or -2 when memory or a thread could not
 * be had (nothing partial: a range whose thread failed to start runs on this one). */
static int decode_parallel(const DecodeArgs *a, int bf16, int threads) {
    int64_t total = 0;
    for (int64_t s = 0; s < a->seqs; s++) total += a->context[s] > 0 ? a->context[s] : 1;
    if (threads > a->seqs) threads = (int)a->seqs;
    if (threads < 1) threads = 1;
    Range ranges[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    const size_t per_range = (size_t)(a->max_context > 0 ? a->max_context : 1) * (size_t)a->heads;
    float *scores = malloc(per_range * (size_t)threads * sizeof(float));
    if (scores == NULL) return -2;
    int64_t first = 0, seen = 0;
    int count = 0;
    for (int t = 0; t < threads && first < a->seqs; t++) {
        int64_t last = first;
        const int64_t goal = total * (t + 1) / threads;
        while (last < a->seqs && (seen < goal || last == first)) {
            seen += a->context[last] > 0 ? a->context[last] : 1;
            last++;
        }
        if (t == threads - 1) last = a->seqs;
        Range *r = &ranges[count++];
        r->args = *a;
        r->args.q = a->q + first * a->heads * a->head_dim;
        r->args.out = a->out + first * a->heads * a->head_dim;
        r->args.tables = a->tables + first * a->table_stride;
        r->args.context = a->context + first;
        r->args.seqs = last - first;
        r->bf16 = bf16;
        r->scores = scores + per_range * (size_t)t;
        r->status = 0;
        first = last;
    }
    for (int i = 1; i < count; i++) {
        started[i] = pthread_create(&ids[i], NULL, run_range, &ranges[i]) == 0;
        if (!started[i]) run_range(&ranges[i]);
    }
    run_range(&ranges[0]);
    int status = 0;
    for (int i = 0; i < count; i++) {
        if (i > 0 && started[i]) pthread_join(ids[i], NULL);
        if (ranges[i].status != 0) status = ranges[i].status;
    }
    free(scores);
    return status;
}

static PyObject *paged_decode_attention(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t q, k_cache, v_cache, out, tables, context;
    DecodeArgs a;
    long long seqs, heads, kv_heads, head_dim, block_size, table_stride, num_blocks, max_context;
    double scale;
    int bf16 = 0, threads = 1;
    if (!PyArg_ParseTuple(args, "nnnnnnLLLLLLLLd|ii", &q, &k_cache, &v_cache, &out, &tables,
                          &context, &seqs, &heads, &kv_heads, &head_dim, &block_size,
                          &table_stride, &num_blocks, &max_context, &scale, &bf16, &threads)) {
        return NULL;
    }
    if (seqs < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0 ||
        block_size <= 0 || table_stride < 0 || num_blocks <= 0 || max_context < 0 ||
        threads < 1 || threads > MAX_THREADS) {
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
    a.scale = (float)scale;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = decode_parallel(&a, bf16, threads);
    Py_END_ALLOW_THREADS
    if (status == -2) return PyErr_NoMemory();
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
     "threads]]): decode attention (float32 queries and output) over a float32 cache, or a "
     "bfloat16 one when bf16 is 1, on up to `threads` threads, by data pointers (see "
     "cpu_paged.py)."},
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

/*
 * Fused CPU kernels for the reverse discounted scans of ppokit.components._scan.
 *
 * Every scan of _scan.py is one instance of a carry-through recurrence over a row:
 *
 *     Z_t = u_t + d Z_{t+1}  at True positions,   Z_t = Z_{t+1}  at masked positions,
 *     u_t = p V_t + q x_t,   Z after the row's end = head  (per row: p, q, d, head, base),
 *     out_t = alpha x_t + beta V_t + g Z' - base at True positions, 0 at masked positions,
 *
 * with Z' = Z_t, or Z_{t+1} (the carry at the next position: for a True t, the value of the
 * next True position, since masked positions carry it through). Masked positions are thus
 * skipped as if absent; their inputs never reach a result (selects, not multiplications, so
 * NaN there does no harm). The instances:
 *
 *   reverse scan   y_t = x_t + d y_next:            p 0, q 1, Z' = Z_t, out = Z - base, or
 *                  Z - V_t - base (beta -1: returns minus values)
 *   GAE            A_t = delta_t + g lam A_next:      p 1 - lam, q lam, d g lam, head V_term,
 *                  out = r_t - V_t + g Z_{t+1}        (Z_t = (1 - lam) V_t + lam G^lam_t: the
 *                  lambda-return recursion; out + V_t = G^lam_t when beta = 0)
 *   next value     out = Z_{t+1} with p 1, q 0, d 0   (V at the next True position)
 *
 * One pass over the row, backwards, in float64. Blocks of positions are solved inside vector
 * registers: the affine maps Z -> u + c Z of a block are composed by doubling (two steps for
 * four positions with AVX2, three for eight with AVX-512), then applied to the carry from the
 * block after, so the sequential dependency is one fused multiply-add per block. The path is
 * chosen at run time from what the CPU has (level(), capped by set_level() in the tests); the
 * scalar recurrence runs the row's top positions that do not fill a block and everything on
 * other CPUs. Per row the sum, sum of squares and count of out over True positions are
 * accumulated, from which whiten() batch-whitens the result in a second pass.
 *
 * Rows are split between threads by ppokit/_native.py, which calls these functions
 * with the GIL released; tensors are passed as addresses.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#if defined(_MSC_VER) && !defined(__clang__)
#define restrict __restrict
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VECTOR 1 /* AVX2 + FMA and AVX-512 blocks, chosen at run time by what the CPU has */
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx512f,avx2,fma")))
#else
#define VECTOR 0
#endif

/* The widest path allowed (set_level): 2 AVX-512, 1 AVX2, 0 scalar. */
static int max_level = 2;

/* The path the kernels take: the widest one allowed that this CPU has. */
static int level(void) {
#if VECTOR
    int cpu = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        cpu = __builtin_cpu_supports("avx512f") ? 2 : 1;
    return cpu < max_level ? cpu : max_level;
#else
    return 0;
#endif
}

typedef struct {
    const float *x;      /* x, rewards; any valid array when q = alpha = 0 */
    const float *v;      /* values; any valid array when p = beta = 0 */
    const uint8_t *m;    /* mask, one byte per position */
    const double *row;   /* [B, 5]: p, q, d, head, base */
    double alpha, beta, g;
    int shift;           /* Z' = Z_{t+1} */
    float *out;
    double *stats;       /* [B, 3]: sum, sum of squares, count of out over True positions */
    int64_t T;
} Job;

typedef struct {
    double p, q, d, base, z, sum, sq;
    int64_t cnt;
} Row;

static void row_start(const Job *job, int64_t b, Row *s) {
    const double *c = job->row + 5 * b;
    s->p = c[0];
    s->q = c[1];
    s->d = c[2];
    s->z = c[3];
    s->base = c[4];
    s->sum = s->sq = 0.0;
    s->cnt = 0;
}

static void row_finish(const Job *job, int64_t b, const Row *s) {
    double *st = job->stats + 3 * b;
    st[0] += s->sum;
    st[1] += s->sq;
    st[2] += (double)s->cnt;
}

/* Positions hi - 1 down to lo of row b, one at a time. */
static void scalar_steps(const Job *job, int64_t b, int64_t lo, int64_t hi, Row *s) {
    const int64_t base = b * job->T;
    for (int64_t t = hi - 1; t >= lo; t--) {
        const int64_t k = base + t;
        if (!job->m[k]) {
            job->out[k] = 0.0f;
            continue;
        }
        const double x = job->x[k], v = job->v[k];
        const double next = s->z;
        s->z = s->p * v + s->q * x + s->d * next;
        const double zsel = job->shift ? next : s->z;
        const float o = (float)(job->alpha * x + job->beta * v + job->g * zsel - s->base);
        job->out[k] = o;
        s->sum += o;
        s->sq += (double)o * o;
        s->cnt += 1;
    }
}

#if VECTOR
/* [a1, a2, a3, f3] and [a2, a3, f2, f3]: the next one and two positions, f past the block */
#define NEXT1(a, f) _mm256_blend_pd(_mm256_permute4x64_pd((a), 0xF9), (f), 0x8)
#define NEXT2(a, f) _mm256_blend_pd(_mm256_permute4x64_pd((a), 0xFE), (f), 0xC)

static inline AVX2 double hsum(__m256d a) {
    const __m128d pair = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
}

/* One row's blocks of four positions, from [body - 4, body) down to [0, 4); x, v, m, out
 * point at the row's start (a Blocks function). Everything the loop reads is a local (Python builds with
 * -fno-strict-aliasing: a field of job would be reloaded after every store to out). */
static AVX2 void blocks4(const float *restrict x, const float *restrict v,
                         const uint8_t *restrict m, float *restrict out, int64_t body,
                         const Job *job, Row *s) {
    const int shift = job->shift;
    const __m256d zero = _mm256_setzero_pd(), one = _mm256_set1_pd(1.0);
    const __m256d alpha = _mm256_set1_pd(job->alpha), beta = _mm256_set1_pd(job->beta);
    const __m256d g = _mm256_set1_pd(job->g);
    const __m256d p = _mm256_set1_pd(s->p), q = _mm256_set1_pd(s->q);
    const __m256d d = _mm256_set1_pd(s->d), base = _mm256_set1_pd(s->base);
    __m256d carry = _mm256_set1_pd(s->z), sum = zero, sq = zero;
    __m256i cnt = _mm256_setzero_si256();
    for (int64_t t = body - 4; t >= 0; t -= 4) {
        const __m256d xs = _mm256_cvtps_pd(_mm_loadu_ps(x + t));
        const __m256d vs = _mm256_cvtps_pd(_mm_loadu_ps(v + t));
        int32_t bytes;
        memcpy(&bytes, m + t, sizeof bytes);
        const __m256i on_i = _mm256_cmpgt_epi64(_mm256_cvtepu8_epi64(_mm_cvtsi32_si128(bytes)),
                                                _mm256_setzero_si256());
        const __m256d on = _mm256_castsi256_pd(on_i);

        /* the maps Z -> u + c Z of the four positions, composed by doubling */
        __m256d u = _mm256_and_pd(_mm256_fmadd_pd(p, vs, _mm256_mul_pd(q, xs)), on);
        __m256d c = _mm256_blendv_pd(one, d, on);
        u = _mm256_fmadd_pd(c, NEXT1(u, zero), u);
        c = _mm256_mul_pd(c, NEXT1(c, one));
        u = _mm256_fmadd_pd(c, NEXT2(u, zero), u);
        c = _mm256_mul_pd(c, NEXT2(c, one));
        const __m256d z = _mm256_fmadd_pd(c, carry, u);
        const __m256d zsel = shift ? NEXT1(z, carry) : z;
        carry = _mm256_permute4x64_pd(z, 0x00);

        __m256d o = _mm256_fmsub_pd(alpha, xs, base);
        o = _mm256_fmadd_pd(beta, vs, o);
        o = _mm256_and_pd(_mm256_fmadd_pd(g, zsel, o), on);
        const __m128 of = _mm256_cvtpd_ps(o);
        _mm_storeu_ps(out + t, of);
        const __m256d od = _mm256_cvtps_pd(of);
        sum = _mm256_add_pd(sum, od);
        sq = _mm256_fmadd_pd(od, od, sq);
        cnt = _mm256_sub_epi64(cnt, on_i);
    }
    int64_t counts[4];
    _mm256_storeu_si256((__m256i *)counts, cnt);
    s->sum += hsum(sum);
    s->sq += hsum(sq);
    s->cnt += counts[0] + counts[1] + counts[2] + counts[3];
}

#endif

#if VECTOR
/* [a1 .. a7, f], [a2 .. a7, f, f], [a4 .. a7, f, f, f, f]: lanes j + 1, j + 2, j + 4, f past
 * the block (permutex2var: an index with bit 3 set takes from the second operand) */
#define IDX1 _mm512_set_epi64(8, 7, 6, 5, 4, 3, 2, 1)
#define IDX2 _mm512_set_epi64(8, 8, 7, 6, 5, 4, 3, 2)
#define IDX4 _mm512_set_epi64(8, 8, 8, 8, 7, 6, 5, 4)

/* The same recurrence as blocks4() in blocks of eight positions, three doubling steps. */
static AVX512 void blocks8(const float *restrict x, const float *restrict v,
                           const uint8_t *restrict m, float *restrict out, int64_t body,
                           const Job *job, Row *s) {
    const int shift = job->shift;
    const __m512d zero = _mm512_setzero_pd(), one = _mm512_set1_pd(1.0);
    const __m512d alpha = _mm512_set1_pd(job->alpha), beta = _mm512_set1_pd(job->beta);
    const __m512d g = _mm512_set1_pd(job->g);
    const __m512d p = _mm512_set1_pd(s->p), q = _mm512_set1_pd(s->q);
    const __m512d d = _mm512_set1_pd(s->d), base = _mm512_set1_pd(s->base);
    const __m512i i1 = IDX1, i2 = IDX2, i4 = IDX4;
    __m512d carry = _mm512_set1_pd(s->z), sum = zero, sq = zero;
    int64_t cnt = 0;
    for (int64_t t = body - 8; t >= 0; t -= 8) {
        const __m512d xs = _mm512_cvtps_pd(_mm256_loadu_ps(x + t));
        const __m512d vs = _mm512_cvtps_pd(_mm256_loadu_ps(v + t));
        const __m512i mb = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(m + t)));
        const __mmask8 on = _mm512_test_epi64_mask(mb, mb);

        __m512d u = _mm512_maskz_mov_pd(on, _mm512_fmadd_pd(p, vs, _mm512_mul_pd(q, xs)));
        __m512d c = _mm512_mask_blend_pd(on, one, d);
        u = _mm512_fmadd_pd(c, _mm512_permutex2var_pd(u, i1, zero), u);
        c = _mm512_mul_pd(c, _mm512_permutex2var_pd(c, i1, one));
        u = _mm512_fmadd_pd(c, _mm512_permutex2var_pd(u, i2, zero), u);
        c = _mm512_mul_pd(c, _mm512_permutex2var_pd(c, i2, one));
        u = _mm512_fmadd_pd(c, _mm512_permutex2var_pd(u, i4, zero), u);
        c = _mm512_mul_pd(c, _mm512_permutex2var_pd(c, i4, one));
        const __m512d z = _mm512_fmadd_pd(c, carry, u);
        const __m512d zsel = shift ? _mm512_permutex2var_pd(z, i1, carry) : z;
        carry = _mm512_broadcastsd_pd(_mm512_castpd512_pd128(z));

        __m512d o = _mm512_fmsub_pd(alpha, xs, base);
        o = _mm512_fmadd_pd(beta, vs, o);
        o = _mm512_maskz_mov_pd(on, _mm512_fmadd_pd(g, zsel, o));
        const __m256 of = _mm512_cvtpd_ps(o);
        _mm256_storeu_ps(out + t, of);
        const __m512d od = _mm512_cvtps_pd(of);
        sum = _mm512_add_pd(sum, od);
        sq = _mm512_fmadd_pd(od, od, sq);
        cnt += __builtin_popcount((unsigned)on);
    }
    s->sum += _mm512_reduce_add_pd(sum);
    s->sq += _mm512_reduce_add_pd(sq);
    s->cnt += cnt;
}

#endif

/* A row's positions [0, body) in vector blocks, x, v, m, out at the row's start. */
typedef void (*Blocks)(const float *, const float *, const uint8_t *, float *, int64_t,
                       const Job *, Row *);

/* Rows [r0, r1): the top T mod width positions of each row one at a time, then its blocks. */
static void run(const Job *job, int64_t r0, int64_t r1) {
    Blocks blocks = NULL;
    int64_t width = 0;
#if VECTOR
    const int path = level();
    if (path == 2) {
        blocks = blocks8;
        width = 8;
    } else if (path == 1) {
        blocks = blocks4;
        width = 4;
    }
#endif
    const int64_t T = job->T;
    const int64_t body = blocks ? T - T % width : 0;
    for (int64_t b = r0; b < r1; b++) {
        Row s;
        const int64_t k = b * T;
        row_start(job, b, &s);
        scalar_steps(job, b, body, T, &s);
        if (blocks)
            blocks(job->x + k, job->v + k, job->m + k, job->out + k, body, job, &s);
        row_finish(job, b, &s);
    }
}

static void *ptr(unsigned long long address) { return (void *)(uintptr_t)address; }

/* scan(x, v, m, row, alpha, beta, g, shift, out, stats, T, r0, r1); addresses as ints */
static PyObject *kernel_scan(PyObject *self, PyObject *args) {
    unsigned long long x, v, m, row, out, stats;
    double alpha, beta, g;
    int shift;
    long long T, r0, r1;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKdddpKKLLL", &x, &v, &m, &row, &alpha, &beta, &g, &shift,
                          &out, &stats, &T, &r0, &r1))
        return NULL;
    if (!x || !v || !m || !row || !out || !stats || T < 0 || r0 < 0 || r1 < r0) {
        PyErr_SetString(PyExc_ValueError, "scan kernel: bad arguments");
        return NULL;
    }
    Job job = {ptr(x), ptr(v), ptr(m), ptr(row), alpha, beta, g, shift, ptr(out), ptr(stats),
               (int64_t)T};
    Py_BEGIN_ALLOW_THREADS
    run(&job, (int64_t)r0, (int64_t)r1);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}


static inline float keep_if(int on, float a) {
    union { float f; uint32_t u; } bits;
    bits.f = a;
    bits.u &= (uint32_t)0 - (uint32_t)on;
    return bits.f;
}

/* y = (y - shift) * scale where m, else 0 (a select: NaN at a masked position gives 0). One
 * loop, compiled for the baseline and, on x86, for AVX2 and AVX-512 (wider vectors). */
#define AFFINE_LOOP                                                                           \
    for (int64_t k = 0; k < n; k++)                                                           \
        y[k] = keep_if(m[k] != 0, (y[k] - shift) * scale);

static void affine(float *restrict y, const uint8_t *restrict m, int64_t n, float shift,
                   float scale) {
    AFFINE_LOOP
}

#if VECTOR
static AVX2 void affine_avx2(float *restrict y, const uint8_t *restrict m, int64_t n, float shift,
                             float scale) {
    AFFINE_LOOP
}

static AVX512 void affine_avx512(float *restrict y, const uint8_t *restrict m, int64_t n,
                                 float shift, float scale) {
    AFFINE_LOOP
}
#endif

/* whiten(y, m, stats, rows, eps, start, stop): batch whitening of y over its True positions,
 * from the per-row statistics of the scan: y = (y - mean) / sqrt(var + eps) where m, else 0,
 * over the flat range [start, stop). var has Bessel's correction (0 below two positions). */
static PyObject *kernel_whiten(PyObject *self, PyObject *args) {
    unsigned long long y, m, stats;
    long long rows, start, stop;
    double eps;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKLdLL", &y, &m, &stats, &rows, &eps, &start, &stop))
        return NULL;
    if (!y || !m || !stats || rows < 0 || start < 0 || stop < start) {
        PyErr_SetString(PyExc_ValueError, "whiten kernel: bad arguments");
        return NULL;
    }
    float *restrict yy = ptr(y);
    const uint8_t *restrict mm = ptr(m);
    const double *st = ptr(stats);
    Py_BEGIN_ALLOW_THREADS
    double total = 0.0, squares = 0.0, n = 0.0;
    for (int64_t b = 0; b < rows; b++) {
        total += st[3 * b];
        squares += st[3 * b + 1];
        n += st[3 * b + 2];
    }
    const double mean = total / (n > 1.0 ? n : 1.0);
    double var = (squares - total * mean) / (n - 1.0 > 1.0 ? n - 1.0 : 1.0);
    var = var > 0.0 ? var : 0.0;
    const float shift = (float)mean, scale = (float)(1.0 / sqrt(var + eps));
    const int64_t n_pos = stop - start;
    switch (level()) {
#if VECTOR
    case 2: affine_avx512(yy + start, mm + start, n_pos, shift, scale); break;
    case 1: affine_avx2(yy + start, mm + start, n_pos, shift, scale); break;
#endif
    default: affine(yy + start, mm + start, n_pos, shift, scale);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Sum over True positions and their count of one row of length T. */
static void row_sum_scalar(const float *x, const uint8_t *m, int64_t T, double *sum, int64_t *n) {
    double acc = 0.0;
    int64_t count = 0;
    for (int64_t t = 0; t < T; t++)
        if (m[t]) {
            acc += x[t];
            count++;
        }
    *sum = acc;
    *n = count;
}

#if VECTOR
static AVX2 void row_sum_vector(const float *x, const uint8_t *m, int64_t T, double *sum,
                                int64_t *n) {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    __m256i count = _mm256_setzero_si256();
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) {
        int64_t bytes;
        memcpy(&bytes, m + t, sizeof bytes);
        const __m256i on = _mm256_cmpgt_epi32(
            _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes)), _mm256_setzero_si256());
        const __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + t), _mm256_castsi256_ps(on));
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
        count = _mm256_sub_epi32(count, on);
    }
    int32_t c[8];
    _mm256_storeu_si256((__m256i *)c, count);
    double rest;
    int64_t rest_n;
    row_sum_scalar(x + t, m + t, T - t, &rest, &rest_n);
    *sum = hsum(_mm256_add_pd(lo, hi)) + rest;
    *n = (int64_t)c[0] + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7] + rest_n;
}
#endif

/* rowsum(x, m, sums, counts, T, r0, r1): per row of [r0, r1), the float64 sum of x over its
 * True positions and their count, in a fixed order (the same for any split of the rows). */
static PyObject *kernel_rowsum(PyObject *self, PyObject *args) {
    unsigned long long x, m, sums, counts;
    long long T, r0, r1;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKLLL", &x, &m, &sums, &counts, &T, &r0, &r1))
        return NULL;
    if (!x || !m || !sums || !counts || T < 0 || r0 < 0 || r1 < r0) {
        PyErr_SetString(PyExc_ValueError, "rowsum kernel: bad arguments");
        return NULL;
    }
    const float *xx = ptr(x);
    const uint8_t *mm = ptr(m);
    double *ss = ptr(sums);
    int64_t *cc = ptr(counts);
    Py_BEGIN_ALLOW_THREADS
    const int vector = level() >= 1;
    for (int64_t b = r0; b < r1; b++) {
#if VECTOR
        if (vector) {
            row_sum_vector(xx + b * T, mm + b * T, T, ss + b, cc + b);
            continue;
        }
#endif
        row_sum_scalar(xx + b * T, mm + b * T, T, ss + b, cc + b);
    }
    (void)vector;
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* fill(c, m, out, T, r0, r1): out = c_b at the True positions of row b, 0 elsewhere. */
static PyObject *kernel_fill(PyObject *self, PyObject *args) {
    unsigned long long c, m, out;
    long long T, r0, r1;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKLLL", &c, &m, &out, &T, &r0, &r1))
        return NULL;
    if (!c || !m || !out || T < 0 || r0 < 0 || r1 < r0) {
        PyErr_SetString(PyExc_ValueError, "fill kernel: bad arguments");
        return NULL;
    }
    const float *cc = ptr(c);
    const uint8_t *restrict mm = ptr(m);
    float *restrict oo = ptr(out);
    Py_BEGIN_ALLOW_THREADS
    for (int64_t b = r0; b < r1; b++) {
        const float value = cc[b];
        for (int64_t t = 0; t < T; t++)
            oo[b * T + t] = keep_if(mm[b * T + t] != 0, value);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* level(): the path the kernels take, 2 AVX-512, 1 AVX2, 0 scalar. */
static PyObject *kernel_level(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLong(level());
}

/* set_level(n): the widest path allowed from now on; returns the previous setting. */
static PyObject *kernel_set_level(PyObject *self, PyObject *args) {
    int n;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &n))
        return NULL;
    const int before = max_level;
    max_level = n < 0 ? 0 : n > 2 ? 2 : n;
    return PyLong_FromLong(before);
}

static PyMethodDef methods[] = {
    {"scan", kernel_scan, METH_VARARGS, "Fused carry-through scan over a block of rows."},
    {"whiten", kernel_whiten, METH_VARARGS, "Batch whitening from the scan's statistics."},
    {"rowsum", kernel_rowsum, METH_VARARGS, "Per-row sums and counts over True positions."},
    {"fill", kernel_fill, METH_VARARGS, "A per-row value at the True positions of each row."},
    {"level", kernel_level, METH_NOARGS, "The path taken: 2 AVX-512, 1 AVX2, 0 scalar."},
    {"set_level", kernel_set_level, METH_VARARGS, "The widest path allowed; returns the old."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "Fused CPU kernels of the reverse discounted scans.", -1,
    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }

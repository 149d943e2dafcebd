/* lucepy's CPU kernels for Q4_1 and Q5_1 weights times Q8_1 activations (docs/architecture.md,
   decision 12).

ggml-cpu computes mul_mat(Q4_1 or Q5_1 weights, activations) one (row, column) pair at a time:
each pair unpacks the row's values again and runs one chain of fused multiply-adds. Here a tile
of 2 rows and 4 columns shares each row's unpacked values and each column's loaded block, and
keeps 8 chains in flight. Every pair goes through exactly the arithmetic of ggml's AVX2 dot
product (ggml_vec_dot_q4_1_q8_1 and _q5_1_q8_1 in ggml/src/ggml-cpu/arch/x86/quants.c at the
pinned commit: integer sums of a 32-value block, times d0*d1 into 8 float lanes; the min times the
activation sum fused into one running sum; the lanes summed as ggml sums them), so each result
is bit for bit ggml's, whatever the column count. lucepy checks that on the loaded ggml before
it uses a kernel (lucepy/ggml/cpu.py).

ggml calls a kernel (mm_q4_1_*, mm_q5_1_*) as a GGML_OP_CUSTOM node (dst->src[0]: the weights,
[K, N]; dst->src[1]: the activations already quantized to Q8_1 by ggml's own CPY, [K, M]; dst:
f32 [N, M]) on each of its threads with (ith, nth). The file is a Python extension only so that
pip builds it; Python reads the kernel's address and the tensor layout it was compiled for. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The pinned ggml.h's struct ggml_tensor (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC
   10, GGML_MAX_NAME 64); lucepy/ggml/cpu.py compares these offsets with its own declaration. */
struct tensor {
    int type;
    void *buffer;
    int64_t ne[4];
    size_t nb[4];
    int op;
    int32_t op_params[16];
    int32_t flags;
    struct tensor *src[10];
    struct tensor *view_src;
    size_t view_offs;
    void *data;
    char name[64];
    void *extra;
    char padding[8];
};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

typedef struct {
    uint16_t d, m; /* halves: the scale and the min */
    uint8_t qs[16]; /* value j in the low nibble of byte j, value j + 16 in its high nibble */
} block_q4_1;

typedef struct {
    uint16_t d, m;  /* as Q4_1's */
    uint8_t qh[4];  /* bit j: value j's fifth bit (16) */
    uint8_t qs[16]; /* as Q4_1's */
} block_q5_1;

typedef struct {
    uint16_t d, s; /* halves: the scale and d times the sum of the 32 values */
    int8_t qs[32];
} block_q8_1;

#define BASE "avx2,fma,f16c"

#define ALWAYS static inline __attribute__((always_inline))

/* A block's 32 unsigned values as bytes, value j in byte j: Q4_1's nibbles (0-15), Q5_1's with
   their fifth bits (0-31). */
#define NIBBLES(b)                                                                              \
    ({                                                                                          \
        const __m128i p_ = _mm_loadu_si128((const __m128i *)(b)->qs);                           \
        _mm256_and_si256(_mm256_set1_epi8(0xF), _mm256_set_m128i(_mm_srli_epi16(p_, 4), p_));  \
    })
#define UNPACK_Q4_1(b) NIBBLES(b)
#define UNPACK_Q5_1(b)                                                                          \
    ({                                                                                          \
        uint32_t h_;                                                                            \
        memcpy(&h_, (b)->qh, 4);                                                                \
        /* byte j of the vector: byte j / 8 of qh; its bit j % 8 set: value j's fifth bit */    \
        const __m256i spread_ = _mm256_shuffle_epi8(                                            \
            _mm256_set1_epi32((int)h_),                                                         \
            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0)); \
        const __m256i bit_ = _mm256_set1_epi64x((long long)0x8040201008040201ULL);              \
        const __m256i set_ = _mm256_cmpeq_epi8(_mm256_and_si256(spread_, bit_), bit_);         \
        _mm256_or_si256(NIBBLES(b), _mm256_and_si256(set_, _mm256_set1_epi8(0x10)));           \
    })

enum { ROW_BLOCK = 16 }; /* rows a thread sweeps over every group of columns before moving on */

/* One tile: rows x0 and x1 (blocks of BLOCK, their values by UNPACK) times the 4 columns
   y[0..4). ds holds each block's 4 column scales then its 4 column sums as floats
   (ds[8 i + c], ds[8 i + 4 + c]). For each pair, in ggml's
   order: summs = fma(m0, s1, summs) (here the tile's 8 pairs in the 8 lanes of one vector, each
   lane the same fma as ggml's scalar one); acc = fma(d0 * d1, float(the block's integer sum),
   acc); result = hsum(acc) + summs. DOT is the block's integer sum: AVX-VNNI's dpbusd, or
   maddubs then madd (the same sums: 2 x 31 x 128 fits an int16). Where the tile has fewer
   rows or columns, x1 = x0 or the missing columns repeat y[0], and their results are not
   written. */
#define DEFINE_TILE(NAME, TARGET, DOT, BLOCK, UNPACK)                                             \
    __attribute__((target(TARGET))) ALWAYS void NAME(                                           \
        int nb, const BLOCK *x0, const BLOCK *x1, const block_q8_1 *const y[4],               \
        const float *ds, float *dst, int64_t ldd, int rows, int cols) {                         \
        __m256 acc[8];                                                                          \
        for (int j = 0; j < 8; j++) {                                                           \
            acc[j] = _mm256_setzero_ps();                                                       \
        }                                                                                       \
        __m256 summs = _mm256_setzero_ps();                                                     \
        for (int i = 0; i < nb; i++) {                                                          \
            const float *dsi = ds + 8 * i;                                                      \
            const __m256i qx0 = UNPACK(&x0[i]);                                                 \
            const __m256i qx1 = UNPACK(&x1[i]);                                                 \
            const __m256 m = _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(x1[i].m)),                   \
                                             _mm_set1_ps(_cvtsh_ss(x0[i].m)));                  \
            summs = _mm256_fmadd_ps(m, _mm256_broadcast_ps((const __m128 *)(dsi + 4)), summs); \
            const __m256 d0 = _mm256_set1_ps(_cvtsh_ss(x0[i].d));                               \
            const __m256 d1 = _mm256_set1_ps(_cvtsh_ss(x1[i].d));                               \
            for (int c = 0; c < 4; c++) {                                                       \
                const __m256i qy = _mm256_loadu_si256((const __m256i *)y[c][i].qs);             \
                const __m256 dy = _mm256_broadcast_ss(dsi + c);                                 \
                acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(d0, dy),                                 \
                                         _mm256_cvtepi32_ps(DOT(qx0, qy)), acc[c]);             \
                acc[4 + c] = _mm256_fmadd_ps(_mm256_mul_ps(d1, dy),                             \
                                             _mm256_cvtepi32_ps(DOT(qx1, qy)), acc[4 + c]);     \
            }                                                                                   \
        }                                                                                       \
        float sm[8];                                                                            \
        _mm256_storeu_ps(sm, summs);                                                            \
        for (int r = 0; r < rows; r++) {                                                        \
            for (int c = 0; c < cols; c++) {                                                    \
                const __m256 a = acc[4 * r + c];                                                \
                __m128 h = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));  \
                h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                         \
                h = _mm_add_ss(h, _mm_movehdup_ps(h));                                          \
                dst[c * ldd + r] = _mm_cvtss_f32(h) + sm[4 * r + c];                            \
            }                                                                                   \
        }                                                                                       \
    }

#define DOT_VNNI(a, b) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (a), (b))
#define DOT_AVX2(a, b) _mm256_madd_epi16(_mm256_maddubs_epi16((a), (b)), _mm256_set1_epi16(1))

DEFINE_TILE(tile_q4_1_vnni, BASE ",avxvnni", DOT_VNNI, block_q4_1, UNPACK_Q4_1)
DEFINE_TILE(tile_q4_1_avx2, BASE, DOT_AVX2, block_q4_1, UNPACK_Q4_1)
DEFINE_TILE(tile_q5_1_vnni, BASE ",avxvnni", DOT_VNNI, block_q5_1, UNPACK_Q5_1)
DEFINE_TILE(tile_q5_1_avx2, BASE, DOT_AVX2, block_q5_1, UNPACK_Q5_1)

/* Column c of the group of 4 columns g, or the group's first where the columns run out (a
   tile computes it again and does not write it). */
static inline int64_t group_col(int64_t g, int c, int64_t m) {
    return 4 * g + c < m ? 4 * g + c : 4 * g;
}

/* This thread's share of the rows: whole pairs, the odd last row to the last thread. First
   the columns' scales and sums as floats (each thread its own copy, a small fraction of the
   work), then within each block of 16 rows every group of 4 columns, 2 rows at a time. */
#define DEFINE_MM(NAME, TARGET, TILE, BLOCK)                                                     \
    __attribute__((target(TARGET))) static void NAME(struct tensor *dst, int ith, int nth,     \
                                                     void *userdata) {                          \
        (void)userdata;                                                                         \
        const struct tensor *w = dst->src[0], *a = dst->src[1];                                 \
        const int nb = (int)(w->ne[0] / 32);                                                    \
        const int64_t n = w->ne[1], m = a->ne[1], groups = (m + 3) / 4;                         \
        const int64_t ldx = (int64_t)(w->nb[1] / sizeof(BLOCK));                                \
        const int64_t ldy = (int64_t)(a->nb[1] / sizeof(block_q8_1));                           \
        const int64_t ldd = (int64_t)(dst->nb[1] / sizeof(float));                              \
        const int64_t pairs = n / 2;                                                            \
        const int64_t r0 = 2 * (pairs * ith / nth);                                             \
        const int64_t r1 = ith == nth - 1 ? n : 2 * (pairs * (ith + 1) / nth);                  \
        const BLOCK *xs = (const BLOCK *)w->data;                                               \
        const block_q8_1 *ys = (const block_q8_1 *)a->data;                                     \
        float *out = (float *)dst->data;                                                        \
        if (r0 >= r1) {                                                                         \
            return;                                                                             \
        }                                                                                       \
        float *ds = malloc(sizeof(float) * 8 * nb * groups);                                    \
        if (ds == NULL) {                                                                       \
            abort(); /* as ggml does when it runs out of memory */                             \
        }                                                                                       \
        for (int64_t g = 0; g < groups; g++) {                                                  \
            for (int c = 0; c < 4; c++) {                                                       \
                const block_q8_1 *y = ys + group_col(g, c, m) * ldy;                            \
                for (int i = 0; i < nb; i++) {                                                  \
                    ds[(g * nb + i) * 8 + c] = _cvtsh_ss(y[i].d);                               \
                    ds[(g * nb + i) * 8 + 4 + c] = _cvtsh_ss(y[i].s);                           \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int64_t b0 = r0; b0 < r1; b0 += ROW_BLOCK) {                                       \
            const int64_t b1 = b0 + ROW_BLOCK < r1 ? b0 + ROW_BLOCK : r1;                       \
            for (int64_t g = 0; g < groups; g++) {                                              \
                const int cols = m - 4 * g < 4 ? (int)(m - 4 * g) : 4;                          \
                const block_q8_1 *y[4];                                                         \
                for (int c = 0; c < 4; c++) {                                                   \
                    y[c] = ys + group_col(g, c, m) * ldy;                                       \
                }                                                                               \
                for (int64_t r = b0; r < b1; r += 2) {                                          \
                    const int rows = b1 - r < 2 ? 1 : 2;                                        \
                    const BLOCK *x0 = xs + r * ldx;                                             \
                    TILE(nb, x0, rows == 2 ? x0 + ldx : x0, y, ds + g * nb * 8,                 \
                         out + 4 * g * ldd + r, ldd, rows, cols);                               \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        free(ds);                                                                               \
    }

DEFINE_MM(mm_q4_1_vnni, BASE ",avxvnni", tile_q4_1_vnni, block_q4_1)
DEFINE_MM(mm_q4_1_avx2, BASE, tile_q4_1_avx2, block_q4_1)
DEFINE_MM(mm_q5_1_vnni, BASE ",avxvnni", tile_q5_1_vnni, block_q5_1)
DEFINE_MM(mm_q5_1_avx2, BASE, tile_q5_1_avx2, block_q5_1)
#endif

/* The kernels this CPU runs for `kind` (0: Q4_1, 1: Q5_1), the preferred first: AVX-VNNI's
   where it has it, then plain AVX2's (the same sums); none without AVX2, FMA and F16C. */
static int runnable(int kind, void *found[2], const char *names[2]) {
    int n = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
        return 0;
    }
    unsigned eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
    if (!(ecx & (1u << 29))) { /* F16C */
        return 0;
    }
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(1));
    if (eax & (1u << 4)) { /* AVX-VNNI */
        found[n] = kind == 0 ? (void *)mm_q4_1_vnni : (void *)mm_q5_1_vnni;
        names[n++] = "avx2+avxvnni";
    }
    found[n] = kind == 0 ? (void *)mm_q4_1_avx2 : (void *)mm_q5_1_avx2;
    names[n++] = "avx2";
#else
    (void)kind;
    (void)found;
    (void)names;
#endif
    return n;
}

static PyObject *kernels(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    static const char *kinds[] = {"q4_1", "q5_1"};
    PyObject *out = PyDict_New();
    for (int kind = 0; out != NULL && kind < 2; kind++) {
        void *found[2];
        const char *names[2];
        const int n = runnable(kind, found, names);
        PyObject *variants = PyList_New(n);
        for (int i = 0; variants != NULL && i < n; i++) {
            PyObject *entry = Py_BuildValue("(Ns)", PyLong_FromVoidPtr(found[i]), names[i]);
            if (entry == NULL) {
                Py_CLEAR(variants);
                break;
            }
            PyList_SET_ITEM(variants, i, entry);
        }
        if (variants == NULL || PyDict_SetItemString(out, kinds[kind], variants) < 0) {
            Py_CLEAR(out);
        }
        Py_XDECREF(variants);
    }
    return out;
}

static PyObject *layout(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:n,s:n}", "type", (Py_ssize_t)offsetof(struct tensor, type), "ne",
        (Py_ssize_t)offsetof(struct tensor, ne), "nb", (Py_ssize_t)offsetof(struct tensor, nb),
        "src", (Py_ssize_t)offsetof(struct tensor, src), "data",
        (Py_ssize_t)offsetof(struct tensor, data), "size", (Py_ssize_t)sizeof(struct tensor));
}

static PyMethodDef methods[] = {
    {"kernels", kernels, METH_NOARGS,
     "{kind: [(address, variant), ...]}: the kernels this CPU runs, the preferred first."},
    {"layout", layout, METH_NOARGS, "Offsets of the ggml_tensor fields the kernels read."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu(void) { return PyModule_Create(&module); }

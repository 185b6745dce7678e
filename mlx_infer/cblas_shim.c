/* The three CBLAS entry points libmlx.so imports (cblas_sgemm, cblas_dgemm, cblas_cgemm, with 32-bit
 * integers), forwarded to numpy's bundled OpenBLAS, which exports them only under other names and with
 * 64-bit integers (an ILP64 build: scipy_cblas_sgemm64_, or cblas_sgemm64_ before numpy 2).
 *
 * mlx_infer/blas.py compiles this once, sets the pointers to that library's functions, then loads it
 * into the global symbol scope before mlx.core is imported, so libmlx binds to these definitions.
 *
 * MLX computes a float32 matrix-vector product (every decode step of a float model) as an sgemm with
 * one row or column; OpenBLAS's sgemm packs the whole weight matrix for it, which made float32 decode
 * 3-4x slower than reading the weights once, so those products go to sgemv instead. */
#include <stdint.h>

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm64)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                        const float *, int64_t, float, float *, int64_t);
typedef void (*dgemm64)(int, int, int, int64_t, int64_t, int64_t, double, const double *, int64_t,
                        const double *, int64_t, double, double *, int64_t);
typedef void (*cgemm64)(int, int, int, int64_t, int64_t, int64_t, const void *, const void *, int64_t,
                        const void *, int64_t, const void *, void *, int64_t);

typedef void (*sgemv64)(int, int, int64_t, int64_t, float, const float *, int64_t, const float *, int64_t,
                        float, float *, int64_t);

/* Set by blas.py before the first call. The enums (order, transposes) stay C ints in both ABIs. */
sgemm64 mlx_infer_sgemm;
sgemv64 mlx_infer_sgemv;
dgemm64 mlx_infer_dgemm;
cgemm64 mlx_infer_cgemm;

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  if (order == COL_MAJOR) { /* C^T = op(B)^T op(A)^T: the same product, row-major, operands swapped */
    cblas_sgemm(ROW_MAJOR, tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
    return;
  }
  if (m == 1 && k > 0) { /* c (1 x n, contiguous) = op(B)^T x, x = op(A)'s one row */
    int64_t incx = ta == NO_TRANS ? 1 : lda;
    if (tb == NO_TRANS) /* B is k x n */
      mlx_infer_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
    else /* B is n x k */
      mlx_infer_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    return;
  }
  if (n == 1 && k > 0) { /* c (m x 1, stride ldc) = op(A) x, x = op(B)'s one column */
    int64_t incx = tb == NO_TRANS ? ldb : 1;
    if (ta == NO_TRANS) /* A is m x k */
      mlx_infer_sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, incx, beta, c, ldc);
    else /* A is k x m */
      mlx_infer_sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, incx, beta, c, ldc);
    return;
  }
  mlx_infer_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double *a, int lda,
                 const double *b, int ldb, double beta, double *c, int ldc) {
  mlx_infer_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void *alpha, const void *a, int lda,
                 const void *b, int ldb, const void *beta, void *c, int ldc) {
  mlx_infer_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* The three CBLAS entry points libmlx.so imports (cblas_sgemm, cblas_dgemm, cblas_cgemm, with 32-bit
 * integers), forwarded to numpy's bundled OpenBLAS, which exports them only under other names and with
 * 64-bit integers (an ILP64 build: scipy_cblas_sgemm64_, or cblas_sgemm64_ before numpy 2).
 *
 * mlx_infer/blas.py compiles this once, sets the three pointers to that library's functions, then loads
 * it into the global symbol scope before mlx.core is imported, so libmlx binds to these definitions. */
#include <stdint.h>

typedef void (*sgemm64)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                        const float *, int64_t, float, float *, int64_t);
typedef void (*dgemm64)(int, int, int, int64_t, int64_t, int64_t, double, const double *, int64_t,
                        const double *, int64_t, double, double *, int64_t);
typedef void (*cgemm64)(int, int, int, int64_t, int64_t, int64_t, const void *, const void *, int64_t,
                        const void *, int64_t, const void *, void *, int64_t);

/* Set by blas.py before the first call. The enums (order, transposes) stay C ints in both ABIs. */
sgemm64 mlx_infer_sgemm;
dgemm64 mlx_infer_dgemm;
cgemm64 mlx_infer_cgemm;

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
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

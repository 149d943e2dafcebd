// lucepy's own kernels (issue 19, decision 12), hooked into the pinned ggml-cuda by hooks.patch:
// a quantized weight matrix (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, and Q4_1 and Q5_1: SmolLM2's
// and its draft's) times 1 or 3 to 16 columns of f32
// activations, and some of the small ops around those products.
#pragma once

#include "common.cuh"

// Computes dst = src0 x src1 (and, with ggml's mat-vec fusion, its bias, gate and GLU) and returns
// true, or returns false, having done nothing, for a case it does not take: ggml's own kernels
// then run.
bool lucepy_cuda_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0,
                         const ggml_tensor * src1, ggml_tensor * dst,
                         const ggml_cuda_mm_fusion_args_host * fusion);

// Computes graph nodes i and i + 1, an RMS norm times a weight vector that ggml-cuda would fuse,
// where a product of ours reads the result (1 or 3-16 columns): the result and the product's
// activations (int8 planes or halves) in one kernel, and returns true; or returns false, having
// done nothing.
bool lucepy_cuda_rms_norm_mul(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);

// Computes graph nodes i and i + 1, SiLU or sigmoid of a tensor times another of its shape (as
// ggml-cuda fuses them), where a product of ours reads the result as one column (a decode): the
// result and its quantized activations in one kernel, and returns true; or returns false, having
// done nothing.
bool lucepy_cuda_unary_mul(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);

// Computes dst, a SWIGLU of two tensors of its shape (ggml's GLU op, split), where a product of
// ours reads it as 2-16 columns (a verify's FFN): the result and the product's halves in one
// kernel, and returns true; or returns false, having done nothing.
bool lucepy_cuda_glu(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// Computes graph node i and nodes after it that one kernel of ours computes at once, and returns
// how many nodes after i it computed; or returns 0, having done nothing. Views between them are
// allowed. The groups:
//   - qwen35's conv step of 1-16 new columns: a CONCAT of a recurrent state's K - 1 saved
//     columns and the new ones, the copy of the new tail into the state, the conv (SSM_CONV, K =
//     4) and its SiLU, and the l2 norm of its first heads of 128 channels (q's and k's: RMS_NORM
//     of a view, SCALE) where the graph has it next;
//   - a gated norm of rows of 64, 128 or 256 values read by a product of ours (one column, a
//     decode, or 2-16 of whole rows, a verify): RMS_NORM, MUL by its weight, SiLU or sigmoid of a
//     gate, MUL; its activations prepared for the product;
//   - qwen35's DeltaNet gates: ADD of a row repeated (the dt bias), SOFTPLUS, MUL by a row
//     repeated (A), and a SIGMOID (beta's) where it comes next;
//   - qwen35's DeltaNet recurrence: GATED_DELTA_NET (a scalar gate, state rows of 128, no
//     per-token snapshots, any number of tokens) and the CPY of its new state that follows;
//   - a product of ours of 2-16 columns (MUL_MAT) and the ADD of a residual to it, when nothing
//     else reads the product.
int lucepy_cuda_fuse(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);

// Computes dst = ARGMAX of rows of at least 16,384 values (a greedy step's logits) in two kernels
// of many CTAs, and returns true; or returns false, having done nothing (ggml's kernel, one CTA a
// row, then runs).
bool lucepy_cuda_argmax(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// ``cgraph`` begins on this context: activations quantized for the last one are stale.
void lucepy_cuda_graph_begin(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph);

// The context is being destroyed: free what the kernels kept for it.
void lucepy_cuda_context_free(ggml_backend_cuda_context & ctx);

// Bytes [ptr, ptr + size) of a CUDA buffer are freed or written anew: no repacked matrix
// (lucepy_cuda_repack) lies there any more.
void lucepy_cuda_bytes_gone(const void * ptr, size_t size);

// For lucepy's Python side (exported from libggml-cuda): set forces the kernels on (1) or off
// (0) on every device, or back to the default (-1: on for compute capability 9.0 and newer); the
// start value comes from LUCEPY_CUDA_KERNELS (0 or 1 forces, unset is the default). get tells
// whether they run on one device (1) or ggml's do (0). Then the count of matrix products they
// computed in this process, of activations they quantized for them, and of those that the kernel
// before the product prepared as it wrote its result (lucepy_cuda_rms_norm_mul, _unary_mul and
// _fuse's gated norms), of other ops they computed (lucepy_cuda_fuse's conv steps, DeltaNet
// gates and recurrences, lucepy_cuda_argmax's argmaxes), and of the copies (a verify's DUP and
// CONT nodes, a rollback's CPY) that those ops made part of themselves.
// Launches that a captured CUDA graph replays are not counted: no host code runs for them.
extern "C" {
GGML_BACKEND_API void lucepy_cuda_kernels_set(int mode);
GGML_BACKEND_API int lucepy_cuda_kernels_get(int device);
GGML_BACKEND_API int64_t lucepy_cuda_kernels_calls(void);
GGML_BACKEND_API int64_t lucepy_cuda_kernels_quantized(void);
GGML_BACKEND_API int64_t lucepy_cuda_kernels_fused(void);
GGML_BACKEND_API int64_t lucepy_cuda_kernels_ops(void);
GGML_BACKEND_API int64_t lucepy_cuda_kernels_copies(void);
GGML_BACKEND_API int64_t lucepy_cuda_kernels_joined(void);
GGML_BACKEND_API int64_t lucepy_cuda_kernels_bulk(void);
GGML_BACKEND_API int64_t lucepy_cuda_kernels_f8(void);
GGML_BACKEND_API int64_t lucepy_cuda_kernels_paired(void);
GGML_BACKEND_API int64_t lucepy_cuda_kernels_tailed(void);
// Rewrites a Q4_0, Q4_K, Q5_K or Q6_K weight (2D, contiguous, rows a multiple of 16, row length
// of 256, in a CUDA device's memory, lucepy's kernels on there; Q5_K and Q6_K from compute
// capability 9.0) in place into its layout in lucepy-layouts.cuh and
// returns 1; from then on lucepy's kernels take every product of it (a product's read that is
// not whole tiles of 16 rows aborts), and nothing else may read it. Returns 0, having done
// nothing, for any other tensor.
GGML_BACKEND_API int lucepy_cuda_repack(struct ggml_tensor * t);
}

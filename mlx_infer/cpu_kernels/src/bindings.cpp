// The Python module of the native CPU kernels: mlx_infer.cpu_kernels loads it (see build.py).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "sampling_ops.h"
#include "decoder_block.h"
#include "gated_delta.h"
#include "huge_pages.h"
#include "kv_write.h"
#include "norm_rope.h"
#include "paged_attention.h"
#include "quantized_matvec.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "mlx-infer's native kernels for MLX's CPU backend";
  m.def("argmax_rows", &mlx_infer::argmax_rows, "x"_a);
  m.def("logprobs", &mlx_infer::logprobs, "logits"_a, "tokens"_a, "k"_a);
  m.def("draw_rows", &mlx_infer::draw_rows, "logits"_a, "temperatures"_a, "uniforms"_a);
  m.def("truncate_top", &mlx_infer::truncate_top, "logits"_a, "top_k"_a, "top_p"_a, "min_p"_a);
  m.def("adjust_logits", &mlx_infer::adjust_logits, "logits"_a, "starts"_a, "ids"_a, "entries"_a, "params"_a,
        "pending"_a);
  m.def("affine_qmv", &mlx_infer::affine_qmv, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a);
  m.def("embed_rows", &mlx_infer::embed_rows, "ids"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a);
  m.def("pack_on_huge_pages", &mlx_infer::pack_on_huge_pages, "arrays"_a);
  m.def("huge_page_bytes", &mlx_infer::huge_page_bytes, "a"_a);
  m.def("set_activations", &mlx_infer::set_activations, "kind"_a);
  m.def("activations", &mlx_infer::activations);
  m.def("kv_write", &mlx_infer::kv_write, "pool"_a, "rows"_a, "slots"_a, "column"_a = 0, "in_place"_a = false);
  nb::class_<mlx_infer::NativeLayer>(m, "NativeLayer")
      .def(nb::init<const mlx::core::array&, float, const std::vector<mlx::core::array>&, int, int,
                    const std::optional<mlx::core::array>&, int, int, int, int,
                    const std::optional<mlx::core::array>&, const std::optional<mlx::core::array>&, float, float,
                    int, const std::vector<mlx::core::array>&, const mlx::core::array&, float,
                    const std::vector<mlx::core::array>&, const std::vector<mlx::core::array>&,
                    const std::vector<int>&>(),
           "norm_weight"_a, "eps"_a, "qkv"_a, "group_size"_a, "bits"_a, "bias"_a.none(), "n_heads"_a,
           "n_kv_heads"_a, "head_dim"_a, "rope_dims"_a, "q_norm"_a.none(), "k_norm"_a.none(), "qk_eps"_a,
           "scale"_a, "window"_a, "o_proj"_a, "post_norm_weight"_a, "post_eps"_a, "gate_up"_a, "down_proj"_a,
           "quant"_a)
      .def("__call__", &mlx_infer::NativeLayer::operator(), "x"_a, "key_pool"_a, "value_pool"_a, "cos"_a, "sin"_a,
           "slot_mapping"_a, "block_tables"_a, "context_lens"_a, "positions"_a, "token_seq"_a, "block_size"_a);
  m.def("run_layers", &mlx_infer::run_layers, "layers"_a, "x"_a, "key_pools"_a, "value_pools"_a, "cos"_a, "sin"_a,
        "slot_mapping"_a, "block_tables"_a, "context_lens"_a, "positions"_a, "token_seq"_a, "block_size"_a);
  m.def("gated_delta", &mlx_infer::gated_delta, "pool"_a, "slots"_a, "q"_a, "k"_a, "v"_a, "decay"_a, "beta"_a,
        "lengths"_a.none() = nb::none());
  m.def("rms_norm", &mlx_infer::rms_norm, "x"_a, "weight"_a, "eps"_a, "offset"_a);
  m.def("rope", &mlx_infer::rope, "x"_a, "cos"_a, "sin"_a, "dims"_a);
  m.def("set_attention_vectors", &mlx_infer::set_attention_vectors, "bits"_a);
  m.def("attention_vectors", &mlx_infer::attention_vectors);
  m.def("paged_attention", &mlx_infer::paged_attention, "q"_a, "key_pool"_a, "value_pool"_a, "block_tables"_a,
        "context_lens"_a, "positions"_a, "token_seq"_a, "block_size"_a, "scale"_a, "window"_a, "softcap"_a,
        "sinks"_a.none() = nb::none(), "value_dim"_a = 0);
}

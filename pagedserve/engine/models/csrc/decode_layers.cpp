// The decoder layers of a Llama-family model for one decode step, in one C++ call.
//
// Eagerly, each layer is ~40 Python-level calls (modules, views, the fused ops, the GEMMs, the K/V
// store, the attention op), ~170 us a layer on the 2-core Xeon of docs/benchmarks.md: a third of a
// batch-1 step. This loop makes the same calls, in the same order and with the same kernels, from
// C++: the fused row-wise ops (fused_ops.cpp), the GEMMs as models/panel_gemm.py's PanelLinear or
// models/onednn.py's packed_linear runs them (the panel GEMM; or the few-row bfloat16 kernel up to
// few_rows rows, else oneDNN's packed GEMM with one row padded to min_rows), the K/V store as
// kv_cache.store_rows (index_copy_ of same-width integer views) and the paged-attention op; so its
// output is bit-identical to LlamaDecoderLayer's (tests/worker/test_decode_layers.py). Ops of other
// libraries are reached through torch's dispatcher: those libraries must be loaded first
// (models/decode_layers.py does).
//
// Per layer l (x [T, hidden] updated in place; T tokens, each a decode of its own sequence):
//   h = rms_norm(x, norms[2l]);  qkv = linear(h, 4l)                    [T, (H + 2 Hkv) D]
//   qk = rotary(qkv[:, :(H + Hkv) D] as [T, H + Hkv, D], cos, sin);  v = qkv[:, (H + Hkv) D:] as [T, Hkv, D]
//   key_caches[l][slot_mapping] = qk[:, H:];  value_caches[l][slot_mapping] = v
//   o = paged_attention(qk[:, :H]);  h = add_rms_norm(x, linear(o, 4l + 1), norms[2l + 1])   (x += o_proj)
//   x += linear(silu_and_mul(linear(h, 4l + 2)), 4l + 3)
// Linear i: panels[i] and out_features[i] as a PanelLinear holds them, or packed[i] (oneDNN's packed
// weight) and for bfloat16 pairs[i] / pair_bias[i] (the few-row kernel's weight and float32 bias), as a
// OneDnnLinear holds them; bias[i] either way.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

c10::OperatorHandle op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

template <typename Signature>
c10::TypedOperatorHandle<Signature> typed(const char* name) { return op(name).template typed<Signature>(); }

using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddNorm = at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using Rotary = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Unary = at::Tensor(const at::Tensor&);
using Attention = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, double, const OptTensor&, bool);

// The ops the loop calls, found once (the first call; their libraries are loaded by then).
struct Ops {
  c10::TypedOperatorHandle<Norm> rms_norm = typed<Norm>("pagedserve_fused::rms_norm");
  c10::TypedOperatorHandle<AddNorm> add_rms_norm = typed<AddNorm>("pagedserve_fused::add_rms_norm");
  c10::TypedOperatorHandle<Rotary> rotary = typed<Rotary>("pagedserve_fused::rotary");
  c10::TypedOperatorHandle<Unary> silu_and_mul = typed<Unary>("pagedserve_fused::silu_and_mul");
  c10::TypedOperatorHandle<Attention> attention = typed<Attention>("pagedserve_cpu::paged_attention");
  c10::OperatorHandle linear = op("mkldnn::_linear_pointwise");  // called boxed: its str and Scalar?[] arguments
};

using PanelLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t);

// pagedserve's float32 GEMM, found on first use (its library is loaded for --gemm-backend panels only).
const c10::TypedOperatorHandle<PanelLinear>& panel_op() {
  static const auto handle = typed<PanelLinear>("pagedserve_panels::panel_linear");
  return handle;
}

// The few-row bfloat16 GEMM, found on first use (its library is loaded for bfloat16 models only).
const c10::OperatorHandle& few_rows_op() {
  static const c10::OperatorHandle handle = op("pagedserve_gemm::few_rows_linear");
  return handle;
}

const Ops& ops() {
  static const Ops instance;
  return instance;
}

at::Tensor call_boxed(const c10::OperatorHandle& handle, std::vector<c10::IValue> args) {
  torch::jit::Stack stack(std::make_move_iterator(args.begin()), std::make_move_iterator(args.end()));
  handle.callBoxed(&stack);
  return stack.back().toTensor();
}

// The linear layers' weights and the row counts that choose their kernel.
struct Linears {
  const c10::List<OptTensor>& packed;
  const c10::List<OptTensor>& bias;
  const c10::List<OptTensor>& pairs;
  const c10::List<OptTensor>& pair_bias;
  const c10::List<OptTensor>& panels;
  at::IntArrayRef out_features;
  int64_t few_rows, min_rows;

  // x [T, in] -> [T, out] through linear i, as models/panel_gemm.py's PanelLinear or models/onednn.py's
  // packed_linear runs it.
  at::Tensor operator()(const at::Tensor& x, size_t i) const {
    const int64_t rows = x.size(0);
    const OptTensor panel_weight = panels.get(i);
    if (panel_weight.has_value()) return panel_op().call(x.contiguous(), *panel_weight, bias.get(i), out_features[i]);
    const OptTensor pair_weight = pairs.get(i);
    if (pair_weight.has_value() && rows <= few_rows)
      return call_boxed(few_rows_op(), {x.contiguous(), *pair_weight, pair_bias.get(i)});
    at::Tensor in = rows < min_rows ? at::cat({x, x.new_zeros({min_rows - rows, x.size(1)})}) : x;
    at::Tensor out = call_boxed(ops().linear, {in.contiguous(), *packed.get(i), bias.get(i), std::string("none"),
                                               c10::List<std::optional<at::Scalar>>(), std::optional<std::string>("")});
    return rows < min_rows ? out.slice(0, 0, rows) : out;
  }
};

// cache [NB, BS, Hkv, D] at flat slots = rows [T, Hkv, D] (same dtype), copied as same-width integers.
void store_rows(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& rows) {
  const auto bits = cache.element_size() == 2 ? at::kShort : at::kInt;
  cache.view(bits).view({-1, cache.size(2), cache.size(3)}).index_copy_(0, slots, rows.view(bits));
}

void decode_layers(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms,
                   const c10::List<OptTensor>& packed, const c10::List<OptTensor>& bias,
                   const c10::List<OptTensor>& pairs, const c10::List<OptTensor>& pair_bias,
                   const c10::List<OptTensor>& panels, at::IntArrayRef out_features, at::TensorList key_caches,
                   at::TensorList value_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   double scale, double eps, int64_t few_rows, int64_t min_rows) {
  const size_t layers = key_caches.size();
  TORCH_CHECK(value_caches.size() == layers && norms.size() == 2 * layers && packed.size() == 4 * layers &&
                  bias.size() == 4 * layers && pairs.size() == 4 * layers && pair_bias.size() == 4 * layers &&
                  panels.size() == 4 * layers && out_features.size() == 4 * layers,
              "per layer: 2 norms, 4 linears (packed, bias, pairs, pair_bias, panels, out_features each) and a key "
              "and value cache");
  for (size_t i = 0; i < 4 * layers; ++i)
    TORCH_CHECK(packed.get(i).has_value() != panels.get(i).has_value(), "linear ", i, " needs packed or panels");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) == slot_mapping.size(0) && x.size(0) == seq_lens.size(0),
              "x must be a contiguous [T, hidden] tensor of T decodes, one a sequence");
  const Linears linear{packed, bias, pairs, pair_bias, panels, out_features, few_rows, min_rows};
  const int64_t tokens = x.size(0), qk_width = (num_heads + num_kv_heads) * head_dim;
  for (size_t l = 0; l < layers; ++l) {
    const at::Tensor qkv = linear(ops().rms_norm.call(x, norms[2 * l], eps), 4 * l);  // (T, (H+2Hkv)*D)
    const at::Tensor qk = ops().rotary.call(qkv.slice(1, 0, qk_width).view({tokens, num_heads + num_kv_heads, head_dim}),
                                            cos, sin);                                 // (T, H+Hkv, D)
    store_rows(key_caches[l], slot_mapping, qk.slice(1, num_heads));
    store_rows(value_caches[l], slot_mapping, qkv.slice(1, qk_width).view({tokens, num_kv_heads, head_dim}));
    at::Tensor out = at::empty({tokens, num_heads, head_dim}, x.options());
    ops().attention.call(out, qk.slice(1, 0, num_heads).contiguous(), key_caches[l], value_caches[l], block_tables,
                         seq_lens, query_start_loc, scale, OptTensor(), false);
    const at::Tensor h = ops().add_rms_norm.call(x, linear(out.view({tokens, num_heads * head_dim}), 4 * l + 1),
                                                 norms[2 * l + 1], eps);               // x += o_proj(out)
    x.add_(linear(ops().silu_and_mul.call(linear(h, 4 * l + 2)), 4 * l + 3));
  }
}

}  // namespace

TORCH_LIBRARY(pagedserve_layers, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor[] norms, Tensor?[] packed, Tensor?[] bias, "
        "Tensor?[] pairs, Tensor?[] pair_bias, Tensor?[] panels, int[] out_features, Tensor(b!)[] key_caches, "
        "Tensor(c!)[] value_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
        "int num_heads, int num_kv_heads, int head_dim, float scale, float eps, int few_rows, int min_rows) -> ()");
}

// Every backend: the packed weights are oneDNN (MkldnnCPU) tensors beside plain CPU ones.
TORCH_LIBRARY_IMPL(pagedserve_layers, CompositeExplicitAutograd, m) { m.impl("decode_layers", TORCH_FN(decode_layers)); }

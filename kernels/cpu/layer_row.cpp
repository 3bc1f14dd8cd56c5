// One decoder layer of a Llama-shaped model (Llama, SmolLM2, Qwen3) for a batch-1 decode step, float32 on the
// CPU, as one op: the library's own steps in the order layers/ and models/llama.py run them, without the ~45 us
// of Python, module lookups and tensor bookkeeping between them that each layer otherwise costs (at one
// thread ~1.3 ms of a ~16 ms SmolLM2 token).
//
//   hidden, residual = decoder_layer_row(hidden, residual?, input_norm, qkv_w, q_norm?, k_norm?, o_w,
//                                        post_norm, gate_up_w, down_w, k_pool, v_pool, slots, seq_lens, loc,
//                                        positions, cos, sin, eps, scale, kv_heads, head_dim)
//
//   qkv, residual = rmsnorm_matvec(hidden, residual, input_norm, eps, qkv_w)
//   q, k, v = qkv split; qk_norm_rope_rows_(q, k, positions, cos, sin, q_norm, k_norm)   (in place)
//   store_kv_rows_(k, v, k_pool, v_pool, loc)
//   attn = decode_attention_rows(q, k_pool, v_pool, slots, seq_lens, scale)
//   gate_up, residual = rmsnorm_matvec(matvec(attn, o_w), residual, post_norm, eps, gate_up_w)
//   hidden = silu_mul_matvec(gate_up, down_w)
//
// Each step is the registered op itself, called through the dispatcher (~1 us each), so the arithmetic and
// the checks are those ops': the layer's outputs are bit for bit the separate ops' (tested). k_pool / v_pool
// are this layer's [slots, kv_heads, head_dim] pool buffers; slots [1, >= seq_len] int64 the request's slots,
// the new token's among them; seq_lens [1], loc [1] (the new token's slot) and positions [1] int64. No biases
// (callers keep the separate ops for models with them), one tensor-parallel rank (no all-reduce).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <string>
#include <tuple>

namespace {

using Pair = std::tuple<at::Tensor, at::Tensor>;
using Opt = c10::optional<at::Tensor>;

c10::OperatorHandle find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// The attention half of a layer from its projection's rows qkv [m, q + 2 kv] (views into them): q and k normed and
// rotated in place, k and v stored at `loc` in the pool and, with new_rows, at those rows of k_read / v_read (the
// dense blocks), then the decode attention over k_read / v_read through read_slots: [m, q]. `op` names the caller.
at::Tensor attention_rows(const char* op, const at::Tensor& qkv, const Opt& q_norm, const Opt& k_norm,
                          at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& loc, const at::Tensor& positions,
                          const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_read, at::Tensor& v_read,
                          const at::Tensor& read_slots, const at::Tensor& seq_lens, const Opt& new_rows, double eps,
                          double scale, int64_t kv_heads, int64_t head_dim) {
  static const auto rope = find("radixserve_cpu::qk_norm_rope_rows_")
                               .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const Opt&, const Opt&, double, int64_t)>();
  static const auto store = find("radixserve_cpu::store_kv_rows_")
                                .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                            const at::Tensor&)>();
  static const auto attend = find("radixserve_cpu::decode_attention_rows")
                                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&, double)>();
  const int64_t m = qkv.size(0), kv_width = kv_heads * head_dim, q_width = qkv.size(1) - 2 * kv_width;
  TORCH_CHECK(q_width > 0 && q_width % kv_width == 0, op, ": qkv rows of ", qkv.size(1),
              " values do not hold q plus k and v of ", kv_heads, " heads of ", head_dim);
  at::Tensor q = qkv.narrow(1, 0, q_width), k = qkv.narrow(1, q_width, kv_width);
  const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width);
  rope.call(q, k, positions, cos, sin, q_norm, k_norm, eps, head_dim);
  at::Tensor k_rows = k_pool.view({k_pool.size(0), kv_width}), v_rows = v_pool.view({v_pool.size(0), kv_width});
  store.call(k, v, k_rows, v_rows, loc);
  if (new_rows.has_value()) {
    at::Tensor kr = k_read.view({k_read.size(0), kv_width}), vr = v_read.view({v_read.size(0), kv_width});
    store.call(k, v, kr, vr, *new_rows);
  }
  return attend.call(q.view({m, kv_heads, q_width / kv_width, head_dim}), k_read, v_read, read_slots, seq_lens, scale);
}

Pair decoder_layer_row(const at::Tensor& hidden, const Opt& residual, const at::Tensor& input_norm,
                       const at::Tensor& qkv_w, const Opt& q_norm, const Opt& k_norm, const at::Tensor& o_w,
                       const at::Tensor& post_norm, const at::Tensor& gate_up_w, const at::Tensor& down_w,
                       at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& seq_lens,
                       const at::Tensor& loc, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, double eps,
                       double scale, int64_t kv_heads, int64_t head_dim) {
  static const auto rmsnorm_matvec =
      find("radixserve_cpu::rmsnorm_matvec").typed<Pair(const at::Tensor&, const Opt&, const at::Tensor&, double,
                                                       const at::Tensor&)>();
  static const auto matvec =
      find("radixserve_cpu::matvec").typed<at::Tensor(const at::Tensor&, const at::Tensor&, const Opt&)>();
  static const auto silu_mul_matvec =
      find("radixserve_cpu::silu_mul_matvec").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  TORCH_CHECK(kv_heads > 0 && head_dim > 0, "decoder_layer_row: kv_heads and head_dim must be positive");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == 1 && seq_lens.dim() == 1 && seq_lens.size(0) == 1,
              "decoder_layer_row: one request: slots [1, len] and seq_lens [1], got ", slots.sizes(), " and ",
              seq_lens.sizes());
  auto [qkv, res] = rmsnorm_matvec.call(hidden, residual, input_norm, eps, qkv_w);
  const at::Tensor attn = attention_rows("decoder_layer_row", qkv.reshape({1, -1}), q_norm, k_norm, k_pool, v_pool,
                                         loc, positions, cos, sin, k_pool, v_pool, slots, seq_lens, c10::nullopt,
                                         eps, scale, kv_heads, head_dim);
  const at::Tensor o = matvec.call(attn, o_w, c10::nullopt).view(hidden.sizes());
  auto [gate_up, res2] = rmsnorm_matvec.call(o, res, post_norm, eps, gate_up_w);
  return {silu_mul_matvec.call(gate_up, down_w).view(hidden.sizes()), res2.view(hidden.sizes())};
}


// The same layer for a decode batch of M >= 2 rows, as layers/ and models/llama.py run it at batch M: the row
// ops of rows.cpp, the packed products (oneDNN's mkldnn::_linear_pointwise or panels.cpp's panel_linear, as
// layers/linear.py's linear() takes rows with a prepacked weight), the KV store into the pool and, where the attention reads the dense blocks
// (attention/dense_kv.py), the append of this step's rows to them. It also takes one row whose products are
// not the C++ ones: the packed weights where calibration chose them for single rows, or the plain weights
// (aten::linear, F.linear's op) where it chose F.linear; each product goes by its weight.
//
//   hidden, residual = decoder_layer_rows(hidden, residual?, input_norm, qkv_packed, q_norm?, k_norm?, o_packed,
//                                         post_norm, gate_up_packed, down_packed, k_pool, v_pool, loc,
//                                         positions, cos, sin, k_read, v_read, read_slots, seq_lens,
//                                         new_rows?, eps, scale, kv_heads, head_dim)
//
//   x, residual = residual ? add_rmsnorm_rows(hidden, residual) : (rmsnorm_rows(hidden), hidden)
//   qkv = linear(x, qkv_packed); q, k, v split; qk_norm_rope_rows_(q, k, ...)          (in place)
//   store_kv_rows_(k, v, k_pool, v_pool, loc); new_rows: store_kv_rows_(k, v, k_read, v_read, new_rows)
//   attn = decode_attention_rows(q, k_read, v_read, read_slots, seq_lens, scale)
//   x, residual = add_rmsnorm_rows(linear(attn, o_packed), residual); hidden = linear(silu_mul_rows(
//   linear(x, gate_up_packed)), down_packed)
//
// k_read / v_read [rows, kv_heads, head_dim] are what the attention reads: the pool itself (read_slots the
// requests' slots) or this layer's dense blocks viewed as rows (read_slots each request's rows there, new_rows
// where this step's go). The outputs are bit for bit the separate ops' (tested).
// x's rows times a weight as layers/linear.py's linear() takes them: a oneDNN packed weight through
// mkldnn::_linear_pointwise, pack_panels' [1, N, K] through panel_linear (panels.cpp), a plain [N, K] one
// through aten::linear (F.linear's op), so the same bits.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight) {
  if (!weight.is_mkldnn() && weight.dim() == 3) {
    static const auto panels = find("radixserve_cpu::panel_linear")
                                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const Opt&)>();
    return panels.call(x, weight, c10::nullopt);
  }
  if (!weight.is_mkldnn()) {
    static const auto linear = find("aten::linear").typed<at::Tensor(const at::Tensor&, const at::Tensor&, const Opt&)>();
    return linear.call(x, weight, c10::nullopt);
  }
  static const auto op = find("mkldnn::_linear_pointwise");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

Pair decoder_layer_rows(const at::Tensor& hidden, const Opt& residual, const at::Tensor& input_norm,
                        const at::Tensor& qkv_packed, const Opt& q_norm, const Opt& k_norm, const at::Tensor& o_packed,
                        const at::Tensor& post_norm, const at::Tensor& gate_up_packed, const at::Tensor& down_packed,
                        at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& loc, const at::Tensor& positions,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_read, at::Tensor& v_read,
                        const at::Tensor& read_slots, const at::Tensor& seq_lens, const Opt& new_rows, double eps,
                        double scale, int64_t kv_heads, int64_t head_dim) {
  static const auto add_rmsnorm = find("radixserve_cpu::add_rmsnorm_rows")
                                      .typed<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  static const auto rmsnorm =
      find("radixserve_cpu::rmsnorm_rows").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  static const auto silu_mul = find("radixserve_cpu::silu_mul_rows").typed<at::Tensor(const at::Tensor&)>();
  TORCH_CHECK(kv_heads > 0 && head_dim > 0, "decoder_layer_rows: kv_heads and head_dim must be positive");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decoder_layer_rows: hidden must be contiguous [M, H], got ",
              hidden.sizes());
  at::Tensor x, res;
  if (residual.has_value()) {
    std::tie(x, res) = add_rmsnorm.call(hidden, *residual, input_norm, eps);
  } else {
    x = rmsnorm.call(hidden, input_norm, eps);
    res = hidden;
  }
  const at::Tensor attn =
      attention_rows("decoder_layer_rows", rows_linear(x, qkv_packed), q_norm, k_norm, k_pool, v_pool, loc,
                     positions, cos, sin, k_read, v_read, read_slots, seq_lens, new_rows, eps, scale, kv_heads, head_dim);
  const at::Tensor o = rows_linear(attn, o_packed);
  auto [gx, res2] = add_rmsnorm.call(o, res, post_norm, eps);
  return {rows_linear(silu_mul.call(rows_linear(gx, gate_up_packed)), down_packed), res2};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def(
      "decoder_layer_row(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor qkv_w, Tensor? q_norm, "
      "Tensor? k_norm, Tensor o_w, Tensor post_norm, Tensor gate_up_w, Tensor down_w, Tensor(a!) k_pool, "
      "Tensor(b!) v_pool, Tensor slots, Tensor seq_lens, Tensor loc, Tensor positions, Tensor cos, Tensor sin, float eps, "
      "float scale, int kv_heads, int head_dim) -> (Tensor, Tensor)");
  m.def(
      "decoder_layer_rows(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor qkv_packed, Tensor? q_norm, "
      "Tensor? k_norm, Tensor o_packed, Tensor post_norm, Tensor gate_up_packed, Tensor down_packed, "
      "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor loc, Tensor positions, Tensor cos, Tensor sin, Tensor(c!) k_read, "
      "Tensor(d!) v_read, Tensor read_slots, Tensor seq_lens, Tensor? new_rows, float eps, float scale, int kv_heads, "
      "int head_dim) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("decoder_layer_row", &decoder_layer_row);
  m.impl("decoder_layer_rows", &decoder_layer_rows);
}

// The packed weights are oneDNN tensors (MkldnnCPU), which the dispatcher ranks above CPU.
TORCH_LIBRARY_IMPL(radixserve_cpu, MkldnnCPU, m) { m.impl("decoder_layer_rows", &decoder_layer_rows); }

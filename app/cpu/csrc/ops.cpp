// The CPU kernels of app/cpu/kernels/*.c as typed torch ops: torch.ops.llm_serve.<name>.
//
// Each op checks dtype, device, rank and layout of its arguments at the boundary (a TORCH_CHECK with a
// message naming the argument) and then hands raw pointers to the C kernel. Shapes the kernels cannot
// take are errors here, never silent memory reads. Fake (meta) implementations live in app/cpu/ops.py,
// so the ops trace under torch.compile. Built by app/cpu/build.py against torch's headers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <sched.h>

#include <cstdint>
#include <tuple>
#include <vector>

extern "C" {
int64_t packed_weight_numel(int64_t n, int64_t k);
void pack_weight(const float* w, float* packed, int64_t n, int64_t k);
void pack_weight_bf16(const float* w, uint16_t* packed, int64_t n, int64_t k);
void linear(const float* x, const float* packed, const float* bias, float* y, int64_t m, int64_t k, int64_t n);
void linear_bf16w(const float* x, const uint16_t* packed, const float* bias, float* y, int64_t m, int64_t k, int64_t n);
int linear_bf16dot_built(void);
void linear_bf16dot(const uint32_t* x, const uint16_t* packed, const float* bias, const float* residual, float* y, int64_t m,
                    int64_t k2, int64_t n);
void linear_int4_bf16dot(const uint32_t* x, const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros,
                         const float* xsums, const float* bias, float* y, int64_t m, int64_t k2, int64_t n,
                         int64_t pairs_per_group);
void int4_group_sums(const uint16_t* x, float* sums, int64_t m, int64_t k, int64_t group_size);
void round_rows_to_bf16(const float* x, uint16_t* out, int64_t rows, int64_t k, int64_t out_k);
int64_t bind_openmp_threads(const int64_t* cpus, int64_t n);
void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps);
void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t width, int lanes);
void rotary(const float* q, int64_t qs_b, int64_t qs_h, int64_t qs_t, int64_t q_heads, const float* k, int64_t ks_b,
            int64_t ks_h, int64_t ks_t, int64_t k_heads, const float* cos, const float* sin, int64_t cs_b, int64_t cs_t,
            float* q_out, float* k_out, int64_t batch, int64_t tokens, int64_t d);
void argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out);
void decode_attention(const float* q, int64_t q_seq_stride, int64_t q_head_stride, const float* new_k,
                      int64_t k_seq_stride, int64_t k_head_stride, const float* new_v, int64_t v_seq_stride,
                      int64_t v_head_stride, const int64_t* new_slots, void* k_pool, void* v_pool, int kv_bf16,
                      const int64_t* key_slots, const int64_t* key_counts, float* out, int64_t seqs, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t max_keys, float scale);
void prefill_attention(const float* q, int64_t q_tok_stride, int64_t q_head_stride, const void* k_pool,
                       const void* v_pool, int kv_bf16, const int64_t* key_slots, int64_t max_keys,
                       const int64_t* query_seq, const int64_t* query_keys, float* out, int64_t tokens, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, float scale);
}

namespace {

void check_cpu(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

void check_dense(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  check_cpu(t, dtype, name);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_index(const at::Tensor& t, int64_t dim, const char* name) {
  check_dense(t, at::kLong, name);
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
}

// A Linear's optional bias: fp32, one value per output (nullptr: none).
const float* checked_bias(const std::optional<at::Tensor>& bias, int64_t out_features) {
  if (!bias.has_value()) return nullptr;
  check_dense(*bias, at::kFloat, "bias");
  TORCH_CHECK(bias->numel() == out_features, "bias must have ", out_features, " values, got ", bias->numel());
  return bias->data_ptr<float>();
}

// ---- Linear: y = x W^T + b over weights packed once into panels -------------------------------------
at::Tensor pack_linear_weight(const at::Tensor& weight, at::ScalarType dtype) {
  check_cpu(weight, at::kFloat, "weight");
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features], got ", weight.sizes());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "packed weights are float32 or bfloat16, not ", dtype);
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor packed = at::empty({packed_weight_numel(n, k)}, w.options().dtype(dtype));
  if (dtype == at::kBFloat16)
    pack_weight_bf16(w.data_ptr<float>(), reinterpret_cast<uint16_t*>(packed.data_ptr()), n, k);
  else
    pack_weight(w.data_ptr<float>(), packed.data_ptr<float>(), n, k);
  return packed;
}

at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  check_cpu(x_in, at::kFloat, "x");
  TORCH_CHECK(x_in.dim() >= 1, "x must have a feature dimension");
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 1 && packed.is_contiguous(), "packed must be a packed weight");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || packed.scalar_type() == at::kFloat, "packed must be float32 or bfloat16, got ", packed.scalar_type());
  const int64_t k = x_in.size(-1);
  TORCH_CHECK(out_features > 0 && packed.numel() == packed_weight_numel(out_features, k),
              "packed holds no [", out_features, ", ", k, "] weight (x has ", k, " features)");
  const float* bias_ptr = checked_bias(bias, out_features);
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t rows = k ? x.numel() / k : 0;
  if (rows == 0) return y;
  if (bf16)
    linear_bf16w(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr()), bias_ptr,
                 y.data_ptr<float>(), rows, k, out_features);
  else
    linear(x.data_ptr<float>(), packed.data_ptr<float>(), bias_ptr, y.data_ptr<float>(), rows, k, out_features);
  return y;
}

// ---- Linear with bf16 products (vdpbf16ps): x rounded to bf16, W packed in groups of 64 columns ---------
constexpr int64_t kBf16GroupCols = 64;

at::Tensor bf16dot_linear(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                          int64_t out_features, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(linear_bf16dot_built(), "this build of the kernels has no avx512_bf16 code (compiler too old)");
  check_cpu(x_in, at::kFloat, "x");
  TORCH_CHECK(x_in.dim() >= 1, "x must have a feature dimension");
  check_dense(packed, at::kBFloat16, "packed");
  TORCH_CHECK(packed.dim() == 1, "packed must be a packed weight");
  const int64_t k = x_in.size(-1), k2 = (k + 1) / 2;
  const int64_t groups = (out_features + kBf16GroupCols - 1) / kBf16GroupCols;
  TORCH_CHECK(out_features > 0 && packed.numel() == groups * k2 * kBf16GroupCols * 2,
              "packed holds no [", out_features, ", ", k, "] weight (x has ", k, " features)");
  const float* bias_ptr = checked_bias(bias, out_features);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty(shape, x_in.options());
  const float* residual_ptr = nullptr;
  if (residual.has_value()) {  // y = residual + (x W^T + b)
    check_dense(*residual, at::kFloat, "residual");
    TORCH_CHECK(residual->sizes() == y.sizes(), "residual must have the output's shape ", y.sizes(), ", got ", residual->sizes());
    residual_ptr = residual->data_ptr<float>();
  }
  const int64_t rows = k ? x_in.numel() / k : 0;
  if (rows == 0) return y;
  at::Tensor x = at::empty({rows, 2 * k2}, x_in.options().dtype(at::kBFloat16));
  const at::Tensor x_rows = x_in.reshape({rows, k}).contiguous();
  // fp32 -> bf16 as torch rounds it; an odd k gets a zero partner
  round_rows_to_bf16(x_rows.data_ptr<float>(), reinterpret_cast<uint16_t*>(x.data_ptr()), rows, k, 2 * k2);
  linear_bf16dot(reinterpret_cast<const uint32_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                 bias_ptr, residual_ptr, y.data_ptr<float>(), rows, k2, out_features);
  return y;
}

// ---- Linear with 4-bit weights (GPTQ codes, a zero and a scale per group and column), bf16 products ------
at::Tensor int4_bf16dot_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                               const at::Tensor& zeros, const std::optional<at::Tensor>& bias, int64_t out_features,
                               int64_t group_size) {
  TORCH_CHECK(linear_bf16dot_built(), "this build of the kernels has no avx512_bf16 code (compiler too old)");
  TORCH_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x_in.dim() >= 1, "x must have a feature dimension");
  check_dense(codes, at::kByte, "codes");
  check_dense(scales, at::kHalf, "scales");
  check_dense(zeros, at::kByte, "zeros");
  const int64_t k = x_in.size(-1), k2 = k / 2;
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && k % group_size == 0,
              "group_size must be a multiple of 16 that divides the input size (", k, "), got ", group_size);
  const int64_t groups = (out_features + kBf16GroupCols - 1) / kBf16GroupCols, quant_groups = k / group_size;
  TORCH_CHECK(out_features > 0 && codes.numel() == groups * k2 * kBf16GroupCols,
              "codes hold no [", out_features, ", ", k, "] weight (x has ", k, " features)");
  TORCH_CHECK(scales.numel() == groups * quant_groups * kBf16GroupCols && zeros.numel() == scales.numel(),
              "scales and zeros must hold one value per column and group of ", group_size, " inputs");
  const float* bias_ptr = checked_bias(bias, out_features);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty(shape, x_in.options().dtype(at::kFloat));
  const int64_t rows = k ? x_in.numel() / k : 0;
  if (rows == 0) return y.to(x_in.scalar_type());
  at::Tensor x = x_in.reshape({rows, k}).contiguous();
  if (x.scalar_type() == at::kFloat) {  // fp32 -> bf16 as torch rounds it
    at::Tensor rounded = at::empty({rows, k}, x.options().dtype(at::kBFloat16));
    round_rows_to_bf16(x.data_ptr<float>(), reinterpret_cast<uint16_t*>(rounded.data_ptr()), rows, k, k);
    x = rounded;
  }
  // each row's sum of its bf16 values over each quantization group (a row's own, whatever the batch)
  at::Tensor xsums = at::empty({rows, quant_groups}, x_in.options().dtype(at::kFloat));
  float* sums = xsums.data_ptr<float>();
  int4_group_sums(reinterpret_cast<const uint16_t*>(x.data_ptr()), sums, rows, k, group_size);
  linear_int4_bf16dot(reinterpret_cast<const uint32_t*>(x.data_ptr()), codes.data_ptr<uint8_t>(),
                      reinterpret_cast<const uint16_t*>(scales.data_ptr()), zeros.data_ptr<uint8_t>(), sums, bias_ptr, y.data_ptr<float>(), rows, k2, out_features, group_size / 2);
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

int64_t bf16dot_built() { return linear_bf16dot_built(); }  // 0 where the compiler lacked avx512_bf16

// ---- Threads: the calling thread's OpenMP team, one thread per CPU ---------------------------------------------
int64_t bind_threads(at::IntArrayRef cpus) {
  TORCH_CHECK(!cpus.empty(), "cpus must name one CPU per thread");
  for (const int64_t cpu : cpus) TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "CPU ", cpu, " is out of range");
  return bind_openmp_threads(cpus.data(), static_cast<int64_t>(cpus.size()));
}

// ---- RMSNorm (Llama's formula) -------------------------------------------------------------------------
at::Tensor rms_norm_op(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  check_cpu(x_in, at::kFloat, "x");
  check_dense(weight, at::kFloat, "weight");
  TORCH_CHECK(weight.dim() == 1 && x_in.dim() >= 1 && x_in.size(-1) == weight.size(0),
              "x's last dimension must equal weight's size ", weight.size(0));
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t hidden = weight.size(0);
  if (hidden) rms_norm(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), x.numel() / hidden, hidden, eps);
  return y;
}

// ---- the gated MLP's silu(gate) * up, from [..., gate | up] rows ------------------------------------------
at::Tensor silu_mul_op(const at::Tensor& gate_up_in, int64_t lanes) {
  check_cpu(gate_up_in, at::kFloat, "gate_up");
  TORCH_CHECK(gate_up_in.dim() >= 1 && gate_up_in.size(-1) % 2 == 0, "gate_up's last dimension must be even (gate, then up)");
  TORCH_CHECK(lanes == 1 || lanes == 8 || lanes == 16, "lanes must be 1, 8 or 16, got ", lanes);
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t width = gate_up.size(-1) / 2;
  std::vector<int64_t> shape = gate_up.sizes().vec();
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  if (width) silu_mul(gate_up.data_ptr<float>(), out.data_ptr<float>(), gate_up.numel() / (2 * width), width, static_cast<int>(lanes));
  return out;
}

// ---- RoPE: q [B, H, T, D], k [B, Hkv, T, D], cos/sin [B or 1, T, D] ------------------------------------
at::Tensor rotary_output(int64_t batch, int64_t heads, int64_t tokens, int64_t dim, const at::Tensor& like) {
  // [B, T, H, D] memory seen as [B, H, T, D]: the layout torch's ops give for the usual transposed q and k
  return at::empty_strided({batch, heads, tokens, dim}, {tokens * heads * dim, dim, heads * dim, 1}, like.options());
}

std::tuple<at::Tensor, at::Tensor> rotary_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin) {
  check_cpu(q, at::kFloat, "q");
  check_cpu(k, at::kFloat, "k");
  check_cpu(cos, at::kFloat, "cos");
  check_cpu(sin, at::kFloat, "sin");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3, "q and k must be [B, H, T, D], cos and sin [B, T, D]");
  const int64_t batch = q.size(0), tokens = q.size(2), dim = q.size(3);
  TORCH_CHECK(k.size(0) == batch && k.size(2) == tokens && k.size(3) == dim && dim % 2 == 0,
              "k must match q's batch, tokens and (even) head size");
  TORCH_CHECK((cos.size(0) == 1 || cos.size(0) == batch) && cos.size(1) == tokens && cos.size(2) == dim,
              "cos must be [1 or B, T, D] with q's T and D (partial rotary is not supported)");
  TORCH_CHECK(sin.sizes() == cos.sizes() && sin.strides() == cos.strides(), "sin must have cos's shape and strides");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && cos.stride(2) == 1, "the last dimension must be contiguous");
  at::Tensor q_out = rotary_output(batch, q.size(1), tokens, dim, q);
  at::Tensor k_out = rotary_output(batch, k.size(1), tokens, dim, k);
  rotary(q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2), q.size(1), k.data_ptr<float>(), k.stride(0),
         k.stride(1), k.stride(2), k.size(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
         cos.size(0) == batch ? cos.stride(0) : 0, cos.stride(1), q_out.data_ptr<float>(), k_out.data_ptr<float>(),
         batch, tokens, dim);
  return {q_out, k_out};
}

// ---- argmax of each row (torch's answer: first index of the maximum, or of the first NaN) --------------
at::Tensor argmax_rows_op(const at::Tensor& x) {
  check_dense(x, at::kFloat, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.size(1) < (int64_t{1} << 31), "x must be [rows, 1..2^31-1]");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  argmax_rows(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  return out;
}

// ---- paged attention over a pool [slots, Hkv, D] of fp32 or bf16 keys and values ----------------------
void check_pool(const at::Tensor& pool, const char* name, int64_t kv_heads, int64_t head_dim) {
  check_dense(pool, pool.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat, name);
  TORCH_CHECK(pool.dim() == 3 && pool.size(1) == kv_heads && pool.size(2) == head_dim, name,
              " must be [slots, ", kv_heads, ", ", head_dim, "], got ", pool.sizes());
}

void check_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t kv_heads, int64_t head_dim) {
  check_pool(k_pool, "k_pool", kv_heads, head_dim);
  check_pool(v_pool, "v_pool", kv_heads, head_dim);
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "k_pool and v_pool must have one dtype");
}

int kv_bf16(const at::Tensor& pool) { return pool.scalar_type() == at::kBFloat16; }

void check_query(const at::Tensor& query, const char* name) {
  check_cpu(query, at::kFloat, name);
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1 && query.stride(3) == 1, name,
              " must be [1, heads, tokens, head_dim] with a contiguous last dimension");
}

// One query per sequence: writes each sequence's new key and value into the pools, then attends.
at::Tensor decode_attention_op(const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
                               at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& new_slots,
                               const at::Tensor& key_slots, const at::Tensor& key_counts, double scale) {
  check_query(query_in, "query");
  check_query(key_in, "key");
  check_query(value_in, "value");
  const int64_t heads = query_in.size(1), seqs = query_in.size(2), head_dim = query_in.size(3);
  const int64_t kv_heads = key_in.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of key heads");
  TORCH_CHECK(key_in.sizes() == value_in.sizes() && key_in.size(2) == seqs && key_in.size(3) == head_dim,
              "key and value must be [1, kv_heads, seqs, head_dim] beside query");
  check_pools(k_pool, v_pool, kv_heads, head_dim);
  check_index(new_slots, 1, "new_slots");
  check_index(key_slots, 2, "key_slots");
  check_index(key_counts, 1, "key_counts");
  TORCH_CHECK(new_slots.size(0) == seqs && key_slots.size(0) == seqs && key_counts.size(0) == seqs,
              "new_slots, key_slots and key_counts must have one row per sequence (", seqs, ")");
  const int64_t max_keys = key_slots.size(1), slots = k_pool.size(0);
  const int64_t* counts = key_counts.data_ptr<int64_t>();
  const int64_t* fresh = new_slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < seqs; b++) {
    TORCH_CHECK(counts[b] >= 1 && counts[b] <= max_keys, "key_counts[", b, "] must be in 1..", max_keys);
    TORCH_CHECK(fresh[b] >= 0 && fresh[b] < slots, "new_slots[", b, "] is outside the pool");
  }
  at::Tensor out = at::empty({1, seqs, heads, head_dim}, query_in.options());
  decode_attention(query_in.data_ptr<float>(), query_in.stride(2), query_in.stride(1), key_in.data_ptr<float>(),
                   key_in.stride(2), key_in.stride(1), value_in.data_ptr<float>(), value_in.stride(2),
                   value_in.stride(1), fresh, k_pool.data_ptr(), v_pool.data_ptr(), kv_bf16(k_pool),
                   key_slots.data_ptr<int64_t>(), counts, out.data_ptr<float>(), seqs, heads, kv_heads, head_dim,
                   max_keys, static_cast<float>(scale));
  return out;
}

// Any step's queries (prefill chunks and decodes side by side); the step's keys are already in the pools.
at::Tensor prefill_attention_op(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                const at::Tensor& key_slots, const at::Tensor& query_seq,
                                const at::Tensor& query_keys, double scale) {
  check_query(query, "query");
  const int64_t heads = query.size(1), tokens = query.size(2), head_dim = query.size(3);
  TORCH_CHECK(k_pool.dim() == 3, "k_pool must be [slots, kv_heads, head_dim]");
  const int64_t kv_heads = k_pool.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of the pool's key heads");
  check_pools(k_pool, v_pool, kv_heads, head_dim);
  check_index(key_slots, 2, "key_slots");
  check_index(query_seq, 1, "query_seq");
  check_index(query_keys, 1, "query_keys");
  TORCH_CHECK(query_seq.size(0) == tokens && query_keys.size(0) == tokens, "query_seq and query_keys need one value a query");
  const int64_t rows = key_slots.size(0), max_keys = key_slots.size(1);
  const int64_t* seq = query_seq.data_ptr<int64_t>();
  const int64_t* keys = query_keys.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; t++) {
    TORCH_CHECK(seq[t] >= 0 && seq[t] < rows, "query_seq[", t, "] names no row of key_slots");
    TORCH_CHECK(keys[t] >= 1 && keys[t] <= max_keys, "query_keys[", t, "] must be in 1..", max_keys);
  }
  at::Tensor out = at::empty({1, tokens, heads, head_dim}, query.options());
  prefill_attention(query.data_ptr<float>(), query.stride(2), query.stride(1), k_pool.data_ptr(),
                    v_pool.data_ptr(), kv_bf16(k_pool), key_slots.data_ptr<int64_t>(), max_keys, seq, keys,
                    out.data_ptr<float>(), tokens, heads, kv_heads, head_dim, static_cast<float>(scale));
  return out;
}

}  // namespace

TORCH_LIBRARY(llm_serve, m) {
  m.def("pack_linear_weight(Tensor weight, ScalarType dtype) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_bf16dot(Tensor x, Tensor packed, Tensor? bias, int out_features, Tensor? residual=None) -> Tensor");
  m.def("linear_bf16dot_built() -> int");
  m.def("bind_threads(int[] cpus) -> int");
  m.def("linear_int4_bf16dot(Tensor x, Tensor codes, Tensor scales, Tensor zeros, Tensor? bias, int out_features, "
        "int group_size) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up, int lanes) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor new_slots, Tensor key_slots, Tensor key_counts, float scale) -> Tensor");
  m.def("prefill_attention(Tensor query, Tensor k_pool, Tensor v_pool, Tensor key_slots, Tensor query_seq, "
        "Tensor query_keys, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_serve, CompositeExplicitAutograd, m) {
  m.impl("linear_bf16dot_built", &bf16dot_built);  // no tensor to dispatch on
  m.impl("bind_threads", &bind_threads);
}

TORCH_LIBRARY_IMPL(llm_serve, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("linear", &packed_linear);
  m.impl("linear_bf16dot", &bf16dot_linear);
  m.impl("linear_int4_bf16dot", &int4_bf16dot_linear);
  m.impl("rms_norm", &rms_norm_op);
  m.impl("silu_mul", &silu_mul_op);
  m.impl("rotary", &rotary_op);
  m.impl("argmax_rows", &argmax_rows_op);
  m.impl("decode_attention", &decode_attention_op);
  m.impl("prefill_attention", &prefill_attention_op);
}

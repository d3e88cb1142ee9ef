// Shared machinery of the models (private): activation buffers in the policy's storage
// format, fp32 working scratch, the decoded fp32 view of the weights, and weight-
// gradient targets. Every op of a model reads fp32 values, computes with the fp32
// layers of layers.hpp, and commits its output to storage, which rounds it; after
// commit the fp32 span holds exactly the stored values, ready for the next op. The
// exception: GEMM operands (operand() and friends) are the stored bf16 tensors when
// the Gemm multiplies bf16 natively, and commit_operand() skips the decode for an
// activation that only such GEMMs read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/formats/bulk.hpp"
#include "mixprec/nn/gemm.hpp"
#include "mixprec/nn/model.hpp"
#include "mixprec/optim/param_store.hpp"

namespace mixprec::nn::detail {

// One stored tensor: `numel` elements of `dtype` at `offset` bytes into the arena.
struct Act {
  std::string name;
  DType dtype = DType::f32;
  std::size_t numel = 0;
  std::size_t offset = 0;
};

// A growable list of buffers, allocated once (finish()) as one block.
class Arena {
 public:
  std::size_t add(std::string name, DType dtype, std::size_t numel);  // returns its index
  void finish();
  const Act& act(std::size_t i) const { return acts_[i]; }
  std::size_t bytes() const noexcept { return bytes_; }
  std::byte* data(std::size_t i) { return base_ + acts_[i].offset; }
  const std::byte* data(std::size_t i) const { return base_ + acts_[i].offset; }
  std::span<float> f32(std::size_t i, std::size_t n);  // only for f32 buffers; first n elements
  std::size_t count() const noexcept { return acts_.size(); }

 private:
  std::vector<Act> acts_;
  std::vector<std::byte> storage_;
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
};

class Engine {
 public:
  // scratch_count fp32 scratch slots of scratch_floats elements each. Each model names
  // its slots and states which values share one (enum ForwardSlot / BackwardSlot in
  // gpt.cpp, mlp.cpp).
  Engine(PrecisionPolicy policy, ParamStore& store, std::size_t scratch_floats, std::size_t scratch_count);

  const PrecisionPolicy& policy() const noexcept { return policy_; }
  Gemm& gemm() noexcept { return gemm_; }
  // One 1-thread Gemm per OpenMP thread (as many as omp_get_max_threads() when the
  // engine was built), for attention's per-head GEMMs; just gemm() on one thread.
  std::span<Gemm> head_gemms() noexcept {
    return head_gemms_.empty() ? std::span<Gemm>(&gemm_, 1) : std::span<Gemm>(head_gemms_);
  }
  // Gemm::flops over gemm() and the head GEMMs.
  std::uint64_t gemm_flops() const noexcept {
    std::uint64_t f = gemm_.flops();
    for (const Gemm& g : head_gemms_) f += g.flops();
    return f;
  }
  Arena& acts() noexcept { return acts_; }
  const Arena& acts() const noexcept { return acts_; }

  // Testing (Model::set_fault): NaN into element 0 of activation `act` as it is committed,
  // +inf into element 0 of the activation gradient of stats label `label`; kNoFault: none.
  static constexpr std::size_t kNoFault = static_cast<std::size_t>(-1);
  void set_fault(std::size_t act, std::size_t label) noexcept {
    fault_act_ = act;
    fault_label_ = label;
  }

  // Scratch slot `slot`, first n elements.
  std::span<float> scratch(std::size_t slot, std::size_t n);
  // The same, set to zero (split over the OpenMP threads when large, as copy()).
  std::span<float> zeroed(std::size_t slot, std::size_t n);
  // dst = src (equal sizes), split over the OpenMP threads when large.
  static void copy(std::span<float> dst, std::span<const float> src);

  // Where an op writes activation `a` (first n elements): the buffer itself when it is
  // fp32, else scratch slot `slot`.
  std::span<float> target(std::size_t a, std::size_t slot, std::size_t n);
  // Stores v (from target) into activation a (rounding when a is low precision) and
  // leaves v holding the stored values.
  void commit(std::size_t a, std::span<float> v);
  // The same for an activation that only native GEMMs read (through operand()): when
  // native_operands(), the stored bf16 values are not decoded back into v (v keeps the
  // unrounded values and must not be read as the activation afterwards); otherwise
  // exactly commit().
  void commit_operand(std::size_t a, std::span<float> v);
  // The same for an activation gradient, counting what rounding lost into stats. An
  // fp32 gradient is not copied into the arena: v is its stored value.
  // `label` indexes stats.tensors (layer and role), which also names the tensor in
  // stats.first_overflow.
  void commit_grad(std::size_t a, std::span<float> v, BackwardStats& stats, std::size_t label);
  // commit_grad for a gradient that only native GEMMs read (see commit_operand).
  void commit_grad_operand(std::size_t a, std::span<float> v, BackwardStats& stats, std::size_t label);
  // ---- fused passes -------------------------------------------------------------
  // A model's op and the commit of its output, run block by block: each block of rows
  // is produced and then committed while it is still in cache, instead of a pass that
  // produces the whole output and another that rounds it. The rounding points and the
  // stored codes, rounded values and counts are exactly those of the unfused sequence
  // (produce every stage in full, commit it, then the next stage), which run_stages
  // runs instead while histograms are on or fusion is switched off
  // (set_fused_passes(false), for the tests that compare the two).
  //
  // How a stage's output is committed: as commit(), commit_operand(), commit_grad() or
  // commit_grad_operand() would; none: not committed (an fp32 result the stage writes
  // in place, e.g. the probabilities).
  enum class Commit : std::uint8_t { value, operand, grad, grad_operand, none };
  struct Stage {
    // produce(ctx, r0, r1) writes rows [r0, r1) of v (and whatever else the stage owns);
    // it may read rows [r0, r1) of earlier stages' outputs, as committed, and anything
    // no stage of the call writes.
    void (*produce)(void* ctx, std::size_t r0, std::size_t r1);
    void* ctx;
    std::size_t act;   // the stored activation or gradient (unused for Commit::none)
    std::span<float> v;  // its fp32 values: rows x cols, from target() or a scratch slot
    std::size_t cols;
    Commit kind = Commit::value;
    std::size_t label = 0;  // gradient kinds: the stats label (as commit_grad)
  };
  // Runs the stages over `rows` rows, the blocks split over the OpenMP threads; stats
  // receives the gradient stages' counts (nullptr when there is none).
  void run_stages(std::size_t rows, std::span<const Stage> stages, BackwardStats* stats);
  // A Stage from a callable f(r0, r1) (which must outlive the run_stages call).
  template <class F>
  static Stage stage(F& f, std::size_t act, std::span<float> v, std::size_t cols, Commit kind = Commit::value,
                     std::size_t label = 0) {
    return {[](void* c, std::size_t r0, std::size_t r1) { (*static_cast<F*>(c))(r0, r1); }, &f, act, v, cols, kind,
            label};
  }

  // Histograms to add every committed activation / activation gradient to (before
  // rounding); nullptr: none.
  void set_histograms(ModelHistograms* h) noexcept { hist_ = h; }
  // fp32 values of activation a (first n elements): the buffer itself when fp32, else
  // decoded into scratch slot `slot`.
  std::span<const float> load(std::size_t a, std::size_t slot, std::size_t n);
  // Elements [begin, begin + n) of what load(a, slot, ...) gives, decoded on this thread
  // into the same place of the slot: for a stage that reads a saved activation block by
  // block (Engine::run_stages).
  std::span<const float> load_part(std::size_t a, std::size_t slot, std::size_t begin, std::size_t n);
  // GEMM operands (docs/gemm.md, "Which GEMM takes which path"). When the policy stores
  // activations and weights in bf16 and the Gemm multiplies bf16 natively (oneDNN's bf16
  // matmul on AVX-512), the operands are the stored bf16 tensors themselves; otherwise
  // their fp32 values (multiplying widened copies would only add a conversion).
  bool native_operands() const noexcept { return native_; }
  // Activation (or activation gradient) `a` as a rows x cols operand; `v` holds its
  // values in fp32 (what target/commit/commit_grad/load left there).
  MatrixView operand(std::size_t a, std::span<const float> v, std::size_t rows, std::size_t cols);
  // A saved activation read by a backward GEMM: its storage when native (nothing is
  // decoded), else load(a, slot, rows * cols).
  MatrixView saved_operand(std::size_t a, std::size_t slot, std::size_t rows, std::size_t cols);
  // Weight `param` as a rows x cols operand (the stored model copy when native).
  MatrixView weight_operand(std::size_t param, std::size_t rows, std::size_t cols) const;
  // The dtype of operands (bf16 when native, else f32), for Gemm::prepare.
  DType operand_dtype() const noexcept { return native_ ? DType::bf16 : DType::f32; }

  // First element index of activation a that is inf/NaN within n, or npos.
  std::size_t first_nonfinite(std::size_t a, std::size_t n) const;

  // Weights as fp32 (exact values of the stored, possibly rounded, weights).
  std::span<const float> w(std::size_t param) const;
  void weights_updated();  // re-decodes the model copy

  // Where backward accumulates the gradient of `param`: the store's fp32 grads, or
  // (fp16 grads) an fp32 accumulator that finish_backward rounds into the store.
  std::span<float> dw(std::size_t param);
  void begin_backward();
  void finish_backward();

  std::size_t scratch_bytes() const noexcept;

 private:
  void commit_grad_impl(std::size_t a, std::span<float> v, BackwardStats& stats, std::size_t label,
                        bool decode_back);
  // The tail of commit_grad_impl: a gradient's counts and amax into stats.
  void record_grad(BackwardStats& stats, std::size_t label, const ConversionStats& s, float amax) const;
  void run_stages_unfused(std::size_t rows, std::span<const Stage> stages, BackwardStats* stats);
  void commit_block(const Stage& st, std::size_t r0, std::size_t r1, ConversionStats& counts, float& amax);

  PrecisionPolicy policy_;
  ParamStore* store_;
  Gemm gemm_;
  std::vector<Gemm> head_gemms_;
  Arena acts_;
  std::vector<std::vector<float>> scratch_;
  std::vector<float> weights_f32_;  // decoded model copy (empty when the model copy is fp32)
  std::vector<float> grad_acc_;     // fp32 accumulator (only when weight grads are low precision)
  ModelHistograms* hist_ = nullptr;
  bool native_ = false;
  std::size_t fault_act_ = kNoFault, fault_label_ = kNoFault;
};


// Whether Engine::run_stages fuses its passes (true, the default) or runs the unfused
// sequence it is defined by; process-wide, for the tests that compare the two.
void set_fused_passes(bool on) noexcept;
bool fused_passes() noexcept;

// Checks a forward call's token spans: rows in [1, batch], both spans at least rows*T
// long, every id < V. std::invalid_argument naming `fn` otherwise.
void check_batch(const char* fn, std::span<const TokenId> inputs, std::span<const TokenId> targets, std::size_t rows,
                 std::size_t batch, std::size_t T, std::size_t V);
std::string group_thousands(std::size_t n);  // 1234567 -> "1,234,567"

// GPT-2 style initialisation helpers (deterministic).
void init_normal(std::span<float> w, float stddev, std::uint64_t seed, std::uint64_t stream);
void init_constant(std::span<float> w, float value);

}  // namespace mixprec::nn::detail

// The scale rules of the low-precision recipes, with the exact rules of NVIDIA Transformer
// Engine (TE): the element formats, delayed scaling (amax history), current (just-in-time)
// scaling and MX block scaling (one E8M0 scale per 32 values); lowp::quantize applies them. docs/fp8.md gives every rule, where it
// comes from, and the decisions taken where the sources are silent.
//
// Scale convention (TE's): quantize stores encode(x * scale), dequantize returns
// decode(code) * scale_inv with scale_inv = 1 / scale (one fp32 division).
//
// The scale functions here are pure and constexpr-friendly; DelayedScaling
// holds per-tensor state (amax history, scale, scale_inv) that saves to and
// loads from JSON text (nlohmann stays private to the library).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mixprec/formats/types.hpp"

namespace mixprec::lowp {

// The two element formats and their largest finite values (448, 57344).
// Element formats: FP8 E4M3 / E5M2 (one byte per element) and FP4 E2M1 (two per byte,
// the first element in the low nibble).
enum class Element : std::uint8_t { e4m3, e5m2, e2m1 };
// The largest finite value: the format table's for the FP8 formats (448, 57344); E2M1's
// (6) is the largest of its eight magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
constexpr float max_finite(Element e) noexcept {
  return e == Element::e4m3   ? format_traits<f8e4m3>::max_finite
         : e == Element::e5m2 ? format_traits<f8e5m2>::max_finite
                              : 6.0f;
}
// The exponent of the format's largest power of two (OCP's emax_elem): 8, 15, 2.
constexpr int max_exponent(Element e) noexcept { return e == Element::e4m3 ? 8 : e == Element::e5m2 ? 15 : 2; }
std::string_view element_label(Element e) noexcept;  // "E4M3", "E5M2", "E2M1" (the run log's dtype)

// TE's recipe.Format: E4M3 everywhere, or HYBRID (E4M3 forward tensors, E5M2 gradients).
enum class Format : std::uint8_t { e4m3, hybrid };
// Which pass a tensor belongs to: forward (inputs, weights, activations) or backward (gradients).
enum class Role : std::uint8_t { forward, backward };
constexpr Element dtype_for(Format f, Role r) noexcept {
  return f == Format::hybrid && r == Role::backward ? Element::e5m2 : Element::e4m3;
}
std::string_view format_name(Format f) noexcept;  // "E4M3", "HYBRID" (TE's names; the fp8 state)
std::string_view format_key(Format f) noexcept;   // "e4m3", "hybrid" (configs, recipe files)
// The one reader of a format's name: either spelling of either.
std::optional<Format> parse_format(std::string_view s) noexcept;
std::string_view role_name(Role r) noexcept;      // "forward", "backward"

// ---- Delayed scaling ---------------------------------------------------------

enum class AmaxAlgo : std::uint8_t { max, most_recent };
std::string_view amax_algo_name(AmaxAlgo a) noexcept;  // "max", "most_recent"
std::optional<AmaxAlgo> parse_amax_algo(std::string_view s) noexcept;

struct DelayedScalingConfig {
  int margin = 0;                        // scale = (fp8_max * 2^-margin) / amax; |margin| <= 64
  std::size_t amax_history_len = 1024;   // >= 1
  AmaxAlgo amax_compute_algo = AmaxAlgo::max;
  Format format = Format::hybrid;
  friend bool operator==(const DelayedScalingConfig&, const DelayedScalingConfig&) = default;
};
// Throws std::invalid_argument naming the field.
void validate(const DelayedScalingConfig& config);

// TE's delayed-scaling scale update for one tensor, given the amax the algorithm picked:
//   scaled_max = fp8_max * 2^-margin (exact); scale = scaled_max / amax (one fp32 division)
//   when amax is finite and > 0, else the previous scale; an infinite result becomes FLT_MAX.
float delayed_scale(float amax, float previous_scale, float fp8_max, int margin) noexcept;

// What record_amax writes into a history slot: the max of the two, where a NaN stays NaN
// (the slot remembers a NaN step).
float fold_amax(float slot, float amax) noexcept;

// One step of TE's history roll on history h (h[0] is the slot the current step's amax was
// recorded in): returns the amax the algorithm uses and rolls h in place:
//   a_i = h[i+1] for i < L-1, a_{L-1} = h[0];  h'[0] = 0, h'[i] = a_i (i > 0)
//   max: fmax over all a_i starting from 0 (NaN entries are ignored, as CUDA fmaxf does)
//   most_recent: h[0] (NaN or inf there keeps the previous scale).
float roll_history(std::span<float> history, AmaxAlgo algo) noexcept;

// The state of one tensor under delayed scaling.
struct DelayedTensorState {
  std::string name;
  Role role = Role::forward;
  std::vector<float> amax_history;  // TE layout: [0] = this step's slot, length amax_history_len
  float scale = 1.0f;
  float scale_inv = 1.0f;
  friend bool operator==(const DelayedTensorState& a, const DelayedTensorState& b) noexcept;
};

struct DelayedScalingState {
  DelayedScalingConfig config;
  std::vector<DelayedTensorState> tensors;

  // {"format":"mixprec.fp8_delayed_scaling","version":1,"config":{...},"tensors":[...]}.
  // Floats are written so that they read back bit for bit; inf and NaN as "inf" and "nan".
  std::string to_json() const;
  // Validates everything and throws std::invalid_argument naming the field.
  static DelayedScalingState from_json(std::string_view json);
  friend bool operator==(const DelayedScalingState&, const DelayedScalingState&) = default;
};
void validate(const DelayedScalingState& state);

// Per-tensor delayed scaling: quantize with scale(i) during the step, record each tensor's
// amax (record_amax), then call update() once per step (after any all-reduce of the amaxes
// with MAX across ranks, which the caller does on the current slots).
class DelayedScaling {
 public:
  explicit DelayedScaling(const DelayedScalingConfig& config = {});
  std::size_t add_tensor(std::string name, Role role);  // scale 1, history all zeros
  std::size_t size() const noexcept { return state_.tensors.size(); }

  // Folds amax into the current slot: max with what is there; a NaN stays NaN.
  // amax must be >= 0, +inf or NaN (std::invalid_argument otherwise, or for a bad index).
  void record_amax(std::size_t tensor, float amax);
  // The current slots (h[0]) of all tensors, e.g. for an all-reduce with MAX.
  std::vector<float> current_amaxes() const;
  void set_current_amaxes(std::span<const float> amaxes);  // one per tensor, validated as record_amax

  void update();  // rolls every history and updates every scale and scale_inv

  Element dtype(std::size_t tensor) const;
  float scale(std::size_t tensor) const { return at(tensor).scale; }
  float scale_inv(std::size_t tensor) const { return at(tensor).scale_inv; }
  std::span<const float> amax_history(std::size_t tensor) const { return at(tensor).amax_history; }
  const DelayedScalingConfig& config() const noexcept { return state_.config; }

  const DelayedScalingState& state() const noexcept { return state_; }
  void load(const DelayedScalingState& state);  // validates first; unchanged on error
  std::string to_json() const { return state_.to_json(); }
  void load_json(std::string_view json) { load(DelayedScalingState::from_json(json)); }

 private:
  const DelayedTensorState& at(std::size_t tensor) const;
  DelayedScalingState state_;
};

// ---- Current (just-in-time) scaling -------------------------------------------

struct CurrentScalingConfig {
  Format format = Format::hybrid;
  bool power_of_2_scales = false;
  float amax_epsilon = 0.0f;  // amax below it is raised to it; finite, >= 0
  friend bool operator==(const CurrentScalingConfig&, const CurrentScalingConfig&) = default;
};
void validate(const CurrentScalingConfig& config);

// TE's compute_scale_from_amax: amax < epsilon -> epsilon; amax inf or 0 -> 1;
// scale = fp8_max / amax (fp32); inf -> FLT_MAX; NaN -> 1; power of two: the fp32
// exponent bits only (mantissa cleared, i.e. rounded down to a power of two).
// value_for_inf replaces an infinite fp8_max / amax (TE's newer signature: the input
// dtype's largest finite; FLT_MAX by default, as TE's current scaling). Inline: block
// recipes take one per 128 values.
inline float current_scale(float amax, float fp8_max, bool power_of_2_scales, float epsilon,
                           float value_for_inf = 0x1.fffffep127f) noexcept {
  if (amax < epsilon) amax = epsilon;  // NaN compares false and stays NaN
  const std::uint32_t abits = std::bit_cast<std::uint32_t>(amax) & 0x7fffffffu;
  if (abits == 0x7f800000u || abits == 0) return 1.0f;  // inf or 0
  float scale = fp8_max / amax;
  const std::uint32_t sbits = std::bit_cast<std::uint32_t>(scale) & 0x7fffffffu;
  if (sbits == 0x7f800000u) scale = value_for_inf;
  if (sbits > 0x7f800000u) scale = 1.0f;  // NaN
  if (power_of_2_scales) scale = std::bit_cast<float>(std::bit_cast<std::uint32_t>(scale) & 0xFF800000u);
  return scale;
}

// ---- MX block scaling -----------------------------------------------------------

inline constexpr std::size_t kMxBlock = 32;

// The MX shared exponent: rounded up so that nothing saturates (TE float_to_e8m0, cuBLAS,
// torchao RCEIL), or floor(log2(amax)) - emax of the element format, clamped to >= -127 (the
// OCP MX specification, torchao FLOOR). Both casts saturate.
enum class ScaleRounding : std::uint8_t { rceil, floor };

// The block scale from a block's amax (what the two rules compute; see docs/fp8.md):
//   TE:  amax is the NaN-ignoring max |x| of the block; NaN -> 0xFF, inf -> 0xFE, 0 -> 0x00,
//        else the fp32 exponent of amax * float(1/fp8_max), plus one when any mantissa bit is
//        set (not past 0xFE; fp32 subnormals at or below 2^-127 give 0x00).
//   OCP: amax is NaN when the block holds a NaN; NaN or inf -> 0xFF (NaN scale); 0 reads as
//        2^-126; e = floor(log2(amax)) - emax_elem (8 for E4M3, 15 for E5M2), at least -127.
e8m0 mx_scale(float amax, Element element, ScaleRounding rounding) noexcept;
// The same rules for any element format given its largest finite (TE: max_norm_rcp =
// float(1 / elem_max)) and the exponent of its largest power of two (OCP: emax_elem);
// MXFP4 (E2M1) uses 6 and 2.
e8m0 mx_scale(float amax, float elem_max, int emax_elem, ScaleRounding rounding) noexcept;

// The factor elements are multiplied by before the saturating cast:
//   TE:  its exp2f_rcp: 1 for code 0x00 (sic), else the bits (254 - code) << 23
//        (0 for 0xFE; a block with the NaN scale 0xFF is NaN throughout, see lowp::quantize);
//   OCP: 2^-e exactly (e in [-127, 119]).
float mx_quantize_factor(e8m0 scale, ScaleRounding rounding) noexcept;

// TE's Quantized_Limits<T>::max_norm_rcp: 1 / max_norm computed in double, stored as float.
inline float mx_max_norm_rcp(float elem_max) noexcept { return static_cast<float>(1.0 / static_cast<double>(elem_max)); }
// The TE rules above as inline code on raw bits, for the block loops (one scale per 32
// values): the E8M0 code of amax given max_norm_rcp, and the factor of a code (NaN for 0xFF).
inline std::uint8_t mx_scale_code_te(float amax, float max_norm_rcp) noexcept {
  const float v = amax * max_norm_rcp;
  const std::uint32_t u = std::bit_cast<std::uint32_t>(v) & 0x7fffffffu;
  if (u > 0x7f800000u) return 0xFF;  // NaN
  if (u == 0x7f800000u) return 0xFE;  // inf
  std::uint32_t exponent = u >> 23;
  const std::uint32_t mantissa = u & 0x7FFFFFu;
  if ((mantissa > 0 && exponent != 0xFE) && !(exponent == 0 && mantissa <= 0x400000u)) ++exponent;
  return static_cast<std::uint8_t>(exponent);  // 0 for v == 0
}
inline float mx_factor_te(std::uint8_t code) noexcept {
  if (code == 0) return 1.0f;  // TE exp2f_rcp(0) == 1
  if (code == 0xFF) return std::bit_cast<float>(0x7fc00000u);
  return std::bit_cast<float>((254u - code) << 23);
}

}  // namespace mixprec::lowp

// Step guards: the reasons a step is refused besides a loss scaler's overflow, decided by
// the one protocol (scaler/protocol.hpp) for every door (docs/spike_guards.md).
//
//   nonfinite_grad  a gradient held inf/NaN (under a loss scale: the overflow; the scale backs off)
//   nonfinite_loss  the step's loss was inf/NaN while its gradients were finite
//   loss_spike      the loss's z-score over the last `window` steps exceeds loss_z
//   grad_spike      the gradient norm's z-score exceeds grad_z
//   user            the door's predicate (skip_if) said so
//
// A guarded skip follows the skip semantics of an overflow exactly (nothing the optimizer
// owns is written; the step counter, schedule and EMA stay) except that the loss scale does
// not back off: only an overflow says the scale is too large.
//
// The z-score detector is llm.c's (llmc/outlier_detector.h, train_gpt2.cu's -sl/-sg): a
// window of the last `window` values in double precision with running sums; while the window
// fills the z-score is NaN (never a skip); then each new value is pushed first and
// z = (x - mean) / sqrt(sum_sq / n - mean^2) over the window that holds it (0 when the
// deviation is 0); the step is skipped when z, rounded to float, is finite and above the
// threshold (0: that guard off). Since the window holds the value, z <= sqrt(window - 1).
// Values that are inf/NaN are not pushed (one would poison the
// running sums for good; llm.c pushes them): such a step is skipped for being non-finite.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec {

enum class SkipReason : std::uint8_t { none, nonfinite_grad, nonfinite_loss, loss_spike, grad_spike, user };
inline constexpr std::size_t kSkipReasons = 6;
std::string_view skip_reason_name(SkipReason r) noexcept;  // "none", "nonfinite_grad", ...
// The names above, in that order (the run log's and the report's vocabulary).
const std::vector<std::string_view>& skip_reason_names();
std::optional<SkipReason> parse_skip_reason(std::string_view name) noexcept;

// llm.c's sliding-window z-score, window configurable (llm.c: 128).
class ZScoreDetector {
 public:
  explicit ZScoreDetector(int window = 128);
  int window() const noexcept { return window_; }
  int count() const noexcept { return count_; }
  // What push(x) would return, changing nothing.
  double peek(double x) const noexcept;
  // Pushes x (finite values only: others are ignored and give NaN) and returns its z-score.
  double push(double x) noexcept;

  // The exact state (values in window order of storage, index, running sums), for checkpoints.
  std::string to_json() const;
  static ZScoreDetector from_json(std::string_view json, std::string_view where);

 private:
  int window_;
  int count_ = 0;
  int index_ = 0;
  double sum_ = 0, sum_sq_ = 0;
  std::vector<double> buffer_;
};

// What a guard configuration holds (a struct with defaults; docs/spike_guards.md). Keys, as
// the engine's config and CLI and the Python door name them: skip_nonfinite, skip_loss_z,
// skip_grad_z, skip_window.
struct GuardConfig {
  // A disabled scaler checks gradients and skips on inf/NaN (always so in the mixprec
  // dialect; the torch dialect passes a disabled scaler through unless this is set).
  bool nonfinite = false;
  double loss_z = 0;  // > 0: skip when the loss's z-score exceeds it (llm.c -sl; 0 off)
  double grad_z = 0;  // > 0: skip when the gradient norm's z-score exceeds it (llm.c -sg; 0 off)
  int window = 128;   // steps in each detector's window (llm.c: 128)

  bool spikes() const noexcept { return loss_z > 0 || grad_z > 0; }
  bool any() const noexcept { return nonfinite || spikes(); }
  bool operator==(const GuardConfig&) const = default;
};
// Throws std::invalid_argument naming the key: z thresholds finite and >= 0, window in [2, 1e6],
// and each threshold that is on below sqrt(window - 1), the largest z-score a window that holds
// the value can give (window 128: 11.27).
void validate(const GuardConfig& c);
// That last rule alone, for one threshold z over a window, its keys named as the caller's
// config names them (the engine's flags: skip-loss-z, skip-window).
void check_guard_reach(double z, int window, std::string_view z_key, std::string_view window_key);
inline constexpr int kMaxGuardWindow = 1000000;  // skip_window's largest value
// One key ("skip_loss_z", ...) set from its text; std::invalid_argument for an unknown key or
// a value it does not allow. The config is unchanged on error.
void set(GuardConfig& c, std::string_view key, std::string_view value);
const std::vector<std::string_view>& guard_config_keys();
// The config as one JSON object of those keys, and back (every key required, unknown ones
// refused; std::invalid_argument prefixed by `where`).
std::string guard_config_json(const GuardConfig& c);
GuardConfig guard_config_from_json(std::string_view json, std::string_view where);

// What the guard saw in one step, for the door's outcome, its predicate and the run log.
struct GuardView {
  double loss = std::numeric_limits<double>::quiet_NaN();       // the step's loss (NaN: not given)
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // unscaled, before clipping
  double loss_z = std::numeric_limits<double>::quiet_NaN();     // NaN: window filling, or not given
  double grad_z = std::numeric_limits<double>::quiet_NaN();
};

}  // namespace mixprec

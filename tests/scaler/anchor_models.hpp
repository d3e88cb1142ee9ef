// Independent models of each anchor's loss-scale rule, transcribed line by line from the
// rules as docs/loss_scaling.md writes them out ("The rules as implemented"). They share no code
// with the library; the tests run both on the same overflow sequences and compare.
//
// Precision is the anchor's: torch keeps a float32 tensor and multiplies by a Python float
// (double) before rounding to float32; DeepSpeed and Apex use Python floats (double); Megatron
// keeps float32 tensors for scale, factors and min; Keras 3 and tf.keras a float32 variable; jmp a float32 array.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>

namespace mixprec::anchors {

// PyTorch torch.amp.GradScaler (_amp_update_scale_).
struct Torch {
  float scale;
  double growth_factor, backoff_factor;
  std::int32_t growth_interval;
  std::int32_t tracker = 0;

  void update(bool found_inf) {
    if (found_inf) {
      scale = static_cast<float>(static_cast<double>(scale) * backoff_factor);
      tracker = 0;
    } else {
      const std::int32_t t = tracker + 1;
      if (t == growth_interval) {
        const float n = static_cast<float>(static_cast<double>(scale) * growth_factor);
        if (std::isfinite(n)) scale = n;
        tracker = 0;
      } else {
        tracker = t;
      }
    }
  }
};

// mixprec's own preset: torch's rule, a floor, and an error after N overflows in a row at the floor.
struct MixprecModel {
  Torch torch;
  float min_scale;
  int max_floor_overflows;
  bool raise;
  int at_floor = 0;

  void update(bool found_inf) {
    if (found_inf) {
      if (torch.scale == min_scale) {
        if (raise && at_floor + 1 == max_floor_overflows) throw std::runtime_error("collapse");
        ++at_floor;
      } else {
        at_floor = 0;
      }
      torch.update(true);
      torch.scale = std::max(torch.scale, min_scale);
    } else {
      at_floor = 0;
      torch.update(false);
    }
  }
};

// DeepSpeed DynamicLossScaler (the fused FP16_Optimizer's window test, docs/loss_scaling.md).
struct DeepSpeed {
  double cur_scale;
  double scale_factor;
  std::int64_t scale_window;
  double min_scale;
  std::int64_t delayed_shift;
  bool consecutive_hysteresis;
  bool raise_error_at_min_scale;
  std::int64_t cur_hysteresis = delayed_shift;
  std::int64_t cur_iter = 0;
  std::int64_t last_overflow_iter = -1;

  void update_scale(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        if (cur_scale == min_scale && raise_error_at_min_scale)
          throw std::runtime_error("Current loss scale already at minimum - cannot decrease scale anymore.");
        cur_scale = std::max(cur_scale / scale_factor, min_scale);
      } else {
        cur_hysteresis -= 1;
      }
      last_overflow_iter = cur_iter;
    } else {
      if (consecutive_hysteresis) cur_hysteresis = delayed_shift;
      const std::int64_t stable = cur_iter - last_overflow_iter - 1;
      if (stable > 0 && stable % scale_window == 0) {
        if (!consecutive_hysteresis) cur_hysteresis = delayed_shift;
        cur_scale *= scale_factor;
      }
    }
    cur_iter += 1;
  }
};

// Megatron-LM DynamicGradScaler (float32 CUDA tensors).
struct Megatron {
  float scale;
  float min_scale, growth_factor, backoff_factor;
  std::int64_t growth_interval, hysteresis;
  std::int64_t growth_tracker = 0;
  std::int64_t hysteresis_tracker = hysteresis;

  void update(bool found_inf) {
    if (found_inf) {
      growth_tracker = 0;
      hysteresis_tracker -= 1;
      if (hysteresis_tracker <= 0) scale = std::max(scale * backoff_factor, min_scale);
    } else {
      growth_tracker += 1;
      if (growth_tracker == growth_interval) {
        growth_tracker = 0;
        hysteresis_tracker = hysteresis;
        scale = scale * growth_factor;
      }
    }
  }
};

// NVIDIA Apex amp LossScaler (Python floats); min_loss_scale 0 means none.
struct Apex {
  double loss_scale;
  double min_loss_scale, max_loss_scale;
  std::int64_t scale_seq_len;
  std::int64_t unskipped = 0;

  void update_scale(bool overflow) {
    if (overflow) {
      loss_scale = min_loss_scale != 0 ? std::max(min_loss_scale, loss_scale / 2.) : loss_scale / 2.;
      unskipped = 0;
    } else {
      unskipped += 1;
    }
    if (unskipped == scale_seq_len) {
      loss_scale = std::min(max_loss_scale, loss_scale * 2.);
      unskipped = 0;
    }
  }
};

// Keras 3 LossScaleOptimizer (keras/src/optimizers/loss_scale_optimizer.py, keras 3.15.1:
// _common_apply -> _stateful_handle_finite_grads / _stateful_handle_non_finite_grads):
// dynamic_scale a float32 variable (initial_scale 2^15), step_counter an int variable
// (dynamic_growth_steps 2000). Finite: if step_counter == dynamic_growth_steps - 1 then
// step_counter = 0, dynamic_scale = dynamic_scale * 2.0, else step_counter += 1. Non-finite:
// step_counter = 0, dynamic_scale = dynamic_scale * 0.5. No floor, no finite guard.
struct Keras3 {
  float dynamic_scale = 32768.0f;
  std::int64_t dynamic_growth_steps = 2000;
  std::int64_t step_counter = 0;

  void apply(bool finite) {
    if (finite) {
      if (step_counter == dynamic_growth_steps - 1) {
        step_counter = 0;
        dynamic_scale = dynamic_scale * 2.0f;
      } else {
        step_counter += 1;
      }
    } else {
      step_counter = 0;
      dynamic_scale = dynamic_scale * 0.5f;
    }
  }
};

// tf.keras / Keras 2 LossScaleOptimizer (float32 variable, multiplier 2, floor 1).
struct TfKeras {
  float current_loss_scale;
  std::int64_t growth_steps;
  std::int64_t counter = 0;

  void update(bool finite) {
    if (finite) {
      if (counter + 1 >= growth_steps) {
        const float n = current_loss_scale * 2.0f;
        if (std::isfinite(n)) current_loss_scale = n;
        counter = 0;
      } else {
        counter += 1;
      }
    } else {
      counter = 0;
      current_loss_scale = std::max(current_loss_scale / 2.0f, 1.0f);
    }
  }
};

// JAX jmp DynamicLossScale (float32 array, int32 counter).
struct Jmp {
  float loss_scale;
  std::int32_t period;
  float factor;
  float min_loss_scale;
  std::int32_t counter = 0;

  void adjust(bool grads_finite) {
    const float grown = loss_scale * factor;
    const float next = grads_finite ? ((counter == period - 1 && std::isfinite(grown)) ? grown : loss_scale)
                                    : std::max(min_loss_scale, loss_scale / factor);
    counter = grads_finite ? (counter + 1) % period : 0;
    loss_scale = next;
  }
};

}  // namespace mixprec::anchors

// mixprec: mixed-precision training toolkit. Umbrella header for the public API.
#pragma once

#include "mixprec/core/dtype.hpp"
#include "mixprec/core/parallel.hpp"
#include "mixprec/dispatch.hpp"
#include "mixprec/formats/bulk.hpp"
#include "mixprec/formats/scalar.hpp"
#include "mixprec/formats/types.hpp"
#include "mixprec/kernels/unscale.hpp"
#include "mixprec/optim/clip.hpp"
#include "mixprec/optim/memory.hpp"
#include "mixprec/optim/optimizer.hpp"
#include "mixprec/optim/param_store.hpp"
#include "mixprec/optim/schedule.hpp"
#include "mixprec/scaler/grad_scaler.hpp"
#include "mixprec/scaler/loss_scale.hpp"
#include "mixprec/version.hpp"

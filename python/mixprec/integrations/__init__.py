"""mixprec where PyTorch users train (docs/python.md, "Where PyTorch users train").

    mixprec.integrations.transformers   MixprecCallback for the Hugging Face Trainer
    mixprec.integrations.accelerate     MixprecAccelerate for a plain Accelerate loop; install_scaler
    mixprec.integrations.lightning      MixprecCallback for Lightning (the scaler goes into
                                        Lightning's own MixedPrecision plugin)

Each puts mixprec.torch.GradScaler where the library keeps its torch.amp.GradScaler, attaches
mixprec.torch.Telemetry to the model, records every optimizer step with the scaler's outcome
(applied or skipped, the parameter that overflowed, the scale) into a run folder, numbered as the
training numbers its steps (a resumed run continues them), shows the skips and the scale in the
library's own logs, holds the LR schedule on a skipped step, and closes the folder at the end
(its report's path printed). Importing this package imports none of those libraries; each module imports its
own (ImportError naming the package and the extra to install when it is missing).
"""

__all__ = ["accelerate", "lightning", "transformers"]

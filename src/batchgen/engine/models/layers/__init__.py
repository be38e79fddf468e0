"""The layers every model family is built from, each defined once.

norm.py (RMSNorm), rotary.py (rotary tables and their scaling variants), mlp.py (the gated MLP),
attention.py (q/k/v projection, optional q/k norms, rope, the attention backend's call),
decoder.py (the pre-norm decoder block and the decoder stack: embedding, blocks, final norm, HF
checkpoint names), post_norm_decoder.py (the block with its norms after attention and MLP: OLMo 2),
sandwich_norm_decoder.py (the pre-norm block with its attention and MLP outputs normed too: GLM-4)
and causal_lm.py (the stack with an lm_head: the class a family file subclasses).
The elementwise math behind them is ../ops.py (eager, torch.compile or the C kernels). Import
these modules directly: this package's __init__ re-exports nothing.
"""

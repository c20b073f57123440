"""cachelife's own kernels for the decoding step: attention for one query over a static cache, split over the
cached positions (`attention`); a linear layer's product for a few rows, and a torch function mode that sends a
step's products to it (`linear`); what the Triton kernels share (`triton_support`).

Nothing here knows a model, `generate` or the cache lifecycle: it acts on tensors alone. What changes a model's
modules to call these kernels lives in `cachelife.model_rewrites`.
"""

"""The decoding step's kernels: model rewrites that cut the kernels of a step (`fusion`: the projections of a
layer fused into one matrix product, reversibly) and kernels of cachelife's own (`attention`: attention for
one query over a static cache, split over the cached positions; `attention_implementation`: that kernel as
a transformers attention implementation; `linear`: a linear layer's product for a few rows, and a torch
function mode that sends a region's products to it; `triton_support`: what the Triton kernels share).

Nothing here knows `generate` or the cache lifecycle: it acts on a model's modules and on tensors alone, and
the integration layer decides when to apply it.
"""

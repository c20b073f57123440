"""Model rewrites: reversible changes to a model's modules or configs that make its decoding step cheaper, or
let the engine's rows decode it. Each returns an object whose `restore()` puts the model back as it was: the
projections of a layer fused into one matrix product (`fused_projections`); cachelife's decode attention kernel
as the model's attention implementation (`decode_attention`); the layers of a stack of identical layers marked
as compile regions (`layer_regions`); a decoder's position table read at each row's own position
(`row_positions`).

Nothing here knows `generate` or the cache lifecycle: the integration layer and the engine decide when to apply
a rewrite.
"""

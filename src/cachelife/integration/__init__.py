"""The transformers integration: what `cachelife.enable` installs on a model (`enabling`, `guard`), the model's
runtime state and its one owner (`runtime`), how `generate`'s arguments are read (`call_arguments`), compiled
forwards and their cache directory (`compiled`, `compile_cache`, `warm_start`), encoder buckets (`buckets`)
and torch's CUDA-graph skip reports (`skips`).
"""

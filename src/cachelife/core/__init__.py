"""The lifecycle core: one layer cache's states (`layer_lifecycle`), a whole cache's (`cache_lifecycle`), the
storage they manage (`buffers`, `reorder`), the shapes and devices caches are built for (`shapes`,
`placement`, `fit`), pinned caches for a model (`pinning`) and the pool of idle pinned buffers (`pool`).

Nothing here knows `generate`: it acts on transformers' cache objects alone.
"""

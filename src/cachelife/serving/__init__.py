"""Serving many requests on one model: the engine (`engine`) batches concurrent requests into the rows of one
pinned batch (`batch`, `rows`), each row with a lifecycle of its own (`slots`) and a place in the cache
(`window`); `requests` is a request's side. `ray_serve` deploys engines behind HTTP endpoints (`openai_api`)."""
